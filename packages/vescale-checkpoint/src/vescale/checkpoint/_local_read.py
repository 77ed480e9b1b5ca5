"""Reading one rank's parts of one stored shard from a local file: one positional read of the byte span they
cover (straight into the target when the part is the whole shard and the target is contiguous), the checksum
chunks this rank was given checked on the bytes read, then the parts copied out as strided views.

A column block of a row-major shard costs one read of the rows it spans and one strided copy; a row block costs
a read of just its rows. The buffer that receives the span is reused by the calling thread between shards.

:func:`check_chunks_read` is the checking half alone: a load checks every chunk first (reading them into the reused
buffer, in pieces of at most ``_CHECK_BYTES``), agrees across ranks that all are intact, and only then fills the
targets with :func:`read_parts` (``chunks=[]``), so that a damaged file changes no target.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from vescale.checkpoint._reader import check_chunks, chunk_spans, shard_nbytes
from vescale.checkpoint._storage import Storage

__all__ = ["read_parts", "byte_span", "release_buffer", "check_chunks_read"]

_bounce = threading.local()
_CHECK_BYTES = 16 << 20  # bytes read at a time to check chunks (whole chunks, at least one)


def byte_span(offsets: tuple[int, ...], lengths: tuple[int, ...], shape: list[int], itemsize: int) -> tuple[int, int]:
    """``[lo, hi)``: the bytes, relative to a row-major box of ``shape``, that its sub-box (``offsets`` relative to
    the box, ``lengths``) touches."""
    first = last = 0
    stride = itemsize
    for j in reversed(range(len(shape))):
        first += offsets[j] * stride
        last += (offsets[j] + lengths[j] - 1) * stride
        stride *= shape[j]
    return first, last + itemsize


def read_parts(storage: Storage, shard: dict[str, Any], dtype: torch.dtype,
               parts: list[tuple[tuple[int, ...], torch.Tensor]], chunks: list[int]) -> None:
    """Copy the sub-boxes ``parts`` ((offsets relative to the shard, target view of the sub-box's shape)) of a
    raw-codec shard into their targets, after checking the shard's checksum ``chunks`` on the bytes read.

    Raises :class:`CorruptCheckpointError` naming the file when it is missing, short, or fails a checked chunk
    (targets of this shard are then left untouched).
    """
    shape, size = shard["lengths"], dtype.itemsize
    nbytes = shard_nbytes(shard)
    spans = [byte_span(offs, tuple(t.shape), shape, size) for offs, t in parts if t.numel()]
    spans += [chunk_spans(shard)[i] for i in chunks]
    spans = [s for s in spans if s[1] > s[0]]
    if not spans:
        return
    lo, hi = min(s[0] for s in spans), max(s[1] for s in spans)
    direct = None
    if len(parts) == 1 and (lo, hi) == (0, nbytes) and tuple(parts[0][1].shape) == tuple(shape):
        target = parts[0][1]
        if target.device.type == "cpu" and target.dtype == dtype and target.is_contiguous():
            direct = target.reshape(-1).view(torch.uint8)
    buf = direct if direct is not None else _buffer(hi - lo)
    view = memoryview(buf.numpy())
    storage.read_into(shard["file"], shard["start"] + lo, view)
    if chunks:
        check_chunks(storage.where(shard["file"]), shard, _Shifted(view, lo), chunks)
    if direct is not None:
        return
    flat = buf.view(dtype)
    strides = [1] * len(shape)
    for j in range(len(shape) - 2, -1, -1):
        strides[j] = strides[j + 1] * shape[j + 1]
    for offs, target in parts:
        if target.numel():
            first = sum(o * s for o, s in zip(offs, strides)) - lo // size
            target.copy_(flat.as_strided(tuple(target.shape), strides, first))


def check_chunks_read(storage: Storage, shard: dict[str, Any], chunks: list[int]) -> None:
    """Read the stored bytes of the shard's checksum ``chunks`` and check them, runs of consecutive chunks at a time
    (at most ``_CHECK_BYTES`` per read, at least one chunk), into this thread's reused buffer.

    Raises :class:`CorruptCheckpointError` naming the file when it is missing, short, or a chunk fails its checksum.
    """
    spans = chunk_spans(shard)
    run: list[int] = []
    for i in sorted(chunks) + [None]:
        if run and (i is None or i != run[-1] + 1 or spans[i][1] - spans[run[0]][0] > _CHECK_BYTES):
            lo, hi = spans[run[0]][0], spans[run[-1]][1]
            view = memoryview(_buffer(hi - lo).numpy())
            storage.read_into(shard["file"], shard["start"] + lo, view)
            check_chunks(storage.where(shard["file"]), shard, _Shifted(view, lo), run)
            run = []
        if i is not None:
            run.append(i)


class _Shifted:
    """The bytes ``[lo, lo + len(view))`` of a shard, indexable by shard-relative slices (for ``check_chunks``)."""

    def __init__(self, view: memoryview, lo: int) -> None:
        self.view, self.lo = view, lo

    def __getitem__(self, s: slice) -> memoryview:
        return self.view[s.start - self.lo:s.stop - self.lo]


def _buffer(nbytes: int) -> torch.Tensor:
    """This thread's reusable receive buffer, at least ``nbytes`` long (8-byte aligned for any dtype view)."""
    buf = getattr(_bounce, "buf", None)
    if buf is None or buf.numel() < nbytes:
        buf = _bounce.buf = torch.empty(max(nbytes, 1 << 20), dtype=torch.uint8)
    return buf[:nbytes]


def release_buffer() -> None:
    """Drop the calling thread's receive buffer (a load ends with it; pool threads drop theirs when they end)."""
    _bounce.buf = None
