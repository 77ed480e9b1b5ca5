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

# Each package and the vescale siblings it declares (the dependency direction of DESIGN.md).
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
    # One pip call, so the local directories satisfy the sibling requirements by name.
    session.install(TORCH, *(_local(p, extras) for p in packages))
    # Reused venvs keep an older build of the same version: refresh the vescale packages themselves.
    session.install("--no-deps", "--force-reinstall", *(_local(p) for p in packages))


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
    session.install("transformers>=4.45", "matplotlib")
    session.run("pytest", "-q", "-p", "no:cacheprovider", str(ROOT / "integration_tests"), *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff over the whole tree."""
    session.install("ruff")
    session.run("ruff", "check", str(ROOT))
