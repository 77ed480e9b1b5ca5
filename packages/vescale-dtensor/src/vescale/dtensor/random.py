"""Counter-based random numbers that do not depend on how a tensor is sharded.

Every value is a pure function of ``(seed, call sequence number, global element index)`` computed with Philox4x32-10
(:mod:`vescale.dtensor._philox`), so a DTensor of any placement (``Shard``, uneven, ``InterleavedShard``,
``RaggedShard``, 2-d meshes) gets, on each rank and with no communication, exactly the slice of the values the same
call gives a plain tensor on one process. The reference is the same vescale call on one process: a plain tensor
inside :func:`single_device` (or a world size of 1). The values differ from ``torch.manual_seed``'s generator.

How calls are intercepted:

* After :func:`manual_seed`, the random aten ops of **every DTensor** (``uniform_``, ``normal_``, ``bernoulli_``,
  ``bernoulli``, ``random_``, ``native_dropout``, ``rand_like``, ``randn_like``, ``randint_like``, and
  ``exponential_``, ``geometric_``, ``log_normal_``, ``cauchy_``: inverse-CDF transforms of uniforms in the open
  interval (0, 1), see :mod:`vescale.dtensor._random_values`) use this scheme, through torch's DTensor
  custom-op-handler table. Every other random aten op that reaches a DTensor (:func:`undrawn_random_ops`:
  ``multinomial``, ``poisson``, ``rrelu_with_noise``, ``normal`` with tensor arguments, ``.out`` variants, ...)
  raises :class:`~vescale.dtensor.errors.UndrawnRandomError` naming it, on every rank and before any collective,
  instead of drawing per rank from torch's generator. Hence ``torch.nn.init.*`` (``normal_``, ``uniform_``,
  ``trunc_normal_``, ``kaiming_*``, ``xavier_*``) and ``F.dropout`` on DTensors follow it without code changes.
* Inside ``with single_device():`` (a ``TorchDispatchMode``) the same ops on **plain tensors** use it too, as do
  factory calls ``torch.rand/randn/randint``. This is the single-device reference, and what deferred init replays.
* :func:`rand`, :func:`randn`, :func:`randint` build DTensors (``device_mesh=``, ``placements=``) or plain tensors.

The sequence number advances by one per call on every rank: ranks must make the same random calls in the same order
(SPMD), which is what makes the scheme communication free. ``orthogonal_`` and ``sparse_`` of ``torch.nn.init`` are
not supported on sharded tensors (they need the whole matrix).

Activation checkpointing (``torch.utils.checkpoint``, reentrant or not, and
:func:`vescale.parallel.checkpoint_activations`): torch restores only its own generators before a recompute, so a
plain counter would hand the recompute the *next* values (other dropout masks, wrong gradients). Here every random
call made inside a checkpointed region's forward is recorded with that region (its seed and sequence number, per
random op, in order), and the same call during the region's recompute replays the recorded values instead of
drawing: recomputed masks are bitwise the forward's, and the recompute does not advance the sequence, so the state
after a checkpointed step equals the state without checkpointing (later steps are bitwise equal too). Regions are
told apart by torch's own per-call objects (:func:`vescale.core.torch_internals.checkpoint_regions`), so nested
regions, several microbatches in flight, reseeding between steps and ``preserve_rng_state=False`` (values are still
replayed) are covered. Replay is per random op in call order, like torch's selective checkpointing, so ops a policy
saves are simply not replayed. A recompute that makes a random call its forward did not make raises
:class:`CheckpointReplayError` (on every rank: the calls are SPMD) instead of returning other values.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Sequence
from contextlib import contextmanager

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate

from vescale.core import torch_internals
from vescale.core.torch_internals import TorchDispatchMode
from vescale.dtensor._random_values import (
    MANTISSA,
    cauchy_values,
    check_params,
    exponential_values,
    geometric_values,
    log_normal_values,
    normal_values,
    randint_values,
    uniform01,
    uniform_values,
)
from vescale.dtensor.errors import CheckpointReplayError, CompiledRandomError, PlacementError, UndrawnRandomError
from vescale.dtensor.layout import global_flat_index

__all__ = ["manual_seed", "initial_seed", "get_state", "set_state", "single_device", "rand", "randn", "randint",
           "normal_", "uniform_", "bernoulli_", "dropout", "is_installed", "uninstall", "fill_random",
           "CheckpointReplayError", "undrawn_random_ops"]

aten = torch.ops.aten

_seed: int = 0
_seq: int = 0
_installed: bool = False


def manual_seed(seed: int) -> None:
    """Seed the counter-based generator, reset the call sequence to 0, and route DTensor random ops to it."""
    global _seed, _seq
    _seed = int(seed) & ((1 << 64) - 1)
    _seq = 0
    _install()


def initial_seed() -> int:
    """The seed set by the last :func:`manual_seed`."""
    return _seed


def get_state() -> tuple[int, int]:
    """``(seed, next call sequence number)``; restore it with :func:`set_state`."""
    return _seed, _seq


def set_state(state: tuple[int, int]) -> None:
    """Restore a state from :func:`get_state` (the seed and the next call sequence number)."""
    global _seed, _seq
    _seed, _seq = int(state[0]), int(state[1])


def _next_seq() -> int:
    global _seq
    s = _seq
    _seq += 1
    return s


# ------------------------------------------------------------------------------------ activation checkpointing replay

class _RegionDraws:
    """What one checkpoint region's forward drew (``key -> [(seed, seq), ...]`` in call order) and, per recompute,
    how many of each key that recompute has replayed."""

    __slots__ = ("draws", "replayed")

    def __init__(self) -> None:
        self.draws: dict[str, list[tuple[int, int]]] = {}
        self.replayed: dict[object, dict[str, int]] = {}


# region object (torch's, one per checkpoint call) -> its draws; dies with the region after its backward
_regions: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _draw(key: str) -> tuple[int, int]:
    """``(seed, sequence number)`` for the next random call ``key`` (an op name).

    Outside checkpointing: the current seed and the next sequence number. Inside a checkpointed region's forward the
    same, recorded with every enclosing region up to the innermost recompute. Inside a recompute: the values the
    region's forward drew for its n-th ``key`` call (the sequence does not advance).
    """
    regions = torch_internals.checkpoint_regions()
    recording = []
    source = None
    for region, token in regions:  # innermost first
        if token is not None:
            source = (region, token)
            break
        recording.append(region)
    draw = _replay(*source, key) if source is not None else (_seed, _next_seq())
    for region in recording:
        record = _regions.get(region)
        if record is None:
            record = _regions[region] = _RegionDraws()
        record.draws.setdefault(key, []).append(draw)
    return draw


def _replay(region, token, key: str) -> tuple[int, int]:
    record = _regions.get(region)
    drawn = record.draws.get(key, []) if record is not None else []
    done = record.replayed.setdefault(token, {}) if record is not None else {}
    i = done.get(key, 0)
    if i >= len(drawn):
        raise CheckpointReplayError(
            f"activation checkpointing: the recompute of a checkpointed region made random call {key} number {i + 1}, "
            f"but the region's forward made only {len(drawn)} such call(s); vescale's RNG cannot give the recompute "
            "the forward's values. Keep the region's random calls (dropout p, module.training, control flow) the "
            "same between forward and backward")
    done[key] = i + 1
    return drawn[i]


# ------------------------------------------------------------------------------------------------------- targets

_BLOCK = 1 << 20  # elements generated per block

def _index_placements(placements: Sequence[Placement], op: str, allow_partial: bool) -> tuple[Placement, ...]:
    out = []
    for mesh_dim, p in enumerate(placements):
        if isinstance(p, Partial):
            if not allow_partial:
                raise PlacementError(f"{op}: cannot fill a DTensor with a Partial placement on mesh dim {mesh_dim} "
                                     f"({tuple(placements)}) with random values; redistribute it first")
            p = Replicate()
        out.append(p)
    return tuple(out)


def _index_of(t: torch.Tensor, op: str, allow_partial: bool = False) -> torch.Tensor:
    """Global flat index of each local element of ``t`` (plain tensor: its own row-major index)."""
    if isinstance(t, DTensor):
        pl = _index_placements(t.placements, op, allow_partial)
        idx = global_flat_index(t.shape, t.device_mesh, pl)
    else:
        idx = global_flat_index(t.shape)
    return idx


def _local(t: torch.Tensor) -> torch.Tensor:
    # the stored shard itself: fills write it in place, often from inside DTensor's dispatch (below autograd)
    return torch_internals.local_tensor(t)


def fill_random(target: torch.Tensor, kind: str, *params, seq: int | None = None, seed: int | None = None,
                index: torch.Tensor | None = None, key: str | None = None) -> torch.Tensor:
    """Overwrite ``target`` (plain tensor or DTensor) in place with ``kind`` in ``uniform``/``normal``/``randint``/
    ``bernoulli``/``exponential``/``geometric``/``log_normal``/``cauchy`` values (``params`` as the aten op takes them
    after the tensor); consumes one sequence number unless ``seq`` is given. Returns ``target``.

    ``index`` overrides the global element indices (deferred init passes the indices of a view). ``key`` names the
    call for checkpoint replay (the aten op; default ``kind``); inside a checkpoint recompute the forward's values
    are replayed (module docstring).
    """
    check_params(kind, params)  # torch's own refusals, before a sequence number is spent
    if seq is None:
        drawn_seed, seq = _draw(key or kind)
        seed = drawn_seed if seed is None else seed
    seed = _seed if seed is None else seed
    local = _local(target)
    if local.is_meta:
        return target
    idx = _index_of(target, kind) if index is None else index.view(local.shape)
    idx = idx.to(local.device)  # generate where the tensor lives (GPU ranks compute their shard on the GPU)
    if kind == "bernoulli" and isinstance(params[0], torch.Tensor):
        p_local = _local(params[0]).to(local.device)
        params = (p_local.expand(local.shape).reshape(-1),)
    flat_idx = idx.reshape(-1)
    out = local.view(-1) if local.is_contiguous() else torch.empty(local.numel(), dtype=local.dtype,
                                                                     device=local.device)
    # Blocks bound the Philox temporaries (several int64 arrays per element) to a constant, not the shard size.
    with torch.no_grad():
        for start in range(0, flat_idx.numel(), _BLOCK):
            block = flat_idx[start:start + _BLOCK]
            out[start:start + block.numel()] = _values(kind, block, seq, seed, params, local.dtype, start)
        if not local.is_contiguous():
            local.copy_(out.view(local.shape))
    return target


def _values(kind: str, idx: torch.Tensor, seq: int, seed: int, params, dtype: torch.dtype,
            start: int) -> torch.Tensor:
    if kind == "uniform":
        return uniform_values(idx, seq, seed, float(params[0]), float(params[1]), dtype)
    if kind == "normal":
        return normal_values(idx, seq, seed, float(params[0]), float(params[1]), dtype)
    if kind == "randint":
        return randint_values(idx, seq, seed, int(params[0]), int(params[1]), dtype)
    if kind == "bernoulli":
        p = params[0]
        p = p[start:start + idx.numel()] if isinstance(p, torch.Tensor) else float(p)
        return (uniform01(idx, seq, seed) < p).to(dtype)
    if kind == "exponential":
        return exponential_values(idx, seq, seed, float(params[0]), dtype)
    if kind == "geometric":
        return geometric_values(idx, seq, seed, float(params[0]), dtype)
    if kind == "log_normal":
        return log_normal_values(idx, seq, seed, float(params[0]), float(params[1]), dtype)
    if kind == "cauchy":
        return cauchy_values(idx, seq, seed, float(params[0]), float(params[1]), dtype)
    raise ValueError(f"fill_random: unknown kind {kind!r}")


def _random_bounds(t: torch.Tensor, frm, to) -> tuple[int, int]:
    if to is None:
        if t.dtype.is_floating_point:
            to = (1 << MANTISSA.get(t.dtype, 53)) + 1
        elif t.dtype == torch.bool:
            to = 2
        else:
            to = min(torch.iinfo(t.dtype).max, (1 << 53) - 1) + 1
    return int(frm), int(to)


def _dropout(x: torch.Tensor, p: float, train: bool | None):
    """(out, keep mask) of ``native_dropout`` computed exactly as torch's CPU dropout decomposes it
    (``noise = bernoulli_(1 - p); noise.div_(1 - p); out = x * noise``), so both paths give the same bits."""
    local = _local(x)
    if not train or p == 0.0:
        out_local, keep = local.clone(), torch.ones_like(local, dtype=torch.bool)
    else:
        seed, seq = _draw(str(aten.native_dropout.default))
        noise = torch.empty_like(local)
        if not local.is_meta:
            idx = _index_of(x, "dropout", allow_partial=True).to(local.device)
            noise.copy_((uniform01(idx, seq, seed) < 1.0 - p).view(local.shape))
        keep = noise != 0
        noise.div_(1.0 - p) if p < 1.0 else noise.zero_()
        out_local = local * noise
    if isinstance(x, DTensor):
        spec = torch_internals.dtensor_spec(x)  # built below autograd: DTensor.from_local would record a node
        return (DTensor(out_local, spec, requires_grad=False),
                DTensor(keep, _with_dtype(spec, torch.bool), requires_grad=False))
    return out_local, keep


def _with_dtype(spec, dtype: torch.dtype):
    from vescale.core.torch_internals import DTensorSpec, TensorMeta

    meta = spec.tensor_meta
    return DTensorSpec(spec.mesh, spec.placements, tensor_meta=TensorMeta(meta.shape, meta.stride, dtype))


def _like(x: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    local = _local(x)
    dtype = dtype or local.dtype
    out_local = torch.empty(local.shape, dtype=dtype, device=local.device)
    if isinstance(x, DTensor):
        spec = torch_internals.dtensor_spec(x)
        _index_placements(spec.placements, "random *_like", allow_partial=False)
        return DTensor(out_local, _with_dtype(spec, dtype), requires_grad=False)
    return out_local


#: In-place fills of the inverse-CDF distributions: op -> (kind, ((argument name, default), ...)) as torch's schema.
_DISTRIBUTIONS = {
    aten.exponential_.default: ("exponential", (("lambd", 1.0),)),
    aten.geometric_.default: ("geometric", (("p", None),)),
    aten.log_normal_.default: ("log_normal", (("mean", 1.0), ("std", 2.0))),
    aten.cauchy_.default: ("cauchy", (("median", 0.0), ("sigma", 1.0))),
}


def _args(positional: Sequence, kwargs: dict, defaults: tuple[tuple[str, object], ...]) -> list:
    """The values of the parameters ``defaults`` names, from positional arguments, then keywords, then defaults."""
    return [positional[i] if i < len(positional) else kwargs.get(name, default)
            for i, (name, default) in enumerate(defaults)]


def _handle(func, args, kwargs, index: torch.Tensor | None = None):
    """Run random aten op ``func`` with the counter RNG; NotImplemented for ops it does not cover.

    ``index`` overrides the element indices of an in-place fill (deferred init replaying a write to a view).
    Raises :class:`CompiledRandomError` while ``torch.compile`` traces: the counter advances in Python at trace time,
    so a compiled graph would replay one draw (the same dropout mask) on every call.
    """
    if torch.compiler.is_compiling():
        raise CompiledRandomError(
            f"{func} on a DTensor inside torch.compile: vescale's counter RNG (dropout masks and init equal to one "
            "device's) runs eagerly only; a compiled graph would repeat one mask on every call. Set dropout to 0 or "
            "call .eval() for the compiled region, compile only blocks without dropout "
            "(vescale.parallel.compile_parallel checks this), or vescale.dtensor.random.uninstall() to use torch's "
            "RNG (masks then differ from one device's)")
    fill = functools.partial(fill_random, key=str(func))  # checkpoint replay matches calls per op
    kwargs = dict(kwargs or {})
    kwargs.pop("generator", None)
    if func is aten.uniform_.default:
        return fill(args[0], "uniform", *(list(args[1:3]) + [kwargs.get("from", 0.0), kwargs.get("to", 1.0)]
                                                 [len(args[1:3]):]), index=index)
    if func is aten.normal_.default:
        return fill(args[0], "normal", *(list(args[1:3]) + [kwargs.get("mean", 0.0), kwargs.get("std", 1.0)]
                                                [len(args[1:3]):]), index=index)
    if func is aten.bernoulli_.float or func is aten.bernoulli_.Tensor:
        p = args[1] if len(args) > 1 else kwargs.get("p", 0.5)
        return fill(args[0], "bernoulli", p, index=index)
    if func is aten.bernoulli.default:
        out = _like(args[0], None)
        return fill(out, "bernoulli", args[0])
    if func is aten.bernoulli.p:
        out = _like(args[0], None)
        return fill(out, "bernoulli", args[1] if len(args) > 1 else kwargs["p"])
    if func in (aten.random_.default, aten.random_.to, getattr(aten.random_, "from")):
        t = args[0]
        if func is aten.random_.default:
            frm, to = _random_bounds(t, 0, None)
        elif func is aten.random_.to:
            frm, to = 0, args[1] if len(args) > 1 else kwargs["to"]
        else:
            frm = args[1] if len(args) > 1 else kwargs["from"]
            to = args[2] if len(args) > 2 else kwargs.get("to")
            frm, to = _random_bounds(t, frm, to)
        return fill(t, "randint", frm, to, index=index)
    if func in _DISTRIBUTIONS:
        kind, defaults = _DISTRIBUTIONS[func]
        return fill(args[0], kind, *_args(args[1:], kwargs, defaults), index=index)
    if func is aten.native_dropout.default:
        return _dropout(args[0], float(args[1]), args[2] if len(args) > 2 else kwargs.get("train"))
    if func in (aten.rand_like.default, aten.randn_like.default):
        out = _like(args[0], kwargs.get("dtype"))
        kind, params = ("uniform", (0.0, 1.0)) if func is aten.rand_like.default else ("normal", (0.0, 1.0))
        return fill(out, kind, *params)
    if func is aten.randint_like.default:
        out = _like(args[0], kwargs.get("dtype"))
        return fill(out, "randint", 0, args[1] if len(args) > 1 else kwargs["high"])
    if func is aten.randint_like.low_dtype:
        out = _like(args[0], kwargs.get("dtype"))
        return fill(out, "randint", args[1], args[2])
    return NotImplemented


def _handle_factory(func, args, kwargs):
    """``torch.rand/randn/randint`` on plain tensors (inside :func:`single_device`)."""
    fill = functools.partial(fill_random, key=str(func))
    kwargs = dict(kwargs or {})
    kwargs.pop("generator", None)
    if func in (aten.rand.default, aten.randn.default):
        out = torch.empty(args[0], dtype=kwargs.get("dtype") or torch.get_default_dtype(), device=kwargs.get("device"))
        return fill(out, "uniform" if func is aten.rand.default else "normal", 0.0, 1.0)
    if func in (aten.randint.default, aten.randint.low):
        low, high, size = (0, args[0], args[1]) if func is aten.randint.default else args[:3]
        out = torch.empty(size, dtype=kwargs.get("dtype") or torch.int64, device=kwargs.get("device"))
        return fill(out, "randint", low, high)
    return NotImplemented


_DTENSOR_OPS = (aten.uniform_.default, aten.normal_.default, aten.bernoulli_.float, aten.bernoulli_.Tensor,
                aten.bernoulli.default, aten.bernoulli.p, aten.random_.default, aten.random_.to,
                getattr(aten.random_, "from"), aten.native_dropout.default, aten.rand_like.default,
                aten.randn_like.default, aten.randint_like.default, aten.randint_like.low_dtype, *_DISTRIBUTIONS)
_FACTORY_OPS = (aten.rand.default, aten.randn.default, aten.randint.default, aten.randint.low)


#: Seeded kernels that draw only with an argument (attention's ``dropout_p``, an RNN's ``dropout``) or not at all:
#: not refused here (SDPA with dropout on DTensors is refused by its sharding rule).
_CONDITIONAL = ("attention", "sdp", "rnn", "lstm", "gru", "cudnn", "miopen", "nested_tensor")


@functools.cache
def undrawn_random_ops() -> tuple:
    """The ATen random ops (torch's ``nondeterministic_seeded`` tag) that take a tensor and reach DTensor dispatch
    (not ``CompositeImplicitAutograd``: those decompose first), that the counter RNG does not draw, less the
    kernels that draw only with a dropout argument. While the counter RNG is installed each of them raises
    :class:`UndrawnRandomError` on a DTensor instead of drawing per rank from torch's generator."""
    drawn = set(_DTENSOR_OPS) | set(_FACTORY_OPS)
    out = [op for op in torch_internals.aten_ops_with_tensor_arguments(torch.Tag.nondeterministic_seeded)
           if op not in drawn and not any(word in op.name() for word in _CONDITIONAL)]
    return tuple(out)


def _refuse(func, args, kwargs):
    """Custom DTensor handler of :func:`undrawn_random_ops`: the same refusal on every rank (SPMD), no collective."""
    raise UndrawnRandomError(
        f"{func} on a DTensor: vescale's counter RNG does not draw this op, so each rank would draw from torch's own "
        "generator and the values would not be one device's (under data or tensor parallelism alike). Draw it on a "
        "plain tensor outside the parallel region, turn it off (eval mode), or call "
        "vescale.dtensor.random.uninstall() to accept torch's per-rank values")


def _install() -> None:
    global _installed
    if not _installed:
        # torch's own extension point for per-op DTensor behaviour (loss_parallel uses it the same way).
        handlers = torch_internals.dtensor_custom_op_handlers()
        handlers.update({op: _refuse for op in undrawn_random_ops()})
        handlers.update({op: _handle for op in _DTENSOR_OPS})
        _installed = True


def is_installed() -> bool:
    """Whether DTensor random ops currently go through the counter RNG."""
    return _installed


def uninstall() -> None:
    """Give DTensor random ops back to torch's own RNG (until the next :func:`manual_seed`)."""
    global _installed
    handlers = torch_internals.dtensor_custom_op_handlers()
    for op in (*_DTENSOR_OPS, *undrawn_random_ops()):
        if handlers.get(op) in (_handle, _refuse):
            del handlers[op]
    _installed = False


class _SingleDeviceMode(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in _DTENSOR_OPS:
            out = _handle(func, args, kwargs)
            if out is not NotImplemented:
                return out
        elif func in _FACTORY_OPS:
            out = _handle_factory(func, args, kwargs)
            if out is not NotImplemented:
                return out
        return func(*args, **(kwargs or {}))


@contextmanager
def single_device():
    """Inside, random ops on plain tensors (and DTensors) use the counter RNG: the single-device reference."""
    with _SingleDeviceMode():
        yield


# ---------------------------------------------------------------------------------------------------- public calls

def _make(size, kind: str, params, device_mesh, placements, dtype, requires_grad: bool) -> torch.Tensor:
    size = tuple(size[0]) if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)) else tuple(size)
    if device_mesh is None:
        out = torch.empty(size, dtype=dtype)
    else:
        from vescale.dtensor.api import from_local
        from vescale.dtensor.layout import local_shape, validate_placements

        placements = validate_placements(size, device_mesh, placements or (Replicate(),) * device_mesh.ndim,
                                         what=f"random {kind} tensor")
        local = torch.empty(local_shape(size, device_mesh, placements), dtype=dtype,
                            device=device_mesh.device_type)
        out = from_local(local, device_mesh, placements, shape=size)
    fill_random(out, kind, *params)
    return out.requires_grad_(requires_grad)


