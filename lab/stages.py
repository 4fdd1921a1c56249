"""The whole lab in one command: its stages in order, from the MNIST files to report/REPORT.md.

    python -m lab                 # make lab: every stage
    python -m lab --force         # make lab FORCE=1: recompute every stage, even those with results on disk
    python -m lab --stages text,gpt-text,report   # make lab STAGES=...: only these

A stage whose result is on disk is skipped; an interrupted LeNet-5 or GPT-2 text run continues from its last checkpoint,
an interrupted benchmark keeps its finished cases. Each stage's output goes to runs/lab/logs/<stage>.log.
"""

import dataclasses
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

from core.run.checkpoints import Checkpoints
from core.run.files import RECORD, write_json_atomic
from core.run.hardware import cuda_mismatch
from core.run.ranks import usable_cores

REPO = Path(__file__).resolve().parents[1]
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
    real: bool = False  # a real interpreter: its figures include the process's memory, or it uses CUDA (see below)


def cuda_devices() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def lab_stages(runs: Path, data_dir: str, report_dir: str, text_dir: str = "data/text") -> list[Stage]:
    gpus = cuda_devices()
    unusable = cuda_mismatch()
    if unusable:
        print(f"warning: {unusable}; until then the lab is sized for the CPU", file=sys.stderr)
    accelerator = "cuda" if gpus else "cpu"
    cores = usable_cores()
    from core.gpt.text_corpus import CORPUS

    # both data sets first: offline without a mirror, the lab stops in its first seconds, not after the LeNet-5 runs
    stages = [Stage("data", ["datasets_local.py", "--root", data_dir], str(REPO / data_dir / "t10k-labels-idx1-ubyte")),
              Stage("text", ["-m", "core.gpt.text_corpus", "--data-dir", text_dir], str(REPO / text_dir / CORPUS))]
    from gelu_ext import ACTIVATIONS  # relu, LeNet-5's default, first

    def lenet(act: str) -> Stage:
        name = f"lab-lenet-{act}"
        return Stage(f"lenet-{act}", ["fabric_lenet.py", "--activation", act, "--run-name", name, "--out-dir", runs,
                                      "--data-dir", data_dir], f"{name}/{RECORD}", resumable_run=name)

    # A newcomer's order: LeNet-5 as the README trains it, the hand-written GELU checked, then the GELU runs and the
    # benchmarks, each measured once: bench-lenet takes the lenet-relu run as the default recipe (the same training)
    # and trains the short recipe at seed 0; bench-gelu takes the median of 7 repetitions. `make bench-lenet` (five
    # seeds of each recipe: their spread) and `make bench-gelu` (21 repetitions) measure more.
    stages += [lenet(ACTIVATIONS[0]), Stage("gelu-check", ["-m", "gelu_ext", "check", "--out", runs / "gelu"], "gelu/check.json")]
    stages += [lenet(act) for act in ACTIVATIONS[1:]]
    stages += [Stage("bench-gelu", ["-m", "gelu_ext", "bench", "--repeats", "7", "--out", runs / "gelu"], "gelu/bench.json"),
               Stage("bench-lenet", ["-m", "lab.bench", "--out-dir", runs, "--keep", "lenet", "--seeds", "1", "--race-epochs", "1", "--default-run",
                                     runs / f"lab-lenet-{ACTIVATIONS[0]}"], "bench-lenet/bench.json")]
    # GPT-2 on Shakespeare with nanoGPT's CPU recipe (docs/text.md): the report's curves, a model to sample from
    # (the later --accelerator wins over the recipe's cpu, as lab.bench's later --precision does)
    from lab.bench import NANOGPT_RECIPE

    text = "lab-gpt-text"
    stages.append(Stage("gpt-text", ["fabric_gpt.py", *NANOGPT_RECIPE, "--dataset", "text", "--data-dir", text_dir,
                                     "--steps", 2000, "--eval-every", 250, "--log-every", 10, "--checkpoint-every", 500,
                                     "--accelerator", accelerator, "--run-name", text, "--out-dir", runs],
                        f"{text}/{RECORD}", resumable_run=text))
    # sized to the hardware: the tiny model on CPU processes, the course's 1.6B model on the visible GPUs
    model, devices = ("1.6b", gpus) if gpus else ("tiny", min(2, cores))
    gpt = ["-m", "lab.bench", "--out-dir", runs, "--keep", "gpt", "--model", model, "--devices", devices, "--accelerator", accelerator]
    if gpus:
        gpt += ["--precisions", "bf16-mixed", "--micro-batch-size", "1", "--num-samples", 16 * devices]
    stages.append(Stage("bench-gpt", gpt, f"bench-gpt-{model}-{devices}x{accelerator}/bench.json", real=True))
    stages.append(Stage(GPU_CHECK, ["-m", "lab.gpu_check", "--runs", runs], f"{GPU_CHECK}/gpu-check.json",
                        optional="" if gpus else "no CUDA GPU on this machine"))
    stages.append(Stage("report", ["-m", "lab.report", "--runs", runs, "--out", report_dir], str(REPO / report_dir / "REPORT.md"),
                        always=True))
    for stage in stages if gpus else []:  # CUDA in forked children is untried: real interpreters there (gpu-check too)
        stage.real = True
    return stages


