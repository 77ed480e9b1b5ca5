"""The zoo sweep: every decoder-only causal LM of the installed ``transformers``, planned by ``auto_plan`` and run in
training mode (each config's own dropout) against one device with vescale's RNG on CPU ranks; writes the table into
docs/zoo.md.

    python tools/zoo.py                          # tp=2 and dp=2 x tp=2, every architecture, both plan sources
    python tools/zoo.py --mesh tp=2 --only llama,gpt_neox --no-write
    python tools/zoo.py --every 4                # a sample: every fourth architecture

Results: pass, refused (a clear vescale error), error (a crash), mismatch (a wrong result), skipped (the model
cannot be built small or its single-device run fails); see ``vescale.plan.zoo``. Also writes ``--json``.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from dataclasses import asdict
from pathlib import Path

from vescale.core.mesh import parse_mesh_spec
from vescale.plan.zoo import ZooResult, run_zoo, zoo_architectures, zoo_table

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "docs" / "zoo.md"
BEGIN, END = "<!-- zoo table: written by tools/zoo.py -->", "<!-- end of zoo table -->"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mesh", action="append", help="mesh spec, e.g. tp=2 or dp=2,tp=2 (repeatable)")
    parser.add_argument("--only", help="comma-separated architectures (transformers model types)")
    parser.add_argument("--every", type=int, default=1, metavar="N",
                        help="a sample: every N-th architecture of the sorted list (CI's sample uses 8)")
    parser.add_argument("--plans", default="auto_plan,transformers",
                        help="plan sources: auto_plan (its defaults), auto_plan+sp (sequence_parallel=True), "
                             "transformers (the model's own TP plan, where it has one)")
    parser.add_argument("--json", default="zoo.json", help="where to write the results as JSON")
    parser.add_argument("--no-write", action="store_true", help="do not rewrite the table in docs/zoo.md")
    parser.add_argument("--from-json", help="write the table of an earlier run's JSON instead of running")
    args = parser.parse_args()
    meshes = [parse_mesh_spec(m) for m in (args.mesh or ["tp=2", "dp=2,tp=2"])]
    archs, excluded = zoo_architectures()
    if args.only:
        wanted = set(args.only.split(","))
        unknown = wanted - {a for a, _ in archs}
        if unknown:
            parser.error(f"not decoder-only causal LMs of this transformers: {sorted(unknown)}")
        archs = [a for a in archs if a[0] in wanted]
    archs = archs[::args.every]
    results, started = [], time.time()
    if args.from_json:
        results = [ZooResult(**r) for r in json.loads(Path(args.from_json).read_text())]
    for mesh in meshes if not args.from_json else []:
        results += run_zoo(mesh, archs, plans=tuple(args.plans.split(",")), on_result=lambda r: print(
            f"{r.arch} | {r.mesh} | {r.plan} | {r.result} | {r.reason[:160]}", flush=True))
    results.sort(key=lambda r: (r.arch, r.plan, len(r.mesh)))
    table = zoo_table(results, excluded)
    print(table)
    print(f"{len(results)} runs in {time.time() - started:.0f} s")
    if not args.from_json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in results], indent=1))
    if not args.no_write:
        import torch
        import transformers

        text = README.read_text()
        block = (f"{BEGIN}\n\ntransformers {transformers.__version__}, torch {torch.__version__.split('+')[0]}; "
                 f"training mode with each config's own dropout; fp32, logits, loss and every gradient at rtol 1e-5 "
                 f"against one device with vescale's counter RNG.\n\n{table}\n{END}")
        if BEGIN in text:
            text = re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _: block, text, flags=re.S)
        else:
            text = text.rstrip() + "\n\n## The zoo sweep\n\n" + block + "\n"
        README.write_text(text)


if __name__ == "__main__":
    main()
