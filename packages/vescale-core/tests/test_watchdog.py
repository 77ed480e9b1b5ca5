"""vescale.core.watchdog: a rank that skips a collective makes every waiting rank raise CollectiveTimeoutError within
the timeout, naming the skipping rank, the collective, its mesh dim and its call site; a normal run's ring records
each collective (op, group, mesh dim, per-group index, bytes, call site) as the program issued it.

The hang tests run on their own spawned ranks (``spawn(..., timeout=120)`` kills them if anything hangs), since a
timed-out gloo group cannot be reused and the short timeout must not leak into the pooled ranks.
"""

from __future__ import annotations

import inspect
import json
import time
from pathlib import Path

import pytest

from vescale.core.launch import spawn
from vescale.core.testing import run_on_ranks

TIMEOUT_S = 3.0  # the collective timeout of the hang tests
SLACK_S = 45.0  # generous: spawned ranks on a loaded 2-core machine; the point is "not the 300 s default, no hang"


def _line_of(fn, marker: str) -> int:
    """The source line of ``fn`` that carries the comment ``marker``."""
    lines, start = inspect.getsourcelines(fn)
    return start + next(i for i, line in enumerate(lines) if f"# {marker}" in line)


SCENARIOS = ("three ranks, skipper waits in a barrier", "two ranks, skipper waits in a barrier",
             "three ranks, skipper sleeps", "three ranks, skipper waits in a barrier, no ring: flight recorder")


def _skip_one(out_dir: str) -> None:
    """On 3 ranks, each scenario on a fresh process group (a timed-out gloo group is unusable) as the mesh dim dp:
    every member but the skipper (rank 1) calls one more all_reduce, then the skipper waits in a barrier on the same
    group (or sleeps past everyone's failure). Each rank writes what it raised to out_dir."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from vescale.core.errors import CollectiveTimeoutError
    from vescale.core.watchdog import set_collective_timeout, watch_collectives

    rank, skipper = dist.get_rank(), 1
    groups = [dist.new_group(ranks) for ranks in ([0, 1, 2], [0, 1], [0, 1, 2], [0, 1, 2])]
    with watch_collectives(set_timeout=False):  # torch imports its compiler on a process's first dispatch mode
        torch.ones(1).add_(1)
    for scenario, group in zip(SCENARIOS, groups):
        member = rank in dist.get_process_group_ranks(group)
        mesh = DeviceMesh.from_group(group, "cpu", mesh_dim_names=("dp",)) if member else None
        set_collective_timeout(60)
        dist.barrier()  # under a long timeout: every rank is here before the short one applies
        t, start, outcome = torch.ones(4), time.monotonic(), {}
        try:
            with watch_collectives(mesh, timeout=TIMEOUT_S, report_wait=TIMEOUT_S, record="no ring" not in scenario):
                if member:
                    dist.all_reduce(t, group=group)  # first all_reduce
                    if rank != skipper:
                        dist.all_reduce(t, group=group)  # skipped all_reduce
                    elif "sleeps" in scenario:
                        time.sleep(2 * TIMEOUT_S + 2)
                    if "barrier" in scenario or rank != skipper:
                        dist.barrier(group=group)  # barrier the skipper waits in
            outcome = {"raised": None}
        except CollectiveTimeoutError as e:
            outcome = {"raised": type(e).__name__, "message": str(e), "missing": e.missing_ranks,
                       "collective": e.collective, "mesh_dim": e.mesh_dim, "call_site": e.call_site, "seq": e.seq,
                       "cause": str(e.__cause__)[:200]}
        outcome["elapsed_s"] = time.monotonic() - start
        (Path(out_dir) / f"{SCENARIOS.index(scenario)}-rank{rank}.json").write_text(json.dumps(outcome))
    set_collective_timeout(60)
    dist.barrier()


def test_skipped_collective_fails_every_waiting_rank_naming_the_skipper(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "100")  # the ranks' flight recorder, for the scenario without ring
    spawn(_skip_one, 3, str(tmp_path), timeout=180, collective_timeout=60)
    skipper = 1
    skipped_site = f"test_watchdog.py:{_line_of(_skip_one, 'skipped all_reduce')} in _skip_one"
    barrier_site = f"test_watchdog.py:{_line_of(_skip_one, 'barrier the skipper waits in')} in _skip_one"
    for i, scenario in enumerate(SCENARIOS):
        members = [0, 1] if scenario.startswith("two") else [0, 1, 2]
        outcomes = {r: json.loads((tmp_path / f"{i}-rank{r}.json").read_text()) for r in range(3)}
        waiting = [r for r in members if r != skipper or "barrier" in scenario]
        for r in waiting:
            o = outcomes[r]
            assert o["raised"] == "CollectiveTimeoutError", (scenario, r, o)
            assert o["elapsed_s"] < TIMEOUT_S + SLACK_S, (scenario, r, o)  # failed, instead of hanging
            # The cause is the backend's: the timeout, or a peer that timed out first and closed the connection.
            assert "timed out" in o["cause"].lower() or "closed by peer" in o["cause"].lower(), o["cause"]
            if "no ring" in scenario:  # torch's flight recorder: its sequence ids, no call sites
                assert (o["collective"], o["mesh_dim"], o["missing"]) == ("all_reduce", "dp", [skipper]), o
                assert f"rank {skipper}: waits in barrier #{o['seq']}" in o["message"], o["message"]
                continue
            # The collective the others wait in, on every rank (the skipper included): op, mesh dim, call site.
            assert (o["collective"], o["mesh_dim"], o["seq"]) == ("all_reduce", "dp", 1), (scenario, o)
            assert o["call_site"].endswith(skipped_site), o["call_site"]
            assert f"rank {skipper}" in o["message"] and skipped_site in o["message"], o["message"]
            if scenario.startswith("three ranks, skipper waits"):  # a majority: the skipper alone is named
                assert o["missing"] == [skipper], o
                assert f"rank(s) [{skipper}] missing from all_reduce #1 on mesh dim 'dp'" in o["message"]
                assert f"rank {skipper}: waits in barrier #1" in o["message"] and barrier_site in o["message"]
            elif scenario.startswith("two"):  # each in a different collective: both named, neither blamed
                assert o["missing"] == [0, 1], o
                assert "disagree" in o["message"] and f"rank {skipper}: waits in barrier #1" in o["message"]
            else:  # the skipper waits in no collective: the others name it as not reporting
                assert o["missing"] == [skipper], o
                assert f"rank {skipper}: did not report" in o["message"], o["message"]
        # Every waiting rank prints the same diagnosis (bar the "raised on rank r" tag).
        texts = {outcomes[r]["message"].replace(f"[raised on rank {r}]", "") for r in waiting}
        assert len(texts) == 1, texts
        for r in set(range(3)) - set(waiting):  # documented: a rank in no collective does not raise itself
            assert outcomes[r]["raised"] is None, (scenario, r, outcomes[r])


def _record_a_step(ring_size: int):
    """A few collectives of each kind on a dp x tp mesh, recorded by the watch and counted by count_comms (the
    independent counter); returns both, and the lines that issued them."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from vescale.core.comm import count_comms
    from vescale.core.mesh import init_mesh, sub_mesh
    from vescale.core.watchdog import watch_collectives

    mesh = init_mesh("dp=1,tp=2")
    x = torch.arange(8.0).reshape(4, 2)
    with watch_collectives(mesh, set_timeout=False, ring_size=ring_size) as watch, count_comms(mesh) as counter:
        dist.all_reduce(torch.ones(3))  # eager world all_reduce
        d = distribute_tensor(x, sub_mesh(mesh, "tp"), [Shard(0)])  # dtensor scatter
        full = d.redistribute(sub_mesh(mesh, "tp"), [Replicate()]).to_local()  # dtensor all_gather
        dist.barrier()  # eager barrier
        dist.all_reduce(torch.ones(5), group=sub_mesh(mesh, "tp").get_group())  # eager tp all_reduce
    assert torch.equal(full, x)
    return watch.ring.to_dict(), counter.summary()


