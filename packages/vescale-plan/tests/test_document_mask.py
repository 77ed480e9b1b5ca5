"""Document masking of packed rows (``ParallelSpec.document_mask``, ``forward_backward(..., documents=)``) against
one device running every document on its own.

The reference is built without the code under test: the unmodified model on one process called once per document
(positions from 0, no mask of any kind), the logits concatenated back into the packed rows, one cross-entropy over
the whole global batch and one backward. The parallel run gets the packed rows and their document ids
(:func:`vescale.plan.documents_from_eos` of an EOS-separated stream). The rows hold documents of 1 to 16 tokens,
several crossing the cp chunk boundaries (chunks of 4 tokens under cp=2). Loss and every gradient (DTensors gathered;
with pp this rank's stages) are compared at rtol 1e-5; logits too where the model is called whole (pp=1). Without
the mask the logits differ from the reference by O(0.1) (checked: the test can fail).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from vescale.core.testing import multi_rank

sys.path.insert(0, str(Path(__file__).parent))  # (importlib mode: the shared fixtures by this folder's path)
from _doc_fixtures import BATCH, MODELS, SEQ, VOCAB, assert_matches, gpt, llama, logits, one_device  # noqa: E402

EOS = VOCAB - 1
# Each row's document lengths (sum SEQ); the last token of every document but a row's last is EOS.
LENGTHS = [[3, 7, 6], [16], [1, 9, 6], [5, 5, 2, 4], [2, 14], [8, 8], [4, 4, 4, 4], [11, 5]]


def packed_batch():
    """``(inputs, targets)`` ``[BATCH, SEQ]``: random tokens below EOS, EOS closing each document but a row's last."""
    import torch

    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, EOS, (BATCH, SEQ + 1), generator=g)
    for r, lengths in enumerate(LENGTHS):
        end = 0
        for n in lengths[:-1]:
            end += n
            tokens[r, end - 1] = EOS
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _logits(model, x):
    return model(input_ids=x, use_cache=False).logits if hasattr(model, "config") else model(x)


def reference_logits(model, inputs):
    """Every document of every row through ``model`` on its own, concatenated: ``[BATCH, SEQ, V]``."""
    import torch

    rows = []
    for r, lengths in enumerate(LENGTHS[:len(inputs)]):
        parts, start = [], 0
        for n in lengths:
            parts.append(logits(model, inputs[r:r + 1, start:start + n]))
            start += n
        rows.append(torch.cat(parts, dim=1))
    return torch.cat(rows)


def _run(model: str, mesh: dict, *, check_logits: bool = True, batch: int = BATCH, **spec_kw) -> None:
    import torch

    from vescale.plan import ParallelSpec, build, document_inputs, documents_from_eos

    inputs, targets = (t[:batch] for t in packed_batch())
    documents = documents_from_eos(inputs, EOS)
    assert [int(d.max()) + 1 for d in documents] == [len(n) for n in LENGTHS[:batch]]
    ref, ref_logits, ref_loss = one_device(MODELS[model], lambda m: reference_logits(m, inputs), targets)
    spec = ParallelSpec(mesh=mesh, document_mask=True, **spec_kw)
    par = build(MODELS[model](), spec, batch_size=batch, seq_len=SEQ)
    what = f"{model} {mesh} {spec_kw}"
    x, y, docs = par.shard_batch(inputs), par.shard_batch(targets), par.shard_batch(documents)
    assert_matches(par, par.forward_backward(x, y, documents=docs), ref, ref_loss, what)
    if check_logits and par.engine is None:
        with torch.no_grad():
            kw = document_inputs(docs, transformers_style=hasattr(par.model, "config"),
                                 explicit_mask=par.roles.ep.size > 1)
            out = par.model(input_ids=x, **kw).logits if hasattr(par.model, "config") else par.model(x, **kw)
            out = out.full_tensor() if hasattr(out, "full_tensor") else out
            if par.roles.cp.size > 1:
                from vescale.parallel import gather_sequence

                out = gather_sequence(out.contiguous(), par.roles.cp.mesh)
        ref_rows = par.shard_batch(ref_logits.detach())
        torch.testing.assert_close(out, ref_rows, rtol=1e-5, atol=1e-5, msg=f"{what} logits")


