"""Shared fixtures: the real MNIST through the project's mirror setting, and running the scripts for real."""

import atexit
import contextlib
import importlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from core.host import warm_python  # noqa: E402 (the repository's, on the path above)
from core.run.ranks import usable_cores  # noqa: E402


def measurement_cache(run_folder: str) -> str:
    """The suite's own cache of this machine's measurements (device_probe.py's, the probes of --precision auto and
    --gelu-impl auto), never the user's: in the repository's .venv when the suite runs there, so that a second run
    takes them as a user's second run does (a fresh clone, as CI's, starts it empty and measures everything; the
    measurements' keys hold the CPU, caps, threads and library versions), else empty for each run."""
    venv = REPO / ".venv"
    if Path(sys.prefix).resolve() == venv.resolve() and os.access(venv, os.W_OK):
        return str(venv / "test-measurements")
    return os.path.join(run_folder, "measurements")


# the pytest-xdist workers share the folders their controller made, as the processes of one suite run (the cache is
# locked); the run's folder goes when the controller ends, after its workers
if "PYTEST_XDIST_WORKER" not in os.environ:
    RUN_FOLDER = tempfile.mkdtemp(prefix="fabric-lab-suite-")
    atexit.register(shutil.rmtree, RUN_FOLDER, ignore_errors=True)
    os.environ["FABRIC_LAB_CACHE"] = measurement_cache(RUN_FOLDER)
    # every extension build of the suite's processes adds a line here (extension_compiler.noted_build)
    os.environ["FABRIC_LAB_BUILD_LOG"] = os.path.join(RUN_FOLDER, "builds.jsonl")
    # torchrun (the tests of several nodes, of gpt.sbatch) makes a log folder per launch, /tmp/torchelastic_* by
    # default, and leaves it: here, in the run's folder, removed at the end (PET_LOG_DIR is its --log-dir)
    os.environ["PET_LOG_DIR"] = os.path.join(RUN_FOLDER, "torchrun-logs")
    # the workers fill the cores by design, so every timing has other processes beside it: kept all the same, as the
    # tests of what is cached expect (measurements.quiet_enough; its own tests unset this)
    os.environ["FABRIC_LAB_KEEP_BUSY_MEASUREMENTS"] = "1"
    # pytest-xdist starts its workers as sys.executable: so they are the warm python's children, with torch,
    # Lightning and transformers imported once for the whole suite, and one server for all (each worker had imported
    # them, and started a server of its own). The server's imports include anyio, a pytest plugin pytest would rewrite
    os.environ["PYTEST_ADDOPTS"] = (os.environ.get("PYTEST_ADDOPTS", "") + " -W 'ignore:Module already imported so "
                                    "cannot be rewritten; anyio:pytest.PytestAssertRewriteWarning'").strip()
    warm_python.install()


