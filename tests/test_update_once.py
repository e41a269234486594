"""The optimizer update is charged once a step, wherever it joined in the
ILP (stop 41): Adam's element-wise update follows its weight gradient's
matmul into one group, and was charged with it every micro-batch.  What the
planner takes for the update is what the pipeline runtime runs once a step."""
from __future__ import annotations

import pytest

import meshplan
from meshplan.cost_model.mesh import mesh_model
from meshplan.graph import GRAD_BOUNDARY
from meshplan.ilp import build_problem
from meshplan.ilp.accumulation import update_nodes
from meshplan.models import build_model
from meshplan.plan import LogicalMesh
from meshplan.runtime.pipeline_split import split_step
from meshplan.trace import trace_for_run

GPT = {"batch": "8", "seq_len": "16", "vocab": "64", "hidden": "32", "layers": "2",
       "heads": "2"}


def _traced(micro_batches: int = 4):
    m = build_model("gpt", GPT)
    state, batch = m.init(0)
    return trace_for_run(m.train_step, (state, batch), m.batch_argnums,
                         micro_batches=micro_batches)


def _grads(g) -> frozenset[int]:
    return frozenset(t for n in g.nodes if n.primitive == GRAD_BOUNDARY for t in n.inputs)


def test_the_update_is_what_the_pipeline_runtime_runs_once_a_step():
    tr = _traced()
    g, flat = tr.graph, tr.flat
    assert [n.id for n in g.nodes] == list(range(len(flat.eqns)))
    split = split_step(flat, tr.forward, [0] * len(flat.eqns), [(0, 0)],
                       [i for i, b in zip(flat.invars, tr.batch_leaves) if b], 4,
                       tr.concat_outputs)
    once, _ = update_nodes(g, _grads(g))
    # (markers and values made of constants alone are in neither: every
    # program that reads a constant makes it again)
    ran_once = {k for k, ph in enumerate(split.eqn_phase) if ph == "A"}
    per_mb = {k for k, ph in enumerate(split.eqn_phase) if ph in ("F", "B")}
    assert ran_once and ran_once <= once
    assert not (per_mb & once)
    # Adam's moments decay without reading the gradient: once a step too
    decays = [n.id for n in g.nodes if n.id in once and n.primitive == "mul"
              and not any(t in _grads(g) for t in n.inputs)]
    assert decays


def test_the_update_in_a_weight_gradients_group_costs_once_a_step():
    tr = _traced()
    g = tr.graph
    grads = _grads(g)
    once, _ = update_nodes(g, grads)
    cluster = meshplan.load_cluster("examples/clusters/dgx-a100-x1.json")
    mm = mesh_model(cluster, LogicalMesh(("data", "model"), (1, 2)))
    one = build_problem(g, mm, accumulate=grads, grad_accum=1)
    many = build_problem(g, mm, accumulate=grads, grad_accum=8)
    mixed = 0
    for a, b in zip(one.groups, many.groups):
        assert a.name == b.name and a.members == b.members
        nodes = ([a.root_node] if a.root_node is not None else []) + a.members
        if not (any(n in once for n in nodes) and any(n not in once for n in nodes)):
            continue
        mixed += 1
        for i in range(a.size):
            # what the update adds, at one eighth; the rest unchanged
            upd = a.update[i][0]
            assert 0 < upd < a.compute[i]
            assert b.compute[i] == pytest.approx(a.compute[i] - upd * 7 / 8, rel=1e-9)
    assert mixed >= 4      # a weight gradient's matmul per weight, at least

