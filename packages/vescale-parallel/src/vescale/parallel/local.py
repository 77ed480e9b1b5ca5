"""Local modules: run a submodule on this rank's shards as plain tensors, for code DTensor cannot propagate through.

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

import contextlib
import functools
import inspect
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from vescale.core import torch_internals
from vescale.dtensor.api import from_local_nograd
from vescale.parallel.factory import capture_paused, capture_resumed, capture_suspended
from vescale.parallel.model_calls import check_token_ids, embedding_name

__all__ = ["make_local", "fast_block", "fast_layer", "fast_model", "fast_path", "in_fast_block", "FastBlock",
           "FastLayer", "FastModel", "FAST_BLOCKS", "FAST_LAYERS", "FAST_MODELS"]


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


# ---------------------------------------------------------------------------------------------------------------
# The fast path: known blocks between the plan's boundaries run on local tensors
# ---------------------------------------------------------------------------------------------------------------

#: Module classes (by module path and name, exact type only) whose ``forward`` computes on this rank's heads or FFN
#: columns alone when its column-parallel projections hold ``Shard(0)`` rows and its row-parallel projection
#: ``Shard(1)`` columns: every shape it uses comes from its input (``view(*input_shape, -1, head_dim)``), attention is
#: per head (grouped-query attention per whole group of heads), the activation is elementwise, and the only cross-head
#: reduction is the row-parallel projection, whose local result is the partial sum DTensor computes there too.
#: Value: (kind, column-parallel linears, row-parallel linear).
FAST_BLOCKS: dict[tuple[str, str], tuple[str, tuple[str, ...], str]] = {}
for _family, _name in (("llama", "Llama"), ("qwen2", "Qwen2"), ("mistral", "Mistral"), ("mixtral", "Mixtral")):
    _path = f"transformers.models.{_family}.modeling_{_family}"
    FAST_BLOCKS[(_path, f"{_name}Attention")] = ("attention", ("q_proj", "k_proj", "v_proj"), "o_proj")
    if _family != "mixtral":  # Mixtral's MLP is a mixture of experts
        FAST_BLOCKS[(_path, f"{_name}MLP")] = ("mlp", ("gate_proj", "up_proj"), "down_proj")
#: Decoder layers (exact type) whose ``forward`` is pre-norm residual: ``x + attn(norm1(x))``, then
#: ``h + mlp(norm2(h))``, with RMSNorms holding one replicated weight. Value: (first norm, attention, second norm,
#: MLP) child names.
FAST_LAYERS: dict[tuple[str, str], tuple[str, str, str, str]] = {}
for _family, _name in (("llama", "Llama"), ("qwen2", "Qwen2"), ("mistral", "Mistral")):
    _path = f"transformers.models.{_family}.modeling_{_family}"
    FAST_LAYERS[(_path, f"{_name}DecoderLayer")] = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
del _family, _name, _path

_ATTENTION_IMPLEMENTATIONS = ("sdpa", "eager")
_fast_depth = 0  # > 0 while a fast block runs: the plan's hooks of its submodules stand aside (see in_fast_block)
_fast_enabled = True
_layer_group = None  # the tp process group while a FastLayer runs: its blocks take and give plain local tensors


def in_fast_block() -> bool:
    """Whether a fast block runs now; the plan's input/output hooks of modules inside it then do nothing (the block
    applies its row-parallel projection's output entry itself, to the wrapped result)."""
    return _fast_depth > 0


@contextlib.contextmanager
def fast_path(enabled: bool) -> Iterator[None]:
    """Inside, known blocks run on local tensors (``True``, the default) or always take the DTensor path (``False``):
    for comparing the two, and for the benchmark."""
    global _fast_enabled
    before, _fast_enabled = _fast_enabled, enabled
    try:
        yield
    finally:
        _fast_enabled = before