def rand(*size, device_mesh=None, placements: Sequence[Placement] | None = None, dtype: torch.dtype | None = None,
         requires_grad: bool = False) -> torch.Tensor:
    """Uniform [0, 1) values of global ``size``: a DTensor with ``placements`` on ``device_mesh``, else plain."""
    return _make(size, "uniform", (0.0, 1.0), device_mesh, placements, dtype or torch.get_default_dtype(),
                 requires_grad)


def randn(*size, device_mesh=None, placements: Sequence[Placement] | None = None, dtype: torch.dtype | None = None,
          requires_grad: bool = False) -> torch.Tensor:
    """Standard normal values of global ``size`` (DTensor with a mesh, else a plain tensor)."""
    return _make(size, "normal", (0.0, 1.0), device_mesh, placements, dtype or torch.get_default_dtype(),
                 requires_grad)


def randint(low: int, high: int, size: Sequence[int], *, device_mesh=None,
            placements: Sequence[Placement] | None = None, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """Integers uniform in ``[low, high)`` of global ``size`` (DTensor with a mesh, else a plain tensor)."""
    return _make((tuple(size),), "randint", (low, high), device_mesh, placements, dtype, False)


def normal_(tensor: torch.Tensor, mean: float = 0.0, std: float = 1.0) -> torch.Tensor:
    """Fill ``tensor`` (plain or DTensor) with normal values in place; returns it."""
    return fill_random(tensor, "normal", mean, std)


def uniform_(tensor: torch.Tensor, a: float = 0.0, b: float = 1.0) -> torch.Tensor:
    """Fill ``tensor`` (plain or DTensor) with uniform values in ``[a, b)`` in place; returns it."""
    return fill_random(tensor, "uniform", a, b)


def bernoulli_(tensor: torch.Tensor, p: float | torch.Tensor = 0.5) -> torch.Tensor:
    """Fill ``tensor`` with 1 with probability ``p`` (a float or a tensor laid out like ``tensor``), else 0."""
    return fill_random(tensor, "bernoulli", p)


def dropout(x: torch.Tensor, p: float = 0.5, training: bool = True) -> torch.Tensor:
    """``F.dropout`` with the counter RNG, differentiable (plain tensor or DTensor; not ``Partial`` or ragged)."""
    if not training or p == 0.0:
        return x
    with single_device():
        return torch.nn.functional.dropout(x, p, training=True)
