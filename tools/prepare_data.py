"""Tokenize training text once into a memory-mapped token directory that ``tools/train.py --data`` reads.

    python tools/prepare_data.py DIR_OR_GLOB --tokenizer TOKENIZER_DIR     # text files (.jsonl: --data-field text)
    python tools/prepare_data.py tokens.bin --tokenizer TOKENIZER_DIR      # already tokenized ids, split only
    python tools/prepare_data.py stdlib                                    # the default corpus (see below)

Inputs: a directory (every file under it, recursively, in path order, hidden ones skipped), a glob, or one file.
Each text file is one document; each line of a ``.jsonl`` file is one document (its ``--data-field``). A ``.bin`` is
a flat stream of token ids (uint16 unless a sidecar ``<name>.json`` says ``{"dtype": "uint32"}``; it may also give
``eos_id`` and ``vocab_size``) whose documents are the runs between EOS ids. Files that are not UTF-8 text are skipped
and counted (each still takes its index in the held-out draw, so a skipped file drawn is one document fewer held
out).

Output (``prepare``): a directory ``<cache>/data/<key>`` holding ``train.bin`` and ``heldout.bin`` (each document's
ids followed by the EOS id, uint16 when the vocabulary fits, else uint32), ``meta.json`` and a copy of the tokenizer
(``tokenizer/``). ``key`` is a content hash of the inputs' bytes, the tokenizer's files and the split settings, so a
second call with the same inputs finds the directory and does no work. The held-out split is a fixed fraction of the
documents (at least one when there are two or more), chosen by a seeded draw.

``stdlib`` is the corpus every machine has: the running interpreter's standard library ``.py`` sources (tests
excluded; files taken in a fixed hash order of their paths up to ``STDLIB_BYTES``), with a byte-level BPE tokenizer
of ``STDLIB_VOCAB`` ids trained on it at first use (the ``tokenizers`` package) and cached beside the data.

The cache root is ``$VESCALE_CACHE``, else ``~/.cache/vescale``.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import shutil
import sys
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

TOOLS = str(Path(__file__).resolve().parent)
if TOOLS not in sys.path:
    sys.path.insert(0, TOOLS)
from data import DTYPES, DataError  # noqa: E402

__all__ = ["Prepared", "prepare", "cache_root", "stdlib_tokenizer", "load_tokenizer", "STDLIB_VOCAB", "STDLIB_BYTES"]

FORMAT = 1  # bump when the layout of a prepared directory changes (part of every cache key)
STDLIB_VOCAB = 512  # the built-in models' vocabulary (tools/models.py): 256 bytes, 255 merges, one EOS
STDLIB_BYTES = 3 * 2**20
STDLIB_EOS = "<|endoftext|>"
_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
_EOS_NAMES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<|im_end|>")


@dataclass
class Prepared:
    """A prepared token directory: ``directory`` (what ``data.TokenData`` opens), its ``meta.json`` contents, and
    whether this call built it (``False``: found in the cache)."""

    directory: Path
    meta: dict
    built: bool


def cache_root() -> Path:
    """``$VESCALE_CACHE``, else ``~/.cache/vescale``."""
    return Path(os.environ.get("VESCALE_CACHE") or Path.home() / ".cache" / "vescale")


# ---------------------------------------------------------------------------------------------------- tokenizers
def load_tokenizer(directory: str | Path):
    """``(tokenizers.Tokenizer, eos_id, vocab_size)`` of a Hugging Face tokenizer directory (its ``tokenizer.json``).

    The EOS token is ``eos_token`` of ``tokenizer_config.json`` or ``special_tokens_map.json``, else the first of the
    usual EOS names the vocabulary holds; :class:`DataError` when there is no ``tokenizer.json`` or no EOS."""
    from tokenizers import Tokenizer

    directory = Path(directory)
    path = directory / "tokenizer.json"
    if not path.is_file():
        raise DataError(f"--tokenizer {directory}: no tokenizer.json there (a Hugging Face 'fast' tokenizer "
                        f"directory, as save_pretrained writes, is needed)")
    tok = Tokenizer.from_file(str(path))
    names = []
    for meta in ("tokenizer_config.json", "special_tokens_map.json"):
        if (directory / meta).is_file():
            eos = json.loads((directory / meta).read_text()).get("eos_token")
            names.append(eos.get("content") if isinstance(eos, dict) else eos)
    names += list(_EOS_NAMES)
    for name in names:
        if name and tok.token_to_id(name) is not None:
            return tok, int(tok.token_to_id(name)), int(tok.get_vocab_size(with_added_tokens=True))
    raise DataError(f"--tokenizer {directory}: no EOS token (no eos_token in tokenizer_config.json and none of "
                    f"{list(_EOS_NAMES)} in the vocabulary); documents need one between them")


def _write_tokenizer_dir(tok, directory: Path, eos: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos, "bos_token": eos, "unk_token": eos,
         "model_max_length": 1 << 20}, indent=2))


def stdlib_files(limit: int = STDLIB_BYTES) -> list[Path]:
    """The default corpus's files: standard library ``.py`` sources of this interpreter (no test directories), in
    the order of a hash of their relative paths (a spread over the library, the same on every run), up to ``limit``
    bytes."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS)  # pruned: site-packages may be large
        files += [Path(folder) / n for n in names if n.endswith(".py") and not n.startswith("test_")]
    files.sort(key=lambda p: hashlib.sha1(p.relative_to(root).as_posix().encode()).hexdigest())
    out, total = [], 0
    for p in files:
        size = p.stat().st_size
        if total + size > limit:
            continue
        out.append(p)
        total += size
    return out


