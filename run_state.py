"""The run lifecycle both training scripts share: start, resume or refuse, atomic checkpoints, clean stops, the run
record and the exit code. (Flags: flags.py; the processes and nodes of a run: ranks.py; the machine: hardware.py.)

A run lives in `runs/<run>/`: `config.json` and `record.json` (both carry `kind`: "lenet" or "gpt"),
TensorBoard events, and `checkpoints/step-00001234/` holding `state` (written by `fabric.save`: one file,
or a folder of shards) and `config.json`. A checkpoint is written under a `.partial` name, fsync'd, and
renamed when every rank has finished, so a `step-N` folder is always complete.
"""

import contextlib
import dataclasses
import errno
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import zipfile
from datetime import datetime
from pathlib import Path

import torch

from flags import ConfigError, Resume, opt
from hardware import cpu_name
from ranks import LOST_PEER, PeerWatch, launcher, take_fabric_run_settings, watch_peers, watch_ranks

def resume_flag():
    """--resume, the same in both scripts' configs."""
    return opt("", "auto: continue the run from its newest good checkpoint, or start it; or a checkpoint folder",
               check=Resume())


def requeue_flag():
    """--requeue-signal (StopRequest), the same in both scripts' configs."""
    return opt("USR1", "in a SLURM job: the signal that saves, requeues the job and exits (none: off)",
               ("USR1", "USR2", "none"))


PARTIAL = ".partial"
RECORD = "record.json"
STEP_DIR = re.compile(r"step-(\d{8})$")


class ResumeError(RuntimeError):
    """A checkpoint that cannot be used, with the reason and the fix."""


class DiskFull(RuntimeError):
    """A checkpoint or record could not be written for lack of space: nothing complete was lost."""


class NonFiniteLoss(RuntimeError):
    pass


# ----------------------------------------------------------------------------- records
def write_json_atomic(path, obj) -> None:
    """Temporary file, fsync, rename: a reader sees the old file or the new one, never half of one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=PARTIAL)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=2, default=str)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # a full disk or a signal: no half-written temporary file is left behind
        Path(tmp).unlink(missing_ok=True)
        raise


def read_record(run_dir) -> dict | None:
    """A run's record.json, or None when the run has not finished (or the file is unreadable)."""
    try:
        return json.loads((Path(run_dir) / RECORD).read_text())
    except (OSError, ValueError):
        return None


def environment() -> dict:
    """Library versions and hardware, recorded with every run so results can be compared honestly."""
    import lightning

    env = {"python": platform.python_version(), "torch": torch.__version__, "lightning": lightning.__version__,
           "platform": platform.platform(), "cpu": cpu_name(), "cpu_threads": torch.get_num_threads(),
           "cuda": torch.version.cuda, "gpu": None, "gpu_count": 0, "launcher": launcher()}
    for module in ("transformers", "deepspeed", "torchmetrics"):
        if module in sys.modules:
            env[module] = getattr(sys.modules[module], "__version__", None)
    if torch.cuda.is_available():
        env["gpu"], env["gpu_count"] = torch.cuda.get_device_name(0), torch.cuda.device_count()
    return env


class Progress:
    """Counters that must survive a resume. `fabric.load` restores objects that have `load_state_dict` in
    place (plain dicts in the state are replaced instead), so every holder of this object sees the
    restored values."""

    def __init__(self, **fields):
        self.__dict__.update(fields)

    def state_dict(self) -> dict:
        return dict(vars(self))

    def load_state_dict(self, state: dict) -> None:
        self.__dict__.update(state)


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


