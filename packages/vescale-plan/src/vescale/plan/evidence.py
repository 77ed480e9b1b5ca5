"""Layout evidence: how a projection's output features are used, read from the ops that follow the matmul.

A column-parallel projection with ``N`` output features is sharded by cutting that feature dim into ``tp`` pieces.
Which cut keeps the downstream code rank-local depends on how the features are used: Llama's ``q_proj`` is viewed as
``[heads, head_dim]`` (cut between heads: ``Shard``), GPT-2's fused ``c_attn`` is split into ``[q | k | v]`` first
(cut each third: ``InterleavedShard(3)``), GPT-NeoX's ``query_key_value`` is viewed per head as ``[heads, 3, d]`` and
chunked inside each head (cut between heads again: plain ``Shard``). :class:`FeatureTracker` follows the output of
every parameter matmul through the ops the trace sees and describes each feature dim of each derived tensor as a
*factor* of the original feature index: ``(stride, size)``, so ``[heads, 3, d]`` is ``(3d, heads), (d, 3), (1, d)``.

What it records per parameter (:class:`LayoutEvidence`):

* ``splits``: equal splits of a factor into ``k`` parts (``chunk``/``split``/``unbind``): the parts have different
  roles (q, k, v; gate, up), so a cut may run inside each part or outside the whole factor, never across it;
* ``mixes``: ops that combine or select features along a factor (indexing, ``narrow``, slices, a contraction in a
  matmul such as ``q @ k.T``, softmax, norms, reductions, ``roll``/``flip``/``sort``, gathers): the whole factor must
  stay on one rank, so the cut must lie outside it;
* ``factors``: every factor a view produced (head counts, kv groups): the cut must not split one of those units;
* ``lost``: the first op after which the chain could no longer be followed (views that merge features with batch
  dims, unknown ops); the evidence before it still counts.

:func:`decide` turns that into a placement kind: ``"shard"`` (the cut lies outside every constraint: whole heads or
groups per rank), ``"interleaved"`` (the outermost constraint is an equal split into ``k`` parts: cut inside each part)
or ``"unsettled"`` (a constraint covers all ``N`` features with no equal parts, e.g. multi-query ``[heads + 2, d]``
or a fixed permutation of the whole output): the planner keeps those replicated and says why. Evidence is only a
reading of the code; :mod:`vescale.plan.verify` checks the resulting plan numerically.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["FeatureTracker", "LayoutEvidence", "LayoutDecision", "decide"]

Factor = tuple[int, int]  # (stride, size) in the original feature index


@dataclass
class LayoutEvidence:
    """What the trace saw of one parameter's ``size`` output features (see the module docstring)."""

    size: int
    splits: list[tuple[int, int, str]] = field(default_factory=list)  # (end = stride * size of the factor, k, op)
    mixes: list[tuple[int, str]] = field(default_factory=list)  # (end of the outermost mixed factor, op)
    factors: set[Factor] = field(default_factory=set)
    lost: str | None = None


@dataclass(frozen=True)
class LayoutDecision:
    """``kind`` is ``"shard"``, ``"interleaved"`` or ``"unsettled"``; ``parts`` the interleaved size (1 for shard);
    ``units`` how many indivisible units (heads, groups, features) the cut runs between, or within each part for
    ``"interleaved"``; ``layout`` the layout in words; ``why`` the reason for ``"unsettled"``."""

    kind: str
    parts: int = 1
    units: int = 0
    layout: str = ""
    why: str = ""


@dataclass
class _State:
    param: str
    piece: bool  # True after a split/selection: only views are followed (for head counts)
    dims: dict[int, Factor]  # tensor dim -> factor; dims not listed carry no features (batch, sequence)


_VIEWS = {"view", "reshape", "flatten", "unflatten", "view_as", "reshape_as", "expand", "expand_as", "squeeze",
          "unsqueeze", "_reshape_alias"}
