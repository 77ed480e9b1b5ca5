"""``load``: check the state against the checkpoint, plan reads, read each stored byte once, send, fill in place.

Every rank describes the boxes it needs (from its DTensors' placements on any mesh, or whole plain tensors). From
everyone's needs and the metadata, all ranks derive the same plan: every stored shard that anyone needs is read by
exactly one of the ranks needing it (fewest bytes read so far, largest shards first), checked against its crc32,
and the overlapping sub-boxes are sent point to point to the other ranks needing them. (On one host with a local
file system each needing rank reads the shard itself instead, the page cache serving the repeats: one of them reads
it whole and checks its crc32, the others read only the contiguous byte range they need when there is one.) A
needing rank whose target is exactly what it reads reads straight into the target's memory. Reading proceeds in
rounds of bounded size; a damaged shard found by any rank fails the load on every rank before the targets of its
round are filled.
"""

from __future__ import annotations

import json
import os
import socket
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from vescale.checkpoint import _values
from vescale.checkpoint._comm import Comm, io_threads
from vescale.checkpoint._layout import intersect, relative
from vescale.checkpoint._reader import read_metadata, read_shard, shard_nbytes, tensor_dtype
from vescale.checkpoint._save import describe, wait_pending
from vescale.checkpoint._state import flatten
from vescale.checkpoint._storage import Storage
from vescale.checkpoint.errors import CheckpointError, CorruptCheckpointError, StateMismatchError
from vescale.checkpoint.format import dtype_name

__all__ = ["load", "LoadResult"]

_ROUND_BYTES = 1 << 30


@dataclass
class LoadResult:
    """What a load left out: keys only in the state (``missing``), only in the checkpoint (``unexpected``), and
    keys skipped for a shape mismatch (``mismatched``); all empty after a strict load."""

    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)


def _broadcast_metadata(storage: Storage, comm: Comm) -> dict[str, Any]:
    if comm.rank == 0:
        try:
            payload = b"M" + json.dumps(read_metadata(storage), separators=(",", ":")).encode()
        except CheckpointError as exc:
            payload = b"E" + f"{type(exc).__name__}\n{exc}".encode()
    else:
        payload = None
    payload = comm.broadcast_bytes(payload, 0)
    if payload[:1] == b"E":
        kind, message = payload[1:].decode().split("\n", 1)
        from vescale.checkpoint import errors

        raise getattr(errors, kind, CheckpointError)(message)
    return json.loads(payload[1:])


def _check(requests: list[dict], meta: dict, strict: bool) -> tuple[LoadResult, set[str]]:
    """Every mismatch between all ranks' requests and the checkpoint; identical on every rank."""
    tensors, values = meta["tensors"], meta["values"]
    problems: list[str] = []
    result = LoadResult()
    skip: set[str] = set()
    wanted: set[str] = set()
    for req in requests:
        for key, (dt, shape, _) in req["tensors"].items():
            wanted.add(key)
            info = tensors.get(key)
            if info is None:
                where = "holds a value, not a tensor" if key in values else "is not in the checkpoint"
                (problems.append(f"missing: {key!r} {where}") if strict else result.missing.append(key))
                skip.add(key)
            elif info["shape"] != shape:
                msg = f"shape mismatch: {key!r} is {info['shape']} in the checkpoint, {shape} in the state"
                if strict:
                    problems.append(msg)
                else:
                    warnings.warn(f"vescale.checkpoint: skipping {msg}", stacklevel=3)
                    result.mismatched.append(key)
                skip.add(key)
            elif info["dtype"] != dt and strict:
                problems.append(f"dtype mismatch: {key!r} is {info['dtype']} in the checkpoint, {dt} in the state; "
                                "pass strict=False to cast")
        for key in req["values"]:
            wanted.add(key)
            if key not in values:
                where = "holds a tensor, not a value" if key in tensors else "is not in the checkpoint"
                (problems.append(f"missing: {key!r} {where}") if strict else result.missing.append(key))
                skip.add(key)
    unexpected = sorted(k for k in list(tensors) + list(values) if k not in wanted)
    if strict:
        problems += [f"unexpected: {k!r} is in the checkpoint but not in the state" for k in unexpected]
    else:
        result.unexpected = unexpected
    if problems:
        problems = sorted(set(problems))
        raise StateMismatchError(f"state does not match checkpoint ({len(problems)} problems):\n  "
                                 + "\n  ".join(problems), problems)
    result.missing = sorted(set(result.missing))
    result.mismatched = sorted(set(result.mismatched))
    return result, skip


@dataclass
class _Read:
    key: str
    shard: dict[str, Any]
    reader: int
    needs: list[tuple[int, int, tuple]]  # (rank, request index, intersection box)
    verify: bool = True  # this reader checks the shard's crc32 (one reader per shard does)
    part: tuple | None = None  # read only this contiguous sub-box of the shard (unverified; another rank verifies)


