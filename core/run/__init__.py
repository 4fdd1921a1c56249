"""The run's lifecycle and processes: what both training scripts share, from the flags to the record."""
