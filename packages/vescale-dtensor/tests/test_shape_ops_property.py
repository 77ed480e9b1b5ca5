"""Shape ops on DTensors of every vescale placement against the same op on the plain tensor (bitwise: only data
movement is involved, values are float64 integers).

Hypothesis draws a shape, placements (``InterleavedShard``, uneven ``Shard``, ``Replicate``, and ``RaggedShard`` on
1-d meshes) and one shape op (view/reshape to a random factorisation, flatten, unflatten, split, chunk, narrow,
strided slice, cat, stack, transpose, permute, contiguous after transpose, clone, expand) over 1-d meshes of 2 and 4
ranks and a 2x2 mesh. The examples are drawn (derandomised) in the test process and each example set runs inside one
multi-rank call. Each result must be a DTensor whose ``full_tensor()`` and local pieces equal the plain op's result and
its slice, with the input gradient of ``sum_i (full_tensor(piece_i) * g_i).sum()`` over every piece (all pieces of a
split or chunk) equal to the plain one. Views of the contiguous input (view, reshape, flatten, unflatten) must share
its local storage and issue no collective.

A refusal is accepted only as a named error type, never by its message: a ``PlacementError`` for a ``RaggedShard``
input (torch's shape ops do not know it) and a ``ViewRedistributeError`` for a view that no placement keeps a view
of the local shards; any other exception, or a refusal of another op, fails. The share of refused views is bounded
per mesh (:data:`MAX_VIEW_REFUSED`, with the measured shares).
"""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vescale.core.testing import run_on_ranks

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
                    database=None)


def _placement(spec):
    from vescale.dtensor import InterleavedShard, RaggedShard, Replicate, Shard

    if spec[0] == "R":
        return Replicate()
    if spec[0] == "S":
        return Shard(spec[1])
    if spec[0] == "I":
        return InterleavedShard(spec[1], spec[2])
    return RaggedShard(spec[1], spec[2])


def _prime_factors(n: int) -> list[int]:
    out, p = [], 2
    while n > 1:
        while n % p == 0:
            out.append(p)
            n //= p
        p += 1
    return out


@st.composite
def _placements(draw, shape, mesh_shape):
    inter = [d for d in range(len(shape)) if any(shape[d] % k == 0 for k in (2, 3, 4))]
    if len(mesh_shape) == 1 and draw(st.integers(0, 5)) == 5:  # ragged: contiguous units of the leading dims
        k = draw(st.integers(1, len(shape)))
        rows = math.prod(shape[:k])
        total = draw(st.sampled_from([t for t in range(1, rows + 1) if rows % t == 0]))
        cuts = sorted(draw(st.lists(st.integers(0, total), min_size=mesh_shape[0] - 1, max_size=mesh_shape[0] - 1)))
        bounds = [0, *cuts, total]
        return [("G", tuple(range(k)), tuple(bounds[i + 1] - bounds[i] for i in range(mesh_shape[0])))]
    out = []
    interleaved = set()
    for _ in mesh_shape:
        kinds = ["I", "S", "I", "R"] if inter else ["S", "R"]
        kind = draw(st.sampled_from(kinds))
        free = [d for d in range(len(shape)) if d not in interleaved]  # no shard of a dim after its interleave
        if kind == "S" and free:
            out.append(("S", draw(st.sampled_from(free))))
        elif kind == "I" and [d for d in inter if d in free]:
            d = draw(st.sampled_from([d for d in inter if d in free]))
            out.append(("I", d, draw(st.sampled_from([k for k in (2, 3, 4) if shape[d] % k == 0]))))
            interleaved.add(d)
        else:
            out.append(("R",))
    return out


