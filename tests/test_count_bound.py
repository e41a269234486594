"""The search passes over a micro-batch count whose relaxed search (every
stage its fastest way on its layers' uncapped plans, as if memory bound
nothing) already plans no faster than the best so far.  That is exact only
if the relaxed figure never exceeds the count's own best: checked here per
count on random small models and clusters (the generator of
``test_auto_contains_manual``), and the pruned search against the
exhaustive one.  Where the relaxed plan fits the memory as it is, it is the
count's plan: checked against the exhaustive search too."""
from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import random

import pytest

import meshplan
from meshplan.api import retracer
from meshplan.cluster import parse_cluster
from meshplan.dp_search import Session, search_pipeline
from meshplan.dp_search.problem import layer_problems
from meshplan.dp_search.search import micro_batch_candidates
from meshplan.dp_search.solver import LayerSolver
from meshplan.dp_search.stages import StageMemoryError, best_pipeline
from meshplan.errors import InfeasiblePlanError
from meshplan.graph import batch_dims_between
from meshplan.models import build_model
from meshplan.trace import trace
from test_auto_contains_manual import random_cluster, random_model


def _total(lay, cluster, opts, solver, relaxed: bool) -> float:
    try:
        return best_pipeline(lay, cluster, opts, solver, relaxed=relaxed)[0].total_s
    except InfeasiblePlanError:
        return math.inf


def _bounds_under_best(m, cluster, graph, rt, session, opts) -> int:
    """Check every micro-batch count's relaxed bound against the count's
    best; the number of counts with a plan."""
    solver = LayerSolver(cluster, opts, session)
    planned = 0
    for B in micro_batch_candidates(m.config["batch"], None):
        g = graph if B == 1 else rt(B)
        lay = layer_problems(g, B, cluster, opts, batch_dims_between(graph, g, B))
        best, bound = (_total(lay, cluster, opts, solver, relaxed) for relaxed in (False, True))
        assert bound <= best * (1 + 1e-9), (
            f"{cluster.name}, {m.config}, {B} micro-batches: relaxed {bound:.6g} s above the "
            f"count's best {best:.6g} s")
        planned += best < math.inf
    return planned


# (seconds each on 2 busy cores: 0 and 2 under 10, the extended ones under 25,
# the slow ones 45-280)
DEFAULT, SLOW = (0, 2), (1, 5, 6, 11, 14, 15)


@pytest.mark.parametrize("seed", [pytest.param(s, marks=() if s in DEFAULT else pytest.mark.slow
                                               if s in SLOW else pytest.mark.extended)
                                  for s in range(16)])
def test_relaxed_bound_is_below_every_counts_best(seed):
    rng = random.Random(100 + seed)
    cluster, m = random_cluster(rng), random_model(rng)
    graph = trace(m.train_step, *m.abstract_args, batch_argnums=m.batch_argnums, name="step")
    rt = retracer(m.train_step, m.abstract_args, m.batch_argnums, "step")
    session = Session(workers=1)
    opts = meshplan.Auto().request(cluster.num_devices).pipeline
    assert _bounds_under_best(m, cluster, graph, rt, session, opts), \
        "no micro-batch count has a plan: the case tests nothing"
    # the pruned search plans as the exhaustive one does
    pruned, full = (search_pipeline(graph, cluster, dataclasses.replace(
        opts, prune_micro_batches=prune), method_name="auto", retrace=rt, session=session)[0]
        for prune in (True, False))
    assert pruned.predicted.iteration_s == full.predicted.iteration_s
    assert (pruned.num_micro_batches, len(pruned.stages)) == \
        (full.num_micro_batches, len(full.stages))


@pytest.mark.extended
def test_a_count_whose_relaxed_plan_fits_takes_it_as_the_full_search_would():
    # a small gpt on eight 80 GB GPUs: memory binds nothing, so the relaxed
    # search's plan fits as it is and no capped layer ILP is needed for it
    m = build_model("gpt", {"layers": "2", "hidden": "64", "seq_len": "16", "vocab": "64",
                            "batch": "16", "optimizer": "sgd"})
    cluster = meshplan.load_cluster(pathlib.Path(__file__).resolve().parents[1] /
                                    "examples/clusters/dgx-a100-x1.json")
    graph = trace(m.train_step, *m.abstract_args, batch_argnums=m.batch_argnums, name="step")
    rt = retracer(m.train_step, m.abstract_args, m.batch_argnums, "step")
    session = Session(workers=1)
    opts = meshplan.Auto().request(cluster.num_devices).pipeline
    (pruned, stats), (full, _) = (search_pipeline(
        graph, cluster, dataclasses.replace(opts, prune_micro_batches=prune),
        method_name="auto", retrace=rt, session=session) for prune in (True, False))
    assert stats.relaxed_fit >= 1
    assert any("planned by the relaxed search alone" in n for n in pruned.notes)

    def body(p):        # (the notes name what each search did)
        d = json.loads(p.to_json())
        d.pop("notes")
        return d
    assert body(pruned) == body(full)


