"""A checkpoint is untrusted input: names that leave the directory, schema violations and oversized headers are
refused with a :class:`CorruptCheckpointError` naming the file and the field, before anything is read from them,
and the state loaded into stays bitwise as it was."""

from __future__ import annotations

import json
import os
import zlib

import pytest
import torch

from vescale import checkpoint
from vescale.checkpoint import CorruptCheckpointError

_FIELDS = ("offsets", "lengths", "file", "start", "end", "codec", "chunk", "crc32")


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Linear(4, 4)


def _saved(path, compress: bool = False) -> torch.nn.Module:
    model = _model(0)
    checkpoint.save(path, {"model": model, "step": 3, "sched": {"gamma": 0.5}}, compress=compress)
    return model


def _fresh() -> dict:
    return {"model": _model(1), "step": 0, "sched": {"gamma": 0.0}}


def _snapshot(state: dict) -> dict:
    return {"model": {k: v.clone() for k, v in state["model"].state_dict().items()}, "step": state["step"],
            "sched": dict(state["sched"])}


def _assert_unchanged(state: dict, before: dict) -> None:
    for k, v in state["model"].state_dict().items():
        assert torch.equal(v, before["model"][k]), k
    assert state["step"] == before["step"] and state["sched"] == before["sched"]


def _edit(path, fn) -> None:
    meta_file = os.path.join(path, "metadata.json")
    with open(meta_file) as f:
        meta = json.load(f)
    fn(meta)
    with open(meta_file, "w") as f:
        json.dump(meta, f)


def _refused(path, match: str) -> None:
    """``load`` and ``verify`` both raise naming ``match``; the state loaded into is unchanged."""
    state = _fresh()
    before = _snapshot(state)
    with pytest.raises(CorruptCheckpointError, match=match):
        checkpoint.load(path, state)
    _assert_unchanged(state, before)
    with pytest.raises(CorruptCheckpointError, match=match):
        checkpoint.verify(path)


def test_shard_file_escaping_the_checkpoint_is_refused(tmp_path):
    # the case: a shard's file edited to ../../etc/passwd with the crc32 of its first 16 bytes (anyone can
    # compute it); here that path leads to a decoy outside the checkpoint, which the reader must never open
    outside = tmp_path / "etc"
    outside.mkdir()
    secret = b"root:x:0:0:root:/root:/bin/bash\n"
    (outside / "passwd").write_bytes(secret)
    path = tmp_path / "jobs" / "ckpt"
    _saved(path)

    def escape(meta):
        shard = meta["tensors"]["model.bias"]["shards"][0]
        shard.update(file="../../etc/passwd", start=0, end=16, chunk=1 << 20, crc32=[zlib.crc32(secret[:16])])
        meta["files"]["../../etc/passwd"] = {"size": len(secret)}

    _edit(path, escape)
    assert os.path.exists(os.path.join(path, "../../etc/passwd"))  # the name does lead to the decoy
    _refused(path, r"metadata.json.*(files key '\.\./\.\./etc/passwd'|shards\[0\]\.file).*not a plain file name")


@pytest.mark.parametrize("name", ["/etc/passwd", "../x.safetensors", "sub/x.safetensors", "..", ".", "",
                                  "memory://other/x", "s3://bucket/x", "file:x", "x\\..\\y", "C:x", "x\x00y"])
def test_every_name_must_be_a_plain_child(tmp_path, name):
    path = tmp_path / "ckpt"
    _saved(path)

    def rename(meta):
        (real,) = meta["files"]
        meta["files"][name] = meta["files"].pop(real)
        for info in meta["tensors"].values():
            for shard in info["shards"]:
                shard["file"] = name

    _edit(path, rename)
    _refused(path, "not a plain file name")


def test_names_are_checked_on_fsspec_storage_too():
    path = "memory://vescale-untrusted/ckpt"
    _saved(path)
    from vescale.checkpoint._storage import Storage

    storage = Storage(path)
    meta = json.loads(storage.read_bytes("metadata.json", 1 << 20))
    storage.fs.pipe_file("/vescale-untrusted/secret", b"s" * 16)
    (real,) = meta["files"]
    meta["files"]["../secret"] = {"size": 16}
    for shard in meta["tensors"]["model.bias"]["shards"]:
        shard.update(file="../secret", start=0, end=16, crc32=[zlib.crc32(b"s" * 16)])
    storage.fs.pipe_file(storage.path("metadata.json"), json.dumps(meta).encode())
    _refused(path, r"shards\[0\]\.file|files key")
    with pytest.raises(CorruptCheckpointError, match="not a plain file name"):
        storage.path("../secret")


