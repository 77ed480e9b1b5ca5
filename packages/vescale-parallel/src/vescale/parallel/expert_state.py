"""Checkpoints of plain-tensor expert parallelism: pipeline stages whose experts :func:`~vescale.parallel.
keep_local_experts` cut to this ep rank's rows, and their plain ``torch.optim`` optimizer, shown to a checkpoint as
the global tensors they are pieces of.

A stage keeps ep rank ``r``'s experts as a plain ``Parameter`` ``[E / ep, ...]`` (the captured graph takes plain
tensors). Saved as it is, a checkpoint would take it for the whole tensor: wrong on every other ep size, and two ep
ranks would write different tensors under one key. :func:`local_experts_state` instead gives a checkpoint two
objects implementing :class:`vescale.core.sharded_state.ShardedStateful`, under the keys the modules and the
optimizer would have themselves (so the checkpoint loads into, and from, the same model on any mesh: ep with
DTensor experts, one process, other pp x ep splits):

- ``"model"`` (:class:`LocalExpertsModel`): every entry of the modules' ``state_dict()`` by its FQN; each local expert
  parameter is a :class:`~vescale.core.sharded_state.ShardedTensor` of global shape ``[E, ...]`` holding one box,
  rows ``[r E / ep, (r + 1) E / ep)``; the other parameters are one box covering the whole tensor (a replica on
  every ep and dp rank; the checkpoint writes one copy); buffers are plain tensors.
- ``"optim"`` (:class:`LocalExpertsOptimizer`): ``state.<fqn>.<name>`` for each per-parameter state tensor (an
  expert's tensors of its parameter's shape placed as the parameter is, scalars such as ``step`` whole),
  other state values as values, and ``param_groups.<fqn>``: that parameter's group hyper-parameters. These are the
  keys a ``torch.optim`` optimizer and vescale's ``DistributedOptimizer`` have in a checkpoint. A
  ``DistributedOptimizer`` (ZeRO over the stage's DDP) shows its own sharded state in local coordinates of the
  ``[E / ep, ...]`` tensor: :class:`LocalExpertsShardedOptimizer` moves its expert boxes into the global tensor.

Every box's data is a view of the parameter's or the optimizer's own tensor (``detach()``: the same storage), so a
load copies into the local tensors in place; parameters and optimizer state are marked ``updated_by_step`` (only an
optimizer step changes them). Nothing here issues a collective.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from vescale.core.sharded_state import Box, ShardedTensor, init_optimizer_state, is_sharded_stateful
from vescale.parallel.errors import ExpertParallelError

__all__ = ["local_experts_layout", "local_experts_state", "LocalExpertsModel", "LocalExpertsOptimizer",
           "LocalExpertsShardedOptimizer"]

#: fqn -> (global shape, offsets, lengths) of a local expert parameter in its global ``[E, ...]`` tensor
Layout = dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]


def local_experts_layout(modules: list[nn.Module], experts, mesh, *, ep: str = "ep") -> Layout:
    """Where each local expert parameter held by ``modules`` sits in its global tensor: ``fqn -> (global shape,
    offsets, lengths)``, rank ``r`` of mesh dim ``ep`` holding rows ``[r E / ep, (r + 1) E / ep)``.

    ``experts``: the :class:`~vescale.parallel.experts.ExpertsInfo` list of the whole model (from
    :func:`~vescale.parallel.experts_as_operator`); a module holds those of its parameters whose FQN is listed there.
    Raises :class:`ExpertParallelError` when ``mesh`` has no dim ``ep`` or a held expert parameter is not
    ``[E / ep, ...]`` (e.g. :func:`~vescale.parallel.keep_local_experts` was not applied). No collective.
    """
    names = tuple(mesh.mesh_dim_names or ())
    if ep not in names:
        raise ExpertParallelError(f"local_experts_layout wants mesh dim {ep!r} but the mesh has dims {list(names)}")
    size, rank = mesh.size(names.index(ep)), mesh.get_local_rank(ep)
    num = {fqn: info.num_experts for info in experts for fqn in info.params}
    layout: Layout = {}
    for module in modules:
        for fqn, p in module.named_parameters():
            if fqn not in num or fqn in layout:
                continue
            total = num[fqn]
            if total % size or p.dim() < 1 or p.shape[0] * size != total:
                raise ExpertParallelError(
                    f"expert parameter {fqn} has shape {tuple(p.shape)}: expected {total} / {ep}={size} experts "
                    f"in its leading dim (this {ep} rank's; was keep_local_experts applied?)")
            per = p.shape[0]
            layout[fqn] = ((total, *p.shape[1:]), (rank * per,) + (0,) * (p.dim() - 1), tuple(p.shape))
    return layout


def _whole(name: str, t: torch.Tensor, stepped: bool) -> ShardedTensor:
    return ShardedTensor(tuple(t.shape), t.dtype, [Box((0,) * t.dim(), tuple(t.shape), t)], updated_by_step=stepped,
                         name=name)


def _placed(name: str, t: torch.Tensor, layout: Layout, fqn: str) -> ShardedTensor:
    shape, offsets, lengths = layout[fqn]
    if tuple(t.shape) != lengths:
        raise ExpertParallelError(f"{name}: local expert tensor of shape {tuple(t.shape)}, but {fqn} was laid out as "
                                  f"rows {offsets[0]}..{offsets[0] + lengths[0]} of {shape} (shape {lengths})")
    return ShardedTensor(shape, t.dtype, [Box(offsets, lengths, t)], updated_by_step=True, name=name)


class LocalExpertsModel:
    """The state of ``modules`` (this rank's pipeline stages, one FQN space) with its local expert parameters
    shown as boxes of their global tensors (see the module docstring); a
    :class:`~vescale.core.sharded_state.ShardedStateful`."""

    def __init__(self, modules: list[nn.Module], layout: Layout) -> None:
        self.modules, self.layout = list(modules), layout
        self._copies: list[tuple[nn.Module, list[str]]] = []  # entries a state_dict() gave as copies, not views

    def sharded_state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        self._copies = []
        for module in self.modules:
            sd = module.state_dict(keep_vars=True)
            owned = {t.data_ptr() for t in [*module.parameters(), *module.buffers()] if t.numel()}
            copies = []
            for name, t in sd.items():
                if name in out:
                    raise ExpertParallelError(f"two of the modules hold a state entry {name!r}")
                if not isinstance(t, torch.Tensor):  # a module's extra state: a value
                    out[name] = t
                    copies.append(name)
                    continue
                if t.numel() and t.data_ptr() not in owned:
                    copies.append(name)
                data = t.detach()
                if name in self.layout:
                    out[name] = _placed(name, data, self.layout, name)
                elif isinstance(t, nn.Parameter) and t.requires_grad:
                    out[name] = _whole(name, data, True)
                else:
                    out[name] = data
            if copies:
                self._copies.append((module, copies))
        missing = sorted(set(self.layout) - set(out))
        if missing:
            raise ExpertParallelError(f"the modules' state_dict() has no entries for the expert parameters {missing}")
        return out

    @torch.no_grad()
    def load_sharded_state_dict(self, state: dict[str, Any]) -> None:
        """Tensors were filled in place; entries a module's ``state_dict()`` handed out as copies (and extra state)
        are given back to it with ``load_state_dict``."""
        for module, names in self._copies:
            given = {n: (state[n].boxes[0].data if isinstance(state[n], ShardedTensor) else state[n])
                     for n in names if n in state}
            if given:
                module.load_state_dict(given, strict=False)


def _hparams(group: dict) -> dict[str, Any]:
    return {k: (v.item() if isinstance(v, torch.Tensor) and v.numel() == 1 else v)
            for k, v in group.items() if k != "params"}


class LocalExpertsOptimizer:
    """A plain ``torch.optim`` optimizer over ``modules``' parameters, its state of local expert parameters shown as
    boxes of their global tensors (see the module docstring); a
    :class:`~vescale.core.sharded_state.ShardedStateful` with ``init_sharded_state``."""

    def __init__(self, optimizer: torch.optim.Optimizer, modules: list[nn.Module], layout: Layout) -> None:
        if is_sharded_stateful(optimizer):
            raise ExpertParallelError(f"{type(optimizer).__name__} shows its own sharded state; "
                                      "LocalExpertsOptimizer takes a plain torch.optim optimizer (a sharded one: "
                                      "LocalExpertsShardedOptimizer)")
        self.optimizer, self.layout = optimizer, layout
        self._names: dict[int, str] = {}
        for module in modules:
            for fqn, p in module.named_parameters():
                self._names.setdefault(id(p), fqn)

    def _fqn(self, p: torch.Tensor, index: int) -> str:
        fqn = self._names.get(id(p))
        if fqn is None:
            raise ExpertParallelError(f"optimizer parameter {index} (shape {tuple(p.shape)}) is not a parameter of "
                                      "the modules given to LocalExpertsOptimizer")
        return fqn

    def _params(self):
        index = 0
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                yield group, p, self._fqn(p, index)
                index += 1

    def sharded_state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for group, p, fqn in self._params():
            out[f"param_groups.{fqn}"] = _hparams(group)
            for name, value in self.optimizer.state.get(p, {}).items():
                key = f"state.{fqn}.{name}"
                if not isinstance(value, torch.Tensor):
                    out[key] = value
                elif fqn in self.layout and value.dim() > 0:
                    if tuple(value.shape) != tuple(p.shape):
                        raise ExpertParallelError(f"optimizer state {key} has shape {tuple(value.shape)}, neither "
                                                  f"its parameter's {tuple(p.shape)} nor a scalar; it cannot be "
                                                  "placed in the global expert tensor")
                    out[key] = _placed(key, value.detach(), self.layout, fqn)
                else:
                    out[key] = _whole(key, value.detach(), True)
        return out

    @torch.no_grad()
    def load_sharded_state_dict(self, state: dict[str, Any]) -> None:
        """Apply the loaded hyper-parameters and non-tensor state values (tensors were filled in place)."""
        for group, p, fqn in self._params():
            for k, v in state.get(f"param_groups.{fqn}", {}).items():
                if isinstance(group.get(k), torch.Tensor):
                    group[k].fill_(v)
                else:
                    group[k] = v
            st = self.optimizer.state.get(p, {})
            for name in list(st):
                value = state.get(f"state.{fqn}.{name}", st[name])
                if not isinstance(value, (ShardedTensor, torch.Tensor)):
                    st[name] = value

    def init_sharded_state(self) -> None:
        """Build the optimizer's lazy state (one step at lr 0 on zero gradients) when it has none; no collective."""
        if not self.optimizer.state:
            init_optimizer_state(self.optimizer)


class LocalExpertsShardedOptimizer:
    """An optimizer that shows its own sharded state (vescale's ``DistributedOptimizer`` over a stage's DDP whose
    ``local_shards`` are the local experts), its boxes of local expert parameters moved into their global tensors;
    a :class:`~vescale.core.sharded_state.ShardedStateful` delegating to ``optimizer``.

    Such an optimizer sees a local expert parameter as a whole plain tensor ``[E / ep, ...]``: each
    :class:`~vescale.core.sharded_state.ShardedTensor` under ``state.<fqn>.<name>`` or ``master.<fqn>`` of an expert
    ``fqn`` whose global shape is that local shape gets the global ``[E, ...]`` shape, and each of its boxes is
    shifted by this rank's first row (the same data views); scalars (``step``) and tensors already of the global
    shape are kept. Anything else of an expert is an error."""

    def __init__(self, optimizer: Any, layout: Layout) -> None:
        if not is_sharded_stateful(optimizer):
            raise ExpertParallelError(f"{type(optimizer).__name__} does not show sharded state (no "
                                      "sharded_state_dict); a plain torch.optim optimizer takes LocalExpertsOptimizer")
        self.optimizer, self.layout = optimizer, layout

    def _moved(self, key: str, value: Any) -> Any:
        head, _, rest = key.partition(".")
        fqn = rest.rpartition(".")[0] if head == "state" else rest if head == "master" else None
        if fqn not in self.layout or not isinstance(value, ShardedTensor) or not value.global_shape:
            return value
        shape, offsets, lengths = self.layout[fqn]
        if value.global_shape == shape:
            return value
        if value.global_shape != lengths:
            raise ExpertParallelError(f"{key}: sharded state of global shape {value.global_shape}, neither the local "
                                      f"expert tensor's {lengths} nor the global {shape}")
        boxes = [Box(tuple(o + s for o, s in zip(b.offsets, offsets)), b.lengths, b.data) for b in value.boxes]
        return ShardedTensor(shape, value.dtype, boxes, updated_by_step=value.updated_by_step, name=key)

    def sharded_state_dict(self) -> dict[str, Any]:
        return {key: self._moved(key, value) for key, value in self.optimizer.sharded_state_dict().items()}

    def load_sharded_state_dict(self, state: dict[str, Any]) -> None:
        """The boxes' data are the optimizer's own views, filled in place; the rest is the optimizer's to apply."""
        self.optimizer.load_sharded_state_dict(state)

    def init_sharded_state(self) -> None:
        init = getattr(self.optimizer, "init_sharded_state", None)
        if callable(init):
            init()


def local_experts_state(modules: list[nn.Module], optimizer: torch.optim.Optimizer | None, experts, mesh, *,
                        ep: str = "ep") -> dict[str, Any]:
    """What a checkpoint saves and loads for ``modules`` (this rank's pipeline stages after
    :func:`~vescale.parallel.keep_local_experts`) and their ``optimizer``: ``{"model": LocalExpertsModel, "optim":
    LocalExpertsOptimizer}`` for a plain ``torch.optim`` optimizer, ``LocalExpertsShardedOptimizer`` for one that
    shows its own sharded state (vescale's ``DistributedOptimizer``); no ``"optim"`` when ``optimizer`` is None.
    Each local expert tensor is a box of its global ``[E, ...]`` tensor (see the module docstring). ``experts``:
    from :func:`~vescale.parallel.experts_as_operator`. Raises :class:`ExpertParallelError` as
    :func:`local_experts_layout` does. No collective."""
    modules = list(modules)
    layout = local_experts_layout(modules, experts, mesh, ep=ep)
    state: dict[str, Any] = {"model": LocalExpertsModel(modules, layout)}
    if optimizer is not None:
        state["optim"] = (LocalExpertsShardedOptimizer(optimizer, layout) if is_sharded_stateful(optimizer)
                          else LocalExpertsOptimizer(optimizer, modules, layout))
    return state
