"""Calls of model code that DTensor would get wrong or refuse, corrected so that they compute what one device computes.

:class:`~vescale.parallel.factory.FactoryCapture` (the mode a parallelized root runs its ``forward`` under) hands
every call of a function in :data:`CORRECTED_FUNCTIONS` to :func:`correct_call` first. Each correction is exact (the
plain op's result, or the same layout choice DTensor would make with more information); none issues a collective
beyond what the op itself needs. They exist because an unmodified model called the way its users call it
(``use_cache=True``, padding masks, ``labels=``) reaches these cases:

* ``torch.cat`` with a legacy empty input (1-d, size 0): the plain op skips it, DTensor's rule fails on it
  (Hugging Face's ``DynamicLayer`` grows its cache from ``torch.tensor([])``).
* An in-place write (``index_copy_``, ``copy_``, ``__setitem__``) from a sharded tensor into a captured factory tensor
  that was never written: the destination takes the source's layout first (``StaticCache`` buffers then hold each
  rank's own heads instead of a replicated copy).
* ``F.scaled_dot_product_attention`` with a DTensor ``attn_mask``: the mask is brought to the query's batch/head
  layout, because DTensor never redistributes keyword arguments; and the output's local tensor is laid out as its
  declared strides say (the CPU kernel's meta function and the kernel disagree for a transposed query).
* Indexing a DTensor with a Python list or a plain tensor (``x[:, [-1, 0]]``): the index becomes a replicated
  DTensor, as a captured factory result would be.
* ``F.cross_entropy`` / ``F.nll_loss`` with ``reduction="mean"`` on a target sharded over some mesh dim: torch's rule
  averages the per-rank means, which differs from the mean whenever ranks hold different numbers of ignored targets
  (padding) or of class weight. It is computed as the sharded sum over the sharded count of what counts.
* An embedding lookup (``F.embedding``, ``torch.embedding``, ``aten.embedding``) with a DTensor weight and a token id
  outside ``[0, vocab_size)``: one device raises ``IndexError``, torch's vocab-parallel rule reads zeros (each rank
  masks the ids outside its rows). :func:`check_token_ids` raises :class:`~vescale.parallel.errors.TokenIdError`
  instead, on every rank (see there for what it costs).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate, Shard

from vescale.core import torch_internals
from vescale.dtensor.layout import relaid_as_declared
from vescale.parallel.errors import TokenIdError

__all__ = ["CORRECTED_FUNCTIONS", "correct_call", "mark_unwritten", "check_token_ids", "name_embeddings",
           "embedding_name"]

_CAT_FUNCTIONS = frozenset({torch.cat, torch.concat, torch.concatenate})


def _is_legacy_empty(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.dim() == 1 and t.shape[0] == 0


def _drop_legacy_empty(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``torch.cat``'s arguments without its legacy empty inputs (1-d, size 0) when other inputs have more dims.

    Plain ``torch.cat`` skips such inputs (a cache grown from ``torch.tensor([])``, as Hugging Face's
    ``DynamicLayer`` does); DTensor's cat rule does not, and fails on them once the placeholder is captured as a
    replicated DTensor. Dropping them is exactly the plain op's result.
    """
    tensors = args[0] if args else kwargs.get("tensors")
    if not isinstance(tensors, (list, tuple)) or not any(map(_is_legacy_empty, tensors)):
        return args, kwargs
    kept = [t for t in tensors if not _is_legacy_empty(t)]
    if not kept or all(t.dim() == 1 for t in kept):
        return args, kwargs  # only 1-d inputs: the plain rule applies as it is
    if args:
        return (kept, *args[1:]), kwargs
    return args, {**kwargs, "tensors": kept}


def _refuse_attention_dropout(args: tuple, kwargs: dict) -> None:
    """Raise the attention-dropout refusal for a DTensor query with ``dropout_p > 0``, on every rank alike (the
    arguments are SPMD). With dropout, torch's CPU dispatch picks the math path, which builds its causal mask as a
    plain tensor (a mixed Tensor/DTensor crash) before the fused kernel's rule could refuse it."""
    query = args[0] if args else kwargs.get("query")
    p = args[3] if len(args) > 3 else kwargs.get("dropout_p", 0.0)
    if isinstance(query, DTensor) and isinstance(p, (int, float)) and p > 0:
        from vescale.dtensor.sharding_rules import ATTENTION_DROPOUT_ERROR

        raise NotImplementedError(ATTENTION_DROPOUT_ERROR.format(p=p))


