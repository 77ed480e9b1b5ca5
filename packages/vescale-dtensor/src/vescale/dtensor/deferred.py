"""Deferred init: build a module on the meta device while recording how each parameter and buffer gets its values,
then materialise it whole (the single-device reference) or as local shards of DTensors.

Recording is a ``TorchDispatchMode`` that sends every factory op to the meta device and logs, per storage, the op
that produced it and every in-place op that wrote to it (``reset_parameters``, HF ``_init_weights``, ``torch.nn.init``),
including the counter-RNG sequence number of each random op (:mod:`vescale.dtensor.random`). Because the device
context stays the real one, libraries that skip init on a meta device context (transformers) still run their init.
Replay runs the same ops with the same RNG keys, so a materialised module equals the module built eagerly inside
``vescale.dtensor.random.single_device()`` after the same seed, and every shard equals the slice of it.

Ops on a deferred module after :func:`deferred_init` returned (a dtype cast, ``model.to(torch.bfloat16)``; a layer
re-initialised) are recorded the same way inside :func:`record_deferred`. A cast of a whole tensor is replayed per
shard: this rank's shard of the fp32 init, cast, which is bitwise the slice of the one-device init cast.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate

from vescale.core import torch_internals
from vescale.core.torch_internals import TorchDispatchMode, pytree
from vescale.dtensor import _torch_hooks
from vescale.dtensor import random as _rng
from vescale.dtensor.errors import DeferredInitError
from vescale.dtensor.layout import contiguous_stride

__all__ = ["deferred_init", "record_deferred", "materialize", "is_deferred", "adopt_deferred"]

aten = torch.ops.aten
_META = torch.device("meta")
_RANDOM = set(_rng._DTENSOR_OPS) | set(_rng._FACTORY_OPS)
# Producers a shard can be created from directly (empty is replayed as zeros, on every path, for determinism).
_FILL_FACTORIES = {aten.empty.memory_format: None, aten.empty_strided.default: None, aten.zeros.default: 0.0,
                   aten.ones.default: 1.0}
_EXTRA_ELEMENTWISE = {aten.fill_.Scalar, aten.zero_.default}


@dataclass
class _Geom:
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int

    @staticmethod
    def of(t: torch.Tensor) -> _Geom:
        return _Geom(tuple(t.shape), tuple(t.stride()), t.storage_offset())


@dataclass
class _Op:
    func: Any
    args: tuple
    kwargs: dict
    geom: _Geom | None = None  # the written view, for in-place ops
    seq: int | None = None  # RNG (seed, seq) of a random op
    seed: int | None = None
    out_index: int = 0


@dataclass
class _Storage:
    keep: torch.Tensor  # keeps the meta storage alive so its id stays unique
    shape: tuple[int, ...]
    dtype: torch.dtype
    entries: list[_Op] = field(default_factory=list)


@dataclass
class _Ref:
    storage: _Storage
    version: int
    geom: _Geom


@dataclass
class _Const:
    value: torch.Tensor


def _sid(t: torch.Tensor) -> int:
    return torch_internals.storage_id(t)


def _is_factory(func) -> bool:
    schema = torch_internals.op_schema(func)
    return any(a.name == "device" for a in schema.arguments) and not any(
        isinstance(a.type, torch.TensorType) for a in schema.arguments)


def _written_args(func, args, kwargs) -> list[torch.Tensor]:
    out = []
    for i, a in enumerate(torch_internals.op_schema(func).arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            val = args[i] if i < len(args) else kwargs.get(a.name)
            if isinstance(val, torch.Tensor):
                out.append(val)
    return out


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.storages: dict[int, _Storage] = {}

    def _ref(self, t: torch.Tensor):
        if not t.is_meta:
            return _Const(t.detach().clone())
        node = self.storages.get(_sid(t))
        if node is None:
            raise DeferredInitError(f"deferred_init: an op used a meta tensor of shape {tuple(t.shape)} that was not "
                                    "created inside deferred_init; create every tensor inside the deferred function")
        return _Ref(node, len(node.entries), _Geom.of(t))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        seq = seed = None
        if func in _RANDOM:
            seed, seq = _rng._seed, _rng._next_seq()
        if _is_factory(func):
            out = func(*args, **dict(kwargs, device=_META))
            self._new_outputs(out, _Op(func, args, kwargs, seq=seq, seed=seed))
            return out
        leaves = pytree.tree_leaves((args, kwargs))
        if not any(isinstance(x, torch.Tensor) and x.is_meta for x in leaves):
            return func(*args, **kwargs)  # computation on real constants only
        rargs, rkwargs = pytree.tree_map_only(torch.Tensor, self._ref, (args, kwargs))
        written = _written_args(func, args, kwargs)
        out = func(*args, **kwargs)
        if written:
            for t in written:
                node = self.storages[_sid(t)]
                node.entries.append(_Op(func, rargs, rkwargs, geom=_Geom.of(t), seq=seq, seed=seed))
            return out
        returns = torch_internals.op_schema(func).returns
        if returns and all(r.alias_info is not None for r in returns):
            return out  # a view: shares its input's storage and log
        self._new_outputs(out, _Op(func, rargs, rkwargs, seq=seq, seed=seed))
        return out

    def _new_outputs(self, out, op: _Op) -> None:
        outs = out if isinstance(out, (tuple, list)) else (out,)
        for i, t in enumerate(outs):
            if isinstance(t, torch.Tensor) and t.is_meta:
                o = _Op(op.func, op.args, op.kwargs, seq=op.seq, seed=op.seed, out_index=i)
                self.storages[_sid(t)] = _Storage(t, tuple(t.shape), t.dtype, [o])


def deferred_init(fn: Callable[..., nn.Module], *args: Any, **kwargs: Any) -> nn.Module:
    """Call ``fn(*args, **kwargs)`` (e.g. a module class) with every new tensor on the meta device; return the module.

    No parameter memory is allocated. Random init ops consume counter-RNG sequence numbers now (as the same eager
    build would), and are replayed with those numbers by :func:`materialize`.
    """
    rec = _Recorder()
    with rec:
        module = fn(*args, **kwargs)
    if not isinstance(module, nn.Module):
        raise DeferredInitError(f"deferred_init: {fn!r} returned {type(module).__name__}, not an nn.Module")
    module._vescale_deferred = rec.storages
    return module


@contextlib.contextmanager
def record_deferred(module: nn.Module) -> Iterator[nn.Module]:
    """Record ops on the still deferred ``module``'s meta tensors into its init record, as :func:`deferred_init` did.

    ``with record_deferred(model): model.to(torch.bfloat16)`` makes ``model`` a bf16 meta model whose
    :func:`materialize` gives, bitwise, the one-device fp32 init cast to bf16 (each rank casting only its shard of the
    fp32 init; no whole fp32 tensor is built). Any other op works too (``torch.nn.init.zeros_(model.head.weight)``):
    random ops draw the counter-RNG sequence numbers they would draw eagerly now, and factories make meta tensors.
    Without this block an op on a deferred model's meta tensors is not recorded, and :func:`materialize` then
    refuses the tensors it made. Yields ``module``. Raises :class:`DeferredInitError` when ``module`` is not deferred
    (or already materialised).
    """
    storages = getattr(module, "_vescale_deferred", None)
    if storages is None:
        raise DeferredInitError(f"record_deferred: {type(module).__name__} was not built by deferred_init (or is "
                                "already materialised)")
    rec = _Recorder()
    rec.storages = storages  # one record: parts adopted from the same model (adopt_deferred) share it too
    with rec:
        yield module


def is_deferred(module: nn.Module) -> bool:
    """Whether ``module`` came from :func:`deferred_init` and still has meta tensors to materialise."""
    return getattr(module, "_vescale_deferred", None) is not None


def adopt_deferred(part: nn.Module, model: nn.Module) -> nn.Module:
    """Make ``part`` materialisable as a piece of the :func:`deferred_init` model ``model``; return ``part``.

    ``part`` is a module built from ``model`` whose parameters and buffers keep the model's FQNs (a pipeline stage
    split from a shadow copy, some of its blocks). Each parameter of ``part``, and each buffer that ``model`` also
    has, is replaced by ``model``'s meta tensor with the same FQN, tied tensors staying tied; other buffers of
    ``part`` (constants a graph capture lifted out of ``forward``) are kept. ``part`` then shares ``model``'s init
    record, so :func:`materialize` (or a vescale ``parallelize_module``) on ``part`` computes just its tensors,
    bitwise the values of the single-device build. ``model`` stays deferred; several parts may be adopted.

    Raises :class:`DeferredInitError` when ``model`` is not deferred (or already materialised) or a parameter FQN of
    ``part`` is not one of ``model``'s, naming it, before changing anything.
    """
    storages = getattr(model, "_vescale_deferred", None)
    if storages is None:
        raise DeferredInitError(f"adopt_deferred: {type(model).__name__} was not built by deferred_init (or is "
                                "already materialised)")
    params = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers(remove_duplicate=False))
    own_params = [fqn for fqn, _ in part.named_parameters(remove_duplicate=False)]
    unknown = [fqn for fqn in own_params if fqn not in params]
    if unknown:
        raise DeferredInitError(f"adopt_deferred: {type(part).__name__} has parameters that "
                                f"{type(model).__name__} has not: {', '.join(unknown)}")
    own = set(own_params)
    for fqn in own_params + [f for f, _ in part.named_buffers(remove_duplicate=False) if f in buffers]:
        owner_name, _, leaf = fqn.rpartition(".")
        # setattr keeps a parameter a parameter and a buffer a buffer (persistence included)
        setattr(part.get_submodule(owner_name), leaf, params[fqn] if fqn in own else buffers[fqn])
    part._vescale_deferred = storages
    return part


# ------------------------------------------------------------------------------------------------------------ replay

class _Replayer:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cache: dict[tuple[int, int], torch.Tensor] = {}

    def resolve(self, x):
        if isinstance(x, _Const):
            return x.value.to(self.device)
        if isinstance(x, _Ref):
            base = self.full(x.storage, x.version)
            return base.as_strided(x.geom.size, x.geom.stride, x.geom.offset)
        return x

    def _run(self, op: _Op, target: torch.Tensor | None = None):
        args, kwargs = pytree.tree_map_only((_Ref, _Const), self.resolve, (op.args, op.kwargs))
        if target is not None:
            args = (target, *args[1:])
        if op.seq is not None:
            state = _rng.get_state()
            _rng.set_state((op.seed, op.seq))
            try:
                out = _rng._handle(op.func, args, kwargs)
                if out is NotImplemented:
                    out = _rng._handle_factory(op.func, args, dict(kwargs, device=self.device))
            finally:
                _rng.set_state(state)
            if out is NotImplemented:
                raise DeferredInitError(f"materialize: random op {op.func} is not supported by vescale's RNG")
            return out
        return op.func(*args, **kwargs)

    def produce(self, node: _Storage, shape: Sequence[int] | None = None) -> torch.Tensor:
        prod = node.entries[0]
        if prod.func in _FILL_FACTORIES:
            fill = _FILL_FACTORIES[prod.func]
            shape = node.shape if shape is None else tuple(shape)
            return torch.full(shape, fill or 0.0, dtype=node.dtype, device=self.device)
        if prod.func is aten.full.default and shape is not None:
            return torch.full(tuple(shape), prod.args[1], dtype=node.dtype, device=self.device)
        if _is_factory(prod.func) and prod.seq is None:
            out = prod.func(*prod.args, **dict(prod.kwargs, device=self.device))
        else:
            out = self._run(prod)
        out = out[prod.out_index] if isinstance(out, (tuple, list)) else out
        return out.contiguous()

    def full(self, node: _Storage, upto: int | None = None) -> torch.Tensor:
        """The global value of a storage after its first ``upto`` log entries (all when None)."""
        upto = len(node.entries) if upto is None else upto
        key = (id(node), upto)
        if key not in self.cache:
            value = self.produce(node)
            for op in node.entries[1:upto]:
                self._run(op, value.as_strided(op.geom.size, op.geom.stride, op.geom.offset))
            self.cache[key] = value
        return self.cache[key]


def _whole(node: _Storage, geom: _Geom) -> bool:
    return geom.size == node.shape and geom.offset == 0 and (geom.stride == contiguous_stride(node.shape)
                                                             or math.prod(node.shape) <= 1)


def _cast_source(node: _Storage) -> _Ref | None:
    """The whole tensor ``node`` is a plain dtype cast of (``t.to(dtype)``, as ``module.to(dtype)`` makes), or None."""
    prod = node.entries[0]
    if prod.func is not aten._to_copy.default or set(prod.kwargs) - {"dtype"} or len(prod.args) != 1:
        return None
    src = prod.args[0]
    if not isinstance(src, _Ref) or not _whole(src.storage, src.geom) or src.storage.shape != node.shape:
        return None
    return src


def _shardable(node: _Storage, upto: int | None = None) -> bool:
    """A storage whose log (its first ``upto`` entries) a shard can replay alone: a fill factory, or a dtype cast of
    such a storage, then whole-tensor elementwise or random ops."""
    entries = node.entries[:len(node.entries) if upto is None else upto]
    prod = entries[0]
    src = _cast_source(node)
    if src is not None:
        if not _shardable(src.storage, src.version):
            return False
    elif prod.func not in _FILL_FACTORIES and prod.func is not aten.full.default:
        return False
    for op in entries[1:]:
        if not _whole(node, op.geom) and _view_positions(node, op.geom) is None:
            return False
        if not _whole(node, op.geom) and op.func not in _VIEW_FILLS and op.seq is not None:
            return False
        scalar_args = all(not isinstance(a, (_Ref, _Const)) or (isinstance(a, _Const) and a.value.dim() == 0)
                          for a in pytree.tree_leaves((op.args[1:], op.kwargs)))
        if op.seq is not None and op.func in _rng._DTENSOR_OPS:
            if op.func in (aten.bernoulli_.Tensor,) and not scalar_args:
                return False
            continue
        if not scalar_args:
            return False
        if op.func not in _EXTRA_ELEMENTWISE and torch.Tag.pointwise not in op.func.tags:
            return False
    return True


_VIEW_FILLS = {aten.uniform_.default, aten.normal_.default, aten.bernoulli_.float, aten.random_.default,
               aten.random_.to, getattr(aten.random_, "from")}


def _view_positions(node: _Storage, geom: _Geom) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Storage positions of a view's elements, sorted, with each one's row-major index in the view.

    None when the view overlaps itself or leaves the storage (then the storage is replayed whole).
    """
    pos = torch.full((), geom.offset, dtype=torch.int64)
    for n, st in zip(geom.size, geom.stride):
        pos = pos.unsqueeze(-1) + torch.arange(n, dtype=torch.int64) * st
    pos = pos.reshape(-1)
    sorted_pos, order = torch.sort(pos)
    if pos.numel() and (sorted_pos[0] < 0 or sorted_pos[-1] >= math.prod(node.shape)
                        or bool((sorted_pos[1:] == sorted_pos[:-1]).any())):
        return None
    return sorted_pos, order


