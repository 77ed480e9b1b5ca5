"""Philox4x32-10 (Salmon et al., SC'11) as vectorised torch int64 ops: a counter-based bit generator.

Each call maps a 128-bit counter and a 64-bit key to four 32-bit words, with no state: any element's random bits
can be computed on its own, on any rank, in any order. Words are held in int64 tensors with values in [0, 2**32).
"""

from __future__ import annotations

import torch

__all__ = ["philox4x32", "MASK32"]

MASK32 = 0xFFFFFFFF
_M0, _M1 = 0xD2511F53, 0xCD9E8D57
_W0, _W1 = 0x9E3779B9, 0xBB67AE85


def _mulhilo(m: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # x < 2**32 and m < 2**32, so the product needs 64 unsigned bits; int64 multiplication wraps modulo 2**64 (two's
    # complement) on every torch backend, so the low 64 bits are exact and the shifts below recover hi and lo.
    p = x * m
    hi = (p >> 32).bitwise_and_(MASK32)
    return hi, p.bitwise_and_(MASK32)


def philox4x32(c0: torch.Tensor, c1: torch.Tensor, c2: int, c3: int, k0: int, k1: int,
               rounds: int = 10) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Philox4x32 of counters ``(c0, c1, c2, c3)`` under key ``(k0, k1)``; returns four word tensors.

    ``c0``/``c1`` are int64 tensors (same shape) with 32-bit values; ``c2``, ``c3``, ``k0``, ``k1`` are Python ints
    in ``[0, 2**32)`` shared by every element.
    """
    x0, x1 = c0, c1
    x2 = torch.full_like(c0, c2 & MASK32)
    x3 = torch.full_like(c0, c3 & MASK32)
    for _ in range(rounds):
        hi0, lo0 = _mulhilo(_M0, x0)
        hi1, lo1 = _mulhilo(_M1, x2)
        x0, x1, x2, x3 = hi1.bitwise_xor_(x1).bitwise_xor_(k0), lo1, hi0.bitwise_xor_(x3).bitwise_xor_(k1), lo0
        k0 = (k0 + _W0) & MASK32
        k1 = (k1 + _W1) & MASK32
    return x0, x1, x2, x3
