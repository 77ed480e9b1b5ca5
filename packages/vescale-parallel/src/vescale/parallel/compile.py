"""Compile mode: ``torch.compile`` the repeated blocks of a vescale-parallelized model, in place.

:func:`compile_parallel` compiles each transformer block (every child of the model's ``nn.ModuleList`` of layers, or
the modules a regex names) with :meth:`nn.Module.compile`, which keeps every FQN, ``state_dict`` key and parameter
object. Inside a block, everything vescale installs compiles into one graph per block: DTensor ops, the plan's
``input``/``output`` redistributions (and their Megatron-style backward), and tensors captured by
:class:`~vescale.parallel.factory.FactoryCapture` (the causal mask built in a block). ``fullgraph=True`` is the
default, so a graph break inside a block is an error, not a silent slowdown.

Whole-model compile also works: ``torch.compile(model, fullgraph=True)`` or ``model.compile(fullgraph=True)`` of a
model parallelized by :func:`~vescale.parallel.parallelize_module` traces the root's boundary hooks, the factory
capture they enter (dynamo traces the mode; :class:`~vescale.parallel.factory.FactoryCapture` leaves the code that
AOT autograd and the compiled graph really run alone, so nothing is converted twice) and the vocab-parallel embedding
(:func:`install_compilable_embeddings`: a Megatron-style masked local lookup while dynamo traces, because torch's
``_MaskPartial`` keeps its mask in mutable placement state that dynamo loses), with no graph break. Use
``fullgraph=True``: without it a backend failure (DTensor's strided-shard backward needs concrete indices) silently
becomes a graph break and that frame runs eagerly (still correct, but slow).

What stays eager: the loss when called outside the model, gradient hooks (DDP buckets, ``param.grad``
redistribution) and the optimizer, which run once per step and are not on the hot path; ``local`` modules of the
plan (data-dependent MoE dispatch), which are skipped if they are blocks.

Dropout inside a block is refused in training mode (:class:`CompileError`): vescale's counter-based RNG makes
eager dropout masks bit-equal to the single-device run; compiled RNG would draw different masks.
"""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from vescale.core import torch_internals
from vescale.core.blocks import find_blocks
from vescale.dtensor.layout import contiguous_stride, smallest_shard
from vescale.parallel.errors import CompileError, TokenIdError
from vescale.parallel.factory import compiled_region
from vescale.parallel.local import is_local
from vescale.parallel.vocab_embedding import lookup_rows

__all__ = ["compile_parallel", "compile_forward", "compiled_blocks", "block_graph_breaks",
           "install_compilable_embeddings"]


def compile_parallel(module: nn.Module, *, blocks: str | None = None, backend: str | Callable = "inductor",
                     fullgraph: bool = True, dynamic: bool | None = False, mode: str | None = None,
                     options: dict | None = None) -> nn.Module:
    """Compile each block of ``module`` in place and return ``module`` (see the module docstring for what stays eager).

    ``blocks``: a regex (full match) over module FQNs naming the blocks; default: the children of the largest
    ``nn.ModuleList`` (``model.layers``, ``transformer.h``, ...). Works on a module parallelized by
    :func:`~vescale.parallel.parallelize_module`; call it before wrapping the model in DDP (tested with TP/SP and with
    a dp x tp mesh); for a graph-captured pipeline stage use :func:`compile_forward`. Raises :class:`CompileError`,
    naming the FQN, when no block matches or a block has active dropout (``p > 0`` and ``training``); the check is
    local, identical on every rank, and issues no collective.
    """
    if not isinstance(module, nn.Module):
        raise CompileError(f"compile_parallel expects an nn.Module, got {type(module).__name__}")
    if fullgraph is not True and fullgraph is not False:
        raise CompileError(f"fullgraph must be a bool, got {fullgraph!r}")
    found = _find_blocks(module, blocks)
    for fqn, block in found:
        _check_no_dropout(fqn, block)
    compiled = []
    for fqn, block in found:
        if is_local(block):
            continue  # a .local module (data dependent): stays eager
        block.compile(backend=backend, fullgraph=fullgraph, dynamic=dynamic, mode=mode, options=options)
        torch_internals.set_compiled_call(block, functools.partial(_run_compiled, torch_internals.compiled_call(block)))
        compiled.append(fqn)
    module._vescale_compiled_blocks = compiled
    return module