def test_ring_records_the_collectives_as_issued():
    rings = run_on_ranks(_record_a_step, 2, 64)
    for ring, counts in rings:
        ops = [(c["op"], c["site"].split("/")[-1]) for c in ring["collectives"]]
        line = lambda marker: f"test_watchdog.py:{_line_of(_record_a_step, marker)} in _record_a_step"  # noqa: E731
        assert ops == [("all_reduce", line("eager world all_reduce")),
                       ("scatter", line("dtensor scatter")),
                       ("all_gather_into_tensor", line("dtensor all_gather")),
                       ("barrier", line("eager barrier")),
                       ("all_reduce", line("eager tp all_reduce"))], ops
        groups = ring["groups"]
        dims = [groups[c["group"]]["dim"] for c in ring["collectives"]]
        assert dims[1] == dims[2] == dims[4] == "tp", dims
        # per-group indices: the tp group's collectives are #0, #1, #2 (the world group's count separately)
        seqs = {}
        for c in ring["collectives"]:
            assert c["seq"] == seqs.get(c["group"], 0), ring
            seqs[c["group"]] = c["seq"] + 1
        assert ring["collectives"][0]["bytes"] == 3 * 4 and ring["collectives"][4]["bytes"] == 5 * 4
        assert ring["collectives"][2]["bytes"] == 2 * 2 * 4  # this rank's shard of the [4, 2] float tensor
        assert groups[ring["collectives"][4]["group"]]["ranks"] == [0, 1]
        # The independent counter saw the same collectives (barrier is not one it counts).
        assert counts["counts"] == {"all_reduce": 2, "scatter": 1, "all_gather_into_tensor": 1}, counts
    # A bounded ring keeps the newest.
    (small, _), _ = run_on_ranks(_record_a_step, 2, 2)
    assert [c["op"] for c in small["collectives"]] == ["barrier", "all_reduce"]


def test_collective_timeout_from_argument_env_and_default(monkeypatch):
    from vescale.core.watchdog import DEFAULT_TIMEOUT_S, ENV_VAR, collective_timeout

    monkeypatch.delenv(ENV_VAR, raising=False)
    assert collective_timeout() == DEFAULT_TIMEOUT_S
    monkeypatch.setenv(ENV_VAR, "12.5")
    assert collective_timeout() == 12.5
    assert collective_timeout(7) == 7.0
    monkeypatch.setenv(ENV_VAR, "soon")
    with pytest.raises(ValueError, match=ENV_VAR):
        collective_timeout()
    with pytest.raises(ValueError, match="positive"):
        collective_timeout(0)
