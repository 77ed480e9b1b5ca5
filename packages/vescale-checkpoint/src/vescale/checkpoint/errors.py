"""Errors raised by vescale.checkpoint; each names the checkpoint file, metadata field or state key involved.

Everything the package raises on purpose derives from :class:`CheckpointError` (itself a
:class:`vescale.core.errors.VescaleError`). Each subclass also derives from the built-in exception callers caught
before it existed (``ValueError``, ``TypeError``, ``FileNotFoundError``), so existing ``except`` clauses keep working.
"""

from __future__ import annotations

from vescale.core.errors import VescaleError

__all__ = ["CheckpointError", "CheckpointNotFoundError", "CorruptCheckpointError", "StateMismatchError",
           "UnsupportedStateError"]


class CheckpointError(VescaleError):
    """Base class of every error vescale.checkpoint raises on purpose."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No complete checkpoint at the path (absent, or a save that never committed its metadata)."""


class CorruptCheckpointError(CheckpointError, ValueError):
    """A checkpoint is missing a file, truncated, damaged (checksum mismatch) or malformed (its metadata breaks the
    format's schema, or names something outside the checkpoint); the message names the file and field."""


class StateMismatchError(CheckpointError, ValueError):
    """The state to load into does not match the checkpoint; ``problems`` lists every offending key."""

    def __init__(self, message: str, problems: list[str] | None = None) -> None:
        super().__init__(message)
        self.problems = list(problems or [])


class UnsupportedStateError(CheckpointError, ValueError, TypeError):
    """The state given to ``save`` or ``load`` cannot be checkpointed as it is (a value of a type the format cannot
    store, a dtype it lacks, two entries with the same key, a layout it cannot map to boxes); the message names the
    key. Also a ``ValueError`` and a ``TypeError``, the built-ins raised here before."""
