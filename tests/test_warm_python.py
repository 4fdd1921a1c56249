"""warm_python.py, the suite's `python` with torch imported already: a command run through it behaves as under
a real interpreter (arguments, output, exit status, signals, thread count), or is handed to one."""

import importlib.util
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO
from core.host import warm_python

SHOW = "import sys, torch; print(sys.argv[1:], sys.path[0], __name__, torch.get_num_threads()); print('err', file=sys.stderr)"


def run(*args, env=None, cwd=REPO, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([warm_python.executable(), *args], cwd=cwd, capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})}, **kw)


def test_a_command_sees_what_a_real_interpreter_gives_it(tmp_path):
    script = tmp_path / "show.py"
    script.write_text(SHOW)
    warm, real = run(script, "a", "--b"), subprocess.run([warm_python.REAL, script, "a", "--b"], capture_output=True,
                                                          text=True, cwd=REPO)
    assert (warm.returncode, warm.stdout, warm.stderr) == (real.returncode, real.stdout, real.stderr) == (
        0, f"['a', '--b'] {tmp_path} __main__ {real.stdout.split()[-1]}\n", "err\n")
    one = run(script, env={"OMP_NUM_THREADS": "1"})  # OpenMP reads it at load: applied as it would have been
    assert one.stdout.split()[-1] == "1"
    # the server's imports looked up its temporary folder; the command's own TMPDIR is the one it gets
    temp = run("-c", "import tempfile; print(tempfile.gettempdir())", env={"TMPDIR": str(tmp_path)})
    assert temp.stdout == f"{tmp_path}\n", temp.stdout + temp.stderr


def test_a_job_that_starts_jobs_starts_them_warm_without_a_server_of_its_own():
    """lab.bench run by a test, or any warm child, hands device_probe's fixed-cost jobs to the server it came from."""
    code = ("import sys; from core.host import warm_python; print(warm_python.executable() == sys.executable, "
            "warm_python._client, warm_python.at_hand() == sys.executable)")
    assert run("-c", code).stdout == "True None True\n"
    assert warm_python.is_client(warm_python.executable()) and not warm_python.is_client(warm_python.REAL)
    # a warm child's sys.executable is the client (the suite's workers are such children): REAL is still the real one
    assert run("-c", "from core.host import warm_python; print(warm_python.REAL)").stdout == f"{warm_python.REAL}\n"


def test_a_real_interpreter_handed_a_client_starts_its_jobs_there():
    """make lab's bench-gpt stage runs a real interpreter (its cases' memory) whose probes go to the lab's server:
    handed a client it takes it and starts no server; handed anything else, it would start its own."""
    code = "from core.host import warm_python; print(warm_python.executable(), warm_python._client)"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    handed = subprocess.run([warm_python.REAL, "-c", code], cwd=REPO, capture_output=True, text=True,
                            env={**env, warm_python.SHARED: warm_python.executable()})
    assert handed.stdout == f"{warm_python.executable()} None\n", handed.stderr
    not_a_client = subprocess.run([warm_python.REAL, "-c", "from core.host import warm_python; print(warm_python.is_client("
                                   "warm_python.os.environ[warm_python.SHARED]))"], cwd=REPO, capture_output=True,
                                  text=True, env={**env, warm_python.SHARED: warm_python.REAL})
    assert not_a_client.stdout == "False\n", not_a_client.stderr


