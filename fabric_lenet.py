"""LeNet-5 on MNIST, trained through Lightning Fabric on CPU or GPU, one or many processes.

    python fabric_lenet.py                                   # defaults: 99.2%+ test accuracy on a 2-core CPU
    python fabric_lenet.py --devices 2 --strategy ddp        # 2 processes (gloo on CPU, NCCL on GPUs)
    python fabric_lenet.py --activation gelu_cpp             # the hand-written C++ GELU of gelu_ext/
    python fabric_lenet.py --resume auto                     # continue the newest interrupted run
    python fabric_lenet.py --cuda-graph                      # on a GPU: the whole step as one CUDA graph

Outputs go to runs/<run-name>/: TensorBoard events, checkpoints/, config.json and record.json. Notes: docs/lenet.md.
"""

import collections
import contextlib
import dataclasses
import itertools
import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch import nn
from torch.utils.data import DataLoader
from torchmetrics.classification import MulticlassAccuracy, MulticlassConfusionMatrix

import datasets_local
from core.lenet import cpu_speed, figures, whole_step
from core.plan import disk
from core.run import flags
from core.run.flags import ConfigError, opt, requeue_flag, resume_flag
from core.run.hardware import check_hardware, compile_cache_per_caps, cuda_graphs, host_sync_forbidden, keep_freed_memory_in_heap
from core.run.layout import Parallel
from core.run.lifecycle import Progress, Run, exit_without_teardown, exits, find_run, take_resumed_choices
from core.run.ranks import check_launcher, launch, take_fabric_run_settings
from core.run.step_watch import LossWatch, StepTimer, progress_bar
from gelu_ext import ACTIVATIONS, GeluBuildError

STRATEGIES = ("auto", "ddp", "dp")
PRECISIONS = ("auto", "32-true", "16-mixed", "bf16-mixed", "bf16-true", "64-true")


