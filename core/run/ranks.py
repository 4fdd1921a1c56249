"""The processes of a run: what launched this one (one rule, for every caller), starting the ranks with a bounded
wait for the other nodes, and watching ranks and nodes so that a lost one ends the run with one message naming it
instead of a collective's traceback or a silent hang."""

import contextlib
import dataclasses
import os
import platform
import signal
import sys
import threading
import time

from core.run.flags import ConfigError

TORCHRUN, SRUN, BY_HAND, FABRIC = ("torchrun", "SLURM (srun)", "by hand (MASTER_ADDR, MASTER_PORT, NODE_RANK)",
                                   "Fabric, on this machine")
# launch() writes its verdict here before Fabric starts the other local ranks: they inherit it, and Fabric's own
# MASTER_ADDR/NODE_RANK (which it sets in this process too) are not mistaken for a launch by hand
STARTED_BY = "FABRIC_LAB_LAUNCHER"
STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2}  # those a launcher forwards (stops.py)
# set when every rank stops on one agreed error (a full disk, a busy folder; lifecycle.exits): another rank's exit
# is then no news, and the watches below say nothing of it
AGREED_END = threading.Event()


def launcher(environ=None) -> str:
    """What started this process: torchrun, srun (a SLURM job step), a user by hand (MASTER_ADDR / NODE_RANK on each
    node), or Fabric on this machine (started alone, or a rank Fabric started). An interactive SLURM shell
    (SLURM_JOB_NAME bash or interactive, as `salloc` or `srun --pty bash` give) is not a launcher: a process started in
    it is started by hand there, as Lightning's SLURMEnvironment also decides."""
    env = os.environ if environ is None else environ
    if env.get("TORCHELASTIC_RUN_ID"):
        return TORCHRUN
    if "SLURM_NTASKS" in env and env.get("SLURM_JOB_NAME") not in ("bash", "interactive"):
        return SRUN
    if env.get(STARTED_BY):
        return env[STARTED_BY]
    if "NODE_RANK" in env or "MASTER_ADDR" in env:
        return BY_HAND
    return FABRIC


# What `fabric run` (Lightning's launcher: torchrun underneath) tells the script it starts, by variable
FABRIC_RUN = {"accelerator": "LT_ACCELERATOR", "strategy": "LT_STRATEGY", "devices": "LT_DEVICES",
              "num_nodes": "LT_NUM_NODES", "precision": "LT_PRECISION"}


def take_fabric_run_settings(cfg, argv: list[str]):
    """Under `fabric run --accelerator cpu --devices 2 ... script.py ...`: its accelerator, strategy, devices, nodes
    and precision become the script's wherever the script's own flag was not given; a flag given with another value
    is one line. The LT_* variables are then removed, so that Fabric sees the one reconciled setting (it would
    compare a strategy object with the launcher's name and refuse) and meets the ranks as under torchrun, which
    `fabric run` is underneath (launch() then starts the process group as it does there). Returns the config with
    them (a new one: its layout follows)."""
    if os.environ.pop("LT_CLI_USED", None) != "1":
        return cfg
    given, theirs_all = {a.split("=", 1)[0] for a in argv if a.startswith("--")}, {}
    for field, variable in FABRIC_RUN.items():
        value = os.environ.pop(variable, None)
        if value is None:
            continue
        flag, current = "--" + field.replace("_", "-"), getattr(cfg, field)
        try:
            theirs = type(current)(value)
        except ValueError:
            raise ConfigError(f"`fabric run {flag} {value}`: this script takes {flag} as a number of processes; give "
                              f"fabric run a count") from None
        if flag in given and theirs != current:
            raise ConfigError(f"{flag} {current} conflicts with `fabric run {flag} {value}`, which launched this "
                              f"process: give {flag} in one place (the launcher's decides how many processes start)")
        theirs_all[field] = theirs
    return dataclasses.replace(cfg, **theirs_all)


def first_process(environ=None) -> bool:
    """Whether this process becomes global rank 0: not a rank Fabric started beside it, and rank 0 by its launcher's
    word (RANK under torchrun, SLURM_PROCID under srun, NODE_RANK when started by hand)."""
    env = os.environ if environ is None else environ
    return not started_by_fabric(env) and all(env.get(k, "0") == "0" for k in ("RANK", "SLURM_PROCID", "NODE_RANK"))


