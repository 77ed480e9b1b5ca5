"""A group of long-lived rank processes joined in one process group, that run functions on every rank.

Both :func:`vescale.core.launch.spawn` (one group, one call) and the test harness (one group per world size, many
calls) are built on :class:`WorkerGroup`. The parent owns a ``TCPStore`` the ranks rendezvous on, so there is no
race for a free port. Each rank talks to the parent over its own pipe: the parent sends a task, the rank answers
with a result or a traceback. The parent never blocks without a deadline; a rank that hangs is asked for its Python
stack (``faulthandler`` on SIGUSR1), then the whole group is killed.
"""

from __future__ import annotations

import contextlib
import faulthandler
import importlib
import importlib.util
import inspect
import io
import multiprocessing as mp
import os
import pickle
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any

from vescale.core.errors import RankError, RankTimeoutError

# How long the other ranks get to report after one rank failed, before the group is declared broken and killed.
# Ranks that fail together (an assertion on every rank) report within this window and the group survives.
_FAILURE_GRACE_S = 2.0
_COLLECTIVE_TIMEOUT = timedelta(seconds=900)
# How long the ranks may take to start and join the group: a guard against a hang, not a timing. A rank's first
# import of torch from a venv installed without bytecode (nox's --no-compile) compiles every module it imports; two
# ranks doing so on a loaded 2-core machine took more than 120 s (a first `nox -s train` failed at start-up).
_START_TIMEOUT_S = 600.0


def default_backend(world_size: int) -> str:
    """``nccl`` when this host has a GPU per rank, else ``gloo``."""
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() >= world_size:
        return "nccl"
    return "gloo"


# ----------------------------------------------------------------------------------------------------------------
# Referring to a function by where it lives, so that test modules imported by pytest under any import mode (and a
# script's __main__) resolve in the rank processes.


def _function_ref(fn: Callable) -> tuple:
    if inspect.isfunction(fn) and "<locals>" not in fn.__qualname__:
        file = getattr(sys.modules.get(fn.__module__), "__file__", None) or inspect.getfile(inspect.unwrap(fn))
        return ("ref", fn.__module__, fn.__qualname__, file)
    try:
        return ("pickle", pickle.dumps(fn))
    except Exception as exc:  # noqa: BLE001 - re-raised with the reason a user can act on
        raise TypeError(
            f"cannot send {fn!r} to the rank processes: it must be a module-level function "
            f"(or picklable callable); pickling failed with {exc}"
        ) from exc


def _load_module(name: str, file: str | None):
    if name == "__main__":
        main = sys.modules.get("__mp_main__")
        if main is not None:
            return main
    else:
        mod = sys.modules.get(name)
        if mod is not None and (file is None or os.path.samefile(getattr(mod, "__file__", file) or file, file)):
            return mod
        try:
            mod = importlib.import_module(name)
            if file is None or os.path.samefile(mod.__file__, file):
                return mod
        except Exception:  # noqa: BLE001 - fall back to loading the file itself
            pass
    if file is None:
        raise ImportError(f"cannot import module {name!r} in the rank process")
    alias = name if name != "__main__" else "__vescale_main__"
    spec = importlib.util.spec_from_file_location(alias, file)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[alias] = mod
    spec.loader.exec_module(mod)
    return mod


def _resolve(ref: tuple) -> Callable:
    if ref[0] == "pickle":
        return pickle.loads(ref[1])
    _, module, qualname, file = ref
    obj: Any = _load_module(module, file)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    # The test decorator replaces a test body by a pytest-facing wrapper; run the body itself.
    return getattr(obj, "__vescale_body__", obj)


# ----------------------------------------------------------------------------------------------------------------
# The rank side.


