"""Exact reductions of an :class:`~meshplan.ilp.problem.IlpProblem`.

Before the dynamic programming of :mod:`meshplan.ilp.dp` or a MIP back end
sees a problem, :func:`presolve` shrinks it without changing its optimum:

* :func:`reduce_problem` drops dominated strategies;
* :func:`eliminate` takes out groups with at most two neighbours.

Two variable-elimination engines, two jobs.  :func:`eliminate` here is a
*presolve*: its result must still be an ILP that a MIP back end can take, so
it keeps every memory row (a group that a binding row depends on stays),
only ever leaves pairwise tables (edges) behind, and eliminates a group only
when the merged edge needs no more MIP variables than what it replaces.
:func:`meshplan.ilp.dp.min_sum_eliminate` is a *solver*: it sets the memory
rows aside, eliminates every group, builds tables over any number of groups
and solves copies of a layer once; its answer is only taken when it happens
to fit in memory.  Both start from :meth:`IlpProblem.pair_tables`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from .problem import Edge, IlpProblem, MemoryRow


def classes(matrix: np.ndarray, axis: int) -> list[list[int]]:
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
# Dominated strategies
# ---------------------------------------------------------------------------

@dataclass
class Reduced:
    """``p`` after exact reductions, with the way back to ``p``'s indices."""
    problem: IlpProblem
    keep: list[np.ndarray]          # per original group: kept strategy indices (into p)
    removed: int                    # strategies removed as dominated or duplicate

    def lift(self, sub: Sequence[int]) -> list[int]:
        """A choice of :attr:`problem` as a choice of the problem reduced."""
        return [int(self.keep[g][c]) for g, c in enumerate(sub)]


def _memory_of_groups(p: IlpProblem) -> list[list[np.ndarray]]:
    """Per group: its usage in every memory row that can bind and depends on it."""
    mem_of: list[list[np.ndarray]] = [[] for _ in range(p.num_groups)]
    for row in p.memory:
        if not row.can_bind():
            continue
        for g, c in row.coefs.items():
            if np.ptp(c) > 0:
                mem_of[g].append(np.asarray(c, dtype=float))
    return mem_of


def _dominated(p: IlpProblem, g: int, keep: list[np.ndarray],
               incident: list[tuple[int, bool]], mem: list[np.ndarray], eps: float) -> np.ndarray:
    """Which kept strategies of ``g`` stay (a mask over ``keep[g]``): each one
    dropped is dominated by one that stays."""
    ks = keep[g]
    k = len(ks)
    c = np.asarray(p.costs[g], dtype=float)[ks]
    D = c[:, None] - c[None, :]                     # D[a, b]: switching b -> a
    for kk, is_u in incident:
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
    for mc in mem:
        m = mc[ks]
        ok &= m[:, None] <= m[None, :] * (1 + 1e-12) + 1e-9
    np.fill_diagonal(ok, False)
    alive = np.ones(k, dtype=bool)
    for b in range(k):
        if (ok[:, b] & alive).any():
            alive[b] = False
    return alive


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
    mem_of = _memory_of_groups(p)
    big = max([float(np.max(np.abs(c))) for c in p.costs if len(c)] +
              [float(np.max(np.abs(e.cost))) for e in p.edges if e.cost.size] + [1e-300])
    eps = tol * big

    removed = 0
    dirty = list(range(n))
    in_dirty = set(dirty)
    while dirty:
        g = dirty.pop()
        in_dirty.discard(g)
        if len(keep[g]) <= 1:
            continue
        alive = _dominated(p, g, keep, incident[g], mem_of[g], eps)
        if not alive.all():
            removed += int((~alive).sum())
            keep[g] = keep[g][alive]
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


# ---------------------------------------------------------------------------
# Elimination of groups of degree <= 2
# ---------------------------------------------------------------------------

