"""The figures of a GPT run, beside what the plan said: time, throughput, TFLOPS and MFU over the timed steps,
peak memory against the memory plan, the collectives of one counted step against the planned ones, the bytes an
NVMe-offloaded step swapped, and the performance model's step time on a GPU it has a preset for. fabric_gpt.py
measures; this module turns the measurements into record.json's fields and the summary table."""

import contextlib

import torch

from core.gpt.gpt_model import positions
from core.plan import accounting, perf_model
from core.plan.comm_counter import CommCounter
from core.run.hardware import cpu_name

STEADY_STEP = 2  # steps a process takes before its traffic repeats: DDP rebuilds its buckets in its second


class StepProbes:
    """What --count-comms and NVMe offload measure around a step without slowing the others: the collectives of one
    steady step (the first after warm-up, and not before this process's third; else the run's last) and the bytes
    each step swapped to and from the drive (Linux's counters; the checkpoints' writes are not in a step)."""

    def __init__(self, cfg, stop_at: int):
        self.cfg, self.stop_at = cfg, stop_at
        self.steps_here, self.comms, self.disk = 0, None, {}
        self.timed = False  # whether the last step counts in the timing figures

    @contextlib.contextmanager
    def around(self, step: int):
        cfg = self.cfg
        counter = CommCounter() if cfg.count_comms and self.comms is None and (
            self.steps_here == max(cfg.timing_warmup, STEADY_STEP) or step + 1 == self.stop_at) else None
        before = disk_io() if cfg.nvme_path else None
        with counter or contextlib.nullcontext():
            yield
        if before:
            self.disk = {k: self.disk.get(k, 0.0) + v - before[k] for k, v in disk_io().items()}
        self.steps_here += 1
        # this process's own first steps are the cold ones; the step the counter slowed is not timed either
        self.timed = counter is None and self.steps_here > cfg.timing_warmup
        if counter:
            steady = self.steps_here > STEADY_STEP
            self.comms = {"step": step + 1, "table": counter.table(), "steady": steady,
                          "why": f"this process's step {self.steps_here}: " + (
                              "the first after warm-up and set-up" if steady else "its last; the run ends before a "
                              "steady step, so one-time set-up traffic (DDP's bucket rebuild) may be in it")}


def disk_io() -> dict:
    """Bytes this process has read from and written to storage (Linux counts DeepSpeed's O_DIRECT swapping)."""
    import psutil

    io = psutil.Process().io_counters()
    return {"read": io.read_bytes, "written": io.write_bytes}


def largest(fabric, value: float) -> float:
    """The largest of a figure across ranks."""
    return float(fabric.all_reduce(torch.tensor(float(value), device=fabric.device), reduce_op="max"))


def measured(fabric, cfg, timing: dict, n_params: int, plan: dict, progress, peak: tuple) -> dict:
    """The figures of the run, measured over the timed (post-warm-up) steps of this process's life. A CPU run that
    outran its cached matmul peak drops it from the cache (accounting.forget_cpu_matmul_peak) and says why."""
    steps, seconds = timing["timed_steps"], timing["timed_time_s"]
    lay = cfg.layout
    flops = accounting.flops_per_token(cfg, n_params)
    samples_per_step = cfg.micro_batch_size * cfg.grad_accum * lay.dp_size
    # None (null in record.json) when every step of the run was warm-up: not timed, rather than NaN
    step_time = seconds / steps if steps else None
    samples_s = samples_per_step / step_time if steps else None
    tokens_s = samples_s * positions(cfg) if steps else None  # trained on: a window predicts its next seq_len - 1
    # FLOPs per token times every position the model runs, per device
    per_device = lambda f: f * samples_s * positions(cfg) / fabric.world_size / 1e12 if steps else None  # noqa: E731
    peak_flops, peak_source = peak
    mfu = per_device(flops["standard"]) * 1e12 / peak_flops if peak_flops and steps else None
    if mfu and mfu > 1 and fabric.device.type == "cpu":
        accounting.forget_cpu_matmul_peak(cfg.precision)
        peak_source += ": above 100%, so the probe ran under more load than the steps; the next run measures it again"
    return {
        "model": cfg.model, "n_params": n_params, "strategy": cfg.strategy, "precision": cfg.precision,
        "world_size": fabric.world_size, "tp_size": lay.tp_size, "pp_size": lay.pp_size,
        "data_parallel_size": lay.dp_size, "device": str(fabric.device.type),
        "device_name": torch.cuda.get_device_name(fabric.device) if fabric.device.type == "cuda" else cpu_name(),
        "steps": progress.step, "steps_here": timing["steps_here"], "timed_steps": steps, "step_time_s": step_time,
        "train_time_s": progress.train_time_s, "tokens_per_s": tokens_s,
        "samples_per_s": samples_s, "timing_warmup": cfg.timing_warmup,
        "tflops_per_device": per_device(flops["standard"]), "tflops_per_device_8n": per_device(flops["course_8n"]),
        "mfu": mfu, "peak_flops": peak_flops, "peak_flops_source": peak_source,
        "memory": {k: largest(fabric, v) for k, v in accounting.peak_memory(fabric.device).items()},
        "planned_gb": plan["total"] / 2**30,
        "first_loss": progress.losses[0][1] if progress.losses else None,
        "final_loss": progress.losses[-1][1] if progress.losses else None,
        "losses": progress.losses, "grad_norms": progress.grad_norms, "skipped_steps": progress.skipped_steps,
        "plan_gb": {k: plan[k] / 2**30 for k in ("params", "grads", "optimizer", "master", "ddp_buckets",
                                                 "gathered_layer", "activations", "total")},
    }


