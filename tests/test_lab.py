"""make lab and make gpu-check on a machine without a GPU: stages run in order, finished ones are skipped,
--force redoes them, a missing dataset stops the first stage, and the GPU check says why it cannot run."""

import ast
import dataclasses
import json
import os
import signal
import subprocess
import time

import pytest

from conftest import REPO, run_in_process
from core.host import warm_python
from fabric_lenet import Config, steps_per_epoch
from lab import gpu_check
from lab import stages as lab


def run_lab(capsys, *args) -> tuple[int, str]:
    """lab.main() in the test process (its stages are subprocesses either way): exit code and what it printed."""
    capsys.readouterr()
    code = lab.main([str(a) for a in args])
    return code, capsys.readouterr().out


def test_without_mnist_the_first_stage_fails_with_the_datasets_message(tmp_path, capsys, monkeypatch):
    empty = tmp_path / "mirror"
    empty.mkdir()
    monkeypatch.setenv("MNIST_MIRROR", str(empty))  # the stages inherit it
    code, out = run_lab(capsys, "--runs", tmp_path / "runs", "--data-dir", tmp_path / "data", "--report-dir",
                        tmp_path / "report")
    lines = out.strip().splitlines()
    assert code == 1, out
    assert "[1/" in lines[-2] and "data" in lines[-2] and "FAILED" in lines[-2] and "MNIST_MIRROR" in lines[-2]
    assert [p.name for p in (tmp_path / "runs" / "lab" / "logs").iterdir()] == ["data.log"]  # nothing else started


def test_without_the_corpus_the_second_stage_fails_and_gpt_text_trains_nanogpts_recipe(mnist_dir, tmp_path, capsys,
                                                                                         monkeypatch):
    """The text corpus is fetched right after MNIST, so an offline lab without TEXT_MIRROR stops in its first seconds,
    not after the LeNet-5 runs; gpt-text then trains nanoGPT's CPU recipe (the one `bench.py text` races) on it."""
    empty = tmp_path / "mirror"
    empty.mkdir()
    monkeypatch.setenv("TEXT_MIRROR", str(empty))
    code, out = run_lab(capsys, "--runs", tmp_path / "runs", "--data-dir", mnist_dir, "--text-dir", tmp_path / "text",
                        "--report-dir", tmp_path / "report")
    failed = out.strip().splitlines()[-2]
    assert code == 1 and "[2/" in failed and "text" in failed and "FAILED" in failed and "TEXT_MIRROR" in failed, out
    assert "data             done earlier" in out  # MNIST was there
    assert [p.name for p in (tmp_path / "runs" / "lab" / "logs").iterdir()] == ["text.log"]  # nothing else started
    import fabric_gpt as gpt
    from lab import bench

    stages = lab.lab_stages(tmp_path / "runs", mnist_dir, "report", str(tmp_path / "text"))
    names = [s.name for s in stages]
    assert names[:2] == ["data", "text"] and names.index("gpt-text") < names.index("bench-gpt")
    stage = stages[names.index("gpt-text")]
    ours, recipe = gpt.parse_args([str(a) for a in stage.args[1:]]), gpt.parse_args(bench.NANOGPT_RECIPE)
    changed = {f.name for f in dataclasses.fields(ours) if getattr(ours, f.name) != getattr(recipe, f.name)}
    assert changed - {"accelerator"} == {"data_dir", "steps", "eval_every", "log_every", "checkpoint_every", "run_name",
                                         "out_dir"}, changed
    assert ours.accelerator == ("cuda" if lab.cuda_devices() else "cpu")  # the recipe's CPU, or the GPU there is
    assert (ours.data_dir, ours.steps, ours.dataset) == (str(tmp_path / "text"), 2000, "text")  # nanoGPT's max_iters
    assert stage.resumable_run == ours.run_name and stage.result == f"{ours.run_name}/record.json"


