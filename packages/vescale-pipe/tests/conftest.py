"""Shared fixtures: each model is captured once per session and split several ways (capture is the slow part)."""

from __future__ import annotations

import pytest
import torch

MB, T, VOCAB = 2, 8, 64  # microbatch size, sequence length, vocabulary


@pytest.fixture(scope="session")
def gpt_capture():
    """(tied 4-layer GPT, its torch.export capture on one microbatch of shape [MB, T])."""
    from vescale.core.testing.models import GPT, GPTConfig
    from vescale.pipe import capture

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=VOCAB, d_model=32, n_layer=4, n_head=4, n_kv_head=2, max_seq_len=16,
                          tie_embeddings=True))
    return model, capture(model, (torch.randint(0, VOCAB, (MB, T)),))


@pytest.fixture(scope="session")
def gpt_pipeline(gpt_capture):
    """(tied GPT, {num_stages: stages}) for 2, 4 (automatic boundaries) and 8 stages (mid-block boundaries)."""
    from vescale.pipe import split

    model, ep = gpt_capture
    x = torch.randint(0, VOCAB, (MB, T))
    mid_block = ["layers.0.mlp"] + [p for i in range(1, 4) for p in (f"layers.{i}", f"layers.{i}.mlp")]
    stages = {n: split(model, num_stages=n, example_inputs=(x,), exported=ep) for n in (2, 4)}
    stages[8] = split(model, split_points=mid_block, example_inputs=(x,), exported=ep)
    return model, stages


@pytest.fixture(scope="session")
def llama_pipeline():
    """(tiny HF LlamaForCausalLM with tied embeddings, its 2 stages), split on ``input_ids`` + ``attention_mask``."""
    transformers = pytest.importorskip("transformers")
    from vescale.pipe import split

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                   use_cache=False, tie_word_embeddings=True)
    model = transformers.LlamaForCausalLM(cfg)
    ids = torch.randint(0, VOCAB, (MB, T))
    mask = torch.ones(MB, T, dtype=torch.long)
    return model, split(model, num_stages=2, example_inputs={"input_ids": ids, "attention_mask": mask})
