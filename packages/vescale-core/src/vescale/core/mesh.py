"""Named device meshes in one canonical dimension order.

Every vescale package speaks of mesh dimensions by name: ``pp`` (pipeline), ``dp`` (data / ZeRO), ``cp`` (context),
``ep`` (expert) and ``tp`` (tensor and sequence). :func:`init_mesh` puts the dimensions a user names in that order, so
``{"tp": 2, "dp": 2}`` and ``{"dp": 2, "tp": 2}`` give the same mesh, and neighbouring ranks share the innermost
(``tp``) dimension, the one with the most traffic.

Dimensions are kept exactly as given: a dimension named with size 1 stays in the mesh (so code may always index
``mesh["tp"]``), and a dimension that is not named is absent. :func:`dim_size` answers 1 for an absent dimension.

:class:`MeshRoles` is the one place that says which ranks play which role (split the batch, average dense or expert
gradients, shard ZeRO 3, carry the model's DTensors); every package asks it rather than deriving a role itself.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vescale.core.errors import MeshError

__all__ = ["CANONICAL_DIM_ORDER", "HSDP_DIMS", "DATA_DIMS", "init_mesh", "parse_mesh_spec", "sub_mesh", "dim_size",
           "mesh_coordinates", "dim_mesh", "dim_group", "MeshRole", "MeshRoles", "hsdp_pair", "batch_size_of"]

#: Outermost to innermost. Unknown names are rejected unless an explicit ``order`` is given.
#: ``dp_replicate`` / ``dp_shard`` are the two dims of hybrid sharded data parallelism (HSDP: replicas of ZeRO 3
#: groups), used instead of ``dp`` (``vescale.parallel.fully_shard_dp``).
CANONICAL_DIM_ORDER: tuple[str, ...] = ("pp", "dp", "dp_replicate", "dp_shard", "cp", "ep", "tp")

#: The two dims of HSDP, outer (replicas) then inner (ZeRO-3 shard groups); a mesh names both instead of ``dp``.
HSDP_DIMS: tuple[str, str] = ("dp_replicate", "dp_shard")

#: The dims whose ranks split the global batch (each holds other rows): data parallel (or HSDP's pair) and experts.
DATA_DIMS: tuple[str, ...] = ("dp", *HSDP_DIMS, "ep")


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


def hsdp_pair(names) -> tuple[str, str] | None:
    """The HSDP dims ``(replicate, shard)`` when the mesh dim ``names`` name both (and no ``dp``), None when they name
    neither; raises :class:`MeshError` for one of them alone or next to ``dp``."""
    names = tuple(names)
    named = [n for n in HSDP_DIMS if n in names]
    if not named:
        return None
    if len(named) != 2 or "dp" in names:
        raise MeshError(f"mesh has dimensions {list(names)}: HSDP names both {list(HSDP_DIMS)} (replicas of ZeRO-3 "
                        "shard groups, replicate outer) instead of 'dp'")
    return HSDP_DIMS


def batch_size_of(dims: Mapping[str, int]) -> int:
    """How many ranks split the global batch on a mesh of ``dims`` (no mesh needed): the data dims' product."""
    return math.prod(int(dims.get(n, 1)) for n in DATA_DIMS)


@dataclass(frozen=True)
class MeshRole:
    """One role some ranks of a mesh play together: the 1-D ``mesh`` over them (dims flattened, mesh order), its
    ``size``, this rank's ``rank`` in it and the ``dims`` it spans. A role of one rank has ``mesh`` None (no
    communication needed: ``group`` is None too)."""

    dims: tuple[str, ...] = ()
    size: int = 1
    rank: int = 0
    mesh: Any = None

    @property
    def group(self):
        """The process group of the role (None for a role of one rank)."""
        return None if self.mesh is None else self.mesh.get_group()

    def __bool__(self) -> bool:
        return self.size > 1


def _role(mesh, names: tuple[str, ...]) -> MeshRole:
    from vescale.core.torch_internals import flattened_mesh

    have = tuple(mesh.mesh_dim_names or ()) if mesh is not None else ()
    names = tuple(n for n in have if n in names)
    size = math.prod(dim_size(mesh, n) for n in names) if names else 1
    if size == 1:
        return MeshRole(names)
    part = sub_mesh(mesh, *names)
    flat = part if len(names) == 1 else flattened_mesh(part)
    return MeshRole(names, size, flat.get_local_rank(), flat)


