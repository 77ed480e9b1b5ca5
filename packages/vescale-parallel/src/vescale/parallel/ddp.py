"""Megatron-style data parallelism: a contiguous gradient buffer per dtype, split into buckets reduced in backward.

:class:`DistributedDataParallel` wraps an unmodified module whose parameters are plain tensors or DTensors (for
example sharded by tensor parallelism over a ``tp`` mesh dimension). Gradients are reduced only over the data-parallel
group. Each parameter's gradient lives in a slice of a flat buffer; a per-parameter hook (run by autograd after the
gradient is accumulated) marks it ready, and a bucket whose parameters are all ready is reduced asynchronously while
the rest of backward runs. Buckets are launched strictly in order, so every rank issues the same collectives in the
same order. The end of backward waits for every reduction, so after ``loss.backward()`` the gradients are averaged
over the dp group, as a single device would compute them for the whole batch. Its options are one value,
:class:`DDPOptions`; the buffers, buckets and reduction groups are laid out by :mod:`vescale.parallel._grad_buckets`.

``zero_stage=0/1`` all-reduce buckets (every rank holds the averaged gradient); ``zero_stage=2`` reduce-scatters
them, so each rank only holds the averaged gradient of its own contiguous 1/dp slice of every bucket (see
:class:`~vescale.parallel.DistributedOptimizer`, which owns those slices). Under ZeRO-2 a bucket's full-size
buffer exists only from its first gradient in backward until its reduce-scatter completes (freed then, without
waiting in backward, or at the end of backward at the latest), so between steps a rank holds ``grad bytes / dp``
(plus padding of fewer than dp elements per bucket); ``no_sync`` micro-steps keep the full buffers of the buckets
they touch until the synchronised backward reduces them.

Expert parallelism: the other dims of the DDP mesh that split the batch as dp does (``vescale.core.mesh.DATA_DIMS``
besides dp, larger than one: ``ep``), the *data dims*, are the parameters' own DTensor mesh dims too (each ep rank
runs the dense layers on its own rows). A parameter replicated on such a dim gets a ``Partial`` gradient there; DDP
sums it over that dim in the same bucketed reduction as over dp (one flat group, dp x ep), instead of one all-reduce
per parameter: each rank's summand enters the buffer multiplied by ep and the bucket is averaged over dp x ep, so
that a reduced gradient an earlier synchronised backward left in the buffer (the same on every rank) counts once when
the next backward accumulates onto it. Until its bucket is reduced such a parameter's ``.grad`` / ``.main_grad``
therefore holds ep times this rank's summand. A parameter sharded on it (an expert, ``Shard(0)`` on ep) has its
complete gradient already (the all-to-all brought every ep rank's tokens to it) and is reduced over dp only. Each
group of parameters reduced over the same dims gets its own buffers and buckets.

Plain-tensor parameters on such a mesh (expert parallelism with plain tensors, as in a captured pipeline stage whose
experts are this rank's ``[E / ep, ...]`` slice): the same two groups. A plain parameter marked as a piece over data
dims (:func:`vescale.core.sharded_state.mark_piece` with ``groups``, as :func:`~vescale.parallel.keep_local_experts`
marks the experts over ep) is reduced over dp and the other data dims; every other plain parameter is replicated over
the data dims (its gradient a summand, summed over them with dp's average).

A pipeline stage: :class:`DistributedDataParallel` implements ``vescale.pipe.StageGradSync`` structurally
(``no_sync``, ``defer_grad_sync``, ``finish_grad_sync``, ``split_backward``), without importing vescale-pipe.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.graph import get_gradient_edge
from torch.distributed.tensor import DTensor

from vescale.core.mesh import DATA_DIMS, dim_group, dim_size
from vescale.core.torch_internals import local_tensor, queue_end_of_backward
from vescale.parallel._grad_buckets import (  # noqa: F401  (_all_gather, _Bucket, _Slot: read by optimizer.py here)
    _all_gather,
    _Bucket,
    _reduce_scatter,
    _Reduction,
    _Slot,
    _summand_prehook,
    lay_out,
    plan_reductions,
)
from vescale.parallel.errors import DDPError

__all__ = ["DistributedDataParallel", "DDPOptions"]


@dataclass(frozen=True)
class DDPOptions:
    """How :class:`DistributedDataParallel` holds and reduces gradients (a value: compare, print, reuse it).

    ``bucket_size_mb``: the bytes of one bucket (positive). ``overlap``: reduce each bucket as soon as backward
    completes it (``False``: every bucket after backward). ``grad_dtype``: the dtype gradients are accumulated and
    reduced in (``None``: each parameter's own; the default fp32 gives bf16 parameters fp32 accumulation).
    ``zero_stage``: 0/1 all-reduce the buckets, 2 reduce-scatters them (each rank keeps its 1/dp slice; see
    :class:`~vescale.parallel.DistributedOptimizer`); ZeRO 3 is ``vescale.parallel.fully_shard_dp``. Raises
    :class:`DDPError` for a value out of range.
    """

    bucket_size_mb: float = 25
    overlap: bool = True
    grad_dtype: torch.dtype | None = torch.float32
    zero_stage: int = 0

    def __post_init__(self) -> None:
        if self.zero_stage not in (0, 1, 2):
            hint = " (ZeRO 3 is torch's fully_shard over the dp sub-mesh; see the README)" if self.zero_stage == 3 \
                else ""
            raise DDPError(f"zero_stage must be 0, 1 or 2, got {self.zero_stage!r}{hint}")
        if not self.bucket_size_mb > 0:
            raise DDPError(f"bucket_size_mb must be positive, got {self.bucket_size_mb!r}")


#: Keyword arguments DistributedDataParallel no longer takes, and what says the same thing now.
_REMOVED = {
    "late_params": "the pipeline engine hands a stage's tied parameters to ddp.defer_grad_sync(params) "
                   "(vescale.pipe.StageGradSync); outside a pipeline call it yourself",
    "wait_in_backward": "ddp.defer_grad_sync(()) leaves the reductions in flight at the end of backward "
                        "(then call ddp.finish_grad_sync() before reading the gradients)",
    "data_dims": "pass the mesh with those dims: DistributedDataParallel(module, mesh) sums over every dim of the "
                 "mesh besides dp that splits the batch (vescale.core.mesh.DATA_DIMS, e.g. ep)",
    "local_shards": "mark each plain piece with vescale.core.sharded_state.mark_piece(p, groups={'ep': group})",
}


def _refuse_old_keywords(kwargs: dict[str, Any]) -> None:
    """Raise :class:`DDPError` naming the new spelling of every removed keyword in ``kwargs`` (TypeError for others)."""
    fields = DDPOptions.__dataclass_fields__
    problems = [f"{k}= is gone: {_REMOVED[k]}" for k in kwargs if k in _REMOVED]
    moved = [f"{k}={v!r}" for k, v in kwargs.items() if k in fields]
    if moved:
        problems.append(f"{', '.join(moved)} is an option: pass DistributedDataParallel(module, mesh, "
                        f"DDPOptions({', '.join(moved)}))")
    unknown = [k for k in kwargs if k not in _REMOVED and k not in fields]
    if unknown:
        raise TypeError(f"DistributedDataParallel got unexpected keyword argument(s) {unknown}")
    if problems:
        raise DDPError("; ".join(problems))


class DistributedDataParallel(nn.Module):
    """Data parallelism over the dp dimension with bucketed, overlapped gradient reduction into a flat buffer.

    ``mesh`` is a 1-D DeviceMesh, an nD DeviceMesh with a ``"dp"`` dimension, or a ProcessGroup; gradients
    are averaged over that group only (TP DTensor parameters keep their placements). ``mesh=None`` is one data
    rank: gradients go into the buffer (in ``grad_dtype``: the fp32 gradients of bf16 masters) and nothing is
    communicated. Parameters are broadcast from dp rank 0 at construction, so replicas start identical. ``options``
    (:class:`DDPOptions`, default ``DDPOptions()``) sets the bucket size, overlap, gradient dtype and ZeRO stage.

    After a synchronised backward each parameter's ``.main_grad`` (the buffer view in ``grad_dtype``) holds the dp
    average. When ``grad_dtype`` equals the parameter dtype, ``.grad`` *is* that view and autograd accumulates into
    it in place, so any ``zero_grad`` works. Otherwise, with ``zero_stage=0``, ``.grad`` is a copy cast to the
    parameter dtype (accumulating into it or clearing it behaves as on one device, at the parameter dtype's
    precision); with ``zero_stage`` 1/2 it stays unset. With ``zero_stage=2`` a rank keeps only its slice of each
    reduced bucket: after a synchronised backward ``.grad`` and ``.main_grad`` are ``None`` (their buffer is freed;
    they are set again during the next backward). The slices accumulate as ``.grad`` does on one device: a second
    synchronised backward without :meth:`zero_grad` (or the optimizer's) in between adds its reduced gradient to them
    (:meth:`no_sync` does the same with one reduction instead of several). Setting ``.grad = None`` by hand clears
    nothing here: clear with ``zero_grad``. Read whole gradients with :meth:`reduced_grads`.
    ``zero_stage=3`` is PyTorch's ``fully_shard`` (see the package README).

    Inside :meth:`no_sync` backward only accumulates locally; the next backward outside it reduces the sum.
    Every rank of the dp group must run the same backward passes (same parameters receive gradients).

    Data dims (expert parallelism, see the module docstring): when ``mesh`` is an nD DeviceMesh with dims besides dp
    that split the batch (``ep`` larger than one), they must be dims of every parameter's DTensor mesh too.
    Parameters replicated there are reduced over dp x those dims (summed over them, averaged over dp), the others
    over dp only. With ZeRO each group's buckets are sharded over its own ranks. As for DTensors summed there, each
    rank's loss must be its share of the global loss (e.g. its rows' mean / ep). The parameters may instead all be
    plain tensors (a pipeline stage): those marked as pieces over data dims
    (``vescale.core.sharded_state.mark_piece(p, groups={"ep": group})``: experts kept as ``[E / ep, ...]`` slices,
    whose gradient the all-to-all already summed over ep) are reduced over dp and the data dims they are not split
    over; every other plain parameter is replicated over all data dims: reduced over dp x data dims like a
    replicated DTensor. A module mixing plain parameters with DTensors over the data dims, a DTensor marked as a
    piece over a data dim (its placements say that), a piece over the dp dim itself, or a piece's group that is not
    the ranks of the mesh's dim of that name is an error.

    A pipeline stage (``vescale.pipe.StageGradSync``, which ``PipeEngine.wrap_stages`` drives): see
    :meth:`defer_grad_sync`. The keywords ``late_params``, ``wait_in_backward``, ``data_dims`` and ``local_shards``
    (and the options as keywords) are refused with a :class:`DDPError` naming what replaced them.
    """

    #: The reduction runs in hooks on the parameters' gradient accumulators, which a split backward (BI then BW)
    #: reaches too: zero-bubble pipeline schedules may drive it (``vescale.pipe.StageGradSync``).
    split_backward = True

    def __init__(self, module: nn.Module, mesh, options: DDPOptions | None = None, **removed: Any) -> None:
        super().__init__()
        if removed:
            _refuse_old_keywords(removed)
        options = DDPOptions() if options is None else options
        if not isinstance(options, DDPOptions):
            raise DDPError(f"options must be a DDPOptions, got {type(options).__name__}")
        if mesh is not None and not dist.is_initialized():
            raise DDPError("DistributedDataParallel needs an initialised process group")
        self.module = module
        self.options = options
        if mesh is None:  # no data parallelism: the buffer (fp32 accumulation for masters) without any collective
            self.dp_group, self.dp_dim_name, self.dp_size, self.dp_rank = None, "dp", 1, 0
            self.data_dims: tuple[str, ...] = ()
        else:
            self.dp_group, self.dp_dim_name = _dp_group(mesh)
            self.dp_size = dist.get_world_size(self.dp_group)
            self.dp_rank = dist.get_rank(self.dp_group)
            self.data_dims = _data_dims(mesh, self.dp_dim_name)
        self.zero_stage = options.zero_stage
        self.overlap = options.overlap
        self.grad_dtype = options.grad_dtype
        self.bucket_bytes = int(options.bucket_size_mb * 1024 * 1024)
        self._sync_enabled = True
        self._callback_queued = False
        self._next_launch = 0
        self._next_free = 0  # ZeRO-2: the first launched bucket whose full buffer may still be held
        self._dirty = False  # some gradient reached the buffer since the last finish_grad_sync
        self._wait_in_backward = True  # False once defer_grad_sync was called: finish_grad_sync waits
        self._validate(module)
        params = [(fqn, p) for fqn, p in module.named_parameters() if p.requires_grad]
        dp = _Reduction(self.dp_dim_name, self.dp_group, self.dp_size, self.dp_rank)
        self._reductions = plan_reductions(params, mesh, dp, self.data_dims)
        self._hooks: list = []
        self._lay_out(late=set())
        self._broadcast_params()

    # -- construction ---------------------------------------------------------------------------------------------

    def _validate(self, module: nn.Module) -> None:
        device = None
        for fqn, p in module.named_parameters():
            if not p.requires_grad:
                continue
            local = local_tensor(p)
            if isinstance(p, DTensor) and self.dp_dim_name in (p.device_mesh.mesh_dim_names or ()):
                raise DDPError(f"parameter {fqn!r} is already a DTensor over mesh dim {self.dp_dim_name!r} "
                               f"(placements {p.placements}); DDP reduces over that dim itself")
            if not local.is_contiguous():
                raise DDPError(f"parameter {fqn!r} (local shape {tuple(local.shape)}) is not contiguous")
            if device is not None and local.device != device:
                raise DDPError(f"parameter {fqn!r} is on {local.device} but others are on {device}")
            device = local.device

    def _lay_out(self, late: set[int]) -> None:
        """(Re)build the buffers, buckets and slots with the ``late`` parameters (ids) last, and hook every
        parameter's gradient accumulator (removing earlier hooks). Local; allocates zeroed buffers."""
        for handle in self._hooks:
            handle.remove()
        self._late = late
        params = [(fqn, p) for fqn, p in self.module.named_parameters() if p.requires_grad]
        self.grad_buffers, self.buckets, self.slots = lay_out(params, self._reductions, late, self.grad_dtype,
                                                              self.bucket_bytes, self.zero_stage)
        self._num_early = sum(1 for b in self.buckets if not any(id(s.param) in late for s in b.slots))
        # The hook sits on each parameter's gradient accumulator node (as torch's DDP and Megatron hook it), not in
        # the tensor's post-accumulate-grad hook dict: a DTensor parameter moved by ``module.to()`` is swapped
        # (``torch.utils.swap_tensors``) and keeps that dict while the hook inside torch stays with the old tensor,
        # so hooks added to the dict later never run. The node is the current tensor's; holding it keeps it alive.
        self._grad_accs = [get_gradient_edge(slot.param).node for slot in self.slots.values()]
        self._hooks = [acc.register_hook(self._make_hook(slot))
                       for acc, slot in zip(self._grad_accs, self.slots.values())]
        # Gradients summed over data dims by the bucket: keep their Partial local values (see _as_summand), scaled
        # by the number of ranks summed over (the bucket averages over dp x those dims, see _Reduction)
        for acc, slot in zip(self._grad_accs, self.slots.values()):
            reduction = slot.buffer.reduction
            if not reduction.summed:
                continue
            dims = ()
            if isinstance(slot.param, DTensor):
                dims = tuple(slot.param.device_mesh.mesh_dim_names.index(d) for d in reduction.summed)
            self._hooks.append(acc.register_prehook(functools.partial(_summand_prehook, param=slot.param, dims=dims,
                                                                      scale=reduction.scale)))

    def defer_grad_sync(self, late: Sequence[torch.Tensor] = ()) -> None:
        """Leave the end of each synchronised backward to :meth:`finish_grad_sync`, and ``late``'s gradients too.

        From now on the end of a synchronised backward launches the reductions of the buckets backward has not
        launched yet and leaves them in flight (a pipeline sends its last gradients meanwhile); the caller calls
        :meth:`finish_grad_sync` before the next backward and before reading the gradients. ``late``: parameters
        whose gradient the caller completes after backward and before :meth:`finish_grad_sync` (a pipeline engine
        summing a tied weight's gradient over its pp stages): they get their own trailing bucket(s), which only
        :meth:`finish_grad_sync` reduces, so every gradient element is still reduced over dp exactly once.
        ``vescale.pipe.PipeEngine.wrap_stages`` calls this with the stage's tied parameters (the
        ``vescale.pipe.StageGradSync`` protocol). Call it before the first backward: it lays the buckets out again.
        Raises :class:`DDPError`, before any collective, for a gradient already held or a ``late`` tensor that is
        not one of this module's trainable parameters. Local.
        """
        unknown = [i for i, p in enumerate(late) if p not in self.slots]
        if unknown:
            raise DDPError(f"defer_grad_sync: late[{unknown[0]}] (shape {tuple(late[unknown[0]].shape)}) is not a "
                           "trainable parameter of the wrapped module")
        if self._dirty or any(b.shard_holds or b.full is not None for b in self.buckets) or any(
                s.param.grad is not None for s in self.slots.values()):
            raise DDPError("defer_grad_sync must be called before the first backward (it lays the gradient buckets "
                           "out again); gradients are already held")
        self._wait_in_backward = False
        ids = {id(p) for p in late}
        if ids != self._late:
            self._lay_out(ids)

    @torch.no_grad()
    def _broadcast_params(self) -> None:
        if self.dp_size == 1:
            return
        src = dist.get_global_rank(self.dp_group, 0)
        works = [dist.broadcast(local_tensor(s.param), src=src, group=self.dp_group, async_op=True)
                 for s in self.slots.values()]
        for w in works:
            w.wait()

    # -- backward -------------------------------------------------------------------------------------------------

    def _make_hook(self, slot: _Slot):
        def hook(grad_inputs, grad_outputs) -> None:  # after autograd accumulated into slot.param.grad
            self._on_grad_ready(slot)

        return hook

    @torch.no_grad()
    def _on_grad_ready(self, slot: _Slot) -> None:
        p = slot.param
        grad = p.grad
        if isinstance(grad, DTensor) and tuple(grad.placements) != tuple(p.placements):
            grad = grad.redistribute(p.device_mesh, p.placements)
        grad = local_tensor(grad)
        if slot.bucket.launched:
            # Its bucket is being (or was) reduced: this gradient would be lost, or race with the collective.
            raise DDPError(f"parameter {slot.fqn!r} received a gradient after its bucket {slot.bucket.index} was "
                           "launched for reduction: call finish_grad_sync() before the next backward, and run one "
                           "backward per parameter per synchronised pass (a parameter reached twice by reentrant "
                           "activation checkpointing cannot be reduced in buckets)")
        view = slot.view()
        self._dirty = True
        if p.dtype == slot.buffer.grad_dtype:
            if grad.data_ptr() != view.data_ptr():
                # A fresh gradient: .grad was None before this backward (set_to_none), so it replaces the buffer.
                view.copy_(grad)
                p.grad = slot.wrap(view)
        else:
            if slot.exposed is not None:
                # After a sync handed out a low-precision copy, .grad is the truth: either that copy with this
                # backward accumulated into it, or (the user cleared it) a fresh gradient.
                view.copy_(grad)
                slot.exposed = None
            else:
                view.add_(grad)  # accumulation micro-steps, in grad_dtype
            p.grad = None
        p.main_grad = view
        if not self._callback_queued:
            self._callback_queued = True
            queue_end_of_backward(self._end_of_backward)  # as torch DDP and FSDP2 do
        if self._sync_enabled and self.overlap:
            slot.bucket.ready += 1
            self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next_launch < self._num_early:
            bucket = self.buckets[self._next_launch]
            if bucket.ready < len(bucket.slots):
                break
            self._launch(bucket)
        # ZeRO-2: free the full buckets whose reduce-scatter is done, in launch order (no waiting in backward)
        while self.zero_stage == 2 and self._next_free < self._next_launch:
            work = self.buckets[self._next_free].work
            if work is not None and not work.is_completed():
                break
            self._complete(self.buckets[self._next_free])
            self._next_free += 1

    def _launch(self, bucket: _Bucket) -> None:
        data, reduction = bucket.data(), bucket.buffer.reduction
        # ZeRO-2: the reduction lands in the shard, or, when the shard still holds an earlier synchronised backward's
        # gradient (no zero_grad since), is added to it when it completes, as one device accumulates into .grad
        if bucket.shard_grad is not None:
            out = bucket.shard_grad if not bucket.shard_holds else torch.empty_like(bucket.shard_grad)
            bucket.incoming = out if bucket.shard_holds else None
            bucket.shard_holds = True
        if reduction.size == 1:
            bucket.work = None
            if bucket.shard_grad is not None:
                out.copy_(data)
        elif bucket.shard_grad is not None:
            bucket.work = _reduce_scatter(out, data, op=dist.ReduceOp.AVG, group=reduction.group,
                                          async_op=True)
        else:
            bucket.work = dist.all_reduce(data, op=dist.ReduceOp.AVG, group=reduction.group, async_op=True)
        bucket.launched = True
        self._next_launch = bucket.index + 1

    def _complete(self, bucket: _Bucket) -> None:
        """Wait for a launched bucket's reduction; with ZeRO-2 free its full buffer (the shard holds the result)."""
        if bucket.work is not None:
            bucket.work.wait()
            bucket.work = None
        if bucket.incoming is not None:
            bucket.shard_grad.add_(bucket.incoming)
            bucket.incoming = None
        if bucket.shard_grad is not None:
            self._release(bucket)

    def _release(self, bucket: _Bucket) -> None:
        """Drop a ZeRO-2 bucket's full-size buffer and every reference to it (``.grad`` views, ``main_grad``)."""
        if bucket.full is None:
            return
        for slot in bucket.slots:
            p = slot.param
            if p.grad is not None and slot.is_view(local_tensor(p.grad)):
                p.grad = None
            if getattr(p, "main_grad", None) is not None:
                p.main_grad = None
        bucket.full = None

    def _end_of_backward(self) -> None:
        self._callback_queued = False
        if self._sync_enabled:
            self._finish(late=False)

    @torch.no_grad()
    def finish_grad_sync(self) -> None:
        """Launch the buckets not yet reduced, wait for every reduction, and expose the averaged gradients.

        Called automatically at the end of a synchronised backward, unless :meth:`defer_grad_sync` was called
        (then that backward leaves the reductions in flight and the late buckets pending). Calling it again is a
        no-op until the next backward. Parameters that got no gradient contribute zeros. Raises :class:`DDPError`
        (before any collective) when a parameter holds a gradient that autograd accumulated without running DDP's
        hook, which would otherwise be left out of the reduction silently.
        """
        self._check_hooks_saw_grads()
        self._finish(late=True)

    def _check_hooks_saw_grads(self) -> None:
        # After DDP's hook a gradient lives in the buffer: .grad is the buffer view, the low-precision copy handed
        # out by the last sync, or None. Anything else was accumulated behind the hook's back.
        for slot in self.slots.values():
            grad = slot.param.grad
            if grad is None:
                continue
            local = local_tensor(grad)
            if not slot.is_view(local) and (slot.exposed is None or local.data_ptr() != slot.exposed.data_ptr()):
                raise DDPError(f"parameter {slot.fqn!r} has a gradient that DistributedDataParallel's hook never "
                               "saw, so it would not be reduced over dp: the parameter tensor was replaced or "
                               "swapped after DDP was built (e.g. module.to() or load_state_dict(assign=True)); "
                               "build DistributedDataParallel after moving or loading the module")

    def _finish(self, late: bool) -> None:
        if not self._dirty:
            return
        for bucket in self.buckets[self._next_launch:self._num_early]:  # empty once launched (_launch advances)
            self._launch(bucket)
        if not late and (self._num_early < len(self.buckets) or not self._wait_in_backward):
            # Leave the reductions in flight: a pipeline sends its last gradients meanwhile; the late buckets and
            # the wait for all of them are finish_grad_sync's.
            return
        for bucket in self.buckets[self._num_early:]:
            self._launch(bucket)
        for bucket in self.buckets:
            self._complete(bucket)  # (ZeRO-2: frees its full buffer: a rank keeps only its shards)
            bucket.ready, bucket.launched = 0, False
        self._next_launch = self._next_free = 0
        self._dirty = False
        if self.zero_stage:
            return  # DistributedOptimizer reads the buffer (zero_stage 1) or the shard (zero_stage 2)
        for slot in self.slots.values():
            p = slot.param
            if p.dtype != slot.buffer.grad_dtype:
                p.grad = slot.wrap(slot.view().to(p.dtype))
                slot.exposed = local_tensor(p.grad)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally; the first backward after the block reduces them."""
        previous = self._sync_enabled
        self._sync_enabled = False
        try:
            yield
        finally:
            self._sync_enabled = previous

    @torch.no_grad()
    def reduced_grads(self) -> dict[str, torch.Tensor]:
        """``{fqn: the dp-averaged gradient}`` of every gradient-requiring parameter, whole on every dp rank.

        Each value is a fresh tensor in ``grad_dtype`` laid out as its parameter is (a DTensor with the parameter's
        mesh and placements, or a plain tensor), so ``full_tensor()`` gives the single-device gradient. Finishes a
        pending gradient sync first (a no-op when none is pending), so after ``no_sync`` micro-steps it reduces
        them. ``zero_stage`` 0/1 copy the reduced buffer; ``zero_stage=2``, whose ranks hold only their slice of each
        reduced bucket, all-gathers every bucket's slices over dp (one collective per bucket, every dp rank must
        call it). For inspection (tests, ``train.py --grad-dump``), not for the step: it copies every gradient.
        """
        self.finish_grad_sync()
        out: dict[str, torch.Tensor] = {}
        for bucket in self.buckets:
            reduction = bucket.buffer.reduction
            if bucket.shard_grad is None:
                data = bucket.data()
            elif reduction.size > 1:
                data = bucket.shard_grad.new_empty(bucket.numel)
                _all_gather(data, bucket.shard_grad, group=reduction.group)
            else:
                data = bucket.shard_grad
            for slot in bucket.slots:
                at = slot.start - bucket.start
                out[slot.fqn] = slot.wrap(data[at:at + slot.numel].view(slot.local_shape).clone())
        return out

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradient buffer (every bucket) and the parameters' ``.grad``.

        ``set_to_none`` applies to gradients that are not views of the buffer; buffer views are zeroed in place.
        With ZeRO-2 this also zeroes the reduced shards and the full bucket buffers still held (between ``no_sync``
        micro-steps).
        """
        for buf in self.grad_buffers:
            buf.data.zero_()
            for bucket in buf.buckets:
                if bucket.shard_grad is not None:
                    bucket.shard_grad.zero_()
                    bucket.shard_holds = False
                if bucket.full is not None:
                    bucket.full.zero_()
        for slot in self.slots.values():
            p = slot.param
            slot.exposed = None
            if p.grad is not None and not slot.is_view(local_tensor(p.grad)):
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.zero_()

    # -- module plumbing ------------------------------------------------------------------------------------------

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def state_dict(self, *args, **kwargs):
        """The wrapped module's state dict (no ``module.`` prefix)."""
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    def grad_buffer_bytes(self) -> int:
        """Bytes held by gradient buffers on this rank now: the flat buffers (zero_stage 0/1), or (zero_stage 2) the
        reduced shards plus the full bucket buffers alive (from a bucket's first gradient to its reduce-scatter)."""
        total = sum(b.data.numel() * b.data.element_size() for b in self.grad_buffers)
        for b in self.buckets:
            for t in (b.shard_grad, b.full):
                if t is not None:
                    total += t.numel() * t.element_size()
        return total


def _dp_group(mesh, dim: str = "dp"):
    """(process group, mesh dim name) for the data-parallel dimension ``dim`` of a mesh, or a group as is."""
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(mesh, (DeviceMesh, dist.ProcessGroup)):
        raise DDPError(f"mesh must be a DeviceMesh or ProcessGroup, got {type(mesh).__name__}")
    found = dim_group(mesh, dim)
    if found is None:
        raise DDPError(f"mesh has dimensions {list(mesh.mesh_dim_names or ())} (shape {tuple(mesh.shape)}); "
                       f"DistributedDataParallel needs a 1-D mesh or one with a {dim!r} dimension")
    return found


def _data_dims(mesh, dp_dim: str) -> tuple[str, ...]:
    """The dims of ``mesh`` besides ``dp_dim`` that split the batch (``DATA_DIMS``, larger than one), mesh order."""
    if not hasattr(mesh, "mesh_dim_names") or mesh.ndim == 1:
        return ()  # a group, or a 1-D mesh: all of it is dp
    return tuple(d for d in mesh.mesh_dim_names or () if d in DATA_DIMS and d != dp_dim and dim_size(mesh, d) > 1)
