"""Example TP/SP plans for well-known model families, built for a given mesh: plain data you can print and edit.

Each function returns a plan (in the grammar of :mod:`vescale.parallel.plan_grammar`) for
:func:`~vescale.parallel.parallelize_module` on ``mesh``. ``tp`` names the mesh dim that shards (Megatron-style:
column-parallel q/k/v and up/gate, row-parallel output projections, vocab-parallel embedding, column-parallel lm
head); if the mesh has a ``dp`` dim, activations
(and the root's inputs and outputs) are batch-sharded on it, so each data-parallel rank passes its own batch and the
whole mesh still computes the single-device program over the global batch. Every other mesh dim replicates.

``sequence_parallel=True`` keeps the residual stream sharded on the sequence dim between the blocks (norms, dropout and
residual adds run on ``1/tp`` of the tokens), all-gathering it before attention/MLP and reduce-scattering their outputs.
``loss_parallel=True`` returns the logits as a DTensor sharded on the vocabulary (for
:func:`~vescale.parallel.vocab_parallel_cross_entropy`); otherwise the root returns plain logits of this rank's batch.

Fused projections (GPT-2's ``c_attn`` = [q | k | v], Mixtral's experts' ``gate_up_proj`` = [gate | up]) are sharded
with :class:`~vescale.dtensor.InterleavedShard` so every rank holds matching pieces of each part.
"""

from __future__ import annotations

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from vescale.core.errors import MeshError
from vescale.dtensor import InterleavedShard

__all__ = ["gpt_plan", "llama_plan", "qwen2_plan", "mixtral_plan", "gpt2_plan", "PLANS"]


class _Dims:
    """Placement builders for a mesh with a ``tp`` dim and an optional ``dp`` (batch) dim."""

    def __init__(self, mesh, tp: str, dp: str | None) -> None:
        names = tuple(mesh.mesh_dim_names or ())
        if tp not in names:
            raise MeshError(f"plan wants tensor-parallel mesh dim {tp!r} but the mesh has dims {list(names)}")
        self.names, self.tp = names, tp
        self.dp = dp if dp in names else None

    def param(self, p: Placement) -> list[Placement]:
        """``p`` on the tp dim, replicated elsewhere."""
        return [p if n == self.tp else Replicate() for n in self.names]

    def act(self, p: Placement) -> list[Placement]:
        """An activation: ``p`` on the tp dim, batch-sharded on dp, replicated elsewhere."""
        return [p if n == self.tp else Shard(0) if n == self.dp else Replicate() for n in self.names]


def _decoder_plan(d: _Dims, *, embed: str, layers: str, attn: str, qkv: list[str], o: str, mlp: str,
                  up: list[str], down: str | None, lm_head: str, attn_in: list | dict, mlp_in: list | dict,
                  biases: bool, sequence_parallel: bool, loss_parallel: bool) -> dict:
    """The Megatron layout of a pre-norm decoder; ``down=None`` leaves the MLP's parameters to the caller."""
    col, row = d.param(Shard(0)), d.param(Shard(1))
    params = {rf"{embed}\.weight": col}
    for name in qkv:
        params[rf"{layers}\.\d+\.{attn}\.{name}\.weight"] = col
        if biases:
            params[rf"{layers}\.\d+\.{attn}\.{name}\.bias"] = col
    params[rf"{layers}\.\d+\.{attn}\.{o}\.weight"] = row
    stream = d.act(Shard(1)) if sequence_parallel else d.act(Replicate())
    outputs = {
        embed: [stream],
        rf"{layers}\.\d+\.{attn}\.{o}": [stream],
        lm_head: [d.act(Shard(-1))],
        "": [None if loss_parallel else d.act(Replicate())],
    }
    inputs = {
        "": [d.act(Replicate())],
        # Block inputs are all-gathered (SP) or kept replicated (TP); either way their gradients are reduced there.
        rf"{layers}\.\d+\.{attn}": attn_in,
        rf"{layers}\.\d+\.{mlp}": mlp_in,
        lm_head: [d.act(Replicate())],
    }
    if down is not None:
        for name in up:
            params[rf"{layers}\.\d+\.{mlp}\.{name}\.weight"] = col
        params[rf"{layers}\.\d+\.{mlp}\.{down}\.weight"] = row
        outputs[rf"{layers}\.\d+\.{mlp}\.{down}"] = [stream]
    params[rf"{lm_head}\.weight"] = col
    return {"parameter": params, "input": inputs, "output": outputs}


