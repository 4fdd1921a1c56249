"""GPT-2 (transformers) on random tokens through Lightning Fabric: data parallel, ZeRO-1/2/3 with offload,
FSDP2, tensor parallel, pipeline parallel, precision, accumulation and activation checkpointing, with
honest time/throughput/TFLOPS/MFU/memory figures. The same commands run on CPUs (gloo) and GPUs (NCCL).

    python fabric_gpt.py                                          # tiny model, single process
    python fabric_gpt.py --strategy deepspeed_stage_3 --devices 2 # ZeRO-3 on 2 processes (CPU or GPUs)
    python fabric_gpt.py --strategy tp --devices 2                # Megatron-style tensor parallel
    python fabric_gpt.py --strategy pp --devices 2 --grad-accum 4 # 2 pipeline stages, 1F1B, 4 micro-batches
    python fabric_gpt.py --model 1.6b --plan --devices 8          # memory plan per device, no training

Every run writes runs/<run-name>/record.json (config, versions, device, figures) and TensorBoard events.
Strategy builders live in strategies.py, FLOPs/peaks/memory-plan arithmetic in accounting.py.
"""

import dataclasses
import functools
import itertools
import json
import math
import sys
import time
import zlib
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
from lightning.fabric import Fabric
from torch.utils.data import DataLoader, TensorDataset

import accounting
import cpu_probe
import flags
import hf_export
import perf_model
import strategies
import text_corpus
from accounting import count_parameters, gpt2_config
from comm_counter import CommCounter
from flags import ConfigError, opt
from hardware import check_hardware, cpu_name, sdpa_kernel, uses_gpu
from ranks import check_launcher, launch
from run_state import (NonFiniteLoss, Progress, ResumeError, Run, StepTimer, StopRequest, any_rank, nonfinite_message,
                       requeue_flag, resume_flag, run_main, step_of)
from strategies import STRATEGIES, is_deepspeed

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
PRECISIONS = ("32-true", "16-mixed", "bf16-mixed", "bf16-true")


@dataclass
class Config:
    model: str = opt("tiny", "model preset", tuple(PRESETS), group="model (a preset; any dimension can be overridden)")
    n_embd: int = opt(0, "hidden size (0: the preset's)", min=0)
    n_layer: int = opt(0, "transformer blocks (0: the preset's)", min=0)
    n_head: int = opt(0, "attention heads (0: the preset's)", min=0)
    seq_len: int = opt(0, "tokens per sample (0: the preset's context length)", min=0)
    vocab_size: int = opt(0, "vocabulary size (0: the preset's)", min=2, zero=True)
    dropout: float = opt(0.0, "dropout; 0 so that strategies can be compared step for step", min=0, below=1)
    dataset: str = opt("", "random tokens (as the course; the default), ramp (x[t+1] = x[t] + 1) or text (windows of "
                       "a corpus; the default with --text or --tokenizer)", ("", "random", "ramp", "text"),
                       group="data: a fixed set of samples, the same for every strategy")
    text: str = opt("", "--dataset text: a UTF-8 file or folder of .txt files (default: Shakespeare, fetched)",
                    check=flags.Existing(optional=True))
    tokenizer: str = opt("", "--dataset text: char (the default), bpe (trained on the corpus, --vocab-size tokens) or "
                         "a saved tokenizer's path", check=flags.Existing(("char", "bpe"), optional=True))
    data_dir: str = opt("data/text", "the fetched corpus and its prepared token files", check=flags.Folder())
    num_samples: int = opt(0, "samples in all = steps x micro-batch x accumulation x data-parallel size (0: 256; "
                           "text: --steps' worth)", min=1, zero=True)
    micro_batch_size: int = opt(4, "samples per data-parallel rank per forward/backward", min=1)
    grad_accum: int = opt(1, "micro-batches per optimizer step (pp: micro-batches in flight)", min=1)
    steps: int = opt(0, "stop after this many optimizer steps (0: all of num_samples); resumable further", min=0)
    seed: int = opt(1234, "seed of the weights and the data", min=0)
    optimizer: str = opt("adamw", "adamw (betas 0.9/--beta2), or plain sgd (exact parity checks)", ("adamw", "sgd"),
                         group="optimisation")
    beta2: float = opt(0.95, "AdamW's second-moment decay (GPT-2/3 recipes 0.95; nanoGPT's small models 0.99)", min=0,
                       below=1)
    lr: float = opt(0.0, "peak learning rate (0: 5e-4 for 1.6b, as the course, else 6e-4)", min=0)
    warmup_steps: int = opt(2, "linear warm-up steps before the cosine decay", min=0)
    weight_decay: float = opt(0.1, "AdamW weight decay on matrices", min=0)
    grad_clip: float = opt(1.0, "max global gradient norm (0: off)", min=0)
    accelerator: str = opt("auto", "where it runs", ("auto", "cpu", "gpu", "cuda"), group="parallelism (Fabric)")
    devices: int = opt(1, "processes (devices) per node", min=1)
    num_nodes: int = opt(1, "nodes; Fabric reads the rank layout from torchrun/SLURM", min=1)
    node_timeout: float = opt(60.0, "seconds to wait for a node that has not joined or stopped answering", above=0,
                              max=1e6)
    strategy: str = opt("auto", "one of auto, ddp, fsdp, tp, fsdp_tp, pp, deepspeed_stage_1/2/3, "
                       "deepspeed_stage_2/3_offload (docs/gpt.md)", STRATEGIES)
    tp_size: int = opt(0, "tensor-parallel group size for tp/fsdp_tp (0: all processes)", min=0)
    pp_size: int = opt(0, "pipeline stages for pp (0: all processes)", min=0)
    pp_schedule: str = opt("1f1b", "pipeline schedule: gpipe (all forwards, then all backwards) or 1f1b", ("1f1b", "gpipe"))
    precision: str = opt("32-true", "Fabric precision", PRECISIONS, group="precision and memory")
    attention_precision: str = opt("auto", "attention's dtype in 16-bit runs; auto: float32 on a CPU where it measures "
                                   "faster", ("auto", "float32", "autocast"))
    loss_scale_power: int = opt(16, "16-mixed: initial loss scale 2^N; an overflowed step is skipped", min=0, max=40)
    nvme_path: str = opt("", "deepspeed_stage_3_offload: offload to NVMe at this folder instead of CPU RAM",
                         check=flags.Folder(optional=True))
    grad_checkpointing: bool = opt(False, "recompute activations in backward: less memory, ~1/3 more compute")
    compile: bool = opt(False, "torch.compile the model")
    plan: bool = opt(False, "print the memory and time plan and exit without training", group="planning")
    cluster: str = opt("", "plan for a100-sxm-80g, h100-sxm, h200-sxm, h100-pcie, h100-sxm-eth or cpu (here); "
                       "default: cpu on a CPU run, else the GPU's", ("", *perf_model.CLUSTERS, "cpu"))
    tokens: float = opt(0.0, "with --plan: tokens to train on, for the days and device-hours (e.g. 15e12)", min=0)
    plan_json: str = opt("", "with --plan: also write the plan as JSON to this path", check=flags.OutFile(optional=True))
    search: bool = opt(False, "rank every strategy x tp x pp x micro-batch x checkpointing x offload that fits")
    count_comms: bool = opt(False, "record one step's collectives (comm_counted in record.json) beside the plan's")
    device_memory_gb: float = opt(0.0, "memory per device for --plan (0: the visible GPU's)", min=0)
    host_memory_gb: float = opt(0.0, "host memory this machine's processes may use (0: what is available now)",
                                min=0)
    eval_every: int = opt(0, "--dataset text: optimizer steps between validation losses (0: at the end only)",
                          min=0, group="validation and samples (--dataset text)")
    eval_batches: int = opt(20, "global batches of fixed validation windows per evaluation", min=1)
    sample: bool = opt(False, "print text generated from --run-name's final weights (any strategy) and exit")
    prompt: str = opt("", "--sample: the text generation starts from (default: a newline)", check=flags.Text())
    max_new_tokens: int = opt(500, "--sample: tokens to generate", min=1)
    temperature: float = opt(0.8, "--sample: softmax temperature (lower: more conservative)", above=0)
    top_k: int = opt(200, "--sample: draw from the k likeliest tokens (0: all)", min=0)
    timing_warmup: int = opt(2, "first optimizer steps left out of time and throughput", min=0,
                             group="run, measurement and checkpoints")
    log_every: int = opt(1, "optimizer steps between log lines", min=1)
    out_dir: str = opt("runs", "folder holding one folder per run", check=flags.Folder())
    run_name: str = opt("", "run folder name (default: gpt-<model>-<strategy>-<date-time>)", check=flags.RunName())
    checkpoint_every: int = opt(0, "optimizer steps between checkpoints (0: only at the end)", min=0)
    keep_last: int = opt(2, "checkpoints kept", min=1)
    resume: str = resume_flag()
    requeue_signal: str = requeue_flag()
    export: bool = opt(False, "at the end, write runs/<run>/hf/: a Hugging Face model folder, whatever the strategy")