@dataclass
class Config(Parallel):  # cfg.layout: the parallel layout of its flags (core/run/layout.py)
    accelerator: str = opt("auto", "where it runs", ("auto", "cpu", "gpu", "cuda", "mps"),
                           group="where and how it runs", runtime=True)
    devices: int = opt(1, "devices (processes) per node", min=1, runtime=True)
    num_nodes: int = opt(1, "nodes; Fabric reads the rank layout from torchrun/SLURM", min=1, runtime=True)
    node_timeout: float = opt(60.0, "seconds to wait for a node that has not joined or stopped answering", above=0,
                              max=1e6, runtime=True)
    strategy: str = opt("auto", "auto: one device; ddp: one process per device; dp: one process, several GPUs",
                        STRATEGIES, runtime=True)
    precision: str = opt("auto", "auto (bf16-mixed on GPUs, the faster of two on CPUs: docs/lenet.md), 32-true, "
                         "16-mixed, bf16-mixed, bf16-true, 64-true", PRECISIONS)
    compile: bool = opt(False, "torch.compile the model (slow to start, faster steps on GPU)", runtime=True)
    compile_mode: str = opt("default", "torch.compile's mode (with --compile); reduce-overhead: CUDA graphs",
                            ("default", "reduce-overhead", "max-autotune"), runtime=True)
    cuda_graph: bool = opt(False, "the whole step as one static-shape program, captured as one CUDA graph on a GPU "
                           "(core/lenet/whole_step.py; one device, in-memory data, AdamW)", runtime=True)
    sync_check: bool = opt(False, "CUDA: fail at a host synchronisation in a step (from a shape's 4th)", runtime=True)
    channels_last: bool = opt(True, "NHWC layout: oneDNN's fast convolutions on CPU, tensor cores on GPU", runtime=True)
    pad_channels: int | str = opt("auto", "with --channels-last, compute conv1's 6 channels as this many; 0: off; "
                                  "auto: 8 or 0, timed here (docs/lenet.md)", runtime=True,
                                  check=flags.number(int, min=6, max=64, zero=True, auto=True))
    # Batch 512 (lr 8e-3): as accurate as 128 or 256, 1.2-1.5x the samples/s on 2 CPU cores. 16 epochs with label
    # smoothing: 99.42% mean over 5 seeds, against 99.35% for 12 or 16 without (make bench-lenet, docs/lenet.md)
    epochs: int = opt(16, "passes over the training set", min=1, group="optimisation")
    batch_size: int = opt(512, "global batch: split evenly across all processes", min=1, max=60000)
    lr: float = opt(8e-3, "peak learning rate of the schedule", above=0)
    optimizer: str = opt("adamw", "adamw, or sgd (momentum 0.9, nesterov)", ("adamw", "sgd"))
    schedule: str = opt("onecycle", "onecycle (warm-up then cosine decay), cosine, constant",
                        ("onecycle", "cosine", "constant"))
    weight_decay: float = opt(5e-4, "decoupled weight decay (AdamW) or L2 (SGD)", min=0)
    label_smoothing: float = opt(0.1, "share of each target spread over the other classes", min=0, below=1, since=0.0)
    seed: int = opt(0, "seed of the weights, the data order and the augmentation", min=0)
    activation: str = opt("relu", "relu, gelu_torch (F.gelu), gelu_py, gelu_cpp (gelu_ext/)", ACTIVATIONS,
                          group="model and data")
    gelu_approximate: str = opt("none", "GELU form for the gelu_* activations: none (erf) or tanh", ("none", "tanh"))
    augment: bool = opt(True, "random shifts of up to 2 pixels")
    data: str = opt("memory", "memory: whole split as tensors, sliced; loader: Dataset + DataLoader",
                    ("memory", "loader"), runtime=True)
    num_workers: int = opt(0, "DataLoader worker processes (--data loader only)", min=0, max=256, runtime=True)
    data_dir: str = opt("data/mnist", "folder for the MNIST files", check=flags.Folder(), runtime=True)
    mirror: str = opt("", "URL or folder with the MNIST .gz files (default: $MNIST_MIRROR, then upstream)",
                      check=flags.Source(), runtime=True)
    train_samples: int = opt(0, "train on the first N training images (0: all 60,000)", min=1, max=60000, zero=True)
    test_samples: int = opt(0, "evaluate on the first N test images (0: all 10,000)", min=1, max=10000, zero=True,
                            since=0)
    max_steps: int = opt(0, "stop after this many optimizer steps (0: all epochs)", min=0, runtime=True)
    out_dir: str = opt("runs", "folder holding one folder per run", check=flags.Folder(),
                       group="output and resumption", runtime=True)
    run_name: str = opt("", "run folder (default: lenet-<activation>-<date-time>)", check=flags.RunName(), runtime=True)
    log_every: int = opt(50, "steps between train-loss log points", min=1, runtime=True)
    eval_every: int = opt(0, "steps between extra test evaluations (0: only at epoch ends)", min=0, runtime=True)
    checkpoint_every: int = opt(0, "steps between checkpoints (0: only at epoch ends)", min=0, runtime=True)
    keep_last: int = opt(3, "checkpoints kept", min=1, runtime=True)
    resume: str = resume_flag()
    requeue_signal: str = requeue_flag()
    cache_dir: str = opt("", "--precision auto's timings (default: $FABRIC_LAB_CACHE, then ~/.cache/fabric-lab)",
                         check=flags.Folder(optional=True), runtime=True)
    tb_images: bool = opt(True, "confusion matrix, mistakes, feature maps, histograms in TensorBoard", runtime=True)


# ----------------------------------------------------------------------------- model
class LeNet5(nn.Module):
    """LeCun et al. 1998: two conv+pool stages, three fully connected layers (61,706 parameters)."""

    def __init__(self, cfg: Config):
        super().__init__()
        act = lambda: make_activation(cfg)  # noqa: E731 - a fresh module per use keeps the graph readable
        # ReLU is monotone, so max-pooling before it gives the same values and gradients with the activation
        # on a quarter of the elements (a tenth of the step on CPU); GELU is not, so it keeps conv-act-pool.
        # The parameters keep their names either way (features.0 and features.3).
        relu = cfg.activation == "relu"
        pool_act = (lambda: [nn.MaxPool2d(2), act()]) if relu else (lambda: [act(), nn.MaxPool2d(2)])
        # conv1's 6 channels travel as cfg.pad_channels (zeros in the extra ones) from conv1 to conv2's input, a whole
        # CPU vector (core/lenet/cpu_speed.py); in NCHW the pooling does not vectorize across channels and padding only adds work
        pad = cpu_speed.conv1_channels(cfg) - 6
        self.features = nn.Sequential(
            cpu_speed.ZeroPaddedConv2d(1, 6, 5, padding=2, pad_out=pad), *pool_act(),   # 1x28x28 -> 6x28x28 -> 6x14x14
            cpu_speed.ZeroPaddedConv2d(6, 16, 5, pad_in=pad), *pool_act(),              # -> 16x10x10 -> 16x5x5
        )
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(16 * 5 * 5, 120), act(), nn.Linear(120, 84), act(), nn.Linear(84, 10),
        )

    autocast_dtype: torch.dtype | None = None  # set for --strategy dp under bf16-mixed, see make_model()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.autocast_dtype is not None:  # entered again here, in whichever thread runs this replica
            with torch.autocast(x.device.type, dtype=self.autocast_dtype):
                return self.classifier(self.features(x))
        return self.classifier(self.features(x))


