"""``save``: plan who writes which box, snapshot, write one safetensors file per writing rank, commit metadata.

Every rank describes the boxes it holds; identical boxes held by several ranks (replicas) are written once, by the
holder with the fewest bytes assigned so far, largest boxes first, so writing is spread evenly. The plan is cached
and reused while the state keeps the same structure (a one-integer all-reduce confirms it on every rank). An async
save snapshots the boxes this rank writes into a reused host buffer (pinned when on GPU) and returns; a background
thread writes, gathers the shard records and lets rank 0 commit ``metadata.json`` last, which makes the checkpoint
visible atomically; the replaced save's files are then deleted in the background.

In an async save, the tensors that only an optimizer step changes in place (trainable parameters and optimizer
state) are copied on the background thread, while the caller goes on with its next forward and backward; every
``torch.optim`` optimizer's ``step()`` waits until that copy is done first (a global step pre-hook), and a tensor
found changed in place before it was copied fails the save (the previous checkpoint stays). Everything else
(buffers, plain tensors, values) is copied before ``save`` returns.
"""

from __future__ import annotations

import json
import os
import queue
import random
import re
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from vescale.checkpoint import _values
from vescale.checkpoint._comm import Comm, io_threads
from vescale.checkpoint._crc import crc32
from vescale.checkpoint._gc import collector_paused
from vescale.checkpoint._layout import Piece, is_dtensor, local_pieces
from vescale.checkpoint._state import Flat, flatten
from vescale.checkpoint._storage import Storage
from vescale.checkpoint.errors import CheckpointError
from vescale.checkpoint.format import (
    CHUNK_BYTES,
    FORMAT_NAME,
    FORMAT_VERSION,
    METADATA_FILE,
    data_file_name,
    dtype_name,
    safetensors_header,
)

__all__ = ["save", "SaveHandle"]

_COMPRESS_MIN_BYTES = 4096
_ALIGN = 64  # staging slots start on cache-line boundaries, so that every dtype view is aligned
_COPY_SLICE = 16 << 20  # bytes per copy when several threads snapshot
_DATA_FILE = re.compile(r"data-([0-9a-f]+)-r\d+\.safetensors")


class SaveHandle:
    """A save in progress (async) or finished. ``wait()`` blocks until it is committed and re-raises its error;
    ``wait_snapshot()`` until this rank's data is copied to host memory, after which the state may change freely.
    ``fence_wait_s``: the seconds optimizer steps on this rank spent waiting for that copy."""

    def __init__(self, path: str, finished: threading.Event | None = None) -> None:
        self.path = path
        self._finished = finished
        self._snapshotted: threading.Event | None = None
        self.error: BaseException | None = None
        self._reported = False  # its error was raised to the caller once (a later save or load does not again)
        self.fence_wait_s = 0.0

    def done(self) -> bool:
        return self._finished is None or self._finished.is_set()

    def snapshot_done(self) -> bool:
        return self._snapshotted is None or self._snapshotted.is_set()

    def wait_snapshot(self, timeout: float | None = None) -> None:
        """Block until this rank's state is copied (a failed copy returns too; ``wait()`` raises its error).
        Needed only before changing saved tensors in place other than by ``optimizer.step()``, which waits itself."""
        if self._snapshotted is not None and not self._snapshotted.wait(timeout):
            raise TimeoutError(f"snapshot for checkpoint {self.path} still running after {timeout} s")

    def wait(self, timeout: float | None = None) -> None:
        """Block until the checkpoint is committed on every rank; raise what the save raised."""
        if self._finished is not None and not self._finished.wait(timeout):
            raise TimeoutError(f"checkpoint save to {self.path} still running after {timeout} s")
        if self.error is not None:
            self._reported = True
            raise self.error


@dataclass
class _Job:
    key: str
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    dtype: torch.dtype
    source: torch.Tensor
    #: set for a job copied in the background: the tensors whose in-place change would alter its data (the local
    #: piece and, for a DTensor, the DTensor, whose in-place ops count on its own counter) and their version counters
    #: when ``save`` was called
    watched: tuple[torch.Tensor, ...] = ()
    version: tuple[int, ...] | None = None


@dataclass
class _Plan:
    signature: str
    mine: list[tuple[str, tuple[int, ...]]]   # (key, offsets) this rank writes, in file order
    tensors: dict[str, dict[str, Any]]          # key -> {"dtype", "shape"}
    staging: torch.Tensor | None = None


