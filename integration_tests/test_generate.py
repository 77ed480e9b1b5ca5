"""``tools/generate.py``: a ``save_pretrained`` directory loaded straight into the sharded model
(``vescale.checkpoint.import_hf``, each rank reading its shards) generates what ``from_pretrained`` generates on one
device.

End to end as a user runs it (``python tools/generate.py``, 2 spawned CPU ranks, tp=2, greedy: the streamed text and
the JSON summary), its rank function on pooled ranks (GPT-2 with tied embeddings, seeded sampling through a static
cache, tp=2 and dp=2 x tp=2, each rank holding half of one device's cache), and its refusals of bad input before any
rank starts.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from vescale.core.testing import run_on_ranks

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))  # tools/generate.py imports report.py by name
import generate  # noqa: E402

PROMPTS = ["5,6,7", "1,9,10,11,12"]


def _save(kind: str, path: Path) -> Path:
    import torch
    import transformers as tf

    torch.manual_seed(0)
    if kind == "llama":  # GQA: 4 heads, 2 key/value heads
        model = tf.LlamaForCausalLM(tf.LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2))
    else:  # lm_head tied to wte: save_pretrained writes only wte
        model = tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                                 bos_token_id=1, eos_token_id=2, initializer_range=0.5))
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    """The tiny Llama's ``save_pretrained`` directory, written once for the module (the tests only read it)."""
    return _save("llama", tmp_path_factory.mktemp("llama") / "llama")


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory) -> Path:
    """The tiny GPT-2's ``save_pretrained`` directory, written once for the module (the tests only read it)."""
    return _save("gpt2", tmp_path_factory.mktemp("gpt2") / "gpt2")


def _reference(path: Path, prompts: list[str], **kw) -> list[list[int]]:
    """One device: ``from_pretrained`` and ``generate`` on the same left-padded batch, new tokens only."""
    import torch
    import transformers as tf

    cfg = generate.parse_args(["--model", str(path), *[a for p in prompts for a in ("--token-ids", p)]])
    model = tf.AutoModelForCausalLM.from_pretrained(path).eval()
    ids, mask = generate.encode(cfg, model.config, None)
    torch.manual_seed(kw.pop("seed", 0))
    out = model.generate(input_ids=ids, attention_mask=mask, pad_token_id=generate.pad_id(model.config), **kw)
    return out[:, ids.shape[1]:].tolist()


def test_cli_end_to_end_matches_from_pretrained(llama_dir):
    path = llama_dir
    run = subprocess.run([sys.executable, str(ROOT / "tools" / "generate.py"), "--model", str(path), "--mesh",
                          "tp=2", "--max-new-tokens", "8", *[a for p in PROMPTS for a in ("--token-ids", p)]],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.strip().splitlines()
    summary = json.loads(lines[-1])
    want = _reference(path, PROMPTS, max_new_tokens=8, do_sample=False)
    # rank 0 (only) streamed its first prompt's tokens, then printed the other completion: each once
    assert lines[:-1] == [f"[{i}] {row}" for i, row in enumerate(want)], run.stdout
    # transformers' cache-rename deprecation (vescale's boundary, not the user's call) is not printed by any rank
    assert generate.CACHE_RENAME_WARNING not in run.stderr, run.stderr[-3000:]
    assert summary["mesh"] == {"tp": 2} and summary["prefill_s"] > 0 and summary["decode_tokens_per_s"] > 0
    # each rank holds its own key/value head (2 kv heads / tp=2) of 2 layers x (keys + values), 2 rows, 4 + 8
    # positions (the last token is not fed back), head dim 8, fp32
    assert summary["kv_cache_bytes_per_rank"] == [2 * 2 * 2 * 1 * 12 * 8 * 4] * 2, summary
    assert len(summary["peak_memory_mb_per_rank"]) == 2


@pytest.mark.parametrize("world_size", [2, 4])
def test_sharded_load_samples_like_from_pretrained(gpt2_dir, world_size):
    path = gpt2_dir
    mesh = "tp=2" if world_size == 2 else "dp=2,tp=2"
    prompts = PROMPTS * (world_size // 2)
    args = ["--model", str(path), "--mesh", mesh, "--max-new-tokens", "6", "--do-sample", "--seed", "5",
            "--top-k", "10", "--top-p", "0.9", "--temperature", "0.7", "--static-cache", "--quiet"]
    cfg = generate.parse_args(args + [a for p in prompts for a in ("--token-ids", p)])
    generate.check(cfg)
    summary = run_on_ranks(generate.generate, world_size, cfg)[0]
    kw = dict(max_new_tokens=6, do_sample=True, seed=5, top_k=10, top_p=0.9, temperature=0.7,
              cache_implementation="static")
    # a sampled batch is one random stream: each dp group's draws are one device's for that group's prompts
    want = [row for g in range(world_size // 2) for row in _reference(path, prompts[2 * g:2 * g + 2], **dict(kw))]
    assert summary["tokens"] == want, (summary["tokens"], want)
    # GPT-2's cache sharded by heads (its fused c_attn output splits into head-sharded q, k, v): every rank holds
    # half of one device's static cache for its group's two rows
    import transformers as tf

    one = tf.AutoModelForCausalLM.from_pretrained(path).eval()
    ids, mask = generate.encode(cfg, one.config, None)
    out = one.generate(input_ids=ids[:2], attention_mask=mask[:2], pad_token_id=generate.pad_id(one.config),
                       max_new_tokens=6, cache_implementation="static", return_dict_in_generate=True)
    one_device = generate.cache_bytes(out.past_key_values)
    assert one_device > 0 and summary["kv_cache_bytes_per_rank"] == [one_device // 2] * world_size, summary


@pytest.mark.parametrize("bad, message", [
    (["--model", "/no/such/dir"], "no such directory"),
    (["--mesh", "tp=8"], "not divisible by tp=8"),
    (["--mesh", "dp=2,tp=2"], "do not split into dp=2"),
    (["--prompt", "hello"], "has no tokenizer"),
    (["--token-ids", "1,x"], "not comma-separated integers"),
])
def test_bad_input_refused_before_ranks_start(llama_dir, bad, message):
    path = llama_dir
    args = ["--model", str(path), "--token-ids", "1,2,3"]
    if bad[0] == "--model":
        args = bad + ["--token-ids", "1,2,3"]
    elif bad[0] in ("--prompt", "--token-ids"):
        args = ["--model", str(path), *bad]
    else:
        args += bad
    with pytest.raises(SystemExit, match=message):
        generate.main(args)
