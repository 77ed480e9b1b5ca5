"""``python -m vescale.plan MODEL --world-size N ...``: plan a job from its model config, on any machine.

MODEL is a Hugging Face ``config.json`` (or a model directory holding one; weights are never read) or a
``transformers`` model type (``llama``, ``mixtral``, ...: that family's default config). The model is built on the
meta device (shapes only), priced by :func:`vescale.plan.choose_parallelism` for every ``pp x dp x cp x ep x tp`` and
ZeRO stage, and the choice printed: the spec (JSON for ``tools/train.py --spec``), memory per rank by term, the
step-time estimate by term, and the best alternatives with why each lost. Nothing fits: exit status 2 with the
reasons; bad input (MODEL, ``--fixed``, hardware file): exit status 1 naming it. ``--calibrate FILE`` instead measures
this machine (:func:`vescale.plan.calibrate.calibrate`) and writes a ``--hardware`` file. ``--dry-run`` then builds
the choice for one rank of the whole world in this process (:func:`vescale.plan.dry_run`) and prints its exact bytes
beside the estimate and the collectives of one step by mesh dim.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

from vescale.plan.cost import CostEstimate, HardwareModel

__all__ = ["main", "HARDWARE", "load_config", "meta_model"]

# Nominal per-GPU figures (bf16 dense peak x 0.4 as the achieved matmul rate; NVLink within a node for tp / cp / ep,
# one 400 Gb/s NIC per GPU across nodes for dp / pp). Calibrate for a real cluster: --hardware FILE.
HARDWARE: dict[str, tuple[HardwareModel, float]] = {
    "h100": (HardwareModel(device_tflops=400.0, tp_gbps=450.0, cp_gbps=450.0, ep_gbps=450.0, dp_gbps=50.0,
                           pp_gbps=50.0, collective_latency_s=20e-6), 80.0),
    "h200": (HardwareModel(device_tflops=400.0, tp_gbps=450.0, cp_gbps=450.0, ep_gbps=450.0, dp_gbps=50.0,
                           pp_gbps=50.0, collective_latency_s=20e-6), 141.0),
}
EXIT_BAD_INPUT, EXIT_NOTHING_FITS = 1, 2


class CliError(Exception):
    """Bad command-line input; the message names the argument."""


def _read_json(path: Path, what: str) -> Any:
    """The JSON value in ``path``; a ``CliError`` naming ``what`` when it is not valid JSON."""
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CliError(f"{what} is not valid JSON: {exc}") from None


def load_config(model: str):
    """The ``transformers`` config for MODEL: a ``config.json`` file, a directory with one, or a model type."""
    import transformers

    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            raise CliError(f"MODEL {model!r} is a directory without config.json")
    if path.suffix == ".json" or path.is_file():
        if not path.is_file():
            raise CliError(f"MODEL {model!r}: no such file")
        data = _read_json(path, f"MODEL {model!r}")
        kind = data.pop("model_type", None) if isinstance(data, dict) else None
        if not kind:
            raise CliError(f"MODEL {model!r} has no \"model_type\" (a Hugging Face config.json names its family)")
        data.pop("architectures", None)
        try:
            return transformers.AutoConfig.for_model(kind, **data)
        except ValueError as exc:
            raise CliError(f"MODEL {model!r}: model_type {kind!r}: {exc}") from None
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model in CONFIG_MAPPING:
        return CONFIG_MAPPING[model]()
    raise CliError(f"MODEL {model!r} is neither a config.json, a model directory, nor a transformers model type "
                   f"(e.g. llama, mixtral, qwen2; {len(CONFIG_MAPPING)} known)")


def meta_model(config, *, attention: str = "sdpa", dtype: str = "bf16"):
    """The causal LM of ``config`` on the meta device (no storage), key/value cache off (training)."""
    import torch
    import transformers

    config.use_cache = False
    with torch.device("meta"):
        try:
            return transformers.AutoModelForCausalLM.from_config(
                config, attn_implementation=attention, dtype=torch.bfloat16 if dtype == "bf16" else torch.float32)
        except ValueError as exc:
            raise CliError(f"model type {config.model_type!r} has no causal-LM class in transformers: {exc}") from None


def _hardware(name: str | None) -> tuple[HardwareModel, float | None]:
    if name is None:
        return HardwareModel(), None
    if name in HARDWARE:
        return HARDWARE[name]
    path = Path(name)
    if not path.is_file():
        raise CliError(f"--hardware {name!r} is neither {sorted(HARDWARE)} nor a JSON file")
    data = _read_json(path, f"--hardware {name!r}")
    known = {f.name for f in fields(HardwareModel)}
    memory = data.pop("memory_gb", None) if isinstance(data, dict) else None
    if isinstance(data, dict):
        data.pop("calibration", None)  # what --calibrate measured, kept for the reader
    unknown = sorted(set(data) - known) if isinstance(data, dict) else ["(not an object)"]
    if unknown:
        raise CliError(f"--hardware {name!r}: unknown field(s) {unknown}; the fields are {sorted(known)}, "
                       "memory_gb and calibration")
    return HardwareModel(**{k: float(v) for k, v in data.items()}), memory


def _fixed(items: list[str]) -> dict[str, int]:
    from vescale.plan.auto_parallelize import MESH_DIMS

    out: dict[str, int] = {}
    for item in items:
        for part in item.split(","):
            name, eq, value = part.partition("=")
            if not eq or name.strip() not in MESH_DIMS or not value.strip().isdigit() or int(value) < 1:
                raise CliError(f"--fixed {part!r}: expected DIM=SIZE with DIM one of {list(MESH_DIMS)} and SIZE a "
                               "positive integer, e.g. --fixed tp=8")
            out[name.strip()] = int(value)
    return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m vescale.plan", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("model", metavar="MODEL", nargs="?", help="config.json, a model directory, or a transformers "
                   "model type")
    p.add_argument("--world-size", type=int, default=None, help="ranks (GPUs) of the job (with --calibrate: the "
                   "local ranks probed, default 2)")
    p.add_argument("--calibrate", metavar="FILE", default=None, help="measure this machine's matmul rate and "
                   "collective latency / bandwidth on --world-size local ranks and write a --hardware FILE (no MODEL)")
    p.add_argument("--memory-gb", type=float, default=None, help="memory per rank (default: the hardware's)")
    p.add_argument("--seq-len", type=int, default=4096, help="tokens per sequence")
    p.add_argument("--batch-size", type=int, default=512, help="global batch in sequences")
    p.add_argument("--microbatch-size", type=int, default=1, help="sequences per pipeline microbatch (0: two "
                   "microbatches per pp rank)")
    p.add_argument("--hardware", default="h100", help="h100, h200, or a JSON file of HardwareModel fields "
                   "(+ memory_gb)")
    p.add_argument("--fixed", action="append", default=[], help="pin mesh dims, e.g. tp=8 or pp=4,tp=8")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="parameter and activation dtype")
    p.add_argument("--sequence-parallel", action="store_true", help="shard the residual stream over tp")
    p.add_argument("--max-tp", type=int, default=8, help="largest tp considered (a node's GPUs)")
    p.add_argument("--alternatives", type=int, default=5, help="how many runner-up meshes to explain")
    p.add_argument("--json", action="store_true", help="print only the spec's JSON (for --spec)")
    p.add_argument("--dry-run", action="store_true", help="build the choice for one rank of the full world here")
    p.add_argument("--rank", type=int, default=0, help="the rank --dry-run builds")
    return p


def _size(n: float) -> str:
    return f"{n / 2**30:.2f} GB" if n >= 2**30 else f"{n / 2**20:.2f} MB"


def _gb(x: float) -> str:
    return f"{x:8.2f} GB"


def _terms(c: CostEstimate, hw: HardwareModel) -> list[tuple[str, float]]:
    """Step-time terms in seconds: compute, bubble, then each dim's bytes over its bandwidth."""
    return [("compute (3 x forward matmul flops)", c.compute_s), ("pipeline bubble", c.bubble_s),
            ("tp collectives", c.tp_bytes / (hw.tp_gbps * 1e9)), ("dp gradient reduction", c.dp_bytes /
                                                                  (hw.dp_gbps * 1e9)),
            ("pp sends", c.pp_bytes / (hw.pp_gbps * 1e9)), ("cp key/value gathers", c.cp_bytes / (hw.cp_gbps * 1e9)),
            ("ep all-to-alls", c.ep_bytes / (hw.ep_gbps * 1e9))]


