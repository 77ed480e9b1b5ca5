"""The main job over the mesh matrix: loss curves and every parameter's first-step gradient equal the single-device
run (also with --grad-accum); resume on another mesh continues it; deferred init gives every mesh bitwise the
single-device init and materialises only each rank's part.

``tools/train.py`` is run in-process on pooled ranks (its ``train`` function, not a subprocess), on the tiny model,
for a few steps. The reference is the same job on one rank (for the --dtype bf16 cells the same bf16 job on one rank).
fp32 unless said; the parallel runs reduce in a different order than one device, so curves are compared with a
tolerance (stated per assertion), not bitwise; the init is compared bitwise.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from vescale.core.mesh import parse_mesh_spec

ROOT = Path(__file__).resolve().parents[1]

sys.path.insert(0, str(ROOT / "tools"))  # tools/train.py imports by name, as do config, models, data, report
import train  # noqa: E402

STEPS = 6
MESHES = [
    (2, "dp=2"), (2, "tp=2"), (2, "pp=2"),
    (4, "dp=2,tp=2"), (4, "pp=2,dp=2"), (4, "pp=2,tp=2"),
    (8, "pp=2,dp=2,tp=2"),
]


def _cfg(mesh: str, out: Path, model: str = "gpt-tiny", **kw) -> train.TrainConfig:
    kw.setdefault("data", "markov")  # the synthetic corpus: learnable by the tiny model, no tokenizer
    kw.setdefault("microbatches", 4)
    cfg = train.TrainConfig(mesh=mesh, model=model, steps=STEPS, batch_size=8, seq_len=16, lr=3e-3, warmup=2,
                            out=str(out), trace_steps=0, quiet=True, **kw)
    cfg.dims = parse_mesh_spec(mesh)
    return cfg


def _losses(out: Path) -> list[float]:
    import json

    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def _grads(out: Path) -> dict[str, torch.Tensor]:
    """The first step's gradients a run dumped (``--grad-dump``, see ``_run``), by parameter FQN."""
    from safetensors.torch import load_file

    return load_file(str(out / "grads.safetensors"))


# A gradient element is a sum over the batch's 8 x 16 = 128 token positions (and, inside the matmuls, over widths of
# up to 4 x d_model), which a parallel run adds up in another order (dp halves, microbatches, tp partial sums) after
# a forward that itself differs by reassociation in every layer. fp32 rounds each addition by at most u = 2**-24 =
# 6e-8 relative, so n = 128 reordered terms stay within about n * u = 7.6e-6 of the largest magnitude involved:
# the bound is 1e-5 x the parameter's largest gradient element. Measured on every cell: at most 7e-7 of it.
GRAD_TOL = 1e-5


