"""Solving an :class:`~meshplan.ilp.problem.IlpProblem`: :func:`solve`.

:func:`solve` presolves the problem exactly (:mod:`meshplan.ilp.presolve`),
tries dynamic programming (:mod:`meshplan.ilp.dp`) and otherwise writes the
MIP and hands it to a back end: HiGHS (highspy) or PuLP's bundled CBC.

Edges are linearised on their distinct rows and columns: strategies of ``u``
with identical rows of ``R`` (same output layout) collapse to one class, the
same for the columns, and the edge variables ``e_pq`` form a transportation
polytope (``sum_q e_pq = sum_{i in p} s_ui``, ``sum_p e_pq = sum_{j in q} s_vj``),
which is exact for one-hot ``s`` and tight in the LP relaxation.
"""
from __future__ import annotations

import math
import os
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from ..errors import InfeasiblePlanError, SolverError, warn
from ..units import human_bytes
from .dp import min_sum_eliminate
from .options import SolverOptions
from .presolve import Presolved, classes, greedy, presolve, repair
from .problem import IlpProblem, Solution


# ---------------------------------------------------------------------------
# The MIP in matrix form, shared by the back ends
# ---------------------------------------------------------------------------

@dataclass
class _Mip:
    """Columns (all in [0, 1]) and rows as numpy blocks.  Names (for CBC and
    LP dumps) are made only when ``names_on``: a HiGHS solve never reads them."""
    names_on: bool = False
    scale: float = 1.0            # objective units per second of cost
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


def _fold_edges(p: IlpProblem, unary: list[np.ndarray]
                ) -> list[tuple[int, int, np.ndarray, str]]:
    """Merge the edges of each pair of groups; fold what depends on one side
    only into ``unary`` (in place); the edges left need pair variables."""
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
    return pair_edges


