"""The crc32 that checksums are computed with: ISA-L's SIMD implementation when the optional ``isal`` package is
installed (``pip install vescale-checkpoint[fast]``, several times faster), else zlib's. Both compute the same
standard CRC-32, so checkpoints do not depend on which one wrote or reads them."""

from __future__ import annotations

try:
    from isal.isal_zlib import crc32
except ImportError:  # the optional accelerator is absent: the standard library's
    from zlib import crc32

__all__ = ["crc32"]
