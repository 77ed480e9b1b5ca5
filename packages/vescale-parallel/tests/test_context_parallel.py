"""Context parallelism of unmodified Hugging Face models against the same model on one process.

Each case builds the model, runs its default call with ``labels=`` (its own loss) on one process as the reference,
then the copy under :func:`vescale.parallel.context_parallel` on every cp rank with the same whole batch. Checked:
logits (gathered back into sequence order), the loss (mean over cp ranks), and every parameter gradient (mean over
cp ranks; with dp, each dp rank gets its own rows and the mean is over dp x cp), fp32 ``rtol=1e-5``. The labels hold
ignored (-100) tokens, so the ranks' token counts differ and a mean of per-rank means would be wrong.
"""

from __future__ import annotations

import pytest

from vescale.core.testing import multi_rank

RTOL, ATOL = 1e-5, 1e-6


def _build(kind: str, attn: str, window: int | None = None):
    import transformers as tf

    common = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, attn_implementation=attn)
    if kind == "llama":
        return tf.LlamaForCausalLM(tf.LlamaConfig(**common)).train()
    if kind == "qwen2":
        return tf.Qwen2ForCausalLM(tf.Qwen2Config(**common)).train()
    return tf.MistralForCausalLM(tf.MistralConfig(**common, sliding_window=window)).train()


def _batch(rows: int, seq: int):
    import torch

    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 64, (rows, seq), generator=g)
    labels = tokens.clone()
    labels[0, 5:9] = -100
    labels[-1, -3:] = -100
    return tokens, labels


def _packed_positions(rows: int, seq: int):
    """Position ids of rows packed with several documents each (restarting at 0 per document), as
    ``DataCollatorWithFlattening`` makes them: documents of uneven lengths, some crossing the cp chunk boundaries
    (every 4 tokens on cp=2, every 2 on cp=4), one of a single token, and (row 1) one restart not at 0."""
    import torch

    lengths = [[3, 6, 7], [5, 1, 4, 6], [2, 9, 5], [16]]
    pos = []
    for r in range(rows):
        row = torch.cat([torch.arange(n) for n in lengths[r % len(lengths)]])
        if r % len(lengths) == 1:
            row[10:] += 3  # a document whose positions start at 3 (a jump, not a restart at 0): a new one too
        assert row.numel() == seq
        pos.append(row)
    return torch.stack(pos)