def _apply_to_view(rep: _Replayer, node: _Storage, op: _Op, local: torch.Tensor, gidx: torch.Tensor) -> None:
    """Replay an in-place elementwise or random op that wrote a view, on the local elements inside that view."""
    pos, order = _view_positions(node, op.geom)
    if pos.numel() == 0 or gidx.numel() == 0:
        return
    k = torch.searchsorted(pos, gidx).clamp_(max=pos.numel() - 1)
    sel = (pos[k] == gidx).nonzero().squeeze(1)
    if sel.numel() == 0:
        return
    flat = local.view(-1)
    part = flat[sel].clone()
    args, kwargs = pytree.tree_map_only((_Ref, _Const), rep.resolve, (op.args, op.kwargs))
    if op.seq is not None:
        state = _rng.get_state()
        _rng.set_state((op.seed, op.seq))
        try:
            _rng._handle(op.func, (part, *args[1:]), kwargs, index=order[k[sel]])
        finally:
            _rng.set_state(state)
    else:
        op.func(part, *args[1:], **kwargs)
    flat[sel] = part


def _local_shard(rep: _Replayer, node: _Storage, mesh: DeviceMesh, placements: tuple[Placement, ...],
                 upto: int | None = None) -> DTensor:
    """This rank's shard of a :func:`_shardable` storage after its first ``upto`` log entries, computed alone."""
    from vescale.dtensor.api import from_local
    from vescale.dtensor.layout import global_flat_index, local_shape

    src = _cast_source(node)
    if src is not None:  # the source's shard, cast: elementwise, so bitwise the slice of the whole cast
        local = _local_shard(rep, src.storage, mesh, placements, src.version).to_local().to(node.dtype)
    else:
        local = rep.produce(node, local_shape(node.shape, mesh, placements))
    dt = from_local(local, mesh, placements, shape=node.shape)
    gidx = None
    for op in node.entries[1:len(node.entries) if upto is None else upto]:
        if not _whole(node, op.geom):
            if gidx is None:
                gidx = global_flat_index(node.shape, mesh, placements).reshape(-1)
            _apply_to_view(rep, node, op, local, gidx)
        elif op.seq is not None:
            rep._run(op, dt)
        else:
            args, kwargs = pytree.tree_map_only((_Ref, _Const), rep.resolve, (op.args, op.kwargs))
            op.func(local, *args[1:], **kwargs)
    return dt


