"""ZeRO 3 and HSDP: PyTorch's ``fully_shard`` (FSDP2) over the data-parallel dims of a named mesh, composed with TP.

vescale does not re-implement parameter sharding: :func:`fully_shard_dp` applies ``torch.distributed.fsdp.fully_shard``
to each transformer block and then to the root, on the data-parallel part of the mesh:

* ZeRO 3: the ``dp`` dim (or a whole 1-D mesh): parameters, gradients and optimizer states sharded over it.
* HSDP: a mesh with the two dims ``dp_replicate`` and ``dp_shard`` (outer, inner): FSDP2's hybrid sharding, sharded
  over ``dp_shard`` and replicated over ``dp_replicate`` (gradients reduce-scattered within a shard group, then
  all-reduced across replicas). Data parallelism then spans both dims: ``dp_replicate x dp_shard`` data shards.

Parameters already sharded over ``tp`` become 2-D (or 3-D) DTensors; the optimizer is any plain ``torch.optim``
optimizer over ``model.parameters()``, and :func:`~vescale.parallel.clip_grad_norm_` works on the resulting gradients
unchanged. Gradient accumulation: ``model.set_requires_gradient_sync(False)`` for all but the last micro-batch.

Pipeline stages (:func:`fully_shard_stage`): a stage that ``vescale.pipe.split`` cut from a captured graph has no
block modules whose forward runs, so the whole stage is one FSDP2 unit over dp, and the wrapper
(:class:`Zero3Stage`) follows ``vescale.pipe.PipeEngine``'s grad-sync protocol: the engine runs every backward but
the stage's last one of the step under ``no_sync()`` (FSDP2 accumulates unsharded gradients, reduces nothing and
keeps the gathered parameters), and the last one reduce-scatters the sum of all microbatches' gradients once, then
frees the gathered parameters.

Mixed precision (:func:`bf16_policy`): FSDP2 keeps the sharded parameters (the masters, which the optimizer updates
and a checkpoint saves) in their own dtype, fp32, casts the gathered parameters to bf16 for forward and backward, and
reduces the gradients in fp32 (or bf16, when asked), so the optimizer state stays fp32 too. A pipeline stage's
captured graph fixes its dtypes at capture, so it is captured in bf16 and ``fully_shard_stage(master_dtype=)``
widens its parameters to the fp32 masters before sharding.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from vescale.core.blocks import find_blocks
from vescale.core.errors import MeshError
from vescale.core.mesh import dim_mesh, hsdp_pair
from vescale.parallel.errors import Zero3Error

__all__ = ["Zero3Stage", "bf16_policy", "fully_shard_dp", "fully_shard_stage", "zero3_mesh"]

def zero3_mesh(mesh):
    """The data-parallel (sub-)mesh :func:`fully_shard_dp` shards over: 2-D ``(dp_replicate, dp_shard)`` for HSDP,
    else the 1-D ``dp`` one (a whole 1-D mesh is the dp mesh). Raises :class:`Zero3Error` for a mesh with neither, or
    with both ``dp`` and an HSDP dim, or with only one of the two HSDP dims. Local; issues no collective."""
    names = tuple(mesh.mesh_dim_names or ())
    try:
        pair = hsdp_pair(names) if mesh.ndim > 1 or names[0] != "dp" else None
    except MeshError as exc:
        raise Zero3Error(str(exc)) from None
    if pair is not None:
        return dim_mesh(mesh, pair)
    data = dim_mesh(mesh, "dp")
    if data is None:
        raise Zero3Error(f"mesh has dimensions {list(names)} (shape {tuple(mesh.shape)}); fully_shard_dp needs a 1-D "
                         "mesh, one with a 'dp' dimension, or one with the HSDP dimensions dp_replicate and dp_shard")
    return data


def bf16_policy(reduce_dtype: torch.dtype = torch.float32):
    """FSDP2's ``MixedPrecisionPolicy`` for bf16 compute over fp32 sharded masters: parameters gathered and cast to
    bf16, gradients reduced in ``reduce_dtype`` (fp32 by default; bf16 halves the reduce-scatter bytes) and kept in
    the sharded parameters' dtype for the optimizer, module outputs left as computed."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)


