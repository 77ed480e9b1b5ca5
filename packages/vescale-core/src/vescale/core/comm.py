"""The one collective counter: calls and bytes per collective, per mesh dimension.

:class:`CommCounter` (``with count_comms(mesh) as c: ...``) counts every collective that reaches the dispatcher inside
the block, forward and backward alike: the functional collectives DTensor issues and the c10d ops that eager
``torch.distributed`` calls (DDP buckets, ZeRO, checkpoint) dispatch to. For each it records

- the call, under its ``torch.distributed`` name (``all_reduce``, ``all_gather_into_tensor``,
  ``reduce_scatter_tensor``, ``all_to_all_single``, ``broadcast``, ...);
- the bytes this rank hands to it: the size of its input tensor(s) on this rank (for an all-gather, this rank's shard,
  not the gathered result);
- when a mesh is given, the mesh dimension(s) whose process group it ran on (``"tp"``, ``"dp"``; ``"dp,tp"`` for the
  world group of a dp x tp mesh; ``"other"`` for any other group).

Strict mode, the planner, the benchmarks and the training CLI's ``summary.json`` all count with it, so their numbers
mean the same thing.

Why a plain ``TorchDispatchMode`` and not torch's ``CommDebugMode``: the latter also tracks modules, which installs
module forward/backward hooks; those hooks changed how some models' forward or backward ran (in-place ops on hooked
outputs). This counter installs nothing on modules, so it cannot change what a model computes.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

from vescale.core.torch_internals import HigherOrderOperator, TorchDispatchMode, op_schema

__all__ = ["CommCounter", "count_comms", "collective_name"]

# c10d's op names for what torch.distributed calls them
_C10D_NAMES = {"allgather_base": "all_gather_into_tensor", "allgather": "all_gather", "allreduce": "all_reduce",
               "reduce_scatter_base": "reduce_scatter_tensor", "reduce_scatter": "reduce_scatter",
               "alltoall_base": "all_to_all_single", "alltoall": "all_to_all", "allreduce_coalesced": "all_reduce"}

# Functional collectives are every op of the _c10d_functional namespace but the bookkeeping ones (waiting on a
# result, wrapping one for autograd), which move no data; c10d's in-place collectives are what torch.distributed.*
# dispatch to.
_NOT_COLLECTIVES = frozenset({"wait_tensor", "_wrap_tensor_autograd"})
_C10D_COLLECTIVES = frozenset({"_allgather_base_", "_reduce_scatter_base_", "allgather_", "allgather_coalesced_",
                               "allgather_into_tensor_coalesced_", "allreduce_", "allreduce_coalesced_", "alltoall_",
                               "alltoall_base_", "broadcast_", "gather_", "scatter_", "reduce_", "reduce_scatter_",
                               "reduce_scatter_tensor_coalesced_"})
# c10d ops whose first argument is the output and second the input; the others (allreduce_, broadcast_, reduce_,
# allreduce_coalesced_) work in place on their first argument.
_C10D_OUTPUT_FIRST = _C10D_COLLECTIVES - {"allreduce_", "allreduce_coalesced_", "broadcast_", "reduce_"}


def collective_name(func) -> str | None:
    """The ``torch.distributed`` name of the collective ``func`` (an ATen op overload), or None if it is not one."""
    namespace, name = getattr(func, "namespace", ""), func.overloadpacket.__name__
    if namespace in ("_c10d_functional", "c10d_functional") and name not in _NOT_COLLECTIVES:
        return name
    if namespace == "c10d" and name in _C10D_COLLECTIVES:
        plain = name.strip("_")
        return _C10D_NAMES.get(plain, plain)
    return None


def _nbytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(o) for o in obj)
    return 0


def _input_bytes(func, args: tuple) -> int:
    """Bytes of the collective's input on this rank (what it hands in, not what it receives)."""
    if not args:
        return 0
    if func.namespace == "c10d" and func.overloadpacket.__name__ in _C10D_OUTPUT_FIRST and len(args) > 1:
        return _nbytes(args[1])
    return _nbytes(args[0])


def _group_key(func, args: tuple, kwargs: dict) -> Any:
    """The process group argument of a collective: a group name (functional ops) or a ProcessGroup (c10d ops)."""
    for i, arg in enumerate(op_schema(func).arguments):
        if arg.name in ("group_name", "process_group"):
            value = kwargs.get(arg.name, args[i] if i < len(args) else None)
            if isinstance(value, torch.ScriptObject):  # c10d ops receive the group boxed for the dispatcher
                import torch.distributed as dist

                value = dist.ProcessGroup.unbox(value)
            return getattr(value, "group_name", value)
    return None