class FastBlock:
    """A planned block that runs on local tensors between its plan's boundaries, when that provably computes what the
    DTensor path computes; otherwise (a runtime condition fails) the block's own ``forward`` runs on DTensors.

    Built by :func:`fast_block` only for a :data:`FAST_BLOCKS` class whose layout the plan makes exactly Megatron's:
    column-parallel projections ``Shard(0)`` (weights and biases) on one mesh dim ``k`` and replicated elsewhere, the
    row-parallel projection ``Shard(1)`` on ``k`` without bias, an ``input`` entry making the block's input replicated
    on ``k`` and replicated or batch-sharded (``Shard(0)``) on every other mesh dim, an ``output`` entry on the
    row-parallel projection, no other plan entry at or inside the block, heads (attention) dividing by the size of
    ``k``. Per call it checks: not compiling, not strict mode (strict
    mode's checks see every DTensor op), no active attention dropout, an attention implementation among
    :data:`_ATTENTION_IMPLEMENTATIONS`, the input so placed, every other DTensor argument on the plan's mesh placed like
    it, no argument but the input requiring grad, a KV cache (if any) with an ``update`` method.

    On the fast path the arguments and the block's parameters become their local tensors (``to_local``,
    differentiable: the input's gradient is ``Partial`` on ``k``, a parameter's is partial on the dims where the input
    is sharded, as in the DTensor path), the original ``forward`` runs on plain tensors (the KV cache still stores
    DTensors sharded on the head dim, see :class:`_CacheOfDTensors`), and its result, the row-parallel projection's
    local partial sum, is wrapped as a DTensor ``Partial`` on ``k`` and passed through the projection's ``output``
    entry (``finish``), exactly the
    redistribution the DTensor path issues there. Attention weights (eager attention) come back sharded by head.
    """

    def __init__(self, module: nn.Module, orig, mesh, k: int, kind: str, params: list[tuple], finish,
                 row_placements: tuple | None = None) -> None:
        self.module, self.orig, self.mesh, self.k, self.kind = module, orig, mesh, k, kind
        self.params, self.finish, self.row_placements = params, finish, row_placements
        self.local_calls = 0  # how many calls took the fast path (for tests and benchmarks)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if _layer_group is not None and not isinstance(self._input(args, kwargs), DTensor):
            return self._run_in_layer(args, kwargs)
        if torch.compiler.is_compiling() or not self._applies(args, kwargs):
            return self.orig(*args, **kwargs)
        params = self._params()
        if params is None:
            return self.orig(*args, **kwargs)
        return self._run_local(args, kwargs, params)

    def _input(self, args: tuple, kwargs: dict) -> Any:
        if args:
            return args[0]
        return kwargs.get("hidden_states" if self.kind == "attention" else "x")

    def _applies(self, args: tuple, kwargs: dict) -> bool:
        from vescale.dtensor.strict import is_strict

        if not _fast_enabled or is_strict() or not self._module_applies():
            return False
        x = self._input(args, kwargs)
        return (isinstance(x, DTensor) and x.device_mesh == self.mesh
                and _batch_or_replicated(tuple(x.placements), self.k) and _arguments_apply(args, kwargs, x, self.mesh))

    def _module_applies(self) -> bool:
        """The module's own runtime conditions: attention without active dropout, with a supported implementation."""
        m = self.module
        if self.kind == "attention":
            if m.training and m.attention_dropout:
                return False
            if m.config._attn_implementation not in _ATTENTION_IMPLEMENTATIONS:
                return False
        return True

    def _run_in_layer(self, args: tuple, kwargs: dict) -> Any:
        """Inside a :class:`FastLayer`: the input is this rank's replicated local activation and the parameters are
        already local; Megatron's two operators bound the block (identity forward / all-reduce backward on entry,
        all-reduce forward / identity backward on exit), so what leaves is the replicated local activation again."""
        x = self._input(args, kwargs)
        entered = _EnterGroup.apply(x, _layer_group)
        if args:
            args = (entered, *args[1:])
        else:
            kwargs = {**kwargs, ("hidden_states" if self.kind == "attention" else "x"): entered}
        self.local_calls += 1
        out = self.orig(*args, **kwargs)
        if self.kind == "mlp":
            return _LeaveGroup.apply(out, _layer_group)
        attn, weights = out
        return _LeaveGroup.apply(attn, _layer_group), weights

    def _params(self) -> list[tuple] | None:
        """``(projection, "weight" | "bias", parameter)`` now, or None if a parameter is no longer on the plan's mesh
        with the placements checked when the block was installed (replaced since, e.g. by ZeRO 3)."""
        return _current_params(self.module, self.mesh, self.params)

    def _run_local(self, args: tuple, kwargs: dict, params: list[tuple]) -> Any:
        x = self._input(args, kwargs)
        placements = tuple(x.placements)
        grad_in = [Partial() if i == self.k else p for i, p in enumerate(placements)]
        args, kwargs = _localized(args, kwargs, x, grad_in, self.mesh, self.k)
        self.local_calls += 1
        with _local_parameters(params, placements) as mode:
            _set_cache_mode(kwargs, mode)
            out = self.orig(*args, **kwargs)
        partial = tuple(Partial() if i == self.k else p for i, p in enumerate(placements))
        if self.kind == "mlp":
            return self.finish(_FromLocal.apply(out, self.mesh, partial, placements))
        attn, weights = out
        attn = self.finish(_FromLocal.apply(attn, self.mesh, partial, placements))
        if isinstance(weights, torch.Tensor):
            heads = _heads(placements, self.k)
            weights = _FromLocal.apply(weights, self.mesh, heads, heads)
        return attn, weights


class FastLayer:
    """A pre-norm decoder layer (:data:`FAST_LAYERS`) whose attention and MLP are both :class:`FastBlock` s run whole on
    local tensors, as Megatron runs it: the norms and residual adds compute on this rank's replicated activation, and
    each block issues its own collectives explicitly (identity forward / all-reduce backward on entry, all-reduce
    forward / identity backward on exit; see :meth:`FastBlock._run_in_layer`), so no op in the layer dispatches on a
    DTensor.

    Built by :func:`fast_layer` only when both blocks are fast on the same mesh dim ``k``, each block's row-parallel
    output entry makes its result replicated on ``k`` (no sequence parallelism), the norms hold one weight each,
    replicated on every mesh dim, and no plan entry names the layer or a norm. Per call it checks what both blocks check
    (see :class:`FastBlock`) plus that the input is placed as both blocks' outputs are; otherwise the layer's own
    ``forward`` runs, and its blocks decide for themselves.

    Forward values are bitwise those of the DTensor path (the same local kernels and the same all-reduces). Backward
    reduces a block's input gradient on entry, before the norm's backward, as Megatron does; the DTensor path may carry
    it as a partial sum through the norm's backward and reduce later, so gradients agree to rounding, not bitwise.
    """

    def __init__(self, module: nn.Module, orig, mesh, k: int, blocks: tuple, norms: list[tuple]) -> None:
        self.module, self.orig, self.mesh, self.k, self.blocks, self.norms = module, orig, mesh, k, blocks, norms
        self.local_calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if _layer_group is not None and not isinstance(self._input(args, kwargs), DTensor):
            self.local_calls += 1  # inside a FastModel: local tensors in, local tensors out, parameters already local
            return self.orig(*args, **kwargs)
        if torch.compiler.is_compiling() or _layer_group is not None or not self._applies(args, kwargs):
            return self.orig(*args, **kwargs)
        params = self._params()
        if params is None:
            return self.orig(*args, **kwargs)
        return self._run_local(args, kwargs, params)

    @staticmethod
    def _input(args: tuple, kwargs: dict) -> Any:
        return args[0] if args else kwargs.get("hidden_states")

    def _applies(self, args: tuple, kwargs: dict) -> bool:
        from vescale.dtensor.strict import is_strict

        if not _fast_enabled or is_strict() or not all(b._module_applies() for b in self.blocks):
            return False
        x = self._input(args, kwargs)
        if not isinstance(x, DTensor) or x.device_mesh != self.mesh:
            return False
        placements = tuple(x.placements)
        return (_batch_or_replicated(placements, self.k) and all(b.row_placements == placements for b in self.blocks)
                and _arguments_apply(args, kwargs, x, self.mesh))

    def _params(self) -> list[tuple] | None:
        found = _current_params(self.module, self.mesh, self.norms)
        if found is None:
            return None
        for block in self.blocks:
            got = block._params()
            if got is None:
                return None
            found += got
        return found

    def _run_local(self, args: tuple, kwargs: dict, params: list[tuple]) -> Any:
        global _layer_group
        x = self._input(args, kwargs)
        placements = tuple(x.placements)
        args, kwargs = _localized(args, kwargs, x, placements, self.mesh, self.k)
        self.local_calls += 1
        before, _layer_group = _layer_group, self.mesh.get_group(self.k)
        try:
            with _local_parameters(params, placements) as mode:
                _set_cache_mode(kwargs, mode)
                out = self.orig(*args, **kwargs)
        finally:
            _layer_group = before
        if isinstance(out, torch.Tensor):
            return _FromLocal.apply(out, self.mesh, placements, placements)
        return (_FromLocal.apply(out[0], self.mesh, placements, placements), *out[1:])  # older transformers: a tuple


