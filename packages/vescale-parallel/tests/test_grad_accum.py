"""Gradient accumulation under DDP and ZeRO 1/2: N micro-steps inside ``no_sync`` give the full batch's gradient,
with the dp reductions of one step.

Each dp rank takes its own rows of one global batch (distinct per rank) and runs them as N micro-steps, each
``(loss / N).backward()``, all but the last inside ``DistributedDataParallel.no_sync()``. The reference is the
unmodified model's one-shot gradient of the mean loss over the whole batch on one device (no microbatches, no
vescale). Gradients are compared per parameter, whole (ZeRO-2: each rank's own slice, as its optimizer sees it),
within 1e-5 x the parameter's largest reference element: each element is a sum over the batch's 8 x 16 = 128
token positions which the parallel run adds up in another order (2 ranks x N micro-steps), so with fp32's unit
roundoff u = 6e-8 it may differ by about 128 u = 7.6e-6 of the largest magnitude involved. A constant scale (a dp
sum instead of a mean, a missing 1/N) misses by at least half the largest element, 50000 times the bound.
"""

from __future__ import annotations

import pytest

from vescale.core.testing import multi_rank
from vescale.core.testing.reference import progression_batch, single_threaded

BATCH, SEQ, VOCAB = 8, 16, 64
TOL = 1e-5  # x the largest element of the reference gradient (see the module docstring)


def _model():
    import torch

    from vescale.core.testing.models import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=VOCAB, d_model=32, n_layer=2, n_head=4, n_kv_head=2, max_seq_len=SEQ))


def _reference_grads(x, y) -> dict:
    """One device, one backward over the whole batch: the gradient of the mean loss, by FQN."""
    from vescale.core.testing.models import cross_entropy

    model = _model()
    cross_entropy(model(x), y).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _assert_close(got, want, what: str) -> None:
    largest = want.abs().max()
    err = (got - want).abs().max()
    assert err <= TOL * largest, (f"{what}: off by {err:.3g}, bound {TOL * largest:.3g} ({TOL} x largest element "
                                  f"{largest:.3g}); norm ratio to one device {float(got.norm() / want.norm()):.6g}")


def _accumulate(ddp, mesh, x, y, n: int) -> list[dict]:
    """This rank's rows ``x``/``y`` as ``n`` micro-steps, all but the last in ``no_sync``; return the dp gradient
    reductions (``{all_reduce / reduce_scatter_tensor: calls}``) each micro-step issued, counted separately."""
    import contextlib

    from vescale.core.comm import count_comms
    from vescale.core.testing.models import cross_entropy

    issued = []
    for i, (xs, ys) in enumerate(zip(x.chunk(n), y.chunk(n))):
        with count_comms(mesh) as counter, ddp.no_sync() if i < n - 1 else contextlib.nullcontext():
            (cross_entropy(ddp(xs), ys) / n).backward()
        per_dim = counter.dim_counts.get("dp", {})
        issued.append({k: v for k, v in per_dim.items() if k in ("all_reduce", "reduce_scatter_tensor")})
    return issued


@multi_rank(world_sizes=[2])
@single_threaded
@pytest.mark.parametrize("zero_stage", [0, 1, 2])
@pytest.mark.parametrize("accum", [2, 4])
def test_accumulated_gradient_equals_one_device_full_batch(world_size, zero_stage, accum):
    import torch
    import torch.distributed as dist

    from vescale.core.mesh import init_mesh
    from vescale.parallel import DDPOptions, DistributedDataParallel, DistributedOptimizer

    mesh = init_mesh({"dp": world_size})
    rank = dist.get_rank()
    x, y = progression_batch(7, BATCH, SEQ, VOCAB)
    want = _reference_grads(x, y)
    rows = BATCH // world_size
    mine_x, mine_y = x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows]
    others = [torch.empty_like(mine_x) for _ in range(world_size)]
    dist.all_gather(others, mine_x)
    assert not torch.equal(others[0], others[1]), "the dp ranks must see different rows"

    # Tiny buckets, so a step has several reductions to count.
    ddp = DistributedDataParallel(_model(), mesh, DDPOptions(bucket_size_mb=0.004, zero_stage=zero_stage))
    opt = (DistributedOptimizer(ddp, torch.optim.SGD, zero_stage=zero_stage, lr=0.1) if zero_stage
           else torch.optim.SGD(ddp.parameters(), lr=0.1))
    assert len(ddp.buckets) > 2
    kind = "reduce_scatter_tensor" if zero_stage == 2 else "all_reduce"

    # One step without accumulation: what a step's dp reductions are (one per bucket).
    [one_step] = _accumulate(ddp, mesh, mine_x, mine_y, 1)
    assert one_step == {kind: len(ddp.buckets)}
    opt.zero_grad(set_to_none=True)
    # Accumulated: nothing inside no_sync, then exactly one step's reductions in the last micro-step.
    issued = _accumulate(ddp, mesh, mine_x, mine_y, accum)
    assert issued == [{}] * (accum - 1) + [one_step], f"zero{zero_stage} accum={accum}: {issued}"

    what = f"zero{zero_stage} accum={accum} rank {rank}"
    by_param = dict(ddp.module.named_parameters())
    assert set(by_param) == set(want)
    if zero_stage == 2:
        # Each rank holds the reduced gradient of its own slice only: check the slices its optimizer will update.
        for piece in opt.pieces.values():
            if piece.hi > piece.lo:
                _assert_close(piece.grad, want[piece.fqn].flatten()[piece.lo:piece.hi], f"{what}: {piece.fqn} slice")
    else:
        for name, p in by_param.items():  # fp32 parameters: .grad is the reduced buffer view, what the step reads
            _assert_close(p.grad, want[name], f"{what}: {name}")
    # The whole reduced gradients (ZeRO-2: gathered over dp), as train.py's --grad-dump reads them.
    reduced = ddp.reduced_grads()
    assert set(reduced) == set(want)
    for name, g in reduced.items():
        _assert_close(g, want[name], f"{what}: reduced_grads {name}")
