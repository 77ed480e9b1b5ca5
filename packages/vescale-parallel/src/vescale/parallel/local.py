"""The plan's ``local`` section: run a submodule on this rank's shards as plain tensors, for code DTensor cannot follow.

Some model code is data dependent in ways DTensor's sharding propagation does not support (a mixture-of-experts
dispatch calls ``nonzero``/``where`` and loops over the experts that were hit). An entry of the plan's ``local``
section runs such a module Megatron-style instead: its DTensor arguments and its own parameters/buffers are replaced
by their local tensors (``to_local``, differentiable), the original ``forward`` runs on plain tensors, and its tensor
outputs are wrapped back as DTensors with the placements of the module's ``output`` entry (default ``Replicate``), which
describe what the *local* results are, e.g. ``Partial()`` for a row-parallel result.

The module's ``local`` entry gives, per positional argument (a list) or keyword (a dict), what each rank's local
*gradient* of that argument is, e.g. ``Partial()`` for a replicated input that feeds sharded weights; ``None`` (or a
missing entry) means "the argument's own placements". Parameters' gradients are those of their local shards, taken as
``Partial`` on the mesh dims where the module's arguments are sharded (each rank saw part of the data there).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from vescale.core import torch_internals
from vescale.parallel.factory import capture_suspended

__all__ = ["make_local", "is_local"]

#: Names served from their new module for one release, with a DeprecationWarning naming the new spelling.
_MOVED = {"FastBlock": "vescale.parallel.fast", "FastLayer": "vescale.parallel.fast",
          "FastModel": "vescale.parallel.fast", "fast_path": "vescale.parallel.fast"}


def __getattr__(name: str) -> Any:
    if name not in _MOVED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    new = _MOVED[name]
    warnings.warn(f"vescale.parallel.local.{name} is deprecated: use {new}.{name}", DeprecationWarning, stacklevel=2)
    return getattr(importlib.import_module(new), name)


def make_local(module: nn.Module, mesh, grad_spec, out_spec, fqn: str) -> None:
    """Make ``module`` run on local tensors (see the module docstring); ``grad_spec``/``out_spec`` are plan entries."""
    module.forward = functools.partial(_local_forward, orig=module.forward, module=module, mesh=mesh,
                                       grad_spec=grad_spec, out_spec=out_spec, fqn=fqn)


def _arg_local(x: Any, grad_placements) -> Any:
    """An argument's local tensor; tuples and lists (rotary ``position_embeddings=(cos, sin)``) element by element,
    each with its own placements as gradient placements."""
    if isinstance(x, DTensor):
        return x.to_local(grad_placements=grad_placements or x.placements)
    if isinstance(x, (tuple, list)) and any(isinstance(v, DTensor) for v in x):
        items = [_arg_local(v, None) for v in x]
        return type(x)(items) if isinstance(x, list) else tuple(items)
    return x


def _local_forward(*args: Any, orig, module: nn.Module, mesh, grad_spec, out_spec, fqn: str, **kwargs: Any) -> Any:
    in_args, in_kwargs = args, kwargs
    if isinstance(grad_spec, Mapping):
        args = tuple(_arg_local(a, None) for a in args)
        kwargs = {k: _arg_local(v, grad_spec.get(k)) for k, v in kwargs.items()}
    else:
        spec = list(grad_spec or [])
        args = tuple(_arg_local(a, spec[i] if i < len(spec) else None) for i, a in enumerate(args))
        kwargs = {k: _arg_local(v, None) for k, v in kwargs.items()}
    # Where an argument is sharded (a batch-sharding dp dim, a sequence-sharded tp dim) each rank saw only part of the
    # data, so a parameter replicated there gets only part of its gradient: a partial sum.
    split = {i for x in (*in_args, *in_kwargs.values()) if isinstance(x, DTensor)
             for i, p in enumerate(x.placements) if isinstance(p, Shard)}
    swap = {name: t.to_local(grad_placements=[Partial() if i in split and isinstance(p, Replicate) else p
                                              for i, p in enumerate(t.placements)])
            for name, t in _named_state(module) if isinstance(t, DTensor)}
    # torch's private reparametrisation (what torch.func.functional_call uses) swaps the tensors for this call only;
    # functional_call itself would re-enter module.__call__ and run this module's hooks twice.
    with capture_suspended(), torch_internals.reparametrize_module(module, swap):
        out = orig(*args, **kwargs)
    return _wrap_outputs(out, mesh, out_spec, fqn)


def _named_state(module: nn.Module):
    yield from module.named_parameters(remove_duplicate=False)
    yield from module.named_buffers(remove_duplicate=False)


def _wrap(x: Any, mesh, placements) -> Any:
    if isinstance(x, torch.Tensor) and not isinstance(x, DTensor):
        return DTensor.from_local(x, mesh, placements or [Replicate()] * mesh.ndim, run_check=False)
    return x


def _wrap_outputs(out: Any, mesh, out_spec, fqn: str) -> Any:
    if isinstance(out_spec, Mapping):
        if isinstance(out, Mapping):
            for key in list(out.keys()):
                out[key] = _wrap(out[key], mesh, out_spec.get(key))
        return out
    spec = list(out_spec or [])
    if isinstance(out, torch.Tensor):
        return _wrap(out, mesh, spec[0] if spec else None)
    if isinstance(out, (tuple, list)):
        items = [_wrap(x, mesh, spec[i] if i < len(spec) else None) for i, x in enumerate(out)]
        return type(out)(items) if isinstance(out, list) else tuple(items)
    return out


def is_local(module: nn.Module) -> bool:
    """Whether ``module`` runs as a ``local`` entry (:func:`make_local`)."""
    return getattr(vars(module).get("forward"), "func", None) is _local_forward
