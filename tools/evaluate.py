"""Held-out loss of the model being trained (``tools/train.py --eval-every``): mean next-token cross-entropy over
the trained tokens (targets not -100: a chat file's assistant tokens) of fixed held-out batches, each dp rank on its
slice of every batch (with expert parallelism each ep rank on its part of that slice), as one device computes it on
the whole batches."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["heldout_loss"]


@torch.no_grad()
def heldout_loss(model: nn.Module, batches: list[torch.Tensor], *, dp_rank: int, dp: int,
                 dp_group: dist.ProcessGroup | None, device: torch.device, ep_rank: int = 0, ep: int = 1,
                 ep_group: dist.ProcessGroup | None = None, eos_id: int | None = None) -> float:
    """The mean loss over the trained tokens of ``batches`` (each ``[B, T + 1]`` token rows or ``[B, 2, T + 1]``
    labelled rows, ``data.step_rows``; ``B`` divisible by ``dp x ep``), as one device computes it on them all.

    Rows as the trainer splits a training batch: each dp rank takes its slice ``batch.chunk(dp)[dp_rank]``, and
    with expert parallelism (``ep > 1``, a model from ``vescale.parallel.parallelize_experts``) each ep rank its part
    of that slice, ``.chunk(ep)[ep_rank]``: the experts' all-to-alls need every ep rank to call the model as often as
    the others, each with its own rows. Collective: every rank of the mesh calls it with the same ``batches``; ranks
    of one (dp, ep) rank's tp group run the same forwards; the per-rank means are averaged by one ``all_reduce`` over
    ``dp_group`` and one over ``ep_group`` (of the loss sum and the token count). A batch whose
    rows do not divide over ``dp x ep`` raises ``ValueError`` on every rank before any forward. With ``ep > 1`` the
    model is called as ``model(input_ids=rows)``, the batch boundary ``parallelize_experts`` gives the root (Hugging
    Face's argument name; a positional batch would not be sharded over ep). ``model`` is left in the mode it was in.
    With ``eos_id`` (document masking, as the run trains) each token attends only within its EOS-delimited document
    (``vescale.plan.document_inputs`` of the rows).
    """
    import inspect

    from data import step_rows

    from vescale.plan import document_inputs, documents_from_eos, language_model_loss

    for batch in batches:
        if batch.ndim not in (2, 3) or batch.shape[0] % (dp * ep):
            raise ValueError(f"heldout_loss: a held-out batch of shape {tuple(batch.shape)} does not split into "
                             f"[rows, seq_len + 1] slices of equal rows over dp={dp} x ep={ep}")
    was_training = model.training
    model.eval()
    try:
        total = torch.zeros(2, dtype=torch.float64, device=device)  # the loss sum, the trained tokens
        for batch in batches:
            inputs, targets, _ = step_rows(batch.chunk(dp)[dp_rank].chunk(ep)[ep_rank].to(device))
            by_name = ep > 1 or "input_ids" in inspect.signature(model.forward).parameters
            docs = None if eos_id is None else documents_from_eos(inputs, eos_id)
            kw = {} if docs is None else document_inputs(docs, transformers_style=by_name,
                                                          explicit_mask=by_name and ep > 1)  # (see document_inputs)
            out = model(input_ids=inputs, **kw) if ep > 1 else model(inputs, **kw)
            total[0] += language_model_loss(out, targets, reduction="sum").double()
            total[1] += (targets != -100).sum()
        for size, group in ((dp, dp_group), (ep, ep_group)):
            if size > 1:
                dist.all_reduce(total, group=group)
    finally:
        model.train(was_training)
    return float(total[0] / total[1].clamp(min=1))


class _InputIds(nn.Module):
    """``model`` called with its batch by keyword, ``model(input_ids=batch)``: how ``sample.generate`` (which passes
    the batch positionally) reaches an expert-parallel model, whose root shards only the Hugging Face keyword
    arguments over ep (``parallelize_experts``). Holds ``model`` as its submodule, so parameters and modes pass."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, batch: torch.Tensor):
        return self.model(input_ids=batch)


class TextMonitor:
    """What ``tools/train.py`` does besides training on real text: the held-out loss every ``--eval-every`` steps
    (and at the last), generations every ``--sample-every`` steps and at the end of the run.

    ``model``: this rank's model as the trainer holds it (``trainer.state["model"]``; a list of pipeline stages on a
    pp mesh, where nothing is evaluated or sampled: ``config.check_fits`` refuses the flags there, and the end
    samples are skipped with a note). ``data``: a ``data.TokenData`` (a ``MarkovCorpus`` turns everything off).
    ``dp_rank`` / ``dp`` / ``dp_group`` and, on a mesh with ep, ``ep_rank`` / ``ep`` / ``ep_group``: how the held-out
    rows are split and averaged (:func:`heldout_loss`). Samples on a mesh with ep: every rank, each ep rank too,
    generates the same rows with the same number of forwards (``sample.generate`` runs a fixed ``NEW_TOKENS`` steps
    of a fixed shape and never stops early), so the experts' all-to-alls stay in lockstep.
    Every method is collective over the mesh when it does something; all ranks decide alike from ``(cfg, step)``.
    """

    EVAL_BATCHES = 4  # held-out batches of --batch-size sequences per evaluation (fewer when the split is short)
    NEW_TOKENS = 48  # generated per continuation

    def __init__(self, cfg, data, model, *, dp_rank: int, dp: int, dp_group, device, log, ep_rank: int = 0,
                 ep: int = 1, ep_group=None) -> None:
        from chat_data import ChatData
        from data import MixedData, TokenData

        self.cfg, self.data, self.model, self.log = cfg, data, model, log
        self.dp_rank, self.dp, self.dp_group, self.device = dp_rank, dp, dp_group, device
        self.ep_rank, self.ep, self.ep_group = ep_rank, ep, ep_group  # ep > 1: each ep rank its part of the rows
        self.text = isinstance(data, (TokenData, ChatData, MixedData))
        self.chat = bool(getattr(cfg, "chat", False))  # prompts in the chat template, ending in its assistant turn
        self.pipeline = isinstance(model, (list, tuple))
        # (data.open_data has refused --eval-every when the held-out split holds less than one batch)
        self.batches = data.heldout_batches(cfg.batch_size, self.EVAL_BATCHES) if self.text else []
        self.prompt = self._prompt() if self.text else []
        self.last_sampled = -1

    def _prompt(self) -> list[int]:
        if self.chat:  # --prompt as a user turn, else the first held-out conversation's turns before the assistant's
            if self.cfg.prompt is None:
                return self.data.prompt(self.cfg.seq_len // 2)
            from chat_data import chat_tokenizer

            return list(chat_tokenizer(self.data.tokenizer_dir).apply_chat_template(
                [{"role": "user", "content": self.cfg.prompt}], tokenize=True, add_generation_prompt=True,
                return_dict=True)["input_ids"])
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
            from config import uses_document_mask

            eos_id = getattr(self.data, "eos_id", None) if uses_document_mask(cfg) else None
            loss = heldout_loss(self.model, self.batches, dp_rank=self.dp_rank, dp=self.dp, dp_group=self.dp_group,
                                device=self.device, ep_rank=self.ep_rank, ep=self.ep, ep_group=self.ep_group,
                                eos_id=eos_id)
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
        model = _InputIds(self.model) if self.ep > 1 else self.model  # (the experts' keyword batch boundary)
        ids, text = continuations(model, self.data.tokenizer_dir, self.prompt, self.NEW_TOKENS,
                                  window=self.cfg.seq_len, seed=self.cfg.seed + step, eos_id=self.data.eos_id)
        self.log(f"samples after step {step + 1}:\n{text}")
        return ids
