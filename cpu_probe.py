"""What this CPU does, measured on it and cached per machine: the CPU side of the time model (perf_model.py).

A GPT-2 step on a few CPU cores is not its FLOPs over a peak. Small models spend most of a step in per-operation
and per-collective overheads that depend on the strategy (FSDP's hooks, DTensor's dispatch, DeepSpeed's engine),
and matmuls at a run's shapes and dtype reach a share of the peak that no constant describes (a bf16 autocast run
without bf16 instructions). So the step is predicted from three measurements of this machine:

- the strategy's **fixed cost**: a real step of the same strategy, precision, processes, layers and micro-batches on
  a minimal model (width 8 per head, 8 tokens, 16 words), which holds every per-op, per-hook and per-collective cost;
- the **work that grows with the model**: one GPT-2 block and the LM head with its loss, forward and backward, at
  the run's shape, in the dtype the run computes in (autocast's or the weights'), with the threads a rank gets, less
  the same at the minimal shape;
- **bandwidths**: host memory (a copy, for the optimizer's sweep over its states) and the gloo link between two
  processes (latency and bytes/s), for the bytes the strategy moves.

LeNet-5's CPU speed work lives here too (the last section): the precision its step is fastest in on this CPU
(measured once per machine and settings) and conv1's channels padded to a whole vector.

Results live in ~/.cache/fabric-lab/cpu-probe.json (FABRIC_LAB_CACHE moves it), keyed by the CPU, its instruction-set
caps, torch and the measured settings, under a file lock so that processes started together measure once.
"""

import fcntl
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import torch

from checkpoints import write_json_atomic
from hardware import cpu_name, cpu_units, isa_caps, uses_gpu
from layout import layout
from ranks import any_rank, cores_per_rank

MINIMAL = {"n_embd_per_head": 8, "seq_len": 8, "vocab_size": 16, "micro_batch_size": 1}
FIXED_STEPS, FIXED_WARMUP = 10, 4


def cache_file() -> Path:
    return Path(os.environ.get("FABRIC_LAB_CACHE", "~/.cache/fabric-lab")).expanduser() / "cpu-probe.json"


def machine_key() -> dict:
    """What every measurement depends on: the CPU, its instruction-set caps (ATEN_CPU_CAPABILITY,
    ONEDNN_MAX_CPU_ISA change the kernels as another CPU would) and torch."""
    return {"cpu": cpu_name(), "units": cpu_units(), "cores": os.cpu_count(), "caps": isa_caps(), "torch": torch.__version__}


def entry_name(kind: str, settings: dict) -> str:
    return json.dumps({"kind": kind, **machine_key(), **settings}, sort_keys=True)


def cached(kind: str, settings: dict, measure, allow_measure: bool = True):
    """measure()'s result for (this machine, kind, settings): from the cache, else measured and added to it (None
    when allow_measure is False and nothing is cached)."""
    path, name = cache_file(), entry_name(kind, settings)
    if not allow_measure:  # a look-up: the file is replaced whole (atomic rename), so no lock is needed, and none is
        # taken: the minimal job that a measurement runs looks up its own estimate while its parent holds the lock
        try:
            return json.loads(path.read_text()).get(name, {}).get("value")
        except (OSError, ValueError):
            return None
    entry, _ = stored_or_measured(path, name, dated(measure))
    return entry["value"]


def dated(measure):
    return lambda: {"value": measure(), "date": f"{datetime.now():%Y-%m-%d %H:%M}"}