def test_exit_codes_errors_and_deaths_by_signal_are_the_commands():
    assert run("-c", "import sys; sys.exit(3)").returncode == 3
    assert run("-c", "import sys; sys.exit('bad input')").stderr == "bad input\n"
    failed = run("-c", "raise ValueError('boom')")
    assert failed.returncode == 1 and failed.stderr.startswith("Traceback") and "warm_python" not in failed.stderr
    assert run("-c", "import os, signal; os.kill(os.getpid(), signal.SIGTERM)").returncode == -signal.SIGTERM
    # as the OOM killer ends a rank: a signal with no handler to reset (the client had failed on it, with exit code 1)
    killed = run("-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    assert (killed.returncode, killed.stderr) == (-signal.SIGKILL, "")
    assert run("-m", "json.tool", "--help").stdout.startswith("usage: python -m json.tool")


def test_what_escapes_a_command_at_its_end_never_reaches_the_servers_frames(tmp_path):
    """A child is the server forked: an exception out of its last instant (here a stream that raises at the final
    flush; in life a Ctrl-C landing then) once unwound into the server's loop and its clean-up, which removed the
    folder of sys.argv[1] (the command's own argument, relative to its working folder: a test suite's repository)."""
    (tmp_path / "victim").mkdir()
    code = ("import sys\nclass Raises:\n    def write(self, text): return len(text)\n"
            "    def flush(self): raise KeyboardInterrupt\nsys.stdout = Raises()")
    ended = run("-c", code, "victim/file", cwd=tmp_path)
    assert ended.returncode == 1 and (tmp_path / "victim").is_dir()
    assert run("-c", "print('served')").stdout == "served\n"  # the server goes on


def test_a_command_holds_the_signals_it_was_started_holding():
    """The signal mask survives an exec: a rank that Fabric starts holding the stop signals (ranks.launch) holds
    them under the warm python too, until it listens, and a signal sent meanwhile waits for it."""
    code = ("import os, signal; print(sorted(signal.pthread_sigmask(signal.SIG_BLOCK, [])));"
            "signal.signal(signal.SIGUSR1, lambda *_: print('taken')); os.kill(os.getpid(), signal.SIGUSR1);"
            "print('held'); signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGUSR1])")
    hold = lambda: signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGUSR1})  # noqa: E731
    # what the suite itself was started holding is held by every command too (`perf record` holds SIGWINCH)
    inherited = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    warm = run("-c", code, preexec_fn=hold)
    real = subprocess.run([warm_python.REAL, "-c", code], capture_output=True, text=True, preexec_fn=hold)
    held = sorted(inherited | {signal.SIGINT, signal.SIGUSR1})
    assert warm.stdout == real.stdout == f"{held}\nheld\ntaken\n", warm.stderr
    mask = run("-c", "import signal; print(sorted(signal.pthread_sigmask(signal.SIG_BLOCK, [])))").stdout
    assert mask == f"{sorted(inherited)}\n"


