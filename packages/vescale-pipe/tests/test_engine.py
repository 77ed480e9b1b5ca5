"""PipeEngine on 2 and 4 gloo ranks: loss and every gradient equal the single-device run.

The reference is the unsplit model on one process accumulating ``(loss_fn(model(x_m), t_m) / M).backward()`` over
the same microbatches. Comparison is bitwise (``torch.equal``) for the loss and every parameter except the tied
embedding: its two partial gradients (embedding and LM head) are summed in another order than on one device (an
all-reduce across ranks, or, for ZBV, another interleaving of microbatches on one rank), so it is compared with a
tolerance of a few ulps (fp32, rtol 1e-5).
"""

from __future__ import annotations

from vescale.core.testing import multi_rank
from vescale.core.testing.reference import reference_gradients

MB, T, VOCAB = 2, 8, 64
SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("zb_h1", 1), ("interleaved_1f1b", 2), ("zbv", 2), ("gpipe", 2)]


def _reference(model, x, y, M, loss_fn):
    """Single-device loss (mean over microbatches) and gradients by FQN (tied weights under every name)."""
    import torch

    losses, grads = reference_gradients(model, x, y, M, loss_fn)
    return torch.stack(losses).mean(), grads


def _compare(engine, ref_grads, tied: set[str], what: str, bitwise: bool = True) -> int:
    """Assert every local gradient equals the reference; return how many parameters were checked."""
    import torch

    checked = 0
    for stage in engine.stages.values():
        for name, p in stage.named_parameters():
            canon = getattr(stage, "canonical_names", {}).get(name, name)
            assert p.grad is not None, f"{what}: {name} got no gradient"
            if canon in tied or not bitwise:
                torch.testing.assert_close(p.grad, ref_grads[name], rtol=1e-5, atol=1e-7, msg=f"{what}: {name}")
            else:
                assert torch.equal(p.grad, ref_grads[name]), f"{what}: {name} differs " \
                    f"(max {(p.grad - ref_grads[name]).abs().max().item():.3g})"
            checked += 1
    return checked


@multi_rank(world_sizes=[2, 4])
def test_every_schedule_matches_single_device(world_size, gpt_pipeline):
    import torch
    import torch.distributed as dist

    from vescale.core.testing.models import cross_entropy
    from vescale.pipe import PipeEngine

    model, stages_by_count = gpt_pipeline
    P = world_size
    rank = dist.get_rank()
    for M in (P, 2 * P):
        g = torch.Generator().manual_seed(M)
        x = torch.randint(0, VOCAB, (M * MB, T), generator=g)
        y = torch.randint(0, VOCAB, (M * MB, T), generator=g)
        ref_loss, ref_grads = _reference(model, x, y, M, cross_entropy)
        for name, V in SCHEDULES:
            engine = PipeEngine(stages_by_count[P * V], None, schedule=name, num_microbatches=M,
                                loss_fn=cross_entropy)
            loss = engine.step(x, y)
            assert torch.equal(loss, ref_loss), f"{name} M={M}: loss {loss.item()} vs {ref_loss.item()}"
            checked = _compare(engine, ref_grads, {"embed.weight"}, f"{name} V={V} M={M} rank {rank}")
            assert checked == sum(1 for s in engine.stages.values() for _ in s.named_parameters())
            if name == "zb_h1" and M == P:
                # a second step accumulates into .grad like backward() does (tied sums included)
                engine.step(x, y)
                for stage in engine.stages.values():
                    for pname, p in stage.named_parameters():
                        torch.testing.assert_close(p.grad, 2 * ref_grads[pname], rtol=1e-5, atol=1e-7)
            for stage in engine.stages.values():
                stage.zero_grad(set_to_none=True)


def _llama_loss(out, target):
    import torch.nn.functional as F

    return F.cross_entropy(out.logits.reshape(-1, out.logits.shape[-1]), target.reshape(-1))


