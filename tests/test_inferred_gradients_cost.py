"""A step written with plain ``jax.value_and_grad`` is planned and costed as
the same step written with ``meshplan.value_and_grad`` (issue 17): the
gradients found in its jaxpr (meshplan.trace.micro) are marked in the
parameters' shapes, mapped to their parameters by the data flow (not by the
backward's order), and marked in the whole-batch trace too, so that one
micro-batch (the whole-graph ILP and its gradient-reduction overlap) sees
them as several micro-batches do."""
import jax
import jax.numpy as jnp
import optax
import pytest

import meshplan
from meshplan.dp_search.layers import assign_layers, gradient_parameters
from meshplan.graph import GRAD_BOUNDARY
from meshplan.trace import trace_both
from meshplan.trace.tracer import trace_micro

ADAM = optax.adam(1e-3)
# non-square weights: jax's weight gradient comes out of a dot_general transposed
SHAPES = [(64, 128), (128, 96), (96, 128), (128, 64)]
CLUSTER = "examples/clusters/aws-p3.16xlarge-x1.json"


def _loss(p, x, y):
    h = x
    for w, b in p:
        h = jnp.tanh(h @ w + b)
    return jnp.mean((h - y) ** 2)


def _step(grad):
    def step(state, batch):
        p, o = state
        loss, g = grad(_loss)(p, batch["x"], batch["y"])
        u, o = ADAM.update(g, o, p)
        return (optax.apply_updates(p, u), o), {"loss": loss}
    return step


def _args(batch=64):
    p = [(jax.ShapeDtypeStruct(s, jnp.float32), jax.ShapeDtypeStruct((s[1],), jnp.float32))
         for s in SHAPES]
    o = jax.eval_shape(ADAM.init, p)
    b = {"x": jax.ShapeDtypeStruct((batch, SHAPES[0][0]), jnp.float32),
         "y": jax.ShapeDtypeStruct((batch, SHAPES[-1][1]), jnp.float32)}
    return (p, o), b


def _marker(graph):
    (m,) = [n for n in graph.nodes if n.primitive == GRAD_BOUNDARY]
    return m


@pytest.mark.parametrize("B", [1, 2])
def test_inferred_gradients_are_the_marked_ones(B):
    """Same gradients (in the parameters' shapes), same parameters, same layers."""
    graphs = {}
    for name, grad in (("plain", jax.value_and_grad), ("marked", meshplan.value_and_grad)):
        if B == 1:
            graphs[name] = trace_both(_step(grad), *_args(), batch_argnums=(1,))[0]
        else:
            graphs[name] = trace_micro(_step(grad), _args(), B, (1,))
    params = {}
    for name, g in graphs.items():
        m = _marker(g)
        ps = gradient_parameters(g, m)
        assert None not in ps
        assert [g.tensors[t].shape for t in m.inputs] == [g.tensors[p].shape for p in ps]
        params[name] = {g.input_of_tensor[p].path: g.tensors[t].shape
                        for t, p in zip(m.inputs, ps)}
    assert params["plain"] == params["marked"] and len(params["plain"]) == 2 * len(SHAPES)
    layers = {name: assign_layers(g, None, default_layers=4) for name, g in graphs.items()}
    assert layers["plain"].flops == layers["marked"].flops
    assert sorted(layers["plain"].layer_of_node) == sorted(layers["marked"].layer_of_node)


@pytest.mark.parametrize("method", [
    pytest.param(meshplan.Auto(), marks=pytest.mark.extended),
    meshplan.Manual(dp=2, tp=2, pp=2, num_micro_batches=4),
    meshplan.PipeshardParallel(stages=1, num_micro_batches=2),
], ids=["auto", "manual-pp2-m4", "one-stage-m2"])
def test_plain_and_marked_steps_get_the_same_plan(method):
    cluster = meshplan.load_cluster(CLUSTER)
    plans = [meshplan.plan(_step(g), *_args(), cluster=cluster, method=method)
             for g in (jax.value_and_grad, meshplan.value_and_grad)]
    plain, marked = plans
    assert len(plain.stages) == len(marked.stages)
    assert plain.num_micro_batches == marked.num_micro_batches
    assert plain.predicted.iteration_s == pytest.approx(marked.predicted.iteration_s, rel=1e-9)
    assert plain.predicted.peak_memory_bytes == marked.predicted.peak_memory_bytes
    for a, b in zip(plain.stages, marked.stages):
        assert a.logical_mesh == b.logical_mesh and a.layers == b.layers
        assert a.predicted.compute_s == pytest.approx(b.predicted.compute_s, rel=1e-9)
        assert a.predicted.comm_s == pytest.approx(b.predicted.comm_s, rel=1e-9)


def test_gradient_overlap_is_credited_to_a_plain_step():
    """The whole-batch Graph of a plain step carries the inferred marker, which
    is what the one-stage ILP takes its gradients (overlap) from."""
    graph = trace_both(_step(jax.value_and_grad), *_args(), batch_argnums=(1,))[0]
    m = _marker(graph)
    assert len(m.inputs) == 2 * len(SHAPES)
    assert {graph.tensors[t].shape for t in m.inputs} == (
        {s for s in SHAPES} | {(s[1],) for s in SHAPES})


def test_gradients_clipped_by_their_global_norm_go_to_their_own_parameters():
    # the global norm makes every update read every gradient; equal shapes
    # then matched them by position, and the found marker lists them in the
    # backward's order: layer 0's gradient was layer 3's (its Adam moments
    # were read on the last stage)
    clipped = optax.chain(optax.clip_by_global_norm(0.05), optax.adam(1e-2))

    def step(state, batch):
        p, o = state
        loss, g = jax.value_and_grad(lambda p: _loss(p, batch["x"], batch["y"]))(p)
        u, o = clipped.update(g, o, p)
        return (optax.apply_updates(p, u), o), {"loss": loss}
    p = [(jax.ShapeDtypeStruct((32, 32), jnp.float32), jax.ShapeDtypeStruct((32,), jnp.float32))
         for _ in range(4)]
    b = {"x": jax.ShapeDtypeStruct((16, 32), jnp.float32),
         "y": jax.ShapeDtypeStruct((16, 32), jnp.float32)}
    g = trace_micro(step, ((p, jax.eval_shape(clipped.init, p)), b), 2, (1,))
    m = _marker(g)
    pairs = {}
    for t, q in zip(m.inputs, gradient_parameters(g, m)):
        # each gradient is computed from its own parameter's layer: the
        # gradient of layer k's weight reads the activations of layer k
        pairs[g.input_of_tensor[q].path] = t
    assert len(pairs) == 8
    order = [pairs[f"[0][{k}][0]"] for k in range(4)]
    # (the backward makes layer 3's first: the later the layer, the earlier its gradient)
    assert order == sorted(order, reverse=True)
