"""Checkpoints, written so that a reader never sees half of one: a checkpoint is a numbered folder completed by a
rename once every rank has written (its files through files.write_atomic or fabric.save).

    runs/<run>/checkpoints/step-00001234/   state (fabric.save: one file, or a folder of shards) and config.json

`Checkpoints` saves them (keeping the newest --keep-last), finds the newest usable one for --resume and refuses or
skips a damaged one with the reason, every rank taking the same decision.
"""

import json
import os
import re
import shutil
import sys
import zipfile
from datetime import datetime
from pathlib import Path

import torch
from lightning.fabric.plugins import TorchCheckpointIO

from core.run.files import PARTIAL, DiskFull, disk_full, free_bytes, why_full, write_json_atomic
from core.run.ranks import any_rank

NOTHING_KEPT = "no checkpoint of this run was complete yet: free space (or choose another --out-dir) and start it again"

STEP_DIR = re.compile(r"step-(\d{8})$")
MARGIN = 256 * 2**10  # bytes kept free beyond a planned checkpoint: a file system's pages and directory entries


def room_needed(planned_bytes: float) -> float:
    """The free bytes a planned checkpoint is written into: 10% and MARGIN beyond the plan (within 3% of real ones)."""
    return 1.1 * planned_bytes + MARGIN


class ResumeError(RuntimeError):
    """A checkpoint that cannot be used, with the reason and the fix. `every_rank`: every rank of the run raised it,
    having agreed (any_rank), so rank 0 alone says it (exits)."""

    every_rank = False

    def agreed(self) -> "ResumeError":
        self.every_rank = True
        return self


# ----------------------------------------------------------------------------- checkpoints
def _fsync(path: Path) -> None:
    """Flush one file, or one directory's entries, to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(path: Path) -> None:
    for p in [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]:
        _fsync(p)


def step_of(path: Path) -> int:
    return int(STEP_DIR.match(path.name).group(1))


def one_line(e: BaseException) -> str:
    """An exception as one short line, its type and first sentence: torch's load errors run to paragraphs of
    advice (weights_only, "Please file an issue") that are not the reason a checkpoint was skipped."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(e)).strip()
    first = re.split(r"(?<=\.)\s|\n", text, maxsplit=1)[0].rstrip(".,: ") if text else "no message"
    return f"{type(e).__name__}: {first if len(first) <= 160 else first[:157] + '...'}"


def damaged_files(path: Path) -> str | None:
    """A cheap check of a checkpoint's files before any rank loads it: torch.save writes zip archives,
    and a truncated archive has lost its central directory. Returns the first problem found."""
    state = path / "state"
    files = [state] if state.is_file() else sorted(p for p in state.rglob("*") if p.is_file())
    for f in files:
        if f.stat().st_size == 0:
            return f"{f} is empty"
        with open(f, "rb") as fh:
            is_zip = fh.read(4) == b"PK\x03\x04"
        if is_zip and not zipfile.is_zipfile(f):
            return f"{f} is truncated (its zip directory is missing)"
    return None


class WrittenInPlace(TorchCheckpointIO):
    """Fabric's one-file checkpoint (one process, ddp) written by torch.save straight into the checkpoint's partial
    folder, whose rename makes it whole. Lightning's own (`_atomic_save`) serializes the whole file into memory
    first, a second copy of every weight and optimizer state on the host (on a GPU, the first), then writes it through
    a file in the system's temporary folder, copied across when that folder is on another disk than the run's: a
    small /tmp fills where the run's disk has room. Lightning's FSDP saves its full state with torch.save too."""

    def save_checkpoint(self, checkpoint, path, storage_options=None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} writes local files and takes no storage_options")
        with open(path, "wb") as f:  # a Python file: a full disk is the OSError itself, not torch's "unexpected pos"
            torch.save(checkpoint, f)


def write_in_place(strategy) -> None:
    """Give `strategy` the in-place writer where it takes Fabric's CheckpointIO plugin (one process and ddp save
    through it; DeepSpeed takes it and saves with its engine); FSDP and model parallel refuse a plugin, and write
    their files with torch.save and distributed checkpoints themselves."""
    try:
        strategy.checkpoint_io = WrittenInPlace()
    except NotImplementedError:
        pass