_PERMUTES = {"transpose", "permute", "swapaxes", "swapdims", "t", "movedim", "moveaxis"}
_POINTWISE = {
    "add", "sub", "mul", "div", "true_divide", "neg", "pow", "exp", "log", "sqrt", "rsqrt", "abs", "clamp", "clip",
    "tanh", "sigmoid", "silu", "gelu", "relu", "relu6", "leaky_relu", "elu", "selu", "celu", "mish", "softplus",
    "hardswish", "hardsigmoid", "hardtanh", "sin", "cos", "erf", "square", "dropout", "float", "half", "bfloat16",
    "double", "to", "type", "type_as", "contiguous", "clone", "detach", "where", "masked_fill", "maximum", "minimum",
    "radd", "rsub", "rmul", "rdiv", "rtruediv", "truediv", "iadd", "isub", "imul", "idiv", "itruediv", "addcmul",
    "lerp", "sign", "reciprocal", "_conj", "requires_grad_", "add_", "mul_", "sub_", "div_", "copy_",
}
_SPLITS = {"split", "chunk", "tensor_split", "unbind", "split_with_sizes"}
_MIX_DIM = {"softmax", "log_softmax", "_softmax", "cumsum", "cumprod", "sort", "argsort", "topk", "sum", "mean",
            "amax", "amin", "max", "min", "prod", "norm", "var", "std", "logsumexp", "normalize", "index_select",
            "gather", "take_along_dim", "narrow", "select", "roll", "flip", "fliplr", "flipud", "cummax", "cummin",
            "argmax", "argmin"}
_MATMULS = {"matmul", "mm", "bmm", "__matmul__", "__rmatmul__", "baddbmm", "einsum"}


def _name(func: Any) -> str:
    name = getattr(func, "__name__", "") or ""
    return name[2:-2] if name.startswith("__") and name.endswith("__") and name not in ("__matmul__",
                                                                                        "__rmatmul__") else name


def _end(f: Factor) -> int:
    return f[0] * f[1]


