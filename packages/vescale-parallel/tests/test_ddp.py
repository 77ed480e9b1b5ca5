"""DDP and ZeRO 1/2 train like one device: 20 AdamW steps of a nanoGPT-style GPT against the single-process run.

Reference: the unmodified model trained on one process over the whole global batch. Comparisons use tolerances
(reductions change the summation order): fp32 losses relative 1e-5 per step, final weights ``allclose``.
"""

from __future__ import annotations

import pytest

from vescale.core.testing import multi_rank
from vescale.core.testing.reference import (
    data_parallel_training,
    one_thread,
    progression_batch,
    reference_training,
    single_threaded,
)

STEPS = 20
BATCH, SEQ = 8, 16
LR = 3e-3


def _cfg():
    from vescale.core.testing.models import GPTConfig

    return GPTConfig(vocab_size=64, d_model=32, n_layer=2, n_head=4, n_kv_head=2, max_seq_len=SEQ)


def _model(seed: int = 0):
    import torch

    from vescale.core.testing.models import GPT

    torch.manual_seed(seed)
    return GPT(_cfg())


def _batch(step: int):
    # Arithmetic progressions mod 64 with a random start and stride: learnable, so the loss really falls.
    return progression_batch(1000 + step, BATCH, SEQ, 64)


def _adamw(params):
    import torch

    return torch.optim.AdamW(params, lr=LR, weight_decay=0.1)


def _train(model, opt, dp_rank: int, dp: int, steps: int = STEPS, accum: int = 1, after_step=None, autocast=None):
    """Train on this dp rank's rows of each global batch; return the dp-mean loss per step."""
    return data_parallel_training(model, opt, _batch, steps, dp_rank=dp_rank, dp=dp, dp_group=model.dp_group,
                                  accum=accum, after_step=after_step, autocast=autocast)


@pytest.fixture(scope="module")
def ref():
    """The single-device runs (:func:`reference_training`), computed once in the pytest process, sent to the ranks."""
    with one_thread():
        return {"plain": reference_training(_model, _batch, _adamw, STEPS),
                "clip": reference_training(_model, _batch, _adamw, STEPS, clip=0.5)}


def _assert_close_curve(got, want, rel=1e-5, what=""):
    for step, (g, w) in enumerate(zip(got, want)):
        assert abs(g - w) <= rel * abs(w), f"{what} step {step}: loss {g!r} vs single device {w!r}"


def _assert_weights(model, ref_state, what="", rtol=1e-4, atol=1e-5):
    import torch
    from torch.distributed.tensor import DTensor

    for k, v in model.state_dict().items():
        full = v.full_tensor() if isinstance(v, DTensor) else v
        torch.testing.assert_close(full, ref_state[k], rtol=rtol, atol=atol, msg=lambda m, k=k: f"{what} {k}: {m}")


