"""``inspect`` and ``verify``: read a checkpoint's metadata, and check every stored byte against it."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from vescale.checkpoint._reader import read_header, read_metadata, read_shard, shard_nbytes, tensor_dtype
from vescale.checkpoint._storage import Storage
from vescale.checkpoint.errors import CorruptCheckpointError

__all__ = ["inspect", "verify", "summary_lines"]


def plural(n: int, word: str) -> str:
    """``"1 problem"``, ``"2 problems"``."""
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def summary_lines(info: dict[str, Any]) -> list[str]:
    """:func:`inspect`'s dict as a human summary: a header line, one aligned line per tensor (name, dtype, global
    shape, shards, stored bytes), and the totals."""
    tensors = info["tensors"]
    head = (f"{info['format']} v{info['version']}, save {info['save_id']}, world size {info['world_size']}, "
            f"{plural(info['files'], 'file')}, {_size(info['bytes'])}")
    rows = [(k, v["dtype"], "[" + ", ".join(map(str, v["shape"])) + "]", plural(v["shards"], "shard"),
             _size(v["bytes"]) + ("" if v["codecs"] == ["raw"] else f" ({'+'.join(v['codecs'])})"))
            for k, v in tensors.items()]
    widths = [max((len(r[i]) for r in rows), default=0) for i in range(4)]
    lines = [head] + ["  ".join(c.ljust(w) for c, w in zip(r[:4], widths)) + "  " + r[4] for r in rows]
    shards = sum(v["shards"] for v in tensors.values())
    values = f" ({', '.join(info['values'])})" if info["values"] else ""
    lines.append(f"total: {plural(len(tensors), 'tensor')}, {plural(shards, 'shard')}, "
                 f"{_size(sum(v['bytes'] for v in tensors.values()))} of tensor data; "
                 f"{plural(len(info['values']), 'value')}{values}")
    return lines


def inspect(path: str | os.PathLike, *, storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Summary of a checkpoint: format version, world size, files, and per key its dtype, global shape, shard count,
    stored bytes (after the codec) and codecs."""
    meta = read_metadata(Storage(path, storage_options))
    return {
        "format": meta["format"], "version": meta["version"], "save_id": meta["save_id"],
        "world_size": meta["world_size"],
        "bytes": sum(f["size"] for f in meta["files"].values()), "files": len(meta["files"]),
        "tensors": {k: {"dtype": v["dtype"], "shape": v["shape"], "shards": len(v["shards"]),
                        "bytes": sum(shard_nbytes(s) for s in v["shards"]),
                        "codecs": sorted({s["codec"] for s in v["shards"]})} for k, v in meta["tensors"].items()},
        "values": sorted(meta["values"]),
    }


def verify(path: str | os.PathLike, *, storage_options: dict[str, Any] | None = None, threads: int = 4,
           checksums: bool = True) -> dict[str, Any]:
    """Check a checkpoint completely: the metadata against its schema (shards tiling each tensor among the rest),
    files present with the recorded sizes, each file's safetensors header listing every shard stored in it at its
    byte range, and every shard's checksums. Returns ``{"files", "tensors", "bytes"}``; raises
    :class:`CorruptCheckpointError` listing every problem, each naming its file. ``checksums=False`` checks all but
    the checksums, reading no stored data (each file's header only): what a load would find before reading, the
    load itself checking every chunk it reads."""
    storage = Storage(path, storage_options)
    meta = read_metadata(storage)
    problems: list[str] = []
    ranges: dict[str, set[tuple[int, int]]] = {}
    for info in meta["tensors"].values():
        for shard in info["shards"]:
            ranges.setdefault(shard["file"], set()).add((shard["start"], shard["end"]))
    for name, info in sorted(meta["files"].items()):
        size = storage.size(name)
        if size is None:
            problems.append(f"checkpoint data file {storage.where(name)} is missing")
        elif size != info["size"]:
            problems.append(f"checkpoint data file {storage.where(name)} is {size} bytes, expected {info['size']} "
                            "(truncated or overwritten)")
        elif name in ranges:
            try:
                header = read_header(storage, name, size)
            except CorruptCheckpointError as exc:
                problems.append(str(exc))
                continue
            end = header.pop("__header_end")
            listed = {(end + e["data_offsets"][0], end + e["data_offsets"][1]) for k, e in header.items()
                      if k != "__metadata__"}
            lost = sorted(ranges[name] - listed)
            if lost:
                problems.append(f"checkpoint data file {storage.where(name)}: its safetensors header does not list "
                                f"the shard stored at bytes [{lost[0][0]}, {lost[0][1]})")
    jobs = []
    for key, info in meta["tensors"].items():
        jobs += [(key, tensor_dtype(info), shard) for shard in info["shards"]]

    def check(job) -> str | None:
        key, dtype, shard = job
        try:
            read_shard(storage, shard, dtype, verify=True)
        except CorruptCheckpointError as exc:
            return f"{exc} (tensor {key!r})"
        return None

    if checksums:
        with ThreadPoolExecutor(max(1, threads)) as pool:
            problems += sorted({p for p in pool.map(check, jobs) if p})
    if problems:
        count = plural(len(problems), "problem")
        raise CorruptCheckpointError(f"checkpoint {storage.url} failed verification ({count}):\n  "
                                     + "\n  ".join(problems))
    return {"files": len(meta["files"]), "tensors": len(meta["tensors"]),
            "bytes": sum(shard_nbytes(s) for _, _, s in jobs)}
