"""GELU written by hand twice: a Python torch.autograd.Function and a C++ operator built just in time.

    from gelu_ext import GELU, gelu_py, gelu_cpp
    GELU(impl="cpp", approximate="tanh")(x)   # impl: "torch" (F.gelu), "py", "cpp"

Both match torch.nn.functional.gelu(x, approximate="none" | "tanh"); `python -m gelu_ext check`
prints the errors and gradcheck results, `python -m gelu_ext bench` the speed against F.gelu.
"""

import fcntl
import math
import os
import shutil
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

APPROXIMATIONS = ("none", "tanh")
IMPLS = ("torch", "py", "cpp")
# the activations LeNet-5 takes (relu, its default, first): gelu_torch is F.gelu, gelu_py and gelu_cpp are these
ACTIVATIONS = ("relu", *(f"gelu_{impl}" for impl in IMPLS))
SOURCE = Path(__file__).with_name("gelu.cpp")
CUDA_SOURCE = Path(__file__).with_name("gelu_cuda.cu")
CUDA_NAME = "gelu_ext_cuda"  # the CUDA kernels' library, loaded after the CPU one
CUDA_ARCHS_WITHOUT_GPU = "8.0;9.0"  # no GPU to ask at build time: the course's A100 and the H100
BUILD_ROOT = Path(os.environ.get("GELU_EXT_BUILD_DIR", Path(__file__).with_name("build")))
SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


class GeluBuildError(RuntimeError):
    """The C++ extension could not be built or loaded; the message names the cause and the fix."""


def _check(x: torch.Tensor, approximate: str) -> None:
    if not (x.is_floating_point()):
        raise TypeError(f"gelu: expected a floating-point tensor (float32/64, float16, bfloat16), got {x.dtype}; "
                        "convert it with .float() first")
    if approximate not in APPROXIMATIONS:
        raise ValueError(f"gelu: approximate must be one of {APPROXIMATIONS}, got {approximate!r}")


# ----------------------------------------------------------------------------- Python version
def _forward_math(x: torch.Tensor, approximate: str) -> torch.Tensor:
    if approximate == "tanh":
        return 0.5 * x * (1.0 + torch.tanh(SQRT_2_OVER_PI * (x + 0.044715 * x.pow(3))))
    return 0.5 * x * (1.0 + torch.erf(x * math.sqrt(0.5)))


def _derivative_math(x: torch.Tensor, approximate: str) -> torch.Tensor:
    if approximate == "tanh":
        t = torch.tanh(SQRT_2_OVER_PI * (x + 0.044715 * x.pow(3)))
        return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * SQRT_2_OVER_PI * (1.0 + 3 * 0.044715 * x * x)
    cdf = 0.5 * (1.0 + torch.erf(x * math.sqrt(0.5)))
    pdf = torch.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)
    return cdf + x * pdf


class GeluFunction(torch.autograd.Function):
    """GELU with a hand-written backward; reduced precisions are computed in float32, as F.gelu does."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
        _check(x, approximate)
        ctx.save_for_backward(x)
        ctx.approximate = approximate
        wide = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        return _forward_math(wide, approximate).to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (x,) = ctx.saved_tensors
        wide = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        return (grad.to(wide.dtype) * _derivative_math(wide, ctx.approximate)).to(x.dtype), None


def gelu_py(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    return GeluFunction.apply(x, approximate)


# ----------------------------------------------------------------------------- C++ version
def _simd_flags() -> tuple[str, list[str]]:
    """Compile for the instruction set PyTorch's own kernels dispatch to here, so Vectorized<T> is SIMD."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability == "AVX512":
        return "avx512", ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-DCPU_CAPABILITY_AVX512",
                          "-DCPU_CAPABILITY=AVX512"]
    if capability == "AVX2":
        return "avx2", ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY_AVX2", "-DCPU_CAPABILITY=AVX2"]
    return "default", []


def cuda_toolkit() -> str | None:
    """The CUDA toolkit to compile gelu_cuda.cu with, when torch is a CUDA build: CUDA_HOME, /usr/local/cuda or the
    one nvcc on PATH belongs to, whichever has nvcc and the runtime's headers. None: no toolkit, GELU_EXT_CUDA=0, or
    no GPU to run the kernel on (GELU_EXT_CUDA=1 builds it anyway: a cluster's login node, the build test)."""
    wanted = os.environ.get("GELU_EXT_CUDA", "auto")
    if torch.version.cuda is None or wanted == "0" or (wanted != "1" and not torch.cuda.is_available()):
        return None
    nvcc = shutil.which("nvcc")
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda",
                  str(Path(nvcc).resolve().parent.parent) if nvcc else None]
    for home in filter(None, candidates):  # a wrapper script on PATH (/usr/local/bin/nvcc) is not the toolkit
        if (Path(home) / "bin" / "nvcc").is_file() and (Path(home) / "include" / "cuda_runtime.h").is_file():
            return home
    return None