def _tight_mlp(memory_bytes: int):
    """A 4-layer MLP on four fake devices of ``memory_bytes``: the model, the
    cluster, the step's Graph, its retracer, a session and Auto's options."""
    m = build_model("mlp", {"layers": 4, "hidden": 256, "in_dim": 64, "out_dim": 8,
                            "batch": 64})
    cluster = parse_cluster({
        "format": "meshplan.cluster/1", "name": "fake-1x4", "num_hosts": 1,
        "devices_per_host": 4, "num_devices": 4,
        "device": {"kind": "fake", "memory_bytes": memory_bytes,
                   "memory_bandwidth_bytes_per_s": 1e12, "peak_flops": {"float32": 1e13}},
        "links": {"intra_host": {"bandwidth_bytes_per_s": 1e11, "latency_s": 1e-6},
                  "inter_host": {"bandwidth_bytes_per_s": 1e10, "latency_s": 5e-6}}})
    graph = trace(m.train_step, *m.abstract_args, batch_argnums=m.batch_argnums, name="step")
    rt = retracer(m.train_step, m.abstract_args, m.batch_argnums, "step")
    return (m, cluster, graph, rt, Session(workers=1),
            meshplan.Auto().request(cluster.num_devices).pipeline)


def test_the_search_names_the_counts_memory_kept_from_a_faster_plan():
    # an MLP on four devices of 1.6 MB: 2 micro-batches would plan faster
    # than the plan found (4) with memory to spare, but fit nothing
    # (meshplan.planning searches such counts again in its ways that need less memory)
    m, cluster, graph, rt, session, opts = _tight_mlp(1_600_000)
    plan, stats = search_pipeline(graph, cluster, opts, method_name="auto", retrace=rt,
                                  session=session)
    assert stats.squeezed == (2,) and plan.num_micro_batches == 4
    solver = LayerSolver(cluster, opts, session)
    for B in micro_batch_candidates(m.config["batch"], None):
        g = graph if B == 1 else rt(B)
        lay = layer_problems(g, B, cluster, opts, batch_dims_between(graph, g, B))
        if B in stats.squeezed:
            with pytest.raises(StageMemoryError):
                best_pipeline(lay, cluster, opts, solver)
            assert _total(lay, cluster, opts, solver, True) < plan.predicted.iteration_s
        else:       # (fits, or planned no faster with memory to spare)
            assert _total(lay, cluster, opts, solver, False) < math.inf or \
                _total(lay, cluster, opts, solver, True) >= plan.predicted.iteration_s


@pytest.mark.extended
@pytest.mark.parametrize("memory_bytes", [1_600_000, 2_000_000])
def test_the_relaxed_bound_keeps_ways_a_cap_makes_fit(memory_bytes):
    # Where memory binds, a way's capped plans may hold less beside the
    # state than its uncapped plans do.  A bound that passed over each way
    # whose uncapped activations and temporaries leave no room for the state
    # split evenly was tried (stop 98): at 2.0 MB it exceeded the best of 1
    # and 4 micro-batches by 14% and 0.2%.  Every count's bound stays under
    # its best here.
    assert _bounds_under_best(*_tight_mlp(memory_bytes)) >= 5


@pytest.mark.extended
def test_the_pruned_search_plans_as_the_exhaustive_one_where_caps_speed_a_stage():
    # (xfail until stop 95: with 4 micro-batches a capped plan of stage 0 was
    # 3% faster than its uncapped one, holding half the gradient sums, so
    # the relaxed bound pruned the winner.  Since stop 96 ZB-H1, priced with
    # what its stages keep, wins both searches at 2 micro-batches; the capped
    # plan at 4 no longer decides, which is not to say that gap is closed)
    _, cluster, graph, rt, session, opts = _tight_mlp(2_000_000)
    pruned, full = (search_pipeline(graph, cluster, dataclasses.replace(
        opts, prune_micro_batches=prune), method_name="auto", retrace=rt, session=session)[0]
        for prune in (True, False))
    assert pruned.predicted.iteration_s == full.predicted.iteration_s
