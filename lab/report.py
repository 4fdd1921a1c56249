"""Write the lab report from the runs on disk: report/REPORT.md with PNG figures beside it.

    python -m lab.report                     # newest run of each kind under runs/
    python -m lab.report --lenet runs/lenet-relu-20261121-120000 --gpt-bench runs/bench-gpt-tiny-2xcpu

Sections whose runs are missing or unreadable say so, and which command produces them; never a traceback.
"""

import json
import re
import traceback
from datetime import datetime
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display needed
import matplotlib.pyplot as plt  # noqa: E402

from core.run.files import RECORD  # noqa: E402


def load_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def newest(paths):
    paths = [p for p in paths if p.exists()]
    return max(paths, key=lambda p: p.stat().st_mtime) if paths else None


def lenet_runs(runs: Path) -> list[Path]:
    """Run folders of fabric_lenet.py: the run record's `kind` (config.json carries it from the start)."""
    return [p for p in runs.iterdir() if p.is_dir() and (load_json(p / "config.json") or {}).get("kind") == "lenet"]


def scalars(run_dir: Path, tag: str) -> list[tuple[int, float]]:
    """(step, value) pairs of one TensorBoard scalar, read with TensorBoard's own event reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    points = {}
    for events in sorted(run_dir.glob("events.out.tfevents.*")):  # a resumed run adds a file; later wins
        acc = EventAccumulator(str(events), size_guidance={"scalars": 0})
        acc.Reload()
        if tag in acc.Tags().get("scalars", []):
            points.update({e.step: e.value for e in acc.Scalars(tag)})
    return sorted(points.items())


RUNS = "runs"  # --runs' default, and make's (RUNS)


class Report:
    def __init__(self, out: Path, runs: Path):
        self.out, self.lines = out, []
        # make's commands in the report write and read make's RUNS: another folder is named in each of them
        self.runs_var = "" if runs == Path(RUNS) else f" RUNS={runs}"
        out.mkdir(parents=True, exist_ok=True)

    def add(self, *lines: str) -> None:
        self.lines.extend(lines)

    def figure(self, fig, name: str, caption: str) -> None:
        fig.tight_layout()
        fig.savefig(self.out / name, dpi=110)
        plt.close(fig)
        self.add(f"![{caption}]({name})", "")

    def note(self, text: str) -> None:
        self.add(f"> **Note:** {text}", "")

    def section(self, title: str, build, *args) -> None:
        """Build one section; any failure becomes a note naming the cause instead of a traceback."""
        self.add(f"## {title}", "")
        try:
            build(self, *args)
        except Exception as e:  # a run from an older version, a half-written file: say so and go on
            where = traceback.extract_tb(e.__traceback__)[-1]
            self.note(f"this section could not be built ({type(e).__name__}: {e}, at {Path(where.filename).name}:"
                      f"{where.lineno}); the run may be from an older version of the scripts or half-written.")

    def write(self) -> Path:
        path = self.out / "REPORT.md"
        text = "\n".join(self.lines) + "\n"
        if self.runs_var:
            text = re.sub(r"`make ([a-z-]+)([^`]*)`", lambda m: f"`make {m[1]}{m[2]}{self.runs_var}`", text)
        path.write_text(text)
        return path


# ----------------------------------------------------------------------------- sections
def section_lenet(rep: Report, runs: Path, chosen: Path | None) -> None:
    candidates = lenet_runs(runs) if runs.is_dir() else []
    complete = [p for p in candidates if (p / RECORD).exists()]
    for p in sorted(set(candidates) - set(complete)):
        rep.note(f"run `{p.name}` has no record.json: it was interrupted or is still running. "
                 f"Continue it with `make lenet RESUME=auto RUN={p.name}`.")
    # the default activation's newest run when there is one (make lab also trains each activation after it), and of
    # those one on the whole data set (a run cut short by --train-samples, --test-samples or --max-steps is a check,
    # not a result)
    settings = {p: (load_json(p / RECORD) or {}).get("config", {}) for p in complete}
    defaults = [p for p in complete if settings[p].get("activation") == "relu"]
    whole = [p for p in defaults if not any(settings[p].get(k) for k in ("train_samples", "test_samples", "max_steps"))]
    run = chosen or newest([p / RECORD for p in whole or defaults or complete])
    run = run.parent if run and run.name == RECORD else run
    if run is None:
        rep.note(f"no finished LeNet-5 run under {runs}/. Produce one with `make lenet`.")
        return
    s = load_json(run / RECORD)
    if s is None:
        rep.note(f"`{run}/record.json` is missing or unreadable. Re-run with `make lenet RUN={run.name}`.")
        return
    cfg = s["config"]
    epochs = f"{s['epochs']} epoch{'s' if s['epochs'] != 1 else ''}"
    rep.add(f"Run `{run.name}`: activation **{cfg['activation']}**, {epochs}, batch {cfg['batch_size']}, "
            f"{cfg['optimizer']} lr {cfg['lr']} ({cfg['schedule']}), precision {cfg['precision']}, "
            f"{s['world_size']} process(es) on {s['device']}.", "",
            f"**Test accuracy: {100 * s['test_acc']:.2f}%** (test loss {s['test_loss']:.4f}), "
            f"{s['train_time_s']:.1f} s of training, {s['samples_per_s']:,.0f} samples/s.", "",
            "Steps of the experiment: parse the MNIST IDX files (datasets_local.py), train LeNet-5 through Fabric "
            "with the settings above, evaluate on the 10,000 test images after every epoch, log to TensorBoard, "
            "checkpoint every epoch.", "")
    lenet_curves(rep, run, s)
    lenet_per_class(rep, s)
    lenet_confusion(rep, s)
    lenet_activations(rep, complete)


def lenet_curves(rep: Report, run: Path, s: dict) -> None:
    loss = scalars(run, "train/loss")
    acc = [(h["step"], h["test_acc"]) for h in s["history"]]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.5))
    if loss:
        a.plot(*zip(*loss), lw=1)
    else:
        a.plot([h["step"] for h in s["epoch_history"]], [h["train_loss"] for h in s["epoch_history"]], marker="o")
    a.set(xlabel="step", ylabel="cross-entropy (log scale)", title="training loss", yscale="log")
    # a loss from ~2.3 to ~0.5 spans less than a decade: ticks at 1, 1.5, 2, 3, 5 and 7 of each, labelled plainly
    a.yaxis.set_major_locator(matplotlib.ticker.LogLocator(base=10, subs=(1.0, 1.5, 2.0, 3.0, 5.0, 7.0)))
    a.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    a.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    b.plot(*zip(*[(st, 100 * v) for st, v in acc]), marker="o")
    b.set(xlabel="step", ylabel="%", title="test accuracy")
    rep.figure(fig, "lenet_curves.png", "LeNet-5 training loss and test accuracy")


def lenet_per_class(rep: Report, s: dict) -> None:
    fig, ax = plt.subplots(figsize=(7, 3))
    ax.bar(range(10), [100 * a for a in s["per_class_acc"]])
    low = min(95.0, 100 * min(s["per_class_acc"]) - 1)  # the differences are tenths of a percent: a cut axis, said so
    ax.set(xticks=range(10), xlabel="digit", ylabel=f"test accuracy %\n(axis starts at {low:.0f}%)", ylim=(low, 100),
           title="per-class test accuracy")
    rep.figure(fig, "lenet_per_class.png", "per-class accuracy")
    rep.add("| digit | " + " | ".join(map(str, range(10))) + " |", "|---" * 11 + "|",
            "| accuracy | " + " | ".join(f"{100 * a:.2f}%" for a in s["per_class_acc"]) + " |", "")


def lenet_confusion(rep: Report, s: dict) -> None:
    fig, ax = plt.subplots(figsize=(5, 4.5))
    im = ax.imshow(s["confusion"], cmap="Blues", norm=matplotlib.colors.LogNorm(vmin=1))
    for i, row in enumerate(s["confusion"]):
        for j, v in enumerate(row):
            if v:
                ax.text(j, i, v, ha="center", va="center", fontsize=6, color="white" if i == j else "black")
    ax.set(xticks=range(10), yticks=range(10), xlabel="predicted", ylabel="true", title="confusion matrix")
    fig.colorbar(im, label="test images (log scale)")
    rep.figure(fig, "lenet_confusion.png", "confusion matrix")


def lenet_activations(rep: Report, complete: list[Path]) -> None:
    from gelu_ext import ACTIVATIONS

    rep.add("### Activations compared", "", "The newest finished run of each activation:", "",
            "| activation | run | test acc | epochs | train s | samples/s |", "|---|---|---|---|---|---|")
    by_act = {}
    for p in sorted(complete, key=lambda p: (p / RECORD).stat().st_mtime):
        summary = load_json(p / RECORD)
        if summary and "config" in summary:
            by_act[summary["config"]["activation"]] = (p, summary)
    for act, (p, r) in sorted(by_act.items()):
        rep.add(f"| {act} | `{p.name}` | {100 * r['test_acc']:.2f}% | {r['epochs']} | {r['train_time_s']:.1f} | "
                f"{r['samples_per_s']:,.0f} |")
    rep.add("")
    missing = [a for a in ACTIVATIONS if a not in by_act]
    if missing:
        rep.note("no run yet for " + ", ".join(missing) + "; produce them with "
                 + ", ".join(f"`make lenet ACT={a}`" for a in missing) + ".")


def section_lenet_bench(rep: Report, runs: Path) -> None:
    table = runs / "bench-lenet" / "table.md"
    if not table.exists():
        rep.note("no LeNet-5 benchmark yet. Produce it with `make bench-lenet`.")
        return
    rep.add(table.read_text(), "")


def section_gelu(rep: Report, runs: Path) -> None:
    check, bench = load_json(runs / "gelu" / "check.json"), load_json(runs / "gelu" / "bench.json")
    if check is None:
        rep.note("no GELU verification yet. Produce it with `make gelu-check`.")
    else:
        rep.add("Largest differences from `torch.nn.functional.gelu` (forward and input gradient), and "
                "`torch.autograd.gradcheck` in float64:", "",
                "| impl | approximate | dtype | max abs err (y) | max abs err (dx) | gradcheck |", "|---|---|---|---|---|---|")
        for r in check["rows"]:
            rep.add(f"| {r['impl']} | {r['approximate']} | {r['dtype']} | {r['forward_max_abs_err']:.2e} | "
                    f"{r['grad_max_abs_err']:.2e} | {'passed' if r['gradcheck_float64'] else 'FAILED'} |")
        rep.add("")
    if bench is None:
        rep.note("no GELU benchmark yet. Produce it with `make bench-gelu`.")
    else:
        rep.add(f"Forward+backward on {bench['numel']:,} elements (median of {bench['repeats']}):", "",
                "| dtype | approximate | impl | ms | vs F.gelu |", "|---|---|---|---|---|")
        for r in bench["rows"]:  # records from before --dtypes timed float32 only
            rep.add(f"| {r.get('dtype', 'float32')} | {r['approximate']} | {r['impl']} | {r['ms']:.2f} | {r['ratio']:.2f}x |")
        rep.add("")


def section_gpt(rep: Report, runs: Path, chosen: Path | None) -> None:
    bench_dir = chosen or newest(list(runs.glob("bench-gpt-*/bench.json")) if runs.is_dir() else [])
    bench_dir = bench_dir.parent if bench_dir and bench_dir.name == "bench.json" else bench_dir
    if bench_dir is None:
        rep.note("no strategy comparison yet. Produce it with `make bench-gpt` (e.g. `make bench-gpt MODEL=tiny "
                 "DEVICES=2 ACCELERATOR=cpu`, or `MODEL=1.6b DEVICES=8` on GPUs).")
        return
    bench = load_json(bench_dir / "bench.json")
    if bench is None:
        rep.note(f"`{bench_dir}/bench.json` is unreadable; re-run `make bench-gpt`.")
        return
    ok = [r for r in bench["rows"] if r["record"]]
    if not ok:
        rep.note(f"every run of `{bench_dir.name}` failed; see its table.md for the errors.")
        return
    first = ok[0]["record"]
    rep.add(f"Sweep `{bench_dir.name}`: model **{first['model']}** ({first['n_params'] / 1e6:,.2f}M parameters) on "
            f"**{first['device_name']}**, the same {bench['args']['num_samples']} samples and global batch for every row.",
            "", (bench_dir / "table.md").read_text(), "")
    rep.figure(strategy_figure(ok), "gpt_strategies.png", "strategy comparison, grouped by precision")


def strategy_figure(rows: list):
    """Four panels of horizontal bars, one row per strategy and one colour per precision, so that labels never
    overlap: throughput, MFU (or TFLOPS where the peak is unknown), the model-state bytes a rank holds against the
    plan's (like with like: process RSS is mostly the libraries), and the speed-up over one device."""
    strategies = list(dict.fromkeys(r["strategy"] for r in rows))
    precisions = list(dict.fromkeys(r["precision"] for r in rows))
    by = {(r["strategy"], r["precision"]): r["record"] for r in rows}
    singles = {p: by[("auto", p)]["tokens_per_s"] for p in precisions if ("auto", p) in by}
    has_mfu = all(r["record"]["mfu"] is not None for r in rows)
    held = lambda r: sum(r.get("held_bytes", {}).values()) / 2**20  # noqa: E731
    # the plan of the same bytes (gradients come and go within a step), wherever they live (offload: the host)
    planned = lambda r: sum(r.get("held_bytes_planned", {}).values()) / 2**20  # noqa: E731
    panels = [("throughput", "tokens/s", lambda r: r["tokens_per_s"]),
              ("model FLOPs utilization" if has_mfu else "achieved TFLOPS per device (MFU: peak unknown)",
               "MFU (%)" if has_mfu else "TFLOPS", (lambda r: 100 * r["mfu"]) if has_mfu else (lambda r: r["tflops_per_device"])),
              ("weights + optimizer states per rank: held (solid) vs planned (hatched)", "MiB", None),
              ("speed-up over one device, same precision", "x one device",
               lambda r: r["tokens_per_s"] / singles[r["precision"]] if r["precision"] in singles else float("nan"))]
    height = 0.8 / len(precisions)
    fig, axes = plt.subplots(2, 2, figsize=(13, 2 + 0.45 * len(strategies) * 2))
    for ax, (title, unit, value) in zip(axes.flat, panels):
        for k, precision in enumerate(precisions):
            ys = [i + (k - (len(precisions) - 1) / 2) * height for i, s in enumerate(strategies) if (s, precision) in by]
            recs = [by[(s, precision)] for s in strategies if (s, precision) in by]
            if value is None:  # held against planned: two thin bars per row
                ax.barh([y - height / 4 for y in ys], [held(r) for r in recs], height / 2, color=f"C{k}", label=precision)
                ax.barh([y + height / 4 for y in ys], [planned(r) for r in recs], height / 2, color="none",
                        edgecolor=f"C{k}", hatch="//")
            else:
                ax.barh(ys, [value(r) for r in recs], height, color=f"C{k}", label=precision)
        ax.set_yticks(range(len(strategies)), strategies)
        ax.invert_yaxis()
        ax.set(title=title, xlabel=unit)
        ax.grid(axis="x", alpha=0.3)
    axes[1, 1].axvline(1, color="gray", lw=0.8)
    axes[0, 0].legend(title="precision", fontsize=8)
    fig.tight_layout()
    return fig


