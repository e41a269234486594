"""Sharding rules for pooling, approx_max_k, scans along an axis, sorts and
per-element conds (issue 17, items 3 and 4), and the primitive-coverage
check: every primitive of the built-in models and of small flax, nnx and
equinox steps has a rule (but fft and top_k, which XLA runs gathered)."""
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import meshplan
from meshplan.graph import IDENTITY_MARKERS
from meshplan.ilp.strategies import node_space
from meshplan.planning import replicated_work
from meshplan.trace import trace

# (data parallel: a primitive with no rule would run replicated on gathered
# activations; with one it runs on each device's rows)
MESH8 = meshplan.DataParallel()


def _pool(x):
    import flax.linen as nn
    return (nn.max_pool(x, (2, 2), strides=(2, 2)).mean()
            + nn.avg_pool(x, (3, 3), strides=(1, 1), padding="SAME").mean())


_nograd = jax.lax.stop_gradient


def _last(f):
    return lambda h: f(h.reshape(h.shape[0], -1))


# primitive(s) -> loss of the (batch, ...) activations; the batch splits them
CASES = {
    "pool": (("reduce_window_max", "reduce_window_sum", "select_and_scatter_add"), _pool),
    "approx_max_k": (("approx_top_k",), _last(lambda h: jax.lax.approx_max_k(h, 3)[0].mean())),
    "cumsum": (("cumsum",), _last(lambda h: (jnp.cumsum(h, axis=1) ** 2).mean())),
    # (under grad these two become an associative scan; on values without a
    # gradient they stay one primitive)
    "cummax": (("cummax",), _last(lambda h: (h * jax.lax.cummax(_nograd(h), axis=1)).mean())),
    "cumlogsumexp": (("cumlogsumexp",),
                     _last(lambda h: (h * jax.lax.cumlogsumexp(_nograd(h), axis=1)).mean())),
    "sort": (("sort",), _last(lambda h: jnp.sort(h, axis=1)[:, :4].mean())),
    "argsort": (("sort",), _last(lambda h: (h * jnp.argsort(h, axis=1)).mean())),
    # (jax 0.10 has stack and unstack primitives; each is the other's transpose)
    "stack": (("stack", "unstack"),
              _last(lambda h: (jnp.stack([h, h * 2.0], axis=1) ** 2).mean()
                    + sum((u ** 3).mean() for u in jnp.unstack(h.reshape(len(h), 4, -1), axis=1)))),
}


def _step(loss_of):
    def step(w, x):
        loss, g = jax.value_and_grad(lambda w: loss_of(jnp.tanh(x * w)))(w)
        return w - 0.1 * g, loss
    return step


W = jnp.float32(0.9)
X = jnp.linspace(-2, 2, 1024 * 8 * 8 * 16).reshape(1024, 8, 8, 16) ** 3


@pytest.mark.parametrize("case", sorted(CASES))
def test_window_topk_scan_and_sort_ops_are_split_along_the_batch(case):
    prims, loss_of = CASES[case]
    step = _step(loss_of)
    graph = trace(step, W, X, batch_argnums=(1,), warn=False)
    nodes = [n for n in graph.nodes if n.primitive in prims]
    assert {n.primitive for n in nodes} == set(prims)
    assert all(node_space(graph, n) is not None for n in nodes)
    assert replicated_work(graph) is None
    par = meshplan.parallelize(step, method=MESH8, batch_argnums=(1,), donate_argnums=())
    got = par(W, X)
    # the plan splits each of these ops along the batch (dimension 0) only
    planned = dict(par.plan.stages[0].constraints)
    for n in nodes:
        for t in n.outputs:
            spec = planned[t]
            assert spec[0] == "data" and set(spec[1:]) == {None}, (n.primitive, spec)
    ref = jax.jit(step)(W, X)
    # (means over a million elements, summed per device first)
    assert float(got[1]) == pytest.approx(float(ref[1]), rel=1e-4)
    assert np.allclose(np.asarray(got[0]), np.asarray(ref[0]), rtol=1e-4)


# (XLA's SPMD partitioner runs these on their operand gathered whole, however
# it is laid out: jax 0.10.2's compiled programs all-gather it)
GATHERED = {
    "top_k": _last(lambda h: jax.lax.top_k(h, 3)[0].mean()),
    # (over trailing dimensions; its gradient is an fft too)
    "fft": lambda h: (jnp.real(jnp.fft.fft(h, axis=-2)) ** 2).mean()
    + (jnp.abs(jnp.fft.rfft(h, axis=-1)) ** 2).mean(),
}


