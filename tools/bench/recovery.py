"""Recovery time: from a rank's death to the restarted job's first new step, and the cold checkpoint load against the
disk's read rate and DCP's cold load.

    python tools/bench/recovery.py [--size-mb 256] [--repeat 3] [--layouts row,column] [--skip-restart] [--small]

**Restart** (one torchrun agent, 2 CPU ranks, ``--max-restarts 1``): ``tools/train.py --resume auto`` checkpoints
every ``--ckpt-every`` steps; once a checkpoint is committed and a step past it is done, rank 1 is SIGKILLed and the
checkpoint's files are evicted from the page cache (``posix_fadvise(DONTNEED)``: the restarted job's load reads the
disk, as after a node change). Split, on the wall clock: ``restart_s`` (death to the new rank process, torchrun
noticing the death, stopping the survivor and starting the group again), ``init_s`` (the new process to the built
model: interpreter and torch imports, rendezvous, process group, build), ``load_s`` (checkpoint load) and
``first_step_s`` (the first new step). The marks come from the restarted run's ``summary.json`` (``startup``).

**Cold load** (4 ranks, the checkpoint layout matrix of ``tools/bench/checkpoint.py``, ``--size-mb`` of fp32
matrices): per row, vescale and DCP each save once, then ``--repeat`` rounds of cold loads: vescale's atomic load
(the default: check, agree, fill), its one-pass load (``atomic=False``, what ``train.py --resume`` uses), DCP's.
Every load follows the same steps: both checkpoints' files are evicted from the page cache
(``posix_fadvise(DONTNEED)`` on every file: clean pages are dropped without privileges; dropping the whole page cache
needs root), one ``dd bs=1M`` stream per data file reads vescale's data files, the files are evicted again, and the
load runs. Each round starts one load further along, so that each load follows each of the others equally often.

Two floors. **Paired** (``*_fraction_of_paired_read_rate``, the median over the rounds, and its range): the dd right
before a load measures the disk's buffered read rate at that moment, on the same bytes (the disk's rate moves with
the host's cache: the same 2 GiB took 0.7-1.4 s on the development machine); each load's fraction is the time its
stored bytes take at that rate over the load's time (1.0: the load reads at the disk's rate). **Best of dd**
(``*_fraction_of_read_rate``, a stricter figure): the stored bytes at the best 4-stream buffered rate of one dd run
per block size (512 KiB / 1 MiB / 4 MiB, after the same eviction, reading as many bytes as the state, measured once
after all the rows) over the median load. Every stored byte comes from the disk once whatever the row (ranks needing
the same bytes share the page cache), so both floors are the stored bytes at the disk's rate; the ``O_DIRECT`` rate
is reported beside them. ``ratio_cold_vs_dcp``: DCP's cold load time over vescale's (above 1: vescale is faster).
``copy_floor_s``: the bytes every rank's targets hold together (4x the stored bytes when replicated) at the host's
memory copy rate with the 4 ranks copying at once (``memory_copy_4x_GBps``, measured in the same run): the time the
copies into the targets take even when nothing else runs, a second floor beside the disk's. Medians; the slowest
rank between barriers. ``free_page_reporting``: whether the machine is a virtual machine returning freed memory to
its host (then every eviction hands the page cache back, and the disk's rate and the loads move with the host).
``crc32``: the module of the checksum in use (``isal.isal_zlib`` with ``vescale-checkpoint[fast]``, else ``zlib``).
Prints one JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

from vescale.core.launch import free_port, spawn

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
import checkpoint as ckpt_bench  # noqa: E402  (tools/bench/checkpoint.py: the layout matrix and its helpers)

TOOLS = BENCH.parent


def _children(pid: int) -> list[int]:
    kids = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        kids += [int(p) for p in (task / "children").read_text().split()]
    return kids


def _train_ranks(agent: int) -> list[int]:
    found = []
    for p in _children(agent):
        try:
            if b"train.py" in Path(f"/proc/{p}/cmdline").read_bytes():
                found.append(p)
        except FileNotFoundError:
            pass
    return sorted(found)


def restart(args, root: str) -> dict:
    """Kill rank 1 of a torchrun job after its first committed checkpoint; time the way back to a new step."""
    out = Path(root) / "run"
    every, steps = args.ckpt_every, args.ckpt_every + 3
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "1",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", str(TOOLS / "train.py"),
            "--model", args.model, "--data", "markov", "--batch-size", "8", "--seq-len", "32", "--mesh", "dp=2",
            "--steps", str(steps), "--ckpt-every", str(every), "--trace-steps", "0", "--quiet", "--resume", "auto",
            "--out", str(out)]
    log = open(Path(root) / "torchrun.log", "w")  # noqa: SIM115 - closed below
    job = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        ckpt, metrics = out / "ckpt" / f"step_{every}", out / "metrics.jsonl"
        deadline = time.monotonic() + 900
        while not ((ckpt / "metadata.json").exists() and metrics.exists()
                   and len(metrics.read_text().splitlines()) > every):
            if job.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"recovery bench: the first run ended early; see {Path(root) / 'torchrun.log'}")
            time.sleep(0.01)
        first = _train_ranks(job.pid)
        killed_at = time.time()
        os.kill(first[1], signal.SIGKILL)
        ckpt_bench._evict_files([str(p) for p in ckpt.iterdir()])  # the restarted load reads the disk
        spawned_at = None
        while spawned_at is None and job.poll() is None:
            if set(_train_ranks(job.pid)) - set(first):
                spawned_at = time.time()
            time.sleep(0.005)
        job.wait(timeout=900)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
        log.close()
    if job.returncode != 0 or spawned_at is None:
        raise SystemExit(f"recovery bench: the restarted run failed; see {Path(root) / 'torchrun.log'}")
    mark = json.loads((out / "summary.json").read_text())["startup"]
    nbytes = sum(p.stat().st_size for p in ckpt.iterdir())
    return {"model": args.model, "checkpoint_MB": round(nbytes / 2**20, 2),
            "restart_s": round(spawned_at - killed_at, 3), "init_s": round(mark["built_at"] - spawned_at, 3),
            "load_s": round(mark["loaded_at"] - mark["built_at"], 3),
            "first_step_s": round(mark["first_step_at"] - mark["loaded_at"], 3),
            "death_to_first_step_s": round(mark["first_step_at"] - killed_at, 3)}


def _copy_rate(nbytes: int = 256 << 20, repeat: int = 5) -> float:
    """The host's memory copy rate with every rank copying at once (GB/s over all ranks): each rank copies
    ``nbytes`` between two buffers it has touched already, ``repeat`` times between barriers; the best round."""
    import torch
    import torch.distributed as dist

    src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.zeros(nbytes, dtype=torch.uint8)
    best = float("inf")
    for _ in range(repeat):
        dist.barrier()
        t0 = time.perf_counter()
        dst.copy_(src)
        took = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        best = min(best, took.item())
    return dist.get_world_size() * nbytes / best / 1e9


def _free_page_reporting() -> bool | None:
    """Whether this machine is a virtual machine that hands memory it frees back to its host (a virtio balloon
    offering free page reporting, feature bit 5): the page cache an eviction frees is then returned to the host, and
    the next cold read pays the host's page faults to get memory back, so that the disk's rate and the loads' speed
    move from run to run. None where there is no sysfs to tell."""
    devices = Path("/sys/bus/virtio/devices")
    if not devices.is_dir():
        return None if not Path("/sys").is_dir() else False
    for dev in devices.iterdir():
        try:
            if int((dev / "device").read_text(), 16) == 5:  # the balloon
                return (dev / "features").read_text().strip()[5:6] == "1"
        except (OSError, ValueError):
            continue
    return False


def _dd_sample(files: list[str]) -> float:
    """Seconds one concurrent ``dd bs=1M`` stream per file takes to read ``files`` through the page cache, evicted
    first."""
    ckpt_bench._evict_files(files)
    t0 = time.perf_counter()
    procs = [subprocess.Popen(["dd", f"if={f}", "of=/dev/null", "bs=1M"], stderr=subprocess.DEVNULL) for f in files]
    if any(p.wait() for p in procs):
        raise SystemExit("recovery bench: dd failed")
    return time.perf_counter() - t0


#: the cold loads of a round, by sample name; each round starts one further along (see :func:`_cold_rows`)
_LOADS = ("vescale_cold_load", "vescale_one_pass_cold_load", "dcp_cold_load")


def _cold_rows(root: str, layouts: list[str], count: int, shape: tuple[int, int], repeat: int) -> dict:
    """On 4 ranks: per layout, one save each side, then ``repeat`` rounds of cold loads: vescale's atomic load, its
    one-pass load (``atomic=False``), DCP's. Every load follows the same steps: evict both checkpoints, dd reads
    vescale's data files (rank 0, the others waiting; ``<load>_dd_s``), evict again, load. Round ``r`` starts at
    load ``r % 3``, so that each load follows each of the others equally often."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from vescale import checkpoint

    rows: dict = {"_copy_GBps": _copy_rate()}
    rank = dist.get_rank()
    for layout in layouts:
        state = ckpt_bench._matrix_state(layout, count, shape, for_dcp=False)
        held = torch.tensor([sum(t.to_local().nbytes for t in state.values())], dtype=torch.float64)
        dist.all_reduce(held)
        dstate = state if layout not in ckpt_bench.DCP_STAND_IN else \
            ckpt_bench._matrix_state(layout, count, shape, for_dcp=True)
        v_path, d_path = f"{root}/v-{layout}", f"{root}/d-{layout}"
        checkpoint.save(v_path, state)
        dcp.save(dstate, checkpoint_id=d_path)
        checkpoint.load(v_path, state)  # first calls (imports, plans), untimed
        checkpoint.load(v_path, state, atomic=False)
        dcp.load(dstate, checkpoint_id=d_path)
        data_files = sorted(os.path.join(v_path, f) for f in os.listdir(v_path) if f.startswith("data"))
        loads = {"vescale_cold_load": partial(checkpoint.load, v_path, state),
                 "vescale_one_pass_cold_load": partial(checkpoint.load, v_path, state, atomic=False),
                 "dcp_cold_load": partial(dcp.load, dstate, checkpoint_id=d_path)}
        samples: dict[str, list[float]] = {}
        for r in range(repeat):
            for name in _LOADS[r % 3:] + _LOADS[:r % 3]:
                ckpt_bench._evict(v_path, d_path)
                took = torch.tensor([_dd_sample(data_files) if rank == 0 else 0.0], dtype=torch.float64)
                dist.broadcast(took, 0)
                samples.setdefault(f"{name}_dd_s", []).append(took.item())
                ckpt_bench._sample_cold(samples, {name: loads[name]}, (v_path, d_path))
        rows[layout] = samples
        rows[layout]["target_bytes"] = int(held.item())
        if rank == 0:
            rows[layout]["vescale_bytes"] = ckpt_bench._bytes(v_path)
            rows[layout]["vescale_data_bytes"] = sum(os.path.getsize(f) for f in data_files)
            rows[layout]["dcp_bytes"] = ckpt_bench._bytes(d_path)
            shutil.rmtree(v_path, ignore_errors=True)
            shutil.rmtree(d_path, ignore_errors=True)
        dist.barrier()
        state = dstate = loads = None  # the next row's state is built after this one's is freed
    return rows


