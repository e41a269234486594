"""meshplan.collector: the garbage collector's thresholds while tracing and
planning, and the caller's put back."""
import gc
import weakref

import pytest

import meshplan
from meshplan.collector import RELAXED_THRESHOLDS, relaxed_gc, with_relaxed_gc
from meshplan.dp_search.stage_dp import Submesh, stage_dp


@pytest.fixture
def thresholds():
    old = gc.get_threshold()
    yield
    gc.set_threshold(*old)


def test_relaxed_inside_and_restored_after_also_on_error(thresholds):
    gc.set_threshold(700, 10, 10)
    with relaxed_gc():
        assert gc.get_threshold() == RELAXED_THRESHOLDS
    assert gc.get_threshold() == (700, 10, 10)
    with pytest.raises(ValueError):
        with relaxed_gc():
            raise ValueError("boom")
    assert gc.get_threshold() == (700, 10, 10)


def test_nests_and_never_collects_more_often_than_the_caller_asked(thresholds):
    mine = (RELAXED_THRESHOLDS[0] * 4, 5, RELAXED_THRESHOLDS[2] * 2)
    gc.set_threshold(*mine)
    with relaxed_gc():
        inside = gc.get_threshold()
        assert inside == (mine[0], RELAXED_THRESHOLDS[1], mine[2])
        with relaxed_gc():
            assert gc.get_threshold() == inside
        assert gc.get_threshold() == inside
    assert gc.get_threshold() == mine


def test_tracing_and_planning_run_relaxed_and_restore(thresholds, monkeypatch):
    """Tracing and planning run under relaxed thresholds (seen from inside
    JAX's trace and the pipeline search) and leave the caller's as they were."""
    import importlib
    tracer = importlib.import_module("meshplan.trace.tracer")
    planning = importlib.import_module("meshplan.planning")
    seen: dict[str, list] = {"trace": [], "search": []}

    def spy(what, real):
        def wrapped(*args, **kwargs):
            seen[what].append(gc.get_threshold())
            return real(*args, **kwargs)
        return wrapped
    monkeypatch.setattr(tracer, "jaxpr_of", spy("trace", tracer.jaxpr_of))
    monkeypatch.setattr(planning, "search_pipeline", spy("search", planning.search_pipeline))
    gc.set_threshold(700, 10, 10)
    from meshplan.models import build_model
    m = build_model("mlp", {"layers": "2", "hidden": "32", "batch": "8"})
    plan = meshplan.plan(m.train_step, *m.abstract_args, cluster=meshplan.Cluster.local(),
                         method=meshplan.Manual(dp=1, tp=4, pp=2, num_micro_batches=2))
    assert len(plan.stages) == 2
    for what, thresholds_seen in seen.items():
        assert thresholds_seen and all(t == RELAXED_THRESHOLDS for t in thresholds_seen), what
    assert gc.get_threshold() == (700, 10, 10)


def test_the_stage_dp_leaves_no_cycle_behind():
    """The DP's recursive memo is unbound when done: what it reached is freed
    by reference counting, without a collection."""
    class Cost:
        """A stage cost that records whether it is still alive."""
        def __call__(self, i, j, m, s):
            return float(j - i + 1)

    cost = Cost()
    alive = weakref.ref(cost)
    was = gc.isenabled()
    gc.disable()
    try:
        res = stage_dp(4, [Submesh(1, 1), Submesh(1, 2)], 4, 4, cost, max_stages=4)
        assert res is not None
        del cost
        assert alive() is None
    finally:
        if was:
            gc.enable()


def test_decorator_keeps_the_function_and_its_result():
    @with_relaxed_gc
    def f(x, *, y=1):
        """doc"""
        return gc.get_threshold(), x + y
    inside, out = f(2, y=3)
    assert out == 5 and f.__doc__ == "doc" and f.__name__ == "f"
    assert inside[0] >= RELAXED_THRESHOLDS[0]
