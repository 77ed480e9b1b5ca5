"""``Parallelized.make_optimizer(torch.optim.Muon, ...)`` through ``vescale.plan.build`` on a GPT, each dp rank its
own rows, against one device's torch.optim.Muon (hidden matrices) + AdamW (the rest).

Two checks per step. Gradients: the dp-averaged gradients (``par.grads()``, whole) against one device's backward of
the whole batch, rtol 1e-5 (the sum runs in another order). Update: one device's two torch optimizers, stepped from
the same parameters with those same gradients (clipped by the same coefficient, computed from the parallel run's
norm as torch does), must give *bitwise* the parallel parameters: the owner ran torch's own Muon on the same whole
matrix (Newton-Schulz in bf16 included), AdamW is elementwise on its flat pieces.
"""

from __future__ import annotations

from vescale.core.testing import multi_rank

BATCH, SEQ, VOCAB = 8, 16, 64
MUON = {"lr": 0.02, "weight_decay": 0.1, "momentum": 0.95}
ADAMW = {"lr": 0.01, "weight_decay": 0.1}


def _model():
    import torch

    from vescale.core.testing.models import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=VOCAB, d_model=32, n_layer=2, n_head=4, n_kv_head=2, max_seq_len=SEQ))


def _run(mesh: dict, zero: int, clip: float | None) -> None:
    import torch
    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor

    from vescale.core.testing import reference
    from vescale.parallel import hidden_matrices
    from vescale.plan import ParallelSpec, build

    what = f"{mesh} zero{zero} clip={clip}"
    full_model = _model()
    hidden = set(hidden_matrices(full_model))
    assert hidden and all(".attn." in n or ".mlp." in n for n in hidden), hidden
    par = build(_model(), ParallelSpec(mesh=mesh, zero=zero, tp_plan="gpt" if "tp" in mesh else "auto"),
                batch_size=BATCH, seq_len=SEQ)
    opt = par.make_optimizer(torch.optim.Muon, clip_grad=clip, rest=(torch.optim.AdamW, ADAMW), **MUON)
    ref = full_model
    named = dict(ref.named_parameters())
    muon = torch.optim.Muon([named[n] for n in hidden], **MUON)
    adamw = torch.optim.AdamW([p for n, p in named.items() if n not in hidden], **ADAMW)

    def full(t):
        return (t.full_tensor() if isinstance(t, DTensor) else t).detach()

    for step in range(2):
        inputs, targets = reference.progression_batch(3000 + step, BATCH, SEQ, VOCAB)
        opt.zero_grad()
        par.forward_backward(par.shard_batch(inputs), par.shard_batch(targets))
        grads = {n: full(g) for n, g in par.grads().items()}
        for p in ref.parameters():
            p.grad = None
        F.cross_entropy(ref(inputs).flatten(0, 1), targets.flatten()).backward()
        assert grads, what
        for n, g in grads.items():  # with pp: this rank's stage
            torch.testing.assert_close(g, named[n].grad, rtol=1e-5, atol=1e-7, msg=f"{what} step {step} grad {n}")
            named[n].grad = g.clone()  # the update check: the same gradients
        opt.step()
        if clip is not None:
            norm = opt.grad_norm if getattr(opt, "grad_norm", None) is not None else par.grad_norm
            coef = torch.clamp(clip / (norm + 1e-6), max=1.0)
            for p in named.values():
                p.grad.mul_(coef)
        muon.step()
        adamw.step()
        for n, p in (n_p for m in par.modules for n_p in m.named_parameters()):
            got = full(p)
            assert torch.equal(got, named[n].detach()), \
                f"{what} step {step} {n}: max diff {(got - named[n].detach()).abs().max()}"


@multi_rank(world_sizes=[4])
def test_make_optimizer_muon_dp2_tp2_and_dp4():
    """dp=2 x tp=2 ZeRO 1 with clipping, ZeRO 3, and ZeRO 0 (every dp rank steps its tp row's owners); dp=4 ZeRO 2
    with clipping."""
    _run({"dp": 2, "tp": 2}, 1, 1.0)
    _run({"dp": 2, "tp": 2}, 3, None)
    _run({"dp": 2, "tp": 2}, 0, 1.0)
    _run({"dp": 4}, 2, 0.5)


@multi_rank(world_sizes=[4])
def test_make_optimizer_muon_pp2_dp2_and_hsdp():
    """pp=2 x dp=2, ZeRO 1 with clipping over the stages (each stage's DDP and its own owners) and ZeRO 3 with
    clipping (each stage one FSDP2 unit, its matrices owned over dp); HSDP 2 x 2 (owners over dp_shard, each replica
    group stepping alike)."""
    _run({"pp": 2, "dp": 2}, 1, 1.0)
    _run({"pp": 2, "dp": 2}, 3, 1.0)
    _run({"dp_replicate": 2, "dp_shard": 2}, 3, None)
