"""torch's own op samples for every ATen op whose DTensor behaviour vescale.dtensor replaces or adds, run as DTensors
with torch's stock rules and with vescale's: a vescale rule may extend torch, never change a result torch gets right.

The samples are torch's OpInfo database (``torch.testing._internal.common_methods_invocations.op_db``, what torch's
``test_dtensor_ops.py`` runs DTensor against), float32 on the CPU, generated once in the test process and shipped to
the ranks. Each tensor of a sample is placed, in turn, replicated and sharded on each dim of size > 1 (evenly or
unevenly: most OpInfo sizes are 5), partial for a copy destination and the first tensor on 2 ranks, on the meshes of
:data:`MESHES` (2 ranks and 2x2, nested shards included; 4 ranks too when opted in); several tensors of one sample
vary one at a time and together. Each (sample, placements) runs three ways on every rank: the op on the plain full
tensors (one device), on DTensors with torch's stock rules (``vescale.dtensor._torch_hooks.uninstall()``, DTensors
made by torch's ``distribute_tensor``) and with vescale's (installed by vescale's ``distribute_tensor``). The outcome:

- ``same``: vescale's result equals torch's: values (bitwise for data movement, ``rtol=1e-4`` where the op computes),
  the output placements and no collective where torch's ran none, the local storage shared with the input exactly
  where torch's is;
- ``extended``: torch raises, vescale returns the one-device result (values; for an output that aliases its input on
  one device, a local alias too, and an in-place write through it reaches the base as on one device);
- ``fixed``: torch returns a result that is wrong against one device (values, or a copy where one device gives a
  view), vescale returns the one-device result;
- ``refused``: torch's result is not the one-device one, or torch raises, and vescale raises a named vescale error
  (:class:`~vescale.core.errors.VescaleError`, possibly as the cause of torch's dispatcher's ``RuntimeError``);
- ``refused_as_torch``: both raise, vescale exactly torch's exception (type and message): the rule defers to torch;
- ``inherited_copy``: vescale returns exactly torch's result, the one-device values as a gathered copy where one
  device returns a view (``split``, ``chunk``, ``narrow``, ``select``, ``diagonal`` of a sharded dim: torch's rule,
  kept; an in-place write through it misses the base under both); not a failure;
- ``error`` (any other exception of vescale's run), ``wrong_as_torch`` (torch's wrong values, kept) and ``changed``
  (vescale returns something other than torch's right result or than one device's): failures. ``invalid``: the
  one-device op itself raises (not counted).

Gradients (``sum_i (full_tensor(out_i) * w_i).sum()`` backward to every floating input) are classified the same way
for the differentiable ops. Random ops follow another contract, because vescale's counter RNG does not draw torch's
generator's values: with vescale's RNG installed (``random.manual_seed``) the DTensor result is bitwise the
one-device result under ``random.single_device()`` with the same seed, and its placements are torch's.

The overridden ops are read at run time from torch's tables (:func:`vescale.dtensor._torch_hooks.installed_ops`, and
the handler table around ``random.manual_seed``); the test fails when one appears that :data:`OPINFOS` (or
:data:`NO_OPINFO`, with where it is tested instead) does not name, and when a named OpInfo's samples never dispatch
the op they stand for (CompositeImplicitAutograd ops never reach DTensor; their decompositions do). Today:

- strategies wrapped by the view rules: ``view``, ``_unsafe_view``, ``view_copy``, ``reshape``, ``expand``,
  ``expand_copy``, ``permute``, ``transpose.int``, ``unsqueeze``, ``repeat``, ``squeeze`` (default, dim, dims);
  by the ragged guard: ``split.Tensor``, ``split_with_sizes``, ``split_with_sizes_copy``, ``slice.Tensor``,
  ``select.int``, ``cat``, ``stack``, ``unbind.int``, ``t``, ``diagonal``;
- strategies added or replaced: ``_scaled_dot_product_flash_attention_for_cpu`` (and backward),
  ``linalg_solve_triangular``;
- handlers: ``view``, ``copy_``, ``clone``, ``split.Tensor``, ``split_with_sizes``, ``_grouped_mm``, the ``unique``
  family;
- the counter RNG's handlers: ``uniform_``, ``normal_``, ``bernoulli_`` (float, Tensor), ``bernoulli`` (default, p),
  ``random_`` (default, to, from), ``native_dropout``, ``rand_like``, ``randn_like``, ``randint_like`` (default,
  low_dtype).
"""

from __future__ import annotations

import functools
import math
import os
import pickle
from collections import Counter

from vescale.core.testing import run_on_ranks