class Checkpoints:
    """Numbered, atomically written checkpoints in one folder, keeping the newest `keep_last`."""

    def __init__(self, folder, keep_last: int = 3, per_rank_files: bool = False):
        # per_rank_files: each rank writes its own torch.save file, for models Fabric cannot save (pipeline
        # stages hold plain tensors, which ModelParallelStrategy's distributed checkpoint refuses)
        self.folder, self.keep_last, self.per_rank_files = Path(folder), keep_last, per_rank_files

    def _write(self, fabric, path: Path, state: dict) -> None:
        if not self.per_rank_files:
            return fabric.save(path, state)
        path.mkdir(parents=True, exist_ok=True)
        plain = {k: (v.state_dict() if hasattr(v, "state_dict") else v) for k, v in state.items()}
        torch.save(plain, path / f"rank-{fabric.global_rank:05d}.pt")

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
        final = self.folder / f"step-{step:08d}"
        partial = final.with_name(final.name + PARTIAL)
        problem = None
        if fabric.global_rank == 0:
            problem = disk_full(lambda: (shutil.rmtree(partial, ignore_errors=True), partial.mkdir(parents=True),
                                         write_json_atomic(partial / "config.json", config)))
        fabric.barrier()
        problem = problem or disk_full(lambda: self._write(fabric, partial / "state", state))
        if any_rank(fabric, problem is not None)[0]:  # every rank stops, and the partial folder goes
            if fabric.global_rank == 0:
                shutil.rmtree(partial, ignore_errors=True)
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

    def full_message(self, fabric, state: dict, step: int, problem: OSError | None) -> str:
        """The folder, the bytes the checkpoint needs and has, the last complete checkpoint and how to resume."""
        need = sum(state_bytes(v) for v in state.values())
        if fabric.world_size > 1:
            need = float(fabric.all_reduce(torch.tensor(float(need), device=fabric.device), reduce_op="sum"))
        free = shutil.disk_usage(self.folder if self.folder.exists() else self.folder.parent).free
        last = self.complete()
        kept = (f"the last complete checkpoint, {last[-1]}, is intact: free space (or move --out-dir) and continue with "
                f"--resume auto --run-name {self.folder.parent.name}") if last else \
            "no checkpoint of this run was complete yet: free space (or choose another --out-dir) and start it again"
        return (f"no space left to write the checkpoint of step {step} into {self.folder}: it needs about "
                f"{need / 2**20:,.1f} MiB and the disk has {free / 2**20:,.1f} MiB free"
                f"{f' ({problem.strerror})' if problem else ' (on another process)'}. The partial checkpoint was removed; "
                f"{kept}")

    def resolve(self, resume: str) -> list[Path]:
        """Candidates for --resume, newest first: `auto` lists this run's checkpoints, a path names one."""
        if resume == "auto":
            return list(reversed(self.complete()))
        path = checkpoint_folder(resume)
        if not (path / "state").exists() or not STEP_DIR.match(path.name):
            raise ResumeError(f"--resume {resume}: no checkpoint there (expected a folder with `state` and "
                              f"`config.json`, such as {self.folder}/step-00000100). Fix: pass such a folder or `auto`.")
        return [path]

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
                check_config(saved)
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

    def _agreed_ok(self, fabric, path: Path, why: str | None, resume: str) -> bool:
        (bad,) = any_rank(fabric, why is not None)
        if not bad:
            return True
        why = why or "another process could not read its part"
        if resume != "auto":
            raise ResumeError(f"checkpoint {path} cannot be loaded: {why}. Fix: resume from another checkpoint "
                              f"(--resume auto picks the newest good one) or start a new run.")
        fabric.print(f"warning: skipping checkpoint {path}: {why}", file=sys.stderr)
        return False

    def abandon_newer(self, fabric, loaded: Path) -> None:
        """Checkpoints newer than the one resumed belong to a branch this run no longer follows; moved
        aside (not deleted), so they neither outrank new saves in pruning nor get picked by `auto`."""
        if fabric.global_rank == 0:
            newer = [p for p in self.complete() if step_of(p) > step_of(loaded)]
            if newer:
                aside = self.folder / f"abandoned-{datetime.now():%Y%m%d-%H%M%S}"
                aside.mkdir(parents=True, exist_ok=True)
                for p in newer:
                    os.replace(p, aside / p.name)
                fabric.print(f"moved {len(newer)} newer checkpoint(s) of the abandoned branch to {aside}")
        fabric.barrier()


def checkpoint_folder(resume: str) -> Path:
    path = Path(resume)
    return path.parent if path.name == "state" else path


def resume_run_name(resume: str, out_dir: str, kind: str) -> str:
    """The run a --resume refers to: a checkpoint folder's run, or for `auto` the newest `<kind>-*` run
    under out_dir that has a complete checkpoint."""
    if resume != "auto":
        return checkpoint_folder(resume).resolve().parent.parent.name  # <out_dir>/<run>/checkpoints/step-N
    runs = [p.parent.parent for p in Path(out_dir).glob(f"{kind}-*/checkpoints/step-*") if STEP_DIR.match(p.name)]
    if not runs:
        raise ResumeError(f"--resume auto: no {kind} run with a checkpoint under {out_dir}/. "
                          "Fix: start a run without --resume, or pass --run-name of a run that has one.")
    return max(runs, key=lambda p: max(c.stat().st_mtime for c in (p / "checkpoints").iterdir())).name


