"""Pipelines with several micro-batches of real train steps (issue 17, items 1
and 2): dropout drawn over the batch, and steps written with jax's own
value_and_grad (no meshplan marker).  Each is compared with jax.jit of the
same step.

- A random draw whose shape carries the batch is drawn once per step at the
  full batch's shape; every micro-batch reads its rows, so the masks are the
  plain step's (drawing per micro-batch would give other masks and other
  numbers).
- Without meshplan.value_and_grad the gradients are found in the jaxpr (the
  backward's reductions over the batch, meshplan.trace.micro); the planner's
  retrace and the runtime's trace are the same function.
"""
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import meshplan
from _steps import tanh_mlp_loss
from meshplan.graph import GRAD_BOUNDARY, INFERRED_GRADIENTS
from meshplan.models import build_model

SGD = optax.sgd(0.1)
BATCH = {"x": jnp.linspace(-1, 1, 16 * 16).reshape(16, 16),
         "y": jnp.cos(jnp.linspace(0, 3, 16 * 4)).reshape(16, 4)}


def _loss(p, x, y, key):
    h = jnp.tanh(x @ p["w1"])
    keep = jax.random.bernoulli(key, 0.8, h.shape)          # dropout over the batch
    h = jnp.where(keep, h / 0.8, 0.0)
    h = jnp.tanh(h @ p["w2"])
    return jnp.mean((h @ p["w3"] - y) ** 2)


def _step(grad, opt=SGD, raw_key=False):
    def step(state, batch):
        p, o, key = state
        key = jax.random.wrap_key_data(key) if raw_key else key
        key, sub = jax.random.split(key)
        loss, g = grad(_loss)(p, batch["x"], batch["y"], sub)
        u, o = opt.update(g, o, p)
        key = jax.random.key_data(key) if raw_key else key
        return (optax.apply_updates(p, u), o, key), {"loss": loss}
    return step


def _state(opt=SGD, raw_key=False):
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    p = {"w1": jax.random.normal(k1, (16, 32)) * 0.3, "w2": jax.random.normal(k2, (32, 32)) * 0.2,
         "w3": jax.random.normal(k3, (32, 4)) * 0.3}
    key = jax.random.key(7)
    return (p, opt.init(p), jax.random.key_data(key) if raw_key else key)


def _compare(step_fn, state, method, *, tol=1e-5, steps=2):
    """``steps`` calls of the parallel step against jax.jit: the loss and every
    float leaf within ``tol`` (of the leaf's norm); keys exactly."""
    step = meshplan.parallelize(step_fn, method=method)
    ref = par = state
    for _ in range(steps):
        ref, rm = jax.jit(step_fn)(ref, BATCH)
        par, pm = step(par, BATCH)
        assert abs(float(pm["loss"]) - float(rm["loss"])) <= tol * abs(float(rm["loss"]))
    for a, b in zip(jax.tree.leaves(par), jax.tree.leaves(ref)):
        if jnp.issubdtype(b.dtype, jax.dtypes.prng_key):
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.linalg.norm(a - b) <= tol * max(np.linalg.norm(b), 1e-6)
    return step


@pytest.mark.parametrize("m", [2, 4])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_dropout_over_the_batch_pipelines_with_micro_batches(m, schedule):
    step = _compare(_step(meshplan.value_and_grad), _state(),
                    meshplan.PipeshardParallel(stages=2, num_micro_batches=m, schedule=schedule))
    assert len(step.plan.stages) == 2 and step.plan.num_micro_batches == m


def test_dropout_with_a_raw_key_pipelines_with_micro_batches():
    step = _compare(_step(meshplan.value_and_grad, raw_key=True), _state(raw_key=True),
                    meshplan.Manual(dp=2, tp=2, pp=2, num_micro_batches=4))
    assert step.plan.num_micro_batches == 4


def test_each_micro_batch_reads_its_rows_of_one_draw_per_step():
    step = meshplan.parallelize(_step(meshplan.value_and_grad),
                                method=meshplan.Manual(dp=2, tp=2, pp=2, num_micro_batches=4))
    step(_state(), BATCH)
    ex = step._cache[next(iter(step._cache))][1]
    draws = [t for k, t in ex.split.tasks.items() if k[0] == "R"]
    # one program draws the (16, 32) mask; no per-micro-batch program draws
    assert len(draws) == 1 and list(ex.split.draws.values()) == [(0, (16, 32))]
    per_mb = [k for k, t in ex.split.tasks.items() if k[0] in "FB"
              for e in t.eqns if ex.flat.eqns[e].eqn.primitive.name == "random_bits"]
    assert per_mb == []
    # the draw's program lowers with the others (it runs once a call)
    compiled = step.lower(_state(), BATCH).compile()
    r = [k for k in compiled.compiled if k[0] == "R"]
    assert len(r) == 1 and compiled.runs(r[0]) == 1


@pytest.mark.parametrize("method", [
    pytest.param(lambda m: meshplan.PipeshardParallel(stages=2, num_micro_batches=m), id="pipeshard"),
    pytest.param(lambda m: meshplan.Manual(dp=2, tp=2, pp=2, num_micro_batches=m), id="manual")])
@pytest.mark.parametrize("m", [2, 4])
def test_plain_jax_value_and_grad_with_adam_pipelines(method, m):
    # Adam divides by sqrt(v): a rounding difference in a gradient near zero
    # becomes a visible update (DESIGN.md).  No gradient of this model is
    # near zero, so the plain step is matched to 1e-5 all the same.
    adam = optax.adam(1e-2)
    step = _compare(_step(jax.value_and_grad, adam), _state(adam), method(m))
    assert len(step.plan.stages) == 2 and step.plan.num_micro_batches == m


def test_plain_jax_grad_with_sgd_and_dropout_pipelines():
    def grad_only(f):                      # jax.grad, the loss computed again as a metric
        def vg(*args):
            return f(*args), jax.grad(f)(*args)
        return vg
    step = _compare(_step(grad_only), _state(),
                    meshplan.PipeshardParallel(stages=2, num_micro_batches=2, schedule="1f1b"))
    assert step.plan.num_micro_batches == 2


