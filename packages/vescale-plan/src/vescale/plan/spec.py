"""``ParallelSpec``: a whole parallelization as plain data, with the rules that refuse what cannot be built.

A spec says which mesh dims a job runs on and how each parallelism is applied (ZeRO stage, dtypes, the tensor-parallel
plan, pipeline schedule and split, gradient accumulation, activation checkpointing, compile). It round-trips through
JSON (:meth:`ParallelSpec.to_json` / :meth:`ParallelSpec.from_json`), so the planner can print one, a person can edit
it, and ``tools/train.py --spec FILE`` or :func:`vescale.plan.build` can take it. :meth:`ParallelSpec.problems` lists
every reason the spec cannot be built for a batch and sequence length, each in one sentence naming the fields; it
needs no process group, so a launcher checks a spec before any rank starts.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields

from vescale.core.errors import MeshError, PlanError
from vescale.core.mesh import CANONICAL_DIM_ORDER, batch_size_of, hsdp_pair

__all__ = ["ParallelSpec", "SpecError", "DTYPES", "CHECKPOINTING"]

#: ``dtype`` / ``reduce_dtype`` values and their torch dtype names.
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
#: ``activation_checkpointing`` values (``vescale.parallel.checkpoint_activations`` policies).
CHECKPOINTING = ("none", "full", "selective")
#: Schedules whose split backward (BI / BW actions) no autograd-hook reducer (FSDP2) or experts operator survives.
_SPLIT_BACKWARD = ("zb_h1", "zbv")


class SpecError(PlanError):
    """A :class:`ParallelSpec` that cannot be built; the message lists every reason."""


@dataclass
class ParallelSpec:
    """How one job is parallelized; every field is plain data.

    - ``mesh``: named dims and sizes (``{"pp": 2, "dp": 2, "tp": 2}``; HSDP names ``dp_replicate`` and ``dp_shard``
      instead of ``dp``); their product is the world size; empty for one rank.
    - ``zero``: 0 (DDP), 1 (optimizer state sharded over dp), 2 (+ gradients), 3 (+ parameters, FSDP2).
    - ``dtype``: ``fp32`` or ``bf16`` (bf16 parameters and compute over fp32 masters); ``reduce_dtype``: the dtype
      gradients are accumulated and reduced in with bf16.
    - ``tp_plan``: ``"auto"`` (:func:`vescale.plan.auto_plan`), a family of ``vescale.parallel.PLANS``
      (``"llama"``, ``"gpt"``, ...), or a plan dict (not JSON-able); ``sequence_parallel``.
    - ``schedule``, ``microbatches`` (per accumulation step; 0: two per pp rank), ``split_points`` (module FQNs
      that start stages 1.., or None to balance by parameters): the pipeline, used when ``pp > 1``.
    - ``grad_accum``: micro-steps per optimizer step (each over an equal slice of every data rank's rows; with a
      pipeline, one engine step over that many times the microbatches).
    - ``activation_checkpointing``: ``none``, ``full`` or ``selective``; ``compile``: torch.compile each block.
    - ``optimizer_state_dtype``: ``fp32`` or ``bf16``: the dtype :meth:`Parallelized.make_optimizer`'s optimizer
      keeps its state (AdamW moments, momenta) in between steps; master weights stay fp32
      (``vescale.parallel.low_precision_state``).
    - ``fp8``: ``none``, ``tensorwise`` or ``rowwise``: the hidden linears become torchao ``Float8Linear`` s before
      any split (``vescale.parallel.float8_linears``; under ZeRO 3 with tensorwise and tp 1 their weights are
      all-gathered in fp8); refused where it does not compose (``vescale.parallel.fp8_problems``).
    - ``document_mask``: packed rows with document ids (``Parallelized.forward_backward(..., documents=)``): each
      token attends only within its document, positions restarting per document (``vescale.plan.documents``); a
      pipeline is captured with those inputs.
    """

    mesh: dict[str, int] = field(default_factory=dict)
    zero: int = 0
    dtype: str = "fp32"
    reduce_dtype: str = "fp32"
    tp_plan: str | dict = "auto"
    sequence_parallel: bool = False
    schedule: str = "1f1b"
    microbatches: int = 0
    split_points: list[str] | None = None
    grad_accum: int = 1
    activation_checkpointing: str = "none"
    compile: bool = False
    optimizer_state_dtype: str = "fp32"
    fp8: str = "none"
    document_mask: bool = False

    # -- derived sizes ----------------------------------------------------------------------------------------------

    def size(self, dim: str) -> int:
        """The size of mesh dim ``dim`` (1 when not named)."""
        return int(self.mesh.get(dim, 1))

    @property
    def world_size(self) -> int:
        return math.prod(self.mesh.values()) if self.mesh else 1

    @property
    def batch_ranks(self) -> int:
        """How many ranks split the global batch (dp or HSDP's pair, times ep; see ``vescale.core.MeshRoles``)."""
        return batch_size_of(self.mesh)

    @property
    def pipeline_microbatches(self) -> int:
        """Microbatches of one engine step: ``microbatches`` (default two per pp rank) per accumulation step."""
        return (self.microbatches or 2 * self.size("pp")) * self.grad_accum

    # -- JSON -----------------------------------------------------------------------------------------------------

    def to_json(self, indent: int | None = 2) -> str:
        """The spec as JSON; raises :class:`SpecError` when ``tp_plan`` is a plan dict (placements are objects)."""
        if not isinstance(self.tp_plan, str):
            raise SpecError("tp_plan is a plan dict, which JSON cannot hold: name a family or 'auto' to save the spec")
        return json.dumps(asdict(self), indent=indent)

    @classmethod
    def from_json(cls, text: str) -> ParallelSpec:
        """A spec from :meth:`to_json`'s text; raises :class:`SpecError` naming an unknown or mistyped field."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise SpecError(f"a parallelism spec must be a JSON object: {exc}") from None
        if not isinstance(data, dict):
            raise SpecError(f"a parallelism spec must be a JSON object, got {type(data).__name__}")
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise SpecError(f"unknown parallelism spec field(s) {unknown}; the fields are {sorted(known)}")
        default = cls()
        for name, value in data.items():
            expected = type(getattr(default, name))
            if name in ("split_points", "tp_plan"):
                continue
            if isinstance(value, bool) != (expected is bool) or not isinstance(value, expected):
                raise SpecError(f"spec field {name!r} must be a {expected.__name__}, got {value!r}")
        spec = cls(**data)
        spec.mesh = {str(k): v for k, v in spec.mesh.items()}
        return spec

    # -- refusals -------------------------------------------------------------------------------------------------

    def problems(self, *, batch_size: int | None = None, seq_len: int | None = None) -> list[str]:
        """Every reason this spec cannot be built (empty when it can), for a global batch of ``batch_size`` sequences
        of ``seq_len`` tokens when given. Pure: no process group, no model."""
        out = self._mesh_problems()
        if out:
            return out
        out += self._value_problems()
        out += _data_parallel_problems(self)
        out += _pipeline_problems(self)
        out += _context_parallel_problems(self, seq_len)
        out += _fp8_problems(self)
        out += _expert_parallel_problems(self)
        if batch_size is not None:
            out += _batch_problems(self, batch_size)
        if seq_len is not None and self.sequence_parallel and seq_len % self.size("tp"):
            out.append(f"seq_len {seq_len} is not divisible by tp={self.size('tp')} (sequence parallel)")
        return out

    def check(self, *, batch_size: int | None = None, seq_len: int | None = None) -> None:
        """Raise :class:`SpecError` listing :meth:`problems`, if any."""
        problems = self.problems(batch_size=batch_size, seq_len=seq_len)
        if problems:
            raise SpecError("the parallelism spec cannot be built:\n  " + "\n  ".join(problems))

    def _mesh_problems(self) -> list[str]:
        out = [f"mesh dim {name!r} is not one of {list(CANONICAL_DIM_ORDER)}" for name in self.mesh
               if name not in CANONICAL_DIM_ORDER]
        out += [f"mesh dim {name}={size!r} must be a positive integer" for name, size in self.mesh.items()
                if isinstance(size, bool) or not isinstance(size, int) or size < 1]
        return out

    def _value_problems(self) -> list[str]:
        out = []
        for name, allowed in (("dtype", DTYPES), ("reduce_dtype", DTYPES), ("optimizer_state_dtype", DTYPES),
                              ("activation_checkpointing", CHECKPOINTING)):
            if getattr(self, name) not in allowed:
                out.append(f"{name} {getattr(self, name)!r} is not one of {list(allowed)}")
        if self.reduce_dtype != "fp32" and self.dtype == "fp32":
            out.append(f"reduce_dtype {self.reduce_dtype} needs dtype bf16 (fp32 parameters reduce in fp32)")
        if self.zero not in (0, 1, 2, 3):
            out.append(f"zero {self.zero!r} is not a ZeRO stage (0, 1, 2 or 3)")
        if not isinstance(self.grad_accum, int) or self.grad_accum < 1:
            out.append(f"grad_accum {self.grad_accum!r} must be at least 1")
        if not isinstance(self.microbatches, int) or self.microbatches < 0:
            out.append(f"microbatches {self.microbatches!r} must be 0 (two per pp rank) or more")
        if not isinstance(self.tp_plan, (str, dict)):
            out.append(f"tp_plan must be 'auto', a family name or a plan dict, got {type(self.tp_plan).__name__}")
        return out


def _data_parallel_problems(spec: ParallelSpec) -> list[str]:
    """ZeRO 3 and HSDP (``vescale.parallel.fully_shard_dp`` / ``fully_shard_stage``)."""
    out = []
    try:
        hsdp = hsdp_pair(spec.mesh)
    except MeshError as exc:
        hsdp = None
        out.append(f"mesh {_mesh_text(spec)}: {exc}, e.g. dp_replicate=2,dp_shard=2,tp=2")
    if hsdp and spec.zero != 3:
        out.append(f"mesh {_mesh_text(spec)} is an HSDP mesh ({' x '.join(hsdp)}): it needs zero 3 (for ZeRO "
                   f"{spec.zero} name one dp={spec.size(hsdp[0]) * spec.size(hsdp[1])} instead)")
    if spec.zero == 3 and not hsdp and not out and spec.size("dp") * spec.size("cp") == 1:
        out.append(f"zero 3 shards parameters over the data-parallel ranks, and mesh {_mesh_text(spec)} has none: "
                   "name a dp dim (or dp_replicate and dp_shard), or use zero 0-2")
    if spec.zero == 3 and spec.size("pp") > 1 and spec.schedule in _SPLIT_BACKWARD:
        out.append(f"zero 3 with schedule {spec.schedule} is not supported: FSDP2 reduce-scatters a stage's "
                   "gradients in autograd hooks that a split backward (BI / BW) does not reach; use gpipe, 1f1b "
                   "or interleaved_1f1b, or zero 1 or 2")
    return out


def _pipeline_problems(spec: ParallelSpec) -> list[str]:
    if spec.size("pp") == 1:
        return []
    try:
        from vescale.pipe.schedule import schedule_names
    except ImportError:  # (vescale-pipe is a dependency of vescale-plan; kept optional for the pure check)
        return []
    names = schedule_names()
    return [] if spec.schedule in names else [f"schedule {spec.schedule!r} is not one of {names}"]


def _context_parallel_problems(spec: ParallelSpec, seq_len: int | None) -> list[str]:
    """What ``vescale.parallel.context_parallel`` composes with here."""
    cp = spec.size("cp")
    if cp == 1:
        return []
    out = []
    if seq_len is not None and seq_len % (2 * cp):
        out.append(f"seq_len {seq_len} is not divisible by 2 x cp = {2 * cp} (each sequence is cut into 2 x cp "
                   f"chunks, a head and a tail per cp rank)")
    other = sorted(set(spec.mesh) - {"pp", "dp", "cp", "tp"})
    if other or spec.compile:
        out.append(f"mesh {_mesh_text(spec)}: cp composes with pp, dp and tp (ZeRO 0-3, bf16, grad_accum, "
                   f"activation checkpointing); not with {', '.join(other) or 'ep/HSDP'}, or compile (cp under "
                   f"torch.compile is not verified against one device yet)")
    return out


def _fp8_problems(spec: ParallelSpec) -> list[str]:
    if spec.fp8 == "none":
        return []
    from vescale.core.launch import rank_device
    from vescale.parallel import fp8_problems

    return fp8_problems(spec.fp8, tp=spec.size("tp"), pp=spec.size("pp"), ep=spec.size("ep"), cp=spec.size("cp"),
                        device_type=rank_device().type)


def _expert_parallel_problems(spec: ParallelSpec) -> list[str]:
    """What ``vescale.parallel.parallelize_experts`` (dp x ep [x tp]) and the experts operator of pipeline stages
    (pp x [dp x] ep) compose with."""
    if spec.size("ep") == 1:
        return []
    out = []
    other = sorted(set(spec.mesh) - {"pp", "dp", "ep", "tp"})
    if other:
        out.append(f"ep composes with pp, dp and tp, not with {', '.join(other)}")
    if spec.zero == 3:
        out.append("ep with zero 3 is not supported (FSDP2 shards every parameter over dp, not composed with the "
                   "experts' Shard(0) over ep); use zero 1 or 2")
    if spec.compile:
        out.append("ep with compile is not supported (untested: the token dispatch's split sizes are data-dependent)")
    if spec.size("pp") > 1:
        if spec.size("tp") > 1:
            out.append("pp x ep x tp is not supported (a captured stage's tp DTensors would reach the experts' "
                       "dispatch operator, which takes plain tensors)")
        if spec.schedule in _SPLIT_BACKWARD:
            out.append(f"schedule {spec.schedule} is not supported with pp x ep (its split backward would re-run the "
                       "experts' operator, all-to-alls included, in the weight pass); use gpipe, 1f1b or "
                       "interleaved_1f1b")
    return out


def _batch_problems(spec: ParallelSpec, batch_size: int) -> list[str]:
    ranks, n, pp = spec.batch_ranks, spec.grad_accum, spec.size("pp")
    what = "dp x ep" if spec.size("ep") > 1 else "dp"
    if not isinstance(batch_size, int) or batch_size < 1:
        return [f"batch_size {batch_size!r} must be a positive number of sequences"]
    if batch_size % ranks:
        return [f"batch_size {batch_size} is not divisible by {what}={ranks}"]
    if not isinstance(n, int) or n < 1:
        return []
    if pp == 1 and batch_size % (ranks * n):
        return [f"batch_size {batch_size} is not divisible by {what}={ranks} x grad_accum {n} (each micro-step takes "
                f"an equal slice of every data rank's rows)"]
    if pp > 1 and (batch_size // ranks) % spec.pipeline_microbatches:
        per = spec.microbatches or 2 * pp
        how = f"{per} x grad_accum {n}" if n > 1 else "microbatches, by default 2 x pp"
        return [f"the per-data-rank batch {batch_size // ranks} is not divisible by {spec.pipeline_microbatches} "
                f"microbatches ({how})"]
    return []


def _mesh_text(spec: ParallelSpec) -> str:
    return ",".join(f"{k}={v}" for k, v in spec.mesh.items()) or "(one rank)"

