"""Expert parallelism: the experts of a mixture-of-experts model distributed over the ``ep`` mesh dim.

:func:`parallelize_experts` takes an unmodified model whose MoE blocks have the Hugging Face shape (Mixtral,
Qwen2-MoE, Qwen3-MoE, ...): a *router* returning ``(router_logits, top_k_weights, top_k_index)`` and an *experts*
module called as ``experts(hidden_states [N, D], top_k_index [N, k], top_k_weights [N, k]) -> [N, D]`` whose own
parameters are stacked per expert (``gate_up_proj [E, ...]``, ``down_proj [E, ...]``). Expert modules are found from
the model's structure (:func:`find_experts`), not from class names.

The layout (what each rank holds and computes):

- ``ep`` is a data dim for everything outside the experts: each ep rank runs the model on its own part of the batch
  (activations ``Shard(0)`` on ``ep``, like ``dp``), and dense parameters are replicated there, their gradients
  summed over ``ep`` by DTensor as over ``dp``.
- Each expert parameter is a DTensor ``Shard(0)`` on ``ep``: rank ``r`` holds experts ``[r*E/ep, (r+1)*E/ep)``. The
  vescale checkpoint sees the global ``[E, ...]`` tensor, so a checkpoint saved on one ep size loads on another, or
  on one process into the plain model.
- The experts module runs on local tensors (a ``local`` entry of the plan, see :mod:`.local`). Its forward sends each
  (token, choice) pair to the rank holding its expert with one variable-split ``all_to_all_single`` over ``ep``, runs
  the module's *own* forward on the received tokens with this rank's experts, sends the results back with a second
  all-to-all, and sums them weighted by the router's weights. Backward runs the two all-to-alls in reverse, so each
  expert's gradient gathers every ep rank's tokens. By default no token is dropped.
- ``capacity_factor=cf`` (a separate mode, off by default): each expert takes at most ``C = ceil(cf * N * k / E)``
  of the ``N`` tokens of each rank's batch (``k`` choices per token, ``E`` experts), decided on that rank before
  any communication (:func:`capacity_keep`). The order is deterministic: a rank's (token, choice) pairs are ranked
  choice-major (every token's first choice, in token order, before any second choice), and each expert keeps the
  first ``C`` pairs that chose it. A dropped pair is neither sent nor computed; it adds nothing to its token's output
  (the other choices keep their router weights, not renormalised) and gets no gradient, as if its router weight
  were zero; the block's residual connection carries the token on.
- Routing (top-k, softmax, normalisation, the load-balancing loss and its coefficient) is the model's own code,
  run on DTensors over the global batch, so it is what one device computes on the whole batch.
- Expert gradients are reduced over ``dp`` (the ranks holding the same experts), never over ``ep``. With vescale's
  DDP / ZeRO instead of a DTensor ``dp`` dim: parallelize over the ``ep`` (and ``tp``) sub-mesh and wrap the model in
  ``DistributedDataParallel(model, mesh)`` over the whole dp x ep mesh, which reduces the dense gradients over dp x ep
  and the experts' over dp, bucketed (see :mod:`vescale.parallel.ddp`).

Other mesh dims compose through the plan given for the dense part (any plan of
:func:`~vescale.parallel.parallelize_module` over the same mesh, e.g. ``mixtral_plan(mesh)`` for TP on attention and
TP inside each expert): :func:`expert_parallel_plan` adds ``Shard(0)`` on ``ep`` to the plan's activation placements
and expert parameters.
"""

from __future__ import annotations

import contextlib
import functools
import math
import re
import weakref
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from vescale.core.torch_internals import set_own_parameters
from vescale.parallel.collectives import OP_STATES, op_state
from vescale.parallel.collectives import AllToAll as _AllToAll  # the dispatch's all-to-alls
from vescale.parallel.collectives import all_to_all as _all_to_all
from vescale.parallel.errors import ExpertParallelError

