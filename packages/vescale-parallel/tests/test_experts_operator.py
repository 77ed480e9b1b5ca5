"""Expert parallelism as one operator (:func:`vescale.parallel.experts.experts_as_operator`), the form pipelines use.

A tiny unmodified Hugging Face Mixtral (fp32, eager experts, no load-balancing term: with plain per-rank tensors the
router sees only its rank's rows) on ep=2: each rank keeps its two of the four experts as plain tensors
(``keep_local_experts``) and runs the model on its own rows, backpropagating its share of the loss (its rows' mean /
ep) through ``DistributedDataParallel`` over the mesh (the experts marked pieces over ep) over dp=1 x ep=2; the
mean of the ranks' losses, every dense gradient (summed over ep by DDP) and each rank's slice of every expert gradient
(summed over ep by the all-to-all) equal the untouched model's on the whole batch in this process (rtol 1e-5).
``torch.export`` of the model keeps each MoE block's dispatch as one ``vescale::ep_experts`` node (what lets
``vescale.pipe.split`` cut stages through it; the pp x ep run against one device is the matrix cell in
``integration_tests/test_train_matrix.py``).
"""

from __future__ import annotations

from vescale.core.testing import multi_rank

RTOL, ATOL = 1e-5, 1e-6
LAYERS = 2


def _build(seed: int = 0):
    from vescale.core.testing.models import tiny_mixtral

    return tiny_mixtral(seed, num_hidden_layers=LAYERS, use_cache=False)


@multi_rank(world_sizes=[2])
def test_operator_dispatch_matches_single_device_and_exports_as_one_node():
    import copy

    import torch

    from vescale.core.mesh import init_mesh
    from vescale.parallel import DistributedDataParallel
    from vescale.parallel.experts import experts_as_operator, keep_local_experts

    mesh = init_mesh({"dp": 1, "ep": 2})
    rank = mesh.get_local_rank("ep")
    ref = _build()
    par = copy.deepcopy(ref)
    g = torch.Generator().manual_seed(1)
    tokens, labels = torch.randint(0, 64, (4, 8), generator=g), torch.randint(0, 64, (4, 8), generator=g)
    ref(input_ids=tokens, labels=labels).loss.backward()

    experts = experts_as_operator(par, mesh)
    exported = torch.export.export(par, (), {"input_ids": tokens.chunk(2)[rank]}, strict=False)
    ops = [n for n in exported.graph.nodes if n.op == "call_function" and "ep_experts" in str(n.target)]
    assert len(ops) == LAYERS, f"{len(ops)} vescale::ep_experts nodes in the captured graph, expected {LAYERS}"

    replaced = keep_local_experts(par, experts, mesh)
    assert sorted(replaced) == sorted(f for info in experts for f in info.params) and len(replaced) == 2 * LAYERS
    ddp = DistributedDataParallel(par, mesh)  # the experts: marked pieces over ep
    loss = ddp(input_ids=tokens.chunk(2)[rank], labels=labels.chunk(2)[rank]).loss
    (loss / 2).backward()  # this rank's share; DDP reduces in backward (.grad: its fp32 buffer)
    named = list(par.named_parameters())

    total = loss.detach().clone()
    torch.distributed.all_reduce(total, group=mesh.get_group("ep"))
    ref_params = dict(ref.named_parameters())
    torch.testing.assert_close(total / 2, ref(input_ids=tokens, labels=labels).loss.detach(), rtol=RTOL, atol=ATOL)
    for name, p in named:
        want = ref_params[name].grad
        if name in replaced:  # this rank's experts: rows [2 rank, 2 rank + 2) of the stacked weights
            assert p.shape[0] == 2, (name, p.shape)
            want = want[2 * rank:2 * rank + 2]
        torch.testing.assert_close(p.grad, want, rtol=RTOL, atol=ATOL, msg=lambda m, name=name: f"{name}: {m}")
