"""Exact causal attention of a context-parallel rank's two sequence chunks, block by block, with no ``S^2`` mask.

Under load-balanced context parallelism (:mod:`vescale.parallel.context_parallel`) a sequence of ``S`` tokens is cut
into ``2 * cp`` chunks of ``c = S / (2 cp)`` tokens and cp rank ``r`` holds chunks ``r`` and ``2 cp - 1 - r``. Each
attention layer all-gathers the keys and values of every rank (rank after rank, each rank's two chunks in its order).
:func:`chunked_causal_attention` computes this rank's queries against them:

- Query chunk ``g`` (a global chunk index) attends to key chunks ``0 .. g``: the diagonal block ``g`` under the causal
  triangle, every block before it whole, blocks wholly outside a sliding window skipped and blocks it cuts masked.
  Each block is ``c x c`` scores, made and dropped at once; the blocks of a query chunk are merged exactly by an online
  log-sum-exp (the running row maximum and normaliser of flash attention). Nothing of size ``S/cp x S`` is ever kept:
  the forward saves the queries, the gathered keys and values, the output and one log-sum-exp per query row.
- The backward recomputes each block's probabilities from the saved log-sum-exp and accumulates the query, key and
  value gradients block by block (the flash-attention backward), so it too holds one block at a time.
- Packed documents: with ``docs`` (a document id per position of the whole sequence, ``[B or 1, S]`` in sequence
  order, non-decreasing along each row) a query attends only to keys of its own document, causally (the mask
  transformers builds for packed rows, see :mod:`vescale.parallel.context_parallel`). Every block is then masked by
  document equality (blocks are not skipped by document: the cost is that of one unpacked sequence).
- Grouped key/value heads stay grouped (queries are viewed as ``[B, Hkv, G, T, D]`` against ``[B, Hkv, 1, T, D]``
  keys): no repeated copy of the keys or values.
- Scores, softmax statistics and accumulators are fp32 (fp64 for fp64 operands) whatever the operands' dtype (as
  transformers' eager attention takes the softmax in fp32); the result is cast back. In fp32 it equals one device's
  sdpa or eager attention to rounding (``rtol 1e-5``), as the tests check.

It is plain torch arithmetic (matmuls, ``exp``, reductions), so it runs on any device and backend; the price is one
Python-level step per block (``2 cp + 1`` blocks per layer and rank, fewer with a window) instead of one fused kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vescale.parallel.errors import ContextParallelError

__all__ = ["ChunkLayout", "chunked_causal_attention", "chunked_forward", "chunked_backward", "attention_output"]


@dataclass(frozen=True)
class ChunkLayout:
    """Where a cp rank's chunks and the gathered keys' chunks lie: ``size`` cp ranks, this ``rank``, ``chunk`` tokens
    a chunk (a sequence is ``2 * size * chunk`` tokens)."""

    size: int
    rank: int
    chunk: int

    def query_chunks(self) -> tuple[int, int]:
        """The global chunk indices of this rank's queries, in their local order: head, then tail."""
        return self.rank, 2 * self.size - 1 - self.rank

    def key_offset(self, g: int) -> int:
        """Where global chunk ``g`` starts in the gathered keys (rank after rank, each rank's head then tail)."""
        owner = g if g < self.size else 2 * self.size - 1 - g
        return owner * 2 * self.chunk + (0 if g < self.size else self.chunk)


def _blocks(layout: ChunkLayout, g: int, window: int | None):
    """``(key chunk, needs a mask)`` for query chunk ``g``: the diagonal first (every query row keeps at least its own
    key, so the running maximum is finite from the first block on), then the earlier chunks, those wholly outside the
    window skipped."""
    c = layout.chunk
    for kc in range(g, -1, -1):
        nearest = g * c - (kc * c + c - 1)  # the smallest query-key distance in the block
        farthest = g * c + c - 1 - kc * c
        if window is not None and nearest >= window:
            break
        yield kc, kc == g or (window is not None and farthest >= window)


def _allowed(g: int, kc: int, c: int, window: int | None, device) -> torch.Tensor:
    """``[c, c]`` bool: which keys of chunk ``kc`` each query of chunk ``g`` may attend to (causal, within window)."""
    q_pos = torch.arange(g * c, (g + 1) * c, device=device)
    k_pos = torch.arange(kc * c, (kc + 1) * c, device=device)
    distance = q_pos[:, None] - k_pos[None, :]
    allowed = distance >= 0
    if window is not None:
        allowed &= distance < window
    return allowed


