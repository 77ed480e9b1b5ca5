"""``tools/train.py``'s collectives run on the rank's device: one code path for gloo (CPU) and NCCL (CUDA).

NCCL takes CUDA tensors only, so a tensor a collective touches must be on ``rank_device()``. The end-of-run summary
gather (``gather_per_rank``) used to build its tensor on the CPU, so every NCCL run crashed at its end. The same
functions are checked here on CPU/gloo ranks of the pooled harness and, with ``@pytest.mark.gpu``, on CUDA/NCCL ranks
(one per visible GPU, up to 2). Values are compared exactly (small integers and halves are exact in float64).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from vescale.core.mesh import parse_mesh_spec
from vescale.core.testing import multi_rank

ROOT = Path(__file__).resolve().parents[1]

sys.path.insert(0, str(ROOT / "tools"))  # tools/train.py imports by name, as do config, models, data, report
import report  # noqa: E402
import train  # noqa: E402


def _gather_on_rank_device() -> tuple[str, list[list[float]], str]:
    """On each rank: (rank_device(), the gathered per-rank rows, the returned tensor's device)."""
    import torch.distributed as dist

    rank = dist.get_rank()
    device = train.rank_device()
    got = report.gather_per_rank([rank + 0.5, 2.0 * rank, 7.0], device)
    return str(device), got.tolist(), str(got.device)


def _expected(world: int) -> list[list[float]]:
    return [[r + 0.5, 2.0 * r, 7.0] for r in range(world)]


@multi_rank(world_sizes=[1, 2])
def test_summary_gather_on_gloo_ranks(world_size):
    device, rows, out_device = _gather_on_rank_device()
    assert device == "cpu"
    assert rows == _expected(world_size)
    assert out_device == "cpu"


def test_summary_of_a_short_dp2_run_has_every_rank(tmp_path, ranks):
    """The real end of ``train``: the summary's per-rank lists come from the gather, one entry per rank."""
    cfg = train.TrainConfig(mesh="dp=2", model="gpt-tiny", steps=2, batch_size=4, seq_len=8, warmup=1,
                            out=str(tmp_path), trace_steps=0, quiet=True, data="markov")
    cfg.dims = parse_mesh_spec(cfg.mesh)
    summary, other = ranks(train.train, 2, cfg)
    assert other == {}
    assert len(summary["peak_memory_mb_per_rank"]) == 2 and min(summary["peak_memory_mb_per_rank"]) > 0
    assert len(summary["init_s_per_rank"]) == 2 and min(summary["init_s_per_rank"]) > 0
    # dp replicas hold the whole tiny model: the same bytes on both ranks
    assert summary["init_mb_per_rank"][0] == summary["init_mb_per_rank"][1] > 0


@pytest.mark.gpu
def test_summary_gather_on_nccl_ranks():
    """CUDA path: NCCL ranks (one per GPU, at most 2) gather through the same function, tensors on ``cuda:<rank>``."""
    import torch

    from vescale.core.launch import spawn

    world = min(2, torch.cuda.device_count())
    device, rows, out_device = spawn(_gather_on_rank_device, world, backend="nccl", timeout=120)
    assert device == "cuda:0"  # rank 0's
    assert rows == _expected(world)
    assert out_device == "cpu"


@pytest.mark.gpu
def test_short_nccl_run_reaches_its_summary(tmp_path):
    """The whole job on NCCL ranks (``main`` spawns nccl when there is a GPU per rank) ends with its summary."""
    import torch

    world = min(2, torch.cuda.device_count())
    summary = train.main(["--mesh", f"dp={world}", "--model", "gpt-tiny", "--data", "markov", "--steps", "3",
                          "--batch-size", "4", "--seq-len", "8", "--trace-steps", "0", "--quiet", "--out",
                          str(tmp_path)])
    assert len(summary["peak_memory_mb_per_rank"]) == world
    assert summary["final_loss"] is not None and summary["final_loss"] == summary["final_loss"]  # not NaN
