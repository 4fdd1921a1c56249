"""LeNet-5 on MNIST, trained through Lightning Fabric on CPU or GPU, one or many processes.

    python fabric_lenet.py                                   # defaults: 99.2%+ test accuracy on a 2-core CPU
    python fabric_lenet.py --devices 2 --strategy ddp        # 2 processes (gloo on CPU, NCCL on GPUs)
    python fabric_lenet.py --activation gelu_cpp             # the hand-written C++ GELU of gelu_ext/
    python fabric_lenet.py --resume auto                     # continue the newest interrupted run

Outputs go to runs/<run-name>/: TensorBoard events, checkpoints/, config.json and record.json. Notes: docs/lenet.md.
"""

import collections
import contextlib
import ctypes
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import psutil
import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch import nn
from torch.utils.data import DataLoader
from torchmetrics.classification import MulticlassAccuracy, MulticlassConfusionMatrix

import cpu_probe
import datasets_local
import flags
from flags import ConfigError, opt
from gelu_ext import GeluBuildError
from hardware import check_hardware, cpu_name, cpu_units, isa_caps, uses_gpu
from ranks import check_launcher, launch
from run_state import (NonFiniteLoss, Progress, Run, StopRequest, Stopwatch, any_rank, nonfinite_message, progress_bar,
                       requeue_flag, resume_flag, run_main)

ACTIVATIONS = ("relu", "gelu_torch", "gelu_py", "gelu_cpp")
STRATEGIES = ("auto", "ddp", "dp")
PRECISIONS = ("auto", "32-true", "16-mixed", "bf16-mixed", "bf16-true", "64-true")


@dataclass
class Config:
    accelerator: str = opt("auto", "where it runs", ("auto", "cpu", "gpu", "cuda", "mps"), group="where and how it runs")
    devices: int = opt(1, "devices (processes) per node", min=1)
    num_nodes: int = opt(1, "nodes; Fabric reads the rank layout from torchrun/SLURM", min=1)
    node_timeout: float = opt(60.0, "seconds to wait for a node that has not joined or stopped answering", above=0,
                              max=1e6)
    strategy: str = opt("auto", "auto: one device; ddp: one process per device; dp: one process, several GPUs",
                        STRATEGIES)
    precision: str = opt("auto", "auto (bf16-mixed on GPUs, the faster of two on CPUs: docs/lenet.md), 32-true, "
                         "16-mixed, bf16-mixed, bf16-true, 64-true", PRECISIONS)
    compile: bool = opt(False, "torch.compile the model (slow to start, faster steps on GPU)")
    compile_mode: str = opt("default", "torch.compile's mode (with --compile); reduce-overhead: CUDA graphs",
                            ("default", "reduce-overhead", "max-autotune"))
    sync_check: bool = opt(False, "CUDA: fail at any host synchronisation inside a step, from the fourth step of "
                           "each batch shape on (the first compile and capture; torch.cuda.set_sync_debug_mode)")
    channels_last: bool = opt(True, "NHWC layout: oneDNN's fast convolutions on CPU, tensor cores on GPU")
    pad_channels: int = opt(8, "with --channels-last, compute conv1's 6 channels as this many (docs/lenet.md); 0: off",
                            min=6, max=64, zero=True)
    # Batch 512 (lr 8e-3): as accurate as 128 or 256, at 1.2-1.5x the samples/s on 2 CPU cores, where a step's
    # fixed cost dominates small batches. 16 epochs with label smoothing: 99.42% mean over 5 seeds, against
    # 99.35% for 12 or 16 epochs without it (make bench-lenet)
    epochs: int = opt(16, "passes over the training set", min=1, group="optimisation")
    batch_size: int = opt(512, "global batch: split evenly across all processes", min=1, max=60000)
    lr: float = opt(8e-3, "peak learning rate of the schedule", above=0)
    optimizer: str = opt("adamw", "adamw, or sgd (momentum 0.9, nesterov)", ("adamw", "sgd"))
    schedule: str = opt("onecycle", "onecycle (warm-up then cosine decay), cosine, constant",
                        ("onecycle", "cosine", "constant"))
    weight_decay: float = opt(5e-4, "decoupled weight decay (AdamW) or L2 (SGD)", min=0)
    label_smoothing: float = opt(0.1, "share of each target spread over the other classes", min=0, below=1)
    seed: int = opt(0, "seed of the weights, the data order and the augmentation", min=0)
    activation: str = opt("relu", "relu, gelu_torch (F.gelu), gelu_py, gelu_cpp (gelu_ext/)", ACTIVATIONS,
                          group="model and data")
    gelu_approximate: str = opt("none", "GELU form for the gelu_* activations: none (erf) or tanh", ("none", "tanh"))
    augment: bool = opt(True, "random shifts of up to 2 pixels")
    data: str = opt("memory", "memory: whole split as tensors, sliced; loader: Dataset + DataLoader",
                    ("memory", "loader"))
    num_workers: int = opt(0, "DataLoader worker processes (--data loader only)", min=0, max=256)
    data_dir: str = opt("data/mnist", "folder for the MNIST files", check=flags.Folder())
    mirror: str = opt("", "URL or folder with the MNIST .gz files (default: $MNIST_MIRROR, then upstream)",
                      check=flags.Source())
    train_samples: int = opt(0, "train on the first N training images only (0: all 60,000)", min=1, max=60000, zero=True)
    max_steps: int = opt(0, "stop after this many optimizer steps (0: run all epochs); for smoke tests", min=0)
    out_dir: str = opt("runs", "folder holding one folder per run", check=flags.Folder(), group="output and resumption")
    run_name: str = opt("", "run folder name (default: lenet-<activation>-<date-time>)", check=flags.RunName())
    log_every: int = opt(50, "steps between train-loss log points", min=1)
    eval_every: int = opt(0, "steps between extra test evaluations (0: only at epoch ends)", min=0)
    checkpoint_every: int = opt(0, "steps between checkpoints (0: only at epoch ends)", min=0)
    keep_last: int = opt(3, "checkpoints kept", min=1)
    resume: str = resume_flag()
    requeue_signal: str = requeue_flag()
    cache_dir: str = opt("~/.cache/fabric-lab", "where --precision auto keeps its timings per machine",
                         check=flags.Folder())
    tb_images: bool = opt(True, "confusion matrix, misclassified digits, feature maps, histograms in TensorBoard")


