"""Placements and redistribution against the single-device tensor (bitwise: only data movement is involved).

Hypothesis draws shapes (uneven, zero-size dims) and placement pairs over 1-d meshes of 1, 2, 4 ranks and a 2x2
mesh; each example runs on pooled ranks: distribute, redistribute, ``full_tensor`` and the local pieces must equal the
slices of the global tensor.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vescale.core.testing import run_on_ranks

SETTINGS = settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)


def _placement(spec):
    from vescale.dtensor import InterleavedShard, Partial, RaggedShard, Replicate, Shard

    kind = spec[0]
    if kind == "R":
        return Replicate()
    if kind == "S":
        return Shard(spec[1])
    if kind == "I":
        return InterleavedShard(spec[1], spec[2])
    if kind == "P":
        return Partial()
    return RaggedShard(spec[1], spec[2])


@st.composite
def _dim_placement(draw, shape, mesh_size, allow_partial, ragged_ok):
    kinds = ["R", "S"]
    if allow_partial:
        kinds.append("P")
    inter = [d for d in range(len(shape)) if shape[d] > 0 and any(shape[d] % k == 0 for k in (2, 3))]
    if inter:
        kinds.append("I")
    if ragged_ok and math.prod(shape) > 0:
        kinds.append("G")
    kind = draw(st.sampled_from(kinds))
    if kind == "S":
        return ("S", draw(st.integers(0, len(shape) - 1)))
    if kind == "I":
        d = draw(st.sampled_from(inter))
        return ("I", d, draw(st.sampled_from([k for k in (2, 3) if shape[d] % k == 0])))
    if kind == "G":
        k = draw(st.integers(1, len(shape)))
        rows = math.prod(shape[:k])
        total = draw(st.sampled_from([t for t in range(1, rows + 1) if rows % t == 0]))
        # split `total` units (a divisor of the rows) at random cut points: uneven and empty pieces included
        cuts = sorted(draw(st.lists(st.integers(0, total), min_size=mesh_size - 1, max_size=mesh_size - 1)))
        bounds = [0, *cuts, total]
        return ("G", tuple(range(k)), tuple(bounds[i + 1] - bounds[i] for i in range(mesh_size)))
    return (kind,)


@st.composite
def _case(draw, mesh_shape):
    shape = tuple(draw(st.lists(st.integers(0, 7), min_size=1, max_size=3)))

    def placements(allow_partial):
        out = []
        for n in mesh_shape:
            ragged_ok = len(mesh_shape) == 1
            out.append(draw(_dim_placement(shape, n, allow_partial, ragged_ok)))
        if len(mesh_shape) == 2:
            # torch cannot redistribute a dim sharded again after an interleaved shard of it
            if out[0][0] == "I" and out[1][0] in "SI" and out[1][1] == out[0][1]:
                out[1] = ("R",)
        return tuple(out)
    return shape, placements(True), placements(False)


def _roundtrip(mesh_shape, case):
    import torch
    import torch.distributed as dist

    from vescale.dtensor import (
        Partial,
        Replicate,
        distribute_tensor,
        from_local,
        full_tensor,
        init_device_mesh,
        redistribute,
    )
    from vescale.dtensor.layout import local_slice

    shape, src, dst = case
    mesh = init_device_mesh("cpu", mesh_shape)
    src = tuple(_placement(p) for p in src)
    dst = tuple(_placement(p) for p in dst)
    g = torch.Generator().manual_seed(hash(str(case)) % 2**31)
    full = torch.randint(-50, 50, shape, generator=g).float()
    dist.broadcast(full, 0)
    if any(isinstance(p, Partial) for p in src):
        # the Partial sum is exact: the first coordinate of each partial mesh dim holds the value, the others zeros
        coord = mesh.get_coordinate()
        owner = all(coord[i] == 0 for i, p in enumerate(src) if isinstance(p, Partial))
        local = local_slice(full, mesh, tuple(Replicate() if isinstance(p, Partial) else p for p in src))
        a = from_local(local if owner else torch.zeros_like(local), mesh, src, shape=shape)
    else:
        a = distribute_tensor(full, mesh, src)
        assert torch.equal(a.to_local(), local_slice(full, mesh, src)), (shape, src)
        assert torch.equal(full_tensor(a), full), (shape, src)
    b = redistribute(a, mesh, dst)
    assert tuple(b.shape) == shape
    assert torch.equal(b.to_local(), local_slice(full, mesh, dst)), (shape, src, dst, b.to_local())
    assert torch.equal(full_tensor(b), full), (shape, src, dst)
    if not any(isinstance(p, Partial) for p in src):
        back = redistribute(b, mesh, src)
        assert torch.equal(back.to_local(), a.to_local()), (shape, src, dst)


@pytest.mark.parametrize("mesh_shape", [(1,), (2,), (4,), (2, 2)], ids=str)
def test_redistribute_roundtrips(mesh_shape):
    cases = []

    @SETTINGS
    @given(_case(mesh_shape))
    def collect(case):
        cases.append(case)

    collect()
    run_on_ranks(_run_all, math.prod(mesh_shape), mesh_shape, cases)


def _run_all(mesh_shape, cases):
    for case in cases:
        _roundtrip(mesh_shape, case)
    return len(cases)