def _assert_grads_match(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    """Every parameter's whole first-step gradient equals one device's within ``GRAD_TOL`` x its largest element.

    Why this catches a constant scale that the loss curves hide (AdamW divides the gradient by its own magnitude, and
    clipping rescales it anyway): a gradient ``c x g`` (a dp sum instead of a mean: c = dp; a missing 1/M over M
    microbatches or grad-accum steps: c = M; a partial reduced twice: c = 2; a mean taken twice: c = 1/dp) misses
    at its largest element by ``|c - 1| x max|g| >= max|g| / 2``, 50000 times the bound. A per-parameter check also
    catches a scale on one parameter only (e.g. a replicated norm weight whose tp partial sums were not reduced).
    """
    assert set(got) == set(want), f"{what}: FQNs differ: {sorted(set(got) ^ set(want))}"
    for name, ref in want.items():
        largest = ref.abs().max()
        err, bound = (got[name] - ref).abs().max(), GRAD_TOL * largest
        assert err <= bound, (f"{what}: gradient of {name} is off by {err:.3g} (bound {bound:.3g} = {GRAD_TOL} x its "
                              f"largest element {largest:.3g}); norm ratio to one device "
                              f"{float(got[name].norm() / ref.norm()):.6g}")


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The single-device run: its loss per step and its first step's gradients."""
    return _single_device(tmp_path_factory, "gpt-tiny")


def _single_device(tmp_path_factory, model: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    """train.py on one rank (``dp=1``) with ``model``: its loss per step and its first step's gradients."""
    from vescale.core.testing import run_on_ranks

    out = tmp_path_factory.mktemp(f"ref-{model}")
    run_on_ranks(train.train, 1, _cfg("dp=1", out, model=model, grad_dump=str(out / "grads.safetensors")))
    return _losses(out), _grads(out)


@pytest.fixture(scope="module")
def reference(reference_run) -> list[float]:
    return reference_run[0]


def _check_run(world_size: int, mesh: str, reference_run, tmp_path: Path, ranks, **kw) -> None:
    """Train on ``mesh`` (``kw``: more settings); its first step's gradients and loss curve equal one device's."""
    ranks(train.train, world_size, _cfg(mesh, tmp_path, grad_dump=str(tmp_path / "grads.safetensors"), **kw))
    what = f"{mesh} {kw}" if kw else mesh
    _assert_grads_match(_grads(tmp_path), reference_run[1], what)
    got, reference = _losses(tmp_path), reference_run[0]
    assert len(got) == STEPS
    assert got[-1] < got[0]  # it learns
    # fp32, different reduction order than one device: rtol 1e-4 per step.
    assert got == pytest.approx(reference, rel=1e-4), f"{what}: {got} vs single device {reference}"


@pytest.mark.parametrize("world_size,mesh", MESHES, ids=[f"ws{w}-{m.replace(',', 'x').replace('=', '')}"
                                                          for w, m in MESHES])
def test_loss_curve_matches_single_device(world_size, mesh, reference_run, tmp_path, ranks):
    _check_run(world_size, mesh, reference_run, tmp_path, ranks)


# Gradient accumulation: the same global batch of 8 in 2 micro-steps, dp gradients reduced once, against the
# one-device run without accumulation. ZeRO-2 on dp x tp also covers DTensor gradients accumulated in the buffer.
ACCUM = [(2, "dp=2", {"grad_accum": 2}), (4, "dp=2,tp=2", {"grad_accum": 2, "zero": 2})]


@pytest.mark.parametrize("world_size,mesh,kw", ACCUM, ids=[f"ws{w}-{m.replace(',', 'x').replace('=', '')}-"
                                                          + "-".join(f"{k}{v}" for k, v in kw.items())
                                                          for w, m, kw in ACCUM])
def test_grad_accum_matches_single_device(world_size, mesh, kw, reference_run, tmp_path, ranks):
    _check_run(world_size, mesh, reference_run, tmp_path, ranks, **kw)


# Pipelines: every pp x dp cell (above too) runs each stage in its own DDP (one bucketed dp reduction, overlapped
# with the last microbatch's backward); here ZeRO 1/2 over the stages (DistributedOptimizer(pp_group=)), and
# --grad-accum 2 as one engine step over twice the microbatches (2 x 2 of one row per dp rank). The 8-rank cells are
# the suite's most expensive: ZeRO 2 on pp x dp x tp, and the done-when composition (without bf16), which
# also covers ZeRO 1 on pp x dp x tp, full activation checkpointing of the stages and grad accumulation with tp.
PIPELINES = [
    (4, "pp=2,dp=2", {"grad_accum": 2, "microbatches": 2}),
    (8, "pp=2,dp=2,tp=2", {"zero": 2}),
    (8, "pp=2,dp=2,tp=2", {"zero": 1, "activation_checkpointing": "full", "grad_accum": 2, "microbatches": 2}),
]


@pytest.mark.parametrize("world_size,mesh,kw", PIPELINES, ids=[f"ws{w}-{m.replace(',', 'x').replace('=', '')}-"
                                                              + "-".join(f"{k}{v}" for k, v in kw.items())
                                                              for w, m, kw in PIPELINES])
def test_pipeline_compositions_match_single_device(world_size, mesh, kw, reference_run, tmp_path, ranks):
    _check_run(world_size, mesh, reference_run, tmp_path, ranks, **kw)


CONTEXT_PARALLEL = [(2, "cp=2"), (4, "dp=2,cp=2"), (4, "cp=2,tp=2")]


@pytest.fixture(scope="module")
def llama_reference_run(tmp_path_factory) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The single-device run of the unmodified HF Llama (context parallelism takes transformers models)."""
    return _single_device(tmp_path_factory, "llama")


@pytest.mark.parametrize("world_size,mesh", CONTEXT_PARALLEL,
                         ids=[f"ws{w}-{m.replace(',', 'x').replace('=', '')}" for w, m in CONTEXT_PARALLEL])
def test_context_parallel_matches_single_device(world_size, mesh, llama_reference_run, tmp_path, ranks):
    """Sequences sharded over cp (each rank a head and a tail chunk of every row), gradients averaged over dp x cp:
    the first step's gradients and the loss curve of one device."""
    _check_run(world_size, mesh, llama_reference_run, tmp_path, ranks, model="llama")


# Expert parallelism composed with vescale DDP: Mixtral's experts over ep, the dense parameters' gradients reduced
# over dp x ep and the experts' over dp, bucketed (DistributedDataParallel(data_dims=("ep",))); ZeRO 2 shards each
# group of buckets over its own ranks. Against the one-device Mixtral run (train.py's loss: no load-balancing term).
EXPERT_PARALLEL = [(4, "dp=2,ep=2", {}), (4, "dp=2,ep=2", {"zero": 2})]


@pytest.fixture(scope="module")
def mixtral_reference_run(tmp_path_factory) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The single-device run of the unmodified HF Mixtral."""
    return _single_device(tmp_path_factory, "mixtral")


@pytest.mark.parametrize("world_size,mesh,kw", EXPERT_PARALLEL,
                         ids=[f"ws{w}-{m.replace(',', 'x').replace('=', '')}-"
                              + "-".join(f"{k}{v}" for k, v in kw.items()) for w, m, kw in EXPERT_PARALLEL])
def test_expert_parallel_with_dp_matches_single_device(world_size, mesh, kw, mixtral_reference_run, tmp_path, ranks):
    _check_run(world_size, mesh, mixtral_reference_run, tmp_path, ranks, model="mixtral", **kw)


def test_expert_parallel_zero2_checkpoint_resumes_on_ep2(mixtral_reference_run, tmp_path, ranks):
    """dp=2,ep=2 --zero 2 saved at half way (ZeRO-2 state: dense over dp x ep, experts over dp), resumed on ep=2
    with a plain AdamW over the DTensor parameters: the rest of the one-device curve (rtol 1e-4)."""
    half, first, resumed = STEPS // 2, tmp_path / "a", tmp_path / "b"
    ranks(train.train, 4, _cfg("dp=2,ep=2", first, model="mixtral", zero=2, ckpt_every=half))
    ranks(train.train, 2, replace(_cfg("ep=2", resumed, model="mixtral"), resume=str(first / "ckpt" / f"step_{half}")))
    got, reference = _losses(resumed), mixtral_reference_run[0]
    assert len(got) == STEPS - half
    assert got == pytest.approx(reference[half:], rel=1e-4), f"dp2 x ep2 zero2 -> ep2: {got} vs {reference[half:]}"


# Expert parallelism composed further, fp32 against the same one-device Mixtral run: pipeline stages whose MoE blocks
# dispatch over ep (each dispatch one vescale::ep_experts node of the captured graph; each rank keeps its experts as
# plain tensors; gradients averaged after the step); dp x ep x tp on 8 ranks (experts' FFNs tp-sharded inside each ep
# rank, DDP over dp x ep); and dp x ep with --grad-accum 2 and full activation checkpointing (each checkpointed
# block re-runs its all-to-alls in backward).
EXPERT_PARALLEL_COMPOSED = [(4, "pp=2,ep=2", {}), (8, "dp=2,ep=2,tp=2", {}),
                            (4, "dp=2,ep=2", {"grad_accum": 2, "activation_checkpointing": "full"})]


@pytest.mark.parametrize("world_size,mesh,kw", EXPERT_PARALLEL_COMPOSED,
                         ids=[f"ws{w}-{m.replace(',', 'x').replace('=', '')}"
                              + "".join(f"-{k}{v}" for k, v in kw.items()) for w, m, kw in EXPERT_PARALLEL_COMPOSED])
def test_expert_parallel_composed_matches_single_device(world_size, mesh, kw, mixtral_reference_run, tmp_path, ranks):
    _check_run(world_size, mesh, mixtral_reference_run, tmp_path, ranks, model="mixtral", **kw)


def test_context_parallel_gpt_matches_single_device(reference_run, tmp_path, ranks):
    """The in-repo GPT (attention by hand, through its causal_attention hook; rotary from the global positions of
    each rank's chunks) on cp=2 against the one-device gpt-tiny run."""
    _check_run(2, "cp=2", reference_run, tmp_path, ranks)


def test_pipeline_context_parallel_gpt_matches_single_device(reference_run, tmp_path, ranks):
    """pp=2 x cp=2 on the in-repo GPT: the model is captured taking whole rows, each rank's stage attends through the
    cp attention operator (kept as one node by torch.export) at the global positions of its chunks, and each stage's
    gradients are averaged over cp; against the one-device gpt-tiny run."""
    _check_run(4, "pp=2,cp=2", reference_run, tmp_path, ranks)


def test_zero3_over_dp_and_cp_gpt_matches_single_device(reference_run, tmp_path, ranks):
    """dp=2 x cp=2 --zero 3 on the in-repo GPT: FSDP2 shards the parameters over dp x cp flattened and averages the
    gradients there, as DDP does with cp (sharding over dp alone leaves the cp sum: 1.12x one device's gradient)."""
    _check_run(4, "dp=2,cp=2", reference_run, tmp_path, ranks, zero=3)


# Context parallelism composed further: an unmodified HF Llama cut into pipeline stages (the deep copy the split
# captures runs its own cp forward, the captured stages call the cp attention operator), tp-sharded captured stages
# (the operator and its backward get DTensors sharded by heads and run on the local shards), and ZeRO 3 over the
# dp x cp ranks (here cp alone) with tp or with pp.
CP_COMPOSED = [
    (4, "pp=2,cp=2", "llama", {}),
    (8, "pp=2,cp=2,tp=2", "gpt-tiny", {}),
    (4, "cp=2,tp=2", "llama", {"zero": 3}),
    (4, "pp=2,cp=2", "llama", {"zero": 3}),
]


@pytest.mark.parametrize("world_size,mesh,model,kw", CP_COMPOSED,
                         ids=[f"{m}-ws{w}-{s.replace(',', 'x').replace('=', '')}"
                              + "".join(f"-{k}{v}" for k, v in kw.items()) for w, s, m, kw in CP_COMPOSED])
def test_context_parallel_compositions_match_single_device(world_size, mesh, model, kw, request, tmp_path, ranks):
    reference = request.getfixturevalue("llama_reference_run" if model == "llama" else "reference_run")
    _check_run(world_size, mesh, reference, tmp_path, ranks, model=model, **kw)


def test_activation_checkpointing_matches_single_device(reference_run, tmp_path, ranks):
    """--activation-checkpointing selective on tp=2 (matmul outputs saved, the rest recomputed in backward under
    the root's factory capture) against the one-device run without checkpointing."""
    _check_run(2, "tp=2", reference_run, tmp_path, ranks, activation_checkpointing="selective")


# ZeRO 3 (FSDP2 per block over dp) composed with tp, and HSDP (--mesh dp_replicate=2,dp_shard=2: two replicas of
# 2-way ZeRO-3 groups), fp32: the bounds of every cell. Measured: at most 5.1e-7 of a parameter's largest gradient.
# With --grad-accum 2 FSDP2 reduce-scatters only in the second micro-step. With pp each stage is one FSDP2 unit
# (vescale.parallel.fully_shard_stage): gathered once a step, its microbatches' gradients reduce-scattered once, in
# the last backward (integration_tests/test_zero3_pipeline.py counts the collectives). Measured on the pp cells:
# 5.0e-7 (pp2 x dp2) and 6.1e-7 (pp2 x dp2 x tp2) of a parameter's largest gradient.
ZERO3 = [(4, "dp=2,tp=2", {"zero": 3}), (4, "dp_replicate=2,dp_shard=2", {"zero": 3}),
         (2, "dp=2", {"zero": 3, "grad_accum": 2}), (4, "pp=2,dp=2", {"zero": 3}),
         (8, "pp=2,dp=2,tp=2", {"zero": 3})]


@pytest.mark.parametrize("world_size,mesh,kw", ZERO3, ids=[f"ws{w}-{m.replace(',', 'x').replace('=', '')}-zero3"
                                                          + "".join(f"-{k}{v}" for k, v in kw.items() if k != "zero")
                                                          for w, m, kw in ZERO3])
def test_zero3_and_hsdp_match_single_device(world_size, mesh, kw, reference_run, tmp_path, ranks):
    _check_run(world_size, mesh, reference_run, tmp_path, ranks, **kw)


# HSDP composed, 8 ranks each: with tp (FSDP2 on the 2-D dp_replicate x dp_shard mesh over tp-sharded DTensors) and
# with pp (each stage one HSDP unit: its microbatches' gradients reduce-scattered over dp_shard, then all-reduced over
# dp_replicate, once a step). The batch of 8 is split over the 4 dp ranks: 2 microbatches of one row each. fp32, the
# bounds of every cell; measured: 5.3e-7 (with tp) and 5.4e-7 (with pp) of a parameter's largest gradient. Sharding
# over dp_shard alone (no reduction over the replicas) fails both.
HSDP_COMPOSED = [(8, "dp_replicate=2,dp_shard=2,tp=2", {"zero": 3}),
                 (8, "pp=2,dp_replicate=2,dp_shard=2", {"zero": 3, "microbatches": 2})]


@pytest.mark.parametrize("world_size,mesh,kw", HSDP_COMPOSED,
                         ids=[f"ws{w}-{m.replace(',', 'x').replace('=', '')}-zero3" for w, m, _ in HSDP_COMPOSED])
def test_hsdp_composed_with_tp_and_pp_matches_single_device(world_size, mesh, kw, reference_run, tmp_path, ranks):
    _check_run(world_size, mesh, reference_run, tmp_path, ranks, **kw)


# --dtype bf16: bf16 parameters and compute, fp32 gradient accumulation and reduction, fp32 master weights and AdamW
# state (DistributedOptimizer, zero_stage 0 without ZeRO; FSDP2's fp32 shards with ZeRO 3). The reference is the same
# recipe on one device. bf16 keeps 8 significant bits: every stored activation and activation gradient is rounded
# with relative error up to u = 2**-8 (uniform: standard deviation u / sqrt(3)), and two runs that add in other
# orders round differently. A first-step gradient of this 2-layer model passes through about S = 70 rounded stages
# (about 16 per block forward and as many backward: norms, projections, rotary, scores, softmax, products, residual
# adds; plus embedding, final norm, head and loss), so each run's relative error is about sqrt(S) u / sqrt(3) = 1.9e-2
# as a random walk, and the difference of two runs sqrt(2) times that, 2.7e-2: the bound is 8 u = 2**-5 = 3.1e-2,
# per parameter, on the norm of the difference relative to the one-device gradient's norm, and on the largest
# element's difference relative to its largest element. A constant scale c misses by |c - 1| >= 0.5 (a dp sum for a
# mean: 1.0), 16 times the bound. Measured: at most 7.8e-3 (norm) and 1.05e-2 (element), on tp=2; the one-device
# bf16 recipe itself is 1.06e-2 (norm) from the fp32 run, checked against the same bound below.
BF16_GRAD_TOL = 2**-5
# The logged loss is a bf16 value (about 4.5: one ulp is 2**-5, relative 2**-7) averaged over dp; the updates differ
# by the gradients' 1% relative through AdamW at lr 3e-3, far below one ulp of the loss: 2 ulps, relative 2**-6.
BF16_LOSS_RTOL = 2**-6


def _assert_bf16_grads_match(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert set(got) == set(want), f"{what}: FQNs differ: {sorted(set(got) ^ set(want))}"
    for name, ref in want.items():
        diff = got[name] - ref
        rel_norm = float(diff.norm() / ref.norm())
        rel_elt = float(diff.abs().max() / ref.abs().max())
        assert rel_norm <= BF16_GRAD_TOL and rel_elt <= BF16_GRAD_TOL, (
            f"{what}: gradient of {name} is off by {rel_norm:.3g} in norm and {rel_elt:.3g} at its largest element "
            f"(bound {BF16_GRAD_TOL}); norm ratio to one device {float(got[name].norm() / ref.norm()):.6g}")


@pytest.fixture(scope="module")
def bf16_reference_run(tmp_path_factory, reference_run) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The single-device bf16 run (its loss per step and first-step gradients), itself within the bf16 bound of the
    fp32 single-device run (so the recipe computes the same gradients, at bf16 precision)."""
    from vescale.core.testing import run_on_ranks

    out = tmp_path_factory.mktemp("ref16")
    run_on_ranks(train.train, 1, _cfg("dp=1", out, dtype="bf16", grad_dump=str(out / "grads.safetensors")))
    grads = _grads(out)
    _assert_bf16_grads_match(grads, reference_run[1], "one-device bf16 vs fp32")
    return _losses(out), grads


# Pipelines cast the (deferred) model to bf16 before the split, so stages are captured and materialised in bf16 (each
# rank its shard of the fp32 init, cast); the last cell is the done-when command (pp2 x dp2 x tp2, ZeRO 1,
# full activation checkpointing, --grad-accum 2).
BF16 = [(2, "tp=2", {}), (2, "tp=2", {"sequence_parallel": True}), (2, "dp=2", {"zero": 1}),
        (4, "dp=2,tp=2", {"zero": 2}), (4, "dp=2,tp=2", {"zero": 3}), (2, "pp=2", {}),
        (8, "pp=2,dp=2,tp=2", {"zero": 1, "activation_checkpointing": "full", "grad_accum": 2, "microbatches": 2}),
        # ZeRO 3 of bf16-captured stages over fp32 masters (fully_shard_stage(master_dtype=)); cp over dp and tp.
        # Measured (norm, element): 9.1e-3, 8.6e-3 (pp2 x dp2 ZeRO 3); 6.1e-3, 7.8e-3 (dp2 x cp2); 7.9e-3, 8.7e-3
        # (cp2 x tp2)
        (4, "pp=2,dp=2", {"zero": 3}), (4, "dp=2,cp=2", {}), (4, "cp=2,tp=2", {})]
BF16_IDS = [f"ws{w}-{m.replace(',', 'x').replace('=', '')}-bf16-zero{kw.get('zero', 0)}"
            + ("-sp" if kw.get("sequence_parallel") else "")
            + ("-ac-accum2" if kw.get("grad_accum") else "") for w, m, kw in BF16]


@pytest.mark.parametrize("world_size,mesh,kw", BF16, ids=BF16_IDS)
def test_bf16_matches_single_device_bf16(world_size, mesh, kw, bf16_reference_run, tmp_path, ranks):
    ranks(train.train, world_size, _cfg(mesh, tmp_path, dtype="bf16", grad_dump=str(tmp_path / "grads.safetensors"),
                                        **kw))
    what = f"{mesh} bf16 {kw}"
    _assert_bf16_grads_match(_grads(tmp_path), bf16_reference_run[1], what)
    got, reference = _losses(tmp_path), bf16_reference_run[0]
    assert len(got) == STEPS and got[-1] < got[0]
    assert got == pytest.approx(reference, rel=BF16_LOSS_RTOL), f"{what}: {got} vs single device {reference}"


def _bf16_masters_after_resume(cfg: train.TrainConfig) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """Build the bf16 trainer of ``cfg`` on this rank, load ``cfg.resume``; return (fqn, master piece, the same
    elements of the bf16 parameter) for each piece this rank updates."""
    from vescale import checkpoint
    from vescale.core.torch_internals import local_tensor

    trainer = train.build_trainer(cfg, train.init_mesh(train.mesh_dims(cfg)))
    checkpoint.load(cfg.resume, {**trainer.state, "progress": {"step": 0}})
    out = []
    for piece in trainer.optimizer.pieces.values():
        flat = local_tensor(piece.slot.param).detach().reshape(-1)[piece.lo:piece.hi]
        out.append((piece.fqn, piece.master.detach().clone(), flat.clone()))
    return out


def test_bf16_resume_on_another_mesh_restores_fp32_masters(bf16_reference_run, tmp_path, ranks):
    """A bf16 ZeRO-1 run on dp=2 saves its fp32 masters; resumed on tp=2 (zero_stage 0 masters) it continues the
    one-device bf16 curve, and its masters are the saved fp32 values, not the bf16 parameters widened: each master
    rounds to its parameter, and most masters are not bf16 numbers."""
    half = STEPS // 2
    first = tmp_path / "a"
    ranks(train.train, 2, replace(_cfg("dp=2", first, dtype="bf16", zero=1), ckpt_every=half))
    ckpt = first / "ckpt" / f"step_{half}"
    resumed = tmp_path / "b"
    cfg_b = replace(_cfg("tp=2", resumed, dtype="bf16"), resume=str(ckpt))
    ranks(train.train, 2, cfg_b)
    got = _losses(resumed)
    assert got == pytest.approx(bf16_reference_run[0][half:], rel=BF16_LOSS_RTOL), got
    for rank_pieces in ranks(_bf16_masters_after_resume, 2, cfg_b):
        widened = total = 0
        for fqn, master, param in rank_pieces:
            assert master.dtype == torch.float32 and param.dtype == torch.bfloat16, fqn
            assert torch.equal(master.to(torch.bfloat16), param), f"{fqn}: the bf16 parameter is not its master"
            widened += int((master == param.float()).sum())
            total += master.numel()
        assert widened < total / 2, f"{widened} of {total} masters are bf16 values: fp32 masters were not restored"


def _init_state(cfg: train.TrainConfig) -> tuple[dict, int]:
    """Build the trainer of ``cfg`` on this rank; return the full value of every tensor it holds, and its init bytes."""
    from torch.distributed.tensor import DTensor

    trainer = train.build_trainer(cfg, train.init_mesh(cfg.dims))
    model = trainer.state["model"]  # the model, or this rank's pipeline stages
    held = {}
    for module in model if isinstance(model, list) else [model]:
        for name, t in [*module.named_parameters(), *module.named_buffers()]:
            held[name] = (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()
    return held, trainer.init_bytes


@pytest.fixture(scope="module")
def init_reference(tmp_path_factory):
    """``(model, init) -> (every tensor of the 1-rank init, whole; its bytes)``, each computed once."""
    from vescale.core.testing import run_on_ranks

    cache: dict = {}

    def get(model: str, init: str) -> tuple[dict, int]:
        if (model, init) not in cache:
            cfg = _cfg("dp=1", tmp_path_factory.mktemp("init"), model=model, init=init)
            cache[model, init] = run_on_ranks(_init_state, 1, cfg)[0]
        return cache[model, init]

    return get


# (world size, mesh, model, init, the most a rank may hold as a fraction of the whole model's bytes).
INITS = [
    (2, "tp=2", "gpt-tiny", "deferred", 0.51),  # every weight but the (replicated) norms sharded
    (2, "pp=2", "gpt-tiny", "deferred", 0.55),  # a stage: half the layers + embedding or norm/head; rotary buffer
    (4, "pp=2,tp=2", "gpt-tiny", "deferred", 0.35),  # a stage's tp shard; embeddings stay replicated in stages
    (4, "pp=2,tp=2", "gpt2", "deferred", 0.35),  # Hugging Face GPT-2: Conv1D weights, learned positions
    (2, "dp=2", "gpt-tiny", "deferred", 1.0),  # each replica computes half, then all-gathers the whole
    (2, "tp=2", "gpt-tiny", "eager", 1.0),  # the old way: every rank builds (and counts) the whole model
]


@pytest.mark.parametrize("world_size,mesh,model,init,most", INITS,
                         ids=[f"{m}-{i}-ws{w}-{s.replace(',', 'x').replace('=', '')}" for w, s, m, i, _ in INITS])
def test_init_on_a_mesh_is_bitwise_the_single_device_init(world_size, mesh, model, init, most, init_reference,
                                                          tmp_path, ranks):
    want, whole = init_reference(model, init)
    got = ranks(_init_state, world_size, _cfg(mesh, tmp_path, model=model, init=init))
    seen = set()
    for rank, (held, nbytes) in enumerate(got):
        assert held, f"rank {rank} holds nothing"
        for name, value in held.items():
            assert name in want, f"{mesh} rank {rank}: {name} is not a tensor of the 1-rank model"
            # Bitwise: deferred init replays the same counter-RNG draws on every mesh; eager distributes rank 0's.
            assert torch.equal(value, want[name]), f"{mesh} rank {rank}: {name} differs from the 1-rank init"
        seen |= set(held)
        assert nbytes <= most * whole, f"{mesh} rank {rank} built {nbytes} bytes, more than {most} x {whole}"
    assert seen == set(want), f"{mesh}: tensors held by no rank: {sorted(set(want) - seen)}"


RESHARDS = [(2, "dp=2", 2, "tp=2"), (4, "dp=2,tp=2", 2, "pp=2"), (2, "tp=2", 1, "dp=1")]


@pytest.mark.parametrize("ws_a,mesh_a,ws_b,mesh_b", RESHARDS,
                         ids=[f"{a.replace(',', 'x').replace('=', '')}-to-{b.replace(',', 'x').replace('=', '')}"
                              for _, a, _, b in RESHARDS])
def test_resume_on_another_mesh_continues_the_curve(ws_a, mesh_a, ws_b, mesh_b, reference, tmp_path, ranks):
    half = STEPS // 2
    first = tmp_path / "a"
    ranks(train.train, ws_a, replace(_cfg(mesh_a, first), steps=STEPS, ckpt_every=half))
    ckpt = first / "ckpt" / f"step_{half}"
    assert ckpt.is_dir()
    resumed = tmp_path / "b"
    ranks(train.train, ws_b, replace(_cfg(mesh_b, resumed), resume=str(ckpt)))
    got = _losses(resumed)
    assert len(got) == STEPS - half
    # The uninterrupted single-device curve is the reference for both meshes (tested above); rtol 1e-4.
    assert got == pytest.approx(reference[half:], rel=1e-4), f"{mesh_a} -> {mesh_b}: {got} vs {reference[half:]}"


@pytest.mark.parametrize("argv,reason", [
    (["--mesh", "pp=8,tp=3"], "pp=8 exceeds the model's 6 layers"),
    (["--mesh", "tp=3"], "vocab_size=512 is not divisible by tp=3"),
    (["--mesh", "dp=3"], "--batch-size 8 is not divisible by dp=3"),
    (["--mesh", "dp=2", "--grad-accum", "3"], "--batch-size 8 is not divisible by dp=2 x --grad-accum 3"),
    (["--mesh", "pp=2", "--grad-accum", "4"], "not divisible by 16 microbatches (4 x --grad-accum 4)"),
    (["--mesh", "tp=2", "--seq-len", "999"], "exceeds the model's max_seq_len=256"),
    (["--mesh", "pp=2,dp=2", "--zero", "3", "--schedule", "zb_h1"], "--zero 3 with --schedule zb_h1 is not supported"),
    (["--mesh", "dp_replicate=2,dp_shard=2"], "is an HSDP mesh (dp_replicate x dp_shard): it needs --zero 3"),
    (["--mesh", "dp=2,dp_shard=2", "--zero", "3"], "HSDP names both dp_replicate and dp_shard"),
    (["--mesh", "tp=2", "--reduce-dtype", "bf16"], "--reduce-dtype bf16 needs --dtype bf16"),
    (["--mesh", "cp=4", "--model", "llama", "--seq-len", "20"], "--seq-len 20 is not divisible by 2 x cp = 8"),
    (["--mesh", "cp=2,tp=2", "--compile"], "not with ep/HSDP, --compile (cp under torch.compile"),
])
def test_a_mesh_that_does_not_fit_is_refused_before_any_rank_starts(argv, reason, capsys):
    with pytest.raises(SystemExit) as info:
        train.main(argv)
    assert reason in str(info.value)


def test_unknown_mesh_dimension_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as info:
        train.main(["--mesh", "dp=2,xx=2"])
    assert info.value.code == 2
    assert "['xx'] are not supported" in capsys.readouterr().err


@pytest.mark.parametrize("argv,reason", [
    (["--mesh", "pp=2,ep=2,tp=2"], "pp x ep x tp is not supported"),
    (["--mesh", "pp=2,ep=2", "--zero", "1"], "pp x ep runs fp32 with --zero 0"),
    (["--mesh", "pp=2,ep=2", "--schedule", "zb_h1"], "--schedule zb_h1 is not supported with pp x ep"),
    (["--mesh", "dp=2,ep=2", "--dtype", "bf16"], "--dtype bf16 is not supported yet"),
    (["--mesh", "dp=2,ep=2", "--zero", "3"], "--zero 3 is not supported"),
    (["--mesh", "dp=2,ep=2", "--grad-accum", "4"], "not divisible by dp x ep x --grad-accum = 16"),
])
def test_an_expert_parallel_run_that_cannot_work_is_refused_with_its_reason(argv, reason, capsys):
    with pytest.raises(SystemExit) as info:
        train.main(["--model", "mixtral", *argv])
    assert info.value.code == 2
    assert reason in capsys.readouterr().err
