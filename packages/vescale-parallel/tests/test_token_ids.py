"""Token ids outside the vocabulary raise a named error on every rank under tensor parallelism, as one device raises.

One device's ``nn.Embedding`` raises ``IndexError`` for an id ``>= vocab_size`` or ``< 0``; a vocab-parallel lookup
(each rank its rows, ids outside them masked) would read zeros and go on. Checked, each against the untouched model
on one process (which must raise ``IndexError``):

- vescale's test GPT on tp=2 (the DTensor path: torch's vocab-parallel rule), with and without sequence parallelism,
  with the ids themselves sequence-sharded over tp (the bad id in one rank's half), and whole-model
  ``torch.compile(fullgraph=True)`` (``aot_eager``: the traced Megatron-style lookup);
- a tiny Hugging Face Llama on tp=2, on the fast path (:class:`~vescale.parallel.fast.FastModel`, Megatron's lookup
  on local tensors) and with the fast path off (DTensor path);
- the Llama on dp2 x tp2, the bad id only in one dp rank's rows: the ranks of the other dp group raise too (the ids
  are batch-sharded over dp; one all-reduce of two numbers makes the ranks agree instead of leaving some waiting);
  the same under whole-model compile (an embedding and a linear layer on dp2 x tp2).

For an id equal to ``vocab_size`` and for ``-1``, every rank raises
:class:`~vescale.parallel.errors.TokenIdError` (an ``IndexError``) naming the id, the vocabulary size and the
embedding's FQN; valid ids still give one device's logits (fp32, ``rtol=1e-5``).
"""

from __future__ import annotations

import pytest

from vescale.core.testing import multi_rank

RTOL, ATOL = 1e-5, 1e-6
VOCAB = 64


def _gpt():
    import torch

    from vescale.core.testing.models import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=VOCAB, d_model=32, n_layer=1, n_head=4, n_kv_head=2, max_seq_len=16)).eval()


def _llama():
    import torch
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    return tf.LlamaForCausalLM(cfg).eval()


def _tokens():
    import torch

    return torch.randint(0, VOCAB, (4, 8), generator=torch.Generator().manual_seed(3))


def _bad(tokens, value: int, row: int = 1):
    bad = tokens.clone()
    bad[row, 5] = value
    return bad


def _call(model, tokens):
    out = model(input_ids=tokens, use_cache=False) if hasattr(model, "config") else model(tokens)
    return out.logits if hasattr(out, "logits") else out


def _expect_every_rank_raises(model, tokens, value: int, fqn: str) -> None:
    import torch

    from vescale.parallel import TokenIdError

    with pytest.raises(TokenIdError) as info:
        with torch.no_grad():
            _call(model, tokens)
    msg = str(info.value)
    assert f"token id {value} " in msg and f"vocabulary size {VOCAB}" in msg and repr(fqn) in msg, msg
    assert isinstance(info.value, IndexError)


def _single_device(build, tokens):
    """One device's logits, and that one device raises IndexError for each bad id."""
    import torch

    ref = build()
    for value in (VOCAB, -1):
        with pytest.raises(IndexError), torch.no_grad():
            _call(ref, _bad(tokens, value))
    with torch.no_grad():
        return _call(ref, tokens)


@multi_rank(world_sizes=[2])
def test_gpt_tp2_out_of_vocabulary_ids_raise_on_every_rank():
    import torch
    from torch.distributed.tensor import Shard

    from vescale.core.mesh import init_mesh
    from vescale.parallel import gpt_plan, parallelize_module

    mesh = init_mesh({"tp": 2})
    r = mesh.get_local_rank("tp")
    tokens = _tokens()
    want = _single_device(_gpt, tokens)
    for sp in (False, True):
        model = parallelize_module(_gpt(), mesh, gpt_plan(mesh, sequence_parallel=sp))
        for value in (VOCAB, -1):
            _expect_every_rank_raises(model, _bad(tokens, value), value, "embed")
        with torch.no_grad():
            torch.testing.assert_close(_call(model, tokens), want, rtol=RTOL, atol=ATOL)
    # ids sequence-sharded over tp (each rank passes its half of every row; the bad id is in rank 1's half): the
    # lookup replicates them first, as DTensor's rule does, so both ranks see it
    plan = gpt_plan(mesh, sequence_parallel=True)
    plan["input"][""] = [[Shard(1)]]
    model = parallelize_module(_gpt(), mesh, plan)
    for value in (VOCAB, -1):
        _expect_every_rank_raises(model, _bad(tokens, value).chunk(2, dim=1)[r], value, "embed")
    with torch.no_grad():
        torch.testing.assert_close(_call(model, tokens.chunk(2, dim=1)[r]), want, rtol=RTOL, atol=ATOL)


@multi_rank(world_sizes=[2])
def test_gpt_tp2_compiled_out_of_vocabulary_ids_raise_on_every_rank():
    import torch

    from vescale.core.mesh import init_mesh
    from vescale.parallel import gpt_plan, parallelize_module

    mesh = init_mesh({"tp": 2})
    tokens = _tokens()
    want = _single_device(_gpt, tokens)
    model = parallelize_module(_gpt(), mesh, gpt_plan(mesh))
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(compiled(tokens), want, rtol=RTOL, atol=ATOL)
        for value in (VOCAB, -1):
            _expect_every_rank_raises(compiled, _bad(tokens, value), value, "embed")
        torch.testing.assert_close(compiled(tokens), want, rtol=RTOL, atol=ATOL)


