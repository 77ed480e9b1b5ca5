"""DDP and ZeRO 1/2/3 composed with tensor parallelism on a 2-D (dp=2, tp=2) mesh: 20 AdamW steps vs one device.

TP parameters are DTensors sharded over ``tp`` (Megatron column/row split of attention and MLP, built with torch's
``parallelize_module`` or vescale's with sequence parallelism); DDP reduces their local shards over ``dp`` only.
Reference: the unmodified GPT on one process over the whole batch. Tolerances: losses relative 1e-5 per step; final
full weights ``allclose``.
"""

from __future__ import annotations

import contextlib

import pytest

from vescale.core.testing import multi_rank, reference

STEPS = 20
BATCH, SEQ = 8, 16
LR = 3e-3


def _model(seed: int = 0):
    import torch

    from vescale.core.testing.models import GPT, GPTConfig

    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=64, d_model=32, n_layer=2, n_head=4, n_kv_head=2, max_seq_len=SEQ))


def _batch(step: int):
    return reference.progression_batch(2000 + step, BATCH, SEQ, 64)


def _adamw(params):
    import torch

    return torch.optim.AdamW(params, lr=LR, weight_decay=0.1)


@pytest.fixture(scope="module")
def ref():
    """The single-device runs (:func:`reference_training`) of the whole batch, without and with clipping."""
    with reference.one_thread():
        return {"plain": reference.reference_training(_model, _batch, _adamw, STEPS),
                "clip": reference.reference_training(_model, _batch, _adamw, STEPS, clip=0.5)}


def _tensor_parallel(model, tp_mesh):
    """Megatron TP of the GPT with torch's own parallelize_module (column-parallel in, row-parallel out)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {}
    for i in range(len(model.layers)):
        for name in ("attn.wq", "attn.wk", "attn.wv", "mlp.w_gate", "mlp.w_up"):
            plan[f"layers.{i}.{name}"] = ColwiseParallel()
        for name in ("attn.wo", "mlp.w_down"):
            plan[f"layers.{i}.{name}"] = RowwiseParallel()
    return parallelize_module(model, tp_mesh, plan)


@multi_rank(world_sizes=[4])
@reference.single_threaded
def test_dp_x_tp_matches_single_device(world_size, ref):
    """dp=2 x tp=2: ZeRO 0 (+ grad accumulation), ZeRO 1 (+ clipping), ZeRO 2 (+ accumulation and clipping)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from vescale.core.mesh import init_mesh, mesh_coordinates
    from vescale.parallel import DDPOptions, DistributedDataParallel, DistributedOptimizer, gpt_plan, parallelize_module

    mesh = init_mesh({"dp": 2, "tp": 2})
    dp_rank = mesh_coordinates(mesh)["dp"]
    full_numel = sum(p.numel() for p in _model().parameters())

    # (ZeRO stage, micro-batches, clip, TP by): torch's parallelize_module, or vescale's with sequence parallelism.
    for stage, accum, clip, tp_by in ((0, 2, None, "torch"), (1, 1, 0.5, "torch"), (2, 2, 0.5, "vescale+SP")):
        what = f"dp2xtp2 zero{stage} accum={accum} clip={clip} tp={tp_by}"
        if tp_by == "torch":
            tp_model = _tensor_parallel(_model(), mesh["tp"])
        else:
            tp_model = parallelize_module(_model(), mesh["tp"], gpt_plan(mesh["tp"], dp=None, sequence_parallel=True))
        model = DistributedDataParallel(tp_model, mesh, DDPOptions(bucket_size_mb=0.004, zero_stage=stage))
        assert isinstance(model.module.layers[0].attn.wq.weight, DTensor)
        if stage == 0:
            opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1, foreach=False)
        else:
            opt = DistributedOptimizer(model, torch.optim.AdamW, zero_stage=stage, clip_grad=clip, lr=LR,
                                       weight_decay=0.1)
        norms = []
        losses = reference.data_parallel_training(
            model, opt, _batch, STEPS, dp_rank=dp_rank, dp=2, dp_group=model.dp_group, accum=accum,
            after_step=(lambda o=opt, n=norms: n.append(o.grad_norm.item())) if clip is not None else None)
        want_losses, want_norms, want_state = ref["clip" if clip else "plain"]
        for step, (g, w) in enumerate(zip(losses, want_losses)):
            assert abs(g - w) <= 1e-5 * abs(w), f"{what} step {step}: loss {g} vs single device {w}"
        if clip is not None:
            torch.testing.assert_close(torch.tensor(norms), torch.tensor(want_norms), rtol=1e-5, atol=0)
        for k, v in model.state_dict().items():
            full = v.full_tensor() if isinstance(v, DTensor) else v
            torch.testing.assert_close(full, want_state[k], rtol=1e-4, atol=1e-5,
                                       msg=lambda m, k=k, what=what: f"{what} {k}: {m}")
        if stage:
            # Each rank holds 1/dp of the AdamW states of its tp-local parameters. Over all 4 ranks that is every
            # tp-sharded element once and every tp-replicated (plain) parameter once per tp rank.
            held = [None] * world_size
            dist.all_gather_object(held, opt.state_bytes())
            replicated = sum(p.numel() for p in model.parameters()
                             if not isinstance(p, DTensor) or all(pl.is_replicate() for pl in p.placements))
            assert sum(held) == 2 * 4 * (full_numel + replicated), (what, held)


