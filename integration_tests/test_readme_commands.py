"""Every ``python tools/train.py ...`` line of the README is accepted as written: its flags parse and the run it
describes passes every check made before any rank starts (``config.check_fits``: the spec's refusals, the model fit,
the numeric flags). Lines naming the reader's own files (``my-...``) are checked with a built-in Hugging Face model
for ``--model`` and without the other names."""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import config  # noqa: E402


def _commands() -> list[str]:
    lines = []
    for block in re.findall(r"```\n(.*?)```", (ROOT / "README.md").read_text(), re.S):
        for line in block.splitlines():
            line = line.split("  #", 1)[0].strip()
            if line.startswith("python tools/train.py"):
                lines.append(line)
    return lines


def _argv(line: str) -> list[str]:
    argv = shlex.split(line)[2:]
    out, skip = [], False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
            continue
        if i + 1 < len(argv) and "my-" in argv[i + 1]:  # the reader's own model (a built-in HF one here), data
            skip = True  # or tokenizer (left out)
            if arg == "--model":
                out += ["--model", "llama"]
            continue
        if arg == "--resume":  # a checkpoint of an earlier run: checked by prepare_out, not here
            skip = True
            continue
        out.append(arg)
    return out


def test_the_readme_has_train_commands():
    assert len(_commands()) >= 15


@pytest.mark.parametrize("line", _commands())
def test_readme_command_is_accepted_as_written(line):
    cfg = config.parse_args(_argv(line), "readme")
    spec = config.check_fits(cfg)  # SystemExit naming the reason if refused
    assert spec.world_size >= 1
