"""The pure core of the intra-operator pass: an ILP over strategy choices.

An :class:`IlpProblem` is numbers only, so tests can drive it with random
costs and compare with :func:`brute_force`.  Each group ``g`` picks one of its
strategies (one-hot binaries ``s_g``); each edge ``(u, v, R)`` adds
``R[i, j]`` when ``u`` picks ``i`` and ``v`` picks ``j``; each memory row
``sum_g coef_g . s_g <= budget`` must hold.

Edges are linearised on their distinct rows and columns: strategies of ``u``
with identical rows of ``R`` (same output layout) collapse to one class, the
same for the columns, and the edge variables ``e_pq`` form a transportation
polytope (``sum_q e_pq = sum_{i in p} s_ui``, ``sum_p e_pq = sum_{j in q} s_vj``),
which is exact for one-hot ``s`` and tight in the LP relaxation.
"""
from __future__ import annotations

import itertools
import math
import os
import time
import warnings
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from ..errors import InfeasiblePlanError, SolverError


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

    def min_memory(self) -> float:
        """A lower bound of the smallest achievable peak over the memory rows."""
        best = 0.0
        for row in self.memory:
            best = max(best, sum(float(c.min()) for c in row.coefs.values()))
        return best


@dataclass(frozen=True)
class Solution:
    choice: tuple[int, ...]
    objective: float
    status: str            # "optimal", "time_limit" (best incumbent), "trivial"
    solve_s: float
    num_variables: int
    num_constraints: int
    backend: str


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


def _classes(matrix: np.ndarray, axis: int) -> list[list[int]]:
    """Indices grouped by identical rows (axis=0) or columns (axis=1)."""
    m = matrix if axis == 0 else matrix.T
    m = np.ascontiguousarray(m)
    if m.shape[0] == 0:
        return []
    _, first, inverse = np.unique(m, axis=0, return_index=True, return_inverse=True)
    inverse = np.asarray(inverse).reshape(-1)
    order = np.argsort(first, kind="stable")          # classes in order of first appearance
    rank = np.empty_like(order)
    rank[order] = np.arange(len(order))
    out: list[list[int]] = [[] for _ in range(len(first))]
    for i, c in enumerate(inverse):
        out[rank[c]].append(i)
    return out


# ---------------------------------------------------------------------------
# Exact reductions
# ---------------------------------------------------------------------------

@dataclass
class Reduced:
    """``p`` after exact reductions, with the way back to ``p``'s indices."""
    problem: IlpProblem
    keep: list[np.ndarray]          # per original group: kept strategy indices (into p)
    removed: int                    # strategies removed as dominated or duplicate


