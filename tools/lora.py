"""``tools/train.py --lora r=8,alpha=16,targets=q_proj,k_proj,v_proj,o_proj``: LoRA fine-tuning with ``peft``.

``parse_lora`` reads the flag; ``lora_problems`` refuses (before any rank starts) a target that matches no module of
the model, a model without a transformers class, the mesh LoRA does not run on yet (cp) and, with ``--export-hf``,
the layers the merge cannot merge (``merge_problems``); ``creator`` makes the PEFT model inside ``build_model``'s
creation (so deferred init records the adapters too); ``load_pretrained`` fills the frozen base weights from the
model directory under their unwrapped names (the model, or a pipeline rank's stages, which keep the PEFT names);
``export`` writes the merged model (through ``models.export_run``, the one HF exporter; each rank merges the layers it
holds, each adapter by the scaling its layer holds, as peft's ``merge_and_unload``) and the adapters in PEFT's own
format (``<DIR>/adapter``, what ``PeftModel.from_pretrained`` loads: every rank's adapters through a checkpoint,
written once by rank 0). Plans, checkpoints (adapters only) and the adapters' layout on any mesh are
``vescale.plan``'s (``vescale.plan.lora``).
"""

from __future__ import annotations

from pathlib import Path

import models
import torch
from torch import nn

__all__ = ["parse_lora", "lora_problems", "creator", "wrap", "lora_config", "load_pretrained", "merge_problems",
           "peft_names", "export", "ADAPTER_DIR"]

#: the adapters' directory inside ``--export-hf DIR``
ADAPTER_DIR = "adapter"
_KEYS = {"r": int, "alpha": float, "dropout": float, "targets": str}


def parse_lora(text: str | None) -> dict | None:
    """``{"r", "alpha", "dropout", "targets"}`` from ``r=8,alpha=16,targets=q_proj,k_proj[,dropout=0.05]`` (names
    after ``targets=`` without ``=`` are more targets); None for None. Raises ValueError naming a bad item."""
    if text is None:
        return None
    out: dict = {"r": 8, "alpha": 16.0, "dropout": 0.0, "targets": []}
    key = None
    for item in (s.strip() for s in text.split(",")):
        if not item:
            continue
        if "=" in item:
            key, _, value = item.partition("=")
            key = key.strip()
            if key not in _KEYS:
                raise ValueError(f"--lora: unknown key {key!r} in {item!r} (keys: {', '.join(_KEYS)})")
        elif key == "targets":
            value = item
        else:
            raise ValueError(f"--lora: {item!r} is not key=value (keys: {', '.join(_KEYS)})")
        if key == "targets":
            out["targets"].append(value.strip())
            continue
        try:
            out[key] = _KEYS[key](value)
        except ValueError:
            raise ValueError(f"--lora: {key}={value!r} is not a {_KEYS[key].__name__}") from None
    return out


def lora_problems(cfg) -> list[str]:
    """Why ``cfg.lora`` cannot run, one sentence each (no process group; the model built on the meta device)."""
    if cfg.lora is None:
        return []
    lora, out = cfg.lora, []
    if lora["r"] < 1 or lora["alpha"] <= 0 or not 0 <= lora["dropout"] < 1:
        out.append(f"--lora r={lora['r']}, alpha={lora['alpha']}, dropout={lora['dropout']}: r must be >= 1, alpha "
                   "> 0 and dropout in [0, 1)")
    if not lora["targets"]:
        out.append("--lora names no targets (targets=q_proj,k_proj,...)")
    if cfg.dims.get("cp", 1) > 1:
        out.append(f"--lora with cp={cfg.dims['cp']} is not supported yet (--lora runs on dp, tp, pp, ep and ZeRO 0-3)")
    if not (models.is_hf_dir(cfg.model) or cfg.model in models.HF_MODELS):
        out.append(f"--lora needs a transformers model (--model DIR or one of {sorted(models.HF_MODELS)}); "
                   f"{cfg.model} is not one")
        return out
    try:
        import peft  # noqa: F401
    except ImportError:
        return out + ["--lora needs the peft package (pip install peft)"]
    with torch.device("meta"):
        base = models.create(cfg.model)
    names = [n for n, _ in base.named_modules()]
    for target in lora["targets"]:
        if not any(n == target or n.endswith("." + target) for n in names):
            close = sorted({n.rsplit(".", 1)[-1] for n in names if n})
            out.append(f"--lora target {target!r} matches no module of {cfg.model} (its module names end in "
                       f"{', '.join(close[:20])})")
    if getattr(cfg, "export_hf", None) and not out:  # the merge's refusals, asked of the whole model (every rank)
        with torch.device("meta"):
            peft_model = wrap(base, lora)  # the same meta model, wrapped in place: built once
        out += [f"--export-hf with --lora: {p}" for p in merge_problems([peft_model])]
    return out


