"""Gradient accumulation in the ILP: which operators make a parameter
gradient (their partial sums may wait for the last micro-batch and be
reduced once a step), which are the optimizer update's (once a step
altogether), and over which mesh axes the runtime lets a sum wait."""
from __future__ import annotations

from ..graph import Graph


def update_nodes(graph: Graph, accumulate: frozenset[int]) -> tuple[frozenset[int], set[int]]:
    """The optimizer update: the operators reading a parameter gradient
    ``accumulate`` or a value computed from one, and the values they compute
    (the gradients themselves excluded)."""
    later = set(accumulate)
    nodes = set()
    for n in graph.nodes:
        if any(t in later for t in n.inputs):
            later.update(n.outputs)
            nodes.add(n.id)
    return frozenset(nodes), later - set(accumulate)


# operators whose result is a gradient's value relaid, recast or scaled, a
# sum of contributions or of its elements (a bias gradient summed over the
# batch, then over the sequence): a reduction before them may wait as well
_GRAD_PASS = frozenset({"convert_element_type", "reshape", "transpose", "squeeze",
                        "expand_dims", "copy", "copy_p", "neg", "mul", "div", "add_any",
                        "reduce_precision", "reduce_sum"})


def summed_axes(name: str, axis_names) -> frozenset[int]:
    """The mesh axes a strategy named ``name`` (ilp.strategies) sums over."""
    return frozenset(axis_names.index(part.split(":")[0]) for part in name.split()
                     if ":" in part and part.split(":")[1].startswith("sum"))


def deferrable(axes: frozenset[int], defer_axes: frozenset[int] | None) -> bool:
    """May a gradient's sum over ``axes`` wait for the last micro-batch?  Only
    over the axes the runtime keeps partial sums on
    (runtime.pipeline_partial: the data-parallel ones)."""
    return defer_axes is None or axes <= defer_axes


def gradient_only(graph: Graph, accumulate: frozenset[int]
                  ) -> tuple[frozenset[int], frozenset[int]]:
    """The operators (outside the update) that make a parameter gradient of
    ``accumulate``: a weight gradient's matmul, a bias gradient's sum over
    the tokens, and the casts, reshapes and scalings between them and the
    gradient.  Their partial sums may be added over the micro-batches and
    reduced once.  An input gradient's matmul is not one of them: what it
    makes feeds the rest of the backward, every micro-batch.  Also the
    values between them and the gradients (a resharding of those is part of
    the gradient's reduction).  ``(operators, values)``."""
    if not accumulate:
        return frozenset(), frozenset()
    skip = update_nodes(graph, accumulate)[0]
    readers: dict[int, list] = {}
    for n in graph.nodes:
        if n.id not in skip:
            for t in n.inputs:
                readers.setdefault(t, []).append(n.id)
    outputs = {o.tensor for o in graph.outputs}
    only: set[int] = set(accumulate)
    nodes: set[int] = set()
    for n in reversed(graph.nodes):
        if n.id in skip or not n.outputs or not all(t in only for t in n.outputs):
            continue
        nodes.add(n.id)
        if n.primitive not in _GRAD_PASS:
            continue
        shaped = [t for t in n.inputs if graph.tensors[t].shape]
        if n.primitive in ("mul", "div") and len(shaped) > 1:
            continue        # (a product with another value, e.g. a mask: not a scaling)
        for t in shaped:
            if t not in outputs and all(r in nodes for r in readers.get(t, ())):
                only.add(t)
    return frozenset(nodes), frozenset(only)
