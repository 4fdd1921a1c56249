"""TensorBoard's events and the console are writes like any other: a full disk met by either is noted (full_disk.py)
and the run stops on it at the next point where its ranks meet, in one message, instead of three tracebacks
(TensorBoard's writer thread, Lightning's logger turning the thread's error into "you tried to log 5.55 which is
currently not supported", and the rank left waiting). Nothing of TensorBoard or Lightning is replaced:
`EventLogger` is Lightning's TensorBoardLogger whose writes (its own, and those made through its SummaryWriter, the
figures and images) turn a full disk into a note and are dropped from then on; `guard_console` does the same for
stdout and stderr (a job's output file on the disk that filled), and for the logging handlers that write to them.
"""

import logging
import os
import sys

from lightning.fabric.loggers import TensorBoardLogger
from lightning.fabric.loggers.logger import _DummyExperiment

from core.run import full_disk
from core.run.files import is_disk_full

EVENTS = "TensorBoard's events"


class EventLogger(TensorBoardLogger):
    """Lightning's TensorBoard logger; after a full disk, nothing more is written (the run stops at the next point its
    ranks meet)."""

    full = False

    def _write(self, write):
        if self.full:
            return None
        try:
            return write()
        except Exception as e:
            if not is_disk_full(e, self.log_dir):
                raise
            self.full = True
            full_disk.note(EVENTS, self.log_dir, e)
            return None

    @property
    def experiment(self):
        writer = None if self.full else self._write(lambda: TensorBoardLogger.experiment.fget(self))
        return writer if isinstance(writer, _DummyExperiment) else _DummyExperiment() if writer is None else \
            _Guarded(self, writer)

    def log_metrics(self, metrics, step=None) -> None:
        self._write(lambda: super(EventLogger, self).log_metrics(metrics, step))

    def log_hyperparams(self, params, metrics=None, step=None) -> None:
        self._write(lambda: super(EventLogger, self).log_hyperparams(params, metrics, step))

    def save(self) -> None:
        self._write(lambda: super(EventLogger, self).save())

    def finalize(self, status: str) -> None:
        self._write(lambda: super(EventLogger, self).finalize(status))


class _Guarded:
    """The SummaryWriter, each of its calls through the logger's guard (a figure, an image, a histogram, a flush)."""

    def __init__(self, logger: EventLogger, writer):
        self._logger, self._writer = logger, writer

    def __getattr__(self, name):
        attr = getattr(self._writer, name)
        if not callable(attr):
            return attr
        return lambda *a, **k: self._logger._write(lambda: attr(*a, **k))


class Console:
    """stdout or stderr: after a write that met a full disk, the rest of this process's output is dropped."""

    def __init__(self, stream, name: str):
        self.wrapped, self.name, self.full = stream, name, False

    def _write(self, write, default=None):
        if self.full:
            return default
        try:
            return write()
        except OSError as e:
            where = self.path()
            if not is_disk_full(e, os.path.dirname(where) or "."):
                raise
            self.full = True
            full_disk.note(f"the console ({self.name}: {where})", os.path.dirname(where) or ".", e)
            return default

    def write(self, text):
        return self._write(lambda: self.wrapped.write(text), len(text))

    def flush(self):
        return self._write(self.wrapped.flush)

    def path(self) -> str:
        try:
            return os.readlink(f"/proc/self/fd/{self.wrapped.fileno()}")
        except (OSError, ValueError, AttributeError):
            return "a file"

    def __getattr__(self, name):
        return getattr(self.wrapped, name)


def guard_console() -> list:
    """Wrap sys.stdout and sys.stderr (and the logging handlers that write to them) in Console; returns what
    `restore` puts back."""
    swapped = []
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if isinstance(stream, Console) or not hasattr(stream, "fileno"):
            continue
        guarded = Console(stream, name)
        setattr(sys, name, guarded)
        swapped.append((sys, name, stream))
        for handler in _stream_handlers(stream):
            handler.stream = guarded
            swapped.append((handler, "stream", stream))
    return swapped


def _stream_handlers(stream) -> list:
    loggers = [logging.getLogger(), *(lg for lg in logging.Logger.manager.loggerDict.values()
                                     if isinstance(lg, logging.Logger))]
    return [h for lg in loggers for h in lg.handlers if isinstance(h, logging.StreamHandler) and h.stream is stream]


def restore(swapped: list) -> None:
    for owner, attribute, stream in reversed(swapped):
        setattr(owner, attribute, stream)
