"""Checkpoints of plain tensors marked as pieces of global tensors: an ep rank's plain ``[E / ep, ...]`` experts
(:func:`~vescale.parallel.keep_local_experts`, as a pp x ep pipeline stage holds them) saved as their rows of the
global ``[E, ...]`` tensors, with their optimizer state, and loaded on another layout.

An integration test: vescale-parallel builds the layout (the experts operator over ep, ``DistributedDataParallel``
over the dp1 x ep2 mesh (ep a data dim), a plain AdamW or ZeRO-1 :class:`~vescale.parallel.DistributedOptimizer`),
vescale-checkpoint saves and loads it knowing the layout only through the marks of ``vescale.core.sharded_state``.
Every rank reports the boxes of the global tensors it holds (parameters, ``exp_avg`` / ``exp_avg_sq`` / ``step``):
after one AdamW step they are assembled into the global tensors the checkpoint must hold; a load on one process (the
unmodified model, a fresh plain AdamW) and a load back onto ep=2 into ZeRO-1 (flat pieces, another optimizer layout)
must give those tensors bitwise. An expert at the wrong rows would differ by its own magnitude.
"""

from __future__ import annotations

import torch

from vescale import checkpoint
from vescale.core.testing import run_on_ranks

LR = 1e-2


def _build() -> torch.nn.Module:
    from vescale.core.testing.models import tiny_mixtral

    return tiny_mixtral(0, use_cache=False)


def _boxes(model: torch.nn.Module, opt) -> list[tuple[str, tuple[int, ...], torch.Tensor]]:
    """This rank's boxes of the global tensors, ``(key, offsets, data copy)``: parameters at their marks' offsets,
    and the optimizer state (a plain optimizer's at its parameter's offsets, ZeRO's from its sharded state)."""
    from vescale.core.sharded_state import ShardedTensor, piece_of

    def at(p: torch.Tensor, t: torch.Tensor) -> tuple[int, ...]:
        mark = piece_of(p)
        return mark.offsets if mark is not None and t.dim() else (0,) * t.dim()

    out = [(f"model.{fqn}", at(p, p), p.detach().clone()) for fqn, p in model.named_parameters()]
    if callable(getattr(opt, "sharded_state_dict", None)):
        return out + [(f"optim.{key}", b.offsets, b.data.clone()) for key, st in opt.sharded_state_dict().items()
                      if key.startswith("state.") and isinstance(st, ShardedTensor) for b in st.boxes]
    for fqn, p in model.named_parameters():
        out += [(f"optim.state.{fqn}.{name}", at(p, v), v.clone()) for name, v in opt.state[p].items()]
    return out


def _on_ep2(path: str, zero: int, save: bool) -> list[tuple[str, tuple[int, ...], torch.Tensor]]:
    """On dp1 x ep2: this rank's experts kept as plain tensors, in DDP over dp x ep, a plain AdamW (``zero`` 0) or
    ZeRO ``zero``; with ``save`` one step on this rank's rows, then saved to ``path``, else loaded from it. Returns
    :func:`_boxes`."""
    from vescale.core.mesh import init_mesh
    from vescale.parallel import DistributedDataParallel, DistributedOptimizer
    from vescale.parallel.experts import experts_as_operator, keep_local_experts

    mesh = init_mesh({"dp": 1, "ep": 2})
    r = mesh.get_local_rank("ep")
    model = _build()
    keep_local_experts(model, experts_as_operator(model, mesh), mesh)
    ddp = DistributedDataParallel(model, mesh)
    inner = torch.optim.AdamW(model.parameters(), lr=LR)
    opt = DistributedOptimizer(ddp, inner, zero_stage=zero) if zero else inner
    state = {"model": model, "optim": opt}
    if save:
        g = torch.Generator().manual_seed(5)
        tokens, labels = torch.randint(0, 64, (4, 8), generator=g), torch.randint(0, 64, (4, 8), generator=g)
        (ddp(input_ids=tokens.chunk(2)[r], labels=labels.chunk(2)[r]).loss / 2).backward()  # this rank's share
        opt.step()
        checkpoint.save(path, state)
    else:
        checkpoint.load(path, state)
    return _boxes(model, opt)


def _assemble(per_rank: list[list[tuple[str, tuple[int, ...], torch.Tensor]]]) -> dict[str, torch.Tensor]:
    """The global tensors the ranks' boxes tile (replicas written twice, identically), by checkpoint key."""
    whole = {f"model.{fqn}": p.detach() for fqn, p in _build().named_parameters()}
    out: dict[str, torch.Tensor] = {}
    for boxes in per_rank:
        for key, offsets, data in boxes:
            fqn = key.removeprefix("model.") if key.startswith("model.") else key.split(".", 2)[2].rpartition(".")[0]
            shape = whole[f"model.{fqn}"].shape if data.dim() else ()
            t = out.setdefault(key, torch.full(shape, float("nan"), dtype=data.dtype))
            region = tuple(slice(o, o + n) for o, n in zip(offsets, data.shape))
            if data.dim() and not torch.isnan(t[region]).all():
                assert torch.equal(t[region], data), f"{key}: two ranks hold different replicas at {offsets}"
            t[region] = data
    for key, t in out.items():
        assert not torch.isnan(t).any(), f"{key}: the ranks' boxes do not cover the global tensor"
    return out


def _check_boxes(per_rank, want: dict[str, torch.Tensor], what: str) -> None:
    for rank, boxes in enumerate(per_rank):
        for key, offsets, data in boxes:
            region = tuple(slice(o, o + n) for o, n in zip(offsets, data.shape))
            assert torch.equal(data, want[key][region]), f"{what}, rank {rank}: {key} at {offsets}"


def _check_one_process(path: str, want: dict[str, torch.Tensor], what: str) -> None:
    """Load ``path`` into the unmodified model and a fresh plain AdamW on this process: the global tensors."""
    model = _build()
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)
    checkpoint.load(path, {"model": model, "optim": opt})
    assert opt.param_groups[0]["lr"] == LR, what
    got = {f"model.{fqn}": p.detach() for fqn, p in model.named_parameters()}
    for fqn, p in model.named_parameters():
        got.update({f"optim.state.{fqn}.{name}": v for name, v in opt.state[p].items()})
    assert got.keys() == want.keys(), f"{what}: keys differ: {sorted(got.keys() ^ want.keys())[:5]}"
    for key, t in want.items():
        assert torch.equal(got[key], t), f"{what}: {key}"
    experts = [k for k in got if ".experts." in k and k.startswith("model.")]
    assert experts and all(got[k].shape[0] == 4 for k in experts), what  # all four experts, both ranks' rows


def test_plain_adamw_pieces_load_on_one_process_and_into_zero_on_ep2(tmp_path):
    path = str(tmp_path / "ckpt")
    want = _assemble(run_on_ranks(_on_ep2, 2, path, 0, True))
    tensors = checkpoint.inspect(path)["tensors"]
    expert = "model.layers.0.mlp.experts.gate_up_proj"
    assert tensors[f"model.{expert}"]["shape"][0] == 4 and tensors[f"optim.state.{expert}.exp_avg"]["shape"][0] == 4
    _check_one_process(path, want, "ep2 AdamW -> one process")
    _check_boxes(run_on_ranks(_on_ep2, 2, path, 1, False), want, "ep2 AdamW -> ep2 ZeRO-1")


def test_zero_pieces_load_on_one_process(tmp_path):
    path = str(tmp_path / "ckpt")
    want = _assemble(run_on_ranks(_on_ep2, 2, path, 1, True))
    _check_one_process(path, want, "ep2 ZeRO-1 -> one process")
