"""``parallelize_module``: turn an unmodified module into a tensor/sequence-parallel one from a plan that is data.

The plan is written in the grammar of :mod:`vescale.parallel.plan_grammar` (sections ``parameter``, ``input``,
``output`` and ``local``, each mapping regex FQN patterns to values, ``""`` for the root module; one item per
argument), and is checked against it and against the module before anything changes.

Parameters no pattern names are replicated; buffers are always replicated. An ``input`` entry redistributes the
module's DTensor arguments to the given placements before its ``forward`` (a plain tensor is taken as this rank's
local piece under them, like :meth:`DTensor.from_local`); an ``output`` entry redistributes its outputs after.
``None`` leaves an argument/output alone. A ``local`` entry runs a submodule on local shards as plain tensors, for
data-dependent code DTensor cannot follow (see :mod:`.local`).

The root module's boundary is plain tensors: plain arguments without an entry become ``Replicate`` DTensors, and
DTensor outputs become plain tensors, via ``to_local()`` after redistributing to the root's ``output`` entry (default
``Replicate``, i.e. the full tensor). A root ``output`` entry of ``None`` returns that output as a DTensor, e.g. to
feed vocab-sharded logits to :func:`vescale.parallel.vocab_parallel_cross_entropy`. Inside, activations stay
DTensors, and tensors created in ``forward`` are captured as replicated DTensors (see :mod:`.factory`).

Boundary redistributions are differentiable with Megatron's backward: an all-gathered (sequence-parallel) input's
gradient is reduce-scattered, a reduced output's gradient passes through.

Token ids: an embedding lookup with a DTensor weight and an id outside its vocabulary raises
:class:`~vescale.parallel.errors.TokenIdError` (naming the id, the vocabulary size and the embedding's FQN) on every
rank, where one device raises ``IndexError`` and torch's vocab-parallel rule would read zeros
(:func:`vescale.parallel.model_calls.check_token_ids`: no collective for ids replicated over the mesh, one all-reduce
of two numbers over the dims where they are batch-sharded).

Compile: a vocab-parallel ``nn.Embedding`` gets a lookup dynamo can trace (see
:func:`vescale.parallel.compile.install_compilable_embeddings`; eager is unchanged), so ``torch.compile(model)`` of
the result works (see :mod:`.compile`).

Gradients: after accumulation each parameter's ``.grad`` is redistributed to the parameter's own placements (the
``Partial`` gradient of a replicated norm weight under sequence parallelism, or of any parameter on a data-parallel
mesh dim, is all-reduced there), so ``param.grad`` always has ``param.placements``; also after a ``module.to(dtype)``
that swapped the DTensor parameters (the root re-hooks their gradient-accumulator nodes at its next forward).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from vescale.core.errors import PlanError
from vescale.core.fqn import match_plan
from vescale.core.placement_format import format_placements
from vescale.dtensor import distribute_tensor, is_deferred, materialize
from vescale.dtensor.api import from_local_nograd
from vescale.parallel.compile import install_compilable_embeddings
from vescale.parallel.factory import FactoryCapture, capture_suspended
from vescale.parallel.fast import FastPathContext, install_fast_path
from vescale.parallel.kv_replicas import install_kv_replicas, planned_kv_replicas
from vescale.parallel.local import make_local
from vescale.parallel.model_calls import name_embeddings
from vescale.parallel.plan_grammar import Plan, check_plan, mesh_description
from vescale.parallel.report import PlanEntry, PlanReport

__all__ = ["parallelize_module", "plan_report", "Plan"]


def parallelize_module(module: nn.Module, mesh: DeviceMesh, plan: Plan) -> nn.Module:
    """Shard ``module``'s parameters and install its activation layouts as ``plan`` says; return ``module``.

    In place: parameters become ``nn.Parameter`` DTensors (``distribute_tensor``, which takes rank 0's values of
    each mesh group), buffers replicated DTensors, and forward hooks are registered. The whole plan is checked
    against the grammar (:func:`~vescale.parallel.check_plan`) and against the module first, so a bad plan raises
    :class:`~vescale.core.errors.PlanError` (naming the section, pattern, FQN, shape, placements and mesh dim) on
    every rank before any collective. ``module.plan_report()`` returns the
    :class:`~vescale.parallel.report.PlanReport` afterwards.

    Attention modules with fewer key/value heads than ranks on the mesh dim sharding ``q_proj``, whose plan replicates
    ``k_proj``/``v_proj``, keep only this rank's kv head in their KV cache (:mod:`vescale.parallel.kv_replicas`; head
    counts that cannot be replicated so raise ``PlanError`` before any collective).
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"parallelize_module expects an nn.Module, got {type(module).__name__}")
    checked = check_plan(plan, mesh)
    mesh_desc = mesh_description(mesh)
    decisions = _decide_parameters(module, mesh, checked.parameter, mesh_desc)
    inputs, outputs, local = (_decide_boundaries(module, getattr(checked, s), s) for s in ("input", "output", "local"))
    # fewer kv heads than tp ranks with k/v replicated: each rank's KV cache keeps only its kv head (.kv_replicas)
    kv_replicas = planned_kv_replicas(module, mesh, {f: p for fqns, p, _ in decisions.values() for f in fqns})

    report = PlanReport(mesh_desc)
    _distribute_state(module, mesh, decisions, report)
    name_embeddings(module)  # the FQNs a TokenIdError names (an id outside an embedding's vocabulary)
    _install_hooks(module, mesh, inputs, outputs, local, report)
    install_kv_replicas(module, mesh, kv_replicas)
    install_compilable_embeddings(module)
    module.plan_report = functools.partial(_identity, report)
    return module