class Checkpoints:
    """Numbered, atomically written checkpoints in one folder, keeping the newest `keep_last`."""

    def __init__(self, folder, keep_last: int = 3, per_rank_files: bool = False, planned_bytes: float = 0.0,
                 not_resumable: str = ""):
        # per_rank_files: each rank writes its own torch.save file, for models Fabric cannot save (pipeline
        # stages hold plain tensors, which ModelParallelStrategy's distributed checkpoint refuses).
        # planned_bytes: one checkpoint, all ranks' files (core/plan/disk.py), checked against the free space first
        # not_resumable: why a run of these settings cannot continue from its checkpoints, and what to do instead
        self.folder, self.keep_last, self.per_rank_files = Path(folder), keep_last, per_rank_files
        self.planned_bytes, self.not_resumable = planned_bytes, not_resumable

    def _write(self, fabric, path: Path, state: dict) -> BaseException | None:
        """Write this rank's part; a full disk is returned (any other error raised) once this rank has been through
        every collective the save holds, so that no rank waits for one that left early."""
        if self.per_rank_files:
            plain = {k: (v.state_dict() if hasattr(v, "state_dict") else v) for k, v in state.items()}
            return disk_full(lambda: (path.mkdir(parents=True, exist_ok=True),
                                      torch.save(plain, path / f"rank-{fabric.global_rank:05d}.pt")), path.parent)
        problem = disk_full(lambda: fabric.save(path, state), path.parent)
        if problem is not None and fabric.world_size > 1:
            # the barriers a failed write skipped and the other ranks wait in: Fabric's after every save, and before it
            # DeepSpeed's closing one (DCP agrees on errors itself; a replicated model is written by rank 0 alone)
            for _ in range(2 if "DeepSpeed" in type(fabric.strategy).__name__ else 1):
                fabric.barrier()
        return problem

    def needed(self) -> float:
        return room_needed(self.planned_bytes)

    def room(self, fabric) -> int | None:
        """The free bytes when less than the planned checkpoint needs, else None; every rank answers the same."""
        if not self.planned_bytes:
            return None
        free = free_bytes(self.folder)
        return free if any_rank(fabric, free < self.needed())[0] else None

    def _read(self, fabric, path: Path, state: dict) -> None:
        if not self.per_rank_files:
            stateful = {k: v for k, v in state.items() if hasattr(v, "load_state_dict")}
            fabric.load(path, state)
            for key, obj in stateful.items():  # some strategies put the saved dict in place of the object
                if state[key] is not obj:
                    obj.load_state_dict(state[key])
                    state[key] = obj
            return
        saved = torch.load(path / f"rank-{fabric.global_rank:05d}.pt", map_location=fabric.device, weights_only=False)
        for key, obj in state.items():
            obj.load_state_dict(saved[key])

    def complete(self) -> list[Path]:
        """Complete checkpoints, oldest first."""
        if not self.folder.is_dir():
            return []
        return sorted(p for p in self.folder.iterdir() if p.is_dir() and STEP_DIR.match(p.name))

    def clean_partial(self) -> None:
        """Saves cut short by a kill leave `.partial` folders; nothing can use them."""
        for p in self.folder.glob(f"step-*{PARTIAL}") if self.folder.is_dir() else []:
            shutil.rmtree(p, ignore_errors=True)

    def save(self, fabric, state: dict, step: int, config: dict) -> Path:
        """Write the checkpoint of `step` into a partial folder, then rename it complete. A disk without room for it
        (the plan's bytes, or a write that met a full disk on any rank) stops every rank with one message, the partial
        folder removed and every earlier checkpoint intact."""
        final = self.folder / f"step-{step:08d}"
        partial = final.with_name(final.name + PARTIAL)
        if (free := self.room(fabric)) is not None:  # known before a byte is written
            raise DiskFull(self.full_message(fabric, state, step, None, free))
        problem = None
        if fabric.global_rank == 0:
            problem = disk_full(lambda: (shutil.rmtree(partial, ignore_errors=True), partial.mkdir(parents=True),
                                         write_json_atomic(partial / "config.json", config)), self.folder)
        if any_rank(fabric, problem is not None)[0]:  # the folder itself did not fit: no rank writes into it
            self.remove_partial(fabric, partial)
            raise DiskFull(self.full_message(fabric, state, step, problem))
        problem = self._write(fabric, partial / "state", state)
        if any_rank(fabric, problem is not None)[0]:  # every rank stops, and the partial folder goes
            self.remove_partial(fabric, partial)
            raise DiskFull(self.full_message(fabric, state, step, problem))
        fabric.barrier()  # every rank's shard is written before the folder is declared complete
        if fabric.global_rank == 0:
            _fsync_tree(partial)
            shutil.rmtree(final, ignore_errors=True)
            os.replace(partial, final)
            _fsync(self.folder)
            for old in self.complete()[:-self.keep_last] if self.keep_last > 0 else []:
                shutil.rmtree(old, ignore_errors=True)
        fabric.barrier()
        return final

    def remove_partial(self, fabric, partial: Path) -> None:
        fabric.barrier()  # every rank has stopped writing into it
        if fabric.global_rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
        fabric.barrier()

    def full_message(self, fabric, state: dict, step: int, problem: BaseException | None, free: int | None = None) -> str:
        """The folder, the bytes the checkpoint needs and has, the last complete checkpoint and how to resume."""
        need = self.planned_bytes or sum(state_bytes(v) for v in state.values())
        if fabric.world_size > 1 and not self.planned_bytes:
            need = float(fabric.all_reduce(torch.tensor(float(need), device=fabric.device), reduce_op="sum"))
        free = free_bytes(self.folder) if free is None else free
        how = f"a write failed: {why_full(problem)}" if problem else "found before writing"
        margin = f", less than the {self.needed() / 2**20:,.1f} MiB kept for it" if self.planned_bytes and not problem else ""
        return (f"no space left to write the checkpoint of step {step} into {self.folder}: it needs about "
                f"{need / 2**20:,.1f} MiB and the disk has {free / 2**20:,.1f} MiB free{margin} ({how}). "
                f"{'The partial checkpoint was removed; ' if problem else 'Nothing was written; '}{self.kept()}")

    def kept(self) -> str:
        """The last complete checkpoint as it is on disk, and the command that continues from it."""
        last = self.complete()
        if not last:
            return NOTHING_KEPT
        if self.not_resumable:
            return f"the last complete checkpoint, {last[-1]}, is intact, but {self.not_resumable}"
        return (f"the last complete checkpoint, {last[-1]}, is intact: free space (or move --out-dir) and continue with "
                f"--resume auto --run-name {self.folder.parent.name}")

    def resolve(self, resume: str) -> list[Path]:
        """Candidates for --resume, newest first: `auto` lists this run's checkpoints, a path names one."""
        if resume == "auto":
            return list(reversed(self.complete()))
        if why := not_a_checkpoint(resume):
            raise ResumeError(why)
        return [checkpoint_folder(resume)]

    def load(self, fabric, state: dict, resume: str, check_config) -> Path | None:
        """Load the newest usable candidate into `state`. Every rank takes the same decision: a checkpoint
        that any rank cannot read is skipped by all (with `auto`), so ranks never resume different steps.

        `check_config(saved_config)` raises ResumeError when the checkpoint belongs to another experiment;
        that is never skipped, since an older checkpoint of the same run would be refused just the same.
        """
        for path in self.resolve(resume):
            try:
                saved = json.loads((path / "config.json").read_text())
                why = None
            except (OSError, ValueError) as e:
                why = f"config.json unreadable ({e})"
            if why is None:
                self._agreed_settings(fabric, check_config, saved)
                why = damaged_files(path)
            if not self._agreed_ok(fabric, path, why, resume):
                continue
            try:
                self._read(fabric, path / "state", state)
            except Exception as e:  # torch/zip/pickle/DeepSpeed errors differ; all mean "this one is bad"
                why = one_line(e)
            if not self._agreed_ok(fabric, path, why, resume):
                continue
            return path
        return None

    @staticmethod
    def _agreed_settings(fabric, check_config, saved: dict) -> None:
        """check_config(saved) on every rank, and every rank stops if one refused: each read the same file, so
        all normally refuse alike and rank 0 says it once (two processes printed the same refusal twice)."""
        try:
            check_config(saved)
            refused = None
        except ResumeError as e:
            refused = e
        some, accepted = any_rank(fabric, refused is not None, refused is None)
        if refused is not None:
            raise refused.agreed() if not accepted else refused
        if some:  # another rank read other settings: its own line says which
            raise ResumeError("another process of this run refused the checkpoint's settings (its message is above)")

    def _agreed_ok(self, fabric, path: Path, why: str | None, resume: str) -> bool:
        (bad,) = any_rank(fabric, why is not None)
        if not bad:
            return True
        why = why or "another process could not read its part"
        if resume != "auto":
            raise ResumeError(f"checkpoint {path} cannot be loaded: {why}. Fix: resume from another checkpoint "
                              f"(--resume auto picks the newest good one) or start a new run.").agreed()
        fabric.print(f"warning: skipping checkpoint {path}: {why}", file=sys.stderr)
        return False

    def abandon_newer(self, fabric, loaded: Path) -> None:
        """Checkpoints newer than the one resumed belong to a branch this run no longer follows; moved
        aside (not deleted), so they neither outrank new saves in pruning nor get picked by `auto`."""
        if fabric.global_rank == 0:
            aside = self.set_aside([p for p in self.complete() if step_of(p) > step_of(loaded)], "abandoned")
            if aside:
                fabric.print(f"moved the newer checkpoint(s) of the abandoned branch to {aside}")
        fabric.barrier()

    def set_aside(self, checkpoints: list[Path], why: str) -> Path | None:
        """Move checkpoints into <folder>/<why>-<time>/ (kept, never deleted; no longer found by resume)."""
        if not checkpoints:
            return None
        aside = self.folder / f"{why}-{datetime.now():%Y%m%d-%H%M%S}"
        aside.mkdir(parents=True, exist_ok=True)
        for p in checkpoints:
            os.replace(p, aside / p.name)
        return aside


