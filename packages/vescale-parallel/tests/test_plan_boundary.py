"""Root-boundary semantics of a plan and factory capture, on tp=2, against the same module on one process.

Values are checked with ``torch.equal`` (elementwise ops and row sums done in the same order); only the parameter
gradient, summed over rows in another grouping, uses ``assert_close``. Plain root inputs are this rank's piece under
the root ``input`` placements (default ``Replicate``) and ``None`` leaves an argument plain; root outputs come back as
the local piece under their ``output`` placements, as a DTensor for ``None``, and as the full tensor when unnamed;
tensors created inside ``forward`` are replicated DTensors, in backward too (the ``masked_fill`` mask autograd saves).
"""

from __future__ import annotations

from vescale.core.testing import multi_rank


def _net():
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.linspace(0.5, 2.0, 6))

        def forward(self, x, bias, flag):
            assert type(flag) is torch.Tensor, "a None root entry must leave the argument plain"
            n = x.shape[-1]
            pos = torch.arange(n, dtype=x.dtype)  # factories: captured as replicated DTensors
            keep = pos < 4 * torch.ones(n)
            y = (x * self.scale + pos).masked_fill(~keep, 0.0) + bias
            return y, y.sum(-1), y * 2

    return Net()


@multi_rank(world_sizes=[2])
def test_root_boundary_and_factory_capture():
    import torch
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from vescale.core.mesh import init_mesh
    from vescale.parallel import parallelize_module

    mesh = init_mesh({"tp": 2})
    rank = mesh.get_local_rank("tp")
    x = torch.arange(24, dtype=torch.float32).reshape(4, 6) / 7
    bias = torch.full((6,), 0.25)
    flag = torch.tensor(1)

    ref = _net()
    ref_x = x.clone().requires_grad_()
    r_y, r_sum, r_twice = ref(ref_x, bias, flag)
    (r_y.sum() + r_sum.sum() + r_twice.sum()).backward()

    par = parallelize_module(_net(), mesh, {
        "parameter": {r"scale": [Shard(0)]},
        "input": {"": [[Shard(0)], [Replicate()], None]},  # x: each rank passes its half of the batch
        "output": {"": [[Shard(0)], None]},                # y: this rank's rows; sum: a DTensor; twice: full
    })
    my_x = x.chunk(2)[rank].clone().requires_grad_()
    y, y_sum, twice = par(my_x, bias, flag)
    assert type(y) is torch.Tensor and torch.equal(y, r_y.detach().chunk(2)[rank])
    assert isinstance(y_sum, DTensor) and torch.equal(y_sum.full_tensor(), r_sum.detach())
    assert type(twice) is torch.Tensor and torch.equal(twice, r_twice.detach())  # gathered rows
    # backward through the boundary and the captured mask
    # each rank back-propagates its rows of y and the replicated values: together, the single-device gradient
    (y.sum() + y_sum.sum().full_tensor() + twice.sum()).backward()
    assert torch.equal(my_x.grad, ref_x.grad.chunk(2)[rank])
    assert par.scale.grad.placements == (Shard(0),)
    # summed over rows in a different grouping (2 + 2 across ranks): close, not bitwise
    torch.testing.assert_close(par.scale.grad.full_tensor(), ref.scale.grad, rtol=1e-6, atol=1e-6)
    assert par.plan_report().for_fqn("scale").placements == "[S(0)]"
