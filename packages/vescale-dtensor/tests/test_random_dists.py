"""vescale.dtensor.random's inverse-CDF distributions (``exponential_``, ``geometric_``, ``log_normal_``,
``cauchy_``): their values follow the distribution, with torch's interval ends and parameter refusals (their bitwise
equality on every placement is in test_random.py); and the random ops the counter RNG does not draw are refused on
DTensors, on every rank, instead of drawing per rank from torch's generator."""

from __future__ import annotations

import math

import pytest
import torch

from vescale.core.testing import multi_rank

N = 400_000


def _draw(fill, dtype=torch.float64, n=N):
    from vescale.dtensor import random as R

    R.manual_seed(77)
    with R.single_device():
        return fill(torch.empty(n, dtype=dtype))


def _moments(x: torch.Tensor) -> tuple[float, float]:
    x = x.double()
    return x.mean().item(), x.var().item()


@pytest.mark.parametrize(("name", "fill", "mean", "var"), [
    ("exponential", lambda t: t.exponential_(2.5), 1 / 2.5, 1 / 2.5 ** 2),
    ("geometric", lambda t: t.geometric_(0.3), 1 / 0.3, 0.7 / 0.3 ** 2),
    ("log_normal", lambda t: t.log_normal_(0.1, 0.4), math.exp(0.1 + 0.08), (math.exp(0.16) - 1) * math.exp(0.36)),
], ids=lambda v: v if isinstance(v, str) else "")
def test_moments_match_the_distribution(name, fill, mean, var):
    got_mean, got_var = _moments(_draw(fill))
    assert abs(got_mean - mean) < 0.01 * mean, (name, got_mean, mean)
    assert abs(got_var - var) < 0.03 * var, (name, got_var, var)


def test_cauchy_quantiles():
    # no moments: the median and the quartiles (median -+ sigma) instead
    x = _draw(lambda t: t.cauchy_(1.5, 0.5))
    q = torch.quantile(x[:100_000], torch.tensor([0.25, 0.5, 0.75], dtype=torch.float64)).tolist()
    assert all(abs(a - b) < 0.02 for a, b in zip(q, [1.0, 1.5, 2.0])), q
    assert torch.isfinite(x).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_interval_ends_are_torchs(dtype):
    n = 100_000
    e = _draw(lambda t: t.exponential_(1.0), dtype, n)
    assert e.dtype == dtype and (e > 0).all() and torch.isfinite(e).all()
    e = _draw(lambda t: t.exponential_(1e4), dtype, n)  # many values below float16's smallest normal: never 0
    assert (e > 0).all()
    g = _draw(lambda t: t.geometric_(0.9), dtype, n)
    assert (g >= 1).all() and torch.equal(g, g.round()) and abs(g.double().mean().item() - 1 / 0.9) < 0.01
    assert (_draw(lambda t: t.log_normal_(0.0, 1.0), dtype, n) > 0).all()
    c = _draw(lambda t: t.cauchy_(0.0, 1.0), dtype, n)
    # float16 overflows past 65504 (about 1 draw in 10**5; torch's own float16 cauchy_ gives inf there too)
    assert not torch.isnan(c).any() and (dtype == torch.float16 or torch.isfinite(c).all())
    k = _draw(lambda t: t.geometric_(0.5), torch.int64, n)
    assert k.dtype == torch.int64 and k.min() >= 1


def test_torch_refusals_kept_and_no_number_spent():
    from vescale.dtensor import random as R

    R.manual_seed(0)
    t = torch.empty(3)
    with R.single_device():
        for call, msg in [(lambda: t.exponential_(0.0), "lambda > 0.0"), (lambda: t.geometric_(1.0), r"in \(0, 1\)"),
                          (lambda: t.log_normal_(0.0, 0.0), "std > 0.0"), (lambda: t.cauchy_(0.0, -1.0), "sigma")]:
            with pytest.raises(RuntimeError, match=msg):
                call()
    assert R.get_state() == (0, 0)


def test_values_are_a_function_of_seed_and_call():
    a = _draw(lambda t: t.exponential_())
    b = _draw(lambda t: t.exponential_())
    assert torch.equal(a, b)
    from vescale.dtensor import random as R

    with R.single_device():
        c = torch.empty(N, dtype=torch.float64).exponential_()  # the next call number: other values
    assert not torch.equal(a, c)


@multi_rank(world_sizes=[2])
def test_undrawn_random_ops_refused_on_dtensors_every_rank():
    import torch.distributed as dist

    from vescale.dtensor import (
        DTensor,
        Partial,
        PlacementError,
        Replicate,
        Shard,
        UndrawnRandomError,
        distribute_tensor,
        init_device_mesh,
    )
    from vescale.dtensor import random as R

    mesh = init_device_mesh("cpu", (2,))
    probs = distribute_tensor(torch.rand(4, 6, generator=torch.Generator().manual_seed(0)), mesh, [Shard(0)])
    R.manual_seed(3)
    calls = {
        "multinomial": lambda: torch.multinomial(probs, 2),
        "rrelu_with_noise": lambda: torch.nn.functional.rrelu(probs, training=True),
        "normal.Tensor_float": lambda: torch.normal(probs, 1.0),
        "poisson": lambda: torch.poisson(probs),
    }
    for name, call in calls.items():
        with pytest.raises(UndrawnRandomError, match=f"{name}.*counter RNG does not draw"):
            call()
    assert R.get_state() == (3, 0)  # nothing drawn
    # the drawn ops on Replicate agree across ranks (no per-rank generator) ...
    x = distribute_tensor(torch.zeros(5, 3), mesh, [Replicate()]).exponential_()
    both = [torch.empty(5, 3) for _ in range(2)]
    dist.all_gather(both, x.to_local())
    assert torch.equal(both[0], both[1]) and (both[0] > 0).all()
    # ... and a Partial tensor is refused as for every other fill
    p = DTensor.from_local(torch.zeros(4, 2), mesh, [Partial()])
    with pytest.raises(PlacementError, match="Partial"):
        p.geometric_(0.5)
    R.uninstall()  # torch's generator back: the refusals go with it
    assert torch.multinomial(probs, 2).shape == (4, 2)
