"""LoRA / PEFT models under a tensor-parallel plan: the adapters' placements derived from their base layers'.

A model wrapped by ``peft`` (``get_peft_model(model, LoraConfig(...))``) renames each targeted layer's weight to
``<layer>.base_layer.weight`` and adds ``<layer>.lora_A.<adapter>.weight`` ``[r, in]`` and
``<layer>.lora_B.<adapter>.weight`` ``[out, r]``; a ``PeftModel`` also nests the model under ``base_model.model``.
:func:`lora_plan` takes a plan written for the unwrapped model (a family plan, ``auto_plan``'s, or a hand plan, keyed
by FQN regexes of the base model: ``...q_proj.weight``) and returns the plan of the wrapped one, with one exact
entry per parameter:

* a base weight keeps its layer's placements;
* column-parallel base (``Shard(0)`` on a mesh dim): ``lora_A`` replicated, ``lora_B`` ``Shard(0)`` there, so the
  adapter's output has the base output's placement (sharded on its features);
* row-parallel base (``Shard(1)``): ``lora_A`` ``Shard(1)``, ``lora_B`` replicated: the adapter's output is partial,
  like the base's, and the two partial sums add before the layer's one reduction;
* replicated base: replicated adapters.

Module boundaries (``input`` / ``output`` / ``local``) move to the PEFT names (the LoRA layer, never its
``base_layer`` or adapters; the unwrapped model's root ``""`` to the wrapped model's inner model). Pure: no
collective, the same result on every rank. :func:`vescale.plan.build` applies it to every plan it resolves.
"""

from __future__ import annotations

import collections
import contextlib
import inspect
import re
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import Replicate

from vescale.core.fqn import match_plan
from vescale.core.placement_format import format_placements
from vescale.plan.decisions import AutoPlan, Decision
from vescale.plan.spec import SpecError

__all__ = ["AdapterState", "is_lora_model", "has_adapters", "lora_layers", "lora_plan", "adapter_placements",
           "adapter_state", "base_fqn", "base_view", "inner_prefix", "forward_parameters",
           "stacked_lora_layers"]

_ADAPTERS = ("lora_A", "lora_B")
# LoRA variants whose extra tensors have no placement rule here (DoRA's magnitudes, embedding adapters, ...)
_UNSUPPORTED = ("lora_magnitude_vector", "lora_embedding_A", "lora_embedding_B")


def lora_layers(model: nn.Module) -> dict[str, nn.Module]:
    """``{fqn: layer}`` of the LoRA layers in ``model``: modules with a ``base_layer`` child and ``lora_A`` /
    ``lora_B`` adapter dicts (peft's ``LoraLayer``, recognised by structure)."""
    return {fqn: m for fqn, m in model.named_modules()
            if isinstance(getattr(m, "base_layer", None), nn.Module) and isinstance(getattr(m, "lora_A", None),
                                                                                   nn.ModuleDict)}


def is_lora_model(model: nn.Module) -> bool:
    """Whether ``model`` holds LoRA layers (a ``peft`` model, or one ``inject_adapter_in_model`` changed)."""
    return bool(lora_layers(model))


def inner_prefix(model: nn.Module) -> str:
    """The FQN prefix of the unwrapped model inside ``model`` (``"base_model.model."`` for a ``PeftModel``)."""
    get = getattr(model, "get_base_model", None)
    inner = get() if callable(get) else None
    if inner is None or inner is model:
        return ""
    for fqn, m in model.named_modules():
        if m is inner:
            return f"{fqn}."
    return ""


def stacked_lora_layers(model: nn.Module) -> list[str]:
    """FQNs of the LoRA layers that adapt stacked (>= 3-D) parameters, e.g. an MoE's experts through peft's
    ``target_parameters`` (a ``ParamWrapper``: ``lora_A`` ``[r * E, in]``, ``lora_B`` ``[out, r * E]``)."""
    return [fqn for fqn, m in lora_layers(model).items() if any(p.dim() >= 3 for p in m.base_layer.parameters())]


