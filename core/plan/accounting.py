"""The arithmetic behind fabric_gpt.py's figures: FLOPs per token, peak FLOP/s (datasheet dense peaks for
GPUs, a measured matmul probe for CPUs), peak memory, and the per-device memory plan of every strategy."""

import dataclasses
import os
import resource
import time

import psutil
import torch

from core.gpt.chunked_loss import CHUNK
from core.gpt.gpt_model import SDPA_FLOAT32, count_parameters, has_biases, model_vocab, positions
from core.gpt.strategies import (NVME_BUFFER_COUNT, REDUCE_BUCKET, deepspeed_on_cpu, fsdp_gathers_bf16,
                                 nvme_param_buffer)
from core.run import hardware, measurements
from core.run.flags import ConfigError

# Dense (not sparse) peak FLOP/s per GPU from NVIDIA's datasheets, for the dtype the matmuls run in.
# Lightning's get_available_flops lists some sparse figures (H100 NVL, H200) and misses names, so it is not used.
PEAK_FLOPS = {
    "a100": {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12},
    "h100 sxm": {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12},
    "h100 pcie": {"bf16": 756e12, "fp16": 756e12, "fp32": 51e12},
    "h100 nvl": {"bf16": 835e12, "fp16": 835e12, "fp32": 60e12},
    "h200 sxm": {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12},
    "h200 nvl": {"bf16": 835e12, "fp16": 835e12, "fp32": 60e12},
    "l40s": {"bf16": 362e12, "fp16": 362e12, "fp32": 91.6e12},
}
# Export variants with the same tensor cores (their interconnect differs, not their FLOP/s)
SAME_CHIP = {"a800": "a100", "h800": "h100"}


def gpu_chip(name: str) -> str | None:
    """The PEAK_FLOPS row of a CUDA device name, or None when it is not listed."""
    name = name.lower()
    for variant, chip in SAME_CHIP.items():
        name = name.replace(variant, chip)
    if "l40s" in name:
        return "l40s"
    for family in ("h200", "h100"):
        if family in name:
            if "nvl" in name:
                return f"{family} nvl"
            if family == "h100" and "pcie" in name:
                return "h100 pcie"
            return f"{family} sxm"
    return "a100" if "a100" in name else None


def dtype_kind(precision: str) -> str:
    return "bf16" if "bf16" in precision else "fp16" if "16" in precision else "fp32"


def peak_flops(device: torch.device, precision: str) -> tuple[float | None, str]:
    """(peak FLOP/s of one device for this precision, where the figure comes from)."""
    if device.type == "cuda":
        chip = gpu_chip(torch.cuda.get_device_name(device))
        if chip is None:
            return None, "unknown GPU (not in PEAK_FLOPS)"
        return PEAK_FLOPS[chip][dtype_kind(precision)], f"datasheet dense peak, {chip}"
    peak, path = cpu_matmul_peak(precision)
    return peak, f"measured CPU matmul probe, {path}"


def measured_cpu_matmul_flops(precision: str) -> float:
    return cpu_matmul_peak(precision)[0]


# the matmul probe: square matmuls of this size, timed for this long (its cache key holds both)
PEAK_PROBE_N, PEAK_PROBE_SECONDS = 1024, 0.5


def cpu_matmul_peak(precision: str) -> tuple[float, str]:
    """(FLOP/s, which path) this process reaches on square matmuls: the CPU's achievable peak, since CPUs have no
    datasheet figure that counts threads, frequency and AMX/AVX-512 alike. For 16-bit autocast the best of the paths
    the run's matmuls may take: GPT-2's Conv1D runs `addmm`, which on a CPU without bf16 instructions can be 20x
    faster than a bf16 `matmul`, and autocast keeps some products in float32; a peak from one slow path made
    utilizations of 160-708% (an AVX2 CPU). MFU is against the fastest, so it stays a share. Measured once per
    machine, precision and thread count (core/run/measurements.py's cache): on that AVX2 CPU it took 20 s of every bf16 run."""
    measure = lambda: list(_measure_matmul_peak(precision, PEAK_PROBE_N, PEAK_PROBE_SECONDS))  # noqa: E731
    settings = matmul_peak_settings(precision)
    return tuple(measurements.cached_unlocked("matmul_peak", settings, measure, timed_threads=settings["threads"]))


def forget_cpu_matmul_peak(precision: str) -> None:
    """A run on this CPU outran its cached peak (MFU above 100%): the probe ran under more load than the run's steps
    (another job on these cores: 2 tests side by side measured 68-72 GFLOP/s on one core of an AVX-512 EPYC, alone
    106). Dropped, so that the next run measures it again rather than inflate every MFU after it."""
    measurements.forget("matmul_peak", matmul_peak_settings(precision))


def matmul_peak_settings(precision: str) -> dict:
    """The probe's cache key beside the machine's: what changes its figure."""
    return {"precision": dtype_kind(precision), "threads": torch.get_num_threads(), "n": PEAK_PROBE_N,
            "seconds": PEAK_PROBE_SECONDS}


