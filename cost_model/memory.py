"""Memory by liveness over the Graph's (topological) node order.

An intermediate tensor is live from the node that produces it to its last
reader; an output of the step stays live to the end, except the new value of
an input that the step updates (it takes over the input's donated buffer;
unless the caller keeps that input, ``Graph.undonated``).
Inputs are resident for the whole step.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Collection, Mapping, Sequence

import numpy as np

from ..graph import INTERMEDIATE, Graph


@dataclass(frozen=True)
class Liveness:
    intervals: dict[int, tuple[int, int]]   # tensor id -> (first node, last node), inclusive
    profile: np.ndarray                     # unsharded live bytes after each node

    def live_at(self, step: int) -> list[int]:
        return [t for t, (a, b) in self.intervals.items() if a <= step <= b]


def liveness(graph: Graph) -> Liveness:
    n = len(graph.nodes)
    aliased = {o.tensor for o in graph.outputs if o.updates is not None} \
        - graph.kept_updates.keys()
    outputs = {o.tensor for o in graph.outputs}
    last_use: dict[int, int] = {}
    for node in graph.nodes:
        for t in node.inputs:
            last_use[t] = node.id
    intervals: dict[int, tuple[int, int]] = {}
    for node in graph.nodes:
        for t in node.outputs:
            if graph.tensors[t].kind != INTERMEDIATE or t in aliased:
                continue
            end = n - 1 if t in outputs else last_use.get(t, node.id)
            intervals[t] = (node.id, end)
    return Liveness(intervals, live_bytes(intervals, n, lambda t: graph.tensors[t].nbytes))


def live_bytes(intervals: Mapping[int, tuple[int, int]], n: int,
               nbytes: Callable[[int], float]) -> np.ndarray:
    """Bytes live after each of ``n`` nodes: tensor ``t`` counts ``nbytes(t)``
    from the first to the last node of its interval (the sweep of every
    liveness profile, unsharded or as one plan lays the tensors out)."""
    delta = np.zeros(n + 1)
    for t, (a, b) in intervals.items():
        v = nbytes(t)
        delta[a] += v
        delta[b + 1] -= v
    return np.cumsum(delta)[:n]


def peak_steps(live: Liveness, k: int) -> list[int]:
    """The ``k`` node positions with the largest unsharded live bytes, taking
    at most one position from each plateau so the points spread out."""
    prof = live.profile
    if len(prof) == 0:
        return []
    order = np.argsort(-prof, kind="stable")
    chosen: list[int] = []
    for i in order:
        if len(chosen) >= k:
            break
        if all(abs(int(i) - c) > 2 for c in chosen):
            chosen.append(int(i))
    return sorted(chosen)


def program_temp_bytes(graph: Graph, intervals: Mapping[int, tuple[int, int]],
                       forward: Sequence[bool], handed_out: Collection[int],
                       grads: Collection[int], update: Collection[int], summed: bool,
                       nbytes: Callable[[int], float]) -> float:
    """The largest arena of intermediates (XLA's ``temp``) of the forward,
    backward and update programs a pipeline stage runs for ``graph`` (one layer).

    The forward's temps are the forward values it does not hand out
    (``handed_out``: what the backward reads and what the next layer does are
    its outputs).  The backward receives the kept values as arguments, which
    stay allocated for the whole program however early it is done with them,
    so its temps are the values it makes itself, on top of those.  A
    parameter's gradient is added into its running sum as it is made
    (``summed``, several micro-batches: a temp for that moment) or is an
    output.  The optimizer update's operators (``update``,
    :func:`meshplan.ilp.accumulation.update_nodes`) are a program of their
    own: its temps are what it makes beyond the new state (which takes the
    old state's buffers).  ``intervals``: the stored values' liveness (first,
    last node)."""
    made_by = graph.producer
    fwd: dict[int, tuple[int, int]] = {}
    bwd: dict[int, tuple[int, int]] = {}
    upd: dict[int, tuple[int, int]] = {}
    for t, (a, b) in intervals.items():
        p = made_by.get(t)
        if p is None or t in handed_out:
            continue
        if t in grads:
            if summed:
                bwd[t] = (a, a)
        elif p in update:
            upd[t] = (a, b)
        elif forward[p]:
            fwd[t] = (a, b)
        else:
            bwd[t] = (a, b)
    n = len(graph.nodes)
    return max((float(live_bytes(iv, n, nbytes).max()) for iv in (fwd, bwd, upd) if iv and n),
               default=0.0)
