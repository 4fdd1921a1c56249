"""GPT-2 (transformers) through Lightning Fabric: data parallel, ZeRO-1/2/3 with offload, FSDP2, tensor parallel,
pipeline parallel, precision, accumulation and activation checkpointing, on random tokens or real text, with honest
time/throughput/TFLOPS/MFU/memory figures. The same commands run on CPUs (gloo) and GPUs (NCCL).

    python fabric_gpt.py                                          # tiny model, single process
    python fabric_gpt.py --strategy deepspeed_stage_3 --devices 2 # ZeRO-3 on 2 processes (CPU or GPUs)
    python fabric_gpt.py --strategy tp --devices 2                # Megatron-style tensor parallel
    python fabric_gpt.py --strategy pp --devices 2 --grad-accum 4 # 2 pipeline stages, 1F1B, 4 micro-batches
    python fabric_gpt.py --dataset text                           # characters of Shakespeare (lab.sample reads them)
    python fabric_gpt.py --model 1.6b --plan --devices 8          # memory and time plan per device, no training

Every run writes runs/<run-name>/record.json (config, versions, device, figures) and TensorBoard events. Beneath
this script (core/): the model (gpt/gpt_model.py), the parallel layout (run/layout.py) and its builders
(gpt/strategies.py), the plans (plan/accounting.py: memory, plan/perf_model.py: time) and the figures beside them
(plan/gpt_figures.py).
"""

import dataclasses
import functools
import itertools
import math
import sys
from dataclasses import dataclass

import torch
from lightning.fabric import Fabric
from torch.utils.data import DataLoader, TensorDataset

import gelu_ext
from core.gpt import cpu_precision, hf_export, strategies, swap_files, text_corpus
from core.gpt.gpt_model import (PRESETS, attention_kernel, build_model, compile_blocks, compute_dtype, count_parameters,
                                 math_dtype, positions, resolve_attention, window_loss)
from core.plan import accounting, disk, gpt_figures, gpu_efficiency, perf_model, published
from core.run import flags
from core.run.checkpoints import ResumeError
from core.run.flags import ConfigError, opt, requeue_flag, resume_flag
from core.run.hardware import check_hardware, compile_cache_per_caps, gpu_precision, return_freed_host_memory, uses_gpu
from core.run.layout import STRATEGIES, Parallel, check_sizes, saved_config
from core.run.lifecycle import (Progress, Run, exit_without_teardown, exits, find_run, resumed_config,
                                take_resumed_choices)
from core.run.measurements import rank_threads
from core.run.ranks import agree_on_precision, check_launcher, launch, take_fabric_run_settings
from core.run.step_watch import LossWatch, StepTimer

PRECISIONS = ("32-true", "16-mixed", "bf16-mixed", "bf16-true")
DEFAULT_SAMPLES = 256  # a run without --num-samples or --steps: the course's fixed set of samples
NVME_RESUME = ("a run with --nvme-path does not resume (DeepSpeed restores no AdamW state from its checkpoints: "
               "docs/limits.md): free space and start it again under another --run-name")


