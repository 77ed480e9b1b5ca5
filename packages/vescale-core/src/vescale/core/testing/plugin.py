"""The pytest plugin of vescale's multi-rank test harness (registered through the ``pytest11`` entry point).

It stops the pooled rank processes when the session ends and offers the ``ranks`` fixture, a callable with the
signature of :func:`vescale.core.testing.run_on_ranks`, for tests that run several functions on ranks.
"""

from __future__ import annotations

import pytest

from vescale.core.testing import run_on_ranks, shutdown_pools


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs CUDA; skipped without it")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    shutdown_pools()


@pytest.fixture
def ranks():
    """``ranks(fn, world_size, *args, **kwargs)`` runs ``fn`` on pooled ranks and returns every rank's result."""
    return run_on_ranks
