"""The training data of ``tools/train.py``: a learnable synthetic corpus that every rank generates for any step
without communicating, so every mesh trains on the same global batches and a resumed run continues the same stream."""

from __future__ import annotations

import torch

__all__ = ["MarkovCorpus"]


class MarkovCorpus:
    """Sequences from a fixed random Markov chain in which each token has ``fanout`` likely successors."""

    def __init__(self, vocab_size: int, seed: int, fanout: int = 4) -> None:
        g = torch.Generator().manual_seed(seed)
        self.vocab_size = vocab_size
        self.successors = torch.randint(0, vocab_size, (vocab_size, fanout), generator=g)
        self.probs = torch.softmax(torch.randn(vocab_size, fanout, generator=g) * 1.5, dim=-1)
        self.seed = seed

    def entropy(self) -> float:
        """Per-token entropy of the chain (nats): the lowest loss a model can reach."""
        return float(-(self.probs * self.probs.log()).sum(-1).mean())

    def batch(self, step: int, batch_size: int, seq_len: int) -> torch.Tensor:
        """The global batch of ``step``: ``[batch_size, seq_len + 1]`` int64 (inputs and shifted targets)."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        tokens = torch.empty(batch_size, seq_len + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, self.vocab_size, (batch_size,), generator=g)
        for t in range(seq_len):
            choice = torch.multinomial(self.probs[tokens[:, t]], 1, generator=g).squeeze(1)
            tokens[:, t + 1] = self.successors[tokens[:, t], choice]
        return tokens