# Settings that may change on resume: they change how the run executes, not what it computes.
RUNTIME_FIELDS = {"node_timeout", "sync_check", "channels_last", "pad_channels", "accelerator", "devices", "num_nodes", "strategy", "compile",
                  "compile_mode", "data",
                  "num_workers", "data_dir", "mirror", "out_dir", "run_name", "log_every", "eval_every",
                  "checkpoint_every", "keep_last", "resume", "requeue_signal", "tb_images", "max_steps", "cache_dir"}
# Settings added after runs were saved without them, with the value those runs behaved as (resume compares it).
ADDED_FIELDS = {"label_smoothing": 0.0}


# ----------------------------------------------------------------------------- model
def make_activation(cfg: Config) -> nn.Module:
    if cfg.activation == "relu":
        return nn.ReLU()
    from gelu_ext import GELU

    return GELU(impl=cfg.activation.removeprefix("gelu_"), approximate=cfg.gelu_approximate)


class ZeroPaddedConv2d(nn.Conv2d):
    """A Conv2d computed with zero weights appended: pad_out output channels that are always zero, and pad_in
    input channels (the zero ones the previous layer appended) that are read with zero weights. The same
    parameters, results and gradients, in a channel count the CPU kernels handle whole vectors of."""

    def __init__(self, *args, pad_out: int = 0, pad_in: int = 0, **kwargs):
        super().__init__(*args, **kwargs)
        self.pad_out, self.pad_in = pad_out, pad_in

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.pad_out or self.pad_in):
            return super().forward(x)
        weight = F.pad(self.weight, (0, 0, 0, 0, 0, self.pad_in, 0, self.pad_out))  # zero filters / zero inputs
        return self._conv_forward(x, weight, F.pad(self.bias, (0, self.pad_out)))


class LeNet5(nn.Module):
    """LeCun et al. 1998: two conv+pool stages, three fully connected layers (61,706 parameters)."""

    def __init__(self, cfg: Config):
        super().__init__()
        act = lambda: make_activation(cfg)  # noqa: E731 - a fresh module per use keeps the graph readable
        # ReLU is monotone, so max-pooling before it gives the same values and gradients with the activation
        # on a quarter of the elements (a tenth of the step on CPU); GELU is not, so it keeps conv-act-pool.
        # The parameters keep their names either way (features.0 and features.3).
        pool_act = (lambda: [nn.MaxPool2d(2), act()]) if cfg.activation == "relu" else (lambda: [act(), nn.MaxPool2d(2)])
        # conv1's 6 channels travel as cfg.pad_channels (zeros in the extra ones) from conv1 to conv2's input;
        # in NCHW the pooling does not vectorize across channels and the padding only added work (10% in float32)
        pad = max(cfg.pad_channels - 6, 0) if cfg.channels_last else 0
        self.features = nn.Sequential(
            ZeroPaddedConv2d(1, 6, 5, padding=2, pad_out=pad), *pool_act(),   # 1x28x28 -> 6x28x28 -> 6x14x14
            ZeroPaddedConv2d(6, 16, 5, pad_in=pad), *pool_act(),              # -> 16x10x10 -> 16x5x5
        )
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(16 * 5 * 5, 120), act(), nn.Linear(120, 84), act(), nn.Linear(84, 10),
        )

    autocast_dtype: torch.dtype | None = None  # set for --strategy dp under bf16-mixed, see run()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.autocast_dtype is not None:  # entered again here, in whichever thread runs this replica
            with torch.autocast(x.device.type, dtype=self.autocast_dtype):
                return self.classifier(self.features(x))
        return self.classifier(self.features(x))


# ----------------------------------------------------------------------------- data
def load_data(cfg: Config):
    """Train and test splits, parsed once from the IDX files (downloaded or copied from the mirror)."""
    train = datasets_local.MNIST(cfg.data_dir, train=True, download=True, mirror=cfg.mirror or None)
    test = datasets_local.MNIST(cfg.data_dir, train=False, download=True, mirror=cfg.mirror or None)
    if cfg.train_samples > len(train):
        raise ConfigError(f"--train-samples {cfg.train_samples} is more than the {len(train):,} training images; "
                          f"use at most {len(train)} (0: all)")
    if cfg.train_samples:
        train.images, train.labels = train.images[:cfg.train_samples], train.labels[:cfg.train_samples]
    return train, test