def _mask_like_query(args: tuple, kwargs: dict) -> dict:
    """``kwargs`` with a DTensor ``attn_mask`` laid out like the query: sharded on the batch / heads where the query
    is and the mask has that dim in full (it broadcasts from the right against ``(batch, heads, q_len, kv_len)``),
    replicated elsewhere.

    DTensor's dispatcher never redistributes keyword arguments (torch skips them on purpose), and ``attn_mask`` is
    keyword-only in the attention kernels: a mask built from a batch-sharded padding mask but replicated by the ops
    that built it would reach the kernel whole while the query holds this rank's rows. Bringing it to the query's
    layout here, where the mask is still an argument of the Python call, is what the kernel's sharding rule assumes
    (and that rule refuses a strategy whose mask layout differs from the mask's own, rather than compute with it).
    """
    query = args[0] if args else kwargs.get("query")
    mask = kwargs.get("attn_mask")
    if not (isinstance(query, DTensor) and isinstance(mask, DTensor)) or mask.device_mesh != query.device_mesh:
        return kwargs
    target = []
    for p in query.placements:
        dim = p.dim - (query.ndim - mask.ndim) if isinstance(p, Shard) and p.dim in (0, 1) else -1
        target.append(Shard(dim) if dim >= 0 and mask.shape[dim] != 1 else Replicate())
    if tuple(target) != tuple(mask.placements):
        kwargs = {**kwargs, "attn_mask": mask.redistribute(mask.device_mesh, target)}
    return kwargs


# Captured factory results not yet written in place. Their values are a pure function of the call (every rank holds
# the same constant), so any placement of them is exact: the first in-place write from a sharded tensor may give them
# its layout (see _adopt_layout_of_first_write).
_unwritten: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # id -> tensor (tensors compare by value)

_WRITE_FUNCTIONS = frozenset({torch.Tensor.index_copy_, torch.Tensor.copy_, torch.Tensor.__setitem__})


def _written_dims(func, args: tuple, ndim: int) -> set[int] | None:
    """The dims of the destination an in-place write indexes (not written in full), or None if unknown."""
    if func is torch.Tensor.copy_:
        return set()
    if func is torch.Tensor.index_copy_:
        return {args[1] % ndim} if isinstance(args[1], int) else None
    key = args[1] if isinstance(args[1], tuple) else (args[1],)
    if any(k is Ellipsis or k is None for k in key) or len(key) > ndim:
        return None
    return {d for d, k in enumerate(key) if not (isinstance(k, slice) and k == slice(None))}


def _adopt_layout_of_first_write(func, args: tuple) -> None:
    """Reshard a captured, never-written replicated factory tensor to the layout of the sharded tensor written into it.

    A Hugging Face ``StaticCache`` allocates its key/value buffers with ``torch.zeros`` inside ``forward`` (global
    shape, so captured replicated) and fills them with ``index_copy_`` from head-sharded keys. Without this each rank
    would hold the whole cache and DTensor would all-gather the keys into it; with it each rank holds its own heads,
    as a cache grown by ``torch.cat`` does. Only dims the write covers in full may take the source's sharding, and
    Replicate -> Shard is a local slice, so no collective is issued and the values stay exact.
    """
    source_at = {torch.Tensor.copy_: 1, torch.Tensor.__setitem__: 2, torch.Tensor.index_copy_: 3}[func]
    if len(args) <= source_at:
        return
    dst, src = args[0], args[source_at]
    if not (isinstance(dst, DTensor) and _unwritten.get(id(dst)) is dst and isinstance(src, DTensor)):
        return
    del _unwritten[id(dst)]
    if (src.device_mesh != dst.device_mesh or src.ndim != dst.ndim
            or not all(isinstance(p, Replicate) for p in dst.placements)):
        return
    indexed = _written_dims(func, args, dst.ndim)
    if indexed is None or not any(isinstance(p, Shard) for p in src.placements):
        return
    for p in src.placements:
        if not isinstance(p, (Shard, Replicate)) or (isinstance(p, Shard) and (
                p.dim in indexed or dst.shape[p.dim] != src.shape[p.dim])):
            return
    resharded = dst.redistribute(dst.device_mesh, src.placements)
    # The one place vescale changes a DTensor's layout in place: the buffer's owner (a cache layer) keeps a reference
    # to this very object, so a new DTensor would not reach it. Global shape and values are unchanged.
    torch_internals.replace_dtensor_contents(dst, resharded)


def mark_unwritten(tensor: DTensor) -> None:
    """Record a freshly captured factory result: its first in-place write may give it the writer's layout."""
    _unwritten[id(tensor)] = tensor


_LOSSES = frozenset({F.cross_entropy, F.nll_loss})


