"""Recomputation inside one program: what a one-stage plan's step
recomputes (``Stage.recompute``), layer by layer, as the pipeline's backward
programs replay their stage's forward (:mod:`meshplan.runtime.pipeline_split`).

One program holds the forward and the backward, so a value the backward
reads is normally kept from the forward.  With a :class:`Replay` the
evaluator (:func:`meshplan.runtime.shard.make_evaluator`) gives the backward
a recomputed copy instead: when a backward equation first reads a value of
a layer's recomputed set, that layer's forward equations are bound again,
from their kept operands passed (with the backward operands of the reading
equation) through one ``jax.lax.optimization_barrier``.  The barrier is
what ``jax.checkpoint`` lowers to as well: XLA cannot merge the copy with
the forward's values (common subexpressions) nor run it before the backward
gets there, so the forward's values die after their last forward reader.

* full: every forward value but the layers' boundaries (a value made in one
  layer and read by the forward of another: the layer inputs, kept);
* selective: the attention-score region and the parameter-only values,
  :func:`meshplan.recompute.selective_nodes` (the planner's definition).

The numbers are those of the plain step: the same equations run again on
the same operands (random draws included: their keys are operands).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from meshplan.graph import Graph, forward_nodes
from meshplan.recompute import FULL, NONE, SELECTIVE, recomputed_tensors, selective_nodes


@dataclass(frozen=True)
class Replay:
    """The forward equations the backward binds again, in groups (a layer's)."""
    groups: tuple[tuple[int, ...], ...]     # equation indices, in stream order
    group_of: Mapping[int, int]             # recomputed value id -> its group
    forward: tuple[bool, ...]               # per equation
    # the first equation after the forward's last: the backward.  Equations
    # outside the forward but among it (a random key split for the next
    # step's state) read the values the forward just made
    backward_from: int = 0

    def reads(self, eqn: int, invars: Sequence[object]) -> list[int]:
        """The recomputed values a backward equation reads (none for the forward)."""
        if self.forward[eqn] or eqn < self.backward_from:
            return []
        return [x for x in invars if isinstance(x, int) and x in self.group_of]


def plan_replay(graph: Graph, recompute: str, layer_of_node: Sequence[int],
                below: int | None = None) -> Replay | None:
    """What a one-program step with ``recompute`` (a :data:`meshplan.recompute.RECOMPUTE`
    name) binds again (None: ``none``); ``graph`` numbers its nodes and tensors as the flat
    equation stream; ``layer_of_node``: the layer of every node; ``below``:
    with ``full``, only the layers numbered below it (None: all)."""
    if recompute == NONE:
        return None
    fwd = tuple(forward_nodes(graph))
    nodes, consumers = graph.nodes, graph.consumers
    if recompute == FULL:
        again = {t for n in nodes if fwd[n.id] for t in n.outputs
                 if (below is None or layer_of_node[n.id] < below)
                 and not any(fwd[c] and layer_of_node[c] != layer_of_node[n.id]
                             for c in consumers.get(t, ()))}
    elif recompute == SELECTIVE:
        again = set(recomputed_tensors(graph, fwd, selective_nodes(graph, fwd)))
    else:
        raise ValueError(f"recompute {recompute!r}")
    # only what the backward reads, and what making it needs
    backward_from = 1 + max((n.id for n in nodes if fwd[n.id]), default=-1)
    need = {t for n in nodes[backward_from:] if not fwd[n.id] for t in n.inputs if t in again}
    stack, replay = list(need), set()
    while stack:
        p = graph.producer.get(stack.pop())
        if p is None or p in replay:
            continue
        replay.add(p)
        stack.extend(t for t in nodes[p].inputs if t in again)
    by_layer: dict[int, list[int]] = {}
    for nid in sorted(replay):
        by_layer.setdefault(layer_of_node[nid], []).append(nid)
    groups = tuple(tuple(v) for _, v in sorted(by_layer.items()))
    group_of = {t: g for g, eqns in enumerate(groups) for nid in eqns
                for t in nodes[nid].outputs if t in again}
    # (no groups: the backward reads nothing left to make again -- the
    # step's own jax.checkpoint calls recompute it already)
    return Replay(groups, group_of, fwd, backward_from)
