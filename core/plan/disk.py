"""The disk a run writes, planned before it starts as its memory is: each checkpoint (every rank's files together),
the checkpoints kept (--keep-last, one more while a save completes), the NVMe offload folder of ZeRO-Infinity, the
Hugging Face export and, for LeNet-5, TensorBoard's images of its first epoch; beside the free space of each folder's
file system. A run whose first checkpoint (with its NVMe folder, where that shares the file system) cannot fit is
refused before the model is built, naming what would fit; the checkpoints save checks the same figure before any rank
writes.

The sizes are what each strategy's writer puts on disk, counted from the parameters P and the parameter tensors T
(GPT-2: 4 + 12 per block): the weights in their training dtype, AdamW's two moments (plain SGD keeps none), ZeRO's
float32 master copy, the tied head written a second time where the model's state is saved per name (a distributed
checkpoint, a pipeline's last stage), and each writer's own cost per tensor. Measured on the tiny model under every
strategy and on `small` under ZeRO-Infinity (tests/test_faults.py compares them with real checkpoints).
"""

from pathlib import Path

from core.gpt.gpt_model import model_vocab
from core.plan.accounting import weight_bytes
from core.run.checkpoints import room_needed
from core.run.files import free_bytes, nearest_existing
from core.run.flags import ConfigError
from core.run.ranks import first_process

ZIP_RECORD = 300  # torch.save's zip archive: a record's headers and its pickle (280-434 bytes measured)
DCP_ITEM = 1_600  # a distributed checkpoint: each item a rank writes, with its share of .metadata (1,560 measured)
DEEPSPEED_FILES = 41_080  # zero_to_fp32.py, zero_to_torch.py and `latest`, copied into every DeepSpeed checkpoint
DEEPSPEED_RANK_FILE = 15_000  # ZeRO-3's per-rank model-states file: the partitioned parameters' placeholders
RUN_FILES = 256 * 2**10  # config.json, record.json and TensorBoard's events beside the checkpoints
# TensorBoard's figures of one LeNet-5 epoch (confusion matrix, mistakes, feature maps, histograms): 132 KiB measured
LENET_EPOCH_EVENTS = 160 * 2**10


def tensors(cfg) -> int:
    """GPT-2's parameter tensors: wte, wpe, the final LayerNorm's two, and 12 per block (the head is wte's)."""
    return 4 + 12 * cfg.n_layer


def checkpoint_bytes(cfg, P: int) -> float:
    """One checkpoint on disk, every rank's files together."""
    lay, T, m = cfg.layout, tensors(cfg), 2 if cfg.optimizer == "adamw" else 0
    word, head = weight_bytes(cfg), model_vocab(cfg) * cfg.n_embd
    steps = 4 * T * (m > 0)  # AdamW's step counters, one float a tensor
    if lay.deepspeed:  # module weights (ZeRO-3: placeholders per rank) and, per rank, the fp32 master and moments
        module = lay.world * DEEPSPEED_RANK_FILE if lay.zero_stage == 3 else word * P + 8 * ZIP_RECORD
        # ZeRO-Infinity copies its optimizer's swap files (no gradients) instead of writing the states itself
        optimizer = (4 + 4 * m) * P + lay.world * 14 * ZIP_RECORD
        return module + optimizer + DEEPSPEED_FILES
    states = (1 + m) * word * P + steps
    if lay.model_parallel and not lay.pipeline:  # a distributed checkpoint: the head saved by name, items per rank
        if lay.tensor_parallel:  # tp splits 6 tensors a block over its ranks, the rest once per FSDP2 shard
            items = lay.dp_size * (6 * cfg.n_layer * lay.tp_size + (T + 1 - 6 * cfg.n_layer))
        else:  # FSDP2 shards every tensor: each rank writes its part of each
            items = lay.world * (T + 1)
        return states + word * head + items * (2 + m) * DCP_ITEM
    if lay.pipeline:  # each stage its own file; the last stage holds the head as a copy of wte
        return states + (1 + m) * word * head + (T + 1 + lay.world * 1.5) * (2 + m) * ZIP_RECORD
    return states + (T * (2 + m) + 6) * ZIP_RECORD


def nvme_bytes(cfg, P: int) -> float:
    """ZeRO-Infinity's swap folder: the optimizer's float32 master weights, moments and gradients, and the weights in
    their training dtype (the tied embedding swapped twice). An upper bound: DeepSpeed keeps in memory what fits its
    CPU budget (the tiny model writes nothing there)."""
    if not cfg.nvme_path:
        return 0.0
    return 16 * P + weight_bytes(cfg) * (P + model_vocab(cfg) * cfg.n_embd)


def export_bytes(cfg, P: int, dtype_bytes: int) -> float:
    """The Hugging Face folder: safetensors of every weight (the head tied: once), config and tokenizer files."""
    return dtype_bytes * P + 64 * 2**10


def lenet_checkpoint_bytes(cfg, P: int, T: int) -> float:
    """One LeNet-5 checkpoint (rank 0 writes it whole): the weights in their dtype, AdamW's two moments and step
    counters or SGD's momentum, each tensor's zip record, the scheduler and the epochs' history (754 KB measured in
    float32 with AdamW, 61,706 parameters in 10 tensors)."""
    word = {"bf16-true": 2, "64-true": 8}.get(cfg.precision, 4)
    m = 2 if cfg.optimizer == "adamw" else 1
    return (1 + m) * word * P + T * (2 + m) * ZIP_RECORD + 4 * 2**10


