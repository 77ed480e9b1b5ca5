"""Value kernels of the counter RNG (:mod:`vescale.dtensor.random`): each maps global element indices, a call sequence
number and a seed to values of one distribution, a pure function of the three (Philox4x32-10, float64 math, cast to
the target dtype). Nothing here knows about placements: the caller passes the global indices of its local elements.

Continuous distributions other than uniform and normal are inverse-CDF transforms of a uniform in the *open* interval
(0, 1) (the 53-bit grid shifted by half a step), so no ``log(0)`` or ``tan(pi/2)`` occurs: exponential values are
positive and finite, Cauchy values finite, geometric values integers >= 1, as torch's own generator gives them.
"""

from __future__ import annotations

import math

import torch

from vescale.dtensor._philox import MASK32, philox4x32

__all__ = ["MANTISSA", "uniform_values", "normal_values", "randint_values", "uniform01", "exponential_values",
           "geometric_values", "log_normal_values", "cauchy_values", "check_params"]

MANTISSA = {torch.float64: 53, torch.float32: 24, torch.float16: 11, torch.bfloat16: 8}


def _words(index: torch.Tensor, seq: int, seed: int):
    return philox4x32(index & MASK32, index >> 32, seq & MASK32, (seq >> 32) & MASK32, seed & MASK32,
                      (seed >> 32) & MASK32)


def _unit(hi: torch.Tensor, lo: torch.Tensor, bits: int) -> torch.Tensor:
    """Uniform in [0, 1) with ``bits`` random bits (<= 53), exact in float64."""
    if bits <= 32:
        return (hi >> (32 - bits)).to(torch.float64) * (2.0 ** -bits)
    return ((hi << (bits - 32)) | (lo >> (64 - bits))).to(torch.float64) * (2.0 ** -bits)


def _open_unit(index: torch.Tensor, seq: int, seed: int) -> torch.Tensor:
    """Uniform in the open interval (0, 1): the 53-bit grid ``k / 2**53`` moved by half a step (exact in float64)."""
    w0, w1, _, _ = _words(index, seq, seed)
    return _unit(w0, w1, 53) + 2.0 ** -54


def uniform_values(index: torch.Tensor, seq: int, seed: int, low: float, high: float,
                   dtype: torch.dtype) -> torch.Tensor:
    """Uniform values in ``[low, high)`` for global element ``index`` (float64 math, cast to ``dtype``)."""
    w0, w1, _, _ = _words(index, seq, seed)
    u = _unit(w0, w1, MANTISSA.get(dtype, 53))
    return (u * (high - low) + low).to(dtype)


def normal_values(index: torch.Tensor, seq: int, seed: int, mean: float, std: float,
                  dtype: torch.dtype) -> torch.Tensor:
    """Normal values (Box-Muller on 53-bit uniforms, float64 math, cast to ``dtype``) for global ``index``."""
    return (_standard_normal(index, seq, seed) * std + mean).to(dtype)


def _standard_normal(index: torch.Tensor, seq: int, seed: int) -> torch.Tensor:
    w0, w1, w2, w3 = _words(index, seq, seed)
    u1 = 1.0 - _unit(w0, w1, 53)  # (0, 1]: log is finite
    u2 = _unit(w2, w3, 53)
    return torch.sqrt(-2.0 * torch.log(u1)) * torch.cos((2.0 * math.pi) * u2)


def randint_values(index: torch.Tensor, seq: int, seed: int, low: int, high: int, dtype: torch.dtype) -> torch.Tensor:
    """Integers uniform in ``[low, high)`` (53-bit multiply-floor; span must be below 2**53)."""
    span = int(high) - int(low)
    if span <= 0 or span >= 1 << 53:
        raise ValueError(f"randint: need 0 < high - low < 2**53, got low={low}, high={high}")
    w0, w1, _, _ = _words(index, seq, seed)
    k = torch.floor(_unit(w0, w1, 53) * span).to(torch.int64).clamp_(max=span - 1)
    return (k + int(low)).to(dtype)


def uniform01(index: torch.Tensor, seq: int, seed: int) -> torch.Tensor:
    """Uniform in [0, 1) with 53 bits (float64): the draw of ``bernoulli`` and dropout."""
    w0, w1, _, _ = _words(index, seq, seed)
    return _unit(w0, w1, 53)


def _positive(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` (float64, > 0) cast to ``dtype`` without rounding to 0 (float16 flushes values below 2**-25): at least
    ``dtype``'s smallest subnormal."""
    out = x.to(dtype)
    if dtype.is_floating_point:
        info = torch.finfo(dtype)
        out.clamp_(min=info.smallest_normal * info.eps)
    return out


def exponential_values(index: torch.Tensor, seq: int, seed: int, lambd: float, dtype: torch.dtype) -> torch.Tensor:
    """Exponential values of rate ``lambd``: ``-log(u) / lambd`` with ``u`` in (0, 1), so each is > 0 and finite."""
    return _positive(-torch.log(_open_unit(index, seq, seed)) / lambd, dtype)


def geometric_values(index: torch.Tensor, seq: int, seed: int, p: float, dtype: torch.dtype) -> torch.Tensor:
    """Geometric values (trials up to the first success, success probability ``p``): ``ceil(log(u) / log(1 - p))``
    with ``u`` in (0, 1), integers >= 1 in ``dtype``."""
    k = torch.ceil(torch.log(_open_unit(index, seq, seed)) / math.log1p(-p)).clamp_(min=1.0)
    if not dtype.is_floating_point:
        k.clamp_(max=float(torch.iinfo(dtype).max))
    return k.to(dtype)


def log_normal_values(index: torch.Tensor, seq: int, seed: int, mean: float, std: float,
                      dtype: torch.dtype) -> torch.Tensor:
    """Log-normal values: ``exp`` of the normal values of ``(mean, std)`` (the same Box-Muller draw as ``normal_``)."""
    return _positive(torch.exp(_standard_normal(index, seq, seed) * std + mean), dtype)


def cauchy_values(index: torch.Tensor, seq: int, seed: int, median: float, sigma: float,
                  dtype: torch.dtype) -> torch.Tensor:
    """Cauchy values: ``median + sigma * tan(pi * (u - 1/2))`` with ``u`` in (0, 1), so each is finite."""
    return (median + sigma * torch.tan(math.pi * (_open_unit(index, seq, seed) - 0.5))).to(dtype)


def check_params(kind: str, params: tuple) -> None:
    """Raise ``RuntimeError`` with torch's own message for parameters torch's generator refuses (before any draw)."""
    if kind == "exponential" and not float(params[0]) > 0.0:
        raise RuntimeError(f"exponential_ expects lambda > 0.0, but found lambda={params[0]}")
    if kind == "geometric" and not 0.0 < float(params[0]) < 1.0:
        raise RuntimeError(f"geometric_ expects p to be in (0, 1), but got p={params[0]}")
    if kind == "log_normal" and not float(params[1]) > 0.0:
        raise RuntimeError(f"log_normal_ expects std > 0.0, but found std={params[1]}")
    if kind == "cauchy" and not float(params[1]) > 0.0:
        raise RuntimeError(f"cauchy_ expects sigma > 0.0, but found sigma={params[1]}")