@dataclass
class Config(Parallel):  # cfg.layout: the parallel layout of its flags (core/run/layout.py)
    model: str = opt("tiny", "model preset", tuple(PRESETS), group="model (a preset; any dimension can be overridden)")
    n_embd: int = opt(0, "hidden size (0: the preset's)", min=0)
    n_layer: int = opt(0, "transformer blocks (0: the preset's)", min=0)
    n_head: int = opt(0, "attention heads (0: the preset's)", min=0)
    seq_len: int = opt(0, "tokens per sample (0: the preset's context length)", min=2, zero=True)
    vocab_size: int = opt(0, "vocabulary size (0: the preset's)", min=2, zero=True)
    pad_vocab_to: int = opt(0, "embedding and head rows a multiple of this (64: 50,257 -> 50,304); the padding is "
                            "masked, never exported (0: 64 on GPUs, else 1)", min=1, max=4096, zero=True,
                            since=1)
    dropout: float = opt(0.0, "dropout; 0 so that strategies can be compared step for step", min=0, below=1)
    bias: bool = opt(True, "biases in the linear layers and LayerNorms, as GPT-2 (no: as nanoGPT's bias=False, "
                     "faster on a CPU; exported as zeros)", since=True)
    dataset: str = opt("", "random tokens (as the course; the default), ramp (x[t+1] = x[t] + 1) or text (windows of "
                       "a corpus; the default with --text or --tokenizer)", ("", "random", "ramp", "text"),
                       group="data: a fixed set of samples, the same for every strategy")
    text: str = opt("", "--dataset text: a UTF-8 file or folder of .txt files (default: Shakespeare, fetched)",
                    check=flags.Existing(optional=True), runtime=True)
    tokenizer: str = opt("", "--dataset text: char (the default), bpe (trained on the corpus, --vocab-size tokens) or "
                         "a saved tokenizer's path", check=flags.Existing(("char", "bpe"), optional=True), runtime=True)
    data_dir: str = opt("data/text", "the fetched corpus and its prepared token files", check=flags.Folder(),
                        runtime=True)
    num_samples: int = opt(0, "samples in all = steps x micro-batch x accumulation x data-parallel size (0: --steps' "
                           "worth, random tokens at least 256)", min=1, zero=True)
    micro_batch_size: int = opt(0, "samples per data-parallel rank per forward/backward (0: on a GPU the largest the "
                                "memory plan fits, else 4)", min=1, zero=True)
    grad_accum: int = opt(0, "micro-batches per optimizer step (0: 1, or under pp one per stage: the micro-batches "
                          "in flight)", min=1, zero=True)
    steps: int = opt(0, "stop after this many optimizer steps (0: all of num_samples); a larger one later extends the "
                     "run", min=0, runtime=True)
    seed: int = opt(1234, "seed of the weights and the data", min=0)
    optimizer: str = opt("adamw", "adamw (betas 0.9/--beta2), or plain sgd (exact parity checks)", ("adamw", "sgd"),
                         group="optimisation")
    beta2: float = opt(0.95, "AdamW's second-moment decay (GPT-2/3 recipes 0.95; nanoGPT's small models 0.99)", min=0,
                       below=1, since=0.95)
    lr: float = opt(0.0, "peak learning rate (0: 5e-4 for 1.6b, as the course, else 6e-4)", min=0)
    warmup_steps: int = opt(2, "linear warm-up steps before the cosine decay", min=0)
    weight_decay: float = opt(0.1, "AdamW weight decay on matrices", min=0)
    grad_clip: float = opt(1.0, "max global gradient norm (0: off)", min=0)
    accelerator: str = opt("auto", "where it runs", ("auto", "cpu", "gpu", "cuda"), group="parallelism (Fabric)",
                           runtime=True)
    devices: int = opt(1, "processes (devices) per node", min=1, runtime=True)
    num_nodes: int = opt(1, "nodes; Fabric reads the rank layout from torchrun/SLURM", min=1, runtime=True)
    node_timeout: float = opt(60.0, "seconds to wait for a node that has not joined or stopped answering", above=0,
                              max=1e6, runtime=True)
    strategy: str = opt("auto", "one of auto, ddp, fsdp, tp, fsdp_tp, pp, deepspeed_stage_1/2/3, "
                       "deepspeed_stage_2/3_offload (docs/gpt.md)", STRATEGIES)
    tp_size: int = opt(0, "tensor-parallel group size for tp/fsdp_tp (0: all processes)", min=0)
    pp_size: int = opt(0, "pipeline stages for pp (0: all processes)", min=0)
    pp_schedule: str = opt("1f1b", "pipeline schedule: gpipe (all forwards, then all backwards) or 1f1b",
                           ("1f1b", "gpipe"))
    precision: str = opt("auto", "auto (bf16-mixed on GPUs, on CPUs the faster measured), 32-true, 16-mixed, "
                         "bf16-mixed, bf16-true", ("auto", *PRECISIONS), group="precision and memory")
    attention_precision: str = opt("auto", "attention's dtype in 16-bit runs; auto: float32 on a CPU where it measures "
                                   "faster", ("auto", "float32", "autocast"), runtime=True)
    gelu_impl: str = opt("auto", "the MLP's GELU (torch: F.gelu; cpp, py: gelu_ext); auto: cpp on a CPU where "
                         "faster", ("auto", "torch", "cpp", "py"), runtime=True)
    loss_scale_power: int = opt(16, "16-mixed: initial loss scale 2^N; an overflowed step is skipped", min=0, max=40,
                                runtime=True)
    nvme_path: str = opt("", "deepspeed_stage_3_offload: offload to NVMe at this folder instead of CPU RAM",
                         check=flags.Folder(optional=True), runtime=True)
    grad_checkpointing: bool = opt(False, "recompute activations in backward: less memory, ~1/3 more compute",
                                   runtime=True)
    chunked_loss: bool | None = opt(None, "the head and its loss a chunk of tokens at a time, never the float32 "
                                    "logits of every token; auto: on GPUs (docs/gpu.md)", since=False)
    compile: bool | None = opt(None, "torch.compile the model (--compile-scope); auto: on GPUs (docs/gpu.md)",
                               runtime=True)
    compile_scope: str = opt("auto", "blocks (one graph they share: fast to compile) or model (fewer kernels); "
                             "auto: blocks on a GPU, model on a CPU",
                             ("auto", "blocks", "model"), runtime=True)
    plan: bool = opt(False, "print the memory and time plan and exit without training", group="planning", runtime=True)
    cluster: str = opt("", "plan for a100-sxm-80g, h100-sxm, h200-sxm, h100-pcie, h100-sxm-eth or cpu (here); "
                       "default: cpu on a CPU run, else the GPU's", ("", *perf_model.CLUSTERS, "cpu"), runtime=True)
    tokens: float = opt(0.0, "with --plan: tokens to train on, for the days and device-hours (e.g. 15e12)", min=0,
                        runtime=True)
    plan_framework: str = opt("", "with --plan on a GPU: whose kernels to price (default: this script's)",
                              ("", *gpu_efficiency.FRAMEWORKS), runtime=True)
    plan_json: str = opt("", "with --plan: also write the plan as JSON to this path",
                         check=flags.OutFile(optional=True), runtime=True)
    search: bool = opt(False, "rank every strategy x tp x pp x micro-batch x checkpointing x offload that fits",
                       runtime=True)
    count_comms: bool = opt(False, "record one step's collectives (comm_counted in record.json) beside the plan's",
                            runtime=True)
    device_memory_gb: float = opt(0.0, "memory per device for --plan (0: the visible GPU's)", min=0, runtime=True)
    host_memory_gb: float = opt(0.0, "host memory this machine's processes may use (0: what is available now)",
                                min=0, runtime=True)
    eval_every: int = opt(0, "--dataset text: optimizer steps between validation losses (0: at the end only)",
                          min=0, group="validation (--dataset text)", runtime=True)
    eval_batches: int = opt(20, "global batches of fixed validation windows per evaluation", min=1, runtime=True)
    timing_warmup: int = opt(2, "first optimizer steps left out of time and throughput", min=0,
                             group="run, measurement and checkpoints", runtime=True)
    log_every: int = opt(0, "optimizer steps between log lines (0: 10 on a GPU, where a log line reads the device, "
                         "else 1)", min=1, zero=True, runtime=True)
    out_dir: str = opt("runs", "folder holding one folder per run", check=flags.Folder(), runtime=True)
    run_name: str = opt("", "run folder name (default: gpt-<model>-<strategy>-<date-time>)", check=flags.RunName(),
                        runtime=True)
    checkpoint_every: int = opt(0, "optimizer steps between checkpoints (0: only at the end)", min=0, runtime=True)
    keep_last: int = opt(2, "checkpoints kept", min=1, runtime=True)
    save_at_end: bool = opt(True, "a checkpoint at the last step (no: a timing run; a stop signal still saves)",
                            runtime=True)
    resume: str = resume_flag()
    requeue_signal: str = requeue_flag()
    export: bool = opt(False, "at the end, write runs/<run>/hf/: a Hugging Face model folder, whatever the strategy",
                       runtime=True)
    export_dtype: str = opt("auto", "--export's weights (auto: the training dtype, bfloat16 for bf16 runs)",
                            ("auto", "float32", "bfloat16", "float16"), runtime=True)


def resolve(cfg: Config) -> Config:
    """Fill the preset's dimensions, the learning rate and the accumulation where the flags left 0 (a pipeline needs
    a micro-batch in flight per stage). A text run's vocabulary and sample count come from its corpus (resolve_text,
    once the process layout is known)."""
    n_embd, n_layer, n_head, seq_len, vocab = PRESETS[cfg.model]
    dataset = cfg.dataset or ("text" if cfg.text or cfg.tokenizer else "random")
    text = dataset == "text"
    cfg = dataclasses.replace(cfg, dataset=dataset, tokenizer=cfg.tokenizer or ("char" if text else ""), n_embd=cfg.n_embd or n_embd, n_layer=cfg.n_layer or n_layer,
                              n_head=cfg.n_head or n_head, seq_len=cfg.seq_len or seq_len,
                              vocab_size=cfg.vocab_size or (0 if text else vocab),
                              grad_accum=cfg.grad_accum or cfg.layout.pp_size,
                              lr=cfg.lr or (5e-4 if cfg.model == "1.6b" else 6e-4),
                              log_every=cfg.log_every or (10 if uses_gpu(cfg.accelerator) else 1),
                              compile_scope=cfg.compile_scope if cfg.compile_scope != "auto" else
                              "blocks" if for_gpu(cfg) else "model",
                              precision=gpu_precision() if cfg.precision == "auto" and for_gpu(cfg) else cfg.precision)
    levers = for_gpu(cfg) and cfg.layout.replicated and not cfg.layout.threads
    cfg = dataclasses.replace(cfg, compile=levers if cfg.compile is None else cfg.compile,
                              chunked_loss=levers if cfg.chunked_loss is None else cfg.chunked_loss,
                              pad_vocab_to=cfg.pad_vocab_to or (64 if levers else 1))
    cfg = cfg if cfg.micro_batch_size else dataclasses.replace(cfg, micro_batch_size=default_micro_batch(cfg))
    return cfg if cfg.num_samples or text else dataclasses.replace(cfg, num_samples=default_num_samples(cfg))


