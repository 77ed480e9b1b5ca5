"""ZeRO 3: PyTorch's ``fully_shard`` (FSDP2) over the dp dimension of a named mesh, composed with vescale/torch TP.

vescale does not re-implement parameter sharding: :func:`fully_shard_dp` applies ``torch.distributed.fsdp.fully_shard``
to each transformer block and then to the root, on the ``dp`` sub-mesh. Parameters already sharded over ``tp``
become 2-D DTensors (dp, tp); the optimizer is any plain ``torch.optim`` optimizer over ``model.parameters()``,
and :func:`~vescale.parallel.clip_grad_norm_` works on the resulting gradients unchanged. Gradient accumulation:
``model.set_requires_gradient_sync(False)`` for all but the last micro-batch (FSDP2's ``no_sync``).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from vescale.core.blocks import find_blocks
from vescale.core.mesh import dim_mesh
from vescale.parallel.errors import Zero3Error

__all__ = ["fully_shard_dp"]


def fully_shard_dp(module: nn.Module, mesh, *, blocks: str | None = None, reshard_after_forward: bool = True,
                   mp_policy: Any = None) -> nn.Module:
    """Shard ``module``'s parameters, gradients and optimizer states over the ``dp`` mesh dim (ZeRO 3); return it.

    ``mesh`` is a 1-D mesh (all of it is dp) or an nD mesh with a ``"dp"`` dimension; TP must already be applied
    over another dim of the same mesh. ``blocks`` is a regex that fully matches the FQNs of the submodules to wrap
    one by one (each becomes one all-gather / reduce-scatter unit); by default every child of every
    ``nn.ModuleList``. ``reshard_after_forward=False`` keeps parameters gathered between forward and backward
    (ZeRO 2-like communication). ``mp_policy`` is a ``torch.distributed.fsdp.MixedPrecisionPolicy``.
    """
    from torch.distributed.fsdp import fully_shard

    dp_mesh = dim_mesh(mesh, "dp")
    if dp_mesh is None:
        raise Zero3Error(f"mesh has dimensions {list(mesh.mesh_dim_names or ())} (shape {tuple(mesh.shape)}); "
                         "fully_shard_dp needs a 1-D mesh or one with a 'dp' dimension")
    targets = [m for _, m in find_blocks(module, blocks, every_list=True)]
    if blocks is not None and not targets:
        raise Zero3Error(f"blocks pattern {blocks!r} matches no submodule FQN of {type(module).__name__}")
    kw = {"mesh": dp_mesh, "reshard_after_forward": reshard_after_forward}
    if mp_policy is not None:
        kw["mp_policy"] = mp_policy
    for m in targets:
        fully_shard(m, **kw)
    fully_shard(module, **kw)
    return module
