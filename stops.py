"""Clean stops: a signal ends the run at the next step boundary with a checkpoint, and in a SLURM job asked to
requeue, the job is requeued so that it continues from it."""

import os
import shutil
import signal
import subprocess
import sys

from ranks import any_rank


class StopRequest:
    """SIGINT/SIGTERM set a flag; the loop stops at the next step boundary after saving. A second
    signal of the same kind falls back to the default behaviour, so a stuck run can still be killed.

    In a SLURM job, `requeue_signal` (SIGUSR1 unless set: what `#SBATCH --signal=USR1@90` sends before the time
    limit or a preemption) stops the same way, and then rank 0 requeues the job (Run.stopped). Outside SLURM that
    signal is ignored with one line: its default action would kill the run unsaved."""

    def __init__(self, requeue_signal: str = "USR1"):
        self.requeue_signal = None if requeue_signal == "none" else getattr(signal, "SIG" + requeue_signal)

    def __enter__(self):
        self.signal_name, self.requeue = None, False
        self.previous = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGINT, signal.SIGTERM)}
        if self.requeue_signal is not None:
            self.previous[self.requeue_signal] = signal.signal(self.requeue_signal, self._handle_requeue)
        return self

    def __exit__(self, *exc):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame):
        self.signal_name = signal.Signals(signum).name
        signal.signal(signum, signal.SIG_DFL if signum == signal.SIGTERM else signal.default_int_handler)

    def _handle_requeue(self, signum, frame):
        name = signal.Signals(signum).name
        if not os.environ.get("SLURM_JOB_ID"):
            print(f"warning: {name} ignored: it asks a SLURM job to save, requeue itself and exit, and this process is "
                  f"not in one (SLURM_JOB_ID is not set)", file=sys.stderr, flush=True)
            return
        self.signal_name, self.requeue = name, True

    def requested(self, fabric, *other_flags: bool) -> tuple[bool, ...]:
        """(any rank signalled, *any rank's other_flags), agreed by all ranks in one small all-reduce; a requeue
        asked on any rank is a requeue on all."""
        stopping, requeue, *others = any_rank(fabric, self.signal_name is not None, self.requeue, *other_flags)
        if requeue and not self.requeue:
            self.signal_name, self.requeue = signal.Signals(self.requeue_signal).name, True
        if stopping and self.signal_name is None:
            self.signal_name = "SIGINT"  # another rank was signalled; it is the same stop for this one
        return (stopping, *others)


class Stopped(Exception):
    """Raised by train() after a clean stop has been saved; the exit code follows the shell's convention, except for
    a SLURM requeue, which is not a failure (0)."""

    def __init__(self, signal_name: str, requeued: bool = False):
        super().__init__(signal_name)
        self.exit_code = 0 if requeued else 128 + int(getattr(signal, signal_name, signal.SIGINT))


def slurm_job_id() -> str:
    """The id `scontrol requeue` takes: <array job>_<task> for a task of a job array, else the job's."""
    array, task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    return f"{array}_{task}" if array and task else os.environ["SLURM_JOB_ID"]


def requeue_slurm_job(resume: str) -> str:
    """`scontrol requeue <job>` (as Lightning's SLURMEnvironment does on SIGUSR1), and what happened, in one line.
    Where scontrol is missing or refuses (a container, a cluster that forbids it) the checkpoint is saved all the
    same: the line says how to requeue by hand."""
    job = slurm_job_id()
    by_hand = f"requeue it by hand with `scontrol requeue {job}`, or submit the job again: {resume}"
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        return f"scontrol is not on PATH here, so SLURM job {job} was not requeued; {by_hand}"
    try:
        proc = subprocess.run([scontrol, "requeue", job], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as e:
        return f"`scontrol requeue {job}` could not run ({e}); {by_hand}"
    if proc.returncode != 0:
        why = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
        return f"`scontrol requeue {job}` failed ({why}); {by_hand}"
    return f"requeued SLURM job {job}: when it runs again it continues from this checkpoint ({resume})"
