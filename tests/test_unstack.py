"""Layers inside a lax.scan over stacked parameters: the rewrite to one input
per layer (meshplan.trace.unstack) changes no number, and pipeline plans cut
between the scanned layers and run."""
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import meshplan
from meshplan.models import build_model
from meshplan.plan import Plan
from meshplan.trace import trace
from meshplan.trace.unstack import unstack_scanned_layers

GPT = {"layers": "4", "hidden": "32", "seq_len": "16", "vocab": "64", "batch": "8",
       "scan_layers": "true"}


def _unstacked(fn, args, batch_argnums=(1,)):
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)),
                            tuple(args))
    g = trace(fn, *abstract, batch_argnums=batch_argnums)
    return g, unstack_scanned_layers(g, fn, abstract)


def _assert_trees_close(a, b, rtol=1e-5, atol=1e-6):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


@pytest.mark.extended      # (about 25 s)
def test_gpt_scan_is_unrolled_per_layer_and_computes_the_same_step():
    m = build_model("gpt", GPT)          # Adam: moments are stacked too
    state, batch = m.init(0)
    g, u = _unstacked(m.train_step, (state, batch))
    assert u is not None and u.num_layers == (4,)
    g2 = trace(u.fn, *u.split(m.abstract_args))
    prims = Counter(n.primitive for n in g2.nodes)
    # no scan left, and no stacked value rebuilt: the optimizer ran per layer
    assert prims["scan"] == 0 and prims["concatenate"] == 0
    paths = [i.path for i in g2.inputs]
    assert "['params']['h']['mlp']['fc']['w'][3]" in paths
    assert "['opt_state'][0].mu['h']['mlp']['fc']['w'][3]" in paths
    stacked = sum(1 for i in g.inputs if g.tensors[i.tensor].shape[:1] == (4,))
    assert len(g2.inputs) == len(g.inputs) + 3 * stacked
    _assert_trees_close(jax.jit(m.train_step)(state, batch),
                        u.restore(jax.jit(u.fn)(*u.split((state, batch)))))


def test_stacked_values_read_whole_are_stacked_again():
    """A reverse scan with an xs computed in the step, a scan carry, and a
    penalty over the whole stacked leaf (not elementwise): same numbers."""
    L, d = 3, 4

    def step(params, x):
        def loss(p):
            scales = jnp.arange(L, dtype=jnp.float32) * 0.1 + 1.0

            def body(h, wsc):
                w, s = wsc
                return jnp.tanh(h @ w) * s, jnp.sum(h)
            h, sums = jax.lax.scan(body, x, (p["w"], scales), reverse=True)
            return jnp.mean(h ** 2) + 0.01 * jnp.sum(p["w"] ** 2) + 0.001 * jnp.sum(sums)
        val, g = jax.value_and_grad(loss)(params)
        return jax.tree.map(lambda w, gw: w - 0.1 * gw, params, g), {"loss": val}

    params = {"w": jax.random.normal(jax.random.PRNGKey(0), (L, d, d)) * 0.5}
    x = jax.random.normal(jax.random.PRNGKey(1), (2, d))
    _, u = _unstacked(step, (params, x))
    assert u is not None and u.shapes == {(L, d, d)}
    _assert_trees_close(step(params, x), u.restore(u.fn(*u.split((params, x)))))


def test_no_rewrite_without_a_scan_over_stacked_inputs():
    m = build_model("gpt", {**GPT, "scan_layers": "false"})
    assert _unstacked(m.train_step, m.abstract_args)[1] is None


