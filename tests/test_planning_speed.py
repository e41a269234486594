"""What makes planning faster keeps its answers: a memory row no choice can
meet is infeasible without the MIP; capped layer ILPs may stop within a
stated gap of their optimum; the passes of one plan cut each micro-batch
count into layers once, and plans of one step in one session trace it and
cut each count once; a stage's mixed recomputation splits are joins of
running sums."""
import dataclasses
import re

import jax
import numpy as np
import pytest

import meshplan
import meshplan.planning as planning
from meshplan.dp_search import Session, problem, search_pipeline
from meshplan.dp_search.session import Recent
from meshplan.dp_search.stages import GroupCost
from meshplan.cost_model.overlap import Backward
from meshplan.errors import InfeasiblePlanError
from meshplan.ilp import EachMicroBatch
from meshplan.ilp.options import SolverOptions
from meshplan.ilp.problem import Edge, IlpProblem, MemoryRow, brute_force
from meshplan.ilp.solvers import solve
from meshplan.models import build_model


def _problem(rng, n=7, k=4, budget_share=0.5):
    p = IlpProblem([f"g{i}" for i in range(n)], [rng.random(k) * 10 for _ in range(n)])
    for _ in range(2 * n):
        u, v = rng.choice(n, 2, replace=False)
        p.edges.append(Edge(int(u), int(v), rng.random((k, k)) * 3))
    coefs = {g: rng.random(k) * 10 for g in range(n)}
    lo = sum(float(c.min()) for c in coefs.values())
    hi = sum(float(c.max()) for c in coefs.values())
    p.memory.append(MemoryRow(coefs, lo + budget_share * (hi - lo)))
    return p


def test_a_row_below_every_choice_is_infeasible_before_any_solver():
    rng = np.random.default_rng(0)
    p = _problem(rng, budget_share=-0.01)       # below the sum of the smallest entries
    assert p.surely_infeasible()
    assert brute_force(p)[0] is None
    with pytest.raises(InfeasiblePlanError):
        solve(p, dp=False)
    # a row the smallest entries meet is left to the solvers, and they agree
    q = _problem(np.random.default_rng(1), budget_share=0.0)
    assert not q.surely_infeasible()
    best, val = brute_force(q)
    assert best is not None and solve(q).objective == pytest.approx(val, rel=1e-9)


@pytest.mark.parametrize("seed", range(8))
def test_a_gapped_mip_stays_within_its_gap_and_says_so(seed):
    p = _problem(np.random.default_rng(seed))
    best, val = brute_force(p)
    assert best is not None
    sol = solve(p, dp=False, gap=0.05)
    assert p.feasible(list(sol.choice))
    assert val * (1 - 1e-9) <= sol.objective <= val * 1.05 + 1e-9
    if sol.num_variables:       # (the MIP ran: what it was allowed is recorded)
        assert sol.gap == 0.05
    else:                       # (the presolve settled it exactly)
        assert sol.gap == 0.0 and sol.objective == pytest.approx(val, rel=1e-9)
    exact = solve(p, dp=False)
    assert exact.gap == 0.0 and exact.objective == pytest.approx(val, rel=1e-9)


def test_capped_gap_is_read_once_from_the_environment():
    assert SolverOptions().capped_gap == 0.01
    assert SolverOptions.from_env({"MESHPLAN_CAPPED_GAP": "0"}).capped_gap == 0.0
    for bad in ("one", "-0.1", "1.5"):
        with pytest.raises(ValueError, match="MESHPLAN_CAPPED_GAP"):
            SolverOptions.from_env({"MESHPLAN_CAPPED_GAP": bad})


@pytest.mark.extended
def test_searches_differing_only_in_input_filter_cut_each_count_once():
    m = build_model("gpt", {"optimizer": "sgd"})
    session = Session.from_env()
    traced = planning.trace_function(m.train_step, m.abstract_args, tuple(m.batch_argnums),
                                     "gpt", session)
    asked = []

    def retrace(B):
        asked.append(B)
        return traced.retrace(B)

    cluster = meshplan.ClusterSpec.local()
    opts = meshplan.PipeshardParallel(stages=2, num_micro_batches=(2, 4)).request(8).pipeline
    memo: dict = {}
    plans = []
    for filt in (None, EachMicroBatch()):
        p, _ = search_pipeline(traced.graph, cluster, dataclasses.replace(opts, input_filter=filt),
                               method_name="pipeshard", retrace=retrace, session=session,
                               layered_memo=memo)
        plans.append(p)
    assert sorted(asked) == [2, 4]
    # the same searches without the memo plan the same
    for filt, want in zip((None, EachMicroBatch()), plans):
        p, _ = search_pipeline(traced.graph, cluster, dataclasses.replace(opts, input_filter=filt),
                               method_name="pipeshard", retrace=traced.retrace, session=Session())
        assert p.to_json() == want.to_json()


