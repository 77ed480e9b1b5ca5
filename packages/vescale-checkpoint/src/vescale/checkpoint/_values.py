"""Lossless JSON encoding of the non-tensor values a state holds (step counters, scheduler state, config).

Plain JSON covers str, int, float, bool, None, lists and str-keyed dicts. Three tagged forms cover the rest that
``state_dict()`` methods commonly return, so a value loads back with its Python type: ``{"__tuple__": [...]}``,
``{"__dict__": [[key, value], ...]}`` for dicts with non-str keys, ``{"__float__": "nan" | "inf" | "-inf"}``.
Anything else raises :class:`UnsupportedStateError` (a ``TypeError``) naming the key: nothing in a checkpoint is ever
unpickled or executed. :func:`decode` takes untrusted JSON: a malformed tagged form raises
:class:`CorruptCheckpointError` naming the key.
"""

from __future__ import annotations

import math
from typing import Any

from vescale.checkpoint.errors import CorruptCheckpointError, UnsupportedStateError

_TAGS = ("__tuple__", "__dict__", "__float__")
_PLAIN = frozenset({str, int, bool, type(None)})  # exact types that encode as themselves


def _all_plain(items) -> bool:
    """Whether every item encodes as itself (lists of parameter ids, betas ...): no per-item recursion needed."""
    return all(type(v) in _PLAIN or (type(v) is float and math.isfinite(v)) for v in items)


def encode(value: Any, key: str) -> Any:
    """JSON-ready form of ``value``; ``key`` names it in errors."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value) if math.isfinite(value) else {"__float__": repr(float(value))}
    if isinstance(value, tuple):
        return {"__tuple__": list(value) if _all_plain(value) else [encode(v, f"{key}[{i}]")
                                                                    for i, v in enumerate(value)]}
    if isinstance(value, list):
        return list(value) if _all_plain(value) else [encode(v, f"{key}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and not any(k in _TAGS for k in value):
            return {k: encode(v, f"{key}.{k}") for k, v in value.items()}
        return {"__dict__": [[encode(k, key), encode(v, f"{key}.{k}")] for k, v in value.items()]}
    if type(value).__module__ == "numpy" and hasattr(value, "item") and getattr(value, "ndim", None) == 0:
        return encode(value.item(), key)  # numpy scalars (np.float64, np.int64, np.bool_)
    raise UnsupportedStateError(f"state value {key!r} of type {type(value).__name__} cannot be stored in a "
                                "checkpoint: use tensors, JSON-able values (str, int, float, bool, None, list, "
                                "tuple, dict) or objects with state_dict()/load_state_dict()")


def decode(value: Any, key: str = "") -> Any:
    """Inverse of :func:`encode`; ``key`` names the value in errors. A malformed tagged form (read from an untrusted
    file) raises :class:`CorruptCheckpointError` naming the key."""
    if isinstance(value, list):
        return [decode(v, f"{key}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        if len(value) == 1:
            (tag, inner), = value.items()
            if tag == "__tuple__":
                if not isinstance(inner, list):
                    raise _malformed(key, tag, "a list")
                return tuple(decode(v, f"{key}[{i}]") for i, v in enumerate(inner))
            if tag == "__dict__":
                if not isinstance(inner, list) or not all(isinstance(kv, list) and len(kv) == 2 for kv in inner):
                    raise _malformed(key, tag, "a list of [key, value] pairs")
                out = {}
                for k, v in inner:
                    k = _hashable(decode(k, key))
                    try:
                        hash(k)
                    except TypeError:
                        raise _malformed(key, tag, "hashable keys") from None
                    out[k] = decode(v, f"{key}.{k}")
                return out
            if tag == "__float__":
                if inner not in ("nan", "inf", "-inf"):
                    raise _malformed(key, tag, "'nan', 'inf' or '-inf'")
                return float(inner)
        return {k: decode(v, f"{key}.{k}") for k, v in value.items()}
    return value


def _malformed(key: str, tag: str, expected: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"checkpoint metadata: value {key!r} has a malformed {tag!r} form (expected "
                                  f"{expected})")


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, list) else key
