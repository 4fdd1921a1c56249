"""LeNet-5's speed on a CPU: conv1's channels padded to a whole vector (ZeroPaddedConv2d), and `--precision auto`'s
choice between float32 and bf16 autocast, made by timing LeNet-5's own step on this CPU once per machine and settings.
"""

import dataclasses
import json
import os
import statistics
import time
from datetime import datetime
from pathlib import Path

import torch

from core.run.hardware import (NO_BF16, cpu_name, cpu_units, gpu_precision, isa_caps, keep_freed_memory_in_heap,
                                native_bf16, uses_gpu)
from core.run.measurements import BUSY, MARGIN, cache_folder, clearly_faster, rank_threads, stored_or_measured
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


# --precision auto: on a GPU bf16 autocast (fp16 without bf16) is the fast choice. On a CPU with bf16 instructions no
# rule holds: bf16 autocast was 1.4x faster than float32 on a Xeon with AMX, 1.3x on an EPYC with AVX-512 BF16
# (docs/lenet.md). So such a CPU times LeNet-5's own step in both, once per machine and settings; one without them
# (bf16 far slower, emulated) times float32 alone (NO_BF16). --pad-channels
# auto likewise: conv1's channels padded to 8 ran float32 1.5x slower than unpadded on that EPYC and 5% faster on a
# Xeon with AVX-512 BF16 (docs/lenet.md), so the same probe times the step both ways.
PROBE_ENV = "FABRIC_LAB_AUTO_PRECISION"  # the launching process's choice, "<precision>:<pad>", inherited by its ranks


PROBE_VERSION = 3  # 3: the padding too; 2: 8 paired windows and a margin; 1: 4 windows, any lead (a moment's load decided)
BF16_MARGIN = MARGIN  # bf16 autocast is taken only this much faster, in 3 of 4 paired windows: its rounding for speed
MEASURED = ("32-true", "bf16-mixed")  # the precisions the probe's step computes in
PADS = (8, 0)  # conv1's channels as a whole vector of 8, or as they are
# The probe's largest batch: its 104 steps cost in proportion to the batch (a batch of 60,000 took minutes before
# its first line). The cases ranked alike from 512 to 4,096 (float32 ahead of bf16 autocast at each, on a Xeon with
# AVX-512 BF16, 2026-11-29: docs/lenet.md), so a larger batch is decided at this one, in about 2 s a pair of cases.
PROBE_BATCH = 1024
# Without bf16 instructions torch emulates bf16, and nothing is left to time (NO_BF16): under the AVX2 caps bf16
# autocast ran the step at a tenth of float32's speed, and timing it took 19 of the probe's 21 s (docs/lenet.md).
# GPT-2's auto alike (core/gpt/cpu_precision.py).


def conv1_channels(cfg) -> int:
    """The channel count conv1 computes in: --pad-channels, 8 while auto is not yet resolved, nothing padded in NCHW."""
    pad = 8 if cfg.pad_channels == "auto" else cfg.pad_channels
    return max(pad, 6) if cfg.channels_last else 6


