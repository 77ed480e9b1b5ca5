"""``tools/train.py`` survives what long runs meet: a preemption signal to one rank (every rank stops at the same step,
checkpointed, exit 0; the resume continues the uninterrupted curve), ``--resume auto`` past an incomplete and a
damaged checkpoint, bad steps (skipped, then a named error after a checkpoint of the last good state), and
``--tensorboard`` (events read back), a checkpoint write failing on one rank (``--on-save-error continue``), a slow
rank named, a kill during an async save (the previous checkpoint resumes). Faults come from ``VESCALE_TRAIN_FAULTS``
(``tools/faults.py``). Tiny model, markov data, few steps; real launches only where a process must die or exit."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vescale.core.errors import RankError
from vescale.core.testing import run_on_ranks, spawn_on_pool

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT / "integration_tests"))  # test_multinode's process helpers
import config  # noqa: E402
import resilience  # noqa: E402
import train  # noqa: E402

COMMON = ["--model", "gpt-tiny", "--data", "markov", "--batch-size", "8", "--seq-len", "16", "--lr", "3e-3",
          "--warmup", "2", "--trace-steps", "0", "--mesh", "dp=2"]


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _read_checkpoint(path: Path) -> dict:
    """Every tensor of a checkpoint, whole, by its key."""
    import torch

    from vescale import checkpoint

    info = checkpoint.inspect(path)["tensors"]
    state = {k: torch.empty(v["shape"], dtype=getattr(torch, v["dtype"])) for k, v in info.items()}
    checkpoint.load(path, state, strict=False)
    return state


def _sigterm_after_two_steps(out: Path, pid: int, stop) -> None:
    """Send SIGTERM to ``pid`` once ``out/metrics.jsonl`` holds two steps (or give up when ``stop`` is set)."""
    while not stop.is_set():
        try:
            if len(_records(out)) >= 2:
                os.kill(pid, signal.SIGTERM)
                return
        except (OSError, ValueError):  # not written yet, or a line half written
            pass
        time.sleep(0.02)


@pytest.mark.parametrize("target", ["rank1", "launcher"])
def test_sigterm_checkpoints_exits_0_and_the_resume_continues_the_curve(tmp_path, target):
    """SIGTERM to rank 1 only (the others learn it through the flag all-reduce), or to the launcher (which passes it
    on to its ranks): every rank stops after the same step, writes a checkpoint there, and the job exits 0.

    The launcher case is a real ``tools/train.py`` process (its signal forwarding and exit code are what it checks).
    The rank-1 case runs ``train.main`` on the warm pool (``spawn_on_pool``: a pooled rank runs the job as a spawned
    rank would, with train.py's own handlers) and signals pooled rank 1 from a thread: no process start."""
    import threading

    steps, cut, whole = 24, tmp_path / "cut", tmp_path / "whole"
    if target == "rank1":
        rank1 = run_on_ranks(os.getpid, 2)[1]  # (starts the pool if it is not running)
        stop = threading.Event()
        signaller = threading.Thread(target=_sigterm_after_two_steps, args=(cut, rank1, stop), daemon=True)
        signaller.start()
        try:
            with spawn_on_pool():
                summary = train.main([*COMMON, "--steps", str(steps), "--quiet", "--out", str(cut)])
        finally:
            stop.set()
            signaller.join()
        output = json.dumps(summary, default=str)
    else:
        job = subprocess.Popen([sys.executable, str(ROOT / "tools" / "train.py"), *COMMON, "--steps", str(steps),
                                "--out", str(cut)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            deadline = time.monotonic() + 600
            while not ((cut / "metrics.jsonl").exists() and len(_records(cut)) >= 2):
                assert job.poll() is None and time.monotonic() < deadline, job.communicate()[0]
                time.sleep(0.02)
            os.kill(job.pid, signal.SIGTERM)
            output = job.communicate(timeout=600)[0]
        finally:
            job.kill()
        assert job.returncode == 0, output
    done = len(_records(cut))
    assert 2 <= done < steps, output
    if target == "launcher":  # (rank 0's log line; the pooled ranks' output is kept only on failure)
        assert f"stopped after step {done}" in output, output
    assert sorted(p.name for p in (cut / "ckpt").iterdir()) == [f"step_{done}"]
    summary = json.loads((cut / "summary.json").read_text())
    assert summary["preempted"] is True and summary["skipped_steps"] == 0
    if target == "launcher":  # (the resume is the same either way)
        return
    run_on_ranks(train.train, 2, config.parse_args([*COMMON, "--steps", str(steps), "--quiet", "--out", str(whole)],
                                                   ""))
    run_on_ranks(train.train, 2, config.parse_args([*COMMON, "--steps", str(steps), "--quiet", "--out", str(cut),
                                                    "--resume", str(cut / "ckpt" / f"step_{done}")], ""))
    got, want = [r["loss"] for r in _records(cut)], [r["loss"] for r in _records(whole)]
    assert got == pytest.approx(want, rel=1e-6, abs=0), (got, want)


def _flip_a_byte(ckpt: Path) -> Path:
    """Flip the third-last byte of the checkpoint's first data file (a shard's bytes); returns the file."""
    data = sorted(p for p in ckpt.iterdir() if p.name != "metadata.json")[0]
    with open(data, "r+b") as f:
        f.seek(-3, os.SEEK_END)
        byte = f.read(1)
        f.seek(-3, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))
    return data


def test_tensorboard_events_and_resume_auto_past_incomplete_and_damaged_checkpoints(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    cfg = config.parse_args([*COMMON, "--steps", "6", "--ckpt-every", "2", "--quiet", "--tensorboard",
                             "--out", str(out)], "")
    run_on_ranks(train.train, 2, cfg)
    records = _records(out)
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    loss = [(e.step, e.value) for e in events.Scalars("train/loss")]
    assert loss == [(r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in records]
    for tag, key in (("train/lr", "lr"), ("train/grad_norm", "grad_norm"), ("perf/tokens_per_s", "tokens_per_s"),
                     ("train/skipped_steps", "skipped"), ("perf/peak_memory_mb", "memory_mb")):
        assert [e.value for e in events.Scalars(tag)] == pytest.approx([r[key] for r in records], rel=1e-6), tag

    assert [p.name for p in resilience.checkpoints_newest_first(out)] == ["step_6", "step_4", "step_2"]
    data = _flip_a_byte(out / "ckpt" / "step_6")  # in the newest checkpoint's data
    (out / "ckpt" / "step_8").mkdir()  # a save that never committed
    said = []
    auto = config.parse_args([*COMMON, "--steps", "6", "--resume", "auto", "--out", str(out)], "")
    resilience.auto_resume(auto, said.append)  # reads no data: step_6's damage is found by its load
    ckpt = [str((out / "ckpt" / f"step_{n}").resolve()) for n in (6, 4, 2)]
    assert (auto.resume, auto.resume_fallbacks) == (ckpt[0], ckpt[1:]), said
    assert "step_8: incomplete" in said[0] and "resuming from" in said[1], said
    # the load of step_6 fails on both ranks alike; they load step_4 instead and run steps 5 and 6 again
    summary = run_on_ranks(train.train, 2, auto)[0]
    assert summary["resumed_from"] == ckpt[1]
    again = _records(out)
    assert [r["step"] for r in again] == [r["step"] for r in records] + [5, 6]
    assert [r["loss"] for r in again[-2:]] == pytest.approx([r["loss"] for r in records[-2:]], rel=1e-6, abs=0)
    for n in (4, 2):  # every complete checkpoint damaged: stopped with an error, no fresh start over them
        _flip_a_byte(out / "ckpt" / f"step_{n}")
    with pytest.raises(RankError, match="every complete checkpoint under .* is damaged"):
        run_on_ranks(train.train, 2, auto)

    os.truncate(data, data.stat().st_size - 1)  # a short file: seen without reading any data, skipped
    said = []
    auto = config.parse_args([*COMMON, "--resume", "auto", "--out", str(out)], "")
    resilience.auto_resume(auto, said.append)
    assert auto.resume == ckpt[1] and "step_6: damaged" in said[1], said

    fresh = config.parse_args([*COMMON, "--resume", "auto", "--out", str(tmp_path / "empty")], "")
    resilience.auto_resume(fresh, said.append)
    assert fresh.resume is None and fresh.overwrite and "starting fresh" in said[-1]


def test_bad_steps_are_skipped_then_stop_with_a_checkpoint_of_the_last_good_state(tmp_path):
    import torch

    out = tmp_path / "run"  # lr 1e30: the first update blows the weights up, every later loss is not finite
    cfg = config.parse_args([*COMMON, "--steps", "6", "--lr", "1e30", "--warmup", "0", "--ckpt-every", "1",
                             "--max-bad-steps", "1", "--quiet", "--out", str(out)], "")
    with pytest.raises(RankError, match="NonFiniteStepError: step 3: 2 consecutive steps"):
        run_on_ranks(train.train, 2, cfg)
    assert [r["skipped"] for r in _records(out)] == [0, 1]
    first, skipped, last_good = (_read_checkpoint(out / "ckpt" / f"step_{n}") for n in (1, 2, 3))
    assert set(first) == set(last_good)
    for key in first:  # the skipped steps changed no weight and no optimizer state
        assert torch.equal(first[key], skipped[key]) and torch.equal(first[key], last_good[key]), key

    # resumed: the count goes on from the checkpoint's 2 (steps 4 and 5 are bad too: the weights are blown up)
    resumed = config.parse_args([*COMMON, "--steps", "5", "--lr", "1e30", "--warmup", "0", "--max-bad-steps", "5",
                                 "--quiet", "--out", str(out), "--resume", str(out / "ckpt" / "step_3")], "")
    summary = run_on_ranks(train.train, 2, resumed)[0]
    assert [r["skipped"] for r in _records(out)][-2:] == [3, 4] and summary["skipped_steps"] == 4


def test_torchrun_restarts_a_killed_rank_and_the_job_ends_as_the_uninterrupted_one(tmp_path):
    """Two torchrun agents on loopback (one rank each, c10d rendezvous, ``--max-restarts 3``), ``--resume auto``
    with a checkpoint every 2 steps: a rank SIGKILLed mid-run makes torchrun restart the group, which resumes from
    the newest checkpoint; the final weights and optimizer state are the uninterrupted run's."""
    import uuid

    import torch
    from test_multinode import MARKER, RANK_ENV, _kill_marked, _tail

    from vescale.core.launch import free_port

    steps, out, whole = 12, tmp_path / "restarted", tmp_path / "whole"
    job = [*COMMON, "--steps", str(steps), "--ckpt-every", "2", "--quiet"]
    argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
            "--max-restarts", "3", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
            "--rdzv-id", "restart", str(ROOT / "tools" / "train.py"), *job, "--resume", "auto", "--out", str(out)]
    token = uuid.uuid4().hex
    env = {**{k: v for k, v in os.environ.items() if k not in RANK_ENV}, MARKER: token}
    logs = [tmp_path / f"agent{n}.log" for n in range(2)]
    agents = []
    try:
        for log in logs:
            agents.append(subprocess.Popen(argv, cwd=ROOT, env=env, stdout=open(log, "w"),  # noqa: SIM115
                                           stderr=subprocess.STDOUT, start_new_session=True))
        deadline = time.monotonic() + 600
        while not ((out / "ckpt" / "step_4" / "metadata.json").exists() and len(_records(out)) >= 5):
            assert all(a.poll() is None for a in agents) and time.monotonic() < deadline, _tail(logs[0])
            time.sleep(0.02)
        kids = Path(f"/proc/{agents[0].pid}/task/{agents[0].pid}/children").read_text().split()
        worker = next(int(p) for p in kids if b"train.py" in Path(f"/proc/{p}/cmdline").read_bytes())
        os.kill(worker, signal.SIGKILL)  # agent 0's rank, in the middle of the run
        codes = [a.wait(timeout=max(1.0, deadline - time.monotonic())) for a in agents]
    finally:
        _kill_marked(token)
    assert codes == [0, 0], "\n".join(_tail(log) for log in logs)
    text = "".join(log.read_text() for log in logs)
    assert "--resume auto: resuming from" in text and "exitcode: -9" in text, text[-4000:]

    run_on_ranks(train.train, 2, config.parse_args([*job, "--out", str(whole)], ""))
    got, want = _read_checkpoint(out / "ckpt" / f"step_{steps}"), _read_checkpoint(whole / "ckpt" / f"step_{steps}")
    assert sorted(got) == sorted(want) and any(k.endswith("exp_avg") for k in got)
    for key in want:  # the same ranks, mesh and data order: the resumed job is the uninterrupted one, bitwise
        assert torch.equal(got[key], want[key]), key


def test_refusals_name_the_flag_or_the_missing_package(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    cfg = config.parse_args([*COMMON, "--tensorboard", "--preempt-signal", "SIGNOPE", "--max-bad-steps", "-1"], "")
    with pytest.raises(SystemExit) as refused:
        config.check_fits(cfg)
    for part in ("--tensorboard needs the tensorboard package", "--preempt-signal: unknown signal 'SIGNOPE'",
                 "--max-bad-steps -1 must be at least 0"):
        assert part in str(refused.value), str(refused.value)


def test_save_failing_on_one_rank_goes_on_with_continue_and_a_slow_rank_is_named(tmp_path, monkeypatch):
    """Rank 1's disk is full for checkpoint ``step_2`` and rank 1 sleeps 0.2 s a step: with ``--on-save-error
    continue`` the run warns and trains on (``step_2`` uncommitted, ``step_4``/``step_6`` complete, one save error in
    summary.json); the per-rank table shows rank 1 busy and rank 0 waiting in collectives, and names rank 1 slow."""
    from faults import ENV_VAR

    monkeypatch.setenv(ENV_VAR, "save_error=1@2")  # the default, --on-save-error stop: every rank raises, naming it
    with spawn_on_pool(), pytest.raises(RankError, match=r"rank 1 failed writing \S*step_2/data-\w+-r00001"
                                                         r"\.safetensors: OSError\(28, 'No space left on device'\)"):
        train.main([*COMMON, "--steps", "3", "--ckpt-every", "2", "--quiet", "--out", str(tmp_path / "stop")])

    monkeypatch.setenv(ENV_VAR, "save_error=1@2,slow=1:0.2")
    out = tmp_path / "run"
    with spawn_on_pool():
        summary = train.main([*COMMON, "--steps", "6", "--ckpt-every", "2", "--on-save-error", "continue", "--quiet",
                              "--trace-steps", "1", "--out", str(out)])
    assert summary["save_errors"] == 1 and len(_records(out)) == 6
    assert not (out / "ckpt" / "step_2" / "metadata.json").exists()
    assert [p.name for p in resilience.checkpoints_newest_first(out)] == ["step_6", "step_4", "step_2"]
    said = []
    auto = config.parse_args([*COMMON, "--resume", "auto", "--out", str(out)], "")
    resilience.auto_resume(auto, said.append)
    assert auto.resume == str((out / "ckpt" / "step_6").resolve()), said
    fast, slow = summary["ranks"]
    assert slow["busy_s"]["p50"] >= 0.2 > fast["busy_s"]["p50"], summary["ranks"]
    assert fast["collective_wait_s"]["p50"] >= 0.1 > slow["collective_wait_s"]["p50"], summary["ranks"]
    assert summary["slow_ranks"] == [1]
    assert json.loads((out / "timeline.json").read_text())["otherData"]["ranks"] == summary["ranks"]
    assert all(r["step_s"]["p50"] <= r["step_s"]["p90"] <= r["step_s"]["max"] for r in summary["ranks"])


def _sigkill_when_written(step_dir: Path, pids: list[int], stop) -> None:
    """SIGKILL every process of ``pids`` once a data file of ``step_dir`` exists (or give up when ``stop`` is set)."""
    while not stop.is_set():
        if any(step_dir.glob("data-*.safetensors")):
            for pid in pids:
                os.kill(pid, signal.SIGKILL)
            return
        time.sleep(0.02)


def test_kill_during_an_async_save_resumes_from_the_previous_checkpoint(tmp_path, monkeypatch):
    """SIGKILL to every rank of the job while its async save of ``step_4`` is writing (``save_stall=4``: the data
    files are written, the save then blocks): ``--resume auto`` skips the uncommitted ``step_4``, naming it, and the
    resumed run loads ``step_2`` and finishes.

    The job is ``train.main`` on the warm pool (``spawn_on_pool``); a thread kills both pooled ranks (the pool is
    rebuilt from the fork server for the resume). What is left on disk is what a killed job leaves: the ranks' save
    threads die with them."""
    import threading

    from faults import ENV_VAR

    out = tmp_path / "run"
    # the pool first: a fork server started now would pass the fault on to every later pooled rank; the job's ranks
    # take it from this process's environment (spawn_on_pool)
    job_ranks = run_on_ranks(os.getpid, 2)
    monkeypatch.setenv(ENV_VAR, "save_stall=4")
    stop = threading.Event()
    killer = threading.Thread(target=_sigkill_when_written, args=(out / "ckpt" / "step_4", job_ranks, stop),
                              daemon=True)
    killer.start()
    try:
        with spawn_on_pool(), pytest.raises(RankError, match="died"):
            train.main([*COMMON, "--steps", "8", "--ckpt-every", "2", "--quiet", "--out", str(out)])
    finally:
        stop.set()
        killer.join()
    monkeypatch.delenv(ENV_VAR)
    assert not (out / "ckpt" / "step_4" / "metadata.json").exists()
    said = []
    auto = config.parse_args([*COMMON, "--steps", "8", "--ckpt-every", "2", "--quiet", "--resume", "auto",
                              "--out", str(out)], "")
    resilience.auto_resume(auto, said.append)
    assert auto.resume == str((out / "ckpt" / "step_2").resolve()), said
    assert any("step_4: incomplete" in line for line in said), said
    summary = run_on_ranks(train.train, 2, auto)[0]
    assert summary["steps"] == 8 and _records(out)[-1]["step"] == 8
    assert (out / "ckpt" / "step_8" / "metadata.json").exists()