def reduce_problem(p: IlpProblem, tol: float = 1e-12) -> Reduced:
    """Remove strategies that can never be needed, keeping the optimum.

    Strategy ``b`` of a group is *dominated* by ``a`` when switching from
    ``b`` to ``a`` can never cost more, whatever the other groups choose:

        cost[a] - cost[b] + sum over edges e of max_j (E_e[a, j] - E_e[b, j]) <= 0

    and ``a`` uses no more memory than ``b`` in every memory row that can
    bind.  Any solution choosing ``b`` stays feasible and gets no worse with
    ``a``, so dropping ``b`` keeps the optimum.  Strategies are dropped one at
    a time (each dominated by one still kept), group after group, repeatedly:
    a drop on one side can create dominance on the other.
    """
    n = p.num_groups
    keep = [np.arange(len(c)) for c in p.costs]
    incident: list[list[tuple[int, bool]]] = [[] for _ in range(n)]
    for k, e in enumerate(p.edges):
        incident[e.u].append((k, True))
        incident[e.v].append((k, False))
    binding = [r for r in p.memory
               if sum(float(np.max(c)) for c in r.coefs.values()) > r.budget]
    mem_of: list[list[np.ndarray]] = [[] for _ in range(n)]
    for row in binding:
        for g, c in row.coefs.items():
            if np.ptp(c) > 0:
                mem_of[g].append(np.asarray(c, dtype=float))
    big = max([float(np.max(np.abs(c))) for c in p.costs if len(c)] +
              [float(np.max(np.abs(e.cost))) for e in p.edges if e.cost.size] + [1e-300])
    eps = tol * big

    removed = 0
    dirty = list(range(n))
    in_dirty = set(dirty)
    while dirty:
        g = dirty.pop()
        in_dirty.discard(g)
        ks = keep[g]
        k = len(ks)
        if k <= 1:
            continue
        c = np.asarray(p.costs[g], dtype=float)[ks]
        D = c[:, None] - c[None, :]                     # D[a, b]: switching b -> a
        for kk, is_u in incident[g]:
            e = p.edges[kk]
            M = e.cost[np.ix_(ks, keep[e.v])] if is_u else e.cost[np.ix_(keep[e.u], ks)].T
            if M.shape[1] == 0 or not np.any(M):
                continue
            if k * k * M.shape[1] <= 1 << 24:
                D += (M[:, None, :] - M[None, :, :]).max(axis=2)
            else:
                for a in range(k):
                    D[a] += (M[a][None, :] - M).max(axis=1)
        ok = D <= eps
        for mc in mem_of[g]:
            m = mc[ks]
            ok &= m[:, None] <= m[None, :] * (1 + 1e-12) + 1e-9
        np.fill_diagonal(ok, False)
        alive = np.ones(k, dtype=bool)
        for b in range(k):
            if (ok[:, b] & alive).any():
                alive[b] = False
        if not alive.all():
            removed += int((~alive).sum())
            keep[g] = ks[alive]
            for kk, is_u in incident[g]:
                e = p.edges[kk]
                h = e.v if is_u else e.u
                if h not in in_dirty:
                    dirty.append(h)
                    in_dirty.add(h)
    costs = [np.asarray(c, dtype=float)[ks] for c, ks in zip(p.costs, keep)]
    edges = [Edge(e.u, e.v, e.cost[np.ix_(keep[e.u], keep[e.v])], e.name) for e in p.edges]
    memory = [MemoryRow({g: np.asarray(c, dtype=float)[keep[g]] for g, c in row.coefs.items()},
                        row.budget, row.name) for row in p.memory]
    return Reduced(IlpProblem(list(p.names), costs, edges, memory), keep, removed)


@dataclass
class _Elimination:
    """How to recover the groups that :func:`eliminate` took out of the ILP."""
    order: list[tuple[int, tuple[int, ...], np.ndarray]]   # (group, neighbours, argmin table)
    remaining: list[int]                                    # old index of each new group
    offset: float                                           # cost of fixed parts

    def recover(self, sub_choice: Sequence[int], n: int) -> list[int]:
        choice = [-1] * n
        for new, old in enumerate(self.remaining):
            choice[old] = int(sub_choice[new])
        for g, nbrs, table in reversed(self.order):
            choice[g] = int(table[tuple(choice[h] for h in nbrs)]) if nbrs else int(table)
        return choice


