"""What a checkpoint sees of plain-tensor expert parallelism (:mod:`vescale.parallel.expert_state`): on ep=2 each rank's
``[E / ep, ...]`` experts (``keep_local_experts``) and their AdamW state are boxes of the global ``[E, ...]`` tensors
at rows ``[r E / ep, (r + 1) E / ep)``, whose data share the local tensors' storage; a sharded optimizer's boxes
in local coordinates are moved there; a model whose experts were not cut, or a box of another shape, is refused
naming the FQN. The end-to-end checks (saved on pp2 x ep2, resumed on ep=2, pp2 x ep2 and one process, exported to
Hugging Face layout) are in ``integration_tests/test_train_matrix.py``.
"""

from __future__ import annotations

import pytest

from vescale.core.testing import multi_rank


@multi_rank(world_sizes=[2])
def test_local_experts_are_rows_of_the_global_tensor_sharing_storage():
    import torch

    from vescale.core.mesh import init_mesh
    from vescale.core.sharded_state import Box, ShardedTensor
    from vescale.core.testing.models import tiny_mixtral
    from vescale.parallel.errors import ExpertParallelError
    from vescale.parallel.expert_state import LocalExpertsShardedOptimizer, local_experts_state
    from vescale.parallel.experts import experts_as_operator, keep_local_experts

    mesh = init_mesh({"dp": 1, "ep": 2})
    rank = mesh.get_local_rank("ep")
    model = tiny_mixtral(0, use_cache=False)
    whole = {n: p.detach().clone() for n, p in model.named_parameters()}
    experts = experts_as_operator(model, mesh)
    with pytest.raises(ExpertParallelError, match=r"model\.layers\.0\.mlp\.experts\.gate_up_proj has shape \(4,"):
        local_experts_state([model], None, experts, mesh)  # not cut to this rank's experts yet
    replaced = keep_local_experts(model, experts, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()

    state = local_experts_state([model], opt, experts, mesh)
    sd, osd = state["model"].sharded_state_dict(), state["optim"].sharded_state_dict()
    params = dict(model.named_parameters())
    for fqn in replaced:
        st = sd[fqn]
        assert isinstance(st, ShardedTensor) and st.global_shape == whole[fqn].shape, (fqn, st)
        (box,) = st.boxes
        assert box.offsets == (2 * rank, 0, 0) and box.lengths == tuple(params[fqn].shape), (fqn, box.offsets)
        assert box.data.data_ptr() == params[fqn].data_ptr() and st.updated_by_step
        ex = osd[f"state.{fqn}.exp_avg"]
        assert ex.global_shape == whole[fqn].shape and ex.boxes[0].offsets == (2 * rank, 0, 0), fqn
        assert ex.boxes[0].data.data_ptr() == opt.state[params[fqn]]["exp_avg"].data_ptr()
        assert osd[f"state.{fqn}.step"].global_shape == ()
    dense = "model.embed_tokens.weight"
    assert sd[dense].boxes[0].offsets == (0, 0) and sd[dense].global_shape == whole[dense].shape
    assert osd[f"param_groups.{dense}"]["lr"] == 1e-2

    class _Sharded:  # a ZeRO-like optimizer: a box of the local [2, ...] tensor, in its local coordinates
        def __init__(self, t):
            self.t = t

        def sharded_state_dict(self):
            return {f"state.{fqn}.exp_avg": ShardedTensor(tuple(self.t.shape), self.t.dtype,
                                                          [Box((1, 0, 0), (1, *self.t.shape[1:]), self.t[1:])]),
                    f"state.{fqn}.step": ShardedTensor((), torch.float32, [Box((), (), torch.tensor(1.0))])}

        def load_sharded_state_dict(self, state):
            pass

    fqn = replaced[0]
    moved = LocalExpertsShardedOptimizer(_Sharded(params[fqn].detach()), state["model"].layout).sharded_state_dict()
    (box,) = moved[f"state.{fqn}.exp_avg"].boxes
    assert moved[f"state.{fqn}.exp_avg"].global_shape == whole[fqn].shape and box.offsets == (2 * rank + 1, 0, 0)
    assert moved[f"state.{fqn}.step"].global_shape == ()
    bad = _Sharded(params[fqn].detach()[:, :3])
    with pytest.raises(ExpertParallelError, match="neither the local expert tensor"):
        LocalExpertsShardedOptimizer(bad, state["model"].layout).sharded_state_dict()