def creator(lora: dict | None):
    """``models.create``, or with ``lora`` a function making its PEFT model (:func:`wrap`)."""
    if lora is None:
        return models.create
    return lambda name: wrap(models.create(name), lora)


def wrap(model: nn.Module, lora: dict | None) -> nn.Module:
    """``model`` as a PEFT LoRA model (``get_peft_model``; base weights frozen, adapters trained), or as is."""
    if lora is None:
        return model
    from peft import get_peft_model

    return get_peft_model(model, lora_config(lora))


def lora_config(lora: dict):
    """The ``peft.LoraConfig`` of the ``--lora`` settings (what :func:`wrap` applies and the export records)."""
    from peft import LoraConfig

    return LoraConfig(r=lora["r"], lora_alpha=lora["alpha"], lora_dropout=lora["dropout"],
                      target_modules=list(lora["targets"]))


def _prefix(modules: list[nn.Module]) -> str:
    """The unwrapped model's FQN prefix in ``modules`` (a PEFT model, or pipeline stages, which keep its FQNs but not
    its wrapper: ``get_peft_model``'s ``base_model.model.`` read from the names)."""
    from vescale.plan.lora import inner_prefix

    prefix = inner_prefix(modules[0])
    if prefix:
        return prefix
    names = [n for m in modules for n, _ in m.named_parameters()]
    return "base_model.model." if names and all(n.startswith("base_model.model.") for n in names) else ""


def load_pretrained(src: str, modules: list[nn.Module], *, stages: bool = False,
                    tied: dict[str, str] | None = None) -> None:
    """``models.load_pretrained``; for a LoRA model (one module, or a pipeline rank's stages) the frozen base weights,
    read under the unwrapped model's names (each rank its own boxes; stages each their part, not strictly), the
    adapters left as initialised. ``tied`` (PEFT names): a stage holding the tied output embedding reads the input
    embedding's tensor. No communication."""
    from vescale.checkpoint import import_hf
    from vescale.plan.lora import base_fqn, has_adapters

    if not has_adapters(modules):
        models.load_pretrained(src, modules, stages=stages, tied=tied)
        return
    prefix = _prefix(modules)
    files = models.hf_weight_names(src)
    for module in modules:
        base = {base_fqn(n, prefix): t for n, t in module.state_dict().items() if ".lora_" not in n}
        # tensors the directory stores under other names (Mixtral's experts, one per expert): read, with a stage's
        # tied output embedding, by load_renamed_and_tied (the base tensors are views of the model's)
        stored = models.stored_names(src, {k: list(t.shape) for k, t in base.items()}, files)
        import_hf(src, {k: t for k, t in base.items() if k not in stored}, strict=not (stages or stored))
        # ``tied`` is keyed by PEFT names; only a stage can hold the output embedding without the input one
        base_tied = {name: base_fqn(tied[prefix + name], prefix) for name in base
                     if stages and prefix + name in (tied or {})}
        models.load_renamed_and_tied(src, base, files, stored, base_tied)


