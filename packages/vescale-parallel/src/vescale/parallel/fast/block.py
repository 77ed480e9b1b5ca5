"""Fast blocks: an attention or gated-MLP block between its plan's boundaries run on local tensors, Megatron-style.

A block is recognised by structure (:func:`block_layout`): a transformers module (see :mod:`.structure`) whose
children are ``nn.Linear`` projections, all but one column-parallel (``Shard(0)`` on one mesh dim ``k``), one
row-parallel (``Shard(1)`` on ``k``, no bias), plus at most one stateless activation, and whose ``forward`` reads no
head count or width. Three column-parallel
projections and the attention interface's attributes (``config`` with ``_attn_implementation``,
``num_attention_heads``, ``num_key_value_heads``; ``head_dim``, ``attention_dropout``) make an attention block, which
returns ``(output, weights)``; two make a gated MLP, which returns its output. Either then computes on this rank's
heads or FFN columns alone, and the only cross-rank reduction is the row-parallel projection's, whose local result
is the partial sum DTensor computes there too. :func:`install_block` adds the plan's conditions (see
:class:`FastBlock`). Static checks only, no collective.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial

from vescale.parallel.collectives import EnterGroup, LeaveGroup
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
    is_activation,
    only_shard_on,
    shapes_from_input,
)

__all__ = ["BlockLayout", "block_layout", "install_block", "FastBlock"]

ATTENTION_IMPLEMENTATIONS = ("sdpa", "eager")  # transformers attention functions that compute per head


@dataclass(frozen=True)
class BlockLayout:
    """What :func:`block_layout` found: the kind (``"attention"`` or ``"mlp"``), the column-parallel and the
    row-parallel projections' child names, the mesh dim ``k`` they are sharded on, the input's parameter name, and
    the ``(owner, name)`` dropout fields of the module and its config
    (:func:`~vescale.parallel.fast.structure.dropout_fields`, read per call)."""

    kind: str
    columns: tuple[str, ...]
    row: str
    k: int
    input: str
    dropouts: tuple[tuple[Any, str], ...] = field(repr=False)  # holds modules: kept out of the repr


def block_layout(module: nn.Module, mesh) -> BlockLayout | None:
    """The block structure of ``module`` with its parameters as distributed on ``mesh`` (see the module docstring),
    or None."""
    if not from_transformers(module) or not shapes_from_input(module):
        return None
    children = dict(module.named_children())
    linears = {n: c for n, c in children.items() if type(c) is nn.Linear}
    others = [c for n, c in children.items() if n not in linears]
    if len(others) > 1 or not all(is_activation(c) for c in others):
        return None
    dropouts = dropout_fields(module, getattr(module, "config", None))
    if random_code((module, *children.values()), dropouts):
        return None  # its forward (or a child's) may draw random numbers: see .random_guard
    if not all(isinstance(lin.weight, DTensor) and lin.weight.device_mesh == mesh for lin in linears.values()):
        return None
    columns = tuple(n for n, lin in linears.items() if only_shard_on(lin.weight.placements, 0) is not None)
    rows = [n for n, lin in linears.items() if only_shard_on(lin.weight.placements, 1) is not None]
    if len(rows) != 1 or len(columns) + 1 != len(linears):
        return None
    row = linears[rows[0]]
    k = only_shard_on(row.weight.placements, 1)
    if {only_shard_on(linears[n].weight.placements, 0) for n in columns} != {k} or row.bias is not None:
        return None
    if any(linears[n].bias is not None and only_shard_on(linears[n].bias.placements, 0) != k for n in columns):
        return None
    if len(columns) == 3 and not others and _attention_layout(module, [linears[n] for n in columns], mesh.size(k)):
        kind = "attention"
    elif len(columns) == 2:
        kind = "mlp"
    else:
        return None
    name = input_name(module)
    if name is None:
        return None
    return BlockLayout(kind, columns, rows[0], k, name, dropouts)


def _attention_layout(module: nn.Module, columns: list[nn.Linear], n: int) -> bool:
    """Whether ``module`` has the attention interface's attributes and its heads (and each column-parallel
    projection's whole heads) divide among the ``n`` ranks of its mesh dim."""
    cfg = getattr(module, "config", None)
    heads_, kv = getattr(cfg, "num_attention_heads", None), getattr(cfg, "num_key_value_heads", None)
    head_dim = getattr(module, "head_dim", None)
    if not all(isinstance(v, int) and v > 0 for v in (heads_, kv, head_dim)):
        return False
    if not hasattr(cfg, "_attn_implementation") or not hasattr(module, "attention_dropout"):
        return False
    return heads_ % n == 0 and kv % n == 0 and all(lin.out_features % (n * head_dim) == 0 for lin in columns)