@multi_rank(world_sizes=[1, 2, 4])
@single_threaded
def test_ddp_and_zero_match_single_device(world_size, ref):
    """dp in {1,2,4}: ZeRO 0 (plain AdamW on DDP grads), 1, 2 (+ clipping), and 2-way grad accumulation."""
    import torch
    import torch.distributed as dist

    from vescale.core.mesh import init_mesh
    from vescale.parallel import DDPOptions, DistributedDataParallel, DistributedOptimizer

    ref_losses, _, ref_state = ref["plain"]
    clip_losses, clip_norms, clip_state = ref["clip"]
    mesh = init_mesh({"dp": world_size})
    rank = dist.get_rank()
    full_state_bytes = 2 * 4 * sum(p.numel() for p in _model().parameters())  # AdamW: exp_avg + exp_avg_sq fp32

    # ZeRO 0: DDP + an unmodified torch AdamW; tiny buckets so there are many, reduced during backward.
    model = DistributedDataParallel(_model(), mesh, DDPOptions(bucket_size_mb=0.004))
    assert len(model.buckets) > 3
    launched_before_end = []
    end_of_backward = model._end_of_backward

    def spy():  # how many buckets were already reduced when autograd finished: the overlap
        launched_before_end.append(model._next_launch)
        end_of_backward()

    model._end_of_backward = spy
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    _assert_close_curve(_train(model, opt, rank, world_size), ref_losses, what="zero0")
    _assert_weights(model, ref_state, "zero0")
    assert len(launched_before_end) == STEPS and min(launched_before_end) >= len(model.buckets) - 1

    # ZeRO 0 with grad accumulation (no_sync) and overlap off.
    model = DistributedDataParallel(_model(), mesh, DDPOptions(bucket_size_mb=0.004, overlap=False))
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    _assert_close_curve(_train(model, opt, rank, world_size, accum=2), ref_losses, what="zero0+accum")
    _assert_weights(model, ref_state, "zero0+accum")

    for stage, accum, clip in ((1, 1, 0.5), (2, 2, 0.5), (2, 1, None)):
        if True:
            what = f"zero{stage} accum={accum} clip={clip}"
            model = DistributedDataParallel(_model(), mesh, DDPOptions(bucket_size_mb=0.004, zero_stage=stage))
            opt = DistributedOptimizer(model, torch.optim.AdamW, zero_stage=stage, clip_grad=clip, lr=LR,
                                       weight_decay=0.1)
            norms = []
            losses = _train(model, opt, rank, world_size, accum=accum,
                            after_step=lambda o=opt, n=norms: n.append(o.grad_norm))
            _assert_close_curve(losses, clip_losses if clip else ref_losses, what=what)
            _assert_weights(model, clip_state if clip else ref_state, what)
            if clip:
                torch.testing.assert_close(torch.stack(norms), torch.tensor(clip_norms), rtol=1e-5, atol=0)
            # Optimizer states: counted from the tensors; all ranks together hold exactly the full state, each
            # rank 1/dp of it up to bucket padding (< dp elements per bucket).
            held = [None] * world_size
            dist.all_gather_object(held, opt.state_bytes())
            assert sum(held) == full_state_bytes, (what, held, full_state_bytes)
            slack = 2 * 4 * world_size * len(model.buckets)
            assert max(held) <= full_state_bytes / world_size + slack, (what, held)
            assert opt.master_bytes() == 0  # fp32 params: masters are views of the parameters


@multi_rank(world_sizes=[2])
@single_threaded
def test_zero_state_dict_round_trip_and_layout(world_size, ref):
    """Save ZeRO-1 state at step 10, load into fresh objects, finish: same losses and weights as 20 steps straight."""
    import torch
    import torch.distributed as dist

    from vescale.core.mesh import init_mesh
    from vescale.dtensor import RaggedShard
    from vescale.parallel import DDPOptions, DistributedDataParallel, DistributedOptimizer, ZeroError

    ref_losses, _, ref_state = ref["plain"]
    mesh = init_mesh({"dp": world_size})
    rank = dist.get_rank()

    model = DistributedDataParallel(_model(), mesh, DDPOptions(bucket_size_mb=0.004, zero_stage=1))
    opt = DistributedOptimizer(model, torch.optim.AdamW, lr=LR, weight_decay=0.1)
    first = _train(model, opt, rank, world_size, steps=10)
    sd = opt.state_dict()
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    # The layout: every parameter's flattened local tensor is covered by the dp ranks' ranges, in order, no gaps.
    for fqn, info in sd["shards"].items():
        numel = torch.Size(info["local_shape"]).numel()
        spans = [r for r in info["ranges"] if r[1] > r[0]]
        assert spans[0][0] == 0 and spans[-1][1] == numel, (fqn, info)
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:])), (fqn, info)
        # The same layout as a vescale RaggedShard of the flattened tensor over dp.
        assert info["placement"] == RaggedShard((0,), [b - a for a, b in info["ranges"]]), (fqn, info)
        assert [list(info["placement"].local_range((numel,), r)) for r in range(world_size)] == info["ranges"]
        lo, hi = info["ranges"][rank]
        if hi > lo:
            assert sd["state"][fqn]["exp_avg"].numel() == hi - lo
    assert sd["dp_size"] == world_size and sd["param_groups"][0]["lr"] == LR

    torch.manual_seed(123)  # a different init, overwritten by the loaded weights and state
    fresh = _model(seed=7)
    fresh.load_state_dict(weights)
    model2 = DistributedDataParallel(fresh, mesh, DDPOptions(bucket_size_mb=0.004, zero_stage=1))
    opt2 = DistributedOptimizer(model2, torch.optim.AdamW, lr=1.0, weight_decay=0.0)
    opt2.load_state_dict(sd)
    assert opt2.param_groups[0]["lr"] == LR
    second = data_parallel_training(model2, opt2, _batch, 10, first_step=10, dp_rank=rank, dp=world_size)
    _assert_close_curve(first + second, ref_losses, what="resumed")
    _assert_weights(model2, ref_state, "resumed")

    # A different bucket layout is refused, naming the parameter.
    model3 = DistributedDataParallel(_model(), mesh, DDPOptions(bucket_size_mb=1, zero_stage=1))
    opt3 = DistributedOptimizer(model3, torch.optim.AdamW, lr=LR)
    with pytest.raises(ZeroError, match="reshard with vescale-checkpoint"):
        opt3.load_state_dict(sd)


