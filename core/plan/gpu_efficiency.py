"""A GPU's time for what a step computes, not its peak times a constant: every kernel of one transformer block, of
the head and of the optimizer at the run's shapes, each priced as a roofline (its FLOPs at the device's matmul rate,
or its bytes at its memory bandwidth, whichever is longer) plus a fixed cost per kernel; and the host's time to issue
them, which an eager PyTorch step at a small micro-batch waits on. perf_model.time_plan takes the longer of the two.

What runs depends on the framework, an input of every plan (FRAMEWORKS): this repository's eager step runs HF
transformers' GPT2Block under autocast, whose operations are counted, not guessed (eager_passes: the block's forward
and backward dispatched on fake tensors at the run's shape, each aten op a kernel and a host dispatch); fused
frameworks (Megatron-LM, llm.c, llm-foundry, this repository under --compile) run the block as the kernels listed in
fused_block.

Per device (CALIBRATION.devices) two numbers are calibrated, each from named published runs (published_runs.json, role
"calibration"; `python -m lab.plan_check --calibrate` solves them, tests/test_plan.py checks that these constants
are that solution): the share of the dense peak a large matmul reaches, and the same for flash attention's FLOPs. One number
is calibrated for all devices from the lab's own H200 run: the host's cost of one eager PyTorch operation. The rest
are stated assumptions (KERNEL_S, MEMORY_EFFICIENCY) and datasheet figures (memory bandwidth)."""

import functools
from dataclasses import dataclass, replace

import torch

from core.gpt.gpt_model import positions


@dataclass(frozen=True)
class Kernel:
    """One launched kernel: "gemm" (a matrix product), "attention" (SDPA/flash) or "memory" (everything else, whose
    time is its bytes); attention carries its head dimension, which flash pads to the next tile width."""
    kind: str
    flops: float = 0.0
    bytes: float = 0.0
    head_dim: int = 0


@dataclass(frozen=True)
class Device:
    """A GPU's kernel rates. gemm and attention: the share of the dense peak (the cluster's) that a large matmul and
    flash attention reach, calibrated; memory_bw: the datasheet's HBM bandwidth in bytes/s."""
    name: str
    memory_bw: float
    gemm: float
    attention: float
    calibrated_from: str = ""


@dataclass(frozen=True)
class Framework:
    """What a step's code launches. block: "counted" (HF GPT2Block under autocast, its ops counted) or "fused" (the
    kernels of fused_block); attention: "flash" (SDPA/FlashAttention, scores never stored) or "unfused" (the scores
    materialised, a fused softmax: Megatron-LM 2021); host: "python" (every kernel one or more ops through PyTorch's
    dispatcher at HOST_OP_S) or "native" (a C++/CUDA launch at KERNEL_S); splits_head: tensor parallel splits the
    vocabulary (Megatron), else the head is whole on every tensor-parallel rank (this repository)."""
    name: str
    block: str
    attention: str
    host: str
    splits_head: bool
    about: str


FRAMEWORKS = {f.name: f for f in (
    Framework("eager", "counted", "flash", "python", False,
              "this repository without --compile: HF transformers' GPT2 under autocast, one kernel per aten op"),
    Framework("compiled", "fused", "flash", "python", False,
              "this repository with --compile: inductor fuses the elementwise work (never timed on a GPU here)"),
    Framework("fused", "fused", "flash", "python", True,
              "PyTorch with fused elementwise kernels and flash attention (llm-foundry/MPT, Megatron-LM today)"),
    Framework("megatron-2021", "fused", "unfused", "python", True,
              "Megatron-LM as in Narayanan et al. 2021: fused kernels, attention scores materialised"),
    Framework("native", "fused", "flash", "native", True,
              "C/CUDA without a framework (llm.c): fused kernels, cuDNN flash attention, no Python per kernel"),
)}

# Assumed, not calibrated: the fixed cost of one kernel on the device (launch, ramp-up and tail of a kernel queued
# behind another), and the share of the datasheet bandwidth an elementwise kernel streams at
KERNEL_S = 3e-6
MEMORY_EFFICIENCY = 0.8


@dataclass(frozen=True)
class Calibration:
    """The calibrated numbers: per device its matmul and attention shares, and the host's cost of one eager op."""
    host_op_s: float
    devices: dict


