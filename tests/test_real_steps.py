"""Real train steps: random numbers (dropout), jax's own grad, per-example outputs.

Random draws are planned replicated: every device draws the same bits, so the
numbers equal the plain step's.  Pipelines with several micro-batches (draws
over the batch, steps without meshplan's markers) are in
test_micro_batch_steps.py.
"""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import meshplan
from meshplan.dp_search import Session
from _steps import assert_states_close, losses_match, tanh_mlp_loss

OPT = optax.sgd(0.1)


def _loss(p, x, y, key):
    h = jnp.tanh(x @ p["w1"])
    keep = jax.random.bernoulli(key, 0.9, h.shape)           # dropout over the batch
    h = jnp.where(keep, h / 0.9, 0.0)
    return jnp.mean((h @ p["w2"] - y) ** 2)


def _step(grad):
    def step(state, batch):
        p, o, key = state
        key, sub = jax.random.split(key)
        loss, g = grad(_loss)(p, batch["x"], batch["y"], sub)
        u, o = OPT.update(g, o, p)
        return (optax.apply_updates(p, u), o, key), {"loss": loss}
    return step


def _state(key):
    k1, k2 = jax.random.split(jax.random.key(0))
    p = {"w1": jax.random.normal(k1, (16, 32)) * 0.3, "w2": jax.random.normal(k2, (32, 4)) * 0.3}
    return (p, OPT.init(p), key)


BATCH = {"x": jnp.linspace(-1, 1, 16 * 16).reshape(16, 16), "y": jnp.ones((16, 4))}


def _check(step_fn, state, method, steps=2):
    ref, par = state, state
    step = meshplan.parallelize(step_fn, method=method)
    jitted = jax.jit(step_fn)
    for _ in range(steps):
        ref, rm = jitted(ref, BATCH)
        par, pm = step(par, BATCH)
        assert float(pm["loss"]) == pytest.approx(float(rm["loss"]), rel=1e-5)
    for a, b in zip(jax.tree.leaves(par[:2]), jax.tree.leaves(ref[:2])):
        a, b = np.asarray(a), np.asarray(b)
        assert np.linalg.norm(a - b) <= 1e-4 * max(np.linalg.norm(b), 1e-6)
    # the carried key advanced as the plain step's did
    assert (jax.random.key_data(par[2]) == jax.random.key_data(ref[2])).all()
    return step


@pytest.mark.parametrize("method", [meshplan.ShardParallel(), meshplan.DataParallel(),
                                    meshplan.Auto()], ids=["shard", "data", "auto"])
def test_dropout_with_a_typed_key_plans_and_matches_jit(method):
    _check(_step(jax.value_and_grad), _state(jax.random.key(7)), method)


def test_dropout_with_a_raw_uint32_key():
    def step(state, batch):
        p, o, raw = state
        (p, o, key), m = _step(jax.value_and_grad)((p, o, jax.random.wrap_key_data(raw)), batch)
        return (p, o, jax.random.key_data(key)), m
    s = _state(jax.random.key(3))
    state = (s[0], s[1], jax.random.key_data(s[2]))
    ref, par = state, state
    par_step = meshplan.parallelize(step, method=meshplan.ShardParallel())
    for _ in range(2):
        ref, rm = jax.jit(step)(ref, BATCH)
        par, pm = par_step(par, BATCH)
        assert float(pm["loss"]) == pytest.approx(float(rm["loss"]), rel=1e-5)


def test_dropout_pipelines_with_one_micro_batch():
    step = _check(_step(meshplan.value_and_grad), _state(jax.random.key(5)),
                  meshplan.Manual(dp=2, tp=2, pp=2, num_micro_batches=1))
    assert len(step.plan.stages) == 2