def forward_parameters(model: nn.Module) -> dict[str, inspect.Parameter]:
    """The named parameters of ``model.forward``; for a wrapper whose forward passes only ``*args, **kwargs`` on
    (peft's task-less ``PeftModel``), those of the model it wraps, so a caller knows it takes ``input_ids=`` (the name
    an ep or dp plan places the batch by)."""
    params = dict(inspect.signature(model.forward).parameters)
    variadic = {inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD}
    get = getattr(model, "get_base_model", None)
    if params and all(p.kind in variadic for p in params.values()) and callable(get):
        inner = get()
        if inner is not model:
            return forward_parameters(inner)
    return params


def base_fqn(fqn: str, prefix: str = "") -> str:
    """``fqn`` (of a parameter or module of the wrapped model) as the unwrapped model names it: ``prefix`` and every
    ``.base_layer`` dropped."""
    if prefix and fqn.startswith(prefix):
        fqn = fqn[len(prefix):]
    elif prefix and fqn + "." == prefix:
        fqn = ""
    return fqn.replace(".base_layer.", ".").removesuffix(".base_layer")


def adapter_placements(base: tuple, which: str, *, fqn: str = "") -> tuple:
    """The placements of a ``lora_A`` (``[r, in]``) or ``lora_B`` (``[out, r]``) adapter weight whose base weight
    ``[out, in]`` has ``base`` (one placement per mesh dim): a shard of the base's dim 0 goes to ``lora_B``'s dim 0, a
    shard of its dim 1 to ``lora_A``'s dim 1 (placement kept, e.g. ``InterleavedShard``), the other replicated."""
    out = []
    for p in base:
        dim = getattr(p, "dim", None)
        if not p.is_shard() and dim is None:
            if not isinstance(p, Replicate):
                raise SpecError(f"LoRA adapter {fqn!r}: base placement {p} is neither a shard nor replicated")
            out.append(Replicate())
        elif dim in (0, -2):
            out.append(p if which == "lora_B" else Replicate())
        elif dim in (1, -1):
            out.append(p if which == "lora_A" else Replicate())
        else:
            raise SpecError(f"LoRA adapter {fqn!r}: base placement {p} shards dim {dim} of a 2-D weight")
    return tuple(out)


@contextlib.contextmanager
def base_view(model: nn.Module):
    """Within: the unwrapped model inside ``model`` (itself when not wrapped) with its LoRA layers running their base
    layer only, so a trace (``auto_plan``) sees the base model's matmuls under ``...base_layer`` names."""
    layers = [m for m in lora_layers(model).values() if callable(getattr(m, "enable_adapters", None))]
    was = [bool(getattr(m, "disable_adapters", False)) for m in layers]
    prefix = inner_prefix(model)
    inner = model.get_submodule(prefix[:-1]) if prefix else model
    trains = [(p, p.requires_grad) for p in model.parameters()]  # (peft's switch also flips requires_grad)
    for m in layers:
        m.enable_adapters(False)
    try:
        yield inner
    finally:
        for m, disabled in zip(layers, was):
            m.enable_adapters(not disabled)
        for p, flag in trains:
            p.requires_grad_(flag)


def has_adapters(modules: nn.Module | list[nn.Module]) -> bool:
    """Whether ``modules`` (a model, or pipeline stages, which keep the model's FQNs) hold LoRA adapters: a
    ``<layer>.lora_A.<adapter>.weight`` beside its ``<layer>.base_layer.weight``."""
    names = {n for m in (modules if isinstance(modules, list) else [modules]) for n, _ in m.named_parameters()}
    return any(n.partition(".lora_A.")[0] + ".base_layer.weight" in names for n in names if ".lora_A." in n)