def cold(args, root: str) -> dict:
    shape = (1024, 2048)
    count = max(1, args.size_mb * 2**20 // (shape[0] * shape[1] * 4))
    layouts = args.layouts.split(",") if args.layouts else list(ckpt_bench.LAYOUTS)
    unknown = sorted(set(layouts) - set(ckpt_bench.LAYOUTS))
    if unknown:
        raise SystemExit(f"unknown layouts {unknown}; known: {', '.join(ckpt_bench.LAYOUTS)}")
    from vescale.checkpoint._crc import crc32

    load_before = [round(x, 2) for x in os.getloadavg()]
    rows = spawn(_cold_rows, 4, root, layouts, count, shape, args.repeat)
    # the dd files hold as many bytes as the state (``_dd`` writes a quarter of its ``mb``): the rate is measured over
    # the amount a cold load reads, not a quarter of it (a short read overstates a disk with a cache in front of it)
    dd = ckpt_bench._dd(root, 4 * args.size_mb, streams_list=(4,))
    rate = dd.get("dd_read_buffered_4x_GBps")
    out = {"state_MB": round(count * shape[0] * shape[1] * 4 / 2**20, 1), "repeat": args.repeat,
           "crc32": crc32.__module__, "load_average_before": load_before,
           "eviction": "posix_fadvise(POSIX_FADV_DONTNEED) on every checkpoint file before each load",
           "disk_read_buffered_4x_GBps": rate, "disk_read_direct_4x_GBps": dd.get("dd_read_4x_GBps"),
           "memory_copy_4x_GBps": round(rows["_copy_GBps"], 2), "free_page_reporting": _free_page_reporting(),
           "rows": {}}
    med = statistics.median
    for layout in layouts:
        r = rows[layout]
        atomic, one, dcp = (med(r[f"{name}_s"]) for name in _LOADS)
        row = {"vescale_cold_load_s": round(atomic, 4), "vescale_one_pass_cold_load_s": round(one, 4),
               "dcp_cold_load_s": round(dcp, 4), "ratio_cold_vs_dcp": round(dcp / atomic, 2),
               "ratio_one_pass_vs_dcp": round(dcp / one, 2)}
        if rate:
            floor = r["vescale_bytes"] / 1e9 / rate
            row["floor_cold_load_s"] = round(floor, 4)
            row["cold_fraction_of_read_rate"] = round(floor / atomic, 3)
            row["one_pass_fraction_of_read_rate"] = round(floor / one, 3)
        # each load against the dd that read vescale's data files right before it (the disk's rate at that moment):
        # the stored bytes the load reads at that rate, over the load's time; the median over the rounds, and the range
        row["paired_dd_s"] = round(med([x for name in _LOADS for x in r[f"{name}_dd_s"]]), 4)
        for name, key in zip(_LOADS, ("cold", "one_pass", "dcp")):
            stored = r["dcp_bytes" if key == "dcp" else "vescale_bytes"] / r["vescale_data_bytes"]
            each = [dd * stored / t for dd, t in zip(r[f"{name}_dd_s"], r[f"{name}_s"])]
            row[f"{key}_fraction_of_paired_read_rate"] = round(med(each), 3)
            row[f"{key}_fraction_of_paired_read_rate_range"] = [round(min(each), 3), round(max(each), 3)]
        # every rank's targets written once at the host's copy rate: a second bound, beside the disk's
        row["copy_floor_s"] = round(r["target_bytes"] / 1e9 / rows["_copy_GBps"], 4)
        if layout in ckpt_bench.DCP_STAND_IN:
            row["dcp_layout"] = ckpt_bench.DCP_STAND_IN[layout]
        out["rows"][layout] = row
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=256, help="cold-load state in MiB (default 256)")
    parser.add_argument("--repeat", type=int, default=3, help="cold loads of each side per row (median)")
    parser.add_argument("--layouts", default="", help="matrix rows, comma-separated (default: all)")
    parser.add_argument("--model", default="gpt-tiny", help="train.py --model of the restart (default gpt-tiny)")
    parser.add_argument("--ckpt-every", type=int, default=3, help="the restart run's checkpoint interval")
    parser.add_argument("--skip-restart", action="store_true", help="only the cold-load matrix")
    parser.add_argument("--skip-cold", action="store_true", help="only the restart")
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where checkpoints are written")
    parser.add_argument("--small", action="store_true", help="64 MiB, one sample per row, gpt-tiny (nox -s bench)")
    args = parser.parse_args()
    if args.small:
        args.size_mb, args.repeat, args.model = 64, 1, "gpt-tiny"
    root = tempfile.mkdtemp(prefix="vescale-recovery-", dir=args.dir)
    result: dict = {"bench": "recovery"}
    try:
        if not args.skip_restart:
            result["restart"] = restart(args, root)
        if not args.skip_cold:
            result["cold_load"] = cold(args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result["load_average"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
