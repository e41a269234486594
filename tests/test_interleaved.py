"""Interleaved 1F1B (v = 2 chunks per device group), planned, costed and
executed: virtual stage k on the devices of group k mod p, the driver in
meshplan.schedule's order, the numbers those of the undecorated step
(float32, SGD) within 1e-5."""
import dataclasses
import json
import pathlib

import pytest

import meshplan
from meshplan.cost_model.pipeline import interleaved_iteration_s
from meshplan.runtime.pipeline import PipelineExecutable
from meshplan.runtime.pipeline_lower import stage_memory
from meshplan.schedule import group_order, max_in_flight
from test_pipeline_runtime import _assert_close, _model, _run

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _plan(name, dp, tp, pp, mb, cluster=None):
    m, state, batch = _model(name)
    kw = {} if cluster is None else {"cluster": cluster}
    return meshplan.plan(m.train_step, state, batch,
                         method=meshplan.Manual(dp=dp, tp=tp, pp=pp, num_micro_batches=mb,
                                                schedule="interleaved"), **kw)


def _check_layout(plan, pp):
    assert plan.schedule == "interleaved" and len(plan.stages) == 2 * pp
    assert plan.device_groups == tuple(k % pp for k in range(2 * pp)) and plan.chunks == 2
    for k, s in enumerate(plan.stages):
        assert s.devices == plan.stages[k % pp].devices
    layers = [s.layers for s in plan.stages]
    assert layers[0][0] == 0 and all(a[1] + 1 == b[0] for a, b in zip(layers, layers[1:]))


def _check_run(name, plan, pp):
    step, state, losses = _run(name, plan)
    ex = step._fast[1]
    assert isinstance(ex, PipelineExecutable)
    m = plan.num_micro_batches
    # the driver ran each group's programs in meshplan.schedule's order
    for g in range(pp):
        mine = [(k, s, i) for k, s, i in ex.wiring.order if s % pp == g]
        assert mine == group_order("interleaved", g, pp, m, 2)
    assert tuple(ex.last_stats["max_in_flight"]) == max_in_flight("interleaved", pp, m, 2)
    _assert_close(state, losses, name)
    # the memory check counts the activations the driver keeps, virtual stage
    # by virtual stage (min(m, p - s) over the virtual stages was short)
    _, state0, batch = _model(name)
    mem = stage_memory(ex, step.lower(state0, batch).compile())
    assert [s.in_flight for s in mem] == list(ex.last_stats["max_in_flight"])


# (mlp 1x2x4 mb4, -m extended: eight virtual stages, where the in-flight
# bound is not min(m, p - s))
FAST = [("mlp", 2, 2, 2, 2), ("mlp", 2, 2, 2, 4),
        pytest.param("mlp", 1, 2, 4, 4, marks=pytest.mark.extended),
        pytest.param("gpt", 2, 2, 2, 2, marks=pytest.mark.extended)]
SLOW = [("gpt", 2, 2, 2, 4), ("mlp", 2, 2, 2, 8), ("gpt", 2, 2, 2, 8),
        ("mlp", 1, 2, 4, 8), ("gpt", 1, 2, 4, 4), ("gpt", 1, 2, 4, 8)]


@pytest.mark.parametrize("name,dp,tp,pp,mb", FAST + [pytest.param(*c, marks=pytest.mark.slow)
                                                       for c in SLOW])
def test_interleaved_equals_undecorated_step(name, dp, tp, pp, mb):
    plan = _plan(name, dp, tp, pp, mb)
    _check_layout(plan, pp)
    _check_run(name, plan, pp)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_pipeshard_interleaved_equals_undecorated_step(name):
    m, state, batch = _model(name)
    plan = meshplan.plan(m.train_step, state, batch, method=meshplan.PipeshardParallel(
        stages=2, num_micro_batches=4, schedule="interleaved"))
    _check_layout(plan, 2)
    _check_run(name, plan, 2)


def test_device_group_round_trips_and_old_files_load():
    plan = _plan("mlp", 2, 2, 2, 4)
    again = meshplan.Plan.from_json(plan.to_json())
    assert again.device_groups == plan.device_groups == (0, 1, 0, 1)
    d = json.loads(plan.to_json())
    assert [s["device_group"] for s in d["stages"]] == [0, 1, 0, 1]
    # a plan file without the key (older, or not interleaved): each stage its own group
    for s in d["stages"]:
        del s["device_group"]
    old = meshplan.Plan.from_dict(d)
    assert old.device_groups == (0, 1, 2, 3) and old.chunks == 1
    # ... which the runtime refuses to run interleaved on shared devices
    m, state, batch = _model("mlp")
    with pytest.raises(meshplan.StalePlanError, match="not an interleaved layout"):
        meshplan.parallelize(m.train_step, plan=old)(state, batch)
    one = json.loads(_plan_1f1b().to_json())
    assert all("device_group" not in s for s in one["stages"])


def _plan_1f1b():
    m, state, batch = _model("mlp")
    return meshplan.plan(m.train_step, state, batch, method=meshplan.Manual(
        dp=2, tp=2, pp=2, num_micro_batches=2, schedule="1f1b"))