_pending: SaveHandle | None = None
_worker: threading.Thread | None = None
_work: queue.SimpleQueue = queue.SimpleQueue()
_cleanup: threading.Thread | None = None
_cached: _Plan | None = None
_fence_installed = False


def describe(flat: Flat, tensors: dict[str, torch.Tensor]) -> tuple[dict[str, Any], dict[str, list[Piece]],
                                                                     dict[str, torch.dtype]]:
    """Per key: [dtype name, global shape, boxes held here] (what ranks exchange), the local pieces, the dtypes."""
    desc, pieces, dtypes = {}, {}, {}
    entries = [(k, list(t.shape), t.dtype, local_pieces(t, k)) for k, t in tensors.items()]
    entries += [(k, shape, dtype, ps) for k, (shape, dtype, ps) in flat.boxes.items()]
    for key, shape, dtype, ps in entries:
        pieces[key] = ps
        dtypes[key] = dtype
        desc[key] = [dtype_name(dtype, key), shape, [[list(p.offsets), list(p.lengths)] for p in ps]]
    return desc, pieces, dtypes


def _assign_writers(descs: list[dict[str, Any]], rank: int) -> tuple[list, dict]:
    """The (key, offsets) boxes ``rank`` writes and the global tensor table; identical on every rank."""
    tensors: dict[str, dict[str, Any]] = {}
    holders: dict[tuple[str, tuple, tuple], list[int]] = {}
    problems = []
    for r, desc in enumerate(descs):
        for key, (dt, shape, boxes) in desc.items():
            info = tensors.setdefault(key, {"dtype": dt, "shape": shape})
            if (info["dtype"], info["shape"]) != (dt, shape):
                problems.append(f"{key}: rank {r} has {dt}{shape}, another rank {info['dtype']}{info['shape']}")
            for offs, lens in boxes:
                holders.setdefault((key, tuple(offs), tuple(lens)), []).append(r)
    if problems:
        raise CheckpointError("ranks disagree on the global dtype/shape of saved tensors:\n  " + "\n  ".join(problems))
    covered: dict[str, int] = {}
    for key, _, lens in holders:
        n = 1
        for x in lens:
            n *= x
        covered[key] = covered.get(key, 0) + n
    for key, info in tensors.items():
        total = 1
        for x in info["shape"]:
            total *= x
        if covered.get(key, 0) != total and total:
            raise CheckpointError(f"tensor {key!r} of shape {info['shape']}: the ranks' shards cover "
                                  f"{covered.get(key, 0)} of {total} elements (overlapping or missing shards)")
    load = [0] * len(descs)
    mine = []
    itemsize = {k: torch.empty(0, dtype=_dtype(v["dtype"])).element_size() for k, v in tensors.items()}
    order = sorted(holders, key=lambda b: (-_numel(b[2]) * itemsize[b[0]], b[0], b[1]))
    for box in order:
        writer = min(holders[box], key=lambda r: (load[r], r))
        load[writer] += _numel(box[2]) * itemsize[box[0]]
        if writer == rank:
            mine.append((box[0], box[1]))
    return mine, tensors


def _dtype(name: str) -> torch.dtype:
    from vescale.checkpoint.format import dtype_from_name

    return dtype_from_name(name)


def _numel(lengths: tuple[int, ...]) -> int:
    n = 1
    for x in lengths:
        n *= x
    return n


