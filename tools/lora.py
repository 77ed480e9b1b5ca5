"""``tools/train.py --lora r=8,alpha=16,targets=q_proj,k_proj,v_proj,o_proj``: LoRA fine-tuning with ``peft``.

``parse_lora`` reads the flag; ``lora_problems`` refuses (before any rank starts) a target that matches no module of
the model, a model without a transformers class, and the meshes LoRA does not run on yet (pp, ep, cp); ``creator``
makes the PEFT model inside ``build_model``'s creation (so deferred init records the adapters too);
``load_pretrained`` fills the frozen base weights from the model directory under their unwrapped names; ``export``
writes the merged model (through ``models.export_run``, the one HF exporter) and the adapters in PEFT's own format
(``<DIR>/adapter``, what ``PeftModel.from_pretrained`` loads). Plans, checkpoints (adapters only) and the adapters'
layout on any mesh are ``vescale.plan``'s (``vescale.plan.lora``).
"""

from __future__ import annotations

from pathlib import Path

import models
import torch
from torch import nn

__all__ = ["parse_lora", "lora_problems", "creator", "wrap", "load_pretrained", "export", "ADAPTER_DIR"]

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
    for dim in ("pp", "ep", "cp"):  # (vescale.plan.build takes a LoRA model on pp; this job's load and export not)
        if cfg.dims.get(dim, 1) > 1:
            out.append(f"--lora with {dim}={cfg.dims[dim]} is not supported yet (--lora runs on dp, tp and ZeRO 0-3)")
    if not (models.is_hf_dir(cfg.model) or cfg.model in models.HF_MODELS):
        out.append(f"--lora needs a transformers model (--model DIR or one of {sorted(models.HF_MODELS)}); "
                   f"{cfg.model} is not one")
        return out
    try:
        import peft  # noqa: F401
    except ImportError:
        return out + ["--lora needs the peft package (pip install peft)"]
    with torch.device("meta"):
        names = [n for n, _ in models.create(cfg.model).named_modules()]
    for target in lora["targets"]:
        if not any(n == target or n.endswith("." + target) for n in names):
            close = sorted({n.rsplit(".", 1)[-1] for n in names if n})
            out.append(f"--lora target {target!r} matches no module of {cfg.model} (its module names end in "
                       f"{', '.join(close[:20])})")
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
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=lora["r"], lora_alpha=lora["alpha"], lora_dropout=lora["dropout"],
                        target_modules=list(lora["targets"]))
    return get_peft_model(model, config)


def load_pretrained(src: str, modules: list[nn.Module], *, stages: bool = False,
                    tied: dict[str, str] | None = None) -> None:
    """``models.load_pretrained``; for a LoRA model the frozen base weights, read under the unwrapped model's names
    (each rank its own boxes), the adapters left as initialised."""
    from vescale.plan.lora import base_fqn, inner_prefix, is_lora_model

    if not is_lora_model(modules[0]):
        models.load_pretrained(src, modules, stages=stages, tied=tied)
        return
    from vescale.checkpoint import import_hf

    model = modules[0]
    prefix = inner_prefix(model)
    base = {base_fqn(n, prefix): t for n, t in model.state_dict().items() if ".lora_" not in n}
    import_hf(src, base)


def _merged(model: nn.Module) -> dict[str, torch.Tensor]:
    """The base model's state with each LoRA layer merged (``W + scaling * B @ A``), by the unwrapped names, laid out
    as the base weights are (the adapters' layout makes ``B @ A`` land on the base weight's placement)."""
    from vescale.plan.lora import base_fqn, inner_prefix, lora_layers

    prefix = inner_prefix(model)
    merged: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        layers = lora_layers(model)
        for name, t in model.state_dict().items():
            if ".lora_" not in name:
                merged[base_fqn(name, prefix)] = t
        for fqn, layer in layers.items():
            weight = layer.base_layer.weight
            for adapter in layer.active_adapters:
                a, b = layer.lora_A[adapter].weight, layer.lora_B[adapter].weight
                weight = weight + layer.scaling[adapter] * (b @ a).to(weight.dtype)
            merged[base_fqn(f"{fqn}.base_layer.weight", prefix)] = weight
    return merged


def export(cfg, model: nn.Module | list[nn.Module], out: Path, log=print) -> None:
    """``--export-hf DIR``: the trained model (a LoRA model merged) as ``from_pretrained`` loads it, and with
    ``--lora`` the adapters in PEFT's format under ``DIR/adapter``. Collective (every rank)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from vescale.plan.lora import is_lora_model

    if isinstance(model, list) or not is_lora_model(model):  # (a pipeline rank's stages: --lora refuses pp)
        models.export_run(cfg, model, out, log=log)
        return
    models.export_run(cfg, _merged(model), out, log=log)
    adapters = {n: p.full_tensor() if isinstance(p, DTensor) else p.detach()  # (a collective over the mesh)
                for n, p in model.named_parameters() if p.requires_grad}
    if dist.get_rank() == 0:
        from peft.utils import get_peft_model_state_dict
        from safetensors.torch import save_file

        target = Path(cfg.export_hf, ADAPTER_DIR)
        target.mkdir(parents=True, exist_ok=True)
        state = get_peft_model_state_dict(model, state_dict={n: t.detach().contiguous().cpu()
                                                             for n, t in adapters.items()})
        save_file(state, str(target / "adapter_model.safetensors"), metadata={"format": "pt"})
        config = model.peft_config["default"]
        config.base_model_name_or_path = str(Path(cfg.model).resolve()) if models.is_hf_dir(cfg.model) else None
        config.save_pretrained(str(target))
        log(f"exported the LoRA adapters to {target} (PeftModel.from_pretrained)")
