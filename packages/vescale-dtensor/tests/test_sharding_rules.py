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


SOLVE_CASES = [  # (mesh shape, placements of A, placements of B, A shape, B shape, left)
    ((2,), ("R",), ("S0",), (4, 3, 4, 4), (4, 3, 4, 5), True),  # torch's rule broadcast these silently
    ((2,), ("S0",), ("S0",), (4, 3, 4, 4), (4, 3, 4, 5), True),
    ((2,), ("R",), ("S0",), (3, 4, 4), (2, 3, 4, 5), True),  # A broadcasts over B's extra leading dim
    ((2,), ("R",), ("S0",), (1, 3, 4, 4), (2, 3, 4, 5), True),  # A broadcasts (size 1)
    ((2,), ("R",), ("S3",), (4, 3, 4, 4), (4, 3, 4, 5), True),  # right-hand-side columns
    ((2,), ("R",), ("S2",), (4, 3, 5, 5), (4, 3, 4, 5), False),  # rows, for X A = B
    ((2, 2), ("S0", "R"), ("S0", "S0"), (4, 3, 1, 4, 4), (4, 3, 1, 4, 5), True),  # Qwen3-Next's gated delta rule
    ((2, 2), ("R", "S1"), ("S4", "R"), (4, 3, 1, 4, 4), (4, 3, 1, 4, 5), True),
]


def _solve(mesh_shape, a_codes, b_codes, a_shape, b_shape, left):
    import torch

    from vescale.dtensor import distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", mesh_shape)
    g = torch.Generator().manual_seed(3)
    n = a_shape[-1]
    a = torch.randn(*a_shape, generator=g).tril() + n * torch.eye(n)  # well conditioned, lower triangular
    b = torch.randn(*b_shape, generator=g)
    ref = [a.clone().requires_grad_(), b.clone().requires_grad_()]
    out = torch.linalg.solve_triangular(*ref, upper=False, left=left)
    grad = torch.randn(out.shape, generator=g)
    out.backward(grad)

    dist = [distribute_tensor(t, mesh, [_placement(c) for c in codes]).requires_grad_()
            for t, codes in ((a, a_codes), (b, b_codes))]
    dout = torch.linalg.solve_triangular(*dist, upper=False, left=left)
    dout.backward(distribute_tensor(grad, mesh, dout.placements))
    where = f"mesh {mesh_shape} A {a_codes} {a_shape} B {b_codes} {b_shape} left={left}"
    torch.testing.assert_close(dout.full_tensor(), out, rtol=1e-5, atol=1e-6, msg=lambda m: f"{where} output: {m}")
    for name, d, r in zip("AB", dist, ref):
        torch.testing.assert_close(d.grad.full_tensor(), r.grad, rtol=1e-5, atol=1e-6,
                                   msg=lambda m, name=name: f"{where} grad {name}: {m}")


@multi_rank(world_sizes=[2, 4])
def test_solve_triangular_matches_single_device(world_size):
    """``linalg_solve_triangular`` (and its backward, which solves again and multiplies) with batch dims sharded,
    broadcast, or not, the right-hand side's columns (rows for ``left=False``) sharded, on 2 ranks and a 2x2 mesh.
    torch's own rule paired a batch-sharded B with a replicated A that has the batch dim in full, and the local
    kernel broadcast the unequal local batches into a wrong result (the first and the 2x2 cases)."""
    import math

    for case in SOLVE_CASES:
        if math.prod(case[0]) == world_size:
            _solve(*case)


def _copy_into_partial():
    import torch
    import torch.distributed as dist

    from vescale.dtensor import DTensor, Partial, Replicate, Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2))
    g = torch.Generator().manual_seed(5)
    base, value = torch.randn(4, 3, 6, generator=g), torch.randn(4, 6, generator=g)
    for dst_placements, src_placements in [([Shard(0), Partial()], [Shard(0), Shard(0)]),
                                           ([Partial(), Replicate()], [Shard(1), Replicate()]),
                                           ([Partial("avg"), Partial()], [Replicate(), Shard(0)])]:
        # a partial tensor whose parts add up to ``base``: rank r's part is base * w_r on each partial dim
        local = distribute_tensor(base, mesh, [Replicate() if p.is_partial() else p for p in dst_placements])
        part = local.to_local().clone()
        for dim, p in enumerate(dst_placements):
            if p.is_partial() and p.reduce_op == "sum":
                part = part * (0.25 if mesh.get_local_rank(dim) == 0 else 0.75)
        dst = DTensor.from_local(part, mesh, dst_placements, run_check=False, shape=base.shape,
                                 stride=base.stride())
        dst[:, 1] = distribute_tensor(value, mesh, src_placements)  # the write RecurrentGemma's scan makes
        want = base.clone()
        want[:, 1] = value
        where = f"dst {dst_placements} <- src {src_placements}"
        torch.testing.assert_close(dst.full_tensor(), want, rtol=1e-6, atol=1e-6,
                                   msg=lambda m, where=where: f"{where}: {m}")
    dist.barrier()


def test_copy_into_partial_matches_single_device():
    """An indexed write of a sharded tensor into a partial one (torch has no Shard -> Partial redistribution): the
    result's full tensor is the plain write's, for sum and avg partials on a 2x2 mesh."""
    run_on_ranks(_copy_into_partial, 4)