def fully_shard_dp(module: nn.Module, mesh, *, blocks: str | None = None, reshard_after_forward: bool = True,
                   mp_policy: Any = None) -> nn.Module:
    """Shard ``module``'s parameters, gradients and optimizer states over the data-parallel dims (ZeRO 3 / HSDP).

    ``mesh`` is a 1-D mesh (all of it is dp), an nD mesh with a ``"dp"`` dimension (ZeRO 3), or an nD mesh with
    ``"dp_replicate"`` and ``"dp_shard"`` dimensions (HSDP: sharded over ``dp_shard``, replicated over
    ``dp_replicate``); TP must already be applied over another dim of the same mesh. ``blocks`` is a regex that fully
    matches the FQNs of the submodules to wrap one by one (each becomes one all-gather / reduce-scatter unit); by
    default every child of every ``nn.ModuleList``. ``reshard_after_forward=False`` keeps parameters gathered between
    forward and backward (ZeRO 2-like communication). ``mp_policy`` is a ``torch.distributed.fsdp.MixedPrecisionPolicy``
    (:func:`bf16_policy` for bf16 compute over fp32 masters). Parameters are sharded in place, as they are: cast the
    model to the master dtype before, not after. Returns ``module`` (now also an FSDP module).
    """
    from torch.distributed.fsdp import fully_shard

    data = zero3_mesh(mesh)
    targets = [m for _, m in find_blocks(module, blocks, every_list=True)]
    if blocks is not None and not targets:
        raise Zero3Error(f"blocks pattern {blocks!r} matches no submodule FQN of {type(module).__name__}")
    kw = {"mesh": data, "reshard_after_forward": reshard_after_forward}
    if mp_policy is not None:
        kw["mp_policy"] = mp_policy
    for m in [*targets, module]:
        _shard_outside_capture(m, fully_shard, kw)
    return module


def fully_shard_stage(stage: nn.Module, mesh, *, reshard_after_forward: bool = False,
                      mp_policy: Any = None, master_dtype: torch.dtype | None = None) -> Zero3Stage:
    """Shard one pipeline stage's parameters over the data-parallel dims of ``mesh`` (ZeRO 3 / HSDP, as
    :func:`fully_shard_dp`), the whole stage as one FSDP2 unit; return it in a :class:`Zero3Stage` for
    ``PipeEngine.wrap_stages``.

    ``stage`` (e.g. a ``vescale.pipe.GraphStage``, TP already applied over another dim of ``mesh``) is sharded in
    place: its parameters become new DTensor parameters under the same FQNs (``wrap_stages`` collects them again).
    ``reshard_after_forward=False`` (default) gathers the stage's parameters once per step, at its first forward,
    and frees them after its last backward: a rank computes on its one stage from the first to the last microbatch,
    so the gathered weights are in use all that time: one all-gather a step. ``True`` frees them after every forward
    and gathers them again at the next forward or backward that finds them freed (least memory; up to 2 x M
    all-gathers a step, M + 1 under GPipe). Either way the stage's gradients are reduce-scattered once a step, in
    its last backward.

    Mixed precision: a captured stage's graph hard-codes the dtypes it was captured in (an RMSNorm's upcast to fp32
    and its cast back to the input's dtype are constants of the graph), so a bf16 stage is captured from the model
    cast to bf16. ``master_dtype=torch.float32`` then casts the stage's floating-point parameters (not its buffers,
    which the graph uses as captured) to fp32 before sharding, the masters the optimizer steps, while ``mp_policy``
    (:func:`bf16_policy`) hands the graph bf16 gathered parameters again; ties within the stage are kept. Refused
    (:class:`Zero3Error`, local, before any collective) when ``mp_policy``'s ``param_dtype`` is not the dtype the
    stage's parameters were captured in.
    No collective here (FSDP2 gathers lazily at the first forward).
    """
    from torch.distributed.fsdp import fully_shard

    if master_dtype is not None:
        _check_compute_dtype(stage, mp_policy)
        _cast_parameters(stage, master_dtype)
    kw = {"mesh": zero3_mesh(mesh), "reshard_after_forward": reshard_after_forward}
    if mp_policy is not None:
        kw["mp_policy"] = mp_policy
    _shard_outside_capture(stage, fully_shard, kw)
    return Zero3Stage(stage)


