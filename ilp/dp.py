"""Exact min-sum variable elimination (bucket elimination) for IlpProblems.

With its memory rows set aside, an :class:`~meshplan.ilp.problem.IlpProblem` is
a pairwise cost network: minimise the sum of one cost per group and one per
edge.  Eliminating the groups one by one (each time adding up the cost tables
that mention the group and keeping, for every choice of the other groups in
them, the best choice of the eliminated one) is dynamic programming over the
graph: exact, and fast when the tables stay small.

Layered models have that shape: a few *hub* groups that every layer touches
(the residual stream and its gradient), and between them one small piece per
layer.  Pieces that are copies of each other (same costs, same edges, same
hubs: the layers of a transformer) have the same best answer for every choice
of the hubs, so each distinct piece is eliminated once and its table counted
as often as it occurs.  What remains (the hubs, the first and last layers) is
eliminated in the greedy order that always leaves the smallest table.

A table is built one strategy of the eliminated group at a time, so memory
holds tables without that group's axis.  When a table would pass
``max_entries`` entries, the most connected group is conditioned on (each of
its strategies in turn); when the work passes ``max_work`` the elimination
gives up and the caller solves the problem as an ILP instead.

This is the solver of the two elimination engines; the other,
:func:`meshplan.ilp.presolve.eliminate`, is an exact presolve that keeps the
problem an ILP (memory rows and all).  See :mod:`meshplan.ilp.presolve` for
why they stay two.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

import numpy as np

from .problem import Edge, IlpProblem

__all__ = ("min_sum_eliminate",)


class _GiveUp(Exception):
    pass


@dataclass
class _Net:
    """A cost network: tables over sorted scopes of groups."""
    sizes: list[int]
    max_entries: float
    max_work: float
    scopes: dict[int, tuple[int, ...]] = field(default_factory=dict)
    tables: dict[int, np.ndarray] = field(default_factory=dict)
    by_group: list[set[int]] = field(default_factory=list)
    next_id: int = 0
    work: float = 0.0
    max_seen: float = 0.0
    constant: float = 0.0

    def add(self, scope: tuple[int, ...], table: np.ndarray) -> None:
        if not scope:
            self.constant += float(table)
            return
        fid = self.next_id
        self.next_id += 1
        self.scopes[fid] = scope
        self.tables[fid] = table
        for g in scope:
            self.by_group[g].add(fid)

    def scope_after(self, g: int) -> tuple[int, ...]:
        sc: set[int] = set()
        for fid in self.by_group[g]:
            sc.update(self.scopes[fid])
        sc.discard(g)
        return tuple(sorted(sc))

    def eliminate(self, g: int) -> tuple[int, tuple[int, ...], np.ndarray]:
        """Take ``g`` out; returns (g, scope it depends on, argmin table).

        The table over the remaining scope is built one strategy of ``g`` at
        a time, so memory holds tables without ``g``'s axis only."""
        rest = self.scope_after(g)
        rshape = [self.sizes[h] for h in rest]
        entries = math.prod(rshape)
        if entries > self.max_entries:
            raise _GiveUp
        self.work += entries * self.sizes[g]
        self.max_seen = max(self.max_seen, entries)
        if self.work > self.max_work:
            raise _GiveUp
        parts = []
        for fid in list(self.by_group[g]):
            scope = self.scopes.pop(fid)
            table = self.tables.pop(fid)
            for h in scope:
                self.by_group[h].discard(fid)
            axis = scope.index(g)
            others = scope[:axis] + scope[axis + 1:]
            shape = [1] * len(rest)
            for h in others:
                shape[rest.index(h)] = self.sizes[h]
            parts.append((np.moveaxis(table, axis, 0), shape))
        low = np.full(rshape, np.inf)
        best = np.zeros(rshape, dtype=np.int32)
        for v in range(self.sizes[g]):
            acc = np.zeros(rshape)
            for table, shape in parts:
                acc += table[v].reshape(shape)
            better = acc < low
            np.copyto(low, acc, where=better)
            best[better] = v
        self.add(rest, low)
        return g, rest, best

    def eliminate_all(self, groups: set[int]) -> list[tuple[int, tuple[int, ...], np.ndarray]]:
        """Eliminate ``groups`` in the cheapest of a few greedy orders."""
        order = []
        for g in self.plan_order(groups):
            order.append(self.eliminate(g))
        return order

    def plan_order(self, groups: set[int], tries: int = 24) -> list[int]:
        """An elimination order for ``groups``, chosen on the scopes alone: the
        greedy one that always leaves the smallest table, and randomised
        variants of it; the one with the least work wins."""
        base: dict[int, set[int]] = {}
        for g in groups:
            sc: set[int] = set()
            for fid in self.by_group[g]:
                sc.update(self.scopes[fid])
            sc.discard(g)
            base[g] = sc
        rng = np.random.default_rng(0)
        logsize = {g: math.log(self.sizes[g]) for g in range(len(self.sizes))}
        best, best_work = None, math.inf
        for k in range(tries):
            nbr = {g: set(v) for g, v in base.items()}
            # log of the table a group's elimination would build (kept up to
            # date for the groups whose neighbourhood changes)
            weight = {g: sum(logsize[x] for x in v) for g, v in nbr.items()}
            left = set(groups)
            order, work = [], 0.0
            while left:
                if k == 0 or len(left) == 1 or rng.random() >= 0.3:
                    pick = min(left, key=lambda h: (weight[h], h))
                else:
                    ranked = heapq.nsmallest(3, left, key=lambda h: (weight[h], h))
                    pick = ranked[min(int(rng.integers(0, 3)), len(ranked) - 1)]
                sc = nbr[pick]
                work += math.exp(weight[pick] + logsize[pick])
                if work >= best_work:
                    break
                for h in sc:
                    if h in nbr:
                        nbr[h] |= sc - {h}
                        nbr[h].discard(pick)
                        weight[h] = sum(logsize[x] for x in nbr[h])
                del nbr[pick]
                left.discard(pick)
                order.append(pick)
            else:
                best, best_work = order, work
            if k == 0 and self.work + best_work > 3 * self.max_work:
                raise _GiveUp    # far over budget: no randomised order will rescue it
        if self.work + best_work > self.max_work:
            raise _GiveUp        # over budget before any table is built
        return best if best is not None else sorted(groups)


