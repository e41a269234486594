"""Overlap of communication with compute (meshplan.cost_model.overlap): the
rule on synthetic figures, the cluster field that turns it on, and what it
does to plans on GPU and CPU clusters."""
import dataclasses
import json
import pathlib
import random

import pytest

import meshplan
from meshplan.cluster import ClusterSpec, load_cluster
from meshplan.cost_model.overlap import Backward, StageWork, hidden_s
from meshplan.errors import ClusterSpecError
from meshplan.models import build_model

ROOT = pathlib.Path(__file__).resolve().parents[1]
A100 = ROOT / "examples" / "clusters" / "dgx-a100-x1.json"


def latency(w: StageWork, overlaps: bool = True) -> float:
    return w.compute_s + w.comm_s + w.send_s - hidden_s(w, overlaps)


# -- the rule, on synthetic figures ------------------------------------------

def exposed(steps):
    return Backward.of_steps(steps).exposed_s


def test_the_last_reduction_is_always_exposed():
    # one gradient at the very end of the backward: nothing after it to hide under
    assert exposed([(5.0, 2.0)]) == 2.0
    # two: the first hides under the 3 s computed after it, the last does not
    assert exposed([(5.0, 2.0), (3.0, 1.0)]) == 1.0
    # reductions serial on the network: 4 + 1 s of them after 3 s of compute
    assert exposed([(5.0, 4.0), (3.0, 1.0)]) == pytest.approx(2.0)
    # compute after the last gradient hides it too
    assert exposed([(5.0, 2.0), (3.0, 0.0)]) == 0.0
    assert exposed([]) == 0.0


def test_stretches_chain_as_their_steps_do():
    rnd = random.Random(3)
    for _ in range(500):
        a = [(rnd.uniform(0, 2), rnd.choice([0.0, rnd.uniform(0, 2)]))
             for _ in range(rnd.randint(0, 5))]
        b = [(rnd.uniform(0, 2), rnd.choice([0.0, rnd.uniform(0, 2)]))
             for _ in range(rnd.randint(0, 5))]
        whole, chained = Backward.of_steps(a + b), Backward.of_steps(a).then(Backward.of_steps(b))
        assert chained.compute_s == pytest.approx(whole.compute_s)
        assert chained.reduce_s == pytest.approx(whole.reduce_s)
        assert chained.exposed_s == pytest.approx(whole.exposed_s)


def test_hidden_is_bounded_by_the_backward_compute_available():
    # 1 s of gradient reduction, 0.25 s of backward compute after it is ready
    bw = Backward.of_steps([(9.75, 1.0), (0.25, 0.0)])
    assert hidden_s(StageWork(10.0, 1.5, backward=bw), True) == pytest.approx(0.25)
    # with B micro-batches the reductions run once (comm_s counts 1/B of
    # them), in the means program after the last backward: none hides
    w4 = StageWork(10.0, 0.5 + 1.0 / 4, backward=bw, num_micro_batches=4)
    assert hidden_s(w4, True) == 0.0


def test_per_micro_batch_collectives_leave_out_the_once_a_step_reductions():
    bw = Backward.of_steps([(3.0, 1.0), (1.0, 0.0)])    # one reduction of 1 s a step
    # a micro-batch runs 0.5 s of tensor-parallel collectives and carries
    # 1/4 of the step's reduction
    w = StageWork(10.0, 0.5 + 1.0 / 4, backward=bw, num_micro_batches=4)
    assert w.per_micro_batch_comm_s == pytest.approx(0.5)
    # one micro-batch: the reduction is the step's own, left out as well
    assert dataclasses.replace(w, comm_s=1.5, num_micro_batches=1).per_micro_batch_comm_s \
        == pytest.approx(0.5)
    assert StageWork(1.0, 0.0, backward=bw).per_micro_batch_comm_s == 0.0


def test_sends_hide_under_the_next_micro_batch_but_the_last():
    w = StageWork(compute_s=4.0, comm_s=1.0, send_s=2.0, num_micro_batches=4)
    assert hidden_s(w, True) == pytest.approx(2.0 * 3 / 4)
    assert hidden_s(dataclasses.replace(w, num_micro_batches=1), True) == 0.0
    # tensor-parallel collectives (comm_s without gradient reductions) never hide
    assert hidden_s(StageWork(compute_s=4.0, comm_s=3.0), True) == 0.0


def test_without_overlap_nothing_hides():
    w = StageWork(4.0, 2.0, 1.0, Backward.of_steps([(3.0, 8.0), (1.0, 0.0)]), 8)
    assert hidden_s(w, False) == 0.0
    assert latency(w, False) == 4.0 + 2.0 + 1.0


