"""Hugging Face interop: export a checkpoint's model to HF sharded safetensors, import HF weights into a model.

``export_hf`` writes ``model-0000i-of-0000n.safetensors`` files plus ``model.safetensors.index.json`` (and
``config.json`` when given a config), which ``transformers`` ``from_pretrained`` loads. ``import_hf`` fills a model
(plain or with DTensor parameters on any mesh) from such a directory; each rank reads only its own slices.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import torch
from torch import nn

from vescale.checkpoint._layout import local_pieces
from vescale.checkpoint._reader import read_metadata, read_shard, tensor_dtype
from vescale.checkpoint._state import _local, flatten
from vescale.checkpoint._storage import Storage, check_name
from vescale.checkpoint.errors import CheckpointError, CorruptCheckpointError, StateMismatchError

__all__ = ["export_hf", "import_hf"]

INDEX_FILE = "model.safetensors.index.json"


def _assemble(storage: Storage, info: dict[str, Any]) -> torch.Tensor:
    dtype = tensor_dtype(info)
    full = torch.empty(info["shape"], dtype=dtype)
    for shard in info["shards"]:
        box = tuple(slice(o, o + n) for o, n in zip(shard["offsets"], shard["lengths"]))
        full[box] = read_shard(storage, shard, dtype)
    return full


def export_hf(path: str | os.PathLike, out_dir: str | os.PathLike, *, prefix: str = "model.", config: Any = None,
              dtype: torch.dtype | None = None, max_shard_bytes: int = 5 << 30,
              storage_options: dict[str, Any] | None = None) -> list[str]:
    """Write the tensors under ``prefix`` (stripped) as HF sharded safetensors plus index into ``out_dir``.

    ``config`` (an object with ``save_pretrained``, a dict, or a path to a ``config.json``) is written alongside.
    ``dtype`` casts floating-point tensors. Runs in one process; returns the name of every file written (the
    safetensors files, ``config.json`` when written, the index last).
    """
    from safetensors.torch import save_file

    storage = Storage(path, storage_options)
    meta = read_metadata(storage)
    keys = [k for k in meta["tensors"] if k.startswith(prefix)]
    if not keys:
        raise CheckpointError(f"checkpoint {storage.url} has no tensors under prefix {prefix!r}; its keys start "
                              f"with {sorted({k.split('.', 1)[0] + '.' for k in meta['tensors']})}")
    os.makedirs(out_dir, exist_ok=True)
    groups: list[list[str]] = [[]]
    size = 0
    for key in keys:
        info = meta["tensors"][key]
        nbytes = math.prod(info["shape"]) * (dtype or tensor_dtype(info)).itemsize
        if groups[-1] and size + nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(key)
        size += nbytes
    weight_map: dict[str, str] = {}
    names, total = [], 0
    for i, group in enumerate(groups):
        name = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {}
        for key in group:
            t = _assemble(storage, meta["tensors"][key])
            if dtype is not None and t.is_floating_point():
                t = t.to(dtype)
            tensors[key[len(prefix):]] = t
            weight_map[key[len(prefix):]] = name
            total += t.numel() * t.element_size()
        save_file(tensors, os.path.join(out_dir, name), metadata={"format": "pt"})
        names.append(name)
    with open(os.path.join(out_dir, INDEX_FILE), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    if config is not None:
        names.append("config.json")
        if hasattr(config, "save_pretrained"):
            config.save_pretrained(out_dir)
        else:
            data = config if isinstance(config, dict) else json.load(open(config))
            with open(os.path.join(out_dir, "config.json"), "w") as f:
                json.dump(data, f, indent=2)
    return names + [INDEX_FILE]


def _weight_map(src: str) -> dict[str, str]:
    """Tensor name -> the file in ``src`` holding it. The index is untrusted: every file it names must be a plain
    file name inside ``src`` (:func:`check_name`), else :class:`CorruptCheckpointError` naming the entry."""
    index = os.path.join(src, INDEX_FILE)
    if os.path.exists(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            items = list(weight_map.items())
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
            raise CorruptCheckpointError(f"{index} is not a safetensors index with a 'weight_map' object: "
                                         f"{type(exc).__name__}") from None
        return {k: os.path.join(src, check_name(v, f"weight_map[{str(k)[:200]!r}]", index)) for k, v in items}
    single = os.path.join(src, "model.safetensors")
    if not os.path.exists(single):
        raise CheckpointError(f"{src} has neither {INDEX_FILE} nor model.safetensors")
    from safetensors import safe_open

    with safe_open(single, framework="pt") as f:
        return dict.fromkeys(f.keys(), single)


def import_hf(src: str | os.PathLike, model: nn.Module, *, prefix: str = "", strict: bool = True) -> None:
    """Fill ``model`` in place from the HF safetensors directory ``src`` (keys ``prefix`` + the model's FQNs).

    Parameters may be DTensors on any mesh: each rank reads its own boxes. Weights tied in the model may be absent
    from ``src``. With ``strict``, missing or unexpected keys and shape mismatches raise
    :class:`StateMismatchError` listing all of them; dtypes are cast.
    """
    from safetensors import safe_open

    src = os.fspath(src)
    where = _weight_map(src)
    flat = flatten({"": model})
    problems = []
    by_ptr: dict[int, str] = {}
    handles: dict[str, Any] = {}
    todo = []
    for key, t in flat.tensors.items():
        name = prefix + key
        ptr = _local(t).data_ptr()
        if name not in where:
            if not (ptr in by_ptr or any(prefix + k in where for k, u in flat.tensors.items() if u is not t and
                                         _local(u).data_ptr() == ptr)):
                problems.append(f"missing: {name!r} is not in {src}")
            continue
        by_ptr[ptr] = name
        todo.append((name, t))
    unexpected = sorted(set(where) - {prefix + k for k in flat.tensors})
    problems += [f"unexpected: {k!r} is in {src} but not in the model" for k in unexpected]
    try:
        for name, t in todo:
            if where[name] not in handles:
                handles[where[name]] = safe_open(where[name], framework="pt")
            shape = list(handles[where[name]].get_slice(name).get_shape())
            if shape != list(t.shape):
                problems.append(f"shape mismatch: {name!r} is {shape} in {src}, {list(t.shape)} in the model")
        if problems and strict:
            raise StateMismatchError("HF weights do not match the model:\n  " + "\n  ".join(problems), problems)
        for name, t in todo:
            if list(handles[where[name]].get_slice(name).get_shape()) != list(t.shape):
                continue
            part = handles[where[name]].get_slice(name)
            for piece in local_pieces(t, name):
                box = tuple(slice(o, o + n) for o, n in zip(piece.offsets, piece.lengths))
                piece.view.copy_(part[box] if box else part[...])
    finally:
        handles.clear()
    for finalize in flat.finalizers:
        finalize()
