"""Memory traffic of elementwise operators once XLA has fused them.

XLA fuses chains of elementwise operators (and the broadcasts feeding them)
into one loop: the intermediate values stay in registers, and only the
operands the chain reads from memory and the results it leaves in memory
cost bandwidth.  Counting every operator's result instead overstates the
time of layer norms, softmaxes, activations and the optimizer update two- to
five-fold, which makes sharding such work look far more valuable than it is.

:func:`fused_bytes` gives, per fusible operator, the bytes it moves under
that rule: the operands it reads from memory (made by a non-fusible operator
or an input of the step) plus its result when the result is materialised
(read by a non-fusible operator, or an output of the step).
:func:`materialised` names the values that exist in memory at all.
"""
from __future__ import annotations

from ..flops import PER_ELEMENT
from ..graph import Graph

FUSIBLE = PER_ELEMENT | frozenset({"broadcast_in_dim", "squeeze", "expand_dims", "iota"})


def fused_bytes(graph: Graph) -> dict[int, float]:
    """node id -> bytes moved, for every fusible operator of ``graph``."""
    fusible = {n.id for n in graph.nodes if n.primitive in FUSIBLE}
    producer = graph.producer
    consumers = graph.consumers
    outputs = {o.tensor for o in graph.outputs}
    out: dict[int, float] = {}
    for n in graph.nodes:
        if n.id not in fusible:
            continue
        moved = 0.0
        for t in dict.fromkeys(n.inputs):
            tt = graph.tensors[t]
            if not tt.shape:
                continue
            p = producer.get(t)
            if p is None or p not in fusible:
                moved += tt.nbytes
        for t in n.outputs:
            readers = consumers.get(t, ())
            if t in outputs or any(r not in fusible for r in readers) or not readers:
                moved += graph.tensors[t].nbytes
        out[n.id] = moved
    return out


def materialised(graph: Graph) -> set[int]:
    """Tensors that exist in memory: results of non-fusible operators, and
    results of fusible ones that a non-fusible operator reads or the step
    returns.  (A value passed only between fusible operators stays in
    registers: XLA fuses the chain, duplicating cheap producers into each
    fusion that needs them.)"""
    outputs = {o.tensor for o in graph.outputs}
    out: set[int] = set()
    for n in graph.nodes:
        if n.primitive not in FUSIBLE:
            out.update(n.outputs)
            out.update(n.inputs)
    out.update(outputs)
    return out
