"""Fast models: a causal LM whose every decoder layer is a fast layer, run whole on local tensors.

A model is recognised by structure (:func:`install_model`): a transformers causal LM (see :mod:`.structure`) whose
``forward`` takes ``input_ids`` and ``inputs_embeds`` and whose two children are a bias-free ``nn.Linear`` head and a
decoder model of the same transformers module holding an ``nn.Embedding``, an ``nn.ModuleList`` of
:class:`~vescale.parallel.fast.layer.FastLayer` s, a final norm with one replicated weight and a static rotary
embedding (``rope_type``, no parameters). One boundary goes in (the token ids), one comes out (the logits); the
vocabulary lookup is :func:`vescale.parallel.vocab_embedding.lookup_rows`. Static checks only, no collective.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from vescale.core import torch_internals
from vescale.dtensor.api import from_local_nograd
from vescale.parallel.collectives import EnterGroup, LeaveGroup, gather_last_dim
from vescale.parallel.fast.boundary import CACHE_KEYS, FromLocal, heads, local_parameters
from vescale.parallel.fast.cache import CacheOfDTensors
from vescale.parallel.fast.context import FastPathContext, fast_path_enabled
from vescale.parallel.fast.layer import FastLayer
from vescale.parallel.fast.random_guard import RandomGuard, random_code
from vescale.parallel.fast.structure import dropout_active, dropout_fields, from_transformers, replicated_weight_norm
from vescale.parallel.local import is_local
from vescale.parallel.model_calls import check_token_ids, embedding_name
from vescale.parallel.vocab_embedding import lookup_rows

__all__ = ["install_model", "FastModel"]


def _decoder_parts(decoder: nn.Module) -> dict[str, str] | None:
    """The child names of ``decoder``'s embedding, layer list, final norm and rotary embedding, or None."""
    children = dict(decoder.named_children())
    if len(children) != 4:
        return None
    parts = {"embed": [n for n, c in children.items() if type(c) is nn.Embedding],
             "layers": [n for n, c in children.items() if isinstance(c, nn.ModuleList)],
             "rotary": [n for n, c in children.items() if hasattr(c, "rope_type") and not list(c.parameters())]}
    taken = {n for names in parts.values() for n in names}
    parts["norm"] = [n for n in children if n not in taken]
    if any(len(names) != 1 for names in parts.values()):
        return None
    return {role: names[0] for role, names in parts.items()}


