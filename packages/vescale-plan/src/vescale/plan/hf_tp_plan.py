"""A Hugging Face model's own tensor-parallel plan (``model._tp_plan``: its config's ``base_model_tp_plan`` under the
base model's prefix, plus the head's), written as a vescale plan for :func:`vescale.parallel.parallelize_module`.

transformers names a torch-TP *style* per module pattern (``"layers.*.self_attn.q_proj": "colwise"``). vescale's
plans place parameters instead and let DTensor carry activations, so the translation is the parameter placements
each style implies, plus the boundary a style fixes (a gathered or all-reduced output):

========================================================  =======================================================
style                                                     vescale plan
========================================================  =======================================================
``colwise``, ``colwise_rep``, ``colwise_gather_output``   weight and bias sharded on the output features
                                                          (``Shard(0)`` of an ``nn.Linear``, ``Shard(1)`` of a
                                                          GPT-2 ``Conv1D``); ``_rep`` / ``_gather_output``: output
                                                          replicated
``rowwise``, ``rowwise_rep``, ``rowwise_split_input``     weight sharded on the input features; output replicated
``embedding_rowwise`` / ``embedding_colwise``             embedding sharded on the vocabulary / the hidden size;
                                                          output replicated
``packed_colwise`` / ``packed_rowwise``                   a fused [gate | up] weight interleaved in two / the
                                                          experts' down weight sharded on its input features
``replicate``, ``replicated_with_grad_allreduce``,        parameters replicated (DTensor reduces their gradients)
``sequence_parallel``, ``all_reduce``, ``local_params``
========================================================  =======================================================

Styles with data-dependent or module-specific behaviour (``moe_tp_experts``, ``mla_kv_a_proj``, the expert-parallel
styles) are refused with a :class:`~vescale.core.errors.PlanError` naming the pattern and the style. A plan that
DTensor accepts is exact whatever it places where (placements decide communication, not results), so the
translation never needs to be more than this.
"""

from __future__ import annotations

import re

from torch import nn
from torch.distributed.tensor import Replicate, Shard

from vescale.core.errors import PlanError
from vescale.dtensor import InterleavedShard

__all__ = ["from_transformers_tp_plan"]

_REPLICATED_STYLES = {"replicate", "replicated_with_grad_allreduce", "sequence_parallel", "all_reduce",
                      "local_params"}


def _placements(mesh, tp: str, placement) -> list:
    names = tuple(mesh.mesh_dim_names or ())
    return [placement if n == tp else Replicate() for n in names]


def from_transformers_tp_plan(model: nn.Module, mesh, *, tp: str = "tp", dp: str | None = "dp") -> dict:
    """The vescale plan of ``model``'s own transformers TP plan on ``mesh`` (its ``tp`` dim shards; other dims
    replicate parameters). If the mesh has a ``dp`` dim, the root's ``input_ids`` / ``labels`` / ``attention_mask`` /
    ``position_ids`` and its ``logits`` are batch-sharded on it: each data-parallel rank passes and gets its own rows
    (without this, rows that differ per rank would be taken as replicated). Raises :class:`PlanError` if the model
    has no TP plan or uses a style vescale does not translate (naming both). Pure: every rank computes the same plan,
    no communication."""
    names = tuple(mesh.mesh_dim_names or ())
    if tp not in names:
        raise PlanError(f"from_transformers_tp_plan: the mesh has dims {list(names)}, no {tp!r} dim to shard on")
    batch = [Shard(0) if n == dp else Replicate() for n in names]
    styles = dict(getattr(model, "_tp_plan", None) or {})
    if not styles:
        raise PlanError(f"{type(model).__name__} has no transformers tensor-parallel plan (config.base_model_tp_plan)")
    modules = dict(model.named_modules())
    params = dict(model.named_parameters())
    rep = [Replicate()] * mesh.ndim
    plan: dict = {"parameter": {},
                  "input": {"": {key: batch for key in ("input_ids", "labels", "attention_mask", "position_ids")}},
                  "output": {"": {"logits": batch}}}
    for pattern, style in styles.items():
        regex = re.escape(pattern).replace(r"\*", r"\d+")
        matched_params = [n for n in params if re.fullmatch(regex, n)]
        matched_modules = [modules[n] for n in modules if re.fullmatch(regex, n)]
        if style in _REPLICATED_STYLES:
            continue
        if matched_params:  # a style placed on a parameter itself (packed experts weights)
            dim = params[matched_params[0]].dim()
            if style == "packed_colwise":
                plan["parameter"][regex] = _placements(mesh, tp, InterleavedShard(dim - 2, 2))
            elif style in ("packed_rowwise", "rowwise"):
                plan["parameter"][regex] = _placements(mesh, tp, Shard(dim - 1))
            elif style == "colwise":
                plan["parameter"][regex] = _placements(mesh, tp, Shard(dim - 2))
            else:
                raise PlanError(f"transformers TP plan entry {pattern!r}: style {style!r} on a parameter is not "
                                "translated to a vescale plan")
            continue
        if not matched_modules:
            continue  # a pattern of a part this model variant lacks
        module = matched_modules[0]
        conv1d = not isinstance(module, (nn.Linear, nn.Embedding)) and hasattr(module, "nf")  # GPT-2's Conv1D
        if style in ("colwise", "colwise_rep", "colwise_gather_output", "packed_colwise"):
            out_dim = 1 if conv1d else 0
            shard = InterleavedShard(out_dim, 2) if style == "packed_colwise" else Shard(out_dim)
            plan["parameter"][regex + r"\.weight"] = _placements(mesh, tp, shard)
            if getattr(module, "bias", None) is not None:
                plan["parameter"][regex + r"\.bias"] = _placements(
                    mesh, tp, InterleavedShard(0, 2) if style == "packed_colwise" else Shard(0))
            if style != "colwise":
                plan["output"][regex] = [rep]
        elif style in ("rowwise", "rowwise_rep", "rowwise_split_input"):
            plan["parameter"][regex + r"\.weight"] = _placements(mesh, tp, Shard(0 if conv1d else 1))
            plan["output"][regex] = [rep]
        elif style in ("embedding_rowwise", "embedding_colwise"):
            plan["parameter"][regex + r"\.weight"] = _placements(
                mesh, tp, Shard(0 if style == "embedding_rowwise" else 1))
            plan["output"][regex] = [rep]
        else:
            raise PlanError(f"transformers TP plan entry {pattern!r}: style {style!r} is not translated to a vescale "
                            "plan (its behaviour is specific to that module); use vescale.plan.auto_plan instead")
    return plan
