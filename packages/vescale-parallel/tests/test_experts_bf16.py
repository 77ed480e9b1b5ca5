"""Expert parallelism in bf16 against one device's bf16 run over the same rows.

bf16 top-k routing compares router probabilities computed from bf16 hidden states, so a last-bit difference of a
hidden state can switch a token whose k-th and (k+1)-th experts nearly tie: a discontinuous change of its output, of
the router's gradient through its top-k weights and of both experts' gradients. The dispatch therefore combines a
token's choices as the model's experts do (fp32 sum, one rounding): with Hugging Face's grouped experts the ep forward
is bitwise one device's (first test). Rounding each choice to bf16 before summing (the combine before) was one ulp
off per token, and on ``tools/train.py --model mixtral`` dp2 x ep2 (``--grad-accum 2 --activation-checkpointing
full``) one token of 128 switched in the last layer, whose router, experts and post-attention norm gradients were then
up to 9.4 % (norm) and 13.5 % (element) off one device; with the ep run's top-k forced to one device's, 1.5 %.

The second test (dp2 x ep2, ``DistributedDataParallel`` over the dp x ep mesh with fp32 gradient buffers, Hugging
Face's eager experts, whose own loop rounds each choice into a bf16 sum) forces the routing, so that a rounding flip
cannot decide it: a forward hook on each router records one device's top-k indices, and in the expert-parallel run
replaces the router's top-k by those indices, with the weights the router's own softmax gives them, renormalised
(as the router computes them). Everything else is the model's and vescale's: token dispatch,
the experts' FFN on each rank's received tokens, the weighted combine, DDP's reductions (dense gradients summed over
ep and averaged over dp, experts' averaged over dp). Bound: the bf16 one of ``integration_tests/test_train_matrix.py``
(``BF16_GRAD_TOL``): per parameter, the difference's norm relative to one device's gradient norm, and its largest
element relative to one device's largest element, both <= 2**-5. A dp sum for a mean (factor 2) or a wrong combine
weight misses it by far more.
"""

from __future__ import annotations

from vescale.core.testing import multi_rank

BF16_GRAD_TOL = 2**-5
LAYERS = 2


def _build():
    import torch

    from vescale.core.testing.models import tiny_mixtral

    return tiny_mixtral(0, num_hidden_layers=LAYERS, output_router_logits=True,
                        router_aux_loss_coef=0.1).to(torch.bfloat16)


def _batch():
    import torch

    g = torch.Generator().manual_seed(10)
    tokens = torch.randint(0, 64, (8, 16), generator=g)
    labels = torch.randint(0, 64, (8, 16), generator=g)
    labels[1, 5:] = -100
    return tokens, labels


def _routers(model):
    return [layer.mlp.gate for layer in model.model.layers]


def _reference(dp: int):
    """One device, bf16: the fp32 sum over the dp slices of the gradients of ``loss(slice) / dp``; the loss; and the
    router's top-k indices per slice and layer (``[tokens of the slice, k]``)."""
    import torch

    model = _build()
    tokens, labels = _batch()
    names = [n for n, _ in model.named_parameters()]
    chosen: list = []
    hooks = [r.register_forward_hook(lambda m, a, out: chosen.append(out[2].detach().clone()))
             for r in _routers(model)]
    grads, loss, top_k = {}, 0.0, []
    for x, y in zip(tokens.chunk(dp), labels.chunk(dp)):
        chosen.clear()
        part = model(input_ids=x, labels=y).loss / dp
        for name, g in zip(names, torch.autograd.grad(part, list(model.parameters()))):
            grads[name] = grads.get(name, 0) + g.float()
        loss += float(part)
        top_k.append(list(chosen))
    for h in hooks:
        h.remove()
    return grads, loss, top_k


def _pin(pinned: list, calls: list):
    """A router forward hook: its top-k indices replaced by the next of ``pinned`` (this rank's tokens), its weights
    by the router's own softmax probabilities at those indices, renormalised; counts its calls in ``calls``."""
    import torch
    from torch.distributed.tensor import DTensor

    def hook(module, args, out):
        logits, weights, index = out
        want = pinned[len(calls)]
        calls.append(module)
        local = logits.to_local() if isinstance(logits, DTensor) else logits
        chosen = torch.softmax(local.float(), dim=-1).gather(-1, want)
        chosen = chosen / chosen.sum(dim=-1, keepdim=True)
        if isinstance(weights, DTensor):
            chosen = DTensor.from_local(chosen, weights.device_mesh, weights.placements, run_check=False)
            want = DTensor.from_local(want, index.device_mesh, index.placements, run_check=False)
        return logits, chosen, want

    return hook


