"""LeNet-5's speed on a CPU: conv1's channels padded to a whole vector (ZeroPaddedConv2d), and `--precision auto`'s
choice between float32 and bf16 autocast, made by timing LeNet-5's own step on this CPU once per machine and settings.
"""

import json
import os
import statistics
import time
from datetime import datetime
from pathlib import Path

import torch

from core.run.hardware import cpu_name, cpu_units, isa_caps, uses_gpu
from core.run.measurements import MARGIN, clearly_faster, rank_threads, stored_or_measured
from core.run import ranks


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


PROBE_VERSION = 2  # 2: 8 paired windows and a margin (1 measured 4 windows and took any lead: a moment's load decided)
BF16_MARGIN = MARGIN  # bf16 autocast is taken only this much faster, in 3 of 4 paired windows: its rounding for speed


def lenet_probe_key(cfg) -> dict:
    """What LeNet-5's step speed depends on: the CPU, the libraries, the threads a rank gets, the local batch
    and the memory layout. A change of any of them measures again, as does a new version of the probe."""
    return {"probe": PROBE_VERSION, "cpu": cpu_name(), "units": cpu_units(), "caps": isa_caps(), "torch": torch.__version__,
            "threads": rank_threads(cfg.devices), "local_batch": cfg.batch_size // cfg.layout.world,
            "channels_last": cfg.channels_last, "pad_channels": cfg.pad_channels, "activation": cfg.activation}


def lenet_step_speeds(make_model, key: dict, windows: int = 8, steps: int = 3) -> dict:
    """Samples/s of LeNet-5's training step (forward, loss, backward, fused AdamW) in float32 and under bf16
    autocast, on random images of the run's shape, in 8 alternating windows of 3 steps each (paired: a window of one
    beside a window of the other), after 2 warm-up steps that include oneDNN's kernel set-up. About 1.5 s on 2
    cores, once per machine and settings."""
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
        return {p: [n / t for t in ts] for p, ts in times.items()}
    finally:
        torch.set_num_threads(threads)


def faster_precision(windows: dict) -> str:
    """bf16 autocast where it is clearly the faster (measurements.clearly_faster: its median BF16_MARGIN above
    float32's and ahead in 3 of 4 paired windows), else float32, which needs no rounding."""
    return "bf16-mixed" if clearly_faster(windows["bf16-mixed"], windows["32-true"], BF16_MARGIN) else "32-true"


def choose_precision(key: dict, cache: Path, measure) -> dict:
    """float32 or bf16 autocast for `key` (faster_precision): from the cache when it holds this key, else measured
    (measure() -> {precision: [samples/s of each window]}) and added to it. A file lock makes ranks started together
    (torchrun) measure once and read the same answer."""
    def measure_entry() -> dict:
        started = time.perf_counter()
        windows = measure()
        return {"choice": faster_precision(windows), "key": key, "windows": windows,
                "samples_per_s": {p: statistics.median(w) for p, w in windows.items()},
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
    if probe.get("resumed"):
        return f"precision auto: {probe['choice']} (the precision the resumed run trained in; --precision forces one)"
    s = probe["samples_per_s"]
    when = f"cached {probe['date']}" if probe["cached"] else f"measured now in {probe['probe_s']:.2f} s"
    return (f"precision auto: {probe['choice']} (LeNet-5 step at batch {probe['key']['local_batch']}, "
            f"{probe['key']['threads']} thread(s): bf16 autocast {s['bf16-mixed']:,.0f} samples/s, float32 "
            f"{s['32-true']:,.0f}, bf16 taken only {BF16_MARGIN:.2f}x faster; {when}; --precision forces one)")


def agree_on_precision(fabric, precision: str, probe: dict | None) -> None:
    """Ranks on different CPUs, each with its own --precision auto probe, must still compute in one precision
    (ranks.agree_on_precision); then the probe's line."""
    ranks.agree_on_precision(fabric, precision)
    if probe:
        fabric.print(probe_line(probe))