def _row(rng) -> GroupCost:
    f = lambda: float(rng.random())     # noqa: E731
    return GroupCost(f(), f(), f(), f(), f() + 1, f(), f(), f(), f(), f(), f(), f(),
                     compute_s=f(), remat_compute_s=f(), selective_compute_s=f(),
                     backward=Backward(f(), f(), f()), remat_backward=Backward(f(), f(), f()),
                     selective_backward=Backward(f(), f(), f()), cast_s=f(), copy_bytes=f())


@pytest.mark.parametrize("seed", range(5))
def test_joined_rows_equal_the_rows_summed_at_once(seed):
    rng = np.random.default_rng(seed)
    rows = [_row(rng) for _ in range(6)]
    for g in range(1, 6):
        once = GroupCost.of_groups([r.as_full() for r in rows[:g]] + rows[g:])
        joined = GroupCost.of_groups([GroupCost.of_groups([r.as_full() for r in rows[:g]]),
                                      GroupCost.of_groups(rows[g:])])
        for a, b in zip(dataclasses.astuple(once), dataclasses.astuple(joined)):
            np.testing.assert_allclose(a, b, rtol=1e-12)


@pytest.mark.parametrize("model", ["gpt", "mlp"])
def test_plans_of_one_step_in_a_session_trace_and_cut_it_once(monkeypatch, model):
    """A grid of hand plans over one step in one session: the step is traced
    once, each micro-batch count once, and (gpt's blocks) each count's
    layers are analysed once; every plan equals the one a fresh session
    makes (mlp: layers clustered to the stages asked)."""
    m = build_model(model, {"optimizer": "sgd"})
    state, batch = m.abstract_args
    traces = []
    real = planning._trace_function

    def counted(*a, **k):
        traces.append(a[3])
        return real(*a, **k)

    monkeypatch.setattr(planning, "_trace_function", counted)
    analysed = []
    real_analyse = problem.analyse_layers

    def counted_analyse(g, *a):
        analysed.append(g.fingerprint)
        return real_analyse(g, *a)

    monkeypatch.setattr(problem, "analyse_layers", counted_analyse)
    grid = [dict(dp=2, tp=2, pp=2, num_micro_batches=2), dict(dp=1, tp=4, pp=2, num_micro_batches=2),
            dict(dp=2, tp=1, pp=4, num_micro_batches=4), dict(dp=1, tp=2, pp=4, num_micro_batches=4),
            dict(dp=4, tp=1, pp=2, num_micro_batches=2)]
    session = Session.from_env()
    plans = [meshplan.plan(m.train_step, state, batch, method=meshplan.Manual(**c),
                           session=session) for c in grid]
    assert traces == ["train_step"]
    if model == "gpt":
        # (counts 2 and 4: its blocks make layers enough for two and four stages)
        assert len(set(analysed)) == len(analysed) == 2
    traced = next(iter(session.traces.values()))
    assert sorted(B for B, how, _ in traced.retrace.log if how != "kept") == [2, 4]
    for c, p in zip(grid, plans):
        fresh = meshplan.plan(m.train_step, state, batch, method=meshplan.Manual(**c))
        assert p.to_json() == fresh.to_json()
    # another argument shape is another trace
    traces.clear()
    wider = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct((2 * x.shape[0],) + x.shape[1:], x.dtype), batch)
    meshplan.plan(m.train_step, state, wider, method=meshplan.Manual(**grid[0]), session=session)
    assert traces == ["train_step"]


def test_a_session_keeps_its_most_recent_steps():
    r = Recent(2)
    for k in "abc":
        r[k] = k.upper()
    assert list(r) == ["b", "c"]
    r["b"] = "B2"           # (set again: the most recent)
    r["d"] = "D"
    assert list(r.items()) == [("b", "B2"), ("d", "D")]
    w = Recent(10, len, budget=5)
    for k in ("aa", "bb", "ccc"):
        w[k] = k
    assert list(w) == ["bb", "ccc"]
    w["dddddd"] = "dddddd"      # (over the budget alone: kept, the newest)
    assert list(w) == ["dddddd"]


@pytest.mark.parametrize("name,overrides", [
    ("mlp", {}), pytest.param("gpt", {"layers": 2, "hidden": 32}, marks=pytest.mark.extended)])
def test_counts_the_hosts_dispatch_keeps_above_one_program_are_not_searched(
        name, overrides, monkeypatch):
    # Auto on CPU devices plans the one program first; a count (or a stage
    # count) whose every plan the host's dispatch keeps slower is passed
    # over.  The plan is the one the whole search finds.
    m = build_model(name, overrides)
    cluster = meshplan.Cluster.local()

    def auto():
        return meshplan.plan(m.train_step, *m.abstract_args, cluster=cluster,
                             method=meshplan.Auto())

    def ilps(p):
        return int(next(re.search(r"needed (\d+) layer ILPs", n)[1] for n in p.notes
                        if n.startswith("chosen among")))
    fast = auto()
    from meshplan.dp_search import search
    monkeypatch.setattr(search, "least_host_s", lambda *a, **k: 0.0)
    whole = auto()
    assert dataclasses.replace(fast, notes=()) == dataclasses.replace(whole, notes=())
    assert ilps(fast) < ilps(whole) / 2
