"""Leave torch as found: tests that seed vescale's RNG route DTensor random ops to it; undo that after each test."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _restore_torch_rng_handlers():
    yield
    from vescale.dtensor import random

    random.uninstall()
