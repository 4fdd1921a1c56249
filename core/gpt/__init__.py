"""GPT-2 and its parallelisms: the model, the strategies that spread it over processes, its text and its export."""