def default_num_samples(cfg: Config) -> int:
    """--num-samples 0: --steps' worth, a whole number of steps whatever the layout; without --steps (and for random
    tokens whatever it says) at least 256 samples, a schedule that a short --steps stops early in. A resumed run keeps
    its own when that is more (check_resume extends a run to more samples, never to fewer)."""
    per_step = max(1, samples_per_step(cfg))  # 0 where the layout is impossible: validate() refuses it later
    least = max(1, DEFAULT_SAMPLES // per_step)
    steps = cfg.steps if cfg.dataset == "text" and cfg.steps else max(cfg.steps, least)
    resumed = resumed_config(cfg.resume, cfg.out_dir, cfg.run_name, "gpt")
    own = resumed.get("num_samples", 0) if resumed.get("dataset") == cfg.dataset else 0
    whole = isinstance(own, int) and own % per_step == 0  # else another layout: the resume refuses it by name
    return max(steps * per_step, own if whole else 0)


def resolve_precision(cfg: Config) -> None:
    """--precision auto on a CPU (a GPU's is resolved with the flags): the faster of float32 and bf16 autocast for this
    run's model, timed here once per machine and shape (core/gpt/cpu_precision.py), before anything is planned with it."""
    global precision_choice
    precision_choice = None
    if cfg.precision != "auto":
        return
    if take_resumed_choices(cfg, "gpt", ("precision",)):
        precision_choice = {"choice": cfg.precision, "why": "the precision the resumed run trained in"}
        return
    makers = lambda: {p: probe_step(cfg, p) for p in cpu_precision.CANDIDATES}  # noqa: E731
    peaks = lambda: (accounting.cpu_matmul_peak("32-true"), accounting.cpu_matmul_peak("bf16-mixed"))  # noqa: E731
    precision_choice = cpu_precision.choose(cfg, rank_threads(cfg.devices), makers, peaks)
    cfg.precision = precision_choice["choice"]


precision_choice = None  # what --precision auto measured, for the start-up lines


def probe_step(cfg: Config, precision: str):
    """A training step's callable (forward, loss, backward) of this run's model cut to cpu_precision.PROBE_LAYERS
    blocks, in `precision`, with the attention and GELU the run would compute in it, on a micro-batch of random tokens.
    Those two are chosen (and measured, if they must be) here, outside the precision measurement's lock."""
    c = dataclasses.replace(cfg, precision=precision, n_layer=min(cfg.n_layer, cpu_precision.PROBE_LAYERS))
    c.attention_precision = resolve_attention(c, False)
    c.gelu_impl = resolve_gelu(c, False)

    def make():
        weights, autocast = compute_dtype(precision, c.layout.deepspeed)
        model = use_gelu(build_model(c), c.gelu_impl).to(weights)
        tokens = torch.randint(0, c.vocab_size, (c.micro_batch_size, c.seq_len))

        def step():
            with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
                loss = window_loss(model, tokens)
            loss.backward()
        return step
    return make


def for_gpu(cfg: Config) -> bool:
    """A run on GPUs, or a plan for one. Such a run takes the GPU levers by default (docs/gpu.md: a compiled model,
    its blocks sharing one graph; the chunked loss; the vocabulary padded to 64) where each is proven equal to the
    plain run, one device or DDP; not on a CPU, where compiling costs more than it saves in a short run, nor under the
    strategies that refuse or have not proven them. make gpu-check's levers row times the step with and without."""
    planned = (cfg.plan or cfg.search) and (cfg.cluster in perf_model.CLUSTERS or bool(cfg.device_memory_gb))
    return uses_gpu(cfg.accelerator) or bool(planned)


def default_micro_batch(cfg: Config) -> int:
    """--micro-batch-size 0: on a GPU (or in a plan for one) the largest power of two up to 64 whose memory plan fits
    its memory (keeping the plan's 10%) and whose global batch divides the samples; elsewhere 4."""
    memory = (cfg.device_memory_gb * 2**30 if cfg.device_memory_gb else
              perf_model.CLUSTERS[cfg.cluster].memory_bytes if cfg.cluster in perf_model.CLUSTERS else
              torch.cuda.get_device_properties(0).total_memory if uses_gpu(cfg.accelerator) and torch.cuda.is_available()
              else 0)
    if not memory:
        return 4
    counted = count_parameters(cfg)
    divides = lambda m: not cfg.num_samples or cfg.num_samples % (m * cfg.grad_accum * cfg.layout.dp_size) == 0  # noqa: E731
    fits = [m for m in (1, 2, 4, 8, 16, 32, 64) if divides(m) and accounting.memory_plan(
        dataclasses.replace(cfg, micro_batch_size=m, accelerator="cuda"), *counted)["total"] < 0.9 * memory]
    return max(fits, default=1)


def resolve_text(cfg: Config) -> None:
    """--dataset text: prepare the corpus (fetched and tokenized once), then take the model's vocabulary from the
    tokenizer (or --vocab-size, when it holds every token) and the sample count from --steps."""
    if cfg.dataset != "text":
        given = [f"{flags.flag_name(name)} {value}" for name, value in
                 (("text", cfg.text), ("tokenizer", cfg.tokenizer), ("eval_every", cfg.eval_every)) if value]
        if given:  # random tokens have no validation split to evaluate
            raise ConfigError(f"{given[0]} is read by --dataset text only, not --dataset {cfg.dataset}; "
                              "drop one of them")
        return
    prepared = prepared_text(cfg)
    if cfg.vocab_size and cfg.vocab_size < prepared.vocab_size:
        raise ConfigError(f"--vocab-size {cfg.vocab_size} is smaller than the {prepared.vocab_size} tokens of the "
                          f"{cfg.tokenizer} tokenizer; leave --vocab-size out (the tokenizer's) or give at least that")
    longest = min(prepared.train_tokens, prepared.val_tokens)  # the window both splits hold
    for split, count in (("train", prepared.train_tokens), ("val", prepared.val_tokens)):
        if count < cfg.seq_len:
            shorter = f" or --seq-len {longest} or less" if longest >= 2 else ""  # a window of 1 predicts nothing
            raise ConfigError(f"the corpus {prepared.corpus} gives {count:,} {split} tokens ({'the last 10%' if split == 'val' else 'the first 90%'} "
                              f"of its {prepared.train_tokens + prepared.val_tokens:,}), fewer than one window of --seq-len "
                              f"{cfg.seq_len}; use a longer text{shorter}")
    # bpe's --vocab-size is the size it was trained for (what names its prepared files), at least what it reached
    cfg.vocab_size = bpe_target(cfg) if cfg.tokenizer == "bpe" else max(cfg.vocab_size, prepared.vocab_size)
    cfg.num_samples = cfg.num_samples or default_num_samples(cfg)


@functools.cache
def _prepared(text: str, tokenizer: str, vocab_size: int, data_dir: str) -> "text_corpus.Prepared":
    return text_corpus.prepare(text, tokenizer, vocab_size, data_dir)


def bpe_target(cfg: Config) -> int:
    """The vocabulary bpe is trained for: --vocab-size, else the one `make text TOKENIZER=bpe` prepares."""
    return cfg.vocab_size or text_corpus.BPE_VOCAB


def prepared_text(cfg: Config) -> "text_corpus.Prepared":
    """The run's prepared corpus (the same object for every call with the same corpus and tokenizer)."""
    return _prepared(cfg.text, cfg.tokenizer, bpe_target(cfg) if cfg.tokenizer == "bpe" else 0, cfg.data_dir)


def samples_per_step(cfg: Config) -> int:
    """Samples in one optimizer step: micro-batch x accumulation x data-parallel size."""
    return cfg.micro_batch_size * cfg.grad_accum * cfg.layout.dp_size


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


def make_eval_dataset(cfg: Config, split: str):
    """--eval-batches global batches of fixed windows of a split, the validation loss's (the corpus's last 10%) or the
    training loss's estimate in eval mode (as nanoGPT's estimate_loss: comparable with it under dropout)."""
    count = cfg.eval_batches * samples_per_step(cfg)
    return text_corpus.Windows(prepared_text(cfg), split, cfg.seq_len, count, cfg.seed + (1 if split == "val" else 2))


# ----------------------------------------------------------------------------- optimizer
def make_optimizer(cfg: Config, model):
    """AdamW (betas 0.9/--beta2) with weight decay on matrices only, or plain SGD. Under offload the step runs
    on the CPU, where DeepSpeed requires its own vectorized CPU Adam; elsewhere torch's fused kernel where it applies."""
    params = list(model.parameters())
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, foreach=False)
    if cfg.layout.offload:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(groups, lr=cfg.lr, betas=(0.9, cfg.beta2), adamw_mode=True)
    mixed_tensors = cfg.layout.tensor_parallel  # DTensor and plain parameters cannot share one kernel
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
            loss = window_loss(model, tokens)
            fabric.backward(loss / len(micro_batches))
        loss_sum += loss.detach()
    scaler = loss_scaler(fabric)
    scale = scaler.get_scale() if scaler else None
    if cfg.grad_clip and cfg.layout.replicated:
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
        loss = window_loss(model, tokens)
        fabric.backward(loss)
        engine.step()
        loss_sum += loss.detach()
    norm = strategies.grad_norm(model, run.cfg, fabric)
    return loss_sum / len(micro_batches), norm, engine.skipped_steps > skipped_before