def _check_compute_dtype(stage: nn.Module, mp_policy: Any) -> None:
    """Raise :class:`Zero3Error` unless ``mp_policy`` computes in the dtype of every floating parameter of
    ``stage`` (the dtype its graph was captured in): otherwise the graph would see parameters of another dtype."""
    compute = getattr(mp_policy, "param_dtype", None)
    wrong = sorted(f"{n} ({p.dtype})" for n, p in stage.named_parameters()
                   if p.is_floating_point() and p.dtype != compute)
    if compute is None or wrong:
        raise Zero3Error(f"fully_shard_stage(master_dtype=...) needs an mp_policy whose param_dtype is the dtype the "
                         f"stage was captured in; param_dtype is {compute}, but parameters {wrong[:4]} differ")


def _cast_parameters(module: nn.Module, dtype: torch.dtype) -> None:
    """Replace every floating-point parameter of ``module`` by a new parameter of ``dtype`` (the same values,
    widened; DTensors stay DTensors), under the same names; one parameter registered under two names stays one."""
    new: dict[int, nn.Parameter] = {}
    for mod in module.modules():
        for name, p in list(mod.named_parameters(recurse=False, remove_duplicate=False)):
            if not p.is_floating_point() or p.dtype == dtype:
                continue
            if id(p) not in new:
                new[id(p)] = nn.Parameter(p.detach().to(dtype), requires_grad=p.requires_grad)
            setattr(mod, name, new[id(p)])


class Zero3Stage(nn.Module):
    """A pipeline stage sharded by FSDP2 (:func:`fully_shard_stage`) in ``vescale.pipe.StageGradSync``'s protocol.

    ``forward`` runs the stage. ``no_sync()``: backward inside accumulates the unsharded gradient locally (no
    reduce-scatter), keeps the gathered parameters, and is not FSDP2's last backward of the step; outside it (the
    engine's last backward of the stage) FSDP2 reduce-scatters the accumulated sum over dp (HSDP: then all-reduces
    over the replicas), averaging, and frees the gathered parameters. ``finish_grad_sync()`` has nothing left to do:
    FSDP2 waits for its reduction at the end of that backward. The reduction runs in FSDP2's autograd hooks, which a
    split backward (``BW`` on parameter edges) does not reach: ``split_backward = False`` makes ``wrap_stages``
    refuse zero-bubble schedules. Parameters are the stage's own (``parameters()`` lists them with the prefix
    ``module.``; checkpoint and name the unwrapped stage).
    """

    split_backward = False

    def __init__(self, stage: nn.Module) -> None:
        super().__init__()
        self.module = stage

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def _set_sync(self, sync: bool) -> None:
        self.module.set_requires_gradient_sync(sync)
        self.module.set_reshard_after_backward(sync)
        self.module.set_is_last_backward(sync)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        self._set_sync(False)
        try:
            yield
        finally:
            self._set_sync(True)

    def defer_grad_sync(self, late: Any = ()) -> None:
        """Nothing to defer: FSDP2 reduces in the stage's last backward and waits there; the engine then sums a tied
        weight's reduced shards over pp (a sum of dp averages is the dp average of the sums)."""
        return None

    def finish_grad_sync(self) -> None:
        return None


def _shard_outside_capture(module: nn.Module, fully_shard, kw: dict) -> None:
    """``fully_shard(module, **kw)`` with FSDP2's forward pre- and post-hooks run with factory capture suspended.

    A module parallelized by vescale runs its forward under :class:`~vescale.parallel.factory.FactoryCapture`, which
    makes ``torch.empty`` & co. replicated DTensors; FSDP2's all-gather buffers, made in its hooks, must stay plain
    tensors. The hooks are bracketed by registering ours around FSDP2's: its pre-hook is prepended (so ours, prepended
    before and after it, sit on either side), its post-hook appended (likewise).
    """
    from vescale.parallel.factory import capture_suspended

    held: list = []

    def enter(*_args) -> None:
        cm = capture_suspended()
        cm.__enter__()
        held.append(cm)

    def leave(*_args) -> None:
        if held:
            held.pop().__exit__(None, None, None)

    module.register_forward_pre_hook(leave, prepend=True)  # runs right after FSDP2's pre-hook (prepended next)
    module.register_forward_hook(enter)  # right before FSDP2's post-hook (appended next)
    fully_shard(module, **kw)
    module.register_forward_pre_hook(enter, prepend=True)
    module.register_forward_hook(leave, always_call=True)
