"""strict() / VESCALE_DTENSOR_STRICT, the comm counter, and RaggedShard ops against the single-device tensor
(elementwise bitwise; norms within a float tolerance because the summation order differs)."""

from __future__ import annotations

from vescale.core.testing import multi_rank


@multi_rank(world_sizes=[2, 4])
def test_strict_mode(world_size):
    import os

    import pytest
    import torch

    from vescale.dtensor import (
        Replicate,
        Shard,
        StrictRedistributeError,
        count_comms,
        distribute_tensor,
        init_device_mesh,
        is_strict,
        redistribute,
        strict,
    )

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    a_full, b_full = torch.arange(16.0).view(4, 4), torch.arange(16.0).view(4, 4).t().contiguous()
    a = distribute_tensor(a_full, mesh, [Shard(0)])
    b = distribute_tensor(b_full, mesh, [Shard(0)])
    with strict():
        assert is_strict()
        with pytest.raises(StrictRedistributeError) as err:
            a @ b
        msg = str(err.value)
        assert "aten.mm" in msg and "(Shard(dim=0),)" in msg and "(Replicate(),)" in msg and "('tp',)" in msg
        with count_comms() as c:
            b_rep = b.redistribute(mesh, [Replicate()])  # explicit: allowed
            y = a @ b_rep  # no redistribution needed: allowed
            z = redistribute(y, mesh, [Replicate()])
        assert torch.equal(z.to_local(), a_full @ b_full)
        assert c.counts["all_gather_into_tensor"] == 2 and c.total == 2
        with strict(False):
            assert torch.equal((a @ b).full_tensor(), a_full @ b_full)
    assert not is_strict()
    assert torch.equal((a @ b).full_tensor(), a_full @ b_full)
    os.environ["VESCALE_DTENSOR_STRICT"] = "1"
    try:
        assert is_strict()
        with pytest.raises(StrictRedistributeError):
            a @ b
    finally:
        del os.environ["VESCALE_DTENSOR_STRICT"]


@multi_rank(world_sizes=[1, 2, 4])
def test_ragged_ops(world_size):
    import torch
    import torch.distributed as dist

    from vescale.dtensor import (
        RaggedShard,
        Replicate,
        Shard,
        count_comms,
        distribute_tensor,
        full_tensor,
        init_device_mesh,
        redistribute,
    )
    from vescale.dtensor.ragged import ragged_map, ragged_norm, ragged_total_norm

    mesh = init_device_mesh("cpu", (world_size,))
    units = {1: [(5,)], 2: [(3, 2), (0, 5)], 4: [(1, 0, 3, 1), (2, 1, 1, 1)]}[world_size]
    g = torch.Generator().manual_seed(0)
    full = torch.randn(10, 3, generator=g)
    other = torch.randn(10, 3, generator=g)
    dist.broadcast(full, 0)
    dist.broadcast(other, 0)
    for u in units:
        for dims in ((0,), (0, 1)):
            p = RaggedShard(dims, u)
            a = distribute_tensor(full, mesh, [p])
            b = distribute_tensor(other, mesh, [p])
            assert a.to_local().shape[0] == p.local_shape(full.shape, dist.get_rank())[0]
            with count_comms() as c:
                assert torch.equal(full_tensor(a), full)
            assert c.total == 1
            out = ragged_map(lambda x, y: x * 2.0 + y.exp(), a, b)
            assert torch.equal(full_tensor(out), full * 2.0 + other.exp())
            for ord in (2.0, 1.0, float("inf")):
                want = torch.linalg.vector_norm(full, ord)
                torch.testing.assert_close(ragged_norm(a, ord), want, rtol=1e-6, atol=1e-6)
            both = torch.linalg.vector_norm(torch.cat([full.flatten(), other.flatten()]))
            torch.testing.assert_close(ragged_total_norm([a, b]), both, rtol=1e-6, atol=1e-6)
            other_ragged = RaggedShard((0,), {1: (1,), 2: (1, 4), 4: (1, 1, 2, 1)}[world_size])
            for dst in ([Replicate()], [Shard(0)], [Shard(1)], [other_ragged]):
                r = redistribute(a, mesh, dst)
                assert torch.equal(full_tensor(r), full)
                assert torch.equal(redistribute(r, mesh, [p]).to_local(), a.to_local())


@multi_rank(world_sizes=[4])
def test_ragged_on_2d_mesh_with_replicate():
    """A ragged dp dim next to a replicated tp dim (ZeRO inside a tp group): gather, RNG and norms still match."""
    import torch

    from vescale.dtensor import RaggedShard, Replicate, distribute_tensor, full_tensor, init_device_mesh, redistribute
    from vescale.dtensor import random as R
    from vescale.dtensor.ragged import ragged_norm

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    full = torch.arange(30.0)
    for pls in ([RaggedShard((0,), (1, 4)), Replicate()], [Replicate(), RaggedShard((0,), (3, 2))]):
        d = distribute_tensor(full, mesh, pls)
        assert torch.equal(full_tensor(d), full)
        torch.testing.assert_close(ragged_norm(d), torch.linalg.vector_norm(full))
        assert torch.equal(redistribute(d, mesh, [Replicate(), Replicate()]).to_local(), full)
        R.manual_seed(8)
        torch.nn.init.normal_(d)
        R.manual_seed(8)
        assert torch.equal(full_tensor(d), R.normal_(torch.empty(30)))
    R.uninstall()
