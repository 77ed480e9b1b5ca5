"""Activation checkpointing per block for unmodified models, correct under vescale's counter-based RNG.

:func:`checkpoint_activations` makes each block of a model (the children of its longest ``nn.ModuleList``, or the
modules a regex names, as :func:`vescale.core.blocks.find_blocks` decides) run its forward under
``torch.utils.checkpoint.checkpoint(use_reentrant=False)``: the block's activations are freed after its forward and
recomputed during backward. FQNs, ``state_dict`` keys, parameter objects and the module hooks a TP plan installs are
unchanged (only the block instance's ``forward`` is wrapped; the hooks of ``__call__`` stay outside the region).

Policies:

* ``"full"``: save only each block's inputs; recompute the whole block.
* ``"selective"``: also save the outputs of the matmul-like ops (``mm``, ``addmm``, ``bmm``, ``baddbmm``, the fused
  attention kernels), recompute the cheap elementwise ones (norms, activations, dropout); torch's selective
  checkpointing (``create_selective_checkpoint_contexts``) with :data:`SELECTIVE_SAVE_OPS`.
* a list of aten ops to save, or a policy function ``(ctx, op, *args, **kwargs) -> CheckpointPolicy`` as torch's
  selective checkpointing takes.

Random ops: vescale's counter RNG (:mod:`vescale.dtensor.random`) replays, in a recompute, exactly the values the
forward drew, for this API and for a user's own ``torch.utils.checkpoint`` (reentrant or not), so gradients are
bitwise those without checkpointing and the RNG state after the step is the same. This needs nothing from this
module: it is how the RNG treats any checkpointed region.

Compile: apply this before :func:`~vescale.parallel.compile_parallel` (dynamo traces torch's checkpoint into the
block's graph; blocks with active dropout are refused by compile mode anyway). Pipeline stages: a graph-captured
stage has no block modules; ``whole=True`` checkpoints the stage's forward as one region.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from vescale.core import torch_internals
from vescale.core.blocks import find_blocks
from vescale.parallel.errors import ActivationCheckpointError
from vescale.parallel.factory import FactoryCapture

__all__ = ["checkpoint_activations", "checkpointed_blocks", "ActivationCheckpointError", "SELECTIVE_SAVE_OPS",
           "POLICIES"]

POLICIES = ("full", "selective")

_aten = torch.ops.aten
#: The ops whose outputs the ``"selective"`` policy saves: matmuls and fused attention (expensive to recompute,
#: and their outputs are what the next cheap op needs). Everything else in a block is recomputed.
SELECTIVE_SAVE_OPS = tuple(getattr(_aten, name).default for name in (
    "mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention") if hasattr(_aten, name))


def checkpoint_activations(module: nn.Module, policy: str | Sequence[Any] | Callable = "full", *,
                           blocks: str | None = None, whole: bool = False) -> nn.Module:
    """Checkpoint the activations of each block of ``module`` in place and return ``module``.

    ``policy``: ``"full"``, ``"selective"``, a list of aten ops to save, or a torch selective-checkpoint policy
    function (module docstring). ``blocks``: a regex (full match over submodule FQNs) naming the blocks; default the
    children of the longest ``nn.ModuleList``. ``whole=True``: checkpoint ``module``'s own forward as one region
    (a pipeline stage) instead of blocks. Call it before DDP / ZeRO 3 wrapping and before ``compile_parallel``.

    Raises :class:`ActivationCheckpointError` (the same on every rank, before any collective: the check reads only
    module structure) when the policy is unknown, no block matches, or a block is already checkpointed.
    Issues no collective; the collectives a block's forward makes are made again by its recompute.
    """
    if not isinstance(module, nn.Module):
        raise ActivationCheckpointError(f"checkpoint_activations expects an nn.Module, got {type(module).__name__}")
    save = _save_policy(policy)
    if whole:
        if blocks is not None:
            raise ActivationCheckpointError("checkpoint_activations: pass either blocks= or whole=True, not both")
        found = [("", module)]
    else:
        found = _find(module, blocks)
    for fqn, block in found:
        if getattr(block.forward, "func", None) is _checkpointed_forward:
            raise ActivationCheckpointError(f"checkpoint_activations: block {fqn or '<root>'!r} "
                                            f"({type(block).__name__}) is already checkpointed")
    for _, block in found:
        block.forward = functools.partial(_checkpointed_forward, block.forward, save)
    module._vescale_checkpointed_blocks = [fqn for fqn, _ in found]
    return module


def checkpointed_blocks(module: nn.Module) -> list[str]:
    """FQNs of the regions :func:`checkpoint_activations` installed on ``module`` (``[""]`` for ``whole=True``)."""
    return list(getattr(module, "_vescale_checkpointed_blocks", []))


def _find(module: nn.Module, pattern: str | None) -> list[tuple[str, nn.Module]]:
    try:
        found = find_blocks(module, pattern)
    except Exception as exc:  # noqa: BLE001 - re.error or anything the pattern provokes, named for the user
        raise ActivationCheckpointError(f"checkpoint_activations: blocks={pattern!r} is not a valid regex: {exc}") \
            from exc
    if not found:
        what = (f"no submodule FQN of {type(module).__name__} fully matches blocks={pattern!r}" if pattern is not None
                else f"{type(module).__name__} has no nn.ModuleList of blocks")
        raise ActivationCheckpointError(f"checkpoint_activations: {what}; pass blocks=<regex> naming the blocks, or "
                                        "whole=True to checkpoint the module's forward as one region (a pipeline "
                                        "stage)")
    return found


def _save_policy(policy: str | Sequence[Any] | Callable) -> Callable | list | None:
    """What torch's selective checkpointing takes for ``policy`` (None: full recompute)."""
    if isinstance(policy, str):
        if policy == "full":
            return None
        if policy == "selective":
            return _save_matmuls
        raise ActivationCheckpointError(f"checkpoint_activations: unknown policy {policy!r}; expected one of "
                                        f"{POLICIES}, a list of aten ops to save, or a policy function")
    if callable(policy):
        return policy
    try:
        ops = list(policy)
    except TypeError:
        raise ActivationCheckpointError(f"checkpoint_activations: policy must be {POLICIES}, a list of aten ops to "
                                        f"save, or a policy function; got {policy!r}") from None
    bad = [op for op in ops if not isinstance(op, (torch_internals.OpOverload, torch_internals.HigherOrderOperator))]
    if bad:
        raise ActivationCheckpointError(f"checkpoint_activations: policy list must hold aten op overloads "
                                        f"(torch.ops.aten.mm.default), got {bad}")
    return ops


