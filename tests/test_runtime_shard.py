"""Running one-stage plans with ShardExecutable on 8 fake CPU devices.

The plans are written by hand (data parallel, Megatron column/row split, a
3-D mesh) for a small MLP trained with optax Adam; every run is compared with
the plain ``jax.jit`` of the same step.
"""
from __future__ import annotations

import dataclasses
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import meshplan
from meshplan.models import build_model
from meshplan.errors import MeshplanError, RuntimeStageError, StalePlanError
from meshplan.trace.walk import flatten
from meshplan.plan import LogicalMesh, Plan, Stage
from meshplan.runtime import ShardExecutable, arg_specs, build_mesh, parse_collectives
from meshplan.trace import trace_for_run
from meshplan.runtime.hlo import summary
from meshplan.runtime.shard import make_evaluator

ROOT = pathlib.Path(__file__).resolve().parents[1]
D_IN, HIDDEN, D_OUT, BATCH = 32, 64, 16, 16
TX = optax.adam(1e-2)


# ---------------------------------------------------------------------------
# the model
# ---------------------------------------------------------------------------

def init(seed: int = 0, batch: int = BATCH) -> tuple[dict[str, Any], dict[str, jax.Array]]:
    k1, k2, k3, k4, k5 = jax.random.split(jax.random.PRNGKey(seed), 5)
    params = {"w1": jax.random.normal(k1, (D_IN, HIDDEN)) / D_IN ** 0.5,
              "b1": 0.1 * jax.random.normal(k5, (HIDDEN,)),
              "w2": jax.random.normal(k2, (HIDDEN, D_OUT)) / HIDDEN ** 0.5,
              "b2": jnp.zeros((D_OUT,))}
    state = {"params": params, "opt": TX.init(params)}
    data = {"x": jax.random.normal(k3, (batch, D_IN)), "y": jax.random.normal(k4, (batch, D_OUT))}
    return state, data


