"""``save``: plan who writes which box, snapshot, write one safetensors file per writing rank, commit metadata.

Every rank describes the boxes it holds; identical boxes held by several ranks (replicas) are written once, by the
holder with the fewest bytes assigned so far, largest boxes first, so writing is spread evenly. The plan is cached
and reused while the state keeps the same structure (a one-integer all-reduce confirms it on every rank). An async
save snapshots the boxes this rank writes into a reused host buffer (pinned when on GPU) and returns; a background
thread writes, gathers the shard records and lets rank 0 commit ``metadata.json`` last, which makes the checkpoint
visible atomically; the replaced save's files are then deleted in the background.

In an async save, the tensors that only an optimizer step changes in place (trainable parameters and optimizer
state) are copied on the background thread, while the caller goes on with its next forward and backward; every
``torch.optim`` optimizer's ``step()`` waits until that copy is done first (a global step pre-hook), and a tensor
found changed in place before it was copied (its version counter moved, or its copy's bytes differ from the
fingerprint taken before ``save`` returned, which catches writes through ``.data``) fails the save (the previous
checkpoint stays). Everything else (buffers, plain tensors, values, strided pieces) is copied before ``save``
returns.

This module runs a save (the collective agreement, the background thread, the optimizer-step fence, committing);
the steps live in their own modules: :mod:`._save_plan` (who writes which box), :mod:`._snapshot` (copying to host
memory, now or in the background), :mod:`._data_file` (the data file, ``metadata.json``, stale files).
"""

from __future__ import annotations

import json
import os
import queue
import random
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from vescale.checkpoint import _snapshot, _values
from vescale.checkpoint._comm import Comm, io_threads
from vescale.checkpoint._data_file import commit_metadata, stale_files, write_data_file
from vescale.checkpoint._gc import collector_paused
from vescale.checkpoint._save_plan import WritePlan, assign_writers, describe
from vescale.checkpoint._snapshot import Deferred, Job, make_jobs, materialize, stage
from vescale.checkpoint._state import flatten
from vescale.checkpoint._storage import Storage
from vescale.checkpoint.errors import CheckpointError
from vescale.checkpoint.format import METADATA_FILE, data_file_name

__all__ = ["save", "SaveHandle"]


class SaveHandle:
    """A save in progress (async) or finished. ``wait()`` blocks until it is committed and re-raises its error;
    ``wait_snapshot()`` until this rank's data is copied to host memory, after which the state may change freely.
    ``fence_wait_s``: the seconds optimizer steps on this rank spent waiting for that copy."""

    def __init__(self, path: str, finished: threading.Event | None = None) -> None:
        self.path = path
        self._finished = finished
        self._snapshotted: threading.Event | None = None
        self.error: BaseException | None = None
        self._reported = False  # its error was raised to the caller once (a later save or load does not again)
        self.fence_wait_s = 0.0

    def done(self) -> bool:
        return self._finished is None or self._finished.is_set()

    def snapshot_done(self) -> bool:
        return self._snapshotted is None or self._snapshotted.is_set()

    def wait_snapshot(self, timeout: float | None = None) -> None:
        """Block until this rank's state is copied (a failed copy returns too; ``wait()`` raises its error).
        Needed only before changing saved tensors in place other than by ``optimizer.step()``, which waits itself."""
        if self._snapshotted is not None and not self._snapshotted.wait(timeout):
            raise TimeoutError(f"snapshot for checkpoint {self.path} still running after {timeout} s")

    def wait(self, timeout: float | None = None) -> None:
        """Block until the checkpoint is committed on every rank; raise what the save raised."""
        if self._finished is not None and not self._finished.wait(timeout):
            raise TimeoutError(f"checkpoint save to {self.path} still running after {timeout} s")
        if self.error is not None:
            self._reported = True
            raise self.error


_pending: SaveHandle | None = None
_worker: threading.Thread | None = None
_work: queue.SimpleQueue = queue.SimpleQueue()
_cleanup: threading.Thread | None = None
_cached: WritePlan | None = None
_fence_installed = False