def test_the_gradients_are_found_where_the_backward_reduces_over_the_batch():
    from meshplan.trace.tracer import trace_micro
    g = trace_micro(_step(jax.value_and_grad), (_state(), BATCH), 4, (1,))
    marks = [n for n in g.nodes if n.primitive == GRAD_BOUNDARY]
    assert len(marks) == 1
    # the three weight gradients, reduced over the batch, nothing else: past
    # the backward's transposes, in the parameters' shapes, as
    # meshplan.value_and_grad marks them (test_inferred_gradients_cost.py)
    shapes = sorted(g.tensors[t].shape for t in marks[0].inputs)
    assert shapes == sorted([(16, 32), (32, 32), (32, 4)])
    # the loss and the draw stay before it, the update after it
    pos = marks[0].id
    assert all(n.id < pos for n in g.nodes if n.primitive == "random_bits")
    grads = set(marks[0].outputs)
    readers = [n.id for n in g.nodes if set(n.inputs) & grads]
    assert readers and min(readers) > pos


def test_meshplan_markers_take_precedence():
    from meshplan.trace.tracer import trace_micro
    g = trace_micro(_step(meshplan.value_and_grad), (_state(), BATCH), 2, (1,))
    marks = [n for n in g.nodes if n.primitive == GRAD_BOUNDARY]
    assert len(marks) == 1 and marks[0].scope != INFERRED_GRADIENTS
    # the user's marker: on the gradient pytree, the parameters' shapes
    assert sorted(g.tensors[t].shape for t in marks[0].inputs) == [(16, 32), (32, 4), (32, 32)]


def test_auto_may_pipeline_a_plain_jax_step_with_micro_batches():
    # the search no longer keeps a step without markers to one micro-batch
    p = meshplan.plan(_step(jax.value_and_grad), _state(), BATCH,
                      cluster=meshplan.Cluster.local(),
                      method=meshplan.PipeshardParallel(stages=2, num_micro_batches=4))
    assert p.num_micro_batches == 4 and len(p.stages) == 2


def test_a_draw_keyed_by_the_batch_is_refused_with_the_reason():
    def step_fn(state, batch):
        p, o, _ = state

        def loss(p):
            h = jnp.tanh(batch["x"] @ p["w1"])
            key = jax.random.wrap_key_data(batch["seed"][0])
            h = jnp.where(jax.random.bernoulli(key, 0.8, h.shape), h, 0.0)
            return jnp.mean((jnp.tanh(h @ p["w2"]) @ p["w3"] - batch["y"]) ** 2)
        l, g = meshplan.value_and_grad(loss)(p)
        u, o = SGD.update(g, o, p)
        return (optax.apply_updates(p, u), o, state[2]), {"loss": l}
    batch = dict(BATCH, seed=jnp.zeros((16, 2), jnp.uint32))
    with pytest.raises(meshplan.MeshplanError, match="takes its key from the batch"):
        meshplan.plan(step_fn, _state(), batch, cluster=meshplan.Cluster.local(),
                      method=meshplan.Manual(dp=2, tp=2, pp=2, num_micro_batches=2))


@pytest.mark.slow   # (30 s; the plain-jax dropout pipelines stay in the default suite)
def test_nnx_dropout_model_pipelines_with_micro_batches():
    # flax nnx: nnx.Dropout draws over the batch, nnx.value_and_grad marks nothing
    from test_libraries import STEPS, _tokens, flax_nnx
    step_fn, state = flax_nnx()
    step = meshplan.parallelize(step_fn, method=meshplan.Manual(dp=2, tp=2, pp=2,
                                                                num_micro_batches=2))
    ref = state
    for _ in range(STEPS):
        ref, rm = jax.jit(step_fn)(ref, _tokens())
        state, pm = step(state, _tokens())
        assert abs(float(pm["loss"]) - float(rm["loss"])) <= 1e-5 * abs(float(rm["loss"]))
    assert step.plan.num_micro_batches == 2 and len(step.plan.stages) == 2
    for a, b in zip(jax.tree.leaves(state["params"]), jax.tree.leaves(ref["params"])):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.linalg.norm(a - b) <= 1e-4 * max(np.linalg.norm(b), 1e-4)


def test_a_metric_computed_from_the_gradients_keeps_them_gradients():
    # the gradient norm as a metric: the gradients are ancestors of a metric
    # too, and still found (the new state is computed from them)
    def step_fn(state, batch):
        p, o, key = state
        key, sub = jax.random.split(key)
        loss, g = jax.value_and_grad(_loss)(p, batch["x"], batch["y"], sub)
        u, o = SGD.update(g, o, p)
        return (optax.apply_updates(p, u), o, key), {"loss": loss, "norm": optax.tree.norm(g)}
    method = meshplan.Manual(dp=2, tp=2, pp=2, num_micro_batches=2)
    step = _compare(step_fn, _state(), method)
    assert step.plan.num_micro_batches == 2
    # (the norm of the mean gradient, computed once per step)
    ref = float(jax.jit(step_fn)(_state(), BATCH)[1]["norm"])
    assert float(step(_state(), BATCH)[1]["norm"]) == pytest.approx(ref, rel=1e-5)


def _eval_step(p, batch):
    h = batch["x"]
    for w in p:
        h = jnp.tanh(h @ w)
    return {"loss": jnp.mean((h - batch["y"]) ** 2), "pred": h,
            "hits": jnp.sum(jnp.argmax(h, -1) == jnp.argmax(batch["y"], -1)),
            "worst": jnp.max(jnp.abs(h - batch["y"]))}


def _eval_with_an_unread_scalar(p, batch):
    # (jax.nn.logsumexp over the batch leaves such a scalar in its jaxpr)
    out = _eval_step(p, batch)
    _ = jnp.mean(jnp.abs(out["pred"]) < 0.1)
    return {"loss": out["loss"]}


def _grads_step(p, batch):
    loss, g = jax.value_and_grad(tanh_mlp_loss)(p, batch)
    return {"loss": loss, "grads": g}


@pytest.mark.parametrize("fn", [_eval_step, _eval_with_an_unread_scalar, _grads_step],
                         ids=["evaluation", "unread-scalar", "gradients"])