@dataclass
class Elimination:
    """How to recover the groups that :func:`eliminate` took out of the ILP."""
    order: list[tuple[int, tuple[int, ...], np.ndarray]]   # (group, neighbours, argmin table)
    remaining: list[int]                                    # old index of each new group
    offset: float                                           # cost of fixed parts
    num_groups: int = 0                                     # groups of the problem eliminated

    def recover(self, sub_choice: Sequence[int], n: int) -> list[int]:
        choice = [-1] * n
        for new, old in enumerate(self.remaining):
            choice[old] = int(sub_choice[new])
        for g, nbrs, table in reversed(self.order):
            choice[g] = int(table[tuple(choice[h] for h in nbrs)]) if nbrs else int(table)
        return choice

    def lift(self, sub: Sequence[int]) -> list[int]:
        """A choice of the reduced problem as a choice of the problem eliminated."""
        return self.recover(sub, self.num_groups)


def _n_vars(mat: np.ndarray) -> int:
    """Transportation variables the MIP needs for an edge table."""
    if mat.shape[0] == 1 or mat.shape[1] == 1 or not np.any(mat):
        return 0
    return len(classes(mat, 0)) * len(classes(mat, 1))


@dataclass
class _Network:
    """The pairwise cost network :func:`eliminate` works on."""
    unary: dict[int, np.ndarray]
    edges: dict[tuple[int, int], np.ndarray]        # (a, b), a < b
    nbr: dict[int, set[int]] = field(default_factory=dict)

    @classmethod
    def of(cls, p: IlpProblem) -> "_Network":
        unary = {g: np.asarray(c, dtype=float).copy() for g, c in enumerate(p.costs)}
        loops, edges = p.pair_tables()
        for g, diag in loops:
            unary[g] += diag
        nbr: dict[int, set[int]] = {g: set() for g in range(p.num_groups)}
        for a, b in edges:
            nbr[a].add(b)
            nbr[b].add(a)
        return cls(unary, edges, nbr)

    def edge(self, a: int, b: int) -> np.ndarray:
        return self.edges[(a, b)] if a < b else self.edges[(b, a)].T

    def take_out_pair(self, h: int, a: int, b: int, max_table: int, growth: float
                      ) -> np.ndarray | None:
        """Eliminate ``h`` between its neighbours ``a < b`` into an edge
        ``a``-``b``; its argmin table, or None (nothing changed) when the
        table or the MIP variables it needs would grow too much."""
        c = self.unary[h]
        if len(c) * len(self.unary[a]) * len(self.unary[b]) > max_table:
            return None
        ha, hb = self.edge(h, a), self.edge(h, b)
        tot = c[:, None, None] + ha[:, :, None] + hb[:, None, :]
        linked = b in self.nbr[a]
        merged = tot.min(axis=0) + (self.edge(a, b) if linked else 0.0)
        old = len(c) + _n_vars(ha) + _n_vars(hb) + (_n_vars(self.edge(a, b)) if linked else 0)
        if _n_vars(merged) > growth * old:
            return None
        self.edges[(a, b)] = merged
        self.nbr[a].add(b)
        self.nbr[b].add(a)
        return np.argmin(tot, axis=0)

    def detach(self, h: int, nb: tuple[int, ...]) -> None:
        for x in nb:
            self.edges.pop((min(h, x), max(h, x)), None)
            self.nbr[x].discard(h)
        self.nbr[h] = set()


def _pinned(p: IlpProblem) -> tuple[list[MemoryRow], set[int]]:
    """Memory rows that can bind, and the groups whose usage they depend on."""
    rows, pinned = [], set()
    for row in p.memory:
        if not row.can_bind():
            continue   # holds whatever is chosen
        rows.append(row)
        for g, c in row.coefs.items():
            if np.ptp(c) > 0:
                pinned.add(g)
    return rows, pinned


