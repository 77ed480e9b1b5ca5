"""Split an unmodified model into pipeline stages by graph capture (``torch.export``, non-strict).

The model is exported once with an example *microbatch*; every node of the captured graph is assigned to a stage by
its position relative to the split points (module FQNs where a stage starts), and each stage becomes a
:class:`GraphStage`: an ``nn.Module`` that holds the model's own ``Parameter`` objects under their original FQNs (so
a checkpoint is independent of the pipeline degree) and runs its slice of the graph. Values a later stage needs
(skip connections, rotary tables, attention masks) travel through the stages in between. A parameter used by several
stages (tied embedding and LM head) is held by each of them; the engine sums its gradients.

Fallback: when ``torch.export`` cannot capture a model (data-dependent control flow, unsupported ops) :func:`split`
raises :class:`SplitError`; write the stage modules by hand (any ``nn.Module`` whose forward takes the previous
stage's outputs) and hand them to :class:`~vescale.pipe.PipeEngine` directly.
"""

from __future__ import annotations

import bisect
import difflib
import operator
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from vescale.core.blocks import find_blocks
from vescale.pipe.errors import SplitError

__all__ = ["GraphStage", "capture", "split", "auto_split_points"]


def _pytree():
    # torch.export describes inputs and outputs with torch's pytree specs; this is the one place that uses them.
    from vescale.core.torch_internals import pytree

    return pytree


