"""DDP over plain-tensor expert parallelism (``DistributedDataParallel`` over a dp x ep mesh, plain
parameters, the experts marked as pieces over ep), the layout of a captured pipeline stage under pp x ep.

Mesh dp2 x ep2 (4 ranks). A tiny Hugging Face Mixtral (fp32, no load-balancing term: with plain per-rank tensors the
router sees only its rank's rows) gets :func:`~vescale.parallel.experts.experts_as_operator` and
:func:`~vescale.parallel.experts.keep_local_experts`: each rank holds its two of the four experts as plain
``[2, ...]`` tensors and every dense parameter as a plain replica. DDP learns which parameters are local experts from
their marks (``mark_piece(..., groups={"ep": group})``, set by ``keep_local_experts``) and is driven as
``PipeEngine`` drives a stage DDP (``vescale.pipe.StageGradSync``): ``defer_grad_sync()``, then
``finish_grad_sync()``. Each (dp, ep) rank backpropagates its rows' mean loss / ep (its share of the step's loss).

The reference is the untouched model in this process (Hugging Face's eager experts, nothing of vescale): one device
accumulating ``loss(slice) / 4`` over the four row slices. Compared (fp32, rtol 1e-5), for ZeRO 0 (torch SGD and
``clip_grad_norm_``), 1 and 2 (``DistributedOptimizer``): every reduced gradient (each rank's experts a slice of the
one-device gradient), the clipped norm (clipping active) and every parameter after two SGD-with-momentum steps. The
collectives of a step are counted: one bucketed reduction per group (dense over dp x ep, experts over dp).
"""

from __future__ import annotations

import pytest

from vescale.core.testing import multi_rank

RTOL, ATOL = 1e-5, 1e-6
LR, MOMENTUM, STEPS = 0.1, 0.9, 2


def _build(seed: int = 0):
    from vescale.core.testing.models import tiny_mixtral

    return tiny_mixtral(seed, use_cache=False)


def _batch(step: int):
    import torch

    g = torch.Generator().manual_seed(20 + step)
    return torch.randint(0, 64, (8, 8), generator=g), torch.randint(0, 64, (8, 8), generator=g)


def _reference(clip: float):
    """Single device: per step, grads accumulated over the four row slices (loss / 4), torch clip, SGD momentum."""
    import torch

    model = _build()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    norms, grads, params = [], [], []
    for step in range(STEPS):
        tokens, labels = _batch(step)
        for x, y in zip(tokens.chunk(4), labels.chunk(4)):
            (model(input_ids=x, labels=y).loss / 4).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
        opt.step()
        opt.zero_grad(set_to_none=True)
        params.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return norms, grads, params


