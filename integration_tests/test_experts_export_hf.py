"""An expert-parallel run exported to Hugging Face layout: ``tools/train.py --mesh dp=1,ep=2 --export-hf`` and
``python -m vescale.checkpoint export-hf`` (its ``main``, in-process) on its checkpoint write what ``from_pretrained``
loads, and it gives the logits of the same training on one device.

The model is train.py's built-in ``mixtral`` (an unmodified Hugging Face Mixtral, small config), trained for two steps
by train.py on ``dp=1,ep=2`` (experts ``Shard(0)`` over ep, the DDP path: dense gradients reduced over dp x ep) and,
as the reference, on one rank (no expert parallelism). The reference's export is read by ``from_pretrained`` too,
which shares no code with the EP path. Compared: the EP export against the EP run's own checkpoint loaded into a
one-device model (bitwise), the CLI export of that checkpoint against train.py's (bitwise), and the EP export's
logits against the one-device run's (fp32, the runs reduce in another order: 1e-5 of the largest logit).
"""

from __future__ import annotations

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

STEPS = 2


@pytest.fixture(scope="module")
def mixtral_config_dir(tmp_path_factory) -> Path:
    """A directory holding the built-in ``mixtral`` model's config.json (what the CLI's ``--config`` takes)."""
    path = tmp_path_factory.mktemp("hf") / "mixtral-config"
    models.hf_config("mixtral").save_pretrained(path)
    return path


def _cfg(mesh: str, out: Path, **kw) -> train.TrainConfig:
    cfg = train.TrainConfig(mesh=mesh, model="mixtral", steps=STEPS, batch_size=8, seq_len=16, lr=3e-3, warmup=1,
                            out=str(out), trace_steps=0, quiet=True, data="markov", **kw)
    cfg.dims = parse_mesh_spec(mesh)
    return cfg


def _load(path: Path):
    import transformers as tf

    return tf.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()


def test_ep_run_exports_what_from_pretrained_reads_with_one_device_logits(mixtral_config_dir, tmp_path):
    import transformers as tf

    from vescale import checkpoint

    run_on_ranks(train.train, 1, _cfg("dp=1", tmp_path / "ref", export_hf=str(tmp_path / "ref-export")))
    summary = run_on_ranks(train.train, 2, _cfg("dp=1,ep=2", tmp_path / "run", ckpt_every=STEPS,
                                                export_hf=str(tmp_path / "export")))[0]
    assert summary["export_hf"] == str(tmp_path / "export")

    exported, reference = _load(tmp_path / "export"), _load(tmp_path / "ref-export")
    # the export holds the EP run's trained state: its checkpoint loaded into one device's model, bitwise
    trained = tf.AutoModelForCausalLM.from_config(models.hf_config("mixtral"), attn_implementation="eager")
    result = checkpoint.load(tmp_path / "run" / "ckpt" / f"step_{STEPS}", {"model": trained}, strict=False)
    assert not result.missing and not result.mismatched
    for name, t in trained.state_dict().items():
        assert torch.equal(exported.state_dict()[name], t), name
    assert exported.model.layers[0].mlp.experts.gate_up_proj.shape[0] == 4  # every expert, from both ep ranks

    tokens = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got, want = exported(tokens).logits, reference(tokens).logits
    err = float((got - want).abs().max() / want.abs().max())
    assert err < 1e-5, err

    # the CLI on the EP checkpoint, with the model's config.json: the same tensors as train.py's export. Called
    # in-process (its main): test_train_hf_dir.py runs the same command as `python -m` in a fresh interpreter
    from vescale.checkpoint.__main__ import main as checkpoint_cli

    assert checkpoint_cli(["export-hf", str(tmp_path / "run" / "ckpt" / f"step_{STEPS}"), str(tmp_path / "cli"),
                           "--config", str(mixtral_config_dir)]) == 0
    from_cli = _load(tmp_path / "cli")
    for name, t in exported.state_dict().items():
        assert torch.equal(from_cli.state_dict()[name], t), name
