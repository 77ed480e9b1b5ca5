"""``dst.copy_(src)`` into a ``Partial`` DTensor from a source of another layout or shape (broadcasting), the rule in
``vescale.dtensor.sharding_rules._copy_into_partial``, against ``copy_`` on one device.

The reference is plain torch: ``torch.empty(dst_shape).copy_(value)``. Values are small integers in float64, so sums
and averages over ranks are exact and the comparison is bitwise. The destination starts as rank-dependent garbage
(every element must be written). Cases cover fewer source dims, size-1 source dims, sharded and partial sources,
uneven shards and an interleaved destination; a source that does not broadcast must raise ``RuntimeError`` on every
rank with no collective issued and the destination untouched.
"""

from __future__ import annotations

from vescale.core.testing import multi_rank, run_on_ranks

#: (destination shape, destination placements, source shape, source placements) on a 1-d mesh
CASES_1D = [
    ((4, 2), ["P"], (2,), ["R"]),  # fewer source dims
    ((4, 2), ["Pavg"], (2,), ["S0"]),  # sharded source (2 over 4 ranks: 1, 1, 0, 0)
    ((3, 5), ["Pmax"], (3, 1), ["S0"]),  # a size-1 source dim, uneven source shards
    ((2, 3, 4), ["P"], (3, 1), ["S0"]),
]

#: the same on a 2x2 mesh, where the destination is also sharded
CASES_2D = [
    ((4, 2), ["P", "S0"], (2,), ["R", "R"]),  # was [[1, 1], [1, 1], [2, 2], [2, 2]] for [[1, 2]] * 4
    ((4, 2), ["P", "S1"], (2,), ["R", "R"]),  # was an IndexError (dst dim 1 applied to the 1-d source)
    ((4, 3), ["S1", "P"], (4, 1), ["R", "R"]),  # a size-1 source dim sharded: ranks disagreed (a hang)
    ((5, 3), ["Pavg", "S0"], (5, 1), ["S0", "R"]),  # uneven shards (3, 2), source sharded on the other mesh dim
    ((2, 5, 4), ["S1", "P"], (5, 4), ["S0", "R"]),  # fewer source dims, the source already sharded as needed
    ((3, 4), ["Pmax", "I1.2"], (4,), ["R", "S0"]),  # interleaved destination dim
    ((6, 4), ["P", "Pavg"], (1, 4), ["R", "S1"]),  # partial on both mesh dims
    ((2, 3), ["S0", "P"], (3,), ["P", "R"]),  # a partial source
]

#: sources that do not broadcast to the destination: (dst shape, dst placements, src shape, src placements)
REFUSED_1D = [((4, 2), ["P"], (3,), ["S0"])]
REFUSED_2D = [((4, 2), ["P", "S0"], (4,), ["R", "S0"]), ((4, 2), ["S1", "P"], (3, 2), ["R", "R"])]


def _placement(code: str):
    from vescale.dtensor import InterleavedShard, Partial, Replicate, Shard

    if code == "R":
        return Replicate()
    if code.startswith("P"):
        return Partial(code[1:] or "sum")
    if code.startswith("S"):
        return Shard(int(code[1:]))
    dim, size = code[1:].split(".")
    return InterleavedShard(int(dim), int(size))


def _garbage_destination(mesh, shape, placements):
    """A DTensor of global ``shape`` placed ``placements`` whose local tensors hold rank-dependent values."""
    import torch
    import torch.distributed as dist

    from vescale.dtensor import from_local
    from vescale.dtensor.layout import local_shape

    local = torch.full(local_shape(shape, mesh, placements), 100.0 + dist.get_rank(), dtype=torch.float64)
    return from_local(local, mesh, placements, shape=shape)


def _check_copies(mesh_shape, cases, refused):
    import pytest
    import torch

    from vescale.dtensor import count_comms, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", mesh_shape)
    for dst_shape, dst_codes, src_shape, src_codes in cases:
        dst_placements = [_placement(c) for c in dst_codes]
        value = torch.arange(1, torch.Size(src_shape).numel() + 1, dtype=torch.float64).view(src_shape)
        want = torch.empty(dst_shape, dtype=torch.float64).copy_(value)  # one device
        dst = _garbage_destination(mesh, dst_shape, dst_placements)
        src = distribute_tensor(value, mesh, [_placement(c) for c in src_codes])
        out = dst.copy_(src)
        where = f"dst {dst_shape} {dst_codes} <- src {src_shape} {src_codes} on mesh {mesh_shape}"
        assert out is dst and tuple(dst.placements) == tuple(dst_placements), where
        got = dst.full_tensor()
        assert torch.equal(got, want), f"{where}: {got.tolist()} != {want.tolist()}"
    for dst_shape, dst_codes, src_shape, src_codes in refused:
        dst_placements = [_placement(c) for c in dst_codes]
        dst = _garbage_destination(mesh, dst_shape, dst_placements)
        before = dst.to_local().clone()
        src = distribute_tensor(torch.ones(src_shape, dtype=torch.float64), mesh, [_placement(c) for c in src_codes])
        where = f"dst {dst_shape} {dst_codes} <- src {src_shape} {src_codes}"
        with pytest.raises(RuntimeError) as plain:  # one device refuses it too, with this error type
            torch.empty(dst_shape).copy_(torch.ones(src_shape))
        with pytest.raises(type(plain.value)) as err, count_comms() as comms:
            dst.copy_(src)
        assert "does not broadcast" in str(err.value) and str(tuple(src_shape)) in str(err.value), (where, err.value)
        assert comms.total == 0, (where, comms.counts)  # refused before any collective, on every rank
        assert torch.equal(dst.to_local(), before), where


@multi_rank(world_sizes=[2, 4], timeout=120)
def test_broadcast_copy_into_partial_on_a_1d_mesh(world_size):
    """On a 1-d mesh the partial mesh dim is the only one: the broadcast copies equal one device, and a source that
    does not broadcast raises on every rank before any collective (it used to be all-gathered first)."""
    _check_copies((world_size,), CASES_1D, REFUSED_1D)


def test_broadcast_copy_into_partial_on_a_2x2_mesh():
    """Destination sharded on one mesh dim and partial on the other: the destination's shard dims are mapped to the
    source's by broadcasting (trailing dims aligned, size-1 and missing source dims replicated)."""
    run_on_ranks(_check_copies, 4, (2, 2), CASES_2D, REFUSED_2D, timeout=120)