def _module_path(node: torch.fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    return list(stack.values())[-1][0]


def _under(path: str, fqn: str) -> bool:
    return path == fqn or path.startswith(fqn + ".")


class GraphStage(nn.Module):
    """One pipeline stage cut from a captured graph.

    ``forward``: stage 0 takes the model's own ``(*args, **kwargs)``; later stages take the previous stage's outputs
    positionally. Non-last stages return a tuple of tensors; the last stage returns the model's output structure
    (a tensor, a ``ModelOutput``, ...). Shapes are those of the example microbatch the split was traced with.
    Parameters and buffers are registered under the model's FQNs; ``canonical_names`` maps the FQN of a tied
    parameter (``lm_head.weight``) to the model's first name for it (``embed.weight``).
    """

    def __init__(self, index: int, num_stages: int, gm: torch.fx.GraphModule, state: list[tuple[str, Any, str]],
                 input_meta: list[tuple[str, tuple[int, ...], torch.dtype]], in_spec: Any, out_spec: Any,
                 kwarg_order: list[str], canonical_names: dict[str, str] | None = None) -> None:
        super().__init__()
        #: FQN -> the model's first FQN for the same Parameter (tied weights), for the engine's gradient sums.
        self.canonical_names = dict(canonical_names or {})
        self.index, self.num_stages = index, num_stages
        object.__setattr__(self, "_gm", gm)  # not a submodule: keeps FQNs of this module equal to the model's
        self._state = [(name, kind == "param") for name, _, kind in state]
        made: dict[str, nn.Module] = {}  # the submodules created here, by FQN
        for name, value, kind in state:
            *parents, leaf = name.split(".")
            owner = self
            for i, part in enumerate(parents):
                path = ".".join(parents[:i + 1])
                if path not in made:
                    made[path] = nn.Module()
                    owner.add_module(part, made[path])
                owner = made[path]
            if kind == "param":
                owner.register_parameter(leaf, value)
            else:
                owner.register_buffer(leaf, value, persistent=kind == "buffer")
        self.input_meta = input_meta
        self._in_spec, self._out_spec, self._kwarg_order = in_spec, out_spec, kwarg_order

    @property
    def graph(self) -> torch.fx.Graph:
        """The captured graph slice this stage runs (placeholders: its params/buffers, then its inputs)."""
        return self._gm.graph

    def _flat_inputs(self, args: tuple, kwargs: dict) -> list:
        if self.index != 0:
            if kwargs:
                raise TypeError(f"stage {self.index} takes the previous stage's outputs positionally, got kwargs "
                                f"{sorted(kwargs)}")
            return list(args)
        pytree = _pytree()
        missing = [k for k in self._kwarg_order if k not in kwargs]
        extra = [k for k in kwargs if k not in self._kwarg_order]
        if missing or extra:
            raise TypeError(f"stage 0 was traced with keyword arguments {self._kwarg_order}; got {sorted(kwargs)}")
        flat, spec = pytree.tree_flatten((tuple(args), {k: kwargs[k] for k in self._kwarg_order}))
        if spec != self._in_spec:
            raise TypeError(f"stage 0 inputs have structure {spec}, the split was traced with {self._in_spec}")
        return flat

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        flat = self._flat_inputs(args, kwargs)
        if len(flat) != len(self.input_meta):
            raise TypeError(f"stage {self.index} takes {len(self.input_meta)} inputs "
                            f"({[n for n, _, _ in self.input_meta]}), got {len(flat)}")
        for value, (name, shape, dtype) in zip(flat, self.input_meta):
            if isinstance(value, torch.Tensor) and tuple(value.shape) != shape:
                raise ValueError(f"stage {self.index} input {name!r} has shape {tuple(value.shape)}; the split was "
                                 f"traced with {shape}. Graph-captured stages are specialised to the example "
                                 "microbatch: pass example_inputs of exactly one microbatch")
            if isinstance(value, torch.Tensor) and value.dtype != dtype:
                raise TypeError(f"stage {self.index} input {name!r} has dtype {value.dtype}; the split was traced "
                                f"with {dtype}")
        state = [self.get_parameter(n) if is_param else self.get_buffer(n) for n, is_param in self._state]
        out = self._gm(*state, *flat)
        if self.index == self.num_stages - 1:
            return _pytree().tree_unflatten(list(out), self._out_spec)
        return tuple(out)


def _export(model: nn.Module, args: tuple, kwargs: dict):
    try:
        ep = torch.export.export(model, args, kwargs, strict=False)
    except Exception as exc:  # noqa: BLE001 - any capture failure gets the same advice
        raise SplitError(f"torch.export could not capture {type(model).__name__}: {type(exc).__name__}: "
                         f"{str(exc).splitlines()[0] if str(exc) else ''}. Fallback: build the stage modules by hand "
                         "and pass them to PipeEngine") from exc
    _drop_metadata_asserts(ep.graph)
    return ep


def _drop_metadata_asserts(graph: torch.fx.Graph) -> None:
    """Remove export's dtype/device asserts on tensors (``aten._assert_tensor_metadata``).

    They check nothing :class:`GraphStage` does not check itself on its inputs, and DTensor has no sharding rule for
    them, so a stage whose parameters or buffers were made tensor-parallel DTensors could not run them.
    """
    for node in list(graph.nodes):
        if (node.op == "call_function" and node.target is torch.ops.aten._assert_tensor_metadata.default
                and not node.users):
            graph.erase_node(node)


def capture(model: nn.Module, example_inputs: Any = ()) -> Any:
    """Capture ``model`` on one example microbatch (``torch.export``, non-strict) for :func:`split`."""
    args, kwargs = _normalise_inputs(example_inputs)
    return _export(model, args, kwargs)


def auto_split_points(model: nn.Module, num_stages: int, *, example_inputs: Any = (),
                      exported: Any = None) -> list[str]:
    """Module FQNs that start stages 1..N-1, balancing parameter counts (the blocks of the longest ModuleList)."""
    args, kwargs = _normalise_inputs(example_inputs)
    ep = exported if exported is not None else _export(model, args, kwargs)
    candidates = [fqn for fqn, _ in find_blocks(model)]
    if not candidates:
        raise SplitError(f"{type(model).__name__} has no nn.ModuleList of blocks to place automatic boundaries at; "
                         "give split_points=[FQN, ...]")
    nodes = [n for n in ep.graph.nodes if n.op == "call_function"]
    index = {n: i for i, n in enumerate(nodes)}
    starts = [_start_index(nodes, c) for c in candidates]
    sizes = _param_first_use(ep, index)
    total = sum(sizes.values())
    before = [sum(v for i, v in sizes.items() if i < s) for s in starts]
    return [candidates[i] for i in _balanced_cuts(before, total, num_stages, len(candidates))]


def _balanced_cuts(before: list[int], total: int, num_stages: int, k: int) -> list[int]:
    """Choose ``num_stages - 1`` increasing candidate indices minimising the largest stage (dynamic programming)."""
    if num_stages - 1 > k:
        raise SplitError(f"cannot make {num_stages} stages: only {k} candidate boundaries (block starts) exist; "
                         "give split_points or use fewer stages")
    if num_stages == 1:
        return []
    # best[j][c]: minimal max stage size using j cuts with the last cut at candidate c.
    inf = float("inf")
    best = [[inf] * k for _ in range(num_stages)]
    prev = [[-1] * k for _ in range(num_stages)]
    for c in range(k):
        best[1][c] = before[c]
    for j in range(2, num_stages):
        for c in range(k):
            for p in range(c):
                val = max(best[j - 1][p], before[c] - before[p])
                if val < best[j][c]:
                    best[j][c], prev[j][c] = val, p
    last = min(range(k), key=lambda c: (max(best[num_stages - 1][c], total - before[c]), c))
    cuts = [last]
    for j in range(num_stages - 1, 1, -1):
        cuts.append(prev[j][cuts[-1]])
    return sorted(cuts)


def _param_first_use(ep, index: dict) -> dict[int, int]:
    sizes: dict[int, int] = {}
    for spec in ep.graph_signature.input_specs:
        if spec.kind.name != "PARAMETER":
            continue
        node = next(n for n in ep.graph.nodes if n.op == "placeholder" and n.name == spec.arg.name)
        users = [index[u] for u in node.users if u in index]
        if users:
            first = min(users)
            sizes[first] = sizes.get(first, 0) + ep.state_dict[spec.target].numel()
    return sizes


def _start_index(nodes: list, fqn: str) -> int:
    for i, n in enumerate(nodes):
        if _under(_module_path(n), fqn):
            return i
    raise SplitError(f"split point {fqn!r} runs no operation in the captured graph (is the module called?)")


def _normalise_inputs(example_inputs: Any) -> tuple[tuple, dict]:
    if isinstance(example_inputs, Mapping):
        return (), dict(example_inputs)
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,), {}
    return tuple(example_inputs), {}


