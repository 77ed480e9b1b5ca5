"""Grouped-query attention with fewer key/value heads than tp ranks: kv heads replicated over the ranks sharing them.

With ``h`` query heads, ``kv`` key/value heads and a tp dim of size ``n`` where ``kv < n`` and ``n % kv == 0``, rank
``i`` of the tp dim holds query heads ``[i h/n, (i+1) h/n)`` (``q_proj`` sharded by rows as usual), and those heads all
read key/value head ``g = i // r`` with ``r = n / kv`` ranks sharing each kv head. The layout:

* ``k_proj`` / ``v_proj`` (weights and biases) are ``Replicate`` on tp (the plans do this when given
  ``num_key_value_heads``; ``auto_plan`` decides it too). Every rank computes the (small) key/value projections of
  all ``kv`` heads; their gradients are the sum over the ranks (each rank's part is non-zero only in the rows of its
  own kv head, so this is the sum over the ``r`` ranks sharing a head).
* The KV cache holds **only this rank's kv head**: :func:`~vescale.parallel.parallelize_module` finds such modules in
  its plan (:func:`planned_kv_replicas`, before any collective) and wraps the cache each of them receives
  (:func:`install_kv_replicas`; :func:`replicate_kv_heads` does the same for a model parallelized otherwise, and is a
  no-op on modules already set up), so that ``cache.update`` stores keys/values as a DTensor ``Shard(1)`` on tp
  whose global value is the keys with every kv head repeated ``r`` times (``[B, n, S, d]``, a valid grouped-query
  layout with ``n`` kv heads), and each rank's local piece is ``[B, 1, S, d]``: its kv head, cut from the replicated
  keys without communication. While the cache's keys are used, the module's ``num_key_value_groups`` reads
  ``h / n`` (query heads per stored kv head), so attention pairs each rank's query heads with its stored kv head.
  Per rank the cache is ``1/kv`` of the one-device cache (``1/n`` when ``kv`` divides ``n`` is not possible below
  one head per rank).

Without a cache (``use_cache=False``) attention runs on DTensors as usual: the replicated keys are cut to each rank's
heads by DTensor's sharding propagation (a local slice). Such attention blocks take the DTensor path, not the fast
path (:mod:`vescale.parallel.fast` requires sharded k/v projections).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from vescale.core.errors import PlanError

__all__ = ["replicate_kv_heads", "kv_head_layout", "planned_kv_replicas", "install_kv_replicas",
           "kv_replicated_modules"]

_CACHE_KEYS = ("past_key_values", "cache", "past_key_value")


def kv_head_layout(num_key_value_heads: int, tp_size: int, num_attention_heads: int | None = None) -> str:
    """``"shard"`` when the kv heads divide over the tp ranks, ``"replicate"`` when fewer kv heads than ranks can be
    replicated over the ranks that share them; raises :class:`PlanError` naming both counts otherwise."""
    if num_attention_heads is not None and num_attention_heads % tp_size:
        raise PlanError(f"num_attention_heads={num_attention_heads} is not divisible by tp={tp_size}")
    if num_key_value_heads % tp_size == 0:
        return "shard"
    if tp_size % num_key_value_heads == 0:
        return "replicate"
    raise PlanError(f"num_key_value_heads={num_key_value_heads} and tp={tp_size}: the kv heads neither divide over the "
                    f"tp ranks nor can be replicated over them (tp must be a multiple of num_key_value_heads when it "
                    f"is larger)")


def replicate_kv_heads(model: nn.Module, mesh, *, tp: str = "tp") -> int:
    """Make each attention module of a parallelized ``model`` whose ``k_proj``/``v_proj`` weights are ``Replicate``
    on ``tp`` while ``q_proj`` is ``Shard(0)`` there keep only this rank's kv head in its KV cache (module docstring).

    :func:`~vescale.parallel.parallelize_module` already does this for every such module its plan lays out so; this
    call is then a no-op (idempotent: a module is never wrapped twice). Applies to modules with
    ``config.num_key_value_heads < mesh.size(tp)``; returns how many keep one kv head per rank (set up now or
    before). Raises :class:`PlanError` (on every rank alike, before any collective) if such a module's head counts or
    placements cannot be laid out this way. No collective.
    """
    names = tuple(mesh.mesh_dim_names or ())
    if tp not in names:
        raise PlanError(f"replicate_kv_heads: the mesh has no {tp!r} dim (dims {list(names)})")
    k = names.index(tp)
    n = mesh.size(k)
    changed = 0
    for fqn, module, kv in _grouped_attention(model):
        if kv >= n:
            continue
        if getattr(module, "_vescale_kv_replicas", None) == k:
            changed += 1  # set up by parallelize_module (or an earlier call)
            continue
        heads = module.config.num_attention_heads
        if kv_head_layout(kv, n, heads) != "replicate":
            continue
        if not _replicated_kv(module, mesh, k):
            raise PlanError(f"{fqn}: num_key_value_heads={kv} is fewer than tp={n}, so k_proj/v_proj must be Replicate "
                            f"on {tp!r} and q_proj Shard(0) there (plans: pass num_key_value_heads=...; auto_plan "
                            f"does this), got k_proj {_placements(module.k_proj.weight)} and q_proj "
                            f"{_placements(module.q_proj.weight)}")
        _install(module, mesh, k)
        changed += 1
    return changed


def planned_kv_replicas(model: nn.Module, mesh, placements: dict[str, tuple]) -> list[tuple[str, int]]:
    """The attention modules of ``model`` that :func:`install_kv_replicas` will set up, from the planned parameter
    ``placements`` (``{parameter FQN: placements}``, before any parameter is distributed): ``(module FQN, mesh dim)``
    for each module with ``q_proj``/``k_proj``/``v_proj`` whose ``q_proj.weight`` is ``Shard(0)`` on exactly one mesh
    dim, whose k/v weights and biases are ``Replicate`` on every mesh dim, and whose ``config.num_key_value_heads``
    is fewer than that dim's size. Raises :class:`PlanError` naming the module and both head counts when such a
    module's kv heads cannot be replicated over the ranks (``kv_head_layout``). Pure: the same on every rank, no
    collective. A plan that shards k/v with fewer kv heads than ranks (split inside a head) is left alone: correct,
    with the cache replicated."""
    found = []
    for fqn, module, kv in _grouped_attention(model):
        prefix = f"{fqn}." if fqn else ""
        q = placements.get(f"{prefix}q_proj.weight", ())
        dims = [i for i, p in enumerate(q) if type(p) is Shard and p.dim == 0]
        if len(dims) != 1 or kv >= mesh.size(dims[0]):
            continue
        kv_params = [f"{prefix}{proj}.{attr}" for proj in ("k_proj", "v_proj") for attr in ("weight", "bias")
                     if getattr(getattr(module, proj), attr, None) is not None]
        if not all(all(isinstance(p, Replicate) for p in placements.get(name, ())) for name in kv_params):
            continue
        try:
            layout = kv_head_layout(kv, mesh.size(dims[0]), module.config.num_attention_heads)
        except PlanError as exc:
            raise PlanError(f"{fqn}: k_proj/v_proj replicated and q_proj sharded on mesh dim {dims[0]}: "
                            f"{exc}") from None
        if layout == "replicate":
            found.append((fqn, dims[0]))
    return found


def _grouped_attention(model: nn.Module):
    """``(FQN, module, num_key_value_heads)`` of each attention module of ``model``: one with ``q_proj``, ``k_proj``
    and ``v_proj`` and a ``config.num_key_value_heads`` (the modules both :func:`replicate_kv_heads` and
    :func:`planned_kv_replicas` consider)."""
    for fqn, module in model.named_modules():
        kv = getattr(getattr(module, "config", None), "num_key_value_heads", None)
        if kv and all(hasattr(module, p) for p in ("q_proj", "k_proj", "v_proj")):
            yield fqn, module, kv


def install_kv_replicas(model: nn.Module, mesh, found: list[tuple[str, int]]) -> None:
    """Wrap the cache of each ``(module FQN, mesh dim)`` of :func:`planned_kv_replicas` (parameters distributed)."""
    modules = dict(model.named_modules())
    for fqn, k in found:
        if getattr(modules[fqn], "_vescale_kv_replicas", None) is None:
            _install(modules[fqn], mesh, k)


def kv_replicated_modules(model: nn.Module) -> list[str]:
    """FQNs of the attention modules of ``model`` whose KV cache keeps only this rank's kv head."""
    return [fqn for fqn, m in model.named_modules() if getattr(m, "_vescale_kv_replicas", None) is not None]


