"""bf16 optimizer state (vescale.parallel.low_precision_state) through vescale.checkpoint: two AdamW steps at dp=2
(ZeRO 2, flat pieces) saved, loaded at dp=4 (ZeRO 1, other pieces), one more step equal to one device's AdamW with
the same bf16 state semantics written out by hand (moments widened to fp32 before each step, rounded to bf16 after).

Every gradient is an exact dp average (the loss is ``sum(p * C)`` with ``C`` multiples of 1/8 per rank and step) and
AdamW is elementwise, so the parameters and the bf16 moments must be bitwise the reference's after the resumed step;
the checkpoint holds the moments as bf16.
"""

from __future__ import annotations

import json
import os

import torch

from vescale import checkpoint
from vescale.core.testing import run_on_ranks
from vescale.core.testing.const_grads import const_grad_net, const_grad_reference, const_grad_step, dyadic_consts

ADAMW = {"lr": 0.01, "weight_decay": 0.1}
SHAPES = {"a": (24, 16), "b": (8, 24), "c": (32, 8)}


def _reference(dps: list[int]) -> tuple[dict, dict]:
    net = const_grad_net(SHAPES)
    opt = torch.optim.AdamW(net.parameters(), **ADAMW)
    const_grad_reference(net, [opt], dps, state_dtype=torch.bfloat16)
    names = dict(net.named_parameters())
    return ({n: p.detach().clone() for n, p in names.items()},
            {n: opt.state[p]["exp_avg"].clone() for n, p in names.items()})


def _build(dp: int, zero: int):
    from vescale.core.mesh import init_mesh
    from vescale.parallel import DDPOptions, DistributedDataParallel, DistributedOptimizer

    mesh = init_mesh({"dp": dp})
    ddp = DistributedDataParallel(const_grad_net(SHAPES), mesh, DDPOptions(bucket_size_mb=0.0005, zero_stage=zero))
    opt = DistributedOptimizer(ddp, torch.optim.AdamW(ddp.module.parameters(), **ADAMW), zero_stage=zero,
                               state_dtype="bf16")
    return mesh, ddp, opt


def _step(mesh, ddp, opt, step: int) -> None:
    const_grad_step(ddp, opt, dyadic_consts(const_grad_net(SHAPES), step, mesh.get_local_rank()))


def _train_save(path: str) -> None:
    mesh, ddp, opt = _build(2, 2)
    for step in range(2):
        _step(mesh, ddp, opt, step)
    checkpoint.save(path, {"model": ddp, "optim": opt})


def _resume(path: str) -> dict:
    mesh, ddp, opt = _build(4, 1)
    checkpoint.load(path, {"model": ddp, "optim": opt})
    _step(mesh, ddp, opt, 2)
    exp_avg = {}
    for piece in opt.pieces.values():
        if piece.hi > piece.lo:
            exp_avg[piece.fqn] = (piece.lo, piece.hi, opt.optimizer.state[piece.master]["exp_avg"].clone())
    return {"params": {n: p.detach().clone() for n, p in ddp.module.named_parameters()}, "exp_avg": exp_avg}


def test_bf16_state_saved_at_dp2_zero2_resumes_at_dp4_zero1(tmp_path):
    path = str(tmp_path / "ckpt")
    run_on_ranks(_train_save, 2, path)
    with open(os.path.join(path, "metadata.json")) as f:
        saved = json.load(f)["tensors"]
    moments = {k: v["dtype"] for k, v in saved.items() if k.endswith(("exp_avg", "exp_avg_sq"))}
    assert moments and set(moments.values()) == {"bfloat16"}, moments
    results = run_on_ranks(_resume, 4, path)
    want_params, want_avg = _reference([2, 2, 4])
    for rank, got in enumerate(results):
        for name, p in got["params"].items():
            assert torch.equal(p, want_params[name]), f"rank {rank} {name}: {(p - want_params[name]).abs().max()}"
        for fqn, (lo, hi, avg) in got["exp_avg"].items():
            assert avg.dtype == torch.bfloat16
            assert torch.equal(avg, want_avg[fqn].reshape(-1)[lo:hi]), f"rank {rank} exp_avg of {fqn}"
