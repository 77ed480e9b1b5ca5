"""vescale.checkpoint against torch.distributed.checkpoint (DCP) on the same model plus AdamW state.

    python tools/bench/checkpoint.py [--size-mb 256] [--small] [--dir /tmp]

4 ranks on a dp x tp = 2 x 2 mesh hold a stack of square linears (TP: colwise/rowwise, replicated over dp) with
AdamW state; ``--size-mb`` is the unique state (parameters + exp_avg + exp_avg_sq). Measured in one run, as the
slowest rank between barriers: the first call of each operation (imports, plans, lazily built optimizer state),
then, one operation after another, the median of 5 calls with vescale and DCP alternating (the machine may be
shared): save (each to a new directory, as a training run does), load into the same layout, load resharded onto tp =
4; then async saves, each followed at once by a training step of ``--step-batch`` rows as in a training loop: the
blocking part (until the save returns, plus what that step's ``optimizer.step()`` waited for vescale's background
snapshot), the step's time and the total (first, then median). DCP uses ``dcp.save``/``dcp.async_save``/``dcp.load``
with ``get_state_dict``/``set_state_dict``. Both fsync their files. Each timed save's directory is deleted after it
(untimed), so that long runs do not fill the disk. A DCP operation that raises is recorded as ``dcp_<op>_error`` and
not retried; every other figure is still reported. The bytes each side writes (``*_bytes_written``) give each side's
save throughput as a fraction of the disk's sequential write bandwidth, measured with dd (O_DIRECT) in the same
directory, by one stream and by 4 concurrent streams (as many as the writing ranks). Reads after a save are served
largely from the page cache on both sides (caches are not dropped on a shared machine; vescale writes its data files
with O_DIRECT, so its first load reads them from the disk). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import tempfile
import time

from vescale.core.launch import spawn


def _model(d: int, layers: int, tp: int, seed: int):
    import torch
    from torch import nn
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from vescale.core.mesh import init_mesh

    torch.manual_seed(seed)
    model = nn.Sequential(*[nn.Linear(d, d, bias=False) for _ in range(layers)])
    mesh = init_mesh({"dp": 4 // tp, "tp": tp}) if tp < 4 else init_mesh({"tp": 4})
    plan = {str(i): ColwiseParallel() if i % 2 == 0 else RowwiseParallel() for i in range(layers)}
    parallelize_module(model, mesh["tp"], plan)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, opt


def _train_step(model, opt, d: int, batch: int = 2) -> None:
    import torch

    model(torch.randn(batch, d)).square().mean().backward()
    opt.step()
    opt.zero_grad()


_REPEAT = 5


def _timed(fn, repeat: int | None = None):
    """Median wall time of ``repeat`` calls, each between barriers (the slowest rank's time)."""
    import statistics

    import torch.distributed as dist

    times = []
    for _ in range(repeat or _REPEAT):
        dist.barrier()
        t0 = time.perf_counter()
        out = fn()
        dist.barrier()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def _bench(root: str, d: int, layers: int, step_batch: int) -> dict:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from vescale import checkpoint

    r: dict[str, float | str] = {}
    model, opt = _model(d, layers, 2, 0)
    _train_step(model, opt, d)
    state = {"model": model, "optim": opt, "step": 1}
    model4, opt4 = _model(d, layers, 4, 1)
    state4 = {"model": model4, "optim": opt4, "step": 0}

    def dcp_state(m, o):
        msd, osd = get_state_dict(m, o)
        return {"model": msd, "optim": osd}

    def dcp_load(m, o, path):
        sd = dcp_state(m, o)
        dcp.load(sd, checkpoint_id=path)
        set_state_dict(m, o, model_state_dict=sd["model"], optim_state_dict=sd["optim"])

    fresh = iter(range(10**6))  # saves go to new directories, like a training run's step_N checkpoints

    def new_dir(prefix: str) -> str:
        return f"{root}/{prefix}-{next(fresh)}"

    checkpoint.save(f"{root}/v1", state)
    dcp.save(dcp_state(model, opt), checkpoint_id=f"{root}/d1")
    if dist.get_rank() == 0:
        r["vescale_bytes_written"], r["dcp_bytes_written"] = _bytes(f"{root}/v1"), _bytes(f"{root}/d1")
    ops = {  # name -> (vescale, DCP); each pair runs alternately so that both see the same machine load
        "save": (lambda: checkpoint.save(new_dir("v"), state),
                 lambda: dcp.save(dcp_state(model, opt), checkpoint_id=new_dir("d"))),
        "load": (lambda: checkpoint.load(f"{root}/v1", state),
                 lambda: dcp_load(model, opt, f"{root}/d1")),
        "load_reshard": (lambda: checkpoint.load(f"{root}/v1", state4),
                         lambda: dcp_load(model4, opt4, f"{root}/d1")),
    }
    failed: dict[str, str] = {}  # DCP operations that raised: reported, not retried; every other figure is kept

    def run(name: str, side: str, fn, samples: list[float]) -> None:
        if side == "dcp" and name in failed:
            return
        try:
            t, _ = _timed(fn, 1)
            error = ""
        except Exception as exc:  # noqa: BLE001 - a failure of the compared library must not lose our figures
            if side != "dcp":
                raise
            t, error = 0.0, f"{type(exc).__name__}: {exc}"[:500]
        if _all_max(float(bool(error))):  # every rank learns that some rank failed
            failed[name] = error or "failed on another rank"
        else:
            samples.append(t)
        _clean(root)

    samples: dict[str, list[float]] = {}
    for name, (v, c) in ops.items():  # first calls: imports, plans, lazily built optimizer state
        run(name, "vescale", v, samples.setdefault(f"vescale_{name}_first_s", []))
        run(name, "dcp", c, samples.setdefault(f"dcp_{name}_first_s", []))
    for name, (v, c) in ops.items():  # one operation at a time, so that loads do not change what saves meet
        for _ in range(_REPEAT):
            run(name, "vescale", v, samples.setdefault(f"vescale_{name}_s", []))
            run(name, "dcp", c, samples.setdefault(f"dcp_{name}_s", []))
    for _ in range(_REPEAT):
        samples.setdefault("vescale_load_read_once_send_s", []).append(
            _timed(lambda: checkpoint.load(f"{root}/v1", state, dedup_reads=True), 1)[0])
    r.update({k: statistics.median(v) for k, v in samples.items() if v})
    step = lambda: _train_step(model, opt, d, step_batch)  # noqa: E731 - the training step after each async save
    r["train_step_s"] = _timed(step)[0]
    r.update(_async(lambda i: checkpoint.save(new_dir("va"), state, async_save=True), "vescale", root, step))
    try:
        r.update(_async(lambda i: _Waitable(dcp.async_save(dcp_state(model, opt), checkpoint_id=new_dir("da"))),
                        "dcp", root, step))
    except _SideFailed as exc:
        failed["async_save"] = str(exc)
    r.update({f"dcp_{name}_error": error for name, error in failed.items()})
    return r


class _SideFailed(Exception):
    pass


def _bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))