def section_gpu_check(rep: Report, runs: Path) -> None:
    folder = runs / "gpu-check"
    check, skipped = load_json(folder / "gpu-check.json"), load_json(folder / "skipped.json")
    if check is None:
        why = f"skipped by `make lab` on {skipped['date']}: {skipped['reason']}" if skipped else "not run yet"
        rep.note(f"GPU check {why}. On a CUDA machine, `make gpu-check` runs every GPU path with a verdict.")
        return
    rep.add((folder / "table.md").read_text(), "")
    samples = [line.split(",") for line in (folder / "nvml.csv").read_text().splitlines()[1:]] if (folder / "nvml.csv").exists() else []
    if samples:
        fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.5))
        for gpu in sorted({row[1] for row in samples}):
            rows = [row for row in samples if row[1] == gpu]
            t = [float(row[0]) for row in rows]
            a.plot(t, [float(row[2]) for row in rows], lw=0.8, label=f"GPU {gpu}")
            b.plot(t, [float(row[3]) for row in rows], lw=0.8, label=f"GPU {gpu}")
        a.set(xlabel="s", ylabel="%", title="GPU utilization (NVML)")
        b.set(xlabel="s", ylabel="GiB", title="GPU memory used (NVML)")
        a.legend(fontsize=7)
        rep.figure(fig, "gpu_utilization.png", "GPU utilization and memory during the GPU check")
    if (folder / "nvidia-smi.txt").exists():
        rep.add("`nvidia-smi` while the 1.6B model trained:", "", "```", (folder / "nvidia-smi.txt").read_text().rstrip(), "```", "")


