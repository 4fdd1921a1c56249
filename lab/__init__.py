"""The lab's own tools, each run with `python -m` from the repository's root (or its make target):

    python -m lab                     # make lab: every stage, from the MNIST files to report/REPORT.md
    python -m lab.bench lenet|gpt|text  # make bench-lenet, bench-gpt, bench-text
    python -m lab.report              # make report
    python -m lab.gpu_check           # make gpu-check
    python -m lab.sample --run-name R # make sample RUN=R
    python -m lab.nanogpt_reference   # nanoGPT's loop, which `bench text` races
"""