def test_a_plan_sharing_devices_across_groups_is_refused():
    plan = _plan("mlp", 2, 2, 2, 4)
    st = list(plan.stages)
    st[1] = dataclasses.replace(st[1], devices=st[0].devices)
    m, state, batch = _model("mlp")
    with pytest.raises(meshplan.StalePlanError, match="another device group"):
        meshplan.parallelize(m.train_step, plan=dataclasses.replace(plan, stages=tuple(st)))(
            state, batch)


@pytest.mark.parametrize("kw", [dict(dp=2, tp=2, pp=2, num_micro_batches=3),
                                dict(dp=4, tp=2, pp=1, num_micro_batches=4)])
def test_manual_interleaved_refuses_what_it_cannot_run(kw):
    with pytest.raises(meshplan.MeshplanError, match="interleaved 1F1B"):
        meshplan.Manual(schedule="interleaved", **kw)


def test_pipeshard_interleaved_refuses_a_micro_batch_count_it_cannot_run():
    m, state, batch = _model("mlp")
    with pytest.raises(meshplan.MeshplanError, match="multiple of the 2 stages"):
        meshplan.plan(m.train_step, state, batch, method=meshplan.PipeshardParallel(
            stages=2, num_micro_batches=3, schedule="interleaved"))


# ---------------------------------------------------------------------------
# the cost: the interleaved formula of the virtual stages' own latencies
# ---------------------------------------------------------------------------

def test_interleaved_iteration_formula():
    # one chunk per group: 1F1B's m t_max + (sum - t_max)
    assert interleaved_iteration_s([1.0, 3.0, 2.0], [0, 1, 2], 8) == pytest.approx(8 * 3 + 3)
    # p groups of v equal chunks t / v: m t + (p - 1) t / v (Narayanan et al. SC'21)
    p, v, m, t = 4, 2, 8, 1.0
    lats = [t / v] * (p * v)
    assert interleaved_iteration_s(lats, [k % p for k in range(p * v)], m) == \
        pytest.approx(m * t + (p - 1) * t / v)
    # the slowest group paces the steady state
    assert interleaved_iteration_s([1.0, 2.0, 1.0, 2.0], [0, 1, 0, 1], 4) == \
        pytest.approx(4 * 4 + (2 - 0) / 2)


def test_plan_is_costed_from_its_virtual_stages():
    m, state, batch = _model("gpt")
    cluster = meshplan.load_cluster(ROOT / "examples/clusters/dgx-a100-x1.json")
    plan = _plan("gpt", 2, 2, 2, 4, cluster=cluster)
    _check_layout(plan, 2)
    lats = [s.predicted.latency_s for s in plan.stages]
    assert all(t and t > 0 for t in lats)
    dispatch = cluster.device.achieved.program_dispatch_s
    want = interleaved_iteration_s(lats, plan.device_groups, 4) + len(lats) * dispatch
    assert plan.predicted.iteration_s == pytest.approx(want, rel=1e-9)
    # each group holds both its chunks' state and activations, and runs one
    # program at a time (the larger working set)
    def working(s):
        m = s.predicted.memory
        return s.predicted.memory_bytes - m.params - m.optimizer - m.activations

    per_group = [sum(s.predicted.memory_bytes - working(s) for s in plan.stages[g::2])
                 + max(working(s) for s in plan.stages[g::2]) for g in range(2)]
    assert plan.predicted.peak_memory_bytes == pytest.approx(max(per_group), abs=2)
    assert plan.predicted.peak_memory_bytes > max(s.predicted.memory_bytes for s in plan.stages)


def test_timeline_draws_interleaved_as_itself(tmp_path):
    from meshplan.tools.timeline import breakdown, draw, simulate
    cluster = meshplan.load_cluster(ROOT / "examples/clusters/dgx-a100-x1.json")
    plan = _plan("gpt", 2, 2, 2, 4, cluster=cluster)
    blocks = simulate(plan)
    assert len(blocks) == 2 * 4 * 4
    for g in range(2):
        mine = sorted((b for b in blocks if b.stage % 2 == g), key=lambda b: b.start)
        # one block at a time on a group's devices, in meshplan.schedule's order
        assert all(a.end <= b.start + 1e-15 for a, b in zip(mine, mine[1:]))
        assert [(b.kind, b.stage, b.micro_batch) for b in mine] == \
            group_order("interleaved", g, 2, 4, 2)
    end = {(b.kind, b.stage, b.micro_batch): b.end for b in blocks}
    start = {(b.kind, b.stage, b.micro_batch): b.start for b in blocks}
    assert all(start["F", k, i] >= end["F", k - 1, i] for k in range(1, 4) for i in range(4))
    assert all(start["B", k, i] >= end["B", k + 1, i] for k in range(3) for i in range(4))
    png = tmp_path / "interleaved.png"
    draw(plan, str(png))
    assert png.stat().st_size > 1000
    assert breakdown(plan, blocks).startswith("predicted")
