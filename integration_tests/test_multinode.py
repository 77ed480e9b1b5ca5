"""A two-node torchrun job on loopback runs ``tools/train.py`` as the README's "Several nodes" block says, and
computes what the same job computes on ranks train.py spawns itself.

The README block is the script: this file reads it, lets bash expand each ``torchrun`` line (with this test's own
``PORT`` and ``RUNS``), and starts the two agents of each launch (``--nnodes 2 --nproc-per-node 2 --node-rank 0|1``,
static rendezvous on 127.0.0.1) as subprocesses running ``sys.executable -m torch.distributed.run``: 4 gloo ranks on
CPU per launch. The reference for a launch is the same parsed command line run by ``train.train`` on pooled ranks of
the test harness (no torchrun, no ``init_distributed``); for the launch that resumes a checkpoint on another mesh,
the reference is the uninterrupted launch that wrote it. Compared: the loss curve of every step (``metrics.jsonl``)
and the final checkpoint (weights and AdamW's moments, which are running averages of the gradients). Tolerances
are those of ``test_train_matrix.py``: fp32, other reduction orders than the reference, so rtol 1e-4 on losses;
on the final state rtol 1e-4 with an absolute floor of 1e-6 of each tensor's largest magnitude (both stated at the
assertions).

Every launch runs under a hard deadline. torchrun starts its workers in sessions of their own, so each launch marks
its processes with a token in their environment; on failure, on timeout and after success every process carrying
the token is killed by its id, and a failure message carries the end of both agents' output.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import replace
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"

sys.path.insert(0, str(ROOT / "tools"))  # tools/train.py imports by name, as do config, models, data, report
import train  # noqa: E402

LAUNCH_TIMEOUT_S = 240  # one launch takes ~20 s on 2 loaded cores: 4 ranks and 2 agents importing torch
MARKER = "VESCALE_MULTINODE_TEST_LAUNCH"
RANK_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
            "TORCHELASTIC_RUN_ID")


def _readme_block() -> str:
    """The bash block of the README's "Several nodes" section."""
    section = README.read_text().split("### Several nodes", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```bash\n(.*?)```", section, re.S).group(1)


def _readme_launches() -> tuple[str, list[list[str]]]:
    """``(preamble, launches)``: the variable assignments, and each launch's ``torchrun`` lines (a blank line or a
    comment separates launches)."""
    preamble, launches, current = [], [], []
    for line in _readme_block().splitlines():
        if line.startswith("torchrun "):
            current.append(line)
            continue
        if current:
            launches.append(current)
            current = []
        if line.strip() and not line.lstrip().startswith("#"):
            assert not launches, f"README block: {line!r} after the first launch is not understood by this test"
            preamble.append(line)
    if current:
        launches.append(current)
    return "\n".join(preamble), launches


def _expand(preamble: str, line: str, env: dict[str, str]) -> list[str]:
    """The arguments bash gives ``torchrun`` on ``line`` after ``preamble`` (without the line's ``&`` / ``; wait``)."""
    command = re.sub(r"\s*(&|;\s*wait)\s*$", "", line)
    script = "set -eu\n" + preamble + "\nprintf '%s\\0' " + command[len("torchrun "):] + "\n"
    out = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=30, check=True)
    return out.stdout.split("\0")[:-1]


def _marked_pids(token: str) -> list[int]:
    """Ids of this user's processes whose environment carries ``MARKER=token``."""
    needle = f"{MARKER}={token}".encode() + b"\0"
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:  # gone, or another user's
            continue
        if needle in environ:
            pids.append(int(entry.name))
    return pids


def _kill_marked(token: str) -> list[int]:
    """SIGKILL every process marked with ``token`` (agents and the workers in their own sessions); their ids."""
    pids = _marked_pids(token)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return pids


def _tail(path: Path, n: int = 4000) -> str:
    text = path.read_text(errors="replace") if path.exists() else "(no output)"
    return text[-n:]


