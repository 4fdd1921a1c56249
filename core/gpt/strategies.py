"""How fabric_gpt.py spreads a GPT-2 over processes, one builder per strategy, all through Lightning Fabric.

    ddp                  replicated model, gradients all-reduced (Fabric's DDPStrategy)
    deepspeed_stage_N    ZeRO-1/2/3 (+ CPU/NVMe offload); on CPU through CPUDeepSpeedStrategy below
    fsdp                 FSDP2 (`fully_shard`), one unit per transformer block plus the root
    tp                   Megatron tensor parallel of every block: attention split by heads, MLP by columns
    fsdp_tp              2-D: tensor parallel inside groups of --tp-size, FSDP2 across them
    pp                   --pp-size stages of contiguous blocks, GPipe or 1F1B over --grad-accum micro-batches

fsdp, tp, fsdp_tp and pp run under Fabric's ModelParallelStrategy, which launches the processes, builds the
device mesh and saves distributed checkpoints; the functions here decide what each rank holds.
`export_state_dict` turns any strategy's model (or checkpoint) back into one ordinary GPT-2 state dict.
"""

import argparse
import ctypes
import functools
import io
import os
import re
import subprocess
import sys
import warnings
from contextlib import nullcontext, redirect_stdout
from pathlib import Path

import torch
from torch import nn

from core.gpt.gpt_model import largest_parameter
from core.host import extension_compiler
from core.run.flags import ConfigError
from core.run.hardware import hide_the_cuda_home_guess
from core.run.layout import saved_config


def fsdp_gathers_bf16(cfg) -> bool:
    """FSDP2 gathers the blocks in bf16 under bf16-mixed (apply_fsdp), not the float32 weights autocast would cast."""
    return cfg.layout.fsdp and cfg.precision == "bf16-mixed"


# ----------------------------------------------------------------------------- DeepSpeed
REDUCE_BUCKET = int(2e8)  # elements; ZeRO-3 keeps a gradient bucket this long (accounting.zero3_bucket)


NVME_BUFFER_COUNT = 8  # ZeRO-Infinity's parameter swap buffers (deepspeed_config)


def nvme_param_buffer(cfg) -> int:
    """Elements of each of ZeRO-Infinity's parameter swap buffers: one rank's partition of the largest parameter, which
    DeepSpeed asserts fits one buffer. A fixed 4.1e7 (the 1.6B model's tied embedding on 2 ranks, 4.02e7) stopped that
    model on one process, whose embedding partition is 8.04e7, with DeepSpeed's assertion ("More elements 51463168
    than buffer size 41000000" for a 1,024-wide GPT-2), and pinned 1.3 GB of host memory (float32) for the tiny
    model."""
    return -(-largest_parameter(cfg) // cfg.layout.dp_size)  # ZeRO-3 pads each parameter to a multiple of the ranks


def deepspeed_config(cfg) -> dict:
    """Written out rather than left to defaults: accumulation and clipping must live here under DeepSpeed
    (Fabric's no_backward_sync and clip_gradients do not apply), and offload targets are explicit."""
    L = cfg.layout
    zero = {"stage": L.zero_stage, "contiguous_gradients": True, "overlap_comm": True,
            "reduce_bucket_size": REDUCE_BUCKET, "allgather_bucket_size": 2e8}
    if L.offload:
        target = {"device": "nvme", "nvme_path": cfg.nvme_path} if cfg.nvme_path else {"device": "cpu", "pin_memory": True}
        zero["offload_optimizer"] = dict(target)
        if L.zero_stage == 3:
            zero["offload_param"] = dict(target)
    if cfg.nvme_path:
        # ZeRO-Infinity swaps the optimizer in sub-groups: DeepSpeed's default of 1e9 elements brings 16 GB of fp32
        # weights, Adam moments and gradients into host memory at once (the 1.6B model was killed at 12 GB per
        # process); 2.5e7 keeps 0.4 GB. Each swapped-in parameter partition takes a whole buffer, and with DeepSpeed's
        # 5 buffers and its reuse distance of 1e9 the 1.6B model's second forward found none free ("Not enough
        # buffers"): parameters are released after use, not prefetched, into 8 buffers each the size of the largest
        # partition (nvme_param_buffer).
        zero.update(sub_group_size=int(2.5e7), stage3_max_reuse_distance=0, stage3_prefetch_bucket_size=0)
        zero["offload_param"].update(buffer_count=NVME_BUFFER_COUNT, buffer_size=nvme_param_buffer(cfg),
                                     max_in_cpu=int(5e7))
    config = {"train_micro_batch_size_per_gpu": cfg.micro_batch_size, "gradient_accumulation_steps": cfg.grad_accum,
              "gradient_clipping": cfg.grad_clip, "zero_optimization": zero, "zero_allow_untested_optimizer": True,
              "steps_per_print": 10**9, "wall_clock_breakdown": False}
    if cfg.precision == "16-mixed":  # DeepSpeed's own loss scaler: an overflowed step is skipped, the scale halved
        config["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": cfg.loss_scale_power,
                          "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1}
    if cfg.nvme_path:
        config["aio"] = {"block_size": 1048576, "queue_depth": 8, "single_submit": False, "overlap_events": True}
    return config


# `make setup` unpacks Debian's libaio here, only when the system has no libaio-dev (no root needed)
VENV_LIBAIO = Path(sys.prefix) / "libaio" / "usr"
# DeepSpeed compiles its ops into torch's extension cache, ~/.cache/torch_extensions unless told: one folder for
# every checkout and venv of a machine, each of which then rebuilds the ops for its own paths, minutes during
# which a run's other ranks give up at the rendezvous. Inside a venv (`make setup`) the ops live in the venv.
# torch runs the `ninja` first on PATH, and two versions (a system's 1.11, requirements.txt's 1.13) each take the
# other's build log for invalid and rebuild every op from scratch: the venv's ninja goes first, in every shell.
if sys.prefix != sys.base_prefix:
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))
    if (Path(sys.prefix) / "bin" / "ninja").exists() and not os.environ.get("PATH", "").startswith(f"{sys.prefix}/bin:"):
        os.environ["PATH"] = f"{sys.prefix}/bin:{os.environ.get('PATH', '')}"


