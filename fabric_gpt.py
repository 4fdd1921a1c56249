"""GPT-2 (transformers) on random tokens through Lightning Fabric: strategies, precision, accumulation,
activation checkpointing, offload, with honest time/throughput/TFLOPS/MFU/memory figures.

    python fabric_gpt.py                                          # tiny model on CPU, single process
    python fabric_gpt.py --model 1.6b --plan --devices 8          # memory plan per device, no training
    python fabric_gpt.py --model 1.6b --strategy deepspeed_stage_3 --devices 2 --precision bf16-mixed
    python fabric_gpt.py --strategy ddp --devices 2 --accelerator cpu   # 2 processes with gloo

Every run writes runs/<run-name>/record.json (config, versions, device, figures) and TensorBoard events.
"""

import dataclasses
import itertools
import math
import resource
import signal
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import psutil
import torch
from lightning.fabric import Fabric
from lightning.fabric.loggers import TensorBoardLogger
from torch.utils.data import DataLoader, TensorDataset

from run_state import (Checkpoints, ConfigError, NonFiniteLoss, ResumeError, StopRequest, check_hardware,
                       check_same_experiment, cpu_name, environment, nonfinite_message, parse_config, resume_run_name, write_json_atomic)

# name: (n_embd, n_layer, n_head, n_positions/seq_len, vocab_size)
PRESETS = {
    "tiny": (64, 2, 4, 64, 256),
    "small": (256, 4, 4, 256, 50257),
    "gpt2": (768, 12, 12, 1024, 50257),
    "gpt2-medium": (1024, 24, 16, 1024, 50257),
    "gpt2-large": (1280, 36, 20, 1024, 50257),
    "gpt2-xl": (1600, 48, 25, 1024, 50257),
    "1.6b": (1600, 48, 32, 1024, 50257),  # the course's table: hidden 1600, 32 heads, 48 layers, seq 1024
}
STRATEGIES = ("auto", "ddp", "fsdp", "deepspeed_stage_1", "deepspeed_stage_2", "deepspeed_stage_3",
              "deepspeed_stage_2_offload", "deepspeed_stage_3_offload")
PRECISIONS = ("32-true", "16-mixed", "bf16-mixed", "bf16-true")
# Dense (not sparse) peak FLOP/s per GPU from NVIDIA's datasheets, for the dtype the matmuls run in.
# Lightning's get_available_flops lists some sparse figures (H100 NVL, H200) and misses names, so it is not used.
PEAK_FLOPS = {
    "a100": {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12},
    "h100 sxm": {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12},
    "h100 pcie": {"bf16": 756e12, "fp16": 756e12, "fp32": 51e12},
    "h100 nvl": {"bf16": 835e12, "fp16": 835e12, "fp32": 60e12},
    "h200": {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12},
}


@dataclass
class Config:
    # --- model (a preset; any dimension can be overridden)
    model: str = "tiny"            # tiny, small, gpt2, gpt2-medium, gpt2-large, gpt2-xl, 1.6b
    n_embd: int = 0                # hidden size (0: the preset's)
    n_layer: int = 0
    n_head: int = 0
    seq_len: int = 0               # tokens per sample (0: the preset's context length)
    vocab_size: int = 0
    dropout: float = 0.0           # 0 so that strategies can be compared step for step
    # --- data: a fixed set of samples, the same for every strategy
    dataset: str = "random"        # random tokens (as the course), or ramp (x[t+1] = x[t] + 1: learnable)
    num_samples: int = 256         # samples trained on in total = steps x micro-batch x accumulation x processes
    micro_batch_size: int = 4      # samples per process per forward/backward
    grad_accum: int = 1            # micro-batches per optimizer step
    steps: int = 0                 # stop after this many optimizer steps (0: all of num_samples)
    seed: int = 1234
    # --- optimization
    lr: float = 0.0                # peak learning rate (0: 5e-4 for 1.6b, as the course, else 6e-4)
    warmup_steps: int = 2
    weight_decay: float = 0.1
    grad_clip: float = 1.0         # max gradient norm (0: off); in the DeepSpeed config under DeepSpeed
    # --- where and how it runs (Fabric)
    accelerator: str = "auto"
    devices: int = 1
    num_nodes: int = 1
    strategy: str = "auto"         # Fabric's names, see STRATEGIES
    precision: str = "32-true"     # 32-true, 16-mixed, bf16-mixed, bf16-true
    nvme_path: str = ""            # with deepspeed_stage_3_offload: offload to NVMe at this path instead of CPU RAM
    grad_checkpointing: bool = False  # recompute activations in backward: less memory, ~1/3 more compute
    compile: bool = False
    # --- measurement and output
    timing_warmup: int = 2         # first optimizer steps left out of time and throughput
    log_every: int = 1
    plan: bool = False             # print the memory plan and exit without training
    device_memory_gb: float = 0.0  # memory per device for --plan (0: the visible GPU's)
    out_dir: str = "runs"
    run_name: str = ""
    checkpoint_every: int = 0      # optimizer steps between checkpoints (0: only at the end)
    keep_last: int = 2
    resume: str = ""               # "auto" or a checkpoint folder


