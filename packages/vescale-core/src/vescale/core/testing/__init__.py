"""Multi-rank tests on CPU: a test body runs on N gloo ranks taken from a pool kept alive for the pytest session.

Spawning a torch process costs about 2 s, so the ranks of each world size are started once and reused by every test
of that size, and they are forked from a server process that imported torch and its DTensor stack once (see
:data:`START_METHOD`). Write the body as a module-level test function and decorate it::

    from vescale.core.testing import multi_rank

    @multi_rank(world_sizes=[1, 2, 4])
    def test_all_reduce(world_size):
        import torch, torch.distributed as dist
        t = torch.ones(3) * dist.get_rank()
        dist.all_reduce(t)
        assert t.tolist() == [sum(range(world_size))] * 3

The body runs on every rank of an initialised default process group (gloo; ``RANK``/``WORLD_SIZE`` set). Pytest
parameters and fixtures with picklable values (``tmp_path``) reach it as usual. A rank that raises fails the test with
that rank's traceback and captured output; a rank that hangs fails it after ``timeout`` seconds with its Python stack,
and the pool of that size is rebuilt so the next test runs. The return value of rank 0 is ignored by pytest.

:func:`run_on_ranks` is the same machinery as a plain call, returning every rank's result.

The single-device side of such comparisons (a reference training loop, microbatch-accumulated gradients, the
data-parallel loop to compare with it) is written once in :mod:`vescale.core.testing.reference`.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from vescale.core._workers import WorkerGroup

__all__ = ["multi_rank", "run_on_ranks", "shutdown_pools", "pool_pids", "imported_vescale_packages", "DEFAULT_TIMEOUT",
           "fails_if_hung", "spawn_on_pool"]

#: Seconds a test body may run on its ranks; override per test or with ``VESCALE_TEST_TIMEOUT``.
DEFAULT_TIMEOUT = float(os.environ.get("VESCALE_TEST_TIMEOUT", "300"))

#: How pooled ranks start (``VESCALE_TEST_START_METHOD``): ``forkserver`` (default) forks them from one server
#: process of the session that imported :data:`PRELOAD` once, so a rank starts in a fraction of a second instead of
#: importing torch and its DTensor stack itself (about 4 CPU seconds a rank, 15 ranks for world sizes 1, 2, 4, 8);
#: ``spawn`` starts each in a fresh interpreter.
START_METHOD = os.environ.get("VESCALE_TEST_START_METHOD", "forkserver")
#: What the fork server imports before forking ranks: what every multi-rank test imports anyway. Pooled ranks start
#: from the server's environment and working directory (this process's when the first pool started).
PRELOAD = ("torch", "torch.distributed", "torch.distributed.tensor", "vescale.core._workers")

_pools: dict[int, WorkerGroup] = {}


def _group(world_size: int) -> WorkerGroup:
    group = _pools.get(world_size)
    if group is None or not group.alive:
        group = WorkerGroup(world_size, backend=os.environ.get("VESCALE_TEST_BACKEND", "gloo"), capture_output=True,
                            start_method=START_METHOD, preload=PRELOAD if START_METHOD == "forkserver" else ())
        _pools[world_size] = group
    return group


def run_on_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float | None = None,
                 **kwargs: Any) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` pooled ranks; return the results in rank order.

    ``fn`` must be a module-level function. Raises :class:`~vescale.core.errors.RankError` or
    :class:`~vescale.core.errors.RankTimeoutError` as :meth:`WorkerGroup.run` does.
    """
    return _group(world_size).run(fn, args, kwargs, timeout=timeout or DEFAULT_TIMEOUT)


# What a pooled rank keeps of its own environment while it runs a spawned job: its place in the process group.
_RANK_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@contextlib.contextmanager
def spawn_on_pool() -> Iterator[None]:
    """Inside, :func:`vescale.core.launch.spawn` runs its job on this session's pooled ranks of that world size
    instead of starting fresh processes, so a program's own ``main`` (``tools/train.py``, ``tools/generate.py``)
    costs its work, not a process start per rank.

    Each rank runs the job as a freshly spawned rank would: in this process's working directory and environment
    (the fork server's are older), with the job's collective timeout; afterwards the rank's own working directory,
    environment and collective timeout are put back. ``spawn``'s ``timeout`` is capped at :data:`DEFAULT_TIMEOUT`.
    Raises ``ValueError`` for a ``backend`` other than the pool's. Not reentrant across threads.
    """
    from vescale.core import launch

    def run(task: Callable[..., Any], world_size: int, args: tuple, *, backend: str | None, timeout: float) -> Any:
        pool_backend = os.environ.get("VESCALE_TEST_BACKEND", "gloo")
        if backend not in (None, pool_backend):
            raise ValueError(f"spawn(backend={backend!r}) cannot run on the test pool, whose ranks use {pool_backend}")
        return run_on_ranks(_run_spawned, world_size, task, os.getcwd(), dict(os.environ), *args,
                            timeout=min(timeout, DEFAULT_TIMEOUT))[0]

    before = launch._spawn_runner
    launch._spawn_runner = run
    try:
        yield
    finally:
        launch._spawn_runner = before


