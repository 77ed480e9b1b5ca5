"""Point-to-point messages between pipeline ranks: tags, the shape header, batched posting.

Every message carries a tag that names it uniquely within a step (direction, sending stage, microbatch, slot), so a
receive can never take another message's bytes. The first forward message of each stage boundary in a step (the
one for microbatch 0) is preceded by a fixed-size int64 header describing the tensors (dtype, requires_grad, shape);
later microbatches reuse it, and gradients mirror the activations' shapes, so the receiver always knows what to
allocate without a hang.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from vescale.pipe.errors import PipeError

__all__ = ["MAX_TENSORS", "HEADER_LEN", "tag", "encode_header", "decode_header", "post"]

MAX_TENSORS = 63
_MAX_DIMS = 8
_SLOT = 1 + 2 + 1 + _MAX_DIMS
HEADER_LEN = 1 + _SLOT * MAX_TENSORS
_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16,
           torch.int8, torch.uint8, torch.bool, torch.complex64, torch.float8_e4m3fn, torch.float8_e5m2]


def tag(kind: int, sender_stage: int, mb: int, slot: int, num_stages: int, num_microbatches: int) -> int:
    """Unique tag of one message in a step: ``kind`` 0 = activations, 1 = gradients; ``slot`` 0 = header."""
    return ((kind * num_stages + sender_stage) * num_microbatches + mb) * (MAX_TENSORS + 1) + slot


def encode_header(tensors: list[torch.Tensor], stage: int, device: torch.device) -> torch.Tensor:
    """Describe ``tensors`` (the outputs of ``stage``) in a fixed-size int64 tensor."""
    if len(tensors) > MAX_TENSORS:
        raise PipeError(f"stage {stage} outputs {len(tensors)} tensors; at most {MAX_TENSORS} can cross a boundary")
    head = torch.zeros(HEADER_LEN, dtype=torch.int64)
    head[0] = len(tensors)
    for i, t in enumerate(tensors):
        if t.dtype not in _DTYPES:
            raise PipeError(f"stage {stage} output {i} has dtype {t.dtype}, which cannot cross a stage boundary")
        if t.dim() > _MAX_DIMS:
            raise PipeError(f"stage {stage} output {i} has {t.dim()} dims; at most {_MAX_DIMS} can cross a boundary")
        base = 1 + i * _SLOT
        head[base] = _DTYPES.index(t.dtype)
        head[base + 1] = int(t.requires_grad)
        head[base + 2] = t.dim()
        head[base + 3:base + 3 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
    return head.to(device)


def decode_header(head: torch.Tensor) -> list[tuple[tuple[int, ...], torch.dtype, bool]]:
    """Inverse of :func:`encode_header`: ``[(shape, dtype, requires_grad), ...]``."""
    values = head.cpu().tolist()
    out = []
    for i in range(values[0]):
        base = 1 + i * _SLOT
        ndim = values[base + 2]
        out.append((tuple(values[base + 3:base + 3 + ndim]), _DTYPES[values[base]], bool(values[base + 1])))
    return out


def post(ops: list[tuple[str, torch.Tensor, int, int]], group) -> list[tuple[str, object]]:
    """Post ``(kind, tensor, peer_global_rank, tag)`` sends/receives as one batch; return ``(kind, work)`` pairs.

    Backends that coalesce a batch into one work (NCCL) return a single ``("recv", work)``: the caller then waits
    for the whole batch, sends included.
    """
    if not ops:
        return []
    p2p = [dist.P2POp(dist.isend if kind == "send" else dist.irecv, t, peer=peer, group=group, tag=tg)
           for kind, t, peer, tg in ops]
    works = dist.batch_isend_irecv(p2p)
    if len(works) != len(ops):
        return [("recv", w) for w in works]
    return [(kind, w) for (kind, *_), w in zip(ops, works)]