@pytest.mark.parametrize("case", sorted(GATHERED))
def test_fft_and_top_k_run_gathered_as_xla_runs_them_and_are_priced_so(case):
    # (their rules let the batch split them: the plan predicted no collective
    # for them while XLA gathered their operands, and an fft split over two
    # axes crashed XLA CPU's fft thunk)
    from meshplan.runtime import hlo
    step = _step(GATHERED[case])
    x = X[:64]
    graph = trace(step, W, x, batch_argnums=(1,), warn=False)
    nodes = [n for n in graph.nodes if n.primitive == case]
    assert nodes and all(node_space(graph, n) is None for n in nodes)
    par = meshplan.parallelize(step, method=MESH8, batch_argnums=(1,), donate_argnums=())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")     # (the fft's share of the work is warned of)
        got = par(W, x)
    compiled = hlo.collective_bytes_per_call(par.lower(W, x).compile().as_text())
    assert compiled > 0 and par.plan.predicted.comm_bytes_per_device == compiled
    ref = jax.jit(step)(W, x)
    assert float(got[1]) == pytest.approx(float(ref[1]), rel=1e-4)
    assert np.allclose(np.asarray(got[0]), np.asarray(ref[0]), rtol=1e-4)


def test_a_split_fft_is_warned_of_as_replicated_work():
    graph = trace(_step(GATHERED["fft"]), W, X[:64], batch_argnums=(1,), warn=False)
    assert "no sharding rule: fft" in (replicated_work(graph) or "")


def _depthwise_step(p, batch):
    def loss(p):
        h = jax.lax.conv_general_dilated(batch["x"], p["dw"], (1, 1), "SAME",
                                         dimension_numbers=("NHWC", "HWIO", "NHWC"),
                                         feature_group_count=16)
        return jnp.mean((jnp.tanh(h).mean((1, 2)) @ p["out"] - batch["y"]) ** 2)
    loss, g = jax.value_and_grad(loss)(p)
    return jax.tree.map(lambda a, b: a - 0.1 * b, p, g), loss


@pytest.mark.parametrize("method", [MESH8, meshplan.ShardParallel()])
def test_a_depthwise_convolution_and_its_weight_gradient_split_along_the_batch(method):
    """A grouped convolution had no rule (every device convolved the whole
    batch); its weight gradient is a convolution with ``batch_group_count``."""
    k = jax.random.split(jax.random.key(0), 4)
    p = {"dw": jax.random.normal(k[0], (3, 3, 1, 16)) * 0.3,
         "out": jax.random.normal(k[1], (16, 4)) * 0.3}
    batch = {"x": jax.random.normal(k[2], (32, 8, 8, 16)), "y": jax.random.normal(k[3], (32, 4))}
    graph = trace(_depthwise_step, p, batch, batch_argnums=(1,), warn=False)
    convs = [n for n in graph.nodes if n.primitive == "conv_general_dilated"]
    groups = {(dict(n.params)["feature_group_count"], dict(n.params)["batch_group_count"])
              for n in convs}
    assert {(16, 1), (1, 16)} <= groups
    assert all(node_space(graph, n) is not None for n in convs)
    assert replicated_work(graph) is None
    par = meshplan.parallelize(_depthwise_step, method=method, batch_argnums=(1,))
    got, ref = par(p, batch), jax.jit(_depthwise_step)(p, batch)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    if method is MESH8:     # (the forward's result: each device its rows)
        planned = dict(par.plan.stages[0].constraints)
        fwd = next(n for n in convs if dict(n.params)["feature_group_count"] == 16)
        assert planned[fwd.outputs[0]][0] == "data"


# ---------------------------------------------------------------------------
# cond: optax.MultiSteps
# ---------------------------------------------------------------------------

MULTI = optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2)


def _opt_step(tx):
    """A two-layer regression step updated by the optax transformation ``tx``."""
    def step(state, batch):
        p, o = state
        loss, g = jax.value_and_grad(
            lambda p: jnp.mean((jnp.tanh(batch["x"] @ p["w1"]) @ p["w2"] - batch["y"]) ** 2))(p)
        u, o = tx.update(g, o, p)
        return (optax.apply_updates(p, u), o), loss
    return step