def test_a_step_that_updates_nothing_runs_its_micro_batches_through_the_pipeline(fn):
    # (refused before: 'updates none of its arguments from the batch', plan
    # one micro-batch, which leaves a pipeline's stages idle in turn)
    p = [jax.random.normal(jax.random.key(i), (16, 16)) * 0.4 for i in range(4)]
    batch = {"x": jax.random.normal(jax.random.key(7), (16, 16)),
             "y": jax.random.normal(jax.random.key(8), (16, 16))}
    step = meshplan.parallelize(fn, method=meshplan.Manual(dp=2, tp=1, pp=4, num_micro_batches=4),
                                donate_argnums=())
    got, want = step(p, batch), jax.jit(fn)(p, batch)
    assert step.plan.num_micro_batches == 4 and len(step.plan.stages) == 4
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    if fn is not _grads_step:
        # a forward program per stage and micro-batch, and nothing else
        assert sorted(b.kind for b in step.last_timeline) == ["F"] * 16
        assert all(s.predicted.memory.grads == 0 for s in step.plan.stages)


def test_a_metric_run_on_the_batch_after_the_update_is_refused_with_the_reason():
    # an EMA model's loss on the batch: the batch passes through the new
    # state, which micro-batches cannot give before the update; the refusal
    # told the user to use meshplan's gradient markers, which did not help
    def loss(w, batch):
        return jnp.mean((jnp.tanh(batch["x"] @ w) - batch["y"]) ** 2)

    def step_fn(state, batch):
        g = jax.grad(loss)(state["w"], batch)
        w = state["w"] - 0.1 * g
        ema = 0.9 * state["ema"] + 0.1 * w
        return {"w": w, "ema": ema}, {"ema_loss": loss(ema, batch)}
    state = {"w": jnp.ones((16, 4)), "ema": jnp.ones((16, 4))}
    with pytest.raises(meshplan.InfeasiblePlanError,
                       match=r"the output \[1\]\['ema_loss'\] runs the batch through the new state"):
        meshplan.plan(step_fn, state, BATCH, cluster=meshplan.Cluster.local(),
                      method=meshplan.Manual(dp=2, tp=2, pp=2, num_micro_batches=2))


def test_per_example_keys_and_a_vmapped_draw_pipeline_with_micro_batches():
    # the equinox way: one key per example (jax.random.split(key, batch
    # size)) and a vmapped draw; the per-example keys are split at the full
    # batch once per step too, so every example keeps its key
    def loss(p, x, y, key):
        keys = jax.random.split(key, x.shape[0])

        def one(xi, ki):
            h = jnp.tanh(xi @ p["w1"])
            h = jnp.where(jax.random.bernoulli(ki, 0.8, h.shape), h / 0.8, 0.0)
            return jnp.tanh(h @ p["w2"]) @ p["w3"]
        return jnp.mean((jax.vmap(one)(x, keys) - y) ** 2)

    def step_fn(state, batch):
        p, o, key = state
        key, sub = jax.random.split(key)
        l, g = jax.value_and_grad(loss)(p, batch["x"], batch["y"], sub)
        u, o = SGD.update(g, o, p)
        return (optax.apply_updates(p, u), o, key), {"loss": l}
    step = _compare(step_fn, _state(), meshplan.PipeshardParallel(stages=2, num_micro_batches=4))
    assert step.plan.num_micro_batches == 4


