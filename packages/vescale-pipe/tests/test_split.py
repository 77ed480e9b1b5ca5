"""Graph-capture split of unmodified models: outputs bitwise equal to the model, FQNs kept, clear errors."""

from __future__ import annotations

import pytest
import torch

from vescale.core.testing.models import GPT, GPTConfig
from vescale.pipe import SplitError, split
from vescale.pipe.split import _balanced_cuts

MB, T, VOCAB = 2, 8, 64


def _chain(stages, *args, **kwargs):
    out = stages[0](*args, **kwargs)
    for stage in stages[1:]:
        out = stage(*out)
    return out


def test_split_gpt_tied_keeps_fqns_and_is_bitwise(gpt_pipeline):
    model, by_count = gpt_pipeline
    x = torch.randint(0, VOCAB, (MB, T))
    model_params = dict(model.named_parameters(remove_duplicate=False))
    for n, stages in by_count.items():
        assert len(stages) == n
        assert torch.equal(_chain(stages, x), model(x))  # bitwise: the same aten ops in the same order
        named = [(name, p) for s in stages for name, p in s.named_parameters()]
        assert {name for name, _ in named} == set(model_params)  # every parameter, under its own FQN
        assert all(p is model_params[name] for name, p in named)
        merged = {}
        for s in stages:
            merged.update(s.state_dict())
        assert set(merged) == set(model.state_dict())  # checkpoints do not depend on the pipeline degree
    stages = by_count[4]
    # automatic boundaries balance parameters: four equal blocks, a small embedding -> one block per stage
    assert [sorted({n.split(".")[1] for n, _ in s.named_parameters() if n.startswith("layers.")}) for s in stages] \
        == [["0"], ["1"], ["2"], ["3"]]
    # the tied weight is held by the first and the last stage, each naming it as its own modules do
    assert dict(stages[0].named_parameters())["embed.weight"] is model.embed.weight
    assert dict(stages[-1].named_parameters())["lm_head.weight"] is model.embed.weight
    assert stages[-1].canonical_names == {"lm_head.weight": "embed.weight"}
    # skip connections: the rotary tables made in stage 0 reach stage 3 through stages 1 and 2; a mid-block
    # boundary (layers.0.mlp) sends the residual stream and the normalised input of the MLP
    assert [n for n, _, _ in stages[3].input_meta][:2] == ["cos", "sin"]
    assert len(by_count[8][1].input_meta) == 4


def test_balanced_cuts():
    """The chosen boundaries minimise the largest stage: compare with brute force over all choices."""
    import itertools

    def largest(cuts, before, total):
        edges = [0] + [before[c] for c in cuts] + [total]
        return max(b - a for a, b in zip(edges, edges[1:]))

    before = [40, 53, 61, 75, 80, 97, 99, 120, 131]  # parameters before each block (a big embedding first)
    total = 150
    for n in range(2, 8):
        cuts = _balanced_cuts(before, total, n, len(before))
        assert cuts == sorted(set(cuts)) and len(cuts) == n - 1
        best = min(largest(c, before, total) for c in itertools.combinations(range(len(before)), n - 1))
        assert largest(cuts, before, total) == best
    with pytest.raises(SplitError, match="only 9 candidate boundaries"):
        _balanced_cuts(before, total, 11, len(before))


def test_split_errors_name_the_problem(gpt_capture, gpt_pipeline):
    model = GPT(GPTConfig(vocab_size=32, d_model=32, n_layer=2, n_head=4, max_seq_len=16))
    x = torch.randint(0, 32, (2, 16))
    with pytest.raises(SplitError, match=r"\['layers\.7'\] are not modules of GPT"):
        split(model, split_points=["layers.7"], example_inputs=(x,))
    with pytest.raises(SplitError, match="exactly one of"):
        split(model, example_inputs=(x,))
    with pytest.raises(SplitError, match="does not start after"):
        split(gpt_capture[0], split_points=["layers.1", "layers.0"], exported=gpt_capture[1])
    stages = gpt_pipeline[1][2]
    with pytest.raises(ValueError, match=r"stage 0 input 'tokens' has shape \(4, 8\); the split was traced"):
        stages[0](torch.randint(0, 32, (4, 8)))


def test_split_hf_llama_with_kwargs(llama_pipeline):
    model, stages = llama_pipeline
    ids = torch.randint(0, VOCAB, (MB, T))
    mask = torch.ones(MB, T, dtype=torch.long)
    out = _chain(stages, input_ids=ids, attention_mask=mask)
    ref = model(input_ids=ids, attention_mask=mask)
    assert type(out) is type(ref)  # the last stage returns the model's own output structure
    assert torch.equal(out.logits, ref.logits)
    assert {n for s in stages for n, _ in s.named_parameters()} == set(dict(model.named_parameters(
        remove_duplicate=False)))
