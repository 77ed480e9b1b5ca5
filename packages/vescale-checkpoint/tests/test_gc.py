"""save and load hold Python's cyclic garbage collector off while they run and give it back as it was."""

from __future__ import annotations

import gc

import pytest
import torch

from vescale import checkpoint
from vescale.checkpoint._gc import collector_paused


class _Probe:
    """A stateful object recording whether the collector ran automatically when save/load reached it."""

    def __init__(self):
        self.seen = []

    def state_dict(self):
        self.seen.append(gc.isenabled())
        return {"x": torch.ones(3)}

    def load_state_dict(self, sd):
        self.seen.append(gc.isenabled())


def test_save_and_load_pause_the_collector(tmp_path):
    probe = _Probe()
    assert gc.isenabled()
    checkpoint.save(tmp_path / "c", {"probe": probe})
    checkpoint.load(tmp_path / "c", {"probe": probe})
    assert probe.seen and not any(probe.seen)
    assert gc.isenabled()
    gc.disable()
    try:
        checkpoint.load(tmp_path / "c", {"probe": probe})
        assert not gc.isenabled(), "a collector the caller had disabled was enabled"
    finally:
        gc.enable()


def test_collector_restored_after_an_error():
    @collector_paused
    def fails():
        assert not gc.isenabled()
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        fails()
    assert gc.isenabled()
