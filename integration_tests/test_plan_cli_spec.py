"""A spec printed by the planner CLI (``python -m vescale.plan ... --json``) trains as written on 8 CPU ranks through
``tools/train.py --spec FILE``, and ``summary.json`` holds the planner's memory estimate of that spec beside what
the ranks measured.

The CLI plans tools/models.py's ``llama`` from its config.json (the same sizes), world 8, pinned to ``pp=1,tp=2`` to
keep 8 ranks on a 2-core machine to seconds; the printed JSON is written to a file unchanged. Two steps on the 8
ranks give the one-device curve (the second step's loss depends on the first step's gradients), and the exact
per-rank parameter + gradient + optimizer bytes match the planner's estimate within 10 %.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import config  # noqa: E402
import train  # noqa: E402

# tools/models.py's "llama" (transformers LlamaForCausalLM), as a Hugging Face config.json
LLAMA = {"model_type": "llama", "vocab_size": 512, "hidden_size": 256, "intermediate_size": 704,
         "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 256,
         "tie_word_embeddings": False}
COMMON = ["--model", "llama", "--data", "markov", "--steps", "2", "--batch-size", "8", "--seq-len", "32",
          "--lr", "3e-3", "--warmup", "1", "--trace-steps", "0", "--quiet"]


def _losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_world8_cli_spec_trains_as_written(ranks, tmp_path, capsys):
    from vescale.plan import ParallelSpec
    from vescale.plan.cli import main

    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    assert main([str(tmp_path / "config.json"), "--world-size", "8", "--seq-len", "32", "--batch-size", "8",
                 "--memory-gb", "16", "--dtype", "fp32", "--fixed", "pp=1,tp=2", "--json"]) == 0
    printed = capsys.readouterr().out
    spec = ParallelSpec.from_json(printed)
    assert spec.world_size == 8 and spec.size("tp") == 2
    (tmp_path / "spec.json").write_text(printed)  # as printed: nothing edited
    by_spec = config.parse_args([*COMMON, "--spec", str(tmp_path / "spec.json"), "--out", str(tmp_path / "run")], "")
    assert config.parallel_spec(by_spec) == spec
    one = config.parse_args([*COMMON, "--mesh", "dp=1", "--out", str(tmp_path / "one")], "")
    ranks(train.train, 1, one)
    summary = ranks(train.train, 8, by_spec)[0]  # 8 ranks: the world the CLI planned
    got, want = _losses(tmp_path / "run"), _losses(tmp_path / "one")
    assert len(got) == 2 and got == pytest.approx(want, rel=1e-4), (got, want)

    estimate = summary["planner_memory_mb"]
    assert "error" not in estimate, estimate
    assert estimate["total"] == pytest.approx(sum(v for k, v in estimate.items() if k != "total"), rel=1e-3)
    measured = summary["state_mb_per_rank"]
    assert len(measured) == 8
    states = estimate["parameters"] + estimate["gradients"] + estimate["optimizer"]
    assert states == pytest.approx(max(measured), rel=0.10), (estimate, measured)
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["planner_memory_mb"] == estimate