def stored_or_measured(path: Path, name: str, measure, wait: bool = True) -> tuple[dict, bool]:
    """(the entry under `name` in the JSON file at `path`, True), else (measure()'s entry, added to the file, False).
    A file lock makes processes started together (a launcher's ranks) measure once and read the same answer; with
    `wait` False a process that finds the lock taken measures without it and stores nothing."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:  # a measurement is running (perhaps this process's parent): the next run stores it
            return measure(), False
        try:
            cache = json.loads(path.read_text())
        except (OSError, ValueError):  # none yet, or unreadable: measure
            cache = {}
        if name in cache:
            return cache[name], True
        entry = measure()
        write_json_atomic(path, {**cache, name: entry})
    return entry, False


def forget(kind: str, settings: dict) -> None:
    """Drop the cached measurement of (this machine, kind, settings), one that a run has shown wrong: the next run
    measures it again."""
    path = cache_file()
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            cache = json.loads(path.read_text())
        except (OSError, ValueError):
            return
        if cache.pop(entry_name(kind, settings), None) is not None:
            write_json_atomic(path, cache)


def cached_unlocked(kind: str, settings: dict, measure):
    """As cached(), for a measurement of a second or so taken inside any process, a minimal job that a locked
    measurement runs included: measured without waiting for the lock, and stored only when the lock is free."""
    value = cached(kind, settings, None, allow_measure=False)
    if value is not None:
        return value
    return stored_or_measured(cache_file(), entry_name(kind, settings), dated(measure), wait=False)[0]["value"]


def rank_threads(devices: int) -> int:
    """The intra-op threads one rank gets: all of them alone, an equal share when Fabric starts several
    (ranks.share_the_cores), OMP_NUM_THREADS when set."""
    return int(os.environ.get("OMP_NUM_THREADS") or 0) or (cores_per_rank(devices) if devices > 1
                                                           else torch.get_num_threads())


def seconds_per_call(fn, seconds: float = 0.2, windows: int = 3) -> float:
    """The median of `windows` timings of fn, each at least `seconds` long, after warm-up calls that build the
    kernels (oneDNN on its first calls)."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(windows):
        count, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds / windows or count < 2:
            fn()
            count += 1
        times.append((time.perf_counter() - start) / count)
    return statistics.median(times)


class threads:
    """Run a measurement with a rank's threads, and give the process its own back."""

    def __init__(self, n: int):
        self.n, self.before = n, torch.get_num_threads()

    def __enter__(self):
        torch.set_num_threads(self.n)

    def __exit__(self, *exc):
        torch.set_num_threads(self.before)


# ----------------------------------------------------------------------------- the work of one block and the head
def compute_dtype(precision: str, deepspeed: bool) -> tuple[torch.dtype, torch.dtype | None]:
    """(the weights' dtype, autocast's dtype or None) of a run: Fabric's *-mixed autocasts float32 weights;
    DeepSpeed's bf16/fp16 and *-true keep the weights in the 16-bit type itself."""
    half = torch.bfloat16 if "bf16" in precision else torch.float16 if "16" in precision else None
    if half is None:
        return torch.float32, None
    if precision.endswith("-true") or deepspeed:
        return half, None
    return torch.float32, half


def block_and_head(gpt2_config, micro_batch: int, precision: str, deepspeed: bool, n_threads: int,
                   allow_measure: bool = True) -> dict | None:
    """Seconds of one GPT-2 block's and of the LM head's (with the cross-entropy) forward and backward on one
    micro-batch, measured here (cached)."""
    c = gpt2_config
    settings = {"n_embd": c.n_embd, "n_head": c.n_head, "seq_len": c.n_positions, "vocab_size": c.vocab_size,
                "micro_batch": micro_batch, "precision": precision, "deepspeed": deepspeed, "threads": n_threads,
                "attention": getattr(c, "_attn_implementation", None) or "as GPT2LMHeadModel picks"}
    return cached("block", settings, lambda: _measure_block_and_head(c, micro_batch, precision, deepspeed, n_threads),
                  allow_measure)