def _why_lost(c: CostEstimate, best: CostEstimate, hw: HardwareModel, budget: float | None) -> str:
    if not c.fits:
        return f"does not fit: {c.memory_gb:.1f} GB > {budget} GB per rank"
    mine, theirs = dict(_terms(c, hw)), dict(_terms(best, hw))
    worst = max(mine, key=lambda k: mine[k] - theirs[k])
    extra = (c.step_s - best.step_s) / best.step_s * 100 if best.step_s else 0.0
    if c.step_s == best.step_s:
        return f"same step estimate; the tie goes to less ZeRO / fewer mechanisms (zero {c.zero_stage})"
    return (f"{extra:+.1f} % step time; most of it {worst} ({mine[worst] * 1e3:.1f} ms vs "
            f"{theirs[worst] * 1e3:.1f} ms)")


def _mesh(c: CostEstimate) -> str:
    return " x ".join(f"{k}={v}" for k, v in c.dims.items()) or "one rank"


def _alternatives(report, n: int) -> list[CostEstimate]:
    """The best ``n`` candidates after the chosen one, one per mesh (its best ZeRO stage)."""
    seen, out = {tuple(report.chosen.dims.items())}, []
    for c in report.candidates:
        key = tuple(c.dims.items())
        if key not in seen:
            seen.add(key)
            out.append(c)
        if len(out) == n:
            break
    return out