def merge_problems(modules: list[nn.Module]) -> list[str]:
    """Why the merged export cannot merge the PEFT layers of ``modules`` (a model or a rank's pipeline stages) the way
    peft's ``merge_and_unload`` does, one sentence each naming the module's FQN and the setting; empty when it can.
    Merged: peft LoRA ``Linear`` layers, each active adapter by its own ``scaling`` (``rank_pattern`` /
    ``alpha_pattern``, ``use_rslora``), ``lora_bias`` too. Refused: LoRA variants (DoRA ``use_dora``, ...),
    ``fan_in_fan_out``, LoRA on embeddings, convolutions, attention or parameters (``target_parameters``), other
    tuners, ``modules_to_save`` and trainable tokens. Pure: no communication (the same answer on every rank that holds
    the same layers; ``lora_problems`` asks it of the whole model before any rank starts)."""
    from peft.tuners.lora import Linear, LoraLayer
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import AuxiliaryTrainingWrapper

    out = []
    for module in modules:
        for fqn, m in module.named_modules():
            kind = type(m).__name__
            if isinstance(m, AuxiliaryTrainingWrapper):
                out.append(f"{fqn!r} is a peft {kind} (modules_to_save / trainable_token_indices): the merged export "
                           "does not write its trained copy")
            elif isinstance(m, BaseTunerLayer) and not isinstance(m, LoraLayer):
                out.append(f"{fqn!r} is a peft {kind}, not a LoRA layer: the merged export merges LoRA only")
            elif not isinstance(m, LoraLayer):
                continue
            elif not (isinstance(m, Linear) and type(m).merge is Linear.merge
                      and type(m).get_delta_weight is Linear.get_delta_weight):
                out.append(f"{fqn!r} is a peft LoRA {kind}: the merged export merges LoRA on linear layers only "
                           "(target_modules naming nn.Linear layers)")
            elif m.fan_in_fan_out:
                out.append(f"{fqn!r} has fan_in_fan_out (a [in, out] base weight): the merged export merges [out, in] "
                           "weights only")
            else:
                for adapter in _adapters_to_merge(m):
                    variant = m.lora_variant.get(adapter)
                    if variant is not None:
                        what = "DoRA (use_dora)" if m.use_dora.get(adapter) else type(variant).__name__
                        out.append(f"{fqn!r} adapter {adapter!r} is {what}: the merged export merges plain LoRA only")
                    elif m.lora_bias[adapter] and getattr(m.get_base_layer(), "bias", None) is None:
                        out.append(f"{fqn!r} adapter {adapter!r} has lora_bias but its base layer no bias")
    return out


def _adapters_to_merge(layer: nn.Module) -> list[str]:
    """The adapters of a LoRA layer that ``merge_and_unload`` merges: the active ones it holds, not merged yet."""
    return [a for a in layer.active_adapters if a in layer.lora_A and a not in layer.merged_adapters]


def _merged(modules: list[nn.Module], layers_of: nn.Module | None = None) -> dict[str, torch.Tensor]:
    """The base model's state held by ``modules`` (a model or a rank's pipeline stages) with each LoRA layer merged as
    peft's ``merge_and_unload`` merges it (``W + (B @ A) * scaling``, each active adapter by the ``scaling`` its layer
    holds; with ``lora_bias`` also ``bias + B.bias * scaling``), by the unwrapped names, laid out as the base weights
    are (the adapters' layout makes ``B @ A`` land on the base weight's placement; a layer's adapters live on its base
    layer's stage).

    ``layers_of``: the PEFT model whose LoRA layers (by FQN, as ``modules`` name them) hold each adapter's scaling and
    settings; default ``modules`` themselves. Pipeline stages hold the model's parameters but not its LoRA layer
    objects (peft's arithmetic is in their captured graph): pass the same PEFT model built on meta. Raises ValueError
    naming every layer :func:`merge_problems` refuses, or an adapter tensor no layer describes, before any
    collective. No communication (a DTensor ``B @ A`` of the adapters' layout needs none: ``vescale.plan.lora``)."""
    from peft.tuners.lora import LoraLayer

    from vescale.plan.lora import base_fqn

    source = modules if layers_of is None else [layers_of]
    problems = merge_problems(source)
    if problems:
        raise ValueError("--export-hf cannot merge these LoRA layers exactly (peft merge_and_unload):\n  "
                         + "\n  ".join(problems))
    layers = {fqn: m for root in source for fqn, m in root.named_modules() if isinstance(m, LoraLayer)}
    # the name prefixes of the adapter tensors some layer describes (``<fqn>.lora_A.<adapter>.``)
    described = {f"{fqn}.{kind}.{adapter}." for fqn, layer in layers.items() for adapter in layer.lora_A
                 for kind in ("lora_A", "lora_B")}
    prefix = _prefix(modules)
    merged: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for module in modules:
            state = module.state_dict()
            deltas: dict[str, list[torch.Tensor]] = {}  # a base weight's (or bias's) state_dict name -> what it gains
            for fqn, layer in layers.items():
                for adapter in _adapters_to_merge(layer):
                    a_name, b_name = f"{fqn}.lora_A.{adapter}.weight", f"{fqn}.lora_B.{adapter}.weight"
                    if a_name not in state:  # a layer of another stage
                        continue
                    a, b, scaling = state[a_name], state[b_name], layer.scaling[adapter]
                    if b.device.type == "cpu" and b.dtype in (torch.float16, torch.bfloat16):
                        delta = ((b.float() @ a.float()) * scaling).to(b.dtype)  # as peft: half matmuls on CPU in fp32
                    else:
                        delta = (b @ a) * scaling
                    deltas.setdefault(f"{fqn}.base_layer.weight", []).append(delta)
                    if layer.lora_bias[adapter]:
                        deltas.setdefault(f"{fqn}.base_layer.bias", []).append(
                            state[b_name.removesuffix(".weight") + ".bias"] * scaling)
            unknown = [n for n in state if ".lora_" in n and not _described(n, described)]
            if unknown:
                raise ValueError(f"--export-hf: adapter tensors {unknown[:4]} belong to no LoRA layer of the model the "
                                 "merge reads the scalings from")
            for name, t in state.items():
                if ".lora_" in name:
                    continue
                for delta in deltas.get(name, ()):  # in the adapters' order, as peft adds them in place
                    t = (t + delta).to(t.dtype)
                merged[base_fqn(name, prefix)] = t
    return merged