@multi_rank(world_sizes=[2])
@single_threaded
def test_bf16_params_with_fp32_master_converge_like_fp32(world_size, ref):
    """bf16 params/compute, fp32 grads and master weights (ZeRO 2): the loss curve stays within 2% of fp32."""
    import torch
    import torch.distributed as dist

    from vescale.core.mesh import init_mesh
    from vescale.parallel import DDPOptions, DistributedDataParallel, DistributedOptimizer

    ref_losses, _, ref_state = ref["plain"]
    mesh = init_mesh({"dp": world_size})
    options = DDPOptions(zero_stage=2, grad_dtype=torch.float32)
    model = DistributedDataParallel(_model().to(torch.bfloat16), mesh, options)
    opt = DistributedOptimizer(model, torch.optim.AdamW, zero_stage=2, lr=LR, weight_decay=0.1)
    assert all(pc.master.dtype == torch.float32 for pc in opt.pieces.values())
    assert opt.master_bytes() > 0
    # The GPT's rotary tables are fp32; autocast keeps every matmul in bf16.
    losses = _train(model, opt, dist.get_rank(), world_size, autocast=torch.bfloat16)
    # bf16 forward/backward: ~3 significant digits per op; 2% per step bounds the drift over 20 steps here.
    _assert_close_curve(losses, ref_losses, rel=2e-2, what="bf16")
    assert losses[-1] < losses[0] - 0.05  # it does learn
    # Weights stay bf16 and track the fp32 run: per tensor, |w_bf16 - w_fp32| <= 5% of |w_fp32| (Frobenius).
    for k, v in model.state_dict().items():
        assert v.dtype == torch.bfloat16, k
        err = ((v.float() - ref_state[k]).norm() / ref_state[k].norm()).item()
        assert err <= 0.05, (k, err)


@multi_rank(world_sizes=[1])
def test_bad_input_raises_clear_errors():
    import torch

    from vescale.core.mesh import init_mesh
    from vescale.parallel import DDPError, DDPOptions, DistributedDataParallel, DistributedOptimizer, ZeroError

    mesh = init_mesh({"dp": 1, "tp": 1})
    with pytest.raises(DDPError, match="zero_stage must be 0, 1 or 2.*fully_shard"):
        DistributedDataParallel(_model(), mesh, DDPOptions(zero_stage=3))
    with pytest.raises(DDPError, match=r"dimensions \['pp', 'tp'\].*'dp' dimension"):
        DistributedDataParallel(_model(), init_mesh({"pp": 1, "tp": 1}))
    with pytest.raises(DDPError, match="DeviceMesh or ProcessGroup, got str"):
        DistributedDataParallel(_model(), "dp")
    model = _model()
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().t().contiguous().t())
    with pytest.raises(DDPError, match="lm_head.weight.*not contiguous"):
        DistributedDataParallel(model, mesh)
    ddp = DistributedDataParallel(_model(), mesh, DDPOptions(zero_stage=1))
    with pytest.raises(ZeroError, match="needs a vescale.parallel.DistributedDataParallel"):
        DistributedOptimizer(_model(), torch.optim.AdamW)
    with pytest.raises(ZeroError, match=r"zero_stage=2\) needs a DistributedDataParallel with zero_stage=2, got .*=1"):
        DistributedOptimizer(ddp, torch.optim.AdamW, zero_stage=2)
    with pytest.raises(ZeroError, match="LBFGS is not elementwise"):
        DistributedOptimizer(ddp, torch.optim.LBFGS)
    with pytest.raises(ZeroError, match="the module comes first"):
        DistributedOptimizer(torch.optim.AdamW, ddp)


class _TwoLayer:
    """Module factory kept at module level (ranks import it): Linear -> Linear, plus an unused Linear."""

    @staticmethod
    def make(dtype):
        import torch

        torch.manual_seed(0)
        model = torch.nn.ModuleDict({"a": torch.nn.Linear(6, 5), "b": torch.nn.Linear(5, 3),
                                     "unused": torch.nn.Linear(2, 2)})
        return model.to(dtype)