def check_same_experiment(saved: dict, current: dict, runtime_fields: set[str], where: str,
                          added: dict | None = None) -> None:
    """Refuse to continue a checkpoint under settings that change what it means; list every difference.
    A setting the checkpoint does not record predates it: `added` gives the value the older code behaved as;
    a setting without one is a difference too, since what the checkpoint did is unknown."""
    added, unknown = added or {}, "not recorded (made before the setting existed)"
    diffs = {}
    for k, now in current.items():
        if k in runtime_fields:
            continue
        was = saved[k] if k in saved else added.get(k, unknown)
        if was != now:
            diffs[k] = (was, now)
    if diffs:
        listing = ", ".join(f"{k}: checkpoint {a if a is unknown else repr(a)} vs now {b!r}" for k, (a, b) in sorted(diffs.items()))
        raise ResumeError(f"cannot resume {where}: the checkpoint was made with other settings ({listing}). "
                          "Fix: resume with the checkpoint's settings, or start a new run with another --run-name.")


# ----------------------------------------------------------------------------- clean stops
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


def disk_full(write) -> OSError | None:
    """Run `write`; return its error when the disk (or the quota) was full, raise any other."""
    try:
        write()
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            return e
        raise
    return None


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


def any_rank(fabric, *flags: bool) -> tuple[bool, ...]:
    """Each flag OR-ed across ranks, so every rank takes the same branch (one all-reduce when distributed)."""
    if fabric.world_size == 1:
        return tuple(flags)
    summed = fabric.all_reduce(torch.tensor([float(f) for f in flags], device=fabric.device), reduce_op="sum")
    return tuple(bool(v > 0) for v in summed)


class Stopped(Exception):
    """Raised by train() after a clean stop has been saved; the exit code follows the shell's convention, except for
    a SLURM requeue, which is not a failure (0)."""

    def __init__(self, signal_name: str, requeued: bool = False):
        super().__init__(signal_name)
        self.exit_code = 0 if requeued else 128 + int(getattr(signal, signal_name, signal.SIGINT))


def progress_bar(fabric, iterable, total: int, desc: str):
    """A tqdm bar on rank 0 when attached to a terminal; the plain iterable otherwise (CI, logs, pipes)."""
    if not (fabric.is_global_zero and sys.stdout.isatty()):
        return iterable
    from tqdm import tqdm

    return tqdm(iterable, total=total, desc=desc, leave=False, unit="batch")


def nonfinite_message(loss: float, step: int, where: str, last_checkpoint, precision: str) -> str:
    saved = f"the last good checkpoint is {last_checkpoint}" if last_checkpoint else "no checkpoint was saved yet"
    reduced = "" if precision.startswith(("32", "64")) else f"overflow in {precision} (try --precision 32-true), "
    return (f"loss became {loss} at step {step} ({where}); training stopped instead of continuing on garbage, "
            f"and {saved}. Likely causes: a learning rate too high (start a new run with a lower --lr or a longer "
            f"warm-up), {reduced}or NaN/inf in the input data.")