def _network(p: IlpProblem, max_entries: float, max_work: float) -> _Net:
    net = _Net([len(c) for c in p.costs], max_entries, max_work)
    net.by_group = [set() for _ in range(p.num_groups)]
    for g, c in enumerate(p.costs):
        net.add((g,), np.asarray(c, dtype=float))
    loops, pairs = p.pair_tables()
    for g, diag in loops:
        net.add((g,), diag)
    for key, mat in pairs.items():
        net.add(key, mat)
    return net


def _hubs_and_pieces(net: _Net, n: int) -> tuple[set[int], list[list[int]]]:
    """Groups with far more neighbours than nearly all others (more than three
    times the 95th percentile), and the connected pieces of the rest."""
    nbr: list[set[int]] = [set() for _ in range(n)]
    for scope in net.scopes.values():
        for a in scope:
            nbr[a].update(x for x in scope if x != a)
    deg = sorted(len(s) for s in nbr)
    typical = deg[min(len(deg) - 1, int(0.95 * len(deg)))] if deg else 0
    hubs = {g for g in range(n) if len(nbr[g]) > max(12, 3 * typical)}
    seen: set[int] = set(hubs)
    pieces = []
    for g in range(n):
        if g in seen:
            continue
        stack, piece = [g], []
        seen.add(g)
        while stack:
            x = stack.pop()
            piece.append(x)
            for y in nbr[x]:
                if y not in seen:
                    seen.add(y)
                    stack.append(y)
        pieces.append(sorted(piece))
    return hubs, pieces


def _signature(net: _Net, piece: list[int], hubs: set[int]) -> tuple:
    """Equal for pieces that are copies of each other (same tables, same hubs)."""
    local = {g: i for i, g in enumerate(piece)}
    members = set(piece)
    fids = sorted({f for g in piece for f in net.by_group[g]})
    items = []
    for fid in fids:
        scope = net.scopes[fid]
        if not set(scope) <= members | hubs:
            return ("unique", piece[0])
        key = tuple(("p", local[g]) if g in members else ("h", g) for g in scope)
        table = net.tables[fid]
        items.append((key, table.shape, table.tobytes()))
    items.sort()
    return tuple(items)


