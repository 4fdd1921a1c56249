"""A Python that has torch, Lightning and transformers imported already, for short jobs started by the dozen: the
test suite's subprocesses, device_probe's fixed-cost runs (lab.bench's predictions) and `make lab`'s stages.

Every such process (each rank of a 2-process run, each torchrun "machine") spent 10-20 s of CPU on a 2-core machine
importing torch, Lightning, torchmetrics and transformers before its first line ran, for a job of a few seconds; the
suite starts some two hundred, the lab's performance model twenty. Here one server (per test suite, whose
pytest-xdist workers are its children too; per bench, per `make lab`) imports them once and forks a child per
command, the way a DataLoader forks its workers from a process that has imported torch (and DeepSpeed where no GPU
is, torch's extension builder, transformers' conversion table, and the repository's modules compiled, each a cost
every child paid again: see serve). bench-gpt's cases run real
interpreters: a forked child's resident memory counts the server's pages it touches (3% more at a run's peak,
measured), and its table reports the memory of what a user runs.
The lab's other stages measure time and accuracy, which a fork leaves as they are (docs/lab.md).
`executable()` is a small client that takes the place of `python`: it hands its arguments, environment, working
folder and descriptors to the server, which forks; the child runs the script as `python script.py ...` would (as
`__main__`, with that sys.argv and sys.path), and the client forwards the signals it receives and exits as the child
did (its code, or the same signal). A client started as a process group of its own (`start_new_session`, as a shell
starts a job, torchrun its workers) gets a child that leads its own group, and forwards to that group: a signal to
the job reaches every process the command started, and SIGKILL to it ends them all. The child's `sys.executable` is
the client, so the ranks a run launches itself and torchrun's workers start warm too.

What the child cannot take over from the server falls back to a real interpreter (the client execs it): interpreter
options other than -u, -B, -m and -c, and environment variables that libraries read once at import or load (instruction-
set caps, thread and allocator settings, PYTHONPATH, Hugging Face's settings), when they differ from the server's,
and a CPU affinity other than the server's (`taskset`, a SLURM step's cores: torch counts its threads from it at load).
OMP_NUM_THREADS, which OpenMP reads at load, is applied with torch.set_num_threads, as it would have taken effect.
Tests that look at the process tree itself (psutil's children of a launcher) start real interpreters. FABRIC_LAB_WARM=0
turns all of it off.
"""

import fcntl
import gc
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

PRELOAD = ("torch", "torch.distributed", "torch.nn.functional", "numpy", "psutil", "lightning.fabric",
           "lightning.fabric.strategies", "lightning.fabric.loggers", "torchmetrics", "transformers",
           "transformers.models.gpt2.modeling_gpt2", "safetensors.torch", "torch.utils.tensorboard",
           "torch._inductor.compile_fx",  # what torch.compile imports first, as does every DeepSpeed ZeRO rank (Muon)
           "torch.distributed.tensor.experimental", "torch.distributed.pipelining",  # fsdp/tp checkpoints, pp runs
           "torch.distributed.checkpoint")  # every FSDP or tensor-parallel save and load (0.1 s a rank)
# read once, at import or library load, by what PRELOAD loads: a child whose value differs runs a real interpreter
LOAD_TIME = ("ONEDNN_", "DNNL_", "ATEN_", "MKL_", "KMP_", "GOMP_", "OMP_", "LD_", "MALLOC_", "PYTHON", "HF_",
             "TRANSFORMERS_", "TOKENIZERS_", "TORCH_", "PYTORCH_", "TORCHINDUCTOR_", "TORCHDYNAMO_", "CUDA_", "NVIDIA_",
             "XDG_CACHE_HOME")
# applied per child, or read when used (torchrun sets TORCH_NCCL_ASYNC_ERROR_HANDLING for its workers; an NCCL group
# reads it when made; inductor looks its cache folder up at each compile)
APPLIED = {"OMP_NUM_THREADS", "PYTHONUNBUFFERED", "TORCH_EXTENSIONS_DIR", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
           "TORCHINDUCTOR_CACHE_DIR"}