def make_activation(cfg: Config) -> nn.Module:
    from gelu_ext import GELU

    return nn.ReLU() if cfg.activation == "relu" else GELU(impl=cfg.activation[5:], approximate=cfg.gelu_approximate)


# ----------------------------------------------------------------------------- data
def epoch_order(n: int, epoch: int, cfg: Config, rank: int, world: int) -> torch.Tensor:
    """This rank's sample indices for an epoch. The same permutation, padding and rank interleaving as
    DistributedSampler(shuffle=True, seed=cfg.seed), so every global batch is the same whatever the
    number of processes, and the in-memory and DataLoader paths see the same samples in the same order.
    The padding (the permutation's first indices again, up to a multiple of `world`) gives every rank the
    same number of steps: with one step more on one rank, the others would wait for it forever."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(cfg.seed + epoch))
    total = math.ceil(n / world) * world
    return order.repeat(math.ceil(total / n))[:total][rank::world]


def train_batches(fabric: Fabric, cfg: Config, train, order: torch.Tensor, start: int, first_step: int,
                  local_batch: int, train_windows):
    """Yield this rank's batches from batch `start` on, on the device and shifted there (each step's shifts drawn from
    its seed: step_shifts), each as (samples, (images, labels)); `first_step`: the global step of the epoch's batch 0.
    In memory a batch and its shifts are one gather from the split's `train_windows` (memory_windows: its pixels'
    windows, normalized as gathered, and the labels); otherwise a DataLoader over `train` feeds them."""
    steps = itertools.count(first_step + start)
    if cfg.data == "memory":
        x, y = train_windows
        order = order.to(x.device)  # on a GPU the data set is there too: each batch a gather, no host copy
        for step, i in zip(steps, range(start * local_batch, len(order), local_batch)):
            idx = order[i:i + local_batch]
            at = step_shifts(fabric, cfg, step, len(idx), x.device) if cfg.augment else (whole_step.centre(x),) * 2
            yield len(idx), (datasets_local.normalize(x[(idx, *at)]), y[idx])
    else:
        sampler = order[start * local_batch:].tolist()
        loader = DataLoader(train, batch_size=local_batch, sampler=sampler, num_workers=cfg.num_workers)
        for step, (xb, yb) in zip(steps, loader):
            xb, yb = xb.to(fabric.device, non_blocking=True), yb.to(fabric.device, non_blocking=True)
            if cfg.augment:
                xb = datasets_local.shift(xb, *step_shifts(fabric, cfg, step, len(xb), xb.device))
            yield len(yb), (xb, yb)


def step_shifts(fabric: Fabric, cfg: Config, step: int, n: int, device: torch.device) -> torch.Tensor:
    """A step's shifts of its n images, (rows, columns), drawn on the device from the step's seed (one per step and
    rank: whole_step.shift_seed): the same draw whichever path feeds the step (memory, DataLoader, whole step)."""
    seed = whole_step.shift_seed(cfg, step, fabric)
    return datasets_local.shift_offsets(n, torch.Generator(device).manual_seed(seed))


# ----------------------------------------------------------------------------- training
def train_step(fabric: Fabric, model, optimizer, scheduler, xb, yb, cfg: Config) -> torch.Tensor:
    """One optimizer step on a batch (on the device, shifted there: train_batches); the loss stays on the device."""
    if cfg.channels_last:
        xb = xb.contiguous(memory_format=torch.channels_last)
    loss = F.cross_entropy(model(xb), yb, label_smoothing=cfg.label_smoothing)
    fabric.backward(loss)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()
    return loss.detach()


def train(run: Run, model, optimizer, scheduler, data) -> dict:
    """The epoch loop: resumes at run.state["progress"], evaluates each epoch, checkpoints, stops on request."""
    fabric, cfg, progress = run.fabric, run.cfg, run.state["progress"]
    train_set, test_tensors, train_windows = data
    world, local_batch = fabric.world_size, cfg.batch_size // fabric.world_size
    epoch_steps = steps_per_epoch(len(train_set), cfg, world)
    timer, losses = StepTimer(fabric.device), LossWatch(fabric, cfg.precision)
    draw = cfg.augment and (lambda step, n: step_shifts(fabric, cfg, step, n, fabric.device))
    whole = cfg.cuda_graph and whole_step.WholeStep(fabric, cfg, model, optimizer, scheduler, train_windows,
                                                    local_batch, epoch_steps, draw, datasets_local.normalize)
    shapes = collections.Counter()  # a new batch shape (an epoch's last batch) is compiled and captured anew
    result = {}
    while progress.epoch < cfg.epochs and not reached_max_steps(progress, cfg):
        epoch, epoch_start_time, data_wait, seen = progress.epoch, progress.train_time_s, 0.0, 0
        order = epoch_order(len(train_set), epoch, cfg, fabric.global_rank, world)
        first_step = progress.global_step - progress.step_in_epoch
        batches = (whole.epoch(order, progress.step_in_epoch, first_step) if whole else
                   train_batches(fabric, cfg, train_set, order, progress.step_in_epoch, first_step, local_batch,
                                 train_windows))
        left = epoch_steps - progress.step_in_epoch  # the bar counts the steps this run takes (--max-steps included)
        left = max(0, min(left, cfg.max_steps - progress.global_step)) if cfg.max_steps else left
        timer.start()
        t_fetch = time.perf_counter()
        # a stop raised mid-epoch closes the batches there: a DataLoader's workers end as at an epoch's end, cleaning
        # up after themselves, not terminated by the interpreter's exit (which leaves their /tmp/pymp-* folders)
        with contextlib.closing(batches):
            for n, batch in progress_bar(fabric, batches, left, f"epoch {epoch + 1}/{cfg.epochs}"):
                shape = batch[0].shape if batch else "whole step"  # the whole step: warm-up steps, then its capture
                shapes[shape] += 1
                data_wait += time.perf_counter() - t_fetch
                # the sync check starts once the shape's warm-up (and the whole step's capture) is done
                with host_sync_forbidden(cfg.sync_check and shapes[shape] > 3 + bool(whole)):
                    loss = whole() if whole else train_step(fabric, model, optimizer, scheduler, *batch, cfg)
                timer.stop()  # the step and the fetch of its batch: training time; check points below are not
                progress.step_in_epoch += 1
                progress.global_step += 1
                seen += n * world
                losses.add(progress.global_step, loss, weight=n)
                if check_point(run, model, losses, timer, test_tensors):
                    break
                timer.start()
                t_fetch = time.perf_counter()
        fold_losses(run, losses, timer)  # the epoch's last steps
        speed = {"epoch_time_s": progress.train_time_s - epoch_start_time, "seen": seen, "data_wait": data_wait}
        result = end_epoch(run, model, test_tensors, epoch, speed, epoch_steps, timer)
        more = progress.epoch < cfg.epochs and not reached_max_steps(progress, cfg)
        if more and run.stop.requested(fabric)[0]:  # a signal during the epoch's evaluation or save: stop there
            raise run.stopped()
    result = result or evaluate(fabric, model, test_tensors)  # nothing left to train: the checkpoint's own scores
    return {**result, "cuda_graph": whole.described()} if whole else result


def check_point(run: Run, model, losses: LossWatch, timer: StepTimer, test_tensors) -> bool:
    """After a step: the train loss every --log-every steps, an evaluation every --eval-every, a checkpoint every
    --checkpoint-every and on a stop request (then the stop). True at --max-steps."""
    fabric, cfg, progress = run.fabric, run.cfg, run.state["progress"]
    step = progress.global_step
    (stopping,), last = run.stop.requested(fabric), reached_max_steps(progress, cfg)
    log_due, eval_due = step % cfg.log_every == 0, cfg.eval_every and step % cfg.eval_every == 0
    save_due = (cfg.checkpoint_every and step % cfg.checkpoint_every == 0) or stopping
    if log_due or eval_due or save_due or last:
        loss = fold_losses(run, losses, timer)
        if log_due:
            run.logger.log_metrics({"train/loss": loss, "train/lr": run.state["scheduler"].get_last_lr()[0]}, step=step)
    if eval_due:
        result, seconds = evaluate(fabric, model, test_tensors), progress.train_time_s
        progress.history.append({"epoch": progress.epoch + 1, "step": step, "train_time_s": seconds, "partial": True,
                                 "wall_s": timer.wall(), **{k: result[k] for k in ("test_loss", "test_acc")}})
        run.logger.log_metrics({"test/loss": result["test_loss"], "test/acc": result["test_acc"]}, step=step)
        fabric.print(f"  step {step}: test acc {100 * result['test_acc']:.2f}% after {seconds:.2f} s of training")
        stopping = stopping or run.stop.requested(fabric)[0]  # a signal during it: stop at this step
    if save_due or stopping:
        run.save(step)
        stopping = stopping or run.stop.requested(fabric)[0]  # during the save: that checkpoint is the stop's
    if stopping:
        raise run.stopped()
    return last


def fold_losses(run: Run, losses: LossWatch, timer: StepTimer) -> float:
    """The steps since the last check point, read from the device in one transfer: their time into the training time,
    each loss into the epoch's running mean in step order (a resumed run's mean is the uninterrupted one's); a
    non-finite loss on any rank stops the run, naming its step. Returns the last step's loss (this rank's)."""
    progress = run.state["progress"]
    read = losses.read(f"epoch {progress.epoch + 1}", run.last_checkpoint, progress.global_step)
    progress.train_time_s += sum(seconds for seconds, _ in timer.collect())
    for r in read:
        progress.loss_sum += r.loss * r.weight
        progress.loss_count += r.weight
    return read[-1].loss if read else math.nan


def end_epoch(run: Run, model, test_tensors, epoch: int, speed: dict, epoch_steps: int, timer: StepTimer) -> dict:
    """Evaluate, print and log the epoch, and checkpoint it (a finished epoch moves the counters to the next). `speed`:
    this process's training time in the epoch, the samples all ranks saw in it, and its wait for data; `timer`'s wall
    clock dates the record, the evaluation included."""
    fabric, cfg, progress = run.fabric, run.cfg, run.state["progress"]
    seconds = speed["epoch_time_s"]
    result = evaluate(fabric, model, test_tensors)
    record = {"epoch": epoch + 1, "step": progress.global_step,
              "train_loss": progress.loss_sum / max(progress.loss_count, 1), "epoch_time_s": seconds,
              "samples_per_s": speed["seen"] / seconds if seconds else 0.0,
              "data_wait_share": speed["data_wait"] / seconds if seconds else 0.0,
              "train_time_s": progress.train_time_s, "wall_s": timer.wall(),
              **{k: result[k] for k in ("test_loss", "test_acc")}}
    progress.history.append(record)
    figures.print_epoch(fabric, record, cfg.epochs)
    run.logger.log_metrics({"test/loss": record["test_loss"], "test/acc": record["test_acc"],
                            "train/epoch_loss": record["train_loss"], "perf/samples_per_s": record["samples_per_s"],
                            "perf/data_wait_share": record["data_wait_share"],
                            **figures.system_metrics(fabric.device)}, step=record["step"])
    if cfg.tb_images and fabric.is_global_zero:
        figures.log_images(run.logger.experiment, model, result, test_tensors, record["step"])
    if progress.step_in_epoch >= epoch_steps:
        progress.epoch, progress.step_in_epoch, progress.loss_sum, progress.loss_count = epoch + 1, 0, 0.0, 0
    run.save(progress.global_step)
    return result


def reached_max_steps(progress: Progress, cfg: Config) -> bool:
    return bool(cfg.max_steps) and progress.global_step >= cfg.max_steps


def steps_per_epoch(n_samples: int, cfg: Config, world: int) -> int:
    """Optimizer steps in one epoch: each rank takes batch_size / world of its n_samples / world samples."""
    return math.ceil(n_samples / world / (cfg.batch_size // world))


def make_optimizer(cfg: Config, model, total_steps: int):
    if cfg.optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=0.9, nesterov=True, weight_decay=cfg.weight_decay)
    else:  # fused: one kernel for all parameters instead of a loop of small ones (matters at LeNet's size)
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, fused=True)
    schedules = torch.optim.lr_scheduler  # onecycle: warm-up, then cosine decay
    warm_up = 0.25 if total_steps == 5 else 0.2  # OneCycleLR divides by zero for a warm-up of one step (0.2 x 5)
    make = {"onecycle": lambda: schedules.OneCycleLR(opt, max_lr=cfg.lr, total_steps=total_steps, pct_start=warm_up),
            "cosine": lambda: schedules.CosineAnnealingLR(opt, T_max=total_steps),
            "constant": lambda: schedules.LambdaLR(opt, lambda step: 1.0)}
    return opt, make[cfg.schedule]()


@torch.no_grad()
def evaluate(fabric: Fabric, model: nn.Module, test_tensors, batch: int = 1000) -> dict:
    """Test loss, accuracy, per-class accuracy and confusion matrix (each rank scores its shard, torchmetrics gathers
    the counts), and the test indices of this rank's first 64 errors, for TensorBoard's misclassified digits."""
    model.eval()
    rank, world = fabric.global_rank, fabric.world_size
    x, y = (t[rank::world] for t in test_tensors)
    # validate_args=False: torchmetrics' check reads each batch's labels back from a GPU (torch.unique), a wait per
    # batch and metric; the labels are MNIST's, verified when loaded
    acc = MulticlassAccuracy(num_classes=10, average="micro", validate_args=False).to(fabric.device)
    per_class = MulticlassAccuracy(num_classes=10, average=None, validate_args=False).to(fabric.device)
    confusion = MulticlassConfusionMatrix(num_classes=10, validate_args=False).to(fabric.device)
    loss_sum = torch.zeros((), device=fabric.device, dtype=torch.float64)
    wrong = []
    for i in range(0, len(y), batch):
        xb, yb = x[i:i + batch].to(fabric.device), y[i:i + batch].to(fabric.device)
        logits = model(xb).float()
        loss_sum += F.cross_entropy(logits, yb, reduction="sum").double()
        for metric in (acc, per_class, confusion):
            metric.update(logits, yb)
        wrong.append(logits.argmax(1) != yb)  # read once, after the loop: a GPU is not waited for per batch
    total = fabric.all_reduce(loss_sum, reduce_op="sum")
    model.train()
    return {"test_loss": float(total) / len(test_tensors[1]), "test_acc": float(acc.compute()),
            "per_class_acc": per_class.compute().tolist(), "confusion": confusion.compute().tolist(),
            "misclassified": (rank + torch.cat(wrong).nonzero().flatten()[:64] * world).tolist()}


def validate(cfg: Config) -> dict | None:
    """Every impossible combination is refused here, before data or model are touched. Returns what --precision
    auto measured on a CPU (None when it did not measure; for a resume, the precision it trained in)."""
    flags.check_config(cfg)  # each flag's own range, again for a config built in Python
    world = cfg.layout.world
    if cfg.batch_size % world:
        raise ConfigError(f"--batch-size {cfg.batch_size} is the global batch and must divide evenly across "
                          f"{world} processes; use a multiple of {world}")
    check_launcher(cfg.num_nodes, cfg.devices, "fabric_lenet.py")
    gpu = check_hardware(cfg.accelerator, cfg.devices, cfg.precision)
    if cfg.layout.threads and not gpu:
        raise ConfigError("--strategy dp splits batches across GPUs in one process and needs CUDA; "
                          "on CPU use --strategy ddp")
    if cfg.layout.threads and cfg.num_nodes > 1:
        raise ConfigError("--strategy dp runs in one process on one node; use ddp for several nodes")
    if cfg.sync_check and not gpu:
        raise ConfigError("--sync-check watches for CUDA host synchronisation and needs a GPU; a CPU step has none to "
                          "find (tests/test_lenet.py counts host reads on CPU instead)")
    if cfg.compile_mode != "default" and not cfg.compile:
        raise ConfigError(f"--compile-mode {cfg.compile_mode} is a mode of torch.compile; add --compile")
    if cfg.cuda_graph:
        check_whole_step(cfg)
    if not cfg.channels_last and cfg.pad_channels not in ("auto", 0):
        raise ConfigError(f"--pad-channels {cfg.pad_channels} pads conv1's output in the channels-last layout and "
                          "--no-channels-last computes in NCHW, where it would pad nothing; drop one of them")
    if cfg.num_workers and cfg.data != "loader":
        raise ConfigError("--num-workers applies to --data loader only; the in-memory path has no workers")
    # each worker hands its batches over by a Unix socket at $TMPDIR/pymp-<8>/listener-<8>: 107 bytes at most
    if cfg.num_workers and len(os.fsencode(tempfile.gettempdir())) > 75:
        raise ConfigError(f"--num-workers {cfg.num_workers}: the temporary folder {tempfile.gettempdir()} is longer "
                          "than the 75 bytes a DataLoader worker's socket path leaves it (no batch would reach the "
                          "training: it fails or waits forever); set TMPDIR to a shorter folder, e.g. TMPDIR=/tmp")
    if cfg.gelu_approximate != "none" and not cfg.activation.startswith("gelu"):
        raise ConfigError(f"--gelu-approximate {cfg.gelu_approximate} is the form of the gelu_* activations and "
                          f"--activation {cfg.activation} computes no GELU; add --activation gelu_torch (or gelu_py, "
                          "gelu_cpp), or drop --gelu-approximate")
    if cfg.activation == "gelu_cpp":
        from gelu_ext import load_cpp

        load_cpp()  # build once here, before Fabric starts worker processes that would race to build it
    probe = None  # a resumed run's own precision and padding (NCHW pads nothing), never measured again
    resumed = take_resumed_choices(cfg, "lenet", ("precision", "pad_channels"),
                                   lambda name, value: name != "pad_channels" or cfg.channels_last)
    if "auto" in (cfg.precision, cfg.pad_channels):  # resolved here, so config.json and resume compare what ran
        make = lambda pad: LeNet5(dataclasses.replace(cfg, pad_channels=pad))  # noqa: E731
        cfg.precision, cfg.pad_channels, probe = cpu_speed.lenet_cpu_choice(cfg, make)
    if resumed:
        probe = {**(probe or {}), "resumed": resumed}
    disk.check_disk(cfg, disk_plan(cfg))  # the first checkpoint and the first epoch's figures fit, or no step is taken
    return probe


def disk_plan(cfg: Config) -> dict:
    """The bytes this run writes (core/plan/disk.py) beside its folder's free space."""
    params = list(LeNet5(cfg).parameters())
    return disk.lenet_disk_plan(cfg, sum(p.numel() for p in params), len(params))


