"""vescale.checkpoint against torch.distributed.checkpoint (DCP): a layout matrix (default) and a model + AdamW state.

    python tools/bench/checkpoint.py [--size-mb 512] [--small] [--layouts row,column] [--repeat 3]
    python tools/bench/checkpoint.py --model-state [--size-mb 256] [--small] [--step-batch 2]

**Layout matrix** (default). The state is ``--size-mb`` of fp32 tensors of 8M elements ([2048, 4096]; ``--small``: 64
MiB of [1024, 2048], one sample each, under a minute), every tensor in one layout per row on 4 ranks (dp2 x tp2):
replicated, TP rows, TP columns, 2-D block, FSDP x TP, ``InterleavedShard``, ZeRO's flat ``RaggedShard`` pieces (over
dp = 4), and a mix. Per row, in one run, vescale and DCP alternating: save (each to a new directory, deleted after,
untimed), load into the same layout, and, on 2 ranks, load resharded (``Shard(1)`` of each matrix, ``Shard(0)`` of
each flat tensor). DCP cannot store ``InterleavedShard`` or ``RaggedShard``; on those rows it is timed on the nearest
torch layout with the same bytes per rank (``dcp_layout``). The first call of each is untimed (plans; the page cache
of the files just written), so loads read from the page cache on both sides. Each figure: the median of ``--repeat``
calls, as the slowest rank between barriers, and the CPU seconds of all ranks together (``*_cpu_s``: what a call costs
even when other jobs on a shared machine stretch its wall time). The floors, from the same run: a load copies each
byte the ranks hold at least once (``floor_load_s``: those bytes at the measured all-ranks memcpy rate, on buffers
larger than the caches; ``floor_load_cpu_s``: the CPU seconds of all ranks that copy costs, measured the same way, to
set against the ``*_cpu_s`` figures); a save writes the state's bytes at dd's 4-stream ``O_DIRECT`` rate, the best of
block sizes 512 KiB, 1 MiB and 4 MiB (``floor_save_s``; ``*_save_fraction_of_disk``: that floor over each side's
save). Loads are also timed with ``verify=False`` (``vescale_unverified_load*``, ``ratio_unverified_*``): DCP checks
nothing it reads, vescale's default checks every byte's crc32 before it writes any target; and in one pass
(``atomic=False``, ``vescale_one_pass_load*``, ``ratio_one_pass_*``: checked as it fills, not all-or-nothing). And cold
(``*_cold_load*``): both checkpoints evicted from the page cache before each load, as for a job's first load after a
save that vescale wrote past the page cache (``O_DIRECT``) or after a restart; its floor, ``floor_cold_load_s``, is
the stored bytes at dd's best 4-stream read rate, ``O_DIRECT`` or through the page cache after an eviction
(``dd_read_buffered_4x``: the kernel's readahead keeps more requests in flight).

**Model state** (``--model-state``). 4 ranks on a dp x tp = 2 x 2 mesh hold a stack of square linears (TP:
colwise/rowwise, replicated over dp) with AdamW state; ``--size-mb`` is the unique state (parameters + exp_avg +
exp_avg_sq). Measured in one run, as the
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
from functools import partial

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


def _dd(root: str, mb: int, streams_list: tuple[int, ...] = (1, 4), block_sizes: tuple[str, ...] = ("512K", "1M", "4M")
        ) -> dict:
    """Sequential write (O_DIRECT + fdatasync) and read (O_DIRECT; ``read_buffered``: through the page cache, the
    files evicted first) bandwidth of the disk under ``root``, GB/s: one dd stream, and 4 concurrent streams writing
    a quarter each (the checkpoint's 4 writing ranks). Each is the best
    over dd's ``block_sizes`` (the disk's bandwidth, not one block size's: on the development machine's disk 16 MiB
    writes run 25 % slower than 1 MiB ones); ``dd_<op>[_4x]_by_block`` gives every size's figure."""
    out: dict = {}
    for streams in streams_list:
        files = [os.path.join(root, f"dd{i}.tmp") for i in range(streams)]
        suffix = "" if streams == 1 else f"_{streams}x"
        for name in ("write", "read", "read_buffered"):
            by_block = {}
            missing = name != "write" and not all(os.path.exists(f) for f in files)  # the writes failed: no reads
            for bs in () if missing else block_sizes:
                if name == "write":  # a quarter of ``mb`` over the streams, in blocks of ``bs``
                    count = max(1, (mb << 20) // 4 // streams // (int(bs[:-1]) << (10 if bs.endswith("K") else 20)))
                    cmds = [["dd", "if=/dev/zero", f"of={f}", f"bs={bs}", f"count={count}", "oflag=direct",
                             "conv=fdatasync"] for f in files]
                elif name == "read":  # the files the last write left, to their end
                    cmds = [["dd", f"if={f}", "of=/dev/null", f"bs={bs}", "iflag=direct"] for f in files]
                else:  # the same through the page cache (the kernel's readahead), evicted first
                    _evict_files(files)
                    cmds = [["dd", f"if={f}", "of=/dev/null", f"bs={bs}"] for f in files]
                t0 = time.perf_counter()
                procs = [subprocess.Popen(c, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
                         for c in cmds]
                errs = [p.communicate()[1] for p in procs]
                elapsed = time.perf_counter() - t0
                copied = [re.search(r"(\d+) bytes .* copied, ([\d.]+) s", e) for e in errs]
                if not all(copied):
                    continue
                if streams == 1:
                    by_block[bs] = round(int(copied[0].group(1)) / float(copied[0].group(2)) / 1e9, 3)
                else:  # all streams together, start to last finish
                    by_block[bs] = round(sum(int(m.group(1)) for m in copied) / elapsed / 1e9, 3)
            out[f"dd_{name}{suffix}_GBps"] = max(by_block.values()) if by_block else None
            out[f"dd_{name}{suffix}_by_block"] = by_block
        for f in files:
            if os.path.exists(f):
                os.remove(f)
    return out


def _evict_files(files: list[str]) -> None:
    """Drop ``files`` from the page cache (``POSIX_FADV_DONTNEED``: clean pages, no privileges needed)."""
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def model_state(args) -> dict:
    """The model + AdamW bench (``--model-state``): save, loads, async saves against DCP."""
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
    return out


# ---------------------------------------------------------------------------------------------------------------------
# The layout matrix (the default mode): every tensor of the state in one layout, row by row.

#: the rows of the matrix: name -> (placements on the dp2 x tp2 mesh, or None for the flat ZeRO row), described
LAYOUTS = {
    "replicated": "[Replicate, Replicate]",
    "row": "[Replicate, Shard(0)] (TP rows)",
    "column": "[Replicate, Shard(1)] (TP columns)",
    "block2d": "[Shard(0), Shard(1)] (2-D block)",
    "fsdp_tp": "[Shard(0), Shard(0)] (FSDP x TP)",
    "interleaved": "[Replicate, InterleavedShard(0, 2)] (fused gate/up)",
    "zero_ragged": "flat 1-D tensors, RaggedShard((0,), (5, 3, 4, 4)) over 4 ranks (ZeRO shards)",
    "mixed": "tensor i in the i % 5-th of the first five rows",
}
_PLAIN = ["replicated", "row", "column", "block2d", "fsdp_tp"]
#: DCP cannot store these layouts: it is timed on the nearest layout torch has, with the same bytes per rank
DCP_STAND_IN = {"interleaved": "row", "zero_ragged": "flat Shard(0) over 4 ranks"}


def _placements(layout: str, i: int):
    from torch.distributed.tensor import Replicate, Shard

    if layout == "mixed":
        layout = _PLAIN[i % len(_PLAIN)]
    if layout == "interleaved":
        from vescale.dtensor import InterleavedShard

        return [Replicate(), InterleavedShard(0, 2)]
    return {"replicated": [Replicate(), Replicate()], "row": [Replicate(), Shard(0)],
            "column": [Replicate(), Shard(1)], "block2d": [Shard(0), Shard(1)],
            "fsdp_tp": [Shard(0), Shard(0)]}[layout]


def _global(i: int, shape: tuple[int, ...]):
    """Tensor ``i`` of the state, the same on every rank (so that each rank slices its part locally)."""
    import torch

    return torch.randn(shape, generator=torch.Generator().manual_seed(1000 + i))


def _matrix_state(layout: str, count: int, shape: tuple[int, int], for_dcp: bool) -> dict:
    """``count`` DTensors of ``shape`` in ``layout`` on this rank (for DCP: its stand-in layout where it has none)."""
    from torch.distributed.tensor import Shard

    from vescale.core.mesh import init_mesh
    from vescale.dtensor import RaggedShard, distribute_tensor

    state = {}
    if layout == "zero_ragged":
        mesh = init_mesh({"dp": 4})
        placements = [Shard(0)] if for_dcp else [RaggedShard((0,), (5, 3, 4, 4))]
        for i in range(count):
            state[f"t{i}"] = distribute_tensor(_global(i, shape).reshape(-1), mesh, placements, src_data_rank=None)
        return state
    mesh = init_mesh({"dp": 2, "tp": 2})
    name = DCP_STAND_IN.get(layout, layout) if for_dcp else layout
    for i in range(count):
        state[f"t{i}"] = distribute_tensor(_global(i, shape), mesh, _placements(name, i), src_data_rank=None)
    return state


def _reshard_state(layout: str, count: int, shape: tuple[int, int]) -> dict:
    """The resharded target on 2 ranks: ``Shard(1)`` of each matrix (``Shard(0)`` of each flat ZeRO tensor),
    zero-filled."""
    import torch
    from torch.distributed.tensor import Shard

    from vescale.core.mesh import init_mesh
    from vescale.dtensor import distribute_tensor

    mesh = init_mesh({"dp": 2})
    flat = layout == "zero_ragged"
    zeros = torch.zeros(shape[0] * shape[1]) if flat else torch.zeros(shape)
    return {f"t{i}": distribute_tensor(zeros, mesh, [Shard(0) if flat else Shard(1)], src_data_rank=None)
            for i in range(count)}


def _local_bytes(state: dict) -> int:
    from torch.distributed.tensor import DTensor

    return sum(t.to_local().nbytes if isinstance(t, DTensor) else t.nbytes for t in state.values())


def _memcpy(nbytes: int, repeat: int) -> float:
    """Aggregate bandwidth (GB/s) of every rank copying ``nbytes`` at once (median of ``repeat``): the floor of a
    load from the page cache, which copies each needed byte at least once."""
    import torch
    import torch.distributed as dist

    src = torch.ones(max(nbytes, 256 << 20) // 4)  # out of every cache, as the state is
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in
    t, _ = _timed(lambda: dst.copy_(src), repeat)
    return dist.get_world_size() * src.nbytes / t / 1e9


def _memcpy_cpu(nbytes: int, repeat: int) -> float:
    """CPU seconds per GB copied, all ranks together, while every rank copies ``nbytes`` at once (median of
    ``repeat``): the CPU floor of a load from the page cache, which copies each needed byte at least once. Unlike
    the wall-clock rate, other jobs on a shared machine stretch it little (a copy's stalls count; its waits do not)."""
    import statistics

    import torch
    import torch.distributed as dist

    src = torch.ones(max(nbytes, 256 << 20) // 4)  # out of every cache, as the state is
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in
    samples = []
    for _ in range(repeat):
        dist.barrier()
        c0 = time.process_time()
        dst.copy_(src)
        samples.append(_sum_all(time.process_time() - c0) / (dist.get_world_size() * src.nbytes / 1e9))
    return statistics.median(samples)


def _sum_all(x: float) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t)
    return t.item()


def _timed_cpu(fn) -> tuple[float, float]:
    """(wall seconds of the slowest rank, CPU seconds of all ranks together) of one call between barriers: on a
    shared machine the CPU time says what a call costs even when other jobs stretch its wall time."""
    import torch.distributed as dist

    dist.barrier()
    c0, t0 = time.process_time(), time.perf_counter()
    fn()
    cpu = time.process_time() - c0
    dist.barrier()
    return time.perf_counter() - t0, _sum_all(cpu)


def _evict(*paths: str) -> None:
    """Drop every file under ``paths`` from the page cache (``POSIX_FADV_DONTNEED``: clean pages, no privileges
    needed), on rank 0 between barriers, so that the next load reads them from the disk."""
    import torch.distributed as dist

    dist.barrier()
    if dist.get_rank() == 0:
        _evict_files([os.path.join(parent, name) for path in paths for parent, _, names in os.walk(path)
                      for name in names])
    dist.barrier()


def _sample_cold(samples: dict, loads: dict, paths: tuple[str, ...]) -> None:
    """One sample of each of ``loads`` (name -> call), each after evicting ``paths`` from the page cache."""
    for name, fn in loads.items():
        _evict(*paths)
        _sample(samples, name, fn)


def _sample(samples: dict, name: str, fn) -> None:
    wall, cpu = _timed_cpu(fn)
    samples.setdefault(f"{name}_s", []).append(wall)
    samples.setdefault(f"{name}_cpu_s", []).append(cpu)


def _matrix_save(root: str, layouts: list[str], count: int, shape: tuple[int, int], repeat: int) -> dict:
    """On 4 ranks: for each layout, save and same-layout load, vescale and DCP alternating; keeps one checkpoint of
    each for the resharded loads."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from vescale import checkpoint

    fresh = iter(range(10**6))
    out: dict = {}
    for layout in layouts:
        state = _matrix_state(layout, count, shape, for_dcp=False)
        dstate = state if layout not in DCP_STAND_IN else _matrix_state(layout, count, shape, for_dcp=True)
        v_path, d_path = f"{root}/v-{layout}", f"{root}/d-{layout}"
        row: dict = {"local_bytes_all_ranks": _sum_all(_local_bytes(state))}
        # first calls (plans, page cache of the files just written), untimed
        checkpoint.save(v_path, state)
        dcp.save(dstate, checkpoint_id=d_path)
        checkpoint.load(v_path, state)
        dcp.load(dstate, checkpoint_id=d_path)
        samples: dict[str, list[float]] = {}
        for _ in range(repeat):
            for side, st in (("vescale", state), ("dcp", dstate)):
                _sample(samples, f"{side}_save", partial(_save_new, side, root, fresh, st))
                _clean_saves(root)
        for _ in range(repeat):
            _sample(samples, "vescale_load", partial(checkpoint.load, v_path, state))
            _sample(samples, "dcp_load", partial(dcp.load, dstate, checkpoint_id=d_path))
            _sample(samples, "vescale_unverified_load", partial(checkpoint.load, v_path, state, verify=False))
            _sample(samples, "vescale_one_pass_load", partial(checkpoint.load, v_path, state, atomic=False))
        for _ in range(repeat):
            _sample_cold(samples, {"vescale_cold_load": partial(checkpoint.load, v_path, state),
                                   "dcp_cold_load": partial(dcp.load, dstate, checkpoint_id=d_path)}, (v_path, d_path))
        row.update({k: statistics.median(v) for k, v in samples.items()})
        if dist.get_rank() == 0:
            row["vescale_bytes_written"], row["dcp_bytes_written"] = _bytes(v_path), _bytes(d_path)
        out[layout] = row
        state = dstate = None  # free this row's tensors before the next row's
    out["memcpy_4_ranks_GBps"] = _memcpy(count * shape[0] * shape[1] * 4 // 4, max(repeat, 3))
    out["memcpy_4_ranks_cpu_s_per_GB"] = _memcpy_cpu(count * shape[0] * shape[1] * 4 // 4, max(repeat, 3))
    return out


def _save_new(side: str, root: str, fresh, state: dict) -> None:
    """vescale's or DCP's save of ``state`` to a new directory, as a training run's saves go."""
    import torch.distributed.checkpoint as dcp

    from vescale import checkpoint

    path = f"{root}/s{next(fresh)}"
    if side == "vescale":
        checkpoint.save(path, state)
    else:
        dcp.save(state, checkpoint_id=path)


def _clean_saves(root: str) -> None:
    """Delete the timed saves (``s<N>``), keeping the loaded checkpoints."""
    import torch.distributed as dist

    dist.barrier()
    if dist.get_rank() == 0:
        for name in os.listdir(root):
            if name.startswith("s"):
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    dist.barrier()


def _matrix_reshard(root: str, layouts: list[str], count: int, shape: tuple[int, int], repeat: int) -> dict:
    """On 2 ranks: load each layout's checkpoints into the resharded target, vescale and DCP alternating."""
    import torch.distributed.checkpoint as dcp

    from vescale import checkpoint

    out: dict = {}
    for layout in layouts:
        state = _reshard_state(layout, count, shape)
        v_path, d_path = f"{root}/v-{layout}", f"{root}/d-{layout}"
        checkpoint.load(v_path, state)
        dcp.load(state, checkpoint_id=d_path)
        samples: dict[str, list[float]] = {}
        for _ in range(repeat):
            _sample(samples, "vescale_load_reshard", partial(checkpoint.load, v_path, state))
            _sample(samples, "dcp_load_reshard", partial(dcp.load, state, checkpoint_id=d_path))
            _sample(samples, "vescale_unverified_load_reshard",
                    partial(checkpoint.load, v_path, state, verify=False))
            _sample(samples, "vescale_one_pass_load_reshard", partial(checkpoint.load, v_path, state, atomic=False))
        for _ in range(repeat):
            _sample_cold(samples, {"vescale_cold_load_reshard": partial(checkpoint.load, v_path, state),
                                   "dcp_cold_load_reshard": partial(dcp.load, state, checkpoint_id=d_path)},
                         (v_path, d_path))
        out[layout] = {k: statistics.median(v) for k, v in samples.items()}
        out[layout]["local_bytes_all_ranks"] = _sum_all(_local_bytes(state))
        state = None  # free this row's tensors before the next row's
    out["memcpy_2_ranks_GBps"] = _memcpy(count * shape[0] * shape[1] * 4 // 2, max(repeat, 3))
    out["memcpy_2_ranks_cpu_s_per_GB"] = _memcpy_cpu(count * shape[0] * shape[1] * 4 // 2, max(repeat, 3))
    return out


def matrix(args) -> dict:
    """The layout matrix: one JSON object with a row per layout, the dd and memcpy figures, and the ratios."""
    size = 64 if args.small else args.size_mb
    shape = (1024, 2048) if args.small else (2048, 4096)
    count = max(1, size * 2**20 // (shape[0] * shape[1] * 4))
    repeat = 1 if args.small else args.repeat
    layouts = args.layouts.split(",") if args.layouts else list(LAYOUTS)
    unknown = sorted(set(layouts) - set(LAYOUTS))
    if unknown:
        raise SystemExit(f"unknown layouts {unknown}; known: {', '.join(LAYOUTS)}")
    root = tempfile.mkdtemp(prefix="vescale-ckpt-matrix-", dir=args.dir)
    try:
        same = spawn(_matrix_save, 4, root, layouts, count, shape, repeat)
        other = spawn(_matrix_reshard, 2, root, layouts, count, shape, repeat)
        dd = _dd(root, min(size, 1024), streams_list=(4,))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    state_bytes = count * shape[0] * shape[1] * 4
    out = {"bench": "checkpoint_matrix", "state_GB": round(state_bytes / 1e9, 3), "tensors": count,
           "shape": list(shape), "repeat": repeat, "mesh": "dp=2,tp=2 (zero_ragged: dp=4); reshard: 2 ranks",
           "memcpy_4_ranks_GBps": round(same.pop("memcpy_4_ranks_GBps"), 2),
           "memcpy_2_ranks_GBps": round(other.pop("memcpy_2_ranks_GBps"), 2),
           "memcpy_4_ranks_cpu_s_per_GB": round(same.pop("memcpy_4_ranks_cpu_s_per_GB"), 4),
           "memcpy_2_ranks_cpu_s_per_GB": round(other.pop("memcpy_2_ranks_cpu_s_per_GB"), 4), **dd, "rows": {}}
    for layout in layouts:
        r = {**same[layout], **{k: v for k, v in other[layout].items() if k != "local_bytes_all_ranks"}}
        row = {"layout": LAYOUTS[layout], **{k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()}}
        if layout in DCP_STAND_IN:
            row["dcp_layout"] = DCP_STAND_IN[layout]
        for op in ("save", "load", "load_reshard", "cold_load", "cold_load_reshard"):
            row[f"ratio_{op}"] = round(r[f"dcp_{op}_s"] / r[f"vescale_{op}_s"], 2)
            row[f"cpu_ratio_{op}"] = round(r[f"dcp_{op}_cpu_s"] / r[f"vescale_{op}_cpu_s"], 2)
        for op in ("load", "load_reshard"):  # like for like: DCP checks nothing it reads
            row[f"ratio_unverified_{op}"] = round(r[f"dcp_{op}_s"] / r[f"vescale_unverified_{op}_s"], 2)
            row[f"ratio_one_pass_{op}"] = round(r[f"dcp_{op}_s"] / r[f"vescale_one_pass_{op}_s"], 2)
        # floors: one copy of every byte each rank needs at the measured memcpy rate; the unique bytes at dd's
        row["floor_load_s"] = round(r["local_bytes_all_ranks"] / 1e9 / out["memcpy_4_ranks_GBps"], 4)
        row["floor_load_reshard_s"] = round(other[layout]["local_bytes_all_ranks"] / 1e9
                                            / out["memcpy_2_ranks_GBps"], 4)
        # the same in CPU seconds of all ranks (to compare with the *_cpu_s figures): one copy of every byte held
        row["floor_load_cpu_s"] = round(r["local_bytes_all_ranks"] / 1e9 * out["memcpy_4_ranks_cpu_s_per_GB"], 4)
        row["floor_load_reshard_cpu_s"] = round(other[layout]["local_bytes_all_ranks"] / 1e9
                                                * out["memcpy_2_ranks_cpu_s_per_GB"], 4)
        cold_rate = max(dd.get("dd_read_4x_GBps") or 0, dd.get("dd_read_buffered_4x_GBps") or 0)
        if cold_rate:  # a load from a cold page cache reads every stored byte from the disk
            row["floor_cold_load_s"] = round(state_bytes / 1e9 / cold_rate, 4)
        if dd.get("dd_write_4x_GBps"):
            row["floor_save_s"] = round(state_bytes / 1e9 / dd["dd_write_4x_GBps"], 4)
            for side in ("vescale", "dcp"):  # the share of the disk's write bandwidth each side's save reaches
                row[f"{side}_save_fraction_of_disk"] = round(row["floor_save_s"] / r[f"{side}_save_s"], 3)
        out["rows"][layout] = row
    out["load_average"] = [round(x, 2) for x in os.getloadavg()]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-state", action="store_true",
                        help="the model + AdamW bench (save, loads, async saves) instead of the layout matrix")
    parser.add_argument("--size-mb", type=int, default=None,
                        help="state size in MiB (default: 512 for the matrix, 256 for --model-state)")
    parser.add_argument("--small", action="store_true", help="a 64 MiB state, one sample per figure (under a minute)")
    parser.add_argument("--layouts", default="", help="matrix rows to run, comma-separated (default: all)")
    parser.add_argument("--repeat", type=int, default=3, help="matrix: samples per figure (median; default 3)")
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where checkpoints are written")
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--step-batch", type=int, default=2,
                        help="rows of the training step run after each async save (default 2: a near-empty step)")
    args = parser.parse_args()
    if args.size_mb is None:
        args.size_mb = 256 if args.model_state else 512
    print(json.dumps(model_state(args) if args.model_state else matrix(args)))


if __name__ == "__main__":
    main()
