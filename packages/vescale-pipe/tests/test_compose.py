"""Composition on 4 ranks: pp x dp (stage replicas average gradients) and pp x tp (stages whose parameters are TP
DTensors, built by hand: the user-given-stages path; the last stage's head returns a replicated DTensor).
References are the single-device model with the same microbatch accumulation; compared with a tolerance (fp32,
rtol 1e-5) because DP averaging and TP partial sums add in another order than one device does.
"""

from __future__ import annotations

import torch
from torch import nn

from vescale.core.testing import multi_rank
from vescale.core.testing.reference import reference_gradients

MB, T, VOCAB = 2, 8, 64


class HandStage(nn.Module):
    """Layers ``lo..hi-1`` of a GPT (plus the embedding on the first, norm and head on the last), FQNs kept."""

    def __init__(self, model, lo: int, hi: int, first: bool, last: bool) -> None:
        super().__init__()
        self.first, self.last = first, last
        if first:
            self.embed = model.embed
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in range(lo, hi)})
        if last:
            self.norm, self.lm_head = model.norm, model.lm_head
        self.register_buffer("inv_freq", model.inv_freq, persistent=False)

    def forward(self, x):
        from vescale.core.testing.models import GPT

        if self.first:
            x = self.embed(x)
        cos, sin = GPT.rotary(self, x.shape[1], x.device)
        for layer in self.layers.values():
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x)) if self.last else x


@multi_rank(world_sizes=[4])
def test_pp_x_dp(gpt_pipeline):
    import torch.distributed as dist

    from vescale.core.mesh import init_mesh, mesh_coordinates
    from vescale.core.testing.models import cross_entropy
    from vescale.pipe import PipeEngine

    model, stages_by_count = gpt_pipeline
    mesh = init_mesh({"pp": 2, "dp": 2})
    dp = mesh_coordinates(mesh)["dp"]
    M = 2
    g = torch.Generator().manual_seed(11)
    x = torch.randint(0, VOCAB, (2 * M * MB, T), generator=g)
    y = torch.randint(0, VOCAB, (2 * M * MB, T), generator=g)
    losses, ref = reference_gradients(model, x, y, 2 * M)  # one device: all 2M microbatches
    mine = slice(dp * M * MB, (dp + 1) * M * MB)  # this replica's half of the global batch
    for name in ("1f1b", "zb_h1"):
        engine = PipeEngine(stages_by_count[2], mesh, schedule=name, num_microbatches=M, loss_fn=cross_entropy)
        assert engine.dp_group is not None and dist.get_world_size(engine.dp_group) == 2
        loss = engine.step(x[mine], y[mine])
        assert torch.equal(loss, torch.stack(losses[dp * M:(dp + 1) * M]).mean())
        for stage in engine.stages.values():
            for n, p in stage.named_parameters():
                torch.testing.assert_close(p.grad, ref[n], rtol=1e-5, atol=1e-7,
                                           msg=lambda m, name=name, n=n: f"{name}: {n}: {m}")
            stage.zero_grad(set_to_none=True)


@multi_rank(world_sizes=[4])
def test_pp_x_tp_with_hand_built_stages():
    import copy

    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from vescale.core.mesh import init_mesh, mesh_coordinates
    from vescale.core.testing.models import GPT, GPTConfig, cross_entropy
    from vescale.pipe import PipeEngine

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=VOCAB, d_model=32, n_layer=2, n_head=4, n_kv_head=2, max_seq_len=16))
    reference = copy.deepcopy(model)
    mesh = init_mesh({"pp": 2, "tp": 2})
    pp = mesh_coordinates(mesh)["pp"]
    stage = HandStage(model, pp, pp + 1, first=pp == 0, last=pp == 1)
    plan = {f"layers.*.attn.{w}": ColwiseParallel() for w in ("wq", "wk", "wv")}
    plan |= {"layers.*.attn.wo": RowwiseParallel(), "layers.*.mlp.w_gate": ColwiseParallel(),
             "layers.*.mlp.w_up": ColwiseParallel(), "layers.*.mlp.w_down": RowwiseParallel()}
    if pp == 1:  # the head returns a replicated DTensor: the engine turns the logits' loss into a plain tensor
        from torch.distributed.tensor import Replicate

        plan["lm_head"] = ColwiseParallel(output_layouts=Replicate(), use_local_output=False)
    parallelize_module(stage, mesh["tp"], plan)
    assert isinstance(stage.get_parameter(f"layers.{pp}.attn.wq.weight"), DTensor)
    M = 2
    g = torch.Generator().manual_seed(5)
    x = torch.randint(0, VOCAB, (M * MB, T), generator=g)
    y = torch.randint(0, VOCAB, (M * MB, T), generator=g)
    losses, ref = reference_gradients(reference, x, y, M)
    stages = [stage, None] if pp == 0 else [None, stage]
    for name in ("1f1b", "zb_h1"):
        engine = PipeEngine(stages, mesh, schedule=name, num_microbatches=M, loss_fn=cross_entropy)
        loss = engine.step(x, y)
        torch.testing.assert_close(loss, torch.stack(losses).mean(), rtol=1e-6, atol=0)
        for n, p in stage.named_parameters():
            grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            torch.testing.assert_close(grad, ref[n], rtol=1e-5, atol=1e-7,
                                       msg=lambda m, name=name, n=n: f"{name}: {n}: {m}")
        stage.zero_grad(set_to_none=True)