def _interleaved_splits():
    import torch

    from vescale.dtensor import (
        InterleavedShard,
        Replicate,
        Shard,
        count_comms,
        distribute_tensor,
        init_device_mesh,
        strict,
    )

    mesh = init_device_mesh("cpu", (2, 2))
    x = torch.randn(2, 3, 4 * 12, generator=torch.Generator().manual_seed(5))  # [q | k | v | w], 12 columns each
    d = distribute_tensor(x, mesh, [Shard(0), InterleavedShard(2, 4)])
    cases = [(12, [Shard(2)] * 4), ([24, 12, 12], [InterleavedShard(2, 2), Shard(2), Shard(2)])]
    for split, placements in cases:
        with strict(), count_comms() as comms:  # local: no redistribution, no collective
            pieces = d.split(split, dim=2)
        assert comms.total == 0, (split, comms.counts)
        for piece, want, p in zip(pieces, x.split(split, dim=2), placements, strict=True):
            assert tuple(piece.placements) == (Shard(0), p), (split, piece.placements)
            torch.testing.assert_close(piece.full_tensor(), want, rtol=0, atol=0)
    # a cut inside a chunk takes torch's path (the dim gathered), with the plain op's values
    for piece, want in zip(d.split(8, dim=2), x.split(8, dim=2), strict=True):
        assert isinstance(piece.placements[1], Replicate)
        torch.testing.assert_close(piece.full_tensor(), want, rtol=0, atol=0)


def test_split_of_interleaved_dim_at_chunk_boundaries_is_local():
    """``split`` of an ``InterleavedShard(2, 4)`` dim into whole chunks (GPT-2's fused ``c_attn`` output into q, k,
    v): each piece ``Shard(2)`` (``InterleavedShard(2, 2)`` for two chunks) with the plain split's values and no
    collective, on a 2x2 mesh whose other dim shards the batch; a cut inside a chunk gathers, as torch does."""
    run_on_ranks(_interleaved_splits, 4)


@multi_rank(world_sizes=[2])
def test_cpu_attention_query_rows_sharded_stay_sharded(world_size):
    """Query rows sharded (``Shard(2)``, 5 rows over 2 ranks: uneven), key and value replicated, no causal mask, with
    and without a row-wise ``attn_mask``: the output stays ``Shard(2)`` with no collective, as torch's rule (found
    through the op's decomposition) keeps it, and output and q/k/v gradients equal one device's. Causal: the rows
    are gathered (the kernel's causal mask would take local row indices), values still one device's; so are rows a
    rank would hold none of."""
    import torch
    import torch.nn.functional as F

    from vescale.dtensor import Replicate, Shard, count_comms, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, n, 8, generator=g) for n in (5, 6, 6))
    mask = torch.randn(5, 6, generator=g)
    w = torch.randn(2, 3, 5, 8, generator=g)
    for causal, with_mask in ((False, False), (False, True), (True, False)):
        ref = [t.clone().requires_grad_() for t in (q, k, v)]
        kw = {"is_causal": causal, "attn_mask": mask if with_mask else None}
        out = F.scaled_dot_product_attention(*ref, **kw)
        (out * w).sum().backward()
        dq = distribute_tensor(q, mesh, [Shard(2)]).requires_grad_()
        dk, dv = (distribute_tensor(t, mesh, [Replicate()]).requires_grad_() for t in (k, v))
        dmask = distribute_tensor(mask, mesh, [Shard(0)]) if with_mask else None
        with count_comms() as comms:
            dout = F.scaled_dot_product_attention(dq, dk, dv, is_causal=causal, attn_mask=dmask)
        if not causal:
            assert tuple(dout.placements) == (Shard(2),) and comms.total == 0, (with_mask, dout.placements)
        torch.testing.assert_close(dout.full_tensor(), out, rtol=1e-6, atol=1e-6)
        (dout * distribute_tensor(w, mesh, [Replicate()]).redistribute(mesh, dout.placements)).sum().backward()
        for d, r in zip((dq, dk, dv), ref):
            torch.testing.assert_close(d.grad.full_tensor(), r.grad, rtol=1e-5, atol=1e-6)
    # one query row over 2 ranks: a rank would hold none (torch's CPU kernel dies of SIGFPE): gathered instead
    one = q[:, :, :1]
    dout = F.scaled_dot_product_attention(distribute_tensor(one, mesh, [Shard(2)]),
                                          *(distribute_tensor(t, mesh, [Replicate()]) for t in (k, v)))
    torch.testing.assert_close(dout.full_tensor(), F.scaled_dot_product_attention(one, k, v), rtol=1e-6, atol=1e-6)


def _unique_family():
    import torch

    from vescale.dtensor import Replicate, Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (2,))
    x = torch.tensor([[3, 1, 3, 7], [1, 1, 9, 3], [5, 5, 5, 0]])
    for placements in ([Replicate()], [Shard(0)], [Shard(1)]):
        d = distribute_tensor(x, mesh, placements)
        calls = [lambda t: t.unique(), lambda t: t.unique(sorted=True, return_inverse=True, return_counts=True),
                 lambda t: t.unique(dim=0, return_counts=True), lambda t: t.unique_consecutive(return_counts=True)]
        for i, call in enumerate(calls):
            got, want = call(d), call(x)
            for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,),
                            strict=True):
                assert all(isinstance(p, Replicate) for p in g.placements), (placements, i, g.placements)
                torch.testing.assert_close(g.full_tensor(), w, rtol=0, atol=0)


def test_unique_family_runs_whole_on_every_rank():
    """``unique`` (``_unique2``), ``unique(dim=)`` and ``unique_consecutive`` of a DTensor (torch has no rule: the
    output shape depends on the data; Kolibri's packed-row starts call it on a replicated tensor): the plain op's
    values, replicated, from replicated and from sharded operands."""
    run_on_ranks(_unique_family, 2)
