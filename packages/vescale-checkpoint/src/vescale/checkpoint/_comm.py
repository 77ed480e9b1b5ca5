"""The collectives a save or load issues, on a private gloo group (or none in a single process).

Checkpoint traffic uses its own gloo process group over all ranks, so that an async save's background thread can
finish its commit while training keeps issuing collectives on the default group, and so that data exchange works
the same on CPU and GPU clusters. Small structured messages travel as JSON bytes (never pickle).
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
import torch.distributed as dist

_groups: dict[int, Any] = {}
_SLOT = 64 << 10  # bytes of a message that travel in the first collective (with its 8-byte length)


def _slot(data: bytes) -> torch.Tensor:
    """A ``_SLOT``-byte buffer: the length of ``data``, then as much of it as fits (zero padded)."""
    head = torch.zeros(_SLOT, dtype=torch.uint8)
    first = len(data).to_bytes(8, "little") + data[:_SLOT - 8]
    head[:len(first)] = torch.frombuffer(bytearray(first), dtype=torch.uint8)
    return head


def _checkpoint_group():
    default = dist.group.WORLD
    group = _groups.get(id(default))
    if group is None:
        group = dist.new_group(backend="gloo")
        _groups.clear()
        _groups[id(default)] = group
    return group


def io_threads(requested: int | None, comm: Comm | None = None) -> int:
    """I/O threads per rank: ``requested``, or this host's CPUs shared among its ranks (1 to 8)."""
    if requested is not None:
        return max(1, requested)
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    local = int(os.environ.get("LOCAL_WORLD_SIZE", comm.world if comm is not None else 1))
    return max(1, min(8, cpus // max(1, local)))


class Comm:
    """This process's rank and world size for checkpointing, and the collectives on the checkpoint group."""

    def __init__(self) -> None:
        if dist.is_available() and dist.is_initialized():
            self.rank, self.world = dist.get_rank(), dist.get_world_size()
            self.group = _checkpoint_group() if self.world > 1 else None
        else:
            self.rank, self.world, self.group = 0, 1, None

    def all_gather_json(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order (one collective when every message fits in ``_SLOT`` bytes)."""
        if self.group is None:
            return [obj]
        data = json.dumps(obj, separators=(",", ":")).encode()
        head = _slot(data)
        heads = [torch.empty(_SLOT, dtype=torch.uint8) for _ in range(self.world)]
        dist.all_gather(heads, head, group=self.group)
        sizes = [int.from_bytes(bytes(h[:8].numpy()), "little") for h in heads]
        rest = max(sizes) - (_SLOT - 8)
        tails = [b""] * self.world
        if rest > 0:  # a message longer than one slot: the remainders, padded to the longest
            mine = torch.zeros(rest, dtype=torch.uint8)
            extra = data[_SLOT - 8:]
            if extra:
                mine[:len(extra)] = torch.frombuffer(bytearray(extra), dtype=torch.uint8)
            out = [torch.empty(rest, dtype=torch.uint8) for _ in range(self.world)]
            dist.all_gather(out, mine, group=self.group)
            tails = [bytes(o.numpy()) for o in out]
        return [json.loads((bytes(h[8:].numpy()) + t)[:n]) for h, t, n in zip(heads, tails, sizes)]

    def broadcast_bytes(self, data: bytes | None, src: int = 0) -> bytes:
        """``data`` from rank ``src`` on every rank (one collective when it fits in ``_SLOT`` bytes)."""
        if self.group is None:
            return data or b""
        head = _slot(data or b"") if self.rank == src else torch.empty(_SLOT, dtype=torch.uint8)
        dist.broadcast(head, src, group=self.group)
        size = int.from_bytes(bytes(head[:8].numpy()), "little")
        got = bytes(head[8:8 + size].numpy())
        rest = size - len(got)
        if rest > 0:
            buf = torch.frombuffer(bytearray(data[len(got):]), dtype=torch.uint8) if self.rank == src else \
                torch.empty(rest, dtype=torch.uint8)
            dist.broadcast(buf, src, group=self.group)
            got += bytes(buf.numpy())
        return got

    def all_reduce_max(self, values: list[int]) -> list[int]:
        if self.group is None:
            return list(values)
        t = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return t.tolist()

    def exchange(self, sends: dict[int, list[torch.Tensor]], recvs: dict[int, list[torch.Tensor]]) -> None:
        """Point to point: send each tensor of ``sends[peer]`` to ``peer`` and receive into each tensor of
        ``recvs[peer]`` from ``peer`` (contiguous CPU uint8 tensors); the i-th tensor a rank receives from a peer
        is the i-th that peer sends it, so both sides list them in the same order and sizes."""
        ops = [dist.P2POp(dist.isend, buf, peer, self.group)
               for peer, bufs in sorted(sends.items()) for buf in bufs if buf.numel()]
        ops += [dist.P2POp(dist.irecv, buf, peer, self.group)
                for peer, bufs in sorted(recvs.items()) for buf in bufs if buf.numel()]
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
