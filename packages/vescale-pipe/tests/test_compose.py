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