def plan_report(module: nn.Module) -> PlanReport:
    """The :class:`PlanReport` of a module returned by :func:`parallelize_module`."""
    getter = getattr(module, "plan_report", None)
    if getter is None:
        raise ValueError(f"{type(module).__name__} was not parallelized by vescale.parallel.parallelize_module")
    return getter()


def _identity(value: Any) -> Any:
    return value


# ---------------------------------------------------------------------------------------------------------------
# Checking the plan (pure, identical on every rank, before any collective)
# ---------------------------------------------------------------------------------------------------------------


def _dim_name(mesh, i: int) -> str:
    return mesh.mesh_dim_names[i] if mesh.mesh_dim_names else f"dim{i}"


def _check_placements(value: Any, mesh, *, where: str, mesh_desc: str) -> tuple[Placement, ...]:
    """``value`` as a tuple of placements, one per mesh dim, or a PlanError naming ``where``."""
    if isinstance(value, Placement) or not isinstance(value, Sequence) or isinstance(value, str):
        raise PlanError(f"{where}: placements must be a list with one Placement per mesh dim of {mesh_desc}, "
                        f"got {value!r}")
    if len(value) != mesh.ndim:
        raise PlanError(f"{where}: {len(value)} placement(s) {list(value)} for the {mesh.ndim}-dim {mesh_desc}; "
                        f"give exactly one per mesh dim (Replicate() on the dims you do not shard)")
    for i, p in enumerate(value):
        if not isinstance(p, Placement):
            raise PlanError(f"{where}: entry {i} (mesh dim {_dim_name(mesh, i)!r}) is {p!r}, not a Placement")
    return tuple(value)


def _shard_divisor(p: Placement) -> int:
    """How many pieces per mesh rank a Shard-like placement needs (InterleavedShard needs its interleave factor)."""
    for attr in ("interleaved_size", "interleave"):
        n = getattr(p, attr, None)
        if isinstance(n, int) and n > 0:
            return n
    return 1


