"""Clean stops: a signal ends the run at the next step boundary with a checkpoint, and in a SLURM job asked to
requeue, the job is requeued so that it continues from it.

What each signal does (the handlers cover the whole run, from set-up to the record and --export):

    SIGINT (Ctrl-C)       save at the next step boundary, exit 130; a second Ctrl-C stops at once, in one line (the
                          last complete checkpoint stays: every save is atomic)
    SIGTERM               save at the next step boundary, exit 143 (SLURM's preemption and time limit send it, then
                          SIGKILL after the grace time); further SIGTERMs are ignored: launchers forward it (make,
                          torchrun's agent), so a process often gets two, and the second must not cut the save
    SIGUSR1 (--requeue-signal, or USR2)
                          in a SLURM job (#SBATCH --signal=USR1@90): save, `scontrol requeue` the job (rank 0), exit 0;
                          where scontrol is missing or refuses, exit 128 + the signal, so that SLURM does not record
                          the job COMPLETED. Outside SLURM: ignored with one line (its default action kills unsaved).

Each signal is acknowledged at once, in one line on stderr ("[rank: N] " before it once the ranks are a group). A
signal that arrives while the run evaluates or saves is acted on as soon as that ends: the checkpoint just written is
the stop's, with no further step. One that arrives after the last step lets the record and export finish. The ranks
Fabric starts hold these signals from their start until they listen (ranks.launch): a Ctrl-C while one still imports
stops the run at its first step boundary too.
"""

import io
import os
import shutil
import signal
import subprocess
import sys

from core.run import full_disk
from core.run.ranks import STOP_SIGNALS, any_rank


class StopRequest:
    """The run's signal handlers: `listen(requeue_signal)` installs them (lifecycle.exits restores the previous ones
    when the run ends); `requested()` says at a step boundary whether any rank was signalled."""

    def __init__(self):
        self.signal_name, self.requeue, self.repeats, self.previous = None, False, 0, {}
        self.requeue_signal, self.pid, self.heard = None, None, False  # heard: a signal reached this process

    def listen(self, requeue_signal: str = "USR1") -> "StopRequest":
        self.requeue_signal = None if requeue_signal == "none" else getattr(signal, "SIG" + requeue_signal)
        self.pid = os.getpid()
        whole_lines()
        for sig in (signal.SIGINT, signal.SIGTERM, self.requeue_signal):
            if sig is not None and sig not in self.previous:
                self.previous[sig] = signal.signal(sig, self._handle)
        # a rank that Fabric started was born holding them (ranks.launch): what came while it imported is taken now
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
        return self

    def close(self) -> None:
        if self.signal_name is not None:  # this process ends on that signal: a repeat during its exit (a launcher
            return  # forwarding it again) stays ignored, where the default action would end it by that signal
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous = {}

    def _handle(self, signum, frame):
        if os.getpid() != self.pid:  # a process forked from the rank (a DataLoader worker) shares its group and so
            return  # its signals, and its copy of this handler: the rank stops the run, the worker with it
        name = signal.Signals(signum).name
        # already stopping on a signal of its own; a stop begun by another rank (requested()) can reach this rank
        # before the signal sent to it does, which is then its first, not a repeat (one Ctrl-C must not stop it at once)
        if self.signal_name is not None and self.heard:
            if signum == signal.SIGINT:  # a person pressing Ctrl-C again: stop now
                raise StoppedAtOnce
            self.repeats += 1
            if self.repeats == 1:
                say(f"{name} received again: ignored, the stop for {self.signal_name} is under way "
                    "(SIGKILL ends the process at once)")
            return
        if signum == self.requeue_signal:
            if not os.environ.get("SLURM_JOB_ID"):
                say(f"warning: {name} ignored: it asks a SLURM job to save, requeue itself and exit, and this process "
                    "is not in one (SLURM_JOB_ID is not set)")
                return
            self.requeue = True
        self.heard, self.signal_name = True, self.signal_name or name  # another rank's stop keeps its name (exit code)
        then = "a requeue of the SLURM job" if self.requeue else "exit"
        again = " (Ctrl-C again stops at once)" if signum == signal.SIGINT else ""
        say(f"{name} received: stopping at the next step boundary with a checkpoint, then {then}{again}")

    def requested(self, fabric, *other_flags: bool) -> tuple[bool, ...]:
        """(any rank signalled, *any rank's other_flags), agreed by all ranks in one small all-reduce; a requeue
        asked on any rank is a requeue on all. A full disk noted on any rank since (full_disk.py) stops every rank
        here, with one message."""
        stopping, requeue, full, *others = any_rank(fabric, self.signal_name is not None, self.requeue,
                                                    full_disk.noted() is not None, *other_flags)
        full_disk.stop_if_noted(fabric, full)
        if requeue and not self.requeue:
            self.signal_name, self.requeue = signal.Signals(self.requeue_signal).name, True
        if stopping and self.signal_name is None:
            self.signal_name = "SIGINT"  # another rank was signalled; it is the same stop for this one
        return (stopping, *others)


