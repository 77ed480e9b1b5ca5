"""Sharding rules for ATen ops that torch's DTensor lacks, registered by :func:`install` on first use of
:mod:`vescale.dtensor` (never at import).

* ``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward: the kernel that
  ``F.scaled_dot_product_attention`` (and so every Hugging Face model's default ``attn_implementation="sdpa"``)
  picks on the CPU. torch registers rules for the CUDA attention kernels only, so without this a tensor-parallel
  model on CPU ranks must fall back to ``attn_implementation="eager"``.

Attention is independent per batch row and per head, so each mesh dim may shard the batch (dim 0) or the heads
(dim 1) of query, key, value, output and logsumexp alike, or replicate them all. Grouped-query attention (fewer
key/value heads) stays correct under head sharding: query head ``i`` reads key/value head ``i // group``, and
contiguous equal shards keep whole groups together (the number of key/value heads must divide by the mesh dim).
An ``attn_mask`` follows the dim it broadcasts over: sharded like the others where it has that dim in full,
replicated where its size there is 1. Without a causal mask the query rows (dim 2) may be sharded too, key and
value replicated (torch finds that strategy through the op's decomposition). Anything else (the key sequence
sharded, or query rows under a causal mask) is redistributed by DTensor first.

Dropout inside the kernel (``dropout_p > 0``) on DTensors is refused: the kernel draws its mask from each rank's
local generator, which would not reproduce the single-device result (vescale's counter RNG covers
``nn.Dropout``, not fused attention dropout). Set the attention dropout to 0 or use eager attention.

* ``aten._grouped_mm`` (Hugging Face's default MoE experts kernel) and the ``unique`` family: operands replicated,
  then computed locally (torch has no rule: ``_grouped_mm``'s CPU meta kernel refuses fp32, ``unique``'s output shape
  depends on the data; see :func:`_whole_on_every_rank`).

* ``aten.linalg_solve_triangular`` with broadcast batch dims (see :func:`_solve_triangular_strategy`): torch's rule
  can pair a batch-sharded right-hand side with a replicated matrix that has the same batch dim in full, and the
  local kernel then broadcasts the two unequal local batches into a wrong result labelled as sharded (Qwen3-Next's
  gated delta rule on a dp x tp mesh hit it). vescale's rule replaces it.

* ``aten.copy_`` into a ``Partial`` DTensor from a sharded one (see :func:`_copy_into_partial`): torch cannot
  redistribute ``Shard`` to ``Partial``, so the backward of an indexed write (``out[:, t] = x``, RecurrentGemma's
  scan) failed when the incoming gradient was partial.

* ``aten.view`` of a DTensor whose local tensor is laid out in memory differently from its declared strides: the
  local tensor is re-laid as declared and the view retried (see :func:`_view_of_relaid`), instead of failing with
  "view size is not compatible with input tensor's size and stride". Nothing else is retried: a view that flattens
  or splits an unevenly sharded dim is refused (torch's "is not evenly divisible by mesh dimension"), never computed
  on a gathered copy, which would not alias its input.

* ``aten.clone`` of a ``RaggedShard`` DTensor: local, same placement (see :func:`_clone_of_ragged`); torch's rule asked
  for a redistribution it does not support.

* ``aten.split`` / ``aten.split_with_sizes`` of an ``InterleavedShard`` dim at its chunk boundaries (GPT-2's fused
  ``c_attn`` output into q, k, v): local, each piece ``Shard`` (see :func:`_split_interleaved`); torch's rule gathers
  the dim first.

Built on torch's private ``torch.distributed.tensor._ops`` registration API (the same one torch's own rules use),
reached through :mod:`vescale.core.torch_internals`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from vescale.core import torch_internals
from vescale.core.torch_internals import (
    OpSchema,
    OpStrategy,
    RuntimeSchemaInfo,
    expand_to_full_mesh_op_strategy,
    register_op_strategy,
)
from vescale.core.torch_internals import StridedShard as _StridedShard
from vescale.dtensor.errors import PlacementError, ViewRedistributeError
from vescale.dtensor.layout import relaid_as_declared, smallest_shard
from vescale.dtensor.placements import InterleavedShard, RaggedShard
from vescale.dtensor.strict import is_strict

__all__ = ["ATTENTION_DROPOUT_ERROR", "install"]

aten = torch.ops.aten

ATTENTION_DROPOUT_ERROR = (
    "scaled_dot_product_attention with dropout_p={p} on DTensors: the fused CPU kernel draws its dropout mask from "
    "each rank's own generator, so the result would not match one device. Set the attention dropout to 0 (e.g. "
    "config.attention_dropout=0.0) or use attn_implementation='eager' (dropout through nn.Dropout is handled by "
    "vescale's counter RNG)"
)


def _mask_placement(op_schema: OpSchema, dim: int) -> list:
    """The placement of the optional ``attn_mask`` keyword for a strategy that shards ``dim`` (or [] if absent)."""
    mask = op_schema.kwargs_schema.get("attn_mask")
    if not isinstance(mask, OpStrategy):
        return []
    shape = mask.shape
    full_dim = dim - (4 - len(shape))  # the mask broadcasts from the right against (batch, heads, q_len, kv_len)
    if full_dim < 0 or shape[full_dim] == 1:
        return [Replicate()]
    return [Shard(full_dim)]


def _attention_strategies(op_schema: OpSchema, outputs: int, inputs: int, causal: bool) -> list[list]:
    """Replicate all, shard the batch, or shard the heads: ``outputs`` output and ``inputs`` tensor input entries.
    Without a causal mask also the query rows (dim 2 of query, output and logsumexp; key and value replicated; in
    backward their gradients partial sums over the rows), the strategy torch finds through the op's decomposition:
    each query row attends independently (a causal kernel would take local row indices for global ones)."""
    strategies = [[Replicate()] * (outputs + inputs + len(_mask_placement(op_schema, 0)))]
    for dim in (0, 1):
        strategies.append([Shard(dim)] * (outputs + inputs) + _mask_placement(op_schema, dim))
    if not causal:
        rows, kv = Shard(2), Replicate()
        if outputs == 2:  # (output, logsumexp) <- (query, key, value)
            strategies.append([rows, rows, rows, kv, kv] + _mask_placement(op_schema, 2))
        else:  # (grad_query, grad_key, grad_value) <- (grad_out, query, key, value, out, logsumexp)
            strategies.append([rows, Partial(), Partial(), rows, rows, kv, kv, rows, rows]
                              + _mask_placement(op_schema, 2))
    return strategies


def _current_mask_placements(op_schema: OpSchema) -> tuple | None:
    """The placements the ``attn_mask`` keyword has now (None without a DTensor mask)."""
    mask = op_schema.kwargs_schema.get("attn_mask")
    if not isinstance(mask, OpStrategy):
        return None
    return tuple(mask.strategies[0].output_spec.placements)


def _valid_strategy(op_schema: OpSchema, heads: tuple[int, ...]) -> Callable[[list, object], bool]:
    """A strategy filter: refuse head or query-row sharding that leaves a rank without heads or rows (torch's CPU
    kernel then dies of SIGFPE; shards follow ``torch.chunk``: 6 heads over 4 ranks are 2, 2, 2, 0), and any
    strategy that needs the ``attn_mask`` in another layout than it has: DTensor's dispatcher does not redistribute
    keyword arguments, so the kernel would get the mask as it is (a wrong broadcast, not only a shape error, when a
    rank's batch is 1)."""
    mask_now = _current_mask_placements(op_schema)
    rows = op_schema.args_schema[0].shape[2]  # query rows (grad_out's in backward)

    def valid(input_specs: list, output_specs: object) -> bool:
        if mask_now is not None and tuple(input_specs[-1].placements) != mask_now:
            return False
        spec = input_specs[0]  # q (grad_out in backward): all tensors of a strategy share batch/head placements
        for n, dim in (*((h, 1) for h in heads), (rows, 2)):  # no rank without heads or query rows (SIGFPE too)
            for mesh_dim, placement in enumerate(spec.placements):
                if placement.is_shard(dim):
                    n = smallest_shard(n, spec.mesh.size(mesh_dim))
            if n == 0:
                return False
        return True

    return valid


def _heads(op_schema: OpSchema, first: int) -> tuple[int, ...]:
    """Head counts of the query and the key (grouped-query attention has fewer key/value heads)."""
    return tuple(op_schema.args_schema[i].shape[1] for i in (first, first + 1))


def _refuse_dropout(p: float) -> None:
    if p:
        raise NotImplementedError(ATTENTION_DROPOUT_ERROR.format(p=p))


def _cpu_flash_attention_strategy(op_schema: OpSchema) -> OpStrategy:
    # (query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None) -> (output, logsumexp)
    args = op_schema.args_schema
    _refuse_dropout(args[3] if len(args) > 3 else 0.0)
    mesh = op_schema.get_mesh_from_args()
    causal = bool(args[4]) if len(args) > 4 else bool(op_schema.kwargs_schema.get("is_causal", False))
    return expand_to_full_mesh_op_strategy(mesh, op_schema, _attention_strategies(op_schema, 2, 3, causal),
                                           input_index=2, allow_uneven_sharding=True,
                                           is_valid_strategy_cb=_valid_strategy(op_schema, _heads(op_schema, 0)))


def _cpu_flash_attention_backward_strategy(op_schema: OpSchema) -> OpStrategy:
    # (grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, *, attn_mask=None, scale=None)
    #   -> (grad_query, grad_key, grad_value)
    _refuse_dropout(op_schema.args_schema[6])
    mesh = op_schema.get_mesh_from_args(validate=False)
    causal = bool(op_schema.args_schema[7])
    return expand_to_full_mesh_op_strategy(mesh, op_schema, _attention_strategies(op_schema, 3, 6, causal),
                                           input_index=3, allow_uneven_sharding=True,
                                           is_valid_strategy_cb=_valid_strategy(op_schema, _heads(op_schema, 1)))


def _broadcast_partner(shape: tuple, batch: tuple, dim: int):
    """How an operand of ``shape`` is placed when output batch dim ``dim`` (of the broadcast ``batch``) is sharded:
    sharded on its aligned dim where it has that dim in full, replicated where it broadcasts (absent or size 1)."""
    aligned = dim - (len(batch) - (len(shape) - 2))
    return Shard(aligned) if aligned >= 0 and shape[aligned] == batch[dim] else Replicate()


def _solve_triangular_strategy(op_schema: OpSchema) -> OpStrategy:
    """``linalg_solve_triangular(A, B, *, upper, left=True, unitriangular=False) -> X``; A and B broadcast over their
    batch dims (all but the last two).

    Strategies, per mesh dim: all replicated; an output batch dim sharded, with each operand sharded on its aligned
    dim where it has that dim in full and replicated where it broadcasts; B partial (X is linear in B) with A
    replicated; B's right-hand-side columns sharded (rows for ``left=False``: each solves independently) with A
    replicated. torch's own rule also offers A replicated with B sharded on any batch dim, which is right only where
    A broadcasts there; it is replaced because otherwise it yields silently wrong values.
    """
    a, b = op_schema.args_schema[0], op_schema.args_schema[1]
    left = op_schema.kwargs_schema.get("left", True)
    batch = tuple(torch.broadcast_shapes(tuple(a.shape[:-2]), tuple(b.shape[:-2])))
    ndim = len(batch) + 2
    strategies: list[list] = [[Replicate()] * 3]
    for dim, size in enumerate(batch):
        if size > 1:
            strategies.append([Shard(dim), _broadcast_partner(tuple(a.shape), batch, dim),
                               _broadcast_partner(tuple(b.shape), batch, dim)])
    strategies.append([Partial(), Replicate(), Partial()])
    independent = -1 if left else -2
    strategies.append([Shard(ndim + independent), Replicate(), Shard(len(b.shape) + independent)])
    mesh = op_schema.get_mesh_from_args()
    return expand_to_full_mesh_op_strategy(mesh, op_schema, strategies, input_index=1, allow_uneven_sharding=True)


def _whole_on_every_rank(op_call, args: tuple, kwargs: dict):
    """An op torch has no sharding rule for, run on the whole operands on every rank: the local op on replicated
    operands, every output tensor wrapped replicated.

    Used for ``aten._grouped_mm`` (Hugging Face's default MoE experts kernel: DTensor's fallback, running the op on
    fake tensors for the output's shape, fails on CPU, where the meta kernel demands bf16 while the CPU kernel takes
    fp32) and the ``unique`` family (data-dependent output shapes no rule can state: Kolibri's packed-row starts).
    Replicated operands need no rule: every rank computes the whole result. Sharded or partial operands are
    redistributed to replicated first (correct, not the fastest: the tokens of a batch-sharded input are
    all-gathered).
    """
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, DTensor)]
    mesh = tensors[0].device_mesh
    for t in tensors:
        if t.device_mesh != mesh:
            raise NotImplementedError(f"{op_call} on DTensors of different meshes: {t.device_mesh} and {mesh}")
    replicate = [Replicate()] * mesh.ndim

    def local(a):
        if not isinstance(a, DTensor):
            return a
        if not all(isinstance(p, Replicate) for p in a.placements):
            a = a.redistribute(mesh, replicate)
        return torch_internals.local_tensor(a)  # below autograd: the local tensor itself, no to_local() node

    def wrap(out):
        if isinstance(out, torch.Tensor):
            return DTensor.from_local(out, mesh, replicate, run_check=False)
        if isinstance(out, (tuple, list)):
            return type(out)(wrap(o) for o in out)
        return out

    return wrap(op_call(*[local(a) for a in args], **{k: local(v) for k, v in kwargs.items()}))