def _case(kind: str, dims: dict, attn: str = "sdpa", window: int | None = None, tp_plan: bool = False,
          checkpointed: bool = False, packed: bool = False, ones_mask: bool = False, use_cache: bool | None = None,
          hf_checkpointing: bool = False):
    """``packed``: rows packed with several documents (``position_ids`` restarting, no attention mask). One device
    attends within each document only when it also builds no KV cache (``use_cache=False``, or transformers'
    gradient checkpointing in training, ``hf_checkpointing``); with ``ones_mask`` (an all-ones attention mask) or a
    cache (``use_cache`` left to the config's ``True``) it attends over the whole row. ``use_cache`` is passed to
    both models when not None."""
    import copy

    import torch
    import torch.distributed as dist

    from vescale.core.mesh import init_mesh, sub_mesh
    from vescale.parallel import context_parallel, gather_sequence

    mesh = init_mesh(dims)
    cp_mesh = sub_mesh(mesh, "cp")
    dp = dims.get("dp", 1)
    torch.manual_seed(0)
    ref = _build(kind, attn, window)
    if hf_checkpointing:
        ref.gradient_checkpointing_enable()
    par = copy.deepcopy(ref)
    tokens, labels = _batch(2 * dp, 16)
    extra = {}
    if packed:
        extra["position_ids"] = _packed_positions(2 * dp, 16)
        if ones_mask:
            extra["attention_mask"] = torch.ones_like(tokens)
    flags = {} if use_cache is None else {"use_cache": use_cache}
    ref_out = ref(input_ids=tokens, labels=labels, **extra, **flags)
    ref_out.loss.backward()

    if tp_plan:
        from vescale.parallel import PLANS, parallelize_module

        parallelize_module(par, sub_mesh(mesh, "tp"), PLANS[kind](sub_mesh(mesh, "tp")))
    context_parallel(par, cp_mesh)
    if checkpointed:  # the recompute in backward must attend over the whole sequence again, as the forward did
        from vescale.parallel import checkpoint_activations

        checkpoint_activations(par, "full")
    r = mesh.get_local_rank("dp") if dp > 1 else 0
    my_tokens, my_labels = tokens.chunk(dp)[r], labels.chunk(dp)[r]
    out = par(input_ids=my_tokens, labels=my_labels, **{key: t.chunk(dp)[r] for key, t in extra.items()}, **flags)
    out.loss.backward()

    def full(t):
        return t.full_tensor() if hasattr(t, "full_tensor") else t

    logits = gather_sequence(full(out.logits).detach(), cp_mesh)
    # The reference loss is the mean over all target tokens of the whole batch; each dp rank's model sees its own
    # rows, so its loss share is over its rows' count: weight the dp ranks by their counts.
    count = (torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), -100)], 1).chunk(dp)[r] != -100).sum()
    loss_sum = out.loss.detach() * count
    dist.all_reduce(loss_sum)
    total = (labels[:, 1:] != -100).sum() * (dist.get_world_size() // dp)  # summed over cp (and tp) ranks
    torch.testing.assert_close(loss_sum / total, ref_out.loss.detach(), rtol=RTOL, atol=ATOL)
    if dp > 1:
        parts = [torch.empty_like(logits) for _ in range(dp)]
        dist.all_gather(parts, logits.contiguous(), group=mesh.get_group("dp"))
        logits = torch.cat(parts)
    torch.testing.assert_close(logits, ref_out.logits.detach(), rtol=RTOL, atol=ATOL)
    ref_params = dict(ref.named_parameters())
    for name, p in par.named_parameters():
        grad = full(p.grad) * count
        dist.all_reduce(grad, group=cp_mesh.get_group())
        if dp > 1:
            dist.all_reduce(grad, group=mesh.get_group("dp"))
        grad = grad / ((labels[:, 1:] != -100).sum() * cp_mesh.size())
        # grad now averages (per-rank grad x its dp rows' count / N) over cp: the one-device gradient
        torch.testing.assert_close(grad, ref_params[name].grad, rtol=RTOL, atol=ATOL,
                                   msg=lambda m, name=name: f"{kind} {dims} {name}: {m}")


@pytest.mark.parametrize("kind,attn,checkpointed", [("llama", "sdpa", False), ("qwen2", "eager", False),
                                                    ("mistral", "sdpa", False), ("llama", "eager", True)])
@multi_rank(world_sizes=[2])
def test_cp2_matches_single_device(kind, attn, checkpointed):
    _case(kind, {"cp": 2}, attn, window=5 if kind == "mistral" else None, checkpointed=checkpointed)


@multi_rank(world_sizes=[4])
def test_cp4_and_composed_meshes_match_single_device():
    _case("llama", {"cp": 4})
    _case("llama", {"dp": 2, "cp": 2}, "eager")
    _case("qwen2", {"cp": 2, "tp": 2}, tp_plan=True)


def _refusals():
    import torch
    import transformers as tf

    from vescale.core.mesh import init_mesh
    from vescale.parallel import ContextParallelError, context_parallel

    model = context_parallel(_build("llama", "sdpa"), init_mesh({"cp": 2}))
    tokens = torch.zeros(1, 16, dtype=torch.long)
    padded = torch.ones(1, 16, dtype=torch.long)
    padded[0, 12:] = 0
    messages = []
    for call in (dict(input_ids=tokens[:, :6]), dict(input_ids=tokens, attention_mask=padded),
                 dict(input_ids=tokens, use_cache=True)):
        with pytest.raises(ContextParallelError) as info:
            model(**call)
        messages.append(str(info.value))
    dropout = tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                                 num_hidden_layers=1, num_attention_heads=4, attention_dropout=0.1))
    context_parallel(dropout.train(), init_mesh({"cp": 2}))
    with pytest.raises(ContextParallelError, match="dropout"):
        dropout(input_ids=tokens)
    return messages


@multi_rank(world_sizes=[2])
def test_refusals_name_the_reason():
    messages = _refusals()
    assert "not divisible by 2 x cp = 4" in messages[0]
    assert "padding" in messages[1]
    assert "KV cache" in messages[2]


# -- packed rows: several documents per row, position_ids restarting, no attention mask ----------------------------