def build_plan() -> list[tuple[str, list[str], list[str], str | None]]:
    """The libraries to load, each (name, sources, compiler flags, CUDA toolkit) built into gelu_ext/build/<name>:
    the CPU operator for this CPU's instruction set, then, where cuda_toolkit() finds a toolkit, gelu_cuda.cu's
    kernels as a library of their own. The CPU library is the same with or without them, so it is compiled once
    (make setup's) and a toolkit adds one source to compile, not two."""
    tag, flags = _simd_flags()
    plan = [(f"gelu_ext_cpp_{tag}", [str(SOURCE)], ["-O3", "-fopenmp", *flags], None)]
    toolkit = cuda_toolkit()
    if toolkit:
        plan.append((CUDA_NAME, [str(CUDA_SOURCE)], ["-O3"], toolkit))
    return plan


def is_built() -> bool:
    """Whether this machine's build of the operator exists (make setup makes it): a choice between kernels takes
    the C++ one only then, rather than compiling for half a minute inside a run."""
    return all((BUILD_ROOT / name / f"{name}.so").exists() for name, *_ in build_plan())


_loaded = False


def load_cpp(verbose: bool = False) -> None:
    """Build (once, cached under gelu_ext/build/) and load the operator, safe across processes.

    Older torch releases guard the build folder with a lock file whose mere existence blocks, so a killed
    build blocks every later one (newer ones use an advisory lock). We hold an flock, which the kernel
    releases when its holder dies, around the build: a `lock` file found while we hold it is stale.
    """
    global _loaded
    if _loaded:
        return
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise GeluBuildError(f"gelu_cpp needs a C++ compiler, and {compiler!r} was not found on PATH. "
                             "Fix: install one (e.g. `apt-get install g++`) or set CXX, or use --activation gelu_py.")
    plan = build_plan()
    if not plan[-1][3]:  # a build without CUDA: torch's guess of a toolkit at the import below would mislead
        from core.run.hardware import hide_the_cuda_home_guess

        hide_the_cuda_home_guess()
    from torch.utils import cpp_extension  # imported here: it is slow and only the C++ path needs it

    from core.host.extension_compiler import install

    install()  # the venv's c++ (its script names this checkout's compiler wrapper, which may have moved)

    venv_bin = Path(sys.prefix) / "bin"  # its ninja, whatever the shell's PATH: another version rebuilds (strategies.py)
    if (venv_bin / "ninja").exists() and not os.environ.get("PATH", "").startswith(f"{venv_bin}:"):
        os.environ["PATH"] = f"{venv_bin}:{os.environ.get('PATH', '')}"
    for name, sources, flags, toolkit in plan:  # the CPU library first: it defines the ops the CUDA one registers for
        if toolkit:
            cpp_extension.CUDA_HOME = os.environ["CUDA_HOME"] = toolkit  # guessed from PATH at import: maybe a wrapper
            if not os.environ.get("TORCH_CUDA_ARCH_LIST") and not torch.cuda.is_available():
                os.environ["TORCH_CUDA_ARCH_LIST"] = CUDA_ARCHS_WITHOUT_GPU
        _build_and_load(cpp_extension, name, sources, flags, toolkit, verbose)
    _register_python_side()
    _loaded = True


def _build_and_load(cpp_extension, name: str, sources: list[str], flags: list[str], toolkit: str | None,
                    verbose: bool) -> None:
    """One library of the plan, built if its sources or flags changed, under an flock (see load_cpp), then loaded."""
    from core.host.extension_compiler import noted_build

    build_dir = BUILD_ROOT / name
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(BUILD_ROOT / f"{name}.flock", "w") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        (build_dir / "lock").unlink(missing_ok=True)
        try:
            with noted_build(f"gelu_ext {name}", build_dir / f"{name}.so"):
                cpp_extension.load(name=name, sources=sources, extra_cflags=[] if toolkit else flags,
                                   extra_cuda_cflags=flags if toolkit else None,
                                   extra_ldflags=[] if toolkit else ["-fopenmp"], with_cuda=bool(toolkit),
                                   build_directory=str(build_dir), is_python_module=False, verbose=verbose)
        except (RuntimeError, OSError) as e:
            raise GeluBuildError(f"building the gelu_ext C++ extension in {build_dir} failed: {e}. "
                                 "Fix: read the compiler output above; delete that folder to rebuild from scratch"
                                 + (f"; GELU_EXT_CUDA=0 builds without the CUDA kernel (toolkit {toolkit})" if toolkit
                                    else "") + ".") from e