def lenet_probe_key(cfg) -> dict:
    """What LeNet-5's step speed depends on: the CPU, the libraries, the threads a rank gets, the local batch (up to
    PROBE_BATCH, the batch it is timed at) and the memory layout, and what is timed: the precisions and paddings left
    open. A change of any of them measures again, as does a new version of the probe."""
    precisions = MEASURED if cfg.precision == "auto" else (cfg.precision,)
    pads = PADS if cfg.pad_channels == "auto" else (cfg.pad_channels,)
    return {"probe": PROBE_VERSION, "cpu": cpu_name(), "units": cpu_units(), "caps": isa_caps(), "torch": torch.__version__,
            "threads": rank_threads(cfg.devices), "local_batch": min(cfg.batch_size // cfg.layout.world, PROBE_BATCH),
            "channels_last": cfg.channels_last, "precisions": list(precisions), "pads": list(pads),
            "activation": cfg.activation}


def lenet_step_speeds(make_model, key: dict, windows: int = 8, steps: int = 3) -> dict:
    """{precision: {pad: samples/s of each window}} of LeNet-5's training step (forward, loss, backward, fused AdamW)
    in each precision (float32, bf16 autocast) and padding of the key, on random images of the run's shape, in 8
    alternating windows of 3 steps each (paired: a window of each case beside the others), after 2 warm-up steps that
    include oneDNN's kernel set-up. make_model(pad) -> LeNet-5. About 1.5 s a pair of cases on 2 cores, once per
    machine and settings."""
    F = torch.nn.functional
    keep_freed_memory_in_heap()  # as training runs: without it each step page-faults its activations in again, more so
    threads = torch.get_num_threads()  # the padded ones (it made the unpadded float32 step look 1.1-1.2x the faster)
    torch.set_num_threads(key["threads"])
    try:
        torch.manual_seed(0)
        n, layout_ = key["local_batch"], torch.channels_last if key["channels_last"] else torch.contiguous_format
        x, y = torch.randn(n, 1, 28, 28).contiguous(memory_format=layout_), torch.randint(0, 10, (n,))
        cases = [(p, pad) for p in key["precisions"] for pad in key["pads"]]
        models = {c: make_model(c[1]).to(memory_format=layout_) for c in cases}
        optimizers = {c: torch.optim.AdamW(m.parameters(), fused=True) for c, m in models.items()}

        def step(case) -> None:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=case[0] == "bf16-mixed"):
                loss = F.cross_entropy(models[case](x), y)
            loss.backward()
            optimizers[case].step()
            optimizers[case].zero_grad(set_to_none=True)

        times = {c: [] for c in cases}
        for c in cases:
            for _ in range(2):
                step(c)
        for _ in range(windows):
            for c in cases:
                t0 = time.perf_counter()
                for _ in range(steps):
                    step(c)
                times[c].append((time.perf_counter() - t0) / steps)
        return {p: {str(pad): [n / t for t in times[(p, pad)]] for pad in key["pads"]} for p in key["precisions"]}
    finally:
        torch.set_num_threads(threads)


def faster_precision(windows: dict) -> str:
    """bf16 autocast where it is clearly the faster (measurements.clearly_faster: its median BF16_MARGIN above
    float32's and ahead in 3 of 4 paired windows), else float32, which needs no rounding."""
    return "bf16-mixed" if clearly_faster(windows["bf16-mixed"], windows["32-true"], BF16_MARGIN) else "32-true"


def fastest(cases: dict) -> dict:
    """From {precision: {pad: windows}}: each precision's faster padding by its median (the padding changes no result,
    so no margin), then the precision (faster_precision, where both were timed)."""
    pads = {p: max(by_pad, key=lambda pad: statistics.median(by_pad[pad])) for p, by_pad in cases.items()}
    windows = {p: cases[p][pads[p]] for p in cases}
    choice = faster_precision(windows) if len(windows) > 1 else next(iter(windows))
    return {"choice": choice, "pad_channels": int(pads[choice]), "windows": windows, "cases": cases}


def choose_precision(key: dict, cache: Path, measure) -> dict:
    """The precision and padding for `key` (fastest): from the cache when it holds this key, else measured
    (measure() -> {precision: {pad: [samples/s of each window]}}) and added to it. A file lock makes ranks started
    together (torchrun) measure once and read the same answer."""
    def measure_entry() -> dict:
        started = time.perf_counter()
        chosen = fastest(measure())
        return {**chosen, "key": key, "samples_per_s": {p: statistics.median(w) for p, w in chosen["windows"].items()},
                "probe_s": time.perf_counter() - started, "date": f"{datetime.now():%Y-%m-%d %H:%M}"}

    entry, was_cached = stored_or_measured(cache, json.dumps(key, sort_keys=True), measure_entry,
                                           timed_threads=key["threads"], what="the LeNet-5 step probe")
    return {**entry, "cached": was_cached}