def beside_the_plan(fabric, cfg, record: dict, timing: dict, n_params: int, held: dict, setup_peak: dict,
                    host: dict) -> dict:
    """What the record holds beside the measured figures: the set-up's own peak, the states a rank holds against
    their plan, the counted collectives against the planned ones, the predicted step, the host plan, NVMe traffic."""
    out = {"memory_setup": {k: largest(fabric, v) for k, v in setup_peak.items()},
           "held_bytes": {k: largest(fabric, v) for k, v in held.items()},
           "held_bytes_planned": accounting.held_states_plan(cfg, n_params)}
    if cfg.count_comms:
        out.update(comm_record(cfg, timing["comms"]))
    out["predicted"] = predicted_step(cfg, record, n_params)
    out["host_plan"] = {k: float(v) for k, v in host.items()}
    if cfg.nvme_path:  # what ZeRO-Infinity swapped during the optimizer steps, all ranks together, per step
        total = lambda v: float(fabric.all_reduce(torch.tensor(v, dtype=torch.float64, device=fabric.device),  # noqa: E731
                                                  reduce_op="sum"))
        out["disk_io_per_step_bytes"] = {k: total(v) / max(1, timing["steps_here"]) for k, v in timing["disk_io"].items()}
    return out


def predicted_step(cfg, record: dict, n_params: int) -> dict | None:
    """On a GPU the performance model has a preset for: its step time for these settings, beside the measured; from
    this GPU's measurements where a --plan on it took them (device_probe.py, cached), else the preset's peak x
    efficiency ("source" says which)."""
    name = perf_model.cluster_of_gpu(record["device_name"]) if record["device"] == "cuda" else None
    if name is None:
        return None
    here = torch.cuda.is_available()  # else a record read back where its GPU is not: the preset's figures
    t = perf_model.time_plan(cfg, perf_model.measured_gpu_cluster(name, probe="cached") if here else
                             perf_model.CLUSTERS[name], n_params)
    return {"cluster": name, "efficiency": t["efficiency"], "step_time_s": t["step_time_s"],
            "tokens_per_s": t["tokens_per_s"], "mfu": t["mfu"],
            "source": "measurements of this GPU" if t["measured_step"] else
            f"the preset's kernels (gpu_efficiency.py, {t['kernels']['framework']})" if t["kernels"] else
            f"the preset's peak x efficiency {t['efficiency']}"}


def comm_record(cfg, comms: dict | None) -> dict:
    """What every rank issued in the counted step, rank 0's table, and the plan's for the same settings."""
    tables = [comms]
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        tables = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(tables, comms)
    return {"comm_counted_step": comms["step"] if comms else None, "comm_counted_why": comms["why"] if comms else None,
            "comm_counted": tables[0]["table"] if tables[0] else [],
            "comm_counted_by_rank": [t["table"] if t else [] for t in tables],
            "comm_planned": perf_model.comm_table(cfg)}


