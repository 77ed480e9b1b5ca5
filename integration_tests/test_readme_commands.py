"""Every command line of the README runs as written, on CPU ranks, and ends in a finite loss.

The lines are read from README.md itself: each ``python tools/train.py ...`` line of a code block (continuation lines
joined), the trainer arguments of the inline ``nox -s train -- ...`` examples, the generation lines, the checkpoint
CLI's ``export-hf`` line and the inline ``python tools/prepare_data.py`` and ``python tools/train.py --help``. Each
runs in one working directory standing for the repository root, which holds what the README tells the reader to
bring: ``my-model/`` (a tiny Llama as ``save_pretrained`` writes it, with its tokenizer), ``my-texts/`` (a folder of
text files) and ``my-tok/`` (a tokenizer directory). The data cache (``$VESCALE_CACHE``) is the session's
(``conftest.stdlib_corpus_cache``).

What a train line gets: ``--steps 2`` (:func:`_steps`: N + 2 where it writes or resumes the checkpoint of step N),
``--quiet``, a fresh ``--out`` unless it names one, and unless it sets them ``--seq-len 16``, ``--trace-steps 0``
and the smallest ``--batch-size`` its mesh accepts: nothing that changes its mesh, model, data or any other flag it
names. Two lines need an earlier run, as they do for the reader: the resume line (``--resume
runs/latest/ckpt/step_50``) resumes from the run of the README's checkpoint line (``--ckpt-every 50``, run for 52
steps into the default ``runs/latest``) and must continue its losses, and the generation lines (``--model DIR``) and
the checkpoint CLI's line read the fine-tune section's run (``runs/ft``).

The jobs run through their own ``main`` (argument parsing, the checks before any rank starts, the output directory,
data preparation, then ``vescale.core.launch.spawn``); ``vescale.core.testing.spawn_on_pool`` hands the spawn to the
session's warm ranks, so a line costs its training work and not a process start per rank.

Not run here, by rule (:func:`_skip_reason`): ``torchrun`` lines of one node are the GPU launch (NCCL, one GPU per
rank; ``test_multinode.py`` runs the torchrun CPU path), and the set-up lines (``pip``, ``nox``, ``pytest``,
``python -m venv``) are what CI itself runs.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import shlex
import shutil
import sys
from pathlib import Path

import pytest

from vescale.core.testing import spawn_on_pool

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import generate  # noqa: E402
import prepare_data  # noqa: E402
import train  # noqa: E402

STEPS = 2
#: What a train line gets unless it sets the flag itself: few steps, short rows, no traced timeline (a fresh --out and
#: --quiet are always added, the out unless the line names one).
ADDED = {"--steps": str(STEPS), "--seq-len": "16", "--trace-steps": "0"}
#: The README's checkpoint line, and the steps it runs here so that the resume line finds its step_50.
CKPT_LINE, CKPT_STEPS = "--ckpt-every 50", 52
#: Where the generation lines' ``DIR`` points: the fine-tune section's export (with a tokenizer), or its weights
#: alone for the line that names a directory without one.
GENERATE_DIR, GENERATE_DIR_NO_TOKENIZER = "runs/ft/hf", "runs/ft/hf-weights-only"
SETUP = ("pip ", "nox ", "pytest", "python -m venv", ". .venv")
#: The chat template of ``my-model``'s tokenizer (role markers around each turn; the generation prompt opens an
#: assistant turn), for the README's chat lines.
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
#: README lines that fail today, with what fails: not run (expected to fail) until fixed or changed in the README.
KNOWN_FAILING: dict[str, str] = {}


def _readme() -> str:
    return (ROOT / "README.md").read_text()


def block_lines(text: str) -> list[str]:
    """Every command line of the README's code blocks (``python`` blocks excluded: they are programs, run by
    ``test_readme.py``), comments stripped, continuation lines joined."""
    lines = []
    for lang, body in re.findall(r"```(\w*)\n(.*?)```", text, re.S):
        if lang == "python":
            continue
        for line in body.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s+", " ", line.split("  #", 1)[0]).strip()
            if line and not line.startswith("#"):
                lines.append(line)
    return lines


def inline_commands(text: str) -> list[str]:
    """The commands quoted inline in the README's prose that a reader runs: ``nox -s train -- ARGS`` as the train
    line it runs, and ``python tools/...``."""
    flat = re.sub(r"\s+", " ", text)
    out = [f"python tools/train.py {args.strip()}" for args in re.findall(r"`nox -s train -- ([^`]*)`", flat)]
    out += [cmd.strip() for cmd in re.findall(r"`(python tools/[^`]*)`", flat)]
    return out


def _skip_reason(line: str) -> str | None:
    """Why a README command line is not run here, or None when it is."""
    if line.startswith("torchrun") and "$" not in line:
        return "GPU launch: torchrun starts one NCCL rank per GPU (the torchrun CPU path is test_multinode.py's)"
    if line.startswith(SETUP) or "&& nox" in line:
        return "set-up or CI command (installs, the test sessions, lint)"
    if "$" in line:
        return "the several-nodes block, run by test_multinode.py"
    return None


def _commands(kind: str) -> list[str]:
    lines = list(dict.fromkeys(block_lines(_readme()) + inline_commands(_readme())))
    prefix = {"train": "python tools/train.py ", "generate": "python tools/generate.py ",
              "checkpoint": "python -m vescale.checkpoint ", "prepare": "python tools/prepare_data.py "}[kind]
    return [line for line in lines if line.startswith(prefix) and not _skip_reason(line)]


def _id(line: str) -> str:
    return re.sub(r"[^\w=,.-]+", "_", line.split(" ", 2)[-1])[:80]


def test_every_readme_command_is_run_or_skipped_by_a_rule():
    """Each command line of the README's blocks is one this module runs, or one a named rule skips: a new kind of
    line cannot go untested unnoticed."""
    text = _readme()
    runs = {line for kind in ("train", "generate", "checkpoint", "prepare") for line in _commands(kind)}
    lines = block_lines(text) + inline_commands(text)
    unknown = [line for line in lines if line not in runs and not _skip_reason(line)
               and not re.match(r"[A-Z]+=|\w+ *\(|import |from |wait\b", line)]  # shell variables, block prose
    assert not unknown, f"README command lines neither run nor skipped by a rule: {unknown}"
    assert len(_commands("train")) >= 20 and len(_commands("generate")) == 5 and _commands("checkpoint")
    assert any("--resume" in line for line in _commands("train"))
    assert set(KNOWN_FAILING) <= runs, "a known failure that is no longer a README line"


# --------------------------------------------------------------------------------------------- the reader's files
@pytest.fixture(scope="module")
def workspace(tmp_path_factory, stdlib_corpus_cache):
    """The directory the lines run in, holding ``my-model/``, ``my-texts/``, ``my-tok/``; the data cache is the
    session's, which holds the default corpus."""
    root = tmp_path_factory.mktemp("readme")
    saved = dict(os.environ)
    os.environ["VESCALE_CACHE"] = str(stdlib_corpus_cache)
    try:
        tok = prepare_data.stdlib_tokenizer(cache=stdlib_corpus_cache)  # 512 ids: the built-in models' vocabulary
        _make_reader_files(root, tok)
        yield root
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _make_reader_files(root: Path, tokenizer: Path) -> None:
    import torch
    import transformers as tf

    fast = tf.PreTrainedTokenizerFast(tokenizer_file=str(tokenizer / "tokenizer.json"), eos_token="<|endoftext|>")
    fast.save_pretrained(root / "my-tok")
    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                            eos_token_id=fast.eos_token_id, bos_token_id=fast.eos_token_id)
    tf.LlamaForCausalLM(config).save_pretrained(root / "my-model")
    fast.chat_template = CHAT_TEMPLATE  # a model directory of an instruction-tuned family carries one
    fast.save_pretrained(root / "my-model")
    rng = random.Random(0)
    words = "the data model rank mesh tensor shard step loss batch layer token".split()
    with open(root / "my-chats.jsonl", "w") as chats:
        for _ in range(64):
            turns = [{"role": role, "content": " ".join(rng.choices(words, k=rng.randint(3, 12)))}
                     for _ in range(rng.randint(1, 2)) for role in ("user", "assistant")]
            chats.write(json.dumps({"messages": turns}) + "\n")
    texts = root / "my-texts"
    texts.mkdir()
    for i, src in enumerate(prepare_data.stdlib_files(limit=200_000)):  # about 50 documents, one a file
        (texts / f"doc{i:03d}.txt").write_text(src.read_text(encoding="utf-8", errors="replace"))