@pytest.mark.extended   # (one stage: test_gpt_scan_is_unrolled_per_layer_and_computes_the_same_step)
def test_pipeline_cuts_between_scanned_layers_and_matches_the_step():
    m = build_model("gpt", {**GPT, "optimizer": "sgd"})
    state, batch = jax.device_get(m.init(0))
    cluster = meshplan.ClusterSpec.local()
    method = meshplan.PipeshardParallel(stages=2, num_micro_batches=2)
    plan = meshplan.plan(m.train_step, state, batch, cluster=cluster, method=method)
    assert len(plan.stages) == 2 and any("unrolled" in n for n in plan.notes)
    # the blocks' parameters are split over the two stages
    holders = [{p.split("]")[-2] + "]" for p, _ in s.params if "['h']" in p} for s in plan.stages]
    assert holders[0] and holders[1] and not holders[0] & holders[1]
    # a saved plan is valid for the same step
    step = meshplan.parallelize(m.train_step, plan=Plan.from_json(plan.to_json()))
    ref_state, par_state = state, state
    for _ in range(2):
        ref_state, ref_metrics = jax.jit(m.train_step)(ref_state, batch)
        par_state, metrics = step(par_state, batch)
    np.testing.assert_allclose(float(metrics["loss"]), float(ref_metrics["loss"]), rtol=1e-5)
    _assert_trees_close(par_state, ref_state, rtol=1e-4, atol=1e-5)
    assert step.plan.stages == plan.stages


def test_checkpointed_body_over_cast_parameters():
    """The usual large-model form: parameters cast to bf16 before the scan and
    a jax.checkpoint body; the cast and the recomputation are kept per layer."""
    L, d = 4, 8

    def step(params, x):
        def loss(p):
            w16 = p["w"].astype(jnp.bfloat16)

            @jax.checkpoint
            def body(h, w):
                return jnp.tanh(h @ w), None
            h, _ = jax.lax.scan(body, x.astype(jnp.bfloat16), w16)
            return jnp.mean(h.astype(jnp.float32) ** 2)
        val, g = jax.value_and_grad(loss)(params)
        return jax.tree.map(lambda w, gw: w - 0.5 * gw, params, g), {"loss": val}

    params = {"w": jax.random.normal(jax.random.PRNGKey(0), (L, d, d)) / d ** 0.5}
    x = jax.random.normal(jax.random.PRNGKey(1), (4, d))
    g, u = _unstacked(step, (params, x))
    assert u is not None and u.shapes == {(L, d, d)}
    g2 = trace(u.fn, *u.split((params, x)))
    prims = Counter(n.primitive for n in g2.nodes)
    assert prims["scan"] == 0 and prims["concatenate"] == 0
    assert any(n.remat for n in g2.nodes)          # the checkpointed body, per layer
    _assert_trees_close(jax.jit(step)(params, x), u.restore(jax.jit(u.fn)(*u.split((params, x)))),
                        rtol=1e-2, atol=1e-3)


@pytest.mark.slow   # (22 s; the unrolled scan's numerics stay in the default suite)
def test_state_kept_per_layer_between_calls():
    """split_layers once, run steps on the per-layer form (no split or stack
    per call), stack_layers at the end: the same state as the plain step."""
    m = build_model("gpt", {**GPT, "optimizer": "sgd"})
    state, batch = jax.device_get(m.init(0))
    step = meshplan.parallelize(
        m.train_step, cluster=meshplan.ClusterSpec.local(),
        method=meshplan.PipeshardParallel(stages=2, num_micro_batches=2))
    layered, _ = step.split_layers(state, batch)
    assert len(layered["params"]["h"]["mlp"]["fc"]["w"]) == 4
    # called with the stacked state, the step returns it stacked
    stacked, _ = step(state, batch)
    assert stacked["params"]["h"]["mlp"]["fc"]["w"].shape == (4, 32, 128)
    ref = state
    for _ in range(2):
        ref, ref_metrics = jax.jit(m.train_step)(ref, batch)
        layered, metrics = step(layered, batch)
    # results stay per layer, each layer on its own stage's devices
    pieces = layered["params"]["h"]["mlp"]["fc"]["w"]
    assert isinstance(pieces, tuple) and len(pieces) == 4
    assert pieces[0].sharding.device_set != pieces[3].sharding.device_set
    np.testing.assert_allclose(float(metrics["loss"]), float(ref_metrics["loss"]), rtol=1e-5)
    _assert_trees_close(step.stack_layers(layered), ref, rtol=1e-4, atol=1e-5)


