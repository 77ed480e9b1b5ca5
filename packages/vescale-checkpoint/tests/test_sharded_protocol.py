"""vescale.checkpoint sees sharded state only through ``vescale.core.sharded_state``.

- A user's own sharded object (row blocks of a matrix in its own flat buffer) saved on 2 ranks round-trips: into a
  plain tensor on one process, and into the same object with another, overlapping split on 2 ranks, bitwise against
  the global matrix it was built from; its hyper-parameter comes back through ``load_sharded_state_dict``.
- A ``ShardedTensor`` standing in the state by itself, and a malformed one (a named ``UnsupportedStateError``).
- A module's plain parameter marked as a box of a global tensor (``mark_piece(global_shape=, offsets=)``), with its
  Adam state, saved on 2 ranks as rows of the global tensor: loaded on one process into the whole tensor and a fresh
  Adam, and on 2 ranks split otherwise, bitwise one process's Adam step on the whole; a piece marked over a mesh dim
  without a box, and optimizer state of another shape, are refused naming the key.
- The package's source names nothing of vescale.parallel's or vescale.dtensor's internals: no import of them, no
  class-name checks, none of their class or attribute names (checked on the syntax tree, docstrings aside).
"""

from __future__ import annotations

import ast
import pathlib

import pytest
import torch

from vescale import checkpoint
from vescale.checkpoint.errors import UnsupportedStateError
from vescale.core.sharded_state import Box, ShardedTensor, mark_piece
from vescale.core.testing import run_on_ranks

ROWS, COLS = 6, 4
GLOBAL = torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS)


class RowBlocks:
    """A user's sharded object: the row ranges ``blocks`` of a ``ROWS x COLS`` matrix, packed in one flat buffer,
    and a hyper-parameter ``scale``. Implements the protocol; vescale knows nothing else of it."""

    def __init__(self, blocks: list[tuple[int, int]], scale: float = 0.0) -> None:
        self.blocks = blocks
        self.buffer = torch.zeros(sum(e - s for s, e in blocks) * COLS)
        self.scale = scale
        self.loads = 0

    def fill_from(self, full: torch.Tensor) -> None:
        for box in self._boxes():
            box.data.copy_(full[box.offsets[0]:box.offsets[0] + box.lengths[0]])

    def _boxes(self) -> list[Box]:
        boxes, at = [], 0
        for s, e in self.blocks:
            n = (e - s) * COLS
            boxes.append(Box((s, 0), (e - s, COLS), self.buffer[at:at + n].view(e - s, COLS)))
            at += n
        return boxes

    def sharded_state_dict(self) -> dict:
        return {"weight": ShardedTensor((ROWS, COLS), torch.float32, self._boxes(), name="weight"),
                "scale": self.scale}

    def load_sharded_state_dict(self, state: dict) -> None:
        self.scale = state["scale"]
        self.loads += 1


SAVE_SPLIT = [[(0, 2), (5, 6)], [(2, 5)]]  # rank 0 holds two blocks, rank 1 one; together all rows once
LOAD_SPLIT = [[(0, 1), (3, 6)], [(1, 4)]]  # another split, rank 0 and 1 both need row 3


def _save(path: str) -> None:
    import torch.distributed as dist

    obj = RowBlocks(SAVE_SPLIT[dist.get_rank()], scale=3.5)
    obj.fill_from(GLOBAL)
    checkpoint.save(path, {"obj": obj, "step": 7})


def _load(path: str) -> tuple[list[tuple[tuple[int, int], torch.Tensor]], float, int]:
    import torch.distributed as dist

    obj = RowBlocks(LOAD_SPLIT[dist.get_rank()])
    state = {"obj": obj, "step": 0}
    checkpoint.load(path, state)
    assert state["step"] == 7
    return [((s, e), obj.buffer.clone()) for s, e in obj.blocks], obj.scale, obj.loads


def test_users_sharded_object_round_trips(tmp_path):
    path = str(tmp_path / "ckpt")
    run_on_ranks(_save, 2, path)
    info = checkpoint.inspect(path)["tensors"]["obj.weight"]
    assert info["shape"] == [ROWS, COLS]
    plain = {"obj": {"weight": torch.zeros(ROWS, COLS), "scale": 0.0}, "step": 0}
    checkpoint.load(path, plain)
    assert torch.equal(plain["obj"]["weight"], GLOBAL) and plain["obj"]["scale"] == 3.5
    for rank, (blocks, scale, loads) in enumerate(run_on_ranks(_load, 2, path)):
        expect = torch.cat([GLOBAL[s:e].reshape(-1) for s, e in LOAD_SPLIT[rank]])
        got = blocks[0][1]
        assert torch.equal(got, expect), f"rank {rank}"
        assert scale == 3.5 and loads == 1


