"""vescale.plan: automatic TP/SP/PP plans and mesh choice for unmodified models.

Scope (being built): derive a ``parallelize_module`` plan from a model's structure, choose the mesh, ZeRO stage and
pipeline split with a cost model, and explain every choice.
"""

from __future__ import annotations

__all__: list[str] = []
