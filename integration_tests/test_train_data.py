"""The main job on real text: ``tools/prepare_data.py`` packs documents with EOS into a cached token file and holds
out a seeded share of them; the global batch of a step is a function of (data, seed, step); a run on ``--data``
resumed on another mesh continues the uninterrupted single-device curve (training and held-out loss); samples are the
same tokens on every rank; the default corpus (the standard library with its own BPE) trains at a few steps.

Every expectation is computed here without the code under test: the packed streams from the tokenizer's own
``encode`` of each document, the curves from the same job on one rank.
"""

from __future__ import annotations

import json
import math
import os
import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from vescale.core.mesh import parse_mesh_spec

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import data as data_mod  # noqa: E402
import prepare_data  # noqa: E402
import train  # noqa: E402

EOS = "<|endoftext|>"
WORDS = ("the cat dog sat on a mat and ran far away from home to see big red sun moon star tree river over under "
         "while code data model loss step rank mesh shard").split()


def _docs(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    docs = []
    for _ in range(n):
        lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12))) for _ in range(rng.randint(3, 12))]
        docs.append("\n".join(lines) + "\n")
    return docs


def _make_tokenizer(path: Path, texts: list[str], vocab: int = 100) -> Path:
    """A small byte-level BPE (at most ``vocab`` ids, fits gpt-tiny's 128) saved as a Hugging Face tokenizer dir."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab, special_tokens=[EOS], show_progress=False))
    path.mkdir(parents=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS}))
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict:
    """30 text documents in a directory, their tokenizer, and a private cache root."""
    root = tmp_path_factory.mktemp("corpus")
    docs = _docs(30, seed=7)
    text_dir = root / "text"
    (text_dir / "sub").mkdir(parents=True)
    paths = []
    for i, doc in enumerate(docs):  # some in a subdirectory: the path order, not the creation order, decides
        p = text_dir / ("sub" if i % 3 == 0 else "") / f"doc{i:02d}.txt"
        p.write_text(doc)
        paths.append(p)
    (text_dir / ".hidden.txt").write_text("never read")
    order = sorted(paths)
    tok = _make_tokenizer(root / "tok", docs)
    return {"dir": text_dir, "docs": [docs[paths.index(p)] for p in order], "tok": tok, "cache": root / "cache"}


def _encode(tok_dir: Path, text: str) -> list[int]:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tok_dir / "tokenizer.json")).encode(text, add_special_tokens=False).ids


def _split_ids(directory: Path) -> tuple[np.ndarray, np.ndarray]:
    meta = json.loads((directory / "meta.json").read_text())
    dtype = data_mod.DTYPES[meta["dtype"]]
    return tuple(np.fromfile(directory / f"{s}.bin", dtype=dtype).astype(np.int64) for s in ("train", "heldout"))


def test_prepare_packs_documents_with_eos_holds_out_a_seeded_share_and_caches(corpus):
    prep = prepare_data.prepare(str(corpus["dir"]), corpus["tok"], heldout=0.1, cache=corpus["cache"])
    assert prep.built
    eos = _encode(corpus["tok"], EOS)
    assert eos == [prep.meta["eos_id"]]
    train_ids, held_ids = _split_ids(prep.directory)
    # The reference: each document's own encoding, EOS after it, in path order, split by the seeded draw.
    held = prepare_data.heldout_documents(30, 0.1, 0)
    assert len(held) == 3
    want = {"train": [], "heldout": []}
    for i, doc in enumerate(corpus["docs"]):
        want["heldout" if i in held else "train"] += _encode(corpus["tok"], doc) + eos
    assert train_ids.tolist() == want["train"]
    assert held_ids.tolist() == want["heldout"]
    assert prep.meta["train_docs"] == 27 and prep.meta["heldout_docs"] == 3 and prep.meta["files"] == 30
    # Another split seed holds out other documents; the held-out ones are never trained on.
    assert prepare_data.heldout_documents(30, 0.1, 1) != held
    # The second call finds the content-hashed directory: nothing rebuilt, no file rewritten.
    stamps = {p.name: p.stat().st_mtime_ns for p in prep.directory.iterdir()}
    again = prepare_data.prepare(str(corpus["dir"]), corpus["tok"], heldout=0.1, cache=corpus["cache"])
    assert not again.built and again.directory == prep.directory
    assert {p.name: p.stat().st_mtime_ns for p in prep.directory.iterdir()} == stamps
    # Changed content is another key.
    changed = corpus["dir"].parent / "changed"
    changed.mkdir()
    (changed / "a.txt").write_text(corpus["docs"][0])
    (changed / "b.txt").write_text(corpus["docs"][1] + "x")
    other = prepare_data.prepare(str(changed), corpus["tok"], heldout=0.1, cache=corpus["cache"])
    assert other.built and other.directory != prep.directory


def test_jsonl_field_and_token_bin_inputs(corpus, tmp_path):
    docs = corpus["docs"][:8]
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"body": d, "n": i}) + "\n" for i, d in enumerate(docs)))
    prep = prepare_data.prepare(str(jsonl), corpus["tok"], field="body", heldout=0.25, cache=tmp_path / "c")
    held = prepare_data.heldout_documents(8, 0.25, 0)
    eos = [prep.meta["eos_id"]]
    want_train = [t for i, d in enumerate(docs) if i not in held for t in _encode(corpus["tok"], d) + eos]
    assert _split_ids(prep.directory)[0].tolist() == want_train
    with pytest.raises(data_mod.DataError, match="no text field 'text'"):
        prepare_data.prepare(str(jsonl), corpus["tok"], cache=tmp_path / "c")
    # An already tokenized stream: its documents are the runs between EOS ids, split the same way.
    stream = np.asarray([t for d in docs for t in _encode(corpus["tok"], d) + eos], dtype=np.uint16)
    stream.tofile(tmp_path / "ids.bin")
    (tmp_path / "ids.json").write_text(json.dumps({"eos_id": eos[0], "vocab_size": 100}))
    binary = prepare_data.prepare(str(tmp_path / "ids.bin"), None, heldout=0.25, cache=tmp_path / "c")
    assert _split_ids(binary.directory)[0].tolist() == want_train
    assert binary.meta["train_docs"] == 6 and binary.meta["heldout_docs"] == 2


def test_global_batch_is_a_function_of_data_seed_and_step(corpus):
    prep = prepare_data.prepare(str(corpus["dir"]), corpus["tok"], heldout=0.1, cache=corpus["cache"])
    train_ids = _split_ids(prep.directory)[0]
    a, b = data_mod.TokenData(prep.directory, 16, seed=3), data_mod.TokenData(prep.directory, 16, seed=3)
    n = a.num_sequences
    assert n == (len(train_ids) - 1) // 16
    # Read in another order by another instance: the same batches.
    later = [b.batch(s, 8, 16) for s in (5, 0, 2)]
    for s, got in zip((5, 0, 2), later):
        assert a.batch(s, 8, 16).equal(got)
    # Each row is one window of the packed stream (inputs and shifted targets, stride seq_len); one epoch visits
    # every window once.
    seen = []
    for s in range(math.ceil(n / 8)):
        for row in a.batch(s, 8, 16)[: n - 8 * s].tolist():
            start = next(i for i in range(0, len(train_ids) - 16, 16) if train_ids[i:i + 17].tolist() == row)
            seen.append(start // 16)
    assert sorted(seen) == list(range(n))
    # Another seed: another order. Offsets: the sequences of a step count from step x batch size, so a run resumed
    # with half the batch size sees the same stream.
    assert not data_mod.TokenData(prep.directory, 16, seed=4).batch(0, 8, 16).equal(a.batch(0, 8, 16))
    assert a.batch(3, 8, 16).equal(torch.cat([a.batch(6, 4, 16), a.batch(7, 4, 16)]))
    assert a.batch(1, 4, 16, offset=8).equal(a.batch(3, 4, 16))


def _cfg(mesh: str, out: Path, data: Path, **kw) -> train.TrainConfig:
    cfg = train.TrainConfig(mesh=mesh, model="gpt-tiny", data=str(data), steps=6, batch_size=8, seq_len=16, lr=3e-3,
                            warmup=2, out=str(out), trace_steps=0, quiet=True, eval_every=3, **kw)
    cfg.dims = parse_mesh_spec(mesh)
    return cfg


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("ws_a,mesh_a,ws_b,mesh_b", [(2, "dp=2", 2, "tp=2")], ids=["dp2-to-tp2"])
def test_resume_on_another_mesh_continues_the_curve_on_real_text(ws_a, mesh_a, ws_b, mesh_b, corpus, tmp_path,
                                                                 ranks):
    prep = prepare_data.prepare(str(corpus["dir"]), corpus["tok"], heldout=0.1, cache=corpus["cache"])
    ref = _records(_run(ranks, 1, _cfg("dp=1", tmp_path / "ref", prep.directory)))
    first = _run(ranks, ws_a, _cfg(mesh_a, tmp_path / "a", prep.directory, ckpt_every=3))
    resumed = _run(ranks, ws_b, _cfg(mesh_b, tmp_path / "b", prep.directory,
                                     resume=str(first / "ckpt" / "step_3")))
    got = _records(first)[:3] + _records(resumed)
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5, 6]
    # fp32, the parallel runs reduce in another order than one device (see test_train_matrix): rtol 1e-4.
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in ref], rel=1e-4)
    evals = [(r["step"], r["eval_loss"]) for r in got if "eval_loss" in r]
    want = [(r["step"], r["eval_loss"]) for r in ref if "eval_loss" in r]
    assert [s for s, _ in evals] == [s for s, _ in want] == [3, 6]
    assert [e for _, e in evals] == pytest.approx([e for _, e in want], rel=1e-4)
    assert all(r["eval_ppl"] == pytest.approx(math.exp(r["eval_loss"])) for r in got if "eval_loss" in r)
    # The loss falls on this text: the last held-out loss is below the first step's training loss.
    assert want[-1][1] < ref[0]["loss"]


def _run(ranks, world: int, cfg) -> Path:
    ranks(train.train, world, cfg)
    return Path(cfg.out)


def _generate_on_mesh(cfg, prompt: list[int]) -> list[list[int]]:
    import sample

    trainer = train.build_trainer(cfg)
    return sample.generate(trainer.state["model"], prompt, 12, window=16, samples=2, seed=5, pad_id=0)


def test_samples_are_the_same_tokens_on_every_rank(corpus, tmp_path, ranks):
    prep = prepare_data.prepare(str(corpus["dir"]), corpus["tok"], heldout=0.1, cache=corpus["cache"])
    prompt = data_mod.TokenData(prep.directory, 16, seed=0).prompt(6)
    (one,) = ranks(_generate_on_mesh, 1, _cfg("dp=1", tmp_path, prep.directory), prompt)
    got = ranks(_generate_on_mesh, 2, _cfg("tp=2", tmp_path, prep.directory), prompt)
    assert got[0] == got[1], "tp ranks chose different tokens"
    assert len(one) == 3 and all(len(r) == 12 for r in one)
    assert got[0][0] == one[0], "greedy continuation differs from one device"


def _train_in_cache(cache: str, cfg) -> dict:
    """``train.train`` with the data cache at ``cache`` (pooled ranks keep their environment between tests)."""
    before = os.environ.get("VESCALE_CACHE")
    os.environ["VESCALE_CACHE"] = cache
    try:
        return train.train(cfg)
    finally:
        if before is None:
            os.environ.pop("VESCALE_CACHE")
        else:
            os.environ["VESCALE_CACHE"] = before


@pytest.fixture(scope="module")
def stdlib_cache(stdlib_corpus_cache):
    """A cache holding the default corpus, prepared (tokenizer trained) once for the session (conftest's)."""
    return stdlib_corpus_cache


def test_default_run_trains_gpt_11m_on_the_standard_library(stdlib_cache, tmp_path, ranks):
    cfg = train.parse_args(["--steps", "2", "--batch-size", "4", "--seq-len", "32", "--eval-every", "2",
                            "--trace-steps", "0", "--out", str(tmp_path)], "test")
    assert cfg.data == "stdlib" and cfg.model == "gpt-11m" and cfg.mesh == "dp=2"
    again = prepare_data.prepare("stdlib", cache=stdlib_cache)
    assert not again.built and again.meta["vocab_size"] == prepare_data.STDLIB_VOCAB
    assert again.meta["heldout_docs"] >= 1 and again.meta["train_tokens"] > 500_000
    summary, _ = ranks(_train_in_cache, 2, str(stdlib_cache), cfg)
    assert summary["data"] == "stdlib" and summary["data_fingerprint"] == again.meta["fingerprint"]
    records = _records(tmp_path)
    # A fresh model predicts about uniformly over the 512 ids: the first loss is near ln 512.
    assert abs(records[0]["loss"] - math.log(prepare_data.STDLIB_VOCAB)) < 0.3, records[0]
    assert math.isfinite(summary["final_eval_loss"]) and "eval_loss" in records[-1]
    assert (tmp_path / "loss.png").is_file()


def test_refusals_before_any_rank_starts(stdlib_cache, monkeypatch, tmp_path):
    monkeypatch.setenv("VESCALE_CACHE", str(stdlib_cache))
    with pytest.raises(SystemExit, match="its tokenizer has 512 ids but model gpt-tiny embeds 128"):
        train.main(["--model", "gpt-tiny", "--steps", "1", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="--eval-every needs a mesh without pp"):
        train.main(["--mesh", "pp=2", "--eval-every", "5", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="--sample-every needs real text"):
        train.main(["--data", "markov", "--sample-every", "5", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="less than one batch of --batch-size 512"):
        train.main(["--batch-size", "512", "--eval-every", "5", "--out", str(tmp_path)])
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "a.txt").write_text("some text")
    with pytest.raises(SystemExit, match="text needs a tokenizer"):
        train.main(["--data", str(tmp_path / "text"), "--out", str(tmp_path / "o")])


def test_a_checkpoint_from_other_data_starts_the_new_data_at_its_beginning(corpus):
    prep = prepare_data.prepare(str(corpus["dir"]), corpus["tok"], heldout=0.1, cache=corpus["cache"])
    d = data_mod.TokenData(prep.directory, 16, seed=0)
    assert data_mod.resume_offset({"step": 3, "sequences": 24, "data": d.fingerprint}, d, 8) == (0, None)
    offset, note = data_mod.resume_offset({"step": 3, "sequences": 24, "data": d.fingerprint}, d, 4)
    assert offset == 12 and "continuing after them" in note
    offset, note = data_mod.resume_offset({"step": 3, "sequences": 24, "data": "elsewhere"}, d, 8)
    assert offset == -24 and "other data" in note
    assert d.batch(3, 8, 16, offset).equal(d.batch(0, 8, 16))


def test_degenerate_greedy_sample_prints_as_one_note():
    """A greedy continuation that collapsed into newlines prints one line naming it, not dozens of empty lines; a
    healthy continuation prints whole; a tail of whitespace after real text is cut and counted."""
    import sample

    vocab = {0: "\n", 1: " ", 2: "cat", 3: " sat", 4: "the"}

    def decode(ids):
        return "".join(vocab[t] for t in ids)

    prompt = [4, 2]
    lines = sample.format_continuation(decode, prompt, [0] * 30, "greedy")
    assert lines == ["greedy: continuation degenerates into repeated newlines (30 tokens)", "    | thecat"]
    assert sample.degenerate_tail([2, 3] + [0, 1] * 5, decode) == (10, "repeated whitespace")
    lines = sample.format_continuation(decode, prompt, [3, 3, 2] + [0, 1] * 5, "sampled (1)")
    assert lines == ["sampled (1):", "    | thecat sat satcat",
                     "    ... then degenerates into repeated whitespace (10 tokens, not shown)"]
    assert sample.degenerate_tail([3, 2, 2, 2, 2, 2], decode) == (5, "repeated 'cat'")
    ok = [3, 0, 4, 2, 0, 0]  # two trailing newlines are text, not degeneration
    assert sample.degenerate_tail(ok, decode) == (0, "")
    shown = sample.format_continuation(decode, prompt, ok, "greedy")
    assert shown == ["greedy:", "    | thecat sat\n    | thecat\n    | "]
    text = "\n".join(sample.format_continuation(decode, prompt, [0] * 30, "greedy"))
    assert text.count("\n") == 1
