"""Reading one rank's parts of one stored shard from a local file, in two passes around the ranks' agreement (or in
one, :func:`read_parts_checked`, for a load that need not be all-or-nothing).

**Read** (:func:`check_chunks_read`, then :func:`read_parts`). The checksum chunks this rank checks are read into a
reused buffer of this thread, ``_CHECK_BYTES`` at a time (one 1 MiB chunk, so the crc32 runs on bytes in the CPU's
cache), and checked. After the agreement, a part that is one contiguous byte range of the shard (a whole shard, a run
of whole rows) into a contiguous CPU target of the stored dtype is read straight into its target with one
positional read; that is every same-layout load. Any other part on this path (a cast, a target off the CPU, a strided
part with the mapped path off) is streamed: the rows it covers are read ``_PIECE_BYTES`` at a time into the buffer and
copied out while they are in the cache. Inside a load, each I/O thread reads each file through one descriptor,
renewed every 32 MiB (:class:`~vescale.checkpoint._storage.ReadDescriptor`).

**Mapped** (:class:`MappedShard`), for strided parts (a column block of a row-major shard, a sub-box, a strided
target) into CPU targets of the stored dtype: the byte span the parts and the checksum chunks cover is mapped
read-only (``mmap``), the chunks are checked on the mapping, and after the agreement the parts are copied out of it
(strided). The file is checked to hold the whole span first, so no access to the mapping can fall past its end.

Why both, measured with ``tools/bench/checkpoint.py`` (512 MiB, 4 ranks, the variants alternating in one run):
contiguous parts are read because mapping and unmapping the page cache's 4 KiB pages (9.2 + 2.1 ms per 128 MiB)
costs more than the second read (2-35 % less CPU per same-layout load). Strided parts streamed instead of mapped
took 0-30 % less CPU when the page cache held the files, but the first load after a save, the one every resumed job
makes (vescale's saves bypass the page cache), was 10-30 % slower: FSDP x TP onto 2 ranks 0.27-0.35 s streamed
against 0.24-0.27 s mapped. Mapping's populate overlaps the page-table work with the disk reads; the streamed fill
copies only after the disk-bound check. So strided parts stay mapped (``VESCALE_CHECKPOINT_MMAP=0`` streams them).

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
from vescale.checkpoint._storage import FileReader, Storage
from vescale.checkpoint.errors import CorruptCheckpointError

__all__ = ["read_parts", "read_parts_checked", "byte_span", "release_buffer", "check_chunks_read", "MappedShard",
           "map_parts"]

_bounce = threading.local()
# bytes read at a time to check chunks (whole chunks, at least one). 1 MiB (in the cache for the crc32) against
# 16 MiB: the check pass of a same-layout 2-D block load (4 ranks x 128 MiB) took 9.8-10.7 ms of CPU per rank
# against 11.2-13.2 (three alternating runs)
_CHECK_BYTES = 1 << 20
# bytes of rows read at a time for parts streamed into CPU targets (the piece stays in the cache while it is copied
# out; 4 MiB against 1 MiB: 7.6 against 9.3 ms streaming half the columns of 128 MiB in one process, as each piece
# costs some Python) and into targets off the CPU (fewer, larger host-to-device copies)
_PIECE_BYTES = 4 << 20
_DEVICE_PIECE_BYTES = 64 << 20
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
               parts: list[tuple[tuple[int, ...], torch.Tensor]]) -> None:
    """Copy the sub-boxes ``parts`` ((offsets relative to the shard, target view of the sub-box's shape)) of a
    raw-codec shard into their targets, unchecked (the check pass is :func:`check_chunks_read`).

    A part that is one contiguous byte range of the shard, into a contiguous CPU target of the stored dtype, is
    read straight into the target. The others are streamed: the rows (along dimension 0) that they cover are read
    ``_PIECE_BYTES`` at a time into this thread's reused buffer, and each part's share of the piece is copied out
    of it (strided, cast to the target's dtype, to any device) while the piece is still in the CPU's cache.

    Raises :class:`CorruptCheckpointError` naming the file when it is missing or short.
    """
    with storage.reader(shard["file"]) as reader:
        _copy_parts(reader, shard, dtype, parts)


def _copy_parts(reader: FileReader, shard: dict[str, Any], dtype: torch.dtype,
                parts: list[tuple[tuple[int, ...], torch.Tensor]]) -> None:
    """:func:`read_parts` on an open reader of the shard's file."""
    shape, size = list(shard["lengths"]), dtype.itemsize
    streamed = []
    for offs, target in parts:
        if not target.numel():
            continue
        if _reads_straight(offs, target, shape, dtype):
            lo, _ = byte_span(offs, tuple(target.shape), shape, size)
            reader.read_into(shard["start"] + lo, memoryview(target.detach().reshape(-1).view(torch.uint8).numpy()))
        else:
            streamed.append((offs, target))
    if not streamed:
        return
    if not shape:  # a 0-d shard: one item
        buf = _buffer(size)
        reader.read_into(shard["start"], memoryview(buf.numpy()))
        for _, target in streamed:
            target.copy_(buf.view(dtype).reshape(()))
        return
    row_bytes = size
    for n in shape[1:]:
        row_bytes *= n
    piece = _PIECE_BYTES if all(t.device.type == "cpu" for _, t in streamed) else _DEVICE_PIECE_BYTES
    step = max(1, piece // row_bytes)
    for first, last in _merged((offs[0], offs[0] + target.shape[0]) for offs, target in streamed):
        for r0 in range(first, last, step):
            r1 = min(r0 + step, last)
            buf = _buffer((r1 - r0) * row_bytes)
            reader.read_into(shard["start"] + r0 * row_bytes, memoryview(buf.numpy()))
            rows = buf.view(dtype).view([r1 - r0] + shape[1:])
            for offs, target in streamed:
                a, b = max(r0, offs[0]), min(r1, offs[0] + target.shape[0])
                if a < b:
                    box = (slice(a - r0, b - r0),) + tuple(slice(o, o + n)
                                                           for o, n in zip(offs[1:], target.shape[1:]))
                    target[a - offs[0]:b - offs[0]].copy_(rows[box])


def _merged(ranges) -> list[tuple[int, int]]:
    """The union of the ``[lo, hi)`` ``ranges`` as sorted disjoint ranges (touching ones joined)."""
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def _reads_straight(offsets: tuple[int, ...], target: torch.Tensor, shape: list[int], dtype: torch.dtype) -> bool:
    """Whether a part is read straight into its target: one contiguous byte range of the shard (see
    :func:`_contiguous_span`) into a contiguous CPU tensor of the stored dtype."""
    return (_contiguous_span(offsets, tuple(target.shape), shape) and target.device.type == "cpu"
            and target.dtype == dtype and target.is_contiguous())


def _contiguous_span(offsets: tuple[int, ...], lengths: tuple[int, ...], shape: list[int]) -> bool:
    """Whether the sub-box (``offsets``, ``lengths``) of a row-major box of ``shape`` is one contiguous run of its
    items: whole along every dimension after the first one it does not span whole, and one item thick along
    every dimension before that one."""
    d = len(shape) - 1
    while d >= 0 and lengths[d] == shape[d]:
        d -= 1
    return d < 0 or all(n == 1 for n in lengths[:d])


def check_chunks_read(storage: Storage, shard: dict[str, Any], chunks: list[int]) -> None:
    """Read the stored bytes of the shard's checksum ``chunks`` and check them, runs of consecutive chunks at a time
    (at most ``_CHECK_BYTES`` per read, at least one chunk), into this thread's reused buffer.

    Raises :class:`CorruptCheckpointError` naming the file when it is missing, short, or a chunk fails its checksum.
    """
    with storage.reader(shard["file"]) as reader:
        _check_read(reader, storage.where(shard["file"]), shard, chunks)


def _check_read(reader: FileReader, where: str, shard: dict[str, Any], chunks) -> None:
    """:func:`check_chunks_read` on an open reader of the shard's file."""
    spans = chunk_spans(shard)
    run: list[int] = []
    for i in sorted(chunks) + [None]:
        if run and (i is None or i != run[-1] + 1 or spans[i][1] - spans[run[0]][0] > _CHECK_BYTES):
            lo, hi = spans[run[0]][0], spans[run[-1]][1]
            view = memoryview(_buffer(hi - lo).numpy())
            reader.read_into(shard["start"] + lo, view)
            check_chunks(where, shard, _Shifted(view, lo), run)
            run = []
        if i is not None:
            run.append(i)


def read_parts_checked(storage: Storage, shard: dict[str, Any], dtype: torch.dtype,
                       parts: list[tuple[tuple[int, ...], torch.Tensor]], chunks: list[int]) -> None:
    """:func:`read_parts` and :func:`check_chunks_read` in one pass, for a load that need not leave its targets
    unchanged when it fails: a part read straight into its target is read ``_CHECK_BYTES`` at a time, and each of
    the checksum ``chunks`` lying inside it is checked on the target's bytes as soon as they have arrived (still in
    the CPU's cache); the other parts are streamed as by :func:`read_parts`, and the chunks that no straight part
    holds whole are read and checked as by :func:`check_chunks_read` (from the page cache, mostly).

    Raises :class:`CorruptCheckpointError` naming the file when it is missing, short, or a chunk fails its checksum;
    the targets may then hold some of the stored bytes.
    """
    where = storage.where(shard["file"])
    spans = chunk_spans(shard)
    shape, size = list(shard["lengths"]), dtype.itemsize
    left = sorted(chunks)
    streamed = []
    with storage.reader(shard["file"]) as reader:
        for offs, target in parts:
            if not target.numel():
                continue
            if not _reads_straight(offs, target, shape, dtype):
                streamed.append((offs, target))
                continue
            lo, hi = byte_span(offs, tuple(target.shape), shape, size)
            out = memoryview(target.detach().reshape(-1).view(torch.uint8).numpy())
            inside = [i for i in left if lo <= spans[i][0] and spans[i][1] <= hi]
            left = [i for i in left if not (lo <= spans[i][0] and spans[i][1] <= hi)]
            for a in range(lo, hi, _CHECK_BYTES):
                b = min(a + _CHECK_BYTES, hi)
                reader.read_into(shard["start"] + a, out[a - lo:b - lo])
                done = [i for i in inside if spans[i][1] <= b]
                if done:
                    check_chunks(where, shard, _Shifted(out, lo), done)
                    inside = inside[len(done):]
        if streamed:
            _copy_parts(reader, shard, dtype, streamed)
        if left:
            _check_read(reader, where, shard, left)


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
            desc, owned = storage.open_kept(shard["file"])
        except FileNotFoundError:
            raise CorruptCheckpointError(f"checkpoint data file {self.where} is missing") from None
        fd = desc.fd
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
            desc.advance(end - base)  # the populate read the span through this descriptor
        finally:
            if owned:
                desc.close()
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

    def fill_and_close(self, dtype: torch.dtype, parts: list[tuple[tuple[int, ...], torch.Tensor]]) -> None:
        """:meth:`fill`, then :meth:`close` (also when the fill raises)."""
        try:
            self.fill(dtype, parts)
        finally:
            self.close()

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
    when the mapped path does not apply (nothing to read, every part read straight into its target, a target off
    the CPU or of another dtype, an item size numpy cannot copy, ``VESCALE_CHECKPOINT_MMAP=0``, a file system that
    cannot map): the caller then reads with :func:`check_chunks_read` and :func:`read_parts` (see the module's
    note)."""
    if os.environ.get("VESCALE_CHECKPOINT_MMAP", "1") == "0" or dtype.itemsize not in _INT_OF_SIZE:
        return None
    if any(t.device.type != "cpu" or t.dtype != dtype for _, t in parts):  # a cast (strict=False) copies as torch
        return None
    if all(_reads_straight(offs, t, shard["lengths"], dtype) for offs, t in parts):  # see the module's note
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


class _Unmappable(Exception):
    """``mmap`` refused a file that opened (internal: the caller reads it instead)."""
