"""ZeRO-2 holds 1/dp of the gradients at rest, and its gradients stay those of one device.

A model of odd-sized linear layers (no parameter, bucket or total a multiple of dp) is wrapped in
``DistributedDataParallel(DDPOptions(zero_stage=2))`` with tiny buckets (several per model) and stepped by
``DistributedOptimizer(zero_stage=2)``. After a synchronised backward and after the step a rank must hold exactly its
reduced shards, ``sum(bucket numel / dp)`` elements of the gradient dtype: the theoretical ``P / dp`` plus the
bucket padding (fewer than dp elements per bucket), and none of the full-size bucket buffers (checked by DDP's
accounting, by ``.grad`` / ``.main_grad`` being cleared, and by weak references to every full buffer backward
created, which must all be dead: nothing else keeps them alive). Gradients are compared per parameter against the
unmodified model on one device over the whole batch (each dp rank its own rows), gathered with ``reduced_grads``,
within 1e-5 x the largest reference element (each element sums 16 row contributions in another order: fp32
roundoff, far below what a lost or doubled bucket would give).
"""

from __future__ import annotations

import pytest

from vescale.core.testing import multi_rank
from vescale.core.testing.reference import single_threaded

ROWS, D_IN = 16, 13
TOL = 1e-5


def _model():
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D_IN, 7), nn.Tanh(), nn.Linear(7, 6), nn.Tanh(), nn.Linear(6, 3))


def _batch(seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randn(ROWS, D_IN, generator=g), torch.randn(ROWS, 3, generator=g)


def _loss(model, x, y):
    return ((model(x) - y) ** 2).mean()


def _reference_grads(seeds) -> dict:
    """One device: the sum over ``seeds`` of the whole batch's mean-loss gradient, by FQN (no vescale)."""
    model = _model()
    for seed in seeds:
        _loss(model, *_batch(seed)).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _assert_close(got, want, what: str) -> None:
    largest = want.abs().max()
    err = (got - want).abs().max()
    assert err <= TOL * largest, f"{what}: off by {err:.3g}, bound {TOL * largest:.3g}"


def _watch_full_buffers(ddp) -> list:
    """Weak references to every full-size ZeRO-2 bucket buffer alive at any gradient hook of later backwards."""
    import weakref

    from torch.autograd.graph import get_gradient_edge

    refs, seen = [], []

    def hook(grad_inputs, grad_outputs):  # runs after DDP's own hook on the same node (registered later)
        for bucket in ddp.buckets:
            if bucket.full is not None and not any(r() is bucket.full for r in seen):
                seen.append(weakref.ref(bucket.full))
                refs.append(bucket.full.untyped_storage()._weak_ref())  # a storage-level weak reference

    for p in ddp.slots:  # (DDP keeps these nodes alive)
        get_gradient_edge(p).node.register_hook(hook)
    return refs


@multi_rank(world_sizes=[2, 4])
@single_threaded
def test_zero2_holds_its_gradient_shards_only(world_size):
    import torch
    import torch.distributed as dist

    from vescale.core.mesh import init_mesh
    from vescale.parallel import DDPOptions, DistributedDataParallel, DistributedOptimizer

    mesh = init_mesh({"dp": world_size})
    rank, rows = dist.get_rank(), ROWS // world_size
    ddp = DistributedDataParallel(_model(), mesh, DDPOptions(bucket_size_mb=0.0001, zero_stage=2))  # ~26 fp32 a bucket
    opt = DistributedOptimizer(ddp, torch.optim.SGD, zero_stage=2, lr=0.1)
    P = sum(p.numel() for p in ddp.parameters())
    assert len(ddp.buckets) >= 3 and P % world_size  # 167 parameters: uneven over dp, padded buckets
    shard_elems = sum(b.numel // world_size for b in ddp.buckets)
    # the theoretical 4P/dp, and padding of fewer than dp elements per bucket
    assert P / world_size <= shard_elems < P / world_size + len(ddp.buckets)
    refs = _watch_full_buffers(ddp)

    def held_only_shards(when: str) -> None:
        assert ddp.grad_buffer_bytes() == 4 * shard_elems, (when, ddp.grad_buffer_bytes(), 4 * shard_elems, P)
        for name, p in ddp.module.named_parameters():
            assert p.grad is None and getattr(p, "main_grad", None) is None, (when, name)
        assert refs and all(torch.UntypedStorage._expired(r) for r in refs), (when, "a full bucket buffer is alive")

    # Step 1: one synchronised backward, then the step.
    x, y = _batch(1)
    _loss(ddp, x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows]).backward()
    assert len(refs) == len(ddp.buckets)  # every bucket had its full buffer during backward...
    held_only_shards("after backward")  # ...and none is left
    want = _reference_grads([1])
    for name, g in ddp.reduced_grads().items():
        _assert_close(g, want[name], f"dp={world_size} step 1 {name}")
    opt.step()
    held_only_shards("after step")
    opt.zero_grad()

    # Each backward creates the buffers again and frees them after its reduce-scatter, whose result is added to the
    # shards, as one device adds a second backward into .grad when nothing cleared it; zero_grad zeroes them.
    ddp = DistributedDataParallel(_model(), mesh, DDPOptions(bucket_size_mb=0.0001, zero_stage=2))
    refs = _watch_full_buffers(ddp)
    for seed in (2, 3):
        x, y = _batch(seed)
        _loss(ddp, x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows]).backward()
        held_only_shards(f"after backward of batch {seed}")
    assert len(refs) == 2 * len(ddp.buckets)
    want = _reference_grads([2, 3])
    for name, g in ddp.reduced_grads().items():
        _assert_close(g, want[name], f"dp={world_size} two backwards without zero_grad {name}")
    ddp.zero_grad()
    assert all(not g.any() for g in ddp.reduced_grads().values())
    held_only_shards("after zero_grad")