@multi_rank(world_sizes=[2])
def test_hf_llama_kwargs_and_optimizer_step(llama_pipeline):
    """HF LlamaForCausalLM (kwargs batch, ModelOutput) under 1F1B and ZB-H1, then one SGD step on every rank.

    Tolerance (fp32, rtol 1e-5), not bitwise: eager HF attention and its captured aten graph differ in the last ulps.
    """
    import torch

    from vescale.pipe import PipeEngine

    model, stages = llama_pipeline
    M = 4
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (M * MB, T), generator=g)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    y = torch.randint(0, VOCAB, (M * MB, T), generator=g)

    def model_loss(out, t):
        return _llama_loss(out, t)

    class _Wrapped(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, xm):
            return self.m(input_ids=xm, attention_mask=torch.ones_like(xm))

    ref_model = _Wrapped(model)
    ref_loss, ref = _reference(ref_model, ids, y, M, model_loss)
    ref = {k.removeprefix("m."): v for k, v in ref.items()}
    for name in ("1f1b", "zb_h1"):
        engine = PipeEngine(stages, None, schedule=name, num_microbatches=M, loss_fn=_llama_loss)
        loss = engine.step(batch, y)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
        _compare(engine, ref, set(), f"llama {name}", bitwise=False)
        for s in engine.stages.values():
            s.zero_grad(set_to_none=True)
    # one optimizer step on the pipeline equals one on the single-device model
    opt = torch.optim.SGD(engine.parameters(), lr=0.5)
    before = {n: p.detach().clone() for s in engine.stages.values() for n, p in s.named_parameters()}
    engine.step(batch, y)
    opt.step()
    # SGD moves w by -lr * g: the gradients agree to rtol 1e-5, atol 1e-7 (checked above), so the weights agree to
    # lr times that, plus the rounding of w - lr * g on each side (at most an ulp of |w| each: 2.4e-7 |w|)
    for s in engine.stages.values():
        for n, p in s.named_parameters():
            want = before[n] - 0.5 * ref[n]
            bound = 0.5 * (1e-5 * ref[n].abs() + 1e-7) + 2.4e-7 * want.abs()
            assert ((p.detach() - want).abs() <= bound).all(), (n, ((p.detach() - want).abs() - bound).max())


@multi_rank(world_sizes=[2])
def test_bad_input_fails_on_every_rank_before_communication(gpt_pipeline):
    import pytest
    import torch

    from vescale.core.testing.models import cross_entropy
    from vescale.pipe import PipeEngine, PipeError, ScheduleError

    model, stages_by_count = gpt_pipeline
    stages = stages_by_count[2]
    with pytest.raises(ScheduleError, match=r"'1f1b' needs at least 2 microbatches .* got num_microbatches=1"):
        PipeEngine(stages, None, schedule="1f1b", num_microbatches=1, loss_fn=cross_entropy)
    with pytest.raises(ScheduleError, match="needs 4 stages for 2 ranks, got 2"):
        PipeEngine(stages, None, schedule="zbv", num_microbatches=2, loss_fn=cross_entropy)
    with pytest.raises(PipeError, match="pp rank 1 has no module for stage 1"):
        PipeEngine([stages[0], None], None, schedule="1f1b", num_microbatches=2, loss_fn=cross_entropy)
    engine = PipeEngine(stages, None, schedule="1f1b", num_microbatches=2, loss_fn=cross_entropy)
    bad = torch.ones(5, T, dtype=torch.long)
    with pytest.raises(PipeError, match=r"batch has shape \(5, 8\), dtype int64 on pp ranks 0, 1: dim 0 must be a "
                                        r"multiple of num_microbatches=2"):
        engine.step(bad, bad)
    # the engine still works after the rejected step (nothing was sent)
    x = torch.randint(0, VOCAB, (2 * MB, T), generator=torch.Generator().manual_seed(3))
    ref_loss, _ = _reference(model, x, x, 2, cross_entropy)
    assert torch.equal(engine.step(x, x), ref_loss)


def _error_on_every_rank(engine, batch, target) -> str:
    """``engine.step(batch, target)`` must raise PipeError on this rank; return its message, checked equal on all."""
    import pytest
    import torch.distributed as dist

    from vescale.pipe import PipeError

    with pytest.raises(PipeError) as info:
        engine.step(batch, target)
    messages = [None] * dist.get_world_size()
    dist.all_gather_object(messages, str(info.value))
    assert len(set(messages)) == 1, f"the ranks raised different errors: {messages}"
    return messages[0]


