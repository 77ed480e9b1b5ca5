"""Packed documents: the document ids of packed rows, their restarting positions, and the model inputs that carry them.

A packed row holds several documents back to back (each followed by an end-of-document token, as
``tools/prepare_data.py`` writes them). With document masking a token attends only to earlier tokens of its own
document and its position counts from its document's start (Llama 3's pretraining). The document ids of a row are
non-decreasing integers, one per position (:func:`documents_from_eos` derives them from the token ids); every model
then takes them through its own mechanism (:func:`document_inputs`):

- a transformers causal LM: ``position_ids`` restarting at 0 for each document, without an attention mask and without
  a KV cache, from which transformers itself builds the block-diagonal causal mask (``sdpa`` and ``eager``; its
  ``use_cache`` must be off, which :func:`vescale.plan.build` sees to), and context parallelism its per-document
  blockwise attention (``vescale.parallel.context_parallel``);
- a model following the causal-attention hook (``forward(tokens, positions=None, documents=None)``, the in-repo GPT):
  per-row ``positions`` and the ``documents`` themselves, passed down to every ``causal_attention(q, k, v,
  documents)``.

Every input returned is per token (``[B, S]``), so it is split as the tokens are: rows over the data ranks,
gradient-accumulation micro-steps and pipeline microbatches along dim 0; under context parallelism the model's cp
forward takes the whole rows and slices what it needs. Local: no collective.
"""

from __future__ import annotations

import torch

__all__ = ["documents_from_eos", "document_positions", "document_inputs", "block_diagonal_mask"]


def documents_from_eos(tokens: torch.Tensor, eos_id: int) -> torch.Tensor:
    """Document ids (int64, same shape as ``tokens`` ``[B, S]``, counting from 0 in each row): a new document starts
    after every ``eos_id`` token; the EOS itself ends its own document."""
    ends = (tokens == eos_id).long()
    return torch.cumsum(ends, dim=-1) - ends  # (an EOS counts for the documents after it, not its own)


def document_positions(documents: torch.Tensor) -> torch.Tensor:
    """The position of every token within its document (int64 ``[B, S]``): 0 where a row's document id changes (and
    at the start of the row), counting up to the next change."""
    s = documents.shape[-1]
    index = torch.arange(s, device=documents.device).expand_as(documents)
    starts = torch.ones_like(documents, dtype=torch.bool)
    starts[..., 1:] = documents[..., 1:] != documents[..., :-1]
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=-1).values
    return index - first


def block_diagonal_mask(documents: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[B, 1, S, S]`` additive attention mask (0 where a query may attend, the dtype's lowest value elsewhere): the
    causal mask within each document of ``documents`` ``[B, S]``, as transformers takes a prepared 4-D mask."""
    s = documents.shape[-1]
    causal = torch.ones(s, s, dtype=torch.bool, device=documents.device).tril()
    allowed = causal & (documents[:, None, :, None] == documents[:, None, None, :])
    return torch.zeros(allowed.shape, dtype=dtype, device=documents.device).masked_fill_(~allowed,
                                                                                        torch.finfo(dtype).min)


def document_inputs(documents: torch.Tensor, *, transformers_style: bool,
                    explicit_mask: bool = False) -> dict[str, torch.Tensor]:
    """The extra per-token keyword inputs that make a model attend within the ``documents`` (``[B, S]``) of its
    packed rows: ``{"position_ids"}`` for a transformers model (``transformers_style``), ``{"positions",
    "documents"}`` for a causal-attention-hook model. ``explicit_mask`` (transformers): also the prepared
    :func:`block_diagonal_mask` as ``attention_mask``, for ranks whose rows differ inside one model mesh (expert
    parallelism: transformers decides from each rank's own ``position_ids`` whether its rows are packed, and a rank
    with a single document per row would take another path, issuing other DTensor collectives, than its peers)."""
    if documents.dim() != 2 or documents.is_floating_point():
        raise ValueError(f"document ids must be integers [batch, seq_len]; got {tuple(documents.shape)} "
                         f"{documents.dtype}")
    positions = document_positions(documents)
    if transformers_style:
        if explicit_mask:
            return {"position_ids": positions, "attention_mask": block_diagonal_mask(documents)}
        return {"position_ids": positions}
    return {"positions": positions, "documents": documents}