_multi_step = _opt_step(MULTI)


def test_multisteps_state_follows_the_parameters_and_runs_like_jit():
    # (weights large enough that the plan splits them)
    p = {"w1": jnp.linspace(-1, 1, 64 * 2048).reshape(64, 2048) * 0.1,
         "w2": jnp.linspace(1, -1, 2048 * 64).reshape(2048, 64) * 0.1}
    state = (p, MULTI.init(p))
    batch = {"x": jnp.linspace(-1, 1, 16 * 64).reshape(16, 64), "y": jnp.ones((16, 64))}
    graph = trace(_multi_step, state, batch, warn=False)
    conds = [n for n in graph.nodes if n.primitive == "cond"]
    assert conds and all(node_space(graph, n) is not None for n in conds)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step = meshplan.parallelize(_multi_step, method=meshplan.ShardParallel(mesh_shape=(8,)),
                                    donate_argnums=())
        out_p, out_o = step(state, batch)[0]
    assert not [c for c in caught if "run replicated" in str(c.message)]
    # every state leaf shaped like a parameter is laid out like that parameter
    specs = dict(step.plan.stages[0].params)
    split = 0
    for name in ("w1", "w2"):
        want = specs[f"[0]['{name}']"]
        for path, spec in specs.items():
            if path.startswith("[1]") and path.endswith(f"['{name}']"):
                assert spec == want, (path, spec, want)
        split += any(d is not None for d in want)
    assert split, specs          # (and the parameters are split at all)
    _runs_like_jit(_multi_step, step, state, batch)


ADAM = optax.adam(1e-2)


_adam_step = _opt_step(ADAM)


@pytest.mark.parametrize("method", [meshplan.ShardParallel(),
                                    pytest.param(meshplan.Auto(), marks=pytest.mark.extended),
                                    meshplan.ShardParallel(mesh_shape=(2, 4))],
                         ids=["shard", "auto", "shard-2x4"])
def test_multisteps_plans_its_state_like_the_plain_adam_step(method):
    # (sizes where splitting pays on the 8-GPU cluster: the plain step's
    # state is split there, and MultiSteps' cond must not undo that)
    S = jax.ShapeDtypeStruct
    p = {"w1": S((1024, 4096), jnp.float32), "w2": S((4096, 1024), jnp.float32)}
    batch = {"x": S((64, 1024), jnp.float32), "y": S((64, 1024), jnp.float32)}
    cluster = meshplan.load_cluster("examples/clusters/dgx-a100-x1.json")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain = meshplan.plan(_adam_step, (p, jax.eval_shape(ADAM.init, p)), batch,
                              method=method, cluster=cluster)
        multi = meshplan.plan(_multi_step, (p, jax.eval_shape(MULTI.init, p)), batch,
                              method=method, cluster=cluster)
    want = {k.replace("[1][0]", "[1]"): v for k, v in plain.stages[0].params}
    got = {k.replace(".inner_opt_state[0]", ""): v for k, v in multi.stages[0].params}
    assert any(d is not None for k, v in want.items() if "mu" in k for d in v), want
    if isinstance(method, meshplan.Auto):
        # Auto may settle on another of equally split layouts (its mesh search
        # sees the cond's extra work); what must hold is that nothing the plain
        # step splits is left whole
        split = lambda spec: any(d is not None for d in spec)  # noqa: E731
        for k, v in want.items():
            assert split(got[k]) == split(v), (k, got[k], v)
        for name in ("w1", "w2"):
            assert split(got[f"[1].acc_grads['{name}']"])
        return
    for k, v in want.items():
        assert got[k] == v, (k, got[k], v)
    # the gradients MultiSteps accumulates are laid out like their parameters
    for name in ("w1", "w2"):
        assert got[f"[1].acc_grads['{name}']"] == want[f"[0]['{name}']"]


def _runs_like_jit(fn, step, state, batch, steps: int = 3) -> None:
    """``steps`` calls of ``step`` (fn parallelized) against jax.jit's."""
    ref, par = state, state
    for _ in range(steps):
        ref, rl = jax.jit(fn)(ref, batch)
        par, pl = step(par, batch)
        assert float(pl) == pytest.approx(float(rl), rel=1e-5)
    for a, b in zip(jax.tree.leaves(par), jax.tree.leaves(ref)):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.linalg.norm(a - b) <= 1e-4 * max(np.linalg.norm(b), 1e-6)