def use_venv_libaio() -> None:
    """Point DeepSpeed's async I/O build (and the loader) at the libaio `make setup` unpacked, if any."""
    lib = next(VENV_LIBAIO.glob("lib/*/libaio.so.1"), None)
    if lib is None:
        return
    for var, folder in (("CPATH", VENV_LIBAIO / "include"), ("LIBRARY_PATH", lib.parent)):
        if str(folder) not in os.environ.get(var, "").split(os.pathsep):  # ranks inherit the launcher's
            os.environ[var] = os.pathsep.join(filter(None, [str(folder), os.environ.get(var)]))
    ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)  # the op needs libaio.so.1: once loaded, found by name


# What `make setup` compiles: the op every multi-process DeepSpeed run on CPU loads (its shared-memory collectives),
# and CPU Adam, which every ZeRO-Offload run steps with (the lab's bench-gpt among them: in a fresh clone its first
# offload case took 64 s instead of 13, and the lab 15.2 min against issue 76's 15; docs/lab.md). Async I/O and
# pinned memory (--nvme-path) are built by the first run that needs them, with a line saying so: few runs need
# them, and they would add about two minutes to the set-up.
SETUP_OPS = ("ShareMemCommBuilder", "CPUAdamBuilder")
OFFLOAD_OPS = ("CPUAdamBuilder",)
NVME_OPS = ("AsyncIOBuilder", "PinMemoryBuilder")
PRECOMPILED_OPS = ("AsyncIOBuilder",)  # 9 of its 12 sources include torch/extension.h (extension_compiler.py)


def deepspeed_on_cpu() -> None:
    """DeepSpeed picks its accelerator at its first import: named here for a run on the CPU, rather than searched
    for with a warning that no GPU was found (every rank); its CPU ops build without CUDA, so torch's guess of a
    CUDA toolkit is hidden too."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    hide_the_cuda_home_guess()


def build_cpu_op(name: str) -> None:
    """Compile one DeepSpeed CPU op into torch's extension cache (a no-op when it is there and up to date)."""
    deepspeed_on_cpu()
    use_venv_libaio()
    ask_cpuinfo_once()
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder(name)
    if builder is None or not builder.is_compatible(verbose=False):
        print(f"note: DeepSpeed's {name} cannot be built here; runs that need it will say so")
        return
    from torch.utils.cpp_extension import _get_build_directory

    output = Path(_get_build_directory(builder.name, verbose=False)) / f"{builder.name}.so"
    try:
        with extension_compiler.precompiled_torch_header(builder.name) if name in PRECOMPILED_OPS else nullcontext(), \
                extension_compiler.noted_build(f"DeepSpeed {builder.name}", output):
            builder.load(verbose=False)
        print(f"built DeepSpeed's {builder.name}")
    except Exception as e:  # the run that needs it will build it again and fail with DeepSpeed's own message
        print(f"note: DeepSpeed's {builder.name} did not build ({type(e).__name__}: {str(e)[:200]})")


