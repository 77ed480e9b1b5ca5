"""Named device meshes in one canonical dimension order.

Every vescale package speaks of mesh dimensions by name: ``pp`` (pipeline), ``dp`` (data / ZeRO), ``cp`` (context),
``ep`` (expert) and ``tp`` (tensor and sequence). :func:`init_mesh` puts the dimensions a user names in that order, so
``{"tp": 2, "dp": 2}`` and ``{"dp": 2, "tp": 2}`` give the same mesh, and neighbouring ranks share the innermost
(``tp``) dimension, the one with the most traffic.

Dimensions are kept exactly as given: a dimension named with size 1 stays in the mesh (so code may always index
``mesh["tp"]``), and a dimension that is not named is absent. :func:`dim_size` answers 1 for an absent dimension.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from vescale.core.errors import MeshError

__all__ = ["CANONICAL_DIM_ORDER", "init_mesh", "parse_mesh_spec", "sub_mesh", "dim_size", "mesh_coordinates",
           "dim_mesh", "dim_group"]

#: Outermost to innermost. Unknown names are rejected unless an explicit ``order`` is given.
#: ``dp_replicate`` / ``dp_shard`` are the two dims of hybrid sharded data parallelism (HSDP: replicas of ZeRO 3
#: groups), used instead of ``dp`` (``vescale.parallel.fully_shard_dp``).
CANONICAL_DIM_ORDER: tuple[str, ...] = ("pp", "dp", "dp_replicate", "dp_shard", "cp", "ep", "tp")


def parse_mesh_spec(spec: str) -> dict[str, int]:
    """Parse ``"pp=2,dp=2,tp=2"`` (the CLI form) into ``{"pp": 2, "dp": 2, "tp": 2}``."""
    dims: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, sep, size = item.partition("=")
        name = name.strip()
        if not sep or not name or not size.strip().isdigit():
            raise MeshError(f"bad mesh entry {item!r} in {spec!r}: expected NAME=SIZE, e.g. 'dp=2,tp=2'")
        if name in dims:
            raise MeshError(f"mesh dimension {name!r} given twice in {spec!r}")
        dims[name] = int(size)
    if not dims:
        raise MeshError(f"empty mesh spec {spec!r}: expected NAME=SIZE[,NAME=SIZE...], e.g. 'dp=2,tp=2'")
    return dims


def _ordered_dims(dims: Mapping[str, int], order: tuple[str, ...] | None) -> dict[str, int]:
    order = tuple(order) if order is not None else CANONICAL_DIM_ORDER
    unknown = [name for name in dims if name not in order]
    if unknown:
        raise MeshError(f"unknown mesh dimension(s) {unknown}: known names, outermost first, are {list(order)} "
                        "(pass order=... to use others)")
    for name, size in dims.items():
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise MeshError(f"mesh dimension {name!r} must have a positive integer size, got {size!r}")
    return {name: dims[name] for name in order if name in dims}


def init_mesh(dims: Mapping[str, int] | str, *, device_type: str | None = None,
              order: tuple[str, ...] | None = None, world_size: int | None = None):
    """Build a named :class:`torch.distributed.device_mesh.DeviceMesh` over all ranks of the default process group.

    ``dims`` maps dimension names to sizes (or is a ``"dp=2,tp=2"`` string); they are laid out in canonical order
    (``pp, dp, dp_replicate, dp_shard, cp, ep, tp``, or ``order``). ``device_type`` defaults to ``cuda`` when the
    default group uses NCCL, else ``cpu``. Raises :class:`MeshError`, on every rank and before any collective, when
    the sizes' product differs from the world size or a name is unknown.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if isinstance(dims, str):
        dims = parse_mesh_spec(dims)
    ordered = _ordered_dims(dims, order)
    if world_size is None:
        if not dist.is_initialized():
            raise MeshError("init_mesh needs an initialised process group (see vescale.core.launch)")
        world_size = dist.get_world_size()
    product = math.prod(ordered.values())
    if product != world_size:
        shape = " x ".join(f"{n}={s}" for n, s in ordered.items())
        raise MeshError(f"mesh {shape} has {product} ranks but the world size is {world_size}")
    if device_type is None:
        device_type = "cuda" if dist.is_initialized() and dist.get_backend() == "nccl" else "cpu"
    return init_device_mesh(device_type, tuple(ordered.values()), mesh_dim_names=tuple(ordered))


def sub_mesh(mesh, *names: str):
    """The sub-mesh over the named dimensions (in mesh order), e.g. ``sub_mesh(mesh, "dp", "tp")``.

    Names absent from ``mesh`` raise :class:`MeshError` listing the mesh's names.
    """
    have = tuple(mesh.mesh_dim_names or ())
    missing = [n for n in names if n not in have]
    if missing or not names:
        raise MeshError(f"mesh has dimensions {list(have)}; cannot take sub-mesh {list(names)}")
    ordered = tuple(n for n in have if n in names)
    return mesh[ordered[0]] if len(ordered) == 1 else mesh[ordered]


def dim_size(mesh, name: str) -> int:
    """Size of dimension ``name`` in ``mesh``, 1 when the mesh has no such dimension."""
    names = tuple(mesh.mesh_dim_names or ())
    return mesh.size(names.index(name)) if name in names else 1


def mesh_coordinates(mesh) -> dict[str, int]:
    """This rank's coordinate along each named dimension, e.g. ``{"pp": 0, "dp": 1, "tp": 0}``."""
    coords = mesh.get_coordinate()
    if coords is None:
        raise MeshError("this rank is not part of the mesh")
    return dict(zip(mesh.mesh_dim_names, coords))


def dim_mesh(mesh, dims: str | tuple[str, ...] = "dp", *, whole_if_1d: bool = True):
    """The part of ``mesh`` along ``dims`` (one name or several, in mesh order), or None when it lacks one of them.

    With ``whole_if_1d`` (the convention of the data-parallel APIs: a 1-D mesh handed to DDP or ZeRO *is* the dp
    mesh), a 1-D mesh is returned whole whatever its dimension is called. Local; issues no collective.
    """
    names = (dims,) if isinstance(dims, str) else tuple(dims)
    if whole_if_1d and mesh.ndim == 1:
        return mesh
    have = tuple(mesh.mesh_dim_names or ())
    if not names or any(n not in have for n in names):
        return None
    return sub_mesh(mesh, *names)


def dim_group(mesh_or_group, dim: str = "dp", *, whole_if_1d: bool = True):
    """``(process group, dimension name)`` of this rank along mesh dimension ``dim``, or None when there is none.

    ``mesh_or_group`` is a DeviceMesh (resolved as :func:`dim_mesh` does; a whole 1-D mesh keeps its own name, or
    ``dim`` when unnamed) or a ProcessGroup (returned as is, named ``dim``). Local; issues no collective.
    """
    if not hasattr(mesh_or_group, "mesh_dim_names"):
        return mesh_or_group, dim
    found = dim_mesh(mesh_or_group, dim, whole_if_1d=whole_if_1d)
    if found is None:
        return None
    names = tuple(found.mesh_dim_names or ())
    return found.get_group(), (names[0] if names else dim)
