"""The figures of a LeNet-5 run: its record (the last evaluation, training time and speed, steady speed after the
first epoch, time to each target accuracy), the summary table it ends with, and the images it shows in TensorBoard
(confusion matrix, misclassified digits, feature maps, weight histograms). fabric_lenet.py measures; this module
turns the measurements into record.json's fields and what a person reads."""

import math
import statistics

import torch

from core.run.hardware import compiled_graphs, cuda_graphs

TARGETS = (0.99, 0.992)  # test accuracies whose time of training the summary reports


def print_epoch(fabric, r: dict, epochs: int) -> None:
    fabric.print(f"epoch {r['epoch']:>2}/{epochs} | train loss {r['train_loss']:.4f} | test loss "
                 f"{r['test_loss']:.4f} | test acc {100 * r['test_acc']:.2f}% | {r['epoch_time_s']:.2f} s | "
                 f"{r['samples_per_s']:,.0f} samples/s | data wait {100 * r['data_wait_share']:.0f}%")


def samples_trained(progress, n_samples: int, batch_size: int, world: int) -> int:
    """Samples trained on by all ranks so far: whole (padded) epochs, then the full batches of the current one
    (an epoch's last batch is the only short one)."""
    return progress.epoch * math.ceil(n_samples / world) * world + progress.step_in_epoch * batch_size