def _clean(root: str) -> None:
    """Delete the checkpoints of timed saves (not the two loaded ones) once every rank is done with them: a run
    of many 2 GB saves would otherwise fill the disk."""
    import torch.distributed as dist

    dist.barrier()
    if dist.get_rank() == 0:
        for name in os.listdir(root):
            if name not in ("v1", "d1"):
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    dist.barrier()


class _Waitable:
    def __init__(self, future) -> None:
        self.future = future
        self.fence_wait_s = 0.0  # DCP's snapshot is taken before async_save returns: no step ever waits for it

    def wait(self) -> None:
        self.future.result()


def _async(start, name: str, root: str, step) -> dict[str, float]:
    """Async saves, each followed at once by one training step (``step``), as in a training loop: the time until
    ``save`` returns, the time that step's optimizer step waited for a background snapshot (``fence_wait``), their
    sum (``blocking``: what training is held up by), the step's own time and the total until committed; the first
    (allocates buffers), then the median of the next ones. A failure on any rank raises :class:`_SideFailed` on
    every rank."""
    import statistics

    import torch.distributed as dist

    figures: dict[str, list[float]] = {}
    for i in range(1 + _REPEAT):
        dist.barrier()
        t0 = time.perf_counter()
        error = ""
        returned = fence = stepped = 0.0
        try:
            handle = start(i)
            returned = time.perf_counter() - t0
            step()
            stepped = time.perf_counter() - t0 - returned
            fence = handle.fence_wait_s
            handle.wait()
        except Exception as exc:  # noqa: BLE001 - reported in the JSON
            error = f"{type(exc).__name__}: {exc}"[:500]
        dist.barrier()
        total = time.perf_counter() - t0
        if _all_max(float(bool(error))):  # after the wait: DCP's background save uses the default group
            raise _SideFailed(error or "failed on another rank")
        for key, value in (("returned", returned), ("fence_wait", fence), ("blocking", returned + fence),
                           ("next_step", stepped), ("total", total)):
            figures.setdefault(key, []).append(_all_max(value))
        _clean(root)
    out = {f"{name}_async_first_blocking_s": figures["blocking"][0]}
    out.update({f"{name}_async_{key}_s": statistics.median(v[1:]) for key, v in figures.items()})
    return out


