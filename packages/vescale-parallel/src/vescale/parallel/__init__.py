"""vescale.parallel: tensor, sequence and data parallelism for unmodified models.

``parallelize_module`` driven by a regex-FQN plan (TP and SP) with example plans for common model families,
Megatron-style DDP with bucketed, overlapped gradient reduction, a ZeRO 1/2 DistributedOptimizer (ZeRO 3 through
torch's ``fully_shard``), vocab-parallel loss, gradient clipping over nD meshes, ``parallelize_stage`` for captured
pipeline stages, compile mode (per block, whole model, pipeline stages), and activation checkpointing per block
(``checkpoint_activations``: full or selective, dropout masks replayed bitwise by vescale's RNG).
"""

from __future__ import annotations

from vescale.parallel import clip_grad as _clip_grad
from vescale.parallel.activation_checkpoint import (  # activation checkpointing
    ActivationCheckpointError,
    checkpoint_activations,
    checkpointed_blocks,
)
from vescale.parallel.clip_grad import clip_grad_norm_, grad_norm  # part 2: DP/ZeRO
from vescale.parallel.compile import (  # compile mode
    block_graph_breaks,
    compile_forward,
    compile_parallel,
    compiled_blocks,
)
from vescale.parallel.context_parallel import context_parallel, gather_sequence  # context parallelism
from vescale.parallel.ddp import DDPOptions, DistributedDataParallel  # part 2: DP/ZeRO
from vescale.parallel.errors import (
    CompileError,
    ContextParallelError,
    DDPError,
    ExpertParallelError,
    Fp8Error,
    LossParallelError,
    TokenIdError,
    Zero3Error,
    ZeroError,
)
from vescale.parallel.experts import (  # expert parallelism
    capacity_keep,
    expert_parallel_plan,
    experts_as_operator,
    find_experts,
    keep_local_experts,
    parallelize_experts,
)
from vescale.parallel.fp8 import FP8_RECIPES, float8_linears, fp8_linear_fqns, fp8_problems  # FP8 linears
from vescale.parallel.kv_replicas import replicate_kv_heads  # part 1: TP/SP (GQA, kv heads < tp)
from vescale.parallel.loss import loss_parallel, vocab_parallel_cross_entropy  # part 1: TP/SP
from vescale.parallel.matrix_optimizer import DistributedMatrixOptimizer, MatrixOptimizer  # Muon under ZeRO, TP
from vescale.parallel.muon import hidden_matrices, matrix_owners  # Muon under ZeRO, TP
from vescale.parallel.optimizer import DistributedOptimizer  # part 2: DP/ZeRO
from vescale.parallel.parallelize import parallelize_module, plan_report  # part 1: TP/SP
from vescale.parallel.plan_grammar import Plan, check_plan  # part 1: TP/SP
from vescale.parallel.plans import PLANS, gpt2_plan, gpt_plan, llama_plan, mixtral_plan, qwen2_plan  # part 1: TP/SP
from vescale.parallel.report import PlanEntry, PlanReport  # part 1: TP/SP
from vescale.parallel.stage import parallelize_stage  # pipeline stages (vescale-plan)
from vescale.parallel.state_dtype import STATE_DTYPES, low_precision_state, state_dtype_of  # bf16 optimizer state
from vescale.parallel.step_guard import NonFiniteStepError, StepGuard, skip_nonfinite_steps  # bad steps
from vescale.parallel.zero3 import fully_shard_dp, fully_shard_stage  # part 2: DP/ZeRO

__all__: list[str] = []
__all__ += ["DistributedDataParallel", "DDPOptions", "DDPError", "DistributedOptimizer", "ZeroError", "clip_grad_norm_",
            "grad_norm", "fully_shard_dp", "fully_shard_stage", "Zero3Error"]  # part 2: DP/ZeRO
__all__ += ["parallelize_module", "plan_report", "Plan", "check_plan", "PlanReport", "PlanEntry",
            "vocab_parallel_cross_entropy", "loss_parallel", "LossParallelError", "PLANS", "gpt_plan", "llama_plan",
            "qwen2_plan", "mixtral_plan", "gpt2_plan", "TokenIdError"]  # part 1: TP/SP
__all__ += ["replicate_kv_heads"]  # part 1: TP/SP (GQA with fewer kv heads than tp ranks)
__all__ += ["parallelize_stage"]  # pipeline stages (vescale-plan)
__all__ += ["compile_parallel", "compile_forward", "compiled_blocks", "block_graph_breaks",
            "CompileError"]  # compile mode
__all__ += ["checkpoint_activations", "checkpointed_blocks", "ActivationCheckpointError"]  # activation checkpointing
__all__ += ["parallelize_experts", "expert_parallel_plan", "find_experts", "capacity_keep", "experts_as_operator",
            "keep_local_experts", "ExpertParallelError"]  # expert parallelism
__all__ += ["context_parallel", "gather_sequence", "ContextParallelError"]  # context parallelism
__all__ += ["MatrixOptimizer", "DistributedMatrixOptimizer", "matrix_owners", "hidden_matrices"]  # Muon (ZeRO, TP)
__all__ += ["StepGuard", "skip_nonfinite_steps", "NonFiniteStepError"]  # bad steps skipped on every rank
__all__ += ["low_precision_state", "state_dtype_of", "STATE_DTYPES"]  # bf16 optimizer state
__all__ += ["float8_linears", "fp8_linear_fqns", "fp8_problems", "FP8_RECIPES", "Fp8Error"]  # FP8 linears (torchao)


def __getattr__(name: str):
    """The deprecated names of :mod:`vescale.parallel.clip_grad`, kept importable from here for one release."""
    if name in _clip_grad.DEPRECATED:
        return getattr(_clip_grad, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