def ask_cpuinfo_once() -> None:
    """DeepSpeed asks py-cpuinfo about the CPU three times as it loads an op (CPU Adam: the vendor, then the build's
    -march and SIMD width, even when built), and each answer is a Python started for it that busy-waits 1 s on a
    CPUID process. The answer is the machine's: asked once per machine, kept with the machine's measurements (never
    waiting for their lock: a measurement holds it while its minimal job, perhaps a DeepSpeed rank, runs), and each
    caller gets a copy of it."""
    import cpuinfo

    from core.run import measurements

    if not hasattr(cpuinfo.get_cpu_info, "answer"):
        ask = cpuinfo.get_cpu_info
        answer = functools.cache(lambda: measurements.cached_unlocked("py-cpuinfo", {}, ask))
        cpuinfo.get_cpu_info = lambda: dict(answer())
        cpuinfo.get_cpu_info.answer = answer


def build_cpu_ops(names=SETUP_OPS) -> None:
    """Compile DeepSpeed's CPU ops at `make setup`, as a GPU machine compiles them at install (DS_BUILD_OPS), one
    process each so they build side by side; otherwise the first run that needs one compiles it while its other
    ranks wait at the rendezvous."""
    extension_compiler.install()
    build = "from core.gpt import strategies; strategies.build_cpu_op({!r})"
    procs = [subprocess.Popen([sys.executable, "-c", build.format(name)], cwd=Path(__file__).resolve().parents[2])
             for name in names]
    if any(p.wait() for p in procs):
        sys.exit("error: a DeepSpeed op build crashed (its output is above)")


def build_offload_ops() -> None:
    """CPU Adam for a ZeRO-Offload run, compiled before the ranks start where this venv's `make setup` did not build
    it (a venv set up before it did, or its build removed)."""
    deepspeed_on_cpu()
    if not op_is_built("cpu_adam"):
        print("note: building DeepSpeed's CPU Adam for ZeRO-Offload, once (this venv's make setup did not)",
              flush=True)
        build_cpu_ops(OFFLOAD_OPS)


def op_is_built(name: str) -> bool:
    """Whether torch's extension cache holds DeepSpeed's op `name` (async_io, pin_memory, ...) already."""
    from torch.utils.cpp_extension import _get_build_directory

    return (Path(_get_build_directory(name, verbose=False)) / f"{name}.so").exists()


def prepare_nvme_offload(path: str, on_gpu: bool) -> None:
    """ZeRO-Infinity's NVMe offload: DeepSpeed compiles its async I/O op against libaio and swaps into `path`.
    Point the build (and the loader) at the venv's libaio when the system has none; refuse early when
    DeepSpeed still finds no libaio or the folder cannot be written."""
    use_venv_libaio()
    if not on_gpu:
        deepspeed_on_cpu()  # before deepspeed's first import, as below
    else:
        from torch.utils.cpp_extension import CUDA_HOME

        problem = cuda_toolkit_problem(CUDA_HOME)
        if problem:
            raise ConfigError(problem)
        if os.environ.get("TORCH_CUDA_ARCH_LIST"):  # seen on an H100 image: "9.0a" stopped the op's build
            os.environ["TORCH_CUDA_ARCH_LIST"] = deepspeed_arch_list(os.environ["TORCH_CUDA_ARCH_LIST"])
    from deepspeed.ops.op_builder import AsyncIOBuilder

    if not on_gpu and not op_is_built("async_io"):
        print("note: building DeepSpeed's async I/O and pinned-memory ops for NVMe offload, once (make setup leaves "
              "them to the first --nvme-path run)", flush=True)
        build_cpu_ops(NVME_OPS)
    if not AsyncIOBuilder().is_compatible():
        raise ConfigError("--nvme-path: DeepSpeed's async I/O op needs libaio, which is not installed here; install "
                          "libaio-dev (apt) or run `make setup`, which unpacks it into .venv on Debian/Ubuntu")
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
        if not os.access(path, os.W_OK):
            raise PermissionError(f"cannot write into {path}")
    except OSError as e:
        raise ConfigError(f"--nvme-path {path}: {e}; give a writable folder on a fast local disk") from None


def deepspeed_arch_list(arch_list: str) -> str:
    """TORCH_CUDA_ARCH_LIST as DeepSpeed 0.19's JIT builder can read it: it parses each entry as digits
    (int("0a") raises), so the architecture-specific suffixes of Hopper and Blackwell ("9.0a", "10.0f")
    are dropped: the op then builds for the plain architecture, which runs on those chips."""
    return re.sub(r"(\d+\.\d+)[a-z]+", r"\1", arch_list)


