"""The zoo sweep (``vescale.plan.zoo``, ``tools/zoo.py``) in CI: unmodified Hugging Face causal LMs, planned by
``auto_plan`` (its defaults, and with ``sequence_parallel=True``; and, where the model has one, its own transformers TP
plan translated by ``vescale.plan.from_transformers_tp_plan``) and called the default way (``use_cache`` as
configured, ``labels=``), against one device on tp=2 and dp=2 x tp=2.

The whole sweep (every decoder-only architecture of the installed transformers, both meshes) takes far longer than
CI's budget on 2 cores, so CI runs a fixed sample: the architectures of the regressions this sweep was built for
(Llama with the default cache, GPT-NeoX's per-head fused qkv, Qwen3, OPT, Starcoder2, Llama-4's MoE whose dp x tp
gradients were wrong through a nested view, Mamba's sequence mixer) plus every eighth
architecture of transformers' own sorted list (the sample moves with transformers' list, it is not hand-picked).
``python tools/zoo.py`` runs all of it and writes the table into docs/zoo.md.

Asserted: no architecture gives a wrong result (``mismatch``), every outcome other than pass carries its reason, and
the regression architectures pass on both meshes under ``auto_plan``, with and without sequence parallelism.
"""

from __future__ import annotations

import pytest

REGRESSIONS = ["llama", "gpt_neox", "qwen3", "opt", "starcoder2", "llama4_text", "mamba"]


def _sample() -> list[tuple[str, str]]:
    from vescale.plan.zoo import zoo_architectures

    archs = zoo_architectures()[0]
    picked = {a for a, _ in archs[::8]} | set(REGRESSIONS)
    return [a for a in archs if a[0] in picked]


@pytest.mark.parametrize("mesh", [{"tp": 2}, {"dp": 2, "tp": 2}], ids=["tp2", "dp2xtp2"])
def test_zoo_sample_matches_single_device_or_refuses(mesh):
    pytest.importorskip("transformers")
    from vescale.plan.zoo import run_zoo, zoo_table

    results = run_zoo(mesh, _sample(), plans=("auto_plan", "auto_plan+sp", "transformers"))
    table = zoo_table(results)
    wrong = [r for r in results if r.result == "mismatch"]
    assert not wrong, f"wrong results (never acceptable):\n{table}"
    assert all(r.reason for r in results if r.result != "pass"), table
    for arch in REGRESSIONS:
        for plan in ("auto_plan", "auto_plan+sp"):
            (r,) = [r for r in results if r.arch == arch and r.plan == plan]
            assert r.result == "pass", f"{arch} ({plan}): {r.result}: {r.reason}\n{table}"
