"""The parallel layout of a run, one value built from its flags: how many processes, how they split the work
(data, tensor and pipeline parallel sizes), what is sharded (ZeRO's stage, FSDP) and what is offloaded. Every
other module reads these attributes; only this one reads the strategy's name.

It is built once, where the flags become a run's configuration, and travels with it (as torchtitan's ParallelDims):
both scripts' Config classes are `Parallel`, so every config, and every copy `dataclasses.replace` makes of one,
carries the layout of its own flags; a config read back from a checkpoint gets its own from `saved_config`.

    cfg.layout.world, .dp_size, .tp_size, .pp_size, .zero_stage, .offload, .deepspeed, .fsdp, .pipeline ...

    auto                 one process (or Fabric's default for several)
    ddp                  replicated model, gradients all-reduced (Fabric's DDPStrategy)
    dp                   LeNet-5 only: one process driving several GPUs (torch's DataParallel)
    deepspeed_stage_N    ZeRO-1/2/3: optimizer states (1), gradients (2), parameters (3) sharded over the processes
    ..._offload          ... and kept in CPU memory (or on NVMe with --nvme-path)
    fsdp                 FSDP2: parameters, gradients and optimizer states sharded block by block
    tp                   Megatron tensor parallel over all processes
    fsdp_tp              2-D: tensor parallel in groups of --tp-size, FSDP2 across them
    pp                   --pp-size pipeline stages, data parallel across pipelines
    tp_pp                plans only (published runs, core/plan/published.py): Megatron-LM's 3-D layout, tensor
                         parallel inside each of --pp-size stages, data parallel across pipelines; no script trains it
"""

import dataclasses
import functools
from types import SimpleNamespace

from core.run.flags import ConfigError

STRATEGIES = ("auto", "ddp", "fsdp", "tp", "fsdp_tp", "pp", "deepspeed_stage_1", "deepspeed_stage_2",
              "deepspeed_stage_3", "deepspeed_stage_2_offload", "deepspeed_stage_3_offload")
PLAN_ONLY = ("tp_pp",)  # layouts the performance model plans for published runs; no --strategy choice
TENSOR_PARALLEL, PIPELINE = ("tp", "fsdp_tp", "tp_pp"), ("pp", "tp_pp")


@dataclasses.dataclass(frozen=True)
class Layout:
    strategy: str
    world: int  # processes in all: --devices x --num-nodes
    tp_size: int = 1  # processes that split each layer's matrices
    pp_size: int = 1  # pipeline stages
    zero_stage: int = 0  # DeepSpeed ZeRO's stage (0: not DeepSpeed)
    offload: bool = False  # ZeRO's optimizer states (stage 3: parameters too) in CPU memory or on NVMe

    @property
    def dp_size(self) -> int:
        """Data-parallel replicas: each takes its own share of every global batch."""
        return self.world // (self.tp_size * self.pp_size)

    @property
    def deepspeed(self) -> bool:
        return self.zero_stage > 0

    @property
    def fsdp(self) -> bool:
        """FSDP2 shards parameters, gradients and optimizer states over the data-parallel processes."""
        return self.strategy in ("fsdp", "fsdp_tp")

    @property
    def tensor_parallel(self) -> bool:
        """Layers split across processes: DTensor parameters (which cannot share a fused kernel with plain ones)."""
        return self.strategy in TENSOR_PARALLEL

    @property
    def pipeline(self) -> bool:
        return self.strategy in PIPELINE

    @property
    def model_parallel(self) -> bool:
        """Run by Fabric's ModelParallelStrategy (device mesh, distributed checkpoints): fsdp, tp, fsdp_tp, pp."""
        return self.fsdp or self.tensor_parallel or self.pipeline

    @property
    def replicated(self) -> bool:
        """The whole model on every process (one process, DDP, DataParallel): Fabric clips its gradients."""
        return not (self.deepspeed or self.model_parallel)

    @property
    def threads(self) -> bool:
        """One process driving several GPUs in threads (DataParallel), where autocast must be entered per thread."""
        return self.strategy == "dp"

    @property
    def sharded_states(self) -> bool:
        """Optimizer states split over processes (ZeRO, FSDP, tp's shards, pp's stages): a checkpoint of this run
        cannot be resumed on another number of processes."""
        return not self.replicated

    def inner_mesh_size(self) -> int:
        """ModelParallelStrategy's second mesh dimension: tensor-parallel ranks, or pipeline stages under pp."""
        return self.pp_size if self.pipeline else self.tp_size


