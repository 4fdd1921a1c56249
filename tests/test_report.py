"""report.py: a report built from runs this test makes itself, and notes (never tracebacks) for
missing, half-written and old-format runs."""

import json
import os
import re
import shutil

import matplotlib.image
import pytest

from conftest import FEW_TEST_IMAGES, run_in_process, run_script, shared_dir
from core.run import hardware
from fabric_lenet import Config
from lab import bench, report


def bench_lenet_in_process(runs, mnist_dir):
    """`bench.py lenet` with every case cut to a few steps, its training runs in this process (the command line
    of each is what the benchmark builds): the tables it writes, not the speed, are under test."""
    def run(script, args, env=None, ranks=1):
        if script.endswith("lenet_reference"):  # the plain loop it races, cut as the cases are
            args = [*args, "--train-samples", "1024", "--data-dir", mnist_dir]
        proc = run_in_process(script, *args, check=False)
        return proc.returncode, bench.last_line(proc.stderr)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(bench, "run", run)
        bench.main(["--out-dir", str(runs), "lenet", "--steps", "3", "--seeds", "2", "--race-epochs", "1", "--",
                    "--max-steps", "3", "--train-samples", "1024", *FEW_TEST_IMAGES,
                    "--data-dir", str(mnist_dir)])


@pytest.fixture(scope="module")
def runs(mnist_dir, tmp_path_factory):
    return shared_dir(tmp_path_factory, "report-runs", lambda runs: make_runs(runs, mnist_dir))


def make_runs(runs, mnist_dir):
    run_in_process("fabric_lenet.py", "--epochs", "1", "--train-samples", "12000", "--data-dir", mnist_dir,
               "--out-dir", runs, "--run-name", "lenet-short")
    run_script("-m", "gelu_ext", "check", "--out", runs / "gelu")
    run_script("-m", "lab.bench", "--out-dir", runs, "gpt", "--model", "tiny", "--devices", "2", "--accelerator", "cpu",
               "--num-samples", "32", "--strategies", "ddp", "--precisions", "32-true")
    bench_lenet_in_process(runs, mnist_dir)


def figures(markdown: str) -> list[str]:
    return re.findall(r"!\[[^\]]*\]\(([^)]+)\)", markdown)


@pytest.mark.slow  # its runs include a 2-process benchmark
def test_report_from_real_runs(runs, tmp_path):
    path = report.main(["--runs", str(runs), "--out", str(tmp_path / "report")])
    text = path.read_text()
    summary = json.loads((runs / "lenet-short" / "record.json").read_text())
    assert f"{100 * summary['test_acc']:.2f}%" in text and "activation **relu**, 1 epoch, batch 512" in text
    check = json.loads((runs / "gelu" / "check.json").read_text())  # the verification table, one row per check
    for r in check["rows"]:
        assert f"| {r['impl']} | {r['approximate']} | {r['dtype']} | {r['forward_max_abs_err']:.2e} |" in text
    assert len(check["rows"]) == 8 and "FAILED" not in text and text.count("| passed |") == 8
    assert "bench-gpt-tiny-2xcpu" in text and "| ddp | 32-true | 2 |" in text
    # like with like: each planned figure beside the measured one of the same quantity; the step predicted from
    # this machine's measurements
    assert "model states held / planned MiB | host RSS / host plan GiB per process" in text
    assert "from device_probe.py's measurements of this machine" in text and "median absolute error" in text
    refs = figures(text)
    assert {"lenet_curves.png", "lenet_per_class.png", "lenet_confusion.png", "gpt_strategies.png"} <= set(refs)
    for name in refs:
        png = tmp_path / "report" / name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert matplotlib.image.imread(png).shape[0] > 100
    assert "| dataloader_b64_w2 | loader | 2 |" in text and "| memory_b64 | memory | - |" in text
    assert "| short | `" + " ".join(bench.SHORT_RECIPE) + "` |" in text
    assert "not reached in every seed" in text  # 3 steps reach no 99.0%