# grad_checkpointing: recomputing activations changes memory and time, not the numbers (tests resume across it);
# a corpus and tokenizer are compared by their SHA-256 (Run's identity), not by the paths that named them
RUNTIME_FIELDS = {"text", "tokenizer", "data_dir", "eval_every", "eval_batches", "sample", "prompt", "max_new_tokens",
                  "temperature", "top_k", "devices", "num_nodes", "node_timeout", "compile", "attention_precision", "grad_checkpointing", "count_comms", "timing_warmup", "log_every", "plan", "cluster", "tokens", "plan_json",
                  "search", "device_memory_gb", "host_memory_gb", "out_dir", "run_name",
                  "checkpoint_every", "keep_last", "resume", "requeue_signal", "steps", "accelerator", "nvme_path", "export", "loss_scale_power"}


ADDED_FIELDS = {"beta2": 0.95}  # settings newer than some checkpoints: the value those runs used


def resolve(cfg: Config) -> Config:
    """Fill the preset's dimensions and the learning rate where the flags left 0. A text run's vocabulary and
    sample count come from its corpus (resolve_text, once the process layout is known)."""
    n_embd, n_layer, n_head, seq_len, vocab = PRESETS[cfg.model]
    dataset = cfg.dataset or ("text" if cfg.text or cfg.tokenizer else "random")
    text = dataset == "text"
    return dataclasses.replace(cfg, dataset=dataset, tokenizer=cfg.tokenizer or ("char" if text else ""), n_embd=cfg.n_embd or n_embd, n_layer=cfg.n_layer or n_layer,
                               n_head=cfg.n_head or n_head, seq_len=cfg.seq_len or seq_len,
                               vocab_size=cfg.vocab_size or (0 if text else vocab),
                               num_samples=cfg.num_samples or (0 if text else 256),
                               lr=cfg.lr or (5e-4 if cfg.model == "1.6b" else 6e-4))


def resolve_text(cfg: Config) -> None:
    """--dataset text: prepare the corpus (fetched and tokenized once), then take the model's vocabulary from the
    tokenizer (or --vocab-size, when it holds every token) and the sample count from --steps."""
    if cfg.dataset != "text":
        if cfg.text or cfg.tokenizer:
            given = f"--text {cfg.text}" if cfg.text else f"--tokenizer {cfg.tokenizer}"
            raise ConfigError(f"{given} is read by --dataset text only, not --dataset {cfg.dataset}; drop one of them")
        return
    prepared = prepared_text(cfg)
    if cfg.vocab_size and cfg.vocab_size < prepared.vocab_size:
        raise ConfigError(f"--vocab-size {cfg.vocab_size} is smaller than the {prepared.vocab_size} tokens of the "
                          f"{cfg.tokenizer} tokenizer; leave --vocab-size out (the tokenizer's) or give at least that")
    for split, count in (("train", prepared.train_tokens), ("val", prepared.val_tokens)):
        if count < cfg.seq_len:
            raise ConfigError(f"the corpus {prepared.corpus} gives {count:,} {split} tokens ({'the last 10%' if split == 'val' else 'the first 90%'} "
                              f"of its {prepared.train_tokens + prepared.val_tokens:,}), fewer than one window of --seq-len "
                              f"{cfg.seq_len}; use a longer text or --seq-len {max(2, count)} or less")
    # bpe's --vocab-size is the size it was trained for (what names its prepared files), at least what it reached
    cfg.vocab_size = bpe_target(cfg) if cfg.tokenizer == "bpe" else max(cfg.vocab_size, prepared.vocab_size)
    if not cfg.num_samples:
        per_step = samples_per_step(cfg)
        cfg.num_samples = (cfg.steps or max(1, 256 // per_step)) * per_step


@functools.cache
def _prepared(text: str, tokenizer: str, vocab_size: int, data_dir: str) -> "text_corpus.Prepared":
    return text_corpus.prepare(text, tokenizer, vocab_size, data_dir)


def bpe_target(cfg: Config) -> int:
    """The vocabulary bpe is trained for: --vocab-size, else the preset's, at least 512."""
    return cfg.vocab_size or max(PRESETS[cfg.model][4], 512)


def prepared_text(cfg: Config) -> "text_corpus.Prepared":
    """The run's prepared corpus (the same object for every call with the same corpus and tokenizer)."""
    return _prepared(cfg.text, cfg.tokenizer, bpe_target(cfg) if cfg.tokenizer == "bpe" else 0, cfg.data_dir)


def samples_per_step(cfg: Config) -> int:
    """Samples in one optimizer step: micro-batch x accumulation x data-parallel size."""
    return cfg.micro_batch_size * cfg.grad_accum * strategies.data_parallel_size(cfg)


# ----------------------------------------------------------------------------- model
def build_model(cfg: Config, fabric: Fabric | None = None):
    """GPT2LMHeadModel with GPT-2's initialisation. Under ZeRO-3 (given the Fabric) it is built inside
    deepspeed.zero.Init, so that no rank ever holds it whole: each parameter is partitioned as it is created and
    then filled one gathered parameter at a time. Every other strategy builds it whole on every rank and cuts or
    shards it. Either way each weight comes from `initial_weights`, by name: the same model for every strategy."""
    from transformers import GPT2LMHeadModel

    torch.manual_seed(cfg.seed)
    partitioned = fabric is not None and strategies.zero_stage(cfg.strategy) == 3
    with fabric.init_module(empty_init=True) if partitioned else nullcontext():
        model = GPT2LMHeadModel(gpt2_config(cfg))
    fill_initial_weights(model, cfg, partitioned)
    if cfg.grad_checkpointing:
        kwargs = {"use_reentrant": False}  # the reentrant variant drops gradients of inputs without grad
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5 renamed it
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return model


def initial_weights(name: str, shape: torch.Size, cfg: Config) -> torch.Tensor:
    """transformers' GPT-2 initialisation (N(0, 0.02), c_proj weights N(0, 0.02/sqrt(2L)), zero biases, unit
    LayerNorms), each parameter drawn from its own generator seeded by the run's seed and the parameter's name,
    so that it does not depend on the order parameters are created or filled in."""
    if name.endswith(".bias"):
        return torch.zeros(shape)
    if ".ln_" in name:
        return torch.ones(shape)
    std = 0.02 / math.sqrt(2 * cfg.n_layer) if name.endswith("c_proj.weight") else 0.02
    generator = torch.Generator().manual_seed(cfg.seed * 2**32 + zlib.crc32(name.encode()))
    return torch.randn(shape, generator=generator) * std


def fill_initial_weights(model, cfg: Config, partitioned: bool) -> None:
    """Write initial_weights into every parameter; a ZeRO-3 partitioned one is gathered alone, filled on rank 0
    and partitioned again (DeepSpeed broadcasts rank 0's values): at most one whole parameter is held at once."""
    first = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    if partitioned:
        from deepspeed.runtime.zero.partition_parameters import GatheredParameters
    for name, p in model.named_parameters():
        with GatheredParameters(p, modifier_rank=0) if partitioned else nullcontext(), torch.no_grad():
            if first or not partitioned:
                p.copy_(initial_weights(name, p.shape, cfg).to(p.dtype))


# ----------------------------------------------------------------------------- data
def make_dataset(cfg: Config):
    """`num_samples` sequences fixed by the seed alone, so every strategy and world size sees the same data: random
    tokens, a ramp, or windows of the corpus at seeded random starts."""
    if cfg.dataset == "text":
        return text_corpus.Windows(prepared_text(cfg), "train", cfg.seq_len, cfg.num_samples, cfg.seed)
    g = torch.Generator().manual_seed(cfg.seed)
    if cfg.dataset == "ramp":
        start = torch.randint(0, cfg.vocab_size, (cfg.num_samples, 1), generator=g)
        tokens = (start + torch.arange(cfg.seq_len)) % cfg.vocab_size
    else:
        tokens = torch.randint(0, cfg.vocab_size, (cfg.num_samples, cfg.seq_len), generator=g)
    return TensorDataset(tokens)


def make_val_dataset(cfg: Config):
    """--eval-batches global batches of fixed validation windows (from the last 10% of the corpus)."""
    count = cfg.eval_batches * samples_per_step(cfg)
    return text_corpus.Windows(prepared_text(cfg), "val", cfg.seq_len, count, cfg.seed + 1)


# ----------------------------------------------------------------------------- optimizer
def make_optimizer(cfg: Config, model):
    """AdamW (betas 0.9/--beta2) with weight decay on matrices only, or plain SGD. Under offload the step runs
    on the CPU, where DeepSpeed requires its own vectorized CPU Adam; elsewhere torch's fused kernel where it applies."""
    params = list(model.parameters())
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, foreach=False)
    if cfg.strategy.endswith("_offload"):
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(groups, lr=cfg.lr, betas=(0.9, cfg.beta2), adamw_mode=True)
    mixed_tensors = cfg.strategy in ("tp", "fsdp_tp")  # DTensor and plain parameters cannot share one kernel
    # fused AdamW: one kernel per tensor for the whole update, on CUDA and on CPU alike (torch picks it for neither).
    # On CPU foreach is a loop of ~10 ops per tensor: 1.9 ms against fused's 0.7 ms for the nanoGPT recipe's 52
    # tensors (docs/text.md), 3% of its step. Fused unscales inside its kernel, and Fabric then
    # refuses to unscale for clipping under 16-mixed: foreach there.
    fused = not mixed_tensors and cfg.precision != "16-mixed"
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, cfg.beta2), fused=fused,
                             foreach=None if fused else not mixed_tensors)