def eliminate(p: IlpProblem, *, max_table: int = 1 << 22, growth: float = 1.0
              ) -> tuple[IlpProblem, _Elimination]:
    """Variable elimination (dynamic programming) on groups of degree <= 2.

    A group whose choice only interacts with at most two other groups (and
    with no memory row that could bind) is taken out: with one neighbour ``n``
    its best strategy for each choice of ``n`` becomes a cost of ``n``; with
    two neighbours ``a, b`` the best for each pair becomes an edge ``a``-``b``
    (kept only when that edge needs no more variables than what it replaces,
    times ``growth``).  Exact: the reduced problem has the same optimum, and
    :meth:`_Elimination.recover` rebuilds the eliminated choices.
    """
    n = p.num_groups
    unary = {g: np.asarray(c, dtype=float).copy() for g, c in enumerate(p.costs)}
    edges: dict[tuple[int, int], np.ndarray] = {}
    nbr: dict[int, set[int]] = {g: set() for g in range(n)}
    for e in p.edges:
        if e.u == e.v:
            unary[e.u] += np.diag(e.cost)
            continue
        key, mat = ((e.u, e.v), e.cost) if e.u < e.v else ((e.v, e.u), e.cost.T)
        edges[key] = edges[key] + mat if key in edges else np.array(mat, dtype=float)
        nbr[e.u].add(e.v)
        nbr[e.v].add(e.u)
    # memory rows that can bind pin the groups whose usage they depend on
    rows, pinned = [], set()
    for row in p.memory:
        if sum(float(np.max(c)) for c in row.coefs.values()) <= row.budget:
            continue   # holds whatever is chosen
        rows.append(row)
        for g, c in row.coefs.items():
            if np.ptp(c) > 0:
                pinned.add(g)

    def edge(a: int, b: int) -> np.ndarray:
        return edges[(a, b)] if a < b else edges[(b, a)].T

    def n_vars(mat: np.ndarray) -> int:
        if mat.shape[0] == 1 or mat.shape[1] == 1 or not np.any(mat):
            return 0
        return len(_classes(mat, 0)) * len(_classes(mat, 1))

    order: list[tuple[int, tuple[int, ...], np.ndarray]] = []
    alive = set(range(n))
    queue = list(range(n))
    offset = 0.0
    while queue:
        h = queue.pop()
        if h not in alive or h in pinned or len(nbr[h]) > 2:
            continue
        nb = tuple(sorted(nbr[h]))
        c = unary[h]
        if len(nb) == 0:
            i = int(np.argmin(c))
            offset += float(c[i])
            order.append((h, (), np.array(i)))
        elif len(nb) == 1:
            a = nb[0]
            tot = c[:, None] + edge(h, a)                  # [h, a]
            order.append((h, (a,), np.argmin(tot, axis=0)))
            unary[a] = unary[a] + tot.min(axis=0)
        else:
            a, b = nb
            size = len(c) * len(unary[a]) * len(unary[b])
            if size > max_table:
                continue
            tot = c[:, None, None] + edge(h, a)[:, :, None] + edge(h, b)[:, None, :]
            new = tot.min(axis=0)
            merged = new + (edge(a, b) if b in nbr[a] else 0.0)
            old = (len(c) + n_vars(edge(h, a)) + n_vars(edge(h, b))
                   + (n_vars(edge(a, b)) if b in nbr[a] else 0))
            if n_vars(merged) > growth * old:
                continue
            order.append((h, (a, b), np.argmin(tot, axis=0)))
            edges[(a, b)] = merged
            nbr[a].add(b)
            nbr[b].add(a)
        for x in nb:
            edges.pop((min(h, x), max(h, x)), None)
            nbr[x].discard(h)
            queue.append(x)
        nbr[h] = set()
        alive.discard(h)
    remaining = sorted(alive)
    new_of = {g: k for k, g in enumerate(remaining)}
    costs = [unary[g] for g in remaining]
    new_edges = [Edge(new_of[a], new_of[b], mat, f"edge_{p.names[a]}_{p.names[b]}")
                 for (a, b), mat in edges.items() if a in alive and b in alive]
    memory = []
    for row in rows:
        const = sum(float(c[0]) for g, c in row.coefs.items() if g not in alive)
        memory.append(MemoryRow({new_of[g]: c for g, c in row.coefs.items() if g in alive},
                                row.budget - const, row.name))
    q = IlpProblem([p.names[g] for g in remaining], costs, new_edges, memory)
    return q, _Elimination(order, remaining, offset)


# ---------------------------------------------------------------------------
# The MIP in matrix form, shared by the back ends
# ---------------------------------------------------------------------------