__all__ = ["parallelize_experts", "expert_parallel_plan", "find_experts", "capacity_keep", "ExpertsInfo",
           "ExpertParallelError", "experts_as_operator", "keep_local_experts"]



#: The keyword arguments a Hugging Face causal LM takes per example (batch dim 0): the default root boundary.
_HF_BATCH_KWARGS = ("input_ids", "labels", "attention_mask", "position_ids")


class ExpertsInfo:
    """One experts module found in a model: its FQN, the module, its number of experts and its parameters' names."""

    def __init__(self, fqn: str, module: nn.Module, num_experts: int, params: list[str]) -> None:
        self.fqn, self.module, self.num_experts, self.params = fqn, module, num_experts, params

    def __repr__(self) -> str:
        return f"ExpertsInfo({self.fqn!r}, num_experts={self.num_experts}, params={self.params})"


def find_experts(model: nn.Module) -> list[ExpertsInfo]:
    """The experts modules of ``model``, found by structure.

    An experts module owns (directly, not through children) parameters that all have >= 3 dims and the same leading
    size ``E >= 2`` (one slice per expert), and its parent has a router: another child module owning a 2-D weight of
    shape ``[E, hidden]``. Pure; no collective.
    """
    found = []
    modules = dict(model.named_modules())
    for fqn, mod in modules.items():
        own = list(mod.named_parameters(recurse=False))
        if not own or any(p.dim() < 3 for _, p in own):
            continue
        sizes = {p.shape[0] for _, p in own}
        if len(sizes) != 1 or next(iter(sizes)) < 2:
            continue
        num = next(iter(sizes))
        parent_fqn, _, name = fqn.rpartition(".")
        parent = modules.get(parent_fqn) if fqn else None
        if parent is None or not _has_router(parent, name, num):
            continue
        found.append(ExpertsInfo(fqn, mod, num, [f"{fqn}.{n}" for n, _ in own]))
    return found


def _has_router(parent: nn.Module, experts_name: str, num: int) -> bool:
    for name, child in parent.named_children():
        if name == experts_name:
            continue
        for _, p in child.named_parameters(recurse=False):
            if p.dim() == 2 and p.shape[0] == num:
                return True
    return False


# ---------------------------------------------------------------------------------------------------------------
# The plan
# ---------------------------------------------------------------------------------------------------------------


def _is_placements(value: Any, ndim: int) -> bool:
    return (isinstance(value, (list, tuple)) and len(value) == ndim
            and all(isinstance(p, Placement) for p in value))


def _batch_on_ep(placements, i_ep: int) -> list[Placement]:
    """An activation's placements with the batch (dim 0) sharded on ``ep`` where the plan replicated it."""
    out = list(placements)
    if isinstance(out[i_ep], Replicate):
        out[i_ep] = Shard(0)
    return out


def _map_arguments(value: Any, fn, ndim: int) -> Any:
    """Apply ``fn`` to every placements list of a boundary entry (a list or dict of placements-or-None)."""
    if isinstance(value, Mapping):
        return {k: (fn(v) if _is_placements(v, ndim) else v) for k, v in value.items()}
    return [fn(v) if _is_placements(v, ndim) else v for v in value]


def _first_match(section: Mapping, fqn: str):
    for pattern, value in section.items():
        if re.fullmatch(pattern, fqn):
            return value
    return None