def test_a_batch_shaped_output_that_ignores_the_batch_is_not_shrunk():
    # its micro-batch pieces would not make it up (it used to come back at
    # micro-batch size): refused with the output's name
    def step_fn(state, batch):
        p, o = state
        loss, g = meshplan.value_and_grad(
            lambda p: jnp.mean((jnp.tanh(batch["x"] @ p["w1"]) @ p["w2"] - batch["y"]) ** 2))(p)
        u, o = OPT.update(g, o, p)
        rows = jnp.arange(batch["x"].shape[0])          # batch-shaped, batch-independent
        return (optax.apply_updates(p, u), o), {"loss": loss, "rows": rows,
                                                "pred": batch["x"][:, 0] * 2}
    state = _state(jax.random.key(1))[:2]
    method = meshplan.Manual(dp=2, tp=2, pp=2, num_micro_batches=2)
    with pytest.raises(meshplan.MeshplanError, match=r"\['rows'\] has the batch's shape"):
        meshplan.parallelize(step_fn, method=method)(state, BATCH)

    def step_ok(state, batch):                              # per-example values concatenate
        new, m = step_fn(state, batch)
        return new, {"loss": m["loss"], "pred": m["pred"]}
    ref = jax.jit(step_ok)(state, BATCH)
    out = meshplan.parallelize(step_ok, method=method)(state, BATCH)
    assert out[1]["pred"].shape == (16,)
    assert np.allclose(np.asarray(out[1]["pred"]), np.asarray(ref[1]["pred"]))


def test_rotary_split_and_checkpoint_name_stay_sharded():
    # jnp.split (rotary embeddings) and checkpoint_name used to be planned
    # replicated: every layer all-gathered its activations around them
    import warnings
    from jax.ad_checkpoint import checkpoint_name

    def make(use_split):
        def step(w, x):
            def loss(w):
                h = x @ w
                a, b = jnp.split(h, 2, axis=-1) if use_split else (h[:, :512], h[:, 512:])
                return jnp.mean(checkpoint_name(jnp.concatenate([-b, a], axis=-1), "rope") ** 2)
            l, g = jax.value_and_grad(loss)(w)
            return w - 0.1 * g, l
        return step
    w = jax.ShapeDtypeStruct((1024, 1024), jnp.float32)
    x = jax.ShapeDtypeStruct((16384, 1024), jnp.float32)
    cluster = meshplan.load_cluster("examples/clusters/dgx-a100-x1.json")
    comm = {}
    for use_split in (True, False):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            p = meshplan.plan(make(use_split), w, x, cluster=cluster,
                              method=meshplan.ShardParallel(mesh_shape=(8,)))
        assert not [c for c in caught if "unknown primitive" in str(c.message)]
        comm[use_split] = p.predicted.comm_bytes_per_device
    # data parallel: only the weight gradient is reduced (not the activations)
    assert comm[True] == comm[False] <= 2 * 1024 * 1024 * 4


def test_a_split_step_runs_sharded_like_jit():
    def step(w, x):
        def loss(w):
            a, b = jnp.split(jnp.tanh(x @ w), 2, axis=-1)
            return jnp.mean(jnp.concatenate([-b * a, a], axis=-1) ** 2)
        l, g = jax.value_and_grad(loss)(w)
        return w - 0.1 * g, l
    w = jnp.linspace(-1, 1, 32 * 64).reshape(32, 64)
    x = jnp.linspace(-1, 1, 64 * 32).reshape(64, 32)
    ref = jax.jit(step)(w, x)
    out = meshplan.parallelize(step, method=meshplan.ShardParallel(mesh_shape=(2, 4)))(w, x)
    assert float(out[1]) == pytest.approx(float(ref[1]), rel=1e-5)
    assert np.allclose(np.asarray(out[0]), np.asarray(ref[0]), rtol=1e-5, atol=1e-6)