def whole_lines() -> None:
    """Under `python -u` or PYTHONUNBUFFERED (SLURM job scripts and the tests set it) print writes its text and its
    newline as two writes, and a handler's line (say) between them lands mid-line, in the line before. Line-buffered,
    a stream writes each line whole and still at once."""
    for stream in (getattr(s, "wrapped", s) for s in (sys.stdout, sys.stderr)):  # under outputs.Console
        if isinstance(stream, io.TextIOWrapper) and stream.write_through:
            try:
                stream.reconfigure(write_through=False, line_buffering=True)
            except (OSError, ValueError):  # closed, or a stream that cannot change now
                pass


def say(line: str) -> None:
    """One line to stderr from a signal handler (print's buffered stream may be mid-write in the main thread). A
    launcher or a terminal signals every rank: once the ranks are a process group, each line names its rank as
    Lightning's do ("[rank: 1] ..."), so that N lines read as N ranks, not as one signal said N times."""
    import torch.distributed as dist  # imported long before any signal: torch is

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        line = f"[rank: {dist.get_rank()}] {line}"
    try:
        os.write(sys.stderr.fileno(), (line + "\n").encode())
    except io.UnsupportedOperation:  # a stream without a descriptor (main() called in a notebook, or a test's capture)
        sys.stderr.write(line + "\n")
    except OSError:
        pass


class StoppedAtOnce(KeyboardInterrupt):
    """A second Ctrl-C: the run ends where it is, without a save (lifecycle.exits says so in one line); a save it
    cuts short stays a `.partial` folder, which no resume reads."""


class Stopped(Exception):
    """Raised after a clean stop has been saved; the exit code follows the shell's convention (128 + the signal),
    except for a SLURM job requeued, which is not a failure (0)."""

    def __init__(self, signal_name: str, requeued: bool = False):
        super().__init__(signal_name)
        self.exit_code = 0 if requeued else 128 + int(getattr(signal, signal_name, signal.SIGINT))


def slurm_job_id() -> str:
    """The id `scontrol requeue` takes: <array job>_<task> for a task of a job array, else the job's (Lightning's
    signal connector builds it the same way)."""
    array, task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    return f"{array}_{task}" if array and task else os.environ["SLURM_JOB_ID"]


def requeue_slurm_job(resume: str) -> tuple[bool, str]:
    """`scontrol requeue <job>` (as Lightning's SLURMEnvironment does on SIGUSR1): (whether SLURM took it, one line
    saying what happened). Where scontrol is missing or refuses (a container, a cluster that forbids it) the
    checkpoint is saved all the same, and the line says how to requeue by hand."""
    job = slurm_job_id()
    by_hand = f"requeue it by hand with `scontrol requeue {job}`, or submit the job again: {resume}"
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        return False, f"scontrol is not on PATH here, so SLURM job {job} was not requeued; {by_hand}"
    # A session of its own, and the stop signals blocked: a launcher's stop to the rank's process group (torchrun's
    # SIGTERM after a repeated signal) would otherwise end scontrol mid-requeue, even one sent in the instant
    # between its fork and its new session (pending there, it kills the child once its signal mask is restored).
    # scontrol inherits the mask; the timeout still ends it (SIGKILL).
    held = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        proc = subprocess.run([scontrol, "requeue", job], capture_output=True, text=True, timeout=60,
                              start_new_session=True)
    except (OSError, subprocess.SubprocessError) as e:
        return False, f"`scontrol requeue {job}` could not run ({e}); {by_hand}"
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
    if proc.returncode != 0:
        why = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
        return False, f"`scontrol requeue {job}` failed ({why}); {by_hand}"
    return True, f"requeued SLURM job {job}: when it runs again it continues from this checkpoint ({resume})"