START_ENV = dict(os.environ)  # the server's, before its imports set some of their own
IMPORTED_WITH = {}  # read at load by an import the server made with this value (import_deepspeed_for_the_cpu)
# interpreter options a child takes over: multiprocessing's spawn passes -B where PYTHONDONTWRITEBYTECODE is set
TAKEN_OVER = ("-u", "-B")
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP, signal.SIGQUIT,
             signal.SIGCONT, signal.SIGALRM)

CLIENT = """#!{python} -S
# python, warm: see warm_python.py
import json, os, select, signal, socket, struct, sys, time
args = sys.argv[1:]
# held until the command's pid is known and the handlers are in place: a signal sent as soon as the command prints
# would otherwise find the default action (the client ended, the command left running). The mask it was started with
# is the command's, as an exec would keep it (a rank Fabric starts holds the stop signals until it listens)
started_with = signal.pthread_sigmask(signal.SIG_BLOCK, {signals})
buf = b""
def receive() -> None:  # unbuffered, so that select() below sees what is still to come
    global buf
    chunk = conn.recv(64)
    if not chunk:
        raise ConnectionError("the server ended")
    buf += chunk
def number() -> int:  # the server's next line
    global buf
    while b"\\n" not in buf:
        receive()
    line, buf = buf.split(b"\\n", 1)
    return int(line)
try:
    conn = socket.socket(socket.AF_UNIX)
    while True:  # the server may still be importing: wait while it lives
        try:
            conn.connect({socket!r})
            break
        except OSError:
            try:
                alive = open("/proc/{server_pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
            except OSError:
                alive = False
            if not alive:
                raise
            time.sleep(0.05)
    leader = os.getpgrp() == os.getpid()  # started as a group (a job): its signals go to the command's group
    # every descriptor it was started with (its standard streams, and those passed on: a compile worker's pipes)
    fds = sorted(int(fd) for fd in os.listdir("/proc/self/fd") if int(fd) != conn.fileno() and os.path.exists(
        f"/proc/self/fd/{{fd}}"))
    body = json.dumps({{"argv": args, "env": dict(os.environ), "cwd": os.getcwd(), "leader": leader,
                       "fds": fds, "mask": sorted(int(s) for s in started_with),
                       "cpus": sorted(os.sched_getaffinity(0))}}).encode()
    socket.send_fds(conn, [struct.pack("!I", len(body))], fds)
    conn.sendall(body)
    pid = number()
except (OSError, ValueError):
    pid = 0
if pid <= 0:  # the server is gone or declined: a real interpreter, as if none of this existed
    signal.pthread_sigmask(signal.SIG_SETMASK, started_with)
    os.execv({python!r}, [{python!r}, *args])
# Each signal's number is written to a pipe by the C-level handler, and forwarded from there: a Python handler alone
# misses a signal that lands between its last check and a blocking read (the client then waits on a command that
# never got it: seen about once in 150 commands signalled beside other work)
wake_read, wake_write = os.pipe()
os.set_blocking(wake_write, False)
signal.set_wakeup_fd(wake_write, warn_on_full_buffer=False)
for sig in {signals}:
    signal.signal(sig, lambda *_: None)
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signals})  # what came meanwhile is forwarded now
while b"\\n" not in buf:
    ready = select.select([conn, wake_read], [], [])[0]
    for sig in os.read(wake_read, 64) if wake_read in ready else b"":
        try:
            (os.killpg if leader else os.kill)(pid, sig)
        except ProcessLookupError:  # it ended meanwhile: its status follows
            pass
    if conn in ready:
        receive()
status = number()
if os.WIFSIGNALED(status):  # SIGKILL (the OOM killer's) has no handler to reset and is default already
    if os.WTERMSIG(status) != signal.SIGKILL:
        signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
    os.kill(os.getpid(), os.WTERMSIG(status))
# ended here, with nothing to flush: an interpreter's own end resets its handlers, and a signal sent in that instant
# (a launcher still stopping the group) would end the client by it, though the command exited by its code
os._exit(os.waitstatus_to_exitcode(status))
"""


SHARED = "FABRIC_LAB_WARM_CLIENT"  # a server's client handed to a real interpreter (make lab's bench-gpt) to use