def _check_param_placements(placements: tuple[Placement, ...], shape: torch.Size, mesh, *, where: str) -> None:
    ndim = len(shape)
    divisors = [1] * ndim
    culprits: list[list[str]] = [[] for _ in range(ndim)]
    for i, p in enumerate(placements):
        if isinstance(p, Partial):
            raise PlanError(f"{where}: Partial on mesh dim {_dim_name(mesh, i)!r} is not a valid parameter placement")
        if isinstance(p, Shard):
            d = p.dim + ndim if p.dim < 0 else p.dim
            if not 0 <= d < ndim:
                raise PlanError(f"{where}: {p!r} on mesh dim {_dim_name(mesh, i)!r} names dim {p.dim} but the shape "
                                f"{tuple(shape)} has {ndim} dim(s)")
            divisors[d] *= mesh.size(i) * _shard_divisor(p)
            culprits[d].append(f"{p!r} on mesh dim {_dim_name(mesh, i)!r} of size {mesh.size(i)}")
    for d, k in enumerate(divisors):
        if shape[d] % k:
            raise PlanError(f"{where}: dim {d} of shape {tuple(shape)} has size {shape[d]}, which does not divide "
                            f"into {k} equal shards ({'; '.join(culprits[d])})")


def _decide_parameters(module: nn.Module, mesh, section: Mapping[str, Any], mesh_desc: str) -> dict[int, tuple]:
    """``{id(param): (fqns, placements, pattern)}`` for every parameter; tied parameters must agree."""
    named = list(module.named_parameters(remove_duplicate=False))
    matches = match_plan(section, [fqn for fqn, _ in named], what="plan section 'parameter'")
    replicate = tuple(Replicate() for _ in range(mesh.ndim))
    decisions: dict[int, tuple] = {}
    for fqn, param in named:
        match = matches.get(fqn)
        if match is not None:
            where = f"plan section 'parameter', entry {match.pattern!r} for {fqn!r} (shape {tuple(param.shape)})"
            placements = _check_placements(match.value, mesh, where=where, mesh_desc=mesh_desc)
            _check_param_placements(placements, param.shape, mesh, where=where)
            pattern = match.pattern
        else:
            placements, pattern = replicate, None
        if isinstance(param, DTensor):
            raise PlanError(f"parameter {fqn!r} is already a DTensor on {param.device_mesh}; parallelize a module once")
        seen = decisions.get(id(param))
        if seen is None:
            decisions[id(param)] = ([fqn], placements, pattern)
            continue
        if seen[1] != placements:
            raise PlanError(f"parameters {seen[0][0]!r} and {fqn!r} are the same (tied) Parameter of shape "
                            f"{tuple(param.shape)} but the plan gives them {list(seen[1])} (from {seen[2]!r}) and "
                            f"{list(placements)} (from {pattern!r})")
        seen[0].append(fqn)
    return decisions


def _decide_boundaries(module: nn.Module, section: Mapping[str, Any], name: str) -> dict[str, tuple[str, Any]]:
    """``{module_fqn: (pattern, arguments)}`` for one checked boundary section (module patterns, first wins)."""
    fqns = [fqn for fqn, _ in module.named_modules()]
    matches = match_plan(section, fqns, what=f"plan section {name!r} (module patterns)")
    return {fqn: (m.pattern, m.value) for fqn, m in matches.items()}


# ---------------------------------------------------------------------------------------------------------------
# Applying it
# ---------------------------------------------------------------------------------------------------------------


