"""Gradient accumulation in the ILP: which operators make a parameter
gradient (their partial sums may wait for the last micro-batch and be
reduced once a step), which are the optimizer update's (once a step
altogether), and over which mesh axes the runtime lets a sum wait."""
from __future__ import annotations

from ..graph import OPT_STATE, PARAM, STATE, Graph, micro_batch_split


Split = tuple[set[int], frozenset[int]]


def step_split(graph: Graph, accumulate: frozenset[int]) -> Split:
    """:func:`meshplan.graph.micro_batch_split` of ``graph`` with the
    gradients ``accumulate``: what runs per micro-batch, and the casts made
    once a step ahead of them (what :func:`update_nodes` and
    :func:`held_copies` read; work them out once and pass it to both)."""
    return micro_batch_split(
        graph, accumulate, (i.tensor for i in graph.inputs if i.role not in _RESIDENT))


def update_nodes(graph: Graph, accumulate: frozenset[int], split: Split | None = None
                 ) -> tuple[frozenset[int], set[int]]:
    """The optimizer update: the operators a step runs once, not once per
    micro-batch, and the values they compute (the gradients themselves
    excluded).  As the pipeline runtime splits a step
    (:func:`meshplan.graph.per_micro_batch_nodes`), every operator runs per
    micro-batch that the gradients ``accumulate`` or a value made from the
    batch (not from a gradient) need; the rest run once: what reads a
    gradient, and what reads only parameters and optimizer state for the
    update (Adam's decay of its moments, a step counter).  Nothing without
    gradients to accumulate."""
    if not accumulate:
        return frozenset(), set()
    each = (split or step_split(graph, accumulate))[0]
    nodes = frozenset(n.id for n in graph.nodes if n.id not in each)
    made = {t for n in graph.nodes if n.id in nodes for t in n.outputs}
    return nodes, made - set(accumulate)


# inputs that do not change from micro-batch to micro-batch
_RESIDENT = frozenset({PARAM, OPT_STATE, STATE})


def held_copies(graph: Graph, accumulate: frozenset[int], split: Split | None = None
                ) -> frozenset[int]:
    """The values a step of several micro-batches makes once and holds all
    step like its parameters: the narrowed copies of
    :func:`meshplan.graph.hoisted_casts`."""
    if not accumulate:
        return frozenset()
    ahead = (split or step_split(graph, accumulate))[1]
    return frozenset(n.outputs[0] for n in graph.nodes if n.id in ahead)


# operators whose result is a gradient's value relaid, recast or scaled, a
# sum of contributions or of its elements (a bias gradient summed over the
# batch, then over the sequence): a reduction before them may wait as well
_GRAD_PASS = frozenset({"convert_element_type", "reshape", "transpose", "squeeze",
                        "expand_dims", "copy", "copy_p", "neg", "mul", "div", "add_any",
                        "reduce_precision", "reduce_sum"})


def name_axes(name: str) -> tuple[tuple[str, str], ...]:
    """(mesh axis, what it splits: ``o0``, ``i1.0``, ``sum``, ``sum>rs2``) of
    each part of a strategy named ``name`` (ilp.strategies; none for ``R``)."""
    return tuple((axis, what) for axis, _, what in (part.partition(":") for part in name.split())
                 if what)


def summed_axes(name: str, axis_names) -> frozenset[int]:
    """The mesh axes a strategy named ``name`` (ilp.strategies) sums over."""
    return frozenset(axis_names.index(axis) for axis, what in name_axes(name)
                     if what.startswith("sum"))


def deferrable(axes: frozenset[int], defer_axes: frozenset[int] | None,
               rows: frozenset[int] | None = None) -> bool:
    """May a gradient's sum over ``axes`` wait for the last micro-batch?  Only
    over the axes the runtime keeps partial sums on (``defer_axes``; None:
    any) and, where known (``rows``, :func:`rows_axes`), only over axes that
    cut the micro-batch's rows where the sum is made: runtime.pipeline_partial
    replays a backward on each data shard's rows, so a sum over an axis that
    cuts the sequence or a hidden dimension is reduced every micro-batch."""
    return (defer_axes is None or axes <= defer_axes) and (rows is None or axes <= rows)


def rows_axes(graph: Graph, inputs, in_specs) -> frozenset[int] | None:
    """The mesh axes that cut the micro-batch's rows of an operator's
    ``inputs`` laid out as ``in_specs`` (an ISpec, or None, per input), from
    ``graph.rows_dim``; None where the graph does not know its rows."""
    dims = graph.rows_dim
    if dims is None:
        return None
    out: set[int] = set()
    for t, spec in zip(inputs, in_specs):
        d = dims.get(t)
        if spec is not None and d is not None and d < len(spec):
            out.update(spec[d])
    return frozenset(out)


def gradient_only(graph: Graph, accumulate: frozenset[int],
                  update: frozenset[int] | None = None) -> tuple[frozenset[int], frozenset[int]]:
    """The operators (outside the update) that make a parameter gradient of
    ``accumulate``: a weight gradient's matmul, a bias gradient's sum over
    the tokens, and the casts, reshapes and scalings between them and the
    gradient.  Their partial sums may be added over the micro-batches and
    reduced once.  An input gradient's matmul is not one of them: what it
    makes feeds the rest of the backward, every micro-batch.  Also the
    values between them and the gradients (a resharding of those is part of
    the gradient's reduction).  ``(operators, values)``.  ``update``: what
    :func:`update_nodes` gives for these arguments, where already known."""
    if not accumulate:
        return frozenset(), frozenset()
    skip = update_nodes(graph, accumulate)[0] if update is None else update
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