def test_overlap_never_makes_a_stage_cheaper_than_its_compute_or_its_communication():
    rnd = random.Random(16)
    for _ in range(2000):
        B = rnd.randint(1, 16)
        steps = [(rnd.uniform(0, 2), rnd.choice([0.0, rnd.uniform(0, 2)]))
                 for _ in range(rnd.randint(0, 6))]
        bw = Backward.of_steps(steps)
        compute = bw.compute_s + rnd.uniform(0, 3)
        grad = bw.reduce_s / B          # amortised over the micro-batches, as comm_s counts it
        w = StageWork(compute, grad + rnd.uniform(0, 3), rnd.choice([0.0, rnd.uniform(0, 5)]),
                      bw, B)
        t, plain = latency(w), latency(w, False)
        assert t >= max(w.compute_s, w.comm_s + w.send_s) - 1e-12
        assert t <= plain
        # what hides is gradient reductions and sends, nothing else
        assert plain - t <= grad + w.send_s + 1e-12


# -- the cluster field ----------------------------------------------------------

def test_overlap_is_a_documented_cluster_field_off_by_default():
    data = json.loads(A100.read_text())
    assert data["device"]["achieved"]["overlap_communication"] is True
    assert any("overlap_communication" in s for s in data["sources"])
    # a file from before the field (or a CPU cluster) keeps every collective on
    # the critical path
    del data["device"]["achieved"]["overlap_communication"]
    old = ClusterSpec.from_dict(data)
    assert old.device.achieved.overlap_communication is False
    assert ClusterSpec.from_dict(old.to_dict()) == old
    assert "collectives overlap compute" in load_cluster(A100).describe()
    data["device"]["achieved"]["overlap_communication"] = "yes"
    with pytest.raises(ClusterSpecError, match=r"overlap_communication.*true or false"):
        ClusterSpec.from_dict(data)


def test_cpu_clusters_do_not_overlap():
    assert not ClusterSpec.local().device.achieved.overlap_communication
    grid = load_cluster(ROOT / "benchmarks" / "results" / "measured_grid_cluster.json")
    assert not grid.device.achieved.overlap_communication


# -- plans ------------------------------------------------------------------------

GPT = {"layers": 2, "hidden": 256, "heads": 4, "seq_len": 128, "vocab": 1024, "batch": 32}


def _without_overlap(cluster: ClusterSpec) -> ClusterSpec:
    a = dataclasses.replace(cluster.device.achieved, overlap_communication=False)
    return dataclasses.replace(cluster, device=dataclasses.replace(cluster.device, achieved=a))


def _plan(cluster, method, config=GPT):
    m = build_model("gpt", config)
    return meshplan.plan(m.train_step, *m.abstract_args, cluster=cluster, method=method)


# gradients of 100 MiB: XLA reduces them in several merged collectives (of
# 30 MiB, ilp.decode.grad_steps), all but the last hidden behind the backward
WIDE = {**GPT, "hidden": 1024}


def test_data_parallel_gets_cheaper_by_at_most_its_gradient_reduction():
    on = load_cluster(A100)
    fast = _plan(on, meshplan.DataParallel(), WIDE)
    slow = _plan(_without_overlap(on), meshplan.DataParallel(), WIDE)
    saved = slow.predicted.iteration_s - fast.predicted.iteration_s
    reduce_s = _gradient_reduction_s(on, slow, WIDE)
    assert 0 < saved < reduce_s
    # the same layouts: overlap changes the time, not the plan
    assert fast.stages[0].params == slow.stages[0].params
    assert fast.stages[0].predicted.comm_s == slow.stages[0].predicted.comm_s


def _gradient_reduction_s(cluster, plan, config=GPT) -> float:
    """The data-parallel plan's gradient reductions, from its ILP solved again."""
    from meshplan.graph import GRAD_BOUNDARY, strip_markers
    from meshplan.ilp import InputLayouts, solve_intra_op
    from meshplan.trace import trace
    m = build_model("gpt", config)
    g = trace(m.train_step, *m.abstract_args, batch_argnums=m.batch_argnums)
    grads = frozenset(t for n in g.nodes if n.primitive == GRAD_BOUNDARY for t in n.inputs)
    r = solve_intra_op(strip_markers(g), cluster, plan.stages[0].logical_mesh,
                       input_filter=InputLayouts("replicated"), accumulate=grads)
    assert r.comm_s == pytest.approx(plan.stages[0].predicted.comm_s)
    return sum(red for _, red in r.grad_steps)   # (one micro-batch: per iteration = per step)


def test_a_pipeline_stage_hides_only_gradient_reductions_and_sends():
    on = load_cluster(A100)
    method = meshplan.Manual(dp=4, tp=1, pp=2, num_micro_batches=4)
    fast, slow = _plan(on, method), _plan(_without_overlap(on), method)
    for f, s in zip(fast.stages, slow.stages):
        assert f.predicted.compute_s == s.predicted.compute_s
        assert f.predicted.latency_s <= s.predicted.latency_s
        assert f.predicted.latency_s >= max(f.predicted.compute_s, f.predicted.comm_s)
    assert fast.predicted.iteration_s < slow.predicted.iteration_s
