"""What vescale.dtensor adds to torch's DTensor dispatch, installed on first use, never at import.

Importing :mod:`vescale.dtensor` leaves torch as shipped. The first call that makes or reshards a DTensor through
vescale (``distribute_tensor``, ``from_local``, ``redistribute``, ``full_tensor``, ``materialize``) calls
:func:`install`, which adds, once:

- the sharding rules torch lacks (:mod:`vescale.dtensor.sharding_rules`: CPU flash attention, ``_grouped_mm``);
- the view rules for interleaved and ragged inputs (:mod:`vescale.dtensor.view_rules`);
- strict mode's check in torch's implicit-redistribution hook (:mod:`vescale.dtensor.strict`; a no-op unless strict
  mode is on; ``strict()`` and ``is_strict()`` install this one themselves too).

The counter RNG's handlers are installed by :func:`vescale.dtensor.random.manual_seed` itself.
"""

from __future__ import annotations

__all__ = ["install", "is_installed"]

_installed = False


def install() -> None:
    """Install vescale's sharding rules, view rules and strict-mode hook into torch's DTensor (idempotent)."""
    global _installed
    if _installed:
        return
    # module attributes, not ``vescale.dtensor.strict`` (the package re-exports the strict() function under that name)
    from vescale.dtensor.sharding_rules import install as install_sharding_rules
    from vescale.dtensor.strict import install as install_strict_hook
    from vescale.dtensor.view_rules import install as install_view_rules

    install_sharding_rules()
    install_view_rules()
    install_strict_hook()
    _installed = True


def is_installed() -> bool:
    """Whether :func:`install` has run in this process."""
    return _installed