def step(state: dict[str, Any], batch: dict[str, jax.Array]) -> tuple[dict[str, Any], dict[str, Any]]:
    def loss_fn(p: dict[str, jax.Array]) -> jax.Array:
        h = jnp.tanh(batch["x"] @ p["w1"] + p["b1"])
        out = h @ p["w2"] + p["b2"]
        return jnp.mean((out - batch["y"]) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(state["params"])
    updates, opt = TX.update(grads, state["opt"], state["params"])
    return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, {"loss": loss}


# ---------------------------------------------------------------------------
# hand-written plans
# ---------------------------------------------------------------------------

def _param_table(state: Any, by_name: dict[str, tuple]) -> tuple[tuple[str, tuple], ...]:
    """Spec of every state leaf whose last key is in ``by_name`` (params and
    their Adam moments alike)."""
    rows = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        name = getattr(path[-1], "key", None)
        if name in by_name and np.ndim(leaf) == len(by_name[name]):
            rows.append((jax.tree_util.keystr(path), by_name[name]))
    return tuple(rows)


def hidden_tensor(state: Any, batch: Any) -> int:
    """Graph id of the forward hidden activation ``x @ w1`` (a dot_general output)."""
    g = meshplan.trace(step, state, batch)
    x_id = next(i.tensor for i in g.inputs if i.argnum == 1 and i.path == "['x']")
    hits = [n.outputs[0] for n in g.nodes
            if n.primitive == "dot_general" and x_id in n.inputs
            and g.tensor(n.outputs[0]).shape == (BATCH, HIDDEN)]
    assert len(hits) == 1, hits
    return hits[0]


def make_plan(state: Any, batch: Any, mesh: LogicalMesh, *, params: dict[str, tuple],
              batch_spec: tuple, constraints: tuple = ()) -> Plan:
    g = meshplan.trace(step, state, batch)
    table = _param_table(state, params)
    outputs = tuple(("[0]" + p, s) for p, s in table) + (("[1]['loss']", ()),)
    stage = Stage(layers=(0, 0), devices=tuple(range(8)), submesh=(1, 8), logical_mesh=mesh,
                  params=table, outputs=outputs, constraints=constraints)
    return Plan(graph_fingerprint=g.fingerprint,
                cluster=meshplan.load_cluster(ROOT / "examples/clusters/dgx-a100-x1.json"),
                method="shard", stages=(stage,),
                batch=(("['x']", batch_spec), ("['y']", batch_spec)),
                batch_argnums=(1,), arg_prefixes=((0, ""), (1, "")))


def data_parallel_plan(state: Any, batch: Any) -> Plan:
    return make_plan(state, batch, LogicalMesh(("data",), (8,)), params={},
                     batch_spec=("data", None))


MEGATRON = {"w1": (None, "model"), "b1": ("model",), "w2": ("model", None)}


def megatron_plan(state: Any, batch: Any) -> Plan:
    return make_plan(state, batch, LogicalMesh(("data", "model"), (2, 4)), params=MEGATRON,
                     batch_spec=("data", None),
                     constraints=((hidden_tensor(state, batch), ("data", "model")),))


def mesh3d_plan(state: Any, batch: Any) -> Plan:
    return make_plan(state, batch, LogicalMesh(("data", "fsdp", "model"), (2, 2, 2)),
                     params={"w1": ("fsdp", "model"), "b1": ("model",), "w2": ("model", "fsdp")},
                     batch_spec=(("data", "fsdp"), None))


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------

def executable(fn: Any, plan: Plan, args: Any, **kw: Any) -> ShardExecutable:
    """A ShardExecutable given the step traced as meshplan.parallelize gives it."""
    return ShardExecutable(fn, plan, args, traced=trace_for_run(fn, args, plan.batch_argnums),
                           retrace=lambda a: trace_for_run(fn, a, plan.batch_argnums), **kw)


def run_both(plan: Plan, steps: int = 3) -> tuple[Any, Any, ShardExecutable]:
    state, batch = init()
    ex = executable(step, plan, (state, batch))
    ref_step = jax.jit(step)
    ref_state, got_state = state, jax.tree_util.tree_map(jnp.copy, state)
    for _ in range(steps):
        ref_state, ref_metrics = ref_step(ref_state, batch)
        got_state, got_metrics = ex(got_state, batch)
    return (ref_state, ref_metrics), (got_state, got_metrics), ex


def assert_close(ref: Any, got: Any, rtol: float = 1e-5) -> None:
    """Leaf by leaf, relative to the leaf's largest magnitude (a floor scale:
    elements near zero are not judged against their own size)."""
    def one(path: Any, r: Any, g: Any) -> None:
        r, g = np.asarray(r), np.asarray(g)
        scale = max(float(np.max(np.abs(r))) if r.size else 0.0, 1e-6)
        np.testing.assert_allclose(g, r, rtol=rtol, atol=rtol * scale,
                                   err_msg=jax.tree_util.keystr(path))
    jax.tree_util.tree_map_with_path(one, ref, got)


def specs_of(tree: Any) -> Any:
    """PartitionSpecs of a pytree of arrays or of NamedShardings."""
    return jax.tree_util.tree_map(lambda x: getattr(x, "sharding", x).spec, tree)


# ---------------------------------------------------------------------------
# the evaluator
# ---------------------------------------------------------------------------

def test_evaluator_replays_the_step_exactly():
    state, batch = init()
    closed, out_shape = jax.make_jaxpr(step, return_shape=True)(state, batch)
    evaluate = make_evaluator(flatten(closed), {})
    leaves = jax.tree_util.tree_leaves((state, batch))
    out_tree = jax.tree_util.tree_structure(out_shape)
    got = jax.tree_util.tree_unflatten(out_tree, jax.jit(evaluate)(*leaves))
    assert_close(jax.jit(step)(state, batch), got)
    eager = jax.tree_util.tree_unflatten(out_tree, evaluate(*leaves))
    assert_close(step(state, batch), eager)


@jax.custom_vjp
def _clip_grad(x: jax.Array) -> jax.Array:
    return x


_clip_grad.defvjp(lambda x: (x, None), lambda _, g: (jnp.clip(g, -1.0, 1.0),))


def _composite_step(w: jax.Array, xs: jax.Array, key: jax.Array) -> tuple[jax.Array, jax.Array]:
    """scan, cond, remat, custom_jvp (relu), custom_vjp and a PRNG key input."""
    def body(c: jax.Array, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        c = jax.checkpoint(lambda c: jax.nn.relu(c @ w + x))(c)
        return c, jnp.sum(c)

    def loss(w: jax.Array) -> jax.Array:
        c, ys = jax.lax.scan(body, jnp.ones(8), xs)
        c = jax.lax.cond(ys.sum() > 0, lambda c: c * 2, lambda c: c - 1, c)
        return jnp.sum(_clip_grad(c) * jax.random.normal(key, c.shape)) + 3.0

    return jax.value_and_grad(loss)(w)


def test_composites_replay_and_run_under_a_plan():
    w, xs, key = 0.3 * jnp.eye(8), jnp.arange(24.0).reshape(3, 8) / 10, jax.random.PRNGKey(1)
    mesh = LogicalMesh(("d",), (8,))
    stage = Stage(layers=(0, 0), devices=tuple(range(8)), submesh=(1, 8), logical_mesh=mesh,
                  params=(("[0]", (None, "d")),), outputs=(("[1]", ("d", None)),))
    # three non-batch arguments: keys are prefixed [0], [1], [2]
    plan = Plan(graph_fingerprint="", cluster=meshplan.Cluster.local(), method="shard",
                stages=(stage,), batch_argnums=())
    ex = executable(_composite_step, plan, (w, xs, key))
    got = ex(w, xs, key)
    assert_close(jax.jit(_composite_step)(w, xs, key), got)
    assert got[1].sharding.spec == P("d", None)


# ---------------------------------------------------------------------------
# meshes and specs
# ---------------------------------------------------------------------------

def test_build_mesh_is_auto_and_row_major():
    mesh = build_mesh(LogicalMesh(("data", "model"), (2, 4)))
    assert mesh.axis_names == ("data", "model")
    assert dict(mesh.shape) == {"data": 2, "model": 4}
    assert mesh.axis_types == (AxisType.Auto, AxisType.Auto)
    ids = sorted(d.id for d in jax.devices())
    assert [[d.id for d in row] for row in mesh.devices] == [ids[:4], ids[4:]]
    picked = build_mesh(LogicalMesh(("x",), (2,)), jax.devices()[6:8])
    assert [d.id for d in picked.devices] == [d.id for d in jax.devices()[6:8]]


def test_build_mesh_refuses_too_few_devices():
    with pytest.raises(RuntimeStageError, match="needs 16 devices"):
        build_mesh(LogicalMesh(("data", "model"), (4, 4)))


def test_plan_for_more_devices_than_present():
    state, batch = init()
    plan = data_parallel_plan(state, batch)
    big = dataclasses.replace(plan.stages[0], devices=tuple(range(16)),
                              logical_mesh=LogicalMesh(("data",), (16,)))
    plan = dataclasses.replace(plan, stages=(big,))
    with pytest.raises(MeshplanError, match="only 8 devices"):
        executable(step, plan, (state, batch))


def test_arg_specs_keys_missing_leaves_and_rank():
    state, batch = init()
    plan = megatron_plan(state, batch)
    specs = arg_specs(plan, (state, batch))
    assert specs[0]["params"]["w1"] == P(None, "model")
    assert specs[0]["opt"][0].mu["w2"] == P("model", None)
    assert specs[0]["params"]["b2"] == P()            # not in the plan: replicated
    assert specs[0]["opt"][0].count == P()
    assert specs[1] == {"x": P("data", None), "y": P("data", None)}
    bad = dict(state, params=dict(state["params"], w1=jnp.zeros((D_IN,))))
    with pytest.raises(StalePlanError, match="1 dimension"):
        arg_specs(plan, (bad, batch))


def test_arg_specs_prefixes_for_several_arguments():
    # step(params, opt, batch): two non-batch arguments are keyed [0]..., [1]...;
    # the single batch argument has no prefix.
    mesh = LogicalMesh(("d",), (8,))
    stage = Stage(layers=(0, 0), devices=tuple(range(8)), submesh=(1, 8), logical_mesh=mesh,
                  params=(("[0]['w']", (None, "d")), ("[1]['m']", ("d",))))
    plan = Plan(graph_fingerprint="x", cluster=meshplan.Cluster.local(), method="shard",
                stages=(stage,), batch=(("['x']", ("d", None)),), batch_argnums=(2,))
    args = ({"w": jnp.zeros((4, 8))}, {"m": jnp.zeros((8,))}, {"x": jnp.zeros((16, 4))})
    assert arg_specs(plan, args) == ({"w": P(None, "d")}, {"m": P("d")}, {"x": P("d", None)})


# ---------------------------------------------------------------------------
# running plans
# ---------------------------------------------------------------------------

def test_data_parallel_matches_jit_and_all_reduces_the_gradients():
    state, batch = init()
    plan = data_parallel_plan(state, batch)
    (ref_state, ref_m), (got_state, got_m), ex = run_both(plan)
    assert_close(ref_m, got_m)
    assert_close(ref_state, got_state)
    assert got_m["loss"].sharding.spec == P()
    assert specs_of(ex.in_shardings[1]) == {"x": P("data", None), "y": P("data", None)}

    lowered = ex.lower(state, batch)
    assert isinstance(lowered, jax.stages.Lowered)
    text = lowered.compile().as_text()
    grad_bytes = 4 * (D_IN * HIDDEN + HIDDEN + HIDDEN * D_OUT + D_OUT)   # 12,608
    # one (combined) all-reduce of all gradients plus the 4-byte loss
    assert summary(text) == {"all-reduce": (1, grad_bytes + 4)}
    (coll,) = parse_collectives(text)
    assert sorted(coll.shapes) == sorted(["f32[64]", "f32[16]", "f32[64,32]", "f32[16,64]",
                                          "f32[]"])


def test_megatron_split_matches_jit_with_planned_shardings():
    state, batch = init()
    plan = megatron_plan(state, batch)
    (ref_state, ref_m), (got_state, got_m), ex = run_both(plan)
    assert_close(ref_m, got_m)
    assert_close(ref_state, got_state)
    params = specs_of(got_state["params"])
    assert params["w1"] == P(None, "model") and params["w2"] == P("model", None)
    assert params["b1"] == P("model")
    assert specs_of(got_state["opt"][0].nu)["w1"] == P(None, "model")
    assert ex.mesh.axis_names == ("data", "model")

    text = ex.lower(state, batch).compile().as_text()
    colls = parse_collectives(text)
    assert {c.kind for c in colls} == {"all-reduce"}
    # Per device: forward partial sums of h @ w2 over 'model' ([8,16] f32 = 512 B);
    # gradients over 'data' of w1 [32,16], b1 [16], w2 [16,16], b2 [16]
    # (3,200 B); and the loss (4 B).
    expected = 8 * D_OUT * 4 + 4 * (D_IN * 16 + 16 + 16 * D_OUT + D_OUT) + 4
    assert sum(c.result_bytes for c in colls) == expected


def test_constraint_reaches_the_compiled_program():
    state, batch = init()
    tid = hidden_tensor(state, batch)
    # Against the Megatron weights, replicating the hidden activation forces a
    # gather that the column/row plan never needs.
    base = megatron_plan(state, batch)
    stage = dataclasses.replace(base.stages[0], constraints=((tid, (None, None)),))
    other = dataclasses.replace(base, stages=(stage,))
    kinds = lambda plan: summary(executable(step, plan, (state, batch))  # noqa: E731
                                 .lower(state, batch).compile().as_text())
    assert "all-gather" not in kinds(base)
    assert "all-gather" in kinds(other)


def test_3d_mesh_matches_jit():
    state, batch = init()
    plan = mesh3d_plan(state, batch)
    (ref_state, ref_m), (got_state, got_m), ex = run_both(plan)
    assert_close(ref_m, got_m)
    assert_close(ref_state, got_state)
    params = specs_of(got_state["params"])
    assert params["w1"] == P("fsdp", "model") and params["w2"] == P("model", "fsdp")
    assert specs_of(ex.in_shardings[1])["x"] == P(("data", "fsdp"), None)


def test_lower_from_shape_dtype_structs_and_unspecified_outputs():
    state, batch = init()
    plan = data_parallel_plan(state, batch)
    abstract = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                                      (state, batch))
    ex = executable(step, plan, abstract)
    # the plan names only the loss among the outputs: the rest is jit's choice
    assert isinstance(ex.out_shardings[1]["loss"], NamedSharding)
    assert ex.out_shardings[0]["params"]["w1"] is None
    lowered = ex.lower(*abstract)
    assert isinstance(lowered, jax.stages.Lowered)
    assert "all-reduce" in summary(lowered.compile().as_text())
    # the same executable then runs concrete arguments with one program
    _, metrics = ex(state, batch)
    assert np.isfinite(float(metrics["loss"]))
    assert len(ex._cache) == 1


def test_donation_and_reuse_of_placed_outputs():
    state, batch = init()
    plan = data_parallel_plan(state, batch)
    ex = executable(step, plan, (state, batch))
    s1, _ = ex(state, batch)       # like jax.jit(donate_argnums=0): the state is consumed
    s2, _ = ex(s1, batch)          # placed outputs go straight in ...
    assert s1["params"]["w1"].is_deleted()           # ... and are donated
    assert not s2["params"]["w1"].is_deleted()
    assert not batch["x"].is_deleted()               # the batch is never donated

    keep = executable(step, plan, (s2, batch), donate_argnums=())
    keep(s2, batch)
    assert not s2["params"]["w1"].is_deleted()


def test_a_deleted_leaf_of_the_state_is_named_on_either_path():
    # (jit deletes the donated leaves it could alias, not necessarily the one
    # the fast path probes: a raw "Array has been deleted" before)
    state, batch = init()
    plan = data_parallel_plan(state, batch)
    ex = executable(step, plan, (state, batch))
    s1, _ = ex(state, batch)
    s2 = jax.tree.map(jnp.copy, s1)
    s2["params"]["b2"].delete()
    with pytest.raises(RuntimeStageError, match=r"argument 0\['params'\]\['b2'\] was donated"):
        ex(s2, batch)                           # the fast path
    _, half = init(batch=BATCH // 2)
    with pytest.raises(RuntimeStageError, match=r"argument 0\['params'\]\['b2'\] was donated"):
        ex(s2, half)                            # another shape: the full path
    # (a ValueError too, as jax raises for a deleted array; and the call that
    # took it may have been another function's: sweep X)
    with pytest.raises(ValueError, match="of this step or of another jitted function"):
        ex(s2, batch)


def test_batch_not_divisible_by_the_mesh_is_a_clear_error():
    state, batch = init()
    plan = data_parallel_plan(state, batch)
    _, odd = init(batch=12)
    with pytest.raises(StalePlanError, match="not divisible by 8") as info:
        executable(step, plan, (state, odd))
    assert isinstance(info.value, MeshplanError)
    assert "['x']" in str(info.value)
    ex = executable(step, plan, (state, batch))
    with pytest.raises(StalePlanError, match="12 is not divisible by 8"):
        ex(state, odd)


def test_constraint_of_wrong_rank_is_stale():
    state, batch = init()
    plan = megatron_plan(state, batch)
    tid = hidden_tensor(state, batch)
    stage = dataclasses.replace(plan.stages[0], constraints=((tid, ("data",)),))
    with pytest.raises(StalePlanError, match="constraint on tensor"):
        executable(step, dataclasses.replace(plan, stages=(stage,)), (state, batch))


def test_a_host_batch_on_later_calls_compiles_the_step_once():
    # the first call places everything; later calls go by the fast path,
    # which must place the batch too or jit keys a second program on it
    m = build_model("gpt", {"layers": 1, "hidden": 32, "heads": 2, "seq_len": 8, "vocab": 32,
                            "batch": 8})
    state, batch = m.init(0)
    step = meshplan.parallelize(m.train_step, method=meshplan.ShardParallel(mesh_shape=(4, 2)))
    for _ in range(3):
        state, _ = step(state, batch)
    (executable,) = [e for _, e in step._cache.values()]
    assert executable._last.jitted._cache_size() == 1


def test_scalars_and_host_arrays_besides_the_batch_compile_the_step_once():
    # a learning rate passed as a Python float, numpy scale, uncommitted
    # array, fresh each call: the fast path places them as the first call did
    def step(p, x, lr, scale, shift):
        loss, g = jax.value_and_grad(lambda p: jnp.mean(jnp.tanh(x @ p["w"] * scale + shift) ** 2))(p)
        return jax.tree.map(lambda a, b: a - lr * b, p, g), loss
    p = {"w": jnp.ones((32, 32)) * 0.1}
    run = meshplan.parallelize(step, method=meshplan.ShardParallel(), donate_argnums=(0,))
    for i in range(3):
        p, _ = run(p, jnp.ones((16, 32)), 0.1 / (i + 1), np.float32(2.0), jnp.zeros(32))
    (executable,) = [e for _, e in run._cache.values()]
    assert executable._last.jitted._cache_size() == 1


def test_a_one_device_plan_compiles_the_step_once():
    # the state from init sits on device 0 with a SingleDeviceSharding that is
    # equivalent to the plan's; passed through as it is, its type differs from
    # the step's outputs and the second call would trace and compile again
    m = build_model("gpt", {"layers": 1, "hidden": 32, "heads": 2, "seq_len": 8, "vocab": 32,
                            "batch": 8})
    state, batch = m.init(0)
    one = dataclasses.replace(meshplan.ClusterSpec.local(), num_hosts=1, devices_per_host=1)
    step = meshplan.parallelize(m.train_step, cluster=one,
                                method=meshplan.Manual(dp=1, tp=1, pp=1))
    for _ in range(3):
        state, _ = step(state, batch)
    (executable,) = [e for _, e in step._cache.values()]
    assert executable._last.jitted._cache_size() == 1
