"""``tools/train.py --model DIR``: a Hugging Face model directory (``save_pretrained``: config.json, sharded
safetensors with their index, a tokenizer) trained on any mesh, and ``--export-hf`` / ``python -m vescale.checkpoint
export-hf`` writing what ``from_pretrained`` reads back.

The reference is ``transformers``' own ``from_pretrained`` on one device, which shares no code with the loader under
test (``models.load_pretrained`` over ``vescale.checkpoint.import_hf``): the state every mesh loads is compared to it
bitwise, and so are the one-device logits. The tiny Llama (GQA, 2 layers, untied head) and its byte-level BPE
tokenizer are built here: nothing can be downloaded.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vescale.core.mesh import parse_mesh_spec
from vescale.core.testing import run_on_ranks

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))  # tools/train.py imports config, models, data and report by name
import models  # noqa: E402
import train  # noqa: E402

TEXT = ("the quick brown fox jumps over the lazy dog. a stitch in time saves nine. "
        "all that glitters is not gold. where there is a will there is a way. ") * 8


def make_tokenizer(path: Path, vocab_size: int = 300) -> None:
    """A byte-level BPE tokenizer trained on ``TEXT`` (the ``tokenizers`` package), saved as transformers saves one."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers, trainers
    from tokenizers import models as tok_models
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(tok_models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([TEXT], trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(path)


def make_model_dir(path: Path, tied: bool = False) -> Path:
    """A tiny Llama saved by ``save_pretrained`` in several safetensors shards (so with an index), and a tokenizer.
    ``tied``: the output head is the input embedding (the file then holds only the embedding)."""
    import transformers as tf

    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                            tie_word_embeddings=tied, eos_token_id=0, bos_token_id=0)
    tf.LlamaForCausalLM(config).save_pretrained(path, max_shard_size="20KB")
    make_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = make_model_dir(tmp_path_factory.mktemp("hf") / "tiny-llama")
    assert (path / "model.safetensors.index.json").is_file()  # sharded: the index path is exercised
    return path


def _cfg(mesh: str, model: Path, out: Path, **kw) -> train.TrainConfig:
    cfg = train.TrainConfig(mesh=mesh, model=str(model), steps=3, batch_size=4, seq_len=16, lr=1e-2, warmup=1,
                            out=str(out), trace_steps=0, quiet=True, microbatches=2, data="markov", **kw)
    cfg.dims = parse_mesh_spec(mesh)
    return cfg


def _reference(model_dir: Path):
    import transformers as tf

    return tf.AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager").eval()


def _loaded_state(cfg: train.TrainConfig) -> dict[str, torch.Tensor]:
    """On a rank: build the trainer of ``cfg`` (which loads the directory) and return the whole tensors of what this
    rank holds, by FQN. DTensors are gathered over their tp group (every rank of a group walks the same FQNs)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor


    trainer = train.build_trainer(cfg)
    held = trainer.state["model"]
    out = {}
    for module in held if isinstance(held, list) else [held]:
        for name, t in sorted(module.state_dict().items()):
            out[name] = (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu().clone()
    dist.barrier()
    return out


def _logits_one_device(cfg: train.TrainConfig, tokens: torch.Tensor) -> torch.Tensor:
    trainer = train.build_trainer(cfg)
    with torch.no_grad():
        return trainer.state["model"](tokens).logits


@pytest.mark.parametrize("world_size, mesh, tied, zero", [
    (2, "tp=2", False, 0), (2, "pp=2", False, 0), (4, "dp=2,tp=2", False, 0), (4, "pp=2,tp=2", True, 0),
    (4, "dp=2,tp=2", False, 3)])
def test_load_equals_from_pretrained(model_dir, tmp_path, world_size, mesh, tied, zero):
    if tied:  # the last stage's head is filled from the embedding's tensor (models.load_pretrained, tied=)
        model_dir = make_model_dir(tmp_path / "tied", tied=True)
    ref = {k: v for k, v in _reference(model_dir).state_dict().items()}
    per_rank = run_on_ranks(_loaded_state, world_size, _cfg(mesh, model_dir, tmp_path, zero=zero))
    seen: dict[str, torch.Tensor] = {}
    for state in per_rank:
        for name, t in state.items():
            if name in seen:  # replicas (dp, or tp-replicated norms) hold the same values
                assert torch.equal(seen[name], t), name
            seen[name] = t
    assert set(seen) == set(ref), set(seen) ^ set(ref)
    for name, t in ref.items():
        assert torch.equal(seen[name], t), name  # bitwise: a copy of the stored bytes, on every mesh
    if mesh.startswith("pp"):  # each stage read only its own layers
        assert all(set(s) != set(ref) for s in per_rank)


def test_logits_equal_from_pretrained_on_one_device(model_dir, tmp_path):
    tokens = torch.randint(0, 320, (2, 12), generator=torch.Generator().manual_seed(1))
    got = run_on_ranks(_logits_one_device, 1, _cfg("dp=1", model_dir, tmp_path), tokens)[0]
    with torch.no_grad():
        want = _reference(model_dir)(tokens).logits
    assert torch.equal(got, want)


def test_bad_directory_refused_before_ranks_start(model_dir, tmp_path):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(model_dir, broken)
    config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    with pytest.raises(SystemExit, match=r"'model.layers.0.mlp.gate_proj.weight' is \[64, 32\] in its safetensors, "
                                         r"\[96, 32\] in the model"):
        train.main(["--model", str(broken), "--mesh", "tp=2", "--steps", "1", "--out", str(tmp_path / "run")])
    with pytest.raises(SystemExit, match="--export-hf needs a Hugging Face model"):
        train.main(["--model", "gpt-tiny", "--steps", "1", "--export-hf", str(tmp_path / "x"),
                    "--out", str(tmp_path / "run")])


def _whole(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def test_fine_tune_exports_what_from_pretrained_reads(model_dir, tmp_path):
    """dp=2 x tp=2 fine-tune, first-step gradients against the one-rank run, export read back with the trained
    state's logits, and the CLI's export of the final checkpoint equal to train.py's."""
    import transformers as tf

    from vescale import checkpoint

    steps = 3
    ref_cfg = _cfg("dp=1", model_dir, tmp_path / "ref", grad_dump=str(tmp_path / "ref" / "grads.safetensors"))
    run_on_ranks(train.train, 1, ref_cfg)
    cfg = _cfg("dp=2,tp=2", model_dir, tmp_path / "run", ckpt_every=steps, export_hf=str(tmp_path / "export"),
               grad_dump=str(tmp_path / "run" / "grads.safetensors"))
    summary = run_on_ranks(train.train, 4, cfg)[0]
    # the first step's gradients on the mesh are one device's (fp32 reassociation: 1e-5 of the largest element)
    want, got = _whole(tmp_path / "ref" / "grads.safetensors"), _whole(tmp_path / "run" / "grads.safetensors")
    assert set(want) == set(got)
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, rtol=0, atol=1e-5 * float(g.abs().max()), msg=name)
    assert summary["final_loss"] < summary["first_loss"], summary

    # the trained state: the final checkpoint of the mesh run, loaded into one device's model
    trained = tf.AutoModelForCausalLM.from_config(models.hf_config(str(model_dir)), attn_implementation="eager")
    result = checkpoint.load(tmp_path / "run" / "ckpt" / f"step_{steps}", {"model": trained}, strict=False)
    assert not result.missing and not result.mismatched
    exported = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "export", attn_implementation="eager").eval()
    initial = _reference(model_dir)
    for name, t in trained.state_dict().items():
        assert torch.equal(exported.state_dict()[name], t), name
    assert not torch.equal(exported.model.layers[0].mlp.up_proj.weight, initial.model.layers[0].mlp.up_proj.weight)
    tokens = torch.randint(0, 320, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(exported(tokens).logits, trained.eval()(tokens).logits)
    # the tokenizer came along and encodes as the original does
    original = tf.AutoTokenizer.from_pretrained(model_dir)
    assert tf.AutoTokenizer.from_pretrained(tmp_path / "export")("a stitch in time").input_ids == \
        original("a stitch in time").input_ids

    # the CLI on the same checkpoint, config and tokenizer from the model directory
    cli = subprocess.run([sys.executable, "-m", "vescale.checkpoint", "export-hf",
                          str(tmp_path / "run" / "ckpt" / f"step_{steps}"), str(tmp_path / "cli"),
                          "--config", str(model_dir)], capture_output=True, text=True, timeout=300)
    assert cli.returncode == 0, cli.stderr[-3000:]
    from_cli = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "cli", attn_implementation="eager")
    for name, t in exported.state_dict().items():
        assert torch.equal(from_cli.state_dict()[name], t), name
    assert (tmp_path / "cli" / "tokenizer.json").is_file()

    # throughput figures: 6 N + 12 L d T per token, N the matmul parameters (all but the input embedding)
    n = sum(p.numel() for p in initial.parameters()) - initial.model.embed_tokens.weight.numel()
    assert summary["model_flops_per_token"] == 6 * n + 12 * 2 * 32 * 16
    assert summary["model_tflops"] == pytest.approx(summary["model_flops_per_token"] * summary["tokens_per_s"] / 1e12,
                                                    rel=1e-3)
    assert summary["mfu"] is None and len(summary["peak_memory_mb_per_rank"]) == 4


