"""The layout matrix of ``tools/bench/checkpoint.py`` as correctness tests: every torch layout row saved from a
dp2 x tp2 mesh and loaded back bitwise, into the same layout, into another layout on the same ranks, onto 2 ranks
(column blocks and uneven row blocks) and into one process.

The reference is the global tensors built in one process from a seed; each rank's expected local shard is what
torch's ``distribute_tensor`` slices out of it (no checkpoint code involved). Dtypes of item sizes 1, 2, 4 and 8
(bool, bfloat16, float32, int64) cover every copy the local read paths make, and a small checksum chunk gives every
shard several chunks. The resharded loads on 4 ranks also run with the mapped path off (``VESCALE_CHECKPOINT_MMAP=0``:
strided parts streamed a few rows at a time), and every load also runs in one pass (``atomic=False``: each chunk
checked as it is filled), on fewer ranks also with one reader sending to the others (``dedup_reads=True``).
vescale's own layouts (``InterleavedShard``, ``RaggedShard``) are in
``integration_tests/test_checkpoint_layout_matrix.py``.
"""

from __future__ import annotations

import os

import torch

from vescale import checkpoint
from vescale.core.testing import run_on_ranks

#: the torch rows of the bench's matrix (``mixed``: tensor i takes the i-th of these, cyclically)
ROWS = ["replicated", "row", "column", "block2d", "fsdp_tp", "mixed"]
_PLAIN = ROWS[:5]


def reference() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {"f32": torch.randn(13, 40, generator=g),  # 13 rows: uneven over 2 and 4
            "bf16": torch.randn(8, 6, generator=g).bfloat16(),
            "i64": torch.randint(-2**40, 2**40, (10, 7), generator=g),
            "bool": torch.rand(9, 5, generator=g) > 0.5,
            "wide": torch.randn(4, 300, generator=g)}


def placements(row: str, i: int) -> list:
    from torch.distributed.tensor import Replicate, Shard

    if row == "mixed":
        row = _PLAIN[i % len(_PLAIN)]
    return {"replicated": [Replicate(), Replicate()], "row": [Replicate(), Shard(0)],
            "column": [Replicate(), Shard(1)], "block2d": [Shard(0), Shard(1)],
            "fsdp_tp": [Shard(0), Shard(0)]}[row]


def _on_mesh(mesh, layout_of, fill: str) -> dict:
    """The reference (``fill="ref"``) or zeros, each tensor laid out as ``layout_of(i)`` says, sliced locally."""
    from torch.distributed.tensor import distribute_tensor

    out = {}
    for i, (key, full) in enumerate(reference().items()):
        src = full if fill == "ref" else torch.zeros_like(full)
        out[key] = distribute_tensor(src, mesh, layout_of(i), src_data_rank=None)
    return out


def _assert_local_equal(state: dict, expected: dict, what: str) -> None:
    for key, t in state.items():
        got, want = t.to_local(), expected[key].to_local()
        assert got.dtype == want.dtype and torch.equal(got, want), (what, key)


def _save_and_load_on_4(root: str) -> None:
    from vescale.checkpoint import _data_file, _local_read

    chunk, piece = _data_file.CHUNK_BYTES, _local_read._PIECE_BYTES
    _data_file.CHUNK_BYTES = 64  # several checksum chunks per shard (pooled ranks: restored below)
    _local_read._PIECE_BYTES = 100  # parts streamed in pieces of a few rows: pieces end inside parts
    try:
        _save_and_load_rows(root)
    finally:
        _data_file.CHUNK_BYTES, _local_read._PIECE_BYTES = chunk, piece


def _save_and_load_rows(root: str) -> None:
    from vescale.core.mesh import init_mesh

    mesh = init_mesh({"dp": 2, "tp": 2})
    for row in ROWS:
        checkpoint.save(os.path.join(root, row), _on_mesh(mesh, lambda i, r=row: placements(r, i), "ref"))
    for k, row in enumerate(ROWS):
        path = os.path.join(root, row)
        same = lambda i, r=row: placements(r, i)  # noqa: E731
        expected = _on_mesh(mesh, same, "ref")
        for atomic in (True, False):  # check, agree, fill; or checked as it fills (one pass)
            state = _on_mesh(mesh, same, "zeros")
            checkpoint.load(path, state, atomic=atomic)
            _assert_local_equal(state, expected, (row, "same layout", atomic))
        next_row = ROWS[(k + 1) % len(ROWS)]
        other = lambda i, r=next_row: placements(r, i + 1)  # noqa: E731 - another row's layout, shifted
        # strided parts copied out of a mapping, then streamed; atomic, then in one pass
        for mapped, atomic in (("1", True), ("0", True), ("1", False), ("0", False)):
            os.environ["VESCALE_CHECKPOINT_MMAP"] = mapped
            try:
                state = _on_mesh(mesh, other, "zeros")
                checkpoint.load(path, state, atomic=atomic)
            finally:
                del os.environ["VESCALE_CHECKPOINT_MMAP"]
            _assert_local_equal(state, _on_mesh(mesh, other, "ref"), (row, "resharded on 4 ranks", mapped, atomic))


def _load_on_fewer(root: str) -> None:
    """Each row's checkpoint onto this world's 1-D mesh: column blocks (``Shard(1)``) and row blocks (uneven for
    the 13-row tensor: 7 and 6)."""
    import torch.distributed as dist
    from torch.distributed.tensor import Shard

    from vescale.core.mesh import init_mesh

    mesh = init_mesh({"dp": dist.get_world_size()})
    for row in ROWS:
        for dim in (1, 0):
            layout = lambda i, d=dim: [Shard(d)]  # noqa: E731
            # atomic; in one pass, every rank reading (local) or one reader sending to the others (dedup)
            for atomic, dedup in ((True, None), (False, None), (False, True)):
                state = _on_mesh(mesh, layout, "zeros")
                checkpoint.load(os.path.join(root, row), state, atomic=atomic, dedup_reads=dedup)
                _assert_local_equal(state, _on_mesh(mesh, layout, "ref"), (row, dist.get_world_size(), dim, atomic,
                                                                           dedup))


def test_layout_matrix_round_trips_and_reshards_bitwise(tmp_path):
    root = str(tmp_path)
    run_on_ranks(_save_and_load_on_4, 4, root)
    run_on_ranks(_load_on_fewer, 2, root)
    ref = reference()
    for row in ROWS:  # one process, plain tensors
        state = {k: torch.zeros_like(v) for k, v in ref.items()}
        checkpoint.load(os.path.join(root, row), state)
        for key, value in ref.items():
            assert torch.equal(state[key], value), (row, key)
