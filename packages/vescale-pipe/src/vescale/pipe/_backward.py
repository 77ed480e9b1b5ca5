"""Backward of one stage and microbatch, whole or split into input-gradient (BI) and weight-gradient (BW) parts.

The split works on the autograd graph of the stage. Every node from which a stage input is reachable is on the
*input path*; a child of an input-path node that reaches parameters but no input starts a *weight branch* (the
``t(W)`` under a matmul, a norm's scale). An input-path node with weight branches is a *split node*.

``BI`` runs autograd to the stage inputs only (``retain_graph``): each split node computes just its input-side
gradient, and a pre-hook keeps the gradient flowing into it. ``BW`` re-runs each split node from that gradient (as a
:class:`torch.autograd.graph.GradientEdge`) restricted to the parameters under it, so it computes just the weight
side: the weight-gradient matmuls really move from BI to BW, nothing is computed twice, and the gradients are bitwise
those of one plain ``backward``. When a parameter sits under several split nodes (a weight used twice in one stage),
BI instead computes the gradients at the weight-branch roots and BW only runs the branches (correct, less deferred).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

__all__ = ["backward_full", "backward_input", "backward_weight", "PendingWeightGrad"]


@dataclass
class PendingWeightGrad:
    """What ``BI`` leaves for ``BW``: autograd calls ``(gradient edges, their gradients, leaves to reach)``."""

    calls: list = field(default_factory=list)
    whole: tuple | None = None  # (roots, grads) when the stage has no inputs needing gradients


def _postorder(roots: list) -> list:
    order, seen, stack = [], set(), [(r, False) for r in roots]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            order.append(node)
            continue
        if node in seen:
            continue
        seen.add(node)
        stack.append((node, True))
        for child, _ in node.next_functions:
            if child is not None and child not in seen:
                stack.append((child, False))
    return order


def backward_full(roots: list[torch.Tensor], grads: list[torch.Tensor] | None,
                  inputs: list[torch.Tensor]) -> list[torch.Tensor | None]:
    """Plain backward from ``roots``; returns the gradients of ``inputs`` (leaves of this stage)."""
    torch.autograd.backward(roots, grads)
    return [x.grad for x in inputs]


def backward_input(roots: list[torch.Tensor], grads: list[torch.Tensor] | None,
                   inputs: list[torch.Tensor]) -> tuple[list[torch.Tensor | None], PendingWeightGrad]:
    """BI: gradients of ``inputs``, plus the captured weight-branch gradients that :func:`backward_weight` needs."""
    root_nodes = [r.grad_fn for r in roots if r.grad_fn is not None]
    pending = PendingWeightGrad()
    if not inputs:
        # Nothing upstream needs a gradient: the whole backward is weight work, done in BW.
        pending.whole = (roots, grads)
        return [], pending
    input_nodes = {get_gradient_edge(x).node for x in inputs}
    order = _postorder(root_nodes)
    on_input_path, has_leaf = set(), set()
    for node in order:  # children before parents
        children = [c for c, _ in node.next_functions if c is not None]
        if node in input_nodes or any(c in on_input_path for c in children):
            on_input_path.add(node)
        if hasattr(node, "variable") and node not in input_nodes:
            has_leaf.add(node)
        elif any(c in has_leaf for c in children):
            has_leaf.add(node)

    def weight_only(node) -> bool:
        return node is not None and node in has_leaf and node not in on_input_path

    def leaves_under(tops: list) -> list:
        found, seen, stack = [], set(), list(tops)
        while stack:
            node = stack.pop()
            if node in seen:
                continue
            seen.add(node)
            if hasattr(node, "variable"):
                found.append(node)
            stack.extend(c for c, _ in node.next_functions if weight_only(c))
        return found

    # Split nodes: on the input path, with weight-only children (the matmul whose second operand is t(W)).
    splits = []
    for node in order:
        if node in on_input_path:
            tops = [c for c, _ in node.next_functions if weight_only(c)]
            if tops:
                splits.append((node, leaves_under(tops)))
    weight_roots = [(r, root) for r, root in zip(roots, root_nodes) if weight_only(root)]
    uses: dict = {}
    for _, leaves in splits:
        for leaf in leaves:
            uses[leaf] = uses.get(leaf, 0) + 1
    separable = all(n == 1 for n in uses.values()) and not weight_roots
    if separable:
        # BI runs each split node for its input edges only; BW re-runs it for its weight edges only, from the
        # gradient captured here, restricted to the parameters under it (so nothing else is recomputed).
        captured: dict = {}
        handles = [node.register_prehook(functools.partial(_capture, captured, node)) for node, _ in splits]
        try:
            input_grads = list(torch.autograd.grad(roots, inputs, grads, retain_graph=True, allow_unused=True))
        finally:
            for h in handles:
                h.remove()
        for node, leaves in splits:
            outs = captured.get(node)
            if outs is None or not leaves:
                continue
            edges = [(GradientEdge(node, i), g) for i, g in enumerate(outs) if g is not None]
            if edges:
                pending.calls.append(([e for e, _ in edges], [g for _, g in edges], [n.variable for n in leaves]))
        return input_grads, pending
    # A parameter reached through several split nodes (a weight used twice in the stage): capture the gradients
    # at the roots of the weight branches instead; BW then runs the branches only (the matmuls ran in BI).
    edges, seen_edges = [], set()
    for node in order:
        if node in on_input_path:
            for child, nr in node.next_functions:
                if weight_only(child) and (child, nr) not in seen_edges:
                    seen_edges.add((child, nr))
                    edges.append(GradientEdge(child, nr))
    edges += [get_gradient_edge(r) for r, _ in weight_roots]
    out = torch.autograd.grad(roots, list(inputs) + edges, grads, retain_graph=True, allow_unused=True)
    leaves = [n.variable for n in order if hasattr(n, "variable") and n not in input_nodes]
    kept = [(e, g) for e, g in zip(edges, out[len(inputs):]) if g is not None]
    if kept:
        pending.calls.append(([e for e, _ in kept], [g for _, g in kept], leaves))
    return list(out[:len(inputs)]), pending


def _capture(store: dict, node, grad_outputs: tuple) -> None:
    store[node] = grad_outputs


def backward_weight(pending: PendingWeightGrad) -> None:
    """BW: accumulate parameter gradients from what :func:`backward_input` captured; frees the graph."""
    if pending.whole is not None:
        torch.autograd.backward(*pending.whole)
        pending.whole = None
        return
    for edges, grads, leaves in pending.calls:
        torch.autograd.backward(edges, grads, inputs=leaves)
    pending.calls = []