@pytest.mark.slow  # a run in a process of its own
def test_finished_stages_are_skipped_and_force_redoes_them(mnist_dir, tmp_path, capsys):
    runs, report = tmp_path / "runs", tmp_path / "report"
    args = ["--runs", runs, "--data-dir", mnist_dir, "--report-dir", report, "--stages",
            "data,gelu-check,gpu-check,report"]
    code, first = run_lab(capsys, *args)
    assert code == 0, first
    check = runs / "gelu" / "check.json"
    assert "gelu-check       done in" in first and check.exists()
    assert "gpu-check        skipped: no CUDA GPU" in first
    text = (report / "REPORT.md").read_text()
    assert f"GPU check skipped by `make lab RUNS={runs}`" in text and "no CUDA GPU on this machine" in text
    assert "Largest differences from `torch.nn.functional.gelu`" in text  # the stage's result reached the report
    written = check.stat().st_mtime_ns
    second = run_lab(capsys, *args)[1]
    assert "data             done earlier" in second and "gelu-check       done earlier" in second
    assert "report           done in" in second  # the report always reflects the runs on disk
    table = second[second.index("| stage | | s |"):].splitlines()  # the lab ends with each stage's seconds
    assert table[2:4] == ["| data | done earlier |  |", "| gelu-check | done earlier |  |"], table
    assert table[4] == "| gpu-check | skipped |  |" and table[5].startswith("| report | ran | ") and table[6].startswith("| all | | ")
    assert check.stat().st_mtime_ns == written
    forced = run_lab(capsys, *args[:-1], "gelu-check", "--force")[1]
    assert "gelu-check       done in" in forced and check.stat().st_mtime_ns > written
    assert json.loads(check.read_text())["rows"]


def test_only_a_complete_checkpoint_makes_a_stage_continue(tmp_path):
    """A run killed while writing its first checkpoint leaves only a `.partial` folder: the stage must start
    over, since --resume auto would find nothing to load."""
    stage = lab.Stage("lenet-relu", [], "lab-lenet-relu/record.json", resumable_run="lab-lenet-relu")
    checkpoints = tmp_path / "lab-lenet-relu" / "checkpoints"
    assert not lab.has_checkpoint(tmp_path, stage)
    (checkpoints / "step-00000100.partial").mkdir(parents=True)
    assert not lab.has_checkpoint(tmp_path, stage)
    (checkpoints / "step-00000050").mkdir()
    assert lab.has_checkpoint(tmp_path, stage)
    assert not lab.has_checkpoint(tmp_path, lab.Stage("data", [], "x"))  # not a training stage