#: Each overridden ATen op (``str(op)``) -> the OpInfos (``name`` or ``name.variant``) whose samples exercise it.
#: ``copy_`` has no OpInfo: ``copy_`` cases are built from ``broadcast_to``'s samples (the sample input copied into a
#: destination of the target shape), listed as ``"copy_"``.
OPINFOS: dict[str, tuple[str, ...]] = {
    "aten.view.default": ("view", "view_as", "reshape", "reshape_as", "flatten", "unflatten", "ravel"),
    "aten._unsafe_view.default": ("matmul",),
    "aten.view_copy.default": ("view_copy",),
    "aten.reshape.default": ("reshape", "reshape_as"),
    "aten.expand.default": ("expand", "expand_as", "broadcast_to"),
    "aten.expand_copy.default": ("expand_copy",),
    "aten.permute.default": ("permute", "movedim"),
    "aten.transpose.int": ("transpose", "mT"),
    "aten.unsqueeze.default": ("unsqueeze",),
    "aten.repeat.default": ("repeat", "tile"),
    "aten.squeeze.default": ("squeeze",),
    "aten.squeeze.dim": ("squeeze",),
    "aten.squeeze.dims": ("squeeze.multiple",),
    "aten.split.Tensor": ("split", "chunk"),
    "aten.split_with_sizes.default": ("split.list_args", "split_with_sizes"),
    "aten.split_with_sizes_copy.default": ("split_with_sizes_copy",),
    "aten.slice.Tensor": ("narrow", "slice", "tensor_split"),
    "aten.select.int": ("select",),
    "aten.cat.default": ("cat",),
    "aten.stack.default": ("stack",),
    "aten.unbind.int": ("unbind",),
    "aten.t.default": ("t",),
    "aten.diagonal.default": ("diagonal",),
    "aten.linalg_solve_triangular.default": ("linalg.solve_triangular",),
    "aten._scaled_dot_product_flash_attention_for_cpu.default": ("nn.functional.scaled_dot_product_attention",),
    "aten._scaled_dot_product_flash_attention_for_cpu_backward.default": (
        "nn.functional.scaled_dot_product_attention",),
    "aten.copy_.default": ("copy_", "nn.functional.pad.circular"),
    "aten.clone.default": ("clone",),
    "aten._unique2.default": ("unique",),
    "aten.unique_dim.default": ("unique",),
    "aten.unique_consecutive.default": ("unique_consecutive",),
    # the counter RNG
    "aten.uniform_.default": ("uniform",),
    "aten.normal_.default": ("normal.in_place",),
    "aten.bernoulli_.float": ("nn.functional.dropout",),
    "aten.bernoulli.default": ("bernoulli",),
    "aten.rand_like.default": ("rand_like",),
    "aten.randn_like.default": ("randn_like",),
    "aten.randint_like.default": ("randint_like",),
    "aten.randint_like.low_dtype": ("randint_like",),
}

_RANDOM_FILL = "not run from its OpInfo here; tests/test_random.py (every placement) and test_random_dists.py"
#: Overridden ops without a float32 CPU OpInfo that reaches them, and where they are tested instead.
NO_OPINFO: dict[str, str] = {
    "aten._grouped_mm.default": "no OpInfo on the CPU; tests/test_sharding_rules.py (MoE experts kernel)",
    "aten._unique.default": "torch.unique dispatches _unique2 and unique_dim; tests/test_sharding_rules.py",
    "aten.bernoulli_.Tensor": "no OpInfo; tests/test_random.py",
    "aten.bernoulli.p": "no OpInfo; tests/test_random.py",
    "aten.random_.default": "no OpInfo; tests/test_random.py",
    "aten.random_.to": "no OpInfo; tests/test_random.py",
    "aten.random_.from": "no OpInfo; tests/test_random.py",
    "aten.native_dropout.default": "F.dropout on the CPU takes bernoulli_; tests/test_random.py",
    "aten.scatter_add.default": "Partial operands only; tests/test_scatter_add_partial.py",
    "aten.scatter_add_.default": "Partial operands only; tests/test_scatter_add_partial.py",
    "aten.exponential_.default": _RANDOM_FILL,
    "aten.geometric_.default": _RANDOM_FILL,
    "aten.log_normal_.default": _RANDOM_FILL,
    "aten.cauchy_.default": _RANDOM_FILL,
}

#: OpInfos whose result is computed (not moved): compared at rtol 1e-4 / atol 1e-5 x scale (see _equal), the rest
#: bitwise.
NUMERIC = frozenset({"linalg.solve_triangular", "nn.functional.scaled_dot_product_attention", "matmul"})
#: OpInfos of the counter RNG (see the module docstring).
RANDOM = frozenset({"uniform", "normal.in_place", "nn.functional.dropout", "bernoulli", "rand_like", "randn_like",
                    "randint_like"})
