"""Save on one layout and world size, load on another: values bitwise equal, training continues on the same curve.

Layouts of a small model (embedding, two MLP linears, head, a 5-element gain that FSDP shards unevenly) and its
AdamW state, on 1, 2, 3, 4 and 8 ranks: ``single`` (one process), ``dp`` (DDP), ``tp`` (torch tensor parallel),
``dp_tp`` (dp 2 x tp world/2, TP replicated over dp), ``fsdp`` (FSDP2), ``fsdp_tp`` (FSDP2 over dp on top of TP:
torch's _StridedShard), ``pp`` (two pipeline stages keeping the model's FQNs, each rank's stage given as a list of
two chunk modules). The reference values are the saving side's full tensors (gathered with ``full_tensor``) written
to a side safetensors file; the loaded values must equal them bitwise. Loads alternate between reading each shard
once and sending it (``dedup_reads=True``, the multi-host path) and the default (every rank reads what it needs from
the local page cache). Losses of two further training steps after the load must match the saving side's own next two
losses within 1e-5 (relative): different layouts reduce in a different order, so this comparison uses a tolerance.
Every layout but ``tp`` saves asynchronously, its next two training steps overlapping the save: the checkpoint must
still hold the values at save time.
"""

from __future__ import annotations

import json
import os

import pytest

from vescale.core.testing import run_on_ranks

HIDDEN = 28


def _net(seed: int):
    import torch
    from torch import nn

    torch.manual_seed(seed)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(32, 16)
            self.fc1 = nn.Linear(16, HIDDEN)
            self.fc2 = nn.Linear(HIDDEN, 16)
            self.head = nn.Linear(16, 32, bias=False)
            self.register_buffer("scale", torch.full((16,), 0.5 + seed))
            self.gain = nn.Parameter(torch.linspace(1, 2, 5) + seed)  # sharded unevenly by FSDP over 2 or 4 ranks

        def forward(self, tokens):
            h = self.emb(tokens) * self.scale
            h = h + self.fc2(torch.relu(self.fc1(h)))
            return self.head(h) * self.gain.mean()

    return Net()


