"""Trace a model on the meta device: which parameter feeds which matmul, and how activations flow between them.

:func:`trace_model` runs ``model.forward`` once on meta tensors (``torch.func.functional_call`` swaps every parameter
and buffer for a meta tensor of the same shape, so no memory is used and the model's own weights are untouched)
under a :class:`~torch.overrides.TorchFunctionMode` that records

* matmul events (``F.linear``, ``addmm``, ``matmul``/``mm``/``bmm``, ``F.embedding``) with the parameter used, which
  of its dims is the input and which the output dim, the bias, and the *producers* of the input (the matmuls whose
  outputs reach it through any chain of non-matmul ops: the data-flow graph between matmuls),
* splits of a matmul output along its last dim (fused projections) and views that split it into heads,
* the *layout evidence* of every matmul output (:mod:`.evidence`): the views, splits, selections and contractions
  its features go through, from which the planner decides how a (fused) projection may be cut,
* every module call with the tensors it received and returned.

A submodule whose forward cannot run on meta tensors (data-dependent control flow, e.g. MoE routing with
``nonzero``) is recorded as *opaque*: its output is replaced by an empty tensor shaped like its first argument, and the
planner falls back to shape analysis for its parameters. If the root module itself fails, :class:`TraceError` is
raised and the planner uses the module tree alone.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from vescale.core.torch_internals import pytree
from vescale.plan.errors import TraceError
from vescale.plan.evidence import FeatureTracker, LayoutEvidence

__all__ = ["trace_model", "ModelTrace", "MatmulEvent", "ModuleCall", "RandomOp"]


@dataclass
class MatmulEvent:
    """One use of a parameter as a matmul/embedding operand.

    ``param`` is the canonical FQN; the data-flow node is ``param`` for a linear and ``param + "@embedding"`` for
    an embedding, so a tied weight used both ways is two nodes. ``in_dim``/``out_dim`` index the parameter's own dims
    (``None`` for the input dim of an embedding); ``producers`` are the matmul/opaque nodes whose outputs reach this
    call's activation input.
    """

    kind: str  # "linear" or "embedding"
    param: str
    in_dim: int | None
    out_dim: int
    bias: str | None
    input_id: int
    output_id: int
    producers: frozenset[str]
    out_shape: tuple[int, ...]


@dataclass
class ModuleCall:
    """One call of a submodule: ids of its tensor arguments (by position or keyword) and outputs (by index or key)."""

    fqn: str
    args: dict[Any, int]
    outputs: dict[Any, int]
    float_args: frozenset = frozenset()  # keys of the floating-point tensor arguments


@dataclass
class RandomOp:
    """One random op of the forward (dropout with ``p > 0`` in either mode, ``bernoulli``, ``rand_like``, ...):
    ``input_id``/``producers`` as for a matmul's input, ``stack`` the module FQNs around the call (outermost first)
    and ``calls_done`` how many module calls had completed before it (an index into ``ModelTrace.calls``)."""

    op: str
    input_id: int
    producers: frozenset[str]
    stack: tuple[str, ...]
    calls_done: int
    active: bool = True  # draws in this forward (False: a dropout called with ``training=False``)


@dataclass
class ModelTrace:
    """Everything :func:`trace_model` learned (see the module docstring)."""

    aliases: dict[str, list[str]]  # canonical parameter FQN -> every FQN of that Parameter (tied weights)
    shapes: dict[str, tuple[int, ...]]  # canonical parameter FQN -> shape
    events: list[MatmulEvent] = field(default_factory=list)
    taint: dict[int, frozenset[str]] = field(default_factory=dict)
    shape_of: dict[int, tuple[int, ...]] = field(default_factory=dict)
    view_parent: dict[int, int] = field(default_factory=dict)
    fused: dict[str, int] = field(default_factory=dict)  # param -> number of equal parts its output is split into
    heads: dict[str, int] = field(default_factory=dict)  # param -> heads per part its output is viewed as
    layouts: dict[str, LayoutEvidence] = field(default_factory=dict)  # param -> how its output features are used
    calls: list[ModuleCall] = field(default_factory=list)
    opaque: dict[str, str] = field(default_factory=dict)  # module FQN -> why it could not be traced
    root_outputs: dict[Any, int] = field(default_factory=dict)
    root_args: dict[Any, int] = field(default_factory=dict)
    flops: dict[str, float] = field(default_factory=dict)  # module FQN -> forward matmul flops of its own code
    # module FQN -> the first op in its own code that mixes along the sequence outside attention (a convolution over
    # time, a cumulative sum/scan): state-space and linear-attention mixers, which need the whole sequence
    seq_mixing: dict[str, str] = field(default_factory=dict)
    # embedding weight -> why its lookup may not reach any module output unchanged (module-tree fallback: an
    # ``nn.Embedding`` subclass with its own forward); the planner keeps such tables replicated
    transformed_lookups: dict[str, str] = field(default_factory=dict)
    # random ops in the order of the forward: a partial sum must be reduced before one (vescale's counter RNG cannot
    # fill a Partial tensor, and a mask of a partial sum is not the mask of the sum's layout)
    random_ops: list[RandomOp] = field(default_factory=list)
    stack: list[str] = field(default_factory=lambda: [""])

    def flops_under(self, prefix: str) -> float:
        """Forward flops of module ``prefix`` and everything inside it (``""``: the whole model)."""
        return sum(f for m, f in self.flops.items() if not prefix or m == prefix or m.startswith(prefix + "."))


_LINEAR = {F.linear}
_ADDMM = {torch.addmm, torch.Tensor.addmm}
_MATMUL = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.mm, torch.Tensor.mm, torch.bmm,
           torch.Tensor.bmm}
_SPLITS = {torch.split, torch.Tensor.split, torch.chunk, torch.Tensor.chunk, torch.tensor_split,
           torch.Tensor.tensor_split}
_T_PROPS = (torch.Tensor.T.__get__, torch.Tensor.mT.__get__)  # ``w.T`` / ``w.mT`` (Falcon's FalconLinear)
#: Ops that combine values along the sequence outside attention (causal convolutions and scans of SSM and
#: linear-attention mixers): a module calling one needs its whole sequence on every rank.
_SEQ_MIXING = {F.conv1d, torch.conv1d, torch.cumsum, torch.Tensor.cumsum, torch.cumprod, torch.Tensor.cumprod,
               torch.logcumsumexp, torch.Tensor.logcumsumexp}
#: Random ops (torch-function level) whose first argument's layout the op depends on; the dropouts are recorded
#: whenever their ``p`` is above 0, in training and in eval mode alike, so the plan does not depend on the mode.
_DROPOUTS = {F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout}
_RANDOM = _DROPOUTS | {torch.bernoulli, torch.Tensor.bernoulli, torch.Tensor.bernoulli_, torch.rand_like,
                       torch.randn_like, torch.randint_like, torch.Tensor.uniform_, torch.Tensor.normal_,
                       torch.Tensor.random_, torch.Tensor.exponential_, torch.Tensor.geometric_,
                       torch.Tensor.log_normal_, torch.Tensor.cauchy_}
_VIEWS = {torch.Tensor.view, torch.reshape, torch.Tensor.reshape, torch.Tensor.flatten, torch.flatten,
          torch.Tensor.unflatten, torch.unflatten}


class _Recorder(TorchFunctionMode):
    """Records matmul events and propagates producer sets through every other op."""

    def __init__(self, trace: ModelTrace, param_of: dict[int, tuple[str, int, bool]]) -> None:
        super().__init__()
        self.t = trace
        self.param_of = param_of  # id(tensor) -> (canonical fqn, leading dims indexed away, transposed)
        self.alive: list[torch.Tensor] = []  # keep every seen tensor alive so that ids stay unique
        self.features = FeatureTracker()
        trace.layouts = self.features.evidence

    def note(self, x: torch.Tensor, producers: frozenset[str]) -> None:
        self.alive.append(x)
        self.t.taint[id(x)] = producers
        self.t.shape_of[id(x)] = tuple(x.shape)

    def producers(self, x: Any) -> frozenset[str]:
        out: frozenset[str] = frozenset()
        for leaf in pytree.tree_flatten(x)[0]:
            if isinstance(leaf, torch.Tensor):
                out = out | self.t.taint.get(id(leaf), frozenset())
        return out

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in _SEQ_MIXING:
            self.t.seq_mixing.setdefault(self.t.stack[-1], getattr(func, "__name__", str(func)))
        try:
            self._record(func, args, kwargs, out)
        except Exception:  # recording must never change what the model computes
            pass
        return out

    def _param_operand(self, x: Any) -> tuple[str, int, bool] | None:
        return self.param_of.get(id(x)) if isinstance(x, torch.Tensor) else None

    def _count_flops(self, func, args, kwargs, out) -> None:
        """Multiply-adds x 2 of the matmul-like ops (the ones that dominate a transformer's compute)."""
        flops = 0.0
        if isinstance(out, torch.Tensor) and args and isinstance(args[0], torch.Tensor):
            if func in _LINEAR or func in _MATMUL:
                flops = 2.0 * out.numel() * args[0].shape[-1]
            elif func in _ADDMM and len(args) > 1:
                flops = 2.0 * out.numel() * args[1].shape[-1]
            elif func is F.scaled_dot_product_attention and len(args) >= 3:
                q, k = args[0], args[1]
                flops = 4.0 * q.numel() * k.shape[-2]
        if flops:
            top = self.t.stack[-1]
            self.t.flops[top] = self.t.flops.get(top, 0.0) + flops

    def _record(self, func, args, kwargs, out) -> None:
        self._count_flops(func, args, kwargs, out)
        if func in _RANDOM and args and isinstance(args[0], torch.Tensor):
            p = (args[1] if len(args) > 1 else kwargs.get("p", 0.5)) if func in _DROPOUTS else 1.0
            active = bool(args[2] if len(args) > 2 else kwargs.get("training", True)) if func in _DROPOUTS else True
            if not isinstance(p, (int, float)) or p > 0:
                self.t.random_ops.append(RandomOp(getattr(func, "__name__", str(func)), id(args[0]),
                                                  self.producers(args[0]), tuple(self.t.stack),
                                                  len(self.t.calls), active))
        outs = [o for o in pytree.tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
        if func is F.embedding and len(args) >= 2 and self._param_operand(args[1]):
            fqn = self._param_operand(args[1])[0]
            self._event("embedding", fqn, None, 0, None, args[0], out)
            return
        event = self._matmul(func, args, kwargs)
        if event is not None:
            (fqn, lead, transposed), x, w_in, w_out, bias = event
            if transposed:
                w_in, w_out = w_out, w_in
            self._event("linear", fqn, lead + w_in, lead + w_out, bias, x, out)
            if isinstance(out, torch.Tensor) and not lead:
                self.features.start(fqn, out)
            return
        self.features.step(func, args, kwargs, out)
        # propagate: derived-parameter views (indexing experts, .t()) and producer sets
        if args and self._param_operand(args[0]) and len(outs) == 1:
            fqn, lead, transposed = self._param_operand(args[0])
            if func in (torch.Tensor.__getitem__,) and outs[0].ndim < args[0].ndim:
                self.param_of[id(outs[0])] = (fqn, lead + args[0].ndim - outs[0].ndim, transposed)
                self.alive.append(outs[0])
            elif func in (torch.Tensor.t, torch.t) or any(func == g for g in _T_PROPS) \
                    or (func in (torch.Tensor.transpose, torch.transpose)
                        and sorted(a % args[0].ndim for a in args[1:3]) == [args[0].ndim - 2, args[0].ndim - 1]):
                self.param_of[id(outs[0])] = (fqn, lead, not transposed)
                self.alive.append(outs[0])
        producers = self.producers((args, kwargs))
        src = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if src is not None and len(producers) == 1 and src.ndim and id(src) in self.t.taint:
            (p,) = producers
            if func in _SPLITS and len(outs) > 1 and len({o.shape[-1] for o in outs}) == 1:
                dim = kwargs.get("dim", args[2] if len(args) > 2 else 0)
                if dim % src.ndim == src.ndim - 1 and sum(o.shape[-1] for o in outs) == src.shape[-1]:
                    self.t.fused[p] = len(outs)
            if func in _VIEWS and len(outs) == 1 and outs[0].ndim == src.ndim + 1 \
                    and outs[0].shape[-2] * outs[0].shape[-1] == src.shape[-1]:
                self.t.heads[p] = int(outs[0].shape[-2])
        if func in _VIEWS and src is not None and len(outs) == 1:
            self.t.view_parent[id(outs[0])] = id(src)
        for o in outs:
            self.note(o, producers)

    def _matmul(self, func, args, kwargs):
        """``((fqn, lead, transposed), activation, in_dim, out_dim, bias_fqn)`` for a matmul with a parameter."""
        if func in _LINEAR and len(args) >= 2 and self._param_operand(args[1]):
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            b = self._param_operand(bias)
            return self._param_operand(args[1]), args[0], 1, 0, b[0] if b else None
        if func in _ADDMM and len(args) >= 3 and self._param_operand(args[2]):
            b = self._param_operand(args[0])
            return self._param_operand(args[2]), args[1], 0, 1, b[0] if b else None
        if func in _MATMUL and len(args) >= 2 and self._param_operand(args[1]) and args[1].ndim >= 2:
            return self._param_operand(args[1]), args[0], 0, 1, None
        return None

    def _event(self, kind, fqn, in_dim, out_dim, bias, x, out) -> None:
        producers = self.producers(x)
        self.t.events.append(MatmulEvent(kind, fqn, in_dim, out_dim, bias, id(x), id(out), producers,
                                         tuple(out.shape)))
        self.note(out, frozenset([fqn if kind == "linear" else f"{fqn}@embedding"]))


def _ids(obj: Any) -> dict[Any, int]:
    """Tensor ids of a call's arguments or outputs, keyed by position or keyword/key."""
    if isinstance(obj, torch.Tensor):
        return {0: id(obj)}
    if isinstance(obj, dict) or hasattr(obj, "keys") and hasattr(obj, "__getitem__"):
        return {k: id(obj[k]) for k in obj.keys() if isinstance(obj[k], torch.Tensor)}
    if isinstance(obj, (tuple, list)):
        return {i: id(v) for i, v in enumerate(obj) if isinstance(v, torch.Tensor)}
    return {}


def _meta_inputs(example_args: tuple, example_kwargs: dict) -> tuple[tuple, dict]:
    def meta(x):
        return x.to("meta") if isinstance(x, torch.Tensor) else x
    return tuple(meta(a) for a in example_args), {k: meta(v) for k, v in example_kwargs.items()}


def trace_model(model: nn.Module, example_args: tuple | None = None, example_kwargs: dict | None = None) -> ModelTrace:
    """Trace ``model`` on the meta device (see the module docstring); ``model`` itself is left unchanged.

    ``example_args``/``example_kwargs`` default to one batch of 2 x 8 token ids (``torch.long``), which fits
    language models; give your own for anything else (their values are never read, only shapes and dtypes).
    Raises :class:`TraceError` if the root ``forward`` fails on meta tensors.
    """
    if example_args is None and example_kwargs is None:
        example_args = (torch.zeros(2, 8, dtype=torch.long),)
    args, kwargs = _meta_inputs(tuple(example_args or ()), dict(example_kwargs or {}))

    aliases: dict[str, list[str]] = {}
    canonical: dict[int, str] = {}
    for fqn, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(canonical.setdefault(id(p), fqn), []).append(fqn)
    shapes = {fqn: tuple(p.shape) for fqn, p in model.named_parameters()}
    trace = ModelTrace(aliases=aliases, shapes=shapes)

    swap: dict[str, torch.Tensor] = {}
    param_of: dict[int, tuple[str, int, bool]] = {}
    for fqn, p in model.named_parameters():
        t = torch.empty(p.shape, dtype=p.dtype, device="meta", requires_grad=p.requires_grad)
        swap[fqn] = t
        param_of[id(t)] = (fqn, 0, False)
    for fqn, b in model.named_buffers():
        swap[fqn] = torch.empty(b.shape, dtype=b.dtype, device="meta")

    recorder = _Recorder(trace, param_of)
    for x in pytree.tree_flatten((args, kwargs))[0]:
        if isinstance(x, torch.Tensor):
            recorder.note(x, frozenset())
    trace.root_args = {**{i: id(a) for i, a in enumerate(args) if isinstance(a, torch.Tensor)},
                       **{k: id(v) for k, v in kwargs.items() if isinstance(v, torch.Tensor)}}

    with contextlib.ExitStack() as stack:
        for fqn, mod in model.named_modules():
            if fqn:
                stack.enter_context(_opaque_guard(mod, fqn, trace, recorder))
        try:
            with torch.no_grad(), recorder:
                out = torch.func.functional_call(model, swap, args, kwargs)
        except Exception as exc:  # noqa: BLE001 - any failure means "cannot trace"; the caller falls back
            raise TraceError(f"{type(model).__name__}.forward does not run on the meta device: "
                             f"{type(exc).__name__}: {exc}") from exc
    trace.root_outputs = _ids(out)
    return trace


@contextlib.contextmanager
def _opaque_guard(mod: nn.Module, fqn: str, trace: ModelTrace, recorder: _Recorder):
    """Record ``mod``'s calls; if its forward fails on meta, mark it opaque and return a stand-in output."""
    original = mod.forward
    own = mod.__dict__.get("forward")  # an instance attribute of the user's, to put back afterwards

    def forward(*args, **kwargs):
        trace.stack.append(fqn)
        try:
            out = original(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001
            first = next((a for a in pytree.tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)), None)
            if first is None or not first.is_floating_point():
                raise
            trace.opaque.setdefault(fqn, f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}")
            out = torch.empty_like(first)
            recorder.note(out, frozenset([fqn]))
        finally:
            trace.stack.pop()
        call_args = {i: id(a) for i, a in enumerate(args) if isinstance(a, torch.Tensor)}
        call_args.update({k: id(v) for k, v in kwargs.items() if isinstance(v, torch.Tensor)})
        floats = frozenset([i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.is_floating_point()]
                           + [k for k, v in kwargs.items() if isinstance(v, torch.Tensor) and v.is_floating_point()])
        trace.calls.append(ModuleCall(fqn, call_args, _ids(out), floats))
        return out

    mod.forward = forward
    try:
        yield
    finally:
        mod.__dict__.pop("forward", None)
        if own is not None:
            mod.__dict__["forward"] = own


def _tree_trace(model: nn.Module, why: str, example_args: tuple | None, example_kwargs: dict | None) -> ModelTrace:
    """A stand-in trace built from the module tree when ``forward`` cannot run on meta.

    Within each module, its ``nn.Linear`` children in registration order form a group: the last child whose output
    size is the hidden size ``H`` is row-parallel and the children before it that read ``H`` are column-parallel
    (attention q/k/v -> o, MLP gate/up -> down). ``nn.Embedding`` children are token embeddings; a Linear producing
    the embedding's vocabulary is the head. ``H`` is the embedding width (else the most common weight dim). Layout
    boundaries sit on those modules themselves (each column Linear gathers its own input: more collectives than a
    traced plan); the root's output structure is unknown, so the root returns full tensors.
    """
    aliases: dict[str, list[str]] = {}
    canonical: dict[int, str] = {}
    for fqn, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(canonical.setdefault(id(p), fqn), []).append(fqn)
    trace = ModelTrace(aliases=aliases, shapes={f: tuple(p.shape) for f, p in model.named_parameters()})
    trace.opaque[""] = why
    ids = iter(range(-1, -10**9, -1))  # fake tensor ids, disjoint from real ones
    fake = {}
    for key in [*range(len(example_args or ((),))), *(example_kwargs or {})]:
        fake[key] = next(ids)
        trace.shape_of[fake[key]] = (2, 8)
    trace.root_args = fake
    embeds = [(f, m) for f, m in model.named_modules() if isinstance(m, nn.Embedding)]
    dims: dict[int, int] = {}
    for shape in trace.shapes.values():
        for d in shape[-2:] if len(shape) >= 2 else ():
            dims[d] = dims.get(d, 0) + 1
    hidden = embeds[0][1].embedding_dim if embeds else max(dims, key=dims.get, default=0)
    vocab = embeds[0][1].num_embeddings if embeds else None

    def name(mod: nn.Module, fqn: str) -> str:
        return canonical[id(mod.weight)] if id(mod.weight) in canonical else f"{fqn}.weight"

    def bias(mod: nn.Module) -> str | None:
        return canonical.get(id(mod.bias)) if getattr(mod, "bias", None) is not None else None

    def note(fqn: str, kind: str, param: str, in_dim, out_dim, b, producers, size: int, x: int | None = None) -> int:
        """A synthetic matmul event plus the call of the module that does it (its argument 0 in, output 0 out)."""
        x, out = (next(ids) if x is None else x), next(ids)
        trace.events.append(MatmulEvent(kind, param, in_dim, out_dim, b, x, out, producers, (2, 8, size)))
        trace.calls.append(ModuleCall(fqn, {0: x}, {0: out}, frozenset([0]) if kind == "linear" else frozenset()))
        trace.shape_of[out] = (2, 8, size)
        trace.taint[out] = frozenset([param if kind == "linear" else f"{param}@embedding"])
        return out

    for fqn, mod in embeds:
        note(fqn, "embedding", name(mod, fqn), None, 0, None, frozenset(), hidden, fake.get(0))
        if type(mod).forward is not nn.Embedding.forward:
            trace.transformed_lookups[name(mod, fqn)] = (f"{type(mod).__name__} overrides nn.Embedding.forward and "
                                                         "may transform the lookup before returning it")
    for parent_fqn, parent in model.named_modules():
        kids = [(f"{parent_fqn}.{n}" if parent_fqn else n, m) for n, m in parent.named_children()
                if isinstance(m, nn.Linear)]
        rows = [i for i, (_, m) in enumerate(kids) if m.out_features == hidden and m.in_features != 0]
        if not rows:
            for f, m in kids:
                if vocab is not None and m.out_features == vocab:
                    trace.root_outputs = {"logits": note(f, "linear", name(m, f), 1, 0, bias(m), frozenset(), vocab)}
            continue
        r = rows[-1]
        cols = [(f, m) for f, m in kids[:r] if m.in_features == hidden]
        if not cols:
            continue
        for f, m in cols:
            note(f, "linear", name(m, f), 1, 0, bias(m), frozenset(), m.out_features)
        f, m = kids[r]
        note(f, "linear", name(m, f), 1, 0, bias(m), frozenset(name(c, cf) for cf, c in cols), hidden)
        convs = {f"{parent_fqn}.{n}" if parent_fqn else n: type(m).__name__ for n, m in parent.named_modules()
                 if isinstance(m, (nn.Conv1d, nn.Conv2d, nn.Conv3d))}
        if convs:
            # a convolution inside (Inkling's short convolutions over q/k/v) may read a projection's output along
            # its features and the sequence: record it as a sequence mixer and the group as taking the stream, so
            # the planner keeps the group replicated (see Planner.sequence_mixers)
            trace.seq_mixing.update(convs)
            stream = next(ids)
            trace.shape_of[stream] = (2, 8, hidden)
            trace.calls.append(ModuleCall(parent_fqn, {0: stream}, {}, frozenset([0])))
    return trace
