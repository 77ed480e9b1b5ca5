"""from_local with uneven shards: global shape inference and the cross-rank check (values compared bitwise)."""

from __future__ import annotations

import pytest

from vescale.core.testing import multi_rank


@multi_rank(world_sizes=[1, 2, 4])
def test_from_local_uneven_infers_and_checks(world_size):
    import torch

    from vescale.dtensor import InterleavedShard, PlacementError, Shard, from_local, init_device_mesh
    from vescale.dtensor.layout import local_slice

    mesh = init_device_mesh("cpu", (world_size,))
    for shape, pl in [((7, 3), Shard(0)), ((2, 5), Shard(1)), ((0, 4), Shard(0)), ((9, 2), InterleavedShard(0, 3)),
                      ((3,), Shard(0))]:
        full = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).view(shape)
        local = local_slice(full, mesh, [pl])
        inferred = from_local(local, mesh, [pl], check=True)
        assert tuple(inferred.shape) == shape and inferred.stride() == full.stride()
        assert torch.equal(inferred.full_tensor(), full)
        given_shape = from_local(local, mesh, [pl], shape=shape, check=True)
        assert torch.equal(given_shape.full_tensor(), full)
    # every rank raises the same error, naming the rank whose local shape is wrong
    wrong = torch.zeros(dist_rank() + 1, 3)
    if world_size > 1:
        msg = r"rank 0 \(mesh coordinate \(0,\)\) has local shape \(1, 3\), expected \(2, 3\)"
        with pytest.raises(PlacementError, match=msg):
            from_local(wrong, mesh, [Shard(0)], shape=(world_size * 2, 3), check=True)
    with pytest.raises(PlacementError, match="2 placements"):
        from_local(wrong, mesh, [Shard(0), Shard(1)])
    with pytest.raises(PlacementError, match="out of range"):
        from_local(wrong, mesh, [Shard(3)], shape=(4, 3))


def dist_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()


@multi_rank(world_sizes=[4])
def test_from_local_2d_mesh_infers_shape():
    import torch

    from vescale.dtensor import Replicate, Shard, from_local, init_device_mesh
    from vescale.dtensor.layout import local_slice

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    cases = [((5, 3), (Shard(0), Shard(1))), ((7, 2), (Shard(0), Shard(0))), ((3, 3), (Replicate(), Shard(0)))]
    for shape, pls in cases:
        full = torch.arange(torch.Size(shape).numel(), dtype=torch.float64).view(shape)
        d = from_local(local_slice(full, mesh, pls), mesh, pls, check=True)
        assert tuple(d.shape) == shape
        assert torch.equal(d.full_tensor(), full)


def test_interleaved_is_torch_strided_shard():
    from torch.distributed.tensor.placement_types import _StridedShard

    from vescale.dtensor import InterleavedShard, PlacementError, as_interleaved, is_interleaved

    p = InterleavedShard(0, 3)
    assert p == _StridedShard(0, split_factor=3) and _StridedShard(0, split_factor=3) == p
    assert hash(p) == hash(_StridedShard(0, split_factor=3))
    assert as_interleaved(_StridedShard(1, split_factor=2)) == InterleavedShard(1, 2)
    assert repr(as_interleaved(_StridedShard(1, split_factor=2))) == "InterleavedShard(dim=1, interleaved_size=2)"
    assert is_interleaved(p) and p.interleaved_size == 3
    with pytest.raises(PlacementError):
        InterleavedShard(0, 0)


def test_placement_errors_name_the_problem():
    from vescale.dtensor import PlacementError, RaggedShard

    with pytest.raises(PlacementError, match="leading dims"):
        RaggedShard((1,), [1, 1])
    with pytest.raises(PlacementError, match="not divisible into 3 units"):
        RaggedShard((0,), [1, 2]).unit_len((4, 2))
    assert RaggedShard((0, 1), [1, 0, 2]).local_shape((3, 4, 5), 2) == (8, 5)


@multi_rank(world_sizes=[2, 4])
def test_local_chunks_rebuild_the_global_tensor(world_size):
    """The chunk metadata of each rank, applied to its local tensor, rebuilds the global tensor exactly."""
    import torch
    import torch.distributed as dist

    from vescale.dtensor import InterleavedShard, RaggedShard, Replicate, Shard, distribute_tensor, init_device_mesh
    from vescale.dtensor.layout import local_chunks

    meshes = [init_device_mesh("cpu", (world_size,))]
    if world_size == 4:
        meshes.append(init_device_mesh("cpu", (2, 2)))
    full = torch.arange(12 * 5, dtype=torch.float32).view(12, 5)
    for mesh in meshes:
        cases = ([[InterleavedShard(0, 3)], [Shard(1)], [RaggedShard((0,), {2: (1, 2), 4: (1, 0, 3, 2)}[world_size])]]
                 if mesh.ndim == 1 else [[Shard(1), InterleavedShard(0, 2)], [InterleavedShard(0, 3), Replicate()]])
        for pls in cases:
            d = distribute_tensor(full, mesh, pls)
            rebuilt = torch.zeros_like(full)
            chunks = local_chunks(full.shape, mesh, d.placements)
            local = d.to_local()
            for c in chunks:
                g = tuple(slice(o, o + n) for o, n in zip(c.global_offset, c.size))
                loc = tuple(slice(o, o + n) for o, n in zip(c.local_offset, c.size))
                rebuilt[g] = local[loc]
            covered = sum(torch.Size(c.size).numel() for c in chunks)
            assert covered == local.numel()
            dist.all_reduce(rebuilt)  # every element is written by exactly (number of replicas) ranks
            replicas = 1 if mesh.ndim == 1 else (2 if isinstance(pls[1], Replicate) else 1)
            assert torch.equal(rebuilt, full * replicas), pls
            if isinstance(pls[0], InterleavedShard) and mesh.ndim == 1:
                assert len(chunks) == 3  # one box per interleaved chunk