@collector_paused
def save(path: str | os.PathLike, state: dict[str, Any], *, async_save: bool = False, compress: bool = False,
         storage_options: dict[str, Any] | None = None, threads: int | None = None) -> SaveHandle:
    """Save ``state`` to the checkpoint directory ``path`` (local path or fsspec URL); collective over all ranks.

    ``state`` maps names to modules, optimizers, tensors/DTensors, JSON-able values or stateful objects (see
    :mod:`vescale.checkpoint`). Plain tensors are taken to be replicated: one copy is written. With
    ``async_save=True`` it returns once the writers are planned and this rank's buffers, plain tensors and values are
    snapshotted to host memory; trainable parameters and optimizer state are copied in the background, and the
    next ``optimizer.step()`` of any ``torch.optim`` optimizer in this process waits for that copy. Changing those
    tensors in place any other way before ``handle.wait_snapshot()`` returns fails the save (a changed version
    counter is detected; the previous checkpoint stays). The handle's ``wait()`` blocks until the checkpoint is
    committed (a later ``save`` or ``load`` waits for it first).
    ``compress=True`` stores each tensor zstd-compressed. ``threads``: I/O threads per rank (default: the host's
    CPUs divided among its ranks, 1 to 8). The checkpoint becomes visible only when complete; a
    previous checkpoint at ``path`` stays loadable until then and its data files are deleted after.
    """
    global _pending, _cached
    wait_pending()
    comm = Comm()
    error: Exception | None = None
    signature = ""
    try:
        flat = flatten(state)
        tensors = {k: _materialize(t) for k, t in flat.tensors.items()}
        values = {k: _values.encode(v, k) for k, v in flat.values.items()}
        desc, pieces, dtypes = describe(flat, tensors)
        signature = json.dumps([comm.world, desc], separators=(",", ":"))
    except Exception as exc:  # noqa: BLE001 - bad input: every rank must learn of it, none may hang
        error = exc
    early: tuple[list[_Job], _Deferred | None] | None = None
    if async_save and error is None and _cached is not None and _cached.signature == signature:
        try:  # the cached plan holds here: snapshot now, while the ranks agree that it holds everywhere
            early = _stage(_cached, _jobs(_cached, pieces, dtypes, flat.stepped, tensors), io_threads(threads, comm))
        except Exception as exc:  # noqa: BLE001 - every rank must learn of it, none may hang
            error = exc
    miss, nonce, failed = comm.all_reduce_max([int(_cached is None or _cached.signature != signature),
                                               random.getrandbits(62), int(error is not None)])
    if error is not None:
        raise error
    if failed:
        raise CheckpointError(f"save to {os.fspath(path)} aborted: another rank rejected its state (see its error)")
    if miss:  # some rank's structure changed: plan again (a snapshot taken early is for the old plan)
        mine, table = _assign_writers(comm.all_gather_json(desc), comm.rank)
        _cached = _Plan(signature, mine, table)
        early = None
    plan = _cached
    save_id = f"{nonce:016x}"
    storage = Storage(path, storage_options)
    storage.makedirs()
    deferred: _Deferred | None = None
    if async_save:
        if early is None:
            early = _stage(plan, _jobs(plan, pieces, dtypes, flat.stepped, tensors), io_threads(threads, comm))
        jobs, deferred = early
    else:
        jobs = _jobs(plan, pieces, dtypes, set(), tensors)
        for job in jobs:
            if job.source.device.type != "cpu" or not job.source.is_contiguous():
                job.source = job.source.to("cpu", copy=False).contiguous()
    handle = SaveHandle(storage.url)
    args = (handle, comm, storage, save_id, jobs, values, plan.tensors, compress, threads, deferred)
    if not async_save:
        _finish(*args)
        handle.wait()
        return handle
    handle._finished = threading.Event()
    handle._snapshotted = threading.Event()
    if deferred is None:
        handle._snapshotted.set()
    else:
        _install_fence()
    _pending = handle
    _in_background(_finish, args, handle)
    return handle


def _install_fence() -> None:
    """Make every ``torch.optim`` optimizer step in this process wait for the background snapshot (once)."""
    global _fence_installed
    if not _fence_installed:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        register_optimizer_step_pre_hook(_fence)
        _fence_installed = True


def _fence(optimizer, args, kwargs) -> None:
    handle = _pending
    if handle is not None and not handle.snapshot_done():
        t0 = time.perf_counter()
        handle.wait_snapshot()
        handle.fence_wait_s += time.perf_counter() - t0


def _in_background(fn, args: tuple, handle: SaveHandle) -> None:
    """Run ``fn(*args)`` on this process's save thread, then mark ``handle`` snapshotted (never leaving an optimizer
    step waiting, whatever ``fn`` did) and finished. The thread is started once and kept:
    starting one per save would make ``save`` wait until the new thread first runs, which on a busy host is long."""
    global _worker
    if _worker is None or not _worker.is_alive():
        _worker = threading.Thread(target=_serve, name="vescale-checkpoint-save", daemon=True)
        _worker.start()
    _work.put((fn, args, handle))


def _serve() -> None:
    while True:
        fn, args, handle = _work.get()
        try:
            fn(*args)  # _finish keeps its own errors on the handle
        finally:
            handle._snapshotted.set()
            handle._finished.set()