@pytest.mark.parametrize("tx", [MULTI, optax.apply_if_finite(optax.adam(1e-2), 3)],
                         ids=["multisteps", "apply_if_finite"])
def test_an_update_in_a_cond_is_one_cond_per_parameter_and_each_stage_runs_its_own(tx):
    # the cond over every leaf was one operation: a pipeline put the whole
    # optimizer state, and a copy of the other stage's parameters, on one
    # stage.  Split per component, each stage holds its own layers' state
    n = 4
    p = {f"w{i}": jnp.linspace(-1, 1, 32 * 32).reshape(32, 32) * (0.1 + 0.01 * i)
         for i in range(n)}

    def step(state, batch):
        p, o = state

        def loss(p):
            h = batch["x"]
            for i in range(n):
                h = jnp.tanh(h @ p[f"w{i}"])
            return jnp.mean((h - batch["y"]) ** 2)
        value, g = jax.value_and_grad(loss)(p)
        u, o = tx.update(g, o, p)
        return (optax.apply_updates(p, u), o), value
    state = (p, tx.init(p))
    batch = {"x": jnp.linspace(-1, 1, 16 * 32).reshape(16, 32), "y": jnp.ones((16, 32))}
    graph = trace(step, state, batch, warn=False)
    assert len([nd for nd in graph.nodes if nd.primitive == "cond"]) >= n
    f = meshplan.parallelize(step, method=meshplan.Manual(dp=2, tp=2, pp=2, num_micro_batches=2))
    _runs_like_jit(step, f, state, batch)
    # each stage holds the state of the parameters it holds, and no other's
    for s in f.plan.stages:
        names = {k.split("['")[-1].rstrip("']") for k, _ in s.params if "['w" in k}
        mine = {k.split("['")[-1].rstrip("']") for k, _ in s.params if k.startswith("[0]['")}
        assert len(mine) == n // 2 and names == mine, (names, mine)


def test_a_cond_that_reduces_a_whole_array_in_a_branch_has_a_rule():
    # a branch that sums a component to a scalar (a global norm, an isfinite
    # check): laid out with its component, an all-reduce of the scalar
    # charged where it is split; a sum that keeps an axis is split as a loop
    # of one step (its sum all-reduced); an operator with no rule, none
    def whole(w, x):
        h = x @ w
        return jax.lax.cond(h.sum() > 0, lambda h: h / h.sum(), lambda h: h * 2.0, h)

    def rows(w, x):
        h = x @ w
        return jax.lax.cond(h.sum() > 0, lambda h: h / h.sum(0), lambda h: h * 2.0, h)
    args = jnp.ones((8, 8)), jnp.ones((16, 8))
    (cond,) = [n for n in trace(whole, *args, warn=False).nodes if n.primitive == "cond"]
    space = node_space(trace(whole, *args, warn=False), cond)
    assert space is not None and space.reduce_each_step
    assert dict(cond.params)["reduced"] == (0,)
    graph = trace(rows, *args, warn=False)
    (cond,) = [n for n in graph.nodes if n.primitive == "cond"]
    space = node_space(graph, cond)
    # (both dimensions split; the rows' class sums 8 floats of the column sums)
    assert space is not None and not space.blocked
    assert space.reduce_each_step == ((space.in_labels[1][0], 32.0),)

    def qr(w, x):
        h = x @ w
        return jax.lax.cond(h.sum() > 0, lambda h: jnp.linalg.qr(h)[0], lambda h: h * 2.0, h)
    graph = trace(qr, *args, warn=False)
    (cond,) = [n for n in graph.nodes if n.primitive == "cond"]
    assert node_space(graph, cond) is None


CLIPPED = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2))
IF_FINITE = optax.apply_if_finite(CLIPPED, 3)