def cuda_toolkit_problem(cuda_home: str | None) -> str | None:
    """On a GPU, DeepSpeed compiles its async I/O op against the CUDA toolkit (its headers and libcudart);
    pip's torch wheels bring the runtime but not the toolkit. Returns what is missing, or None."""
    if cuda_home and (Path(cuda_home) / "include" / "cuda_runtime.h").exists():
        return None
    found = f"CUDA_HOME is {cuda_home}, which has no include/cuda_runtime.h" if cuda_home else "no CUDA_HOME or nvcc found"
    return (f"--nvme-path on a GPU: DeepSpeed compiles its async I/O op against the CUDA toolkit and {found}. Install "
            f"the toolkit for torch's CUDA {torch.version.cuda} (e.g. apt install cuda-toolkit, or conda install -c "
            "nvidia cuda-toolkit) and set CUDA_HOME to it; or offload to CPU memory (no --nvme-path)")


def cpu_deepspeed_strategy(config: dict):
    """Fabric's DeepSpeedStrategy accepts only CUDA; DeepSpeed itself runs ZeRO on the CPU (its CPU
    accelerator, gloo). This subclass lifts only the CUDA checks, through Fabric's extension points."""
    deepspeed_on_cpu()  # before deepspeed's first import, here and in the workers
    from lightning.fabric.strategies import DDPStrategy, DeepSpeedStrategy
    from lightning.fabric.utilities.seed import reset_seed

    class CPUDeepSpeedStrategy(DeepSpeedStrategy):
        def setup_environment(self) -> None:
            if self.global_rank == 0:
                print("note: DeepSpeed on CPU (gloo) is for learning and verification; its speed says nothing "
                      "about GPUs", flush=True)
            DDPStrategy.setup_environment(self)  # what the parent does after its CUDA-only check

        def _setup_distributed(self) -> None:  # the parent's, less the GPU-index check CPU devices cannot pass
            reset_seed()
            self._set_world_ranks()
            # every rank printed that DeepSpeed's shared-memory op was "built successfully" (make setup built it;
            # the rank only loaded it): that line goes, anything else DeepSpeed said stays, also when it fails
            said = io.StringIO()
            try:
                with redirect_stdout(said):
                    self._init_deepspeed_distributed()
            finally:
                print("".join(l for l in said.getvalue().splitlines(True) if "built successfully" not in l), end="")
            if not self._config_initialized:
                self._format_config()
                self._config_initialized = True

        def _initialize_engine(self, model, optimizer=None, scheduler=None):
            import deepspeed  # a CPU device has no index: DeepSpeed's device_rank is the local rank

            engine, ds_optimizer, _, ds_scheduler = deepspeed.initialize(
                args=argparse.Namespace(device_rank=self.local_rank), config=self.config, model=model,
                model_parameters=[p for p in model.parameters() if p.requires_grad], optimizer=optimizer,
                lr_scheduler=scheduler, dist_init_required=False)
            return engine, ds_optimizer, ds_scheduler

    return CPUDeepSpeedStrategy(config=config)


# ----------------------------------------------------------------------------- the Fabric strategy
def make_strategy(cfg, on_gpu: bool):
    """The object (or name) handed to Fabric(strategy=...)."""
    L = cfg.layout
    if L.deepspeed:
        from lightning.fabric.strategies import DeepSpeedStrategy

        ask_cpuinfo_once()  # before DeepSpeed's first op load
        # DeepSpeed 0.19 calls torch.distributed's collectives by their deprecated names, which the user cannot change;
        # under ZeRO-3 the warnings came back at every step (130 of them in a 32-step 2-process run)
        warnings.filterwarnings("ignore", category=FutureWarning, message=r"`torch\.distributed\.(all_gather_into_tensor|"
                                r"reduce_scatter_tensor)` is deprecated")
        if L.offload and not on_gpu:
            build_offload_ops()  # before the ranks start, where `make setup` left it out
        strategy = DeepSpeedStrategy(config=deepspeed_config(cfg)) if on_gpu else cpu_deepspeed_strategy(deepspeed_config(cfg))
        # where zero.Init puts each partition as the model is built: straight to its offload target
        strategy.remote_device = "nvme" if cfg.nvme_path else None  # None: the device (on a CPU: host memory)
        return strategy
    if L.model_parallel:
        from lightning.fabric.strategies import ModelParallelStrategy

        # Mesh dimensions: (data_parallel, tensor_parallel); pp uses the second one for its stages.
        return ModelParallelStrategy(parallelize_fn=functools.partial(parallelize, cfg=cfg),
                                     data_parallel_size=L.dp_size, tensor_parallel_size=L.inner_mesh_size())
    return cfg.strategy


