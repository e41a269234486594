"""A weight read by several layers (a tied embedding, which the LM head reads
again): a backward op that reads a gradient made in the backward of layer L
and that weight runs in layer L, not in the weight's first layer; only the
weight's own gradient and its update follow the weight.  So the float32 GPT's
``dlogits @ wte`` runs with the head, no ``[batch, seq, vocab]`` gradient goes
back to the first stage, and the pipeline still computes the plain step."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

import meshplan
from meshplan.dp_search.layers import assign_layers
from meshplan.markers import mark_pipeline_boundary, value_and_grad
from meshplan.models import build_model
from meshplan.trace import trace, trace_for_run

from test_pipeline_runtime import _assert_close, _plan, _run

CLUSTER = "examples/clusters/dgx-a100-x1.json"
# float32 compute (the default): the head reads wte itself, not a cast of it
GPT = {"layers": "2", "hidden": "32", "heads": "2", "seq_len": "16", "vocab": "256",
       "batch": "8"}


def _stages(plan):
    return {l: s for s, st in enumerate(plan.stages) for l in range(st.layers[0], st.layers[1] + 1)}


def test_tied_head_backward_runs_with_the_head_and_no_vocab_gradient_crosses():
    m = build_model("gpt", GPT)
    mb = 2
    plan = meshplan.plan(m.train_step, *m.abstract_args,
                         cluster=meshplan.load_cluster(CLUSTER).with_devices(1, 2),
                         method=meshplan.Manual(dp=1, tp=1, pp=2, num_micro_batches=mb))
    g = trace_for_run(m.train_step, m.abstract_args, (1,), mb).graph
    layer = plan.layer_of_node
    L = max(layer) + 1
    wte = next(i.tensor for i in g.inputs if i.path == "['params']['wte']")
    V = g.tensors[wte].shape[0]
    b, s = int(GPT["batch"]) // mb, int(GPT["seq_len"])
    head = [n for n in g.nodes if n.primitive == "dot_general" and wte in n.inputs]
    fwd = [n for n in head if g.tensors[n.outputs[0]].shape == (b, s, V)]
    bwd = [n for n in head if any(g.tensors[t].shape == (b, s, V) for t in n.inputs)]
    assert len(fwd) == 1 and len(bwd) == 1
    # the head's backward matmul (dlogits x wte) is in the last layer, with the head
    assert layer[bwd[0].id] == layer[fwd[0].id] == L - 1
    # the embedding's gather and wte's update stay in the first layer
    assert layer[next(n.id for n in g.nodes if n.primitive == "gather" and wte in n.inputs)] == 0
    new_wte = next(o.tensor for o in g.outputs
                   if o.updates is not None and g.inputs[o.updates].tensor == wte)
    assert layer[g.producer[new_wte]] == 0
    # no [batch, seq, vocab] value goes from one stage to another
    stage = _stages(plan)
    const = g.constant_nodes
    for n in g.nodes:
        for t in n.inputs:
            p = g.producer.get(t)
            if p is None or p in const or stage[layer[p]] == stage[layer[n.id]]:
                continue
            assert g.tensors[t].nbytes < b * s * V * 4, (g.nodes[p], n)


def test_a_weight_read_by_two_layers_places_each_backward_matmul_with_its_layer():
    """Not about embeddings: a weight read in the first and the last of three
    marked layers.  Each backward matmul reading it joins the layer whose
    gradient it reads; its gradient and its update join its first layer."""
    opt = optax.sgd(0.1)

    def loss_fn(p, x):
        h = jnp.tanh(jnp.tanh(x @ p["e"]) @ p["w"])
        h = mark_pipeline_boundary(h)
        h = jnp.tanh(h @ p["v"])
        h = mark_pipeline_boundary(h)
        return jnp.mean(jnp.tanh(h @ p["w"]) ** 2)

    def step(state, x):
        loss, gr = value_and_grad(loss_fn)(state["params"], x)
        u, o = opt.update(gr, state["opt_state"], state["params"])
        return {"params": optax.apply_updates(state["params"], u), "opt_state": o}, loss

    k = jax.random.split(jax.random.PRNGKey(0), 4)
    p = {n: jax.random.normal(kk, (16, 16)) / 4 for n, kk in zip("ewv", k)}
    state = {"params": p, "opt_state": opt.init(p)}
    x = jax.random.normal(k[3], (8, 16))
    g = trace(step, state, x)
    lay = assign_layers(g)
    assert lay.marked and lay.num_layers == 3
    w = next(i.tensor for i in g.inputs if i.path.endswith("['params']['w']"))
    readers = [n for n in g.nodes if w in n.inputs]
    fwd = [lay.layer_of_node[n.id] for n in readers if lay.forward[n.id]]
    bwd = [lay.layer_of_node[n.id] for n in readers
           if not lay.forward[n.id] and n.primitive == "dot_general"]
    assert sorted(fwd) == [0, 2] and sorted(bwd) == [0, 2]
    new_w = next(o.tensor for o in g.outputs
                 if o.updates is not None and g.inputs[o.updates].tensor == w)
    assert lay.layer_of_node[g.producer[new_w]] == 0
    # and the pipeline (w's readers on two stages) computes the plain step
    plan = meshplan.plan(step, state, x, method=meshplan.Manual(dp=4, tp=1, pp=2,
                                                                num_micro_batches=2))
    assert len(plan.stages) == 2
    got = meshplan.parallelize(step, plan=plan)
    ref = jax.jit(step)
    ref_state, got_state = state, jax.device_get(state)
    for _ in range(2):
        ref_state, ref_loss = ref(ref_state, x)
        got_state, got_loss = got(got_state, x)
        np.testing.assert_allclose(float(got_loss), float(ref_loss), rtol=1e-5)
    assert got._fast[1].split.moved == 0
    for a, c in zip(jax.tree_util.tree_leaves(ref_state), jax.tree_util.tree_leaves(got_state)):
        np.testing.assert_allclose(np.asarray(c), np.asarray(a), rtol=1e-5, atol=1e-6)


def test_tied_gpt_pipeline_moves_nothing_and_equals_the_plain_step():
    """The runtime splits the step by the plan's layers: with the head's
    backward matmul on the last stage it has no op to move off its layer's
    stage (before, it moved that one), and the numbers are the plain step's."""
    plan = _plan("gpt", 4, 1, 2, 2, "gpipe")
    assert len(plan.stages) == 2
    step, state, losses = _run("gpt", plan)
    assert step._fast[1].split.moved == 0
    _assert_close(state, losses, "gpt")