def _current_params(module: nn.Module, mesh, entries: list[tuple]) -> list[tuple] | None:
    """``(owner, attr, dtensor)`` for each ``(child, attr, placements)`` entry as the module holds it now, or None if
    one is no longer a DTensor on ``mesh`` with those placements (replaced since it was checked)."""
    found = []
    for child, attr, placements in entries:
        owner = getattr(module, child)
        t = getattr(owner, attr)
        if not isinstance(t, DTensor) or t.device_mesh != mesh or tuple(t.placements) != placements:
            return None
        found.append((owner, attr, t))
    return found


def _heads(placements: tuple, k: int) -> tuple:
    """Placements of a per-head tensor ``[batch, heads, ...]``: heads sharded on ``k``, the batch as the input's."""
    return tuple(Shard(1) if i == k else p for i, p in enumerate(placements))


def _localized(args: tuple, kwargs: dict, x: DTensor, grad_in, mesh, k: int) -> tuple[tuple, dict]:
    """The arguments as local tensors: the input differentiably (its gradient taken as ``grad_in``), the others (which
    need no gradient: checked) as they are; a KV cache wrapped to store head-sharded DTensors
    (:class:`_CacheOfDTensors`)."""

    def local(v: Any) -> Any:
        if v is x:
            return x.to_local(grad_placements=grad_in)
        if isinstance(v, DTensor):
            return torch_internals.local_tensor(v)
        if isinstance(v, (tuple, list)) and any(isinstance(t, DTensor) for t in v):
            items = [local(t) for t in v]
            return type(v)(items) if isinstance(v, list) else tuple(items)
        return v

    args = tuple(local(a) for a in args)
    kwargs = {key: local(v) for key, v in kwargs.items()}
    heads = _heads(tuple(x.placements), k)
    for key in _CACHE_KEYS:
        if kwargs.get(key) is not None:
            kwargs[key] = _CacheOfDTensors(kwargs[key], mesh, heads)
    return args, kwargs


def _set_cache_mode(kwargs: dict, mode) -> None:
    for key in _CACHE_KEYS:
        if isinstance(kwargs.get(key), _CacheOfDTensors):
            kwargs[key].mode = mode


@contextlib.contextmanager
def _local_parameters(params: list[tuple], placements: tuple):
    """Within, each ``(owner, attr, dtensor)`` reads as its local tensor (gradient: the parameter's own placements, but
    partial where the input ``placements`` shard the batch), the plan's hooks stand aside and factory capture is
    paused (yielding the capture mode, for the cache). An instance attribute shadows the module's registered parameter
    (Python finds instance attributes before ``nn.Module.__getattr__`` looks in the parameters), so the module, its
    parameters and its state dict stay as they are; much cheaper than reparametrizing the module."""
    global _fast_depth
    sharded = {i for i, p in enumerate(placements) if isinstance(p, Shard)}
    shadowed = []
    grad = torch.is_grad_enabled()
    _fast_depth += 1
    try:
        for owner, attr, t in params:
            # without autograd (a decode step) no gradient placements matter: the stored shard, no autograd node
            vars(owner)[attr] = torch_internals.local_tensor(t) if not grad else t.to_local(grad_placements=[
                Partial() if i in sharded and isinstance(p, Replicate) else p for i, p in enumerate(t.placements)])
            shadowed.append((owner, attr))
        with capture_paused() as mode:
            yield mode
    finally:
        _fast_depth -= 1
        for owner, attr in shadowed:
            del vars(owner)[attr]


class _EnterGroup(torch.autograd.Function):
    """Megatron's ``f``: identity forward; backward all-reduces the gradient (each rank's part from its own heads or FFN
    columns) over the tensor-parallel group."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad, None


class _LeaveGroup(torch.autograd.Function):
    """Megatron's ``g``: all-reduces the row-parallel projection's partial sums; identity backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        out = x.contiguous().clone()
        torch.distributed.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


_CACHE_KEYS = ("past_key_values", "cache")  # the KV cache keyword (renamed in transformers 5)


