"""The whole lab in one command, and a few-minute check of every CUDA path of this repository.

    python lab.py                 # make lab: every stage, from the MNIST files to report/REPORT.md
    python lab.py --force         # make lab FORCE=1: recompute every stage, even those with results on disk
    python lab.py gpu-check       # make gpu-check: each GPU path with a verdict, into runs/gpu-check/

A stage whose result is on disk is skipped; an interrupted LeNet-5 run continues from its last checkpoint,
an interrupted benchmark keeps its finished cases. Each stage's output goes to runs/lab/logs/<stage>.log.
"""

import csv
import dataclasses
import functools
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from datetime import datetime
from pathlib import Path

from hardware import cuda_mismatch
from run_state import RECORD, Checkpoints, write_json_atomic

REPO = Path(__file__).resolve().parent
ACTIVATIONS = ("relu", "gelu_torch", "gelu_py", "gelu_cpp")  # relu is LeNet-5's default
LOGS = Path("lab/logs")  # under --runs
GPU_CHECK = "gpu-check"


@dataclasses.dataclass
class Stage:
    name: str
    args: list  # a command of this repository: [script or -m module, flags...]
    result: str  # the file (under --runs unless absolute) whose presence means the stage is done
    resumable_run: str = ""  # a training run folder to continue with --resume auto when it has a checkpoint
    optional: str = ""  # why the stage is skipped on this machine ("" when it runs)
    always: bool = False  # cheap and reads the other stages' results: runs every time


def cuda_devices() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def lab_stages(runs: Path, data_dir: str, report_dir: str) -> list[Stage]:
    gpus = cuda_devices()
    unusable = cuda_mismatch()
    if unusable:
        print(f"warning: {unusable}; until then the lab is sized for the CPU", file=sys.stderr)
    accelerator = "cuda" if gpus else "cpu"
    cores = os.cpu_count() or 1
    stages = [Stage("data", ["datasets_local.py", "--root", data_dir], str(REPO / data_dir / "t10k-labels-idx1-ubyte"))]
    for act in ACTIVATIONS:
        name = f"lab-lenet-{act}"
        stages.append(Stage(f"lenet-{act}", ["fabric_lenet.py", "--activation", act, "--run-name", name, "--out-dir", runs,
                                             "--data-dir", data_dir],
                            f"{name}/{RECORD}", resumable_run=name))
    stages += [Stage("gelu-check", ["-m", "gelu_ext", "check", "--out", runs / "gelu"], "gelu/check.json"),
               Stage("bench-gelu", ["-m", "gelu_ext", "bench", "--out", runs / "gelu"], "gelu/bench.json"),
               Stage("bench-lenet", ["bench.py", "--out-dir", runs, "--keep", "lenet"], "bench-lenet/bench.json")]
    # sized to the hardware: the tiny model on CPU processes, the course's 1.6B model on the visible GPUs
    model, devices = ("1.6b", gpus) if gpus else ("tiny", min(2, cores))
    gpt = ["bench.py", "--out-dir", runs, "--keep", "gpt", "--model", model, "--devices", devices, "--accelerator", accelerator]
    if gpus:
        gpt += ["--precisions", "bf16-mixed", "--micro-batch-size", "1", "--num-samples", 16 * devices]
    stages.append(Stage("bench-gpt", gpt, f"bench-gpt-{model}-{devices}x{accelerator}/bench.json"))
    stages.append(Stage(GPU_CHECK, ["lab.py", "--runs", runs, GPU_CHECK], f"{GPU_CHECK}/gpu-check.json",
                        optional="" if gpus else "no CUDA GPU on this machine"))
    stages.append(Stage("report", ["report.py", "--runs", runs, "--out", report_dir], str(REPO / report_dir / "REPORT.md"),
                        always=True))
    return stages