def _save_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SELECTIVE_SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _contexts(save: Callable | list | None) -> tuple[Any, Any]:
    """torch's ``context_fn`` (called at the start of each checkpointed forward): the selective-checkpoint modes,
    and for the recompute also the factory-capture modes the forward ran under. The recompute runs in backward,
    outside the parallelized root's ``forward`` and its :class:`~vescale.parallel.factory.FactoryCapture`; without
    it a mask a block builds (``torch.ones(t, t).tril()``) would come back a plain tensor next to DTensors."""
    forward, recompute = (create_selective_checkpoint_contexts(save) if save is not None
                          else (contextlib.nullcontext(), contextlib.nullcontext()))
    captures = [m for m in torch_internals.function_mode_stack() if isinstance(m, FactoryCapture)]
    return forward, _entered(captures, recompute)


@contextlib.contextmanager
def _entered(modes: list, inner: Any) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for mode in modes:
            stack.enter_context(mode)
        stack.enter_context(inner)
        yield


def _checkpointed_forward(forward: Callable, save: Callable | list | None, *args: Any, **kwargs: Any) -> Any:
    if not torch.is_grad_enabled():  # nothing to save: eval and generation run the plain forward
        return forward(*args, **kwargs)
    if torch.compiler.is_compiling():
        # dynamo traces the region as one higher-order op and needs context_fn to give two dispatch modes; the
        # factory capture is traced into the graph already
        if save is None:
            return checkpoint(forward, *args, use_reentrant=False, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False,
                          context_fn=functools.partial(create_selective_checkpoint_contexts, save), **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, context_fn=functools.partial(_contexts, save), **kwargs)
