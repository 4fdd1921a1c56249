"""What the two training scripts stand on, in layers: each folder imports only the folders below it.

    core/run/     the run's lifecycle and processes: flags, the parallel layout, the machine, ranks, stops, files,
                  checkpoints, the step's watches (imports nothing of core)
    core/gpt/     GPT-2 and its parallelisms: the model, one builder per strategy, the text corpus, the export
    core/lenet/   LeNet-5's support: its figures, its CPU speed work (padded channels, the precision probe)
    core/plan/    the plan and its measurements: memory, time and traffic of any strategy on any cluster, this CPU
                  measured, a GPT run's figures beside the plan

tests/test_layout.py holds these rules.
"""