def disk_plan(cfg, P: int, export_dtype_bytes: int = 0) -> dict:
    """A GPT run's: its checkpoints, the NVMe folder and the export."""
    export = export_bytes(cfg, P, export_dtype_bytes) if export_dtype_bytes else 0.0
    return plan_of(cfg, checkpoint_bytes(cfg, P), nvme_bytes(cfg, P), export)


def lenet_disk_plan(cfg, P: int, T: int) -> dict:
    """A LeNet-5 run's: its checkpoints, and TensorBoard's figures of the first epoch beside the first one."""
    return plan_of(cfg, lenet_checkpoint_bytes(cfg, P, T), events=LENET_EPOCH_EVENTS if cfg.tb_images else 0.0)


def plan_of(cfg, one: float, nvme: float = 0.0, export: float = 0.0, events: float = 0.0) -> dict:
    """What the run writes, where, and what each file system holds free: bytes of one checkpoint, of the checkpoints
    kept (one more while a save completes, before the oldest goes), of the NVMe folder and of the export."""
    run_dir = Path(cfg.out_dir) / cfg.run_name if cfg.run_name else Path(cfg.out_dir)  # unnamed: checked before Run names it
    nvme_path = getattr(cfg, "nvme_path", "")
    plan = {"checkpoint": one, "checkpoints_kept": cfg.keep_last * one, "while_saving": (cfg.keep_last + 1) * one,
            "nvme": nvme, "export": export, "events": events, "run_folder": str(run_dir)}
    # the first checkpoint, the run's files and the events written before it: what must fit before anything trains
    needs = {str(run_dir): room_needed(one) + RUN_FILES + events}
    if nvme_path:
        needs[nvme_path] = plan["nvme"]
    by_device: dict = {}
    for folder, need in needs.items():
        dev = nearest_existing(folder).stat().st_dev  # one entry per file system
        by_device.setdefault(dev, {"folders": [], "first": 0.0, "free": free_bytes(folder)})
        by_device[dev]["folders"].append(folder)
        by_device[dev]["first"] += need
    plan["file_systems"] = list(by_device.values())
    return plan


def mib(b: float) -> str:
    return f"{b / 2**30:,.2f} GiB" if b >= 2**30 else f"{b / 2**20:,.1f} MiB"


def print_disk_plan(cfg, plan: dict, out=print, local: bool = True) -> None:
    """The bytes (every rank's files: on a cluster, the shared file system's), and where `local` each folder's room."""
    out(f"  disk: each checkpoint {mib(plan['checkpoint'])}, {mib(plan['while_saving'])} with --keep-last "
        f"{cfg.keep_last} while a save completes" + (f"; NVMe folder {mib(plan['nvme'])}" if plan["nvme"] else "")
        + (f"; --export {mib(plan['export'])}" if plan["export"] else ""))
    for fs in plan["file_systems"] if local else []:
        out(f"    {', '.join(fs['folders'])}: the first checkpoint needs {mib(fs['first'])}, {mib(fs['free'])} free")


def check_disk(cfg, plan: dict) -> None:
    """Refuse a run whose first checkpoint cannot fit (with its NVMe folder where that shares the file system),
    naming what would; warn when the checkpoints kept would not."""
    for fs in plan["file_systems"]:
        if fs["first"] > fs["free"]:
            shown = " and ".join(fs["folders"])
            nvme = getattr(cfg, "nvme_path", "")
            raise ConfigError(f"the disk of {shown} has {mib(fs['free'])} free and this run's first checkpoint needs "
                              f"{mib(fs['first'])}" + (f" (with the NVMe folder's {mib(plan['nvme'])})" if plan["nvme"]
                                                        and nvme in fs["folders"] else "")
                              + (f" (with TensorBoard's figures of its first epoch, {mib(plan['events'])})"
                                 if plan.get("events") else "")
                              + f": nothing would be saved. Fix: free {mib(fs['first'] - fs['free'])} there, or give "
                              "--out-dir" + (" (and --nvme-path)" if nvme else "") + " on a disk with more room")
    run_fs = plan["file_systems"][0]
    others = run_fs["first"] - room_needed(plan["checkpoint"])
    fit = int((run_fs["free"] - others - room_needed(0)) // (1.1 * plan["checkpoint"])) if plan["checkpoint"] else 99
    if fit - 1 < cfg.keep_last and first_process():  # a save writes the new checkpoint before the oldest goes
        advice = (f"--keep-last {fit - 1} fits" if fit > 1 else
                  f"only the first fits: free {mib(room_needed(plan['checkpoint']))} more or give another --out-dir")
        print(f"warning: {run_fs['folders'][0]}'s disk holds {fit} checkpoint(s) of {mib(plan['checkpoint'])} "
              f"({mib(run_fs['free'])} free), not the {cfg.keep_last + 1} of --keep-last {cfg.keep_last} while a save "
              f"completes: a later save will stop the run; {advice}", flush=True)
