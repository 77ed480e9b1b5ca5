"""The zoo sweep: every decoder-only causal LM that the installed ``transformers`` ships, planned and run against one
device.

The architectures come from transformers' own auto mapping (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``), not from a hand-
picked list. Of those, encoder families (also in the masked-LM mapping), encoder-decoder models and composite
(multimodal) configs are not decoder-only and are listed as skipped. Each remaining architecture is built from a
small config (its defaults, with the sizes shrunk where the config has them; its dropout rates untouched) and run the
way its users train it: ``model.train()``, its default attention implementation, ``use_cache`` as the config says,
``input_ids`` with ``labels``, so the model's own loss. The single-device reference is the same call on the
unparallelized model on each rank, with vescale's counter RNG (:mod:`vescale.dtensor.random`: ``manual_seed`` then
``single_device()``), so its dropout masks are the ones any layout must reproduce bitwise. The parallel run is a plan
+ ``parallelize_module`` on the given mesh, each data-parallel rank passing its own rows, after the same
``manual_seed`` (its DTensor random ops take the counter RNG; plain-tensor ones stay torch's, as in a user's loop).
Plan sources:
``auto_plan`` (called as users call it: its defaults, so no sequence parallelism), ``auto_plan+sp``
(``sequence_parallel=True``) and ``transformers`` (the model's own ``base_model_tp_plan`` via
:func:`~vescale.plan.hf_tp_plan.from_transformers_tp_plan`, where it has one).

Each case ends in one of:

* ``pass``: logits, loss and every parameter gradient equal the reference (fp32, rtol 1e-5, atol 1e-5).
* ``refused``: vescale raised an error that names what it cannot do (a :class:`~vescale.core.errors.VescaleError`
  or ``NotImplementedError``); the reason is its message.
* ``error``: anything else raised in the parallel run (a crash, not a refusal).
* ``mismatch``: the parallel run finished with a different result: the one outcome that must never happen.
* ``skipped``: the architecture could not be built small, or the single-device reference itself fails on CPU.

``transformers`` is needed (a test dependency of vescale, not a runtime one); it is imported inside the functions.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["ZooResult", "zoo_architectures", "tiny_config", "has_transformers_tp_plan", "run_zoo_case", "run_zoo",
           "zoo_table"]

RTOL, ATOL = 1e-5, 1e-5  # fp32
# The fp64 re-run of an fp32 difference: rounding shrinks by orders of magnitude, a wrong result does not. Not 1e-12:
# models that upcast parts to fp32 themselves (softmax(..., dtype=torch.float32)) keep fp32 rounding in fp64 runs.
RTOL64, ATOL64 = 1e-6, 1e-6
SEQ, ROWS_PER_RANK = 8, 2
RNG_SEED = 0  # vescale.dtensor.random's seed for the reference and the parallel run alike
POOL_CASES = 24  # cases run by one pool of ranks before it is restarted
MAX_PARAMETERS = 20_000_000  # a small config that stays larger than this is skipped (memory of 2 x 4 ranks)
#: The auto_plan plan sources and the keyword arguments each passes (``auto_plan`` alone: its defaults).
AUTO_PLAN_SOURCES: dict[str, dict[str, Any]] = {"auto_plan": {}, "auto_plan+sp": {"sequence_parallel": True}}

# Sizes every small config gets where the config has the field (the model's defaults otherwise).
_SIZES: dict[str, Any] = {
    "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 64, "n_positions": 64,
    "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64, "num_experts": 4, "num_local_experts": 4,
    "n_routed_experts": 4, "num_experts_per_tok": 2, "first_k_dense_replace": 1, "kv_lora_rank": 16,
    "q_lora_rank": 32, "rotary_dim": 8, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16, "n_group": 1,
    "topk_group": 1, "sliding_window": 16, "layer_types": None, "use_cache": None, "pad_token_id": 0,
    "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": None,
}  # no dropout field: every config keeps its own default dropout, run in training mode


@dataclass
class ZooResult:
    """One architecture on one mesh: ``result`` is pass / refused / error / mismatch / skipped (see the module doc);
    ``reason`` says why for anything but pass; ``collectives`` counts the collectives of one forward + backward;
    ``max_diff`` is the largest absolute difference seen (logits, loss, gradients)."""

    arch: str
    model: str
    mesh: str
    plan: str
    result: str
    reason: str = ""
    collectives: int | None = None
    max_diff: float | None = None


def zoo_architectures() -> tuple[list[tuple[str, str]], list[tuple[str, str, str]]]:
    """``(decoder_only, excluded)``: ``[(arch, model class name)]`` and ``[(arch, class name, why excluded)]``, from
    transformers' causal-LM auto mapping, sorted by arch."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    keep, excluded = [], []
    for arch, cls_name in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()):
        if isinstance(cls_name, (tuple, list)):
            cls_name = cls_name[0]
        why = ""
        if arch in MODEL_FOR_MASKED_LM_MAPPING_NAMES:
            why = "encoder family (also a masked LM): a causal LM only as a decoder add-on"
        else:
            try:
                config_cls = CONFIG_MAPPING[arch]
                encoder_decoder = getattr(config_cls, "is_encoder_decoder", False) or \
                    getattr(config_cls(), "is_encoder_decoder", False)
            except Exception as e:  # noqa: BLE001 - a config that cannot load or build with its defaults
                encoder_decoder, why = False, f"config not buildable with its defaults: {type(e).__name__}"
            if encoder_decoder:
                why = "encoder-decoder"
            elif not why and getattr(config_cls, "sub_configs", None):
                why = "composite (multimodal) config"
        if why:
            excluded.append((arch, cls_name, why))
        else:
            keep.append((arch, cls_name))
    return keep, excluded