# pytest-xdist's workers share the machine's cores: each worker's processes take cores / workers threads, where
# torch's default (every core, in each worker) has their OpenMP threads spin against each other
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if WORKERS > 1 and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = str(max(1, usable_cores() // WORKERS))
    if "torch" in sys.modules:  # a warm child: OpenMP read the variable when torch loaded, in the server
        sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture(scope="session", autouse=True)
def warm_interpreter():
    """Every process the suite starts, and every one the scripts it runs start, forked from a warm python
    (warm_python.py): about 10 s less CPU each on 2 cores."""
    warm_python.install()


def mirror_dir() -> Path | None:
    """MNIST_MIRROR when set (as .ci/run sets it), else ../shared/data/mnist beside the repository."""
    candidate = Path(os.environ.get("MNIST_MIRROR") or REPO.parent / "shared" / "data" / "mnist")
    return candidate if (candidate / "train-images-idx3-ubyte.gz").exists() else None


@pytest.fixture(scope="session")
def mnist_dir(tmp_path_factory) -> Path:
    """The four verified MNIST files, fetched once per session from the mirror by the project's downloader."""
    mirror = mirror_dir()
    if mirror is None:
        pytest.skip("real MNIST needed: set MNIST_MIRROR to a folder with the four .gz files "
                    "(CI uses ../shared/data/mnist)")
    import datasets_local

    root = tmp_path_factory.mktemp("mnist")
    datasets_local.download(root, str(mirror), quiet=True)
    return root


def shared_dir(tmp_path_factory, name: str, make) -> Path:
    """A folder that `make(folder)` fills once per suite run, whichever pytest-xdist worker asks first: the others
    wait on its lock and read it (the runs that parity, resume and plan tests compare with, made once, not once per
    worker). Tests copy from it and never write into it."""
    import fcntl
    import shutil

    base = tmp_path_factory.getbasetemp()
    root = (base.parent if "PYTEST_XDIST_WORKER" in os.environ else base) / "shared"
    root.mkdir(exist_ok=True)
    folder = root / name
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (root / f"{name}.done").exists():
            shutil.rmtree(folder, ignore_errors=True)  # what a failed attempt left
            folder.mkdir()
            make(folder)
            (root / f"{name}.done").touch()
    return folder


def run_script(*args, timeout=600, check=True, env=None, cold=False) -> subprocess.CompletedProcess:
    """Run a repository script (or `-m module`) in a process of its own, as `python script ...`: forked warm (warm_python.py),
    or with `cold` a real interpreter, for a test that measures the process itself (a fork's resident memory counts
    the pages of the server it came from, as they are touched). A variable given as None is left out of its env."""
    full_env = {k: v for k, v in {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}.items() if v is not None}
    python = warm_python.REAL if cold else warm_python.executable()
    proc = subprocess.run([python, *map(str, args)], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env=full_env)
    if check and proc.returncode != 0:
        raise AssertionError(f"{args} exited {proc.returncode}\nstdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}")
    return proc


@contextlib.contextmanager
def sized_disk(folder: Path, size: int):
    """A real file system of `size` bytes at `folder`, a tmpfs, unmounted after: what a full disk is tested on, and a
    disk whose room does not depend on the machine (a tmpfs's size may exceed its memory: only what is written takes
    any). CI runs as root; without the right to mount the test fails saying so, rather than pass untested."""
    folder.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={int(size)}", "tmpfs", str(folder)], capture_output=True,
                          text=True)
    if done.returncode:
        pytest.fail(f"a full disk is tested on a real tmpfs, and mounting one needs root (as CI has): {done.stderr.strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], capture_output=True)


def fill(folder: Path, leave: int = 0) -> Path:
    """Take every free byte of `folder`'s file system but `leave`, as another program writing there would."""
    filler = folder / "filler"
    with open(filler, "ab") as f:
        while (free := shutil.disk_usage(folder).free) > leave:
            try:
                f.write(b"\0" * min(free - leave, 1 << 20))
                f.flush()
            except OSError:
                break
    return filler


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_node(node_rank: int, port: int, script: str, *args, log: Path, nnodes: int = 2, env=None,
               join_timeout: int = 60) -> subprocess.Popen:
    """One "machine": a torchrun launcher with one process, meeting the others at a c10d rendezvous on
    127.0.0.1:port, with the script's --num-nodes/--devices to match (the README's multi-node command)."""
    torchrun = Path(warm_python.REAL).parent / "torchrun"  # its console script, run by the warm python
    cmd = [warm_python.executable(), torchrun, "--nnodes", nnodes, "--node-rank", node_rank, "--nproc-per-node", 1,
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-conf", f"join_timeout={join_timeout}",
           script, *args, "--num-nodes", nnodes, "--devices", 1]
    return subprocess.Popen(list(map(str, cmd)), cwd=REPO, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})


def start_nodes(script: str, *args, logs: Path, nnodes: int = 2, env=None) -> list[subprocess.Popen]:
    """Node 0 first: its launcher holds the rendezvous store (on a cluster, the machine the endpoint names)."""
    import socket

    # Both "machines" share this host's cores: one thread each, as 2 processes on one machine get from Fabric
    # (alone on a node, Fabric gives its process every core, and 2 x 2 threads on 2 cores changes the sums' order).
    env = {"OMP_NUM_THREADS": "1", **(env or {})}
    port, procs = free_port(), []
    logs.mkdir(parents=True, exist_ok=True)
    for node in range(nnodes):
        procs.append(start_node(node, port, script, *args, log=logs / f"node{node}.log", nnodes=nnodes, env=env))
        for _ in range(600 if node == 0 else 0):
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                break
            time.sleep(0.05)
    return procs


def run_nodes(script: str, *args, logs: Path, nnodes: int = 2, timeout: float = 600, check=True) -> list[str]:
    """Run a script on `nnodes` torchrun "machines" to the end; each node's output."""
    procs = start_nodes(script, *args, logs=logs, nnodes=nnodes)
    codes = [p.wait(timeout=timeout) for p in procs]
    outs = [(logs / f"node{n}.log").read_text() for n in range(nnodes)]
    if check and any(codes):
        raise AssertionError(f"{script} on {nnodes} nodes exited {codes}\n" +
                             "\n".join(f"node {n}:\n{o[-3000:]}" for n, o in enumerate(outs)))
    return outs


def wait_for_checkpoint(run_dir: Path, *procs: subprocess.Popen, timeout: float = 300, output=None) -> None:
    """Until the run's first complete checkpoint exists, every process still running meanwhile; `output()` says
    what they printed when one ends first (default: its piped stdout)."""
    deadline = time.time() + timeout
    while not [p for p in (Path(run_dir) / "checkpoints").glob("step-*") if not p.name.endswith(".partial")]:
        ended = [p for p in procs if p.poll() is not None]
        assert not ended, f"run ended before its first checkpoint:\n{output() if output else ended[0].stdout.read()}"
        assert time.time() < deadline, "no checkpoint appeared"
        time.sleep(0.02)


def run_in_process(script: str, *args, check=True) -> subprocess.CompletedProcess:
    """A single-process run of a script's (fabric_gpt.py) or a tool's (lab.sample, -m lab.sample) main() in the test
    process: the command line's code path from argument parsing on, without a new interpreter importing torch,
    Lightning and transformers again (about 3.5 s of CPU each time). Multi-process runs, signals and the command line
    itself use run_script."""
    module = importlib.import_module(script.removeprefix("-m ").removesuffix(".py").replace("/", "."))
    if "torch._dynamo" in sys.modules:  # as a new process would: no graphs compiled yet, none counted
        sys.modules["torch._dynamo"].reset()
        sys.modules["torch._dynamo"].utils.counters.clear()
    out, err, code = io.StringIO(), io.StringIO(), 0
    environ = dict(os.environ)
    from core.run.ranks import STOP_SIGNALS

    # a run stopped by a signal keeps its handlers to its end (stops.py), which a process's end takes with it
    handlers = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            module.main([str(a) for a in args])
        except SystemExit as e:  # as the interpreter would: a message goes to stderr with exit status 1
            code = e.code if isinstance(e.code, int) else 1
            if isinstance(e.code, str):
                print(e.code, file=sys.stderr)
        finally:  # as the process's end would: a process group of one (ddp on 1 device) holds MASTER_PORT open,
            import torch.distributed  # and the variables Fabric set would reach every later run's processes

            if torch.distributed.is_available() and torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
            os.environ.clear()
            os.environ.update(environ)
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
    proc = subprocess.CompletedProcess([script, *args], code, out.getvalue(), err.getvalue())
    if check and code != 0:
        raise AssertionError(f"{script} {args} exited {code}\nstdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}")
    return proc


def read_summary(run_dir: Path) -> dict:
    """A finished run's record.json (both scripts write one, with its `kind`)."""
    return json.loads((Path(run_dir) / "record.json").read_text())


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: multi-process, signalled, DeepSpeed or large-model runs (a run in a process "
                            "of its own); `make test-fast` leaves them out, `make test` runs them")
    config.addinivalue_line("markers", "builds: compiles an op that `make setup` leaves to its first use (minutes in a "
                            "fresh checkout); started first, so that its compiler runs beside the rest of the suite")


def pytest_terminal_summary(terminalreporter):
    """The suite's time on a new machine, foreseeable: its five slowest tests and the builds it made (a fresh .venv
    compiles DeepSpeed's ops and the GELU's kernels the first time a test needs them; `make setup` builds some)."""
    seconds: dict = {}  # a test's set-up (its fixtures' runs), call and teardown
    for kind in ("passed", "failed", "error", "skipped"):
        for r in terminalreporter.stats.get(kind, []):
            if hasattr(r, "duration") and hasattr(r, "nodeid"):
                seconds[r.nodeid] = seconds.get(r.nodeid, 0.0) + r.duration
    if not seconds or "PYTEST_XDIST_WORKER" in os.environ:
        return
    write = terminalreporter.write_line
    write("")
    write("slowest 5 tests: " + "; ".join(f"{s:.0f} s {nodeid.split('::')[-1]}"
                                          for nodeid, s in sorted(seconds.items(), key=lambda item: -item[1])[:5]))
    log = Path(os.environ.get("FABRIC_LAB_BUILD_LOG", "/nonexistent"))
    builds = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    write(f"builds: {sum(b['seconds'] for b in builds):.0f} s in {len(builds)} ("
          + (", ".join(f"{b['build']} {b['seconds']:.0f} s" for b in builds) or "none: every extension was built")
          + "; each inside the tests' time)")


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: item.get_closest_marker("builds") is None)  # stable: otherwise in file order


