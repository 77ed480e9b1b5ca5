"""Benchmark context parallelism: activation memory per rank and step time against sequence length, cp = 1, 2, 4.

    python tools/bench/cp.py [--small] [--seq-lens 512 1024 2048] [--cp 1 2 4] [--steps N] [--documents N]

One training step (forward with the model's own loss, backward) of an unmodified Hugging Face Llama (4 layers, hidden
256, 8 heads / 4 kv heads; ``--small``: 2 layers, hidden 64) under :func:`vescale.parallel.context_parallel`, batch 1,
fp32, on ``cp`` CPU ranks (cp = 1: the plain model on one pooled rank). Reported per (sequence length, cp):

* ``activation_mb``: the bytes the step's forward saves for backward on a rank (every tensor autograd keeps but the
  parameters, counted once per storage, via ``torch.autograd.graph.saved_tensors_hooks``), which is what the
  activations cost in memory whatever the allocator (CPU torch keeps no allocator statistics). It must fall as
  ``1 / cp``, except the keys and values each layer gathers over cp, which every rank holds whole (the attention is
  blockwise, so no ``S/cp x S`` term: the ratio to cp = 1 stays constant as the sequence grows);
* ``ratio_to_cp1``: that figure over cp = 1's, next to the ideal ``1 / cp``;
* ``step_ms``: median step time of the slowest rank;
* with ``--documents N`` (the cost of document masking): each row packed as ``N`` equal documents (``position_ids``
  restarting per document, no attention mask, no cache: transformers' packed rows, masked per document on one device
  and by vescale's blockwise cp kernel) and measured again, ``masked_step_ms`` / ``masked_activation_mb``. The
  attention FLOPs do not change (no block is skipped by document); the mask adds ``S x S`` comparisons per layer
  (one device: a ``[1, 1, S, S]`` bool mask, ``mask_mb``; cp: ``c x c`` per block, none kept).

Torch's own ``torch.distributed.tensor.experimental.context_parallel`` is tried on the same model on 2 ranks; it
implements ring attention for the CUDA attention kernels only, so on CPU the bench records what it does (the error,
a hang past ``--torch-timeout``, or whether its logits differ from one device) rather than a time. (Seen with torch
2.13: CPU sdpa's ``aten._scaled_dot_product_flash_attention_for_cpu`` has neither a ring handler nor a DTensor
sharding strategy; one rank raises ``NotImplementedError`` while the other waits in an all-gather: a hang.)

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def _model(small: bool):
    import torch
    import transformers as tf

    torch.manual_seed(0)
    size = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2) if small else dict(
        hidden_size=256, intermediate_size=704, num_hidden_layers=4)
    config = tf.LlamaConfig(vocab_size=1024, num_attention_heads=8, num_key_value_heads=4,
                            max_position_embeddings=8192, attn_implementation="sdpa", **size)
    return tf.LlamaForCausalLM(config).train()


def _measure(small: bool, seq_len: int, steps: int, cp: int, documents: int = 0) -> dict:
    import torch
    import torch.distributed as dist

    from vescale.core.testing.reference import saved_activation_bytes

    model = _model(small)
    if cp > 1:
        from vescale.core.mesh import init_mesh
        from vescale.parallel import context_parallel

        context_parallel(model, init_mesh({"cp": cp}))
    tokens = torch.randint(0, 1024, (1, seq_len), generator=torch.Generator().manual_seed(1))
    packed = {}
    if documents:  # packed rows: positions restart per document (what --document-mask gives a transformers model)
        packed = {"position_ids": (torch.arange(seq_len) % -(-seq_len // documents)).unsqueeze(0),
                  "use_cache": False}

    def step():
        return model(input_ids=tokens, labels=tokens, **(packed or {"use_cache": None if cp > 1 else False})).loss

    activation = saved_activation_bytes(model, step)
    times = []
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        if cp > 1:
            dist.barrier()
        t0 = time.perf_counter()
        step().backward()
        times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    if cp > 1:
        worst = torch.tensor([step_s])
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        step_s = float(worst)
    return {"activation_mb": round(activation / 2**20, 2), "step_ms": round(step_s * 1e3, 1)}


def _torch_context_parallel(small: bool, seq_len: int) -> str:
    """What torch's experimental context_parallel does with this model on CPU ranks (a short description)."""
    import torch
    from torch.distributed.tensor.experimental import context_parallel

    from vescale.core.mesh import init_mesh

    model = _model(small)
    tokens = torch.randint(0, 1024, (1, seq_len), generator=torch.Generator().manual_seed(1))
    reference = model(input_ids=tokens, use_cache=False).logits.detach()
    mesh = init_mesh({"cp": 2})
    positions = torch.arange(seq_len).unsqueeze(0)
    ids = tokens.clone()
    try:
        with context_parallel(mesh, buffers=[ids, positions], buffer_seq_dims=[1, 1]):
            logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits.detach()
    except Exception as exc:  # noqa: BLE001 - the bench reports what torch does, whatever it raises
        return f"raised {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    rank = mesh.get_local_rank()
    # torch's load balancer on by default for causal sdpa: this rank's chunks are r and 2cp-1-r of 2cp
    from vescale.parallel.context_parallel import local_positions

    expected = reference[:, local_positions(seq_len, 2, rank)]
    if logits.shape != expected.shape:
        return f"ran; logits shape {tuple(logits.shape)}, expected {tuple(expected.shape)}"
    err = float((logits - expected).abs().max())
    verdict = " (wrong: CPU attention not intercepted)" if err > 1e-4 else ""
    return f"ran; max |logit - one device| {err:.2e}{verdict}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="tiny model and short sequences (the nox bench session)")
    parser.add_argument("--seq-lens", type=int, nargs="+", default=None)
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--documents", type=int, default=0, metavar="N",
                        help="also measure each row packed as N documents, masked per document")
    parser.add_argument("--torch-timeout", type=float, default=120, help="seconds given to torch's context_parallel")
    args = parser.parse_args()
    seq_lens = args.seq_lens or ([128, 256] if args.small else [512, 1024, 2048])

    from vescale.core.errors import RankError, RankTimeoutError
    from vescale.core.testing import run_on_ranks

    rows = []
    for seq_len in seq_lens:
        base = None
        for cp in args.cp:
            result = run_on_ranks(_measure, cp, args.small, seq_len, args.steps, cp)[0]  # cp = 1: one pooled rank
            base = base or result["activation_mb"]
            row = {"seq_len": seq_len, "cp": cp, **result,
                   "ratio_to_cp1": round(result["activation_mb"] / base, 3), "ideal": round(1 / cp, 3)}
            if args.documents:
                masked = run_on_ranks(_measure, cp, args.small, seq_len, args.steps, cp, args.documents)[0]
                row.update(documents=args.documents, masked_step_ms=masked["step_ms"],
                           masked_activation_mb=masked["activation_mb"],
                           mask_mb=round(seq_len * seq_len / 2**20, 2) if cp == 1 else 0.0)
            rows.append(row)
    try:
        torch_cp = run_on_ranks(_torch_context_parallel, 2, args.small, seq_lens[0], timeout=args.torch_timeout)[0]
    except (RankError, RankTimeoutError) as exc:  # torch's attempt hanging or failing is the finding
        torch_cp = f"failed: {str(exc).splitlines()[0][:200]}"
    print(json.dumps({"rows": rows, "torch_context_parallel_on_cpu": torch_cp}))


if __name__ == "__main__":
    main()