def test_replicated_control_flow_is_named_once_per_plan():
    # a lax.cond that orthogonalises the gradients in a branch (a QR, which
    # has no sharding rule) runs replicated: the plan says what, and how
    # much, once
    import warnings
    multi = optax.adam(1e-3)

    def step(state, batch):
        p, o = state
        loss, g = jax.value_and_grad(
            lambda p: jnp.mean((jnp.tanh(batch["x"] @ p["w1"]) @ p["w2"]) ** 2))(p)
        g = jax.lax.cond(loss > 1.0, lambda g: jax.tree.map(lambda x: jnp.linalg.qr(x)[0], g),
                         lambda g: g, g)
        u, o = multi.update(g, o, p)
        return (optax.apply_updates(p, u), o), loss
    p = {"w1": jax.ShapeDtypeStruct((512, 512), jnp.float32),
         "w2": jax.ShapeDtypeStruct((512, 512), jnp.float32)}
    state = (p, jax.eval_shape(multi.init, p))
    batch = {"x": jax.ShapeDtypeStruct((64, 512), jnp.float32)}
    cluster = meshplan.load_cluster("examples/clusters/dgx-a100-x1.json")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = meshplan.plan(step, state, batch, cluster=cluster)
    said = [str(c.message) for c in caught if "run replicated" in str(c.message)]
    assert len(said) == 1 and "cond (" in said[0], said
    assert any("cond (" in n for n in plan.notes)
    # each plan says it, also a second of one step in one session
    session = Session.from_env()
    for _ in range(2):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            again = meshplan.plan(step, state, batch, cluster=cluster, session=session)
        assert [str(c.message) for c in caught if "run replicated" in str(c.message)] == said
        assert again.notes == plan.notes
    # a step with nothing replicated says nothing
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        meshplan.plan(_step(jax.value_and_grad), _state(jax.random.key(0)), BATCH, cluster=cluster)
    assert not [c for c in caught if "run replicated" in str(c.message)]


def test_random_bits_are_split_only_when_a_split_draw_equals_the_whole():
    from meshplan.trace import trace
    g_on = trace(_step(jax.value_and_grad), _state(jax.random.key(0)), BATCH)
    jax.config.update("jax_threefry_partitionable", False)
    try:
        g_off = trace(_step(jax.value_and_grad), _state(jax.random.key(0)), BATCH)
    finally:
        jax.config.update("jax_threefry_partitionable", True)
    from meshplan.ilp.strategies import node_space
    bits = lambda g: [n for n in g.nodes if n.primitive == "random_bits"]   # noqa: E731
    assert bits(g_on) and all(node_space(g_on, n) is not None for n in bits(g_on))
    assert bits(g_off) and all(node_space(g_off, n) is None for n in bits(g_off))


def _scaled_step(p, batch, scale, n, train=True):
    # a learning-rate scale, a step number and a flag passed as Python scalars
    def loss(p):
        x = batch
        for w in p:
            x = jnp.tanh(x @ w)
        return jnp.mean(x.astype(jnp.float32) ** 2)
    l, g = jax.value_and_grad(loss)(p)
    scale = scale * train       # (weak: the update stays bfloat16)
    return [w - scale * gw for w, gw in zip(p, g)], {"loss": l, "n": n + 1}


@pytest.mark.parametrize("method", [meshplan.ShardParallel(),
                                    meshplan.Manual(dp=2, tp=2, pp=2, num_micro_batches=2)],
                         ids=["one-stage", "pipeline"])
def test_python_scalar_arguments_stay_weakly_typed_as_under_jit(method):
    # jax.jit traces a Python scalar weakly typed: 0.5 * a bfloat16 gradient
    # stays bfloat16.  Planned as a float32 array, the plan's trace differed
    # from the one the runtime ran (a stale-plan error at the first call) and
    # the pipeline found no gradients in its micro-batch trace.  A Python
    # bool is no weak type to jit: the pipeline took it for one and refused
    # its first call as stale
    ks = jax.random.split(jax.random.key(0), 4)
    p = [jax.random.normal(k, (32, 32), jnp.bfloat16) * 0.3 for k in ks]
    x = jnp.ones((16, 32), jnp.bfloat16)
    step = meshplan.parallelize(_scaled_step, method=method)
    out, ref = step(p, x, 0.5, 3, True), jax.jit(_scaled_step)(p, x, 0.5, 3, True)
    out, ref = step(out[0], x, 0.25, 4, True), jax.jit(_scaled_step)(ref[0], x, 0.25, 4, True)
    assert [w.dtype for w in out[0]] == [jnp.bfloat16] * 4
    for a, b in zip(out[0], ref[0]):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                   rtol=2e-2, atol=2e-2)
    assert int(out[1]["n"]) == 5 and out[1]["n"].dtype == ref[1]["n"].dtype


