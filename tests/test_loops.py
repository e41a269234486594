"""Time-step loops (issue 17, item 3): a ``lax.scan`` over the sequence, a
``fori_loop`` and a ``while_loop`` run split along the dimensions their body
does not mix (the batch of the carry), not replicated; numbers equal jit."""
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import meshplan
from meshplan.ilp.strategies import node_space
from meshplan.planning import replicated_work
from meshplan.trace import trace


def _rglru(p, x):
    """An RG-LRU-like recurrence (Griffin): gates made outside the scan, an
    element-wise linear recurrence over time inside it."""
    a = jax.nn.sigmoid(x @ p["wa"])
    b = x @ p["wb"]

    def step(h, ab):
        a_t, b_t = ab
        h = a_t * h + (1 - a_t) * b_t
        return h, h
    h0 = jnp.zeros((x.shape[0], x.shape[2]), x.dtype)
    _, hs = jax.lax.scan(step, h0, (a.transpose(1, 0, 2), b.transpose(1, 0, 2)))
    return jnp.mean(hs ** 2)


def _rnn(p, x):
    """A plain RNN: the recurrence multiplies by a weight inside the scan."""
    def step(h, x_t):
        h = jnp.tanh(h @ p["wa"] + x_t @ p["wb"])
        return h, h
    h0 = jnp.zeros((x.shape[0], x.shape[2]), x.dtype)
    _, hs = jax.lax.scan(step, h0, x.transpose(1, 0, 2))
    return jnp.mean(hs ** 2)


def _loops(p, x):
    """A fori_loop (a scan with a counter) and a while_loop over the batch's rows."""
    h = x[:, 0] @ p["wa"]
    h = jax.lax.fori_loop(0, 4, lambda i, h: jnp.tanh(h * 0.9 + 0.1), h)
    h2 = jax.lax.while_loop(lambda s: s[0] < 3, lambda s: (s[0] + 1, jnp.sin(s[1]) * 2.0),
                            (0, jax.lax.stop_gradient(h)))[1]
    return jnp.mean(h * h2)


def _step(loss):
    def step(p, x):
        v, g = jax.value_and_grad(loss)(p, x)
        return jax.tree.map(lambda a, b: a - 0.1 * b, p, g), v
    return step


def _args(B, T, H):
    p = {"wa": jnp.linspace(-0.5, 0.5, H * H).reshape(H, H) / 8,
         "wb": jnp.linspace(0.5, -0.5, H * H).reshape(H, H) / 8}
    return p, jnp.linspace(-1, 1, B * T * H).reshape(B, T, H)


def _loop_nodes(graph):
    return [n for n in graph.nodes if n.primitive in ("scan", "while")]


def _batch_label(space, k):
    """The label of dimension 0 of the loop's carry operand ``k``."""
    return space.in_labels[k][0]


@pytest.mark.parametrize("loss", [_rglru, _rnn, _loops], ids=["rglru", "rnn", "fori-while"])
def test_loop_rule_splits_the_carry_along_the_batch_only(loss):
    p, x = _args(16, 4, 8)
    graph = trace(_step(loss), p, x, warn=False)
    loops = _loop_nodes(graph)
    forward = [n for n in loops if not n.scope.startswith("transpose")]
    assert forward
    for n in loops:
        assert node_space(graph, n) is not None, n.primitive
    for n in forward:
        space = node_space(graph, n)
        shapes = [graph.tensors[t].shape for t in n.inputs]
        # the carry of shape (batch, hidden): its batch dimension may be split ...
        k = shapes.index((16, 8))
        lab = _batch_label(space, k)
        assert lab not in space.blocked and space.sizes[lab] == 16
        # ... and a scan's per-step inputs and outputs split it on their
        # dimension 1, never on the iteration dimension 0
        for labels, shape in zip(list(space.in_labels) + list(space.out_labels),
                                 shapes + [graph.tensors[t].shape for t in n.outputs]):
            if labels and len(shape) == 3:
                assert labels[0] in space.blocked and labels[1] == lab, (labels, shape)