#: Ops run whole on every rank (:func:`_whole_on_every_rank`), where this torch has them.
_WHOLE_ON_EVERY_RANK = ("_grouped_mm.default", "_unique2.default", "_unique.default", "unique_dim.default",
                        "unique_consecutive.default")


def _view_of_relaid(op_call, args: tuple, kwargs: dict):
    """``aten.view`` on a DTensor, retried on a re-laid local tensor when the local view fails, and as reshape's copy
    inside autograd's backward.

    DTensor declares an output's strides from the op's meta function, which for some kernels disagrees with what the
    kernel returns: an elementwise backward (``softplus_backward``) of a transposed gradient and a contiguous input
    declares a contiguous result while the local kernel follows the gradient's memory order. Such a tensor is
    viewable by its declared strides but not locally, so ``reshape`` (which autograd's ``ViewBackward`` and model code
    call) takes the view path and fails on the local tensor. Here the local tensor is then laid out as declared (a
    copy; the values are the same, no communication) and viewed; a view that is invalid for the declared strides too
    still raises.

    A view that cannot be a view of the local shards (an unevenly sharded dim split or merged, a layout no placement
    keeps) is refused with :class:`~vescale.dtensor.ViewRedistributeError` (:mod:`vescale.dtensor.view_rules`; raised
    here as that type, with the message torch's dispatcher gave it), never computed on a gathered copy. The one
    exception is a view issued while autograd runs a backward (outside strict mode): there it comes from a derivative
    formula's ``reshape`` of a gradient (``ViewBackward``), whose contract allows a copy and which nothing aliases, so
    the dims the view merges or splits are redistributed first (see :func:`_copy_of_refused_view`). Views outside a
    backward are never retried.
    """
    with _torch_path(op_call, _view_of_relaid):
        try:
            return op_call(*args, **kwargs)
        except RuntimeError as e:
            if not isinstance(args[0], DTensor):
                raise
            if "view size is not compatible" in str(e):
                return op_call(relaid_as_declared(args[0]), *args[1:], **kwargs)
            if not _caused_by(e, ViewRedistributeError):
                raise
            if torch_internals.torch_graph_task_id() != -1 and not is_strict():
                return _copy_of_refused_view(op_call, args[0], args[1])
            # the named error itself (torch's dispatcher wrapped it in a plain RuntimeError), with torch's message
            raise ViewRedistributeError(str(e)) from e


