"""``load``: check the state against the checkpoint, plan reads, read each stored byte once, send, fill in place.

Every rank describes the boxes it needs (from its DTensors' placements on any mesh, or whole plain tensors). From
everyone's needs and the metadata, all ranks derive the same plan (reused while the same checkpoint is loaded into
the same layout again): every stored shard that anyone needs is read by exactly one of the ranks needing it (fewest
bytes read so far, largest shards first), checked against all its chunk checksums, and the overlapping sub-boxes
are sent point to point to the other ranks needing them; reading then proceeds in rounds of bounded size, and a
damaged shard found by any rank fails the load on every rank. On one host with a local file system each needing rank
instead reads just the byte span its parts cover (see :mod:`vescale.checkpoint._local_read`: contiguous parts read
straight into their targets, strided ones copied out of a mapping of the span), the page cache serving the repeats;
each checksum chunk is checked by one of the ranks that read it, so the checking is spread and no rank reads bytes
only to check them where a rank reading them anyway can.

A checkpoint is untrusted input, and a load that fails changes nothing: rank 0 checks the metadata against its
schema and the data files' sizes against the storage (:mod:`vescale.checkpoint._schema`) before anything is
allocated from it; every rank then checks everything it will use (its checksum chunks, the decompression of its
compressed shards, the values and the state's own constraints) before any target tensor, optimizer state or value is
written, and the ranks agree on the outcome in one small collective on the checkpoint group (stage, then commit). On
the local path contiguous parts are read to be checked, then read again straight into their targets from the page
cache, and strided parts are checked on a mapping of their span and copied out of it after the agreement; the
read-once path stages everything a rank reads when that fits in ``_ROUND_BYTES`` on every rank, else checks first
and reads again. Any failure raises on every rank, naming the file and the tensor, and leaves every rank's state
bitwise as it was; errors other than corruption (a permission, a failing disk) are agreed on the same way, so no
rank is left waiting in a collective. A one-pass load (``atomic=False``, for a state with nothing to keep) checks
each chunk as it fills its target and agrees once at the end (per round on the read-once path): the same checks and
errors, without the second copy after the agreement, but a failure may leave targets partly written.
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
from vescale.checkpoint._crc import crc32
from vescale.checkpoint._gc import collector_paused
from vescale.checkpoint._layout import intersect, relative
from vescale.checkpoint._local_read import (
    MappedShard,
    byte_span,
    check_chunks_read,
    map_parts,
    read_parts,
    read_parts_checked,
    release_buffer,
)
from vescale.checkpoint._reader import chunk_spans, read_metadata, read_shard, shard_nbytes, tensor_dtype
from vescale.checkpoint._save import wait_pending
from vescale.checkpoint._save_plan import describe
from vescale.checkpoint._schema import check_file_sizes
from vescale.checkpoint._state import flatten
from vescale.checkpoint._storage import Storage
from vescale.checkpoint.errors import CheckpointError, StateMismatchError
from vescale.checkpoint.format import dtype_name

__all__ = ["load", "LoadResult"]

_ROUND_BYTES = 1 << 30
_RUN_BYTES = 32 << 20  # the most a rank checks ahead of another needing the same bytes (see _plan)
_last_plan: tuple[str, list] | None = None  # (what it was planned for, the reads): the plan of the last load


@dataclass
class LoadResult:
    """What a load left out: keys only in the state (``missing``), only in the checkpoint (``unexpected``), and
    keys skipped for a shape mismatch (``mismatched``); all empty after a strict load."""

    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)


def _broadcast_metadata(storage: Storage, comm: Comm) -> tuple[dict[str, Any], int]:
    """Rank 0 reads and checks the metadata and the data files' sizes; every rank gets the metadata and a crc32 of
    it (what a cached plan was made from), or raises the same error (whatever rank 0 met: no rank is left
    waiting)."""
    cause = None
    if comm.rank == 0:
        try:
            meta = read_metadata(storage)
            check_file_sizes(storage, meta)
            payload = b"M" + json.dumps(meta, separators=(",", ":")).encode()
        except Exception as exc:  # noqa: BLE001 - every rank must learn of it, none may hang
            cause = exc
            payload = b"E" + _error_text(exc, f"reading {storage.url} failed").encode()
    else:
        payload = None
    payload = comm.broadcast_bytes(payload, 0)
    if payload[:1] == b"E":
        raise _error_from_text(payload[1:].decode()) from cause
    return json.loads(payload[1:]), crc32(payload)


def _error_text(exc: BaseException, context: str) -> str:
    """``exc`` as "<class>\n<message>" for other ranks: a checkpoint error keeps its class, any other becomes a
    :class:`CheckpointError` whose message says ``context``."""
    if isinstance(exc, CheckpointError):
        return f"{type(exc).__name__}\n{exc}"
    return f"CheckpointError\n{context}: {type(exc).__name__}: {exc}"


def _error_from_text(text: str) -> CheckpointError:
    from vescale.checkpoint import errors

    kind, message = text.split("\n", 1)
    cls = getattr(errors, kind, CheckpointError)
    if cls is errors.StateMismatchError:
        return cls(message, message.split("\n  ")[1:])
    return cls(message) if isinstance(cls, type) and issubclass(cls, CheckpointError) else CheckpointError(message)


def _agree(comm: Comm, error: str | None) -> None:
    """One small collective: every rank's error text (or None); the first one raises on every rank."""
    errors = comm.all_gather_json(error) if comm.world > 1 else [error]
    first = next((e for e in errors if e), None)
    if first:
        raise _error_from_text(first)


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
    # a rank keeps checking consecutive chunks (into the next shard of the file) while it is at most ``slack`` bytes
    # ahead of the least loaded rank needing them: each rank reads its share as long sequential runs, and each reads
    # about as much from the disk (dealt one by one, the ranks took turns on every 1 MiB and whichever rank's
    # readahead ran first read most of the bytes: 28-464 MiB of 1 GiB per rank, replicated, 4 ranks)
    shared = sum(shard_nbytes(g[0].shard) for g in groups if len(g) > 1 and g[0].shard["codec"] == "raw")
    slack = min(_RUN_BYTES, shared // len(requests))
    prev = -1
    for group in sorted(groups, key=lambda g: (-shard_nbytes(g[0].shard), g[0].shard["file"], g[0].shard["start"])):
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
                users = [r for r, ranges in touched.items() if any(a < hi and lo < b for a, b in ranges)] \
                    or list(by_rank)
                r = min(users, key=lambda r: (load[r], r))
                if prev in users and load[prev] - load[r] < slack:
                    r = prev
                by_rank[r].chunks.append(i)
                load[r] += hi - lo
                prev = r
        reads += group
    return reads


def _cached_plan(storage: Storage, meta: dict, digest: int, requests: list[dict], skip: set[str], dedup: bool
                 ) -> list[_Read]:
    """:func:`_plan`, reused while the same checkpoint (path, save id, metadata digest) is loaded into states of the
    same layout."""
    global _last_plan
    key = json.dumps([storage.url, meta["save_id"], digest, dedup, sorted(skip), requests], separators=(",", ":"))
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
         dedup_reads: bool | None = None, atomic: bool = True) -> LoadResult:
    """Load the checkpoint at ``path`` into ``state`` in place, resharding to its current layout; collective.

    Tensors (module parameters and buffers, optimizer states, DTensors on any mesh) are filled in place, values
    are assigned back into ``state``'s containers, stateful objects get ``load_state_dict``. Plain tensors in a stateful
    object's ``state_dict()`` take the checkpoint's shape and dtype (replaced when they differ). Optimizers without
    state yet get it built first. With ``strict`` (default) any missing or unexpected key and any shape or dtype
    mismatch raises :class:`StateMismatchError` listing all of them, on every rank, before any data is read; with
    ``strict=False`` those keys are skipped (dtypes cast) and reported in the returned :class:`LoadResult`.
    Damaged, truncated or malformed data raises :class:`CorruptCheckpointError` naming the file, the field or the
    tensor (checksums are checked unless ``verify=False``; the metadata's schema always). A load that fails on
    any rank raises on every rank and leaves every rank's state as it was: nothing is written before every rank
    has checked what it will use.

    ``atomic=False`` checks each byte as it is read into its target instead (one pass over the bytes, not a check
    pass and then a fill): a load that fails still raises on every rank naming the file and the tensor, and values,
    stateful objects and replaced tensors are still set only after success, but tensors filled in place may hold a
    mix of their old and the stored bytes. For a state with nothing to keep, such as a job resuming into the model
    and optimizer it has just built (``tools/train.py --resume`` does this); the cold load then runs at close to the
    disk's read rate, where the atomic one also copies every byte again after the ranks agree.

    ``threads``: I/O threads per rank (default: the host's CPUs divided among its ranks, 1 to 8).
    ``dedup_reads``: each stored shard is read by one rank and sent to the others needing it (True), or read by
    every rank needing it (False). The default reads once and sends unless the storage is a local file system and
    all ranks run on one host, where the shared page cache already makes the second read a memory copy.
    """
    wait_pending()
    comm = Comm()
    storage = Storage(path, storage_options)
    meta, digest = _broadcast_metadata(storage, comm)
    saved = meta["tensors"]
    error: Exception | None = None
    decoded: dict[str, Any] = {}
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
        for key in flat.values:  # decoded and checked now, assigned only once everything else succeeded
            if key in meta["values"]:
                decoded[key] = _values.decode(meta["values"][key], key)
                flat.check_value(key, decoded[key])
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
    reads = _cached_plan(storage, meta, digest, requests, skip, dedup_reads)
    workers = io_threads(threads, comm)
    with ThreadPoolExecutor(workers) if workers > 1 else contextlib.nullcontext() as pool:  # one: this thread
        if storage.local and not dedup_reads:
            with storage.keep_open():
                _read_local(reads, comm, storage, pieces, saved, verify, pool, atomic)
        else:
            _read_once(reads, comm, storage, pieces, saved, verify, pool, atomic)
    for key, t in replaced.items():
        flat.tensor_setters[key](t)
    for key in flat.values:
        if key not in skip:
            flat.setters[key](decoded[key])
    for finalize in flat.finalizers:
        finalize()
    return result


