"""Measurements of this machine, cached per machine: a measurement is taken once for its settings and read back after,
keyed by the CPU, its instruction-set caps, torch and the measured settings, in ~/.cache/fabric-lab/cpu-probe.json
(FABRIC_LAB_CACHE moves it), under a file lock so that processes started together (a launcher's ranks) measure once
and read the same answer. With the helpers every measurement times with: a rank's threads, and a call's median time.
"""

import fcntl
import json
import os
import statistics
import sys
import time
from datetime import datetime
from pathlib import Path

import torch

from core.run.files import write_json_atomic
from core.run.hardware import cpu_name, cpu_units, isa_caps
from core.run.ranks import cores_per_rank, usable_cores


def cache_folder() -> Path:
    """Where this machine's measurements are kept: FABRIC_LAB_CACHE, else ~/.cache/fabric-lab."""
    return Path(os.environ.get("FABRIC_LAB_CACHE") or "~/.cache/fabric-lab").expanduser()


def cache_file() -> Path:
    return cache_folder() / "cpu-probe.json"


def machine_key() -> dict:
    """What every measurement depends on: the CPU, the cores this process may use, its instruction-set caps
    (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA change the kernels as another CPU would) and torch."""
    return {"cpu": cpu_name(), "units": cpu_units(), "cores": usable_cores(), "caps": isa_caps(), "torch": torch.__version__}


def entry_name(kind: str, settings: dict) -> str:
    return json.dumps({"kind": kind, **machine_key(), **settings}, sort_keys=True)


def cached(kind: str, settings: dict, measure, allow_measure: bool = True, timed_threads: int | None = None):
    """measure()'s result for (this machine, kind, settings): from the cache, else measured and added to it (None
    when allow_measure is False and nothing is cached). `timed_threads`: measure() times this process's own work on
    that many threads, so a machine too busy for them while it ran makes the result this run's only (quiet_enough)."""
    path, name = cache_file(), entry_name(kind, settings)
    if not allow_measure:  # a look-up: the file is replaced whole (atomic rename), so no lock is needed, and none is
        # taken: the minimal job that a measurement runs looks up its own estimate while its parent holds the lock
        try:
            return json.loads(path.read_text()).get(name, {}).get("value")
        except (OSError, ValueError):
            return None
    entry, _ = stored_or_measured(path, name, dated(measure), timed_threads=timed_threads,
                                  what=f"the {kind} measurement")
    return entry["value"]


def dated(measure):
    return lambda: {"value": measure(), "date": f"{datetime.now():%Y-%m-%d %H:%M}"}


def stored_or_measured(path: Path, name: str, measure, wait: bool = True, timed_threads: int | None = None,
                       what: str = "the measurement") -> tuple[dict, bool]:
    """(the entry under `name` in the JSON file at `path`, True), else (measure()'s entry, added to the file, False).
    A file lock makes processes started together (a launcher's ranks) measure once and read the same answer; with
    `wait` False a process that finds the lock taken measures without it and stores nothing. A cache that cannot be
    kept (a read-only or missing home, a full disk) costs a measurement per run, never the run: it says so, once.
    With `timed_threads`, neither does a timing that other processes disturbed (quiet_enough): it says so."""
    if timed_threads:
        measure = watched(measure, timed_threads, what)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = open(path.with_suffix(".lock"), "w")
    except OSError as e:
        return unkept(path, e, measure()), False
    with lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:  # a measurement is running (perhaps this process's parent): the next run stores it
            return measure(), False
        try:
            cache = json.loads(path.read_text())
        except (OSError, ValueError):  # none yet, or unreadable: measure
            cache = {}
        if name in cache:
            return cache[name], True
        entry = measure()
        if BUSY in entry:  # this run's answer, not the machine's
            return entry, False
        try:
            write_json_atomic(path, {**cache, name: entry})
        except OSError as e:
            unkept(path, e, entry)
    return entry, False


# ----------------------------------------------------------------------------- a timing that other processes disturbed
BUSY = "busy"  # the entry's key saying why it was not kept
KEEP_BUSY_ENV = "FABRIC_LAB_KEEP_BUSY_MEASUREMENTS"  # 1: keep them anyway (the suite, whose workers fill the cores)


