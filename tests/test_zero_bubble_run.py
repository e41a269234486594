"""ZB-H1 planned, costed and executed: each stage's backward cut into B
(input gradients) and W (weight gradients), the driver in
meshplan.schedule's order, the numbers those of the undecorated step
(float32, SGD) within 1e-5."""
import json
import pathlib

import pytest

import meshplan
from meshplan.cost_model.pipeline import zb_h1_iteration_s
from meshplan.runtime.pipeline import PipelineExecutable
from meshplan.schedule import max_in_flight, schedule_order
from test_pipeline_runtime import _assert_close, _model, _run

ROOT = pathlib.Path(__file__).resolve().parents[1]
GPU = ROOT / "examples/clusters/dgx-a100-x1.json"


def _plan(name, dp, tp, pp, mb, schedule="zb-h1", cluster=None):
    m, state, batch = _model(name)
    kw = {} if cluster is None else {"cluster": meshplan.load_cluster(cluster)}
    return meshplan.plan(m.train_step, state, batch,
                         method=meshplan.Manual(dp=dp, tp=tp, pp=pp, num_micro_batches=mb,
                                                schedule=schedule), **kw)


# (gpt's 2-stage case takes ~45 s on the shared 2-core machine: -m slow)
FAST = [("mlp", 2, 2, 2, 2), ("mlp", 1, 2, 4, 4)]
SLOW = [("gpt", 2, 2, 2, 2), ("mlp", 2, 2, 2, 4), ("mlp", 2, 2, 2, 8), ("gpt", 2, 2, 2, 4),
        ("gpt", 2, 2, 2, 8),
        ("mlp", 1, 2, 4, 8), ("gpt", 1, 2, 4, 4), ("gpt", 1, 2, 4, 8)]


@pytest.mark.parametrize("name,dp,tp,pp,mb", FAST + [pytest.param(*c, marks=pytest.mark.slow)
                                                       for c in SLOW])
def test_zb_h1_equals_undecorated_step(name, dp, tp, pp, mb):
    plan = _plan(name, dp, tp, pp, mb)
    assert plan.schedule == "zb-h1" and len(plan.stages) == pp
    step, state, losses = _run(name, plan)
    ex = step._fast[1]
    assert isinstance(ex, PipelineExecutable)
    tasks = ex.split.tasks
    # the first stage sends no gradient back: one backward; every other
    # stage's parameter gradients (their running sums) are its W's
    assert ("W", 0) not in tasks
    for s in range(1, pp):
        assert tasks["W", s].accumulate and not tasks["B", s].accumulate
        assert not set(tasks["W", s].eqns) & set(tasks["B", s].eqns)
    # the driver ran each stage's programs in meshplan.schedule's order
    for s in range(pp):
        mine = [(k, i) for k, t, i in ex.wiring.order if t == s]
        assert mine == [(k, i) for k, i in schedule_order("zb-h1", s, pp, mb)
                        if (k, s) in tasks]
    # activations held from F to W: every stage within 1F1B's largest bound
    assert tuple(ex.last_stats["max_in_flight"]) == max_in_flight("zb-h1", pp, mb)
    assert max(ex.last_stats["max_in_flight"]) <= min(pp, mb)
    _assert_close(state, losses, name)


def test_plan_is_costed_by_zb_h1_and_beats_1f1b():
    """On a GPU cluster file: the plan's time is the ZB-H1 walk of its stages,
    below 1F1B's for the same stages; every stage keeps p micro-batches."""
    zb = _plan("gpt", 1, 2, 4, 4, cluster=GPU)
    one = _plan("gpt", 1, 2, 4, 4, "1f1b", cluster=GPU)
    assert [s.layers for s in zb.stages] == [s.layers for s in one.stages]
    assert zb.predicted.iteration_s < one.predicted.iteration_s
    assert all(s.predicted.memory.activations >= o.predicted.memory.activations
               for s, o in zip(zb.stages, one.stages))
    # the time lies between the perfect pipeline and 1F1B's formula of the same latencies
    lats = [s.predicted.latency_s for s in zb.stages]
    assert 4 * max(lats) < zb.predicted.iteration_s < 4 * max(lats) + sum(lats)
    # ... and a zero W makes it 1F1B's walk
    assert zb_h1_iteration_s([1.0] * 4, [2.0] * 4, [0.0] * 4, 4) == pytest.approx(4 * 3 + 3 * 3)
    again = meshplan.Plan.from_json(zb.to_json())
    assert again.schedule == "zb-h1" and json.loads(zb.to_json())["schedule"] == "zb-h1"


def test_timeline_draws_w_blocks(tmp_path):
    from meshplan.tools.timeline import draw, simulate
    plan = _plan("gpt", 1, 2, 4, 4, cluster=GPU)
    blocks = simulate(plan)
    kinds = {(b.stage, b.kind) for b in blocks}
    assert ("W", 0) not in {(k, s) for s, k in kinds}
    assert all((s, "W") in kinds for s in range(1, 4))
    for s in range(4):
        mine = sorted((b for b in blocks if b.stage == s), key=lambda b: b.start)
        assert all(a.end <= b.start + 1e-15 for a, b in zip(mine, mine[1:]))
    png = tmp_path / "zb.png"
    draw(plan, str(png))
    assert png.stat().st_size > 1000


def test_backward_parts_of_a_transformer_layer():
    """The planner's B/W cut (by dependence, as the runtime cuts the
    programs): a block's backward has both parts; the first layer sends no
    gradient back; what W still reads after B is part of what is kept."""
    from meshplan.dp_search.layers import assign_layers
    from meshplan.dp_search.zero_bubble import backward_parts, kept_parts, w_shares
    from meshplan.trace import trace
    from meshplan.models import build_model
    m = build_model("gpt", {"layers": 2, "hidden": 32, "heads": 2, "seq_len": 16, "vocab": 64,
                            "batch": 8})
    g = trace(m.train_step, *m.abstract_args, batch_argnums=m.batch_argnums, name="gpt")
    lay = assign_layers(g, None, default_layers=4)
    f, b, w = backward_parts(g, lay)
    assert sum(f) + sum(b) + sum(w) == pytest.approx(g.total_flops)
    assert b[0] == 0.0
    blocks = [l for l in range(lay.num_layers) if f[l] > 0.2 * max(f)]
    assert blocks and all(b[l] > 0 and w[l] > 0 for l in blocks)
    # W reads some of the forward's values and some of B's results
    parts = kept_parts(g, lay)
    assert all(parts[0][l] > 0 and parts[1][l] > 0 for l in blocks)
