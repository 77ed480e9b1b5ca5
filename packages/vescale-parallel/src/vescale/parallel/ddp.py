"""Megatron-style data parallelism: a contiguous gradient buffer per dtype, split into buckets reduced in backward.

:class:`DistributedDataParallel` wraps an unmodified module whose parameters are plain tensors or DTensors (for
example sharded by tensor parallelism over a ``tp`` mesh dimension). Gradients are reduced only over the data-parallel
group. Each parameter's gradient lives in a slice of a flat buffer; a per-parameter hook (run by autograd after the
gradient is accumulated) marks it ready, and a bucket whose parameters are all ready is reduced asynchronously while
the rest of backward runs. Buckets are launched strictly in order, so every rank issues the same collectives in the
same order. The end of backward waits for every reduction, so after ``loss.backward()`` the gradients are averaged
over the dp group, as a single device would compute them for the whole batch.

``zero_stage=0/1`` all-reduce buckets (every rank holds the averaged gradient); ``zero_stage=2`` reduce-scatters
them, so each rank only holds the averaged gradient of its own contiguous 1/dp slice of every bucket (see
:class:`~vescale.parallel.DistributedOptimizer`, which owns those slices). Under ZeRO-2 a bucket's full-size
buffer exists only from its first gradient in backward until its reduce-scatter completes (freed then, without
waiting in backward, or at the end of backward at the latest), so between steps a rank holds ``grad bytes / dp``
(plus padding of fewer than dp elements per bucket); ``no_sync`` micro-steps keep the full buffers of the buckets
they touch until the synchronised backward reduces them.

``data_dims`` (expert parallelism): mesh dims of the parameters' own DTensor mesh over which the batch is split as
over dp (``ep``: each ep rank runs the dense layers on its own rows). A parameter replicated on such a dim gets a
``Partial`` gradient there; DDP sums it over that dim in the same bucketed reduction as over dp (one flat group,
dp x ep), instead of one all-reduce per parameter: each rank's summand enters the buffer multiplied by ep and the
bucket is averaged over dp x ep, so that a reduced gradient an earlier synchronised backward left in the buffer (the
same on every rank) counts once when the next backward accumulates onto it. Until its bucket is reduced such a
parameter's ``.grad`` / ``.main_grad`` therefore holds ep times this rank's summand. A parameter sharded on it (an
expert, ``Shard(0)`` on ep) has its complete gradient already (the all-to-all brought every ep rank's tokens to
it) and is reduced over dp only. Each group of parameters reduced over the same dims gets its own buffers and
buckets (see :class:`_Reduction`).

Plain-tensor parameters with ``data_dims`` (expert parallelism with plain tensors, as in a captured pipeline stage
whose experts are this rank's ``[E / ep, ...]`` slice): the same two groups. A plain parameter marked as a piece over
data dims (:func:`vescale.core.sharded_state.mark_piece` with ``groups``, as
:func:`~vescale.parallel.keep_local_experts` marks the experts over ep) is reduced over dp and the other data dims;
every other plain parameter is replicated over the data dims (its gradient a summand, summed over them with dp's
average).
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.graph import get_gradient_edge
from torch.distributed.tensor import DTensor, Partial, Replicate

from vescale.core.mesh import dim_group, sub_mesh
from vescale.core.sharded_state import piece_of
from vescale.core.torch_internals import flattened_mesh, local_tensor, queue_end_of_backward
from vescale.parallel.errors import DDPError

__all__ = ["DistributedDataParallel"]


# torch 2.13's spelling of the single-tensor collectives (``*_into_tensor`` / ``*_tensor`` are deprecated there).
_reduce_scatter = dist.reduce_scatter_single
_all_gather = dist.all_gather_single


@dataclass(eq=False)
class _Slot:
    """Where one parameter's gradient lives: elements ``[start, start + numel)`` of its buffer (offsets count in the
    whole buffer), viewed as ``local_shape``; with ZeRO-2 in its bucket's own full-size buffer while that exists."""

    fqn: str
    param: nn.Parameter
    buffer: _GradBuffer
    bucket: _Bucket
    start: int
    numel: int
    local_shape: torch.Size
    exposed: torch.Tensor | None = None  # the low-precision .grad copy finish_grad_sync handed out, if any

    def view(self) -> torch.Tensor:
        """The gradient's place in the buffer (with ZeRO-2 this allocates the bucket's buffer, zeroed, if freed)."""
        at = self.start - self.bucket.start
        return self.bucket.data()[at:at + self.numel].view(self.local_shape)

    def is_view(self, grad: torch.Tensor | None) -> bool:
        """Whether ``grad`` (a local tensor) is :meth:`view` (never allocates)."""
        return grad is not None and self.bucket.allocated() and grad.data_ptr() == self.view().data_ptr()

    def wrap(self, local: torch.Tensor) -> torch.Tensor:
        """``local`` dressed as the parameter is (a DTensor with the same mesh and placements, or as is)."""
        p = self.param
        if isinstance(p, DTensor):
            return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                      stride=p.stride())
        return local