def install_block(module: nn.Module, layout: BlockLayout, mesh, input_spec, row_output_spec, entries_inside: bool,
                  finish, context: FastPathContext) -> bool:
    """Install :class:`FastBlock` on ``module`` (of ``layout``) if the plan qualifies (see there); return whether it
    did. ``input_spec`` is the block's ``input`` entry (None: none), ``row_output_spec`` the row-parallel
    projection's ``output`` entry (None: none), ``entries_inside`` whether any other plan entry names the block or a
    module inside it; ``finish(partial_dtensor)`` applies the projection's output entry."""
    if entries_inside or row_output_spec is None or input_spec is None:
        return False
    k = layout.k
    x_spec = input_spec.get(layout.input) if isinstance(input_spec, Mapping) \
        else (input_spec[0] if len(input_spec) else None)
    if x_spec is None or not batch_or_replicated(x_spec, k):
        return False
    params = [(name, attr, tuple(getattr(getattr(module, name), attr).placements))
              for name in (*layout.columns, layout.row) for attr in ("weight", "bias")
              if getattr(getattr(module, name), attr) is not None]
    if len(params) != len(list(module.parameters())):
        return False  # a parameter outside the projections (the activation has none: checked)
    row = row_output_spec[0] if isinstance(row_output_spec, (list, tuple)) and len(row_output_spec) == 1 else None
    module.forward = FastBlock(module, module.forward, mesh, layout, params, finish, context,
                               tuple(row) if isinstance(row, (list, tuple)) else None)
    return True


