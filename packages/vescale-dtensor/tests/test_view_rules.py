"""Views of interleaved DTensors (``vescale.dtensor.view_rules``) against the plain tensors.

Regression for a silent wrong answer: ``F.linear(x, W)`` with a fused ``query_key_value`` weight placed
``InterleavedShard(0, 3)`` (GPT-NeoX lays it out ``[heads, 3, head_dim]``), then ``.view(B, S, heads, 3 * head_dim)``.
torch placed the result ``_StridedShard(3, sf=3)`` and ``full_tensor()`` was off by ~7 on 2 ranks (on 4 ranks the
view raised a local shape error). Now the view keeps a provably right placement (``_StridedShard(2, 3)`` when each
rank's third of the dim is whole heads) or raises ``ViewRedistributeError`` before any collective (a gathered copy
would not be a view); after an explicit redistribution the values and the gradients of ``x`` and ``W`` match the
plain tensors (fp32, rtol 1e-5).
"""

from __future__ import annotations

from vescale.core.testing import multi_rank

# (heads, head_dim): 4 and 2 heads do not split into 3 interleaved pieces of whole heads (refused), 6 heads on 2 ranks
# and 12 heads on 2 and 4 ranks do (kept sharded)
HEADS = [(4, 2), (2, 4), (6, 2), (12, 2)]


def caused_by(error: BaseException, kind: type) -> BaseException | None:
    """``error`` or the first exception of its ``__cause__`` chain that is a ``kind`` (torch's dispatcher re-raises
    errors of sharding rules as ``RuntimeError`` from them)."""
    while error is not None:
        if isinstance(error, kind):
            return error
        error = error.__cause__
    return None