# ----------------------------------------------------------------------------- running stages
def run_logged(args: list, log: Path, python: str | None = None, env: dict | None = None) -> int:
    """Run one command of the repository with its output in `log`; Ctrl-C reaches it too (same process
    group; a warm client forwards it), so a training run saves its checkpoint before the lab stops."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a") as f:
        f.write(f"\n$ python {' '.join(map(str, args))}  # {datetime.now():%Y-%m-%d %H:%M:%S}\n")
        f.flush()
        proc = subprocess.Popen([python or sys.executable, *map(str, args)], cwd=REPO, stdout=f, stderr=subprocess.STDOUT,
                                env={**os.environ, **(env or {})})
        try:
            return proc.wait()
        except KeyboardInterrupt:
            return proc.wait()


def print_stage_table(table: list) -> None:
    """Each stage's seconds at the lab's end: where a lab's time went on this machine, at a glance."""
    print("\n| stage | | s |\n|---|---|---|")
    for name, how, seconds in table:
        print(f"| {name} | {how} | {'' if seconds is None else f'{seconds:.0f}'} |")
    print(f"| all | | {sum(s for _, _, s in table if s is not None):.0f} |\n", flush=True)


def last_line(log: Path) -> str:
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    return (errors or lines or [""])[-1].strip()


def lab(args) -> int:
    runs = Path(args.runs)
    stages = lab_stages(runs, args.data_dir, args.report_dir, args.text_dir)
    if args.stages:
        unknown = set(args.stages.split(",")) - {s.name for s in stages}
        if unknown:
            print(f"error: --stages: unknown {', '.join(sorted(unknown))}; the stages are "
                  f"{', '.join(s.name for s in stages)}", file=sys.stderr)
            return 2
        stages = [s for s in stages if s.name in args.stages.split(",")]
    # Stages start forked from a warm python (warm_python.py: torch, Lightning and transformers imported once, not
    # 10-15 s a stage and a benchmark case again): what they measure is time, and a fork trains at a real
    # interpreter's speed (docs/lab.md). bench-gpt's table reports each run's memory, which in a fork would count the
    # server's pages, and CUDA in a forked child is untried here: those stages start real interpreters.
    from core.host import warm_python

    started = time.time()
    print(f"lab: {len(stages)} stages into {runs}/ (logs in {runs / LOGS}/); finished stages are skipped"
          f"{' -- FORCE: recomputing all' if args.force else ''}", flush=True)
    print(f"lab: {expected_duration(stages, runs, args.force)}", flush=True)
    # after the estimate, which may time a matmul: its server imports meanwhile (none when no stage would use it)
    warm = warm_python.executable() if not all(s.real for s in stages) else warm_python.REAL
    table = []  # (stage, what happened, seconds): printed at the end
    for i, stage in enumerate(stages, 1):
        tag = f"[{i}/{len(stages)}] {stage.name:<16}"
        result = resolved(runs, stage)
        if stage.optional:
            write_json_atomic(runs / stage.name / "skipped.json", {"reason": stage.optional, "date": f"{datetime.now():%Y-%m-%d}"})
            print(f"{tag} skipped: {stage.optional}", flush=True)
            table.append((stage.name, "skipped", None))
            continue
        if args.force and stage.name != "data":
            forget(stage, runs, result)
        elif result.exists() and not stage.always:
            print(f"{tag} done earlier -> {result} (FORCE=1 recomputes)", flush=True)
            table.append((stage.name, "done earlier", None))
            continue
        command = [a for a in stage.args if not (args.force and a == "--keep")]
        if has_checkpoint(runs, stage):
            command += ["--resume", "auto"]
        elif stage.resumable_run and (runs / stage.resumable_run).exists():  # cut before its first checkpoint
            shutil.rmtree(runs / stage.resumable_run)  # nothing to continue; a run name is never overwritten
        log = runs / LOGS / f"{stage.name}.log"
        print(f"{tag} started{' (continuing its run)' if '--resume' in command else ''}, log {log}", flush=True)
        t0 = time.time()
        # a real stage's own short jobs (bench-gpt's probes) go to the lab's server instead of starting another
        code = run_logged(command, log, warm_python.REAL if stage.real else warm, {warm_python.SHARED: warm})
        if code:
            stopped = code in (128 + signal.SIGINT, -signal.SIGINT)  # exit 130, or killed by SIGINT
            print(f"{tag} {'stopped' if stopped else 'FAILED'} after {time.time() - t0:.0f} s: {last_line(log)}", flush=True)
            print(f"lab: {'interrupted' if stopped else 'stopped'} after {time.time() - started:.0f} s; finished stages "
                  "are kept: run `make lab` again to continue" + ("" if stopped else f" once the cause is fixed (log {log})"))
            return code if code > 0 else 130
        took = time.time() - t0
        print(f"{tag} done in {took:.0f} s -> {result}", flush=True)
        record_timing(runs, stage.name, took, resumed="--resume" in command)
        table.append((stage.name, "continued" if "--resume" in command else "ran", took))
    print_stage_table(table)
    print(f"lab: all stages finished in {time.time() - started:.0f} s; the report is {args.report_dir}/REPORT.md", flush=True)
    return 0