def test_packed_reference_attends_within_documents():
    """What the packed tests compare against: one device's transformers Llama given restarting position_ids, no
    mask and no KV cache attends within each document (its logits differ from attending over the whole row, which
    it does with an all-ones mask or with the cache the config's ``use_cache=True`` makes), and the document ids
    context parallelism derives are transformers' own packed-sequence indices."""
    import torch
    from transformers.masking_utils import find_packed_sequence_indices

    from vescale.parallel.context_parallel import document_ids

    positions = _packed_positions(4, 16)
    assert torch.equal(document_ids(positions), find_packed_sequence_indices(positions))
    assert document_ids(torch.arange(16).unsqueeze(0)) is None  # one document a row: the plain causal mask
    assert document_ids(torch.arange(3, 19).expand(2, 16)) is None
    torch.manual_seed(0)
    model = _build("llama", "sdpa").eval()
    tokens, _ = _batch(2, 16)
    with torch.no_grad():
        within = model(input_ids=tokens, position_ids=positions[:2], use_cache=False).logits
        across = model(input_ids=tokens, position_ids=positions[:2], use_cache=False,
                       attention_mask=torch.ones_like(tokens)).logits
        cached = model(input_ids=tokens, position_ids=positions[:2]).logits
    assert torch.equal(across, cached)
    assert (within - across).abs().max() > 1e-3  # a cross-document attention fails the tests below (rtol 1e-5)


@pytest.mark.parametrize("kind,attn,how", [("llama", "sdpa", "plain"), ("mistral", "sdpa", "plain"),
                                           ("qwen2", "eager", "checkpointed"), ("llama", "sdpa", "hf_checkpointing")])
@multi_rank(world_sizes=[2])
def test_cp2_packed_documents_match_single_device(kind, attn, how):
    """Logits, loss and every gradient of packed rows (documents crossing the chunk boundaries) on cp=2, also with a
    sliding window (Mistral, window 5), under vescale's activation checkpointing (the recompute masks documents
    again) and under transformers' gradient checkpointing (which turns the config's cache off: one device packs)."""
    _case(kind, {"cp": 2}, attn, window=5 if kind == "mistral" else None, checkpointed=how == "checkpointed",
          packed=True, use_cache=None if how == "hf_checkpointing" else False,
          hf_checkpointing=how == "hf_checkpointing")


@pytest.mark.parametrize("how", ["ones_mask", "config_cache"])
@multi_rank(world_sizes=[2])
def test_cp2_restarting_positions_that_one_device_does_not_pack(how):
    """With an (all-ones) attention mask, or with the KV cache of the config's ``use_cache=True``, transformers does
    not look for packing: one device attends over the whole row, and so does cp."""
    masked = how == "ones_mask"
    _case("llama", {"cp": 2}, packed=True, ones_mask=masked, use_cache=False if masked else None)


@multi_rank(world_sizes=[4])
def test_cp4_and_cp2_tp2_packed_documents_match_single_device():
    _case("llama", {"cp": 4}, packed=True, use_cache=False)
    _case("qwen2", {"cp": 2, "tp": 2}, tp_plan=True, packed=True, use_cache=False)  # ids as replicated DTensors


@multi_rank(world_sizes=[2])
def test_attention_without_the_document_ids_is_refused_on_every_rank():
    """A model whose attention module drops its keyword arguments would attend across documents: refused, before
    the first layer's key/value gather, on every rank."""
    from vescale.core.mesh import init_mesh
    from vescale.parallel import ContextParallelError, context_parallel
    from vescale.parallel.context_parallel import DOCUMENTS_KWARG

    model = context_parallel(_build("llama", "sdpa"), init_mesh({"cp": 2}))
    attention = model.model.layers[0].self_attn
    forward = attention.forward

    def dropping(*args, **kwargs):
        kwargs.pop(DOCUMENTS_KWARG, None)
        return forward(*args, **kwargs)

    attention.forward = dropping
    tokens, _ = _batch(2, 16)
    with pytest.raises(ContextParallelError, match="without the packed documents' ids"):
        model(input_ids=tokens, position_ids=_packed_positions(2, 16), use_cache=False)
    model(input_ids=tokens, use_cache=False)  # one document a row: nothing to pass, nothing refused
