"""report.py: a report built from runs this test makes itself, and notes (never tracebacks) for
missing, half-written and old-format runs."""

import json
import re
import shutil

import matplotlib.image
import pytest

from conftest import run_in_process, run_script

import report


@pytest.fixture(scope="module")
def runs(mnist_dir, tmp_path_factory):
    runs = tmp_path_factory.mktemp("runs")
    run_in_process("fabric_lenet.py", "--epochs", "1", "--train-samples", "12000", "--data-dir", mnist_dir,
               "--out-dir", runs, "--run-name", "lenet-short")
    run_script("-m", "gelu_ext", "check", "--out", runs / "gelu")
    run_script("bench.py", "--out-dir", runs, "gpt", "--model", "tiny", "--devices", "2", "--accelerator", "cpu",
               "--num-samples", "32", "--strategies", "ddp", "--precisions", "32-true")
    return runs


def figures(markdown: str) -> list[str]:
    return re.findall(r"!\[[^\]]*\]\(([^)]+)\)", markdown)


@pytest.mark.slow  # its runs include a 2-process benchmark
def test_report_from_real_runs(runs, tmp_path):
    path = report.main(["--runs", str(runs), "--out", str(tmp_path / "report")])
    text = path.read_text()
    summary = json.loads((runs / "lenet-short" / "record.json").read_text())
    assert f"{100 * summary['test_acc']:.2f}%" in text
    assert "| gelu_py" not in text or "gradcheck" in text
    assert "GELU" in text and "passed" in text  # the verification table
    assert "bench-gpt-tiny-2xcpu" in text and "| ddp | 32-true | 2 |" in text
    refs = figures(text)
    assert {"lenet_curves.png", "lenet_per_class.png", "lenet_confusion.png", "gpt_strategies.png"} <= set(refs)
    for name in refs:
        png = tmp_path / "report" / name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert matplotlib.image.imread(png).shape[0] > 100
    assert "> **Note:**" in text and "make bench-lenet" in text  # the section with no run names its command


def test_missing_runs_folder_gives_notes(tmp_path):
    text = report.main(["--runs", str(tmp_path / "nothing"), "--out", str(tmp_path / "r")]).read_text()
    assert "nothing has run yet" in text and "`make lenet`" in text and "make bench-gpt" in text
    assert "Traceback" not in text


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


def test_benchmark_output_flags_work_before_and_after_the_command():
    """`make bench-lenet ARGS="--out-dir d"` puts the flag after the command; make lab puts it before."""
    import bench

    after = bench.parse_args(["lenet", "--out-dir", "d", "--keep", "--seeds", "2"])
    before = bench.parse_args(["--out-dir", "e", "gpt", "--model", "tiny"])
    assert (after.out_dir, after.keep, after.seeds, after.func) == ("d", True, 2, bench.bench_lenet)
    assert (before.out_dir, before.keep, before.func) == ("e", False, bench.bench_gpt)
    assert bench.parse_args(["gpt"]).out_dir == "runs"
