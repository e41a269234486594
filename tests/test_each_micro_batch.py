"""Where memory binds, the searched methods also try reducing every gradient
each micro-batch (ZeRO-2's way): running sums in the parameters' layout
instead of whole per data shard.  The runtime then keeps no partial sums, and
the plan charges what runs."""
import dataclasses
import json

import jax
import numpy as np
import pytest

import meshplan
import meshplan.planning as planning
from meshplan.dp_search import SearchStats, Session, search_pipeline
from meshplan.errors import InfeasiblePlanError
from meshplan.ilp import EachMicroBatch, SequenceSplit
from meshplan.models import build_model
from meshplan.runtime import hlo

from _steps import losses_match

GPT = {"optimizer": "sgd"}


@pytest.fixture(scope="module")
def gpt_searched():
    """gpt's two-stage, four-micro-batch plan searched both ways, and what ran it."""
    m = build_model("gpt", GPT)
    session = Session.from_env()
    traced = planning.trace_function(m.train_step, m.abstract_args, tuple(m.batch_argnums),
                                     "gpt", session)
    cluster = meshplan.ClusterSpec.local()
    opts = meshplan.PipeshardParallel(stages=2, num_micro_batches=4).request(8).pipeline
    plans = {}
    for name, filt in (("plain", None), ("each", EachMicroBatch()), ("sequence", SequenceSplit())):
        p, _ = search_pipeline(traced.graph, cluster, dataclasses.replace(opts, input_filter=filt),
                               method_name="pipeshard", retrace=traced.retrace, session=session)
        plans[name] = p
    return m, plans


def _runs_as_jit(m, plan):
    """``plan`` round-trips through JSON and runs ``m``'s step with
    jax.jit's numbers; the step that ran it."""
    assert meshplan.Plan.from_json(plan.to_json()) == plan
    state, batch = jax.device_get(m.init(0))
    step = meshplan.parallelize(m.train_step, plan=plan)
    got, want = losses_match(step, state, batch, m.train_step)
    for a, b in zip(jax.tree_util.tree_leaves(jax.device_get(got)),
                    jax.tree_util.tree_leaves(jax.device_get(want))):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * float(np.max(np.abs(b))) + 1e-7)
    return step


class _Asked(list):
    """The filters the passes were asked with; ``counts``: their micro-batch
    counts; ``searches``: the inter-operator searches run, hand plans included."""
    counts: list
    searches: int


def _scripted(monkeypatch, base, first, second, third=None, hand=None):
    """search_pipeline answering ``first`` for the plain pass, ``second``
    for the each-micro-batch pass, ``third`` for the sequence-split one and
    ``hand`` for the hand plans of the winner's shape (a Plan: ``base`` with
    these (recompute, seconds[, counts that fit nothing though they would
    plan faster]); None: no plan fits); returns what the passes were asked."""
    asked = _Asked()
    asked.counts, asked.searches = [], 0

    def answer(spec):
        if spec is None:
            raise InfeasiblePlanError("no plan fits (scripted)")
        recompute, seconds, *squeezed = spec
        return dataclasses.replace(
            base, stages=tuple(dataclasses.replace(s, recompute=recompute, remat=recompute != "none")
                               for s in base.stages),
            predicted=dataclasses.replace(base.predicted, iteration_s=seconds)), \
            SearchStats(squeezed=tuple(squeezed[0]) if squeezed else (), distinct_layer_ilps=3)

    def fake(graph, cluster, opts, **kw):
        asked.searches += 1
        if opts.fixed is not None and kw["method_name"] != "manual":
            return answer(hand)     # (the hand plans of the winner's shape)
        asked.append(opts.input_filter)
        asked.counts.append(opts.num_micro_batches)
        f = opts.input_filter
        return answer(second if isinstance(f, EachMicroBatch) else
                      third if isinstance(f, SequenceSplit) else first)

    monkeypatch.setattr(planning, "search_pipeline", fake)
    return asked


def _plan(method=None, model="gpt"):
    m = build_model(model, GPT if model == "gpt" else {})
    return meshplan.plan(m.train_step, *m.abstract_args, cluster=meshplan.ClusterSpec.local(),
                         method=method or meshplan.PipeshardParallel(num_micro_batches=4))


def test_memory_bound_search_keeps_the_faster_of_both_ways(monkeypatch, gpt_searched):
    base = gpt_searched[1]["plain"]
    asked = _scripted(monkeypatch, base, ("full", 2.0), ("none", 1.5))
    p = _plan()
    assert len(asked) == 2 and p.reduce_grads_each_micro_batch
    assert p.predicted.iteration_s == 1.5 and planning.EACH_MICRO_BATCH_NOTE in p.notes
    # slower, and the sequence-split pass slower too: the first plan stays
    asked = _scripted(monkeypatch, base, ("full", 2.0), ("none", 2.5), ("full", 2.0))
    p = _plan()
    assert len(asked) == 3 and not p.reduce_grads_each_micro_batch
    assert p.predicted.iteration_s == 2.0
    assert planning.SEQUENCE_NOTE not in p.notes