def executable() -> str:
    """The `python` to start a job with: the client at hand, else a warm client of its own (its server starts on the
    first call and imports in the background; a command waits for it), or the real one with FABRIC_LAB_WARM=0."""
    global _client
    client = at_hand()
    if client is None and os.environ.get("FABRIC_LAB_WARM", "1") != "0":
        client = _client = _start_server()
    return client or REAL


def at_hand() -> str | None:
    """The warm client this process can use without starting a server: its own python when it is a warm child (its
    children are forked there too), the one its starter handed it (FABRIC_LAB_WARM_CLIENT: started real beside a
    server), or the one it started already; None with FABRIC_LAB_WARM=0."""
    if os.environ.get("FABRIC_LAB_WARM", "1") == "0":
        return None
    return next((path for path in (sys.executable, os.environ.get(SHARED, "")) if is_client(path)), _client)


def is_client(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return CLIENT.splitlines()[1].encode() in f.read(200)
    except OSError:
        return False


def real_interpreter() -> str:
    """The interpreter itself: in a warm child sys.executable is the client, whose first line names it."""
    if not is_client(sys.executable):
        return sys.executable
    with open(sys.executable) as f:
        return f.readline()[2:].rsplit(" -S", 1)[0]


REAL = real_interpreter()  # for the tests that look at a real process tree, and for FABRIC_LAB_WARM=0


def install() -> None:
    """The warm client as this process's sys.executable too: what the scripts a test runs in its own process launch
    (the lab's stages, lab.bench's cases, device_probe's minimal jobs, torch.compile's workers) starts warm as well."""
    sys.executable = executable()


_client = None


def _start_server() -> str:
    folder = Path(tempfile.mkdtemp(prefix="warm-python-"))
    sock = str(folder / "socket")
    client = folder / "python"
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    server = subprocess.Popen([REAL, __file__, sock, str(client)], stdin=subprocess.PIPE, env=env)
    _start_server.server = server  # its stdin closes with this process, and it exits then
    client.write_text(CLIENT.format(python=REAL, socket=sock, server_pid=server.pid,
                                    signals=[int(s) for s in FORWARDED]))
    client.chmod(0o755)
    return str(client)


def declines(argv: list[str], env: dict) -> bool:
    """Whether a real interpreter must run this command (see the module's docstring)."""
    rest = list(argv)
    while rest and rest[0] in TAKEN_OVER:
        rest.pop(0)
    if not rest or (rest[0].startswith("-") and (rest[0] not in ("-m", "-c") or len(rest) < 2)):
        return True
    keys = {k for k in {*env, *START_ENV} if (k.startswith(LOAD_TIME) or k in IMPORTED_WITH) and k not in APPLIED}
    # a value the imports set themselves (a child's children inherit it) is what a fresh process gets too
    return any(env.get(k) not in (START_ENV.get(k), os.environ.get(k), IMPORTED_WITH.get(k, START_ENV.get(k)))
               for k in keys)



def run_child(argv: list[str], env: dict, cwd: str, mask: list[int]) -> None:
    """In the forked child: become `python argv...` and never return."""
    import atexit

    code = run_as_main(become_the_interpreter(argv, env, cwd, mask), cwd)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code & 0xFF)


def become_the_interpreter(argv: list[str], env: dict, cwd: str, mask: list[int]) -> list[str]:
    """What `python argv...` starts with: default signal handlers, the signals its starter held (`mask`), the
    folder, the environment (with what the imports set), the thread count, the standard streams; returns argv without
    its -u and -B."""
    import io

    import torch

    for sig in range(1, signal.NSIG):
        if sig not in (signal.SIGKILL, signal.SIGSTOP, signal.SIGINT, signal.SIGPIPE, 32, 33):
            try:
                signal.signal(sig, signal.SIG_DFL)
            except (OSError, ValueError):
                pass
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # as the interpreter sets it
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    os.chdir(cwd)
    imported = {k: v for k, v in os.environ.items() if k not in START_ENV}  # what the imports set, as they would have
    os.environ.clear()
    os.environ.update({**imported, **env})
    tempfile.tempdir = None  # the server's imports looked its TMPDIR up once; the child's own is read at its first use
    options = set()
    while argv[0] in TAKEN_OVER:
        options.add(argv[0])
        argv = argv[1:]
    unbuffered = "-u" in options or bool(env.get("PYTHONUNBUFFERED"))
    if "-B" in options:  # without it, the server's value: PYTHONDONTWRITEBYTECODE, the same as the child's
        sys.dont_write_bytecode = True
    if "OMP_NUM_THREADS" in env:
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    keep_the_servers_op_registrations()
    sys.stdin = sys.__stdin__ = open(0, "r", closefd=False)
    servers = {sys.stdout: "stdout", sys.stderr: "stderr"}
    for fd, name in ((1, "stdout"), (2, "stderr")):
        raw = open(fd, "wb", buffering=0 if unbuffered else -1, closefd=False)
        stream = io.TextIOWrapper(raw, encoding="utf-8", errors="backslashreplace" if fd == 2 else "strict",
                                  line_buffering=not unbuffered and (fd == 2 or os.isatty(fd)),
                                  write_through=unbuffered)
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)
    log_to_the_childs_streams({server: getattr(sys, name) for server, name in servers.items()})
    return argv