def compile_forward(module: nn.Module, *, backend: str | Callable = "inductor", fullgraph: bool = True,
                    dynamic: bool | None = False, mode: str | None = None, options: dict | None = None) -> nn.Module:
    """Compile ``module.forward`` (not its hooks) in place and return ``module``: for a graph-captured pipeline stage.

    A stage from :func:`vescale.pipe.split` is one flat graph with no blocks; its vescale root hooks (boundary
    conversion, factory capture) keep running eagerly around the compiled ``forward``, which runs inside
    :func:`~vescale.parallel.factory.compiled_region` (its aten factories were captured when dynamo traced it).
    ``fullgraph=True`` (the default) is required for a tensor-parallel stage: with ``False``, a backend failure
    (DTensor's strided-shard backward needs concrete indices under fake tensors) becomes a graph break whose eager
    remainder runs inside the compiled region without factory capture, and DTensor raises on mixed tensors.
    """
    if not isinstance(module, nn.Module):
        raise CompileError(f"compile_forward expects an nn.Module, got {type(module).__name__}")
    _check_no_dropout(type(module).__name__, module)
    compiled = torch.compile(module.forward, backend=backend, fullgraph=fullgraph, dynamic=dynamic, mode=mode,
                             options=options)
    module.forward = functools.partial(_run_compiled, compiled)
    module._vescale_compiled_blocks = [""]
    return module


def compiled_blocks(module: nn.Module) -> list[str]:
    """FQNs of the blocks :func:`compile_parallel` compiled in ``module`` (empty if it was not called)."""
    return list(getattr(module, "_vescale_compiled_blocks", []))