@dataclass
class _Mip:
    """Columns (all in [0, 1]) and rows as numpy blocks.  Names (for CBC and
    LP dumps) are made only when ``names_on``: a HiGHS solve never reads them."""
    names_on: bool = False
    cost: list[np.ndarray] = field(default_factory=list)
    integer: list[np.ndarray] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    row_idx: list[np.ndarray] = field(default_factory=list)
    row_val: list[np.ndarray] = field(default_factory=list)
    row_lo: list[float] = field(default_factory=list)
    row_hi: list[float] = field(default_factory=list)
    row_names: list[str] = field(default_factory=list)
    offset: float = 0.0
    s: list[np.ndarray | None] = field(default_factory=list)   # group -> column per strategy
    # per pair edge: (u, v, strategy -> row class, strategy -> column class, variables [a, b])
    pairs: list[tuple[int, int, np.ndarray, np.ndarray, np.ndarray]] = field(
        default_factory=list)
    num_cols: int = 0

    def cols(self, cost: np.ndarray, integer: bool, names=None) -> np.ndarray:
        """New columns (upper bound 1) with these costs; their indices."""
        n = len(cost)
        idx = np.arange(self.num_cols, self.num_cols + n)
        self.num_cols += n
        self.cost.append(np.asarray(cost, dtype=float))
        self.integer.append(np.full(n, integer))
        if self.names_on:
            self.names.extend(names())
        return idx

    def row(self, idx: np.ndarray, val: np.ndarray, lo: float, hi: float, name) -> None:
        self.row_idx.append(np.asarray(idx, dtype=np.int64))
        self.row_val.append(np.asarray(val, dtype=float))
        self.row_lo.append(lo)
        self.row_hi.append(hi)
        if self.names_on:
            self.row_names.append(name())

    @property
    def num_rows(self) -> int:
        return len(self.row_lo)

    def columns(self) -> tuple[np.ndarray, np.ndarray]:
        """(cost, integer) of every column."""
        cat = (lambda xs, dt: np.concatenate(xs) if xs else np.zeros(0, dtype=dt))
        return cat(self.cost, float), cat(self.integer, bool)


def _safe(name: str) -> str:
    return "".join(ch if ch.isalnum() or ch == "_" else "_" for ch in name)


