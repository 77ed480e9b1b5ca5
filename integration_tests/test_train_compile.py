"""``tools/train.py --compile`` trains as eager does: a tp=2 run with every block compiled gives one device's eager
first-step gradients and loss curve.

One cell, chosen because it holds both failures the flag had (stop 44): DTensors inside the compiled blocks (tp) and
the step on which train.py counted collectives (its counter is a dispatch mode, under which dynamo retraced the blocks
and failed). ``train.train`` runs in-process on pooled ranks, gpt-tiny, 3 steps, with ``compile_parallel``'s backend
set to ``aot_eager`` on the ranks: dynamo's capture and AOT autograd, where the failures were, without inductor's C++
build (minutes on a CPU; the flag's inductor runs were checked by hand on tp=2, dp=2 and one rank). fp32, compared
within fp tolerance (compiled graphs may reorder), as ``test_train_matrix.py`` compares meshes.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import train  # noqa: E402
from test_train_matrix import _assert_grads_match, _cfg, _grads, _losses  # noqa: E402

STEPS = 3


def _train_compiled_with(cfg, backend: str) -> dict:
    """``train.train(cfg)`` on this rank with ``compile_parallel``'s backend set to ``backend`` (build imports it from
    ``vescale.parallel`` when called)."""
    import functools

    import vescale.parallel as parallel

    original = parallel.compile_parallel
    parallel.compile_parallel = functools.partial(original, backend=backend)
    try:
        return train.train(cfg)
    finally:
        parallel.compile_parallel = original


def test_compiled_tp2_matches_one_device_eager(tmp_path, ranks):
    from dataclasses import replace

    runs = {}
    for name, world_size, mesh, compile_ in (("eager", 1, "dp=1", False), ("compiled", 2, "tp=2", True)):
        out = tmp_path / name
        cfg = replace(_cfg(mesh, out, grad_dump=str(out / "grads.safetensors"), compile=compile_), steps=STEPS)
        summaries = ranks(_train_compiled_with, world_size, cfg, "aot_eager")
        assert summaries[0]["spec"]["compile"] is compile_
        assert summaries[0]["collectives_one_step"] is None or not compile_  # (no counter under compile)
        runs[name] = (_losses(out), _grads(out))
    (got, got_grads), (want, want_grads) = runs["compiled"], runs["eager"]
    _assert_grads_match(got_grads, want_grads, "tp=2 --compile")
    assert len(got) == STEPS and got == pytest.approx(want, rel=1e-4), f"compiled {got} vs eager {want}"