def test_apply_if_finite_plans_its_state_like_the_plain_step():
    # optax.apply_if_finite runs its update in a cond whose branch computes
    # the global norm: its state was replicated (and the cond's work)
    S = jax.ShapeDtypeStruct
    p = {"w1": S((1024, 4096), jnp.float32), "w2": S((4096, 1024), jnp.float32)}
    batch = {"x": S((64, 1024), jnp.float32), "y": S((64, 1024), jnp.float32)}
    cluster = meshplan.load_cluster("examples/clusters/dgx-a100-x1.json")
    method = meshplan.ShardParallel(mesh_shape=(2, 4))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plain = meshplan.plan(_opt_step(CLIPPED), (p, jax.eval_shape(CLIPPED.init, p)), batch,
                              method=method, cluster=cluster)
        finite = meshplan.plan(_opt_step(IF_FINITE), (p, jax.eval_shape(IF_FINITE.init, p)),
                               batch, method=method, cluster=cluster)
    assert not [c for c in caught if "run replicated" in str(c.message)]
    want = dict(plain.stages[0].params)
    got = {k.replace(".inner_state", ""): v for k, v in finite.stages[0].params}
    moments = [k for k in want if ".mu" in k or ".nu" in k]
    assert moments and any(d is not None for k in moments for d in want[k])
    for k in moments:
        assert got[k] == want[k], (k, got[k], want[k])
    # (the cond's results are written once and read again: XLA fuses no
    # further across a conditional; replicated, it was 5x the plain step)
    assert finite.predicted.iteration_s <= plain.predicted.iteration_s * 1.25


def test_a_cond_in_a_branch_follows_the_parameters_too():
    # apply_if_finite around MultiSteps around clip and adam: a cond in a
    # cond's branch, both reducing to scalars; each moment and running
    # gradient sum is laid out like its parameter
    S = jax.ShapeDtypeStruct
    tx = optax.apply_if_finite(optax.MultiSteps(CLIPPED, 4), 3)
    p = {"w1": S((1024, 4096), jnp.float32), "w2": S((4096, 1024), jnp.float32)}
    batch = {"x": S((64, 1024), jnp.float32), "y": S((64, 1024), jnp.float32)}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = meshplan.plan(_opt_step(tx), (p, jax.eval_shape(tx.init, p)), batch,
                             method=meshplan.ShardParallel(mesh_shape=(2, 4)),
                             cluster=meshplan.load_cluster("examples/clusters/dgx-a100-x1.json"))
    assert not [c for c in caught if "run replicated" in str(c.message)]
    specs = dict(plan.stages[0].params)
    state = {k: v for k, v in specs.items() if k.startswith("[1]") and v}
    assert len(state) == 6          # (mu, nu and the running sum of each weight)
    for k, v in state.items():
        assert v == specs["[0]" + k[k.rindex("['"):]], (k, v)
    assert any(d is not None for v in state.values() for d in v)


def _branchy_step(stacked: bool):
    """Matmuls inside a cond: on the step counter, or (``stacked``) on the
    layer index inside a scan over stacked layers, as Gemma alternates local
    and global attention."""
    def block(w, h, even):
        return jax.lax.cond(even, lambda a: jnp.tanh(a @ w), lambda a: jax.nn.relu(a @ w) * 0.5, h)

    def loss(w, s, x, y):
        if stacked:
            h = jax.lax.scan(lambda h, wi: (block(wi[0], h, wi[1] % 2 == 0), None), x,
                             (w, jnp.arange(w.shape[0])))[0]
        else:
            h = block(w, x, s % 2 == 0)
        return jnp.mean((h - y) ** 2)

    def step(state, batch):
        l, g = jax.value_and_grad(loss)(state["w"], state["step"], batch["x"], batch["y"])
        return {"w": state["w"] - 0.1 * g, "step": state["step"] + 1}, l
    return step


@pytest.mark.parametrize("stacked", [False, True], ids=["counter", "layer-index"])
@pytest.mark.parametrize("method", [MESH8, meshplan.ShardParallel()], ids=["data", "shard"])
def test_matmuls_in_a_conds_branches_split_along_the_batch(stacked, method):
    """A cond whose branches are not element-wise (a matmul) had no rule:
    every device ran it on the whole batch.  Its branches are now read as a
    loop body run once: what no branch mixes (the batch) splits."""
    step = _branchy_step(stacked)
    k = jax.random.split(jax.random.key(0), 3)
    w = jax.random.normal(k[0], (3, 32, 32) if stacked else (32, 32)) * 0.3
    state = {"w": w, "step": jnp.int32(0)}
    batch = {"x": jax.random.normal(k[1], (64, 32)), "y": jax.random.normal(k[2], (64, 32))}
    graph = trace(step, state, batch, batch_argnums=(1,), warn=False)
    assert any(n.primitive == ("scan" if stacked else "cond") for n in graph.nodes)
    assert replicated_work(graph) is None
    par = meshplan.parallelize(step, method=method, batch_argnums=(1,))
    got, ref = state, state
    for _ in range(2):      # (both branches)
        got, gl = par(got, batch)
        ref, rl = jax.jit(step)(ref, batch)
        assert float(gl) == pytest.approx(float(rl), rel=1e-5)
    np.testing.assert_allclose(np.asarray(got["w"]), np.asarray(ref["w"]), rtol=1e-5, atol=1e-6)
    if method is MESH8:     # (the matmul in the branch runs on each device's rows)
        hlo = par.lower(state, batch).compile().as_text()
        dots = [l for l in hlo.splitlines() if " dot(" in l and "f32[64,32]" in l]
        assert not dots, dots