def lenet_cpu_choice(cfg, make_model) -> tuple[str, int, dict | None]:
    """(the precision and conv1 padding --precision auto and --pad-channels auto stand for here, the probe's entry
    where it measured); make_model(pad) -> LeNet-5 with that padding."""
    precision, pad = cfg.precision, cfg.pad_channels
    if uses_gpu(cfg.accelerator):  # tensor cores take whole multiples of 8 channels
        return (gpu_precision() if precision == "auto" else precision), (8 if pad == "auto" else pad), None
    bf16_instructions = native_bf16()
    emulated = precision == "auto" and not bf16_instructions
    precision = "32-true" if emulated else precision
    # nothing padded in NCHW; the probe times float32 and bf16 steps only, and no emulated bf16 step: a run that asks
    # for bf16 without bf16 instructions (a test, a comparison) has no speed to gain, and timing its padding took about
    # 22 s of the 30 s of two 2-step runs, one in each precision, on an AVX2 EPYC (tests/test_gpu_paths.py's dtype test)
    timed = MEASURED if bf16_instructions else ("32-true",)
    if pad == "auto" and (not cfg.channels_last or precision not in ("auto", *timed)):
        pad = 8 if cfg.channels_last else 0
    if "auto" not in (precision, pad):
        return precision, pad, ({"choice": precision, "pad_channels": pad, "why": NO_BF16} if emulated else None)
    if os.environ.get("LOCAL_RANK", "0") != "0" and os.environ.get(PROBE_ENV):
        inherited, inherited_pad = os.environ[PROBE_ENV].split(":")  # a rank started by Fabric's launcher, which
        return inherited, int(inherited_pad), None                      # decided before starting it
    key = lenet_probe_key(dataclasses.replace(cfg, precision=precision, pad_channels=pad))
    folder = Path(cfg.cache_dir).expanduser() if cfg.cache_dir else cache_folder()
    probe = choose_precision(key, folder / "precision-probe.json",
                             lambda: lenet_step_speeds(make_model, key))
    os.environ[PROBE_ENV] = f"{probe['choice']}:{probe['pad_channels']}"
    return probe["choice"], probe["pad_channels"], ({**probe, "why": NO_BF16} if emulated else probe)


def probe_line(probe: dict) -> str:
    """What auto chose and why: the resumed run's precision, and the probe's figures where it measured."""
    taken = ", ".join(f"--{name.replace('_', '-')} auto: {value}" for name, value in probe.get("resumed", {}).items())
    lines = [f"{taken} (the resumed run's own; --precision and --pad-channels force them)"] if taken else []
    if "cases" in probe:
        lines.append(measured_line(probe))
    elif "why" in probe:  # nothing timed
        lines.append(f"auto: --precision {probe['choice']} ({probe['why']}; --precision forces one)")
    return "\n".join(lines)


def measured_line(probe: dict) -> str:
    key, names = probe["key"], {"32-true": "float32", "bf16-mixed": "bf16 autocast"}
    shown = lambda pad, w: f"{statistics.median(w):,.0f} ({f'padded to {pad}' if int(pad) else 'unpadded'})"  # noqa: E731
    speeds = ", ".join(f"{names[p]} " + " / ".join(shown(pad, w) for pad, w in by_pad.items())
                       for p, by_pad in probe["cases"].items())
    when = f"cached {probe['date']}" if probe["cached"] else f"measured now in {probe['probe_s']:.2f} s" + (
        ", not kept: the machine was busy" if BUSY in probe else "")
    batch = f"{key['local_batch']}" + (", the probe's largest" if key["local_batch"] == PROBE_BATCH else "")
    bf16 = probe.get("why") or f"bf16 taken only {BF16_MARGIN:.2f}x faster"
    return (f"auto: --precision {probe['choice']} --pad-channels {probe['pad_channels']} (LeNet-5's step at batch "
            f"{batch}, {key['threads']} thread(s), samples/s: {speeds}; {bf16}; {when}; --precision and "
            "--pad-channels force them)")


def agree_on_precision(fabric, precision: str, probe: dict | None) -> None:
    """Ranks on different CPUs, each with its own --precision auto probe, must still compute in one precision
    (ranks.agree_on_precision); then the probe's line."""
    ranks.agree_on_precision(fabric, precision)
    if probe:
        fabric.print(probe_line(probe))
