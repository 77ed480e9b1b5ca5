"""vescale.checkpoint against torch.distributed.checkpoint (DCP) on the same model plus AdamW state.

    python tools/bench/checkpoint.py [--size-mb 256] [--small] [--dir /tmp]

4 ranks on a dp x tp = 2 x 2 mesh hold a stack of square linears (TP: colwise/rowwise, replicated over dp) with
AdamW state; ``--size-mb`` is the unique state (parameters + exp_avg + exp_avg_sq). Measured in one run, as the
slowest rank between barriers: the first call of each operation (imports, plans, lazily built optimizer state),
then the median of 5 calls with vescale and DCP alternating (the machine may be shared): save (each to a new
directory, as a training run does), load into the same layout, load resharded onto tp = 4; then the blocking part
and the total of async saves (first, then median). DCP uses ``dcp.save``/``dcp.async_save``/``dcp.load`` with
``get_state_dict``/``set_state_dict``. Both fsync their files. The disk's sequential write and read bandwidth is
measured with dd (O_DIRECT) in the same directory. Reads after a save are served largely from the page cache on
both sides (caches are not dropped on a shared machine). Prints one JSON object.
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


def _train_step(model, opt, d: int) -> None:
    import torch

    model(torch.randn(2, d)).square().mean().backward()
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


def _bench(root: str, d: int, layers: int) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from vescale import checkpoint

    r: dict[str, float] = {}
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
    checkpoint.save(f"{root}/v1", state)
    dcp.save(dcp_state(model, opt), checkpoint_id=f"{root}/d1")
    ops = {  # name -> (vescale, DCP); each pair runs alternately so that both see the same machine load
        "save": (lambda: checkpoint.save(f"{root}/v-{next(fresh)}", state),
                 lambda: dcp.save(dcp_state(model, opt), checkpoint_id=f"{root}/d-{next(fresh)}")),
        "load": (lambda: checkpoint.load(f"{root}/v1", state),
                 lambda: dcp_load(model, opt, f"{root}/d1")),
        "load_reshard": (lambda: checkpoint.load(f"{root}/v1", state4),
                         lambda: dcp_load(model4, opt4, f"{root}/d1")),
    }
    for name, (v, c) in ops.items():  # first calls: imports, plans, lazily built optimizer state
        r[f"vescale_{name}_first_s"], _ = _timed(v, 1)
        r[f"dcp_{name}_first_s"], _ = _timed(c, 1)
    samples: dict[str, list[float]] = {}
    for _ in range(_REPEAT):
        for name, (v, c) in ops.items():
            samples.setdefault(f"vescale_{name}_s", []).append(_timed(v, 1)[0])
            samples.setdefault(f"dcp_{name}_s", []).append(_timed(c, 1)[0])
        samples.setdefault("vescale_load_read_once_send_s", []).append(
            _timed(lambda: checkpoint.load(f"{root}/v1", state, dedup_reads=True), 1)[0])
    r.update({k: statistics.median(v) for k, v in samples.items()})
    r.update(_async(lambda i: checkpoint.save(f"{root}/v2-{i}", state, async_save=True), "vescale"))
    r.update(_async(lambda i: _Waitable(dcp.async_save(dcp_state(model, opt), checkpoint_id=f"{root}/d2-{i}")),
                    "dcp"))
    return r


class _Waitable:
    def __init__(self, future) -> None:
        self.future = future

    def wait(self) -> None:
        self.future.result()


def _async(start, name: str) -> dict[str, float]:
    """Blocking and total time of async saves: the first (allocates buffers), then the median of the next ones."""
    import statistics

    import torch.distributed as dist

    blocking, total = [], []
    for i in range(1 + _REPEAT):
        dist.barrier()
        t0 = time.perf_counter()
        handle = start(i)
        blocked = time.perf_counter() - t0
        handle.wait()
        dist.barrier()
        total.append(time.perf_counter() - t0)
        blocking.append(_all_max(blocked))  # after the wait: DCP's background save uses the default group
    return {f"{name}_async_first_blocking_s": blocking[0], f"{name}_async_blocking_s": statistics.median(blocking[1:]),
            f"{name}_async_total_s": statistics.median(total[1:])}


def _all_max(x: float) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([x])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _dd(root: str, mb: int) -> dict:
    """Sequential write (O_DIRECT + fdatasync) and read (O_DIRECT) bandwidth of the disk under ``root``, GB/s."""
    f = os.path.join(root, "dd.tmp")
    out = {}
    for name, cmd in [("write", ["dd", "if=/dev/zero", f"of={f}", "bs=4M", f"count={max(1, mb // 4)}",
                                 "oflag=direct", "conv=fdatasync"]),
                      ("read", ["dd", f"if={f}", "of=/dev/null", "bs=4M", "iflag=direct"])]:
        res = subprocess.run(cmd, capture_output=True, text=True)
        m = re.search(r"(\d+) bytes .* copied, ([\d.]+) s", res.stderr)
        out[f"dd_{name}_GBps"] = round(int(m.group(1)) / float(m.group(2)) / 1e9, 3) if m else None
    os.remove(f)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=256, help="unique model + AdamW state in MiB (default 256)")
    parser.add_argument("--small", action="store_true", help="a 64 MiB state (the nox bench session)")
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where checkpoints are written")
    parser.add_argument("--d-model", type=int, default=1024)
    args = parser.parse_args()
    size = 64 if args.small else args.size_mb
    d = args.d_model
    layers = max(2, round(size * 2**20 / (3 * 4 * d * d)) // 2 * 2)
    state_bytes = layers * d * d * 4 * 3
    root = tempfile.mkdtemp(prefix="vescale-ckpt-bench-", dir=args.dir)
    try:
        r = spawn(_bench, 4, root, d, layers)
        r.update(_dd(root, min(size, 1024)))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    gb = state_bytes / 1e9
    out = {"bench": "checkpoint", "world_size": 4, "mesh": "dp=2,tp=2", "state_GB": round(gb, 3),
           "layers": layers, "d_model": d, **{k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()}}
    out["speedup_save"] = round(r["dcp_save_s"] / r["vescale_save_s"], 2)
    out["speedup_load"] = round(r["dcp_load_s"] / r["vescale_load_s"], 2)
    out["speedup_load_reshard"] = round(r["dcp_load_reshard_s"] / r["vescale_load_reshard_s"], 2)
    out["vescale_async_blocking_fraction_of_save"] = round(r["vescale_async_blocking_s"] / r["vescale_save_s"], 3)
    out["dcp_async_blocking_fraction_of_save"] = round(r["dcp_async_blocking_s"] / r["dcp_save_s"], 3)
    out["vescale_save_GBps"] = round(gb / r["vescale_save_s"], 3)
    out["vescale_load_GBps"] = round(gb / r["vescale_load_s"], 3)
    if r.get("dd_write_GBps"):
        out["vescale_save_fraction_of_dd_write"] = round(out["vescale_save_GBps"] / r["dd_write_GBps"], 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
