"""Files read and written whole: every write goes through a temporary name, fsync and rename (`write_atomic`: the
one writer of the repository's JSON records, downloads, prepared data and checkpoint folders), so a reader sees the
old file or the new one, never half of one; and `fetch`, the bytes of a file from a URL or a local folder (a mirror).
"""

import json
import os
import sys
import tempfile
import urllib.parse
import urllib.request
from pathlib import Path

PARTIAL = ".partial"  # the suffix of what is still being written: a temporary file, a checkpoint folder


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