def _all_max(x: float) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([x])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _dd(root: str, mb: int) -> dict:
    """Sequential write (O_DIRECT + fdatasync) and read (O_DIRECT) bandwidth of the disk under ``root``, GB/s: one
    dd stream, and 4 concurrent streams writing a quarter each (the checkpoint's 4 writing ranks)."""
    out = {}
    for streams in (1, 4):
        files = [os.path.join(root, f"dd{i}.tmp") for i in range(streams)]
        count = max(1, mb // 4 // streams)
        suffix = "" if streams == 1 else f"_{streams}x"
        for name in ("write", "read"):
            cmds = [["dd", "if=/dev/zero", f"of={f}", "bs=4M", f"count={count}", "oflag=direct", "conv=fdatasync"]
                    if name == "write" else ["dd", f"if={f}", "of=/dev/null", "bs=4M", "iflag=direct"] for f in files]
            t0 = time.perf_counter()
            procs = [subprocess.Popen(c, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True) for c in cmds]
            errs = [p.communicate()[1] for p in procs]
            elapsed = time.perf_counter() - t0
            copied = [re.search(r"(\d+) bytes .* copied, ([\d.]+) s", e) for e in errs]
            if not all(copied):
                out[f"dd_{name}{suffix}_GBps"] = None
            elif streams == 1:
                out[f"dd_{name}_GBps"] = round(int(copied[0].group(1)) / float(copied[0].group(2)) / 1e9, 3)
            else:  # all streams together, start to last finish
                out[f"dd_{name}{suffix}_GBps"] = round(sum(int(m.group(1)) for m in copied) / elapsed / 1e9, 3)
        for f in files:
            os.remove(f)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=256, help="unique model + AdamW state in MiB (default 256)")
    parser.add_argument("--small", action="store_true", help="a 64 MiB state (the nox bench session)")
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where checkpoints are written")
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--step-batch", type=int, default=2,
                        help="rows of the training step run after each async save (default 2: a near-empty step)")
    args = parser.parse_args()
    size = 64 if args.small else args.size_mb
    d = args.d_model
    layers = max(2, round(size * 2**20 / (3 * 4 * d * d)) // 2 * 2)
    state_bytes = layers * d * d * 4 * 3
    root = tempfile.mkdtemp(prefix="vescale-ckpt-bench-", dir=args.dir)
    try:
        r = spawn(_bench, 4, root, d, layers, args.step_batch)
        r.update(_dd(root, min(size, 1024)))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    gb = state_bytes / 1e9
    out = {"bench": "checkpoint", "world_size": 4, "mesh": "dp=2,tp=2", "state_GB": round(gb, 3),
           "layers": layers, "d_model": d, "step_batch": args.step_batch,
           **{k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()}}
    pairs = {"speedup_save": "save_s", "speedup_load": "load_s", "speedup_load_reshard": "load_reshard_s"}
    for out_key, key in pairs.items():
        if f"dcp_{key}" in r:
            out[out_key] = round(r[f"dcp_{key}"] / r[f"vescale_{key}"], 2)
    for side in ("vescale", "dcp"):
        if f"{side}_async_blocking_s" in r and f"{side}_save_s" in r:
            fraction = r[f"{side}_async_blocking_s"] / r[f"{side}_save_s"]
            out[f"{side}_async_blocking_fraction_of_save"] = round(fraction, 3)
        if f"{side}_save_s" in r:
            out[f"{side}_save_GBps"] = round(r[f"{side}_bytes_written"] / 1e9 / r[f"{side}_save_s"], 3)
            for dd in ("dd_write_GBps", "dd_write_4x_GBps"):
                if r.get(dd):
                    out[f"{side}_save_fraction_of_{dd[:-5]}"] = round(out[f"{side}_save_GBps"] / r[dd], 3)
    out["vescale_load_GBps"] = round(gb / r["vescale_load_s"], 3)
    out["load_average"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
