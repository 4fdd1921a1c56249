"""The lifecycle both training scripts share, in the order main() goes through it: which run a command means
(`find_run`: a new one, one to continue, or one that already finished), the run's folder, logger, resume and record
(`Run`), and the exits (`exits`: an expected failure is one line `error: ...`, exit 1; a clean stop 128 + the
signal). Checkpoints: checkpoints.py; signals and SLURM: stops.py; the step's watches: step_watch.py.

A run lives in `runs/<run>/`: `config.json` and `record.json` (both carry `kind`: "lenet" or "gpt"), TensorBoard
events and `checkpoints/`.
"""

import atexit
import contextlib
import dataclasses
import json
import os
import platform
import re
import signal
import sys
import time
from datetime import datetime
from pathlib import Path

import torch

from core.run import flags, folder_lock, full_disk, outputs
from core.run.checkpoints import (STEP_DIR, Checkpoints, ResumeError, checkpoint_folder, damaged_files, not_a_checkpoint,
                                  write_in_place)
from core.run.files import RECORD, DiskFull, disk_full, free_bytes, read_record, why_full, write_json_atomic
from core.run.flags import ConfigError
from core.run.hardware import cpu_name
from core.run.ranks import (AGREED_END, LOST_PEER, PeerWatch, any_rank, first_process, global_rank, launcher, watch_peers,
                             watch_ranks)
from core.run.step_watch import NonFiniteLoss
from core.run.stops import Stopped, StoppedAtOnce, StopRequest, requeue_slurm_job, say


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


# ----------------------------------------------------------------------------- exits
@contextlib.contextmanager
def exits(*errors):
    """Around a script's main(): every expected failure (bad settings, a checkpoint that cannot be used, a non-finite
    loss, a full disk, and the script's own `errors`) ends in one line `error: ...` and exit 1, a lost peer in one
    line naming it, and a clean stop in 128 + the signal number (0 for a SLURM requeue). Yields the run's
    StopRequest: once main() calls its listen(), a signal saves and stops the run (stops.py)."""
    PeerWatch.current = None
    AGREED_END.clear()
    full_disk.clear()
    full_disk.quiet_threads()  # TensorBoard's writer thread meeting a full disk: noted, without its traceback
    console = outputs.guard_console()  # stdout and stderr on the disk that filled: noted too
    stop = StopRequest()
    try:
        yield stop
        if (noted := full_disk.noted()) is not None:  # met after the last point where the ranks met (the summary)
            raise DiskFull(full_disk.message(noted))
        end_process_group()
    except (folder_lock.FolderBusy, DiskFull, ConfigError, ResumeError, NonFiniteLoss, *errors) as e:
        # a busy folder, a full disk and an agreed refusal stop every rank of the run: rank 0 says so, once
        if isinstance(e, (folder_lock.FolderBusy, DiskFull)) or getattr(e, "every_rank", False):
            AGREED_END.set()  # the other ranks end with this one: their exits are no news to the rank watch
            sys.exit(f"error: {e}" if global_rank() == 0 else 1)
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
    except KeyboardInterrupt as e:  # Ctrl-C twice, or once before the handlers listen (set-up): no traceback
        how = "again: stopped at once, without a save" if isinstance(e, StoppedAtOnce) else "during set-up: stopped"
        say(f"SIGINT received {how}; every complete checkpoint of this run stays (saves are atomic), and --resume auto "
            "continues from the newest")
        sys.exit(128 + signal.SIGINT)
    finally:
        stop.close()
        folder_lock.release_all()
        outputs.restore(console)


def end_process_group() -> None:
    """A run that ended well takes its process group down itself (Fabric leaves it up): left to the interpreter's exit,
    its threads were once torn down mid-call ("terminate called without an active exception", SIGABRT) after a
    two-node ZeRO-3 run had written its record."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


@contextlib.contextmanager
def exit_without_teardown():
    """Around a script's main() run as its own process: it ends as the exit would (the status and message of any
    sys.exit, atexit's handlers: logging, multiprocessing's finalizers, ..., the output flushed), without the
    interpreter's teardown. Tearing down torch, Lightning and transformers object by object takes about 2 s of CPU in
    every rank, and a run that ended, stopped on a signal or failed with its message needs none of it; its files
    are closed by then. Left to the teardown, a signalled rank of a SLURM job aborted in 3 of 16 tries ("terminate
    called without an active exception": a C++ thread still joinable, exit status 134 instead of 0)."""
    code = 0
    try:
        yield
    except SystemExit as e:
        code = e.code
    if isinstance(code, str):
        with contextlib.suppress(OSError):  # a console on a full disk says nothing more; the exit status still tells
            print(code, file=sys.stderr)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError):
            stream.flush()
    os._exit(0 if code is None else code if isinstance(code, int) else 1)


