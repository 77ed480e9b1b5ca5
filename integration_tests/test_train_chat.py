"""Fine-tuning data for the main job: chat files (``--chat``: the tokenizer's chat template, assistant tokens
trained, one conversation per padded row) and mixed sources (``--data a:0.7,b:0.3``), with their refusals.

Expectations are computed here without the code under test: a conversation's ids from the tokenizer's own
``encode`` of each piece between special tokens (the template's role markers are special tokens, which split the
text, so the whole encodes as its pieces), the first step's loss from one device's ``F.cross_entropy(...,
ignore_index=-100)`` of the global batch on the unparallelized initial model.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from vescale.core.mesh import parse_mesh_spec

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import chat_data  # noqa: E402
import data as data_mod  # noqa: E402
import prepare_data  # noqa: E402
import train  # noqa: E402

EOS, END = "<|endoftext|>", "<|end|>"
ROLES = ("system", "user", "assistant")
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
WORDS = "the cat dog sat on a mat and ran far away from home to see big red sun moon star tree river".split()


def _sentence(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 9)))


def _conversations(n: int, seed: int) -> list[list[dict]]:
    """Conversations of 1-3 exchanges, some with a system turn, one without an assistant turn."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        turns = [{"role": "system", "content": _sentence(rng)}] if i % 3 == 0 else []
        for _ in range(rng.randint(1, 3)):
            turns += [{"role": "user", "content": _sentence(rng)}, {"role": "assistant", "content": _sentence(rng)}]
        out.append(turns if i != 5 else turns[:1])
    return out


def _tokenizer(path: Path, template: str | None = TEMPLATE) -> Path:
    """A byte-level BPE of at most 100 ids (fits gpt-tiny's 128) with the role markers as special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = [EOS, END] + [f"<|{r}|>" for r in ROLES]
    tok.train_from_iterator([" ".join(WORDS)] * 20, trainers.BpeTrainer(vocab_size=100, special_tokens=specials,
                                                                        show_progress=False))
    path.mkdir(parents=True)
    tok.save(str(path / "tokenizer.json"))
    config = {"eos_token": EOS, "pad_token": EOS, "tokenizer_class": "PreTrainedTokenizerFast"}
    if template is not None:
        config["chat_template"] = template
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def _write_jsonl(path: Path, convs: list[list[dict]], field: str = "messages") -> Path:
    path.write_text("".join(json.dumps({field: c, "id": i}) + "\n" for i, c in enumerate(convs)))
    return path


@pytest.fixture(scope="module")
def chat(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("chat")
    convs = _conversations(40, seed=3)
    return {"convs": convs, "tok": _tokenizer(root / "tok"), "file": _write_jsonl(root / "chat.jsonl", convs),
            "cache": root / "cache", "root": root}


def _reference(tok_dir: Path, conv: list[dict]) -> tuple[list[int], list[bool]]:
    """A conversation's ids and which are trained, from each piece's own encoding."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    ids, trained = [], []
    for m in conv:
        content = tok.encode(m["content"], add_special_tokens=False).ids
        ids += [tok.token_to_id(f"<|{m['role']}|>")] + content + [tok.token_to_id(END)]
        trained += [False] + [m["role"] == "assistant"] * (len(content) + 1)
    return ids, trained


def test_chat_rows_train_only_the_assistant_tokens(chat):
    directory = chat_data.prepare_chat(chat["file"], chat["tok"], heldout=0.1, cache=chat["cache"])
    assert chat_data.prepare_chat(chat["file"], chat["tok"], heldout=0.1, cache=chat["cache"]) == directory
    data = chat_data.ChatData(directory, 48, seed=0)
    held = prepare_data.heldout_documents(40, 0.1, 0)
    kept = [c for i, c in enumerate(chat["convs"]) if i not in held]
    assert data.num_sequences == len(kept) == 36
    for index, conv in enumerate(kept):
        ids, trained = _reference(chat["tok"], conv)
        row = data.row("train", index)
        n = min(len(ids), 49)
        assert row[0, :n].tolist() == ids[:n], index
        assert row[1, :n].tolist() == [t if m else -100 for t, m in zip(ids[:n], trained[:n])], index
        assert (row[0, n:] == data.pad_id).all() and (row[1, n:] == -100).all()  # padding is never trained
    assert (data.row("train", kept.index(chat["convs"][5]))[1] == -100).all()  # no assistant turn: nothing trained
    # The global batch of a step is the run's conversations in a seeded order, and inputs / targets shift by one.
    rows = data.batch(1, 4, 48)
    order = data.order(0)
    assert rows.tolist() == [data.row("train", int(order[k])).tolist() for k in range(4, 8)]
    inputs, targets, trained_count = data_mod.step_rows(rows)
    assert torch.equal(inputs, rows[:, 0, :-1]) and torch.equal(targets, rows[:, 1, 1:])
    assert trained_count == int((rows[:, 1, 1:] != -100).sum()) > 0
    # The sample prompt: the first held-out conversation's turns before the assistant's, then the assistant marker.
    first = chat["convs"][min(held)]
    cut = next(i for i, m in enumerate(first) if m["role"] == "assistant")
    want = _reference(chat["tok"], first[:cut])[0] + [_reference(chat["tok"], [first[cut]])[0][0]]
    assert data.prompt(64) == want