def gpt_plan(mesh, *, tp: str = "tp", dp: str | None = "dp", sequence_parallel: bool = False,
             loss_parallel: bool = False) -> dict:
    """Plan for :class:`vescale.core.testing.models.GPT` (``forward(tokens) -> logits``).

    Needs ``n_head``, ``n_kv_head``, ``ffn_hidden`` and ``vocab_size`` divisible by the tp size. Tied embeddings are
    fine: ``embed.weight`` and ``lm_head.weight`` both get ``Shard(0)``.
    """
    d = _Dims(mesh, tp, dp)
    return _decoder_plan(d, embed="embed", layers="layers", attn="attn", qkv=["wq", "wk", "wv"], o="wo", mlp="mlp",
                         up=["w_gate", "w_up"], down="w_down", lm_head="lm_head",
                         attn_in=[d.act(Replicate()), None, None], mlp_in=[d.act(Replicate())], biases=False,
                         sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)


def _hf_plan(mesh, tp, dp, sequence_parallel, loss_parallel, *, biases: bool,
             down: str | None = "down_proj", num_key_value_heads: int | None = None) -> dict:
    d = _Dims(mesh, tp, dp)
    plan = _decoder_plan(d, embed="model.embed_tokens", layers="model.layers", attn="self_attn",
                         qkv=["q_proj", "k_proj", "v_proj"], o="o_proj", mlp="mlp", up=["gate_proj", "up_proj"],
                         down=down, lm_head="lm_head", attn_in={"hidden_states": d.act(Replicate())},
                         mlp_in=[d.act(Replicate())], biases=biases, sequence_parallel=sequence_parallel,
                         loss_parallel=loss_parallel)
    _hf_boundary(plan, d, loss_parallel)
    if num_key_value_heads is not None:
        _replicate_kv(plan, d, mesh, num_key_value_heads, biases)
    return plan


def _replicate_kv(plan: dict, d: _Dims, mesh, kv: int, biases: bool) -> None:
    """Fewer kv heads than tp ranks: ``k_proj``/``v_proj`` replicated on tp (see :mod:`vescale.parallel.kv_replicas`,
    whose setup, run by ``parallelize_module``, then keeps one kv head per rank in the cache)."""
    from vescale.parallel.kv_replicas import kv_head_layout

    if kv_head_layout(kv, mesh.size(d.names.index(d.tp))) == "replicate":
        for name in ("k_proj", "v_proj"):
            for attr in ("weight", "bias") if biases else ("weight",):
                # the key _decoder_plan wrote (same text), so the entry is replaced in place
                plan["parameter"][rf"model.layers\.\d+\.self_attn\.{name}\.{attr}"] = d.param(Replicate())


def _hf_boundary(plan: dict, d: _Dims, loss_parallel: bool) -> None:
    """Hugging Face models take keyword arguments and return a ModelOutput: name both by key."""
    batch = d.act(Replicate())
    plan["input"][""] = {"input_ids": batch, "labels": batch, "attention_mask": batch, "position_ids": batch}
    plan["output"][""] = {"logits": None if loss_parallel else batch}


def llama_plan(mesh, *, tp: str = "tp", dp: str | None = "dp", sequence_parallel: bool = False,
               loss_parallel: bool = False,
               num_key_value_heads: int | None = None) -> dict:
    """Plan for Hugging Face ``LlamaForCausalLM`` (call it with ``input_ids``; ``use_cache=False``).

    ``num_key_value_heads`` (the model's ``config.num_key_value_heads``; also for Qwen2 and Mixtral): when it is
    fewer than the tp size, ``k_proj``/``v_proj`` are replicated on tp instead of split inside a head, and
    ``parallelize_module`` makes the KV cache keep one kv head per rank (:mod:`vescale.parallel.kv_replicas`; no
    separate call). Raises ``PlanError`` if the kv heads neither divide over tp nor
    replicate over it. Omitted: k/v are sharded by rows whatever the head count (kv heads fewer than tp then split
    inside a head, which DTensor all-gathers at the head view: correct, but the cache is replicated)."""
    return _hf_plan(mesh, tp, dp, sequence_parallel, loss_parallel, biases=False,
                    num_key_value_heads=num_key_value_heads)


def qwen2_plan(mesh, *, tp: str = "tp", dp: str | None = "dp", sequence_parallel: bool = False,
               loss_parallel: bool = False,
               num_key_value_heads: int | None = None) -> dict:
    """Plan for Hugging Face ``Qwen2ForCausalLM``: Llama's, plus the q/k/v biases sharded with their weights."""
    return _hf_plan(mesh, tp, dp, sequence_parallel, loss_parallel, biases=True,
                    num_key_value_heads=num_key_value_heads)