def _block_mask(g: int, kc: int, c: int, window: int | None, masked: bool, docs: torch.Tensor | None,
                device) -> torch.Tensor | None:
    """Which keys of chunk ``kc`` each query of chunk ``g`` may attend to, broadcastable against the scores
    ``[B, Hkv, G, c, c]``: ``[c, c]`` (causal / window, when ``masked``), with ``docs`` also ``[B or 1, 1, 1, c, c]``
    (the same document); None when every key may be attended to."""
    allowed = _allowed(g, kc, c, window, device) if masked else None
    if docs is None:
        return allowed
    same = docs[:, g * c:(g + 1) * c, None] == docs[:, None, kc * c:(kc + 1) * c]
    if allowed is not None:
        same = same & allowed
    return same[:, None, None]


def _accumulation_dtype(q: torch.Tensor) -> torch.dtype:
    """fp32, or the operands' dtype where it is wider (fp64)."""
    return torch.promote_types(q.dtype, torch.float32)


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, mask: torch.Tensor | None) -> torch.Tensor:
    s = torch.matmul(q, k.transpose(-1, -2)).mul_(scale)
    return s if mask is None else s.masked_fill_(~mask, float("-inf"))


def chunked_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: ChunkLayout, scale: float,
                    window: int | None,
                    docs: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward of :func:`chunked_causal_attention` without autograd: ``(out [B, H, 2c, D]`` in ``q``'s dtype
    (laid out as :func:`attention_output`),
    ``lse [B, Hkv, H/Hkv, 2c, 1]`` fp32 or wider), what :func:`chunked_backward` takes."""
    b, h, t, d = q.shape
    hkv, c = k.shape[1], layout.chunk
    acc_dtype = _accumulation_dtype(q)
    qg = q.reshape(b, hkv, h // hkv, t, d).to(acc_dtype)
    kf, vf = k.to(acc_dtype).unsqueeze(2), v.to(acc_dtype).unsqueeze(2)  # [B, Hkv, 1, S, D]
    outs, lses = [], []
    for j, g in enumerate(layout.query_chunks()):
        qj = qg[..., j * c:(j + 1) * c, :]
        m = norm = acc = None
        for kc, masked in _blocks(layout, g, window):
            at = layout.key_offset(kc)
            mask = _block_mask(g, kc, c, window, masked, docs, q.device)
            s = _scores(qj, kf[..., at:at + c, :], scale, mask)
            m_new = s.amax(-1, keepdim=True) if m is None else torch.maximum(m, s.amax(-1, keepdim=True))
            p = torch.exp(s - m_new)
            pv = torch.matmul(p, vf[..., at:at + c, :])
            if m is None:
                norm, acc = p.sum(-1, keepdim=True), pv
            else:
                alpha = torch.exp(m - m_new)
                norm = norm * alpha + p.sum(-1, keepdim=True)
                acc = acc * alpha + pv
            m = m_new
        outs.append(acc / norm)
        lses.append(m + torch.log(norm))
    out = torch.cat(outs, dim=-2).reshape(b, h, t, d)
    return attention_output(q).copy_(out), torch.cat(lses, dim=-2)


def attention_output(q: torch.Tensor) -> torch.Tensor:
    """An empty ``[B, H, T, D]`` output for queries ``q`` laid out as ``[B, T, H, D]`` in memory (as torch's fused
    attention kernels return it): the model's ``transpose(1, 2)`` back to ``[B, T, H * D]`` is then a view, not a
    second copy kept for the output projection's backward."""
    b, h, t, d = q.shape
    return q.new_empty((b, t, h, d)).transpose(1, 2)