def test_chat_refusals_are_named_before_any_rank_starts(chat, tmp_path, monkeypatch):
    monkeypatch.setenv("VESCALE_CACHE", str(tmp_path / "cache"))

    def main(data: str, tok: Path, *extra: str) -> str:
        argv = ["--model", "gpt-tiny", "--data", data, "--chat", "--tokenizer", str(tok), "--out",
                str(tmp_path / "out"), "--seq-len", "32", "--steps", "1", *extra]
        with pytest.raises(SystemExit) as exc:
            train.main(argv)
        return str(exc.value)

    wrong_field = _write_jsonl(tmp_path / "wrong.jsonl", chat["convs"][:3], field="conversation")
    assert "wrong.jsonl:1: no chat field 'messages'" in main(str(wrong_field), chat["tok"])
    assert "no chat template" in main(str(chat["file"]), _tokenizer(tmp_path / "plain", template=None))
    (tmp_path / "empty.jsonl").write_text("\n")
    assert "holds no conversation" in main(str(tmp_path / "empty.jsonl"), chat["tok"])
    assert "no such file" in main(str(tmp_path / "missing.jsonl"), chat["tok"])


def test_mixed_sources_draw_by_weight_and_resume_each_source_exactly(chat, tmp_path):
    second = _write_jsonl(tmp_path / "second.jsonl", _conversations(20, seed=9))
    cfg = train.TrainConfig(model="gpt-tiny", data=f"{chat['file']}:0.75,{second}:0.25", chat=True,
                            tokenizer=str(chat["tok"]), seq_len=32, heldout=0.1)
    import os

    os.environ["VESCALE_CACHE"] = str(chat["cache"])
    try:
        mixed = data_mod.open_data(cfg, 128)
        again = data_mod.open_data(cfg, 128)
    finally:
        os.environ.pop("VESCALE_CACHE")
    assert isinstance(mixed, data_mod.MixedData) and mixed.fingerprint == again.fingerprint
    small = data_mod.MixedData(mixed.sources, [0.75, 0.25], seed=0)
    small.BLOCK = 5  # the same rules across many blocks of draws
    for mix, other in ((mixed, again), (small, None)):
        # Row k is source s's next row: replay the draws and check every row against that source's own stream.
        seen = [0, 0]
        for step in range(6):
            batch = mix.batch(step, 8, 32)
            for r in range(8):
                s, j = mix.position(step * 8 + r)
                assert j == seen[s]
                seen[s] += 1
                assert batch[r].tolist() == mix.sources[s].run_row(j).tolist()
                assert mix.positions(step * 8 + r + 1) == seen
            if other is not None:
                assert torch.equal(batch, other.batch(step, 8, 32))  # deterministic from the seed
    counts = np.bincount([mixed.position(k)[0] for k in range(4000)], minlength=2)
    assert abs(counts[0] / 4000 - 0.75) < 0.03
    # A run resumed with another batch size (offset from the checkpoint's progress) continues every source.
    offset, note = data_mod.resume_offset({"step": 3, "sequences": 24, "data": mixed.fingerprint}, mixed, 4)
    assert offset == 12
    a, b = mixed.positions(24)
    assert a + b == 24 and note.endswith(f"mixed sources continue: {mixed.sources[0].fingerprint} after row {a}, "
                                         f"{mixed.sources[1].fingerprint} after row {b}")
    assert torch.equal(mixed.batch(3, 4, 32, offset), mixed.batch(3, 8, 32)[:4])
    assert torch.equal(mixed.batch(4, 4, 32, offset), mixed.batch(3, 8, 32)[4:])


