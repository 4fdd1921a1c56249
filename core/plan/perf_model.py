"""The performance model beside the memory plan (accounting.py): clusters as data, and for a model, a cluster
and a strategy, every transfer of one optimizer step, the step time (compute, exposed communication, pipeline
bubble, offload), tokens/s, MFU, the days to train on T tokens, and a search over strategies.

The transfers (`comm_table`) are what this repository's strategies issue, as counted by comm_counter.py on
gloo with torch 2.14 and DeepSpeed 0.19 (tests/test_gpt.py checks every strategy's bytes against the count).
Times follow from them: a collective over n ranks moving B bytes per rank costs latency plus B over the link's
bandwidth times the ring algorithm's factor (all-reduce 2(n-1)/n, all-gather and reduce-scatter (n-1)/n).
"""

import math
from dataclasses import dataclass, replace

import torch

from core.gpt import gpt_model
from core.gpt.strategies import fsdp_gathers_bf16
from core.plan import accounting, device_probe, disk, gpu_efficiency
from core.run import measurements
from core.run.files import write_atomic
from core.run.flags import ConfigError
from core.run.hardware import cpu_name
from core.run.layout import search_layouts
from core.run.ranks import usable_cores

GB = 1e9


@dataclass(frozen=True)
class Cluster:
    """One node type. Bandwidths are per device and direction, in bytes/s; peaks are dense, per device."""
    name: str
    device: str
    peak_flops: dict  # dtype kind -> FLOP/s
    memory_bytes: float
    devices_per_node: int
    intra_bw: float  # NVLink (or PCIe when the GPUs have no NVLink)
    intra_latency: float
    inter_bw: float  # the node's network per device (one NIC per GPU on DGX/HGX nodes)
    inter_latency: float
    pcie_bw: float  # host <-> device (offload)
    nvme_bw: float  # per node, read or write
    host_adam_params_per_s: float  # DeepSpeed's CPU Adam on the node's host, parameters per second per device
    efficiency: float  # without `kernels`: the achievable fraction of the peak in training matmuls (an input)
    overlap: bool = True  # communication on its own engine (NCCL on a GPU); CPU cores do both in turn
    shared_cores: bool = False  # CPU processes share one machine's cores: peak_flops is the machine's, and a rank
    # that waits (a pipeline stage in its bubble) leaves its cores to the others
    probe: str = ""  # "measure" or "cached": the step from device_probe's measurements (measured_step), taken
    measured_on: str = ""  # the device they are taken on: "cpu" (this machine's processes), "cuda:0" (its GPU)
    step_script: str = ""  # probe "measure": the training script whose step on the minimal model is timed (the
    # caller's own: a script stands above the plan, which never names one)
    source: str = ""
    kernels: str = ""  # a key of gpu_efficiency.CALIBRATION.devices: the step priced kernel by kernel on this GPU


H100_SXM = Cluster(
    "h100-sxm", "NVIDIA H100 SXM5 80GB", {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12}, 80 * GB, 8,
    intra_bw=450 * GB, intra_latency=10e-6, inter_bw=50 * GB, inter_latency=20e-6, pcie_bw=50 * GB, nvme_bw=12 * GB,
    host_adam_params_per_s=1.5e9, efficiency=0.45, kernels="h100",
    source="NVIDIA H100 datasheet: 989 TFLOPS bf16 dense, 67 fp32, NVLink 4 900 GB/s (450 each way), PCIe 5.0 x16 "
           "(50 GB/s achieved of 64), NDR InfiniBand 400 Gb/s per GPU (DGX H100)")
CLUSTERS = {
    "a100-sxm-80g": Cluster(
        "a100-sxm-80g", "NVIDIA A100 80GB SXM", {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12}, 80 * GB, 8,
        intra_bw=300 * GB, intra_latency=10e-6, inter_bw=25 * GB, inter_latency=20e-6, pcie_bw=25 * GB, nvme_bw=6 * GB,
        host_adam_params_per_s=1e9, efficiency=0.5, kernels="a100",
        source="NVIDIA A100 datasheet: 312 TFLOPS bf16 dense, 19.5 fp32 (TF32 off, torch's default), NVLink 3 600 GB/s "
               "(300 each way), PCIe 4.0 x16 (25 GB/s achieved of 32), HDR InfiniBand 200 Gb/s per GPU (DGX A100)"),
    "h100-sxm": H100_SXM,
    # H100's tensor cores and NVLink with more memory, or with another network: variants of the same node
    "h200-sxm": replace(
        H100_SXM, name="h200-sxm", device="NVIDIA H200 SXM 141GB", memory_bytes=141 * GB, kernels="h200",
        source="NVIDIA H200 datasheet: H100's tensor cores (989 TFLOPS bf16 dense) with 141 GB HBM3e; NVLink 4 and NDR "
               "400 Gb/s per GPU as DGX H200"),
    "h100-pcie": Cluster(
        "h100-pcie", "NVIDIA H100 PCIe 80GB", {"bf16": 756e12, "fp16": 756e12, "fp32": 51e12}, 80 * GB, 8,
        intra_bw=25 * GB, intra_latency=15e-6, inter_bw=25 * GB, inter_latency=20e-6, pcie_bw=50 * GB, nvme_bw=6 * GB,
        host_adam_params_per_s=1e9, efficiency=0.45, kernels="h100-pcie",
        source="NVIDIA H100 PCIe datasheet: 756 TFLOPS bf16 dense, 51 fp32; no NVLink bridge assumed, so GPUs meet "
               "through the PCIe switches and host (25 GB/s each way achieved); 200 Gb/s network per GPU"),
    "h100-sxm-eth": replace(
        H100_SXM, name="h100-sxm-eth", device="NVIDIA H100 SXM5 80GB, 100 GbE between nodes", inter_bw=12.5 * GB / 8,
        inter_latency=50e-6, nvme_bw=0,
        source="h100-sxm inside a node; one 100 Gb/s Ethernet link per node shared by its 8 GPUs, no local NVMe "
               "(a cloud node)"),
}
DEFAULT_GPU_CLUSTER = "a100-sxm-80g"  # the course's node: 2 x A100 80GB SXM with NVLink


class PlanError(ConfigError):
    """A cluster or a strategy the model cannot plan: the message names the flag and the fix."""


def cluster_named(name: str, precision: str = "32-true", step_script: str = "") -> Cluster:
    """A preset by name, or "cpu": this machine, measured (its fixed costs by running `step_script`)."""
    if name == "cpu":
        return measured_cpu_cluster(precision, step_script)
    if name not in CLUSTERS:
        raise PlanError(f"--cluster {name!r} is not known; known: {', '.join([*CLUSTERS, 'cpu'])} (cpu is measured "
                        "on this machine)")
    return CLUSTERS[name]