RUNTIME_FIELDS = {"compile", "timing_warmup", "log_every", "plan", "device_memory_gb", "out_dir", "run_name",
                  "checkpoint_every", "keep_last", "resume", "steps", "accelerator", "nvme_path"}


def resolve(cfg: Config) -> Config:
    """Fill the preset's dimensions and the learning rate where the flags left 0."""
    n_embd, n_layer, n_head, seq_len, vocab = PRESETS[cfg.model]
    return dataclasses.replace(cfg, n_embd=cfg.n_embd or n_embd, n_layer=cfg.n_layer or n_layer,
                               n_head=cfg.n_head or n_head, seq_len=cfg.seq_len or seq_len,
                               vocab_size=cfg.vocab_size or vocab, lr=cfg.lr or (5e-4 if cfg.model == "1.6b" else 6e-4))


def world_size(cfg: Config) -> int:
    return cfg.devices * cfg.num_nodes


def samples_per_step(cfg: Config) -> int:
    """Samples in one optimizer step: micro-batch x accumulation x processes."""
    return cfg.micro_batch_size * cfg.grad_accum * world_size(cfg)


def is_deepspeed(cfg: Config) -> bool:
    return cfg.strategy.startswith("deepspeed")


def zero_stage(cfg: Config) -> int:
    return int(cfg.strategy.split("_")[2]) if is_deepspeed(cfg) else 0


# ----------------------------------------------------------------------------- model
def gpt2_config(cfg: Config):
    from transformers import GPT2Config

    return GPT2Config(n_embd=cfg.n_embd, n_layer=cfg.n_layer, n_head=cfg.n_head, n_positions=cfg.seq_len,
                      vocab_size=cfg.vocab_size, resid_pdrop=cfg.dropout, embd_pdrop=cfg.dropout,
                      attn_pdrop=cfg.dropout, use_cache=False, bos_token_id=cfg.vocab_size - 1,
                      eos_token_id=cfg.vocab_size - 1)


def build_model(cfg: Config):
    """GPT2LMHeadModel with random weights, built whole on every rank from the same seed. Never inside
    deepspeed.zero.Init: transformers would then initialize already-partitioned weights (first loss ~41
    instead of ~ln(vocab)); DeepSpeed partitions the finished model in fabric.setup instead."""
    from transformers import GPT2LMHeadModel

    torch.manual_seed(cfg.seed)
    model = GPT2LMHeadModel(gpt2_config(cfg))
    if cfg.grad_checkpointing:
        kwargs = {"use_reentrant": False}  # the reentrant variant drops gradients of inputs without grad
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5 renamed it
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return model


def count_parameters(cfg: Config) -> int:
    """Parameters of the model, counted on the meta device (no memory, works for 1.6B on any machine)."""
    from transformers import GPT2LMHeadModel

    with torch.device("meta"):
        model = GPT2LMHeadModel(gpt2_config(cfg))
    return sum(p.numel() for p in model.parameters())  # .parameters() counts the tied wte/lm_head once


