"""TP/SP of the nanoGPT-style GPT (vescale.core.testing.models) against the same model run on one process.

One multi-rank test per world size checks several meshes and options: world size 2 runs tp=2 (plain TP, plain logits
at the boundary) and tp=2 with sequence parallelism, dropout and vocab-parallel loss; world size 4 runs tp=4 and a
2x2 dp x tp mesh (each dp rank feeding its half of the batch). Everything is fp32. Compared:

* logits, loss and every parameter gradient: ``assert_close(rtol=1e-5, atol=1e-6)`` (reductions are reordered by
  sharding, so not bitwise);
* initial weights of a deferred-init model materialised into shards: bitwise (``torch.equal``);
* dropout masks: bitwise (the zero pattern of every ``nn.Dropout`` output equals the single-device run's under
  ``vescale.dtensor.random``).
"""

from __future__ import annotations

import pytest

from vescale.core.testing import multi_rank

RTOL, ATOL = 1e-5, 1e-6


def _config(tp: int, dropout: float, tie: bool):
    from vescale.core.testing.models import GPTConfig

    # 8 heads / 4 kv heads: GQA that divides tp=4; ffn 96 and vocab 64 divide too.
    return GPTConfig(vocab_size=64, d_model=32, n_layer=2, n_head=8, n_kv_head=4, ffn_hidden=96, max_seq_len=16,
                     dropout=dropout, tie_embeddings=tie)


def _record_dropout(model, store: dict):
    import torch.nn as nn

    def hook(mod, args, out, name):
        store.setdefault(name, []).append(out.full_tensor() if hasattr(out, "full_tensor") else out)

    import functools

    for name, mod in model.named_modules():
        if isinstance(mod, nn.Dropout):
            mod.register_forward_hook(functools.partial(hook, name=name))