def expert_parallel_plan(model: nn.Module, mesh, plan: Mapping | None = None, *, ep: str = "ep", dp: str = "dp",
                         experts: list[ExpertsInfo] | None = None) -> dict:
    """``plan`` (a :func:`~vescale.parallel.parallelize_module` plan over ``mesh``, or None: everything replicated
    but the batch, which is sharded on ``dp`` when the mesh has it) with expert parallelism over mesh dim ``ep``
    added; pure (no collective, ``plan`` is not changed).

    - every ``input``/``output``/``local`` placements list that replicates ``ep`` shards the batch (dim 0) there;
    - each expert parameter is ``Shard(0)`` on ``ep``, keeping the plan's placements on the other dims;
    - each experts module gets a ``local`` entry (the plan's own if it has one; by default each rank's local
      gradients are the arguments' own placements) and an ``output`` entry (default: the batch placements);
    - the root gets the Hugging Face keyword boundary (``input_ids``, ``labels``, ``attention_mask``,
      ``position_ids`` in, ``logits`` out, all batch-sharded) when the plan has no root entry.

    Raises :class:`~vescale.parallel.errors.ExpertParallelError` when the mesh has no ``ep`` dim, the model has no
    experts, or ``ep`` does not divide an experts module's number of experts.
    """
    names = tuple(mesh.mesh_dim_names or ())
    if ep not in names:
        raise ExpertParallelError(f"expert parallelism wants mesh dim {ep!r} but the mesh has dims {list(names)}")
    i_ep, ndim, size = names.index(ep), mesh.ndim, mesh.size(names.index(ep))
    experts = find_experts(model) if experts is None else experts
    if not experts:
        raise ExpertParallelError(
            f"{type(model).__name__} has no experts module: expected a module owning parameters stacked per expert "
            f"([E, ...], >= 3 dims) beside a router owning a [E, hidden] weight")
    for info in experts:
        if info.num_experts % size:
            raise ExpertParallelError(f"{info.fqn} has {info.num_experts} experts, not divisible by mesh dim {ep!r} "
                                      f"of size {size}")
    if plan is None:
        plan = {}
        if dp in names and dp != ep:
            batch = [Shard(0) if n == dp else Replicate() for n in names]
            plan["input"] = {"": {k: batch for k in _HF_BATCH_KWARGS}}
            plan["output"] = {"": {"logits": batch}}
    plan = dict(plan)
    batch = _batch_on_ep([Replicate()] * ndim, i_ep)
    root_in = (plan.get("input") or {}).get("")
    if root_in is not None:
        first = next((v for v in (root_in.values() if isinstance(root_in, Mapping) else root_in)
                      if _is_placements(v, ndim)), None)
        if first is not None:
            batch = _batch_on_ep(first, i_ep)
    fix = functools.partial(_batch_on_ep, i_ep=i_ep)

    params: dict[str, Any] = {}
    base_params = plan.get("parameter") or {}
    for info in experts:
        for fqn in info.params:
            placements = list(_first_match(base_params, fqn) or [Replicate()] * ndim)
            placements[i_ep] = Shard(0)
            params[re.escape(fqn)] = placements
    for pattern, value in base_params.items():  # an exact entry of an expert (lora_plan's) is the one above, ep added
        params.setdefault(pattern, value)

    sections: dict[str, dict] = {}
    for section in ("input", "output", "local"):
        sections[section] = {k: _map_arguments(v, fix, ndim) for k, v in (plan.get(section) or {}).items()}
    for info in experts:
        key = re.escape(info.fqn)
        if _first_match(sections["local"], info.fqn) is None:
            sections["local"] = {key: [None, None, None], **sections["local"]}
        if _first_match(sections["output"], info.fqn) is None:
            sections["output"] = {key: [batch], **sections["output"]}
    if "" not in sections["input"]:
        sections["input"][""] = {k: batch for k in _HF_BATCH_KWARGS}
    if "" not in sections["output"]:
        sections["output"][""] = {"logits": batch}
    return {"parameter": params, **sections}


# ---------------------------------------------------------------------------------------------------------------
# Token dispatch
# ---------------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _num_experts(module: nn.Module, num: int):
    """The experts module's ``num_experts`` attribute (its forward sizes one-hot masks by it) set to ``num``."""
    if not hasattr(module, "num_experts"):
        yield
        return
    saved = module.num_experts
    module.num_experts = num
    try:
        yield
    finally:
        module.num_experts = saved


