"""``build``: apply a :class:`~vescale.plan.spec.ParallelSpec` to an unmodified model, one parallelism at a time, in one
order, and return the training-loop interface (:class:`Parallelized`) that is the same on every mesh.

The order (each step a function of this module, skipped when its mesh dim or field is off):

1. ``dtype``: the model is cast to bf16 before anything splits it (ZeRO 3 without pp keeps fp32 masters in FSDP2);
   ``fp8``: its hidden linears become torchao ``Float8Linear`` s (``vescale.parallel.float8_linears``);
2. the model is laid out: pipeline stages (:func:`apply_pp`, tensor-parallel inside each, the cp attention and the
   experts operator installed before the split), or experts over ep (:func:`apply_ep`), or tensor parallel
   (:func:`apply_tp`), or a deferred model materialised (dp replicas share the init);
3. ``load_weights`` (the caller's, e.g. pretrained safetensors) fills what this rank holds;
4. activation checkpointing, then compile, then context parallelism (pp == 1);
5. data parallelism (:func:`apply_dp`): FSDP2 for ZeRO 3, else vescale DDP (ZeRO 2 shards its buffers), per stage
   with a pipeline.

Every mesh role (which ranks split the batch, average gradients, hold experts) comes from
:class:`vescale.core.MeshRoles`; nothing here derives one. Collectives: the wrappers' own (DDP's broadcast, FSDP2's
setup, the pipeline engine's), in the same order on every rank.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from vescale.core.launch import rank_device
from vescale.core.mesh import MeshRoles, init_mesh
from vescale.plan.spec import DTYPES, ParallelSpec, SpecError
from vescale.plan.token_mean import token_scale, token_sum

__all__ = ["build", "Parallelized", "apply_tp", "apply_ep", "apply_pp", "apply_dp", "resolve_tp_plan"]

LoadWeights = Callable[[list[nn.Module], bool], None]  # (modules this rank holds, whether they are pipeline stages)


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, DTYPES[name])


def _span(name: str):
    from vescale.pipe.timeline import span

    return span(name, cat=name)


@dataclass
class Parallelized:
    """What :func:`build` made on this rank, and all a training loop needs, whatever the mesh.

    ``modules``: the model as this rank holds it (one module, or its pipeline stages, unwrapped: what a checkpoint
    saves under ``"model"``); ``module``: what to call when ``pp == 1`` (the DDP or FSDP2 wrapper, or the model);
    ``engine``: the :class:`vescale.pipe.PipeEngine` when ``pp > 1``; ``ddp``: the DDP whose buffers hold the
    gradients (the stage's with a pipeline), or None; ``roles``: the mesh roles.
    """

    spec: ParallelSpec
    roles: MeshRoles
    modules: list[nn.Module]
    module: nn.Module | None = None
    engine: Any = None
    ddp: Any = None
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] | None = None
    report: Any = None  # the planner's ParallelReport, when vescale.plan.auto_parallelize chose the spec
    plan: dict | None = None  # the tensor-parallel plan applied (spec.tp_plan resolved), None without tp
    grad_norm: torch.Tensor | None = None  # the last clip_grad_norm_'s norm
    step_guard: Any = None  # make_optimizer(skip_nonfinite=True)'s vescale.parallel.StepGuard
    _cp_positions: torch.Tensor | None = None
    _experts: list = field(default_factory=list)  # pp x ep: the experts whose stages hold plain [E / ep, ...] rows
    _by_name: bool = False  # the model takes its token ids as ``input_ids=`` (transformers), where plans place them
    _input_name: str = "input_ids"  # the name of the model's token-id argument (a pipeline's stage 0 takes it by name)
    _token_scale: float | None = None  # this pipeline step's token_scale (None: every target position trained)

    @property
    def mesh(self):
        return self.roles.mesh

    @property
    def model(self) -> nn.Module | None:
        """The (unwrapped) model when ``pp == 1``; None with a pipeline (see :attr:`modules`)."""
        return self.modules[0] if self.engine is None else None

    @property
    def held(self) -> nn.Module | list[nn.Module]:
        """The (unwrapped) model as this rank holds it: the model, or its pipeline stages with pp."""
        return self.modules[0] if self.engine is None else self.modules

    @property
    def loss_scale(self) -> float:
        """What each rank multiplies its rows' mean loss by before backward when it runs ``module`` itself: ``1 /
        ep`` (each ep rank backpropagates its share; DDP averages over dp), else 1."""
        return 1.0 / self.roles.ep.size

    def shard_batch(self, batch: torch.Tensor) -> torch.Tensor:
        """This rank's rows (dim 0) of a global batch: what :meth:`forward_backward` takes."""
        return self.roles.shard_batch(batch)

    def parameters(self) -> list[nn.Parameter]:
        """The trainable parameters this rank holds (the pipeline stages', or the model's)."""
        if self.engine is not None:
            return self.engine.parameters()
        return [p for m in self.modules for p in m.parameters() if p.requires_grad]

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor, *,
                         num_tokens: int | torch.Tensor | None = None,
                         documents: torch.Tensor | None = None) -> torch.Tensor:
        """Forward and backward of this rank's rows (:meth:`shard_batch` of the global inputs and targets: token ids,
        given to the model as ``input_ids=`` when its ``forward`` names it, else positionally; targets -100 are
        ignored), with ``grad_accum`` micro-steps reduced once. The loss is one device's: the mean over the trained
        tokens of the whole global batch (:mod:`vescale.plan.token_mean`; ``num_tokens``, their count, saves its one
        scalar all-reduce over the batch ranks), so afterwards the gradients are one device's for the global batch,
        whatever the counts per rank, micro-step, microbatch or cp chunk. Returns this rank's detached share of that
        loss (:meth:`global_loss` of the shares is the global mean); with every position trained, the mean over its
        rows, computed as without ignored tokens.

        ``documents`` (with ``spec.document_mask``): the rows' document ids ``[B, S]`` (:meth:`shard_batch` of the
        global ones, e.g. :func:`vescale.plan.documents_from_eos`); each token attends only within its document,
        positions restarting per document (:func:`vescale.plan.document_inputs`: extra per-token model inputs, split
        with the rows into micro-steps and pipeline microbatches). Without them every row is one document."""
        extra = self._token_inputs(inputs, documents)
        scale = token_scale(targets, self.roles, num_tokens)
        if self.engine is not None:
            y = targets if self._cp_positions is None else targets[:, self._cp_positions]
            self._token_scale = scale  # read by build's stage_loss, every microbatch
            batch = {self._input_name: inputs, **extra} if extra else inputs
            return self._observed(self.engine.step(batch, y).detach() * self.roles.ep.size)
        n, total, ddp = self.spec.grad_accum, None, self.ddp
        fsdp = self.spec.zero == 3
        chunks = {k: v.chunk(n) for k, v in extra.items()}  # (per-token inputs: split as the rows are)
        for i, (x, y) in enumerate(zip(inputs.chunk(n), targets.chunk(n))):
            kw = {k: v[i] for k, v in chunks.items()}
            last = i == n - 1
            if fsdp:  # FSDP2 reduce-scatters only in the last micro-step's backward
                self.module.set_requires_gradient_sync(last)
            with ddp.no_sync() if ddp is not None and not last else contextlib.nullcontext():
                if self._cp_positions is not None:  # this cp rank's positions: its loss is its share of the rows'
                    y = y[:, self._cp_positions]
                with _span("forward"):
                    output = self.module(input_ids=x, **kw) if self._by_name else self.module(x, **kw)
                    loss = self.loss_fn(output, y) / n if scale is None else token_sum(self.loss_fn, output, y) * scale
                with _span("backward"):
                    (loss * self.loss_scale).backward()
                    if ddp is not None and last:
                        ddp.finish_grad_sync()
            total = loss.detach() if total is None else total + loss.detach()
        return self._observed(total)

    def _token_inputs(self, inputs: torch.Tensor, documents: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """The model's extra per-token inputs for ``documents`` (none without a document mask); a pipeline captured
        with them gets one document per row when none are given."""
        from vescale.plan.documents import document_inputs

        if documents is None and not (self.spec.document_mask and self.engine is not None):
            return {}
        if not self.spec.document_mask:
            raise SpecError("forward_backward got documents but spec.document_mask is off (a pipeline is captured "
                            "with the model's document inputs only when it is on): set document_mask=True")
        if documents is None:
            documents = torch.zeros_like(inputs)
        if documents.shape != inputs.shape:
            raise SpecError(f"documents {tuple(documents.shape)} do not match the inputs {tuple(inputs.shape)}")
        # (a pipeline's stages are graphs captured once, on every rank from the same example, with position_ids
        # only: they take what they were captured with, and no rank can choose another mask path in them)
        return document_inputs(documents.to(inputs.device), transformers_style=self._by_name,
                               explicit_mask=self._by_name and self.roles.ep.size > 1 and self.engine is None)

    def _observed(self, loss: torch.Tensor) -> torch.Tensor:
        if self.step_guard is not None:  # a non-finite loss skips the next optimizer step on every rank
            self.step_guard.observe_loss(loss)
        return loss

    def global_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The global batch's mean loss from every rank's :meth:`forward_backward` value: the mean over the ranks
        that average dense gradients (dp x cp x ep). A collective over them."""
        role = self.roles.dense_grads
        if role.size == 1:
            return loss
        loss = loss.clone()
        dist.all_reduce(loss, group=role.group)
        return loss / role.size

    def make_optimizer(self, optimizer_cls: type, *, param_groups: Callable[[list], list] | None = None,
                       clip_grad: float | None = None, rest: tuple[type, dict] | None = None,
                       matrices: Callable[[str, nn.Parameter], bool] | None = None, skip_nonfinite: bool = False,
                       max_bad_steps: int | None = 3, **kw: Any):
        """The optimizer this spec calls for: ``optimizer_cls(groups, **kw)`` over :meth:`parameters`
        (``param_groups(params)`` shapes the groups), inside :class:`vescale.parallel.DistributedOptimizer` for ZeRO
        1/2 and bf16 masters (fp32 masters and state), plain otherwise (ZeRO 3: over FSDP2's shards). With
        ``clip_grad`` every step first clips the gradient norm to it, computed as one device's (over dp, tp, ep and
        pp); the norm is kept in :attr:`grad_norm` (or the DistributedOptimizer's). The spec's
        ``optimizer_state_dtype`` (``bf16``) keeps every optimizer state tensor in bf16 between steps, masters fp32
        (:func:`vescale.parallel.low_precision_state`, on the ZeRO pieces, FSDP2's shards or the matrices' owners).

        A matrix optimizer (``torch.optim.Muon`` or a subclass) takes the hidden 2-D weights (``matrices(fqn, p)``,
        default :func:`vescale.parallel.hidden_matrices`: not embeddings nor the head) with ``**kw``; the other
        parameters go to ``rest = (cls, kwargs)`` (default AdamW with ``kw``'s ``lr``), grouped by
        ``param_groups``. It is stepped by whole-matrix owners (:mod:`vescale.parallel.muon`): a
        ``DistributedMatrixOptimizer`` for ZeRO 1/2 and bf16 (fp32 masters), else a ``MatrixOptimizer`` (ZeRO 0,
        ZeRO 3 over FSDP2's fp32 shards); gradients in fp32.

        ``skip_nonfinite``: every rank skips a step whose loss (from :meth:`forward_backward`) or gradients are not
        finite on any rank (:func:`vescale.parallel.skip_nonfinite_steps`: one one-element all-reduce over the world
        per step); more than ``max_bad_steps`` such steps in a row raise
        :class:`vescale.parallel.NonFiniteStepError`. The guard is :attr:`step_guard` (its ``skipped`` count)."""
        from vescale.parallel import DistributedOptimizer, low_precision_state

        if skip_nonfinite:  # the same optimizer, its step guarded
            opt = self.make_optimizer(optimizer_cls, param_groups=param_groups, clip_grad=clip_grad, rest=rest,
                                      matrices=matrices, **kw)
            from vescale.parallel import skip_nonfinite_steps

            self.step_guard = skip_nonfinite_steps(opt, max_consecutive=max_bad_steps)
            return opt
        params = self.parameters()
        if isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Muon):
            return self._make_matrix_optimizer(optimizer_cls, params, param_groups, clip_grad, rest, matrices, kw)
        inner = optimizer_cls(param_groups(params) if param_groups is not None else params, **kw)
        if self.ddp is not None and (self.spec.zero in (1, 2) or self.spec.dtype != "fp32"):
            return DistributedOptimizer(self.ddp, inner, zero_stage=self.spec.zero, clip_grad=clip_grad,
                                        pp_group=self.roles.pp.group, state_dtype=self.spec.optimizer_state_dtype)
        low_precision_state(inner, self.spec.optimizer_state_dtype)
        if clip_grad:
            def clip(*_: Any) -> None:
                self.clip_grad_norm_(clip_grad)

            inner.register_step_pre_hook(clip)
        return inner

    def _make_matrix_optimizer(self, cls: type, params: list, param_groups, clip_grad, rest, matrices, kw):
        from vescale.parallel import DistributedMatrixOptimizer, MatrixOptimizer, hidden_matrices

        if self.spec.dtype != "fp32" and self.spec.reduce_dtype != "fp32":
            raise SpecError(f"{cls.__name__} through make_optimizer needs fp32 gradients; spec reduce_dtype is "
                            f"{self.spec.reduce_dtype!r}")
        if self.roles.ep.size > 1:
            raise SpecError(f"{cls.__name__} through make_optimizer does not support ep={self.roles.ep.size}")
        names = {}
        for module in self.modules:
            hidden = set(hidden_matrices(module))
            for name, p in module.named_parameters():
                if matrices(name, p) if matrices is not None else name in hidden:
                    names.setdefault(id(p), name)
        mats = [p for p in params if id(p) in names]
        others = [p for p in params if id(p) not in names]
        rest_cls, rest_kw = rest if rest is not None else (torch.optim.AdamW, {"lr": kw.get("lr", 1e-3)})
        matrix = cls(mats, **kw)
        other = rest_cls(param_groups(others) if param_groups is not None else others, **rest_kw)
        if self.ddp is not None and (self.spec.zero in (1, 2) or self.spec.dtype != "fp32"):  # (bf16: fp32 masters)
            return DistributedMatrixOptimizer(self.ddp, matrix, other, zero_stage=self.spec.zero,
                                              clip_grad=clip_grad, pp_group=self.roles.pp.group,
                                              state_dtype=self.spec.optimizer_state_dtype)
        shard_dim = "dp_shard" if "dp_shard" in self.spec.mesh else "dp"  # HSDP: replicas step alike
        opt = MatrixOptimizer(self.modules, matrix, other,
                              dp_dim=shard_dim if self.spec.zero == 3 else "_none_", tp_dim="tp",
                              state_dtype=self.spec.optimizer_state_dtype)
        if clip_grad:
            opt.register_step_pre_hook(lambda *_: self.clip_grad_norm_(clip_grad))
        return opt

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip this rank's gradients to a global norm of ``max_norm`` (one device's norm); returns the norm.
        Collective over every rank holding a piece (use it with plain optimizers; DistributedOptimizer clips its
        own fp32 pieces)."""
        from vescale.parallel import clip_grad_norm_

        self.grad_norm = clip_grad_norm_(self.parameters(), max_norm, pp_group=self.roles.pp.group)
        return self.grad_norm

    def state(self, optimizer=None) -> dict:
        """What a checkpoint saves and loads (any other mesh loads it): ``{"model": ..., "optim": optimizer}``, the
        model as :attr:`modules` holds it (with pp x ep the stages' plain expert rows are marked as boxes of the global
        tensors, which a checkpoint, the optimizer's sharded state and a plain optimizer's state follow). A LoRA
        model's ``"model"`` is its adapters only (:func:`vescale.plan.lora.adapter_state`)."""
        from vescale.plan.lora import adapter_state, has_adapters

        model = self.held
        if has_adapters(model):  # a LoRA model: its adapters (the base stays as loaded)
            model = adapter_state(model)
        return {"model": model} if optimizer is None else {"model": model, "optim": optimizer}

    def grads(self) -> dict[str, torch.Tensor]:
        """This rank's data-averaged gradients by parameter FQN of the unwrapped model (every name of a tied one),
        laid out as the parameters are (DTensors over tp, or plain); pp x ep's local experts gathered over ep. A
        collective over dp with ZeRO 2 (and over ep for pp x ep): call it on every rank."""
        reduced = None
        if self.ddp is not None:
            by_fqn = self.ddp.reduced_grads()
            reduced = {id(slot.param): by_fqn[slot.fqn] for slot in self.ddp.slots.values()}
        out = {}
        for module in self.modules:
            for name, p in module.named_parameters(remove_duplicate=False):
                grad = p.grad if reduced is None else reduced.get(id(p))
                if grad is not None:
                    out[name] = grad
        ep = self.roles.ep
        for name in sorted(set(out) & {fqn for info in self._experts for fqn in info.params}):
            parts = [torch.empty_like(out[name]) for _ in range(ep.size)]
            dist.all_gather(parts, out[name].contiguous(), group=ep.group)
            out[name] = torch.cat(parts)
        return out


def resolve_tp_plan(model: nn.Module, spec: ParallelSpec, mesh, *, sequence_parallel: bool | None = None) -> dict:
    """The plan dict of ``spec.tp_plan`` over ``mesh``: a dict as is, a family of ``vescale.parallel.PLANS``, or
    ``"auto"`` (:func:`vescale.plan.auto_plan` of ``model``, deferred or on the meta device). For a LoRA (peft) model
    the plan is the unwrapped model's, keyed by the PEFT names with the adapters derived
    (:func:`vescale.plan.lora.lora_plan`)."""
    from vescale.parallel import PLANS
    from vescale.plan.lora import is_lora_model, lora_plan

    sp = spec.sequence_parallel if sequence_parallel is None else sequence_parallel
    if isinstance(spec.tp_plan, dict):
        plan = spec.tp_plan
    elif spec.tp_plan in PLANS:
        plan = PLANS[spec.tp_plan](mesh, dp=None, sequence_parallel=sp)
    elif spec.tp_plan != "auto":
        raise SpecError(f"tp_plan {spec.tp_plan!r} is neither 'auto', a plan dict, nor a family of "
                        f"vescale.parallel.PLANS ({sorted(PLANS)})")
    else:  # (auto_plan derives a LoRA model's adapters itself)
        from vescale.plan.auto_plan import auto_plan

        return auto_plan(model, mesh, sequence_parallel=sp, dp=None)
    return lora_plan(model, plan, mesh) if is_lora_model(model) else plan


def apply_tp(model: nn.Module, roles: MeshRoles, plan: dict) -> nn.Module:
    """Shard ``model`` over tp by ``plan`` (a deferred model goes straight into its shards)."""
    from vescale.parallel import parallelize_module

    return parallelize_module(model, roles.tp.mesh, plan)


def apply_ep(model: nn.Module, roles: MeshRoles, plan: dict | None) -> nn.Module:
    """The experts over ep (``Shard(0)``), attention and each expert's FFN by ``plan`` (tp > 1), on the model's own
    mesh (ep [x tp])."""
    from vescale.parallel import parallelize_experts

    return parallelize_experts(model, roles.model, plan)


def apply_pp(model: nn.Module, roles: MeshRoles, spec: ParallelSpec, plan: dict | None, *, loss_fn,
             example_inputs, device=None):
    """Split ``model`` into pipeline stages; build (tp-shard by ``plan``'s parameter entries, compile) only this
    rank's; return the engine. The stages reduce their own gradients (:func:`apply_dp` wraps each), so the engine
    has no flat dp all-reduce."""
    from vescale.plan.pipeline import build_pipeline

    return build_pipeline(model, roles.pp.mesh, schedule=spec.schedule, num_microbatches=spec.pipeline_microbatches,
                          loss_fn=loss_fn, example_inputs=example_inputs, split_points=spec.split_points,
                          tp_mesh=roles.tp.mesh, plan=plan, device=device, compile=spec.compile)


def _needs_ddp(spec: ParallelSpec, roles: MeshRoles) -> bool:
    """vescale DDP holds the gradients: to reduce them over data ranks, to shard them (ZeRO 1/2), or as the fp32
    buffer bf16 masters step with. With ep it needs a dp dim (its groups are dp x ep); without one the experts'
    DTensors sum the dense gradients over ep themselves."""
    if spec.zero == 3:
        return False
    if roles.ep.size > 1:
        return "dp" in roles.mesh.mesh_dim_names
    return roles.dense_grads.size > 1 or spec.zero in (1, 2) or spec.dtype != "fp32"


def _ddp(module: nn.Module, roles: MeshRoles, spec: ParallelSpec):
    """vescale DDP over the dense-gradient role; with ep over the whole mesh, whose ep dim DDP sums dense gradients
    over (experts averaged over dp). A pipeline stage's DDP learns its tied weights from the engine
    (``vescale.pipe.StageGradSync``)."""
    from vescale.parallel import DDPOptions, DistributedDataParallel

    options = DDPOptions(zero_stage=spec.zero, grad_dtype=_dtype(spec.reduce_dtype))
    return DistributedDataParallel(module, roles.mesh if roles.ep.size > 1 else roles.dense_grads.mesh, options)


def apply_dp(model: nn.Module, roles: MeshRoles, spec: ParallelSpec, *, engine=None, experts=None):
    """Data parallelism: ZeRO 3 as FSDP2 (per block, or one unit per pipeline stage), else vescale DDP when
    :func:`_needs_ddp`; with a pipeline each of this rank's stages gets its own wrapper (``engine.wrap_stages``).
    Returns the DDP holding the gradients (the stage's), or None."""
    from vescale.parallel import fully_shard_dp, fully_shard_stage
    from vescale.parallel.zero3 import bf16_policy

    policy = bf16_policy(_dtype(spec.reduce_dtype)) if spec.dtype == "bf16" else None
    if spec.zero == 3:
        if engine is None:
            fully_shard_dp(model, roles.fsdp, mp_policy=policy)
        else:  # the stage was captured in bf16: its parameters become fp32 masters before sharding
            master = torch.float32 if policy is not None else None
            engine.wrap_stages(lambda i, stage: fully_shard_stage(stage, roles.fsdp, mp_policy=policy,
                                                                  master_dtype=master))
        return None
    if not _needs_ddp(spec, roles):
        return None
    if engine is None:
        return _ddp(model, roles, spec)
    wrappers = []

    def wrap(index: int, stage: nn.Module) -> nn.Module:
        if experts:  # this ep rank keeps its experts' rows as plain [E / ep, ...] parameters, marked pieces over ep
            from vescale.parallel import keep_local_experts

            keep_local_experts(stage, experts, roles.mesh)
        wrappers.append(_ddp(stage, roles, spec))
        return wrappers[-1]

    engine.wrap_stages(wrap)
    return wrappers[0] if wrappers else None


def build(model: nn.Module, spec: ParallelSpec, mesh=None, *, loss_fn=None, batch_size: int | None = None,
          seq_len: int | None = None, example_inputs: Any = None, device: torch.device | str | None = None,
          load_weights: LoadWeights | None = None) -> Parallelized:
    """Parallelize ``model`` (unmodified; plain, or recorded by ``vescale.dtensor.deferred_init``) as ``spec`` says,
    on ``mesh`` (default: ``init_mesh(spec.mesh)``, none for one rank without a process group or named dims; pp x ep
    and ep with ZeRO or bf16 add ``dp=1`` for DDP's groups),
    and return the :class:`Parallelized` training interface.

    ``loss_fn(output, targets)``: the mean loss of a batch (default: next-token cross-entropy of the logits).
    ``batch_size`` (global, sequences) and ``seq_len``: checked against the spec; with pp they shape the
    microbatch the split is captured on, unless ``example_inputs`` (one microbatch) is given. ``device``: where the
    stages and batches live (default: this rank's). ``load_weights(modules, stages)``: fills what this rank holds
    after it is laid out and before data parallelism wraps it (under ZeRO 3 without pp: after FSDP2 sharded it).
    Raises :class:`SpecError` on every rank, before any collective, when the spec cannot be built.
    """
    from vescale.dtensor import is_deferred, materialize, record_deferred
    from vescale.parallel import checkpoint_activations, compile_parallel, context_parallel
    from vescale.parallel.context_parallel import local_positions
    from vescale.plan.auto_parallelize import language_model_loss

    spec.check(batch_size=batch_size, seq_len=seq_len)
    loss_fn = loss_fn or language_model_loss
    if mesh is None and (spec.world_size > 1 or (spec.mesh and dist.is_initialized())):
        dims = dict(spec.mesh)
        if spec.size("ep") > 1 and "dp" not in dims and (spec.size("pp") > 1 or spec.zero or spec.dtype != "fp32"):
            dims = {"dp": 1, **dims}  # DDP's groups are built over dp x ep
        mesh = init_mesh(dims)
    roles = MeshRoles.of(mesh)
    pp, ep, cp = roles.pp.size, roles.ep.size, roles.cp.size
    from vescale.plan.lora import is_lora_model, stacked_lora_layers

    if is_lora_model(model) and cp > 1:
        raise SpecError(f"a LoRA (peft) model on cp={cp} is refused: LoRA with context parallelism is not built "
                        "(a LoRA model runs on dp, tp, pp, ep and ZeRO 0-3); use cp=1")
    stacked = stacked_lora_layers(model) if ep > 1 else []
    if stacked:  # peft's ParamWrapper hides the experts from find_experts, and adapters [r * E, ...] have no ep rows
        raise SpecError(f"a LoRA (peft) model with adapters on the experts' stacked parameters ({stacked[0]!r}, "
                        f"peft target_parameters) is refused on ep={ep}: target the attention / dense projections "
                        f"only (target_modules), or use ep=1")
    if ep > 1 and "dp" not in roles.mesh.mesh_dim_names and (pp > 1 or spec.zero or spec.dtype != "fp32"):
        raise SpecError(f"mesh {roles.mesh.mesh_dim_names}: ep with pp, ZeRO or bf16 reduces through DDP over dp x "
                        "ep; give the mesh a dp dim (dp=1 will do)")
    if device is None:
        device = rank_device()
    if spec.dtype != "fp32" and (spec.zero != 3 or pp > 1):  # (ZeRO 3: FSDP2's policy casts fp32 shards)
        with record_deferred(model) if is_deferred(model) else contextlib.nullcontext():
            model.to(_dtype(spec.dtype))
    if spec.fp8 != "none":  # before any split: TP shards the Float8Linears' weights, FSDP2 gathers them
        from vescale.parallel import float8_linears

        if is_deferred(model):  # torchao swaps modules and wraps weights: ops deferred_init cannot record
            raise SpecError(f"fp8 {spec.fp8!r} needs an eagerly built model (tools/train.py --init eager); this one "
                            "is recorded by deferred_init")
        float8_linears(model, spec.fp8, tp=roles.tp.size,
                       fsdp_float8_all_gather=spec.fp8 == "tensorwise" and spec.zero == 3 and roles.tp.size == 1)
    from vescale.plan.lora import forward_parameters

    params = forward_parameters(model)  # (a task-less PeftModel: its inner model's names)
    out = Parallelized(spec, roles, [model], loss_fn=loss_fn, _by_name="input_ids" in params,
                       _input_name="input_ids" if "input_ids" in params else next(iter(params), "input_ids"))
    if spec.document_mask and not out._by_name and not {"positions", "documents"} <= set(params):
        raise SpecError(f"document_mask: {type(model).__name__}.forward takes neither input_ids= (a transformers "
                        f"model: restarting position_ids) nor positions= and documents= (the causal-attention hook), "
                        f"so its packed documents cannot be kept apart")
    if spec.document_mask and getattr(getattr(model, "config", None), "use_cache", False):
        model.config.use_cache = False  # transformers looks for packed rows (restarting positions) only without a cache
    cp_positions = None
    if cp > 1:
        if seq_len is None:
            raise SpecError("build needs seq_len with cp > 1 (each cp rank takes its positions of every row)")
        cp_positions = local_positions(seq_len, cp, roles.cp.rank).to(device)
    if pp > 1:
        if cp > 1:  # before the split: the captured stages call the cp attention operator
            context_parallel(model, roles.cp.mesh)
        experts = []
        if ep > 1:  # each experts module's dispatch becomes one operator the stage graphs keep whole
            from vescale.parallel.experts import experts_as_operator

            experts = experts_as_operator(model, roles.mesh)
        if example_inputs is None:
            if batch_size is None or seq_len is None:
                raise SpecError("build needs batch_size and seq_len (or example_inputs) with pp > 1")
            rows = batch_size // spec.batch_ranks // spec.pipeline_microbatches
            example_inputs = torch.zeros(rows, seq_len, dtype=torch.long, device=device)
            if spec.document_mask:  # stage 0 takes the tokens and the document inputs by name
                from vescale.plan.documents import document_inputs

                example_inputs = {out._input_name: example_inputs,
                                  **document_inputs(torch.zeros_like(example_inputs), transformers_style=out._by_name)}
        def stage_loss(o, t):  # each microbatch's share of the step's loss (/ M by the engine), / ep per ep rank
            if out._token_scale is None:
                return loss_fn(o, t) / ep
            return token_sum(loss_fn, o, t) * (out._token_scale * spec.pipeline_microbatches / ep)

        out.plan = resolve_tp_plan(model, spec, roles.tp.mesh, sequence_parallel=False) if roles.tp.size > 1 else None
        engine = apply_pp(model, roles, spec, out.plan, loss_fn=stage_loss, example_inputs=example_inputs,
                          device=device)
        held = list(engine.stages.values())
        if load_weights is not None:
            load_weights(held, True)
        if spec.activation_checkpointing != "none":  # a captured stage has no block modules: one region per stage
            for stage in held:
                checkpoint_activations(stage, spec.activation_checkpointing, whole=True)
        out.ddp = apply_dp(model, roles, spec, engine=engine, experts=experts)  # (wrappers keep the stage modules)
        out.engine, out.modules, out._experts, out._cp_positions = engine, held, experts, cp_positions
        return out
    if roles.tp.size > 1:  # (with ep: over the model's ep x tp mesh)
        out.plan = resolve_tp_plan(model, spec, roles.model if ep > 1 else roles.tp.mesh)
    if ep > 1:
        model = apply_ep(model, roles, out.plan)
    elif roles.tp.size > 1:
        model = apply_tp(model, roles, out.plan)
    elif is_deferred(model):  # dp replicas each compute 1/dp of the init, then all-gather it (weights: none)
        over = roles.dp.mesh if load_weights is None else None
        materialize(model, device=device, replicate_over=over)
    if load_weights is not None and spec.zero != 3:
        load_weights([model], False)
    if spec.activation_checkpointing != "none":  # before compile and DDP (see checkpoint_activations)
        checkpoint_activations(model, spec.activation_checkpointing)
    if spec.compile:
        compile_parallel(model)
    if cp > 1:  # every cp rank runs its head and tail chunks of each row; targets sliced alike
        context_parallel(model, roles.cp.mesh)
    out.ddp = apply_dp(model, roles, spec)
    if spec.zero == 3 and load_weights is not None:  # each rank reads only its ZeRO-3 (and tp) shard
        load_weights([model], False)
    out.modules, out.module, out._cp_positions = [model], out.ddp if out.ddp is not None else model, cp_positions
    return out