def _two_layer_loss(model, x):
    import torch

    return model["b"](torch.tanh(model["a"](x))).square().mean()


@multi_rank(world_sizes=[2])
def test_low_precision_grad_semantics_match_single_device(world_size):
    """bf16 params + fp32 grad buffer, ZeRO 0: .grad accumulates across backwards and clears like on one device;
    an unused parameter gets a zero gradient. Reference: fp32 single-device gradients (tolerance: bf16, 2e-2)."""
    import torch
    import torch.distributed as dist

    from vescale.core.mesh import init_mesh
    from vescale.parallel import DistributedDataParallel

    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(5))
    ref = _TwoLayer.make(torch.float32)
    _two_layer_loss(ref, x).backward()
    want = {n: p.grad.clone() for n, p in ref.named_parameters() if p.grad is not None}

    model = DistributedDataParallel(_TwoLayer.make(torch.bfloat16), init_mesh({"dp": 2}))
    rows = x[dist.get_rank() * 4:(dist.get_rank() + 1) * 4].bfloat16()

    def check(scale):
        for n, p in model.module.named_parameters():
            assert p.grad is not None and p.grad.dtype == torch.bfloat16, n
            expect = want.get(n, torch.zeros_like(p, dtype=torch.float32)) * scale
            torch.testing.assert_close(p.grad.float(), expect, rtol=2e-2, atol=2e-3, msg=lambda m, n=n: f"{n}: {m}")

    _two_layer_loss(model.module, rows).backward()
    check(1)
    _two_layer_loss(model.module, rows).backward()  # no zero_grad: gradients add up, as on one device
    check(2)
    for p in model.parameters():
        p.grad = None  # what torch.optim's zero_grad() does
    _two_layer_loss(model.module, rows).backward()
    check(1)


def test_removed_keywords_are_refused_naming_their_new_spelling():
    """The pipeline's and expert parallelism's old keywords (and the options as keywords) are not in the signature;
    passing one raises DDPError naming what replaced it, before any process group or collective is needed."""
    import inspect

    import torch

    from vescale.parallel import DDPError, DDPOptions, DistributedDataParallel

    assert list(inspect.signature(DistributedDataParallel.__init__).parameters) == [
        "self", "module", "mesh", "options", "removed"]
    model = torch.nn.Linear(2, 2)
    cases = {"late_params": ([], r"late_params= is gone: .*ddp\.defer_grad_sync\(params\)"),
             "wait_in_backward": (False, r"wait_in_backward= is gone: ddp\.defer_grad_sync\(\(\)\)"),
             "data_dims": (("ep",), r"data_dims= is gone: pass the mesh with those dims"),
             "local_shards": ({}, r"local_shards= is gone: .*mark_piece\(p, groups="),
             "zero_stage": (2, r"zero_stage=2 is an option: pass DistributedDataParallel\(module, mesh, "
                               r"DDPOptions\(zero_stage=2\)\)")}
    for name, (value, message) in cases.items():
        with pytest.raises(DDPError, match=message):
            DistributedDataParallel(model, None, **{name: value})
    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) \['bucket_mb'\]"):
        DistributedDataParallel(model, None, bucket_mb=1)
    with pytest.raises(DDPError, match="bucket_size_mb must be positive, got 0"):
        DDPOptions(bucket_size_mb=0)
    assert DDPOptions(zero_stage=2) == DDPOptions(zero_stage=2) != DDPOptions()
    ddp = DistributedDataParallel(model, None, DDPOptions(grad_dtype=None))  # one data rank: no process group needed
    assert ddp.options.grad_dtype is None and ddp.grad_buffers[0].data.dtype == torch.float32
    ddp.defer_grad_sync([model.weight])  # the tied weight gets its own trailing bucket, reduced in finish_grad_sync
    assert [[s.fqn for s in b.slots] for b in ddp.buckets] == [["bias"], ["weight"]]
    ddp(torch.ones(1, 2)).sum().backward()
    ddp.finish_grad_sync()
    assert torch.equal(model.weight.grad, torch.ones(2, 2)) and torch.equal(model.bias.grad, torch.ones(2))
    with pytest.raises(DDPError, match="before the first backward"):
        ddp.defer_grad_sync()
