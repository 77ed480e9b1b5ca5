"""The blockwise causal attention of a context-parallel rank against one full-sequence attention, in one process.

Each cp rank's queries (its head and tail chunks) attend to the keys and values of every rank (gathered rank after
rank) through :func:`chunked_causal_attention`; the ranks' outputs put back in sequence order, and their gradients
summed, must equal torch's ``scaled_dot_product_attention`` of the whole sequence under the dense causal (and sliding
window; with packed documents also per document) mask: fp64 to the default tolerance, fp32 at ``rtol 1e-5``. No
process group is needed: the gather is done by indexing here.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vescale.parallel import ContextParallelError
from vescale.parallel.chunked_attention import ChunkLayout, chunked_causal_attention
from vescale.parallel.context_parallel import local_positions


def _dense(q, k, v, window, docs=None):
    pos = torch.arange(q.shape[2])
    distance = pos[:, None] - pos[None, :]
    allowed = distance >= 0
    if window is not None:
        allowed &= distance < window
    if docs is not None:  # [B or 1, S]: a query sees only keys of its own document
        allowed = (allowed & (docs[:, :, None] == docs[:, None, :]))[:, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=True)


@pytest.mark.parametrize("cp,window,dtype", [(1, None, torch.float64), (2, None, torch.float64),
                                             (3, 5, torch.float64), (2, 13, torch.float64),
                                             (4, None, torch.float32), (2, 7, torch.float32)])
def test_ranks_together_equal_one_attention(cp, window, dtype):
    g = torch.Generator().manual_seed(cp)
    b, h, hkv, s, d = 2, 4, 2, 24, 8
    q, k, v = (torch.randn(b, n, s, d, generator=g, dtype=dtype, requires_grad=True) for n in (h, hkv, hkv))
    ref = _dense(q, k, v, window)
    grad_out = torch.randn(ref.shape, generator=g, dtype=dtype)
    ref.backward(grad_out)
    order = torch.cat([local_positions(s, cp, r) for r in range(cp)])  # the gathered keys' order
    out, dq, dk, dv = torch.zeros_like(ref), torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for rank in range(cp):
        mine = local_positions(s, cp, rank)
        ql = q.detach()[:, :, mine].requires_grad_()
        kg, vg = (t.detach()[:, :, order].requires_grad_() for t in (k, v))
        part = chunked_causal_attention(ql, kg, vg, ChunkLayout(cp, rank, s // (2 * cp)), window=window)
        part.backward(grad_out[:, :, mine])
        out[:, :, mine] = part.detach()
        dq[:, :, mine] += ql.grad
        dk[:, :, order] += kg.grad
        dv[:, :, order] += vg.grad
    tol = {} if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-6)
    for name, got, want in (("out", out, ref), ("dq", dq, q.grad), ("dk", dk, k.grad), ("dv", dv, v.grad)):
        torch.testing.assert_close(got, want.detach(), **tol, msg=lambda m, name=name: f"{name}: {m}")


def _documents(lengths: list[list[int]]) -> torch.Tensor:
    return torch.stack([torch.cat([torch.full((n,), i) for i, n in enumerate(row)]) for row in lengths])


@pytest.mark.parametrize("cp,window,dtype,lengths", [
    (1, None, torch.float64, [[5, 19], [24]]),
    (2, None, torch.float64, [[3, 6, 7, 8], [1, 1, 22]]),  # documents across chunk boundaries, one-token ones
    (3, 5, torch.float64, [[10, 14], [4, 4, 4, 12]]),
    (4, None, torch.float32, [[7, 2, 9, 6], [24]]),
    (2, 7, torch.float32, [[13, 11]]),  # one row of ids for a batch of two (broadcast)
])
def test_packed_documents_ranks_together_equal_one_masked_attention(cp, window, dtype, lengths):
    """With document ids, every rank's queries attend only within their document (and causally, in the window):
    together equal to sdpa of the whole sequence under that dense mask, outputs and the three gradients."""
    g = torch.Generator().manual_seed(10 + cp)
    b, h, hkv, s, d = 2, 4, 2, 24, 8
    docs = _documents(lengths)
    q, k, v = (torch.randn(b, n, s, d, generator=g, dtype=dtype, requires_grad=True) for n in (h, hkv, hkv))
    ref = _dense(q, k, v, window, docs)
    assert not torch.allclose(ref, _dense(q, k, v, window))  # the documents change the result
    grad_out = torch.randn(ref.shape, generator=g, dtype=dtype)
    ref.backward(grad_out)
    order = torch.cat([local_positions(s, cp, r) for r in range(cp)])
    out, dq, dk, dv = torch.zeros_like(ref), torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for rank in range(cp):
        mine = local_positions(s, cp, rank)
        ql = q.detach()[:, :, mine].requires_grad_()
        kg, vg = (t.detach()[:, :, order].requires_grad_() for t in (k, v))
        part = chunked_causal_attention(ql, kg, vg, ChunkLayout(cp, rank, s // (2 * cp)), window=window, docs=docs)
        part.backward(grad_out[:, :, mine])
        out[:, :, mine] = part.detach()
        dq[:, :, mine] += ql.grad
        dk[:, :, order] += kg.grad
        dv[:, :, order] += vg.grad
    tol = {} if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-6)
    for name, got, want in (("out", out, ref), ("dq", dq, q.grad), ("dk", dk, k.grad), ("dv", dv, v.grad)):
        torch.testing.assert_close(got, want.detach(), **tol, msg=lambda m, name=name: f"{name}: {m}")


def test_shapes_that_do_not_match_the_layout_are_refused():
    q, k = torch.zeros(1, 4, 6, 8), torch.zeros(1, 2, 12, 8)
    with pytest.raises(ContextParallelError, match="do not match"):
        chunked_causal_attention(q, k, k, ChunkLayout(2, 0, 4))
    with pytest.raises(ContextParallelError, match="not a multiple"):
        chunked_causal_attention(torch.zeros(1, 3, 6, 8), k, k, ChunkLayout(2, 0, 3))
    with pytest.raises(ContextParallelError, match="document ids"):
        chunked_causal_attention(torch.zeros(1, 4, 6, 8), k, k, ChunkLayout(2, 0, 3), docs=torch.zeros(1, 6))
