"""clip_grad_norm_ over a mix of TP shards, replicated/partial DTensors, plain tensors, plain pieces (``mark_piece``)
and pp stages; a copy marked ``counts_in_norm=False`` is left out of the norm and still clipped; the deprecated
spellings (``mark_sharded``, ``mark_tied_copy``, ``is_tied_copy``) warn and mark the same.

Reference: ``torch.nn.utils.clip_grad_norm_`` on the full gradients of every stage on one device. Tolerance: relative
1e-6 on the norm and on the clipped gradients (the summation order differs).
"""

from __future__ import annotations

import pytest

from vescale.core.testing import multi_rank


def _full_grads(stage: int):
    """Full gradients of stage ``stage``: W [8, 6] (TP Shard(0)), b [6] (Replicate), c [5] (plain), z [10] (ZeRO
    pieces over tp: 3 + 7 elements), q [4] (Partial over tp)."""
    import torch

    g = torch.Generator().manual_seed(10 + stage)
    return {name: torch.randn(*shape, generator=g) for name, shape in
            (("W", (8, 6)), ("b", (6,)), ("c", (5,)), ("z", (10,)), ("q", (4,)))}


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
@multi_rank(world_sizes=[4])
def test_clip_over_tp_zero_and_pp_matches_single_device(norm_type, world_size):
    import torch
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    from vescale.core.mesh import init_mesh, mesh_coordinates
    from vescale.core.sharded_state import mark_piece
    from vescale.parallel import clip_grad_norm_

    mesh = init_mesh({"pp": 2, "tp": 2})
    coords = mesh_coordinates(mesh)
    stage, tp = coords["pp"], coords["tp"]
    tp_mesh = mesh["tp"]

    full = {s: _full_grads(s) for s in (0, 1)}
    ref = [torch.zeros_like(t, requires_grad=True) for s in (0, 1) for t in full[s].values()]
    for p, g in zip(ref, [g for s in (0, 1) for g in full[s].values()]):
        p.grad = g.clone()
    max_norm = 0.3
    want = torch.nn.utils.clip_grad_norm_(ref, max_norm, norm_type=norm_type)
    want_grads = dict(zip([(s, n) for s in (0, 1) for n in full[s]], [p.grad for p in ref]))

    mine = full[stage]

    def param(grad):
        p = torch.nn.Parameter(torch.zeros_like(grad))
        p.grad = grad
        return p

    W = param(distribute_tensor(mine["W"], tp_mesh, [Shard(0)]))
    b = param(distribute_tensor(mine["b"], tp_mesh, [Replicate()]))
    c = param(mine["c"].clone())
    lo, hi = (0, 3) if tp == 0 else (3, 10)
    z = param(mine["z"][lo:hi].clone())
    mark_piece(z, global_shape=(10,), offsets=(lo,), groups={"tp": tp_mesh.get_group()})
    q = param(DTensor.from_local(mine["q"] / 2, tp_mesh, [Partial()]))
    got = clip_grad_norm_([W, b, c, z, q], max_norm, norm_type=norm_type, pp_group=mesh["pp"].get_group())

    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    assert want > max_norm  # the gradients really are scaled down
    torch.testing.assert_close(W.grad.full_tensor(), want_grads[(stage, "W")], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(b.grad.full_tensor(), want_grads[(stage, "b")], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(c.grad, want_grads[(stage, "c")], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(z.grad, want_grads[(stage, "z")][lo:hi], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(q.grad.full_tensor(), want_grads[(stage, "q")], rtol=1e-6, atol=1e-7)


@multi_rank(world_sizes=[1])
def test_clip_plain_tensors_like_torch():
    import torch

    from vescale.parallel import clip_grad_norm_, grad_norm

    torch.manual_seed(0)
    a = [torch.nn.Parameter(torch.zeros(7, 3)) for _ in range(3)]
    b = [torch.nn.Parameter(torch.zeros(7, 3)) for _ in range(3)]
    for x, y in zip(a, b):
        x.grad = torch.randn(7, 3)
        y.grad = x.grad.clone()
    a.append(torch.nn.Parameter(torch.zeros(2)))  # no gradient: ignored by both
    want = torch.nn.utils.clip_grad_norm_(b, 1.0)
    got = clip_grad_norm_(a, 1.0)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    for x, y in zip(a, b):
        torch.testing.assert_close(x.grad, y.grad, rtol=1e-6, atol=1e-7)
    assert grad_norm(a).item() == pytest.approx(1.0, rel=1e-5)  # already clipped: norm is max_norm
    a[0].grad[0, 0] = float("nan")
    with pytest.raises(RuntimeError, match="non-finite"):
        clip_grad_norm_(a, 1.0, error_if_nonfinite=True)


@multi_rank(world_sizes=[2])
def test_a_stage_without_gradients_joins_the_pp_reduction(world_size):
    """A pipeline stage whose parameters got no gradient still joins the pp all-reduce (on the device its backend
    needs: CPU on gloo, the current GPU on NCCL) and gets the whole model's norm; its parameters are left alone."""
    import torch
    import torch.distributed as dist

    from vescale.parallel import clip_grad_norm_

    rank = dist.get_rank()
    grads = [torch.tensor([3.0, 4.0]), torch.tensor([12.0])]
    p = torch.nn.Parameter(torch.zeros(2 if rank == 0 else 1))
    if rank == 0:
        p.grad = grads[0].clone()
    norm = clip_grad_norm_([p], max_norm=1.0, pp_group=dist.group.WORLD)
    assert torch.allclose(norm, torch.tensor(5.0)), norm  # rank 1 contributes nothing: sqrt(3^2 + 4^2)
    if rank == 0:
        assert torch.allclose(p.grad, grads[0] / (5.0 + 1e-6))
    else:
        assert p.grad is None


@multi_rank(world_sizes=[2])
def test_a_copy_that_does_not_count_is_left_out_of_the_norm_and_still_clipped(world_size):
    """Two pp ranks each hold a copy of a tied weight with the same gradient; rank 1's is marked counts_in_norm=False:
    the norm is one device's (the weight once), and both copies are scaled alike."""
    import torch
    import torch.distributed as dist

    from vescale.core.sharded_state import mark_piece
    from vescale.parallel import clip_grad_norm_, grad_norm

    rank = dist.get_rank()
    tied = torch.nn.Parameter(torch.zeros(2))
    tied.grad = torch.tensor([3.0, 4.0])
    own = torch.nn.Parameter(torch.zeros(1))
    own.grad = torch.tensor([12.0 if rank == 0 else 0.0])
    unmarked = grad_norm([tied, own], pp_group=dist.group.WORLD)
    assert torch.allclose(unmarked, torch.tensor(194.0).sqrt()), unmarked  # 2 (3^2 + 4^2) + 12^2: the tied weight twice
    if rank == 1:
        mark_piece(tied, counts_in_norm=False)
    norm = clip_grad_norm_([tied, own], max_norm=1.0, pp_group=dist.group.WORLD)
    assert torch.allclose(norm, torch.tensor(13.0)), norm  # sqrt(3^2 + 4^2 + 12^2): the tied weight once
    assert torch.allclose(tied.grad, torch.tensor([3.0, 4.0]) / (13.0 + 1e-6)), (rank, tied.grad)


def test_deprecated_spellings_warn_and_mark_as_mark_piece():
    import torch

    import vescale.parallel
    from vescale.core.sharded_state import piece_of
    from vescale.parallel.clip_grad import is_tied_copy, mark_sharded, mark_tied_copy

    # still importable from vescale.parallel for one release
    assert vescale.parallel.mark_sharded is mark_sharded and vescale.parallel.mark_tied_copy is mark_tied_copy
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        _ = vescale.parallel.nope
    group = object()  # a stand-in: marking only records it
    t = torch.nn.Parameter(torch.zeros(3))
    with pytest.warns(DeprecationWarning, match=r"mark_sharded.*use vescale\.core\.sharded_state\.mark_piece\(t, "
                                                r"groups=groups\)"):
        assert mark_sharded(t, {"tp": group}) is t
    assert piece_of(t).group_map == {"tp": group} and piece_of(t).counts_in_norm
    with pytest.warns(DeprecationWarning, match=r"is_tied_copy.*piece_of\(t\)\.counts_in_norm"):
        assert not is_tied_copy(t)
    with pytest.warns(DeprecationWarning, match=r"mark_tied_copy.*mark_piece\(t, counts_in_norm=False\)"):
        assert mark_tied_copy(t) is t
    assert piece_of(t).group_map == {"tp": group} and not piece_of(t).counts_in_norm
    with pytest.warns(DeprecationWarning):
        assert is_tied_copy(t)