def epoch_order(n: int, epoch: int, cfg: Config, rank: int, world: int) -> torch.Tensor:
    """This rank's sample indices for an epoch. The same permutation, padding and rank interleaving as
    DistributedSampler(shuffle=True, seed=cfg.seed), so every global batch is the same whatever the
    number of processes, and the in-memory and DataLoader paths see the same samples in the same order.
    The padding (the permutation's first indices again, up to a multiple of `world`) gives every rank the
    same number of steps: with one step more on one rank, the others would wait for it forever."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(cfg.seed + epoch))
    total = padded_epoch(n, world)
    return order.repeat(math.ceil(total / n))[:total][rank::world]


def padded_epoch(n: int, world: int) -> int:
    """Samples in one epoch over all ranks: n padded up to a multiple of the world size."""
    return math.ceil(n / world) * world


def train_batches(train, order: torch.Tensor, start: int, cfg: Config, local_batch: int, train_tensors):
    """Yield this rank's batches from batch `start` on, by in-memory slicing or through a DataLoader."""
    if cfg.data == "memory":
        x, y = train_tensors
        order = order.to(x.device)  # on a GPU the data set is there too: each batch a gather, no host copy
        for i in range(start * local_batch, len(order), local_batch):
            idx = order[i:i + local_batch]
            yield x[idx], y[idx]
    else:
        sampler = order[start * local_batch:].tolist()
        loader = DataLoader(train, batch_size=local_batch, sampler=sampler, num_workers=cfg.num_workers,
                            persistent_workers=False)
        yield from loader


def steps_per_epoch(n_samples: int, cfg: Config, world: int) -> int:
    """Optimizer steps in one epoch: each rank takes batch_size / world of its n_samples / world samples."""
    return math.ceil(n_samples / world / (cfg.batch_size // world))


def samples_trained(progress: Progress, n_samples: int, cfg: Config, world: int) -> int:
    """Samples trained on by all ranks so far: whole (padded) epochs, then the full batches of the current one
    (an epoch's last batch is the only short one)."""
    return progress.epoch * padded_epoch(n_samples, world) + progress.step_in_epoch * cfg.batch_size


# The value of a black pixel after normalization: MNIST's background, every image's minimum. A constant, so
# that no step reads the batch's minimum back from the device.
BACKGROUND = float(datasets_local.normalize(torch.zeros(1, 1, 1, dtype=torch.uint8)))


def random_shift(x: torch.Tensor, generator: torch.Generator, fill: float = BACKGROUND, pad: int = 2) -> torch.Tensor:
    """Translate each image by up to `pad` pixels in each direction, filling with the background value.
    Two views of windows (unfold) and one index per image each: an element-wise gather over all pixels
    cost about 15x more, a tenth of the training step."""
    n, _, h, w = x.shape
    padded = F.pad(x, (pad, pad, pad, pad), value=fill)
    oy, ox = torch.randint(0, 2 * pad + 1, (2, n), generator=generator, device=generator.device).to(x.device)
    at = torch.arange(n, device=x.device)
    rows = padded[:, 0].unfold(1, h, 1)[at, oy]  # (n, w + 2 pad, h): each image's window of rows, column-major
    return rows.unfold(1, w, 1)[at, ox].unsqueeze(1)  # (n, 1, h, w)


# ----------------------------------------------------------------------------- training
def make_optimizer(cfg: Config, model: nn.Module, total_steps: int):
    if cfg.optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=0.9, nesterov=True, weight_decay=cfg.weight_decay)
    else:
        # fused: one kernel for all parameters instead of a loop of small ones (matters at LeNet's size)
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, fused=True)
    if cfg.schedule == "onecycle":
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=cfg.lr, total_steps=total_steps, pct_start=0.2)
    elif cfg.schedule == "cosine":
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=total_steps)
    else:
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    return opt, sched


@torch.no_grad()
def evaluate(fabric: Fabric, model: nn.Module, test_tensors, batch: int = 1000) -> dict:
    """Test loss, accuracy, per-class accuracy and confusion matrix; each rank scores its shard and
    torchmetrics gathers the counts across processes. Also the test indices of this rank's first 64 errors,
    for TensorBoard's misclassified digits."""
    model.eval()
    rank, world = fabric.global_rank, fabric.world_size
    x, y = (t[rank::world] for t in test_tensors)
    acc = MulticlassAccuracy(num_classes=10, average="micro").to(fabric.device)
    per_class = MulticlassAccuracy(num_classes=10, average=None).to(fabric.device)
    confusion = MulticlassConfusionMatrix(num_classes=10).to(fabric.device)
    loss_sum = torch.zeros((), device=fabric.device, dtype=torch.float64)
    wrong = []
    for i in range(0, len(y), batch):
        xb, yb = x[i:i + batch].to(fabric.device), y[i:i + batch].to(fabric.device)
        logits = model(xb).float()
        loss_sum += F.cross_entropy(logits, yb, reduction="sum").double()
        for metric in (acc, per_class, confusion):
            metric.update(logits, yb)
        if len(wrong) < 64:
            wrong += [rank + (i + j) * world for j in (logits.argmax(1) != yb).nonzero().flatten().tolist()]
    total = fabric.all_reduce(loss_sum, reduce_op="sum")
    model.train()
    return {"test_loss": float(total) / len(test_tensors[1]), "test_acc": float(acc.compute()),
            "per_class_acc": per_class.compute().tolist(), "confusion": confusion.compute().tolist(),
            "misclassified": wrong[:64]}


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


