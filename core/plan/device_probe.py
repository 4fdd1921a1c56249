"""What this machine does, measured on it and cached per machine: the measured side of the time model
(perf_model.py), on its CPU, or on its GPU when a run is planned there (cached per GPU model).

A GPT-2 step is not its FLOPs over a peak. Small models spend most of a step in per-operation and per-collective
overheads that depend on the strategy (FSDP's hooks, DTensor's dispatch, DeepSpeed's engine; on a GPU the kernels'
launches and the host's reads), and matmuls at a run's shapes and dtype reach a share of the peak that no constant
describes (a bf16 autocast run without bf16 instructions; on the H200 the 1.6B model's micro-batch 1 at 8-11% MFU
and micro-batch 8 at 31%, where a preset's peak x 0.45 planned 45% at both). So the step is predicted from three
measurements of the device the run would use:

- the strategy's **fixed cost**: a real step of the same strategy, precision, processes, layers and micro-batches on
  a minimal model (width 8 per head, 8 tokens, 16 words), which holds every per-op, per-hook, per-launch and
  per-collective cost;
- the **work that grows with the model**: one GPT-2 block and the LM head with its loss, forward and backward, at
  the run's shape, in the dtype the run computes in (autocast's or the weights'), with the threads a rank gets (on a
  GPU its matmuls, attention and elementwise kernels queued as a step queues them), less the same at the minimal
  shape;
- **bandwidths**: the device's memory (a copy, for the optimizer's sweep over its states) and, on a CPU, the gloo
  link between two processes (latency and bytes/s), for the bytes the strategy moves. One GPU measures no NVLink or
  network: between GPUs the plan keeps its preset's figures, and says so.

The fixed cost is a real run of the training script that asked for the plan (fabric_gpt.py gives its own path, as
this layer stands below it). Every measurement is cached per machine (core/run/measurements.py), and a GPU's under
its name as well.
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from core.gpt.gpt_model import compute_dtype
from core.run.measurements import cached, rank_threads, seconds_per_call, threads

MINIMAL = {"n_embd_per_head": 8, "seq_len": 8, "vocab_size": 16, "micro_batch_size": 1}
FIXED_STEPS, FIXED_WARMUP = 10, 4


def on_device(device: str) -> dict:
    """What a measurement's cache entry adds for a GPU: its model (a CPU's entries stay as they were)."""
    return {} if device == "cpu" else {"gpu": torch.cuda.get_device_name(torch.device(device))}


def synchronizer(device: str):
    return (lambda: torch.cuda.synchronize(device)) if device != "cpu" else (lambda: None)


def block_and_head(gpt2_config, micro_batch: int, precision: str, deepspeed: bool, n_threads: int,
                   allow_measure: bool = True, device: str = "cpu") -> dict | None:
    """Seconds of one GPT-2 block's and of the LM head's (with the cross-entropy) forward and backward on one
    micro-batch, measured here on `device` (cached)."""
    c = gpt2_config
    settings = {"n_embd": c.n_embd, "n_head": c.n_head, "seq_len": c.n_positions, "vocab_size": c.vocab_size,
                "micro_batch": micro_batch, "precision": precision, "deepspeed": deepspeed, "threads": n_threads,
                "attention": getattr(c, "_attn_implementation", None) or "as GPT2LMHeadModel picks", **on_device(device)}
    return cached("block", settings,
                  lambda: _measure_block_and_head(c, micro_batch, precision, deepspeed, n_threads, device), allow_measure,
                  timed_threads=n_threads if device == "cpu" else None)


def _measure_block_and_head(c, b: int, precision: str, deepspeed: bool, n_threads: int, device: str = "cpu") -> dict:
    from transformers import GPT2LMHeadModel
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    weights, autocast = compute_dtype(precision, deepspeed)
    with torch.device("meta"):  # the attention implementation the whole model picks (SDPA), set on its config
        c = GPT2LMHeadModel(c).config
    torch.manual_seed(0)
    kind = torch.device(device).type
    with threads(n_threads), torch.device(device):
        block = GPT2Block(c).to(weights)
        head = torch.nn.Linear(c.n_embd, c.vocab_size, bias=False).to(weights)
        x = torch.randn(b, c.n_positions, c.n_embd, dtype=weights, requires_grad=True)
        y = torch.randint(0, c.vocab_size, (b * c.n_positions,))

        def run(fn):
            def step():
                with torch.autocast(kind, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
                    out = fn()
                out.backward()
            return seconds_per_call(step, sync=synchronizer(device))

        first = lambda out: out[0] if isinstance(out, tuple) else out  # noqa: E731 (transformers 4 gave tuples)
        block_s = run(lambda: first(block(x)).float().sum())
        head_s = run(lambda: torch.nn.functional.cross_entropy(head(x).flatten(0, 1).float(), y))
    return {"block_s": block_s, "head_s": head_s}


# ----------------------------------------------------------------------------- bandwidths
def memory_bandwidth(n_threads: int, allow_measure: bool = True, device: str = "cpu") -> float | None:
    """Bytes/s of a copy (read and write) with a rank's threads, 64 MiB on a CPU, 1 GiB on a GPU, beyond its caches
    (cached)."""
    def measure():
        with threads(n_threads):
            a = torch.ones(1 << (24 if device == "cpu" else 28), device=device)
            b = torch.empty_like(a)
            seconds = seconds_per_call(lambda: b.copy_(a), seconds=0.3, sync=synchronizer(device))
            return 2 * a.numel() * a.element_size() / seconds
    return cached("memory", {"threads": n_threads, **on_device(device)}, measure, allow_measure,
                  timed_threads=n_threads if device == "cpu" else None)


def gloo_link() -> tuple[float, float]:
    """(latency s, bandwidth bytes/s) of an all-reduce between 2 local processes over gloo (cached)."""
    return tuple(cached("gloo", {}, lambda: list(_measure_gloo_link())))


def _measure_gloo_link(sizes=(1, 1 << 22)) -> tuple[float, float]:
    """The time of a 4-byte all-reduce, and the slope between it and a 16 MiB one over the ring's 2(n-1)/n = 1."""
    import torch.multiprocessing as mp

    queue = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(_gloo_probe, args=(2, sizes, queue, _free_port()), nprocs=2, start_method="spawn")
    small, large = queue.get()
    return small, (sizes[1] - sizes[0]) * 4 / max(large - small, 1e-9)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gloo_probe(rank, world, sizes, queue, port):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    times = []
    for n in sizes:
        t = torch.ones(n)
        for _ in range(3):
            dist.all_reduce(t)
        samples = []
        for _ in range(10):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(t)
            samples.append(time.perf_counter() - start)
        times.append(statistics.median(samples))
    if rank == 0:
        queue.put(times)
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- the fixed cost of a strategy's step
def minimal_flags(cfg, heads: int, device: str = "cpu") -> list[str]:
    """fabric_gpt.py's flags for the same strategy, precision, processes, layers, micro-batches, optimizer and
    memory levers as cfg, on the minimal shape, on `device`'s kind."""
    steps = FIXED_STEPS
    samples = steps * cfg.grad_accum * cfg.layout.dp_size
    out = ["--model", "tiny", "--n-embd", MINIMAL["n_embd_per_head"] * heads, "--n-head", heads,
           "--n-layer", cfg.n_layer, "--seq-len", MINIMAL["seq_len"], "--vocab-size", MINIMAL["vocab_size"],
           "--micro-batch-size", MINIMAL["micro_batch_size"], "--grad-accum", cfg.grad_accum,
           "--num-samples", samples, "--steps", steps, "--timing-warmup", FIXED_WARMUP, "--strategy", cfg.strategy,
           "--precision", cfg.precision if cfg.precision != "auto" else "32-true", "--devices", cfg.devices,
           "--accelerator", torch.device(device).type, "--optimizer", cfg.optimizer,
           "--grad-clip", cfg.grad_clip, "--pp-schedule", cfg.pp_schedule, "--tp-size", cfg.tp_size,
           "--pp-size", cfg.pp_size, "--log-every", steps,
           # the run's precision, attention dtype and GELU, never auto: their probes would wait for the lock this
           # measurement holds (a configuration planned before validate() resolved them plans float32, as accounting does)
           "--attention-precision", attention if (attention := getattr(cfg, "attention_precision", "auto")) != "auto"
           else "autocast", "--gelu-impl", gelu if (gelu := getattr(cfg, "gelu_impl", "auto")) != "auto" else "torch"]
    if cfg.grad_checkpointing:
        out.append("--grad-checkpointing")
    if cfg.compile:
        out.append("--compile")
    return [str(v) for v in out]


