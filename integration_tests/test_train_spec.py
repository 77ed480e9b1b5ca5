"""The spec the planner chooses trains, through ``tools/train.py --spec FILE``, the same curve as the equivalent
flags: one composition path (``vescale.plan.build``) whichever way the parallelism is said.

The planner (``vescale.plan.choose_parallelism``, restricted by ``fixed``) prices the tiny model and its report
gives the spec as JSON (``report.spec().to_json()``), which is written to a file; ``train.py --spec FILE`` and
``train.py`` with the flags that say the same (``--mesh``, ``--zero``, ``--tp-plan auto``, ``--split-points``) run
on pooled ranks. The two curves are bitwise equal (the same ops in the same order), and both equal the one-device
curve within the matrix's tolerance (so neither is a no-op).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import config  # noqa: E402
import models  # noqa: E402
import train  # noqa: E402

COMMON = ["--model", "gpt-tiny", "--data", "markov", "--steps", "4", "--batch-size", "8", "--seq-len", "16",
          "--lr", "3e-3", "--warmup", "2", "--trace-steps", "0", "--quiet", "--microbatches", "4"]


def _losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def _planned_spec(world: int, fixed: dict, zero: int):
    import torch

    from vescale.plan import choose_parallelism

    with torch.device("meta"):
        model = models.create("gpt-tiny")
    report = choose_parallelism(model, world, batch_size=8, seq_len=16, fixed=fixed, zero_stages=(zero,))
    return report.spec(microbatches=4)


@pytest.fixture(scope="module")
def one_device(tmp_path_factory) -> list[float]:
    """The losses of the same job on one rank (``--mesh dp=1``), run once for every cell."""
    from vescale.core.testing import run_on_ranks

    out = tmp_path_factory.mktemp("one")
    run_on_ranks(train.train, 1, config.parse_args([*COMMON, "--mesh", "dp=1", "--out", str(out)], ""))
    return _losses(out)


@pytest.mark.parametrize("world, fixed, zero", [(4, {"dp": 2, "tp": 2}, 1), (4, {"pp": 2, "dp": 2}, 2)],
                         ids=["dp2xtp2-zero1", "pp2xdp2-zero2"])
def test_planned_spec_trains_the_curve_of_the_equivalent_flags(ranks, tmp_path, world, fixed, zero, one_device):
    from vescale.plan import ParallelSpec

    spec = _planned_spec(world, fixed, zero)
    assert spec.mesh == fixed and spec.zero == zero and spec.tp_plan == "auto"
    assert ParallelSpec.from_json(spec.to_json()) == spec  # the JSON round trip
    path = tmp_path / "spec.json"
    path.write_text(spec.to_json())
    by_spec = config.parse_args([*COMMON, "--spec", str(path), "--out", str(tmp_path / "spec")], "")
    flags = [*COMMON, "--mesh", ",".join(f"{k}={v}" for k, v in fixed.items()), "--zero", str(zero),
             "--tp-plan", "auto", "--out", str(tmp_path / "flags")]
    if spec.split_points:
        flags += ["--split-points", ",".join(spec.split_points)]
    by_flags = config.parse_args(flags, "")
    assert config.parallel_spec(by_spec) == config.parallel_spec(by_flags) == spec
    ranks(train.train, world, by_spec)
    ranks(train.train, world, by_flags)
    got, want, one = _losses(tmp_path / "spec"), _losses(tmp_path / "flags"), one_device
    assert got == want, (got, want)
    assert got == pytest.approx(one, rel=1e-5), (got, one)


def test_a_spec_file_that_is_not_a_spec_is_a_usage_error(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"mesh": {"dp": 2}, "zero_stage": 1}))
    with pytest.raises(SystemExit):
        config.parse_args(["--spec", str(bad)], "")
    assert "unknown parallelism spec field(s) ['zero_stage']" in capsys.readouterr().err
