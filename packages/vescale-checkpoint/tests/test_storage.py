"""Round trips of every kind of value through local, ``memory://`` and ``s3://`` (a local moto server) storage.

All comparisons are bitwise (``torch.equal``) against the values saved.
"""

from __future__ import annotations

import json

import pytest
import torch

from vescale import checkpoint
from vescale.core.launch import free_port
from vescale.core.testing import run_on_ranks


class _Counter:
    """A stateful object that is neither a module nor an optimizer."""

    def __init__(self, n=0):
        self.n = n
        self.table = {}

    def state_dict(self):
        return {"n": self.n, "table": self.table, "hist": torch.arange(self.n)}

    def load_state_dict(self, sd):
        self.n, self.table, self.hist = sd["n"], sd["table"], sd["hist"]


def _rich_state(seed: int):
    g = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.LayerNorm(5))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    counter = _Counter(3 + seed)
    counter.table = {1: "one", (2, 3): [float("inf"), None]} if seed == 0 else {}
    tensors = {
        "f64": torch.randn(3, 2, generator=g, dtype=torch.float64),
        "bf16": torch.randn(7, generator=g).bfloat16(),
        "f16": torch.randn(2, 2, 2, generator=g).half(),
        "i64": torch.randint(-(2 ** 40), 2 ** 40, (5,), generator=g),
        "u8": torch.randint(0, 255, (9,), generator=g, dtype=torch.uint8),
        "bool": torch.rand(4, generator=g) > 0.5,
        "scalar": torch.tensor(float(seed) + 0.25),
        "empty": torch.zeros(0, 3),
        "compressible": torch.zeros(4096) + seed,
    }
    compiled = torch.compile(torch.nn.Linear(3, 2))  # saved under the module's own FQNs, not "_orig_mod."
    with torch.no_grad():
        compiled.weight.fill_(seed)
    return {"model": model, "optim": opt, "sched": sched, "counter": counter, "tensors": tensors, "compiled": compiled,
            "rng": torch.random.get_rng_state(), "meta": {"name": f"run{seed}", "lrs": (0.1, 0.01), "ok": True},
            "step": 10 + seed}


def _train(state):
    state["model"](torch.ones(2, 6)).sum().backward()
    state["optim"].step()
    state["sched"].step()


def _assert_same(a, b):
    from vescale.checkpoint._state import flatten

    fa, fb = flatten(a), flatten(b)
    assert fa.tensors.keys() == fb.tensors.keys() and fa.values.keys() == fb.values.keys()
    for k in fa.tensors:
        assert fa.tensors[k].dtype == fb.tensors[k].dtype and torch.equal(fa.tensors[k], fb.tensors[k]), k
    for k in fa.values:
        assert repr(fa.values[k]) == repr(fb.values[k]), k


@pytest.mark.parametrize("where", ["local", "memory"])
def test_round_trip_every_value_kind(tmp_path, where):
    from safetensors.torch import load as st_load

    path = str(tmp_path / "ckpt") if where == "local" else f"memory://{tmp_path.name}/ckpt"
    saved = _rich_state(0)
    _train(saved)
    checkpoint.save(path, saved, compress=True)
    fresh = _rich_state(1)
    meta = fresh["meta"]
    checkpoint.load(path, fresh)
    _assert_same(saved, fresh)
    assert fresh["meta"] is meta and meta["name"] == "run0"  # a dict value is loaded in place
    assert fresh["counter"].table == {1: "one", (2, 3): [float("inf"), None]}
    assert fresh["sched"].last_epoch == 1 and fresh["optim"].param_groups[0]["lr"] == saved["optim"].param_groups[0][
        "lr"]
    info = checkpoint.inspect(path)
    assert "compiled.weight" in info["tensors"] and not any("_orig_mod" in k for k in info["tensors"])
    assert info["tensors"]["tensors.compressible"]["codecs"] == ["zstd"]
    assert info["tensors"]["tensors.bf16"]["codecs"] == ["raw"]
    # the data file is plain safetensors: raw entries read back with the safetensors library
    import fsspec

    fs, root = fsspec.core.url_to_fs(path)
    meta = json.loads(fs.cat_file(f"{root}/metadata.json"))
    (name,) = meta["files"]
    data = st_load(fs.cat_file(f"{root}/{name}"))
    assert torch.equal(data["tensors.f64@0,0"], saved["tensors"]["f64"])
    assert checkpoint.verify(path)["tensors"] == len(meta["tensors"])



@pytest.fixture(scope="module")
def s3_options():
    pytest.importorskip("s3fs")
    ThreadedMotoServer = pytest.importorskip("moto.server").ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    options = {"key": "testing", "secret": "testing", "use_listings_cache": False, "skip_instance_cache": True,
               "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{port}", "region_name": "eu-west-1"}}
    import s3fs

    s3fs.S3FileSystem(**options).mkdir("ckpt-bucket")
    yield options
    server.stop()


def _s3_save_load(options: dict, url: str):
    import torch.distributed as dist
    from torch.distributed.tensor import Shard, distribute_tensor

    from vescale.core.mesh import init_mesh

    mesh = init_mesh({"dp": dist.get_world_size()})
    full = torch.arange(48, dtype=torch.float32).reshape(8, 6)
    state = {"w": distribute_tensor(full, mesh["dp"], [Shard(1)]), "r": full[0].clone(), "step": 4}
    checkpoint.save(url, state, storage_options=options)
    checkpoint.save(url, state, storage_options=options, async_save=True).wait()  # overwrite: old files removed
    target = {"w": distribute_tensor(torch.zeros(8, 6), mesh["dp"], [Shard(0)]), "r": torch.zeros(6), "step": 0}
    checkpoint.load(url, target, storage_options=options)
    assert torch.equal(target["w"].full_tensor(), full) and torch.equal(target["r"], full[0])
    assert target["step"] == 4
    checkpoint.wait_pending()  # the replaced save's files are deleted in the background
    return len(checkpoint.inspect(url, storage_options=options)["tensors"])


