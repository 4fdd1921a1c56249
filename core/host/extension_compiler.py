"""The C++ compiler the venv's torch extensions build with (DeepSpeed's CPU ops, the C++ GELU): the system's `c++`
without the debug information no run reads, and for the op named in $FABRIC_LAB_PRECOMPILE with torch/extension.h
parsed once for all its sources rather than once for each.

torch compiles with $CXX when set, else with the `c++` first on PATH: `install()` writes the venv's, a shell script
that runs this file for an extension's source (standard library only: it starts once per source file) and hands
every other command (a link, torch's version checks) to the compiler itself. The command ninja records is the same
`c++ ...` with or without it, so an op built either way is never rebuilt for the other.

Why. DeepSpeed's builders pass `-O3 -g`: without -g async I/O and pinned memory took 623 s of CPU instead of 873 (an
AVX2 EPYC). Async I/O is compiled at -O0 and 9 of its 12 sources include torch/extension.h, 17-18 s of CPU each, two
thirds of it parsing (an AVX-512 BF16 EPYC): its headers precompiled once with the sources' own flags (31 s, 786 MB,
deleted after the build) leave 6-7 s a source, and the NVMe ops' build 148 s of CPU instead of 199 (docs/tests-log.md).
An op of two or three sources would lose: the precompiled header costs two sources' parse.

Where clang is at hand (the system's, or Debian's that `make setup` unpacks into the venv), an op's sources that
include torch/extension.h compile with clang instead: 0.69-0.84x GCC's CPU time a source (an AMX Xeon, docs/tests.md),
and for the op named in $FABRIC_LAB_PRECOMPILE with its header precompiled, templates instantiated once
(-fpch-instantiate-templates): GCC instantiates them again at the end of every source, 10 s of a source's 10-12 even
with the header precompiled; clang's take 3-6 s after a 19-23 s header. clang compiles with the op's -fopenmp, and an
object that then calls the OpenMP runtime is thrown away and compiled by GCC: clang's OpenMP calls libomp, another
runtime than torch's libgomp. A source whose own text uses OpenMP goes to GCC without trying, and so does any source
clang fails on.
"""

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

HEADER = "torch/extension.h"
SOURCE_SUFFIXES = (".c", ".cc", ".cpp", ".cxx")
INCLUDE = re.compile(r'\s*#\s*include\s*[<"]([^>"]+)[>"]')
FOLDER = "precompiled"  # inside the op's build folder, where ninja runs the compiler


def install() -> None:
    """Write the venv's `c++` (a no-op outside a venv, or where it is this file's already)."""
    venv_cxx = Path(sys.prefix) / "bin" / "c++"
    if sys.prefix == sys.base_prefix:
        return
    others = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep) if Path(p) != venv_cxx.parent)
    real = shutil.which("c++", path=others)
    if not real:
        return
    python = Path(sys.prefix) / "bin" / "python"  # not sys.executable, which may be a warm_python client for a while
    here = Path(__file__).resolve()  # a checkout that moved it leaves the system's compiler, not a broken one
    script = (f"#!/bin/sh\n# torch extensions built in this venv: {here.name}\n"
              f'[ -f "{here}" ] || exec "{real}" "$@"\n'
              # only an extension's source needs this file; the rest (torch asks for the compiler's version twice at
              # each extension's load, a Python started for each) goes to the compiler as this file would send it
              "for arg do case $arg in -DTORCH_EXTENSION_NAME=*)\n"
              f'  exec "{python}" -I -S "{here}" "{real}" "$@";; esac; done\n'
              f'exec "{real}" "$@" -g0\n')
    if not venv_cxx.exists() or venv_cxx.read_text() != script:
        temporary = venv_cxx.with_suffix(f".{os.getpid()}")
        temporary.write_text(script)
        temporary.chmod(0o755)
        temporary.replace(venv_cxx)


BUILD_LOG = "FABRIC_LAB_BUILD_LOG"  # a file: each build made while it is set adds a line (the suite sums them)


