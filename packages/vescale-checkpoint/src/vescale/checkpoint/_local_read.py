"""Reading one rank's parts of one stored shard from a local file.

Two paths. **Mapped** (:class:`MappedShard`), for parts of a raw shard into CPU targets of its dtype (a column
block of a row-major shard, any sub-box): the byte span the rank's parts and checksum chunks cover is mapped
read-only (``mmap``), its chunks are checked on the mapping itself, and after the ranks have agreed that every
chunk is intact the parts are copied out of the mapping straight into their targets (strided). Each needed byte is
read once by the checksum and copied once. Before it maps, the file is checked to hold the whole span, so no access
to the mapping can fall past its end.

**Read** (:func:`check_chunks_read`, then :func:`read_parts`): the chunks are read into a reused buffer and checked,
and after the agreement the span is read again with one positional read, straight into the target when the part is
the whole shard, else into a buffer that the parts are copied out of. It serves whole shards into one contiguous CPU
target (every same-layout load), targets off the CPU or of another dtype (a cast), item sizes numpy has no integer
for, file systems that cannot map, and every shard with ``VESCALE_CHECKPOINT_MMAP=0`` in the environment. Whole
shards are read, not mapped, because mapping and unmapping the page cache's 4 KiB pages costs more than the
second read: in ``tools/bench/checkpoint.py`` on a quiet machine (512 MiB, 4 ranks, the two alternating in one run)
the same-layout loads took 2-35 % less CPU on every row of the layout matrix than with whole shards mapped (an
earlier A/B on a machine shared with other jobs had favoured mapping them by 4-15 % on three of four rows).

A mapped file that another process truncates during the load makes the next access to the lost pages a SIGBUS,
which ends the process (the read path raises instead); checkpoints are written to new files and never truncated.
"""

from __future__ import annotations

import mmap
import os
import threading
from typing import Any

import numpy as np
import torch

from vescale.checkpoint._reader import check_chunks, chunk_spans, shard_nbytes
from vescale.checkpoint._storage import Storage
from vescale.checkpoint.errors import CorruptCheckpointError

__all__ = ["read_parts", "byte_span", "release_buffer", "check_chunks_read", "MappedShard", "map_parts"]

_bounce = threading.local()
_CHECK_BYTES = 16 << 20  # bytes read at a time to check chunks (whole chunks, at least one)
# per item size, an integer dtype of torch and of numpy: parts are copied as these (bitwise, any dtype, bfloat16 too)
_INT_OF_SIZE = {1: (torch.uint8, np.uint8), 2: (torch.int16, np.int16), 4: (torch.int32, np.int32),
                8: (torch.int64, np.int64)}


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
    spans = [byte_span(offs, tuple(t.shape), shape, size) for offs, t in parts if t.numel()]
    if chunks:
        stored = chunk_spans(shard)
        spans += [stored[i] for i in chunks]
    spans = [s for s in spans if s[1] > s[0]]
    if not spans:
        return
    lo, hi = min(s[0] for s in spans), max(s[1] for s in spans)
    direct = None
    whole = _whole_shard_target(shard, parts)
    if whole is not None and whole.dtype == dtype:
        direct = whole.reshape(-1).view(torch.uint8)
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