def test_sharded_tensor_in_the_state_and_a_malformed_one(tmp_path):
    path = str(tmp_path / "ckpt")
    t = torch.arange(5, dtype=torch.float64)
    checkpoint.save(path, {"st": ShardedTensor((5,), torch.float64, [Box((0,), (5,), t)])})
    target = torch.zeros(5, dtype=torch.float64)
    checkpoint.load(path, {"st": ShardedTensor((5,), torch.float64, [Box((0,), (5,), target)])})
    assert torch.equal(target, t)

    class Bad:
        def sharded_state_dict(self):
            return {"w": ShardedTensor((2, 2), torch.float32, [Box((1, 0), (2, 2), torch.zeros(2, 2))], name="w")}

        def load_sharded_state_dict(self, state):
            pass

    with pytest.raises(UnsupportedStateError, match=r"'bad': sharded tensor 'w' of shape \(2, 2\).*reaches outside"):
        checkpoint.save(str(tmp_path / "bad"), {"bad": Bad()})


GRAD = torch.linspace(-1.0, 1.0, ROWS * COLS).reshape(ROWS, COLS)
SAVE_ROWS, LOAD_ROWS = [(0, 2), (2, 6)], [(0, 5), (5, 6)]  # rows of the global weight per rank, saved and loaded


class RowsOfWeight(torch.nn.Module):
    """Rows ``[lo, hi)`` of a ``ROWS x COLS`` weight (marked as that box of the global weight) and a whole bias."""

    def __init__(self, lo: int, hi: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(hi - lo, COLS))
        self.bias = torch.nn.Parameter(torch.zeros(COLS))
        if (lo, hi) != (0, ROWS):
            mark_piece(self.weight, global_shape=(ROWS, COLS), offsets=(lo, 0))
        self.rows = (lo, hi)


def _stepped(lo: int, hi: int) -> tuple[RowsOfWeight, torch.optim.Adam]:
    """The module on rows ``[lo, hi)`` after one Adam step on those rows of GLOBAL and GRAD (elementwise: a box of
    one process's step on the whole)."""
    m = RowsOfWeight(lo, hi)
    with torch.no_grad():
        m.weight.copy_(GLOBAL[lo:hi])
        m.bias.copy_(GLOBAL[0])
    opt = torch.optim.Adam(m.parameters(), lr=0.1)
    m.weight.grad, m.bias.grad = GRAD[lo:hi].clone(), GRAD[1].clone()
    opt.step()
    return m, opt


def _save_rows(path: str) -> None:
    import torch.distributed as dist

    m, opt = _stepped(*SAVE_ROWS[dist.get_rank()])
    checkpoint.save(path, {"model": m, "optim": opt})


def _load_rows(path: str) -> dict[str, torch.Tensor]:
    import torch.distributed as dist

    m = RowsOfWeight(*LOAD_ROWS[dist.get_rank()])
    opt = torch.optim.Adam(m.parameters(), lr=0.5)
    checkpoint.load(path, {"model": m, "optim": opt})
    st = opt.state[m.weight]
    return {"weight": m.weight.detach().clone(), "bias": m.bias.detach().clone(), "exp_avg": st["exp_avg"].clone(),
            "exp_avg_sq": st["exp_avg_sq"].clone(), "step": st["step"].clone(), "lr": opt.param_groups[0]["lr"]}


