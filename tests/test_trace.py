"""Tracing to the Graph IR: nested jaxprs, composites, roles, fingerprints."""
import subprocess
import sys
import textwrap
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from meshplan.graph import BATCH, OPT_STATE, PARAM, STATE, Graph, forward_nodes, topological
from meshplan.trace import trace
from meshplan.errors import TraceError
from _steps import tanh_mlp_loss


def _mlp_step():
    opt = optax.adam(1e-3)

    def loss_fn(p, b):
        h = jax.nn.relu(b["x"] @ p["w1"])
        return ((h @ p["w2"] - b["y"]) ** 2).mean()

    def step(state, batch):
        l, g = jax.value_and_grad(loss_fn)(state["params"], batch)
        u, o = opt.update(g, state["opt_state"], state["params"])
        return {"params": optax.apply_updates(state["params"], u), "opt_state": o}, {"loss": l}

    p = {"w1": jnp.ones((8, 16)), "w2": jnp.ones((16, 4))}
    state = {"params": p, "opt_state": opt.init(p)}
    batch = {"x": jnp.ones((32, 8)), "y": jnp.ones((32, 4))}
    return step, state, batch


def test_roles_outputs_and_topology():
    step, state, batch = _mlp_step()
    g = trace(step, state, batch)
    roles = {i.path: i.role for i in g.inputs}
    assert roles["['params']['w1']"] == PARAM
    assert roles["['opt_state'][0].mu['w1']"] == OPT_STATE
    assert roles["['opt_state'][0].count"] == OPT_STATE
    assert {i.role for i in g.inputs if i.argnum == 1} == {BATCH}
    # every state output updates the same-path input; the loss updates nothing
    for o in g.outputs:
        if o.path.startswith("[0]"):
            assert o.updates is not None
            assert g.inputs[o.updates].path == o.path[3:]
            assert g.tensors[o.tensor].shape == g.tensors[g.inputs[o.updates].tensor].shape
        else:
            assert o.updates is None
    assert topological(g.nodes)
    assert g.num_params == 8 * 16 + 16 * 4
    # forward: 2 matmuls; backward: dW1, dW2 and dH (dX is not needed)
    assert g.matmul_flops == 2 * 32 * (8 * 16 + 16 * 4) * 2 + 2 * 32 * 16 * 4


def _lr_step(p, b, lr):
    loss, g = jax.value_and_grad(lambda p: jnp.mean((jnp.tanh(b["x"] @ p["w0"]) @ p["w1"]
                                                     - b["y"]) ** 2))(p)
    return jax.tree.map(lambda a, c: a - lr * c, p, g), loss


def test_a_loss_is_no_new_value_of_a_scalar_argument():
    # (the loss has a learning rate's shape and dtype: it was taken for the
    # rate's new value, and the forward, which starts from the loss, was lost)
    p = {"w0": jnp.ones((8, 16)) / 8, "w1": jnp.ones((16, 4)) / 16}
    b = {"x": jnp.ones((16, 8)), "y": jnp.zeros((16, 4))}
    g = trace(_lr_step, p, b, 0.1, batch_argnums=(1,), warn=False)
    assert [o.updates is None for o in g.outputs] == [False, False, True]
    assert any(forward_nodes(g))
    import meshplan
    par = meshplan.parallelize(_lr_step, batch_argnums=(1,),
                               method=meshplan.PipeshardParallel(stages=2, num_micro_batches=2))
    got, want = par(p, b, 0.1), jax.jit(_lr_step)(p, b, 0.1)
    assert len(par.plan.stages) == 2
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-7)


def test_a_float64_numpy_state_is_updated_as_jax_jit_takes_it():
    # (x64 off: jax.jit takes the float64 arrays as float32, and so are the
    # new values; the pairing compared float64 with float32 and found none)
    p = {"w0": np.ones((8, 16)) / 8, "w1": np.ones((16, 4)) / 16}
    b = {"x": np.ones((16, 8)), "y": np.zeros((16, 4))}
    step = lambda p, b: _lr_step(p, b, 0.1)     # noqa: E731
    g = trace(step, p, b, batch_argnums=(1,), warn=False)
    assert [o.updates is None for o in g.outputs] == [False, False, True]