def _check_reads(mine: list[_Read], storage: Storage, saved: dict, verify: bool, pool: ThreadPoolExecutor | None,
                 keep: bool) -> tuple[dict[int, torch.Tensor], str | None]:
    """Check this rank's reads without writing any target: the checksum ``chunks`` of each (when ``verify``) and
    the decompression of each compressed shard. Returns the decompressed shards (by ``id`` of their read) when
    ``keep``, and the first error as :func:`_error_text` (naming the file and the tensor), or None."""
    staged: dict[int, torch.Tensor] = {}

    def check(rd: _Read) -> None:
        chunks = rd.chunks if verify else []
        try:
            if rd.shard["codec"] != "raw":
                data = read_shard(storage, rd.shard, tensor_dtype(saved[rd.key]), verify=chunks)
                if keep:
                    staged[id(rd)] = data
            elif chunks:
                check_chunks_read(storage, rd.shard, chunks)
        except Exception as exc:  # noqa: BLE001 - agreed on by every rank, then raised
            where = storage.where(rd.shard["file"])
            raise _Failed(_error_text(exc, f"reading {where} failed") + f" (tensor {rd.key!r})") from exc

    try:
        for _ in (pool.map if pool else map)(check, mine):
            pass
    except _Failed as exc:
        return staged, str(exc)
    finally:
        release_buffer()
    return staged, None