def devices(a100: tuple[float, float], h100: tuple[float, float]) -> dict:
    """Each GPU preset's kernel rates: HBM from the datasheets (A100 80GB SXM 2,039 GB/s, H100 SXM 3.35 TB/s, H200
    4.8 TB/s, H100 PCIe 2.0 TB/s); the H200 and the H100 PCIe have the H100's tensor cores, so its calibration."""
    a, h = Device("a100", 2.039e12, *a100, calibrated_from="a100"), Device("h100", 3.35e12, *h100, calibrated_from="h100")
    return {"a100": a, "h100": h, "h200": replace(h, name="h200", memory_bw=4.8e12),
            "h100-pcie": replace(h, name="h100-pcie", memory_bw=2.0e12)}


# Solved by `python -m lab.plan_check --calibrate` from the rows of published_runs.json whose role is
# "calibration" (tests/test_plan.py checks each group's error is zero with these): matmul and attention shares from
# llm-foundry's MPT-1b and MPT-13b at sequence 2048 and MPT-1b at 32,768 on 8 GPUs of each kind; the host's cost of
# one eager op (Python, autograd and autocast included) from this lab's 1.6B on one H200 at micro-batch 1
CALIBRATION = Calibration(host_op_s=17.86e-6, devices=devices(a100=(0.643, 0.310), h100=(0.467, 0.178)))

# FlashAttention's kernels are compiled for head dimensions in steps of 32 up to 256: a head of 50 runs 64-wide tiles
FLASH_HEAD_DIMS = (32, 64, 96, 128, 160, 192, 224, 256)


# ----------------------------------------------------------------------------- pricing
def kernel_seconds(k: Kernel, device: Device, peak: float) -> float:
    """A roofline with a fixed cost: a matmul's FLOPs at the device's matmul share of the peak, flash attention's
    at its share times its tiles' useful width, or its bytes at the streaming bandwidth, whichever is longer."""
    memory = k.bytes / (device.memory_bw * MEMORY_EFFICIENCY)
    if k.kind == "gemm":
        return max(k.flops / (peak * device.gemm), memory) + KERNEL_S
    if k.kind == "attention":
        padded = next((d for d in FLASH_HEAD_DIMS if d >= k.head_dim), k.head_dim)
        return max(k.flops / (peak * device.attention * k.head_dim / padded), memory) + KERNEL_S
    return memory + KERNEL_S


@dataclass(frozen=True)
class Work:
    """Kernels of one pass and the operations the host dispatches to launch them."""
    kernels: tuple
    host_ops: int

    def seconds(self, device: Device, peak: float) -> float:
        return sum(kernel_seconds(k, device, peak) for k in self.kernels)

    def scaled(self, tp: int) -> "Work":
        """A tensor-parallel rank's share of a counted pass: its matmuls and attention split t ways, the elementwise
        work (LayerNorms and the residual stream, replicated under tensor parallel) kept whole."""
        if tp == 1:
            return self
        split = tuple(replace(k, flops=k.flops / tp, bytes=k.bytes / tp) if k.kind != "memory" else k
                      for k in self.kernels)
        return Work(split, self.host_ops)


# ----------------------------------------------------------------------------- fused frameworks: the kernels listed
def gemm(m: float, n: float, k: float, word: int) -> Kernel:
    return Kernel("gemm", 2 * m * n * k, word * (m * k + k * n + m * n))


def memory(elements: float, word: int) -> Kernel:
    return Kernel("memory", bytes=elements * word)


def fused_block(h: int, heads: int, s: int, b: int, tp: int, attention: str, word: int = 2) -> tuple[Work, Work]:
    """(forward, backward) of one block of a fused framework on a tensor-parallel rank (Megatron's split, no sequence
    parallel): LayerNorm, the q,k,v matmul, attention, the projection, bias+dropout+residual, LayerNorm, fc with its
    bias and GELU fused, the second MLP matmul, bias+residual. Backward: each matmul's input and weight gradients,
    attention's backward, and the elementwise kernels reading the forward's saved inputs and the incoming gradient."""
    n, d = b * s, h // heads
    forward = [memory(2 * n * h, word), gemm(n, 3 * h / tp, h, word), *attention_kernels(n, s, h, d, tp, attention,
                                                                                            word, backward=False),
               gemm(n, h, h / tp, word), memory(3 * n * h, word), memory(2 * n * h, word), gemm(n, 4 * h / tp, h, word),
               memory(8 * n * h / tp, word), gemm(n, h, 4 * h / tp, word), memory(3 * n * h, word)]
    backward = [*(g for f in forward if f.kind == "gemm" for g in (f, f)),  # input and weight gradients
                *attention_kernels(n, s, h, d, tp, attention, word, backward=True),
                memory(3 * n * h, word), memory(3 * n * h, word),  # the two LayerNorms' backward
                memory(12 * n * h / tp, word),  # GELU's backward with the fc bias gradient
                memory(3 * n * h, word), memory(3 * n * h, word),  # residual gradients, dropout masks
                memory(9 * n * h / tp, word)]  # the other bias gradients (reductions over the tokens)
    return Work(tuple(forward), len(forward)), Work(tuple(backward), len(backward))


