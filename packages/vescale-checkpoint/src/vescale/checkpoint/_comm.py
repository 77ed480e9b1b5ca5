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


def _checkpoint_group():
    default = dist.distributed_c10d._get_default_group()
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
        """Every rank's ``obj``, in rank order."""
        if self.group is None:
            return [obj]
        data = torch.frombuffer(bytearray(json.dumps(obj, separators=(",", ":")).encode()), dtype=torch.uint8)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world)]
        dist.all_gather(sizes, torch.tensor([data.numel()], dtype=torch.int64), group=self.group)
        longest = max(int(s) for s in sizes)
        padded = torch.zeros(longest, dtype=torch.uint8)
        padded[: data.numel()] = data
        out = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.world)]
        dist.all_gather(out, padded, group=self.group)
        return [json.loads(bytes(o[: int(s)].numpy())) for o, s in zip(out, sizes)]

    def broadcast_bytes(self, data: bytes | None, src: int = 0) -> bytes:
        """``data`` from rank ``src`` on every rank."""
        if self.group is None:
            return data or b""
        size = torch.tensor([len(data) if self.rank == src else 0], dtype=torch.int64)
        dist.broadcast(size, src, group=self.group)
        if not int(size):
            return b""
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.rank == src else torch.empty(
            int(size), dtype=torch.uint8)
        dist.broadcast(buf, src, group=self.group)
        return bytes(buf.numpy())

    def all_reduce_max(self, values: list[int]) -> list[int]:
        if self.group is None:
            return list(values)
        t = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return t.tolist()

    def exchange(self, sends: dict[int, torch.Tensor], recv_sizes: dict[int, int]) -> dict[int, torch.Tensor]:
        """Send ``sends[peer]`` (uint8) to each peer, receive ``recv_sizes[peer]`` bytes from each; point to point."""
        received = {peer: torch.empty(n, dtype=torch.uint8) for peer, n in recv_sizes.items() if n}
        ops = [dist.P2POp(dist.isend, buf, peer, self.group) for peer, buf in sorted(sends.items()) if buf.numel()]
        ops += [dist.P2POp(dist.irecv, buf, peer, self.group) for peer, buf in sorted(received.items())]
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        return received