def install_model(module: nn.Module, mesh, inputs: dict, outputs: dict, named: list[str], context: FastPathContext,
                  own_output: Any = None) -> bool:
    """Install :class:`FastModel` on ``module`` if it is recognised (see the module docstring) and the plan qualifies
    (see there); return whether it did. ``inputs``/``outputs`` map the module's own descendants' relative FQNs to
    their entries' specs, ``named`` lists every relative FQN a plan entry names, ``own_output`` is the module's own
    ``output`` entry (None: none)."""
    if not from_transformers(module):
        return False
    if not {"input_ids", "inputs_embeds"} <= set(inspect.signature(type(module).forward).parameters):
        return False
    children = dict(module.named_children())
    heads_ = [n for n, c in children.items() if type(c) is nn.Linear]
    if len(children) != 2 or len(heads_) != 1:
        return False
    head_name = heads_[0]
    decoder_name = next(n for n in children if n != head_name)
    decoder, head = children[decoder_name], children[head_name]
    if not from_transformers(decoder) or type(decoder).__module__ != type(module).__module__ \
            or list(decoder.named_parameters(recurse=False)) or list(decoder.named_buffers(recurse=False)):
        return False
    parts = _decoder_parts(decoder)
    if parts is None:
        return False
    d = decoder_name
    embed_fqn = f"{d}.{parts['embed']}"
    fixed = {d, f"{d}.{parts['norm']}", f"{d}.{parts['rotary']}", f"{d}.{parts['layers']}"}
    prefixes = (f"{d}.{parts['norm']}.", f"{d}.{parts['rotary']}.", f"{embed_fqn}.", f"{head_name}.")
    if any(n in fixed or n.startswith(prefixes) for n in named) or embed_fqn in inputs:
        return False
    layers = [(layer, vars(layer).get("forward")) for layer in getattr(decoder, parts["layers"])]
    if not layers or not all(isinstance(f, FastLayer) and f.mesh == mesh and f.context is context for _, f in layers):
        return False
    k = layers[0][1].k
    placements = layers[0][1].blocks[0].row_placements
    if any(f.k != k or any(b.row_placements != placements for b in f.blocks) for _, f in layers):
        return False
    embed, norm, rotary = (getattr(decoder, parts[role]) for role in ("embed", "norm", "rotary"))
    vocab_rows = tuple(Shard(0) if i == k else Replicate() for i in range(mesh.ndim))
    if is_local(embed):
        return False  # a ``local`` entry: the plan wants that module's own forward
    if not (isinstance(embed.weight, DTensor) and embed.weight.device_mesh == mesh
            and tuple(embed.weight.placements) == vocab_rows and embed.weight.shape[0] % mesh.size(k) == 0
            and embed.max_norm is None and not embed.sparse and not embed.scale_grad_by_freq
            and not [n for n, _ in embed.named_buffers()] and list(embed.parameters()) == [embed.weight]):
        return False
    if not (head.bias is None and isinstance(head.weight, DTensor) and head.weight.device_mesh == mesh
            and tuple(head.weight.placements) == vocab_rows and "forward" not in vars(head)):
        return False
    if not _same_spec(outputs.get(embed_fqn), placements) or \
            (head_name in inputs and not _same_spec(inputs[head_name], placements)):
        return False
    logits = tuple(Shard(2) if i == k else p for i, p in enumerate(placements))
    if head_name in outputs:
        spec = outputs[head_name]
        if not (isinstance(spec, (list, tuple)) and len(spec) == 1 and isinstance(spec[0], (list, tuple))
                and len(spec[0]) == mesh.ndim and all(
                    (type(p) is Shard and p.dim in (-1, 2)) if i == k else p == placements[i]
                    for i, p in enumerate(spec[0]))):
            return False
    if not replicated_weight_norm(norm, mesh):
        return False
    dropouts = dropout_fields(module, getattr(module, "config", None), decoder, getattr(decoder, "config", None))
    if random_code((module, decoder, norm, rotary), dropouts):
        return False  # a forward it runs locally may draw random numbers: see .random_guard
    rope = rotary.rope_type
    if not isinstance(rope, str) or "dynamic" in rope or rope == "longrope" or list(rotary.children()) \
            or "forward" in vars(rotary):
        return False
    buffers = []
    for name, buf in rotary.named_buffers():
        if not (isinstance(buf, DTensor) and buf.device_mesh == mesh
                and all(type(p) is Replicate for p in buf.placements)):
            return False
        buffers.append((rotary, name))
    cache_class = _dynamic_cache_class(decoder)
    if cache_class is None:
        return False
    entries = [(owner, "weight", tuple(owner.weight.placements)) for owner in (embed, norm, head)]
    n_layer_params = sum(len(f.norms) + sum(len(b.params) for b in f.blocks) for _, f in layers)
    if len(entries) + n_layer_params != len(list(module.parameters())):
        return False  # a parameter elsewhere (tied embeddings count once: refused, the lm head would be local twice)
    # the model's own output entry asks for the logits with the vocabulary replicated on k: gathered in FastModel
    gathered = tuple(Replicate() if i == k else p for i, p in enumerate(logits))
    own = own_output.get("logits") if isinstance(own_output, Mapping) else None
    gather = isinstance(own, (list, tuple)) and tuple(own) == gathered
    module.forward = FastModel(module, module.forward, mesh, k, (decoder_name, parts["embed"], head_name), layers,
                               entries, buffers, placements, logits, cache_class, context, gathered if gather else None,
                               dropouts=dropouts)
    return True