def test_apply_if_finite_runs_split_like_jit():
    # (a weight large enough that the plan splits it and its moments)
    p = {"w1": jnp.linspace(-1, 1, 16 * 2048).reshape(16, 2048) * 0.1,
         "w2": jnp.linspace(1, -1, 2048 * 2048).reshape(2048, 2048) * 0.01}
    state = (p, IF_FINITE.init(p))
    batch = {"x": jnp.linspace(-1, 1, 32 * 16).reshape(32, 16), "y": jnp.ones((32, 2048))}
    fn = _opt_step(IF_FINITE)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step = meshplan.parallelize(fn, method=meshplan.ShardParallel(mesh_shape=(8,)),
                                    donate_argnums=())
        step(state, batch)
    assert not [c for c in caught if "run replicated" in str(c.message)]
    _runs_like_jit(fn, step, state, batch)
    # the moments split like their parameters; the branch's norm is a sum of
    # the devices' parts, all-reduced as one scalar
    specs = dict(step.plan.stages[0].params)
    assert specs["[1].inner_state[1][0].mu['w2']"] == specs["[0]['w2']"] != (None, None)
    text = step.lower(state, batch).compile().as_text()
    assert [ln for ln in text.splitlines() if "f32[] all-reduce(" in ln and "branch" in ln]


# ---------------------------------------------------------------------------
# coverage: no primitive of these steps runs replicated for want of a rule
# ---------------------------------------------------------------------------

def _traced(step, *args):
    """The step's Graph as planning sees it (a scan over layers unrolled)."""
    from meshplan.dp_search import Session
    from meshplan.planning import trace_function
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return trace_function(step, args, (1,), "step", Session.from_env()).graph


def _unruled(graph) -> set[str]:
    return {n.primitive for n in graph.nodes
            if n.primitive not in IDENTITY_MARKERS
            and any(graph.tensors[t].shape for t in n.outputs)
            and node_space(graph, n) is None}


# Primitives that stay replicated on purpose, each with why.
ALLOWED = {
    # random keys: every device holds the same key (random_bits drawn from
    # them are split, see test_real_steps)
    "random_wrap", "random_unwrap", "random_split", "random_fold_in", "random_seed",
    "threefry2x32",
}

TINY = {
    "mlp": {"layers": 2, "hidden": 16, "in_dim": 8, "out_dim": 8, "batch": 8},
    "gpt": {"layers": 1, "hidden": 16, "heads": 2, "seq_len": 8, "vocab": 32, "batch": 8},
    "moe": {"layers": 2, "hidden": 16, "heads": 2, "seq_len": 8, "vocab": 32, "batch": 8},
    "wresnet": {"layers": 8, "base_width": 8, "image_size": 8, "batch": 8},
}


@pytest.mark.parametrize("name", sorted(TINY))
def test_built_in_models_use_only_primitives_with_rules(name):
    from meshplan.models import build_model
    model = build_model(name, TINY[name])
    graph = _traced(model.train_step, *model.abstract_args)
    assert _unruled(graph) - ALLOWED == set()


def _sgd_step(loss_fn):
    opt = optax.sgd(0.1)

    def step(state, batch):
        params, key = state
        key, sub = jax.random.split(key)
        loss, g = jax.value_and_grad(loss_fn)(params, batch, sub)
        u, _ = opt.update(g, opt.init(params), params)
        return (optax.apply_updates(params, u), key), loss
    return step