#: Samples taken per OpInfo, evenly spaced over its list (solve_triangular has 432): 1 in CI, on a 2-rank and a
#: 2x2 mesh; ``VESCALE_OP_SAMPLES=N`` (or ``all``) takes N (every one) and adds the 4-rank 1-d mesh.
_SAMPLES_ENV = os.environ.get("VESCALE_OP_SAMPLES", "")
MAX_SAMPLES = 10**6 if _SAMPLES_ENV == "all" else int(_SAMPLES_ENV or 1)
#: The meshes run, by world size.
MESHES: dict[int, list[tuple[int, ...]]] = {2: [(2,)], 4: [(4,), (2, 2)] if _SAMPLES_ENV else [(2, 2)]}
#: Placement combinations per sample when it has several tensors (each varied alone, then together).
MAX_COMBOS = 12 if _SAMPLES_ENV else 4


# ----------------------------------------------------------------------------------------------- callables by name

def _method(name, x, *args, **kwargs):
    return getattr(x, name)(*args, **kwargs)


def _attribute(name, x):
    return getattr(x, name)


def _aten(name, overload, *args, **kwargs):
    import torch

    return getattr(getattr(torch.ops.aten, name), overload)(*args, **kwargs)


def _copy_into(dst, src):
    return dst.copy_(src)


def _portable(op):
    """``op`` as the ranks receive it: the module's own helpers by name (a rank may import this test module under
    another name than pytest's importlib mode gave it here), anything else as it is."""
    if op is _copy_into:
        return ("_copy_into",)
    if isinstance(op, functools.partial) and op.func in (_attribute, _method, _aten):
        return (op.func.__name__, *op.args)
    return op


def _local(op):
    """The callable a :func:`_portable` value stands for, on a rank."""
    if not isinstance(op, tuple):
        return op
    name, *args = op
    fn = {"_copy_into": _copy_into, "_attribute": _attribute, "_method": _method, "_aten": _aten}[name]
    return functools.partial(fn, *args) if args else fn


def _callable(info):
    """A picklable callable computing what ``info.op`` computes (OpInfo ops are often lambdas)."""
    import torch

    if info.name == "copy_":
        return _copy_into
    if info.name in ("T", "mT", "H", "mH"):
        return functools.partial(_attribute, info.name)
    if info.name in ("normal", "uniform") and info.variant_test_name in ("in_place", ""):  # Tensor.normal_/uniform_
        return functools.partial(_method, info.name + "_")
    if isinstance(info.op, torch._ops.OpOverload):
        return functools.partial(_aten, info.op.overloadpacket.__name__, info.op._overloadname)
    candidates = [info.op]
    if info.method_variant is not None and info.method_variant.__name__ != "<lambda>":
        candidates.append(functools.partial(_method, info.method_variant.__name__))
    path = info.name.split(".")
    fn = functools.reduce(lambda o, a: getattr(o, a, None), path, torch)
    if fn is not None:
        candidates.append(fn)
    for c in candidates:
        try:
            pickle.dumps(c)
        except Exception:  # noqa: BLE001 (lambdas and descriptors do not pickle; try the next)
            continue
        return c
    raise AssertionError(f"no picklable callable for OpInfo {info.name}.{info.variant_test_name}")


# ------------------------------------------------------------------------------------------ samples (test process)

def _opinfo_key(info) -> str:
    return info.name + (f".{info.variant_test_name}" if info.variant_test_name else "")