def _scanned_step():
    """A step over 4 layers stacked in a lax.scan, gradients unmarked, its
    parameters and a batch of 16 rows."""
    k1, k2 = jax.random.split(jax.random.key(0))
    params = {"emb": jax.random.normal(k1, (16, 16)) * 0.3,
              "w": jax.random.normal(k2, (4, 16, 16)) * 0.3}

    def step_fn(p, batch):
        def loss(p):
            h, _ = jax.lax.scan(lambda h, w: (h + jnp.tanh(h @ w), None), p["emb"][batch["x"]],
                                p["w"])
            logits = h @ p["emb"].T
            return jnp.mean(jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(
                logits, batch["y"][..., None], -1)[..., 0])
        loss, g = jax.value_and_grad(loss)(p)
        return jax.tree.map(lambda a, c: a - 0.1 * c, p, g), {"loss": loss}
    tok = jax.random.randint(jax.random.key(1), (16, 9), 0, 16)
    return step_fn, params, {"x": tok[:, :-1], "y": tok[:, 1:]}


def test_micro_batches_as_many_rows_as_there_are_layers_pipeline():
    # a micro-batch of 4 rows and 4 stacked layers: a broadcast to the
    # micro-batch's rows is no stacked value (it was made lazily, where
    # first read, at this batch size only, and the step "traced to other
    # operations" at the micro-batch)
    step_fn, params, batch = _scanned_step()
    step = meshplan.parallelize(step_fn, method=meshplan.Manual(dp=2, tp=2, pp=2,
                                                                 num_micro_batches=4))
    par, metrics = step(params, batch)
    ref, ref_metrics = jax.jit(step_fn)(params, batch)
    assert step.plan.num_micro_batches == 4 and len(step.plan.stages) == 2
    np.testing.assert_allclose(float(metrics["loss"]), float(ref_metrics["loss"]), rtol=1e-5)
    _assert_trees_close(par, ref, rtol=1e-4, atol=1e-5)