def _described(name: str, described: set[str]) -> bool:
    """Whether a prefix of ``name`` ending at a dot is in ``described``: one set lookup per dot of the name."""
    return any(name[:i + 1] in described for i, c in enumerate(name) if c == ".")


def peft_names(adapters: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Adapter tensors by PEFT's saved names (``...q_proj.lora_A.weight``: the adapter name ``default`` dropped, as
    ``get_peft_model_state_dict`` writes them)."""
    return {n.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B."): t
            for n, t in adapters.items()}


def export(cfg, model: nn.Module | list[nn.Module], out: Path, log=print) -> None:
    """``--export-hf DIR``: the trained model (a LoRA model merged) as ``from_pretrained`` loads it, and with
    ``--lora`` the adapters in PEFT's format under ``DIR/adapter``. ``model``: this rank's model or pipeline stages.
    Collective (every rank): the adapters go through a checkpoint (each rank saves what it holds, replicas once), which
    rank 0 reads whole and writes once. Each adapter merges by its layer's scaling (pipeline stages: the layers of the
    ``--lora`` PEFT model rebuilt on meta, the same on every rank); what the merge refuses (:func:`merge_problems`)
    raises ValueError before any collective."""
    import shutil

    import torch.distributed as dist

    from vescale import checkpoint
    from vescale.plan.lora import adapter_state, has_adapters

    held = model if isinstance(model, list) else [model]
    if not has_adapters(held):
        models.export_run(cfg, model, out, log=log)
        return
    layers_of = None
    if isinstance(model, list):  # pipeline stages: the scalings from the run's PEFT model, rebuilt on meta
        with torch.device("meta"):
            layers_of = wrap(models.create(cfg.model), cfg.lora)
    models.export_run(cfg, _merged(held, layers_of), out, log=log)
    tmp = out / "export-adapter-ckpt"
    checkpoint.save(tmp, {"adapters": adapter_state(held)})
    if dist.get_rank() == 0:
        from safetensors.torch import load_file, save_file

        whole = out / "export-adapter-whole"
        files = checkpoint.export_hf(tmp, whole, prefix="adapters.")
        adapters = {n: t for f in files if f.endswith(".safetensors") for n, t in load_file(str(whole / f)).items()}
        target = Path(cfg.export_hf, ADAPTER_DIR)
        target.mkdir(parents=True, exist_ok=True)
        save_file(peft_names(adapters), str(target / "adapter_model.safetensors"), metadata={"format": "pt"})
        config = lora_config(cfg.lora)
        config.base_model_name_or_path = str(Path(cfg.model).resolve()) if models.is_hf_dir(cfg.model) else None
        config.save_pretrained(str(target))
        shutil.rmtree(tmp)
        shutil.rmtree(whole)
        log(f"exported the LoRA adapters ({len(adapters)} tensors) to {target} (PeftModel.from_pretrained)")