def _plan(requests: list[dict], meta: dict, skip: set[str], dedup: bool) -> list[_Read]:
    """Who reads which stored shard. ``dedup``: one reader per shard, which sends; else each needing rank reads."""
    reads: list[_Read] = []
    groups: list[list[_Read]] = []
    for key in sorted({k for req in requests for k in req["tensors"]} - skip):
        for shard in meta["tensors"][key]["shards"]:
            box = (tuple(shard["offsets"]), tuple(shard["lengths"]))
            needs = []
            for r, req in enumerate(requests):
                for j, (offs, lens) in enumerate(req["tensors"].get(key, (None, None, []))[2]):
                    inter = intersect(box, (tuple(offs), tuple(lens)))
                    if inter is not None and (all(inter[1]) or not inter[1]):
                        needs.append((r, j, inter))
            if needs and dedup:
                reads.append(_Read(key, shard, -1, needs))
            elif needs:
                group = []
                for r in sorted({r for r, _, _ in needs}):
                    mine = [n for n in needs if n[0] == r]
                    part = mine[0][2] if len(mine) == 1 and shard["codec"] == "raw" and _contiguous(
                        mine[0][2], box) else None
                    group.append(_Read(key, shard, r, mine, verify=False, part=part))
                groups.append(group)
    load = [0] * len(requests)
    if not dedup:  # each needing rank reads; one of them (balanced by bytes) reads it all and checks the crc32
        for group in sorted(groups, key=lambda g: -shard_nbytes(g[0].shard)):
            primary = min(group, key=lambda rd: (load[rd.reader], rd.reader))
            primary.verify, primary.part = True, None
            for rd in group:
                load[rd.reader] += shard_nbytes(rd.shard) if rd.part is None else 0
        return [rd for group in groups for rd in group]
    for read in sorted(reads, key=lambda rd: -shard_nbytes(rd.shard)):
        candidates = {r for r, _, _ in read.needs}
        read.reader = min(candidates, key=lambda r: (load[r], r))
        load[read.reader] += shard_nbytes(read.shard)
    return reads


def _contiguous(inter: tuple, box: tuple) -> bool:
    """Whether sub-box ``inter`` of ``box`` is one contiguous byte range of the row-major shard, and not all of it."""
    lens, full = inter[1], box[1]
    k = next((j for j in range(len(full)) if lens[j] != full[j]), None)
    return k is not None and all(full[j] == 1 for j in range(k)) and all(
        lens[j] == full[j] for j in range(k + 1, len(full)))


def _rounds(reads: list[_Read]) -> list[list[_Read]]:
    rounds, current, size = [], [], 0
    for read in reads:
        if current and size + shard_nbytes(read.shard) > _ROUND_BYTES:
            rounds.append(current)
            current, size = [], 0
        current.append(read)
        size += shard_nbytes(read.shard)
    return rounds + ([current] if current else [])


def load(path: str | os.PathLike, state: dict[str, Any], *, strict: bool = True,
         storage_options: dict[str, Any] | None = None, verify: bool = True, threads: int | None = None,
         dedup_reads: bool | None = None) -> LoadResult:
    """Load the checkpoint at ``path`` into ``state`` in place, resharding to its current layout; collective.

    Tensors (module parameters and buffers, optimizer states, DTensors on any mesh) are filled in place, values
    are assigned back into ``state``'s containers, stateful objects get ``load_state_dict``. Plain tensors in a stateful
    object's ``state_dict()`` take the checkpoint's shape and dtype (replaced when they differ). Optimizers without
    state yet get it built first. With ``strict`` (default) any missing or unexpected key and any shape or dtype
    mismatch raises :class:`StateMismatchError` listing all of them, on every rank, before any data is read; with
    ``strict=False`` those keys are skipped (dtypes cast) and reported in the returned :class:`LoadResult`.
    Damaged or truncated data raises :class:`CorruptCheckpointError` naming the file (checksums are checked
    unless ``verify=False``).

    ``threads``: I/O threads per rank (default: the host's CPUs divided among its ranks, 1 to 8).
    ``dedup_reads``: each stored shard is read by one rank and sent to the others needing it (True), or read by
    every rank needing it (False). The default reads once and sends unless the storage is a local file system and
    all ranks run on one host, where the shared page cache already makes the second read a memory copy.
    """
    wait_pending()
    comm = Comm()
    storage = Storage(path, storage_options)
    meta = _broadcast_metadata(storage, comm)
    saved = meta["tensors"]
    error: Exception | None = None
    try:
        flat = flatten(state, init_optimizer=lambda key: any(k.startswith(f"{key}.state.") for k in saved))
        replaced = {}
        for key, t in flat.tensors.items():
            info = saved.get(key)
            if info and key in flat.tensor_setters and (info["shape"] != list(t.shape)
                                                        or info["dtype"] != dtype_name(t.dtype, key)):
                replaced[key] = torch.empty(info["shape"], dtype=tensor_dtype(info), device=t.device)
        flat.tensors.update(replaced)
        desc, pieces, _ = describe(flat, flat.tensors)
        request = {"tensors": desc, "values": sorted(flat.values), "host": socket.gethostname()}
    except Exception as exc:  # noqa: BLE001 - bad input: every rank must learn of it, none may hang
        error, request = exc, {"error": f"{type(exc).__name__}: {exc}"}
    requests = comm.all_gather_json(request)
    if error is not None:
        raise error
    failed = [f"rank {r}: {req['error']}" for r, req in enumerate(requests) if "error" in req]
    if failed:
        raise CheckpointError(f"load from {storage.url} aborted: " + "; ".join(failed))
    result, skip = _check(requests, meta, strict)
    if dedup_reads is None:
        dedup_reads = not (storage.local and len({req["host"] for req in requests}) == 1)
    reads = _plan(requests, meta, skip, dedup_reads)
    with ThreadPoolExecutor(io_threads(threads, comm)) as pool:
        for batch in _rounds(reads):
            _run_round(batch, comm, storage, pieces, saved, verify, pool)
    for key, t in replaced.items():
        flat.tensor_setters[key](t)
    for key in flat.values:
        if key not in skip:
            flat.setters[key](_values.decode(meta["values"][key]))
    for finalize in flat.finalizers:
        finalize()
    return result