def log_to_the_childs_streams(streams: dict) -> None:
    """A logging handler a library made at the server's import holds the server's sys.stdout or sys.stderr (DeepSpeed's
    logs to stdout): it writes to the child's own, which the child's end flushes, as in a new interpreter."""
    import logging

    for logger in [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]:
        for handler in getattr(logger, "handlers", ()):
            if isinstance(handler, logging.StreamHandler) and handler.stream in streams:
                handler.stream = streams[handler.stream]


def keep_the_servers_op_registrations() -> None:
    """At exit, weakref finalizers undo every torch.library registration the server's imports made, one by one,
    writing into dispatcher pages the child shares with the server (each written page copied): 30-60 ms of CPU per
    child for a process about to end. Its own registrations are still undone."""
    import weakref

    import torch.library

    for finalizer, info in list(getattr(weakref.finalize, "_registry", {}).items()):  # CPython's live finalizers
        if info.func is torch.library._del_library:
            finalizer.atexit = False


def run_as_main(argv: list[str], cwd: str) -> int:
    """Run the script, `-m` module or `-c` code as `__main__`; its exit code (negative: the signal it ends by)."""
    import runpy
    import threading
    import traceback

    try:
        if argv[0] == "-m":
            sys.argv, sys.path[0] = [argv[1], *argv[2:]], cwd
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        elif argv[0] == "-c":
            import types

            main = types.ModuleType("__main__")
            sys.modules["__main__"], sys.argv, sys.path[0] = main, ["-c", *argv[2:]], ""
            exec(compile(argv[1], "<string>", "exec"), main.__dict__)
        else:
            sys.argv, sys.path[0] = argv, os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
        threading._shutdown()
    except SystemExit as e:
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
        return e.code if isinstance(e.code, int) else 0 if e.code is None else 1
    except BaseException as e:  # the traceback from the command's first frame on, as the interpreter prints it
        tb = e.__traceback__
        while tb and tb.tb_frame.f_code.co_filename in (__file__, runpy.__file__, "<frozen runpy>"):
            tb = tb.tb_next
        traceback.print_exception(type(e), e, tb)
        return -signal.SIGINT if isinstance(e, KeyboardInterrupt) else 1  # SIGINT: the interpreter ends by it
    return 0


def import_the_extension_builder() -> None:
    """torch's extension builder and setuptools, 50 ms of CPU in every run that loads the C++ GELU or a DeepSpeed op.
    Its import guesses a CUDA home where nvcc is on PATH and no GPU is, with a warning the runs hide
    (hardware.hide_the_cuda_home_guess): not printed here either, on the console of the suite or the lab."""
    import logging

    guess = lambda record: "No CUDA runtime is found" not in record.getMessage()  # noqa: E731
    logger = logging.getLogger("torch.utils.cpp_extension")
    logger.addFilter(guess)
    import torch.utils.cpp_extension  # noqa: F401

    logger.removeFilter(guess)


def a_gpu_may_be_present() -> bool:
    """An NVIDIA or AMD device node: what a forked child could not use once the server had asked CUDA for devices."""
    return any(Path("/dev").glob("nvidia[0-9]*")) or Path("/dev/kfd").exists()


