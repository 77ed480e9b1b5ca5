"""vescale.core: the thin core every vescale package shares.

- :mod:`vescale.core.launch`: start ranks locally (``spawn``) or join torchrun's (``init_distributed``).
- :mod:`vescale.core.mesh`: named device meshes in canonical order (``init_mesh``, ``sub_mesh``) and the resolution
  of a mesh dimension, given by name, to its sub-mesh or process group (``dim_mesh``, ``dim_group``); the one owner
  of mesh roles (``MeshRoles.of(mesh)``: which ranks split the batch, average gradients, hold expert replicas).
- :mod:`vescale.core.blocks`: a model's repeated blocks (``find_blocks``), for compile, ZeRO 3 and pipeline splits.
- :mod:`vescale.core.comm`: the one collective counter (``count_comms``: calls and bytes per collective, per mesh dim).
- :mod:`vescale.core.watchdog`: collective timeouts that name the missing rank (``watch_collectives``).
- :mod:`vescale.core.preemption`: a preemption signal on any rank stops every rank at the same step
  (``PreemptionGuard``, ``should_stop()``: one tiny all-reduce).
- :mod:`vescale.core.fqn`: the one matcher of plan patterns against FQNs (``match_plan``).
- :mod:`vescale.core.sharded_state`: the protocol through which sharded state (ZeRO's optimizer, ragged DTensors, a
  user's object) is saved and loaded (``ShardedTensor``, ``ShardedStateful``, ``BoxPlacement``).
- :mod:`vescale.core.errors`: ``VescaleError`` and its subclasses.
- :mod:`vescale.core.testing`: the pooled multi-rank pytest harness.
"""

from __future__ import annotations

from vescale.core.errors import CollectiveTimeoutError, MeshError, PlanError, RankError, RankTimeoutError, VescaleError
from vescale.core.fqn import PlanMatch, match_plan
from vescale.core.launch import init_distributed, spawn
from vescale.core.mesh import (
    MeshRole,
    MeshRoles,
    dim_group,
    dim_mesh,
    dim_size,
    init_mesh,
    mesh_coordinates,
    parse_mesh_spec,
    sub_mesh,
)
from vescale.core.preemption import PreemptionGuard

__all__ = [
    "VescaleError",
    "MeshError",
    "PlanError",
    "RankError",
    "RankTimeoutError",
    "CollectiveTimeoutError",
    "PlanMatch",
    "match_plan",
    "spawn",
    "init_distributed",
    "init_mesh",
    "parse_mesh_spec",
    "sub_mesh",
    "dim_size",
    "mesh_coordinates",
    "dim_mesh",
    "dim_group",
    "MeshRole",
    "MeshRoles",
    "PreemptionGuard",
]