def fold_losses(run: Run, pending: list, epoch: int) -> float:
    """The losses of the steps since the last check point, read from the device in one transfer (a step reads
    nothing): each finite one added to the epoch's running mean in step order, exactly as if added every step (a
    resumed run's mean matches the uninterrupted one's), and a non-finite one, on any rank, stops the run naming its
    step before anything is logged or saved. Returns the last step's loss (this rank's shard; the mean is rank 0's)."""
    progress: Progress = run.state["progress"]
    values = torch.stack([loss.float() for _, loss, _ in pending]).tolist() if pending else []
    bad = next(((step, v) for (step, _, _), v in zip(pending, values) if not math.isfinite(v)), None)
    (nonfinite,) = any_rank(run.fabric, bad is not None)
    if nonfinite:
        step, loss = bad or (progress.global_step, math.nan)  # another rank may have seen it
        raise NonFiniteLoss(nonfinite_message(loss, step, f"epoch {epoch + 1}", run.last_checkpoint, run.cfg.precision))
    for (_, _, n), value in zip(pending, values):
        progress.loss_sum += value * n
        progress.loss_count += n
    pending.clear()
    return values[-1] if values else math.nan


def train(run: Run, model, optimizer, scheduler, data) -> dict:
    """The epoch loop: resumes at run.state["progress"], evaluates each epoch, checkpoints, stops on request."""
    fabric, cfg = run.fabric, run.cfg
    train_set, test_tensors, train_tensors = data
    progress: Progress = run.state["progress"]
    world, local_batch = fabric.world_size, cfg.batch_size // fabric.world_size
    epoch_steps = steps_per_epoch(len(train_set), cfg, world)
    result, pending = {}, []  # pending: (step, loss on the device, samples) since the last check point
    shapes = collections.Counter()  # a new batch shape (an epoch's last batch) is compiled and captured anew
    while progress.epoch < cfg.epochs:
        epoch = progress.epoch
        order = epoch_order(len(train_set), epoch, cfg, fabric.global_rank, world)
        epoch_start_time, data_wait, seen = progress.train_time_s, 0.0, 0
        clock = Stopwatch(progress)  # adds to progress.train_time_s; paused around evaluation and saving
        t_fetch = time.perf_counter()
        batches = train_batches(train_set, order, progress.step_in_epoch, cfg, local_batch, train_tensors)
        left = epoch_steps - progress.step_in_epoch  # the bar counts the steps this run takes (--max-steps included)
        if cfg.max_steps:
            left = max(0, min(left, cfg.max_steps - progress.global_step))
        for xb, yb in progress_bar(fabric, batches, left, f"epoch {epoch + 1}/{cfg.epochs}"):
            shapes[xb.shape] += 1
            with host_sync_forbidden(cfg.sync_check and shapes[xb.shape] > 3):  # after warm-up and capture
                xb, yb = xb.to(fabric.device, non_blocking=True), yb.to(fabric.device, non_blocking=True)
                if cfg.channels_last:
                    xb = xb.contiguous(memory_format=torch.channels_last)
                if cfg.augment:
                    g = torch.Generator(xb.device).manual_seed(cfg.seed * 1_000_003 + progress.global_step * world
                                                               + fabric.global_rank)  # drawn where the batch is
                    xb = random_shift(xb, g)
                data_wait += time.perf_counter() - t_fetch
                loss = F.cross_entropy(model(xb), yb, label_smoothing=cfg.label_smoothing)
                fabric.backward(loss)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                scheduler.step()
            progress.step_in_epoch += 1
            progress.global_step += 1
            step, seen = progress.global_step, seen + len(yb) * world
            pending.append((step, loss.detach(), len(yb)))  # read at the next check point, not now
            (stopping,) = run.stop.requested(fabric)
            last = cfg.max_steps and step >= cfg.max_steps
            log_due = step % cfg.log_every == 0
            eval_due = cfg.eval_every and step % cfg.eval_every == 0
            save_due = (cfg.checkpoint_every and step % cfg.checkpoint_every == 0) or stopping
            if log_due or eval_due or save_due or last:
                loss_value = fold_losses(run, pending, epoch)
                if log_due:
                    run.logger.log_metrics({"train/loss": loss_value, "train/lr": scheduler.get_last_lr()[0]}, step=step)
            if eval_due:
                with clock.paused():
                    log_eval(run, evaluate(fabric, model, test_tensors), epoch, step, progress.train_time_s)
            if save_due:
                with clock.paused():
                    run.save(step)
            if stopping:
                raise run.stopped()
            if last:
                break
            t_fetch = time.perf_counter()
        fold_losses(run, pending, epoch)  # an epoch's last steps
        clock.pause()
        epoch_time = progress.train_time_s - epoch_start_time
        finished_epoch = progress.step_in_epoch >= epoch_steps
        result = evaluate(fabric, model, test_tensors)
        record = {"epoch": epoch + 1, "step": progress.global_step,
                  "train_loss": progress.loss_sum / max(progress.loss_count, 1),
                  "epoch_time_s": epoch_time, "samples_per_s": seen / epoch_time if epoch_time else 0.0,
                  "data_wait_share": data_wait / epoch_time if epoch_time else 0.0,
                  "train_time_s": progress.train_time_s, **{k: result[k] for k in ("test_loss", "test_acc")}}
        progress.history.append(record)
        print_epoch(fabric, record, cfg)
        log_epoch(run, model, record, result, test_tensors)
        if finished_epoch:
            progress.epoch, progress.step_in_epoch, progress.loss_sum, progress.loss_count = epoch + 1, 0, 0.0, 0
        run.save(progress.global_step)
        if cfg.max_steps and progress.global_step >= cfg.max_steps:
            break
    return result