@functools.lru_cache(maxsize=None)
def layout(strategy: str, devices: int, num_nodes: int = 1, tp_size: int = 0, pp_size: int = 0) -> Layout:
    """The layout of these flags (--strategy, --devices, --num-nodes, --tp-size, --pp-size; 0: all processes)."""
    world = devices * num_nodes
    deepspeed = strategy.startswith("deepspeed")
    return Layout(strategy, world,
                  tp_size=(tp_size or world) if strategy in TENSOR_PARALLEL else 1,
                  pp_size=(pp_size or world) if strategy in PIPELINE else 1,
                  zero_stage=int(strategy.split("_")[2]) if deepspeed else 0,
                  offload=strategy.endswith("_offload"))


def of_flags(cfg) -> Layout:
    """The layout of a config's parallel flags (LeNet-5's have no --tp-size or --pp-size)."""
    return layout(cfg.strategy, cfg.devices, getattr(cfg, "num_nodes", 1), getattr(cfg, "tp_size", 0),
                  getattr(cfg, "pp_size", 0))


class Parallel:
    """A dataclass config whose layout is built from its flags when it is made: `cfg.layout`. A config is made anew
    (dataclasses.replace) rather than changed in place where its parallel flags change, so the two always agree."""

    def __post_init__(self):
        self.layout = of_flags(self)


def saved_config(config: dict) -> SimpleNamespace:
    """A run's config as its checkpoint saved it (config.json), with the layout it ran under."""
    saved = SimpleNamespace(**config)
    saved.layout = of_flags(saved)
    return saved


def check_sizes(cfg) -> None:
    """Refuse --tp-size and --pp-size that do not fit the strategy, the processes or the model, with the fix."""
    L = cfg.layout
    if cfg.tp_size and not L.tensor_parallel:
        raise ConfigError(f"--tp-size applies to --strategy tp or fsdp_tp, not {cfg.strategy}; drop it or pick one of those")
    if cfg.pp_size and not L.pipeline:
        raise ConfigError(f"--pp-size applies to --strategy pp, not {cfg.strategy}; drop it or use --strategy pp")
    if L.tensor_parallel:
        t = L.tp_size
        given = f"--tp-size {t}" + ("" if cfg.tp_size else f" (all {t} processes, as --tp-size is not given)")
        if cfg.n_head % t:
            raise ConfigError(f"{given} must divide the {cfg.n_head} attention heads (each rank holds whole heads); "
                              f"choose a divisor of {cfg.n_head}")
        if L.world % t:
            raise ConfigError(f"--tp-size {t} must divide the {L.world} processes; choose a divisor of {L.world}")
        if not L.fsdp and t != L.world:
            raise ConfigError(f"--strategy tp uses all {L.world} processes for one tensor-parallel group; for "
                              f"--tp-size {t} with data parallel across groups use --strategy fsdp_tp")
    if L.pipeline:
        p = L.pp_size
        given = f"--pp-size {p}" + ("" if cfg.pp_size else f" (all {p} processes, as --pp-size is not given)")
        if p > cfg.n_layer:
            raise ConfigError(f"{given} is larger than the {cfg.n_layer} layers: each stage needs at least one "
                              f"block; use at most {cfg.n_layer}")
        if L.world % p:
            raise ConfigError(f"--pp-size {p} must divide the {L.world} processes; choose a divisor of {L.world}")
        if cfg.grad_accum < p:
            raise ConfigError(f"--grad-accum {cfg.grad_accum}: a pipeline of {p} stages needs at least {p} "
                              f"micro-batches per step (they are what flows through the stages); use --grad-accum {p} or more")


def search_layouts(cfg) -> list[Layout]:
    """Every layout `--search` weighs on cfg's devices and nodes: one device alone; else data parallel, FSDP and each
    ZeRO stage (with offload), tensor parallel inside one node, fsdp_tp for each tensor-parallel group of a node's
    devices, and pp for each stage count that divides the processes."""
    devices, num_nodes, world, n_head, n_layer = cfg.devices, cfg.num_nodes, cfg.layout.world, cfg.n_head, cfg.n_layer
    names = ["ddp", "fsdp", *(s for s in STRATEGIES if s.startswith("deepspeed"))] if world > 1 else ["auto"]
    found = [(s, 0, 0) for s in names]  # (strategy, tp_size, pp_size)
    if 1 < world <= devices and n_head % world == 0:
        found.append(("tp", 0, 0))
    found += [("fsdp_tp", t, 0) for t in divisors(devices) if 1 < t < world and n_head % t == 0]
    found += [("pp", 0, p) for p in divisors(world) if 1 < p <= n_layer]
    return [layout(s, devices, num_nodes, t, p) for s, t, p in found]


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
