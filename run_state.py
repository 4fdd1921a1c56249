"""What both training scripts need to lose nothing: atomic checkpoints, resume, clean stops, run records.

A checkpoint is a folder `runs/<run>/checkpoints/step-00001234/` holding `state` (written by `fabric.save`:
one file, or a folder of shards under DeepSpeed) and `config.json`. It is written under a `.partial`
name and renamed when every rank has finished, so a folder without that suffix is always complete.
"""

import json
import os
import platform
import shutil
import signal
import sys
import tempfile
from pathlib import Path

import torch

PARTIAL = ".partial"


class ResumeError(RuntimeError):
    """A checkpoint that cannot be used, with the reason and the fix."""


class ConfigError(ValueError):
    """Settings that cannot work here, refused before any data or model is touched."""


def check_hardware(accelerator: str, devices: int, precision: str) -> bool:
    """Refuse device settings this machine cannot honour; return whether the run will use CUDA GPUs."""
    gpu = accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available())
    if accelerator in ("gpu", "cuda") and not torch.cuda.is_available():
        raise ConfigError("--accelerator gpu: no CUDA GPU is visible here; use --accelerator cpu (or auto)")
    if gpu and devices > torch.cuda.device_count():
        raise ConfigError(f"--devices {devices}: only {torch.cuda.device_count()} GPU(s) visible")
    if not gpu and devices > (os.cpu_count() or 1):
        raise ConfigError(f"--devices {devices}: this machine has {os.cpu_count()} CPU cores; use at most that many processes")
    if precision == "16-mixed" and not gpu:
        raise ConfigError("--precision 16-mixed needs a GPU (float16 loss scaling); on CPU use bf16-mixed or 32-true")
    return gpu


def write_json_atomic(path, obj) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=PARTIAL)
    with os.fdopen(fd, "w") as f:
        json.dump(obj, f, indent=2, default=str)
    os.replace(tmp, path)


def environment() -> dict:
    """Library versions and hardware, recorded with every run so results can be compared honestly."""
    import lightning

    env = {"python": platform.python_version(), "torch": torch.__version__, "lightning": lightning.__version__,
           "platform": platform.platform(), "cpu": cpu_name(), "cpu_threads": torch.get_num_threads(),
           "cuda": torch.version.cuda, "gpu": None, "gpu_count": 0}
    for module in ("transformers", "deepspeed", "torchmetrics"):
        if module in sys.modules:
            env[module] = getattr(sys.modules[module], "__version__", None)
    if torch.cuda.is_available():
        env["gpu"], env["gpu_count"] = torch.cuda.get_device_name(0), torch.cuda.device_count()
    return env


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


# ----------------------------------------------------------------------------- checkpoints
class Checkpoints:
    """Numbered, atomically written checkpoints in one folder, keeping the newest `keep_last`."""

    def __init__(self, folder, keep_last: int = 3):
        self.folder, self.keep_last = Path(folder), keep_last

    def complete(self) -> list[Path]:
        """Complete checkpoints, oldest first."""
        if not self.folder.is_dir():
            return []
        return sorted(p for p in self.folder.glob("step-*") if p.is_dir() and not p.name.endswith(PARTIAL))

    def save(self, fabric, state: dict, step: int, config: dict) -> Path:
        final = self.folder / f"step-{step:08d}"
        partial = final.with_name(final.name + PARTIAL)
        if fabric.global_rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(parents=True)
            write_json_atomic(partial / "config.json", config)
        fabric.barrier()
        fabric.save(partial / "state", state)
        fabric.barrier()  # every rank's shard is on disk before the folder is declared complete
        if fabric.global_rank == 0:
            shutil.rmtree(final, ignore_errors=True)
            os.replace(partial, final)
            for old in self.complete()[:-self.keep_last] if self.keep_last > 0 else []:
                shutil.rmtree(old, ignore_errors=True)
        fabric.barrier()
        return final

    def resolve(self, resume: str) -> list[Path]:
        """Candidates for --resume, newest first: `auto` lists this run's checkpoints, a path names one."""
        if resume == "auto":
            return list(reversed(self.complete()))
        path = Path(resume)
        if path.name == "state":
            path = path.parent
        if not (path / "state").exists():
            raise ResumeError(f"--resume {resume}: no checkpoint there (expected a folder with `state` and "
                              f"`config.json`, such as {self.folder}/step-00000100). Fix: pass such a folder or `auto`.")
        return [path]

    def load(self, fabric, state: dict, resume: str, check_config) -> Path | None:
        """Load the newest usable candidate into `state`; with `auto`, skip unreadable ones with a warning.

        `check_config(saved_config)` raises ResumeError when the checkpoint belongs to another experiment;
        that is never skipped, since an older checkpoint of the same run would be refused just the same.
        """
        candidates = self.resolve(resume)
        for path in candidates:
            try:
                saved = json.loads((path / "config.json").read_text())
            except (OSError, ValueError) as e:
                self._unreadable(fabric, path, f"config.json unreadable ({e})", resume)
                continue
            check_config(saved)
            try:
                fabric.load(path / "state", state)
            except Exception as e:  # torch/zip/pickle/DeepSpeed errors differ; all mean "this one is bad"
                self._unreadable(fabric, path, f"{type(e).__name__}: {e}", resume)
                continue
            return path
        return None

    @staticmethod
    def _unreadable(fabric, path: Path, why: str, resume: str) -> None:
        if resume != "auto":
            raise ResumeError(f"checkpoint {path} cannot be loaded: {why}. Fix: resume from another checkpoint "
                              f"(--resume auto picks the newest good one) or start a new run.")
        fabric.print(f"warning: skipping checkpoint {path}: {why}", file=sys.stderr)