def test_where_memory_still_binds_the_activations_are_split_along_the_sequence(
        monkeypatch, gpt_searched):
    base = gpt_searched[1]["plain"]
    # both passes recompute: the third, faster, wins and says so
    asked = _scripted(monkeypatch, base, ("full", 2.0), ("selective", 1.8), ("none", 1.2))
    p = _plan()
    assert [type(f) for f in asked] == [type(None), EachMicroBatch, SequenceSplit]
    assert p.predicted.iteration_s == 1.2 and planning.SEQUENCE_NOTE in p.notes
    assert p.reduce_grads_each_micro_batch        # (it reduces each micro-batch too)
    # it alone fits
    asked = _scripted(monkeypatch, base, None, None, ("full", 3.0))
    p = _plan()
    assert len(asked) == 3 and p.predicted.iteration_s == 3.0 and planning.SEQUENCE_NOTE in p.notes
    # a step with no [batch, sequence, ...] values (an MLP): no third pass
    asked = _scripted(monkeypatch, base, ("full", 2.0), ("selective", 1.8), ("none", 1.2))
    assert _plan(model="mlp").predicted.iteration_s == 1.8 and len(asked) == 2
    # where the second pass's faster plan recomputes nothing, there is no third
    asked = _scripted(monkeypatch, base, ("full", 2.0), ("none", 1.5), ("none", 1.0))
    assert _plan().predicted.iteration_s == 1.5 and len(asked) == 2


def test_the_second_pass_runs_only_where_memory_binds(monkeypatch, gpt_searched):
    base = gpt_searched[1]["plain"]
    asked = _scripted(monkeypatch, base, ("none", 2.0), ("none", 1.0))
    assert not _plan().reduce_grads_each_micro_batch and asked == [None]
    # nothing fits the plain way: the other way's plan
    # (it recomputes: the sequence-split pass is asked too, and fits nothing)
    asked = _scripted(monkeypatch, base, None, ("selective", 3.0))
    assert _plan().reduce_grads_each_micro_batch and len(asked) == 3
    # nothing fits any way: the plain search's error
    _scripted(monkeypatch, base, None, None, None)
    with pytest.raises(InfeasiblePlanError, match="scripted"):
        _plan()
    # a hand-made method's layouts stay as they are
    asked = _scripted(monkeypatch, base, ("full", 2.0), ("none", 1.0))
    _plan(meshplan.Manual(dp=2, tp=2, pp=2, num_micro_batches=4))
    assert len(asked) == 1 and not isinstance(asked[0], EachMicroBatch)


def test_counts_memory_kept_from_a_faster_plan_are_searched_again(monkeypatch, gpt_searched):
    """The first pass's plan recomputes nothing, but 2 micro-batches fit
    nothing although they would plan faster with memory to spare: the later
    passes search 2 micro-batches alone (moe-10b on 16 V100s)."""
    base = gpt_searched[1]["plain"]
    asked = _scripted(monkeypatch, base, ("none", 2.0, (2,)), ("none", 1.5))
    p = _plan(meshplan.PipeshardParallel())
    assert [type(f) for f in asked] == [type(None), EachMicroBatch]
    assert asked.counts == [None, (2,)]
    assert p.predicted.iteration_s == 1.5 and p.reduce_grads_each_micro_batch
    assert any(n.startswith("searched again with 2 micro-batch(es) alone") for n in p.notes)
    # the second pass's plan recomputes: the third searches the same count
    asked = _scripted(monkeypatch, base, ("none", 2.0, (2,)), ("selective", 1.8), ("none", 1.6))
    p = _plan(meshplan.PipeshardParallel())
    assert asked.counts == [None, (2,), (2,)] and p.predicted.iteration_s == 1.6
    # slower there: the first plan stays
    asked = _scripted(monkeypatch, base, ("none", 2.0, (2,)), ("none", 2.5))
    p = _plan(meshplan.PipeshardParallel())
    assert p.predicted.iteration_s == 2.0 and len(asked) == 2
    assert not any(n.startswith("searched again") for n in p.notes)
    # where the first plan recomputes, every count is searched again
    asked = _scripted(monkeypatch, base, ("full", 2.0, (2,)), ("none", 1.5))
    _plan(meshplan.PipeshardParallel())
    assert asked.counts == [None, None]


