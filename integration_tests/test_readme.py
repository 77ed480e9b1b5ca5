"""The README's example runs as written on 4 ranks (dp=2 x tp=2) and computes what one device computes on the
global batch: each dp rank trains on its own half of the rows, so the DDP average is exercised."""

from __future__ import annotations

import re
from pathlib import Path

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
