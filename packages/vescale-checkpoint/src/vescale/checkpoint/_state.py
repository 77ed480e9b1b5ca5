"""Turn a user's state dict into flat, dotted keys of tensors and JSON values, and write loaded values back.

``state`` values may be modules (plain, DDP, ``torch.compile``-d, FSDP2, TP, pipeline stages keeping original
FQNs), ``torch.optim`` optimizers, tensors and DTensors, JSON-able values, nested dicts/lists of those, and any
object with ``state_dict()``/``load_state_dict()``. Keys:

- module ``m`` under ``"model"``: ``model.<fqn of each state_dict entry>``; a list of modules (the pipeline stages
  a rank holds, which keep the whole model's FQNs) shares one FQN space, so any stage split loads any other
- optimizer under ``"optim"``: ``optim.state.<param fqn>.<state name>`` and ``optim.param_groups.<param fqn>``
  (that parameter's group hyperparameters), parameters named by the modules found in the same state
- vescale ``DistributedOptimizer`` (ZeRO 1/2, flat ragged shards): the same keys as a torch optimizer, each rank's
  flat piece mapped to boxes of the global parameter (plus ``optim.master.<fqn>`` for fp32 masters), so ZeRO and
  plain optimizer checkpoints load into each other at any dp size
- other objects: their ``state_dict()`` flattened under their key; nested dicts join keys with dots.

Loading fills tensors in place; values are assigned back into their containers (a dict or list value is updated in
place, so a caller's reference sees the loaded content); stateful objects then get
``load_state_dict`` with the filled dict. A plain tensor in such an object's ``state_dict()`` whose shape or dtype
differs from the checkpoint's is replaced by a new tensor instead (data loader or sampler state that grows).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from vescale.checkpoint._layout import Piece, flat_range_pieces, is_dtensor, local_pieces
from vescale.checkpoint.errors import UnsupportedStateError
from vescale.core import torch_internals


@dataclass
class Flat:
    """A flattened state: tensors to save or fill, values with setters, and calls to make after a load."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    #: tensors held as explicit boxes (ZeRO flat shards): key -> (global shape, dtype, pieces)
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
    """The module whose FQNs are the model's own: strips DDP's ``module.`` and torch.compile's ``_orig_mod.``."""
    from torch.nn.parallel import DistributedDataParallel

    while True:
        if isinstance(m, DistributedDataParallel) or (type(m).__name__ == "DistributedDataParallel"
                                                      and isinstance(getattr(m, "module", None), nn.Module)):
            m = m.module  # torch's DDP, or vescale.parallel's
        elif torch_internals.compiled_original(m) is not None:
            m = torch_internals.compiled_original(m)
        else:
            return m


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if is_dtensor(t) else t