def parallelize(model: nn.Module, device_mesh, cfg) -> nn.Module:
    """ModelParallelStrategy's hook: turn the whole model into what this rank holds, on this rank's device.
    Fabric moves nothing here (its module_to_device is a no-op for this strategy): FSDP2 moves what it
    shards, but under plain tp distribute_tensor moves only the split linears, and a pipeline stage
    built by hand is not moved at all, so both are moved here."""
    device, L = mesh_device(device_mesh), cfg.layout
    if L.tensor_parallel and not L.fsdp:
        model.to(device)  # embeddings, LayerNorms, LM head: replicated, so each rank needs them on its device
    if L.tensor_parallel:
        apply_tensor_parallel(model, device_mesh["tensor_parallel"], cfg.n_head)
    if L.fsdp:
        apply_fsdp(model, device_mesh["data_parallel"], gather_bf16=fsdp_gathers_bf16(cfg))
    if L.pipeline:  # only this stage's blocks travel to the device, never the whole model
        model = pipeline_stage_module(model, device_mesh["tensor_parallel"].get_local_rank(), L.pp_size).to(device)
    return model


def mesh_device(device_mesh) -> torch.device:
    """This rank's device: Fabric has set the current CUDA device before calling parallelize."""
    if device_mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(device_mesh.device_type)


class PlacementError(RuntimeError):
    """A strategy left part of the model off the rank's device: a bug of its builder, caught before the
    first forward would fail deep inside with a device mismatch."""


def check_placement(module: nn.Module, device: torch.device) -> None:
    """Every parameter and buffer this rank holds lives on `device` (DTensors: their local shard)."""
    def elsewhere(t: torch.Tensor) -> bool:
        return t.device.type != device.type or (device.index is not None and t.device.index not in (None, device.index))

    wrong = [(name, t.device) for name, t in [*module.named_parameters(), *module.named_buffers()] if elsewhere(t)]
    if wrong:
        listing = ", ".join(f"{name} on {where}" for name, where in wrong[:4]) + (", ..." if len(wrong) > 4 else "")
        raise PlacementError(f"after set-up {len(wrong)} parameter(s)/buffer(s) are not on {device}: {listing}. The "
                             f"strategy did not move them; this is a bug in strategies.py, not in the flags")


# ----------------------------------------------------------------------------- FSDP2
def apply_fsdp(model: nn.Module, dp_mesh, gather_bf16: bool = False) -> None:
    """One FSDP unit per transformer block, then the root (embeddings, final norm, tied LM head): each
    block's parameters are gathered just before it runs and freed after, as the memory plan counts.
    Under bf16-mixed the blocks are gathered in bf16, what autocast casts their matmuls' weights to anyway: half the
    bytes, and no bf16 copy of every block's weights kept for backward. Their gradients are reduced and accumulated
    in float32; inside a block the residual stream is bf16 (FSDP casts a block's input; the CPU's LayerNorm takes no
    float32 input with bf16 weights), as in torchtitan's recipe. The root stays float32 (embeddings, ln_f, the head)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if gather_bf16 \
        else MixedPrecisionPolicy()
    for block in model.transformer.h:
        fully_shard(block, mesh=dp_mesh, mp_policy=policy)
    fully_shard(model, mesh=dp_mesh)


# ----------------------------------------------------------------------------- tensor parallel
def conv1d_to_linear(conv) -> nn.Linear:
    """HF GPT-2's Conv1D holds its weight as [in, out] and computes x @ W + b; nn.Linear holds [out, in].
    The same numbers, transposed, so PyTorch's ColwiseParallel/RowwiseParallel apply unchanged."""
    biased = conv.bias is not None  # --no-bias: none
    linear = nn.Linear(conv.weight.shape[0], conv.weight.shape[1], bias=biased, device=conv.weight.device,
                       dtype=conv.weight.dtype)
    with torch.no_grad():
        linear.weight.copy_(conv.weight.t())
        if biased:
            linear.bias.copy_(conv.bias)
    return linear


def qkv_rows_by_rank(n_embd: int, n_head: int, tp: int) -> torch.Tensor:
    """Row order of the fused q,k,v weight ([3h, h] as nn.Linear) that puts each rank's whole heads of q, k
    and v next to each other, so an even column split gives rank r the q, k and v of heads
    r*n/t ... (r+1)*n/t. (Splitting the fused weight as it is would hand rank 0 all of q and part of k.)"""
    local = n_embd // tp  # whole heads, since tp divides n_head
    rows = [part * n_embd + r * local + torch.arange(local) for r in range(tp) for part in range(3)]
    return torch.cat(rows)