def capacity_keep(top_k_index: torch.Tensor, num_experts: int, capacity_factor: float) -> torch.Tensor:
    """Which (token, choice) pairs of one rank's batch its experts take under ``capacity_factor``: a bool ``[N, k]``.

    ``top_k_index [N, k]`` holds the experts the router chose for this rank's ``N`` tokens. Each expert takes at most
    ``C = ceil(capacity_factor * N * k / num_experts)`` pairs, the first ``C`` that chose it in choice-major order
    (all first choices in token order, then all second choices, ...). Local and deterministic; no collective.
    """
    n, k = top_k_index.shape
    capacity = math.ceil(capacity_factor * n * k / num_experts)
    by_priority = top_k_index.t().reshape(-1)  # pair j * N + t: token t's choice j
    order = torch.argsort(by_priority, stable=True)  # grouped by expert, priority order within each expert
    counts = torch.bincount(by_priority, minlength=num_experts)
    first = torch.cumsum(counts, 0) - counts  # where each expert's group starts in ``order``
    slot = torch.arange(order.numel(), device=order.device) - first[by_priority[order]]
    keep = torch.empty_like(by_priority, dtype=torch.bool)
    keep[order] = slot < capacity
    return keep.view(k, n).t()


def _ep_forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, *,
                orig, module: nn.Module, num_experts: int, group,
                capacity_factor: float | None = None) -> torch.Tensor:
    """The experts' forward on this rank's tokens (plain tensors), with the experts spread over ``group``.

    ``hidden_states [N, D]``, ``top_k_index [N, k]`` (global expert ids) and ``top_k_weights [N, k]`` are this rank's
    tokens; the module's own parameters are this rank's ``E / ep`` experts. With ``capacity_factor`` only the pairs
    :func:`capacity_keep` keeps are dispatched. Issues three ``all_to_all_single`` over ``group`` in forward (counts,
    expert ids, tokens) and one more to return the results; two in backward.
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    per_rank = num_experts // world
    n, k = top_k_index.shape
    flat = top_k_index.reshape(-1)
    if capacity_factor is None:
        order = torch.argsort(flat, stable=True)  # (token, choice) pairs grouped by expert, so by destination rank
    else:
        kept = torch.nonzero(capacity_keep(top_k_index, num_experts, capacity_factor).reshape(-1)).squeeze(1)
        order = kept[torch.argsort(flat[kept], stable=True)]
    expert = flat[order]
    token = torch.div(order, k, rounding_mode="floor")
    send = torch.bincount(torch.div(expert, per_rank, rounding_mode="floor"), minlength=world)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    send_splits, recv_splits = send.tolist(), recv.tolist()
    recv_expert = _all_to_all(expert, recv_splits, send_splits, group)

    x = _AllToAll.apply(hidden_states[token], recv_splits, send_splits, group)
    local_index = (recv_expert - rank * per_rank).unsqueeze(1)
    ones = torch.ones(local_index.shape, dtype=top_k_weights.dtype, device=x.device)
    with _num_experts(module, per_rank):
        y = orig(x, local_index, ones)
    # Keep every rank's graph the same shape: a rank that received no token (or whose experts were not hit) still
    # links its output to its input and its expert weights, so both all-to-alls run backward on every rank and
    # every expert weight gets a (zero) gradient, as on one device where unhit experts get zeros.
    y = y + x[:0].sum()
    for p in module.parameters(recurse=False):
        y = y + p.reshape(-1)[:0].sum()
    back = _AllToAll.apply(y, send_splits, recv_splits, group)
    weights = top_k_weights.reshape(-1)[order].unsqueeze(1)
    # Combine in the weighted outputs' precision (bf16 outputs x fp32 router weights: fp32) and round once, as Hugging
    # Face's grouped experts sum a token's choices; a bf16 index_add would round each choice and then their sum, a
    # one-ulp difference per token that, fed to the next router, flips near-tied top-k choices (measured with bf16
    # Mixtral on dp2 x ep2: one token switched in the last layer, whose gradients were up to 9% off one device's).
    weighted = back * weights
    out = torch.zeros(hidden_states.shape, dtype=weighted.dtype, device=hidden_states.device)
    return out.index_add(0, token, weighted).to(hidden_states.dtype)


#: Experts modules whose forward dispatches over ep (a second parallelize_experts is refused).
_DISTRIBUTED: weakref.WeakSet = weakref.WeakSet()


def _install_dispatch(info: ExpertsInfo, group, capacity_factor: float | None) -> None:
    module = info.module
    _DISTRIBUTED.add(module)
    orig = module.forward
    module.forward = functools.partial(_ep_forward, orig=orig, module=module, num_experts=info.num_experts,
                                       group=group, capacity_factor=capacity_factor)


# ---------------------------------------------------------------------------------------------------------------
# The dispatch as one operator (pipelines: torch.export keeps it a single node)
# ---------------------------------------------------------------------------------------------------------------


class _OpSetup:
    """What one experts module's operator needs besides its tensors (an operator takes no module or group)."""

    def __init__(self, module: nn.Module, names: list[str], num_experts: int, group, capacity_factor) -> None:
        # a shallow copy whose own parameters are filled per call: the operator is handed the tensors, so neither the
        # model's (possibly meta or whole) weights nor a later replacement of them is kept alive here
        self.template = _shallow_template(module, names)
        self.forward = type(module).forward
        self.names, self.num_experts, self.group, self.capacity_factor = names, num_experts, group, capacity_factor