class MappedShard:
    """The bytes ``[lo, hi)`` (relative to the shard's start) of a raw shard of a local data file, mapped read-only.

    :meth:`check` checks checksum chunks on the mapping; :meth:`fill` copies parts out of it into their targets;
    :meth:`close` unmaps (also when nothing was filled). Raises :class:`CorruptCheckpointError` naming the file when it
    is missing, not a regular file, or ends before ``hi``; ``OSError`` when it cannot be opened.
    """

    def __init__(self, storage: Storage, shard: dict[str, Any], lo: int, hi: int) -> None:
        self.shard, self.lo, self.where = shard, lo, storage.where(shard["file"])
        begin, end = shard["start"] + lo, shard["start"] + hi
        try:
            fd = storage._open_read(shard["file"])
        except FileNotFoundError:
            raise CorruptCheckpointError(f"checkpoint data file {self.where} is missing") from None
        try:
            size = os.fstat(fd).st_size
            if size < end:  # an access past the end of a mapping is a SIGBUS, not an error: refuse it here
                raise CorruptCheckpointError(f"checkpoint data file {self.where} is truncated: expected bytes "
                                             f"[{begin}, {end}), the file ends at {size}")
            base = begin - begin % mmap.ALLOCATIONGRANULARITY
            try:  # MAP_POPULATE maps every page of the span in one call instead of one page fault per 4 KiB
                self._map = mmap.mmap(fd, end - base, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                                      prot=mmap.PROT_READ, offset=base)
            except (OSError, ValueError) as exc:
                raise _Unmappable(str(exc)) from None
        finally:
            os.close(fd)
        self._view = memoryview(self._map)[begin - base:]

    def check(self, chunks: list[int]) -> None:
        """Check the shard's checksum ``chunks`` (inside the mapped span) on the mapped bytes."""
        if chunks:
            check_chunks(self.where, self.shard, _Shifted(self._view, self.lo), chunks)

    def fill(self, dtype: torch.dtype, parts: list[tuple[tuple[int, ...], torch.Tensor]]) -> None:
        """Copy each part ((offsets relative to the shard, CPU target of the part's shape)) out of the mapping."""
        shape, size = self.shard["lengths"], dtype.itemsize
        as_torch, as_numpy = _INT_OF_SIZE[size]
        strides = [size] * len(shape)
        for j in range(len(shape) - 2, -1, -1):
            strides[j] = strides[j + 1] * shape[j + 1]
        src = np.frombuffer(self._view, dtype=np.uint8)  # read-only, no copy
        for offs, target in parts:
            if not target.numel():
                continue
            first = sum(o * s for o, s in zip(offs, strides)) - self.lo
            part = np.lib.stride_tricks.as_strided(src[first:].view(as_numpy), tuple(target.shape), tuple(strides),
                                                   writeable=False)
            np.copyto(target.detach().view(as_torch).numpy(), part)
        del src

    def close(self) -> None:
        """Unmap. Copies out of the mapping must have finished (else the views left keep it mapped until freed)."""
        try:
            self._view.release()
            self._map.close()
        except BufferError:  # a view of it is still alive: the mapping goes when the last one is freed
            pass


def map_parts(storage: Storage, shard: dict[str, Any], dtype: torch.dtype,
              parts: list[tuple[tuple[int, ...], torch.Tensor]], chunks: list[int]) -> MappedShard | None:
    """A :class:`MappedShard` of the span that ``parts`` and the checksum ``chunks`` of a raw shard cover, or None
    when the mapped path does not apply (nothing to read, a target off the CPU or of another dtype, an item size
    numpy cannot copy, ``VESCALE_CHECKPOINT_MMAP=0``, a file system that cannot map): the caller then reads with
    :func:`check_chunks_read` and :func:`read_parts`, and for a whole shard into one contiguous CPU target, which
    reads straight into the target after the check (see the module's note)."""
    if os.environ.get("VESCALE_CHECKPOINT_MMAP", "1") == "0" or dtype.itemsize not in _INT_OF_SIZE:
        return None
    if any(t.device.type != "cpu" or t.dtype != dtype for _, t in parts):  # a cast (strict=False) copies as torch
        return None
    if _whole_shard_target(shard, parts) is not None:  # read straight into it after the check: see the module
        return None
    shape, size = shard["lengths"], dtype.itemsize
    spans = [byte_span(offs, tuple(t.shape), shape, size) for offs, t in parts if t.numel()]
    if chunks:
        stored = chunk_spans(shard)
        spans += [stored[i] for i in chunks]
    spans = [s for s in spans if s[1] > s[0]]
    if not spans:
        return None
    lo, hi = min(s[0] for s in spans), max(s[1] for s in spans)
    # whole items (a chunk size need not divide by the item size), within the shard (which holds whole items)
    lo, hi = lo - lo % size, min(hi + (-hi) % size, shard_nbytes(shard))
    try:
        return MappedShard(storage, shard, lo, hi)
    except _Unmappable:  # this file system cannot map the file: read it instead
        return None


def _whole_shard_target(shard: dict[str, Any], parts: list[tuple[tuple[int, ...], torch.Tensor]]
                        ) -> torch.Tensor | None:
    """The target when ``parts`` is the whole shard into one contiguous CPU tensor, else None."""
    if len(parts) != 1 or tuple(parts[0][1].shape) != tuple(shard["lengths"]) or any(parts[0][0]):
        return None
    target = parts[0][1]
    return target if target.device.type == "cpu" and target.is_contiguous() else None


class _Unmappable(Exception):
    """``mmap`` refused a file that opened (internal: the caller reads it instead)."""
