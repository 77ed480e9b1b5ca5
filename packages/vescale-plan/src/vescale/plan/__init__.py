"""vescale.plan: automatic TP/SP/PP plans and mesh choice for unmodified models.

:func:`auto_plan` derives a ``parallelize_module`` plan from a model's traced structure on the meta device;
:func:`explain` prints it with the reason behind every placement (:func:`verify_pairs` checks its column/row pairs
numerically on a simulated mesh before :func:`auto_plan` returns); :func:`auto_parallelize` chooses the mesh, ZeRO
stage and pipeline split with a cost model and applies them through :func:`build`, the one composition of every
parallelism: a :class:`ParallelSpec` (plain data, JSON) in, the training-loop interface (:class:`Parallelized`) out.
:func:`dry_run` builds a spec for one rank of a large world in one process (fake process group, meta device);
``python -m vescale.plan`` is the planner CLI (:mod:`vescale.plan.cli`).
"""

from __future__ import annotations

import sys
import types

# name -> the module that defines it. ``import vescale.plan`` loads none of them: each is imported on first use
# (module ``__getattr__``, PEP 562), so ``from vescale.plan import build`` (tools/train.py at every rank start) pays
# for build and what it imports, not for the tracer, the planner and the cost model as well.
_WHERE = {
    "ActivationBytes": "activations", "ModelShape": "activations", "activation_bytes": "activations",
    "model_shape": "activations",
    "ParallelReport": "auto_parallelize", "auto_parallelize": "auto_parallelize",
    "choose_parallelism": "auto_parallelize", "language_model_loss": "auto_parallelize",
    "AutoPlan": "auto_plan", "Decision": "auto_plan", "auto_plan": "auto_plan", "plan_from_trace": "auto_plan",
    "Parallelized": "build", "apply_dp": "build", "apply_ep": "build", "apply_pp": "build", "apply_tp": "build",
    "build": "build", "resolve_tp_plan": "build",
    "CommCounter": "comm",
    "CostEstimate": "cost", "HardwareModel": "cost", "estimate": "cost", "estimate_spec": "cost",
    "DryRunReport": "dry_run", "dry_run": "dry_run",
    "document_inputs": "documents", "document_positions": "documents", "documents_from_eos": "documents",
    "TraceError": "errors",
    "explain": "explain", "explain_choice": "explain",
    "from_transformers_tp_plan": "hf_tp_plan",
    "PipelineSplit": "pipeline", "build_pipeline": "pipeline", "pipeline_split": "pipeline",
    "ParallelSpec": "spec", "SpecError": "spec",
    "ModelTrace": "trace", "trace_model": "trace",
    "IGNORE_INDEX": "token_mean", "token_scale": "token_mean", "token_sum": "token_mean",
    "PairCheck": "verify", "verify_pairs": "verify",
}

__all__ = ["auto_plan", "AutoPlan", "Decision", "plan_from_trace", "explain", "auto_parallelize",
           "choose_parallelism", "ParallelReport",
           "language_model_loss", "CostEstimate", "HardwareModel", "estimate", "estimate_spec", "PipelineSplit",
           "pipeline_split", "build_pipeline", "CommCounter", "trace_model", "ModelTrace", "TraceError",
           "verify_pairs", "PairCheck", "from_transformers_tp_plan", "explain_choice", "ModelShape", "model_shape",
           "ActivationBytes", "activation_bytes", "ParallelSpec", "SpecError", "build", "Parallelized", "apply_tp",
           "apply_ep", "apply_pp", "apply_dp", "resolve_tp_plan", "dry_run", "DryRunReport",
           "document_inputs", "document_positions", "documents_from_eos", "IGNORE_INDEX", "token_scale", "token_sum"]


def __getattr__(name: str):
    """The public name ``name``, imported from its module on first use (then cached in this module's globals)."""
    module = _WHERE.get(name)
    if module is not None:
        import importlib

        value = getattr(importlib.import_module(f"vescale.plan.{module}"), name)
        globals()[name] = value
        return value
    if name == "ParallelResult":  # the result of auto_parallelize before it went through build
        import warnings

        warnings.warn("vescale.plan.ParallelResult is now vescale.plan.Parallelized (what build and "
                      "auto_parallelize return)", DeprecationWarning, stacklevel=2)
        return __getattr__("Parallelized")
    raise AttributeError(f"module 'vescale.plan' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


class _Package(types.ModuleType):
    """This package's module type: importing a submodule named like the function it defines (``build``,
    ``auto_plan``, ``dry_run``, ...) binds the function, not the submodule, as the package attribute (what the eager
    ``from vescale.plan.build import build`` of the package's import did), so ``from vescale.plan import build``
    gives the function whichever import came first."""

    def __setattr__(self, name: str, value) -> None:
        if isinstance(value, types.ModuleType) and _WHERE.get(name) == name and value.__name__ == f"{__name__}.{name}":
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
