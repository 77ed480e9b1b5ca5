"""Creating and resharding DTensors: torch's entry points plus uneven-shape checks and vescale's placements."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import distribute_tensor as _torch_distribute_tensor
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from vescale.core import torch_internals
from vescale.core.torch_internals import StridedShard as _StridedShard
from vescale.dtensor import _torch_hooks
from vescale.dtensor.errors import PlacementError
from vescale.dtensor.layout import contiguous_stride, local_shape, local_slice, validate_placements
from vescale.dtensor.placements import RaggedShard

__all__ = ["from_local", "from_local_nograd", "distribute_tensor", "redistribute", "full_tensor", "mesh_group"]


def mesh_group(mesh: DeviceMesh):
    """A process group spanning every rank of ``mesh`` (the default group when the mesh spans the world)."""
    if mesh.ndim == 1:
        return mesh.get_group()
    if mesh.size() == dist.get_world_size():
        return None
    return torch_internals.flattened_mesh(mesh).get_group()


def _rank_coordinates(mesh: DeviceMesh) -> dict[int, tuple[int, ...]]:
    grid = mesh.mesh
    return {int(grid[idx]): idx for idx in itertools.product(*[range(n) for n in grid.shape])}


def _infer_global_shape(gathered: dict[tuple[int, ...], tuple[int, ...]], mesh: DeviceMesh,
                        placements: Sequence[Placement]) -> tuple[int, ...]:
    ndim = len(next(iter(gathered.values())))
    shape = []
    for d in range(ndim):
        sharding = {m for m, p in enumerate(placements) if isinstance(p, (Shard, _StridedShard)) and p.dim == d}
        if not sharding:
            shape.append(gathered[(0,) * mesh.ndim][d])
            continue
        shape.append(sum(s[d] for c, s in gathered.items() if all(c[m] == 0 for m in range(mesh.ndim)
                                                                   if m not in sharding)))
    return tuple(shape)


def from_local(local_tensor: torch.Tensor, device_mesh: DeviceMesh | None = None,
               placements: Sequence[Placement] | None = None, *, shape: Sequence[int] | None = None,
               stride: Sequence[int] | None = None, check: bool = False, run_check: bool = False,
               grad_placements: Sequence[Placement] | None = None) -> DTensor:
    """Wrap each rank's ``local_tensor`` as a DTensor of global ``shape`` (uneven shards allowed).

    ``shape``/``stride`` give the global size and stride when shards are uneven (torch otherwise assumes even
    shards); ``stride`` defaults to the contiguous stride of ``shape``. With ``check=True`` the local shapes and
    dtypes of all mesh ranks are gathered (one ``all_gather_object`` over the mesh), the global shape is inferred
    when ``shape`` is None, and every rank raises the same :class:`PlacementError` naming each rank whose local
    shape differs from what ``placements`` give for that shape. ``run_check`` is torch's (broadcasts replicas).
    ``RaggedShard`` placements need ``shape`` or ``check=True``. Differentiable like torch's ``from_local``.
    """
    _torch_hooks.install()
    mesh = device_mesh
    if mesh is None:
        mesh = torch_internals.current_mesh()
    placements = tuple(placements) if placements is not None else (Replicate(),) * mesh.ndim
    if isinstance(local_tensor, DTensor):
        raise PlacementError(f"from_local: expected a local torch.Tensor, got a DTensor with {local_tensor.placements}")
    if shape is not None:
        placements = validate_placements(shape, mesh, placements, what="from_local tensor")
    elif len(placements) != mesh.ndim:
        raise PlacementError(f"from_local: {len(placements)} placements {placements} for a {mesh.ndim}-d mesh")
    if check:
        shape = _check_local_shapes(local_tensor, mesh, placements, shape)
        placements = validate_placements(shape, mesh, placements, what="from_local tensor")
    if shape is None and any(isinstance(p, RaggedShard) for p in placements):
        raise PlacementError(f"from_local with {placements} needs shape= (or check=True) to know the global shape")
    if shape is not None:
        shape = torch.Size(shape)
        stride = tuple(stride) if stride is not None else contiguous_stride(shape)
    return DTensor.from_local(local_tensor, mesh, placements, run_check=run_check, shape=shape, stride=stride,
                              grad_placements=grad_placements)


#: DTensorSpecs of :func:`from_local_nograd`, by (mesh, placements, local shape, local stride, dtype); emptied when
#: it reaches :data:`_NOGRAD_SPECS_MAX` entries (a growing KV cache brings a new shape every step).
_NOGRAD_SPECS: dict = {}
_NOGRAD_SPECS_MAX = 256


def from_local_nograd(local_tensor: torch.Tensor, device_mesh: DeviceMesh, placements: tuple) -> DTensor:
    """What ``DTensor.from_local(local_tensor, device_mesh, placements, run_check=False)`` returns (same global shape,
    stride, placements and values; no gradient), for a ``local_tensor`` that takes no gradient, built without the
    autograd function: the DTensor holds ``local_tensor`` itself (not a view of it), and its spec is the one
    ``from_local`` made for the same mesh, ``placements`` (a tuple), local shape, stride and dtype, reused.

    For per-step wrapping on hot paths (a decode step's grown KV cache, a model's integer inputs). Raises
    ``ValueError`` if ``local_tensor`` requires grad (use :func:`from_local`). Under ``torch.compile`` it is
    ``from_local``. Even shards only (``from_local`` without ``shape``)."""
    if local_tensor.requires_grad:
        raise ValueError(f"from_local_nograd: the local tensor (shape {tuple(local_tensor.shape)}) requires grad; "
                         f"use from_local, whose autograd function carries its gradient")
    if torch.compiler.is_compiling():
        return DTensor.from_local(local_tensor, device_mesh, placements, run_check=False)
    key = (device_mesh, placements, local_tensor.shape, local_tensor.stride(), local_tensor.dtype)
    spec = _NOGRAD_SPECS.get(key)
    if spec is None:
        _torch_hooks.install()
        made = DTensor.from_local(local_tensor, device_mesh, placements, run_check=False)
        if device_mesh.get_coordinate() is None:
            return made  # this rank is outside the mesh: from_local holds an empty local tensor
        if len(_NOGRAD_SPECS) >= _NOGRAD_SPECS_MAX:
            _NOGRAD_SPECS.clear()
        _NOGRAD_SPECS[key] = spec = torch_internals.dtensor_spec(made)
    return DTensor(local_tensor, spec, requires_grad=False)


def _check_local_shapes(local_tensor: torch.Tensor, mesh: DeviceMesh, placements: Sequence[Placement],
                        shape: Sequence[int] | None) -> tuple[int, ...]:
    info = (dist.get_rank(), tuple(local_tensor.shape), str(local_tensor.dtype))
    gathered: list = [None] * mesh.size()
    dist.all_gather_object(gathered, info, group=mesh_group(mesh))
    coords = _rank_coordinates(mesh)
    by_coord = {coords[r]: s for r, s, _ in gathered}
    dtypes = {d for _, _, d in gathered}
    if len(dtypes) > 1:
        raise PlacementError(f"from_local(check=True): local dtypes differ across mesh ranks: "
                             f"{ {r: d for r, _, d in gathered} }")
    if len({len(s) for s in by_coord.values()}) > 1:
        raise PlacementError(f"from_local(check=True): local ranks differ across mesh ranks: "
                             f"{ {r: s for r, s, _ in gathered} }")
    ragged = [p for p in placements if isinstance(p, RaggedShard)]
    if shape is None:
        if ragged:
            raise PlacementError(f"from_local(check=True) with {placements} needs shape=")
        shape = _infer_global_shape(by_coord, mesh, placements)
    shape = tuple(int(s) for s in shape)
    validate_placements(shape, mesh, placements, what="from_local tensor")
    bad = []
    for r, s, _ in gathered:
        want = local_shape(shape, mesh, placements, coordinate=coords[r])
        if tuple(s) != tuple(want):
            bad.append(f"rank {r} (mesh coordinate {coords[r]}) has local shape {s}, expected {want}")
    if bad:
        raise PlacementError(f"from_local(check=True): global shape {shape} with placements {tuple(placements)} on "
                             f"mesh {tuple(mesh.shape)} (dims {mesh.mesh_dim_names}): " + "; ".join(bad))
    return shape


def distribute_tensor(tensor: torch.Tensor, device_mesh: DeviceMesh | None = None,
                      placements: Sequence[Placement] | None = None, *, src_data_rank: int | None = 0) -> DTensor:
    """Distribute a global ``tensor`` over ``device_mesh`` with ``placements`` (any vescale or torch placement).

    Same contract as torch's ``distribute_tensor`` (data of mesh coordinate ``src_data_rank`` wins; ``None`` slices
    locally without communication), plus validation that raises :class:`PlacementError` before any collective, and
    ``RaggedShard`` and uneven ``InterleavedShard`` (broadcast from the source, then sliced locally). For every
    placement the result is a new autograd leaf that requires grad exactly when ``tensor`` does (as torch's is for
    ``Shard``): its ``.grad`` after a backward is the gradient's local piece; ``tensor`` itself gets no gradient.
    """
    _torch_hooks.install()
    mesh = device_mesh
    if mesh is None:
        mesh = torch_internals.current_mesh()
    placements = tuple(placements) if placements is not None else (Replicate(),) * mesh.ndim
    placements = validate_placements(tensor.shape, mesh, placements, what="distribute_tensor input")
    if any(isinstance(p, (RaggedShard, _StridedShard)) for p in placements):
        # torch scatters only even _StridedShard pieces and knows nothing of RaggedShard: broadcast and slice.
        data = tensor.detach()
        if src_data_rank is not None:
            data = data.clone().contiguous()
            dist.broadcast(data, src=int(mesh.mesh.reshape(-1)[src_data_rank]), group=mesh_group(mesh))
        # built from a local piece that takes no gradient, so the DTensor is a leaf (no from_local node above it)
        out = from_local(local_slice(data, mesh, placements), mesh, placements, shape=tensor.shape,
                         stride=contiguous_stride(tensor.shape))
        return out.requires_grad_(tensor.requires_grad)
    return _torch_distribute_tensor(tensor, mesh, placements, src_data_rank=src_data_rank)


def full_tensor(dtensor: DTensor) -> torch.Tensor:
    """The global tensor on every rank (works for ``RaggedShard`` too; torch's ``full_tensor`` otherwise)."""
    _torch_hooks.install()
    if any(isinstance(p, RaggedShard) for p in dtensor.placements):
        from vescale.dtensor.ragged import ragged_full_tensor

        return ragged_full_tensor(dtensor)
    return dtensor.full_tensor()


def redistribute(dtensor: DTensor, device_mesh: DeviceMesh | None = None,
                 placements: Sequence[Placement] | None = None, *, async_op: bool = False) -> DTensor:
    """Explicitly reshard ``dtensor`` to ``placements``; handles ``RaggedShard`` on either side, else torch's.

    Always allowed under :func:`vescale.dtensor.strict`. Ragged conversions, and interleaved ones on n-d meshes
    (where torch's planner mis-orders some ``_StridedShard`` steps), go through the global tensor on each rank (an
    all-gather, then a local slice), so they cost the global size in memory.
    """
    _torch_hooks.install()
    mesh = device_mesh or dtensor.device_mesh
    placements = tuple(placements) if placements is not None else (Replicate(),) * mesh.ndim
    placements = validate_placements(dtensor.shape, mesh, placements, what="redistribute target")
    src_ragged = any(isinstance(p, RaggedShard) for p in dtensor.placements)
    dst_ragged = any(isinstance(p, RaggedShard) for p in placements)
    interleaved_nd = mesh.ndim > 1 and any(isinstance(p, _StridedShard) for p in (*dtensor.placements, *placements))
    if not (src_ragged or dst_ragged or interleaved_nd):
        return dtensor.redistribute(mesh, placements, async_op=async_op)
    if interleaved_nd and not (src_ragged or dst_ragged):
        # torch mis-orders some _StridedShard transitions on n-d meshes: gather to Replicate, then slice locally.
        if any(isinstance(p, Partial) for p in placements):
            raise PlacementError(f"redistribute: cannot turn {dtensor.placements} into {placements} (Partial target)")
        full = dtensor.redistribute(mesh, (Replicate(),) * mesh.ndim).to_local()
        return from_local(local_slice(full, mesh, placements), mesh, placements, shape=dtensor.shape,
                          stride=dtensor.stride())
    if any(isinstance(p, Partial) for p in placements):
        raise PlacementError(f"redistribute: cannot turn {dtensor.placements} into {placements} (Partial target)")
    full = full_tensor(dtensor) if src_ragged else dtensor.redistribute(mesh, (Replicate(),) * mesh.ndim).to_local()
    if dst_ragged:
        local = local_slice(full, mesh, placements)
        return from_local(local, mesh, placements, shape=dtensor.shape, stride=contiguous_stride(dtensor.shape))
    return _torch_distribute_tensor(full, mesh, placements, src_data_rank=None)