def _local_value(rep: _Replayer, node: _Storage, mesh: DeviceMesh, placements: tuple[Placement, ...]):
    """The local shard of a storage on this rank as a DTensor, computing only the shard when possible."""
    from vescale.dtensor.api import from_local
    from vescale.dtensor.layout import local_slice

    if _shardable(node):
        return _local_shard(rep, node, mesh, placements), True
    full = rep.full(node)
    return from_local(local_slice(full, mesh, placements), mesh, placements, shape=node.shape), False


def materialize(module: nn.Module, mesh: DeviceMesh | None = None,
                placements: Mapping[str, Sequence[Placement]] | None = None, *,
                device: torch.device | str | None = None, report: dict | None = None,
                replicate_over: DeviceMesh | None = None) -> nn.Module:
    """Replace the meta parameters and buffers of a :func:`deferred_init` module by real tensors, in place.

    Without ``mesh``: full plain tensors, the single-device reference. With ``mesh``: DTensors whose
    placements come from ``placements`` (FQN -> one placement per mesh dim, as
    ``named_parameters``/``named_buffers`` spell FQNs; parameters not in it are replicated DTensors, buffers not in
    it stay plain whole tensors, as model code that mixes them with plain tensors expects), each rank computing only
    its local shard, bitwise equal to the slice of the reference. Tied tensors (one storage, several FQNs) stay tied
    and must be given the same placements. Elementwise and random writes through views (an Embedding ``padding_idx``
    row) are replayed on the local elements inside the view. Storages computed from other tensors (rotary buffers
    from ``arange``) or written with tensor operands are computed whole on each rank, then sliced; their FQNs are
    listed in ``report["full"]`` (``report["sharded"]`` lists the rest) when a dict is passed. No communication.
    Raises :class:`DeferredInitError` naming the FQN for unknown FQNs, conflicting tied placements, ``Partial``
    placements, and placements that do not fit the shape or mesh (all before any work).

    With ``replicate_over`` (a 1-D mesh, instead of ``mesh``): full plain tensors on every rank of it, as
    without a mesh, but each rank replays only its ``Shard(0)`` slice of every parameter whose first dim divides by
    the mesh size and one all-gather per such parameter assembles the whole (the rest is computed whole): data-
    parallel replicas share the cost of the init. Tied parameters stay tied.
    """
    _torch_hooks.install()
    storages: dict[int, _Storage] | None = getattr(module, "_vescale_deferred", None)
    if storages is None:
        raise DeferredInitError(f"materialize: {type(module).__name__} was not built by deferred_init")
    if replicate_over is not None:
        if mesh is not None or placements:
            raise DeferredInitError("materialize: give replicate_over or mesh/placements, not both")
        return _materialize_replicated(module, replicate_over, device, report)
    placements = dict(placements or {})
    if placements and mesh is None:
        raise DeferredInitError("materialize: placements given without a mesh")
    device = torch.device(device) if device is not None else torch.device(
        mesh.device_type if mesh is not None else "cpu")

    slots: list[tuple[str, nn.Module, str, bool, torch.Tensor]] = []
    for mod_name, mod in module.named_modules(remove_duplicate=False):
        own = ([(True, name, t) for name, t in mod.named_parameters(recurse=False, remove_duplicate=False)]
               + [(False, name, t) for name, t in mod.named_buffers(recurse=False, remove_duplicate=False)])
        for is_param, name, t in own:  # None entries are skipped by named_parameters/named_buffers
            fqn = f"{mod_name}.{name}" if mod_name else name
            slots.append((fqn, mod, name, is_param, t))
    known = {fqn for fqn, *_ in slots}
    unknown = sorted(set(placements) - known)
    if unknown:
        raise DeferredInitError(f"materialize: placements name FQNs that are not parameters or buffers: {unknown}")

    by_storage: dict[int, list] = {}
    for slot in slots:
        t = slot[4]
        if t.is_meta:
            by_storage.setdefault(_sid(t), []).append(slot)
    plan: dict[int, tuple[Placement, ...] | None] = {}
    for sid, group in by_storage.items():
        node = storages.get(sid)
        fqns = [s[0] for s in group]
        if node is None:
            raise DeferredInitError(f"materialize: {fqns} were not created inside deferred_init (an op on a "
                                    "deferred module after deferred_init, e.g. module.to(dtype), must run inside "
                                    "`with record_deferred(module):`)")
        for fqn, *_rest in group:
            if not _whole(node, _Geom.of(_rest[-1])):
                raise DeferredInitError(f"materialize: {fqn} is a view of a larger tensor; unsupported")
        chosen = {tuple(placements[f]) for f in fqns if f in placements}
        if len(chosen) > 1:
            raise DeferredInitError(f"materialize: tied tensors {fqns} were given different placements {chosen}")
        if mesh is None or (not chosen and not any(s[3] for s in group)):
            plan[sid] = None  # no mesh, or a buffer left out of the plan: a plain whole tensor
            continue
        pl = chosen.pop() if chosen else (Replicate(),) * mesh.ndim
        if any(isinstance(p, Partial) for p in pl):
            raise DeferredInitError(f"materialize: {fqns[0]} cannot be materialised as Partial {pl}")
        from vescale.dtensor.layout import validate_placements

        try:
            plan[sid] = validate_placements(node.shape, mesh, pl, what=f"parameter {fqns[0]}")
        except Exception as e:
            raise DeferredInitError(str(e)) from e

    rep = _Replayer(device)
    sharded, whole = [], []
    for sid, group in by_storage.items():
        node = storages[sid]
        pl = plan[sid]
        if pl is None:
            value, local_only = rep.full(node), False
        else:
            value, local_only = _local_value(rep, node, mesh, pl)
        (sharded if local_only else whole).extend(s[0] for s in group)
        for _fqn, mod, name, is_param, old in group:
            if is_param:
                setattr(mod, name, nn.Parameter(value, requires_grad=old.requires_grad))
            else:
                setattr(mod, name, value)
        # tied parameters must stay one object
        if len({id(getattr(s[1], s[2])) for s in group if s[3]}) > 1:
            first = next(s for s in group if s[3])
            shared = getattr(first[1], first[2])
            for _fqn, mod, name, is_param, _old in group:
                if is_param:
                    setattr(mod, name, shared)
        if pl is not None or _cast_source(node) is not None:
            rep.cache.clear()  # free whole tensors computed for slicing, or a cast's fp32 source, before the next
    module._vescale_deferred = None
    if report is not None:
        report["sharded"] = sorted(sharded)
        report["full"] = sorted(whole)
    return module


def _materialize_replicated(module: nn.Module, mesh: DeviceMesh, device: torch.device | str | None,
                            report: dict | None) -> nn.Module:
    """``materialize(module, replicate_over=mesh)``: shards over ``mesh``, then each sharded parameter all-gathered."""
    if mesh.ndim != 1:
        raise DeferredInitError(f"materialize: replicate_over must be a 1-D mesh, got the {mesh.ndim}-D {mesh}")
    n = mesh.size()
    split = {fqn: [Shard(0)] for fqn, p in module.named_parameters() if p.dim() and p.shape[0] % n == 0}
    materialize(module, mesh, split, device=device, report=report)
    whole: dict[int, nn.Parameter] = {}  # id of a DTensor parameter -> its full value (tied ones: one object)
    for mod in module.modules():
        for name, p in list(mod.named_parameters(recurse=False, remove_duplicate=False)):
            if isinstance(p, DTensor):
                if id(p) not in whole:
                    whole[id(p)] = nn.Parameter(p.full_tensor(), requires_grad=p.requires_grad)
                setattr(mod, name, whole[id(p)])
    return module
