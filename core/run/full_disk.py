"""A full disk met at any moment of a run, in any rank or thread, ends the run in one message. A checkpoint's save
agrees on it itself (checkpoints.py); every other write (TensorBoard's events, written by a thread of their own, the
console when it is redirected to a file, the run's files at its start) is noted where it fails and dropped: nothing
is raised in the middle of a step, where the other ranks would wait in a collective for this one. Every rank stops on
it together at the next point where the ranks meet (each step boundary's all-reduce, a save, the record) and rank 0
says it: what met the disk, its free space, the last complete checkpoint as it is on disk and the command that
continues.
"""

import dataclasses
import os
import threading

import torch

from core.run.checkpoints import NOTHING_KEPT
from core.run.files import DiskFull, free_bytes, is_disk_full, why_full
from core.run.ranks import any_rank


@dataclasses.dataclass
class Noted:
    what: str  # "TensorBoard's events", "the console (stdout, /path)"
    folder: str  # where it was written
    error: BaseException


_first: list[Noted] = []  # this process's first full disk, until the run stops on it
_after: list = []  # what says how the run continues (lifecycle.Run's, once it exists)


def note(what: str, folder, error: BaseException) -> None:
    """Keep the first full disk of this process; the run stops on it at the next point where the ranks meet."""
    if not _first:
        _first.append(Noted(what, str(folder), error))


def noted() -> Noted | None:
    return _first[0] if _first else None


def continue_with(after) -> None:
    """`after()`: the last complete checkpoint as it is on disk and the command that continues from it."""
    _after[:] = [after]


def clear() -> None:
    """A new run in this process (a test runs the scripts' main() in-process) starts with nothing noted."""
    _first.clear()
    _after.clear()


def guarded(what: str, folder, write):
    """Run `write` (into `folder`); a full disk is noted and None returned, any other error raised."""
    try:
        return write()
    except Exception as e:
        if not is_disk_full(e, folder):
            raise
        note(what, folder, e)
        return None


def message(n: Noted) -> str:
    after = _after[0]() if _after else NOTHING_KEPT
    return (f"no space left to write {n.what} into {n.folder}: the disk has {free_bytes(n.folder) / 2**20:,.1f} MiB free "
            f"({why_full(n.error)}). {after[0].upper()}{after[1:]}")


def stop_if_noted(fabric, anywhere: bool) -> None:
    """Every rank, with `anywhere` the flag all-reduced from each rank's noted(): raise DiskFull on all of them, rank
    0's message naming the first rank's write that met the disk (broadcast from it)."""
    if not anywhere:
        return
    mine = noted()
    if fabric.world_size > 1:
        rank = torch.tensor(float(fabric.global_rank if mine else fabric.world_size), device=fabric.device)
        source = int(fabric.all_reduce(rank, reduce_op="min"))
        text = fabric.broadcast(message(mine) if fabric.global_rank == source else None, src=source)
    else:
        text = message(mine)
    clear()
    raise DiskFull(text)


def agree(fabric) -> None:
    """A point where the ranks meet for this alone (the start, a save, the record): one small all-reduce."""
    stop_if_noted(fabric, any_rank(fabric, noted() is not None)[0])


def quiet_threads() -> None:
    """A thread that dies of a full disk (TensorBoard's event writer) is noted instead of printing its traceback; the
    thread that waits for it (Lightning's logger) meets the same error and notes it too."""
    previous = threading.excepthook
    if getattr(previous, "full_disk", False):
        return

    def hook(args) -> None:
        if args.exc_value is not None and is_disk_full(args.exc_value, "."):
            file = getattr(getattr(getattr(args.thread, "_record_writer", None), "_writer", None), "filename", None)
            note("TensorBoard's events" if file else f"the files of thread {args.thread.name}",
                 os.path.dirname(os.fsdecode(file)) if file else os.getcwd(), args.exc_value)
            return
        previous(args)
    hook.full_disk = True
    threading.excepthook = hook