# ----------------------------------------------------------------------------- running stages
def run_logged(args: list, log: Path) -> int:
    """Run one command of the repository with its output in `log`; Ctrl-C reaches it too (same process
    group), so a training run saves its checkpoint before the lab stops."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a") as f:
        f.write(f"\n$ python {' '.join(map(str, args))}  # {datetime.now():%Y-%m-%d %H:%M:%S}\n")
        f.flush()
        proc = subprocess.Popen([sys.executable, *map(str, args)], cwd=REPO, stdout=f, stderr=subprocess.STDOUT)
        try:
            return proc.wait()
        except KeyboardInterrupt:
            return proc.wait()


def last_line(log: Path) -> str:
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    return (errors or lines or [""])[-1].strip()


def lab(args) -> int:
    runs = Path(args.runs)
    stages = lab_stages(runs, args.data_dir, args.report_dir)
    if args.stages:
        unknown = set(args.stages.split(",")) - {s.name for s in stages}
        if unknown:
            print(f"error: --stages: unknown {', '.join(sorted(unknown))}; the stages are "
                  f"{', '.join(s.name for s in stages)}", file=sys.stderr)
            return 2
        stages = [s for s in stages if s.name in args.stages.split(",")]
    started = time.time()
    print(f"lab: {len(stages)} stages into {runs}/ (logs in {runs / LOGS}/); finished stages are skipped"
          f"{' -- FORCE: recomputing all' if args.force else ''}", flush=True)
    for i, stage in enumerate(stages, 1):
        tag = f"[{i}/{len(stages)}] {stage.name:<16}"
        result = Path(stage.result) if Path(stage.result).is_absolute() else runs / stage.result
        if stage.optional:
            write_json_atomic(runs / stage.name / "skipped.json", {"reason": stage.optional, "date": f"{datetime.now():%Y-%m-%d}"})
            print(f"{tag} skipped: {stage.optional}", flush=True)
            continue
        if args.force and stage.name != "data":
            forget(stage, runs, result)
        elif result.exists() and not stage.always:
            print(f"{tag} done earlier -> {result} (FORCE=1 recomputes)", flush=True)
            continue
        command = [a for a in stage.args if not (args.force and a == "--keep")]
        if has_checkpoint(runs, stage):
            command += ["--resume", "auto"]
        elif stage.resumable_run and (runs / stage.resumable_run).exists():  # cut before its first checkpoint
            shutil.rmtree(runs / stage.resumable_run)  # nothing to continue; a run name is never overwritten
        log = runs / LOGS / f"{stage.name}.log"
        print(f"{tag} started{' (continuing its run)' if '--resume' in command else ''}, log {log}", flush=True)
        t0 = time.time()
        code = run_logged(command, log)
        if code:
            stopped = code in (128 + signal.SIGINT, -signal.SIGINT)  # exit 130, or killed by SIGINT
            print(f"{tag} {'stopped' if stopped else 'FAILED'} after {time.time() - t0:.0f} s: {last_line(log)}", flush=True)
            print(f"lab: {'interrupted' if stopped else 'stopped'} after {time.time() - started:.0f} s; finished stages "
                  "are kept: run `make lab` again to continue" + ("" if stopped else f" once the cause is fixed (log {log})"))
            return code if code > 0 else 130
        print(f"{tag} done in {time.time() - t0:.0f} s -> {result}", flush=True)
    print(f"lab: all stages finished in {time.time() - started:.0f} s; the report is {args.report_dir}/REPORT.md", flush=True)
    return 0


def has_checkpoint(runs: Path, stage: Stage) -> bool:
    """The stage's training run was cut after a complete checkpoint (a `.partial` save cannot be resumed)."""
    return bool(stage.resumable_run) and bool(Checkpoints(runs / stage.resumable_run / "checkpoints").complete())


def forget(stage: Stage, runs: Path, result: Path) -> None:
    """FORCE: remove a stage's results so that it runs from scratch (a benchmark, run without --keep, starts
    each of its cases clean; gpu-check always does)."""
    if stage.resumable_run:
        shutil.rmtree(runs / stage.resumable_run, ignore_errors=True)
    result.unlink(missing_ok=True)


# ----------------------------------------------------------------------------- gpu-check
def visible_gpus(cuda_visible_devices: str | None, count: int) -> list:
    """The GPUs CUDA shows this process, as NVML indices (int) or UUIDs (str, GPU-... or MIG-...), in CUDA's
    order; like CUDA, the list ends at the first entry that names no device."""
    if cuda_visible_devices is None:
        return list(range(count))
    visible = []
    for entry in (e.strip() for e in cuda_visible_devices.split(",")):
        if entry.isdigit() and int(entry) < count:
            visible.append(int(entry))
        elif entry.startswith(("GPU-", "MIG-")):
            visible.append(entry)
        else:
            break
    return visible