def tiny_config(arch: str):
    """The config of ``arch`` with its defaults, shrunk to the sizes of ``_SIZES`` where it has those fields.

    Hybrid models keep one layer of every kind their default ``layer_types`` has (the shortest prefix that holds
    them all), so a linear-attention hybrid still has its attention layers.
    """
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config_cls = CONFIG_MAPPING[arch]
    defaults = config_cls()
    known = set(defaults.to_dict()) | set(getattr(defaults, "attribute_map", {}))
    kwargs = {k: v for k, v in _SIZES.items() if k in known and v is not None}
    if "qk_rope_head_dim" in known:
        kwargs.pop("head_dim", None)  # multi-head latent attention derives its head dims from the lora/rope sizes
    kinds = getattr(defaults, "layer_types", None)
    if isinstance(kinds, (list, tuple)) and kinds:
        layers = next(n for n in range(1, len(kinds) + 1) if set(kinds[:n]) == set(kinds))
        kwargs["num_hidden_layers"] = max(kwargs.get("num_hidden_layers", 2), layers)
        if "layer_types" in known:
            kwargs["layer_types"] = list(kinds[: kwargs["num_hidden_layers"]])
    try:
        config = config_cls(**kwargs)
    except Exception:  # noqa: BLE001 - some configs validate combinations: fall back to setting attributes
        config = config_cls()
        for k, v in kwargs.items():
            try:
                setattr(config, k, v)
            except Exception:  # noqa: BLE001 - a derived (read-only) field
                pass
    return config


def _model(arch: str, cls_name: str, dtype=None):
    import torch
    import transformers

    config = tiny_config(arch)
    with torch.device("meta"):
        size = sum(p.numel() for p in getattr(transformers, cls_name)(config).parameters())
    if size > MAX_PARAMETERS:
        raise ValueError(f"the small config still has {size / 1e6:.0f}M parameters (fields this sweep does not "
                         f"shrink); over the sweep's limit of {MAX_PARAMETERS / 1e6:.0f}M")
    torch.manual_seed(0)
    model = getattr(transformers, cls_name)(config)
    return model.to(dtype or torch.float32).train()


def _batch(world_rows: int, vocab: int):
    import torch

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, min(vocab, 128), (world_rows, SEQ), generator=g)
    return ids


def _max_diff(a, b) -> float:
    return float((a.detach().double() - b.detach().double()).abs().max()) if a.numel() else 0.0


def run_zoo_case(arch: str, cls_name: str, mesh_dims: dict[str, int], plan: str = "auto_plan") -> ZooResult:
    """Run one architecture on this rank's part of ``mesh_dims`` (call on every rank of the world); see the module
    doc for the outcomes. The same on every rank: each rank computes the reference, and the comparison's outcome is
    agreed by an all-reduce before returning.

    fp32 first (rtol 1e-5, atol 1e-5). A difference there is run again in fp64 (rtol 1e-6): sharding reorders sums,
    and a model whose gradients are large sums of cancelling terms can differ by more than 1e-5 in fp32 from
    rounding alone. If fp64 agrees, it was rounding (a pass, with both figures in the reason); if not, a mismatch.
    """
    import torch

    result = _run_zoo_case(arch, cls_name, mesh_dims, torch.float32, plan)
    if result.result == "mismatch":
        exact = _run_zoo_case(arch, cls_name, mesh_dims, torch.float64, plan)
        if exact.result == "pass":
            result.result = "pass"
            result.reason = (f"fp32 differs by {result.max_diff:.2g} ({result.reason}); fp64 agrees to "
                             f"{exact.max_diff:.2g}: rounding")
        else:
            result.reason = f"fp64 too: {exact.reason}"
    return result