# ----------------------------------------------------------------------------- output
def print_epoch(fabric: Fabric, r: dict, cfg: Config) -> None:
    fabric.print(f"epoch {r['epoch']:>2}/{cfg.epochs} | train loss {r['train_loss']:.4f} | test loss "
                 f"{r['test_loss']:.4f} | test acc {100 * r['test_acc']:.2f}% | {r['epoch_time_s']:.2f} s | "
                 f"{r['samples_per_s']:,.0f} samples/s | data wait {100 * r['data_wait_share']:.0f}%")


def log_eval(run: Run, result, epoch, step, train_time) -> None:
    fabric, logger = run.fabric, run.logger
    run.state["progress"].history.append({"epoch": epoch + 1, "step": step, "train_time_s": train_time, "partial": True,
                    "test_loss": result["test_loss"], "test_acc": result["test_acc"]})
    logger.log_metrics({"test/loss": result["test_loss"], "test/acc": result["test_acc"]}, step=step)
    fabric.print(f"  step {step}: test acc {100 * result['test_acc']:.2f}% after {train_time:.2f} s of training")


def log_epoch(run: Run, model, record: dict, result: dict, test_tensors) -> None:
    fabric, logger, cfg = run.fabric, run.logger, run.cfg
    step = record["step"]
    metrics = {"test/loss": record["test_loss"], "test/acc": record["test_acc"], "train/epoch_loss": record["train_loss"],
               "perf/samples_per_s": record["samples_per_s"], "perf/data_wait_share": record["data_wait_share"],
               "system/process_rss_gb": psutil.Process().memory_info().rss / 2**30}
    if fabric.device.type == "cuda":
        metrics["system/gpu_max_allocated_gb"] = torch.cuda.max_memory_allocated(fabric.device) / 2**30
        try:
            metrics["system/gpu_utilization_pct"] = torch.cuda.utilization(fabric.device)
        except Exception:  # needs pynvml; memory figures above do not
            pass
    logger.log_metrics(metrics, step=step)
    if cfg.tb_images and fabric.is_global_zero:
        log_images(logger.experiment, model, result, test_tensors, step)


def log_images(writer, model, result: dict, test_tensors, step: int) -> None:
    """Confusion matrix, misclassified digits, conv feature maps and weight histograms in TensorBoard."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from torchvision.utils import make_grid

    fig, ax = plt.subplots(figsize=(5, 5))
    ax.imshow(torch.tensor(result["confusion"]).log1p().numpy(), cmap="Blues")
    ax.set(xlabel="predicted", ylabel="true", xticks=range(10), yticks=range(10), title="confusion (log counts)")
    writer.add_figure("test/confusion_matrix", fig, step)
    plt.close(fig)

    module = getattr(model, "module", model)
    device = next(module.parameters()).device
    x = test_tensors[0]
    with torch.no_grad():
        if result["misclassified"]:  # found by evaluate(): no second pass over the test set
            wrong = x[result["misclassified"]]
            writer.add_image("test/misclassified", make_grid(wrong * datasets_local.STD + datasets_local.MEAN,
                                                              nrow=8, padding=1), step)
        maps, hooks = {}, []
        for name, i in (("conv1", 1), ("conv2", 4)):  # outputs of the layer after each convolution; the real channels only
            keep = module.features[i - 1].out_channels
            hooks.append(module.features[i].register_forward_hook(
                lambda m, a, out, n=name, k=keep: maps.__setitem__(n, out[:, :k])))
        module(x[:4].to(device))
        for h in hooks:
            h.remove()
        for name, fmap in maps.items():
            fmap = fmap.float().cpu().flatten(0, 1).unsqueeze(1)  # (images*channels, 1, H, W)
            writer.add_image(f"features/{name}", make_grid(fmap, nrow=fmap.shape[0] // 4, normalize=True,
                                                           scale_each=True, padding=1), step)
    for name, param in module.named_parameters():
        writer.add_histogram(f"weights/{name}", param.detach().float().cpu(), step)


def cuda_graphs(cfg: Config, device: torch.device) -> str | None:
    """What became of --compile-mode reduce-overhead's CUDA graphs (forward and backward captured once, then
    replayed): torch.compile falls back to launching kernels one by one, quietly, when it cannot capture."""
    if not (cfg.compile and cfg.compile_mode == "reduce-overhead"):
        return None
    if device.type != "cuda":
        return f"not captured: CUDA graphs record CUDA kernels and this run is on {device.type}; compiled without them"
    from torch._dynamo.utils import counters

    skipped = counters["inductor"]["cudagraph_skips"]
    return "captured and replayed" if not skipped else (
        f"refused for {count(skipped, 'graph')} (TORCH_LOGS=cudagraphs prints the reason); those run compiled, "
        "without graphs")


TARGETS = (0.99, 0.992)  # test accuracies whose time of training the summary reports


def steady_speed(history: list[dict], first_epoch_here: int) -> float | None:
    """Samples/s of the steady state: the median epoch of this process after its first (which carries start-up:
    kernel selection, lazy loading, compilation). None with fewer than 2 epochs here. Epoch times are read after the
    epoch's losses come back from the device, so queued GPU work is inside them."""
    speeds = [h["samples_per_s"] for h in history if not h.get("partial") and h["epoch"] > first_epoch_here + 1]
    return statistics.median(speeds) if speeds else None


