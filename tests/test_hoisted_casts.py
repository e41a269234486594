"""A mixed-precision step's parameter casts run once a step (stop 42): with
several micro-batches, the bfloat16 copy of a float32 weight is made ahead
of the micro-batches in its stage's R program and read by every
micro-batch, instead of a cast per micro-batch and per recomputation.  The
planner charges the cast once a step and counts the copy's bytes, as the
runtime runs and holds it; the numbers are the undecorated step's."""
from __future__ import annotations

import dataclasses
import functools

import jax
import pytest

import meshplan
from _steps import assert_states_close, jit_losses, run_plan
import meshplan.graph as graph_module
from meshplan.graph import GRAD_BOUNDARY
from meshplan.ilp.accumulation import update_nodes
from meshplan.models import build_model
from meshplan.runtime.pipeline_lower import stage_memory
from meshplan.runtime.pipeline_split import split_step
from meshplan.trace import trace_for_run

DGX = "examples/clusters/dgx-a100-x1.json"
GPT = {"optimizer": "sgd", "batch": "16", "seq_len": "32", "vocab": "64", "hidden": "64",
       "layers": "4", "dtype": "float32", "compute_dtype": "bfloat16"}


def _split(traced, m: int):
    flat = traced.flat
    return split_step(flat, traced.forward, [0] * len(flat.eqns), [(0, 0)],
                      [i for i, b in zip(flat.invars, traced.batch_leaves) if b], m,
                      traced.concat_outputs)


@functools.lru_cache(maxsize=None)
def _traced(micro_batches: int):
    m = build_model("gpt", GPT)
    state, batch = m.init(0)
    return trace_for_run(m.train_step, (state, batch), m.batch_argnums,
                         micro_batches=micro_batches)


def test_casts_of_parameters_run_ahead_once_and_the_planner_charges_them_once():
    tr = _traced(4)
    g, flat = tr.graph, tr.flat
    split = _split(tr, 4)
    params = set(flat.invars)
    casts = {k for k, fe in enumerate(flat.eqns) if fe.eqn.primitive.name == "convert_element_type"
             and fe.invars[0] in params and flat.avals[fe.outvars[0]].dtype == jax.numpy.bfloat16}
    assert casts and split.hoisted == casts
    assert all(split.eqn_phase[k] == "R" for k in casts)
    r = split.tasks[("R", 0)]
    assert set(r.outputs) == {flat.eqns[k].outvars[0] for k in casts}
    assert set(r.inputs) <= params
    for kind in ("F", "B"):
        assert not set(split.tasks[(kind, 0)].eqns) & casts
    # the planner's once-a-step set holds them, as the runtime's R and A phases
    grads = frozenset(t for n in g.nodes if n.primitive == GRAD_BOUNDARY for t in n.inputs)
    once, _ = update_nodes(g, grads)
    assert casts <= once
    assert not once & {k for k, ph in enumerate(split.eqn_phase) if ph in ("F", "B")}
    # one micro-batch: nothing to hoist
    assert not _split(_traced(1), 1).hoisted


def test_a_cast_read_by_the_update_or_of_the_batch_stays_where_it_is():
    def step(state, batch):
        w = state["w"]

        def loss(w):
            y = batch["x"].astype(jax.numpy.bfloat16) @ w.astype(jax.numpy.bfloat16)
            return (y.astype(jax.numpy.float32) ** 2).mean()
        l, gw = meshplan.value_and_grad(loss)(w)
        # the update reads a cast of the weight too: that one runs there
        return {"w": w - 0.1 * gw * w.astype(jax.numpy.bfloat16).astype(jax.numpy.float32)}, \
            {"loss": l}
    state = {"w": jax.numpy.ones((8, 8))}
    batch = {"x": jax.numpy.ones((4, 8))}
    tr = trace_for_run(step, (state, batch), (1,), micro_batches=2)
    split = _split(tr, 2)
    phases = {split.eqn_phase[k] for k, fe in enumerate(tr.flat.eqns)
              if fe.eqn.primitive.name == "convert_element_type"
              and tr.flat.avals[fe.outvars[0]].dtype == jax.numpy.bfloat16}
    # the weight's cast for the loss ahead, the batch's per micro-batch (and
    # the backward's of a gradient), the update's in the update
    assert phases == {"R", "F", "B", "A"}
    assert len(split.hoisted) == 1


@pytest.mark.parametrize("remat,schedule", [pytest.param("full", "1f1b", marks=pytest.mark.extended),
                                             ("none", "zb-h1")])
