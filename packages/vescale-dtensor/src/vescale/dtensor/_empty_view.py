"""The sharding strategy of a ``view`` or ``reshape`` of an empty DTensor, for :mod:`vescale.dtensor.view_rules`.

torch's dim map of these ops (``_view_ops.view_groups``) never returns for some empty shapes (``[0]`` viewed as
``[0, 3]``, ``[4, 0]`` unflattened to ``[4, 2, 0, 0, 0]``): on every rank, a hang before any collective. An empty
input never reaches it: replicated or partial it is viewed as it is; sharded it is refused by name.
"""

from __future__ import annotations

import torch
from torch import Tensor

from vescale.core.torch_internals import (
    DTensorSpec,
    OpOverload,
    OpSchema,
    OpSpec,
    OpStrategy,
    generate_redistribute_costs,
)
from vescale.core.torch_internals import view_ops as _view_ops
from vescale.dtensor.errors import PlacementError

__all__ = ["RESHAPE_DIM_MAPS", "empty_view_strategy"]

#: The dim maps built on ``view_groups``, which never returns for some empty shapes (``[0]`` as ``[0, 3]``).
RESHAPE_DIM_MAPS = (_view_ops.dim_maps[Tensor.view], _view_ops.dim_maps[torch.reshape])


def empty_view_strategy(op: OpOverload, input_strategy: OpStrategy, op_schema: OpSchema) -> OpStrategy:
    """A view or reshape of an empty input: the local tensor viewed, placements kept, where every mesh dim replicates
    or holds a partial (each local shape is the global one); sharded: :class:`PlacementError` naming op and shape."""
    mesh, result = op_schema.get_mesh_from_args(validate=False), OpStrategy([])
    for src in (spec.output_spec for spec in input_strategy.strategies):
        if any(not (p.is_replicate() or p.is_partial()) for p in src.placements):
            raise PlacementError(f"{op}: input of global shape {tuple(input_strategy.shape)} (empty) placed "
                                 f"{tuple(src.placements)} on mesh {tuple(mesh.shape)} (dims {mesh.mesh_dim_names}): "
                                 "a view of a sharded empty tensor is not supported; redistribute to Replicate first")
        tgt = DTensorSpec(mesh=mesh, placements=tuple(src.placements), tensor_meta=src.tensor_meta)
        result.strategies.append(OpSpec(output_specs=DTensorSpec(mesh=mesh, placements=tuple(src.placements)),
                                        input_specs=(tgt,),
                                        redistribute_cost=[generate_redistribute_costs(input_strategy, tgt)]))
    return result