@multi_rank(world_sizes=[2])
def test_ep_bf16_forward_is_one_devices_with_grouped_experts():
    """ep=2, bf16, Hugging Face's grouped experts (``experts_implementation="grouped_mm"``, transformers' default),
    which sum a token's weighted choices in fp32 and round once: the dispatch combines likewise, so every MoE block's
    output, the logits and the loss are bitwise one device's (this CPU's matmuls give each row the same bits
    whatever the batch). Rounding each choice to bf16 before summing differs in the last bit of some tokens."""
    import torch

    from vescale.core.mesh import init_mesh
    from vescale.core.testing.models import tiny_mixtral
    from vescale.core.testing.reference import one_thread
    from vescale.parallel import parallelize_experts

    with one_thread():
        mesh = init_mesh({"ep": 2})
        r = mesh.get_local_rank("ep")
        models = [tiny_mixtral(0, experts_implementation="grouped_mm").to(torch.bfloat16) for _ in range(2)]
        outputs: list = [[], []]
        for model, store in zip(models, outputs):
            for layer in model.model.layers:
                layer.mlp.register_forward_hook(lambda m, a, out, store=store: store.append(out))
        ref, par = models
        parallelize_experts(par, mesh)
        tokens, labels = _batch()
        want = ref(input_ids=tokens, labels=labels)
        got = par(input_ids=tokens.chunk(2)[r], labels=labels.chunk(2)[r])
        assert len(outputs[0]) == len(outputs[1]) == 2
        for layer, (mine, whole) in enumerate(zip(outputs[1], outputs[0])):
            mine = mine.to_local() if hasattr(mine, "to_local") else mine
            differ = int((mine != whole.chunk(2)[r]).sum())
            assert differ == 0, f"layer {layer}: {differ} elements of the MoE output differ from one device's"
        logits = got.logits.to_local() if hasattr(got.logits, "to_local") else got.logits
        assert torch.equal(logits, want.logits.chunk(2)[r])
        assert torch.equal(got.loss.float(), want.loss.float()), (got.loss, want.loss)


@multi_rank(world_sizes=[4])
def test_dp_ep_bf16_with_one_devices_routing_matches_single_device():
    import torch
    import torch.distributed as dist

    from vescale.core.mesh import init_mesh, sub_mesh
    from vescale.core.testing.reference import one_thread
    from vescale.parallel import DDPOptions, DistributedDataParallel, parallelize_experts

    with one_thread():
        ref_grads, ref_loss, ref_top_k = _reference(dp=2)
        mesh = init_mesh({"dp": 2, "ep": 2})
        d, e = mesh.get_local_rank("dp"), mesh.get_local_rank("ep")
        model = _build()
        calls: list = []
        pinned = [layer.chunk(2)[e] for layer in ref_top_k[d]]  # this rank's tokens: the ep half of its dp slice
        for router in _routers(model):
            router.register_forward_hook(_pin(pinned, calls))
        model = parallelize_experts(model, sub_mesh(mesh, "ep"))
        ddp = DistributedDataParallel(model, mesh, DDPOptions(grad_dtype=torch.float32))
        tokens, labels = _batch()
        x, y = tokens.chunk(2)[d].chunk(2)[e], labels.chunk(2)[d].chunk(2)[e]
        loss = ddp(input_ids=x, labels=y).loss  # the dp slice's loss, on every ep rank of it
        loss.backward()
        assert len(calls) == LAYERS  # every router's top-k was pinned, once
        mean = loss.detach().float()
        dist.all_reduce(mean, group=mesh.get_group("dp"))
        assert abs(float(mean) / 2 - ref_loss) <= 2**-6 * abs(ref_loss), (float(mean) / 2, ref_loss)
        reduced = ddp.reduced_grads()
        assert sorted(reduced) == sorted(ref_grads)
        for name, ref in ref_grads.items():
            got = reduced[name].full_tensor().float()
            assert got.dtype == torch.float32 and got.shape == ref.shape, (name, got.dtype, got.shape)
            diff = got - ref
            rel_norm = float(diff.norm() / ref.norm())
            rel_elt = float(diff.abs().max() / ref.abs().max())
            assert rel_norm <= BF16_GRAD_TOL and rel_elt <= BF16_GRAD_TOL, (
                f"dp2 x ep2 bf16, routing pinned: gradient of {name} is off by {rel_norm:.3g} in norm and "
                f"{rel_elt:.3g} at its largest element (bound {BF16_GRAD_TOL}); norm ratio to one device "
                f"{float(got.norm() / ref.norm()):.6g}")
