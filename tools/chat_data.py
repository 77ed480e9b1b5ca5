"""Chat data for ``tools/train.py --data FILE.jsonl --chat``: conversations formatted by the tokenizer's chat
template, trained on the assistant's tokens only.

Each line of the ``.jsonl`` is one conversation: its ``--chat-field`` (default ``messages``) holds a list of
``{"role", "content"}``. The tokenizer (``--tokenizer``, else the ``--model`` directory) formats it with
``apply_chat_template``; a token is trained when it belongs to an assistant turn, found by rendering the conversation
up to that turn with the generation prompt (the turn's text is what follows), so the template needs no
``{% generation %}`` markers. Rows are padded, not packed: one conversation per row of ``seq_len + 1`` tokens
(longer ones cut), the padding and every non-assistant token ignored in the targets (-100), so no conversation
attends to another. :func:`prepare_chat` tokenizes once into the cache (``ids.bin``, ``trained.bin``,
``offsets.bin`` per split, ``meta.json``); :class:`ChatData` serves ``[B, 2, seq_len + 1]`` batches (ids, labels)
as a pure function of (data, seed, step), like ``data.TokenData``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import torch

TOOLS = str(Path(__file__).resolve().parent)
if TOOLS not in sys.path:
    sys.path.insert(0, TOOLS)
from data import DataError  # noqa: E402

__all__ = ["ChatData", "prepare_chat", "chat_tokenizer", "conversation_tokens", "IGNORE"]

FORMAT = 1
IGNORE = -100
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def chat_tokenizer(directory: str | Path):
    """The transformers tokenizer of ``directory``; :class:`DataError` when it has no chat template."""
    from transformers import AutoTokenizer

    if not (Path(directory) / "tokenizer.json").is_file():
        raise DataError(f"--chat: {directory} has no tokenizer.json (give --tokenizer DIR or --model DIR)")
    tok = AutoTokenizer.from_pretrained(str(directory))
    if not getattr(tok, "chat_template", None):
        raise DataError(f"--chat: the tokenizer in {directory} has no chat template (chat_template in "
                        "tokenizer_config.json or chat_template.jinja)")
    return tok


def conversation_tokens(tok, messages: list[dict], where: str = "conversation") -> tuple[list[int], list[bool]]:
    """The ids of ``messages`` formatted by ``tok``'s chat template, and per id whether it is an assistant token.

    An assistant turn ``i`` spans the text the template adds between ``messages[:i]`` with the generation prompt and
    ``messages[:i + 1]`` (its content and end-of-turn marker). Raises :class:`DataError` naming ``where`` when the
    template does not render a conversation as the extension of its prefixes."""
    text = tok.apply_chat_template(messages, tokenize=False)
    spans = []
    for i, m in enumerate(messages):
        if m.get("role") != "assistant":
            continue
        before = tok.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True) if i else ""
        upto = tok.apply_chat_template(messages[:i + 1], tokenize=False)
        if not (upto.startswith(before) and text.startswith(upto)):
            raise DataError(f"{where}: the chat template does not render turn {i} as an extension of the turns "
                            "before it, so its assistant tokens cannot be told apart")
        spans.append((len(before), len(upto)))
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    trained = [any(a <= start < b for a, b in spans) for start, _ in enc["offset_mapping"]]
    return list(enc["input_ids"]), trained


def _conversations(path: Path, field: str):
    """``(where, messages)`` of each non-blank line of ``path``; :class:`DataError` naming the line otherwise."""
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}:{n}: not JSON ({exc.msg})") from None
            messages = record.get(field) if isinstance(record, dict) else None
            if not isinstance(messages, list) or not all(
                    isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                    for m in messages):
                raise DataError(f"{path}:{n}: no chat field {field!r} (a list of {{'role', 'content'}}; set "
                                "--chat-field)")
            yield f"{path}:{n}", messages


def prepare_chat(data: str | Path, tokenizer: str | Path, *, field: str = "messages", heldout: float = 0.02,
                 split_seed: int = 0, cache: str | Path | None = None) -> Path:
    """Tokenize the conversations of ``data`` (a ``.jsonl`` file) into the cache, once; returns the directory.

    Raises :class:`DataError` for a missing or empty file, a line without ``field``, a tokenizer without a chat
    template, or a file with no assistant token."""
    from prepare_data import cache_root, heldout_documents

    path = Path(data).expanduser()
    if not path.is_file():
        why = "a directory" if path.is_dir() else "no such file"
        raise DataError(f"--data {data} --chat: {why} (--chat reads one .jsonl file of conversations)")
    tok = chat_tokenizer(tokenizer)
    digest = hashlib.sha256(json.dumps({"chat": FORMAT, "field": field, "heldout": heldout,
                                        "split_seed": split_seed}).encode() + path.read_bytes())
    for name in _TOKENIZER_FILES:
        if (Path(tokenizer) / name).is_file():
            digest.update(b"\0tok\0" + (Path(tokenizer) / name).read_bytes())
    key = digest.hexdigest()[:20]
    target = (Path(cache) if cache is not None else cache_root()) / "chat" / key
    if (target / "meta.json").is_file():
        return target
    convs = [conversation_tokens(tok, messages, where) for where, messages in _conversations(path, field)]
    if not convs:
        raise DataError(f"--data {data} --chat: the file holds no conversation")
    if not any(any(t) for _, t in convs):
        raise DataError(f"--data {data} --chat: no conversation has an assistant turn (nothing to train on)")
    held = heldout_documents(len(convs), heldout, split_seed)
    tmp = target.with_name(f"{key}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    counts = {}
    for split, keep in (("train", lambda i: i not in held), ("heldout", lambda i: i in held)):
        chosen = [convs[i] for i in range(len(convs)) if keep(i)]
        ids = np.array([t for c, _ in chosen for t in c], dtype=np.uint32)
        trained = np.array([m for _, ms in chosen for m in ms], dtype=np.uint8)
        offsets = np.cumsum([0] + [len(c) for c, _ in chosen]).astype(np.int64)
        ids.tofile(tmp / f"{split}_ids.bin")
        trained.tofile(tmp / f"{split}_trained.bin")
        offsets.tofile(tmp / f"{split}_offsets.bin")
        counts[f"{split}_conversations"], counts[f"{split}_trained_tokens"] = len(chosen), int(trained.sum())
    (tmp / "tokenizer").mkdir()
    for name in _TOKENIZER_FILES:
        if (Path(tokenizer) / name).is_file():
            shutil.copy(Path(tokenizer) / name, tmp / "tokenizer" / name)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    meta = {"format": FORMAT, "fingerprint": f"chat-{key}", "source": str(path), "field": field,
            "vocab_size": len(tok), "pad_id": int(pad or 0), "eos_id": tok.eos_token_id, **counts}
    (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
    from prepare_data import _commit

    _commit(tmp, target)
    return target


class ChatData:
    """Prepared conversations (:func:`prepare_chat`) as padded rows ``[2, seq_len + 1]``: ids, and labels (the id
    where it is an assistant token, else -100). A batch is ``[B, 2, seq_len + 1]`` (``data.step_rows`` splits it
    into inputs and targets); conversation ``k`` of the run is entry ``k mod n`` of epoch ``k // n``'s permutation,
    drawn from ``(seed, epoch)``."""

    def __init__(self, directory: str | Path, seq_len: int, seed: int) -> None:
        self.directory = Path(directory)
        self.meta = json.loads((self.directory / "meta.json").read_text())
        self.seq_len, self.seed = seq_len, seed
        self.vocab_size, self.pad_id = int(self.meta["vocab_size"]), int(self.meta["pad_id"])
        self.eos_id = self.meta["eos_id"]
        self.fingerprint = self.meta["fingerprint"]
        self.tokenizer_dir = self.directory / "tokenizer"
        self.splits = {s: tuple(np.fromfile(self.directory / f"{s}_{k}.bin", dtype=d)
                                for k, d in (("ids", np.uint32), ("trained", np.uint8), ("offsets", np.int64)))
                       for s in ("train", "heldout")}
        self.num_sequences = len(self.splits["train"][2]) - 1
        if self.num_sequences == 0:
            raise DataError(f"{self.meta['source']} --chat: no conversation left for training")
        self._epoch, self._order = -1, None

    def entropy(self) -> None:
        return None

    def row(self, split: str, index: int) -> np.ndarray:
        """Conversation ``index`` of ``split`` as ``[2, seq_len + 1]`` int64: ids (padded with the pad id), labels."""
        ids, trained, offsets = self.splits[split]
        a, b = int(offsets[index]), int(offsets[index + 1])
        b = min(b, a + self.seq_len + 1)
        out = np.full((2, self.seq_len + 1), IGNORE, dtype=np.int64)
        out[0] = self.pad_id
        out[0, :b - a] = ids[a:b]
        out[1, :b - a] = np.where(trained[a:b] > 0, ids[a:b].astype(np.int64), IGNORE)
        return out

    def order(self, epoch: int) -> torch.Tensor:
        if epoch != self._epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._epoch, self._order = epoch, torch.randperm(self.num_sequences, generator=g)
        return self._order

    def batch(self, step: int, batch_size: int, seq_len: int, offset: int = 0) -> torch.Tensor:
        """The global batch of ``step``: ``[batch_size, 2, seq_len + 1]`` (see :meth:`data.TokenData.batch` for
        ``offset``)."""
        if seq_len != self.seq_len:
            raise DataError(f"batch of seq_len {seq_len} asked of chat rows padded to {self.seq_len}")
        first = offset + step * batch_size
        return torch.from_numpy(np.stack([self.run_row(k) for k in range(first, first + batch_size)]))

    def run_row(self, k: int) -> np.ndarray:
        """Conversation ``k`` of the run, as a row: entry ``k mod n`` of epoch ``k // n``'s permutation."""
        return self.row("train", int(self.order(k // self.num_sequences)[k % self.num_sequences]))

    def heldout_batches(self, batch_size: int, count: int) -> list[torch.Tensor]:
        """Up to ``count`` held-out batches ``[batch_size, 2, seq_len + 1]``, the held-out conversations in order."""
        have = (len(self.splits["heldout"][2]) - 1) // batch_size
        return [torch.from_numpy(np.stack([self.row("heldout", i) for i in range(b * batch_size,
                                                                                   (b + 1) * batch_size)]))
                for b in range(min(count, have))]

    def prompt(self, length: int) -> list[int]:
        """The chat prompt of the first held-out (else training) conversation: its turns before the first assistant
        turn, formatted by the template with the generation prompt (at most ``length`` ids, the last ones)."""
        split = "heldout" if len(self.splits["heldout"][2]) > 1 else "train"
        ids, trained, offsets = self.splits[split]
        a, b = int(offsets[0]), int(offsets[1])
        first = next((k for k in range(a, b) if trained[k]), b)  # the assistant turn starts after the prompt
        return [int(t) for t in ids[a:first]][-length:]
