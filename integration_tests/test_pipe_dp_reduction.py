"""One dp gradient reduction for pipeline stages, ZeRO over stages, and a clip norm that counts a tied weight once.

A two-stage model whose embedding is tied to its output projection (stage 0 embeds, the last stage projects with the
same weight) runs on ``pp=2 x dp=2`` with each stage in its own ``DistributedDataParallel``
(``PipeEngine.wrap_stages``). Against the same model on one device, in plain torch: every gradient (the tied one is
the sum of both uses), the clip norm, and (ZeRO-2) the clipped update. The collectives over dp are the DDP buckets'
reductions only (no flat all-reduce beside them), and the norm without marking the tied copy counts it twice (what
``clip_grad_norm_(pp_group=...)`` returned before), which shows the model exercises the tie. The checked step is
the second, after the first's gradients were set to None. One cell has DTensor stages moved by ``.to()`` after
sharding, as ``vescale.plan.build_pipeline`` moves tp-sharded stages (see ``_run``).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from vescale.core.testing.models import TiedPair, TiedPairStage

V, D, SEQ, BATCH, M = 16, 8, 4, 8, 2  # vocab, width, sequence, global batch, microbatches per dp rank
MAX_NORM = 0.05  # below the norm, so clipping scales every gradient


def _loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, V), target.reshape(-1))


def _reference(x: torch.Tensor, y: torch.Tensor) -> tuple[TiedPair, dict, float, dict, dict]:
    """Plain torch on one device: model, gradients, clip norm, clipped gradients, params after one SGD(lr=1) step."""
    torch.manual_seed(0)
    whole = TiedPair(V, D)
    _loss(whole(x), y).backward()
    grads = {n: p.grad.clone() for n, p in whole.named_parameters()}
    norm = float(torch.nn.utils.clip_grad_norm_(whole.parameters(), MAX_NORM))
    clipped = {n: p.grad.clone() for n, p in whole.named_parameters()}
    stepped = {n: (p - p.grad).detach() for n, p in whole.named_parameters()}
    return whole, grads, norm, clipped, stepped


def _run(zero: int, dtensor_stages: bool = False) -> dict:
    """On each of 4 ranks (pp=2 x dp=2): one pipeline step with DDP stages; what the test compares.

    ``dtensor_stages``: each stage's parameters are DTensors (replicated over a tp dim of size 1) and the stage is
    then moved with ``.to()``, as ``vescale.plan.build_pipeline`` moves its tp-sharded stages. For DTensor parameters
    ``.to()`` swaps the tensors (``torch.utils.swap_tensors``), after which hooks added to a parameter's
    post-accumulate-grad dict never run: DDP stages then reduced nothing (zero gradients on pp x dp x tp)."""
    from vescale.core.comm import count_comms
    from vescale.core.mesh import init_mesh, sub_mesh
    from vescale.core.sharded_state import piece_of
    from vescale.parallel import (
        DDPOptions,
        DistributedDataParallel,
        DistributedOptimizer,
        clip_grad_norm_,
        parallelize_module,
    )
    from vescale.parallel.clip_grad import grad_norm
    from vescale.pipe import PipeEngine

    mesh = init_mesh("pp=2,dp=2,tp=1" if dtensor_stages else "pp=2,dp=2")
    pp, dp = sub_mesh(mesh, "pp"), sub_mesh(mesh, "dp")
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, V, (BATCH, SEQ), generator=g), torch.randint(0, V, (BATCH, SEQ), generator=g)
    whole, ref_grads, ref_norm, ref_clipped, ref_stepped = _reference(x, y)
    mine = x.chunk(2)[dp.get_local_rank()], y.chunk(2)[dp.get_local_rank()]
    stage = TiedPairStage(whole, pp.get_local_rank())
    if dtensor_stages:
        from torch.distributed.tensor import Replicate

        stage = parallelize_module(stage, sub_mesh(mesh, "tp"), {"parameter": {".*": [Replicate()]}}).to("cpu")
    engine = PipeEngine({pp.get_local_rank(): stage}, pp, num_stages=2, num_microbatches=M, loss_fn=_loss)
    ddps = []
    engine.wrap_stages(lambda s, module: ddps.append(DistributedDataParallel(module, dp, DDPOptions(zero_stage=zero)))
                       or ddps[-1])  # (the engine hands it the tied weight: vescale.pipe.StageGradSync)
    ddp = ddps[0]
    copies = engine.tied_copies()  # the engine marked them itself: left out of the norm, still clipped
    assert len(copies) == (1 if pp.get_local_rank() == 1 else 0), copies
    assert all(not piece_of(p).counts_in_norm for p in copies)
    engine.step(*mine)  # a first step, cleared as zero_grad(set_to_none=True) clears it: the checked step is the second
    for p in engine.parameters():  # (the tied sum must not subtract the first step's values still in DDP's buffer)
        p.grad = None
    ddp.zero_grad(set_to_none=True)  # (ZeRO-2 keeps reduced shards: only zero_grad clears them, as .grad on one device)
    with count_comms(mesh) as counter:
        engine.step(*mine)
        ddp.finish_grad_sync()  # a no-op: the engine finished it (counted if it were not)
    dp_comms = counter.dim_counts.get("dp", {})
    out = {"dp_comms": dict(dp_comms), "buckets": len(ddp.buckets), "errors": []}
    got = {n: _full(t) for n, t in ddp.reduced_grads().items()}
    for name, ref in ref_grads.items():
        if name in got and not torch.allclose(got[name], ref, rtol=1e-5, atol=1e-7):
            out["errors"].append(f"gradient of {name}: max error {(got[name] - ref).abs().max():.3g}")
    out["checked"] = sorted(set(got) & set(ref_grads))
    if zero == 0:
        # the norm without the tied mark: the tied weight once per stage holding it
        unmarked = [nn.Parameter(p.detach()) for p in engine.parameters()]
        for u, p in zip(unmarked, engine.parameters()):
            u.grad = p.grad.clone()
        out["unmarked_norm"] = float(grad_norm(unmarked, pp_group=pp.get_group()))
        out["norm"] = float(clip_grad_norm_(engine.parameters(), MAX_NORM, pp_group=pp.get_group()))
        for name, p in stage.named_parameters():
            if not torch.allclose(_full(p.grad), ref_clipped[name], rtol=1e-5, atol=1e-8):
                out["errors"].append(f"clipped gradient of {name} differs from one device's")
    else:
        opt = DistributedOptimizer(ddp, torch.optim.SGD, zero_stage=2, clip_grad=MAX_NORM, pp_group=pp.get_group(),
                                   lr=1.0)
        opt.step()
        out["norm"] = float(opt.grad_norm)
        for name, p in stage.named_parameters():
            if not torch.allclose(_full(p.detach()), ref_stepped[name], rtol=1e-5, atol=1e-7):
                out["errors"].append(f"{name} after the clipped ZeRO-2 step differs from one device's")
    out["ref_norm"] = ref_norm
    return out


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


@pytest.mark.parametrize("zero,dtensor_stages", [(0, False), (2, False), (0, True)],
                         ids=["zero0", "zero2", "zero0-dtensor-stages-moved"])
def test_pipeline_stages_in_ddp_match_one_device_and_clip_counts_tied_weights_once(zero, dtensor_stages, ranks):
    results = ranks(_run, 4, zero, dtensor_stages)
    checked = set()
    for rank, r in enumerate(results):
        assert not r["errors"], f"rank {rank}: {r['errors']}"
        checked |= set(r["checked"])
        # One dp reduction path: exactly one bucket collective per DDP bucket, nothing else over dp.
        want = {"all_reduce" if zero == 0 else "reduce_scatter_tensor": r["buckets"]}
        assert r["dp_comms"] == want, f"rank {rank}: collectives over dp {r['dp_comms']}, expected {want}"
        assert r["norm"] == pytest.approx(r["ref_norm"], rel=1e-5), (rank, r["norm"], r["ref_norm"])
        if zero == 0:
            # counted twice without the mark: the test model exercises the tie
            assert r["unmarked_norm"] > r["ref_norm"] * (1 + 1e-3), (rank, r["unmarked_norm"], r["ref_norm"])
    assert checked == {"emb.weight", "l1.weight", "l1.bias", "l2.weight", "l2.bias"}