# ------------------------------------------------------------------------------------------------------ train lines
def _steps(argv: list[str]) -> int:
    """The steps a train line runs here: ``STEPS``; a line that writes checkpoints (``--ckpt-every N``) or resumes
    from one (``--resume .../step_N``) runs to N + ``STEPS``, so that its first checkpoint exists or it trains past
    the one it resumes."""
    for flag in ("--ckpt-every", "--resume"):
        if flag in argv:
            return int(re.findall(r"\d+", argv[argv.index(flag) + 1])[-1]) + STEPS
    return STEPS


def _train_argv(line: str, out: Path | None) -> list[str]:
    """``line``'s arguments with :data:`ADDED` (``--steps`` replaced by :func:`_steps`'), ``--quiet`` and
    ``--out out`` unless the line names one (``out`` None: the default, a new ``runs/run-<time>``)."""
    argv = shlex.split(line)[2:]
    if argv == ["--help"]:
        return argv
    if "--steps" in argv:
        del argv[argv.index("--steps"):argv.index("--steps") + 2]
    argv += ["--steps", str(_steps(argv))]
    argv += [a for flag, value in ADDED.items() if flag not in argv for a in (flag, value)]
    if "--out" not in argv and out is not None:
        argv += ["--out", str(out)]
    return argv + ["--quiet"]