@dataclass(eq=False)
class _Bucket:
    """A contiguous range ``[start, end)`` of a buffer, padded so that ``end - start`` is a multiple of dp.

    With ZeRO-2 the bucket's full-size gradient lives in its own tensor (``full``), created zeroed when the first
    gradient reaches the bucket and freed once the reduce-scatter has written this rank's slice into ``shard_grad``:
    between steps a rank holds only the shards (1/dp of the gradients, plus padding)."""

    index: int
    buffer: _GradBuffer
    start: int
    end: int
    slots: list[_Slot] = field(default_factory=list)
    ready: int = 0
    work: object | None = None
    launched: bool = False
    shard_grad: torch.Tensor | None = None  # zero_stage 2: this rank's reduced slice
    full: torch.Tensor | None = None  # zero_stage 2: the full-size gradient, while the bucket holds one
    shard_holds: bool = False  # zero_stage 2: shard_grad holds a reduced gradient no zero_grad has cleared since
    incoming: torch.Tensor | None = None  # zero_stage 2: a reduction in flight, added to shard_grad when it completes

    @property
    def numel(self) -> int:
        return self.end - self.start

    def allocated(self) -> bool:
        """Whether the bucket's full-size gradient exists (always, but with ZeRO-2 between backward and reduction)."""
        return self.shard_grad is None or self.full is not None

    def data(self) -> torch.Tensor:
        if self.shard_grad is None:
            return self.buffer.data[self.start:self.end]
        if self.full is None:
            self.full = self.shard_grad.new_zeros(self.numel)  # (a Tensor method: no factory capture can see it)
        return self.full


@dataclass(eq=False)
class _Reduction:
    """The group a set of parameters' gradients is reduced over: dp, or dp and ``data_dims`` flattened.

    ``name`` is ``"dp"`` or the dims joined by ``+`` (``"dp+ep"``), the key gradient clipping sums ZeRO shards under.
    ``summed`` names the data dims reduced here besides dp: gradients are summed there (they are ``Partial`` sums)
    and averaged over dp. Every bucket is reduced with ``AVG`` over the whole group; a summand enters the buffer
    multiplied by :attr:`scale` (the product of the ``summed`` dims' sizes, see :func:`_summand_prehook`), so the
    average is the sum over ``summed`` of the average over dp, and a gradient already reduced (identical on every
    rank, as an earlier synchronised backward leaves it in the buffer) counts once, as on one device.
    """

    name: str
    group: dist.ProcessGroup
    size: int
    rank: int
    summed: tuple[str, ...] = ()
    dp_size: int = 1

    @property
    def scale(self) -> int:
        """What a summand is multiplied by on its way into the buffer: the number of ranks it is summed over."""
        return self.size // self.dp_size