READS = ("item", "__float__", "__int__", "__bool__", "tolist", "cpu", "numpy")


def host_reads(monkeypatch, script_module, *args) -> dict:
    """Every read of a tensor's value on the host during the train() of a run of `script_module` (on a GPU each
    one waits for the device), by (method, function that read). Left out: torch.optim's step counters, which live
    on the host unless the optimizer is capturable or fused (then no read at all), and torch.compile's own
    compile-time reads."""
    import collections
    import traceback

    import torch

    counts, active = collections.Counter(), [False]
    for name in READS:
        original = getattr(torch.Tensor, name)

        def read(self, *a, _original=original, _name=name, **k):
            if active[0]:
                frame = traceback.extract_stack(limit=2)[0]
                if not any(part in frame.filename for part in ("torch/optim/", "torch/_inductor/", "torch/_dynamo/")):
                    counts[(_name, frame.name)] += 1
            return _original(self, *a, **k)
        monkeypatch.setattr(torch.Tensor, name, read)
    train = script_module.train

    def counted(*a, **k):
        active[0] = True
        try:
            return train(*a, **k)
        finally:
            active[0] = False
    monkeypatch.setattr(script_module, "train", counted)
    run_in_process(f"{script_module.__name__}.py", *args)
    monkeypatch.undo()
    return dict(counts)


