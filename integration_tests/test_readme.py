"""The README's example runs as written on 4 ranks and computes what one device computes."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def _example() -> str:
    text = README.read_text()
    section = text.split("## Parallelize an unmodified Hugging Face model", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def _run_example(code: str):
    import torch
    import torch.nn.functional as F

    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)
    # The single-device reference: the same model, batch and optimizer step on this rank alone.
    import transformers

    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(namespace["config"])
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    tokens = namespace["tokens"]
    ref_loss = F.cross_entropy(ref(input_ids=tokens[:, :-1]).logits.flatten(0, 1), tokens[:, 1:].flatten())
    ref_loss.backward()
    ref_opt.step()
    # Every dp rank drew the same batch, so the dp average is this batch's loss; rtol 1e-5 (fp32, TP partial sums).
    torch.testing.assert_close(namespace["loss"].detach(), ref_loss.detach(), rtol=1e-5, atol=1e-6)
    # After one AdamW step: Adam's first update is about lr * sign(grad), so a weight whose gradient is ~0 may move
    # by +-lr on one side and not the other; logits agree to a few lr-sized steps (atol 1e-3), not to fp32 noise.
    model = namespace["model"]
    after = model(input_ids=tokens[:, :-1]).logits
    expected = ref(input_ids=tokens[:, :-1]).logits
    torch.testing.assert_close(after, expected, rtol=0, atol=1e-3)
    assert not torch.allclose(after, namespace["logits"], atol=1e-3)  # the step did change the model
    return float(namespace["loss"])


def test_readme_example_matches_single_device(ranks):
    losses = ranks(_run_example, 4, _example())
    assert len(set(losses)) == 1