@pytest.mark.parametrize("data,why", [("a.jsonl:0,b.jsonl:0", "weights sum to 0.0"),
                                      ("{chat}:1,missing/:1", "source missing/: no such file or directory"),
                                      ("{chat}:1,{empty}:1", "holds no conversation"),
                                      ("{chat}:-1,{chat}:2", "finite weight >= 0")])
def test_mixed_refusals(chat, tmp_path, data, why):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    cfg = train.TrainConfig(model="gpt-tiny", data=data.format(chat=chat["file"], empty=empty), chat=True,
                            tokenizer=str(chat["tok"]), seq_len=32)
    with pytest.raises(data_mod.DataError, match=why):
        data_mod.open_data(cfg, 128)


def _first_loss_on_one_device(cfg, rows: torch.Tensor) -> float:
    """The initial model (the run's seed, materialised whole, no parallelism) on the global batch of step 0."""
    import torch.nn.functional as F

    from vescale.dtensor import materialize

    model = train.build_model(cfg, torch.device("cpu"))
    materialize(model, device="cpu")
    with torch.no_grad():
        logits = model(rows[:, 0, :-1])
    return float(F.cross_entropy(logits.flatten(0, 1), rows[:, 1, 1:].flatten(), ignore_index=-100))


def test_chat_fine_tune_dp2_tp2_grad_accum_first_loss_is_one_devices_token_mean(chat, tmp_path, ranks):
    cfg = train.TrainConfig(mesh="dp=2,tp=2", model="gpt-tiny", data=str(chat["file"]), chat=True,
                            tokenizer=str(chat["tok"]), steps=2, batch_size=8, seq_len=48, grad_accum=2, lr=3e-3,
                            warmup=1, out=str(tmp_path / "run"), trace_steps=0, quiet=True, eval_every=2,
                            heldout=0.25)
    cfg.dims = parse_mesh_spec(cfg.mesh)
    import os

    os.environ["VESCALE_CACHE"] = str(chat["cache"])
    try:
        corpus = data_mod.open_data(cfg, 128)
        summary = ranks(_in_cache, 4, str(chat["cache"]), cfg)[0]
    finally:
        os.environ.pop("VESCALE_CACHE")
    rows = corpus.batch(0, 8, 48)
    # rows with very different trained counts: a per-rank or per-micro-step mean would not give this loss
    assert len({int((r[1] != -100).sum()) for r in rows}) > 3
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["loss"] == pytest.approx(_first_loss_on_one_device(cfg, rows), rel=1e-5)
    assert np.isfinite(summary["final_eval_loss"]) and "eval_loss" in records[-1]


def _in_cache(cache: str, cfg) -> dict:
    import os

    os.environ["VESCALE_CACHE"] = cache
    try:
        return train.train(cfg)
    finally:
        os.environ.pop("VESCALE_CACHE", None)


def test_generate_chat_formats_prompts_with_the_template(chat, tmp_path):
    """``tools/generate.py --chat``: each prompt a user turn, the assistant turn opened; refused without a template."""
    import shutil

    import generate
    import transformers as tf

    model_dir = tmp_path / "model"
    tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                       num_attention_heads=4, num_key_value_heads=2)).save_pretrained(model_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(chat["tok"] / name, model_dir / name)
    prompts = ["the cat sat", "a big red sun over the river"]
    cfg = generate.parse_args(["--model", str(model_dir), "--chat", *[a for p in prompts for a in ("--prompt", p)]])
    ids, mask = generate.encode(cfg, tf.AutoConfig.from_pretrained(model_dir),
                                tf.AutoTokenizer.from_pretrained(model_dir))
    for row, keep, prompt in zip(ids.tolist(), mask.tolist(), prompts):
        want = _reference(chat["tok"], [{"role": "user", "content": prompt}])[0] + \
            _reference(chat["tok"], [{"role": "assistant", "content": ""}])[0][:1]
        assert [t for t, k in zip(row, keep) if k] == want and keep[-len(want):] == [1] * len(want)
    plain = _tokenizer(tmp_path / "plain", template=None)
    shutil.copy(plain / "tokenizer_config.json", model_dir / "tokenizer_config.json")
    with pytest.raises(SystemExit, match="has no chat template"):
        generate.main(["--model", str(model_dir), "--mesh", "tp=1", "--chat", "--prompt", "hello"])