def test_plain_piece_saves_as_its_global_box_and_loads_on_another_split(tmp_path):
    path = str(tmp_path / "ckpt")
    run_on_ranks(_save_rows, 2, path)
    tensors = checkpoint.inspect(path)["tensors"]
    for key in ("model.weight", "optim.state.weight.exp_avg", "optim.state.weight.exp_avg_sq"):
        assert tensors[key]["shape"] == [ROWS, COLS], (key, tensors[key])
    assert tensors["optim.state.weight.step"]["shape"] == [] and tensors["model.bias"]["shape"] == [COLS]
    ref, ref_opt = _stepped(0, ROWS)  # one process, the whole weight
    want = {"weight": ref.weight.detach(), "bias": ref.bias.detach(), **ref_opt.state[ref.weight]}
    m = RowsOfWeight(0, ROWS)
    opt = torch.optim.Adam(m.parameters(), lr=0.5)
    checkpoint.load(path, {"model": m, "optim": opt})  # one process: whole tensors, a fresh Adam
    assert torch.equal(m.weight.detach(), want["weight"]) and torch.equal(m.bias.detach(), want["bias"])
    for name in ("exp_avg", "exp_avg_sq", "step"):
        assert torch.equal(opt.state[m.weight][name], want[name]), name
    assert opt.param_groups[0]["lr"] == 0.1
    for rank, got in enumerate(run_on_ranks(_load_rows, 2, path)):
        lo, hi = LOAD_ROWS[rank]
        for name in ("weight", "exp_avg", "exp_avg_sq"):
            assert torch.equal(got[name], want[name][lo:hi]), (rank, name)
        assert torch.equal(got["bias"], want["bias"]) and torch.equal(got["step"], want["step"]) and got["lr"] == 0.1


def test_pieces_a_checkpoint_cannot_place_are_refused(tmp_path):
    m = RowsOfWeight(0, ROWS)
    mark_piece(m.weight, groups={"ep": object()})  # split over ep, but where this piece sits is not said
    with pytest.raises(UnsupportedStateError, match=r"'model\.weight' is marked .* split over \['ep'\] but not where"):
        checkpoint.save(str(tmp_path / "a"), {"model": m})
    m = RowsOfWeight(2, 4)
    opt = torch.optim.Adam(m.parameters())
    opt.state[m.weight]["odd"] = torch.zeros(3)
    with pytest.raises(UnsupportedStateError, match=r"'optim\.state\.weight\.odd' has shape \(3,\), neither its "
                                                    r"parameter's \(2, 4\)"):
        checkpoint.save(str(tmp_path / "b"), {"model": m, "optim": opt})


# What checkpoint must not name: other vescale packages, their classes, and the attributes/keys of their internals
# that the protocol replaces (ZeRO's state-dict layout, RaggedShard's fields).
_OTHER_PACKAGES = ("vescale.parallel", "vescale.dtensor", "vescale.pipe", "vescale.plan")
# class names of other packages, as names, attributes or strings
_CLASSES = {"DistributedOptimizer", "RaggedShard", "InterleavedShard", "GraphStage",
            "PipeEngine"}
# attributes of their internals the protocol replaces (RaggedShard's fields, the ZeRO optimizer's)
_ATTRIBUTES = _CLASSES | {"local_units", "local_range", "unit_len", "dims", "zero_stage", "dp_rank", "dp_size", "ddp",
                          "optimizer", "pieces", "master"}
# keys of ZeRO's own state-dict layout
_STRINGS = _CLASSES | {"vescale.zero/1", "zero_stage", "dp_rank", "dp_size", "ranges", "local_shape", "master",
                       "local_units", "local_range"}


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                ids.add(id(first.value))
    return ids


def test_checkpoint_names_nothing_of_parallel_or_dtensor():
    import vescale.checkpoint

    root = pathlib.Path(vescale.checkpoint.__file__).parent
    problems = []
    files = sorted(root.glob("*.py"))
    assert len(files) > 10
    for path in files:
        tree = ast.parse(path.read_text(), str(path))
        docs = _docstrings(tree)
        for node in ast.walk(tree):
            where = f"{path.name}:{getattr(node, 'lineno', '?')}"
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(_OTHER_PACKAGES):
                problems.append(f"{where}: imports {node.module}")
            elif isinstance(node, ast.Import):
                problems += [f"{where}: imports {a.name}" for a in node.names if a.name.startswith(_OTHER_PACKAGES)]
            elif isinstance(node, ast.Attribute) and node.attr in _ATTRIBUTES:
                problems.append(f"{where}: attribute .{node.attr}")
            elif isinstance(node, ast.Name) and node.id in _CLASSES:
                problems.append(f"{where}: name {node.id}")
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
                if node.value in _STRINGS or any(p in node.value for p in _OTHER_PACKAGES):
                    problems.append(f"{where}: string {node.value!r}")
            elif isinstance(node, ast.Compare):  # a class recognised by its name: type(x).__name__ == "..."
                if any(isinstance(n, ast.Attribute) and n.attr in ("__name__", "__qualname__")
                       for n in ast.walk(node)):
                    problems.append(f"{where}: compares a class name")
    assert not problems, "vescale.checkpoint names other packages' internals:\n  " + "\n  ".join(problems)