def _mean_over_sharded_target(func, args: tuple, kwargs: dict) -> Any:
    """``func(..., reduction="mean")`` as (sum of the losses) / (sum of what counts), or ``None`` to leave the call.

    Applies when the input is a DTensor and the target a DTensor sharded on some mesh dim. What counts is torch's
    denominator for the mean: each target not equal to ``ignore_index``, weighted by ``weight[target]`` when class
    weights are given (label smoothing keeps the same denominator). Both sums are sharded reductions (``Partial``),
    so the division sees the global totals, as one device does.
    """
    names = ("input", "target", "weight", "size_average", "ignore_index", "reduce", "reduction")
    bound = dict(zip(names, args))
    bound.update(kwargs)
    inp, target = bound.get("input"), bound.get("target")
    if bound.get("reduction", "mean") != "mean" or bound.get("size_average") is not None or \
            bound.get("reduce") is not None:
        return None
    if not (isinstance(inp, DTensor) and isinstance(target, DTensor) and target.dtype in (torch.int64, torch.int32)
            and any(isinstance(p, Shard) for p in target.placements)):
        return None  # probabilities as targets, or a replicated target: torch's rule is exact there
    ignore = bound.get("ignore_index", -100)
    weight = bound.get("weight")
    counted = target != ignore
    if weight is None:
        denominator = counted.sum(dtype=inp.dtype)
    else:
        picked = weight[torch.where(counted, target, torch.zeros_like(target))]
        denominator = torch.where(counted, picked, torch.zeros_like(picked)).sum()
    total = func(**{**bound, "reduction": "sum"})
    return total / denominator


def _index_as_dtensors(args: tuple) -> tuple:
    """``dtensor[key]`` arguments with list and plain-tensor indices made replicated DTensors on its mesh.

    ``x[:, [-1, 0]]`` makes torch build the index tensor inside the op, out of the capture's sight, and DTensor then
    refuses the mix. The index is the same on every rank (it is the program's constant), so replicated is exact.
    """
    if len(args) < 2 or not isinstance(args[0], DTensor):
        return args
    self, key = args[0], args[1]
    parts = key if isinstance(key, tuple) else (key,)

    def lift(k: Any) -> Any:
        if isinstance(k, list):
            k = torch.tensor(k, device=self.device_mesh.device_type)
        if isinstance(k, torch.Tensor) and not isinstance(k, DTensor):
            return DTensor.from_local(k, self.device_mesh, [Replicate()] * self.device_mesh.ndim, run_check=False)
        return k

    lifted = tuple(lift(k) for k in parts)
    if all(a is b for a, b in zip(lifted, parts)):
        return args
    return (self, lifted if isinstance(key, tuple) else lifted[0], *args[2:])


_INDEX_FUNCTIONS = frozenset({torch.Tensor.__getitem__})


# -- token ids outside the vocabulary ------------------------------------------------------------------------------

_names: dict[int, tuple[tuple[int, ...], str]] = {}  # id(weight) -> (its shape, the FQN an error names it by)


def name_embeddings(module: torch.nn.Module, prefix: str = "") -> None:
    """Record the FQN (``prefix`` + the name in ``module``) of every parameter, an ``nn.Embedding``'s weight by its
    module's FQN, for :class:`~vescale.parallel.errors.TokenIdError` messages. No collective."""
    found = {id(p): (p, f"{prefix}{fqn}") for fqn, p in module.named_parameters()}
    found.update({id(m.weight): (m.weight, f"{prefix}{fqn}") for fqn, m in module.named_modules()
                  if isinstance(m, torch.nn.Embedding) and isinstance(m.weight, torch.Tensor)})
    for key, (p, fqn) in found.items():
        # by id, holding neither the tensor nor a weak reference to it: a tensor with a weakref cannot be swapped by
        # ``module.to()`` (torch.utils.swap_tensors refuses it). A freed tensor's id reused by another only changes
        # the name an error message prints, which embedding_name checks by shape.
        _names[key] = (tuple(p.shape), fqn)


def embedding_name(weight: torch.Tensor) -> str:
    """How a :class:`~vescale.parallel.errors.TokenIdError` names the embedding of ``weight``."""
    entry = _names.get(id(weight))
    if entry is not None and entry[0] == tuple(weight.shape):
        return repr(entry[1])
    return f"of weight {list(weight.shape)} (not a parameter parallelize_module saw)"


def check_token_ids(ids: torch.Tensor, vocab_size: int, name: str,
                    groups: Sequence[dist.ProcessGroup] = ()) -> None:
    """Raise :class:`~vescale.parallel.errors.TokenIdError` if an id of ``ids`` (this rank's plain tensor) is outside
    ``[0, vocab_size)``; ``name`` names the embedding in the message.

    ``groups``: the process groups of the mesh dims over which ``ids`` is a piece of the batch (each rank its own
    rows). Then one all-reduce (MAX) of two int64s per group makes every rank see the whole batch's smallest and
    largest id, so all raise together (a rank left running would wait in the next collective for the ones that
    raised). Without groups (ids the same on every rank, as a tensor-parallel lookup has them) no collective: every
    rank reaches the same verdict from its own copy. Either way it reads two numbers back to the host (a device
    sync on GPU).
    """
    if ids.numel():
        lo, hi = torch.aminmax(ids.to(torch.int64))
        stats = torch.stack([-lo.clamp(min=-(2 ** 62)), hi])
    else:  # nothing to check here; the others' ids still count
        stats = ids.new_full((2,), -(2 ** 62), dtype=torch.int64)  # (a Tensor method: factory capture skips it)
    for group in groups:
        dist.all_reduce(stats, op=dist.ReduceOp.MAX, group=group)
    neg_lo, hi = stats.tolist()
    lo = -neg_lo
    if lo < 0 or hi >= vocab_size:
        raise TokenIdError(_token_id_message(lo, hi, vocab_size, name))


