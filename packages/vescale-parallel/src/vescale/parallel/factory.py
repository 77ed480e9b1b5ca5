"""Factory capture: tensors a parallelized ``forward`` creates from scratch become replicated DTensors.

Model code builds tensors inside ``forward`` (``torch.arange`` positions, ``torch.ones(t, t).tril()`` masks,
``torch.tensor(...)`` constants) and combines them with activations, which inside a parallelized module are DTensors.
DTensor refuses to mix the two. :class:`FactoryCapture` is a :class:`~torch.overrides.TorchFunctionMode` that the
parallelized root module enters for the duration of its ``forward``: the result of every *deterministic* factory
function called by model code is wrapped, without communication, as a DTensor that is ``Replicate`` on every dim of
the mesh. That is exactly what the single-device program means: every rank builds the same full tensor.

Why a mode and not :func:`torch.distributed.tensor.experimental.implicit_replication`: implicit replication only
admits plain tensors into DTensor ops during ``forward``. A plain mask saved by autograd (``masked_fill`` saves it)
comes back in ``backward``, outside any context, and fails there. Converting at creation leaves no plain tensor in
the graph, so ``backward`` needs no context at all.

Only calls made directly by model code are seen: while the mode handles a call it is switched off (torch's rule for
modes), so tensors torch itself creates inside an op (collective buffers in DTensor's redistribution, temporaries
of a functional op) stay plain. Random factories (``rand``, ``randn``, ...) are left alone on purpose: wrapping a
per-rank random draw as ``Replicate`` would silently be wrong; use dropout (DTensor's RNG) or create them as
DTensors explicitly.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate
from torch.overrides import TorchFunctionMode

from vescale.parallel.errors import DataDependentError
from vescale.parallel.model_calls import CORRECTED_FUNCTIONS, correct_call, mark_unwritten

__all__ = ["FactoryCapture", "FACTORY_FUNCTIONS", "capture_suspended", "capture_paused", "capture_resumed",
           "compiled_region"]

_suspended = 0
_compiled = 0  # > 0 while a graph compiled by vescale.parallel.compile_parallel runs (see compiled_region)

_FACTORY_NAMES = ("arange", "ones", "zeros", "full", "empty", "eye", "linspace", "logspace", "scalar_tensor",
                  "ones_like", "zeros_like", "full_like", "empty_like", "tril_indices", "triu_indices")


def _aten_overloads(names: tuple[str, ...]) -> set:
    """The ``torch.ops.aten`` overloads of ``names`` (not the ``out=`` ones): what graphs captured by
    ``torch.export`` (pipeline stages) call instead of the ``torch.*`` functions."""
    found = set()
    for name in names:
        packet = getattr(torch.ops.aten, name)
        found.update(getattr(packet, o) for o in packet.overloads() if not o.startswith("out") and "_out" not in o)
    return found


_TORCH_FACTORIES = frozenset({
    torch.arange, torch.range, torch.ones, torch.zeros, torch.full, torch.empty, torch.eye, torch.linspace,
    torch.logspace, torch.tensor, torch.as_tensor, torch.scalar_tensor, torch.ones_like, torch.zeros_like,
    torch.full_like, torch.empty_like, torch.tril_indices, torch.triu_indices,
})
_ATEN_FACTORIES = frozenset(_aten_overloads(_FACTORY_NAMES))

#: Deterministic creation functions whose plain-tensor results are captured as replicated DTensors: the ``torch.*``
#: functions eager code calls and their aten overloads, which captured graphs call.
FACTORY_FUNCTIONS: frozenset = _TORCH_FACTORIES | _ATEN_FACTORIES


class FactoryCapture(TorchFunctionMode):
    """Wrap plain results of :data:`FACTORY_FUNCTIONS` as DTensors replicated on ``device_mesh``.

    Issues no collective. A result that already is a DTensor (``ones_like`` of a DTensor) is returned unchanged.
    ``aten=False`` captures only the ``torch.*`` functions, not their ``torch.ops.aten`` overloads: for roots whose
    code is ordinary Python (a ``torch.compile``d graph calls aten overloads, and they must stay plain); ``True``
    for roots that run a graph captured by ``torch.export`` (pipeline stages).

    Under ``torch.compile`` (see :mod:`vescale.parallel.compile`): while dynamo traces, the wrapping is traced into
    the graph; code that really runs during a compile session (AOT autograd tracing the graph, whose factories are
    already wrapped) or inside :func:`compiled_region` is left alone, so nothing is converted twice.
    """

    def __init__(self, device_mesh, *, aten: bool = True) -> None:
        super().__init__()
        self.device_mesh = device_mesh
        self._replicate = [Replicate()] * device_mesh.ndim
        self._functions = FACTORY_FUNCTIONS if aten else _TORCH_FACTORIES

    def __torch_function__(self, func, types, args=(), kwargs=None) -> Any:
        if func is torch.Tensor.tolist and args and isinstance(args[0], DTensor):
            _refuse_values_read(args[0])
        if not _suspended and func in CORRECTED_FUNCTIONS:
            handled, out, args, kwargs = correct_call(func, args, kwargs or {})
            if handled:
                return out
        out = func(*args, **(kwargs or {}))
        if _suspended or func not in self._functions:
            return out
        if not torch.compiler.is_dynamo_compiling() and (_compiled or torch.compiler.is_compiling()):
            return out  # a compiled graph's own ops, or AOT tracing one: captured when dynamo traced it
        if isinstance(out, torch.Tensor) and not isinstance(out, DTensor):
            out = DTensor.from_local(out, self.device_mesh, self._replicate, run_check=False)
            if not torch.compiler.is_dynamo_compiling():  # a traced graph has no object identity to track
                mark_unwritten(out)
        return out


def _refuse_values_read(t: DTensor) -> None:
    """Raise :class:`DataDependentError` for ``t.tolist()`` in model code, naming the calling line."""
    import linecache

    from vescale.core.watchdog import user_frame

    caller = user_frame()
    where = ""
    if caller is not None:
        file, line, _ = caller
        where = f" at {file}:{line} `{linecache.getline(file, line).strip()}`"
    raise DataDependentError(
        f"model code reads a DTensor's values into Python{where}: .tolist() of a {tuple(t.shape)} tensor placed "
        f"{tuple(t.placements)}. DTensor cannot follow data-dependent control flow (e.g. MoE routing by token "
        "counts): keep the module that does it replicated in the plan (no sharded parameters or activations reach "
        "it), or run it on local shards with a 'local' plan entry and check its result against one device")


@contextlib.contextmanager
def capture_suspended() -> Iterator[None]:
    """Inside, factories stay plain: for code that runs on local shards (a ``local`` module of the plan)."""
    global _suspended
    _suspended += 1
    try:
        yield
    finally:
        _suspended -= 1


@contextlib.contextmanager
def capture_paused() -> Iterator[FactoryCapture | None]:
    """Like :func:`capture_suspended`, and the innermost :class:`FactoryCapture` mode, when it is the innermost torch
    function mode, leaves the mode stack meanwhile, so plain-tensor code (a fast block, see
    :class:`vescale.parallel.fast.FastBlock`) pays no Python call per torch function."""
    from vescale.core import torch_internals

    stack = torch_internals.function_mode_stack()
    mode = stack[-1] if stack and isinstance(stack[-1], FactoryCapture) else None
    if mode is not None:
        mode.__exit__(None, None, None)
    try:
        with capture_suspended():
            yield mode
    finally:
        if mode is not None:
            mode.__enter__()


@contextlib.contextmanager
def capture_resumed(mode: FactoryCapture | None) -> Iterator[None]:
    """Inside :func:`capture_paused` (which yielded ``mode``): the capture back on, for a stretch of DTensor code (the
    KV cache's update called from a fast block)."""
    global _suspended
    _suspended -= 1
    if mode is not None:
        mode.__enter__()
    try:
        yield
    finally:
        if mode is not None:
            mode.__exit__(None, None, None)
        _suspended += 1


@contextlib.contextmanager
def compiled_region() -> Iterator[None]:
    """Inside, a compiled graph runs: factories are captured while dynamo traces it, not when its code executes.

    Dynamo traces this mode into the graph (the ``from_local`` of a captured ``torch.ones`` is part of the graph),
    so when the graph's code later runs under the still-active mode its factory calls must stay plain.
    """
    global _compiled
    _compiled += 1
    try:
        yield
    finally:
        _compiled -= 1
