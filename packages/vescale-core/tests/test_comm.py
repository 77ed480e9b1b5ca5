"""vescale.core.comm: the one collective counter (calls, bytes, mesh dims)."""

from __future__ import annotations

from vescale.core.testing import multi_rank


@multi_rank(world_sizes=[4])
def test_counts_calls_bytes_and_mesh_dims_of_functional_and_eager_collectives():
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from vescale.core.comm import count_comms
    from vescale.core.mesh import init_mesh

    mesh = init_mesh({"dp": 2, "tp": 2})
    x = distribute_tensor(torch.randn(8, 4), mesh["tp"], [Shard(0)])
    with count_comms(mesh) as c:
        x.redistribute(mesh["tp"], [Replicate()])  # functional all-gather of a 4x4 fp32 shard (+ wait_tensor)
        t = torch.ones(3)
        dist.all_reduce(t, group=mesh.get_group("dp"))  # c10d op, 12 bytes
        dist.all_reduce(t)  # the whole world: both dims
        out = torch.empty(6)
        dist.all_gather_into_tensor(out, t, group=mesh.get_group("tp"))  # counts the 12-byte input, not the output
    assert dict(c.counts) == {"all_gather_into_tensor": 2, "all_reduce": 2} and c.total == 4
    assert dict(c.bytes) == {"all_gather_into_tensor": 64 + 12, "all_reduce": 24} and c.total_bytes == 100
    assert c.dim_counts == {"tp": {"all_gather_into_tensor": 2}, "dp": {"all_reduce": 1}, "dp,tp": {"all_reduce": 1}}
    assert c.dim_bytes["tp"] == {"all_gather_into_tensor": 76}
    summary = c.summary()
    assert summary["total"] == 4
    assert summary["per_dim"]["dp"] == {"counts": {"all_reduce": 1}, "bytes": {"all_reduce": 12}}

    with c:  # entering again starts from zero
        dist.broadcast(t, src=0)
    assert dict(c.counts) == {"broadcast": 1} and c.dim_counts == {"dp,tp": {"broadcast": 1}}


@multi_rank(world_sizes=[2])
def test_without_a_mesh_there_are_no_dims_and_a_model_runs_unchanged():
    import torch
    from torch import nn

    from vescale.core.comm import count_comms

    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    x = torch.randn(3, 4)
    want = model(x)
    with count_comms() as c:
        got = model(x)
        got.sum().backward()
    assert torch.equal(got, want) and c.total == 0 and c.dim_counts == {} and "per_dim" not in c.summary()
    # it installs no module hooks (torch's CommDebugMode does; see the module docstring)
    assert not any(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks for m in model.modules())


def test_collective_names():
    import torch

    from vescale.core.comm import collective_name

    assert collective_name(torch.ops.c10d.allreduce_.default) == "all_reduce"
    assert collective_name(torch.ops.c10d._allgather_base_.default) == "all_gather_into_tensor"
    assert collective_name(torch.ops._c10d_functional.reduce_scatter_tensor.default) == "reduce_scatter_tensor"
    assert collective_name(torch.ops._c10d_functional.wait_tensor.default) is None
    assert collective_name(torch.ops.aten.add.Tensor) is None