def global_rank() -> int:
    """This process's rank in its run: the process group's once it exists, else 0 for the first process."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return 0 if first_process() else 1


def started_by_fabric(environ=None) -> bool:
    """A rank that Fabric started beside rank 0 (its local rank above 0), not one a launcher started."""
    env = os.environ if environ is None else environ
    return env.get("LOCAL_RANK", "0") != "0" and launcher(env) not in (TORCHRUN, SRUN)


def check_launcher(num_nodes: int, devices: int, script: str) -> None:
    """--num-nodes above 1 needs every node started, by a launcher (torchrun, srun) or by hand with the address of
    node 0 (MASTER_ADDR, MASTER_PORT, NODE_RANK, as Fabric reads them). Started alone, a process would wait for the
    other nodes for the process group's 30 minutes without a word: refused at once, with the commands."""
    if num_nodes > 1 and launcher() == FABRIC:
        raise ConfigError(
            f"--num-nodes {num_nodes}: no launcher started this process, so nothing would start the other nodes and it "
            f"would wait for them. Start it on every node, e.g. `torchrun --nnodes {num_nodes} --nproc-per-node {devices} "
            f"--rdzv-backend c10d --rdzv-endpoint NODE0_HOST:29500 {script} ... --num-nodes {num_nodes} --devices "
            f"{devices}` (the same on each node), or `srun` under SLURM, or by hand with MASTER_ADDR=NODE0_HOST "
            f"MASTER_PORT=29500 NODE_RANK=<0..{num_nodes - 1}> on each node")


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity (a SLURM allocation, a container's cpuset, `taskset`), as
    Lightning's launcher counts them for its ranks' threads and `nproc` for the suite's workers. os.cpu_count() is
    the whole machine's: on 8 cores allocated of a 128-core node, two ranks would start 64 threads each."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # no affinity call (macOS): the machine's count
        return os.cpu_count() or 1


def cores_per_rank(processes: int) -> int:
    """The intra-op threads each of `processes` ranks on this machine gets: an equal share of the cores."""
    return max(1, usable_cores() // processes)


def share_the_cores(fabric) -> None:
    """Where Fabric starts this machine's ranks, each computes with an equal share of the cores. Lightning sets the
    share in its launcher, which under ModelParallelStrategy (fsdp, tp, fsdp_tp, pp) exists in rank 0 alone and sets
    it there after starting the others: they kept every core (on 2 cores, 3 threads for 2 ranks; a tensor-parallel
    step 34-44 ms against 19-25 ms, a pipeline's 19-20 against 11-13, docs/gpt.md). Set before, the ranks Fabric
    starts inherit it (OpenMP reads OMP_NUM_THREADS at load). torchrun sets it itself; OMP_NUM_THREADS given wins."""
    import torch

    local = getattr(fabric.strategy, "num_processes", 1)
    environment = getattr(fabric.strategy, "cluster_environment", None)
    if local < 2 or "OMP_NUM_THREADS" in os.environ or environment is None or environment.creates_processes_externally:
        return
    threads = cores_per_rank(local)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)


def launch(fabric, num_nodes: int, timeout: float) -> None:
    """fabric.launch(), whose rendezvous waits for every rank, bounded by `timeout` seconds: a node that was not
    started (or cannot reach node 0) ends the wait with one message naming the address and the launcher, instead
    of the process group's 30 minutes without a word. (Under torchrun the launcher meets first: see README.)"""
    import torch

    def give_up() -> None:
        address = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
        start = (f"make the job start every task (#SBATCH --nodes {num_nodes} --ntasks-per-node "
                 f"{fabric.world_size // num_nodes}, the command under srun)" if launcher() == SRUN else
                 f"start the same command on every node (node ranks 0 to {num_nodes - 1}) with the same address and port")
        print(f"error: waited {timeout:g} s at {address} for the {fabric.world_size} processes of this run on "
              f"{num_nodes} node(s), and not all came (this is rank {fabric.global_rank} on node {fabric.node_rank}; "
              f"launcher: {launcher()}). Fix: {start}, check that {address} can be reached from each node, or wait "
              f"longer with --node-timeout", file=sys.stderr, flush=True)
        os._exit(1)

    os.environ.setdefault(STARTED_BY, launcher())  # before Fabric sets MASTER_ADDR here and starts the local ranks
    share_the_cores(fabric)
    timer = threading.Timer(timeout, give_up)
    timer.daemon = True
    timer.start()
    # The local ranks Fabric starts here are born holding the stop signals, and take them once they listen (stops.py):
    # a Ctrl-C reaches the terminal's whole group, and a rank still importing would end in a traceback, Fabric then
    # killing the others. In this process they wait out the rendezvous, where a stop could not act anyway (it acts at
    # a step boundary).
    held = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        fabric.launch()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
        timer.cancel()
    if fabric.world_size > 1:  # every rank, so that a log shows where each one runs (and its pid, for a kill)
        environment_name = type(getattr(fabric.strategy, "cluster_environment", None)).__name__
        line = (f"rank {fabric.global_rank}/{fabric.world_size}: node {fabric.node_rank}, local rank {fabric.local_rank}, "
                f"pid {os.getpid()}, host {platform.node()}, {torch.get_num_threads()} thread(s), {environment_name} "
                f"(launcher: {launcher()})\n")
        print(line, end="", flush=True)  # one write with its newline: unbuffered, print writes the end apart


# what gloo and NCCL raise in a collective whose peer is gone
LOST_PEER = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "remote process exited",
             "NCCL communicator was aborted")