class _Failed(Exception):
    """A read that failed, carried as its error text (internal)."""


def _read_local(reads: list[_Read], comm: Comm, storage: Storage, pieces: dict, saved: dict, verify: bool,
                pool: ThreadPoolExecutor | None, atomic: bool) -> None:
    """Every rank reads its own parts of the shards it needs from local files.

    ``atomic``: first each rank checks its share of the chunks (on a mapping of the span where :func:`map_parts`
    gives one, else read into a buffer) and decompresses its compressed shards, the ranks agree that all are intact,
    and only then does each fill its targets (copied out of the mapping, or read again from the page cache): a
    damaged shard found by any rank fails the load on every rank with every target unchanged. Else each read is
    checked as it fills its targets (one pass over the bytes, see :func:`read_parts_checked`) and the ranks agree
    once at the end: a failure still raises on every rank, with targets partly written."""
    # in file order, so that each rank reads each file front to back (also in one pass: ranks needing the same bytes
    # then read them at about the same time, each page coming from the disk once while the others wait on it; with
    # each rank starting at another file, the replicated row at 2 GiB took 1.30-1.41 s against 1.05-1.18)
    mine = sorted((rd for rd in reads if rd.reader == comm.rank), key=lambda rd: (rd.shard["file"], rd.shard["start"]))
    staged: dict[int, torch.Tensor] = {}  # by id of the read: a decompressed shard
    mapped: dict[int, MappedShard] = {}   # by id of the read: the mapped span of a raw shard

    def parts(rd: _Read) -> list[tuple[tuple[int, ...], torch.Tensor]]:
        origin = rd.shard["offsets"]
        out = []
        for _, j, inter in rd.needs:
            piece = pieces[rd.key][j]
            out.append((tuple(o - so for o, so in zip(inter[0], origin)), piece.view[relative(inter, piece.offsets)]))
        return out

    def check(rd: _Read, fill_unmapped: bool = False) -> None:
        """Check ``rd``'s chunks (and stage or map what the fill needs); ``fill_unmapped``: a raw shard that is not
        mapped is read into its targets, each chunk checked there (one pass)."""
        chunks = rd.chunks if verify else []
        dtype = tensor_dtype(saved[rd.key])
        if rd.shard["codec"] != "raw":
            staged[id(rd)] = read_shard(storage, rd.shard, dtype, verify=chunks)
            return
        targets = parts(rd)
        m = map_parts(storage, rd.shard, dtype, targets, chunks)
        if m is None:
            if fill_unmapped:
                read_parts_checked(storage, rd.shard, dtype, targets, chunks)
            elif chunks:
                check_chunks_read(storage, rd.shard, chunks)
            return
        mapped[id(rd)] = m
        m.check(chunks)

    def fill(rd: _Read) -> None:
        dtype = tensor_dtype(saved[rd.key])
        if id(rd) in mapped:
            mapped.pop(id(rd)).fill_and_close(dtype, parts(rd))
        elif rd.shard["codec"] == "raw":
            read_parts(storage, rd.shard, dtype, parts(rd))
        else:
            data = staged.pop(id(rd))
            for offs, target in parts(rd):
                target.copy_(data[tuple(slice(o, o + n) for o, n in zip(offs, target.shape))])

    def check_and_fill(rd: _Read) -> None:
        check(rd, fill_unmapped=True)
        if id(rd) in mapped or id(rd) in staged:
            fill(rd)

    def named(fn):
        def run(rd: _Read) -> None:
            try:
                fn(rd)
            except Exception as exc:  # noqa: BLE001 - agreed on by every rank, then raised
                where = storage.where(rd.shard["file"])
                raise _Failed(_error_text(exc, f"reading {where} failed") + f" (tensor {rd.key!r})") from exc
        return run

    try:
        try:
            failures = _run_all(named(check if atomic else check_and_fill), mine, pool)
        finally:
            release_buffer()
        _agree(comm, str(failures[0]) if failures else None)
        if atomic:
            failures = _run_all(fill, mine, pool)
            if failures:
                raise failures[0]
    finally:
        release_buffer()
        for m in mapped.values():
            m.close()


