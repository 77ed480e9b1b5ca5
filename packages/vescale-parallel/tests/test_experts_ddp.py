"""Expert parallelism composed with vescale DDP and ZeRO 1/2 (``DistributedDataParallel`` over the dp x ep mesh).

Mesh dp2 x ep2 (4 ranks). The model (a tiny Hugging Face Mixtral, fp32, with its own loss and load-balancing loss)
is parallelized by :func:`vescale.parallel.parallelize_experts` over the ``ep`` sub-mesh and wrapped in
:class:`~vescale.parallel.DistributedDataParallel` over the whole mesh (whose ep dim splits the batch): dense
parameters are reduced over dp x ep (one flat group), experts over dp. Each rank passes its rows (dp slice, then its
ep part).

What DDP computes is the single-device gradient of the mean over dp of each dp slice's loss: one device accumulating
``loss(slice d) / dp`` over the dp slices (the load-balancing loss is a function of a whole batch, so it is per slice,
as with any data parallelism or gradient accumulation). The reference is exactly that, on the untouched model in this
process (Hugging Face's eager experts; nothing of vescale). Compared (fp32, rtol 1e-5): the losses, every reduced
gradient (``reduced_grads``, also with ZeRO-2's sharded buckets), the clipped gradient norm (clipping active), and
every parameter after two SGD-with-momentum steps, for ZeRO 0 (torch SGD + ``clip_grad_norm_``), 1 and 2
(``DistributedOptimizer``). The collectives of a step are counted: the gradient reductions are one per bucket over
their own groups, not one per parameter.
"""

from __future__ import annotations

import pytest

from vescale.core.testing import multi_rank

RTOL, ATOL = 1e-5, 1e-6
LR, MOMENTUM, STEPS = 0.1, 0.9, 2


def _build(seed: int = 0):
    from vescale.core.testing.models import tiny_mixtral

    return tiny_mixtral(seed, output_router_logits=True, router_aux_loss_coef=0.1)


def _batch(step: int):
    import torch

    g = torch.Generator().manual_seed(10 + step)
    tokens = torch.randint(0, 64, (8, 8), generator=g)
    labels = torch.randint(0, 64, (8, 8), generator=g)
    labels[1, 5:] = -100
    return tokens, labels


def _reference(dp: int, clip: float):
    """Single device: per step, grads accumulated over the dp slices (loss / dp), torch clip, SGD momentum."""
    import torch

    model = _build()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    losses, norms, grads, params = [], [], [], []
    for step in range(STEPS):
        tokens, labels = _batch(step)
        total = 0.0
        for x, y in zip(tokens.chunk(dp), labels.chunk(dp)):
            loss = model(input_ids=x, labels=y).loss / dp
            loss.backward()
            total += loss.item()
        losses.append(total)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
        opt.step()
        opt.zero_grad(set_to_none=True)
        params.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return losses, norms, grads, params


def _run(zero: int, clip: float, ref) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from vescale.core.comm import count_comms
    from vescale.core.mesh import init_mesh, sub_mesh
    from vescale.parallel import (
        DDPOptions,
        DistributedDataParallel,
        DistributedOptimizer,
        clip_grad_norm_,
        parallelize_experts,
    )

    ref_losses, ref_norms, ref_grads, ref_params = ref
    mesh = init_mesh({"dp": 2, "ep": 2})
    d, e = mesh.get_local_rank("dp"), mesh.get_local_rank("ep")
    model = parallelize_experts(_build(), sub_mesh(mesh, "ep"))
    ddp = DistributedDataParallel(model, mesh, DDPOptions(zero_stage=2 if zero == 2 else 0))
    # two reductions: dense parameters over dp x ep, experts over dp (small model: one bucket each)
    assert sorted({b.buffer.reduction.name for b in ddp.buckets}) == ["dp", "dp+ep"]
    for slot in ddp.slots.values():
        expert = ".experts." in slot.fqn
        assert slot.buffer.reduction.name == ("dp" if expert else "dp+ep"), slot.fqn
        assert isinstance(slot.param.placements[0], Shard if expert else Replicate)
    if zero:
        opt = DistributedOptimizer(ddp, torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM),
                                   zero_stage=zero, clip_grad=clip)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    what = f"dp2 x ep2 zero={zero}"
    counts = None
    for step in range(STEPS):
        tokens, labels = _batch(step)
        x, y = tokens.chunk(2)[d].chunk(2)[e], labels.chunk(2)[d].chunk(2)[e]
        with count_comms(mesh) as comms:
            loss = ddp(input_ids=x, labels=y).loss  # the dp slice's loss, on every ep rank of it
            loss.backward()
        if step == 0:
            counts = comms.summary()
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=mesh.get_group("dp"))
        torch.testing.assert_close(mean.item() / 2, ref_losses[step], rtol=RTOL, atol=ATOL)
        reduced = ddp.reduced_grads()
        assert sorted(reduced) == sorted(ref_grads[step])
        for name, g in reduced.items():
            assert isinstance(g, DTensor)
            torch.testing.assert_close(g.full_tensor(), ref_grads[step][name], rtol=RTOL, atol=ATOL,
                                       msg=lambda m, name=name, step=step: f"{what} step {step} grad {name}: {m}")
        if zero:
            opt.step()
            norm = opt.grad_norm
        else:
            norm = clip_grad_norm_(list(model.parameters()), clip)
            opt.step()
        torch.testing.assert_close(float(norm), ref_norms[step], rtol=RTOL, atol=ATOL,
                                   msg=lambda m, step=step: f"{what} step {step} grad norm: {m}")
        opt.zero_grad(set_to_none=True)
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.full_tensor(), ref_params[step][name], rtol=RTOL, atol=ATOL,
                                       msg=lambda m, name=name, step=step: f"{what} step {step} param {name}: {m}")
    return counts


