"""Every private torch name the project uses goes through :mod:`vescale.core.torch_internals`.

The rule, checked by an AST walk over every ``*.py`` file under ``packages/*/src`` and ``tools/`` except the
compatibility module itself (``vescale/core/torch_internals.py``). A line is a violation when it has:

1. an import of a private torch module or name: ``import torch.x._y``, ``from torch.x._y import z`` or
   ``from torch.x import _y`` (any dotted component or imported name that starts with one ``_``; dunders are fine);
2. an attribute chain whose root is a name the file bound by importing from torch (``torch``, ``nn``, ``dist``, a
   ``from torch... import DTensor``, ...) with a component that starts with one ``_``: ``torch._dynamo.reset``,
   ``nn.Module._call_impl``, ``DTensor._op_dispatcher``. Chains through ``torch.ops`` are exempt:
   ``torch.ops.aten._foo`` names an operator, not a Python private;
3. an attribute access, on any object, of a name in :data:`TORCH_PRIVATE_ATTRIBUTES` (``x._local_tensor``,
   ``x._spec``, ``m._parameters``, ...), or that name as a string constant passed to ``getattr``/``hasattr``/
   ``setattr``/``delattr``. These are torch objects' private attributes; the project never names its own attributes
   so.

Whatever cannot be replaced by public API is added to the compatibility module with a comment saying why.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from vescale.core import torch_internals

REPO = Path(__file__).resolve().parents[3]
COMPAT_MODULE = REPO / "packages" / "vescale-core" / "src" / "vescale" / "core" / "torch_internals.py"

# Private attributes of torch objects (DTensor, placements, nn.Module, OpOverload, Tensor, ...).
TORCH_PRIVATE_ATTRIBUTES = frozenset({
    "_local_tensor", "_spec", "_op_dispatcher", "_custom_op_handlers", "_mesh_resources", "_split_tensor",
    "_split_factor_int", "_compiled_call_impl", "_call_impl", "_orig_mod", "_schema", "_overloadpacket", "_version",
    "_cdata", "_execution_engine", "_parameters", "_buffers", "_modules", "_get_default_group", "_flatten",
})

_ATTRIBUTE_FUNCTIONS = frozenset({"getattr", "hasattr", "setattr", "delattr"})


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _attribute_chain(node: ast.Attribute) -> tuple[str | None, list[str]]:
    """``a.b.c`` -> ("a", ["b", "c"]); the root is None when the chain does not start at a plain name."""
    parts: list[str] = []
    cur: ast.expr = node
    while isinstance(cur, ast.Attribute):
        parts.append(cur.attr)
        cur = cur.value
    parts.reverse()
    return (cur.id if isinstance(cur, ast.Name) else None), parts


def find_private_torch_access(source: str, filename: str = "<snippet>") -> list[str]:
    """Return ``"filename:line: what"`` for each private torch access in ``source`` (the rule in the docstring)."""
    tree = ast.parse(source, filename)
    torch_names: set[str] = set()  # names this file bound by importing from torch
    found: list[str] = []

    def report(node: ast.AST, what: str) -> None:
        found.append(f"{filename}:{node.lineno}: {what}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "torch" or alias.name.startswith("torch."):
                    if any(_private(p) for p in alias.name.split(".")):
                        report(node, f"import {alias.name}")
                    torch_names.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and (
                node.module == "torch" or node.module.startswith("torch.")):
            if any(_private(p) for p in node.module.split(".")):
                report(node, f"from {node.module} import ...")
            for alias in node.names:
                if _private(alias.name):
                    report(node, f"from {node.module} import {alias.name}")
                torch_names.add(alias.asname or alias.name)

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            if node.attr in TORCH_PRIVATE_ATTRIBUTES:
                report(node, f"attribute .{node.attr}")
                continue
            root, parts = _attribute_chain(node)
            # Report each chain once, at its outermost private component.
            if root in torch_names and _private(node.attr) and parts[:1] != ["ops"]:
                report(node, f"{root}.{'.'.join(parts)}")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _ATTRIBUTE_FUNCTIONS
              and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
              and node.args[1].value in TORCH_PRIVATE_ATTRIBUTES):
            report(node, f'{node.func.id}(..., "{node.args[1].value}")')
    return sorted(set(found), key=lambda hit: (int(hit.split(":")[1]), hit))


def _scanned_files() -> list[Path]:
    files = sorted(REPO.glob("packages/*/src/**/*.py")) + sorted((REPO / "tools").rglob("*.py"))
    return [f for f in files if f.resolve() != COMPAT_MODULE.resolve()]


def test_no_private_torch_access_outside_the_compat_module():
    files = _scanned_files()
    assert len(files) > 50  # the walk found the packages, not an empty tree
    found = [hit for f in files for hit in find_private_torch_access(f.read_text(), str(f.relative_to(REPO)))]
    assert not found, "private torch access outside vescale/core/torch_internals.py:\n" + "\n".join(found)


def test_the_compat_module_exists_where_the_rule_says():
    assert COMPAT_MODULE.is_file()
    # the module imported is the one the scan exempts (installed as a copy in an isolated venv, editable in a dev one)
    assert torch_internals.__name__ == "vescale.core.torch_internals"
    assert Path(torch_internals.__file__).read_bytes() == COMPAT_MODULE.read_bytes()


def test_every_compat_name_resolves_in_this_torch():
    # the audit when torch moves: a renamed or removed private name fails here, naming it
    missing = []
    for name in torch_internals.__all__:
        try:
            getattr(torch_internals, name)
        except (ImportError, AttributeError) as e:
            missing.append(f"{name}: {e}")
    assert not missing, missing


def test_compat_module_imports_the_dtensor_stack_on_first_access_only():
    code = ("import sys\n"
            "import vescale.core.torch_internals as ti\n"
            "assert 'torch.distributed.tensor' not in sys.modules, 'imported at import'\n"
            "assert ti.StridedShard.__name__ == '_StridedShard'\n"
            "assert 'torch.distributed.tensor' in sys.modules\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


def test_scanner_reports_each_kind_of_access_with_its_line():
    snippet = "\n".join([
        "import torch",                                               # 1
        "import torch.nn as nn",                                      # 2
        "from torch.utils import _pytree as pytree",                  # 3
        "from torch.distributed.tensor._utils import X",              # 4
        "from torch.distributed.tensor import DTensor",               # 5
        "import torch.utils._pytree",                                 # 6
        "y = t._local_tensor",                                        # 7
        "torch._dynamo.reset()",                                      # 8
        "z = nn.modules.dropout._DropoutNd",                          # 9
        "DTensor._op_dispatcher",                                     # 10
        "hasattr(t, '_spec')",                                        # 11
        "m._parameters['w'] = p",                                     # 12
    ])
    lines = sorted(int(hit.split(":")[1]) for hit in find_private_torch_access(snippet, "s.py"))
    assert lines == [3, 4, 6, 7, 8, 9, 10, 11, 12]
    assert find_private_torch_access("x = a._local_tensor", "pkg/m.py") == ["pkg/m.py:1: attribute ._local_tensor"]


def test_scanner_accepts_public_and_own_private_names():
    snippet = "\n".join([
        "import torch",
        "from torch.distributed.tensor import DTensor, Shard",
        "from vescale.core.torch_internals import local_tensor",
        "from vescale.dtensor import _philox",
        "aten = torch.ops.aten",
        "a = torch.ops.aten._grouped_mm.default",
        "b = aten._scaled_dot_product_flash_attention_for_cpu",
        "c = self._hooks",
        "d = DTensor.__name__",
        "e = torch.distributed.group.WORLD",
    ])
    assert find_private_torch_access(snippet) == []
