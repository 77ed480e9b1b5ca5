"""vescale.plan.ParallelSpec: plain data with a JSON round trip, and every refusal named before any rank starts;
vescale.plan.build on one rank (bf16 masters without any data-parallel dim) against plain torch."""

from __future__ import annotations

import pytest

from vescale.plan import ParallelSpec, SpecError


def test_json_round_trip_and_bad_files():
    spec = ParallelSpec(mesh={"pp": 2, "dp": 2, "tp": 2}, zero=1, dtype="bf16", tp_plan="llama",
                        split_points=["layers.2"], grad_accum=2, activation_checkpointing="full")
    again = ParallelSpec.from_json(spec.to_json())
    assert again == spec and again.world_size == 8 and again.batch_ranks == 2 and again.pipeline_microbatches == 8
    with pytest.raises(SpecError, match=r"unknown parallelism spec field\(s\) \['zero_stage'\]"):
        ParallelSpec.from_json('{"zero_stage": 1}')
    with pytest.raises(SpecError, match="spec field 'zero' must be a int"):
        ParallelSpec.from_json('{"zero": "1"}')
    with pytest.raises(SpecError, match="must be a JSON object"):
        ParallelSpec.from_json("[1]")
    with pytest.raises(SpecError, match="plan dict, which JSON cannot hold"):
        ParallelSpec(tp_plan={"parameter": {}}).to_json()


@pytest.mark.parametrize("fields, batch, seq, reason", [
    ({"mesh": {"dp": 3}}, 8, 16, "batch_size 8 is not divisible by dp=3"),
    ({"mesh": {"dp": 2}, "grad_accum": 3}, 8, 16, "not divisible by dp=2 x grad_accum 3"),
    ({"mesh": {"pp": 2}, "grad_accum": 4}, 8, 16, "not divisible by 16 microbatches (4 x grad_accum 4)"),
    ({"mesh": {"pp": 2, "dp": 2}, "zero": 3, "schedule": "zb_h1"}, 8, 16, "zero 3 with schedule zb_h1"),
    ({"mesh": {"pp": 2}, "schedule": "foo"}, 8, 16, "schedule 'foo' is not one of"),
    ({"mesh": {"tp": 2}, "zero": 3}, 8, 16, "zero 3 shards parameters over the data-parallel ranks"),
    ({"mesh": {"dp_replicate": 2, "dp_shard": 2}}, 8, 16, "it needs zero 3"),
    ({"mesh": {"dp": 2, "dp_shard": 2}, "zero": 3}, 8, 16, "HSDP names both"),
    ({"mesh": {"tp": 2}, "reduce_dtype": "bf16"}, 8, 16, "reduce_dtype bf16 needs dtype bf16"),
    ({"mesh": {"cp": 4}}, 8, 20, "seq_len 20 is not divisible by 2 x cp = 8"),
    ({"mesh": {"cp": 2, "tp": 2}, "compile": True}, 8, 16, "or compile (cp under torch.compile"),
    ({"mesh": {"pp": 2, "ep": 2, "tp": 2}}, 8, 16, "pp x ep x tp is not supported"),
    ({"mesh": {"dp": 2, "ep": 2}, "zero": 3}, 8, 16, "ep with zero 3 is not supported"),
    ({"mesh": {"dp": 2, "ep": 2}, "grad_accum": 4}, 8, 16, "not divisible by dp x ep=4 x grad_accum 4"),
    ({"mesh": {"tp": 2}, "sequence_parallel": True}, 8, 15, "seq_len 15 is not divisible by tp=2"),
    ({"mesh": {"xx": 2}}, 8, 16, "mesh dim 'xx' is not one of"),
    ({"dtype": "fp16"}, 8, 16, "dtype 'fp16' is not one of"),
    ({"grad_accum": 0}, 8, 16, "grad_accum 0 must be at least 1"),
])
def test_every_refusal_names_its_fields(fields, batch, seq, reason):
    spec = ParallelSpec(**fields)
    problems = spec.problems(batch_size=batch, seq_len=seq)
    assert any(reason in p for p in problems), problems
    with pytest.raises(SpecError, match="cannot be built"):
        spec.check(batch_size=batch, seq_len=seq)


def test_specs_that_can_be_built_have_no_problems():
    for fields in ({}, {"mesh": {"pp": 2, "dp": 2, "tp": 2}, "zero": 1, "dtype": "bf16"},
                   {"mesh": {"dp_replicate": 2, "dp_shard": 2, "tp": 2}, "zero": 3},
                   {"mesh": {"dp": 2, "ep": 2}, "zero": 2}, {"mesh": {"pp": 2, "cp": 2}, "zero": 3}):
        assert ParallelSpec(**fields).problems(batch_size=8, seq_len=16) == [], fields


def test_build_on_one_rank_with_bf16_masters_matches_plain_torch():
    """World size 1, no mesh: bf16 parameters stepped by fp32 masters through DistributedOptimizer over a DDP of no
    data rank (``mesh=None``), with gradient accumulation; against the same recipe written in plain torch."""
    import torch
    import torch.nn.functional as F

    from vescale.plan import build

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Embedding(64, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 64))

    batches = [torch.randint(0, 64, (4, 9), generator=torch.Generator().manual_seed(s)) for s in range(3)]
    par = build(model(), ParallelSpec(dtype="bf16", grad_accum=2), batch_size=4, seq_len=8)
    assert par.mesh is None and par.ddp is not None and par.ddp.dp_group is None
    opt = par.make_optimizer(torch.optim.AdamW, lr=1e-2, clip_grad=1.0)
    ref = model().to(torch.bfloat16)
    masters = [p.detach().float().clone().requires_grad_() for p in ref.parameters()]
    ref_opt = torch.optim.AdamW(masters, lr=1e-2)
    for batch in batches:
        opt.zero_grad()
        loss = par.forward_backward(batch[:, :-1], batch[:, 1:])
        opt.step()
        for p in ref.parameters():
            p.grad = None
        ref_loss = 0.0
        for half in batch.chunk(2):
            part = F.cross_entropy(ref(half[:, :-1]).flatten(0, 1), half[:, 1:].flatten()) / 2
            part.backward()
            ref_loss += float(part.detach())
        for m, p in zip(masters, ref.parameters()):
            m.grad = p.grad.float()
        torch.nn.utils.clip_grad_norm_(masters, 1.0)
        ref_opt.step()
        with torch.no_grad():
            for m, p in zip(masters, ref.parameters()):
                p.copy_(m)
        assert float(loss) == pytest.approx(ref_loss, rel=2**-7)
    for (name, p), m in zip(par.model.named_parameters(), masters):
        piece = opt.pieces[p]
        torch.testing.assert_close(piece.master.view(p.shape), m.detach(), rtol=2**-6, atol=1e-4, msg=name)
