"""The vocab-parallel embedding lookup (Megatron's): this rank's rows of a vocabulary sharded by rows.

:func:`lookup_rows` is the one implementation: the fast path's whole-model run (:mod:`vescale.parallel.fast.model`)
all-reduces its result over the tensor-parallel group, compile mode's traced lookup
(:func:`vescale.parallel.compile.install_compilable_embeddings`) wraps it as a ``Partial`` DTensor. Ids must have
been checked against the whole vocabulary first (``TokenIdError``: both callers do, before any collective); an id
outside this rank's rows reads zeros here. Local and differentiable; no collective.
"""

from __future__ import annotations

import torch

__all__ = ["lookup_rows"]


def lookup_rows(ids: torch.Tensor, weight: torch.Tensor, offset: int, padding_idx: int | None) -> torch.Tensor:
    """``[*ids.shape, dim]``: the rows ``weight`` holds (vocabulary ids ``[offset, offset + rows)``) looked up, zeros
    for every other id; ``padding_idx`` (a global id, or None) gets no gradient, as in ``nn.Embedding``. Uses no
    factory function (factory capture must not see one)."""
    rows = weight.shape[0]
    outside = (ids < offset) | (ids >= offset + rows)
    local = (ids - offset).masked_fill(outside, 0)
    pad = padding_idx - offset if padding_idx is not None and offset <= padding_idx < offset + rows else None
    return torch.nn.functional.embedding(local, weight, pad).masked_fill(outside.unsqueeze(-1), 0.0)
