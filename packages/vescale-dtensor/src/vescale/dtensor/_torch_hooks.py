"""What vescale.dtensor adds to torch's DTensor dispatch, installed on first use, never at import.

Importing :mod:`vescale.dtensor` leaves torch as shipped. The first call that makes or reshards a DTensor through
vescale (``distribute_tensor``, ``from_local``, ``redistribute``, ``full_tensor``, ``materialize``) calls
:func:`install`, which adds, once:

- the sharding rules torch lacks (:mod:`vescale.dtensor.sharding_rules`: CPU flash attention, ``_grouped_mm``);
- the view rules for interleaved and ragged inputs (:mod:`vescale.dtensor.view_rules`);
- strict mode's check in torch's implicit-redistribution hook (:mod:`vescale.dtensor.strict`; a no-op unless strict
  mode is on; ``strict()`` and ``is_strict()`` install this one themselves too).

:func:`installed_ops` lists every ATen op whose entry in torch's tables :func:`install` changed, read from the tables
themselves (a diff of torch's strategy and handler tables around the install), and :func:`uninstall` puts torch's
own entries back: the tests run torch's op samples once with torch's stock rules and once with vescale's.

The counter RNG's handlers are installed by :func:`vescale.dtensor.random.manual_seed` itself.
"""

from __future__ import annotations

from typing import Any

__all__ = ["install", "is_installed", "uninstall", "installed_ops"]

_installed = False
_MISSING = object()
#: (table name, op) -> (torch's entry before install or _MISSING, vescale's entry after install or _MISSING)
_changes: dict[tuple[str, Any], tuple[Any, Any]] = {}


def _tables() -> dict[str, dict]:
    """torch's per-op DTensor tables that an install may change, by name."""
    from vescale.core import torch_internals

    propagator = torch_internals.sharding_propagator()
    return {"op_to_rules": propagator.op_to_rules,
            "op_strategy_funcs": propagator.op_strategy_funcs,
            "op_single_dim_strategy_funcs": propagator.op_single_dim_strategy_funcs,
            "op_to_schema_info": propagator.op_to_schema_info,
            "op_to_schema_info_for_single_dim_strategy": propagator.op_to_schema_info_for_single_dim_strategy,
            "custom_op_handlers": torch_internals.dtensor_custom_op_handlers()}


def install() -> None:
    """Install vescale's sharding rules, view rules and strict-mode hook into torch's DTensor (idempotent)."""
    global _installed
    if _installed:
        return
    # module attributes, not ``vescale.dtensor.strict`` (the package re-exports the strict() function under that name)
    from vescale.dtensor import sharding_rules, view_rules
    from vescale.dtensor.strict import install as install_strict_hook

    before = {name: dict(table) for name, table in _tables().items()}
    sharding_rules.install()
    view_rules.install()
    install_strict_hook()
    for name, table in _tables().items():
        for op in before[name].keys() | table.keys():
            old, new = before[name].get(op, _MISSING), table.get(op, _MISSING)
            if old is not new:
                _changes[(name, op)] = (_changes.get((name, op), (old, new))[0], new)
    _installed = True


def is_installed() -> bool:
    """Whether :func:`install` has run in this process (and :func:`uninstall` has not undone it since)."""
    return _installed


def installed_ops() -> dict[Any, tuple[str, ...]]:
    """The ATen ops whose DTensor behaviour :func:`install` replaced or added, each with the names of torch's tables
    it changed (``op_strategy_funcs``: a sharding strategy; ``custom_op_handlers``: a handler that runs instead of
    sharding propagation; ``op_single_dim_strategy_funcs``: torch's rule removed so vescale's is used). Installs
    first if needed."""
    install()
    out: dict[Any, list[str]] = {}
    for name, op in _changes:
        if name in ("op_to_schema_info", "op_to_schema_info_for_single_dim_strategy"):
            continue  # the cache keys of a strategy listed under its own table
        out.setdefault(op, []).append(name)
    return {op: tuple(sorted(names)) for op, names in out.items()}


def uninstall() -> None:
    """Put back torch's own entries that :func:`install` replaced (and remove the ones it added), and forget every
    cached sharding decision; the next vescale entry point installs again. Entries changed since by someone else are
    left alone. Strict mode's hook stays (it defers to torch's unless strict mode is on)."""
    global _installed
    if not _installed:
        return
    from vescale.core import torch_internals
    from vescale.dtensor import sharding_rules

    tables = _tables()
    for (name, op), (old, new) in _changes.items():
        if tables[name].get(op, _MISSING) is not new:
            continue
        if old is _MISSING:
            del tables[name][op]
        else:
            tables[name][op] = old
    sharding_rules._installed = False  # view_rules re-wraps whatever strategy torch's table holds
    torch_internals.clear_sharding_caches()
    _installed = False
