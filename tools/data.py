"""The training data of ``tools/train.py``: token files prepared from text (``prepare_data.py``) and the synthetic
Markov corpus of the equivalence tests.

Both give the global batch of a step as a pure function of (data, seed, step), computed by every rank without
communicating: each dp rank takes its slice, so every mesh trains on the same global batches, and a run resumed from a
checkpoint (on any mesh) continues the same stream.

:class:`TokenData` reads a prepared directory (``train.bin`` / ``heldout.bin`` memory-mapped, ``meta.json``): the
training split is one stream of documents, each followed by the EOS id, cut into sequences of ``seq_len + 1`` tokens
(inputs and shifted targets) that overlap by one token, so every token is a target exactly once per epoch. The order
of the sequences is a permutation per epoch drawn from ``(seed, epoch)``; sequence ``k`` of the run (counting from the
first step) is entry ``k mod n`` of epoch ``k // n``'s permutation.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from vescale.core.errors import VescaleError

__all__ = ["DataError", "MarkovCorpus", "TokenData", "MixedData", "DTYPES", "open_data", "resume_offset", "step_rows",
           "parse_sources"]

IGNORE = -100  # an ignored target (F.cross_entropy's ignore_index)

DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


class DataError(VescaleError, ValueError):
    """The training data cannot be used: missing or empty inputs, a tokenizer without EOS, ids past the vocab."""


class MarkovCorpus:
    """Sequences from a fixed random Markov chain in which each token has ``fanout`` likely successors."""

    def __init__(self, vocab_size: int, seed: int, fanout: int = 4) -> None:
        g = torch.Generator().manual_seed(seed)
        self.vocab_size = vocab_size
        self.successors = torch.randint(0, vocab_size, (vocab_size, fanout), generator=g)
        self.probs = torch.softmax(torch.randn(vocab_size, fanout, generator=g) * 1.5, dim=-1)
        self.seed = seed
        self.fingerprint = f"markov-v{vocab_size}-s{seed}-f{fanout}"
        self.tokenizer_dir = None

    def entropy(self) -> float:
        """Per-token entropy of the chain (nats): the lowest loss a model can reach."""
        return float(-(self.probs * self.probs.log()).sum(-1).mean())

    def batch(self, step: int, batch_size: int, seq_len: int, offset: int = 0) -> torch.Tensor:
        """The global batch of ``step``: ``[batch_size, seq_len + 1]`` int64 (inputs and shifted targets).

        A function of ``(seed, step)`` only: ``offset`` (see :meth:`TokenData.batch`) is accepted and ignored."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        tokens = torch.empty(batch_size, seq_len + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, self.vocab_size, (batch_size,), generator=g)
        for t in range(seq_len):
            choice = torch.multinomial(self.probs[tokens[:, t]], 1, generator=g).squeeze(1)
            tokens[:, t + 1] = self.successors[tokens[:, t], choice]
        return tokens


