"""Every way vescale is checked: per-package isolated tests, the integration matrix, lint.

    nox -s tests integration      # what CI runs (the README's test command)
    nox -s lint

Each ``tests`` session builds a fresh venv holding one package, only the vescale siblings it declares (installed from
``packages/``, never from a registry) and its test extras, which proves the packages install and work separately.
torch is pinned to 2.13 so no venv ever downloads a multi-GB CUDA build.
"""

from __future__ import annotations

from pathlib import Path

import nox

ROOT = Path(__file__).parent
TORCH = "torch==2.13.*"

nox.options.reuse_venv = "yes"
nox.options.sessions = ["tests", "integration"]

# Each package and the vescale siblings it declares (the dependency direction of docs/architecture.md).
PACKAGES: dict[str, list[str]] = {
    "vescale-core": [],
    "vescale-dtensor": ["vescale-core"],
    "vescale-parallel": ["vescale-core", "vescale-dtensor"],
    "vescale-pipe": ["vescale-core"],
    "vescale-checkpoint": ["vescale-core"],
    "vescale-plan": ["vescale-core", "vescale-dtensor", "vescale-parallel", "vescale-pipe"],
}


def _local(package: str, extras: str = "") -> str:
    return f"{ROOT / 'packages' / package}{extras}"


def _install(session: nox.Session, packages: list[str], extras: str = "[test]") -> None:
    # --no-compile: byte-compiling all of torch at install costs ~70 s per venv; Python compiles what it imports.
    # One pip call, so the local directories satisfy the sibling requirements by name.
    session.install("--no-compile", TORCH, *(_local(p, extras) for p in packages))
    # Reused venvs keep an older build of the same version: refresh the vescale packages themselves.
    session.install("--no-compile", "--no-deps", "--force-reinstall", *(_local(p) for p in packages))


@nox.session
@nox.parametrize("package", list(PACKAGES))
def tests(session: nox.Session, package: str) -> None:
    """One package alone in its own venv: install it with its declared siblings, run its tests."""
    _install(session, PACKAGES[package] + [package])
    session.run("pytest", "-q", "-p", "no:cacheprovider", str(ROOT / "packages" / package / "tests"), *session.posargs)


@nox.session
def integration(session: nox.Session) -> None:
    """Every package together: the cross-package matrix over world sizes 1, 2, 4, 8 and mesh shapes.

    Select part of the matrix with pytest options, e.g. ``nox -s integration -- -k ws4``.
    """
    _install(session, list(PACKAGES))
    # tokenizers: train.py's data (tools/prepare_data.py: the default corpus's BPE, --tokenizer DIR)
    session.install("--no-compile", "transformers>=4.45", "tokenizers", "matplotlib")
    session.run("pytest", "-q", "-p", "no:cacheprovider", str(ROOT / "integration_tests"), *session.posargs)


@nox.session
def train(session: nox.Session) -> None:
    """The main job: ``tools/train.py`` with every package installed; arguments after ``--`` go to it.

    ``nox -s train`` trains the default ~11M-parameter model on 2 CPU ranks; ``nox -s train -- --mesh
    pp=2,dp=2,tp=2 --steps 100`` picks another mesh.
    """
    _install(session, list(PACKAGES), extras="")
    session.install("--no-compile", "tokenizers", "matplotlib")  # tokenizers: the default corpus's BPE
    session.run("python", str(ROOT / "tools" / "train.py"), *session.posargs)


@nox.session
def bench(session: nox.Session) -> None:
    """Every benchmark in ``tools/bench`` at its small size; each prints one JSON object, collected in bench_out/.

    ``nox -s bench -- NAME`` runs only ``tools/bench/NAME.py``; without ``--small`` use the script directly.
    """
    _install(session, list(PACKAGES), extras="")
    session.install("--no-compile", "transformers>=4.45", "matplotlib")
    out = ROOT / "bench_out"
    out.mkdir(exist_ok=True)
    scripts = sorted((ROOT / "tools" / "bench").glob("*.py"))
    if session.posargs:
        scripts = [s for s in scripts if s.stem in session.posargs]
    for script in scripts:
        result = session.run("python", str(script), "--small", silent=True)
        (out / f"{script.stem}.json").write_text(result.strip().splitlines()[-1] + "\n")
        session.log(f"{script.stem}: {result.strip().splitlines()[-1]}")


@nox.session
def lint(session: nox.Session) -> None:
    """ruff over the whole tree."""
    session.install("ruff")
    session.run("ruff", "check", str(ROOT))