def _distribute_state(module: nn.Module, mesh, decisions: dict[int, tuple], report: PlanReport) -> None:
    """Replace parameters (as planned) and buffers (replicated) by DTensors; tied parameters stay tied.

    A module built by :func:`vescale.dtensor.deferred_init` is materialised straight into local shards (each rank
    computes only its slice, bitwise equal to the single-device init under vescale's RNG); an eager module's tensors
    are distributed from mesh coordinate 0.
    """
    by_fqn = {fqn: (placements, pattern) for fqns, placements, pattern in decisions.values() for fqn in fqns}
    replicate = tuple(Replicate() for _ in range(mesh.ndim))
    if is_deferred(module):
        materialize(module, mesh, {fqn: list(placements) for fqn, (placements, _) in by_fqn.items()})
    new_params: dict[int, nn.Parameter] = {}
    for mod_fqn, mod in module.named_modules(remove_duplicate=False):
        prefix = f"{mod_fqn}." if mod_fqn else ""
        for name, param in list(mod.named_parameters(recurse=False, remove_duplicate=False)):
            if param is None:
                continue
            placements, pattern = by_fqn[prefix + name]
            if id(param) not in new_params:
                if isinstance(param, DTensor):  # materialised from deferred init
                    new = param if isinstance(param, nn.Parameter) else nn.Parameter(param, param.requires_grad)
                else:
                    dt = distribute_tensor(param.detach(), mesh, placements)
                    new = nn.Parameter(dt, requires_grad=param.requires_grad)
                if new.requires_grad:
                    new.register_post_accumulate_grad_hook(_grad_to_param_placements)
                new_params[id(param)] = new
            setattr(mod, name, new_params[id(param)])
            report.entries.append(PlanEntry("parameter", prefix + name, tuple(param.shape),
                                            format_placements(placements), pattern))
        for name, buf in list(mod.named_buffers(recurse=False, remove_duplicate=False)):
            if buf is None:
                continue
            if not isinstance(buf, DTensor):
                setattr(mod, name, distribute_tensor(buf, mesh, replicate))
            report.entries.append(PlanEntry("buffer", prefix + name, tuple(buf.shape), format_placements(replicate),
                                            None))


def _grad_to_param_placements(param: torch.Tensor) -> None:
    """Post-accumulate-grad hook: bring ``param.grad`` (often ``Partial``) to the parameter's placements.
    Idempotent: a gradient already laid out as its parameter is left alone."""
    grad = param.grad
    if isinstance(grad, DTensor) and tuple(grad.placements) != tuple(param.placements):
        param.grad = grad.redistribute(param.device_mesh, param.placements)


class _GradPlacementHooks:
    """Keeps :func:`_grad_to_param_placements` running for the DTensor parameters ``parallelize_module`` made, also
    after ``module.to(dtype or device)`` swapped them (``torch.utils.swap_tensors``: the Parameter object keeps its
    post-accumulate-grad hook dict, but autograd's hook stays with the old tensor and never runs again).

    At each outermost forward of the root, :meth:`refresh` hooks the gradient-accumulator node of each such parameter
    whose node is not the one hooked before (the first forward, or after a swap), as DDP hooks nodes, and holds the
    node so that the forward's graph uses it. The hook is idempotent, so a parameter whose own post-accumulate-grad
    hook still runs is redistributed once. Nodes are taken at forward time, not here, so that no node keeps alive a
    parameter that ``fully_shard`` (or anything) replaces before training starts.
    """

    def __init__(self, fqns: set[str]) -> None:
        self.fqns = frozenset(fqns)
        self.nodes: dict[str, Any] = {}  # FQN -> the gradient-accumulator node hooked for it

    def refresh(self, module: nn.Module) -> None:
        if not torch.is_grad_enabled() or torch.compiler.is_compiling():
            return  # no backward will follow this forward; or dynamo traces the root (autograd nodes are eager's)
        for fqn, param in module.named_parameters():
            if fqn not in self.fqns or not isinstance(param, DTensor) or not param.requires_grad:
                continue
            node = get_gradient_edge(param).node
            if self.nodes.get(fqn) is not node:
                node.register_hook(functools.partial(_node_grad_hook, param))
                self.nodes[fqn] = node


def _node_grad_hook(param: torch.Tensor, grad_inputs: Any, grad_outputs: Any) -> None:
    """A gradient-accumulator node's post hook (autograd has accumulated into ``param.grad``)."""
    _grad_to_param_placements(param)