@pytest.mark.parametrize("raw", [False, True, "legacy"])
def test_per_example_keys_the_batch_holds_pipeline_with_micro_batches(raw):
    # (the equinox idiom with the keys made by the data pipeline: row i
    # draws with keys[i] at any micro-batch size); keys whose rows are
    # mixed (reversed) are still refused.  "legacy": raw uint32 keys handed
    # to jax.random as they are (each call wraps and unwraps them), folded
    # and split per layer
    def one(p, x, key):
        if raw == "legacy":
            key = jax.random.split(jax.random.fold_in(key, 3))[0]
        key = jax.random.wrap_key_data(key) if raw else key
        keep = jax.random.bernoulli(jax.random.split(key)[1], 0.8, (32,))
        return jnp.where(keep, jnp.tanh(x @ p["w1"]), 0.0) @ p["w2"]

    def step_fn(p, batch, flip=False):
        keys = batch["keys"][::-1] if flip else batch["keys"]
        l, g = jax.value_and_grad(
            lambda p: jnp.mean(jax.vmap(one, (None, 0, 0))(p, batch["x"], keys) ** 2))(p)
        return jax.tree.map(lambda a, b: a - 0.1 * b, p, g), l
    k1, k2 = jax.random.split(jax.random.key(0))
    p = {"w1": jax.random.normal(k1, (16, 32)) * 0.3, "w2": jax.random.normal(k2, (32, 4)) * 0.3}
    keys = jax.random.split(jax.random.key(1), 16)
    batch = {"x": BATCH["x"], "keys": jax.random.key_data(keys) if raw else keys}
    method = meshplan.PipeshardParallel(stages=2, num_micro_batches=2)
    step = meshplan.parallelize(step_fn, method=method)
    (got, lg), (want, lw) = step(p, batch), jax.jit(step_fn)(p, batch)
    assert step.plan.num_micro_batches == 2
    np.testing.assert_allclose(float(lg), float(lw), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
    with pytest.raises(meshplan.MeshplanError, match="takes its key from the batch"):
        meshplan.plan(lambda p, b: step_fn(p, b, flip=True), p, batch,
                      cluster=meshplan.Cluster.local(), method=method)


# (the threefry pipeline runs with -m extended; threefry draws in pipelines:
# test_dropout_over_the_batch_pipelines_with_micro_batches)
@pytest.mark.parametrize("method,impl,rows", [
    pytest.param(meshplan.Manual(dp=2, tp=2, pp=2, num_micro_batches=2), "threefry2x32", 8,
                 marks=pytest.mark.extended),
    # (one program recomputing its blocks, which split the next step's key
    # among their forward: runtime.remat.Replay.backward_from)
    pytest.param(meshplan.Manual(dp=4, tp=2, pp=1, remat=True), "threefry2x32", 8,
                 marks=pytest.mark.extended),
    pytest.param(meshplan.Manual(dp=4, tp=2, pp=1), "rbg", 8, marks=pytest.mark.extended),
    (meshplan.Manual(dp=1, tp=4, pp=2, num_micro_batches=4), "rbg", 4)])
def test_builtin_gpt_with_dropout_matches_jit(method, impl, rows):
    # Megatron-LM's dropout in the built-in gpt: each micro-batch draws its
    # rows of the masks the plain step draws (also micro-batches of one
    # example, whose trace JAX makes with fewer broadcasts), a recomputation
    # draws the same bits again, and a Philox ("rbg") draw split over devices
    # is the whole one's
    m = build_model("gpt", {"dropout": "0.1", "rng_impl": impl, "optimizer": "sgd",
                            "layers": "2", "hidden": "64", "batch": str(rows), "seq_len": "16",
                            "vocab": "64"})
    state, batch = m.init(0)
    ref, rm = jax.jit(m.train_step)(state, batch)
    step = meshplan.parallelize(m.train_step, method=method, batch_argnums=m.batch_argnums)
    par, pm = step(state, batch)
    assert len(step.plan.stages) == method.pp
    np.testing.assert_allclose(float(pm["loss"]), float(rm["loss"]), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(par), jax.tree.leaves(ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


def _custom_vjp_gap(bwd) -> float:
    """The largest difference from jax.jit of a step whose hidden layer passes
    through a custom_vjp with backward ``bwd``, as a 2-stage pipeline of 2
    micro-batches."""
    @jax.custom_vjp
    def op(x):
        return x
    op.defvjp(lambda x: (x, None), lambda _, g: (bwd(g),))

    def loss(p, x, y):
        return jnp.mean((op(jnp.tanh(x @ p["w1"])) @ p["w2"] - y) ** 2)

    def step(p, batch):
        l, g = jax.value_and_grad(loss)(p, batch["x"], batch["y"])
        return jax.tree.map(lambda a, b: a - 0.1 * b, p, g), {"loss": l}
    k1, k2 = jax.random.split(jax.random.key(0))
    p = {"w1": jax.random.normal(k1, (16, 32)), "w2": jax.random.normal(k2, (32, 4))}
    out = meshplan.parallelize(step, method=meshplan.Manual(dp=2, tp=2, pp=2,
                                                            num_micro_batches=2))(p, BATCH)[0]
    ref = jax.jit(step)(p, BATCH)[0]
    return max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(out),
                                                              jax.tree.leaves(ref)))


def test_a_custom_vjp_linear_in_the_cotangent_pipelines_exactly():
    # every true VJP is linear in the cotangent: the mean of the micro-batch
    # gradients is the whole batch's
    assert _custom_vjp_gap(lambda g: 0.5 * g) < 1e-5


def test_a_custom_vjp_that_clips_its_cotangent_is_warned_of():
    # a micro-batch's loss is the mean over its own rows, so its backward's
    # cotangents are the micro-batch count times the whole batch's, and a
    # backward that clips them (not linear in the cotangent) clips other
    # values: no combination of micro-batches is the whole batch's gradient
    with pytest.warns(UserWarning, match=r"outputs \[0\].*\(gradients, batch statistics\)\) cannot "
                                         r"be combined exactly .*clipped"):
        gap = _custom_vjp_gap(lambda g: jnp.clip(g, -0.01, 0.01))
    assert gap > 1e-3     # (the difference the warning names)


def test_nnx_batch_norm_pipelines_with_a_warning():
    # nnx.BatchNorm under nnx.value_and_grad: its scale's gradient is the
    # backward's sum(dy * (x - mean)), which the input's gradient reads too,
    # times rsqrt(var); found as a gradient (it was refused), the step runs,
    # warned that each micro-batch normalises with its own statistics
    nnx = pytest.importorskip("flax.nnx")

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.l1 = nnx.Linear(16, 32, rngs=rngs)
            self.bn = nnx.BatchNorm(32, rngs=rngs)
            self.l2 = nnx.Linear(32, 4, rngs=rngs)

        def __call__(self, x):
            return self.l2(jax.nn.relu(self.bn(self.l1(x))))

    graphdef, state = nnx.split(Net(nnx.Rngs(0)))

    def step_fn(state, batch):
        model = nnx.merge(graphdef, state)
        loss, grads = nnx.value_and_grad(
            lambda m: jnp.mean((m(batch["x"]) - batch["y"]) ** 2))(model)
        nnx.update(model, jax.tree.map(lambda p, g: p - 0.1 * g, nnx.state(model, nnx.Param),
                                       nnx.state(grads, nnx.Param)))
        return nnx.state(model), loss
    step = meshplan.parallelize(step_fn, method=meshplan.Manual(dp=2, tp=2, pp=2,
                                                                num_micro_batches=2))
    with pytest.warns(UserWarning, match="cannot be combined exactly.*num_micro_batches=1"):
        new, loss = step(state, BATCH)
    ref, ref_loss = jax.jit(step_fn)(state, BATCH)
    assert step.plan.num_micro_batches == 2 and len(step.plan.stages) == 2
    assert jax.tree.structure(new) == jax.tree.structure(ref) and np.isfinite(float(loss))
    # (one micro-batch: the undecorated step's numbers)
    one = meshplan.parallelize(step_fn, method=meshplan.Manual(dp=4, tp=2))
    new, loss = one(state, BATCH)
    assert abs(float(loss) - float(ref_loss)) <= 1e-5 * abs(float(ref_loss))
    for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("method", [meshplan.Manual(dp=2, tp=2, pp=2, num_micro_batches=2),
                                    meshplan.Manual(dp=4, tp=2, pp=1, num_micro_batches=2)],
                         ids=["pp2", "pp1"])
def test_a_metric_of_frozen_gradients_keeps_the_trained_ones_exact(method):
    # a frozen sub-tree (set_to_zero) whose gradients only a metric reads:
    # the backward that makes them runs with the forward (ancestors of the
    # metric), so the trained weight's backward reads a cotangent the forward
    # made; with partial sums its scale is rescaled like a backward's (the
    # trained weight's gradient was 1/D of jax.jit's)
    labels = {"w1": "frozen", "w2": "frozen", "w3": "train"}
    opt = optax.multi_transform({"train": optax.sgd(0.1), "frozen": optax.set_to_zero()}, labels)

    def step_fn(state, batch):
        p, o, key = state
        loss, g = jax.value_and_grad(_loss)(p, batch["x"], batch["y"], key)
        u, o = opt.update(g, o, p)
        return (optax.apply_updates(p, u), o, key), {"loss": loss, "norm": optax.tree.norm(g),
                                                     "g3": g["w3"]}
    step = _compare(step_fn, _state(opt), method)
    assert step.plan.num_micro_batches == 2
    ref = jax.jit(step_fn)(_state(opt), BATCH)[1]
    got = step(_state(opt), BATCH)[1]
    for name in ("norm", "g3"):
        np.testing.assert_allclose(np.asarray(got[name]), np.asarray(ref[name]), rtol=1e-5,
                                   atol=1e-7)


@pytest.mark.parametrize("method, calls", [
    (meshplan.ShardParallel(), [8]),
    (meshplan.Manual(dp=2, tp=2, pp=2, num_micro_batches=2), [4, 4])])
def test_a_debug_callback_on_per_example_values_runs_with_each_micro_batch(method, calls):
    # as in a scan over the micro-batches: one call each, with its rows (it
    # ran once, in the update, on values averaged over the micro-batches,
    # and warned the loss "scales with the micro-batch size")
    seen = []

    def step_fn(p, b):
        def loss(p):
            per_example = jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2, axis=1)
            jax.debug.callback(lambda v: seen.append(np.asarray(v)), per_example)
            return per_example.mean()
        loss, g = jax.value_and_grad(loss)(p)
        return jax.tree.map(lambda a, c: a - 0.1 * c, p, g), {"loss": loss}
    p = {"w": jax.random.normal(jax.random.key(1), (4, 4))}
    b = {"x": jax.random.normal(jax.random.key(0), (8, 4)), "y": jnp.zeros((8, 4))}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        par = jax.block_until_ready(meshplan.parallelize(step_fn, method=method)(p, b))
    assert not [w for w in caught if "meshplan" in str(w.message)]
    got, seen[:] = list(seen), []
    ref = jax.block_until_ready(jax.jit(step_fn)(p, b))
    assert [len(v) for v in got] == calls
    np.testing.assert_allclose(np.concatenate(got), seen[0], rtol=1e-6)
    assert float(par[1]["loss"]) == pytest.approx(float(ref[1]["loss"]), rel=1e-6)