@multi_rank(world_sizes=[2, 4])
@reference.single_threaded
def test_zero3_fully_shard_recipe_matches_single_device(world_size, ref):
    """ZeRO 3 = fully_shard_dp (torch FSDP2 on the dp sub-mesh): dp=2, and dp=2 x tp=2; grad accumulation + clipping.

    Optimizer states held per rank are 1/dp of the (tp-local) whole, counted from the AdamW state tensors.
    """
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from vescale.core.mesh import init_mesh, mesh_coordinates
    from vescale.parallel import clip_grad_norm_, fully_shard_dp

    tp = world_size // 2
    mesh = init_mesh({"dp": 2, "tp": tp})
    dp_rank = mesh_coordinates(mesh)["dp"]
    model = _model()
    if tp > 1:
        model = _tensor_parallel(model, mesh["tp"])
    tp_sharded = {n for n, p in model.named_parameters() if isinstance(p, DTensor)}
    model = fully_shard_dp(model, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    norms = []

    def sync(last: bool):  # FSDP2's gradient accumulation: reduce-scatter only on the last microbatch
        model.set_requires_gradient_sync(last)
        return contextlib.nullcontext()

    losses = reference.data_parallel_training(
        model, opt, _batch, STEPS, dp_rank=dp_rank, dp=2, dp_group=mesh["dp"].get_group(), accum=2, sync=sync,
        before_step=lambda: norms.append(clip_grad_norm_(model.parameters(), 0.5).item()))
    want_losses, want_norms, want_state = ref["clip"]
    for step, (g, w) in enumerate(zip(losses, want_losses)):
        assert abs(g - w) <= 1e-5 * abs(w), f"zero3 tp={tp} step {step}: loss {g} vs single device {w}"
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(want_norms), rtol=1e-5, atol=0)
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v.full_tensor(), want_state[k], rtol=1e-4, atol=1e-5,
                                   msg=lambda m, k=k: f"zero3 tp={tp} {k}: {m}")
    held = sum(t.to_local().numel() * t.element_size() for st in opt.state.values() for t in st.values()
               if isinstance(t, DTensor))
    every = [None] * world_size
    dist.all_gather_object(every, held)
    numel = {n: p.numel() for n, p in _model().named_parameters()}
    want = 2 * 4 * sum(n if name in tp_sharded else n * tp for name, n in numel.items())
    assert sum(every) == want, (every, want)
    assert max(every) <= 2 * 4 * sum(numel.values()) / 2  # each rank: at most 1/dp of the full AdamW state
