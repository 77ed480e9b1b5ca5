"""ZeRO 1/2: any elementwise ``torch.optim`` optimizer run on this rank's flat, ragged shard of the parameters.

:class:`DistributedOptimizer` takes the gradient buffers of a :class:`~vescale.parallel.DistributedDataParallel`
module. Every bucket is split into dp equal contiguous slices; dp rank ``r`` owns slice ``r`` of every bucket. A
parameter's (local, i.e. per-TP-shard) flattened tensor therefore falls into contiguous, possibly unequal and
possibly empty pieces, one per dp rank: a ragged shard. For each parameter piece it owns, a rank keeps a 1-D master
tensor (a view of the parameter itself when parameter and master dtype agree, else an fp32 copy) and the wrapped
optimizer keeps its state for that piece only, so optimizer-state memory per rank is 1/dp of the whole (up to
bucket padding of fewer than dp elements per bucket).

``step()`` waits for the gradient reductions, points each master's ``.grad`` at its reduced gradient (a view of the
DDP buffer, or of the zero_stage-2 shard), optionally clips by the global norm, runs the optimizer, and all-gathers
the updated parameters bucket by bucket (in the parameter dtype) over the dp group.

State dict layout (``format: "vescale.zero/1"``), enough to reshard to another dp size: ``state[fqn]`` holds the
optimizer's per-parameter state restricted to this rank's piece (1-D tensors; scalars such as ``step`` as is) and,
for low-precision parameters, ``master`` (the fp32 piece); ``shards[fqn]`` holds ``local_shape`` (the TP-local
tensor that is flattened), ``global_shape``, ``dtype``, ``placements``/``mesh_dim_names`` (the parameter's TP
layout, empty for a plain tensor), ``ranges``: ``[start, end)`` into the flattened local tensor for every dp
rank, in dp-rank order (``ranges[dp_rank]`` is this rank's piece), and ``placement``: the same layout as a
:class:`vescale.dtensor.RaggedShard` ``((0,), [end - start per dp rank])`` of the flattened local tensor over the dp
mesh dim (with DDP's ``data_dims`` a bucket reduced over dp x ep is sharded over those ranks: ``sharded_over`` names
them, ``"dp+ep"``, and ``rank`` is this rank's index into ``ranges``); ``param_groups`` list hyper-parameters with
``params`` given as FQNs. With ``zero_stage=0`` every range is the whole ``[0, numel)`` (replicated over dp) and
``placement`` is None.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from vescale.core.sharded_state import mark_piece, piece_of
from vescale.dtensor import RaggedShard
from vescale.parallel import optimizer_state
from vescale.parallel.clip_grad import _dtensor_groups, clip_grad_norm_
from vescale.parallel.ddp import DistributedDataParallel, _all_gather, _Bucket, _Slot, local_tensor
from vescale.parallel.errors import ZeroError
from vescale.parallel.state_dtype import low_precision_state

__all__ = ["DistributedOptimizer", "STATE_DICT_FORMAT"]

STATE_DICT_FORMAT = "vescale.zero/1"

# Optimizers whose update of an element depends on other elements: they cannot run on a flat piece unchanged.
_NOT_ELEMENTWISE = {"LBFGS", "SparseAdam", "Adafactor", "Muon"}


@dataclass(eq=False)
class _Piece:
    """This rank's piece ``[lo, hi)`` of one parameter's flattened local tensor, and its master copy."""

    slot: _Slot
    lo: int
    hi: int
    master: torch.Tensor
    grad: torch.Tensor  # where the reduced gradient of the piece lives (grad dtype)
    aliased: bool  # master is a view of the parameter itself

    @property
    def fqn(self) -> str:
        return self.slot.fqn


def _owned(bucket: _Bucket, slot: _Slot, rank: int, dp: int) -> tuple[int, int]:
    """``[lo, hi)`` of ``slot``'s flattened tensor that dp rank ``rank`` owns.

    Empty pieces sit where they fall (``lo == hi`` at 0 before the parameter, at ``numel`` after it), so the ranges of
    ranks 0..dp-1 tile ``[0, numel)`` in order, exactly as a ``RaggedShard`` lays them out.
    """
    size = bucket.numel // dp
    start, end = bucket.start + rank * size, bucket.start + (rank + 1) * size
    lo = min(max(start - slot.start, 0), slot.numel)
    hi = min(max(end - slot.start, 0), slot.numel)
    return lo, max(lo, hi)


def _scatter_gathered(bucket: _Bucket, full: torch.Tensor, work) -> None:
    """Wait for a bucket's parameter all-gather and copy each parameter's values out of it."""
    work.wait()
    for slot in bucket.slots:
        at = slot.start - bucket.start
        local_tensor(slot.param).view(-1).copy_(full[at:at + slot.numel])


class DistributedOptimizer:
    """ZeRO ``zero_stage`` 1 (optimizer states sharded over dp) or 2 (gradients too) around a torch optimizer; 0:
    nothing sharded, every dp rank updates the whole (the master-weight optimizer of a bf16 model without ZeRO).

    ``module`` (first, as everywhere in vescale) is the :class:`DistributedDataParallel` whose buffers hold the
    gradients; its ``zero_stage`` must be 2 for ``zero_stage=2`` and 0 or 1 for ``zero_stage`` 0 or 1.
    ``optimizer_cls_or_instance`` is an optimizer class (built with ``**kw`` over this rank's master pieces) or a
    freshly built instance over ``module``'s parameters (its param groups and defaults are reused; it must have no
    state yet). Each master piece is marked (:func:`vescale.core.sharded_state.mark_piece`) with the groups a clip norm
    sums it over: the ranks its bucket is sharded over, its parameter's DTensor shard dims and the groups of its
    parameter's own mark (a plain piece over ep); a parameter marked ``counts_in_norm=False`` before construction (a
    pipeline-tied weight's later copies) leaves its pieces out of the clip norm. ``master_dtype`` is the dtype of
    the master weights and optimizer states (fp32 for bf16 models). ``clip_grad`` clips the global gradient norm
    (over dp, TP shards and ``pp_group``) before each step; the norm is kept in :attr:`grad_norm`. ``state_dtype``
    (e.g. ``torch.bfloat16``): the wrapped optimizer keeps its state in it between steps
    (:func:`vescale.parallel.low_precision_state`; masters stay ``master_dtype``).

    Only elementwise optimizers (SGD, Adam, AdamW, RMSprop, Adagrad, ...) give single-device results. Learning-rate
    schedulers take :attr:`optimizer` (the wrapped torch optimizer).
    """

    def __init__(self, module: DistributedDataParallel, optimizer_cls_or_instance, *, zero_stage: int = 1,
                 clip_grad: float | None = None, master_dtype: torch.dtype = torch.float32,
                 pp_group: dist.ProcessGroup | None = None, state_dtype: torch.dtype | str | None = None,
                 **kw: Any) -> None:
        if isinstance(optimizer_cls_or_instance, DistributedDataParallel):
            raise ZeroError("the module comes first: DistributedOptimizer(ddp_module, optimizer_cls_or_instance, "
                            "...), as in every vescale API")
        if not isinstance(module, DistributedDataParallel):
            raise ZeroError(f"DistributedOptimizer needs a vescale.parallel.DistributedDataParallel module, got "
                            f"{type(module).__name__}; wrap it first: DistributedDataParallel(model, mesh, "
                            f"DDPOptions(zero_stage={zero_stage}))")
        if zero_stage not in (0, 1, 2):
            raise ZeroError(f"zero_stage must be 0, 1 or 2, got {zero_stage!r} (ZeRO 3: torch fully_shard, see "
                            "README)")
        if (zero_stage == 2) != (module.zero_stage == 2):
            raise ZeroError(f"DistributedOptimizer(zero_stage={zero_stage}) needs a DistributedDataParallel with "
                            f"zero_stage={'2' if zero_stage == 2 else '0 or 1'}, got zero_stage={module.zero_stage}")
        instance = None if isinstance(optimizer_cls_or_instance, type) else optimizer_cls_or_instance
        cls = optimizer_cls_or_instance if instance is None else type(instance)
        if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
            raise ZeroError(f"expected a torch.optim.Optimizer class or instance, got {optimizer_cls_or_instance!r}")
        if cls.__name__ in _NOT_ELEMENTWISE:
            raise ZeroError(f"{cls.__name__} is not elementwise and cannot run on flat ZeRO shards (Muon: "
                            "vescale.parallel.DistributedMatrixOptimizer steps it by whole matrices)")
        if instance is not None and (instance.state or kw):
            raise ZeroError("pass a freshly built optimizer instance (no state) and no extra keyword arguments")
        self.ddp = module
        self.zero_stage = zero_stage
        self.clip_grad = clip_grad
        self.master_dtype = master_dtype
        self.pp_group = pp_group
        self.grad_norm: torch.Tensor | None = None
        self.pieces: dict[nn.Parameter, _Piece] = self._make_pieces()

        if instance is None:
            groups = [{"params": [p for p in module.slots]}]
            defaults = kw
        else:
            # Hyper-parameters travel in the groups; pass only the defaults the constructor accepts (AdamW's
            # defaults hold keys, e.g. decoupled_weight_decay, that its __init__ does not take).
            accepted = inspect.signature(cls.__init__).parameters
            groups = instance.param_groups
            defaults = {k: v for k, v in instance.defaults.items() if k in accepted}
        self._group_fqns: list[list[str]] = []
        inner_groups = []
        for i, group in enumerate(groups):
            fqns = []
            for p in group["params"]:
                if p not in self.pieces:
                    raise ZeroError(f"param group {i} holds a tensor (shape {tuple(p.shape)}) that is not a "
                                    "gradient-requiring parameter of the DDP module")
                fqns.append(self.pieces[p].fqn)
            self._group_fqns.append(fqns)
            masters = [self.pieces[p].master for p in group["params"] if self.pieces[p].hi > self.pieces[p].lo]
            inner_groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": masters})
        #: The wrapped torch optimizer over this rank's master pieces.
        self.optimizer = cls(inner_groups, **defaults)
        if state_dtype is not None:
            low_precision_state(self.optimizer, state_dtype)

    def _make_pieces(self) -> dict[nn.Parameter, _Piece]:
        ddp = self.ddp
        pieces = {}
        for bucket in ddp.buckets:
            # a bucket is sharded over the ranks it is reduced over: dp, or dp x data dims (DDP's data_dims)
            reduction = bucket.buffer.reduction
            dp, rank = reduction.size, reduction.rank
            region_start = bucket.start + rank * (bucket.numel // dp)
            for slot in bucket.slots:
                lo, hi = self._owned(bucket, slot, rank)
                flat = local_tensor(slot.param).detach().view(-1)
                start, end = slot.start + lo, slot.start + hi
                if hi == lo:
                    grad = slot.buffer.data[:0]
                elif bucket.shard_grad is not None:
                    grad = bucket.shard_grad[start - region_start:end - region_start]
                else:
                    grad = slot.buffer.data[start:end]
                aliased = slot.param.dtype == self.master_dtype
                master = flat[lo:hi] if aliased else flat[lo:hi].to(self.master_dtype).clone()
                # zero_stage 0: every dp rank holds the whole, so the clip norm must not sum it over dp
                groups = {reduction.name: reduction.group} if self.zero_stage and reduction.size > 1 else {}
                if isinstance(slot.param, DTensor):
                    groups.update(_dtensor_groups(slot.param))
                own = piece_of(slot.param)  # a plain piece (experts over ep), or a tied copy another stage counts
                if own is not None:
                    groups.update(own.group_map)
                mark_piece(master, groups=groups, counts_in_norm=own is None or own.counts_in_norm)
                pieces[slot.param] = _Piece(slot, lo, hi, master, grad, aliased)
        return pieces

    def _owned(self, bucket: _Bucket, slot: _Slot, rank: int) -> tuple[int, int]:
        """``[lo, hi)`` of ``slot`` that dp rank ``rank`` updates: all of it with ``zero_stage=0``."""
        return (0, slot.numel) if self.zero_stage == 0 else _owned(bucket, slot, rank, bucket.buffer.reduction.size)

    # -- the step -------------------------------------------------------------------------------------------------

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the DDP gradient buffers (the masters' gradients are views of them)."""
        self.ddp.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def step(self, closure=None):
        """Finish gradient sync, (clip,) update this rank's pieces, then all-gather the parameters over dp."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.ddp.finish_grad_sync()
        for piece in self.pieces.values():
            g = piece.grad
            piece.master.grad = g if g.dtype == piece.master.dtype else g.to(piece.master.dtype)
        if self.clip_grad is not None:
            self.grad_norm = clip_grad_norm_([pc.master for pc in self.pieces.values()], self.clip_grad,
                                             pp_group=self.pp_group)
        self._update()
        self._gather_params()
        return loss

    def _update(self) -> None:
        """Update this rank's pieces (a subclass adds its own updates of pieces before they are gathered)."""
        self.optimizer.step()

    def _gather_params(self) -> None:
        # At most two buckets in flight: bucket i's all-gather runs while bucket i-1 is copied into the parameters,
        # so the temporary gather buffers never exceed two buckets.
        previous = None
        for bucket in self.ddp.buckets:
            reduction = bucket.buffer.reduction
            dp, rank = reduction.size, reduction.rank
            if dp == 1 or self.zero_stage == 0:  # every rank updated the whole bucket: nothing to gather
                for slot in bucket.slots:
                    piece = self.pieces[slot.param]
                    if not piece.aliased:
                        local_tensor(slot.param).view(-1).copy_(piece.master)
                continue
            size = bucket.numel // dp
            region_start = bucket.start + rank * size
            shard = torch.zeros(size, dtype=bucket.buffer.param_dtype, device=bucket.buffer.data.device)
            for slot in bucket.slots:
                piece = self.pieces[slot.param]
                if piece.hi > piece.lo:
                    at = slot.start + piece.lo - region_start
                    shard[at:at + piece.hi - piece.lo].copy_(piece.master)
            full = torch.empty(bucket.numel, dtype=shard.dtype, device=shard.device)
            current = (bucket, full, _all_gather(full, shard, group=reduction.group, async_op=True))
            if previous is not None:
                _scatter_gathered(*previous)
            previous = current
        if previous is not None:
            _scatter_gathered(*previous)

    # -- accounting -----------------------------------------------------------------------------------------------

    def state_bytes(self) -> int:
        """Bytes of the wrapped optimizer's state tensors on this rank (exp_avg, exp_avg_sq, momentum, ...)."""
        return sum(v.numel() * v.element_size() for st in self.optimizer.state.values() for v in st.values()
                   if isinstance(v, torch.Tensor) and v.dim() > 0)

    def master_bytes(self) -> int:
        """Bytes of master weights this rank holds beyond the parameters (0 when masters alias fp32 params)."""
        return sum(pc.master.numel() * pc.master.element_size() for pc in self.pieces.values() if not pc.aliased)

    # -- state dict -----------------------------------------------------------------------------------------------

    def _shard_info(self, piece: _Piece) -> dict[str, Any]:
        p, reduction = piece.slot.param, piece.slot.bucket.buffer.reduction
        ranges = [list(self._owned(piece.slot.bucket, piece.slot, r)) for r in range(reduction.size)]
        is_dt = isinstance(p, DTensor)
        numel = piece.slot.numel
        return {
            # The same layout as a vescale placement over the dp mesh dim of the flattened local tensor [numel]:
            # units of one element, ranks[r] holds ranges[r].
            "placement": RaggedShard((0,), [hi - lo for lo, hi in ranges]) if numel and self.zero_stage else None,
            "global_shape": list(optimizer_state._global_shape(p)),
            "local_shape": list(piece.slot.local_shape),
            "dtype": str(p.dtype).removeprefix("torch."),
            "placements": [str(pl) for pl in p.placements] if is_dt else [],
            "mesh_dim_names": list(p.device_mesh.mesh_dim_names or ()) if is_dt else [],
            "ranges": ranges,
            # the ranks ``ranges`` are over: dp, or dp x DDP's data dims ("dp+ep"), and this rank's index in them
            "sharded_over": reduction.name,
            "rank": reduction.rank,
        }

    def state_dict(self) -> dict[str, Any]:
        """This rank's optimizer state by FQN with the ragged-shard layout (see the module docstring)."""
        state: dict[str, dict[str, Any]] = {}
        for piece in self.pieces.values():
            entry = dict(self.optimizer.state.get(piece.master, {}))
            if not piece.aliased and piece.hi > piece.lo:
                entry["master"] = piece.master
            if entry:
                state[piece.fqn] = entry
        groups = []
        for fqns, group in zip(self._group_fqns, self.optimizer.param_groups):
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": list(fqns)})
        return {
            "format": STATE_DICT_FORMAT,
            "zero_stage": self.zero_stage,
            "dp_size": self.ddp.dp_size,
            "dp_rank": self.ddp.dp_rank,
            "state": state,
            "param_groups": groups,
            "shards": {pc.fqn: self._shard_info(pc) for pc in self.pieces.values()},
        }

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict saved by a DistributedOptimizer with the same dp size and bucket layout.

        A different layout raises :class:`ZeroError` naming the first mismatching FQN; reshard it with
        vescale-checkpoint first.
        """
        if state_dict.get("format") != STATE_DICT_FORMAT:
            raise ZeroError(f"not a {STATE_DICT_FORMAT} state dict (format={state_dict.get('format')!r})")
        by_fqn = {pc.fqn: pc for pc in self.pieces.values()}
        for fqn, info in state_dict["shards"].items():
            piece = by_fqn.get(fqn)
            if piece is None:
                raise ZeroError(f"state dict has parameter {fqn!r} which this optimizer does not hold")
            mine = self._shard_info(piece)
            if info["ranges"] != mine["ranges"] or info["local_shape"] != mine["local_shape"]:
                raise ZeroError(f"{fqn!r}: saved ranges {info['ranges']} (local shape {info['local_shape']}, dp="
                                f"{state_dict['dp_size']}) differ from this layout's {mine['ranges']} (local shape "
                                f"{mine['local_shape']}, dp={self.ddp.dp_size}); reshard with vescale-checkpoint")
        missing = sorted(set(by_fqn) - set(state_dict["shards"]))
        if missing:
            raise ZeroError(f"state dict lacks parameters {missing[:5]}{'...' if len(missing) > 5 else ''}")
        order = [m for g in self.optimizer.param_groups for m in g["params"]]
        index = {id(m): i for i, m in enumerate(order)}
        inner_state = {}
        for fqn, entry in state_dict["state"].items():
            piece = by_fqn[fqn]
            entry = dict(entry)
            master = entry.pop("master", None)
            if master is not None:
                piece.master.copy_(master)
            if entry and id(piece.master) in index:
                inner_state[index[id(piece.master)]] = entry
        inner_groups = []
        for group, saved in zip(self.optimizer.param_groups, state_dict["param_groups"]):
            hyper = {k: v for k, v in saved.items() if k != "params"}
            inner_groups.append({**hyper, "params": [index[id(m)] for m in group["params"]]})
        self.optimizer.load_state_dict({"state": inner_state, "param_groups": inner_groups})

    # -- the sharded-state protocol (vescale.core.sharded_state), through which checkpoints see this state ---------

    def sharded_state_dict(self) -> dict[str, Any]:
        """This rank's state as boxes of the global parameters, under a torch optimizer's checkpoint keys (see
        :mod:`vescale.parallel.optimizer_state`)."""
        return optimizer_state.sharded_state_dict(self)

    def load_sharded_state_dict(self, state: dict[str, Any]) -> None:
        """Apply a :meth:`sharded_state_dict` whose boxes a load filled in place (hyper-parameters, scalars)."""
        optimizer_state.load_sharded_state_dict(self, state)

    def init_sharded_state(self) -> None:
        """Build the wrapped optimizer's lazy state (once, with an lr-0 step; no collectives) so a load can fill it."""
        optimizer_state.init_sharded_state(self)
