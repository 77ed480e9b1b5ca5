"""vescale's counter RNG under ``torch.utils.checkpoint``: a recompute replays the forward's values bitwise.

Reference: the same function without any checkpoint (its gradients and the RNG state after it). Plain tensors under
``single_device()`` on one process; DTensors on 2 ranks. Every case fails with the replay disabled (the recompute
would draw the next sequence numbers: other masks, other gradients, a state that ran ahead).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from vescale.core.testing import multi_rank
from vescale.dtensor import random as vrandom


def _fn(x, w):
    h = torch.nn.functional.dropout(x @ w, 0.4)
    h = torch.nn.functional.dropout(h.tanh(), 0.4) * torch.rand_like(h)
    return (h @ w).sum()


def _grads(wrap, *, retain: bool = False):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 6, generator=g, requires_grad=True)
    w = torch.randn(6, 6, generator=g, requires_grad=True)
    vrandom.manual_seed(11)
    with vrandom.single_device():
        loss = wrap(_fn, x, w)
        loss.backward(retain_graph=retain)
        first = (x.grad.clone(), w.grad.clone())
        if retain:  # a second backward over the same graph: a second recompute, the same values again
            x.grad = w.grad = None
            loss.backward()
            assert torch.equal(x.grad, first[0]) and torch.equal(w.grad, first[1])
    return first, vrandom.get_state()


WRAPS = {
    "non_reentrant": lambda f, *a: checkpoint(f, *a, use_reentrant=False),
    "reentrant": lambda f, *a: checkpoint(f, *a, use_reentrant=True),
    "no_preserve_rng_state": lambda f, *a: checkpoint(f, *a, use_reentrant=False, preserve_rng_state=False),
    "no_early_stop": lambda f, *a: checkpoint(f, *a, use_reentrant=False, early_stop=False),
}


@pytest.mark.parametrize("name", sorted(WRAPS))
def test_recompute_replays_bitwise(name):
    (ref_x, ref_w), ref_state = _grads(lambda f, *a: f(*a))
    (gx, gw), state = _grads(WRAPS[name], retain=name == "non_reentrant")
    assert state == ref_state  # the recompute did not advance the sequence
    assert torch.equal(gx, ref_x) and torch.equal(gw, ref_w)


@multi_rank(world_sizes=[2])
def test_dtensor_dropout_replays_bitwise(world_size):
    from torch.distributed.tensor import Shard, distribute_tensor

    from vescale.core.mesh import init_mesh

    mesh = init_mesh({"tp": world_size})

    def run(use_ckpt, reentrant=False):
        g = torch.Generator().manual_seed(0)
        x = distribute_tensor(torch.randn(8, 6, generator=g), mesh, [Shard(0)]).requires_grad_()
        w = distribute_tensor(torch.randn(6, 6, generator=g), mesh, [Shard(1)]).requires_grad_()
        f = lambda a, b: torch.nn.functional.dropout(a @ b, 0.5).square()  # noqa: E731
        vrandom.manual_seed(4)
        out = checkpoint(f, x, w, use_reentrant=reentrant) if use_ckpt else f(x, w)
        out.sum().backward()
        return x.grad.full_tensor(), w.grad.full_tensor(), vrandom.get_state()

    ref = run(False)
    for reentrant in (False, True):
        got = run(True, reentrant)
        assert got[2] == ref[2]
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