# ----------------------------------------------------------------------------- which run
def find_run(cfg, kind: str, finished, identity: dict | None = None) -> dict | None:
    """The run this command means, decided by every rank from the same files before any rank writes: a new one
    (never into an earlier run's folder), one to continue (--resume: its folder's name goes into cfg.run_name), or,
    for --resume auto of a run whose record shows the same experiment (`identity`: what it trained on beside its
    flags) already reached what cfg asks for (`finished(record, cfg)`), that record, returned so that a requeued job
    that finished does not train twice."""
    asked = cfg.resume  # --resume auto may turn into a start (nothing to resume), in the run's own folder
    if cfg.resume == "auto" and cfg.run_name and first_process():  # before reading a folder another run writes
        folder_lock.refuse_if_held(Path(cfg.out_dir) / cfg.run_name)
    if cfg.resume == "auto" and (done := resume_or_start(cfg, kind, finished, identity or {})) is not None:
        return done
    if cfg.resume not in ("", "auto") and (why := not_a_checkpoint(cfg.resume)):
        raise ResumeError(why)  # before any process starts, rather than in Run once they have
    if cfg.resume and not cfg.run_name:
        cfg.run_name = resume_run_name(cfg.resume, cfg.out_dir, kind)
    if cfg.run_name and first_process():  # a run already writing there (its other ranks learn it in Run)
        folder_lock.refuse_if_held(Path(cfg.out_dir) / cfg.run_name)
    if not asked:
        refuse_existing_run(cfg)
    if cfg.run_name:  # what the folder held at this look: Run.hold_folder refuses what another run wrote since
        _looked[str(Path(cfg.out_dir) / cfg.run_name)] = run_files(Path(cfg.out_dir) / cfg.run_name)
    return None


_looked: dict[str, set] = {}  # run folder -> its run files when find_run looked (this process)


def run_files(folder: Path) -> set[str]:
    """What every run writes into its folder once it holds it, as far as `folder` has them (a ZeRO-Infinity run's
    own swap files may be there before it holds it)."""
    return {name for name in ("config.json", "record.json", "checkpoints") if (folder / name).exists()}


def resume_run_name(resume: str, out_dir: str, kind: str) -> str:
    """The run a --resume refers to: a checkpoint folder's run, or for `auto` the newest `<kind>-*` run
    under out_dir that has a complete checkpoint."""
    if resume != "auto":
        return checkpoint_folder(resume).resolve().parent.parent.name  # <out_dir>/<run>/checkpoints/step-N
    runs = [p.parent.parent for p in Path(out_dir).glob(f"{kind}-*/checkpoints/step-*") if STEP_DIR.match(p.name)]
    if not runs:
        raise ResumeError(f"--resume auto: no {kind} run with a checkpoint under {out_dir}/. "
                          "Fix: start a run without --resume, or pass --run-name of a run that has one.")
    newest = lambda run: max(c.stat().st_mtime for c in (run / "checkpoints").iterdir() if STEP_DIR.match(c.name))  # noqa: E731
    return max(runs, key=newest).name  # by its checkpoints alone: a folder set aside (abandoned-*) is not one


def resumed_config(resume: str, out_dir: str, run_name: str, kind: str) -> dict:
    """With --resume, the settings the run being resumed recorded (its config.json), or {} where there is none yet
    (find_run says so, or starts the run). A setting a flag leaves to the script takes the run's own from here: a
    fresh choice (a measurement near its margin, a sample count from another --steps) would refuse the resume."""
    if not resume:
        return {}
    folders = [] if resume == "auto" else [checkpoint_folder(resume).resolve().parent.parent]  # the checkpoint's run
    try:
        folders.append(Path(out_dir) / (run_name or resume_run_name(resume, out_dir, kind)))
    except ResumeError:
        pass
    for folder in folders:
        try:
            saved = json.loads((folder / "config.json").read_text())
        except (OSError, ValueError):
            continue
        if isinstance(saved, dict):
            return saved
    return {}


def take_resumed_choices(cfg, kind: str, names: tuple, usable=lambda name, value: True) -> dict:
    """The settings `names` that are auto on cfg set to what the run being resumed recorded, where `usable` accepts
    it here: a choice measured again near its margin could come out otherwise, and the resumed run would then be
    refused as another setting or round otherwise than the uninterrupted one. Returns what it took."""
    pending = [name for name in names if getattr(cfg, name) == "auto"]
    saved = resumed_config(cfg.resume, cfg.out_dir, cfg.run_name, kind) if pending else {}
    taken = {name: saved[name] for name in pending
             if saved.get(name) not in (None, "auto") and usable(name, saved[name])}
    for name, value in taken.items():
        setattr(cfg, name, value)
    return taken


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