CSV_HEADER = ["time_s", "gpu", "util_pct", "mem_used_gib", "mem_total_gib", "label"]


class NvmlSampler(threading.Thread):
    """Utilization and memory of the GPUs this process sees (CUDA_VISIBLE_DEVICES), sampled through NVML while
    the checks run, into a CSV file (labels quoted). A MIG slice has no utilization counter: left empty."""

    def __init__(self, path: Path, every_s: float = 0.5):
        super().__init__(daemon=True)
        import pynvml

        pynvml.nvmlInit()
        self.nvml, self.path, self.every_s = pynvml, path, every_s
        by = lambda g: (pynvml.nvmlDeviceGetHandleByIndex(g) if isinstance(g, int)  # noqa: E731
                        else pynvml.nvmlDeviceGetHandleByUUID(g))
        self.handles = [by(g) for g in visible_gpus(os.environ.get("CUDA_VISIBLE_DEVICES"), pynvml.nvmlDeviceGetCount())]
        self.done, self.t0 = threading.Event(), time.time()
        self.label = ""  # the check running now, written beside each sample

    def sample(self, handle) -> tuple:
        try:
            util = self.nvml.nvmlDeviceGetUtilizationRates(handle).gpu
        except self.nvml.NVMLError:  # MIG slices (and some vGPUs) do not report it
            util = ""
        mem = self.nvml.nvmlDeviceGetMemoryInfo(handle)
        return util, f"{mem.used / 2**30:.3f}", f"{mem.total / 2**30:.3f}"

    def run(self) -> None:
        with open(self.path, "w", newline="") as f:
            out = csv.writer(f)
            out.writerow(CSV_HEADER)
            while not self.done.wait(self.every_s):
                for i, h in enumerate(self.handles):
                    try:
                        out.writerow([f"{time.time() - self.t0:.2f}", i, *self.sample(h), self.label])
                    except self.nvml.NVMLError as e:  # a sample lost is no reason to stop sampling
                        out.writerow([f"{time.time() - self.t0:.2f}", i, "", "", "", f"{self.label} (NVML: {e})"])
                f.flush()

    def stop(self) -> None:
        self.done.set()
        self.join()


# A learnable token sequence, SGD without clipping: every strategy must give the single GPU's losses.
TINY_EXACT = ["--model", "tiny", "--dataset", "ramp", "--num-samples", "48", "--warmup-steps", "1", "--optimizer", "sgd",
              "--grad-clip", "0", "--lr", "0.5", "--accelerator", "cuda", "--precision", "32-true"]
TINY_BY_STRATEGY = {  # the single GPU's global batch of 4 on 2 GPUs
    "ddp": ["--micro-batch-size", "1", "--grad-accum", "2"], "fsdp": ["--micro-batch-size", "1", "--grad-accum", "2"],
    "tp": ["--micro-batch-size", "4"], "pp": ["--micro-batch-size", "2", "--grad-accum", "2"],
    "deepspeed_stage_1": ["--micro-batch-size", "1", "--grad-accum", "2"],
    "deepspeed_stage_2": ["--micro-batch-size", "1", "--grad-accum", "2"],
    "deepspeed_stage_3": ["--micro-batch-size", "1", "--grad-accum", "2"],
}