def attention_kernels(n: int, s: int, h: int, d: int, tp: int, kind: str, word: int, backward: bool) -> list[Kernel]:
    """Causal attention over n tokens in sequences of s. Flash: one kernel, half the score blocks skipped by the mask,
    its backward recomputing the scores (5 products against forward's 2). Unfused: the two batched products at full
    size and the s x s scores written, softmaxed and read (about 30 bytes an element forward and backward together,
    2-byte words: scores, softmax, dropout and its mask, and their gradients)."""
    products = 4 * n * s * h / tp  # QK^T and PV, forward, as the model FLOPs count them
    if kind == "flash":
        return [Kernel("attention", products / 2 * (2.5 if backward else 1), 4 * n * h / tp * word, d)]
    scores = n * s * (h // d) / tp  # elements of the scores of every head on this rank
    part = 2 if backward else 1
    return [Kernel("gemm", products / 2 * part, 0), Kernel("gemm", products / 2 * part, 0),
            memory(scores * (20 if backward else 10) / word, word)]


def fused_head(h: int, vocab: int, s: int, b: int, tp: int, word: int = 2) -> tuple[Work, Work]:
    """The embeddings' lookup, the final LayerNorm, the logits' matmul and a fused cross-entropy (logits written,
    read once for the loss and its gradient); backward: the two matmul gradients and the embeddings' scatter."""
    n = b * s
    forward = [memory(3 * n * h, word), memory(2 * n * h, word), gemm(n, vocab / tp, h, word),
               memory(3 * n * vocab / tp, word)]
    backward = [gemm(n, vocab / tp, h, word), gemm(n, vocab / tp, h, word), memory(3 * n * h, word),
                memory(2 * n * h, 4)]
    return Work(tuple(forward), len(forward)), Work(tuple(backward), len(backward))


# ----------------------------------------------------------------------------- this repository's eager step: counted
GEMMS = {"mm", "addmm", "bmm", "baddbmm"}
NO_KERNEL = {"detach", "view", "t", "transpose", "expand", "split", "_unsafe_view", "alias", "as_strided", "slice",
             "select", "unsqueeze", "squeeze", "permute", "split_with_sizes", "unbind", "empty", "empty_like"}
NOT_DISPATCHED_IN_A_RUN = {"device"}  # fake tensors' own queries


def counted_kernel(func, args, kwargs, out) -> Kernel | None:
    """The kernel one dispatched aten op launches (None: a view or an allocation, which launch none)."""
    name = func.overloadpacket.__name__
    if name in NO_KERNEL or func.is_view:
        return None
    tensors = [t for t in torch.utils._pytree.tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    if name in GEMMS:
        a, b = (args[1], args[2]) if name in ("addmm", "baddbmm") else (args[0], args[1])
        return Kernel("gemm", 2 * a.numel() * b.shape[-1], nbytes)
    if "scaled_dot_product" in name:
        q = args[0]  # [batch, heads, s, d]; the run's windows are causal
        products = 4 * q.shape[0] * q.shape[1] * q.shape[2] ** 2 * q.shape[3]
        return Kernel("attention", products / 2 * (2.5 if "backward" in name else 1), nbytes, q.shape[3])
    return Kernel("memory", bytes=nbytes)


def count(fn) -> Work:
    """Run fn under a dispatch mode that records each aten op: the kernels it launches and every op dispatched."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counter(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.kernels, self.ops = [], 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.overloadpacket.__name__ not in NOT_DISPATCHED_IN_A_RUN:
                self.ops += 1
                k = counted_kernel(func, args, kwargs or {}, out)
                if k is not None:
                    self.kernels.append(k)
            return out

    counter = Counter()
    with counter:
        fn()
    return Work(tuple(counter.kernels), counter.ops)


@functools.lru_cache(maxsize=64)
def eager_passes(h: int, heads: int, s: int, vocab: int, b: int, precision: str, deepspeed: bool) -> dict:
    """{block_forward, block_backward, head_forward, head_backward}: HF's GPT2Block, and the embeddings, final
    LayerNorm, tied head and float32 cross-entropy (as device_probe times them), forward and backward under the run's
    autocast, dispatched on fake tensors at this shape (no memory, about 0.1 s). CPU autocast stands in for CUDA's:
    the same casts of the same weights."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    from core.gpt.gpt_model import compute_dtype

    weights, autocast = compute_dtype(precision, deepspeed)
    config = GPT2Config(n_embd=h, n_head=heads, n_layer=1, n_positions=s, vocab_size=vocab,
                        activation_function="gelu_pytorch_tanh", resid_pdrop=0, embd_pdrop=0, attn_pdrop=0,
                        use_cache=False, attn_implementation="sdpa")
    with torch.device("meta"):
        config = GPT2LMHeadModel(config).config
    config._attn_implementation = "sdpa"  # a block alone gets no mask: causal SDPA, as the run's SDPA_CAUSAL
    cast = torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None)
    out: dict = {}
    default = torch.get_default_dtype()
    with FakeTensorMode():
        torch.set_default_dtype(weights)  # built in the weights' dtype (fake parameters cannot be converted)
        try:
            block, ln_f = GPT2Block(config), torch.nn.LayerNorm(h)
            wte, wpe = torch.nn.Embedding(vocab, h), torch.nn.Embedding(s, h)
        finally:
            torch.set_default_dtype(default)
        x = torch.randn(b, s, h, dtype=weights, requires_grad=True)
        idx, y = torch.randint(0, vocab, (b, s)), torch.randint(0, vocab, (b * s,))
        result = {}

        def block_forward():
            with cast:
                o = block(x)
                result["y"] = (o[0] if isinstance(o, tuple) else o).float().sum()

        def head_forward():
            with cast:
                e = wte(idx) + wpe(torch.arange(s))
                logits = torch.nn.functional.linear(ln_f(x), wte.weight)
                result["y"] = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y) + e.float().sum()

        for name, forward in (("block", block_forward), ("head", head_forward)):
            out[f"{name}_forward"] = count(forward)
            out[f"{name}_backward"] = count(lambda: result["y"].backward())
    return out