def _run_agents(argvs: list[list[str]], logs: Path) -> float:
    """Start one torchrun agent per ``argvs`` entry, wait for all of them (hard deadline), return the wall seconds.

    Fails the test, with the end of every agent's output, when an agent exits non-zero or the deadline passes;
    every process of the launch is killed before this returns, whatever happened."""
    token = uuid.uuid4().hex
    env = {k: v for k, v in os.environ.items() if k not in RANK_ENV}
    env[MARKER] = token
    logs.mkdir(parents=True, exist_ok=True)
    procs, files, problem = [], [], None
    t0 = time.monotonic()
    try:
        for node, argv in enumerate(argvs):
            files.append(open(logs / f"node{node}.log", "w"))  # noqa: SIM115 - closed below
            procs.append(subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *argv], cwd=ROOT, env=env,
                                          stdout=files[-1], stderr=subprocess.STDOUT, start_new_session=True))
        deadline = t0 + LAUNCH_TIMEOUT_S
        # Poll every agent: when one fails, the other would wait for it (torchrun's exit barrier) for minutes.
        codes = [p.poll() for p in procs]
        while None in codes and all(c in (None, 0) for c in codes) and time.monotonic() < deadline:
            time.sleep(0.2)
            codes = [p.poll() for p in procs]
        if any(c is None for c in codes) and all(c in (None, 0) for c in codes):
            problem = f"still running after {LAUNCH_TIMEOUT_S} s (exit codes so far {codes})"
        elif any(c != 0 for c in codes):
            problem = f"exit codes {codes}"
    finally:
        killed = _kill_marked(token)
        for p in procs:
            p.wait()
        for f in files:
            f.close()
    wall = time.monotonic() - t0
    if problem is not None:
        outputs = "\n".join(f"--- node {n}: {' '.join(argv)}\n{_tail(logs / f'node{n}.log')}"
                            for n, argv in enumerate(argvs))
        pytest.fail(f"torchrun launch failed: {problem}; killed pids {killed}\n{outputs}", pytrace=False)
    return wall


class Launches:
    """The README's launches, each run (once) the first time a test asks for it."""

    def __init__(self, runs: Path) -> None:
        self.runs = runs
        self.preamble, self.lines = _readme_launches()
        self.done: dict[int, float] = {}

    def argvs(self, index: int, port: int | str = "PORT") -> list[list[str]]:
        env = {**os.environ, "PORT": str(port), "RUNS": str(self.runs)}
        env.pop("HOST", None)
        return [_expand(self.preamble, line, env) for line in self.lines[index]]

    def config(self, index: int) -> train.TrainConfig:
        """The ``TrainConfig`` both nodes of launch ``index`` run (checked to be the same)."""
        configs = []
        for argv in self.argvs(index):
            job = argv[argv.index("tools/train.py") + 1:]
            configs.append(train.parse_args(job, "reference"))
        assert all(c == configs[0] for c in configs), f"launch {index}: the nodes run different jobs: {configs}"
        return configs[0]

    def run(self, index: int) -> train.TrainConfig:
        from vescale.core.launch import free_port

        if index not in self.done:
            self.done[index] = _run_agents(self.argvs(index, free_port()), self.runs / "logs" / f"launch{index}")
            print(f"\nlaunch {index} ({self.config(index).mesh}): {self.done[index]:.1f} s")
        return self.config(index)


@pytest.fixture(scope="module")
def launches(tmp_path_factory) -> Launches:
    return Launches(tmp_path_factory.mktemp("multinode"))