def measured_cpu_cluster(precision: str, step_script: str = "") -> Cluster:
    """This machine, measured (device_probe.py, cached): the matmul probe for the peak that MFU is against, the gloo
    link, and the step itself from the strategy's fixed cost and the work of the run's shape (measured_step)."""
    # a CPU plan's ranks share the machine's cores: one core's peak times the cores, whatever this process's own
    # threads. Measured on one thread, which another process's load slows by its share of a core; on every core
    # beside such a load OpenMP's threads wait on each other (42 GFLOP/s against 203 quiet: a plan's MFU of 144%)
    with measurements.threads(1):
        peak = accounting.measured_cpu_matmul_flops(precision) * usable_cores()
    return cpu_cluster(precision, peak, device_probe.gloo_link(), probe="measure", step_script=step_script)


def cpu_cluster(precision: str, peak: float, link: tuple[float, float] | None = None, probe: str = "",
                step_script: str = "") -> Cluster:
    """This machine with a measured matmul peak and, when given, a measured (latency s, bandwidth B/s) link;
    without one, communication is planned as free (a lower bound of the step). probe "measure" or "cached": the
    step from measured_step (measured now when not cached, or only when cached); "": compute at CPU_EFFICIENCY of the
    peak, a lower bound."""
    import psutil

    latency, bandwidth = link or (0.0, math.inf)
    kind = accounting.dtype_kind(precision)
    measured_link = (f"gloo all-reduce latency {latency * 1e6:.0f} us and bandwidth {bandwidth / GB:.2f} GB/s" if link
                     else "communication not counted")
    return Cluster("cpu", "this CPU (measured)", {kind: peak}, psutil.virtual_memory().total, 64,
                   intra_bw=bandwidth, intra_latency=latency, inter_bw=bandwidth, inter_latency=latency,
                   pcie_bw=math.inf, nvme_bw=2 * GB, host_adam_params_per_s=2e8, efficiency=CPU_EFFICIENCY,
                   overlap=False, shared_cores=True, probe=probe, measured_on="cpu", step_script=step_script,
                   source=f"measured: matmul {peak / 1e9:.1f} GFLOP/s ({kind}), {measured_link}")


# Without the step measurements (a candidate of --search, a run's own first estimate): the share of the matmul
# probe a large model's step reaches on CPU, used as a lower bound of the step
CPU_EFFICIENCY = 0.5


def measured_gpu_cluster(name: str, device: str = "cuda:0", probe: str = "measure", step_script: str = "") -> Cluster:
    """The preset of the GPU present here, its step measured on it (device_probe.py, cached per GPU model): the
    links between GPUs, PCIe, NVMe and the peak that MFU is against stay the preset's."""
    return replace(CLUSTERS[name], probe=probe, measured_on=device, step_script=step_script,
                   source=f"measured on this {torch.cuda.get_device_name(torch.device(device))}: the step's fixed cost, "
                          f"the block and head at the run's shape, memory bandwidth; the preset's: " + CLUSTERS[name].source)