def eliminate(p: IlpProblem, *, max_table: int = 1 << 22, growth: float = 1.0
              ) -> tuple[IlpProblem, Elimination]:
    """Variable elimination (dynamic programming) on groups of degree <= 2.

    A group whose choice only interacts with at most two other groups (and
    with no memory row that could bind) is taken out: with one neighbour ``n``
    its best strategy for each choice of ``n`` becomes a cost of ``n``; with
    two neighbours ``a, b`` the best for each pair becomes an edge ``a``-``b``
    (kept only when that edge needs no more variables than what it replaces,
    times ``growth``).  Exact: the reduced problem has the same optimum, and
    :meth:`Elimination.recover` rebuilds the eliminated choices.
    """
    n = p.num_groups
    net = _Network.of(p)
    rows, pinned = _pinned(p)
    order: list[tuple[int, tuple[int, ...], np.ndarray]] = []
    alive = set(range(n))
    queue = list(range(n))
    offset = 0.0
    while queue:
        h = queue.pop()
        if h not in alive or h in pinned or len(net.nbr[h]) > 2:
            continue
        nb = tuple(sorted(net.nbr[h]))
        c = net.unary[h]
        if len(nb) == 0:
            i = int(np.argmin(c))
            offset += float(c[i])
            order.append((h, (), np.array(i)))
        elif len(nb) == 1:
            a = nb[0]
            tot = c[:, None] + net.edge(h, a)                  # [h, a]
            order.append((h, (a,), np.argmin(tot, axis=0)))
            net.unary[a] = net.unary[a] + tot.min(axis=0)
        else:
            best = net.take_out_pair(h, nb[0], nb[1], max_table, growth)
            if best is None:
                continue
            order.append((h, nb, best))
        net.detach(h, nb)
        queue.extend(nb)
        alive.discard(h)
    return _remaining_problem(p, net, rows, alive), Elimination(order, sorted(alive), offset, n)


def _remaining_problem(p: IlpProblem, net: _Network, rows: list[MemoryRow],
                       alive: set[int]) -> IlpProblem:
    """The groups ``alive`` with what elimination left of their costs, edges
    and memory rows (renumbered in order)."""
    remaining = sorted(alive)
    new_of = {g: k for k, g in enumerate(remaining)}
    costs = [net.unary[g] for g in remaining]
    new_edges = [Edge(new_of[a], new_of[b], mat, f"edge_{p.names[a]}_{p.names[b]}")
                 for (a, b), mat in net.edges.items() if a in alive and b in alive]
    memory = []
    for row in rows:
        const = sum(float(c[0]) for g, c in row.coefs.items() if g not in alive)
        memory.append(MemoryRow({new_of[g]: c for g, c in row.coefs.items() if g in alive},
                                row.budget - const, row.name))
    return IlpProblem([p.names[g] for g in remaining], costs, new_edges, memory)


# ---------------------------------------------------------------------------
# The pipeline solve applies
# ---------------------------------------------------------------------------

@dataclass
class Presolved:
    """A problem after :func:`presolve`, with the way back: ``steps`` in the
    order applied, each a :class:`Reduced` or an :class:`Elimination`."""
    problem: IlpProblem
    steps: list[Reduced | Elimination] = field(default_factory=list)

    def lift(self, sub: Sequence[int]) -> list[int]:
        """A choice of :attr:`problem` as a choice of the original problem."""
        choice = [int(c) for c in sub]
        for step in reversed(self.steps):
            choice = step.lift(choice)
        return choice

    def project(self, choice: Sequence[int]) -> list[int]:
        """A choice of the original problem as one of :attr:`problem` (for a
        warm start): eliminated groups dropped, and a strategy removed as
        dominated replaced by the cheapest kept one of its group."""
        ch = [int(c) for c in choice]
        for step in self.steps:
            if isinstance(step, Elimination):
                ch = [ch[old] for old in step.remaining]
            else:
                ch = [int(np.flatnonzero(keep == c)[0]) if np.any(keep == c)
                      else int(np.argmin(cost)) for c, keep, cost
                      in zip(ch, step.keep, step.problem.costs)]
        return ch