# ----------------------------------------------------------------------------- LeNet-5 runs in several test files
# For runs whose test is not accuracy (resumption, faults, reports, compiled and whole steps), both sides of each
# comparison alike: evaluating all 10,000 test images took 46 s of the suite's worker time (docs/tests.md)
FEW_TEST_IMAGES = ["--test-samples", "1000"]


# ----------------------------------------------------------------------------- GPT runs shared by several test files
# float32 named: --precision auto may choose bf16 on a CPU with bf16 instructions, and the equalities below are float32's
SMALL = ["--model", "tiny", "--dataset", "ramp", "--lr", "1e-2", "--num-samples", "48", "--accelerator", "cpu",
         "--warmup-steps", "1", "--precision", "32-true"]
# Plain SGD without clipping: AdamW's normalisation and clipping would hide a missing 1/accumulation or a
# gradient summed where it should be averaged; with SGD they change the weights and the gradient norm.
EXACT = [*SMALL, "--optimizer", "sgd", "--grad-clip", "0", "--lr", "0.5", "--export"]
# Each strategy on 2 processes with the single process's global batch of 4 samples per step. Where the
# data-parallel size is 2 the batch is 2 micro-batches of 1 per process: accumulation is proven at once.
TWO_PROCESS = {
    "ddp": ["--micro-batch-size", "1", "--grad-accum", "2"],
    "deepspeed_stage_1": ["--micro-batch-size", "1", "--grad-accum", "2"],
    "deepspeed_stage_2": ["--micro-batch-size", "1", "--grad-accum", "2"],
    "deepspeed_stage_3": ["--micro-batch-size", "1", "--grad-accum", "2"],
    "fsdp": ["--micro-batch-size", "1", "--grad-accum", "2"],
    "tp": ["--micro-batch-size", "4"],
    "fsdp_tp": ["--micro-batch-size", "4", "--tp-size", "2"],
    "pp": ["--micro-batch-size", "2", "--grad-accum", "2"],
    "pp_gpipe": ["--micro-batch-size", "2", "--grad-accum", "2", "--pp-schedule", "gpipe"],
}


def record(out: Path, name: str) -> dict:
    return json.loads((out / name / "record.json").read_text())


def losses(out: Path, name: str) -> list[float]:
    return [loss for _, loss in record(out, name)["losses"]]


def run_gpt(out: Path, name: str, *args, base=SMALL, check=True, timeout=600):
    """Multi-process runs as a user starts them; single-process ones in the test process (no start-up)."""
    if "--devices" in args:
        return run_script("fabric_gpt.py", *base, "--out-dir", out, "--run-name", name, *args, check=check, timeout=timeout)
    return run_in_process("fabric_gpt.py", *base, "--out-dir", out, "--run-name", name, *args, check=check)


@pytest.fixture(scope="session")
def single(tmp_path_factory):
    """One process, SGD, the reference every strategy is compared with; also proves it learns."""
    make = lambda out: run_gpt(out, "single", "--micro-batch-size", "4", base=EXACT)
    return shared_dir(tmp_path_factory, "gpt-single", make), "single"


@pytest.fixture(scope="session")
def two_process(tmp_path_factory):
    """Runs on 2 processes by strategy, made once and shared by the parity and resume tests."""
    def get(name):
        def make(out):
            proc = run_gpt(out, name, "--strategy", name.removesuffix("_gpipe"), "--devices", "2", *TWO_PROCESS[name],
                           "--count-comms", "--checkpoint-every", "2", "--keep-last", "6", base=EXACT)  # resumed mid-run
            (out / f"{name}.log").write_text(proc.stdout + proc.stderr)
        return shared_dir(tmp_path_factory, f"gpt-two-{name}", make), name
    return get
