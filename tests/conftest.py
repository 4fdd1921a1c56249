"""Shared fixtures: the real MNIST through the project's mirror setting, and running the scripts for real."""

import contextlib
import importlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


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


def run_script(*args, timeout=600, check=True, env=None) -> subprocess.CompletedProcess:
    """Run a repository script in a fresh Python process, the way a user runs it."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.run([sys.executable, *map(str, args)], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env=full_env)
    if check and proc.returncode != 0:
        raise AssertionError(f"{args} exited {proc.returncode}\nstdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}")
    return proc


def run_in_process(script: str, *args, check=True) -> subprocess.CompletedProcess:
    """A single-process run of a script's main() in the test process: the command line's code path from
    argument parsing on, without a new interpreter importing torch, Lightning and transformers again (about
    3.5 s of CPU each time). Multi-process runs, signals and the command line itself use run_script."""
    module = importlib.import_module(Path(script).stem)
    out, err, code = io.StringIO(), io.StringIO(), 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            module.main([str(a) for a in args])
        except SystemExit as e:  # as the interpreter would: a message goes to stderr with exit status 1
            code = e.code if isinstance(e.code, int) else 1
            if isinstance(e.code, str):
                print(e.code, file=sys.stderr)
    proc = subprocess.CompletedProcess([script, *args], code, out.getvalue(), err.getvalue())
    if check and code != 0:
        raise AssertionError(f"{script} {args} exited {code}\nstdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}")
    return proc


def read_summary(run_dir: Path) -> dict:
    """A finished run's record.json (both scripts write one, with its `kind`)."""
    return json.loads((Path(run_dir) / "record.json").read_text())


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: multi-process or DeepSpeed runs; `make test-fast` leaves them out")
