"""Fast layers: a decoder layer whose attention and MLP are both fast blocks, run whole on local tensors.

A layer is recognised by structure (:func:`install_layer`): a transformers module (see :mod:`.structure`) whose four
children are an attention :class:`~vescale.parallel.fast.block.FastBlock`, a gated-MLP one, on one mesh dim ``k`` with
outputs replicated on ``k`` (no sequence parallelism), and two norms holding one weight each, replicated on every
mesh dim. Everything the layer computes outside its blocks then runs on this rank's replicated activation with
replicated parameters, as on one device; each block issues Megatron's collectives itself. Static checks only, no
collective.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from vescale.parallel.fast.block import FastBlock
from vescale.parallel.fast.boundary import (
    FromLocal,
    arguments_apply,
    batch_or_replicated,
    current_params,
    heads,
    local_parameters,
    localized,
)
from vescale.parallel.fast.cache import set_cache_mode, wrap_caches
from vescale.parallel.fast.context import FastPathContext, fast_path_enabled
from vescale.parallel.fast.random_guard import RandomGuard, random_code
from vescale.parallel.fast.structure import (
    dropout_active,
    dropout_fields,
    from_transformers,
    input_name,
    replicated_weight_norm,
)

__all__ = ["install_layer", "FastLayer"]


def install_layer(module: nn.Module, mesh, named: list[str], context: FastPathContext) -> bool:
    """Install :class:`FastLayer` on ``module`` if it is recognised (see the module docstring) and no plan entry names
    it or one of its norms; return whether it did. ``named``: the relative FQNs of the plan entries at or inside
    ``module`` (``""``: the module itself)."""
    if not from_transformers(module) or "" in named:
        return False
    children = dict(module.named_children())
    if len(children) != 4:
        return False
    fast = {name: getattr(child, "forward", None) for name, child in children.items()}
    attn = [f for f in fast.values() if isinstance(f, FastBlock) and f.kind == "attention"]
    mlp = [f for f in fast.values() if isinstance(f, FastBlock) and f.kind == "mlp"]
    norm_names = [name for name, f in fast.items() if not isinstance(f, FastBlock)]
    if len(attn) != 1 or len(mlp) != 1 or len(norm_names) != 2:
        return False
    blocks = (attn[0], mlp[0])
    if not all(b.mesh == mesh and b.context is context for b in blocks) or blocks[0].k != blocks[1].k:
        return False
    k = blocks[0].k
    if not all(b.row_placements is not None and isinstance(b.row_placements[k], Replicate) for b in blocks):
        return False
    if any(n == norm or n.startswith(norm + ".") for n in named for norm in norm_names):
        return False
    if not all(replicated_weight_norm(children[name], mesh) for name in norm_names):
        return False
    dropouts = dropout_fields(module, getattr(module, "config", None))
    if random_code((module, *(children[name] for name in norm_names)), dropouts):
        return False  # its forward (or a norm's) may draw random numbers: see .random_guard
    name = input_name(module)
    if name is None:
        return False
    norms = [(n, "weight", tuple(children[n].weight.placements)) for n in norm_names]
    module.forward = FastLayer(module, module.forward, mesh, k, blocks, norms, name, context, dropouts)
    return True


class FastLayer:
    """A decoder layer (see the module docstring) whose attention and MLP are both :class:`FastBlock` s, run whole on
    local tensors as Megatron runs it: the norms and residual adds compute on this rank's replicated activation, and
    each block issues its own collectives explicitly (identity forward / all-reduce backward on entry, all-reduce
    forward / identity backward on exit; see :meth:`FastBlock._run_in_layer`), so no op in the layer dispatches on a
    DTensor.

    Per call it checks what both blocks check (see :class:`FastBlock`) plus that the input is placed as both blocks'
    outputs are, that no dropout of the layer or its config is active and that the first call in the layer's mode drew
    no random op (``random``, see :class:`~vescale.parallel.fast.random_guard.RandomGuard`); otherwise the layer's own
    ``forward`` runs, and its blocks decide for themselves.

    Forward values are bitwise those of the DTensor path (the same local kernels and the same all-reduces). Backward
    reduces a block's input gradient on entry, before the norm's backward, as Megatron does; the DTensor path may carry
    it as a partial sum through the norm's backward and reduce later, so gradients agree to rounding, not bitwise.
    """

    def __init__(self, module: nn.Module, orig, mesh, k: int, blocks: tuple, norms: list[tuple], input_name: str,
                 context: FastPathContext, dropouts: tuple[tuple[Any, str], ...]) -> None:
        self.module, self.orig, self.mesh, self.k, self.blocks, self.norms = module, orig, mesh, k, blocks, norms
        self.input_name, self.context = input_name, context
        self.dropouts = dropouts  # the layer's and its config's dropout fields (install_layer's), read per call
        self.random = RandomGuard()
        self.local_calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        inside = self.context.layer_group is not None
        if inside and not isinstance(self._input(args, kwargs), DTensor):
            self.local_calls += 1  # inside a fast model: local tensors in, local tensors out, parameters already local
            return self.orig(*args, **kwargs)
        if torch.compiler.is_compiling() or inside or not self._applies(args, kwargs):
            return self.orig(*args, **kwargs)
        params = self.params_now()
        if params is None:
            return self.orig(*args, **kwargs)
        if not self.random.clean(self.module):
            return self.random.dtensor_path(self.module, self.orig, args, kwargs)
        return self._run_local(args, kwargs, params)

    def _input(self, args: tuple, kwargs: dict) -> Any:
        return args[0] if args else kwargs.get(self.input_name)

    def _applies(self, args: tuple, kwargs: dict) -> bool:
        from vescale.dtensor.strict import is_strict

        if not fast_path_enabled() or is_strict() or dropout_active(self.module, self.dropouts) \
                or not all(b.module_applies() for b in self.blocks):
            return False
        x = self._input(args, kwargs)
        if not isinstance(x, DTensor) or x.device_mesh != self.mesh:
            return False
        placements = tuple(x.placements)
        return (batch_or_replicated(placements, self.k) and all(b.row_placements == placements for b in self.blocks)
                and arguments_apply(args, kwargs, x, self.mesh))

    def params_now(self) -> list[tuple] | None:
        """``(owner, attr, dtensor)`` of the norms' and both blocks' parameters now, or None if one was replaced."""
        found = current_params(self.module, self.mesh, self.norms)
        if found is None:
            return None
        for block in self.blocks:
            got = block.params_now()
            if got is None:
                return None
            found += got
        return found

    def _run_local(self, args: tuple, kwargs: dict, params: list[tuple]) -> Any:
        x = self._input(args, kwargs)
        placements = tuple(x.placements)
        args, kwargs = localized(args, kwargs, x, placements)
        wrap_caches(kwargs, self.mesh, heads(placements, self.k))
        self.local_calls += 1
        context = self.context
        before, context.layer_group = context.layer_group, self.mesh.get_group(self.k)
        try:
            with local_parameters(params, placements, context) as mode:
                set_cache_mode(kwargs, mode)
                out = self.orig(*args, **kwargs)
        finally:
            context.layer_group = before
        if isinstance(out, torch.Tensor):
            return FromLocal.apply(out, self.mesh, placements, placements)
        return (FromLocal.apply(out[0], self.mesh, placements, placements), *out[1:])  # older transformers: a tuple