def stdlib_tokenizer(files: list[Path] | None = None, cache: Path | None = None) -> Path:
    """The default corpus's byte-level BPE tokenizer directory (``STDLIB_VOCAB`` ids, EOS ``<|endoftext|>``),
    trained on ``files`` at first use and cached under ``<cache>/tokenizers/stdlib-<content hash>``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    files = stdlib_files() if files is None else files
    digest = hashlib.sha256(f"stdlib-bpe-{STDLIB_VOCAB}-{FORMAT}".encode())
    for p in files:
        digest.update(p.name.encode() + b"\0" + p.read_bytes())
    target = (cache or cache_root()) / "tokenizers" / f"stdlib-{digest.hexdigest()[:16]}"
    if (target / "tokenizer.json").is_file():
        return target
    print(f"prepare_data: training the default corpus's BPE tokenizer on {len(files)} standard library files "
          f"(once; cached under {target.parent})", file=sys.stderr, flush=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=STDLIB_VOCAB, special_tokens=[STDLIB_EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator((_read_text(p) or "" for p in files), trainer)
    tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    _write_tokenizer_dir(tok, tmp, STDLIB_EOS)
    _commit(tmp, target)
    return target


# ------------------------------------------------------------------------------------------------------ inputs
def _read_text(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return None


def find_inputs(data: str) -> list[Path]:
    """The files ``data`` names (a file, a directory searched recursively, or a glob), in path order."""
    path = Path(data).expanduser()
    if path.is_file():
        return [path]
    if path.is_dir():
        files = [p for p in path.rglob("*") if p.is_file()
                 and not any(part.startswith(".") for part in p.relative_to(path).parts)]
    elif any(c in data for c in "*?["):
        files = [Path(p) for p in glob.glob(os.path.expanduser(data), recursive=True) if Path(p).is_file()]
    else:
        raise DataError(f"--data {data}: no such file or directory")
    if not files:
        raise DataError(f"--data {data}: no files there")
    return sorted(files)


def _documents(files: list[Path], field: str, skipped: list[str]) -> Iterator[str]:
    """Each document's text: a whole text file, or ``field`` of each line of a ``.jsonl`` file."""
    for path in files:
        if path.suffix == ".jsonl":
            with open(path, encoding="utf-8") as f:
                for n, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    record = json.loads(line)
                    if not isinstance(record, dict) or not isinstance(record.get(field), str):
                        raise DataError(f"{path}:{n}: no text field {field!r} (set --data-field)")
                    yield record[field]
        else:
            text = _read_text(path)
            if text is None:
                skipped.append(str(path))
            else:
                yield text


def _count_documents(files: list[Path]) -> int:
    count = 0
    for path in files:
        if path.suffix == ".jsonl":
            with open(path, encoding="utf-8") as f:
                count += sum(1 for line in f if line.strip())
        else:
            count += 1
    return count


