"""A view of a DTensor is a view: it shares each rank's local storage with its input and issues no collective, or it
is refused (``ViewRedistributeError``, raised on every rank during sharding propagation, as torch refuses such views),
never computed on a gathered copy.

Checked against plain torch on one device: an in-place write through the view must reach the base exactly as it does
there. Refusals are checked for their type (a ``RuntimeError`` whose cause is ``ViewRedistributeError``), torch's
wording ("is not evenly divisible by mesh dimension" where a shard is uneven), and that no collective ran. The last
two tests restate two scenarios of PyTorch's own DTensor view tests (``TestViewOps.test_dtensor_unflatten_1d`` and
``test_view_redistribution``) with vescale's rules installed.
"""

from __future__ import annotations

import math

from vescale.core.testing import multi_rank, run_on_ranks


def _refusal(error: BaseException):
    """The ``ViewRedistributeError`` behind ``error`` (torch's dispatcher re-raises it as ``RuntimeError``), or None."""
    from vescale.dtensor import ViewRedistributeError

    while error is not None:
        if isinstance(error, ViewRedistributeError):
            return error
        error = error.__cause__
    return None


def _placement(code: str):
    from vescale.dtensor import InterleavedShard, Replicate, Shard

    if code == "R":
        return Replicate()
    if code[0] == "S":
        return Shard(int(code[1:]))
    dim, size = code[1:].split(".")
    return InterleavedShard(int(dim), int(size))


def _views():
    """(name, op): each op returns one view of its argument, or a list of views (split, chunk)."""
    return {
        "view": lambda size: (lambda t: t.view(size)),
        "reshape": lambda size: (lambda t: t.reshape(size)),
        "unflatten": lambda dim, sizes: (lambda t: t.unflatten(dim, sizes)),
        "flatten": lambda start, end: (lambda t: t.flatten(start, end)),
        "transpose": lambda a, b: (lambda t: t.transpose(a, b)),
        "unsqueeze": lambda dim: (lambda t: t.unsqueeze(dim)),
        "split": lambda size, dim: (lambda t: list(t.split(size, dim))),
        "chunk": lambda n, dim: (lambda t: list(t.chunk(n, dim))),
    }


#: (mesh shape, global shape, placements, op name, op args, outcome): "view" must alias, "uneven" and "refused" must
#: be refused ("uneven" with torch's wording about divisibility)
CASES = [
    ((4,), (64,), ["S0"], "view", ((8, 8),), "view"),
    ((4,), (63,), ["S0"], "view", ((7, 9),), "uneven"),  # the reported case: gathered, the write did not reach it
    ((4,), (63,), ["S0"], "unflatten", (0, (7, 9)), "uneven"),
    ((4,), (63,), ["S0"], "reshape", ((7, 9),), "uneven"),  # reshape of a contiguous tensor is this view
    ((4,), (4, 4), ["S0"], "view", ((-1, 8),), "uneven"),  # torch's test_view_redistribution (gathered before)
    ((2,), (4, 4), ["S0"], "view", ((-1, 8),), "view"),  # the same on 2 ranks is a view
    ((2,), (4, 6), ["S1"], "flatten", (0, 1), "view"),  # a shard of the inner dim: _StridedShard(0, sf=4)
    ((2,), (8, 6), ["S1"], "view", ((4, 12),), "refused"),  # torch's own rule gathers here; a copy is no view
    ((2,), (4, 12), ["I1.3"], "view", ((4, 3, 4),), "view"),
    ((2,), (4, 12), ["I1.3"], "split", (4, 1), "view"),  # cut at the interleaved chunks: local
    ((2,), (4, 12), ["S0"], "split", (5, 1), "view"),  # an unsharded dim
    ((2,), (6, 4), ["S1"], "chunk", (3, 0), "view"),
    ((2, 2), (4, 6, 8), ["S0", "S2"], "transpose", (0, 2), "view"),
    ((2, 2), (4, 6, 8), ["S0", "I2.2"], "unsqueeze", (1,), "view"),
    ((2, 2), (4, 6, 8), ["R", "S1"], "unflatten", (1, (3, 2)), "uneven"),  # 3 rows over 2 ranks
    ((2, 2), (4, 4, 8, 15), ["S2", "S0"], "view", ((4, 4, 15, 8),), "uneven"),  # XLNet's rel_shift on dp x tp
    ((2, 2), (3, 3, 4), ["S0", "R"], "view", ((9, 4),), "uneven"),  # 3 rows over 2 ranks, flattened
]


