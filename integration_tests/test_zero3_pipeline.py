"""ZeRO 3 (FSDP2) of pipeline stages: one gather and one reduce-scatter per step, gradients equal to one device.

A two-stage model whose embedding is tied to its output projection (stage 0 embeds, the last stage projects with the
same weight) runs on ``pp=2 x dp=2`` (and HSDP: ``pp=2 x dp_replicate=2 x dp_shard=2``) with each stage sharded by
``vescale.parallel.fully_shard_stage`` and handed to ``PipeEngine.wrap_stages``. Against the same model on one device
in plain torch: every gradient (the tied one the sum of both uses, summed over pp on the dp shards) after the
second step (the first's gradients set to None, as ``zero_grad`` does). Over dp a step issues exactly one all-gather
(the stage's parameters, gathered at its first forward and kept through the microbatches) and one reduce-scatter
(the sum of all microbatches' gradients, in the last backward), or with ``reshard_after_forward=True`` still one
reduce-scatter but an all-gather per use; after the step the stage holds its shards only. A zero-bubble schedule,
whose split backward FSDP2's hooks do not see, is refused on every rank. bf16: a stage built in bf16 (as
``tools/train.py`` captures one) sharded with ``master_dtype=torch.float32`` holds fp32 masters (the bf16 init,
widened) and fp32 gradients, within the bf16 bound of the bf16 model's gradients on one device; masters for a stage
not built in the policy's compute dtype are refused.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from vescale.core.testing.models import TiedPair, TiedPairStage

V, D, SEQ, BATCH, M = 16, 8, 4, 8, 4  # vocab, width, sequence, global batch, microbatches per dp rank


def _loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, V), target.reshape(-1))


def _run(mesh_spec: str, schedule: str, reshard_after_forward: bool, bf16: bool = False) -> dict:
    """On each rank: two pipeline steps with ZeRO-3 stages; the second's gradients and collectives over dp. ``bf16``:
    the stage is built in bf16 (as a pipeline split captures it for bf16 compute) and sharded with fp32 masters and
    FSDP2's bf16 policy (``master_dtype``); the reference is the bf16 model on one device."""
    from torch.distributed.tensor import DTensor, Shard

    from vescale.core.comm import count_comms
    from vescale.core.mesh import init_mesh, sub_mesh
    from vescale.parallel import fully_shard_stage
    from vescale.parallel.zero3 import bf16_policy, zero3_mesh
    from vescale.pipe import PipeEngine

    mesh = init_mesh(mesh_spec)
    pp, dp = sub_mesh(mesh, "pp"), zero3_mesh(mesh)
    dp_rank = dp.get_coordinate()[0] * dp.shape[-1] + dp.get_coordinate()[-1] if dp.ndim == 2 else dp.get_local_rank()
    dp_ranks = dp.size()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, V, (BATCH * dp_ranks // 2, SEQ), generator=g), torch.randint(
        0, V, (BATCH * dp_ranks // 2, SEQ), generator=g)
    torch.manual_seed(0)
    whole = TiedPair(V, D).to(torch.bfloat16 if bf16 else torch.float32)
    _loss(whole(x), y).backward()  # one device, plain torch: the reference gradients
    ref = {n: p.grad.clone() for n, p in whole.named_parameters()}
    mine = x.chunk(dp_ranks)[dp_rank], y.chunk(dp_ranks)[dp_rank]
    stage = TiedPairStage(whole, pp.get_local_rank()).to(whole.emb.weight.dtype)
    engine = PipeEngine({pp.get_local_rank(): stage}, pp, num_stages=2, num_microbatches=M, loss_fn=_loss,
                        schedule=schedule)
    precision = {"mp_policy": bf16_policy(), "master_dtype": torch.float32} if bf16 else {}
    engine.wrap_stages(lambda s, module: fully_shard_stage(
        module, mesh, reshard_after_forward=reshard_after_forward, **precision))
    engine.step(*mine)  # a first step, cleared as zero_grad(set_to_none=True) clears it: the checked step is second
    for p in engine.parameters():
        p.grad = None
    names = ("dp",) if "dp" in mesh.mesh_dim_names else ("dp_replicate", "dp_shard")
    with count_comms(mesh) as counter:
        engine.step(*mine)
    out = {"dp_comms": {n: dict(counter.dim_counts.get(n, {})) for n in names}, "errors": [], "checked": []}
    optimizer_params = {id(p) for p in engine.parameters()}
    for name, p in stage.named_parameters():
        held = stage.get_parameter(name)  # what the stage holds between steps: its dp shard, not the gathered weight
        if not (isinstance(held, DTensor) and Shard(0) in held.placements):
            out["errors"].append(f"{name} is held as {type(held).__name__} after the step, not a dp shard")
        if id(p) not in optimizer_params:
            out["errors"].append(f"{name}: the engine's parameters() lost the sharded parameter")
        if bf16 and not (isinstance(p, DTensor) and p.dtype == torch.float32
                         and torch.equal(p.full_tensor(), whole.get_parameter(name).float())):
            out["errors"].append(f"{name}: the master is {p.dtype}, not the bf16 init widened to fp32")
        if not (isinstance(p.grad, DTensor) and Shard(0) in p.grad.placements):
            out["errors"].append(f"{name}: its gradient is not a reduce-scattered dp shard")
            continue
        got = p.grad.full_tensor()
        if bf16:  # bf16 compute in another order: the bound (2**-5 of the norm) derived in test_train_matrix.py
            err = float((got - ref[name].float()).norm() / ref[name].float().norm())
            if got.dtype != torch.float32 or err > 2**-5:
                out["errors"].append(f"gradient of {name}: {got.dtype}, relative error {err:.3g} in norm")
        elif not torch.allclose(got, ref[name], rtol=1e-5, atol=1e-7):
            out["errors"].append(f"gradient of {name}: max error {(got - ref[name]).abs().max():.3g}, norm ratio "
                                 f"{float(got.norm() / ref[name].norm()):.6g}")
        out["checked"].append(name)
    return out


CELLS = [
    (4, "pp=2,dp=2", "1f1b", False, False),
    (4, "pp=2,dp=2", "gpipe", True, False),
    (8, "pp=2,dp_replicate=2,dp_shard=2", "1f1b", False, False),
    (4, "pp=2,dp=2", "1f1b", False, True),  # bf16 stages over fp32 masters
]


@pytest.mark.parametrize("world_size,mesh,schedule,reshard_after_forward,bf16", CELLS,
                         ids=[f"{m.replace(',', 'x').replace('=', '')}-{s}-reshard{int(r)}" + ("-bf16" if b else "")
                              for _, m, s, r, b in CELLS])
def test_zero3_stages_match_one_device_with_one_reduction_per_step(world_size, mesh, schedule, reshard_after_forward,
                                                                    bf16, ranks):
    results = ranks(_run, world_size, mesh, schedule, reshard_after_forward, bf16)
    checked = set()
    for rank, r in enumerate(results):
        assert not r["errors"], f"rank {rank}: {r['errors']}"
        checked |= set(r["checked"])
        for dim, comms in r["dp_comms"].items():
            # One reduction of the summed microbatch gradients per step, never one per microbatch (HSDP: the
            # reduce-scatter over dp_shard, then one all-reduce over dp_replicate; gathers only over dp_shard).
            want = {"reduce_scatter_tensor": 1} if dim != "dp_replicate" else {"all_reduce": 1}
            gathers = comms.pop("all_gather_into_tensor", 0)
            assert comms == want, f"rank {rank}: collectives over {dim} {r['dp_comms']}, expected {want} + gathers"
            if dim == "dp_replicate":
                assert gathers == 0, f"rank {rank}: {gathers} all-gathers over dp_replicate"
            elif not reshard_after_forward:
                assert gathers == 1, f"rank {rank}: {gathers} all-gathers over {dim} in one step, expected 1"
            else:  # gathered again for every forward (M) and for the backward after them
                assert gathers == M + 1, f"rank {rank}: {gathers} all-gathers over {dim} under gpipe, expected {M + 1}"
    assert checked == {"emb.weight", "l1.weight", "l1.bias", "l2.weight", "l2.bias"}


def _refused(schedule: str) -> str:
    from vescale.core.mesh import init_mesh, sub_mesh
    from vescale.parallel import fully_shard_stage
    from vescale.pipe import PipeEngine, PipeError

    mesh = init_mesh("pp=2,dp=2")
    pp = sub_mesh(mesh, "pp")
    torch.manual_seed(0)
    whole = TiedPair(V, D)
    stage = TiedPairStage(whole, pp.get_local_rank())
    engine = PipeEngine({pp.get_local_rank(): stage}, pp, num_stages=2, num_microbatches=M, loss_fn=_loss,
                        schedule=schedule)
    try:
        engine.wrap_stages(lambda s, module: fully_shard_stage(module, mesh))
    except PipeError as exc:
        return str(exc)
    return ""


def test_a_split_backward_schedule_is_refused_on_every_rank(ranks):
    for rank, message in enumerate(ranks(_refused, 4, "zb_h1")):
        assert "split backward (BI / BW)" in message and "'zb_h1'" in message, (rank, message)


def test_fp32_masters_of_a_stage_not_captured_in_the_compute_dtype_are_refused():
    """``master_dtype`` widens a stage captured in the compute dtype; a stage whose parameters are already fp32 (its
    graph captured in fp32) with a bf16 policy would hand that graph bf16 parameters: refused, naming a parameter,
    before the mesh is looked at (no collective)."""
    from vescale.parallel import fully_shard_stage
    from vescale.parallel.errors import Zero3Error
    from vescale.parallel.zero3 import bf16_policy

    stage = TiedPairStage(TiedPair(V, D), 0)
    with pytest.raises(Zero3Error, match=r"param_dtype is torch.bfloat16.*emb.weight \(torch.float32\)"):
        fully_shard_stage(stage, None, mp_policy=bf16_policy(), master_dtype=torch.float32)