def block_graph_breaks(module: nn.Module, *args: Any, blocks: str | None = None, **kwargs: Any) -> dict[str, dict]:
    """Run ``module(*args, **kwargs)`` once and ``torch._dynamo.explain`` each block on the inputs it received.

    Returns ``{block_fqn: {"graphs": n, "graph_breaks": n, "reasons": [str, ...]}}``. The explain runs on the
    block's *uncompiled* forward (with its vescale hooks), under the model's factory capture, with grad disabled;
    use it before or after :func:`compile_parallel` to see whether a block compiles as one graph.
    """
    from vescale.parallel.factory import FactoryCapture

    found = _find_blocks(module, blocks)
    seen: dict[str, tuple] = {}

    def grab(fqn: str, mod: nn.Module, a: tuple, kw: dict) -> None:
        seen.setdefault(fqn, (a, kw))

    handles = [b.register_forward_pre_hook(functools.partial(grab, fqn), with_kwargs=True) for fqn, b in found]
    try:
        with torch.no_grad():
            module(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    mesh = next((p.device_mesh for p in module.parameters() if isinstance(p, DTensor)), None)
    result: dict[str, dict] = {}
    for fqn, block in found:
        if fqn not in seen:
            raise CompileError(f"block {fqn!r} was not called by the forward; cannot explain it")
        a, kw = seen[fqn]
        with torch.no_grad(), (FactoryCapture(mesh) if mesh is not None else contextlib.nullcontext()), \
                compiled_region():
            torch.compiler.reset()
            ex = torch_internals.dynamo_explain(functools.partial(_call_uncompiled, block))(*a, **kw)
        result[fqn] = {"graphs": ex.graph_count, "graph_breaks": ex.graph_break_count,
                       "reasons": [str(r.reason) for r in ex.break_reasons]}
    return result


def install_compilable_embeddings(module: nn.Module) -> list[str]:
    """Give every vocab-parallel ``nn.Embedding`` of ``module`` a lookup dynamo can trace; return their FQNs.

    A vocab-parallel embedding has a DTensor weight ``Shard(0)`` on exactly one mesh dim and ``Replicate`` on the
    others (``parallelize_module`` calls this after distributing the parameters). Eagerly its ``forward`` is
    unchanged (torch's ``_MaskPartial`` lookup). While dynamo traces it, it looks up this rank's vocabulary rows
    Megatron-style instead: ids outside the slice read row 0 and are zeroed, and the result is a plain ``Partial``
    sum over the vocab dim, which the embedding's ``output`` entry then reduces (the same collective). Modules that
    override ``forward`` or use ``max_norm``/``sparse``/``scale_grad_by_freq`` keep torch's lookup.
    """
    found = []
    for fqn, mod in module.named_modules():
        if type(mod).forward is not nn.Embedding.forward or "forward" in mod.__dict__:
            continue
        if mod.max_norm is not None or mod.sparse or mod.scale_grad_by_freq:
            continue
        weight = mod.weight
        if not isinstance(weight, DTensor):
            continue
        places = list(weight.placements)
        vdims = [i for i, p in enumerate(places) if isinstance(p, Shard) and p.dim in (0, -2) and type(p) is Shard]
        if len(vdims) != 1 or any(not isinstance(p, Replicate) for i, p in enumerate(places) if i != vdims[0]):
            continue
        vdim = vdims[0]
        mesh = weight.device_mesh
        n, coord = mesh.size(vdim), mesh.get_local_rank(vdim)
        if smallest_shard(weight.shape[0], n) == 0:
            continue  # some rank holds no rows: keep torch's lookup
        offset = min(coord * -(-weight.shape[0] // n), weight.shape[0])  # Shard's pieces: ceil(rows / n) each
        mod.forward = functools.partial(_embedding_forward, module=mod, vdim=vdim, offset=offset, fqn=fqn)
        found.append(fqn)
    return found


def _embedding_forward(ids: Any, *, module: nn.Embedding, vdim: int, offset: int, fqn: str = "") -> Any:
    if not (torch.compiler.is_compiling() and isinstance(ids, DTensor)):
        return nn.Embedding.forward(module, ids)  # (eager: the root's model-call corrections check the ids)
    weight = module.weight
    mesh = weight.device_mesh
    places = list(ids.placements)
    want = [Replicate() if i == vdim or isinstance(p, Partial) else p for i, p in enumerate(places)]
    if want != places:
        ids = ids.redistribute(mesh, want)
    w, idx = weight.to_local(), _checked_ids(ids.to_local(), mesh, want, weight.shape[0], repr(fqn))
    out = lookup_rows(idx, w, offset, module.padding_idx)  # this rank's rows: a partial sum over the vocab dim
    shape = (*ids.shape, weight.shape[1])
    return DTensor.from_local(out, mesh, [Partial() if i == vdim else p for i, p in enumerate(want)],
                              run_check=False, shape=torch.Size(shape), stride=contiguous_stride(shape))


def _checked_ids(ids: torch.Tensor, mesh, placements: list, vocab_size: int, name: str) -> torch.Tensor:
    """``ids`` (this rank's local token ids, laid out ``placements`` on ``mesh``) after the check of
    :func:`~vescale.parallel.model_calls.check_token_ids`, written so that dynamo traces it: the smallest and largest
    id are reduced (functional all-reduce MAX) over the mesh dims where the ids are sharded, and an opaque operator
    (``vescale::checked_token_ids``, which the graph keeps because the lookup reads its output) raises
    :class:`~vescale.parallel.errors.TokenIdError` on every rank alike when one is outside the vocabulary."""
    from vescale.core.torch_internals import traceable_all_reduce

    if ids.numel() == 0:
        stats = ids.new_full((2,), -(2 ** 62), dtype=torch.int64)  # (a Tensor method: factory capture skips it)
    else:
        lo, hi = torch.aminmax(ids.to(torch.int64))
        stats = torch.stack([-lo.clamp(min=-(2 ** 62)), hi])
    for i, p in enumerate(placements):
        if not p.is_replicate():
            stats = traceable_all_reduce(stats, "max", (mesh, i))
    return torch.ops.vescale.checked_token_ids(ids, stats, vocab_size, name)


@torch.library.custom_op("vescale::checked_token_ids", mutates_args=())
def _checked_token_ids(ids: torch.Tensor, stats: torch.Tensor, vocab_size: int, name: str) -> torch.Tensor:
    """A copy of ``ids``; raises :class:`~vescale.parallel.errors.TokenIdError` when ``stats`` (the negated smallest
    and the largest id of the whole batch) fall outside ``[0, vocab_size)``."""
    from vescale.parallel.model_calls import _token_id_message

    neg_lo, hi = stats.tolist()
    if -neg_lo < 0 or hi >= vocab_size:
        raise TokenIdError(_token_id_message(-neg_lo, hi, vocab_size, name))
    return ids.clone()


@_checked_token_ids.register_fake
def _(ids: torch.Tensor, stats: torch.Tensor, vocab_size: int, name: str) -> torch.Tensor:
    return torch.empty_like(ids)


def _run_compiled(compiled: Callable, *args: Any, **kwargs: Any) -> Any:
    with compiled_region():
        return compiled(*args, **kwargs)


def _call_uncompiled(block: nn.Module, *args: Any, **kwargs: Any) -> Any:
    return torch_internals.call_uncompiled(block, *args, **kwargs)


def _find_blocks(module: nn.Module, pattern: str | None) -> list[tuple[str, nn.Module]]:
    try:
        found = find_blocks(module, pattern)
    except re.error as e:
        raise CompileError(f"blocks pattern {pattern!r} is not a valid regex: {e}") from None
    if not found and pattern is not None:
        raise CompileError(f"blocks pattern {pattern!r} matches no submodule of {type(module).__name__}")
    if not found:
        raise CompileError(f"{type(module).__name__} has no nn.ModuleList of blocks; name them with blocks=REGEX")
    return found


# torch's dropout modules (all the public subclasses of its private _DropoutNd)
_DROPOUT_MODULES = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)


def _check_no_dropout(fqn: str, block: nn.Module) -> None:
    for name, m in block.named_modules():
        if not m.training:
            continue
        where = f"{fqn}.{name}" if name else fqn
        p = m.p if isinstance(m, _DROPOUT_MODULES) else getattr(m, "attention_dropout", 0.0)
        if isinstance(p, (int, float)) and p > 0:
            raise CompileError(f"block {where!r} ({type(m).__name__}) has dropout p={p} in training mode; compiled "
                               "dropout would not reproduce vescale's single-device RNG masks. Set dropout to 0 or "
                               "call .eval() before compile_parallel")