class _CacheOfDTensors:
    """The KV cache as a fast block's ``forward`` sees it: ``update`` takes and returns this rank's heads as plain
    tensors, while the cache itself is updated with DTensors sharded on the head dim (under the model's factory
    capture), exactly as on the DTensor path, so a cache is the same object whichever path filled it."""

    def __init__(self, cache: Any, mesh, placements: tuple) -> None:
        self.cache, self.mesh, self.placements, self.mode = cache, mesh, placements, None

    def update(self, key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any):
        layer = self._growing_layer(args, kwargs, key, value)
        if layer is not None:
            # what ``DynamicLayer.update`` does (concatenate on the sequence dim, which no placement shards), on this
            # rank's heads; the layer then holds DTensors of the same placements, as the DTensor path leaves it.
            # No gradient flows here (checked), so they are built below autograd, their spec shared by the layers.
            keys = torch.cat([torch_internals.local_tensor(layer.keys), key], dim=-2)
            values = torch.cat([torch_internals.local_tensor(layer.values), value], dim=-2)
            layer.keys = from_local_nograd(keys, self.mesh, self.placements)
            layer.values = from_local_nograd(values, self.mesh, self.placements)
            return keys, values
        key = _FromLocal.apply(key, self.mesh, self.placements, self.placements)
        value = _FromLocal.apply(value, self.mesh, self.placements, self.placements)
        with capture_resumed(self.mode):
            key, value = self.cache.update(key, value, *args, **kwargs)
        return _to_local(key, self.placements), _to_local(value, self.placements)

    def _growing_layer(self, args: tuple, kwargs: dict, key: torch.Tensor, value: torch.Tensor) -> Any:
        """The cache layer ``update`` would grow, if it is exactly transformers' ``DynamicLayer`` of a cache without
        offloading, already holding DTensors of these placements, and no gradient flows through the update (a
        decode step): then the concatenation can run on local tensors. None otherwise."""
        idx = args[0] if args else kwargs.get("layer_idx")
        layers = getattr(self.cache, "layers", None)
        if not isinstance(idx, int) or not isinstance(layers, list) or not 0 <= idx < len(layers):
            return None
        layer = layers[idx]
        if (type(layer).__qualname__, type(layer).__module__) != ("DynamicLayer", "transformers.cache_utils") \
                or getattr(self.cache, "offloading", True) or not getattr(layer, "is_initialized", False):
            return None
        for t in (layer.keys, layer.values):
            if not (isinstance(t, DTensor) and t.device_mesh == self.mesh and tuple(t.placements) == self.placements
                    and t.ndim == key.ndim and t.numel() > 0):
                return None
        if torch.is_grad_enabled() and any(t.requires_grad for t in (key, value, layer.keys, layer.values)):
            return None
        return layer

    def __getattr__(self, name: str) -> Any:
        return getattr(self.cache, name)


def _arguments_apply(args: tuple, kwargs: dict, x: DTensor, mesh) -> bool:
    """Every tensor argument but the input ``x`` is a DTensor on ``mesh`` placed like ``x`` and needs no gradient (its
    local tensor is then what the rank computes with), and a KV cache, if any, has an ``update`` method."""
    placements = tuple(x.placements)
    for v in (*args, *kwargs.values()):
        for t in (v if isinstance(v, (tuple, list)) else (v,)):
            if not isinstance(t, torch.Tensor) or t is x:
                continue
            if t.requires_grad or not isinstance(t, DTensor) or t.device_mesh != mesh:
                return False
            if tuple(t.placements) != placements:
                return False
    for key in _CACHE_KEYS:
        cache = kwargs.get(key)
        if cache is not None and not callable(getattr(cache, "update", None)):
            return False
    return True


def _to_local(t: Any, placements: tuple) -> Any:
    if not isinstance(t, DTensor):
        return t
    if tuple(t.placements) != placements:
        t = t.redistribute(t.device_mesh, placements)
    return t.to_local()