def test_cli_export_refuses_a_config_directory_without_config(tmp_path, capsys):
    """The CLI's main in-process (its ``python -m`` entry runs in a fresh interpreter above): a usage error, exit 2."""
    from vescale.checkpoint.__main__ import main as checkpoint_cli

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(SystemExit) as refused:
        checkpoint_cli(["export-hf", str(tmp_path / "ckpt"), str(tmp_path / "out"), "--config", str(empty)])
    stderr = capsys.readouterr().err
    assert refused.value.code == 2 and "a directory without config.json" in stderr, stderr


@pytest.mark.parametrize("schedule, last, middle", [
    ("cosine", 1e-3, 1e-3 + (1e-2 - 1e-3) * 0.5), ("linear", 1e-3, 1e-3 + (1e-2 - 1e-3) * 0.5),
    ("constant", 1e-2, 1e-2)])
def test_lr_schedules(schedule, last, middle):
    cfg = train.TrainConfig(lr=1e-2, warmup=4, steps=24, lr_schedule=schedule, min_lr=1e-3)
    lrs = [train.lr_at(s, cfg) for s in range(cfg.steps + 1)]
    assert lrs[:4] == pytest.approx([2.5e-3, 5e-3, 7.5e-3, 1e-2])  # linear warm-up
    assert lrs[4] == pytest.approx(1e-2) and lrs[14] == pytest.approx(middle) and lrs[24] == pytest.approx(last)
    assert all(a >= b for a, b in zip(lrs[4:], lrs[5:]))  # never rises after the warm-up
    if schedule == "cosine":  # a quarter of the way: (1 + cos(pi / 4)) / 2 of the range left
        assert lrs[9] == pytest.approx(1e-3 + 9e-3 * (1 + math.cos(math.pi / 4)) / 2)


def test_weight_decay_only_on_matrices(model_dir):
    """One AdamW step from train.py's groups equals a step in which only the matrices were decayed by hand."""
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(model_dir)
    params = list(model.parameters())
    groups = train.decay_groups(params, 0.1)
    assert {id(p) for p in groups[0]["params"]} == {id(p) for p in params if p.ndim == 2}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in params:
        p.grad = torch.zeros_like(p)  # no gradient: the step is the decay alone, w - lr * wd * w
    torch.optim.AdamW(groups, lr=0.5).step()
    for name, p in model.named_parameters():
        factor = 1 - 0.5 * 0.1 if "norm" not in name else 1.0
        assert torch.equal(p.detach(), before[name] * factor), name