def mixtral_plan(mesh, *, tp: str = "tp", dp: str | None = "dp", sequence_parallel: bool = False,
                 loss_parallel: bool = False,
                 num_key_value_heads: int | None = None) -> dict:
    """Plan for Hugging Face ``MixtralForCausalLM``: attention as Llama, each expert's FFN tensor-parallel.

    ``experts.gate_up_proj [E, 2F, D]`` is column-parallel with ``InterleavedShard(1, 2)`` (each rank holds matching
    gate and up rows), ``experts.down_proj [E, D, F]`` row-parallel; the router is replicated.
    """
    d = _Dims(mesh, tp, dp)
    plan = _hf_plan(mesh, tp, dp, sequence_parallel, loss_parallel, biases=False, down=None,
                    num_key_value_heads=num_key_value_heads)
    plan["parameter"][r"model\.layers\.\d+\.mlp\.experts\.gate_up_proj"] = d.param(InterleavedShard(1, 2))
    plan["parameter"][r"model\.layers\.\d+\.mlp\.experts\.down_proj"] = d.param(Shard(2))
    stream = d.act(Shard(1)) if sequence_parallel else d.act(Replicate())
    plan["output"][r"model\.layers\.\d+\.mlp"] = [stream]
    # The expert dispatch is data dependent (nonzero/where): run the experts on local shards. Every input feeds the
    # sharded expert FFNs, so each rank's input gradients are partial sums; the local result is too.
    partial = d.act(Partial())
    plan["local"] = {r"model\.layers\.\d+\.mlp\.experts": [partial, None, partial]}
    plan["output"][r"model\.layers\.\d+\.mlp\.experts"] = [partial]
    return plan


def gpt2_plan(mesh, *, tp: str = "tp", dp: str | None = "dp", sequence_parallel: bool = False,
              loss_parallel: bool = False) -> dict:
    """Plan for Hugging Face ``GPT2LMHeadModel``: ``Conv1D`` weights are ``[in, out]``, so column-parallel is
    ``Shard(1)`` and row-parallel ``Shard(0)``; the fused ``c_attn`` (q | k | v) uses ``InterleavedShard(1, 3)``.

    The token embedding ``wte`` is vocab-parallel and tied to ``lm_head``; position embeddings are replicated.
    """
    d = _Dims(mesh, tp, dp)
    fused, col, row = d.param(InterleavedShard(1, 3)), d.param(Shard(1)), d.param(Shard(0))
    params = {
        r"transformer\.wte\.weight": d.param(Shard(0)),
        r"lm_head\.weight": d.param(Shard(0)),
        r"transformer\.h\.\d+\.attn\.c_attn\.weight": fused,
        r"transformer\.h\.\d+\.attn\.c_attn\.bias": d.param(InterleavedShard(0, 3)),
        r"transformer\.h\.\d+\.attn\.c_proj\.weight": row,
        r"transformer\.h\.\d+\.mlp\.c_fc\.weight": col,
        r"transformer\.h\.\d+\.mlp\.c_fc\.bias": d.param(Shard(0)),
        r"transformer\.h\.\d+\.mlp\.c_proj\.weight": row,
    }
    stream = d.act(Shard(1)) if sequence_parallel else d.act(Replicate())
    outputs = {
        r"transformer\.wte": [d.act(Replicate())],
        r"transformer\.h\.\d+\.attn\.c_proj": [stream],
        r"transformer\.h\.\d+\.mlp\.c_proj": [stream],
        r"lm_head": [d.act(Shard(-1))],
    }
    plan = {"parameter": params, "input": {}, "output": outputs}
    _hf_boundary(plan, d, loss_parallel)
    if sequence_parallel:
        outputs[r"transformer\.drop"] = [stream]
        plan["input"][r"transformer\.h\.\d+\.attn"] = [d.act(Replicate())]
        plan["input"][r"transformer\.h\.\d+\.mlp"] = [d.act(Replicate())]
        plan["input"][r"lm_head"] = [d.act(Replicate())]
    return plan


#: Plan builders by model family name (for the training CLI and docs).
PLANS = {"gpt": gpt_plan, "llama": llama_plan, "qwen2": qwen2_plan, "mixtral": mixtral_plan, "gpt2": gpt2_plan}
