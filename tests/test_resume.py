"""Nothing lost: real processes killed (SIGKILL, SIGINT) and resumed must end exactly where an
uninterrupted run ends; bad checkpoints and non-finite losses end in one clear message."""

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import torch

from conftest import (FEW_TEST_IMAGES, REPO, read_summary, run_in_process, run_script, shared_dir,
                      wait_for_checkpoint)
from core.host import warm_python

# 2 epochs of 47 steps (batch 128); a checkpoint every 8 steps, so a cut lands mid-epoch and the resume crosses an
# epoch boundary; default precision (bf16 autocast) and augmentation.
ARGS = ["--epochs", "2", "--train-samples", "6000", "--batch-size", "128", "--checkpoint-every", "8", "--keep-last", "20",
        "--no-tb-images", "--accelerator", "cpu", *FEW_TEST_IMAGES]


def start(args, env=None) -> subprocess.Popen:
    """One process in a session of its own, signalled as a group (the warm client forwards to its one process)."""
    return subprocess.Popen([warm_python.executable(), "fabric_lenet.py", *map(str, args)], cwd=REPO, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def final_weights(run_dir: Path) -> dict:
    last = sorted(p for p in (run_dir / "checkpoints").glob("step-*") if not p.name.endswith(".partial"))[-1]
    return torch.load(last / "state", map_location="cpu", weights_only=False)["model"]


def assert_same_run(a: Path, b: Path) -> None:
    sa, sb = read_summary(a), read_summary(b)
    assert sa["steps"] == sb["steps"]
    assert sa["test_loss"] == sb["test_loss"] and sa["test_acc"] == sb["test_acc"]  # bit for bit on CPU
    assert [e["train_loss"] for e in sa["epoch_history"]] == [e["train_loss"] for e in sb["epoch_history"]]
    wa, wb = final_weights(a), final_weights(b)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.fixture(scope="module")
def reference(mnist_dir, tmp_path_factory):
    make = lambda out: run_in_process("fabric_lenet.py", *ARGS, "--data-dir", mnist_dir, "--out-dir", out, "--run-name", "ref")
    return shared_dir(tmp_path_factory, "lenet-reference", make) / "ref"


@pytest.mark.slow  # a run in a process of its own
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT, signal.SIGUSR1])
def test_interrupted_run_resumes_exactly(reference, mnist_dir, tmp_path, request, sig):
    """Killed, stopped with Ctrl-C, or (in a SLURM job) asked to requeue: the run resumes to the uninterrupted one.
    The Ctrl-C run reads through a DataLoader worker, which the terminal's signal reaches too: one acknowledgement,
    the rank's, and the loader's batches resume as exactly as the in-memory ones."""
    from test_gpt import slurm_job

    loader = ["--data", "loader", "--num-workers", "1"] if sig == signal.SIGINT else []
    args = [*ARGS, *loader, "--data-dir", mnist_dir, "--out-dir", tmp_path, "--run-name", "cut"]
    # the run's TMPDIR, where a DataLoader worker keeps a folder while it lives; short: the worker binds a socket there,
    # and a Unix socket's path is at most 107 bytes (a folder under tmp_path leaves the loader waiting forever)
    temp = Path(tempfile.mkdtemp(prefix="cut-"))
    request.addfinalizer(lambda: shutil.rmtree(temp, ignore_errors=True))
    proc = start(args, {**(slurm_job(tmp_path) if sig == signal.SIGUSR1 else os.environ), "TMPDIR": str(temp)})
    wait_for_checkpoint(tmp_path / "cut", proc)
    os.killpg(proc.pid, sig)
    output = proc.communicate(timeout=120)[0]
    if sig == signal.SIGUSR1:  # saved, `scontrol requeue 4242` called once, exit 0: a requeue is not a failure
        assert proc.returncode == 0 and "SIGUSR1 received: saved" in output, output
        assert "requeued SLURM job 4242" in output and (tmp_path / "scontrol.log").read_text() == "requeue 4242\n"
    elif sig == signal.SIGINT:  # a clean stop: checkpoint first, then exit 130 and say how to resume
        assert proc.returncode == 128 + signal.SIGINT, output
        assert "SIGINT received: saved" in output and "--resume auto" in output
        assert output.count("SIGINT received: stopping at the next step boundary") == 1, output
        # the worker ended with the epoch it was in, as at an epoch's end (not terminated at the interpreter's exit)
        assert not list(temp.glob("pymp-*")), "the stopped run left its DataLoader worker's folder"
    else:
        assert proc.returncode == -signal.SIGKILL
    assert not (tmp_path / "cut" / "record.json").exists(), "the run must have been cut before its end"
    resumed = run_in_process("fabric_lenet.py", *args, "--resume", "auto")
    assert "resumed from" in resumed.stdout
    assert_same_run(reference, tmp_path / "cut")