class FeatureTracker:
    """Follows the output features of parameter matmuls through the ops a :class:`TorchFunctionMode` sees.

    The recorder calls :meth:`start` for each linear matmul output and :meth:`step` for every other op; the result is
    :attr:`evidence` (parameter FQN -> :class:`LayoutEvidence`). Tensors are keyed by ``id``; the caller keeps them
    alive for the whole trace.
    """

    def __init__(self) -> None:
        self.states: dict[int, _State] = {}
        self.evidence: dict[str, LayoutEvidence] = {}

    def start(self, param: str, out: torch.Tensor) -> None:
        if out.ndim == 0:
            return
        n = int(out.shape[-1])
        self.evidence.setdefault(param, LayoutEvidence(n))
        self.states[id(out)] = _State(param, False, {out.ndim - 1: (1, n)})

    # -- dispatch --------------------------------------------------------------------------------------------------

    def step(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        name = _name(func)
        tracked = [(i, a) for i, a in enumerate(args) if isinstance(a, torch.Tensor) and id(a) in self.states]
        tracked += [(k, v) for k, v in kwargs.items() if isinstance(v, torch.Tensor) and id(v) in self.states]
        if not tracked:
            return
        outs = [o for o in (out if isinstance(out, (tuple, list)) else [out]) if isinstance(o, torch.Tensor)]
        if not outs:  # size(), dim(), dtype, ...: nothing to follow
            return
        for pos, x in tracked:
            st = self.states[id(x)]
            ev = self.evidence[st.param]
            try:
                self._step_one(name, func, pos, x, st, ev, args, kwargs, outs)
            except Exception as exc:  # noqa: BLE001 - reading evidence must never break the trace
                self._lose(ev, st, f"{name} ({type(exc).__name__})")

    def _lose(self, ev: LayoutEvidence, st: _State, op: str) -> None:
        if not st.piece and ev.lost is None:
            ev.lost = op

    def _mix(self, ev: LayoutEvidence, st: _State, dims, op: str, x: torch.Tensor) -> None:
        ends = [_end(st.dims[d % x.ndim]) for d in dims if d % x.ndim in st.dims]
        if ends and not st.piece:
            ev.mixes.append((max(ends), op))

    def _step_one(self, name, func, pos, x, st, ev, args, kwargs, outs) -> None:
        if name in _VIEWS and len(outs) == 1 and pos == 0:
            return self._view(st, ev, x, outs[0], name)
        if name in _PERMUTES and len(outs) == 1 and pos == 0:
            return self._permute(st, ev, x, outs[0], args, kwargs, name)
        if name in _POINTWISE and len(outs) == 1:
            if tuple(outs[0].shape) == tuple(x.shape):
                self.states[id(outs[0])] = st
            else:
                self._lose(ev, st, name)
            return
        if name in ("getitem",) and pos == 0:
            return self._getitem(st, ev, x, args[1], outs, name)
        if name in _SPLITS and pos == 0:
            return self._split(st, ev, x, args, kwargs, outs, name)
        if name in _MATMULS:
            if name == "einsum" or x.ndim < 2:
                return self._lose(ev, st, name)
            first = pos == 0 or (name == "baddbmm" and pos == 1)
            return self._mix(ev, st, [-1 if first else -2], f"{name} (contraction)", x)
        if name == "scaled_dot_product_attention":
            if pos in (0, 1, "query", "key"):
                self._mix(ev, st, [-1], f"{name} (contraction)", x)
            return
        if name in ("layer_norm", "rms_norm", "group_norm"):
            shape = args[1] if len(args) > 1 else kwargs.get("normalized_shape", ())
            k = len(shape) if isinstance(shape, (tuple, list, torch.Size)) else 1
            return self._mix(ev, st, list(range(-k, 0)), name, x)
        if name in _MIX_DIM and pos == 0:
            dims = self._dims_arg(name, args, kwargs, x)
            self._mix(ev, st, dims, name, x)
            if name in ("narrow", "select", "index_select") and len(outs) == 1:
                self._piece(st, ev, x, outs[0], dims)
            return
        self._lose(ev, st, name)

    @staticmethod
    def _dims_arg(name, args, kwargs, x) -> list[int]:
        if name == "roll":
            d = kwargs.get("dims", args[2] if len(args) > 2 else None)
        elif name == "normalize":
            d = kwargs.get("dim", args[2] if len(args) > 2 else 1)
        else:
            d = kwargs.get("dim", args[1] if len(args) > 1 and not isinstance(args[1], torch.Tensor) else None)
            if name in ("flip",) and d is None:
                d = args[1] if len(args) > 1 else None
        if d is None:
            return list(range(x.ndim))
        return [int(v) for v in (d if isinstance(d, (tuple, list)) else [d])]

    # -- shape ops -------------------------------------------------------------------------------------------------

    def _set(self, st: _State, ev: LayoutEvidence, out: torch.Tensor, dims: dict[int, Factor]) -> None:
        for f in dims.values():
            ev.factors.add(f)
        self.states[id(out)] = _State(st.param, st.piece, dims)

    def _view(self, st, ev, x, out, name) -> None:
        old, new = [int(s) for s in x.shape], [int(s) for s in out.shape]
        if name in ("expand", "expand_as") and len(old) == len(new):
            return self._set(st, ev, out, {d: f for d, f in st.dims.items() if old[d] == new[d]})
        groups, i, j = [], 0, 0
        while i < len(old) and j < len(new):
            oi, nj, po, pn = [i], [j], old[i], new[j]
            i, j = i + 1, j + 1
            while po != pn:
                if po < pn and i < len(old):
                    oi.append(i)
                    po, i = po * old[i], i + 1
                elif j < len(new):
                    nj.append(j)
                    pn, j = pn * new[j], j + 1
                else:
                    return self._lose(ev, st, name)
            groups.append((oi, nj))
        dims: dict[int, Factor] = {}
        for oi, nj in groups:
            feats = [d for d in oi if d in st.dims and old[d] > 1]
            if not feats:
                continue
            if any(d not in st.dims and old[d] > 1 for d in oi):
                return self._lose(ev, st, f"{name} (merges features with other dims)")
            for a, b in zip(feats, feats[1:]):
                if st.dims[a][0] != _end(st.dims[b]):
                    return self._lose(ev, st, f"{name} (merges non-adjacent features)")
            stride = st.dims[feats[-1]][0]
            for d in reversed(nj):
                if new[d] > 1:
                    dims[d] = (stride, new[d])
                    stride *= new[d]
                else:  # a unit axis of size 1 (one head): no dim to follow, but a unit count for decide()
                    ev.factors.add((stride, 1))
        self._set(st, ev, out, dims)

    def _permute(self, st, ev, x, out, args, kwargs, name) -> None:
        n = x.ndim
        order = list(range(n))
        if name == "t" or (name in ("transpose", "swapaxes", "swapdims") and n < 2):
            order = order[::-1] if n == 2 else order
        elif name in ("transpose", "swapaxes", "swapdims"):
            a, b = (int(v) % n for v in args[1:3])
            order[a], order[b] = order[b], order[a]
        elif name == "permute":
            p = args[1:] if len(args) > 2 or not isinstance(args[1], (tuple, list)) else args[1]
            order = [int(v) % n for v in p]
        else:  # movedim(src, dst)
            src = [int(v) % n for v in (args[1] if isinstance(args[1], (tuple, list)) else [args[1]])]
            dst = [int(v) % n for v in (args[2] if isinstance(args[2], (tuple, list)) else [args[2]])]
            rest = iter([d for d in order if d not in src])
            where = dict(zip(dst, src))
            order = [where[k] if k in where else next(rest) for k in range(n)]
        self._set(st, ev, out, {k: st.dims[d] for k, d in enumerate(order) if d in st.dims})

    def _piece(self, st, ev, x, out, removed: list[int]) -> None:
        """``out`` is a part of ``x`` after a selection along ``removed`` dims: follow it (views only) if the other
        dims keep their positions."""
        removed = {d % x.ndim for d in removed}
        if out.ndim == x.ndim:
            self.states[id(out)] = _State(st.param, True, {d: f for d, f in st.dims.items() if d not in removed})
        elif out.ndim == x.ndim - len(removed):
            keep = [d for d in range(x.ndim) if d not in removed]
            self.states[id(out)] = _State(st.param, True, {k: st.dims[d] for k, d in enumerate(keep)
                                                           if d in st.dims})

    def _split(self, st, ev, x, args, kwargs, outs, name) -> None:
        default = 0
        d = kwargs.get("dim", args[2] if len(args) > 2 else default) if name != "unbind" else \
            kwargs.get("dim", args[1] if len(args) > 1 else 0)
        d = int(d) % x.ndim
        if d not in st.dims:  # a split of batch/sequence: every piece keeps the feature layout
            for o in outs:
                self.states[id(o)] = st
            return
        f = st.dims[d]
        sizes = {int(o.shape[d]) for o in outs} if name != "unbind" else {1}
        if len(sizes) == 1 and len(outs) > 1 and not st.piece:
            k = len(outs)
            ev.splits.append((_end(f), k, name))
            for o in outs:
                piece = dict(st.dims)
                if name == "unbind":
                    piece = {(dd if dd < d else dd - 1): ff for dd, ff in st.dims.items() if dd != d}
                else:
                    piece[d] = (f[0], f[1] // k)
                self.states[id(o)] = _State(st.param, True, {dd: ff for dd, ff in piece.items() if ff[1] > 1})
        elif not st.piece:
            ev.mixes.append((_end(f), f"{name} (unequal parts)"))

    def _getitem(self, st, ev, x, index, outs, name) -> None:
        idx = index if isinstance(index, tuple) else (index,)
        if any(i is Ellipsis for i in idx):
            at = next(k for k, i in enumerate(idx) if i is Ellipsis)
            used = sum(1 for i in idx if i is not None and i is not Ellipsis)
            idx = idx[:at] + (slice(None),) * (x.ndim - used) + idx[at + 1:]
        dims: dict[int, Factor] = {}
        selected, src, dst, advanced = [], 0, 0, False
        for i in idx:
            if i is None:
                dst += 1
                continue
            size = int(x.shape[src])
            if isinstance(i, int):
                if src in st.dims:
                    selected.append(src)
            elif isinstance(i, slice):
                full = i.step in (None, 1) and (i.start or 0) in (0, -size) and (i.stop is None or i.stop >= size)
                if src in st.dims:
                    if full:
                        dims[dst] = st.dims[src]
                    else:
                        selected.append(src)
                dst += 1
            else:  # tensor / list / bool index: advanced indexing (output dims may move: not followed)
                if src not in st.dims:
                    return self._lose(ev, st, "advanced index")
                selected.append(src)
                advanced = True
                dst += 1
            src += 1
        for k in range(src, x.ndim):
            if k in st.dims:
                dims[dst] = st.dims[k]
            dst += 1
        if selected:
            what = "index" + (" with a tensor/list (gather)" if advanced else "")
            self._mix(ev, st, selected, what, x)
            if not advanced and len(outs) == 1:
                self.states[id(outs[0])] = _State(st.param, True, dims)
            return
        if len(outs) == 1:
            self._set(st, ev, outs[0], dims)


def decide(ev: LayoutEvidence | None, size: int) -> LayoutDecision:
    """The cut of ``size`` output features that the evidence allows (see the module docstring).

    The outermost constraint wins: with ``end = stride * size`` of the outermost split or mixed factor, ``outer =
    size // end`` whole units lie outside it. ``outer > 1``: plain ``Shard`` between those units (NeoX/Bloom
    ``[heads, 3, d]``, Falcon ``[kv, q_per_kv + 2, d]``, a Llama ``q_proj`` viewed ``[heads, d]``); ``outer == 1`` and
    that constraint is an equal split into ``k`` parts everywhere it appears: ``InterleavedShard(k)`` (GPT-2
    ``[3, heads, d]``, fused gate/up ``[2, inter]``); otherwise unsettled.
    """
    if ev is None or ev.size != size:
        return LayoutDecision("shard", 1, size, f"[{size}] (no views or splits seen)")
    ends = [e for e, _, _ in ev.splits] + [e for e, _ in ev.mixes]
    top = max(ends, default=0)
    if not ends or top < size:
        bound = top or 1
        outer = size // bound if size % bound == 0 else 1
        units = min([f[1] for f in ev.factors if _end(f) == size and f[0] >= bound and f[0] > 1] + [outer])
        if not ends:
            return LayoutDecision("shard", 1, units, f"[{units}, {size // units}]" if units < size else f"[{size}]")
        inner = [(op, e) for e, _, op in ev.splits] + [(op, e) for e, op in ev.mixes]
        op = next(op for op, e in inner if e == top)
        return LayoutDecision("shard", 1, units, f"[{units} units, {size // units}] (units of {top} features kept "
                              f"whole: {op})")
    if (size, 1) in ev.factors:  # viewed as [1, ...] (a single head / group): one indivisible unit
        return LayoutDecision("shard", 1, 1, f"[1 unit, {size}]")
    outer_splits = {(k, op) for e, k, op in ev.splits if e == top}
    outer_mixes = [op for e, op in ev.mixes if e == top]
    ks = {k for k, _ in outer_splits}
    if outer_mixes or len(ks) != 1:
        why = (f"all {size} outputs are selected or combined as one unit ({outer_mixes[0]}) before any equal split "
               "into parts" if outer_mixes else f"split into different numbers of parts {sorted(ks)}")
        return LayoutDecision("unsettled", why=why)
    (k,) = ks
    part = size // k
    units = min([f[1] for f in ev.factors if _end(f) == part and f[0] > 1] + [part])
    inner = f"{units} units each, {part // units}" if units < part else f"{part}"
    return LayoutDecision("interleaved", k, units, f"[{k} parts, {inner}]")