def through_stages(fabric, stage, call, tokens: torch.Tensor) -> list:
    """Give a pipeline schedule's `call` (step: forward and backward, or eval) this stage's part: the first stage
    feeds the windows' first seq_len - 1 tokens, the last compares with the tokens after each (gpt_model.window_loss).
    Returns the last stage's micro-batch losses."""
    losses: list = []
    inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    with fabric.autocast():
        call(*([inputs] if stage.first else []), **({"target": targets, "losses": losses} if stage.last else {}))
    return losses


def step_pipeline(run: Run, model, optimizer, micro_batches, schedule) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """One pipeline step: the schedule runs every micro-batch through the stages (GPipe or 1F1B) and
    backward; then tied and data-parallel gradients are combined, clipped and stepped."""
    fabric, cfg = run.fabric, run.cfg
    mesh, stage = fabric.strategy.device_mesh, strategies.local_module(model, cfg)
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


def evaluate(run: Run, model, loader, schedule=None) -> float:
    """The mean loss over fixed windows, in eval mode without gradients, under any strategy (each data-parallel rank
    takes its share; a pipeline runs the windows through its stages)."""
    fabric, cfg = run.fabric, run.cfg
    batches, total = iter(loader), torch.zeros((), device=fabric.device)
    model.eval()
    with torch.no_grad():
        for _ in range(cfg.eval_batches):
            micro_batches = [next(batches)[0] for _ in range(cfg.grad_accum)]
            if schedule is None:
                total += sum(window_loss(model, t).float() for t in micro_batches) / len(micro_batches)
            else:
                total += pipeline_eval_loss(fabric, model, cfg, schedule, torch.cat(micro_batches))
    model.train()
    return mean_loss(fabric, cfg, total / cfg.eval_batches)


def pipeline_eval_loss(fabric, model, cfg: Config, schedule, tokens: torch.Tensor) -> torch.Tensor:
    """A forward of the micro-batches through the stages; only the last stage has the loss (0 elsewhere)."""
    losses = through_stages(fabric, strategies.local_module(model, cfg), schedule.eval, tokens)
    return torch.stack(losses).float().mean() if losses else torch.zeros((), device=fabric.device)


# ----------------------------------------------------------------------------- training
def train(run: Run, model, optimizer, loader, take_step, flops: dict, evaluate_now=None) -> dict:
    """Optimizer steps of --grad-accum micro-batches each, from progress.step to the step this command stops at, as
    nanoGPT's loop: the step's learning rate, its micro-batches, the step; then at a check point (a log line, an
    evaluation, a checkpoint, a stop) what the steps since the last one left on the device, read in one transfer.
    `evaluate_now()` (a text run's validation and training losses in eval mode) runs every --eval-every steps and at
    the end."""
    fabric, cfg, progress = run.fabric, run.cfg, run.state["progress"]
    total_steps, stop_at = progress.schedule_steps, schedule_steps(cfg)[1]  # the schedule the run started with
    batches = itertools.islice(iter(loader), progress.step * cfg.grad_accum, None)
    timer, watch, probes = StepTimer(fabric.device), LossWatch(fabric, cfg.precision), gpt_figures.StepProbes(cfg, stop_at)
    timed_time, timed_steps, step_time = 0.0, 0, 0.0
    while progress.step < stop_at:
        timer.start()  # the whole iteration but its check points, as nanoGPT times its loop: the batch's fetch included
        for group in optimizer.param_groups:
            group["lr"] = lr_at(progress.step, cfg, total_steps)
        micro_batches = [next(batches)[0] for _ in range(cfg.grad_accum)]
        with probes.around(progress.step):
            loss, norm, skipped = take_step(run, model, optimizer, micro_batches)
        timer.stop(timed=probes.timed)
        progress.step += 1
        progress.skipped_steps += skipped
        watch.add(progress.step, loss, norm, skipped)
        step = progress.step
        log_due = step % cfg.log_every == 0 or step == stop_at
        eval_due = evaluate_now and ((cfg.eval_every and step % cfg.eval_every == 0) or step == stop_at)
        save_due = (cfg.checkpoint_every and step % cfg.checkpoint_every == 0) or (step == stop_at and cfg.save_at_end)
        (stopping,) = run.stop.requested(fabric)
        if not (log_due or eval_due or save_due or stopping):
            continue
        # a NaN state is never logged as progress or checkpointed as good; the error names its first step
        last = watch.read(f"of {total_steps}", run.last_checkpoint, step)[-1]
        for seconds, timed in timer.collect():
            progress.train_time_s += seconds
            timed_time, timed_steps, step_time = timed_time + seconds * timed, timed_steps + timed, seconds
        if log_due:
            loss_value = mean_loss(fabric, cfg, last.loss)
            progress.losses.append([step, loss_value])
            progress.grad_norms.append([step, last.norm])
            log_step(run, step, stop_at, loss_value, last.norm, step_time, flops, skipped)
        if eval_due:
            val, train_eval = evaluate_now()
            progress.val_losses.append([step, val])
            progress.train_losses_eval.append([step, train_eval])
            run.logger.log_metrics({"val/loss": val, "train/loss_eval": train_eval}, step=step)
            fabric.print(f"step {step:>4}/{stop_at} | val loss {val:.4f} | train loss {train_eval:.4f} (eval mode; "
                         f"{cfg.eval_batches} x {samples_per_step(cfg)} fixed windows each)")
            stopping = stopping or run.stop.requested(fabric)[0]  # a signal during it: stop at this step
        if save_due or stopping:
            run.save(step)
            stopping = stopping or (step < stop_at and run.stop.requested(fabric)[0])  # during the save: this one
        if stopping:
            raise run.stopped()
    return {"timed_time_s": timed_time, "timed_steps": timed_steps, "comms": probes.comms,
            "steps_here": probes.steps_here, "disk_io": probes.disk}


