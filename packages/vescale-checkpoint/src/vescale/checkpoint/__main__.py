"""``python -m vescale.checkpoint inspect|verify|export-hf PATH ...``: the checkpoint command line."""

from __future__ import annotations

import argparse
import json
import sys

from vescale.checkpoint.errors import CheckpointError


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit status (0 ok, 1 a checkpoint problem, printed to stderr)."""
    parser = argparse.ArgumentParser(prog="python -m vescale.checkpoint", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("inspect", help="print a JSON summary of a checkpoint")
    p.add_argument("path")
    p = sub.add_parser("verify", help="check every file and checksum; exit 1 naming the damaged files")
    p.add_argument("path")
    p = sub.add_parser("export-hf", help="write Hugging Face sharded safetensors plus index")
    p.add_argument("path")
    p.add_argument("out_dir")
    p.add_argument("--prefix", default="model.", help="state key prefix of the model's tensors (default model.)")
    p.add_argument("--config", help="config.json to copy alongside")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="cast floating-point tensors")
    p.add_argument("--max-shard-gb", type=float, default=5.0)
    args = parser.parse_args(argv)
    from vescale import checkpoint

    try:
        if args.command == "inspect":
            print(json.dumps(checkpoint.inspect(args.path), indent=2))
        elif args.command == "verify":
            print(json.dumps({"ok": True, **checkpoint.verify(args.path)}))
        else:
            import torch

            files = checkpoint.export_hf(args.path, args.out_dir, prefix=args.prefix, config=args.config,
                                         dtype=getattr(torch, args.dtype) if args.dtype else None,
                                         max_shard_bytes=int(args.max_shard_gb * (1 << 30)))
            print(json.dumps({"out_dir": args.out_dir, "files": files}))
    except CheckpointError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