def _install(module: nn.Module, mesh, k: int) -> None:
    n, kv, heads = mesh.size(k), module.config.num_key_value_heads, module.config.num_attention_heads
    group = mesh.get_local_rank(k) // (n // kv)
    module.register_forward_pre_hook(_Wrap(mesh, k, group, heads // n), with_kwargs=True)
    module.register_forward_hook(_restore_groups, always_call=True)
    module._vescale_kv_replicas = k  # the mesh dim; marks the module as set up (replicate_kv_heads is idempotent)


def _placements(t: Any) -> str:
    return str(list(t.placements)) if isinstance(t, DTensor) else "a plain tensor"


def _replicated_kv(module: nn.Module, mesh, k: int) -> bool:
    q = module.q_proj.weight
    if not (isinstance(q, DTensor) and q.device_mesh == mesh and q.placements[k] == Shard(0)):
        return False
    for proj in (module.k_proj, module.v_proj):
        for t in (proj.weight, proj.bias):
            if t is not None and not (isinstance(t, DTensor) and t.device_mesh == mesh
                                      and all(isinstance(p, Replicate) for p in t.placements)):
                return False
    return True


class _Wrap:
    """The attention module's forward pre-hook: hand it the cache as a :class:`_OwnHeadCache`."""

    def __init__(self, mesh, k: int, group: int, groups: int) -> None:
        self.mesh, self.k, self.group, self.groups = mesh, k, group, groups

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict):
        for key in _CACHE_KEYS:
            cache = kwargs.get(key)
            if cache is not None and not isinstance(cache, _OwnHeadCache):
                kwargs[key] = _OwnHeadCache(cache, module, self)
        return args, kwargs


def _restore_groups(module: nn.Module, args: tuple, output: Any) -> None:
    saved = getattr(module, "_vescale_kv_saved_groups", None)
    if saved is not None:
        module.num_key_value_groups = saved
        del module._vescale_kv_saved_groups


class _OwnHeadCache:
    """A KV cache whose ``update`` stores only this rank's kv head (see the module docstring); everything else is the
    wrapped cache's."""

    def __init__(self, cache: Any, module: nn.Module, wrap: _Wrap) -> None:
        self.cache, self.module, self.wrap = cache, module, wrap

    def _own_head(self, t: Any) -> Any:
        w = self.wrap
        if not (isinstance(t, DTensor) and t.device_mesh == w.mesh and isinstance(t.placements[w.k], Replicate)):
            raise PlanError(f"kv-head replication expects the keys/values as DTensors replicated on mesh dim {w.k}, "
                            f"got {type(t).__name__} {_placements(t)}")
        # This rank's piece of the repeated layout; its gradient is this rank's part of the replicated keys' gradient
        # (its own query heads only): a partial sum over the tp ranks.
        grad = [Partial() if i == w.k else p for i, p in enumerate(t.placements)]
        local = t.to_local(grad_placements=grad)[:, w.group:w.group + 1].contiguous()
        placements = [Shard(1) if i == w.k else p for i, p in enumerate(t.placements)]
        shape = list(t.shape)
        shape[1] = w.mesh.size(w.k)
        stride = [1] * len(shape)  # contiguous (computed, not allocated: factories here would be captured)
        for i in range(len(shape) - 2, -1, -1):
            stride[i] = stride[i + 1] * shape[i + 1]
        return DTensor.from_local(local, w.mesh, placements, run_check=False, shape=torch.Size(shape),
                                 stride=tuple(stride))

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        key_states, value_states = self._own_head(key_states), self._own_head(value_states)
        out = self.cache.update(key_states, value_states, *args, **kwargs)
        m = self.module
        if getattr(m, "_vescale_kv_saved_groups", None) is None:
            m._vescale_kv_saved_groups = m.num_key_value_groups
        m.num_key_value_groups = self.wrap.groups  # query heads per stored kv head, until the forward returns
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self.cache, name)
