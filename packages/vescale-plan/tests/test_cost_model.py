"""The cost model against what vescale builds: ``estimate_spec`` (one spec priced, no search) agrees with the
planner's own candidate and with the dry run's exact bytes (gradients in ``reduce_dtype``: fp32 under bf16);
``--calibrate`` writes a hardware file the CLI takes; ``import vescale.plan`` is lazy."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

from vescale.plan import ParallelSpec, choose_parallelism, estimate_spec  # noqa: E402
from vescale.plan.cli import main, meta_model  # noqa: E402
from vescale.plan.dry_run import dry_run, meta_scalars  # noqa: E402

# tools/models.py's "llama" sizes; EVEN: every head count divides tp=4
LLAMA = {"model_type": "llama", "vocab_size": 512, "hidden_size": 256, "intermediate_size": 704,
         "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 256,
         "tie_word_embeddings": False}
EVEN = {**LLAMA, "num_key_value_heads": 8}


def load_config_from(data: dict):
    import transformers

    data = dict(data)
    return transformers.AutoConfig.for_model(data.pop("model_type"), **data)


@pytest.mark.parametrize("fixed, zero", [({"pp": 2, "tp": 2}, 0), ({"dp": 2, "tp": 2}, 1), ({"dp": 4}, 2)])
def test_estimate_spec_prices_a_spec_as_the_planner_prices_its_candidate(fixed, zero):
    model = meta_model(load_config_from(LLAMA), dtype="fp32")
    with meta_scalars():
        report = choose_parallelism(model, 4, batch_size=8, seq_len=32, fixed=fixed, zero_stages=(zero,))
    spec = report.spec()
    got = estimate_spec(model, spec, batch_size=8, seq_len=32)
    want = report.chosen
    assert got.dims == want.dims == fixed and got.zero_stage == zero
    for term in ("weights_gb", "grads_gb", "states_gb", "activations_gb", "tp_bytes", "dp_bytes", "pp_bytes",
                 "step_s", "memory_gb"):
        assert math.isclose(getattr(got, term), getattr(want, term), rel_tol=1e-9), term


@pytest.mark.parametrize("dtype, zero", [("bf16", 0), ("bf16", 1), ("fp32", 2)])
def test_estimated_bytes_are_the_dry_runs_exact_bytes(dtype, zero):
    """Rank 5 of dp=2 x tp=4: parameters, gradients (DDP's buffers in fp32 under bf16) and optimizer state (Adam's
    two states, fp32 masters under bf16, ZeRO's 1/dp) as estimated and as built, within 2 % (padding, the
    replicated norms the estimate shards by tp)."""
    spec = ParallelSpec(mesh={"dp": 2, "tp": 4}, zero=zero, dtype=dtype)
    cfg = load_config_from(EVEN)
    report = dry_run(lambda: meta_model(cfg, attention="eager", dtype=dtype), spec, world_size=8, rank=5,
                     batch_size=8, seq_len=32)
    assert report.ok, report.failed
    c = estimate_spec(meta_model(cfg, dtype=dtype), spec, batch_size=8, seq_len=32)
    for term, est in (("parameters", c.weights_gb), ("gradients", c.grads_gb), ("optimizer", c.states_gb)):
        assert est * 2**30 == pytest.approx(report.bytes[term], rel=0.02), term
    if dtype == "bf16":  # the planner once priced gradients in the parameters' dtype: half of what build keeps
        assert c.grads_gb == pytest.approx(2 * c.weights_gb, rel=1e-9)


def test_calibration_file_is_a_hardware_file(tmp_path, capsys):
    from vescale.core.testing import spawn_on_pool
    from vescale.plan.calibrate import calibrate

    path = tmp_path / "hw.json"
    with spawn_on_pool():
        wrote = calibrate(path, world_size=2, matmul_size=64, bandwidth_mb=0.25)
    data = json.loads(path.read_text())
    assert data == json.loads(json.dumps(wrote))
    assert data["device_tflops"] > 0 and data["collective_latency_s"] > 0 and data["memory_gb"] > 0
    assert data["dp_gbps"] == data["tp_gbps"] == data["calibration"]["groups"]["2"]["gbps"] > 0
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    assert main([str(tmp_path / "config.json"), "--world-size", "4", "--seq-len", "32", "--batch-size", "8",
                 "--hardware", str(path), "--json"]) == 0
    assert ParallelSpec.from_json(capsys.readouterr().out).world_size == 4


def test_package_import_is_lazy():
    """``import vescale.plan`` imports no submodule; a name loads its own module only; a submodule named like its
    function (``build``, ``dry_run``) imported first does not shadow the function."""
    code = """
import sys
import vescale.plan as p
first = sorted(m for m in sys.modules if m.startswith("vescale.plan."))
from vescale.plan import ParallelSpec
spec_only = sorted(m for m in sys.modules if m.startswith("vescale.plan."))
import vescale.plan.dry_run
from vescale.plan import dry_run, build
print(first, spec_only, callable(dry_run) and callable(build) and p.dry_run is dry_run, "torch" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split("\n")
    assert out[0] == "[] ['vescale.plan.spec'] True True", out
