"""Train steps written with flax (linen and nnx) and equinox, with optax, run
through meshplan.parallelize and give the plain step's numbers."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import meshplan

BATCH, IN, HIDDEN, OUT = 16, 24, 64, 8


def data(seed=0):
    kx, ky = jax.random.split(jax.random.PRNGKey(seed + 100))
    return {"x": jax.random.normal(kx, (BATCH, IN)), "y": jax.random.normal(ky, (BATCH, OUT))}


def compare(step_fn, state, batch, steps=3):
    reference = jax.jit(step_fn)
    step = meshplan.parallelize(step_fn, cluster=meshplan.Cluster.local(),
                                method=meshplan.ShardParallel(mesh_shape=(2, 4)))
    ref, par = state, jax.tree.map(np.array, state)
    for _ in range(steps):
        ref, ref_loss = reference(ref, batch)
        par, loss = step(par, batch)
        np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(par), jax.tree.leaves(ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    assert step.plan is not None and step.plan.stages[0].logical_mesh.shape == (2, 4)
    # the parameters were really placed as the plan says
    leaf = jax.tree.leaves(par)[0]
    assert len(leaf.sharding.device_set) == 8
    return step


def test_flax_linen():
    nn = pytest.importorskip("flax.linen")

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.relu(nn.Dense(HIDDEN)(x))
            x = nn.LayerNorm()(x)
            return nn.Dense(OUT)(x)

    model = MLP()
    params = model.init(jax.random.PRNGKey(0), jnp.zeros((1, IN)))
    tx = optax.sgd(0.1)

    def train_step(state, batch):
        def loss_fn(p):
            return jnp.mean((model.apply(p, batch["x"]) - batch["y"]) ** 2)
        loss, grads = meshplan.value_and_grad(loss_fn)(state["params"])
        updates, opt = tx.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, loss

    compare(train_step, {"params": params, "opt": tx.init(params)}, data())


def test_flax_nnx():
    nnx = pytest.importorskip("flax.nnx")

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.fc = nnx.Linear(IN, HIDDEN, rngs=rngs)
            self.out = nnx.Linear(HIDDEN, OUT, rngs=rngs)

        def __call__(self, x):
            return self.out(jax.nn.gelu(self.fc(x)))

    graphdef, params = nnx.split(MLP(nnx.Rngs(0)), nnx.Param)
    tx = optax.sgd(0.1)

    def train_step(state, batch):
        def loss_fn(p):
            model = nnx.merge(graphdef, p)
            return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)
        loss, grads = jax.value_and_grad(loss_fn)(state["params"])
        updates, opt = tx.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, loss

    compare(train_step, {"params": params, "opt": tx.init(params)}, data(1))


def test_equinox():
    eqx = pytest.importorskip("equinox")
    model = eqx.nn.MLP(IN, OUT, HIDDEN, depth=2, key=jax.random.PRNGKey(0))
    params, static = eqx.partition(model, eqx.is_array)
    tx = optax.sgd(0.1, momentum=0.9)

    def train_step(state, batch):
        def loss_fn(p):
            m = eqx.combine(p, static)
            return jnp.mean((jax.vmap(m)(batch["x"]) - batch["y"]) ** 2)
        loss, grads = meshplan.value_and_grad(loss_fn)(state["params"])
        updates, opt = tx.update(grads, state["opt"], state["params"])
        return {"params": eqx.apply_updates(state["params"], updates), "opt": opt}, loss

    compare(train_step, {"params": params, "opt": tx.init(params)}, data(2))


def test_a_step_under_eqx_filter_jit_or_a_callable_with_attributes_of_its_own():
    # (the wrapper copied the callable's __dict__ over its own: equinox's
    # filter_jit keeps the function's name in `fn`, which replaced the step,
    # and an object's `method` replaced the method given)
    eqx = pytest.importorskip("equinox")

    def plain(s, b):
        g = jax.grad(lambda w: jnp.mean((b["x"] @ w - b["y"]) ** 2))(s["w"])
        return {"w": s["w"] - 0.1 * g}, jnp.mean(b["y"])

    class Step:
        method = "sgd"      # (an attribute of the user's own)

        def __call__(self, s, b):
            return plain(s, b)
    state = {"w": jnp.linspace(-1, 1, IN * OUT).reshape(IN, OUT)}
    for fn in (eqx.filter_jit(plain), Step()):
        step = compare(fn, state, data(3))
        assert step.method == meshplan.ShardParallel(mesh_shape=(2, 4)) and step.fn is fn
    # (named as jax.jit names them)
    for fn in (functools.partial(plain), Step(), plain):
        assert meshplan.parallelize(fn).__name__ == jax.jit(fn).__name__