def _train_commands() -> list[str]:
    """The README's train lines, each run once: a line that trains what an earlier one trains is left out (the inline
    ``nox -s train -- --mesh pp=2,dp=2,tp=2 --steps 100`` is the block's first line, once the steps are set)."""
    seen, lines = set(), []
    for line in _commands("train"):
        argv = _train_argv(line, Path("out"))
        key = json.dumps(vars(train.parse_args(argv, "readme")), sort_keys=True) if argv != ["--help"] else line
        if key not in seen:
            seen.add(key)
            lines.append(line)
    return lines


def _smallest_batch(argv: list[str]) -> list[str]:
    """``argv`` with the smallest ``--batch-size`` of 1, 2, 4, 8 that its mesh, microbatches and accumulation accept
    (``config.check_fits``), unless it sets one. Run in the workspace (``my-model`` is read)."""
    if "--batch-size" in argv:
        return argv
    for batch in (1, 2, 4):
        try:
            train.check_fits(train.parse_args([*argv, "--batch-size", str(batch)], "readme"))
        except SystemExit:
            continue
        return [*argv, "--batch-size", str(batch)]
    return argv


_RUNS: dict[str, tuple[dict, Path, list[str]]] = {}


def _run_line(line: str, workspace: Path, out: Path | None, batch_of: str | None = None) -> tuple[dict, Path]:
    """Run the train line ``line`` in ``workspace`` once per module (later calls return the first run): its summary
    and output directory. Its batch is the smallest it accepts, or that of the run of line ``batch_of`` (a resumed
    run continues the batches of the run it resumes)."""
    if line not in _RUNS:
        cwd = os.getcwd()
        os.chdir(workspace)
        try:
            argv = _train_argv(line, out)
            if batch_of is None:
                argv = _smallest_batch(argv)
            else:
                earlier = _RUNS[batch_of][2]
                argv += ["--batch-size", earlier[earlier.index("--batch-size") + 1]]
            with spawn_on_pool():
                summary = train.main(argv)
            cfg = train.parse_args(argv, "readme")
            out_dir = (workspace / cfg.out if cfg.out else workspace / "runs" / "latest").resolve()
            _RUNS[line] = summary, out_dir, argv
        finally:
            os.chdir(cwd)
    return _RUNS[line][:2]