def heldout_documents(num_docs: int, fraction: float, seed: int) -> set[int]:
    """Indices of the held-out documents: ``round(fraction * num_docs)`` of them (at least one when there are two
    or more documents and ``fraction > 0``, never all), drawn from ``seed``."""
    if num_docs < 2 or fraction <= 0:
        return set()
    k = min(num_docs - 1, max(1, round(fraction * num_docs)))
    return {int(i) for i in np.random.default_rng(seed).choice(num_docs, size=k, replace=False)}


# ------------------------------------------------------------------------------------------------------ prepare
def prepare(data: str, tokenizer: str | Path | None = None, *, field: str = "text", heldout: float = 0.02,
            split_seed: int = 0, cache: str | Path | None = None) -> Prepared:
    """Tokenize ``data`` (see the module docstring; ``"stdlib"`` for the default corpus) into the cache, once.

    ``tokenizer``: a Hugging Face tokenizer directory (``None`` for ``stdlib``, or for a ``.bin`` whose sidecar
    gives ``eos_id``). ``heldout``: the fraction of documents held out, drawn with ``split_seed``. Returns the
    directory; raises :class:`DataError` naming the input when it cannot be used.
    """
    cache = Path(cache) if cache is not None else cache_root()
    if data == "stdlib":
        files = stdlib_files()
        if not files:
            raise DataError(f"no standard library sources under {sysconfig.get_paths()['stdlib']}")
        tokenizer = stdlib_tokenizer(files, cache) if tokenizer is None else tokenizer
        source = f"stdlib:{sysconfig.get_paths()['stdlib']}"
    else:
        files, source = find_inputs(data), str(data)
    binary = len(files) == 1 and files[0].suffix == ".bin"
    sidecar = json.loads(files[0].with_suffix(".json").read_text()) if binary and files[0].with_suffix(
        ".json").is_file() else {}
    tok = eos_id = vocab_size = None
    if tokenizer is not None:
        tok, eos_id, vocab_size = load_tokenizer(tokenizer)
    elif not binary:
        raise DataError(f"--data {data}: text needs a tokenizer (--tokenizer DIR, or --model DIR with one)")
    eos_id = int(sidecar.get("eos_id", eos_id if eos_id is not None else -1))
    if binary and eos_id < 0:
        raise DataError(f"--data {data}: no EOS id for the .bin (give --tokenizer DIR or 'eos_id' in "
                        f"{files[0].with_suffix('.json')})")

    digest = hashlib.sha256(json.dumps({"format": FORMAT, "field": field, "heldout": heldout,
                                        "split_seed": split_seed, "binary": binary, "sidecar": sidecar}).encode())
    for p in files:
        digest.update(b"\0file\0" + p.read_bytes())
    if tokenizer is not None:
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (Path(tokenizer) / name).is_file():
                digest.update(b"\0tok\0" + (Path(tokenizer) / name).read_bytes())
    key = digest.hexdigest()[:20]
    target = cache / "data" / key
    if (target / "meta.json").is_file():
        return Prepared(target, json.loads((target / "meta.json").read_text()), built=False)

    tmp = target.with_name(f"{key}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    print(f"prepare_data: tokenizing {len(files)} file(s) of {source} (once; cached under {target})",
          file=sys.stderr, flush=True)
    if binary:
        dtype_name = sidecar.get("dtype", "uint16")
        if dtype_name not in DTYPES:
            raise DataError(f"{files[0].with_suffix('.json')}: dtype {dtype_name!r} is not one of {list(DTYPES)}")
        ids = np.fromfile(files[0], dtype=DTYPES[dtype_name])
        vocab_size = int(sidecar.get("vocab_size", vocab_size or (int(ids.max()) + 1 if len(ids) else 0)))
        if len(ids) and int(ids.max()) >= vocab_size:
            raise DataError(f"--data {data}: token id {int(ids.max())} is past the vocabulary ({vocab_size} ids)")
        counts, skipped = _split_binary(ids, eos_id, heldout, split_seed, tmp, DTYPES[dtype_name]), []
    else:
        dtype_name = "uint16" if vocab_size <= 2**16 else "uint32"
        skipped: list[str] = []
        held = heldout_documents(_count_documents(files), heldout, split_seed)
        counts = _tokenize(_documents(files, field, skipped), tok, eos_id, held, tmp, DTYPES[dtype_name])
    if counts["train_tokens"] == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        raise DataError(f"--data {data}: no tokens in the training split ({counts['train_docs']} documents, "
                        f"{len(skipped)} files skipped as not UTF-8 text)")
    if tokenizer is not None:
        (tmp / "tokenizer").mkdir()
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (Path(tokenizer) / name).is_file():
                shutil.copy(Path(tokenizer) / name, tmp / "tokenizer" / name)
    meta = {"format": FORMAT, "fingerprint": key, "source": source, "files": len(files), "skipped": skipped[:20],
            "skipped_count": len(skipped), "dtype": dtype_name, "vocab_size": vocab_size, "eos_id": eos_id,
            "heldout_fraction": heldout, "split_seed": split_seed, **counts,
            "tokenizer": str(tokenizer) if tokenizer is not None else None}
    (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
    _commit(tmp, target)
    return Prepared(target, meta, built=True)


def _tokenize(docs: Iterator[str], tok, eos_id: int, held: set[int], out: Path, dtype, chunk: int = 256) -> dict:
    """Encode ``docs`` in chunks, appending each document's ids and the EOS id to ``train.bin`` or ``heldout.bin``."""
    counts = {"train_docs": 0, "heldout_docs": 0, "train_tokens": 0, "heldout_tokens": 0}
    limit = np.iinfo(dtype).max
    with open(out / "train.bin", "wb") as train, open(out / "heldout.bin", "wb") as hold:
        index, batch = 0, []

        def flush() -> None:
            nonlocal index
            for enc in tok.encode_batch(batch, add_special_tokens=False):
                ids = np.asarray([*enc.ids, eos_id], dtype=np.int64)
                if ids.max() > limit:
                    raise DataError(f"token id {int(ids.max())} does not fit {np.dtype(dtype).name}")
                split = "heldout" if index in held else "train"
                (hold if split == "heldout" else train).write(ids.astype(dtype).tobytes())
                counts[f"{split}_docs"] += 1
                counts[f"{split}_tokens"] += len(ids)
                index += 1
            batch.clear()

        for text in docs:
            batch.append(text)
            if len(batch) == chunk:
                flush()
        if batch:
            flush()
    return counts


def _split_binary(ids: np.ndarray, eos_id: int, fraction: float, seed: int, out: Path, dtype) -> dict:
    """Split a token stream into its EOS-ended documents (a last one without EOS gets one) and write the splits."""
    ends = np.flatnonzero(ids == eos_id) + 1
    if len(ids) and (not len(ends) or ends[-1] != len(ids)):
        ids, ends = np.concatenate([ids, np.asarray([eos_id], dtype=ids.dtype)]), np.append(ends, len(ids) + 1)
    starts = np.concatenate([[0], ends[:-1]]).astype(np.int64)
    held = heldout_documents(len(ends), fraction, seed)
    counts = {"train_docs": 0, "heldout_docs": 0, "train_tokens": 0, "heldout_tokens": 0}
    with open(out / "train.bin", "wb") as train, open(out / "heldout.bin", "wb") as hold:
        for i, (a, b) in enumerate(zip(starts, ends)):
            split = "heldout" if i in held else "train"
            (hold if split == "heldout" else train).write(ids[a:b].astype(dtype).tobytes())
            counts[f"{split}_docs"] += 1
            counts[f"{split}_tokens"] += int(b - a)
    return counts


def _commit(tmp: Path, target: Path) -> None:
    """Move the finished ``tmp`` into place; if another process got there first, keep its (identical) result."""
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.rename(tmp, target)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not target.exists():
            raise


def main(argv: list[str] | None = None) -> Prepared:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("data", help="directory, glob, text/.jsonl file, .bin of ids, or 'stdlib'")
    p.add_argument("--tokenizer", default=None, help="Hugging Face tokenizer directory (tokenizer.json)")
    p.add_argument("--data-field", default="text", help="the text field of .jsonl records")
    p.add_argument("--heldout", type=float, default=0.02, help="fraction of documents held out")
    p.add_argument("--cache", default=None, help="cache root (default $VESCALE_CACHE, else ~/.cache/vescale)")
    args = p.parse_args(argv)
    try:
        prepared = prepare(args.data, args.tokenizer, field=args.data_field, heldout=args.heldout, cache=args.cache)
    except DataError as exc:
        raise SystemExit(f"prepare_data.py: {exc}") from None
    print(json.dumps({"directory": str(prepared.directory), "built": prepared.built, **prepared.meta}, indent=2))
    return prepared


if __name__ == "__main__":
    main()
