"""Muon with bf16 parameters (DistributedMatrixOptimizer over fp32 masters) against one device's fp32 masters
stepped by torch.optim.Muon + AdamW.

As in test_muon.py, every gradient is a dp average of constants that are multiples of 1/8 in [-2, 2] (the loss is
``sum(p * C)``), exact in bf16 and in fp32 in any order, so the parallel fp32 gradients are bitwise one device's; the
owners step the fp32 master pieces they gather with torch's own Muon. After two steps every master piece must be
*bitwise* the reference's fp32 weight, and every bf16 parameter its bf16 rounding. dp=2, ZeRO 0, 1 and 2, and ZeRO 1
with bf16 optimizer state (Muon's momenta and AdamW's moments rounded to bf16 after each step in the reference).
"""

from __future__ import annotations

from vescale.core.testing import multi_rank

MUON = {"lr": 0.02, "weight_decay": 0.1, "momentum": 0.95}
ADAMW = {"lr": 0.01, "weight_decay": 0.1}
SHAPES = {"a": (24, 16), "b": (8, 24), "c": (32, 8)}


def _net():
    from vescale.core.testing.const_grads import const_grad_net

    return const_grad_net(SHAPES)


def _consts(step: int, rank: int) -> dict:
    from vescale.core.testing.const_grads import dyadic_consts

    return dyadic_consts(_net(), step, rank)


def _reference(dp: int, steps: int = 2, state_dtype=None) -> dict:
    """One device: fp32 weights starting from the bf16 model's values (its masters' start), Muon on the matrices,
    AdamW on the biases; with ``state_dtype`` their state is rounded to it after each step and widened before."""
    import torch

    from vescale.core.testing.const_grads import const_grad_reference, split_matrices

    net = _net()
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(p.to(torch.bfloat16))
    mats, rest = split_matrices(net, SHAPES)
    const_grad_reference(net, [torch.optim.Muon(mats, **MUON), torch.optim.AdamW(rest, **ADAMW)], [dp] * steps,
                         state_dtype=state_dtype)
    return {n: p.detach().clone() for n, p in net.named_parameters()}


@multi_rank(world_sizes=[2])
def test_muon_bf16_params_dp2_zero012_bitwise():
    import torch

    from vescale.core.mesh import init_mesh
    from vescale.core.testing.const_grads import const_grad_step, split_matrices
    from vescale.parallel import DDPOptions, DistributedDataParallel, DistributedMatrixOptimizer

    mesh = init_mesh({"dp": 2})
    for zero, state_dtype in ((0, None), (1, None), (2, None), (1, torch.bfloat16)):
        want = _reference(2, state_dtype=state_dtype)
        ddp = DistributedDataParallel(_net().to(torch.bfloat16), mesh,
                                      DDPOptions(bucket_size_mb=0.0005, zero_stage=zero))
        mats, rest = split_matrices(ddp.module, SHAPES)
        opt = DistributedMatrixOptimizer(ddp, torch.optim.Muon(mats, **MUON), torch.optim.AdamW(rest, **ADAMW),
                                         zero_stage=zero, state_dtype=state_dtype)
        for step in range(2):
            const_grad_step(ddp, opt, _consts(step, mesh.get_local_rank()))
        for name, p in ddp.module.named_parameters():
            assert p.dtype == torch.bfloat16
            assert torch.equal(p.detach(), want[name].to(torch.bfloat16)), f"zero {zero} {name}"
        for piece in opt.pieces.values():
            ref = want[piece.fqn].reshape(-1)[piece.lo:piece.hi]
            assert piece.master.dtype == torch.float32
            assert torch.equal(piece.master, ref), f"zero {zero} master of {piece.fqn}"
        if state_dtype is not None:  # Muon's momenta and AdamW's moments held in bf16
            held = [v for o in (opt.optimizer, opt.matrix.optimizer) for st in o.state.values() for v in st.values()
                    if v.dim() > 0]
            assert held and {v.dtype for v in held} == {state_dtype}


def test_muon_refuses_bf16_gradients_by_name():
    """bf16 parameters whose gradients DDP reduces in bf16: refused naming the parameter (no process group needed
    for the check: one rank, no mesh)."""
    import pytest
    import torch

    from vescale.parallel import DDPOptions, DistributedDataParallel, DistributedMatrixOptimizer, ZeroError

    ddp = DistributedDataParallel(_net().to(torch.bfloat16), None, DDPOptions(zero_stage=0, grad_dtype=None))
    mats = [getattr(ddp.module, n).weight for n in SHAPES]
    with pytest.raises(ZeroError, match=r"'a.weight' has torch.bfloat16 gradients"):
        DistributedMatrixOptimizer(ddp, torch.optim.Muon(mats), torch.optim.AdamW([ddp.module.b.bias]), zero_stage=0)
