"""GPT-2's `--precision auto` on a CPU: float32 or bf16, whichever trains this run's model faster on this machine,
timed once per machine and shape (cached with the machine's other measurements).

Why measured. bf16 autocast (attention kept in float32 where that measures faster) trained nanoGPT's character
recipe at 1.14x nanoGPT's float32 loop on an AVX-512 BF16 EPYC, where float32 ran at 0.92x (docs/text.md); on an
AVX-512 BF16 Xeon without AMX bf16 matmuls are no faster than float32; without bf16 instructions torch emulates
them, about 90x slower. No rule of the CPU's flags foretells the first two, so the run's own step decides, as LeNet-5's
`--precision auto` does (core/lenet/cpu_speed.py): the model cut to 2 blocks, at the run's micro-batch, a few seconds.
A model whose cut step would take more than STEP_BUDGET FLOPs (GPT-2 small's vocabulary at 1,024 tokens: 0.3 TFLOP)
spends its step in matmuls, and the CPU's matmul rates in both types decide it without a minute of probing.
"""

import statistics
import time

from core.gpt.gpt_model import positions
from core.run.hardware import NO_BF16, native_bf16
from core.run.measurements import MARGIN, cached, clearly_faster, threads

CANDIDATES = ("32-true", "bf16-mixed")
PROBE_LAYERS = 2  # the step of a model cut to 2 blocks: the embedding, blocks and head in their shares, in seconds
STEP_BUDGET = 20e9  # FLOPs of a probe step timed whole (nanoGPT's recipe: 2.4e9); above, the matmul rates decide
VERSION = 2  # 2: the step runs a window's first seq_len - 1 positions (gpt_model.window_loss), counted so


def probe_settings(cfg, n_threads: int) -> dict:
    """What the choice depends on besides the machine: the shape of one rank's micro-batch, the model's width, its
    blocks as probed, what computes its attention and GELU, and the strategy's weights (DeepSpeed's bf16 keeps them
    in bf16)."""
    return {"version": VERSION, "n_embd": cfg.n_embd, "n_head": cfg.n_head, "layers": min(cfg.n_layer, PROBE_LAYERS),
            "seq_len": cfg.seq_len, "vocab": cfg.vocab_size, "micro_batch": cfg.micro_batch_size,
            "threads": n_threads, "attention": cfg.attention_precision, "gelu": cfg.gelu_impl,
            "checkpointing": cfg.grad_checkpointing, "deepspeed": cfg.layout.deepspeed}


def choose(cfg, n_threads: int, makers, matmul_peaks) -> dict:
    """{"choice", ...}: 32-true where the CPU has no bf16 instructions (nothing to measure); else, for a model whose
    probe step stays within STEP_BUDGET, the faster of the two as timed by step_speeds; for a larger one, whose step
    is its matmuls, the faster of the CPU's float32 and bf16 matmul rates (the MFU's probe). Cached either way.
    makers: () -> {precision: () -> a training step's callable}, called outside the cache's lock; matmul_peaks:
    () -> (float32's (FLOP/s, path), the best (FLOP/s, path) of bf16 autocast's), as accounting.cpu_matmul_peak's."""
    if not native_bf16():
        return {"choice": "32-true", "why": NO_BF16}
    if probe_flops(cfg) > STEP_BUDGET:
        return by_matmul_rates(*matmul_peaks())
    settings = probe_settings(cfg, n_threads)
    if known := cached("precision", settings, None, allow_measure=False):  # no model built, no lock taken
        return known
    steps = makers()
    return cached("precision", settings, lambda: measure(settings, n_threads, steps), timed_threads=n_threads)


def probe_flops(cfg) -> float:
    """Forward and backward FLOPs of the probe's step: 6 x its parameters and 12 x layers x width x positions (the
    attention's scores and their use, as accounting.flops_per_token counts them) for each of a micro-batch's tokens.
    Without the attention a long sequence passed for a small step: 1 x 20,000 positions of `tiny` as 14 GFLOP, whose
    2 blocks' attention adds 614."""
    layers, tokens = min(cfg.n_layer, PROBE_LAYERS), cfg.micro_batch_size * positions(cfg)
    weights = 6 * (12 * cfg.n_embd ** 2 * layers + cfg.vocab_size * cfg.n_embd)
    return (weights + 12 * layers * cfg.n_embd * positions(cfg)) * tokens


def by_matmul_rates(float32: tuple, best_bf16: tuple) -> dict:
    """bf16 where the CPU's best bf16 matmul path (the MFU's probe: "best of <paths>: <the fastest>") is clearly above
    its float32 rate. Where that fastest is float32's own matmul, bf16 autocast has nothing faster to offer: its rate
    is a second timing of float32, and a moment's load between the two timings once chose bf16 on a CPU where bf16
    autocast trains at 0.7x."""
    fp32, (bf16, path) = float32[0], best_bf16
    fastest = path.rsplit(": ", 1)[-1]
    faster = fastest != "float32 matmul" and bf16 >= MARGIN * fp32
    return {"choice": "bf16-mixed" if faster else "32-true",
            "why": f"a model this size is its matmuls: here bf16 autocast's fastest, {fastest}, {bf16 / 1e9:,.0f} "
                   f"GFLOP/s, float32 matmul {fp32 / 1e9:,.0f}"}


def measure(settings: dict, n_threads: int, makers: dict) -> dict:
    started = time.perf_counter()
    with threads(n_threads):
        windows = step_speeds({p: make() for p, make in makers.items()})
    tokens = settings["micro_batch"] * (settings["seq_len"] - 1)  # the positions a step computes (positions())
    speeds = {p: [tokens * s for s in w] for p, w in windows.items()}
    bf16 = clearly_faster(speeds["bf16-mixed"], speeds["32-true"])
    return {"choice": "bf16-mixed" if bf16 else "32-true", "windows": speeds,
            "tokens_per_s": {p: statistics.median(w) for p, w in speeds.items()},
            "probe_s": round(time.perf_counter() - started, 2)}


def step_speeds(steps: dict, windows: int = 8, window_s: float = 0.05) -> dict:
    """Steps/s of each callable in `windows` alternating windows (one beside the other: a moment's load falls on both),
    each of as many steps as fill `window_s`, after 2 warm-up steps that build the kernels."""
    per_window = {}
    for name, step in steps.items():
        for _ in range(2):
            step()
        start = time.perf_counter()
        step()
        per_window[name] = max(1, round(window_s / (time.perf_counter() - start)))
    rates = {name: [] for name in steps}
    for _ in range(windows):
        for name, step in steps.items():
            start = time.perf_counter()
            for _ in range(per_window[name]):
                step()
            rates[name].append(per_window[name] / (time.perf_counter() - start))
    return rates


def note(choice: dict) -> str:
    """The start-up line of a run whose precision auto chose."""
    if "tokens_per_s" not in choice:
        return f"precision auto: {choice['choice']} ({choice['why']}; --precision forces one)"
    s = choice["tokens_per_s"]
    return (f"precision auto: {choice['choice']} (a {PROBE_LAYERS}-block step of this model here: bf16 autocast "
            f"{s['bf16-mixed']:,.0f} tokens/s, float32 {s['32-true']:,.0f}; bf16 taken only clearly faster; "
            f"--precision forces one)")