def import_deepspeed_for_the_cpu() -> None:
    """DeepSpeed, 0.2 s of every rank's CPU to import, on a machine without GPUs: it picks its accelerator once, at its
    import, so the server imports it as the project's CPU runs do (DS_ACCELERATOR=cpu: strategies.deepspeed_on_cpu),
    and a child that names another accelerator runs a real interpreter. Where a GPU may be present DeepSpeed would ask
    CUDA for its devices, which no forked child could use afterwards: not imported there."""
    if a_gpu_may_be_present() or START_ENV.get("DS_ACCELERATOR", "cpu") != "cpu":
        return
    IMPORTED_WITH["DS_ACCELERATOR"] = os.environ["DS_ACCELERATOR"] = "cpu"
    try:
        import deepspeed  # noqa: F401
    except Exception:  # noqa: BLE001 - not installed or broken: each command that imports it meets that itself
        pass
    finally:  # not in a child's environment unless its own starter put it there
        if "DS_ACCELERATOR" not in START_ENV:
            del os.environ["DS_ACCELERATOR"]


def build_the_conversion_table() -> None:
    """transformers (5.x) builds its table of checkpoint renamings, a thousand regular expressions (0.17 s), at a
    process's first save_pretrained or from_pretrained, and keeps it: built here once, for every exporting child."""
    try:
        from transformers import conversion_mapping

        conversion_mapping.get_checkpoint_conversion_mapping("gpt2")
    except Exception:  # noqa: BLE001 - another transformers: each child builds what it needs, as before
        pass


def compile_the_repository(repo: Path = Path(__file__).resolve().parents[2]) -> None:
    """Under PYTHONDONTWRITEBYTECODE (this machine's shell sets it; CI likely runs in the same environment, not
    verified) no bytecode is kept, and every process compiled each module of the repository it imported from source:
    60 ms of CPU a run of fabric_gpt.py. The server compiles them once, and its children take that code for a module
    whose source is unchanged (the libraries' own bytecode was written at their install). Nothing is written, as the
    setting asks."""
    if not sys.dont_write_bytecode:  # kept beside their sources as usual
        return
    import importlib.machinery as machinery

    # the tests are pytest's to compile (it rewrites their asserts)
    packages = [d for d in repo.iterdir() if (d / "__init__.py").exists() and d.name != "tests"]
    sources = [*repo.glob("*.py"), *(path for d in packages for path in d.rglob("*.py"))]
    compiled = {}
    for path in sources:
        try:
            mtime = path.stat().st_mtime_ns  # before the read: a source changed meanwhile is compiled again
            compiled[str(path)] = mtime, compile(path.read_bytes(), str(path), "exec", dont_inherit=True)
        except (SyntaxError, ValueError, OSError):  # a file being edited: the command that imports it says why
            pass
    tops = {path.stem for path in repo.glob("*.py")} | {d.name for d in packages}

    class Compiled(machinery.SourceFileLoader):
        def get_code(self, fullname):
            mtime, code = compiled.get(self.path, (None, None))
            return code if code and os.stat(self.path).st_mtime_ns == mtime else super().get_code(fullname)

    class Repository:  # ahead of the path finder, for the repository's own modules only
        @staticmethod
        def find_spec(name, path=None, target=None):
            spec = machinery.PathFinder.find_spec(name, path, target) if name.partition(".")[0] in tops else None
            if spec is not None and spec.origin in compiled:
                spec.loader = Compiled(name, spec.origin)
            return spec

    sys.meta_path.insert(0, Repository)


