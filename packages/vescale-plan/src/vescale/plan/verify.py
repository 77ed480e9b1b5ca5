"""Numerical check of a plan's column/row pairs on a simulated tensor-parallel mesh, in one process.

A column/row pair is correct when each rank, holding only its shards of the column weights (and biases) and of the
row weight, computes a partial row output, and the partial outputs of all ranks add up to the plain result (the one
all-reduce / reduce-scatter that Megatron-style TP issues). :func:`verify_pairs` checks exactly that for one
representative of every distinct pair type (same owner-module class, relative parameter names, shapes and
placements: a 32-layer model has two, attention and MLP), by running the model forward ``1 + tp`` times:

* once plainly, recording each representative row matmul's output;
* once per simulated rank ``r``, with every column weight/bias multiplied by the mask of the output features rank
  ``r`` owns under its placement, the row weight by the mask of the input features it owns, and the row bias kept on
  rank 0 only. Which indices a rank owns comes from :func:`vescale.dtensor.layout.local_dim_indices` - the same index
  math ``distribute_tensor`` uses. The row output is recorded and then replaced by the plain run's, so everything
  after it (and the next pair) sees exact inputs and one run checks every pair.

Masked features are zero: a head whose q, k and v are all zero contributes nothing, and whatever a rank computes
from features it does not own meets a zeroed row column. So ``sum_r row_r == row`` holds (up to rounding) exactly
when every feature a rank's row shard reads depends only on features that rank owns - when the plan's cut is
rank-local. A wrong cut (``InterleavedShard(0, 3)`` on GPT-NeoX's ``[heads, 3, d]`` output mixes q, k and v of
different heads on one rank) gives an O(1) relative difference; a right one agrees to ~1e-7 in fp32.

The weights used are random (seeded), never the model's own values (zero-initialised biases would hide a wrong bias
layout): the model's own parameters are swapped with ``torch.func.functional_call``, so nothing is modified. Where
the model's parameters are real, the run uses the model itself with random values for the checked blocks; on the meta
device (or above ``max_numel`` elements), a Hugging Face-style model (``type(model)(config)``) is rebuilt on CPU as a
shrunken copy from its config (head dim 8, small MLP and vocabulary, only the layers needed) and the plan's
placements for the same FQNs are checked on it; a small meta model without meta buffers gets random weights for every
parameter. Anything else is reported as unverified. The forward stops right after the last representative row.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.placement_types import Placement
from torch.overrides import TorchFunctionMode

from vescale.dtensor.layout import local_dim_indices
from vescale.plan.trace import ModelTrace

__all__ = ["PairCheck", "verify_pairs"]


@dataclass
class PairCheck:
    """The verdict on one pair type. ``row``/``cols``: the representative's parameter FQNs; ``members``: the row FQN
    of every pair of that type (the verdict applies to all); ``status``: ``"verified"``, ``"refused"`` (sharded result
    differs) or ``"unverified"`` (could not be run: ``reason`` says why); ``rel_diff``: max |sum of rank outputs -
    plain| / max |plain| over the row's calls; ``how``: what was run."""

    row: str
    cols: list[str]
    members: list[str] = field(default_factory=list)
    status: str = "unverified"
    rel_diff: float = float("nan")
    how: str = ""
    reason: str = ""


class _Done(BaseException):
    """Raised from inside the forward once every representative row has run: the rest of the model is skipped
    (a ``BaseException``, so that a model's own ``except Exception`` does not swallow it)."""


class _MeshSize:
    """The one thing ``local_dim_indices`` needs from a mesh when a coordinate is given: its size."""

    def __init__(self, n: int) -> None:
        self.n = n

    def size(self, mesh_dim: int = 0) -> int:
        return self.n