@pytest.mark.parametrize("metric", [None, "count", "x_sum"])
def test_a_step_returning_its_new_state_alone_pipelines(metric):
    # no loss among the outputs: the one the step computed and dropped ends
    # the forward (the whole step was one layer, and pp=2 "did not fit"),
    # also beside a metric of the batch alone, whose ancestors hold no
    # layer (sweep W: a token count returned for logging)
    def step_fn(p, b):
        def loss(p):
            h = jnp.tanh(b["x"] @ p["w1"] + p["b1"])
            return jnp.mean((h @ p["w2"] - b["y"]) ** 2)
        new = jax.tree.map(lambda a, c: a - 0.1 * c, p, jax.grad(loss)(p))
        if metric is None:
            return new
        return new, ((b["y"] != 0).sum() if metric == "count" else b["x"].sum())
    k1, k2 = jax.random.split(jax.random.key(0))
    p = {"w1": jax.random.normal(k1, (16, 32)) * 0.1, "b1": jnp.zeros(32),
         "w2": jax.random.normal(k2, (32, 8)) * 0.1}
    b = {"x": jax.random.normal(k1, (8, 16)), "y": jax.random.normal(k2, (8, 8))}
    step = meshplan.parallelize(step_fn, method=meshplan.Manual(dp=2, tp=2, pp=2,
                                                                 num_micro_batches=2))
    par, ref = step(p, b), jax.jit(step_fn)(p, b)
    assert len(step.plan.stages) == 2
    for a, c in zip(jax.tree.leaves(par), jax.tree.leaves(ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(c), rtol=1e-5, atol=1e-7)



def test_running_statistics_a_step_returns_are_not_forward_work():
    # the dropped loss ends the forward beside a metric, but the new value of
    # an input the step returns (the wresnet's BatchNorm running statistics,
    # made before the backward and read by nothing) is update work: counted
    # as forward it moved the wresnet's layers and its pipeline plan (sweep V2)
    from meshplan.api import trace_step
    from meshplan.graph import forward_nodes
    from meshplan.models import build_model
    m = build_model("wresnet", {"batch": 8, "image_size": 16, "base_width": 8, "layers": 8})
    graph = trace_step(m.train_step, m.abstract_args, (1,), "wresnet")[0]
    fwd = forward_nodes(graph)
    updates = {o.tensor for o in graph.outputs if o.updates is not None}
    assert not any(fwd[n.id] and not updates.isdisjoint(n.outputs) for n in graph.nodes)
    assert any(fwd[n.id] for n in graph.nodes if n.primitive == "conv_general_dilated")


@pytest.mark.parametrize("m", [1, 2])
def test_an_update_that_reads_the_loss_pipelines(m):
    # (a learning rate picked by the loss, as optax's reduce_on_plateau
    # does: the loss's sum was taken for a gradient, the marker ended the
    # forward at the head, and the step cut into one layer)
    def step_fn(p, b):
        value, g = jax.value_and_grad(tanh_mlp_loss)(p, b)
        lr = jnp.where(value > 0.5, 0.1, 0.01)
        return [w - lr * gw for w, gw in zip(p, g)], value
    ks = jax.random.split(jax.random.key(0), 6)
    p = [jax.random.normal(ks[i], (16, 16)) * 0.3 for i in range(4)]
    b = {"x": jax.random.normal(ks[4], (16, 16)), "y": jax.random.normal(ks[5], (16, 16))}
    step = meshplan.parallelize(step_fn, method=meshplan.Manual(dp=2, tp=2, pp=2,
                                                                 num_micro_batches=m))
    par, ref = step(p, b), jax.jit(step_fn)(p, b)
    assert len(step.plan.stages) == 2
    for a, c in zip(jax.tree.leaves(par), jax.tree.leaves(ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(c), rtol=1e-5, atol=1e-7)


def test_the_new_state_returned_again_among_the_metrics_pipelines():
    # (a metrics dict that holds the new state: it is no metric computed
    # after the update, and the gradients are still found)
    def step_fn(state, batch):
        p, o, key = state
        loss, g = jax.value_and_grad(_loss)(p, batch["x"], batch["y"], key)
        u, o = SGD.update(g, o, p)
        new = (optax.apply_updates(p, u), o, key)
        return new, {"loss": loss, "state": new[0]}
    step = _compare(step_fn, _state(), meshplan.Manual(dp=2, tp=2, pp=2, num_micro_batches=2))
    assert len(step.plan.stages) == 2
    new, metrics = step(_state(), BATCH)
    for a, b in zip(jax.tree.leaves(metrics["state"]), jax.tree.leaves(new[0])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

def test_a_scalar_among_the_batch_leaves_is_every_micro_batchs_whole():
    # (a loss weight passed with the batch: it has no rows to cut, and the
    # micro-batches' losses scaled by it are no "mul over the examples")
    def step_fn(p, b):
        def loss(p):
            return jnp.mean((jnp.tanh(b["x"] @ p["w1"]) @ p["w2"] - b["y"]) ** 2) * b["scale"]
        l, g = meshplan.value_and_grad(loss)(p)
        return jax.tree.map(lambda a, c: a - 0.1 * c, p, g), {"loss": l}
    k1, k2 = jax.random.split(jax.random.key(0))
    p = {"w1": jax.random.normal(k1, (16, 32)) * 0.2, "w2": jax.random.normal(k2, (32, 4)) * 0.2}
    b = dict(BATCH, scale=jnp.float32(2.0))
    step = meshplan.parallelize(step_fn, method=meshplan.PipeshardParallel(stages=2,
                                                                             num_micro_batches=2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        (got, gm), (want, wm) = step(p, b), jax.jit(step_fn)(p, b)
    np.testing.assert_allclose(float(gm["loss"]), float(wm["loss"]), rtol=1e-6)
    for a, c in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(c), rtol=1e-5, atol=1e-7)


def test_a_complex_parameters_gradient_combines_without_a_warning():
    # (its gradient is built by complex(re, 0.0): linear, as an add)
    def step_fn(p, b):
        l, g = jax.value_and_grad(
            lambda p: jnp.mean((jnp.real(b["x"] @ p["cw"]) - b["y"]) ** 2))(p)
        return jax.tree.map(lambda a, c: a - 0.1 * jnp.conj(c), p, g), {"loss": l}
    k1, k2 = jax.random.split(jax.random.key(0))
    p = {"cw": (jax.random.normal(k1, (16, 4)) + 1j * jax.random.normal(k2, (16, 4))) * 0.2}
    step = meshplan.parallelize(step_fn, method=meshplan.Manual(dp=4, tp=2, pp=1,
                                                                 num_micro_batches=2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        (got, gm), (want, wm) = step(p, BATCH), jax.jit(step_fn)(p, BATCH)
    np.testing.assert_allclose(float(gm["loss"]), float(wm["loss"]), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(got["cw"]), np.asarray(want["cw"]), rtol=1e-5, atol=1e-7)


def test_batch_leaves_that_disagree_on_dimension_0_are_named():
    def step_fn(p, b):
        loss, g = jax.value_and_grad(lambda p: jnp.mean((b["xT"].T @ p["w"] - b["y"]) ** 2))(p)
        return jax.tree.map(lambda a, c: a - 0.1 * c, p, g), {"loss": loss}
    batch = {"xT": jnp.ones((16, 8)), "y": jnp.ones((8, 4))}
    with pytest.raises(meshplan.MeshplanError,
                       match=r"argument 1\['xT'\] has 16 rows, argument 1\['y'\] has 8"):
        meshplan.plan(step_fn, {"w": jnp.ones((16, 4))}, batch, cluster=meshplan.Cluster.local(),
                      method=meshplan.Manual(dp=2, tp=2, pp=2, num_micro_batches=2))


def test_per_example_arguments_outside_batch_argnums_are_named_with_the_fix():
    # labels and weights passed as arguments of their own, batch_argnums left
    # at (1,): the micro-batch trace fails, and the error says which to add
    def step_fn(p, x, y, w):
        def loss(p):
            per = jnp.sum((jnp.tanh(x @ p["w"]) - y) ** 2, axis=1)
            return jnp.sum(per * w) / jnp.sum(w)
        l, g = jax.value_and_grad(loss)(p)
        return jax.tree.map(lambda a, c: a - 0.1 * c, p, g), l
    args = ({"w": jnp.ones((8, 4))}, jnp.ones((16, 8)), jnp.ones((16, 4)), jnp.ones((16,)))
    method = meshplan.Manual(dp=2, tp=2, pp=2, num_micro_batches=2)
    with pytest.raises(meshplan.MeshplanError, match=r"Argument\(s\) 2 \(y\), 3 \(w\) have "
                       r"dimension 0 of the batch's size 16 but are not in batch_argnums=\(1,\): "
                       r"if they are per-example, pass batch_argnums=\(1, 2, 3\)"):
        meshplan.plan(step_fn, *args, cluster=meshplan.Cluster.local(), method=method)
    plan = meshplan.plan(step_fn, *args, cluster=meshplan.Cluster.local(), method=method,
                         batch_argnums=(1, 2, 3))
    assert plan.num_micro_batches == 2


def test_the_next_key_split_off_with_the_batchs_keys_is_refused_with_the_fix():
    # split(key, B + 1): the next key and one key an example from one split
    def step_fn(state, batch):
        p, o, key = state
        ks = jax.random.split(key, batch["x"].shape[0] + 1)
        key, subs = ks[0], ks[1:]

        def loss(p):
            drop = jax.vmap(lambda k: jax.random.bernoulli(k, 0.8, (32,)))(subs)
            h = jnp.where(drop, jnp.tanh(batch["x"] @ p["w1"]), 0.0)
            return jnp.mean((jnp.tanh(h @ p["w2"]) @ p["w3"] - batch["y"]) ** 2)
        loss, g = jax.value_and_grad(loss)(p)
        u, o = SGD.update(g, o, p)
        return (optax.apply_updates(p, u), o, key), {"loss": loss}
    step = meshplan.parallelize(step_fn, method=meshplan.Manual(dp=2, tp=2, pp=2,
                                                                 num_micro_batches=2))
    with pytest.raises(meshplan.MeshplanError, match="split the next key off before"):
        step(_state(), BATCH)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_a_marked_zero_gradient_of_a_parameter_the_loss_never_reads_pipelines(schedule):
    # meshplan.value_and_grad marks the zeros jax makes for it: a constant no
    # stage program computes (the update's driver looked it up and crashed)
    def step_fn(state, batch):
        p, o, key = state
        loss, g = meshplan.value_and_grad(_loss)(p, batch["x"], batch["y"], key)
        u, o = SGD.update(g, o, p)
        return (optax.apply_updates(p, u), o, key), {"loss": loss}
    p, o, key = _state()
    p = {**p, "unused": jnp.ones((4, 4)), "unused_scalar": jnp.float32(1.0)}   # (a literal zero)
    _compare(step_fn, (p, SGD.init(p), key),
             meshplan.Manual(dp=2, tp=2, pp=2, num_micro_batches=2, schedule=schedule))


@pytest.mark.parametrize("method", [meshplan.ShardParallel(),
                                    meshplan.Manual(dp=2, tp=2, pp=2, num_micro_batches=2)])
def test_a_cond_between_two_forwards_of_several_layers_is_differentiated_through(method):
    # the forward cond hands its backward residuals that depend on the
    # batch and are no per-example values: they were taken for gradients,
    # and the marker came before the backward cond that makes the real ones
    # (a KeyError under ShardParallel, a refusal with micro-batches)
    def step_fn(state, batch):
        p, o, key = state

        def loss(p):
            fwd = lambda act: (lambda h: jnp.tanh(act(h @ p["w1"]) @ p["w2"]) @ p["w3"])
            out = jax.lax.cond(p["w3"][0, 0] > 0, fwd(jnp.tanh), fwd(jax.nn.relu), batch["x"])
            return jnp.mean((out - batch["y"]) ** 2)
        loss, g = jax.value_and_grad(loss)(p)
        u, o = SGD.update(g, o, p)
        return (optax.apply_updates(p, u), o, key), {"loss": loss}
    _compare(step_fn, _state(), method)


def test_a_callback_on_a_value_only_it_reads_runs_with_the_forward():
    # jnp.mean(h) read by jax.debug.print alone: no ancestor of the loss, it
    # ran in a backward, under the once-a-step reduction's shard_map, and
    # failed ("the context mesh cannot be empty")
    seen = []

    def step_fn(state, batch):
        p, o, key = state

        def loss(p):
            h = jnp.tanh(batch["x"] @ p["w1"])
            jax.debug.callback(lambda v: seen.append(float(v)), jnp.mean(h))
            return jnp.mean((jnp.tanh(h @ p["w2"]) @ p["w3"] - batch["y"]) ** 2)
        loss, g = jax.value_and_grad(loss)(p)
        u, o = SGD.update(g, o, p)
        return (optax.apply_updates(p, u), o, key), {"loss": loss}
    _compare(step_fn, _state(), meshplan.Manual(dp=2, tp=2, pp=2, num_micro_batches=2), steps=1)
    assert len(seen) == 3       # (jit's one, and one per micro-batch)
    assert (seen[1] + seen[2]) / 2 == pytest.approx(seen[0], rel=1e-5)


def test_a_table_among_the_batch_leaves_as_long_as_the_batch_is_named():
    # per-class weights in the batch dict, 16 classes for 16 examples: cut
    # into micro-batches like the rows, and indexed by the labels.  The
    # warning named only a combination of values scaling differently
    def step_fn(p, b):
        def loss(p):
            logits = jnp.tanh(b["x"] @ p["w1"]) @ p["w2"]
            nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), b["y"][:, None], 1)[:, 0]
            return jnp.mean(nll * b["cw"][b["y"]])
        value, g = jax.value_and_grad(loss)(p)
        return jax.tree.map(lambda a, c: a - 0.1 * c, p, g), value
    k1, k2 = jax.random.split(jax.random.key(0))
    p = {"w1": jax.random.normal(k1, (8, 16)) * 0.3, "w2": jax.random.normal(k2, (16, 16)) * 0.3}
    b = {"x": jax.random.normal(k1, (16, 8)), "y": jnp.arange(16) % 16,
         "cw": jnp.linspace(0.2, 2.0, 16)}
    step = meshplan.parallelize(step_fn, method=meshplan.Manual(dp=2, tp=2, pp=2,
                                                                 num_micro_batches=2))
    with pytest.warns(UserWarning, match=r"argument 1\['cw'\] is indexed by values of the batch"):
        step(p, b)


def _sparse_sgd(state, batch):
    # the rows a batch reads, updated in place by their mean-loss gradient
    rows = state["emb"][batch["ids"]]

    def loss(rows, w):
        return jnp.mean((jnp.tanh(rows) @ w - batch["y"]) ** 2)
    value, (g_rows, g_w) = jax.value_and_grad(loss, argnums=(0, 1))(rows, state["w"])
    return ({"emb": state["emb"].at[batch["ids"]].add(-0.5 * g_rows),
             "w": state["w"] - 0.5 * g_w}, {"loss": value})


@pytest.mark.parametrize("method", [meshplan.Manual(dp=8, num_micro_batches=2),
                                    meshplan.Manual(dp=2, tp=2, pp=2, num_micro_batches=2)],
                         ids=["dp8", "pp2"])
def test_rows_of_a_table_updated_by_a_scatter_add_combine_without_a_warning(method):
    # the table plus its rows' gradient summed over the examples: warned as
    # 'scatter-add of values that scale differently', though it was exact
    k = jax.random.key(0)
    state = {"emb": jax.random.normal(k, (64, 8)) * 0.1, "w": jax.random.normal(k, (8, 1))}
    batch = {"ids": jax.random.randint(jax.random.fold_in(k, 1), (16,), 0, 8),
             "y": jax.random.normal(jax.random.fold_in(k, 2), (16, 1))}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = meshplan.parallelize(_sparse_sgd, method=method)(state, batch)
    assert not [w for w in caught if "meshplan" in str(w.message)], caught[0].message
    want = jax.jit(_sparse_sgd)(state, batch)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_micro_batches_of_one_example_are_refused_naming_the_size():
    # (the refusal said the traces differ and to mark the gradients or use one
    # micro-batch, not that two examples a micro-batch would do)
    def loss(p, b):
        return jnp.mean((jnp.tanh(b["x"] @ p["w1"] + p["b1"]) - b["y"]) ** 2)

    def step_fn(p, b):
        value, g = jax.value_and_grad(loss)(p, b)
        return jax.tree.map(lambda a, c: a - 0.1 * c, p, g), {"loss": value}
    p = {"w1": jnp.ones((16, 16)) * 0.1, "b1": jnp.zeros(16)}
    b = {"x": jnp.ones((8, 16)), "y": jnp.zeros((8, 16))}
    with pytest.raises(meshplan.InfeasiblePlanError,
                       match="micro-batches of one example .* two or more examples"):
        meshplan.plan(step_fn, p, b, cluster=meshplan.Cluster.local(),
                      method=meshplan.Manual(dp=1, tp=4, pp=2, num_micro_batches=8))


def test_an_evaluation_step_adding_its_metric_into_its_state_is_told_what_to_do():
    # (it was told to compute its gradients with meshplan.value_and_grad: it has none)
    def step_fn(s, b):
        value = _eval_step(s["ws"], b)["loss"]
        return {**s, "loss_sum": s["loss_sum"] + value}, {"loss": value}
    s = {"ws": [jnp.ones((16, 16)) * 0.1] * 2, "loss_sum": jnp.float32(0)}
    b = {"x": jnp.ones((16, 16)), "y": jnp.zeros((16, 16))}
    with pytest.raises(meshplan.InfeasiblePlanError, match="running sum.*outside the step"):
        meshplan.plan(step_fn, s, b, cluster=meshplan.Cluster.local(),
                      method=meshplan.Manual(dp=2, tp=2, pp=2, num_micro_batches=2))


def test_a_counter_beside_the_batch_in_a_loop_carry_is_the_same_in_every_micro_batch():
    # PPO-style: Adam updates inside a scan over chunks of the batch.  The
    # optimizer's step count shares the carry with values of the batch, but
    # depends on no example: it was refused as a batch-dependent int32 value
    # (the updates themselves differ with micro-batches, and are warned about)
    tx = optax.adam(0.1)

    def step(state, x):
        def body(c, xc):
            p, o = c
            loss, g = jax.value_and_grad(lambda p: jnp.mean(jnp.tanh(xc @ p) ** 2))(p)
            u, o = tx.update(g, o, p)
            return (optax.apply_updates(p, u), o), loss
        (p, o), losses = jax.lax.scan(body, (state["p"], state["o"]),
                                      x.reshape(4, -1, x.shape[-1]))
        return {"p": p, "o": o}, jnp.mean(losses)
    p = jnp.linspace(-1, 1, 64).reshape(8, 8)
    state, x = {"p": p, "o": tx.init(p)}, jnp.linspace(-2, 2, 128).reshape(16, 8)
    f = meshplan.parallelize(step, method=meshplan.Manual(dp=4, pp=2, num_micro_batches=2),
                             batch_argnums=(1,))
    with pytest.warns(UserWarning, match=r"\['p'\].* differ from the undecorated step's"):
        got = f(state, x)[0]
    assert int(got["o"][0].count) == int(jax.jit(step)(state, x)[0]["o"][0].count) == 4


@pytest.mark.parametrize("vg", [jax.value_and_grad, meshplan.value_and_grad],
                         ids=["jax", "meshplan"])
def test_an_update_that_runs_the_loss_again_says_to_plan_one_micro_batch(vg):
    # optax.lbfgs's line search evaluates the loss on the batch inside the
    # update: each refusal names that cause and the fix (the first said to use
    # meshplan.value_and_grad, which only led to the second)
    tx = optax.lbfgs()

    def loss(p, b):
        return jnp.mean((jnp.tanh(b["x"] @ p["w1"]) @ p["w2"] - b["y"]) ** 2)

    def step(state, b):
        value, g = vg(lambda p: loss(p, b))(state["params"])
        u, opt = tx.update(g, state["opt"], state["params"], value=value, grad=g,
                           value_fn=lambda p: loss(p, b))
        return {"params": optax.apply_updates(state["params"], u), "opt": opt}, value
    p = {"w1": jnp.linspace(-1, 1, 32 * 64).reshape(32, 64) / 6,
         "w2": jnp.linspace(1, -1, 64 * 16).reshape(64, 16) / 8}
    state = jax.tree.map(jnp.copy, {"params": p, "opt": tx.init(p)})
    batch = {"x": jnp.linspace(-1, 1, 16 * 32).reshape(16, 32), "y": jnp.ones((16, 16))}
    f = meshplan.parallelize(step, method=meshplan.Manual(dp=2, tp=2, pp=2, num_micro_batches=2))
    with pytest.raises(meshplan.MeshplanError, match=r"line search.*num_micro_batches=1"):
        f(state, batch)


def test_a_weakly_typed_parameter_updated_per_micro_batch_stays_weak():
    # a scalar temperature made by jnp.asarray(1.0) scaling a bfloat16 loss:
    # its update runs per micro-batch and the step returns the mean, which
    # came back strongly typed (the next call re-planned, its loss float32)
    def step(p, b):
        def loss(p):
            out = jnp.tanh(b["x"].astype(jnp.bfloat16) @ p["w"].astype(jnp.bfloat16))
            return jnp.mean((out - b["y"].astype(jnp.bfloat16)) ** 2) * p["temp"]
        value, g = jax.value_and_grad(loss)(p)
        return jax.tree.map(lambda a, d: a - 0.1 * d, p, g), value
    p = {"w": jnp.linspace(-1, 1, 32 * 32).reshape(32, 32) / 6, "temp": jnp.asarray(1.0)}
    batch = {"x": jnp.linspace(-1, 1, 16 * 32).reshape(16, 32), "y": jnp.ones((16, 32))}
    f = meshplan.parallelize(step, method=meshplan.Manual(dp=4, tp=2, num_micro_batches=2))
    want = jax.jit(step)(p, batch)
    for _ in range(2):
        p, value = f(p, batch)
        assert p["temp"].weak_type and value.dtype == want[1].dtype == jnp.bfloat16
    assert len(f._cache) == 1       # (planned once)


@pytest.mark.parametrize("dtype,reduce,warned", [(jnp.float16, jnp.mean, True),
                                                  (jnp.float16, jnp.sum, False),
                                                  (jnp.bfloat16, jnp.mean, False)])
def test_a_float16_backward_under_micro_batches_is_warned_of(dtype, reduce, warned):
    # each micro-batch's cotangents are its own mean loss's, num_micro_batches
    # times the whole batch's: a loss scale that fits jax.jit's step overflowed
    # silently (float32 and bfloat16 have the range; a summed loss's are jax.jit's)
    def step(p, b):
        def loss(p):
            h = jnp.tanh(b["x"].astype(dtype) @ p["w"].astype(dtype))
            return reduce((h - b["y"].astype(dtype)) ** 2).astype(jnp.float32) * 1024.0
        value, g = jax.value_and_grad(loss)(p)
        return jax.tree.map(lambda a, d: a - 1e-4 * d, p, g), value
    p = {"w": jnp.linspace(-1, 1, 32 * 32).reshape(32, 32) / 6}
    batch = {"x": jnp.linspace(-1, 1, 16 * 32).reshape(16, 32), "y": jnp.ones((16, 32))}
    f = meshplan.parallelize(step, method=meshplan.Manual(dp=4, tp=2, num_micro_batches=2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        f(p, batch)
    said = [str(c.message) for c in caught if "float16 with 2 micro-batches" in str(c.message)]
    assert bool(said) == warned and (not said or "2x room" in said[0]), said
