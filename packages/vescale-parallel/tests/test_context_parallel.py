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


def _case(kind: str, dims: dict, attn: str = "sdpa", window: int | None = None, tp_plan: bool = False,
          checkpointed: bool = False):
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
    par = copy.deepcopy(ref)
    tokens, labels = _batch(2 * dp, 16)
    ref_out = ref(input_ids=tokens, labels=labels)
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
    out = par(input_ids=my_tokens, labels=my_labels)
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