def checkpoint_folder(resume: str) -> Path:
    path = Path(resume)
    return path.parent if path.name == "state" else path


def not_a_checkpoint(resume: str) -> str | None:
    """Why --resume PATH names no checkpoint, or None where it names one. The example is the newest checkpoint of the
    run folder PATH lies in (a user who passed the run folder or its record.json), where it has one."""
    path = checkpoint_folder(resume)
    if (path / "state").exists() and STEP_DIR.match(path.name):
        return None
    where = path.resolve()
    run = next((p for p in (where, *where.parents) if (p / "checkpoints").is_dir()), None)
    newest = Checkpoints(run / "checkpoints").complete()[-1:] if run else []
    example = newest[0] if newest else "<out-dir>/<run>/checkpoints/step-00000100"
    return (f"--resume {resume}: no checkpoint there (expected a folder with `state` and `config.json`, such as "
            f"{example}). Fix: pass such a folder or `auto`.")


def state_bytes(obj) -> int:
    """Bytes of the tensors an object's state_dict holds on this rank (its shard under ZeRO/FSDP)."""
    def walk(x):
        if isinstance(x, torch.Tensor):
            return x.numel() * x.element_size() if x.device.type != "meta" else 0
        if isinstance(x, dict):
            return sum(walk(v) for v in x.values())
        if isinstance(x, (list, tuple)):
            return sum(walk(v) for v in x)
        return 0
    try:
        return walk(obj.state_dict()) if hasattr(obj, "state_dict") else 0
    except Exception:  # a DeepSpeed engine's state_dict may need collectives; the estimate then leaves it out
        return 0


