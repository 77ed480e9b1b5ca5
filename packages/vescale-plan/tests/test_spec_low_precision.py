"""ParallelSpec's low-precision fields (issue 39): ``optimizer_state_dtype`` and ``fp8`` are data, round-trip through
JSON, and their refusals name the field and the reason before anything is built (pure: no process group)."""

from __future__ import annotations

import pytest


def test_fields_round_trip_and_refusals():
    from vescale.plan import ParallelSpec

    spec = ParallelSpec(mesh={"dp": 2}, zero=3, optimizer_state_dtype="bf16", fp8="tensorwise")
    again = ParallelSpec.from_json(spec.to_json())
    assert (again.optimizer_state_dtype, again.fp8) == ("bf16", "tensorwise")
    assert ParallelSpec(optimizer_state_dtype="fp16").problems() == [
        "optimizer_state_dtype 'fp16' is not one of ['fp32', 'bf16']"]
    assert ParallelSpec(mesh={"tp": 2}, fp8="e4m3").problems() == [
        "fp8 recipe 'e4m3' is not one of ['tensorwise', 'rowwise']"]
    assert any("fp8 linears with pp=2" in p for p in ParallelSpec(mesh={"pp": 2}, fp8="tensorwise").problems())


def test_fp8_rowwise_with_tp_is_refused():
    pytest.importorskip("torchao")
    from vescale.plan import ParallelSpec

    problems = ParallelSpec(mesh={"dp": 2, "tp": 2}, fp8="rowwise").problems()
    assert len(problems) == 1 and "fp8 rowwise scaling with tp=2" in problems[0], problems
    assert ParallelSpec(mesh={"dp": 2, "tp": 2}, fp8="tensorwise").problems() == []
