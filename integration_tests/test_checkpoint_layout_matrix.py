"""The vescale rows of the checkpoint layout matrix (``tools/bench/checkpoint.py``): ``InterleavedShard`` on a
dp2 x tp2 mesh and ZeRO's flat ``RaggedShard`` pieces over 4 ranks, saved and loaded back bitwise into the same
layout, into each other's and torch's layouts on 4 ranks, onto 2 ranks, and into one process.

An integration test because vescale-checkpoint does not depend on vescale-dtensor. The reference is the global
tensors built in one process from a seed; each rank's expected local piece is what ``vescale.dtensor``'s
``distribute_tensor`` slices out of it (no checkpoint code involved). Item sizes 2, 4 and 8 (bfloat16, float32,
int64) and a small checksum chunk (several per shard) exercise the mapped local read path's strided copies.
"""

from __future__ import annotations

import os

import torch

from vescale import checkpoint
from vescale.core.testing import run_on_ranks


def _reference() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return {"qkv": torch.randn(12, 10, generator=g),  # rows divisible by interleaved_size x tp
            "up": torch.randn(8, 6, generator=g).bfloat16(),
            "ids": torch.randint(-2**40, 2**40, (16, 3), generator=g)}


def _layout(row: str):
    """(mesh dims, placements for a tensor, whether tensors are flattened) of a matrix row."""
    from torch.distributed.tensor import Replicate, Shard

    from vescale.dtensor import InterleavedShard, RaggedShard

    return {"interleaved": ({"dp": 2, "tp": 2}, [Replicate(), InterleavedShard(0, 2)], False),
            "zero_ragged": ({"dp": 4}, [RaggedShard((0,), (3, 1, 0, 4))], True),  # one rank holds nothing
            "block2d": ({"dp": 2, "tp": 2}, [Shard(0), Shard(1)], False),
            "flat_rows": ({"dp": 4}, [Shard(0)], True),
            "two_ranks_columns": ({"dp": 2}, [Shard(1)], False),
            "two_ranks_flat": ({"dp": 2}, [RaggedShard((0,), (1, 3))], True)}[row]


def _state(row: str, fill: str) -> dict:
    from vescale.core.mesh import init_mesh
    from vescale.dtensor import distribute_tensor

    dims, placements, flat = _layout(row)
    mesh = init_mesh(dims)
    out = {}
    for key, full in _reference().items():
        src = full if fill == "ref" else torch.zeros_like(full)
        out[key] = distribute_tensor(src.reshape(-1) if flat else src, mesh, placements, src_data_rank=None)
    return out


def _check(state: dict, row: str, what) -> None:
    """Local pieces bitwise equal to the reference's (the shape of a flat row's tensors aside: the checkpoint
    stores the shape saved, so a flat row's checkpoint loads only into flat tensors and vice versa)."""
    expected = _state(row, "ref")
    for key, t in state.items():
        assert torch.equal(t.to_local(), expected[key].to_local()), (what, key)


def _save_and_load_on_4(root: str) -> None:
    from vescale.checkpoint import _data_file

    chunk = _data_file.CHUNK_BYTES
    _data_file.CHUNK_BYTES = 64  # several checksum chunks per shard (pooled ranks: restored below)
    try:
        for row in ("interleaved", "zero_ragged"):
            checkpoint.save(os.path.join(root, row), _state(row, "ref"))
    finally:
        _data_file.CHUNK_BYTES = chunk
    for saved, targets in (("interleaved", ("interleaved", "block2d")), ("zero_ragged", ("zero_ragged", "flat_rows"))):
        for row in targets:
            state = _state(row, "zeros")
            checkpoint.load(os.path.join(root, saved), state)
            _check(state, row, (saved, row))


def _load_on_2(root: str) -> None:
    for saved, row in (("interleaved", "two_ranks_columns"), ("zero_ragged", "two_ranks_flat")):
        state = _state(row, "zeros")
        checkpoint.load(os.path.join(root, saved), state)
        _check(state, row, (saved, row))


def test_vescale_layout_rows_round_trip_and_reshard_bitwise(tmp_path):
    root = str(tmp_path)
    run_on_ranks(_save_and_load_on_4, 4, root)
    run_on_ranks(_load_on_2, 2, root)
    ref = _reference()
    for row, flat in (("interleaved", False), ("zero_ragged", True)):  # one process, plain tensors
        state = {k: torch.zeros_like(v.reshape(-1) if flat else v) for k, v in ref.items()}
        checkpoint.load(os.path.join(root, row), state)
        for key, value in ref.items():
            assert torch.equal(state[key], value.reshape(-1) if flat else value), (row, key)
