"""``scatter_add`` / ``scatter_add_`` with a ``Partial`` operand (vescale's handler in sharding_rules): the result's
full tensor equals one device's sum, in place and out of place (torch's own rule scattered the summands as if whole:
PhiMoE's router backward under auto_plan gave wrong gradients)."""

from __future__ import annotations

import pytest
import torch

from vescale.core.testing import multi_rank


@multi_rank(world_sizes=[2])
@pytest.mark.parametrize("inplace", [True, False])
def test_scatter_add_with_partial_operands_equals_one_device(inplace):
    from vescale.dtensor import DTensor, Partial, Replicate, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (2,))
    rank = torch.distributed.get_rank()
    g = torch.Generator().manual_seed(0)
    selfs, srcs = [torch.randn(6, 4, generator=g) for _ in range(2)], [torch.randn(6, 2, generator=g) for _ in range(2)]
    index = torch.randint(0, 4, (6, 2), generator=g)
    idx = distribute_tensor(index, mesh, [Replicate()])
    for self_partial, src_partial in [(True, True), (True, False), (False, True)]:
        a = DTensor.from_local(selfs[rank].clone(), mesh, [Partial()]) if self_partial else \
            distribute_tensor(selfs[0].clone(), mesh, [Replicate()])
        s = DTensor.from_local(srcs[rank].clone(), mesh, [Partial()]) if src_partial else \
            distribute_tensor(srcs[0], mesh, [Replicate()])
        ref = (sum(selfs) if self_partial else selfs[0]).scatter_add(1, index, sum(srcs) if src_partial else srcs[0])
        out = a.scatter_add_(1, idx, s) if inplace else torch.scatter_add(a, 1, idx, s)
        if inplace:
            assert out is a and a.placements == ((Partial(),) if self_partial else (Replicate(),))
        torch.testing.assert_close(out.full_tensor(), ref, rtol=1e-6, atol=1e-6, msg=f"{self_partial} {src_partial}")
