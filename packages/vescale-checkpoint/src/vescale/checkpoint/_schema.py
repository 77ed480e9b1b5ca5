"""The schema of ``metadata.json``, checked in full before a load or verify allocates or reads anything from it.

A checkpoint is untrusted input (it may come from anyone, edited by hand or by an attacker). :func:`check_tables`
checks every field the readers use, so that no later step meets a missing key, a wrong type or an absurd number:

- ``files``: plain file names (:func:`vescale.checkpoint._storage.check_name`), each with an integer ``size``;
- ``tensors``: a known ``dtype``, a ``shape`` of at most 64 non-negative integers whose byte size fits in 2**48;
- each shard: every field present and of its type; ``offsets``/``lengths`` as long as the shape, the box inside
  the shape; ``file`` listed in ``files`` and ``[start, end)`` inside its recorded size; ``codec`` ``raw`` (stored
  bytes == the box's bytes) or ``zstd`` (no more than the box's bytes, and no more than zstd's largest expansion
  away from them); ``chunk`` >= 1 and one ``crc32`` in ``[0, 2**32)`` per chunk;
- the shards of a tensor tile it exactly (inside it, no two overlapping, volumes adding up), and no two shards
  share stored bytes of a file (so what a load allocates is bounded by the bytes the files really hold, which
  :func:`check_file_sizes` compares with the storage before any data is read);
- ``values``: each decodes (:func:`vescale.checkpoint._values.decode`).

Every violation raises :class:`CorruptCheckpointError` naming the file and the field (``tensors['w'].shards[0].
chunk``).
"""

from __future__ import annotations

import math
from typing import Any

from vescale.checkpoint import _values
from vescale.checkpoint._storage import Storage, check_name
from vescale.checkpoint.errors import CorruptCheckpointError
from vescale.checkpoint.format import dtype_from_name

__all__ = ["check_tables", "check_file_sizes", "MAX_TENSOR_BYTES"]

MAX_DIMS = 64
MAX_TENSOR_BYTES = 1 << 48  # 256 TiB: past any tensor one job holds, far from int64 overflow
_MAX_INT = 1 << 62
_ZSTD_MAX_EXPANSION = 1 << 15  # zstd stores at most 128 KiB per 4-byte (RLE) block
_SHARD_FIELDS = ("offsets", "lengths", "file", "start", "end", "codec", "chunk", "crc32")


def _int(value: Any, field: str, where: str, lo: int = 0, hi: int = _MAX_INT) -> int:
    if type(value) is not int or not lo <= value <= hi:
        raise CorruptCheckpointError(f"{where}: field {field} is {_short(value)}, not an integer in [{lo}, {hi}]")
    return value


def _ints(value: Any, field: str, where: str, n: int | None = None) -> list[int]:
    if not isinstance(value, list) or (n is not None and len(value) != n) or len(value) > MAX_DIMS:
        want = f"a list of {n} integers" if n is not None else f"a list of at most {MAX_DIMS} integers"
        raise CorruptCheckpointError(f"{where}: field {field} is {_short(value)}, not {want}")
    for i, v in enumerate(value):
        _int(v, f"{field}[{i}]", where)
    return value


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def check_tables(meta: dict[str, Any], where: str) -> None:
    """Check the ``files``, ``tensors`` and ``values`` tables of a parsed ``metadata.json`` (``where`` names it);
    raise :class:`CorruptCheckpointError` naming the first offending field."""
    if not isinstance(meta.get("save_id"), str):
        raise CorruptCheckpointError(f"{where}: field save_id is {_short(meta.get('save_id'))}, not a string")
    _int(meta.get("world_size"), "world_size", where, 1)
    sizes: dict[str, int] = {}
    for name, info in meta["files"].items():
        check_name(name, f"field files key {str(name)[:200]!r}", where)
        if not isinstance(info, dict):
            raise CorruptCheckpointError(f"{where}: field files[{name!r}] is {_short(info)}, not an object")
        sizes[name] = _int(info.get("size"), f"files[{name!r}].size", where)
    used: dict[str, list[tuple[int, int, str]]] = {}
    for key, info in meta["tensors"].items():
        _check_tensor(key, info, sizes, used, where)
    for name, spans in used.items():
        spans.sort()
        for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
            if start < end:
                raise CorruptCheckpointError(f"{where}: {a} and {b} claim the same bytes of file {name!r}")
    for key, value in meta["values"].items():
        try:
            _values.decode(value, key)
        except RecursionError:
            raise CorruptCheckpointError(f"{where}: value {key!r} is nested too deeply") from None


def _check_tensor(key: str, info: Any, sizes: dict[str, int], used: dict, where: str) -> None:
    field = f"tensors[{key!r}]"
    if not isinstance(info, dict):
        raise CorruptCheckpointError(f"{where}: field {field} is {_short(info)}, not an object")
    if not isinstance(info.get("dtype"), str):
        raise CorruptCheckpointError(f"{where}: field {field}.dtype is {_short(info.get('dtype'))}, not a name")
    try:
        itemsize = dtype_from_name(info["dtype"]).itemsize
    except CorruptCheckpointError:
        raise CorruptCheckpointError(f"{where}: field {field}.dtype is {_short(info['dtype'])}, not a dtype the "
                                     "format knows") from None
    shape = _ints(info.get("shape"), f"{field}.shape", where)
    numel = math.prod(shape)
    if numel * itemsize > MAX_TENSOR_BYTES:
        raise CorruptCheckpointError(f"{where}: field {field}.shape is {shape}, {numel * itemsize} bytes of "
                                     f"{info['dtype']}: more than the {MAX_TENSOR_BYTES} bytes a tensor may hold")
    shards = info.get("shards")
    if not isinstance(shards, list):
        raise CorruptCheckpointError(f"{where}: field {field}.shards is {_short(shards)}, not a list")
    boxes = []
    for i, shard in enumerate(shards):
        sfield = f"{field}.shards[{i}]"
        box = _check_shard(shard, sfield, shape, itemsize, sizes, where)
        if math.prod(box[1]):
            boxes.append((box, sfield))
        if shard["end"] > shard["start"]:
            used.setdefault(shard["file"], []).append((shard["start"], shard["end"], sfield))
    covered = sum(math.prod(b[1]) for b, _ in boxes)
    if covered != numel:
        raise CorruptCheckpointError(f"{where}: the shards of {field} cover {covered} of its {numel} elements")
    _check_disjoint(boxes, field, where)


