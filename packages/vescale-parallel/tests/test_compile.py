"""Compile mode: :func:`compile_parallel` blocks of a parallelized model against eager and single-device runs.

CPU inductor compiles take minutes on the 2-core test machine, so most tests compile with ``backend="aot_eager"``
(dynamo capture + AOT autograd, the same graphs inductor would lower, without code generation); one test compiles a
1-layer GPT with inductor (one compile, ~20-35 s with a warm inductor cache, ~190 s cold). Every block is
compiled with ``fullgraph=True`` (a graph break raises) and :func:`block_graph_breaks` must report one graph and
zero breaks per block.

World size 2: a tiny HF Llama with tp=2 + sequence parallelism and vescale's GPT (its causal mask is built inside the
block, under factory capture) with tp=2. World size 4: the Llama on a dp x tp = 2x2 mesh. Two steps each (different
batches, no recompiles expected). Logits, loss and every parameter gradient: compiled vs eager parallel and vs the
single-device model, ``assert_close(rtol=1e-5, atol=1e-6)`` in fp32 (not bitwise: compiled graphs and sharding
reorder reductions).

Whole-model compile: ``torch.compile(model, fullgraph=True)`` (GPT tp=2, vocab-parallel loss) and
``model.compile(fullgraph=True)`` (HF Llama tp=2 + SP) against the eager parallel model, same tolerance, with dynamo's
``graph_break`` counter asserted to be zero and at least one frame compiled. dp x tp = 2x2 training (world size 4):
vescale DDP over compiled blocks and ZeRO 2 over a whole-model compile, losses and updated weights vs eager.
"""

from __future__ import annotations

import pytest

from vescale.core.testing import multi_rank

RTOL, ATOL = 1e-5, 1e-6


def _llama():
    import transformers as tf

    cfg = tf.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                         attn_implementation="eager")
    return tf.LlamaForCausalLM(cfg).train()


def _gpt(n_layer: int = 2):
    from vescale.core.testing.models import GPT, GPTConfig

    return GPT(GPTConfig(vocab_size=64, d_model=32, n_layer=n_layer, n_head=4, n_kv_head=2, max_seq_len=16)).train()


def _logits(model, tokens):
    out = model(input_ids=tokens, use_cache=False) if hasattr(model, "config") else model(tokens)
    return out.logits if hasattr(out, "logits") else out