@multi_rank(world_sizes=[4])
def test_dp_ep_ddp_and_zero_match_single_device():
    from vescale.core.testing.reference import one_thread

    with one_thread():
        ref_first = _reference(dp=2, clip=1e9)
        clip = ref_first[1][0] / 4  # a quarter of the first step's norm: clipping scales every step
        ref = _reference(dp=2, clip=clip)
        assert ref[1][0] > clip
        counts = {zero: _run(zero, clip, ref) for zero in (0, 1, 2)}
    # The gradient reductions are bucketed: in backward one all-reduce (ZeRO 0/1) or reduce-scatter (ZeRO 2) per
    # bucket, two buckets (dense over dp x ep, experts over dp). Nothing else reduces a gradient: the other
    # all-reduces (the routing's and the loss's scalars, over ep) move fewer bytes than the smallest parameter's
    # gradient (a norm weight, 32 fp32), where without DDP's data dims each parameter was all-reduced over ep.
    smallest = min(p.numel() for p in _build().parameters()) * 4
    for zero, c in counts.items():
        grad_op = "reduce_scatter_tensor" if zero == 2 else "all_reduce"
        assert c["per_dim"]["dp"]["counts"] == {grad_op: 1}, (zero, c)
        assert c["per_dim"]["dp,ep"]["counts"] == {grad_op: 1}, (zero, c)
        rest = sum(v["bytes"].get("all_reduce", 0) for k, v in c["per_dim"].items() if k not in ("dp", "dp,ep"))
        assert 0 < rest < smallest, (zero, rest, smallest, c)


@multi_rank(world_sizes=[4])
def test_data_dims_errors_before_any_collective():
    import torch

    from vescale.core.mesh import init_mesh, sub_mesh
    from vescale.parallel import DistributedDataParallel, parallelize_experts
    from vescale.parallel.errors import DDPError

    mesh = init_mesh({"dp": 2, "ep": 2})
    mixed = parallelize_experts(_build(), sub_mesh(mesh, "ep"))  # a plain parameter among DTensors over ep
    mixed.model.embed_tokens.weight = torch.nn.Parameter(torch.zeros_like(mixed.model.embed_tokens.weight.to_local()))
    with pytest.raises(DDPError, match=r"parameter 'model\.embed_tokens\.weight' is not a DTensor over data dim 'ep'"):
        DistributedDataParallel(mixed, mesh)
    model = parallelize_experts(_build(), sub_mesh(mesh, "ep"))
    with pytest.raises(DDPError, match=r"data_dims= is gone: pass the mesh with those dims"):
        DistributedDataParallel(model, mesh, data_dims=("ep",))


@multi_rank(world_sizes=[2])
def test_gradient_as_summand_over_a_data_dim():
    """Whatever layout a gradient arrives in on a data dim, DDP's summand (labelled Replicate there) sums over that
    dim to the gradient's value: a Partial sum keeps its local values; Replicate and Shard are kept by coordinate 0."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    from vescale.core.mesh import init_mesh
    from vescale.parallel._grad_buckets import _as_summand

    mesh = init_mesh({"ep": 2})
    r = mesh.get_local_rank("ep")
    full = torch.arange(12.0).reshape(4, 3)
    cases = {
        "partial": DTensor.from_local(full * (r + 1) / 3, mesh, [Partial()], run_check=False),
        "replicate": DTensor.from_local(full, mesh, [Replicate()], run_check=False),
        "shard": DTensor.from_local(full.chunk(2)[r], mesh, [Shard(0)], run_check=False, shape=full.shape,
                                    stride=full.stride()),
        "partial_avg": DTensor.from_local(full * (2 * r), mesh, [Partial("avg")], run_check=False),
    }
    for name, grad in cases.items():
        out = _as_summand(grad, mesh, (0,))
        assert tuple(out.placements) == (Replicate(),), name
        total = out.to_local().clone()
        dist.all_reduce(total)
        torch.testing.assert_close(total, full, msg=lambda m, name=name: f"{name}: {m}")
    kept = _as_summand(cases["partial"], mesh, (0,)).to_local()
    torch.testing.assert_close(kept, full * (r + 1) / 3)  # a Partial sum is kept as is, no communication