def _worker_main(rank: int, world_size: int, store_port: int, backend: str, conn: Connection, threads: int,
                 capture: bool, stack_file: str) -> None:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store_port),
    )
    stack_out = open(stack_file, "w")  # noqa: SIM115 - lives as long as the process
    faulthandler.register(signal.SIGUSR1, file=stack_out, all_threads=True)

    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    try:
        store = dist.TCPStore("127.0.0.1", store_port, world_size + 1, is_master=False,
                              timeout=timedelta(seconds=120))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=_COLLECTIVE_TIMEOUT)
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises
        conn.send(("err", None, traceback.format_exc(), ""))
        return
    conn.send(("ready", None, None, ""))
    default_dtype = torch.get_default_dtype()
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            break
        if msg is None:
            break
        task_id, ref, payload, parent_path = msg
        for entry in reversed(parent_path):
            if entry not in sys.path:
                sys.path.insert(0, entry)
        out = io.StringIO()
        redirect = (contextlib.redirect_stdout(out), contextlib.redirect_stderr(out)) if capture else ()
        try:
            with contextlib.ExitStack() as stack:
                for r in redirect:
                    stack.enter_context(r)
                fn = _resolve(ref)
                args, kwargs = pickle.loads(payload)
                result = fn(*args, **kwargs)
            reply = ("ok", task_id, pickle.dumps(result), out.getvalue())
        except BaseException:  # noqa: BLE001 - every failure goes back to the parent
            reply = ("err", task_id, traceback.format_exc(), out.getvalue())
        finally:
            torch.set_default_dtype(default_dtype)
            torch.set_grad_enabled(True)
        try:
            conn.send(reply)
        except Exception:  # noqa: BLE001 - an unpicklable result
            conn.send(("err", task_id, f"result of rank {rank} is not picklable:\n{traceback.format_exc()}",
                       out.getvalue()))
        if not dist.is_initialized():
            # The task tore the process group down; this process cannot serve another task.
            break
    with contextlib.suppress(Exception):
        if dist.is_initialized():
            dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------------------------
# The parent side.