def mean_loss(fabric, cfg: Config, loss) -> float:
    """The loss of the whole global batch: the mean over data-parallel ranks (TP ranks agree; under PP
    only each pipeline's last stage holds it)."""
    loss = torch.as_tensor(loss, dtype=torch.float32, device=fabric.device)
    if cfg.layout.pipeline:
        return float(fabric.all_reduce(loss, reduce_op="sum")) / cfg.layout.dp_size
    return float(fabric.all_reduce(loss, reduce_op="mean"))


# ----------------------------------------------------------------------------- output
def log_step(run: Run, step, stop_at, loss, norm, step_time, flops, skipped=False) -> None:
    fabric, cfg = run.fabric, run.cfg
    samples_s = samples_per_step(cfg) / step_time
    tokens_s = samples_s * positions(cfg)  # the tokens trained on: a window predicts its next seq_len - 1
    tflops = flops["standard"] * samples_s * positions(cfg) / fabric.world_size / 1e12
    metrics = {"train/loss": loss, "train/grad_norm": norm, "perf/step_time_s": step_time, "perf/tokens_per_s": tokens_s,
               "perf/tflops_per_device": tflops}
    run.logger.log_metrics(metrics, step=step)
    fabric.print(f"step {step:>4}/{stop_at} | loss {loss:.4f} | grad norm {norm:.3f} | {1e3 * step_time:8.1f} ms | "
                 f"{tokens_s:,.0f} tok/s | {tflops:.3f} TFLOPS/device"
                 + (" | skipped: gradients overflowed the fp16 loss scale, which is now halved" if skipped else ""))


def validate(cfg: Config) -> None:
    """Refuse impossible settings before any model is built, each with the flag and the fix."""
    flags.check_config(cfg)  # each flag's own range, again for a config built in Python
    check_flags_the_run_reads(cfg)
    if cfg.n_embd % cfg.n_head:
        raise ConfigError(f"--n-embd {cfg.n_embd} must be divisible by --n-head {cfg.n_head}")
    check_sizes(cfg)
    resolve_text(cfg)  # the corpus's errors (missing, empty, binary, too short) before any model is built
    lay = cfg.layout
    if cfg.nvme_path and not (lay.offload and lay.zero_stage == 3):
        raise ConfigError("--nvme-path offloads through DeepSpeed ZeRO-3: use it with --strategy deepspeed_stage_3_offload")
    if cfg.nvme_path and cfg.resume:  # its load skips the optimizer state and the swapper starts AdamW anew
        raise ConfigError("--resume with --nvme-path: DeepSpeed does not bring AdamW's moments and step count back from "
                          "an NVMe-offload checkpoint, so the resumed run would not be the uninterrupted one; start the "
                          "run again, or offload to CPU memory (no --nvme-path), whose runs resume exactly")
    if cfg.chunked_loss and (lay.zero_stage == 3 or lay.tensor_parallel or lay.pipeline):
        raise ConfigError(f"--chunked-loss reads the head's weight in the model's own forward, which --strategy "
                          f"{cfg.strategy} gathers per module or splits; use it with auto, ddp, fsdp or ZeRO-1/2")
    if cfg.compile and lay.zero_stage == 3:  # measured, both scopes: its hooks recompiled per module, left eager
        raise ConfigError("--compile with ZeRO-3: DeepSpeed's hooks that gather each module's parameters run inside "
                          "the compiled code, and torch.compile recompiles them per module until its limit; use "
                          "--strategy fsdp (its blocks compile) or ZeRO-1/2, or drop --compile")
    if cfg.optimizer == "sgd" and lay.offload:
        raise ConfigError("--optimizer sgd: ZeRO-Offload steps on the CPU with DeepSpeed's CPU Adam only; use adamw")
    if cfg.gelu_impl in ("cpp", "py") and lay.tensor_parallel:
        raise ConfigError(f"--gelu-impl {cfg.gelu_impl} with --strategy {cfg.strategy}: the lab's GELU operator has no "
                          "sharding rule for tensor parallelism's DTensors; use --gelu-impl torch (or auto)")
    if cfg.plan or cfg.search:
        resolve_precision(cfg)
        # a plan for this CPU computes attention as a run here would; one for GPUs in their 16-bit type
        cfg.attention_precision = resolve_attention(cfg, accounting.plans_for_gpu(cfg) or cfg.cluster not in ("", "cpu"))
        return
    check_launcher(cfg.num_nodes, cfg.devices, "fabric_gpt.py")
    # 16-mixed runs on CPU (float16 autocast, GradScaler) so that its loss-scale path can be tested without a GPU;
    # auto never chooses it there
    on_gpu = check_hardware(cfg.accelerator, cfg.devices, cfg.precision, fp16_on_cpu=not lay.deepspeed)
    if cfg.nvme_path:
        strategies.prepare_nvme_offload(cfg.nvme_path, on_gpu)
    check_samples(cfg)
    # auto's two choices keep float32 weights: the same bytes on disk
    disk.check_disk(cfg, disk_plan(cfg))  # the first checkpoint (and the NVMe folder) fit, or nothing is built
    resolve_precision(cfg)  # after every refusal it does not change (it times a cut model); the rest plans with it
    if not on_gpu:  # a resumed CPU run's own attention dtype and GELU, the C++ one where resolve_gelu could pick it
        measurable = not (cfg.compile or cfg.layout.tensor_parallel) and gelu_ext.is_built()
        take_resumed_choices(cfg, "gpt", ("attention_precision", "gelu_impl"), lambda name, value:
                             name != "gelu_impl" or value == "torch" or value == "cpp" and measurable)
    cfg.attention_precision = resolve_attention(cfg, on_gpu)
    cfg.gelu_impl = resolve_gelu(cfg, on_gpu)
    if cfg.precision == "16-mixed" and lay.model_parallel:
        raise ConfigError(f"--precision 16-mixed with --strategy {cfg.strategy}: its loss scaling is not wired through "
                          "FSDP2/TP/PP here; use bf16-mixed")
    accounting.check_host_memory(cfg, on_gpu)


