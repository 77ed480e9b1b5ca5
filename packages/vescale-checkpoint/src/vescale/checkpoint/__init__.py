"""vescale.checkpoint: save on one mesh and strategy, load on any other; pickle-free, async, deduplicated.

``save(path, state, async_save=False)`` and ``load(path, state, strict=True)`` take a dict of names to modules
(plain, DDP, FSDP2, torch TP, pipeline stages), optimizers, tensors and DTensors, JSON-able values and objects with
``state_dict()``/``load_state_dict()``. Both are collective over all ranks of the default process group (or run in
a single process without one). Loading reshards online to whatever layout the state has now: any world size, any
DTensor placements. The format (:mod:`vescale.checkpoint.format`) is a directory of safetensors files plus JSON
metadata. ``export_hf``/``import_hf`` convert to and from Hugging Face sharded safetensors. CLI:
``python -m vescale.checkpoint inspect|verify|export-hf PATH ...``.
"""

from __future__ import annotations

from vescale.checkpoint._load import LoadResult, load
from vescale.checkpoint._save import SaveHandle, save, wait_pending
from vescale.checkpoint.errors import (
                                       CheckpointError,
                                       CheckpointNotFoundError,
                                       CorruptCheckpointError,
                                       StateMismatchError,
                                       UnsupportedStateError,
)
from vescale.checkpoint.format import FORMAT_VERSION
from vescale.checkpoint.hf import export_hf, import_hf
from vescale.checkpoint.inspection import inspect, verify

__all__ = [
    "save",
    "load",
    "SaveHandle",
    "LoadResult",
    "wait_pending",
    "verify",
    "inspect",
    "export_hf",
    "import_hf",
    "FORMAT_VERSION",
    "CheckpointError",
    "CheckpointNotFoundError",
    "CorruptCheckpointError",
    "StateMismatchError",
    "UnsupportedStateError",
]