def _run_zoo_case(arch: str, cls_name: str, mesh_dims: dict[str, int], dtype, plan_source: str) -> ZooResult:
    import copy

    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from vescale.core.errors import VescaleError
    from vescale.core.mesh import init_mesh
    from vescale.dtensor import count_comms, random
    from vescale.parallel import parallelize_module
    from vescale.plan.auto_plan import auto_plan
    from vescale.plan.hf_tp_plan import from_transformers_tp_plan

    mesh_name = " x ".join(f"{k}{v}" for k, v in mesh_dims.items())
    result = ZooResult(arch, cls_name, mesh_name, plan_source, "pass")
    dp = mesh_dims.get("dp", 1)
    try:
        ref = _model(arch, cls_name, dtype)
        rtol, atol = (RTOL, ATOL) if dtype == torch.float32 else (RTOL64, ATOL64)
        ids = _batch(ROWS_PER_RANK * dp, ref.config.vocab_size)
        # the copy to parallelize is taken before the reference runs: some models keep non-leaf tensors from a
        # forward (RecurrentGemma's cached state), which deepcopy refuses
        par = copy.deepcopy(ref)
        random.manual_seed(RNG_SEED)
        with random.single_device():  # dropout from vescale's counter RNG: the masks any layout must reproduce
            ref_out = ref(input_ids=ids, labels=ids)
            ref_out.loss.backward()
    except Exception as e:  # noqa: BLE001
        result.result, result.reason = "skipped", f"single-device reference fails: {type(e).__name__}: {e}"
        return result

    failure = ""
    try:
        mesh = init_mesh(mesh_dims)
        par.zero_grad(set_to_none=True)
        rank = mesh.get_local_rank("dp") if dp > 1 else 0
        mine = slice(ROWS_PER_RANK * rank, ROWS_PER_RANK * (rank + 1))
        if plan_source in AUTO_PLAN_SOURCES:
            plan = auto_plan(par, mesh, example_kwargs={"input_ids": ids[mine], "labels": ids[mine]},
                             **AUTO_PLAN_SOURCES[plan_source])
        else:
            plan = from_transformers_tp_plan(par, mesh)
        parallelize_module(par, mesh, plan)
        random.manual_seed(RNG_SEED)  # after planning: the same sequence numbers as the reference's calls
        with count_comms() as comms:
            out = par(input_ids=ids[mine], labels=ids[mine])
            out.loss.backward()
        result.collectives = comms.total
        # a plan that names no root output for the logits returns the full tensor (every dp rank's rows)
        want = ref_out.logits if out.logits.shape[0] == ref_out.logits.shape[0] else ref_out.logits[mine]
        diffs = [_max_diff(out.logits, want), _max_diff(out.loss, ref_out.loss)]
        ok = torch.allclose(out.logits, want, rtol=rtol, atol=atol) and \
            torch.allclose(out.loss, ref_out.loss, rtol=rtol, atol=atol)
        ref_params = dict(ref.named_parameters())
        for name, p in par.named_parameters():
            r = ref_params[name].grad
            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            if (g is None) != (r is None):
                ok, failure = False, f"{name}: gradient present on one side only"
                continue
            if g is not None:
                diffs.append(_max_diff(g, r))
                if not torch.allclose(g, r, rtol=rtol, atol=atol):
                    ok = False
                    failure = failure or f"gradient of {name} differs by {diffs[-1]:.3g}"
        result.max_diff = max(diffs)
        if not ok:
            result.result = "mismatch"
            result.reason = failure or f"logits/loss differ by {result.max_diff:.3g}"
    except (VescaleError, NotImplementedError) as e:
        result.result, result.reason = "refused", f"{type(e).__name__}: {e}"
    except Exception as e:  # noqa: BLE001
        frames = traceback.extract_tb(e.__traceback__)
        model_frames = [f for f in frames if "/transformers/" in f.filename] or frames
        frame = model_frames[-1]  # the model's line that made the call
        where = f"{frame.filename.rsplit('/transformers/', 1)[-1]}:{frame.lineno} `{(frame.line or '').strip()}`"
        result.result, result.reason = "error", f"{type(e).__name__}: {e} (at {where})"
    # Every rank must report the same outcome: a rank that alone saw a mismatch makes it a mismatch everywhere.
    order = ["pass", "refused", "error", "mismatch"]
    flag = torch.tensor([order.index(result.result)])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if order[int(flag)] != result.result:
        result.result, result.reason = order[int(flag)], result.reason or "another rank saw it"
    result.reason = " ".join(result.reason.split())[:300]
    return result


