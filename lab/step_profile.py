"""Where one GPT-2 training step's time goes, from torch.profiler: matmuls, attention, the loss, the optimizer, the
rest (elementwise, norms, copies) and the device's idle time, as shares of the step. The measurement the GPU work
starts from: which lever (a compiled block, a fused loss, fewer host reads) is worth its code.

    python -m lab.step_profile --model 1.6b --precision bf16-mixed      # on a GPU: the micro-batch a run picks
    python -m lab.step_profile --model tiny --accelerator cpu           # the same split on this CPU
    python -m lab.step_profile --model 1.6b --precision bf16-mixed -- --micro-batch-size 8   # any fabric_gpt.py flag

One process, fabric_gpt.py's model, optimizer and step (step_data_parallel) on random tokens: 2 warm-up steps, then
--steps profiled. Writes profile.json and profile.md into --out (make gpu-check: runs/gpu-check/gpt-1.6b-profile).
"""

import argparse
import os
import re
import sys
import time
from pathlib import Path

import torch
from lightning.fabric import Fabric

import fabric_gpt
from core.run.files import write_json_atomic
from core.run.flags import Folder, Parser, choice, number
from core.run.lifecycle import exits

# A kernel's (or, on a CPU, an operator's) kind, by its name: the first pattern that matches
KINDS = (("attention", r"flash|fmha|attention|sdpa|softmax_backward_data|_efficient_attention"),
         ("matmul", r"gemm|matmul|\bmm\b|aten::mm|addmm|bmm|linear|cutlass|cublas|xmma|nvjet|sm\d+_"),
         ("loss", r"cross_entropy|nll_loss|log_softmax|logsumexp"),
         ("optimizer", r"adam|multi_tensor|foreach|optimizer|_fused_"))


def kind_of(name: str) -> str:
    return next((kind for kind, pattern in KINDS if re.search(pattern, name, re.I)), "other")


def split(prof, on_gpu: bool, wall_s: float) -> dict:
    """Seconds per kind over the profiled steps: each kernel's (CPU: each operator's own) time, and the device's idle
    time, the steps' wall time less all of it."""
    seconds = {kind: 0.0 for kind, _ in KINDS} | {"other": 0.0}
    for event in prof.key_averages():
        own = (event.self_device_time_total if on_gpu else event.self_cpu_time_total) / 1e6
        if own > 0 and (not on_gpu or event.device_type.name == "CUDA"):
            seconds[kind_of(event.key)] += own
    busy = sum(seconds.values())
    return {**seconds, "idle": max(0.0, wall_s - busy), "busy": busy, "wall": wall_s}


def profile(cfg, steps: int) -> dict:
    """2 warm-up steps, then `steps` profiled, of fabric_gpt's step on one device."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiler

    on_gpu = fabric_gpt.uses_gpu(cfg.accelerator)
    fabric = Fabric(accelerator=cfg.accelerator, devices=1, **fabric_gpt.fabric_precision(cfg, on_gpu))
    model, optimizer, _ = fabric_gpt.setup_model(fabric, cfg)
    tokens = torch.randint(0, cfg.vocab_size, (cfg.grad_accum, cfg.micro_batch_size, cfg.seq_len), device=fabric.device)
    run = type("Run", (), {"fabric": fabric, "cfg": cfg})()  # what step_data_parallel reads of a Run

    def step():
        return fabric_gpt.step_data_parallel(run, model, optimizer, list(tokens))

    for _ in range(2):
        step()
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    with profiler(activities=activities) as prof:
        started = time.perf_counter()
        for _ in range(steps):
            loss = step()[0]
        sync()
        wall = time.perf_counter() - started
    parts = split(prof, on_gpu, wall)
    tokens_per_step = cfg.micro_batch_size * cfg.grad_accum * cfg.seq_len
    return {"model": cfg.model, "precision": cfg.precision, "micro_batch": cfg.micro_batch_size,
            "grad_accum": cfg.grad_accum, "device": torch.cuda.get_device_name() if on_gpu else "cpu",
            "steps": steps, "step_s": wall / steps, "tokens_per_s": tokens_per_step * steps / wall,
            "loss": float(loss), "seconds": parts,
            "shares": {k: parts[k] / wall for k in (*dict(KINDS), "other", "idle")}}


def table(result: dict) -> str:
    lines = [f"{result['model']} {result['precision']}, micro-batch {result['micro_batch']} x {result['grad_accum']}, "
             f"{result['device']}: {1e3 * result['step_s']:.1f} ms a step, {result['tokens_per_s']:,.0f} tokens/s",
             "", "| kind | ms a step | share |", "|---|---|---|"]
    for kind, share in result["shares"].items():
        lines.append(f"| {kind} | {1e3 * result['seconds'][kind] / result['steps']:.1f} | {100 * share:.1f}% |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(description=__doc__, prog="python -m lab.step_profile")
    parser.add_argument("--model", default="1.6b", type=choice(fabric_gpt.PRESETS), help="model preset (default: 1.6b)")
    parser.add_argument("--precision", default="bf16-mixed", type=choice(fabric_gpt.PRECISIONS),
                        help="default: bf16-mixed")
    parser.add_argument("--accelerator", default="auto", type=choice(("auto", "cpu", "cuda")), help="default: auto")
    parser.add_argument("--steps", default=2, type=number(int, min=1, max=100), help="steps profiled (default: 2)")
    parser.add_argument("--out", default="runs/step-profile", type=Folder(), help="folder for profile.json and .md")
    parser.add_argument("extra", nargs="*", help="more fabric_gpt.py flags, after -- (checked by its parser)")
    return parser


def parse_args(argv=None):
    """This tool's flags, and the run's config: the flags passed on are checked by fabric_gpt.py's parser."""
    args = build_parser().parse_args(argv)
    return args, fabric_gpt.parse_args(["--model", args.model, "--precision", args.precision, "--accelerator",
                                        args.accelerator, *args.extra])


def main(argv=None) -> dict:
    with exits():  # a flag, the hardware or the memory plan that cannot work: one line, before the model is built
        args, cfg = parse_args(argv)
        fabric_gpt.validate(cfg)
    os.environ.setdefault("KINETO_LOG_LEVEL", "5")  # the profiler's own start and stop lines, and its CUDA probe
    result = profile(cfg, args.steps)
    out = Path(args.out)
    write_json_atomic(out / "profile.json", result)
    (out / "profile.md").write_text(table(result) + "\n")
    print(table(result))
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
