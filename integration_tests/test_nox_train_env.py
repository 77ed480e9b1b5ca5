"""``nox -s train -- --model llama`` from a clean checkout: the ``train`` session installs everything the job needs.

The session is noxfile.py's own ``train`` function, called with a stand-in for nox's session and for the noxfile's
``_install`` (its arguments: the packages, their extras, the other requirements), recording what the session would
install and the command it runs; no venv is built. What it installs is closed over dependencies with the metadata of
this environment (the requirements it names, each vescale package's ``pyproject.toml`` dependencies, and theirs),
and the command then runs (with one short step added, on the default corpus prepared once by a session fixture) in
an interpreter started with ``-S`` whose path holds exactly those distributions, linked from this environment: a
venv holding only what the session installs, without pip. Its spawned ranks inherit ``-S`` and the path. A
distribution the job imports but the session does not install fails the job as it failed the reader in #41
(``ModuleNotFoundError: transformers``); optional imports (transformers tries accelerate, psutil, ...) find nothing,
as in the session's venv.

What this does not prove: that pip resolves these names from the registry, or the versions it picks.
``VESCALE_TEST_NOX_TRAIN=1`` runs the real thing instead (``test_nox_train_llama_from_a_clean_checkout``: a copy of
the checkout, a new ``.nox`` built by nox, minutes of installs); it needs ``nox`` on ``PATH``.
"""

from __future__ import annotations

import importlib.metadata as metadata
import importlib.util
import json
import math
import os
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11 (pyproject.toml is read)

ROOT = Path(__file__).resolve().parents[1]
LLAMA = ["--model", "llama"]  # the README's `nox -s train -- --model llama`
SHORT = ["--steps", "1", "--seq-len", "16", "--trace-steps", "0", "--quiet"]


class _Session:
    """What noxfile.py's ``train`` session uses of ``nox.Session``: its arguments, and the commands it runs."""

    def __init__(self, posargs: list[str]) -> None:
        self.posargs, self.name = posargs, "train"
        self.runs: list[list[str]] = []

    def run(self, *args: str, **kwargs) -> str:
        self.runs.append(list(args))
        return ""

    def log(self, *args, **kwargs) -> None:
        pass


