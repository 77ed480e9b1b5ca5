"""The planner CLI (``python -m vescale.plan``) and the one-rank dry run, on small configs written by the test."""

from __future__ import annotations

import json
import math

import pytest
import torch

pytest.importorskip("transformers")

from vescale.plan import ParallelSpec, choose_parallelism  # noqa: E402
from vescale.plan.cli import EXIT_BAD_INPUT, EXIT_NOTHING_FITS, load_config, main, meta_model  # noqa: E402
from vescale.plan.dry_run import dry_run, meta_scalars  # noqa: E402

# tools/models.py's "llama" sizes (what tools/train.py trains on CPU ranks)
LLAMA = {"model_type": "llama", "vocab_size": 512, "hidden_size": 256, "intermediate_size": 704,
         "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 256,
         "tie_word_embeddings": False}
ARGS = ["--world-size", "8", "--memory-gb", "16", "--seq-len", "64", "--batch-size", "32", "--hardware", "h100"]


@pytest.fixture
def config_path(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA))
    return path


def test_json_spec_loads_and_checks(config_path, capsys):
    assert main([str(config_path), *ARGS, "--json"]) == 0
    spec = ParallelSpec.from_json(capsys.readouterr().out)
    spec.check(batch_size=32, seq_len=64)
    assert spec.world_size == 8 and spec.dtype == "bf16" and spec.tp_plan == "auto"
    # the same choice as the library call on the same model (the CLI adds no choosing of its own)
    with meta_scalars():
        report = choose_parallelism(meta_model(load_config(str(config_path))), 8, memory_budget_gb=16, batch_size=32,
                                    seq_len=64, param_bytes=2, act_bytes=2, microbatch_size=1,
                                    hw=__import__("vescale.plan.cli", fromlist=["HARDWARE"]).HARDWARE["h100"][0])
    assert spec.mesh == report.chosen.dims and spec.zero == report.chosen.zero_stage


def test_text_output_names_every_term(config_path, capsys):
    assert main([str(config_path.parent), *ARGS, "--fixed", "tp=2", "--alternatives", "2"]) == 0
    out = capsys.readouterr().out
    for term in ("parameters", "gradients", "optimizer state", "activations", "communication buffers", "compute",
                 "best alternatives", "why each lost"):
        assert term in out, term
    spec = ParallelSpec.from_json(out[out.index("{"):out.index("}\n") + 1])
    assert spec.size("tp") == 2
    assert out.count(" ZeRO ") >= 2  # the chosen line's mesh and the alternatives


def test_nothing_fits_exits_with_reasons(config_path, capsys):
    code = main([str(config_path), "--world-size", "2", "--memory-gb", "0.001", "--seq-len", "64",
                 "--batch-size", "4"])
    err = capsys.readouterr().err
    assert code == EXIT_NOTHING_FITS
    assert "nothing fits" in err and "0.001 GB" in err and "activations" in err


@pytest.mark.parametrize("argv, names", [
    (["/no/such/config.json", "--world-size", "8"], "/no/such/config.json"),
    (["not-a-model-type", "--world-size", "8"], "not-a-model-type"),
    (["{cfg}", "--world-size", "8", "--fixed", "xp=2"], "--fixed 'xp=2'"),
    (["{cfg}", "--world-size", "8", "--fixed", "tp=two"], "--fixed 'tp=two'"),
    (["{cfg}", "--world-size", "8", "--hardware", "a100"], "--hardware 'a100'"),
    (["{cfg}", "--world-size", "8", "--fixed", "tp=3"], "world size 8"),
])
def test_bad_input_exits_naming_it(config_path, capsys, argv, names):
    argv = [a.replace("{cfg}", str(config_path)) for a in argv]
    assert main(argv) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert names in err, err


def test_config_without_model_type_is_refused(tmp_path, capsys):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"hidden_size": 8}))
    assert main([str(path), "--world-size", "2"]) == EXIT_BAD_INPUT
    assert "model_type" in capsys.readouterr().err