def flops_per_token(cfg: Config, n_params: int) -> dict:
    """Training FLOPs per token. Standard (PaLM appendix B, nanoGPT): 6N + 12·L·H·Q·T, the model's work.
    Course formula: 8N, i.e. 6N plus a second forward (2N) as activation recomputation costs."""
    attention = 12 * cfg.n_layer * cfg.n_head * (cfg.n_embd // cfg.n_head) * cfg.seq_len
    return {"standard": 6 * n_params + attention, "course_8n": 8 * n_params}


# ----------------------------------------------------------------------------- data
def make_dataset(cfg: Config) -> TensorDataset:
    """`num_samples` sequences fixed by the seed alone, so every strategy and world size sees the same data."""
    g = torch.Generator().manual_seed(cfg.seed)
    if cfg.dataset == "ramp":
        start = torch.randint(0, cfg.vocab_size, (cfg.num_samples, 1), generator=g)
        tokens = (start + torch.arange(cfg.seq_len)) % cfg.vocab_size
    else:
        tokens = torch.randint(0, cfg.vocab_size, (cfg.num_samples, cfg.seq_len), generator=g)
    return TensorDataset(tokens)


# ----------------------------------------------------------------------------- strategy and optimizer
def deepspeed_config(cfg: Config) -> dict:
    """Written out rather than left to defaults: accumulation and clipping must live here under DeepSpeed
    (Fabric's no_backward_sync and clip_gradients do not apply), and offload targets are explicit."""
    zero = {"stage": zero_stage(cfg), "contiguous_gradients": True, "overlap_comm": True,
            "reduce_bucket_size": 2e8, "allgather_bucket_size": 2e8}
    if cfg.strategy.endswith("_offload"):
        target = {"device": "nvme", "nvme_path": cfg.nvme_path} if cfg.nvme_path else {"device": "cpu", "pin_memory": True}
        zero["offload_optimizer"] = dict(target)
        if zero_stage(cfg) == 3:
            zero["offload_param"] = dict(target)
    config = {"train_micro_batch_size_per_gpu": cfg.micro_batch_size, "gradient_accumulation_steps": cfg.grad_accum,
              "gradient_clipping": cfg.grad_clip, "zero_optimization": zero, "zero_allow_untested_optimizer": True,
              "steps_per_print": 10**9, "wall_clock_breakdown": False}
    if cfg.nvme_path:
        config["aio"] = {"block_size": 1048576, "queue_depth": 8, "single_submit": False, "overlap_events": True}
    return config


def make_strategy(cfg: Config):
    if is_deepspeed(cfg):
        from lightning.fabric.strategies import DeepSpeedStrategy

        return DeepSpeedStrategy(config=deepspeed_config(cfg))
    return cfg.strategy


def make_optimizer(cfg: Config, model, device: torch.device):
    """AdamW (betas 0.9/0.95) with weight decay on matrices only. Under offload the optimizer step runs on
    the CPU, where DeepSpeed requires its own vectorized CPU Adam; on CUDA the fused kernel is used."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if cfg.strategy.endswith("_offload"):
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(groups, lr=cfg.lr, betas=(0.9, 0.95), adamw_mode=True)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), fused=device.type == "cuda")


def lr_at(step: int, cfg: Config, total_steps: int) -> float:
    """Linear warm-up, then cosine decay to 10% of the peak (a function of the step: nothing to checkpoint)."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


# ----------------------------------------------------------------------------- memory plan
def memory_plan(cfg: Config, n_params: int, largest_layer: int) -> dict:
    """Bytes per device for model states and activations. Model states follow DeepSpeed's accounting for
    16-bit training (its estimate_zero2/3_model_states_mem_needs), split into parts as each strategy
    partitions them; activations follow
    Korthikanti et al. 2022 with memory-efficient attention (34·s·b·h bytes per layer in 16 bits)."""
    P, N = n_params, world_size(cfg)
    stage, offload = zero_stage(cfg), cfg.strategy.endswith("_offload")
    half = cfg.precision in ("16-mixed", "bf16-mixed", "bf16-true")
    if is_deepspeed(cfg) and half:
        # 16-bit weights (2 bytes), 16-bit grads (2; ZeRO-3 reduce-scatters them straight into the fp32
        # partitions), and per optimizer partition fp32 grads, fp32 master weights, Adam m and v (4+4+8)
        params = 2 * P / N if stage == 3 else 2 * P
        grads = 0 if stage == 3 else 2 * P / N if stage == 2 else 2 * P
        optim = 16 * P / N
        gathered = 4 * largest_layer if stage == 3 else 0  # a whole layer gathered for compute
        if offload:
            optim, grads = 0, 0
            params = 0 if stage == 3 else 2 * P
    elif is_deepspeed(cfg) or cfg.strategy == "fsdp":
        # fp32 (or fp16/bf16 autocast over fp32 weights under FSDP): 4 + 4 + 8 bytes, partitioned by stage
        shard = 3 if cfg.strategy == "fsdp" else stage
        params = 4 * P / N if shard == 3 else 4 * P
        grads = 4 * P / N if shard >= 2 else 4 * P
        optim = 8 * P / N
        gathered = 4 * largest_layer if shard == 3 else 0
        if offload:
            optim, grads, params = 0, 0, (0 if stage == 3 else 4 * P)
    else:
        # replicated: autocast keeps fp32 weights (4 + 4 + 8 bytes); bf16-true holds everything in 2 bytes
        per = 2 if cfg.precision == "bf16-true" else 4
        params, grads, optim, gathered = per * P, per * P, 2 * per * P, 0
    act_bytes = 2 if half else 4
    s, b, h, L, V = cfg.seq_len, cfg.micro_batch_size, cfg.n_embd, cfg.n_layer, cfg.vocab_size
    per_layer = 34 * s * b * h * act_bytes / 2
    logits = s * b * V * (act_bytes + 4 + 4)  # logits, their fp32 copy for the loss, and its gradient
    act_full = L * per_layer + logits
    act_ckpt = L * 2 * s * b * h * act_bytes / 2 * 2 + per_layer + logits  # layer inputs kept, one layer recomputed
    activations = act_ckpt if cfg.grad_checkpointing else act_full
    total = params + grads + optim + gathered + activations
    plan = {"params": params, "grads": grads, "optimizer": optim, "gathered_layer": gathered,
            "activations": activations, "activations_full": act_full, "activations_checkpointed": act_ckpt,
            "total": total, "n_params": P, "largest_layer_params": largest_layer}
    plan["deepspeed_estimate"] = deepspeed_estimate(cfg, P, largest_layer) if is_deepspeed(cfg) and half else None
    return plan


def deepspeed_estimate(cfg: Config, n_params: int, largest_layer: int) -> float | None:
    """DeepSpeed's own per-GPU model-state estimate for ZeRO-2/3 (it has none for stage 1)."""
    stage = zero_stage(cfg)
    offload = cfg.strategy.endswith("_offload")
    if stage == 2:
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

        return estimate_zero2_model_states_mem_needs(n_params, cfg.devices, cfg.num_nodes, cpu_offload=offload)[1]
    if stage == 3:
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

        return estimate_zero3_model_states_mem_needs(n_params, largest_layer, cfg.devices, cfg.num_nodes,
                                                     cpu_offload=offload, cpu_offload_params=offload)[1]
    return None


def largest_layer_params(cfg: Config) -> int:
    return max(cfg.vocab_size * cfg.n_embd, 12 * cfg.n_embd ** 2 + 13 * cfg.n_embd)


def device_memory(cfg: Config) -> float | None:
    if cfg.device_memory_gb:
        return cfg.device_memory_gb * 2**30
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory
    return None


def print_plan(cfg: Config, plan: dict) -> None:
    gib = lambda b: f"{b / 2**30:9.2f} GiB" if b >= 2**30 or b == 0 else f"{b / 2**20:9.2f} MiB"  # noqa: E731
    print(f"memory plan: {cfg.model} ({plan['n_params'] / 1e6:,.1f}M parameters), {cfg.strategy}, {cfg.precision}, "
          f"{world_size(cfg)} device(s), micro-batch {cfg.micro_batch_size} x {cfg.seq_len} tokens")
    for key in ("params", "grads", "optimizer", "gathered_layer"):
        print(f"  {key:<26}{gib(plan[key])}")
    print(f"  {'activations (no ckpt)':<26}{gib(plan['activations_full'])}")
    print(f"  {'activations (checkpointed)':<26}{gib(plan['activations_checkpointed'])}")
    print(f"  {'total per device':<26}{gib(plan['total'])}   (activations {'with' if cfg.grad_checkpointing else 'without'} checkpointing)")
    if plan["deepspeed_estimate"] is not None:
        ours = plan["params"] + plan["grads"] + plan["optimizer"] + plan["gathered_layer"]
        print(f"  model states: ours {gib(ours)}, DeepSpeed's estimator {gib(plan['deepspeed_estimate'])}")
    memory = device_memory(cfg)
    if memory is None:
        print("  fits: unknown (no GPU visible; pass --device-memory-gb to plan for one)")
    else:
        verdict = "fits" if plan["total"] < 0.9 * memory else "does NOT fit"
        print(f"  {verdict} in {memory / 2**30:.0f} GiB per device (keeping 10% for buffers and fragmentation)")


# ----------------------------------------------------------------------------- measurement
def peak_flops(device: torch.device, precision: str) -> float | None:
    """Dense peak FLOP/s of one device for this precision, or None when unknown (CPU, unlisted GPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device).lower()
    chip = ("h200" if "h200" in name else "h100 nvl" if "h100 nvl" in name else "h100 pcie" if "h100" in name and "pcie" in name
            else "h100 sxm" if "h100" in name else "a100" if "a100" in name else None)
    if chip is None:
        return None
    kind = "bf16" if "bf16" in precision else "fp16" if "16" in precision else "fp32"
    return PEAK_FLOPS[chip][kind]


def peak_memory(device: torch.device) -> dict:
    if device.type == "cuda":
        return {"max_allocated_gb": torch.cuda.max_memory_allocated(device) / 2**30,
                "max_reserved_gb": torch.cuda.max_memory_reserved(device) / 2**30}
    # ru_maxrss is in KiB on Linux: the process's peak resident memory
    return {"max_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            "rss_gb": psutil.Process().memory_info().rss / 2**30}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ----------------------------------------------------------------------------- training
def train(fabric: Fabric, cfg: Config, model, optimizer, loader, state: dict, ckpts: Checkpoints, logger,
          stop: StopRequest, total_steps: int, stop_at: int, flops: dict) -> dict:
    """Optimizer steps of `grad_accum` micro-batches each, from state["progress"]["step"] to `stop_at`."""
    progress = state["progress"]
    deepspeed = is_deepspeed(cfg)
    tokens_per_step = samples_per_step(cfg) * cfg.seq_len
    batches = itertools.islice(iter(loader), progress["step"] * cfg.grad_accum, None)
    timed_time, timed_steps, last_ckpt = 0.0, 0, None
    while progress["step"] < stop_at:
        step = progress["step"]
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, cfg, total_steps)
        sync(fabric.device)
        t0 = time.perf_counter()
        loss_sum = torch.zeros((), device=fabric.device)
        for micro in range(cfg.grad_accum):
            (tokens,) = next(batches)
            last = micro == cfg.grad_accum - 1
            # DDP: skip the gradient all-reduce until the last micro-batch. DeepSpeed counts micro-batches
            # itself (gradient_accumulation_steps), scales the loss and steps only at the boundary.
            with fabric.no_backward_sync(model, enabled=not last and not deepspeed):
                loss = model(input_ids=tokens, labels=tokens).loss
                fabric.backward(loss if deepspeed else loss / cfg.grad_accum)
            loss_sum += loss.detach()
            if deepspeed:
                # The engine counts micro-batches and steps the ZeRO optimizer only at the accumulation
                # boundary. Fabric's optimizer.step() would call the ZeRO optimizer directly, every time.
                fabric.strategy.model.step()
        if not deepspeed:
            if cfg.grad_clip:
                fabric.clip_gradients(model, optimizer, max_norm=cfg.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        sync(fabric.device)
        step_time = time.perf_counter() - t0
        progress["step"] = step = step + 1
        if step > cfg.timing_warmup:
            timed_time, timed_steps = timed_time + step_time, timed_steps + 1
        if step % cfg.log_every == 0 or step == stop_at:
            loss_value = float(fabric.all_reduce(loss_sum / cfg.grad_accum, reduce_op="mean"))
            if not math.isfinite(loss_value):
                raise NonFiniteLoss(nonfinite_message(loss_value, step, f"of {total_steps}", last_ckpt, cfg.precision))
            progress["losses"].append([step, loss_value])
            log_step(fabric, logger, cfg, step, total_steps, loss_value, step_time, tokens_per_step, flops)
        (stopping,) = stop.requested(fabric)
        if (cfg.checkpoint_every and step % cfg.checkpoint_every == 0) or stopping or step == stop_at:
            last_ckpt = ckpts.save(fabric, state, step, dataclasses.asdict(cfg))
        if stopping:
            fabric.print(f"{stop.signal_name} received: saved {last_ckpt}; resume with --resume auto --run-name {cfg.run_name}")
            return {"stopped": stop.signal_name}
    return {"timed_time_s": timed_time, "timed_steps": timed_steps}


def log_step(fabric, logger, cfg, step, total_steps, loss, step_time, tokens_per_step, flops) -> None:
    tokens_s = tokens_per_step / step_time
    metrics = {"train/loss": loss, "perf/step_time_s": step_time, "perf/tokens_per_s": tokens_s,
               "perf/tflops_per_device": flops["standard"] * tokens_s / fabric.world_size / 1e12}
    logger.log_metrics(metrics, step=step)
    warm = "" if step > cfg.timing_warmup else " (warm-up, not timed)"
    fabric.print(f"step {step:>4}/{total_steps} | loss {loss:.4f} | {1e3 * step_time:8.1f} ms | "
                 f"{tokens_s:,.0f} tok/s | {metrics['perf/tflops_per_device']:.3f} TFLOPS/device{warm}")


def summarize(fabric: Fabric, cfg: Config, result: dict, n_params: int, flops: dict, plan: dict, progress: dict) -> dict:
    """The figures of the run, measured over the timed (post-warm-up) steps of this process's life."""
    steps, seconds = result["timed_steps"], result["timed_time_s"]
    tokens_per_step = samples_per_step(cfg) * cfg.seq_len
    step_time = seconds / steps if steps else float("nan")
    tokens_s = tokens_per_step / step_time if steps else float("nan")
    per_device = lambda f: f * tokens_s / fabric.world_size / 1e12  # noqa: E731
    peak = peak_flops(fabric.device, cfg.precision)
    memory = {k: float(fabric.all_reduce(torch.tensor(v, device=fabric.device), reduce_op="max"))
              for k, v in peak_memory(fabric.device).items()}  # the largest across ranks
    return {
        "model": cfg.model, "n_params": n_params, "strategy": cfg.strategy, "precision": cfg.precision,
        "world_size": fabric.world_size, "device": str(fabric.device.type),
        "device_name": torch.cuda.get_device_name(fabric.device) if fabric.device.type == "cuda" else cpu_name(),
        "steps": progress["step"], "timed_steps": steps, "step_time_s": step_time,
        "train_time_s": progress["train_time_s"], "tokens_per_s": tokens_s, "samples_per_s": tokens_s / cfg.seq_len,
        "tflops_per_device": per_device(flops["standard"]), "tflops_per_device_8n": per_device(flops["course_8n"]),
        "mfu": per_device(flops["standard"]) * 1e12 / peak if peak and steps else None, "peak_flops": peak,
        "memory": memory, "planned_gb": plan["total"] / 2**30, "first_loss": progress["losses"][0][1] if progress["losses"] else None,
        "final_loss": progress["losses"][-1][1] if progress["losses"] else None, "losses": progress["losses"],
    }


def print_summary(fabric: Fabric, r: dict) -> None:
    mem = ", ".join(f"{k} {v:.2f}" for k, v in r["memory"].items())
    mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "unknown (no dense peak known for this device)"
    fabric.print(f"\n{'model':<22}{r['model']} ({r['n_params'] / 1e6:,.2f}M parameters)\n"
                 f"{'strategy / precision':<22}{r['strategy']} / {r['precision']} on {r['world_size']} x {r['device_name']}\n"
                 f"{'steps (timed)':<22}{r['steps']} ({r['timed_steps']})\n"
                 f"{'step time':<22}{1e3 * r['step_time_s']:.1f} ms\n"
                 f"{'throughput':<22}{r['tokens_per_s']:,.0f} tokens/s, {r['samples_per_s']:,.2f} samples/s\n"
                 f"{'TFLOPS per device':<22}{r['tflops_per_device']:.3f} (6N+attention), {r['tflops_per_device_8n']:.3f} (course, 8N)\n"
                 f"{'MFU':<22}{mfu}\n"
                 f"{'peak memory (GiB)':<22}{mem}; planned {r['planned_gb']:.2f}\n"
                 f"{'loss first / last':<22}{r['first_loss']:.4f} / {r['final_loss']:.4f}")


# ----------------------------------------------------------------------------- main
def deepspeed_allowed_on_cpu() -> bool:
    """Lightning refuses DeepSpeed off CUDA. The test suite lifts that guard (tests/deepspeed_cpu/) to run
    ZeRO for real on CPU with gloo; for users a DeepSpeed strategy needs GPUs."""
    from lightning.fabric.strategies import DeepSpeedStrategy

    return getattr(DeepSpeedStrategy.setup_environment, "cpu_allowed", False)


def validate(cfg: Config) -> None:
    """Refuse impossible settings before any model is built, each with the fix."""
    for name in ("n_embd", "n_layer", "n_head", "seq_len", "vocab_size", "num_samples", "micro_batch_size",
                 "grad_accum", "devices", "num_nodes", "log_every"):
        if getattr(cfg, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(cfg, name)}")
    if cfg.n_embd % cfg.n_head:
        raise ConfigError(f"--n-embd {cfg.n_embd} must be divisible by --n-head {cfg.n_head}")
    if cfg.dataset not in ("random", "ramp"):
        raise ConfigError(f"--dataset {cfg.dataset!r} is not one of random, ramp")
    if cfg.nvme_path and cfg.strategy != "deepspeed_stage_3_offload":
        raise ConfigError("--nvme-path offloads through DeepSpeed ZeRO-3: use it with --strategy deepspeed_stage_3_offload")
    if cfg.plan:
        return
    gpu = check_hardware(cfg.accelerator, cfg.devices, cfg.precision)
    if is_deepspeed(cfg) and not gpu and not deepspeed_allowed_on_cpu():
        raise ConfigError(f"--strategy {cfg.strategy} needs CUDA GPUs (Lightning runs DeepSpeed on CUDA only); "
                          "on CPU use --strategy ddp or auto, or run --plan to size it for GPUs")
    if cfg.strategy == "fsdp" and not gpu:
        raise ConfigError("--strategy fsdp is set up for CUDA GPUs here; on CPU use --strategy ddp")
    per_step = samples_per_step(cfg)
    if cfg.num_samples % per_step:
        raise ConfigError(f"--num-samples {cfg.num_samples} is not a multiple of the {per_step} samples per optimizer "
                          f"step (micro-batch {cfg.micro_batch_size} x accumulation {cfg.grad_accum} x "
                          f"{world_size(cfg)} processes); choose e.g. --num-samples {per_step * max(1, cfg.num_samples // per_step)}")


def parse_args(argv=None) -> Config:
    return parse_config(Config, argv, __doc__, {"model": tuple(PRESETS), "strategy": STRATEGIES, "precision": PRECISIONS,
               "dataset": ("random", "ramp")})


def main(argv=None):
    cfg = resolve(parse_args(argv))
    try:
        validate(cfg)
        if cfg.plan:
            plan = memory_plan(cfg, count_parameters(cfg), largest_layer_params(cfg))
            print_plan(cfg, plan)
            return plan
        if cfg.resume and not cfg.run_name:
            cfg.run_name = resume_run_name(cfg.resume, cfg.out_dir, "gpt")
        return run(cfg)
    except (ConfigError, ResumeError, NonFiniteLoss) as e:
        sys.exit(f"error: {e}")


def run(cfg: Config) -> dict:
    fabric = Fabric(accelerator=cfg.accelerator, devices=cfg.devices, num_nodes=cfg.num_nodes,
                    strategy=make_strategy(cfg), precision=cfg.precision)
    fabric.launch()
    cfg.run_name = fabric.broadcast(cfg.run_name or f"gpt-{cfg.model}-{cfg.strategy}-{datetime.now():%Y%m%d-%H%M%S}")
    run_dir = Path(cfg.out_dir) / cfg.run_name
    logger = TensorBoardLogger(root_dir=cfg.out_dir, name=cfg.run_name, version="")  # after launch: name agreed
    fabric.print(f"config: {dataclasses.asdict(cfg)}")

    n_params = count_parameters(cfg)
    flops = flops_per_token(cfg, n_params)
    plan = memory_plan(cfg, n_params, largest_layer_params(cfg))
    model = build_model(cfg)
    optimizer = make_optimizer(cfg, model, fabric.device)
    if cfg.compile:
        model = torch.compile(model)  # Fabric unwraps it, wraps the strategy, then compiles again
    model, optimizer = fabric.setup(model, optimizer)  # jointly: DeepSpeed wraps both in one engine
    loader = fabric.setup_dataloaders(DataLoader(make_dataset(cfg), batch_size=cfg.micro_batch_size, shuffle=False))
    # The schedule spans all of num_samples; --steps only ends the run early (it can be resumed further).
    total_steps = cfg.num_samples // samples_per_step(cfg)  # world_size(cfg) == fabric.world_size
    stop_at = min(total_steps, cfg.steps) if cfg.steps else total_steps

    progress = {"step": 0, "losses": [], "train_time_s": 0.0}
    state = {"model": model, "optimizer": optimizer, "progress": progress}
    ckpts = Checkpoints(run_dir / "checkpoints", cfg.keep_last)
    if cfg.resume:
        loaded = ckpts.load(fabric, state, cfg.resume, lambda saved: check_resume(saved, cfg))
        if loaded is None:
            raise ResumeError(f"--resume {cfg.resume}: no usable checkpoint in {ckpts.folder}")
        progress = state["progress"]
        fabric.print(f"resumed from {loaded} at step {progress['step']}")
    if fabric.is_global_zero:
        write_json_atomic(run_dir / "config.json", dataclasses.asdict(cfg))
    fabric.print(f"{n_params / 1e6:,.2f}M parameters, {stop_at} of {total_steps} optimizer steps of "
                 f"{cfg.micro_batch_size} x {cfg.grad_accum} x {fabric.world_size} samples x {cfg.seq_len} tokens")

    start = time.perf_counter()
    with StopRequest() as stop:
        result = train(fabric, cfg, model, optimizer, loader, state, ckpts, logger, stop, total_steps, stop_at, flops)
    progress["train_time_s"] += time.perf_counter() - start
    if "stopped" in result:
        sys.exit(128 + getattr(signal, result["stopped"]))  # the shell's convention for "ended by a signal"
    record = summarize(fabric, cfg, result, n_params, flops, plan, progress)
    parts = ("params", "grads", "optimizer", "gathered_layer", "activations", "total")
    record.update(config=dataclasses.asdict(cfg), env=environment(), plan_gb={k: plan[k] / 2**30 for k in parts})
    if fabric.is_global_zero:
        write_json_atomic(run_dir / "record.json", record)
        logger.log_hyperparams(dataclasses.asdict(cfg))
        logger.finalize("success")
    print_summary(fabric, record)
    return record


def check_resume(saved: dict, cfg: Config) -> None:
    if is_deepspeed(cfg) and world_size(cfg) != saved["devices"] * saved["num_nodes"]:
        raise ResumeError(f"cannot resume run {cfg.run_name}: its ZeRO checkpoint is sharded over "
                          f"{saved['devices'] * saved['num_nodes']} processes and this run has {world_size(cfg)}. Fix: resume "
                          "with the same --devices/--num-nodes, or convert it with DeepSpeed's zero_to_fp32.py (see README).")
    check_same_experiment(saved, dataclasses.asdict(cfg), RUNTIME_FIELDS, f"run {cfg.run_name}")


if __name__ == "__main__":
    main()
