"""ZeRO checkpoints through the sharded-state protocol: ZeRO-2 saved and resumed, dp2 -> dp4, a plain optimizer's
checkpoint into ZeRO and back, and ZeRO x TP; every check against an independent single-device run.

An integration test: it needs vescale-parallel and vescale-checkpoint (which knows ZeRO only through
``vescale.core.sharded_state``). The reference is a plain ``torch.optim.AdamW`` on one process over the whole batch,
never a checkpoint of the code under test. A resumed run takes one more step and is compared with the reference's
step 3: the gradient (dp-averaged, the whole of each parameter), the parameters, and the optimizer state this rank
holds (its boxes of ``exp_avg`` / ``exp_avg_sq``, read from the optimizer, compared with those boxes of the
reference's state). Tolerance 1e-6 relative: the same elementwise AdamW, on flat pieces instead of whole tensors,
with the batch mean summed over ranks in another order.
"""

from __future__ import annotations

import pytest
import torch

from vescale import checkpoint
from vescale.core.testing import run_on_ranks

BATCH = 8
LR, WD = 1e-2, 0.1
TOL = {"rtol": 1e-6, "atol": 1e-7}
# Optimizer state: the dp average is a sum then a division (DDP's AVG), one device's a single backward, so a
# gradient element differs by rounding (~1e-7 of the gradient's scale, measured 1.5e-9 absolute on an exp_avg of
# 3.7e-4 after two steps); a layout or scale error is off by the values themselves (1e-5 to 1e-3 here).
STATE_TOL = {"rtol": 1e-6, "atol": 1e-8}


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def _batch(i: int) -> torch.Tensor:
    return torch.randn(BATCH, 8, generator=torch.Generator().manual_seed(100 + i))


def _reference(steps: int) -> list[dict]:
    """The single-device run: after each step, its parameters, the gradients of that step and the AdamW state."""
    net = _net()
    opt = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=WD)
    out = []
    for i in range(steps):
        net(_batch(i)).square().mean().backward()
        grads = {k: p.grad.clone() for k, p in net.named_parameters()}
        opt.step()
        opt.zero_grad()
        out.append({"params": {k: p.detach().clone() for k, p in net.named_parameters()}, "grads": grads,
                    "state": {k: {n: v.clone() for n, v in opt.state[p].items()} for k, p in net.named_parameters()}})
    return out


@pytest.fixture(scope="module")
def ref():
    return _reference(3)


