"""The machine a run is on: refusing device settings it cannot honour (with the fix), a torch that cannot use the
GPUs nvidia-smi sees, and the CPU's name and units that the records and benchmarks print beside every figure."""

import contextlib
import functools
import logging
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from core.run.flags import ConfigError
from core.run.ranks import usable_cores


def hide_the_cuda_home_guess() -> None:
    """torch's extension builder warns at import where nvcc is on PATH but no GPU is ("No CUDA runtime is found, using
    CUDA_HOME=..."): for a build without CUDA (DeepSpeed's CPU ops, the C++ GELU's CPU variant) it only misleads."""
    logging.getLogger("torch.utils.cpp_extension").addFilter(not_the_cuda_home_guess)


def not_the_cuda_home_guess(record: logging.LogRecord) -> bool:
    return "No CUDA runtime is found" not in record.getMessage()


def check_hardware(accelerator: str, devices: int, precision: str, fp16_on_cpu: bool = False) -> bool:
    """Refuse device settings this machine cannot honour; return whether the run will use CUDA GPUs.
    fp16_on_cpu: the caller runs 16-mixed on a CPU too (float16 autocast and a GradScaler: slow, for checks)."""
    gpu = uses_gpu(accelerator)
    # only where a GPU was asked for or may be used: a CPU run needs no nvidia-smi call and no warning
    unusable = cuda_mismatch() if accelerator in ("auto", "gpu", "cuda") else None
    if accelerator in ("gpu", "cuda") and not torch.cuda.is_available():
        raise ConfigError(unusable or "--accelerator gpu: no CUDA GPU is visible here; use --accelerator cpu (or auto)")
    if unusable:  # --accelerator auto: runs on the CPU, but never without saying why
        print(f"warning: {unusable}; running on the CPU", file=sys.stderr)
    if gpu and devices > torch.cuda.device_count():
        raise ConfigError(f"--devices {devices}: only {torch.cuda.device_count()} GPU(s) visible")
    if not gpu and devices > usable_cores():
        raise ConfigError(f"--devices {devices}: this process may use {usable_cores()} CPU core(s) (its CPU affinity); "
                          f"use at most that many processes")
    if precision == "16-mixed" and not gpu and not fp16_on_cpu:
        raise ConfigError("--precision 16-mixed needs a GPU (float16 loss scaling); on CPU use bf16-mixed or 32-true")
    return gpu


def cuda_mismatch() -> str | None:
    """When nvidia-smi sees GPUs that torch cannot use (most often a torch build for a newer CUDA than the
    driver runs: CUDA 13 builds need driver 580+), the one line that says so and how to mend it."""
    if torch.cuda.is_available() or not shutil.which("nvidia-smi"):
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    gpus = [[f.strip() for f in line.split(",")] for line in out.splitlines() if line.count(",") >= 1]
    if not gpus:
        return None
    name, driver = gpus[0][:2]
    built = f"for CUDA {torch.version.cuda}" if torch.version.cuda else "without CUDA"
    return (f"nvidia-smi sees {len(gpus)} GPU(s) ({name}, driver {driver}) but torch {torch.__version__} (built {built}) "
            f"cannot use them: install a torch build this driver runs, e.g. `rm -rf .venv && make setup "
            f"TORCH_INDEX=https://download.pytorch.org/whl/cu126` (CUDA 12.6 runs on drivers 525 and newer)")


def uses_gpu(accelerator: str) -> bool:
    return accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available())


def _cpuinfo(field: str) -> str | None:
    """The first value of a /proc/cpuinfo field (Linux), else None."""
    return _cpuinfo_fields().get(field)


@functools.cache
def _cpuinfo_fields() -> dict:
    """/proc/cpuinfo's fields, the first value of each, read once a process (the name, family, model and flags are
    read for every cached measurement's key)."""
    fields = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def cpu_name() -> str:
    """The CPU's model name with its family and model: a cloud guest's name is often the vendor's line alone ("AMD
    EPYC" for a Zen 4 and a Zen 5, the same instruction sets and 1.8x apart in LeNet-5's time, docs/lab.md)."""
    name = _cpuinfo("model name") or platform.processor() or "unknown"
    family, model = _cpuinfo("cpu family"), _cpuinfo("model")
    return f"{name} (family {family}, model {model})" if family and model else name


def cpu_units() -> list[str]:
    """The CPU's matrix and vector units that decide small-model speed (bf16 AMX, AVX-512, AVX2)."""
    flags = (_cpuinfo("flags") or "").split()
    return [name for flag, name in (("amx_bf16", "AMX-BF16"), ("avx512_bf16", "AVX-512 BF16"), ("avx512f", "AVX-512"),
                                    ("avx2", "AVX2")) if flag in flags]