def _build(layout: str, seed: int):
    """(module to put in the state, module to run or None, optimizer) for ``layout`` on the current ranks."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from vescale.core.mesh import init_mesh

    net = _net(seed)
    world = dist.get_world_size() if dist.is_initialized() else 1
    tp_plan = {"emb": RowwiseParallel(input_layouts=Replicate()), "fc1": ColwiseParallel(),
               "fc2": RowwiseParallel(), "head": ColwiseParallel(output_layouts=Replicate())}
    run = net
    if layout == "dp":
        from torch.nn.parallel import DistributedDataParallel

        run = net = DistributedDataParallel(net)
    elif layout == "tp":
        parallelize_module(net, init_mesh({"tp": world})["tp"], tp_plan)
    elif layout == "dp_tp":
        parallelize_module(net, init_mesh({"dp": 2, "tp": world // 2})["tp"], tp_plan)
    elif layout == "fsdp":
        from torch.distributed.fsdp import fully_shard

        fully_shard(net, mesh=init_mesh({"dp": world})["dp"])
    elif layout == "fsdp_tp":
        from torch.distributed.fsdp import fully_shard

        mesh = init_mesh({"dp": 2, "tp": world // 2})
        parallelize_module(net, mesh["tp"], tp_plan)
        fully_shard(net, mesh=mesh["dp"])
    elif layout == "pp":  # two stages, each rank holding its stage as two chunks (a list of modules)
        import copy

        stage = dist.get_rank() * 2 // world
        for name in (["fc2", "head"] if stage == 0 else ["emb", "fc1"]):
            delattr(net, name)
        first = copy.deepcopy(net)
        kept = "emb" if stage == 0 else "fc2"
        for name in [n for n, _ in first.named_children() if n != kept] + ["gain", "scale"]:
            delattr(first, name)
        delattr(net, kept)
        opt = torch.optim.AdamW([*first.parameters(), *net.parameters()], lr=1e-2, weight_decay=0.1)
        return [first, net], None, opt
    else:
        assert layout == "single"
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1)
    return net, run, opt


def _step(run, opt, i: int) -> float:
    import torch

    g = torch.Generator().manual_seed(100 + i)
    tokens = torch.randint(0, 32, (4, 8), generator=g)
    logits = run(tokens)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.roll(1, 1).flatten())
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def _full_values(state) -> dict:
    """Every tensor of the flattened state as a full plain tensor (collective for DTensors)."""
    from vescale.checkpoint._layout import is_dtensor
    from vescale.checkpoint._state import flatten

    flat = flatten(state)
    return {k: (t.full_tensor() if is_dtensor(t) else t).detach().clone() for k, t in flat.tensors.items()}


def _save_all(layouts: list[str], root: str) -> None:
    import torch.distributed as dist
    from safetensors.torch import save_file

    from vescale import checkpoint

    rank = dist.get_rank()
    for layout in layouts:
        net, run, opt = _build(layout, seed=0)
        if run is not None:
            for i in range(2):
                _step(run, opt, i)
        else:  # a pipeline stage: give its optimizer state by a step on a local loss
            sum(p.square().sum() for m in net for p in m.parameters()).backward()
            opt.step()
            opt.zero_grad()
        path = os.path.join(root, f"{layout}-{dist.get_world_size()}")
        state = {"model": net, "optim": opt, "step": 2}
        # async except for tp: the next steps overlap the background copy (their optimizer steps wait for it)
        handle = checkpoint.save(path, state, async_save=layout != "tp")
        ref = _full_values(state)
        save_file(ref, os.path.join(path + ".ref", f"r{rank}.safetensors")) if os.makedirs(
            path + ".ref", exist_ok=True) is None else None
        if run is not None:
            losses = [_step(run, opt, i) for i in (2, 3)]
            if rank == 0:
                with open(path + ".ref/losses.json", "w") as f:
                    json.dump(losses, f)
        handle.wait()
        dist.barrier()


def _load_all(jobs: list[tuple[str, str]], root: str) -> list[str]:
    import glob

    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file

    from vescale import checkpoint

    done = []
    for i, (saved, layout) in enumerate(jobs):
        path = os.path.join(root, saved)
        ref = {}
        for f in sorted(glob.glob(path + ".ref/r*.safetensors")):
            ref.update(load_file(f))
        net, run, opt = _build(layout, seed=1)
        state = {"model": net, "optim": opt, "step": 0}
        before = _full_values({"model": net})
        assert any(not torch.equal(v, ref[k]) for k, v in before.items()), "fresh model already equals the save"
        checkpoint.load(path, state, dedup_reads=True if i % 2 == 0 else None)  # read-once-and-send, or auto
        assert state["step"] == 2
        got = _full_values(state)
        assert got, layout
        for key, value in got.items():
            assert torch.equal(value, ref[key]), f"{saved} -> {layout}: {key} differs after load (bitwise)"
        if run is not None and os.path.exists(path + ".ref/losses.json"):
            with open(path + ".ref/losses.json") as f:
                expected = json.load(f)
            losses = [_step(run, opt, i) for i in (2, 3)]
            assert losses == pytest.approx(expected, rel=1e-5), f"{saved} -> {layout}: loss curve differs"
        done.append(f"{saved}->{layout}@{dist.get_world_size() if dist.is_initialized() else 1}")
        dist.barrier()
    return done


SAVES = {1: ["single"], 2: ["tp", "pp", "fsdp", "dp"], 4: ["dp_tp", "fsdp_tp", "tp"], 8: ["fsdp_tp"], 3: ["fsdp"]}
LOADS = {
    1: [("tp-2", "single"), ("pp-2", "single"), ("fsdp_tp-4", "single"), ("dp_tp-4", "single"),
        ("fsdp_tp-8", "single"), ("fsdp-3", "single")],
    2: [("dp_tp-4", "tp"), ("fsdp_tp-4", "pp"), ("single-1", "fsdp"), ("tp-4", "dp")],
    3: [("fsdp_tp-8", "fsdp"), ("dp_tp-4", "fsdp")],  # uneven FSDP shards over 3 ranks
    4: [("single-1", "dp_tp"), ("tp-2", "fsdp_tp"), ("pp-2", "dp_tp"), ("fsdp-2", "tp"), ("dp-2", "fsdp_tp"),
        ("fsdp-3", "fsdp_tp")],
    8: [("dp_tp-4", "fsdp"), ("fsdp-3", "dp_tp")],  # 5 gains over 8 FSDP ranks: some hold none
}


def test_reshard_matrix(tmp_path):
    root = str(tmp_path)
    for world, layouts in SAVES.items():
        run_on_ranks(_save_all, world, layouts, root)
    for world, jobs in LOADS.items():
        done = run_on_ranks(_load_all, world, jobs, root)[0]
        assert len(done) == len(jobs)
