"""Installing the fast path on a module ``parallelize_module`` has just laid out: blocks, then layers, then models.

Contract: :func:`install_fast_path` only replaces the ``forward`` of modules it recognises (see :mod:`.block`,
:mod:`.layer`, :mod:`.model`) and whose plan entries qualify; the plan, its report, every hook and every parameter
stay as they are. Static checks only, no collective, the same decisions on every rank.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from torch import nn

from vescale.parallel.fast.block import block_layout, install_block
from vescale.parallel.fast.context import FastPathContext
from vescale.parallel.fast.layer import install_layer
from vescale.parallel.fast.model import install_model

__all__ = ["install_fast_path"]


def install_fast_path(module: nn.Module, mesh, inputs: dict, outputs: dict, local: dict, context: FastPathContext,
                      apply_outputs: Callable[[Any, Any, Any, str], Any]) -> None:
    """Install the fast path on ``module`` and its descendants. ``inputs``/``outputs``/``local`` map FQNs to
    ``(pattern, spec)`` of the plan's entries; ``context`` is the one the plan's hooks of ``module`` read;
    ``apply_outputs(out, spec, mesh, fqn)`` applies an ``output`` entry (what a block does at its row-parallel
    projection)."""
    mods = dict(module.named_modules())
    named = [*inputs, *outputs, *local]
    for fqn, mod in mods.items():
        if not fqn or fqn in local:
            continue
        layout = block_layout(mod, mesh)
        if layout is None:
            continue
        row = f"{fqn}.{layout.row}"
        if row in local:
            continue
        inside = any(n.startswith(fqn + ".") and not (n == row and n in outputs and n not in inputs) for n in named)
        row_spec = outputs.get(row, (None, None))[1]
        finish = functools.partial(_finish_row, apply_outputs=apply_outputs, spec=row_spec, mesh=mesh, fqn=row)
        install_block(mod, layout, mesh, inputs.get(fqn, (None, None))[1], row_spec, inside, finish, context)
    # then whole decoder layers whose two blocks both went fast
    for fqn, mod in mods.items():
        if fqn:
            install_layer(mod, mesh, [n[len(fqn) + 1:] if n != fqn else "" for n in named
                                      if n == fqn or n.startswith(fqn + ".")], context)
    # then whole causal LMs whose every layer went fast: relative FQNs
    for fqn, mod in mods.items():
        prefix = f"{fqn}." if fqn else ""
        inside = {n[len(prefix):]: spec for n, (_, spec) in inputs.items() if n.startswith(prefix) and n != fqn}
        after = {n[len(prefix):]: spec for n, (_, spec) in outputs.items() if n.startswith(prefix) and n != fqn}
        install_model(mod, mesh, inside, after, [n[len(prefix):] for n in named if n.startswith(prefix) and n != fqn],
                      context, own_output=outputs.get(fqn, (None, None))[1])


def _finish_row(out: Any, *, apply_outputs, spec, mesh, fqn: str) -> Any:
    return apply_outputs(out, spec, mesh, fqn)