@dataclass(eq=False)
class _GradBuffer:
    """One flat gradient buffer holding every parameter of one (reduction, param dtype, grad dtype) triple.

    With ZeRO-2 ``data`` is empty (it only carries dtype and device): each bucket holds its own full-size buffer
    while it has gradients (see :class:`_Bucket`)."""

    param_dtype: torch.dtype
    grad_dtype: torch.dtype
    data: torch.Tensor
    buckets: list[_Bucket] = field(default_factory=list)
    reduction: _Reduction | None = None


class DistributedDataParallel(nn.Module):
    """Data parallelism over the dp dimension with bucketed, overlapped gradient reduction into a flat buffer.

    ``mesh`` is a 1-D DeviceMesh, an nD DeviceMesh with a ``"dp"`` dimension, or a ProcessGroup; gradients
    are averaged over that group only (TP DTensor parameters keep their placements). ``mesh=None`` is one data
    rank: gradients go into the buffer (in ``grad_dtype``: the fp32 gradients of bf16 masters) and nothing is
    communicated. Parameters are broadcast from dp
    rank 0 at construction, so replicas start identical. ``grad_dtype`` is the dtype gradients are accumulated and
    reduced in (``None``: each parameter's own dtype); with bf16 parameters the default fp32 gives fp32 gradient
    accumulation. ``bucket_size_mb`` bounds the bytes of one bucket; ``overlap=False`` reduces every bucket after
    backward instead of during it.

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

    ``late_params``: parameters whose gradient someone else completes after backward and before the reduction (a
    pipeline engine summing a tied weight's gradient over its pp stages). They get their own trailing bucket(s),
    which backward never launches: the end of a synchronised backward launches the other buckets' reductions and
    leaves them in flight; :meth:`finish_grad_sync` (call it before the next backward) then reduces the late ones and
    waits for all, so every gradient element is still reduced over dp exactly once. ``wait_in_backward=False``
    leaves the reductions in flight at the end of backward in any case (for a caller with more work after it, a
    pipeline sending gradients upstream); then call :meth:`finish_grad_sync` before reading the gradients.

    ``data_dims`` (e.g. ``("ep",)`` for :func:`~vescale.parallel.parallelize_experts`): dims of ``mesh`` (which then
    must be a DeviceMesh with dp and those dims) that are also dims of every parameter's DTensor mesh and split the
    batch. Parameters replicated there are reduced over dp x those dims (summed over them, averaged over dp), the
    others over dp only (see the module docstring). With ZeRO each group's buckets are sharded over its own ranks.
    As for DTensors summed there, each rank's loss must be its share of the global loss (e.g. its rows' mean / ep).

    With ``data_dims`` the parameters may instead all be plain tensors (a pipeline stage). Those marked as pieces
    over data dims (``vescale.core.sharded_state.mark_piece(p, groups={"ep": group})``: experts kept as
    ``[E / ep, ...]`` slices, whose gradient the all-to-all already summed over ep) are reduced over dp and the data
    dims they are not split over; every other plain parameter is replicated over all data dims: reduced over dp x
    data dims like a replicated DTensor. A module mixing plain parameters with DTensors over the data dims, a
    DTensor marked as a piece over a data dim (its placements say that), a piece over the dp dim itself, or a
    piece's group that is not the ranks of the mesh's dim of that name is an error.
    """

    def __init__(self, module: nn.Module, mesh, *, bucket_size_mb: float = 25, overlap: bool = True,
                 grad_dtype: torch.dtype | None = torch.float32, zero_stage: int = 0,
                 late_params=(), wait_in_backward: bool = True, data_dims: Sequence[str] = ()) -> None:
        super().__init__()
        if zero_stage not in (0, 1, 2):
            hint = " (ZeRO 3 is torch's fully_shard over the dp sub-mesh; see the README)" if zero_stage == 3 else ""
            raise DDPError(f"zero_stage must be 0, 1 or 2, got {zero_stage!r}{hint}")
        if not bucket_size_mb > 0:
            raise DDPError(f"bucket_size_mb must be positive, got {bucket_size_mb!r}")
        if mesh is not None and not dist.is_initialized():
            raise DDPError("DistributedDataParallel needs an initialised process group")
        self.module = module
        if mesh is None:  # no data parallelism: the buffer (fp32 accumulation for masters) without any collective
            if data_dims:
                raise DDPError("data_dims need a DeviceMesh with a dp dim, not mesh=None")
            self.dp_group, self.dp_dim_name, self.dp_size, self.dp_rank = None, "dp", 1, 0
        else:
            self.dp_group, self.dp_dim_name = _dp_group(mesh)
            self.dp_size = dist.get_world_size(self.dp_group)
            self.dp_rank = dist.get_rank(self.dp_group)
        self.zero_stage = zero_stage
        self.overlap = overlap
        self.grad_dtype = grad_dtype
        self.bucket_bytes = int(bucket_size_mb * 1024 * 1024)
        self._sync_enabled = True
        self._callback_queued = False
        self._next_launch = 0
        self._next_free = 0  # ZeRO-2: the first launched bucket whose full buffer may still be held
        self._dirty = False  # some gradient reached the buffer since the last finish_grad_sync
        self.wait_in_backward = wait_in_backward
        self._validate(module)
        self.data_dims = tuple(data_dims)
        self._reductions = self._plan_reductions(module, mesh)
        self._late = {id(p) for p in late_params}
        self.grad_buffers: list[_GradBuffer] = []
        self.buckets: list[_Bucket] = []
        self.slots: dict[nn.Parameter, _Slot] = {}
        self._build_buffers(module)
        self._num_early = sum(1 for b in self.buckets if not any(id(s.param) in self._late for s in b.slots))
        self._broadcast_params()
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

    def _plan_reductions(self, module: nn.Module, mesh) -> dict[int, _Reduction]:
        """``{id(param): its _Reduction}``; checks ``data_dims`` and the parameters' piece marks against ``mesh`` and
        every parameter (local, no collective: a bad layout raises DDPError on every rank)."""
        dp = _Reduction(self.dp_dim_name, self.dp_group, self.dp_size, self.dp_rank)
        params = [(fqn, p) for fqn, p in module.named_parameters() if p.requires_grad]
        for fqn, p in params:
            piece = piece_of(p)
            if piece is not None and self.dp_dim_name in piece.group_map:
                raise DDPError(f"parameter {fqn!r} is marked as a piece over {self.dp_dim_name!r} (mark_piece "
                               f"groups {sorted(piece.group_map)}), the dim DDP averages over: its replicas over "
                               f"{self.dp_dim_name!r} must be whole")
        if not self.data_dims:
            return {id(p): dp for _, p in params}
        names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
        missing = [d for d in (self.dp_dim_name, *self.data_dims) if d not in names]
        if missing or self.dp_dim_name in self.data_dims:
            raise DDPError(f"data_dims {list(self.data_dims)} need a DeviceMesh with dims {self.dp_dim_name!r} and "
                           f"{list(self.data_dims)} (distinct), got {list(names) or type(mesh).__name__}")
        groups = {d: dist.get_process_group_ranks(sub_mesh(mesh, d).get_group()) for d in self.data_dims}
        # the plain pieces over data dims: {fqn: (parameter, the data dims it is split over)}
        split = {fqn: (p, [d for d in self.data_dims if d in piece.group_map]) for fqn, p in params
                 if (piece := piece_of(p)) is not None and any(d in piece.group_map for d in self.data_dims)}
        for fqn, (p, dims) in sorted(split.items()):
            if isinstance(p, DTensor):
                raise DDPError(f"parameter {fqn!r} is a DTensor (placements {p.placements}) marked as a piece over "
                               f"data dims {dims} (mark_piece groups): its placements say where it is split")
            for d in dims:
                ranks = dist.get_process_group_ranks(piece_of(p).group_map[d])
                if ranks != groups[d]:
                    raise DDPError(f"parameter {fqn!r} is marked as a piece over {d!r} with ranks {ranks}, but the "
                                   f"DDP mesh's dim {d!r} holds ranks {groups[d]}; mark it with that mesh's group")
        plain = [fqn for fqn, p in params if not isinstance(p, DTensor)]
        if plain and len(plain) < len(params):
            dtensor, dt = next((fqn, p) for fqn, p in params if isinstance(p, DTensor))
            names = list(dt.device_mesh.mesh_dim_names or ())
            raise DDPError(f"parameter {plain[0]!r} is not a DTensor over data dim {self.data_dims[0]!r} but a plain "
                           f"tensor, while {dtensor!r} is a DTensor over {names}: with data_dims the parameters are "
                           "all DTensors over them (parallelize the model over them before wrapping it) or all plain "
                           "tensors, this rank's pieces marked with vescale.core.sharded_state.mark_piece")
        keys: dict[int, tuple[str, ...]] = {}
        for fqn, p in params:  # every check first, then the groups (creating one is collective)
            if not isinstance(p, DTensor):
                # a plain parameter: a piece over the data dims its mark names, replicated over the other data dims
                keys[id(p)] = tuple(d for d in self.data_dims if d not in split.get(fqn, (None, ()))[1])
                continue
            pnames = tuple(p.device_mesh.mesh_dim_names or ()) if isinstance(p, DTensor) else ()
            summed = []
            for d in self.data_dims:
                if d not in pnames:
                    raise DDPError(f"parameter {fqn!r} is not a DTensor over data dim {d!r} (its mesh dims: "
                                   f"{list(pnames)}); parallelize the model over {d!r} before wrapping it")
                i = pnames.index(d)
                if dist.get_process_group_ranks(p.device_mesh.get_group(i)) != groups[d]:
                    raise DDPError(f"parameter {fqn!r}: its mesh dim {d!r} holds ranks "
                                   f"{dist.get_process_group_ranks(p.device_mesh.get_group(i))}, the DDP mesh's "
                                   f"{groups[d]}; build both from the same mesh")
                if isinstance(p.placements[i], Replicate):
                    summed.append(d)
            keys[id(p)] = tuple(summed)
        by_dims: dict[tuple[str, ...], _Reduction] = {(): dp}
        for key in sorted(set(keys.values())):  # the same order on every rank
            if key not in by_dims:
                flat = flattened_mesh(sub_mesh(mesh, self.dp_dim_name, *key)).get_group()
                by_dims[key] = _Reduction("+".join((self.dp_dim_name, *key)), flat, dist.get_world_size(flat),
                                          dist.get_rank(flat), key, self.dp_size)
        return {pid: by_dims[key] for pid, key in keys.items()}

    def _build_buffers(self, module: nn.Module) -> None:
        # Backward visits parameters roughly in reverse registration order: fill buckets in that order so the first
        # bucket completes first.
        params = [(fqn, p) for fqn, p in module.named_parameters() if p.requires_grad][::-1]
        by_dtype: dict[tuple[bool, str, torch.dtype, torch.dtype], list[tuple[str, nn.Parameter]]] = {}
        for fqn, p in params:
            key = (id(p) in self._late, self._reductions[id(p)].name, p.dtype, self.grad_dtype or p.dtype)
            by_dtype.setdefault(key, []).append((fqn, p))
        # late parameters' buffers (and so buckets) come after all the others
        for (_, _, pdtype, gdtype), group in sorted(by_dtype.items(), key=lambda kv: kv[0][0]):
            reduction = self._reductions[id(group[0][1])]
            size = reduction.size
            elem = torch.empty((), dtype=gdtype).element_size()
            layout: list[tuple[int, int, list[tuple[str, nn.Parameter, int]]]] = []  # (start, end, members)
            offset, members, bucket_start = 0, [], 0
            for fqn, p in group:
                n = local_tensor(p).numel()
                members.append((fqn, p, offset))
                offset += n
                if (offset - bucket_start) * elem >= self.bucket_bytes:
                    end = bucket_start + _round_up(offset - bucket_start, size)
                    layout.append((bucket_start, end, members))
                    offset = bucket_start = end
                    members = []
            if members:
                end = bucket_start + _round_up(offset - bucket_start, size)
                layout.append((bucket_start, end, members))
                offset = end
            device = local_tensor(group[0][1]).device
            flat = torch.zeros(0 if self.zero_stage == 2 else offset, dtype=gdtype, device=device)
            buf = _GradBuffer(pdtype, gdtype, flat, reduction=reduction)
            for start, end, mem in layout:
                bucket = _Bucket(len(self.buckets), buf, start, end)
                if self.zero_stage == 2:
                    bucket.shard_grad = torch.zeros(bucket.numel // size, dtype=gdtype, device=device)
                for fqn, p, off in mem:
                    local = local_tensor(p)
                    slot = _Slot(fqn, p, buf, bucket, off, local.numel(), local.shape)
                    bucket.slots.append(slot)
                    self.slots[p] = slot
                buf.buckets.append(bucket)
                self.buckets.append(bucket)
            self.grad_buffers.append(buf)

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

        Called automatically at the end of a synchronised backward (which leaves the ``late_params`` buckets
        pending); calling it again is a no-op until the next backward. Parameters that got no gradient contribute
        zeros. Raises :class:`DDPError` (before any collective) when a parameter holds a gradient that autograd
        accumulated without running DDP's hook, which would otherwise be left out of the reduction silently.
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
        if not late and (self._num_early < len(self.buckets) or not self.wait_in_backward):
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


def _summand_prehook(grad_outputs, *, param: torch.Tensor, dims: tuple[int, ...], scale: int):
    """Before accumulation: the incoming gradient as ``scale`` times this rank's summand over the data dims.

    A DTensor gradient becomes its summand over mesh ``dims`` (see :func:`_as_summand`), so that the parameter's own
    hook (``parallelize_module`` brings ``.grad`` to the parameter's placements) does not all-reduce it there: the
    bucket does. A plain gradient is this rank's summand already. ``scale`` (the number of ranks summed over) makes
    the bucket's average over dp x data dims their sum (see :class:`_Reduction`)."""
    grad = grad_outputs[0]
    if grad is None:
        return None
    if isinstance(grad, DTensor) and isinstance(param, DTensor):
        grad = _as_summand(grad, param.device_mesh, dims, scale=scale)
    elif scale != 1:
        grad = grad * scale
    else:
        return None
    return (grad,) + tuple(grad_outputs[1:])


def _as_summand(grad: DTensor, mesh, dims: tuple[int, ...], scale: float = 1) -> DTensor:
    """``grad`` labelled ``Replicate`` on mesh ``dims`` with local values whose sum over those dims is ``scale``
    times its value.

    A ``Partial`` sum there keeps its local values (no communication; times ``scale``). Any other layout there
    (``Replicate``, a ``Shard``, another partial kind) is first made ``Replicate`` on those dims and then kept by the
    ranks at coordinate 0 of all of them, zeros elsewhere, which is exact. Other dims are left as they are.
    """
    placements = list(grad.placements)
    other = [i for i in dims if not (type(placements[i]) is Partial and placements[i].reduce_op == "sum")]
    if other:
        grad = grad.redistribute(mesh, [Replicate() if i in other else p for i, p in enumerate(placements)])
    local = local_tensor(grad)
    if any(mesh.get_local_rank(i) != 0 for i in other):
        local = torch.zeros_like(local)
    elif scale != 1:
        local = local * scale
    labelled = [Replicate() if i in dims else p for i, p in enumerate(grad.placements)]
    return DTensor.from_local(local, mesh, labelled, run_check=False, shape=grad.shape, stride=grad.stride())


def _round_up(n: int, k: int) -> int:
    return max(k, math.ceil(n / k) * k)


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