def _linen_step():
    import flax.linen as nn

    class Block(nn.Module):
        @nn.compact
        def __call__(self, h, _):
            y = nn.Dense(16)(nn.LayerNorm()(h))
            y = nn.Dropout(0.1, deterministic=False)(nn.gelu(y))
            return h + nn.Dense(16)(y), None

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            stack = nn.scan(nn.remat(Block), variable_axes={"params": 0},
                            split_rngs={"params": True, "dropout": True}, length=2)
            h, _ = stack()(nn.Dense(16)(x), None)
            return nn.Dense(4)(h)

    model = Model()
    x = jnp.ones((8, 8))
    params = model.init({"params": jax.random.key(0), "dropout": jax.random.key(1)}, x)
    loss = lambda p, b, k: jnp.mean((model.apply(p, b["x"], rngs={"dropout": k}) - b["y"]) ** 2)  # noqa: E731
    return _sgd_step(loss), ((params, jax.random.key(2)), {"x": x, "y": jnp.ones((8, 4))})


def _nnx_step():
    from flax import nnx

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.a = nnx.Linear(8, 16, rngs=rngs)
            self.drop = nnx.Dropout(0.1, rngs=rngs)
            self.b = nnx.Linear(16, 4, rngs=rngs)

        def __call__(self, x):
            return self.b(self.drop(nnx.relu(self.a(x))))

    graphdef, params, rest = nnx.split(Model(nnx.Rngs(0)), nnx.Param, ...)

    def loss(p, b, k):
        model = nnx.merge(graphdef, p, rest)
        model.drop.rngs = nnx.Rngs(dropout=k)
        return jnp.mean((model(b["x"]) - b["y"]) ** 2)
    x = jnp.ones((8, 8))
    return _sgd_step(loss), ((params, jax.random.key(2)), {"x": x, "y": jnp.ones((8, 4))})


def _equinox_step():
    import equinox as eqx

    k1, k2 = jax.random.split(jax.random.key(0))
    model = (eqx.nn.Linear(8, 16, key=k1), eqx.nn.Dropout(0.1), eqx.nn.Linear(16, 4, key=k2))
    params, static = eqx.partition(model, eqx.is_array)

    def loss(p, b, k):
        a, drop, c = eqx.combine(p, static)
        f = lambda x, kk: c(drop(jax.nn.relu(a(x)), key=kk))   # noqa: E731
        pred = jax.vmap(f)(b["x"], jax.random.split(k, b["x"].shape[0]))
        return jnp.mean((pred - b["y"]) ** 2)
    x = jnp.ones((8, 8))
    return _sgd_step(loss), ((params, jax.random.key(2)), {"x": x, "y": jnp.ones((8, 4))})


def _multisteps_step():
    p = {"w1": jnp.ones((8, 16)), "w2": jnp.ones((16, 8))}
    return _multi_step, ((p, MULTI.init(p)), {"x": jnp.ones((8, 8)), "y": jnp.ones((8, 8))})


@pytest.mark.parametrize("make", [_linen_step, _nnx_step, _equinox_step, _multisteps_step],
                         ids=["linen-scan-remat-dropout", "nnx-dropout", "equinox-dropout",
                              "optax-multisteps"])
def test_library_steps_use_only_primitives_with_rules(make):
    step, args = make()
    graph = _traced(step, *args)
    assert _unruled(graph) - ALLOWED == set()


def test_random_draws_trace_with_no_unknown_primitive():
    # jax.random.uniform turns bits into floats with bitcast_convert_type, and
    # flax clones keys with random_clone: both used to be reported as unknown
    # primitives "planned replicated" although the first has a rule
    def step(key, x):
        key = jax.random.clone(key)
        keep = jax.random.uniform(key, x.shape) > 0.5
        return jnp.sum(jnp.where(keep, x, 0.0))

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        graph = trace(step, jax.random.key(0), jnp.ones((8, 4)), batch_argnums=(1,))
    assert graph.warnings == ()


def test_replicated_work_names_what_weighs_with_the_share_that_put_it_there():
    """Sweep X (stop 92): the list named a top_k at "0% of FLOPs" beside the
    fft that made up the share: each part now gives both its shares, and one
    that weighs nothing is left out."""
    def loss_of(h):     # (the top_k of one example's last row: next to nothing)
        return GATHERED["fft"](h) + GATHERED["top_k"](h[:1, :1, :1])
    graph = trace(_step(loss_of), W, X[:64], batch_argnums=(1,), warn=False)
    assert any(n.primitive == "top_k" and node_space(graph, n) is None for n in graph.nodes)
    said = replicated_work(graph) or ""
    assert "fft (" in said and "of bytes: " in said
    assert "top_k" not in said
