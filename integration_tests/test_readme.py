"""The README's example runs as written on 4 ranks (dp=2 x tp=2) and computes what one device computes on the
global batch: each dp rank trains on its own half of the rows, so the DDP average is exercised."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from vescale.core.testing.reference import assert_first_adamw_step

README = Path(__file__).resolve().parents[1] / "README.md"


def _example() -> str:
    text = README.read_text()
    section = text.split("## Parallelize an unmodified Hugging Face model", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def _run_example(code: str):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    import transformers

    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)
    model, opt, batch, mesh = namespace["model"], namespace["opt"], namespace["batch"], namespace["mesh"]
    assert namespace["tokens"].shape[0] == batch.shape[0] // 2  # this dp rank's half of the global batch

    def full(t):
        return t.full_tensor() if hasattr(t, "full_tensor") else t

    # The single-device reference: the same model, the whole global batch, the same AdamW step.
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(namespace["config"])
    ref_logits = ref(input_ids=batch[:, :-1]).logits
    ref_loss = F.cross_entropy(ref_logits.flatten(0, 1), batch[:, 1:].flatten())
    ref_loss.backward()
    # fp32, TP changes the order of the reductions: rtol 1e-5. Forward: this rank's rows of the global logits.
    dp_rank = mesh.get_local_rank("dp")
    torch.testing.assert_close(namespace["logits"], ref_logits.detach().chunk(2)[dp_rank], rtol=1e-5, atol=1e-6)
    loss = namespace["loss"].detach().clone()
    dist.all_reduce(loss)  # both tp ranks of a dp rank hold its loss: the sum over the 4 ranks / 4 is the dp mean
    torch.testing.assert_close(loss / 4, ref_loss.detach(), rtol=1e-5, atol=1e-6)
    # Gradients: DDP's dp average of the two halves' gradients is the global batch's gradient.
    grads = {}
    for name, p in model.module.named_parameters():
        grads[name] = full(p.grad).clone()
        torch.testing.assert_close(grads[name], ref.get_parameter(name).grad, rtol=1e-5, atol=1e-6, msg=name)
    ref_grads = {n: p.grad.clone() for n, p in ref.named_parameters()}
    assert set(grads) == set(ref_grads)
    torch.optim.AdamW(ref.parameters(), lr=1e-3).step()
    for name, p in model.module.named_parameters():
        # AdamW's exp_avg after one step is (1 - beta1) * g: the optimizer saw this gradient, no constant factor
        # (which Adam's update itself would hide); then the weights within what the step makes of the gradients.
        torch.testing.assert_close(full(opt.state[p]["exp_avg"]), 0.1 * grads[name], rtol=1e-6, atol=0, msg=name)
        assert_first_adamw_step(name, full(p.detach()), ref.get_parameter(name).detach(), grads[name],
                                 ref_grads[name], lr=1e-3)
    return float(namespace["loss"])


def test_readme_example_matches_single_device(ranks):
    losses = ranks(_run_example, 4, _example())
    # dp=2 x tp=2, tp innermost: ranks 0, 1 are dp rank 0 and share its loss; ranks 2, 3 are dp rank 1 on other rows
    assert losses[0] == losses[1] and losses[2] == losses[3] and losses[0] != losses[2], losses


def _own_loop_example(moe: bool) -> str:
    """The README's own-loop block, as written, or with its commented dp x ep spec and a Mixtral of the same shape
    (4 experts, 2 per token) in place of the Llama."""
    text = README.read_text()
    code = re.search(r"```python\n(.*?)```", text.split("## nD training in your own loop", 1)[1], re.S).group(1)
    if not moe:
        return code
    lines = code.splitlines()
    spec = next(i for i, line in enumerate(lines) if line.startswith("spec = "))
    lines[spec] = lines[spec + 1].removeprefix("# ").split("   #")[0]
    code = "\n".join(lines)
    return (code.replace("transformers.LlamaConfig(", "transformers.MixtralConfig(num_local_experts=4, "
                         "num_experts_per_tok=2, ").replace("LlamaForCausalLM", "MixtralForCausalLM"))


def _one_device_losses_and_grads(code: str, bf16: bool) -> tuple[list[float], dict]:
    """The same model and batches trained on one device in plain torch (no vescale): AdamW and the gradient clip of
    the block; with ``bf16`` bf16 parameters and compute stepped by fp32 masters (the block's recipe)."""
    import torch
    import torch.nn.functional as F
    import transformers

    namespace: dict = {"transformers": transformers}
    config_src = re.search(r"config = (transformers\.\w+Config\(.*?\))\n", code, re.S).group(1)
    config = eval(config_src, namespace)
    torch.manual_seed(0)
    model = getattr(transformers, "MixtralForCausalLM" if "Mixtral" in config_src else "LlamaForCausalLM")(config)
    if bf16:
        model.to(torch.bfloat16)
    params = list(model.parameters())
    masters = [p.detach().float().clone().requires_grad_() for p in params] if bf16 else params
    opt = torch.optim.AdamW(masters, lr=1e-3)
    losses, grads = [], {}
    for step in range(3):
        batch = torch.randint(0, 512, (8, 33), generator=torch.Generator().manual_seed(step))
        opt.zero_grad()
        for p in params:
            p.grad = None
        logits = model(input_ids=batch[:, :-1]).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        loss.backward()
        losses.append(float(loss.detach()))
        if bf16:
            for m, p in zip(masters, params):
                m.grad = p.grad.float()
        grads = {n: p.grad.float().clone() for n, p in model.named_parameters()}
        torch.nn.utils.clip_grad_norm_(masters, 1.0)
        opt.step()
        if bf16:
            with torch.no_grad():
                for m, p in zip(masters, params):
                    p.copy_(m)
    return losses, grads


def _run_own_loop(code: str) -> tuple[list[float], dict]:
    """Run the block on this rank, recording the printed losses (every rank computes them) and the last step's
    whole gradients by FQN of what this rank holds (its first replica only)."""
    import builtins

    import torch.distributed as dist

    from vescale.core.mesh import mesh_coordinates
    from vescale.plan import Parallelized

    losses: list[float] = []
    namespace: dict = {"print": lambda text: losses.append(float(text.rsplit(" ", 1)[1])) or builtins.print(text)}
    original, seen = Parallelized.forward_backward, {}

    def recording(self, inputs, targets):  # each step's gradients after its backward, before the clip and update
        loss = original(self, inputs, targets)
        seen["grads"] = self.grads()  # (a collective on every rank, as forward_backward is)
        return loss

    Parallelized.forward_backward = recording
    try:
        exec(compile(code, "README.md", "exec"), namespace)
    finally:
        Parallelized.forward_backward = original
    par, grads = namespace["par"], seen["grads"]
    at = mesh_coordinates(par.mesh)
    keep = all(at.get(d, 0) == 0 for d in ("dp", "tp"))
    whole = {n: (g.full_tensor() if hasattr(g, "full_tensor") else g).float().clone() for n, g in grads.items()}
    dist.barrier()
    return losses, whole if keep else {}


def _relative(a, b) -> float:
    import torch

    return float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b).clamp_min(1e-12))