def measured_step(cfg, cluster: Cluster, n_params: int, allow_measure: bool, exposed_comm_s: float = 0.0,
                  offload_s: float = 0.0) -> dict | None:
    """One optimizer step from device_probe's measurements of the device the run would use (this CPU's processes,
    or this GPU), or None when they are not cached and may not be measured: the strategy's fixed cost (its step on the
    minimal model), plus the work that grows with the model (block and head at the run's shape less the minimal
    one's, per micro-batch, split as the strategy splits the layers), plus the optimizer's sweep over this rank's
    states at memory bandwidth, plus the transfers: on a CPU every byte on the measured gloo link, on GPUs the
    preset's links as time_plan overlaps them (`exposed_comm_s`), and offload's (`offload_s`)."""
    lay, device = cfg.layout, cluster.measured_on or "cpu"
    n, ds, heads = measurements.rank_threads(cfg.devices), lay.deepspeed, device_probe.minimal_heads(cfg)
    minimal = replace(cfg, n_embd=device_probe.MINIMAL["n_embd_per_head"] * heads, n_head=heads,
                      seq_len=device_probe.MINIMAL["seq_len"], vocab_size=device_probe.MINIMAL["vocab_size"])
    fixed = device_probe.fixed_step(cfg, allow_measure, cluster.step_script, device)
    big = fixed and device_probe.block_and_head(gpt_model.gpt2_config(cfg), cfg.micro_batch_size, cfg.precision, ds, n,
                                                allow_measure, device)
    small = big and device_probe.block_and_head(gpt_model.gpt2_config(minimal), device_probe.MINIMAL["micro_batch_size"],
                                                cfg.precision, ds, n, allow_measure, device)
    bandwidth = small and device_probe.memory_bandwidth(n, allow_measure, device)
    if not bandwidth:
        return None
    block = max(big["block_s"] - small["block_s"], 0.0) * (4 / 3 if cfg.grad_checkpointing else 1)  # + a forward
    head = max(big["head_s"] - small["head_s"], 0.0)
    L, t, p, m = cfg.n_layer, lay.tp_size, lay.pp_size, cfg.grad_accum
    if lay.pipeline:  # every stage at its own cores: the busiest stage takes each of the m micro-batches,
        # the others each one on the way in or out (fill and drain); (m + p - 1) slots when the stages are equal
        stages = [(L // p + (i < L % p)) * block + (head if i == p - 1 else 0) for i in range(p)]
        work = m * max(stages) + sum(stages) - max(stages)
    else:
        work = m * (L * block / t + head)
    states = n_params if lay.replicated else n_params / lay.world
    optimizer = states * (28 if cfg.optimizer == "adamw" else 12) / bandwidth  # read p g m v, write p m v
    if cluster.shared_cores:  # this CPU: the calls' latency is in the fixed cost; its ranks wait on the link in turn
        comm = sum(algorithm(r)[0] * r["bytes"] * r["count"] for r in comm_table(cfg)) / cluster.intra_bw
        offload_s = offload_time(cfg, cluster, n_params)[1].get("nvme_s", 0.0)  # host memory is this machine's
    else:
        comm = exposed_comm_s
    return {"device": device, "shared_cores": cluster.shared_cores, "fixed_s": fixed, "work_s": work,
            "optimizer_s": optimizer, "link_s": comm, "offload_s": offload_s,
            "step_time_s": fixed + work + optimizer + comm + offload_s, "threads_per_rank": n}


# ----------------------------------------------------------------------------- the transfers of one step
def param_tensors(cfg) -> list[tuple[str, tuple]]:
    """GPT2LMHeadModel's parameters in registration order (HF Conv1D weights are [in, out]; lm_head is tied)."""
    h, V, S = cfg.n_embd, gpt_model.model_vocab(cfg), cfg.seq_len
    out = [("wte", (V, h)), ("wpe", (S, h))]
    for i in range(cfg.n_layer):
        out += [(f"h.{i}.{n}", s) for n, s in (
            ("ln_1.weight", (h,)), ("ln_1.bias", (h,)), ("attn.c_attn.weight", (h, 3 * h)), ("attn.c_attn.bias", (3 * h,)),
            ("attn.c_proj.weight", (h, h)), ("attn.c_proj.bias", (h,)), ("ln_2.weight", (h,)), ("ln_2.bias", (h,)),
            ("mlp.c_fc.weight", (h, 4 * h)), ("mlp.c_fc.bias", (4 * h,)), ("mlp.c_proj.weight", (4 * h, h)),
            ("mlp.c_proj.bias", (h,)))]
    out += [("ln_f.weight", (h,)), ("ln_f.bias", (h,))]
    return out if gpt_model.has_biases(cfg) else [(name, shape) for name, shape in out if not name.endswith(".bias")]


def numel(shape) -> int:
    return math.prod(shape)


def row(kind: str, group: int, nbytes: float, count: int, link: str = "", overlap: str = "") -> dict:
    return {"kind": kind, "group_size": group, "bytes": int(nbytes), "count": int(count), "link": link, "overlap": overlap}


def merge(rows: list[dict]) -> list[dict]:
    """Rows of the same (kind, group, bytes, link, overlap) added up; empty groups and counts dropped."""
    out: dict = {}
    for r in rows:
        if r["count"] <= 0 or r["group_size"] < 2:
            continue
        key = (r["kind"], r["group_size"], r["bytes"], r["link"], r["overlap"])
        out[key] = out.get(key, 0) + r["count"]
    return [row(k, n, b, c, link, ov) for (k, n, b, link, ov), c in sorted(out.items())]


def buckets(sizes: list[int], cap: float, first_cap: float | None = None) -> list[int]:
    """Greedy buckets in backward order (parameters last-to-first), closing a bucket once it reaches its cap
    (DDP: 1 MiB first, then 25 MiB), or before it would pass it (DeepSpeed's reduce bucket, in elements)."""
    out, current, limit = [], 0, first_cap or cap
    for size in reversed(sizes):
        if first_cap is None and current and current + size > limit:  # DeepSpeed
            out.append(current)
            current = 0
        current += size
        if first_cap is not None and current >= limit:  # DDP
            out.append(current)
            current, limit = 0, cap
    return out + ([current] if current else [])


def element_bytes(cfg) -> dict:
    """Bytes per element: gradients and parameters as the strategy keeps them, activations between blocks."""
    half = cfg.precision in ("16-mixed", "bf16-mixed", "bf16-true")
    weights = accounting.weight_bytes(cfg)
    matmul_out = 2 if half else 4  # autocast's matmuls return 16-bit tensors
    residual = 4 if accounting.runs_autocast(cfg) else matmul_out
    return {"grad": weights, "param": weights, "matmul_out": matmul_out, "residual": residual}


def comm_table(cfg) -> list[dict]:
    """Every collective and transfer global rank 0 issues in one optimizer step, as comm_counter counts them:
    {kind, group_size, bytes (the tensor this rank hands to one call), count}, plus the link it crosses and
    what it can overlap with. Groups of one rank move nothing and are left out."""
    w, m, lay = element_bytes(cfg), cfg.grad_accum, cfg.layout
    params = param_tensors(cfg)
    sizes = [numel(s) for _, s in params]
    dp, t, p = lay.dp_size, lay.tp_size, lay.pp_size
    dp_link, tp_link = link_of(cfg, "dp"), link_of(cfg, "tp")
    rows = []
    if lay.replicated:
        rows += [row("all_reduce", dp, b * w["grad"], 1, dp_link, "backward")
                 for b in buckets(sizes, 25 * 2**20 / w["grad"], 2**20 / w["grad"])]
    elif lay.deepspeed:
        rows += deepspeed_rows(cfg, params, dp, dp_link)
    elif lay.fsdp:
        rows += fsdp_rows(cfg, params, dp, t, dp_link)
    if lay.tensor_parallel:
        activation = gpt_model.positions(cfg) * cfg.micro_batch_size * cfg.n_embd * w["matmul_out"]
        # per block of this rank's stage: attention's and the MLP's row-parallel outputs in forward, the
        # column-parallel inputs' gradients in backward (no sequence parallelism)
        rows.append(row("all_reduce", t, activation, 4 * -(-cfg.n_layer // p) * m, tp_link, "none"))
        # the gradient norm: the float64 squares of the tensor-parallel shards, summed in one all-reduce
        rows.append(row("all_reduce", t, 8, 1, tp_link, "none"))
    if lay.pipeline:
        rows += pipeline_rows(cfg, params, p, dp, w)
    return merge(rows)


def link_of(cfg, group: str) -> str:
    """Which link a group crosses: tensor-parallel and pipeline groups are the innermost mesh dimension (inside a
    node when they fit); a data-parallel group spans nodes as soon as there is more than one."""
    lay = cfg.layout
    if group == "tp":
        return "intra" if lay.tp_size <= cfg.devices else "inter"
    if group == "pp":  # under 3-D layouts the stages follow the tensor-parallel groups of a node
        return "intra" if lay.tp_size * lay.pp_size <= cfg.devices else "inter"
    return "inter" if cfg.num_nodes > 1 and lay.dp_size > 1 else "intra"


def deepspeed_rows(cfg, params, dp, link) -> list[dict]:
    """ZeRO as DeepSpeed 0.19 issues it in our config (strategies.deepspeed_config) on gloo:
    ZeRO-1 all-reduces the gradient at the step's boundary and ZeRO-2 after every micro-batch (both ask for an
    all-reduce of the bucket, not a reduce-scatter), in reduce buckets of 2e8 elements; both all-gather each
    rank's updated partition per optimizer parameter group (padded to 2·dp elements). ZeRO-3 reduce-scatters the
    gradient after every micro-batch; parameters under stage3_param_persistence_threshold (1e5 elements) stay
    whole and are all-gathered once after the step; the others are all-gathered before each micro-batch (at
    once while they fit stage3_max_live_parameters, 1e9 elements; beyond it, again in backward: unverified)."""
    from core.gpt.strategies import deepspeed_config

    w, m, stage = element_bytes(cfg), cfg.grad_accum, cfg.layout.zero_stage
    sizes = [numel(s) for _, s in params]
    rows = []
    zero = deepspeed_config(cfg)["zero_optimization"]
    bucket = zero["reduce_bucket_size"]
    if stage in (1, 2):
        for b in buckets(sizes, bucket):
            rows.append(row("all_reduce", dp, b * w["grad"], m if stage == 2 else 1, link, "backward"))
        for group in optimizer_groups(cfg, params):
            padded = -(-group // (2 * dp)) * 2 * dp
            rows.append(row("all_gather", dp, padded // dp * w["param"], 1, link, "none"))
        # the gradient norm, one all-reduce per parameter group whether or not it clips (DeepSpeed 0.19 computes
        # it for every step: compute_grad_norm)
        rows.append(row("all_reduce", dp, 4, len(optimizer_groups(cfg, params)), link, "none"))
    else:
        threshold = zero.get("stage3_param_persistence_threshold", 1e5)
        for b in buckets(sizes, bucket):
            rows.append(row("reduce_scatter", dp, b * w["grad"], m, link, "backward"))
        persistent = [s for s in sizes if s <= threshold]
        rows += [row("all_gather", dp, -(-s // dp) * w["param"], 1, link, "none") for s in persistent]
        gathered = sum(-(-s // dp) for s in sizes if s > threshold)
        if gathered:
            held = sum(s for s in sizes if s > threshold)
            kept = held <= zero.get("stage3_max_live_parameters", 1e9) and zero.get("stage3_max_reuse_distance", 1e9) >= held
            times = 1 if kept else 2
            rows.append(row("all_gather", dp, gathered * w["param"], times * m, link, "forward"))
        # the gradient norm, once with or without clipping (the model is built under zero.Init): a float64 square on
        # the device, float32 when offloaded
        rows.append(row("all_reduce", dp, 4 if cfg.layout.offload else 8, 1, link, "none"))
    if cfg.precision == "16-mixed" or (cfg.precision in ("bf16-mixed", "bf16-true") and stage in (1, 2)):
        rows.append(row("all_reduce", dp, 1, 1, link, "none"))  # the overflow check of the 16-bit optimizer
    return rows


def optimizer_groups(cfg, params) -> list[int]:
    """Elements per optimizer parameter group: AdamW decays matrices only (two groups), SGD has one."""
    if cfg.optimizer == "sgd":
        return [sum(numel(s) for _, s in params)]
    matrices = sum(numel(s) for _, s in params if len(s) >= 2)
    return [matrices, sum(numel(s) for _, s in params) - matrices]


def fsdp_rows(cfg, params, dp, t, link) -> list[dict]:
    """FSDP2, one unit per block plus the root: a block is gathered before its forward and again before its
    backward (resharded after forward), the root once per micro-batch; each unit's gradient is reduce-scattered
    once per step (no_backward_sync defers it to the last micro-batch); under bf16-mixed the blocks are gathered in
    bf16, the root in float32, and gradients reduced in float32. The gradient norm sums the float64 squares
    of the shards in one all-reduce: one number, two under fsdp_tp (the matrices split by tensor parallel too, and
    the parameters it replicates)."""
    w, m = element_bytes(cfg), cfg.grad_accum

    def shard(shape):  # elements: dim 0 padded to a multiple of dp; tensor parallel has split the matrices first
        return -(-shape[0] // dp) * numel(shape[1:])

    def tp_split(name, shape):  # what tensor parallel leaves a rank, as nn.Linear [out, in] (strategies.conv1d_to_linear)
        if t == 1 or not name.startswith("h."):
            return shape
        if name.endswith(("c_attn.weight", "c_fc.weight")):  # column-parallel: the outputs split
            return (shape[1] // t, shape[0])
        if name.endswith(("c_attn.bias", "c_fc.bias")):
            return (shape[0] // t,)
        if name.endswith("c_proj.weight"):  # row-parallel: the inputs split, its bias replicated
            return (shape[1], shape[0] // t)
        return shape
    blocks: dict = {}
    root = 0
    for name, shape in params:
        size = shard(tp_split(name, shape))
        if name.startswith("h."):
            blocks[name.split(".")[1]] = blocks.get(name.split(".")[1], 0) + size
        else:
            root += size
    # the blocks are gathered in bf16 under bf16-mixed (strategies.apply_fsdp); gradients reduce in the weights' word
    gather = 2 if fsdp_gathers_bf16(cfg) else w["param"]
    rows = [row("all_gather", dp, root * w["param"], m, link, "forward"),
            row("reduce_scatter", dp, root * dp * w["grad"], 1, link, "backward")]
    for size in blocks.values():
        rows += [row("all_gather", dp, size * gather, 2 * m, link, "forward"),
                 row("reduce_scatter", dp, size * dp * w["grad"], 1, link, "backward")]
    rows.append(row("all_reduce", dp, 8 * (2 if t > 1 else 1), 1, link, "none"))
    return rows


def pipeline_rows(cfg, params, p, dp, w) -> list[dict]:
    """Rank 0 is the first stage: it sends each micro-batch's activations forward and receives their gradient
    back (the same bytes at every stage boundary), all-reduces the tied embedding's gradient with the last
    stage, then the gradient norm's float64 square over all ranks, and with data parallel its stage's
    gradients with the stage's replicas, one call per parameter."""
    m, link = cfg.grad_accum, link_of(cfg, "pp")
    # under 3-D layouts (plans only) each tensor-parallel rank sends its 1/t of the activation (Megatron's
    # scatter/gather) and holds 1/t of every matrix and of the vocabulary-parallel embedding
    t = cfg.layout.tp_size if cfg.layout.tensor_parallel else 1
    activation = gpt_model.positions(cfg) * cfg.micro_batch_size * cfg.n_embd * w["residual"] / t
    rows = [row("send", p, activation, m, link, "none"), row("recv", p, activation, m, link, "none"),
            row("all_reduce", 2 if p > 1 else 1, gpt_model.model_vocab(cfg) * cfg.n_embd * w["grad"] / t, 1, link, "none"),
            row("all_reduce", cfg.layout.world, 8, 1, link_of(cfg, "dp"), "none")]
    if dp > 1:
        from core.gpt.strategies import stage_blocks

        first = [s for n, s in params if not n.startswith("h.") and n in ("wte", "wpe")] + [
            s for n, s in params if n.startswith("h.") and int(n.split(".")[1]) in stage_blocks(cfg.n_layer, p, 0)]
        rows += [row("all_reduce", dp, numel(s) * w["grad"] / t, 1, link_of(cfg, "dp"), "none") for s in first]
    return rows


# ----------------------------------------------------------------------------- time
ALGORITHM = {  # (bandwidth factor on the bytes one rank hands over, latency hops): rings, except that an
    # all-reduce's latency is a tree's (2 log2 n hops), as NCCL picks a tree for small all-reduces
    "all_reduce": lambda n: (2 * (n - 1) / n, 2 * math.ceil(math.log2(n))),
    "all_gather": lambda n: (n - 1, n - 1),  # each rank hands its shard; n-1 shards arrive
    "reduce_scatter": lambda n: ((n - 1) / n, n - 1),
    "broadcast": lambda n: (1, 1), "send": lambda n: (1, 1), "recv": lambda n: (1, 1),
}


def algorithm(r: dict) -> tuple[float, int]:
    """(bandwidth factor, latency hops) of a transfer row's collective over its group."""
    return ALGORITHM.get(r["kind"], lambda n: (1, 1))(r["group_size"])


def transfer_time(r: dict, cluster: Cluster) -> float:
    """Seconds of one row: every call of it, latency and bandwidth of the link it crosses."""
    bw, lat = (cluster.intra_bw, cluster.intra_latency) if r["link"] == "intra" else (cluster.inter_bw, cluster.inter_latency)
    factor, hops = algorithm(r)
    return r["count"] * (hops * lat + factor * r["bytes"] / bw)


def flops_per_device(cfg, n_params: int) -> dict:
    """FLOPs of one optimizer step on the busiest device: the model's (6N + attention per token) and the
    recomputed forward under checkpointing, split as the strategy splits the work."""
    h, L, V = cfg.n_embd, cfg.n_layer, gpt_model.model_vocab(cfg)
    head = 6 * V * h  # the LM head's matmul per token (the embedding lookup costs no FLOPs)
    total = accounting.flops_per_token(cfg, n_params)["standard"]
    blocks = total - head
    recompute = (blocks / 3) if cfg.grad_checkpointing else 0  # one more forward of every block
    lay = cfg.layout
    dp, t, p, world = lay.dp_size, lay.tp_size, lay.pp_size, lay.world
    tokens = cfg.micro_batch_size * cfg.grad_accum * gpt_model.positions(cfg)  # per data-parallel rank
    if lay.pipeline:  # (under 3-D layouts, plans only, tensor parallel splits each stage's blocks and head)
        t = lay.tp_size if lay.tensor_parallel else 1
        per_block, head = (blocks + recompute) / L / t, head / t
        first = -(-L // p) * per_block  # the first stages take the extra block
        last = (L // p) * per_block + head
        busiest = max(first, last) if p > 1 else L * per_block + head
        return {"model": total * tokens * dp / world, "busiest": busiest * tokens,
                "per_micro_batch": busiest * tokens / cfg.grad_accum,
                "all_ranks": (L * per_block + head) * t * tokens * dp}
    # tensor parallel splits the blocks' matmuls; the LM head is replicated on every tensor-parallel rank
    busiest = ((blocks + recompute) / t + head) * tokens
    return {"model": total * tokens * dp / world, "busiest": busiest,
            "per_micro_batch": busiest / cfg.grad_accum, "all_ranks": busiest * world}


def offload_time(cfg, cluster: Cluster, n_params: int) -> tuple[float, dict]:
    """ZeRO-Offload per step and device: the gradient partition to the host and the updated 16/32-bit partition
    back over PCIe, the host's Adam, ZeRO-3's parameters fetched for every micro-batch's forward and backward,
    and NVMe: fp32 master weights and both moments read and written once."""
    lay = cfg.layout
    if not lay.offload:
        return 0.0, {}
    w, dp = element_bytes(cfg), lay.dp_size
    part = n_params / dp
    pcie = part * (w["grad"] + w["param"])
    if lay.zero_stage == 3:
        pcie += 2 * cfg.grad_accum * part * w["param"]
    nvme = 2 * 12 * part * cfg.devices if cfg.nvme_path else 0  # the node's devices share its drives
    parts = {"pcie_bytes": pcie, "pcie_s": pcie / cluster.pcie_bw, "host_adam_s": part / cluster.host_adam_params_per_s,
             "nvme_bytes": nvme, "nvme_s": nvme / cluster.nvme_bw}
    return parts["pcie_s"] + parts["host_adam_s"] + parts["nvme_s"], parts


def time_plan(cfg, cluster: Cluster, n_params: int, tokens: float = 0, framework: str | None = None,
              calibration=None) -> dict:
    """Step time broken down, throughput, MFU and the days to train on `tokens`. On a GPU preset the compute is
    the step's kernels at that GPU's rates (gpu_efficiency.py, its CALIBRATION unless `calibration` is given) for
    `framework` (default: this repository's own step, eager or --compile); elsewhere the FLOPs at the peak times
    the cluster's efficiency."""
    dtype = accounting.dtype_kind(cfg.precision)
    peak = cluster.peak_flops.get(dtype) or next(iter(cluster.peak_flops.values()))
    rate = peak * cluster.efficiency
    flops = flops_per_device(cfg, n_params)
    lay = cfg.layout
    m, p = cfg.grad_accum, lay.pp_size
    kernels = None
    if cluster.kernels and not cluster.probe:  # a GPU preset: what the step launches, each kernel at its rates (a
        # GPU present here measures its step instead, its transfers hidden behind the peak's compute as before)
        fw, cal = gpu_efficiency.framework_of(cfg, framework), calibration or gpu_efficiency.CALIBRATION
        kernels = gpu_efficiency.step_seconds(cfg, cal.devices[cluster.kernels], peak,
                                              gpu_efficiency.rank_states(cfg, n_params), gpt_model.model_vocab(cfg), fw,
                                              cal.host_op_s)
        kernels["framework"] = fw.name
        compute = kernels["compute_s"]
        bubble = (p - 1) * kernels["per_micro_batch_s"] if lay.pipeline else 0.0
    elif cluster.shared_cores:  # the machine's cores do every rank's work, a waiting stage's cores included
        compute, bubble = flops["all_ranks"] / rate, 0.0
    else:
        compute = flops["busiest"] / rate
        bubble = (p - 1) * flops["per_micro_batch"] / rate if lay.pipeline else 0.0
    comm = comm_table(cfg)
    comm_s, exposed = exposed_comm(comm, compute, cluster)
    offload, offload_parts = offload_time(cfg, cluster, n_params)
    step = compute + bubble + exposed + offload
    measured = (measured_step(cfg, cluster, n_params, cluster.probe == "measure", exposed, offload) if cluster.probe
                else None)
    if cluster.probe and measured is None and cluster.kernels:  # a GPU here without its measurements: its preset's
        return time_plan(cfg, replace(cluster, probe=""), n_params, tokens, framework, calibration)  # kernels
    if measured:
        step = measured["step_time_s"]
    samples_per_step = cfg.micro_batch_size * m * lay.dp_size
    tokens_per_step = samples_per_step * gpt_model.positions(cfg)  # each window predicts its next seq_len - 1 tokens
    tokens_s = tokens_per_step / step
    world = lay.world
    model_flops = accounting.flops_per_token(cfg, n_params)["standard"]
    # the share of the peak the compute reaches: an input of the cluster, or what the kernels came to
    efficiency = flops["busiest"] / (compute * peak) if kernels else cluster.efficiency
    out = {"cluster": cluster.name, "device": cluster.device, "peak_flops": peak, "efficiency": efficiency,
           "kernels": kernels,
           "step_time_s": step, "compute_s": compute, "comm_s": comm_s, "comm_exposed_s": exposed, "bubble_s": bubble,
           "offload_s": offload, "offload": offload_parts, "tokens_per_step": tokens_per_step, "tokens_per_s": tokens_s,
           "mfu": model_flops * tokens_per_step / step / ((1 if cluster.shared_cores else world) * peak),
           "comm": comm,
           "comm_bytes": sum(r["bytes"] * r["count"] for r in comm), "measured_step": measured,
           "measured_on": cluster.measured_on}
    if tokens:
        out.update(tokens=tokens, train_days=tokens / tokens_s / 86400, device_hours=tokens / tokens_s / 3600 * world)
    return out


def exposed_comm(comm: list[dict], compute: float, cluster: Cluster) -> tuple[float, float]:
    """(seconds of every transfer of the step, the seconds of them the compute does not hide); each row of `comm`
    gets its own time_s."""
    by_overlap = {"none": 0.0, "backward": 0.0, "forward": 0.0}
    for r in comm:
        r["time_s"] = transfer_time(r, cluster)
        by_overlap[r["overlap"]] += r["time_s"]
    comm_s = sum(by_overlap.values())
    if not cluster.overlap:
        return comm_s, comm_s
    hidden_bwd = min(by_overlap["backward"], 2 / 3 * compute)  # gradient reductions hide behind backward (2/3 of
    hidden_fwd = min(by_overlap["forward"], compute - hidden_bwd)  # compute), gathers behind the rest
    return comm_s, comm_s - hidden_bwd - hidden_fwd


# ----------------------------------------------------------------------------- plans and the search
def cluster_of_gpu(name: str) -> str | None:
    chip = accounting.gpu_chip(name)
    return {"a100": "a100-sxm-80g", "h100 sxm": "h100-sxm", "h200 sxm": "h200-sxm", "h100 pcie": "h100-pcie"}.get(chip)


def present_gpu_cluster() -> str | None:
    """The preset of the GPU this process sees, when it has one."""
    return cluster_of_gpu(torch.cuda.get_device_name(0)) if torch.cuda.is_available() else None


def check_plannable(cfg, cluster: Cluster) -> None:
    """Refuse what the cluster cannot run, with the flag and the fix."""
    if cfg.devices > cluster.devices_per_node:  # --devices is per node: the same devices in all, in whole nodes
        nodes = -(-cfg.devices * cfg.num_nodes // cluster.devices_per_node)
        raise PlanError(f"--devices {cfg.devices} (a node's): a {cluster.name} node has {cluster.devices_per_node} "
                        f"devices; use --devices {cluster.devices_per_node} --num-nodes {nodes}")
    if cfg.layout.tp_size > cfg.devices:
        raise PlanError(f"tensor parallel over {cfg.layout.tp_size} devices is larger than a node's {cfg.devices}: its "
                        "all-reduces in every block need the node's NVLink; use --strategy fsdp_tp --tp-size "
                        f"{cfg.devices} (or fewer) so that data parallel spans the nodes")
    if cfg.nvme_path and cluster.nvme_bw <= 0:
        raise PlanError(f"--nvme-path: a {cluster.name} node has no NVMe drive in its preset; offload to CPU memory "
                        "(drop --nvme-path) or plan for another --cluster")


def full_plan(cfg, cluster: Cluster, n_params: int, attn: str, tokens: float = 0) -> dict:
    """Memory (accounting.memory_plan) and time together, as --plan prints and --plan-json writes them."""
    gpu = cluster.name != "cpu"
    plan = accounting.memory_plan(replace(cfg, accelerator="cuda" if gpu else "cpu"), n_params, attn)
    t = time_plan(cfg, cluster, n_params, tokens)
    # on a CPU every process shares the host's memory; a GPU has its own
    need = plan["total"] * (1 if gpu else cfg.devices)
    fits = bool(need < 0.9 * cluster.memory_bytes)
    keys = ("step_time_s", "compute_s", "comm_s", "comm_exposed_s", "bubble_s", "offload_s", "tokens_per_s", "mfu",
            "train_days", "device_hours", "comm")
    return {**plan, "memory_per_device_bytes": plan["total"], "memory_available_bytes": cluster.memory_bytes,
            "fits": fits, **{k: t[k] for k in keys if k in t}, "time": t, "cluster_source": cluster.source}


def write_json(path: str, result: dict) -> None:
    import json

    write_atomic(path, json.dumps(result, indent=1, default=float).encode())  # a reader never sees half a plan


def candidates(cfg, cluster: Cluster, global_batch: int):
    """Every strategy x tp x pp x micro-batch x checkpointing x offload this cluster and batch allow."""
    for lay in search_layouts(cfg):
        t, p = lay.tp_size if lay.tensor_parallel and lay.fsdp else 0, lay.pp_size if lay.pipeline else 0
        for micro in (1, 2, 4, 8, 16, 32, 64):
            if global_batch % (micro * lay.dp_size):
                continue
            accum = global_batch // (micro * lay.dp_size)
            if lay.pipeline and accum < lay.pp_size:
                continue
            for ckpt in (False, True):
                for path in ("", "/nvme") if lay.offload and lay.zero_stage == 3 and cluster.nvme_bw > 0 else ("",):
                    yield replace(cfg, strategy=lay.strategy, tp_size=t, pp_size=p, micro_batch_size=micro,
                                  grad_accum=accum, grad_checkpointing=ckpt, nvme_path=path, search=False)


def search(cfg, cluster: Cluster) -> list[dict]:
    """Every candidate's plan; those that fit, fastest first. Nothing fits: a PlanError with the smallest."""
    world = cfg.layout.world
    global_batch = cfg.micro_batch_size * cfg.grad_accum * cfg.layout.dp_size
    n_params, attn = gpt_model.count_parameters(cfg)
    if cluster.probe:  # measuring every candidate's fixed cost would run each: what is cached, else the lower bound
        cluster = replace(cluster, probe="cached")
    rows, smallest = [], None
    for c in candidates(cfg, cluster, global_batch):
        lay = c.layout
        if c.precision == "16-mixed" and lay.model_parallel:
            continue  # refused by fabric_gpt.py
        plan = full_plan(c, cluster, n_params, attn, cfg.tokens)
        entry = {"n_params": n_params, "strategy": c.strategy, "tp": lay.tp_size, "pp": lay.pp_size, "dp": lay.dp_size,
                 "micro_batch": c.micro_batch_size, "grad_accum": c.grad_accum, "checkpointing": c.grad_checkpointing,
                 "nvme": bool(c.nvme_path), "memory_per_device_bytes": plan["total"], "fits": plan["fits"],
                 **{k: plan[k] for k in ("step_time_s", "compute_s", "comm_s", "comm_exposed_s", "bubble_s", "offload_s",
                                         "tokens_per_s", "mfu", "train_days", "device_hours") if k in plan}}
        if smallest is None or plan["total"] < smallest[1]["total"]:
            smallest = (entry, plan)
        if plan["fits"]:
            rows.append(entry)
    if not rows:
        entry, plan = smallest
        parts = ", ".join(f"{k} {plan[k] / 2**30:.1f}" for k in ("params", "grads", "optimizer", "master", "gathered_layer",
                                                                 "activations") if plan[k])
        raise PlanError(f"{model_label(cfg, n_params)} fits nowhere on {world} x {cluster.device} "
                        f"at a global batch of {global_batch}: the smallest plan, {entry['strategy']} (tp {entry['tp']}, "
                        f"pp {entry['pp']}, micro-batch {entry['micro_batch']}, checkpointing {entry['checkpointing']}), "
                        f"needs {plan['total'] / 2**30:.1f} GiB per device ({parts} GiB) of "
                        f"{0.9 * cluster.memory_bytes / 2**30:.1f} usable. Add devices or nodes, or a smaller micro-batch")
    rows.sort(key=lambda r: (-round(r["tokens_per_s"], 6), r["memory_per_device_bytes"]))  # ties: less memory first
    return rows


def model_label(cfg, n_params: int) -> str:
    """The model as planned: its preset's name when it has the preset's shape, else named by its size; either way
    with the shape (any dimension may have been overridden)."""
    shape = (cfg.n_embd, cfg.n_layer, cfg.n_head, cfg.seq_len, cfg.vocab_size)
    name = f"the {cfg.model} preset" if gpt_model.PRESETS[cfg.model] == shape else \
        f"a {n_params / 1e9:.3g}B-parameter GPT-2"
    return (f"{name} (hidden {cfg.n_embd}, {cfg.n_layer} layers, {cfg.n_head} heads, sequence {cfg.seq_len}, "
            f"vocabulary {cfg.vocab_size}: {n_params / 1e9:.3g}B parameters)")


def print_search(cfg, cluster: Cluster, rows: list[dict], top: int = 12) -> None:
    rates = (f"each step's kernels at this GPU's rates (gpu_efficiency.py, {gpu_efficiency.framework_of(cfg).name})"
             if cluster.kernels else f"peak x efficiency {cluster.efficiency:.2f}")
    print(f"search: {model_label(cfg, rows[0]['n_params'])} on {cfg.num_nodes} x {cfg.devices} {cluster.device}, {cfg.precision}, global batch "
          f"{rows[0]['micro_batch'] * rows[0]['grad_accum'] * rows[0]['dp']} x {cfg.seq_len} tokens; {rates}; "
          f"{len(rows)} plans fit, fastest first (predicted)")
    days = "train_days" in rows[0]
    print(f"  {'strategy':<27}{'tp':>3}{'pp':>3}{'dp':>5}{'micro':>6}{'accum':>6} ckpt  {'GiB/dev':>8}{'step ms':>10}"
          f"{'tokens/s':>12}{'MFU':>6}" + ("    days" if days else ""))
    for r in rows[:top]:
        name = r["strategy"] + (" (nvme)" if r["nvme"] else "")
        print(f"  {name:<27}{r['tp']:>3}{r['pp']:>3}{r['dp']:>5}{r['micro_batch']:>6}{r['grad_accum']:>6} "
              f"{'yes ' if r['checkpointing'] else 'no  '} {r['memory_per_device_bytes'] / 2**30:>8.1f}"
              f"{1e3 * r['step_time_s']:>10.1f}{r['tokens_per_s']:>12,.0f}{100 * r['mfu']:>5.1f}%"
              + (f"{r['train_days']:>8.1f}" if days else ""))
    print_per_strategy(rows, single_device_baseline(cfg, cluster))


def single_device_baseline(cfg, cluster: Cluster) -> dict | None:
    """The fastest plan that trains the same global batch on one device, or None when nothing fits one."""
    global_batch = cfg.micro_batch_size * cfg.grad_accum * cfg.layout.dp_size
    one = replace(cfg, devices=1, num_nodes=1, strategy="auto", tp_size=0, pp_size=0, micro_batch_size=global_batch,
                  grad_accum=1, nvme_path="")
    try:
        return search(one, cluster)[0]
    except PlanError:
        return None


def print_per_strategy(rows: list[dict], single: dict | None) -> None:
    """The bonus table: each strategy's fastest plan, its memory and its speed-up over one device."""
    best: dict = {}
    for r in rows:
        best.setdefault(r["strategy"] + (" (nvme)" if r["nvme"] else ""), r)
    base = single["tokens_per_s"] if single else None
    print("  each strategy's fastest plan against one device" + (
        f" ({single['tokens_per_s']:,.0f} tokens/s at micro-batch {single['micro_batch']} x {single['grad_accum']}"
        f"{', checkpointing' if single['checkpointing'] else ''}):" if single else " (nothing fits one device):"))
    for name, r in best.items():
        speedup = f"{r['tokens_per_s'] / base:5.2f}x" if base else "  n/a"
        print(f"    {name:<31}{r['memory_per_device_bytes'] / 2**30:6.1f} GiB {1e3 * r['step_time_s']:9.1f} ms "
              f"{r['tokens_per_s']:>10,.0f} tokens/s  {speedup}  (tp {r['tp']}, pp {r['pp']}, micro {r['micro_batch']} x "
              f"{r['grad_accum']}{', ckpt' if r['checkpointing'] else ''})")


# ----------------------------------------------------------------------------- --plan and --search, printed
def plan_cluster(cfg, step_script: str = "") -> Cluster:
    """--cluster, else this CPU under --accelerator cpu, else the visible GPU's node type, else the course's node;
    the node type of the GPU present here has its step measured on it. --device-memory-gb overrides memory."""
    name = cfg.cluster or ("cpu" if cfg.accelerator == "cpu" else "")
    here = present_gpu_cluster() if cfg.accelerator != "cpu" else None
    cluster = cluster_named(name or here or DEFAULT_GPU_CLUSTER, cfg.precision, step_script)
    if here and cluster.name == here:
        cluster = measured_gpu_cluster(here, step_script=step_script)
    if cfg.device_memory_gb:
        cluster = replace(cluster, memory_bytes=cfg.device_memory_gb * 2**30)
    return cluster


def print_plan(cfg, plan: dict) -> None:
    gib = lambda b: f"{b / 2**30:9.2f} GiB" if b >= 2**30 or b == 0 else f"{b / 2**20:9.2f} MiB"  # noqa: E731
    lay = cfg.layout
    print(f"memory plan: {cfg.model} ({plan['n_params'] / 1e6:,.1f}M parameters), {cfg.strategy}, {cfg.precision}, "
          f"{lay.world} device(s) (dp {lay.dp_size}, tp {lay.tp_size}, pp {lay.pp_size}), micro-batch "
          f"{cfg.micro_batch_size} x {cfg.seq_len} tokens")
    levers = [f"compiled ({cfg.compile_scope})" if cfg.compile else "", "chunked loss" if cfg.chunked_loss else "",
              f"vocabulary padded to {gpt_model.model_vocab(cfg):,}" if gpt_model.model_vocab(cfg) > cfg.vocab_size else ""]
    if any(levers):
        print(f"  levers: {', '.join(lever for lever in levers if lever)}")
    for key in ("params", "grads", "optimizer", "master", "ddp_buckets", "gathered_layer"):
        if plan[key] or key in ("params", "grads", "optimizer"):
            print(f"  {key:<26}{gib(plan[key])}")
    print(f"  {'activations (no ckpt)':<26}{gib(plan['activations_full'])}")
    print(f"  {'activations (checkpointed)':<26}{gib(plan['activations_checkpointed'])}")
    print(f"  {'total per device':<26}{gib(plan['total'])}   (activations {'with' if cfg.grad_checkpointing else 'without'} checkpointing)")
    if plan["deepspeed_estimate"] is not None:
        ours = plan["params"] + plan["grads"] + plan["optimizer"] + plan["gathered_layer"]
        print(f"  model states: ours {gib(ours)}, DeepSpeed's estimator {gib(plan['deepspeed_estimate'])}")
    if plan["time"]["cluster"] != "cpu":  # on a CPU the devices are processes: the host line below decides
        print(f"  {'fits' if plan['fits'] else 'does NOT fit'} in {plan['memory_available_bytes'] / 2**30:.0f} GiB per device "
              f"of {plan['time']['device']} (keeping 10% for buffers and fragmentation)")


def print_time_plan(cfg, t: dict) -> None:
    ms = lambda s: f"{1e3 * s:10.2f} ms"  # noqa: E731
    m = t["measured_step"]
    if m and m["shared_cores"]:  # this CPU, from its measurements (device_probe.py)
        print(f"time plan on this CPU ({cpu_name()}), {cfg.devices} process(es) of {m['threads_per_rank']} "
              f"thread(s), from its measurements (device_probe.py, cached in {measurements.cache_file()}):")
        print_measured_parts(m, ms)
        print(f"  {'step':<26}{ms(t['step_time_s'])}   {t['tokens_per_s']:,.0f} tokens/s, MFU {100 * t['mfu']:.1f}% of "
              f"{t['peak_flops'] / 1e9:.0f} GFLOP/s (the matmul probe)")
        return
    if m:  # the GPU present here, measured; what one GPU cannot measure is the preset's
        print(f"time plan on {cfg.num_nodes} x {cfg.devices} {t['device']} ({t['cluster']}), the step from measurements "
              f"on this machine's {m['device']} (device_probe.py, cached in {measurements.cache_file()}):")
        print_measured_parts(m, ms)
        print(f"  {'step':<26}{ms(t['step_time_s'])}   {t['tokens_per_s']:,.0f} tokens/s, MFU {100 * t['mfu']:.1f}% of "
              f"{t['peak_flops'] / 1e12:.0f} TFLOPS (the datasheet's)")
        print("  measured here: the fixed cost, the block and head at this shape, memory bandwidth; assumed (the "
              f"preset's): the peak, the links between GPUs{', PCIe, the host Adam, NVMe' if t['offload_s'] else ''}")
        print_transfers(t)
        return
    why = ("its measurements failed (the warning above)" if t["measured_on"] else
           "this node is not here; on one, the step is measured on its GPU")
    k = t["kernels"]
    if k:  # a GPU preset: the step's kernels at its rates, calibrated on published runs
        fw = gpu_efficiency.FRAMEWORKS[k["framework"]]
        device = gpu_efficiency.CALIBRATION.devices[cluster_kernels(t["cluster"])]
        print(f"time plan on {cfg.num_nodes} x {cfg.devices} {t['device']} ({t['cluster']}): each kernel of the step "
              f"priced on it (gpu_efficiency.py), framework {fw.name}: {fw.about}")
        print(f"  rates: {gpu_efficiency.describe(device)}; peak {t['peak_flops'] / 1e12:.0f} TFLOPS")
        print(f"  measured: nothing ({why}); assumed (the preset's datasheet figures): the peak, HBM, every "
              "link's bandwidth and latency")
        print(f"  {'compute':<26}{ms(t['compute_s'])}   (GPU {ms(k['gpu_s']).strip()}, host {ms(k['host_s']).strip()}: "
              f"{'the host issuing kernels' if k['host_bound'] else 'the GPU'} sets it; {100 * t['efficiency']:.1f}% "
              "of the peak)")
    else:
        print(f"time plan on {cfg.num_nodes} x {cfg.devices} {t['device']} ({t['cluster']}): peak "
              f"{t['peak_flops'] / 1e12:.1f} TFLOPS x efficiency {t['efficiency']:.2f} (an input, --cluster's)")
        print(f"  measured: nothing ({why}); assumed (the preset's datasheet figures): the peak, the efficiency, every "
              "link's bandwidth and latency")
        print(f"  {'compute':<26}{ms(t['compute_s'])}")
    print(f"  {'communication':<26}{ms(t['comm_s'])}   ({ms(t['comm_exposed_s']).strip()} not hidden behind compute)")
    if t["bubble_s"]:
        print(f"  {'pipeline bubble':<26}{ms(t['bubble_s'])}   ((p-1)/(m+p-1) of the pipeline's time, m = {cfg.grad_accum})")
    if t["offload_s"]:
        parts = ", ".join(f"{k} {v:.3g}" for k, v in t["offload"].items())
        print(f"  {'offload':<26}{ms(t['offload_s'])}   ({parts})")
    print(f"  {'step':<26}{ms(t['step_time_s'])}   {t['tokens_per_s']:,.0f} tokens/s, MFU {100 * t['mfu']:.1f}%")
    if "train_days" in t:
        print(f"  {t['tokens']:.3g} tokens: {t['train_days']:,.1f} days, {t['device_hours']:,.0f} device-hours")
    print_transfers(t)


def cluster_kernels(name: str) -> str:
    return CLUSTERS[name].kernels


def print_measured_parts(m: dict, ms) -> None:
    for key, label in (("fixed_s", "fixed (minimal model)"), ("work_s", "work of this shape"),
                       ("optimizer_s", "optimizer sweep"),
                       ("link_s", "bytes on the gloo link" if m["shared_cores"] else "transfers not hidden"),
                       ("offload_s", "NVMe" if m["shared_cores"] else "offload")):
        if key != "offload_s" or m[key]:
            print(f"  {label:<26}{ms(m[key])}")


def print_transfers(t: dict) -> None:
    if t["comm"]:
        print(f"  transfers of one optimizer step (rank 0): {'kind':<15}{'group':>6}{'bytes':>14}{'count':>7}  link   overlaps")
        for r in t["comm"]:
            print(f"  {'':<42}{r['kind']:<15}{r['group_size']:>6}{r['bytes']:>14,}{r['count']:>7}  {r['link']:<6} {r['overlap']}")


def plan(cfg, step_script: str = "", beside=None) -> dict:
    """--plan and --search: memory and time without training, printed and, with --plan-json, written. On this CPU
    the step is measured by running `step_script` (the training script asking) on the minimal model. `beside(cfg,
    cluster, strategy)`: what the caller prints after the plan (fabric_gpt.py: the nearest published run), a dict
    added to the result."""
    cluster = plan_cluster(cfg, step_script)
    check_plannable(cfg, cluster)
    if cfg.search:
        rows = search(cfg, cluster)
        print_search(cfg, cluster, rows)
        result = {"search": rows}
        fastest = rows[0]
    else:
        n_params, attn = gpt_model.count_parameters(cfg)
        result = full_plan(cfg, cluster, n_params, attn, cfg.tokens)
        host = accounting.host_plan(cfg, cluster.name != "cpu" and cfg.accelerator != "cpu", (n_params, attn))
        available = accounting.host_available(cfg)
        result.update(host_memory_per_process_bytes=host["per_process"], host_memory_machine_bytes=host["machine"],
                      host_memory_available_bytes=available, host_fits=accounting.host_fits(host["machine"], available))
        if cluster.name == "cpu":  # the devices are this machine's processes: their memory is the host's
            result["fits"] = result["host_fits"]
        print_plan(cfg, result)
        # on a cluster of GPUs the host is each node's, whose memory no preset holds: this machine's is no measure
        verdict = (f"on this machine: {'fits' if result['host_fits'] else 'does NOT fit'} in {available / 2**30:.1f} GiB "
                   "available") if cluster.name == "cpu" else "per node of the cluster (compare with its host memory)"
        print(f"  host memory: {host['per_process'] / 2**30:.2f} GiB per process (libraries {host['baseline'] / 2**30:.2f}, "
              f"build {host['construction'] / 2**30:.2f}, training {host['training'] / 2**30:.2f}, checkpoint "
              f"{host['checkpoint'] / 2**30:.2f}), {host['machine'] / 2**30:.2f} GiB for {cfg.devices} process(es) {verdict}")
        result["disk"] = disk.disk_plan(cfg, n_params)  # the bytes are the cluster's; the free space this machine's
        disk.print_disk_plan(cfg, result["disk"], local=cluster.name == "cpu")
        print_time_plan(cfg, result["time"])
        fastest = {"strategy": cfg.strategy}
    if beside:
        result.update(beside(cfg, cluster, fastest["strategy"]))
    if cfg.plan_json:
        write_json(cfg.plan_json, result)
    return result
