"""The snapshot of a save: copy the boxes this rank writes to host memory, now or (async) in the background.

Each box becomes a :class:`Job` reading from the local piece. ``stage`` gives every job a slot in the write plan's
reused host buffer (pinned when on GPU) and copies the jobs that must be copied before ``save`` returns. The jobs of
tensors only an optimizer step changes in place are copied later, in the background (:func:`copy_deferred`), when
their piece has a fingerprint (it is contiguous, or rows of whole 8-byte words: :func:`fingerprint_rows`); before
``save`` returns, ``stage`` takes the :func:`fingerprint` of each (block sums of its bytes: one read of them, on CPU
about half the time of copying them, on GPU kernels queued on the caller's stream), and they carry their version
counters. The background copy fails if a version counter moved or if the copy's fingerprint differs from the one
taken in ``save``: a write that bypasses the counter (through ``.data``, a NumPy view, another tensor sharing the
storage) changes the bytes, so the committed data are the data at save time unless the change leaves every block
sum as it was (see :func:`fingerprint`).

On GPU every device-to-host copy is issued from the copying thread on its current stream (the caller's, or the
background copy's side stream, which first waits for an event recorded on the caller's stream), never from I/O pool
threads (whose current stream is the default one), and an event recorded after them is waited on before a job's
slot is handed to the writer: every copy is ordered before its write and checksum, whatever ``threads`` is.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from vescale.checkpoint._layout import Piece, is_dtensor
from vescale.checkpoint._save_plan import WritePlan, numel
from vescale.checkpoint.errors import CheckpointError
from vescale.core import torch_internals

__all__ = ["Job", "Deferred", "make_jobs", "materialize", "stage", "copy_deferred", "fingerprint",
           "fingerprint_rows"]

_ALIGN = 64  # staging slots start on cache-line boundaries (shifted by under 8 bytes; see stage)
_COPY_SLICE = 16 << 20  # bytes per copy (and per fingerprint slice) when several threads snapshot
_BLOCK_WORDS = 128  # 8-byte words per block sum of a fingerprint: a word moved to another 1 KiB block is seen


@dataclass
class Job:
    """One box this rank writes: its key, position, dtype and the tensor to read it from (its host slot once
    copied)."""

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
    #: set by ``stage`` for a job copied in the background: the source's :func:`fingerprint` when ``save`` was called
    fingerprint: tuple[torch.Tensor, ...] | None = None


def make_jobs(plan: WritePlan, pieces: dict[str, list[Piece]], dtypes: dict[str, torch.dtype], stepped: set[str],
              tensors: dict[str, torch.Tensor]) -> list[Job]:
    """The boxes ``plan`` has this rank write, as jobs reading from the local pieces; those of ``stepped`` keys
    that have a fingerprint (:func:`fingerprint_rows`) carry version counters, marking them to be copied in the
    background (the others are copied before ``save`` returns)."""
    by_box = {(k, p.offsets): p for k, ps in pieces.items() for p in ps}
    jobs = []
    for key, offs in plan.mine:
        piece = by_box[(key, tuple(offs))]
        job = Job(key, piece.offsets, piece.lengths, dtypes[key], piece.view)
        if key in stepped and fingerprint_rows(piece.view) is not None:
            watched = (piece.view,) + ((tensors[key],) if key in tensors and is_dtensor(tensors[key]) else ())
            try:
                job.version = tuple(torch_internals.tensor_version(t) for t in watched)
                job.watched = watched
            except RuntimeError:  # an inference tensor has no version counter: copy it now
                pass
        jobs.append(job)
    return jobs


def materialize(t: torch.Tensor) -> torch.Tensor:
    """A Partial DTensor is reduced to Replicate so that what is saved is the tensor's value. Other DTensors are
    kept as they are (detaching one costs a dispatch; :func:`local_pieces` detaches the local tensor instead)."""
    if is_dtensor(t):
        if any(p.is_partial() for p in t.placements):
            from torch.distributed.tensor import Replicate

            return t.redistribute(t.device_mesh, [Replicate() if p.is_partial() else p for p in t.placements]).detach()
        return t
    return t.detach()


@dataclass
class Deferred:
    """Background copies of an async save: (job, its host slot) pairs, ``threads`` copying, and on GPU the event
    recorded on the saving thread's stream when ``save`` was called (the copies wait for it)."""

    pairs: list[tuple[Job, torch.Tensor]]
    threads: int
    ready: tuple[torch.device, Any] | None = None