def _momentum_step(s, b):
    # step(state, batch) -> (new_params, new_momentum, loss): the parts of
    # one state argument returned apart; params and momentum alike in shape
    value, g = jax.value_and_grad(tanh_mlp_loss)(s["params"], b)
    m = [0.9 * a + c for a, c in zip(s["mom"], g)]
    return [w - 0.1 * v for w, v in zip(s["params"], m)], m, value


def test_parts_of_the_state_returned_apart_are_its_new_values():
    # (only a whole argument was paired: none was, the pipeline refused the
    # step as one that 'updates none of its arguments', and the one-stage
    # plan counted the momentum as parameters)
    ks = jax.random.split(jax.random.key(0), 6)
    s = {"params": [jax.random.normal(ks[i], (16, 16)) * 0.3 for i in range(3)],
         "mom": [jnp.zeros((16, 16))] * 3}
    b = {"x": jax.random.normal(ks[4], (16, 16)), "y": jax.random.normal(ks[5], (16, 16))}
    g = trace(_momentum_step, s, b, batch_argnums=(1,), warn=False)
    pairs = {o.path: g.inputs[o.updates].path for o in g.outputs if o.updates is not None}
    assert pairs == {**{f"[0][{i}]": f"['params'][{i}]" for i in range(3)},
                     **{f"[1][{i}]": f"['mom'][{i}]" for i in range(3)}}
    import meshplan
    par = meshplan.parallelize(_momentum_step,
                               method=meshplan.Manual(dp=2, tp=2, pp=2, num_micro_batches=2))
    got, want = par(s, b), jax.jit(_momentum_step)(s, b)
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)


def test_of_alike_arguments_a_new_value_is_paired_with_the_nearest():
    # (new momentum returned first: both arguments are alike and each new
    # value is computed from both; the first alike argument was taken)
    def step(p, mom, b):
        new_p, new_m, value = _momentum_step({"params": p, "mom": mom}, b)
        return new_m, new_p, value
    p = [jnp.ones((16, 16)) / 16] * 3
    g = trace(step, p, [jnp.zeros((16, 16))] * 3, {"x": jnp.ones((16, 16)),
                                                   "y": jnp.zeros((16, 16))},
              batch_argnums=(2,), warn=False)
    assert {o.path: g.inputs[o.updates].argnum for o in g.outputs if o.updates is not None} \
        == {**{f"[0][{i}]": 1 for i in range(3)}, **{f"[1][{i}]": 0 for i in range(3)}}


def test_state_the_forward_does_not_read_is_optimizer_state_whatever_its_path():
    # keras's stateless API: (trainable, non_trainable, optimizer variables)
    # as lists, so no path names a moment; an EMA of the weights, too
    def step(state, batch):
        (w,), (), (m, v, ema) = state

        def loss(w):
            return jnp.mean((batch["x"] @ w - batch["y"]) ** 2)
        value, g = jax.value_and_grad(loss)(w)
        m, v = 0.9 * m + 0.1 * g, 0.99 * v + 0.01 * g * g
        w = w - 0.01 * m / (jnp.sqrt(v) + 1e-8)
        return ([w], [], [m, v, 0.9 * ema + 0.1 * w]), value
    w = jnp.ones((8, 4))
    g = trace(step, ([w], [], [w * 0, w * 0, w]), {"x": jnp.ones((32, 8)), "y": jnp.ones((32, 4))})
    roles = {i.path: i.role for i in g.inputs if i.argnum == 0}
    assert roles == {"[0][0]": PARAM, "[2][0]": OPT_STATE, "[2][1]": OPT_STATE,
                     "[2][2]": OPT_STATE}


def test_abstract_args_trace_without_allocation():
    step, state, batch = _mlp_step()
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (state, batch))
    g1 = trace(step, *abstract)
    g2 = trace(step, state, batch)
    assert g1.fingerprint == g2.fingerprint


def test_fingerprint_stable_and_shape_sensitive():
    step, state, batch = _mlp_step()
    f1 = trace(step, state, batch).fingerprint
    f2 = trace(step, state, batch).fingerprint
    assert f1 == f2
    batch2 = {"x": jnp.ones((64, 8)), "y": jnp.ones((64, 4))}
    assert trace(step, state, batch2).fingerprint != f1
    assert trace(step, state, batch, batch_argnums=()).fingerprint != f1


