"""Muon state (vescale.parallel.muon) through vescale.checkpoint: two steps at dp=2 (ZeRO 2) saved, loaded at dp=4
(ZeRO 1, other owners), one more step equal to one device's torch.optim.Muon + AdamW.

Every gradient is an exact dp average (the loss is ``sum(p * C)`` with ``C`` multiples of 1/8 per rank and step), so
the parallel run sees one device's gradients bit for bit and runs torch's own Muon on the same whole matrices: the
parameters and each owner's whole-matrix momentum must be bitwise equal to the reference's after the resumed step.
"""

from __future__ import annotations

import torch

from vescale import checkpoint
from vescale.core.testing import run_on_ranks
from vescale.core.testing.const_grads import (
    const_grad_net,
    const_grad_reference,
    const_grad_step,
    dyadic_consts,
    split_matrices,
)

MUON = {"lr": 0.02, "weight_decay": 0.1, "momentum": 0.95}
ADAMW = {"lr": 0.01, "weight_decay": 0.1}
SHAPES = {"a": (24, 16), "b": (8, 24), "c": (32, 8), "d": (16, 32), "e": (16, 16)}


def _reference(dps: list[int]) -> tuple[dict, dict]:
    net = const_grad_net(SHAPES, norm=16)
    mats, rest = split_matrices(net, SHAPES)
    muon = torch.optim.Muon(mats, **MUON)
    const_grad_reference(net, [muon, torch.optim.AdamW(rest, **ADAMW)], dps)
    momenta = {f"{n}.weight": muon.state[getattr(net, n).weight]["momentum_buffer"].clone() for n in SHAPES}
    return {n: p.detach().clone() for n, p in net.named_parameters()}, momenta


def _build(dp: int, zero: int):
    from vescale.core.mesh import init_mesh
    from vescale.parallel import DDPOptions, DistributedDataParallel, DistributedMatrixOptimizer

    mesh = init_mesh({"dp": dp})
    ddp = DistributedDataParallel(const_grad_net(SHAPES, norm=16), mesh,
                                  DDPOptions(bucket_size_mb=0.0005, zero_stage=zero))
    mats, rest = split_matrices(ddp.module, SHAPES)
    opt = DistributedMatrixOptimizer(ddp, torch.optim.Muon(mats, **MUON), torch.optim.AdamW(rest, **ADAMW),
                                     zero_stage=zero)
    return mesh, ddp, opt


def _step(mesh, ddp, opt, step: int) -> None:
    const_grad_step(ddp, opt, dyadic_consts(const_grad_net(SHAPES, norm=16), step, mesh.get_local_rank()))


def _train_save(path: str) -> None:
    mesh, ddp, opt = _build(2, 2)
    for step in range(2):
        _step(mesh, ddp, opt, step)
    checkpoint.save(path, {"model": ddp, "optim": opt})


def _resume(path: str) -> dict:
    mesh, ddp, opt = _build(4, 1)
    checkpoint.load(path, {"model": ddp, "optim": opt})
    _step(mesh, ddp, opt, 2)
    params = {n: p.detach().clone() for n, p in ddp.module.named_parameters()}
    momenta = {m.fqn: opt.matrix.optimizer.state[m.work]["momentum_buffer"].clone()
               for m in opt.matrix.matrices if opt.matrix.owns(m)}
    return {"params": params, "momenta": momenta, "lr": [g["lr"] for g in opt.param_groups]}


def test_muon_state_saved_at_dp2_resumes_at_dp4(tmp_path):
    path = str(tmp_path / "ckpt")
    run_on_ranks(_train_save, 2, path)
    results = run_on_ranks(_resume, 4, path)
    want_params, want_momenta = _reference([2, 2, 4])
    owned = {}
    for rank, got in enumerate(results):
        for name, p in got["params"].items():
            assert torch.equal(p, want_params[name]), f"rank {rank} {name}: {(p - want_params[name]).abs().max()}"
        for fqn, buf in got["momenta"].items():
            assert torch.equal(buf, want_momenta[fqn]), f"rank {rank} momentum of {fqn}"
            owned[fqn] = rank
        assert sorted(set(got["lr"])) == [ADAMW["lr"], MUON["lr"]]
    assert sorted(owned) == sorted(want_momenta), owned  # every momentum has an owner at dp=4
    assert len(set(owned.values())) > 1, owned  # and the owners are spread over the ranks
