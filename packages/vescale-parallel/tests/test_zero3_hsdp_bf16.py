"""HSDP and bf16 mixed precision for ZeRO 3 (``fully_shard_dp``) and bf16 master weights without ZeRO
(``DistributedOptimizer(zero_stage=0)``), each against the same recipe computed on one process over the whole batch.

The model is a small stack of linear + tanh blocks (dtype-clean: a bf16 copy computes in bf16 throughout). fp32
gradients are compared within 1e-5 of each parameter's largest element (a reordered fp32 sum of 16 rows); bf16 ones
within 2**-5 relative, in norm and at the largest element (8 units of bf16 rounding, 2**-8: about 8 rounded stages on
a gradient's path here, each run's error about sqrt(8) u / sqrt(3), far below the bound; a constant gradient scale
such as a dp sum for a mean misses by 0.5 or more).
"""

from __future__ import annotations

from vescale.core.testing import multi_rank

ROWS, WIDTH = 16, 32
BF16_TOL = 2**-5


def _net():
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(3))
            self.head = nn.Linear(WIDTH, 4)

        def forward(self, x):
            for layer in self.layers:
                x = torch.tanh(layer(x))
            return self.head(x)

    torch.manual_seed(0)
    return Net()


def _batch():
    import torch

    g = torch.Generator().manual_seed(1)
    return torch.randn(ROWS, WIDTH, generator=g), torch.randn(ROWS, 4, generator=g)


def _loss(out, y):
    return ((out.float() - y) ** 2).mean()


def _reference_grads(dtype):
    """Whole-batch gradients of the plain model cast to ``dtype``, as fp32, by FQN (no vescale code involved)."""

    model = _net().to(dtype)
    x, y = _batch()
    _loss(model(x.to(dtype)), y).backward()
    return {n: p.grad.float() for n, p in model.named_parameters()}


def _check(got, want, tol, what, norm=False):
    assert set(got) == set(want), (what, sorted(set(got) ^ set(want)))
    for name, ref in want.items():
        diff = got[name] - ref
        elt = float(diff.abs().max() / ref.abs().max())
        rel = float(diff.norm() / ref.norm())
        assert elt <= tol and (not norm or rel <= tol), f"{what} {name}: off by {elt:.3g} (element), {rel:.3g} (norm)"


@multi_rank(world_sizes=[4])
def test_hsdp_and_bf16_fully_shard_match_single_device():
    """HSDP on a (dp_replicate=2, dp_shard=2) mesh: parameters (Replicate, Shard(0)), gradients equal the
    whole-batch ones; with ``bf16_policy`` the shards (masters), their gradients and the optimizer state stay fp32
    and the gradients equal the bf16 recipe on one process. Bad HSDP meshes are refused before any collective."""
    import pytest
    import torch
    from torch.distributed.tensor import Replicate, Shard

    from vescale.core.mesh import init_mesh, mesh_coordinates
    from vescale.parallel.errors import Zero3Error
    from vescale.parallel.zero3 import bf16_policy, fully_shard_dp, zero3_mesh

    with pytest.raises(Zero3Error, match="HSDP names both"):
        zero3_mesh(init_mesh({"dp_shard": 4}))
    with pytest.raises(Zero3Error, match="HSDP names both"):
        zero3_mesh(init_mesh({"dp": 2, "dp_shard": 2}))

    mesh = init_mesh({"dp_replicate": 2, "dp_shard": 2})
    at = mesh_coordinates(mesh)
    dp_rank = 2 * at["dp_replicate"] + at["dp_shard"]
    x, y = _batch()
    rows = slice(dp_rank * ROWS // 4, (dp_rank + 1) * ROWS // 4)
    for dtype, policy, tol in ((torch.float32, None, 1e-5), (torch.bfloat16, bf16_policy(), BF16_TOL)):
        model = fully_shard_dp(_net(), mesh, mp_policy=policy)
        for p in model.parameters():
            assert p.dtype == torch.float32 and tuple(p.placements) == (Replicate(), Shard(0)), p.placements
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        _loss(model(x[rows]), y[rows]).backward()
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        assert all(g.dtype == torch.float32 for g in grads.values())
        _check(grads, _reference_grads(dtype), tol, f"HSDP {dtype}", norm=dtype == torch.bfloat16)
        opt.step()
        assert all(t.dtype == torch.float32 for st in opt.state.values() for t in st.values() if t.dim())


@multi_rank(world_sizes=[2])
def test_bf16_master_weights_without_zero_match_single_device():
    """``DistributedOptimizer(zero_stage=0)`` over a bf16 DDP on dp=2: every rank holds fp32 masters of the whole
    model (nothing sharded, no all-gather); one clipped SGD step equals the one-process recipe (bf16 whole-batch
    gradients widened to fp32, clipped by their global norm, applied to fp32 masters, parameters their bf16
    rounding). The clip norm counts every element once (a replicated master summed over dp would be sqrt(2) off)."""
    import torch
    import torch.distributed as dist

    from vescale.core.mesh import init_mesh
    from vescale.parallel import DDPOptions, DistributedDataParallel, DistributedOptimizer

    lr, clip = 0.5, 0.05
    mesh = init_mesh({"dp": 2})
    ddp = DistributedDataParallel(_net().to(torch.bfloat16), mesh, DDPOptions(grad_dtype=torch.float32))
    opt = DistributedOptimizer(ddp, torch.optim.SGD, zero_stage=0, clip_grad=clip, lr=lr)
    x, y = _batch()
    rows = slice(dist.get_rank() * ROWS // 2, (dist.get_rank() + 1) * ROWS // 2)
    _loss(ddp(x[rows].bfloat16()), y[rows]).backward()
    opt.step()

    want = _reference_grads(torch.bfloat16)
    norm = torch.cat([g.flatten() for g in want.values()]).norm()
    assert abs(float(opt.grad_norm) / float(norm) - 1) <= BF16_TOL, (float(opt.grad_norm), float(norm))
    assert norm > clip  # the step is clipped
    # the masters start as the bf16 model's values (the model was cast before DDP), widened
    masters = {n: p.detach().to(torch.bfloat16).float() for n, p in _net().named_parameters()}
    got = {}
    for p, piece in opt.pieces.items():
        assert (piece.lo, piece.hi) == (0, p.numel()) and not piece.aliased
        assert torch.equal(piece.master.to(torch.bfloat16), p.detach().reshape(-1))
        got[piece.fqn] = (masters[piece.fqn].reshape(-1) - piece.master.detach()) / lr  # the applied gradient
    _check(got, {n: (g * clip / norm).reshape(-1) for n, g in want.items()}, BF16_TOL, "zero_stage 0 bf16 step",
           norm=True)
    info = opt.state_dict()["shards"]
    assert all(s["ranges"] == [[0, s["ranges"][0][1]]] * 2 and s["placement"] is None for s in info.values())