@pytest.mark.slow  # its runs include a 2-process benchmark
def test_the_lenet_benchmark_records_every_case(runs):
    result = json.loads((runs / "bench-lenet" / "bench.json").read_text())
    cases = {"dataloader_b64_w0", "dataloader_b64_w1", "dataloader_b64_w2", "memory_b64", "default_seed0",
             "default_seed1", "short_seed0", "short_seed1"}
    assert set(result["results"]) == cases and result["seeds"] == 2
    assert all(r["samples_per_s"] > 0 for r in result["results"].values())
    short_batch = int(bench.SHORT_RECIPE[bench.SHORT_RECIPE.index("--batch-size") + 1])
    assert result["results"]["short_seed1"]["batch_size"] == short_batch
    assert result["results"]["default_seed0"]["batch_size"] == Config().batch_size
    assert len(result["recipes"]["default"]["acc_all"]) == 2
    # the plain loop raced beside each default seed, in both precisions (issue 77; float32 alone without bf16
    # instructions, where bf16 is emulated): before seed 0's run, after seed 1's
    assert set(result["plain_loop"]) == {"default_seed0", "default_seed1"}
    timed = {"32-true", "bf16-mixed"} if hardware.native_bf16() else {"32-true"}
    for loop in result["plain_loop"].values():
        assert set(loop) == timed and all(p["samples_per_s"] > 0 for p in loop.values())
    written = lambda path: (runs / "bench-lenet" / path).stat().st_mtime_ns  # noqa: E731
    last = "bf16-mixed" if "bf16-mixed" in timed else "32-true"  # the plain loop's last run before seed 0's
    assert written(f"plain-seed0/{last}.json") < written("default_seed0/record.json")
    assert written("plain-seed1/32-true.json") > written("default_seed1/record.json")
    assert "| vs the faster plain |" in (runs / "bench-lenet" / "table.md").read_text()


def test_a_benchmark_keeps_a_finished_case_only_for_the_same_command(tmp_path):
    """make lab's --keep: a sweep continues where it stopped, but a case whose flags changed (a new recipe) runs again."""
    folder, log = tmp_path / "case", tmp_path / "runs.log"
    # A real subprocess, as the benchmarks start one: it appends to a log and writes the run's record.json.
    script = ("import pathlib, sys; d = pathlib.Path(sys.argv[1]); d.mkdir(); (d / 'record.json').write_text('{}'); "
              "open(sys.argv[2], 'a').write(sys.argv[3] + chr(10))")
    first = bench.run_case(folder, True, "-c", [script, folder, log, "a"])
    again = bench.run_case(folder, True, "-c", [script, folder, log, "a"])
    changed = bench.run_case(folder, True, "-c", [script, folder, log, "b"])
    without_keep = bench.run_case(folder, False, "-c", [script, folder, log, "b"])
    assert [first[0], again, changed[0], without_keep[0]] == [0, (0, "kept"), 0, 0]
    assert log.read_text().split() == ["a", "b", "b"]
    (folder / "record.json").unlink()  # a case killed before its end
    assert bench.run_case(folder, True, "-c", [script, folder, log, "b"])[1] != "kept"


def test_empty_runs_folder_gives_notes(tmp_path, monkeypatch):
    """Each note says which command produces what is missing; from a folder other than make's default the command
    names it (RUNS=), so that what it produces lands where this report reads."""
    (tmp_path / "nothing").mkdir()
    text = report.main(["--runs", str(tmp_path / "nothing"), "--out", str(tmp_path / "r")]).read_text()
    runs = f"RUNS={tmp_path / 'nothing'}"
    assert "nothing has run yet" in text and f"`make lenet {runs}`" in text and "`make bench-gpt MODEL=tiny" in text
    assert f"`make bench-lenet {runs}`" in text and f"`make gelu-check {runs}`" in text
    assert "Traceback" not in text and "| None |" not in text and "under runs/" not in text
    assert f"no finished LeNet-5 run under {tmp_path / 'nothing'}/" in text
    commands = re.findall(r"`(make [^`]*)`", text)
    assert len(commands) >= 8 and all(c.endswith(runs) for c in commands), commands
    monkeypatch.chdir(tmp_path / "nothing")
    (tmp_path / "nothing" / "runs").mkdir()
    text = report.main(["--runs", "runs", "--out", str(tmp_path / "r")]).read_text()
    assert "`make lenet`" in text and "RUNS=" not in text