def system_metrics(device: torch.device) -> dict:
    """The process's memory, and on a GPU its peak allocation and utilization (through pynvml, where installed)."""
    import psutil

    metrics = {"system/process_rss_gb": psutil.Process().memory_info().rss / 2**30}
    if device.type == "cuda":
        metrics["system/gpu_max_allocated_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
        try:
            metrics["system/gpu_utilization_pct"] = torch.cuda.utilization(device)
        except Exception:  # needs pynvml; memory figures above do not
            pass
    return metrics


def steady_speed(history: list[dict], first_epoch_here: int) -> float | None:
    """Samples/s of the steady state: the median epoch of this process after its first (which carries start-up:
    kernel selection, lazy loading, compilation). None with fewer than 2 epochs here. Epoch times are read after the
    epoch's losses come back from the device, so queued GPU work is inside them."""
    speeds = [h["samples_per_s"] for h in history if not h.get("partial") and h["epoch"] > first_epoch_here + 1]
    return statistics.median(speeds) if speeds else None


def time_to_accuracy(history: list[dict]) -> dict:
    """The training time and step at which each target test accuracy was first measured: as fine as the
    evaluation points (--eval-every, else epoch ends), so an upper bound; None where it was never reached. wall_s:
    the seconds from this process's first step to that evaluation's end, evaluations and saves included."""
    reached = {}
    for target in TARGETS:
        first = next((h for h in history if h["test_acc"] >= target), None)
        reached[f"{100 * target:.1f}%"] = first and {"train_time_s": first["train_time_s"], "step": first["step"],
                                                     "wall_s": first.get("wall_s")}
    return reached


def count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def print_summary(fabric, summary: dict) -> None:
    fabric.print(f"\n{'class':>7} | accuracy")
    for digit, acc in enumerate(summary["per_class_acc"]):
        fabric.print(f"{digit:>7} | {100 * acc:6.2f}%")
    subset = summary.get("config", {}).get("test_samples")  # --test-samples: a check's figure, not MNIST's test set
    fabric.print(f"{'all':>7} | {100 * summary['test_acc']:6.2f}%"
                 + (f" (the first {subset:,} test images)" if subset else "") + "\n"
                 f"{count(summary['epochs'], 'epoch')}, {count(summary['steps'], 'step')} in "
                 f"{summary['train_time_s']:.1f} s of training ({summary['samples_per_s']:,.0f} samples/s"
                 + (f", steady {summary['samples_per_s_steady']:,.0f} after the first epoch"
                    if summary["samples_per_s_steady"] else "") + "); "
                 f"run folder {summary['run_dir']}")
    reached = [f"{target} after {r['train_time_s']:.2f} s" + (f" ({r['wall_s']:.2f} s wall)" if r.get("wall_s") else "")
               + f" (step {r['step']})" if r else f"{target} not reached" for target, r in summary["time_to_accuracy"].items()]
    fabric.print(f"time to test accuracy: {', '.join(reached)}; measured at evaluation points (--eval-every); wall: from "
                 "the first step, evaluations and saves included")
    if summary.get("compiled_graphs") is None and summary["cuda_graphs"]:  # --cuda-graph
        fabric.print(f"CUDA graph: {summary['cuda_graphs']}")
    if summary.get("compiled_graphs"):
        graphs = f"; CUDA graphs {summary['cuda_graphs']}" if summary["cuda_graphs"] else ""
        fabric.print(f"torch.compile: {count(summary['compiled_graphs'], 'graph')} (one per batch shape and mode){graphs}")


def summarize(fabric, cfg, result: dict, progress, n_train: int, first_epoch_here: int, compute: dict,
              probe: dict | None) -> dict:
    """The run's record: the last evaluation, the training time and speed, time to accuracy, the whole history."""
    samples = samples_trained(progress, n_train, cfg.batch_size, fabric.world_size)
    return {"test_acc": result["test_acc"], "test_loss": result["test_loss"],
            "per_class_acc": result["per_class_acc"], "confusion": result["confusion"],
            "epochs": progress.epoch + (1 if progress.step_in_epoch else 0), "steps": progress.global_step,
            "train_time_s": progress.train_time_s, "samples_per_s": samples / max(progress.train_time_s, 1e-9),
            "world_size": fabric.world_size, "device": str(fabric.device), "precision_probe": probe,
            "compute_dtype": compute["dtype"], "cuda_graphs": result.get("cuda_graph") or cuda_graphs(cfg.compile, cfg.compile_mode, fabric.device),
            "compiled_graphs": compiled_graphs() if cfg.compile else None,
            "time_to_accuracy": time_to_accuracy(progress.history),
            "samples_per_s_steady": steady_speed(progress.history, first_epoch_here),
            "history": progress.history, "epoch_history": [h for h in progress.history if not h.get("partial")]}


def image_grid(images: torch.Tensor, per_row: int, scale_each: bool = False) -> torch.Tensor:
    """(N, 1, H, W) images as one (1, rows * (H + 1) + 1, per_row * (W + 1) + 1) picture with 1-pixel borders, as
    torchvision's make_grid lays them out (torchvision is not a dependency: importing it cost each process 3 s).
    `scale_each`: each image stretched to [0, 1] on its own, as feature maps of different ranges need."""
    if scale_each:
        low = images.amin(dim=(1, 2, 3), keepdim=True)
        images = (images - low) / (images.amax(dim=(1, 2, 3), keepdim=True) - low).clamp_min(1e-5)
    n, _, h, w = images.shape
    rows = -(-n // per_row)
    grid = torch.zeros(1, rows * (h + 1) + 1, per_row * (w + 1) + 1)
    for i, image in enumerate(images):
        r, c = divmod(i, per_row)
        grid[:, 1 + r * (h + 1):(r + 1) * (h + 1), 1 + c * (w + 1):(c + 1) * (w + 1)] = image
    return grid


def log_images(writer, model, result: dict, test_tensors, step: int) -> None:
    """Confusion matrix, misclassified digits, conv feature maps and weight histograms in TensorBoard."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 5))
    ax.imshow(torch.tensor(result["confusion"]).log1p().numpy(), cmap="Blues")
    ax.set(xlabel="predicted", ylabel="true", xticks=range(10), yticks=range(10), title="confusion (log counts)")
    writer.add_figure("test/confusion_matrix", fig, step)
    plt.close(fig)

    module = getattr(model, "module", model)  # unwrapped: so the digits are cast here, as Fabric casts a batch
    weights = next(module.parameters())
    x = test_tensors[0]
    with torch.no_grad():
        if result["misclassified"]:  # found by evaluate(): no second pass over the test set
            wrong = x[result["misclassified"]]
            # each stretched to [0, 1]: the normalised digit's own range, whatever the data's mean and spread
            writer.add_image("test/misclassified", image_grid(wrong, 8, scale_each=True), step)
        maps, hooks = {}, []
        for name, i in (("conv1", 1), ("conv2", 4)):  # outputs of the layer after each convolution; the real channels only
            keep = module.features[i - 1].out_channels
            hooks.append(module.features[i].register_forward_hook(
                lambda m, a, out, n=name, k=keep: maps.__setitem__(n, out[:, :k])))
        module(x[:4].to(weights.device, weights.dtype))  # bf16-true and 64-true hold their weights in that dtype
        for h in hooks:
            h.remove()
        for name, fmap in maps.items():
            fmap = fmap.float().cpu().flatten(0, 1).unsqueeze(1)  # (images*channels, 1, H, W)
            writer.add_image(f"features/{name}", image_grid(fmap, fmap.shape[0] // 4, scale_each=True), step)
    for name, param in module.named_parameters():
        writer.add_histogram(f"weights/{name}", param.detach().float().cpu(), step)