# ----------------------------------------------------------------------------- how long it takes
# Each stage's seconds in a whole `make lab` from a fresh clone on the CPUs it was timed on (as bench.cpu_label names
# them: 2 cores, no GPU), with that CPU's float32 matmul rate there (accounting.cpu_matmul_peak). A CPU of one of these
# names takes its times as they are (the AVX2 EPYC measured 0.34-1.0x of its rate within a day, under other load); any
# other CPU the times of the reference nearest its measured rate, scaled by the ratio, a rough guess (the AVX2
# EPYC's times scaled to the AVX-512 one said 12 min for its 7.8); once a lab has timed its stages here
# (runs/lab/timings.json), those times.
REFERENCES = {
    "AMD EPYC (family 25, model 1), 2 cores (AVX2)": (129e9, {  # 2026-11-28 04:35, a fresh lab at f4f9a2a, 842 s in
        # all (it said 15 min); bench-gpt: CPU Adam built in its first ZeRO-Offload case
        "data": 7, "text": 1, "lenet-relu": 63, "gelu-check": 1, "lenet-gelu_torch": 79, "lenet-gelu_py": 117,
        "lenet-gelu_cpp": 78, "bench-gelu": 37, "bench-lenet": 36, "gpt-text": 114, "bench-gpt": 308, "gpu-check": 0,
        "report": 2}),
    "AMD EPYC (family 26, model 2), 2 cores (AVX-512 BF16, AVX-512, AVX2)": (216e9, {  # 2026-11-30 21:26, after a
        # fresh clone's .ci/run at eef8622, 416 s in all (it said 9 min: gpt-text had been estimated, and both scripts
        # now choose bf16 autocast)
        "data": 4, "text": 1, "lenet-relu": 33, "gelu-check": 1, "lenet-gelu_torch": 37, "lenet-gelu_py": 63,
        "lenet-gelu_cpp": 34, "bench-gelu": 21, "bench-lenet": 24, "gpt-text": 40, "bench-gpt": 158, "gpu-check": 0,
        "report": 1}),
    "AMD EPYC (family 25, model 17), 2 cores (AVX-512 BF16, AVX-512, AVX2)": (144e9, {  # the same name and
        # instruction sets, 1.4-2.4x slower a stage; 2026-12-02 07:07, after a fresh clone's .ci/run at ac8a744, caches
        # empty, 763 s in all (it said 7 min: the name alone had matched the other EPYC's)
        "data": 8, "text": 1, "lenet-relu": 61, "gelu-check": 1, "lenet-gelu_torch": 71, "lenet-gelu_py": 114,
        "lenet-gelu_cpp": 66, "bench-gelu": 35, "bench-lenet": 46, "gpt-text": 94, "bench-gpt": 263, "gpu-check": 0,
        "report": 3}),
    "Intel(R) Xeon(R) Processor (family 6, model 207), 2 cores (AVX-512 BF16, AVX-512, AVX2)": (258e9, {  # no AMX;
        # 2026-11-28 22:17, a fresh clone at 0b3af48, 823 s in all (it said 7 min: the EPYC's times scaled by the
        # matmul rate, 1.27x)
        "data": 7, "text": 1, "lenet-relu": 69, "gelu-check": 1, "lenet-gelu_torch": 82, "lenet-gelu_py": 110,
        "lenet-gelu_cpp": 83, "bench-gelu": 29, "bench-lenet": 48, "gpt-text": 99, "bench-gpt": 292, "gpu-check": 0,
        "report": 3}),
    "Intel(R) Xeon(R) Processor (family 6, model 207), 2 cores (AMX-BF16, AVX-512 BF16, AVX-512, AVX2)": (216e9, {
        # the same model with AMX; 2026-11-29 21:09, a fresh clone at 91923cc, 693 s in all (it said 8 min: the
        # AVX-512 BF16 EPYC's times scaled by the matmul rate, 1.06x); both scripts chose bf16 autocast
        "data": 7, "text": 1, "lenet-relu": 59, "gelu-check": 1, "lenet-gelu_torch": 73, "lenet-gelu_py": 106,
        "lenet-gelu_cpp": 65, "bench-gelu": 22, "bench-lenet": 33, "gpt-text": 52, "bench-gpt": 269, "gpu-check": 0,
        "report": 2}),
}
TIMINGS = "lab/timings.json"  # under --runs