def _step(model, tokens, labels, n_labels, dp_group=None):
    """Forward + backward of a sum-reduced CE divided by the global label count; returns (logits, loss) of the batch."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    logits = _logits(model, tokens)
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum") / n_labels
    loss.backward()
    loss, logits = loss.detach(), logits.detach()
    if dp_group is not None:
        dist.all_reduce(loss, group=dp_group)
        parts = [torch.empty_like(logits) for _ in range(dist.get_world_size(dp_group))]
        dist.all_gather(parts, logits.contiguous(), group=dp_group)
        logits = torch.cat(parts)
    return logits, loss


def _check(kind: str, mesh_dims: dict):
    import copy

    import torch
    import torch._dynamo

    from vescale.core.mesh import init_mesh
    from vescale.parallel import PLANS, block_graph_breaks, compile_parallel, compiled_blocks, parallelize_module

    torch._dynamo.reset()
    mesh = init_mesh(mesh_dims)
    dp = mesh_dims.get("dp", 1)
    torch.manual_seed(0)
    ref = _llama() if kind == "llama" else _gpt()
    eager, comp = copy.deepcopy(ref), copy.deepcopy(ref)
    plan = PLANS[kind](mesh, sequence_parallel=kind == "llama", loss_parallel=False)
    parallelize_module(eager, mesh, plan)
    parallelize_module(comp, mesh, plan)
    compile_parallel(comp, backend="aot_eager")
    blocks = compiled_blocks(comp)
    expected_blocks = ["model.layers.0", "model.layers.1"] if kind == "llama" else ["layers.0", "layers.1"]
    assert blocks == expected_blocks, blocks
    r = mesh.get_local_rank("dp") if dp > 1 else 0
    group = mesh.get_group("dp") if dp > 1 else None
    g = torch.Generator().manual_seed(1)
    for step in range(2):
        tokens = torch.randint(0, 64, (4, 8), generator=g)
        labels = torch.randint(0, 64, (4, 8), generator=g)
        labels[1, 5:] = -100
        n = (labels != -100).sum()
        ref_logits, ref_loss = _step(ref, tokens, labels, n)
        mine = (tokens.chunk(dp)[r], labels.chunk(dp)[r])
        e_logits, e_loss = _step(eager, *mine, n, group)
        c_logits, c_loss = _step(comp, *mine, n, group)
        for what, (got, want) in {"logits": (c_logits, e_logits), "loss": (c_loss, e_loss)}.items():
            torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL, msg=lambda m, w=what: f"{kind} {w}: {m}")
        torch.testing.assert_close(c_logits, ref_logits, rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(c_loss, ref_loss, rtol=RTOL, atol=ATOL)
        ref_params, eager_params = dict(ref.named_parameters()), dict(eager.named_parameters())
        assert list(ref_params) == [name for name, _ in comp.named_parameters()]
        for name, p in comp.named_parameters():
            assert tuple(p.grad.placements) == tuple(p.placements), (name, p.grad.placements)
            full = p.grad.full_tensor()
            torch.testing.assert_close(full, eager_params[name].grad.full_tensor(), rtol=RTOL, atol=ATOL,
                                       msg=lambda m, name=name, s=step: f"{kind} {mesh_dims} step {s} {name}: {m}")
            torch.testing.assert_close(full, ref_params[name].grad, rtol=RTOL, atol=ATOL)
        for model in (ref, eager, comp):
            model.zero_grad(set_to_none=True)
    # one graph per block, no break (fullgraph=True would already have raised on one)
    mine = tokens.chunk(dp)[r]
    breaks = block_graph_breaks(comp, input_ids=mine, use_cache=False) if kind == "llama" else block_graph_breaks(
        comp, mine)
    assert set(breaks) == set(blocks)
    for fqn, info in breaks.items():
        assert (info["graphs"], info["graph_breaks"]) == (1, 0), (fqn, info)


@multi_rank(world_sizes=[2, 4])
def test_compiled_blocks_match_eager(world_size):
    if world_size == 2:
        _check("llama", {"tp": 2})
        _check("gpt", {"tp": 2})
    else:
        _check("llama", {"dp": 2, "tp": 2})


def test_compile_errors_name_the_block():
    from torch import nn

    from vescale.core.testing.models import GPT, GPTConfig
    from vescale.parallel import CompileError, compile_parallel

    model = GPT(GPTConfig(vocab_size=64, d_model=32, n_layer=2, n_head=4, n_kv_head=2, max_seq_len=16, dropout=0.1))
    with pytest.raises(CompileError, match=r"layers\.0\.attn\.attn_dropout.*p=0\.1"):
        compile_parallel(model.train(), backend="aot_eager")
    with pytest.raises(CompileError, match="matches no submodule of GPT"):
        compile_parallel(model, blocks=r"nope\.\d+")
    with pytest.raises(CompileError, match="no nn.ModuleList"):
        compile_parallel(nn.Linear(2, 2))
    compile_parallel(model.eval(), backend="aot_eager")  # eval: dropout is the identity, compiling is fine
    assert [n for n, m in model.named_modules() if getattr(m, "_compiled_call_impl", None) is not None] == \
        ["layers.0", "layers.1"]


def test_compile_forward_keeps_results_and_hooks():
    """compile_forward compiles ``forward`` only: forward hooks still run eagerly; outputs equal eager (rtol 1e-5)."""
    import torch
    from torch import nn

    from vescale.parallel import compile_forward, compiled_blocks

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    x = torch.randn(3, 8)
    want = model(x)
    calls = []
    model.register_forward_hook(lambda m, a, out: calls.append(out.shape))
    compile_forward(model, backend="aot_eager")
    got = model(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert calls == [torch.Size([3, 4])] and compiled_blocks(model) == [""]


def _whole(kind: str, how: str, loss_parallel: bool, backend_name: str = "aot_eager", steps: int = 2,
           n_layer: int = 2):
    """Whole-model compile (``torch.compile(model)`` or ``model.compile()``, fullgraph) vs eager parallel, 2 steps."""
    import copy

    import torch
    import torch._dynamo
    import torch.nn.functional as F
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    from vescale.core.mesh import init_mesh
    from vescale.parallel import PLANS, parallelize_module, vocab_parallel_cross_entropy

    torch._dynamo.reset()
    counters.clear()
    mesh = init_mesh({"tp": 2})
    torch.manual_seed(0)
    ref = _llama() if kind == "llama" else _gpt(n_layer)
    eager, comp = copy.deepcopy(ref), copy.deepcopy(ref)
    plan = PLANS[kind](mesh, sequence_parallel=kind == "llama", loss_parallel=loss_parallel)
    parallelize_module(eager, mesh, plan)
    parallelize_module(comp, mesh, plan)
    backend = CompileCounterWithBackend(backend_name)
    if how == "torch.compile":
        run = torch.compile(comp, backend=backend, fullgraph=True)
    else:
        comp.compile(backend=backend, fullgraph=True)
        run = comp
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        tokens = torch.randint(0, 64, (4, 8), generator=g)
        labels = torch.randint(0, 64, (4, 8), generator=g)
        labels[1, 5:] = -100
        got = {}
        for name, model in (("eager", eager), ("compiled", run)):
            logits = _logits(model, tokens)
            if loss_parallel:  # vocab-sharded DTensor logits
                loss = vocab_parallel_cross_entropy(logits.flatten(0, 1), labels.flatten())
                logits, loss = logits.full_tensor(), loss.full_tensor()
            else:
                loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
            loss.backward()
            got[name] = (logits.detach(), loss.detach())
        where = f"{kind} {how} loss_parallel={loss_parallel} step {step}"
        for i, what in enumerate(("logits", "loss")):
            torch.testing.assert_close(got["compiled"][i], got["eager"][i], rtol=RTOL, atol=ATOL,
                                       msg=lambda m, w=what, at=where: f"{at} {w}: {m}")
        eager_params = dict(eager.named_parameters())
        for name, p in comp.named_parameters():
            assert tuple(p.grad.placements) == tuple(p.placements), (name, p.grad.placements)
            torch.testing.assert_close(p.grad.full_tensor(), eager_params[name].grad.full_tensor(), rtol=RTOL,
                                       atol=ATOL, msg=lambda m, name=name, at=where: f"{at} grad {name}: {m}")
        for model in (eager, comp):
            model.zero_grad(set_to_none=True)
    breaks = sum(counters["graph_break"].values())
    return backend.frame_count, breaks


@multi_rank(world_sizes=[2])
def test_whole_model_compile_matches_eager():
    """torch.compile(model) / model.compile() of a parallelized model: eager results, zero graph breaks.

    GPT tp=2 with the vocab-parallel loss (DTensor logits) and HF Llama tp=2 + SP, ``fullgraph=True`` (a break would
    raise),
    ``backend="aot_eager"``; logits, loss and every gradient vs the eager parallel model at rtol 1e-5.
    """
    seen = {}
    for kind, how, lp in (("gpt", "torch.compile", True), ("llama", "module.compile", False)):
        seen[(kind, how, lp)] = _whole(kind, how, lp)
    for key, (frames, breaks) in seen.items():
        assert frames >= 1 and breaks == 0, (key, frames, breaks)  # compiled, and not one graph break


@multi_rank(world_sizes=[2])
def test_whole_model_inductor_matches_eager():
    """``torch.compile(model, backend="inductor", fullgraph=True)`` on CPU: 1-layer GPT tp=2, one step (one compile).

    Logits, loss and every gradient vs the eager parallel model at rtol 1e-5, zero graph breaks. Inductor compiles
    in-process (``compile_threads=1``: a compile worker pool costs more than it saves for these few kernels).
    """
    import torch._inductor.config

    with torch._inductor.config.patch(compile_threads=1):
        frames, breaks = _whole("gpt", "torch.compile", False, backend_name="inductor", steps=1, n_layer=1)
    assert frames >= 1 and breaks == 0, (frames, breaks)


def _train_dp_tp(how: str, stage: int, mesh, batches):
    """Two SGD steps of the GPT (vescale TP+SP over ``tp``, vescale DDP/ZeRO over ``dp``); losses and final weights."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch.distributed.tensor import DTensor

    from vescale.core.mesh import mesh_coordinates
    from vescale.parallel import (
        DDPOptions,
        DistributedDataParallel,
        DistributedOptimizer,
        compile_parallel,
        gpt_plan,
        parallelize_module,
    )

    torch.manual_seed(0)
    model = parallelize_module(_gpt(), mesh["tp"], gpt_plan(mesh["tp"], dp=None, sequence_parallel=True))
    counter = CompileCounterWithBackend("aot_eager")
    if how == "blocks":
        compile_parallel(model, backend="aot_eager")
    elif how == "whole":
        model.compile(backend=counter, fullgraph=True)
    ddp = DistributedDataParallel(model, mesh, DDPOptions(bucket_size_mb=0.004, zero_stage=stage))
    if stage == 0:
        opt = torch.optim.SGD(ddp.parameters(), lr=0.5, momentum=0.9)
    else:
        opt = DistributedOptimizer(ddp, torch.optim.SGD, zero_stage=stage, lr=0.5, momentum=0.9)
    r = mesh_coordinates(mesh)["dp"]
    losses = []
    for tokens, labels in batches:
        logits = ddp(tokens.chunk(2)[r])
        loss = F.cross_entropy(logits.flatten(0, 1), labels.chunk(2)[r].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        loss = loss.detach()
        dist.all_reduce(loss, group=ddp.dp_group)
        losses.append(loss / 2)
    weights = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in ddp.module.state_dict().items()}
    return losses, weights, counter.frame_count


