"""``docs/architecture.md`` matches the code: every owner its concept table names imports, with every name it
lists in parentheses."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"


def _owners() -> list[tuple[str, list[str]]]:
    table = DOC.read_text().split("## One owner per concept", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| ---")][1:]
    out = []
    for row in rows:
        owner = row.split(" | ")[1]
        for module, names in re.findall(r"`(vescale\.[\w.]+)`(?: \(([^)]*)\))?", owner):
            out.append((module, re.findall(r"`(\w+)`", names or "")))
    return out


def test_every_owner_in_the_concept_table_exists():
    owners = _owners()
    assert len(owners) >= 15, owners  # the table was read (a parse that finds nothing must not pass)
    missing = []
    for module, names in owners:
        try:
            mod = importlib.import_module(module)
        except ImportError as exc:
            missing.append(f"{module}: {exc}")
            continue
        missing += [f"{module}.{name}" for name in names if not hasattr(mod, name)]
    assert not missing, missing
