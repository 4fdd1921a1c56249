"""`python tests/fill_at.py SCRIPT ARGS...`: run SCRIPT (fabric_gpt.py, fabric_lenet.py) as `python SCRIPT ARGS...`
would, while rank 0 takes every free byte of the file system at $FILL_DISK at one moment of the run, as another
program writing there would: $FILL_AT is `<moment>:<n>`. What the run then meets is real (a real tmpfs, the errors the
libraries raise on it); only the moment is chosen. Fabric starts the other ranks with this same command line, so
every rank knows it. A file system hands out whole pages: at `console` and `log`, the file written next is first
taken to its page's end (a line of dots, padding scalars), so that its next write needs room the disk no longer has.

    step:N   after optimizer step N, before its check point                         (between steps)
    console:N  the same, stdout being a file on that disk, its last page full         (a print)
    log:N    as TensorBoard is given the metrics of step N, its file's page full    (while logging)
    save:N   as step N's checkpoint is written, its room checked: every rank writes (during a save)
    eval:N   during the N-th evaluation of this process                             (during an evaluation)
    swap:N   as ZeRO-Infinity swaps optimizer state out for the N-th time here      (during the NVMe swap: 1 writes
             the float32 partition as the model is set up, 3 the moments at step 1, then one a step)
"""

import importlib
import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository, as `python SCRIPT` has it

MOMENT, _, AT = os.environ["FILL_AT"].partition(":")
AT = int(AT)
calls = {"n": 0}


def rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def fill() -> None:
    """Every free byte of $FILL_DISK, written by rank 0 into `filler` (the test removes it to give the room back)."""
    if rank() != 0:
        return
    disk = Path(os.environ["FILL_DISK"])
    with open(disk / "filler", "ab") as f:
        while (free := shutil.disk_usage(disk).free) > 0:
            try:
                f.write(b"\0" * min(free, 1 << 20))
                f.flush()
            except OSError:
                break


def to_the_page_end(output) -> None:
    """A file system hands out pages (4 KiB on a tmpfs): write to `output` (stdout, or TensorBoard's SummaryWriter)
    until its file ends within a few bytes of a page's end, so that the run's next write there needs a new page."""
    if rank() != 0:
        return
    if output is sys.stdout:
        size = os.fstat(1).st_size
        print("." * ((-size - 1) % 4096), flush=True)  # with its newline, up to the page's end exactly
        return
    output.flush()
    events = max(Path(output.log_dir).glob("events.out.tfevents.*"), key=lambda p: p.stat().st_mtime)
    while -events.stat().st_size % 4096 > 80:  # each scalar about 50 bytes; a step's metrics 250
        output.add_scalar("fill/pad", 0.0, 0)
        output.flush()


def at_the_nth_call(function):
    """`function`, filling the disk before its AT-th call in this process."""
    def counted(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == AT:
            fill()
        return function(*args, **kwargs)
    return counted


def patch(script) -> None:
    if MOMENT == "step" and script.__name__ == "fabric_lenet":  # check_point(run, ...) after the step's count
        check_point = script.check_point
        script.check_point = lambda run, *a: (run.state["progress"].global_step == AT and fill(),
                                              check_point(run, *a))[1]
    elif MOMENT == "step":  # take_step(run, ...) before the run's progress counts it
        strategy_steps = script.steps_of_the_strategy

        def steps(*args):
            take_step, evaluate_now = strategy_steps(*args)
            return (lambda run, *a: (take_step(run, *a), run.state["progress"].step + 1 == AT and fill())[0]), \
                evaluate_now
        script.steps_of_the_strategy = steps
    elif MOMENT == "console":  # stdout is a file on the disk (the test's): its page ends, then the disk fills
        strategy_steps = script.steps_of_the_strategy

        def steps(*args):
            take_step, evaluate_now = strategy_steps(*args)
            return (lambda run, *a: (take_step(run, *a), run.state["progress"].step + 1 == AT and
                                     (to_the_page_end(sys.stdout), fill()))[0]), evaluate_now
        script.steps_of_the_strategy = steps
    elif MOMENT == "log":  # the events file's page ends, then the disk fills: these metrics need a new page
        from lightning.fabric.loggers import TensorBoardLogger

        log = TensorBoardLogger.log_metrics

        def log_metrics(self, metrics, step=None):
            if step == AT:
                to_the_page_end(self.experiment)
                fill()
            return log(self, metrics, step)
        TensorBoardLogger.log_metrics = log_metrics
    elif MOMENT == "save":
        from core.run.checkpoints import Checkpoints, step_of

        write = Checkpoints._write

        def save(self, fabric, path, state):
            if step_of(path.parent.with_name(path.parent.name.removesuffix(".partial"))) == AT:
                fabric.barrier()  # every rank has its room checked and is about to write
                fill()
                fabric.barrier()
            return write(self, fabric, path, state)
        Checkpoints._write = save
    elif MOMENT == "eval":
        script.evaluate = at_the_nth_call(script.evaluate)
    elif MOMENT == "swap":
        from deepspeed.runtime.swap_tensor import optimizer_utils, partitioned_optimizer_swapper, pipelined_optimizer_swapper

        # the first writes each file (the float32 partition as the model is set up; the moments at step 1)
        optimizer_utils.OptimizerSwapper._initialize_parameters = at_the_nth_call(
            optimizer_utils.OptimizerSwapper._initialize_parameters)
        for swapper in (partitioned_optimizer_swapper.PartitionedOptimizerSwapper,
                        pipelined_optimizer_swapper.PipelinedOptimizerSwapper):
            swapper.swap_out_optimizer_state = at_the_nth_call(swapper.swap_out_optimizer_state)
    else:
        raise SystemExit(f"FILL_AT={os.environ['FILL_AT']}: no such moment (step, log, save, eval, swap)")


if __name__ == "__main__":
    script = importlib.import_module(Path(sys.argv[1]).stem)
    patch(script)
    from core.run.lifecycle import exit_without_teardown

    with exit_without_teardown():  # as the script's own __main__
        script.main(sys.argv[2:])  # sys.argv stays this command: Fabric starts the other ranks with it