def minimal_heads(cfg) -> int:
    """Heads of the minimal model: one, or one per tensor-parallel rank."""
    return cfg.layout.tp_size


def fixed_step(cfg, allow_measure: bool = True, script: str = "", device: str = "cpu") -> float | None:
    """Seconds of one optimizer step of cfg's strategy on the minimal model, run here on `device`'s kind as its own
    job of `script` (the training script whose step it is; cached, and measured only when one is given). NVMe offload
    is measured as offload to memory (its drive traffic is a bandwidth term)."""
    argv = minimal_flags(cfg, minimal_heads(cfg), device)
    # keyed by the threads its ranks get: before ranks.share_the_cores, rank 1 of fsdp, tp and pp kept every core, and
    # those entries (fsdp, tp, pp 13-62% too slow) are not read again
    settings = {"argv": argv, "rank_threads": rank_threads(cfg.devices), **on_device(device)}
    try:
        return cached("fixed", settings, lambda: _run_minimal(script, argv), allow_measure and bool(script))
    except RuntimeError as e:  # the plan goes on without it, as a lower bound, and says why
        print(f"warning: {e}; the time plan is compute alone, a lower bound", file=sys.stderr)
        return None


def _run_minimal(script: str, argv: list[str]) -> float:
    """The minimal run's step time. Its processes are forked from a warm python (warm_python.py): the job is a few
    seconds of steps after 10-20 s of imports a process, twenty times in a lab's first bench (AVX2 EPYC: 7 s a job
    instead of 25, the step time the same within its run-to-run spread)."""
    from core.host import warm_python

    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR",
                                                            "MASTER_PORT", "NODE_RANK", "FABRIC_LAB_LAUNCHER")}
    with tempfile.TemporaryDirectory(prefix="fixed-cost-") as out:
        done = subprocess.run([warm_python.executable(), str(script), *argv, "--out-dir", out, "--run-name", "probe"],
                              env=env, capture_output=True, text=True)
        if done.returncode:
            tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise RuntimeError(f"the fixed-cost probe ({' '.join(argv)}) failed: {tail}")
        return json.loads((Path(out) / "probe" / "record.json").read_text())["step_time_s"]