def cuda_implementation() -> str:
    """What runs gelu_ext's ops on CUDA tensors, as the dispatcher has it: the kernels of gelu_cuda.cu, or the
    composite of ATen ops in gelu.cpp (a build without the CUDA toolkit)."""
    load_cpp()
    cuda = next((line for line in torch._C._dispatch_dump("gelu_ext::gelu_forward").splitlines()
                 if line.startswith("CUDA:")), "")
    return "gelu_cuda.cu kernel" if CUDA_SOURCE.name in cuda else "ATen ops (built without nvcc)"


def _is_dense(x: torch.Tensor) -> bool:
    """Python's twin of at::Tensor::is_non_overlapping_and_dense: strides that tile the storage exactly."""
    if x.numel() <= 1:
        return True
    expected = 1
    for stride, size in sorted((st, sz) for st, sz in zip(x.stride(), x.shape) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _register_python_side() -> None:
    """Fake (meta) kernels for torch.compile and the meta device; autograd is the C++ side's (GeluFunction)."""

    def like(x, same_strides=True):  # the C++ kernels keep a dense input's layout, else return contiguous
        dense = same_strides and _is_dense(x)
        return torch.empty_like(x, memory_format=torch.preserve_format if dense else torch.contiguous_format)

    @torch.library.register_fake("gelu_ext::gelu_forward")
    def _(x, approximate):
        return like(x)

    @torch.library.register_fake("gelu_ext::gelu_backward")
    def _(grad, x, approximate):
        return like(x, grad.stride() == x.stride())


def gelu_cpp(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    _check(x, approximate)
    load_cpp()
    return torch.ops.gelu_ext.gelu_forward(x, approximate)


# ----------------------------------------------------------------------------- which is faster here
KERNEL_VERSION = 2  # the C++ tanh form: 2 computes it from exp (1 called Sleef's tanh, 3.5x slower): measure again


def tanh_speeds(tokens: int, width: int, dtype: torch.dtype, n_threads: int, allow_measure: bool = True) -> dict | None:
    """Seconds of F.gelu's and of the C++ operator's tanh GELU, forward and backward, on a (tokens, width) input
    of `dtype` with a rank's threads: measured once per machine and shape (core/run/measurements.py), then read back;
    None when not measured and `allow_measure` is False. A model chooses by it where the C++ one is built."""
    from core.run.measurements import cached, seconds_per_call, threads

    def measure() -> dict:
        load_cpp()
        x = torch.randn(tokens, width, dtype=dtype, requires_grad=True)
        grad, times = torch.randn(tokens, width, dtype=dtype), {}
        with threads(n_threads):
            for impl in ("torch", "cpp"):
                act = GELU(impl, "tanh")
                times[impl] = seconds_per_call(lambda: torch.autograd.grad(act(x), x, grad), seconds=0.15)
        return {"torch_s": times["torch"], "cpp_s": times["cpp"]}

    settings = {"tokens": tokens, "width": width, "dtype": str(dtype), "threads": n_threads, "kernel": KERNEL_VERSION}
    return cached("gelu_tanh", settings, measure, allow_measure, timed_threads=n_threads)


# ----------------------------------------------------------------------------- module
class GELU(nn.Module):
    """Drop-in for nn.GELU choosing the implementation: "torch" (F.gelu), "py" or "cpp"."""

    def __init__(self, impl: str = "torch", approximate: str = "none"):
        super().__init__()
        if impl not in IMPLS:
            raise ValueError(f"GELU impl must be one of {IMPLS}, got {impl!r}")
        if approximate not in APPROXIMATIONS:
            raise ValueError(f"GELU approximate must be one of {APPROXIMATIONS}, got {approximate!r}")
        self.impl, self.approximate = impl, approximate
        if impl == "cpp":
            load_cpp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.impl == "py":
            return gelu_py(x, self.approximate)
        if self.impl == "cpp":
            return gelu_cpp(x, self.approximate)
        return F.gelu(x, approximate=self.approximate)

    def extra_repr(self) -> str:
        return f"impl={self.impl}, approximate={self.approximate}"