def section_environment(rep: Report, runs: Path) -> None:
    records = [p for p in (list(runs.glob("*/*/record.json")) + list(runs.glob("*/record.json"))) if runs.is_dir()]
    env = None
    for path in sorted(records, key=lambda p: p.stat().st_mtime, reverse=True):
        env = (load_json(path) or {}).get("env")
        if env:
            rep.add(f"As recorded by `{path.parent.name}`:", "")
            break
    if env is None:
        from core.run.lifecycle import environment

        env = environment()
        rep.add("No run recorded its environment; this is the machine writing the report:", "")
    rep.add("| | |", "|---|---|", *[f"| {k} | {'none' if v is None else v} |" for k, v in env.items()], "")


def text_runs(runs: Path) -> list[Path]:
    """Finished fabric_gpt.py runs on text: their record names the corpus and tokenizer."""
    return [p.parent for p in runs.glob(f"*/{RECORD}") if "text" in (load_json(p) or {})]


def section_text(rep: Report, runs: Path, chosen: Path | None) -> None:
    run_dir = chosen or newest(text_runs(runs) if runs.is_dir() else [])
    if run_dir is None:
        rep.note("no GPT-2 run on text yet. Produce one with `make lab STAGES=text,gpt-text,report` (nanoGPT's CPU "
                 "recipe, 2000 steps: docs/text.md) or `make gpt DATASET=text`.")
        return
    r = load_json(run_dir / RECORD)
    if r is None or "text" not in r:
        rep.note(f"`{run_dir}/{RECORD}` is unreadable or not a text run; run it again.")
        return
    t = r["text"]
    rep.add(f"Run `{run_dir.name}`: {r['model']} ({r['n_params'] / 1e6:,.2f}M parameters), {r['strategy']} / "
            f"{r['precision']} on {r['world_size']} x {r['device_name']}, {t['tokenizer']} tokenizer ({t['tokenizer_vocab']} "
            f"tokens) on `{Path(t['corpus']).name}` ({t['train_tokens']:,} train and {t['val_tokens']:,} validation tokens).", "",
            "| steps | train loss | validation loss | tokens/s |", "|---:|---:|---:|---:|",
            f"| {r['steps']} | {r['final_loss']:.4f} | {r['val_loss']:.4f} | "
            + (f"{r['tokens_per_s']:,.0f} |" if r["tokens_per_s"] else "not timed |"), "",
            f"Text from its final weights: `make sample RUN={run_dir.name}`.", "")
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(*zip(*r["losses"]), label="train (global batch)", lw=1)
    ax.plot(*zip(*r["val_losses"]), "o-", label=f"validation ({r['config']['eval_batches']} fixed batches)")
    ax.set_xlabel("optimizer step"), ax.set_ylabel("cross-entropy (nats per token)"), ax.legend()
    rep.figure(fig, "gpt_text_curves.png", "GPT-2 on text: training and validation loss")