def eager_work(h: int, heads: int, s: int, vocab: int, b: int, precision: str, deepspeed: bool) -> dict:
    """eager_passes at micro-batch b, counted at 1 and 2 and extended linearly (every op's size grows with b, the
    weights' casts do not), so that a search over micro-batches counts each shape twice, not once per size."""
    one, two = (eager_passes(h, heads, s, vocab, k, precision, deepspeed) for k in (1, 2))
    if b <= 2:
        return eager_passes(h, heads, s, vocab, b, precision, deepspeed)
    out = {}
    for key, w1 in one.items():
        w2 = two[key]
        if len(w1.kernels) != len(w2.kernels):  # a size-dependent path: count this size itself
            return eager_passes(h, heads, s, vocab, b, precision, deepspeed)
        out[key] = Work(tuple(replace(k1, flops=k1.flops + (b - 1) * (k2.flops - k1.flops),
                                      bytes=k1.bytes + (b - 1) * (k2.bytes - k1.bytes))
                              for k1, k2 in zip(w1.kernels, w2.kernels)), w1.host_ops)
    return out


# ----------------------------------------------------------------------------- a step
def host_seconds(work: Work, framework: Framework, host_op_s: float) -> float:
    return work.host_ops * (host_op_s if framework.host == "python" else KERNEL_S)


def passes(cfg, framework: Framework, vocab: int) -> dict:
    """One block's and the head's forward and backward on one rank at cfg's micro-batch."""
    t = cfg.layout.tp_size
    if framework.block == "counted":
        deepspeed = cfg.layout.deepspeed
        work = eager_work(cfg.n_embd, cfg.n_head, positions(cfg), vocab, cfg.micro_batch_size, cfg.precision, deepspeed)
        return {k: (w.scaled(t) if k.startswith("block") else w) for k, w in work.items()}
    word = 4 if cfg.precision == "32-true" else 2
    block = fused_block(cfg.n_embd, cfg.n_head, positions(cfg), cfg.micro_batch_size, t, framework.attention, word)
    head = fused_head(cfg.n_embd, vocab, positions(cfg), cfg.micro_batch_size, t if framework.splits_head else 1, word)
    return {"block_forward": block[0], "block_backward": block[1], "head_forward": head[0], "head_backward": head[1]}