def _has_tensors(obj: Any) -> bool:
    if isinstance(obj, torch.Tensor) or _is_stateful(obj):
        return True
    if isinstance(obj, dict):
        return any(_has_tensors(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_has_tensors(v) for v in obj)
    return False


def _is_stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def init_optimizer_state(opt: torch.optim.Optimizer) -> None:
    """Create an optimizer's lazily-built state with one step at learning rate 0 on zero gradients.

    Parameters are unchanged (lr 0), gradients are restored to None, and the state tensors get the right shapes,
    dtypes and placements to be filled by a load.
    """
    saved_lrs = []
    touched = []
    for group in opt.param_groups:
        saved_lrs.append(group.get("lr"))
        if "lr" in group:
            group["lr"] = torch.zeros_like(group["lr"]) if isinstance(group["lr"], torch.Tensor) else 0.0
        for p in group["params"]:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
                touched.append(p)
    try:
        opt.step()
    finally:
        for group, lr in zip(opt.param_groups, saved_lrs):
            if lr is not None:
                group["lr"] = lr
        for p in touched:
            p.grad = None


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
    params_by_name: dict[str, torch.Tensor] = {}
    for value in state.values():
        for m in (value if _is_module_list(value) else [value] if isinstance(value, nn.Module) else []):
            for name, p in unwrap_module(m).named_parameters():
                param_names.setdefault(id(p), name)
                params_by_name.setdefault(name, p)

    def walk(key: str, obj: Any, setter: Callable[[Any], None], replaceable: bool = False) -> None:
        if isinstance(obj, nn.Module):
            module(key, unwrap_module(obj))
        elif _is_module_list(obj):  # pipeline stages of one model on this rank: one FQN space
            for m in obj:
                module(key, unwrap_module(m))
        elif isinstance(obj, torch.optim.Optimizer):
            optimizer(key, obj)
        elif _is_zero_optimizer(obj):
            zero_optimizer(key, obj)
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
        sd = m.state_dict()
        trainable = {name for name, p in m.named_parameters() if p.requires_grad}
        for name, t in sd.items():
            flat.add_tensor(_join(key, name), t)
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
                for sname, sval in opt.state.get(p, {}).items():
                    skey = _join(key, f"state.{name}.{sname}")
                    if isinstance(sval, torch.Tensor):
                        flat.add_tensor(skey, sval)
                        flat.stepped.add(skey)
                    else:
                        flat.add_value(skey, sval, lambda v, st=opt.state[p], s=sname: st.__setitem__(s, v))

    def zero_optimizer(key: str, opt: Any) -> None:
        if not opt.optimizer.state and init_optimizer is not None and init_optimizer(key):
            init_optimizer_state(opt.optimizer)
        sd = opt.state_dict()
        dp_rank = sd["dp_rank"]
        named = dict(params_by_name)
        if isinstance(getattr(opt, "ddp", None), nn.Module):
            named.update(unwrap_module(opt.ddp).named_parameters())
        hparams = {fqn: g for g in sd["param_groups"] for fqn in g["params"]}
        for fqn, info in sd["shards"].items():
            if fqn in hparams:
                flat.add_value(_join(key, f"param_groups.{fqn}"), _hparams(hparams[fqn]),
                               lambda v, g=hparams[fqn]: _set_hparams(g, v))
            param = named.get(fqn)
            if param is None:
                raise UnsupportedStateError(f"optimizer {key!r} holds parameter {fqn!r}, which no module in the "
                                            "state has")
            tp = local_pieces(param.detach(), fqn)
            if len(tp) != 1 or list(tp[0].lengths) != list(info["local_shape"]):
                raise UnsupportedStateError(f"optimizer {key!r}: parameter {fqn!r} (placements "
                                            f"{getattr(param, 'placements', None)}) is not one box of local shape "
                                            f"{info['local_shape']}; cannot map its ZeRO shard")
            lo, hi = info["ranges"][dp_rank]
            entries = dict(sd["state"].get(fqn, {}))
            for sname, sval in entries.items():
                skey = _join(key, f"master.{fqn}" if sname == "master" else f"state.{fqn}.{sname}")
                if isinstance(sval, torch.Tensor) and sval.dim() == 1 and sval.numel() == hi - lo and hi > lo:
                    pieces = flat_range_pieces(sval, lo, hi, tuple(info["local_shape"]), ())
                    for piece in pieces:  # TP-local box -> global box
                        piece.offsets = tuple(o + t for o, t in zip(piece.offsets, tp[0].offsets))
                    flat.add_boxes(skey, list(param.shape), sval.dtype, pieces)
                    flat.stepped.add(skey)
                elif isinstance(sval, torch.Tensor):
                    flat.add_tensor(skey, sval)
                    flat.stepped.add(skey)
                else:
                    flat.add_value(skey, sval, lambda v, e=sd["state"][fqn], s=sname: e.__setitem__(s, v))
        flat.finalizers.append(lambda opt=opt, sd=sd: opt.load_state_dict(sd))

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


def _is_zero_optimizer(obj: Any) -> bool:
    """vescale.parallel.DistributedOptimizer (ZeRO 1/2), recognised by its state-dict format, without importing it."""
    fmt = getattr(type(obj), "__module__", "")
    return (fmt.startswith("vescale.parallel") and type(obj).__name__ == "DistributedOptimizer"
            and isinstance(getattr(obj, "optimizer", None), torch.optim.Optimizer))
