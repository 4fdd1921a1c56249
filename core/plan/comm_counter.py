"""Count the collectives and point-to-point transfers a process issues: every call that reaches PyTorch's
dispatcher as a c10d operation, whoever makes it (DDP's C++ reducer, FSDP2, DTensor's functional collectives,
DeepSpeed through torch.distributed, the pipeline schedules' send/recv). Nothing here knows a strategy: it
records what was asked for, so that the performance model's `comm` table can be checked against it.

What is counted is the logical operation the code asked for, with the tensor one rank hands to the call:
gloo carries out a reduce-scatter as a full all-reduce, but it is counted as the reduce_scatter it was."""

from collections import Counter

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

# c10d / functional-collective operation -> (kind, which argument holds what this rank hands over)
KINDS = {
    "allreduce_": ("all_reduce", 0), "allreduce_coalesced_": ("all_reduce", 0), "all_reduce": ("all_reduce", 0),
    "all_reduce_": ("all_reduce", 0), "all_reduce_coalesced": ("all_reduce", 0), "all_reduce_coalesced_": ("all_reduce", 0),
    "broadcast_": ("broadcast", 0), "broadcast": ("broadcast", 0),
    "_allgather_base_": ("all_gather", 1), "allgather_": ("all_gather", 1), "allgather_coalesced_": ("all_gather", 1),
    "allgather_into_tensor_coalesced_": ("all_gather", 1), "all_gather_into_tensor": ("all_gather", 0),
    "all_gather_into_tensor_coalesced": ("all_gather", 0), "all_gather_into_tensor_out": ("all_gather", 0),
    "_reduce_scatter_base_": ("reduce_scatter", 1), "reduce_scatter_": ("reduce_scatter", 1),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1), "reduce_scatter_tensor": ("reduce_scatter", 0),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", 0),
    "send": ("send", 0), "recv_": ("recv", 0), "recv_any_source_": ("recv", 0),
    "alltoall_": ("all_to_all", 1), "alltoall_base_": ("all_to_all", 1), "all_to_all_single": ("all_to_all", 0),
    "reduce_": ("reduce", 0), "gather_": ("gather", 1), "scatter_": ("scatter", 1), "barrier": ("barrier", None),
}


def nbytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(nbytes(v) for v in value)
    return 0


def group_size(args) -> int:
    """The size of the process group the call runs in: a ProcessGroup object (c10d) or a group name
    (functional collectives)."""
    for a in args:
        if isinstance(a, torch.ScriptObject):
            try:
                return dist.ProcessGroup.unbox(a).size()
            except (RuntimeError, TypeError):
                continue
        if isinstance(a, dist.ProcessGroup):
            return a.size()
    names = [a for a in args if isinstance(a, str)]
    if names:  # functional collectives name their group last
        from torch.distributed.distributed_c10d import _resolve_process_group

        return _resolve_process_group(names[-1]).size()
    return dist.get_world_size()


class CommCounter(TorchDispatchMode):
    """`with CommCounter() as c: ...` then `c.table()`: one row per (kind, group size, bytes) with its count."""

    def __init__(self):
        super().__init__()
        self.calls: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kind = KINDS.get(func._schema.name.split("::")[-1]) if func.namespace in ("c10d", "_c10d_functional") else None
        if kind is not None:
            name, arg = kind
            self.calls[(name, group_size(args), nbytes(args[arg]) if arg is not None else 0)] += 1
        return func(*args, **(kwargs or {}))

    def table(self) -> list[dict]:
        return [{"kind": k, "group_size": n, "bytes": b, "count": c} for (k, n, b), c in sorted(self.calls.items())]


def bytes_by_kind(table: list[dict], min_group: int = 2) -> dict:
    """Total bytes handed over per kind in groups of at least `min_group` ranks (a group of one moves nothing)."""
    total: Counter = Counter()
    for row in table:
        if row["group_size"] >= min_group and row["kind"] != "barrier":
            total[row["kind"]] += row["bytes"] * row["count"]
    return dict(total)