def _run_spawned(task: Callable[..., Any], cwd: str, environ: dict[str, str], *args: Any) -> Any:
    """On a pooled rank: ``task(*args)`` in the spawning process's ``cwd`` and ``environ``; then restore the rank."""
    from vescale.core._workers import _COLLECTIVE_TIMEOUT
    from vescale.core.watchdog import set_collective_timeout

    own_cwd, own_env = os.getcwd(), dict(os.environ)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update({k: own_env[k] for k in _RANK_ENV if k in own_env})
    try:
        return task(*args)
    finally:
        os.chdir(own_cwd)
        os.environ.clear()
        os.environ.update(own_env)
        import torch.distributed as dist

        if dist.is_initialized():  # the task set the job's collective timeout on the default group
            set_collective_timeout(_COLLECTIVE_TIMEOUT.total_seconds())


def pool_pids(world_size: int) -> list[int]:
    """Process ids of the pooled ranks of ``world_size`` (empty when none is running); for tests of the pool."""
    group = _pools.get(world_size)
    return group.pids if group is not None and group.alive else []


def shutdown_pools() -> None:
    """Stop every pooled rank; the pytest plugin calls this at the end of the session."""
    while _pools:
        _, group = _pools.popitem()
        group.close()


def multi_rank(world_sizes: Iterable[int] | int = (2,), *, timeout: float | None = None):
    """Decorate a module-level test body to run on every rank, once per world size in ``world_sizes``.

    The body may take a ``world_size`` argument; it is parametrised by pytest either way. Everything else in its
    signature is resolved by pytest (parameters, fixtures) in the test process and sent to the ranks by pickle.
    """
    import pytest

    sizes = [world_sizes] if isinstance(world_sizes, int) else list(world_sizes)

    def decorate(body: Callable[..., Any]) -> Callable[..., None]:
        sig = inspect.signature(body)
        takes_world_size = "world_size" in sig.parameters
        params = list(sig.parameters.values())
        if not takes_world_size:
            params.append(inspect.Parameter("world_size", inspect.Parameter.KEYWORD_ONLY))

        @functools.wraps(body)
        def test(**kwargs: Any) -> None:
            world_size = kwargs["world_size"] if takes_world_size else kwargs.pop("world_size")
            _group(world_size).run(test, (), kwargs, timeout=timeout or DEFAULT_TIMEOUT)

        test.__signature__ = sig.replace(parameters=params)  # what pytest sees: the body's args + world_size
        del test.__wrapped__  # keep pytest from reading the body's signature instead
        test.__vescale_body__ = body  # what the ranks run when they resolve this test by name
        return pytest.mark.parametrize("world_size", sizes)(test)

    return decorate


def imported_vescale_packages(module: str) -> set[str]:
    """The ``vescale.<sub>`` packages loaded by ``import <module>`` in a fresh interpreter.

    Packages use it to prove they import no sibling they do not declare (see docs/architecture.md).
    """
    import subprocess
    import sys

    code = (f"import sys, {module}\n"
            "print(' '.join(sorted({m.split('.')[1] for m in sys.modules if m.startswith('vescale.')})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise ImportError(f"import {module} failed in a fresh interpreter:\n{out.stderr}")
    return set(out.stdout.split())


@contextlib.contextmanager
def fails_if_hung(seconds: float) -> Iterator[None]:
    """Fail the test, instead of hanging the run, if the body is still running after ``seconds`` (a guard against a
    hang, not a timing: keep it minutes above any wait the body expects). Main thread only (SIGALRM)."""
    import signal

    import pytest

    def hung(signum, frame):
        pytest.fail(f"still running after {seconds} s: the call hung", pytrace=False)

    previous = signal.signal(signal.SIGALRM, hung)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
