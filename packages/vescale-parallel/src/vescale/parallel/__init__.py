"""vescale.parallel: tensor, sequence and data parallelism for unmodified models.

Scope (being built): ``parallelize_module`` driven by a regex-FQN plan (TP and SP), Megatron-style DDP with bucketed,
overlapped gradient reduction, a ZeRO DistributedOptimizer, vocab-parallel loss and gradient clipping over nD meshes.
"""

from __future__ import annotations

__all__: list[str] = []
