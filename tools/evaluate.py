"""Held-out loss of the model being trained (``tools/train.py --eval-every``): mean next-token cross-entropy over
fixed held-out batches, each dp rank on its slice of every batch, as one device computes it on the whole batches."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["heldout_loss"]


@torch.no_grad()
def heldout_loss(model: nn.Module, batches: list[torch.Tensor], *, dp_rank: int, dp: int,
                 dp_group: dist.ProcessGroup | None, device: torch.device) -> float:
    """The mean loss over ``batches`` (each ``[B, T + 1]``, ``B`` divisible by ``dp``: inputs and shifted targets).

    Collective: every rank of the mesh calls it with the same ``batches``; ranks of one dp rank's tp group run the
    same forwards, and the per-dp-rank means are averaged by one ``all_reduce`` over ``dp_group`` (equal slices, so
    the mean of means is the global mean). ``model`` is left in the mode it was in.
    """
    from vescale.plan import language_model_loss

    was_training = model.training
    model.eval()
    try:
        total = torch.zeros((), dtype=torch.float64, device=device)
        for batch in batches:
            rows = batch.chunk(dp)[dp_rank].to(device)
            total += language_model_loss(model(rows[:, :-1].contiguous()), rows[:, 1:].contiguous()).double()
        total /= max(1, len(batches))
        if dp > 1:
            dist.all_reduce(total, group=dp_group)
            total /= dp
    finally:
        model.train(was_training)
    return float(total)


class TextMonitor:
    """What ``tools/train.py`` does besides training on real text: the held-out loss every ``--eval-every`` steps
    (and at the last), generations every ``--sample-every`` steps and at the end of the run.

    ``model``: this rank's model as the trainer holds it (``trainer.state["model"]``; a list of pipeline stages on a
    pp mesh, where nothing is evaluated or sampled: ``config.check_fits`` refuses the flags there, and the end
    samples are skipped with a note). ``data``: a ``data.TokenData`` (a ``MarkovCorpus`` turns everything off).
    Every method is collective over the mesh when it does something; all ranks decide alike from ``(cfg, step)``.
    """

    EVAL_BATCHES = 4  # held-out batches of --batch-size sequences per evaluation (fewer when the split is short)
    NEW_TOKENS = 48  # generated per continuation

    def __init__(self, cfg, data, model, *, dp_rank: int, dp: int, dp_group, device, log) -> None:
        from data import TokenData

        self.cfg, self.data, self.model, self.log = cfg, data, model, log
        self.dp_rank, self.dp, self.dp_group, self.device = dp_rank, dp, dp_group, device
        self.text = isinstance(data, TokenData)
        self.pipeline = isinstance(model, (list, tuple))
        # (data.open_data has refused --eval-every when the held-out split holds less than one batch)
        self.batches = data.heldout_batches(cfg.batch_size, self.EVAL_BATCHES) if self.text else []
        self.prompt = self._prompt() if self.text else []
        self.last_sampled = -1

    def _prompt(self) -> list[int]:
        if self.cfg.prompt is None:  # the held-out split's first tokens, cut after their last line break
            ids = self.data.prompt(min(32, self.cfg.seq_len // 2))
            if self.data.tokenizer_dir is not None:
                from sample import decoder

                decode = decoder(self.data.tokenizer_dir)
                ends = [k + 1 for k in range(len(ids)) if "\n" in decode(ids[k:k + 1])]
                ids = ids[:ends[-1]] if ends else ids
            return ids
        from data import DataError

        if self.data.tokenizer_dir is None:
            raise DataError(f"--prompt needs a tokenizer; the data {self.cfg.data} has none (give --tokenizer)")
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(self.data.tokenizer_dir / "tokenizer.json"))
        return tok.encode(self.cfg.prompt, add_special_tokens=False).ids

    def after_step(self, step: int) -> dict:
        """After step ``step`` (0-based): the held-out figures for its metrics record when it is an evaluation step
        (``eval_loss``, ``eval_ppl``), else ``{}``; prints samples when it is a sampling step."""
        import math

        cfg, done, out = self.cfg, step + 1, {}
        if not self.text or self.pipeline:
            return out
        if cfg.eval_every and (done % cfg.eval_every == 0 or done == cfg.steps):
            loss = heldout_loss(self.model, self.batches, dp_rank=self.dp_rank, dp=self.dp, dp_group=self.dp_group,
                                device=self.device)
            out = {"eval_loss": loss, "eval_ppl": math.exp(min(loss, 50.0))}
            self.log(f"step {done}: held-out loss {loss:.4f}, perplexity {out['eval_ppl']:.2f}")
        if cfg.sample_every and done % cfg.sample_every == 0:
            self.sample(step)
        return out

    def sample(self, step: int) -> list[list[int]] | None:
        """Print (rank 0) a greedy and two sampled continuations of the prompt after step ``step``; returns the ids
        (the same on every rank), ``None`` when nothing was sampled (synthetic data, or a pipeline: noted)."""
        if not self.text:
            return None
        if self.pipeline:
            self.log("samples need a mesh without pp (the pipeline engine runs training steps only): skipped")
            return None
        if step == self.last_sampled:
            return None
        from sample import continuations

        self.last_sampled = step
        ids, text = continuations(self.model, self.data.tokenizer_dir, self.prompt, self.NEW_TOKENS,
                                  window=self.cfg.seq_len, seed=self.cfg.seed + step, eos_id=self.data.eos_id)
        self.log(f"samples after step {step + 1}:\n{text}")
        return ids