def _caused_by(error: BaseException | None, kind: type) -> bool:
    """Whether ``error`` or an exception of its ``__cause__`` chain is a ``kind`` (torch's dispatcher re-raises the
    errors of sharding rules as ``RuntimeError`` from them)."""
    while error is not None:
        if isinstance(error, kind):
            return True
        error = error.__cause__
    return False


def _copy_of_refused_view(op_call, t: DTensor, size) -> DTensor:
    """``t.view(size)`` computed on ``t`` redistributed so that it is a view: the mesh dims sharding a dim the view
    merges or splits replicated (``view_rules.replicate_reshaped``), else every shard replicated. Each rank decides
    from global shapes and placements alike; the redistribution is :func:`vescale.dtensor.redistribute` (interleaved
    layouts on n-d meshes go through ``Replicate``)."""
    from vescale.dtensor.api import redistribute  # api imports this module's installer
    from vescale.dtensor.view_rules import replicate_reshaped

    mesh = t.device_mesh
    placements = replicate_reshaped(t, size)
    try:
        return op_call(redistribute(t, mesh, placements), size)
    except RuntimeError as e:
        if not _caused_by(e, ViewRedistributeError):
            raise
    return op_call(redistribute(t, mesh, [Replicate() if p.is_shard() else p for p in t.placements]), size)