def test_signals_reach_the_command_and_sigkill_ends_it(tmp_path):
    # short sleeps: a handler runs between bytecodes, so a signal landing just before a long sleep's system call
    # waits for that sleep to end, in any Python (seen about once in 150 such commands beside other work)
    code = ("import signal, sys, time\nsignal.signal(signal.SIGUSR1, lambda *a: (print('usr1', flush=True), sys.exit(5)))\n"
            "print('up', flush=True)\nfor _ in range(600): time.sleep(0.1)")
    proc = subprocess.Popen([warm_python.executable(), "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "up\n"
    proc.send_signal(signal.SIGUSR1)
    assert proc.communicate(timeout=30)[0] == "usr1\n" and proc.returncode == 5
    pid_file = tmp_path / "pid"
    proc = subprocess.Popen([warm_python.executable(), "-c", f"import os, time; open({str(pid_file)!r}, 'w').write(str("
                             "os.getpid())); time.sleep(60)"])
    while not pid_file.exists() or not pid_file.read_text():
        time.sleep(0.02)
    proc.kill()  # the client cannot forward SIGKILL: the server ends the command when its client is gone
    assert proc.wait(timeout=30) == -signal.SIGKILL
    deadline = time.time() + 10
    while os.path.exists(f"/proc/{pid_file.read_text()}") and time.time() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{pid_file.read_text()}")


def test_processes_a_command_starts_are_warm_and_load_time_settings_get_a_real_interpreter(tmp_path):
    nested = run("-c", "import subprocess, sys; print(subprocess.run([sys.executable, '-c', 'import sys; "
                 "print(sys.executable)'], capture_output=True, text=True).stdout.strip())")
    assert nested.stdout.strip() == warm_python.executable() != warm_python.REAL
    # multiprocessing's spawn passes -B where PYTHONDONTWRITEBYTECODE is set (device_probe's gloo probe): taken over
    spawned = run("-u", "-B", "-c", "import sys; print(sys.executable, sys.dont_write_bytecode)")
    assert spawned.stdout == f"{warm_python.executable()} True\n", spawned.stderr
    assert run("-O", "-c", "import sys; print(sys.executable)").stdout.strip() == warm_python.REAL  # not taken over
    capped = run("-c", "import sys; print(sys.executable)", env={"ATEN_CPU_CAPABILITY": "default"})
    assert capped.stdout.strip() == warm_python.REAL  # read once by torch: a forked child would keep the server's
    worker = run("-c", "import sys; print(sys.executable)", env={"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"})
    assert worker.stdout.strip() == warm_python.executable()  # what torchrun gives each worker: read when used
    compile_env = {"TORCHINDUCTOR_FREEZING": "1", "TORCHDYNAMO_VERBOSE": "1", "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}
    settings = run("-c", "import sys, torch._dynamo, torch._inductor.config as c; "
                   "from torch._inductor.runtime.cache_dir_utils import cache_dir; "
                   "print(c.freezing, torch._dynamo.config.verbose, cache_dir(), sys.executable)", env=compile_env)
    assert settings.stdout.split()[:3] == ["True", "True", str(tmp_path)]  # read at import by the server's torch
    cache_only = run("-c", "import sys; print(sys.executable)", env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path)})
    assert cache_only.stdout.strip() == warm_python.executable()  # looked up at each compile: the child's own
    one_core = {min(os.sched_getaffinity(0))}  # taskset's: torch counts its threads from it at load
    held = run("-c", "import os; print(sorted(os.sched_getaffinity(0)))", preexec_fn=lambda: os.sched_setaffinity(0, one_core))
    assert held.stdout == f"{sorted(one_core)}\n", held.stderr


def test_a_job_signalled_as_a_group_reaches_every_process_it_started(tmp_path):
    """As a shell's job or srun's task: SIGTERM to the client's process group reaches the command and the process it
    started (warm too, in the command's group), and SIGKILL to the group ends both."""
    code = ("import signal, subprocess, sys, time\n"
            "signal.signal(signal.SIGTERM, lambda *a: (print('parent', flush=True), sys.exit(0)))\n"
            "child = subprocess.Popen([sys.executable, '-c', 'import signal, sys, time; signal.signal(signal.SIGTERM, "
            "lambda *a: (print(\\'child\\', flush=True), sys.exit(0))); print(\\'up\\', flush=True); "
            "[time.sleep(0.1) for _ in range(600)]'])\n"
            "for _ in range(600): time.sleep(0.1)")
    proc = subprocess.Popen([warm_python.executable(), "-c", code], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    assert proc.stdout.readline() == "up\n"
    os.killpg(proc.pid, signal.SIGTERM)
    # both write to the one pipe at once: a word each, their lines may interleave
    assert sorted(re.findall(r"child|parent", proc.communicate(timeout=30)[0])) == ["child", "parent"]
    assert proc.returncode == 0


def test_signals_that_outlast_the_command_leave_its_exit_code():
    """A launcher may still be signalling a job's group as its command ends: a command that holds SIGTERM ends by
    its code under a real interpreter, and so does the client, whose own end would otherwise restore the default
    action in the flood's path (the client ended by SIGTERM 10 times in 10, 2026-11-29)."""
    code = ("import signal\nseen = []\nsignal.signal(signal.SIGTERM, lambda *_: seen.append(1))\nprint('up', flush=True)\n"
            "while len(seen) < 5: signal.pause()\nsignal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})\n")
    for python in (warm_python.REAL, warm_python.executable()) * 3:
        proc = subprocess.Popen([python, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True)
        assert proc.stdout.readline() == "up\n"
        while proc.poll() is None:  # until the client is gone
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:  # ended and reaped between the two calls
                break
        assert proc.wait(timeout=30) == 0, python


def test_descriptors_passed_on_reach_the_command(tmp_path):
    """As torch.compile's worker pool starts its workers: a pipe handed over with pass_fds is there, by number."""
    read, write = os.pipe()
    proc = subprocess.Popen([warm_python.executable(), "-c", f"import os; os.write({write}, b'through the pipe')"],
                            pass_fds=(write,))
    os.close(write)
    assert proc.wait(timeout=30) == 0 and os.read(read, 100) == b"through the pipe"


def test_inspecting_the_stack_looks_up_no_more_modules_than_a_real_interpreter(tmp_path):
    """runpy's frames under a command name "<frozen runpy>", a file inspect maps to no module: without the server's
    mapping each inspect.stack() compared it with every module the server imported (37,098 lookups where a real
    interpreter makes 4; torchrun's rendezvous calls it at every record)."""
    script = tmp_path / "scan.py"
    script.write_text("import inspect\nseen = []\nismodule = inspect.ismodule\ninspect.stack()\n"
                      "inspect.ismodule = lambda m: seen.append(m) or ismodule(m)\ninspect.stack()\nprint(len(seen))")
    real = int(subprocess.run([warm_python.REAL, script], capture_output=True, text=True, cwd=REPO).stdout)
    for command in ([script], ["-m", "scan"]):
        warm = run(*command, cwd=tmp_path)
        assert int(warm.stdout) < real + 100, (command, warm.stdout, real)  # its own frames: a few lookups each


def test_looking_up_a_sources_module_resolves_only_the_modules_a_command_imported(tmp_path):
    """inspect's first lookup of a file's module resolves the path of every loaded module (torch.library does it at
    each fake-kernel registration: the C++ GELU's, in every GPT-2 run), 60 ms in a child of the server's four
    thousand; the server resolved them once, so a command resolves the few it imported itself."""
    script = tmp_path / "lookup.py"
    script.write_text("import inspect, json, sys\nseen = []\ngetabsfile = inspect.getabsfile\n"
                      "inspect.getabsfile = lambda *a: seen.append(a) or getabsfile(*a)\n"
                      "import json.tool\nassert inspect.getmodule(sys._getframe()).__name__ == '__main__'\n"
                      "print(len(seen), len(sys.modules))")
    real, _ = map(int, subprocess.run([warm_python.REAL, script], capture_output=True, text=True).stdout.split())
    resolved, loaded = map(int, run(script).stdout.split())
    assert resolved < real < 200 < 1000 < loaded, (resolved, real, loaded)


def test_a_command_leaves_the_servers_op_registrations_to_the_server_and_undoes_its_own():
    """torch.library's finalizers undo each registration at exit; in a child, those of the server's imports wrote
    into pages shared with the server (30 ms of CPU a command). Only the command's own are undone."""
    code = ("import weakref, torch.library as L; lib = L.Library('warm_test', 'DEF'); print(sum(f.atexit for f, i in "
            "weakref.finalize._registry.items() if i.func is L._del_library))")
    assert run("-c", code).stdout == "1\n"
    assert int(subprocess.run([warm_python.REAL, "-c", code], capture_output=True, text=True).stdout) > 100


def test_a_commands_garbage_collections_leave_the_servers_objects_alone():
    """The half million objects the server's imports made are frozen out of each child's collections (a full one
    walked them all: 0.3 s, writing into every page that holds them); the command's own garbage is still collected."""
    code = ("import gc\nclass A: pass\na = A(); a.me = a; del a\n"
            "print(len(gc.get_objects()), gc.get_freeze_count(), gc.collect())")
    tracked, frozen, collected = map(int, run("-c", code).stdout.split())
    assert frozen > 100_000 > 10 * tracked and collected >= 1


def test_deepspeed_is_the_servers_on_a_machine_whose_ranks_run_on_the_cpu():
    """DeepSpeed picks its accelerator at its import: the server imports it only where no GPU is, with the CPU the
    project's runs name (strategies.deepspeed_on_cpu). A command that names the CPU or nothing is forked, its
    environment as its starter gave it; one that names another accelerator gets a real interpreter."""
    code = "import os, sys; print(sys.executable, 'deepspeed' in sys.modules, os.environ.get('DS_ACCELERATOR'))"
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    unnamed = subprocess.run([warm_python.executable(), "-c", code], capture_output=True, text=True, env=env)
    cpu, other = (run("-c", code, env={"DS_ACCELERATOR": name}) for name in ("cpu", "cuda"))
    preloaded = not warm_python.a_gpu_may_be_present()
    assert unnamed.stdout == f"{warm_python.executable()} {preloaded} None\n", unnamed.stderr
    assert cpu.stdout == f"{warm_python.executable()} {preloaded} cpu\n", cpu.stderr
    assert other.stdout.split()[:2] == [warm_python.executable() if not preloaded else warm_python.REAL, "False"]


def test_a_librarys_log_lines_keep_their_place_in_the_commands_output():
    """DeepSpeed's logger writes to the sys.stdout of the process that imported it, the server's when the server did:
    each command's handlers write to its own stream, so a block-buffered command's lines stay in order (and are not
    left in the server's buffer at its end)."""
    code = "from deepspeed.utils import logger; print('a'); logger.warning('b'); print('c')"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    proc = subprocess.run([warm_python.executable(), "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert [line[-1:] for line in proc.stdout.splitlines()] == ["a", "b", "c"], proc.stdout + proc.stderr


COMPILED = """import builtins, importlib, json, sys
seen, compile_ = [], builtins.compile
builtins.compile = lambda source, path, *a, **k: seen.append(path) or compile_(source, path, *a, **k)
importlib.import_module(sys.argv[1])
print(json.dumps(seen))
"""


def test_a_repository_module_is_compiled_once_and_a_changed_one_again(tmp_path):
    """A second command that imports an unchanged module of the repository compiles nothing: its bytecode is beside
    it, or under PYTHONDONTWRITEBYTECODE (which keeps none) the server's. A module whose source
    changed since is compiled again, and nothing is written where the setting says not to."""
    module, source = "core.run.folder_lock", REPO / "core" / "run" / "folder_lock.py"
    cached = Path(importlib.util.cache_from_source(str(source)))
    before = cached.exists() and cached.stat().st_mtime_ns
    run("-c", COMPILED, module)
    assert str(source) not in run("-c", COMPILED, module).stdout
    stat = source.stat()
    try:
        os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
        assert str(source) in run("-c", COMPILED, module).stdout
    finally:
        os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    if os.environ.get("PYTHONDONTWRITEBYTECODE"):
        assert (cached.exists() and cached.stat().st_mtime_ns) == before


def test_a_module_being_edited_leaves_the_servers_compiling_to_the_others(tmp_path, monkeypatch):
    """The server compiles the repository's modules before it serves: one that does not compile (a file being edited)
    is left to the command that imports it, which meets the error a real interpreter gives; the others come compiled."""
    (tmp_path / "good.py").write_text("VALUE = 1\n")
    (tmp_path / "broken.py").write_text("def f(:\n")
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    monkeypatch.syspath_prepend(str(tmp_path))
    warm_python.compile_the_repository(tmp_path)
    import good

    assert good.VALUE == 1 and type(good.__loader__).__name__ == "Compiled"
    with pytest.raises(SyntaxError):
        import broken  # noqa: F401
    monkeypatch.delitem(sys.modules, "good")
