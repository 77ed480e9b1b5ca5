"""Sharding rules vescale adds (``vescale.dtensor.sharding_rules``) against the single-device op.

CPU scaled-dot-product attention (the kernel ``F.scaled_dot_product_attention`` picks on the CPU): output and the
gradients of query, key and value with the batch or the heads sharded, on 1-d meshes of 2 and 4 ranks (uneven: 3
batch rows over 2 or 4 ranks, 7 heads over 4 ranks; 6 heads over 4 ranks, where torch's chunking would leave a
rank without heads, are redistributed instead) and a 2x2 mesh (batch over one dim, heads over the other),
with a causal flag, an additive mask (broadcast over heads, or per batch row), and grouped-query attention. Compared
with ``assert_close(rtol=1e-6, atol=1e-6)``: each rank runs the same per-head arithmetic on its slice.
"""

from __future__ import annotations

import pytest

from vescale.core.testing import multi_rank, run_on_ranks

CASES = [  # (mesh shape, placements of q/k/v, heads, kv heads, batch, mask kind)
    ((2,), ("S1",), 4, 4, 2, None),
    ((2,), ("S0",), 4, 4, 3, "per_row"),
    ((2,), ("S1",), 4, 2, 2, "broadcast"),  # grouped-query attention, heads sharded
    ((4,), ("S1",), 7, 7, 2, "broadcast"),  # 7 heads over 4 ranks: uneven shards (2, 2, 2, 1)
    ((4,), ("S1",), 6, 6, 2, None),  # 6 heads over 4 ranks would leave rank 3 none: redistributed, not crashed
    ((4,), ("S0",), 4, 4, 3, None),  # 3 rows over 4 ranks: one rank empty
    ((2, 2), ("S0", "S1"), 4, 2, 2, "per_row"),
    ((2, 2), ("R", "S1"), 4, 4, 2, None),
]


def _placement(code):
    from vescale.dtensor import Replicate, Shard

    return Replicate() if code == "R" else Shard(int(code[1]))


def _attention(mesh_shape, codes, heads, kv_heads, batch, mask_kind):
    import torch
    import torch.nn.functional as F

    from vescale.dtensor import Replicate, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", mesh_shape)
    placements = [_placement(c) for c in codes]
    g = torch.Generator().manual_seed(7)
    seq, dim = 5, 8
    q = torch.randn(batch, heads, seq, dim, generator=g)
    k = torch.randn(batch, kv_heads, seq, dim, generator=g)
    v = torch.randn(batch, kv_heads, seq, dim, generator=g)
    grad = torch.randn(batch, heads, seq, dim, generator=g)
    mask = None
    if mask_kind == "broadcast":
        mask = torch.randn(seq, seq, generator=g)
    elif mask_kind == "per_row":
        mask = torch.randn(batch, 1, seq, seq, generator=g)
    kwargs = dict(is_causal=mask is None, enable_gqa=kv_heads != heads)

    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*ref, attn_mask=mask, **kwargs)
    out.backward(grad)

    dist = [distribute_tensor(t, mesh, placements).requires_grad_() for t in (q, k, v)]
    dmask = None
    if mask is not None:
        mask_placements = [p if p.is_shard(0) and mask.dim() == 4 else Replicate() for p in placements]
        dmask = distribute_tensor(mask, mesh, mask_placements)
    dout = F.scaled_dot_product_attention(*dist, attn_mask=dmask, **kwargs)
    # placements are kept unless torch.chunk would leave some rank without heads
    kept = all(len(torch.arange(n).chunk(mesh.size(i))) == mesh.size(i)
               for n in (heads, kv_heads) for i, code in enumerate(codes) if code == "S1")
    if kept:
        assert tuple(dout.placements) == tuple(placements), dout.placements  # no resharding of the output
    dout.backward(distribute_tensor(grad, mesh, placements).redistribute(mesh, dout.placements))
    where = f"mesh {mesh_shape} {codes} heads {heads}/{kv_heads} batch {batch} mask {mask_kind}"
    torch.testing.assert_close(dout.full_tensor(), out, rtol=1e-6, atol=1e-6, msg=lambda m: f"{where} output: {m}")
    for name, d, r in zip("qkv", dist, ref):
        assert tuple(d.grad.placements) == tuple(placements) or not kept, (name, d.grad.placements)
        torch.testing.assert_close(d.grad.full_tensor(), r.grad, rtol=1e-6, atol=1e-6,
                                   msg=lambda m, name=name: f"{where} grad {name}: {m}")


def _cases(world_size):
    import math

    for case in CASES:
        if math.prod(case[0]) == world_size:
            _attention(*case)


@multi_rank(world_sizes=[2, 4])
def test_cpu_attention_sharded_matches_single_device(world_size):
    _cases(world_size)


def _dropout_refused():
    import torch

    from vescale.dtensor import Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (1,))
    q = distribute_tensor(torch.randn(2, 4, 5, 8), mesh, [Shard(1)])
    with pytest.raises(NotImplementedError, match=r"dropout_p=0\.1 on DTensors.*attention_dropout=0\.0"):
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, q, q, 0.1, False)


def test_cpu_attention_dropout_refused():
    """Fused attention dropout on DTensors is refused with the reason (it would draw per-rank masks)."""
    run_on_ranks(_dropout_refused, 1)
