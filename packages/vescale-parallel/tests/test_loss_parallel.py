"""Vocab-parallel cross-entropy against ``F.cross_entropy`` on the full logits, on 1-D and 2-D meshes.

Values and logits gradients: ``assert_close(rtol=1e-5, atol=1e-6)`` (the log-sum-exp is reduced in a different
order, so not bitwise). Covers reductions none/sum/mean, ``ignore_index``, ``label_smoothing``, an uneven vocab
split, batch sharding on a dp mesh dim, and ``loss_parallel()`` routing ``F.cross_entropy``/``nn.CrossEntropyLoss``.
"""

from __future__ import annotations

import pytest

from vescale.core.testing import multi_rank

RTOL, ATOL = 1e-5, 1e-6


def _check(mesh, logits_placements, vocab: int, *, smoothing: float, reduction: str, via: str,
           ignore_index: int = -100, ignored_rows: int = 0):
    import torch
    import torch.nn.functional as F
    from torch.distributed.tensor import distribute_tensor

    from vescale.parallel import loss_parallel, vocab_parallel_cross_entropy

    g = torch.Generator().manual_seed(vocab)
    full = torch.randn(6, 5, vocab, generator=g) * 3
    target = torch.randint(0, vocab, (6, 5), generator=g)
    target[0, :2] = ignore_index
    target[3, 4] = ignore_index
    target[:ignored_rows] = ignore_index
    ref_in = full.clone().requires_grad_()
    ref = F.cross_entropy(ref_in.flatten(0, 1), target.flatten(), label_smoothing=smoothing, reduction=reduction,
                          ignore_index=ignore_index)
    ref.backward(torch.ones_like(ref))

    logits = distribute_tensor(full, mesh, logits_placements).requires_grad_()
    tgt = distribute_tensor(target, mesh, _target_placements(logits_placements))
    if via == "function":
        loss = vocab_parallel_cross_entropy(logits, tgt, label_smoothing=smoothing, reduction=reduction,
                                            ignore_index=ignore_index)
        if reduction == "none":
            loss = loss.flatten(0, 1)
    else:
        flat, flat_t = logits.flatten(0, 1), tgt.flatten(0, 1)
        with loss_parallel():
            if via == "F":
                loss = F.cross_entropy(flat, flat_t, label_smoothing=smoothing, reduction=reduction,
                                       ignore_index=ignore_index)
            else:
                loss = torch.nn.CrossEntropyLoss(label_smoothing=smoothing, reduction=reduction)(flat, flat_t)
    loss.backward(torch.ones_like(loss))  # outside the context: no context needed in backward
    torch.testing.assert_close(loss.full_tensor(), ref.detach(), rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(logits.grad.full_tensor(), ref_in.grad, rtol=RTOL, atol=ATOL)


def _target_placements(logits_placements):
    from torch.distributed.tensor import Replicate

    return [Replicate() if p.is_shard(2) else p for p in logits_placements]


@multi_rank(world_sizes=[2, 4])
def test_vocab_parallel_cross_entropy_matches_full(world_size):
    from torch.distributed.tensor import Replicate, Shard

    from vescale.core.mesh import init_mesh

    if world_size == 2:
        mesh = init_mesh({"tp": 2})
        for vocab in (16, 7):  # even and uneven split of the vocabulary
            for smoothing in (0.0, 0.2):
                for reduction in ("mean", "sum", "none"):
                    _check(mesh, [Shard(2)], vocab, smoothing=smoothing, reduction=reduction, via="function")
        _check(mesh, [Shard(2)], 16, smoothing=0.1, reduction="mean", via="F")
        _check(mesh, [Shard(2)], 16, smoothing=0.0, reduction="sum", via="module")
        _check(mesh, [Replicate()], 16, smoothing=0.1, reduction="mean", via="function")  # vocab not sharded
    else:
        mesh = init_mesh({"dp": 2, "tp": 2})
        for reduction in ("mean", "none"):
            _check(mesh, [Shard(0), Shard(2)], 10, smoothing=0.1, reduction=reduction, via="function")
        _check(mesh, [Shard(2), Shard(0)], 16, smoothing=0.0, reduction="mean", via="F")  # tp dim first
        mesh4 = init_mesh({"tp": 4})
        _check(mesh4, [Shard(2)], 10, smoothing=0.3, reduction="mean", via="function")  # chunks 3, 3, 3, 1


@multi_rank(world_sizes=[4])
def test_vocab_parallel_cross_entropy_ignores_a_whole_dp_rank(world_size):
    """Uneven trained tokens over dp (dp rank 0's rows all ignored): the mean is over the global batch's trained
    tokens; ``ignore_index`` may also be a class id (7), which then never counts as a target on its vocab owner."""
    from torch.distributed.tensor import Shard

    from vescale.core.mesh import init_mesh

    mesh = init_mesh({"dp": 2, "tp": 2})
    for ignore_index in (-100, 7):
        for reduction in ("mean", "sum"):
            _check(mesh, [Shard(0), Shard(2)], 10, smoothing=0.0, reduction=reduction, via="function",
                   ignore_index=ignore_index, ignored_rows=3)
        _check(mesh, [Shard(0), Shard(2)], 10, smoothing=0.1, reduction="mean", via="F", ignore_index=ignore_index,
               ignored_rows=3)


@multi_rank(world_sizes=[2])
def test_vocab_parallel_cross_entropy_errors():
    import torch
    import torch.nn.functional as F
    from torch.distributed.tensor import Shard, distribute_tensor

    from vescale.core.mesh import init_mesh
    from vescale.parallel import LossParallelError, loss_parallel, vocab_parallel_cross_entropy

    mesh = init_mesh({"tp": 2})
    logits = distribute_tensor(torch.randn(4, 8), mesh, [Shard(1)])
    with pytest.raises(LossParallelError, match="DTensor logits"):
        vocab_parallel_cross_entropy(torch.randn(4, 8), torch.zeros(4, dtype=torch.long))
    with pytest.raises(LossParallelError, match=r"target piece \(3,\)"):
        vocab_parallel_cross_entropy(logits, torch.zeros(3, dtype=torch.long))
    with pytest.raises(LossParallelError, match="reduction"):
        vocab_parallel_cross_entropy(logits, torch.zeros(4, dtype=torch.long), reduction="avg")
    with loss_parallel(), pytest.raises(LossParallelError, match="class weights"):
        F.cross_entropy(logits, torch.zeros(4, dtype=torch.long), weight=torch.ones(8))
    # plain tensors are untouched inside the context
    with loss_parallel():
        plain = F.cross_entropy(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long))
    assert type(plain) is torch.Tensor and abs(plain.item() - torch.log(torch.tensor(3.0)).item()) < 1e-6