class TokenData:
    """A prepared token directory (``prepare_data.prepare``) as fixed-length training sequences and held-out batches.

    ``seq_len``: tokens a model sees per row (each row holds ``seq_len + 1``). ``seed``: the shuffle of every epoch.
    Raises :class:`DataError` when the training split holds no whole sequence.
    """

    def __init__(self, directory: str | Path, seq_len: int, seed: int) -> None:
        self.directory = Path(directory)
        meta_path = self.directory / "meta.json"
        if not meta_path.is_file():
            raise DataError(f"{self.directory} is not a prepared token directory (no meta.json); "
                            f"run tools/prepare_data.py on the data first")
        self.meta = json.loads(meta_path.read_text())
        dtype = DTYPES[self.meta["dtype"]]
        self.train = _open(self.directory / "train.bin", dtype)
        self.heldout = _open(self.directory / "heldout.bin", dtype)
        self.seq_len, self.seed = seq_len, seed
        self.vocab_size, self.eos_id = int(self.meta["vocab_size"]), int(self.meta["eos_id"])
        self.fingerprint = self.meta["fingerprint"]
        tok = self.directory / "tokenizer"
        self.tokenizer_dir = tok if (tok / "tokenizer.json").is_file() else None
        self.num_sequences = max(0, (len(self.train) - 1) // seq_len)
        if self.num_sequences == 0:
            raise DataError(f"{self.meta.get('source', self.directory)}: the training split has {len(self.train)} "
                            f"tokens, fewer than one sequence of --seq-len {seq_len} + 1")
        self._epoch, self._order = -1, None

    def entropy(self) -> None:
        """Real text has no known floor (the Markov corpus has one)."""
        return None

    def order(self, epoch: int) -> torch.Tensor:
        """The permutation of the training sequences in ``epoch``: a function of ``(seed, epoch)``."""
        if epoch != self._epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._epoch, self._order = epoch, torch.randperm(self.num_sequences, generator=g)
        return self._order

    def sequence(self, index: int) -> np.ndarray:
        """Training sequence ``index`` (``0 <= index < num_sequences``): ``seq_len + 1`` token ids."""
        start = index * self.seq_len
        return self.train[start:start + self.seq_len + 1]

    def batch(self, step: int, batch_size: int, seq_len: int, offset: int = 0) -> torch.Tensor:
        """The global batch of ``step``: ``[batch_size, seq_len + 1]`` int64, sequences ``offset + step * batch_size``
        onwards of the run's order. ``offset`` is 0 for a run that never changed ``batch_size``; a run resumed with
        another batch size passes the difference between the checkpoint's position and ``step * batch_size``."""
        if seq_len != self.seq_len:
            raise DataError(f"batch of seq_len {seq_len} asked of data packed for seq_len {self.seq_len}")
        first = offset + step * batch_size
        return torch.from_numpy(np.stack([self.run_row(k) for k in range(first, first + batch_size)]).astype(np.int64))

    def run_row(self, k: int) -> np.ndarray:
        """Sequence ``k`` of the run: entry ``k mod n`` of epoch ``k // n``'s permutation."""
        epoch, i = divmod(k, self.num_sequences)
        return self.sequence(int(self.order(epoch)[i]))

    def heldout_batches(self, batch_size: int, count: int) -> list[torch.Tensor]:
        """Up to ``count`` held-out batches ``[batch_size, seq_len + 1]``: the held-out split's first sequences in
        order (the same for every run on this data and ``seq_len``); fewer when the split is short, none when it
        holds less than one batch."""
        have = max(0, (len(self.heldout) - 1) // self.seq_len) // batch_size
        out = []
        for b in range(min(count, have)):
            rows = [self.heldout[i * self.seq_len:i * self.seq_len + self.seq_len + 1]
                    for i in range(b * batch_size, (b + 1) * batch_size)]
            out.append(torch.from_numpy(np.stack(rows).astype(np.int64)))
        return out

    def prompt(self, length: int) -> list[int]:
        """The first ``length`` tokens of the held-out split (else of the training split): a prompt from the data."""
        source = self.heldout if len(self.heldout) >= length else self.train
        return [int(t) for t in source[:length]]


def _open(path: Path, dtype) -> np.ndarray:
    """``path`` memory-mapped read-only as a 1-d array of ``dtype`` (an empty array for an empty file)."""
    if path.stat().st_size == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r")


def parse_sources(data: str) -> list[tuple[str, float]] | None:
    """``--data a.jsonl:0.7,dir/:0.3`` as ``[(source, weight), ...]``; None for one source without a weight (an
    existing path is always one source). :class:`DataError` when the weights are not finite, >= 0 and of positive
    sum."""
    if Path(data).exists() or ("," not in data and ":" not in data):
        return None
    out = []
    for part in data.split(","):
        source, _, weight = part.rpartition(":")
        try:
            w = float(weight)
        except ValueError:
            if "," not in data:
                return None  # one source whose name holds a colon
            raise DataError(f"--data {data}: source {part!r} has no weight (SOURCE:WEIGHT)") from None
        if not source or not np.isfinite(w) or w < 0:
            raise DataError(f"--data {data}: source {part!r} needs a path and a finite weight >= 0")
        out.append((source, w))
    if not sum(w for _, w in out) > 0:
        raise DataError(f"--data {data}: the weights sum to {sum(w for _, w in out)}; they must sum to a positive "
                        "number")
    return out


def _open_source(cfg, data: str):
    """One source of ``--data``: prepared conversations (``--chat``), or a prepared token directory."""
    tokenizer = cfg.tokenizer
    if tokenizer is None and (Path(cfg.model) / "tokenizer.json").is_file():
        tokenizer = cfg.model
    if getattr(cfg, "chat", False):
        from chat_data import ChatData, prepare_chat

        if tokenizer is None:
            raise DataError(f"--data {data} --chat needs a tokenizer with a chat template (--model DIR or "
                            "--tokenizer DIR)")
        return ChatData(prepare_chat(data, tokenizer, field=cfg.chat_field, heldout=cfg.heldout), cfg.seq_len,
                        cfg.seed)
    if (Path(data) / "meta.json").is_file() and (Path(data) / "train.bin").is_file():
        directory = Path(data)  # a directory prepare_data.py wrote: used as it is
    else:
        import prepare_data

        directory = prepare_data.prepare(data, tokenizer, field=cfg.data_field, heldout=cfg.heldout).directory
    return TokenData(directory, cfg.seq_len, cfg.seed)


class MixedData:
    """Several sources drawn with weights: row ``k`` of the run comes from source ``choice(k)``, drawn from
    ``(seed, k // BLOCK)``, and is that source's own next row (its row ``j`` of the run, ``j`` the rows it gave
    before ``k``). The whole stream is a function of (sources, weights, seed) and the global row index, so the
    position of every source resumes exactly from a checkpoint's row count on any mesh. The held-out batches, the
    prompt and the tokenizer are the first source's."""

    BLOCK = 4096

    def __init__(self, sources: list, weights: list[float], seed: int) -> None:
        self.sources, self.seed = sources, seed
        self.weights = torch.tensor(weights, dtype=torch.float64) / sum(weights)
        first = sources[0]
        self.vocab_size, self.eos_id, self.tokenizer_dir = first.vocab_size, first.eos_id, first.tokenizer_dir
        self.seq_len = first.seq_len
        self.fingerprint = "mix-" + ",".join(f"{s.fingerprint}:{w:.6g}" for s, w in zip(sources, weights))
        self._before: list[torch.Tensor] = []  # per block: each source's rows before it (choices are redrawn)
        self._last: tuple[int, torch.Tensor] = (-1, torch.empty(0, dtype=torch.long))

    def entropy(self) -> None:
        return None

    def _choices(self, b: int) -> torch.Tensor:
        """The sources of block ``b``'s rows: a function of ``(seed, b)``."""
        if self._last[0] != b:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + 7919 * b + 17)
            self._last = (b, torch.multinomial(self.weights, self.BLOCK, replacement=True, generator=g))
        return self._last[1]

    def _block(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Block ``b``'s choices and each source's rows before it (counts kept, choices redrawn: O(sources) memory
        per block, so a resume after many rows draws the blocks once and keeps little)."""
        while len(self._before) <= b:
            n = len(self._before)
            self._before.append(torch.zeros(len(self.sources), dtype=torch.long) if n == 0 else
                                self._before[-1] + torch.bincount(self._choices(n - 1), minlength=len(self.sources)))
        return self._choices(b), self._before[b]

    def position(self, k: int) -> tuple[int, int]:
        """``(source, its row)`` of row ``k`` of the run."""
        b, i = divmod(k, self.BLOCK)
        choices, before = self._block(b)
        s = int(choices[i])
        return s, int(before[s]) + int((choices[:i] == s).sum())

    def positions(self, rows: int) -> list[int]:
        """How many rows each source gave in the run's first ``rows`` rows (what a resumed run continues from)."""
        b, i = divmod(rows, self.BLOCK)
        choices, before = self._block(b)
        return (before + torch.bincount(choices[:i], minlength=len(self.sources))).tolist()

    def batch(self, step: int, batch_size: int, seq_len: int, offset: int = 0) -> torch.Tensor:
        """The global batch of ``step``: rows ``offset + step * batch_size`` onwards of the mixed run."""
        first = offset + step * batch_size
        rows = [self.sources[s].run_row(j) for s, j in map(self.position, range(first, first + batch_size))]
        return torch.from_numpy(np.stack(rows).astype(np.int64))

    def heldout_batches(self, batch_size: int, count: int) -> list[torch.Tensor]:
        return self.sources[0].heldout_batches(batch_size, count)

    def prompt(self, length: int) -> list[int]:
        return self.sources[0].prompt(length)


def open_data(cfg, vocab_size: int):
    """The data of a ``TrainConfig``: ``--data markov`` the synthetic corpus over ``vocab_size`` ids; with ``--chat``
    the conversations of a ``.jsonl`` (``chat_data.py``); otherwise the prepared token directory of ``--data``
    (``stdlib`` by default), tokenized on first use by ``prepare_data`` (``--tokenizer``, else the ``--model``
    directory's own tokenizer, else for ``stdlib`` its own BPE) and cached; a directory ``prepare_data.py`` wrote is
    opened as it is. ``SOURCE:WEIGHT,...`` mixes several such sources (:class:`MixedData`).
    No communication: every rank may call it (after the first, a cache hit). :class:`DataError` when a source is
    missing or empty, the weights do not sum to a positive number, the data's vocabulary does not fit the model's
    ``vocab_size``, or ``--eval-every`` finds less than one batch held out."""
    if cfg.data == "markov":
        return MarkovCorpus(vocab_size, cfg.seed)
    mix = parse_sources(cfg.data)
    if mix is None:
        data = _open_source(cfg, cfg.data)
    else:
        sources = []
        for source, _ in mix:
            if not Path(source).expanduser().exists() and not any(c in source for c in "*?["):
                raise DataError(f"--data {cfg.data}: source {source}: no such file or directory")
            sources.append(_open_source(cfg, source))
        data = MixedData(sources, [w for _, w in mix], cfg.seed)
        if len({s.vocab_size for s in sources}) > 1:
            raise DataError(f"--data {cfg.data}: the sources' tokenizers differ ({[s.vocab_size for s in sources]} "
                            "ids); mix sources tokenized alike")
    if data.vocab_size > vocab_size:
        raise DataError(f"--data {cfg.data}: its tokenizer has {data.vocab_size} ids but model {cfg.model} embeds "
                        f"{vocab_size} (pick a model with a vocabulary at least that large, or --data markov for "
                        f"the synthetic corpus)")
    if cfg.eval_every and not data.heldout_batches(cfg.batch_size, 1):
        raise DataError(f"--eval-every: the held-out split of --data {cfg.data} holds less than one batch of "
                        f"--batch-size {cfg.batch_size} rows of --seq-len {cfg.seq_len} + 1; raise --heldout")
    return data


def step_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(inputs, targets, trained)`` of a global batch: ``[B, T + 1]`` token rows (targets the inputs shifted by
    one), or ``[B, 2, T + 1]`` labelled rows (ids, then labels with -100 where nothing is trained: chat data);
    ``trained`` counts the targets that are not -100 (``Parallelized.forward_backward``'s ``num_tokens``)."""
    if rows.ndim == 3:
        inputs, targets = rows[:, 0, :-1].contiguous(), rows[:, 1, 1:].contiguous()
    else:
        inputs, targets = rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
    return inputs, targets, int((targets != IGNORE).sum())


def resume_offset(progress: dict, data: MarkovCorpus | TokenData, batch_size: int) -> tuple[int, str | None]:
    """The ``offset`` (:meth:`TokenData.batch`) a run resumed from a checkpoint's ``progress`` (``step``,
    ``sequences`` consumed, ``data`` fingerprint) continues with, and a note for the log when it is not the plain
    continuation: other data than the checkpoint's starts at its own first sequence; another batch size continues
    after the last sequence consumed."""
    step, seen, saved = int(progress["step"]), int(progress.get("sequences") or 0), progress.get("data") or ""
    if saved and saved != data.fingerprint:
        return -step * batch_size, (f"the checkpoint was trained on other data ({saved}); this data "
                                    f"({data.fingerprint}) starts at its first sequence")
    if not saved:  # a checkpoint from before the data position was saved: the batch of a step is a function of it
        return 0, None
    offset = seen - step * batch_size
    note = None if offset == 0 else (f"resumed with --batch-size {batch_size} after {seen} sequences "
                                     f"(step {step}): continuing after them")
    if isinstance(data, MixedData):  # every source's position follows from the mixed stream's row count
        where = ", ".join(f"{s.fingerprint} after row {n}" for s, n in zip(data.sources, data.positions(seen)))
        note = (f"{note}; " if note else "") + f"mixed sources continue: {where}"
    return offset, note