def _run_case(mesh_dims: dict, *, sp: bool, dropout: float, tie: bool, loss_parallel: bool, deferred: bool):
    import torch
    import torch.nn.functional as F

    from vescale.core.mesh import init_mesh
    from vescale.core.testing.models import GPT
    from vescale.dtensor import deferred_init
    from vescale.dtensor import random as vrandom
    from vescale.parallel import parallelize_module, vocab_parallel_cross_entropy
    from vescale.parallel.plans import gpt_plan

    mesh = init_mesh(mesh_dims)
    tp, dp = mesh_dims["tp"], mesh_dims.get("dp", 1)
    cfg = _config(tp, dropout, tie)
    # The reference: the whole model on this process, weights and dropout from vescale's counter RNG.
    vrandom.manual_seed(1234)
    with vrandom.single_device():
        ref = GPT(cfg)
    if deferred:
        vrandom.manual_seed(1234)
        par = deferred_init(GPT, cfg)
    else:
        par = GPT(cfg)
        par.load_state_dict(ref.state_dict())
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (4, 8), generator=g)
    targets = torch.randint(0, cfg.vocab_size, (4, 8), generator=g)
    targets[1, :3] = -100  # some ignored positions

    ref_drop, par_drop = {}, {}
    _record_dropout(ref, ref_drop)
    _record_dropout(par, par_drop)
    vrandom.manual_seed(99)
    with vrandom.single_device():
        ref_logits = ref(tokens)
    ref_loss = F.cross_entropy(ref_logits.flatten(0, 1), targets.flatten(), label_smoothing=0.1 if sp else 0.0)
    ref_loss.backward()

    parallelize_module(par, mesh, gpt_plan(mesh, sequence_parallel=sp, loss_parallel=loss_parallel))
    for name, p in par.named_parameters():  # deferred init: shards bitwise equal to the single-device init
        if deferred:
            assert torch.equal(p.full_tensor(), ref.get_parameter(name).detach()), name
    r = mesh.get_local_rank("dp") if dp > 1 else 0
    my_tokens, my_targets = tokens.chunk(dp)[r], targets.chunk(dp)[r]
    vrandom.manual_seed(99)
    logits = par(my_tokens)
    if loss_parallel:
        assert logits.placements[mesh.mesh_dim_names.index("tp")].is_shard(2)
        loss = vocab_parallel_cross_entropy(logits, my_targets, label_smoothing=0.1 if sp else 0.0)
        full_logits, loss_value = logits.full_tensor(), loss.full_tensor()
    else:
        assert type(logits) is torch.Tensor and logits.shape == (4 // dp, 8, cfg.vocab_size)
        # plain local logits: the loss over the global batch is the mean of the dp ranks' means (same token count)
        loss = F.cross_entropy(logits.flatten(0, 1), my_targets.flatten(), reduction="sum")
        count = (targets != -100).sum()
        loss = loss / count
        full_logits, loss_value = _gather_dp(logits, mesh, dp), _sum_dp(loss.detach(), mesh, dp)
    loss.backward()

    torch.testing.assert_close(full_logits, ref_logits, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(loss_value, ref_loss, rtol=RTOL, atol=ATOL)
    names = [n for n, _ in ref.named_parameters()]
    assert names == [n for n, _ in par.named_parameters()]
    for name, p in par.named_parameters():
        assert tuple(p.grad.placements) == tuple(p.placements), (name, p.grad.placements, p.placements)
        torch.testing.assert_close(p.grad.full_tensor(), ref.get_parameter(name).grad, rtol=RTOL, atol=ATOL,
                                   msg=lambda m, name=name: f"{name}: {m}")
    assert ref_drop.keys() == par_drop.keys()
    for name in ref_drop:
        for a, b in zip(ref_drop[name], par_drop[name]):  # b is the parallel output's full_tensor()
            assert torch.equal(a == 0, b == 0), f"dropout mask of {name} differs"
    if dropout:
        assert any((t == 0).any() for ts in ref_drop.values() for t in ts), "dropout dropped nothing"
    return par


def _gather_dp(x, mesh, dp: int):
    import torch
    import torch.distributed as dist

    if dp == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(dp)]
    dist.all_gather(parts, x.contiguous(), group=mesh.get_group("dp"))
    return torch.cat(parts)


def _sum_dp(x, mesh, dp: int):
    import torch.distributed as dist

    if dp > 1:
        dist.all_reduce(x, group=mesh.get_group("dp"))
    return x


@multi_rank(world_sizes=[2, 4])
def test_gpt_matches_single_device(world_size):
    from vescale.parallel import plan_report

    if world_size == 2:
        # plain TP, logits gathered at the boundary, tied embeddings
        _run_case({"tp": 2}, sp=False, dropout=0.0, tie=True, loss_parallel=False, deferred=False)
        # SP + dropout + vocab-parallel loss with label smoothing, weights materialised from deferred init
        par = _run_case({"tp": 2}, sp=True, dropout=0.1, tie=False, loss_parallel=True, deferred=True)
        report = plan_report(par)
        entry = report.for_fqn("layers.1.attn.wo.weight")
        assert entry.placements == "[S(1)]" and entry.pattern == r"layers\.\d+\.attn\.wo\.weight"
        assert report.for_fqn("norm.weight").pattern is None  # replicated by default
        assert any(e.kind == "input" and e.fqn == "layers.0.attn" and e.pattern == r"layers\.\d+\.attn"
                   for e in report.entries)
        assert "layers\\.\\d+\\.attn" in str(report)
        import json

        entries = json.loads(report.to_json())["entries"]
        assert sum(e["kind"] == "parameter" for e in entries) == len(list(par.named_parameters()))
        assert {"kind": "buffer", "fqn": "inv_freq", "shape": [2], "placements": "[R]", "pattern": None} in entries
    else:
        _run_case({"tp": 4}, sp=True, dropout=0.1, tie=False, loss_parallel=True, deferred=False)
        _run_case({"dp": 2, "tp": 2}, sp=True, dropout=0.1, tie=True, loss_parallel=True, deferred=True)
        _run_case({"dp": 2, "tp": 2}, sp=False, dropout=0.0, tie=False, loss_parallel=False, deferred=False)


def test_plan_needs_tp_dim():
    """A plan builder names the missing mesh dim (no ranks needed: meshes are checked by name)."""
    from vescale.core.errors import MeshError
    from vescale.parallel.plans import gpt_plan

    class FakeMesh:
        mesh_dim_names = ("dp",)

    with pytest.raises(MeshError, match="'tp'"):
        gpt_plan(FakeMesh())