@dataclass(frozen=True)
class MeshRoles:
    """Which ranks of a named mesh do what, said once for every package (``MeshRoles.of(mesh)``).

    - ``batch``: the ranks that split the global batch, each taking its rows in order (``dp`` or HSDP's pair, then
      ``ep``): :meth:`shard_batch` is this rank's slice;
    - ``dense_grads``: the ranks over which the gradient of a parameter every one of them holds is averaged, and over
      which a rank's loss is averaged into the global one: ``batch`` plus ``cp`` (cp ranks hold the same parameters
      and each computes its share of the same rows);
    - ``expert_grads``: the ranks over which an expert's gradient is averaged (the data dims without ``ep``, whose
      all-to-all already summed it), plus ``cp``;
    - ``fsdp``: the mesh ZeRO 3 shards over (FSDP2): ``dp`` (``dp x cp`` flattened with cp), or the 2-D HSDP
      ``(dp_replicate, dp_shard)`` mesh;
    - ``model``: the mesh the model's own DTensors live on, without the data dims: its ``ep`` and ``tp`` dims that are
      larger than one (None when neither is);
    - ``pp``, ``dp``, ``cp``, ``ep``, ``tp``: each dim alone (``dp``: HSDP's pair flattened).

    Each is a :class:`MeshRole` (size 1 and no mesh when the mesh lacks the dims). Building it creates the flattened
    groups it needs (torch caches them), so call it on every rank; nothing else is communicated.
    """

    mesh: Any
    batch: MeshRole
    dense_grads: MeshRole
    expert_grads: MeshRole
    pp: MeshRole
    dp: MeshRole
    cp: MeshRole
    ep: MeshRole
    tp: MeshRole
    fsdp: Any = None
    model: Any = None

    @classmethod
    def of(cls, mesh) -> MeshRoles:
        """The roles of ``mesh`` (a named DeviceMesh, or None for one rank). Raises :class:`MeshError` for a mesh that
        names ``dp`` and an HSDP dim, or only one of the HSDP pair."""
        names = tuple(mesh.mesh_dim_names or ()) if mesh is not None else ()
        pair = hsdp_pair(names)
        dp_dims = ("dp", *HSDP_DIMS)
        fsdp = None
        if pair is not None:
            fsdp = sub_mesh(mesh, *pair)
        elif "dp" in names or "cp" in names:
            fsdp = _role(mesh, ("dp", "cp")).mesh
        model_dims = tuple(n for n in ("ep", "tp") if dim_size(mesh, n) > 1) if mesh is not None else ()
        return cls(mesh=mesh, batch=_role(mesh, DATA_DIMS), dense_grads=_role(mesh, (*DATA_DIMS, "cp")),
                   expert_grads=_role(mesh, (*dp_dims, "cp")), pp=_role(mesh, ("pp",)), dp=_role(mesh, dp_dims),
                   cp=_role(mesh, ("cp",)), ep=_role(mesh, ("ep",)), tp=_role(mesh, ("tp",)), fsdp=fsdp,
                   model=sub_mesh(mesh, *model_dims) if model_dims else None)

    @property
    def hsdp(self) -> bool:
        """Whether the mesh is an HSDP one (``dp_replicate x dp_shard`` instead of ``dp``)."""
        return self.mesh is not None and HSDP_DIMS[0] in (self.mesh.mesh_dim_names or ())

    def shard_batch(self, batch, dim: int = 0):
        """This rank's rows of ``batch`` (a tensor whose ``dim`` is the global batch): the ``batch`` role's
        ``rank``-th of ``size`` equal slices. Raises :class:`MeshError` when the rows do not divide."""
        rows = batch.shape[dim]
        if rows % self.batch.size:
            raise MeshError(f"a global batch of {rows} rows does not divide over the {self.batch.size} ranks that "
                            f"split it ({' x '.join(self.batch.dims)})")
        return batch.chunk(self.batch.size, dim)[self.batch.rank] if self.batch.size > 1 else batch
