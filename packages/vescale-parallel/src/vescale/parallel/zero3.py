"""ZeRO 3: PyTorch's ``fully_shard`` (FSDP2) over the dp dimension of a named mesh, composed with vescale/torch TP.

vescale does not re-implement parameter sharding: :func:`fully_shard_dp` applies ``torch.distributed.fsdp.fully_shard``
to each transformer block and then to the root, on the ``dp`` sub-mesh. Parameters already sharded over ``tp``
become 2-D DTensors (dp, tp); the optimizer is any plain ``torch.optim`` optimizer over ``model.parameters()``,
and :func:`~vescale.parallel.clip_grad_norm_` works on the resulting gradients unchanged. Gradient accumulation:
``model.set_requires_gradient_sync(False)`` for all but the last micro-batch (FSDP2's ``no_sync``).
"""

from __future__ import annotations

import re
from typing import Any

from torch import nn

from vescale.core.errors import VescaleError

__all__ = ["fully_shard_dp", "Zero3Error"]


class Zero3Error(VescaleError, ValueError):
    """The mesh or block pattern given to :func:`fully_shard_dp` cannot be used."""


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

    names = tuple(mesh.mesh_dim_names or ())
    if mesh.ndim == 1:
        dp_mesh = mesh
    elif "dp" in names:
        dp_mesh = mesh["dp"]
    else:
        raise Zero3Error(f"mesh has dimensions {list(names)} (shape {tuple(mesh.shape)}); fully_shard_dp needs a "
                         "1-D mesh or one with a 'dp' dimension")
    if blocks is None:
        targets = [m for ml in module.modules() if isinstance(ml, nn.ModuleList) for m in ml]
    else:
        pattern = re.compile(blocks)
        targets = [m for fqn, m in module.named_modules() if fqn and pattern.fullmatch(fqn)]
        if not targets:
            raise Zero3Error(f"blocks pattern {blocks!r} matches no submodule FQN of {type(module).__name__}")
    kw = {"mesh": dp_mesh, "reshard_after_forward": reshard_after_forward}
    if mp_policy is not None:
        kw["mp_policy"] = mp_policy
    for m in targets:
        fully_shard(m, **kw)
    fully_shard(module, **kw)
    return module