def test_rnn_sums_its_weight_gradient_over_the_split_batch_in_every_step():
    # h @ W inside the body contracts the hidden dimension of the carry: it
    # stays whole; the backward scan sums dW over the batch, so a split
    # batch costs an all-reduce of dW's partial sums in every step
    B, T, H = 16, 4, 8
    p, x = _args(B, T, H)
    graph = trace(_step(_rnn), p, x, warn=False)
    fwd, bwd = sorted(_loop_nodes(graph), key=lambda n: n.scope.startswith("transpose"))
    space = node_space(graph, fwd)
    shapes = [graph.tensors[t].shape for t in fwd.inputs]
    carry = space.in_labels[shapes.index((B, H))]
    assert carry[1] in space.blocked and carry[0] not in space.blocked
    # (the forward sums over the inputs' hidden dimension in x_t @ U, not
    # over the batch)
    assert carry[0] not in dict(space.reduce_each_step)
    space = node_space(graph, bwd)
    (lab,) = [lab for lab, _ in space.reduce_each_step if space.sizes[lab] == B]
    assert lab not in space.blocked
    # (dW and dU: two H x H float32 sums in each of the T steps)
    assert dict(space.reduce_each_step)[lab] == 2 * H * H * 4 * T


def test_a_loop_around_the_rnn_sums_its_weight_gradient_in_every_inner_step():
    # two epochs of the RNN's SGD steps in an outer scan: the inner backward
    # scan's all-reduces run in each outer step too (they were dropped: a
    # tensor-parallel plan of such a loop predicted 4 KiB, and the program
    # all-reduced 8 KiB more inside the inner loop)
    B, T, H = 16, 4, 8
    p, x = _args(B, T, H)

    def epochs(p, x):
        p, vs = jax.lax.scan(lambda p, _: _step(_rnn)(p, x), p, None, length=2)
        return p, vs[-1]
    graph = trace(epochs, p, x, warn=False)
    (outer,) = [n for n in _loop_nodes(graph) if n.params and dict(n.params).get("length") == 2]
    space = node_space(graph, outer)
    batch = space.in_labels[[graph.tensors[t].shape for t in outer.inputs].index((B, T, H))][0]
    assert batch not in space.blocked
    # (at least dW and dU in each of the T inner steps of each of the 2)
    assert dict(space.reduce_each_step)[batch] >= 2 * (2 * H * H * 4 * T)


def test_a_loop_that_mixes_everything_has_no_rule():
    def step(w, x):
        # (a reversal keeps both dimensions of the carry whole)
        h = jax.lax.fori_loop(0, 3, lambda i, h: jnp.flip(h @ w), x @ w)
        return jnp.mean(h)
    graph = trace(step, jnp.ones((8, 8)), jnp.ones((8, 8)), warn=False)
    (loop,) = _loop_nodes(graph)
    assert node_space(graph, loop) is None


def _run_against_jit(step, p, x, method):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        par = meshplan.parallelize(step, method=method, donate_argnums=())
        got_p, got_l = par(p, x)
    ref_p, ref_l = jax.jit(step)(p, x)
    assert float(got_l) == pytest.approx(float(ref_l), rel=1e-5)
    for a, b in zip(jax.tree.leaves(got_p), jax.tree.leaves(ref_p)):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.linalg.norm(a - b) <= 1e-4 * max(np.linalg.norm(b), 1e-6)
    return par


@pytest.mark.parametrize("loss,size", [(_rglru, (64, 8, 32)), (_rnn, (512, 8, 32)),
                                       (_loops, (4096, 2, 64))],
                         ids=["rglru", "rnn", "fori-while"])
def test_time_step_loops_run_batch_split_and_equal_jit(loss, size):
    step = _step(loss)
    p, x = _args(*size)
    graph = trace(step, p, x, warn=False)
    assert replicated_work(graph) is None
    par = _run_against_jit(step, p, x, meshplan.DataParallel())
    planned = dict(par.plan.stages[0].constraints)
    for n in _loop_nodes(graph):
        for t in n.outputs:
            spec = planned.get(t)
            if spec is None:        # (a scalar counter)
                assert graph.tensors[t].shape == ()
                continue
            if size[0] not in graph.tensors[t].shape:
                continue            # (an RNN's weight gradient)
            want = ("data", None) if len(spec) == 2 else (None, "data", None)
            assert tuple(spec) == want, (n.primitive, graph.tensors[t].shape, spec)