@collector_paused
def save(path: str | os.PathLike, state: dict[str, Any], *, async_save: bool = False, compress: bool = False,
         storage_options: dict[str, Any] | None = None, threads: int | None = None) -> SaveHandle:
    """Save ``state`` to the checkpoint directory ``path`` (local path or fsspec URL); collective over all ranks.

    ``state`` maps names to modules, optimizers, tensors/DTensors, JSON-able values or stateful objects (see
    :mod:`vescale.checkpoint`). Plain tensors are taken to be replicated: one copy is written. With
    ``async_save=True`` it returns once the writers are planned and this rank's buffers, plain tensors and values are
    snapshotted to host memory; trainable parameters and optimizer state are copied in the background, and the
    next ``optimizer.step()`` of any ``torch.optim`` optimizer in this process waits for that copy. Changing those
    tensors in place any other way before ``handle.wait_snapshot()`` returns fails the save (a moved version counter,
    or bytes that differ from a fingerprint taken before ``save`` returns, as a write through ``.data`` leaves them;
    the previous checkpoint stays). The handle's ``wait()`` blocks until the checkpoint is committed (a later
    ``save`` or ``load`` waits for it first).
    ``compress=True`` stores each tensor zstd-compressed. ``threads``: I/O threads per rank (default: the host's
    CPUs divided among its ranks, 1 to 8). The checkpoint becomes visible only when complete; a
    previous checkpoint at ``path`` stays loadable until then and its data files are deleted after.
    """
    global _pending, _cached
    wait_pending()
    comm = Comm()
    error: Exception | None = None
    signature = ""
    try:
        flat = flatten(state)
        tensors = {k: materialize(t) for k, t in flat.tensors.items()}
        values = {k: _values.encode(v, k) for k, v in flat.values.items()}
        desc, pieces, dtypes = describe(flat, tensors)
        signature = json.dumps([comm.world, desc], separators=(",", ":"))
    except Exception as exc:  # noqa: BLE001 - bad input: every rank must learn of it, none may hang
        error = exc
    early: tuple[list[Job], Deferred | None] | None = None
    if async_save and error is None and _cached is not None and _cached.signature == signature:
        try:  # the cached plan holds here: snapshot now, while the ranks agree that it holds everywhere
            early = stage(_cached, make_jobs(_cached, pieces, dtypes, flat.stepped, tensors), io_threads(threads, comm))
        except Exception as exc:  # noqa: BLE001 - every rank must learn of it, none may hang
            error = exc
    miss, nonce, failed = comm.all_reduce_max([int(_cached is None or _cached.signature != signature),
                                               random.getrandbits(62), int(error is not None)])
    if error is not None:
        raise error
    if failed:
        raise CheckpointError(f"save to {os.fspath(path)} aborted: another rank rejected its state (see its error)")
    if miss:  # some rank's structure changed: plan again (a snapshot taken early is for the old plan)
        mine, table = assign_writers(comm.all_gather_json(desc), comm.rank)
        _cached = WritePlan(signature, mine, table)
        early = None
    plan = _cached
    save_id = f"{nonce:016x}"
    storage = Storage(path, storage_options)
    setup_error = None
    deferred: Deferred | None = None
    jobs: list[Job] = []
    try:  # a failure here (the directory, a host copy) is carried into _finish, which every rank reaches
        storage.makedirs()
        if async_save:
            if early is None:
                early = stage(plan, make_jobs(plan, pieces, dtypes, flat.stepped, tensors),
                              io_threads(threads, comm))
            jobs, deferred = early
        else:
            jobs = make_jobs(plan, pieces, dtypes, set(), tensors)
            for job in jobs:
                if job.source.device.type != "cpu" or not job.source.is_contiguous():
                    job.source = job.source.to("cpu", copy=False).contiguous()
    except Exception as exc:  # noqa: BLE001 - every rank must learn of it, none may hang
        setup_error = f"rank {comm.rank} could not prepare {storage.url}: {exc!r}"
        jobs, deferred = [], None
    handle = SaveHandle(storage.url)
    args = (handle, comm, storage, save_id, jobs, values, plan.tensors, compress, threads, deferred, setup_error)
    if not async_save:
        _finish(*args)
        handle.wait()
        return handle
    handle._finished = threading.Event()
    handle._snapshotted = threading.Event()
    if deferred is None:
        handle._snapshotted.set()
    else:
        _install_fence()
    _pending = handle
    _in_background(_finish, args, handle)
    return handle