def apply_tensor_parallel(model: nn.Module, tp_mesh, n_head: int) -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tp = tp_mesh.size()
    for block in model.transformer.h:
        attn, mlp = block.attn, block.mlp
        n_embd = attn.embed_dim
        attn.c_attn = conv1d_to_linear(attn.c_attn)
        order = qkv_rows_by_rank(n_embd, n_head, tp)
        with torch.no_grad():
            attn.c_attn.weight.copy_(attn.c_attn.weight[order])
            if attn.c_attn.bias is not None:
                attn.c_attn.bias.copy_(attn.c_attn.bias[order])
        attn.c_proj, mlp.c_fc, mlp.c_proj = (conv1d_to_linear(m) for m in (attn.c_proj, mlp.c_fc, mlp.c_proj))
        # Each rank now computes n_head / tp heads: HF's attention splits c_attn's output by split_size.
        attn.split_size, attn.num_heads, attn.embed_dim = n_embd // tp, n_head // tp, n_embd // tp
        parallelize_module(block, tp_mesh, {"attn.c_attn": ColwiseParallel(), "attn.c_proj": RowwiseParallel(),
                                            "mlp.c_fc": ColwiseParallel(), "mlp.c_proj": RowwiseParallel()})


def undo_tensor_parallel(state_dict: dict, n_layer: int, n_embd: int, n_head: int, tp: int) -> dict:
    """A gathered TP state dict (Linear layout, heads grouped by rank) back to HF's Conv1D layout."""
    inverse = torch.argsort(qkv_rows_by_rank(n_embd, n_head, tp))
    out = dict(state_dict)
    for i in range(n_layer):
        for name in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"):
            w, b = f"transformer.h.{i}.{name}.weight", f"transformer.h.{i}.{name}.bias"
            if w not in out:
                continue
            if name == "attn.c_attn":
                out[w] = out[w][inverse]
                if b in out:  # --no-bias: none
                    out[b] = out[b][inverse]
            out[w] = out[w].t().contiguous()
    return out


# ----------------------------------------------------------------------------- pipeline parallel
def stage_blocks(n_layer: int, pp: int, stage: int) -> range:
    """Contiguous blocks of one stage; the first stages take one more when the layers do not divide."""
    per, extra = divmod(n_layer, pp)
    start = stage * per + min(stage, extra)
    return range(start, start + per + (1 if stage < extra else 0))