def lr_at(step: int, cfg: Config, total_steps: int) -> float:
    """Linear warm-up, then cosine decay to 10% of the peak (a function of the step: nothing to checkpoint)."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


# ----------------------------------------------------------------------------- one optimizer step
def step_data_parallel(run: Run, model, optimizer, micro_batches) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """DDP, FSDP2, TP and single process: accumulate, then clip and step. Returns (mean loss, grad norm,
    skipped), the first two on the device, unread: under 16-mixed the loss scaler skips a step whose gradients
    overflowed and halves the scale (reading the scale is that precision's one host sync a step)."""
    fabric, cfg = run.fabric, run.cfg
    loss_sum = torch.zeros((), device=fabric.device)
    for i, tokens in enumerate(micro_batches):
        # skip the gradient all-reduce (DDP) or reduce-scatter (FSDP2) until the last micro-batch
        with fabric.no_backward_sync(model, enabled=i < len(micro_batches) - 1):
            loss = model(input_ids=tokens, labels=tokens).loss
            fabric.backward(loss / len(micro_batches))
        loss_sum += loss.detach()
    scaler = loss_scaler(fabric)
    scale = scaler.get_scale() if scaler else None
    if cfg.grad_clip and cfg.strategy in ("auto", "ddp"):
        # unscales under 16-mixed; a non-finite norm is not an error here: an overflow is the scaler's to handle, and
        # train() reports any other at its next log point (raising here would read the norm every step)
        norm = fabric.clip_gradients(model, optimizer, max_norm=cfg.grad_clip, error_if_nonfinite=False)
    elif cfg.grad_clip:
        norm = strategies.clip_grad_norm(model, cfg, fabric, cfg.grad_clip)
    else:
        if scaler:  # the optimizer Fabric steps, not its wrapper: the scaler tracks optimizers by identity
            fabric.strategy.precision.unscale_gradients(getattr(optimizer, "optimizer", optimizer))
        norm = strategies.grad_norm(model, cfg, fabric)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss_sum / len(micro_batches), norm, bool(scaler and scaler.get_scale() < scale)


def loss_scaler(fabric):
    """The GradScaler of 16-mixed (None in other precisions)."""
    return getattr(fabric.strategy.precision, "scaler", None)


def step_deepspeed(run: Run, model, optimizer, micro_batches) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """The DeepSpeed engine counts micro-batches (gradient_accumulation_steps), scales the loss, clips and
    steps the ZeRO optimizer only at the boundary, where its fp16 loss scaler may skip an overflowed step.
    Fabric's optimizer.step() would call the ZeRO optimizer directly, every micro-batch; its
    no_backward_sync does not apply."""
    fabric, engine = run.fabric, run.fabric.strategy.model
    loss_sum = torch.zeros((), device=fabric.device)
    skipped_before = engine.skipped_steps
    for tokens in micro_batches:
        loss = model(input_ids=tokens, labels=tokens).loss
        fabric.backward(loss)
        engine.step()
        loss_sum += loss.detach()
    norm = strategies.grad_norm(model, run.cfg, fabric)
    return loss_sum / len(micro_batches), norm, engine.skipped_steps > skipped_before


def through_stages(fabric, stage, call, tokens: torch.Tensor) -> list:
    """Give a pipeline schedule's `call` (step: forward and backward, or eval) this stage's part: the first stage
    feeds the tokens, the last compares with them as targets. Returns the last stage's micro-batch losses."""
    losses: list = []
    with fabric.autocast():
        call(*([tokens] if stage.first else []), **({"target": tokens, "losses": losses} if stage.last else {}))
    return losses


def step_pipeline(run: Run, model, optimizer, micro_batches, schedule) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """One pipeline step: the schedule runs every micro-batch through the stages (GPipe or 1F1B) and
    backward; then tied and data-parallel gradients are combined, clipped and stepped."""
    fabric, cfg = run.fabric, run.cfg
    mesh, stage = fabric.strategy.device_mesh, strategies.local_module(model, cfg.strategy)
    losses = through_stages(fabric, stage, schedule.step, torch.cat(micro_batches))
    strategies.sync_tied_embedding(stage, mesh)
    strategies.all_reduce_pipeline_grads(stage, mesh)
    norm = (strategies.clip_grad_norm if cfg.grad_clip else lambda m, c, f, _: strategies.grad_norm(m, c, f))(
        model, cfg, fabric, cfg.grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    # only the last stage has the loss; the others contribute 0 to the sum taken for logging
    loss = torch.stack(losses).mean().detach() if losses else torch.zeros((), device=fabric.device)
    return loss, norm, False  # 16-mixed is refused under pp: no loss scaler


def evaluate(run: Run, model, val_loader, schedule=None) -> float:
    """The mean loss over the fixed validation windows, in eval mode without gradients, under any strategy (each
    data-parallel rank takes its share; a pipeline runs the windows through its stages)."""
    fabric, cfg = run.fabric, run.cfg
    batches, total = iter(val_loader), torch.zeros((), device=fabric.device)
    model.eval()
    with torch.no_grad():
        for _ in range(cfg.eval_batches):
            micro_batches = [next(batches)[0] for _ in range(cfg.grad_accum)]
            if schedule is None:
                total += sum(model(input_ids=t, labels=t).loss.float() for t in micro_batches) / len(micro_batches)
            else:
                total += pipeline_eval_loss(fabric, model, cfg, schedule, torch.cat(micro_batches))
    model.train()
    return mean_loss(fabric, cfg, total / cfg.eval_batches)


def pipeline_eval_loss(fabric, model, cfg: Config, schedule, tokens: torch.Tensor) -> torch.Tensor:
    """A forward of the micro-batches through the stages; only the last stage has the loss (0 elsewhere)."""
    losses = through_stages(fabric, strategies.local_module(model, cfg.strategy), schedule.eval, tokens)
    return torch.stack(losses).float().mean() if losses else torch.zeros((), device=fabric.device)


# ----------------------------------------------------------------------------- training
def first_nonfinite(bad: tuple, step: int, loss: torch.Tensor, norm: torch.Tensor, skipped: bool) -> tuple:
    """(first step whose loss or gradient norm was not finite, 0 for none yet; that step's loss), kept on the device
    so that a step needs no host read. An infinite norm in a step the loss scaler skipped is the overflow it exists
    to absorb, not a failure."""
    loss = loss.detach().float()
    failed = ~torch.isfinite(loss)
    if not skipped:
        failed = failed | ~torch.isfinite(norm.to(loss.device))
    new = failed & (bad[0] == 0)
    return torch.where(new, step, bad[0]), torch.where(new, loss, bad[1])


def raise_if_nonfinite(run: Run, bad: tuple, total_steps: int) -> None:
    """NonFiniteLoss, naming the first non-finite step, where any rank had one (all ranks agree and stop)."""
    step, loss = int(bad[0]), float(bad[1])
    (any_failed,) = any_rank(run.fabric, step != 0)
    if any_failed:
        step = step or run.state["progress"].step  # another rank's failure: stopped here at this step
        raise NonFiniteLoss(nonfinite_message(loss if not math.isfinite(loss) else math.nan, step, f"of {total_steps}",
                                              run.last_checkpoint, run.cfg.precision))


STEADY_STEP = 2  # steps a process takes before its traffic repeats: DDP rebuilds its buckets in its second


def train(run: Run, model, optimizer, loader, total_steps: int, stop_at: int, flops: dict, take_step,
          validate_now=None) -> dict:
    """Optimizer steps of `grad_accum` micro-batches each, from progress.step to `stop_at`; `validate_now()` (a text
    run's validation loss) every --eval-every steps and at the end, before the checkpoint that holds it."""
    fabric, cfg = run.fabric, run.cfg
    progress: Progress = run.state["progress"]
    tokens_per_step = samples_per_step(cfg) * cfg.seq_len
    batches = itertools.islice(iter(loader), progress.step * cfg.grad_accum, None)
    steps_here, timed_time, timed_steps, comms, disk = 0, 0.0, 0, None, {}
    # (first step with a non-finite loss or gradient norm, 0 for none; its loss), on the device: first_nonfinite
    bad = (torch.zeros((), dtype=torch.long, device=fabric.device), torch.zeros((), device=fabric.device))
    timer, step_time = StepTimer(fabric.device), 0.0
    while progress.step < stop_at:
        for group in optimizer.param_groups:
            group["lr"] = lr_at(progress.step, cfg, total_steps)
        micro_batches = [next(batches)[0] for _ in range(cfg.grad_accum)]
        # a steady step is counted (the first after warm-up, and not before this process's third: DDP rebuilds its
        # buckets in its second), else the last one; not timed, as the counter slows it
        counter = CommCounter() if cfg.count_comms and comms is None and (
            steps_here == max(cfg.timing_warmup, STEADY_STEP) or progress.step + 1 == stop_at) else None
        timer.start()
        io_before = disk_io() if cfg.nvme_path else None
        with counter or nullcontext():
            loss, norm, skipped = take_step(run, model, optimizer, micro_batches)
        if io_before:  # the step's own swapping, not the checkpoints'
            disk = {k: disk.get(k, 0.0) + v - io_before[k] for k, v in disk_io().items()}
        progress.step += 1
        steps_here += 1
        # this process's own first steps are the cold ones; the step the counter slowed is not timed either
        timer.stop(timed=counter is None and steps_here > cfg.timing_warmup)
        if counter:
            steady = steps_here > STEADY_STEP
            comms = {"step": progress.step, "table": counter.table(), "steady": steady,
                     "why": f"this process's step {steps_here}: " + (
                         "the first after warm-up and set-up" if steady else "its last; the run ends before a steady "
                         "step, so one-time set-up traffic (DDP's bucket rebuild) may be in it")}
        step = progress.step
        progress.skipped_steps += skipped
        bad = first_nonfinite(bad, step, loss, norm, skipped)
        log_due = step % cfg.log_every == 0 or step == stop_at
        eval_due = validate_now and ((cfg.eval_every and step % cfg.eval_every == 0) or step == stop_at)
        save_due = (cfg.checkpoint_every and step % cfg.checkpoint_every == 0) or step == stop_at
        (stopping,) = run.stop.requested(fabric)
        if log_due or eval_due or save_due or stopping:
            # Read on the host only here (each read waits for the device): a NaN state must never be logged as
            # progress or checkpointed as "good", and the message names the first step that went wrong
            raise_if_nonfinite(run, bad, total_steps)
            for seconds, timed in timer.collect():
                progress.train_time_s += seconds
                timed_time, timed_steps = timed_time + seconds * timed, timed_steps + timed
                step_time = seconds  # the newest step's, for its log line
        if log_due:
            loss_value, norm_value = mean_loss(fabric, cfg, loss), float(norm)
            progress.losses.append([step, loss_value])
            progress.grad_norms.append([step, norm_value])
            log_step(run, step, stop_at, loss_value, norm_value, step_time, tokens_per_step, flops, skipped)
        if eval_due:
            val = validate_now()
            progress.val_losses.append([step, val])
            run.logger.log_metrics({"val/loss": val}, step=step)
            fabric.print(f"step {step:>4}/{stop_at} | val loss {val:.4f} over {cfg.eval_batches} x "
                         f"{samples_per_step(cfg)} fixed windows")
        if save_due or stopping:
            run.save(step)
        if stopping:
            raise run.stopped()
    return {"timed_time_s": timed_time, "timed_steps": timed_steps, "comms": comms, "steps_here": steps_here,
            "disk_io": disk}


def mean_loss(fabric, cfg: Config, loss: torch.Tensor) -> float:
    """The loss of the whole global batch: the mean over data-parallel ranks (TP ranks agree; under PP
    only each pipeline's last stage holds it)."""
    if cfg.strategy == "pp":
        return float(fabric.all_reduce(loss, reduce_op="sum")) / strategies.data_parallel_size(cfg)
    return float(fabric.all_reduce(loss, reduce_op="mean"))


# ----------------------------------------------------------------------------- output
def log_step(run: Run, step, stop_at, loss, norm, step_time, tokens_per_step, flops, skipped=False) -> None:
    fabric = run.fabric
    tokens_s = tokens_per_step / step_time
    metrics = {"train/loss": loss, "train/grad_norm": norm, "perf/step_time_s": step_time, "perf/tokens_per_s": tokens_s,
               "perf/tflops_per_device": flops["standard"] * tokens_s / fabric.world_size / 1e12}
    run.logger.log_metrics(metrics, step=step)
    fabric.print(f"step {step:>4}/{stop_at} | loss {loss:.4f} | grad norm {norm:.3f} | {1e3 * step_time:8.1f} ms | "
                 f"{tokens_s:,.0f} tok/s | {metrics['perf/tflops_per_device']:.3f} TFLOPS/device"
                 + (" | skipped: gradients overflowed the fp16 loss scale, which is now halved" if skipped else ""))


def summarize(fabric: Fabric, cfg: Config, result: dict, n_params: int, flops: dict, plan: dict, progress: Progress,
              peak: tuple) -> dict:
    """The figures of the run, measured over the timed (post-warm-up) steps of this process's life."""
    steps, seconds = result["timed_steps"], result["timed_time_s"]
    tokens_per_step = samples_per_step(cfg) * cfg.seq_len
    # None (null in record.json) when every step of the run was warm-up: not timed, rather than NaN
    step_time = seconds / steps if steps else None
    tokens_s = tokens_per_step / step_time if steps else None
    per_device = lambda f: f * tokens_s / fabric.world_size / 1e12 if steps else None  # noqa: E731
    peak_flops, peak_source = peak
    memory = {k: float(fabric.all_reduce(torch.tensor(v, device=fabric.device), reduce_op="max"))
              for k, v in accounting.peak_memory(fabric.device).items()}  # the largest across ranks
    return {
        "model": cfg.model, "n_params": n_params, "strategy": cfg.strategy, "precision": cfg.precision,
        "world_size": fabric.world_size, "tp_size": strategies.tp_size(cfg), "pp_size": strategies.pp_size(cfg),
        "data_parallel_size": strategies.data_parallel_size(cfg), "device": str(fabric.device.type),
        "device_name": torch.cuda.get_device_name(fabric.device) if fabric.device.type == "cuda" else cpu_name(),
        "steps": progress.step, "timed_steps": steps, "step_time_s": step_time,
        "train_time_s": progress.train_time_s, "tokens_per_s": tokens_s,
        "samples_per_s": tokens_s / cfg.seq_len if steps else None, "timing_warmup": cfg.timing_warmup,
        "tflops_per_device": per_device(flops["standard"]), "tflops_per_device_8n": per_device(flops["course_8n"]),
        "mfu": per_device(flops["standard"]) * 1e12 / peak_flops if peak_flops and steps else None,
        "peak_flops": peak_flops, "peak_flops_source": peak_source,
        "memory": memory, "planned_gb": plan["total"] / 2**30,
        "first_loss": progress.losses[0][1] if progress.losses else None,
        "final_loss": progress.losses[-1][1] if progress.losses else None,
        "losses": progress.losses, "grad_norms": progress.grad_norms, "skipped_steps": progress.skipped_steps,
        "plan_gb": {k: plan[k] / 2**30 for k in ("params", "grads", "optimizer", "master", "ddp_buckets",
                                                 "gathered_layer", "activations", "total")},
    }


def print_summary(fabric: Fabric, r: dict) -> None:
    mem = ", ".join(f"{k} {v:.2f}" for k, v in r["memory"].items())
    setup = ", ".join(f"{k} {v:.2f}" for k, v in r.get("memory_setup", {}).items())
    mfu = f"{100 * r['mfu']:.2f}% of {r['peak_flops'] / 1e12:.2f} TFLOPS ({r['peak_flops_source']})" if r["mfu"] is not None \
        else f"unknown ({r['peak_flops_source']})"
    timed = r["timed_steps"] > 0
    not_timed = (f"not timed: {r['steps']} steps here, all of them warm-up (--timing-warmup {r['timing_warmup']}); "
                 f"run more steps or lower --timing-warmup")
    fabric.print(f"\n{'model':<22}{r['model']} ({r['n_params'] / 1e6:,.2f}M parameters)\n"
                 f"{'strategy / precision':<22}{r['strategy']} / {r['precision']} on {r['world_size']} x {r['device_name']}"
                 f" (dp {r['data_parallel_size']}, tp {r['tp_size']}, pp {r['pp_size']})\n"
                 f"{'steps (timed)':<22}{r['steps']} ({r['timed_steps']})\n"
                 + (f"{'step time':<22}{1e3 * r['step_time_s']:.1f} ms\n"
                    f"{'throughput':<22}{r['tokens_per_s']:,.0f} tokens/s, {r['samples_per_s']:,.2f} samples/s\n"
                    f"{'TFLOPS per device':<22}{r['tflops_per_device']:.3f} (6N+attention), {r['tflops_per_device_8n']:.3f} (course, 8N)\n"
                    f"{'MFU':<22}{mfu}\n" if timed else f"{'step time':<22}{not_timed}\n")
                 + f"{'peak memory (GiB)':<22}{mem} in training; planned {r['planned_gb']:.3g}; set-up peak {setup}\n"
                 f"{'loss first / last':<22}{r['first_loss']:.4f} / {r['final_loss']:.4f}"
                 + (f"\n{'val loss first / last':<22}{r['val_losses'][0][1]:.4f} / {r['val_loss']:.4f} (step "
                    f"{r['val_losses'][-1][0]}; {r['text']['tokenizer']} tokenizer, {r['text']['tokenizer_vocab']} tokens)"
                    if r.get("val_losses") else "")
                 + (f"\n{'predicted step':<22}{1e3 * r['predicted']['step_time_s']:.1f} ms on {r['predicted']['cluster']} at "
                    f"efficiency {r['predicted']['efficiency']} (perf_model.py)" if r.get("predicted") else ""))


def plan_cluster(cfg: Config) -> "perf_model.Cluster":
    """--cluster, else this CPU under --accelerator cpu, else the visible GPU's node type, else the course's node;
    --device-memory-gb overrides memory."""
    name = cfg.cluster or ("cpu" if cfg.accelerator == "cpu" else "")
    if not name and torch.cuda.is_available():
        name = perf_model.cluster_of_gpu(torch.cuda.get_device_name(0)) or perf_model.DEFAULT_GPU_CLUSTER
    cluster = perf_model.cluster_named(name or perf_model.DEFAULT_GPU_CLUSTER, cfg.precision)
    if cfg.device_memory_gb:
        cluster = dataclasses.replace(cluster, memory_bytes=cfg.device_memory_gb * 2**30)
    return cluster


def print_plan(cfg: Config, plan: dict) -> None:
    gib = lambda b: f"{b / 2**30:9.2f} GiB" if b >= 2**30 or b == 0 else f"{b / 2**20:9.2f} MiB"  # noqa: E731
    print(f"memory plan: {cfg.model} ({plan['n_params'] / 1e6:,.1f}M parameters), {cfg.strategy}, {cfg.precision}, "
          f"{strategies.world_size(cfg)} device(s) (dp {strategies.data_parallel_size(cfg)}, tp {strategies.tp_size(cfg)}, "
          f"pp {strategies.pp_size(cfg)}), micro-batch {cfg.micro_batch_size} x {cfg.seq_len} tokens")
    for key in ("params", "grads", "optimizer", "master", "ddp_buckets", "gathered_layer"):
        if plan[key] or key in ("params", "grads", "optimizer"):
            print(f"  {key:<26}{gib(plan[key])}")
    print(f"  {'activations (no ckpt)':<26}{gib(plan['activations_full'])}")
    print(f"  {'activations (checkpointed)':<26}{gib(plan['activations_checkpointed'])}")
    print(f"  {'total per device':<26}{gib(plan['total'])}   (activations {'with' if cfg.grad_checkpointing else 'without'} checkpointing)")
    if plan["deepspeed_estimate"] is not None:
        ours = plan["params"] + plan["grads"] + plan["optimizer"] + plan["gathered_layer"]
        print(f"  model states: ours {gib(ours)}, DeepSpeed's estimator {gib(plan['deepspeed_estimate'])}")
    if plan["time"]["cluster"] != "cpu":  # on a CPU the devices are processes: the host line below decides
        print(f"  {'fits' if plan['fits'] else 'does NOT fit'} in {plan['memory_available_bytes'] / 2**30:.0f} GiB per device "
              f"of {plan['time']['device']} (keeping 10% for buffers and fragmentation)")


def print_time_plan(cfg: Config, t: dict) -> None:
    ms = lambda s: f"{1e3 * s:10.2f} ms"  # noqa: E731
    if t["cpu_step"]:  # this CPU, from its measurements (cpu_probe.py)
        c = t["cpu_step"]
        print(f"time plan on this CPU ({cpu_name()}), {cfg.devices} process(es) of {c['threads_per_rank']} "
              f"thread(s), from its measurements (cpu_probe.py, cached in {cpu_probe.cache_file()}):")
        for key, label in (("fixed_s", "fixed (minimal model)"), ("work_s", "work of this shape"),
                           ("optimizer_s", "optimizer sweep"), ("link_s", "bytes on the gloo link"), ("nvme_s", "NVMe")):
            print(f"  {label:<26}{ms(c[key])}")
        print(f"  {'step':<26}{ms(t['step_time_s'])}   {t['tokens_per_s']:,.0f} tokens/s, MFU {100 * t['mfu']:.1f}% of "
              f"{t['peak_flops'] / 1e9:.0f} GFLOP/s (the matmul probe)")
        return
    print(f"time plan on {cfg.num_nodes} x {cfg.devices} {t['device']} ({t['cluster']}): peak "
          f"{t['peak_flops'] / 1e12:.1f} TFLOPS x efficiency {t['efficiency']:.2f} (an input, --cluster's)")
    print(f"  {'compute':<26}{ms(t['compute_s'])}")
    print(f"  {'communication':<26}{ms(t['comm_s'])}   ({ms(t['comm_exposed_s']).strip()} not hidden behind compute)")
    if t["bubble_s"]:
        print(f"  {'pipeline bubble':<26}{ms(t['bubble_s'])}   ((p-1)/(m+p-1) of the pipeline's time, m = {cfg.grad_accum})")
    if t["offload_s"]:
        parts = ", ".join(f"{k} {v:.3g}" for k, v in t["offload"].items())
        print(f"  {'offload':<26}{ms(t['offload_s'])}   ({parts})")
    print(f"  {'step':<26}{ms(t['step_time_s'])}   {t['tokens_per_s']:,.0f} tokens/s, MFU {100 * t['mfu']:.1f}%")
    if "train_days" in t:
        print(f"  {t['tokens']:.3g} tokens: {t['train_days']:,.1f} days, {t['device_hours']:,.0f} device-hours")
    if t["comm"]:
        print(f"  transfers of one optimizer step (rank 0): {'kind':<15}{'group':>6}{'bytes':>14}{'count':>7}  link   overlaps")
        for r in t["comm"]:
            print(f"  {'':<42}{r['kind']:<15}{r['group_size']:>6}{r['bytes']:>14,}{r['count']:>7}  {r['link']:<6} {r['overlap']}")


# ----------------------------------------------------------------------------- main
def validate(cfg: Config) -> None:
    """Refuse impossible settings before any model is built, each with the flag and the fix."""
    flags.check_config(cfg)  # each flag's own range, again for a config built in Python
    if cfg.n_embd % cfg.n_head:
        raise ConfigError(f"--n-embd {cfg.n_embd} must be divisible by --n-head {cfg.n_head}")
    validate_parallel_sizes(cfg)
    resolve_text(cfg)  # the corpus's errors (missing, empty, binary, too short) before any model is built
    if cfg.nvme_path and cfg.strategy != "deepspeed_stage_3_offload":
        raise ConfigError("--nvme-path offloads through DeepSpeed ZeRO-3: use it with --strategy deepspeed_stage_3_offload")
    if cfg.nvme_path and cfg.resume:  # its load skips the optimizer state and the swapper starts AdamW anew
        raise ConfigError("--resume with --nvme-path: DeepSpeed does not bring AdamW's moments and step count back from "
                          "an NVMe-offload checkpoint, so the resumed run would not be the uninterrupted one; start the "
                          "run again, or offload to CPU memory (no --nvme-path), whose runs resume exactly")
    if cfg.optimizer == "sgd" and cfg.strategy.endswith("_offload"):
        raise ConfigError("--optimizer sgd: ZeRO-Offload steps on the CPU with DeepSpeed's CPU Adam only; use adamw")
    if cfg.plan or cfg.search:
        # a plan for this CPU computes attention as a run here would; one for GPUs in their 16-bit type
        cfg.attention_precision = resolve_attention(cfg, accounting.plans_for_gpu(cfg) or cfg.cluster not in ("", "cpu"))
        return
    # 16-mixed runs on CPU (float16 autocast, GradScaler) so that its loss-scale path can be tested without a GPU
    check_launcher(cfg.num_nodes, cfg.devices, "fabric_gpt.py")
    on_gpu = check_hardware(cfg.accelerator, cfg.devices, cfg.precision, fp16_on_cpu=not is_deepspeed(cfg.strategy))
    if cfg.nvme_path:
        strategies.prepare_nvme_offload(cfg.nvme_path, on_gpu)
    cfg.attention_precision = resolve_attention(cfg, on_gpu)
    if cfg.precision == "16-mixed" and cfg.strategy in strategies.MODEL_PARALLEL:
        raise ConfigError(f"--precision 16-mixed with --strategy {cfg.strategy}: its loss scaling is not wired through "
                          "FSDP2/TP/PP here; use bf16-mixed")
    data_bytes = cfg.num_samples * cfg.seq_len * 8  # the token ids, int64, made whole before the first step
    if cfg.dataset != "text" and data_bytes > host_available(cfg) / 4:  # text: windows of a memory-mapped file
        raise ConfigError(f"--num-samples {cfg.num_samples} x --seq-len {cfg.seq_len} tokens are {data_bytes / 2**30:.1f} "
                          f"GiB of token ids, more than a quarter of this machine's available memory; use fewer samples "
                          f"(--steps ends a run early without making its samples smaller)")
    check_host_memory(cfg, on_gpu)
    per_step = samples_per_step(cfg)
    if cfg.num_samples % per_step:
        raise ConfigError(f"--num-samples {cfg.num_samples} is not a multiple of the {per_step} samples per optimizer "
                          f"step (micro-batch {cfg.micro_batch_size} x accumulation {cfg.grad_accum} x "
                          f"{strategies.data_parallel_size(cfg)} data-parallel ranks); choose e.g. --num-samples "
                          f"{per_step * max(1, cfg.num_samples // per_step)}")


def math_dtype(cfg: Config) -> torch.dtype:
    """The dtype the run's matmuls compute in: autocast's, else the weights' (cpu_probe.compute_dtype)."""
    weights, autocast = cpu_probe.compute_dtype(cfg.precision, is_deepspeed(cfg.strategy))
    return autocast or weights


def resolve_attention(cfg: Config, on_gpu: bool) -> str:
    """--attention-precision auto as this run will compute it: float32 on a CPU where SDPA's forward and backward at
    the run's shape measure faster in float32 than in the run's 16-bit type (the CPU flash kernel's bf16 backward was
    4x its float32 time on the AVX-512 BF16 EPYC, more than bf16 matmuls save), else the 16-bit type."""
    if cfg.attention_precision != "auto":
        return cfg.attention_precision
    half = math_dtype(cfg)
    if on_gpu or half == torch.float32:
        return "autocast"
    faster = cpu_probe.float32_attention_faster(cfg.n_head // strategies.tp_size(cfg), cfg.seq_len,
                                                cfg.n_embd // cfg.n_head, cfg.micro_batch_size, half,
                                                cpu_probe.rank_threads(cfg.devices))
    return "float32" if faster else "autocast"


def device_plan(cfg: Config, on_gpu: bool, counted: tuple[int, str] | None = None) -> dict:
    """The memory plan per device of this run (accounting.memory_plan) on the accelerator it runs on; `counted` is
    count_parameters(cfg) when the caller has it."""
    n_params, attn = counted or count_parameters(cfg)
    return accounting.memory_plan(dataclasses.replace(cfg, accelerator="cuda" if on_gpu else "cpu"), n_params, attn)


def host_plan(cfg: Config, on_gpu: bool, counted: tuple[int, str] | None = None, device: dict | None = None) -> dict:
    """Host RAM per process and for this machine's processes (accounting.host_memory_plan), from the device plan
    (made here unless the caller has it)."""
    if is_deepspeed(cfg.strategy):
        import deepspeed  # noqa: F401  (imported by every rank anyway: its memory belongs to the baseline)
    device = device or device_plan(cfg, on_gpu, counted)
    return accounting.host_memory_plan(cfg, device["n_params"], device, on_gpu, accounting.process_baseline())


def host_available(cfg: Config) -> float:
    import psutil

    return cfg.host_memory_gb * 2**30 or psutil.virtual_memory().available


def host_fits(need: float, available: float) -> bool:
    return need * (1 + accounting.HOST_PLAN_MARGIN) <= available  # the plan's measured error, kept


def check_host_memory(cfg: Config, on_gpu: bool) -> None:
    """Refuse, before any model exists, a run whose processes would not fit this machine's memory (the kernel
    would kill one mid-run), naming the figures and settings that would fit. Local rank 0 decides for the machine:
    ranks launched after it would see its own memory as taken."""
    import os

    if os.environ.get("LOCAL_RANK", "0") != "0":
        return
    counted = count_parameters(cfg)  # the levers below change memory, not the model
    host, available = host_plan(cfg, on_gpu, counted), host_available(cfg)
    if host_fits(host["machine"], available):
        return
    gib = lambda b: f"{b / 2**30:.1f} GiB"  # noqa: E731
    offload = f", of which offload {gib(host['offload'])}" if host["offload"] else ""
    fixes = [f"{advice} ({gib(need)})" for advice, need in host_memory_fixes(cfg, on_gpu, available, counted)]
    margin = f"{100 * accounting.HOST_PLAN_MARGIN:.0f}%"
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


def host_memory_fixes(cfg: Config, on_gpu: bool, available: float, counted: tuple[int, str]) -> list[tuple[str, float]]:
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


def validate_parallel_sizes(cfg: Config) -> None:
    world = strategies.world_size(cfg)
    if cfg.tp_size and cfg.strategy not in ("tp", "fsdp_tp"):
        raise ConfigError(f"--tp-size applies to --strategy tp or fsdp_tp, not {cfg.strategy}; drop it or pick one of those")
    if cfg.pp_size and cfg.strategy != "pp":
        raise ConfigError(f"--pp-size applies to --strategy pp, not {cfg.strategy}; drop it or use --strategy pp")
    if cfg.strategy in ("tp", "fsdp_tp"):
        t = strategies.tp_size(cfg)
        if cfg.n_head % t:
            raise ConfigError(f"--tp-size {t} must divide the {cfg.n_head} attention heads (each rank holds whole "
                              f"heads); choose a divisor of {cfg.n_head}")
        if world % t:
            raise ConfigError(f"--tp-size {t} must divide the {world} processes; choose a divisor of {world}")
        if cfg.strategy == "tp" and t != world:
            raise ConfigError(f"--strategy tp uses all {world} processes for one tensor-parallel group; for "
                              f"--tp-size {t} with data parallel across groups use --strategy fsdp_tp")
    if cfg.strategy == "pp":
        p = strategies.pp_size(cfg)
        if p > cfg.n_layer:
            raise ConfigError(f"--pp-size {p} is larger than the {cfg.n_layer} layers: each stage needs at least one "
                              f"block; use at most {cfg.n_layer}")
        if world % p:
            raise ConfigError(f"--pp-size {p} must divide the {world} processes; choose a divisor of {world}")
        if cfg.grad_accum < p:
            raise ConfigError(f"--grad-accum {cfg.grad_accum}: a pipeline of {p} stages needs at least {p} "
                              f"micro-batches per step (they are what flows through the stages); use --grad-accum {p} or more")


def parse_args(argv=None) -> Config:
    return flags.parse_config(Config, argv, __doc__, prog="fabric_gpt.py")


def main(argv=None):
    cfg = resolve(parse_args(argv))
    if cfg.sample:
        try:
            return sample(cfg)
        except (ConfigError, FileNotFoundError, ValueError) as e:
            sys.exit(f"error: {e}")
    if cfg.plan or cfg.search:
        return run_main(cfg, "gpt", validate, plan_only, argv=argv)
    return run_main(cfg, "gpt", validate, run, errors=(strategies.PlacementError,), finished=reached_its_end, argv=argv)


def sample(cfg: Config) -> str:
    """--sample: text generated from --run-name's newest checkpoint, whatever strategy wrote it (gathered into one
    state dict in this process), with the run's own tokenizer; the context is cut to the --seq-len - 1 tokens
    whose next token training predicts."""
    from transformers import GPT2LMHeadModel

    from run_state import Checkpoints

    run_dir = Path(cfg.out_dir) / cfg.run_name
    if not cfg.run_name or not run_dir.is_dir():
        raise ConfigError(f"--sample needs --run-name of a run under {cfg.out_dir}/ (make sample RUN=<run folder>)"
                          + (f"; {run_dir} does not exist" if cfg.run_name else ""))
    if not (run_dir / "tokenizer.json").is_file():
        raise ConfigError(f"{run_dir} has no tokenizer.json: it was not trained on text, so its tokens mean nothing; "
                          "sample a run of --dataset text")
    checkpoints = Checkpoints(run_dir / "checkpoints").complete()
    if not checkpoints:
        raise ConfigError(f"{run_dir} has no complete checkpoint to sample from; train it first (or --resume auto)")
    saved = SimpleNamespace(**json.loads((checkpoints[-1] / "config.json").read_text()))
    if getattr(saved, "nvme_path", ""):
        raise ConfigError(f"{checkpoints[-1]} is an NVMe-offload checkpoint, whose weights DeepSpeed cannot read back; "
                          "train with --export and load runs/<run>/hf instead")
    model = GPT2LMHeadModel(accounting.gpt2_config(saved))
    model.load_state_dict(strategies.export_checkpoint(checkpoints[-1]), strict=False)  # lm_head: tied to wte
    model.tie_weights()
    model.eval()
    tokenizer = text_corpus.load_tokenizer(run_dir / "tokenizer.json")
    ids = text_corpus.encode_prompt(tokenizer, cfg.prompt or "\n")
    text = tokenizer.decode(generate(model, ids, cfg, saved.seq_len, tokenizer.get_vocab_size()))
    print(f"{checkpoints[-1]} (step {step_of(checkpoints[-1])}), temperature {cfg.temperature}, top-k {cfg.top_k}:\n")
    print(text)
    return text


@torch.no_grad()
def generate(model, ids: list[int], cfg: Config, context: int, vocab: int) -> list[int]:
    """Draw --max-new-tokens tokens one at a time from the softmax of the last position's logits over the
    tokenizer's vocabulary, divided by --temperature and cut to the --top-k likeliest; seeded by --seed."""
    generator = torch.Generator().manual_seed(cfg.seed)
    x = torch.tensor([ids])
    for _ in range(cfg.max_new_tokens):
        # at most context - 1 tokens: training (labels = inputs) never asks the last position for a next token
        logits = model(input_ids=x[:, -(context - 1):]).logits[:, -1, :vocab].float() / cfg.temperature
        if cfg.top_k and cfg.top_k < vocab:
            kth = torch.topk(logits, cfg.top_k).values[:, -1:]
            logits = logits.masked_fill(logits < kth, -math.inf)
        x = torch.cat([x, torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)], dim=1)
    return x[0].tolist()


def reached_its_end(record: dict, cfg: Config) -> bool:
    """An earlier run's record reached the step this command would stop at (--steps, else all of --num-samples)."""
    return record.get("steps", 0) >= schedule_steps(cfg)[1]


def schedule_steps(cfg: Config) -> tuple[int, int]:
    """(optimizer steps the schedule spans: all of num_samples, the step this command stops at: --steps or all)."""
    total = cfg.num_samples // samples_per_step(cfg)
    return total, min(total, cfg.steps) if cfg.steps else total


def plan_only(cfg: Config) -> dict:
    """--plan and --search: memory and time without training, printed and, with --plan-json, written."""
    cluster = plan_cluster(cfg)
    perf_model.check_plannable(cfg, cluster)
    if cfg.search:
        rows = perf_model.search(cfg, cluster)
        perf_model.print_search(cfg, cluster, rows)
        result = {"search": rows}
    else:
        n_params, attn = count_parameters(cfg)
        result = perf_model.full_plan(cfg, cluster, n_params, attn, cfg.tokens)
        host = host_plan(cfg, cluster.name != "cpu" and cfg.accelerator != "cpu", (n_params, attn))
        available = host_available(cfg)
        result.update(host_memory_per_process_bytes=host["per_process"], host_memory_machine_bytes=host["machine"],
                      host_memory_available_bytes=available, host_fits=host_fits(host["machine"], available))
        if cluster.name == "cpu":  # the devices are this machine's processes: their memory is the host's
            result["fits"] = result["host_fits"]
        print_plan(cfg, result)
        # on a cluster of GPUs the host is each node's, whose memory no preset holds: this machine's is no measure
        verdict = (f"on this machine: {'fits' if result['host_fits'] else 'does NOT fit'} in {available / 2**30:.1f} GiB "
                   "available") if cluster.name == "cpu" else "per node of the cluster (compare with its host memory)"
        print(f"  host memory: {host['per_process'] / 2**30:.2f} GiB per process (libraries {host['baseline'] / 2**30:.2f}, "
              f"build {host['construction'] / 2**30:.2f}, training {host['training'] / 2**30:.2f}, checkpoint "
              f"{host['checkpoint'] / 2**30:.2f}), {host['machine'] / 2**30:.2f} GiB for {cfg.devices} process(es) {verdict}")
        print_time_plan(cfg, result["time"])
    if cfg.plan_json:
        perf_model.write_json(cfg.plan_json, result)
    return result


def attention_kernel(cfg: Config, device: torch.device, implementation: str) -> str:
    """The attention kernel this run's shape gets on its device (a rank's heads under tensor parallel), in the
    dtype its matmuls run in: for the record, since PyTorch picks it silently (the 1.6B preset's head dimension 50
    is not a multiple of 8, which some kernels need)."""
    if implementation not in ("sdpa", accounting.SDPA_FLOAT32):
        return f"{implementation} (transformers' own, scores materialised)"
    # --attention-precision float32 (chosen by auto where it measured faster), else the run's matmul dtype
    dtype = torch.float32 if implementation == accounting.SDPA_FLOAT32 else math_dtype(cfg)
    heads, head_dim = cfg.n_head // strategies.tp_size(cfg), cfg.n_embd // cfg.n_head
    kernel = sdpa_kernel(device, dtype, heads, cfg.seq_len, head_dim, cfg.dropout)
    return f"SDPA {kernel}, {heads} heads x {head_dim} dims x {cfg.seq_len} positions in {str(dtype).split('.')[-1]}"


def fabric_precision(cfg: Config, on_gpu: bool) -> dict:
    """Fabric's precision arguments: 16-mixed as Fabric's own plugin with a GradScaler starting at
    2^--loss-scale-power (on CPU too, where Fabric would turn the name into bf16); other precisions, and
    DeepSpeed's own fp16 (configured in strategies.deepspeed_config), by name."""
    if cfg.precision != "16-mixed" or is_deepspeed(cfg.strategy):
        return {"precision": cfg.precision}
    from lightning.fabric.plugins import MixedPrecision

    device = "cuda" if on_gpu else "cpu"
    scaler = torch.amp.GradScaler(device, init_scale=2.0 ** cfg.loss_scale_power)
    return {"plugins": [MixedPrecision("16-mixed", device, scaler=scaler)]}


def run(cfg: Config) -> dict:
    on_gpu = uses_gpu(cfg.accelerator)
    fabric = Fabric(accelerator=cfg.accelerator, devices=cfg.devices, num_nodes=cfg.num_nodes,
                    strategy=strategies.make_strategy(cfg, on_gpu), **fabric_precision(cfg, on_gpu))
    launch(fabric, cfg.num_nodes, cfg.node_timeout)
    n_params, attn = count_parameters(cfg)
    flops = accounting.flops_per_token(cfg, n_params)
    plan = device_plan(cfg, on_gpu, (n_params, attn))
    peak = accounting.peak_flops(fabric.device, cfg.precision)  # on CPU a short matmul probe, before any model exists
    host = host_plan(cfg, on_gpu, device=plan)  # its baseline: this process before the model exists
    model = build_model(cfg, fabric)
    if cfg.compile:
        model = torch.compile(model)  # Fabric unwraps it, wraps the strategy, then compiles again
    if cfg.strategy in strategies.MODEL_PARALLEL:  # parameters are replaced while sharding: optimizer after
        model = fabric.setup_module(model)
        optimizer = fabric.setup_optimizers(make_optimizer(cfg, model))
    else:
        model, optimizer = fabric.setup(model, make_optimizer(cfg, model))  # DeepSpeed: one engine
    if not is_deepspeed(cfg.strategy):  # DeepSpeed keeps offloaded partitions on the CPU by design
        strategies.check_placement(strategies.local_module(model, cfg.strategy), fabric.device)
    # Set-up has its own peak (DeepSpeed first moves the whole fp32 model to each GPU, then partitions it):
    # kept apart, so that the training peak is what the plan predicts
    setup_peak = accounting.peak_memory(fabric.device)
    accounting.return_freed_host_memory()
    accounting.reset_peak_memory(fabric.device)
    micro = cfg.micro_batch_size
    loader = fabric.setup_dataloaders(DataLoader(make_dataset(cfg), batch_size=micro, shuffle=False))
    # The schedule spans all of num_samples; --steps only ends the run early (it can be resumed further).
    total_steps, stop_at = schedule_steps(cfg)
    take_step = step_deepspeed if is_deepspeed(cfg.strategy) else step_data_parallel
    if cfg.strategy == "pp":
        # the stage itself, not Fabric's wrapper: the schedule runs backward through autograd.grad, which
        # the wrapper refuses under mixed precision; step_pipeline applies Fabric's autocast instead
        schedule = strategies.make_pipeline_schedule(strategies.local_module(model, cfg.strategy), fabric,
                                                     fabric.strategy.device_mesh, cfg.pp_schedule, cfg.grad_accum)
        take_step = lambda r, m, o, b: step_pipeline(r, m, o, b, schedule)  # noqa: E731

    validate_now = None
    if cfg.dataset == "text":
        val_loader = fabric.setup_dataloaders(DataLoader(make_val_dataset(cfg), batch_size=micro, shuffle=False))
        validate_now = lambda: evaluate(run, model, val_loader, schedule if cfg.strategy == "pp" else None)  # noqa: E731

    progress = Progress(step=0, losses=[], grad_norms=[], train_time_s=0.0, skipped_steps=0, val_losses=[])
    # pipeline stages are saved per rank: the stage itself, not Fabric's wrapper (whose state_dict is the whole model's)
    state = {"model": strategies.local_module(model, cfg.strategy) if cfg.strategy == "pp" else model,
             "optimizer": optimizer, "progress": progress}
    run = Run(fabric, cfg, "gpt", RUNTIME_FIELDS, state, check_config=lambda saved: check_resume(saved, cfg),
              per_rank_checkpoints=cfg.strategy == "pp", identity=text_identity(cfg), added_fields=ADDED_FIELDS)
    run.start()
    if cfg.dataset == "text" and fabric.is_global_zero:  # the run carries its tokenizer: --sample and hf/ read it
        text_corpus.save_tokenizer(prepared_text(cfg), run.dir)
    fabric.print(f"{n_params / 1e6:,.2f}M parameters, steps {progress.step + 1}-{stop_at} of {total_steps}, each "
                 f"{micro} x {cfg.grad_accum} x {strategies.data_parallel_size(cfg)} samples x {cfg.seq_len} tokens; "
                 f"peak {peak[0] / 1e12:.2f} TFLOPS ({peak[1]})" if peak[0] else f"peak FLOP/s unknown ({peak[1]})")
    attention = attention_kernel(cfg, fabric.device, attn)
    fabric.print(f"attention: {attention}")
    announce_duration(fabric, cfg, n_params, peak, stop_at - progress.step)
    with StopRequest(cfg.requeue_signal) as run.stop:
        result = train(run, model, optimizer, loader, total_steps, stop_at, flops, take_step, validate_now)
    record = summarize(fabric, cfg, result, n_params, flops, plan, progress, peak)
    record["memory_setup"] = {k: float(fabric.all_reduce(torch.tensor(v, device=fabric.device), reduce_op="max"))
                              for k, v in setup_peak.items()}
    record["held_bytes"] = {k: float(fabric.all_reduce(torch.tensor(float(v), device=fabric.device), reduce_op="max"))
                            for k, v in accounting.held_bytes(strategies.local_module(model, cfg.strategy), optimizer).items()}
    record["held_bytes_planned"] = accounting.held_states_plan(cfg, n_params)
    if cfg.count_comms:
        record.update(comm_record(cfg, result["comms"], n_params))
    record["predicted"] = predicted_step(cfg, record, n_params)
    record["host_plan"] = {k: float(v) for k, v in host.items()}
    if cfg.dataset == "text":
        record["val_losses"] = progress.val_losses
        record["val_loss"] = progress.val_losses[-1][1] if progress.val_losses else None
        record["text"] = {**text_identity(cfg), "corpus": prepared_text(cfg).corpus, "tokenizer": cfg.tokenizer,
                          "tokenizer_vocab": prepared_text(cfg).vocab_size, "train_tokens": prepared_text(cfg).train_tokens,
                          "val_tokens": prepared_text(cfg).val_tokens}
    record["attention_kernel"] = attention
    record["model_build"] = "partitioned (deepspeed.zero.Init)" if strategies.zero_stage(cfg.strategy) == 3 else "whole on every rank"
    if cfg.nvme_path:  # what ZeRO-Infinity swapped during the optimizer steps, all ranks together, per step
        record["disk_io_per_step_bytes"] = {k: float(fabric.all_reduce(torch.tensor(v, dtype=torch.float64, device=fabric.device),
                                                                       reduce_op="sum")) / max(1, result["steps_here"])
                                            for k, v in result["disk_io"].items()}
    if cfg.export:
        export = strategies.export_state_dict(fabric, model, cfg)
        if fabric.global_rank == 0:
            record["exported_to"] = str(hf_export.write_hf_folder(export, cfg, run.dir / "hf"))
        del export
    record = run.finish(record)
    print_summary(fabric, record)
    return record


def text_identity(cfg: Config) -> dict:
    """What a text run's checkpoints are tied to, beside the flags: its corpus and tokenizer, by content."""
    if cfg.dataset != "text":
        return {}
    prepared = prepared_text(cfg)
    return {"corpus_sha256": prepared.corpus_sha256, "tokenizer_sha256": prepared.tokenizer_sha256}


def announce_duration(fabric: Fabric, cfg: Config, n_params: int, peak: tuple, steps: int) -> None:
    """A run that the performance model plans at over a minute says so before its first step, so that no one
    waits on a silent step. On a CPU the plan counts compute at the measured peak (communication would add)."""
    if fabric.device.type == "cuda":
        cluster = perf_model.CLUSTERS.get(perf_model.cluster_of_gpu(torch.cuda.get_device_name(fabric.device)) or "")
    else:  # this CPU's measurements when a --plan made them (cached), else compute alone: a lower bound
        cluster = perf_model.cpu_cluster(cfg.precision, peak[0], probe="cached") if peak[0] else None
    if cluster is None or steps <= 0:
        return
    plan = perf_model.time_plan(cfg, cluster, n_params)
    seconds = plan["step_time_s"] * steps
    if seconds > 60:
        lower_bound = cluster.name == "cpu" and not plan["cpu_step"]
        fabric.print(f"planned: about {duration(seconds)} for {steps} step{'s' * (steps > 1)} (perf_model.py on "
                     f"{cluster.device}{', at least' if lower_bound else ''}); Ctrl-C stops cleanly at the end of "
                     "a step with a checkpoint, and --resume auto continues", flush=True)


def duration(seconds: float) -> str:
    return (f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min" if seconds < 5400
            else f"{seconds / 3600:.1f} h")


def disk_io() -> dict:
    """Bytes this process has read from and written to storage (Linux counts DeepSpeed's O_DIRECT swapping)."""
    import psutil

    io = psutil.Process().io_counters()
    return {"read": io.read_bytes, "written": io.write_bytes}


def predicted_step(cfg: Config, record: dict, n_params: int) -> dict | None:
    """On a GPU the performance model has a preset for: its step time for these settings, beside the measured."""
    name = perf_model.cluster_of_gpu(record["device_name"]) if record["device"] == "cuda" else None
    if name is None:
        return None
    t = perf_model.time_plan(cfg, perf_model.CLUSTERS[name], n_params)
    return {"cluster": name, "efficiency": t["efficiency"], "step_time_s": t["step_time_s"],
            "tokens_per_s": t["tokens_per_s"], "mfu": t["mfu"]}


def comm_record(cfg: Config, comms: dict | None, n_params: int) -> dict:
    """What every rank issued in the counted step, rank 0's table, and the plan's for the same settings."""
    tables = [comms]
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        tables = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(tables, comms)
    return {"comm_counted_step": comms["step"] if comms else None, "comm_counted_why": comms["why"] if comms else None,
            "comm_counted": tables[0]["table"] if tables[0] else [],
            "comm_counted_by_rank": [t["table"] if t else [] for t in tables],
            "comm_planned": perf_model.comm_table(cfg)}


def check_resume(saved: dict, cfg: Config) -> None:
    """The number of processes must stay (it shards the checkpoint and sets the global batch); how they are laid
    out over nodes may change (2 processes on one node, or one on each of 2: devices and num_nodes are runtime)."""
    was, now = saved["devices"] * saved["num_nodes"], strategies.world_size(cfg)
    if now == was:
        return
    if is_deepspeed(cfg.strategy) or cfg.strategy in strategies.MODEL_PARALLEL:
        raise ResumeError(f"cannot resume run {cfg.run_name}: its {cfg.strategy} checkpoint is sharded over "
                          f"{was} processes and this run has {now}. Fix: resume "
                          "with the same --devices/--num-nodes, or export it as one state dict (strategies.export_checkpoint, see README).")
    raise ResumeError(f"cannot resume run {cfg.run_name}: it ran on {was} processes and "
                      f"this run has {now}, which changes the global batch (micro-batch x accumulation x "
                      f"data-parallel size). Fix: resume with as many processes (--devices x --num-nodes), or start a "
                      f"new run with another --run-name")


if __name__ == "__main__":
    main()
