"""LeNet-5's support: the figures of a run, and its speed work on CPUs."""