def test_a_skipped_checkpoint_is_one_line_naming_the_file_and_the_reason(mnist_dir, tmp_path):
    """A checkpoint whose file unpickles to something weights_only refuses: one warning line, not torch's paragraph."""
    import datetime

    args = ["--train-samples", "1024", *FEW_TEST_IMAGES, "--batch-size", "256", "--epochs", "1",
            "--checkpoint-every", "1", "--max-steps", "2", "--no-tb-images", "--accelerator", "cpu", "--data-dir",
            mnist_dir, "--out-dir", tmp_path, "--run-name", "odd"]
    run_in_process("fabric_lenet.py", *args)
    ckpts = sorted((tmp_path / "odd" / "checkpoints").glob("step-*"))
    torch.save({"model": datetime.datetime.now()}, ckpts[-1] / "state")  # a whole file, of something not a state
    resumed = run_in_process("fabric_lenet.py", *args[:-6], "--max-steps", "3", *args[-6:], "--resume", "auto")
    warnings = [line for line in (resumed.stderr + resumed.stdout).splitlines() if "skipping checkpoint" in line]
    assert warnings == [f"warning: skipping checkpoint {ckpts[-1]}: UnpicklingError: Weights only load failed"], warnings
    assert "Please file an issue" not in resumed.stderr + resumed.stdout and f"resumed from {ckpts[-2]}" in resumed.stdout


def test_corrupt_newest_checkpoint_falls_back_to_previous(reference, mnist_dir, tmp_path):
    args = [*ARGS, "--data-dir", mnist_dir, "--out-dir", tmp_path, "--run-name", "bad", "--max-steps", "40"]
    run_in_process("fabric_lenet.py", *args)
    ckpts = sorted((tmp_path / "bad" / "checkpoints").glob("step-*"))
    newest = ckpts[-1] / "state"
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])  # truncated, as by a full disk
    (tmp_path / "bad" / "checkpoints" / "step-00000999.partial").mkdir()  # a save that never finished
    explicit = run_in_process("fabric_lenet.py", *args, "--resume", ckpts[-1], check=False)
    assert explicit.returncode == 1
    assert f"checkpoint {ckpts[-1]} cannot be loaded" in explicit.stderr.strip().splitlines()[-1]
    resumed = run_in_process("fabric_lenet.py", *args[:-2], "--resume", "auto")
    assert f"skipping checkpoint {ckpts[-1]}" in resumed.stderr + resumed.stdout
    assert f"resumed from {ckpts[-2]}" in resumed.stdout
    assert_same_run(reference, tmp_path / "bad")


def test_resume_with_other_settings_is_refused(mnist_dir, tmp_path):
    args = ["--epochs", "1", "--max-steps", "5", "--no-tb-images", "--data-dir", mnist_dir, "--out-dir", tmp_path,
            "--run-name", "r"]
    run_in_process("fabric_lenet.py", *args)
    proc = run_in_process("fabric_lenet.py", *args, "--resume", "auto", "--activation", "gelu_py", "--batch-size", "64",
                      check=False)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1 and "cannot resume run r" in last
    assert "activation: checkpoint 'relu' vs now 'gelu_py'" in last and "batch_size" in last