@contextmanager
def _torch_path(op_call, handler: Callable) -> Iterator[None]:
    """Inside, ``op_call`` on DTensors takes torch's own dispatch: ``handler`` (this module's handler for it) is
    out of torch's custom-handler table, so calling the op again does not re-enter the handler."""
    handlers = torch_internals.dtensor_custom_op_handlers()
    handlers.pop(op_call, None)
    try:
        yield
    finally:
        handlers[op_call] = handler


def _scatter_add_of_partial(op_call, args: tuple, kwargs: dict):
    """``scatter_add``/``scatter_add_`` with a ``Partial`` self or src: torch's rule gives a wrong sum (the partial
    summands are scattered as if whole; PhiMoE's router backward met it). The partial operands are reduced first
    (an all-reduce on every rank), the sum is computed whole, and an in-place call writes it back into its ``Partial``
    self through :func:`_copy_into_partial` (the value on one rank of each sum dim). Every other call takes torch's
    path."""
    self_, src = args[0], (args[3] if len(args) > 3 else kwargs.get("src"))
    operands = [t for t in (self_, src) if isinstance(t, DTensor)]
    if not any(p.is_partial() for t in operands for p in t.placements):
        with _torch_path(op_call, _scatter_add_of_partial):
            return op_call(*args, **kwargs)

    def whole(t):
        if not isinstance(t, DTensor) or not any(p.is_partial() for p in t.placements):
            return t
        return t.redistribute(t.device_mesh, [Replicate() if p.is_partial() else p for p in t.placements])

    rest = list(args[1:])
    if len(rest) > 2:
        rest[2] = whole(rest[2])
    value = torch.ops.aten.scatter_add.default(whole(self_), *rest, **{k: whole(v) for k, v in kwargs.items()})
    if op_call is torch.ops.aten.scatter_add_.default:
        return self_.copy_(value)
    return value