def _mesh_dim_groups(mesh) -> dict[str, str]:
    """``{group name: "dim[,dim...]"}``: the group of each of ``mesh``'s dimensions on this rank, and the world
    group when the mesh spans every rank, named by all the mesh's dimensions (``"dp,tp"``)."""
    import torch.distributed as dist

    names = tuple(mesh.mesh_dim_names or (f"dim{i}" for i in range(mesh.ndim)))
    if mesh.get_coordinate() is None:  # this rank is not in the mesh: nothing it runs is on the mesh's groups
        return {}
    out = {mesh.get_group(d).group_name: names[d] for d in range(mesh.ndim)}
    world = dist.group.WORLD
    if world is not None and sorted(mesh.mesh.flatten().tolist()) == sorted(dist.get_process_group_ranks(world)):
        out.setdefault(world.group_name, ",".join(names))  # eager torch.distributed calls without a group
    return out


class _CountCollectives(TorchDispatchMode):
    """Counts collective ops as they reach the dispatcher. DTensor ops are let through first (NotImplemented), so
    the collectives they desugar into are seen. It tracks no modules and installs no hooks (see the module
    docstring). ``counter._record(name, bytes, group name)`` runs just before the op does, so a recorder sees a
    collective that then hangs (the watchdog's ring, :mod:`vescale.core.watchdog`, records through this class with
    a ``name_of`` that also names barriers)."""

    def __init__(self, counter: Any, name_of: Any = None) -> None:
        super().__init__()
        self.counter = counter
        self.name_of = name_of or collective_name

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        kwargs = kwargs or {}
        if isinstance(func, HigherOrderOperator):
            return func(*args, **kwargs)
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        name = self.name_of(func)
        if name is not None:
            self.counter._record(name, _input_bytes(func, args), _group_key(func, args, kwargs))
        return func(*args, **kwargs)


class CommCounter:
    """Counts the collectives issued inside a ``with`` block, forward and backward alike, on this rank.

    - ``counts``: ``{collective: calls}``; ``total``: their sum.
    - ``bytes``: ``{collective: bytes of its inputs on this rank}``; ``total_bytes``: their sum.
    - ``dim_counts`` / ``dim_bytes``: ``{mesh dims: {collective: calls / bytes}}`` when ``mesh`` is given (keys as in
      the module docstring); empty otherwise.

    Entering the block clears all of them. ``summary()`` gives them as one JSON-ready dict.
    """

    def __init__(self, mesh: Any = None) -> None:
        self.mesh = mesh
        self.counts: Counter[str] = Counter()
        self.bytes: Counter[str] = Counter()
        self.dim_counts: dict[str, Counter[str]] = {}
        self.dim_bytes: dict[str, Counter[str]] = {}
        self._groups: dict[str, str] = {}
        self._mode = _CountCollectives(self)

    def _record(self, name: str, size: int, group: Any) -> None:
        self.counts[name] += 1
        self.bytes[name] += size
        if self.mesh is not None:
            dim = self._groups.get(group, "other") if isinstance(group, str) else "other"
            self.dim_counts.setdefault(dim, Counter())[name] += 1
            self.dim_bytes.setdefault(dim, Counter())[name] += size

    def __enter__(self) -> CommCounter:
        for c in (self.counts, self.bytes, self.dim_counts, self.dim_bytes):
            c.clear()
        if self.mesh is not None and not self._groups:
            self._groups = _mesh_dim_groups(self.mesh)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)

    @property
    def total(self) -> int:
        """Number of collectives counted."""
        return sum(self.counts.values())

    @property
    def total_bytes(self) -> int:
        """Bytes of the counted collectives' inputs on this rank."""
        return sum(self.bytes.values())

    def summary(self) -> dict:
        """``{"total", "total_bytes", "counts", "bytes"[, "per_dim": {dims: {"counts", "bytes"}}]}``, plain types."""
        out: dict = {"total": self.total, "total_bytes": self.total_bytes, "counts": dict(self.counts),
                     "bytes": dict(self.bytes)}
        if self.mesh is not None:
            out["per_dim"] = {dim: {"counts": dict(self.dim_counts[dim]), "bytes": dict(self.dim_bytes[dim])}
                              for dim in sorted(self.dim_counts)}
        return out


def count_comms(mesh: Any = None) -> CommCounter:
    """``with count_comms() as c: ...`` then read ``c.total`` / ``c.counts`` / ``c.bytes``; with ``mesh``, also
    ``c.dim_counts`` / ``c.dim_bytes`` (per mesh dimension)."""
    return CommCounter(mesh)