def _print_plan(report, spec, hw, args, budget, seconds: float) -> None:
    c = report.chosen
    print(f"# plan: {args.model}, world {args.world_size}, batch {args.batch_size} x {args.seq_len} tokens, "
          f"{args.dtype}, {budget} GB per rank ({seconds:.1f} s, {len(report.candidates)} candidates)")
    print(f"mesh {_mesh(c)}, ZeRO {c.zero_stage}" + (f", {c.microbatches} microbatches" if c.pp > 1 else ""))
    print("\n## spec (save as a file for tools/train.py --spec)")
    print(spec.to_json())
    print("\n## memory per rank (estimate)")
    for name, v in (("parameters", c.weights_gb), ("gradients", c.grads_gb), ("optimizer state", c.states_gb),
                    ("activations", c.activations_gb), ("communication buffers", c.gathered_gb)):
        print(f"  {name:<24}{_gb(v)}")
    print(f"  {'total':<24}{_gb(c.memory_gb)} of {budget} GB")
    if c.gathered_gb == 0:
        print("  (communication buffers: ZeRO-3's gathered blocks only; DDP buckets are views of the gradients)")
    print("\n## step time (estimate)")
    for name, s in _terms(c, hw):
        if s:
            print(f"  {name:<36}{s * 1e3:10.1f} ms")
    print(f"  {'step (dp reduction overlapped)':<36}{c.step_s * 1e3:10.1f} ms")
    alts = _alternatives(report, args.alternatives)
    if alts:
        print("\n## best alternatives (why each lost)")
        for a in alts:
            print(f"  {_mesh(a):<28} ZeRO {a.zero_stage}  {a.step_s * 1e3:9.1f} ms {a.memory_gb:7.1f} GB: "
                  f"{_why_lost(a, c, hw, budget)}")


def _print_refusal(report, budget, args) -> None:
    print(f"nothing fits: no pp x dp x cp x ep x tp of world {args.world_size} keeps a rank under {budget} GB "
          f"(batch {args.batch_size} x {args.seq_len}, {args.dtype})", file=sys.stderr)
    print("the smallest candidates:", file=sys.stderr)
    for c in sorted(report.candidates, key=lambda c: c.memory_gb)[:5]:
        print(f"  {_mesh(c):<28} ZeRO {c.zero_stage}: {c.memory_gb:.1f} GB = states {c.params_gb:.1f} + "
              f"activations {c.activations_gb:.1f}", file=sys.stderr)
    print("try: a larger --world-size, --sequence-parallel, a smaller --microbatch-size or --seq-len, or "
          "--max-tp 16", file=sys.stderr)