def test_links_and_special_files_are_not_followed(tmp_path):
    path = tmp_path / "ckpt"
    _saved(path)
    (data,) = [f for f in os.listdir(path) if f.endswith(".safetensors")]
    target = tmp_path / "elsewhere.safetensors"
    os.replace(path / data, target)
    os.symlink(target, path / data)
    _refused(path, "symbolic link|not a regular file")
    os.remove(path / data)
    os.mkfifo(path / data)  # a read would block forever on a FIFO nobody writes
    _refused(path, "not a regular file")


@pytest.mark.parametrize("field", _FIELDS)
def test_a_missing_shard_field_is_named(tmp_path, field):
    path = tmp_path / "ckpt"
    _saved(path)
    _edit(path, lambda meta: meta["tensors"]["model.weight"]["shards"][0].pop(field))
    _refused(path, rf"field tensors\['model.weight'\]\.shards\[0\]\.{field} is missing")


def _shard(meta, key="model.weight"):
    return meta["tensors"][key]["shards"][0]


def _second_shard(meta):
    """Split model.weight's one shard (4 x 4 float32) into two 2-row boxes over its bytes that overlap in row 1
    (rows 0-1 and 1-2: the volumes add up to the tensor's, row 3 is left out)."""
    a = _shard(meta)
    b = dict(a, offsets=[1, 0], lengths=[2, 4], start=a["start"] + 32)
    a.update(lengths=[2, 4], end=a["start"] + 32)
    meta["tensors"]["model.weight"]["shards"].append(b)


_VIOLATIONS = {
    "box past the shape": (lambda m: _shard(m).update(offsets=[1, 0]), r"box offset 1 \+ length 4 past the size 4"),
    "end past the file": (lambda m: _shard(m).update(end=10 ** 12), r"\.end is 1000000000000, past the recorded"),
    "negative start": (lambda m: _shard(m).update(start=-8), r"\.start is -8"),
    "start as bool": (lambda m: _shard(m).update(start=True), r"\.start is True"),
    "absurd shape": (lambda m: m["tensors"]["model.weight"].update(shape=[1 << 40, 1 << 40]), "more than the"),
    "unknown dtype": (lambda m: m["tensors"]["model.weight"].update(dtype="float128"), r"\.dtype is 'float128'"),
    "wrong checksum count": (lambda m: _shard(m).update(crc32=[1, 2]), r"\.crc32 is \[1, 2\], not a list of 1"),
    "checksum too big": (lambda m: _shard(m).update(crc32=[1 << 40]), r"\.crc32\[0\] is"),
    "chunk of zero": (lambda m: _shard(m).update(chunk=0), r"\.chunk is 0"),
    "unknown codec": (lambda m: _shard(m).update(codec="lz4"), r"\.codec is 'lz4'"),
    "raw bytes not the box": (lambda m: _shard(m).update(lengths=[2, 4]), "stores 64 bytes .* raw box of 32"),
    "overlapping boxes": (_second_shard, r"shards\[0\] and .*shards\[1\] of tensors\['model.weight'\] overlap"),
    "shards not tiling": (lambda m: m["tensors"]["model.weight"].update(shards=[]), "cover 0 of its 16"),
    "shared file bytes": (lambda m: _shard(m, "model.bias").update(start=_shard(m)["start"], end=_shard(m)["start"]
                                                                    + 16), "claim the same bytes"),
    "file not listed": (lambda m: m["files"].clear(), "which the files table lacks"),
    "malformed tuple value": (lambda m: m["values"].update(step={"__tuple__": 5}), r"value 'step' .*'__tuple__'"),
    "malformed float value": (lambda m: m["values"].update(step={"__float__": "1e999"}), r"'__float__'"),
    "unhashable dict key": (lambda m: m["values"].update(step={"__dict__": [[{"a": 1}, 2]]}), "hashable keys"),
    "version as string": (lambda m: m.update(version="2"), "format version '2'"),
    "shape not a list": (lambda m: m["tensors"]["model.weight"].update(shape="4x4"), r"\.shape is '4x4'"),
    "tensor not an object": (lambda m: m["tensors"].update({"model.weight": 7}), r"tensors\['model.weight'\] is 7"),
}


