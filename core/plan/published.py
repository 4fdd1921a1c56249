"""The plan held against the field's published training runs: every row of published_runs.json (a paper's table or
a repository's file, each with where it was read) predicted by perf_model.time_plan, the model `make plan` uses, on
the row's cluster preset and framework, nothing fitted to the row. `make plan-check` prints one line per row and the
median and worst error over the validation rows; the calibration rows (named in gpu_efficiency.py) are printed apart,
and the rows the model cannot represent are kept with their reason.

    python -m lab.plan_check              # make plan-check
    python -m lab.plan_check --calibrate  # solve gpu_efficiency's calibrated constants from their rows

Each row's measured figure is turned into seconds a step by its own source's definition: tokens/s of all GPUs,
seconds or milliseconds a step, or Megatron-LM's TFLOP/s per GPU (Narayanan et al. 2021, equation 3: 96·B·s·l·h²·
(1 + s/6h + V/16lh) FLOPs a step, the recomputed forward counted)."""

import functools
import json
import math
import statistics
from dataclasses import replace
from pathlib import Path

from core.plan import gpu_efficiency, perf_model

ROWS = Path(__file__).with_name("published_runs.json")
GOAL_MEDIAN, GOAL_WORST = 0.20, 2.0  # issue 75: median error at most 20%, none off by more than 2x


@functools.lru_cache(maxsize=1)
def rows() -> tuple:
    return tuple(json.loads(ROWS.read_text()))


def planned_rows() -> list[dict]:
    return [r for r in rows() if r["role"] != "refused"]


# ----------------------------------------------------------------------------- a row as a plan
def row_config(template, row: dict):
    """The plan's config of a published run: its shape, layout, micro-batches and precision on `template`
    (fabric_gpt.py's Config, whose other fields a plan does not read)."""
    m, par = row["model"], row["parallel"]
    gpus = row["gpus"]
    devices = min(gpus, perf_model.CLUSTERS[row["cluster"]].devices_per_node)
    strategy = par["strategy"]
    return replace(template, n_embd=m["hidden"], n_layer=m["layers"], n_head=m["heads"], seq_len=m["seq"],
                   vocab_size=m["vocab"], pad_vocab_to=m.get("pad_vocab_to", 1), micro_batch_size=par["micro_batch"],
                   grad_accum=par["grad_accum"], strategy=strategy, devices=devices, num_nodes=gpus // devices,
                   tp_size=par["tp"] if strategy in ("tp", "fsdp_tp", "tp_pp") else 0,
                   pp_size=par["pp"] if strategy in ("pp", "tp_pp") else 0, precision=par["precision"],
                   grad_checkpointing=par["recompute"], compile=False, optimizer="adamw", nvme_path="",
                   cluster=row["cluster"], attention_precision="autocast")


def parameters(cfg) -> int:
    """GPT-2's parameters (the head tied to the embedding), counted in closed form rather than by building the
    model: l(12h² + 13h) + Vh + sh + 2h, without biases (--no-bias) l(12h² + 2h) + Vh + sh + h (tests/test_plan.py
    holds it to gpt_model.count_parameters)."""
    from core.gpt.gpt_model import model_vocab
    from core.plan.accounting import block_params, final_norm_params

    h = cfg.n_embd
    return cfg.n_layer * block_params(cfg) + model_vocab(cfg) * h + cfg.seq_len * h + final_norm_params(cfg)


def measured_step(row: dict) -> float:
    """Seconds a step, from the figure as its source defines it."""
    value, unit = row["measured"]["value"], row["measured"]["unit"]
    m, par = row["model"], row["parallel"]
    tokens = par["global_batch"] * m["seq"]
    if unit == "tokens/s":
        return tokens / value
    if unit == "s/step":
        return value
    if unit == "ms/step":
        return value / 1e3
    if unit.startswith("TFLOP/s per GPU, Megatron eq. 3"):
        h, s, l, V = m["hidden"], m["seq"], m["layers"], m["vocab"]
        per_token = 96 * l * h * h + 16 * s * l * h + 6 * h * V
        return tokens * per_token / (value * 1e12 * row["gpus"])
    raise ValueError(f"{row['name']}: unit {unit!r} is not one this check reads; add its conversion to measured_step")


def predict(template, row: dict, calibration=None) -> dict:
    """The row planned as `make plan` plans: its step, and the ratio to the measured one."""
    cfg = row_config(template, row)
    t = perf_model.time_plan(cfg, perf_model.CLUSTERS[row["cluster"]], parameters(cfg), framework=row["framework"],
                             calibration=calibration)
    measured = measured_step(row)
    ratio = t["step_time_s"] / measured
    return {"row": row, "predicted_s": t["step_time_s"], "measured_s": measured, "ratio": ratio,
            "error": max(ratio, 1 / ratio) - 1, "host_bound": t["kernels"]["host_bound"]}


def error_summary(results: list[dict]) -> dict:
    errors = [r["error"] for r in results]
    worst = max(results, key=lambda r: r["error"])
    return {"rows": len(results), "median": statistics.median(errors), "worst": worst["error"] + 1, "worst_row": worst}


def check(template) -> dict:
    """Every row predicted: {validation, calibration, refused, summary}."""
    out = {"validation": [], "calibration": [], "refused": [r for r in rows() if r["role"] == "refused"]}
    for row in rows():
        if row["role"] != "refused":
            out[row["role"]].append(predict(template, row))
    out["summary"] = error_summary(out["validation"])
    return out


