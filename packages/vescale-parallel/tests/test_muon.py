"""Muon under ZeRO 1/2/3 and TP (vescale.parallel.muon) against one device's torch.optim.Muon + AdamW.

Each dp rank's gradient of every parameter is a rank- and step-dependent constant ``C`` (the loss is
``sum(p * C)``) whose entries are multiples of 1/8 in [-2, 2]: the dp average of such gradients is exact in fp32 in
any summation order, so the parallel gradient is bitwise the single-device one (the mean of the ranks' ``C``). The
owner then runs torch's own Muon on that same whole matrix, so every parameter must be *bitwise* equal to the
single-device run after two steps, Newton-Schulz (bf16) included; AdamW runs elementwise on flat pieces with the same
ops, so it is bitwise too. Matrices: five of different shapes (uneven over dp=4), plus vectors for AdamW.
"""

from __future__ import annotations

from vescale.core.testing import multi_rank

MUON = {"lr": 0.02, "weight_decay": 0.1, "momentum": 0.95}
ADAMW = {"lr": 0.01, "weight_decay": 0.1}
SHAPES = {"a": (24, 16), "b": (8, 24), "c": (32, 8), "d": (16, 32), "e": (16, 16)}
TP_PLACEMENT = {"a": 0, "b": 1, "c": 0, "d": 1}  # e stays whole on every tp rank (plain)


def _net():
    from vescale.core.testing.const_grads import const_grad_net

    return const_grad_net(SHAPES, norm=16)


def _consts(net, step: int, rank: int) -> dict:
    from vescale.core.testing.const_grads import dyadic_consts

    return dyadic_consts(net, step, rank)


def _reference(dp: int, steps: int = 2) -> dict:
    """One device: torch Muon on the five matrices, AdamW on the rest, gradients the mean of the dp ranks'."""
    import torch

    from vescale.core.testing.const_grads import const_grad_reference, split_matrices

    net = _net()
    mats, rest = split_matrices(net, SHAPES)
    const_grad_reference(net, [torch.optim.Muon(mats, **MUON), torch.optim.AdamW(rest, **ADAMW)], [dp] * steps)
    return {n: p.detach().clone() for n, p in net.named_parameters()}


