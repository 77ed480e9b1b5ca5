"""tools/train.py with bf16 optimizer state and FP8 linears (issue 39), one cell: dp=2, ZeRO 3, --fp8 tensorwise
(fp8 weight all-gather), --optimizer-state-dtype bf16.

A run of four steps checkpoints at step 2; a second run resumes from that checkpoint and must repeat steps 3 and 4's
losses (relative 1e-6: the same ops on the same data), which holds only if the bf16 moments and the fp8 model's
weights were saved and loaded as they were. The checkpoint holds the AdamW moments as bfloat16, the masters fp32.
The numerics against one device are the library tests' (vescale-parallel tests/test_state_dtype.py, test_fp8.py).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from vescale.core.testing import run_on_ranks

pytest.importorskip("torchao", reason="--fp8 needs torchao (vescale-parallel[fp8])")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import config  # noqa: E402
import train  # noqa: E402

COMMON = ["--model", "gpt-tiny", "--data", "markov", "--batch-size", "8", "--seq-len", "16", "--lr", "3e-3",
          "--warmup", "2", "--trace-steps", "0", "--mesh", "dp=2", "--zero", "3", "--init", "eager",
          "--fp8", "tensorwise", "--optimizer-state-dtype", "bf16", "--steps", "4", "--quiet"]


def _losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


def test_bf16_state_and_fp8_train_checkpoint_and_resume(tmp_path):
    from vescale import checkpoint

    first = tmp_path / "first"
    run_on_ranks(train.train, 2, config.parse_args([*COMMON, "--ckpt-every", "2", "--out", str(first)], ""))
    saved = checkpoint.inspect(first / "ckpt" / "step_2")["tensors"]
    moments = {k: v["dtype"] for k, v in saved.items() if k.endswith(("exp_avg", "exp_avg_sq"))}
    assert moments and set(moments.values()) == {"bfloat16"}, moments
    assert {v["dtype"] for k, v in saved.items() if k.startswith("model.")} == {"float32"}
    again = tmp_path / "again"
    run_on_ranks(train.train, 2, config.parse_args(
        [*COMMON, "--resume", str(first / "ckpt" / "step_2"), "--out", str(again)], ""))
    want, got = _losses(first), _losses(again)
    assert sorted(got) == [3, 4], got
    for step in (3, 4):
        assert got[step] == pytest.approx(want[step], rel=1e-6), (step, got[step], want[step])
    assert want[4] < want[1]