def owned_mask(shape: tuple[int, ...], placement: Placement, n: int, rank: int) -> torch.Tensor:
    """1.0 where rank ``rank`` of a size-``n`` mesh dim holds an element of a tensor of ``shape`` under
    ``placement`` (``Shard`` / ``InterleavedShard`` / ``Replicate``), else 0.0; float32, broadcastable to ``shape``."""
    mask = torch.ones(())
    for d, ix in enumerate(local_dim_indices(shape, _MeshSize(n), [placement], coordinate=[rank])):
        if len(ix) != shape[d]:
            m = torch.zeros(shape[d])
            m[ix] = 1.0
            mask = mask * m.view([shape[d] if k == d else 1 for k in range(len(shape))])
    return mask


_LINEAR = {F.linear}
_ADDMM = {torch.addmm, torch.Tensor.addmm}
_MATMUL = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.mm, torch.Tensor.mm, torch.bmm,
           torch.Tensor.bmm}


class _RowProbe(TorchFunctionMode):
    """Records the outputs of matmuls whose weight is one of ``watch`` (id -> row FQN; transposes of a watched
    weight - Falcon's ``x @ w.T`` - are watched too). In a rank run (``plain`` given) it returns the plain run's
    output in their place, and a rank other than the first (``bias=False``) leaves out a bias passed to the matmul
    itself (it is added once, after the reduction). Raises :class:`_Done` once every watched row has run."""

    def __init__(self, watch: dict[int, str], plain: dict[str, list[torch.Tensor]] | None, bias: bool = True) -> None:
        super().__init__()
        self.watch, self.plain, self.bias = dict(watch), plain, bias
        self.seen: dict[str, list[torch.Tensor]] = {}
        self.alive: list[torch.Tensor] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        src = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if src is not None and id(src) in self.watch and isinstance(out, torch.Tensor) and _is_transpose(func, args):
            self.watch[id(out)] = self.watch[id(src)]
            self.alive.append(out)
            return out
        w, x, bias = None, None, None
        if func in _LINEAR and len(args) >= 2:
            w, x, bias = args[1], args[0], args[2] if len(args) > 2 else kwargs.get("bias")
        elif func in _ADDMM and len(args) >= 3:
            w, x, bias = args[2], args[1], args[0]
        elif func in _MATMUL and len(args) >= 2:
            w, x = args[1], args[0]
        row = self.watch.get(id(w)) if isinstance(w, torch.Tensor) else None
        if row is None:
            return out
        mine = out if self.bias or bias is None else (F.linear(x, w) if func in _LINEAR else torch.mm(x, w))
        calls = self.seen.setdefault(row, [])
        calls.append(mine.detach().clone())
        if self.plain is not None:
            k = len(calls) - 1
            out = self.plain[row][k] if k < len(self.plain.get(row, [])) else out
        if len(self.seen) == len(set(self.watch.values())):
            raise _Done
        return out


def _is_transpose(func, args) -> bool:
    if func in (torch.Tensor.t, torch.t) or func == torch.Tensor.T.__get__ or func == torch.Tensor.mT.__get__:
        return True
    if func in (torch.Tensor.transpose, torch.transpose) and len(args) >= 3:
        n = args[0].ndim
        return sorted(int(a) % n for a in args[1:3]) == [n - 2, n - 1]
    return False


def _rand_like(shape: tuple[int, ...], gen: torch.Generator, dtype, device) -> torch.Tensor:
    if len(shape) >= 2:
        t = torch.randn(shape, generator=gen) / math.sqrt(max(shape[-1], 1))
    else:
        t = 1.0 + 0.2 * torch.randn(shape, generator=gen)
    return t.to(dtype=dtype if dtype.is_floating_point else torch.float32, device=device)


def _owner(fqns: list[str]) -> str:
    parts = [f.split(".")[:-1] for f in fqns]
    common = []
    for xs in zip(*parts):
        if len(set(xs)) != 1:
            break
        common.append(xs[0])
    return ".".join(common)


