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
import time
import warnings
from dataclasses import dataclass, field

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
    seen: dict[bytes, list[int]] = {}
    for i in range(m.shape[0]):
        seen.setdefault(np.ascontiguousarray(m[i]).tobytes(), []).append(i)
    return list(seen.values())


def solve(p: IlpProblem, *, backend: str = "highs", time_limit: float | None = 60.0,
          threads: int = 1) -> Solution:
    """Optimal (or best within ``time_limit``) strategy choice for ``p``."""
    import pulp

    t0 = time.perf_counter()
    if all(len(c) == 1 for c in p.costs):
        choice = tuple(0 for _ in p.costs)
        if not p.feasible(list(choice)):
            raise _infeasible(p)
        return Solution(choice, p.objective(list(choice)), "trivial",
                        time.perf_counter() - t0, 0, 0, "none")

    scale = _cost_scale(p)
    prob = pulp.LpProblem("meshplan_intra_op", pulp.LpMinimize)
    s: list[list] = []
    n_vars = 0
    objective = []
    for g, (name, cost) in enumerate(zip(p.names, p.costs)):
        if len(cost) == 1:
            s.append([1])
            objective.append(float(cost[0]) * scale)
            continue
        vs = [pulp.LpVariable(f"s_{name}_{i}", cat="Binary") for i in range(len(cost))]
        n_vars += len(vs)
        s.append(vs)
        prob += pulp.lpSum(vs) == 1, f"one_{name}"
        objective.extend(float(c) * scale * v for c, v in zip(cost, vs) if c != 0)

    for k, e in enumerate(p.edges):
        if not np.any(e.cost):
            continue
        rows, cols = _classes(e.cost, 0), _classes(e.cost, 1)
        su, sv = s[e.u], s[e.v]
        if len(rows) == 1 or len(cols) == 1:
            # cost depends on one side only: fold it into that side's terms
            if len(rows) == 1:
                objective.extend(float(e.cost[0, j]) * scale * sv[j] for j in range(len(sv))
                                 if e.cost[0, j] != 0)
            else:
                objective.extend(float(e.cost[i, 0]) * scale * su[i] for i in range(len(su))
                                 if e.cost[i, 0] != 0)
            continue
        ename = e.name or f"e{k}"
        evars = {}
        for a, r in enumerate(rows):
            for b, c in enumerate(cols):
                var = pulp.LpVariable(f"{ename}_{a}_{b}", lowBound=0)
                evars[a, b] = var
                val = float(e.cost[r[0], c[0]])
                if val:
                    objective.append(val * scale * var)
        n_vars += len(evars)
        for a, r in enumerate(rows):
            prob += (pulp.lpSum(evars[a, b] for b in range(len(cols)))
                     == pulp.lpSum(su[i] for i in r)), f"{ename}_row{a}"
        for b, c in enumerate(cols[:-1]):  # the last column's balance is implied
            prob += (pulp.lpSum(evars[a, b] for a in range(len(rows)))
                     == pulp.lpSum(sv[j] for j in c)), f"{ename}_col{b}"

    for k, row in enumerate(p.memory):
        terms = []
        const = 0.0
        for g, coef in row.coefs.items():
            if len(coef) == 1:
                const += float(coef[0])
            else:
                terms.extend(float(c) * v for c, v in zip(coef, s[g]) if c)
        prob += pulp.lpSum(terms) <= row.budget - const, row.name or f"mem{k}"

    prob += pulp.lpSum(objective)
    solver = _solver(pulp, backend, time_limit, threads)
    try:
        prob.solve(solver)
    except pulp.PulpSolverError as err:
        raise SolverError(f"ILP back end {backend!r} failed: {err}") from err
    status = pulp.LpStatus[prob.status]
    elapsed = time.perf_counter() - t0
    if status == "Infeasible":
        raise _infeasible(p)
    if status not in ("Optimal",):
        # a time limit hit with an incumbent reports "Not Solved"/"Optimal" depending on the solver
        if not all(v.varValue is not None for vs in s for v in vs if not isinstance(v, int)):
            if p.memory:
                raise _infeasible(p)
            raise SolverError(f"ILP back end {backend!r} returned {status} with no solution; "
                              "raise the time limit")
    choice = []
    for vs in s:
        if len(vs) == 1:
            choice.append(0)
        else:
            vals = [v.varValue or 0.0 for v in vs]
            choice.append(int(np.argmax(vals)))
    timed_out = time_limit is not None and elapsed >= time_limit * 0.98
    if status != "Optimal" or timed_out:
        warnings.warn(f"meshplan: ILP stopped at its {time_limit:.0f} s time limit; using the best "
                      "plan found so far (raise time_limit for a better one)", stacklevel=2)
        status = "time_limit"
    else:
        status = "optimal"
    n_cons = prob.numConstraints()
    if not p.feasible(choice):
        raise _infeasible(p)
    return Solution(tuple(choice), p.objective(choice), status, elapsed, n_vars, n_cons, backend)


def _cost_scale(p: IlpProblem) -> float:
    """Scale costs (seconds) so the solver works with numbers near 1..1e6."""
    mx = max([float(np.max(np.abs(c))) for c in p.costs if len(c)] +
             [float(np.max(np.abs(e.cost))) for e in p.edges if e.cost.size] + [0.0])
    return 1.0 if mx == 0 else 1e3 / mx


def _solver(pulp, backend: str, time_limit: float | None, threads: int):
    backend = backend.lower()
    if backend == "highs":
        try:
            import highspy  # noqa: F401
            return pulp.HiGHS(msg=False, timeLimit=time_limit, threads=threads)
        except (ImportError, AttributeError, pulp.PulpSolverError):
            warnings.warn("meshplan: highspy is not available; falling back to CBC", stacklevel=3)
            backend = "cbc"
    if backend == "cbc":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # PuLP 3.3 still bundles CBC
            solver = pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit, threads=threads)
        if not solver.available():
            raise SolverError("no ILP solver available: install highspy (pip install highspy) "
                              "or make PuLP's bundled CBC executable")
        return solver
    raise SolverError(f"unknown ILP back end {backend!r}: use 'highs' or 'cbc'")


def _infeasible(p: IlpProblem) -> InfeasiblePlanError:
    budget = min((r.budget for r in p.memory), default=None)
    need = p.min_memory()
    msg = (f"the model does not fit: it needs at least {need / 2**30:.2f} GiB per device "
           f"(lower bound over all shardings of this mesh) but the budget is "
           f"{(budget or 0) / 2**30:.2f} GiB; use more devices, pipeline stages, remat, "
           "smaller micro-batches or a cluster with more memory per device")
    return InfeasiblePlanError(msg, budget_bytes=int(budget) if budget is not None else None,
                               needed_bytes=int(need))
