"""vescale.dtensor: PyTorch's DTensor plus what it lacks.

``DTensor``, ``DeviceMesh``, ``init_device_mesh``, ``Shard``, ``Replicate`` and ``Partial`` are torch's own objects,
re-exported. vescale adds :class:`InterleavedShard` and :class:`RaggedShard`, a :func:`from_local` that checks uneven
shards, the counter-based RNG in :mod:`vescale.dtensor.random`, deferred (meta-device) init with sharded
materialisation, and a :func:`strict` mode that forbids implicit resharding. Built on ``torch.distributed.tensor``,
never a fork of it.
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from vescale.dtensor import random
from vescale.dtensor.api import distribute_tensor, from_local, full_tensor, redistribute
from vescale.dtensor.deferred import adopt_deferred, deferred_init, is_deferred, materialize, record_deferred
from vescale.dtensor.errors import (
    CompiledRandomError,
    DeferredInitError,
    PlacementError,
    StrictRedistributeError,
    UndrawnRandomError,
    ViewRedistributeError,
)
from vescale.dtensor.placements import InterleavedShard, RaggedShard, as_interleaved, is_interleaved
from vescale.dtensor.strict import CommCounter, count_comms, is_strict, strict

__all__ = [
    "DTensor",
    "DeviceMesh",
    "init_device_mesh",
    "distribute_tensor",
    "from_local",
    "redistribute",
    "full_tensor",
    "Shard",
    "Replicate",
    "Partial",
    "InterleavedShard",
    "RaggedShard",
    "is_interleaved",
    "as_interleaved",
    "deferred_init",
    "materialize",
    "is_deferred",
    "adopt_deferred",
    "record_deferred",
    "strict",
    "is_strict",
    "count_comms",
    "CommCounter",
    "random",
    "PlacementError",
    "StrictRedistributeError",
    "ViewRedistributeError",
    "DeferredInitError",
    "CompiledRandomError",
    "UndrawnRandomError",
]