def _formulate(p: IlpProblem, scale: float, names: bool = False) -> _Mip:
    """One-hot binaries per group; per edge, after folding what depends on one
    side only, transportation variables on the distinct rows and columns."""
    m = _Mip(names_on=names)
    unary = [np.asarray(c, dtype=float).copy() for c in p.costs]
    # fold edges that need no pair variables into the groups' own costs
    pair_edges = []
    merged: dict[tuple[int, int], np.ndarray] = {}
    edge_names: dict[tuple[int, int], str] = {}
    for e in p.edges:
        key, mat = (e.u, e.v), e.cost
        if (e.v, e.u) in merged:
            key, mat = (e.v, e.u), e.cost.T
        merged[key] = merged[key] + mat if key in merged else np.array(mat, dtype=float)
        edge_names.setdefault(key, e.name)
    for (u, v), mat in merged.items():
        if not np.any(mat):
            continue
        if mat.shape[0] == 1 or mat.shape[1] == 1:
            if mat.shape[0] == 1:
                unary[v] += mat[0]
            else:
                unary[u] += mat[:, 0]
            continue
        # additively separable: c_ij = a_i + b_j
        a = mat[:, 0] - mat[0, 0]
        b = mat[0, :]
        if np.allclose(mat, a[:, None] + b[None, :], rtol=1e-12, atol=1e-15 * np.abs(mat).max()):
            unary[u] += a
            unary[v] += b
            continue
        pair_edges.append((u, v, mat, edge_names[(u, v)]))

    for g, (name, cost) in enumerate(zip(p.names, unary)):
        if len(cost) == 1:
            m.s.append(None)
            m.offset += float(cost[0]) * scale
            continue
        nm = _safe(name)
        cols = m.cols(cost * scale, True, lambda: [f"s_{nm}_{i}" for i in range(len(cost))])
        m.s.append(cols)
        m.row(cols, np.ones(len(cols)), 1.0, 1.0, lambda: f"one_{nm}")

    for k, (u, v, mat, name) in enumerate(pair_edges):
        rows, cols = _classes(mat, 0), _classes(mat, 1)
        R, C = len(rows), len(cols)
        su, sv = m.s[u], m.s[v]
        ename = _safe(name or f"e{k}")
        first_r = np.array([r[0] for r in rows])
        first_c = np.array([c[0] for c in cols])
        ev = m.cols((mat[np.ix_(first_r, first_c)] * scale).ravel(), False,
                    lambda: [f"{ename}_{a}_{b}" for a in range(R) for b in range(C)]
                    ).reshape(R, C)
        row_of = np.empty(mat.shape[0], dtype=np.int64)
        for a, r in enumerate(rows):
            row_of[r] = a
        col_of = np.empty(mat.shape[1], dtype=np.int64)
        for b, c in enumerate(cols):
            col_of[c] = b
        m.pairs.append((u, v, row_of, col_of, ev))
        for a, r in enumerate(rows):
            m.row(np.concatenate([ev[a], su[r]]),
                  np.concatenate([np.ones(C), -np.ones(len(r))]), 0.0, 0.0,
                  lambda: f"{ename}_row{a}")
        for b, c in enumerate(cols[:-1]):  # the last column's balance is implied
            m.row(np.concatenate([ev[:, b], sv[c]]),
                  np.concatenate([np.ones(R), -np.ones(len(c))]), 0.0, 0.0,
                  lambda: f"{ename}_col{b}")

    for k, row in enumerate(p.memory):
        idx, val = [], []
        const = 0.0
        for g, coef in row.coefs.items():
            if m.s[g] is None:
                const += float(coef[0])
            else:
                nz = np.flatnonzero(coef)
                idx.append(m.s[g][nz])
                val.append(np.asarray(coef, dtype=float)[nz])
        # in units of the budget, so the coefficients stay near 1
        unit = max(abs(row.budget), 1.0)
        m.row(np.concatenate(idx) if idx else np.zeros(0, dtype=np.int64),
              (np.concatenate(val) if val else np.zeros(0)) / unit, -math.inf,
              (row.budget - const) / unit, lambda: _safe(row.name or f"mem{k}"))
    return m


def formulation_size(p: IlpProblem) -> tuple[int, int]:
    """(variables, constraints) of the MIP that a back end would get for ``p``."""
    m = _formulate(p, 1.0)
    return m.num_cols, m.num_rows


def reduced(p: IlpProblem) -> IlpProblem:
    """``p`` after the exact reductions :func:`solve` applies before a back end."""
    q, _ = eliminate(reduce_problem(p).problem)
    q = reduce_problem(q).problem
    q2, el = eliminate(q)
    return reduce_problem(q2).problem if el.order else q


def greedy(p: IlpProblem) -> list[int] | None:
    """A feasible-if-possible choice: groups in order, each taking its cheapest
    strategy given the ones already taken (a warm start for the solver)."""
    n = p.num_groups
    adj: list[list[tuple[int, np.ndarray, bool]]] = [[] for _ in range(n)]
    for e in p.edges:
        adj[e.u].append((e.v, e.cost, True))
        adj[e.v].append((e.u, e.cost, False))
    choice: list[int | None] = [None] * n
    for g in range(n):
        c = np.asarray(p.costs[g], dtype=float).copy()
        for h, mat, is_u in adj[g]:
            if choice[h] is not None:
                c += mat[:, choice[h]] if is_u else mat[choice[h], :]
        choice[g] = int(np.argmin(c))
    ch = [int(x) for x in choice]
    return ch if p.feasible(ch) else None


# table entries the elimination DP may touch per group before the MIP takes over
DP_WORK_PER_GROUP = 2e6


