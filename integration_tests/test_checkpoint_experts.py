"""Expert-parallel ZeRO checkpoints that reshard across ep sizes: dp2 x ep2 ZeRO-2 saved, then loaded on dp2 x ep2
(bitwise the saved state), on dp1 x ep4 (ZeRO-2: the dense state sharded over 4 ranks, each rank one expert) and on
one process into the plain model with a plain ``torch.optim.AdamW``; each continues one step and matches an
independent single-device run.

An integration test: vescale-parallel builds the run (:func:`~vescale.parallel.parallelize_experts` over ``ep``,
``DistributedDataParallel`` over the dp x ep mesh, :class:`~vescale.parallel.DistributedOptimizer`), vescale-checkpoint
saves and loads it knowing ZeRO only through ``vescale.core.sharded_state``. ZeRO shards the dense parameters' state
over the flattened dp x ep ranks and each expert parameter's over dp, within the ep rank's experts
(``vescale.parallel.optimizer_state`` reports each piece as boxes of the global ``[E, ...]`` tensor).

The reference is a tiny unmodified Hugging Face Mixtral (its own routing, load-balancing loss included) trained by a
plain AdamW on one process. A data-parallel step's gradient is that of the mean over the dp slices of each slice's
loss (the load-balancing loss is a function of a whole batch; see packages/vescale-parallel/tests/test_experts_ddp.py),
so the reference accumulates ``loss(slice) / dp`` over the same dp slices the run used at each step. Compared after the
resumed step: every parameter's reduced gradient (whole), every parameter, and this rank's boxes of ``exp_avg`` /
``exp_avg_sq`` / ``step`` read from the optimizer against those boxes of the reference's state (tolerances below:
the same elementwise AdamW, on flat pieces, with the batch reduced in another order). A checkpoint that put a piece
in the wrong place would be off by the tensors' own magnitude.
"""

from __future__ import annotations

import pytest
import torch

from vescale import checkpoint
from vescale.core.testing import run_on_ranks

# AdamW's first update is lr * g / (|g| + eps): with the default eps (1e-8) the rounding of a near-zero gradient
# element (the batch reduced over dp x ep in another order) moves that element by up to lr (measured: 3e-6), and the
# third step's gradients then differ by more than 1e-5 of their largest element, even on one process after loading
# the checkpoint. eps 1e-5 (the gradients here are 1e-5 to 1e-3)
# keeps the update smooth in such elements: measured, parameters within 7e-7 (atol: a thousandth of lr), gradients
# and the AdamW state within 3.6e-6 of each reference tensor's largest element (SCALED: the 1e-5 for ep).
LR, WD, EPS = 1e-2, 0.1, 1e-5
PARAM_TOL = {"rtol": 1e-6, "atol": 1e-3 * LR}
SCALED = 1e-5
SAVED_DP = 2  # the checkpoint's run: dp2 x ep2, ZeRO-2, two steps


def _close(got: torch.Tensor, want: torch.Tensor, what: str, whole: torch.Tensor | None = None) -> None:
    """``got`` equals ``want`` (a box of ``whole``, or whole) to :data:`SCALED` of the whole reference tensor's
    largest magnitude (exactly where that is 0)."""
    scale = float((want if whole is None else whole).abs().max()) if want.numel() else 0.0
    torch.testing.assert_close(got, want, rtol=0, atol=SCALED * scale, msg=what)


def _build() -> torch.nn.Module:
    from vescale.core.testing.models import tiny_mixtral

    return tiny_mixtral(0, output_router_logits=True, router_aux_loss_coef=0.1)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 + step)
    tokens = torch.randint(0, 64, (8, 8), generator=g)
    labels = torch.randint(0, 64, (8, 8), generator=g)
    labels[1, 5:] = -100
    return tokens, labels