@multi_rank(world_sizes=[4])
def test_compiled_dp_x_tp_ddp_and_zero_match_eager():
    """dp x tp = 2x2: vescale DDP (ZeRO 0, torch SGD) over compile_parallel blocks and ZeRO 2
    (DistributedOptimizer) over a whole-model ``module.compile(fullgraph=True)``, vs the same eager setups.

    Two SGD+momentum steps on different batches; per-step loss and every updated weight at rtol 1e-5 (fp32).
    """
    import torch
    import torch._dynamo

    from vescale.core.mesh import init_mesh

    torch._dynamo.reset()
    mesh = init_mesh({"dp": 2, "tp": 2})
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 64, (4, 8), generator=g), torch.randint(0, 64, (4, 8), generator=g))
               for _ in range(2)]
    for how, stage in (("blocks", 0), ("whole", 2)):
        want_losses, want_weights, _ = _train_dp_tp("eager", stage, mesh, batches)
        losses, weights, frames = _train_dp_tp(how, stage, mesh, batches)
        if how == "whole":
            assert frames >= 1
        for step, (got, want) in enumerate(zip(losses, want_losses)):
            torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL, msg=lambda m, s=step, h=how: f"{h} {s}: {m}")
        assert list(weights) == list(want_weights)
        for k, v in weights.items():
            torch.testing.assert_close(v, want_weights[k], rtol=RTOL, atol=ATOL,
                                       msg=lambda m, k=k, h=how, z=stage: f"{h} zero{z} {k}: {m}")