def _measure_matmul_peak(precision: str, n: int, seconds: float) -> tuple[float, str]:
    a32, b32 = torch.randn(n, n), torch.randn(n, n)
    if dtype_kind(precision) != "bf16":
        return _rate(lambda: a32 @ b32, n, seconds), "float32 matmul"
    bias = torch.zeros(n, dtype=torch.bfloat16)
    paths = {"bf16 addmm": lambda a, b: torch.addmm(bias[:a.shape[1]], a, b), "bf16 matmul": lambda a, b: a @ b,
             "float32 matmul": None}
    rates = {}
    for name, fn in paths.items():
        if fn is None:
            rates[name] = _rate(lambda: a32 @ b32, n, seconds / len(paths))
            continue
        # an emulated path (no bf16 instructions) takes seconds a call at n = 1024: measured at 256 when a call at n
        # would not fit a few times in its share of the time (under the AVX2 caps on an AVX-512 BF16 EPYC the path
        # ran 2-3 GFLOP/s at 256 and 1.2 at 1024: 15 s for this probe at 1024, where a fixed 2 GFLOP/s cut let it)
        small = _rate(lambda: fn(a32[:256, :256].bfloat16(), b32[:256, :256].bfloat16()), 256, 0.02)
        m = n if 2 * n**3 / small < seconds / len(paths) / 4 else 256
        a, b = a32[:m, :m].bfloat16(), b32[:m, :m].bfloat16()
        rates[name] = _rate(lambda: fn(a, b), m, seconds / len(paths))
    best = max(rates, key=rates.get)
    return rates[best], f"best of {', '.join(rates)}: {best}"


def _rate(fn, n: int, seconds: float, windows: int = 4) -> float:
    """FLOP/s of fn, an n x n x n matmul: the best of `windows` timings, so that a moment of another process's load
    does not lower the peak every later MFU is measured against."""
    for _ in range(2):  # oneDNN builds its kernel on the first calls
        fn()
    best = 0.0
    for _ in range(windows):
        count, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds / windows or count < 2:
            fn()
            count += 1
        best = max(best, 2 * n**3 * count / (time.perf_counter() - start))
    return best