@multi_rank(world_sizes=[2, 4])
def test_fused_qkv_linear_then_view(world_size):
    import pytest
    import torch
    import torch.nn.functional as F
    from torch.distributed.tensor.placement_types import _StridedShard

    from vescale.dtensor import (
        InterleavedShard,
        Replicate,
        ViewRedistributeError,
        count_comms,
        distribute_tensor,
        init_device_mesh,
        strict,
    )
    from vescale.dtensor.layout import local_slice

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    B, S, D = 2, 3, 8
    for heads, hd in HEADS:
        g = torch.Generator().manual_seed(heads * 100 + hd)
        x_full = torch.randn(B, S, D, generator=g)
        w_full = torch.randn(3 * heads * hd, D, generator=g)
        grad = torch.randn(B, S, heads, 3 * hd, generator=g)
        x_ref, w_ref = x_full.clone().requires_grad_(), w_full.clone().requires_grad_()
        ref = F.linear(x_ref, w_ref).view(B, S, heads, 3 * hd)
        (ref * grad).sum().backward()

        x = distribute_tensor(x_full, mesh, [Replicate()]).requires_grad_()
        w = distribute_tensor(w_full, mesh, [InterleavedShard(0, 3)]).requires_grad_()
        y = F.linear(x, w)
        assert tuple(y.placements) == (_StridedShard(2, split_factor=3),), y.placements
        where = f"heads={heads} head_dim={hd} on {world_size} ranks"
        kept = heads % 3 == 0 and (heads // 3) % world_size == 0  # each rank's piece of a third is whole heads
        if kept:
            with count_comms() as comms:
                out = y.view(B, S, heads, 3 * hd)
            assert comms.total == 0 and tuple(out.placements) == (_StridedShard(2, split_factor=3),), where
            assert out.to_local().data_ptr() == y.to_local().data_ptr(), where  # a view of the local tensor
        else:
            with count_comms() as comms, pytest.raises(RuntimeError) as err:
                y.view(B, S, heads, 3 * hd)
            assert caused_by(err.value, ViewRedistributeError) is not None, (where, err.value)
            assert comms.total == 0, (where, comms.counts)
            assert "aten.view" in str(err.value) and "_StridedShard(dim=2, sf=3)" in str(err.value), err.value
            assert "('tp',)" in str(err.value), err.value
            out = y.redistribute(mesh, [Replicate()]).view(B, S, heads, 3 * hd)  # the explicit way
        where = f"{where}: output {out.placements}"
        torch.testing.assert_close(out.full_tensor(), ref.detach(), rtol=1e-5, atol=1e-5,
                                   msg=lambda m, where=where: f"{where}: {m}")
        assert torch.equal(out.to_local(), local_slice(out.full_tensor(), mesh, out.placements)), where

        (out * distribute_tensor(grad, mesh, out.placements)).sum().backward()
        torch.testing.assert_close(w.grad.full_tensor(), w_ref.grad, rtol=1e-5, atol=1e-5,
                                   msg=lambda m, where=where: f"{where}: grad W: {m}")
        torch.testing.assert_close(x.grad.full_tensor(), x_ref.grad, rtol=1e-5, atol=1e-5,
                                   msg=lambda m, where=where: f"{where}: grad x: {m}")

        with strict():  # the same in strict mode: kept views communicate nothing, the others are refused
            y = F.linear(x.detach(), w.detach())
            if kept:
                torch.testing.assert_close(y.view(B, S, heads, 3 * hd).full_tensor(), ref.detach(), rtol=1e-5,
                                           atol=1e-5)
            else:
                with pytest.raises(RuntimeError) as err:
                    y.view(B, S, heads, 3 * hd)
                assert caused_by(err.value, ViewRedistributeError) is not None, err.value


@multi_rank(world_sizes=[2])
def test_interleaved_views_keep_provable_placements(world_size):
    """Splitting the interleaved dim at its chunk boundary gives plain ``Shard`` of the inner dim; flattening a dim
    into an interleaved one multiplies the split factor; transposes move it; all without communication."""
    import torch

    from vescale.dtensor import InterleavedShard, Shard, count_comms, distribute_tensor, init_device_mesh
    from vescale.dtensor.layout import local_slice

    mesh = init_device_mesh("cpu", (world_size,))
    full = torch.arange(4 * 12, dtype=torch.float64).view(4, 12)
    x = distribute_tensor(full, mesh, [InterleavedShard(1, 3)])
    cases = [  # (op, expected placement)
        (lambda t: t.view(4, 3, 4), Shard(2)),  # [interleaved_size, rest] -> Shard on the rest
        (lambda t: t.view(48), InterleavedShard(0, 12)),  # 4 rows x 3 chunks
        (lambda t: t.t(), InterleavedShard(0, 3)),
        (lambda t: t.unsqueeze(0), InterleavedShard(2, 3)),
        (lambda t: t.view(2, 2, 12), InterleavedShard(2, 3)),  # the dims before it split: untouched
    ]
    for i, (op, want) in enumerate(cases):
        ref = op(full)
        with count_comms() as c:
            out = op(x)
        assert tuple(out.placements) == (want,) and c.total == 0, (i, out.placements, c.counts)
        assert torch.equal(out.to_local(), local_slice(ref.contiguous(), mesh, out.placements)), i
        assert torch.equal(out.full_tensor(), ref), i


@multi_rank(world_sizes=[4])
def test_nested_shards_on_a_2d_mesh(world_size):
    """Two mesh dims sharding one view group. torch's rule gave local shapes that do not fit for uneven nested
    ``Shard`` (``[12]`` on ``[Shard(0), Shard(0)]`` unflattened to ``[6, 2]``: "shape '[2, 2]' is invalid for input
    of size 3") and placed some nested layouts wrongly; every output placement is now checked element by element
    (``view_rules._layout_kept``). Where no placement is a view of the local shards, ``view`` raises
    ``ViewRedistributeError`` before any collective, and reshape's copy path (``_unsafe_view`` of a clone, what
    ``reshape`` of a non-viewable tensor runs) replicates the group and gives the plain values. ``expand`` (which
    changes the element count) keeps torch's rule."""
    import pytest
    import torch

    from vescale.dtensor import (
        InterleavedShard,
        Shard,
        ViewRedistributeError,
        count_comms,
        distribute_tensor,
        init_device_mesh,
    )

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    cases = [  # (global shape, placements, view size or None for the expand, whether it is a view of the shards)
        ((12,), [Shard(0), Shard(0)], (6, 2), False),
        ((4, 4, 1, 8, 4), [Shard(0), Shard(1)], None, True),
        ((8, 3), [Shard(0), InterleavedShard(0, 2)], (24,), True),
        ((6, 4), [InterleavedShard(0, 3), Shard(1)], (3, 2, 4), True),
        # Llama-4's MoE backward: the gradient of `routed_out.reshape(E, T, H).sum(0)` flattened back to [E * T, H]
        # (an expanded gradient: reshape copies) with tokens on dp and the sequence interleaved on tp; torch's rule
        # placed the result (_StridedShard(0, sf=4), _StridedShard(0, sf=2)), whose tp pieces are other rows
        # (gradients off by 0.08)
        ((4, 32, 3), [Shard(1), InterleavedShard(1, 2)], (128, 3), False),
        ((4, 6, 3), [Shard(1), InterleavedShard(1, 3)], (24, 3), False),
    ]
    for i, (shape, placements, size, is_view) in enumerate(cases):
        full = torch.arange(torch.Size(shape).numel(), dtype=torch.float64).view(shape)
        x = distribute_tensor(full, mesh, placements)
        if size is None:
            out = x.expand(4, 4, 2, 8, 4)
            assert torch.equal(out.full_tensor(), full.expand(4, 4, 2, 8, 4)), (i, out.placements)
            continue
        if is_view:
            with count_comms() as comms:
                out = x.view(size)
            assert comms.total == 0 and out.to_local().data_ptr() == x.to_local().data_ptr(), (i, out.placements)
            assert torch.equal(out.full_tensor(), full.view(size)), (i, out.placements)
            continue
        with count_comms() as comms, pytest.raises(RuntimeError) as err:
            x.view(size)
        assert isinstance(err.value, ViewRedistributeError) and comms.total == 0, (i, err.value)
        out = torch.ops.aten._unsafe_view(x.clone(), size)
        assert torch.equal(out.full_tensor(), full.view(size)), (i, out.placements)


@multi_rank(world_sizes=[1, 2])
def test_view_of_a_tensor_laid_out_unlike_its_declared_strides(world_size):
    """An elementwise backward of a transposed gradient and a contiguous input: DTensor declares a contiguous result,
    the local kernel follows the gradient's memory order. ``reshape`` of it (autograd's ``ViewBackward`` does this in
    Qwen3-Next's and OLMo-Hybrid's linear attention) took the view path and failed on the local tensor; now the local
    tensor is re-laid as declared and the values are the plain op's. A view invalid for the declared strides still
    raises."""
    import pytest
    import torch

    from vescale.dtensor import Replicate, from_local, init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    g = torch.arange(2 * 32 * 8, dtype=torch.float32).view(2, 32, 8).sin().transpose(1, 2)  # [2, 8, 32], transposed
    x = torch.linspace(-3, 3, 2 * 8 * 32).view(2, 8, 32)
    ref = torch.ops.aten.softplus_backward(g, x, 1.0, 20.0)
    out = torch.ops.aten.softplus_backward(from_local(g, mesh, [Replicate()], run_check=False),
                                           from_local(x, mesh, [Replicate()], run_check=False), 1.0, 20.0)
    assert out.is_contiguous() and not out.to_local().is_contiguous()  # the disagreement this test is about
    assert torch.equal(out.reshape(16, 32).full_tensor(), ref.reshape(16, 32))
    assert torch.equal(out.view(2, 8, 4, 8).full_tensor(), ref.reshape(2, 8, 4, 8))
    with pytest.raises(RuntimeError):
        out.transpose(1, 2).view(2, 256)