def test_s3_multi_rank(s3_options):
    import s3fs

    url = "s3://ckpt-bucket/run/step4"
    assert run_on_ranks(_s3_save_load, 2, s3_options, url) == [2, 2]
    names = sorted(p.rsplit("/", 1)[-1] for p in s3fs.S3FileSystem(**s3_options).ls(url))
    assert names[-1] == "metadata.json" and len(names) == 3, names  # two data files of the latest save only
    fresh = {"w": torch.zeros(8, 6), "r": torch.zeros(6), "step": 0}
    checkpoint.load(url, fresh, storage_options=s3_options)  # single process, no process group
    assert torch.equal(fresh["w"], torch.arange(48, dtype=torch.float32).reshape(8, 6))
    assert checkpoint.verify(url, storage_options=s3_options)["files"] == 2


@pytest.mark.parametrize("workers", [0, 1, 3])
def test_direct_writes_match_the_bytes(tmp_path, monkeypatch, workers):
    """Local data files go through a ring of aligned O_DIRECT buffers (made 8 KiB here, so that pieces cross
    buffer boundaries, start mid-buffer and end mid-page); the file holds the bytes exactly, whatever the pieces'
    sizes (empty included) and however many writer threads. Where the file system refuses O_DIRECT (at open or at
    the first write), the same bytes are written buffered."""
    import errno
    import os
    from concurrent.futures import ThreadPoolExecutor

    from vescale.checkpoint import _storage

    monkeypatch.setattr(_storage, "_DIRECT_BUFFER", 8192)
    g = torch.Generator().manual_seed(0)
    sizes = (3, 0, 8189, 1, 40000, 4096)
    pieces = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).numpy() for n in sizes]
    header = b"h" * 77
    expected = header + b"".join(p.tobytes() for p in pieces)
    storage = _storage.Storage(tmp_path)
    pool = ThreadPoolExecutor(workers) if workers else None
    direct = []
    real = _storage._write_direct
    monkeypatch.setattr(_storage, "_write_direct", lambda *a: direct.append(real(*a)) or direct[-1])
    storage.write_file("a.bin", header, [memoryview(p) for p in pieces], pool)
    assert (tmp_path / "a.bin").read_bytes() == expected
    if hasattr(os, "O_DIRECT"):
        assert direct == [True] or not _direct_supported(tmp_path), "O_DIRECT was not used on this file system"

    def refuse(fd, data, offset):
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(_storage, "_pwrite_direct", refuse)  # O_DIRECT refused at the first write ...
    storage.write_file("b.bin", header, [memoryview(p) for p in pieces], pool)
    assert (tmp_path / "b.bin").read_bytes() == expected  # ... so it was written buffered
    assert direct[-1] is False or not hasattr(os, "O_DIRECT")
    if pool is not None:
        pool.shutdown()


def _direct_supported(path) -> bool:
    import os

    try:
        os.close(os.open(os.path.join(path, "probe"), os.O_CREAT | os.O_WRONLY | os.O_DIRECT, 0o644))
        return True
    except OSError:
        return False


def _load_counting_opens(path, monkeypatch, state: dict, **load_kwargs) -> list[str]:
    """Load the checkpoint at ``path`` (saved from ``state``) into zeros; assert the values are those saved and that
    the load left no descriptor open; return the data files' names, once per open."""
    import os

    from vescale.checkpoint import _storage

    opened: list[str] = []
    real = _storage.Storage._open_read

    def spy(self, name):
        opened.append(name)
        return real(self, name)

    monkeypatch.setattr(_storage.Storage, "_open_read", spy)
    before = set(os.listdir("/proc/self/fd"))
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    checkpoint.load(path, target, **load_kwargs)
    assert all(torch.equal(target[k], state[k]) for k in state)
    assert set(os.listdir("/proc/self/fd")) == before
    return [n for n in opened if n.endswith(".safetensors")]


@pytest.mark.parametrize("atomic", [True, False])
def test_a_local_load_opens_each_file_once_per_thread_and_closes_it(tmp_path, monkeypatch, atomic):
    """Shard after shard of one file is read on one kept descriptor per I/O thread (the kernel's readahead state
    lives in it), and the load closes every descriptor it opened."""
    state = {f"w{i}": torch.full((64, 32), float(i)) for i in range(12)}
    checkpoint.save(tmp_path / "ckpt", state)
    data = _load_counting_opens(tmp_path / "ckpt", monkeypatch, state, threads=2, atomic=atomic)
    assert len(set(data)) == 1 and 1 <= len(data) <= 2, data  # 12 shards, one file, at most one open per thread


@pytest.mark.parametrize("atomic", [True, False])
def test_a_long_read_moves_to_a_fresh_descriptor_and_closes_the_old_one(tmp_path, monkeypatch, atomic):
    """After every ``_RENEW_BYTES`` read through one descriptor the reader moves to a fresh descriptor of the file (the
    kernel's readahead starts over with small page-cache folios); the values are those saved and the load leaves no
    descriptor open."""
    from vescale.checkpoint import _storage

    state = {"big": torch.randn(256, 256), "small": torch.randn(8, 8)}
    checkpoint.save(tmp_path / "ckpt", state)
    renew = 16 << 10
    monkeypatch.setattr(_storage, "_RENEW_BYTES", renew)
    data = _load_counting_opens(tmp_path / "ckpt", monkeypatch, state, threads=1, atomic=atomic)
    assert len(set(data)) == 1 and len(data) >= state["big"].nbytes // renew, len(data)