def split(model: nn.Module, *, split_points: Sequence[str] | None = None, num_stages: int | None = None,
          example_inputs: Any = (), virtual_chunks: int = 1, exported: Any = None) -> list[GraphStage]:
    """Split ``model`` into pipeline stages by graph capture; return every stage, in order.

    Give either ``split_points`` (module FQNs where stages 1.. start, in execution order; ``len + 1`` stages) or
    ``num_stages`` (pipeline ranks; ``num_stages * virtual_chunks`` stages with boundaries placed between blocks of
    the longest ``nn.ModuleList`` to balance parameter counts). ``example_inputs`` is one microbatch: a tuple of
    positional args, a tensor, or a dict of keyword args; stages are specialised to its shapes. The model's
    ``train()``/``eval()`` mode at split time is baked into the graph (dropout). ``exported``: a
    ``torch.export.ExportedProgram`` of ``model`` from :func:`capture`, to split one capture several ways. Raises
    :class:`SplitError` naming the bad split point, or when capture fails (see the module docstring for the fallback).
    """
    if (split_points is None) == (num_stages is None):
        raise SplitError("give exactly one of split_points=[FQN, ...] or num_stages=N")
    if virtual_chunks < 1:
        raise SplitError(f"virtual_chunks must be >= 1, got {virtual_chunks}")
    args, kwargs = _normalise_inputs(example_inputs)
    known = dict(model.named_modules())
    if split_points is not None:
        bad = [p for p in split_points if p not in known]
        if bad:
            hints = {p: difflib.get_close_matches(p, list(known), n=3) for p in bad}
            raise SplitError(f"split points {bad} are not modules of {type(model).__name__}; closest: {hints}")
    ep = exported if exported is not None else _export(model, args, kwargs)
    bad_out = [s for s in ep.graph_signature.output_specs if s.kind.name != "USER_OUTPUT"]
    if bad_out:
        raise SplitError(f"{type(model).__name__}.forward mutates state ({[str(s.target) for s in bad_out]}); "
                         "stages must not update buffers or inputs in place")
    if split_points is None:
        split_points = auto_split_points(model, num_stages * virtual_chunks, example_inputs=example_inputs,
                                         exported=ep)
    return _build_stages(model, ep, list(split_points), list(kwargs))


