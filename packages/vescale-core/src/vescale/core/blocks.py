"""The repeated blocks of a model (transformer layers): the one place that decides what a block is.

A *block* is a child of an ``nn.ModuleList``: by default of the model's longest one (``model.layers``,
``transformer.h``, ...; on a tie the first in ``named_modules`` order), the unit that compile mode compiles, ZeRO 3
shards one at a time and pipeline splits cut between. A regex ``pattern`` (full match over submodule FQNs, the root
excluded) names blocks explicitly instead. Each caller raises its own error when nothing is found.
"""

from __future__ import annotations

import re

from torch import nn

__all__ = ["find_blocks"]


def find_blocks(module: nn.Module, pattern: str | None = None, *, every_list: bool = False
                ) -> list[tuple[str, nn.Module]]:
    """``[(fqn, block), ...]`` in module order: the blocks of ``module`` (see the module docstring).

    - ``pattern``: every submodule whose FQN fully matches it (``re.error`` if it is not a regex).
    - default: the children of the longest ``nn.ModuleList`` (FQNs ``"<list fqn>.<i>"``).
    - ``every_list=True``: the children of every ``nn.ModuleList``, nested ones included (ZeRO 3's default, so that
      e.g. the experts inside a block are sharded as their own units too).

    Returns ``[]`` when nothing matches or ``module`` has no ``nn.ModuleList``.
    """
    if pattern is not None:
        rx = re.compile(pattern)
        return [(fqn, m) for fqn, m in module.named_modules() if fqn and rx.fullmatch(fqn)]
    lists = [(fqn, m) for fqn, m in module.named_modules() if isinstance(m, nn.ModuleList)]
    if not every_list:
        lists = [max(lists, key=lambda item: len(item[1]))] if lists else []
    return [(f"{fqn}.{name}" if fqn else name, block)
            for fqn, layers in lists for name, block in layers.named_children()]
