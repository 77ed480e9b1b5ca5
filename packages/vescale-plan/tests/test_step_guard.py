"""Bad steps: a NaN in one rank's gradient makes every rank skip the update (``make_optimizer(skip_nonfinite=True)``,
vescale.parallel.StepGuard), on a plain optimizer over DDP, over DDP x tp, ZeRO 1 (DistributedOptimizer) and ZeRO 3
(FSDP2). The state after the bad step equals the state before it bitwise, and the next good step equals one
device's run of the good batches only."""

from __future__ import annotations

import pytest

from vescale.core.testing import run_on_ranks

CASES = [(2, {"mesh": {"dp": 2}}), (4, {"mesh": {"dp": 2, "tp": 2}, "tp_plan": "gpt"}),
         (2, {"mesh": {"dp": 2}, "zero": 1}), (2, {"mesh": {"dp": 2}, "zero": 3})]
B, T, VOCAB, LR, CLIP = 4, 8, 64, 1e-2, 0.5


def _local_copies(obj) -> list:
    """Every tensor in ``obj`` (nested dicts/lists; DTensors as their local shards), cloned, in a fixed order."""
    from torch.distributed.tensor import DTensor

    if isinstance(obj, DTensor):
        return [obj.to_local().detach().clone()]
    if hasattr(obj, "detach"):
        return [obj.detach().clone()]
    if isinstance(obj, dict):
        return [t for k in sorted(obj, key=str) for t in _local_copies(obj[k])]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _local_copies(v)]
    return [obj]


def _full(model) -> dict:
    from torch.distributed.tensor import DTensor

    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for n, p in model.named_parameters()}


def _guarded_run(fields: dict, bad_rank: int, how: str) -> None:
    import copy

    import torch
    import torch.distributed as dist

    from vescale.core.testing.models import GPT, GPTConfig
    from vescale.plan import ParallelSpec, build
    from vescale.plan.auto_parallelize import language_model_loss

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=VOCAB, d_model=32, n_layer=2, n_head=4, max_seq_len=16))
    reference = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, VOCAB, (B, T + 1), generator=g) for _ in range(3)]
    par = build(model, ParallelSpec(**fields), batch_size=B, seq_len=T)
    opt = par.make_optimizer(torch.optim.AdamW, lr=LR, clip_grad=CLIP, skip_nonfinite=True, max_bad_steps=1)

    def step(i: int, poison: bool = False) -> None:
        opt.zero_grad(set_to_none=True)
        rows = par.shard_batch(batches[i])
        loss = par.forward_backward(rows[:, :-1].contiguous(), rows[:, 1:].contiguous())
        if poison and dist.get_rank() == bad_rank:
            if how == "grad":  # one element of what this rank's update would read, after the dp reduction
                next(g for g in par.step_guard.gradients() if g.numel()).view(-1)[0] = float("nan")
            else:
                par.step_guard.observe_loss(loss * float("inf"))
        opt.step()

    step(0)
    before = _local_copies([dict(par.model.named_parameters()), opt.state_dict()])
    step(1, poison=True)
    after = _local_copies([dict(par.model.named_parameters()), opt.state_dict()])
    assert par.step_guard.skipped == 1 and par.step_guard.last_skipped
    assert len(before) == len(after)
    for i, (a, b) in enumerate(zip(before, after)):  # bitwise: the skipped step changed nothing on any rank
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b, f"state item {i} changed"
    step(2)
    assert par.step_guard.consecutive == 0 and par.step_guard.skipped == 1

    ref_opt = torch.optim.AdamW(reference.parameters(), lr=LR)  # one device, the good batches only
    for i in (0, 2):
        ref_opt.zero_grad(set_to_none=True)
        language_model_loss(reference(batches[i][:, :-1]), batches[i][:, 1:]).backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), CLIP)
        ref_opt.step()
    got = _full(par.model)
    for name, p in reference.named_parameters():
        torch.testing.assert_close(got[name], p.detach(), rtol=1e-3, atol=1e-4,
                                   msg=lambda m, name=name: f"{name}: {m}")  # Adam amplifies rounding


@pytest.mark.parametrize("world_size,fields", CASES, ids=["dp2", "dp2xtp2", "zero1", "zero3"])
def test_nan_in_one_ranks_gradient_skips_the_step_everywhere(world_size, fields):
    run_on_ranks(_guarded_run, world_size, fields, 1, "grad")


def test_nonfinite_loss_on_one_rank_skips_the_step():
    run_on_ranks(_guarded_run, 2, {"mesh": {"dp": 2}, "zero": 1}, 0, "loss")


def _too_many(max_bad: int) -> None:
    import torch

    from vescale.parallel import NonFiniteStepError, skip_nonfinite_steps

    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1)
    guard = skip_nonfinite_steps(opt, max_consecutive=max_bad)
    for i in range(max_bad):
        p.grad = torch.full((3,), float("nan"))
        opt.step()
        assert guard.consecutive == i + 1
    p.grad = torch.full((3,), float("nan"))
    with pytest.raises(NonFiniteStepError, match=f"max_bad_steps={max_bad}"):
        opt.step()
    assert torch.equal(p.detach(), torch.ones(3)) and guard.skipped == max_bad + 1
    p.grad = torch.ones(3)
    opt.step()  # a good step resets the run and steps
    assert guard.consecutive == 0 and torch.allclose(p.detach(), torch.full((3,), 0.9))


@pytest.mark.parametrize("max_bad", [0, 2])
def test_more_consecutive_bad_steps_than_allowed_raise(max_bad):
    run_on_ranks(_too_many, 2, max_bad)


def _carried_preemption(_: int) -> None:
    """Guard and preemption flag in one all-reduce: a SIGUSR1 to rank 1 only stops both ranks at the same step, a NaN
    on rank 0 still skips the step everywhere, and each step (guarded ``opt.step()`` + ``should_stop()``) issues one
    all-reduce instead of the two of the guard and the PreemptionGuard apart."""
    import os
    import signal

    import torch
    import torch.distributed as dist

    from vescale.core import PreemptionGuard
    from vescale.core.comm import count_comms
    from vescale.parallel import skip_nonfinite_steps

    def run(carried: bool) -> tuple[list, list, list]:
        p = torch.nn.Parameter(torch.ones(3))
        opt = torch.optim.SGD([p], lr=0.1)
        guard = skip_nonfinite_steps(opt, max_consecutive=None)
        stops, skipped, counts = [], [], []
        with PreemptionGuard(["SIGUSR1"]) as preempt:
            if carried:
                guard.carry(preempt)
            for step in range(5):
                p.grad = torch.full((3,), float("nan") if step == 1 and dist.get_rank() == 0 else 1.0)
                if step == 3 and dist.get_rank() == 1:
                    os.kill(os.getpid(), signal.SIGUSR1)  # only rank 1 is told
                with count_comms() as counter:
                    opt.step()
                    stops.append(preempt.should_stop())
                skipped.append(guard.last_skipped)
                counts.append(counter.total)
        return stops, skipped, counts

    # apart: the guard's and the flag's all-reduce (the flag's stops once agreed); carried: the guard's only
    for carried, want in ((False, [2, 2, 2, 2, 1]), (True, [1] * 5)):
        stops, skipped, counts = run(carried)
        assert stops == [False, False, False, True, True], (carried, stops)
        assert skipped == [False, True, False, False, False], (carried, skipped)
        assert counts == want, (carried, counts)


def test_preemption_flag_carried_in_the_guards_all_reduce():
    run_on_ranks(_carried_preemption, 2, 0)