def build_parser():
    from core.run.flags import Folder, Parser

    parser = Parser(description=__doc__, prog="python -m lab.report")
    parser.add_argument("--runs", default=RUNS, type=Folder(create=False), help="folder holding the runs "
                        "(default: runs; it must exist: run make lenet first)")
    parser.add_argument("--out", default="report", type=Folder(), help="folder for REPORT.md and the figures "
                        "(default: report)")
    parser.add_argument("--lenet", default=None, type=Folder(create=False), help="a LeNet run folder (default: the "
                        "newest finished relu run on the whole training set, else the newest relu run, else the newest)")
    parser.add_argument("--gpt-text", default=None, type=Folder(create=False), help="a GPT-2 run on text (default: "
                        "the newest finished one)")
    parser.add_argument("--gpt-bench", default=None, type=Folder(create=False), help="a bench-gpt-* folder (default: "
                        "the newest)")
    return parser


def main(argv=None) -> Path:
    args = build_parser().parse_args(argv)
    runs = Path(args.runs)
    rep = Report(Path(args.out), runs)
    rep.add("# fabric-lab report", "", f"Written by `make report` on {datetime.now():%Y-%m-%d %H:%M} from `{runs}/`; "
            "every figure below comes from a run on disk.", "")
    if not any(runs.iterdir()):
        rep.note(f"`{runs}/` is empty: nothing has run yet. Start with `make lenet`.")
    rep.section("LeNet-5 on MNIST", section_lenet, runs, Path(args.lenet) if args.lenet else None)
    rep.section("LeNet-5 benchmark", section_lenet_bench, runs)
    rep.section("GELU operator", section_gelu, runs)
    rep.section("GPT-2 on text", section_text, runs, Path(args.gpt_text) if args.gpt_text else None)
    rep.section("GPT-2: strategies compared", section_gpt, runs, Path(args.gpt_bench) if args.gpt_bench else None)
    rep.section("GPU check", section_gpu_check, runs)
    rep.section("Environment", section_environment, runs)
    path = rep.write()
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