def test_a_constant_shaped_like_the_micro_batch_is_made_per_layer_at_every_size():
    """Sweep A (stop 93): a zeros_like of the activation made outside the
    scan (flax's Dropout leaves one) has a stacked bias's shape when a
    micro-batch has as many rows as there are layers; it was then stacked
    lazily, read whole by every layer, where at full batch each layer makes
    its own: the step "traced to other operations" and 4 micro-batches were
    refused (2 and 8 ran)."""
    L, D = 4, 32
    w = jax.random.normal(jax.random.key(0), (L, D, D)) / np.sqrt(D)
    params = {"w": w, "b": jnp.zeros((L, D)), "head": jnp.ones((D, 8)) / D}

    def step_fn(p, batch):
        def loss(p):
            x = batch["x"]
            zeros = jnp.zeros(x.shape)

            def body(h, wb):
                a = h @ wb[0] + wb[1]
                return h + jnp.where(a > 0, a, zeros), None
            h, _ = jax.lax.scan(body, x, (p["w"], p["b"]))
            return jnp.mean((h @ p["head"]) ** 2)
        l, g = jax.value_and_grad(loss)(p)
        return jax.tree.map(lambda a, c: a - 0.1 * c, p, g), {"loss": l}
    batch = {"x": jax.random.normal(jax.random.key(1), (16, D))}
    step = meshplan.parallelize(step_fn, method=meshplan.PipeshardParallel(
        stages=2, num_micro_batches=4))
    par, metrics = step(params, batch)
    ref, ref_metrics = jax.jit(step_fn)(params, batch)
    assert step.plan.num_micro_batches == 4 and len(step.plan.stages) == 2
    np.testing.assert_allclose(float(metrics["loss"]), float(ref_metrics["loss"]), rtol=1e-5)
    _assert_trees_close(par, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("method", [meshplan.ShardParallel(),
                                    meshplan.Manual(dp=2, tp=2, pp=2, num_micro_batches=2)])
def test_donated_stacked_arrays_are_deleted_as_jit_deletes_them(method):
    # the step runs on per-layer pieces; the stacked arrays it was given
    # stayed alive beside the new ones (twice the parameters' memory)
    step_fn, params, batch = _scanned_step()
    params = jax.device_put(params)
    step = meshplan.parallelize(step_fn, method=method, donate_argnums=(0,))
    new, _ = step(params, batch)
    assert all(x.is_deleted() for x in jax.tree.leaves(params))
    again, _ = step(new, batch)      # (what it returned runs again, and goes too)
    assert all(x.is_deleted() for x in jax.tree.leaves(new))
    with pytest.raises(meshplan.MeshplanError, match="donated"):
        step(params, batch)


def test_layers_in_a_scan_plan_as_the_same_layers_in_a_loop():
    # the scan's transpose also makes the gradient of its carry's first
    # value (the batch input), which nothing reads: unrolled, it must not be
    # priced, or the scanned step plans otherwise than the loop
    def block(p, x):
        return x + jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"]

    def step_of(loss):
        def step(p, b):
            value, g = jax.value_and_grad(loss)(p, b)
            return jax.tree.map(lambda a, c: a - 0.1 * c, p, g), value
        return step

    def loop(p, b):
        x = b["x"]
        for i in range(4):
            x = block(p[f"l{i}"], x)
        return jnp.mean((x - b["y"]) ** 2)

    def scanned(p, b):
        return jnp.mean((jax.lax.scan(lambda x, lp: (block(lp, x), None), b["x"], p)[0]
                         - b["y"]) ** 2)
    ks = jax.random.split(jax.random.key(0), 8)
    layers = [{"w1": jax.random.normal(ks[2 * i], (64, 256)) / 8, "b1": jnp.zeros(256),
               "w2": jax.random.normal(ks[2 * i + 1], (256, 64)) / 16} for i in range(4)]
    b = {"x": jnp.ones((64, 64)), "y": jnp.zeros((64, 64))}
    plans = [meshplan.plan(step_of(loop), {f"l{i}": p for i, p in enumerate(layers)}, b),
             meshplan.plan(step_of(scanned), jax.tree.map(lambda *xs: jnp.stack(xs), *layers), b)]
    assert plans[0].predicted.iteration_s == pytest.approx(plans[1].predicted.iteration_s,
                                                           rel=1e-9)
    assert plans[0].stages[0].logical_mesh == plans[1].stages[0].logical_mesh
    specs = [sorted(str(s) for _, s in p.stages[0].params) for p in plans]
    assert specs[0] == specs[1]


def test_shardings_of_an_unrolled_scan_say_why_not_stale():
    # (sweep A of stop 94: Plan.shardings called the plan stale for the very
    # arguments it was made for; step.shardings said why)
    def step(params, batch):
        def loss(p):
            h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), batch["x"], p["stack"])
            return jnp.mean(h ** 2)
        value, g = jax.value_and_grad(loss)(params)
        return jax.tree.map(lambda a, b: a - 0.1 * b, params, g), {"loss": value}
    params = {"stack": jax.ShapeDtypeStruct((4, 16, 16), jnp.float32)}
    batch = {"x": jax.ShapeDtypeStruct((8, 16), jnp.float32)}
    method = meshplan.ShardParallel()
    plan = meshplan.plan(step, params, batch, method=method)
    for why in (lambda: plan.shardings(params, batch, step=step),
                lambda: meshplan.parallelize(step, method=method).shardings(params, batch)):
        with pytest.raises(meshplan.MeshplanError, match="unrolled for planning") as e:
            why()
        assert not isinstance(e.value, meshplan.StalePlanError)