class _FromLocal(torch.autograd.Function):
    """A local result as a DTensor of ``placements``; the gradient is taken as ``grad_placements`` (what the DTensor
    path's kernel receives there) and handed back as its local tensor."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, mesh, placements: tuple, grad_placements: tuple) -> DTensor:
        ctx.mesh, ctx.grad_placements = mesh, grad_placements
        return DTensor.from_local(x, mesh, placements, run_check=False)

    @staticmethod
    def backward(ctx, grad):
        return _local_grad(grad, ctx.mesh, ctx.grad_placements), None, None, None


def _local_grad(grad: Any, mesh, placements: tuple) -> torch.Tensor:
    """This rank's local piece of ``grad`` laid out as ``placements`` (a DTensor gradient redistributed there first
    if it arrives otherwise; a plain gradient is already local)."""
    if isinstance(grad, DTensor):
        if tuple(grad.placements) != placements:
            grad = grad.redistribute(mesh, placements)
        grad = torch_internals.local_tensor(grad)
    return grad


def _batch_or_replicated(placements, k: int) -> bool:
    """Replicated on mesh dim ``k``, and replicated or batch-sharded (``Shard(0)``, rows computed independently) on
    every other: a sequence-sharded input (context parallelism) needs attention across ranks, which only the DTensor
    path does."""
    return isinstance(placements[k], Replicate) and all(
        type(p) is Replicate or (type(p) is Shard and p.dim == 0) for p in placements)


def _only_shard_on(placements, dim: int) -> int | None:
    """The mesh dim on which ``placements`` is exactly ``Shard(dim)`` when every other mesh dim replicates, else
    None."""
    found = [i for i, p in enumerate(placements) if type(p) is Shard and p.dim == dim]
    rest = [p for i, p in enumerate(placements) if i not in found]
    if len(found) != 1 or not all(isinstance(p, Replicate) for p in rest):
        return None
    return found[0]


def fast_block(module: nn.Module, mesh, input_spec, row_output_spec, entries_inside: bool, finish) -> bool:
    """Install :class:`FastBlock` on ``module`` if its class and the plan qualify (see there); return whether it did.

    ``input_spec`` is the block's ``input`` entry (None: none), ``row_output_spec`` the row-parallel projection's
    ``output`` entry (None: none), ``entries_inside`` whether any other plan entry names the block or a module inside
    it; ``finish(partial_dtensor)`` applies the projection's output entry. Static checks only, no collective.
    """
    known = FAST_BLOCKS.get((type(module).__module__, type(module).__qualname__))
    if known is None or entries_inside or row_output_spec is None or input_spec is None or "forward" in vars(module):
        return False
    kind, cols, row = known
    children = dict(module.named_children())
    if set(children) - {*cols, row, "act_fn"}:
        return False
    linears = [children.get(n) for n in (*cols, row)]
    if not all(type(lin) is nn.Linear and isinstance(lin.weight, DTensor) and lin.weight.device_mesh == mesh
               for lin in linears):
        return False
    if any(list(m.parameters()) for m in [children.get("act_fn")] if m is not None):
        return False
    ks = {_only_shard_on(lin.weight.placements, 0) for lin in linears[:-1]}
    k = _only_shard_on(linears[-1].weight.placements, 1)
    if ks != {k} or k is None or linears[-1].bias is not None:
        return False
    for lin in linears[:-1]:
        if lin.bias is not None and _only_shard_on(lin.bias.placements, 0) != k:
            return False
    n = mesh.size(k)
    if kind == "attention":
        cfg = module.config
        if cfg.num_attention_heads % n or cfg.num_key_value_heads % n:
            return False
    x_spec = input_spec.get("hidden_states" if kind == "attention" else "x") if isinstance(input_spec, Mapping) \
        else (input_spec[0] if len(input_spec) else None)
    if x_spec is None or not _batch_or_replicated(x_spec, k):
        return False
    params = [(name, attr, tuple(getattr(lin, attr).placements)) for name, lin in zip((*cols, row), linears)
              for attr in ("weight", "bias") if getattr(lin, attr) is not None]
    if len(params) != len(list(module.parameters())):
        return False  # a parameter outside the projections (the activation has none: checked)
    row = row_output_spec[0] if isinstance(row_output_spec, (list, tuple)) and len(row_output_spec) == 1 else None
    module.forward = FastBlock(module, module.forward, mesh, k, kind, params, finish,
                               tuple(row) if isinstance(row, (list, tuple)) else None)
    return True


def fast_layer(module: nn.Module, mesh, entries_at: bool) -> bool:
    """Install :class:`FastLayer` on ``module`` if its class qualifies and both its blocks run :class:`FastBlock` on
    the same mesh dim with replicated outputs (see there); return whether it did. ``entries_at`` says whether a plan
    entry names the layer itself or one of its norms. Static checks only, no collective."""
    known = FAST_LAYERS.get((type(module).__module__, type(module).__qualname__))
    if known is None or entries_at or "forward" in vars(module):
        return False
    norm1, attn, norm2, mlp = known
    children = dict(module.named_children())
    if set(children) != {norm1, attn, norm2, mlp}:
        return False
    blocks = tuple(getattr(children[name], "forward", None) for name in (attn, mlp))
    if not all(isinstance(b, FastBlock) and b.mesh == mesh for b in blocks) or blocks[0].k != blocks[1].k:
        return False
    k = blocks[0].k
    if not all(b.row_placements is not None and isinstance(b.row_placements[k], Replicate) for b in blocks):
        return False
    norms = []
    for name in (norm1, norm2):
        norm = children[name]
        state = [*norm.named_parameters(), *norm.named_buffers()]
        if [n for n, _ in state] != ["weight"] or list(norm.children()) or "forward" in vars(norm):
            return False
        w = norm.weight
        if not (isinstance(w, DTensor) and w.device_mesh == mesh and all(type(p) is Replicate for p in w.placements)):
            return False
        norms.append((name, "weight", tuple(w.placements)))
    module.forward = FastLayer(module, module.forward, mesh, k, blocks, norms)
    return True


# ---------------------------------------------------------------------------------------------------------------
# The whole causal LM on local tensors: one boundary in (the token ids), one out (the logits)
# ---------------------------------------------------------------------------------------------------------------

#: Causal LMs (exact type) whose ``forward`` is ``lm_head(model(...).last_hidden_state[keep])`` (plus a loss when given
#: labels), over a decoder model (exact type, the value) that embeds the tokens, builds the masks and the rotary
#: embedding, runs its layers and a final RMSNorm.
FAST_MODELS: dict[tuple[str, str], str] = {}
for _family, _name in (("llama", "Llama"), ("qwen2", "Qwen2"), ("mistral", "Mistral")):
    FAST_MODELS[(f"transformers.models.{_family}.modeling_{_family}", f"{_name}ForCausalLM")] = f"{_name}Model"
del _family, _name
_MODEL_CHILDREN = {"embed_tokens", "layers", "norm", "rotary_emb"}


class FastModel:
    """A causal LM (:data:`FAST_MODELS`) whose every decoder layer is a :class:`FastLayer`, run whole on local tensors
    as Megatron runs it: the token ids' local tensor goes in (checked against the vocabulary first:
    :func:`~vescale.parallel.model_calls.check_token_ids` raises ``TokenIdError`` on every rank where one device
    raises ``IndexError``), the vocab-parallel embedding looks up this rank's rows (ids outside them read zeros) and
    all-reduces, the rotary embedding, the masks and every layer compute on this
    rank's replicated activation, the final norm too, and the column-parallel lm head (identity forward / all-reduce
    backward on entry) gives this rank's vocabulary columns, wrapped as a DTensor with the lm head's ``output`` entry
    placements. The root's own boundaries (its ``input`` and ``output`` entries, the plain tensors it returns) apply
    around it unchanged; the KV cache holds head-sharded DTensors as on the DTensor path (see
    :class:`_CacheOfDTensors`). Where the model's own ``output`` entry gives ``logits`` exactly those placements with
    the vocabulary replicated on ``k`` (the plans' default, full logits), the columns are all-gathered here instead,
    in one collective as Megatron gathers them (:class:`_GatherVocab`), and the entry then finds them in place: the
    values and placements the entry's redistribution gives, without DTensor's redistribute machinery.

    Built by :func:`fast_model` only when every layer is a :class:`FastLayer` on one mesh dim ``k`` (their placements
    ``P``), the embedding is an ``nn.Embedding`` sharded ``Shard(0)`` on ``k`` (replicated elsewhere, rows dividing
    evenly, no ``max_norm``/``sparse``/``scale_grad_by_freq``) whose ``output`` entry is ``[P]``, the lm head an
    ``nn.Linear`` without bias sharded ``Shard(0)`` on ``k`` whose ``input`` entry is ``[P]`` (or none) and ``output``
    entry ``P`` with the vocabulary dim sharded on ``k`` (or none), the final norm an RMSNorm with one replicated
    weight, the rotary embedding static (not ``dynamic``/``longrope``), and no other plan entry names the decoder
    model or its embedding's input, norm, rotary embedding or layer list. Per call it checks what every layer checks,
    plus: keyword arguments with ``input_ids`` a DTensor placed ``P`` (not ``inputs_embeds``), no ``labels`` (the
    loss wants the full
    vocabulary), no attentions or hidden states asked for, an integer ``logits_to_keep``, every other tensor argument a
    DTensor placed ``P`` without gradient, every layer still its :class:`FastLayer` (not checkpointed, not compiled);
    otherwise the model's own ``forward`` runs and its layers decide for themselves.

    Forward values are bitwise those of the DTensor path (the same local kernels and collectives); gradients agree to
    rounding (see :class:`FastLayer`).
    """

    def __init__(self, module: nn.Module, orig, mesh, k: int, layers: list, entries: list[tuple],
                 buffers: list[tuple], placements: tuple, logits_placements: tuple, cache_class: type,
                 gathered_placements: tuple | None = None) -> None:
        self.module, self.orig, self.mesh, self.k = module, orig, mesh, k
        self.layers, self.entries, self.buffers, self.cache_class = layers, entries, buffers, cache_class
        self.placements, self.logits_placements = placements, logits_placements
        self.gathered_placements = gathered_placements  # the own output entry's logits placements, if gathered here
        # generate() reads the forward's signature to decide what to pass (attention_mask, logits_to_keep, ...)
        self.__signature__ = inspect.signature(orig)
        embed = module.model.embed_tokens
        rows = embed.weight.shape[0] // mesh.size(k)
        self.offset = mesh.get_local_rank(k) * rows
        pad = embed.padding_idx
        self.padding_idx = pad - self.offset if pad is not None and 0 <= pad - self.offset < rows else None
        self.local_calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling() or _layer_group is not None or not self._applies(args, kwargs):
            return self.orig(*args, **kwargs)
        params, buffers = self._params(), self._current_buffers()
        if params is None or buffers is None:
            return self.orig(*args, **kwargs)
        return self._run_local(kwargs, params, buffers)

    def _applies(self, args: tuple, kwargs: dict) -> bool:
        from vescale.dtensor.strict import is_strict

        if args or not _fast_enabled or is_strict():
            return False
        m = self.module
        for layer, fast in self.layers:
            if vars(layer).get("forward") is not fast or torch_internals.compiled_call(layer) is not None \
                    or getattr(layer, "gradient_checkpointing", False) or not all(
                        b._module_applies() for b in fast.blocks):
                return False
        if getattr(m.model, "gradient_checkpointing", False) or torch_internals.compiled_call(m.model) is not None:
            return False
        ids = kwargs.get("input_ids")
        if not isinstance(ids, DTensor) or ids.device_mesh != self.mesh or tuple(ids.placements) != self.placements:
            return False
        if kwargs.get("inputs_embeds") is not None or kwargs.get("labels") is not None \
                or not isinstance(kwargs.get("logits_to_keep", 0), int):
            return False
        for flag, default in (("output_attentions", False), ("output_hidden_states", False), ("return_dict", True)):
            value = kwargs.get(flag)
            if (getattr(m.config, flag, default) if value is None else value) != default:
                return False
        for key, v in kwargs.items():
            if key in _CACHE_KEYS:
                if v is not None and not callable(getattr(v, "update", None)):
                    return False
                continue
            for t in (v.values() if isinstance(v, dict) else v if isinstance(v, (tuple, list)) else (v,)):
                if isinstance(t, torch.Tensor) and (not isinstance(t, DTensor) or t.device_mesh != self.mesh
                                                    or tuple(t.placements) != self.placements or t.requires_grad):
                    return False
        return True

    def _params(self) -> list[tuple] | None:
        """``(owner, attr, dtensor)`` of every parameter now, or None if one is no longer a DTensor on the mesh with
        the placements checked at installation (replaced since, e.g. by ZeRO 3)."""
        found = []
        for owner, attr, placements in self.entries:
            t = getattr(owner, attr)
            if not isinstance(t, DTensor) or t.device_mesh != self.mesh or tuple(t.placements) != placements:
                return None
            found.append((owner, attr, t))
        for _, fast in self.layers:
            got = fast._params()
            if got is None:
                return None
            found += got
        return found

    def _current_buffers(self) -> list[tuple] | None:
        """``(owner, attr, dtensor)`` of the rotary embedding's buffers now (``module.to()`` replaces them), or None if
        one is no longer a replicated DTensor on the mesh."""
        found = []
        for owner, attr in self.buffers:
            t = getattr(owner, attr)
            if not (isinstance(t, DTensor) and t.device_mesh == self.mesh
                    and all(type(p) is Replicate for p in t.placements)):
                return None
            found.append((owner, attr, t))
        return found

    def _run_local(self, kwargs: dict, params: list[tuple], buffers: list[tuple]) -> Any:
        global _layer_group
        m = self.module
        heads = _heads(self.placements, self.k)
        kwargs = {key: _local_value(v) for key, v in kwargs.items()}
        ids = kwargs.pop("input_ids")
        kwargs.pop("inputs_embeds", None)  # None (checked): the embeddings computed here take its place
        embed = m.model.embed_tokens
        # before any collective: an id outside the vocabulary would read zeros below (replicated on k, so no
        # collective there; batch-sharded dims agree with one all-reduce of two numbers)
        check_token_ids(ids, embed.weight.shape[0], embedding_name(embed.weight),
                        [self.mesh.get_group(i) for i, p in enumerate(self.placements) if not p.is_replicate()])
        cache_key = next((key for key in _CACHE_KEYS if key in kwargs), "cache")
        cache = kwargs.get(cache_key)
        use_cache = kwargs.get("use_cache")
        if cache is None and (use_cache if use_cache is not None else getattr(m.model.config, "use_cache", False)):
            # what the decoder model creates itself then (under the root's factory capture, as there)
            cache = kwargs[cache_key] = self.cache_class(config=m.model.config)
        if cache is not None:
            kwargs[cache_key] = _CacheOfDTensors(cache, self.mesh, heads)
        self.local_calls += 1
        head = m.lm_head
        group = self.mesh.get_group(self.k)
        before, _layer_group = _layer_group, group
        try:
            with _local_parameters(params, self.placements) as mode, _local_buffers(buffers):
                if cache is not None:
                    kwargs[cache_key].mode = mode
                embeds = _VocabLookup.apply(ids, embed.weight, self.offset, self.padding_idx, group)
                vars(head)["forward"] = functools.partial(_column_head, head=head, group=group)
                try:
                    out = self.orig(inputs_embeds=embeds, **kwargs)
                finally:
                    del vars(head)["forward"]
        finally:
            _layer_group = before
        for key in _CACHE_KEYS:
            if isinstance(out.get(key), _CacheOfDTensors):
                out[key] = out[key].cache
        logits = out["logits"]
        if self.gathered_placements is not None:
            out["logits"] = _gather_vocab(logits, self.mesh, self.k, self.gathered_placements)
        elif logits.requires_grad:
            out["logits"] = _FromLocal.apply(logits, self.mesh, self.logits_placements, self.logits_placements)
        else:
            out["logits"] = from_local_nograd(logits, self.mesh, self.logits_placements)
        return out


def _local_value(v: Any) -> Any:
    """A call argument with its (checked: gradient-free) DTensors as their local tensors."""
    if isinstance(v, DTensor):
        return torch_internals.local_tensor(v)
    if isinstance(v, dict) and any(isinstance(t, DTensor) for t in v.values()):
        return {key: _local_value(t) for key, t in v.items()}
    if isinstance(v, (tuple, list)) and any(isinstance(t, DTensor) for t in v):
        items = [_local_value(t) for t in v]
        return type(v)(items) if isinstance(v, list) else tuple(items)
    return v


def _dynamic_cache_class(decoder: nn.Module) -> Any:
    """``DynamicCache`` as the decoder model's module names it (vescale does not import transformers), or None."""
    import sys

    return getattr(sys.modules.get(type(decoder).__module__), "DynamicCache", None)


@contextlib.contextmanager
def _local_buffers(buffers: list[tuple]):
    """Within, each ``(owner, attr, dtensor)`` buffer (replicated, no gradient) reads as its local tensor."""
    for owner, attr, t in buffers:
        vars(owner)[attr] = torch_internals.local_tensor(t)
    try:
        yield
    finally:
        for owner, attr, _ in buffers:
            vars(owner).pop(attr, None)


def _column_head(x: torch.Tensor, *, head: nn.Module, group) -> torch.Tensor:
    """The lm head on this rank's vocabulary rows (Megatron's column-parallel linear; the weight is local here)."""
    return torch.nn.functional.linear(_EnterGroup.apply(x, group), head.weight)


def _all_gather_last(x: torch.Tensor, mesh, k: int) -> torch.Tensor:
    """``x`` of every rank of mesh dim ``k``, concatenated in rank order on the last dim (one all-gather)."""
    n = mesh.size(k)
    x = x.contiguous()
    out = x.new_empty((n * x.shape[0], *x.shape[1:]))
    torch.distributed.all_gather_single(out, x, group=mesh.get_group(k))
    return out.view(n, *x.shape).movedim(0, -2).reshape(*x.shape[:-1], n * x.shape[-1])


def _gather_vocab(x: torch.Tensor, mesh, k: int, placements: tuple) -> DTensor:
    """The lm head's local vocabulary columns ``x`` gathered over mesh dim ``k``, as a DTensor of ``placements``
    (replicated on ``k``); through :class:`_GatherVocab` when ``x`` takes a gradient."""
    if x.requires_grad and torch.is_grad_enabled():
        return _GatherVocab.apply(x, mesh, k, placements)
    return from_local_nograd(_all_gather_last(x, mesh, k), mesh, placements)


class _GatherVocab(torch.autograd.Function):
    """Megatron's gather of a column-parallel output: forward all-gathers the columns (see :func:`_gather_vocab`);
    backward hands this rank its columns of the gradient (brought to ``placements`` first if it comes otherwise),
    what the DTensor path's ``Shard`` -> ``Replicate`` redistribution hands back."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, mesh, k: int, placements: tuple) -> DTensor:
        ctx.mesh, ctx.k, ctx.placements, ctx.cols = mesh, k, placements, x.shape[-1]
        return from_local_nograd(_all_gather_last(x.detach(), mesh, k), mesh, placements)

    @staticmethod
    def backward(ctx, grad):
        grad = _local_grad(grad, ctx.mesh, ctx.placements)
        start = ctx.mesh.get_local_rank(ctx.k) * ctx.cols
        return grad.narrow(-1, start, ctx.cols).contiguous(), None, None, None


class _VocabLookup(torch.autograd.Function):
    """Megatron's vocab-parallel embedding: this rank's rows looked up (ids outside them read zeros), all-reduced over
    the tp group; backward: each rank's rows get the (replicated) gradient of the positions whose ids they hold."""

    @staticmethod
    def forward(ctx, ids: torch.Tensor, weight: torch.Tensor, offset: int, padding_idx, group) -> torch.Tensor:
        local = ids - offset
        outside = (local < 0) | (local >= weight.shape[0])
        local = local.masked_fill(outside, 0)
        out = torch.nn.functional.embedding(local, weight).masked_fill(outside.unsqueeze(-1), 0.0)
        torch.distributed.all_reduce(out, group=group)
        ctx.save_for_backward(local, outside)
        ctx.rows, ctx.padding_idx = weight.shape[0], padding_idx
        return out

    @staticmethod
    def backward(ctx, grad):
        local, outside = ctx.saved_tensors
        grad = grad.masked_fill(outside.unsqueeze(-1), 0.0)
        dweight = torch.ops.aten.embedding_dense_backward(grad, local, ctx.rows,
                                                          -1 if ctx.padding_idx is None else ctx.padding_idx, False)
        return None, dweight, None, None, None


def fast_model(module: nn.Module, mesh, inputs: dict, outputs: dict, named: list[str], own_output: Any = None) -> bool:
    """Install :class:`FastModel` on ``module`` if its class, its layers and the plan qualify (see there); return
    whether it did. ``inputs``/``outputs`` map the module's own descendants' relative FQNs to their entries' specs,
    ``named`` lists every relative FQN a plan entry names, ``own_output`` is the module's own ``output`` entry (None:
    none). Static checks only, no collective."""
    decoder_class = FAST_MODELS.get((type(module).__module__, type(module).__qualname__))
    if decoder_class is None or "forward" in vars(module):
        return False
    children = dict(module.named_children())
    decoder, head = children.get("model"), children.get("lm_head")
    if set(children) != {"model", "lm_head"} or type(decoder).__qualname__ != decoder_class \
            or type(decoder).__module__ != type(module).__module__ \
            or set(dict(decoder.named_children())) != _MODEL_CHILDREN:
        return False
    fixed = {"model", "model.norm", "model.rotary_emb", "model.layers"}
    if any(n in fixed or n.startswith(("model.norm.", "model.rotary_emb.", "model.embed_tokens.", "lm_head."))
           for n in named) or "model.embed_tokens" in inputs or "forward" in vars(decoder):
        return False
    layers = [(layer, vars(layer).get("forward")) for layer in decoder.layers]
    if not layers or not all(isinstance(f, FastLayer) and f.mesh == mesh for _, f in layers):
        return False
    k = layers[0][1].k
    placements = layers[0][1].blocks[0].row_placements
    if any(f.k != k or any(b.row_placements != placements for b in f.blocks) for _, f in layers):
        return False
    embed, norm, rotary = decoder.embed_tokens, decoder.norm, decoder.rotary_emb
    vocab_rows = tuple(Shard(0) if i == k else Replicate() for i in range(mesh.ndim))
    if getattr(vars(embed).get("forward"), "func", None) is _local_forward:
        return False  # a ``local`` entry: the plan wants that module's own forward
    if not (type(embed) is nn.Embedding and isinstance(embed.weight, DTensor) and embed.weight.device_mesh == mesh
            and tuple(embed.weight.placements) == vocab_rows and embed.weight.shape[0] % mesh.size(k) == 0
            and embed.max_norm is None and not embed.sparse and not embed.scale_grad_by_freq
            and not [n for n, _ in embed.named_buffers()] and list(embed.parameters()) == [embed.weight]):
        return False
    if not (type(head) is nn.Linear and head.bias is None and isinstance(head.weight, DTensor)
            and head.weight.device_mesh == mesh and tuple(head.weight.placements) == vocab_rows
            and "forward" not in vars(head)):
        return False
    if not _same_spec(outputs.get("model.embed_tokens"), placements) or \
            ("lm_head" in inputs and not _same_spec(inputs["lm_head"], placements)):
        return False
    logits = tuple(Shard(2) if i == k else p for i, p in enumerate(placements))
    if "lm_head" in outputs:
        spec = outputs["lm_head"]
        if not (isinstance(spec, (list, tuple)) and len(spec) == 1 and isinstance(spec[0], (list, tuple))
                and len(spec[0]) == mesh.ndim and all(
                    (type(p) is Shard and p.dim in (-1, 2)) if i == k else p == placements[i]
                    for i, p in enumerate(spec[0]))):
            return False
    state = [*norm.named_parameters(), *norm.named_buffers()]
    if [n for n, _ in state] != ["weight"] or list(norm.children()) or "forward" in vars(norm) \
            or not (isinstance(norm.weight, DTensor) and norm.weight.device_mesh == mesh
                    and all(type(p) is Replicate for p in norm.weight.placements)):
        return False
    rope = getattr(rotary, "rope_type", None)
    if not isinstance(rope, str) or "dynamic" in rope or rope == "longrope" or list(rotary.parameters()) \
            or list(rotary.children()) or "forward" in vars(rotary):
        return False
    buffers = []
    for name, buf in rotary.named_buffers():
        if not (isinstance(buf, DTensor) and buf.device_mesh == mesh
                and all(type(p) is Replicate for p in buf.placements)):
            return False
        buffers.append((rotary, name))
    cache_class = _dynamic_cache_class(decoder)
    if cache_class is None:
        return False
    entries = [(owner, "weight", tuple(owner.weight.placements)) for owner in (embed, norm, head)]
    n_layer_params = sum(len(f.norms) + sum(len(b.params) for b in f.blocks) for _, f in layers)
    if len(entries) + n_layer_params != len(list(module.parameters())):
        return False  # a parameter elsewhere (tied embeddings count once: refused, the lm head would be local twice)
    # the model's own output entry asks for the logits with the vocabulary replicated on k: gathered in FastModel
    gathered = tuple(Replicate() if i == k else p for i, p in enumerate(logits))
    own = own_output.get("logits") if isinstance(own_output, Mapping) else None
    gather = isinstance(own, (list, tuple)) and tuple(own) == gathered
    module.forward = FastModel(module, module.forward, mesh, k, layers, entries, buffers, placements, logits,
                               cache_class, gathered if gather else None)
    return True


def _same_spec(spec: Any, placements: tuple) -> bool:
    """Whether a one-argument/one-output plan entry gives exactly ``placements``."""
    return (isinstance(spec, (list, tuple)) and len(spec) == 1 and isinstance(spec[0], (list, tuple))
            and tuple(spec[0]) == tuple(placements))