def test_a_faster_hand_plan_of_the_winners_shape_is_taken(monkeypatch, gpt_searched):
    base = gpt_searched[1]["plain"]
    _scripted(monkeypatch, base, ("none", 2.0), ("none", 1.0), hand=("none", 1.5))
    p = _plan()
    assert p.predicted.iteration_s == 1.5 and planning.HAND_MADE_NOTE in p.notes
    _scripted(monkeypatch, base, ("none", 2.0), ("none", 1.0), hand=("none", 2.5))
    p = _plan()
    assert p.predicted.iteration_s == 2.0 and planning.HAND_MADE_NOTE not in p.notes


def test_a_plan_chosen_among_searches_says_what_they_all_needed(monkeypatch, gpt_searched):
    """The winner's own search note counts its search alone; a note sums
    every search it was chosen among (3 layer ILPs each, scripted)."""
    base = gpt_searched[1]["plain"]
    asked = _scripted(monkeypatch, base, ("full", 2.0), ("none", 1.5), hand=("none", 1.2))
    p = _plan()
    assert asked.searches > 2 and planning.HAND_MADE_NOTE in p.notes
    want = planning.compared_note(SearchStats(searches=asked.searches,
                                              distinct_layer_ilps=3 * asked.searches))
    assert want in p.notes and f"among {asked.searches} " in want
    # one search (a hand-made method's): no such note
    _scripted(monkeypatch, base, ("none", 2.0), ("none", 1.0))
    p = _plan(meshplan.Manual(dp=2, tp=2, pp=2, num_micro_batches=4))
    assert not any(n.startswith("chosen among") for n in p.notes)


def test_gradients_reduced_each_micro_batch_run_as_planned(gpt_searched):
    m, plans = gpt_searched
    plan = dataclasses.replace(plans["each"], reduce_grads_each_micro_batch=True)
    step = _runs_as_jit(m, plan)
    assert step._fast[1].partial is None        # (no sums kept whole per data shard)
    # each stage's collectives, as compiled, are what the plan charges
    compiled = meshplan.parallelize(m.train_step, plan=plan).lower(*m.abstract_args).compile()
    for s, st in enumerate(plan.stages):
        actual = sum(compiled.runs(key) * hlo.collective_bytes(co.as_text())
                     for key, co in compiled.stage(s).items())
        assert abs(actual - st.predicted.comm_bytes) <= 0.1 * st.predicted.comm_bytes, (s, actual)
    # and the running sums are counted in the parameters' layout: no more
    # gradient bytes than parameter bytes (sums kept whole per data shard
    # may count more)
    for st in plan.stages:
        assert st.predicted.memory.grads <= st.predicted.memory.params


@pytest.mark.extended   # (such plans run: test_gradients_reduced_each_micro_batch_run_as_planned)
def test_the_runtime_keeps_no_partial_sums_for_such_a_plan():
    # (a Manual plan whose data-parallel sums the runtime keeps whole per
    # shard, marked as reducing them each micro-batch: the backwards reduce them)
    m = build_model("gpt", GPT)
    state, batch = jax.device_get(m.init(0))
    plan = meshplan.plan(m.train_step, state, batch, method=meshplan.Manual(
        dp=2, tp=2, pp=2, num_micro_batches=4))
    for flag in (False, True):
        step = meshplan.parallelize(
            m.train_step, plan=dataclasses.replace(plan, reduce_grads_each_micro_batch=flag))
        _, metrics = step(state, batch)
        _, ref = jax.jit(m.train_step)(state, batch)
        np.testing.assert_allclose(float(metrics["loss"]), float(ref["loss"]), rtol=1e-5)
        assert (step._fast[1].partial is None) == flag


def test_a_plan_searched_with_the_sequence_split_runs_as_planned(gpt_searched):
    # (activations between layers split along the sequence, each layer
    # gathering them where it chose)
    m, plans = gpt_searched
    step = _runs_as_jit(m, dataclasses.replace(plans["sequence"],
                                               reduce_grads_each_micro_batch=True))
    assert step._fast[1].partial is None        # (as the planner marks such a plan)


def test_the_sequence_split_filter():
    from meshplan.graph import BATCH, PARAM, GraphInput, Tensor
    f = SequenceSplit()
    act = GraphInput(tensor=0, argnum=0, path="", role="boundary")
    x = Tensor(id=0, shape=(4, 16, 8), dtype="float32", kind="input")
    assert f(act, ((), (1,), ()), x) and f(act, ((0,), (1,), ()), x)
    assert not f(act, ((), (), ()), x) and not f(act, ((), (1,), (0,)), x)
    ids = Tensor(id=0, shape=(4, 16, 1), dtype="int32", kind="input")
    assert f(act, ((), (), ()), ids)        # token ids and positions stay free
    assert f(GraphInput(0, 0, "", PARAM), ((), (), ()), x)
    assert f(GraphInput(0, 0, "", BATCH), ((0,), (), ()), x)