def plan(args) -> tuple[Any, Any, HardwareModel, float | None]:
    """``(report, spec, hardware, budget)`` for parsed ``args``; raises :class:`CliError` on bad input."""
    from vescale.core.errors import PlanError
    from vescale.plan.auto_parallelize import choose_parallelism
    from vescale.plan.dry_run import meta_scalars

    hw, memory = _hardware(args.hardware)
    budget = args.memory_gb if args.memory_gb is not None else memory
    fixed = _fixed(args.fixed)
    if args.world_size < 1 or args.batch_size < 1 or args.seq_len < 1:
        raise CliError("--world-size, --batch-size and --seq-len must be positive")
    model = meta_model(load_config(args.model), dtype=args.dtype)
    nbytes = 2 if args.dtype == "bf16" else 4
    try:
        with meta_scalars():
            report = choose_parallelism(model, args.world_size, memory_budget_gb=budget, batch_size=args.batch_size,
                                        seq_len=args.seq_len, fixed=fixed, max_tp=args.max_tp, param_bytes=nbytes,
                                        act_bytes=nbytes, hw=hw, sequence_parallel=args.sequence_parallel,
                                        microbatch_size=args.microbatch_size or None)
    except PlanError as exc:
        raise CliError(str(exc)) from None
    c = report.chosen
    spec = report.spec(microbatches=c.microbatches if args.microbatch_size else 0,
                       sequence_parallel=args.sequence_parallel)
    spec = replace(spec, dtype=args.dtype)
    return report, spec, hw, budget


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit status (0 planned, 1 bad input, 2 nothing fits or the dry run failed)."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.calibrate:
        from vescale.plan.calibrate import calibrate

        wrote = calibrate(args.calibrate, world_size=args.world_size or 2)
        print(json.dumps({k: v for k, v in wrote.items() if k != "calibration"}))
        return 0
    if args.model is None or args.world_size is None:
        parser.error("MODEL and --world-size are required (unless --calibrate FILE)")
    t0 = time.perf_counter()
    try:
        report, spec, hw, budget = plan(args)
    except CliError as exc:
        print(f"python -m vescale.plan: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if not report.chosen.fits:
        _print_refusal(report, budget, args)
        return EXIT_NOTHING_FITS
    if args.json:
        print(spec.to_json())
    else:
        _print_plan(report, spec, hw, args, budget, time.perf_counter() - t0)
    if not args.dry_run:
        return 0
    return _dry_run(args, spec, report.chosen)


def _dry_run(args, spec, c: CostEstimate) -> int:
    from vescale.plan.dry_run import dry_run

    config = load_config(args.model)
    # eager attention: sdpa's meta kernel path mixes plain and DTensor operands; parameters and collectives are
    # the same either way
    result = dry_run(lambda: meta_model(config, attention="eager", dtype=args.dtype), spec,
                     world_size=args.world_size, rank=args.rank, batch_size=args.batch_size, seq_len=args.seq_len)
    out = sys.stdout if not args.json else sys.stderr
    print(f"\n## dry run: rank {args.rank} of {args.world_size}, coordinate {result.coordinate} "
          f"({', '.join(f'{k} {v:.1f} s' for k, v in result.seconds.items())})", file=out)
    estimate = {"parameters": c.weights_gb, "gradients": c.grads_gb, "optimizer": c.states_gb}
    print(f"  {'bytes per rank':<14}{'exact':>14}{'estimate':>14}", file=out)
    for name, est in estimate.items():
        got = result.bytes.get(name)
        exact = _size(got) if got is not None else "not built"
        print(f"  {name:<14}{exact:>14}{_size(est * 2**30):>14}", file=out)
    for name, detail in result.checks.items():
        print(f"  ok   {name}: {detail}", file=out)
    for name, detail in result.failed.items():
        print(f"  FAIL {name}: {detail}", file=out)
    for name, detail in result.not_checked.items():
        print(f"  not checked, {name}: {detail}", file=out)
    if result.collectives:
        print("  collectives of one step (calls, MB this rank hands in) by mesh dim:", file=out)
        for dim, v in result.collectives.get("per_dim", {}).items():
            parts = ", ".join(f"{k} {n} x, {v['bytes'][k] / 2**20:.1f} MB" for k, n in v["counts"].items())
            print(f"    {dim:<10} {parts}", file=out)
    return 0 if result.ok else EXIT_NOTHING_FITS