@pytest.mark.slow  # its runs include a 2-process benchmark
def test_half_written_and_old_runs_give_notes(runs, tmp_path):
    broken = tmp_path / "runs"
    shutil.copytree(runs / "lenet-short", broken / "lenet-killed")
    (broken / "lenet-killed" / "record.json").unlink()  # killed before the end
    shutil.copytree(runs / "lenet-short", broken / "lenet-old")
    old = json.loads((broken / "lenet-old" / "record.json").read_text())
    del old["confusion"], old["per_class_acc"]  # as written by an older version of the script
    (broken / "lenet-old" / "record.json").write_text(json.dumps(old))
    bench = broken / "bench-gpt-tiny-2xcpu"
    bench.mkdir()
    (bench / "bench.json").write_text('{"rows": [')  # half-written
    text = report.main(["--runs", str(broken), "--out", str(tmp_path / "r")]).read_text()
    assert "`lenet-killed` has no record.json" in text and "RESUME=auto RUN=lenet-killed" in text
    assert "could not be built (KeyError" in text
    assert "bench.json` is unreadable" in text


def test_the_report_shows_a_run_on_the_whole_training_set_before_a_newer_check(runs, tmp_path):
    """A quick check (--train-samples, --test-samples, --max-steps) made after the lab's LeNet-5 run is not the lab's
    result: the report takes the newest relu run on the whole data set, and the check only where there is no such
    run."""
    folder = tmp_path / "runs"
    shutil.copytree(runs / "lenet-short", folder / "lenet-whole")
    record = json.loads((folder / "lenet-whole" / "record.json").read_text())
    record["config"]["train_samples"] = 0
    (folder / "lenet-whole" / "record.json").write_text(json.dumps(record))
    shutil.copytree(runs / "lenet-short", folder / "lenet-check")
    later = (folder / "lenet-whole" / "record.json").stat().st_mtime + 60
    os.utime(folder / "lenet-check" / "record.json", (later, later))  # the newer of the two
    text = report.main(["--runs", str(folder), "--out", str(tmp_path / "r")]).read_text()
    assert "Run `lenet-whole`" in text and "Run `lenet-check`" not in text
    record["config"]["test_samples"] = 500  # evaluated on a part of the test set: a check too
    (folder / "lenet-whole" / "record.json").write_text(json.dumps(record))
    assert "Run `lenet-check`" in report.main(["--runs", str(folder), "--out", str(tmp_path / "r")]).read_text()
    shutil.rmtree(folder / "lenet-whole")
    assert "Run `lenet-check`" in report.main(["--runs", str(folder), "--out", str(tmp_path / "r")]).read_text()


@pytest.mark.slow  # a 2-process benchmark case, started under torchrun
def test_a_failed_case_of_the_gpt_sweep_shows_what_its_rank_said(tmp_path):
    """bench.py starts a case's ranks side by side under torchrun: a case that fails shows rank 0's own last line in
    the table, not torchrun's report of the failure, which follows it on torchrun's stderr."""
    run_script("-m", "lab.bench", "--out-dir", tmp_path, "gpt", "--model", "tiny", "--devices", "2", "--accelerator", "cpu",
               "--num-samples", "32", "--strategies", "ddp", "--precisions", "32-true", "--", "--tp-size", "2")
    out = tmp_path / "bench-gpt-tiny-2xcpu"
    [row] = json.loads((out / "bench.json").read_text())["rows"]
    assert row["record"] is None and row["error"].startswith("error: --tp-size applies to --strategy tp or fsdp_tp")
    assert "| ddp | 32-true | 2 | failed: error: --tp-size applies" in (out / "table.md").read_text()


def test_benchmark_output_flags_work_before_and_after_the_command():
    """`make bench-lenet ARGS="--out-dir d"` puts the flag after the command; make lab puts it before."""
    from lab import bench

    after = bench.parse_args(["lenet", "--out-dir", "d", "--keep", "--seeds", "2"])
    before = bench.parse_args(["--out-dir", "e", "gpt", "--model", "tiny"])
    assert (after.out_dir, after.keep, after.seeds, after.func) == ("d", True, 2, bench.bench_lenet)
    assert (before.out_dir, before.keep, before.func) == ("e", False, bench.bench_gpt)
    assert bench.parse_args(["gpt"]).out_dir == "runs"