# ----------------------------------------------------------------------------- the lifecycle
class Run:
    """One training run, the same for both scripts: the run name agreed by all ranks, its folder and
    TensorBoard logger, resume (or a clear refusal), checkpoints, clean stops and the final record.
    train() receives this object as its context."""

    def __init__(self, fabric, cfg, kind: str, runtime_fields: set[str], state: dict, check_config=None,
                 per_rank_checkpoints: bool = False, added_fields: dict | None = None, identity: dict | None = None):
        from lightning.fabric.loggers import TensorBoardLogger

        self.fabric, self.cfg, self.kind, self.state = fabric, cfg, kind, state
        self.runtime_fields, self.added_fields = runtime_fields, added_fields
        self.identity = identity or {}  # what the run depends on beside its flags (a corpus, a tokenizer): by content
        self.check_config = check_config or (lambda saved: None)
        # A default name holds the start time: rank 0's is broadcast so all ranks write to one folder.
        cfg.run_name = fabric.broadcast(cfg.run_name or unused_name(cfg.out_dir, f"{kind}-{default_name(cfg)}-"
                                                                                 f"{datetime.now():%Y%m%d-%H%M%S}"))
        self.dir = Path(cfg.out_dir) / cfg.run_name
        self.logger = TensorBoardLogger(root_dir=cfg.out_dir, name=cfg.run_name, version="")
        self.ckpts = Checkpoints(self.dir / "checkpoints", cfg.keep_last, per_rank_checkpoints)
        self.last_checkpoint: Path | None = None
        self.stop: StopRequest | None = None
        fabric.print(f"config: {self.config()}")

    def config(self) -> dict:
        return {"kind": self.kind, **dataclasses.asdict(self.cfg), **self.identity}

    def start(self) -> None:
        """Resume if asked (or refuse with the fix), then record the config the run continues under."""
        fabric, cfg = self.fabric, self.cfg
        watch_ranks(fabric, self.resume_hint)
        watch_peers(fabric, self.resume_hint, cfg.num_nodes, cfg.node_timeout,
                    f"{cfg.run_name}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}")
        if fabric.global_rank == 0:
            self.ckpts.clean_partial()
        fabric.barrier()
        if cfg.resume:
            def check(saved):
                self.check_config(saved)
                check_same_experiment(saved, self.config(), self.runtime_fields, f"run {cfg.run_name}", self.added_fields)

            loaded = self.ckpts.load(fabric, self.state, cfg.resume, check)
            if loaded is None:
                raise ResumeError(f"--resume {cfg.resume}: no usable checkpoint in {self.ckpts.folder}. "
                                  "Fix: start the run again without --resume.")
            self.ckpts.abandon_newer(fabric, loaded)
            self.last_checkpoint = loaded
            fabric.print(f"resumed from {loaded}")
        if fabric.is_global_zero:
            write_json_atomic(self.dir / "config.json", self.config())
            # Open TensorBoard's writer now: made lazily, at the first logged step, its import and file
            # creation (about 40 ms on the Xeon) were counted as training time, 1% of the short LeNet-5 recipe.
            _ = self.logger.experiment

    def save(self, step: int) -> Path:
        with PeerWatch.current.busy() if PeerWatch.current else contextlib.nullcontext():
            self.last_checkpoint = self.ckpts.save(self.fabric, self.state, step, self.config())
        return self.last_checkpoint

    def resume_hint(self) -> str:
        last = self.ckpts.complete()
        return (f"the last complete checkpoint is {last[-1]}: continue with --resume auto --run-name {self.cfg.run_name}"
                if last else "no checkpoint was complete: start the run again")

    def stopped(self) -> Stopped:
        """After a signal: the checkpoint is saved; say how to continue (in a SLURM job asked to requeue, requeue it
        first: rank 0, once) and return the exception to raise."""
        name = self.stop.signal_name if self.stop else "SIGINT"
        resume = f"--resume auto --run-name {self.cfg.run_name}"
        if self.stop and self.stop.requeue:
            said = requeue_slurm_job(resume) if self.fabric.is_global_zero else ""
            self.fabric.print(f"{name} received: saved {self.last_checkpoint}; {said}", flush=True)
            return Stopped(name, requeued=True)
        self.fabric.print(f"{name} received: saved {self.last_checkpoint}; resume with {resume}")
        return Stopped(name)

    def finish(self, record: dict, metrics: dict | None = None) -> dict:
        record = {"kind": self.kind, "run_dir": str(self.dir), **record, "config": self.config(), "env": environment()}
        if PeerWatch.current:  # from here ranks leave one by one (and rank 0 may take the store with it)
            PeerWatch.current.finish()
        if self.fabric.is_global_zero:
            problem = disk_full(lambda: write_json_atomic(self.dir / RECORD, record))
            if problem:
                raise DiskFull(f"no space left to write {self.dir / RECORD} ({len(json.dumps(record, default=str)):,} "
                               f"bytes; {shutil.disk_usage(self.dir).free:,} free): the training finished and its last "
                               f"checkpoint, {self.last_checkpoint}, is intact; free space and run again with "
                               f"--resume auto --run-name {self.cfg.run_name} to write the record")
            self.logger.log_hyperparams(dataclasses.asdict(self.cfg), metrics)
            self.logger.finalize("success")
        return record


def unused_name(out_dir, name: str) -> str:
    """`name`, or `name-2`, `name-3`, ... when runs started in the same second already took it."""
    taken = lambda n: (Path(out_dir) / n).exists()  # noqa: E731
    return name if not taken(name) else next(f"{name}-{i}" for i in range(2, 10**6) if not taken(f"{name}-{i}"))


def default_name(cfg) -> str:
    return getattr(cfg, "activation", None) or f"{cfg.model}-{cfg.strategy}"


def refuse_existing_run(cfg) -> None:
    """A new run never writes into an earlier run's folder (its record, checkpoints and TensorBoard events
    would be mixed with or replace the earlier ones). Every rank checks before any rank starts writing:
    the launcher's rendezvous comes after this check."""
    folder = Path(cfg.out_dir) / cfg.run_name
    if cfg.run_name and folder.is_dir() and any(folder.iterdir()):
        raise ConfigError(f"run {folder} exists; a new run does not overwrite it. Fix: continue it with --resume auto "
                          f"--run-name {cfg.run_name}, or start a new run with another --run-name (or remove the folder)")