def _noxfile():
    """noxfile.py as a module, with a stand-in ``nox`` whose decorators leave the session functions as they are."""
    fake = types.ModuleType("nox")
    fake.options = types.SimpleNamespace()
    fake.Session = _Session
    fake.session = lambda fn=None, **kw: fn if fn is not None else (lambda f: f)
    fake.parametrize = lambda *a, **kw: (lambda f: f)
    saved = sys.modules.get("nox")
    sys.modules["nox"] = fake
    try:
        spec = importlib.util.spec_from_file_location("_noxfile_under_test", ROOT / "noxfile.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        if saved is None:
            sys.modules.pop("nox")
        else:
            sys.modules["nox"] = saved
    return module


def _train_session(posargs: list[str]) -> tuple[list[str], _Session]:
    """What noxfile.py's ``train`` session installs (as pip arguments: torch, each vescale package editable with its
    extras, the extra requirements; from the arguments it gives the noxfile's ``_install``) and the session."""
    noxfile, installs = _noxfile(), []

    def record(session, packages, extras="", requirements=()):
        extra_of = extras if isinstance(extras, dict) else dict.fromkeys(packages, extras)
        installs.append([noxfile.TORCH, *(a for p in packages for a in ("-e", f"{ROOT / 'packages' / p}"
                                                                           f"{extra_of.get(p, '')}")),
                         *requirements])

    noxfile._install = record
    session = _Session(posargs)
    noxfile.train(session)
    assert len(installs) == 1, installs
    return installs[0], session


def _installed_by(install_args: list[str]) -> set[str]:
    """The distributions a ``pip install`` of ``install_args`` puts into an empty venv: the named requirements and
    editable vescale packages, and their dependencies (markers evaluated; extras only where requested), by the
    metadata of this environment."""
    todo: list[Requirement] = []
    args = iter(install_args)
    for arg in args:
        if arg == "-e":
            path = next(args)
            project = tomllib.loads((Path(re.sub(r"\[.*\]$", "", path)) / "pyproject.toml").read_text())["project"]
            extras = set(re.findall(r"\[(.*)\]$", path)[0].split(",")) if path.endswith("]") else set()
            todo.append(Requirement(project["name"]))
            todo += [Requirement(r) for r in project.get("dependencies", [])]
            for extra in extras:
                todo += [Requirement(r) for r in project.get("optional-dependencies", {}).get(extra, [])]
        elif not arg.startswith("-"):
            todo.append(Requirement(arg))
    found: set[str] = set()
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if name in found:
            continue
        found.add(name)
        try:
            requires = metadata.requires(req.name) or []
        except metadata.PackageNotFoundError:
            continue
        for text in requires:
            dep = Requirement(text)
            if dep.marker is None or any(dep.marker.evaluate({"extra": e}) for e in (req.extras or {""})):
                todo.append(dep)
    return found


def _site_of(distributions: set[str], into: Path) -> list[str]:
    """A ``sys.path`` holding exactly ``distributions`` of this environment (as a venv where only they were installed
    would): ``into`` gets a link to each top-level entry of each one's files (packages, modules, ``.dist-info``), and
    the directories that editable installs put on the path through their ``.pth`` files come after it."""
    into.mkdir()
    paths = [str(into)]
    for name in sorted(distributions):
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue  # (pip would install it; nothing here can import it, so a need for it fails the job)
        for top in sorted({f.parts[0] for f in dist.files or [] if f.parts[0] != ".."}):
            source = Path(dist.locate_file(top))
            if source.exists() and not (into / top).exists():
                (into / top).symlink_to(source)
            if top.endswith(".pth"):
                paths += [line.strip() for line in source.read_text().splitlines() if Path(line.strip()).is_dir()]
    return paths


def test_nox_train_session_installs_what_model_llama_imports(tmp_path, stdlib_corpus_cache):
    install, session = _train_session(LLAMA)
    (command,) = session.runs
    assert command[:2] == ["python", str(ROOT / "tools" / "train.py")] and command[2:] == LLAMA
    installed = _installed_by(install)
    assert {"torch", "transformers", "tokenizers", "matplotlib", "vescale-plan"} <= installed

    # The session's command, in an interpreter (and spawned ranks: -S is passed on) that sees only those.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(_site_of(installed, tmp_path / "site")),
           "PYTHONNOUSERSITE": "1", "VESCALE_CACHE": str(stdlib_corpus_cache)}
    job = subprocess.run([sys.executable, "-S", *command[1:], *SHORT, "--out", str(tmp_path / "run")],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert job.returncode == 0, (f"`nox -s train -- --model llama` fails with only what the train session installs "
                                 f"({sorted(installed)}):\n{job.stderr[-4000:]}")
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["model"] == "llama" and summary["mesh"] == {"dp": 2} and math.isfinite(summary["final_loss"])


def test_a_missing_requirement_fails_the_job(tmp_path):
    """The check can fail: without transformers (and peft, which requires it) among the session's requirements
    (#41's noxfile) the closure lacks it, and in that site the import the llama job makes fails, as it did for the
    reader."""
    install, _ = _train_session(LLAMA)
    without = _installed_by([a for a in install if not a.startswith(("transformers", "peft"))])  # (peft needs it)
    assert "transformers" not in without and "torch" in without
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(_site_of(without, tmp_path / "site")),
           "PYTHONNOUSERSITE": "1"}
    probe = subprocess.run([sys.executable, "-S", "-c", "import transformers"],
                           env=env, capture_output=True, text=True, timeout=300)
    assert probe.returncode == 1 and "No module named 'transformers'" in probe.stderr, probe.stderr[-2000:]


@pytest.mark.skipif(os.environ.get("VESCALE_TEST_NOX_TRAIN") != "1" or shutil.which("nox") is None,
                    reason="opt-in (VESCALE_TEST_NOX_TRAIN=1, nox on PATH): builds the train session's venv, minutes")
def test_nox_train_llama_from_a_clean_checkout(tmp_path):
    """The README's command itself, in a copy of the tracked files (a clean checkout), with a fresh ``.nox``."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    clean = tmp_path / "checkout"
    for name in filter(None, files.split("\0")):
        if (ROOT / name).is_file():
            (clean / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, clean / name)
    env = {**os.environ, "VESCALE_CACHE": str(tmp_path / "cache")}
    env.pop("VIRTUAL_ENV", None)
    run = subprocess.run(["nox", "-s", "train", "--", *LLAMA, *SHORT, "--out", str(tmp_path / "run")], cwd=clean,
                         env=env, capture_output=True, text=True, timeout=3600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert (tmp_path / "run" / "summary.json").is_file() and (clean / ".nox" / "train").is_dir()