def test_fingerprint_same_in_another_process():
    code = textwrap.dedent("""
        import sys; sys.path.insert(0, %r)
        from test_trace import _mlp_step
        from meshplan.trace import trace
        step, s, b = _mlp_step(); print(trace(step, s, b).fingerprint)
    """ % (str(__import__("pathlib").Path(__file__).parent),))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**__import__("os").environ, "PYTHONHASHSEED": "123"}, check=True)
    step, state, batch = _mlp_step()
    assert out.stdout.strip() == trace(step, state, batch).fingerprint


def test_inlines_jit_custom_jvp_custom_vjp_and_remat():
    @jax.custom_vjp
    def f(x):
        return jnp.sin(x)

    f.defvjp(lambda x: (jnp.sin(x), jnp.cos(x)), lambda r, g: (g * r,))

    def fn(w, x):
        h = jax.jit(lambda a, b: a @ b)(x, w)
        h = jax.nn.relu(h)                      # custom_jvp_call
        h = f(h)                                # custom_vjp_call (no grad here)
        h = jax.checkpoint(lambda h: jnp.tanh(h) * 2.0)(h)   # remat2
        return h.sum()

    w, x = jnp.ones((4, 4)), jnp.ones((2, 4))
    prims = {e.primitive.name for e in jax.make_jaxpr(fn)(w, x).jaxpr.eqns}
    assert {"jit", "custom_jvp_call", "custom_vjp_call", "remat2"} <= prims
    g = trace(fn, w, x, batch_argnums=())
    got = {n.primitive for n in g.nodes}
    assert not got & {"jit", "pjit", "custom_jvp_call", "custom_vjp_call", "remat2"}
    assert {"dot_general", "max", "sin", "tanh"} <= got
    remat_prims = {n.primitive for n in g.nodes if n.remat}
    assert "tanh" in remat_prims and "dot_general" not in remat_prims
    assert topological(g.nodes)
    # and under grad too (the checkpointed body is differentiated)
    g2 = trace(jax.grad(fn), w, x, batch_argnums=())
    assert any(n.remat for n in g2.nodes)


def test_scan_is_a_composite_costing_every_iteration():
    def body(c, w):
        return jnp.tanh(c @ w), None

    def fn(ws, x):
        c, _ = jax.lax.scan(body, x, ws)
        return c.sum()

    for layers in (1, 3, 24):
        ws, x = jnp.ones((layers, 16, 16)), jnp.ones((8, 16))
        g = trace(fn, ws, x, batch_argnums=())
        (scan,) = [n for n in g.nodes if n.primitive == "scan"]
        assert scan.repeat == layers
        assert scan.flops == pytest.approx(layers * (2 * 8 * 16 * 16 + 8 * 16))


def test_cond_costs_its_most_expensive_branch_and_while_is_composite():
    def fn(w, x):
        y = jax.lax.cond(x.sum() > 0, lambda x: x @ w, lambda x: x * 2.0, x)
        _, z = jax.lax.while_loop(lambda s: s[0] < 3, lambda s: (s[0] + 1, s[1] * 0.5), (0, y))
        return z.sum()

    w, x = jnp.ones((16, 16)), jnp.ones((8, 16))
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        g = trace(fn, w, x, batch_argnums=())
    (cond,) = [n for n in g.nodes if n.primitive == "cond"]
    assert cond.flops == 2 * 8 * 16 * 16
    # (a counted loop: costed for its 3 iterations, no unknown-trip-count warning)
    (loop,) = [n for n in g.nodes if n.primitive == "while"]
    assert loop.repeat == 3
    assert not any("while loop" in w for w in g.warnings)


def test_unknown_primitive_warns_and_gets_generic_cost():
    from jax.extend.core import Primitive
    from jax.interpreters import mlir

    mystery = Primitive("mystery_op")
    mystery.def_abstract_eval(lambda x: x)
    mystery.def_impl(lambda x: x)
    mlir.register_lowering(mystery, lambda ctx, x: [x])

    def fn(x):
        return mystery.bind(x * 2.0).sum()

    with pytest.warns(UserWarning, match="mystery_op"):
        g = trace(fn, jnp.ones((4, 8)), batch_argnums=())
    (node,) = [n for n in g.nodes if n.primitive == "mystery_op"]
    assert node.flops == 32