def _run(zero: int, clip: float, ref) -> dict:
    import torch

    from vescale.core.comm import count_comms
    from vescale.core.mesh import init_mesh
    from vescale.parallel import DDPOptions, DistributedDataParallel, DistributedOptimizer, clip_grad_norm_
    from vescale.parallel.experts import experts_as_operator, keep_local_experts

    ref_norms, ref_grads, ref_params = ref
    mesh = init_mesh({"dp": 2, "ep": 2})
    d, e = mesh.get_local_rank("dp"), mesh.get_local_rank("ep")
    model = _build()
    experts = experts_as_operator(model, mesh)
    local = keep_local_experts(model, experts, mesh)
    ddp = DistributedDataParallel(model, mesh, DDPOptions(zero_stage=2 if zero == 2 else 0))
    ddp.defer_grad_sync()  # as PipeEngine drives a stage's DDP (vescale.pipe.StageGradSync)
    for slot in ddp.slots.values():
        assert slot.buffer.reduction.name == ("dp" if slot.fqn in local else "dp+ep"), slot.fqn
    buckets = {name: sum(b.buffer.reduction.name == name for b in ddp.buckets) for name in ("dp", "dp+ep")}
    if zero:
        opt = DistributedOptimizer(ddp, torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM),
                                   zero_stage=zero, clip_grad=clip)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    what = f"dp2 x ep2 plain experts zero={zero}"

    def one_device(name: str, t: torch.Tensor) -> torch.Tensor:  # this rank's slice of a one-device tensor
        return t[2 * e:2 * e + 2] if name in local else t

    counts = None
    for step in range(STEPS):
        tokens, labels = _batch(step)
        x, y = tokens.chunk(4)[2 * d + e], labels.chunk(4)[2 * d + e]
        with count_comms(mesh) as comms:
            (ddp(input_ids=x, labels=y).loss / 2).backward()  # this rank's share: its rows' mean / ep
            ddp.finish_grad_sync()
        if step == 0:
            counts = comms.summary()
        reduced = ddp.reduced_grads()
        assert sorted(reduced) == sorted(ref_grads[step])
        for name, g in reduced.items():
            torch.testing.assert_close(g, one_device(name, ref_grads[step][name]), rtol=RTOL, atol=ATOL,
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
            torch.testing.assert_close(p.detach(), one_device(name, ref_params[step][name]), rtol=RTOL, atol=ATOL,
                                       msg=lambda m, name=name, step=step: f"{what} step {step} param {name}: {m}")
    return {"counts": counts, "buckets": buckets}


@multi_rank(world_sizes=[4])
def test_stage_ddp_with_plain_experts_matches_single_device_one_reduction_per_group():
    from vescale.core.testing.reference import one_thread

    with one_thread():
        ref_first = _reference(clip=1e9)
        clip = ref_first[0][0] / 4  # a quarter of the first step's norm: clipping scales every step
        ref = _reference(clip=clip)
        assert ref[0][0] > clip
        results = {zero: _run(zero, clip, ref) for zero in (0, 1, 2)}
    # The gradient reductions are bucketed, one per bucket of each group, in the step (backward plus
    # finish_grad_sync): dense over dp x ep, experts over dp (small model: one bucket each). Nothing else crosses dp.
    for zero, r in results.items():
        grad_op = "reduce_scatter_tensor" if zero == 2 else "all_reduce"
        assert r["buckets"] == {"dp": 1, "dp+ep": 1}, (zero, r)
        per_dim = r["counts"]["per_dim"]
        assert per_dim["dp"]["counts"] == {grad_op: 1}, (zero, per_dim)
        assert per_dim["dp,ep"]["counts"] == {grad_op: 1}, (zero, per_dim)


@multi_rank(world_sizes=[4])
def test_piece_marks_errors_before_any_collective():
    """A plain model on a mesh with data dims and no marks is replicated over dp x ep; a piece over dp, a piece whose
    group is not the mesh's, a DTensor marked as a piece, and plain parameters among DTensors are refused, naming the
    FQN."""
    import torch

    from vescale.core.mesh import init_mesh, sub_mesh
    from vescale.core.sharded_state import mark_piece
    from vescale.parallel import DistributedDataParallel, parallelize_experts
    from vescale.parallel.errors import DDPError

    mesh = init_mesh({"dp": 2, "ep": 2})
    name = "model.layers.0.mlp.experts.down_proj"
    replicas = DistributedDataParallel(_build(), mesh)
    assert {s.buffer.reduction.name for s in replicas.slots.values()} == {"dp+ep"}

    def marked(**groups):
        model = _build()
        mark_piece(model.get_parameter(name), groups=groups)
        return model

    with pytest.raises(DDPError, match=r"parameter '.*down_proj' is marked as a piece over 'dp' .* the dim DDP "
                                       r"averages over"):
        DistributedDataParallel(marked(dp=mesh.get_group("dp")), mesh)
    with pytest.raises(DDPError, match=r"'.*down_proj' is marked as a piece over 'ep' with ranks \[.*\], but the DDP "
                                       r"mesh's dim 'ep' holds ranks"):
        DistributedDataParallel(marked(ep=mesh.get_group("dp")), mesh)
    model = parallelize_experts(_build(), sub_mesh(mesh, "ep"))
    mark_piece(model.get_parameter(name), groups={"ep": mesh.get_group("ep")})
    with pytest.raises(DDPError, match=r"'.*down_proj' is a DTensor .* marked as a piece over data dims \['ep'\]"):
        DistributedDataParallel(model, mesh)
    model = parallelize_experts(_build(), sub_mesh(mesh, "ep"))
    model.lm_head.weight = torch.nn.Parameter(torch.zeros(64, 32))
    with pytest.raises(DDPError, match=r"parameter 'lm_head\.weight' is not a DTensor over data dim 'ep' but a plain "
                                       r"tensor, while .* is a DTensor over \['ep'\]"):
        DistributedDataParallel(model, mesh)
