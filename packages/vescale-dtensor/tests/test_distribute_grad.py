"""``distribute_tensor`` of a leaf that requires grad gives a leaf DTensor that requires grad, for every placement
(torch's ``Shard``/``Replicate``, vescale's ``InterleavedShard`` and ``RaggedShard``, mixes on a 2x2 mesh) and both
``src_data_rank`` values, and its ``.grad`` after a backward is the one-device gradient's local piece.

Reference: plain torch, ``(t ** 2 * w).sum().backward()`` on one process (gradient ``2 * t * w``), float64 small
integers, compared bitwise. With ``src_data_rank=0`` the other ranks pass different data (rank 0's must win); with
``None`` every rank passes the same tensor. The backward runs through ``vescale.dtensor.full_tensor`` (for
``RaggedShard`` its gather, differentiable since this fix too).
"""

from __future__ import annotations

from vescale.core.testing import multi_rank, run_on_ranks

SHAPE = (6, 12)

#: placements on a 1-d mesh of 2 and 4 ranks (ragged local units are per rank, so they are built per world size)
PLACEMENTS_1D = [["S0"], ["S1"], ["R"], ["I0.2"], ["I1.3"], ["G0"], ["G01"]]
#: placements on a 2x2 mesh
PLACEMENTS_2D = [["S0", "S1"], ["S0", "I1.2"], ["I0.2", "R"], ["R", "I0.3"], ["I1.4", "S0"], ["G0", "R"],
                 ["R", "R"]]


def _placement(code: str, mesh_size: int):
    from vescale.dtensor import InterleavedShard, RaggedShard, Replicate, Shard

    if code == "R":
        return Replicate()
    if code[0] == "S":
        return Shard(int(code[1:]))
    if code[0] == "I":
        dim, size = code[1:].split(".")
        return InterleavedShard(int(dim), int(size))
    dims = tuple(int(c) for c in code[1:])
    units = [1 + (r % 2) for r in range(mesh_size)]  # unequal pieces: 1, 2, 1, 2 units
    rows = SHAPE[0] if dims == (0,) else SHAPE[0] * SHAPE[1]
    while rows % sum(units):
        units[-1] += 1
    return RaggedShard(dims, units)


def _check(mesh_shape, codes_list):
    import torch
    import torch.distributed as dist

    from vescale.dtensor import distribute_tensor, full_tensor, init_device_mesh
    from vescale.dtensor.layout import local_slice

    mesh = init_device_mesh("cpu", mesh_shape)
    n = SHAPE[0] * SHAPE[1]
    base = torch.arange(n, dtype=torch.float64).view(SHAPE) % 11 - 5
    w = torch.arange(n, dtype=torch.float64).view(SHAPE) % 7 + 1
    ref_in = base.clone().requires_grad_()
    (ref_in ** 2 * w).sum().backward()
    ref = ref_in.grad  # one device: 2 * t * w
    for codes in codes_list:
        for src_data_rank in (0, None):
            placements = [_placement(c, mesh.size(m)) for m, c in enumerate(codes)]
            where = f"{placements} on mesh {mesh_shape}, src_data_rank={src_data_rank}"
            data = base + 1000 * dist.get_rank() if src_data_rank == 0 else base.clone()  # rank 0's data must win
            t = data.requires_grad_()
            d = distribute_tensor(t, mesh, placements, src_data_rank=src_data_rank)
            assert d.requires_grad and d.is_leaf and d.grad_fn is None, (where, d.requires_grad, d.is_leaf)
            (full_tensor(d) ** 2 * w).sum().backward()  # full_tensor's backward: each rank's piece, no reduction
            assert d.grad is not None, where
            assert tuple(d.grad.placements) == tuple(d.placements), (where, d.grad.placements)
            assert torch.equal(d.grad.to_local(), local_slice(ref, mesh, placements)), where
            assert t.grad is None, where  # the DTensor is a new leaf, as torch's distribute_tensor makes it
            plain = distribute_tensor(base, mesh, placements, src_data_rank=src_data_rank)
            assert not plain.requires_grad and plain.is_leaf, where  # no grad in, no grad out


@multi_rank(world_sizes=[2, 4])
def test_distributed_leaf_requires_grad_on_a_1d_mesh(world_size):
    """1-d meshes of 2 and 4 ranks, every placement kind, both src_data_rank values."""
    _check((world_size,), PLACEMENTS_1D)


def test_distributed_leaf_requires_grad_on_a_2x2_mesh():
    """Mixes of Shard, InterleavedShard, RaggedShard and Replicate on a 2x2 mesh, both src_data_rank values."""
    run_on_ranks(_check, 4, (2, 2), PLACEMENTS_2D)
