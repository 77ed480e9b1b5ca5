"""The fast path: recognised blocks of a tensor-parallel model run on local tensors between the plan's boundaries.

Where the plan gives an attention or gated-MLP block exactly Megatron's layout, it runs on plain local tensors
(:class:`FastBlock`); a decoder layer whose two blocks do runs whole (:class:`FastLayer`); a causal LM whose every
layer does runs from token ids to logits (:class:`FastModel`). Modules are recognised by structure (children,
parameters, placements, plan entries) among transformers' classes; see :mod:`.structure`. The plan, its report,
strict mode and the collectives do not change: forward values are bitwise the DTensor path's, gradients equal it to
rounding. No random op runs locally (:mod:`.random_guard`: refused at installation where the code names one, else
the first call in each mode takes the DTensor path and records what it draws). Each parallelized model keeps its
run-time state in its :class:`FastPathContext`; ``with fast_path(False):`` makes every block take the DTensor path.
``parallelize_module`` installs it (:func:`install_fast_path`).
"""

from __future__ import annotations

from vescale.parallel.fast.block import FastBlock
from vescale.parallel.fast.context import FastPathContext, fast_path, fast_path_enabled
from vescale.parallel.fast.install import install_fast_path
from vescale.parallel.fast.layer import FastLayer
from vescale.parallel.fast.model import FastModel
from vescale.parallel.fast.random_guard import RandomGuard

__all__ = ["FastBlock", "FastLayer", "FastModel", "FastPathContext", "RandomGuard", "fast_path", "fast_path_enabled",
           "install_fast_path"]
