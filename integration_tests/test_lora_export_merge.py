"""The merged LoRA export (``tools/lora.py``'s merge, what ``--export-hf`` writes) equals peft's own
``merge_and_unload`` for LoraConfigs whose layers hold different scalings (``rank_pattern`` / ``alpha_pattern``,
``use_rslora``, ``lora_bias``), and refuses by name what it cannot merge exactly (DoRA, LoRA on an embedding), also
before any rank starts (``lora_problems``).

One process, no process group: the merge of an unsharded model issues no collective. The reference is peft's
``merge_and_unload`` of a deep copy of the same model, built without the code under test.
"""

from __future__ import annotations

import copy
import sys
import types
from pathlib import Path

import pytest
import torch

pytest.importorskip("peft")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import lora  # noqa: E402

LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _llama_config(bias: bool = False):
    import transformers as tf

    return tf.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                          attention_bias=bias, mlp_bias=bias)


def _peft_model(bias: bool = False, **config):
    """A tiny Llama wrapped by peft with ``LoraConfig(**config)``, every adapter tensor random and nonzero."""
    import transformers as tf
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = get_peft_model(tf.LlamaForCausalLM(_llama_config(bias)), LoraConfig(**config))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:  # (peft starts lora_B at zero: the merge would add nothing)
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model


CASES = {
    # q_proj: 8 / 2, down_proj: 3 / 4, the rest 8 / 4
    "patterns": dict(r=4, lora_alpha=8, target_modules=LINEARS, rank_pattern={"q_proj": 2},
                     alpha_pattern={"down_proj": 3}),
    "rslora": dict(r=4, lora_alpha=8, target_modules=LINEARS, use_rslora=True),  # 8 / sqrt(4)
    "lora_bias": dict(r=4, lora_alpha=6, target_modules=["q_proj", "down_proj"], lora_bias=True),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_merged_export_equals_merge_and_unload(case):
    config = CASES[case]
    model = _peft_model(bias=case == "lora_bias", **config)
    from peft.tuners.lora import LoraLayer

    scalings = {layer.scaling["default"] for layer in model.modules() if isinstance(layer, LoraLayer)}
    assert len(scalings) == (1 if case != "patterns" else 3), scalings
    assert scalings != {config["lora_alpha"] / config["r"]} or case == "lora_bias"  # not the single CLI scaling

    want = copy.deepcopy(model).merge_and_unload().state_dict()
    got = lora._merged([model])
    assert sorted(got) == sorted(want)
    base = {n.removeprefix("base_model.model.").replace(".base_layer.", "."): t
            for n, t in model.state_dict().items() if ".lora_" not in n}
    changed = [n for n in want if not torch.equal(want[n], base[n])]
    # every adapted weight (with lora_bias, its bias too) of both layers moved: the comparison covers the merge
    assert len(changed) == len(config["target_modules"]) * 2 * (2 if case == "lora_bias" else 1), changed
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-6, atol=1e-7, msg=name)


def _stages(model: torch.nn.Module) -> list[torch.nn.Module]:
    """``model``'s parameters split in two module trees under their FQNs, no LoRA layer objects: what a pipeline
    rank's captured stages (``vescale.pipe.GraphStage``) hold."""
    stages = [torch.nn.Module(), torch.nn.Module()]
    for name, p in model.named_parameters():
        owner = stages[0 if "layers.0." in name or "embed_tokens" in name else 1]
        *path, leaf = name.split(".")
        for part in path:
            if not hasattr(owner, part):
                owner.add_module(part, torch.nn.Module())
            owner = getattr(owner, part)
        owner.register_parameter(leaf, p)
    return stages


def test_stages_merge_by_the_scalings_of_the_model_rebuilt_on_meta():
    """Pipeline stages: the scalings come from the same PEFT model built on meta (what ``export`` passes)."""
    import transformers as tf
    from peft import LoraConfig, get_peft_model

    config = CASES["patterns"]
    model = _peft_model(**config)
    with torch.device("meta"):
        layers_of = get_peft_model(tf.LlamaForCausalLM(_llama_config()), LoraConfig(**config))
    want = copy.deepcopy(model).merge_and_unload().state_dict()
    got = {n: t for stage in _stages(model) for n, t in lora._merged([stage], layers_of).items()}
    assert sorted(got) == sorted(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-6, atol=1e-7, msg=name)
    with pytest.raises(ValueError, match=r"adapter tensors \['base_model\.model\.model\.layers\.0\.self_attn\.q_proj"):
        lora._merged(_stages(model)[:1])  # no layers to read the scalings from: refused, not merged with none


@pytest.mark.parametrize("config, named", [
    (dict(r=4, lora_alpha=8, target_modules=["v_proj"], use_dora=True), "use_dora"),
    (dict(r=4, lora_alpha=8, target_modules=["embed_tokens", "q_proj"]), "Embedding"),
], ids=["dora", "embedding"])
def test_merge_refuses_by_name(config, named):
    model = _peft_model(**config)
    with pytest.raises(ValueError, match=rf"'base_model\.model\.model\.(layers\.0\.self_attn\.v_proj|embed_tokens)'"
                                         rf".*{named}"):
        lora._merged([model])


def test_lora_problems_refuses_unmergeable_export(tmp_path):
    _llama_config().save_pretrained(tmp_path)  # config.json only: lora_problems builds the model on meta
    cfg = types.SimpleNamespace(model=str(tmp_path), dims={}, export_hf=str(tmp_path / "out"),
                                lora={"r": 4, "alpha": 8.0, "dropout": 0.0, "targets": ["embed_tokens", "q_proj"]})
    problems = lora.lora_problems(cfg)
    assert len(problems) == 1 and "embed_tokens" in problems[0] and "--export-hf" in problems[0], problems
    cfg.lora["targets"] = ["q_proj"]
    assert lora.lora_problems(cfg) == []
    cfg.export_hf, cfg.lora["targets"] = None, ["embed_tokens"]  # training alone: the merge is not asked
    assert lora.lora_problems(cfg) == []
