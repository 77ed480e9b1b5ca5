"""The on-disk format, version 2: a directory of safetensors data files plus one JSON metadata file.

A checkpoint at ``PATH`` is::

    PATH/metadata.json                          written last: the checkpoint exists once this file does
    PATH/data-<save_id>-r<rank>.safetensors     one per writing rank, valid safetensors files

``metadata.json``::

    {"format": "vescale-checkpoint", "version": 2, "save_id": "<hex>", "world_size": 4,
     "files":   {"data-<id>-r00000.safetensors": {"size": <bytes>}, ...},
     "tensors": {"<key>": {"dtype": "float32", "shape": [8, 16],
                           "shards": [{"offsets": [0, 0], "lengths": [4, 16], "file": "data-...",
                                       "start": <byte>, "end": <byte>, "codec": "raw" | "zstd",
                                       "chunk": <bytes>, "crc32": [<int>, ...]}, ...]}, ...},
     "values":  {"<key>": <JSON value, tagged as in vescale.checkpoint._values>, ...}}

Each shard is a box of the global tensor (``offsets``/``lengths`` per dimension, row-major bytes) stored once, in
the data file's byte range ``[start, end)``; the shards of a tensor tile it exactly. ``codec == "zstd"`` stores the
box's bytes zstd-compressed (as a ``U8`` safetensors entry). ``crc32`` lists the checksums of the stored bytes
cut into ``chunk``-byte pieces (the last one shorter), so that a reader can check just the chunks it reads and the
checking of one shard can be spread over several readers. Keys are the dotted
paths of the saved state (``model.layers.0.w.weight``, ``optim.state.layers.0.w.exp_avg``, ``step``). Nothing is
pickled: reading a checkpoint never runs code.

Version 1 (before chunked checksums) stored one ``crc32`` integer per shard over all its stored bytes; it is read
as a version-2 shard with a single chunk (:func:`check_metadata` migrates it in memory).
"""

from __future__ import annotations

import json
from typing import Any

import torch

from vescale.checkpoint.errors import CorruptCheckpointError, UnsupportedStateError

__all__ = ["FORMAT_NAME", "FORMAT_VERSION", "READABLE_VERSIONS", "CHUNK_BYTES", "METADATA_FILE", "data_file_name",
           "dtype_name", "dtype_from_name", "safetensors_header"]

FORMAT_NAME = "vescale-checkpoint"
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
CHUNK_BYTES = 1 << 20  # checksum granularity of the shards written now
METADATA_FILE = "metadata.json"

_DTYPES: dict[torch.dtype, tuple[str, str]] = {  # torch dtype -> (metadata name, safetensors name)
    torch.float64: ("float64", "F64"), torch.float32: ("float32", "F32"), torch.float16: ("float16", "F16"),
    torch.bfloat16: ("bfloat16", "BF16"), torch.int64: ("int64", "I64"), torch.int32: ("int32", "I32"),
    torch.int16: ("int16", "I16"), torch.int8: ("int8", "I8"), torch.uint8: ("uint8", "U8"),
    torch.bool: ("bool", "BOOL"), torch.float8_e4m3fn: ("float8_e4m3fn", "F8_E4M3"),
    torch.float8_e5m2: ("float8_e5m2", "F8_E5M2"), torch.complex64: ("complex64", "C64"),
    torch.uint16: ("uint16", "U16"), torch.uint32: ("uint32", "U32"), torch.uint64: ("uint64", "U64"),
}
_BY_NAME = {name: dt for dt, (name, _) in _DTYPES.items()}


def dtype_name(dtype: torch.dtype, key: str = "") -> str:
    """Metadata name of ``dtype`` (``"bfloat16"``); ``TypeError`` naming ``key`` for dtypes the format lacks."""
    try:
        return _DTYPES[dtype][0]
    except KeyError:
        raise UnsupportedStateError(f"tensor {key!r} has dtype {dtype}, which vescale checkpoints cannot "
                                    "store") from None


def dtype_from_name(name: str) -> torch.dtype:
    """Inverse of :func:`dtype_name`."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise CorruptCheckpointError(f"unknown dtype {name!r} in checkpoint metadata") from None


def data_file_name(save_id: str, rank: int) -> str:
    """Name of the data file rank ``rank`` writes in save ``save_id``."""
    return f"data-{save_id}-r{rank:05d}.safetensors"


def safetensors_header(entries: list[tuple[str, torch.dtype, list[int], int]]) -> tuple[bytes, list[int]]:
    """Header bytes of a safetensors file holding ``entries`` (name, dtype, shape, nbytes) back to back.

    Returns the header (8-byte length prefix, JSON, space padding to 8 bytes) and each entry's absolute start
    offset in the file.
    """
    table: dict[str, Any] = {}
    offset = 0
    for name, dtype, shape, nbytes in entries:
        table[name] = {"dtype": _DTYPES[dtype][1], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    body = json.dumps(table, separators=(",", ":")).encode()
    body += b" " * (-len(body) % 8)
    header = len(body).to_bytes(8, "little") + body
    return header, [len(header) + table[name]["data_offsets"][0] for name, *_ in entries]


def check_metadata(meta: Any, where: str) -> dict[str, Any]:
    """Validate the top level of a parsed ``metadata.json`` and migrate older versions in memory; raise
    :class:`CorruptCheckpointError` naming ``where`` (the tables are checked by
    :func:`vescale.checkpoint._schema.check_tables`)."""
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME:
        raise CorruptCheckpointError(f"{where} is not vescale-checkpoint metadata")
    if type(meta.get("version")) is not int or meta["version"] not in READABLE_VERSIONS:
        raise CorruptCheckpointError(f"{where} has format version {meta.get('version')!r:.40}; this "
                                     f"vescale.checkpoint reads versions {', '.join(map(str, READABLE_VERSIONS))}")
    for field in ("files", "tensors", "values"):
        if not isinstance(meta.get(field), dict):
            raise CorruptCheckpointError(f"{where} lacks the {field!r} table")
    if meta["version"] == 1:
        _migrate_v1(meta, where)
    return meta


def _migrate_v1(meta: dict[str, Any], where: str) -> None:
    """Version 1 -> 2 in place: a shard's single whole-shard crc32 becomes a one-chunk checksum list (``version``
    keeps saying what was stored)."""
    for key, info in meta["tensors"].items():
        shards = info.get("shards") if isinstance(info, dict) else None
        for i, shard in enumerate(shards if isinstance(shards, list) else ()):
            if not isinstance(shard, dict) or type(shard.get("crc32")) is not int:
                raise CorruptCheckpointError(f"{where}: field tensors[{key!r}].shards[{i}].crc32 is missing or not "
                                             "an integer (version 1)")
            shard["crc32"] = [shard["crc32"]]
            start, end = shard.get("start"), shard.get("end")
            if type(start) is int and type(end) is int:  # otherwise the schema check names the field
                shard["chunk"] = max(1, end - start)
            else:
                shard["chunk"] = 1

