"""Low-precision optimizer state: a ``torch.optim`` optimizer whose state tensors are kept in bf16 between steps.

:func:`low_precision_state` registers a step pre-hook and post-hook on an optimizer. Between steps every floating
state tensor with at least one dimension (AdamW's ``exp_avg`` and ``exp_avg_sq``, SGD's ``momentum_buffer``, Muon's
``momentum_buffer``) is held in ``dtype``; scalars (``step``) keep theirs. Each step:

1. the pre-hook widens each such tensor to the parameter's dtype (fp32 masters: fp32) in a fresh tensor;
2. the optimizer's own step runs unchanged on it (torch's numerics, fp32 arithmetic);
3. the post-hook rounds the result to ``dtype`` (round to nearest even, ``Tensor.copy_``) back into the same
   low-precision tensor objects, so views a checkpoint took of them stay valid.

The semantics, which a one-device reference reproduces with the same three lines around ``torch.optim.AdamW.step``:
state stored rounded to ``dtype``, arithmetic in the parameter dtype, master weights untouched. State memory between
steps is ``element_size(dtype) / element_size(fp32)`` of fp32 state (a half for bf16); during a step the widened
fp32 copies exist transiently (the step's peak holds one fp32 copy of the state beside the low-precision one). Works
on plain tensors, ZeRO flat pieces and DTensor (FSDP2, TP) state alike; issues no collective.
"""

from __future__ import annotations

from typing import Any

import torch

from vescale.parallel.errors import ZeroError

__all__ = ["low_precision_state", "state_dtype_of", "STATE_DTYPES"]

#: Names accepted for a state dtype (spec fields and flags): fp32 leaves the optimizer unchanged.
STATE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

# optimizer -> the dtype its state is kept in (set by low_precision_state)
_ATTR = "_vescale_state_dtype"


def _is_state(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point() and value.dim() > 0


def low_precision_state(optimizer: torch.optim.Optimizer, dtype: torch.dtype | str = torch.bfloat16
                        ) -> torch.optim.Optimizer:
    """Keep ``optimizer``'s state tensors in ``dtype`` between steps (see the module docstring); returns it.

    ``dtype``: a torch floating dtype narrower than the parameters, or a name in :data:`STATE_DTYPES` (``"fp32"``
    returns the optimizer unchanged). Raises :class:`~vescale.parallel.ZeroError` for an optimizer that already has
    state or low-precision state, or a non-floating dtype. No collectives.
    """
    if isinstance(dtype, str):
        if dtype not in STATE_DTYPES:
            raise ZeroError(f"optimizer state dtype {dtype!r} is not one of {sorted(STATE_DTYPES)}")
        dtype = STATE_DTYPES[dtype]
    if not dtype.is_floating_point:
        raise ZeroError(f"optimizer state dtype must be floating, got {dtype}")
    if dtype == torch.float32:
        return optimizer
    if getattr(optimizer, _ATTR, None) is not None:
        raise ZeroError(f"{type(optimizer).__name__} already keeps its state in {getattr(optimizer, _ATTR)}")
    if optimizer.state:
        raise ZeroError(f"{type(optimizer).__name__} already has state; make its state low-precision before the "
                        "first step")
    stash: dict[tuple[int, str], torch.Tensor] = {}

    def states(opt: torch.optim.Optimizer):
        """(parameter, its state dict, state name, floating state tensor) of every parameter with state."""
        for group in opt.param_groups:
            for p in group["params"]:
                st = opt.state.get(p)
                for name, value in (st or {}).items():
                    if _is_state(value):
                        yield p, st, name, value

    def widen(opt: torch.optim.Optimizer, *_: Any) -> None:
        stash.clear()
        for p, st, name, value in list(states(opt)):
            if value.dtype == dtype:
                stash[(id(p), name)] = value
                st[name] = value.to(p.dtype)

    def narrow(opt: torch.optim.Optimizer, *_: Any) -> None:
        for p, st, name, value in list(states(opt)):
            if value.dtype == dtype:
                continue
            kept = stash.get((id(p), name))
            if kept is not None and kept.shape == value.shape:
                kept.copy_(value)
                st[name] = kept
            else:  # state built in this step (the first)
                st[name] = value.to(dtype)
        stash.clear()

    optimizer.register_step_pre_hook(widen)
    optimizer.register_step_post_hook(narrow)
    setattr(optimizer, _ATTR, dtype)
    return optimizer


def state_dtype_of(optimizer: Any) -> torch.dtype | None:
    """The dtype :func:`low_precision_state` keeps ``optimizer``'s state in, or None (unchanged)."""
    return getattr(optimizer, _ATTR, None)
