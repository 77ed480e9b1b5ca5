"""``tools/train.py --model DIR --lora ...`` end to end on dp=2 x tp=2: the checkpoint holds only the adapters, the
export's adapter directory is what ``PeftModel.from_pretrained`` loads and its merged model what ``from_pretrained``
loads, both computing the trained model's logits; a target that matches no module is refused before any rank starts.

The reference is built here without the code under test: ``peft``'s own ``get_peft_model`` on the directory's
``from_pretrained`` model, its adapters filled from the run's checkpoint (saved on dp2 x tp2, loaded on one
process: the adapters reshard like any other state).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from vescale.core.mesh import parse_mesh_spec
from vescale.core.testing import run_on_ranks

pytest.importorskip("peft")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import train  # noqa: E402

TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
STEPS = 3


def _model_dir(path: Path) -> Path:
    import transformers as tf

    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    tf.LlamaForCausalLM(config).save_pretrained(path)
    return path


def _base(model_dir: Path):
    import transformers as tf

    return tf.AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager").eval()


def test_lora_train_checkpoint_export(tmp_path):
    import transformers as tf
    from peft import LoraConfig, PeftModel, get_peft_model

    from vescale import checkpoint

    model_dir = _model_dir(tmp_path / "tiny-llama")
    cfg = train.TrainConfig(mesh="dp=2,tp=2", model=str(model_dir), steps=STEPS, batch_size=4, seq_len=16, lr=2e-2,
                            warmup=1, out=str(tmp_path / "run"), trace_steps=0, quiet=True, data="markov",
                            ckpt_every=STEPS, export_hf=str(tmp_path / "export"),
                            lora={"r": 4, "alpha": 8.0, "dropout": 0.0, "targets": TARGETS.split(",")})
    cfg.dims = parse_mesh_spec(cfg.mesh)
    summary = run_on_ranks(train.train, 4, cfg)[0]
    assert summary["final_loss"] < summary["first_loss"], summary

    # the checkpoint: adapters only (2 per targeted linear), with their optimizer state
    ckpt = tmp_path / "run" / "ckpt" / f"step_{STEPS}"
    names = [k for k in json.loads((ckpt / "metadata.json").read_text())["tensors"] if k.startswith("model.")]
    assert len(names) == 2 * 7 * 2 and all(".lora_" in k for k in names), names[:4]

    # one device's PEFT model, its adapters from that checkpoint (saved on dp2 x tp2)
    trained = get_peft_model(_base(model_dir), LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS.split(",")))
    adapters = {n: p for n, p in trained.named_parameters() if p.requires_grad}
    before = {n: p.detach().clone() for n, p in adapters.items()}
    result = checkpoint.load(ckpt, {"model": adapters}, strict=False)
    assert not result.missing and not result.mismatched
    assert any(not torch.equal(before[n], p) for n, p in adapters.items())  # trained: lora_B left zero
    trained.eval()
    tokens = torch.randint(0, 320, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = trained(input_ids=tokens).logits
        assert not torch.allclose(want, _base(model_dir)(tokens).logits)
        # the adapters in PEFT's format, on the original base model
        loaded = PeftModel.from_pretrained(_base(model_dir), tmp_path / "export" / "adapter").eval()
        torch.testing.assert_close(loaded(input_ids=tokens).logits, want, rtol=0, atol=1e-6)
        # the merged model
        merged = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "export", attn_implementation="eager").eval()
        torch.testing.assert_close(merged(tokens).logits, want, rtol=1e-5, atol=1e-5)


def test_lora_target_matching_nothing_refused(tmp_path):
    model_dir = _model_dir(tmp_path / "tiny-llama")
    with pytest.raises(SystemExit, match=r"--lora target 'qkv' matches no module"):
        train.main(["--model", str(model_dir), "--mesh", "tp=2", "--steps", "1", "--data", "markov",
                    "--lora", "r=4,alpha=8,targets=q_proj,qkv", "--out", str(tmp_path / "run")])
    with pytest.raises(SystemExit, match=r"--lora with cp=2 is not supported"):
        train.main(["--model", str(model_dir), "--mesh", "cp=2", "--steps", "1", "--data", "markov",
                    "--lora", "r=4,targets=q_proj", "--out", str(tmp_path / "run")])


def _lora_run(tmp_path: Path, model_dir: Path, mesh: str, world: int,
              targets: tuple = ("q_proj", "v_proj", "down_proj")) -> tuple[dict, dict]:
    """``train.train`` with ``--lora`` on ``mesh`` (``world`` ranks), exported: its summary and its PEFT adapters."""
    from safetensors.torch import load_file

    out = tmp_path / mesh.replace(",", "_").replace("=", "")
    cfg = train.TrainConfig(mesh=mesh, model=str(model_dir), steps=2, batch_size=4, seq_len=16, lr=2e-2, warmup=1,
                            out=str(out / "run"), trace_steps=0, quiet=True, data="markov",
                            export_hf=str(out / "export"),
                            lora={"r": 4, "alpha": 8.0, "dropout": 0.0, "targets": list(targets)})
    cfg.dims = parse_mesh_spec(cfg.mesh)
    summary = run_on_ranks(train.train, world, cfg)[0]
    return summary, load_file(str(out / "export" / "adapter" / "adapter_model.safetensors"))


def test_lora_pipeline_equals_one_rank(tmp_path):
    """``--mesh pp=2 --lora``: the base weights load into each stage, the export gathers both stages' adapters, and
    after two steps they equal one rank's run (same data and seed); the PEFT export loads with ``from_pretrained`` and
    computes what the merged export (both stages' base weights, merged) computes."""
    import transformers as tf
    from peft import PeftModel

    model_dir = _model_dir(tmp_path / "tiny-llama")
    one, want = _lora_run(tmp_path, model_dir, "dp=1", 1)
    two, got = _lora_run(tmp_path, model_dir, "pp=2", 2)
    assert sorted(got) == sorted(want) and len(got) == 2 * 3 * 2, sorted(got)[:4]
    assert any(n.endswith("lora_B.weight") and t.abs().max() > 0 for n, t in got.items())  # trained
    for name, t in want.items():
        torch.testing.assert_close(got[name], t, rtol=1e-4, atol=1e-6, msg=name)
    assert two["first_loss"] == pytest.approx(one["first_loss"], rel=1e-5)
    loaded = PeftModel.from_pretrained(_base(model_dir), tmp_path / "pp2" / "export" / "adapter").eval()
    state = loaded.state_dict()
    for name, t in got.items():  # PEFT's loaded names keep the adapter name
        torch.testing.assert_close(state[name.replace(".weight", ".default.weight")], t, rtol=0, atol=0)
    tokens = torch.randint(0, 320, (2, 12), generator=torch.Generator().manual_seed(3))
    merged = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "pp2" / "export", attn_implementation="eager").eval()
    with torch.no_grad():
        want_logits = loaded(input_ids=tokens).logits
        assert not torch.allclose(want_logits, _base(model_dir)(tokens).logits)
        torch.testing.assert_close(merged(tokens).logits, want_logits, rtol=1e-5, atol=1e-5)


def test_lora_mixtral_ep2_equals_one_rank(tmp_path):
    """``--mesh ep=2 --lora`` on a Mixtral directory (experts saved one tensor per expert): each ep rank loads its
    experts, and after two steps the exported adapters equal one rank's run (same data and seed)."""
    import transformers as tf

    torch.manual_seed(0)
    config = tf.MixtralConfig(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                              num_local_experts=4, num_experts_per_tok=2)
    model_dir = tmp_path / "tiny-mixtral"
    tf.MixtralForCausalLM(config).save_pretrained(model_dir)
    one, want = _lora_run(tmp_path, model_dir, "dp=1", 1, targets=("q_proj", "o_proj"))
    two, got = _lora_run(tmp_path, model_dir, "ep=2", 2, targets=("q_proj", "o_proj"))
    assert sorted(got) == sorted(want) and len(got) == 2 * 2 * 2, sorted(got)[:4]
    assert any(n.endswith("lora_B.weight") and t.abs().max() > 0 for n, t in got.items())  # trained
    for name, t in want.items():
        torch.testing.assert_close(got[name], t, rtol=1e-4, atol=1e-6, msg=name)
    assert two["first_loss"] == pytest.approx(one["first_loss"], rel=1e-5)
