"""Gradients summed from contributions of several layers, summed once a step.

A parameter read in two places (a tied embedding: the token lookup in the
first layer, the output projection in the last) gets its gradient as an
``add_any`` of one contribution per use.  Run per micro-batch, that sum ties
the layers together: the layer holding the output projection must hand its
whole contribution to the other one every micro-batch, and a data-parallel
reduction of it cannot wait for the last micro-batch.

The sum is linear, so summing each contribution over the micro-batches and
adding the sums once a step gives the same gradient (up to rounding order).
Megatron-LM does the same with its tied embedding: the first and the last
pipeline stage each keep a copy of the word embedding, accumulate its
gradient over the micro-batches, and all-reduce the two copies' gradients
once per iteration (Megatron-LM's pipeline-parallel GPT).

:func:`once_a_step` is the one definition, over the operators of the step
traced at micro-batch size: the planner (the layer ILPs' gradients:
:mod:`meshplan.dp_search.problem`) and the pipeline runtime (the split's
phases: :mod:`meshplan.runtime.pipeline_split`) both call it, so what the
plan charges once a step is what runs once a step.
"""
from __future__ import annotations

from typing import Mapping, Sequence

from .graph import Graph

__all__ = ["once_a_step", "summing_adds", "graph_ops"]

Op = tuple[str, Sequence[int], Sequence[int]]      # (primitive, input ids, output ids)


def graph_ops(graph: Graph) -> list[Op]:
    """A Graph's operators as the functions below read them."""
    return [(n.primitive, n.inputs, n.outputs) for n in graph.nodes]


def once_a_step(ops: Sequence[Op], layer_of: Sequence[int], marker: str,
                readers: Mapping[int, Sequence[int]] | None = None
                ) -> tuple[frozenset[int], frozenset[int]]:
    """The ``add_any`` operators that sum a gradient (what a ``marker``
    operator reads) from contributions made in more than one layer, and the
    contributions themselves: ``(operator indices, value ids)``.

    An ``add_any`` qualifies when every reader of its result is the marker or
    another qualifying ``add_any``; a tree of them ending at the marker is
    moved as a whole, when its operands (the contributions) are each made by
    an operator and those operators lie in at least two layers.  ``readers``:
    value id -> the operators reading it (a Graph's ``consumers``), when the
    caller has it already."""
    made_by = {o: k for k, (_, _, outs) in enumerate(ops) for o in outs}
    readers = _readers(ops) if readers is None else readers
    summing = summing_adds(ops, marker, readers)
    moved: set[int] = set()
    leaves: set[int] = set()
    for k in sorted(summing, reverse=True):
        if any(r in summing for o in ops[k][2] for r in readers.get(o, ())):
            continue            # not a tree's root: its root collects it
        tree, operands, stack = set(), [], [k]
        while stack:
            j = stack.pop()
            tree.add(j)
            for x in ops[j][1]:
                p = made_by.get(x)
                if p in summing:
                    stack.append(p)
                else:
                    operands.append(x)
        makers = [made_by.get(x) for x in operands]
        if any(p is None for p in makers) or len({layer_of[p] for p in makers}) < 2:
            continue
        moved |= tree
        leaves.update(operands)
    return frozenset(moved), frozenset(leaves)


def summing_adds(ops: Sequence[Op], marker: str,
                 readers: Mapping[int, Sequence[int]] | None = None) -> frozenset[int]:
    """The ``add_any`` operators whose result only the ``marker`` or other
    such adds read: sums of contributions to a gradient.  ``readers``: value
    id -> the operators reading it, when the caller has it already."""
    readers = _readers(ops) if readers is None else readers
    summing: set[int] = set()
    for k in range(len(ops) - 1, -1, -1):     # (readers come later: one sweep)
        prim, _, outs = ops[k]
        if prim == "add_any" and all(readers.get(o) for o in outs) and all(
                ops[r][0] == marker or r in summing for o in outs for r in readers[o]):
            summing.add(k)
    return frozenset(summing)


def _readers(ops: Sequence[Op]) -> dict[int, list[int]]:
    readers: dict[int, list[int]] = {}
    for k, (_, ins, _) in enumerate(ops):
        for x in ins:
            readers.setdefault(x, []).append(k)
    return readers
