"""Turn a user's state dict into flat, dotted keys of tensors and JSON values, and write loaded values back.

``state`` values may be modules (plain, DDP, ``torch.compile``-d, FSDP2, TP, pipeline stages keeping original
FQNs), ``torch.optim`` optimizers, tensors and DTensors, JSON-able values, nested dicts/lists of those, and any
object with ``state_dict()``/``load_state_dict()``. Keys:

- module ``m`` under ``"model"``: ``model.<fqn of each state_dict entry>``; a list of modules (the pipeline stages
  a rank holds, which keep the whole model's FQNs) shares one FQN space, so any stage split loads any other
- optimizer under ``"optim"``: ``optim.state.<param fqn>.<state name>`` and ``optim.param_groups.<param fqn>``
  (that parameter's group hyperparameters), parameters named by the modules found in the same state
- an object implementing :class:`vescale.core.sharded_state.ShardedStateful` (``sharded_state_dict()`` /
  ``load_sharded_state_dict()``; vescale's ZeRO ``DistributedOptimizer`` does, giving a torch optimizer's keys, so
  ZeRO and plain optimizer checkpoints load into each other at any dp size): its sharded state dict flattened under
  its key, each :class:`~vescale.core.sharded_state.ShardedTensor` saved as the boxes it holds; a
  ``ShardedTensor`` may also stand anywhere in the state by itself
- other objects: their ``state_dict()`` flattened under their key; nested dicts join keys with dots.

A module's plain parameter marked as a box of a global tensor (:func:`vescale.core.sharded_state.mark_piece` with
``global_shape`` and ``offsets``, e.g. an ep rank's ``[E / ep, ...]`` experts) is saved and loaded as that box of the
global tensor under the parameter's key, and so is each per-parameter state tensor of a ``torch.optim`` optimizer
of the parameter's shape (scalars such as ``step`` stay whole); other state of such a parameter, a DTensor with
such a mark, or a plain parameter marked as a piece over mesh dims without a box is refused
(:class:`UnsupportedStateError`).

Modules are named by their own ``state_dict`` keys (a wrapper whose ``state_dict`` is its inner module's, such as
vescale's DDP, needs no unwrapping); torch's DDP and ``torch.compile`` wrappers are unwrapped. Nothing here knows
vescale's other packages: their objects are seen only through the protocol of :mod:`vescale.core.sharded_state`.

Loading fills tensors in place; values are assigned back into their containers (a dict or list value is updated in
place, so a caller's reference sees the loaded content); stateful objects then get
``load_state_dict`` with the filled dict. A plain tensor in such an object's ``state_dict()`` whose shape or dtype
differs from the checkpoint's is replaced by a new tensor instead (data loader or sampler state that grows).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from vescale.checkpoint._layout import Piece, is_dtensor
from vescale.checkpoint.errors import UnsupportedStateError
from vescale.core import torch_internals
from vescale.core.sharded_state import (
    GlobalPiece,
    ShardedStateError,
    ShardedTensor,
    init_optimizer_state,
    is_sharded_stateful,
    piece_of,
)


@dataclass
class Flat:
    """A flattened state: tensors to save or fill, values with setters, and calls to make after a load."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    #: tensors held as explicit boxes (a ShardedTensor): key -> (global shape, dtype, pieces)
    boxes: dict[str, tuple[list[int], torch.dtype, list[Piece]]] = field(default_factory=dict)
    values: dict[str, Any] = field(default_factory=dict)
    setters: dict[str, Callable[[Any], None]] = field(default_factory=dict)
    tensor_setters: dict[str, Callable[[Any], None]] = field(default_factory=dict)  # tensors of stateful objects
    finalizers: list[Callable[[], None]] = field(default_factory=list)
    #: keys of tensors that only an optimizer step changes in place (trainable parameters, optimizer state): an
    #: async save may copy these in the background until the next ``optimizer.step()``
    stepped: set[str] = field(default_factory=set)
    #: values inside tuples (which a load cannot assign into): key -> the value held
    fixed: dict[str, Any] = field(default_factory=dict)

    def add_tensor(self, key: str, t: torch.Tensor) -> None:
        self._check_new(key)
        self.tensors[key] = t

    def add_value(self, key: str, value: Any, setter: Callable[[Any], None]) -> None:
        self._check_new(key)
        self.values[key] = value
        self.setters[key] = setter

    def add_boxes(self, key: str, shape: list[int], dtype: torch.dtype, pieces: list[Piece]) -> None:
        self._check_new(key)
        self.boxes[key] = (shape, dtype, pieces)

    def check_value(self, key: str, new: Any) -> None:
        """Raise :class:`UnsupportedStateError` unless the loaded value ``new`` can be assigned to ``key`` (a load
        checks every value before it writes anything)."""
        if key in self.fixed:
            old = self.fixed[key]
            if not (isinstance(old, dict) and isinstance(new, dict)) and not (
                    isinstance(old, list) and isinstance(new, list)) and new != old:
                raise UnsupportedStateError(f"cannot assign {key!r} inside a tuple")

    def _check_new(self, key: str) -> None:
        if key in self.tensors or key in self.values or key in self.boxes:
            raise UnsupportedStateError(f"two entries of the state flatten to the same key {key!r}; rename one")