def check_whole_step(cfg: Config) -> None:
    """--cuda-graph's step is one device's, on its in-memory data, with AdamW: refuse what it cannot be."""
    refusals = [
        (cfg.layout.world > 1 or cfg.layout.threads, f"--strategy {cfg.strategy} on {cfg.devices} device(s) x "
         f"{cfg.num_nodes} node(s): the graph is one device's step; use one device"),
        (cfg.data != "memory", "--data loader: the step gathers its batch on the device; use --data memory"),
        (cfg.compile, "--compile: torch.compile's own CUDA graphs are --compile --compile-mode reduce-overhead"),
        (cfg.precision == "16-mixed", "--precision 16-mixed: its loss scaler reads each step's overflow on the "
         "host; use bf16-mixed"),
        (cfg.optimizer != "adamw", "--optimizer sgd: the graph's optimizer is AdamW (capturable); use adamw"),
    ]
    for refused, why in refusals:
        if refused:
            raise ConfigError(f"--cuda-graph with {why}")


# ----------------------------------------------------------------------------- main
def parse_args(argv=None) -> Config:
    cfg = flags.parse_config(Config, argv, __doc__, prog="fabric_lenet.py")
    # under `fabric run`: its --devices and the rest where the command line left the defaults
    return take_fabric_run_settings(cfg, sys.argv[1:] if argv is None else [str(a) for a in argv])


