"""Plain-tensor experts as pieces of their global tensors: the one annotation
(``vescale.core.sharded_state.mark_piece``) that :func:`~vescale.parallel.keep_local_experts` sets and ZeRO reads.

On dp1 x ep2 (2 ranks) a tiny Hugging Face Mixtral gets the experts operator and keeps each ep rank's two of four
experts as plain ``[2, ...]`` tensors. Checked: each kept parameter's mark (global shape ``[4, ...]``, offsets at its
rows ``[2 r, 2 r + 2)``, the ep group) and its values (those rows of the whole model's); then, after one ZeRO-1 AdamW
step over DDP on the dp x ep mesh, the optimizer's ``sharded_state_dict`` places each expert's ``exp_avg`` in
the global tensor's coordinates at those rows (data: AdamW's first moment, ``(1 - beta1)`` times the reduced
gradient, compared elementwise), the dense parameters' boxes stay in their own tensors, each master piece is marked
with the groups a clip norm sums it over, and a parameter marked ``counts_in_norm=False`` passes that on to its
master. Checkpoints of this layout (saved on ep=2, loaded on one process and back) are in
``integration_tests/test_checkpoint_plain_pieces.py``.
"""

from __future__ import annotations

from vescale.core.testing import multi_rank


@multi_rank(world_sizes=[2])
def test_kept_experts_are_marked_rows_of_the_global_tensor_and_zero_places_their_state_there():
    import torch
    import torch.distributed as dist

    from vescale.core.mesh import init_mesh
    from vescale.core.sharded_state import ShardedTensor, mark_piece, piece_of
    from vescale.core.testing.models import tiny_mixtral
    from vescale.parallel import DistributedDataParallel, DistributedOptimizer
    from vescale.parallel.experts import experts_as_operator, keep_local_experts

    mesh = init_mesh({"dp": 1, "ep": 2})
    r = mesh.get_local_rank("ep")
    model = tiny_mixtral(0, use_cache=False)
    whole = {n: p.detach().clone() for n, p in model.named_parameters()}
    replaced = keep_local_experts(model, experts_as_operator(model, mesh), mesh)
    params = dict(model.named_parameters())
    assert len(replaced) == 4  # two expert tensors per MoE block, two blocks
    for fqn in replaced:
        mark = piece_of(params[fqn])
        assert mark.global_shape == tuple(whole[fqn].shape) and mark.offsets == (2 * r, 0, 0), (fqn, mark)
        assert list(mark.group_map) == ["ep"] and dist.get_process_group_ranks(mark.group_map["ep"]) == [0, 1]
        assert mark.counts_in_norm
        assert torch.equal(params[fqn].detach(), whole[fqn][2 * r:2 * r + 2]), fqn
    frozen = "model.norm.weight"  # as a pipeline engine marks a tied weight's later copies
    mark_piece(params[frozen], counts_in_norm=False)

    ddp = DistributedDataParallel(model, mesh)
    opt = DistributedOptimizer(ddp, torch.optim.AdamW(model.parameters(), lr=1e-2), zero_stage=1)
    g = torch.Generator().manual_seed(3)
    tokens, labels = torch.randint(0, 64, (4, 8), generator=g), torch.randint(0, 64, (4, 8), generator=g)
    (ddp(input_ids=tokens.chunk(2)[r], labels=labels.chunk(2)[r]).loss / 2).backward()
    grads = ddp.reduced_grads()
    opt.step()

    for pc in opt.pieces.values():
        mark = piece_of(pc.master)
        want = {"ep"} if pc.fqn in replaced else {"dp+ep"}  # (dp has one rank: nothing to sum over it)
        assert set(mark.group_map) == want, (pc.fqn, mark)
        assert mark.counts_in_norm == (pc.fqn != frozen), pc.fqn
    sd = opt.sharded_state_dict()
    shards = opt.state_dict()["shards"]
    for fqn in replaced:
        st = sd[f"state.{fqn}.exp_avg"]
        assert isinstance(st, ShardedTensor) and st.global_shape == tuple(whole[fqn].shape), (fqn, st.global_shape)
        assert shards[fqn]["global_shape"] == list(whole[fqn].shape)
        assert sum(b.data.numel() for b in st.boxes) == params[fqn].numel()  # this rank's rows, all of them
        for box in st.boxes:
            assert 2 * r <= box.offsets[0] and box.offsets[0] + box.lengths[0] <= 2 * r + 2, (fqn, box.offsets)
            rows = tuple(slice(o - (2 * r if d == 0 else 0), o - (2 * r if d == 0 else 0) + n)
                         for d, (o, n) in enumerate(zip(box.offsets, box.lengths)))
            torch.testing.assert_close(box.data, 0.1 * grads[fqn][rows], rtol=1e-6, atol=0, msg=fqn)
        assert sd[f"state.{fqn}.step"].global_shape == ()
    held = 0
    for fqn in sorted(set(whole) - set(replaced)):  # dense: flat ranges of the whole tensor over dp x ep
        lo, hi = shards[fqn]["ranges"][r]
        assert shards[fqn]["global_shape"] == list(whole[fqn].shape), fqn
        st = sd.get(f"state.{fqn}.exp_avg")
        assert (st is None) == (hi == lo), fqn  # a rank holding nothing of a parameter lists none of its state
        if st is not None:
            assert st.global_shape == tuple(whole[fqn].shape) and sum(b.data.numel() for b in st.boxes) == hi - lo
            held += 1
    assert held > 0