def _add_pair_edge(m: _Mip, k: int, u: int, v: int, mat: np.ndarray, name: str) -> None:
    """Transportation variables of one edge on its distinct rows and columns,
    balanced against the one-hot binaries of ``u`` and ``v``."""
    rows, cols = classes(mat, 0), classes(mat, 1)
    R, C = len(rows), len(cols)
    su, sv = m.s[u], m.s[v]
    ename = _safe(name or f"e{k}")
    first_r = np.array([r[0] for r in rows])
    first_c = np.array([c[0] for c in cols])
    ev = m.cols((mat[np.ix_(first_r, first_c)] * m.scale).ravel(), False,
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


def _add_memory_rows(m: _Mip, p: IlpProblem) -> None:
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


def _formulate(p: IlpProblem, scale: float, names: bool = False) -> _Mip:
    """One-hot binaries per group; per edge, after folding what depends on one
    side only, transportation variables on the distinct rows and columns."""
    m = _Mip(names_on=names, scale=scale)
    unary = [np.asarray(c, dtype=float).copy() for c in p.costs]
    pair_edges = _fold_edges(p, unary)
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
        _add_pair_edge(m, k, u, v, mat, name)
    _add_memory_rows(m, p)
    return m


def formulation_size(p: IlpProblem) -> tuple[int, int]:
    """(variables, constraints) of the MIP that a back end would get for ``p``."""
    m = _formulate(p, 1.0)
    return m.num_cols, m.num_rows


# table entries the elimination DP may touch per group before the MIP takes over
DP_WORK_PER_GROUP = 2e6


def solve(p: IlpProblem, *, backend: str = "highs", time_limit: float | None = 60.0,
          threads: int = 1, reduce: bool = True, dp: bool = True,
          dp_max_entries: int = 1 << 25, options: SolverOptions = SolverOptions(),
          gap: float = 0.0, seed: Sequence[int] | None = None) -> Solution:
    """Optimal (or best within ``time_limit``) strategy choice for ``p``.

    The problem is first reduced exactly (:func:`~meshplan.ilp.presolve.presolve`).
    With ``dp`` the rest is solved by variable elimination
    (:func:`~meshplan.ilp.dp.min_sum_eliminate`)
    when its tables stay under ``dp_max_entries`` (and its work under
    ``DP_WORK_PER_GROUP`` per group) and its answer fits the memory rows
    (``Solution.backend == "dp"``).
    Otherwise the MIP goes to ``backend``: ``"highs"`` (highspy) or ``"cbc"``
    (PuLP's bundled CBC).  ``reduce=False, dp=False`` hands the unreduced
    formulation to the back end.  ``seed``: a choice of ``p`` near the
    optimum that may not fit its memory rows (the plan of the same problem
    with a looser row): the MIP starts from it made to fit
    (:func:`~meshplan.ilp.presolve.repair`).  It changes where the solver
    starts, not what it proves."""
    t0 = time.perf_counter()
    if p.surely_infeasible():      # (a capped layer's MIP would prove it in seconds)
        raise _infeasible(p)
    if all(len(c) == 1 for c in p.costs):
        choice = tuple(0 for _ in p.costs)
        if not p.feasible(list(choice)):
            raise _infeasible(p)
        return Solution(choice, p.objective(list(choice)), "trivial",
                        time.perf_counter() - t0, 0, 0, "none")
    pre = presolve(p) if reduce else Presolved(p)
    q = pre.problem
    if all(len(c) == 1 for c in q.costs):
        choice = pre.lift([0] * q.num_groups)
        if not p.feasible(choice):
            raise _infeasible(p)
        return Solution(tuple(choice), p.objective(choice), "optimal",
                        time.perf_counter() - t0, 0, 0, backend)
    if dp:
        # Dynamic programming over the cost network, memory rows set aside:
        # when its optimum also fits in memory, it is the optimum.  Its work
        # budget grows with the problem: a small network that the DP finds
        # hard is a quick MIP, a large one often is not.
        got = min_sum_eliminate(q, max_entries=dp_max_entries,
                                max_work=min(3e9, DP_WORK_PER_GROUP * q.num_groups),
                                debug=options.dp_debug)
        if got is not None:
            choice = pre.lift(got[0])
            if p.feasible(choice):
                return Solution(tuple(choice), p.objective(choice), "optimal",
                                time.perf_counter() - t0, 0, 0, "dp")
    return _solve_mip(p, pre, backend=backend, time_limit=time_limit, threads=threads,
                      options=options, t0=t0, gap=gap, seed=seed)


def _solve_mip(p: IlpProblem, pre: Presolved, *, backend: str, time_limit: float | None,
               threads: int, options: SolverOptions, t0: float, gap: float = 0.0,
               seed: Sequence[int] | None = None) -> Solution:
    """The presolved problem as a MIP, solved by ``backend``; the answer as a choice of ``p``."""
    q = pre.problem
    scale = _cost_scale(q)
    backend = backend.lower()
    if backend == "highs":
        try:
            import highspy  # noqa: F401
        except ImportError:
            warn("meshplan: highspy is not available; falling back to CBC")
            backend = "cbc"
    mip = _formulate(q, scale, names=backend == "cbc" or options.names)
    # (HiGHS spends most of a capped layer's MIP at its root looking for
    # plans that its uncapped plan, made to fit, nearly is already)
    warm = repair(q, pre.project(seed)) if seed is not None and len(seed) == p.num_groups \
        else None
    if warm is None:
        warm = greedy(q)
    if backend == "highs":
        values, status = _run_highs(mip, warm, time_limit, threads, options, gap)
    elif backend == "cbc":
        values, status = _run_cbc(mip, time_limit, threads, options, gap)
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
    choice = pre.lift([0 if cols is None else int(np.argmax(values[cols])) for cols in mip.s])
    if status != "optimal":
        warn(f"meshplan: ILP stopped at its {time_limit:.0f} s time limit; using the best "
             "plan found so far (raise time_limit for a better one)")
        status = "time_limit"
    if not p.feasible(choice):
        raise _infeasible(p)
    return Solution(tuple(choice), p.objective(choice), status, elapsed, mip.num_cols,
                    mip.num_rows, backend, gap)


def _new_highs(quiet: bool) -> Any:
    """A HiGHS instance.  HiGHS prints its banner on the process's standard
    output (file descriptor 1, below Python) when the first instance is made;
    ``quiet`` sends that to /dev/null, so that nothing but the plan reaches
    stdout (``meshplan plan ... > plan.txt``)."""
    import highspy
    if not quiet:
        return highspy.Highs()
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            return highspy.Highs()
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def _run_highs(mip: _Mip, warm: list[int] | None, time_limit: float | None, threads: int,
               options: SolverOptions, gap: float = 0.0) -> tuple[list[float] | None, str]:
    import highspy

    h = _new_highs(quiet=not options.log)
    h.setOptionValue("output_flag", bool(options.log))
    h.setOptionValue("threads", int(threads))
    # Our problems are solved at the root node or close to it; HiGHS's presolve
    # (probing on thousands of transportation rows) costs more than it saves.
    h.setOptionValue("presolve", options.highs_presolve)
    h.setOptionValue("mip_rel_gap", max(gap, 1e-7))
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
    if options.dump_path:
        h.writeModel(options.dump_path)
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


def _run_cbc(mip: _Mip, time_limit: float | None, threads: int, options: SolverOptions,
             gap: float = 0.0) -> tuple[list[float] | None, str]:
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
        solver = pulp.PULP_CBC_CMD(msg=bool(options.log), timeLimit=time_limit, threads=threads,
                                   gapRel=gap or None)
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


def _cost_scale(p: IlpProblem) -> float:
    """Scale costs (seconds) so the solver works with numbers near 1..1e6."""
    mx = max([float(np.max(np.abs(c))) for c in p.costs if len(c)] +
             [float(np.max(np.abs(e.cost))) for e in p.edges if e.cost.size] + [0.0])
    return 1.0 if mx == 0 else 1e3 / mx


def _infeasible(p: IlpProblem) -> InfeasiblePlanError:
    budget = min((r.budget for r in p.memory), default=None)
    need = p.min_memory()
    msg = (f"the model does not fit: it needs at least {human_bytes(need)} per device "
           f"(a lower bound over the layouts the method allows on this mesh) but the budget is "
           f"{human_bytes(budget or 0)}; use more devices, pipeline stages, remat, "
           "smaller micro-batches or a cluster with more memory per device")
    return InfeasiblePlanError(msg, budget_bytes=int(budget) if budget is not None else None,
                               needed_bytes=int(need))
