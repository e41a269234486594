"""The schedule search: by default Auto and PipeshardParallel search every
schedule the runtime runs (GPipe, 1F1B, interleaved 1F1B, ZB-H1, in one
process or several: tests/test_multihost_pipeline.py), and the searched plan
is the fastest of the plans each schedule gives when named alone.  A fixed
stage count leaves interleaved out unless named."""
from __future__ import annotations

import pathlib

import pytest

import meshplan
from meshplan.cluster import load_cluster
from meshplan.dp_search import Session
from meshplan.errors import InfeasiblePlanError
from meshplan.methods import AUTO_SCHEDULES
from meshplan.models import build_model

ROOT = pathlib.Path(__file__).resolve().parents[1]
ONE_HOST = load_cluster(str(ROOT / "examples/clusters/dgx-a100-x1.json"))
GPT = {"layers": 4, "hidden": 32, "heads": 2, "seq_len": 16, "vocab": 64, "batch": 8}


@pytest.fixture(scope="module")
def gpt():
    # (one session: the plans share their layers' ILPs, which no schedule
    # changes; tests/test_ilp_structure.py: a shared cache changes no result)
    m = build_model("gpt", GPT)
    return m.train_step, tuple(m.abstract_args), Session.from_env()


def _plan(gpt, method):
    step, args, session = gpt
    return meshplan.plan(step, *args, cluster=ONE_HOST, method=method, session=session)


def test_searched_schedule_is_the_fastest_named_one(gpt):
    named = {}
    for s in AUTO_SCHEDULES:
        try:
            named[s] = _plan(gpt, meshplan.PipeshardParallel(num_micro_batches=4, schedule=s))
        except InfeasiblePlanError:
            continue
    assert {"1f1b", "zb-h1"} <= named.keys()
    searched = _plan(gpt, meshplan.PipeshardParallel(num_micro_batches=4))
    best = min(p.predicted.iteration_s for p in named.values())
    assert searched.predicted.iteration_s == pytest.approx(best, rel=1e-9)
    assert searched.schedule == min(named, key=lambda s: (named[s].predicted.iteration_s,
                                                          AUTO_SCHEDULES.index(s)))
    # on this cluster ZB-H1's W programs fill 1F1B's bubbles: the search takes it
    assert named["zb-h1"].predicted.iteration_s < named["1f1b"].predicted.iteration_s
    assert searched.schedule != "1f1b"


def test_a_list_of_schedules_bounds_the_search(gpt):
    p = _plan(gpt, meshplan.PipeshardParallel(num_micro_batches=4, schedule=("1f1b", "gpipe")))
    assert p.schedule in ("1f1b", "gpipe")


def test_exact_stage_counts_search_interleaved_only_when_named():
    req = meshplan.PipeshardParallel(stages=2).request(8)
    assert "interleaved" not in req.pipeline.schedules and "zb-h1" in req.pipeline.schedules
    assert meshplan.PipeshardParallel().request(8).pipeline.schedules == AUTO_SCHEDULES
    named = meshplan.PipeshardParallel(stages=2, schedule=("1f1b", "interleaved"),
                                       num_micro_batches=4).request(8)
    assert named.pipeline.schedules == ("1f1b", "interleaved")