# ----------------------------------------------------------------------------- the run
class Run:
    """One training run, the same for both scripts: the run name agreed by all ranks, its folder and
    TensorBoard logger, resume (or a clear refusal), checkpoints, clean stops and the final record.
    train() receives this object as its context."""

    def __init__(self, fabric, cfg, kind: str, state: dict, stop: StopRequest, check_config=None,
                 per_rank_checkpoints: bool = False, identity: dict | None = None, checkpoint_bytes: float = 0.0,
                 not_resumable: str = ""):
        self.fabric, self.cfg, self.kind, self.state = fabric, cfg, kind, state
        self.runtime_fields, self.added_fields = flags.runtime_fields(cfg), flags.recorded_since(cfg)
        self.identity = identity or {}  # what the run depends on beside its flags (a corpus, a tokenizer): by content
        self.check_config = check_config or (lambda saved: None)
        # A default name holds the start time: rank 0's is broadcast so all ranks write to one folder.
        cfg.run_name = fabric.broadcast(cfg.run_name or unused_name(cfg.out_dir, f"{kind}-{default_name(cfg)}-"
                                                                                 f"{datetime.now():%Y%m%d-%H%M%S}"))
        self.dir = Path(cfg.out_dir) / cfg.run_name
        self.hold_folder()
        self.logger = outputs.EventLogger(root_dir=cfg.out_dir, name=cfg.run_name, version="")
        self.ckpts = Checkpoints(self.dir / "checkpoints", cfg.keep_last, per_rank_checkpoints, checkpoint_bytes,
                                 not_resumable)
        write_in_place(fabric.strategy)
        full_disk.continue_with(self.ckpts.kept)  # a full disk met anywhere names the last checkpoint on disk
        self.last_checkpoint: Path | None = None
        self.stop = stop  # requested() at step boundaries; its signal names the stop
        fabric.print(f"config: {self.config()}")

    def config(self) -> dict:
        return {"kind": self.kind, **dataclasses.asdict(self.cfg), **self.identity}

    def hold_folder(self) -> None:
        """Rank 0 takes the run folder's lock before anything is written into it; every rank stops if another
        process holds it (two runs started together, both past find_run's look)."""
        who = folder_lock.hold(self.dir) if self.fabric.global_rank == 0 else None  # its name on a full disk: noted
        if any_rank(self.fabric, who is not None)[0]:
            raise folder_lock.FolderBusy(folder_lock.busy_message(self.dir, self.fabric.broadcast(who)))
        # a run started with this one that trained and ended between find_run's look and this lock left its files
        looked = _looked.get(str(self.dir))
        written = self.fabric.global_rank == 0 and looked is not None and bool(run_files(self.dir) - looked)
        if any_rank(self.fabric, written)[0]:  # exits() gives the lock back
            raise folder_lock.FolderBusy(f"run {self.dir} exists; a new run does not overwrite it (another run started "
                                         f"with this one wrote it meanwhile). Fix: continue it with --resume auto "
                                         f"--run-name {self.cfg.run_name}, or start a new run with another --run-name")

    def start(self) -> None:
        """Resume if asked (or refuse with the fix), then record the config the run continues under."""
        fabric, cfg = self.fabric, self.cfg
        watch_ranks(fabric, self.resume_hint)
        watch_peers(fabric, self.resume_hint, cfg.num_nodes, cfg.node_timeout,
                    f"{cfg.run_name}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}")
        if fabric.global_rank == 0:
            self.ckpts.clean_partial()
            if not cfg.resume:  # started over in a folder whose checkpoints are all damaged (resume_or_start)
                self.ckpts.set_aside(self.ckpts.complete(), "damaged")
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
            full_disk.guarded("the run's config.json", self.dir, lambda: write_json_atomic(self.dir / "config.json",
                                                                                           self.config()))
            # Open TensorBoard's writer now: made lazily, at the first logged step, its import and file
            # creation (about 40 ms on the Xeon) were counted as training time, 1% of the short LeNet-5 recipe.
            _ = self.logger.experiment
        full_disk.agree(fabric)  # the disk filled while the model was built: every rank stops here

    def save(self, step: int) -> Path:
        if self.fabric.is_global_zero:  # the events so far on disk with the checkpoint (a full disk there is noted)
            self.logger.save()
        full_disk.agree(self.fabric)  # a write since the last step boundary met a full disk: no save, every rank stops
        with PeerWatch.current.busy() if PeerWatch.current else contextlib.nullcontext():
            self.last_checkpoint = self.ckpts.save(self.fabric, self.state, step, self.config())
        return self.last_checkpoint

    def resume_hint(self) -> str:
        last = self.ckpts.complete()
        return (f"the last complete checkpoint is {last[-1]}: continue with --resume auto --run-name {self.cfg.run_name}"
                if last else "no checkpoint was complete: start the run again")

    def stopped(self) -> Stopped:
        """After a signal: the checkpoint is saved and the logger flushed; say how to continue (in a SLURM job asked to
        requeue, requeue it first: rank 0, once; every rank then exits as SLURM took it) and return the exception."""
        name = self.stop.signal_name or "SIGINT"
        resume = f"--resume auto --run-name {self.cfg.run_name}"
        if self.fabric.is_global_zero:
            self.logger.finalize("interrupted")  # the events of the last steps on disk before the process ends
        if self.stop.requeue:
            requeued, said = requeue_slurm_job(resume) if self.fabric.is_global_zero else (False, "")
            requeued = bool(self.fabric.broadcast(requeued))
            self.fabric.print(f"{name} received: saved {self.last_checkpoint}; {said}", flush=True)
            return Stopped(name, requeued=requeued)
        self.fabric.print(f"{name} received: saved {self.last_checkpoint}; resume with {resume}", flush=True)
        return Stopped(name)

    def finish(self, record: dict, metrics: dict | None = None, trained: bool = True) -> dict:
        """Write the run's record (rank 0) and close its logger. A process that trained no step (its run had reached
        the end already) leaves an earlier record as it is, rather than replace its figures with empty ones."""
        record = {"kind": self.kind, "run_dir": str(self.dir), **record, "config": self.config(), "env": environment()}
        if PeerWatch.current:  # from here ranks leave one by one (and rank 0 may take the store with it)
            PeerWatch.current.finish()
        if self.stop.signal_name:  # it came after the last step: the run ends as it would have
            self.fabric.print(f"{self.stop.signal_name} received after the last step: the record was written first")
        full_disk.agree(self.fabric)
        if not trained and (earlier := read_record(self.dir)) is not None:
            self.fabric.print(f"no step trained: {self.dir / RECORD} of the earlier run is kept as it is")
            return earlier
        if self.fabric.is_global_zero:
            problem = disk_full(lambda: write_json_atomic(self.dir / RECORD, record), self.dir)
            if problem:
                raise DiskFull(f"no space left to write {self.dir / RECORD}: it needs "
                               f"{len(json.dumps(record, indent=2, default=str)):,} bytes and the disk has "
                               f"{free_bytes(self.dir):,} free ({why_full(problem)}). The training finished and its last "
                               f"checkpoint, {self.last_checkpoint}, is intact: free space and run again with "
                               f"--resume auto --run-name {self.cfg.run_name} to write the record")
            self.logger.log_hyperparams(dataclasses.asdict(self.cfg), metrics)
            self.logger.finalize("success")  # events that meet a full disk here: the record is written, exits says it
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
    if cfg.run_name and folder.is_dir() and any(not folder_lock.is_lock(p) for p in folder.iterdir()):
        raise ConfigError(f"run {folder} exists; a new run does not overwrite it. Fix: continue it with --resume auto "
                          f"--run-name {cfg.run_name}, or start a new run with another --run-name (or remove the folder)")