def test_unknown_stage_is_refused_with_the_list(capsys):
    with pytest.raises(SystemExit) as exit_:
        lab.main(["--stages", "lenet-swish"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith("error: --stages must be a comma-separated list of data, text, lenet-relu")
    assert "bench-gpt" in err and err.rstrip().endswith("got lenet-swish (see python -m lab --help)")


@pytest.mark.slow  # a real interpreter and torchrun
def test_bench_gpt_in_the_lab_runs_its_ranks_real_under_a_warm_agent(tmp_path):
    """bench-gpt runs real (its table reports each rank's memory) with the lab's client at hand: torchrun's agent,
    which only starts the ranks, is forked from the lab's server; the ranks are real interpreters."""
    script = tmp_path / "rank.py"
    script.write_text("import os, sys, psutil; agent = ' '.join(psutil.Process(os.getppid()).cmdline())\n"
                      "print(os.environ['RANK'], sys.executable, 'warm_python.py' in agent, file=sys.stderr)")
    code = (f"import sys; sys.path.insert(0, {str(REPO)!r}); from lab import bench; from core.host import warm_python; "
            f"print(warm_python.at_hand() is not None, bench.run({str(script)!r}, [], ranks=2))")
    env = {**os.environ, warm_python.SHARED: warm_python.executable()}
    lab_like = subprocess.run([warm_python.REAL, "-c", code], cwd=REPO, env=env, capture_output=True, text=True)
    assert lab_like.stdout == f"True (0, '0 {warm_python.REAL} True')\n", lab_like.stderr
    env[warm_python.SHARED] = warm_python.REAL  # not a client: make bench-gpt on its own starts no server for it
    alone = subprocess.run([warm_python.REAL, "-c", code], cwd=REPO, env=env, capture_output=True, text=True)
    assert alone.stdout == f"False (0, '0 {warm_python.REAL} False')\n", alone.stderr


def test_stages_start_warm_but_those_a_fork_would_change(tmp_path, capsys, monkeypatch):
    """Forked from the warm python: every stage but bench-gpt (its table reports each run's memory, which in a fork
    counts the server's pages) and gpu-check (CUDA); on a machine with GPUs, every stage starts a real interpreter."""
    started = {}  # stage: (the python it started with, the client handed to it)
    monkeypatch.setattr(lab, "run_logged", lambda args, log, python, env:
                        started.update({log.stem: (python, env[warm_python.SHARED])}) or 0)
    code, out = run_lab(capsys, "--runs", tmp_path, "--stages", "lenet-relu,bench-lenet,bench-gpt")
    assert code == 0, out
    warm = warm_python.executable()
    # bench-gpt's probes go to the lab's server
    assert started == {"lenet-relu": (warm, warm), "bench-lenet": (warm, warm), "bench-gpt": (warm_python.REAL, warm)}
    assert warm_python.REAL != warm
    assert not any(s.real for s in lab.lab_stages(tmp_path, "data", "report") if s.name.startswith("lenet-"))
    monkeypatch.setattr(lab, "cuda_devices", lambda: 2)
    assert all(s.real for s in lab.lab_stages(tmp_path, "data", "report"))
    started.clear()  # and no server is handed on when no stage would use it
    assert run_lab(capsys, "--runs", tmp_path / "gpu", "--stages", "lenet-relu")[0] == 0
    assert started == {"lenet-relu": (warm_python.REAL, warm_python.REAL)}


def test_gpu_check_without_cuda_says_so_in_one_line_and_fails(tmp_path, capsys):
    assert gpu_check.main(["--runs", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "no CUDA GPU is visible" in err and not list(tmp_path.iterdir())


@pytest.mark.slow
def test_an_interrupted_lenet_stage_continues_its_run(mnist_dir, tmp_path):
    """A LeNet-5 stage whose run has a checkpoint but no record (stopped part-way) is continued with
    --resume auto, not restarted, as the full default run. Stopped once it has continued: that a resumed run ends
    exactly where the uninterrupted one does is test_resume.py's to prove, and the rest would be 30 s of training."""
    runs = tmp_path / "runs"
    run_in_process("fabric_lenet.py", "--run-name", "lab-lenet-relu", "--out-dir", runs, "--data-dir", mnist_dir,
                   "--max-steps", "10", "--no-tb-images")
    (runs / "lab-lenet-relu" / "record.json").unlink()  # as if stopped after its checkpoint at step 10
    proc = subprocess.Popen([warm_python.executable(), "-m", "lab", "--runs", str(runs), "--data-dir", str(mnist_dir),
                             "--report-dir", str(tmp_path / "report"), "--stages", "lenet-relu"], cwd=REPO,
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    log, deadline = runs / "lab" / "logs" / "lenet-relu.log", time.time() + 120
    while not (log.exists() and "continuing at epoch 1, step 10\n" in log.read_text()):
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[0]
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)
    assert "lenet-relu       started (continuing its run)" in proc.communicate()[0]
    config = ast.literal_eval(next(line for line in log.read_text().splitlines() if line.startswith("config: "))[8:])
    default = dataclasses.asdict(Config())
    changed = {k for k in default if config[k] != default[k]}
    resolved = {"precision", "pad_channels"}  # auto's answers, recorded as what ran
    assert changed <= {"run_name", "out_dir", "data_dir", "resume", *resolved} and config["resume"] == "auto", changed
    assert steps_per_epoch(60_000, Config(), 1) > 10  # the default run had most of its steps still to go


def test_the_lab_says_how_long_it_expects_and_learns_from_its_own_times(tmp_path, monkeypatch):
    """Before its first stage: the stages still to run, from a reference CPU's times (a reference CPU's own, as they
    are; another CPU, those of the reference nearest its measured matmul rate, scaled by the ratio), and, once a lab
    has timed its stages on this CPU, from those times (finished stages count 0)."""
    from core.plan import accounting
    from lab import bench

    stages = lab.lab_stages(tmp_path, str(tmp_path / "data"), "report", str(tmp_path / "text"))
    todo = [s for s in stages if not s.optional]
    by_rate = sorted(lab.REFERENCES.items(), key=lambda kv: kv[1][0])
    (slow, (slow_rate, _)), (fast, (fast_rate, _)) = by_rate[0], by_rate[-1]
    for cpu in (slow, fast):
        monkeypatch.setattr(bench, "cpu_label", lambda: cpu)
        minutes = sum(lab.REFERENCES[cpu][1][s.name] for s in todo) / 60
        same = lab.expected_duration(stages, tmp_path, force=False)
        assert f"about {minutes:.0f} min" in same and "on this CPU model" in same, same
    monkeypatch.setattr(bench, "cpu_label", lambda: "Another CPU, 2 cores (AVX2)")
    for rate, cpu in ((slow_rate / 2, slow), (fast_rate * 2, fast)):  # the nearest reference, scaled
        monkeypatch.setattr(accounting, "cpu_matmul_peak", lambda precision: (rate, "float32 matmul"))
        minutes = sum(lab.REFERENCES[cpu][1][s.name] for s in todo) / 60 * lab.REFERENCES[cpu][0] / rate
        guess = lab.expected_duration(stages, tmp_path, force=False)
        assert f"{len(todo)} stage(s) to run" in guess and f"about {minutes:.0f} min" in guess, guess
        assert f"on an {cpu}," in guess and f"({rate / lab.REFERENCES[cpu][0]:.2f}x)" in guess, guess
    for s in todo:
        lab.record_timing(tmp_path, s.name, 60.0, resumed=False)
    lab.record_timing(tmp_path, "lenet-relu", 1.0, resumed=True)  # a continued run's remainder is not its time
    assert lab.read_json(tmp_path / lab.TIMINGS)["seconds"]["lenet-relu"] == 60.0
    (tmp_path / "lab-lenet-relu").mkdir()
    (tmp_path / "lab-lenet-relu" / "record.json").write_text("{}")  # finished: nothing left to time
    timed = lab.expected_duration(stages, tmp_path, force=False)
    assert f"{len(todo) - 1} stage(s) to run" in timed and f"about {len(todo) - 1} min" in timed
    assert "as the stages took here before" in timed
    report_only = lab.expected_duration([s for s in stages if s.name == "report"], tmp_path, force=True)
    assert "1 stage(s) to run, expected to take about 60 s" in report_only, report_only  # not "about 1 min" or 0


def test_bench_lenet_takes_a_finished_default_run_as_its_seed_0_only_when_it_is_one(tmp_path):
    """The lab's lenet-relu run is the bench's default_seed0 (the same training); another recipe, an unfinished run
    or another device is trained again."""
    from lab import bench

    cfg = Config()
    whole = cfg.epochs * steps_per_epoch(60_000, cfg, 1)
    # as a run records it: --precision auto resolved to what it chose on this CPU
    config = {"kind": "lenet", **dataclasses.asdict(cfg), "precision": "32-true"}
    record = {"kind": "lenet", "device": "cpu", "steps": whole, "config": config}
    (tmp_path / "record.json").write_text(json.dumps(record))
    assert bench.default_recipe_run(str(tmp_path))
    for changed in ({"steps": whole - 1}, {"device": "cuda:0"}, {"config": {**record["config"], "lr": 1e-3}},
                    {"config": {**record["config"], "seed": 1}}):
        (tmp_path / "record.json").write_text(json.dumps({**record, **changed}))
        assert not bench.default_recipe_run(str(tmp_path)), changed
    assert not bench.default_recipe_run("") and not bench.default_recipe_run(str(tmp_path / "none"))
