"""What ``tools/train.py`` reports: metrics a line a step, a progress bar, the loss curve, an nD timeline of a few
steps, and ``summary.json`` with its per-rank figures (:func:`run_summary`: gathered from every rank on its own
device)."""

from __future__ import annotations

import json
import resource
import sys
import time
import weakref
from pathlib import Path

import torch
import torch.distributed as dist

__all__ = ["RunLog", "TensorBoardLog", "TimelineWindow", "dump_grads", "gather_per_rank", "state_bytes",
           "peak_memory_mb", "planner_memory_mb", "run_summary", "rank_table"]


def gather_per_rank(values: list[float], device: torch.device, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Every rank's ``values`` (same length on every rank) as a ``[world, len(values)]`` float64 CPU tensor.

    Collective over ``group`` (default: all ranks): one ``all_gather`` of tensors on ``device``, which must be the
    rank's device (``train.rank_device``), since NCCL refuses CPU tensors. Returned on every rank.

    It is the last collective of a run, so it returns only once the backend's threads have let go of its tensors:
    a gloo worker thread may drop its reference to a finished collective after ``all_gather`` has returned, and if
    that happens while the interpreter is shutting down (a torchrun rank ends right after this), freeing the
    tensors' Python objects from that thread aborts the process ("terminate called without an active exception").
    """
    rows, held = _all_gather_rows(values, device, group)
    _wait_released(held)
    return rows


def _all_gather_rows(values: list[float], device: torch.device, group) -> tuple[torch.Tensor, list[weakref.ref]]:
    """The gathered rows on the CPU, and weak references to the tensors the collective used (no strong one left)."""
    mine = torch.tensor([values], dtype=torch.float64, device=device)
    per_rank = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(per_rank, mine, group=group)
    return torch.cat(per_rank).cpu(), [weakref.ref(t) for t in (mine, *per_rank)]


def _wait_released(refs: list[weakref.ref], timeout: float = 5.0) -> bool:
    """Wait (sleeping, so that a backend thread can take the GIL) until every tensor of ``refs`` is freed, i.e. no
    backend thread holds it any more; ``False`` if some still lived after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while any(r() is not None for r in refs):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


def dump_grads(grads: dict[str, torch.Tensor], path: str | Path, keep: bool) -> None:
    """Write the whole gradients of every rank's ``grads`` (``{fqn: tensor or DTensor}``) to one safetensors file.

    Collective over all ranks, each passing its own ``grads``: every DTensor is gathered whole over its mesh
    (``full_tensor``, in FQN order, so the ranks of one tp group issue the same collectives), then ranks with
    ``keep`` send theirs to rank 0 (one ``gather_object``; ranks without ``keep``, e.g. dp and tp replicas, send
    nothing), which writes ``path`` with every FQN once, as fp32 on the CPU.
    """
    from torch.distributed.tensor import DTensor

    whole = {}
    for name in sorted(grads):
        g = grads[name]
        g = g.full_tensor() if isinstance(g, DTensor) else g
        whole[name] = g.detach().to("cpu", torch.float32).contiguous()
    gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(whole if keep else {}, gathered, dst=0)  # (NCCL: via the current CUDA device)
    if dist.get_rank() != 0:
        return
    from safetensors.torch import save_file

    merged: dict[str, torch.Tensor] = {}
    for part in gathered:
        for name, g in part.items():
            merged.setdefault(name, g.clone())  # clones: tied FQNs must not share storage in safetensors
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    save_file(merged, str(path))


def state_bytes(modules: list[torch.nn.Module]) -> int:
    """Bytes of the distinct parameters and buffers of ``modules`` as this rank holds them (DTensors: local shards)."""
    from torch.distributed.tensor import DTensor

    seen: dict[int, torch.Tensor] = {}
    for module in modules:
        for t in [*module.parameters(), *module.buffers()]:
            seen[id(t)] = t.to_local() if isinstance(t, DTensor) else t
    return sum(t.numel() * t.element_size() for t in seen.values())


def peak_memory_mb() -> float:
    """This process's peak memory: CUDA allocations when it uses CUDA, else its peak resident set."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def planner_memory_mb(spec, make_model, batch_size: int, seq_len: int) -> dict:
    """The planner's per-rank memory estimate of ``spec`` for this run, in MB by term (``parameters``, ``gradients``,
    ``optimizer``, ``activations``, ``communication_buffers``, ``total``): ``vescale.plan.estimate_spec`` on the model
    ``make_model()`` builds on the meta device (the given spec priced, no search). ``{"error": why}`` when the model
    cannot be priced (a report, not a reason to fail the run). No collective."""
    try:
        from vescale.plan import estimate_spec

        with torch.device("meta"):
            model = make_model()
        c = estimate_spec(model, spec, batch_size=batch_size, seq_len=seq_len)
    except Exception as exc:  # noqa: BLE001 - reported in summary.json instead
        return {"error": f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"}
    terms = {"parameters": c.weights_gb, "gradients": c.grads_gb, "optimizer": c.states_gb,
             "activations": c.activations_gb, "communication_buffers": c.gathered_gb, "total": c.memory_gb}
    return {k: round(v * 1024, 2) for k, v in terms.items()}


class TimelineWindow:
    """Records the nD timeline (``vescale.pipe.Timeline``) of ``count`` steps into ``path``: from five steps after
    ``start`` (earlier when the run is shorter); nothing when ``count`` is 0. Every rank takes part."""

    def __init__(self, mesh, start: int, steps: int, count: int, path: Path) -> None:
        self.mesh, self.count, self.path = mesh, count, path
        self.first = min(start + 5, steps - count) if count else -1
        self.timeline = None

    def before(self, step: int) -> None:
        if step == self.first:
            from vescale.pipe.timeline import Timeline

            self.timeline = Timeline(self.mesh).__enter__()

    def after(self, step: int) -> None:
        if self.timeline is not None and step == self.first + self.count - 1:
            self.timeline.__exit__(None, None, None)
            self.timeline.export(self.path)
            self.timeline = None


class RunLog:
    """Rank 0's record of the run in ``out``: ``metrics.jsonl`` (a line a step; appended to on resume), a one-line
    progress bar (a line per 1/20 of the run when stdout is not a terminal), then ``loss.png`` and ``summary.json``.
    On other ranks (``active=False``) it only keeps the records."""

    def __init__(self, out: Path, total: int, start: int, *, active: bool, append: bool, quiet: bool,
                 tensorboard: bool = False) -> None:
        self.out, self.total, self.start, self.quiet = out, total, start, quiet or not active
        self.records: list[dict] = []
        self.file = self.tensorboard = None
        if active:
            out.mkdir(parents=True, exist_ok=True)
            self.file = open(out / "metrics.jsonl", "a" if append else "w")  # noqa: SIM115 - closed by finish()
            self.tensorboard = TensorBoardLog(out / "tensorboard") if tensorboard else None
        self.t0 = time.perf_counter()
        self.tty = sys.stdout.isatty()
        self.every = max(1, total // 20)

    def step(self, step: int, record: dict) -> None:
        """Record step ``step`` (0-based): ``record`` has at least ``loss`` and ``tokens_per_s``."""
        self.records.append(record)
        if self.file is not None:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        if self.tensorboard is not None:
            self.tensorboard.step(record)
        if self.quiet:
            return
        left = self.total - step - 1
        eta = (time.perf_counter() - self.t0) / max(step + 1 - self.start, 1) * left
        bar = "#" * int(24 * (step + 1) / self.total)
        line = (f"step {step + 1:>5}/{self.total} [{bar:<24}] loss {record['loss']:7.4f} | "
                f"{record['tokens_per_s']:8.0f} tok/s | ETA {int(eta) // 60}m{int(eta) % 60:02d}s"
                + (f" | {record['skipped']} skipped" if record.get("skipped") else ""))
        if self.tty:
            print("\r" + line, end="\n" if left == 0 else "", flush=True)
        elif (step + 1) % self.every == 0 or left == 0 or step == self.start:
            print(line, flush=True)

    def finish(self, summary: dict, floor: float | None) -> dict:
        """Close ``metrics.jsonl``, plot the loss (and held-out loss) against ``floor`` (the corpus entropy; ``None``
        for real text, which has no known floor), write ``summary.json``."""
        self.file.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.records:
            plot_loss(self.records, self.out / "loss.png", floor)
        (self.out / "summary.json").write_text(json.dumps(summary, indent=2))
        return summary


class TensorBoardLog:
    """TensorBoard event files in ``path`` (``torch.utils.tensorboard``; the ``tensorboard`` package): each metrics
    record's figures as scalars at its ``step`` under the tags of :attr:`TAGS`."""

    #: metrics.jsonl key -> TensorBoard tag
    TAGS = {"loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm", "skipped": "train/skipped_steps",
            "tokens_per_s": "perf/tokens_per_s", "step_s": "perf/step_s", "memory_mb": "perf/peak_memory_mb",
            "eval_loss": "eval/loss", "eval_ppl": "eval/perplexity"}

    def __init__(self, path: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise RuntimeError("--tensorboard needs the tensorboard package (pip install tensorboard)") from exc
        self.writer = SummaryWriter(log_dir=str(path))

    def step(self, record: dict) -> None:
        for key, tag in self.TAGS.items():
            if isinstance(record.get(key), (int, float)):
                self.writer.add_scalar(tag, record[key], global_step=record["step"])

    def close(self) -> None:
        self.writer.close()


def plot_loss(metrics: list[dict], path: Path, floor: float | None) -> bool:
    """The training loss per step, the held-out loss where records have ``eval_loss``, and the corpus entropy
    (unless ``floor`` is ``None``), as a PNG; ``False`` when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("train.py: matplotlib is not installed; skipping loss.png", file=sys.stderr)
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([m["step"] for m in metrics], [m["loss"] for m in metrics], label="training loss")
    evals = [m for m in metrics if "eval_loss" in m]
    if evals:
        ax.plot([m["step"] for m in evals], [m["eval_loss"] for m in evals], "o-", label="held-out loss")
    if floor is not None:
        ax.axhline(floor, color="gray", linestyle="--", label=f"corpus entropy {floor:.2f}")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def run_summary(cfg, trainer, corpus, run_log: RunLog, res, *, wall: float, comms: dict | None, startup: dict,
                device: torch.device, log=print) -> dict:
    """The end of a run of ``tools/train.py``: every rank's figures (peak memory, init time and bytes, step times and
    collective waits, the exact state bytes) gathered, and on rank 0 ``summary.json`` written (``run_log.finish``)
    and returned; ``{}`` on the other ranks. Collective (two all-gathers over all ranks). ``trainer``: train.py's
    ``Trainer``; ``res``: its ``Resilience``; ``wall``: the loop's seconds; ``comms``: one step's collectives."""
    import models
    import rank_times

    from vescale.plan.dry_run import rank_bytes

    par, optimizer = trainer.par, trainer.optimizer
    per_rank = gather_per_rank([peak_memory_mb(), trainer.init_s, trainer.init_bytes,
                                *rank_times.rank_row(res.step_s, res.wait_s)], device)
    held = gather_per_rank([float(sum(rank_bytes(par, optimizer).values()))], device)  # exact, beside the estimate
    if dist.get_rank() != 0:
        return {}
    ranks, slow = rank_table(per_rank[:, 3:], cfg.slow_rank, Path(cfg.out), log)
    losses = [r["loss"] for r in run_log.records]
    tokens_per_s = cfg.batch_size * cfg.seq_len * max(1, len(run_log.records)) / wall  # (fewer when preempted)
    tflops = trainer.flops_per_token * tokens_per_s / 1e12
    return run_log.finish({
        "mesh": cfg.dims, "model": cfg.model, "parameters": trainer.num_params, "steps": cfg.steps,
        "first_loss": losses[0] if losses else None, "final_loss": losses[-1] if losses else None,
        "data": cfg.data, "data_fingerprint": corpus.fingerprint,
        "final_eval_loss": next((r["eval_loss"] for r in reversed(run_log.records) if "eval_loss" in r), None),
        "corpus_entropy": corpus.entropy(), "tokens_per_s": tokens_per_s, "wall_s": wall,
        "peak_memory_mb_per_rank": [round(float(p), 1) for p in per_rank[:, 0]], "init": cfg.init,
        "init_s_per_rank": [round(float(t), 3) for t in per_rank[:, 1]],
        "init_mb_per_rank": [round(float(b) / 2**20, 2) for b in per_rank[:, 2]],
        "state_mb_per_rank": [round(float(b) / 2**20, 2) for b in held[:, 0]],  # parameters + gradients + optimizer
        "planner_memory_mb": planner_memory_mb(par.spec, lambda: models.create(cfg.model),
                                               cfg.batch_size // cfg.grad_accum, cfg.seq_len),
        "collectives_one_step": comms,
        "grad_accum": cfg.grad_accum, "spec": json.loads(par.spec.to_json()) if isinstance(par.spec.tp_plan, str)
        else None, "model_flops_per_token": trainer.flops_per_token, "model_tflops": tflops,
        "mfu": tflops / (dist.get_world_size() * cfg.peak_tflops) if cfg.peak_tflops else None,
        "export_hf": cfg.export_hf, "skipped_steps": res.guard.skipped, "preempted": res.preempt.stopping,
        "save_errors": res.save_errors, "ranks": ranks, "slow_ranks": slow, "startup": startup,
        "resumed_from": cfg.resume,
    }, corpus.entropy())


def rank_table(rows: torch.Tensor, slow_rank: float, out: Path, log=print) -> tuple[list[dict], list[int]]:
    """Rank 0: every rank's step times and collective waits (``rank_times``) as summary.json and timeline.json
    (``otherData.ranks``) report them, and the ranks ``--slow-rank`` (``slow_rank``) names (warned about here)."""
    import rank_times

    table = rank_times.per_rank_table(rows)
    slow = rank_times.slow_ranks(table, slow_rank)
    if slow:
        busy = {r["rank"]: round(r["busy_s"]["p50"] * 1e3, 1) for r in table}
        log(f"WARNING: slow rank(s) {slow}: median busy step time (less collective waits) at least "
            f"{slow_rank}x the median rank's; busy ms per rank {busy}")
    trace = out / "timeline.json"
    if trace.is_file():
        data = json.loads(trace.read_text())
        data.setdefault("otherData", {})["ranks"] = table
        trace.write_text(json.dumps(data))
    return table, slow