def _shallow_template(module: nn.Module, names: list[str]) -> nn.Module:
    import copy

    template = copy.copy(module)
    set_own_parameters(template, dict.fromkeys(names))
    template.__dict__.pop("forward", None)
    return template


#: int key (an operator argument) -> _OpSetup, one per experts module given to :func:`experts_as_operator`: the
#: registry every vescale custom operator finds its state in (``key = len(_OP_SETUPS); _OP_SETUPS[key] = setup``).
_OP_SETUPS = OP_STATES


def _run_op(key: int, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
            params: list[torch.Tensor]) -> torch.Tensor:
    """:func:`_ep_forward` with the experts module's own forward on ``params`` (this rank's experts)."""
    setup = op_state(key)
    template = setup.template
    set_own_parameters(template, dict(zip(setup.names, params)))
    try:
        return _ep_forward(hidden, top_k_index, top_k_weights, orig=functools.partial(setup.forward, template),
                           module=template, num_experts=setup.num_experts, group=setup.group,
                           capacity_factor=setup.capacity_factor)
    finally:
        set_own_parameters(template, dict.fromkeys(setup.names))


@torch.library.custom_op("vescale::ep_experts", mutates_args=())
def _ep_experts(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                params: list[torch.Tensor], key: int) -> torch.Tensor:
    """The experts' output ``[N, D]`` for this rank's tokens (see :func:`_ep_forward`); ``params``: this rank's."""
    with torch.no_grad():
        return _run_op(key, hidden, top_k_index, top_k_weights, params)


@_ep_experts.register_fake
def _(hidden, top_k_index, top_k_weights, params, key):
    return torch.empty_like(hidden)


def _ep_experts_setup(ctx, inputs, output):
    hidden, top_k_index, top_k_weights, params, key = inputs
    ctx.save_for_backward(hidden, top_k_index, top_k_weights, *params)
    ctx.key = key


def _ep_experts_backward(ctx, grad_out):
    """Re-runs the dispatch with autograd (its three forward all-to-alls and the experts' FFN on the received
    tokens, as activation checkpointing would), then backpropagates through it (two more all-to-alls): the saved
    tensors of the forward have data-dependent sizes that an operator's outputs cannot carry through the capture."""
    hidden, top_k_index, top_k_weights, *params = ctx.saved_tensors
    leaves = [t.detach().requires_grad_() for t in (hidden, top_k_weights, *params)]
    with torch.enable_grad():
        out = _run_op(ctx.key, leaves[0], top_k_index, leaves[1], leaves[2:])
        grads = torch.autograd.grad(out, leaves, grad_out, allow_unused=True)
    grads = [torch.zeros_like(t) if g is None else g for t, g in zip(leaves, grads)]
    return grads[0], None, grads[1], list(grads[2:]), None


