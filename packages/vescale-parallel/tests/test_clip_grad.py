"""clip_grad_norm_ over a mix of TP shards, replicated/partial DTensors, plain tensors, ZeRO pieces and pp stages.

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
    from vescale.parallel import clip_grad_norm_, mark_sharded

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
    mark_sharded(z, {"tp": tp_mesh.get_group()})
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