def chunked_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                     lse: torch.Tensor, layout: ChunkLayout, scale: float, window: int | None,
                     docs: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of :func:`chunked_causal_attention` from what :func:`chunked_forward` returned: each block's
    probabilities recomputed from ``lse``, the gradients accumulated block by block (the flash-attention backward)."""
    b, h, t, d = q.shape
    hkv, c = k.shape[1], layout.chunk
    shape = (b, hkv, h // hkv, t, d)
    acc_dtype = _accumulation_dtype(q)
    qg, dout = q.reshape(shape).to(acc_dtype), grad_out.reshape(shape).to(acc_dtype)
    delta = (dout * out.reshape(shape).to(acc_dtype)).sum(-1, keepdim=True)  # rowsum(dO * O)
    kf, vf = k.to(acc_dtype).unsqueeze(2), v.to(acc_dtype).unsqueeze(2)
    dq = torch.zeros(shape, dtype=acc_dtype, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc_dtype, device=k.device)
    dv = torch.zeros(v.shape, dtype=acc_dtype, device=v.device)
    for j, g in enumerate(layout.query_chunks()):
        rows = slice(j * c, (j + 1) * c)
        qj, doj = qg[..., rows, :], dout[..., rows, :]
        for kc, masked in _blocks(layout, g, window):
            at = layout.key_offset(kc)
            mask = _block_mask(g, kc, c, window, masked, docs, q.device)
            kb, vb = kf[..., at:at + c, :], vf[..., at:at + c, :]
            p = torch.exp(_scores(qj, kb, scale, mask) - lse[..., rows, :])
            dv[:, :, at:at + c] += torch.matmul(p.transpose(-1, -2), doj).sum(2)
            ds = p * (torch.matmul(doj, vb.transpose(-1, -2)) - delta[..., rows, :])
            ds.mul_(scale)
            dq[..., rows, :] += torch.matmul(ds, kb)
            dk[:, :, at:at + c] += torch.matmul(ds.transpose(-1, -2), qj).sum(2)
    return dq.reshape(b, h, t, d).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _ChunkedCausalAttention(torch.autograd.Function):
    """``q [B, H, 2c, D]`` (this rank's chunks), ``k, v [B, Hkv, 2 cp c, D]`` (gathered) -> ``[B, H, 2c, D]``."""

    @staticmethod
    def forward(ctx, q, k, v, layout: ChunkLayout, scale: float, window: int | None, docs: torch.Tensor | None):
        out, lse = chunked_forward(q, k, v, layout, scale, window, docs)
        ctx.save_for_backward(q, k, v, out, lse, docs)
        ctx.layout, ctx.scale, ctx.window = layout, scale, window
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, docs = ctx.saved_tensors
        return (*chunked_backward(grad_out, q, k, v, out, lse, ctx.layout, ctx.scale, ctx.window, docs),
                None, None, None, None)


def chunked_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: ChunkLayout,
                             scale: float | None = None, window: int | None = None,
                             docs: torch.Tensor | None = None) -> torch.Tensor:
    """``[B, H, 2c, D]``: exact causal attention (within ``window`` when given: query ``i`` sees key ``j`` iff
    ``0 <= i - j < window``; with ``docs`` only keys of the query's own document, see the module docstring) of this
    rank's queries ``q [B, H, 2c, D]`` (its head chunk, then its tail chunk) against the gathered
    ``k, v [B, Hkv, 2 cp c, D]`` (rank after rank), ``H`` a multiple of ``Hkv``; differentiable in all three.
    ``docs``: integer ``[B or 1, 2 cp c]``, the whole sequence's document ids in sequence order. ``scale`` defaults
    to ``D ** -0.5``. No collective."""
    if q.shape[2] != 2 * layout.chunk or k.shape[2] != 2 * layout.size * layout.chunk or k.shape != v.shape:
        raise ContextParallelError(f"chunked_causal_attention: queries {tuple(q.shape)} and keys {tuple(k.shape)} / "
                                   f"values {tuple(v.shape)} do not match {layout}")
    if q.shape[1] % k.shape[1]:
        raise ContextParallelError(f"chunked_causal_attention: {q.shape[1]} query heads are not a multiple of "
                                   f"{k.shape[1]} key/value heads")
    if docs is not None and (docs.dim() != 2 or docs.shape[1] != k.shape[2] or docs.shape[0] not in (1, q.shape[0])
                             or docs.is_floating_point()):
        raise ContextParallelError(f"chunked_causal_attention: document ids {tuple(docs.shape)} ({docs.dtype}) must "
                                   f"be integers [B or 1, S] for queries {tuple(q.shape)} and keys {tuple(k.shape)}")
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    return _ChunkedCausalAttention.apply(q, k, v, layout, float(scale), window, docs)
