"""DDP's gradient layout: which group each parameter is reduced over, and the flat buffers and buckets holding them.

:func:`plan_reductions` assigns every trainable parameter a :class:`_Reduction` (dp, or dp with the other data dims of
the mesh flattened: ``dp+ep``); :func:`lay_out` packs the gradients of each (late, reduction, param dtype, grad dtype)
group into one flat :class:`_GradBuffer`, cut into :class:`_Bucket` s of about ``bucket_bytes`` whose sizes are
multiples of the reduction's group size (ZeRO-2 reduce-scatters them evenly). Both are local: neither issues a
collective, but :func:`plan_reductions` creates the flattened groups (every rank must call it, in the same order).
:class:`~vescale.parallel.DistributedDataParallel` owns the result and drives the reductions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate

from vescale.core.mesh import sub_mesh
from vescale.core.sharded_state import piece_of
from vescale.core.torch_internals import flattened_mesh, local_tensor
from vescale.parallel.errors import DDPError

__all__: list[str] = []

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



def plan_reductions(params: list[tuple[str, nn.Parameter]], mesh, dp: _Reduction,
                    data_dims: tuple[str, ...]) -> dict[int, _Reduction]:
    """``{id(param): its _Reduction}`` for the trainable ``params`` (``(fqn, parameter)``): ``dp`` for every one
    without ``data_dims`` (the dims of ``mesh`` besides dp that split the batch, e.g. ``("ep",)``); with them, a
    DTensor replicated on a data dim (or a plain parameter not marked as a piece over it) is also reduced there.
    Checks the parameters' piece marks against ``mesh`` and every parameter first (no collective: a bad layout
    raises DDPError on every rank), then creates the flattened groups (collective), in the same order on every
    rank."""
    for fqn, p in params:
        piece = piece_of(p)
        if piece is not None and dp.name in piece.group_map:
            raise DDPError(f"parameter {fqn!r} is marked as a piece over {dp.name!r} (mark_piece "
                           f"groups {sorted(piece.group_map)}), the dim DDP averages over: its replicas over "
                           f"{dp.name!r} must be whole")
    if not data_dims:
        return {id(p): dp for _, p in params}
    groups = {d: dist.get_process_group_ranks(sub_mesh(mesh, d).get_group()) for d in data_dims}
    # the plain pieces over data dims: {fqn: (parameter, the data dims it is split over)}
    split = {fqn: (p, [d for d in data_dims if d in piece.group_map]) for fqn, p in params
             if (piece := piece_of(p)) is not None and any(d in piece.group_map for d in data_dims)}
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
        raise DDPError(f"parameter {plain[0]!r} is not a DTensor over data dim {data_dims[0]!r} but a plain "
                       f"tensor, while {dtensor!r} is a DTensor over {names}: on a mesh whose data dims "
                       f"{list(data_dims)} split the batch besides dp, the parameters are all DTensors over them "
                       "(parallelize the model over them before wrapping it) or all plain tensors, this rank's "
                       "pieces marked with vescale.core.sharded_state.mark_piece")
    keys: dict[int, tuple[str, ...]] = {}
    for fqn, p in params:  # every check first, then the groups (creating one is collective)
        if not isinstance(p, DTensor):
            # a plain parameter: a piece over the data dims its mark names, replicated over the other data dims
            keys[id(p)] = tuple(d for d in data_dims if d not in split.get(fqn, (None, ()))[1])
            continue
        pnames = tuple(p.device_mesh.mesh_dim_names or ()) if isinstance(p, DTensor) else ()
        summed = []
        for d in data_dims:
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
            flat = flattened_mesh(sub_mesh(mesh, dp.name, *key)).get_group()
            by_dims[key] = _Reduction("+".join((dp.name, *key)), flat, dist.get_world_size(flat),
                                      dist.get_rank(flat), key, dp.size)
    return {pid: by_dims[key] for pid, key in keys.items()}


def lay_out(params: list[tuple[str, nn.Parameter]], reductions: dict[int, _Reduction], late: set[int],
            grad_dtype: torch.dtype | None, bucket_bytes: int,
            zero_stage: int) -> tuple[list[_GradBuffer], list[_Bucket], dict[nn.Parameter, _Slot]]:
    """The flat buffers, the buckets (in launch order) and every parameter's slot for the trainable ``params``.

    One buffer per (late, reduction, param dtype, grad dtype); the ``late`` parameters' (ids) buffers and buckets
    come after all the others, so that backward can launch every bucket before them. Buckets hold about
    ``bucket_bytes`` each, padded to a multiple of their reduction's size; with ``zero_stage=2`` the buffers are
    empty and each bucket gets its zeroed shard (:class:`_Bucket`). Allocates zeroed buffers; no collective."""
    # Backward visits parameters roughly in reverse registration order: fill buckets in that order so the first
    # bucket completes first.
    params = params[::-1]
    buffers: list[_GradBuffer] = []
    buckets: list[_Bucket] = []
    slots: dict[nn.Parameter, _Slot] = {}
    by_dtype: dict[tuple[bool, str, torch.dtype, torch.dtype], list[tuple[str, nn.Parameter]]] = {}
    for fqn, p in params:
        key = (id(p) in late, reductions[id(p)].name, p.dtype, grad_dtype or p.dtype)
        by_dtype.setdefault(key, []).append((fqn, p))
    # late parameters' buffers (and so buckets) come after all the others
    for (_, _, pdtype, gdtype), group in sorted(by_dtype.items(), key=lambda kv: kv[0][0]):
        reduction = reductions[id(group[0][1])]
        size = reduction.size
        elem = torch.empty((), dtype=gdtype).element_size()
        layout: list[tuple[int, int, list[tuple[str, nn.Parameter, int]]]] = []  # (start, end, members)
        offset, members, bucket_start = 0, [], 0
        for fqn, p in group:
            n = local_tensor(p).numel()
            members.append((fqn, p, offset))
            offset += n
            if (offset - bucket_start) * elem >= bucket_bytes:
                end = bucket_start + _round_up(offset - bucket_start, size)
                layout.append((bucket_start, end, members))
                offset = bucket_start = end
                members = []
        if members:
            end = bucket_start + _round_up(offset - bucket_start, size)
            layout.append((bucket_start, end, members))
            offset = end
        device = local_tensor(group[0][1]).device
        flat = torch.zeros(0 if zero_stage == 2 else offset, dtype=gdtype, device=device)
        buf = _GradBuffer(pdtype, gdtype, flat, reduction=reduction)
        for start, end, mem in layout:
            bucket = _Bucket(len(buckets), buf, start, end)
            if zero_stage == 2:
                bucket.shard_grad = torch.zeros(bucket.numel // size, dtype=gdtype, device=device)
            for fqn, p, off in mem:
                local = local_tensor(p)
                slot = _Slot(fqn, p, buf, bucket, off, local.numel(), local.shape)
                bucket.slots.append(slot)
                slots[p] = slot
            buf.buckets.append(bucket)
            buckets.append(bucket)
        buffers.append(buf)
    return buffers, buckets, slots


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