class AdapterState(nn.Module):
    """The parameters that train of a model (or of a rank's pipeline stages), by FQN, as a module whose
    ``state_dict`` holds them alone: a checkpoint saves and loads them in place (any layout) and names their optimizer
    state by FQN. Read-only mapping access too (``state["...lora_A.default.weight"]``, ``keys()``, ``items()``)."""

    def __init__(self, params: dict[str, nn.Parameter]) -> None:
        super().__init__()
        object.__setattr__(self, "_adapters", dict(params))  # not registered: dotted names, no submodules

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        for name, p in self._adapters.items():
            yield prefix + name, p

    def state_dict(self, *args: Any, destination=None, prefix: str = "", keep_vars: bool = False) -> dict:
        out = collections.OrderedDict() if destination is None else destination
        for name, p in self._adapters.items():
            out[prefix + name] = p if keep_vars else p.detach()
        return out

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        missing = [n for n in self._adapters if n not in state_dict]
        if strict and missing:
            raise KeyError(f"adapter state lacks {missing[:4]}")
        with torch.no_grad():
            for name, p in self._adapters.items():
                if name in state_dict and state_dict[name] is not p:
                    p.copy_(state_dict[name])
        return None

    def keys(self):
        return self._adapters.keys()

    def items(self):
        return self._adapters.items()

    def __getitem__(self, name: str) -> nn.Parameter:
        return self._adapters[name]

    def __iter__(self):
        return iter(self._adapters)

    def __len__(self) -> int:
        return len(self._adapters)


def adapter_state(modules: nn.Module | list[nn.Module]) -> AdapterState:
    """What a checkpoint of a LoRA model holds: the parameters that train (the adapters, as laid out: DTensors over
    tp, FSDP2 shards, this rank's pipeline stages'), as an :class:`AdapterState`, which ``vescale.checkpoint`` saves
    and loads in place on any mesh (with the optimizer's state named by FQN). The frozen base weights are not in it
    (they come from the base model's weights)."""
    return AdapterState({n: p for m in (modules if isinstance(modules, list) else [modules])
                         for n, p in m.named_parameters() if p.requires_grad})


def lora_plan(model: nn.Module, plan: dict, mesh=None) -> AutoPlan:
    """The plan of LoRA model ``model`` from ``plan``, a plan of the unwrapped model (or already of ``model``):
    exact entries for every parameter (adapters by :func:`adapter_placements`), boundaries moved to the PEFT module
    names, and one :class:`~vescale.plan.Decision` per parameter (what :func:`vescale.plan.explain` prints).

    Raises :class:`~vescale.plan.SpecError` naming the adapter when its base layer is sharded in a way no adapter
    layout follows (a LoRA embedding of a vocab-parallel table, DoRA magnitudes of a sharded layer)."""
    prefix = inner_prefix(model)
    layers = lora_layers(model)
    params = dict(model.named_parameters(remove_duplicate=False))
    section = plan.get("parameter", {})
    # base placements: the plan matched against both spellings of each FQN (plain names, or auto_plan's base_layer)
    plain = {fqn: base_fqn(fqn, prefix) for fqn in params}
    unwrapped = {fqn: fqn[len(prefix):] if fqn.startswith(prefix) else fqn for fqn in params}
    by_plain = match_plan(section, set(plain.values()) | set(unwrapped.values()), what="plan section 'parameter'")
    ndim = _ndim(section, mesh)
    replicate = tuple(Replicate() for _ in range(ndim))

    def placed(fqn: str) -> tuple[tuple, str]:
        for name in (unwrapped[fqn], plain[fqn]):
            m = by_plain.get(name)
            if m is not None:
                return tuple(m.value), f"from {m.pattern!r}"
        return replicate, "not in the plan: replicated"

    entries: dict[str, Any] = {}
    decisions: list[Decision] = []
    for fqn, param in params.items():
        layer, kind = _adapter_of(fqn, layers)
        if kind is None:
            value, why = placed(fqn)
            role = "frozen" if not param.requires_grad else "trained"
        elif kind in _UNSUPPORTED:
            base_w = f"{layer}.base_layer.weight"
            value, _ = placed(base_w) if base_w in params else (replicate, "")
            if any(not isinstance(p, Replicate) for p in value):
                raise SpecError(f"LoRA parameter {fqn!r}: its base layer is sharded {format_placements(value)} and "
                                f"{kind} has no derived layout; replicate {layer!r} in the plan or leave it untargeted")
            why, role = "base layer replicated", "adapter"
        else:
            base_w = f"{layer}.base_layer.weight"
            if base_w not in params or params[base_w].ndim != 2:
                raise SpecError(f"LoRA adapter {fqn!r}: base layer {layer!r} has no 2-D weight (only linear layers "
                                "take a derived adapter layout)")
            base, _ = placed(base_w)
            if fqn.endswith(".bias"):  # lora_B's bias follows the base output's features
                value = adapter_placements(base, "lora_B", fqn=fqn) if kind == "lora_B" else replicate
                value = tuple(Replicate() if getattr(p, "dim", 0) not in (0, -1) else p for p in value)
            else:
                value = adapter_placements(base, kind, fqn=fqn)
            role = "adapter"
            why = f"{kind} of {base_fqn(base_w, prefix)} {format_placements(base)}"
        entries[re.escape(fqn)] = list(value)
        decisions.append(Decision("parameter", fqn, format_placements(value), role, why))
    out = {"parameter": entries}
    for kind in ("input", "output", "local"):
        moved = _move_boundaries(model, plan.get(kind, {}), prefix, layers, kind)
        if moved or kind in plan:
            out[kind] = moved
        for fqn, value in moved.items():
            decisions.append(Decision(kind, re.sub(r"\\(.)", r"\1", fqn), format_placements(value) if isinstance(
                value, (list, tuple)) else str(value), "boundary", "moved to the PEFT module name"))
    checks = [d for d in getattr(plan, "decisions", []) if d.kind == "verify"]  # auto_plan's pair checks
    return AutoPlan(out, [*decisions, *checks], getattr(plan, "mesh_desc", ""))


