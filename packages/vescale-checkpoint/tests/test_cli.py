"""``python -m vescale.checkpoint``'s output: ``inspect`` a line per tensor (``--json`` the full dict), ``verify``
counting its problems in words, ``export-hf`` listing every file it wrote."""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch import nn

from vescale import checkpoint
from vescale.checkpoint.__main__ import main as cli
from vescale.checkpoint._reader import read_metadata
from vescale.checkpoint._storage import Storage


def _save(path: str) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4), nn.Linear(4, 2, bias=False))
    checkpoint.save(path, {"model": model, "step": 7})
    return model


def test_inspect_prints_one_line_per_tensor_and_json_on_request(tmp_path, capsys):
    path = str(tmp_path / "ckpt")
    _save(path)
    assert cli(["inspect", path]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 + 3 + 1, lines  # header, model.0.weight/.bias, model.1.weight, totals
    assert lines[0].startswith("vescale") and "world size 1" in lines[0], lines[0]
    weight = next(line for line in lines if line.startswith("model.0.weight"))
    assert weight.split()[1:] == ["float32", "[4,", "8]", "1", "shard", "128", "B"], weight
    assert lines[-1] == "total: 3 tensors, 3 shards, 176 B of tensor data; 1 value (step)", lines[-1]
    assert cli(["inspect", path, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info == json.loads(json.dumps(checkpoint.inspect(path)))
    assert info["tensors"]["model.1.weight"] == {"dtype": "float32", "shape": [2, 4], "shards": 1, "bytes": 32,
                                                  "codecs": ["raw"]}


def _flip(path: str, key: str) -> None:
    shard = read_metadata(Storage(path))["tensors"][key]["shards"][0]
    with open(os.path.join(path, shard["file"]), "r+b") as f:
        f.seek(shard["start"])
        byte = f.read(1)
        f.seek(shard["start"])
        f.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.parametrize("keys, words", [(["model.1.weight"], "1 problem)"),
                                         (["model.1.weight", "model.0.bias"], "2 problems)")])
def test_verify_counts_problems_in_words(tmp_path, capsys, keys, words):
    path = str(tmp_path / "ckpt")
    _save(path)
    for key in keys:
        _flip(path, key)
    assert cli(["verify", path]) == 1
    err = capsys.readouterr().err
    assert f"failed verification ({words}" in err, err


def test_export_hf_lists_every_file_it_wrote(tmp_path, capsys):
    path, out = str(tmp_path / "ckpt"), tmp_path / "hf"
    _save(path)
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "toy"}))
    assert cli(["export-hf", path, str(out), "--config", str(config)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert sorted(printed["files"]) == sorted(os.listdir(out)), printed
    assert "config.json" in printed["files"] and printed["files"][-1] == "model.safetensors.index.json"