def _token_id_message(lo: int, hi: int, vocab_size: int, name: str) -> str:
    bad, which = (lo, "smallest") if lo < 0 else (hi, "largest")
    return (f"token id {bad} (the {which} id of the batch) is out of range for embedding {name} with vocabulary "
            f"size {vocab_size}: ids must lie in [0, {vocab_size - 1}] (one device raises IndexError here; a "
            "vocab-parallel lookup would read zeros)")


_EMBEDDING_FUNCTIONS = frozenset({F.embedding, torch.embedding, torch.ops.aten.embedding.default})


def _checked_embedding_args(func, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Check an eager embedding lookup's ids against its DTensor weight (see :func:`check_token_ids`); return the
    arguments to call it with.

    Ids sharded on a mesh dim where the weight's rows are split are first replicated there, which is what DTensor's
    vocab-parallel rule does with them anyway (its lookup needs every id on every rank of that dim): the check then
    sees them whole without a collective of its own. Ids sharded on other dims (each dp rank its rows) are checked
    with one all-reduce of two numbers over those dims, so that every rank raises together.
    """
    functional = func is F.embedding
    ids_at, weight_at = (0, 1) if functional else (1, 0)
    ids_key, weight_key = ("input", "weight") if functional else ("indices", "weight")
    ids = args[ids_at] if len(args) > ids_at else kwargs.get(ids_key)
    weight = args[weight_at] if len(args) > weight_at else kwargs.get(weight_key)
    if not isinstance(weight, DTensor) or not isinstance(ids, torch.Tensor) or torch.compiler.is_compiling():
        return args, kwargs
    if not isinstance(ids, DTensor):
        check_token_ids(ids, weight.shape[0], embedding_name(weight))
        return args, kwargs
    mesh = ids.device_mesh
    rows = {i for i, p in enumerate(weight.placements) if p.is_shard() and p.dim in (0, -weight.ndim)}
    if ids.device_mesh == weight.device_mesh and any(not p.is_replicate() for i, p in enumerate(ids.placements)
                                                     if i in rows):
        ids = ids.redistribute(mesh, [Replicate() if i in rows else p for i, p in enumerate(ids.placements)])
        if len(args) > ids_at:
            args = (*args[:ids_at], ids, *args[ids_at + 1:])
        else:
            kwargs = {**kwargs, ids_key: ids}
    groups = [mesh.get_group(i) for i, p in enumerate(ids.placements) if not p.is_replicate()]
    check_token_ids(torch_internals.local_tensor(ids), weight.shape[0], embedding_name(weight), groups)
    return args, kwargs


CORRECTED_FUNCTIONS: frozenset = (_CAT_FUNCTIONS | _WRITE_FUNCTIONS | _LOSSES | _INDEX_FUNCTIONS
                                  | _EMBEDDING_FUNCTIONS | {F.scaled_dot_product_attention})


def correct_call(func, args: tuple, kwargs: dict) -> tuple[bool, Any, tuple, dict]:
    """``(handled, result, args, kwargs)``: the corrected result if the call was computed here, else the (possibly
    adjusted) arguments to call ``func`` with."""
    if func in _CAT_FUNCTIONS:
        args, kwargs = _drop_legacy_empty(args, kwargs)
    elif func in _WRITE_FUNCTIONS:
        _adopt_layout_of_first_write(func, args)
        if func is torch.Tensor.__setitem__:
            args = _index_as_dtensors(args)
    elif func in _INDEX_FUNCTIONS:
        args = _index_as_dtensors(args)
    elif func is F.scaled_dot_product_attention:
        _refuse_attention_dropout(args, kwargs)
        out = func(*args, **_mask_like_query(args, kwargs))
        return True, relaid_as_declared(out), args, kwargs
    elif func in _EMBEDDING_FUNCTIONS:
        args, kwargs = _checked_embedding_args(func, args, kwargs)
    elif func in _LOSSES:
        out = _mean_over_sharded_target(func, args, kwargs)
        if out is not None:
            return True, out, args, kwargs
    return False, None, args, kwargs