def resume_run_name(resume: str, out_dir: str, prefix: str) -> str:
    """The run a --resume refers to: a checkpoint folder's run, or for `auto` the newest `<prefix>-*` run
    under out_dir that has a complete checkpoint."""
    if resume != "auto":
        return Path(resume).resolve().parent.parent.name  # <out_dir>/<run>/checkpoints/step-N
    runs = [p.parent.parent for p in Path(out_dir).glob(f"{prefix}-*/checkpoints/step-*")
            if p.is_dir() and not p.name.endswith(PARTIAL)]
    if not runs:
        raise ResumeError(f"--resume auto: no {prefix} run with a checkpoint under {out_dir}/. "
                          "Fix: start a run without --resume, or pass --run-name of a run that has one.")
    return max(runs, key=lambda p: max(c.stat().st_mtime for c in (p / "checkpoints").iterdir())).name


def parse_config(config_class, argv, description: str, choices: dict):
    """argparse built from a config dataclass: one flag per field (--some-field), its default and type,
    `choices` where given, --x/--no-x for booleans."""
    import argparse
    import dataclasses

    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    for f in dataclasses.fields(config_class):
        flag = "--" + f.name.replace("_", "-")
        if f.type is bool or f.type == "bool":
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
        else:
            parser.add_argument(flag, type=type(f.default), default=f.default, choices=choices.get(f.name))
    return config_class(**vars(parser.parse_args(argv)))


def check_same_experiment(saved: dict, current: dict, runtime_fields: set[str], where: str) -> None:
    """Refuse to continue a checkpoint under settings that change what it means; list every difference."""
    diffs = {k: (saved.get(k), current.get(k)) for k in current
             if k not in runtime_fields and k in saved and saved.get(k) != current.get(k)}
    if diffs:
        listing = ", ".join(f"{k}: checkpoint {a!r} vs now {b!r}" for k, (a, b) in sorted(diffs.items()))
        raise ResumeError(f"cannot resume {where}: the checkpoint was made with other settings ({listing}). "
                          "Fix: resume with the checkpoint's settings, or start a new run with another --run-name.")


# ----------------------------------------------------------------------------- clean stops
class StopRequest:
    """SIGINT/SIGTERM set a flag; the loop stops at the next step boundary after saving. A second
    signal of the same kind falls back to the default behaviour, so a stuck run can still be killed."""

    def __enter__(self):
        self.signal_name = None
        self.previous = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGINT, signal.SIGTERM)}
        return self

    def __exit__(self, *exc):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame):
        self.signal_name = signal.Signals(signum).name
        signal.signal(signum, signal.SIG_DFL if signum == signal.SIGTERM else signal.default_int_handler)

    def requested(self, fabric, *other_flags: bool) -> tuple[bool, ...]:
        """(any rank signalled, *any rank's other_flags), agreed by all ranks in one small all-reduce."""
        return any_rank(fabric, self.signal_name is not None, *other_flags)


def any_rank(fabric, *flags: bool) -> tuple[bool, ...]:
    """Each flag OR-ed across ranks, so every rank takes the same branch (one all-reduce when distributed)."""
    if fabric.world_size == 1:
        return tuple(flags)
    summed = fabric.all_reduce(torch.tensor([float(f) for f in flags], device=fabric.device), reduce_op="sum")
    return tuple(bool(v > 0) for v in summed)


def progress_bar(fabric, iterable, total: int, desc: str):
    """A tqdm bar on rank 0 when attached to a terminal; the plain iterable otherwise (CI, logs, pipes)."""
    if not (fabric.is_global_zero and sys.stdout.isatty()):
        return iterable
    from tqdm import tqdm

    return tqdm(iterable, total=total, desc=desc, leave=False, unit="batch")


class NonFiniteLoss(RuntimeError):
    pass


def nonfinite_message(loss: float, step: int, where: str, last_checkpoint, precision: str) -> str:
    saved = f"the last good checkpoint is {last_checkpoint}" if last_checkpoint else "no checkpoint was saved yet"
    reduced = "" if precision.startswith(("32", "64")) else f"overflow in {precision} (try --precision 32-true), "
    return (f"loss became {loss} at step {step} ({where}); training stopped instead of continuing on garbage, "
            f"and {saved}. Likely causes: a learning rate too high (start a new run with a lower --lr or a longer "
            f"warm-up), {reduced}or NaN/inf in the input data.")