PLAN_ONLY = ("cluster", "device_memory_gb", "tokens", "plan_framework", "plan_json")  # read by --plan/--search only


def check_flags_the_run_reads(cfg: Config) -> None:
    """A flag given a value that this run would not read is refused rather than ignored. A training run runs on the
    hardware it finds (--cluster or --device-memory-gb would size its default micro-batch for other hardware)."""
    given = [(name, getattr(cfg, name)) for name in PLAN_ONLY if getattr(cfg, name)]
    if given and not (cfg.plan or cfg.search):
        name, value = given[0]
        flag = f"{flags.flag_name(name)} {f'{value:g}' if isinstance(value, float) else value}"
        raise ConfigError(f"{flag} is read by --plan and --search only, and this is a training run; add --plan "
                          "(or --search) to plan for it, or drop it")
    default = {f.name: f.default for f in dataclasses.fields(Config)}
    if cfg.export_dtype != default["export_dtype"] and not cfg.export:
        raise ConfigError(f"--export-dtype {cfg.export_dtype} is the dtype of --export's folder; add --export, or "
                          "drop it (make export RUN=<run> writes a finished run's folder)")
    if cfg.loss_scale_power != default["loss_scale_power"] and cfg.precision not in ("16-mixed", "auto"):
        raise ConfigError(f"--loss-scale-power {cfg.loss_scale_power} scales float16's loss and --precision "
                          f"{cfg.precision} has no loss scaling; use --precision 16-mixed, or drop it")
    if cfg.pp_schedule != default["pp_schedule"] and not cfg.layout.pipeline:
        raise ConfigError(f"--pp-schedule {cfg.pp_schedule} applies to --strategy pp, not {cfg.strategy}; drop it or "
                          "use --strategy pp")
    if cfg.beta2 != default["beta2"] and cfg.optimizer != "adamw":
        raise ConfigError(f"--beta2 {cfg.beta2:g} is AdamW's second-moment decay and --optimizer {cfg.optimizer} has "
                          "none; use --optimizer adamw, or drop it")


def check_samples(cfg: Config) -> None:
    """The sample set fits in memory, is whole optimizer steps and holds --steps."""
    data_bytes = cfg.num_samples * cfg.seq_len * 8  # the token ids, int64, made whole before the first step
    if cfg.dataset != "text" and data_bytes > accounting.host_available(cfg) / 4:  # text: windows of a memory-mapped file
        raise ConfigError(f"--num-samples {cfg.num_samples} x --seq-len {cfg.seq_len} tokens are {data_bytes / 2**30:.1f} "
                          f"GiB of token ids, more than a quarter of this machine's available memory; use fewer samples "
                          f"(--num-samples; without it a run takes --steps' worth), or --dataset text, whose "
                          f"windows are read from a memory-mapped file")
    per_step = samples_per_step(cfg)
    if cfg.num_samples % per_step:
        raise ConfigError(f"--num-samples {cfg.num_samples} is not a multiple of the {per_step} samples per optimizer "
                          f"step (micro-batch {cfg.micro_batch_size} x accumulation {cfg.grad_accum} x "
                          f"{cfg.layout.dp_size} data-parallel ranks); choose e.g. --num-samples "
                          f"{per_step * max(1, cfg.num_samples // per_step)}")
    if cfg.steps > cfg.num_samples // per_step:
        raise ConfigError(f"--steps {cfg.steps} is more than the {cfg.num_samples // per_step} optimizer steps that "
                          f"--num-samples {cfg.num_samples} holds at {per_step} samples a step; give --num-samples "
                          f"{cfg.steps * per_step}, or leave it out: it is --steps' worth by default")


# ----------------------------------------------------------------------------- main
def parse_args(argv=None) -> Config:
    cfg = flags.parse_config(Config, argv, __doc__, prog="fabric_gpt.py")
    # under `fabric run`: its --devices and the rest where the command line left the defaults
    cfg = take_fabric_run_settings(cfg, sys.argv[1:] if argv is None else [str(a) for a in argv])
    resolved = resolve(cfg)
    if cfg.compile_scope != "auto" and not resolved.compile:  # resolve() names auto's scope: told apart only here
        raise ConfigError(f"--compile-scope {cfg.compile_scope} is how --compile compiles, and this run is not "
                          "compiled; add --compile, or drop it")
    return resolved