def _records(out: Path) -> list[dict]:
    return [json.loads(r) for r in (out / "metrics.jsonl").read_text().splitlines()]


def _assert_trained(summary: dict, out: Path, steps: int, first_step: int = 1) -> list[dict]:
    """The run wrote one finite loss a step, from ``first_step`` to ``steps``, its summary and its loss plot."""
    records = _records(out)
    assert [r["step"] for r in records] == list(range(first_step, steps + 1)), records
    assert all(math.isfinite(r["loss"]) for r in records), records
    assert summary["steps"] == steps and math.isfinite(summary["final_loss"]), summary
    assert (out / "summary.json").is_file() and (out / "loss.png").is_file()
    return records


def _line_with(marker: str) -> str:
    return next(line for line in _train_commands() if marker in line)


def _prerequisite(workspace: Path, marker: str) -> tuple[dict, Path]:
    """The run of the README's train line containing ``marker``, as the reader ran it before the line needing it:
    the checkpoint line into the default ``runs/latest``, the fine-tune line into its own ``--out runs/ft``."""
    return _run_line(_line_with(marker), workspace, None)


def _params(lines: list[str]) -> list:
    return [pytest.param(line, id=_id(line), marks=[pytest.mark.xfail(run=False, reason=KNOWN_FAILING[line])]
                         if line in KNOWN_FAILING else []) for line in lines]


@pytest.mark.parametrize("line", _params(_train_commands()))
def test_train_line_runs_as_written(line, workspace, tmp_path, monkeypatch):
    monkeypatch.chdir(workspace)
    argv = _train_argv(line, tmp_path / "run")
    if argv == ["--help"]:
        with pytest.raises(SystemExit) as done:
            train.main(argv)
        assert done.value.code == 0
        return
    cfg = train.parse_args(argv, "readme")
    resumes = bool(cfg.resume) and cfg.resume != "auto"  # auto: the newest checkpoint under --out, none here yet
    if resumes:
        _prerequisite(workspace, CKPT_LINE)  # the run whose runs/latest/ckpt/step_50 this line resumes
    summary, out = _run_line(line, workspace, None if CKPT_LINE in line else tmp_path / "run",
                             batch_of=_line_with(CKPT_LINE) if resumes else None)
    if resumes:
        _check_resumed(summary, out, cfg, _prerequisite(workspace, CKPT_LINE))
        return
    _assert_trained(summary, out, cfg.steps)
    assert summary["mesh"] == cfg.dims and summary["model"] == cfg.model
    if cfg.ckpt_every:
        assert (out / "ckpt" / f"step_{cfg.ckpt_every}" / "metadata.json").is_file()
    if cfg.eval_every:
        assert math.isfinite(summary["final_eval_loss"]), summary
    if cfg.export_hf:
        _check_export(workspace / cfg.export_hf)
    if cfg.compile:
        assert summary["spec"]["compile"] is True
    if cfg.tensorboard:
        assert any((out / "tensorboard").glob("events.out.tfevents.*")), sorted(out.iterdir())


def _check_resumed(summary: dict, out: Path, cfg, checkpoint_run: tuple[dict, Path]) -> None:
    """The resumed run starts after the checkpoint's step and continues the run that wrote it: the same losses at
    the same steps (another mesh sums in another order: within 1e-4 relative, fp32)."""
    saved = int(Path(cfg.resume).name.removeprefix("step_"))
    records = _assert_trained(summary, out, cfg.steps, first_step=saved + 1)
    want = [r["loss"] for r in _records(checkpoint_run[1])[saved:cfg.steps]]
    assert len(want) == STEPS
    assert [r["loss"] for r in records] == pytest.approx(want, rel=1e-4)


