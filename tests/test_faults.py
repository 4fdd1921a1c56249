"""Faults for real: a full disk is a real, size-limited file system (a tmpfs) filled at the checkpoint, record.json,
the prepared data, the Hugging Face export and the NVMe folder (at any moment of a run, under every strategy:
test_full_disk.py); the disk planned before a run as its memory is, GPT-2's and LeNet-5's; and one run per folder."""

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

import fabric_gpt as gpt
from conftest import (EXACT, REPO, TWO_PROCESS, fill, losses, read_summary, record, run_in_process, run_script,
                      sized_disk, wait_for_checkpoint)
from core.plan import disk
from core.host import warm_python
from core.run.checkpoints import room_needed

TINY = ["--model", "tiny", "--num-samples", "32", "--micro-batch-size", "4", "--accelerator", "cpu",
        "--precision", "32-true"]


def planned_checkpoint(args: list) -> float:
    """The disk plan's bytes of one checkpoint of the run these flags start."""
    cfg = gpt.parse_args([str(a) for a in args])
    return disk.checkpoint_bytes(cfg, gpt.count_parameters(cfg)[0])


def one_error(proc) -> str:
    """The one line a run that met a fault ends with, whatever its ranks printed before."""
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("error:")]
    assert proc.returncode == 1 and len(lines) == 1, (proc.returncode, proc.stdout[-3000:], proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return lines[0]


def run(*args, **kw):
    if "--devices" in map(str, args):
        return run_script("fabric_gpt.py", *args, **kw)
    return run_in_process("fabric_gpt.py", *args, check=kw.get("check", True))


# ----------------------------------------------------------------------------- a full disk at a checkpoint
@pytest.mark.slow
@pytest.mark.parametrize("name", ["auto", "ddp"])  # ZeRO-2/3, fsdp: at a save and other moments, test_full_disk.py
def test_a_full_disk_at_a_checkpoint_is_one_message_and_the_run_resumes_to_its_end(single, two_process, name, tmp_path):
    """A disk that holds one checkpoint and not two (the plan warns of it): the second save stops every rank with one
    message (what, the bytes needed and free, the last complete checkpoint, the resume command) before a byte is
    written, the first checkpoint intact; moved to a roomier disk the run resumes and ends at the uninterrupted
    run's losses."""
    (ref_out, ref), flags = (single, ["--micro-batch-size", "4"]) if name == "auto" else \
        (two_process(name), ["--strategy", name, "--devices", "2", *TWO_PROCESS[name]])
    args = [*EXACT, *flags, "--checkpoint-every", "2", "--run-name", "cut"]
    planned = planned_checkpoint(args)
    with sized_disk(tmp_path / "disk", room_needed(planned) + disk.RUN_FILES + 0.3 * planned + 2**16) as mount:
        proc = run(*args, "--out-dir", mount, check=False, timeout=300)
        message, said = one_error(proc), proc.stdout + proc.stderr
        assert said.count("warning: ") == 1 and "holds 1 checkpoint(s)" in said and "only the first fits" in said, said
        folder = mount / "cut" / "checkpoints"
        assert message.startswith(f"error: no space left to write the checkpoint of step 4 into {folder}: it needs about")
        assert "MiB free" in message and f"{folder / 'step-00000002'}, is intact" in message, message
        assert "--resume auto --run-name cut" in message, message
        assert sorted(p.name for p in folder.iterdir()) == ["step-00000002"]  # nothing of step 4 left
        shutil.copytree(mount / "cut", tmp_path / "roomy" / "cut")
    resumed = run(*args, "--out-dir", tmp_path / "roomy", "--resume", "auto", timeout=300)
    assert "resumed from" in resumed.stdout + resumed.stderr
    assert losses(tmp_path / "roomy", "cut") == pytest.approx(losses(ref_out, ref), rel=1e-5)


def test_a_lenet_run_without_room_for_its_first_checkpoint_and_epoch_is_refused_before_its_first_step(mnist_dir,
                                                                                                      tmp_path):
    """LeNet-5 plans its disk as GPT-2 does: on 256 KiB it trained its whole first epoch (118 steps) before its first
    checkpoint (0.7 MiB) failed; now one line, before Fabric starts, with the bytes its checkpoint and the first
    epoch's TensorBoard figures need."""
    with sized_disk(tmp_path / "disk", 256 * 2**10) as mount:
        proc = run_in_process("fabric_lenet.py", "--precision", "32-true", "--accelerator", "cpu", "--data-dir",
                              mnist_dir, "--out-dir", mount, "--run-name", "l", check=False)
        message = one_error(proc)
        assert f"the disk of {mount / 'l'} has 0.2 MiB free and this run's first checkpoint needs 1.4 MiB" in message
        assert "TensorBoard's figures of its first epoch" in message and "--out-dir" in message, message
        assert "device:" not in proc.stdout and not (mount / "l").exists()


def test_a_disk_without_room_for_the_first_checkpoint_is_refused_before_the_model_is_built(tmp_path):
    """Named by the run's folder, or by --out-dir before a run without --run-name is named (it once showed
    `<out-dir>/run`, a folder no run would write, in the refusal, the start-up line and the record)."""
    with sized_disk(tmp_path / "disk", 300 * 2**10) as mount:
        proc = run_in_process("fabric_gpt.py", *TINY, "--out-dir", mount, "--run-name", "r", check=False)
        message = one_error(proc)
        assert f"the disk of {mount / 'r'} has" in message and "first checkpoint needs" in message, message
        assert "--out-dir" in message and "parameters" not in proc.stdout  # nothing was built
        assert not (mount / "r").exists()
        unnamed = one_error(run_in_process("fabric_gpt.py", *TINY, "--out-dir", mount, check=False))
        assert f"the disk of {mount} has" in unnamed, unnamed
    proc = run_in_process("fabric_gpt.py", *TINY, "--steps", "1", "--no-save-at-end", "--out-dir", tmp_path / "roomy")
    (folder,) = (tmp_path / "roomy").iterdir()
    assert json.loads((folder / "record.json").read_text())["disk_planned"]["run_folder"] == str(folder)
    assert f"    {folder}: the first checkpoint needs" in proc.stdout, proc.stdout


@pytest.mark.slow
def test_a_disk_without_room_for_the_nvme_folder_is_refused_before_the_model_is_built(tmp_path):
    """ZeRO-Infinity's swap folder is planned (the `small` model's: 16 bytes a parameter and the weights) and a
    disk without room for it refused, naming the folder and what it needs, before any rank builds the model."""
    with sized_disk(tmp_path / "nvme", 64 * 2**20) as nvme:
        args = ["--model", "small", "--seq-len", "64", "--micro-batch-size", "1", "--num-samples", "4",
                "--accelerator", "cpu", "--strategy", "deepspeed_stage_3_offload", "--nvme-path", nvme, "--devices", "2"]
        started = time.time()
        message = one_error(run_script("fabric_gpt.py", *args, "--out-dir", tmp_path, "--run-name", "r", check=False))
        assert f"the disk of {nvme} has" in message and "NVMe folder's" in message, message
        assert not list(nvme.iterdir()) and time.time() - started < 60


def test_a_full_disk_at_record_json_keeps_the_trained_run_and_resuming_writes_the_record(tmp_path, monkeypatch):
    """The disk fills (another program) after the last checkpoint: record.json cannot be written, one message says
    so with the bytes, the intact checkpoint and the command; that command, with room again, writes the record."""
    from core.run import lifecycle

    save = lifecycle.Run.save

    def save_then_fill(self, step):
        done = save(self, step)
        if step == 8:
            fill(self.dir.parent)
        return done

    args = [*TINY, "--checkpoint-every", "4", "--run-name", "rec"]
    with sized_disk(tmp_path / "disk", 8 * 2**20) as mount:
        monkeypatch.setattr(lifecycle.Run, "save", save_then_fill)
        message = one_error(run_in_process("fabric_gpt.py", *args, "--out-dir", mount, check=False))
        monkeypatch.undo()
        assert message.startswith(f"error: no space left to write {mount / 'rec' / 'record.json'}: it needs ")
        assert "step-00000008, is intact" in message and "--resume auto --run-name rec" in message, message
        (mount / "filler").unlink()
        run_in_process("fabric_gpt.py", *args, "--out-dir", mount, "--resume", "auto")
        assert read_summary(mount / "rec")["steps"] == 8


def test_a_full_disk_at_the_prepared_data_stops_before_training_and_keeps_nothing_half_written(tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("to be or not to be, that is the question. " * 40_000)  # 1.7 MB: 1.7 MB of char tokens
    with sized_disk(tmp_path / "data", 1 * 2**20) as data:
        message = one_error(run_in_process("fabric_gpt.py", *TINY, "--text", text, "--data-dir", data,
                                           "--out-dir", tmp_path, "--run-name", "t", check=False))
        assert message.startswith(f"error: no space left to write the prepared token files of {text}"), message
        assert "MiB needed" in message and "--data-dir" in message, message
        assert [p.name for p in (data / "prepared").iterdir() if not p.name.endswith(".lock")] == []


def test_a_full_disk_at_the_export_keeps_the_checkpoint_and_names_the_command(tmp_path, monkeypatch):
    """--export at a run's end, the disk filled (another program) after the last checkpoint: one message, no partial
    folder, the checkpoint intact; `make export`'s command then writes it where there is room."""
    write = gpt.hf_export.write_hf_folder
    monkeypatch.setattr(gpt.hf_export, "write_hf_folder", lambda sd, cfg, folder, *a: (fill(folder.parent.parent),
                                                                                      write(sd, cfg, folder, *a))[1])
    args = [*TINY, "--export", "--run-name", "ex"]
    with sized_disk(tmp_path / "disk", 8 * 2**20) as mount:
        message = one_error(run_in_process("fabric_gpt.py", *args, "--out-dir", mount, check=False))
        monkeypatch.undo()
        assert message.startswith(f"error: no space left to write the Hugging Face folder {mount / 'ex' / 'hf'}"), message
        assert "step-00000008 is intact" in message and "make export RUN=ex" in message, message
        assert not (mount / "ex" / "hf.partial").exists() and not (mount / "ex" / "hf").exists()
        shutil.copytree(mount / "ex", tmp_path / "roomy" / "ex")
    run_script("-m", "core.gpt.hf_export", tmp_path / "roomy" / "ex")
    assert (tmp_path / "roomy" / "ex" / "hf" / "model.safetensors").is_file()


# ----------------------------------------------------------------------------- the disk planned
def checkpoint_sizes(run_dir: Path) -> list[int]:
    return [sum(f.stat().st_size for f in c.rglob("*") if f.is_file())
            for c in sorted((run_dir / "checkpoints").glob("step-*")) if not c.name.endswith(".partial")]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(TWO_PROCESS))
def test_the_disk_plan_is_each_strategys_checkpoint_within_ten_percent(two_process, name):
    out, run_name = two_process(name)
    planned, sizes = record(out, run_name)["disk_planned"]["checkpoint"], checkpoint_sizes(out / run_name)
    assert sizes and all(abs(planned / size - 1) < 0.1 for size in sizes), (planned, sizes)


def test_the_disk_plan_of_one_process_and_of_bf16_within_ten_percent(tmp_path):
    for precision in ("32-true", "bf16-true"):
        run_in_process("fabric_gpt.py", *TINY, "--precision", precision, "--checkpoint-every", "4", "--optimizer",
                       "adamw", "--out-dir", tmp_path, "--run-name", precision)
        planned = record(tmp_path, precision)["disk_planned"]["checkpoint"]
        assert all(abs(planned / size - 1) < 0.1 for size in checkpoint_sizes(tmp_path / precision)), precision


def test_plan_shows_the_disk_of_a_cluster(tmp_path):
    """--plan for GPUs we do not have: each checkpoint (the 1.6B model's fp32 master and moments) and the NVMe folder."""
    out = tmp_path / "plan.json"
    proc = run_in_process("fabric_gpt.py", "--model", "1.6b", "--precision", "bf16-mixed", "--cluster", "h100-sxm",
                          "--strategy", "deepspeed_stage_3_offload", "--nvme-path", tmp_path, "--devices", "2",
                          "--plan", "--plan-json", out)
    assert "disk: each checkpoint" in proc.stdout and "NVMe folder" in proc.stdout, proc.stdout
    plan = json.loads(out.read_text())["disk"]
    assert 1.7e10 < plan["checkpoint"] < 2.1e10 and 2.5e10 < plan["nvme"] < 3.2e10  # 12 and 18 bytes a parameter


# ----------------------------------------------------------------------------- one run per folder
LONG = [*TINY, "--num-samples", "4000", "--checkpoint-every", "10", "--log-every", "50"]


def start(out: Path, *args) -> subprocess.Popen:
    return subprocess.Popen([warm_python.executable(), "fabric_gpt.py", *map(str, [*LONG, "--out-dir", out, *args])],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.slow
def test_a_run_holds_its_folder_against_a_second_run_and_a_resume_and_a_killed_one_leaves_no_lock(tmp_path):
    first = start(tmp_path, "--run-name", "held")
    try:
        wait_for_checkpoint(tmp_path / "held", first, output=lambda: first.stdout.read())
        holder = (tmp_path / "held" / ".run.lock").read_text()
        assert holder.startswith("process ") and "fabric_gpt.py" in holder
        for extra in ([], ["--resume", "auto"], ["--strategy", "ddp", "--devices", "2", "--resume", "auto"]):
            proc = run_script("fabric_gpt.py", *LONG, "--out-dir", tmp_path, "--run-name", "held", *extra, check=False)
            message = one_error(proc)
            assert message.startswith(f"error: run folder {tmp_path / 'held'} is in use by {holder}"), (extra, message)
        assert first.poll() is None  # the holder trains on, untouched
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    again = run_script("fabric_gpt.py", *LONG, "--out-dir", tmp_path, "--run-name", "held", "--resume", "auto",
                       "--steps", "30")
    assert "resumed from" in again.stdout  # the killed run's lock died with it


@pytest.mark.slow
def test_two_runs_started_together_with_one_name_train_one_of_them(tmp_path):
    """Both pass the check that refuses an existing folder; the lock lets one write: one TensorBoard file, one record."""
    args = ["--run-name", "same", "--num-samples", "64"]
    procs = [start(tmp_path, *args), start(tmp_path, *args)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    codes = sorted(p.returncode for p in procs)
    assert codes == [0, 1], outs
    refused = outs[[p.returncode for p in procs].index(1)]
    assert "is in use by process" in refused or "exists; a new run does not overwrite it" in refused, refused
    assert len(list((tmp_path / "same").glob("events.out.tfevents.*"))) == 1
    assert read_summary(tmp_path / "same")["steps"] == 16
    os.sync()


def test_a_run_that_ended_between_the_look_and_the_lock_is_not_overwritten(tmp_path, monkeypatch):
    """Two runs started together with one name: both look (no folder yet), then the first trains and ends, releasing
    its folder's lock, before the second takes it (the second waited, as for a machine measurement another process
    was taking). The second refuses the folder it now finds written, and leaves the first run's files as they were."""
    folder = tmp_path / "same"
    look = gpt.find_run

    def look_then_the_other_run_ends(*args, **kwargs):
        found = look(*args, **kwargs)
        folder.mkdir()
        (folder / "record.json").write_text('{"kind": "gpt", "steps": 16}')  # what the other run left
        return found

    monkeypatch.setattr(gpt, "find_run", look_then_the_other_run_ends)
    proc = run_in_process("fabric_gpt.py", *TINY, "--out-dir", tmp_path, "--run-name", "same", check=False)
    assert proc.returncode == 1 and "exists; a new run does not overwrite it" in proc.stdout + proc.stderr
    assert sorted(p.name for p in folder.iterdir()) == [".run.lock", "record.json"]  # the lock file, as every run's
    assert json.loads((folder / "record.json").read_text()) == {"kind": "gpt", "steps": 16}