def _run_round(batch: list[_Read], comm: Comm, storage: Storage, pieces: dict, saved: dict, verify: bool,
               pool: ThreadPoolExecutor) -> None:
    me = comm.rank

    def read(rd: _Read) -> tuple[torch.Tensor, bool, tuple[int, ...]]:
        """(data, whether read straight into the target, global offsets of the data's first element)."""
        dtype = tensor_dtype(saved[rd.key])
        box = rd.part or (tuple(rd.shard["offsets"]), tuple(rd.shard["lengths"]))
        direct = None
        for r, j, inter in rd.needs:
            if r != me or inter != box or rd.shard["codec"] != "raw":
                continue
            piece = pieces[rd.key][j]
            view = piece.view[relative(inter, piece.offsets)]
            if view.device.type == "cpu" and view.dtype == dtype and view.is_contiguous():
                direct = view
        if rd.part is None:
            return read_shard(storage, rd.shard, dtype, verify=verify and rd.verify, out=direct), \
                direct is not None, box[0]
        out = direct if direct is not None else torch.empty(box[1], dtype=dtype)
        strides = [_numel(rd.shard["lengths"][j + 1:]) for j in range(len(box[1]))]
        skip = sum((o - so) * st for o, so, st in zip(box[0], rd.shard["offsets"], strides)) * dtype.itemsize
        storage.read_into(rd.shard["file"], rd.shard["start"] + skip, memoryview(out.reshape(-1).view(
            torch.uint8).numpy()))
        return out, direct is not None, box[0]

    mine = [rd for rd in batch if rd.reader == me]
    data: dict[int, tuple[torch.Tensor, bool, tuple[int, ...]]] = {}
    error = None
    try:
        for rd, got in zip(mine, pool.map(read, mine)):
            data[id(rd)] = got
    except CorruptCheckpointError as exc:
        error = str(exc)
    errors = [e for e in comm.all_gather_json(error)] if comm.world > 1 else [error]
    first = next((e for e in errors if e), None)
    if first:
        raise CorruptCheckpointError(first)

    sends: dict[int, list[torch.Tensor]] = {}
    recv_sizes: dict[int, int] = {}
    for rd in batch:
        itemsize = tensor_dtype(saved[rd.key]).itemsize
        for r, _, inter in rd.needs:
            if rd.reader == me and r != me:
                shard, _, origin = data[id(rd)]
                sends.setdefault(r, []).append(shard[relative(inter, origin)])
            elif r == me and rd.reader != me:
                recv_sizes[rd.reader] = recv_sizes.get(rd.reader, 0) + _aligned(_numel(inter[1]) * itemsize)
    packed = {peer: _pack(parts) for peer, parts in sends.items()}
    received = comm.exchange(packed, recv_sizes) if comm.world > 1 else {}
    cursor = dict.fromkeys(received, 0)
    for rd in batch:
        dtype = tensor_dtype(saved[rd.key])
        for r, j, inter in rd.needs:
            if r != me:
                continue
            piece = pieces[rd.key][j]
            target = piece.view[relative(inter, piece.offsets)]
            if rd.reader == me:
                shard, direct, origin = data[id(rd)]
                if not direct:
                    target.copy_(shard[relative(inter, origin)])
            else:
                n = _numel(inter[1]) * dtype.itemsize
                start = cursor[rd.reader]
                cursor[rd.reader] = start + _aligned(n)
                target.copy_(received[rd.reader][start:start + n].view(dtype).reshape(inter[1]))


def _pack(parts: list[torch.Tensor]) -> torch.Tensor:
    sizes = [p.numel() * p.element_size() for p in parts]
    out = torch.empty(sum(_aligned(n) for n in sizes), dtype=torch.uint8)
    offset = 0
    for part, size in zip(parts, sizes):
        out[offset:offset + size].view(part.dtype).view(part.shape).copy_(part)
        offset += _aligned(size)
    return out


def _aligned(nbytes: int) -> int:
    """Parts of an exchange buffer start on 8-byte boundaries so that each can be viewed as its dtype."""
    return -(-nbytes // 8) * 8


def _numel(lengths: tuple[int, ...]) -> int:
    n = 1
    for x in lengths:
        n *= x
    return n
