"""The pytest plugin of vescale's multi-rank test harness (registered through the ``pytest11`` entry point).

It stops the pooled rank processes when the session ends and offers the ``ranks`` fixture, a callable with the
signature of :func:`vescale.core.testing.run_on_ranks`, for tests that run several functions on ranks.

``pytest --cpu-durations=N`` lists the N tests (0: all) that used the most CPU seconds, counted over the test process,
the pooled ranks and every child process the test waited for (``launch.spawn`` ranks, subprocesses and theirs). On a
shared, loaded machine wall-clock durations swing with the load; CPU time is what a test costs on idle cores.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from vescale.core import testing
from vescale.core.testing import run_on_ranks, shutdown_pools


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--cpu-durations", type=int, default=None, metavar="N",
                     help="list the N tests (0: all) that used the most CPU seconds: the test process, its pooled "
                          "ranks and the child processes it waited for")


_CPU = pytest.StashKey[dict]()


def _process_cpu(pid: int) -> float:
    """User + system CPU seconds of a live process (0 when it is gone or ``/proc`` is missing)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime (fields 14, 15)


def _cpu_now() -> float:
    """CPU seconds so far of this process, its reaped descendants and the pooled ranks alive now.

    A pooled rank that exits and is reaped between two readings moves its whole time into the reaped children's, so
    the difference of two readings still counts it once.
    """
    t = os.times()
    pooled = sum(_process_cpu(pid) for size in list(testing._pools) for pid in testing.pool_pids(size))
    return t.user + t.system + t.children_user + t.children_system + pooled


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    if item.config.getoption("cpu_durations") is None:
        yield
        return
    start = _cpu_now()
    yield
    item.config.stash.setdefault(_CPU, {})[item.nodeid] = _cpu_now() - start  # setup (fixtures), call, teardown


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    n = config.getoption("cpu_durations")
    if n is None:
        return
    spent = sorted(config.stash.get(_CPU, {}).items(), key=lambda kv: -kv[1])
    terminalreporter.write_sep("=", f"CPU seconds per test (setup + call + teardown), {sum(v for _, v in spent):.1f} "
                                    f"in all")
    for nodeid, seconds in spent[:n or None]:
        terminalreporter.write_line(f"{seconds:8.2f}  {nodeid}")


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