def solve(p: IlpProblem, *, backend: str = "highs", time_limit: float | None = 60.0,
          threads: int = 1, reduce: bool = True, dp: bool = True,
          dp_max_entries: int = 1 << 25) -> Solution:
    """Optimal (or best within ``time_limit``) strategy choice for ``p``.

    The problem is first reduced exactly (:func:`reduce_problem`,
    :func:`eliminate`).  With ``dp`` the rest is solved by variable
    elimination (:mod:`meshplan.ilp.dp`)
    when its tables stay under ``dp_max_entries`` (and its work under
    ``DP_WORK_PER_GROUP`` per group) and its answer fits the memory rows
    (``Solution.backend == "dp"``).
    Otherwise the MIP goes to ``backend``: ``"highs"`` (highspy) or ``"cbc"``
    (PuLP's bundled CBC).  ``reduce=False, dp=False`` hands the unreduced
    formulation to the back end."""
    t0 = time.perf_counter()
    if all(len(c) == 1 for c in p.costs):
        choice = tuple(0 for _ in p.costs)
        if not p.feasible(list(choice)):
            raise _infeasible(p)
        return Solution(choice, p.objective(list(choice)), "trivial",
                        time.perf_counter() - t0, 0, 0, "none")
    if reduce:
        # exact reductions: dominated strategies, then variable elimination of
        # groups with at most two neighbours, then dominance again
        red = reduce_problem(p)
        q1, elim = eliminate(red.problem)
        red2 = reduce_problem(q1)
        q = red2.problem
        # a second round: pruning may leave groups with fewer neighbours
        q2, elim2 = eliminate(q)
        if elim2.order:
            red3 = reduce_problem(q2)
            q = red3.problem
        else:
            elim2, red3 = None, None
    else:
        red = Reduced(p, [np.arange(len(c)) for c in p.costs], 0)
        elim = _Elimination([], list(range(p.num_groups)), 0.0)
        red2 = Reduced(p, [np.arange(len(c)) for c in p.costs], 0)
        elim2 = red3 = None
        q = p

    def back(sub: Sequence[int]) -> list[int]:
        if elim2 is not None:
            sub = [int(red3.keep[g][c]) for g, c in enumerate(sub)]
            sub = elim2.recover(sub, red2.problem.num_groups)
        mid = [int(red2.keep[g][c]) for g, c in enumerate(sub)]
        full = elim.recover(mid, red.problem.num_groups)
        return [int(red.keep[g][c]) for g, c in enumerate(full)]

    if all(len(c) == 1 for c in q.costs):
        choice = back([0] * q.num_groups)
        if not p.feasible(choice):
            raise _infeasible(p)
        return Solution(tuple(choice), p.objective(choice), "optimal",
                        time.perf_counter() - t0, 0, 0, backend)
    if dp:
        # Dynamic programming over the cost network, memory rows set aside:
        # when its optimum also fits in memory, it is the optimum.
        from .dp import min_sum_eliminate
        # its work budget grows with the problem: a small network that the
        # DP finds hard is a quick MIP, a large one often is not
        got = min_sum_eliminate(q, max_entries=dp_max_entries,
                                max_work=min(3e9, DP_WORK_PER_GROUP * q.num_groups))
        if got is not None:
            choice = back(got[0])
            if p.feasible(choice):
                return Solution(tuple(choice), p.objective(choice), "optimal",
                                time.perf_counter() - t0, 0, 0, "dp")
    scale = _cost_scale(q)
    backend = backend.lower()
    if backend == "highs":
        try:
            import highspy  # noqa: F401
        except ImportError:
            warnings.warn("meshplan: highspy is not available; falling back to CBC", stacklevel=2)
            backend = "cbc"
    mip = _formulate(q, scale, names=backend == "cbc" or bool(os.environ.get("MESHPLAN_ILP_DUMP")))
    warm = greedy(q)
    if backend == "highs":
        values, status = _run_highs(mip, q, warm, time_limit, threads)
    elif backend == "cbc":
        values, status = _run_cbc(mip, time_limit, threads)
    else:
        raise SolverError(f"unknown ILP back end {backend!r}: use 'highs' or 'cbc'")
    elapsed = time.perf_counter() - t0
    if status == "infeasible":
        raise _infeasible(p)
    if values is None:
        if p.memory:
            raise _infeasible(p)
        raise SolverError(f"ILP back end {backend!r} found no solution within its time limit; "
                          "raise the time limit")
    values = np.asarray(values, dtype=float)
    choice = back([0 if cols is None else int(np.argmax(values[cols])) for cols in mip.s])
    if status != "optimal":
        warnings.warn(f"meshplan: ILP stopped at its {time_limit:.0f} s time limit; using the best "
                      "plan found so far (raise time_limit for a better one)", stacklevel=2)
        status = "time_limit"
    if not p.feasible(choice):
        raise _infeasible(p)
    return Solution(tuple(choice), p.objective(choice), status, elapsed, mip.num_cols,
                    mip.num_rows, backend)