def test_a_resume_path_that_is_no_checkpoint_is_refused_before_fabric_with_the_runs_newest(mnist_dir, tmp_path):
    """--resume given the run folder or a file in it (record.json) instead of a checkpoint: one line before any
    process starts, with that run's newest checkpoint as the example (it once named `<out-dir>/<parent>/checkpoints`,
    after Fabric had started)."""
    newest = tmp_path / "r" / "checkpoints" / "step-00000040"
    for folder in (newest.with_name("step-00000020"), newest):  # what the refusal reads of a checkpoint: its files
        (folder / "state").mkdir(parents=True)
        (folder / "config.json").write_text("{}")
    (tmp_path / "r" / "record.json").write_text("{}")
    (tmp_path / "elsewhere").mkdir()  # a folder of no run (a path that does not exist is refused as a bad flag)
    for given in (tmp_path / "r" / "record.json", tmp_path / "r", tmp_path / "elsewhere"):
        proc = run_in_process("fabric_lenet.py", "--precision", "32-true", "--pad-channels", "8", "--data-dir",
                              mnist_dir, "--out-dir", tmp_path, "--resume", given, check=False)
        example = newest if given != tmp_path / "elsewhere" else "<out-dir>/<run>/checkpoints/step-00000100"
        assert proc.returncode == 1 and proc.stderr.strip() == (
            f"error: --resume {given}: no checkpoint there (expected a folder with `state` and `config.json`, such as "
            f"{example}). Fix: pass such a folder or `auto`."), proc.stderr
        assert "device:" not in proc.stdout and sorted(p.name for p in tmp_path.iterdir()) == ["elsewhere", "r"]


def test_checkpoint_from_before_a_setting_existed_is_compared_as_it_ran(mnist_dir, tmp_path):
    """A checkpoint whose config lacks a setting was made by older code: label smoothing did not exist, so it
    trained without it (0.0) and continuing under the new default 0.1 is refused; a setting with no known
    older value is refused as unknown instead of being ignored. --test-samples did not exist either: those runs
    evaluated on all 10,000 images (0), the default, so it is no difference."""
    import json

    args = ["--epochs", "1", "--max-steps", "5", "--no-tb-images", "--data-dir", mnist_dir, "--out-dir", tmp_path,
            "--run-name", "old"]
    run_in_process("fabric_lenet.py", *args)
    config_file = next((tmp_path / "old" / "checkpoints").glob("step-*")) / "config.json"
    config = json.loads(config_file.read_text())
    del config["label_smoothing"], config["weight_decay"], config["test_samples"]
    config_file.write_text(json.dumps(config))
    proc = run_in_process("fabric_lenet.py", *args, "--resume", "auto", "--max-steps", "6", check=False)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1 and "label_smoothing: checkpoint 0.0 vs now 0.1" in last
    assert "weight_decay: checkpoint not recorded (made before the setting existed) vs now 0.0005" in last
    assert "test_samples" not in last
    config["weight_decay"] = 5e-4  # recorded again: only label smoothing is left to its older value
    config_file.write_text(json.dumps(config))
    resumed = run_in_process("fabric_lenet.py", *args, "--resume", "auto", "--max-steps", "6", "--label-smoothing", "0")
    assert "resumed from" in resumed.stdout and read_summary(tmp_path / "old")["steps"] == 6


def test_resume_auto_starts_continues_or_skips_a_finished_run(mnist_dir, tmp_path):
    """--resume auto set once and forgotten: a run with no checkpoint starts (one line says so), one with a
    checkpoint continues, one whose record reached the end trains no more and exits 0; a path that does not exist
    stays an error, and without --resume an existing run is never overwritten."""
    args = ["--train-samples", "1024", *FEW_TEST_IMAGES, "--batch-size", "256", "--epochs", "2", "--no-tb-images",
            "--accelerator", "cpu", "--data-dir", mnist_dir, "--out-dir", tmp_path, "--run-name", "mine"]
    first = run_in_process("fabric_lenet.py", *args, "--max-steps", "3", "--resume", "auto")
    assert f"--resume auto: {tmp_path / 'mine'} has no checkpoint yet: starting the run" in first.stdout
    assert read_summary(tmp_path / "mine")["steps"] == 3
    again = run_in_process("fabric_lenet.py", *args, "--resume", "auto")  # the rest: 8 steps in all
    assert "resumed from" in again.stdout and read_summary(tmp_path / "mine")["steps"] == 8
    record = (tmp_path / "mine" / "record.json").read_text()
    done = run_in_process("fabric_lenet.py", *args, "--resume", "auto")
    assert done.returncode == 0 and "has finished (its record.json holds step 8); nothing to train" in done.stdout
    assert (tmp_path / "mine" / "record.json").read_text() == record and "resumed from" not in done.stdout
    # a runtime flag changed (how the run executes, not what it computes): still the finished run
    done = run_in_process("fabric_lenet.py", *args, "--resume", "auto", "--log-every", "7", "--keep-last", "2")
    assert "has finished" in done.stdout and (tmp_path / "mine" / "record.json").read_text() == record
    refused = run_in_process("fabric_lenet.py", *args, check=False)
    assert refused.returncode == 1 and "a new run does not overwrite it" in refused.stderr
    missing = run_in_process("fabric_lenet.py", *args, "--resume", str(tmp_path / "nope"), check=False)
    assert missing.returncode == 2 and "--resume must be auto or an existing checkpoint folder" in missing.stderr
    nothing = run_in_process("fabric_lenet.py", "--resume", "auto", "--out-dir", tmp_path / "empty", "--max-steps", "1",
                             *args[:-6], "--data-dir", mnist_dir)
    assert "--resume auto: no lenet run with a checkpoint under" in nothing.stdout and "starting a new run" in nothing.stdout