def expected_duration(stages: list, runs: Path, force: bool) -> str:
    """The line the lab starts with: how long the stages still to run should take on this machine, and whence."""
    from lab.bench import cpu_label

    timed = read_json(runs / TIMINGS)
    here = timed.get("cpu") == cpu_label()
    todo = [s for s in stages if not s.optional and (force or s.always or not resolved(runs, s).exists())]
    if here and all(s.name in timed["seconds"] for s in todo):
        seconds, how = sum(timed["seconds"][s.name] for s in todo), f"as the stages took here before ({runs / TIMINGS})"
    else:
        reference, scale, how = cpu_label(), 1.0, "as a whole lab took on this CPU model (lab.REFERENCES)"
        if reference not in REFERENCES:
            from core.plan import accounting

            rate = accounting.cpu_matmul_peak("32-true")[0]
            reference = min(REFERENCES, key=lambda cpu: abs(math.log(REFERENCES[cpu][0] / rate)))
            scale = REFERENCES[reference][0] / rate
            how = f"the stages' times on an {reference}, scaled by this CPU's measured matmul rate ({1 / scale:.2f}x)"
        seconds = sum(timed["seconds"].get(s.name) if here and s.name in timed["seconds"] else
                      REFERENCES[reference][1].get(s.name, 60) * scale for s in todo)
    about = f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"
    return f"{len(todo)} stage(s) to run, expected to take about {about} on this machine ({how})"


def record_timing(runs: Path, stage: str, seconds: float, resumed: bool) -> None:
    """A stage's time on this machine, for the next lab's estimate (a continued run's time is only its remainder)."""
    from lab.bench import cpu_label

    timed = read_json(runs / TIMINGS)
    if timed.get("cpu") != cpu_label():
        timed = {"cpu": cpu_label(), "seconds": {}}
    if not resumed:
        timed["seconds"][stage] = round(seconds, 1)
        write_json_atomic(runs / TIMINGS, timed)


def read_json(path: Path) -> dict:
    import json

    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {"seconds": {}}


def resolved(runs: Path, stage: Stage) -> Path:
    return Path(stage.result) if Path(stage.result).is_absolute() else runs / stage.result


def has_checkpoint(runs: Path, stage: Stage) -> bool:
    """The stage's training run was cut after a complete checkpoint (a `.partial` save cannot be resumed)."""
    return bool(stage.resumable_run) and bool(Checkpoints(runs / stage.resumable_run / "checkpoints").complete())


def forget(stage: Stage, runs: Path, result: Path) -> None:
    """FORCE: remove a stage's results so that it runs from scratch (a benchmark, run without --keep, starts
    each of its cases clean; gpu-check always does)."""
    if stage.resumable_run:
        shutil.rmtree(runs / stage.resumable_run, ignore_errors=True)
    result.unlink(missing_ok=True)


def build_parser():
    from core.run.flags import Folder, Names, Parser

    stage_names = [s.name for s in lab_stages(Path("runs"), "data/mnist", "report")]
    parser = Parser(description=__doc__, prog="python -m lab")
    parser.add_argument("--runs", default="runs", type=Folder(), help="folder holding the runs and benchmarks (default: runs)")
    parser.add_argument("--force", action="store_true", help="recompute every stage, even those with results on disk")
    parser.add_argument("--stages", default="", type=Names(stage_names), help="comma-separated stage names to run "
                        "(default: all)")
    parser.add_argument("--data-dir", default="data/mnist", type=Folder(), help="folder for the MNIST files "
                        "(default: data/mnist)")
    parser.add_argument("--text-dir", default="data/text", type=Folder(), help="folder for the Shakespeare corpus "
                        "(default: data/text)")
    parser.add_argument("--report-dir", default="report", type=Folder(), help="folder for REPORT.md and its figures "
                        "(default: report)")
    return parser


def main(argv=None) -> int:
    return lab(build_parser().parse_args(argv))
