"""Keeping random ops off the fast path: on local tensors every rank would draw from torch's own generator.

Contract: a fast block, layer or model runs locally only where its forward draws no random number, shown twice.
At installation (static, no collective): the ``forward`` code of the module's class and of the classes of the
modules it runs locally (and every transformers method that code names, as :func:`~.structure.shapes_from_input`
walks it) names no random function (:data:`RANDOM_NAMES`; dropout may be named where a ``*dropout*`` field holds its
probability, read per call, see :func:`random_code`), and recognition admits no ``nn.Dropout*`` submodule;
otherwise it is not installed. At run time
(:class:`RandomGuard`): the first call in training mode and the first in eval mode that would run locally take the
DTensor path instead (vescale's counter RNG draws there, or ``UndrawnRandomError`` refuses), under a dispatch mode
that records every op drawing random numbers (torch's ``nondeterministic_seeded`` tag; attention and RNN kernels only
with a nonzero dropout); calls in that mode then run locally only if it recorded none, from the first call
outside a backward pass (an activation-checkpointing recomputation of the probed call takes the probe's path).
Each later call costs one dict lookup. Dropout probabilities in config fields are read per call as before
(:func:`~.structure.dropout_active`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from vescale.core import torch_internals
from vescale.parallel.fast.structure import code_names

__all__ = ["RANDOM_NAMES", "random_names", "random_code", "RandomGuard"]

#: names of torch's random functions and methods (``torch.*``, ``F.*``, ``Tensor.*``): a ``forward`` naming one may
#: draw random numbers (its probability cannot be shown zero statically), so it is not run on local tensors
RANDOM_NAMES = frozenset({
    "dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout", "native_dropout",
    "rand", "rand_like", "randn", "randn_like", "randint", "randint_like", "randperm", "bernoulli", "bernoulli_",
    "normal", "normal_", "uniform_", "exponential_", "geometric_", "cauchy_", "log_normal_", "random_",
    "multinomial", "poisson", "rrelu", "rrelu_", "gumbel_softmax", "binomial"})

# dropout functions: a forward naming one is trusted statically only if a ``*dropout*`` field exists (see random_code)
_DROPOUT_NAMES = frozenset(name for name in RANDOM_NAMES if "dropout" in name)

# seeded kernels that draw only with a nonzero dropout argument (fused attention, RNNs)
_CONDITIONAL = ("attention", "sdp", "rnn", "lstm", "gru", "cudnn", "miopen")
_DROPOUT_ARGS = ("dropout_p", "dropout", "p")


def random_names(*modules: nn.Module) -> frozenset[str]:
    """The :data:`RANDOM_NAMES` the ``forward`` code of ``modules``' classes names (see :func:`.code_names`)."""
    found: set[str] = set()
    for module in modules:
        names = code_names(type(module))
        found |= RANDOM_NAMES & (names if names is not None else RANDOM_NAMES)
    return frozenset(found)


def random_code(modules: tuple[nn.Module, ...], dropout_fields: tuple) -> frozenset[str]:
    """The random functions the ``forward`` code of ``modules`` names that no per-call check covers: every one but
    dropout, and dropout too where ``dropout_fields`` (see :func:`~.structure.dropout_fields`) is empty (its
    probability is then a literal or read from elsewhere). A dropout whose probability sits in such a field is read per
    call (:func:`~.structure.dropout_active`) and, if it comes from somewhere else, drawn on the first probed call."""
    names = random_names(*modules)
    return names - _DROPOUT_NAMES if dropout_fields else names


def _draws(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether the seeded op ``func`` draws with these arguments (a fused attention or RNN kernel: only with a
    nonzero dropout)."""
    if not any(word in func.name() for word in _CONDITIONAL):
        return True
    for i, arg in enumerate(torch_internals.op_schema(func).arguments):
        if arg.name in _DROPOUT_ARGS:
            value = args[i] if i < len(args) else kwargs.get(arg.name, 0)
            return bool(value)
    return False


class _RandomOps(torch_internals.TorchDispatchMode):
    """Records the random ops dispatched inside (on plain tensors and DTensors alike)."""

    def __init__(self) -> None:
        super().__init__()
        self.found: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.Tag.nondeterministic_seeded in func.tags and _draws(func, args, kwargs):
            self.found.add(str(func))
        return func(*args, **kwargs)


class RandomGuard:
    """A fast object's run-time random-op check (see the module docstring). ``found[training]``: None before the
    first call in that mode was probed, else the sorted names of the random ops its forward dispatched there
    (``()``: none, the fast path may run)."""

    __slots__ = ("found", "_settled")

    def __init__(self) -> None:
        self.found: dict[bool, tuple[str, ...] | None] = {True: None, False: None}
        self._settled = {True: False, False: False}

    def clean(self, module: nn.Module) -> bool:
        """Whether a call of ``module`` in its current mode may run locally: that mode was probed and drew nothing,
        and a call outside a backward pass has come since. Until then a call inside a backward pass is the
        activation-checkpointing recomputation of the probed call, which must take the probe's (DTensor) path to
        recompute the same tensors."""
        training = module.training
        if self.found[training] != ():
            return False
        if not self._settled[training]:
            if torch_internals.torch_graph_task_id() >= 0:
                return False
            self._settled[training] = True
        return True

    def dtensor_path(self, module: nn.Module, orig: Callable, args: tuple, kwargs: dict) -> Any:
        """``orig(*args, **kwargs)`` on the DTensor path; the first call in ``module``'s mode is probed."""
        training = module.training
        if self.found[training] is not None:
            return orig(*args, **kwargs)
        probe = _RandomOps()
        with probe:
            out = orig(*args, **kwargs)
        self.found[training] = tuple(sorted(probe.found))
        return out