# ----------------------------------------------------------------------------- the published run nearest a plan
def nearest(template, cfg, cluster, strategy: str = "") -> dict:
    """The planned row closest to a plan (same GPU family first, then model size, GPU count, micro-batch and
    layout), predicted by the same model: what the plan's figure can be trusted to, by its nearest neighbour's error."""
    family = lambda key: "a100" if key == "a100" else "h100"  # noqa: E731 (the H200 shares the H100's calibration)
    size, gpus = parameters(cfg), cfg.layout.world

    def distance(row):
        rc = row_config(template, row)
        return (0 if family(perf_model.CLUSTERS[row["cluster"]].kernels) == family(cluster.kernels) else 10) \
            + abs(math.log(parameters(rc) / size)) + abs(math.log(row["gpus"] / gpus)) \
            + 0.5 * abs(math.log(rc.micro_batch_size / cfg.micro_batch_size)) \
            + (0 if rc.strategy == (strategy or cfg.strategy) else 0.5)
    best = min(planned_rows(), key=distance)
    return predict(template, best)


def beside_the_plan(cfg, cluster, strategy: str) -> dict:
    """perf_model.plan's `beside` for a GPU preset's plan: the nearest published run printed under it, and returned
    as {"nearest_published": {name, source, predicted_s, measured_s, ratio}}."""
    if not cluster.kernels or cluster.probe:  # this CPU, or a GPU present here and measured
        return {}
    found = nearest(cfg, cfg, cluster, strategy)
    row = found["row"]
    print(f"  nearest published run: {row['name']} ({row['role']} row of `make plan-check`): predicted "
          f"{seconds(found['predicted_s'])}, measured {seconds(found['measured_s'])}, {found['ratio']:.2f}x")
    return {"nearest_published": {"name": row["name"], "source": row["source"],
                                  **{k: found[k] for k in ("predicted_s", "measured_s", "ratio")}}}


# ----------------------------------------------------------------------------- calibration
def calibrate(template) -> gpu_efficiency.Calibration:
    """gpu_efficiency's calibrated numbers solved from their named rows: per device the matmul share (the mean log
    error of its sequence-2048 calibration rows made zero) and the attention share (its long-sequence row's), then
    the host's cost of an eager op (the lab's H200 row at micro-batch 1)."""
    cal = gpu_efficiency.CALIBRATION
    for _ in range(3):  # matmul and attention each move the other's rows a little
        for key in ("a100", "h100"):
            mine = [r for r in rows() if r["role"] == "calibration" and r.get("calibrates") == key]
            short = [r for r in mine if r["model"]["seq"] <= 2048]
            long_ = [r for r in mine if r["model"]["seq"] > 2048]
            for field, group in (("gemm", short), ("attention", long_)):
                def error(x, field=field, group=group, key=key):
                    trial = with_device(cal, key, **{field: x})
                    return statistics.fmean(math.log(predict(template, r, trial)["ratio"]) for r in group)
                cal = with_device(cal, key, **{field: solve(error, 0.05, 1.0)})
        host_rows = [r for r in rows() if r["role"] == "calibration" and r.get("calibrates") == "host"]
        cal = replace(cal, host_op_s=solve(lambda x: statistics.fmean(math.log(predict(
            template, r, replace(cal, host_op_s=x))["ratio"]) for r in host_rows), 1e-6, 200e-6, rising=True))
    return cal


def with_device(cal, key: str, **change):
    devices = {k: (replace(d, **change) if k == key or d.calibrated_from == key else d) for k, d in cal.devices.items()}
    return replace(cal, devices=devices)


def solve(f, low: float, high: float, rising: bool = False) -> float:
    """The root of a monotonic f on [low, high] by bisection (falling: a faster device predicts shorter steps)."""
    for _ in range(50):
        mid = (low + high) / 2
        if (f(mid) > 0) == rising:
            high = mid
        else:
            low = mid
    return (low + high) / 2


# ----------------------------------------------------------------------------- printed
def seconds(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s"


def print_check(result: dict) -> None:
    print(f"plan-check: {len(rows())} measured GPU training runs ({ROWS.name}: published, and this lab's), each "
          "predicted by perf_model.time_plan (the model `make plan` uses) on its cluster preset and framework; ratio = "
          "predicted / measured step, error = the larger of ratio and 1/ratio, less 1")
    print(f"  {'run':<70}{'GPUs':>6}{'predicted':>12}{'measured':>12}{'ratio':>8}")
    for role in ("validation", "calibration"):
        print(f"  {role} rows:")
        for r in result[role]:
            row = r["row"]
            print(f"  {row['name'][:69]:<70}{row['gpus']:>6}{seconds(r['predicted_s']):>12}{seconds(r['measured_s']):>12}"
                  f"{r['ratio']:>7.2f}x" + ("  (host-bound)" if r["host_bound"] else ""))
    print("  refused rows (the model cannot represent them; kept with the reason):")
    for row in result["refused"]:
        print(f"  {row['name']}: {row['refused']}")
    s = result["summary"]
    print(f"validation: {s['rows']} rows, median error {100 * s['median']:.1f}% (goal <= {100 * GOAL_MEDIAN:.0f}%), "
          f"worst {s['worst']:.2f}x (goal <= {GOAL_WORST:.0f}x: {s['worst_row']['row']['name']})")
    print(f"calibration: {gpu_efficiency.describe_calibration()}")
