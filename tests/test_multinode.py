"""Several machines, on one host: two torchrun launchers of one process each (as on two nodes) sharing one output
folder, SLURM's variables, a node that never comes and a node that dies. (The GPT strategies on two torchrun nodes,
and the SLURM batch script, are in test_gpt.py, beside the one-node runs they are compared with.)"""

import json
import os
import re
import threading
import time

import pytest
from test_resume import assert_same_run

from conftest import (FEW_TEST_IMAGES, free_port, mirror_dir, read_summary, run_nodes, run_script, start_node,
                      start_nodes, wait_for_checkpoint)
from core.host import warm_python
from core.run import ranks

LENET = ["--epochs", "1", "--train-samples", "10000", "--batch-size", "128", "--checkpoint-every", "30", "--keep-last", "20",
         "--no-tb-images", "--accelerator", "cpu", "--strategy", "ddp", *FEW_TEST_IMAGES]


@pytest.mark.slow
def test_a_node_killed_mid_run_stops_the_other_and_both_resume_to_the_uninterrupted_run(mnist_dir, tmp_path):
    """Two nodes download MNIST into one empty shared folder (once: rank 0 first, the others then find it valid),
    train, and node 1's process is SIGKILLed after a checkpoint. The survivor stops within seconds naming the lost
    rank; both launchers exit non-zero; started again on both nodes, the run resumes from the last complete
    checkpoint and ends bit for bit where the same run on 2 processes of one machine ends."""
    mirror = mirror_dir()
    run_script("fabric_lenet.py", *LENET, "--devices", "2", "--data-dir", mnist_dir, "--out-dir", tmp_path,
               "--run-name", "whole")
    args = [*LENET, "--data-dir", tmp_path / "shared-data", "--mirror", mirror, "--out-dir", tmp_path, "--run-name", "cut"]
    nodes = start_nodes("fabric_lenet.py", *args, logs=tmp_path / "logs")
    logs = [tmp_path / "logs" / f"node{n}.log" for n in range(2)]
    wait_for_checkpoint(tmp_path / "cut", *nodes, output=lambda: logs[0].read_text()[-3000:])
    rank, pid = map(int, re.search(r"^rank (\d)/2: node 1, .*pid (\d+)", logs[1].read_text(), re.M).groups())
    killed_at = time.time()
    os.kill(pid, 9)
    codes = [p.wait(timeout=60) for p in nodes]
    assert all(codes) and time.time() - killed_at < 20, codes
    survivor = logs[0].read_text()
    errors = [line for line in survivor.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(f"error: rank {rank} (node 1) stopped"), survivor[-3000:]
    assert "--resume auto --run-name cut" in errors[0]
    both = survivor + logs[1].read_text()
    assert both.count("downloaded ") == 4  # each of the four files once, by rank 0, into the shared folder
    assert not (tmp_path / "cut" / "record.json").exists()

    resumed = run_nodes("fabric_lenet.py", *args, "--resume", "auto", logs=tmp_path / "logs-resume")
    assert "resumed from" in resumed[0] + resumed[1]
    assert_same_run(tmp_path / "whole", tmp_path / "cut")
    assert read_summary(tmp_path / "cut")["env"]["launcher"] == "torchrun"


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["by hand", "SLURM"])
def test_a_node_that_never_comes_ends_the_wait_with_one_message(mnist_dir, tmp_path, launcher):
    """Node 0 started by hand (MASTER_ADDR, NODE_RANK) or task 1 of a 2-node SLURM job, alone: within
    --node-timeout seconds one line names the address, the launcher and the fix (not 30 minutes of silence)."""
    port = free_port()
    env = ({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "NODE_RANK": "0"} if launcher == "by hand" else
           {"SLURM_NTASKS": "2", "SLURM_NNODES": "2", "SLURM_NTASKS_PER_NODE": "1", "SLURM_PROCID": "1",
            "SLURM_LOCALID": "0", "SLURM_NODEID": "1", "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "lenet",
            "SLURM_NODELIST": "localhost", "MASTER_PORT": str(port)})
    started = time.time()
    proc = run_script("fabric_lenet.py", "--num-nodes", "2", "--devices", "1", "--accelerator", "cpu",
                      "--precision", "32-true", "--node-timeout", "1", "--data-dir", mnist_dir, "--out-dir", tmp_path,
                      check=False, env=env, timeout=120)
    assert proc.returncode == 1 and time.time() - started < 60
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: waited 1 s at "), proc.stderr[-2000:]
    assert f":{port} for the 2 processes of this run on 2 node(s)" in errors[0]
    assert ("launcher: by hand" if launcher == "by hand" else "launcher: SLURM (srun)") in errors[0]
    assert "--node-timeout" in errors[0] and not list(tmp_path.glob("lenet-*"))