def _check_export(directory: Path) -> None:
    """A directory ``from_pretrained`` loads (weights, config, tokenizer), holding trained weights: other values than
    the workspace's ``my-model`` the run started from, under the same names."""
    import torch
    import transformers as tf

    assert (directory / "config.json").is_file() and (directory / "tokenizer.json").is_file()
    model = tf.AutoModelForCausalLM.from_pretrained(directory)
    assert all(p.isfinite().all() for p in model.parameters())
    start = directory
    while start.parent != start and not (start / "my-model").is_dir():
        start = start.parent
    initial = tf.AutoModelForCausalLM.from_pretrained(start / "my-model").state_dict()
    trained = model.state_dict()
    assert set(trained) == set(initial)
    assert any(not torch.equal(t, initial[n]) for n, t in trained.items()), "the export holds the untrained weights"


# -------------------------------------------------------------------------- generation, checkpoint CLI, data prep
@pytest.fixture(scope="module")
def fine_tuned(workspace) -> Path:
    """The fine-tune section's first line run (``--out runs/ft --export-hf runs/ft/hf``), and its export's weights
    alone in ``GENERATE_DIR_NO_TOKENIZER``."""
    _, out = _prerequisite(workspace, "--out runs/ft")
    bare = workspace / GENERATE_DIR_NO_TOKENIZER
    bare.mkdir(exist_ok=True)
    for f in (workspace / GENERATE_DIR).iterdir():
        if f.name == "config.json" or f.name.startswith("model"):
            shutil.copy(f, bare / f.name)
    return out


@pytest.mark.parametrize("line", _commands("generate"), ids=_id)
def test_generate_line_runs_as_written(line, fine_tuned, workspace, monkeypatch, capsys):
    monkeypatch.chdir(workspace)
    model = GENERATE_DIR_NO_TOKENIZER if "without tokenizer" in _raw_line(line) else GENERATE_DIR
    argv = [model if a == "DIR" else a for a in shlex.split(line)[2:]] + ["--quiet"]
    named = argv[argv.index("--model") + 1]
    if named not in (GENERATE_DIR, GENERATE_DIR_NO_TOKENIZER):  # another section's export: its train line first
        _prerequisite(workspace, f"--export-hf {named}")
    with spawn_on_pool():
        summary = generate.main(argv)
    cfg = generate.parse_args(argv)
    rows = len(cfg.prompt) or len(cfg.token_ids)
    assert summary["mesh"] == cfg.dims and len(summary["tokens"]) == rows
    assert all(0 < len(t) <= cfg.max_new_tokens for t in summary["tokens"]), summary["tokens"]
    assert (summary["texts"] is None) == (model == GENERATE_DIR_NO_TOKENIZER)
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["prompts"] == rows


def _raw_line(line: str) -> str:
    """The README line ``line`` came from, with its comment."""
    return next((raw for raw in _readme().splitlines() if raw.strip().startswith(line)), line)


@pytest.mark.parametrize("line", _commands("checkpoint"), ids=_id)
def test_checkpoint_cli_line_runs_as_written(line, fine_tuned, workspace, monkeypatch, capsys):
    from vescale.checkpoint.__main__ import main as checkpoint_cli

    monkeypatch.chdir(workspace)
    argv = shlex.split(line)[3:]
    assert checkpoint_cli(argv) == 0
    written = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert "config.json" in written["files"] and (workspace / argv[2] / "config.json").is_file()
    _check_export(workspace / argv[2])
    # inspect and verify (the checkpoint README's commands) on the same checkpoint
    assert checkpoint_cli(["verify", argv[1]]) == 0 and checkpoint_cli(["inspect", argv[1]]) == 0


@pytest.mark.parametrize("line", _commands("prepare"), ids=_id)
def test_prepare_data_line_runs_as_written(line, workspace, monkeypatch):
    monkeypatch.chdir(workspace)
    words = {"PATH": "my-texts", "DIR": "my-tok"}
    prepared = prepare_data.main([words.get(a, a) for a in shlex.split(line)[2:]])
    assert prepared.meta["train_tokens"] > 0 and prepared.meta["heldout_docs"] >= 1