class AveragingStage(nn.Module):
    """A stand-in dp reducer in plain torch (nothing of vescale): implements :class:`vescale.pipe.StageGradSync` and
    records how the engine drives it. ``finish_grad_sync`` averages every gradient over ``group`` (one all-reduce)."""

    split_backward = True

    def __init__(self, stage: nn.Module, group) -> None:
        super().__init__()
        self.module, self.group = stage, group
        self.events: list = []
        self.late: list = []
        self.tied_at_finish: list = []

    def forward(self, *args):
        return self.module(*args)

    def no_sync(self):
        import contextlib

        self.events.append("no_sync")
        return contextlib.nullcontext()

    def defer_grad_sync(self, late) -> None:
        self.events.append("defer")
        self.late = list(late)

    def finish_grad_sync(self) -> None:
        import torch.distributed as dist

        self.events.append("finish")
        self.tied_at_finish = [p.grad.clone() for p in self.late]
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.group)
        flat /= dist.get_world_size(self.group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


@multi_rank(world_sizes=[4])
def test_stage_grad_sync_protocol_is_all_the_engine_needs(gpt_pipeline):
    """pp2 x dp2, 1F1B, 2 microbatches: a plain-torch stand-in reducer satisfying ``StageGradSync`` gets the stage's
    tied weight once (``defer_grad_sync``), runs the first of its two backwards under ``no_sync`` and finishes once
    per step after the tied sum over pp (its tied gradient is then the same on both pp ranks); the engine's own flat
    dp all-reduce skips it (one all-reduce over dp a step: the stand-in's). Gradients equal one device's. A wrapper
    with only part of the protocol, or a ``wrap`` taking the old third argument, is refused on every rank."""
    import pytest
    import torch.distributed as dist

    from vescale.core.comm import count_comms
    from vescale.core.mesh import init_mesh, mesh_coordinates
    from vescale.core.testing.models import cross_entropy
    from vescale.pipe import PipeEngine, PipeError, StageGradSync

    model, stages_by_count = gpt_pipeline
    mesh = init_mesh({"pp": 2, "dp": 2})
    at = mesh_coordinates(mesh)
    M = 2
    g = torch.Generator().manual_seed(5)
    x = torch.randint(0, VOCAB, (2 * M * MB, T), generator=g)
    y = torch.randint(0, VOCAB, (2 * M * MB, T), generator=g)
    _, ref = reference_gradients(model, x, y, 2 * M)
    mine = slice(at["dp"] * M * MB, (at["dp"] + 1) * M * MB)
    engine = PipeEngine(stages_by_count[2], mesh, schedule="1f1b", num_microbatches=M, loss_fn=cross_entropy)
    dp_group = engine.dp_group
    wrapped = []
    engine.wrap_stages(lambda s, stage: wrapped.append(AveragingStage(stage, dp_group)) or wrapped[-1])
    (reducer,) = wrapped
    assert isinstance(reducer, StageGradSync)
    tied = engine.tied_parameters(at["pp"])
    assert len(tied) == 1 and reducer.late == tied and reducer.events == ["defer"]
    with count_comms(mesh) as counter:
        engine.step(x[mine], y[mine])
    assert reducer.events == ["defer", "no_sync", "finish"], reducer.events
    assert counter.dim_counts["dp"] == {"all_reduce": 1}, counter.dim_counts
    both = [torch.empty_like(reducer.tied_at_finish[0]) for _ in range(2)]
    dist.all_gather(both, reducer.tied_at_finish[0], group=mesh.get_group("pp"))
    assert torch.equal(both[0], both[1])  # finished after the tied sum over pp
    stage = reducer.module
    for n, p in stage.named_parameters():
        torch.testing.assert_close(p.grad, ref[n], rtol=1e-5, atol=1e-7, msg=lambda m, n=n: f"{n}: {m}")
    stage.zero_grad(set_to_none=True)

    class HalfReducer(nn.Module):  # no_sync and finish_grad_sync, as before StageGradSync, but no defer_grad_sync
        split_backward = True

        def __init__(self, stage: nn.Module) -> None:
            super().__init__()
            self.module = stage

        def no_sync(self):
            raise AssertionError("never driven")

        def finish_grad_sync(self) -> None:
            raise AssertionError("never driven")

    half = PipeEngine(stages_by_count[2], mesh, schedule="1f1b", num_microbatches=M, loss_fn=cross_entropy)
    with pytest.raises(PipeError, match=r"has .* but not \['defer_grad_sync'\] of vescale.pipe.StageGradSync"):
        half.wrap_stages(lambda s, stage: HalfReducer(stage))
    with pytest.raises(PipeError, match=r"wrap\(index, stage\)"):
        half.wrap_stages(lambda s, stage, late: stage)