def _check_shard(shard: Any, field: str, shape: list[int], itemsize: int, sizes: dict[str, int], where: str
                 ) -> tuple[list[int], list[int]]:
    if not isinstance(shard, dict):
        raise CorruptCheckpointError(f"{where}: field {field} is {_short(shard)}, not an object")
    for name in _SHARD_FIELDS:
        if name not in shard:
            raise CorruptCheckpointError(f"{where}: field {field}.{name} is missing")
    offsets = _ints(shard["offsets"], f"{field}.offsets", where, len(shape))
    lengths = _ints(shard["lengths"], f"{field}.lengths", where, len(shape))
    for d, (o, n, s) in enumerate(zip(offsets, lengths, shape)):
        if o + n > s:
            raise CorruptCheckpointError(f"{where}: field {field} has box offset {o} + length {n} past the size {s} "
                                         f"of dimension {d}")
    name = check_name(shard["file"], f"field {field}.file", where)
    if name not in sizes:
        raise CorruptCheckpointError(f"{where}: field {field}.file names {name!r}, which the files table lacks")
    start = _int(shard["start"], f"{field}.start", where)
    end = _int(shard["end"], f"{field}.end", where, start)
    if end > sizes[name]:
        raise CorruptCheckpointError(f"{where}: field {field}.end is {end}, past the recorded size {sizes[name]} of "
                                     f"file {name!r}")
    box_bytes = math.prod(lengths) * itemsize
    stored = end - start
    if shard["codec"] == "raw":
        if stored != box_bytes:
            raise CorruptCheckpointError(f"{where}: field {field} stores {stored} bytes ([start, end)) for a raw box "
                                         f"of {box_bytes} bytes")
    elif shard["codec"] == "zstd":
        if stored > box_bytes or box_bytes > max(stored, 1) * _ZSTD_MAX_EXPANSION:
            raise CorruptCheckpointError(f"{where}: field {field} stores {stored} zstd bytes for a box of "
                                         f"{box_bytes} bytes, more than zstd can hold in them")
    else:
        raise CorruptCheckpointError(f"{where}: field {field}.codec is {_short(shard['codec'])}, not 'raw' or "
                                     "'zstd'")
    chunk = _int(shard["chunk"], f"{field}.chunk", where, 1)
    crcs = shard["crc32"]
    count = max(1, -(-stored // chunk))
    if not isinstance(crcs, list) or len(crcs) != count:
        raise CorruptCheckpointError(f"{where}: field {field}.crc32 is {_short(crcs)}, not a list of {count} "
                                     f"checksums ({stored} bytes in chunks of {chunk})")
    for i, c in enumerate(crcs):
        _int(c, f"{field}.crc32[{i}]", where, 0, (1 << 32) - 1)
    return offsets, lengths


def _check_disjoint(boxes: list[tuple[tuple[list[int], list[int]], str]], field: str, where: str) -> None:
    """No two non-empty boxes overlap: swept along dimension 0, so each box is compared only with those starting
    before it ends there (linear for row shards)."""
    if len(boxes) < 2 or not boxes[0][0][0]:  # one box, or a 0-d tensor (whose one box the volume check allows)
        return
    boxes = sorted(boxes, key=lambda b: b[0][0])
    for i, ((offs, lens), a) in enumerate(boxes):
        for (o2, l2), b in boxes[i + 1:]:
            if o2[0] >= offs[0] + lens[0]:
                break
            if all(x < y + m and y < x + n for x, n, y, m in zip(offs, lens, o2, l2)):
                raise CorruptCheckpointError(f"{where}: {a} and {b} of {field} overlap")


def check_file_sizes(storage: Storage, meta: dict[str, Any]) -> None:
    """Compare every data file's recorded size with the storage's (one directory listing): a missing, truncated
    or overwritten file raises :class:`CorruptCheckpointError` naming it before any data is read or allocated."""
    actual = storage.sizes()
    for name, info in sorted(meta["files"].items()):
        size = actual.get(name)
        if size is None:
            raise CorruptCheckpointError(f"checkpoint data file {storage.where(name)} is missing")
        if size < 0:
            raise CorruptCheckpointError(f"checkpoint data file {storage.where(name)} is not a regular file (a "
                                         "symbolic link, a directory or a device); a checkpoint's files must be")
        if size < info["size"]:
            raise CorruptCheckpointError(f"checkpoint data file {storage.where(name)} is truncated: {size} bytes, "
                                         f"the metadata records {info['size']}")
        if size != info["size"]:
            raise CorruptCheckpointError(f"checkpoint data file {storage.where(name)} is {size} bytes, expected "
                                         f"{info['size']} (overwritten)")
