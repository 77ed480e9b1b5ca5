"""``load``: check the state against the checkpoint, plan reads, read each stored byte once, send, fill in place.

Every rank describes the boxes it needs (from its DTensors' placements on any mesh, or whole plain tensors). From
everyone's needs and the metadata, all ranks derive the same plan (reused while the same checkpoint is loaded into
the same layout again): every stored shard that anyone needs is read by exactly one of the ranks needing it (fewest
bytes read so far, largest shards first), checked against all its chunk checksums, and the overlapping sub-boxes
are sent point to point to the other ranks needing them; reading then proceeds in rounds of bounded size, and a
damaged shard found by any rank fails the load on every rank before the targets of its round are filled. On one
host with a local file system each needing rank instead reads, with one positional read, just the byte span its
parts cover (see :mod:`vescale.checkpoint._local_read`), the page cache serving the repeats; each checksum chunk is
checked by one of the ranks that read it, so the checking is spread and no rank reads bytes only to check them
where a rank reading them anyway can. A damaged shard found by any rank fails the load on every rank (targets may
then be partly filled). A needing rank whose target is exactly the stored shard reads straight into its memory.
"""

from __future__ import annotations

import contextlib
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
from vescale.checkpoint._gc import collector_paused
from vescale.checkpoint._layout import intersect, relative
from vescale.checkpoint._local_read import byte_span, read_parts, release_buffer
from vescale.checkpoint._reader import chunk_spans, read_metadata, read_shard, shard_nbytes, tensor_dtype
from vescale.checkpoint._save import wait_pending
from vescale.checkpoint._save_plan import describe
from vescale.checkpoint._state import flatten
from vescale.checkpoint._storage import Storage
from vescale.checkpoint.errors import CheckpointError, CorruptCheckpointError, StateMismatchError
from vescale.checkpoint.format import dtype_name

__all__ = ["load", "LoadResult"]

_ROUND_BYTES = 1 << 30
_last_plan: tuple[str, list] | None = None  # (what it was planned for, the reads): the plan of the last load


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
    chunks: list[int] = field(default_factory=list)  # checksum chunks of the shard this reader checks


def _plan(requests: list[dict], meta: dict, skip: set[str], dedup: bool) -> list[_Read]:
    """Who reads which stored shard. ``dedup``: one reader per shard, which checks it whole and sends the others
    their parts; else every needing rank reads its own parts, and the shard's checksum chunks are shared out among
    them (each chunk to a rank that reads bytes in it, the least loaded first), so that every stored byte is checked
    once and no rank reads a byte only to check it when a rank that needs the byte can."""
    groups: list[list[_Read]] = []
    itemsize = {}
    for key in sorted({k for req in requests for k in req["tensors"]} - skip):
        itemsize[key] = tensor_dtype(meta["tensors"][key]).itemsize
        for shard in meta["tensors"][key]["shards"]:
            box = (tuple(shard["offsets"]), tuple(shard["lengths"]))
            needs = []
            for r, req in enumerate(requests):
                for j, (offs, lens) in enumerate(req["tensors"].get(key, (None, None, []))[2]):
                    inter = intersect(box, (tuple(offs), tuple(lens)))
                    if inter is not None and (all(inter[1]) or not inter[1]):
                        needs.append((r, j, inter))
            if not needs:
                continue
            if dedup:
                groups.append([_Read(key, shard, -1, needs)])
            else:
                groups.append([_Read(key, shard, r, [n for n in needs if n[0] == r])
                               for r in sorted({n[0] for n in needs})])
    load = [0] * len(requests)
    reads = []
    for group in sorted(groups, key=lambda g: -shard_nbytes(g[0].shard)):
        shard = group[0].shard
        spans = chunk_spans(shard)
        if dedup:
            read = group[0]
            read.reader = min({r for r, _, _ in read.needs}, key=lambda r: (load[r], r))
            read.chunks = list(range(len(spans)))
            load[read.reader] += shard_nbytes(shard)
        elif shard["codec"] != "raw":  # compressed: each reader decompresses it whole; one of them checks it
            primary = min(group, key=lambda rd: (load[rd.reader], rd.reader))
            primary.chunks = list(range(len(spans)))
            load[primary.reader] += shard_nbytes(shard)
        else:
            size = itemsize[group[0].key]
            origin = shard["offsets"]
            touched = {rd.reader: [byte_span(tuple(o - so for o, so in zip(inter[0], origin)), inter[1],
                                             shard["lengths"], size) for _, _, inter in rd.needs] for rd in group}
            by_rank = {rd.reader: rd for rd in group}
            for i, (lo, hi) in enumerate(spans):
                users = [r for r, ranges in touched.items() if any(a < hi and lo < b for a, b in ranges)]
                r = min(users or list(by_rank), key=lambda r: (load[r], r))
                by_rank[r].chunks.append(i)
                load[r] += hi - lo
        reads += group
    return reads


def _cached_plan(storage: Storage, meta: dict, requests: list[dict], skip: set[str], dedup: bool) -> list[_Read]:
    """:func:`_plan`, reused while the same checkpoint (path and save id) is loaded into states of the same layout."""
    global _last_plan
    key = json.dumps([storage.url, meta["save_id"], dedup, sorted(skip), requests], separators=(",", ":"))
    if _last_plan is None or _last_plan[0] != key:
        _last_plan = (key, _plan(requests, meta, skip, dedup))
    return _last_plan[1]


