"""Compiled pipeline stages: ``vescale.parallel.compile_forward`` on split stages, driven by ``PipeEngine``.

pp=2 on 2 ranks (each rank's stage compiled) and pp=2 x tp=2 on 4 ranks (stages tensor-parallelized with
``parallelize_stage`` as ``tools/train.py`` composes them, then compiled). ``backend="aot_eager"`` (dynamo capture +
AOT autograd; CPU inductor compiles are too slow for the suite). The loss and every gradient are compared with the
eager pipeline of the same stages and with the single-device model accumulating the same microbatches
(``reference_gradients``), fp32, ``rtol=1e-5, atol=1e-7``: not bitwise, since compiled graphs may reorder reductions.

An integration test: it needs vescale-pipe and vescale-parallel (``compile_forward``, ``parallelize_stage``)
installed together, which no single package's test session has.
"""

from __future__ import annotations

from vescale.core.testing import multi_rank
from vescale.core.testing.reference import reference_gradients

MB, T, VOCAB = 2, 8, 64
RTOL, ATOL = 1e-5, 1e-7


def _full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _run(stages, mesh, x, y, M):
    """One ``1f1b`` step over ``stages``; returns (loss, {fqn: full gradient}) of this rank's stage, grads cleared."""
    from vescale.core.testing.models import cross_entropy
    from vescale.pipe import PipeEngine

    engine = PipeEngine(stages, mesh, schedule="1f1b", num_microbatches=M, loss_fn=cross_entropy)
    loss = engine.step(x, y)
    grads = {}
    for stage in engine.stages.values():
        grads.update({n: _full(p.grad).clone() for n, p in stage.named_parameters()})
        stage.zero_grad(set_to_none=True)
    return loss, grads


def _check(what, loss, grads, want_loss, want_grads):
    import torch

    torch.testing.assert_close(loss, want_loss, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what} loss: {m}")
    assert grads and set(grads) <= set(want_grads), (what, sorted(grads))
    for n, g in grads.items():
        torch.testing.assert_close(g, want_grads[n], rtol=RTOL, atol=ATOL, msg=lambda m, n=n: f"{what} {n}: {m}")


@multi_rank(world_sizes=[2])
def test_compiled_stages_pp2_match_eager_and_single_device():
    import copy

    import torch
    import torch._dynamo
    from torch._dynamo.testing import CompileCounterWithBackend

    from vescale.core.testing.models import GPT, GPTConfig, cross_entropy
    from vescale.parallel import compile_forward
    from vescale.pipe import split

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=VOCAB, d_model=32, n_layer=4, n_head=4, n_kv_head=2, max_seq_len=16,
                          tie_embeddings=True))
    stages_by_count = {2: split(model, num_stages=2, example_inputs=(torch.randint(0, VOCAB, (MB, T)),))}
    M = 2
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, VOCAB, (M * MB, T), generator=g)
    y = torch.randint(0, VOCAB, (M * MB, T), generator=g)
    losses, ref = reference_gradients(model, x, y, M, cross_entropy)
    eager_loss, eager_grads = _run(copy.deepcopy(stages_by_count[2]), None, x, y, M)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = [compile_forward(s, backend=counter) for s in copy.deepcopy(stages_by_count[2])]
    for step in range(2):  # the second step reuses the compiled graphs
        loss, grads = _run(compiled, None, x, y, M)
        _check(f"pp2 step {step} vs eager pipeline", loss, grads, eager_loss, eager_grads)
        _check(f"pp2 step {step} vs single device", loss, grads, torch.stack(losses).mean(), ref)
    assert counter.frame_count >= 1  # this rank's stage really ran compiled


@multi_rank(world_sizes=[4])
def test_compiled_stages_pp2_x_tp2_match_eager_and_single_device():
    import copy

    import torch
    import torch._dynamo

    from vescale.core.mesh import init_mesh, mesh_coordinates
    from vescale.core.testing.models import GPT, GPTConfig, cross_entropy
    from vescale.parallel import compile_forward, gpt_plan, parallelize_stage
    from vescale.pipe import capture, split

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=VOCAB, d_model=32, n_layer=2, n_head=4, n_kv_head=2, max_seq_len=16))
    mesh = init_mesh({"pp": 2, "tp": 2})
    pp = mesh_coordinates(mesh)["pp"]
    M = 2
    g = torch.Generator().manual_seed(5)
    x = torch.randint(0, VOCAB, (M * MB, T), generator=g)
    y = torch.randint(0, VOCAB, (M * MB, T), generator=g)
    losses, ref = reference_gradients(model, x, y, M, cross_entropy)
    example = (x[:MB],)
    stages = split(model, num_stages=2, example_inputs=example, exported=capture(model, example))
    plan = gpt_plan(mesh["tp"], dp=None)
    built = {}
    for how in ("eager", "compiled"):  # as tools/train.py: TP by the plan's parameter entries, embeddings replicated
        mine = copy.deepcopy(stages[pp])
        parallelize_stage(mine, mesh["tp"], plan, ["embed.weight"])
        if how == "compiled":
            mine = compile_forward(mine, backend="aot_eager")  # fullgraph=True
        built[how] = [mine, None] if pp == 0 else [None, mine]
    sharded = [n for n, p in built["compiled"][pp].named_parameters() if "layers" in n and n.endswith("wq.weight")]
    assert sharded and all(built["compiled"][pp].get_parameter(n).placements[0].is_shard() for n in sharded)
    eager_loss, eager_grads = _run(built["eager"], mesh, x, y, M)
    loss, grads = _run(built["compiled"], mesh, x, y, M)
    _check(f"pp2xtp2 pp={pp} vs eager pipeline", loss, grads, eager_loss, eager_grads)
    _check(f"pp2xtp2 pp={pp} vs single device", loss, grads, torch.stack(losses).mean(), ref)