def test_a_replicated_loop_is_named_once_with_its_share():
    def step(w, x):
        h = jax.lax.fori_loop(0, 8, lambda i, h: jnp.flip(jnp.tanh(h @ w)), x @ w)
        return jnp.mean(h)
    w = jax.ShapeDtypeStruct((512, 512), jnp.float32)
    x = jax.ShapeDtypeStruct((256, 512), jnp.float32)
    cluster = meshplan.load_cluster("examples/clusters/dgx-a100-x1.json")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = meshplan.plan(step, w, x, cluster=cluster, method=meshplan.ShardParallel())
    said = [str(c.message) for c in caught if "run replicated" in str(c.message)]
    assert len(said) == 1 and "scan (" in said[0] and "MiB" in said[0], said
    assert any("scan (" in n for n in plan.notes)


def test_a_loop_and_a_cond_nested_in_a_scan_keep_its_batch_split():
    def loss(p, x):
        def step(h, x_t):
            h = jax.lax.fori_loop(0, 2, lambda i, h: jnp.tanh(h + x_t), h)
            h = jax.lax.cond(jnp.sum(x_t) > 0, lambda h: h * 2.0, lambda h: h - 1.0, h)
            return h, h
        _, hs = jax.lax.scan(step, x[:, 0] @ p["wa"], x.transpose(1, 0, 2))
        return jnp.mean(hs ** 2)
    p, x = _args(16, 4, 8)
    graph = trace(_step(loss), p, x, warn=False)
    (outer,) = [n for n in _loop_nodes(graph) if not n.scope.startswith("transpose")
                and graph.tensors[n.inputs[-1]].shape == (4, 16, 8)]
    space = node_space(graph, outer)
    assert space is not None
    carry = space.in_labels[[graph.tensors[t].shape for t in outer.inputs].index((16, 8))]
    assert carry[0] not in space.blocked
    _run_against_jit(_step(loss), p, x, meshplan.DataParallel())