def main(argv=None) -> dict:
    with exits(strategies.PlacementError) as stop:  # an expected failure is one line `error: ...`
        cfg = parse_args(argv)
        validate(cfg)
        if cfg.plan or cfg.search:
            # on a CPU its step is timed by running this script; on a GPU preset the nearest published run beside it
            return perf_model.plan(cfg, step_script=__file__, beside=published.beside_the_plan)
        if (finished := find_run(cfg, "gpt", reached_its_end, text_identity(cfg))) is not None:
            return finished  # --resume auto of a run that already reached its end: nothing to train
        stop.listen(cfg.requeue_signal)  # from here a signal saves and stops the run, or lets its record finish
        on_gpu = uses_gpu(cfg.accelerator)
        fabric = Fabric(accelerator=cfg.accelerator, devices=cfg.devices, num_nodes=cfg.num_nodes,
                        strategy=strategies.make_strategy(cfg, on_gpu), **fabric_precision(cfg, on_gpu))
        launch(fabric, cfg.num_nodes, cfg.node_timeout)
        agree_on_precision(fabric, cfg.precision)
        n_params, attn = count_parameters(cfg)
        plan = accounting.device_plan(cfg, on_gpu, (n_params, attn))
        peak = accounting.peak_flops(fabric.device, cfg.precision)  # on CPU a short matmul probe, before any model
        host = accounting.host_plan(cfg, on_gpu, device=plan)  # its baseline: this process before the model exists
        model, optimizer, setup_peak = setup_model(fabric, cfg)
        loader = fabric.setup_dataloaders(DataLoader(make_dataset(cfg), batch_size=cfg.micro_batch_size))
        take_step, evaluate_now = steps_of_the_strategy(fabric, cfg, model)
        progress = Progress(step=0, losses=[], grad_norms=[], train_time_s=0.0, skipped_steps=0, val_losses=[],
                            train_losses_eval=[], schedule_steps=schedule_steps(cfg)[0])
        # pipeline stages are saved per rank: the stage itself, not Fabric's wrapper (whose state is the whole model)
        state = {"model": strategies.local_module(model, cfg) if cfg.layout.pipeline else model,
                 "optimizer": optimizer, "progress": progress}
        run = Run(fabric, cfg, "gpt", state, stop, check_config=lambda saved: check_resume(saved, cfg),
                  per_rank_checkpoints=cfg.layout.pipeline, identity=text_identity(cfg),
                  checkpoint_bytes=disk_plan(cfg)["checkpoint"], not_resumable=NVME_RESUME if cfg.nvme_path else "")
        on_disk = disk_plan(cfg)  # again, in the folder Run has named
        run.start()  # resume from the newest good checkpoint, or start
        announce(run, n_params, peak, attn, on_disk)
        timing = train(run, model, optimizer, loader, take_step, accounting.flops_per_token(cfg, n_params),
                       evaluate_now and functools.partial(evaluate_now, run))
        record = gpt_figures.measured(fabric, cfg, timing, n_params, plan, progress, peak)
        held = accounting.held_bytes(strategies.local_module(model, cfg), optimizer)
        record.update(gpt_figures.beside_the_plan(fabric, cfg, record, timing, n_params, held, setup_peak, host))
        record.update(text_record(cfg, progress), attention_kernel=attention_kernel(cfg, fabric.device, attn),
                      model_build="partitioned (deepspeed.zero.Init)" if cfg.layout.zero_stage == 3 else
                      "whole on every rank", disk_planned=on_disk)
        if cfg.export:
            record["exported_to"] = export(fabric, cfg, model, run)
        record = run.finish(record, trained=timing["steps_here"] > 0)
    gpt_figures.print_summary(fabric, record)
    return record


def setup_model(fabric: Fabric, cfg: Config):
    """The model and its optimizer set up by Fabric for the strategy; the set-up's own peak memory (DeepSpeed first
    moves the whole fp32 model to each GPU, then partitions it), kept apart so that the training peak is what the
    plan predicts."""
    model = use_gelu(build_model(cfg, fabric), cfg.gelu_impl)
    if cfg.compile:
        compile_cache_per_caps()
        if cfg.compile_scope == "blocks":
            compile_blocks(model)
        else:  # the text recipe on the AVX2 EPYC: 14.6k tokens/s compiled whole against 12.6k by blocks (docs/text.md)
            model = torch.compile(model)  # Fabric unwraps it, wraps the strategy, then compiles again
    if cfg.layout.model_parallel:  # parameters are replaced while sharding: the optimizer after
        model = fabric.setup_module(model)
        optimizer = fabric.setup_optimizers(make_optimizer(cfg, model))
    else:
        model, optimizer = fabric.setup(model, make_optimizer(cfg, model))  # DeepSpeed: one engine
    if not cfg.layout.deepspeed:  # DeepSpeed keeps offloaded partitions on the CPU by design
        strategies.check_placement(strategies.local_module(model, cfg), fabric.device)
    if cfg.nvme_path:  # the float32 partition, swapped out as the model was set up
        swap_files.note_if_short(fabric, cfg.nvme_path)
    setup_peak = accounting.peak_memory(fabric.device)
    return_freed_host_memory()
    accounting.reset_peak_memory(fabric.device)
    return model, optimizer, setup_peak


def use_gelu(model, impl: str):
    """The MLPs' GELU from gelu_ext where --gelu-impl names it; the config still names transformers'
    gelu_pytorch_tanh, so an exported hf/ folder loads anywhere."""
    if impl in ("cpp", "py"):
        for block in model.transformer.h:
            block.mlp.act = gelu_ext.GELU(impl, "tanh")
    return model


def steps_of_the_strategy(fabric: Fabric, cfg: Config, model):
    """(take_step, evaluate_now or None): the optimizer step of the strategy (a pipeline's schedule drives its
    stages), and a text run's validation loss over its fixed windows."""
    take_step, schedule = step_deepspeed if cfg.layout.deepspeed else step_data_parallel, None
    if cfg.nvme_path:  # a swap file written short on a full disk is noted before the next swap-in reads it
        take_step = lambda run, *a: (step_deepspeed(run, *a), swap_files.note_if_short(fabric, cfg.nvme_path))[0]  # noqa: E731
    if cfg.layout.pipeline:
        # the stage itself, not Fabric's wrapper: the schedule runs backward through autograd.grad, which
        # the wrapper refuses under mixed precision; step_pipeline applies Fabric's autocast instead
        schedule = strategies.make_pipeline_schedule(strategies.local_module(model, cfg), fabric,
                                                     fabric.strategy.device_mesh, cfg.pp_schedule, cfg.grad_accum)
        take_step = functools.partial(step_pipeline, schedule=schedule)
    if cfg.dataset != "text":
        return take_step, None
    val, train = (fabric.setup_dataloaders(DataLoader(make_eval_dataset(cfg, split), batch_size=cfg.micro_batch_size))
                  for split in ("val", "train"))
    return take_step, lambda run: (evaluate(run, model, val, schedule), evaluate(run, model, train, schedule))


def announce(run: Run, n_params: int, peak: tuple, attn: str, on_disk: dict) -> None:
    """The run's size, the attention kernel it gets, the disk it writes and, when over a minute, its planned
    duration."""
    fabric, cfg, progress = run.fabric, run.cfg, run.state["progress"]
    if cfg.dataset == "text" and fabric.is_global_zero:  # the run carries its tokenizer: lab.sample and hf/ read it
        text_corpus.save_tokenizer(prepared_text(cfg), run.dir)
    total_steps, stop_at = progress.schedule_steps, schedule_steps(cfg)[1]
    steps = (f"steps {progress.step + 1}-{stop_at}" if stop_at > progress.step else f"no step left: the run is at step "
             f"{progress.step} and this command ends it at {stop_at} (a larger --steps goes on)")
    span = (f"of {total_steps}" if stop_at <= total_steps else
            f"past its schedule of {total_steps} (the learning rate stays at the schedule's end)")
    fabric.print(f"{n_params / 1e6:,.2f}M parameters, {steps} {span}, each "
                 f"{cfg.micro_batch_size} x {cfg.grad_accum} x {cfg.layout.dp_size} samples x {cfg.seq_len} tokens; "
                 f"peak {peak[0] / 1e12:.2f} TFLOPS ({peak[1]})" if peak[0] else f"peak FLOP/s unknown ({peak[1]})")
    fabric.print(f"attention: {attention_kernel(cfg, fabric.device, attn)}")
    fabric.print(gelu_note(cfg))
    if precision_choice:
        fabric.print(cpu_precision.note(precision_choice))
    disk.print_disk_plan(cfg, on_disk, fabric.print)
    gpt_figures.announce_duration(fabric, cfg, n_params, peak, stop_at - progress.step)


