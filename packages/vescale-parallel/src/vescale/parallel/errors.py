"""The errors :mod:`vescale.parallel` raises, one class per feature, all :class:`~vescale.core.errors.VescaleError`.

Plan errors are :class:`vescale.core.errors.PlanError` (shared by every package that reads plans).
"""

from __future__ import annotations

from vescale.core.errors import VescaleError

__all__ = ["DDPError", "ZeroError", "Zero3Error", "LossParallelError", "CompileError", "ActivationCheckpointError",
           "DataDependentError", "TokenIdError", "NonFiniteStepError", "Fp8Error"]


class DDPError(VescaleError, ValueError):
    """A module, mesh or option cannot be used by :class:`~vescale.parallel.DistributedDataParallel`."""


class ZeroError(VescaleError, ValueError):
    """A :class:`~vescale.parallel.DistributedOptimizer` cannot be built from, or loaded with, what it was given."""


class Zero3Error(VescaleError, ValueError):
    """The mesh or block pattern given to :func:`~vescale.parallel.fully_shard_dp` cannot be used."""


class LossParallelError(VescaleError, ValueError):
    """The logits/target layout does not suit vocab-parallel cross-entropy."""


class CompileError(VescaleError, ValueError):
    """A model cannot be compiled as asked (no blocks found, dropout active in a block, bad arguments)."""


class ActivationCheckpointError(VescaleError, ValueError):
    """:func:`~vescale.parallel.checkpoint_activations` was given an unknown policy, a pattern naming no block, or a
    block that is already checkpointed."""


class DataDependentError(VescaleError, RuntimeError):
    """Model code inside a parallelized ``forward`` reads a DTensor's values into Python (``.tolist()``), which
    DTensor cannot follow (data-dependent control flow such as MoE routing by counts)."""


class ContextParallelError(VescaleError, ValueError):
    """:func:`~vescale.parallel.context_parallel` cannot shard this model or call over ``cp`` exactly (a sequence length
    not divisible by ``2 x cp``, padding masks, a KV cache, attention dropout, an unsupported attention)."""


class ExpertParallelError(VescaleError, ValueError):
    """A mesh, model or plan that :func:`~vescale.parallel.parallelize_experts` cannot use (no ``ep`` dim, no
    experts, ``ep`` not dividing the number of experts)."""


class TokenIdError(VescaleError, IndexError):
    """A token id is outside an embedding's vocabulary ``[0, vocab_size)``: one device's lookup raises
    ``IndexError`` there, a vocab-parallel lookup would read zeros. The message names the id, the vocabulary size and
    the embedding; every rank holding a piece of the ids raises it (see
    :func:`vescale.parallel.model_calls.check_token_ids`)."""


class NonFiniteStepError(VescaleError, RuntimeError):
    """More consecutive optimizer steps had a non-finite loss or gradient norm on some rank than a
    :class:`~vescale.parallel.step_guard.StepGuard` allows (raised on every rank; the state is the last good step's)."""


class Fp8Error(VescaleError, ValueError):
    """FP8 linears (:mod:`vescale.parallel.fp8`) cannot run as asked: torchao missing, a recipe or placement that
    does not compose, or a device without an fp8 matmul."""
