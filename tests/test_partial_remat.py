"""Recomputing only the first k of a stage's layers (Mist's per-stage count,
issue 23): the stage DP prices it between none and full and takes it where
memory binds, the plan records it, and the pipeline runtime replays only
those layers' forward, with the numbers of the undecorated step."""
import dataclasses
import functools
import json

import jax
import numpy as np
import pytest

import meshplan
from _steps import assert_states_close, jit_losses, run_plan
from meshplan.errors import PlanFormatError
from meshplan.models import build_model
from meshplan.api import _replay
from meshplan.dp_search.layers import assign_layers
from meshplan.plan import Plan
from meshplan.trace import trace

DGX = "examples/clusters/dgx-a100-x1.json"
GPT = {"optimizer": "sgd", "layers": "6", "hidden": "64", "seq_len": "32", "vocab": "64",
       "batch": "16"}


@functools.lru_cache(maxsize=None)
def _manual(remat, frac=0.9):
    m = build_model("gpt", GPT)
    return meshplan.plan(m.train_step, *m.abstract_args, cluster=meshplan.load_cluster(DGX),
                         method=meshplan.Manual(dp=2, tp=2, pp=2, num_micro_batches=4,
                                                remat=remat, memory_fraction=frac))


def _need(p) -> int:
    return max(s.predicted.memory_bytes for s in p.stages)


@pytest.mark.extended
def test_where_none_does_not_fit_some_layers_recompute_and_the_rest_not():
    none, sel, full = (_manual(r) for r in ("none", "selective", "full"))
    dev = meshplan.load_cluster(DGX).device.memory_bytes
    # half way between all-full and the least that recomputes no weight matmul
    frac = (_need(full) + 0.5 * (min(_need(none), _need(sel)) - _need(full))) / dev
    p = _manual(None, frac)
    parts = [s for s in p.stages if s.recompute_layers]
    assert parts, [(s.recompute, s.recompute_layers) for s in p.stages]
    for s in parts:
        assert s.recompute == "full" and s.remat
        assert 0 < s.recompute_layers < s.layers[1] - s.layers[0] + 1
        assert f"remat (first {s.recompute_layers} layers)" in str(p)
    assert _need(p) <= frac * dev
    # faster than recomputing every layer, slower than recomputing none
    assert none.predicted.iteration_s < p.predicted.iteration_s < full.predicted.iteration_s
    # each stage's activations lie between its none and full figures
    for k, s in enumerate(p.stages):
        a = s.predicted.memory.activations
        assert full.stages[k].predicted.memory.activations <= a <= \
            none.stages[k].predicted.memory.activations


def test_the_count_round_trips_and_is_checked():
    s = _manual("full").stages[0]
    part = dataclasses.replace(s, recompute_layers=2)
    d = json.loads(json.dumps(part.to_dict()))
    assert d["recompute_layers"] == 2
    assert type(part).from_dict(d) == part
    assert "recompute_layers" not in s.to_dict()       # (absent when all recompute)
    with pytest.raises(PlanFormatError, match="recompute_layers"):
        dataclasses.replace(s, recompute_layers=s.layers[1] - s.layers[0] + 1)
    with pytest.raises(PlanFormatError, match="recompute_layers"):
        dataclasses.replace(s, remat=False, recompute="none", recompute_layers=1)


# ---------------------------------------------------------------------------
# the runtime
# ---------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _model():
    m = build_model("gpt", GPT)
    state, batch = jax.device_get(m.init(0))
    return m, state, batch


def _local(stage0: dict) -> Plan:
    m, state, batch = _model()
    p = meshplan.plan(m.train_step, state, batch,
                      method=meshplan.Manual(dp=2, tp=2, pp=2, num_micro_batches=4))
    first = dataclasses.replace(p.stages[0], remat=stage0["recompute"] != "none", **stage0)
    return dataclasses.replace(p, stages=(first,) + p.stages[1:])


def _run(plan, steps):
    m, state, batch = _model()
    step, state, losses = run_plan(m.train_step, plan, state, batch, steps)
    return step._fast[1], state, losses


def _kept_between(ex, s):
    """Bytes stage ``s``'s backward reads from its forward program (or from
    what that forward received), per micro-batch."""
    f, b = ex.programs[("F", s)].task, ex.programs[("B", s)].task
    made = {o for k in f.eqns for o in ex.flat.eqns[k].outvars}
    kept = [x for x in b.inputs if x in made or (x in f.inputs and x not in ex.flat.invars)]
    return sum(np.prod(ex.flat.avals[x].shape) * ex.flat.avals[x].dtype.itemsize for x in kept)


@pytest.mark.extended   # (one program: test_one_program_recomputing_its_first_layers_...)
def test_a_stage_recomputing_its_first_layers_equals_the_undecorated_step():
    plan = _local({"recompute": "full", "recompute_layers": 2})
    ex, state, losses = _run(plan, steps=3)
    m, state0, batch = _model()
    ref_losses, ref_state = jit_losses(m.train_step, state0, batch, 3)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_states_close(ref_state, state)
    # the replayed forward is the first two layers' (and only theirs' matmuls)
    lo, hi = plan.stages[0].layers
    layer = plan.layer_of_node
    b0 = ex.programs[("B", 0)].task
    dots = [k for k in b0.replay if ex.flat.eqns[k].eqn.primitive.name == "dot_general"]
    assert dots and all(layer[k] < lo + 2 for k in dots)
    # the later layers' matmuls are not replayed: their results were kept
    later = [k for k in ex.programs[("F", 0)].task.eqns if lo + 2 <= layer[k] <= hi
             and ex.flat.eqns[k].eqn.primitive.name == "dot_general"]
    assert later and not set(later) & set(b0.replay)


@pytest.mark.extended
def test_what_a_stage_keeps_falls_as_more_of_its_layers_recompute():
    kept = []
    for stage0 in ({"recompute": "none"}, {"recompute": "full", "recompute_layers": 2},
                   {"recompute": "full"}):
        ex, _, _ = _run(_local(stage0), steps=1)
        kept.append(_kept_between(ex, 0))
    assert kept[0] > kept[1] > kept[2], kept


@pytest.mark.extended      # (about 45 s)
def test_one_program_recomputing_its_first_layers_equals_the_undecorated_step():
    m, state, batch = _model()
    p = meshplan.plan(m.train_step, state, batch, method=meshplan.Manual(dp=4, tp=2, remat="full"))
    assert len(p.stages) == 1 and p.num_micro_batches == 1
    whole = p
    p = dataclasses.replace(p, stages=(dataclasses.replace(p.stages[0], recompute_layers=2),))
    # the program binds again the first two layers' values only
    g = trace(m.train_step, *m.abstract_args, batch_argnums=m.batch_argnums)
    mine, all_ = (_replay(q, g) for q in (p, whole))
    layer = p.layer_of_node or assign_layers(g).layer_of_node
    eqns = [k for grp in mine.groups for k in grp]
    assert eqns and all(layer[k] < 2 for k in eqns)
    assert set(eqns) < {k for grp in all_.groups for k in grp}
    step = meshplan.parallelize(m.train_step, plan=p)
    got_state, got = step(state, batch)
    ref_state, ref = jax.jit(m.train_step)(state, batch)
    assert float(got["loss"]) == pytest.approx(float(ref["loss"]), rel=1e-5)
    for a, b in zip(jax.tree_util.tree_leaves(ref_state), jax.tree_util.tree_leaves(got_state)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-6)