@multi_rank(world_sizes=[2, 4], timeout=60)
def test_bad_batch_on_the_first_stage_only_raises_on_every_rank(world_size, gpt_pipeline):
    """The documented way (batch on the rank of stage 0 only, target on the last stage's only): a bad or missing
    batch or target makes every rank raise the same error before any p2p; without the metadata exchange the other
    ranks would wait for stage 0's activations forever (the harness's 60 s timeout fails the test)."""
    import re

    import torch
    import torch.distributed as dist

    from vescale.core.testing.models import cross_entropy
    from vescale.pipe import PipeEngine

    model, stages_by_count = gpt_pipeline
    P, M, rank = world_size, 2 * world_size, dist.get_rank()
    engine = PipeEngine(stages_by_count[P], None, schedule="1f1b", num_microbatches=M, loss_fn=cross_entropy)
    first, last = rank == 0, rank == P - 1
    g = torch.Generator().manual_seed(5)
    x = torch.randint(0, VOCAB, (M * MB, T), generator=g)
    y = torch.randint(0, VOCAB, (M * MB, T), generator=g)

    def only(cond, value):
        return value if cond else None

    # dim 0 not a multiple of the microbatches
    bad = torch.ones(M * MB - 1, T, dtype=torch.long)
    msg = _error_on_every_rank(engine, only(first, bad), only(last, y))
    assert msg.startswith(f"batch has shape ({M * MB - 1}, {T}), dtype int64 on pp rank 0: dim 0 must be a multiple "
                          f"of num_microbatches={M}"), msg
    # a 0-d batch
    msg = _error_on_every_rank(engine, only(first, torch.tensor(3)), only(last, y))
    assert "batch has shape (), dtype int64 on pp rank 0: dim 0 must be a multiple" in msg, msg
    # the batch missing on stage 0, the target missing on the last stage
    msg = _error_on_every_rank(engine, None, only(last, y))
    assert msg.startswith("pp rank 0 holds stage 0 and needs the batch, got None"), msg
    msg = _error_on_every_rank(engine, only(first, x), None)
    assert msg.startswith(f"pp rank {P - 1} holds the last stage and needs the target, got None"), msg
    # a bad target on the last stage only, in a nested structure: named by its index
    msg = _error_on_every_rank(engine, only(first, x), only(last, (y, y[:-1])))
    assert re.search(rf"target tensor #1 \(of 2, .*\) has shape \({M * MB - 1}, {T}\), dtype int64 on pp rank "
                     rf"{P - 1}: dim 0", msg), msg
    # a rank passed another batch than stage 0's: every rank names both
    other = x.float() if rank == 1 else x
    msg = _error_on_every_rank(engine, other, only(last, y))
    assert (f"the batch on pp rank 1 differs from the batch on pp rank 0 (stage 0): got shape ({M * MB}, {T}), dtype "
            f"float32, expected shape ({M * MB}, {T}), dtype int64") in msg, msg
    # nothing was sent: the engine steps normally afterwards, with the batch on stage 0 only
    ref_loss, _ = _reference(model, x, y, M, cross_entropy)
    for stage in engine.stages.values():
        stage.zero_grad(set_to_none=True)
    assert torch.equal(engine.step(only(first, x), only(last, y)), ref_loss)


def test_describe_batch_is_fixed_size_and_compares_structure():
    """The per-step description: fixed length whatever the batch; equal for equal shapes/dtypes/structure only."""
    import torch

    from vescale.pipe.microbatch import _DESC_LEN, _describe_batch

    a = {"ids": torch.zeros(4, 8, dtype=torch.long), "mask": torch.ones(4, 8)}
    rows = [_describe_batch(b, 2) for b in (None, a, torch.zeros(4, 8), [torch.zeros(4, 2)] * 20,
                                            torch.zeros(4, *[1] * 12))]
    assert all(len(r) == _DESC_LEN for r in rows)
    assert _describe_batch(a, 2) == _describe_batch({"ids": torch.ones(4, 8, dtype=torch.long),
                                                     "mask": torch.zeros(4, 8)}, 2)  # values do not matter
    for other in ({"mask": a["mask"], "ids": a["ids"]}, {"ids": a["ids"], "mask": a["mask"].double()},
                  {"ids": a["ids"], "mask": torch.ones(4, 9)}, (a["ids"], a["mask"])):
        assert _describe_batch(other, 2)[:3] != _describe_batch(a, 2)[:3], other
    # tensors past the described ones still count in the digest
    many = [torch.zeros(4, 2)] * 20
    assert _describe_batch(many, 2)[:3] != _describe_batch(many[:19] + [torch.zeros(4, 3)], 2)[:3]