def _copy_into_partial(op_call, args: tuple, kwargs: dict):
    """``dst.copy_(src)`` where ``dst`` is partial on some mesh dim and ``src`` (a DTensor on the same mesh) is
    placed otherwise or has another shape (broadcasting).

    torch would redistribute ``src`` to ``dst``'s placements, which has no ``Shard -> Partial`` path. Any value is a
    valid partial of itself: ``src`` is redistributed to the placements :func:`_broadcast_source_placements` gives
    (``Replicate`` where ``dst`` is partial, ``dst``'s shards aligned to ``src``'s dims elsewhere), so each rank's
    local ``src`` broadcasts exactly onto its local ``dst``, and each rank writes its part: the value on the first rank
    of a ``sum`` dim and zeros on the others; the value everywhere for ``avg``, ``max`` and ``min``. The result's
    full tensor is what ``copy_`` gives on one device. A ``src`` that does not broadcast to ``dst``'s global shape
    raises ``RuntimeError`` (as on one device) on every rank before any collective. Every other copy takes torch's
    path.
    """
    dst, src = args[0], args[1]
    if (isinstance(dst, DTensor) and isinstance(src, DTensor) and src.device_mesh == dst.device_mesh
            and any(p.is_partial() for p in dst.placements)
            and (tuple(src.placements) != tuple(dst.placements) or src.shape != dst.shape)):
        mesh = dst.device_mesh
        targets = _broadcast_source_placements(dst, src)  # validates from global metadata: before any collective
        from vescale.dtensor.api import redistribute  # api imports this module's installer

        part = torch_internals.local_tensor(redistribute(src, mesh, targets))
        for dim, placement in enumerate(dst.placements):
            if placement.is_partial() and placement.reduce_op == "sum" and mesh.get_local_rank(dim) != 0:
                part = torch.zeros_like(part)
        torch_internals.local_tensor(dst).copy_(part, *args[2:], **kwargs)
        return dst
    with _torch_path(op_call, _copy_into_partial):
        return op_call(*args, **kwargs)