_ep_experts.register_autograd(_ep_experts_backward, setup_context=_ep_experts_setup)


def _op_forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, *,
                module: nn.Module, key: int) -> torch.Tensor:
    """An experts module's forward under :func:`experts_as_operator`. (It holds its setup by key: the pipeline split
    deep-copies the model, and a process group is not copyable.)"""
    params = [getattr(module, n) for n in _OP_SETUPS[key].names]
    return _ep_experts(hidden_states, top_k_index, top_k_weights, params, key)


def _undistributed_experts(model: nn.Module, capacity_factor) -> list:
    """The experts of ``model`` (:func:`find_experts`), after checking ``capacity_factor`` (a positive number or None)
    and that none is distributed yet; raises :class:`ExpertParallelError` (local, before any collective)."""
    if capacity_factor is not None and not (isinstance(capacity_factor, (int, float)) and capacity_factor > 0):
        raise ExpertParallelError(f"capacity_factor must be a positive number or None, got {capacity_factor!r}")
    experts = find_experts(model)
    done = [e.fqn for e in experts if e.module in _DISTRIBUTED]
    if done:
        raise ExpertParallelError(f"the experts {done} are already distributed by parallelize_experts")
    return experts


def experts_as_operator(model: nn.Module, mesh, *, ep: str = "ep",
                        capacity_factor: float | None = None) -> list[ExpertsInfo]:
    """Make each experts module of ``model`` dispatch over mesh dim ``ep`` through one custom operator,
    ``vescale::ep_experts``, so that ``torch.export`` (the pipeline split of ``vescale.pipe``) keeps the whole
    dispatch as a single graph node; returns the experts found (:func:`find_experts`).

    For pipelines (pp x ep): call it before the split, then give each stage this rank's experts with
    :func:`keep_local_experts`. The layout is that of :func:`parallelize_experts` with plain tensors: each ep rank
    runs the stage on its own rows, holds ``E / ep`` experts (plain ``[E / ep, ...]`` parameters), and the operator
    sends each (token, choice) pair to its expert's rank and back (variable-split ``all_to_all_single`` over ``ep``;
    ``capacity_factor`` as there). Its backward re-runs the dispatch (three forward all-to-alls and the local expert
    FFN) and backpropagates through it (two all-to-alls): the forward's intermediate tensors have data-dependent sizes
    an operator cannot return through the capture. An expert's gradient is then the sum over every ep rank's loss of
    the tokens it took; dense parameters' gradients are each rank's own. With each rank backpropagating its share
    of the loss (its rows' mean / ep), ``DistributedDataParallel(module, mesh)`` (mesh with dp and ep) over the module
    after :func:`keep_local_experts` (which marks the experts as pieces over ep) makes both one device's: the dense
    gradients summed over ep (and averaged over dp), the experts' averaged over dp only.

    Raises :class:`ExpertParallelError` (before any collective) as :func:`parallelize_experts` does.
    """
    from vescale.core.mesh import dim_group

    experts = _undistributed_experts(model, capacity_factor)
    expert_parallel_plan(model, mesh, None, ep=ep, experts=experts)  # the same checks (mesh dim, divisibility)
    bad = [e.fqn for e in experts if "forward" in vars(e.module)]
    if bad:
        raise ExpertParallelError(f"the experts modules {bad} have a replaced forward; experts_as_operator runs "
                                  f"their class's own forward")
    group, _ = dim_group(mesh, ep)
    for info in experts:
        key = len(_OP_SETUPS)
        names = [fqn.rpartition(".")[2] for fqn in info.params]
        _OP_SETUPS[key] = _OpSetup(info.module, names, info.num_experts, group, capacity_factor)
        _DISTRIBUTED.add(info.module)
        info.module.forward = functools.partial(_op_forward, module=info.module, key=key)
    return experts