def announce_duration(fabric, cfg, n_params: int, peak: tuple, steps: int) -> None:
    """A run that the performance model plans at over a minute says so before its first step, so that no one
    waits on a silent step. On a CPU the plan counts compute at the measured peak (communication would add)."""
    if fabric.device.type == "cuda":  # this GPU's measurements when a --plan on it made them (cached), else its preset
        name = perf_model.cluster_of_gpu(torch.cuda.get_device_name(fabric.device))
        cluster = perf_model.measured_gpu_cluster(name, str(fabric.device), probe="cached") if name else None
    else:  # this CPU's measurements when a --plan made them (cached), else compute alone: a lower bound
        cluster = perf_model.cpu_cluster(cfg.precision, peak[0], probe="cached") if peak[0] else None
    if cluster is None or steps <= 0:
        return
    plan = perf_model.time_plan(cfg, cluster, n_params)
    seconds = plan["step_time_s"] * steps
    if seconds > 60:
        lower_bound = cluster.name == "cpu" and not plan["measured_step"]
        fabric.print(f"planned: about {duration(seconds)} for {steps} step{'s' * (steps > 1)} (perf_model.py on "
                     f"{cluster.device}{', at least' if lower_bound else ''}); Ctrl-C stops cleanly at the end of "
                     "a step with a checkpoint, and --resume auto continues", flush=True)


def duration(seconds: float) -> str:
    return (f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min" if seconds < 5400
            else f"{seconds / 3600:.1f} h")


def print_summary(fabric, r: dict) -> None:
    mem = ", ".join(f"{k} {v:.2f}" for k, v in r["memory"].items())
    setup = ", ".join(f"{k} {v:.2f}" for k, v in r.get("memory_setup", {}).items())
    mfu = f"{100 * r['mfu']:.2f}% of {r['peak_flops'] / 1e12:.2f} TFLOPS ({r['peak_flops_source']})" if r["mfu"] is not None \
        else f"unknown ({r['peak_flops_source']})"
    timed = r["timed_steps"] > 0
    here = r.get("steps_here", r["steps"])  # records written before it existed: the run's steps
    not_timed = ("not timed: no step trained in this process" if not here else f"not timed: {here} steps here, all of "
                 f"them warm-up (--timing-warmup {r['timing_warmup']}); run more steps or lower --timing-warmup")
    fabric.print(f"\n{'model':<22}{r['model']} ({r['n_params'] / 1e6:,.2f}M parameters)\n"
                 f"{'strategy / precision':<22}{r['strategy']} / {r['precision']} on {r['world_size']} x {r['device_name']}"
                 f" (dp {r['data_parallel_size']}, tp {r['tp_size']}, pp {r['pp_size']})\n"
                 f"{'steps (timed)':<22}{r['steps']} ({r['timed_steps']})\n"
                 + (f"{'step time':<22}{1e3 * r['step_time_s']:.1f} ms\n"
                    f"{'throughput':<22}{r['tokens_per_s']:,.0f} tokens/s, {r['samples_per_s']:,.2f} samples/s\n"
                    f"{'TFLOPS per device':<22}{r['tflops_per_device']:.3f} (6N+attention), "
                    f"{r['tflops_per_device_8n']:.3f} (course, 8N)\n"
                    f"{'MFU':<22}{mfu}\n" if timed else f"{'step time':<22}{not_timed}\n")
                 + f"{'peak memory (GiB)':<22}{mem} in training; set-up peak {setup}\n"
                 f"{'planned (GiB)':<22}{planned_memory(r)}\n"
                 f"{'loss first / last':<22}" + (f"{r['first_loss']:.4f} / {r['final_loss']:.4f}" if r["losses"] else
                                                  "none logged (no log point among the steps trained)")
                 + (f"\n{'val loss first / last':<22}{r['val_losses'][0][1]:.4f} / {r['val_loss']:.4f} (step "
                    f"{r['val_losses'][-1][0]}; {r['text']['tokenizer']} tokenizer, {r['text']['tokenizer_vocab']} tokens)"
                    if r.get("val_losses") else "")
                 + (f"\n{'predicted step':<22}{1e3 * r['predicted']['step_time_s']:.1f} ms on {r['predicted']['cluster']} from "
                    f"{prediction_source(r['predicted'])} (perf_model.py)"
                    if r.get("predicted") else ""))


def planned_memory(r: dict) -> str:
    """The plans beside the measured peaks: the device's (what max_allocated counts on a GPU) and, on any machine, a
    process's host memory, the one a CPU run's max_rss_gb is to be read against (records older than it: the first)."""
    host = r.get("host_plan")
    return f"device {r['planned_gb']:.3g} (states and activations)" + (
        f"; host {host['per_process'] / 2**30:.3g} a process (libraries {host['baseline'] / 2**30:.3g})" if host else "")


def prediction_source(predicted: dict) -> str:
    """What a record's predicted step came from; records written before "source" existed: the efficiency used."""
    return predicted.get("source") or f"efficiency {predicted['efficiency']}"
