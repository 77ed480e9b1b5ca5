"""The snapshot of a save: copy the boxes this rank writes to host memory, now or (async) in the background.

Each box becomes a :class:`Job` reading from the local piece. ``stage`` gives every job a slot in the write plan's
reused host buffer (pinned when on GPU) and copies the jobs that must be copied before ``save`` returns; the jobs of
tensors only an optimizer step changes in place carry their version counters and are copied later, in the background
(:func:`copy_deferred`), which fails if one of them was changed in place first.

On GPU every device-to-host copy is issued from the copying thread on its current stream (the caller's, or the
background copy's side stream, which first waits for an event recorded on the caller's stream), never from I/O pool
threads (whose current stream is the default one), and an event recorded after them is waited on before a job's
slot is handed to the writer: every copy is ordered before its write and checksum, whatever ``threads`` is.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from vescale.checkpoint._layout import Piece, is_dtensor
from vescale.checkpoint._save_plan import WritePlan, numel
from vescale.checkpoint.errors import CheckpointError
from vescale.core import torch_internals

__all__ = ["Job", "Deferred", "make_jobs", "materialize", "stage", "copy_deferred"]

_ALIGN = 64  # staging slots start on cache-line boundaries, so that every dtype view is aligned
_COPY_SLICE = 16 << 20  # bytes per copy when several threads snapshot


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


def make_jobs(plan: WritePlan, pieces: dict[str, list[Piece]], dtypes: dict[str, torch.dtype], stepped: set[str],
              tensors: dict[str, torch.Tensor]) -> list[Job]:
    """The boxes ``plan`` has this rank write, as jobs reading from the local pieces; those of ``stepped`` keys
    carry version counters, marking them to be copied in the background."""
    by_box = {(k, p.offsets): p for k, ps in pieces.items() for p in ps}
    jobs = []
    for key, offs in plan.mine:
        piece = by_box[(key, tuple(offs))]
        job = Job(key, piece.offsets, piece.lengths, dtypes[key], piece.view)
        if key in stepped:
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
    now, with ``threads`` threads, and return the others (to be copied in the background) as a :class:`Deferred`
    (None when there are none). Each copied job reads from its slot afterwards."""
    sizes = [-(-numel(j.lengths) * j.source.element_size() // _ALIGN) * _ALIGN for j in jobs]
    total = sum(sizes)
    on_gpu = torch.cuda.is_available() and any(j.source.is_cuda for j in jobs)
    if plan.staging is None or plan.staging.numel() != total or (on_gpu and not plan.staging.is_pinned()):
        plan.staging = torch.empty(total, dtype=torch.uint8, pin_memory=on_gpu)
    now, later = [], []
    offset = 0
    for job, size in zip(jobs, sizes):
        nbytes = numel(job.lengths) * job.source.element_size()
        dst = plan.staging[offset:offset + nbytes].view(job.dtype).view(job.lengths)
        (later if job.version is not None else now).append((job, dst))
        offset += size
    _copy(now, threads)
    if not later:
        return jobs, None
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
    """The background part of an async snapshot; raises if a source changed in place before it was copied."""
    if deferred.ready is not None:  # GPU: copy on a side stream once the saving thread's earlier writes are done
        device, event = deferred.ready
        stream = torch.cuda.Stream(device=device)
        with torch.cuda.stream(stream):
            stream.wait_event(event)
            _copy(deferred.pairs, deferred.threads)
    else:
        _copy(deferred.pairs, deferred.threads)
    changed = sorted({job.key for job, _ in deferred.pairs
                      if tuple(torch_internals.tensor_version(t) for t in job.watched) != job.version})
    if changed:
        raise CheckpointError(
            f"{len(changed)} tensors were changed in place after save(async_save=True) returned and before they "
            f"were copied: {', '.join(changed[:8])}{' ...' if len(changed) > 8 else ''}. Only optimizer.step() "
            "waits for the copy by itself; call handle.wait_snapshot() before changing them any other way")

