"""Memory by liveness over the Graph's (topological) node order.

An intermediate tensor is live from the node that produces it to its last
reader; an output of the step stays live to the end, except the new value of
an input that the step updates (it takes over the input's donated buffer).
Inputs are resident for the whole step.
"""
from __future__ import annotations

from dataclasses import dataclass

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
    aliased = {o.tensor for o in graph.outputs if o.updates is not None}
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
    delta = np.zeros(n + 1)
    for t, (a, b) in intervals.items():
        nb = graph.tensors[t].nbytes
        delta[a] += nb
        delta[b + 1] -= nb
    profile = np.cumsum(delta)[:n]
    return Liveness(intervals, profile)


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


def resident_bytes(graph: Graph) -> int:
    """Unsharded bytes of all inputs (parameters, optimizer state, batch, state)."""
    return sum(graph.tensors[i.tensor].nbytes for i in graph.inputs)