def keep_local_experts(module: nn.Module, experts: list[ExpertsInfo], mesh, *, ep: str = "ep") -> list[str]:
    """Replace each expert parameter of ``module`` (a pipeline stage, or the model; found by the FQNs of
    ``experts``) by this ep rank's experts, a plain ``Parameter`` ``[E / ep, ...]`` (rank ``r``: experts
    ``[r E / ep, (r + 1) E / ep)``); returns the FQNs replaced. ``module``'s parameters must be materialised, whole.
    Each is marked ``vescale.core.sharded_state.mark_piece(p, global_shape=[E, ...], offsets=(r E / ep, 0, ...),
    groups={ep: this rank's ep group})``: gradient clipping sums it over ep, DDP reduces it over dp only, ZeRO and
    checkpoints place it (and its optimizer state) at its rows of the global tensor. No collective."""
    from vescale.core.mesh import dim_group
    from vescale.core.sharded_state import mark_piece

    size, rank = mesh.size(mesh.mesh_dim_names.index(ep)), mesh.get_local_rank(ep)
    group, _ = dim_group(mesh, ep)
    owned = dict(module.named_parameters())
    done = []
    for info in experts:
        for fqn in info.params:
            if fqn not in owned:
                continue
            whole = owned[fqn]
            if whole.shape[0] != info.num_experts:
                raise ExpertParallelError(f"{fqn} has leading size {whole.shape[0]}, expected all "
                                          f"{info.num_experts} experts (keep_local_experts was already applied?)")
            per = info.num_experts // size
            local = nn.Parameter(whole.detach()[rank * per:(rank + 1) * per].clone(),
                                 requires_grad=whole.requires_grad)
            mark_piece(local, global_shape=tuple(whole.shape), offsets=(rank * per,) + (0,) * (whole.dim() - 1),
                       groups={ep: group})
            owner_fqn, _, leaf = fqn.rpartition(".")
            module.get_submodule(owner_fqn).register_parameter(leaf, local)
            done.append(fqn)
    return done


# ---------------------------------------------------------------------------------------------------------------
# The entry point
# ---------------------------------------------------------------------------------------------------------------


def parallelize_experts(module: nn.Module, mesh, plan: Mapping | None = None, *, ep: str = "ep",
                        dp: str = "dp", capacity_factor: float | None = None) -> nn.Module:
    """Distribute ``module``'s experts over mesh dim ``ep`` and parallelize the rest by ``plan``; return ``module``.

    ``mesh`` is the whole mesh (e.g. ``init_mesh("dp=2,ep=2,tp=2")``); ``plan`` is the plan for the dense part over
    it (``mixtral_plan(mesh)``, ``auto_plan``'s, a hand plan, or None to replicate everything but the experts and
    the batch, which is sharded on ``dp`` and ``ep``).
    Calls :func:`~vescale.parallel.parallelize_module` with :func:`expert_parallel_plan` (see the module docstring for
    the layout). Each rank then passes its own part of the batch (``Shard(0)`` over ``dp`` and ``ep``, in mesh
    order) and the model computes the single-device result over the whole batch: logits of this rank's examples,
    the loss and the load-balancing loss of the whole batch, and every parameter's gradient.

    ``dp`` names the data-parallel mesh dim the batch is sharded on when ``plan`` is None (a given plan says that
    itself). ``capacity_factor`` (None: no token dropped) caps the tokens each expert takes from each rank's batch
    (see the module docstring; a positive number). Errors (:class:`ExpertParallelError`,
    :class:`~vescale.core.errors.PlanError`) are raised on every rank before any collective; so is one for a model
    whose experts were already distributed.
    """
    from vescale.core.mesh import dim_group
    from vescale.parallel.parallelize import parallelize_module

    experts = _undistributed_experts(module, capacity_factor)
    full_plan = expert_parallel_plan(module, mesh, plan, ep=ep, dp=dp, experts=experts)
    group, _ = dim_group(mesh, ep)
    for info in experts:
        _install_dispatch(info, group, capacity_factor)
    return parallelize_module(module, mesh, full_plan)