def test_documents_from_eos_and_positions():
    import torch

    from vescale.plan import document_inputs, document_positions, documents_from_eos

    tokens = torch.tensor([[5, 9, EOS, 4, EOS, EOS, 1, 2]])
    docs = documents_from_eos(tokens, EOS)
    assert docs.tolist() == [[0, 0, 0, 1, 1, 2, 3, 3]]
    assert document_positions(docs).tolist() == [[0, 1, 2, 0, 1, 0, 0, 1]]
    assert sorted(document_inputs(docs, transformers_style=True)) == ["position_ids"]
    assert sorted(document_inputs(docs, transformers_style=False)) == ["documents", "positions"]
    with pytest.raises(ValueError, match="document ids must be integers"):
        document_inputs(docs.float(), transformers_style=True)


def test_one_device_gpt_and_llama_and_the_mask_matters():
    """One rank (no mesh): the model's own mechanism equals the per-document reference, and the unmasked packed
    rows do not (so every comparison below can fail)."""
    import torch

    from vescale.plan import document_inputs, documents_from_eos

    inputs, _ = packed_batch()
    docs = documents_from_eos(inputs, EOS)
    for model_fn in (gpt, llama):
        model = model_fn()
        ref = reference_logits(model, inputs)
        hf = hasattr(model, "config")
        kw = document_inputs(docs, transformers_style=hf)
        masked = model(input_ids=inputs, use_cache=False, **kw).logits if hf else model(inputs, **kw)
        torch.testing.assert_close(masked, ref, rtol=1e-5, atol=1e-5)
        assert (logits(model, inputs) - ref).abs().max() > 1e-2


@multi_rank(world_sizes=[2])
@pytest.mark.parametrize("model", ["gpt", "llama"])
@pytest.mark.parametrize("mesh", [{"tp": 2}, {"cp": 2}])
def test_document_mask_tp2_cp2(world_size, mesh, model):
    _run(model, mesh, **({"tp_plan": model} if "tp" in mesh else {}))


@multi_rank(world_sizes=[2])
def test_document_mask_cp2_activation_checkpointing(world_size):
    _run("gpt", {"cp": 2}, activation_checkpointing="full")


@multi_rank(world_sizes=[4])
def test_document_mask_dp2_tp2_sequence_parallel_grad_accum(world_size):
    _run("gpt", {"dp": 2, "tp": 2}, tp_plan="gpt", sequence_parallel=True, grad_accum=2)


@multi_rank(world_sizes=[2])
@pytest.mark.parametrize("model", ["gpt", "llama"])
def test_document_mask_pp2(world_size, model):
    _run(model, {"pp": 2}, microbatches=2)


@multi_rank(world_sizes=[4])
def test_document_mask_dp2_ep2_mixtral(world_size):
    # one row a rank: batch rank 1 holds a single document, its peers packed rows (transformers would take another
    # mask path there, with other DTensor collectives, but for the explicit block-diagonal mask: a hang)
    _run("mixtral", {"dp": 2, "ep": 2}, batch=4)


@multi_rank(world_sizes=[4])
def test_document_mask_pp2_cp2(world_size):
    _run("gpt", {"pp": 2, "cp": 2}, microbatches=2)


@multi_rank(world_sizes=[4])
def test_document_mask_pp2_ep2_mixtral(world_size):
    _run("mixtral", {"pp": 2, "dp": 1, "ep": 2}, microbatches=2)


@multi_rank(world_sizes=[2])
def test_document_mask_tp2_compile(world_size):
    _run("gpt", {"tp": 2}, tp_plan="gpt", compile=True)


def test_documents_without_the_spec_field_are_refused():
    import torch

    from vescale.plan import ParallelSpec, SpecError, build

    inputs, targets = packed_batch()
    par = build(gpt(), ParallelSpec(), batch_size=BATCH, seq_len=SEQ)
    with pytest.raises(SpecError, match="document_mask"):
        par.forward_backward(inputs, targets, documents=torch.zeros_like(inputs))
    with pytest.raises(SpecError, match="Linear.forward takes neither"):  # no way to hand it the documents
        build(torch.nn.Linear(4, 4), ParallelSpec(document_mask=True))