def gpu_check(args) -> int:
    gpus = cuda_devices()
    if not gpus:
        print("gpu-check: no CUDA GPU is visible on this machine (torch.cuda.is_available() is False); "
              "run it on a CUDA machine", file=sys.stderr)
        return 1
    import torch

    out = Path(args.runs) / GPU_CHECK
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    sampler = NvmlSampler(out / "nvml.csv")
    sampler.start()
    rows, log = [], out / "gpu-check.log"

    def check(name: str, command: list, verdict, *more: list) -> None:
        """Run the command(s); the verdict reads what they wrote and returns (passed, the figure that shows it)."""
        sampler.label = name
        t0 = time.time()
        code = 0
        for c in (command, *more):
            code = code or run_logged(c, log)
        try:
            ok, figure = verdict() if code == 0 else (False, f"exit {code}: {last_line(log)}")
        except Exception as e:  # a verdict that cannot be read is a failed check, with its cause
            ok, figure = False, f"{type(e).__name__}: {e}"
        rows.append({"check": name, "verdict": "pass" if ok else "FAIL", "figure": figure, "seconds": time.time() - t0})
        print(f"{name:<34} {'pass' if ok else 'FAIL'}  {figure}", flush=True)

    record = lambda run: json.loads((out / run / RECORD).read_text())  # noqa: E731
    for precision in ("32-true", "16-mixed", "bf16-mixed"):
        run = f"lenet-{precision}"

        def lenet_verdict(run=run):
            r = record(run)
            return r["test_acc"] >= 0.97, f"test acc {100 * r['test_acc']:.2f}% after 1 epoch, {r['samples_per_s']:,.0f} samples/s"
        check(f"LeNet-5 {precision}", ["fabric_lenet.py", "--epochs", "1", "--precision", precision, "--accelerator", "cuda",
                                       "--no-tb-images", "--out-dir", out, "--run-name", run], lenet_verdict)

    def graphs_verdict():
        r = record("lenet-graphs")
        return (r["test_acc"] >= 0.97 and r["cuda_graphs"] == "captured and replayed",
                f"CUDA graphs {r['cuda_graphs']}, no host sync in a step, test acc {100 * r['test_acc']:.2f}% after 1 "
                f"epoch, {r['samples_per_s']:,.0f} samples/s")
    check("LeNet-5 compiled, CUDA graphs", ["fabric_lenet.py", "--epochs", "1", "--compile", "--compile-mode",
                                            "reduce-overhead", "--sync-check", "--accelerator", "cuda", "--no-tb-images",
                                            "--out-dir", out, "--run-name", "lenet-graphs"], graphs_verdict)

    def gelu_verdict():
        checked = json.loads((out / "gelu" / "check.json").read_text())
        rows_ = checked["rows"]
        bench = json.loads((out / "gelu" / "bench.json").read_text())["rows"]
        worst = max(r["forward_max_abs_err"] for r in rows_ if r["dtype"] == "float32")
        ratio = max(r["ratio"] for r in bench if r["impl"] == "gelu_cpp")
        kernel = checked["env"].get("cuda_implementation", "?")
        return (all(r["gradcheck_float64"] for r in rows_) and worst < 1e-5,
                f"max |dy| {worst:.1e} (float32), gradcheck float64 passed, {kernel}: time vs F.gelu up to {ratio:.2f}x "
                "(float32, bf16, fp16; goal 1.1x)")
    if gpus >= 2:  # DataParallel's worker threads once ran bf16 autocast as float16; the record names what conv1 ran in
        def dp_verdict():
            r = record("lenet-dp-bf16")
            return (r["test_acc"] >= 0.97 and r["compute_dtype"] == "torch.bfloat16",
                    f"conv1 computed in {r['compute_dtype']}, test acc {100 * r['test_acc']:.2f}% after 1 epoch")
        check("LeNet-5 dp bf16-mixed, 2 GPUs", ["fabric_lenet.py", "--epochs", "1", "--precision", "bf16-mixed",
                                                "--strategy", "dp", "--devices", "2", "--accelerator", "cuda",
                                                "--no-tb-images", "--out-dir", out, "--run-name", "lenet-dp-bf16"], dp_verdict)
    else:
        rows.append({"check": "LeNet-5 dp bf16-mixed", "verdict": "not run", "figure": "needs 2 GPUs", "seconds": 0})

    dtypes = ["--dtypes", "float32", "bfloat16", "float16"]
    check("C++ GELU on CUDA tensors", ["-m", "gelu_ext", "check", "--device", "cuda", "--out", out / "gelu", *dtypes],
          gelu_verdict, ["-m", "gelu_ext", "bench", "--device", "cuda", "--out", out / "gelu", *dtypes])

    losses = lambda run: [loss for _, loss in record(run)["losses"]]  # noqa: E731

    def same_losses(run: str, ref: str, tolerance: float):
        """A verdict: every step's loss of `run` within `tolerance` (relative) of `ref`'s."""
        got, want = losses(run), losses(ref)
        worst = max(abs(a - b) / abs(b) for a, b in zip(got, want))
        return len(got) == len(want) and worst < tolerance, f"largest relative loss difference {worst:.1e} over {len(want)} steps"

    check("GPT tiny, 1 GPU (reference)", ["fabric_gpt.py", *TINY_EXACT, "--micro-batch-size", "4", "--out-dir", out,
                                          "--run-name", "gpt-single"], lambda: (True, f"losses {losses('gpt-single')[0]:.4f} .. "
                                                                                      f"{losses('gpt-single')[-1]:.4f}"))
    for strategy, flags in TINY_BY_STRATEGY.items() if gpus >= 2 else ():
        check(f"GPT tiny, {strategy} on 2 GPUs", ["fabric_gpt.py", *TINY_EXACT, "--strategy", strategy, "--devices", "2",
                                                 *flags, "--out-dir", out, "--run-name", f"gpt-{strategy}"],
              functools.partial(same_losses, f"gpt-{strategy}", "gpt-single", 1e-3))
    if gpus < 2:
        rows.append({"check": "GPT tiny, multi-GPU strategies", "verdict": "not run", "figure": "needs 2 GPUs", "seconds": 0})
    # a one-rank mesh still builds and moves the model as the strategy does: tp and pp once never left the CPU
    for strategy, flags in (("tp", ["--micro-batch-size", "4"]), ("pp", ["--micro-batch-size", "2", "--grad-accum", "2"])):
        check(f"GPT tiny, {strategy} on 1 GPU", ["fabric_gpt.py", *TINY_EXACT, "--strategy", strategy, "--devices", "1",
                                                *flags, "--out-dir", out, "--run-name", f"gpt-{strategy}-1"],
              functools.partial(same_losses, f"gpt-{strategy}-1", "gpt-single", 1e-3))

    # 16-mixed from a loss scale of 2^40: the first steps overflow and must be skipped while the run goes on
    def overflow_verdict(run: str, steps: int):
        r = record(run)
        ok = r["steps"] == steps and 0 < r["skipped_steps"] < steps and not math.isnan(r["final_loss"])
        return ok, f"{r['skipped_steps']} of {r['steps']} steps skipped, loss {r['first_loss']:.3f} .. {r['final_loss']:.3f}"
    fp16 = ["fabric_gpt.py", "--model", "tiny", "--dataset", "ramp", "--lr", "1e-2", "--precision", "16-mixed",
            "--loss-scale-power", "40", "--accelerator", "cuda", "--micro-batch-size", "4", "--num-samples", "1200",
            "--log-every", "50", "--out-dir", out]
    check("GPT tiny 16-mixed, overflow, Fabric", [*fp16, "--run-name", "gpt-fp16"],
          functools.partial(overflow_verdict, "gpt-fp16", 300))
    check("GPT tiny 16-mixed, overflow, ZeRO-2", [*fp16, "--strategy", "deepspeed_stage_2", "--run-name", "gpt-fp16-ds"],
          functools.partial(overflow_verdict, "gpt-fp16-ds", 300))

    # ZeRO-Infinity: optimizer states swapped to a folder through libaio (tensors of 1 MiB or more: a wider tiny model)
    # and stepped by DeepSpeed's CPU Adam, so the reference is AdamW on one GPU
    tiny_adamw = ["fabric_gpt.py", "--model", "tiny", "--n-embd", "128", "--n-layer", "4", "--dataset", "ramp",
                  "--num-samples", "48", "--warmup-steps", "1", "--lr", "1e-2", "--accelerator", "cuda",
                  "--micro-batch-size", "4", "--out-dir", out]
    check("GPT tiny, ZeRO-3 NVMe offload, 1 GPU", [*tiny_adamw, "--run-name", "gpt-adamw"],
          functools.partial(same_losses, "gpt-nvme", "gpt-adamw", 2e-3),
          [*tiny_adamw, "--strategy", "deepspeed_stage_3_offload", "--nvme-path", out / "nvme", "--run-name", "gpt-nvme"])

    fits = torch.cuda.get_device_properties(0).total_memory / 2**30 >= 48  # AdamW on 1.56B: ~25 GiB of states + activations
    big = ["fabric_gpt.py", "--model", "1.6b", "--precision", "bf16-mixed", "--accelerator", "cuda", "--micro-batch-size", "1",
           "--steps", "8", "--num-samples", "64", "--out-dir", out, "--run-name", "gpt-1.6b"]
    snapshot = threading.Timer(60, lambda: (out / "nvidia-smi.txt").write_text(nvidia_smi()))
    snapshot.start()  # one nvidia-smi table while the large model trains
    check("GPT-2 1.6B, 1 GPU, bf16-mixed", big + ([] if fits else ["--grad-checkpointing"]),
          lambda: big_model_verdict(record("gpt-1.6b")))
    snapshot.cancel()
    if not (out / "nvidia-smi.txt").exists():
        (out / "nvidia-smi.txt").write_text(nvidia_smi())
    sampler.stop()

    summary = {"date": f"{datetime.now():%Y-%m-%d}", "gpu": torch.cuda.get_device_name(0), "gpus": gpus,
               "torch": torch.__version__, "cuda": torch.version.cuda, "rows": rows}
    write_json_atomic(out / "gpu-check.json", summary)
    lines = [f"GPU check on {gpus} x {summary['gpu']} ({summary['date']}, torch {summary['torch']}, CUDA {summary['cuda']}):",
             "", "| check | verdict | figure | s |", "|---|---|---|---|"]
    lines += [f"| {r['check']} | {r['verdict']} | {r['figure']} | {r['seconds']:.0f} |" for r in rows]
    (out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines) + f"\nwrote {out}/table.md, gpu-check.json, nvml.csv")
    return 0 if all(r["verdict"] != "FAIL" for r in rows) else 1


