"""FP8 linears: torchao's ``Float8Linear`` (dynamic tensor-wise or row-wise scaling) on the hidden linears of a model,
composed with vescale's tensor parallelism and ZeRO 3 (FSDP2).

torchao is an optional dependency (``pip install vescale-parallel[fp8]``, pinned to a version tested with this
torch). What composes, each measured against one device's torchao model in ``tests/test_fp8.py``:

- tensor-wise scaling with TP (linears converted before ``parallelize_module``, their weights then DTensors
  ``Shard(0)``/``Shard(1)``): torchao computes each scale's amax on the DTensor, i.e. over the global tensor, so the
  step is one device's up to the reduction order (vescale's fast path recognises only exact ``nn.Linear``
  children, so converted blocks run through DTensor ops);
- ZeRO 3 (FSDP2) over dp, tensor-wise or row-wise: each dp rank scales its own rows' activations and gradients,
  which is what one device computes when it runs each rank's rows as a micro-batch (the reference); with tensor-wise
  scaling and tp == 1 the weights are all-gathered in fp8 (``enable_fsdp_float8_all_gather``: a quarter of the fp32
  bytes; the weight scale's amax all-reduced over dp, so it is the whole weight's);
- dp x tp x ZeRO 3, tensor-wise: weights all-gathered in their own dtype (torchao's fp8 all-gather reduces amax with
  a functional collective DTensor has no rule for), fp8 matmuls.

Refused (:func:`fp8_problems`, before any collective): row-wise scaling with tp > 1 (a row's scale spans the
contraction dim, which a TP shard cuts: per-shard scales, not one device's; measured 1.7-5.7 % gradient differences
on a 2-layer GPT), pp, ep and cp (not tested), a device whose ``torch._scaled_mm`` does not run fp8 (probed once),
and torchao absent. Linears whose in or out features are not multiples of ``16 x tp`` (``_scaled_mm``'s rule on every
TP shard) are left in high precision, as are embeddings and the output head.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import torch
from torch import nn

from vescale.parallel.errors import Fp8Error
from vescale.parallel.muon import hidden_matrices

__all__ = ["FP8_RECIPES", "TORCHAO_VERSION", "fp8_problems", "float8_linears", "fp8_linear_fqns"]

#: torchao's dynamic scaling recipes vescale composes
FP8_RECIPES = ("tensorwise", "rowwise")
#: the torchao release the ``fp8`` extra pins (tested with torch 2.13 on CPU)
TORCHAO_VERSION = "0.18.0"


@functools.cache
def _scaled_mm_runs(device_type: str) -> str | None:
    """None when an fp8 ``torch._scaled_mm`` runs on ``device_type``, else why not (one 16 x 16 probe, cached)."""
    if device_type == "cuda":
        if not torch.cuda.is_available():
            return "CUDA is not available"
        if torch.cuda.get_device_capability() < (8, 9):
            return f"CUDA device capability {torch.cuda.get_device_capability()} < (8, 9) has no fp8 matmul"
    try:
        a = torch.ones(16, 16, device=device_type).to(torch.float8_e4m3fn)
        b = torch.ones(16, 16, device=device_type).to(torch.float8_e4m3fn).t()
        one = torch.ones((), device=device_type)
        torch.ops.aten._scaled_mm(a, b, one, one, out_dtype=torch.float32)  # torch's fp8 matmul, as torchao's
    except (RuntimeError, NotImplementedError, AttributeError) as exc:
        return f"torch._scaled_mm does not run fp8 on {device_type}: {str(exc).splitlines()[0][:160]}"
    return None


def _torchao_problem() -> str | None:
    try:
        import torchao  # noqa: F401
        from torchao.float8 import convert_to_float8_training  # noqa: F401
    except ImportError as exc:
        return (f"fp8 linears need torchao ({exc}); install it with pip install 'vescale-parallel[fp8]' "
                f"(torchao=={TORCHAO_VERSION})")
    return None


def fp8_problems(recipe: str, *, tp: int = 1, pp: int = 1, ep: int = 1, cp: int = 1,
                 device_type: str = "cpu") -> list[str]:
    """Every reason FP8 linears with ``recipe`` cannot run on this mesh and device type (empty when they can).

    No process group needed; the device probe runs one tiny fp8 matmul on ``device_type`` (cached).
    """
    out = []
    if recipe not in FP8_RECIPES:
        return [f"fp8 recipe {recipe!r} is not one of {list(FP8_RECIPES)}"]
    if recipe == "rowwise" and tp > 1:
        out.append(f"fp8 rowwise scaling with tp={tp}: a row's scale spans the contraction dim a TP shard cuts, so "
                   "each shard would scale alone (not one device's numerics); use tensorwise with tp")
    for name, size in (("pp", pp), ("ep", ep), ("cp", cp)):
        if size > 1:
            out.append(f"fp8 linears with {name}={size} are not supported yet (dp, tp and ZeRO 3 are)")
    missing = _torchao_problem()
    if missing:
        out.append(missing)
    else:
        why = _scaled_mm_runs(device_type)
        if why:
            out.append(f"fp8 linears cannot run here: {why}")
    return out


def fp8_linear_fqns(model: nn.Module, module_filter: Callable[[str, nn.Module], bool] | None = None, *,
                    tp: int = 1) -> list[str]:
    """FQNs of the ``nn.Linear`` modules :func:`float8_linears` converts: hidden linears (not embeddings nor the
    output head, :func:`vescale.parallel.hidden_matrices`) whose weight dims are multiples of ``16 * tp`` (so that
    every TP shard keeps ``_scaled_mm``'s multiple-of-16 rule, whichever dim the plan splits), and which
    ``module_filter(fqn, module)`` (default: all) accepts."""
    hidden = set(hidden_matrices(model))
    out = []
    for fqn, module in model.named_modules():
        if not isinstance(module, nn.Linear) or f"{fqn}.weight" not in hidden:
            continue
        if any(n % (16 * tp) for n in module.weight.shape):
            continue
        if module_filter is None or module_filter(fqn, module):
            out.append(fqn)
    return out


def float8_linears(model: nn.Module, recipe: str = "tensorwise", *, tp: int = 1, fsdp_float8_all_gather: bool = False,
                   module_filter: Callable[[str, nn.Module], bool] | None = None) -> list[str]:
    """Swap the linears of :func:`fp8_linear_fqns` for torchao ``Float8Linear`` s (dynamic ``recipe`` scaling,
    in place, keeping their parameters and FQNs); returns the converted FQNs.

    Call it on the unsharded model, before tensor parallelism over ``tp`` ranks (vescale's fast path then leaves the
    converted blocks to DTensor ops) and before ZeRO 3; ``fsdp_float8_all_gather`` (tensor-wise, tp == 1) makes
    FSDP2 all-gather their weights in fp8. No collectives. Raises :class:`~vescale.parallel.Fp8Error` when torchao
    is missing, the recipe is unknown or row-wise with ``tp > 1``, a weight is already a DTensor, or fp8 all-gather
    is asked for with row-wise scaling or ``tp > 1``.
    """
    problem = _torchao_problem() or (None if recipe in FP8_RECIPES else
                                     f"fp8 recipe {recipe!r} is not one of {list(FP8_RECIPES)}")
    if problem is None and recipe == "rowwise" and tp > 1:
        problem = fp8_problems(recipe, tp=tp)[0]
    if problem is None and fsdp_float8_all_gather and (recipe != "tensorwise" or tp > 1):
        problem = (f"fp8 all-gather under ZeRO 3 needs tensorwise scaling and tp == 1, got {recipe!r} with tp={tp} "
                   "(torchao's amax all-reduce has no DTensor rule): all-gather in the weights' own dtype")
    if problem:
        raise Fp8Error(problem)
    from torch.distributed.tensor import DTensor
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    fqns = fp8_linear_fqns(model, module_filter, tp=tp)
    sharded = [f for f in fqns if isinstance(model.get_submodule(f).weight, DTensor)]
    if sharded:
        raise Fp8Error(f"{sharded[0]!r} already holds a DTensor weight: convert the linears to fp8 before tensor "
                       "parallelism (parallelize_module)")
    config = Float8LinearConfig.from_recipe_name(recipe)
    if fsdp_float8_all_gather:
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    chosen = set(fqns)
    convert_to_float8_training(model, config=config, module_filter_fn=lambda _m, fqn: fqn in chosen)
    return fqns