def time_to_accuracy(history: list[dict]) -> dict:
    """The training time and step at which each target test accuracy was first measured: as fine as the
    evaluation points (--eval-every, else epoch ends), so an upper bound; None where it was never reached."""
    reached = {}
    for target in TARGETS:
        first = next((h for h in history if h["test_acc"] >= target), None)
        reached[f"{100 * target:.1f}%"] = first and {"train_time_s": first["train_time_s"], "step": first["step"]}
    return reached


def count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def print_summary(fabric: Fabric, summary: dict) -> None:
    fabric.print(f"\n{'class':>7} | accuracy")
    for digit, acc in enumerate(summary["per_class_acc"]):
        fabric.print(f"{digit:>7} | {100 * acc:6.2f}%")
    fabric.print(f"{'all':>7} | {100 * summary['test_acc']:6.2f}%\n"
                 f"{count(summary['epochs'], 'epoch')}, {count(summary['steps'], 'step')} in "
                 f"{summary['train_time_s']:.1f} s of training ({summary['samples_per_s']:,.0f} samples/s"
                 + (f", steady {summary['samples_per_s_steady']:,.0f} after the first epoch"
                    if summary["samples_per_s_steady"] else "") + "); "
                 f"run folder {summary['run_dir']}")
    reached = [f"{target} after {r['train_time_s']:.2f} s (step {r['step']})" if r else f"{target} not reached"
               for target, r in summary["time_to_accuracy"].items()]
    fabric.print(f"time to test accuracy: {', '.join(reached)}; measured at evaluation points (--eval-every)")
    if summary.get("cuda_graphs"):
        fabric.print(f"CUDA graphs: {summary['cuda_graphs']}")


# ----------------------------------------------------------------------------- main
def validate(cfg: Config) -> None:
    """Every impossible combination is refused here, before data or model are touched."""
    flags.check_config(cfg)  # each flag's own range, again for a config built in Python
    world = cfg.devices * cfg.num_nodes
    if cfg.batch_size % world:
        raise ConfigError(f"--batch-size {cfg.batch_size} is the global batch and must divide evenly across "
                          f"{world} processes; use a multiple of {world}")
    check_launcher(cfg.num_nodes, cfg.devices, "fabric_lenet.py")
    gpu = check_hardware(cfg.accelerator, cfg.devices, cfg.precision)
    if cfg.strategy == "dp" and not gpu:
        raise ConfigError("--strategy dp splits batches across GPUs in one process and needs CUDA; "
                          "on CPU use --strategy ddp")
    if cfg.strategy == "dp" and cfg.num_nodes > 1:
        raise ConfigError("--strategy dp runs in one process on one node; use ddp for several nodes")
    if cfg.sync_check and not gpu:
        raise ConfigError("--sync-check watches for CUDA host synchronisation and needs a GPU; a CPU step has none to "
                          "find (tests/test_lenet.py counts host reads on CPU instead)")
    if cfg.compile_mode != "default" and not cfg.compile:
        raise ConfigError(f"--compile-mode {cfg.compile_mode} is a mode of torch.compile; add --compile")
    if cfg.num_workers and cfg.data != "loader":
        raise ConfigError("--num-workers applies to --data loader only; the in-memory path has no workers")
    if cfg.activation == "gelu_cpp":
        from gelu_ext import load_cpp

        load_cpp()  # build once here, before Fabric starts worker processes that would race to build it
    if cfg.precision == "auto":  # resolved here, so config.json and resume compare the precision that ran
        cfg.precision = auto_precision(cfg)


# ----------------------------------------------------------------------------- --precision auto
# On a GPU bf16 autocast (fp16 without bf16) is the fast choice. On a CPU no rule holds: bf16 autocast was
# 1.4x faster than float32 on a Xeon with AMX, 1.3x on an EPYC with AVX-512 BF16 and far slower without
# either (docs/lenet.md). So the CPU times LeNet-5's own step in both, once per machine and settings.
PROBE_ENV = "FABRIC_LAB_AUTO_PRECISION"  # the launching process's choice, inherited by the ranks it starts
PRECISION_PROBE: dict | None = None  # this process's probe result (or cache hit), for the run's record