def _reference(dps: list[int]) -> list[dict]:
    """One device, AdamW: step ``i`` accumulates ``loss(slice) / dps[i]`` over ``dps[i]`` slices of batch ``i``.
    After each step: its gradients, the parameters and the AdamW state, by FQN."""
    from vescale.core.testing.reference import one_thread

    out = []
    with one_thread():
        model = _build()
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, eps=EPS)
        for i, dp in enumerate(dps):
            tokens, labels = _batch(i)
            for x, y in zip(tokens.chunk(dp), labels.chunk(dp)):
                (model(input_ids=x, labels=y).loss / dp).backward()
            grads = {k: p.grad.clone() for k, p in model.named_parameters()}
            opt.step()
            opt.zero_grad()
            out.append({"grads": grads, "params": {k: p.detach().clone() for k, p in model.named_parameters()},
                        "state": {k: {n: v.clone() for n, v in opt.state[p].items()}
                                  for k, p in model.named_parameters()}})
    return out


@pytest.fixture(scope="module")
def ref_same():
    """The reference of the saved run resumed on dp=2 (every step over two dp slices)."""
    return _reference([SAVED_DP] * 3)


@pytest.fixture(scope="module")
def ref_dp1():
    """The reference of the saved run resumed without dp (its third step over the whole batch)."""
    return _reference([SAVED_DP] * 2 + [1])


def _zero(dp: int, ep: int, stage: int, tp: int = 1):
    """The tiny Mixtral with its experts over ``ep`` (``tp`` > 1: and ``mixtral_plan`` over tp, attention by heads and
    each expert's FFN inside its ep rank), in DDP over dp x ep (several buckets), ZeRO ``stage`` AdamW."""
    from vescale.core.mesh import init_mesh, sub_mesh
    from vescale.parallel import (
        DDPOptions,
        DistributedDataParallel,
        DistributedOptimizer,
        mixtral_plan,
        parallelize_experts,
    )

    mesh = init_mesh({"dp": dp, "ep": ep, "tp": tp} if tp > 1 else {"dp": dp, "ep": ep})
    inner = sub_mesh(mesh, "ep", "tp") if tp > 1 else sub_mesh(mesh, "ep")
    model = parallelize_experts(_build(), inner, mixtral_plan(inner) if tp > 1 else None)
    ddp = DistributedDataParallel(model, mesh, DDPOptions(bucket_size_mb=0.01, zero_stage=2 if stage == 2 else 0))
    return mesh, ddp, DistributedOptimizer(ddp, torch.optim.AdamW, zero_stage=stage, lr=LR, weight_decay=WD,
                                           eps=EPS)


def _step(mesh, ddp, opt, i: int) -> dict[str, torch.Tensor]:
    """One step on this rank's rows of batch ``i`` (dp slice, then its ep part); the whole reduced gradients."""
    d, e = mesh.get_local_rank("dp"), mesh.get_local_rank("ep")
    dp, ep = mesh["dp"].size(), mesh["ep"].size()
    tokens, labels = _batch(i)
    x, y = tokens.chunk(dp)[d].chunk(ep)[e], labels.chunk(dp)[d].chunk(ep)[e]
    ddp(input_ids=x, labels=y).loss.backward()
    grads = {k: g.full_tensor() for k, g in ddp.reduced_grads().items()}
    opt.step()
    opt.zero_grad()
    return grads


def _boxes(opt) -> list[tuple[str, tuple, tuple, torch.Tensor]]:
    """This rank's boxes of the optimizer's sharded state: (key, offsets, lengths, a copy of the data)."""
    from vescale.core.sharded_state import ShardedTensor

    return [(key, b.offsets, b.lengths, b.data.clone()) for key, st in opt.sharded_state_dict().items()
            if isinstance(st, ShardedTensor) for b in st.boxes]


def _snapshot(ddp, opt) -> dict:
    return {"params": {k: p.full_tensor().detach().clone() for k, p in ddp.module.named_parameters()},
            "boxes": _boxes(opt)}