def _ndim(section: dict, mesh) -> int:
    if mesh is not None:
        return mesh.ndim
    for value in section.values():
        return len(value)
    return 1


def _adapter_of(fqn: str, layers: dict[str, nn.Module]) -> tuple[str, str | None]:
    """``(layer FQN, "lora_A" | "lora_B" | other kind)`` when ``fqn`` is an adapter tensor, else ``("", None)``."""
    for kind in (*_ADAPTERS, *_UNSUPPORTED):
        head, sep, _ = fqn.partition(f".{kind}.")
        if sep and head in layers:
            return head, kind
    return "", None


def _move_boundaries(model: nn.Module, section: dict, prefix: str, layers: dict[str, nn.Module],
                     kind: str) -> dict:
    """One boundary section keyed by exact PEFT module names: each module that is neither a LoRA layer's base layer
    nor inside its adapters takes the entry its unwrapped name matches; the root's goes to the inner model."""
    if not section:
        return {}
    inside = tuple(f"{layer}." for layer in layers)
    names: dict[str, str] = {}
    for fqn, _ in model.named_modules():
        if fqn.startswith(inside):
            continue  # a base layer or an adapter: the LoRA layer around it owns the boundary
        if prefix and not (fqn + ".").startswith(prefix):
            continue  # the PEFT wrappers above the inner model
        names[fqn] = fqn[len(prefix):] if prefix and fqn + "." != prefix else ("" if prefix else fqn)
    # a boundary written on auto_plan's base_layer names belongs to the LoRA layer; one on an adapter's own module
    # (a module-tree fallback plan sees them) is inside it: the LoRA layer's boundary governs
    patterns = {re.sub(r"(\\\.|\.)base_layer$", "", p): v for p, v in section.items()
                if not re.search(r"(\\\.|\.)(lora_[A-Za-z_]+)(\\\.|\.|$)", p)}
    matches = match_plan(patterns, set(names.values()), what=f"plan section {kind!r} (module patterns)")
    return {re.escape(fqn): matches[name].value for fqn, name in names.items() if name in matches}
