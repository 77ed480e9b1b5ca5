"""Writing a save to storage: this rank's safetensors data file with its chunk checksums, then (rank 0) the
``metadata.json`` that commits the checkpoint, and the list of files a committed save makes stale."""

from __future__ import annotations

import json
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from vescale.checkpoint._crc import crc32
from vescale.checkpoint._snapshot import Job
from vescale.checkpoint._storage import Storage
from vescale.checkpoint.format import (
    CHUNK_BYTES,
    FORMAT_NAME,
    FORMAT_VERSION,
    METADATA_FILE,
    safetensors_header,
)

__all__ = ["write_data_file", "commit_metadata", "stale_files"]

_COMPRESS_MIN_BYTES = 4096
_DATA_FILE = re.compile(r"data-([0-9a-f]+)-r\d+\.safetensors")


def write_data_file(storage: Storage, name: str, jobs: list[Job], compress: bool, pool: ThreadPoolExecutor
                    ) -> list[dict]:
    """Write this rank's data file; return one shard record per job."""
    raws = [memoryview(j.source.reshape(-1).view(torch.uint8).numpy()) for j in jobs]
    codecs = ["raw"] * len(jobs)
    if compress:
        import zstandard

        def squeeze(raw: memoryview):
            return memoryview(zstandard.ZstdCompressor(level=1).compress(raw)) if raw.nbytes >= _COMPRESS_MIN_BYTES \
                else None

        for i, packed in enumerate(pool.map(squeeze, raws)):
            if packed is not None and packed.nbytes < raws[i].nbytes:
                raws[i], codecs[i] = packed, "zstd"
    entries = []
    for job, raw, codec in zip(jobs, raws, codecs):
        tag = f"{job.key}@{','.join(map(str, job.offsets))}"
        if codec == "raw":
            entries.append((tag, job.dtype, list(job.lengths), raw.nbytes))
        else:
            entries.append((tag, torch.uint8, [raw.nbytes], raw.nbytes))
    header, starts = safetensors_header(entries)
    failure: list[BaseException] = []

    def write() -> None:
        try:
            storage.write_file(name, header, raws, pool)
        except BaseException as exc:  # noqa: BLE001 - re-raised below, on the saving thread
            failure.append(exc)

    writing = threading.Thread(target=write, name="vescale-checkpoint-write")
    writing.start()  # the checksums are computed here while the pool writes and the disk syncs
    try:
        crcs = [[crc32(raw[lo:lo + CHUNK_BYTES]) for lo in range(0, raw.nbytes, CHUNK_BYTES)] or [crc32(b"")]
                for raw in raws]
    finally:
        writing.join()
    if failure:
        raise failure[0]
    return [{"key": j.key, "offsets": list(j.offsets), "lengths": list(j.lengths), "file": name, "start": s,
             "end": s + raw.nbytes, "codec": codec, "chunk": CHUNK_BYTES, "crc32": crc}
            for j, raw, codec, s, crc in zip(jobs, raws, codecs, starts, crcs)]


def commit_metadata(storage: Storage, save_id: str, world: int, gathered: list[dict], tensors: dict) -> None:
    """Write ``metadata.json`` from every rank's shard records and values (rank 0, last: it makes the
    checkpoint visible)."""
    meta_tensors = {key: {"dtype": info["dtype"], "shape": info["shape"], "shards": []}
                    for key, info in sorted(tensors.items())}
    values: dict[str, Any] = {}
    files = {}
    for g in gathered:
        for rec in g["records"]:
            key = rec.pop("key")
            meta_tensors[key]["shards"].append(rec)
        for key, v in g["values"].items():
            values.setdefault(key, v)
        if g["file"]:
            files[g["file"][0]] = {"size": g["file"][1]}
    for info in meta_tensors.values():
        info["shards"].sort(key=lambda s: s["offsets"])
    meta = {"format": FORMAT_NAME, "version": FORMAT_VERSION, "save_id": save_id, "world_size": world,
            "files": files, "tensors": meta_tensors, "values": dict(sorted(values.items()))}
    storage.write_atomic(METADATA_FILE, json.dumps(meta, separators=(",", ":")).encode())


def stale_files(storage: Storage, save_id: str) -> list[str]:
    """Data files of other saves and leftover temporary metadata in the checkpoint directory."""
    stale = []
    for name in storage.names():
        m = _DATA_FILE.fullmatch(name)
        if (m and m.group(1) != save_id) or (name.startswith(f".{METADATA_FILE}.") and name.endswith(".tmp")):
            stale.append(name)
    return stale

