"""``tools/train.py --model DIR --mesh ep=2`` on a Mixtral directory written by ``transformers``' ``save_pretrained``.

The installed ``transformers`` keeps each experts module's weights stacked (``mlp.experts.gate_up_proj [E, 2I, D]``,
``down_proj [E, D, I]``) but ``save_pretrained`` writes Mixtral's original layout, one tensor per expert
(``block_sparse_moe.experts.E.w1/w3/w2.weight``), by its own conversion rules; ``tools/models.py`` reads that layout
by the same rules (``stored_names``), each ep rank reading only its experts' tensors. The reference is
``from_pretrained`` on one device (no vescale): the first step's loss of the ep=2 run equals its loss on the same
batch (fp32, the batch split over two ranks: rtol 1e-5).
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


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory) -> Path:
    """A tiny Mixtral saved by ``save_pretrained`` in several safetensors shards (so with an index). Initialised
    with std 0.5, not 0.02, so that its loss depends on every weight (at 0.02 it is near log(vocab) whatever the
    experts hold: swapping each expert's gate and up halves moves it by 1e-5; at 0.5 by 1.6%)."""
    import transformers as tf

    path = tmp_path_factory.mktemp("hf") / "tiny-mixtral"
    torch.manual_seed(0)
    config = tf.MixtralConfig(vocab_size=128, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                              num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False,
                              initializer_range=0.5)
    tf.MixtralForCausalLM(config).save_pretrained(path, max_shard_size="20KB")
    assert (path / "model.safetensors.index.json").is_file()
    return path


def _cfg(mesh: str, model: Path, out: Path) -> train.TrainConfig:
    cfg = train.TrainConfig(mesh=mesh, model=str(model), steps=1, batch_size=4, seq_len=16, lr=1e-2, warmup=1,
                            out=str(out), trace_steps=0, quiet=True, data="markov")
    cfg.dims = parse_mesh_spec(mesh)
    return cfg


def _train_recording_reads(cfg: train.TrainConfig) -> tuple[dict, list[str]]:
    """On a rank: ``train.train(cfg)``, recording the names of the safetensors tensors whose data this rank read
    (a slice indexed or a whole tensor; reading a header's shape is not reading data)."""
    import safetensors

    opened: list[str] = []
    real = safetensors.safe_open

    class Slice:
        def __init__(self, name, part):
            self.name, self.part = name, part

        def __getitem__(self, index):
            opened.append(self.name)
            return self.part[index]

        def __getattr__(self, attr):
            return getattr(self.part, attr)

    class Recording:
        def __init__(self, *args, **kwargs):
            self.handle = real(*args, **kwargs)

        def __enter__(self):
            self.handle.__enter__()
            return self

        def __exit__(self, *exc):
            return self.handle.__exit__(*exc)

        def get_slice(self, name):
            return Slice(name, self.handle.get_slice(name))

        def get_tensor(self, name):
            opened.append(name)
            return self.handle.get_tensor(name)

        def __getattr__(self, attr):
            return getattr(self.handle, attr)

    safetensors.safe_open = Recording
    try:
        return train.train(cfg), opened
    finally:
        safetensors.safe_open = real


def test_ep2_from_a_mixtral_directory_first_loss_equals_from_pretrained(mixtral_dir, tmp_path):
    import transformers as tf
    from data import open_data

    assert any(".block_sparse_moe.experts.3.w1.weight" in k for k in models.hf_weight_names(str(mixtral_dir)))
    assert models.pretrained_problems(str(mixtral_dir)) == []
    cfg = _cfg("ep=2", mixtral_dir, tmp_path / "run")
    (summary, rank0_reads), (_, rank1_reads) = run_on_ranks(_train_recording_reads, 2, cfg)

    # each ep rank read only its own experts' tensors (rank 0: experts 0-1, rank 1: experts 2-3)
    def experts(reads: list[str]) -> set[int]:
        return {int(k.split(".experts.")[1].split(".")[0]) for k in reads if ".experts." in k}

    assert experts(rank0_reads) == {0, 1} and experts(rank1_reads) == {2, 3}, (rank0_reads, rank1_reads)

    reference = tf.AutoModelForCausalLM.from_pretrained(mixtral_dir, attn_implementation="eager").eval()
    tokens = open_data(cfg, models.model_spec(cfg.model).vocab_size).batch(0, cfg.batch_size, cfg.seq_len, 0)
    with torch.no_grad():
        logits = reference(input_ids=tokens[:, :-1]).logits
    want = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    assert summary["first_loss"] == pytest.approx(float(want), rel=1e-5), (summary["first_loss"], float(want))