class WorkerGroup:
    """``world_size`` rank processes in one process group, each running tasks sent by this process.

    ``run`` is synchronous and never hangs: it returns every rank's result, or raises :class:`RankError` (a rank
    raised or died) or :class:`RankTimeoutError`. After a failure in which some rank did not report back, the group
    is closed (``alive`` becomes false) because its process group can no longer be trusted.

    ``start_method`` is ``"spawn"`` (a fresh interpreter per rank: each imports torch itself, about 2 s) or
    ``"forkserver"``: the ranks are forked from multiprocessing's fork server of this process, which imports the
    modules of ``preload`` once when it starts (the first group to use it decides them), so a rank starts with them
    loaded. A forked rank inherits the fork server's environment and working directory (those of this process when
    the server started), not those of this process at the time of the fork.
    """

    def __init__(self, world_size: int, *, backend: str | None = None, capture_output: bool = False,
                 start_timeout: float = _START_TIMEOUT_S, start_method: str = "spawn",
                 preload: tuple[str, ...] = ()) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if start_method not in ("spawn", "forkserver"):
            raise ValueError(f"start_method must be 'spawn' or 'forkserver', got {start_method!r}")
        if preload and start_method != "forkserver":
            raise ValueError(f"preload {preload} needs start_method='forkserver', got {start_method!r}")
        import torch.distributed as dist

        self.world_size = world_size
        self.backend = backend or default_backend(world_size)
        self._store = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True, wait_for_workers=False,
                                    timeout=timedelta(seconds=120))
        threads = max(1, (os.cpu_count() or 1) // world_size)
        ctx = mp.get_context(start_method)
        if preload:
            ctx.set_forkserver_preload(list(preload))  # no effect once the fork server runs
        self._tmpdir = tempfile.TemporaryDirectory(prefix="vescale-workers-")
        self._conns: list[Connection] = []
        self._procs: list[mp.Process] = []
        self._stack_files: list[str] = []
        self._task_id = 0
        for rank in range(world_size):
            parent_end, child_end = ctx.Pipe(duplex=True)
            stack_file = os.path.join(self._tmpdir.name, f"stack-{rank}.txt")
            proc = ctx.Process(
                target=_worker_main,
                args=(rank, world_size, self._store.port, self.backend, child_end, threads, capture_output,
                      stack_file),
                name=f"vescale-rank-{rank}", daemon=True,
            )
            proc.start()
            child_end.close()
            self._conns.append(parent_end)
            self._procs.append(proc)
            self._stack_files.append(stack_file)
        self.alive = True
        try:
            self._collect(None, time.monotonic() + start_timeout, what="start-up")
        except BaseException:
            self.close()
            raise

    # -- running --------------------------------------------------------------------------------------------------

    def run(self, fn: Callable, args: tuple = (), kwargs: dict | None = None, *, timeout: float = 300.0) -> list:
        """Run ``fn(*args, **kwargs)`` on every rank; return the per-rank results, rank order."""
        if not self.alive:
            raise RuntimeError("this WorkerGroup was closed after a failure; make a new one")
        ref = _function_ref(fn)
        payload = pickle.dumps((tuple(args), dict(kwargs or {})))
        self._task_id += 1
        for conn in self._conns:
            conn.send((self._task_id, ref, payload, list(sys.path)))
        return self._collect(self._task_id, time.monotonic() + timeout, what=getattr(fn, "__qualname__", repr(fn)))

    def _collect(self, task_id: int | None, deadline: float, *, what: str) -> list:
        pending = set(range(self.world_size))
        results: list[Any] = [None] * self.world_size
        failures: dict[int, tuple[str, str]] = {}
        outputs: dict[int, str] = {}
        by_conn = {conn: r for r, conn in enumerate(self._conns)}
        by_sentinel = {p.sentinel: r for r, p in enumerate(self._procs)}
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            ready = wait([self._conns[r] for r in pending] + [self._procs[r].sentinel for r in pending], remaining)
            for obj in ready:
                if obj in by_conn:
                    rank = by_conn[obj]
                    if rank not in pending:
                        continue
                    try:
                        kind, tid, body, out = obj.recv()
                    except (EOFError, OSError):
                        pending.discard(rank)
                        failures[rank] = ("died", "")
                        continue
                    if tid != task_id and kind != "err":
                        continue
                    pending.discard(rank)
                    outputs[rank] = out
                    if kind == "ok":
                        results[rank] = pickle.loads(body) if body is not None else None
                    elif kind == "ready":
                        pass
                    else:
                        failures[rank] = ("raised", body)
                else:
                    rank = by_sentinel[obj]
                    if rank in pending and not _has_message(self._conns[rank]):
                        pending.discard(rank)
                        failures[rank] = ("died", "")
            if failures and pending:
                deadline = min(deadline, time.monotonic() + _FAILURE_GRACE_S)
        stacks = self._dump_stacks(sorted(pending))
        for rank, (kind, _) in failures.items():
            if kind == "died":  # a dying torch process can take a moment to be reaped
                self._procs[rank].join(10.0)
                failures[rank] = (kind, f"process exited with code {self._procs[rank].exitcode}")
        if pending or any(not p.is_alive() for p in self._procs):
            # Some rank is stuck in (or gone from) the process group: nothing can run on this group any more.
            self.close()
            if pending and not failures:
                ranks = sorted(pending)
                raise RankTimeoutError(
                    f"{what}: rank(s) {ranks} of {self.world_size} did not finish in time; the ranks were killed.\n"
                    + stacks + _format_outputs(outputs),
                    ranks=ranks,
                )
        if failures:
            rank = min(failures)
            kind, text = failures[rank]
            others = sorted(set(failures) - {rank})
            also = f" (rank(s) {others} failed too)" if others else ""
            hung = f" (rank(s) {sorted(pending)} were still running and were killed)" if pending else ""
            raise RankError(
                f"{what}: rank {rank} of {self.world_size} {kind}{also}{hung}:\n{text}" + _format_outputs(outputs),
                rank=rank, remote_traceback=text if kind == "raised" else "",
            )
        return results

    def _dump_stacks(self, ranks: list[int]) -> str:
        if not ranks:
            return ""
        for r in ranks:
            with contextlib.suppress(Exception):
                os.kill(self._procs[r].pid, signal.SIGUSR1)
        time.sleep(0.3)
        parts = []
        for r in ranks:
            with contextlib.suppress(Exception), open(self._stack_files[r]) as f:
                text = f.read().strip()
                if text:
                    parts.append(f"--- Python stack of rank {r} when it was killed ---\n{text}\n")
        return "".join(parts)

    # -- teardown -------------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop every rank: politely if they are idle, by force if not. Idempotent."""
        if not self._procs:
            return
        self.alive = False
        for conn in self._conns:
            with contextlib.suppress(Exception):
                conn.send(None)
        deadline = time.monotonic() + 2.0
        for p in self._procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []
        self._tmpdir.cleanup()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def __enter__(self) -> WorkerGroup:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _has_message(conn: Connection) -> bool:
    try:
        return conn.poll()
    except (EOFError, OSError):
        return False


def _format_outputs(outputs: dict[int, str]) -> str:
    parts = [f"--- output of rank {r} ---\n{text.rstrip()}\n" for r, text in sorted(outputs.items()) if text.strip()]
    return ("\n" + "".join(parts)) if parts else ""