@st.composite
def _op(draw, shape):
    nd = len(shape)
    d = draw(st.integers(0, nd - 1))
    kind = draw(st.sampled_from(["view", "view", "reshape", "flatten", "unflatten", "unflatten", "split", "chunk",
                                 "narrow", "slice", "cat", "stack", "transpose", "permute", "contiguous", "clone",
                                 "expand"]))
    if kind in ("view", "reshape"):
        primes = draw(st.permutations(_prime_factors(math.prod(shape))))
        cuts = sorted(draw(st.lists(st.integers(0, len(primes)), min_size=0, max_size=3)))
        bounds = [0, *cuts, len(primes)]
        return (kind, tuple(math.prod(primes[bounds[i]:bounds[i + 1]]) for i in range(len(bounds) - 1)))
    if kind == "flatten":
        start = draw(st.integers(0, nd - 1))
        return ("flatten", start, draw(st.integers(start, nd - 1)))
    if kind == "unflatten":
        a = draw(st.sampled_from([k for k in range(1, shape[d] + 1) if shape[d] % k == 0]))
        return ("unflatten", d, (a, shape[d] // a))
    if kind == "split":
        size = draw(st.integers(1, max(shape[d], 1)))
        return ("split", d, size, draw(st.integers(0, -(-shape[d] // size) - 1)))
    if kind == "chunk":
        n = draw(st.integers(1, max(shape[d], 1)))
        return ("chunk", d, n, draw(st.integers(0, len(range(0, shape[d], -(-shape[d] // n))) - 1)))
    if kind == "narrow":
        start = draw(st.integers(0, shape[d] - 1))
        return ("narrow", d, start, draw(st.integers(1, shape[d] - start)))
    if kind == "slice":
        start = draw(st.integers(0, shape[d] - 1))
        return ("slice", d, start, draw(st.integers(start + 1, shape[d])), draw(st.integers(1, 3)))
    if kind in ("cat", "stack", "expand"):
        return (kind, draw(st.integers(0, nd - 1 if kind == "cat" else nd)))
    if kind in ("transpose", "contiguous"):
        return (kind, d, draw(st.integers(0, nd - 1)))
    if kind == "permute":
        return ("permute", tuple(draw(st.permutations(range(nd)))))
    return ("clone",)


@st.composite
def _case(draw, mesh_shape):
    nd = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.sampled_from([6, 4, 12, 8, 3, 2, 5, 1]), min_size=nd, max_size=nd)))
    return shape, draw(_placements(shape, mesh_shape)), draw(_op(shape))


def _apply(op, t):
    import torch

    kind, args = op[0], op[1:]
    if kind == "view":
        return t.view(args[0])
    if kind == "reshape":
        return t.reshape(args[0])
    if kind == "flatten":
        return t.flatten(*args)
    if kind == "unflatten":
        return t.unflatten(*args)
    if kind == "split":
        return t.split(args[1], args[0])[args[2]]
    if kind == "chunk":
        return t.chunk(args[1], args[0])[args[2]]
    if kind == "narrow":
        return t.narrow(*args)
    if kind == "slice":
        d, start, stop, step = args
        return t[(slice(None),) * d + (slice(start, stop, step),)]
    if kind == "cat":
        return torch.cat([t, t], args[0])
    if kind == "stack":
        return torch.stack([t, t], args[0])
    if kind == "transpose":
        return t.transpose(*args)
    if kind == "contiguous":
        return t.transpose(*args).contiguous()
    if kind == "permute":
        return t.permute(args[0])
    if kind == "expand":
        u = t.unsqueeze(args[0])
        sizes = list(u.shape)
        sizes[args[0]] = 3
        return u.expand(sizes)
    return t.clone()


#: The ops that are views of a contiguous input on one device and go through ``aten.view``: a result must share the
#: input's local storage and issue no collective; a refusal must be a ``ViewRedistributeError``.
VIEW_KINDS = ("view", "reshape", "flatten", "unflatten")


def _named_refusal(error: BaseException, kinds: tuple[type, ...]) -> BaseException | None:
    """The first exception of ``error``'s ``__cause__`` chain that is one of ``kinds`` (torch's dispatcher re-raises
    a sharding rule's error as ``RuntimeError`` from it), else None."""
    while error is not None:
        if isinstance(error, kinds):
            return error
        error = error.__cause__
    return None


def _pieces(op, t):
    """All results of ``op`` on ``t`` (every piece of a split or chunk, so that their backward is torch's cat of real
    gradients), and the index of the one ``op`` selects."""
    kind, args = op[0], op[1:]
    if kind == "split":
        return list(t.split(args[1], args[0])), args[2]
    if kind == "chunk":
        return list(t.chunk(args[1], args[0])), args[2]
    return [_apply(op, t)], 0


def _check(mesh, case):
    """Run one case on every rank; return "ok", "refused: view" or "refused: ragged" (asserting the refusal is one of
    the named errors allowed for it)."""
    import torch

    from vescale.dtensor import (
        PlacementError,
        RaggedShard,
        ViewRedistributeError,
        count_comms,
        distribute_tensor,
        full_tensor,
    )
    from vescale.dtensor.layout import local_slice

    shape, specs, op = case
    placements = [_placement(s) for s in specs]
    ragged = any(isinstance(p, RaggedShard) for p in placements)
    full = torch.arange(math.prod(shape), dtype=torch.float64).view(shape)
    ref_in = full.clone().requires_grad_()
    ref_pieces, pick = _pieces(op, ref_in)
    ref = ref_pieces[pick]
    where = f"{op} on shape {shape} placements {placements} mesh {tuple(mesh.shape)}"
    x = distribute_tensor(full, mesh, placements)
    if not ragged:
        x.requires_grad_()
    try:
        with count_comms() as comms:
            pieces, _ = _pieces(op, x)
    except Exception as e:  # a refusal must be one of the named errors allowed for this case, nothing else
        if ragged:  # torch's shape ops do not know RaggedShard: vescale refuses them
            assert _named_refusal(e, (PlacementError,)) is not None, f"{where}: {type(e).__name__}: {e}"
            return "refused: ragged"
        assert op[0] in VIEW_KINDS, f"{where}: only views may be refused, got {type(e).__name__}: {e}"
        assert _named_refusal(e, (ViewRedistributeError,)) is not None, f"{where}: {type(e).__name__}: {e}"
        assert comms.total == 0, f"{where}: refused after {comms.counts}"
        return "refused: view"
    out = pieces[pick]
    assert tuple(out.shape) == tuple(ref.shape), (where, out.shape, ref.shape)
    if op[0] in VIEW_KINDS:  # a view of the local tensor, not a gathered copy
        assert comms.total == 0, f"{where}: the view issued {comms.counts}"
        assert out.to_local().untyped_storage().data_ptr() == x.to_local().untyped_storage().data_ptr(), where
    got = full_tensor(out)
    assert torch.equal(got, ref.detach()), f"{where}: output placed {out.placements} differs from the plain op"
    if not any(isinstance(p, RaggedShard) for p in out.placements):
        want = local_slice(ref.detach(), mesh, out.placements)
        assert torch.equal(out.to_local(), want), f"{where}: local piece of {out.placements} is wrong"
    if ragged:
        return "ok"  # torch's backward of the ops above does not know RaggedShard
    # the input gradient of sum_i (piece_i * g_i).sum() over every piece (one piece but for split and chunk)
    grads = [torch.arange(p.numel(), dtype=torch.float64).view(p.shape) % 7 + 1 + i for i, p in enumerate(ref_pieces)]
    sum((p * g).sum() for p, g in zip(ref_pieces, grads)).backward()
    try:
        sum((full_tensor(p) * g).sum() for p, g in zip(pieces, grads)).backward()
    except Exception as e:
        raise AssertionError(f"{where}: backward (output {out.placements}) raised {e}") from e
    assert torch.equal(full_tensor(x.grad), ref_in.grad), f"{where}: gradient (output {out.placements}) differs"
    return "ok"


def _run_all(mesh_shape, cases):
    from vescale.dtensor import init_device_mesh

    mesh = init_device_mesh("cpu", mesh_shape)
    return [_check(mesh, case) for case in cases]


#: Upper bounds on the share of examples whose view is refused (``ViewRedistributeError``), per mesh. Measured on the
#: derandomised draw of 150 examples per mesh (hypothesis 6.x): 16 (10.7 %) on 2 ranks, 12 (8.0 %) on 4 ranks and 32
#: (21.3 %) on 2x2, where interleaved placements on both mesh dims often meet in one view group. Ragged inputs (27 and
#: 24 of the 1-d examples) are refused by design except ``clone`` (26 and 21 refused). The bounds leave one to three
#: points for another hypothesis version's draw; a rule that starts refusing views it kept fails here.
MAX_VIEW_REFUSED = {(2,): 0.12, (4,): 0.10, (2, 2): 0.24}


@pytest.mark.parametrize("mesh_shape", [(2,), (4,), (2, 2)], ids=str)
def test_shape_ops_match_plain_tensor(mesh_shape):
    cases = []

    @SETTINGS
    @given(_case(mesh_shape))
    def collect(case):
        cases.append(case)

    collect()
    results = run_on_ranks(_run_all, math.prod(mesh_shape), mesh_shape, cases)
    assert all(r == results[0] for r in results)  # every rank took the same branch
    outcome = results[0]
    ragged = [c[1][0][0] == "G" for c in cases]
    # the draw exercises interleaved inputs
    assert sum(any(s[0] == "I" for s in c[1]) for c in cases) >= len(cases) // 3
    # refusals: ragged inputs only as ragged refusals, and views within the measured bound
    assert all(is_ragged for is_ragged, r in zip(ragged, outcome) if r == "refused: ragged")
    refused_views = outcome.count("refused: view")
    assert refused_views <= MAX_VIEW_REFUSED[mesh_shape] * len(cases), (
        f"{refused_views} of {len(cases)} views refused: "
        f"{[c for c, r in zip(cases, outcome) if r == 'refused: view']}")
    assert outcome.count("ok") + refused_views + outcome.count("refused: ragged") == len(cases)
