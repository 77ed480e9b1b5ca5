"""``tools/generate.py`` on a multi-query model (one key/value head) at tp=2: the kv head is replicated over the two
ranks (``auto_plan`` replicates ``k_proj``/``v_proj``; ``parallelize_module`` itself keeps one head per rank in the
cache), and the tokens equal ``from_pretrained``'s ``generate`` on one device, greedy through a static cache; the
same through ``vescale.plan.auto_parallelize``. Also: head counts that neither divide over tp nor replicate over it are
refused before any rank starts, naming both. And ``--compile`` (a torch.compile'd decode step over a static cache)
gives the eager one-device tokens.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from vescale.core.testing import run_on_ranks

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))  # tools/generate.py imports report.py by name
import generate  # noqa: E402

PROMPTS = ["5,6,7", "1,9,10,11,12"]


def _save(path: Path, kv: int) -> Path:
    import torch
    import transformers as tf

    torch.manual_seed(0)
    heads = 6 if kv == 3 else 4
    tf.LlamaForCausalLM(tf.LlamaConfig(
        vocab_size=64, hidden_size=8 * heads, intermediate_size=64, num_hidden_layers=2, num_attention_heads=heads,
        num_key_value_heads=kv, max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
        eos_token_id=2)).save_pretrained(path)
    return path


def test_mqa_on_tp2_generates_like_from_pretrained(tmp_path):
    import transformers as tf

    path = _save(tmp_path / "mqa", kv=1)
    args = ["--model", str(path), "--mesh", "tp=2", "--max-new-tokens", "6", "--static-cache", "--quiet"]
    cfg = generate.parse_args(args + [a for p in PROMPTS for a in ("--token-ids", p)])
    generate.check(cfg)
    summary = run_on_ranks(generate.generate, 2, cfg)[0]
    model = tf.AutoModelForCausalLM.from_pretrained(path).eval()
    ids, mask = generate.encode(cfg, model.config, None)
    out = model.generate(input_ids=ids, attention_mask=mask, pad_token_id=0, max_new_tokens=6, do_sample=False,
                         cache_implementation="static", return_dict_in_generate=True)
    want = out.sequences[:, ids.shape[1]:].tolist()
    assert summary["tokens"] == want, (summary["tokens"], want)
    assert summary["plan"] == "auto" and summary["kv_heads_replicated"] is True
    assert summary["kv_replica_layers"] == 2  # parallelize_module set up both layers itself (no separate call)
    # each rank holds the one kv head its query heads read (one-device bytes / num_key_value_heads; with one kv head
    # that is the whole one-device cache; the head-per-rank layout itself is checked on tp=4 with 2 kv heads in
    # vescale-parallel's test_kv_replicas.py)
    one_device = generate.cache_bytes(out.past_key_values)
    assert one_device > 0
    assert summary["kv_cache_bytes_per_rank"] == [one_device] * 2, summary


def _auto_parallelized_generates_like_one_device():
    import copy

    import torch
    import transformers as tf
    from torch.distributed.tensor import DTensor

    from vescale.core.mesh import init_mesh
    from vescale.parallel.kv_replicas import kv_replicated_modules
    from vescale.plan import auto_parallelize

    torch.manual_seed(0)
    ref = tf.LlamaForCausalLM(tf.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, max_position_embeddings=64, pad_token_id=0)).eval()
    result = auto_parallelize(copy.deepcopy(ref), mesh=init_mesh({"tp": 2}), batch_size=2, seq_len=16)
    par = result.module
    assert kv_replicated_modules(par) == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    ids = torch.tensor([[0, 0, 5, 6, 7], [1, 9, 10, 11, 12]])
    kw = dict(attention_mask=(ids != 0).long(), max_new_tokens=5, pad_token_id=0, do_sample=False)
    with torch.no_grad():
        want = ref.generate(input_ids=ids, **kw)
        out = par.generate(input_ids=ids, return_dict_in_generate=True, **kw)
    keys = out.past_key_values.layers[0].keys
    # the one kv head, repeated over both ranks: global [2, tp, S, d] Shard(1), each rank's piece one head
    return (torch.equal(out.sequences, want), isinstance(keys, DTensor) and tuple(keys.shape[:2]),
            keys.to_local().shape[1] if isinstance(keys, DTensor) else None)


def test_auto_parallelize_keeps_one_kv_head_per_rank():
    """``vescale.plan.auto_parallelize`` (auto_plan replicates k/v of an MQA model; parallelize_module sets up the
    cache) on tp=2: greedy tokens equal one device's, each rank's cache one kv head, with no other call."""
    assert run_on_ranks(_auto_parallelized_generates_like_one_device, 2) == [(True, (2, 2), 1)] * 2


def test_kv_heads_that_neither_divide_nor_replicate_refused(tmp_path):
    path = _save(tmp_path / "gqa3", kv=3)
    with pytest.raises(SystemExit, match=r"num_key_value_heads=3 and tp=2"):
        generate.main(["--model", str(path), "--mesh", "tp=2", "--token-ids", "1,2,3"])


def test_compiled_decode_step_gives_eager_tokens(tmp_path):
    """``--compile``: HF's compiled forward (inductor, static cache) runs the decode steps of the tp=2 model and gives
    one device's eager tokens (about 100 s on a loaded 2-core machine, most of it inductor)."""
    import transformers as tf

    path = _save(tmp_path / "gqa", kv=2)
    args = ["--model", str(path), "--mesh", "tp=2", "--max-new-tokens", "3", "--compile", "--quiet"]
    cfg = generate.parse_args(args + [a for p in PROMPTS for a in ("--token-ids", p)])
    generate.check(cfg)
    summary = run_on_ranks(generate.generate, 2, cfg)[0]
    model = tf.AutoModelForCausalLM.from_pretrained(path).eval()
    ids, mask = generate.encode(cfg, model.config, None)
    want = model.generate(input_ids=ids, attention_mask=mask, pad_token_id=0, max_new_tokens=3, do_sample=False,
                          cache_implementation="static", disable_compile=True)[:, ids.shape[1]:].tolist()
    assert summary["tokens"] == want, (summary["tokens"], want)
    assert summary["static_cache"] and summary["compiled_decode"], summary