def test_resume_auto_sets_every_damaged_checkpoint_aside_and_starts_over(mnist_dir, tmp_path):
    """A requeued job whose checkpoints are all damaged would fail on every requeue: one line, the checkpoints moved
    to checkpoints/damaged-<time>/ (kept), the run started over to its end. Without --run-name, auto picks the run
    with the newest checkpoint, not the one with the newest folder set aside."""
    args = ["--train-samples", "1024", *FEW_TEST_IMAGES, "--batch-size", "256", "--epochs", "1", "--no-tb-images",
            "--accelerator", "cpu", "--checkpoint-every", "1", "--data-dir", mnist_dir, "--out-dir", tmp_path]
    run_in_process("fabric_lenet.py", *args, "--run-name", "lenet-broken", "--max-steps", "2")
    for ckpt in (tmp_path / "lenet-broken" / "checkpoints").glob("step-*"):
        state = ckpt / "state"
        state.write_bytes(state.read_bytes()[:100])  # truncated, as by a full disk
    (tmp_path / "lenet-broken" / "record.json").unlink()
    started = run_in_process("fabric_lenet.py", *args, "--run-name", "lenet-broken", "--max-steps", "3",
                             "--resume", "auto")
    assert "every checkpoint of" in started.stdout and "the run starts over" in started.stdout, started.stdout
    aside = list((tmp_path / "lenet-broken" / "checkpoints").glob("damaged-*/step-*"))
    assert len(aside) == 2 and read_summary(tmp_path / "lenet-broken")["steps"] == 3 and "resumed from" not in started.stdout
    run_in_process("fabric_lenet.py", *args, "--run-name", "lenet-newer", "--max-steps", "1")
    time.sleep(0.01)
    (tmp_path / "lenet-broken" / "checkpoints" / "abandoned-later").mkdir()  # newer than lenet-newer's checkpoint
    resumed = run_in_process("fabric_lenet.py", *args, "--max-steps", "2", "--resume", "auto")
    assert f"resumed from {tmp_path / 'lenet-newer'}" in resumed.stdout


def test_nonfinite_loss_stops_with_the_step_and_causes(mnist_dir, tmp_path):
    proc = run_in_process("fabric_lenet.py", "--optimizer", "sgd", "--lr", "1e6", "--epochs", "1", "--checkpoint-every", "1",
                      "--no-tb-images", "--data-dir", mnist_dir, "--out-dir", tmp_path, "--run-name", "nan", check=False)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1 and "loss became nan at step" in last and "learning rate" in last
    good = sorted((tmp_path / "nan" / "checkpoints").glob("step-*"))
    assert good and f"the last good checkpoint is {good[-1]}" in last
    assert torch.isfinite(torch.load(good[-1] / "state", weights_only=False)["model"]["features.0.weight"]).all()