def _measure_block_and_head(c, b: int, precision: str, deepspeed: bool, n_threads: int) -> dict:
    from transformers import GPT2LMHeadModel
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    weights, autocast = compute_dtype(precision, deepspeed)
    with torch.device("meta"):  # the attention implementation the whole model picks (SDPA), set on its config
        c = GPT2LMHeadModel(c).config
    torch.manual_seed(0)
    with threads(n_threads):
        block = GPT2Block(c).to(weights)
        head = torch.nn.Linear(c.n_embd, c.vocab_size, bias=False).to(weights)
        x = torch.randn(b, c.n_positions, c.n_embd, dtype=weights, requires_grad=True)
        y = torch.randint(0, c.vocab_size, (b * c.n_positions,))

        def run(fn):
            def step():
                with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
                    out = fn()
                out.backward()
            return seconds_per_call(step)

        first = lambda out: out[0] if isinstance(out, tuple) else out  # noqa: E731 (transformers 4 gave tuples)
        block_s = run(lambda: first(block(x)).float().sum())
        head_s = run(lambda: torch.nn.functional.cross_entropy(head(x).flatten(0, 1).float(), y))
    return {"block_s": block_s, "head_s": head_s}


# ----------------------------------------------------------------------------- attention's dtype
def float32_attention_faster(heads: int, seq_len: int, head_dim: int, micro_batch: int, dtype: torch.dtype,
                             n_threads: int) -> bool:
    """Whether SDPA's forward and backward at this shape run faster in float32 than in the run's 16-bit dtype here
    (cached). On the AVX-512 BF16 EPYC the CPU flash kernel's bf16 backward took 4x its float32 time, more than the
    bf16 matmuls save; a CPU with AMX or without bf16 instructions may differ, so it is measured, not assumed."""
    settings = {"heads": heads, "seq_len": seq_len, "head_dim": head_dim, "micro_batch": micro_batch,
                "dtype": str(dtype), "threads": n_threads}
    return cached("attention", settings, lambda: _measure_attention(settings, dtype, n_threads))["float32_faster"]


def _measure_attention(settings: dict, dtype: torch.dtype, n_threads: int) -> dict:
    shape = (settings["micro_batch"], settings["heads"], settings["seq_len"], settings["head_dim"])
    times = {}
    with threads(n_threads):
        for name, dt in (("float32", torch.float32), ("16-bit", dtype)):
            q, k, v = (torch.randn(shape, dtype=dt, requires_grad=True) for _ in range(3))

            def step():
                out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
                out.backward(torch.ones_like(out))
            times[name] = seconds_per_call(step, seconds=0.1)
    return {"float32_s": times["float32"], "16bit_s": times["16-bit"], "float32_faster": times["float32"] < times["16-bit"]}


# ----------------------------------------------------------------------------- bandwidths
def memory_bandwidth(n_threads: int, allow_measure: bool = True) -> float | None:
    """Bytes/s of a 64 MiB copy (read and write) with a rank's threads (cached)."""
    def measure():
        with threads(n_threads):
            a = torch.ones(1 << 24)
            b = torch.empty_like(a)
            return 2 * a.numel() * a.element_size() / seconds_per_call(lambda: b.copy_(a), seconds=0.3)
    return cached("memory", {"threads": n_threads}, measure, allow_measure)


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
def minimal_flags(cfg, heads: int) -> list[str]:
    """fabric_gpt.py's flags for the same strategy, precision, processes, layers, micro-batches, optimizer and
    memory levers as cfg, on the minimal shape."""
    steps = FIXED_STEPS
    samples = steps * cfg.grad_accum * layout(cfg).dp_size
    out = ["--model", "tiny", "--n-embd", MINIMAL["n_embd_per_head"] * heads, "--n-head", heads,
           "--n-layer", cfg.n_layer, "--seq-len", MINIMAL["seq_len"], "--vocab-size", MINIMAL["vocab_size"],
           "--micro-batch-size", MINIMAL["micro_batch_size"], "--grad-accum", cfg.grad_accum,
           "--num-samples", samples, "--steps", steps, "--timing-warmup", FIXED_WARMUP, "--strategy", cfg.strategy,
           "--precision", cfg.precision, "--devices", cfg.devices, "--accelerator", "cpu", "--optimizer", cfg.optimizer,
           "--grad-clip", cfg.grad_clip, "--pp-schedule", cfg.pp_schedule, "--tp-size", cfg.tp_size,
           "--pp-size", cfg.pp_size, "--log-every", steps,
           # the run's attention dtype, never auto: its probe would wait for the lock this measurement holds
           "--attention-precision", attention if (attention := getattr(cfg, "attention_precision", "auto")) != "auto"
           else "autocast"]
    if cfg.grad_checkpointing:
        out.append("--grad-checkpointing")
    if cfg.compile:
        out.append("--compile")
    return [str(v) for v in out]


