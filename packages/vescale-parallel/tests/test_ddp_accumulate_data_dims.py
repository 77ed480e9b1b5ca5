"""Gradient accumulation over several backwards equals one device's, for every DDP layout and ZeRO stage.

Two backwards before one optimizer step: either both synchronised (no ``zero_grad`` in between: the second's reduced
gradient adds to the first's, as ``.grad`` accumulates on one device) or a ``no_sync`` micro-step then a synchronised
one. Layouts, each on dp1 x ep2 (2 ranks) and dp2 x ep2 (4 ranks), a tiny Hugging Face Mixtral in fp32:

- ``dtensor``: :func:`~vescale.parallel.parallelize_experts` over the ep sub-mesh, DDP over the dp x ep mesh (ep a
  data dim; dense gradients reduced over dp x ep as summands, experts over dp);
- ``local``: plain tensors (experts kept as ``[E / ep, ...]`` slices, marked as pieces over ep), as a pipeline stage
  holds them;
- ``plain``: the unmodified model, DDP over all ranks as one dp dim (no data dim besides dp).

ZeRO 0 (torch SGD on ``.grad``), 1 and 2 (:class:`~vescale.parallel.DistributedOptimizer`). The reference is the
untouched model on one process: the gradient of the sum of both micro-steps' losses (each micro-step's loss is
what the layout's ranks compute together: the dp mean of each dp slice's loss, or the mean of every rank's rows'
mean loss), and the parameters after one SGD step on it. Compared: every reduced gradient (``reduced_grads``) and
every parameter after the step, fp32 ``rtol=1e-5``.

Before DDP scaled the summands of a gradient reduced over data dims, the first synchronised backward's reduced
gradient stayed in the buffer and was summed over ep again by the second: ``ep * g1 + g2`` (ZeRO 0 and 1).
"""

from __future__ import annotations

import pytest

from vescale.core.testing import multi_rank

RTOL, ATOL = 1e-5, 1e-6
LR = 0.5
MICRO = 2
LAYOUTS = ("dtensor", "local", "plain")


def _build():
    from vescale.core.testing.models import tiny_mixtral

    return tiny_mixtral(0, use_cache=False)


def _batch(micro: int):
    import torch

    g = torch.Generator().manual_seed(40 + micro)
    tokens = torch.randint(0, 64, (8, 8), generator=g)
    labels = torch.randint(0, 64, (8, 8), generator=g)
    labels[micro, 3:] = -100  # uneven counts of targets over the row slices
    return tokens, labels


def _slices(layout: str, dp: int, ep: int) -> list[list[int]]:
    """Row-slice indices (of ``dp * ep`` equal slices of a batch) whose losses are averaged together: per dp slice
    its ep parts for ``dtensor`` (one DTensor loss over the dp slice), every part alone otherwise."""
    if layout == "dtensor":
        return [list(range(d * ep, (d + 1) * ep)) for d in range(dp)]
    return [[i] for i in range(dp * ep)]


def _reference(layout: str, dp: int, ep: int):
    """One device: grads of the sum over micro-steps of the mean over loss groups, then one plain SGD step."""
    import torch

    model = _build()
    for micro in range(MICRO):
        tokens, labels = _batch(micro)
        xs, ys = tokens.chunk(dp * ep), labels.chunk(dp * ep)
        groups = _slices(layout, dp, ep)
        for group in groups:
            x, y = torch.cat([xs[i] for i in group]), torch.cat([ys[i] for i in group])
            (model(input_ids=x, labels=y).loss / len(groups)).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        params = {n: p - LR * p.grad for n, p in model.named_parameters()}
    return grads, params