class _RootState:
    """Per-root bookkeeping: the factory-capture mode is entered on the outermost call only."""

    def __init__(self, mesh, aten: bool, outputs_by_key: bool, grad_hooks: _GradPlacementHooks) -> None:
        self.mesh, self.aten = mesh, aten
        self.outputs_by_key = outputs_by_key  # the root's output entry names outputs by key
        self.depth = 0
        self.mode: FactoryCapture | None = None
        self.as_tuple = False  # this call asked for return_dict=False; the outputs are named by key meanwhile
        self.grad_hooks = grad_hooks


def _install_hooks(module: nn.Module, mesh, inputs: dict, outputs: dict, local: dict, report: PlanReport) -> None:
    mods = dict(module.named_modules())
    fast = FastPathContext()  # the fast path's state for this model: its blocks and the hooks below share it
    for fqn, (key, spec) in local.items():
        report.entries.append(PlanEntry("local", fqn, (), format_placements(spec), key))
        make_local(mods[fqn], mesh, spec, outputs.get(fqn, (None, None))[1], fqn)
    for fqn, (key, spec) in inputs.items():
        report.entries.append(PlanEntry("input", fqn, (), format_placements(spec), key))
        if fqn != "":
            mods[fqn].register_forward_pre_hook(
                functools.partial(_input_hook, mesh=mesh, spec=spec, fqn=fqn, fast=fast), with_kwargs=True)
    for fqn, (key, spec) in outputs.items():
        report.entries.append(PlanEntry("output", fqn, (), format_placements(spec), key))
        if fqn != "" and fqn not in local:
            mods[fqn].register_forward_hook(
                functools.partial(_output_hook, mesh=mesh, spec=spec, fqn=fqn, fast=fast))
    install_fast_path(module, mesh, inputs, outputs, local, fast, _apply_outputs)
    # a root that runs an exported graph (a pipeline stage) calls aten factories directly; others call torch.*
    runs_graph = any(isinstance(v, torch.fx.GraphModule) for v in (module, *vars(module).values()))
    hooked = {fqn for fqn, p in module.named_parameters() if isinstance(p, DTensor) and p.requires_grad}
    state = _RootState(mesh, aten=runs_graph, outputs_by_key=isinstance(outputs.get("", (None, None))[1], dict),
                       grad_hooks=_GradPlacementHooks(hooked))
    module.register_forward_pre_hook(
        functools.partial(_root_pre_hook, state=state, spec=inputs.get("", (None, None))[1]), with_kwargs=True)
    module.register_forward_hook(
        functools.partial(_root_post_hook, state=state, spec=outputs.get("", (None, None))[1]), always_call=True)


def _convert(x: Any, mesh, placements, *, where: str) -> Any:
    """Bring one argument/output to ``placements`` (``None``: leave it); plain tensors count as local pieces."""
    if placements is None or x is None:
        return x
    if isinstance(x, DTensor):
        if x.device_mesh != mesh:
            raise PlanError(f"{where} is a DTensor on {x.device_mesh}, not on the plan's mesh {mesh}")
        if tuple(x.placements) == tuple(placements):
            return x
        if not (x.requires_grad and torch.is_grad_enabled()):
            return _redistribute(x, mesh, tuple(placements))
        return _Redistribute.apply(x, tuple(placements))
    if isinstance(x, torch.Tensor):
        if not x.requires_grad:  # token ids, masks, positions: no autograd node needed (every decode step has them)
            return from_local_nograd(x, mesh, tuple(placements))
        return DTensor.from_local(x, mesh, placements, run_check=False)
    if isinstance(x, dict) and all(isinstance(v, torch.Tensor) or v is None for v in x.values()):
        # one entry per kind of layer (HF generate() with a static cache passes attention_mask as
        # {"full_attention": mask, "sliding_attention": mask}): each is laid out as the plan says
        return {k: _convert(v, mesh, placements, where=f"{where}[{k!r}]") for k, v in x.items()}
    raise PlanError(f"{where} is a {type(x).__name__}, not a tensor, but the plan gives it placements "
                    f"{format_placements(placements)}")