def resolve_gelu(cfg: Config, on_gpu: bool) -> str:
    """--gelu-impl auto: on a CPU the lab's C++ tanh GELU where it is built (make setup) and measured faster at the
    run's MLP shape than F.gelu, whose tanh form took 3.6x its exact form's time on an AVX-512 BF16 Xeon (docs/gelu.md);
    F.gelu on GPUs, under --compile (Inductor fuses it) and tensor parallelism (the op has no DTensor rule)."""
    if cfg.gelu_impl != "auto" or on_gpu or cfg.compile or cfg.layout.tensor_parallel or not gelu_ext.is_built():
        return "torch" if cfg.gelu_impl == "auto" else cfg.gelu_impl
    speeds = gelu_speeds(cfg)
    return "cpp" if speeds["cpp_s"] < speeds["torch_s"] else "torch"


def gelu_shape(cfg: Config) -> tuple[int, int]:
    """(tokens, width) of one micro-batch's MLP activation."""
    return cfg.micro_batch_size * positions(cfg), 4 * cfg.n_embd


def gelu_speeds(cfg: Config, allow_measure: bool = True) -> dict | None:
    """Both tanh GELUs timed at this run's MLP shape, in the dtype it computes in, with a rank's threads (cached)."""
    return gelu_ext.tanh_speeds(*gelu_shape(cfg), math_dtype(cfg), rank_threads(cfg.devices), allow_measure)


def gelu_note(cfg: Config) -> str:
    """What computes the MLP's GELU, and the measurement auto chose by, for the start-up lines."""
    names = {"cpp": "the lab's C++ operator (gelu_ext)", "py": "the lab's Python Function (gelu_ext)"}
    speeds = gelu_speeds(cfg, allow_measure=False)
    measured = (f"; forward and backward at {' x '.join(map(str, gelu_shape(cfg)))}: C++ {1e3 * speeds['cpp_s']:.2f} "
                f"ms, F.gelu {1e3 * speeds['torch_s']:.2f} ms" if speeds else "")
    return f"GELU (tanh): {names.get(cfg.gelu_impl, 'F.gelu (torch)')}{measured}"


def disk_plan(cfg: Config) -> dict:
    """The bytes this run writes (core/plan/disk.py) beside each folder's free space."""
    export_word = hf_export.export_dtype(cfg.precision, cfg.export_dtype).itemsize if cfg.export else 0
    return disk.disk_plan(cfg, count_parameters(cfg)[0], export_word)


def export(fabric: Fabric, cfg: Config, model, run: Run) -> str | None:
    """runs/<run>/hf/: the model gathered into one ordinary state dict on rank 0, as a Hugging Face folder."""
    state_dict = strategies.export_state_dict(fabric, model, cfg)
    if fabric.global_rank != 0:
        return None
    dtype = hf_export.export_dtype(cfg.precision, cfg.export_dtype)
    return str(hf_export.write_hf_folder(state_dict, cfg, run.dir / "hf", dtype, run.last_checkpoint))


def fabric_precision(cfg: Config, on_gpu: bool) -> dict:
    """Fabric's precision arguments: 16-mixed as Fabric's own plugin with a GradScaler starting at
    2^--loss-scale-power (on CPU too, where Fabric would turn the name into bf16); other precisions, and
    DeepSpeed's own fp16 (configured in strategies.deepspeed_config), by name."""
    if cfg.precision != "16-mixed" or cfg.layout.deepspeed:
        return {"precision": cfg.precision}
    from lightning.fabric.plugins import MixedPrecision

    device = "cuda" if on_gpu else "cpu"
    scaler = torch.amp.GradScaler(device, init_scale=2.0 ** cfg.loss_scale_power)
    return {"plugins": [MixedPrecision("16-mixed", device, scaler=scaler)]}


def reached_its_end(record: dict, cfg: Config) -> bool:
    """An earlier run's record reached the step this command would stop at (--steps, else all of --num-samples)."""
    return record.get("steps", 0) >= schedule_steps(cfg)[1]


def schedule_steps(cfg: Config) -> tuple[int, int]:
    """(optimizer steps the schedule spans: all of num_samples, the step this command stops at: --steps or all)."""
    total = cfg.num_samples // samples_per_step(cfg)
    return total, min(total, cfg.steps) if cfg.steps else total


def text_identity(cfg: Config) -> dict:
    """What a text run's checkpoints are tied to, beside the flags: its corpus and tokenizer, by content."""
    if cfg.dataset != "text":
        return {}
    prepared = prepared_text(cfg)
    return {"corpus_sha256": prepared.corpus_sha256, "tokenizer_sha256": prepared.tokenizer_sha256}


def text_record(cfg: Config, progress: Progress) -> dict:
    """A text run's validation losses and what it trained on."""
    if cfg.dataset != "text":
        return {}
    prepared = prepared_text(cfg)
    return {"val_losses": progress.val_losses, "val_loss": progress.val_losses[-1][1] if progress.val_losses else None,
            "train_losses_eval": getattr(progress, "train_losses_eval", []),
            "text": {**text_identity(cfg), "corpus": prepared.corpus, "tokenizer": cfg.tokenizer,
                     "tokenizer_vocab": prepared.vocab_size, "train_tokens": prepared.train_tokens,
                     "val_tokens": prepared.val_tokens}}


def check_resume(saved: dict, cfg: Config) -> None:
    """The number of processes must stay (it shards the checkpoint and sets the global batch); how they are laid
    out over nodes may change (2 processes on one node, or one on each of 2: devices and num_nodes are runtime). A run
    extends: more samples (what a larger --steps asks for) continue the same ones, at the rate its schedule ended
    with (its checkpoint keeps the schedule it started with)."""
    if cfg.dataset == saved.get("dataset") and cfg.num_samples > saved.get("num_samples", 0):
        saved["num_samples"] = cfg.num_samples  # compared as equal: every dataset's first samples are the same
    ran = saved_config(saved)
    was, now = ran.layout.world, cfg.layout.world
    if now == was:
        return
    if ran.layout.sharded_states:  # the checkpoint's own strategy: a resume under another is refused besides
        raise ResumeError(f"cannot resume run {cfg.run_name}: its {ran.strategy} checkpoint is sharded over "
                          f"{was} processes and this run has {now}. Fix: resume with the same --devices/--num-nodes, "
                          "or export it as one state dict (strategies.export_checkpoint, docs/gpt.md).")
    processes = f"{was} process{'es' if was != 1 else ''}"
    raise ResumeError(f"cannot resume run {cfg.run_name}: it ran on {processes} and "
                      f"this run has {now}, which changes the global batch (micro-batch x accumulation x "
                      f"data-parallel size). Fix: resume with as many processes (--devices x --num-nodes), or start a "
                      f"new run with another --run-name")


if __name__ == "__main__":
    with exit_without_teardown():  # 2 s of CPU in every rank, and C++ threads torn down mid-call
        main()