def isa_caps() -> dict:
    """The instruction-set caps in force (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA): they change the kernels as much as
    another CPU would (AVX2 alone: bf16 autocast 8.7x slower), so every measurement of this machine is keyed by them."""
    return {v: os.environ[v] for v in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA") if v in os.environ}


def compile_cache_per_caps() -> None:
    """torch.compile writes a CPU kernel for the vector width ATEN_CPU_CAPABILITY allows, but inductor's cache of
    compiled graphs is not keyed by it (torch 2.14): a graph compiled without the cap and served under
    ATEN_CPU_CAPABILITY=avx2 gave a softmax 27 off, and LeNet-5 NaN or an index out of bounds (an AVX-512 EPYC).
    Under caps the cache is a folder of its own, inside TORCHINDUCTOR_CACHE_DIR (or inductor's default)."""
    caps = isa_caps()
    if not caps:
        return
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    folder = "caps-" + "-".join(f"{name.split('_')[0].lower()}_{value}" for name, value in sorted(caps.items()))
    base = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or default_cache_dir()
    if Path(base).name != folder:  # a process started by one that keyed it already
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(base) / folder)


# The kernel behind F.scaled_dot_product_attention, by the ATen operation it dispatches to
SDPA_KERNELS = {"_scaled_dot_product_flash_attention": "flash", "_scaled_dot_product_flash_attention_for_cpu": "flash (CPU)",
                "_scaled_dot_product_efficient_attention": "memory-efficient", "_scaled_dot_product_cudnn_attention": "cuDNN",
                "_scaled_dot_product_fused_attention_overrideable": "fused (device's own)"}


def sdpa_kernel(device: torch.device, dtype: torch.dtype, heads: int, seq_len: int, head_dim: int,
                dropout: float = 0.0) -> str:
    """Which SDPA kernel runs for one micro-batch row of this attention shape (causal, as GPT-2's, with gradients):
    PyTorch picks among flash, memory-efficient, cuDNN and the unfused math by dtype, head dimension and device,
    and says nothing unless asked. Found by running it once and watching the ATen operations it dispatches to."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func.__name__.split(".")[0])
            return func(*args, **(kwargs or {}))

    q, k, v = (torch.randn(1, heads, seq_len, head_dim, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    with Seen() as seen:
        torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)
    found = [SDPA_KERNELS[op] for op in seen.ops if op in SDPA_KERNELS]
    return found[0] if found else "math (unfused: the scores are materialised)"


@contextlib.contextmanager
def host_sync_forbidden(active: bool):
    """With --sync-check, any operation in the block that makes the host wait for the GPU raises (CUDA's own
    detection): a step must queue its work and go on, reading values only at check points."""
    if not active:
        yield
        return
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def compiled_graphs() -> int:
    """Graphs torch.compile has compiled in this process (each recompilation is one more)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def cuda_graphs(compiled: bool, mode: str, device: torch.device) -> str | None:
    """What became of torch.compile's reduce-overhead CUDA graphs (forward and backward captured once, then
    replayed): torch.compile falls back to launching kernels one by one, quietly, when it cannot capture."""
    if not (compiled and mode == "reduce-overhead"):
        return None
    if device.type != "cuda":
        return f"not captured: CUDA graphs record CUDA kernels and this run is on {device.type}; compiled without them"
    from torch._dynamo.utils import counters

    skipped = counters["inductor"]["cudagraph_skips"]
    return "captured and replayed" if not skipped else (
        f"refused for {skipped} graph{'s' * (skipped != 1)} (TORCH_LOGS=cudagraphs prints the reason); those run "
        "compiled, without graphs")


# ----------------------------------------------------------------------------- glibc's heap
def _glibc():
    """The C library when it is glibc (whose allocator these settings belong to), else None."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except OSError:  # musl or another libc: its allocator has no such settings
        return None


def keep_freed_memory_in_heap() -> None:
    """For LeNet-5's CPU steps: glibc hands each freed block over its (adaptive) threshold back to the OS, so each
    step page-faults its ~30 MB of activations in again; on the 2-core Xeon VM that made steps 1.3-1.6x slower and
    erratic. The largest threshold glibc allows and no trimming keep them in the heap for the next step."""
    libc = _glibc()
    if libc is not None:
        m_trim_threshold, m_mmap_threshold = -1, -3
        libc.mallopt(m_mmap_threshold, 32 * 2**20)
        libc.mallopt(m_trim_threshold, 2**31 - 1)


def return_freed_host_memory() -> None:
    """Hand what the heap holds freed back to the system (glibc keeps it otherwise). For a GPT run after set-up:
    ZeRO-Infinity creates each partition's fp32 weights in host memory before swapping them to NVMe, and without this
    the process kept those gigabytes through training. And before the host plan reads a process's baseline
    (accounting.process_baseline)."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)



def gpu_precision() -> str:
    """--precision auto on GPUs (or a plan for them): bf16 autocast, fp16 with loss scaling where a GPU has no bf16."""
    return "16-mixed" if torch.cuda.is_available() and not torch.cuda.is_bf16_supported() else "bf16-mixed"


NO_BF16 = "no bf16 instructions on this CPU (torch would emulate bf16)"  # why --precision auto took float32 untimed


def native_bf16() -> bool:
    """This CPU computes bf16 matmuls in hardware (AVX-512 BF16 or AMX) and no instruction-set cap hides them. Without
    them torch emulates bf16: on an AVX2 EPYC with torch 2.14, 0.7 GFLOP/s against 61 in float32."""
    below_bf16 = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI")
    capped = os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper() in below_bf16
    return not capped and any("BF16" in unit for unit in cpu_units())