class FastBlock:
    """A planned block that runs on local tensors between its plan's boundaries, when that provably computes what the
    DTensor path computes; otherwise (a runtime condition fails) the block's own ``forward`` runs on DTensors.

    Built by :func:`install_block` for a recognised block (see the module docstring) whose plan makes its layout
    exactly Megatron's: column-parallel projections ``Shard(0)`` (weights and biases) on ``k`` and replicated
    elsewhere, the row-parallel projection ``Shard(1)`` on ``k``, an ``input`` entry making the block's input
    replicated on ``k`` and replicated or batch-sharded (``Shard(0)``) on every other mesh dim, an ``output`` entry on
    the row-parallel projection, no other plan entry at or inside the block. Per call it checks: not compiling, the
    fast path on (:func:`~vescale.parallel.fast.fast_path`), not strict mode (its checks see every DTensor op), no
    active attention dropout, an attention implementation among :data:`ATTENTION_IMPLEMENTATIONS`, the input so
    placed, every other DTensor argument on the plan's mesh placed like it, no argument but the input requiring grad,
    a KV cache (if any) with an ``update`` method, the parameters still those checked at installation, no other
    dropout of the module or its config active (:func:`~vescale.parallel.fast.structure.dropout_active`), and no
    random op drawn by the first call in the module's mode (``random``: a
    :class:`~vescale.parallel.fast.random_guard.RandomGuard`; that first call takes the DTensor path).

    On the fast path the arguments and the block's parameters become their local tensors (``to_local``,
    differentiable: the input's gradient is ``Partial`` on ``k``, a parameter's is partial on the dims where the input
    is sharded, as in the DTensor path), the original ``forward`` runs on plain tensors (the KV cache still stores
    DTensors sharded on the head dim, see :mod:`.cache`), and its result, the row-parallel projection's local partial
    sum, is wrapped as a DTensor ``Partial`` on ``k`` and passed through the projection's ``output`` entry
    (``finish``), exactly the redistribution the DTensor path issues there. Attention weights (eager attention) come
    back sharded by head.
    """

    def __init__(self, module: nn.Module, orig, mesh, layout: BlockLayout, params: list[tuple], finish,
                 context: FastPathContext, row_placements: tuple | None = None) -> None:
        self.module, self.orig, self.mesh, self.k, self.kind = module, orig, mesh, layout.k, layout.kind
        self.input_name, self.params, self.finish, self.context = layout.input, params, finish, context
        self.row_placements = row_placements
        self.dropouts = layout.dropouts
        self.random = RandomGuard()
        self.local_calls = 0  # how many calls took the fast path (for tests and benchmarks)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.context.layer_group is not None and not isinstance(self._input(args, kwargs), DTensor):
            return self._run_in_layer(args, kwargs)
        if torch.compiler.is_compiling() or not self._applies(args, kwargs):
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

        if not fast_path_enabled() or is_strict() or not self.module_applies():
            return False
        x = self._input(args, kwargs)
        return (isinstance(x, DTensor) and x.device_mesh == self.mesh
                and batch_or_replicated(tuple(x.placements), self.k) and arguments_apply(args, kwargs, x, self.mesh))

    def module_applies(self) -> bool:
        """The module's own runtime conditions: no active dropout; attention with a supported implementation."""
        m = self.module
        if dropout_active(m, self.dropouts):
            return False
        if self.kind == "attention":
            if m.training and m.attention_dropout:
                return False
            if m.config._attn_implementation not in ATTENTION_IMPLEMENTATIONS:
                return False
        return True

    def _run_in_layer(self, args: tuple, kwargs: dict) -> Any:
        """Inside a fast layer or model: the input is this rank's replicated local activation and the parameters are
        already local; Megatron's two operators bound the block (identity forward / all-reduce backward on entry,
        all-reduce forward / identity backward on exit), so what leaves is the replicated local activation again."""
        group = self.context.layer_group
        entered = EnterGroup.apply(self._input(args, kwargs), group)
        if args:
            args = (entered, *args[1:])
        else:
            kwargs = {**kwargs, self.input_name: entered}
        self.local_calls += 1
        out = self.orig(*args, **kwargs)
        if self.kind == "mlp":
            return LeaveGroup.apply(out, group)
        attn, weights = out
        return LeaveGroup.apply(attn, group), weights

    def params_now(self) -> list[tuple] | None:
        """``(projection, "weight" | "bias", parameter)`` now, or None if a parameter is no longer on the plan's mesh
        with the placements checked when the block was installed (replaced since, e.g. by ZeRO 3)."""
        return current_params(self.module, self.mesh, self.params)

    def _run_local(self, args: tuple, kwargs: dict, params: list[tuple]) -> Any:
        x = self._input(args, kwargs)
        placements = tuple(x.placements)
        grad_in = [Partial() if i == self.k else p for i, p in enumerate(placements)]
        args, kwargs = localized(args, kwargs, x, grad_in)
        wrap_caches(kwargs, self.mesh, heads(placements, self.k))
        self.local_calls += 1
        with local_parameters(params, placements, self.context) as mode:
            set_cache_mode(kwargs, mode)
            out = self.orig(*args, **kwargs)
        partial = tuple(Partial() if i == self.k else p for i, p in enumerate(placements))
        if self.kind == "mlp":
            return self.finish(FromLocal.apply(out, self.mesh, partial, placements))
        attn, weights = out
        attn = self.finish(FromLocal.apply(attn, self.mesh, partial, placements))
        if isinstance(weights, torch.Tensor):
            per_head = heads(placements, self.k)
            weights = FromLocal.apply(weights, self.mesh, per_head, per_head)
        return attn, weights