def busy_cpu_seconds() -> float | None:
    """CPU seconds every process of the machine has used since boot, the hypervisor's steal included (/proc/stat's
    first line), or None where there is no /proc/stat."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def quiet_enough(others: float, timed_threads: int, cores: int) -> bool:
    """Whether a timing on `timed_threads` threads stands for the machine when other processes used `others` cores on
    average meanwhile: each thread could still have had a core of its own (a quarter of a core over for the system's
    own work: two ranks on 2 cores time their matmul peak side by side, one thread each), or the others stayed under
    half a core (a desktop's background). A LeNet-5 probe taken beside a test suite on 2 cores read 700-3,300
    samples/s for steps that run 12,000-18,000 quiet (an AVX2 EPYC), and its choice would have stood for every later
    run."""
    return others < 0.5 or others <= cores - timed_threads + 0.25


def watched(measure, timed_threads: int, what: str):
    """measure(), its entry marked BUSY (with a line saying so) where other processes' load left its threads without
    cores of their own (quiet_enough): /proc/stat's busy time over the measurement, less this process's own."""
    def run():
        before, own_before, started = busy_cpu_seconds(), time.process_time(), time.monotonic()
        entry = measure()
        after, own, wall = busy_cpu_seconds(), time.process_time() - own_before, time.monotonic() - started
        if before is None or after is None or wall <= 0 or os.environ.get(KEEP_BUSY_ENV) == "1":
            return entry
        others, cores = max(0.0, (after - before - own) / wall), os.cpu_count() or 1
        if quiet_enough(others, timed_threads, cores):
            return entry
        why = (f"other processes used {others:.1f} of this machine's {cores} cores while {what} ran on "
               f"{timed_threads} thread(s)")
        print(f"note: {why}: its answer stands for this run only, and the next run measures it again", file=sys.stderr)
        return {**entry, BUSY: why}
    return run


_UNKEPT: set = set()  # the cache folders this process could not write, each said once


def unkept(path: Path, error: OSError, entry):
    """`entry`, measured and not stored at `path`: the note that says why (once per folder and process)."""
    if path.parent not in _UNKEPT:
        _UNKEPT.add(path.parent)
        print(f"note: measurements are not kept in {path.parent} ({error.strerror or error}): each run measures "
              f"again; set FABRIC_LAB_CACHE (fabric_lenet.py: --cache-dir) to a folder it can write", file=sys.stderr)
    return entry


def forget(kind: str, settings: dict) -> None:
    """Drop the cached measurement of (this machine, kind, settings), one that a run has shown wrong: the next run
    measures it again."""
    path = cache_file()
    try:
        lock = open(path.with_suffix(".lock"), "w") if path.exists() else None
    except OSError:  # a cache this process cannot write: nothing it could drop
        lock = None
    if lock is None:
        return
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            cache = json.loads(path.read_text())
        except (OSError, ValueError):
            return
        if cache.pop(entry_name(kind, settings), None) is not None:
            write_json_atomic(path, cache)


def cached_unlocked(kind: str, settings: dict, measure, timed_threads: int | None = None):
    """As cached(), for a measurement of a second or so taken inside any process, a minimal job that a locked
    measurement runs included: measured without waiting for the lock, and stored only when the lock is free."""
    value = cached(kind, settings, None, allow_measure=False)
    if value is not None:
        return value
    return stored_or_measured(cache_file(), entry_name(kind, settings), dated(measure), wait=False,
                              timed_threads=timed_threads, what=f"the {kind} measurement")[0]["value"]


MARGIN = 1.05  # a 16-bit path is taken only this much faster, in 3 of 4 paired windows: its rounding for speed


def clearly_faster(a: list[float], b: list[float], margin: float = MARGIN) -> bool:
    """Whether speeds `a` beat `b` clearly: a's median `margin` above b's and a ahead in 3 of 4 paired windows. A
    lead within the windows' spread is the machine's moment (another process's load measured 7% for bf16 on a Xeon
    where it runs 21% slower quiet, 2026-11-28)."""
    ahead = sum(x > y for x, y in zip(a, b))
    return statistics.median(a) >= margin * statistics.median(b) and 4 * ahead >= 3 * len(b)


def rank_threads(devices: int) -> int:
    """The intra-op threads one rank gets: all of them alone, an equal share when Fabric starts several
    (ranks.share_the_cores), OMP_NUM_THREADS when set."""
    return int(os.environ.get("OMP_NUM_THREADS") or 0) or (cores_per_rank(devices) if devices > 1
                                                           else torch.get_num_threads())


def seconds_per_call(fn, seconds: float = 0.2, windows: int = 3, sync=lambda: None) -> float:
    """The median of `windows` timings of fn, each at least `seconds` long, after warm-up calls that build the
    kernels (oneDNN on its first calls). On a GPU `sync` (torch.cuda.synchronize) ends each window where its kernels
    end: the calls between queue as a training loop's do, so the window holds their launches and their work. A first
    call that outlasts the whole measurement is followed by one more, timed alone: eight calls of a shape that takes
    minutes would cost more than the run they decide, and a call that long is not lost in the timer's noise."""
    start = time.perf_counter()
    fn()
    sync()
    if time.perf_counter() - start > seconds:
        start = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - start
    fn()
    sync()
    times = []
    for _ in range(windows):
        count, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds / windows or count < 2:
            fn()
            count += 1
        sync()
        times.append((time.perf_counter() - start) / count)
    return statistics.median(times)


class threads:
    """Run a measurement with a rank's threads, and give the process its own back."""

    def __init__(self, n: int):
        self.n, self.before = n, torch.get_num_threads()

    def __enter__(self):
        torch.set_num_threads(self.n)

    def __exit__(self, *exc):
        torch.set_num_threads(self.before)