def minimal_heads(cfg) -> int:
    """Heads of the minimal model: one, or one per tensor-parallel rank."""
    return layout(cfg).tp_size


def fixed_step(cfg, allow_measure: bool = True) -> float | None:
    """Seconds of one optimizer step of cfg's strategy on the minimal model, run here as its own job (cached).
    NVMe offload is measured as offload to memory (its drive traffic is a bandwidth term)."""
    argv = minimal_flags(cfg, minimal_heads(cfg))
    # keyed by the threads its ranks get: before ranks.share_the_cores, rank 1 of fsdp, tp and pp kept every core, and
    # those entries (fsdp, tp, pp 13-62% too slow) are not read again
    settings = {"argv": argv, "rank_threads": rank_threads(cfg.devices)}
    try:
        return cached("fixed", settings, lambda: _run_minimal(argv), allow_measure)
    except RuntimeError as e:  # the plan goes on without it, as a lower bound, and says why
        print(f"warning: {e}; the CPU time plan is compute alone, a lower bound", file=sys.stderr)
        return None


def _run_minimal(argv: list[str]) -> float:
    """The minimal run's step time. Its processes are forked from a warm python (warm_python.py): the job is a few
    seconds of steps after 10-20 s of imports a process, twenty times in a lab's first bench (AVX2 EPYC: 7 s a job
    instead of 25, the step time the same within its run-to-run spread)."""
    import warm_python

    script = Path(__file__).with_name("fabric_gpt.py")
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR",
                                                            "MASTER_PORT", "NODE_RANK", "FABRIC_LAB_LAUNCHER")}
    with tempfile.TemporaryDirectory(prefix="fixed-cost-") as out:
        done = subprocess.run([warm_python.executable(), str(script), *argv, "--out-dir", out, "--run-name", "probe"],
                              env=env, capture_output=True, text=True)
        if done.returncode:
            tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise RuntimeError(f"the fixed-cost probe ({' '.join(argv)}) failed: {tail}")
        return json.loads((Path(out) / "probe" / "record.json").read_text())["step_time_s"]


# ----------------------------------------------------------------------------- LeNet-5 on a CPU
class ZeroPaddedConv2d(torch.nn.Conv2d):
    """A Conv2d computed with zero weights appended: pad_out output channels that are always zero, and pad_in
    input channels (the zero ones the previous layer appended) that are read with zero weights. The same
    parameters, results and gradients, in a channel count the CPU kernels handle whole vectors of."""

    def __init__(self, *args, pad_out: int = 0, pad_in: int = 0, **kwargs):
        super().__init__(*args, **kwargs)
        self.pad_out, self.pad_in = pad_out, pad_in

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.pad_out or self.pad_in):
            return super().forward(x)
        F = torch.nn.functional
        weight = F.pad(self.weight, (0, 0, 0, 0, 0, self.pad_in, 0, self.pad_out))  # zero filters / zero inputs
        return self._conv_forward(x, weight, F.pad(self.bias, (0, self.pad_out)))


# --precision auto: on a GPU bf16 autocast (fp16 without bf16) is the fast choice. On a CPU no rule holds: bf16
# autocast was 1.4x faster than float32 on a Xeon with AMX, 1.3x on an EPYC with AVX-512 BF16 and far slower without
# either (docs/lenet.md). So the CPU times LeNet-5's own step in both, once per machine and settings.
PROBE_ENV = "FABRIC_LAB_AUTO_PRECISION"  # the launching process's choice, inherited by the ranks it starts


