"""The checkpoint group's JSON/bytes collectives: messages shorter and longer than one slot, of different sizes on
different ranks, arrive exactly (compared with the messages each rank built)."""

from __future__ import annotations

from vescale.core.testing import multi_rank


@multi_rank(world_sizes=[2])
def test_gather_and_broadcast_any_size():
    from vescale.checkpoint._comm import _SLOT, Comm

    comm = Comm()
    for n in (0, 10, _SLOT - 8, _SLOT - 7, 3 * _SLOT + 5):
        message = {"rank": comm.rank, "text": "x" * (n if comm.rank == 1 else n // 3)}
        assert comm.all_gather_json(message) == [{"rank": r, "text": "x" * (n if r == 1 else n // 3)}
                                                 for r in range(comm.world)], n
        for src in range(comm.world):
            payload = bytes([src + 1]) * n
            assert comm.broadcast_bytes(payload if comm.rank == src else None, src) == payload, (n, src)