def _zero(dp: int, stage: int, tp: int = 1):
    """DDP + DistributedOptimizer(AdamW) over ``dp`` (several buckets), the net TP-sharded over ``tp`` if > 1."""
    from vescale.core.mesh import init_mesh
    from vescale.parallel import DDPOptions, DistributedDataParallel, DistributedOptimizer

    net = _net()
    if tp > 1:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_mesh({"dp": dp, "tp": tp})
        net = parallelize_module(net, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    else:
        mesh = init_mesh({"dp": dp})
    ddp = DistributedDataParallel(net, mesh["dp"], DDPOptions(bucket_size_mb=0.0003, zero_stage=2 if stage == 2 else 0))
    return mesh, ddp, DistributedOptimizer(ddp, torch.optim.AdamW, zero_stage=stage, lr=LR, weight_decay=WD)


def _step(mesh, ddp, opt, i: int) -> dict[str, torch.Tensor]:
    """One step on this dp rank's share of batch ``i``; returns the whole dp-averaged gradients."""
    dp, rank = mesh["dp"].size(), mesh["dp"].get_local_rank()
    ddp(_batch(i).chunk(dp)[rank]).square().mean().backward()
    grads = {k: (g.full_tensor() if hasattr(g, "full_tensor") else g) for k, g in ddp.reduced_grads().items()}
    opt.step()
    opt.zero_grad()
    return grads


def _snapshot(ddp, opt) -> dict:
    """What this rank holds after a step: whole parameters, and its boxes of each AdamW state tensor (read from the
    optimizer, as (key, offsets, lengths, values))."""
    from vescale.core.sharded_state import ShardedTensor

    params = {k: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
              for k, p in ddp.module.named_parameters()}
    boxes = [(key, b.offsets, b.lengths, b.data.clone()) for key, st in opt.sharded_state_dict().items()
             if isinstance(st, ShardedTensor) for b in st.boxes]
    return {"params": params, "boxes": boxes}


def _check(got: dict, grads: dict | None, ref: dict, what: str) -> None:
    """Compare a rank's snapshot (and the gradients of its last step) with the reference after the same step."""
    if grads is not None:
        assert grads.keys() == ref["grads"].keys(), what
        for k, g in grads.items():
            torch.testing.assert_close(g, ref["grads"][k], **TOL, msg=f"{what}: gradient of {k}")
    for k, p in got["params"].items():
        torch.testing.assert_close(p, ref["params"][k], **TOL, msg=f"{what}: parameter {k}")
    names = set()
    for key, offsets, lengths, data in got["boxes"]:
        fqn, name = key.removeprefix("state.").rsplit(".", 1)
        names.add(name)
        want = ref["state"][fqn][name][tuple(slice(o, o + n) for o, n in zip(offsets, lengths))]
        torch.testing.assert_close(data, want.to(data.dtype), **STATE_TOL, msg=f"{what}: {key} {offsets}")
    assert {"exp_avg", "exp_avg_sq", "step"} <= names, f"{what}: state boxes {sorted(names)}"


def _train_save(path: str, dp: int, stage: int, steps: int, tp: int = 1) -> None:
    mesh, ddp, opt = _zero(dp, stage, tp)
    for i in range(steps):
        _step(mesh, ddp, opt, i)
    checkpoint.save(path, {"model": ddp, "optim": opt, "step": steps})


def _resume(path: str, dp: int, stage: int, step: int, tp: int = 1, save_to: str | None = None):
    """A fresh DDP + ZeRO (its optimizer state built by the load), loaded from ``path``, then step ``step``."""
    mesh, ddp, opt = _zero(dp, stage, tp)
    state = {"model": ddp, "optim": opt, "step": 0}
    checkpoint.load(path, state)
    assert state["step"] == step and opt.param_groups[0]["lr"] == LR
    grads = _step(mesh, ddp, opt, step)
    if save_to is not None:
        checkpoint.save(save_to, {"model": ddp, "optim": opt, "step": step + 1})
    return _snapshot(ddp, opt), grads


@pytest.fixture(scope="module")
def zero2_ckpt(tmp_path_factory):
    """Two ZeRO-2 steps on dp=2, saved."""
    path = str(tmp_path_factory.mktemp("zero2") / "ckpt")
    run_on_ranks(_train_save, 2, path, 2, 2, 2)
    return path


def test_zero2_saved_and_resumed_matches_single_device(zero2_ckpt, ref):
    """ZeRO-2 on dp=2 saved after two steps, loaded into a fresh ZeRO-2 on dp=2: the third step matches."""
    keys = set(checkpoint.inspect(zero2_ckpt)["tensors"])
    assert {"optim.state.0.weight.exp_avg", "optim.state.2.bias.exp_avg_sq", "optim.state.0.bias.step"} <= keys
    for rank, (got, grads) in enumerate(run_on_ranks(_resume, 2, zero2_ckpt, 2, 2, 2)):
        _check(got, grads, ref[2], f"zero2 dp2 resumed, rank {rank}")


def test_zero_dp2_to_dp4_matches_single_device(zero2_ckpt, ref):
    """The dp=2 ZeRO-2 checkpoint resumed on dp=4 (other ragged pieces, other buckets' split) with ZeRO-1."""
    for rank, (got, grads) in enumerate(run_on_ranks(_resume, 4, zero2_ckpt, 4, 1, 2)):
        _check(got, grads, ref[2], f"zero1 dp4 from zero2 dp2, rank {rank}")


def _plain(path: str | None = None):
    net = _net()
    opt = torch.optim.AdamW(net.parameters(), lr=0.5)  # the load restores lr
    if path is not None:
        state = {"model": net, "optim": opt, "step": 0}
        checkpoint.load(path, state)
    return net, opt


def test_plain_optimizer_checkpoint_into_zero_and_back(tmp_path, ref):
    """A single-device AdamW checkpoint (2 steps) resumed in ZeRO-1 on dp=2 for step 3, saved, then loaded back
    into a plain AdamW: both match the single-device run's third step."""
    plain, zero = str(tmp_path / "plain"), str(tmp_path / "zero")
    net = _net()
    opt = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=WD)
    for i in range(2):
        net(_batch(i)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    checkpoint.save(plain, {"model": net, "optim": opt, "step": 2})
    for rank, (got, grads) in enumerate(run_on_ranks(_resume, 2, plain, 2, 1, 2, save_to=zero)):
        _check(got, grads, ref[2], f"plain -> zero1 dp2, rank {rank}")
    back, back_opt = _plain(zero)
    assert back_opt.param_groups[0]["lr"] == LR and back_opt.param_groups[0]["weight_decay"] == WD
    for k, p in back.named_parameters():
        torch.testing.assert_close(p.detach(), ref[2]["params"][k], **TOL, msg=f"back to plain: {k}")
        for name in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(back_opt.state[p][name], ref[2]["state"][k][name], **STATE_TOL,
                                       msg=f"back to plain: {k} {name}")


def test_zero_x_tp_saved_resumed_and_loaded_plain(tmp_path, ref):
    """ZeRO-1 on dp=2 x tp=2 (column- then row-parallel linears: each ZeRO piece is a flat range of a TP shard)
    saved after two steps; resumed on dp=2 x tp=2 for step 3, and loaded into the plain single-device model."""
    path = str(tmp_path / "ckpt")
    run_on_ranks(_train_save, 4, path, 2, 1, 2, 2)
    net, opt = _plain(path)
    for k, p in net.named_parameters():
        torch.testing.assert_close(p.detach(), ref[1]["params"][k], **TOL, msg=f"plain from dp2xtp2: {k}")
        for name in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(opt.state[p][name], ref[1]["state"][k][name], **STATE_TOL,
                                       msg=f"plain from dp2xtp2: {k} {name}")
    for rank, (got, grads) in enumerate(run_on_ranks(_resume, 4, path, 2, 1, 2, 2)):
        _check(got, grads, ref[2], f"zero1 dp2xtp2 resumed, rank {rank}")