@pytest.mark.slow
def test_resumed_on_another_process_count(mnist_dir, tmp_path):
    """LeNet's state is replicated and its global batches do not depend on the world size: a run cut on one
    process continues on two from the same state and takes the same steps. Compared a few steps after the
    resume, where only the order of the gradient reduction differs (one process against two): the end of a
    long float32 trajectory amplifies that order into differences that depend on the CPU (2.6e-3 in test loss
    after 350 steps on an AMD EPYC), which says nothing about the resume. No augmentation: its per-rank draws
    depend on the world size."""
    args = [*ARGS, "--no-augment", "--precision", "32-true", "--data-dir", mnist_dir, "--out-dir", tmp_path]
    run_in_process("fabric_lenet.py", *args, "--run-name", "whole", "--max-steps", "43")
    run_in_process("fabric_lenet.py", *args, "--run-name", "moved", "--max-steps", "40")
    proc = run_script("fabric_lenet.py", *args, "--run-name", "moved", "--resume", "auto", "--devices", "2",
                      "--strategy", "ddp", "--max-steps", "43")
    assert "resumed from" in proc.stdout and "step-00000040" in proc.stdout
    moved, whole = read_summary(tmp_path / "moved"), read_summary(tmp_path / "whole")
    assert moved["steps"] == whole["steps"] == 43 and moved["world_size"] == 2
    # 3 AdamW steps from one state: reduction order moves the weights by ~1e-7 of their size; a wrong batch,
    # learning rate or optimizer state moves them by ~1e-3 (lr 8e-3 per step)
    wm, ww = final_weights(tmp_path / "moved"), final_weights(tmp_path / "whole")
    for key in ww:
        torch.testing.assert_close(wm[key], ww[key], rtol=1e-4, atol=1e-5, msg=key)
    assert moved["test_loss"] == pytest.approx(whole["test_loss"], rel=1e-4)


def test_ctrl_c_twice_during_a_save_ends_the_run_at_once_in_one_line(tmp_path, monkeypatch):
    """Ctrl-C while step 4's checkpoint is written, then Ctrl-C again before it is done: the run ends there, exit 130,
    with one line saying so, no traceback; step 2's checkpoint stays whole, step 4's half-written save stays a
    `.partial` folder, and --resume auto continues from step 2."""
    from core.run import checkpoints

    write = checkpoints.Checkpoints._write

    def interrupted_at_step_4(self, fabric, folder, state):
        if "step-00000004" in str(folder):
            for _ in range(2):  # as a person pressing Ctrl-C twice: each handled as it comes
                os.kill(os.getpid(), signal.SIGINT)
        return write(self, fabric, folder, state)

    args = ["--model", "tiny", "--num-samples", "32", "--micro-batch-size", "4", "--accelerator", "cpu",
            "--checkpoint-every", "2", "--out-dir", tmp_path, "--run-name", "twice"]
    monkeypatch.setattr(checkpoints.Checkpoints, "_write", interrupted_at_step_4)
    proc = run_in_process("fabric_gpt.py", *args, check=False)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 130 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert lines[-1].startswith("SIGINT received again: stopped at once, without a save") and "--resume auto" in lines[-1]
    assert lines[-2].startswith("SIGINT received: stopping at the next step boundary"), lines[-2:]
    folder = tmp_path / "twice" / "checkpoints"
    assert sorted(p.name for p in folder.iterdir()) == ["step-00000002", "step-00000004.partial"]
    monkeypatch.undo()
    resumed = run_in_process("fabric_gpt.py", *args, "--resume", "auto")
    assert f"resumed from {folder / 'step-00000002'}" in resumed.stdout and read_summary(tmp_path / "twice")["steps"] == 8


def test_a_full_disk_is_one_message_and_loses_nothing(tmp_path, monkeypatch):
    """A real disk that another program fills between the save's check of its room and its write (step 4): the
    write itself meets ENOSPC; one line naming the folder, the bytes, the last complete checkpoint and the resume
    command; exit 1; no partial folder; the run resumes from step 2 to its end."""
    from conftest import fill, sized_disk
    from core.run import checkpoints

    room = checkpoints.Checkpoints.room

    def filled_after_the_check(self, fabric):
        answer = room(self, fabric)
        if (self.folder / "step-00000002").exists():
            fill(self.folder.parent.parent, leave=64 * 2**10)
        return answer

    with sized_disk(tmp_path / "disk", 16 * 2**20) as mount:
        args = ["--model", "tiny", "--num-samples", "32", "--micro-batch-size", "4", "--accelerator", "cpu",
                "--checkpoint-every", "2", "--out-dir", mount, "--run-name", "full"]
        monkeypatch.setattr(checkpoints.Checkpoints, "room", filled_after_the_check)
        proc = run_in_process("fabric_gpt.py", *args, check=False)
        message = proc.stderr.strip()
        folder = mount / "full" / "checkpoints"
        assert proc.returncode == 1 and message.count("\n") == 0, message
        assert message.startswith("error: no space left to write the checkpoint of step 4 into " + str(folder))
        assert "MiB and the disk has" in message and "No space left on device" in message
        assert f"{folder / 'step-00000002'}, is intact" in message and "--resume auto --run-name full" in message
        assert sorted(p.name for p in folder.iterdir()) == ["step-00000002"]  # the partial step 4 is gone
        monkeypatch.undo()
        (mount / "filler").unlink()
        resumed = run_in_process("fabric_gpt.py", *args, "--resume", "auto")
        assert "resumed from" in resumed.stdout and read_summary(mount / "full")["steps"] == 8


