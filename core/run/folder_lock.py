"""One run per folder: a run holds its folder for as long as it runs, by an OS lock (flock) on `<run>/.run.lock`
that dies with the process, so a crashed run never leaves a stale one. A second run naming the same folder, new or
--resume, is refused in one line naming the process that holds it.

The process that becomes global rank 0 takes the lock once the run's name is agreed, before anything is written into
the folder, and every rank learns the answer; before that, a launch looks whether another process holds it (the
common case, a run started in a second terminal, refused before any rank starts).
"""

import fcntl
import os
import socket
import sys
import time
from pathlib import Path

from core.run import full_disk
from core.run.flags import ConfigError

NAME = ".run.lock"
_held: dict[str, int] = {}  # folder -> the open descriptor that holds its lock, for this process's lifetime


class FolderBusy(ConfigError):
    """Another process holds the run folder; every rank of this run raises it, rank 0 says it."""


def holder(folder) -> str | None:
    """Who holds `folder`'s lock ("process 1234 on host, started ...: command"), or None when nobody does."""
    path = Path(folder) / NAME
    if str(Path(folder).resolve()) in _held or not path.exists():
        return None
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # granted while no run holds it
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    except BlockingIOError:
        return path.read_text().strip() or "another process (it has not written its name yet)"
    finally:
        os.close(fd)


def refuse_if_held(folder) -> None:
    if (who := holder(folder)) is not None:
        raise FolderBusy(busy_message(folder, who))


def busy_message(folder, who: str) -> str:
    return (f"run folder {folder} is in use by {who}; one run writes a folder at a time. Fix: wait for that run to "
            "end (or stop it), or give this run another --run-name")


def hold(folder) -> str | None:
    """Take `folder`'s lock for this process's lifetime; None, or who holds it when another process does."""
    folder = Path(folder)
    key = str(folder.resolve())
    if key in _held:
        return None
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder / NAME, os.O_RDWR | os.O_CREAT, 0o644)
    for attempt in range(5):  # another launch's look (a moment's shared lock) is not a holder
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            time.sleep(0.05)
    else:
        os.close(fd)
        return (folder / NAME).read_text().strip() or "another process"
    _held[key] = fd
    os.ftruncate(fd, 0)
    name = (f"process {os.getpid()} on {socket.gethostname()}, started {time.strftime('%Y-%m-%d %H:%M:%S')}: "
            f"{' '.join(sys.argv)[:300]}")
    # held all the same when the disk has no room for the name (the run stops on it once its ranks meet)
    full_disk.guarded(f"the run's lock file {NAME}", folder, lambda: os.write(fd, name.encode()))
    return None


def release_all() -> None:
    """Give back every folder this process holds (at the end of main(): a test may run the script again in-process)."""
    for fd in _held.values():
        os.close(fd)  # closing the descriptor releases its flock
    _held.clear()


def is_lock(path: Path) -> bool:
    return path.name == NAME
