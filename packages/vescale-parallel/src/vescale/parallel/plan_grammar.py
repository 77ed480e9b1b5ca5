"""The plan grammar: what a tensor/sequence-parallel plan for :func:`~vescale.parallel.parallelize_module` looks like.

A plan is plain data, a dict of up to four sections. Each section maps regex patterns (full match, first wins, see
:func:`vescale.core.fqn.match_plan`) to values; no key is ever split or parsed::

    plan        := {"parameter": {PARAM_REGEX:  placements},     # how each parameter is sharded
                    "input":     {MODULE_REGEX: arguments},      # redistribute a module's arguments before forward
                    "output":    {MODULE_REGEX: arguments},      # redistribute a module's outputs after forward
                    "local":     {MODULE_REGEX: arguments}}      # run a module on local shards (see .local)
    placements  := [Placement, ...]                  # exactly one per mesh dim, e.g. [Replicate(), Shard(0)]
    arguments   := [placements | None, ...]          # one item per positional argument (or output), in order
                 | {NAME: placements | None, ...}    # one item per keyword argument (or output key)

Every section is optional. ``PARAM_REGEX`` matches parameter FQNs (``r"layers\\.\\d+\\.attn\\.wq\\.weight"``),
``MODULE_REGEX`` module FQNs (``r"layers\\.\\d+\\.attn"``); ``""`` is the root module itself (its ``input`` and
``output`` entries describe the plain tensors the caller passes and gets back; the root cannot be ``local``). ``None``
leaves that argument or output alone; arguments past the end of a list are left alone too.

**One rule for boundary entries**: an ``input`` / ``output`` / ``local`` value is always a list with one item per
argument or a dict with one item per keyword, never a bare placements list. A single tensor argument on a 1-dim mesh
is therefore ``[[Shard(1)]]``, not ``[Shard(1)]``; the bare form is refused with a :class:`PlanError` that shows the
wrapped spelling, so a plan never depends on a guess between the two.

Example (Hugging Face Llama on a ``dp x tp`` mesh; :func:`vescale.parallel.llama_plan` builds the whole one)::

    {"parameter": {r"model\\.layers\\.\\d+\\.self_attn\\.[qkv]_proj\\.weight": [Replicate(), Shard(0)],
                   r"model\\.layers\\.\\d+\\.self_attn\\.o_proj\\.weight":    [Replicate(), Shard(1)]},
     "input":     {r"model\\.layers\\.\\d+\\.self_attn": {"hidden_states": [Shard(0), Replicate()]},
                   "": {"input_ids": [Shard(0), Replicate()]}},                  # the root: per keyword
     "output":    {r"model\\.layers\\.\\d+\\.self_attn\\.o_proj": [[Shard(0), Shard(1)]],   # one output
                   "": {"logits": None}}}                                        # keep the logits a DTensor

:func:`check_plan` validates a plan against this grammar up front, before any module is touched; each error names
the section and the entry. The old single ``"forward"`` section (keys ``"X.input"`` / ``"X.output"`` / ``"X.local"``)
is refused with the new spelling of its entries.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch.distributed.tensor.placement_types import Placement

from vescale.core.errors import PlanError

__all__ = ["Plan", "SECTIONS", "BOUNDARY_SECTIONS", "CheckedPlan", "Arguments", "check_plan"]

#: A plan: ``{"parameter" | "input" | "output" | "local": {regex: value}}`` (see the module docstring).
Plan = Mapping[str, Mapping[str, Any]]

#: The sections of a plan, in the order they are applied.
SECTIONS = ("parameter", "input", "output", "local")

#: The sections whose entries are per-argument (module boundaries).
BOUNDARY_SECTIONS = ("input", "output", "local")

#: A checked boundary entry: one placements tuple (or ``None``) per position, or per keyword.
Arguments = list | dict


@dataclass
class CheckedPlan:
    """A plan that passed :func:`check_plan`: the same entries, boundary values normalised to
    ``list[tuple[Placement, ...] | None]`` or ``dict[str, tuple[Placement, ...] | None]``. Parameter values are kept
    as given (they are checked against each parameter's shape when applied, where the error can name the FQN)."""

    parameter: dict[str, Any] = field(default_factory=dict)
    input: dict[str, Arguments] = field(default_factory=dict)
    output: dict[str, Arguments] = field(default_factory=dict)
    local: dict[str, Arguments] = field(default_factory=dict)


def check_plan(plan: Plan, mesh: Any = None) -> CheckedPlan:
    """Validate ``plan`` against the grammar; return it as a :class:`CheckedPlan`.

    Pure (no collective, no module needed). With ``mesh`` (a ``DeviceMesh``), each boundary item must hold exactly
    one :class:`Placement` per mesh dim. Raises :class:`~vescale.core.errors.PlanError` naming the section and the
    entry: unknown section, old ``"forward"`` section (with the new spelling), non-string pattern, a bare placements
    list where a per-argument list belongs (with the wrapped spelling), a root ``local`` entry, items that are not
    placements.
    """
    if not isinstance(plan, Mapping):
        raise PlanError(f"a plan is a dict with sections {list(SECTIONS)}, got {type(plan).__name__}")
    if "forward" in plan:
        raise PlanError(_old_format_message(plan["forward"]))
    unknown = [k for k in plan if k not in SECTIONS]
    if unknown:
        raise PlanError(f"unknown plan section(s) {unknown}; a plan has sections {list(SECTIONS)}")
    checked = CheckedPlan()
    for name in SECTIONS:
        section = plan.get(name, {})
        if not isinstance(section, Mapping):
            raise PlanError(f"plan section {name!r} must be a dict of FQN patterns to values, got "
                            f"{type(section).__name__}")
        for pattern, value in section.items():
            where = f"plan section {name!r}, entry {pattern!r}"
            if not isinstance(pattern, str):
                raise PlanError(f"{where}: a pattern is a regex string (\"\" for the root module), got "
                                f"{type(pattern).__name__}")
            if name == "parameter":
                if isinstance(value, (str, Placement)) or not isinstance(value, Sequence):
                    raise PlanError(f"{where}: a parameter entry is a list with one Placement per mesh dim, got "
                                    f"{value!r}")
                checked.parameter[pattern] = value
                continue
            if name == "local" and pattern == "":
                raise PlanError(f"{where}: the root module cannot be local; name a submodule")
            getattr(checked, name)[pattern] = _check_arguments(value, mesh, where=where, section=name)
    return checked


def _check_arguments(value: Any, mesh, *, where: str, section: str) -> Arguments:
    what = "output" if section == "output" else "argument"
    if isinstance(value, Mapping):
        out: dict = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise PlanError(f"{where}: keyword names are strings, got {key!r}")
            out[key] = _check_item(item, mesh, where=f"{where}, {what} {key!r}")
        return out
    if isinstance(value, Sequence) and not isinstance(value, str):
        if any(isinstance(v, Placement) for v in value):
            raise PlanError(f"{where}: {_show(value)} is a bare placements list, but an entry of section {section!r} "
                            f"has one item per {what}; for the first {what} write {_show([value])}")
        return [_check_item(item, mesh, where=f"{where}, {what} {i}") for i, item in enumerate(value)]
    raise PlanError(f"{where}: expected a list (one item per positional {what}) or a dict (one per keyword) of "
                    f"placements lists, got {value!r}")


def _check_item(item: Any, mesh, *, where: str) -> tuple[Placement, ...] | None:
    if item is None:
        return None
    if isinstance(item, (str, Placement)) or not isinstance(item, Sequence):
        raise PlanError(f"{where}: placements must be a list with one Placement per mesh dim (or None), got "
                        f"{item!r}")
    for i, p in enumerate(item):
        if not isinstance(p, Placement):
            raise PlanError(f"{where}: item {i} of {_show(item)} is {p!r}, not a Placement")
    if mesh is not None and len(item) != mesh.ndim:
        raise PlanError(f"{where}: {len(item)} placement(s) {_show(item)} for the {mesh.ndim}-dim "
                        f"{mesh_description(mesh)}; give exactly one per mesh dim (Replicate() on the dims you do "
                        "not shard)")
    return tuple(item)


def _show(value: Any) -> str:
    """Nested placements lists as a plan author writes them: ``[[Shard(dim=1)], None]``."""
    if isinstance(value, Sequence) and not isinstance(value, str):
        return "[" + ", ".join(_show(v) for v in value) + "]"
    return repr(value)


def _old_format_message(forward: Any) -> str:
    """The refusal of a ``{"forward": {"X.input": ...}}`` plan, with its entries spelled in the grammar."""
    lines = []
    for key in forward if isinstance(forward, Mapping) else ():
        head, _, kind = str(key).rpartition(".")
        if kind not in BOUNDARY_SECTIONS:
            head, kind = str(key), "input"
        lines.append(f"    {key!r} -> plan[{kind!r}][{head.removesuffix(chr(92))!r}]")
    shown = "\n".join(lines[:8]) + ("\n    ..." if len(lines) > 8 else "")
    return ("plan section 'forward' is the old format and is not read any more: module boundaries now have their "
            "own sections {'input': {MODULE_REGEX: ...}, 'output': {...}, 'local': {...}}, with '' for the root "
            "module; each value is a list with one item per argument/output (or a dict per keyword), e.g. "
            "{'output': {'proj': [[Shard(1)]]}}" + (f". Your entries:\n{shown}" if lines else ""))


def mesh_description(mesh: Any) -> str:
    """``mesh(dp=2, tp=4)``: a mesh as error messages and reports name it."""
    names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
    return "mesh(" + ", ".join(f"{n}={s}" for n, s in zip(names, mesh.shape)) + ")"