def _run(mesh, zero: int, tp: int) -> None:
    import torch
    from torch.distributed.tensor import DTensor

    from vescale.core.mesh import mesh_coordinates
    from vescale.core.testing.const_grads import const_grad_step, shard_consts, shard_weights, split_matrices
    from vescale.parallel import (
        DDPOptions,
        DistributedDataParallel,
        DistributedMatrixOptimizer,
        MatrixOptimizer,
        fully_shard_dp,
    )

    dp = mesh.size(mesh.mesh_dim_names.index("dp"))
    dp_rank = mesh_coordinates(mesh)["dp"]
    net = _net()
    tp_mesh = mesh["tp"] if tp > 1 else None
    if tp_mesh is not None:
        shard_weights(net, tp_mesh, TP_PLACEMENT)
    what = f"dp{dp} x tp{tp} zero{zero}"
    if zero == 3:
        model = fully_shard_dp(net, mesh, blocks=None)
        inner = net
    else:
        model = DistributedDataParallel(net, mesh["dp"] if tp > 1 else mesh,
                                        DDPOptions(bucket_size_mb=0.0005, zero_stage=zero))
        inner = model.module
    mats, rest = split_matrices(inner, SHAPES)
    muon, adamw = torch.optim.Muon(mats, **MUON), torch.optim.AdamW(rest, **ADAMW)
    if zero == 3:
        opt = MatrixOptimizer(inner, muon, adamw)
    else:
        opt = DistributedMatrixOptimizer(model, muon, adamw, zero_stage=zero)
    for step in range(2):
        consts = _consts(_net(), step, dp_rank)
        if tp_mesh is not None:  # each weight's constant placed as the weight (ZeRO 1/2 keep its placement)
            consts = shard_consts(consts, tp_mesh, TP_PLACEMENT)
        const_grad_step(model, opt, consts)
    want = _reference(dp)
    for name, p in inner.named_parameters():
        got = p.full_tensor() if isinstance(p, DTensor) else p.detach()
        assert torch.equal(got, want[name]), f"{what} {name}: max diff {(got - want[name]).abs().max()}"
    # each matrix's momentum lives on one rank (a row of ranks for the tp-replicated e), as a whole matrix
    owned = [m.fqn for m in opt.matrix.matrices if opt.matrix.owns(m)]
    for fqn in owned:
        buf = opt.matrix.optimizer.state[next(m.work for m in opt.matrix.matrices if m.fqn == fqn)]["momentum_buffer"]
        assert tuple(buf.shape) == SHAPES[fqn.split(".")[0]], (what, fqn, buf.shape)
    if zero != 3:  # the plain state dict round trip (same layout): the owners' momenta come back
        import copy

        saved = copy.deepcopy(opt.state_dict())
        for st in opt.matrix.optimizer.state.values():
            st["momentum_buffer"].zero_()
        opt.load_state_dict(saved)
        for m in opt.matrix.matrices:
            if opt.matrix.owns(m):
                assert torch.equal(opt.matrix.optimizer.state[m.work]["momentum_buffer"],
                                   saved["matrix"]["state"][m.fqn]["momentum_buffer"]), (what, m.fqn)
                assert saved["matrix"]["state"][m.fqn]["momentum_buffer"].abs().sum() > 0, (what, m.fqn)
    held = torch.tensor([float(opt.matrix.state_bytes())])
    torch.distributed.all_reduce(held)
    total = sum(m * n for m, n in SHAPES.values()) * 4
    replicated = SHAPES["e"][0] * SHAPES["e"][1] * 4 * (tp - 1) if tp > 1 else 0
    assert held.item() == (total + replicated) * (mesh.size() // (dp * tp)), (what, held.item())


@multi_rank(world_sizes=[2])
def test_muon_dp2_zero123_bitwise():
    """dp=2, ZeRO 1, 2 and 3: every parameter bitwise one device's after two steps."""
    from vescale.core.mesh import init_mesh

    mesh = init_mesh({"dp": 2})
    for zero in (1, 2, 3):
        _run(mesh, zero, 1)


@multi_rank(world_sizes=[4])
def test_muon_dp4_and_dp2_tp2_bitwise():
    """dp=4 (five matrices over four owners), ZeRO 2 and 3; dp=2 x tp=2 (Shard(0)/Shard(1) matrices gathered to
    their owner only, a plain one owned by a dp row), ZeRO 1, 2 and 3."""
    from vescale.core.mesh import init_mesh

    mesh = init_mesh({"dp": 4})
    for zero in (2, 3):
        _run(mesh, zero, 1)
    mesh = init_mesh({"dp": 2, "tp": 2})
    for zero in (1, 2, 3):
        _run(mesh, zero, 2)


def test_owners_balance_cost():
    from vescale.parallel import matrix_owners

    owners = matrix_owners([(64, 64), (64, 64), (8, 8), (8, 8), (8, 8)], 2)
    assert owners == [(0, 0), (1, 0), (0, 0), (1, 0), (0, 0)]
    owners = matrix_owners([(8, 8), (64, 64)], 4, columns=2, replicated=[True, False])
    assert owners == [(1, None), (0, 0)]


def test_refusals_name_the_parameter():
    """Before any collective: a non-2-D parameter or a bf16 one in the matrix optimizer's groups is refused by FQN."""
    import pytest
    import torch

    from vescale.parallel import MatrixOptimizer, ZeroError

    net = _net()
    with pytest.raises(ZeroError, match=r"'a.weight' is torch.bfloat16"):
        net.a.to(torch.bfloat16)
        MatrixOptimizer(net, torch.optim.Muon([net.a.weight]))
    net = _net()
    muon = torch.optim.Muon([net.a.weight])
    muon.param_groups[0]["params"].append(net.norm.weight)  # Muon's own check runs only at construction
    with pytest.raises(ZeroError, match=r"'norm.weight' has shape \(16,\); only 2-D"):
        MatrixOptimizer(net, muon)


def test_one_rank_matches_torch_and_state_dict_round_trips():
    """One process, no process group (ZeRO 0, owners all here): bitwise torch's Muon + AdamW for two steps; its
    state dict loaded into a fresh optimizer gives the same third step (and a wrong layout is refused by FQN)."""
    import copy

    import pytest
    import torch

    from vescale.core.testing.const_grads import split_matrices
    from vescale.parallel import MatrixOptimizer, ZeroError

    def make(net):
        mats, rest = split_matrices(net, SHAPES)
        return MatrixOptimizer(net, torch.optim.Muon(mats, **MUON), torch.optim.AdamW(rest, **ADAMW))

    def step(net, opt, i):
        opt.zero_grad()
        consts = _consts(net, i, 0)
        for name, p in net.named_parameters():
            p.grad = consts[name].clone()
        opt.step()

    net = _net()
    opt = make(net)
    for i in range(2):
        step(net, opt, i)
    want = _reference(1)
    for name, p in net.named_parameters():
        assert torch.equal(p.detach(), want[name]), name
    saved = copy.deepcopy(opt.state_dict())  # as with torch: its tensors are the live state
    again = _net()
    again.load_state_dict(net.state_dict())
    opt2 = make(again)
    opt2.load_state_dict(saved)
    step(net, opt, 2)
    step(again, opt2, 2)
    for (name, p), q in zip(net.named_parameters(), again.parameters()):
        assert torch.equal(p.detach(), q.detach()), name
    saved["matrix"]["owners"]["a.weight"] = [1, 0]
    with pytest.raises(ZeroError, match="'a.weight' was owned by"):
        make(_net()).load_state_dict(saved)