def _redistribute(x: DTensor, mesh, placements: tuple) -> DTensor:
    # torch's redistribution code calls factories (torch.arange for interleaved offsets): they must stay plain
    with capture_suspended():
        return _redistribute_uncaptured(x, mesh, placements)


def _redistribute_uncaptured(x: DTensor, mesh, placements: tuple) -> DTensor:
    if mesh.ndim > 1 and any(isinstance(p, Partial) and type(p) is not Partial for p in x.placements):
        # torch mis-applies the embedding's masked-partial layout when one redistribute also changes other mesh
        # dims (it reshards the batch before applying the mask): reduce it on its own dim first.
        x = x.redistribute(mesh, [Replicate() if isinstance(p, Partial) else p for p in x.placements])
    return x.redistribute(mesh, placements)


class _Redistribute(torch.autograd.Function):
    """A boundary redistribution whose backward goes straight from the incoming gradient to the source layout.

    Activations stay DTensors, so the gradient reaching a boundary is often ``Partial`` (the sum of a
    column-parallel input's contributions). torch's own ``redistribute`` backward first brings it to the *target*
    layout (an all-reduce to ``Replicate``) and then to the source; going directly costs one reduce-scatter for an
    all-gathered (sequence-parallel) input, as in Megatron and torch's TP, and never asks torch to turn ``Partial``
    into the embedding's masked-partial layout (which it cannot): a partial source gets a ``Replicate`` gradient.
    """

    @staticmethod
    def forward(ctx, x: DTensor, placements: tuple) -> DTensor:
        ctx.mesh = x.device_mesh
        ctx.src = tuple(Replicate() if isinstance(p, Partial) else p for p in x.placements)
        return _redistribute(x, x.device_mesh, placements)

    @staticmethod
    def backward(ctx, grad: DTensor):
        if isinstance(grad, DTensor) and tuple(grad.placements) != ctx.src:
            grad = grad.redistribute(ctx.mesh, ctx.src)
        return grad, None


def _apply_args(args: tuple, kwargs: dict, spec, mesh, fqn: str) -> tuple[tuple, dict]:
    name = f"module {fqn!r}" if fqn else "the root module"
    if isinstance(spec, dict):
        kwargs = dict(kwargs)
        for key, placements in spec.items():
            if key in kwargs:
                kwargs[key] = _convert(kwargs[key], mesh, placements, where=f"keyword argument {key!r} of {name}")
        return args, kwargs
    args = list(args)
    for i, placements in enumerate(spec):
        if i < len(args):
            args[i] = _convert(args[i], mesh, placements, where=f"positional argument {i} of {name}")
    return tuple(args), kwargs


def _apply_outputs(out: Any, spec, mesh, fqn: str) -> Any:
    name = f"module {fqn!r}" if fqn else "the root module"
    if isinstance(spec, dict):
        if not isinstance(out, Mapping):
            raise PlanError(f"the plan gives {name} outputs by key {list(spec)} but it returned {type(out).__name__}")
        for key, placements in spec.items():
            if key in out:
                out[key] = _convert(out[key], mesh, placements, where=f"output {key!r} of {name}")
        return out
    if isinstance(out, torch.Tensor):
        if len(spec) != 1:
            raise PlanError(f"the plan gives {len(spec)} outputs for {name} but it returned one tensor")
        return _convert(out, mesh, spec[0], where=f"the output of {name}")
    if isinstance(out, (tuple, list)):
        if len(spec) > len(out):
            raise PlanError(f"the plan gives {len(spec)} outputs for {name} but it returned {len(out)}")
        items = list(out)
        for i, placements in enumerate(spec):
            items[i] = _convert(items[i], mesh, placements, where=f"output {i} of {name}")
        return type(out)(items) if isinstance(out, list) else tuple(items)
    raise PlanError(f"the plan gives placements for the outputs of {name} but it returned {type(out).__name__}")