def _named_axis_step(state, batch):
    # per-example code under vmap with an axis name, as equinox's BatchNorm
    # writes it: the collectives over the named axis are reductions over
    # the batch
    def loss(w):
        def one(x):
            h = x @ w["a"]
            h = jnp.tanh(h - jax.lax.pmean(h, "b"))
            return jnp.sum((h @ w["b"]) ** 2)
        return jax.vmap(one, axis_name="b")(batch).mean()
    loss_value, g = jax.value_and_grad(loss)(state)
    peak = jax.vmap(lambda x: jax.lax.pmax(jnp.abs(x).max(), "b"), axis_name="b")(batch)
    return jax.tree.map(lambda p, d: p - 0.1 * d, state, g), {"loss": loss_value, "peak": peak}


def test_collectives_over_a_vmapped_axis_are_planned_as_reductions():
    # they reach the jaxpr as psum/pmax over positional axes: planned as
    # unknown primitives (replicated, warned) until the trace took them for
    # the reductions they are
    ks = jax.random.split(jax.random.key(0), 3)
    state = {"a": jax.random.normal(ks[0], (8, 16)), "b": jax.random.normal(ks[1], (16, 4))}
    batch = jax.random.normal(ks[2], (16, 8))
    from meshplan.trace import trace
    graph = trace(_named_axis_step, state, batch)
    prims = {n.primitive for n in graph.nodes}
    assert {"reduce_sum", "reduce_max"} <= prims and not prims & {"psum", "pmax"}
    assert not [w for w in graph.warnings if "unknown primitive" in w]
    step = meshplan.parallelize(_named_axis_step, method=meshplan.ShardParallel())
    got, want = losses_match(step, state, batch, _named_axis_step, steps=2)
    assert_states_close(want, got)


def _constant_state_step(state, batch):
    # a flag cleared after the first step and a buffer reset to zeros: outputs
    # made from literals and constants alone
    def loss(w):
        return jnp.mean((jnp.tanh(batch @ w["a"]) @ w["b"]) ** 2)
    loss_value, g = jax.value_and_grad(loss)(state["w"])
    w = jax.tree.map(lambda p, d: p - 0.1 * d, state["w"], g)
    return {"w": w, "first": False, "zero": jnp.zeros(3), "n": state["n"] + 1}, \
        {"loss": loss_value, "one": 1.0}


def test_a_pipeline_returns_constant_outputs_as_jit_does_and_anew_each_call():
    # a literal output came back as a Python bool (so the next call, given
    # it, was refused as stale), and a constant one as one array shared by
    # every call (donated back, the next call would return a deleted array)
    ks = jax.random.split(jax.random.key(0), 3)
    state = {"w": {"a": jax.random.normal(ks[0], (8, 16)), "b": jax.random.normal(ks[1], (16, 4))},
             "first": jnp.asarray(True), "zero": jnp.ones(3), "n": jnp.asarray(0)}
    batch = jax.random.normal(ks[2], (16, 8))
    step = meshplan.parallelize(_constant_state_step, batch_argnums=(1,), donate_argnums=(0,),
                                method=meshplan.Manual(dp=2, tp=2, pp=2, num_micro_batches=2))
    want, got = state, jax.tree.map(jnp.copy, state)
    for _ in range(3):
        got, metrics = step(got, batch)
        want, ref_metrics = jax.jit(_constant_state_step)(want, batch)
    for a, b in zip(jax.tree.leaves((want, ref_metrics)), jax.tree.leaves((got, metrics))):
        assert isinstance(b, jax.Array) and (b.dtype, b.weak_type) == (a.dtype, a.weak_type)
    assert_states_close(want, got)
    assert int(got["n"]) == 3 and not bool(got["first"])


def _masked_by_position(x, w, pos):
    # a KV cache's "positions up to pos are valid" mask, made from an argument
    # that is no batch and broadcast over the batch's rows by jnp.where
    valid = jnp.arange(16) <= pos
    return jnp.where(valid[None, :], x @ w, -1e9) @ w.T


@pytest.mark.parametrize("method", [meshplan.ShardParallel(), meshplan.DataParallel()],
                         ids=["shard", "data"])