def _run_highs(mip: _Mip, q: IlpProblem, warm: list[int] | None, time_limit: float | None,
               threads: int) -> tuple[list[float] | None, str]:
    import highspy

    h = highspy.Highs()
    h.setOptionValue("output_flag", bool(_VERBOSE))
    h.setOptionValue("threads", int(threads))
    # Our problems are solved at the root node or close to it; HiGHS's presolve
    # (probing on thousands of transportation rows) costs more than it saves.
    h.setOptionValue("presolve", os.environ.get("MESHPLAN_HIGHS_PRESOLVE", "off"))
    h.setOptionValue("mip_rel_gap", 1e-7)
    h.setOptionValue("mip_abs_gap", 1e-9)
    if time_limit is not None:
        h.setOptionValue("time_limit", float(time_limit))
    lp = highspy.HighsLp()
    cost, integer = mip.columns()
    lp.num_col_ = mip.num_cols
    lp.num_row_ = mip.num_rows
    lp.col_cost_ = cost
    lp.col_lower_ = np.zeros(mip.num_cols)
    lp.col_upper_ = np.ones(mip.num_cols)
    lp.row_lower_ = np.array([-highspy.kHighsInf if not math.isfinite(x) else x for x in mip.row_lo])
    lp.row_upper_ = np.array([highspy.kHighsInf if not math.isfinite(x) else x for x in mip.row_hi])
    lp.offset_ = mip.offset
    starts = np.zeros(mip.num_rows + 1, dtype=np.int32)
    starts[1:] = np.cumsum([len(ix) for ix in mip.row_idx])
    lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
    lp.a_matrix_.start_ = starts
    lp.a_matrix_.index_ = (np.concatenate(mip.row_idx) if mip.row_idx
                           else np.zeros(0)).astype(np.int32)
    lp.a_matrix_.value_ = (np.concatenate(mip.row_val) if mip.row_val
                           else np.zeros(0)).astype(float)
    lp.integrality_ = [highspy.HighsVarType.kInteger if i else highspy.HighsVarType.kContinuous
                       for i in integer]
    if mip.names_on:
        lp.col_names_ = list(mip.names)
        lp.row_names_ = list(mip.row_names)
    h.passModel(lp)
    if os.environ.get("MESHPLAN_ILP_DUMP"):
        h.writeModel(os.environ["MESHPLAN_ILP_DUMP"])
    if warm is not None:
        sol = highspy.HighsSolution()
        sol.col_value = list(_complete_warm(mip, warm))
        sol.value_valid = True
        try:
            h.setSolution(sol)
        except Exception:  # noqa: BLE001 - an older highspy: start cold
            pass
    h.run()
    ms = h.getModelStatus()
    S = highspy.HighsModelStatus
    if ms == S.kInfeasible:
        return None, "infeasible"
    info = h.getInfo()
    has = int(getattr(info, "primal_solution_status", 0)) == 2
    values = list(h.getSolution().col_value) if has else None
    return values, ("optimal" if ms == S.kOptimal else "time_limit")