def _rounds(reads: list[_Read]) -> list[list[_Read]]:
    """Consecutive groups of reads whose shards, held in memory together, stay under ``_ROUND_BYTES``."""
    rounds, current, size = [], [], 0
    for read in reads:
        n = shard_nbytes(read.shard)
        if current and size + n > _ROUND_BYTES:
            rounds.append(current)
            current, size = [], 0
        current.append(read)
        size += n
    return rounds + ([current] if current else [])


@collector_paused
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
    reads = _cached_plan(storage, meta, requests, skip, dedup_reads)
    workers = io_threads(threads, comm)
    with ThreadPoolExecutor(workers) if workers > 1 else contextlib.nullcontext() as pool:  # one: this thread
        if storage.local and not dedup_reads:
            _read_local(reads, comm, storage, pieces, saved, verify, pool)
        else:
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


def _read_local(reads: list[_Read], comm: Comm, storage: Storage, pieces: dict, saved: dict, verify: bool,
                pool: ThreadPoolExecutor | None) -> None:
    """Every rank reads its own parts of the shards it needs from local files and checks its share of the chunks;
    a damaged shard found by any rank fails the load on every rank (targets may then be partly filled)."""

    def fill(rd: _Read) -> None:
        dtype = tensor_dtype(saved[rd.key])
        origin = rd.shard["offsets"]
        parts = []
        for _, j, inter in rd.needs:
            piece = pieces[rd.key][j]
            parts.append((tuple(o - so for o, so in zip(inter[0], origin)), piece.view[relative(inter, piece.offsets)]))
        chunks = rd.chunks if verify else []
        if rd.shard["codec"] == "raw":
            read_parts(storage, rd.shard, dtype, parts, chunks)
            return
        data = read_shard(storage, rd.shard, dtype, verify=chunks)
        for offs, target in parts:
            target.copy_(data[tuple(slice(o, o + n) for o, n in zip(offs, target.shape))])

    error = None
    try:
        for _ in (pool.map if pool else map)(fill, [rd for rd in reads if rd.reader == comm.rank]):
            pass
    except CorruptCheckpointError as exc:
        error = str(exc)
    finally:
        release_buffer()
    first = next((e for e in (comm.all_gather_json(error) if comm.world > 1 else [error]) if e), None)
    if first:
        raise CorruptCheckpointError(first)


def _run_round(batch: list[_Read], comm: Comm, storage: Storage, pieces: dict, saved: dict, verify: bool,
               pool: ThreadPoolExecutor | None) -> None:
    me = comm.rank

    def read(rd: _Read) -> tuple[torch.Tensor, bool, tuple[int, ...]]:
        """(the shard, whether read straight into the target, global offsets of its first element), its
        ``chunks`` checked."""
        dtype = tensor_dtype(saved[rd.key])
        box = (tuple(rd.shard["offsets"]), tuple(rd.shard["lengths"]))
        direct = None
        for r, j, inter in rd.needs:
            if r == me and inter == box and rd.shard["codec"] == "raw":
                piece = pieces[rd.key][j]
                view = piece.view[relative(inter, piece.offsets)]
                if view.device.type == "cpu" and view.dtype == dtype and view.is_contiguous():
                    direct = view
        data = read_shard(storage, rd.shard, dtype, verify=rd.chunks if verify else False, out=direct)
        return data, direct is not None, box[0]

    mine = [rd for rd in batch if rd.reader == me]
    data: dict[int, tuple[torch.Tensor, bool, tuple[int, ...]]] = {}
    error = None
    try:
        for rd, got in zip(mine, (pool.map if pool else map)(read, mine)):
            data[id(rd)] = got
    except CorruptCheckpointError as exc:
        error = str(exc)
    errors = [e for e in comm.all_gather_json(error)] if comm.world > 1 else [error]
    first = next((e for e in errors if e), None)
    if first:
        raise CorruptCheckpointError(first)

    # Every part travels as its own message, in the order of the batch on both sides: sent straight from the shard
    # when it is contiguous there, received straight into the target when that is a contiguous CPU tensor of the
    # stored dtype (no packing, no unpacking, no buffers the size of everything sent).
    sends: dict[int, list[torch.Tensor]] = {}
    recvs: dict[int, list[torch.Tensor]] = {}
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []  # (target, received temporary)
    for rd in batch:
        dtype = tensor_dtype(saved[rd.key])
        for r, j, inter in rd.needs:
            if not _numel(inter[1]):
                continue
            if rd.reader == me and r != me:
                shard, _, origin = data[id(rd)]
                sends.setdefault(r, []).append(_as_bytes(shard[relative(inter, origin)].contiguous()))
            elif r == me:
                piece = pieces[rd.key][j]
                target = piece.view[relative(inter, piece.offsets)]
                if rd.reader == me:
                    shard, direct, origin = data[id(rd)]
                    if not direct:
                        target.copy_(shard[relative(inter, origin)])
                    continue
                if target.device.type == "cpu" and target.dtype == dtype and target.is_contiguous():
                    recvs.setdefault(rd.reader, []).append(_as_bytes(target))
                else:
                    temp = torch.empty(inter[1], dtype=dtype)
                    recvs.setdefault(rd.reader, []).append(_as_bytes(temp))
                    copies.append((target, temp))
    if comm.world > 1:
        comm.exchange(sends, recvs)
    for target, temp in copies:
        target.copy_(temp)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's memory as a flat uint8 tensor (the same memory)."""
    return t.reshape(-1).view(torch.uint8)


def _numel(lengths: tuple[int, ...]) -> int:
    n = 1
    for x in lengths:
        n *= x
    return n
