"""Benchmark vescale's tensor-parallel generation against PyTorch's own TP of the same model, same ranks, one run.

    python tools/bench/generate.py [--small] [--tp 2] [--repeats N] [--new-tokens N]

``model.generate`` (greedy, the default dynamic cache) of an unmodified Hugging Face ``LlamaForCausalLM`` at two sizes:
a small one (dispatch-bound, like a GPU decode step: 0.11M parameters) and a larger one (6.5M parameters,
``--small`` skips it), on a ``tp`` mesh:

* vescale: ``vescale.parallel.parallelize_module`` with ``llama_plan`` (DTensor activations between the blocks, the
  attention and MLP blocks on local tensors by the fast path of :class:`vescale.parallel.fast.FastBlock`, plain
  tensors at the model's boundary, the KV cache sharded by heads);
* torch: ``torch.distributed.tensor.parallel.parallelize_module`` with Colwise q/k/v/gate/up, Rowwise o/down, a
  vocab-parallel embedding and a column-parallel lm head gathered to plain logits (local activations inside: the
  model sees plain tensors of its own heads).

Both run in the same rank processes, interleaved (vescale, torch, vescale, ...) so machine noise hits both. Times
come from a streamer's callbacks: prefill (prompt in, first token out) and the mean decode step after it; the median
over repeats of the slowest rank. Reports the ratio vescale / torch for both (the issue's target: decode step <= 1.1)
and whether both produced the same tokens. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

SIZES = {
    "small": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128),
    "large": dict(vocab_size=4096, hidden_size=256, intermediate_size=704, num_hidden_layers=6,
                  num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256),
}


def _torch_tp(model, mesh):
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
            "lm_head": ColwiseParallel(output_layouts=Replicate())}
    for i in range(len(model.model.layers)):
        p = f"model.layers.{i}."
        plan.update({p + f"self_attn.{n}": ColwiseParallel() for n in ("q_proj", "k_proj", "v_proj")})
        plan.update({p + f"mlp.{n}": ColwiseParallel() for n in ("gate_proj", "up_proj")})
        plan[p + "self_attn.o_proj"] = RowwiseParallel()
        plan[p + "mlp.down_proj"] = RowwiseParallel()
    return parallelize_module(model, mesh, plan)


class _Timer:
    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def _rank_main(size: str, tp: int, batch: int, prompt_len: int, new_tokens: int, repeats: int) -> dict:
    import copy

    import torch
    import torch.distributed as dist
    import transformers as tf

    from vescale.core.mesh import init_mesh
    from vescale.parallel import llama_plan, parallelize_module

    torch.set_num_threads(1)
    mesh = init_mesh({"tp": tp})
    torch.manual_seed(0)
    base = tf.LlamaForCausalLM(tf.LlamaConfig(**SIZES[size])).eval()
    n_params = sum(p.numel() for p in base.parameters())
    ours = parallelize_module(copy.deepcopy(base), mesh, llama_plan(mesh))
    theirs = _torch_tp(copy.deepcopy(base), mesh)
    ids = torch.randint(3, SIZES[size]["vocab_size"], (batch, prompt_len), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)

    def run(model) -> tuple[float, float, list]:
        timer = _Timer()
        dist.barrier()
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, streamer=timer)
        t = timer.times
        return t[1] - t[0], (t[-1] - t[1]) / (len(t) - 2), out.tolist()

    run(ours), run(theirs)  # warm-up
    prefill, step, same = {"vescale": [], "torch": []}, {"vescale": [], "torch": []}, True
    for _ in range(repeats):
        p_o, s_o, tok_o = run(ours)
        p_t, s_t, tok_t = run(theirs)
        prefill["vescale"].append(p_o), prefill["torch"].append(p_t)
        step["vescale"].append(s_o), step["torch"].append(s_t)
        same &= tok_o == tok_t
    med = torch.tensor([statistics.median(prefill["vescale"]), statistics.median(prefill["torch"]),
                        statistics.median(step["vescale"]), statistics.median(step["torch"])], dtype=torch.float64)
    dist.all_reduce(med, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
    p_o, p_t, s_o, s_t = med.tolist()
    return {"size": size, "tp": tp, "params": n_params, "batch": batch, "prompt_len": prompt_len,
            "new_tokens": new_tokens, "vescale_prefill_s": round(p_o, 5), "torch_prefill_s": round(p_t, 5),
            "prefill_ratio": round(p_o / p_t, 3), "vescale_decode_step_s": round(s_o, 5),
            "torch_decode_step_s": round(s_t, 5), "vescale_decode_tokens_per_s": round(batch / s_o, 1),
            "torch_decode_tokens_per_s": round(batch / s_t, 1), "decode_step_ratio": round(s_o / s_t, 3),
            "same_tokens": same}


def main() -> None:
    from vescale.core.launch import spawn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="the small size only, few repeats (nox bench)")
    parser.add_argument("--tp", type=int, nargs="+", default=[2])
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=32)
    args = parser.parse_args()
    repeats = args.repeats or (2 if args.small else 5)
    sizes = ["small"] if args.small else ["small", "large"]
    results = [spawn(_rank_main, tp, size, tp, args.batch, args.prompt_len, args.new_tokens, repeats)
               for size in sizes for tp in args.tp]
    print(json.dumps({"benchmark": "generate", "small": args.small, "repeats": repeats, "results": results}))


if __name__ == "__main__":
    main()
