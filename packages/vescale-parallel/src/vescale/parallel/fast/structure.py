"""What the fast path's recognisers look at: a module's children, parameters, placements and origin, never its name.

Contract: each predicate is static (no collective, no forward run) and conservative. Code run on local tensors must
compute what it computes on DTensors; what makes that hold for a transformers module is the library's own layout
conventions (shapes from the input, ``view(*input_shape, -1, head_dim)``; per-head attention through its attention
interface; elementwise activations), so a recognised module's class is one transformers defines
(:func:`from_transformers`: a subclass defined elsewhere may compute anything) whose ``forward`` is not replaced, a
block's ``forward`` reads no head or width count (:func:`shapes_from_input`), and a random op is never run locally
(:func:`dropout_fields`: a nonzero one in training sends the call to the DTensor path; every other random op:
:mod:`.random_guard`).
"""

from __future__ import annotations

import inspect
from typing import Any

from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

__all__ = ["from_transformers", "input_name", "only_shard_on", "is_activation", "replicated_weight_norm",
           "code_names", "shapes_from_input", "dropout_fields", "dropout_active"]

# attribute names of a head count or a model width: a forward reading one may shape by global sizes, which local
# tensors (this rank's heads or columns) do not have
_GLOBAL_SIZES = frozenset({"num_heads", "num_attention_heads", "num_key_value_heads", "num_kv_heads", "n_head",
                           "n_heads", "hidden_size", "intermediate_size", "embed_dim", "all_head_size"})

# torch's dropout modules (all the public subclasses of its private _DropoutNd): random, so never run locally
_DROPOUT_MODULES = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)


def from_transformers(module: nn.Module) -> bool:
    """Whether ``module``'s class is defined by transformers and its ``forward`` is the class's own."""
    return type(module).__module__.startswith("transformers.") and "forward" not in vars(module)


def input_name(module: nn.Module) -> str | None:
    """The name of the first parameter of ``type(module).forward`` (the activation it takes), if it can be passed
    by position or by keyword; None otherwise."""
    try:
        params = list(inspect.signature(type(module).forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return None
    if not params or params[0].kind is not inspect.Parameter.POSITIONAL_OR_KEYWORD:
        return None
    return params[0].name


def only_shard_on(placements, dim: int) -> int | None:
    """The mesh dim on which ``placements`` is exactly ``Shard(dim)`` when every other mesh dim replicates, else
    None."""
    found = [i for i, p in enumerate(placements) if type(p) is Shard and p.dim == dim]
    rest = [p for i, p in enumerate(placements) if i not in found]
    if len(found) != 1 or not all(isinstance(p, Replicate) for p in rest):
        return None
    return found[0]


def is_activation(module: nn.Module) -> bool:
    """A stateless leaf (no parameters, buffers or children) that is not a dropout: an elementwise activation in a
    transformers block."""
    return (not list(module.parameters()) and not list(module.buffers()) and not list(module.children())
            and not isinstance(module, _DROPOUT_MODULES))


def replicated_weight_norm(module: nn.Module, mesh) -> bool:
    """A leaf whose only state is one ``weight``, a DTensor on ``mesh`` replicated on every mesh dim, and whose
    ``forward`` is its class's own (an RMSNorm)."""
    state = [*module.named_parameters(), *module.named_buffers()]
    if [n for n, _ in state] != ["weight"] or list(module.children()) or "forward" in vars(module):
        return False
    w = module.weight
    return isinstance(w, DTensor) and w.device_mesh == mesh and all(type(p) is Replicate for p in w.placements)


def code_names(cls: type) -> frozenset[str] | None:
    """Every name (``co_names``: globals, attributes, methods) the code of ``cls.forward`` reads, with its nested
    functions and every method of ``cls`` defined in transformers that it (transitively) names; None if some of that
    code cannot be read."""
    seen, names = set(), set()
    todo = [inspect.unwrap(cls.forward)]
    while todo:
        f = todo.pop()
        code = f if inspect.iscode(f) else getattr(f, "__code__", None)
        if code is None:
            return None
        if code in seen:
            continue
        seen.add(code)
        names.update(code.co_names)
        todo += [c for c in code.co_consts if inspect.iscode(c)]  # nested functions and comprehensions
        methods = (inspect.unwrap(m) for m in (getattr(cls, n, None) for n in code.co_names) if callable(m))
        todo += [m for m in methods if inspect.isfunction(m) and m.__module__.startswith("transformers.")]
    return frozenset(names)


def shapes_from_input(module: nn.Module) -> bool:
    """Whether ``type(module).forward``, and every method of its class it (transitively) refers to, reads no head
    count or width (see ``_GLOBAL_SIZES``): its shapes then come from its input."""
    names = code_names(type(module))
    return names is not None and not _GLOBAL_SIZES & names


def dropout_fields(*owners: Any) -> tuple[tuple[Any, str], ...]:
    """``(owner, name)`` of every number attribute of ``owners`` (a module, its ``config``) whose name says dropout
    (``*dropout*``, ``*pdrop*``), except ``attention_dropout`` (the attention interface's: attention blocks check it
    themselves). Read per call in training by :func:`dropout_active`."""
    found = []
    for owner in owners:
        for name, value in (vars(owner).items() if owner is not None else ()):
            if ("dropout" in name or "pdrop" in name) and name != "attention_dropout" \
                    and isinstance(value, (int, float)) and not isinstance(value, bool):
                found.append((owner, name))
    return tuple(found)


def dropout_active(module: nn.Module, fields: tuple[tuple[Any, str], ...]) -> bool:
    """Whether ``module`` trains with a nonzero dropout of ``fields`` (its random masks are drawn on the DTensor
    path, as on one device)."""
    return module.training and any(getattr(owner, name) for owner, name in fields)