def serve(sock_path: str, client: str) -> None:
    """Import once, then fork a child per connection; report each child's pid and wait status to its client, and
    kill a child whose client went away (a client killed by SIGKILL cannot forward it)."""
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    import_the_extension_builder()
    import_deepspeed_for_the_cpu()
    build_the_conversion_table()
    compile_the_repository()
    import inspect

    import torch

    # runpy is frozen: a child's frames in it (every script's, every -m's) name "<frozen runpy>", which inspect maps to
    # no module, so each inspect.stack() scanned every loaded module for it (9 ms a call here, 0.2 in a new Python;
    # torchrun's rendezvous calls it at every record, py-cpuinfo at each step of its trace)
    inspect.modulesbyfile.setdefault("<frozen runpy>", "runpy")
    # inspect's table of each loaded module's file, which its first lookup of a source's module fills by resolving
    # every module's path (60 ms of CPU in a child; torch.library does it at each registration of the C++ GELU's fake
    # kernel, every GPT-2 run): filled here once, a child then resolves only the modules it imported itself. Asked
    # for a file no module has, as a lookup during the imports may have mapped this one already (and then scans none).
    # A module that fails the walk (a lazy one whose __getattr__ raises) leaves the table to each child, as before
    try:
        inspect.getmodule(None, "<no module's file>")
    except Exception:  # noqa: BLE001
        pass
    # what the imports made lives as long as the server: out of every child's garbage collections, which otherwise
    # walk its half a million objects (0.3 s a full one) and write into each page holding them (copied on write)
    gc.freeze()

    if torch.cuda.is_initialized():  # CUDA cannot be used in a forked child
        sys.exit("warm_python: CUDA was initialized on import; run with FABRIC_LAB_WARM=0")
    sys.executable = client
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(sock_path)
    listener.listen(64)
    children: dict[int, tuple[socket.socket, bool]] = {}  # pid -> its client's connection, whether it leads a group
    while True:
        connections = {conn: pid for pid, (conn, _) in children.items() if conn}
        readable, _, _ = select.select([listener, sys.stdin, *connections], [], [], 0.05)
        if sys.stdin in readable and not os.read(sys.stdin.fileno(), 1):  # the suite ended
            for pid in children:
                kill(children, pid)
            return
        for conn in readable:
            if conn in connections and not conn.recv(1):  # killed once: not watched again while it ends
                pid = connections[conn]
                kill(children, pid)
                conn.close()
                children[pid] = None, children[pid][1]
        reap(children)
        if listener in readable:
            accept(listener, children)


def kill(children: dict, pid: int) -> None:
    try:
        (os.killpg if children[pid][1] else os.kill)(pid, signal.SIGKILL)
    except ProcessLookupError:  # ended meanwhile, not reaped yet
        pass


def reap(children: dict) -> None:
    """Send each ended child's wait status to its client."""
    while children:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            break
        conn = children.pop(pid)[0]
        if conn:
            try:
                conn.sendall(f"{status}\n".encode())
            except OSError:
                pass
            conn.close()


def accept(listener: socket.socket, children: dict) -> None:
    """Take one client's request: decline it (the client execs a real interpreter) or fork its command."""
    conn, _ = listener.accept()
    try:
        msg, fds, _, _ = socket.recv_fds(conn, 4, 250)
        size, body = struct.unpack("!I", msg)[0], b""
        while len(body) < size:
            body += conn.recv(size - len(body))
        request = json.loads(body)
    except (OSError, ValueError, struct.error):
        conn.close()
        return
    if declines(request["argv"], request["env"]) or request["cpus"] != sorted(os.sched_getaffinity(0)):
        conn.sendall(b"0\n")
        conn.close()
    else:
        pid = os.fork()
        if pid == 0:
            try:
                listener.close()
                for other, _ in children.values():
                    if other:
                        other.close()
                conn.close()
                high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 10_000) for fd in fds]  # above any target number
                for fd in fds:
                    os.close(fd)
                for fd, target in zip(high, request["fds"]):
                    os.dup2(fd, target)  # inheritable, as after an exec
                    os.close(fd)
                if request["leader"]:
                    os.setpgid(0, 0)
                run_child(request["argv"], request["env"], request["cwd"], request["mask"])
            finally:  # what escapes it (a signal in its last instant, a stream that raises at its flush) ends it here:
                os._exit(1)  # unwound, it would run the server's loop and clean-up, in the command's folder
        if request["leader"]:
            os.setpgid(pid, pid)  # here too, so that no signal can come before the child's own call
        conn.sendall(f"{pid}\n".encode())
        children[pid] = conn, request["leader"]
    for fd in fds:
        os.close(fd)


if __name__ == "__main__":
    folder, server = Path(sys.argv[1]).parent, os.getpid()  # a child's sys.argv is its command's
    try:
        serve(*sys.argv[1:])
    finally:  # its socket and client, by the server alone
        if os.getpid() == server:
            import shutil

            shutil.rmtree(folder, ignore_errors=True)