def min_sum_eliminate(p: IlpProblem, *, max_entries: int = 1 << 25,
                      max_work: float = 3e9, condition_depth: int = 1, debug: bool = False
                      ) -> tuple[list[int], float] | None:
    """The optimal choice of ``p`` (ignoring its memory rows) and its value, by
    variable elimination, or None when it would take too much (a table of
    more than ``max_entries`` entries, or ``max_work`` entries in all).

    When a table would be too large, the group that most others depend on is
    *conditioned on*: each of its strategies in turn is fixed (its edges become
    costs of its neighbours) and the smaller problem is eliminated; the best
    of those answers is the optimum.  ``condition_depth`` bounds how many
    groups may be conditioned on in this way, one inside the other.  ``debug``
    prints the largest table and the work of each attempt."""
    got = _eliminate(p, max_entries, max_work, debug)
    if got is not None or condition_depth <= 0:
        return got
    return _conditioned(p, max_entries, max_work, condition_depth, debug)


def _conditioned(p: IlpProblem, max_entries: int, max_work: float, depth: int,
                 debug: bool = False) -> tuple[list[int], float] | None:
    n = p.num_groups
    nbr: list[set[int]] = [set() for _ in range(n)]
    for e in p.edges:
        if e.u != e.v:
            nbr[e.u].add(e.v)
            nbr[e.v].add(e.u)
    hub = max(range(n), key=lambda g: (len(nbr[g]) * math.log(max(len(p.costs[g]), 2)), -g))
    if len(p.costs[hub]) <= 1 or not nbr[hub]:
        return None
    rest = [g for g in range(n) if g != hub]
    new_of = {g: k for k, g in enumerate(rest)}
    # the whole budget is shared by the conditioned sub-problems
    budget = max_work / len(p.costs[hub])
    best: tuple[list[int], float] | None = None
    for v in range(len(p.costs[hub])):
        costs = [np.asarray(p.costs[g], dtype=float).copy() for g in rest]
        edges = []
        for e in p.edges:
            if e.u == hub and e.v == hub:
                continue
            if e.u == hub:
                costs[new_of[e.v]] += e.cost[v, :]
            elif e.v == hub:
                costs[new_of[e.u]] += e.cost[:, v]
            else:
                edges.append(Edge(new_of[e.u], new_of[e.v], e.cost, e.name))
        q = IlpProblem([p.names[g] for g in rest], costs, edges)
        got = min_sum_eliminate(q, max_entries=max_entries, max_work=budget,
                                condition_depth=depth - 1, debug=debug)
        if got is None:
            return None
        sub, _ = got
        choice = [0] * n
        for g, c in zip(rest, sub):
            choice[g] = c
        choice[hub] = v
        val = p.objective(choice)
        if best is None or val < best[1]:
            best = (choice, val)
    return best


def _eliminate(p: IlpProblem, max_entries: int, max_work: float, debug: bool = False
               ) -> tuple[list[int], float] | None:
    n = p.num_groups
    net = _network(p, max_entries, max_work)
    # (group, groups its choice depends on, argmin table), in elimination order
    order: list[tuple[int, tuple[int, ...], np.ndarray]] = []
    try:
        hubs, pieces = _hubs_and_pieces(net, n)
        by_sig: dict[tuple, list[list[int]]] = {}
        for piece in pieces:
            by_sig.setdefault(_signature(net, piece, hubs), []).append(piece)
        for sig, copies in by_sig.items():
            if len(copies) == 1 or sig[:1] == ("unique",):
                continue
            first = copies[0]
            start = net.next_id
            recs = net.eliminate_all(set(first))
            # what the piece leaves behind: tables over hubs, made just now
            left = [(f, net.scopes[f]) for f in net.scopes if f >= start]
            order.extend(recs)
            for other in copies[1:]:
                m = dict(zip(first, other))
                for f in {f for g in other for f in net.by_group[g]}:
                    for h in net.scopes.pop(f):
                        net.by_group[h].discard(f)
                    net.tables.pop(f)
                for f, scope in left:
                    net.add(scope, net.tables[f].copy())
                for g, rest, best in recs:
                    order.append((m[g], tuple(m.get(h, h) for h in rest), best))
        done = {r[0] for r in order}
        order.extend(net.eliminate_all(set(range(n)) - done))
    except _GiveUp:
        if debug:
            print("dp gave up: max table", net.max_seen, "work", net.work)
        return None
    if debug:
        print("dp max table", net.max_seen, "work", net.work)
    choice = [0] * n
    for g, rest, best in reversed(order):
        choice[g] = int(best[tuple(choice[h] for h in rest)]) if rest else int(best)
    return choice, net.constant