def test_a_mixed_precision_pipeline_matches_the_plain_step(remat, schedule):
    m = build_model("gpt", GPT)
    state, batch = m.init(0)
    plan = meshplan.plan(m.train_step, *m.abstract_args, cluster=meshplan.load_cluster(DGX),
                         method=meshplan.Manual(dp=2, tp=2, pp=2, num_micro_batches=4,
                                                remat=remat, schedule=schedule))
    want_losses, want = jit_losses(m.train_step, state, batch, 2)
    step, got, losses = run_plan(m.train_step, plan, state, batch, 2)
    assert losses == pytest.approx(want_losses, rel=1e-4)
    assert_states_close(want, got, 1e-2)
    # the R programs lower with the rest; each stage holds its copies
    compiled = step.lower(state, batch).compile()
    assert {k for k in compiled.compiled if k[0] == "R"} == {("R", 0), ("R", 1)}
    ex = step._entry((state, batch))[1]
    mem = stage_memory(ex, compiled)
    for s, sm in enumerate(mem):
        leaves = sum(a.size * a.dtype.itemsize for a in jax.tree_util.tree_leaves(state))
        copies = sum(ex.flat.avals[x].size * 2 for x in ex.split.tasks[("R", s)].outputs)
        assert copies > 0 and sm.state >= copies / 4     # (cut over at most 4 devices)
        assert sm.state < leaves


def test_the_planner_counts_the_copies_a_stage_keeps():
    m = build_model("gpt", GPT)
    cluster = meshplan.load_cluster(DGX)

    def params(mb: int) -> list[float]:
        p = meshplan.plan(m.train_step, *m.abstract_args, cluster=cluster,
                          method=meshplan.Manual(dp=2, tp=2, pp=2, num_micro_batches=mb))
        return [s.predicted.memory.params for s in p.stages]
    one, four = params(1), params(4)
    for a, b in zip(one, four):
        # a bfloat16 copy of the float32 weights (not of the float32-cast
        # layer-norm parameters): more than nothing, at most half
        assert a < b <= 1.5 * a


@functools.lru_cache(maxsize=None)
def _plan(remat: str, frac: float = 0.9):
    m = build_model("gpt", GPT)
    return meshplan.plan(m.train_step, *m.abstract_args, cluster=meshplan.load_cluster(DGX),
                         method=meshplan.Manual(dp=2, tp=2, pp=2, num_micro_batches=4,
                                                remat=remat, memory_fraction=frac))


def test_where_the_copies_do_not_fit_a_recomputing_stage_casts_per_micro_batch():
    kept = _plan("full")
    assert all(s.keep_casts for s in kept.stages)
    dev = meshplan.load_cluster(DGX).device.memory_bytes
    need = max(s.predicted.memory_bytes for s in kept.stages)
    copies = min(s.predicted.memory.params for s in kept.stages) / 3   # (a third of 6 B/param)
    p = _plan("full", (need - copies / 2) / dev)
    each = [s for s in p.stages if not s.keep_casts]
    assert each and all(s.recompute == "full" for s in p.stages)
    assert max(s.predicted.memory_bytes for s in p.stages) < need
    assert p.predicted.iteration_s > kept.predicted.iteration_s
    assert "weights cast per micro-batch" in str(p)
    back = meshplan.Plan.from_json(p.to_json())
    assert back.stages == p.stages and '"keep_casts": false' in p.to_json()
    assert '"keep_casts"' not in kept.to_json()


@pytest.mark.extended      # (about 35 s)
def test_without_copies_a_stage_casts_in_its_own_programs_and_matches():
    m = build_model("gpt", GPT)
    state, batch = m.init(0)
    kept = _plan("full")
    plan = dataclasses.replace(kept, stages=(kept.stages[0],
                                             dataclasses.replace(kept.stages[1], keep_casts=False)))
    want_losses, want = jit_losses(m.train_step, state, batch, 2)
    step, got, losses = run_plan(m.train_step, plan, state, batch, 2)
    assert losses == pytest.approx(want_losses, rel=1e-4)
    assert_states_close(want, got, 1e-2)
    split = step._entry((state, batch))[1].split
    assert ("R", 0) in split.tasks and ("R", 1) not in split.tasks
    assert split.hoisted and all(split.eqn_stage[k] == 0 for k in split.hoisted)
    # its backward casts again in its replay of the forward
    assert any(tr.eqns[k].eqn.primitive.name == "convert_element_type"
               for tr in [step._entry((state, batch))[1].flat] for k in split.tasks[("B", 1)].replay)