def _complete_warm(mip: _Mip, warm: list[int]) -> np.ndarray:
    """The full column vector (binaries and transportation variables) of a
    choice, so that HiGHS takes it as its first incumbent."""
    x = np.zeros(mip.num_cols)
    for g, cols in enumerate(mip.s):
        if cols is not None:
            x[cols[warm[g]]] = 1.0
    for u, v, row_of, col_of, ev in mip.pairs:
        x[ev[row_of[warm[u]], col_of[warm[v]]]] = 1.0
    return x


def _run_cbc(mip: _Mip, time_limit: float | None, threads: int
             ) -> tuple[list[float] | None, str]:
    import pulp

    prob = pulp.LpProblem("meshplan_intra_op", pulp.LpMinimize)
    cost, integer = mip.columns()
    xs = [pulp.LpVariable(n, lowBound=0, upBound=1, cat="Binary" if i else "Continuous")
          for n, i in zip(mip.names, integer)]
    for idx, val, lo, hi, name in zip(mip.row_idx, mip.row_val, mip.row_lo, mip.row_hi,
                                      mip.row_names):
        expr = pulp.LpAffineExpression([(xs[int(i)], float(v)) for i, v in zip(idx, val)])
        if lo == hi:
            prob += pulp.LpConstraint(expr, pulp.LpConstraintEQ, name, lo)
        else:
            prob += pulp.LpConstraint(expr, pulp.LpConstraintLE, name, hi)
    prob += pulp.LpAffineExpression([(x, float(c)) for x, c in zip(xs, cost) if c]) + mip.offset
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # PuLP 3.3 still bundles CBC
        solver = pulp.PULP_CBC_CMD(msg=bool(_VERBOSE), timeLimit=time_limit, threads=threads)
    if not solver.available():
        raise SolverError("no ILP solver available: install highspy (pip install highspy) "
                          "or make PuLP's bundled CBC executable")
    t0 = time.perf_counter()
    try:
        prob.solve(solver)
    except pulp.PulpSolverError as err:
        raise SolverError(f"ILP back end 'cbc' failed: {err}") from err
    status = pulp.LpStatus[prob.status]
    if status == "Infeasible":
        return None, "infeasible"
    if any(x.varValue is None for x, i in zip(xs, integer) if i):
        return None, "time_limit"
    timed_out = time_limit is not None and time.perf_counter() - t0 >= time_limit * 0.98
    return [x.varValue or 0.0 for x in xs], ("optimal" if status == "Optimal" and not timed_out
                                              else "time_limit")


_VERBOSE = bool(int(os.environ.get("MESHPLAN_ILP_LOG", "0") or 0))


def _cost_scale(p: IlpProblem) -> float:
    """Scale costs (seconds) so the solver works with numbers near 1..1e6."""
    mx = max([float(np.max(np.abs(c))) for c in p.costs if len(c)] +
             [float(np.max(np.abs(e.cost))) for e in p.edges if e.cost.size] + [0.0])
    return 1.0 if mx == 0 else 1e3 / mx


def _infeasible(p: IlpProblem) -> InfeasiblePlanError:
    budget = min((r.budget for r in p.memory), default=None)
    need = p.min_memory()
    msg = (f"the model does not fit: it needs at least {need / 2**30:.2f} GiB per device "
           f"(lower bound over all shardings of this mesh) but the budget is "
           f"{(budget or 0) / 2**30:.2f} GiB; use more devices, pipeline stages, remat, "
           "smaller micro-batches or a cluster with more memory per device")
    return InfeasiblePlanError(msg, budget_bytes=int(budget) if budget is not None else None,
                               needed_bytes=int(need))