def test_a_mask_made_without_the_batch_does_not_hold_the_batch_whole(method):
    # the select followed its broadcast mask, which can split no rows: the
    # work ran replicated on every device (noted as 'no layout that splits
    # them was predicted faster') or the rows were all-gathered
    x = jax.random.normal(jax.random.key(0), (64, 16))
    w = jax.random.normal(jax.random.key(1), (16, 16))
    step = meshplan.parallelize(_masked_by_position, method=method, batch_argnums=(0,))
    np.testing.assert_allclose(step(x, w, jnp.int32(5)),
                               jax.jit(_masked_by_position)(x, w, jnp.int32(5)), rtol=1e-5)
    assert not any("replicated" in n for n in step.plan.notes), step.plan.notes
    hlo = step.lower(x, w, jnp.int32(5)).compile().as_text()
    assert "all-gather" not in hlo


def _adam_with_norm_metric(state, batch):
    p, o = state
    loss, g = jax.value_and_grad(tanh_mlp_loss)(p, batch)
    u, o = ADAM.update(g, o, p)
    p = optax.apply_updates(p, u)
    # metrics read after the update: the new weights' norm, the gradients'
    return (p, o), {"loss": loss, "wnorm": sum(jnp.sum(w * w) for w in p),
                    "gnorm": optax.tree.norm(g)}


ADAM = optax.adam(1e-2)


def test_a_metric_of_the_new_weights_leaves_each_stage_its_own_update():
    # the metric's ancestors (every layer's Adam arithmetic) were taken as
    # forward work: stage 0's update ran on the last stage, which held all
    # of the optimizer state (640 B on stage 0 against 16 KiB)
    ws = [jax.random.normal(jax.random.key(i), (32, 32)) * 0.2 for i in range(4)]
    state = (ws, ADAM.init(ws))
    batch = {"x": jax.random.normal(jax.random.key(7), (16, 32)),
             "y": jax.random.normal(jax.random.key(8), (16, 32))}
    step = meshplan.parallelize(_adam_with_norm_metric,
                                method=meshplan.Manual(dp=2, tp=2, pp=2, num_micro_batches=2))
    got, want = losses_match(step, state, batch, _adam_with_norm_metric, steps=3)
    assert_states_close(want, got)
    _, m = step(got, batch)
    _, ref = jax.jit(_adam_with_norm_metric)(want, batch)
    np.testing.assert_allclose(float(m["wnorm"]), float(ref["wnorm"]), rtol=1e-5)
    np.testing.assert_allclose(float(m["gnorm"]), float(ref["gnorm"]), rtol=1e-5)
    for s in step.plan.stages:
        mem = s.predicted.memory
        # Adam's two moments of the stage's own weights, as their sharding holds them
        assert mem.params > 0 and 1.5 * mem.params <= mem.optimizer <= 2.5 * mem.params, str(mem)
        # (a layer whose only step output is such a metric was taken for an
        # evaluation step's and charged no gradients)
        assert mem.grads == pytest.approx(mem.params, rel=0.01), str(mem)


def _sgd_with_late_metrics(state, batch):
    value, g = jax.value_and_grad(tanh_mlp_loss)(state["ws"], batch)
    ws = [w - 0.1 * d for w, d in zip(state["ws"], g)]
    return ({"ws": ws, "loss_ema": 0.9 * state["loss_ema"] + 0.1 * value},
            {"combo": value * optax.tree.norm(ws), "gnorm": optax.tree.norm(g)})


def test_a_step_whose_every_metric_comes_after_the_gradients_pipelines():
    # (refused: 'every output of this step updates an argument, so nothing
    # marks where its forward ends', once such metrics stopped being forward)
    state = {"ws": [jax.random.normal(jax.random.key(i), (32, 32)) * 0.2 for i in range(4)],
             "loss_ema": jnp.float32(1.0)}
    batch = {"x": jax.random.normal(jax.random.key(7), (16, 32)),
             "y": jax.random.normal(jax.random.key(8), (16, 32))}
    step = meshplan.parallelize(_sgd_with_late_metrics,
                                method=meshplan.Manual(dp=2, tp=2, pp=2, num_micro_batches=2))
    got, want = step(state, batch), jax.jit(_sgd_with_late_metrics)(state, batch)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    # the loss is the forward's end: both stages hold forward work
    assert all(s.predicted.memory.activations > 0 for s in step.plan.stages[:-1])