def big_model_verdict(r: dict) -> tuple[bool, str]:
    """The large run trained (finite loss) within its memory plan; its speed, with MFU where the GPU's peak is known."""
    mem = r["memory"]["max_allocated_gb"]
    mfu = (f"MFU {100 * r['mfu']:.1f}% of {r['peak_flops'] / 1e12:.0f} TFLOPS" if r["mfu"] is not None
           else f"MFU unknown ({r['peak_flops_source']})")
    setup = r.get("memory_setup", {}).get("max_allocated_gb")
    predicted = r.get("predicted")
    step = (f"step {1e3 * r['step_time_s']:.0f} ms vs predicted {1e3 * predicted['step_time_s']:.0f} ms "
            f"({predicted['cluster']}, efficiency {predicted['efficiency']}), " if predicted else "")
    return (not math.isnan(r["final_loss"]) and mem <= 1.25 * r["planned_gb"], step +
            f"{r['tokens_per_s']:,.0f} tok/s, {r['tflops_per_device']:.1f} TFLOPS (6N+attn) / {r['tflops_per_device_8n']:.1f} "
            f"(8N), {mfu}, training peak {mem:.1f} GiB vs plan {r['planned_gb']:.1f} GiB"
            + (f" (set-up peak {setup:.1f})" if setup is not None else "")
            + (f"; attention {r['attention_kernel']}" if r.get("attention_kernel") else ""))


def nvidia_smi() -> str:
    try:
        return subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return f"nvidia-smi could not run: {e}"


def build_parser():
    from flags import Folder, Names, Parser, choice

    stage_names = [s.name for s in lab_stages(Path("runs"), "data/mnist", "report")]
    parser = Parser(description=__doc__, prog="lab.py")
    parser.add_argument("command", nargs="?", default="lab", type=choice(("lab", GPU_CHECK)),
                        help=f"lab (default), or {GPU_CHECK} on a CUDA machine")
    parser.add_argument("--runs", default="runs", type=Folder(), help="folder holding the runs and benchmarks (default: runs)")
    parser.add_argument("--force", action="store_true", help="recompute every stage, even those with results on disk")
    parser.add_argument("--stages", default="", type=Names(stage_names), help="comma-separated stage names to run "
                        "(default: all)")
    parser.add_argument("--data-dir", default="data/mnist", type=Folder(), help="folder for the MNIST files "
                        "(default: data/mnist)")
    parser.add_argument("--report-dir", default="report", type=Folder(), help="folder for REPORT.md and its figures "
                        "(default: report)")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return lab(args) if args.command == "lab" else gpu_check(args)


if __name__ == "__main__":
    sys.exit(main())