def _same_spec(spec: Any, placements: tuple) -> bool:
    """Whether a one-argument/one-output plan entry gives exactly ``placements``."""
    return (isinstance(spec, (list, tuple)) and len(spec) == 1 and isinstance(spec[0], (list, tuple))
            and tuple(spec[0]) == tuple(placements))


def _dynamic_cache_class(decoder: nn.Module) -> Any:
    """``DynamicCache`` as the decoder model's module names it (vescale does not import transformers), or None."""
    import sys

    return getattr(sys.modules.get(type(decoder).__module__), "DynamicCache", None)


class FastModel:
    """A causal LM (see the module docstring) whose every decoder layer is a :class:`FastLayer`, run whole on local
    tensors as Megatron runs it: the token ids' local tensor goes in (checked against the vocabulary first:
    :func:`~vescale.parallel.model_calls.check_token_ids` raises ``TokenIdError`` on every rank where one device
    raises ``IndexError``), the vocab-parallel embedding looks up this rank's rows (ids outside them read zeros) and
    all-reduces, the rotary embedding, the masks and every layer compute on this rank's replicated activation, the
    final norm too, and the column-parallel lm head (identity forward / all-reduce backward on entry) gives this
    rank's vocabulary columns, wrapped as a DTensor with the lm head's ``output`` entry placements. The root's own
    boundaries (its ``input`` and ``output`` entries, the plain tensors it returns) apply around it unchanged; the KV
    cache holds head-sharded DTensors as on the DTensor path (see :mod:`.cache`). Where the model's own ``output``
    entry gives ``logits`` exactly those placements with the vocabulary replicated on ``k`` (the plans' default, full
    logits), the columns are all-gathered here instead, in one collective as Megatron gathers them
    (:func:`~vescale.parallel.collectives.gather_last_dim`), and the entry then finds them in place.

    Built by :func:`install_model` only when every layer is a :class:`FastLayer` on one mesh dim ``k`` (their
    placements ``P``), the embedding is sharded ``Shard(0)`` on ``k`` (replicated elsewhere, rows dividing evenly, no
    ``max_norm``/``sparse``/``scale_grad_by_freq``) with ``output`` entry ``[P]``, the lm head sharded ``Shard(0)`` on
    ``k`` with ``input`` entry ``[P]`` (or none) and ``output`` entry ``P`` with the vocabulary dim sharded on ``k``
    (or none), the rotary embedding not ``dynamic``/``longrope``, no other plan entry names the decoder model or its
    embedding's input, norm, rotary embedding or layer list, and no parameter is tied. Per call it checks what every
    layer checks, plus: keyword arguments with ``input_ids`` a DTensor placed ``P`` (not ``inputs_embeds``), no
    ``labels`` (the loss wants the full vocabulary), no attentions or hidden states asked for, an integer
    ``logits_to_keep``, every other tensor argument a DTensor placed ``P`` without gradient, no dropout of the model,
    its decoder or their configs active, every layer still its :class:`FastLayer` (not checkpointed, not compiled), no
    random op drawn by the first call in the model's mode (``random``, see
    :class:`~vescale.parallel.fast.random_guard.RandomGuard`); otherwise the model's own ``forward`` runs and its
    layers decide for themselves.

    Forward values are bitwise those of the DTensor path (the same local kernels and collectives); gradients agree to
    rounding (see :class:`FastLayer`).
    """

    def __init__(self, module: nn.Module, orig, mesh, k: int, names: tuple[str, str, str], layers: list,
                 entries: list[tuple], buffers: list[tuple], placements: tuple, logits_placements: tuple,
                 cache_class: type, context: FastPathContext, gathered_placements: tuple | None = None, *,
                 dropouts: tuple[tuple[Any, str], ...]) -> None:
        self.module, self.orig, self.mesh, self.k, self.context = module, orig, mesh, k, context
        self.decoder_name, self.embed_name, self.head_name = names
        self.layers, self.entries, self.buffers, self.cache_class = layers, entries, buffers, cache_class
        self.placements, self.logits_placements = placements, logits_placements
        self.gathered_placements = gathered_placements  # the own output entry's logits placements, if gathered here
        # generate() reads the forward's signature to decide what to pass (attention_mask, logits_to_keep, ...)
        self.__signature__ = inspect.signature(orig)
        embed = getattr(self._decoder(), self.embed_name)
        self.offset = mesh.get_local_rank(k) * (embed.weight.shape[0] // mesh.size(k))
        self.dropouts = dropouts  # the model's, its decoder's and their configs' dropout fields, read per call
        self.random = RandomGuard()
        self.local_calls = 0

    def _decoder(self) -> nn.Module:
        return getattr(self.module, self.decoder_name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling() or self.context.layer_group is not None or not self._applies(args, kwargs):
            return self.orig(*args, **kwargs)
        params, buffers = self._params(), self._current_buffers()
        if params is None or buffers is None:
            return self.orig(*args, **kwargs)
        if not self.random.clean(self.module):
            return self.random.dtensor_path(self.module, self.orig, args, kwargs)
        return self._run_local(kwargs, params, buffers)

    def _applies(self, args: tuple, kwargs: dict) -> bool:
        from vescale.dtensor.strict import is_strict

        if args or not fast_path_enabled() or is_strict() or dropout_active(self.module, self.dropouts):
            return False
        m, decoder = self.module, self._decoder()
        for layer, fast in self.layers:
            if vars(layer).get("forward") is not fast or torch_internals.compiled_call(layer) is not None \
                    or getattr(layer, "gradient_checkpointing", False) or not all(
                        b.module_applies() for b in fast.blocks):
                return False
        if getattr(decoder, "gradient_checkpointing", False) or torch_internals.compiled_call(decoder) is not None:
            return False
        ids = kwargs.get("input_ids")
        if not isinstance(ids, DTensor) or ids.device_mesh != self.mesh or tuple(ids.placements) != self.placements:
            return False
        if kwargs.get("inputs_embeds") is not None or kwargs.get("labels") is not None \
                or not isinstance(kwargs.get("logits_to_keep", 0), int):
            return False
        for flag, default in (("output_attentions", False), ("output_hidden_states", False), ("return_dict", True)):
            value = kwargs.get(flag)
            if (getattr(m.config, flag, default) if value is None else value) != default:
                return False
        for key, v in kwargs.items():
            if key in CACHE_KEYS:
                if v is not None and not callable(getattr(v, "update", None)):
                    return False
                continue
            for t in (v.values() if isinstance(v, dict) else v if isinstance(v, (tuple, list)) else (v,)):
                if isinstance(t, torch.Tensor) and (not isinstance(t, DTensor) or t.device_mesh != self.mesh
                                                    or tuple(t.placements) != self.placements or t.requires_grad):
                    return False
        return True

    def _params(self) -> list[tuple] | None:
        """``(owner, attr, dtensor)`` of every parameter now, or None if one is no longer a DTensor on the mesh with
        the placements checked at installation (replaced since, e.g. by ZeRO 3)."""
        found = []
        for owner, attr, placements in self.entries:
            t = getattr(owner, attr)
            if not isinstance(t, DTensor) or t.device_mesh != self.mesh or tuple(t.placements) != placements:
                return None
            found.append((owner, attr, t))
        for _, fast in self.layers:
            got = fast.params_now()
            if got is None:
                return None
            found += got
        return found

    def _current_buffers(self) -> list[tuple] | None:
        """``(owner, attr, dtensor)`` of the rotary embedding's buffers now (``module.to()`` replaces them), or None if
        one is no longer a replicated DTensor on the mesh."""
        found = []
        for owner, attr in self.buffers:
            t = getattr(owner, attr)
            if not (isinstance(t, DTensor) and t.device_mesh == self.mesh
                    and all(type(p) is Replicate for p in t.placements)):
                return None
            found.append((owner, attr, t))
        return found

    def _run_local(self, kwargs: dict, params: list[tuple], buffers: list[tuple]) -> Any:
        decoder, context = self._decoder(), self.context
        per_head = heads(self.placements, self.k)
        kwargs = {key: _local_value(v) for key, v in kwargs.items()}
        ids = kwargs.pop("input_ids")
        kwargs.pop("inputs_embeds", None)  # None (checked): the embeddings computed here take its place
        embed = getattr(decoder, self.embed_name)
        # before any collective: an id outside the vocabulary would read zeros below (replicated on k, so no
        # collective there; batch-sharded dims agree with one all-reduce of two numbers)
        check_token_ids(ids, embed.weight.shape[0], embedding_name(embed.weight),
                        [self.mesh.get_group(i) for i, p in enumerate(self.placements) if not p.is_replicate()])
        cache_key = next((key for key in CACHE_KEYS if key in kwargs), "cache")
        cache = kwargs.get(cache_key)
        use_cache = kwargs.get("use_cache")
        if cache is None and (use_cache if use_cache is not None else getattr(decoder.config, "use_cache", False)):
            # what the decoder model creates itself then (under the root's factory capture, as there)
            cache = kwargs[cache_key] = self.cache_class(config=decoder.config)
        if cache is not None:
            kwargs[cache_key] = CacheOfDTensors(cache, self.mesh, per_head)
        self.local_calls += 1
        head = getattr(self.module, self.head_name)
        group = self.mesh.get_group(self.k)
        before, context.layer_group = context.layer_group, group
        try:
            with local_parameters(params, self.placements, context) as mode, _local_buffers(buffers):
                if cache is not None:
                    kwargs[cache_key].mode = mode
                embeds = LeaveGroup.apply(lookup_rows(ids, embed.weight, self.offset, embed.padding_idx), group)
                vars(head)["forward"] = functools.partial(_column_head, head=head, group=group)
                try:
                    out = self.orig(inputs_embeds=embeds, **kwargs)
                finally:
                    del vars(head)["forward"]
        finally:
            context.layer_group = before
        for key in CACHE_KEYS:
            if isinstance(out.get(key), CacheOfDTensors):
                out[key] = out[key].cache
        logits = out["logits"]
        if self.gathered_placements is not None:
            out["logits"] = gather_last_dim(logits, self.mesh, self.k, self.gathered_placements)
        elif logits.requires_grad:
            out["logits"] = FromLocal.apply(logits, self.mesh, self.logits_placements, self.logits_placements)
        else:
            out["logits"] = from_local_nograd(logits, self.mesh, self.logits_placements)
        return out


def _local_value(v: Any) -> Any:
    """A call argument with its (checked: gradient-free) DTensors as their local tensors."""
    if isinstance(v, DTensor):
        return torch_internals.local_tensor(v)
    if isinstance(v, dict) and any(isinstance(t, DTensor) for t in v.values()):
        return {key: _local_value(t) for key, t in v.items()}
    if isinstance(v, (tuple, list)) and any(isinstance(t, DTensor) for t in v):
        items = [_local_value(t) for t in v]
        return type(v)(items) if isinstance(v, list) else tuple(items)
    return v


@contextlib.contextmanager
def _local_buffers(buffers: list[tuple]):
    """Within, each ``(owner, attr, dtensor)`` buffer (replicated, no gradient) reads as its local tensor."""
    for owner, attr, t in buffers:
        vars(owner)[attr] = torch_internals.local_tensor(t)
    try:
        yield
    finally:
        for owner, attr, _ in buffers:
            vars(owner).pop(attr, None)


def _column_head(x: torch.Tensor, *, head: nn.Module, group) -> torch.Tensor:
    """The lm head on this rank's vocabulary rows (Megatron's column-parallel linear; the weight is local here)."""
    return torch.nn.functional.linear(EnterGroup.apply(x, group), head.weight)
