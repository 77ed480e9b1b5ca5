"""Sharding propagation of view-family ops (``view``, ``reshape``, ``flatten``, ``unflatten``, ``expand``,
``permute``, ``transpose``, ``unsqueeze``, ``squeeze``, ``repeat``) for inputs with an interleaved placement
(:class:`~vescale.dtensor.InterleavedShard`, i.e. torch's ``_StridedShard``), registered by :func:`install` on first
use of :mod:`vescale.dtensor` (never at import).

torch's view rules treat ``_StridedShard`` as the by-product of its own flatten (FSDP2 + TP) and get general
interleaved layouts wrong: ``[24] _StridedShard(sf=3)`` viewed as ``[4, 6]`` on 2 ranks comes out as
``_StridedShard(1, sf=3)`` (wrong values), flattening a dim after an interleaved one fails with a bare ``KeyError``,
and uneven pieces give local shapes that do not fit (``shape '[12]' is invalid for input of size 16``).

The contract here: for every mesh dim holding a ``_StridedShard``, the output placement is one this module can prove
correct, else that mesh dim of the input is redistributed to ``Replicate`` first, which only the ops that copy on one
device may do (below). The proof: a view keeps the row-major order of elements, and splits or merges whole groups of
adjacent dims; a dim of size ``N`` placed ``_StridedShard(sf)`` on a mesh dim of size ``m`` is ``sf`` chunks of ``N /
sf`` elements, each cut in ``m`` pieces by ``torch.chunk``'s rule. Within one group (its flattened size ``F``) that is
``sf * (elements of the group before the dim)`` chunks of ``F / that`` elements, provided each chunk's cut falls on
whole rows of the dims after it; the output then carries it on the output dim of the group where the chunk boundaries
land, again only when the cut falls on whole rows there. Anything else (a group with two sharded mesh dims, a size not
divisible by the split factor, a broadcast or repeated dim) is replicated. Mesh dims with plain
``Shard``/``Replicate``/``Partial`` keep torch's own rules. Inputs without ``_StridedShard`` go to torch, whose output
is then checked when two mesh dims shard the input: every mesh coordinate must hold as many elements in and out (nested
uneven ``Shard``s broke that); if not, the merged or split dims are replicated first.

A view stays a view: for the ops that alias their input on one device (:data:`ALIAS_VIEW_OPS`: ``view``, and so
``flatten``/``unflatten``/``reshape`` of a viewable tensor, ``squeeze``, ``unsqueeze``, ``permute``, ``transpose``,
``expand``) a strategy that would redistribute the input (torch's own fallback included) is refused with
:class:`~vescale.dtensor.ViewRedistributeError`, as is torch's refusal of an unevenly sharded view; the error names
the op, shape, placements, mesh and each mesh dim that would move, and why (torch's "is not evenly divisible by mesh
dimension" where a shard is uneven). It is raised during sharding propagation, from global shapes and placements, so
every rank raises it before any collective. ``reshape``'s copy path (``_unsafe_view`` of a clone), ``view_copy``,
``expand_copy`` and ``repeat`` copy on one device too and may redistribute. (``sharding_rules._view_of_relaid`` takes
a refused ``view`` issued inside autograd's backward, a gradient reshaped by a derivative formula, as that copy.)

:class:`~vescale.dtensor.RaggedShard` inputs of these ops and of ``split``, ``slice`` (``narrow``, indexing),
``select``, ``cat``, ``stack``, ``unbind``, ``t`` and ``diagonal`` raise :class:`~vescale.dtensor.PlacementError`
(re-raised by torch's dispatcher as ``RuntimeError`` with its message) naming the op, shape, placement and mesh dim:
torch would treat the unknown placement like ``Replicate`` and return wrong values or fail on a local shape.

An empty input of ``view``/``reshape`` takes :func:`vescale.dtensor._empty_view.empty_view_strategy` (torch's dim map
never returns for some empty shapes): viewed as it is where replicated or partial, refused by name where sharded.

This is the one module that reaches into torch's private view-rule machinery (``_view_ops.dim_maps`` for the dim
mapping of each op, ``propagate_shape_and_sharding`` for the non-interleaved mesh dims, and the sharding
propagator's strategy table to wrap torch's strategies): torch offers no public hook for sharding rules.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from vescale.core import torch_internals
from vescale.core.errors import VescaleError
from vescale.core.torch_internals import (
    Broadcast,
    DTensorSpec,
    Flatten,
    InputDim,
    NewDim,
    OpOverload,
    OpSchema,
    OpSpec,
    OpStrategy,
    Repeat,
    Singleton,
    Split,
    StrategyType,
    TupleStrategy,
    generate_redistribute_costs,
    register_op_strategy,
)
from vescale.core.torch_internals import StridedShard as _StridedShard
from vescale.core.torch_internals import view_ops as _view_ops
from vescale.dtensor._empty_view import RESHAPE_DIM_MAPS, empty_view_strategy
from vescale.dtensor.errors import PlacementError, ViewRedistributeError
from vescale.dtensor.layout import local_dim_indices, local_shape
from vescale.dtensor.placements import RaggedShard

__all__ = ["propagate_strided_view", "replicate_reshaped", "VIEW_OPS", "ALIAS_VIEW_OPS", "RAGGED_REFUSED", "install"]

aten = torch.ops.aten

#: The view-family ATen ops whose torch strategy is wrapped, with the torch function whose dim map they use
#: (the same pairs torch registers in ``torch/distributed/tensor/_ops/_view_ops.py``).
VIEW_OPS: dict[OpOverload, tuple[Callable, bool]] = {
    aten.view.default: (Tensor.view, True),
    aten._unsafe_view.default: (Tensor.view, True),
    aten.view_copy.default: (Tensor.view, False),
    aten.reshape.default: (torch.reshape, False),
    aten.expand.default: (Tensor.expand, False),
    aten.expand_copy.default: (Tensor.expand, False),
    aten.permute.default: (torch.permute, False),
    aten.transpose.int: (torch.transpose, False),
    aten.unsqueeze.default: (torch.unsqueeze, False),
    aten.repeat.default: (Tensor.repeat, False),
    aten.squeeze.default: (torch.squeeze, True),
    aten.squeeze.dim: (torch.squeeze, True),
    aten.squeeze.dims: (torch.squeeze, True),
}


def _pieces(n: int, parts: int) -> list[int]:
    """Sizes ``torch.chunk`` (and so ``Shard``) gives when ``n`` elements are cut into ``parts``."""
    c = -(-n // parts) if n else 0
    return [max(0, min(c, n - r * c)) for r in range(parts)]


def _cut_on_rows(rows: int, row_len: int, parts: int) -> bool:
    """Whether cutting ``rows * row_len`` elements in ``parts`` (torch's chunk rule) cuts whole rows, exactly as
    cutting the ``rows`` would."""
    return _pieces(rows * row_len, parts) == [p * row_len for p in _pieces(rows, parts)]


def _group_of(rule: Sequence, in_dim: int) -> tuple[list[int], list[int], tuple[int, ...]] | None:
    """The view group of input dim ``in_dim``: (input dims, output dims in order, output group sizes), or None when
    the rule does something other than keep, flatten or split it (broadcast, repeat, dropped)."""
    hits = []
    for out_dim, cmd in enumerate(rule):
        if isinstance(cmd, Singleton):
            continue
        src = cmd.input_dim if isinstance(cmd, Split) else cmd
        if isinstance(src, InputDim):
            dims = [src.input_dim]
        elif isinstance(src, Flatten) and all(isinstance(d, InputDim) for d in src.input_dims):
            dims = [d.input_dim for d in src.input_dims]
        else:
            if _mentions(cmd, in_dim):
                return None
            continue
        if in_dim in dims:
            hits.append((out_dim, cmd, dims))
    if not hits:
        return None
    in_dims = hits[0][2]
    if any(h[2] != in_dims for h in hits):
        return None
    if len(hits) == 1 and not isinstance(hits[0][1], Split):
        return in_dims, [hits[0][0]], ()
    if not all(isinstance(h[1], Split) for h in hits):
        return None
    shape = hits[0][1].group_shape
    if any(h[1].group_shape != shape for h in hits) or sorted(h[1].split_id for h in hits) != list(range(len(shape))):
        return None
    return in_dims, [h[0] for h in sorted(hits, key=lambda h: h[1].split_id)], tuple(shape)


def _mentions(cmd, in_dim: int) -> bool:
    if isinstance(cmd, InputDim):
        return cmd.input_dim == in_dim
    return any(_mentions(c, in_dim) for c in cmd.inputs())


def _strided_output(p: _StridedShard, mesh_size: int, in_shape: Sequence[int], rule: Sequence
                    ) -> tuple[Placement | None, list[int]]:
    """The output placement of interleaved ``p`` through ``rule`` (None when it cannot be proven), and the input dims
    of its view group (to detect other mesh dims sharding the same group)."""
    group = _group_of(rule, p.dim)
    if group is None:
        return None, [p.dim]
    in_dims, out_dims, out_sizes = group
    sf = torch_internals.split_factor(p)
    size = int(in_shape[p.dim])
    if sf < 1 or size % sf:
        return None, in_dims
    if len(out_dims) == 1 and not out_sizes:
        out_sizes = (math.prod(int(in_shape[d]) for d in in_dims),)
    # the group flattened: sf_flat chunks of `chunk` elements, each cut in mesh_size pieces on whole rows of `after`
    k = in_dims.index(p.dim)
    before = math.prod(int(in_shape[d]) for d in in_dims[:k])
    after = math.prod(int(in_shape[d]) for d in in_dims[k + 1:])
    if not _cut_on_rows(size // sf, after, mesh_size):
        return None, in_dims
    sf_flat = before * sf
    # the output dim where the chunk boundaries land: prod(out_sizes[:i]) divides sf_flat, which divides
    # prod(out_sizes[:i + 1]); when it divides exactly, each chunk is one index of dim i and the cut lies further in
    lead = 1
    for i, n in enumerate(out_sizes):
        exact = lead * n == sf_flat and i < len(out_sizes) - 1
        if sf_flat % lead == 0 and (lead * n) % sf_flat == 0 and not exact:
            s = sf_flat // lead
            rest = math.prod(out_sizes[i + 1:])
            if not _cut_on_rows(n // s, rest, mesh_size):
                return None, in_dims
            return (Shard(out_dims[i]) if s == 1 else _StridedShard(out_dims[i], split_factor=s)), in_dims
        lead *= n
    return None, in_dims


def propagate_strided_view(placements: Sequence[Placement], in_shape: Sequence[int], rule: Sequence,
                           mesh_shape: Sequence[int], strict_view: bool
                           ) -> tuple[list[Placement], list[Placement]]:
    """(input target placements, output placements) of a view-family op with dim map ``rule``.

    Every ``_StridedShard`` mesh dim either maps to a proven output placement or becomes ``Replicate`` in the input
    target (a redistribution); the other mesh dims follow torch's ``propagate_shape_and_sharding``.
    """
    placements = list(placements)
    decided: dict[int, Placement | None] = {}
    groups: dict[int, list[int]] = {}
    for mesh_dim, p in enumerate(placements):
        if isinstance(p, _StridedShard):
            decided[mesh_dim], groups[mesh_dim] = _strided_output(p, mesh_shape[mesh_dim], in_shape, rule)
    # a group reshaped while another mesh dim shards it too: the nested layout is not analysed, replicate
    for mesh_dim, dims in groups.items():
        group = _group_of(rule, placements[mesh_dim].dim)
        identity = group is not None and len(group[0]) == 1 and len(group[1]) == 1
        if identity:
            continue
        others = [m for m, q in enumerate(placements)
                  if m != mesh_dim and isinstance(q, (Shard, _StridedShard)) and q.dim in dims]
        if others:
            decided[mesh_dim] = None
    torch_in = [Replicate() if m in decided else p for m, p in enumerate(placements)]
    tgt, out = _view_ops.propagate_shape_and_sharding(torch_in, tuple(in_shape), rule, tuple(mesh_shape),
                                                      strict_view)
    tgt, out = list(tgt), list(out)
    for mesh_dim, placement in decided.items():
        if placement is not None:
            tgt[mesh_dim], out[mesh_dim] = placements[mesh_dim], placement
    return tgt, out


#: The view-family ops that return an alias of their input on one device. Their strategy never redistributes the
#: input: where no output placement is a view of each rank's local tensor they raise :class:`ViewRedistributeError`
#: (a gathered copy would not alias the input). ``reshape``, ``_unsafe_view`` (reshape's copy path: a view of a fresh
#: clone), ``view_copy``, ``expand_copy`` and ``repeat`` copy on one device too and may redistribute.
ALIAS_VIEW_OPS: frozenset[OpOverload] = frozenset({
    aten.view.default, aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.unsqueeze.default,
    aten.permute.default, aten.transpose.int, aten.expand.default,
})


#: Shape ops whose torch strategy would pass a ``RaggedShard`` through as if it were ``Replicate`` (wrong values or a
#: local shape error): refused with a :class:`PlacementError` instead.
RAGGED_REFUSED: tuple[OpOverload, ...] = (
    *VIEW_OPS, aten.split.Tensor, aten.split_with_sizes.default, aten.split_with_sizes_copy.default,
    aten.slice.Tensor, aten.select.int, aten.cat.default, aten.stack.default, aten.unbind.int, aten.t.default,
    aten.diagonal.default,
)


def _strategies(arg) -> list[OpStrategy]:
    if isinstance(arg, OpStrategy):
        return [arg]
    if isinstance(arg, TupleStrategy):
        return [c for child in arg.children for c in _strategies(child)]
    return []


def _refuse_ragged(op: OpOverload, op_schema: OpSchema) -> None:
    for arg in op_schema.args_schema:
        for strategy in _strategies(arg):
            for spec in strategy.strategies:
                for mesh_dim, p in enumerate(spec.output_spec.placements):
                    if isinstance(p, RaggedShard):
                        mesh = spec.output_spec.mesh
                        raise PlacementError(
                            f"{op}: input of global shape {tuple(strategy.shape)} is placed {p!r} on mesh dim "
                            f"{mesh_dim} of mesh {tuple(mesh.shape)} (dims {mesh.mesh_dim_names}); torch's shape "
                            f"ops do not know RaggedShard. Call vescale.dtensor.redistribute(t, mesh, [Shard(0)] or "
                            f"[Replicate()]) first")


def _out_shape(rule: Sequence, in_shape: Sequence[int]) -> tuple[int, ...]:
    """Global output shape of a view-family dim map ``rule`` applied to ``in_shape``."""

    def size(cmd) -> int:
        if isinstance(cmd, InputDim):
            return int(in_shape[cmd.input_dim])
        if isinstance(cmd, Flatten):
            return math.prod(size(c) for c in cmd.input_dims)
        if isinstance(cmd, Split):
            return int(cmd.group_shape[cmd.split_id])
        if isinstance(cmd, Singleton):
            return 1
        if isinstance(cmd, Broadcast):
            return int(cmd.dim_size)
        if isinstance(cmd, NewDim):
            return int(cmd.size)
        if isinstance(cmd, Repeat):
            return int(cmd.times) * size(cmd.input_dim)
        raise NotImplementedError(f"unknown view dim spec {cmd!r}")

    return tuple(size(cmd) for cmd in rule)


def _local_sizes_agree(mesh, in_shape: Sequence[int], tgt: Sequence[Placement], out_shape: Sequence[int],
                       out: Sequence[Placement]) -> bool:
    """Whether every mesh coordinate holds as many elements of the input (placed ``tgt``) as of the output (placed
    ``out``): a view of the local tensor needs it, and torch's rules miss it for some nested uneven ``Shard``s.
    Ops that change the element count (``expand``, ``repeat``) are not checked."""
    if math.prod(in_shape) != math.prod(out_shape):
        return True
    for coord in itertools.product(*(range(n) for n in mesh.shape)):
        if math.prod(local_shape(in_shape, mesh, tgt, coord)) != math.prod(local_shape(out_shape, mesh, out, coord)):
            return False
    return True


#: Largest view group (elements) whose layout :func:`_layout_kept` checks index by index; a larger nested or interleaved
#: group is replicated rather than trusted.
_MAX_CHECKED_GROUP = 1 << 22


def _group_order(mesh, shape: Sequence[int], dims: Sequence[int], placements: Sequence[Placement],
                 coord: Sequence[int]) -> torch.Tensor:
    """The row-major flat index, within the group of ``dims`` of ``shape``, of each element the mesh coordinate
    ``coord`` holds, in local order (mesh dims placing other tensor dims are ignored)."""
    sizes = [int(shape[d]) for d in dims]
    local = []
    for p in placements:
        if isinstance(p, _StridedShard) and p.dim in dims:
            local.append(_StridedShard(list(dims).index(p.dim), split_factor=torch_internals.split_factor(p)))
        elif isinstance(p, Shard) and not isinstance(p, _StridedShard) and p.dim in dims:
            local.append(Shard(list(dims).index(p.dim)))
        else:
            local.append(Replicate())
    idx = local_dim_indices(sizes, mesh, local, coord)
    flat = torch.zeros((), dtype=torch.int64)
    for ix, n in zip(idx, sizes):
        flat = (flat.unsqueeze(-1) * n + ix).reshape(-1) if flat.dim() else ix.clone()
    return flat


def _layout_kept(mesh, in_shape: Sequence[int], tgt: Sequence[Placement], out_shape: Sequence[int],
                 out: Sequence[Placement], rule: Sequence) -> bool:
    """Whether a view (same element count, row-major order kept) of an input placed ``tgt`` is exactly the output
    placed ``out`` on every mesh coordinate: the local tensor is viewed, so each coordinate's local elements, in
    local order, must be the same global elements. Checked index by index per view group touched by a sharded mesh
    dim (a group of more than ``_MAX_CHECKED_GROUP`` elements counts as not proven). torch's rules get nested
    layouts wrong: ``[E, T, H]`` placed (Shard(1), _StridedShard(1, sf=2)) viewed as ``[E * T, H]`` comes out as
    (_StridedShard(0, sf=E), _StridedShard(0, sf=2)), which holds other rows on the second mesh dim."""
    if math.prod(in_shape) != math.prod(out_shape):
        return True
    groups: dict[tuple[int, ...], list[int]] = {}
    for d in range(len(in_shape)):
        group = _group_of(rule, d)
        if group is not None:
            groups[tuple(group[0])] = group[1]
    touched = set()
    for p in tgt:
        if isinstance(p, (Shard, _StridedShard)):
            key = next((k for k in groups if p.dim in k), None)
            if key is None:
                return False
            touched.add(key)
    for p in out:
        if isinstance(p, (Shard, _StridedShard)):
            key = next((k for k, o in groups.items() if p.dim in o), None)
            if key is None:
                return False
            touched.add(key)
    for in_dims in touched:
        out_dims = groups[in_dims]
        if math.prod(int(in_shape[d]) for d in in_dims) > _MAX_CHECKED_GROUP:
            return False
        acting = [m for m in range(mesh.ndim)
                  if (isinstance(tgt[m], (Shard, _StridedShard)) and tgt[m].dim in in_dims)
                  or (isinstance(out[m], (Shard, _StridedShard)) and out[m].dim in out_dims)]
        with torch_internals.outside_dispatch_modes():  # real index tensors, also while torch.compile traces
            for combo in itertools.product(*(range(mesh.size(m)) for m in acting)):
                coord = [0] * mesh.ndim
                for m, c in zip(acting, combo):
                    coord[m] = c
                if not torch.equal(_group_order(mesh, in_shape, in_dims, tgt, coord),
                                   _group_order(mesh, out_shape, out_dims, out, coord)):
                    return False
    return True


def _replicate_reshaped(placements: Sequence[Placement], rule: Sequence) -> list[Placement]:
    """``placements`` with every mesh dim that shards a dim the view merges, splits or drops set to ``Replicate``."""
    out = []
    for p in placements:
        if isinstance(p, (Shard, _StridedShard)):
            group = _group_of(rule, p.dim)
            if group is None or len(group[0]) != 1 or len(group[1]) != 1:
                p = Replicate()
        out.append(p)
    return out


def replicate_reshaped(t, size: Sequence[int]) -> list[Placement]:
    """The placements of DTensor ``t`` with every mesh dim that shards a dim ``t.view(size)`` merges, splits or drops
    set to ``Replicate`` (a layout the view keeps as it is, for the copy a refused view's caller may take instead)."""
    return _replicate_reshaped(t.placements, _view_ops.dim_maps[Tensor.view](t, list(size)))


def _view_strategy(op: OpOverload, dim_map_fn: Callable, strict_view: bool, torch_strategy: Callable
                   ) -> Callable[[OpSchema], StrategyType]:
    """The strategy of view-family ``op``: vescale's rules (interleaved inputs, nested shards) around torch's.

    For ``strict_view`` ops (torch refuses to redistribute their input) a refusal by torch's rule is raised as
    :class:`ViewRedistributeError` with torch's reason; for :data:`ALIAS_VIEW_OPS` a strategy that would redistribute
    the input is refused the same way (see :func:`_refuse_copying_view`)."""
    dim_map = _view_ops.dim_maps[dim_map_fn]
    placed = _placed_view_strategy(op, dim_map, strict_view, torch_strategy)

    def strategy(op_schema: OpSchema) -> StrategyType:
        try:
            result = placed(op_schema)
        except RuntimeError as e:
            if not strict_view or isinstance(e, VescaleError):
                raise
            raise ViewRedistributeError(f"{op}: {_describe_input(op_schema)}: {e}") from e
        if op in ALIAS_VIEW_OPS:
            _refuse_copying_view(op, op_schema, result, dim_map)
        return result

    return strategy


def _describe_input(op_schema: OpSchema) -> str:
    """``global shape ... placed ... on mesh ... (dims ...), args ...`` for the input of a view-family op."""
    input_strategy = op_schema.args_schema[0]
    args = tuple(op_schema.args_schema[1:])
    if not isinstance(input_strategy, OpStrategy):
        return f"args {args}"
    spec = input_strategy.strategies[0].output_spec
    mesh = spec.mesh
    return (f"input of global shape {tuple(input_strategy.shape)} placed {tuple(spec.placements)} on mesh "
            f"{tuple(mesh.shape)} (dims {mesh.mesh_dim_names}), args {args}")


def _why_not_local(p: Placement, mesh_dim: int, mesh_size: int, in_shape: Sequence[int], rule: Sequence | None
                   ) -> str:
    """Why the shard ``p`` (on mesh dim ``mesh_dim`` of ``mesh_size``) cannot stay put through the view ``rule``."""
    if not isinstance(p, (Shard, _StridedShard)):
        return "not a shard"
    n = int(in_shape[p.dim])
    if isinstance(p, _StridedShard):
        sf = torch_internals.split_factor(p)
        if n % sf == 0 and (n // sf) % mesh_size:
            return (f"input dimension {p.dim} (size {n}) is {sf} interleaved chunks of {n // sf}, a size that is "
                    f"not evenly divisible by mesh dimension {mesh_dim} (size {mesh_size})")
    elif n % mesh_size:
        return (f"input dimension {p.dim} (size {n}) is not evenly divisible by mesh dimension {mesh_dim} "
                f"(size {mesh_size})")
    group = _group_of(rule, p.dim) if rule is not None else None
    if group is not None and len(group[1]) > 1:
        sizes = group[2]
        for out_dim, size in zip(group[1], sizes):
            if size % mesh_size:
                return (f"output dimension {out_dim} (size {size}) is not evenly divisible by mesh dimension "
                        f"{mesh_dim} (size {mesh_size})")
    return "the local pieces are not whole blocks of any output dimension"


def _refuse_copying_view(op: OpOverload, op_schema: OpSchema, result: StrategyType, dim_map: Callable) -> None:
    """Raise :class:`ViewRedistributeError` when ``result`` (the strategy of alias view ``op``) redistributes the
    input: no output strategy takes the input as it is placed. A view of a DTensor is a view of each rank's local
    tensor or it is refused; a gathered copy would not alias the input (an in-place write through it would not reach
    the input, as it does on one device). Pure function of global shapes and placements: every rank raises alike,
    before any collective."""
    input_strategy = op_schema.args_schema[0]
    if not isinstance(input_strategy, OpStrategy) or not isinstance(result, OpStrategy) or not result.strategies:
        return
    sources = {tuple(s.output_spec.placements) for s in input_strategy.strategies}
    if any(tuple(spec.input_specs[0].placements) in sources for spec in result.strategies):
        return
    src = input_strategy.strategies[0].output_spec
    tgt = result.strategies[0].input_specs[0]
    mesh = src.mesh
    in_shape = tuple(input_strategy.shape)
    try:
        rule = dim_map(*op_schema.args_schema, **op_schema.kwargs_schema)
    except Exception:  # the reason is best effort (symbolic sizes); the refusal is not
        rule = None
    moved = [f"mesh dimension {m} (size {mesh.size(m)}) from {a!r} to {b!r}: "
             f"{_why_not_local(a, m, mesh.size(m), in_shape, rule)}"
             for m, (a, b) in enumerate(zip(src.placements, tgt.placements)) if a != b]
    raise ViewRedistributeError(
        f"{op}: {_describe_input(op_schema)}: no placement of the output is a view of each rank's local tensor; it "
        f"would redistribute " + "; ".join(moved) + ". A view never copies: redistribute the input explicitly "
        "first (DTensor.redistribute), or take a copy")


def _placed_view_strategy(op: OpOverload, dim_map: Callable, strict_view: bool, torch_strategy: Callable
                          ) -> Callable[[OpSchema], StrategyType]:
    def strategy(op_schema: OpSchema) -> StrategyType:
        _refuse_ragged(op, op_schema)
        input_strategy = op_schema.args_schema[0]
        if not isinstance(input_strategy, OpStrategy):
            return torch_strategy(op_schema)
        in_shape = tuple(input_strategy.shape)
        if dim_map in RESHAPE_DIM_MAPS and any(isinstance(n, int) and n == 0 for n in in_shape):
            return empty_view_strategy(op, input_strategy, op_schema)  # (torch's dim map would never return)
        sizes = [*in_shape, *(a for arg in op_schema.args_schema[1:]
                              for a in (arg if isinstance(arg, (list, tuple)) else (arg,)))]
        if any(isinstance(n, torch.SymInt) for n in sizes):
            # Symbolic shapes (torch.compile tracing with dynamic sizes): the size arithmetic below needs concrete
            # sizes, so torch's own rule decides (see the README's limitation for interleaved inputs under compile).
            return torch_strategy(op_schema)
        strided = any(isinstance(p, _StridedShard) for s in input_strategy.strategies for p in s.output_spec.placements)
        if strided and any(_nested(s.output_spec.placements) for s in input_strategy.strategies):
            # A tensor dim sharded by two mesh dims with a _StridedShard among them is torch's own nested layout
            # (batch on dp and sequence on tp flattened together, FSDP x TP): torch's rule is written for it and
            # keeps it sharded (replicating here would cost an all-gather per block and breaks torch.compile's
            # tracing of the graphs after it). Where torch's rule cannot place it, vescale's below replicates.
            # torch's rule is checked element by element and used only where it keeps every coordinate's elements.
            try:
                result = torch_strategy(op_schema)
            except (RuntimeError, AssertionError, NotImplementedError):
                result = None
            if result is not None:
                rule = dim_map(*op_schema.args_schema, **op_schema.kwargs_schema)
                mesh = op_schema.get_mesh_from_args(validate=False)
                out_shape = _out_shape(rule, in_shape)
                if all(_layout_kept(mesh, in_shape, spec.input_specs[0].placements, out_shape,
                                    spec.output_spec.placements, rule) for spec in result.strategies):
                    return result
        if not strided:
            result = torch_strategy(op_schema)
            # torch's rules are right for one sharded mesh dim; nested uneven Shards of one group can get local
            # shapes that do not fit (then: replicate the reshaped dims). Symbolic shapes (compile) stay torch's.
            nested = any(sum(isinstance(p, (Shard, _StridedShard)) for p in s.output_spec.placements) > 1
                         for s in input_strategy.strategies)
            if not nested or not all(isinstance(n, int) for n in in_shape):
                return result
        rule = dim_map(*op_schema.args_schema, **op_schema.kwargs_schema)
        mesh = op_schema.get_mesh_from_args(validate=False)
        out_shape = _out_shape(rule, in_shape)
        if not strided and all(_local_sizes_agree(mesh, in_shape, spec.input_specs[0].placements, out_shape,
                                                  spec.output_spec.placements)
                               and _layout_kept(mesh, in_shape, spec.input_specs[0].placements, out_shape,
                                                spec.output_spec.placements, rule)
                               for spec in result.strategies):
            return result
        result = OpStrategy([])
        for spec in input_strategy.strategies:
            src = spec.output_spec
            try:
                tgt, out = propagate_strided_view(src.placements, in_shape, rule, tuple(mesh.shape), strict_view)
                if not (_local_sizes_agree(mesh, in_shape, tgt, out_shape, out)
                        and _layout_kept(mesh, in_shape, tgt, out_shape, out, rule)):
                    tgt, out = propagate_strided_view(_replicate_reshaped(src.placements, rule), in_shape, rule,
                                                      tuple(mesh.shape), strict_view)
            except RuntimeError as e:
                error = ViewRedistributeError if strict_view else RuntimeError
                raise error(f"{op}: input of global shape {in_shape} with placements {tuple(src.placements)} on mesh "
                            f"{tuple(mesh.shape)} (dims {mesh.mesh_dim_names}): {e}") from e
            if not (_local_sizes_agree(mesh, in_shape, tgt, out_shape, out)
                    and _layout_kept(mesh, in_shape, tgt, out_shape, out, rule)):
                raise PlacementError(f"{op}: no consistent output placement for input of global shape {in_shape} "
                                     f"placed {tuple(src.placements)} on mesh {tuple(mesh.shape)} (dims "
                                     f"{mesh.mesh_dim_names}); redistribute it to Replicate first")
            tgt_spec = DTensorSpec(mesh=mesh, placements=tuple(tgt), tensor_meta=src.tensor_meta,
                                   use_strided_shard_as_shard_order=False)
            result.strategies.append(OpSpec(
                output_specs=DTensorSpec(mesh=mesh, placements=tuple(out), use_strided_shard_as_shard_order=False),
                input_specs=(tgt_spec,),
                redistribute_cost=[generate_redistribute_costs(input_strategy, tgt_spec)]))
        return result

    return strategy


def _nested(placements: Sequence[Placement]) -> bool:
    """Whether some tensor dim is sharded by more than one mesh dim."""
    dims = [p.dim for p in placements if isinstance(p, (Shard, _StridedShard))]
    return len(dims) != len(set(dims))


def _ragged_guard(op: OpOverload, torch_strategy: Callable) -> Callable[[OpSchema], StrategyType]:
    def strategy(op_schema: OpSchema) -> StrategyType:
        _refuse_ragged(op, op_schema)
        return torch_strategy(op_schema)

    return strategy


def install() -> None:
    """Wrap torch's strategies of the ops above with these rules (idempotent)."""
    propagator = torch_internals.sharding_propagator()
    for op in RAGGED_REFUSED:
        torch_strategy = propagator.op_strategy_funcs[op]
        if getattr(torch_strategy, "_vescale_wrapped", False):
            continue  # already wrapped (module reloaded)
        if op in VIEW_OPS:
            fn, strict_view = VIEW_OPS[op]
            new = _view_strategy(op, fn, strict_view, torch_strategy)
        else:
            new = _ragged_guard(op, torch_strategy)
        new._vescale_wrapped = True
        register_op_strategy(op, schema_info=propagator.op_to_schema_info.get(op))(new)
    torch_internals.clear_sharding_caches()  # (the C++ fast-path cache too: ops may have run before install)