def optimizer_work(states: float, grad_accum: int, framework: Framework, adamw: bool) -> Work:
    """The optimizer over this rank's states (elements): fused AdamW reads weights, gradients and both moments and
    writes three (28 bytes an element, device_probe's sweep; SGD 12), the gradient norm reads the gradients and
    clipping scales them (12); an eager step also adds each micro-batch's gradients into .grad after the first
    (12 bytes an element each)."""
    per = (28 if adamw else 12) + 12 + (12 * (grad_accum - 1) if framework.block == "counted" else 0)
    return Work((Kernel("memory", bytes=per * states),), 8)


def step_seconds(cfg, device: Device, peak: float, states: float, vocab: int, framework: Framework,
                 host_op_s: float) -> dict:
    """The compute of one optimizer step on the busiest rank: m micro-batches through its blocks (and the head
    where it holds it), forward, backward and, under checkpointing, the forward again; then the optimizer over its
    states. GPU and host time apart: a step takes the longer (the host queues kernels ahead of the GPU until it
    runs out of them). per_micro_batch_s: the busiest stage's micro-batch, which a pipeline's bubble repeats."""
    lay, m, L = cfg.layout, cfg.grad_accum, cfg.n_layer
    w = passes(cfg, framework, vocab)
    recompute = 1 if cfg.grad_checkpointing else 0
    gpu = {k: v.seconds(device, peak) for k, v in w.items()}
    host = {k: host_seconds(v, framework, host_op_s) for k, v in w.items()}

    def micro_batch(times, blocks, with_head):
        block = times["block_forward"] * (1 + recompute) + times["block_backward"]
        return blocks * block + (times["head_forward"] + times["head_backward"] if with_head else 0.0)

    p = lay.pp_size if lay.pipeline else 1
    if p > 1:  # the first stages take the extra block, the last holds the head
        stages = [(-(-L // p), False), (L // p, True)]
    else:
        stages = [(L, True)]
    gpu_mb = max(micro_batch(gpu, n, head) for n, head in stages)
    host_mb = max(micro_batch(host, n, head) for n, head in stages)
    opt = optimizer_work(states, m, framework, cfg.optimizer == "adamw")
    gpu_s = m * gpu_mb + opt.seconds(device, peak)
    host_s = m * host_mb + host_seconds(opt, framework, host_op_s)
    return {"gpu_s": gpu_s, "host_s": host_s, "compute_s": max(gpu_s, host_s),
            "per_micro_batch_s": max(gpu_mb, host_mb), "host_bound": host_s > gpu_s,
            "kernels_per_micro_batch": sum(len(v.kernels) for v in w.values())}


def rank_states(cfg, n_params: int) -> float:
    """Parameters whose optimizer states this rank updates: a shard under ZeRO and FSDP, a stage under pipeline,
    a tensor-parallel share (the matrices; the rest replicated is small), else all."""
    lay = cfg.layout
    held = n_params / (lay.tp_size if lay.tensor_parallel else 1) / (lay.pp_size if lay.pipeline else 1)
    return held / lay.dp_size if (lay.deepspeed or lay.fsdp) else held


def framework_of(cfg, name: str | None = None) -> Framework:
    """The framework a plan prices: the one named (a published run's), else --plan-framework, else this
    repository's own step (eager, or compiled under --compile)."""
    name = name or getattr(cfg, "plan_framework", "") or ("compiled" if getattr(cfg, "compile", False) else "eager")
    if name not in FRAMEWORKS:
        raise ValueError(f"framework {name!r} is not known; known: {', '.join(FRAMEWORKS)}")
    return FRAMEWORKS[name]


def describe(device: Device, cal: Calibration | None = None) -> str:
    cal = cal or CALIBRATION
    return (f"matmuls at {device.gemm:.3f} of the peak, flash attention at {device.attention:.3f}, an eager op "
            f"{cal.host_op_s * 1e6:.1f} us on the host (calibrated on published runs: make plan-check); HBM "
            f"{device.memory_bw / 1e12:.2f} TB/s x {MEMORY_EFFICIENCY}, {KERNEL_S * 1e6:.0f} us a kernel (assumed)")


def describe_calibration(cal: Calibration | None = None) -> str:
    cal = cal or CALIBRATION
    return "; ".join([f"{k}: matmuls {cal.devices[k].gemm:.3f}, attention {cal.devices[k].attention:.3f} of the peak"
                      for k in ("a100", "h100")] + [f"an eager op {cal.host_op_s * 1e6:.2f} us on the host"])
