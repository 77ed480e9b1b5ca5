"""from_local_nograd: the DTensor torch's from_local makes (global shape, stride, placements, values), built without
its autograd function, its spec reused per (mesh, placements, local shape, stride, dtype); refuses a tensor that
requires grad."""

from __future__ import annotations

import pytest

from vescale.core.testing import multi_rank


@multi_rank(world_sizes=[2])
def test_from_local_nograd_is_from_local_without_autograd():
    import torch
    import torch.distributed as dist

    from vescale.core.torch_internals import dtensor_spec, local_tensor
    from vescale.dtensor import DTensor, Replicate, Shard, init_device_mesh
    from vescale.dtensor.api import from_local_nograd

    mesh = init_device_mesh("cpu", (2,))
    rank = dist.get_rank()
    full = torch.arange(2 * 4 * 6, dtype=torch.float32).view(2, 4, 6)
    cases = [
        (full.chunk(2, dim=1)[rank].contiguous(), (Shard(1),)),
        (full.chunk(2, dim=2)[rank], (Shard(2),)),  # a non-contiguous local piece: global stride as from_local's
        (full.transpose(0, 2), (Replicate(),)),
        (torch.tensor([[3, 1], [4, 1]]), (Replicate(),)),  # integer token ids
    ]
    for local, placements in cases:
        want = DTensor.from_local(local, mesh, placements, run_check=False)
        for grad_mode in (True, False):
            with torch.set_grad_enabled(grad_mode):
                got = from_local_nograd(local, mesh, placements)
            assert type(got) is DTensor and not got.requires_grad and got.grad_fn is None
            assert got.shape == want.shape and got.stride() == want.stride() and got.dtype == want.dtype
            assert tuple(got.placements) == tuple(want.placements) and got.device_mesh == mesh
            assert local_tensor(got) is local  # the tensor itself, no view
            assert torch.equal(got.full_tensor(), want.full_tensor())
    # Shard(2) of a 3-d tensor: the global tensor is the one the pieces came from
    assert torch.equal(from_local_nograd(full.chunk(2, dim=2)[rank], mesh, (Shard(2),)).full_tensor(), full)

    # the spec is shared by every DTensor of the same key, and a new local shape gets its own
    a = from_local_nograd(torch.zeros(2, 3), mesh, (Shard(0),))
    b = from_local_nograd(torch.ones(2, 3), mesh, (Shard(0),))
    c = from_local_nograd(torch.ones(2, 4), mesh, (Shard(0),))
    assert dtensor_spec(a) is dtensor_spec(b) and dtensor_spec(c) is not dtensor_spec(a)
    assert a.shape == (4, 3) and c.shape == (4, 4)

    # a tensor that takes a gradient needs from_local's autograd function: refused, naming the shape
    w = torch.zeros(2, 3, requires_grad=True)
    with pytest.raises(ValueError, match=r"shape \(2, 3\)\) requires grad"):
        from_local_nograd(w, mesh, (Shard(0),))