# every head count divides tp=8: each linear and the embedding are cut in 8, the norms replicated
EVEN = {**LLAMA, "num_key_value_heads": 8}


def _global_bytes() -> tuple[int, int]:
    """(bytes of the linears and embeddings, bytes of the norms) of EVEN in fp32, from the plain model."""
    model = meta_model(load_config_from(EVEN), dtype="fp32")
    norms = sum(p.numel() for n, p in model.named_parameters() if "norm" in n) * 4
    total = sum(p.numel() for p in model.parameters()) * 4
    return total - norms, norms


def load_config_from(data: dict):
    import transformers

    data = dict(data)
    return transformers.AutoConfig.for_model(data.pop("model_type"), **data)


def test_dry_run_world_64_counts_bytes_and_collectives():
    """Rank 13 of dp=8 x tp=8 (ZeRO 1, fp32): exact bytes match what the plain model's shapes say it must hold."""
    spec = ParallelSpec(mesh={"dp": 8, "tp": 8}, zero=1)
    cfg = load_config_from(EVEN)
    report = dry_run(lambda: meta_model(cfg, attention="eager", dtype="fp32"), spec, world_size=64, rank=13,
                     batch_size=32, seq_len=64)
    assert report.ok, report.failed
    assert report.coordinate == {"dp": 1, "tp": 5}
    assert {"build", "shapes", "step"} <= set(report.checks)
    sharded, whole = _global_bytes()
    params = sharded // 8 + whole  # every linear and embedding cut in 8 over tp, norms replicated
    assert report.bytes["parameters"] == params
    assert params <= report.bytes["gradients"] <= params + 8 * 64 * 4 * 8  # one fp32 buffer (+ padding per dp)
    adam = 2 * params / 8  # exp_avg and exp_avg_sq of this rank's 1/8 (ZeRO 1); fp32 masters alias the parameters
    assert math.isclose(report.bytes["optimizer"], adam, rel_tol=0.02)
    per_dim = report.collectives["per_dim"]
    assert per_dim["tp"]["counts"].get("all_reduce", 0) > 0  # row-parallel outputs in forward, inputs' grads back
    assert sum(per_dim["dp"]["counts"].values()) > 0  # the gradient reduction and ZeRO 1's parameter gather
    assert not torch.distributed.is_initialized()


def test_dry_run_pipeline_rank():
    """The last rank of pp=2 x dp=4 x tp=8: its stage built, the schedule run on meta (the stage's captured input
    shapes stand in for the previous rank's header), and what could not be checked said."""
    spec = ParallelSpec(mesh={"pp": 2, "dp": 4, "tp": 8}, zero=1, microbatches=4)
    cfg = load_config_from(EVEN)
    report = dry_run(lambda: meta_model(cfg, attention="eager", dtype="fp32"), spec, world_size=64, rank=63,
                     batch_size=32, seq_len=64)
    assert report.ok, report.failed
    assert report.coordinate == {"pp": 1, "dp": 3, "tp": 7}
    assert {"schedule", "step"} <= set(report.checks) and "pipeline boundaries" in report.not_checked
    sharded, whole = _global_bytes()
    assert 0 < report.bytes["parameters"] < sharded // 8 + whole  # the second stage's shards only
    assert report.bytes["gradients"] >= report.bytes["parameters"]
    assert report.collectives["per_dim"]["tp"]["counts"].get("all_reduce", 0) > 0
    # no tied weight in this model: nothing is summed over pp (the fake group's gather once made every parameter
    # look held by every pp rank, and the step all-reduced all of the stage's gradients over pp)
    assert "all_reduce" not in report.collectives["per_dim"].get("pp", {}).get("counts", {})


def test_dry_run_refuses_a_spec_before_building():
    bad = ParallelSpec(mesh={"dp": 8, "tp": 8}, zero=1)
    cfg = load_config_from(EVEN)
    refused = dry_run(lambda: meta_model(cfg, attention="eager"), bad, world_size=64, batch_size=12, seq_len=64)
    assert not refused.ok and "batch_size 12" in refused.failed["spec"]
    assert not torch.distributed.is_initialized()
