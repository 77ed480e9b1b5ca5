"""Every way vescale is checked: per-package isolated tests, the integration matrix, lint; and the main job.

    nox -s tests integration      # what CI runs (the README's test command)
    nox -s train -- --steps 50    # the main job; arguments after -- go to tools/train.py
    nox -s lint

Each ``tests`` session has its own venv holding one package, only the vescale siblings it declares (installed from
``packages/``, never from a registry) and its test extras, which proves the packages install and work separately.
torch is pinned to 2.13 so no venv ever downloads a multi-GB CUDA build.

torch (and what it requires) is installed once, into a shared base folder beside the venvs (``.nox/_torch-base``),
that every venv with a vescale package sees through a ``.pth`` file; each venv installs the rest itself. Every
package declares torch, so the base adds nothing a venv would not hold anyway, and it holds no vescale package:
isolation is unchanged. The base's exact torch build is the requirement of each venv's pip call, so no
resolver backtracking (s3fs's botocore ranges) can swap in another torch build (a multi-GB CUDA one).

Venvs are kept between runs and installed once: the vescale packages are installed editable (``pip install -e``), so
a source change needs no reinstall, and each venv holds a stamp of what it was installed from (the requirement list
and the packages' ``pyproject.toml`` files). A run whose stamp matches skips pip entirely; a changed dependency,
extra or requirement reinstalls. ``nox -N -s ...`` rebuilds a venv from scratch; ``rm -r .nox`` the base too.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import nox

ROOT = Path(__file__).parent
TORCH = "torch==2.13.*"  # resolved by pip's own configuration (find-links, indexes): the CPU build here
# What tools/ imports beyond the packages: transformers (--model llama/mixtral/gpt2/a HF directory, --export-hf,
# tools/generate.py), tokenizers (the default corpus's BPE, --tokenizer DIR; also a transformers dependency),
# matplotlib (loss.png, timeline.png), tensorboard (--tensorboard event files), peft (--lora: the PEFT model and
# its adapter export). safetensors comes with vescale-checkpoint, numpy with vescale-core.
TOOLS = ["transformers>=5", "tokenizers", "matplotlib", "tensorboard", "peft>=0.17"]

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
# The extras a package's own ``tests`` session installs: [test], plus [s3] for the checkpoint's s3:// round trips
# (s3fs and a local moto server; kept out of [test] so a dev venv of every package resolves fast without them).
TEST_EXTRAS: dict[str, str] = {"vescale-checkpoint": "[test,s3]"}
STAMP = "vescale-install.sha256"
# pytest's list of the slowest tests in every CI log (wall clock, setup and call separately).
DURATIONS = "--durations=25"


def _torch_base(session: nox.Session) -> str | None:
    """Make torch importable in this venv from the shared base folder (installed once); return the base's torch pin.

    The base is installed by this venv's pip with ``--target`` (a plain folder, ignoring what the venv holds) and
    stamped like a venv: a base whose stamp names the same torch requirement and Python is reused. A ``.pth`` file
    puts it on the venv's ``sys.path`` after the venv's own site-packages. The pin is the exact version the base
    holds (``torch==2.13.0+cpu`` here), read from its metadata. Returns None when installs are skipped
    (``--no-install``).
    """
    base = Path(session.virtualenv.location).parent / "_torch-base"
    site, stamp = base / "site-packages", base / STAMP
    paths = session.run_install("python", "-c", "import sys, sysconfig; print(sys.version, '|', "
                                "sysconfig.get_paths()['purelib'])", silent=True)
    if paths is None:  # --no-install: nothing is installed, the venv keeps what it has
        return None
    python, purelib = (part.strip() for part in paths.rsplit("|", 1))
    key = hashlib.sha256("\0".join([TORCH, python]).encode()).hexdigest()
    if not (stamp.is_file() and stamp.read_text() == key):
        stamp.unlink(missing_ok=True)
        if site.exists():
            shutil.rmtree(site)
        session.install("--no-compile", "--target", str(site), TORCH)
        stamp.write_text(key)
    versions = [d.name.removesuffix(".dist-info").split("-", 1)[1] for d in site.glob("torch-*.dist-info")]
    assert len(versions) == 1, f"{site} should hold one torch, holds {versions}"
    strays = sorted(d.name for d in site.glob("vescale*"))
    assert not strays, f"{site} holds vescale packages {strays}: a venv would import packages it does not declare"
    (Path(purelib) / "_vescale_torch_base.pth").write_text(f"{site}\n")
    return f"torch=={versions[0]}"


def _install(session: nox.Session, packages: list[str], extras: dict[str, str] | str = "",
             requirements: tuple[str, ...] = ()) -> None:
    """Install ``packages`` editable with torch 2.13 (each with its extras) and ``requirements``, unless already done.

    torch comes from the shared base (:func:`_torch_base`); one pip call installs the rest, so the local directories
    satisfy the sibling requirements by name. Skipped when the venv's stamp says it holds exactly this: the same
    requirement list (with the base's torch pin), the same pyproject.toml files, the same checkout path (an editable
    install points at it). vescale packages not in ``packages`` (left by an older package list) are removed,
    so a reused venv proves isolation as a fresh one does.
    """
    # Python keeps the bytecode it compiles, even where the environment says not to (PYTHONDONTWRITEBYTECODE, set
    # on some CI images): every rank of every test is a new process, and without the cache each one compiles what it
    # imports again (`import torch`: 2.9 s, against 1.35 s from the cache, on the 2-core development machine).
    session.env["PYTHONDONTWRITEBYTECODE"] = ""
    extra_of = extras if isinstance(extras, dict) else dict.fromkeys(packages, extras)
    # torch from the shared base, pinned to the build it holds: pip finds it installed and never swaps it.
    pin = _torch_base(session) if packages else ""
    if pin is None:  # --no-install
        return
    pip_args = [pin] if packages else []
    for p in packages:
        pip_args += ["-e", f"{ROOT / 'packages' / p}{extra_of.get(p, '')}"]
    pip_args += requirements
    digest = hashlib.sha256("\0".join([str(ROOT), *pip_args]).encode())
    for p in packages:
        digest.update((ROOT / "packages" / p / "pyproject.toml").read_bytes())
    key = digest.hexdigest()
    stamp = Path(session.virtualenv.location) / STAMP
    if stamp.is_file() and stamp.read_text() == key:
        session.log(f"{session.name}: venv already holds these requirements, skipping install ({stamp})")
        return

    stamp.unlink(missing_ok=True)  # a failed install below leaves no stamp: the next run installs again
    listed = session.run_install(
        "python", "-c", "import importlib.metadata as m; print(*{d.metadata['Name'] for d in m.distributions()})",
        silent=True)
    strays = sorted(n for n in (listed or "").split() if n.startswith("vescale-") and n not in packages)
    if strays:
        session.run_install("python", "-m", "pip", "uninstall", "-y", *strays)
    # --no-compile: byte-compiling all of torch at install costs ~70 s per venv; Python compiles what it imports.
    session.install("--no-compile", *pip_args)
    # Written through run_install so that `--no-install` (which skips the install above) writes no stamp either.
    session.run_install("python", "-c", "import pathlib, sys; pathlib.Path(sys.argv[1]).write_text(sys.argv[2])",
                        str(stamp), key, silent=True)


def _check_only(session: nox.Session, packages: list[str]) -> None:
    """Fail unless this venv can import exactly the vescale packages in ``packages`` (the isolation proof's premise)."""
    wanted = sorted(p.removeprefix("vescale-") for p in packages)
    code = ("import importlib.util, sys\n"
            "found = sorted(n for n in sys.argv[1].split(',') if importlib.util.find_spec('vescale.' + n))\n"
            "assert found == sys.argv[2].split(','), f'importable vescale packages: {found}, expected {sys.argv[2]}'")
    if session.run("python", "-c", code, ",".join(p.removeprefix("vescale-") for p in PACKAGES), ",".join(wanted),
                   silent=True, log=False) is not None:  # (None: skipped, --install-only)
        session.log(f"venv checked: the only vescale packages it can import are {', '.join(wanted)}")


@nox.session
@nox.parametrize("package", list(PACKAGES), ids=list(PACKAGES))
def tests(session: nox.Session, package: str) -> None:
    """One package alone in its venv, with only the siblings it declares; runs the package's tests.

    Installs the package and those siblings editable, with their test extras (pytest, hypothesis, transformers, ...;
    the checkpoint's [s3] too). ``nox -s tests`` runs every package, ``nox -s "tests(vescale-core)"`` one.

    Before the tests, the venv is checked to import no other vescale package: each package's ``src/`` holds only its
    own ``vescale/<sub>``, so an editable install exposes nothing more than a wheel would.
    """
    packages = PACKAGES[package] + [package]
    _install(session, packages, extras={p: TEST_EXTRAS.get(p, "[test]") for p in packages})
    _check_only(session, packages)
    session.run("pytest", "-q", "-p", "no:cacheprovider", DURATIONS, str(ROOT / "packages" / package / "tests"),
                *session.posargs)


@nox.session
def integration(session: nox.Session) -> None:
    """The cross-package matrix over world sizes 1, 2, 4, 8 and mesh shapes, with every package installed.

    Installs every package editable with its [test] extras, plus what the tools import (the matrix runs
    tools/train.py): transformers, tokenizers, matplotlib.

    Select part of the matrix with pytest options, e.g. ``nox -s integration -- -k ws4``.
    """
    _install(session, list(PACKAGES), extras="[test]", requirements=tuple(TOOLS))
    session.run("pytest", "-q", "-p", "no:cacheprovider", DURATIONS, str(ROOT / "integration_tests"), *session.posargs)


@nox.session
def train(session: nox.Session) -> None:
    """The main job, ``tools/train.py``; arguments after ``--`` go to it.

    Installs every package editable and what the tools import: transformers (``--model llama``, ``mixtral``,
    ``gpt2``, a Hugging Face directory), tokenizers, matplotlib.

    ``nox -s train`` trains the default ~11M-parameter model on 2 CPU ranks; ``nox -s train -- --mesh
    pp=2,dp=2,tp=2 --steps 100`` picks another mesh, ``nox -s train -- --model llama --mesh dp=2,tp=2`` an
    unmodified transformers model.
    """
    _install(session, list(PACKAGES), requirements=tuple(TOOLS))
    session.run("python", str(ROOT / "tools" / "train.py"), *session.posargs)


@nox.session
def bench(session: nox.Session) -> None:
    """Every benchmark in ``tools/bench`` at its small size; each prints one JSON object, collected in bench_out/.

    Installs every package editable and what the tools import (transformers: the Hugging Face model benchmarks).

    ``nox -s bench -- NAME`` runs only ``tools/bench/NAME.py``; without ``--small`` use the script directly.
    """
    _install(session, list(PACKAGES), requirements=tuple(TOOLS))
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
    """ruff (only) over the whole tree."""
    _install(session, [], requirements=("ruff",))
    session.run("ruff", "check", str(ROOT))
