"""The one way vescale writes placements as text (plan reports, ``explain`` tables, auto-plan decisions).

It needs nothing from DTensor: a placement is written with ``str`` (torch's short form, ``S(0)``, ``R``, ``P(sum)``),
so it lives in the core every package may import.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["format_placements"]


def format_placements(value: Any) -> str:
    """``value`` as text: a placements list as ``[S(0), R]``, ``None`` as ``None``, a list of those (one per
    argument) as ``[[S(1)], None]``, a mapping (per keyword) as ``{mask: [R]}``; anything else with ``str``.

    A sequence counts as one placements list when each item has ``is_replicate`` (every torch and vescale placement).
    """
    if isinstance(value, (list, tuple)):
        if all(hasattr(p, "is_replicate") for p in value):
            return "[" + ", ".join(str(p) for p in value) + "]"
        return "[" + ", ".join(format_placements(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k}: {format_placements(v)}" for k, v in value.items()) + "}"
    return str(value)
