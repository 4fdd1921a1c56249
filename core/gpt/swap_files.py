"""ZeRO-Infinity's swap files, checked after DeepSpeed writes them. DeepSpeed creates a rank's files under --nvme-path
as it first swaps each state out (the float32 partition when the model is set up, AdamW's moments at the first
step), and a write that meets a full disk fails there without a word (DeepSpeed 0.19.8's async I/O leaves the file
empty): the next swap-in then aborts the process in a C++ assertion ("file_offset + buffer nbytes > file bytes"),
SIGABRT, and the other ranks report it dead. Once written, the files are only overwritten in place, which needs no
new room. So after the set-up and after each step every rank looks at its files' sizes (a few stat calls) and a file
written short is noted as the full disk it is (full_disk.py): the run stops before any swap-in reads it.
"""

import errno
import os

from core.run import full_disk

WHAT = "ZeRO-Infinity's swap files"


def short_file(fabric) -> str | None:
    """This rank's first swap file that holds less than its tensor, as `path: N of M bytes`; None when all are whole
    (or the run swaps nothing)."""
    optimizer = getattr(getattr(fabric.strategy, "model", None), "optimizer", None)
    swapper = getattr(optimizer, "optimizer_swapper", None)
    if swapper is None:
        return None
    for info in swapper.swap_params_info.values():
        need = info.numel() * swapper.swap_element_size
        for path in info.get_swap_paths():
            if os.path.exists(path) and (size := os.path.getsize(path)) < need:
                return f"{path}: {size:,} of {need:,} bytes"
    return None


def note_if_short(fabric, nvme_path: str) -> None:
    if (short := short_file(fabric)) is not None:
        full_disk.note(WHAT, nvme_path, OSError(errno.ENOSPC, f"No space left on device: {short} written short"))
