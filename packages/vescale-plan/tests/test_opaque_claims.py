"""An opaque module's output is a partial sum only when its shape-paired projections really are sharded.

The model: a block not traceable on meta that holds an inner opaque module with an unambiguous projection pair
(``[32, 16]`` in, ``[16, 32]`` out) and a second pair of another inner size (48), so that the block finds no pair of
its own and replicates every weight under it, the inner pair's too (JetMoE's decoder layer around its mixture-of-
attention). The inner module must then not be run on local shards with a ``Partial`` output: its replicated
projections compute the whole result on each rank, and a ``Partial`` output would sum ``tp`` copies of it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vescale.core.testing import multi_rank

H = 16


class _Pair(nn.Module):
    """A projection pair behind a data-dependent read (``int()`` of a tensor): opaque, paired by shape."""

    def __init__(self, inner: int) -> None:
        super().__init__()
        self.w_in = nn.Parameter(torch.randn(inner, H) / H**0.5)
        self.w_out = nn.Parameter(torch.randn(H, inner) / inner**0.5)

    def forward(self, x):
        k = int((x > 0).sum()) % 2 + 1
        return F.linear(F.linear(x, self.w_in).relu(), self.w_out) * k


class _Block(nn.Module):
    """Opaque too (its own data-dependent read, after the inner module's call), with pairs of two inner sizes."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = _Pair(32)
        self.w_a = nn.Parameter(torch.randn(48, H) / H**0.5)
        self.w_b = nn.Parameter(torch.randn(H, 48) / 48**0.5)

    def forward(self, x):
        h = x + self.inner(x)
        k = int((h > 0).sum()) % 3 + 1
        return h + F.linear(F.linear(h, self.w_a).tanh(), self.w_b) / k


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, H)
        self.block = _Block()
        self.head = nn.Linear(H, 64)

    def forward(self, ids):
        return self.head(self.block(self.embed(ids)))


def _model() -> _Model:
    torch.manual_seed(0)
    return _Model()


def _roles(plan) -> dict[str, str]:
    return {d.fqn: d.role for d in plan.decisions if d.kind == "parameter"}


def test_a_replicated_pair_inside_a_replicating_opaque_block_gets_no_partial_output():
    from vescale.plan import plan_from_trace, trace_model

    with torch.device("meta"):
        trace = trace_model(_model())
    assert {"block", "block.inner"} <= set(trace.opaque), trace.opaque  # the premise: neither traceable on meta
    plan = plan_from_trace(trace, ["tp"], {"tp": 2})
    roles = _roles(plan)
    assert {roles[f"block.{p}"] for p in ("inner.w_in", "inner.w_out", "w_a", "w_b")} == {"replicated"}, roles
    # the old plan: {"block.inner": [[Partial()]]} in output and local, with both projections replicated
    assert not [k for sec in ("output", "local") for k in plan[sec] if k.startswith("block")], plan
    notes = [d.reason for d in plan.decisions if d.fqn == "block.inner" and d.kind == "local"]
    assert notes and notes[0].startswith("not run on local shards: module block.inner not traceable on meta; paired "
                                         "by shape, but its projection block.inner.w_in is replicated"), notes
    assert plan["output"][""] == [[torch.distributed.tensor.Replicate()]], plan["output"]


def test_an_opaque_pair_alone_still_runs_on_local_shards():
    """The same inner module directly under the root: its pair is sharded and its output stays a partial sum."""
    from torch.distributed.tensor import Partial, Shard

    from vescale.plan import plan_from_trace, trace_model

    class Flat(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.inner, self.head = nn.Embedding(64, H), _Pair(32), nn.Linear(H, 64)

        def forward(self, ids):
            h = self.embed(ids)
            return self.head(h + self.inner(h))

    with torch.device("meta"):
        plan = plan_from_trace(trace_model(Flat()), ["tp"], {"tp": 2})
    assert plan["parameter"]["inner\\.w_in"] == [Shard(0)] and plan["parameter"]["inner\\.w_out"] == [Shard(1)]
    assert plan["local"]["inner"] == [[Partial()]] and plan["output"]["inner"] == [[Partial()]], plan


@multi_rank(world_sizes=[2])
def test_the_nested_opaque_model_equals_one_device(world_size):
    """tp=2: logits and every parameter's gradient equal the single-device run (fp32, rtol 1e-5; the old plan summed
    the inner module's two replicated copies)."""
    from vescale.core.mesh import init_mesh
    from vescale.parallel import parallelize_module
    from vescale.plan import auto_plan

    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 64, (2, 8), generator=gen)
    weight = torch.randn(2, 8, 64, generator=gen)
    ref = _model()
    (ref(ids) * weight).sum().backward()
    mesh = init_mesh({"tp": world_size})
    model = _model()
    plan = auto_plan(model, mesh, example_args=(ids,))
    parallelize_module(model, mesh, plan)
    logits = model(ids)
    (logits * weight).sum().backward()
    full = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
    torch.testing.assert_close(full, ref(ids), rtol=1e-5, atol=1e-6)
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        torch.testing.assert_close(g, q.grad, rtol=1e-5, atol=1e-5, msg=name)