def _broadcast_source_placements(dst: DTensor, src: DTensor) -> list:
    """The placements to give ``src`` so that each rank's local piece broadcasts onto its local piece of ``dst``
    (placed as it is, partial on some mesh dims).

    Broadcasting aligns trailing dims: ``dst`` dim ``d`` is ``src`` dim ``d - (dst.ndim - src.ndim)``. A mesh dim
    that shards ``dst`` dim ``d`` shards that ``src`` dim alike (same ``Shard`` or interleaved split factor, so the
    local sizes agree, uneven ones included), unless ``src`` lacks the dim or has size 1 there (it broadcasts:
    ``Replicate``); partial and replicated mesh dims of ``dst`` take ``src`` replicated. Raises ``RuntimeError`` when
    ``src``'s global shape does not broadcast to ``dst``'s and :class:`PlacementError` for a ``dst`` placement other
    than ``Shard``, ``InterleavedShard``, ``Replicate`` or ``Partial``; both depend on global shapes and placements
    only, so every rank raises alike.
    """
    mesh = dst.device_mesh
    where = (f"aten.copy_ into a DTensor of global shape {tuple(dst.shape)} placed {tuple(dst.placements)} from one "
             f"of global shape {tuple(src.shape)} placed {tuple(src.placements)} on mesh {tuple(mesh.shape)} "
             f"(dims {mesh.mesh_dim_names})")
    try:
        broadcast = tuple(torch.broadcast_shapes(tuple(src.shape), tuple(dst.shape)))
    except RuntimeError as e:
        raise RuntimeError(f"{where}: the source does not broadcast to the destination: {e}") from e
    if broadcast != tuple(dst.shape):
        raise RuntimeError(f"{where}: the source does not broadcast to the destination (broadcast shape {broadcast})")
    offset = dst.ndim - src.ndim
    targets: list = []
    for mesh_dim, p in enumerate(dst.placements):
        if p.is_partial() or isinstance(p, Replicate):
            targets.append(Replicate())
            continue
        if not isinstance(p, (Shard, _StridedShard)):
            raise PlacementError(f"{where}: mesh dim {mesh_dim} of the destination is placed {p!r}; only Shard, "
                                 f"InterleavedShard, Replicate and Partial are supported")
        d = p.dim + dst.ndim if p.dim < 0 else p.dim
        s = d - offset
        if s < 0 or src.shape[s] == 1:
            targets.append(Replicate())  # src broadcasts along dst dim d: every rank needs all of it
        elif isinstance(p, _StridedShard):
            targets.append(_StridedShard(s, split_factor=torch_internals.split_factor(p)))
        else:
            targets.append(Shard(s))
    return targets


def _clone_of_ragged(op_call, args: tuple, kwargs: dict):
    """``aten.clone`` of a DTensor placed ``RaggedShard``: each rank clones its local piece, placed as the input (clone
    is elementwise; no communication). torch's clone rule is a single-dim strategy, which cannot see the placement it
    does not know and asks for an unsupported redistribution to ``Replicate``. Every other clone takes torch's path."""
    t = args[0]
    if isinstance(t, DTensor) and any(isinstance(p, RaggedShard) for p in t.placements):
        spec = torch_internals.dtensor_spec(t)
        local = torch_internals.local_tensor(t).clone(**kwargs)
        return DTensor.from_local(local, spec.mesh, spec.placements, run_check=False, shape=t.shape, stride=t.stride())
    with _torch_path(op_call, _clone_of_ragged):
        return op_call(*args, **kwargs)


