"""Matching plan patterns against module and parameter FQNs: the one place that does it.

A plan is a dict from regex patterns to values (placements, split points, ...). A pattern applies to an FQN when it
*full-matches* it (``re.fullmatch``), so ``r"layers\\.\\d+\\.mlp\\.up"`` never matches ``"layers.0.mlp.up_proj"`` by
accident. When several patterns match one FQN the first in plan order wins. A pattern that matches nothing is an
error by default, naming the pattern and the closest FQNs, because a typo in a plan must never pass silently.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

from vescale.core.errors import PlanError

__all__ = ["PlanMatch", "compile_patterns", "match_plan"]

V = TypeVar("V")


@dataclass(frozen=True)
class PlanMatch(Generic[V]):
    """``fqn`` got ``value`` because plan entry ``pattern`` matched it."""

    fqn: str
    pattern: str
    value: V


def compile_patterns(patterns: Iterable[str], *, what: str = "plan") -> list[re.Pattern]:
    """Compile patterns, raising :class:`PlanError` naming the one that is not a valid regex."""
    compiled = []
    for pattern in patterns:
        if not isinstance(pattern, str):
            raise PlanError(f"{what} key {pattern!r} must be a regex string, got {type(pattern).__name__}")
        try:
            compiled.append(re.compile(pattern))
        except re.error as exc:
            raise PlanError(f"{what} pattern {pattern!r} is not a valid regex: {exc}") from exc
    return compiled


def match_plan(plan: Mapping[str, V], fqns: Iterable[str], *, what: str = "plan",
               allow_unmatched: bool = False) -> dict[str, PlanMatch[V]]:
    """Map each FQN that some pattern of ``plan`` full-matches to its :class:`PlanMatch` (first pattern wins).

    FQNs no pattern matches are absent from the result. Unless ``allow_unmatched``, a pattern that matches no FQN
    raises :class:`PlanError` listing every such pattern with the closest FQNs, so that all typos show at once.
    Pure and deterministic: every rank computes the same answer without communicating.
    """
    patterns = list(plan)
    compiled = compile_patterns(patterns, what=what)
    fqns = list(fqns)
    matches: dict[str, PlanMatch[V]] = {}
    used = [False] * len(patterns)
    for fqn in fqns:
        for i, regex in enumerate(compiled):
            if regex.fullmatch(fqn):
                used[i] = True
                if fqn not in matches:
                    matches[fqn] = PlanMatch(fqn, patterns[i], plan[patterns[i]])
    unmatched = [p for p, u in zip(patterns, used) if not u]
    if unmatched and not allow_unmatched:
        lines = []
        for pattern in unmatched:
            close = difflib.get_close_matches(_literal(pattern), fqns, n=3, cutoff=0.5)
            hint = f" (closest: {', '.join(close)})" if close else ""
            lines.append(f"  {pattern!r}{hint}")
        raise PlanError(f"{what} has {len(unmatched)} pattern(s) that match no FQN among {len(fqns)}:\n"
                        + "\n".join(lines))
    return matches


def _literal(pattern: str) -> str:
    """A readable stand-in for a pattern, for suggesting close FQNs: drop regex escapes and classes."""
    text = re.sub(r"\\d[+*]?|\[[^\]]*\][+*]?|\.\*|\.\+", "0", pattern)
    return text.replace("\\", "")