@multi_rank(world_sizes=[2])
@single_threaded
@pytest.mark.parametrize("accum", [1, 2])
def test_zero2_bf16_params_fp32_grads_hold_shards_only(world_size, accum):
    """bf16 parameters, fp32 gradient accumulation and reduction (the bf16 recipe), with ``no_sync`` micro-steps:
    full buffers live during the micro-steps, only the fp32 shards after the synchronised one."""
    import contextlib

    import torch
    import torch.distributed as dist

    from vescale.core.mesh import init_mesh
    from vescale.parallel import DDPOptions, DistributedDataParallel

    mesh = init_mesh({"dp": world_size})
    rank, rows = dist.get_rank(), ROWS // world_size
    options = DDPOptions(bucket_size_mb=0.0001, zero_stage=2, grad_dtype=torch.float32)
    ddp = DistributedDataParallel(_model().to(torch.bfloat16), mesh, options)
    shard_elems = sum(b.numel // world_size for b in ddp.buckets)
    full_elems = sum(b.numel for b in ddp.buckets)
    x, y = _batch(5)
    x, y = x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows]
    for i, (xs, ys) in enumerate(zip(x.chunk(accum), y.chunk(accum))):
        with ddp.no_sync() if i < accum - 1 else contextlib.nullcontext():
            (_loss(ddp, xs.bfloat16(), ys.bfloat16()) / accum).backward()
        if i < accum - 1:  # accumulating: every bucket's full fp32 buffer is held
            assert ddp.grad_buffer_bytes() == 4 * (shard_elems + full_elems)
    assert ddp.grad_buffer_bytes() == 4 * shard_elems
    assert all(p.grad is None and getattr(p, "main_grad", None) is None for p in ddp.parameters())
    # The reference: one device in fp32 from the same bf16-rounded weights and inputs; the parallel run computes
    # in bf16 (8 bits of mantissa), so the bound is bf16's: relative 2e-2 of the largest element.
    ref = _model().to(torch.bfloat16).float()
    bx, by = _batch(5)
    _loss(ref, bx.bfloat16().float(), by.bfloat16().float()).backward()
    for name, g in ddp.reduced_grads().items():
        want = dict(ref.named_parameters())[name].grad.float()
        err = (g - want).abs().max()
        assert g.dtype == torch.float32 and err <= 2e-2 * want.abs().max(), (name, float(err))