@multi_rank(world_sizes=[2])
def test_llama_tp2_out_of_vocabulary_ids_raise_on_every_rank_fast_and_dtensor_path():
    import torch

    from vescale.core.mesh import init_mesh
    from vescale.parallel import llama_plan, parallelize_module
    from vescale.parallel.fast import FastModel, fast_path

    mesh = init_mesh({"tp": 2})
    tokens = _tokens()
    want = _single_device(_llama, tokens)
    model = parallelize_module(_llama(), mesh, llama_plan(mesh))
    assert isinstance(model.forward, FastModel)
    with torch.no_grad():
        _call(model, tokens)  # probed for random ops (DTensor path)
    for fast in (True, False):
        with fast_path(fast):
            calls = model.forward.local_calls
            for value in (VOCAB, -1):
                _expect_every_rank_raises(model, _bad(tokens, value), value, "model.embed_tokens")
            with torch.no_grad():
                torch.testing.assert_close(_call(model, tokens), want, rtol=RTOL, atol=ATOL)
            assert (model.forward.local_calls > calls) == fast  # the path asked for ran
    sp = parallelize_module(_llama(), mesh, llama_plan(mesh, sequence_parallel=True))
    for value in (VOCAB, -1):
        _expect_every_rank_raises(sp, _bad(tokens, value), value, "model.embed_tokens")


@multi_rank(world_sizes=[4])
def test_llama_dp2_tp2_bad_id_in_one_dp_slice_raises_on_every_rank():
    import torch

    from vescale.core.mesh import init_mesh
    from vescale.parallel import llama_plan, parallelize_module
    from vescale.parallel.fast import fast_path

    mesh = init_mesh({"dp": 2, "tp": 2})
    d = mesh.get_local_rank("dp")
    tokens = _tokens()
    want = _single_device(_llama, tokens)
    model = parallelize_module(_llama(), mesh, llama_plan(mesh))
    for fast in (True, False):
        with fast_path(fast):
            for value in (VOCAB, -1):
                bad = _bad(tokens, value, row=0)  # row 0: in dp rank 0's half only
                _expect_every_rank_raises(model, bad.chunk(2)[d], value, "model.embed_tokens")
            with torch.no_grad():
                torch.testing.assert_close(_call(model, tokens.chunk(2)[d]), want.chunk(2)[d], rtol=RTOL, atol=ATOL)


@multi_rank(world_sizes=[2])
def test_check_token_ids_agrees_over_a_batch_sharded_dim():
    """The check alone: each rank its own rows, one rank's id out of range, both raise with the batch's extreme."""
    import torch
    import torch.distributed as dist

    from vescale.parallel import TokenIdError
    from vescale.parallel.model_calls import check_token_ids

    rank = dist.get_rank()
    ids = torch.tensor([[3, 7], [1, 2]]) + rank
    check_token_ids(ids, 10, "'e'", [dist.group.WORLD])
    for value, shown in ((10, "token id 12 "), (-5, "token id -5 ")):
        ids = torch.tensor([[3, 7], [1, 2]])
        if rank == 1:
            ids[0, 0] = value if value < 0 else 12
        with pytest.raises(TokenIdError, match=shown):
            check_token_ids(ids, 10, "'e'", [dist.group.WORLD])
    check_token_ids(torch.zeros(0, dtype=torch.int64), 10, "'e'", [dist.group.WORLD])


@multi_rank(world_sizes=[4])
def test_compiled_lookup_with_batch_sharded_ids_raises_on_every_rank():
    """Under whole-model compile on dp2 x tp2 with the ids sharded over dp (the bad id in dp rank 0's rows): the
    traced check reduces the ids' extremes over dp (a functional all-reduce in the graph), so every rank raises."""
    import copy

    import torch
    from torch import nn
    from torch.distributed.tensor import Replicate, Shard

    from vescale.core.mesh import init_mesh
    from vescale.parallel import TokenIdError, parallelize_module

    mesh = init_mesh({"dp": 2, "tp": 2})
    d = mesh.get_local_rank("dp")
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 4))
    batch = [Shard(0), Replicate()]
    model = parallelize_module(copy.deepcopy(ref), mesh, {"parameter": {r"0\.weight": [Replicate(), Shard(0)]},
                                                          "input": {"": [batch]},
                                                          "output": {"0": [batch], "": [batch]}})
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    ids = torch.randint(0, 16, (4, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(ids).chunk(2)[d]
        torch.testing.assert_close(compiled(ids.chunk(2)[d]), want, rtol=RTOL, atol=ATOL)
        for value in (16, -1):
            bad = ids.clone()
            bad[0, 2] = value
            with pytest.raises(TokenIdError, match=rf"token id {value} .*embedding '0' with vocabulary size 16"):
                compiled(bad.chunk(2)[d])
        torch.testing.assert_close(compiled(ids.chunk(2)[d]), want, rtol=RTOL, atol=ATOL)