def stage(plan: WritePlan, jobs: list[Job], threads: int = 1) -> tuple[list[Job], Deferred | None]:
    """Give each job a slot in the plan's reused host buffer (pinned when on GPU); copy the jobs without a version
    now, with ``threads`` threads, take the :func:`fingerprint` of the others (to be copied in the background) and
    return those as a :class:`Deferred` (None when there are none). Each copied job reads from its slot afterwards.

    The slot of a job copied later starts at the same byte offset modulo 8 as its source, so that the fingerprints
    of source and copy sum the same 8-byte words."""
    sizes = [-(-(numel(j.lengths) * j.source.element_size() + 8) // _ALIGN) * _ALIGN for j in jobs]
    total = sum(sizes)
    on_gpu = torch.cuda.is_available() and any(j.source.is_cuda for j in jobs)
    if plan.staging is None or plan.staging.numel() != total or (on_gpu and not plan.staging.is_pinned()):
        plan.staging = torch.empty(total, dtype=torch.uint8, pin_memory=on_gpu)
    now, later = [], []
    offset = 0
    for job, size in zip(jobs, sizes):
        nbytes = numel(job.lengths) * job.source.element_size()
        start = offset + (job.source.storage_offset() * job.source.element_size() % 8 if job.version is not None
                          else 0)
        dst = plan.staging[start:start + nbytes].view(job.dtype).view(job.lengths)
        (later if job.version is not None else now).append((job, dst))
        offset += size
    _copy(now, threads)
    if not later:
        return jobs, None
    with _pool(threads) as pool:  # queued before the event below on GPU, so that the background copy follows them
        for job, _ in later:
            job.fingerprint = fingerprint(job.source, fingerprint_rows(job.source), pool)
    deferred = Deferred(later, threads)
    cuda = [job.source.device for job, _ in later if job.source.is_cuda]
    if cuda:  # the background copies must see every write queued so far on this thread's stream
        deferred.ready = (cuda[0], torch.cuda.current_stream(cuda[0]).record_event())
    return jobs, deferred


def _copy(pairs: list[tuple[Job, torch.Tensor]], threads: int) -> None:
    """Copy each job's source into its host slot, then point the job at the slot; returns once every copy is done.

    Host sources are copied by ``threads`` threads when there are several (in slices of at most ``_COPY_SLICE``
    bytes). Device sources are copied from the calling thread, on its current stream of each device (so after all
    the work queued there, and on ``copy_deferred``'s side stream after the event it waits for): a pool thread's
    current stream would be the default stream, which neither waits for that event nor is the stream synchronised
    below. An event recorded per device after its copies is waited on before any slot is handed to the writer and
    checksummed (copies into pinned memory are asynchronous).
    """
    host, device = [], []
    for job, dst in pairs:
        if job.source.is_cuda:
            device.append((dst, job.source))
            continue
        nbytes = dst.numel() * dst.element_size()
        if threads > 1 and job.source.is_contiguous() and nbytes > _COPY_SLICE:
            flat_dst, flat_src = dst.reshape(-1), job.source.reshape(-1)
            step = max(1, _COPY_SLICE // job.source.element_size())
            host += [(flat_dst[lo:lo + step], flat_src[lo:lo + step]) for lo in range(0, flat_dst.numel(), step)]
        else:
            host.append((dst, job.source))
    done = []
    if device:
        for dst, src in device:
            dst.copy_(src, non_blocking=True)
        for dev in {src.device for _, src in device}:
            done.append(torch.cuda.current_stream(dev).record_event())
    if threads > 1 and len(host) > 1:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(lambda c: c[0].copy_(c[1]), host))
    else:
        for dst, src in host:
            dst.copy_(src)
    for event in done:
        event.synchronize()
    for job, dst in pairs:
        job.source = dst


def copy_deferred(deferred: Deferred) -> None:
    """The background part of an async snapshot; raises, naming the tensors, if a source changed in place before
    it was copied: its version counter moved, or its copy's fingerprint differs from the one taken in ``save``."""
    if deferred.ready is not None:  # GPU: copy on a side stream once the saving thread's earlier writes are done
        device, event = deferred.ready
        stream = torch.cuda.Stream(device=device)
        with torch.cuda.stream(stream):
            stream.wait_event(event)
            _copy(deferred.pairs, deferred.threads)
            taken = [tuple(t.cpu() for t in job.fingerprint or ()) for job, _ in deferred.pairs]
    else:
        _copy(deferred.pairs, deferred.threads)
        taken = [job.fingerprint or () for job, _ in deferred.pairs]
    changed = set()
    with _pool(deferred.threads) as pool:
        for (job, dst), before in zip(deferred.pairs, taken):
            if tuple(torch_internals.tensor_version(t) for t in job.watched) != job.version:
                changed.add(job.key)
            elif before and not all(torch.equal(a, b) for a, b in zip(before, fingerprint(dst, len(before[1]), pool))):
                changed.add(job.key)
    if changed:
        names = sorted(changed)
        raise CheckpointError(
            f"{len(names)} tensors were changed in place after save(async_save=True) returned and before they "
            f"were copied: {', '.join(names[:8])}{' ...' if len(names) > 8 else ''}. Only optimizer.step() "
            "waits for the copy by itself; call handle.wait_snapshot() before changing them any other way "
            "(through .data too)")


def fingerprint_rows(t: torch.Tensor) -> int | None:
    """The rows :func:`fingerprint` reads ``t`` as: 1 when ``t`` is contiguous; for a strided ``t`` whose last dim
    is contiguous (a column block), its rows, when each row and the step between rows are whole 8-byte words;
    None when ``t`` has no fingerprint."""
    if t.is_contiguous():
        return 1
    if t.dim() < 2 or t.stride(-1) != 1:
        return None
    row, size = t.shape[-1] * t.element_size(), t.element_size()
    try:
        rows = t.view(-1, t.shape[-1])
    except RuntimeError:  # the leading dims do not collapse into one
        return None
    return rows.shape[0] if row % 8 == 0 and rows.stride(0) * size % 8 == 0 else None


def fingerprint(t: torch.Tensor, rows: int = 1, pool: ThreadPoolExecutor | None = None) -> tuple[torch.Tensor, ...]:
    """The bytes of ``t``, read as ``rows`` rows (see :func:`fingerprint_rows`), as (heads, block sums, sums of the
    rows' last blocks, tails), on ``t``'s device; equal for two tensors of equal values read as the same rows whose
    rows start at the same byte offsets modulo 8 in their storages (a strided source and its contiguous copy).

    Each row's bytes from its first to its last 8-byte boundary are read as int64 words and summed (modulo 2**64)
    in blocks of ``_BLOCK_WORDS`` words (1 KiB; the sums take 1/128 of ``t``'s bytes), the last block of a row
    possibly shorter, by ``pool``'s threads in slices when ``t`` is a large CPU tensor; the under 8 bytes before
    and after them are kept as they are. A change goes unseen only if it leaves every block's sum as it was: words
    permuted within a block, or deltas that cancel modulo 2**64 in each changed block (for a change not built to
    cancel, about one chance in 2**64 per block). Integer sums do not depend on the order of the additions, so
    neither the threads nor the device change the result. Costs one read of ``t``.
    """
    raw = (t.reshape(1, -1) if rows == 1 else t.view(rows, -1)).view(torch.uint8)
    head = min((-raw.storage_offset()) % 8, raw.shape[1])
    body = (raw.shape[1] - head) // 8 * 8
    middle = raw[:, head:head + body]  # one row is viewed as words in 1-D: a dtype view checks even its stride
    words = middle[0].view(torch.int64)[None] if rows == 1 else middle.view(torch.int64)
    blocks = words.shape[1] // _BLOCK_WORDS
    sums = torch.empty(rows, blocks, dtype=torch.int64, device=t.device)
    grid = words[:, :blocks * _BLOCK_WORDS].view(rows, blocks, _BLOCK_WORDS)
    if rows == 1:  # one row: slices of its blocks; else slices of rows
        grid, out = grid[0], sums[0]
    else:
        out = sums
    unit = grid[0].numel() * 8 if len(grid) else 1  # bytes per slice step
    step = max(1, _COPY_SLICE // max(unit, 1))
    slices = [(lo, min(lo + step, len(grid))) for lo in range(0, len(grid), step)]
    if pool is not None and len(slices) > 1 and not t.is_cuda:
        list(pool.map(lambda s: torch.sum(grid[s[0]:s[1]], -1, out=out[s[0]:s[1]]), slices))
    elif grid.numel():
        torch.sum(grid, -1, out=out)
    rests = words[:, blocks * _BLOCK_WORDS:].sum(1)
    return raw[:, :head].clone(), sums, rests, raw[:, head + body:].clone()


@contextmanager
def _pool(threads: int) -> Iterator[ThreadPoolExecutor | None]:
    """A pool of ``threads`` threads for the length of the block, or None for one thread."""
    if threads <= 1:
        yield None
        return
    with ThreadPoolExecutor(threads) as pool:
        yield pool