def _check_views(mesh_shape, cases):
    import pytest
    import torch

    from vescale.dtensor import ViewRedistributeError, count_comms, distribute_tensor, init_device_mesh, strict

    mesh = init_device_mesh("cpu", mesh_shape)
    ops = _views()
    for shape, codes, name, args, outcome in cases:
        op = ops[name](*args)
        where = f"{name}{args} of {shape} placed {codes} on mesh {mesh_shape}"
        full = torch.arange(math.prod(shape), dtype=torch.float64).view(shape)
        x = distribute_tensor(full, mesh, [_placement(c) for c in codes])
        if outcome != "view":
            for strict_mode in (False, True):
                with strict(strict_mode), count_comms() as comms, pytest.raises(ViewRedistributeError) as err:
                    op(x)
                refusal = err.value
                assert isinstance(refusal, RuntimeError), where  # the type torch's own refusal has
                assert comms.total == 0, (where, comms.counts)  # refused before any collective
                assert "aten.view" in str(refusal) and str(tuple(shape)) in str(refusal), (where, refusal)
                if outcome == "uneven":
                    assert "is not evenly divisible by mesh dimension" in str(refusal), (where, refusal)
            continue
        # one device: the same view, then a write through it
        ref_base = full.clone()
        ref_views = op(ref_base)
        with count_comms() as comms:
            views = op(x)
        assert comms.total == 0, (where, comms.counts)
        ref_views = ref_views if isinstance(ref_views, list) else [ref_views]
        views = views if isinstance(views, list) else [views]
        storage = x.to_local().untyped_storage().data_ptr()
        for i, (v, ref_v) in enumerate(zip(views, ref_views, strict=True)):
            assert v.to_local().untyped_storage().data_ptr() == storage, f"{where}: piece {i} is not a view"
            assert torch.equal(v.full_tensor(), ref_v), (where, i, v.placements)
            v.mul_(-(i + 2))  # in place through the view
            ref_v.mul_(-(i + 2))
        assert torch.equal(x.full_tensor(), ref_base), f"{where}: the write through the view did not reach the base"


def test_views_alias_their_input_or_are_refused():
    """1-d meshes of 2 and 4 ranks and a 2x2 mesh: every view case either aliases (write-through equal to one device,
    no collective) or is refused with ``ViewRedistributeError`` (in and out of strict mode, no collective)."""
    for mesh_shape in [(2,), (4,), (2, 2)]:
        cases = [c[1:] for c in CASES if c[0] == mesh_shape]
        run_on_ranks(_check_views, math.prod(mesh_shape), mesh_shape, cases)