class GPT2Stage(nn.Module):
    """One pipeline stage of GPT2LMHeadModel: the embeddings on the first, contiguous blocks, the final
    norm and LM head on the last. Parameter names are the whole model's (transformer.h.7.attn...), so
    the stages' checkpoints together are one ordinary GPT-2 state dict."""

    def __init__(self, model: nn.Module, blocks: range, first: bool, last: bool):
        super().__init__()
        t = model.transformer
        self.first, self.last = first, last
        self.transformer = nn.Module()
        if first:
            self.transformer.wte, self.transformer.wpe, self.transformer.drop = t.wte, t.wpe, t.drop
        self.transformer.h = nn.ModuleDict({str(i): t.h[i] for i in blocks})
        if last:
            self.transformer.ln_f, self.lm_head = t.ln_f, model.lm_head
            if not first:  # the tied embedding lives on two stages: its own copy here, gradients summed
                self.lm_head.weight = nn.Parameter(t.wte.weight.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            positions = torch.arange(x.shape[1], device=x.device)
            x = self.transformer.drop(self.transformer.wte(x) + self.transformer.wpe(positions))
        for block in self.transformer.h.values():
            x = block(x)  # no mask: HF's SDPA attention is causal when none is given
        if self.last:
            x = self.lm_head(self.transformer.ln_f(x))
        return x


def pipeline_stage_module(model: nn.Module, stage: int, pp: int) -> GPT2Stage:
    n_layer = len(model.transformer.h)
    return GPT2Stage(model, stage_blocks(n_layer, pp, stage), first=stage == 0, last=stage == pp - 1)


def causal_lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The loss GPT2LMHeadModel computes (gpt_model.window_loss): the last stage's logits of a window's first
    seq_len - 1 tokens against the tokens after each (through_stages feeds them so)."""
    return nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def make_pipeline_schedule(stage_module, fabric, mesh, schedule: str, n_micro: int):
    """A torch.distributed.pipelining schedule over the stage group; the loss is the mean over the
    micro-batches (scale_grads), as with gradient accumulation elsewhere."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    pp_mesh = mesh["tensor_parallel"]
    stage = PipelineStage(stage_module, pp_mesh.get_local_rank(), pp_mesh.size(), fabric.device, group=pp_mesh.get_group())
    cls = Schedule1F1B if schedule == "1f1b" else ScheduleGPipe
    return cls(stage, n_microbatches=n_micro, loss_fn=causal_lm_loss, scale_grads=True)


def sync_tied_embedding(module, mesh) -> None:
    """The first and last stage each hold the tied wte/lm_head weight: sum their gradients so both
    copies take the same update, as the single tied parameter would."""
    pp_mesh = mesh["tensor_parallel"]
    if pp_mesh.size() == 1:
        return
    import torch.distributed as dist

    # new_group is collective: every rank creates every pipeline's group, in one order, and uses its own
    pipelines = tuple(tuple(row) for row in mesh.mesh.tolist())  # rows: data-parallel replicas of the pipeline
    group = tied_groups(pipelines)[mesh["data_parallel"].get_local_rank()]
    if module.first:
        dist.all_reduce(module.transformer.wte.weight.grad, group=group)
    elif module.last:
        dist.all_reduce(module.lm_head.weight.grad, group=group)


@functools.cache
def tied_groups(pipelines: tuple) -> list:
    """One group per pipeline: its first and last stage."""
    import torch.distributed as dist

    return [dist.new_group([ranks[0], ranks[-1]]) for ranks in pipelines]


# ----------------------------------------------------------------------------- gradients, any strategy
def local_module(model, cfg) -> nn.Module:
    """What this rank runs: the pipeline stage under pp (Fabric's wrapper keeps the whole model as
    `.module`), the model itself (sharded in place by FSDP2/TP) otherwise."""
    return model._forward_module if cfg.layout.pipeline else getattr(model, "module", model)


def grad_norm(model, cfg, fabric) -> torch.Tensor:
    """The global L2 norm of the gradient, the same quantity for every strategy: sharded gradients are
    combined across ranks, tied and replicated ones counted once. A 0-dim tensor on the device, not read here:
    the training loop reads it at log points only (each read waits for the device)."""
    L = cfg.layout
    if L.deepspeed:
        norm = model._forward_module.get_global_grad_norm() if hasattr(model, "_forward_module") else None
        return torch.as_tensor(norm if norm is not None else float("nan"))  # the engine's, as it holds it
    module = local_module(model, cfg)
    grads = [(name, p.grad) for name, p in module.named_parameters() if p.grad is not None]
    if L.pipeline and not module.first:  # the tied embedding's copy: counted on the first stage
        grads = [(name, g) for name, g in grads if name != "lm_head.weight"]
    square = sharded_square_sum([g for _, g in grads], fabric.device)
    if L.pipeline and fabric.world_size > 1:
        import torch.distributed as dist

        # stages hold disjoint parameters; data-parallel replicas hold the same, so divide them out
        dist.all_reduce(square)
        square /= L.dp_size
    return square.sqrt()


def sharded_square_sum(grads: list, device: torch.device) -> torch.Tensor:
    """The sum of squares of all gradients, float64 on the device, whole over the mesh. Each DTensor's local shard
    is squared here and the partial sums are added across the mesh dimensions it is sharded over: one all-reduce
    per dimension for all parameters together (a full_tensor() per parameter was one each, 964 for 80 layers).
    Replicated dimensions are not summed (every rank holds the same values)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    partial: dict[tuple, torch.Tensor] = {}  # mesh dimensions to sum over -> this rank's sum of squares
    groups: dict[str, object] = {}
    for g in grads:
        if isinstance(g, DTensor) and any(p.is_partial() for p in g.placements):  # not a shard: reduce it whole
            g = g.full_tensor()
        if isinstance(g, DTensor):
            mesh = g.device_mesh
            names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
            # not replicated means split: Shard, and FSDP2's _StridedShard over a tensor-parallel split (not a Shard)
            sharded = [i for i, p in enumerate(g.placements) if not p.is_replicate()]
            dims = tuple(sorted(names[i] for i in sharded))
            groups.update({names[i]: mesh.get_group(i) for i in sharded})
            g = g.to_local()
        else:
            dims = ()
        # in float32 without a float32 copy of a 16-bit gradient, as torch's clip_grad_norm_
        n = torch.linalg.vector_norm(g, dtype=torch.float32).double() ** 2
        partial[dims] = partial[dims] + n if dims in partial else n
    # Dimension by dimension in name order (the same on every rank): the sums still to be added over it, in one
    # call; afterwards sums left with the same remaining dimensions are one number
    for name in sorted(groups):
        keys = sorted(k for k in partial if k[:1] == (name,))
        summed = torch.stack([partial.pop(k) for k in keys])
        if groups[name].size() > 1:
            dist.all_reduce(summed, group=groups[name])
        for k, value in zip(keys, summed.unbind()):
            partial[k[1:]] = partial[k[1:]] + value if k[1:] in partial else value
    return sum(partial.values(), torch.zeros((), dtype=torch.float64, device=device))


def clip_grad_norm(model, cfg, fabric, max_norm: float) -> torch.Tensor:
    """Clip to max_norm by the global norm above (torch's clip_grad_norm_ cannot mix DTensor and plain
    gradients, nor see the other pipeline stages). As torch's, without reading the norm on the host: every
    gradient is multiplied by min(1, max_norm / norm), exactly 1.0 when the norm is within bounds."""
    norm = grad_norm(model, cfg, fabric)
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for p in local_module(model, cfg).parameters():
        if p.grad is not None:
            p.grad.mul_(scale.to(p.grad.dtype))  # a 0-dim tensor: DTensor gradients take it as a replicated scalar
    return norm


def all_reduce_pipeline_grads(module, mesh) -> None:
    """Data parallel across pipelines: average each stage's gradients over its replicas."""
    dp_mesh = mesh["data_parallel"]
    if dp_mesh.size() == 1:
        return
    import torch.distributed as dist

    for p in module.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, op=dist.ReduceOp.AVG, group=dp_mesh.get_group())


