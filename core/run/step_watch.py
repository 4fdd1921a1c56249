"""What a training loop watches at every step without making the host wait for the device: each step's time
(StepTimer) and each step's loss and gradient norm (LossWatch), both kept on the device and read at the next check
point (a log line, an evaluation, a checkpoint, a stop) in one transfer. Both scripts use them."""

import math
import sys
import time
from typing import NamedTuple

import torch

from core.run.ranks import any_rank


class NonFiniteLoss(RuntimeError):
    pass


class StepTimer:
    """Each step's duration without making the host wait for the device: on a GPU a CUDA event is recorded on the
    stream before and after the step and the pairs are read at the next check point, after one synchronisation
    (timing a step by synchronising around it would empty the launch queue every step); on a CPU the clock.
    `collect()` returns [(seconds, timed)] of the steps since the last call, in order (timed: stop()'s flag, whether
    the step counts in the timing figures); `wall()` the seconds since the first step began, check points included."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.pending: list = []
        self.begun = self.first = None

    def wall(self) -> float:
        return time.perf_counter() - self.first if self.first else 0.0

    def start(self) -> None:
        self.first = self.first or time.perf_counter()
        self.begun = torch.cuda.Event(enable_timing=True) if self.cuda else time.perf_counter()
        if self.cuda:
            self.begun.record()

    def stop(self, timed: bool = True) -> None:
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.pending.append((self.begun, end, timed))
        else:
            self.pending.append((time.perf_counter() - self.begun, None, timed))

    def collect(self) -> list[tuple[float, bool]]:
        if self.cuda and self.pending:
            self.pending[-1][1].synchronize()
        done = [(begun.elapsed_time(end) / 1e3 if self.cuda else begun, timed) for begun, end, timed in self.pending]
        self.pending = []
        return done


class Reading(NamedTuple):
    step: int
    loss: float
    norm: float  # 0.0 where the step gave none
    weight: int  # what the step's loss is a mean over (LeNet-5's running mean weighs each step by its samples)


class LossWatch:
    """Each step's loss, and gradient norm where there is one, kept on the device (a step reads nothing). `read()` at
    a check point fetches all of them in one transfer and, when any rank saw a non-finite one, stops the run naming
    the first such step before anything is logged or saved. An infinite norm in a step the loss scaler skipped is the
    overflow it exists to absorb, not a failure."""

    def __init__(self, fabric, precision: str):
        self.fabric, self.precision = fabric, precision
        self.pending: list[tuple[int, torch.Tensor, bool, int]] = []  # (step, [loss, norm], norm checked, weight)

    def add(self, step: int, loss: torch.Tensor, norm: torch.Tensor | None = None, skipped: bool = False,
            weight: int = 1) -> None:
        loss = loss.detach().float().reshape(())
        norm = norm.detach().float().to(loss.device).reshape(()) if norm is not None else torch.zeros_like(loss)
        self.pending.append((step, torch.stack([loss, norm]), not skipped, weight))

    def read(self, where: str, last_checkpoint, current_step: int) -> list[Reading]:
        """The steps since the last read, in order; NonFiniteLoss (on every rank) if any rank had a non-finite one.
        `where` and `last_checkpoint` go into the message; `current_step` names the stop when another rank failed."""
        values = torch.stack([v for _, v, _, _ in self.pending]).tolist() if self.pending else []
        read = [Reading(step, loss, norm, weight) for (step, _, _, weight), (loss, norm) in zip(self.pending, values)]
        failed = [r for r, (_, _, checked, _) in zip(read, self.pending)
                  if not math.isfinite(r.loss) or (checked and not math.isfinite(r.norm))]
        self.pending = []
        (any_failed,) = any_rank(self.fabric, bool(failed))
        if any_failed:
            step, loss = (failed[0].step, failed[0].loss) if failed else (current_step, math.nan)  # another rank's
            raise NonFiniteLoss(nonfinite_message(loss if not math.isfinite(loss) else math.nan, step, where,
                                                  last_checkpoint, self.precision))
        return read


def nonfinite_message(loss: float, step: int, where: str, last_checkpoint, precision: str) -> str:
    saved = f"the last good checkpoint is {last_checkpoint}" if last_checkpoint else "no checkpoint was saved yet"
    reduced = "" if precision.startswith(("32", "64")) else f"overflow in {precision} (try --precision 32-true), "
    return (f"loss became {loss} at step {step} ({where}); training stopped instead of continuing on garbage, "
            f"and {saved}. Likely causes: a learning rate too high (start a new run with a lower --lr or a longer "
            f"warm-up), {reduced}or NaN/inf in the input data.")


def progress_bar(fabric, iterable, total: int, desc: str):
    """A tqdm bar on rank 0 when attached to a terminal; the plain iterable otherwise (CI, logs, pipes)."""
    if not (fabric.is_global_zero and sys.stdout.isatty()):
        return iterable
    from tqdm import tqdm

    return tqdm(iterable, total=total, desc=desc, leave=False, unit="batch")