def _losses(out: str | Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def _final_state(out: str | Path, steps: int) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint ``out/ckpt/step_<steps>``, whole (model weights, AdamW moments and steps)."""
    from vescale import checkpoint

    path = Path(out) / "ckpt" / f"step_{steps}"
    state: dict[str, dict[str, torch.Tensor]] = {}
    for key, info in checkpoint.inspect(path)["tensors"].items():
        top, rest = key.split(".", 1)
        state.setdefault(top, {})[rest] = torch.empty(info["shape"], dtype=getattr(torch, info["dtype"]))
    result = checkpoint.load(path, state, strict=False)  # the values (param groups, progress) are not compared
    assert not result.missing and not result.mismatched, result
    return {f"{top}.{rest}": t for top, part in state.items() for rest, t in part.items()}


def _assert_same_state(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert sorted(got) == sorted(want), f"{what}: checkpoint keys differ"
    assert any(k.endswith(".exp_avg") for k in got), f"{what}: no optimizer moments in the checkpoint"
    for key, value in want.items():
        # fp32, other reduction order: rtol 1e-4, absolute floor 1e-6 of the tensor's largest magnitude.
        atol = 1e-6 * float(value.abs().max()) if value.numel() else 0.0
        torch.testing.assert_close(got[key], value, rtol=1e-4, atol=atol, msg=lambda m, k=key: f"{what}: {k}: {m}")


def test_readme_block_is_a_two_node_loopback_job(launches):
    """What the other tests rely on: two agents per launch, node ranks 0 and 1, static rendezvous on loopback,
    three launches on three meshes of 4 ranks, the last resuming the first's checkpoint."""
    assert len(launches.lines) == 3, launches.lines
    for index in range(3):
        argvs = launches.argvs(index, 12345)
        assert len(argvs) == 2, argvs
        for node, argv in enumerate(argvs):
            assert argv[argv.index("--nnodes") + 1] == "2" and argv[argv.index("--nproc-per-node") + 1] == "2"
            assert argv[argv.index("--node-rank") + 1] == str(node)
            assert argv[argv.index("--rdzv-endpoint") + 1] == "127.0.0.1:12345"
            assert "--rdzv-backend" not in argv  # torchrun's default: static
    cfgs = [launches.config(i) for i in range(3)]
    assert [c.mesh for c in cfgs] == ["pp=2,dp=2", "dp=2,tp=2", "pp=2,tp=2"]
    assert all(math.prod(c.dims.values()) == 4 for c in cfgs)  # 2 nodes x 2 ranks
    assert cfgs[0].resume is None and cfgs[1].resume is None
    assert cfgs[2].resume == str(Path(cfgs[0].out) / "ckpt" / f"step_{cfgs[0].ckpt_every}")


@pytest.mark.parametrize("index", [0, 1], ids=["pp2xdp2", "dp2xtp2"])
def test_two_node_launch_equals_self_spawned_run(index, launches, tmp_path, ranks):
    cfg = launches.run(index)
    got = _losses(cfg.out)
    assert len(got) == cfg.steps
    assert got[-1] < got[0]  # it learns
    reference = replace(cfg, out=str(tmp_path / "spawned"))
    ranks(train.train, 4, reference)
    want = _losses(reference.out)
    # fp32, other reduction order possible (torchrun's workers run 1 thread each): rtol 1e-4 per step.
    assert got == pytest.approx(want, rel=1e-4), f"{cfg.mesh} under torchrun: {got} vs self-spawned {want}"
    _assert_same_state(_final_state(cfg.out, cfg.steps), _final_state(reference.out, cfg.steps),
                       f"{cfg.mesh} under torchrun vs self-spawned")


def test_two_node_resume_on_another_mesh_continues_the_curve(launches):
    first = launches.run(0)
    resumed = launches.run(2)
    half = first.ckpt_every
    got, uninterrupted = _losses(resumed.out), _losses(first.out)
    assert len(got) == first.steps - half
    # The uninterrupted torchrun run (itself checked against the self-spawned one above); rtol 1e-4.
    assert got == pytest.approx(uninterrupted[half:], rel=1e-4), (
        f"{first.mesh} -> {resumed.mesh} from step {half}: {got} vs uninterrupted {uninterrupted[half:]}")
    _assert_same_state(_final_state(resumed.out, resumed.steps), _final_state(first.out, first.steps),
                       f"{first.mesh} -> {resumed.mesh} resumed vs uninterrupted")


def _gather_repeatedly(times: int) -> tuple[int, list[list[float]]]:
    """On each rank: call ``report.gather_per_rank`` ``times`` times; count the calls after which a tensor of its
    collective was still alive (held by gloo's worker thread), seen through the weak references it waits on."""
    import report
    import torch.distributed as dist

    seen: list = []
    unwrapped = report._all_gather_rows

    def recording(*args, **kwargs):
        rows, held = unwrapped(*args, **kwargs)
        seen.append(held)
        return rows, held

    report._all_gather_rows = recording
    try:
        held_after_return = 0
        for _ in range(times):
            rows = report.gather_per_rank([float(dist.get_rank()), 1.0], train.rank_device())
            held_after_return += any(r() is not None for r in seen[-1])
    finally:
        report._all_gather_rows = unwrapped
    return held_after_return, rows.tolist()


def test_summary_gather_returns_after_the_backend_let_go(ranks):
    """The end-of-run gather, the last collective before a torchrun rank exits, returns only once gloo's worker thread
    has dropped its tensors: without the wait, about 6 % of all_gather calls return while it still holds them (an
    abort if the interpreter is then shutting down), so 200 calls would all but surely see some."""
    for rank, (held, rows) in enumerate(ranks(_gather_repeatedly, 2, 200)):
        assert rows == [[0.0, 1.0], [1.0, 1.0]], f"rank {rank}: {rows}"
        assert held == 0, f"rank {rank}: {held} of 200 gathers returned while a gloo thread still held their tensors"
