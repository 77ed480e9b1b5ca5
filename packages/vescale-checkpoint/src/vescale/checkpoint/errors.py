"""Errors raised by vescale.checkpoint; each names the checkpoint file or state key involved."""

from __future__ import annotations

from vescale.core.errors import VescaleError

__all__ = ["CheckpointError", "CheckpointNotFoundError", "CorruptCheckpointError", "StateMismatchError"]


class CheckpointError(VescaleError):
    """Base class of every error vescale.checkpoint raises on purpose."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No complete checkpoint at the path (absent, or a save that never committed its metadata)."""


class CorruptCheckpointError(CheckpointError, ValueError):
    """A checkpoint file is missing, truncated or damaged (checksum mismatch); the message names the file."""


class StateMismatchError(CheckpointError, ValueError):
    """The state to load into does not match the checkpoint; ``problems`` lists every offending key."""

    def __init__(self, message: str, problems: list[str] | None = None) -> None:
        super().__init__(message)
        self.problems = list(problems or [])