def _join(prefix: str, key: Any) -> str:
    return f"{prefix}.{key}" if prefix else str(key)


def unwrap_module(m: nn.Module) -> nn.Module:
    """The module whose FQNs are the model's own: strips torch DDP's ``module.`` and torch.compile's ``_orig_mod.``
    (other wrappers are named through their ``state_dict`` keys, see :func:`_named_state`)."""
    from torch.nn.parallel import DistributedDataParallel

    while True:
        if isinstance(m, DistributedDataParallel):
            m = m.module
        elif torch_internals.compiled_original(m) is not None:
            m = torch_internals.compiled_original(m)
        else:
            return m


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if is_dtensor(t) else t


def _named_state(m: nn.Module) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``m.state_dict()`` and its parameters (the ``Parameter`` objects, which carry their marks) by every FQN it
    stores them under, in its order (a tied parameter's first name first)."""
    try:
        kept = m.state_dict(keep_vars=True)
    except TypeError:  # a state_dict override without keep_vars: fall back to the parameters' module names
        return m.state_dict(), dict(m.named_parameters(remove_duplicate=False))
    params = {name: t for name, t in kept.items() if isinstance(t, nn.Parameter)}
    sd = OrderedDict((k, t.detach() if isinstance(t, torch.Tensor) else t) for k, t in kept.items())
    metadata = getattr(kept, "_metadata", None)
    if metadata is not None:  # load_state_dict reads the modules' versions from it
        sd._metadata = metadata
    return sd, params


def _placed_piece(p: torch.Tensor | None, key: str) -> GlobalPiece | None:
    """The mark of a plain parameter ``p`` that is a box of a global tensor, or None (no mark, or one that only
    leaves it out of norms); raises :class:`UnsupportedStateError` for a mark a checkpoint cannot place."""
    mark = piece_of(p) if p is not None else None
    if mark is None:
        return None
    if is_dtensor(p):
        if mark.placed:
            raise UnsupportedStateError(f"{key!r} is a DTensor marked (mark_piece) as a box at {mark.offsets} of a "
                                        f"global tensor of shape {mark.global_shape}: its placements place it already")
        return None
    if not mark.placed and mark.groups:
        raise UnsupportedStateError(f"{key!r} is marked (mark_piece) as a piece of a tensor split over "
                                    f"{[d for d, _ in mark.groups]} but not where it sits in it: mark it with "
                                    "global_shape= and offsets= to save it")
    return mark if mark.placed else None


def _has_tensors(obj: Any) -> bool:
    if isinstance(obj, (torch.Tensor, ShardedTensor)) or _is_stateful(obj) or is_sharded_stateful(obj):
        return True
    if isinstance(obj, dict):
        return any(_has_tensors(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_has_tensors(v) for v in obj)
    return False


def _is_stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def _hparams(group: dict) -> dict[str, Any]:
    return {k: (v.item() if isinstance(v, torch.Tensor) and v.numel() == 1 else v)
            for k, v in group.items() if k != "params"}


def _set_hparams(group: dict, values: dict[str, Any]) -> None:
    for k, v in values.items():
        current = group.get(k)
        if isinstance(current, torch.Tensor):
            current.fill_(v)
        else:
            group[k] = v


def flatten(state: dict[str, Any], *, init_optimizer: Callable[[str], bool] | None = None) -> Flat:
    """Flatten ``state`` (see the module docstring). ``init_optimizer(key)`` says whether to build the lazy state
    of an optimizer that has none yet (a load into a fresh optimizer)."""
    if not isinstance(state, dict):
        raise UnsupportedStateError(f"state must be a dict of names to modules, optimizers, tensors or values, "
                                    f"got {type(state).__name__}")
    flat = Flat()
    param_names: dict[int, str] = {}
    named: dict[int, tuple[dict[str, Any], dict[str, torch.Tensor]]] = {}  # id(module) -> _named_state(module)
    for value in state.values():
        for m in (value if _is_module_list(value) else [value] if isinstance(value, nn.Module) else []):
            m = unwrap_module(m)
            named[id(m)] = _named_state(m)
            for name, p in named[id(m)][1].items():
                param_names.setdefault(id(p), name)

    def walk(key: str, obj: Any, setter: Callable[[Any], None], replaceable: bool = False) -> None:
        if isinstance(obj, ShardedTensor):
            sharded_tensor(key, obj)
        elif is_sharded_stateful(obj):
            sharded(key, obj)
        elif isinstance(obj, nn.Module):
            module(key, unwrap_module(obj))
        elif _is_module_list(obj):  # pipeline stages of one model on this rank: one FQN space
            for m in obj:
                module(key, unwrap_module(m))
        elif isinstance(obj, torch.optim.Optimizer):
            optimizer(key, obj)
        elif isinstance(obj, torch.Tensor):
            flat.add_tensor(key, obj)
            if replaceable and not is_dtensor(obj):
                flat.tensor_setters[key] = setter
        elif _is_stateful(obj):
            sd = obj.state_dict()
            walk_children(key, sd, True)
            flat.finalizers.append(lambda obj=obj, sd=sd: obj.load_state_dict(sd))
        elif isinstance(obj, (dict, list, tuple)) and _has_tensors(obj):
            walk_children(key, obj, replaceable)
        else:
            flat.add_value(key, obj, lambda new, old=obj, setter=setter: _assign(old, new, setter))

    def walk_children(key: str, obj: Any, replaceable: bool = False) -> None:
        items = obj.items() if isinstance(obj, dict) else enumerate(obj)
        for k, v in list(items):
            if isinstance(obj, tuple):
                def setter(new, k=k, v=v, key=key):
                    if new != v:
                        raise UnsupportedStateError(f"cannot assign {_join(key, k)!r} inside a tuple")
            else:
                def setter(new, obj=obj, k=k):
                    obj[k] = new
            walk(_join(key, k), v, setter, replaceable and not isinstance(obj, tuple))
            if isinstance(obj, tuple) and _join(key, k) in flat.values:
                flat.fixed[_join(key, k)] = v

    def module(key: str, m: nn.Module) -> None:
        sd, params = named.pop(id(m), None) or _named_state(m)
        trainable = {name for name, p in params.items() if p.requires_grad}
        for name, t in sd.items():
            mark = _placed_piece(params.get(name), _join(key, name))
            if mark is None:
                flat.add_tensor(_join(key, name), t)
            else:  # this rank's box of the global tensor (t: a detached view of the parameter, filled in place)
                flat.add_boxes(_join(key, name), list(mark.global_shape), t.dtype,
                               [Piece(mark.offsets, tuple(t.shape), t)])
            if name in trainable:
                flat.stepped.add(_join(key, name))
        owned = {_local(t).data_ptr() for t in list(m.parameters()) + list(m.buffers())}
        if not all(_local(t).data_ptr() in owned for t in sd.values() if _local(t).numel()):
            flat.finalizers.append(lambda m=m, sd=sd: m.load_state_dict(sd))

    def optimizer(key: str, opt: torch.optim.Optimizer) -> None:
        if not opt.state and init_optimizer is not None and init_optimizer(key):
            init_optimizer_state(opt)
        index = 0
        for group in opt.param_groups:
            for p in group["params"]:
                name = param_names.get(id(p), f"param{index}")
                index += 1
                flat.add_value(_join(key, f"param_groups.{name}"), _hparams(group),
                               lambda v, group=group: _set_hparams(group, v))
                mark = _placed_piece(p, _join(key, f"state.{name}"))
                for sname, sval in opt.state.get(p, {}).items():
                    skey = _join(key, f"state.{name}.{sname}")
                    if isinstance(sval, torch.Tensor) and mark is not None and sval.dim() > 0:
                        if tuple(sval.shape) != tuple(p.shape):
                            raise UnsupportedStateError(
                                f"optimizer state {skey!r} has shape {tuple(sval.shape)}, neither its parameter's "
                                f"{tuple(p.shape)} (a box of a global tensor of shape {mark.global_shape}) nor a "
                                "scalar: it cannot be placed in the global tensor")
                        flat.add_boxes(skey, list(mark.global_shape), sval.dtype,
                                       [Piece(mark.offsets, tuple(sval.shape), sval)])
                        flat.stepped.add(skey)
                    elif isinstance(sval, torch.Tensor):
                        flat.add_tensor(skey, sval)
                        flat.stepped.add(skey)
                    else:
                        flat.add_value(skey, sval, lambda v, st=opt.state[p], s=sname: st.__setitem__(s, v))

    def sharded_tensor(key: str, st: ShardedTensor) -> None:
        flat.add_boxes(key, list(st.global_shape), st.dtype, [Piece(b.offsets, b.lengths, b.data) for b in st.boxes])
        if st.updated_by_step:
            flat.stepped.add(key)

    def sharded(key: str, obj: Any) -> None:
        init = getattr(obj, "init_sharded_state", None)
        if callable(init) and init_optimizer is not None and init_optimizer(key):
            init()
        try:
            sd = obj.sharded_state_dict()
        except ShardedStateError as e:
            raise UnsupportedStateError(f"{key!r}: {e}") from e
        if not isinstance(sd, dict):
            raise UnsupportedStateError(f"{key!r}: sharded_state_dict() of {type(obj).__name__} returned a "
                                        f"{type(sd).__name__}, not a dict")
        walk_children(key, sd)
        flat.finalizers.append(lambda obj=obj, sd=sd: obj.load_sharded_state_dict(sd))

    for k, v in state.items():
        walk(str(k), v, lambda new, k=k: state.__setitem__(k, new))
    return flat


def _assign(old: Any, new: Any, setter: Callable[[Any], None]) -> None:
    """Load a value in place: a dict or list the caller holds is updated, not replaced; others are set."""
    if isinstance(old, dict) and isinstance(new, dict):
        old.clear()
        old.update(new)
    elif isinstance(old, list) and isinstance(new, list):
        old[:] = new
    else:
        setter(new)


def _is_module_list(obj: Any) -> bool:
    return isinstance(obj, (list, tuple)) and bool(obj) and all(isinstance(m, nn.Module) for m in obj)
