"""The one door to torch's private API: every private torch name vescale needs, each with why no public API serves.

Everything else in the project uses torch's public API or this module; ``tests/test_private_torch_access.py``
fails on a private torch access anywhere else (its docstring states the rule). When torch moves, this is the one file
to audit.

Names from ``torch.distributed.tensor`` are imported on first access (``from vescale.core.torch_internals import
DTensorSpec`` imports torch's module then), so that importing :mod:`vescale.core` never imports the DTensor stack
and works on a torch built without distributed. Nothing here patches torch; the packages that hook into torch
install their hooks on first use, idempotently.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

# torch ships no public pytree module (2.13 has no ``torch.utils.pytree``); this is the one torch.export,
# torch.compile and DTensor use, so its specs compare equal to theirs.
import torch.utils._pytree as pytree

# torch's ops as dispatch modes see them; no public alias of either class exists.
from torch._ops import HigherOrderOperator, OpOverload

# The only base class for a Python dispatch mode (what ``CommDebugMode`` and ``FakeTensorMode`` subclass); torch
# has no public one.
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "pytree",
    "OpOverload",
    "HigherOrderOperator",
    "TorchDispatchMode",
    # imported on first access (torch.distributed.tensor and friends)
    "StridedShard",
    "DTensorSpec",
    "TensorMeta",
    "OpSchema",
    "OpSpec",
    "OpStrategy",
    "StrategyType",
    "TupleStrategy",
    "RuntimeSchemaInfo",
    "register_op_strategy",
    "generate_redistribute_costs",
    "expand_to_full_mesh_op_strategy",
    "view_ops",
    "Broadcast",
    "Flatten",
    "InputDim",
    "NewDim",
    "Repeat",
    "Singleton",
    "Split",
    "ExplicitRedistributionContext",
    "reparametrize_module",
    # accessors
    "outside_dispatch_modes",
    "local_tensor",
    "dtensor_spec",
    "replace_dtensor_contents",
    "current_mesh",
    "flattened_mesh",
    "split_factor",
    "split_tensor",
    "dtensor_custom_op_handlers",
    "sharding_propagator",
    "clear_sharding_caches",
    "traceable_all_reduce",
    "op_schema",
    "storage_id",
    "tensor_version",
    "set_own_parameters",
    "compiled_original",
    "compiled_call",
    "set_compiled_call",
    "call_uncompiled",
    "dynamo_explain",
    "queue_end_of_backward",
    "set_group_timeout",
    "default_store",
    "flight_recorder_json",
    "fake_store",
    "meta_nonzero_assumed",
    "checkpoint_regions",
    "torch_graph_task_id",
    "function_mode_stack",
]

_DT = "torch.distributed.tensor"

# name -> (module, attribute or None for the module itself), imported on first access.
_LAZY: dict[str, tuple[str, str | None]] = {
    # Interleaved sharding (vescale's InterleavedShard subclasses it; FSDP2 + TP produce it): torch keeps the class
    # private while its layout semantics settle.
    "StridedShard": (f"{_DT}.placement_types", "_StridedShard"),
    # A DTensor's layout record. The sharding-rule API speaks in specs, and building a DTensor below autograd (inside
    # a dispatch handler, where ``DTensor.from_local`` would record a graph node) needs one.
    "DTensorSpec": (f"{_DT}._dtensor_spec", "DTensorSpec"),
    "TensorMeta": (f"{_DT}._dtensor_spec", "TensorMeta"),
    # torch's sharding-rule registration API (the one its own op rules use); there is no public way to add a
    # sharding rule for an ATen op.
    "OpSchema": (f"{_DT}._op_schema", "OpSchema"),
    "OpSpec": (f"{_DT}._op_schema", "OpSpec"),
    "OpStrategy": (f"{_DT}._op_schema", "OpStrategy"),
    "StrategyType": (f"{_DT}._op_schema", "StrategyType"),
    "TupleStrategy": (f"{_DT}._op_schema", "TupleStrategy"),
    "RuntimeSchemaInfo": (f"{_DT}._op_schema", "RuntimeSchemaInfo"),
    "register_op_strategy": (f"{_DT}._ops.utils", "register_op_strategy"),
    "generate_redistribute_costs": (f"{_DT}._ops.utils", "generate_redistribute_costs"),
    "expand_to_full_mesh_op_strategy": (f"{_DT}._ops.utils", "expand_to_full_mesh_op_strategy"),
    # torch's view-op dim maps (``dim_maps``, ``propagate_shape_and_sharding``) and their dim-spec classes: the
    # interleaved view rules reuse torch's own description of each view op instead of re-deriving it.
    "view_ops": (f"{_DT}._ops._view_ops", None),
    "Broadcast": (f"{_DT}._ops._view_ops", "Broadcast"),
    "Flatten": (f"{_DT}._ops._view_ops", "Flatten"),
    "InputDim": (f"{_DT}._ops._view_ops", "InputDim"),
    "NewDim": (f"{_DT}._ops._view_ops", "NewDim"),
    "Repeat": (f"{_DT}._ops._view_ops", "Repeat"),
    "Singleton": (f"{_DT}._ops._view_ops", "Singleton"),
    "Split": (f"{_DT}._ops._view_ops", "Split"),
    # The hook torch calls on every implicit redistribution its dispatcher decides on; strict mode wraps it. torch
    # exposes only a context manager that warns or raises without naming vescale's placements.
    "ExplicitRedistributionContext": (f"{_DT}._utils", "ExplicitRedistributionContext"),
    # Swaps a module's tensors for one call without re-entering ``module.__call__``; the public
    # ``torch.func.functional_call`` re-enters it and would run the module's hooks twice.
    "reparametrize_module": ("torch.nn.utils.stateless", "_reparametrize_module"),
}


if TYPE_CHECKING:  # what the table above gives, for type checkers and linters
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.distributed.tensor._op_schema import (
        OpSchema,
        OpSpec,
        OpStrategy,
        RuntimeSchemaInfo,
        StrategyType,
        TupleStrategy,
    )
    from torch.distributed.tensor._ops import _view_ops as view_ops
    from torch.distributed.tensor._ops._view_ops import Broadcast, Flatten, InputDim, NewDim, Repeat, Singleton, Split
    from torch.distributed.tensor._ops.utils import (
        expand_to_full_mesh_op_strategy,
        generate_redistribute_costs,
        register_op_strategy,
    )
    from torch.distributed.tensor._utils import ExplicitRedistributionContext
    from torch.distributed.tensor.placement_types import _StridedShard as StridedShard
    from torch.nn.utils.stateless import _reparametrize_module as reparametrize_module


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attr = _LAZY[name]
    value = importlib.import_module(module)
    if attr is not None:
        value = getattr(value, attr)
    globals()[name] = value  # later accesses skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


def _is_dtensor(t: Any) -> bool:
    # No DTensor can exist before torch.distributed.tensor is imported, so this never imports it.
    module = sys.modules.get(_DT)
    return module is not None and isinstance(t, module.DTensor)


# ------------------------------------------------------------------------------------------------- DTensor internals


def local_tensor(t: Any) -> Any:
    """The tensor a DTensor stores for this rank (``t`` itself when ``t`` is not a DTensor).

    Why not ``DTensor.to_local()``: with grad enabled that returns a fresh differentiable view (an autograd node,
    which must not be created inside a dispatch handler and which refuses in-place writes to a parameter's shard);
    sites that write the shard in place, hand it to a collective, or run below autograd need the stored tensor itself.
    """
    return t._local_tensor if _is_dtensor(t) else t


def dtensor_spec(t: Any) -> Any:
    """A DTensor's ``DTensorSpec`` (mesh, placements, tensor meta, shard order).

    Why: building a DTensor below autograd takes the spec, and the order in which mesh dims shard one tensor dim
    (``shard_order``) has no public accessor.
    """
    return t._spec


def replace_dtensor_contents(dst: Any, src: Any) -> None:
    """Make DTensor ``dst`` hold ``src``'s local tensor and layout, in place (same global shape and values).

    Why: a module that keeps a reference to ``dst`` (a cache buffer) must see the new layout; torch has no public
    in-place re-layout of a DTensor object.
    """
    dst._local_tensor = src._local_tensor
    dst._spec = src._spec


def current_mesh() -> Any:
    """The mesh of the innermost ``with mesh:`` block (torch's default for a missing ``device_mesh``).

    Why: ``DeviceMesh`` is public as a context manager but torch offers no public getter of the current mesh.
    """
    from torch.distributed.device_mesh import _mesh_resources

    return _mesh_resources.get_current_mesh()


def flattened_mesh(mesh: Any) -> Any:
    """A 1-d mesh over all of ``mesh``'s ranks, cached by torch (so its process group is created once).

    Why: ``DeviceMesh._flatten`` is the only way to get one group over an N-d (sub-)mesh without a new
    ``dist.new_group`` call, which every rank of the world would have to make each time.
    """
    return mesh._flatten()


def split_factor(placement: Any) -> int:
    """The split factor of a ``StridedShard`` as an int. Why: the class is private (see ``StridedShard``)."""
    return placement._split_factor_int()


def split_tensor(placement: Any, tensor: Any, num_chunks: int, *, with_padding: bool = True,
                 contiguous: bool = True) -> tuple[list, list[int]]:
    """``(pieces, pad sizes)``: ``tensor`` cut in ``num_chunks`` as ``placement`` (``Shard``/``StridedShard``) cuts it.

    Why: the cutting rule DTensor itself applies (``torch.chunk``'s, interleaved for ``StridedShard``) is only
    available as the placements' private ``_split_tensor``; re-deriving it could drift from torch's.
    """
    return placement._split_tensor(tensor, num_chunks, with_padding=with_padding, contiguous=contiguous)


def dtensor_custom_op_handlers() -> dict:
    """torch's table of per-op DTensor handlers (``{OpOverload: handler}``), which loss_parallel uses too.

    Why: torch's only extension point that replaces how one ATen op runs on DTensors; it has no public registry.
    """
    from torch.distributed.tensor import DTensor

    return DTensor._op_dispatcher._custom_op_handlers


def traceable_all_reduce(tensor: Any, op: str, group: Any) -> Any:
    """``tensor`` all-reduced with ``op`` (``"sum"``, ``"max"``, ...) over ``group`` (a ``(mesh, dim)`` pair or a
    process group), as an op dynamo traces into a graph (a functional collective: returns a new tensor).

    Why: ``torch.distributed.all_reduce`` mutates in place and breaks a ``fullgraph`` capture; the functional form
    lives in the private ``torch.distributed._functional_collectives``.
    """
    from torch.distributed import _functional_collectives as funcol

    return funcol.all_reduce(tensor, op, group)


def clear_sharding_caches() -> None:
    """Forget every sharding decision DTensor cached: its Python propagation cache and its C++ fast-path cache.

    Why: a rule registered after DTensor ops already ran (vescale's ``install``) is otherwise bypassed for the op and
    layout combinations those ops cached on the fast path; torch offers only the private debug helper to clear both.
    """
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()


def sharding_propagator() -> Any:
    """torch's DTensor sharding propagator (its strategy table and cache).

    Why: wrapping a torch sharding strategy needs the registered one and its schema info; there is no public reader.
    """
    from torch.distributed.tensor import DTensor

    return DTensor._op_dispatcher.sharding_propagator


# --------------------------------------------------------------------------------------- ops, tensors and modules


def op_schema(func: Any) -> Any:
    """The ``FunctionSchema`` of an ATen op overload (arguments, alias info, returns).

    Why: an ``OpOverload`` exposes its schema only as ``_schema``.
    """
    return func._schema


def aten_ops_with_tensor_arguments(tag: Any, *, skip_composite_implicit: bool = True) -> list:
    """Every registered ``aten`` op overload carrying ``tag`` (a ``torch.Tag``) that takes a tensor argument; with
    ``skip_composite_implicit``, less those with a ``CompositeImplicitAutograd`` kernel (they decompose before any
    tensor subclass sees them). Sorted by qualified name.

    Why: torch lists registered op names, their dispatch keys and schemas only through ``torch._C``
    (``_dispatch_get_all_op_names``, ``_dispatch_has_kernel_for_dispatch_key``, ``OpOverload._schema``).
    """
    import torch

    out = []
    for name in sorted(torch._C._dispatch_get_all_op_names()):
        if not name.startswith("aten::"):
            continue
        base, _, overload = name[len("aten::"):].partition(".")
        op = getattr(getattr(torch.ops.aten, base, None), overload or "default", None)
        if op is None or tag not in op.tags:
            continue
        composite = torch._C._dispatch_has_kernel_for_dispatch_key(name, "CompositeImplicitAutograd")
        if skip_composite_implicit and composite:
            continue
        if any(a.type.isSubtypeOf(torch._C.TensorType.get()) for a in op._schema.arguments):
            out.append(op)
    return out


def storage_id(t: Any) -> int:
    """An id of ``t``'s storage, equal for every view of it and valid on the meta device.

    Why: ``untyped_storage()`` returns a new Python object per call and ``data_ptr()`` is 0 for every meta tensor;
    only the storage's C pointer identifies it.
    """
    return t.untyped_storage()._cdata


def tensor_version(t: Any) -> int:
    """``t``'s version counter (bumped by every in-place write to it or a view of it; RuntimeError for an inference
    tensor). Why: torch exposes the counter only as ``_version``."""
    return t._version


def set_own_parameters(module: Any, params: dict) -> None:
    """Make ``params`` (name -> tensor or None, plain tensors allowed) the whole table of ``module``'s own parameters,
    replacing the table rather than assigning attributes one by one.

    Why: ``nn.Module`` keeps its own parameters in ``_parameters``; ``setattr`` and ``register_parameter`` accept only
    ``nn.Parameter`` (or None) there, while an operator that runs a module's own ``forward`` on the tensors autograd
    hands it (plain tensors, views) needs exactly those tensors in the table, and a fresh table per call.
    """
    module._parameters = dict(params)


def compiled_original(module: Any) -> Any:
    """The module ``torch.compile(module)`` wrapped (its ``OptimizedModule._orig_mod``), or None if ``module`` is
    not such a wrapper. Why: ``OptimizedModule`` is private and keeps the original only as ``_orig_mod``."""
    import torch.nn as nn

    orig = getattr(module, "_orig_mod", None)
    return orig if isinstance(orig, nn.Module) else None


def compiled_call(module: Any) -> Callable | None:
    """What ``module.compile()`` installed as its compiled call (None before).

    Why: ``nn.Module.compile`` keeps it in ``_compiled_call_impl``; wrapping it (to run code around every compiled
    call, outside the traced region) has no public hook.
    """
    return module._compiled_call_impl


def set_compiled_call(module: Any, fn: Callable) -> None:
    """Replace ``module``'s compiled call with ``fn`` (see :func:`compiled_call`)."""
    module._compiled_call_impl = fn


def call_uncompiled(module: Any, *args: Any, **kwargs: Any) -> Any:
    """Run ``module`` with its hooks but without its compiled call.

    Why: after ``module.compile()`` both ``module(...)`` and the public API go through the compiled call;
    ``nn.Module._call_impl`` is the eager path it wraps.
    """
    import torch.nn as nn

    return nn.Module._call_impl(module, *args, **kwargs)


def dynamo_explain(fn: Callable) -> Callable:
    """``torch._dynamo.explain(fn)``: graph breaks and their reasons. Why: the explanation has no public API."""
    import torch._dynamo

    return torch._dynamo.explain(fn)


def queue_end_of_backward(callback: Callable[[], None]) -> None:
    """Run ``callback`` once the current backward pass ends (call it from inside backward).

    Why: autograd's engine callback queue is private (torch's DDP and FSDP2 use the same one); hooks on tensors
    fire per gradient, never once at the end.
    """
    from torch.autograd.variable import Variable

    Variable._execution_engine.queue_callback(callback)


def checkpoint_regions() -> list[tuple[Any, Any]]:
    """The ``torch.utils.checkpoint`` regions this thread is running in, innermost first, as ``(region, token)``.

    ``region`` is the object torch keeps for one checkpoint call, the same in its forward and in every recompute
    (the ``ctx`` of ``use_reentrant=True``, the checkpoint frame of ``use_reentrant=False``). ``token`` is None while
    the region's original forward runs and, while torch recomputes it during backward, an id of that recompute (the
    backward's graph task, so a second backward with ``retain_graph`` is a new recompute).

    Why: torch's checkpoint restores only torch's own generators for the recompute and exposes no hook or flag
    saying that a recompute (or a checkpointed forward) is running; vescale's counter RNG must replay the counter
    values the forward drew. The frames of torch's checkpoint functions on this thread's stack say it exactly.
    """
    import inspect

    from torch.utils import checkpoint as cp

    codes = _checkpoint_codes(cp, inspect)
    out: list[tuple[Any, Any]] = []
    frame = sys._getframe(1)
    while frame is not None:
        kind = codes.get(frame.f_code)
        if kind == "reentrant_forward":
            out.append((frame.f_locals["ctx"], None))
        elif kind == "reentrant_backward":
            out.append((frame.f_locals["ctx"], ("graph_task", torch_graph_task_id())))
        elif kind == "forward":
            gen = frame.f_locals.get("gen")
            gen_frame = getattr(gen, "gi_frame", None)
            region = gen_frame.f_locals.get("new_frame") if gen_frame is not None else None
            if region is not None:
                out.append((region, None))
        elif kind == "recompute":
            region = frame.f_locals.get("frame")
            if region is not None:
                out.append((region, ("gid", frame.f_locals.get("gid"))))
        frame = frame.f_back
    return out


_CHECKPOINT_CODES: dict = {}


def _checkpoint_codes(cp: Any, inspect: Any) -> dict:
    # code object -> what a frame running it is (torch.utils.checkpoint's private classes, see checkpoint_regions)
    if not _CHECKPOINT_CODES:
        _CHECKPOINT_CODES[cp.CheckpointFunction.forward.__code__] = "reentrant_forward"
        _CHECKPOINT_CODES[cp.CheckpointFunction.backward.__code__] = "reentrant_backward"
        _CHECKPOINT_CODES[inspect.unwrap(cp.checkpoint).__code__] = "forward"
        for const in cp._checkpoint_hook.__init__.__code__.co_consts:
            if getattr(const, "co_name", None) == "unpack_hook":  # the hook that runs the recompute
                _CHECKPOINT_CODES[const] = "recompute"
        if len(set(_CHECKPOINT_CODES.values())) != 4:
            raise RuntimeError("torch.utils.checkpoint changed: vescale cannot find its recompute hook "
                               "(vescale.core.torch_internals.checkpoint_regions must be updated)")
    return _CHECKPOINT_CODES


def function_mode_stack() -> list:
    """The active ``TorchFunctionMode``s, outermost first.

    Why: torch has no public read of the mode stack; torch's own checkpoint reads it to run a recompute under the
    forward's device context, and vescale's activation checkpointing does the same for its factory-capture mode.
    """
    from torch.overrides import _get_current_function_mode_stack

    return list(_get_current_function_mode_stack())


def torch_graph_task_id() -> int:
    """The id of the backward pass running on this thread (-1 outside backward).

    Why: autograd exposes no public id of the current backward; checkpoint's own recompute bookkeeping uses this one.
    """
    import torch

    return torch._C._current_graph_task_id()


def outside_dispatch_modes() -> Any:
    """A context manager that steps out of every active dispatch mode (the fake and proxy modes of a
    ``torch.compile`` trace), for plain integer bookkeeping on real tensors inside a sharding rule.

    Why: torch has no public way to leave the active modes; sharding rules run inside them while tracing.
    """
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes()


# ------------------------------------------------------------------------------------------- process groups (watchdog)


def set_group_timeout(group: Any, seconds: float) -> Any:
    """Make ``group`` (a ``ProcessGroup`` or its ``group_name``) time out collectives issued from now on after
    ``seconds``; return the ``ProcessGroup``.

    Why: the timeout is public only as an argument of ``init_process_group`` / ``new_group``; the groups a
    ``DeviceMesh`` creates take torch's 30-minute default, and functional collectives name their group by a string
    that only ``_resolve_process_group`` turns back into the group.
    """
    from datetime import timedelta

    import torch.distributed.distributed_c10d as c10d

    if isinstance(group, str):
        group = c10d._resolve_process_group(group)
    c10d._set_pg_timeout(timedelta(seconds=seconds), group)
    return group


def default_store() -> Any:
    """The key-value store the default process group was created with (``init_process_group``'s store).

    Why: the ranks of a hung collective can no longer talk through the process group; the store still works, and
    torch keeps it only as ``_get_default_store``.
    """
    import torch.distributed.distributed_c10d as c10d

    return c10d._get_default_store()


def flight_recorder_json() -> bytes:
    """torch's flight recorder (the last collectives of every process group of this rank, NCCL and gloo alike;
    recording only when ``TORCH_FR_BUFFER_SIZE`` > 0 was set before the group was created) as JSON bytes.

    Why: the dump is bound only as ``torch._C._distributed_c10d._dump_fr_trace_json``.
    """
    import torch._C._distributed_c10d as c10d_c

    return c10d_c._dump_fr_trace_json()


def fake_store() -> Any:
    """A store for ``init_process_group("cpu:fake,meta:fake", store=fake_store(), rank=r, world_size=n)``: a process
    group of any size in one process whose collectives communicate nothing (importing it registers the ``fake``
    backend).

    Why: torch ships its fake process group only under ``torch.testing._internal`` (``fake_pg.FakeStore``).
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


@contextlib.contextmanager
def meta_nonzero_assumed() -> Iterator[None]:
    """Within the block, ``nonzero`` of a meta tensor assumes every element is nonzero (a data-dependent output size
    gets the input's), so code that indexes by a mask runs on the meta device.

    Why: the switch is ``torch.fx.experimental._config.meta_nonzero_assume_all_nonzero``, a private config module.
    """
    import torch.fx.experimental._config as fx_config

    old = fx_config.meta_nonzero_assume_all_nonzero
    fx_config.meta_nonzero_assume_all_nonzero = True
    try:
        yield
    finally:
        fx_config.meta_nonzero_assume_all_nonzero = old
