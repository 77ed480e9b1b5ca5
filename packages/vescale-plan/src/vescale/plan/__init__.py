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

from vescale.plan.activations import ActivationBytes, ModelShape, activation_bytes, model_shape
from vescale.plan.auto_parallelize import (
    ParallelReport,
    auto_parallelize,
    choose_parallelism,
    language_model_loss,
)
from vescale.plan.auto_plan import AutoPlan, Decision, auto_plan, plan_from_trace
from vescale.plan.build import Parallelized, apply_dp, apply_ep, apply_pp, apply_tp, build, resolve_tp_plan
from vescale.plan.comm import CommCounter
from vescale.plan.cost import CostEstimate, HardwareModel, estimate
from vescale.plan.dry_run import DryRunReport, dry_run
from vescale.plan.errors import TraceError
from vescale.plan.explain import explain, explain_choice
from vescale.plan.hf_tp_plan import from_transformers_tp_plan
from vescale.plan.pipeline import PipelineSplit, build_pipeline, pipeline_split
from vescale.plan.spec import ParallelSpec, SpecError
from vescale.plan.trace import ModelTrace, trace_model
from vescale.plan.verify import PairCheck, verify_pairs

__all__ = ["auto_plan", "AutoPlan", "Decision", "plan_from_trace", "explain", "auto_parallelize",
           "choose_parallelism", "ParallelReport",
           "language_model_loss", "CostEstimate", "HardwareModel", "estimate", "PipelineSplit",
           "pipeline_split", "build_pipeline", "CommCounter", "trace_model", "ModelTrace", "TraceError",
           "verify_pairs", "PairCheck", "from_transformers_tp_plan", "explain_choice", "ModelShape", "model_shape",
           "ActivationBytes", "activation_bytes", "ParallelSpec", "SpecError", "build", "Parallelized", "apply_tp",
           "apply_ep", "apply_pp", "apply_dp", "resolve_tp_plan", "dry_run", "DryRunReport"]


def __getattr__(name: str):
    if name == "ParallelResult":  # the result of auto_parallelize before it went through build
        import warnings

        warnings.warn("vescale.plan.ParallelResult is now vescale.plan.Parallelized (what build and "
                      "auto_parallelize return)", DeprecationWarning, stacklevel=2)
        return Parallelized
    raise AttributeError(f"module 'vescale.plan' has no attribute {name!r}")
