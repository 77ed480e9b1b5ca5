"""Microbatches: splitting a step's batch along dim 0, and describing it compactly so pp ranks can compare theirs.

:func:`split_microbatches` cuts every tensor of a (nested) batch into equal microbatches. :func:`_describe_batch`
turns a step argument into a fixed-size int64 row (presence, a digest of its structure and every leaf's dtype and
shape, the first leaf that cannot be split, the first leaves' shapes) that ``PipeEngine`` all-gathers over pp before a
step, so that every rank raises the same error for a missing or mismatched batch before any stage waits on another;
the ``_*_text`` helpers word what two rows say. Local; no collective.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from typing import Any

import torch

from vescale.pipe.errors import PipeError

__all__ = ["split_microbatches"]

# The per-step batch description (_describe_batch): one fixed-size int64 row per argument (batch, target).
_DESC_LEAVES = 8  # tensor leaves described shape by shape; the digest covers all of them
_DESC_DIMS = 8    # dims described per leaf; the digest covers all of them
_LEAF = 2 + _DESC_DIMS  # dtype code, ndim, dims
_PRESENT, _COUNT, _DIGEST, _BAD = range(4)  # then _DESC_LEAVES leaf slots, then the slot of the first bad leaf
_DESC_LEN = 4 + _LEAF * (_DESC_LEAVES + 1)
#: Every torch dtype, in one order that every rank of one torch version agrees on (code = index).
_DTYPE_CODES = sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)


def split_microbatches(obj: Any, num_microbatches: int, what: str = "batch") -> list[Any]:
    """Split every tensor in ``obj`` (tensor, tuple/list, dict, nested) along dim 0 into equal microbatches.

    Non-tensor leaves are repeated in every microbatch. Raises :class:`PipeError` naming the path and shape of a
    tensor whose dim 0 is not a multiple of ``num_microbatches``.
    """
    if isinstance(obj, torch.Tensor):
        if obj.dim() == 0 or obj.shape[0] % num_microbatches:
            raise PipeError(f"{what} has shape {tuple(obj.shape)}: dim 0 must be a multiple of "
                            f"num_microbatches={num_microbatches}")
        return list(obj.chunk(num_microbatches))
    if isinstance(obj, (tuple, list)):
        parts = [split_microbatches(v, num_microbatches, f"{what}[{i}]") for i, v in enumerate(obj)]
        return [type(obj)(p[m] for p in parts) for m in range(num_microbatches)]
    if isinstance(obj, Mapping):
        parts = {k: split_microbatches(v, num_microbatches, f"{what}[{k!r}]") for k, v in obj.items()}
        return [{k: p[m] for k, p in parts.items()} for m in range(num_microbatches)]
    return [obj] * num_microbatches


def _tensor_leaves(obj: Any) -> tuple[list[torch.Tensor], str]:
    """The tensor leaves of ``obj``, in :func:`split_microbatches` order, and ``obj``'s skeleton.

    The skeleton names the containers, keys and non-tensor leaf types: two arguments with equal skeletons and equal
    leaf shapes and dtypes split into microbatches of the same structure.
    """
    if isinstance(obj, torch.Tensor):
        return [obj], "T"
    if isinstance(obj, (tuple, list)):
        parts = [_tensor_leaves(v) for v in obj]
        skeleton = f"{type(obj).__name__}(" + ",".join(sk for _, sk in parts) + ")"
        return [x for leaves, _ in parts for x in leaves], skeleton
    if isinstance(obj, Mapping):
        parts = [(k, _tensor_leaves(v)) for k, v in obj.items()]
        return ([x for _, (leaves, _) in parts for x in leaves],
                "{" + ",".join(f"{k!r}:{sk}" for k, (_, sk) in parts) + "}")
    return [], type(obj).__name__


def _describe_batch(obj: Any, num_microbatches: int) -> list[int]:
    """A fixed-size (``_DESC_LEN``) int64 description of a step argument (batch or target), for comparing on ranks.

    Fields: present (0 for ``None``), number of tensor leaves, a CRC-32 digest of the skeleton and of every leaf's
    dtype and full shape (so descriptions compare exactly whatever their size), the index of the first tensor leaf
    that cannot be split into ``num_microbatches`` (0-d, or dim 0 not a multiple; -1 for none), then dtype code,
    ndim and dims of the first ``_DESC_LEAVES`` leaves, then of that first bad leaf (what error messages show).
    """
    row = [0] * _DESC_LEN
    row[_BAD] = -1
    if obj is None:
        return row
    leaves, skeleton = _tensor_leaves(obj)
    row[_PRESENT], row[_COUNT] = 1, len(leaves)
    metas = ";".join(f"{t.dtype}{tuple(t.shape)}" for t in leaves)
    row[_DIGEST] = zlib.crc32(f"{skeleton}|{metas}".encode())
    bad = [i for i, t in enumerate(leaves) if t.dim() == 0 or t.shape[0] % num_microbatches]
    if bad:
        row[_BAD] = bad[0]
    slots = list(enumerate(leaves[:_DESC_LEAVES]))
    if bad:
        slots.append((_DESC_LEAVES, leaves[bad[0]]))
    for k, t in slots:
        base = 4 + k * _LEAF
        row[base] = _DTYPE_CODES.index(t.dtype) if t.dtype in _DTYPE_CODES else -1
        row[base + 1] = t.dim()
        row[base + 2:base + 2 + min(t.dim(), _DESC_DIMS)] = list(t.shape)[:_DESC_DIMS]
    return row


def _leaf_text(row: list[int], slot: int) -> str:
    """``shape (5, 8), dtype int64`` of leaf slot ``slot`` of a description (``...`` past the described dims)."""
    base = 4 + slot * _LEAF
    code, ndim = row[base], row[base + 1]
    dims = [str(d) for d in row[base + 2:base + 2 + min(ndim, _DESC_DIMS)]] + (["..."] if ndim > _DESC_DIMS else [])
    shape = "(" + ", ".join(dims) + ("," if ndim == 1 else "") + ")"
    dtype = str(_DTYPE_CODES[code]).removeprefix("torch.") if code >= 0 else "unknown"
    return f"shape {shape}, dtype {dtype}"


def _desc_text(row: list[int]) -> str:
    """What a description says, e.g. ``shape (8, 16), dtype int64`` or ``2 tensors: shape ..; shape ..``."""
    if not row[_PRESENT]:
        return "nothing (None)"
    n = row[_COUNT]
    if n == 1:
        return _leaf_text(row, 0)
    shown = "; ".join(_leaf_text(row, k) for k in range(min(n, _DESC_LEAVES)))
    return f"{n} tensors: {shown}" + ("; ..." if n > _DESC_LEAVES else "")


def _leaf_name(what: str, row: list[int], index: int) -> str:
    return what if row[_COUNT] == 1 else f"{what} tensor #{index} (of {row[_COUNT]}, in flattening order)"


def _first_difference(a: list[int], b: list[int]) -> str:
    """Where two descriptions of present arguments differ, as ``got ... expected ...`` text."""
    if a[_COUNT] != b[_COUNT]:
        return f"{_desc_text(a)}, expected {_desc_text(b)}"
    for k in range(min(a[_COUNT], _DESC_LEAVES)):
        sa, sb = (r[4 + k * _LEAF:4 + (k + 1) * _LEAF] for r in (a, b))
        if sa != sb:
            which = "" if a[_COUNT] == 1 else f"tensor #{k}: "
            return f"{which}{_leaf_text(a, k)}, expected {_leaf_text(b, k)}"
    return (f"{_desc_text(a)}, expected {_desc_text(b)} (they differ in their structure, their dims past "
            f"{_DESC_DIMS}, or their tensors past #{_DESC_LEAVES - 1})")
