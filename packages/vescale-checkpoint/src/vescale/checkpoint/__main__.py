"""``python -m vescale.checkpoint inspect|verify|export-hf PATH ...``: the checkpoint command line.

``export-hf CKPT OUT --config MODEL_DIR`` writes the ``model.`` tensors of any checkpoint (saved from any mesh) as a
directory ``transformers``' ``from_pretrained`` loads: sharded safetensors, their index, ``MODEL_DIR``'s
``config.json`` and, when ``MODEL_DIR`` has one, its tokenizer (or ``--tokenizer DIR``'s).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from vescale.checkpoint.errors import CheckpointError
from vescale.checkpoint.inspection import summary_lines


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit status (0 ok, 1 a checkpoint problem, printed to stderr)."""
    parser = argparse.ArgumentParser(prog="python -m vescale.checkpoint", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("inspect", help="print a summary of a checkpoint: one line per tensor, then the totals")
    p.add_argument("path")
    p.add_argument("--json", action="store_true", help="the full summary as JSON (machine-readable)")
    p = sub.add_parser("verify", help="check every file and checksum; exit 1 naming the damaged files")
    p.add_argument("path")
    p = sub.add_parser("export-hf", help="write Hugging Face sharded safetensors plus index")
    p.add_argument("path")
    p.add_argument("out_dir")
    p.add_argument("--prefix", default="model.", help="state key prefix of the model's tensors (default model.)")
    p.add_argument("--config", help="config.json to copy alongside, or the Hugging Face model directory the model came "
                                    "from (its config.json, and its tokenizer when it has one)")
    p.add_argument("--tokenizer", help="a Hugging Face tokenizer directory to save beside the weights (needs "
                                       "transformers)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="cast floating-point tensors")
    p.add_argument("--max-shard-gb", type=float, default=5.0)
    args = parser.parse_args(argv)
    if args.command == "export-hf":
        args.config, args.tokenizer = _export_sources(parser, args.config, args.tokenizer)
    from vescale import checkpoint

    try:
        if args.command == "inspect":
            info = checkpoint.inspect(args.path)
            print(json.dumps(info, indent=2) if args.json else "\n".join(summary_lines(info)))
        elif args.command == "verify":
            print(json.dumps({"ok": True, **checkpoint.verify(args.path)}))
        else:
            import torch

            files = checkpoint.export_hf(args.path, args.out_dir, prefix=args.prefix, config=args.config,
                                         dtype=getattr(torch, args.dtype) if args.dtype else None,
                                         max_shard_bytes=int(args.max_shard_gb * (1 << 30)))
            if args.tokenizer:
                from transformers import AutoTokenizer

                saved = AutoTokenizer.from_pretrained(args.tokenizer).save_pretrained(args.out_dir)
                files += [os.path.basename(f) for f in saved]
            print(json.dumps({"out_dir": args.out_dir, "files": files}))
    except CheckpointError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def _export_sources(parser: argparse.ArgumentParser, config: str | None, tokenizer: str | None
                    ) -> tuple[str | None, str | None]:
    """``(config.json path, tokenizer directory)`` of ``export-hf``'s ``--config`` / ``--tokenizer``; a model
    directory as ``--config`` gives both (its tokenizer only when it has one and ``--tokenizer`` is not given).
    A usage error (exit 2) naming the path when neither is what it should be."""
    if config is not None and os.path.isdir(config):
        directory, config = config, os.path.join(config, "config.json")
        if not os.path.isfile(config):
            parser.error(f"--config {directory}: a directory without config.json (expected a Hugging Face model "
                         f"directory, or give the config.json file)")
        if tokenizer is None and any(os.path.isfile(os.path.join(directory, f)) for f in _TOKENIZER_FILES):
            tokenizer = directory
    elif config is not None and not os.path.isfile(config):
        parser.error(f"--config {config}: no such file or directory")
    if tokenizer is not None and not any(os.path.isfile(os.path.join(tokenizer, f)) for f in _TOKENIZER_FILES):
        parser.error(f"--tokenizer {tokenizer}: no tokenizer there (none of {list(_TOKENIZER_FILES)})")
    return config, tokenizer


if __name__ == "__main__":
    sys.exit(main())