def test_rnn_weight_gradient_is_all_reduced_in_every_step_as_costed():
    # the rule's premise: XLA sums the partial weight gradients inside the
    # loop's body (a carry holds whole values), not once after it
    import re
    step = _step(_rnn)
    p, x = _args(512, 8, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        par = meshplan.parallelize(step, method=meshplan.DataParallel(), donate_argnums=())
        par(p, x)
    text = par.lower(p, x).compile().as_text()
    comp, inside = None, []
    for line in text.splitlines():
        m = re.match(r"^(ENTRY )?%?\S+ .*\{$", line)
        if m:
            comp = "entry" if m.group(1) else "body"
        if "all-reduce(" in line or "all-reduce-start(" in line:
            inside.append((comp, line.count("f32[32,32]")))
    assert ("body", 2) in inside, inside


@pytest.mark.parametrize("cond,body,init,n", [
    (lambda s: s[0] < 3, lambda s: (s[0] + 1, jnp.sin(s[1]) * 2.0), 0, 3),
    (lambda s: s[0] <= 10, lambda s: (s[0] + 2, jnp.sin(s[1]) * 2.0), 1, 5),
    (lambda s: 0 < s[0], lambda s: (s[0] - 1, jnp.sin(s[1]) * 2.0), 4, 4),
    (lambda s: s[0] != 6, lambda s: (s[0] + 3, jnp.sin(s[1]) * 2.0), 0, 2),
], ids=["lt", "le-step2", "count-down", "ne"])
def test_a_counted_while_loop_is_costed_for_its_trip_count(cond, body, init, n):
    B, H = 8, 16

    def step(p, x):
        return jax.lax.while_loop(cond, body, (init, x @ p))[1]
    graph = trace(step, jnp.ones((H, H)), jnp.ones((B, H)), warn=False)
    (loop,) = _loop_nodes(graph)
    assert loop.repeat == n and dict(loop.params)["trip_count"] == n
    assert not any("trip count" in w for w in graph.warnings)
    # the body (sin, mul: 2 FLOPs per element) n times, the predicate n + 1 times
    assert loop.flops == pytest.approx(n * 2 * B * H + (n + 1), rel=0.2)


def test_a_while_loop_whose_trip_count_depends_on_data_is_costed_once_and_said_so():
    def step(p, x):
        return jax.lax.while_loop(lambda s: s[1].sum() < 100.0,
                                  lambda s: (s[0] + 1, s[1] * 2.0), (0, x @ p))[1]
    graph = trace(step, jnp.ones((4, 4)), jnp.ones((8, 4)), warn=False)
    (loop,) = _loop_nodes(graph)
    assert loop.repeat == 1
    assert any("trip count unknown" in w for w in graph.warnings)


def _accumulating_step(p, batch):
    """The README's gradient accumulation written in the step: a scan over
    2 chunks of the batch, x.reshape(2, B // 2, ...)."""
    def loss(p, x, y):
        return jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"] - y) ** 2)
    x, y = batch
    xs, ys = x.reshape(2, x.shape[0] // 2, x.shape[1]), y.reshape(2, y.shape[0] // 2, 1)

    def body(g, c):
        return jax.tree.map(jnp.add, g, jax.grad(loss)(p, *c)), None
    g, _ = jax.lax.scan(body, jax.tree.map(jnp.zeros_like, p), (xs, ys))
    return jax.tree.map(lambda a, b: a - 0.1 * b / 2, p, g), loss(p, x, y)


def _accumulation_args(B=1024, D=32):
    p = {"w1": jnp.linspace(-0.2, 0.2, D * 64).reshape(D, 64),
         "w2": jnp.linspace(0.2, -0.2, 64).reshape(64, 1)}
    return p, (jnp.linspace(-1, 1, B * D).reshape(B, D), jnp.linspace(1, -1, B).reshape(B, 1))


def test_a_loop_is_charged_its_whole_work_unless_it_splits():
    # every label of a loop's space is some operand's or result's dimension:
    # a label carried by none (the rule made one per use of a class) let a
    # split of it divide the work with no layout changed, so the replicated
    # loop was priced at 1/8 of its work and DataParallel ran the README's
    # accumulation scan on every device
    from meshplan.cost_model.mesh import mesh_model
    from meshplan.ilp.strategies import all_strategies
    from meshplan.plan import LogicalMesh
    graph = trace(_accumulating_step, *_accumulation_args(), warn=False)
    (scan,) = [n for n in _loop_nodes(graph) if n.primitive == "scan"]
    space = node_space(graph, scan)
    carried = {l for ls in space.in_labels + space.out_labels if ls for l in ls}
    assert set(space.sizes) == carried
    mm = mesh_model(meshplan.Cluster.local(), LogicalMesh(("data",), (8,)))
    by_name = {s.name: s for s in all_strategies(graph, scan, mm)}
    split = [s for s in by_name.values() if s.name != "R"]
    assert split and all(s.compute_s < by_name["R"].compute_s / 4 for s in split)


def test_data_parallel_splits_the_accumulation_scan_and_equals_jit():
    p, batch = _accumulation_args()
    step = meshplan.parallelize(_accumulating_step, method=meshplan.DataParallel(),
                                batch_argnums=(1,))
    with warnings.catch_warnings():
        warnings.simplefilter("error")      # (exact: no micro-batch warning)
        got = step(p, batch)
    want = jax.jit(_accumulating_step)(p, batch)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert not any("replicated work" in n for n in step.plan.notes), step.plan.notes


def test_a_split_loop_divides_only_the_work_its_split_cuts():
    # a Newton-Schulz iteration (muon's): x @ x.T sums over the split
    # dimension and b @ x keeps it, but a @ a multiplies an all-reduced square
    # matrix by itself and runs whole on every device.  The split loop was
    # priced at 1/8 of its work; its matmuls are a third each: 1/12 + 1/3
    from meshplan.cost_model.mesh import mesh_model
    from meshplan.ilp.strategies import all_strategies
    from meshplan.plan import LogicalMesh
    n = 256

    def body(x, _):
        a = x @ x.T
        return 3.0 * x - (a + a @ a) @ x, None

    def step(w):
        return jax.lax.scan(body, w, None, length=5)[0]

    def nested(w):      # (the same in an outer loop: its body's cuts are the inner's)
        return jax.lax.scan(lambda x, _: (step(x), None), w, None, length=2)[0]
    mm = mesh_model(meshplan.Cluster.local(), LogicalMesh(("x",), (8,)))
    for fn in (step, nested):
        graph = trace(fn, jax.ShapeDtypeStruct((n, n), jnp.float32), warn=False,
                      batch_argnums=())
        (scan,) = _loop_nodes(graph)
        by_name = {s.name: s for s in all_strategies(graph, scan, mm)}
        (split,) = [s for s in by_name.values() if s.name != "R"]
        ratio = split.compute_s / by_name["R"].compute_s
        assert abs(ratio - (2 / 3 / 8 + 1 / 3)) < 0.01, (fn.__name__, ratio)