@contextlib.contextmanager
def noted_build(name: str, output: Path):
    """Within: an op loaded (built if it must be), one process at a time; when `output` (its shared library) was made
    or remade meanwhile, its seconds are added to $FABRIC_LAB_BUILD_LOG, where set: `make test` ends with the time
    its builds took. Processes that need the op together wait here for the first (torch's own lock would make them
    wait inside the load, and each would then count the first one's build as its own)."""
    output.parent.mkdir(parents=True, exist_ok=True)
    with open(output.parent / "fabric-lab-build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        before, started = output.stat().st_mtime if output.exists() else None, time.time()
        yield
        log = os.environ.get(BUILD_LOG)
        if log and output.exists() and output.stat().st_mtime != before:
            with open(log, "a") as f:  # one short line in append mode: whole, whichever process writes it
                f.write(json.dumps({"build": name, "seconds": round(time.time() - started, 1)}) + "\n")


@contextlib.contextmanager
def precompiled_torch_header(op: str):
    """Within: the op `op` (its extension name) compiles with torch/extension.h precompiled; deleted after."""
    from torch.utils.cpp_extension import _get_build_directory

    os.environ["FABRIC_LAB_PRECOMPILE"] = op
    try:
        yield
    finally:
        del os.environ["FABRIC_LAB_PRECOMPILE"]
        shutil.rmtree(Path(_get_build_directory(op, verbose=False)) / FOLDER, ignore_errors=True)


def compile_command(real: str, args: list[str], precompile: bool = True) -> list[str]:
    """What runs for `c++ args`: the same without debug information, and the precompiled header where asked (not
    where clang compiles the op's other sources: GCC's header would be built for this one alone)."""
    args = [*args, "-g0"]
    if precompile and (source := precompiling(args)) is not None and includes_torch(*source):
        try:  # the sources without torch would only pay for loading it
            header = precompiled(real, flags_of(args))
        except OSError:  # never a reason for the compile itself to fail
            header = None
        if header:
            args += ["-include", str(header)]
    return [real, *args]


def precompiling(args: list[str]) -> tuple[Path, list[Path]] | None:
    """(source, its -I folders) where `args` compile one source of the op named in $FABRIC_LAB_PRECOMPILE, else None
    (another op, or a link)."""
    found = extension_source(args)
    op = os.environ.get("FABRIC_LAB_PRECOMPILE")
    return found if found and op and f"-DTORCH_EXTENSION_NAME={op}" in args else None


def extension_source(args: list[str]) -> tuple[Path, list[Path]] | None:
    """(source, its -I folders) where `args` compile one source of a torch extension, else None (a link, a probe)."""
    sources = [Path(a) for a in args if is_source(a)]
    if any(a.startswith("-DTORCH_EXTENSION_NAME=") for a in args) and len(sources) == 1:
        return sources[0], [Path(a[2:]) for a in args if a.startswith("-I") and len(a) > 2]
    return None


def local_lines(path: Path, include_dirs: list[Path], seen: set | None = None):
    """The lines of `path` and of the headers it includes that are found beside it or in -I folders (system headers
    are in neither), each file once."""
    seen = set() if seen is None else seen
    seen.add(path)
    for line in path.read_text(errors="replace").splitlines():
        yield line
        included = INCLUDE.match(line)
        if included and included[1] != HEADER:
            candidates = [folder / included[1] for folder in (path.parent, *include_dirs)]
            found = next((c.resolve() for c in candidates if c.is_file()), None)
            if found and found not in seen:
                yield from local_lines(found, include_dirs, seen)


def includes_torch(path: Path, include_dirs: list[Path]) -> bool:
    """Whether `path` includes torch/extension.h, itself or through the headers it finds beside it or in -I folders."""
    return any((included := INCLUDE.match(line)) and included[1] == HEADER for line in local_lines(path, include_dirs))


# ----------------------------------------------------------------------------- clang, where it is at hand
OPENMP = re.compile(r"^\s*#\s*pragma\s+omp\b|\bparallel_for\b|\bomp_\w+\s*\(", re.MULTILINE)
OPENMP_CALL = re.compile(r"^\s*U\s+(__kmpc_|omp_|GOMP_)", re.MULTILINE)
CLANG = "clang"  # Debian's clang, unpacked into the venv by make setup where the system has none


def writes_openmp(path: Path) -> bool:
    """Whether the source itself uses OpenMP: a pragma, a call to its runtime, or ATen's parallel_for (OpenMP's
    threads in torch's builds). What its headers hold is known only once compiled (`calls_openmp`)."""
    return bool(OPENMP.search(path.read_text(errors="replace")))


def calls_openmp(obj: Path) -> bool:
    """Whether the object calls an OpenMP runtime (clang's __kmpc_*, or omp_* and GOMP_*); True when it cannot tell."""
    nm = shutil.which("nm")
    listed = subprocess.run([nm, "-u", str(obj)], capture_output=True, text=True) if nm else None
    return listed is None or listed.returncode != 0 or bool(OPENMP_CALL.search(listed.stdout))


def find_clang() -> tuple[str, dict] | None:
    """clang++ and the environment it runs in: $FABRIC_LAB_CLANG's (0: none), else the venv's (its libraries beside
    it), else the system's; None."""
    if (named := os.environ.get("FABRIC_LAB_CLANG")) is not None:
        return None if named in ("", "0") else (named, dict(os.environ))
    # the venv's python runs this file with -S, which leaves sys.prefix the base one: its own path names the venv
    root = (Path(sys.prefix) if sys.prefix != sys.base_prefix else Path(sys.executable).parent.parent) / CLANG
    for binary in sorted(root.glob("usr/lib/llvm-*/bin/clang++"), reverse=True):
        libraries = [str(p) for p in root.glob("usr/lib/*-linux-gnu")] + [os.environ.get("LD_LIBRARY_PATH", "")]
        return str(binary), {**os.environ, "LD_LIBRARY_PATH": os.pathsep.join(filter(None, libraries))}
    system = shutil.which("clang++")
    return (system, dict(os.environ)) if system else None


def compiled_with_clang(args: list[str]) -> bool | None:
    """Compile `args`' source with clang, torch/extension.h precompiled where that is asked and can be done (see the
    module's docstring). True: compiled. False: GCC compiles it without a header of its own: it uses OpenMP, or clang
    failed on it. None: not clang's (a link, a source without torch, no clang, or clang's header did not compile), and
    GCC compiles it as it did before clang."""
    found = extension_source(args)
    if found is None or not includes_torch(*found) or not (clang := find_clang()):
        return None
    compiler, env = clang
    flags, precompile = [*args, "-g0"], precompiling(args) is not None
    if writes_openmp(found[0]):  # not waiting for clang's header: GCC's is wanted only where clang's failed already
        return None if precompile and (header_folder(compiler, flags_of(flags)) / "failed").exists() else False
    pch = None
    if precompile:
        try:
            pch = precompiled(compiler, flags_of(flags), env)
        except OSError:
            return None
        if pch is None:
            return None
    if subprocess.run([compiler, *flags, *(["-include-pch", str(pch)] if pch else [])], env=env,
                      capture_output=True).returncode:
        return False  # its messages dropped: GCC compiles the source next, and says what is wrong with it
    if "-o" not in args or calls_openmp(Path(args[args.index("-o") + 1])):  # a header's OpenMP, instantiated here
        return False
    if pch and "-MF" in args:  # ninja's dependencies: the sources and headers, not the precompiled file (deleted after)
        depfile = Path(args[args.index("-MF") + 1])
        depfile.write_text(depfile.read_text().replace(f" {pch.with_suffix('')} \\\n", " ", 1))
    return True


def is_source(arg: str) -> bool:
    return arg.endswith(SOURCE_SUFFIXES) and not arg.startswith("-")


def flags_of(args: list[str]) -> list[str]:
    """The compile command's flags without its source, output and dependency file: what the header shares."""
    flags, skip = [], False
    for a in args:
        if skip or a in ("-o", "-MF"):
            skip = not skip
        elif a not in ("-c", "-MMD") and not is_source(a):
            flags.append(a)
    return flags


def header_folder(real: str, flags: list[str]) -> Path:
    """Where the header precompiled by `real` with `flags` is made, in the op's build folder (ninja's working one)."""
    return Path(FOLDER).resolve() / hashlib.sha1("\0".join([real, *flags]).encode()).hexdigest()[:16]


def precompiled(real: str, flags: list[str], clang_env: dict | None = None) -> Path | None:
    """torch/extension.h compiled once per compiler and set of flags (the first source builds it while the others
    wait): GCC's beside the header it stands for, which a source then includes (the header is returned), clang's
    with its templates instantiated, which a source names (the .pch is returned); None when it does not compile,
    and each source then parses the header itself."""
    folder = header_folder(real, flags)
    header = folder / "torch_extension.h"
    output = header.with_suffix(".h.pch" if clang_env else ".h.gch")
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not output.exists() and not (folder / "failed").exists():
            header.write_text(f"#include <{HEADER}>\n")
            partial = folder / f"partial{output.suffix}"
            command = [real, *flags, "-x", "c++-header", str(header), "-o", str(partial),
                       *(["-fpch-instantiate-templates"] if clang_env else [])]
            if subprocess.run(command, capture_output=True, env=clang_env).returncode == 0:  # a failure costs time
                partial.replace(output)  # a source never reads a half-written one
            else:
                (folder / "failed").touch()
    return None if not output.exists() else output if clang_env else header


if __name__ == "__main__":
    if (clang := compiled_with_clang(sys.argv[2:])) is not True:
        command = compile_command(sys.argv[1], sys.argv[2:], precompile=clang is None)
        os.execv(command[0], command)