def test_recomputation_the_method_asks_for_is_not_called_memory_binding(
        monkeypatch, gpt_searched):
    # (ShardParallel(remat="full") with memory to spare: the sequence-split
    # pass's note said "memory binds")
    _scripted(monkeypatch, gpt_searched[1]["plain"], ("full", 2.0), ("full", 1.9),
              ("full", 1.2))
    p = _plan(method=meshplan.PipeshardParallel(num_micro_batches=4))
    assert planning.SEQUENCE_NOTE in p.notes
    p = _plan(method=meshplan.ShardParallel(remat="full"))
    assert p.predicted.iteration_s == 1.2
    assert not any(planning.BINDS in n for n in p.notes), p.notes
    assert any(planning.ASKED in n for n in p.notes), p.notes


def test_data_shards_of_one_example_are_priced_as_reducing_each_micro_batch():
    """Sweep A (stop 93): with micro-batches of one example per data shard
    the runtime cannot trace the step at a shard's rows where meshplan found
    its gradients itself (trace.micro.ONE_EXAMPLE), so every backward
    all-reduces its gradients (runtime.pipeline_partial); the plan charged
    one reduction a step, a quarter of what the last stage sends.  The stage
    DP now prices it as the runtime runs it."""
    import jax.numpy as jnp
    import optax
    tx = optax.sgd(0.1)
    params = {"layers": [{"w": jax.ShapeDtypeStruct((64, 64), jnp.float32),
                          "b": jax.ShapeDtypeStruct((64,), jnp.float32)} for _ in range(4)],
              "head": jax.ShapeDtypeStruct((64, 8), jnp.float32)}

    def step(state, batch):
        def loss_fn(p):
            x = batch["x"]
            for layer in p["layers"]:
                x = x + jnp.tanh(x @ layer["w"] + layer["b"])
            return optax.softmax_cross_entropy_with_integer_labels(x @ p["head"],
                                                                   batch["y"]).mean()
        loss, g = jax.value_and_grad(loss_fn)(state["params"])
        u, opt = tx.update(g, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], u), "opt": opt}, {"loss": loss}
    state = {"params": params, "opt": jax.eval_shape(tx.init, params)}
    batch = {"x": jax.ShapeDtypeStruct((16, 64), jnp.float32),
             "y": jax.ShapeDtypeStruct((16,), jnp.int32)}
    # (16 rows, 4 micro-batches, 4 data shards: one example each)
    s = meshplan.parallelize(step, method=meshplan.Manual(dp=4, tp=1, pp=2, num_micro_batches=4))
    compiled = s.lower(state, batch).compile()
    last = len(s.plan.stages) - 1
    actual = sum(compiled.runs(key) * hlo.collective_bytes_per_call(co.as_text())
                 for key, co in compiled.stage(last).items())
    assert any(key[0] == "B" and hlo.collective_bytes_per_call(co.as_text())
               for key, co in compiled.stage(last).items())     # (a backward reduces)
    assert s.plan.stages[last].predicted.comm_bytes == pytest.approx(actual, rel=0.01)


def test_a_stages_deferred_axes_round_trip_and_files_without_them_leave_it_to_the_runtime():
    # a pipeline plan records, per stage, the axes its gradient sums wait
    # over (runtime.pipeline_partial keeps partial sums over those alone)
    m = build_model("mlp", {"layers": 4, "hidden": 32, "batch": 16})
    plan = meshplan.plan(m.train_step, *m.abstract_args,
                         cluster=meshplan.ClusterSpec.local(),
                         method=meshplan.Manual(dp=4, tp=1, pp=2, num_micro_batches=4))
    axes = [s.deferred_axes for s in plan.stages]
    assert all(a is not None and set(a) <= set(s.logical_mesh.axes)
               for a, s in zip(axes, plan.stages)), axes
    # (a data-parallel mlp: its sums wait over the data axis, reduced once a step)
    assert all("data" in a for a in axes), axes
    d = json.loads(plan.to_json())
    assert [s["deferred_axes"] for s in d["stages"]] == [list(a) for a in axes]
    assert [s.deferred_axes for s in meshplan.Plan.from_json(plan.to_json()).stages] == axes
    for s in d["stages"]:
        del s["deferred_axes"]
    assert all(s.deferred_axes is None
               for s in meshplan.Plan.from_json(json.dumps(d)).stages)