def death(code: int) -> str:
    """How a process ended, from its exit status (negative: the signal that killed it)."""
    if code >= 0:
        return f"exited with status {code}"
    name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else f"signal {-code}"
    hint = " (what the kernel's out-of-memory killer sends: `dmesg | grep -i oom` tells)" if -code == signal.SIGKILL else ""
    return f"was killed by {name}{hint}"


def watch_ranks(fabric, after) -> None:
    """A rank that dies takes the run down with one message instead of a collective's traceback or a silent hang.
    Rank 0 of a run Fabric launched watches the processes it started; each of those watches rank 0. Within a
    second of a death the watcher prints which rank died and how, with `after()` (the last checkpoint and the
    resume command), stops the others and exits 1. (Under torchrun or SLURM the launcher does this.)"""
    procs = list(getattr(fabric.strategy.launcher, "procs", None) or [])
    parent = os.getppid()
    launched_child = started_by_fabric()
    if not procs and not launched_child:
        return

    def stop(message: str) -> None:
        if AGREED_END.is_set():  # this rank ends too, on the error every rank agreed (rank 0 says it)
            return
        print(f"error: {message}. The other processes are stopped; {after()}", file=sys.stderr, flush=True)
        for p in procs:
            if p.poll() is None:
                p.kill()
        os._exit(1)

    def watch() -> None:
        while True:
            time.sleep(0.5)
            for rank, p in enumerate(procs, start=1):
                code = p.poll()
                if code is not None and code != 0:
                    stop(f"rank {rank} (pid {p.pid}) {death(code)}")
            if launched_child and os.getppid() != parent:
                stop(f"rank 0 (pid {parent}, the process that launched this one) died; this rank "
                     f"({fabric.global_rank}) cannot continue alone")

    # Fabric's own observer polls every 5 s and SIGKILLs every process, this one included, without a word: when it
    # saw a death first, the run ended as if rank 0 had been killed too. This watch does its work (and says why).
    for thread in threading.enumerate():
        if thread.name == "child-process-observer":
            thread._run = lambda: True  # its next poll ends it quietly
    threading.Thread(target=watch, daemon=True, name="rank-watch").start()


