"""The intra-operator ILP as numbers only: :class:`IlpProblem` and its answer.

An :class:`IlpProblem` carries no graph, so tests can drive it with random
costs and compare with :func:`brute_force`.  Each group ``g`` picks one of its
strategies (one-hot binaries ``s_g``); each edge ``(u, v, R)`` adds
``R[i, j]`` when ``u`` picks ``i`` and ``v`` picks ``j``; each memory row
``sum_g coef_g . s_g <= budget`` must hold.

:mod:`meshplan.ilp.presolve` shrinks a problem exactly,
:mod:`meshplan.ilp.dp` solves it by dynamic programming when that is cheap,
and :mod:`meshplan.ilp.solvers` hands the rest to a MIP back end.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import numpy as np


@dataclass
class Edge:
    u: int
    v: int
    cost: np.ndarray       # shape (n_u, n_v)
    name: str = ""


@dataclass
class MemoryRow:
    coefs: dict[int, np.ndarray]   # group -> bytes per strategy
    budget: float
    name: str = ""

    def least(self) -> float:
        """The row's smallest possible use: each group's smallest entry."""
        return sum(float(c.min()) for c in self.coefs.values())

    def can_bind(self) -> bool:
        """Whether some choice could exceed the budget (else the row holds whatever is chosen)."""
        return sum(float(np.max(c)) for c in self.coefs.values()) > self.budget


@dataclass
class IlpProblem:
    names: list[str]                       # one per group, used for variable names
    costs: list[np.ndarray]                # group -> cost per strategy
    edges: list[Edge] = field(default_factory=list)
    memory: list[MemoryRow] = field(default_factory=list)

    @property
    def num_groups(self) -> int:
        return len(self.costs)

    def objective(self, choice: list[int]) -> float:
        total = sum(float(c[i]) for c, i in zip(self.costs, choice))
        total += sum(float(e.cost[choice[e.u], choice[e.v]]) for e in self.edges)
        return total

    def memory_use(self, choice: list[int]) -> list[float]:
        return [sum(float(c[choice[g]]) for g, c in row.coefs.items()) for row in self.memory]

    def feasible(self, choice: list[int]) -> bool:
        return all(m <= row.budget * (1 + 1e-9) + 1e-6
                   for m, row in zip(self.memory_use(choice), self.memory))

    def surely_infeasible(self) -> bool:
        """No choice fits: a memory row's budget is below the sum of each
        group's smallest entry (the tolerance as :meth:`feasible`'s)."""
        return any(row.least() > row.budget * (1 + 1e-9) + 1e-6 for row in self.memory)

    def min_memory(self) -> float:
        """A lower bound of the smallest achievable peak over the memory rows."""
        return max([0.0, *(row.least() for row in self.memory)])

    def pair_tables(self) -> tuple[list[tuple[int, np.ndarray]], dict[tuple[int, int], np.ndarray]]:
        """The edges as cost tables: ``(group, diagonal)`` for each edge from a
        group to itself, in edge order, and one float table per unordered pair
        of groups ``(u, v)``, ``u < v`` (rows: ``u``'s strategies), summing
        the pair's edges in edge order."""
        loops: list[tuple[int, np.ndarray]] = []
        pairs: dict[tuple[int, int], np.ndarray] = {}
        for e in self.edges:
            if e.u == e.v:
                loops.append((e.u, np.diag(e.cost).astype(float)))
                continue
            key, mat = ((e.u, e.v), e.cost) if e.u < e.v else ((e.v, e.u), e.cost.T)
            pairs[key] = pairs[key] + mat if key in pairs else np.array(mat, dtype=float)
        return loops, pairs


@dataclass(frozen=True)
class Solution:
    choice: tuple[int, ...]
    objective: float
    status: str            # "optimal", "time_limit" (best incumbent), "trivial"
    solve_s: float
    num_variables: int
    num_constraints: int
    backend: str
    # the MIP was allowed to stop within this fraction of the optimum (0: optimal)
    gap: float = 0.0


def brute_force(p: IlpProblem) -> tuple[list[int] | None, float]:
    """Exhaustive optimum (for tests); ``(None, inf)`` when nothing fits."""
    best, best_val = None, math.inf
    for choice in itertools.product(*[range(len(c)) for c in p.costs]):
        ch = list(choice)
        if not p.feasible(ch):
            continue
        val = p.objective(ch)
        if best is None or val < best_val - 1e-12 * abs(best_val):
            best, best_val = ch, val
    return best, best_val
