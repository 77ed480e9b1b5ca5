"""vescale.dtensor: PyTorch's DTensor plus what it lacks.

Scope (being built): interleaved and ragged placements, a counter-based RNG that makes sharded init and dropout
bitwise equal to one device, deferred (meta-device) init that materialises only local shards, and a strict mode that
forbids implicit resharding. Built on ``torch.distributed.tensor``, never a fork of it.
"""

from __future__ import annotations

__all__: list[str] = []
