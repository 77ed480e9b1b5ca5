"""The ``vescale::cp_attention`` operator on DTensors whose heads are sharded over tp, as a tensor-parallel pipeline
stage captured by ``torch.export`` hands it (``vescale.parallel.parallelize_stage`` propagates shardings op by op, so
the operator itself receives DTensors; no module boundary unwraps them).

On a cp=2 x tp=2 mesh every rank calls the operator (and its backward) with query, key and value DTensors sharded by
heads (``Shard(1)``) over tp, holding its cp rank's positions. Checked against torch's ``scaled_dot_product_attention``
of the whole sequence in one process, fp32 ``rtol 1e-5``: the output (the full heads, this rank's positions), the
query gradient, and the key/value gradients of this rank's positions (summed over every cp rank's queries by the
operator's reduce-scatter). Grouped key/value heads (4 query heads over 2) check that each tp shard's queries meet
their own key/value heads. Again with packed rows' document ids (a replicated DTensor) against sdpa under the
per-document causal mask.
"""

from __future__ import annotations

from vescale.core.testing import multi_rank


@multi_rank(world_sizes=[4])
def test_operator_runs_on_tp_head_shards():
    import torch
    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    from vescale.core.mesh import init_mesh, sub_mesh
    from vescale.parallel.context_parallel import _Setup, _setup_key, local_positions

    mesh = init_mesh({"cp": 2, "tp": 2})
    cp_mesh, tp_mesh = sub_mesh(mesh, "cp"), sub_mesh(mesh, "tp")
    cp, rank = cp_mesh.size(), cp_mesh.get_local_rank()
    g = torch.Generator().manual_seed(5)
    b, h, hkv, s, d = 2, 4, 2, 16, 8
    # packed rows: each row's document ids (sequence order), replicated over tp as the model hands them over
    packed = torch.tensor([[0] * 3 + [1] * 6 + [2] * 7, [0] * 10 + [1] * 6])
    for docs in (None, packed):
        q, k, v = (torch.randn(b, n, s, d, generator=g, requires_grad=True) for n in (h, hkv, hkv))
        grad_out = torch.randn(b, h, s, d, generator=g)
        causal = torch.ones(s, s, dtype=torch.bool).tril()
        mask = causal if docs is None else (causal & (docs[:, :, None] == docs[:, None, :]))[:, None]
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        ref.backward(grad_out)

        mine = local_positions(s, cp, rank)
        key = _setup_key(_Setup(cp_mesh.get_group(), cp, rank))
        ql, kl, vl = (distribute_tensor(t.detach()[:, :, mine], tp_mesh, [Shard(1)]).requires_grad_()
                      for t in (q, k, v))
        dd = None if docs is None else distribute_tensor(docs, tp_mesh, [Replicate()])
        out = torch.ops.vescale.cp_attention(ql, kl, vl, dd, key, d ** -0.5, None)[0]
        assert isinstance(out, DTensor) and out.placements == (Shard(1),), out
        out.backward(distribute_tensor(grad_out[:, :, mine], tp_mesh, [Replicate()]))  # redistributed to Shard(1)
        for name, got, want in (("out", out, ref), ("dq", ql.grad, q.grad), ("dk", kl.grad, k.grad),
                                ("dv", vl.grad, v.grad)):
            assert got.placements == (Shard(1),), (name, got.placements)
            torch.testing.assert_close(got.full_tensor(), want.detach()[:, :, mine], rtol=1e-5, atol=1e-6,
                                       msg=lambda m, name=name, docs=docs: f"{name} (documents {docs}): {m}")
