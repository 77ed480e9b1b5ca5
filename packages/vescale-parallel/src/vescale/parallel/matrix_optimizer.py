""":class:`MatrixOptimizer` (ZeRO 0 and 3, plain / TP / FSDP2 parameters) and :class:`DistributedMatrixOptimizer`
(ZeRO 1/2 over vescale DDP): a matrix optimizer (``torch.optim.Muon``) stepped by whole-matrix owners
(:mod:`vescale.parallel.muon`) beside an elementwise optimizer for the other parameters, with the sharded-state
protocol of :mod:`vescale.core.sharded_state` for checkpoints.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from vescale.core.sharded_state import init_optimizer_state
from vescale.core.torch_internals import local_tensor
from vescale.dtensor import RaggedShard
from vescale.parallel.errors import ZeroError
from vescale.parallel.muon import _check_matrix, _data_of, _grad_of, _hparams, _Matrix, _MatrixStep, _tp_layout
from vescale.parallel.optimizer import DistributedOptimizer
from vescale.parallel.state_dtype import low_precision_state

__all__ = ["MatrixOptimizer", "DistributedMatrixOptimizer"]


def _names(modules: Iterable[nn.Module]) -> dict[int, str]:
    names: dict[int, str] = {}
    for module in modules:
        for name, p in module.named_parameters():
            names.setdefault(id(p), name)
    return names


class MatrixOptimizer:
    """A matrix optimizer (``torch.optim.Muon``) plus an elementwise one for the other parameters, over plain,
    TP-sharded (DTensor ``Shard(d)``/``Replicate`` on a 1-D tp mesh) or FSDP2-sharded (ZeRO 3: ``Shard(0)`` over
    dp, optionally x tp) parameters, equal to one device's two optimizers.

    ``matrix``: a freshly built ``torch.optim.Muon`` over 2-D fp32 parameters of ``modules`` (its groups and
    hyper-parameters are the ones stepped); ``rest``: a torch optimizer over the remaining parameters (stepped as is,
    elementwise on any shard), or None. ``dp_dim_index``/``tp_dim_index``: the mesh dims of the parameters' DTensor mesh
    that are FSDP2's dp shard and tp (None: absent). Without a dp dim (ZeRO 0), every data rank holds whole TP-local
    gradients and computes every update of its dp row's owners (the replicated result). Collectives per step: see the
    module docstring (all_to_all over dp and tp); the rest optimizer's own (none for plain torch). ``state_dtype``
    (e.g. ``torch.bfloat16``): both optimizers keep their state (momenta, AdamW moments) in it between steps
    (:func:`vescale.parallel.low_precision_state`).
    """

    def __init__(self, modules: nn.Module | list[nn.Module], matrix: torch.optim.Optimizer,
                 rest: torch.optim.Optimizer | None = None, *, dp_dim: str = "dp", tp_dim: str = "tp",
                 state_dtype: torch.dtype | str | None = None) -> None:
        modules = [modules] if isinstance(modules, nn.Module) else list(modules)
        if matrix.state:
            raise ZeroError("pass a freshly built matrix optimizer (no state)")
        names = _names(modules)
        matrices, dp_group, dp, dp_rank, tp_group, tp, tp_rank = [], None, 1, 0, None, 1, 0
        for gi, group in enumerate(matrix.param_groups):
            for p in group["params"]:
                fqn = names.get(id(p))
                if fqn is None:
                    raise ZeroError(f"matrix optimizer group {gi} holds a tensor of shape {tuple(p.shape)} that is "
                                    "not a parameter of the modules")
                _check_matrix(fqn, p)
                dims = tuple(p.device_mesh.mesh_dim_names or ()) if isinstance(p, DTensor) else ()
                dp_dim_index = dims.index(dp_dim) if dp_dim in dims else None
                tp_dim_index = dims.index(tp_dim) if tp_dim in dims else None
                other = [f"{d}: {pl}" for i, (d, pl) in enumerate(zip(dims, p.placements if dims else ()))
                         if i not in (dp_dim_index, tp_dim_index) and not pl.is_replicate()]
                if other:
                    raise ZeroError(f"matrix optimizer: parameter {fqn!r} is split over mesh dims other than "
                                    f"dp_dim={dp_dim!r} and tp_dim={tp_dim!r} ({', '.join(other)}); name them")
                if tp_dim_index is not None:
                    tp_group, tp = p.device_mesh.get_group(tp_dim_index), p.device_mesh.size(tp_dim_index)
                    tp_rank = p.device_mesh.get_local_rank(tp_dim_index)
                sharded_dim, tp_sizes, _ = _tp_layout(fqn, p, tp_dim_index)
                if dp_dim_index is not None:
                    dp_group, dp = p.device_mesh.get_group(dp_dim_index), p.device_mesh.size(dp_dim_index)
                    dp_rank = p.device_mesh.get_local_rank(dp_dim_index)
                    rows = p.shape[0] if sharded_dim != 0 else tp_sizes[tp_rank]
                    cols = p.shape[1] if sharded_dim != 1 else tp_sizes[tp_rank]
                    per = -(-rows // dp)
                    ranges = [(min(rows, r * per) * cols, min(rows, (r + 1) * per) * cols) for r in range(dp)]
                    lo, hi = ranges[dp_rank]
                    if local_tensor(p).numel() != hi - lo:
                        raise ZeroError(f"matrix optimizer: parameter {fqn!r} (placements {p.placements}) holds "
                                        f"{tuple(local_tensor(p).shape)} here, not rows [{lo // max(cols, 1)}, "
                                        f"{hi // max(cols, 1)}) of its TP-local matrix; unsupported ZeRO 3 layout")
                    matrices.append(_Matrix(fqn, p, gi, tuple(p.shape), sharded_dim, tp_sizes, ranges,
                                            _grad_of(p), _data_of(p), None, None))
                else:
                    numel = local_tensor(p).numel()
                    matrices.append(_Matrix(fqn, p, gi, tuple(p.shape), sharded_dim, tp_sizes, [(0, numel)],
                                            _grad_of(p), _data_of(p), _grad_of(p), _data_of(p)))
        self.matrix = _MatrixStep(matrices, matrix, dp_group=dp_group,
                                  dp_size=dp, dp_rank=dp_rank, tp_group=tp_group, tp_size=tp, tp_rank=tp_rank)
        self.rest = rest
        if state_dtype is not None:
            low_precision_state(self.matrix.optimizer, state_dtype)
            if rest is not None:
                low_precision_state(rest, state_dtype)
        self._rest_fqns = [[names.get(id(p), "?") for p in g["params"]] for g in rest.param_groups] if rest else []
        self._hooks: list[Callable[[], None]] = []

    @property
    def param_groups(self) -> list[dict]:
        """The elementwise optimizer's groups, then the matrix optimizer's (set ``lr`` here for a schedule)."""
        return (self.rest.param_groups if self.rest is not None else []) + self.matrix.optimizer.param_groups

    def register_step_pre_hook(self, hook: Callable[..., None]) -> None:
        """Run ``hook(self)`` before each step (e.g. gradient clipping)."""
        self._hooks.append(hook)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear (or zero) the gradients of both optimizers' parameters."""
        for m in self.matrix.matrices:
            if set_to_none:
                m.param.grad = None
            elif m.param.grad is not None:
                m.param.grad.zero_()
        if self.rest is not None:
            self.rest.zero_grad(set_to_none)

    def step(self, closure=None):
        """Hooks, the elementwise optimizer's step, then the owners' matrix step (collectives over dp and tp)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for hook in self._hooks:
            hook(self)
        if self.rest is not None:
            self.rest.step()
        self.matrix.step()
        return loss

    def layout(self) -> RaggedShard:
        """Which rank owns which matrices' state (see :meth:`_MatrixStep.layout`)."""
        return self.matrix.layout()

    def state_bytes(self) -> int:
        """Bytes of optimizer state on this rank: the owned momenta and the elementwise optimizer's state."""
        rest = 0
        if self.rest is not None:
            rest = sum(local_tensor(v).numel() * v.element_size() for st in self.rest.state.values()
                       for v in st.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
        return self.matrix.state_bytes() + rest

    def state_dict(self) -> dict[str, Any]:
        """``{"matrix": ..., "rest": ...}``: the owners' whole-matrix state by FQN and the elementwise optimizer's
        own state dict; loads into the same layout only (:meth:`sharded_state_dict` reshards)."""
        return {"matrix": self.matrix.state_dict(), "rest": self.rest.state_dict() if self.rest is not None else None}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.matrix.load_state_dict(state_dict["matrix"])
        if self.rest is not None:
            self.rest.load_state_dict(state_dict["rest"])

    # -- the sharded-state protocol (vescale.core.sharded_state) --------------------------------------------------

    def sharded_state_dict(self) -> dict[str, Any]:
        """The owned momenta as whole-matrix boxes of the global parameters, and the elementwise optimizer's state
        (DTensor values as they are), under a torch optimizer's checkpoint keys."""
        out: dict[str, Any] = {}
        self.matrix.sharded_state_dict(out)
        if self.rest is not None:
            for fqns, group in zip(self._rest_fqns, self.rest.param_groups):
                for fqn, p in zip(fqns, group["params"]):
                    out[f"param_groups.{fqn}"] = _hparams(group)
                    for name, value in self.rest.state.get(p, {}).items():
                        out[f"state.{fqn}.{name}"] = value
        return out

    def load_sharded_state_dict(self, state: dict[str, Any]) -> None:
        """Apply hyper-parameters a load filled (tensors were filled in place)."""
        self.matrix.load_sharded_state_dict(state)
        if self.rest is not None:
            for fqns, group in zip(self._rest_fqns, self.rest.param_groups):
                for fqn in fqns:
                    for k, v in state.get(f"param_groups.{fqn}", {}).items():
                        group[k] = v

    def init_sharded_state(self) -> None:
        """Build both optimizers' lazy state (lr-0 steps; no collectives) so a load can fill it."""
        self.matrix.init_state()
        if self.rest is not None and not self.rest.state:
            init_optimizer_state(self.rest)


class DistributedMatrixOptimizer(DistributedOptimizer):
    """ZeRO 1/2 (over a :class:`~vescale.parallel.DistributedDataParallel`) with a matrix optimizer: ``matrix`` (a
    fresh ``torch.optim.Muon`` over 2-D fp32 parameters of the DDP module) stepped by whole-matrix owners, ``rest``
    (a fresh elementwise optimizer over the other parameters) on flat ZeRO pieces as
    :class:`~vescale.parallel.DistributedOptimizer` does.

    The matrices' gradients are the DDP buffers' (ZeRO 1 without clipping: every dp rank holds them whole, so only
    the tp gather moves them; ZeRO 2, or ZeRO 1 with clipping: the owner gathers the clipped flat pieces); their new
    values are scattered back into every rank's master piece and leave with the bucket all-gather of the step, with
    the rest. TP: DTensors ``Shard(d)``/``Replicate`` on a 1-D tp mesh. bf16 parameters: the owners gather and step
    the fp32 master pieces (the bf16 parameters follow from the bucket all-gather), with fp32 gradients. Not
    supported (raised at construction): DDP ``data_dims`` (ep), gradients reduced in bf16. ``state_dtype``: both
    optimizers' state dtype between steps (:func:`vescale.parallel.low_precision_state`).
    """

    def __init__(self, module, matrix: torch.optim.Optimizer, rest: torch.optim.Optimizer, *, zero_stage: int = 1,
                 clip_grad: float | None = None, pp_group: dist.ProcessGroup | None = None,
                 state_dtype: torch.dtype | str | None = None) -> None:
        if matrix.state:
            raise ZeroError("pass a freshly built matrix optimizer (no state)")
        super().__init__(module, rest, zero_stage=zero_stage, clip_grad=clip_grad, pp_group=pp_group,
                         state_dtype=state_dtype)
        matrices, reduction, tp_group, tp, tp_rank = [], None, None, 1, 0
        for gi, group in enumerate(matrix.param_groups):
            for p in group["params"]:
                piece = self.pieces.get(p)
                if piece is None:
                    raise ZeroError(f"matrix optimizer group {gi} holds a tensor of shape {tuple(p.shape)} that is "
                                    "not a gradient-requiring parameter of the DDP module")
                _check_matrix(piece.fqn, p, fp32_master=piece.master.dtype == torch.float32)
                if piece.grad.dtype != torch.float32:
                    raise ZeroError(f"matrix optimizer: parameter {piece.fqn!r} has {piece.grad.dtype} gradients "
                                    "(DDP's grad dtype, reduce_dtype); Muon's owners gather fp32 gradients")
                slot = piece.slot
                reduction = slot.bucket.buffer.reduction
                if reduction.summed:
                    raise ZeroError(f"matrix optimizer: parameter {piece.fqn!r} is reduced over "
                                    f"{reduction.name}; DDP data_dims (ep) are not supported")
                tp_dim_index = None
                if isinstance(p, DTensor):
                    if p.device_mesh.ndim != 1:
                        raise ZeroError(f"matrix optimizer: parameter {piece.fqn!r} lives on mesh "
                                        f"{p.device_mesh.mesh_dim_names} ({p.placements}); only a 1-D tp mesh")
                    tp_dim_index = 0
                    tp_group, tp, tp_rank = p.device_mesh.get_group(0), p.device_mesh.size(0), \
                        p.device_mesh.get_local_rank(0)
                sharded_dim, tp_sizes, _ = _tp_layout(piece.fqn, p, tp_dim_index)
                ranges = [self._owned(slot.bucket, slot, r) for r in range(reduction.size)]
                whole = zero_stage == 0 or (zero_stage == 1 and clip_grad is None)
                matrices.append(_Matrix(
                    piece.fqn, p, gi, tuple(p.shape), sharded_dim, tp_sizes, ranges,
                    grad_piece=lambda piece=piece: piece.grad, param_piece=lambda piece=piece: piece.master,
                    grad_local=(lambda slot=slot: slot.view().reshape(-1)) if whole else None,
                    # a low-precision parameter's owner gathers and steps the fp32 master pieces instead
                    param_local=_data_of(p) if piece.aliased else (
                        (lambda piece=piece: piece.master) if zero_stage == 0 else None)))
        dp_group = reduction.group if reduction is not None else None
        dp_size = reduction.size if reduction is not None else 1
        dp_rank = reduction.rank if reduction is not None else 0
        self.matrix = _MatrixStep(matrices, matrix, dp_group=dp_group, dp_size=dp_size, dp_rank=dp_rank,
                                  tp_group=tp_group, tp_size=tp, tp_rank=tp_rank)
        if state_dtype is not None:
            low_precision_state(self.matrix.optimizer, state_dtype)

    @property
    def param_groups(self) -> list[dict]:
        """The elementwise optimizer's groups, then the matrix optimizer's (set ``lr`` here for a schedule)."""
        return self.optimizer.param_groups + self.matrix.optimizer.param_groups

    def _update(self) -> None:
        super()._update()
        self.matrix.step()

    def layout(self) -> RaggedShard:
        """Which rank owns which matrices' state (see :meth:`_MatrixStep.layout`)."""
        return self.matrix.layout()

    def state_bytes(self) -> int:
        return super().state_bytes() + self.matrix.state_bytes()

    def state_dict(self) -> dict[str, Any]:
        """:class:`DistributedOptimizer`'s state dict (the elementwise pieces) with ``"matrix"``: the owners'
        whole-matrix state by FQN; loads into the same layout only (:meth:`sharded_state_dict` reshards)."""
        return {**super().state_dict(), "matrix": self.matrix.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.matrix.load_state_dict(state_dict["matrix"])

    def sharded_state_dict(self) -> dict[str, Any]:
        """The elementwise pieces' state (:class:`DistributedOptimizer`'s) and the owned momenta as whole-matrix
        boxes of the global parameters."""
        out = super().sharded_state_dict()
        self.matrix.sharded_state_dict(out)
        return out

    def load_sharded_state_dict(self, state: dict[str, Any]) -> None:
        super().load_sharded_state_dict(state)
        self.matrix.load_sharded_state_dict(state)

    def init_sharded_state(self) -> None:
        super().init_sharded_state()
        self.matrix.init_state()