def lenet_probe_key(cfg) -> dict:
    """What LeNet-5's step speed depends on: the CPU, the libraries, the threads a rank gets, the local batch
    and the memory layout. A change of any of them measures again."""
    return {"cpu": cpu_name(), "units": cpu_units(), "caps": isa_caps(), "torch": torch.__version__,
            "threads": rank_threads(cfg.devices), "local_batch": cfg.batch_size // layout(cfg).world,
            "channels_last": cfg.channels_last, "pad_channels": cfg.pad_channels, "activation": cfg.activation}


def lenet_step_speeds(make_model, key: dict, windows: int = 4, steps: int = 2) -> dict:
    """Samples/s of LeNet-5's training step (forward, loss, backward, fused AdamW) in float32 and under bf16
    autocast, on random images of the run's shape: the median of 4 alternating windows of 2 steps, after 2
    warm-up steps that include oneDNN's kernel set-up. About 0.5 s on 2 cores, once per machine and settings."""
    F = torch.nn.functional
    threads = torch.get_num_threads()
    torch.set_num_threads(key["threads"])
    try:
        torch.manual_seed(0)
        n, layout_ = key["local_batch"], torch.channels_last if key["channels_last"] else torch.contiguous_format
        x, y = torch.randn(n, 1, 28, 28).contiguous(memory_format=layout_), torch.randint(0, 10, (n,))
        models = {p: make_model().to(memory_format=layout_) for p in ("32-true", "bf16-mixed")}
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


def choose_precision(key: dict, cache: Path, measure) -> dict:
    """The faster of float32 and bf16 autocast for `key`: from the cache when it holds this key, else
    measured (measure() -> {precision: samples/s}) and added to it. A file lock makes ranks started
    together (torchrun) measure once and read the same answer."""
    def measure_entry() -> dict:
        started = time.perf_counter()
        speeds = measure()
        return {"choice": max(speeds, key=speeds.get), "samples_per_s": speeds, "key": key,
                "probe_s": time.perf_counter() - started, "date": f"{datetime.now():%Y-%m-%d %H:%M}"}

    entry, was_cached = stored_or_measured(cache, json.dumps(key, sort_keys=True), measure_entry)
    return {**entry, "cached": was_cached}


def lenet_precision(cfg, make_model) -> tuple[str, dict | None]:
    """(the precision --precision auto stands for here, the probe's entry on a CPU that decided by measuring)."""
    if uses_gpu(cfg.accelerator):
        return ("bf16-mixed" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "16-mixed"), None
    if os.environ.get("LOCAL_RANK", "0") != "0" and os.environ.get(PROBE_ENV):
        return os.environ[PROBE_ENV], None  # a rank started by Fabric's launcher, which decided before starting it
    key = lenet_probe_key(cfg)
    probe = choose_precision(key, Path(cfg.cache_dir).expanduser() / "precision-probe.json",
                             lambda: lenet_step_speeds(make_model, key))
    os.environ[PROBE_ENV] = probe["choice"]
    return probe["choice"], probe


def probe_line(probe: dict) -> str:
    s = probe["samples_per_s"]
    when = f"cached {probe['date']}" if probe["cached"] else f"measured now in {probe['probe_s']:.2f} s"
    return (f"precision auto: {probe['choice']} (LeNet-5 step at batch {probe['key']['local_batch']}, "
            f"{probe['key']['threads']} thread(s): bf16 autocast {s['bf16-mixed']:,.0f} samples/s, float32 "
            f"{s['32-true']:,.0f}; {when}; --precision forces one)")


def agree_on_precision(fabric, precision: str, probe: dict | None) -> None:
    """Ranks on different CPUs, each with its own --precision auto probe, must still compute in one precision."""
    from flags import ConfigError

    (differ,) = any_rank(fabric, fabric.broadcast(precision) != precision)
    if differ:
        raise ConfigError("--precision auto chose differently on different ranks (different CPUs or caches); "
                          "pass --precision 32-true or bf16-mixed explicitly")
    if probe:
        fabric.print(probe_line(probe))