@pytest.mark.parametrize("moe", [False, True], ids=["pp2xdp2xtp2-zero1-bf16", "dp2xep2-zero2"])
def test_own_loop_example_matches_single_device(ranks, moe):
    """The block's losses (rank 0 prints them) and every parameter's last-step gradient (before the clip) against
    plain torch on one device. bf16: the loss within 2**-5 relative and each gradient within 2**-4 of its norm (the
    same bf16 recipe, different accumulation orders over microbatches and ranks, three steps of AdamW); fp32 with
    experts: 1e-4 (reduction order only)."""
    code = _own_loop_example(moe)
    bf16 = 'dtype="bf16"' in code.split("spec = ", 1)[1].splitlines()[0]
    ref_losses, ref_grads = _one_device_losses_and_grads(code, bf16)
    results = ranks(_run_own_loop, 4 if moe else 8, code)
    losses = results[0][0]
    tol = 2**-5 if bf16 else 1e-4
    assert len(losses) == 3 and all(abs(a - b) <= tol * abs(b) for a, b in zip(losses, ref_losses)), \
        (losses, ref_losses)
    got: dict = {}
    for _, grads in results:
        got.update(grads)
    assert set(got) == set(ref_grads), sorted(set(got) ^ set(ref_grads))
    gtol = 2**-4 if bf16 else 1e-4
    bad = {n: _relative(g, ref_grads[n]) for n, g in got.items() if _relative(g, ref_grads[n]) > gtol}
    assert not bad, bad