# ----------------------------------------------------------------------------- one ordinary state dict
def export_state_dict(fabric, model, cfg) -> dict | None:
    """The full model as GPT2LMHeadModel.state_dict() keys and layout, on rank 0 (None elsewhere)."""
    import torch.distributed as dist

    L = cfg.layout
    if L.deepspeed:
        engine = model._forward_module if hasattr(model, "_forward_module") else model
        if L.zero_stage == 3:
            import deepspeed

            params = list(engine.module.parameters())
            with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
                sd = {k: v.detach().float().cpu().clone() for k, v in engine.module.state_dict().items()}
        else:
            sd = {k: v.detach().float().cpu().clone() for k, v in engine.module.state_dict().items()}
        return sd if fabric.global_rank == 0 else None
    module = local_module(model, cfg)
    if L.fsdp or L.tensor_parallel:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        sd = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if fabric.global_rank != 0:
            return None
        sd = {k: v.float() for k, v in sd.items()}
        return undo_tensor_parallel(sd, cfg.n_layer, cfg.n_embd, cfg.n_head, L.tp_size) if L.tp_size > 1 else sd
    if L.pipeline:
        local = {k: v.detach().float().cpu() for k, v in module.state_dict().items()}
        parts = [None] * fabric.world_size if fabric.global_rank == 0 else None
        # through gloo on the CPU: over NCCL, gather_object stages every stage's pickled fp32 weights in
        # rank 0's GPU memory (GBs for the 1.6B model); new_group is collective, so every rank makes it
        dist.gather_object(local, parts, dst=0, group=dist.new_group(backend="gloo"))
        if fabric.global_rank != 0:
            return None
        sd = {}
        for part in parts:
            sd.update(part)
        return sd
    return {k: v.detach().float().cpu() for k, v in module.state_dict().items()} if fabric.global_rank == 0 else None


def export_checkpoint(folder) -> dict:
    """A checkpoint folder of any strategy (runs/R/checkpoints/step-N) as one ordinary GPT-2 state dict,
    in one process: DeepSpeed's zero_to_fp32 for ZeRO, DCP's reader for FSDP2/TP/PP, then TP undone."""
    import json

    folder = Path(folder)
    cfg = saved_config(json.loads((folder / "config.json").read_text()))
    L, state = cfg.layout, folder / "state"
    if L.deepspeed:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        sd = get_fp32_state_dict_from_zero_checkpoint(str(state))
    elif state.is_dir() and list(state.glob("rank-*.pt")):  # pipeline stages: one file per rank
        sd = {}
        for part in sorted(state.glob("rank-*.pt")):
            sd.update(torch.load(part, map_location="cpu", weights_only=False)["model"])
    elif state.is_dir():  # a distributed checkpoint (DCP) of ModelParallelStrategy
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

        keys = {k for k in FileSystemReader(str(state)).read_metadata().state_dict_metadata if k.startswith("model.")}
        with warnings.catch_warnings():  # one process reading every shard is the point here, not a mistake
            warnings.filterwarnings("ignore", message="torch.distributed is unavailable or uninitialized")
            sd = _load_state_dict_from_keys(keys, checkpoint_id=str(state))["model"]  # nested back under "model"
    else:
        sd = torch.load(state, map_location="cpu", weights_only=False)["model"]
    sd = {k: v.float() for k, v in sd.items() if isinstance(v, torch.Tensor)}
    if L.tensor_parallel:
        sd = undo_tensor_parallel(sd, cfg.n_layer, cfg.n_embd, cfg.n_head, L.tp_size)
    return sd
