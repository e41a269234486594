"""Which forward values a stage recomputes: the choices, and the one graph-level
definition of *selective* recomputation that the planner costs and the
runtime executes.  (A stage recomputing ``full`` may do so for its first
``Stage.recompute_layers`` layers only, Mist's per-stage count: the stage DP
prices it from its layers' none and full figures, the runtimes replay those
layers' forward.)

Megatron-LM's selective recomputation (Korthikanti et al. 2022, "Reducing
Activation Recomputation in Large Transformer Models", section 4.3) keeps the
outputs of the matmuls with weights and recomputes the attention-score region:
``Q K^T``, the mask, softmax and dropout, which hold the ``5 a s / h`` term of
a layer's ``s b h (34 + 5 a s / h)`` activation bytes for few FLOPs.

In graph terms: an *attention dot* is a forward ``dot_general`` with batch
dimensions whose operands both depend on the batch (``Q K^T``, ``P V``; a
weight matmul has no batch dimensions, an expert einsum reads a parameter).
The region is those dots plus the forward ops on a path from one's result to
another's operand that crosses no other matmul, grown by the forward ops
whose every forward reader is in the region (the dropout mask's draw, the
reshapes of Q, K and V).  Its values are recomputed in the backward, except
those a forward op outside the region reads (the context ``P V`` that the
output projection reads): the checkpoint's outputs, kept as before.

The region also holds the forward ops (matmuls aside) whose values derive
from parameters alone: a bfloat16 copy of a float32 weight, a broadcast bias.
Megatron-LM keeps its weights in 16 bits and so keeps no copy per micro-batch;
a step that casts them would otherwise keep one per micro-batch in flight
(12 h^2 / t bytes a layer), which a selective stage makes again from the
resident parameters instead.
"""
from __future__ import annotations

from typing import Sequence

from .graph import BATCH, PARAM, Graph

NONE, SELECTIVE, FULL = "none", "selective", "full"
RECOMPUTE = (NONE, SELECTIVE, FULL)

_MATMULS = frozenset({"dot_general", "conv_general_dilated"})


def recompute_name(remat: bool | str | None) -> str:
    """A stage's choice from ``Stage.remat``-style values: a bool (True: full)
    or one of :data:`RECOMPUTE`."""
    if remat in RECOMPUTE:
        return remat
    return FULL if remat else NONE


def _batch_dims(node) -> bool:
    dn = node.param("dimension_numbers")
    try:
        (_, _), (lb, rb) = dn
    except (TypeError, ValueError):
        return False
    return bool(lb) and bool(rb)


def _batch_dependent(graph: Graph) -> set[int]:
    dep = {i.tensor for i in graph.inputs if i.role == BATCH}
    for n in graph.nodes:
        if not dep.isdisjoint(n.inputs):
            dep.update(n.outputs)
    return dep


def selective_nodes(graph: Graph, forward: Sequence[bool]) -> frozenset[int]:
    """The ids of the forward nodes in the selective region (module doc).
    ``forward``: per node, whether it is a forward op."""
    dep = _batch_dependent(graph)
    nodes, producer, consumers = graph.nodes, graph.producer, graph.consumers
    dots = {n.id for n in nodes if forward[n.id] and n.primitive == "dot_general"
            and _batch_dims(n) and all(t in dep for t in n.inputs[:2])}
    weights = _parameter_only(graph, forward)
    if not dots:
        return frozenset(weights)
    # forward from the dots' results, stopping at any matmul
    down: set[int] = set()
    stack = [c for d in dots for t in nodes[d].outputs for c in consumers.get(t, ())]
    while stack:
        q = stack.pop()
        if q in down or not forward[q]:
            continue
        down.add(q)
        if nodes[q].primitive not in _MATMULS:
            stack.extend(c for t in nodes[q].outputs for c in consumers.get(t, ()))
    # back from the dots' operands, stopping at any matmul
    up: set[int] = set()
    stack = [p for d in dots for t in nodes[d].inputs if (p := producer.get(t)) is not None]
    while stack:
        q = stack.pop()
        if q in up or not forward[q]:
            continue
        up.add(q)
        if nodes[q].primitive not in _MATMULS:
            stack.extend(p for t in nodes[q].inputs if (p := producer.get(t)) is not None)
    region = dots | ((down & up) - {q for q in down if nodes[q].primitive in _MATMULS})
    # grow by the forward ops only the region reads (latest first, so chains join)
    for n in reversed(nodes):
        if n.id in region or not forward[n.id] or n.primitive in _MATMULS:
            continue
        readers = {c for t in n.outputs for c in consumers.get(t, ()) if forward[c]}
        if readers and readers <= region:
            region.add(n.id)
    return frozenset(region | weights)


def _parameter_only(graph: Graph, forward: Sequence[bool]) -> set[int]:
    """The forward nodes (matmuls aside) whose operands are parameters,
    constants or such nodes' values, reading at least one parameter."""
    params = {i.tensor for i in graph.inputs if i.role == PARAM}
    made = {i.tensor for i in graph.inputs} | {t for n in graph.nodes for t in n.outputs}
    derived: set[int] = set()
    out: set[int] = set()
    for n in graph.nodes:
        if not forward[n.id] or n.primitive in _MATMULS or not n.outputs:
            continue
        ins = [t for t in n.inputs if t in made and t not in graph.constant_tensors]
        if ins and all(t in params or t in derived for t in ins):
            out.add(n.id)
            derived.update(n.outputs)
    return out



def recomputed_tensors(graph: Graph, forward: Sequence[bool],
                       region: frozenset[int]) -> frozenset[int]:
    """The values of ``region`` the backward gets by recomputing them: all its
    results except those a forward op outside it reads (kept, as a
    checkpoint's outputs are), and all values derived from parameters alone."""
    weights = _parameter_only(graph, forward)
    out = set()
    for nid in region:
        for t in graph.nodes[nid].outputs:
            if nid in weights or not any(forward[c] and c not in region
                                         for c in graph.consumers.get(t, ())):
                out.add(t)
    return frozenset(out)


def replay_reads(graph: Graph, forward: Sequence[bool], again: frozenset[int],
                 nodes: Sequence[int] | None = None) -> frozenset[int]:
    """What replaying the makers of ``again`` reads that it does not make:
    forward values and batch pieces, which a selective stage keeps from its
    forward in their place (the Q, K and V matmul's result); parameters
    and values made of constants alone are not counted.  ``nodes``: look only
    at these (a layer's); default all."""
    batch = {i.tensor for i in graph.inputs if i.role == BATCH}
    const = graph.constant_tensors
    out = set()
    for nid in (range(len(graph.nodes)) if nodes is None else nodes):
        n = graph.nodes[nid]
        if not n.outputs or not all(t in again for t in n.outputs):
            continue
        for t in n.inputs:
            p = graph.producer.get(t)
            if t not in again and t not in const and (t in batch or (p is not None and forward[p])):
                out.add(t)
    return frozenset(out)