def _input_hook(module: nn.Module, args: tuple, kwargs: dict, *, mesh, spec, fqn: str, fast: FastPathContext):
    if fast.depth:  # plain local tensors inside a fast block; the block applies its boundaries itself
        return None
    return _apply_args(args, kwargs, spec, mesh, fqn)


def _output_hook(module: nn.Module, args: tuple, out: Any, *, mesh, spec, fqn: str, fast: FastPathContext):
    if fast.depth:
        return None
    return _apply_outputs(out, spec, mesh, fqn)


def _root_pre_hook(module: nn.Module, args: tuple, kwargs: dict, *, state: _RootState, spec):
    alone: set = set()  # arguments the root entry explicitly leaves alone (None): they stay plain
    if spec is not None:
        args, kwargs = _apply_args(args, kwargs, spec, state.mesh, "")
        alone = {k for k, v in (spec.items() if isinstance(spec, dict) else enumerate(spec)) if v is None}
    replicate = [Replicate()] * state.mesh.ndim

    def default(key: Any, x: Any) -> Any:
        return _convert(x, state.mesh, replicate, where="") if _is_plain(x) and key not in alone else x

    args = tuple(default(i, a) for i, a in enumerate(args))
    kwargs = {k: default(k, v) for k, v in kwargs.items()}
    state.depth += 1
    if state.depth == 1:
        state.grad_hooks.refresh(module)  # (re-)hook parameters a module.to() swapped since the last forward
        # Hugging Face's return_dict=False returns ModelOutput.to_tuple(): ask for the ModelOutput so that a plan
        # naming outputs by key ("logits") applies, and turn it into the tuple on the way out.
        state.as_tuple = state.outputs_by_key and kwargs.get("return_dict") is False
        if state.as_tuple:
            kwargs["return_dict"] = True
        state.mode = FactoryCapture(state.mesh, aten=state.aten)
        state.mode.__enter__()
    return args, kwargs


def _root_post_hook(module: nn.Module, args: tuple, out: Any, *, state: _RootState, spec):
    state.depth -= 1
    if state.depth == 0 and state.mode is not None:
        mode, state.mode = state.mode, None
        mode.__exit__(None, None, None)
    if out is None:
        return None
    planned: dict = {}
    if spec is not None:
        out = _apply_outputs(out, spec, state.mesh, "")
        planned = dict(spec.items() if isinstance(spec, dict) else enumerate(spec))
    out = _to_boundary(out, planned)
    if state.depth == 0 and state.as_tuple and hasattr(out, "to_tuple"):
        state.as_tuple = False
        out = out.to_tuple()
    return out


def _is_plain(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and not isinstance(x, DTensor)


def _boundary_one(x: Any, key: Any, planned: dict) -> Any:
    """One root output: kept as a DTensor (entry ``None``), local piece (entry given), or full tensor (no entry).

    Tuples and lists (``hidden_states``) and nested mappings get the default for each element; other objects (a KV
    cache holding DTensors, fed back on the next call) pass unchanged.
    """
    if key in planned and isinstance(x, DTensor):
        return x if planned[key] is None else x.to_local()
    if isinstance(x, DTensor):
        return _redistribute(x, x.device_mesh, (Replicate(),) * x.device_mesh.ndim).to_local()
    if isinstance(x, (tuple, list, Mapping)):
        return _to_boundary(x, {})
    return x


def _to_boundary(out: Any, planned: dict) -> Any:
    """Root outputs as plain tensors (see :func:`parallelize_module`); ``planned`` maps output keys to entries."""
    if isinstance(out, torch.Tensor):
        return _boundary_one(out, 0, planned)
    if isinstance(out, Mapping):
        for key in list(out.keys()):
            out[key] = _boundary_one(out[key], key, planned)
        return out
    if isinstance(out, (tuple, list)):
        items = [_boundary_one(x, i, planned) for i, x in enumerate(out)]
        return type(out)(items) if isinstance(out, list) else tuple(items)
    return out