def _check(got: dict, grads: dict | None, ref: dict, what: str) -> None:
    """A rank's snapshot (and its last step's gradients) against the reference after the same step."""
    if grads is not None:
        assert grads.keys() == ref["grads"].keys(), what
        for k, g in grads.items():
            _close(g, ref["grads"][k], f"{what}: gradient of {k}")
    for k, p in got["params"].items():
        torch.testing.assert_close(p, ref["params"][k], **PARAM_TOL, msg=f"{what}: parameter {k}")
    names, experts = set(), 0
    for key, offsets, lengths, data in got["boxes"]:
        if not key.startswith("state."):
            continue
        fqn, name = key.removeprefix("state.").rsplit(".", 1)
        names.add(name)
        experts += ".experts." in fqn and name == "exp_avg"
        whole = ref["state"][fqn][name]
        _close(data, whole[tuple(slice(o, o + n) for o, n in zip(offsets, lengths))], f"{what}: {key} at {offsets}",
               whole)
    assert {"exp_avg", "exp_avg_sq", "step"} <= names and experts, f"{what}: state boxes {sorted(names)}"


def _train_save(path: str, dp: int = SAVED_DP, tp: int = 1) -> list:
    """Two ZeRO-2 steps on dp x ep2 (x tp), saved to ``path``; this rank's snapshot at the save."""
    from vescale.core.testing.reference import one_thread

    with one_thread():
        mesh, ddp, opt = _zero(dp, 2, 2, tp)
        for i in range(2):
            _step(mesh, ddp, opt, i)
        checkpoint.save(path, {"model": ddp, "optim": opt, "step": 2})
        return _snapshot(ddp, opt)


def _resume(path: str, dp: int, ep: int, stage: int, tp: int = 1) -> tuple[dict, dict, dict]:
    """A fresh run on dp x ep (x tp) (its optimizer state built by the load) loaded from ``path``: the loaded
    snapshot, then step 2's gradients and the snapshot after it."""
    from vescale.core.testing.reference import one_thread

    with one_thread():
        mesh, ddp, opt = _zero(dp, ep, stage, tp)
        state = {"model": ddp, "optim": opt, "step": 0}
        checkpoint.load(path, state)
        assert state["step"] == 2 and opt.param_groups[0]["lr"] == LR and opt.param_groups[0]["weight_decay"] == WD
        loaded = _snapshot(ddp, opt)
        grads = _step(mesh, ddp, opt, 2)
        return loaded, grads, _snapshot(ddp, opt)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Two ZeRO-2 steps on dp2 x ep2, saved; each rank's snapshot at the save."""
    path = str(tmp_path_factory.mktemp("ep_zero2") / "ckpt")
    return path, run_on_ranks(_train_save, 4, path)


def test_ep_zero2_checkpoint_resumes_bitwise_on_the_same_mesh(saved, ref_same):
    """dp2 x ep2 ZeRO-2 loaded on dp2 x ep2: each rank's parameters and state boxes are bitwise the saved ones (and
    the saved run matched the reference), and the third step matches the single-device run's."""
    path, at_save = saved
    keys = set(checkpoint.inspect(path)["tensors"])
    assert {"optim.state.model.layers.0.mlp.experts.gate_up_proj.exp_avg",
            "optim.state.model.embed_tokens.weight.exp_avg_sq"} <= keys, sorted(keys)[:20]
    for rank, (before, (loaded, grads, after)) in enumerate(zip(at_save, run_on_ranks(_resume, 4, path, 2, 2, 2))):
        _check(before, None, ref_same[1], f"dp2 x ep2 at save, rank {rank}")
        for k, p in before["params"].items():
            assert torch.equal(loaded["params"][k], p), f"rank {rank}: parameter {k}"
        assert [b[:3] for b in loaded["boxes"]] == [b[:3] for b in before["boxes"]], f"rank {rank}: boxes"
        for (key, offsets, _, data), (_, _, _, want) in zip(loaded["boxes"], before["boxes"]):
            assert torch.equal(data, want), f"rank {rank}: {key} at {offsets}"
        _check(after, grads, ref_same[2], f"dp2 x ep2 resumed, rank {rank}")


def test_ep_zero2_checkpoint_reshards_to_ep4(saved, ref_dp1):
    """The dp2 x ep2 checkpoint loaded on dp1 x ep4 with ZeRO-2 (one expert per rank; the dense state over the 4
    ranks in other ragged pieces): the loaded state and the next step match the single-device run's."""
    path, _ = saved
    for rank, (loaded, grads, after) in enumerate(run_on_ranks(_resume, 4, path, 1, 4, 2)):
        _check(loaded, None, ref_dp1[1], f"dp1 x ep4 loaded, rank {rank}")
        _check(after, grads, ref_dp1[2], f"dp1 x ep4 resumed, rank {rank}")