def _split_interleaved(op_call, args: tuple, kwargs: dict):
    """``aten.split`` / ``aten.split_with_sizes`` of a dim placed ``InterleavedShard(d, sf)`` into pieces made of
    whole chunks: each rank splits its local tensor, and a piece of one chunk is ``Shard(d)``, of ``c`` chunks
    ``InterleavedShard(d, c)``. No communication.

    A rank holds its piece of every chunk, concatenated in chunk order (all chunks are cut alike), so cutting its local
    tensor at the chunk boundaries gives exactly its piece of each output. GPT-2's fused ``c_attn`` output
    ``[q | k | v]`` thus splits into head-sharded q, k and v; torch's rule gathers the split dim first, which left every
    rank computing attention, and holding the KV cache, of all heads. Other splits, and a dim that another mesh dim
    shards too, take torch's path.
    """
    found = _interleaved_split(*args, **kwargs) if isinstance(args[0], DTensor) else None
    if found is None:
        with _torch_path(op_call, _split_interleaved):
            return op_call(*args, **kwargs)
    t, dim, sizes, mesh_dim, chunk = found
    local = torch_internals.local_tensor(t)
    piece = local.shape[dim] // (t.shape[dim] // chunk)  # this rank's piece of each chunk
    out = []
    for n, part in zip(sizes, local.split([n // chunk * piece for n in sizes], dim)):
        placements = list(t.placements)
        placements[mesh_dim] = Shard(dim) if n == chunk else InterleavedShard(dim, n // chunk)
        shape = list(t.shape)
        shape[dim] = n
        out.append(DTensor.from_local(part, t.device_mesh, placements, run_check=False, shape=torch.Size(shape),
                                      stride=t.stride()))
    return out


def _interleaved_split(t: DTensor, split, dim: int = 0) -> tuple | None:
    """``(t, dim, sizes, mesh dim, chunk)`` when splitting ``t`` by ``split`` (a size or a list of sizes) on ``dim``
    cuts only at chunk boundaries of the one ``InterleavedShard`` placed on that dim; else None."""
    dim = dim + t.ndim if dim < 0 else dim
    n = t.shape[dim]
    on_dim = [i for i, p in enumerate(t.placements) if isinstance(p, (Shard, _StridedShard)) and p.dim == dim]
    if len(on_dim) != 1 or not isinstance(t.placements[on_dim[0]], _StridedShard):
        return None
    if any(not isinstance(p, (Shard, _StridedShard, Replicate, Partial)) for p in t.placements):
        return None  # RaggedShard: torch's path refuses it with a clear error
    sf = torch_internals.split_factor(t.placements[on_dim[0]])
    if n % sf:
        return None
    chunk = n // sf
    if isinstance(split, int):
        if split <= 0:
            return None
        sizes = [split] * (n // split) + ([n % split] if n % split else [])
    else:
        sizes = [int(s) for s in split]
    if sum(sizes) != n or any(s <= 0 or s % chunk for s in sizes):
        return None
    return t, dim, sizes, on_dim[0], chunk


_installed = False


def install() -> None:
    """Register the rules above with torch's DTensor (idempotent)."""
    global _installed
    if _installed:
        return
    register_op_strategy(aten._scaled_dot_product_flash_attention_for_cpu.default,
                         schema_info=RuntimeSchemaInfo(3, static_kwargkey=["scale"]))(_cpu_flash_attention_strategy)
    register_op_strategy(aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
                         schema_info=RuntimeSchemaInfo(6, static_kwargkey=["scale"]))(
        _cpu_flash_attention_backward_strategy)
    # torch registers a single-dim rule for solve_triangular, which its propagator consults before a full-mesh
    # strategy: drop it so vescale's rule is the one used
    propagator = torch_internals.sharding_propagator()
    propagator.op_single_dim_strategy_funcs.pop(aten.linalg_solve_triangular.default, None)
    register_op_strategy(aten.linalg_solve_triangular.default,
                         schema_info=RuntimeSchemaInfo(2, static_kwargkey=["left"]))(_solve_triangular_strategy)
    torch_internals.clear_sharding_caches()  # (the C++ fast-path cache too: ops may have run before install)
    # torch's own extension point for per-op DTensor behaviour (vescale.dtensor.random and loss_parallel use it)
    for name in _WHOLE_ON_EVERY_RANK:
        packet, overload = name.split(".")
        if hasattr(aten, packet):
            torch_internals.dtensor_custom_op_handlers()[getattr(getattr(aten, packet), overload)] = (
                _whole_on_every_rank)
    torch_internals.dtensor_custom_op_handlers()[aten.view.default] = _view_of_relaid
    torch_internals.dtensor_custom_op_handlers()[aten.copy_.default] = _copy_into_partial
    torch_internals.dtensor_custom_op_handlers()[aten.clone.default] = _clone_of_ragged
    for op in (aten.scatter_add.default, aten.scatter_add_.default):
        torch_internals.dtensor_custom_op_handlers()[op] = _scatter_add_of_partial
    for op in (aten.split.Tensor, aten.split_with_sizes.default):
        torch_internals.dtensor_custom_op_handlers()[op] = _split_interleaved
    _installed = True
