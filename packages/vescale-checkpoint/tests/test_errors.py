"""Bad input and damaged checkpoints: every problem is named, on every rank, before any data is read."""

from __future__ import annotations

import os

import pytest
import torch

from vescale import checkpoint
from vescale.checkpoint import CheckpointNotFoundError, CorruptCheckpointError, StateMismatchError
from vescale.checkpoint.__main__ import main as cli
from vescale.core.testing import multi_rank


def _state(rank: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    state = {"w": torch.randn(4, 6, generator=g), "b": torch.randn(6, generator=g).half(), "step": 5,
             f"only_on_rank{rank}": torch.zeros(2)}
    return state


@multi_rank(world_sizes=[2])
def test_mismatches_listed_on_every_rank_before_reading(tmp_path):
    import torch.distributed as dist

    from vescale.checkpoint import _load

    rank = dist.get_rank()
    path = os.path.join(tmp_path, "ckpt")
    # a value only rank 1 cannot store: rank 1 names it, rank 0 is told, nobody hangs, nothing is written
    odd = {**_state(rank), "handle": object() if rank == 1 else 0}
    with pytest.raises(TypeError if rank == 1 else checkpoint.CheckpointError,
                       match="'handle' of type object" if rank == 1 else "another rank rejected"):
        checkpoint.save(path, odd)
    assert not os.path.exists(os.path.join(path, "metadata.json"))
    checkpoint.save(path, _state(rank))

    bad = {"w": torch.zeros(6, 4), "b": torch.zeros(6), "extra": 1, f"only_on_rank{rank}": torch.zeros(2)}
    if rank == 1:
        bad["only_rank1_wants_this"] = torch.zeros(3)
    read = _load.read_shard
    _load.read_shard = lambda *a, **k: (_ for _ in ()).throw(AssertionError("data read before the check"))
    try:
        with pytest.raises(StateMismatchError) as err:
            checkpoint.load(path, bad)
    finally:
        _load.read_shard = read
    text = str(err.value)
    for needle in ["shape mismatch: 'w' is [4, 6] in the checkpoint, [6, 4]", "dtype mismatch: 'b' is float16",
                   "missing: 'extra'", "missing: 'only_rank1_wants_this'", "unexpected: 'step'"]:
        assert needle in text, (needle, text)
    assert len(err.value.problems) == 5

    # strict=False: shape-mismatched keys skipped, dtype cast, the rest loaded and reported; read by every rank,
    # or read once and sent (the receiver of a cast tensor takes it into a temporary, then casts)
    for dedup in (False, True):
        loose = {"w": torch.zeros(6, 4), "b": torch.zeros(6), f"only_on_rank{rank}": torch.ones(2)}
        with pytest.warns(UserWarning, match="shape mismatch"):
            result = checkpoint.load(path, loose, strict=False, dedup_reads=dedup)
        assert result.mismatched == ["w"] and result.unexpected == ["step"]
        assert torch.equal(loose["b"], _state(rank)["b"].float())  # float16 -> float32 is exact
        assert torch.equal(loose[f"only_on_rank{rank}"], torch.zeros(2))

    # a damaged byte makes every rank fail, naming the file
    dist.barrier()
    data = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if rank == 0:
        with open(os.path.join(path, data[0]), "r+b") as f:
            f.seek(-3, os.SEEK_END)
            byte = f.read(1)
            f.seek(-3, os.SEEK_END)
            f.write(bytes([byte[0] ^ 0xFF]))
    dist.barrier()
    for dedup in (True, False):  # one reader that sends, or every rank reading
        with pytest.raises(CorruptCheckpointError, match=data[0]):
            checkpoint.load(path, _state(rank, seed=1), dedup_reads=dedup)


def test_verify_names_damaged_and_truncated_files(tmp_path, capsys):
    path = tmp_path / "ckpt"
    state = _state(0)
    checkpoint.save(path, state, compress=True)
    assert checkpoint.verify(path)["tensors"] == 3
    assert cli(["verify", str(path)]) == 0
    name = next(f for f in os.listdir(path) if f.endswith(".safetensors"))
    file = path / name
    raw = bytearray(file.read_bytes())
    raw[-5] ^= 0x01
    file.write_bytes(bytes(raw))
    with pytest.raises(CorruptCheckpointError, match=f"{name} is damaged: checksum mismatch"):
        checkpoint.verify(path)
    assert checkpoint.verify(path, checksums=False)["tensors"] == 3  # reads no data: the damage is not seen
    assert cli(["verify", str(path)]) == 1
    assert name in capsys.readouterr().err
    with pytest.raises(CorruptCheckpointError, match=name):
        checkpoint.load(path, _state(0, seed=1))
    file.write_bytes(bytes(raw[:-40]))
    for checksums in (True, False):  # a size is seen without reading data
        with pytest.raises(CorruptCheckpointError, match=f"{name} is .* bytes, expected"):
            checkpoint.verify(path, checksums=checksums)
    with pytest.raises(CorruptCheckpointError, match=f"{name} is truncated"):
        checkpoint.load(path, _state(0, seed=1))
    os.remove(file)
    with pytest.raises(CorruptCheckpointError, match=f"{name} is missing"):
        checkpoint.load(path, _state(0, seed=1))


def test_failed_save_stays_invisible_and_keeps_the_previous_checkpoint(tmp_path):
    from vescale.checkpoint import _storage

    path = tmp_path / "ckpt"
    old = _state(0)
    checkpoint.save(path, old)
    write = _storage.Storage.write_file

    def broken(self, name, header, pieces, pool):
        write(self, name, header, pieces[:1], pool)  # a partial file, then the disk "fails"
        raise OSError("disk full")

    _storage.Storage.write_file = broken
    try:
        with pytest.raises(checkpoint.CheckpointError, match="disk full"):
            checkpoint.save(path, _state(0, seed=7))
        with pytest.raises(checkpoint.CheckpointError, match="disk full"):
            checkpoint.save(tmp_path / "new", _state(0, seed=7))
    finally:
        _storage.Storage.write_file = write
    with pytest.raises(CheckpointNotFoundError, match="no complete checkpoint"):
        checkpoint.load(tmp_path / "new", _state(0, seed=1))
    fresh = _state(0, seed=1)
    checkpoint.load(path, fresh)
    assert all(torch.equal(fresh[k], old[k]) for k in ("w", "b")) and fresh["step"] == 5
    checkpoint.verify(path)


def test_everything_raised_on_purpose_is_a_checkpoint_error(tmp_path):
    from vescale.checkpoint import UnsupportedStateError

    cases = [
        ({"handle": object()}, "'handle' of type object"),                      # a value the format cannot store
        ({"z": torch.zeros(2, dtype=torch.complex128)}, "'z' has dtype"),       # a dtype the format lacks
        ({"a": {"b": torch.zeros(1)}, "a.b": torch.zeros(1)}, "same key 'a.b'"),  # two entries, one key
    ]
    for state, match in cases:
        with pytest.raises(UnsupportedStateError, match=match) as err:
            checkpoint.save(tmp_path / "ckpt", state)
        # still the built-ins callers caught before
        assert isinstance(err.value, checkpoint.CheckpointError) and isinstance(err.value, (TypeError, ValueError))
    with pytest.raises(UnsupportedStateError, match="state must be a dict"):
        checkpoint.save(tmp_path / "ckpt", [torch.zeros(2)])
    checkpoint.save(tmp_path / "ckpt", {"pair": (torch.zeros(2), 5)})
    state = {"pair": (torch.ones(2), 6)}  # a tuple cannot take the saved 5
    with pytest.raises(UnsupportedStateError, match=r"cannot assign 'pair\.1' inside a tuple"):
        checkpoint.load(tmp_path / "ckpt", state)
    assert torch.equal(state["pair"][0], torch.ones(2))  # checked before anything was written