def resume_or_start(cfg, kind: str, finished, identity: dict) -> dict | None:
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
    if record is not None and record.get("kind") == kind and same_experiment(record.get("config", {}), cfg, kind,
                                                                             identity) and finished(record, cfg):
        print(f"--resume auto: run {folder} has finished (its record.json holds step {record.get('steps')}); "
              f"nothing to train", flush=True)  # the same experiment again: a requeued job, or a runtime flag changed
        return record
    complete = Checkpoints(folder / "checkpoints").complete()
    if not complete:
        print(f"--resume auto: {folder} has no checkpoint yet: starting the run", flush=True)
        cfg.resume = ""
    elif not any(readable(p) for p in complete):  # a requeued job would fail on every requeue: start over
        print(f"--resume auto: every checkpoint of {folder} is damaged ({readable_problem(complete[-1])}): they are "
              f"set aside under {folder}/checkpoints/damaged-<time>/ and the run starts over", flush=True)
        cfg.resume = ""
    return None


def same_experiment(saved: dict, cfg, kind: str, identity: dict) -> bool:
    """An earlier run's config asked for what cfg asks for: the flags that change what a run computes (runtime
    flags such as --log-every aside), and what it trained on beside them (a corpus and tokenizer, by content)."""
    try:
        check_same_experiment(saved, {"kind": kind, **dataclasses.asdict(cfg), **identity}, flags.runtime_fields(cfg),
                              "", flags.recorded_since(cfg))
    except ResumeError:
        return False
    return True


def readable(checkpoint: Path) -> bool:
    return readable_problem(checkpoint) is None


def readable_problem(checkpoint: Path) -> str | None:
    """The cheap checks a resume makes before loading: a config.json that reads, and state files not cut short."""
    try:
        json.loads((checkpoint / "config.json").read_text())
    except (OSError, ValueError) as e:
        return f"{checkpoint.name}/config.json unreadable ({e})"
    return damaged_files(checkpoint)