@pytest.mark.slow
def test_torchrun_with_a_node_missing_gives_up_after_its_join_timeout(tmp_path):
    """Under torchrun the nodes meet in the launchers, before any process of ours starts: the wait is torchrun's
    (--rdzv-conf join_timeout, 600 s by default; the README's commands set it), and it ends in its own error."""
    started, log = time.time(), tmp_path / "node0.log"
    node = start_node(0, free_port(), "fabric_lenet.py", "--out-dir", tmp_path / "runs", log=log, join_timeout=2)
    assert node.wait(timeout=120) != 0 and time.time() - started < 60
    assert "RendezvousTimeoutError" in log.read_text() and not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_a_node_that_goes_silent_is_named_after_node_timeout(mnist_dir, tmp_path):
    """A machine that stops answering without closing its connections (SIGSTOP here; a hung kernel, a cut
    network) leaves the other ranks waiting in a collective for the process group's 30 minutes: the heartbeat in
    the rendezvous store names it after --node-timeout seconds, and the rank stops."""
    args = [*LENET, "--train-samples", "60000", "--checkpoint-every", "0", "--data-dir", mnist_dir, "--out-dir", tmp_path,
            "--run-name", "silent", "--node-timeout", "3"]  # no checkpoint mid-epoch: a rank saving gets 10x longer
    nodes = start_nodes("fabric_lenet.py", *args, logs=tmp_path / "logs")
    logs, pid = [tmp_path / "logs" / f"node{n}.log" for n in range(2)], None
    try:
        deadline = time.time() + 300
        while "device: cpu x 2" not in logs[0].read_text():
            assert time.time() < deadline and all(p.poll() is None for p in nodes), logs[0].read_text()[-3000:]
            time.sleep(0.05)
        time.sleep(2)  # training, mid-epoch
        rank, pid = map(int, re.search(r"^rank (\d)/2: node 1, .*pid (\d+)", logs[1].read_text(), re.M).groups())
        stopped_at = time.time()
        os.kill(pid, 19)  # SIGSTOP: alive, connections open, silent
        assert nodes[0].wait(timeout=60) != 0 and time.time() - stopped_at < 3 + 20
        errors = [line for line in logs[0].read_text().splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and f"rank {rank} (node 1) stopped answering for 3 s" in errors[0], errors
        assert "no checkpoint was complete: start the run again" in errors[0]
    finally:
        for p in nodes:
            p.kill()
        if pid:
            os.kill(pid, 9)  # a stopped process takes SIGKILL


# ----------------------------------------------------------------------------- what launched a process: one rule
LAUNCH_VARS = ("TORCHELASTIC_RUN_ID", "SLURM_NTASKS", "SLURM_JOB_NAME", "SLURM_JOB_ID", "MASTER_ADDR", "MASTER_PORT",
               "NODE_RANK", "LOCAL_RANK", ranks.STARTED_BY)


@pytest.mark.parametrize("env,started_by,several_nodes_allowed,fabric_child", [
    ({}, ranks.FABRIC, False, False),  # a plain start: Fabric starts any other local ranks
    # rank 0 after fabric.launch(): Fabric set MASTER_ADDR/NODE_RANK here, and launch() recorded the verdict first
    ({"MASTER_ADDR": "127.0.0.1", "NODE_RANK": "0", "LOCAL_RANK": "0", ranks.STARTED_BY: ranks.FABRIC}, ranks.FABRIC,
     False, False),
    ({"MASTER_ADDR": "127.0.0.1", "NODE_RANK": "0", "LOCAL_RANK": "1", ranks.STARTED_BY: ranks.FABRIC}, ranks.FABRIC,
     False, True),  # a rank Fabric started: it watches rank 0
    ({"TORCHELASTIC_RUN_ID": "r", "LOCAL_RANK": "1", "MASTER_ADDR": "n0"}, ranks.TORCHRUN, True, False),
    ({"SLURM_NTASKS": "4", "SLURM_JOB_NAME": "train", "SLURM_JOB_ID": "7", "LOCAL_RANK": "1"}, ranks.SRUN, True, False),
    # an interactive SLURM shell (salloc, srun --pty bash) is not a launcher: nothing there starts the other nodes
    ({"SLURM_NTASKS": "4", "SLURM_JOB_NAME": "bash", "SLURM_JOB_ID": "7"}, ranks.FABRIC, False, False),
    ({"SLURM_NTASKS": "4", "SLURM_JOB_NAME": "interactive", "SLURM_JOB_ID": "7", "LOCAL_RANK": "1",
      ranks.STARTED_BY: ranks.FABRIC}, ranks.FABRIC, False, True),
    ({"SLURM_NTASKS": "4", "SLURM_JOB_NAME": "bash", "MASTER_ADDR": "n0", "NODE_RANK": "1"}, ranks.BY_HAND, True, False),
    ({"MASTER_ADDR": "n0", "MASTER_PORT": "29500", "NODE_RANK": "1"}, ranks.BY_HAND, True, False),
    ({"MASTER_ADDR": "n0", "NODE_RANK": "1", "LOCAL_RANK": "1", ranks.STARTED_BY: ranks.BY_HAND}, ranks.BY_HAND, True, True),
])
def test_one_rule_says_what_launched_a_process(monkeypatch, env, started_by, several_nodes_allowed, fabric_child):
    """The launcher rule that messages, records, the --num-nodes refusal and the rank watch all use."""
    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert ranks.launcher() == started_by and ranks.started_by_fabric() == fabric_child
    if several_nodes_allowed:
        ranks.check_launcher(2, 1, "fabric_gpt.py")
    else:
        with pytest.raises(ranks.ConfigError, match="--num-nodes 2: no launcher started this process"):
            ranks.check_launcher(2, 1, "fabric_gpt.py")


@pytest.mark.slow  # a run in a process of its own
def test_a_run_fabric_launched_records_fabric_as_its_launcher_and_shares_the_cores(tmp_path):
    """Fabric sets MASTER_ADDR and NODE_RANK in rank 0 too: the record still says Fabric started the run. Without
    OMP_NUM_THREADS each rank computes with an equal share of the cores: under ModelParallelStrategy Lightning gave
    rank 0 its share only after starting rank 1, which kept every core (ranks.share_the_cores; under DDPStrategy its
    launcher, in every rank, gives each its share)."""
    proc = run_script("fabric_gpt.py", "--model", "tiny", "--accelerator", "cpu", "--devices", "2", "--strategy", "tp",
                      "--steps", "1", "--num-samples", "8", "--out-dir", tmp_path, "--run-name", "two",
                      env={"OMP_NUM_THREADS": None})
    record = json.loads((tmp_path / "two" / "record.json").read_text())
    assert record["env"]["launcher"] == ranks.FABRIC
    threads = re.findall(r"^rank [01]/2: .*, (\d+) thread\(s\), LightningEnvironment", proc.stdout, re.M)
    assert threads == [str(max(1, ranks.usable_cores() // 2))] * 2, proc.stdout[-3000:]


def test_a_process_held_to_fewer_cores_counts_only_those():
    """Under `taskset`, a container's cpuset or a SLURM step's cores, the process may use fewer cores than the machine
    has (os.cpu_count()). Held to one, it counts one, as Lightning's launcher and `nproc` do: a rank's share of the
    threads, the key of the cached measurements, and the refusal of a second CPU process, named with the count."""
    import subprocess

    from conftest import REPO

    code = ("from core.run import hardware, measurements, ranks\n"
            "print(ranks.cores_per_rank(1), measurements.machine_key()['cores'])\n"
            "try:\n    hardware.check_hardware('cpu', 2, '32-true')\nexcept ranks.ConfigError as e:\n    print(e)")
    one_core = lambda: os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # noqa: E731
    held = subprocess.run([warm_python.REAL, "-c", code], cwd=REPO, capture_output=True, text=True, preexec_fn=one_core)
    counts, refusal = held.stdout.split("\n", 1)
    assert counts == "1 1" and refusal.startswith("--devices 2: this process may use 1 CPU core(s)"), held


@pytest.mark.slow
def test_torchrun_as_gpt_sbatch_documents_it_hands_slurms_signals_on(tmp_path):
    """torchrun in a SLURM job, with the flags gpt.sbatch gives it: SIGUSR1 to its task's process group (the agent
    alone: its processes run in sessions of their own), once. The agent hands it to its 2 processes, which save at
    their step boundary and requeue the job once (rank 0); torchrun exits non-zero, and the job run again continues
    from that checkpoint to the end. Once, not twice: a second signal before the agent has handed on the first
    (torch's `run()` is still logging it) makes the agent's `finally` stop its processes with SIGTERM instead, which
    saves without a requeue (the suite under load, 2026-11-30; gpt.sbatch says so). Two signals straight to the ranks
    are the srun test's (test_gpt.py)."""
    import signal
    import subprocess
    from pathlib import Path

    from conftest import REPO

    recipe = (REPO / "gpt.sbatch").read_text()
    handled = re.search(r"--signals-to-handle (\S+)", recipe).group(1)
    timeout = re.search(r"--shutdown-timeout (\d+)", recipe).group(1)
    assert "SIGUSR1" in handled and "SIGUSR2" in handled and "SIGTERM" in handled
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "scontrol").write_text('#!/bin/sh\necho "$@" >> "$SCONTROL_LOG"\n')
    (tmp_path / "bin" / "scontrol").chmod(0o755)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "SLURM_JOB_ID": "515",
           "SCONTROL_LOG": str(tmp_path / "scontrol.log"), "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}"}
    command = [warm_python.executable(), str(Path(warm_python.REAL).parent / "torchrun"), "--signals-to-handle",
               handled, "--shutdown-timeout", timeout, "--standalone", "--nproc-per-node", "2", "fabric_gpt.py",
               "--model", "tiny", "--dataset", "ramp", "--num-samples", "4000", "--micro-batch-size", "2", "--devices",
               "2", "--strategy", "ddp", "--accelerator", "cpu", "--steps", "40", "--out-dir", str(tmp_path),
               "--run-name", "tr", "--resume", "auto"]
    proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # the task's process group, as srun starts it
    for line in proc.stdout:
        if line.startswith("step   10/"):
            os.killpg(proc.pid, signal.SIGUSR1)
            break
    output = proc.communicate(timeout=300)[0]
    assert proc.returncode != 0 and "SIGUSR1 received: saved" in output, output[-3000:]
    assert (tmp_path / "scontrol.log").exists() and (tmp_path / "scontrol.log").read_text() == "requeue 515\n", output[-4000:]
    saved = max(int(p.name[5:]) for p in (tmp_path / "tr" / "checkpoints").glob("step-*"))
    assert 10 <= saved < 40
    again = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "resumed from" in again.stdout, again.stdout[-2000:] + again.stderr[-2000:]
    assert json.loads((tmp_path / "tr" / "record.json").read_text())["steps"] == 40


ANOTHER_RANK_FIRST = """
import os, signal
from core.run import stops
stop = stops.StopRequest().listen("USR1")
stop.signal_name = "SIGINT"  # what requested() records when the step's all-reduce says another rank was signalled
os.kill(os.getpid(), signal.SIGINT)  # then this rank's own Ctrl-C, later (a loaded machine): its first
print("still running", stop.signal_name, flush=True)
os.kill(os.getpid(), signal.SIGINT)  # and a second: at once
"""


def test_a_ranks_own_signal_after_the_stop_another_rank_began_is_its_first():
    """One Ctrl-C reaches every rank, but the step's all-reduce can bring rank 0's stop to rank 1 before rank 1's own
    signal lands: that signal is then rank 1's first, acknowledged as such and saved at the boundary, not taken for a
    second Ctrl-C (which stops at once, without a save), nor said to be "received again"."""
    import signal
    import subprocess

    from conftest import REPO

    proc = subprocess.run([warm_python.executable(), "-c", ANOTHER_RANK_FIRST], cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    assert proc.stdout == "still running SIGINT\n", proc.stdout + proc.stderr
    assert proc.stderr.count("SIGINT received: stopping at the next step boundary") == 1, proc.stderr
    assert "received again" not in proc.stderr, proc.stderr
    assert proc.returncode == -signal.SIGINT and "StoppedAtOnce" in proc.stderr, proc.stderr


FLOODED_REQUEUES = """
import os, signal, sys
from core.run import stops
seen = []
signal.signal(signal.SIGTERM, lambda *_: seen.append(1))
print("ready", flush=True)
while len(seen) < 5:  # the flood has begun
    signal.pause()
failed = [line for ok, line in (stops.requeue_slurm_job("--resume auto") for _ in range(100)) if not ok]
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # the flood lasts until this line is read, and an
print(len(failed), failed[:1], flush=True)                  # interpreter's end restores the default action
"""


def test_a_launchers_stop_to_the_rank_never_ends_scontrol_mid_requeue(tmp_path):
    """torchrun's agent, stopping, sends SIGTERM to each rank's process group, and may send it as rank 0 starts
    `scontrol requeue`: scontrol must not die of it, even in the instant between its fork and its own session (a
    signal pending there kills the child once its mask is restored). A process whose group is flooded with SIGTERM
    requeues 100 times, and each requeue is recorded; without the signals blocked, 50-78 of them died (AVX-512 EPYC)."""
    import signal
    import subprocess
    import threading

    from test_gpt import slurm_job

    from conftest import REPO

    proc = subprocess.Popen([warm_python.executable(), "-c", FLOODED_REQUEUES], cwd=REPO, env=slurm_job(tmp_path),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    first = proc.stdout.readline()
    assert first == "ready\n", first + proc.communicate(timeout=60)[0]
    requeued = threading.Event()

    def flood():
        while not requeued.is_set() and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)

    flooding = threading.Thread(target=flood)
    flooding.start()
    try:
        result = proc.stdout.readline()  # the flood stops once the 100 requeues are done
    finally:
        requeued.set()
        flooding.join()
    output = result + proc.communicate(timeout=60)[0]
    assert proc.returncode == 0 and output.startswith("0 []"), output[-2000:]
    assert (tmp_path / "scontrol.log").read_text() == "requeue 4242\n" * 100


PRINTS_WHILE_SIGNALLED = """
import os, sys, time
from core.run import stops
os.environ.pop("SLURM_JOB_ID", None)
stop = stops.StopRequest().listen("USR1")  # outside SLURM each SIGUSR1 is a warning line from the handler
print("listening", flush=True)
end = time.time() + 60
while time.time() < end and not os.path.exists(sys.argv[1]):  # until the test has sent all its signals
    print("step | loss 5.5608 | grad norm 1.484")
"""


def test_a_handlers_line_never_lands_inside_a_printed_line_under_pythonunbuffered(tmp_path):
    """SLURM job scripts and launchers set PYTHONUNBUFFERED, where print writes a line's text and its newline
    separately: 100 signals during a stream of prints must each be one whole line, and so must every print."""
    import signal
    import subprocess

    from conftest import REPO

    done = tmp_path / "done"
    proc = subprocess.Popen([warm_python.executable(), "-u", "-c", PRINTS_WHILE_SIGNALLED, str(done)], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.stdout.readline() == "listening\n"
    lines, handled = [], [0]

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            handled[0] += line.startswith("warning: SIGUSR1 ignored")
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    for sent in range(1, 101):  # each after the last one's line: two pending SIGUSR1 would be delivered as one
        proc.send_signal(signal.SIGUSR1)
        deadline = time.time() + 10
        while handled[0] < sent and time.time() < deadline:
            time.sleep(0.002)
    done.touch()
    proc.wait(timeout=60)
    reader.join(timeout=60)
    lines = [line.rstrip("\n") for line in lines]
    warnings = [line for line in lines if line.startswith("warning: SIGUSR1 ignored")]
    mixed = [line for line in lines if line != "step | loss 5.5608 | grad norm 1.484" and line not in warnings]
    assert proc.returncode == 0 and len(warnings) == 100 and not mixed, (len(warnings), mixed[:3])