def presolve(p: IlpProblem) -> Presolved:
    """Dominated strategies, then variable elimination of groups with at most
    two neighbours, then dominance again; a second round of elimination (and
    dominance) when pruning left groups with fewer neighbours."""
    red = reduce_problem(p)
    q1, elim = eliminate(red.problem)
    red2 = reduce_problem(q1)
    steps: list[Reduced | Elimination] = [red, elim, red2]
    q2, elim2 = eliminate(red2.problem)
    if not elim2.order:
        return Presolved(red2.problem, steps)
    red3 = reduce_problem(q2)
    return Presolved(red3.problem, steps + [elim2, red3])


def reduced(p: IlpProblem) -> IlpProblem:
    """``p`` after the exact reductions :func:`~meshplan.ilp.solvers.solve` applies before a back end."""
    return presolve(p).problem


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


def repair(p: IlpProblem, seed: Sequence[int], passes: int = 20) -> list[int] | None:
    """A choice of ``p`` that fits its memory rows, made from ``seed`` (a
    choice that may not fit, such as the plan of the same layer under a
    looser cap): while a row is over its budget, the strategy change that
    frees the most excess bytes per unit of added cost (given the
    neighbours' strategies) is taken; then each group in turn takes its
    cheapest strategy that still fits, until a pass changes nothing.  A warm
    start for the solver (None: nothing fitting was reached)."""
    n = p.num_groups
    ch = [int(c) for c in seed]
    if len(ch) != n or any(not 0 <= c < len(k) for c, k in zip(ch, p.costs)):
        return None     # (not a choice of this problem)
    adj: list[list[tuple[int, np.ndarray]]] = [[] for _ in range(n)]
    loops = [np.zeros(len(c)) for c in p.costs]
    for e in p.edges:
        if e.u == e.v:
            loops[e.u] = loops[e.u] + np.diag(e.cost)
        else:
            adj[e.u].append((e.v, e.cost))
            adj[e.v].append((e.u, e.cost.T))
    budget = np.array([row.budget * (1 + 1e-9) + 1e-6 for row in p.memory])
    # group -> its bytes in each row, per strategy (rows x strategies)
    rows = [np.array([np.asarray(row.coefs[g], dtype=float) if g in row.coefs
                      else np.zeros(len(p.costs[g])) for row in p.memory]).reshape(
                          len(p.memory), len(p.costs[g])) for g in range(n)]
    use = np.array(p.memory_use(ch)) if p.memory else np.zeros(0)

    def local(g: int) -> np.ndarray:
        c = np.asarray(p.costs[g], dtype=float) + loops[g]
        for h, mat in adj[g]:
            c = c + mat[:, ch[h]]
        return c

    while np.any(use > budget):
        over = np.maximum(use - budget, 0.0).sum()
        best = None
        for g in range(n):
            d = rows[g] - rows[g][:, [ch[g]]]
            freed = over - np.maximum(use[:, None] + d - budget[:, None], 0.0).sum(0)
            if not np.any(freed > 0):
                continue
            c = local(g)
            score = np.where(freed > 0, np.maximum(c - c[ch[g]], 0.0) / np.maximum(freed, 1e-300),
                             np.inf)
            i = int(np.argmin(score))
            if best is None or score[i] < best[0]:
                best = (score[i], g, i)
        if best is None:
            return None
        _, g, i = best
        use = use + rows[g][:, i] - rows[g][:, ch[g]]
        ch[g] = i
    for _ in range(passes):
        changed = False
        for g in range(n):
            d = rows[g] - rows[g][:, [ch[g]]]
            c = np.where(np.all(use[:, None] + d <= budget[:, None], axis=0), local(g), np.inf)
            i = int(np.argmin(c))
            if c[i] < c[ch[g]]:
                use = use + d[:, i]
                ch[g], changed = i, True
        if not changed:
            break
    return ch if p.feasible(ch) else None