@pytest.mark.parametrize("case", sorted(_VIOLATIONS))
def test_schema_violations_are_named_before_anything_is_read(tmp_path, case):
    from vescale.checkpoint import _load

    path = tmp_path / "ckpt"
    _saved(path)
    edit, match = _VIOLATIONS[case]
    _edit(path, edit)
    read = _load.read_shard
    _load.read_shard = lambda *a, **k: (_ for _ in ()).throw(AssertionError("data read before the schema check"))
    try:
        _refused(path, match)
    finally:
        _load.read_shard = read


def test_header_sizes_are_capped(tmp_path, monkeypatch):
    from vescale.checkpoint import _reader

    path = tmp_path / "ckpt"
    _saved(path)
    monkeypatch.setattr(_reader, "MAX_METADATA_BYTES", 64)
    _refused(path, "metadata.json is larger than 64 bytes")
    monkeypatch.undo()
    checkpoint.load(path, _fresh())
    (data,) = [f for f in os.listdir(path) if f.endswith(".safetensors")]
    with open(path / data, "r+b") as f:  # a safetensors header claiming 2**60 bytes: refused, never allocated
        f.write((1 << 60).to_bytes(8, "little"))
    with pytest.raises(CorruptCheckpointError, match=f"{data}: safetensors header length {1 << 60} exceeds"):
        checkpoint.verify(path)
    checkpoint.load(path, _fresh())  # a load reads the byte ranges the metadata checksums, never the header


def test_a_header_that_misplaces_a_shard_fails_verify(tmp_path):
    path = tmp_path / "ckpt"
    _saved(path)
    (data,) = [f for f in os.listdir(path) if f.endswith(".safetensors")]
    raw = bytearray((path / data).read_bytes())
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    for entry in header.values():
        if isinstance(entry, dict) and "data_offsets" in entry and entry["data_offsets"][0] == 0:
            entry["data_offsets"] = [entry["data_offsets"][0] + 4, entry["data_offsets"][1] + 4]
    body = json.dumps(header, separators=(",", ":")).encode()
    assert len(body) <= n
    raw[8:8 + n] = body + b" " * (n - len(body))
    (path / data).write_bytes(bytes(raw))
    with pytest.raises(CorruptCheckpointError, match="header does not list the shard"):
        checkpoint.verify(path)


def test_zstd_expansion_is_bounded(tmp_path):
    path = tmp_path / "ckpt"
    model = _model(0)
    checkpoint.save(path, {"model": model, "step": 3, "sched": {"gamma": 0.5}, "zeros": torch.zeros(1 << 16)},
                    compress=True)
    state = {**_fresh(), "zeros": torch.ones(1 << 16)}
    checkpoint.load(path, state)
    assert torch.equal(state["zeros"], torch.zeros(1 << 16))
    assert torch.equal(state["model"].weight, model.weight)

    def inflate(meta):  # the same few compressed bytes claimed to hold a tensor of 2**40 elements
        info = meta["tensors"]["zeros"]
        info["shape"] = [1 << 40]
        info["shards"][0]["lengths"] = [1 << 40]

    _edit(path, inflate)
    with pytest.raises(CorruptCheckpointError, match="more than zstd can hold"):
        checkpoint.verify(path)


def test_hf_index_names_stay_inside_the_directory(tmp_path):
    from safetensors.torch import save_file

    outside = tmp_path / "outside.safetensors"
    save_file({"weight": torch.ones(4, 4), "bias": torch.ones(4)}, str(outside))
    src = tmp_path / "hf"
    src.mkdir()
    (src / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"weight": "../outside.safetensors", "bias": "../outside.safetensors"}}))
    model = _model(1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CorruptCheckpointError, match=r"weight_map\['weight'\] is '\.\./outside\.safetensors'"):
        checkpoint.import_hf(src, model)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