def resume_or_start(cfg, kind: str, finished) -> dict | None:
    """--resume auto, set once and forgotten (as Lightning's ckpt_path="last"): continue the run when it has a
    checkpoint, start it when it has none (one line says so), and when its record says the same settings already
    reached what this command asks for, return that record: a requeued job that finished must not train twice (other
    settings take the ordinary way: continue, or be refused with the difference). Every rank decides the same, from
    the same files, before any rank writes."""
    if not cfg.run_name:
        try:
            cfg.run_name = resume_run_name("auto", cfg.out_dir, kind)
        except ResumeError:
            print(f"--resume auto: no {kind} run with a checkpoint under {cfg.out_dir}/: starting a new run", flush=True)
            cfg.resume = ""
            return None
    folder = Path(cfg.out_dir) / cfg.run_name
    record = read_record(folder)
    where = ("kind", "resume", "run_name", "out_dir")  # how the command names the run, not what it asks for
    same = record is not None and {k: v for k, v in record.get("config", {}).items() if k not in where} == {
        k: v for k, v in dataclasses.asdict(cfg).items() if k not in where}
    if same and record.get("kind") == kind and finished(record, cfg):  # the same command again: a requeued job
        print(f"--resume auto: run {folder} has finished (its record.json holds step {record.get('steps')}); "
              f"nothing to train", flush=True)
        return record
    if not Checkpoints(folder / "checkpoints").complete():
        print(f"--resume auto: {folder} has no checkpoint yet: starting the run", flush=True)
        cfg.resume = ""
    return None


def run_main(cfg, kind: str, validate, run, errors: tuple = (), finished=lambda record, cfg: False, argv=None):
    """What both scripts' main() do: validate, find the run a --resume means (or start or skip it: resume_or_start),
    run it, and turn every expected failure into one line `error: ...` (exit 1) and a clean stop into 128 + the
    signal number. `finished(record, cfg)`: the record of an earlier run reached what cfg asks for; `argv`: the
    command line cfg came from (to tell the flags given from the defaults under `fabric run`)."""
    PeerWatch.current = None
    try:
        take_fabric_run_settings(cfg, sys.argv[1:] if argv is None else argv)
        validate(cfg)
        auto = cfg.resume == "auto" and not getattr(cfg, "plan", False)
        if auto and (done := resume_or_start(cfg, kind, finished)) is not None:
            return done
        if cfg.resume and not cfg.run_name:
            cfg.run_name = resume_run_name(cfg.resume, cfg.out_dir, kind)
        if not cfg.resume and not auto and not getattr(cfg, "plan", False):
            refuse_existing_run(cfg)
        return run(cfg)
    except (ConfigError, ResumeError, NonFiniteLoss, DiskFull, *errors) as e:
        sys.exit(f"error: {e}")
    except RuntimeError as e:  # a collective whose peer died
        if not any(s in str(e) for s in LOST_PEER):
            raise
        if PeerWatch.current:  # a rank on another node: the store says which, within two seconds
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the launcher's stop would cut the message short
            cause = re.sub(r"^\[[^\]]*\] ", "", str(e).splitlines()[0])[:120]  # without gloo's source location
            sys.exit(f"error: {PeerWatch.current.lost()} ({cause}). This rank stops; "
                     f"{PeerWatch.current.after()}")
        time.sleep(3)  # a rank on this machine: the rank watch names it, given a moment
        sys.exit(f"error: another process of this run stopped answering ({str(e).splitlines()[0][:160]}); see its "
                 f"output above, and resume from the last complete checkpoint with --resume auto")
    except Stopped as e:
        sys.exit(e.exit_code)


class Stopwatch:
    """Training time kept in progress.train_time_s (so it survives a resume), excluding pauses."""

    def __init__(self, progress: Progress):
        self.progress, self.mark = progress, time.perf_counter()

    def pause(self) -> None:
        now = time.perf_counter()
        self.progress.train_time_s += now - self.mark
        self.mark = now

    def resume(self) -> None:
        self.mark = time.perf_counter()

    @contextlib.contextmanager
    def paused(self):
        self.pause()
        yield
        self.resume()


class StepTimer:
    """Each step's duration without making the host wait for the device: on a GPU a CUDA event is recorded on the
    stream before and after the step and the pairs are read at the next check point, after one synchronisation
    (timing a step by synchronising around it would empty the launch queue every step); on a CPU the clock.
    `collect()` returns [(seconds, timed)] of the steps since the last call, in order (timed: stop()'s flag, whether
    the step counts in the timing figures)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.pending: list = []
        self.begun = None

    def start(self) -> None:
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