def _recorded(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` on plain tensors and the set of ATen ops (``str``) it dispatched."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen: set[str] = set()

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.add(str(func))
            return func(*args, **(kwargs or {}))

    with Record():
        out = fn(*args, **kwargs)
    return out, seen


def _samples():
    """``(cases, dispatched)``: the cases to run on ranks, and per OpInfo key the ATen ops its kept samples dispatch.

    A case is ``(key, op, input, args, kwargs, differentiable)`` with plain CPU tensors. Samples the one-device op
    rejects, with dropout inside attention (torch's fused CPU kernel draws from each rank's generator), without a
    tensor input, or with an empty tensor are left out.
    """
    import torch
    from torch.testing._internal.common_methods_invocations import op_db

    by_key = {_opinfo_key(o): o for o in op_db}
    wanted = sorted({k for keys in OPINFOS.values() for k in keys} - {"copy_"})
    missing = [k for k in wanted if k not in by_key]
    assert not missing, f"OpInfos named in OPINFOS but not in torch's op_db: {missing}"
    torch.manual_seed(0)
    cases, dispatched = [], {}
    for key in [*wanted, "copy_"]:
        info = by_key["broadcast_to" if key == "copy_" else key]
        op = _copy_into if key == "copy_" else _callable(info)
        samples = list(info.sample_inputs("cpu", torch.float32, requires_grad=False))
        step = max(1, math.ceil(len(samples) / MAX_SAMPLES))
        seen: set[str] = set()
        targets = {op for op, keys in OPINFOS.items() if key in keys}
        kept = 0
        for n, s in enumerate(samples):
            if n % step and kept and targets <= seen:
                continue  # neither a case nor needed for the dispatch check (every op it stands for was seen)
            inp, args, kwargs = s.input, tuple(s.args), dict(s.kwargs)
            if key == "copy_":  # the sample input broadcast into a destination of the target shape
                inp, args, kwargs = torch.randn(tuple(args[0])), (inp,), {}
            if kwargs.get("dropout_p", 0.0):
                continue
            if not (isinstance(inp, torch.Tensor) or (isinstance(inp, (list, tuple)) and inp)):
                continue
            if any(t.numel() == 0 for t in _tensors((inp, args, kwargs))):
                continue  # torch's view rule loops forever on some empty shapes ([4, 0] unflattened to [4, 2, 0, 0, 0])
            differentiable = info.supports_autograd and key not in RANDOM and key != "copy_"
            try:  # every sample's dispatched ops count; every step-th sample is a case
                seen |= _recorded(_reference, op, inp, args, kwargs, differentiable)[1]
            except Exception:  # noqa: BLE001 (the one-device op rejects this sample: not a case)
                continue
            if n % step == 0 or not kept:  # (the first valid sample when the step's first is left out)
                cases.append((key, op, inp, args, kwargs, differentiable))
                kept += 1
        dispatched[key] = seen
    return cases, dispatched


def _clone(tree):
    import torch
    from torch.utils._pytree import tree_map

    return tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, tree)


def _weights(shape):
    """Fixed cotangent weights of ``shape`` (small integers, so the plain and the sharded backward agree closely)."""
    import torch

    n = math.prod(shape)
    return (torch.arange(n, dtype=torch.float32) % 7 - 3).reshape(shape)


def _tensors(tree) -> list:
    import torch
    from torch.utils._pytree import tree_flatten

    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def _reference(op, inp, args, kwargs, differentiable: bool) -> dict:
    """The one-device result of a case: output values, whether each output shares the input's storage, the input
    after an in-place write through the outputs that do (None where one device refuses that write), and the
    gradients of every floating input (None unless ``differentiable``)."""
    import torch

    inp, args, kwargs = _clone((inp, args, kwargs))
    leaves = _tensors((inp, args, kwargs))
    if differentiable:
        for t in leaves:
            if t.is_floating_point():
                t.requires_grad_(True)
    outs = _tensors(op(inp, *args, **kwargs))
    first = leaves[0]
    ref = {"values": [o.detach().clone() for o in outs],
           "alias": [o.untyped_storage().data_ptr() == first.untyped_storage().data_ptr() and o.numel() > 0
                     for o in outs],
           "grads": None, "written": None}
    if differentiable and any(o.requires_grad for o in outs):
        loss = sum((o * _weights(o.shape)).sum() for o in outs if o.requires_grad and o.is_floating_point())
        loss.backward()
        ref["grads"] = [t.grad.clone() if t.grad is not None else torch.zeros_like(t) for t in leaves
                        if t.is_floating_point()]
    if outs and all(ref["alias"]) and isinstance(inp, torch.Tensor):
        try:
            with torch.no_grad():
                for i, o in enumerate(outs):
                    o.mul_(-(i + 2))
            ref["written"] = first.detach().clone()
        except RuntimeError:
            pass  # an expanded view: one device refuses the write too
    return ref


# ------------------------------------------------------------------------------------------------- on every rank

def _codes(shape, mesh_shape, partial: bool) -> list[tuple[str, ...]]:
    """Placement codes for one tensor (``R``, ``S<d>``, ``P``), one per mesh dim: replicated, and sharded on each dim
    of size > 1 (nested and crossed on 2-d meshes), plus partial when ``partial``."""
    dims = [d for d, n in enumerate(shape) if n > 1]
    if len(mesh_shape) == 1:
        return [("R",), *[(f"S{d}",) for d in dims], *([("P",)] if partial else [])]
    out = [("R", "R")]
    for d in dims:  # one mesh dim alone is what the 1-d meshes cover; here both shard, nested or crossed
        out.append((f"S{d}", f"S{d}"))
    if dims:
        out.append(("R", f"S{dims[-1]}"))
    if len(dims) >= 2:
        out += [(f"S{dims[0]}", f"S{dims[1]}"), (f"S{dims[1]}", f"S{dims[0]}")]
    if partial:
        out += [("P", "R"), *[("P", f"S{d}") for d in dims[:2]], *[(f"S{d}", "P") for d in dims[:1]]]
    return out


def _combos(shapes: list, mesh_shape, partial_first: bool) -> list[tuple]:
    """Placement codes for every tensor of a sample: all combinations when few, else each tensor varied alone (the
    others replicated) and all varied together, at most :data:`MAX_COMBOS`."""
    import itertools

    choices = [_codes(s, mesh_shape, partial_first and i == 0) for i, s in enumerate(shapes)]
    if math.prod(len(c) for c in choices) <= MAX_COMBOS:
        return list(itertools.product(*choices))
    out = [tuple(c[0] for c in choices)]
    for i, c in enumerate(choices):
        out += [tuple(code if j == i else choices[j][0] for j in range(len(choices))) for code in c[1:]]
    out += [tuple(c[k % len(c)] for c in choices) for k in range(1, max(len(c) for c in choices))]
    return list(dict.fromkeys(out))[:MAX_COMBOS]


def _place(t, mesh, codes, vescale: bool, grad: bool):
    """``t`` as a DTensor placed by ``codes``: made by vescale's ``distribute_tensor``/``from_local`` (which install
    vescale's rules) or by torch's (which leave torch as found). A partial tensor is ``t`` on coordinate 0 of each
    partial mesh dim and zeros elsewhere."""
    import torch
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
    from torch.distributed.tensor import distribute_tensor as torch_distribute

    from vescale.dtensor import distribute_tensor, from_local

    placements = [Replicate() if c == "R" else Partial() if c == "P" else Shard(int(c[1:])) for c in codes]
    if "P" in codes:
        first = all(mesh.get_local_rank(m) == 0 for m, c in enumerate(codes) if c == "P")
        shards = [p if isinstance(p, Shard) else Replicate() for p in placements]
        piece = torch_distribute(t, mesh, shards, src_data_rank=None).to_local()
        local = piece.clone() if first else torch.zeros_like(piece)
        if vescale:
            out = from_local(local, mesh, placements, shape=t.shape)
        else:
            out = DTensor.from_local(local, mesh, placements, run_check=False, shape=t.shape, stride=t.stride())
    elif vescale:
        out = distribute_tensor(t, mesh, placements, src_data_rank=None)
    else:
        out = torch_distribute(t, mesh, placements, src_data_rank=None)
    return out.detach().requires_grad_(grad and t.is_floating_point())


def _aliases(out, first) -> bool | None:
    """Whether ``out``'s local tensor shares ``first``'s local storage (None when ``out``'s local piece is empty)."""
    from vescale.core import torch_internals

    local = torch_internals.local_tensor(out)
    if local.numel() == 0:
        return None
    return local.untyped_storage().data_ptr() == torch_internals.local_tensor(first).untyped_storage().data_ptr()


def _piece(t, want, mesh, numeric: bool) -> dict:
    """What a run keeps of an output or gradient ``t`` (a DTensor, or None for no gradient), without a collective
    unless ``t`` is partial: its placements, this rank's local piece (the full tensor where partial), and whether
    that equals the same piece of the one-device tensor ``want``."""
    from torch.distributed.tensor import DTensor

    from vescale.core import torch_internals
    from vescale.dtensor.layout import local_slice

    if t is None:
        return {"placements": None, "piece": None, "right": not bool(want.any())}
    if not isinstance(t, DTensor):
        piece = t.detach().clone()
        return {"placements": None, "piece": piece, "right": _equal([piece], [want], numeric)}
    placements = tuple(t.placements)
    if any(p.is_partial() for p in placements):
        piece = t.full_tensor().detach().clone()
        right = _equal([piece], [want], numeric)
    else:
        piece = torch_internals.local_tensor(t).detach().clone()
        right = t.shape == want.shape and _equal([piece], [local_slice(want, mesh, placements)], numeric)
    return {"placements": placements, "piece": piece, "right": right}


def _run(case, ref, mesh, combo, vescale: bool) -> dict:
    """One case as DTensors: ``{"raised": exc}``, or per output its placements, local piece and whether that is the
    one-device result's piece, whether its local tensor shares the input's storage, the collectives the op issued,
    the same for the input gradients (``grads`` or ``grad_raised``), and (vescale's run, where one device allows it)
    whether an in-place write through the outputs reached the input as on one device (``written``)."""
    import torch
    from torch.distributed.tensor import DTensor
    from torch.utils._pytree import tree_flatten, tree_unflatten

    from vescale.core.comm import count_comms
    from vescale.dtensor.layout import local_slice

    key, op, inp, args, kwargs, differentiable = case
    numeric = key in NUMERIC
    grad = differentiable and ref["grads"] is not None
    leaves, spec = tree_flatten(_clone((inp, args, kwargs)))
    where = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    for j, i in enumerate(where):
        leaves[i] = _place(leaves[i], mesh, combo[j], vescale, grad)
    placed = [leaves[i] for i in where]
    d_inp, d_args, d_kwargs = tree_unflatten(leaves, spec)
    try:
        with count_comms() as comms:
            outs = _tensors(op(d_inp, *d_args, **d_kwargs))
    except Exception as e:  # noqa: BLE001 (classified by the caller)
        return {"raised": e}
    if len(outs) != len(ref["values"]):
        return {"raised": AssertionError(f"{len(outs)} outputs, {len(ref['values'])} on one device")}
    res = {"comms": comms.total, "alias": [_aliases(o, placed[0]) if isinstance(o, DTensor) else False for o in outs],
           "outs": [_piece(o, want, mesh, numeric) for o, want in zip(outs, ref["values"])]}
    if grad:
        try:
            loss = 0
            for o in outs:
                if o.requires_grad and o.is_floating_point():
                    w = _weights(o.shape)
                    if any(p.is_partial() for p in o.placements):
                        loss = loss + (o.full_tensor() * w).sum()
                    else:  # this rank's piece of the cotangent: no collective
                        loss = loss + (o.to_local() * local_slice(w, mesh, o.placements)).sum()
            if isinstance(loss, torch.Tensor):
                loss.backward()
            floats = [t for t in placed if t.is_floating_point()]
            res["grads"] = [_piece(t.grad, want, mesh, True) for t, want in zip(floats, ref["grads"])]
        except Exception as e:  # noqa: BLE001
            res["grad_raised"] = e
    if vescale and ref["written"] is not None:
        try:
            with torch.no_grad():
                for i, o in enumerate(outs):
                    o.mul_(-(i + 2))
            res["written"] = _piece(placed[0], ref["written"], mesh, numeric)["right"]
        except Exception as e:  # noqa: BLE001
            res["written"] = e
    return res


def _named(error: BaseException | None) -> bool:
    """Whether ``error`` is, or is caused by, an error vescale raises on purpose."""
    from vescale.core.errors import VescaleError

    while error is not None:
        if isinstance(error, VescaleError):
            return True
        error = error.__cause__
    return False


def _equal(a: list, b: list, numeric: bool) -> bool:
    """Same shapes and dtypes, and values bitwise (``numeric``: within rtol 1e-4, atol 1e-5 x the reference's largest
    magnitude (at least 1): a gradient of a peaked softmax, OpInfo's values up to 9, sums terms ~40 times its small
    elements, and fp32 reordering rounds at that scale)."""
    import torch

    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if x.shape != y.shape or x.dtype != y.dtype:
            return False
        scale = max(1.0, float(y.abs().nan_to_num(0.0, 0.0, 0.0).max())) if numeric and y.numel() else 1.0
        same = (torch.allclose(x.double(), y.double(), rtol=1e-4, atol=1e-5 * scale, equal_nan=True) if numeric
                else torch.equal(x, y))
        if not same:
            return False
    return True


def _right(run: dict, ref: dict) -> bool:
    """The one-device result: values, and a local alias for each output that is a view of the input on one device."""
    return all(o["right"] for o in run["outs"]) and all(
        a is not False for a, want in zip(run["alias"], ref["alias"]) if want)


def _same_pieces(a: list, b: list, numeric: bool) -> bool:
    """Two runs' outputs (or gradients) hold the same values: both the one-device ones, or equal pieces equally
    placed."""
    if all(x["right"] for x in a) and all(y["right"] for y in b):
        return True
    return all(x["placements"] == y["placements"] and (x["piece"] is None) == (y["piece"] is None)
               and (x["piece"] is None or _equal([x["piece"]], [y["piece"]], numeric)) for x, y in zip(a, b))


def _same(s: dict, v: dict, numeric: bool) -> bool:
    """vescale's run gave torch's result: values, aliasing, and where torch ran no collective, none and its
    placements."""
    if not _same_pieces(s["outs"], v["outs"], numeric):
        return False
    if any(a is not None and b is not None and a != b for a, b in zip(s["alias"], v["alias"])):
        return False
    same_placements = [o["placements"] for o in s["outs"]] == [o["placements"] for o in v["outs"]]
    return s["comms"] > 0 or (v["comms"] == 0 and same_placements)


def _same_error(s: BaseException, v: BaseException) -> bool:
    return type(s) is type(v) and str(s) == str(v)


def _forward_outcome(ref: dict, s: dict, v: dict, numeric: bool) -> str:
    if "raised" in v:
        if "raised" in s and _same_error(s["raised"], v["raised"]):
            return "refused_as_torch"
        if _named(v["raised"]) and ("raised" in s or not _right(s, ref)):
            return "refused"
        return "error"
    if "written" in v and v["written"] is not True:
        # an in-place write through vescale's outputs did not reach the base as on one device: torch's own rule (a
        # gathered copy, e.g. split of a sharded dim) when torch's run returned the same copy; else vescale lost a view
        copied = "raised" not in s and not all(a is not False for a, want in zip(s["alias"], ref["alias"]) if want)
        if copied and _same(s, v, numeric) and all(o["right"] for o in s["outs"]):
            return "inherited_copy"
        return "changed"
    if "raised" in s:
        return "extended" if _right(v, ref) else "changed"
    if _same(s, v, numeric):
        if _right(s, ref):
            return "same"
        # torch's own result, inherited: a gathered copy where one device gives a view is documented (split of a
        # sharded dim); wrong values are not
        return "inherited_copy" if all(o["right"] for o in s["outs"]) else "wrong_as_torch"
    if _right(s, ref):
        return "changed"
    return "fixed" if _right(v, ref) else "changed"


def _grad_outcome(ref: dict, s: dict, v: dict) -> str | None:
    if ref["grads"] is None or "raised" in v:
        return None
    s_ok = "raised" not in s and "grads" in s
    s_right = s_ok and all(g["right"] for g in s["grads"])
    if "grad_raised" in v:
        if "grad_raised" in s and _same_error(s["grad_raised"], v["grad_raised"]):
            return "refused_as_torch"
        return "refused" if _named(v["grad_raised"]) and not s_right else "error"
    if all(g["right"] for g in v["grads"]):
        return "same" if s_right else ("fixed" if s_ok else "extended")
    if s_ok and _same_pieces(s["grads"], v["grads"], True):
        return "wrong_as_torch"
    return "changed"


def _random_case(case, mesh, combo) -> str:
    """A random op: torch's stock run gives the placements and errors to match; vescale's counter RNG must give
    bitwise the one-device result under ``random.single_device()`` with the same seed."""
    import torch
    from torch.distributed.tensor import DTensor

    from vescale.dtensor import _torch_hooks, random

    key, op, inp, args, kwargs, _ = case
    seed = 1234

    def call(vescale: bool):
        leaves = [_place(t, mesh, c, vescale, False) for t, c in zip(_tensors(inp), combo)]
        out = op(leaves[0], *args, **kwargs)
        return out, [tuple(o.placements) for o in _tensors(out) if isinstance(o, DTensor)]

    _torch_hooks.uninstall()
    random.uninstall()
    torch.manual_seed(0)
    try:
        stock = call(False)[1]
    except Exception as e:  # noqa: BLE001
        stock = e
    random.manual_seed(seed)
    with random.single_device():
        want = [o.clone() for o in _tensors(op(inp.clone(), *args, **kwargs))]
    random.manual_seed(seed)
    try:
        out, placements = call(True)
        got = [o.full_tensor() if isinstance(o, DTensor) else o for o in _tensors(out)]
    except Exception as e:  # noqa: BLE001
        if isinstance(stock, Exception) and _same_error(stock, e):
            return "refused_as_torch"
        return "refused" if _named(e) else "error"
    finally:
        random.uninstall()
    if len(got) != len(want) or not all(torch.equal(g, w) for g, w in zip(got, want)):
        return "changed"
    if isinstance(stock, Exception):
        return "extended"
    return "same" if placements == stock else "changed"


def _overrides() -> list[str]:
    """Every ATen op whose DTensor behaviour vescale changes, read from torch's tables: what ``install`` changed, and
    the handlers ``random.manual_seed`` adds."""
    from vescale.core import torch_internals
    from vescale.dtensor import _torch_hooks, random

    ops = {str(op) for op in _torch_hooks.installed_ops()}
    random.uninstall()
    before = dict(torch_internals.dtensor_custom_op_handlers())
    random.manual_seed(0)
    after = torch_internals.dtensor_custom_op_handlers()
    ops |= {str(op) for op in after if before.get(op) is not after[op]}
    random.uninstall()
    return sorted(ops)


def _check_samples(cases: list, meshes: list[tuple[int, ...]]) -> dict:
    """On every rank: each case on each mesh and placement combination, torch's stock rules then vescale's; returns
    ``{"outcomes": [(mesh, key, case index, combo, forward, gradient, detail)], "overrides": [...]}``."""
    import torch

    from vescale.dtensor import _torch_hooks, init_device_mesh

    cases = [(key, _local(op), *rest) for key, op, *rest in cases]
    was_installed = _torch_hooks.is_installed()
    overrides = _overrides()
    refs = [None if c[0] in RANDOM else _reference(*c[1:]) for c in cases]
    outcomes = []
    try:
        for mesh_shape in meshes:
            mesh = init_device_mesh("cpu", mesh_shape)
            partial = mesh_shape == (2,)
            todo = []
            for n, case in enumerate(cases):
                shapes = [tuple(t.shape) for t in _tensors(case[2:5])]
                first_partial = case[0] == "copy_" or (partial and case[0] not in RANDOM)
                todo += [(n, combo) for combo in _combos(shapes, mesh_shape, first_partial)]
            random_todo = [(n, combo) for n, combo in todo if cases[n][0] in RANDOM]
            todo = [(n, combo) for n, combo in todo if cases[n][0] not in RANDOM]
            _torch_hooks.uninstall()
            stock = [_run(cases[n], refs[n], mesh, combo, vescale=False) for n, combo in todo]
            assert not _torch_hooks.is_installed(), "a stock run installed vescale's rules"
            for (n, combo), s in zip(todo, stock):
                v = _run(cases[n], refs[n], mesh, combo, vescale=True)
                numeric = cases[n][0] in NUMERIC
                fwd = _forward_outcome(refs[n], s, v, numeric)
                grad = _grad_outcome(refs[n], s, v)
                detail = ""
                if fwd not in ("same", "extended", "fixed", "refused_as_torch") or grad in ("error", "changed"):
                    detail = f"torch: {s.get('raised', s.get('placements'))!r}; vescale: " \
                             f"{v.get('raised', v.get('placements'))!r} {v.get('grad_raised', '')!r}"[:400]
                outcomes.append((mesh_shape, cases[n][0], n, combo, fwd, grad, detail))
            for n, combo in random_todo:
                outcomes.append((mesh_shape, cases[n][0], n, combo, _random_case(cases[n], mesh, combo), None, ""))
    finally:
        if was_installed:
            _torch_hooks.install()
        else:
            _torch_hooks.uninstall()
        torch.manual_seed(0)
    return {"outcomes": outcomes, "overrides": overrides}


# ------------------------------------------------------------------------------------------------- the test

FAILING = frozenset({"error", "changed", "wrong_as_torch"})


def test_torch_op_samples_with_vescale_rules_equal_torch_or_extend_it():
    """Every overridden op is covered; on each mesh of :data:`MESHES` no sample ends in ``error``, ``changed`` or
    ``wrong_as_torch``, forward or backward (see the module docstring)."""
    import torch

    cases, dispatched = _samples()
    sent = [(key, _portable(op), *rest) for key, op, *rest in cases]
    results = {n: run_on_ranks(_check_samples, n, sent, meshes, timeout=900) for n, meshes in MESHES.items()}

    from vescale.dtensor import random

    overrides = results[2][0]["overrides"]
    assert overrides == results[4][0]["overrides"]
    # the random ops the counter RNG refuses on DTensors (tests/test_random_dists.py): a refusal, not a rule
    overrides = sorted(set(overrides) - {str(op) for op in random.undrawn_random_ops()})
    uncovered = sorted(set(overrides) - set(OPINFOS) - set(NO_OPINFO))
    stale = sorted((set(OPINFOS) | set(NO_OPINFO)) - set(overrides))
    assert not uncovered, f"vescale overrides ops this test does not cover (add their OpInfos to OPINFOS): {uncovered}"
    assert not stale, f"OPINFOS/NO_OPINFO name ops vescale no longer overrides: {stale}"
    for op, keys in OPINFOS.items():
        _, name, overload = op.split(".")
        schema = f"aten::{name}" + ("" if overload == "default" else f".{overload}")
        assert any(op in dispatched.get(k, ()) for k in keys) or torch._C._dispatch_has_kernel_for_dispatch_key(
            schema, "CompositeImplicitAutograd"), f"no sample of {keys} dispatches {op}"

    merged: dict = {}
    rank_of = {"error": 5, "changed": 4, "wrong_as_torch": 3}
    for ranks in results.values():
        for rank in ranks:
            for i, row in enumerate(rank["outcomes"]):
                key = (row[0], i)
                old = merged.get(key)
                if old is None or rank_of.get(row[4], 0) + rank_of.get(row[5], 0) > \
                        rank_of.get(old[4], 0) + rank_of.get(old[5], 0):
                    merged[key] = row
    rows = list(merged.values())
    forward = Counter(r[4] for r in rows)
    backward = Counter(r[5] for r in rows if r[5] is not None)
    print(f"\n{len(cases)} samples, {len(rows)} (sample, mesh, placements) cases; forward {dict(forward)}; "
          f"gradients {dict(backward)}")
    bad = [r for r in rows if r[4] in FAILING or r[5] in FAILING]
    assert not bad, f"{len(bad)} cases where vescale's rules change torch's result or fail:\n" + "\n".join(
        f"  mesh {m} {key} sample {n} {combo}: forward {f}, gradient {g}: {d}"
        for m, key, n, combo, f, g, d in bad[:40])
    covered = {(r[0], r[1]) for r in rows if r[4] not in FAILING}
    for key in {k for keys in OPINFOS.values() for k in keys}:
        for mesh in (m for meshes in MESHES.values() for m in meshes):
            assert (mesh, key) in covered, f"no case of {key} ran on mesh {mesh}"
