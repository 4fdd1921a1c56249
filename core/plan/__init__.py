"""The plan and its measurements: what a GPT run will need and take, and what it measured beside that."""