def _factorizations(n: int, least: int = 2) -> list[tuple[int, ...]]:
    """Every ordered way to write ``n`` as a product of at least ``least`` integers above 1."""
    out = []
    for first in range(2, n + 1):
        if n % first == 0:
            if n == first:
                if least <= 1:
                    out.append((first,))
            else:
                out.extend((first, *rest) for rest in _factorizations(n // first, max(least - 1, 1)))
    return out


@multi_rank(world_sizes=[2, 4])
def test_unflatten_scenarios_of_torch_view_tests(world_size):
    """PyTorch's ``test_dtensor_unflatten_1d`` restated: (1) a flattened group unflattened back, the shard on any of
    its dims (``Shard`` of the group when it is the first dim, else interleaved by the dims before it), sizes
    ``2m - 1``, ``2m``, ``2m + 1`` for ``m`` ranks: the view is ``Shard(dim)`` with the plain local piece and no
    collective, or, when the sharded dim is uneven and not the group's last, refused with torch's "is not evenly
    divisible by mesh dimension"; (2) a ``Shard`` input with one dim unflattened into every factorisation: refused
    exactly when the sharded dim itself is unflattened and is uneven or its first factor is; else ``Shard`` of the
    moved dim; (3) a replicated input stays replicated."""
    import pytest
    import torch

    from vescale.dtensor import (
        InterleavedShard,
        Replicate,
        Shard,
        ViewRedistributeError,
        count_comms,
        distribute_tensor,
        init_device_mesh,
    )
    from vescale.dtensor.layout import local_slice

    mesh = init_device_mesh("cpu", (world_size,))
    m = world_size

    def expect_view(x, size, want, global_out, where):
        with count_comms() as comms:
            out = x.view(size)
        assert tuple(out.placements) == (want,), (where, out.placements)
        assert comms.total == 0, (where, comms.counts)
        assert out.to_local().untyped_storage().data_ptr() == x.to_local().untyped_storage().data_ptr(), where
        assert torch.equal(out.to_local(), local_slice(global_out, mesh, [want])), where

    def expect_refusal(x, size, where):
        with count_comms() as comms, pytest.raises(ViewRedistributeError,
                                                   match="is not evenly divisible by mesh dimension"):
            x.view(size)
        assert comms.total == 0, (where, comms.counts)

    # (1) flatten -> view back
    for ndim in (2, 3, 4):
        for start in range(ndim):
            for end in range(start + 2, ndim + 1):
                for sd in range(start, end):
                    for size in (2 * m - 1, 2 * m, 2 * m + 1):
                        dims = [2 * m + 1] * ndim
                        dims[sd] = size
                        flat = dims[:start] + [math.prod(dims[start:end])] + dims[end:]
                        sf = math.prod(dims[start:sd])
                        placement = Shard(start) if sf == 1 else InterleavedShard(start, sf)
                        full = torch.arange(math.prod(dims)).view(flat)
                        x = distribute_tensor(full, mesh, [placement], src_data_rank=None)
                        where = f"{flat} {placement} -> {dims}"
                        if size % m and sd != end - 1:
                            expect_refusal(x, dims, where)
                        else:
                            expect_view(x, dims, Shard(sd), full.view(dims), where)

    # (2) any factorisation of one dim of a Shard input
    for ndim in (1, 2, 3, 4):
        for ud in range(ndim):
            for sd in range(ndim):
                for ud_size in (m * m - 1, m * m, m * m + 1):
                    for sd_size in (m * m - 1, m * m, m * m + 1):
                        if ud == sd and ud_size != sd_size:
                            continue
                        dims = [m * m] * ndim
                        dims[ud], dims[sd] = ud_size, sd_size
                        full = torch.arange(math.prod(dims)).view(dims)
                        x = distribute_tensor(full, mesh, [Shard(sd)], src_data_rank=None)
                        for factors in _factorizations(dims[ud]):
                            size = dims[:ud] + list(factors) + dims[ud + 1:]
                            where = f"{dims} Shard({sd}) -> {size}"
                            if sd == ud and (dims[sd] % m or factors[0] % m):
                                expect_refusal(x, size, where)
                                continue
                            moved = sd if sd <= ud else sd + len(factors) - 1
                            expect_view(x, size, Shard(moved), full.view(size), where)

    # (3) Replicate stays Replicate
    for ndim in (1, 2, 3, 4):
        for ud in range(ndim):
            dims = [6] * ndim
            dims[ud] = 12
            full = torch.arange(math.prod(dims)).view(dims)
            size = dims[:ud] + [3, 4] + dims[ud + 1:]
            expect_view(distribute_tensor(full, mesh, [Replicate()], src_data_rank=None), size, Replicate(),
                        full.view(size), f"{dims} Replicate -> {size}")


@multi_rank(world_sizes=[2, 4])
def test_view_redistribution_scenario_of_torch_view_tests(world_size):
    """PyTorch's ``test_view_redistribution`` restated: ``[4, 4]`` placed ``Shard(0)`` viewed as ``[-1, 8]`` needs a
    redistribution on 4 ranks (one row each, two per output row): refused, as torch refuses it ("Sharding propagation
    failed"); before, vescale gathered and returned a copy. On 2 ranks it is a view (``Shard(0)``, no collective)."""
    import pytest
    import torch

    from vescale.dtensor import Shard, ViewRedistributeError, count_comms, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    full = torch.randn(4, 4, generator=torch.Generator().manual_seed(0))
    x = distribute_tensor(full, mesh, [Shard(0)])
    if world_size == 4:
        with count_comms() as comms, pytest.raises(RuntimeError, match="Sharding propagation failed") as err:
            x.view(-1, 8)
        assert isinstance(err.value, ViewRedistributeError), err.value
    else:
        with count_comms() as comms:
            out = x.view(-1, 8)
        assert tuple(out.placements) == (Shard(0),) and out.to_local().data_ptr() == x.to_local().data_ptr()
        assert torch.equal(out.full_tensor(), full.view(-1, 8))
    assert comms.total == 0, comms.counts


@multi_rank(world_sizes=[2])
def test_backward_of_a_view_whose_gradient_is_not_viewable(world_size):
    """``[8, 8]`` placed ``InterleavedShard(0, 2)`` viewed as ``[2, 16, 2]`` is a view (``Shard(1)``). Its backward
    reshapes the ``Shard(1)`` gradient back to ``[8, 8]``, a layout torch's rule would gather: inside the backward that
    ``reshape`` may copy, so the gradient is the one-device gradient (placed as the copy comes out, ``Replicate``, as
    before this rule); in strict mode the redistribution is refused."""
    import pytest
    import torch

    from vescale.dtensor import InterleavedShard, Shard, distribute_tensor, full_tensor, init_device_mesh, strict
    from vescale.dtensor.layout import local_slice

    mesh = init_device_mesh("cpu", (world_size,))
    full = torch.arange(64, dtype=torch.float64).view(8, 8)
    g = torch.arange(64, dtype=torch.float64).view(2, 16, 2) % 5 - 2
    ref_in = full.clone().requires_grad_()
    (ref_in.view(2, 16, 2) * g).sum().backward()
    for strict_mode in (False, True):
        x = distribute_tensor(full, mesh, [InterleavedShard(0, 2)]).requires_grad_()
        y = x.view(2, 16, 2)
        assert tuple(y.placements) == (Shard(1),), y.placements
        loss = (full_tensor(y) * g).sum()
        with strict(strict_mode):
            if strict_mode:
                with pytest.raises(RuntimeError) as err:
                    loss.backward()
                assert _refusal(err.value) is not None, err.value
                continue
            loss.backward()
        assert torch.equal(x.grad.full_tensor(), ref_in.grad), x.grad.placements
        assert torch.equal(x.grad.to_local(), local_slice(ref_in.grad, mesh, x.grad.placements)), x.grad.placements


@multi_rank(world_sizes=[2])
def test_view_of_an_empty_tensor_returns_or_is_refused_by_name(world_size):
    """torch's dim map of ``view``/``reshape`` never returns for some empty shapes (``[0]`` as ``[0, 3]``, ``[4, 0]``
    unflattened to ``[4, 2, 0, 0, 0]``): replicated or partial, the view is the local view (one device's result, no
    collective); sharded, it is refused with ``PlacementError`` naming the op and shape, on every rank."""
    import pytest
    import torch

    from vescale.dtensor import (
        Partial,
        PlacementError,
        Replicate,
        Shard,
        count_comms,
        distribute_tensor,
        from_local,
        init_device_mesh,
    )

    mesh = init_device_mesh("cpu", (world_size,))
    for shape, size in (((0,), (0, 3)), ((4, 0), (4, 2, 0, 0, 0)), ((4, 0), (2, 2, 0)), ((2, 0, 3), (0, 6))):
        full = torch.zeros(shape)
        want = full.view(size)
        for placement in (Replicate(), Partial()):
            x = from_local(full.clone(), mesh, [placement], shape=full.shape)
            with count_comms() as comms:
                out = x.view(size)
                unflat = x.reshape(size)
            assert comms.total == 0, (shape, size, comms.counts)
            for y in (out, unflat):
                assert y.shape == want.shape and tuple(y.placements) == (placement,), (shape, size, y.placements)
                assert y.to_local().shape == want.shape
        x = distribute_tensor(full, mesh, [Shard(0)])
        with pytest.raises((RuntimeError, PlacementError)) as err:
            x.view(size)
        cause = err.value
        while cause is not None and not isinstance(cause, PlacementError):
            cause = cause.__cause__
        assert cause is not None and "empty" in str(cause) and str(tuple(shape)) in str(cause), err.value
