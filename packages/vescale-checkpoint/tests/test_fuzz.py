"""Fuzzing the untrusted parts of a checkpoint: ``metadata.json`` and the safetensors headers of its data files.

Whatever the mutation, ``load`` and ``verify`` either succeed or raise a :class:`CheckpointError` subclass; they
never raise anything else, never open a file outside the checkpoint directory (an audit hook records every open),
and a load that fails leaves the state bitwise as it was. A few hundred examples in all, single process.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import zlib

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vescale import checkpoint
from vescale.checkpoint import CheckpointError

_opened: list[str] | None = None  # paths opened while a fuzzed call runs


def _audit(event: str, args: tuple) -> None:
    if _opened is not None and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        _opened.append(os.fsdecode(args[0]))


sys.addaudithook(_audit)  # audit hooks cannot be removed; this one records only while _opened is a list

_BASE = tempfile.mkdtemp(prefix="vescale-fuzz-")
_SECRET = b"root:x:0:0:root:/root:/bin/bash\n" * 4
os.makedirs(os.path.join(_BASE, "etc"))
with open(os.path.join(_BASE, "etc", "passwd"), "wb") as _f:
    _f.write(_SECRET)
_NASTY_NAMES = ["../../etc/passwd", "../etc/passwd", os.path.join(_BASE, "etc", "passwd"), "/etc/passwd", "..",
                "file://" + os.path.join(_BASE, "etc", "passwd"), "etc/passwd", "", ".", "a/../../etc/passwd"]


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(6, 4, generator=g), "b": torch.randn(5, generator=g).half(),
            "z": torch.zeros(3000) + seed, "step": seed, "meta": {"lrs": (0.1, 0.01), "inf": float("inf")}}


def _pristine(compress: bool) -> str:
    path = os.path.join(_BASE, f"pristine-{int(compress)}", "ckpt")
    if not os.path.exists(os.path.join(path, "metadata.json")):
        checkpoint.save(path, _state(0), compress=compress)
    return path


def _copy(compress: bool) -> str:
    work = os.path.join(_BASE, "work", "ckpt")
    shutil.rmtree(os.path.dirname(work), ignore_errors=True)
    shutil.copytree(_pristine(compress), work)
    return work


def _check_calls(path: str) -> None:
    """Run ``load`` and ``verify``; only CheckpointErrors, no open outside ``path``, a failed load changes nothing."""
    global _opened
    state = _state(1)
    before = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    root = os.path.realpath(path)
    _opened = []
    try:
        try:
            checkpoint.load(path, state)
        except CheckpointError:
            for k, v in before.items():
                assert torch.equal(state[k], v) if isinstance(v, torch.Tensor) else state[k] == v, k
        try:
            checkpoint.verify(path)
        except CheckpointError:
            pass
        opened = list(_opened)
    finally:
        _opened = None
    for p in opened:
        real = os.path.realpath(p if os.path.isabs(p) else os.path.join(os.getcwd(), p))
        inside = real == root or real.startswith(root + os.sep)
        assert inside or not (real.startswith(os.path.realpath(_BASE)) or real.startswith("/etc/")), p


_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2 ** 70), 2 ** 70) | st.sampled_from([0, 1, -1, 2 ** 32, 2 ** 62])
    | st.floats(allow_nan=True) | st.text(max_size=8) | st.sampled_from(_NASTY_NAMES),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=8)


def _nodes(obj, path=()):
    """Every (path, container, key) in a JSON tree."""
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for k, v in items:
        yield path + (k,), obj, k
        yield from _nodes(v, path + (k,))


@settings(max_examples=150, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(compress=st.booleans(), edits=st.lists(st.tuples(st.integers(0, 10 ** 6), st.sampled_from(
    ["replace", "delete", "nasty_file", "number"]), _json), min_size=1, max_size=3))
def test_fuzzed_metadata_raises_only_checkpoint_errors(compress, edits):
    path = _copy(compress)
    meta_file = os.path.join(path, "metadata.json")
    with open(meta_file) as f:
        meta = json.load(f)
    for pick, how, value in edits:
        nodes = list(_nodes(meta))
        _, parent, key = nodes[pick % len(nodes)]
        if how == "delete":
            del parent[key]
        elif how == "nasty_file":  # make a shard point outside with checksums of what it would read there
            shard = next((n[1] for n in nodes if n[2] == "file" and isinstance(n[1], dict)), None)
            if shard is not None:
                shard.update(file=value if isinstance(value, str) and value else _NASTY_NAMES[pick % 10],
                             start=0, end=16, chunk=16, crc32=[zlib.crc32(_SECRET[:16])])
        elif how == "number" and isinstance(parent[key], int) and not isinstance(parent[key], bool):
            parent[key] += (pick % 7) - 3
        else:
            parent[key] = value
    with open(meta_file, "w") as f:
        json.dump(meta, f)
    _check_calls(path)


@settings(max_examples=100, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(compress=st.booleans(), how=st.sampled_from(["length", "bytes", "json", "data"]),
       at=st.integers(0, 10 ** 6), blob=st.binary(min_size=1, max_size=16), value=_json,
       length=st.integers(0, 2 ** 64 - 1))
def test_fuzzed_safetensors_headers_raise_only_checkpoint_errors(compress, how, at, blob, value, length):
    path = _copy(compress)
    (name,) = [f for f in os.listdir(path) if f.endswith(".safetensors")]
    file = os.path.join(path, name)
    with open(file, "rb") as f:
        raw = bytearray(f.read())
    n = int.from_bytes(raw[:8], "little")
    if how == "length":  # any 8-byte header length, absurd ones included
        raw[:8] = length.to_bytes(8, "little")
    elif how == "bytes":  # bytes overwritten inside the header
        pos = 8 + at % n
        raw[pos:pos + len(blob)] = blob[:max(0, 8 + n - pos)]
    elif how == "json":  # any JSON in place of the header, padded or cut to its length
        body = json.dumps(value).encode()[:n]
        raw[8:8 + n] = body + b" " * (n - len(body))
    else:  # bytes overwritten anywhere in the file: the checksums must catch what the load reads
        pos = at % len(raw)
        raw[pos:pos + len(blob)] = blob[:len(raw) - pos]
    with open(file, "wb") as f:
        f.write(bytes(raw))
    _check_calls(path)