def test_ep_zero2_checkpoint_loads_on_one_process_into_plain_adamw(saved, ref_dp1):
    """The dp2 x ep2 checkpoint loaded on one process into the unmodified model and a plain AdamW (lr and weight
    decay restored from it): parameters and the whole state match the reference after two steps, and a third step
    over the whole batch matches the reference's."""
    _check_one_process(saved[0], ref_dp1)


def _check_one_process(path: str, ref: list[dict]) -> None:
    """``path`` loaded on one process into the unmodified model and a plain AdamW (lr, weight decay and eps restored
    from it) matches ``ref`` after two steps (parameters, the whole state), and a third step over the whole batch
    matches ``ref``'s third (gradients, parameters, state)."""
    from vescale.core.testing.reference import one_thread

    with one_thread():
        model = _build()
        opt = torch.optim.AdamW(model.parameters(), lr=0.5)  # the load restores lr, weight decay and eps
        state = {"model": model, "optim": opt, "step": 0}
        checkpoint.load(path, state)
        assert state["step"] == 2 and opt.param_groups[0]["lr"] == LR and opt.param_groups[0]["weight_decay"] == WD
        assert opt.param_groups[0]["eps"] == EPS
        for step in (1, 2):
            if step == 2:
                tokens, labels = _batch(2)
                model(input_ids=tokens, labels=labels).loss.backward()
                for k, p in model.named_parameters():
                    _close(p.grad, ref[2]["grads"][k], f"plain: gradient of {k}")
                opt.step()
            for k, p in model.named_parameters():
                torch.testing.assert_close(p.detach(), ref[step]["params"][k], **PARAM_TOL,
                                           msg=f"plain after step {step + 1}: {k}")
                for name in ("exp_avg", "exp_avg_sq", "step"):
                    _close(opt.state[p][name], ref[step]["state"][k][name],
                           f"plain after step {step + 1}: {k} {name}")


# ep x tp: each expert's FFN tp-sharded inside its ep rank (mixtral_plan: gate_up_proj InterleavedShard(1, 2), down_proj
# Shard(2)) and attention by heads, then ZeRO-2 pieces of those shards; dp = 1, so the reference's steps are over the
# whole batch, as both loads' next step.
@pytest.fixture(scope="module")
def ref_whole():
    """The reference of the ep2 x tp2 run (and of its loads): every step over the whole batch."""
    return _reference([1] * 3)


@pytest.fixture(scope="module")
def saved_tp(tmp_path_factory, ref_whole):
    """Two ZeRO-2 steps on dp1 x ep2 x tp2 (4 ranks), saved; each rank's parameters and state boxes at the save
    match the reference's."""
    path = str(tmp_path_factory.mktemp("ep_tp_zero2") / "ckpt")
    for rank, snapshot in enumerate(run_on_ranks(_train_save, 4, path, 1, 2)):
        _check(snapshot, None, ref_whole[1], f"ep2 x tp2 at save, rank {rank}")
    return path


def test_ep_tp_zero2_checkpoint_reshards_to_ep4(saved_tp, ref_whole):
    """The ep2 x tp2 ZeRO-2 checkpoint loaded on dp1 x ep4 without tp (ZeRO-2, one whole expert per rank): the
    loaded state and the next step match the single-device run's."""
    for rank, (loaded, grads, after) in enumerate(run_on_ranks(_resume, 4, saved_tp, 1, 4, 2)):
        _check(loaded, None, ref_whole[1], f"ep2 x tp2 -> ep4 loaded, rank {rank}")
        _check(after, grads, ref_whole[2], f"ep2 x tp2 -> ep4 resumed, rank {rank}")


def test_ep_tp_zero2_checkpoint_loads_on_one_process_into_plain_adamw(saved_tp, ref_whole):
    """The ep2 x tp2 ZeRO-2 checkpoint loaded on one process into the unmodified model and a plain AdamW."""
    _check_one_process(saved_tp, ref_whole)