def _case_on_rank(arch: str, cls_name: str, mesh_dims: dict[str, int], plan: str) -> dict:
    import gc

    try:
        return asdict(run_zoo_case(arch, cls_name, mesh_dims, plan))
    finally:
        gc.collect()


def has_transformers_tp_plan(arch: str) -> bool:
    """Whether ``arch``'s config carries transformers' own TP plan (``base_model_tp_plan``)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return bool(getattr(CONFIG_MAPPING[arch], "base_model_tp_plan", None))


def run_zoo(mesh_dims: dict[str, int], archs: list[tuple[str, str]] | None = None, *,
            plans: tuple[str, ...] = ("auto_plan",), timeout: float = 300,
            on_result: Callable[[ZooResult], None] | None = None) -> list[ZooResult]:
    """Sweep ``archs`` (default: every decoder-only architecture) on pooled CPU ranks of ``mesh_dims``, with each
    plan source of ``plans`` (``"auto_plan"``, ``"auto_plan+sp"``; ``"transformers"``: the model's own TP plan, where
    it has one; see the module docstring), one call per case: a rank that dies or hangs (``timeout`` seconds) costs
    that case an ``error``, and the pool is rebuilt for the next one. ``on_result`` is called with each result as it
    comes (progress of a long sweep)."""
    import math

    from vescale.core.errors import RankError, RankTimeoutError
    from vescale.core.testing import run_on_ranks, shutdown_pools

    if archs is None:
        archs = zoo_architectures()[0]
    mesh_name = " x ".join(f"{k}{v}" for k, v in mesh_dims.items())
    results = []
    cases = [(arch, cls_name, plan) for arch, cls_name in archs for plan in plans
             if plan in AUTO_PLAN_SOURCES or has_transformers_tp_plan(arch)]
    for done, (arch, cls_name, plan) in enumerate(cases):
        if done and done % POOL_CASES == 0:
            shutdown_pools()  # each architecture imports its own transformers modules: fresh ranks bound the memory
        try:
            out = run_on_ranks(_case_on_rank, math.prod(mesh_dims.values()), arch, cls_name, mesh_dims, plan,
                               timeout=timeout)[0]
            results.append(ZooResult(**out))
        except (RankError, RankTimeoutError) as e:
            first = " ".join(str(e).split())[:200]
            results.append(ZooResult(arch, cls_name, mesh_name, plan, "error", f"a rank failed: {first}"))
        if on_result is not None:
            on_result(results[-1])
    return results


def zoo_table(results: list[ZooResult], excluded: list[tuple[str, str, str]] = ()) -> str:
    """The sweep as a Markdown table (one row per architecture and mesh), a summary line, and the excluded list."""
    lines = []
    for plan in sorted({r.plan for r in results}):
        ran = [r for r in results if r.plan == plan]
        tested = [r for r in ran if r.result != "skipped"]
        count = {k: sum(r.result == k for r in ran) for k in ("pass", "refused", "error", "mismatch", "skipped")}
        lines.append(f"- `{plan}`: {count['pass']} of {len(tested)} runs pass "
                     f"({100 * count['pass'] / max(len(tested), 1):.0f} %), {count['refused']} refused, "
                     f"{count['error']} error, {count['mismatch']} numerical mismatch; {count['skipped']} skipped.")
    lines += ["", "| architecture | model | mesh | plan | result | collectives / step | reason |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        reason = r.reason.replace("|", "\\|")
        lines.append(f"| {r.arch} | {r.model} | {r.mesh} | {r.plan} | {r.result} | "
                     f"{'' if r.collectives is None else r.collectives} | {reason} |")
    if excluded:
        lines += ["", "Not decoder-only (not swept): " + ", ".join(f"{a} ({why})" for a, _, why in excluded) + "."]
    return "\n".join(lines) + "\n"