def main(argv=None) -> dict:
    with exits(GeluBuildError, datasets_local.MNISTError) as stop:  # an expected failure is one line `error: ...`
        cfg = parse_args(argv)
        probe = validate(cfg)
        if (finished := find_run(cfg, "lenet", reached_its_end)) is not None:
            return finished  # --resume auto of a run that already reached its end: nothing to train
        stop.listen(cfg.requeue_signal)  # from here a signal saves and stops the run, or lets its record finish
        keep_freed_memory_in_heap()
        fabric = Fabric(accelerator=cfg.accelerator, devices=cfg.devices, num_nodes=cfg.num_nodes,
                        strategy=cfg.strategy, precision=cfg.precision)
        launch(fabric, cfg.num_nodes, cfg.node_timeout)
        cpu_speed.agree_on_precision(fabric, cfg.precision, probe)
        fabric.seed_everything(cfg.seed)
        with fabric.rank_zero_first():  # rank 0 downloads; the others then read the verified files
            train_set, test_set = load_data(cfg)
        model, compute = make_model(cfg)
        total_steps = cfg.epochs * steps_per_epoch(len(train_set), cfg, fabric.world_size)
        optimizer, scheduler = make_optimizer(cfg, model, total_steps)
        model, optimizer = fabric.setup(model, optimizer)
        progress = Progress(epoch=0, step_in_epoch=0, global_step=0, loss_sum=0.0, loss_count=0,
                            train_time_s=0.0, history=[])
        run = Run(fabric, cfg, "lenet", dict(model=model, optimizer=optimizer, scheduler=scheduler, progress=progress),
                  stop, checkpoint_bytes=disk_plan(cfg)["checkpoint"])
        on_disk = disk_plan(cfg)  # again, in the folder Run has named
        fabric.print(f"device: {fabric.device} x {fabric.world_size} process(es), precision {cfg.precision}")
        disk.print_disk_plan(cfg, on_disk, fabric.print)
        if cfg.cuda_graph and fabric.device.type != "cuda":
            fabric.print(f"CUDA graph: not captured on {fabric.device.type}; the whole step runs as the same static program")
        if fabric.device.type != "cuda" and (graphs := cuda_graphs(cfg.compile, cfg.compile_mode, fabric.device)):
            fabric.print(f"CUDA graphs: {graphs}")  # on a GPU: known after a step
        run.start()  # resume from the newest good checkpoint, or start
        if cfg.resume:
            fabric.print(f"continuing at epoch {progress.epoch + 1}, step {progress.global_step}")
        first_epoch_here, first_step_here = progress.epoch, progress.global_step
        # in-memory data lives where the model does (on a GPU 280 MB, moved once): a step copies nothing from the host
        on_device = lambda tensors: tuple(t.to(fabric.device) for t in tensors)  # noqa: E731
        data = (train_set, on_device(test_set.tensors()),
                memory_windows(train_set, fabric.device) if cfg.data == "memory" else None)
        result = train(run, model, optimizer, scheduler, data)
        record = figures.summarize(fabric, cfg, result, progress, len(train_set), first_epoch_here, compute, probe)
        summary = run.finish(record, {f"hparams/{k}": result[k] for k in ("test_acc", "test_loss")},
                             trained=progress.global_step > first_step_here)
    figures.print_summary(fabric, summary)
    return summary