@pytest.mark.extended
def test_the_planner_holds_a_copy_once_not_per_micro_batch_in_flight(monkeypatch):
    # recomputing nothing, each micro-batch's backward read its own cast of
    # a weight, kept in flight; now every one reads the stage's copy
    kept = _plan("none")
    monkeypatch.setattr(graph_module, "hoisted_casts", lambda *a: frozenset())
    m = build_model("gpt", GPT)
    each = meshplan.plan(m.train_step, *m.abstract_args, cluster=meshplan.load_cluster(DGX),
                         method=meshplan.Manual(dp=2, tp=2, pp=2, num_micro_batches=4,
                                                remat="none"))
    for s, (a, b) in enumerate(zip(kept.stages, each.stages)):
        copies = a.predicted.memory.params - b.predicted.memory.params
        in_flight = 2 - s       # (1F1B, 2 stages)
        assert copies > 0
        # (the copies a backward read: the weights', not the biases' or the
        # position embedding's, whose casts fed only element-wise adds)
        gone = b.predicted.memory.activations - a.predicted.memory.activations
        assert 0.9 * in_flight * copies < gone <= in_flight * copies
    # and the runtime's backward reads no cast of a weight its forward made
    state, batch = m.init(0)
    step = meshplan.parallelize(m.train_step, plan=kept)
    step(state, batch)
    ex = step._entry((state, batch))[1]
    flat, split = ex.flat, ex.split
    made = {o: fe for fe in flat.eqns for o in fe.outvars}
    for s in range(2):
        for x in split.tasks[("B", s)].inputs:
            if split.producer.get(x) == ("F", s):
                assert not (made[x].eqn.primitive.name == "convert_element_type"
                            and made[x].invars[0] in set(flat.invars))


@pytest.mark.extended      # (about 40 s)
def test_a_mixed_precision_stage_keeps_what_the_plan_counts():
    # the runtime replays the element-wise chains layer by layer, as the
    # planner counts them (a float32 layer-norm chain is made again from its
    # bfloat16 input): before, judged over the whole step, it kept the
    # float32 chain values and 1.3-1.5x the planned bytes
    m = build_model("gpt", GPT)
    state, batch = m.init(0)
    plan = _plan("none")
    step = meshplan.parallelize(m.train_step, plan=plan)
    compiled = step.lower(state, batch).compile()
    mem = stage_memory(step._entry((state, batch))[1], compiled)
    for sm, st in zip(mem, plan.stages):
        assert sm.activations == pytest.approx(st.predicted.memory.activations, rel=0.05)


def test_a_selective_replay_reads_the_copy_and_casts_nothing_again(monkeypatch):
    def extra(plan_of) -> list[float]:
        none, sel = plan_of("none"), plan_of("selective")
        return [b.predicted.latency_s - a.predicted.latency_s
                for a, b in zip(none.stages, sel.stages)]
    m = build_model("gpt", GPT)

    def fresh(remat):
        return meshplan.plan(m.train_step, *m.abstract_args, cluster=meshplan.load_cluster(DGX),
                             method=meshplan.Manual(dp=2, tp=2, pp=2, num_micro_batches=4,
                                                    remat=remat))
    with_copies = extra(_plan)
    monkeypatch.setattr(graph_module, "hoisted_casts", lambda *a: frozenset())
    casting = extra(fresh)
    # the attention region's replay either way; the weights' casts only without copies
    for a, b in zip(with_copies, casting):
        assert 0 < a < b


def test_the_layer_ilp_counts_the_copies_in_its_memory_rows():
    from meshplan.cost_model.mesh import mesh_model
    from meshplan.ilp import build_problem
    from meshplan.plan import LogicalMesh
    g = _traced(4).graph
    grads = frozenset(t for n in g.nodes if n.primitive == GRAD_BOUNDARY for t in n.inputs)
    mm = mesh_model(meshplan.load_cluster(DGX), LogicalMesh(("data", "model"), (1, 2)))
    one = build_problem(g, mm, accumulate=grads, grad_accum=1)
    four = build_problem(g, mm, accumulate=grads, grad_accum=4)
    # the group making each copy holds its bytes in every layout, with several
    # micro-batches only
    casts = _split(_traced(4), 4).hoisted
    assert casts
    for k in casts:
        gid = four.group_of_tensor[g.nodes[k].outputs[0]]
        before = one.resident_rows.get(gid, 0.0)
        assert (four.resident_rows[gid] > before).all()
