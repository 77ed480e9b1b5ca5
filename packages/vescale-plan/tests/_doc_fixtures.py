"""What test_document_mask.py and test_token_mean.py share: their tiny models (seeded: every call builds the same
weights) and the comparison of a built job's loss and gradients with one device's.

Imported by path (the suite runs with ``--import-mode=importlib``, so this folder is not on ``sys.path``; each test
module puts it there, in the rank processes too).
"""

from __future__ import annotations

from collections.abc import Callable

BATCH, SEQ, VOCAB = 8, 16, 64


def gpt():
    """The in-repo GPT (causal-attention hook), 2 layers, d_model 32, GQA 4/2 heads."""
    import torch

    from vescale.core.testing.models import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=VOCAB, d_model=32, n_layer=2, n_head=4, n_kv_head=2, max_seq_len=SEQ))


def llama():
    """A transformers Llama of the GPT's size (sdpa attention)."""
    import torch
    import transformers as T

    torch.manual_seed(0)
    return T.LlamaForCausalLM(T.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                            max_position_embeddings=64, attn_implementation="sdpa"))


def mixtral():
    """A transformers Mixtral of the GPT's size, 4 experts, top-2 (eager attention)."""
    import torch
    import transformers as T

    torch.manual_seed(0)
    return T.MixtralForCausalLM(T.MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                max_position_embeddings=64, num_local_experts=4,
                                                num_experts_per_tok=2, attn_implementation="eager"))


MODELS = {"gpt": gpt, "llama": llama, "mixtral": mixtral}


def logits(model, x):
    """``model``'s logits of tokens ``x`` ``[B, S]`` (a transformers model without its KV cache)."""
    return model(input_ids=x, use_cache=False).logits if hasattr(model, "config") else model(x)


def one_device(model_fn: Callable, logits_of: Callable, targets):
    """The reference: ``model_fn()`` on this process, ``logits_of(model)`` ``[B, S, V]``, one cross-entropy (mean over
    the targets that are not -100) and one backward. Returns ``(model, logits, loss)``, the gradients in the model."""
    import torch.nn.functional as F

    model = model_fn()
    out = logits_of(model)
    loss = F.cross_entropy(out.flatten(0, 1), targets.flatten(), ignore_index=-100)
    loss.backward()
    return model, out, loss


def assert_matches(par, loss, ref_model, ref_loss, what: str) -> None:
    """``par.global_loss(loss)`` equals ``ref_loss`` and every gradient ``par`` holds (DTensors gathered; with pp this
    rank's stages') equals ``ref_model``'s of that FQN, rtol 1e-5 (the parallel run sums in another order)."""
    import torch

    torch.testing.assert_close(par.global_loss(loss), ref_loss.detach(), rtol=1e-5, atol=1e-6, msg=what)
    grads = {n: (g.full_tensor() if hasattr(g, "full_tensor") else g) for n, g in par.grads().items()}
    assert grads, what
    named = dict(ref_model.named_parameters())
    for n, g in grads.items():
        torch.testing.assert_close(g, named[n].grad, rtol=1e-5, atol=1e-6, msg=lambda m, n=n: f"{what} {n}: {m}")