def _build_stages(model: nn.Module, ep, split_points: list[str], kwarg_order: list[str]) -> list[GraphStage]:
    graph = ep.graph
    first_name: dict[int, str] = {}
    canonical: dict[str, str] = {}
    aliases: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        canonical[name] = first_name.setdefault(id(p), name)
        aliases.setdefault(id(p), []).append(name)

    def local_name(target: str, users: list) -> str:
        """The FQN of a (possibly tied) parameter as the modules of this stage that use it call it."""
        names = aliases.get(id(model.get_parameter(target)), [target])
        paths = [_module_path(u) for u in users]
        for name in names:
            owner = name.rpartition(".")[0]
            if any(_under(path, owner) for path in paths):
                return name
        return target
    calls = [n for n in graph.nodes if n.op == "call_function"]
    starts = [_start_index(calls, p) for p in split_points]
    for a, b, pa, pb in zip(starts, starts[1:], split_points, split_points[1:]):
        if b <= a:
            raise SplitError(f"split point {pb!r} does not start after {pa!r} in execution order")
    num_stages = len(split_points) + 1
    stage_of: dict[torch.fx.Node, int] = {}
    for i, n in enumerate(calls):
        stage_of[n] = bisect.bisect_right(starts, i)
    for n in calls:  # an element of a multi-output op stays with its producer
        if n.target is operator.getitem and n.args[0] in stage_of:
            stage_of[n] = stage_of[n.args[0]]
    kinds = {s.arg.name: s for s in ep.graph_signature.input_specs}
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    user_inputs = [n for n in placeholders if kinds[n.name].kind.name == "USER_INPUT"]
    state_nodes = [n for n in placeholders if kinds[n.name].kind.name != "USER_INPUT"]
    output_node = next(n for n in graph.nodes if n.op == "output")
    final_outputs = list(output_node.args[0])
    for n in user_inputs:
        stage_of[n] = 0

    def used_from(v) -> int:
        """Last stage that reads ``v`` (num_stages for a final output)."""
        last = max((stage_of[u] for u in v.users if u in stage_of), default=-1)
        return num_stages if v in final_outputs else last

    live = [v for v in user_inputs + calls if v in stage_of]
    stages = []
    for k in range(num_stages):
        if k == 0:
            inputs = list(user_inputs)
        else:
            inputs = [v for v in live if stage_of[v] < k <= used_from(v)]
        if k == num_stages - 1:
            outputs = final_outputs
        else:
            outputs = [v for v in live if stage_of[v] <= k < used_from(v)]
        body = [n for n in calls if stage_of[n] == k]
        used_state = [s for s in state_nodes if any(u in body for u in s.users)]
        for v in inputs + outputs:
            is_tensor = isinstance(v.meta.get("val"), torch.Tensor) if isinstance(v, torch.fx.Node) else False
            if isinstance(v, torch.fx.Node) and not is_tensor and v not in state_nodes:
                raise SplitError(f"value {v.name!r} ({type(v.meta.get('val')).__name__}) crosses into stage "
                                 f"{k if v in inputs else k + 1}; only tensors can travel between stages")
        new = torch.fx.Graph()
        env: dict[torch.fx.Node, torch.fx.Node] = {}
        for s in used_state:
            env[s] = new.placeholder(s.name)
        for v in inputs:
            env[v] = new.placeholder(v.name)
        for n in body:
            env[n] = new.node_copy(n, env.__getitem__)
        missing = [str(o) for o in outputs if isinstance(o, torch.fx.Node) and o not in env]
        if missing:
            raise SplitError(f"stage {k} would output {missing}, which it neither computes nor receives")
        new.output(tuple(env[o] if isinstance(o, torch.fx.Node) else o for o in outputs))
        gm = torch.fx.GraphModule(torch.nn.Module(), new, class_name=f"Stage{k}")
        state = []
        for s in used_state:
            spec = kinds[s.name]
            kind = spec.kind.name
            if kind == "PARAMETER":
                name = local_name(spec.target, [u for u in s.users if u in body])
                state.append((name, model.get_parameter(spec.target), "param"))
            elif kind == "BUFFER":
                state.append((spec.target, model.get_buffer(spec.target),
                              "buffer" if spec.persistent else "nonpersistent"))
            else:
                const = ep.constants[spec.target]
                state.append((f"_pipe_constant_{spec.target}".replace(".", "_"), const, "nonpersistent"))
        meta = [(v.name, tuple(v.meta["val"].shape), v.meta["val"].dtype) for v in inputs
                if isinstance(v.meta.get("val"), torch.Tensor)]
        out_spec = ep.call_spec.out_spec
        names = {n: canonical[n] for n, _, kind in state if kind == "param" and canonical.get(n, n) != n}
        stages.append(GraphStage(k, num_stages, gm, state, meta, ep.call_spec.in_spec, out_spec, kwarg_order, names))
    return stages
