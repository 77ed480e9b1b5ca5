"""HF interop: a checkpoint exported with ``export_hf`` loads with ``transformers`` ``from_pretrained`` and gives
bitwise-equal logits; ``import_hf`` fills a model (plain, or tensor parallel on 2 ranks) bitwise."""

from __future__ import annotations

import json
import os

import pytest
import torch

from vescale import checkpoint
from vescale.checkpoint.__main__ import main as cli
from vescale.core.testing import run_on_ranks

transformers = pytest.importorskip("transformers")


def _config():
    return transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


def _llama(seed: int):
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(_config()).eval()


def _import_tp(src: str) -> bool:
    import torch.distributed as dist
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from vescale.core.mesh import init_mesh

    ref = _llama(0).state_dict()
    model = _llama(1)
    mesh = init_mesh({"tp": dist.get_world_size()})["tp"]
    parallelize_module(model, mesh, {r"model.layers.\d+.mlp.(gate|up)_proj": ColwiseParallel(),
                                     r"model.layers.\d+.mlp.down_proj": RowwiseParallel()})
    checkpoint.import_hf(src, model)
    for k, v in model.state_dict().items():
        full = v.full_tensor() if hasattr(v, "full_tensor") else v
        assert torch.equal(full, ref[k]), k
    return True


def test_export_loads_with_from_pretrained_and_imports_back(tmp_path):
    model = _llama(0)
    path, out = str(tmp_path / "ckpt"), str(tmp_path / "hf")
    checkpoint.save(path, {"model": model, "step": 3})
    files = checkpoint.export_hf(path, out, prefix="model.", config=model.config, max_shard_bytes=40_000)
    assert len(files) > 2 and files[-1] == "model.safetensors.index.json"
    with open(os.path.join(out, files[-1])) as f:
        index = json.load(f)
    assert set(index["weight_map"]) == set(model.state_dict())
    loaded = transformers.LlamaForCausalLM.from_pretrained(out).eval()
    tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded(tokens).logits, model(tokens).logits)  # bitwise: same weights, same code

    fresh = _llama(1)
    checkpoint.import_hf(out, fresh)
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, model.state_dict()[k]), k
    assert run_on_ranks(_import_tp, 2, out) == [True, True]

    # the command line does the same; inspect reports the keys
    assert cli(["export-hf", path, str(tmp_path / "hf2"), "--config", os.path.join(out, "config.json")]) == 0
    again = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "hf2")).eval()
    with torch.no_grad():
        assert torch.equal(again(tokens).logits, model(tokens).logits)
    assert cli(["inspect", path]) == 0
    assert checkpoint.inspect(path)["values"] == ["step"]