def _run(layout: str, zero: int, mode: str, dp: int, ref) -> dict[str, float]:
    """Accumulate MICRO backwards under ``layout``; assert grads and the stepped parameters; return rel errors."""
    import contextlib

    import torch
    from torch.distributed.tensor import DTensor

    from vescale.core.mesh import init_mesh, sub_mesh
    from vescale.parallel import DDPOptions, DistributedDataParallel, DistributedOptimizer, parallelize_experts
    from vescale.parallel.experts import experts_as_operator, keep_local_experts

    ep = 2
    ref_grads, ref_params = ref
    mesh = init_mesh({"dp": dp, "ep": ep})
    d, e = mesh.get_local_rank("dp"), mesh.get_local_rank("ep")
    model = _build()
    local: list[str] = []
    if layout == "dtensor":
        parallelize_experts(model, sub_mesh(mesh, "ep"))
        ddp = DistributedDataParallel(model, mesh, DDPOptions(zero_stage=2 if zero == 2 else 0))
    elif layout == "local":
        local = keep_local_experts(model, experts_as_operator(model, mesh), mesh)
        ddp = DistributedDataParallel(model, mesh, DDPOptions(zero_stage=2 if zero == 2 else 0))
    else:
        ddp = DistributedDataParallel(model, init_mesh({"dp": dp * ep}), DDPOptions(zero_stage=2 if zero == 2 else 0))
    if zero:
        opt = DistributedOptimizer(ddp, torch.optim.SGD(model.parameters(), lr=LR), zero_stage=zero)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=LR)
    what = f"{layout} dp{dp} x ep{ep} zero={zero} {mode}"

    def one_device(name: str, t: torch.Tensor) -> torch.Tensor:  # this rank's part of a one-device tensor
        return t[e * (t.shape[0] // ep):(e + 1) * (t.shape[0] // ep)] if name in local else t

    def whole(t: torch.Tensor) -> torch.Tensor:
        return t.full_tensor() if isinstance(t, DTensor) else t

    for micro in range(MICRO):
        tokens, labels = _batch(micro)
        x, y = tokens.chunk(dp * ep)[d * ep + e], labels.chunk(dp * ep)[d * ep + e]
        sync = mode == "synced" or micro == MICRO - 1
        with contextlib.nullcontext() if sync else ddp.no_sync():
            loss = ddp(input_ids=x, labels=y).loss
            # dtensor: the dp slice's loss (one DTensor over its ep ranks); local: this rank's share of the dp x ep
            # sum (its rows' mean / ep, DDP sums over ep); plain: its rows' mean (DDP averages over every rank)
            (loss / ep if layout == "local" else loss).backward()
    errors = {}
    for name, g in ddp.reduced_grads().items():
        got, want = whole(g), one_device(name, ref_grads[name])
        errors[name] = ((got - want).norm() / want.norm()).item()
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL, msg=lambda m, name=name: f"{what} grad {name}: {m}")
    opt.step()
    for name, p in model.named_parameters():
        torch.testing.assert_close(whole(p.detach()), one_device(name, ref_params[name]), rtol=RTOL, atol=ATOL,
                                   msg=lambda m, name=name: f"{what} param {name} after the step: {m}")
    return errors


def _all(dp: int) -> None:
    from vescale.core.testing.reference import one_thread

    with one_thread():
        for layout in LAYOUTS:
            ref = _reference(layout, dp, 2)
            for zero in (0, 1, 2):
                for mode in ("synced", "no_sync"):
                    _run(layout, zero, mode, dp, ref)


@multi_rank(world_sizes=[2])
def test_accumulation_matches_single_device_dp1_ep2():
    _all(dp=1)


@multi_rank(world_sizes=[4])
def test_accumulation_matches_single_device_dp2_ep2():
    _all(dp=2)


@multi_rank(world_sizes=[2])
def test_summand_scaled_by_the_data_dims():
    """The gradient DDP keeps in a dp+ep buffer is ep times this rank's summand (sum over ep of the summands: the
    gradient), so the flat group's average counts an already reduced gradient (identical on every rank) once."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Partial, Replicate

    from vescale.core.mesh import init_mesh
    from vescale.parallel._grad_buckets import _as_summand

    mesh = init_mesh({"ep": 2})
    r = mesh.get_local_rank("ep")
    full = torch.arange(6.0).reshape(2, 3)
    for name, grad in {"partial": DTensor.from_local(full * (r + 1) / 3, mesh, [Partial()], run_check=False),
                       "replicate": DTensor.from_local(full, mesh, [Replicate()], run_check=False)}.items():
        out = _as_summand(grad, mesh, (0,), scale=2.0).to_local().clone()
        dist.all_reduce(out, op=dist.ReduceOp.AVG)
        torch.testing.assert_close(out, full, msg=lambda m, name=name: f"{name}: {m}")


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__, "-q"])
