"""The main job masks attention per document on packed real text by default (``--document-mask``), on cp=2 as on
one device; ``--no-document-mask`` attends across the packed row.

One cell: gpt-tiny on a tiny corpus (``test_train_data``'s fixture: 30 documents, a small BPE, EOS between
documents, so some packed rows hold several documents and some cross the cp chunk boundaries), 3 steps.
The reference for the first step's loss is computed here without the code under test: the same initial model (the
job's own ``--grad-dump`` of step 0 is not used; the model is rebuilt from the job's seed) run on every document of
every row on its own, one cross-entropy over the global batch. Rows are 64 tokens (gpt-tiny's longest).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import prepare_data  # noqa: E402
import train  # noqa: E402
from test_train_data import _cfg, _records, _run, corpus  # noqa: E402,F401,F811  (the corpus fixture)


def _per_document_loss(cfg, eos_id: int) -> float:
    """Step 0's loss of the job's initial model, each document of each row run on its own (no mask of any kind)."""
    import data as data_mod

    trainer = train.build_trainer(cfg)  # one rank: the whole model, initialised as every mesh initialises it
    model = trainer.state["model"]
    rows = data_mod.TokenData(cfg.data, cfg.seq_len, cfg.seed).batch(0, cfg.batch_size, cfg.seq_len)
    inputs, targets = rows[:, :-1], rows[:, 1:]
    logits, packed = [], 0
    with torch.no_grad():
        for row in inputs:
            ends = [i + 1 for i, t in enumerate(row.tolist()) if t == eos_id]
            cuts = [0, *[e for e in ends if e < len(row)], len(row)]
            packed += len(cuts) > 2
            logits.append(torch.cat([model(row[None, a:b]) for a, b in zip(cuts, cuts[1:])], dim=1))
    assert packed >= 2, "the test's rows should hold several documents"
    return float(F.cross_entropy(torch.cat(logits).flatten(0, 1), targets.flatten()))


def _short(cfg):
    cfg.steps, cfg.eval_every, cfg.seq_len = 2, 0, 64  # rows of 64 tokens: several hold two documents or more
    return cfg


def test_document_mask_is_on_by_default_and_cp2_equals_one_device(corpus, tmp_path, ranks):  # noqa: F811
    prep = prepare_data.prepare(str(corpus["dir"]), corpus["tok"], heldout=0.1, cache=corpus["cache"])
    eos_id = json.loads((Path(prep.directory) / "meta.json").read_text())["eos_id"]
    masked = _records(_run(ranks, 2, _short(_cfg("cp=2", tmp_path / "cp2", prep.directory))))
    unmasked = _records(_run(ranks, 1, _short(_cfg("dp=1", tmp_path / "off", prep.directory, document_mask=False))))
    (want,) = ranks(_per_document_loss, 1, _short(_cfg("dp=1", tmp_path / "ref", prep.directory)), eos_id)
    assert masked[0]["loss"] == pytest.approx(want, rel=1e-5)
    assert abs(unmasked[0]["loss"] - want) > 1e-4 * want  # the packed rows' documents do see each other without it