def _install_fence() -> None:
    """Make every ``torch.optim`` optimizer step in this process wait for the background snapshot (once)."""
    global _fence_installed
    if not _fence_installed:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        register_optimizer_step_pre_hook(_fence)
        _fence_installed = True



def _fence(optimizer, args, kwargs) -> None:
    handle = _pending
    if handle is not None and not handle.snapshot_done():
        t0 = time.perf_counter()
        handle.wait_snapshot()
        handle.fence_wait_s += time.perf_counter() - t0



def _in_background(fn, args: tuple, handle: SaveHandle) -> None:
    """Run ``fn(*args)`` on this process's save thread, then mark ``handle`` snapshotted (never leaving an optimizer
    step waiting, whatever ``fn`` did) and finished. The thread is started once and kept:
    starting one per save would make ``save`` wait until the new thread first runs, which on a busy host is long."""
    global _worker
    if _worker is None or not _worker.is_alive():
        _worker = threading.Thread(target=_serve, name="vescale-checkpoint-save", daemon=True)
        _worker.start()
    _work.put((fn, args, handle))



def _serve() -> None:
    while True:
        fn, args, handle = _work.get()
        try:
            fn(*args)  # _finish keeps its own errors on the handle
        finally:
            handle._snapshotted.set()
            handle._finished.set()



def wait_pending() -> None:
    """Wait for this process's async save in flight and for the removal of replaced data files, if any
    (``save`` and ``load`` call it first); raise the save's error unless its ``wait()`` already did."""
    global _pending, _cleanup
    if _pending is not None:
        handle, _pending = _pending, None
        if not handle._reported:
            handle.wait()
    if _cleanup is not None:
        thread, _cleanup = _cleanup, None
        thread.join()



def _finish(handle: SaveHandle, comm: Comm, storage: Storage, save_id: str, jobs: list[Job], values: dict,
            tensors: dict, compress: bool, threads: int | None, deferred: Deferred | None,
            error: str | None = None) -> None:
    """Finish the snapshot, write, gather the records on every rank, commit on rank 0, and agree on the outcome
    (collective). ``error``: this rank already failed (it writes nothing but still takes part)."""
    records: list[dict] = []
    name = data_file_name(save_id, comm.rank)
    size = 0
    try:
        if deferred is not None:
            try:
                _snapshot.copy_deferred(deferred)
            except CheckpointError as exc:
                error = f"rank {comm.rank}: {exc}"
            finally:
                handle._snapshotted.set()
        if jobs and error is None:
            with ThreadPoolExecutor(io_threads(threads, comm)) as pool:
                records = write_data_file(storage, name, jobs, compress, pool)
            size = storage.size(name)
    except Exception as exc:  # noqa: BLE001 - reported to every rank below, then raised
        error = f"rank {comm.rank} failed writing {storage.where(name)}: {exc!r}\n{traceback.format_exc()}"
    try:
        gathered = comm.all_gather_json({"records": records, "values": values, "error": error,
                                         "file": [name, size] if jobs else None})
        errors = [g["error"] for g in gathered if g["error"]]
        status = b""
        if comm.rank == 0:
            if errors:
                status = errors[0].encode()
            else:
                try:
                    commit_metadata(storage, save_id, comm.world, gathered, tensors)
                except Exception as exc:  # noqa: BLE001 - reported to every rank
                    status = f"rank 0 failed to commit {storage.where(METADATA_FILE)}: {exc!r}".encode()
        status = comm.broadcast_bytes(status, 0)
        if status:
            raise CheckpointError(f"saving {storage.url} failed: {status.decode()}")
        if comm.rank == 0:  # the new checkpoint is committed: the previous save's files go, in the background
            _start_cleanup(storage, stale_files(storage, save_id))
    except BaseException as exc:  # noqa: BLE001 - kept for wait()
        handle.error = exc



def _start_cleanup(storage: Storage, names: list[str]) -> None:
    """Delete ``names`` on a background thread (unlinking large files is slow); the list is fixed at commit time,
    so files of a later save are never touched, and ``wait_pending`` joins the thread."""
    global _cleanup
    if names:
        _cleanup = threading.Thread(target=lambda: [storage.remove(n) for n in names], daemon=True,
                                    name="vescale-checkpoint-cleanup")
        _cleanup.start()

