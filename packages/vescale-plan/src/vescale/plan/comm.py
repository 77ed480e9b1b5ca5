"""Count the collectives a piece of code issues, with the bytes each one moves (per rank).

:class:`CommCounter` is a ``TorchDispatchMode`` like torch's ``CommDebugMode`` (which counts calls only); it also adds
up the size of every collective's input tensor, so two plans can be compared by the bytes they move, not only by how
many collectives they issue.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["CommCounter"]

_OPS = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single", "broadcast",
        "all_reduce_coalesced", "all_gather_into_tensor_coalesced", "reduce_scatter_tensor_coalesced")


class CommCounter(TorchDispatchMode):
    """``with CommCounter() as c: ...`` then ``c.counts`` (``{op: calls}``), ``c.bytes`` (``{op: bytes}``) and
    ``c.total_bytes``: functional collectives (what DTensor issues) by name, input sizes in bytes on this rank."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()
        self.bytes: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        ns = getattr(func, "namespace", "")
        name = func._schema.name.split("::")[-1] if hasattr(func, "_schema") else ""
        if ns in ("_c10d_functional", "c10d_functional") and name in _OPS:
            first = args[0] if args else None
            tensors = first if isinstance(first, (list, tuple)) else [first]
            size = sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
            self.counts[name] += 1
            self.bytes[name] += size
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        """Number of collectives issued."""
        return sum(self.counts.values())

    @property
    def total_bytes(self) -> int:
        """Bytes of collective inputs on this rank."""
        return sum(self.bytes.values())
