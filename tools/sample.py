"""Text from the model being trained: greedy and sampled continuations of a prompt, the same tokens on every rank.

``tools/train.py`` calls :func:`continuations` every ``--sample-every`` steps and at the end of a run on real text.
Every rank of the mesh runs the same forwards (tensor parallelism needs all of a tp group's ranks; the plan's root
output gives every rank the whole logits), and the sampled rows draw from one CPU generator seeded identically on
every rank, so all ranks choose the same tokens without communicating. Pipeline meshes are not served: the pipeline
engine runs training steps only (``config.check_fits`` refuses ``--sample-every`` with pp > 1).
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["generate", "continuations", "decoder", "degenerate_tail", "format_continuation"]

MIN_DEGENERATE = 4  # a tail of this many whitespace-only or identical ids prints as a note, not as text


def _logits(output) -> torch.Tensor:
    if hasattr(output, "logits"):
        return output.logits
    return output["logits"] if isinstance(output, dict) else output


@torch.no_grad()
def generate(model: nn.Module, prompt: list[int], new_tokens: int, *, window: int, samples: int = 2,
             temperature: float = 0.8, seed: int = 0, pad_id: int = 0) -> list[list[int]]:
    """``1 + samples`` continuations of ``prompt`` (``new_tokens`` ids each): row 0 greedy (argmax), the others
    sampled at ``temperature`` from a generator seeded with ``seed``.

    Each forward sees a fixed ``[1 + samples, window]`` input: the last ``window`` tokens, right-padded with
    ``pad_id`` (a causal model's logits at a position do not depend on later ones), so the shape suits any sequence
    parallel split and compiled blocks. Collective when ``model`` is parallel: every rank of its mesh must call it
    with the same arguments; all of them return the same ids. ``model`` is left in the mode it was in.
    """
    param = next(model.parameters())
    device = param.to_local().device if hasattr(param, "to_local") else param.device
    rows = [list(prompt) for _ in range(1 + samples)]
    g = torch.Generator().manual_seed(seed)
    was_training = model.training
    model.eval()
    try:
        for _ in range(new_tokens):
            ctx = [r[-window:] for r in rows]
            last = len(ctx[0]) - 1
            batch = torch.full((len(rows), window), pad_id, dtype=torch.long)
            for i, r in enumerate(ctx):
                batch[i, :len(r)] = torch.tensor(r, dtype=torch.long)
            logits = _logits(model(batch.to(device)))[:, last].float().cpu()
            chosen = [int(logits[0].argmax())]
            if samples:
                probs = torch.softmax(logits[1:] / temperature, dim=-1)
                chosen += torch.multinomial(probs, 1, generator=g).squeeze(1).tolist()
            for r, t in zip(rows, chosen):
                r.append(t)
    finally:
        model.train(was_training)
    return [r[len(prompt):] for r in rows]


def continuations(model: nn.Module, tokenizer_dir, prompt: list[int], new_tokens: int, *, window: int, seed: int,
                  eos_id: int) -> tuple[list[list[int]], str]:
    """:func:`generate`'s ids and a printable block: the prompt, then the greedy and each sampled continuation
    decoded by the tokenizer of ``tokenizer_dir`` (ids when there is none)."""
    ids = generate(model, prompt, new_tokens, window=window, seed=seed, pad_id=eos_id)
    decode = (lambda t: repr(t)) if tokenizer_dir is None else decoder(tokenizer_dir)
    lines = ["prompt:", _indent(decode(prompt))]
    for i, row in enumerate(ids):
        lines += format_continuation(decode, prompt, row, "greedy" if i == 0 else f"sampled ({i})")
    return ids, "\n".join(lines)


def degenerate_tail(row: list[int], decode, *, min_tokens: int = MIN_DEGENERATE) -> tuple[int, str]:
    """How many of ``row``'s last ids are degenerate and what they are: the longest suffix whose ids each decode to
    whitespace only, or the last id repeated, whichever is longer; ``(0, "")`` when it is under ``min_tokens``.

    The description names what repeats (``"repeated newlines"``, ``"repeated whitespace"``, ``"repeated 'ab'"``), so a
    greedy continuation that collapsed into blank lines prints as one line saying so instead of as empty lines."""
    spaces = 0
    for t in reversed(row):
        if decode([t]).strip():
            break
        spaces += 1
    same = 0
    for t in reversed(row):
        if t != row[-1]:
            break
        same += 1
    n = max(spaces, same)
    if n < min_tokens:
        return 0, ""
    texts = {decode([t]) for t in row[len(row) - n:]}
    if texts <= {"\n"}:
        return n, "repeated newlines"
    if n == spaces:
        return n, "repeated whitespace"
    return n, f"repeated {decode([row[-1]])!r}"


def format_continuation(decode, prompt: list[int], row: list[int], label: str) -> list[str]:
    """The printable lines of one continuation: ``label:``, then ``prompt + row`` decoded and indented, its
    degenerate tail (:func:`degenerate_tail`) cut off and replaced by a one-line note of what it was and how long."""
    n, what = degenerate_tail(row, decode)
    if not n:
        return [f"{label}:", _indent(decode(prompt + row))]
    if n == len(row):
        return [f"{label}: continuation degenerates into {what} ({n} tokens)", _indent(decode(prompt))]
    return [f"{label}:", _indent(decode(prompt + row[:len(row) - n])),
            f"    ... then degenerates into {what} ({n} tokens, not shown)"]


def decoder(tokenizer_dir):
    """``ids -> text`` by the tokenizer of the directory ``tokenizer_dir`` (its ``tokenizer.json``)."""
    from pathlib import Path

    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
    return lambda t: tok.decode(list(t), skip_special_tokens=False)


def _indent(text: str) -> str:
    return "\n".join("    | " + line for line in text.splitlines() or [""])