def _run_all(fn, items: list, pool: ThreadPoolExecutor | None) -> list[BaseException]:
    """Run ``fn`` on every item (on ``pool`` when given) until all have finished, even after some raised (no task
    may still use a mapping when it is closed); the exceptions raised, in the order of ``items``."""
    def run(item) -> BaseException | None:
        try:
            fn(item)
        except Exception as exc:  # noqa: BLE001 - returned to the caller, which raises or agrees on it
            return exc
        return None

    return [exc for exc in (pool.map if pool else map)(run, items) if exc is not None]


def _read_once(reads: list[_Read], comm: Comm, storage: Storage, pieces: dict, saved: dict, verify: bool,
               pool: ThreadPoolExecutor | None, atomic: bool) -> None:
    """Each stored shard read by one rank and sent to the others needing it. ``atomic``: when what every rank reads
    fits in one round, the round stages it all (read, checked, agreed) before any target is filled; otherwise every
    rank first checks its shards (read and discarded), the ranks agree, and the rounds then read again unchecked.
    Else the rounds read once, checking as they read (straight into the targets where they can), agreeing per
    round before any part is sent."""
    batches = _rounds(reads)
    if not atomic:
        for batch in batches:
            _run_round(batch, comm, storage, pieces, saved, verify, pool, staged=False)
        return
    if len(batches) <= 1:
        for batch in batches:
            _run_round(batch, comm, storage, pieces, saved, verify, pool, staged=True)
        return
    _, error = _check_reads([rd for rd in reads if rd.reader == comm.rank], storage, saved, verify, pool, keep=False)
    _agree(comm, error)
    for batch in batches:
        _run_round(batch, comm, storage, pieces, saved, False, pool, staged=False)


