"""Files read and written whole: every write goes through a temporary name, fsync and rename (`write_atomic`: the
one writer of the repository's JSON records, downloads, prepared data and checkpoint folders), so a reader sees the
old file or the new one, never half of one; `read_record`, a finished run's record.json (without torch: the lab's
report and benchmarks read records); `fetch`, the bytes of a file from a URL or a local folder (a mirror); and a full
disk told from any other failure, whichever library met it (`disk_full`).
"""

import errno
import json
import os
import shutil
import sys
import tempfile
import urllib.parse
import urllib.request
from pathlib import Path

PARTIAL = ".partial"  # the suffix of what is still being written: a temporary file, a checkpoint folder
RECORD = "record.json"  # a finished run's record, in its folder
# What libraries say when a write found no room: an OSError's errno, or the text of the error they made of it
# (shutil.copytree's list of errors, torch's zip writer "file write failed", numpy's short write, DCP's errors)
FULL = (errno.ENOSPC, errno.EDQUOT)
FULL_TEXT = ("No space left on device", "[Errno 28]", "[Errno 122]", "Disk quota exceeded")
WRITE_FAILED = ("file write failed", "unexpected pos", "failed writing", "write failed", "requested and")
NEARLY_FULL = 1 << 20  # a write that failed on a file system with less than this free found it full


class DiskFull(RuntimeError):
    """A checkpoint, record, download or export could not be written for lack of space: nothing complete was lost."""


def write_atomic(path, data: bytes) -> None:
    """Temporary file in the same folder, fsync, rename: a reader sees the old file or the new one, never half of
    one, and a full disk or a signal leaves no temporary file behind."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=PARTIAL)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json_atomic(path, obj) -> None:
    write_atomic(path, json.dumps(obj, indent=2, default=str).encode())


def fetch(mirror: str, filename: str) -> bytes:
    """The bytes of `filename` (.gz) from a URL or a local directory."""
    parsed = urllib.parse.urlparse(mirror)
    if parsed.scheme in ("http", "https", "ftp", "file"):
        url = urllib.parse.urljoin(mirror.rstrip("/") + "/", filename)
        with urllib.request.urlopen(url, timeout=30) as response:
            return _read_with_progress(response, filename)
    path = Path(mirror).expanduser() / filename
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist")
    return path.read_bytes()


def _read_with_progress(response, filename: str) -> bytes:
    """The whole body; with a progress bar when a person watches a terminal."""
    if not sys.stderr.isatty():
        return response.read()
    from tqdm import tqdm

    chunks = []
    total = int(response.headers.get("Content-Length") or 0) or None
    with tqdm(total=total, unit="B", unit_scale=True, desc=filename, leave=False) as bar:
        while chunk := response.read(1 << 16):
            chunks.append(chunk)
            bar.update(len(chunk))
    return b"".join(chunks)


def nearest_existing(folder) -> Path:
    """`folder`, or its nearest parent that exists: where it would be made, on the file system it would use."""
    path = Path(folder).absolute()
    while not path.exists():
        path = path.parent
    return path


def free_bytes(folder) -> int:
    """Free space of the file system that holds `folder` (or would)."""
    return shutil.disk_usage(nearest_existing(folder)).free


def chain(e: BaseException):
    """`e` and the errors it was raised from or while handling, outermost first."""
    while e is not None:
        yield e
        e = e.__cause__ or e.__context__


def is_disk_full(e: BaseException, folder) -> bool:
    """Whether `e`, raised while writing into `folder`, means its disk (or quota) is full: an OSError's errno
    anywhere in its chain, the words a library put in its own error, or a write that failed where the disk has
    nothing left."""
    if any(isinstance(seen, OSError) and seen.errno in FULL for seen in chain(e)):
        return True
    text = f"{e} {e.args!r}"
    if any(s in text for s in FULL_TEXT):
        return True
    return any(s in text for s in WRITE_FAILED) and free_bytes(folder) < NEARLY_FULL


def disk_full(write, folder) -> BaseException | None:
    """Run `write` (into `folder`); return its error when the disk was full, raise any other."""
    try:
        write()
    except Exception as e:
        if is_disk_full(e, folder):
            return e
        raise
    return None


def why_full(e: BaseException | None) -> str:
    """A full disk's error in a few words, whatever library raised it (shutil.Error carries a list of them; torch.save
    into a file raises its zip writer's own error over the file's OSError)."""
    if e is None:
        return "on another process"
    if (os_error := next((seen for seen in chain(e) if isinstance(seen, OSError) and seen.strerror), None)):
        return os_error.strerror
    text = str(e)
    return next((s for s in FULL_TEXT if s in text), f"{type(e).__name__}: {text[:80]}")


def read_record(run_dir) -> dict | None:
    """A run's record.json, or None when the run has not finished (or the file is unreadable)."""
    try:
        return json.loads((Path(run_dir) / RECORD).read_text())
    except (OSError, ValueError):
        return None
