"""vescale.pipe: pipeline parallelism for unmodified PyTorch models.

Scope (being built): split a model into stages, run GPipe / 1F1B / interleaved / zero-bubble schedules expressed as
instruction lists, compose with TP and DP on a named mesh, and record one nD timeline of every rank.
"""

from __future__ import annotations

__all__: list[str] = []