def probe_key(cfg: Config) -> dict:
    """What the step's speed depends on: the CPU, the libraries, the threads a rank gets, the local batch
    and the memory layout. A change of any of them measures again."""
    world = cfg.devices * cfg.num_nodes
    return {"cpu": cpu_name(), "units": cpu_units(), "caps": isa_caps(), "torch": torch.__version__,
            "threads": cpu_probe.rank_threads(cfg.devices),
            "local_batch": cfg.batch_size // world, "channels_last": cfg.channels_last,
            "pad_channels": cfg.pad_channels, "activation": cfg.activation}


def measure_step_speed(cfg: Config, key: dict, windows: int = 4, steps: int = 2) -> dict:
    """Samples/s of LeNet-5's training step (forward, loss, backward, fused AdamW) in float32 and under
    bf16 autocast, on random images of the run's shape: the median of 4 alternating windows of 2 steps, after 2
    warm-up steps that include oneDNN's kernel set-up. About 0.5 s on 2 cores, once per machine and settings."""
    threads = torch.get_num_threads()
    torch.set_num_threads(key["threads"])
    try:
        torch.manual_seed(0)
        n = key["local_batch"]
        x = torch.randn(n, 1, 28, 28)
        x = x.contiguous(memory_format=torch.channels_last) if cfg.channels_last else x
        y = torch.randint(0, 10, (n,))
        models = {p: LeNet5(cfg) for p in ("32-true", "bf16-mixed")}
        if cfg.channels_last:
            models = {p: m.to(memory_format=torch.channels_last) for p, m in models.items()}
        optimizers = {p: torch.optim.AdamW(m.parameters(), fused=True) for p, m in models.items()}

        def step(precision: str) -> None:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
                loss = F.cross_entropy(models[precision](x), y)
            loss.backward()
            optimizers[precision].step()
            optimizers[precision].zero_grad(set_to_none=True)

        times = {p: [] for p in models}
        for p in models:
            for _ in range(2):
                step(p)
        for _ in range(windows):
            for p in models:
                t0 = time.perf_counter()
                for _ in range(steps):
                    step(p)
                times[p].append((time.perf_counter() - t0) / steps)
        return {p: n / statistics.median(t) for p, t in times.items()}
    finally:
        torch.set_num_threads(threads)


def choose_precision(key: dict, cache_file: Path, measure) -> dict:
    """The faster of float32 and bf16 autocast for `key`: from the cache when it holds this key, else
    measured (measure() -> {precision: samples/s}) and added to it. A file lock makes ranks started
    together (torchrun) measure once and read the same answer."""
    def measure_entry() -> dict:
        started = time.perf_counter()
        speeds = measure()
        return {"choice": max(speeds, key=speeds.get), "samples_per_s": speeds, "key": key,
                "probe_s": time.perf_counter() - started, "date": f"{datetime.now():%Y-%m-%d %H:%M}"}

    entry, cached = cpu_probe.stored_or_measured(cache_file, json.dumps(key, sort_keys=True), measure_entry)
    return {**entry, "cached": cached}


def auto_precision(cfg: Config) -> str:
    """The precision --precision auto stands for here; on a CPU, decided by choose_precision."""
    global PRECISION_PROBE
    if uses_gpu(cfg.accelerator):
        return "bf16-mixed" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "16-mixed"
    if os.environ.get("LOCAL_RANK", "0") != "0" and os.environ.get(PROBE_ENV) in PRECISIONS:
        return os.environ[PROBE_ENV]  # a rank started by Fabric's launcher, which decided before starting it
    key = probe_key(cfg)
    PRECISION_PROBE = choose_precision(key, Path(cfg.cache_dir).expanduser() / "precision-probe.json",
                                       lambda: measure_step_speed(cfg, key))
    os.environ[PROBE_ENV] = PRECISION_PROBE["choice"]
    return PRECISION_PROBE["choice"]


def probe_line(probe: dict) -> str:
    s = probe["samples_per_s"]
    when = f"cached {probe['date']}" if probe["cached"] else f"measured now in {probe['probe_s']:.2f} s"
    return (f"precision auto: {probe['choice']} (LeNet-5 step at batch {probe['key']['local_batch']}, "
            f"{probe['key']['threads']} thread(s): bf16 autocast {s['bf16-mixed']:,.0f} samples/s, float32 "
            f"{s['32-true']:,.0f}; {when}; --precision forces one)")


def parse_args(argv=None) -> Config:
    return flags.parse_config(Config, argv, __doc__, prog="fabric_lenet.py")


def main(argv=None) -> dict:
    global PRECISION_PROBE
    PRECISION_PROBE = None  # filled by --precision auto in validate()
    return run_main(parse_args(argv), "lenet", validate, run, errors=(GeluBuildError, datasets_local.MNISTError),
                    finished=reached_its_end, argv=argv)