def _jobs(plan: _Plan, pieces: dict[str, list[Piece]], dtypes: dict[str, torch.dtype], stepped: set[str],
          tensors: dict[str, torch.Tensor]) -> list[_Job]:
    """The boxes ``plan`` has this rank write, as jobs reading from the local pieces; those of ``stepped`` keys
    carry version counters, marking them to be copied in the background."""
    by_box = {(k, p.offsets): p for k, ps in pieces.items() for p in ps}
    jobs = []
    for key, offs in plan.mine:
        piece = by_box[(key, tuple(offs))]
        job = _Job(key, piece.offsets, piece.lengths, dtypes[key], piece.view)
        if key in stepped:
            watched = (piece.view,) + ((tensors[key],) if key in tensors and is_dtensor(tensors[key]) else ())
            try:
                job.version = tuple(t._version for t in watched)
                job.watched = watched
            except RuntimeError:  # an inference tensor has no version counter: copy it now
                pass
        jobs.append(job)
    return jobs


def wait_pending() -> None:
    """Wait for this process's async save in flight and for the removal of replaced data files, if any
    (``save`` and ``load`` call it first); raise the save's error unless its ``wait()`` already did."""
    global _pending, _cleanup
    if _pending is not None:
        handle, _pending = _pending, None
        if not handle._reported:
            handle.wait()
    if _cleanup is not None:
        thread, _cleanup = _cleanup, None
        thread.join()


def _materialize(t: torch.Tensor) -> torch.Tensor:
    """A Partial DTensor is reduced to Replicate so that what is saved is the tensor's value. Other DTensors are
    kept as they are (detaching one costs a dispatch; :func:`local_pieces` detaches the local tensor instead)."""
    if is_dtensor(t):
        if any(p.is_partial() for p in t.placements):
            from torch.distributed.tensor import Replicate

            return t.redistribute(t.device_mesh, [Replicate() if p.is_partial() else p for p in t.placements]).detach()
        return t
    return t.detach()


@dataclass
class _Deferred:
    """Background copies of an async save: (job, its host slot) pairs, ``threads`` copying, and on GPU the event
    recorded on the saving thread's stream when ``save`` was called (the copies wait for it)."""

    pairs: list[tuple[_Job, torch.Tensor]]
    threads: int
    ready: tuple[torch.device, Any] | None = None


