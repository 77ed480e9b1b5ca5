"""The plan report: which parameter, buffer and module boundary got which placements, and from which plan entry."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

__all__ = ["PlanEntry", "PlanReport"]


@dataclass(frozen=True)
class PlanEntry:
    """One decision of :func:`~vescale.parallel.parallelize_module`.

    ``kind`` is ``"parameter"``, ``"buffer"``, ``"input"``, ``"output"`` or ``"local"``; ``fqn`` the
    parameter/buffer FQN or the module FQN (``""`` is the root); ``shape`` the global shape (empty for module
    boundaries); ``placements`` one string per mesh dim (for boundaries, one ``placements`` string per
    argument/output, ``None`` = left alone);
    ``pattern`` the pattern of the plan entry that put it there (in the plan section named by ``kind``; ``""`` is the
    root module), ``None`` when it is the default (replicated).
    """

    kind: str
    fqn: str
    shape: tuple[int, ...]
    placements: str
    pattern: str | None


@dataclass
class PlanReport:
    """Every decision taken for one parallelized module, in module order; print it or dump it as JSON."""

    mesh: str
    entries: list[PlanEntry] = field(default_factory=list)

    def for_fqn(self, fqn: str) -> PlanEntry:
        """The parameter or buffer entry of ``fqn``; ``KeyError`` naming it when absent."""
        for entry in self.entries:
            if entry.fqn == fqn and entry.kind in ("parameter", "buffer"):
                return entry
        raise KeyError(f"no parameter or buffer {fqn!r} in the plan report")

    def to_json(self) -> str:
        """The report as a JSON document (``{"mesh": ..., "entries": [...]}``)."""
        return json.dumps({"mesh": self.mesh, "entries": [asdict(e) for e in self.entries]}, indent=1)

    def __str__(self) -> str:
        rows = [(e.kind, e.fqn or "<root>", "x".join(map(str, e.shape)) or "-", e.placements, _pattern(e.pattern))
                for e in self.entries]
        head = ("kind", "fqn", "shape", "placements", "plan entry")
        widths = [max(len(r[i]) for r in [head, *rows]) for i in range(4)]
        lines = [f"parallelized on {self.mesh}"]
        for row in [head, *rows]:
            lines.append("  ".join(c.ljust(w) for c, w in zip(row[:4], widths)) + "  " + row[4])
        return "\n".join(lines)


def _pattern(pattern: str | None) -> str:
    """The plan-entry column: the pattern, ``''`` for the root module's, ``(default)`` when no entry applied."""
    if pattern is None:
        return "(default)"
    return repr(pattern) if pattern == "" else pattern