def reached_its_end(record: dict, cfg: Config) -> bool:
    """An earlier run's record reached what this command asks for: --max-steps steps, else all --epochs."""
    world = cfg.devices * cfg.num_nodes
    whole = cfg.epochs * steps_per_epoch(cfg.train_samples or 60_000, cfg, world)  # MNIST's 60,000 training images
    return record.get("steps", 0) >= (min(whole, cfg.max_steps) if cfg.max_steps else whole)


def keep_freed_memory_in_heap() -> None:
    """glibc hands each freed block over its (adaptive) threshold back to the OS, so each step page-faults
    its ~30 MB of activations in again; on the 2-core Xeon VM that made steps 1.3-1.6x slower and erratic.
    The largest threshold glibc allows and no trimming keep them in the heap for the next step."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (musl, ...): its allocator has no such settings
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    libc.mallopt(m_mmap_threshold, 32 * 2**20)
    libc.mallopt(m_trim_threshold, 2**31 - 1)


def run(cfg: Config) -> dict:
    keep_freed_memory_in_heap()
    fabric = Fabric(accelerator=cfg.accelerator, devices=cfg.devices, num_nodes=cfg.num_nodes, strategy=cfg.strategy,
                    precision=cfg.precision)
    launch(fabric, cfg.num_nodes, cfg.node_timeout)
    (differ,) = any_rank(fabric, fabric.broadcast(cfg.precision) != cfg.precision)
    if differ:  # ranks on different CPUs, each with its own probe: they must compute in one precision
        raise ConfigError("--precision auto chose differently on different ranks (different CPUs or caches); "
                          "pass --precision 32-true or bf16-mixed explicitly")
    if PRECISION_PROBE:
        fabric.print(probe_line(PRECISION_PROBE))
    fabric.seed_everything(cfg.seed)
    with fabric.rank_zero_first():  # rank 0 downloads; the others then read the verified files
        train_set, test_set = load_data(cfg)
    model = LeNet5(cfg)
    if cfg.strategy == "dp" and cfg.precision == "bf16-mixed":
        # DataParallel's worker threads re-enter autocast without its dtype, so the replicas would compute in
        # the thread's default, float16 on CUDA, with no loss scaler: the model names its dtype itself
        model.autocast_dtype = torch.bfloat16
    compute = {}  # the dtype conv1 computed in at the first step: what the record says must be what ran

    def note_dtype(module, args, out) -> None:
        compute.setdefault("dtype", str(out.dtype))
    model.features[0].register_forward_hook(note_dtype)
    if cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)
    if cfg.compile:
        model = torch.compile(model, mode=None if cfg.compile_mode == "default" else cfg.compile_mode)
    optimizer, scheduler = make_optimizer(cfg, model, cfg.epochs * steps_per_epoch(len(train_set), cfg, fabric.world_size))
    model, optimizer = fabric.setup(model, optimizer)
    progress = Progress(epoch=0, step_in_epoch=0, global_step=0, loss_sum=0.0, loss_count=0, train_time_s=0.0, history=[])
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "progress": progress}
    run = Run(fabric, cfg, "lenet", RUNTIME_FIELDS, state, added_fields=ADDED_FIELDS)
    fabric.print(f"device: {fabric.device} x {fabric.world_size} process(es), precision {cfg.precision}")
    if fabric.device.type != "cuda" and (graphs := cuda_graphs(cfg, fabric.device)):  # on a GPU: known after a step
        fabric.print(f"CUDA graphs: {graphs}")
    run.start()
    if cfg.resume:
        fabric.print(f"continuing at epoch {progress.epoch + 1}, step {progress.global_step}")
    first_epoch_here = progress.epoch
    # in-memory data lives where the model does (on a GPU: 190 MB, moved once), so a step copies nothing from the host
    on_device = lambda tensors: tuple(t.to(fabric.device) for t in tensors)  # noqa: E731
    data = (train_set, on_device(test_set.tensors()), on_device(train_set.tensors()) if cfg.data == "memory" else None)
    with StopRequest(cfg.requeue_signal) as run.stop:
        result = train(run, model, optimizer, scheduler, data)
    summary = {"test_acc": result["test_acc"], "test_loss": result["test_loss"],
               "per_class_acc": result["per_class_acc"], "confusion": result["confusion"],
               "epochs": progress.epoch + (1 if progress.step_in_epoch else 0), "steps": progress.global_step,
               "train_time_s": progress.train_time_s,
               "samples_per_s": samples_trained(progress, len(train_set), cfg, fabric.world_size)
               / max(progress.train_time_s, 1e-9),
               "world_size": fabric.world_size, "device": str(fabric.device), "precision_probe": PRECISION_PROBE,
               "compute_dtype": compute.get("dtype"), "cuda_graphs": cuda_graphs(cfg, fabric.device),
               "time_to_accuracy": time_to_accuracy(progress.history),
               "samples_per_s_steady": steady_speed(progress.history, first_epoch_here),
               "history": progress.history,
               "epoch_history": [h for h in progress.history if not h.get("partial")]}
    summary = run.finish(summary, {"hparams/test_acc": result["test_acc"], "hparams/test_loss": result["test_loss"]})
    print_summary(fabric, summary)
    return summary


if __name__ == "__main__":
    main()