def _stage(plan: _Plan, jobs: list[_Job], threads: int = 1) -> tuple[list[_Job], _Deferred | None]:
    """Give each job a slot in the plan's reused host buffer (pinned when on GPU); copy the jobs without a version
    now, with ``threads`` threads, and return the others (to be copied in the background) as a :class:`_Deferred`
    (None when there are none). Each copied job reads from its slot afterwards."""
    sizes = [-(-_numel(j.lengths) * j.source.element_size() // _ALIGN) * _ALIGN for j in jobs]
    total = sum(sizes)
    on_gpu = torch.cuda.is_available() and any(j.source.is_cuda for j in jobs)
    if plan.staging is None or plan.staging.numel() != total or (on_gpu and not plan.staging.is_pinned()):
        plan.staging = torch.empty(total, dtype=torch.uint8, pin_memory=on_gpu)
    now, later = [], []
    offset = 0
    for job, size in zip(jobs, sizes):
        nbytes = _numel(job.lengths) * job.source.element_size()
        dst = plan.staging[offset:offset + nbytes].view(job.dtype).view(job.lengths)
        (later if job.version is not None else now).append((job, dst))
        offset += size
    _copy(now, threads)
    if not later:
        return jobs, None
    deferred = _Deferred(later, threads)
    cuda = [job.source.device for job, _ in later if job.source.is_cuda]
    if cuda:  # the background copies must see every write queued so far on this thread's stream
        deferred.ready = (cuda[0], torch.cuda.current_stream(cuda[0]).record_event())
    return jobs, deferred


def _copy(pairs: list[tuple[_Job, torch.Tensor]], threads: int) -> None:
    """Copy each job's source into its host slot (slices of at most ``_COPY_SLICE`` bytes shared among ``threads``
    threads when there are several), then point the job at the slot."""
    copies = []
    for job, dst in pairs:
        nbytes = dst.numel() * dst.element_size()
        if threads > 1 and job.source.is_contiguous() and nbytes > _COPY_SLICE and not job.source.is_cuda:
            flat_dst, flat_src = dst.reshape(-1), job.source.reshape(-1)
            step = max(1, _COPY_SLICE // job.source.element_size())
            copies += [(flat_dst[lo:lo + step], flat_src[lo:lo + step]) for lo in range(0, flat_dst.numel(), step)]
        else:
            copies.append((dst, job.source))
    if threads > 1 and len(copies) > 1:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(lambda c: c[0].copy_(c[1], non_blocking=True), copies))
    else:
        for dst, src in copies:
            dst.copy_(src, non_blocking=True)
    for device in {job.source.device for job, _ in pairs if job.source.is_cuda}:  # copies to pinned memory are
        torch.cuda.current_stream(device).synchronize()  # asynchronous: wait for them
    for job, dst in pairs:
        job.source = dst


def _copy_deferred(deferred: _Deferred) -> None:
    """The background part of an async snapshot; raises if a source changed in place before it was copied."""
    if deferred.ready is not None:  # GPU: copy on a side stream once the saving thread's earlier writes are done
        device, event = deferred.ready
        stream = torch.cuda.Stream(device=device)
        with torch.cuda.stream(stream):
            stream.wait_event(event)
            _copy(deferred.pairs, deferred.threads)
    else:
        _copy(deferred.pairs, deferred.threads)
    changed = sorted({job.key for job, _ in deferred.pairs if tuple(t._version for t in job.watched) != job.version})
    if changed:
        raise CheckpointError(
            f"{len(changed)} tensors were changed in place after save(async_save=True) returned and before they "
            f"were copied: {', '.join(changed[:8])}{' ...' if len(changed) > 8 else ''}. Only optimizer.step() "
            "waits for the copy by itself; call handle.wait_snapshot() before changing them any other way")


def _write(storage: Storage, name: str, jobs: list[_Job], compress: bool, pool: ThreadPoolExecutor) -> list[dict]:
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


def _finish(handle: SaveHandle, comm: Comm, storage: Storage, save_id: str, jobs: list[_Job], values: dict,
            tensors: dict, compress: bool, threads: int | None, deferred: _Deferred | None) -> None:
    """Finish the snapshot, write, gather the records on every rank, commit on rank 0, and agree on the outcome
    (collective)."""
    records: list[dict] = []
    error = None
    name = data_file_name(save_id, comm.rank)
    size = 0
    try:
        if deferred is not None:
            try:
                _copy_deferred(deferred)
            except CheckpointError as exc:
                error = f"rank {comm.rank}: {exc}"
            finally:
                handle._snapshotted.set()
        if jobs and error is None:
            with ThreadPoolExecutor(io_threads(threads, comm)) as pool:
                records = _write(storage, name, jobs, compress, pool)
            size = storage.size(name)
    except Exception as exc:  # noqa: BLE001 - reported to every rank below, then raised
        error = f"rank {comm.rank} failed writing {storage.where(name)}: {exc!r}\n{traceback.format_exc()}"
    try:
        gathered = comm.all_gather_json({"records": records, "values": values, "error": error,
                                         "file": [name, size] if jobs else None})
        errors = [g["error"] for g in gathered if g["error"]]
        status = b""
        if comm.rank == 0:
            if errors:
                status = errors[0].encode()
            else:
                try:
                    _commit(storage, save_id, comm.world, gathered, tensors)
                except Exception as exc:  # noqa: BLE001 - reported to every rank
                    status = f"rank 0 failed to commit {storage.where(METADATA_FILE)}: {exc!r}".encode()
        status = comm.broadcast_bytes(status, 0)
        if status:
            raise CheckpointError(f"saving {storage.url} failed: {status.decode()}")
        if comm.rank == 0:  # the new checkpoint is committed: the previous save's files go, in the background
            _start_cleanup(storage, _stale(storage, save_id))
    except BaseException as exc:  # noqa: BLE001 - kept for wait()
        handle.error = exc


def _commit(storage: Storage, save_id: str, world: int, gathered: list[dict], tensors: dict) -> None:
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


def _stale(storage: Storage, save_id: str) -> list[str]:
    """Data files of other saves and leftover temporary metadata in the checkpoint directory."""
    stale = []
    for name in storage.names():
        m = _DATA_FILE.fullmatch(name)
        if (m and m.group(1) != save_id) or (name.startswith(f".{METADATA_FILE}.") and name.endswith(".tmp")):
            stale.append(name)
    return stale


def _start_cleanup(storage: Storage, names: list[str]) -> None:
    """Delete ``names`` on a background thread (unlinking large files is slow); the list is fixed at commit time,
    so files of a later save are never touched, and ``wait_pending`` joins the thread."""
    global _cleanup
    if names:
        _cleanup = threading.Thread(target=lambda: [storage.remove(n) for n in names], daemon=True,
                                    name="vescale-checkpoint-cleanup")
        _cleanup.start()