class PeerWatch:
    """Ranks on other machines, which no process here can poll. Every rank bumps its own counter in the run's
    rendezvous store (the TCPStore at MASTER_ADDR:MASTER_PORT on node 0) each second and reads its two ring
    neighbours'. A counter that stands still for `timeout` s, or a store that stops answering, is a lost rank:
    the rank that sees it says which and exits 1, instead of waiting in a collective for the process group's
    30 minutes. A collective that fails at once (gloo: "Connection closed by peer") asks `lost()` which rank."""

    current: "PeerWatch | None" = None  # this process's watch, for run_main's message

    def __init__(self, fabric, after, num_nodes: int, timeout: float, tag: str):
        from datetime import timedelta

        from torch.distributed import TCPStore

        self.after, self.timeout, self.finished = after, timeout, False
        self.rank, self.world, self.devices = fabric.global_rank, fabric.world_size, fabric.world_size // num_nodes
        self.address = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
        # its own connection: the process group's store client may be busy in a blocking wait
        self.store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=timedelta(seconds=max(1.0, min(timeout, 30.0))))
        self.key = lambda r: f"fabric-lab/{tag}/beat/{r}"  # noqa: E731
        self.store.add(self.key(self.rank), 1)
        self.neighbours = sorted({(self.rank + 1) % self.world, (self.rank - 1) % self.world} - {self.rank})
        PeerWatch.current = self
        threading.Thread(target=self._watch, daemon=True, name="peer-watch").start()

    def name(self, rank: int) -> str:
        return f"rank {rank} (node {rank // self.devices})"

    def store_lost(self) -> str:
        who = "node 0's torchrun" if launcher() == TORCHRUN else self.name(0)
        return f"the run's rendezvous store at {self.address}, held by {who}, stopped answering"

    def counts(self, ranks) -> dict:
        self.store.add(self.key(self.rank), 1)
        return {r: self.store.add(self.key(r), 0) for r in ranks}

    def _watch(self) -> None:
        seen = {r: (None, time.monotonic()) for r in self.neighbours}
        answered = time.monotonic()
        while not self.finished:
            time.sleep(1.0)
            now = time.monotonic()
            try:
                counts = self.counts(self.neighbours)
            except Exception:  # noqa: BLE001 - any failure to reach the store is the same news
                if self.finished:
                    return
                if now - answered > self.timeout:
                    self._stop(self.store_lost())
                continue
            answered = now
            seen = {r: (c, now) if c != seen[r][0] else seen[r] for r, c in counts.items()}
            # a neighbour writing a checkpoint may pause its beat: it gets 10 times as long
            stale = [r for r, (_, since) in seen.items() if now - since > self.timeout
                     and (now - since > 10 * self.timeout or not self.busy_now(r))]
            if stale and not self.finished:
                self._stop(f"{', '.join(map(self.name, stale))} stopped answering for {self.timeout:g} s (its "
                           f"process or machine is gone; {launcher()} on that node may say more)")

    @contextlib.contextmanager
    def busy(self):
        """A long stretch (writing a checkpoint) in which this rank's beat may pause, if the write holds the GIL:
        its neighbours give it 10 times --node-timeout instead of once."""
        self.store.add(self.key(self.rank) + "/busy", 1)
        try:
            yield
        finally:
            self.store.add(self.key(self.rank) + "/busy", -1)

    def busy_now(self, rank: int) -> bool:
        try:
            return self.store.add(self.key(rank) + "/busy", 0) > 0
        except Exception:  # noqa: BLE001 - the store's loss is noticed at the next beat
            return False

    def _stop(self, message: str) -> None:
        if AGREED_END.is_set():
            return
        print(f"error: {message}. This rank ({self.rank}) stops; {self.after()}", file=sys.stderr, flush=True)
        os._exit(1)

    def lost(self, wait: float = 2.0) -> str:
        """Which ranks stopped: the counters that did not move in `wait` seconds."""
        try:
            before = self.counts(range(self.world))
            time.sleep(wait)
            after = self.counts(range(self.world))
        except Exception:  # noqa: BLE001
            return self.store_lost()
        gone = [r for r in range(self.world) if r != self.rank and after[r] == before[r]]
        return f"{', '.join(map(self.name, gone))} stopped" if gone else "a peer's connection dropped"

    def finish(self) -> None:
        self.finished = True


def watch_peers(fabric, after, num_nodes: int, timeout: float, tag: str) -> None:
    """Start the PeerWatch where rank 0 cannot poll the other ranks as processes: several nodes, or ranks that
    torchrun or SLURM started."""
    if fabric.world_size > 1 and (num_nodes > 1 or launcher() in (TORCHRUN, SRUN)):
        PeerWatch(fabric, after, num_nodes, timeout, tag)


def agree_on_precision(fabric, precision: str) -> None:
    """Ranks on different CPUs, each with its own --precision auto measurement, must still compute in one precision."""
    (differ,) = any_rank(fabric, fabric.broadcast(precision) != precision)
    if differ:
        raise ConfigError("--precision auto chose differently on different ranks (different CPUs or caches); "
                          "pass --precision 32-true or bf16-mixed explicitly")


def any_rank(fabric, *flags: bool) -> tuple[bool, ...]:
    """Each flag OR-ed across ranks, so every rank takes the same branch (one all-reduce when distributed)."""
    if fabric.world_size == 1:
        return tuple(flags)
    import torch

    summed = fabric.all_reduce(torch.tensor([float(f) for f in flags], device=fabric.device), reduce_op="sum")
    return tuple(bool(v > 0) for v in summed)
