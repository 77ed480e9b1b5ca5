"""Shape ops on DTensors of every vescale placement against the same op on the plain tensor (bitwise: only data
movement is involved, values are float64 integers).

Hypothesis draws a shape, placements (``InterleavedShard``, uneven ``Shard``, ``Replicate``, and ``RaggedShard`` on
1-d meshes) and one shape op (view/reshape to a random factorisation, flatten, unflatten, split, chunk, narrow,
strided slice, cat, stack, transpose, permute, contiguous after transpose, clone, expand) over 1-d meshes of 2 and 4
ranks and a 2x2 mesh. The examples are drawn (derandomised) in the test process and each example set runs inside one
multi-rank call. Each result must be a DTensor whose ``full_tensor()`` and local pieces equal the plain op's result and
its slice, with the input gradient of ``(full_tensor(out) * g).sum()`` equal to the plain one, or the op must raise
an error that says what to do (redistribute) or names the placement torch cannot handle (``RaggedShard``).
"""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vescale.core.testing import run_on_ranks

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
                    database=None)

#: Substrings of an acceptable refusal: torch's and vescale's errors that tell the user to redistribute, or name the
#: placement torch's ops do not know.
CLEAR_ERRORS = ("redistribute", "RaggedShard", "RS(")


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


def _check(mesh, case):
    """Run one case on every rank; return "ok" or "refused: <error>" (asserting the refusal is a clear one)."""
    import torch

    from vescale.dtensor import RaggedShard, distribute_tensor, full_tensor
    from vescale.dtensor.layout import local_slice

    shape, specs, op = case
    placements = [_placement(s) for s in specs]
    ragged = any(isinstance(p, RaggedShard) for p in placements)
    full = torch.arange(math.prod(shape), dtype=torch.float64).view(shape)
    ref_in = full.clone().requires_grad_()
    ref = _apply(op, ref_in)
    g = torch.arange(ref.numel(), dtype=torch.float64).view(ref.shape) % 7 + 1
    where = f"{op} on shape {shape} placements {placements} mesh {tuple(mesh.shape)}"
    x = distribute_tensor(full, mesh, placements)
    if not ragged:
        x.requires_grad_()
    try:
        out = _apply(op, x)
    except Exception as e:  # every refusal must be a clear one
        msg = str(e)
        assert any(s in msg for s in CLEAR_ERRORS), f"{where}: unclear error {type(e).__name__}: {msg}"
        return f"refused: {type(e).__name__}"
    assert tuple(out.shape) == tuple(ref.shape), (where, out.shape, ref.shape)
    got = full_tensor(out)
    assert torch.equal(got, ref.detach()), f"{where}: output placed {out.placements} differs from the plain op"
    if not any(isinstance(p, RaggedShard) for p in out.placements):
        want = local_slice(ref.detach(), mesh, out.placements)
        assert torch.equal(out.to_local(), want), f"{where}: local piece of {out.placements} is wrong"
    # torch's backward of split/chunk with unused pieces mixes plain zeros into a DTensor cat, whatever the placement
    if not ragged and op[0] not in ("split", "chunk"):
        (ref * g).sum().backward()
        try:
            (got * g).sum().backward()
        except Exception as e:
            raise AssertionError(f"{where}: backward (output {out.placements}) raised {e}") from e
        assert torch.equal(full_tensor(x.grad), ref_in.grad), f"{where}: gradient (output {out.placements}) differs"
    return "ok"


def _run_all(mesh_shape, cases):
    from vescale.dtensor import init_device_mesh

    mesh = init_device_mesh("cpu", mesh_shape)
    return [_check(mesh, case) for case in cases]


@pytest.mark.parametrize("mesh_shape", [(2,), (4,), (2, 2)], ids=str)
def test_shape_ops_match_plain_tensor(mesh_shape):
    cases = []

    @SETTINGS
    @given(_case(mesh_shape))
    def collect(case):
        cases.append(case)

    collect()
    results = run_on_ranks(_run_all, math.prod(mesh_shape), mesh_shape, cases)
    assert results[0] == results[-1]  # every rank took the same branch
    # the draw exercises interleaved inputs, and most cases compute rather than refuse
    assert sum(any(s[0] == "I" for s in c[1]) for c in cases) >= len(cases) // 3
    assert results[0].count("ok") >= len(cases) // 2, list(zip(cases, results[0]))
