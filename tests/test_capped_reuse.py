"""Capped layer ILPs (issue 20): a capped problem is the uncapped one plus
its cap row, so it is built once per layer and mesh; and a layer with no
plan under a looser cap gets none under a tighter one without a solve."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import meshplan
import meshplan.dp_search.solver as solver_mod
import meshplan.ilp.intra_op as intra
from meshplan.api import trace_step
from meshplan.dp_search import Session
from meshplan.dp_search.problem import layer_problems
from meshplan.dp_search.search import plan_pipeline
from meshplan.dp_search.solver import LayerSolver
from meshplan.models import build_model
from meshplan.request import PipelineOptions

ROOT = Path(__file__).resolve().parents[1]


def _graph(config: dict):
    m = build_model("gpt", {k: str(v) for k, v in config.items()})
    return trace_step(m.train_step, m.abstract_args, tuple(m.batch_argnums), "gpt")[0]


def test_capped_layer_ilps_reuse_the_uncapped_build(monkeypatch):
    """test_memory_fit's one-stage case, which needs layer plans with their
    state capped: the plan is byte-identical to building every capped ILP
    afresh, with fewer ILPs built."""
    g = _graph({"layers": 8, "hidden": 4096, "batch": 48, "seq_len": 512, "heads": 32,
                "vocab": 128})
    cluster = meshplan.load_cluster(ROOT / "examples/clusters/aws-p3.16xlarge-x1.json")
    opts = PipelineOptions(num_stages=1, num_micro_batches=(1,), schedules=("1f1b",),
                           data_parallel_stages=True, remat=False)
    builds: list = []
    real_build = intra.build_problem

    def counted(*a, **k):
        builds.append(k.get("resident_budget"))
        return real_build(*a, **k)
    monkeypatch.setattr(intra, "build_problem", counted)

    def plan() -> tuple[str, int]:
        del builds[:]
        p = plan_pipeline(g, cluster, meshplan.PipeshardParallel(), options=opts,
                          session=Session(workers=1))
        return p.to_json(), len(builds)
    reused, n_reused = plan()
    real_job = LayerSolver._job
    # every ILP built afresh: no prebuilt problem in the jobs
    def fresh_job(self, *a, **k):
        job = real_job(self, *a, **k)
        return job[:12] + (None,) + job[13:]     # (the prebuilt problem, job[12]: none)
    monkeypatch.setattr(LayerSolver, "_job", fresh_job)
    fresh, n_fresh = plan()
    assert reused == fresh
    assert n_reused < n_fresh, (n_reused, n_fresh)


def test_no_plan_under_a_looser_cap_means_none_under_a_tighter_one(monkeypatch):
    g = _graph({"layers": 2, "hidden": 64, "batch": 8, "seq_len": 16, "heads": 2, "vocab": 64})
    cluster = meshplan.load_cluster(ROOT / "examples/clusters/aws-p3.16xlarge-x1.json")
    # a budget no layer fits
    opts = replace(meshplan.Auto().request(cluster.num_devices).pipeline, memory_fraction=1e-9)
    lay = layer_problems(g, 1, cluster, opts)
    s = LayerSolver(cluster, opts, Session(workers=1))
    req = lay.request(1, 0, 0)
    assert s.layer_cost(*req) is None and s.solves == 1

    def refuse(*a, **k):
        raise AssertionError("solved a layer a looser cap already refused")
    monkeypatch.setattr(solver_mod, "solve_job", refuse)
    assert s.layer_cost(*req, tighten=4) is None
    assert s.solves == 1
    s.prefetch([req], 8)        # (nothing to solve: no worker pool started)
    assert s.layer_cost(*req, tighten=8) is None and s._pool is None


def test_a_looser_plan_that_meets_the_cap_is_the_capped_optimum(monkeypatch):
    """A layer's plan under a looser cap (here none) whose state already
    fits a tighter cap is that cap's optimum: it is reused without a solve,
    and a fresh solve under the cap finds a plan as fast."""
    g = _graph({"layers": 2, "hidden": 256, "batch": 8, "seq_len": 64, "heads": 4, "vocab": 64})
    cluster = meshplan.load_cluster(ROOT / "examples/clusters/aws-p3.16xlarge-x1.json")
    opts = replace(meshplan.Auto().request(cluster.num_devices).pipeline, memory_fraction=1e-3)
    lay = layer_problems(g, 1, cluster, opts)
    budget = cluster.device.memory_bytes * opts.memory_fraction
    mesh = max(range(len(lay.meshes_of[-1])), key=lambda k: lay.meshes_of[-1][k].size)
    req = lay.request(1, len(lay.submeshes) - 1, mesh)
    s = LayerSolver(cluster, opts, Session(workers=1))
    loose = s.layer_cost(*req)
    assert loose is not None and s.solves == 1
    meets = max(t for t in solver_mod.TIGHTEN if budget / t >= 1.001 * loose.resident_bytes)
    below = min(t for t in solver_mod.TIGHTEN if budget / t < 0.999 * loose.resident_bytes)
    assert meets > 1, "the test needs a cap the loose plan meets"
    assert s.layer_cost(*req, tighten=meets) is loose and s.solves == 1
    fresh = LayerSolver(cluster, opts, Session(workers=1)).layer_cost(*req, tighten=meets)
    assert abs(fresh.result.objective_s - loose.result.objective_s) \
        <= 1e-6 * loose.result.objective_s
    # a cap the plan does not meet is solved
    tight = s.layer_cost(*req, tighten=below)
    assert s.solves == 2
    assert tight is None or tight.resident_bytes <= budget / below * 1.001