def _layer_indices(fqn: str) -> list[int]:
    return [int(p) for p in fqn.split(".") if p.isdigit()]


def _shrunk_copy(model: nn.Module, tp: int, needed: list[str]) -> nn.Module:
    """A Hugging Face-style model rebuilt from a shrunken copy of ``model.config`` on CPU: the same head counts
    (they decide the layout), head dim 8, hidden = heads x 8, an MLP of ``16 * tp`` per fused part, a small
    vocabulary and only the layers up to the deepest one in ``needed``. Raises if the model cannot be rebuilt."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        raise TypeError("no config to rebuild it from")
    cfg = copy.deepcopy(config)
    heads = getattr(cfg, "num_attention_heads", None)
    if not heads:
        raise TypeError("config has no num_attention_heads")
    hd = 8
    cfg.hidden_size = heads * hd
    if getattr(cfg, "head_dim", None) is not None:
        cfg.head_dim = hd
    for name in ("intermediate_size", "ffn_hidden_size", "n_inner", "ffn_dim", "moe_intermediate_size"):
        if getattr(cfg, name, None) is not None:
            setattr(cfg, name, 16 * tp)
    vocab = 64 * tp
    if getattr(cfg, "vocab_size", None) is not None:
        cfg.vocab_size = vocab
        for tok in ("pad_token_id", "bos_token_id", "eos_token_id"):
            ids = getattr(cfg, tok, None)
            if isinstance(ids, int) and ids >= vocab or isinstance(ids, list):
                setattr(cfg, tok, None if tok == "pad_token_id" else 0)
    layers = max((max(_layer_indices(f), default=0) for f in needed), default=0) + 1
    n_layers = getattr(cfg, "num_hidden_layers", None)
    if isinstance(n_layers, int) and layers < n_layers:
        for key, value in list(vars(cfg).items()):
            if isinstance(value, list) and len(value) == n_layers:
                setattr(cfg, key, value[:layers])
        cfg.num_hidden_layers = layers
    with torch.random.fork_rng(devices=[]), torch.device("cpu"):  # its init must not move the caller's RNG
        tiny = type(model)(cfg)
    return tiny.float()


def _inputs(trace: ModelTrace, model: nn.Module, example_args, example_kwargs, device, gen) -> tuple[tuple, dict]:
    """Real inputs shaped like the traced ones. Token ids (inputs that index an embedding) are always drawn at random
    below the runnable model's smallest vocabulary: repeated ids (the default zeros) make every key alike, attention
    uniform, and a wrong q/k cut invisible. Other meta tensors become ones (int/bool: masks) or random (float)."""
    if example_args is None and example_kwargs is None:
        example_args = (torch.zeros(2, 8, dtype=torch.long),)
    shapes = dict(model.named_parameters())
    embeds = [e for e in trace.events if e.kind == "embedding" and e.param in shapes]
    vocab = min([shapes[e.param].shape[0] for e in embeds] or [2])
    feeds = set()
    for e in embeds:
        tid = e.input_id
        while tid is not None:
            feeds.add(tid)
            tid = trace.view_parent.get(tid)
    token_keys = {k for k, i in trace.root_args.items() if i in feeds}

    def real(key, x):
        if not isinstance(x, torch.Tensor):
            return x
        if key in token_keys and not x.is_floating_point():
            return torch.randint(0, vocab, tuple(x.shape), generator=gen).to(device)
        if x.is_meta:
            return (torch.randn(tuple(x.shape), generator=gen).to(x.dtype) if x.is_floating_point()
                    else torch.ones(tuple(x.shape), dtype=x.dtype)).to(device)
        return x.to(device)
    args = tuple(real(i, a) for i, a in enumerate(example_args or ()))
    return args, {k: real(k, v) for k, v in (example_kwargs or {}).items()}


def verify_pairs(model: nn.Module, trace: ModelTrace, pairs: list[tuple[str, list[str]]],
                 placements: dict[str, Placement], tp_size: int, *, example_args: tuple | None = None,
                 example_kwargs: dict | None = None, max_numel: int = 16_000_000, seed: int = 0) -> list[PairCheck]:
    """Check every sharded column/row pair of a plan on a simulated mesh of ``tp_size`` ranks (module docstring).

    ``pairs``: ``(row, cols)`` parameter FQNs as the planner paired them; ``placements``: the tp-dim placement of
    each planned parameter (missing = replicated). Pairs whose row is replicated are skipped. Returns one
    :class:`PairCheck` per pair type. Pure: ``model`` is neither modified nor moved; no process group is used.
    """
    first = {}
    for e in trace.events:
        first.setdefault(e.param, e)
    checks: dict[tuple, PairCheck] = {}
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    for row, cols in pairs:
        if isinstance(placements.get(row, Replicate()), Replicate):
            continue
        members = [*cols, row] + [first[p].bias for p in [*cols, row] if first[p].bias]
        owner = _owner(members)
        key = (type(modules.get(owner)).__qualname__,
               tuple((m[len(owner):], tuple(params[m].shape) if m in params else (), str(placements.get(m)))
                     for m in members))
        check = checks.setdefault(key, PairCheck(row, list(cols)))
        check.members.append(row)
    if not checks or tp_size <= 1:
        return list(checks.values())
    reps = list(checks.values())
    # The runs are tiny: intra-op threads only add synchronisation (on a loaded 2-core machine a [16, 256] matmul
    # took 8 ms with 2 threads and 0.15 ms with 1), so run them single-threaded and restore the setting after.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        results = _check(model, trace, reps, first, placements, tp_size, example_args, example_kwargs, max_numel,
                         seed)
    finally:
        torch.set_num_threads(threads)
    if results is None:
        return reps
    for c in reps:
        if c.row not in results:
            c.reason = f"the row matmul of {c.row} was not observed in the run"
            continue
        c.rel_diff, dtype = results[c.row]
        tol = 1e-4 if dtype in (torch.float32, torch.float64) else 3e-2
        c.status = "verified" if c.rel_diff <= tol else "refused"
        c.reason = (f"sum over {tp_size} simulated ranks equals the plain result (max rel. diff {c.rel_diff:.1e})"
                    if c.status == "verified" else
                    f"sharded result differs from the plain one on a simulated tp={tp_size} mesh (max rel. diff "
                    f"{c.rel_diff:.2g}): the cut is not rank-local")
    return reps


def _check(model, trace, reps, first, placements, tp_size, example_args, example_kwargs, max_numel, seed):
    """Build what to run and run it: ``{row: (rel. diff, dtype)}``, or None (the reasons are set on ``reps``)."""
    try:
        runnable, subst_base, how, device = _runnable(model, trace, reps, first, tp_size, max_numel, seed)
    except Exception as exc:  # noqa: BLE001 - anything that stops the check leaves the pairs unverified
        for c in reps:
            c.reason = f"could not build a model to run: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
        return None
    gen = torch.Generator().manual_seed(seed + 1)
    try:
        args, kwargs = _inputs(trace, runnable, example_args, example_kwargs, device, gen)
        results = _simulate(runnable, subst_base, reps, first, placements, tp_size, args, kwargs)
    except Exception as exc:  # noqa: BLE001
        for c in reps:
            c.reason = f"the simulated run failed: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
        return None
    for c in reps:
        c.how = how
    return results


def _runnable(model, trace, reps, first, tp, max_numel, seed):
    """``(module to run, {fqn: random tensor}, description, device)``: see the module docstring for the choice."""
    params = dict(model.named_parameters())
    owners = sorted({_owner([c.row, *c.cols]) for c in reps})
    gen = torch.Generator().manual_seed(seed)
    meta = any(p.is_meta for p in params.values()) or any(b.is_meta for b in model.buffers())
    checked = [f for f in params if any(f.startswith(o + ".") or not o for o in owners)]
    numel = sum(params[f].numel() for f in checked)
    if not meta and numel <= max_numel:
        device = next(iter(params.values())).device
        subst = {f: _rand_like(tuple(params[f].shape), gen, params[f].dtype, device) for f in checked}
        return model, subst, "the model itself, random weights in the checked blocks", device
    errors = []
    try:
        tiny = _shrunk_copy(model, tp, owners)
        tparams = dict(tiny.named_parameters())
        missing = [m for c in reps for m in [c.row, *c.cols] if m not in tparams]
        if missing:
            raise KeyError(f"shrunken copy lacks {missing[:3]}")
        subst = {f: _rand_like(tuple(p.shape), gen, torch.float32, "cpu") for f, p in tparams.items()
                 if any(f.startswith(o + ".") or not o for o in owners)}
        n_layers = getattr(tiny.config, "num_hidden_layers", "?")
        return tiny, subst, (f"a shrunken copy built from the config (hidden {getattr(tiny.config, 'hidden_size', '?')}"
                             f", {n_layers} layer(s), random weights)"), torch.device("cpu")
    except Exception as exc:  # noqa: BLE001
        errors.append(f"shrunken copy: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}")
    total = sum(p.numel() for p in params.values())
    if not any(b.is_meta for b in model.buffers()) and total <= max_numel:
        subst = {f: _rand_like(tuple(p.shape), gen, torch.float32, "cpu") for f, p in params.items()}
        return model, subst, "the model with random weights for every parameter", torch.device("cpu")
    raise RuntimeError("; ".join(errors + [f"{total} parameters on meta ({'meta buffers, ' if meta else ''}"
                                           f"limit {max_numel}) and no shrinkable config"]))


def _simulate(model: nn.Module, base: dict[str, torch.Tensor], reps: list[PairCheck], first, placements, n: int,
              args: tuple, kwargs: dict) -> dict[str, tuple[float, torch.dtype]]:
    """Run the plain and the ``n`` rank-masked forwards; ``{row: (max relative difference, dtype)}``."""
    rows = {c.row: c for c in reps}

    def run(subst: dict[str, torch.Tensor], plain, bias: bool = True):
        watch = {id(subst[r]): r for r in rows}
        probe = _RowProbe(watch, plain, bias)
        try:
            with torch.no_grad(), probe:
                torch.func.functional_call(model, subst, args, kwargs)
        except _Done:
            pass
        return probe.seen

    training = {m: m.training for m in model.modules()}
    model.eval()
    try:
        plain = run(dict(base), None)
        sums: dict[str, list[torch.Tensor]] = {}
        for r in range(n):
            subst = dict(base)
            for c in reps:
                for p in [*c.cols, c.row]:
                    e = first[p]
                    for fqn in [p] + ([e.bias] if e.bias else []):
                        pl = placements.get(fqn, Replicate())
                        t = base[fqn]
                        if fqn == e.bias and p == c.row:
                            continue  # a row bias is added once, after the reduction: see _RowProbe
                        if not isinstance(pl, Replicate):
                            subst[fqn] = t * owned_mask(tuple(t.shape), pl, n, r).to(t.device, t.dtype)
            for row, outs in run(subst, plain, bias=r == 0).items():
                acc = sums.setdefault(row, [torch.zeros_like(o) for o in outs])
                for k, o in enumerate(outs[:len(acc)]):
                    acc[k] += o
    finally:
        for m, t in training.items():
            m.train(t)
    out = {}
    for row, ref in plain.items():
        got = sums.get(row, [])
        if len(got) < len(ref):
            continue
        diff = max(float((g.double() - p.double()).abs().max()) for g, p in zip(got, ref))
        scale = max(float(p.double().abs().max()) for p in ref) or 1.0
        out[row] = (diff / scale, ref[0].dtype)
    return out