@pytest.mark.slow
def test_ctrl_c_while_a_rank_still_imports_stops_the_run_at_its_first_step(tmp_path):
    """Ctrl-C reaches the terminal's whole process group, rank 1 included, which Fabric has just started and which is
    still importing torch (a real interpreter: seconds): it was born holding the stop signals (ranks.launch) and takes
    them once it listens, so the run stops as the signal table says, at its first step boundary with a checkpoint and
    exit 130, both ranks acknowledging, instead of rank 1's KeyboardInterrupt traceback and Fabric killing rank 0."""
    import psutil

    args = ["fabric_gpt.py", "--model", "tiny", "--accelerator", "cpu", "--devices", "2", "--strategy", "ddp",
            "--micro-batch-size", "1", "--num-samples", "2000", "--out-dir", tmp_path, "--run-name", "ctrl-c"]
    proc = subprocess.Popen([warm_python.REAL, *map(str, args)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
    def rank_1_started() -> bool:  # by its own environment: a helper rank 0 forks (ldconfig, ...) has rank 0's
        # command line until it execs, and a SIGINT then would reach rank 0 before it listens; a helper may also end
        # between the listing and the reading
        for child in psutil.Process(proc.pid).children():
            with contextlib.suppress(psutil.Error):
                if child.environ().get("LOCAL_RANK") == "1" and "fabric_gpt.py" in " ".join(child.cmdline()):
                    return True
        return False

    deadline = time.time() + 120
    while not rank_1_started():
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGINT)  # as the terminal sends Ctrl-C: to every process of the group
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "Traceback" not in err and "terminating all other processes" not in err, err[-3000:]
    assert err.count("SIGINT received: stopping at the next step boundary with a checkpoint") == 2, err[-3000:]
    assert "SIGINT received: saved" in out and "--resume auto --run-name ctrl-c" in out
    assert sorted(p.name for p in (tmp_path / "ctrl-c" / "checkpoints").iterdir()) == ["step-00000001"]


@pytest.mark.slow
def test_a_killed_rank_stops_the_run_with_one_message(tmp_path):
    """SIGKILL of rank 1 (as the OOM killer sends) mid-run: rank 0 stops within seconds and says which rank died and
    how, with the last complete checkpoint and the resume command, instead of a collective's traceback. (That such a
    checkpoint resumes to the uninterrupted run, bit for bit, is test_multinode.py's node-kill test.)"""
    import psutil

    args = ["fabric_gpt.py", "--model", "tiny", "--accelerator", "cpu", "--devices", "2", "--strategy", "ddp",
            "--micro-batch-size", "1", "--num-samples", "20000", "--checkpoint-every", "2", "--out-dir", tmp_path,
            "--run-name", "killed"]
    proc = subprocess.Popen([warm_python.REAL, *map(str, args)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    checkpoints = tmp_path / "killed" / "checkpoints"
    wait_for_checkpoint(tmp_path / "killed", proc, timeout=120, output=lambda: proc.communicate())
    child = next(c for c in psutil.Process(proc.pid).children() if "fabric_gpt.py" in " ".join(c.cmdline()))
    killed_at = time.time()
    child.send_signal(signal.SIGKILL)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1 and time.time() - killed_at < 15
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and f"rank 1 (pid {child.pid}) was killed by SIGKILL" in lines[0], err[-2000:]
    assert "--resume auto --run-name killed" in lines[0] and "Traceback" not in err
    last = int(lines[0].split("step-")[1][:8])
    assert (checkpoints / f"step-{last:08d}").is_dir() and not (tmp_path / "killed" / "record.json").exists()