def flops_per_token(cfg, n_params: int) -> dict:
    """Training FLOPs per token. Standard (PaLM appendix B, nanoGPT): 6N + 12·L·H·Q·T, the model's work.
    Course formula: 8N, i.e. 6N plus a second forward (2N) as activation recomputation costs."""
    attention = 12 * cfg.n_layer * cfg.n_head * (cfg.n_embd // cfg.n_head) * positions(cfg)
    return {"standard": 6 * n_params + attention, "course_8n": 8 * n_params}


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak on a GPU; a process's peak resident memory (CPU) cannot be reset."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: torch.device) -> dict:
    if device.type == "cuda":
        return {"max_allocated_gb": torch.cuda.max_memory_allocated(device) / 2**30,
                "max_reserved_gb": torch.cuda.max_memory_reserved(device) / 2**30}
    # ru_maxrss is in KiB on Linux: the process's peak resident memory
    return {"max_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            "rss_gb": psutil.Process().memory_info().rss / 2**30}


# ----------------------------------------------------------------------------- memory plan
# ----------------------------------------------------------------------------- the model's shape
def weight_bytes(cfg) -> int:
    """Bytes per parameter (and gradient) as a run keeps them: 2 where the weights themselves are 16-bit (DeepSpeed
    runs the model in its 16-bit precision; bf16-true everywhere), else 4 (autocast keeps float32 weights)."""
    half = cfg.precision in ("16-mixed", "bf16-mixed", "bf16-true")
    return 2 if (half and cfg.layout.deepspeed) or cfg.precision == "bf16-true" else 4


def block_params(cfg) -> int:
    """A block's parameters: its four matrices (12h²), its two LayerNorms' weights (2h) and, as GPT-2 has them, their
    biases (2h) and the matrices' (9h); --no-bias has neither."""
    h = cfg.n_embd
    return 12 * h * h + (13 * h if has_biases(cfg) else 2 * h)


def tp_split_params(cfg) -> int:
    """What tensor parallelism splits t ways in a block: the matrices and the column-parallel biases (c_attn's, c_fc's);
    the LayerNorms and the row-parallel biases are replicated (Korthikanti et al. 2022, no sequence parallelism)."""
    h = cfg.n_embd
    return 12 * h * h + (7 * h if has_biases(cfg) else 0)


def final_norm_params(cfg) -> int:
    return cfg.n_embd * (2 if has_biases(cfg) else 1)


def largest_layer_params(cfg) -> int:
    return max(model_vocab(cfg) * cfg.n_embd, block_params(cfg))


def model_states(cfg, P: int) -> dict:
    """Bytes per device of weights, gradients and optimizer state. 16-bit DeepSpeed follows its own
    estimate_zero2/3_model_states_mem_needs; the rest counts what each strategy keeps on a rank."""
    lay = cfg.layout
    N, stage, offload = lay.world, lay.zero_stage, lay.offload
    per = weight_bytes(cfg)
    h, L, V, S = cfg.n_embd, cfg.n_layer, model_vocab(cfg), cfg.seq_len
    states = {"params": 0.0, "grads": 0.0, "optimizer": 0.0, "master": 0.0, "ddp_buckets": 0.0, "gathered_layer": 0.0}
    moments = 2 if cfg.optimizer == "adamw" else 0  # AdamW's m and v; plain SGD keeps none
    if lay.deepspeed:
        if per == 2:  # 16-bit weights and grads; fp32 grads, master weights, Adam m and v per partition (4+4+8)
            states.update(params=2 * P / N if stage == 3 else 2 * P,
                          grads=0 if stage == 3 else 2 * P / N if stage == 2 else 2 * P, optimizer=(8 + 4 * moments) * P / N)
        else:  # fp32 weights; ZeRO keeps its own fp32 master copy of each partition besides Adam's m and v (ZeRO-3
            # means to reuse fp32 weights, but deepspeed 0.19's check compares a torch.device with a str and copies)
            states.update(params=4 * P / N if stage == 3 else 4 * P, grads=4 * P / N if stage >= 2 else 4 * P,
                          optimizer=4 * moments * P / N, master=4 * P / N)
        states["gathered_layer"] = 4 * largest_layer_params(cfg) if stage == 3 else 0  # as DeepSpeed's estimator
        if offload:
            states.update(optimizer=0, grads=0, master=0, params=0 if stage == 3 else states["params"])
        return states
    # Fabric's strategies keep fp32 weights under autocast; bf16-true holds everything in 2 bytes
    t, p = lay.tp_size, lay.pp_size
    blocks, split, ln_f = L * block_params(cfg), tp_split_params(cfg), final_norm_params(cfg)
    embeddings = V * h + S * h
    if lay.tensor_parallel and lay.pipeline:  # Megatron's 3-D layout (plans only): a stage's blocks split t ways,
        # the vocabulary-parallel embedding on the first and last stages
        layers = -(-L // p)
        held = layers * (split / t + block_params(cfg) - split) + (V * h + S * h) / t
    elif lay.tensor_parallel:  # tp_split_params split t ways; the rest of each block and the embeddings replicated
        held = L * split / t + (blocks - L * split) + embeddings + ln_f
    elif lay.pipeline:
        layers = -(-L // p)  # the first stages take the extra layer
        held = layers * block_params(cfg) + max(embeddings, V * h + ln_f)  # first stage: wte+wpe; last: ln_f+head
    else:
        held = P
    shard = lay.dp_size if lay.fsdp else 1
    states.update(params=per * held / shard, grads=per * held / shard, optimizer=moments * per * held / shard)
    if lay.replicated and N > 1:
        states["ddp_buckets"] = per * P  # DDP all-reduces from buckets that copy every gradient
    if lay.fsdp:
        # one block's weights, then its gradients (under bf16 gathering: bf16 weights, float32 gradients to reduce);
        # and the root unit (embeddings, final norm, the tied head), which FSDP2 does not reshard after forward: its
        # whole weights from its forward to the end of backward, and its whole gradient from the head's backward
        # until it is reduced (measured: GPT-2 small's width, 4 blocks, 2 ranks, CPU: the peak 6.4% over the plan
        # without them at micro-batch 4 x 1024 and 14% at 2 x 128 with the weights alone, docs/gpt.md)
        root = 2 * per * (embeddings + ln_f) if lay.dp_size > 1 else 0
        states["gathered_layer"] = (2 + 4 if fsdp_gathers_bf16(cfg) else 2 * per) * block_params(cfg) / t + root
    return states


def held_states_plan(cfg, P: int) -> dict:
    """The plan of what held_bytes measures: weights, fp32 master weights and optimizer moments one rank holds,
    wherever they live (the device, or the host under ZeRO-Offload, where the device plan counts none)."""
    lay = cfg.layout
    if not lay.deepspeed:
        states = model_states(cfg, P)
        return {k: states[k] for k in ("params", "master", "optimizer")}
    N, word = lay.world, weight_bytes(cfg)
    moments = 2 if cfg.optimizer == "adamw" else 0
    return {"params": word * P / N if lay.zero_stage == 3 else word * P, "master": 4 * P / N,
            "optimizer": 4 * moments * P / N}


def runs_autocast(cfg) -> bool:
    """16-bit autocast around float32 weights (DeepSpeed runs 16-bit "mixed" as 16-bit weights, no autocast)."""
    return cfg.precision in ("16-mixed", "bf16-mixed") and not cfg.layout.deepspeed


LOSS_BYTES_PER_LOGIT = 12  # the loss's peak: three float32 tensors of the logits' size (activation_bytes)
LOSS_SAVED_PER_LOGIT = 4  # of them saved in forward: log_softmax's float32 output, whatever the logits' word


def activation_bytes(cfg, attn_implementation: str) -> dict:
    """Bytes saved for backward by one micro-batch, counted from what HF GPT-2 actually saves (listed with
    torch.autograd.graph.saved_tensors_hooks on CPU; tests/test_gpt.py compares the two). Per block and per
    element of s·b·h, with w the activation word (2 under bf16, 4 in float32) and r the residual stream's
    (4 under autocast, which leaves it in float32):
      2r   the two LayerNorms' inputs (the residual stream)
      2w   their outputs, the inputs of c_attn and c_fc
      3w   q, k, v (SDPA saves them, its output w and a log-sum-exp per head and position)
      w    the attention output (c_proj's input is a view of it)
      8w   the MLP: c_fc's output (the tanh GELU's input, one kernel) and the GELU's output (c_proj's input)
    = 2r + 14w: 64 bytes in float32, 36 under bf16 autocast, 28 in bf16-true: Korthikanti et al.'s 34 counts
    dropout masks and a 16-bit residual. (With gelu_new, a Python composite whose ops each saved their inputs,
    it was 2r + 14w + 12g: 112 bytes in float32, 84 under autocast on an H100, where pow ran in float32.) Autocast also keeps each block's 16-bit weight
    copies (12h² x 2 bytes) for backward. Eager attention adds the s x s scores (Korthikanti's 5as/h, in w-byte
    words). Tensor parallel splits all but the LayerNorms' inputs and outputs by t."""
    s, b, h, a, L, V = positions(cfg), cfg.micro_batch_size, cfg.n_embd, cfg.n_head, cfg.n_layer, model_vocab(cfg)
    half = cfg.precision in ("16-mixed", "bf16-mixed", "bf16-true")
    # DeepSpeed runs 16-bit "mixed" as 16-bit weights and activations, no autocast: like bf16-true
    lay = cfg.layout
    autocast = runs_autocast(cfg)
    w = 2 if half else 4
    r = 4 if (autocast or not half) and not fsdp_gathers_bf16(cfg) else 2  # bf16 gathers: bf16 inside the blocks
    t, p = lay.tp_size, lay.pp_size
    scores = 5 * a * s / h * w / 2 if attn_implementation == "eager" else 0
    # attention: q, k, v and its output as SDPA saves them (w each), or, computed in float32 (SDPA_FLOAT32), in 4
    # bytes each, the output then cast back for c_proj, which saves that copy (w)
    attention = 3 * 4 + 4 + w if attn_implementation == SDPA_FLOAT32 else 4 * w
    per_layer = s * b * h * (2 * r + 2 * w + (8 * w + attention + scores) / t)
    # per block, kept from forward to backward (with bf16 gathers the block's own weights, freed and gathered again)
    weight_copies = 12 * h * h * 2 / t if autocast and not fsdp_gathers_bf16(cfg) else 0
    head_copy = V * h * 2 if autocast else 0  # lm_head's (the tied embedding's) 16-bit copy
    head = s * b * h * (r + w) + head_copy  # ln_f's input and output, and that copy
    # the loss at its peak, in backward: log_softmax's float32 output (saved), the float32 gradient nll_loss makes
    # of it and the float32 gradient of the logits made from those two, 12 bytes a logit whatever the logits' own
    # word (measured: 12.0-12.4 with bf16 or float32 logits, 2,048-4,096 x 50,257 on a CPU, docs/gpt.md); in forward
    # the logits, their float32 copy and that output are w + 8 at most. The chunked loss (chunked_loss.py) holds one
    # chunk's float32 logits and their 16-bit copy, the head's float32 gradient and the hidden states' gradient,
    # all made in forward
    logits = s * b * V * LOSS_BYTES_PER_LOGIT / t
    logits_gradient = s * b * V * (LOSS_BYTES_PER_LOGIT - LOSS_SAVED_PER_LOGIT) / t  # made in backward
    if getattr(cfg, "chunked_loss", False):
        logits, logits_gradient = min(s * b, CHUNK) * V * (4 + w) + V * h * 4 + s * b * h * w, 0
    layers = -(-L // p)
    in_flight = 1
    if lay.pipeline:  # the first stage holds activations of up to p (1F1B) or m (GPipe) micro-batches
        in_flight = min(p, cfg.grad_accum) if cfg.pp_schedule == "1f1b" else cfg.grad_accum
    blocks_full = in_flight * layers * per_layer
    # checkpointing keeps each block's input (the residual stream) and recomputes one block at a time
    blocks_checkpointed = in_flight * layers * s * b * h * r + per_layer
    full = blocks_full + in_flight * layers * weight_copies + head + logits
    checkpointed = blocks_checkpointed + weight_copies + head + logits
    # every 16-bit copy the forward made (autocast keeps them until its region ends, then frees them into the heap)
    all_copies = in_flight * layers * weight_copies + head_copy
    return {"activations_full": full, "activations_checkpointed": checkpointed, "logits_gradient": logits_gradient,
            "weight_copies": all_copies,
            "block_activations": blocks_checkpointed if cfg.grad_checkpointing else blocks_full}


def plans_for_gpu(cfg) -> bool:
    """The plan describes a GPU run: one is asked for, or visible, or --device-memory-gb names one."""
    accelerator = getattr(cfg, "accelerator", "auto")
    return accelerator in ("gpu", "cuda") or (accelerator == "auto" and (
        torch.cuda.is_available() or bool(getattr(cfg, "device_memory_gb", 0))))


def memory_plan(cfg, n_params: int, attn_implementation: str = "sdpa") -> dict:
    states = model_states(cfg, n_params)
    acts = activation_bytes(cfg, attn_implementation)
    activations = acts["activations_checkpointed"] if cfg.grad_checkpointing else acts["activations_full"]
    plan = {**states, **acts, "activations": activations, "total": sum(states.values()) + activations,
            "n_params": n_params, "largest_layer_params": largest_layer_params(cfg),
            "model_states": sum(states.values()) - states["gathered_layer"]}
    lay = cfg.layout
    if lay.pipeline:
        m, p = cfg.grad_accum, lay.pp_size
        plan["bubble_fraction"] = (p - 1) / (m + p - 1)
    half = cfg.precision in ("16-mixed", "bf16-mixed", "bf16-true")
    plan["deepspeed_estimate"] = deepspeed_estimate(cfg, n_params) if lay.deepspeed and half else None
    return plan


# ZeRO-Infinity's host buffers in our config (strategies.deepspeed_config): optimizer sub-groups of 2.5e7 elements
# (fp32 weights, both moments and the gradient swapped in at once), 8 parameter buffers each a rank's partition of the
# largest parameter (strategies.nvme_param_buffer) and at most 5e7 parameter elements kept in host memory
NVME_SUB_GROUP, NVME_MAX_IN_CPU = 2.5e7, 5e7


# The host plan against the measured peak RSS: the 1.6B model under ZeRO-Infinity 3% over (10.3 planned, 10.01 GiB
# measured per process), GPT-2 small's width with 4 blocks on one process 1.0-3.9% under (float32, bf16, checkpointing,
# micro-batch 2 and 8, AVX-512 EPYC; tests/test_gpt.py; freed_but_resident: counting every freed tensor planned the
# bf16 run with checkpointing 7.0% over there; a Xeon with AVX-512 BF16: the training term alone 1.3% under at
# micro-batch 2, 0.2% under at 8; the AMX Xeon with checkpointed_copies_resident: -0.5% and +0.4%, and 2.5% under for
# micro-batch 1 at sequence 32, 5.3% under without them): a run is refused when the plan plus this share does not
# fit, rather than a flat 10% that refused the documented 1.6B command on a 24 GiB machine. Since the tied sum
# (2026-12-01, another AVX-512 BF16 EPYC, micro-batch 2): float32 2.3-3.9% under, bf16 1.3% and (checkpointed) 2.5%
# over; at micro-batch 8 the plan is 6% (bf16) and 9.5% (float32) over, on the side of refusing (docs/gpt.md)
HOST_PLAN_MARGIN = 0.05


def host_memory_plan(cfg, n_params: int, device_plan: dict, on_gpu: bool, baseline: float) -> dict:
    """Host RAM of one process and of this machine's processes, peak of set-up and training:
      baseline      the process with its libraries imported (measured when the plan is made)
      construction  the whole float32 model on every rank (every strategy but ZeRO-3, which builds its partition
                    under zero.Init and holds one whole parameter at a time while filling it)
      training      on a CPU the device plan itself (weights, gradients, optimizer, activations); on a GPU only
                    what offload keeps on the host
      checkpoint    one process or ddp on a CPU: the states and their serialized copy while Fabric saves
      offload       CPU offload: fp32 master weights, Adam's moments and fp32 gradients of the partition (and the
                    16-bit weights under ZeRO-3); NVMe: the partition's fp32 gradient, fp32 and 16-bit weights
                    (measured: DeepSpeed keeps them in host memory) and ZeRO-Infinity's sub-group and swap buffers"""
    lay = cfg.layout
    dp, stage = lay.dp_size, lay.zero_stage
    word = weight_bytes(cfg)
    partition = n_params / dp
    offload = 0.0
    if lay.offload:
        if cfg.nvme_path:  # measured on the 1.6B model (docs/gpt.md): the partition's fp32 gradient and fp32 and
            # 16-bit weights stay in host memory (10 bytes per element under bf16) besides the swap buffers
            # a parameter's partition larger than a sub-group is a sub-group of its own (the 1.6B model's embedding
            # on one process, 8.04e7): counting 2.5e7 planned a 1,024-wide model 16% under its peak (docs/gpt.md)
            largest_partition = nvme_param_buffer(cfg)
            offload = (partition * (4 + 4 + word) + max(NVME_SUB_GROUP, largest_partition) * 16
                       + (NVME_BUFFER_COUNT * largest_partition + NVME_MAX_IN_CPU) * word)
        else:
            offload = partition * (4 + 8 + 4) + (partition * word if stage == 3 else 0)
    if stage == 3:
        construction = (0 if on_gpu else partition * word) + 4 * largest_layer_params(cfg)
    else:
        construction = 4 * n_params
    kept = freed_but_resident(cfg, word, copies=device_plan["weight_copies"] > 0,
                              activations=device_plan["block_activations"])
    replicated_on_cpu = not on_gpu and lay.replicated
    # on a CPU, the larger of two moments beyond the device plan: backward's start, the forward's freed 16-bit copies
    # still in the heap, and its end, where the gradients have reused that heap and the tied sum is made out of place
    training = offload + (0 if on_gpu else device_plan["total"] + zero3_on_cpu(cfg, n_params, word, device_plan)
                          + max(checkpointed_copies_resident(cfg),
                                tied_gradient_sum(cfg, word, device_plan) if replicated_on_cpu else 0))
    # Fabric's single-file checkpoint (one process, ddp) is written by torch.save in place (checkpoints.WrittenInPlace):
    # the weights and optimizer states it serializes are the process's own, and beside them the gradients and
    # autocast's 16-bit weight copies the step freed, partly still in the process's heap (freed_but_resident)
    states = device_plan["params"] + device_plan["optimizer"] + device_plan["master"]
    checkpoint = states + kept if replicated_on_cpu else 0
    per_process = baseline + max(construction, training, checkpoint)
    return {"baseline": baseline, "construction": construction, "offload": offload, "training": training,
            "checkpoint": checkpoint, "per_process": per_process, "machine": per_process * cfg.devices}


DEEPSPEED_MAX_LIVE_PARAMETERS = int(1e9)  # stage3_max_live_parameters, DeepSpeed's default (deepspeed_config keeps it)


def zero3_on_cpu(cfg, n_params: int, word: int, device_plan: dict) -> float:
    """ZeRO-3 across data-parallel ranks on a CPU, without offload: what a rank holds at its peak beyond its partition
    (the device plan's states and one gathered layer, as DeepSpeed's estimator counts them):
      - the whole gradients, twice: DeepSpeed copies each into its gradient bucket (REDUCE_BUCKET elements, made with
        torch.empty: resident only as far as they fill it), and reduce_scatter_coalesced concatenates them again
      - the gradients autograd made, freed once copied and kept in glibc's heap where small (freed_gradients)
      - the tied embedding's gradient summed out of place, as on one process (tied_gradient_sum)
      - the parameters kept gathered after use, up to the live-parameter limit, beyond the one layer counted
    Measured against rank 0's peak on 2 ranks (GPT-2 small's width at sequence 128, micro-batch 2, and 384 wide at
    256; a Zen 4 EPYC, docs/gpt.md): -3.7% to +0.7% over four shapes in float32 and bf16. The bucket counted whole
    (0.75 GiB in float32) had planned the tiny model 72% over its peak and 384 wide 25%. ZeRO-Infinity's 1.6B run
    peaked 4-8% under its plan without these, so offload's plan, measured on its own, is left as it was."""
    lay = cfg.layout
    if not (lay.deepspeed and lay.zero_stage == 3 and lay.dp_size > 1 and not lay.offload):
        return 0.0
    gathered = max(0.0, min(n_params, DEEPSPEED_MAX_LIVE_PARAMETERS) * word - 4 * largest_layer_params(cfg))
    return (2 * min(REDUCE_BUCKET, n_params) * word + freed_gradients(cfg, word)
            + tied_gradient_sum(cfg, word, device_plan) + gathered)


# glibc serves an allocation of 32 MiB or more (its largest mmap threshold) from mmap and unmaps it when freed;
# smaller blocks go back to the heap for reuse, where the process's resident memory still counts them
MMAP_THRESHOLD = 32 * 2**20


def block_matrices(cfg) -> tuple:
    """Elements of a block's weight matrices: c_attn, attn.c_proj, c_fc, mlp.c_proj."""
    h = cfg.n_embd
    return 3 * h * h, h * h, 4 * h * h, 4 * h * h


def heap_resident(numels, nbytes: int) -> float:
    """Bytes of those tensors (`numels` elements of `nbytes` each) that glibc keeps in the heap once freed."""
    return sum(n * nbytes for n in numels if n * nbytes < MMAP_THRESHOLD)


def checkpointed_copies_resident(cfg) -> float:
    """Under autocast with checkpointing, the forward still makes every block's 16-bit weight copies (autocast's cache
    keeps them until the forward ends) where the device plan counts one block's, alive in its backward; freed, the
    copies under glibc's mmap threshold stay in the heap. Measured with mallinfo2 at the peak of a bf16 run with
    checkpointing (GPT-2 small's width, 4 blocks, micro-batch 1, sequence 32, AMX Xeon): 0.054 GiB of freed heap."""
    if not (cfg.grad_checkpointing and runs_autocast(cfg)) or fsdp_gathers_bf16(cfg):  # no copies (activation_bytes)
        return 0.0
    t = cfg.layout.tp_size  # tensor parallel: each rank's shard of a block's matrices
    return (-(-cfg.n_layer // cfg.layout.pp_size) - 1) * heap_resident([n / t for n in block_matrices(cfg)], 2)


def freed_activations(cfg, activations: float) -> float:
    """The blocks' `activations` a process still holds once freed: all of them where each tensor is under glibc's
    mmap threshold (the largest, the MLP's s·b·4h in float32), none where each went back to the system."""
    return activations if positions(cfg) * cfg.micro_batch_size * 4 * cfg.n_embd * 4 < MMAP_THRESHOLD else 0


def freed_but_resident(cfg, word: int, copies: bool, activations: float) -> float:
    """Bytes a replicated model's process still holds after a step freed them: the tensors under glibc's mmap
    threshold among its gradients (word bytes an element), autocast's 16-bit weight copies (with `copies`) and the
    blocks' activations (freed_activations). GPT-2 small's 154 MB embedding gradient goes
    back to the system, its 2-9 MB block matrices stay. Measured with mallinfo2 before a save (GPT-2 small's width,
    4 blocks, AVX-512 EPYC): 0.165 GiB of freed heap in float32 (planned 0.153), 0.200 under bf16 with checkpointing
    (0.239; every freed tensor counted, 0.375)."""
    matrices = block_matrices(cfg)
    weight_copies = cfg.n_layer * heap_resident(matrices, 2) + heap_resident((model_vocab(cfg) * cfg.n_embd,), 2)
    return freed_gradients(cfg, word) + (weight_copies if copies else 0) + freed_activations(cfg, activations)


def freed_gradients(cfg, word: int) -> float:
    """The model's gradients (word bytes an element) that glibc keeps in the heap once freed: the block matrices,
    biases and norms and the position embedding, not the vocabulary's."""
    h, V, L, s = cfg.n_embd, model_vocab(cfg), cfg.n_layer, positions(cfg)
    matrices = block_matrices(cfg)
    biases_and_norms = block_params(cfg) - sum(matrices)
    return heap_resident((V * h, s * h), word) + L * (heap_resident(matrices, word) + biases_and_norms * word)


def tied_gradient_sum(cfg, word: int, device_plan: dict) -> float:
    """What a replicated model on a CPU holds beyond the device plan's sum at the end of backward: autograd adds the
    embedding's gradient to the tied head's out of place, so three whole vocabulary x width gradients are alive at
    once (the head's, the embedding's and their sum) beside every other gradient, the step's activations freed into
    the heap by then. The larger moment where the vocabulary outweighs the activations: GPT-2 small's width with 4
    blocks at sequence 128, micro-batch 2 in float32 peaked 9% over the plan without it (2 x 147 MiB against 0.19 GiB
    of activations; each tensor's bytes traced with a TorchDispatchMode, an AVX2 EPYC, docs/gpt.md). Autocast's
    16-bit weight copies, freed block by block as backward passes them, are not counted: the larger float32 gradients
    made after them reuse that heap (under bf16 with checkpointing the same run peaked 0.13 GiB under float32's, where
    counting them planned it 9% over; an AVX-512 BF16 EPYC)."""
    resident = freed_activations(cfg, device_plan["block_activations"])  # the gradients are all alive here
    return max(0.0, 2 * model_vocab(cfg) * cfg.n_embd * word + resident - device_plan["activations"])


def process_baseline() -> float:
    """This process's resident memory now: torch, Lightning and transformers imported (a rank imports the same).
    What this process's measurements freed before it (a first run on a new machine times its matmul peak and its
    attention: 40-50 MB) goes back to the system first: kept in the heap it was counted as the libraries' and again
    as training's, whose tensors reuse it (a fresh clone's host-plan test planned 5.3% over the run's peak)."""
    hardware.return_freed_host_memory()
    return psutil.Process().memory_info().rss


def deepspeed_estimate(cfg, n_params: int) -> float | None:
    """DeepSpeed's own per-GPU model-state estimate for ZeRO-2/3 (it has none for stage 1)."""
    stage, offload = cfg.layout.zero_stage, cfg.layout.offload
    if not torch.cuda.is_available():
        deepspeed_on_cpu()  # the first import of DeepSpeed in a plan: its accelerator named, not searched for
    if stage == 2:
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

        return estimate_zero2_model_states_mem_needs(n_params, cfg.devices, cfg.num_nodes, cpu_offload=offload)[1]
    if stage == 3:
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

        return estimate_zero3_model_states_mem_needs(n_params, largest_layer_params(cfg), cfg.devices, cfg.num_nodes,
                                                     cpu_offload=offload, cpu_offload_params=offload)[1]
    return None


def held_bytes(model, optimizer) -> dict:
    """Bytes this rank actually holds in parameters, DeepSpeed's fp32 master partition and optimizer state
    (local shards only): the measurement the plan's model states are checked against."""
    from torch.distributed.tensor import DTensor

    def nbytes(t):
        t = t.to_local() if isinstance(t, DTensor) else t
        return t.numel() * t.element_size()

    module = getattr(model, "module", model)
    # ZeRO-3 leaves an empty placeholder in each parameter and keeps this rank's partition in ds_tensor
    # (under NVMe offload a swapped-out partition is an empty placeholder: it holds no host memory)
    params = sum(nbytes(getattr(p, "ds_tensor", p)) for p in module.parameters())
    outer = getattr(optimizer, "optimizer", optimizer)  # Fabric's wrapper -> torch's or DeepSpeed's optimizer
    inner = getattr(outer, "optimizer", outer)  # DeepSpeed's ZeRO optimizer -> the torch optimizer it steps
    state = sum(nbytes(v) for s in inner.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
    # ZeRO copies its partition into fp32 master weights (ZeRO-3 shares them when they are fp32 on the same device)
    masters = getattr(outer, "single_partition_of_fp32_groups", None) or [
        m for m, w in zip(getattr(outer, "fp32_partitioned_groups_flat", []), getattr(outer, "fp16_partitioned_groups_flat", []))
        if m is not None and (w is None or m.untyped_storage().data_ptr() != w.untyped_storage().data_ptr())]
    return {"params": params, "master": sum(nbytes(m) for m in masters), "optimizer": state}


# ----------------------------------------------------------------------------- a run's plans, and what would fit
def device_plan(cfg, on_gpu: bool, counted: tuple[int, str] | None = None) -> dict:
    """The memory plan per device of this run (accounting.memory_plan) on the accelerator it runs on; `counted` is
    count_parameters(cfg) when the caller has it."""
    n_params, attn = counted or count_parameters(cfg)
    return memory_plan(dataclasses.replace(cfg, accelerator="cuda" if on_gpu else "cpu"), n_params, attn)


def host_plan(cfg, on_gpu: bool, counted: tuple[int, str] | None = None, device: dict | None = None) -> dict:
    """Host RAM per process and for this machine's processes (host_memory_plan), from the device plan
    (made here unless the caller has it)."""
    if cfg.layout.deepspeed:
        if not (on_gpu and torch.cuda.is_available()):
            deepspeed_on_cpu()  # its accelerator named, not searched for with a warning
        import deepspeed  # noqa: F401  (imported by every rank anyway: its memory belongs to the baseline)
    device = device or device_plan(cfg, on_gpu, counted)
    return host_memory_plan(cfg, device["n_params"], device, on_gpu, process_baseline())


def host_available(cfg) -> float:
    return cfg.host_memory_gb * 2**30 or psutil.virtual_memory().available


def host_fits(need: float, available: float) -> bool:
    return need * (1 + HOST_PLAN_MARGIN) <= available  # the plan's measured error, kept


def check_host_memory(cfg, on_gpu: bool) -> None:
    """Refuse, before any model exists, a run whose processes would not fit this machine's memory (the kernel
    would kill one mid-run), naming the figures and settings that would fit. Local rank 0 decides for the machine:
    ranks launched after it would see its own memory as taken."""
    if os.environ.get("LOCAL_RANK", "0") != "0":
        return
    counted = count_parameters(cfg)  # the levers below change memory, not the model
    host, available = host_plan(cfg, on_gpu, counted), host_available(cfg)
    if host_fits(host["machine"], available):
        return
    gib = lambda b: f"{b / 2**30:.1f} GiB"  # noqa: E731
    offload = f", of which offload {gib(host['offload'])}" if host["offload"] else ""
    fixes = [f"{advice} ({gib(need)})" for advice, need in host_memory_fixes(cfg, on_gpu, available, counted)]
    margin = f"{100 * HOST_PLAN_MARGIN:.0f}%"
    raise ConfigError(
        f"this run needs about {gib(host['machine'])} of host memory and {gib(available)} is available (the plan keeps "
        f"{margin}, its measured error): {cfg.devices} process(es) x {gib(host['per_process'])} = libraries "
        f"{gib(host['baseline'])} + the larger of building the model ({gib(host['construction'])}), training "
        f"({gib(host['training'])}{offload}) and saving a checkpoint ({gib(host['checkpoint'])})."
        f" Would fit: {'; '.join(fixes[:3]) if fixes else 'nothing this machine can change (checkpointing, micro-batch 1, bf16, ZeRO-3, NVMe offload): use a smaller model or a larger machine'}"
        f". (--host-memory-gb overrides the available figure.)")


# What lowers a run's host memory, cheapest first: each is tried alone, then with those before it
HOST_LEVERS = (("--grad-checkpointing", {"grad_checkpointing": True}),
               ("--micro-batch-size 1", {"micro_batch_size": 1}),
               ("--precision bf16-mixed", {"precision": "bf16-mixed"}),
               ("--strategy deepspeed_stage_3", {"strategy": "deepspeed_stage_3"}),
               ("--strategy deepspeed_stage_3_offload --nvme-path DIR", {"strategy": "deepspeed_stage_3_offload",
                                                                         "nvme_path": "DIR"}))


def host_memory_fixes(cfg, on_gpu: bool, available: float, counted: tuple[int, str]) -> list[tuple[str, float]]:
    """(flags to add, host bytes then) for each setting, or setting with the cheaper ones before it, that makes the
    run fit; a lever already in use is never advised, nor one the run's other settings refuse."""
    fixes, chosen = [], []  # chosen: the levers tried so far, a later one replacing any that sets the same thing
    for advice, change in HOST_LEVERS:
        if all(getattr(cfg, k) == v or (k == "nvme_path" and cfg.nvme_path) for k, v in change.items()):
            continue  # in use already (any NVMe folder is the NVMe lever)
        chosen = [(a, c) for a, c in chosen if not set(c) & set(change)] + [(advice, change)]
        for levers in ([(advice, change)], chosen):
            other = dataclasses.replace(cfg, **{k: v for _, c in levers for k, v in c.items()})
            if other.optimizer == "sgd" and other.strategy.endswith("_offload"):
                continue  # ZeRO-Offload steps with DeepSpeed's CPU Adam only (validate refuses sgd there)
            need, text = host_plan(other, on_gpu, counted)["machine"], " ".join(a for a, _ in levers)
            if host_fits(need, available) and text not in (f for f, _ in fixes):
                fixes.append((text, need))
    return fixes