def load_data(cfg: Config):
    """Train and test splits, parsed once from the IDX files (downloaded or copied from the mirror)."""
    train = datasets_local.MNIST(cfg.data_dir, train=True, download=True, mirror=cfg.mirror or None)
    test = datasets_local.MNIST(cfg.data_dir, train=False, download=True, mirror=cfg.mirror or None)
    # a quick check's first n of a split (each flag bounded by its split's size); an evaluation of all 10,000 test
    # images in emulated bf16 takes 4 s on an AVX2 CPU
    for split, n in ((train, cfg.train_samples), (test, cfg.test_samples)):
        if n:
            split.images, split.labels = split.images[:n], split.labels[:n]
    return train, test


def memory_windows(train_set, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The in-memory path's training split on the device: its images as datasets_local.windows of their raw pixels
    (every shift of each, a view of one copy padded with 0, the pixel whose normalization is the background: 61 MB in
    uint8 where float32 took 245 MB, docs/lenet.md), each batch normalized as it is gathered, and its labels."""
    return datasets_local.windows(train_set.images.unsqueeze(1).to(device), fill=0), train_set.labels.to(device)


def make_model(cfg: Config) -> tuple[nn.Module, dict]:
    """LeNet-5 in the run's layout and compiled form, and a dict that conv1's output fills with the dtype it
    computed in (what the record says ran)."""
    model = LeNet5(cfg)
    if cfg.layout.threads and cfg.precision == "bf16-mixed":
        # DataParallel's worker threads re-enter autocast without its dtype, so the replicas would compute in
        # the thread's default, float16 on CUDA, with no loss scaler: the model names its dtype itself
        model.autocast_dtype = torch.bfloat16
    compute = {"dtype": None}  # its key there from the start: compiled, a change of keys fails a guard (recompiles)

    def note_dtype(module, args, out) -> None:
        compute["dtype"] = str(out.dtype)
    model.features[0].register_forward_hook(note_dtype)
    if cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)
    if cfg.compile:
        compile_cache_per_caps()
        # static: the short last batch gets its own graph (a dynamic one would recapture every later full batch)
        model = torch.compile(model, mode=None if cfg.compile_mode == "default" else cfg.compile_mode, dynamic=False)
    return model, compute


def reached_its_end(record: dict, cfg: Config) -> bool:
    """An earlier run's record reached what this command asks for: --max-steps steps, else all --epochs."""
    whole = cfg.epochs * steps_per_epoch(cfg.train_samples or 60_000, cfg, cfg.layout.world)  # MNIST's 60,000
    return record.get("steps", 0) >= (min(whole, cfg.max_steps) if cfg.max_steps else whole)


if __name__ == "__main__":
    with exit_without_teardown():  # 2 s of CPU in every rank, and C++ threads torn down mid-call
        main()
