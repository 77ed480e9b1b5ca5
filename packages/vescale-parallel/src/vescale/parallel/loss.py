"""Vocab-parallel cross-entropy: the loss of vocab-sharded logits without gathering them, on any mesh.

The logits ``[..., V]`` stay sharded over the vocabulary along one mesh dim (the tp dim); other mesh dims may shard
leading (batch, sequence) dims or replicate. Per token the loss needs three sums over the vocabulary, so each rank
reduces its slice and one all-reduce over the tp group (after one all-reduce of the max, for stability) finishes them:
``log sum exp(x)``, the target logit (only the rank owning the target contributes) and, for label smoothing,
``sum x``. With smoothing ``eps`` the per-token loss is ``(1 - eps) * nll + eps * (logsumexp - mean(x))``, torch's
definition; ``ignore_index`` tokens contribute 0 and are left out of the mean. ``backward`` is local:
``softmax - (1 - eps) * onehot - eps / V``.

:func:`loss_parallel` routes ``F.cross_entropy`` / ``nn.CrossEntropyLoss`` on such DTensor logits to this function,
so unmodified model code (Hugging Face's loss) uses it; unlike torch's ``loss_parallel`` it supports
``label_smoothing`` and needs no context in ``backward``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.overrides import TorchFunctionMode

from vescale.dtensor.layout import contiguous_stride
from vescale.parallel.errors import LossParallelError

__all__ = ["vocab_parallel_cross_entropy", "loss_parallel"]


class _VocabParallelCE(torch.autograd.Function):
    """Per-token cross-entropy of local vocab slices ``x [N, v]``; ``t [N]`` global target ids."""

    @staticmethod
    def forward(ctx, x, t, group, v0: int, vocab: int, eps: float, ignore_index: int):
        xf = x.float()
        vloc = xf.shape[-1]
        m = xf.max(dim=-1).values if vloc else xf.new_full(xf.shape[:-1], float("-inf"))
        if group is not None:
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        z = xf - m.unsqueeze(-1)
        valid = t != ignore_index
        mine = valid & (t >= v0) & (t < v0 + vloc)
        local_t = torch.where(mine, t - v0, torch.zeros_like(t))
        sums = torch.stack([z.exp().sum(-1),
                            torch.where(mine, z.gather(-1, local_t.unsqueeze(-1)).squeeze(-1), torch.zeros_like(m)),
                            z.sum(-1)], dim=-1)
        if group is not None:
            dist.all_reduce(sums, group=group)
        lse = sums[..., 0].log()
        loss = lse - sums[..., 1]
        if eps:
            loss = (1.0 - eps) * loss + eps * (lse - sums[..., 2] / vocab)
        loss = torch.where(valid, loss, torch.zeros_like(loss))
        ctx.save_for_backward(z, lse, local_t, mine, valid)
        ctx.eps, ctx.vocab, ctx.dtype = eps, vocab, x.dtype
        return loss.to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        z, lse, local_t, mine, valid = ctx.saved_tensors
        g = (z - lse.unsqueeze(-1)).exp()
        g.scatter_add_(-1, local_t.unsqueeze(-1), -(1.0 - ctx.eps) * mine.to(g.dtype).unsqueeze(-1))
        if ctx.eps:
            g -= ctx.eps / ctx.vocab
        g *= (grad.float() * valid).unsqueeze(-1)
        return g.to(ctx.dtype), None, None, None, None, None, None


def _vocab_slice(vocab: int, n: int, coord: int) -> tuple[int, int]:
    """Offset and size of piece ``coord`` of ``n`` when ``Shard`` splits ``vocab`` (torch.chunk's rule)."""
    chunk = -(-vocab // n)
    start = min(coord * chunk, vocab)
    return start, max(0, min(vocab, start + chunk) - start)


def vocab_parallel_cross_entropy(logits: DTensor, target: torch.Tensor, *, ignore_index: int = -100,
                                 label_smoothing: float = 0.0, reduction: str = "mean") -> DTensor:
    """Cross-entropy of DTensor ``logits [..., V]`` against class ids ``target [...]``, gathering no logits.

    ``logits`` may be sharded on its last (class) dim along at most one mesh dim; on the other mesh dims it must be
    ``Replicate`` or ``Shard`` of a leading dim (``Partial`` is reduced first). ``target`` is a DTensor of the same
    leading shape, or a plain tensor holding this rank's piece (the logits' local shape without the class dim).
    Returns a DTensor: per-token losses (``reduction="none"``, placed like the logits minus the class dim), or the
    ``Replicate`` scalar sum / mean over non-ignored tokens of the *global* batch, as ``F.cross_entropy`` computes on
    one device. Collectives: all-reduce MAX and one all-reduce SUM (3 floats per token) over the vocab mesh dim,
    plus the scalar reductions over batch-sharding dims.
    """
    if not isinstance(logits, DTensor):
        raise LossParallelError(f"vocab_parallel_cross_entropy needs DTensor logits, got {type(logits).__name__}")
    if reduction not in ("mean", "sum", "none"):
        raise LossParallelError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise LossParallelError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    mesh, ndim = logits.device_mesh, logits.ndim
    if ndim < 1:
        raise LossParallelError("logits must have a class dim")
    if any(isinstance(p, Partial) for p in logits.placements):
        logits = logits.redistribute(mesh, [Replicate() if isinstance(p, Partial) else p for p in logits.placements])
    class_dim = ndim - 1
    vocab_dims, out_placements = [], []
    for i, p in enumerate(logits.placements):
        if isinstance(p, Shard) and (p.dim % ndim) == class_dim:
            if type(p) is not Shard:
                raise LossParallelError(f"logits placement {p} on mesh dim {i}: only plain Shard of the class dim is "
                                        "supported")
            vocab_dims.append(i)
            out_placements.append(Replicate())
        else:
            out_placements.append(p)
    if len(vocab_dims) > 1:
        raise LossParallelError(f"logits {tuple(logits.shape)} shard the class dim on mesh dims {vocab_dims} of "
                                f"{mesh}; at most one is supported")
    vocab = logits.shape[-1]
    if vocab_dims:
        d = vocab_dims[0]
        group, n, coord = mesh.get_group(d), mesh.size(d), mesh.get_local_rank(d)
        v0, vloc = _vocab_slice(vocab, n, coord)
    else:
        group, v0, vloc = None, 0, vocab
    local = logits.to_local()
    if local.shape[-1] != vloc:
        raise LossParallelError(f"local logits {tuple(local.shape)} do not hold the expected {vloc} classes")
    if isinstance(target, DTensor):
        if tuple(target.shape) != tuple(logits.shape[:-1]):
            raise LossParallelError(f"target shape {tuple(target.shape)} does not match logits {tuple(logits.shape)}")
        t_local = target.redistribute(mesh, out_placements).to_local()
    elif isinstance(target, torch.Tensor):
        t_local = target
    else:
        raise LossParallelError(f"target must be a tensor, got {type(target).__name__}")
    if tuple(t_local.shape) != tuple(local.shape[:-1]):
        raise LossParallelError(f"target piece {tuple(t_local.shape)} does not match this rank's logits piece "
                                f"{tuple(local.shape)} (logits {tuple(logits.shape)}, placements {logits.placements})")
    per_token = _VocabParallelCE.apply(local, t_local.long(), group, v0, vocab, float(label_smoothing),
                                       int(ignore_index))
    shape = logits.shape[:-1]
    losses = DTensor.from_local(per_token, mesh, out_placements, run_check=False, shape=shape,
                                stride=contiguous_stride(shape))
    if reduction == "none":
        return losses
    total = losses.sum().redistribute(mesh, [Replicate()] * mesh.ndim)
    if reduction == "sum":
        return total
    count_local = (t_local != ignore_index).to(per_token.dtype)
    count = DTensor.from_local(count_local, mesh, out_placements, run_check=False, shape=shape,
                               stride=contiguous_stride(shape)).sum().redistribute(mesh, [Replicate()] * mesh.ndim)
    return total / count


class _LossParallelMode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is F.cross_entropy and args and isinstance(args[0], DTensor):
            return _cross_entropy_call(*args, **kwargs)
        return func(*args, **kwargs)


def _cross_entropy_call(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
                        reduction="mean", label_smoothing=0.0):
    if weight is not None or size_average is not None or reduce is not None:
        raise LossParallelError("loss_parallel: class weights and the legacy size_average/reduce are not supported")
    if input.ndim != 2:
        raise LossParallelError(f"loss_parallel: F.cross_entropy input must be [N, C] (got {tuple(input.shape)}); "
                                "flatten the leading dims as Hugging Face models do")
    if isinstance(target, torch.Tensor) and target.is_floating_point():
        raise LossParallelError("loss_parallel: class-probability targets are not supported, give class ids")
    return vocab_parallel_cross_entropy(input, target, ignore_index=ignore_index, label_smoothing=label_smoothing,
                                        reduction=reduction)


@contextlib.contextmanager
def loss_parallel() -> Iterator[None]:
    """Inside, ``F.cross_entropy`` (and ``nn.CrossEntropyLoss``) on DTensor logits ``[N, C]`` is vocab-parallel.

    Calls on plain tensors are untouched. ``backward`` may run outside the context.
    """
    with _LossParallelMode():
        yield