def _run_round(batch: list[_Read], comm: Comm, storage: Storage, pieces: dict, saved: dict, verify: bool,
               pool: ThreadPoolExecutor | None, staged: bool) -> None:
    """Read this rank's shards of ``batch``, agree that all ranks' reads succeeded, then send and fill. ``staged``:
    nothing is read straight into a target (the round is the whole load and must change nothing if it fails)."""
    me = comm.rank

    def read(rd: _Read) -> tuple[torch.Tensor, bool, tuple[int, ...]]:
        """(the shard, whether read straight into the target, global offsets of its first element), its
        ``chunks`` checked."""
        dtype = tensor_dtype(saved[rd.key])
        box = (tuple(rd.shard["offsets"]), tuple(rd.shard["lengths"]))
        direct = None
        for r, j, inter in rd.needs:
            if r == me and inter == box and rd.shard["codec"] == "raw" and not staged:
                piece = pieces[rd.key][j]
                view = piece.view[relative(inter, piece.offsets)]
                if view.device.type == "cpu" and view.dtype == dtype and view.is_contiguous():
                    direct = view
        try:
            data = read_shard(storage, rd.shard, dtype, verify=rd.chunks if verify else False, out=direct)
        except Exception as exc:  # noqa: BLE001 - agreed on by every rank, then raised
            where = storage.where(rd.shard["file"])
            raise _Failed(_error_text(exc, f"reading {where} failed") + f" (tensor {rd.key!r})") from exc
        return data, direct is not None, box[0]

    mine = [rd for rd in batch if rd.reader == me]
    data: dict[int, tuple[torch.Tensor, bool, tuple[int, ...]]] = {}
    error = None
    try:
        for rd, got in zip(mine, (pool.map if pool else map)(read, mine)):
            data[id(rd)] = got
    except _Failed as exc:
        error = str(exc)
    _agree(comm, error)

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