def test_graph_json_roundtrip():
    step, state, batch = _mlp_step()
    g = trace(step, state, batch)
    g2 = Graph.from_json(g.to_json())
    assert g2 == g
    # (a layer subgraph's rows, where known, survive too)
    import dataclasses
    rows = dataclasses.replace(g, batch_dims=((g.inputs[-1].tensor, 0),))
    assert Graph.from_json(rows.to_json()) == rows and rows.rows_dim == {g.inputs[-1].tensor: 0}
    assert g.rows_dim is None


def test_bad_batch_argnums_and_failing_function():
    step, state, batch = _mlp_step()
    with pytest.raises(TraceError, match="batch_argnums"):
        trace(step, state, batch, batch_argnums=(5,))

    def broken(x):
        return x @ jnp.ones((3, 3))

    # the function's own error, raised as jax.jit raises it, with a note
    with pytest.raises(TypeError, match="dot_general requires contracting dimensions") as e:
        trace(broken, jnp.ones((2, 2)), batch_argnums=())
    assert any("meshplan traced 'broken'" in n for n in e.value.__notes__)


def test_params_are_plain_python_values():
    step, state, batch = _mlp_step()
    g = trace(step, state, batch)

    def check(v):
        if isinstance(v, tuple):
            for x in v:
                check(x)
        else:
            assert v is None or type(v) in (bool, int, float, str), (type(v), v)
            assert not (isinstance(v, str) and v.startswith("np."))
    for n in g.nodes:
        check(n.params)


def test_random_bits_cost_their_generator_integer_work():
    # threefry (JAX's default) a whole call of about 120 integer operations per element
    # Philox under "rbg" keys about 30; priced at the device's int32 rate
    from pathlib import Path
    from meshplan.cluster import load_cluster

    def draw(key):
        return jax.random.bernoulli(key, 0.9, (64, 128))
    found = {}
    for impl in ("threefry2x32", "rbg"):
        g = trace(draw, jax.random.key(0, impl=impl), batch_argnums=())
        bits = [n for n in g.nodes if n.primitive == "random_bits"]
        assert len(bits) == 1 and dict(bits[0].params)["generator"] == impl
        assert dict(bits[0].params)["partitionable"]
        found[impl] = bits[0].flops / (64 * 128)
    assert found == {"threefry2x32": 120.0, "rbg": 30.0}
    root = Path(__file__).resolve().parents[1]
    a100 = load_cluster(root / "examples/clusters/dgx-a100-x1.json").device
    assert a100.flops_for(jnp.uint32) == a100.flops_for("int32") == 9.7e12
    assert a100.flops_for("int8") == 624e12


def test_four_bit_values_take_half_a_byte_as_xla_stores_them():
    # (a frozen int4 weight was priced at a byte an element: twice what jax.jit
    # takes for its argument)
    def step(q, s, x):
        return jnp.mean(x @ (q.astype(jnp.float32) * s))
    q = jax.ShapeDtypeStruct((256, 256), jnp.int4)
    s = jax.ShapeDtypeStruct((256,), jnp.float32)
    x = jax.ShapeDtypeStruct((16, 256), jnp.float32)
    graph = trace(step, q, s, x, batch_argnums=(2,), warn=False)
    sizes = [graph.tensors[i.tensor].nbytes for i in graph.inputs]
    args = jax.jit(step).lower(q, s, x).compile().memory_analysis().argument_size_in_bytes
    assert sizes[0] == 256 * 256 // 2 and sum(sizes) == args


def test_four_bit_values_take_half_a_byte_in_loop_bodies_and_stage_memory():
    # (a loop body's values and a stage's arrays were sized at int4's one-byte
    # itemsize)
    from meshplan.runtime.pipeline_lower import _device_bytes

    def step(q, x):
        def body(c, _):
            return c + 1, None
        q2, _ = jax.lax.scan(body, q, None, length=3)
        return jnp.mean(x @ q2.astype(jnp.float32))
    q = jax.ShapeDtypeStruct((64, 64), jnp.int4)
    x = jax.ShapeDtypeStruct((8, 64), jnp.float32)
    graph = trace(step, q, x, batch_argnums=(1,), warn=False)
    scan = next(n for n in graph.nodes if n.primitive == "scan")
    shapes, _, _, itemsizes = dict(scan.params)["loop"]
    assert {itemsizes[i] for i, s in enumerate(shapes) if s == (64, 64)} == {0.5}
    assert _device_bytes((64, 64), jnp.int4, None) == 64 * 64 // 2
    assert _device_bytes((64, 64), jnp.bfloat16, None) == 64 * 64 * 2
