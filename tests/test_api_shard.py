"""meshplan.parallelize with one-stage plans: numerics against the plain step,
saved plans, stale plans, re-planning, lowering, odd shapes."""
import functools
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import meshplan
from meshplan.errors import InfeasiblePlanError, StalePlanError
from meshplan.models import build_model
from meshplan.runtime import parse_collectives

LOCAL = None


def local():
    global LOCAL
    if LOCAL is None:
        LOCAL = meshplan.Cluster.local()
    return LOCAL


def run_both(model, method, steps=3, **cfg):
    m = build_model(model, {k: str(v) for k, v in cfg.items()})
    state, batch = m.init(0)
    reference = jax.jit(m.train_step)
    step = meshplan.parallelize(m.train_step, cluster=local(), method=method,
                                batch_argnums=m.batch_argnums)
    ref, par = state, jax.tree.map(np.array, state)
    losses = []
    for _ in range(steps):
        ref, ref_metrics = reference(ref, batch)
        par, metrics = step(par, batch)
        losses.append((float(metrics["loss"]), float(ref_metrics["loss"])))
    return step, par, ref, losses


def assert_elementwise(par, ref, rtol=1e-5):
    """Every element within ``rtol`` of its tensor's scale.  A tensor near zero
    (a bias whose gradient cancels, e.g. before a batch norm) is judged against
    a floor: the largest magnitude anywhere in the new state (DESIGN.md)."""
    leaves = [np.asarray(b, np.float64) for b in jax.tree.leaves(ref)]
    floor = max((np.abs(b).max(initial=0.0) for b in leaves), default=0.0)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(par)[0], leaves):
        a = np.asarray(a, np.float64)
        scale = max(np.abs(b).max(initial=0.0), floor, 1e-30)
        err = np.abs(a - b).max(initial=0.0)
        assert err <= rtol * scale, (jax.tree_util.keystr(path), err, scale)


def assert_losses(losses, rtol=1e-5):
    for got, want in losses:
        assert abs(got - want) <= rtol * abs(want), (got, want)


MESHES = [(8,), (2, 4), (4, 2), (2, 2, 2)]
MODELS = ["mlp", "gpt", "moe", "wresnet"]
DEFAULT_CASES = [(m, MESHES[k]) for k, m in enumerate(MODELS)]
SLOW_CASES = [(m, s) for m in MODELS for s in MESHES if (m, s) not in DEFAULT_CASES]


def _case(model, shape):
    step, par, ref, losses = run_both(model, meshplan.ShardParallel(mesh_shape=shape),
                                      optimizer="sgd")
    assert step.plan.logical_mesh.shape == shape
    assert_losses(losses)
    assert_elementwise(par, ref)


# (wresnet, the slowest, runs with -m extended; convolutions against jit: test_fuzz_models,
# also -m extended)
@pytest.mark.parametrize("model, shape", [pytest.param(*c, marks=pytest.mark.extended)
                                          if c[0] == "wresnet" else c for c in DEFAULT_CASES])
def test_models_match_unparallelized_step(model, shape):
    _case(model, shape)


@pytest.mark.slow
@pytest.mark.parametrize("model, shape", SLOW_CASES)
def test_models_match_unparallelized_step_all_meshes(model, shape):
    _case(model, shape)


@pytest.mark.extended   # (sgd: test_models_match_unparallelized_step)
def test_adam_gpt_matches_within_adam_noise():
    # Adam divides by sqrt(v): gradients that cancel to rounding level flip the
    # sign of full-size updates (DESIGN.md, "JAX facts").  The loss must match
    # tightly; the state within a per-tensor norm bound.
    step, par, ref, losses = run_both("gpt", meshplan.ShardParallel(mesh_shape=(2, 4)))
    assert_losses(losses)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(par)[0], jax.tree.leaves(ref)):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        floor = 1e-3 * np.sqrt(b.size)   # one Adam step (lr) per element
        err = np.linalg.norm(a - b) / max(np.linalg.norm(b), floor)
        assert err <= 1e-3, (jax.tree_util.keystr(path), err)


def test_outputs_come_back_sharded_as_planned():
    m = build_model("mlp", {"optimizer": "sgd"})
    state, batch = m.init(0)
    step = meshplan.parallelize(m.train_step, cluster=local(),
                                method=meshplan.Manual(dp=2, tp=4))
    new_state, _ = step(state, batch)
    specs = dict(step.plan.stages[0].params)
    for path, leaf in jax.tree_util.tree_flatten_with_path(new_state)[0]:
        want = specs[jax.tree_util.keystr(path)]
        got = tuple(leaf.sharding.spec) + (None,) * (leaf.ndim - len(leaf.sharding.spec))
        assert got == tuple(want), (jax.tree_util.keystr(path), got, want)


def test_saved_plan_reloads_runs_identically_and_stale_plan_is_refused(tmp_path):
    m = build_model("gpt", {"optimizer": "sgd"})
    state, batch = m.init(0)
    live = meshplan.parallelize(m.train_step, cluster=local(), method=meshplan.ShardParallel(mesh_shape=(2, 4)))
    out_live, met_live = live(jax.tree.map(np.array, state), batch)
    path = tmp_path / "plan.json"
    path.write_text(live.plan.to_json())
    loaded = meshplan.Plan.from_json(path.read_text())
    assert loaded == live.plan
    saved = meshplan.parallelize(m.train_step, plan=loaded)
    out_saved, met_saved = saved(jax.tree.map(np.array, state), batch)
    assert float(met_saved["loss"]) == float(met_live["loss"])
    for a, b in zip(jax.tree.leaves(out_saved), jax.tree.leaves(out_live)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # another batch size -> another graph -> the plan is stale, and the
    # refusal names the leaves that differ (it gave fingerprints alone)
    m2 = build_model("gpt", {"optimizer": "sgd", "batch": "16"})
    s2, b2 = m2.init(0)
    with pytest.raises(StalePlanError, match="re-plan") as info:
        saved(s2, b2)
    assert ("argument 1['input_ids'] is int32[16,32] where the plan has int32[8,32]"
            in str(info.value))
    # another function of the same arguments: named, as the plan records it
    other = meshplan.parallelize(lambda s, b: m.train_step(s, {**b, "labels": b["input_ids"]}),
                                 plan=loaded)
    with pytest.raises(StalePlanError, match="the same arguments but other operations .*"
                                             "'train_step', this is '<lambda>'"):
        other(jax.tree.map(np.array, state), batch)
    # (a function of the same name: what differs is said, not the name; the
    # CLI's plan of --model mlp run with another activation: sweep C, stop 94)
    def train_step(s, b):
        return m.train_step(s, {**b, "labels": b["input_ids"]})
    with pytest.raises(StalePlanError, match=r"other operations \(the step's code or the model's "
                                             r"options differ\)"):
        meshplan.parallelize(train_step, plan=loaded)(jax.tree.map(np.array, state), batch)


def test_plan_json_has_the_contract_keys():
    m = build_model("mlp")
    p = meshplan.plan(m.train_step, *m.abstract_args, cluster=local(),
                      method=meshplan.DataParallel())
    d = json.loads(p.to_json())
    for key in ("format", "graph_fingerprint", "cluster", "method", "num_micro_batches",
                "schedule", "batch", "stages", "predicted"):
        assert key in d
    assert d["format"] == "meshplan.plan/1"
    for key in ("iteration_s", "tflops_per_device", "peak_memory_bytes", "comm_bytes_per_device"):
        assert key in d["predicted"]
    stage = d["stages"][0]
    for key in ("layers", "devices", "submesh", "logical_mesh", "remat", "params", "predicted"):
        assert key in stage
    state = m.abstract_args[0]
    want = {jax.tree_util.keystr(p_) for p_, _ in jax.tree_util.tree_flatten_with_path(state)[0]}
    assert set(stage["params"]) == want
    assert d["batch"]["['x']"] == ["data", None]
    assert all(all(x is None for x in spec) for spec in stage["params"].values())


def test_decorator_forms_replanning_and_lower():
    m = build_model("mlp", {"optimizer": "sgd"})
    state, batch = m.init(0)

    @meshplan.parallelize
    def step_a(state, batch):
        return m.train_step(state, batch)

    @meshplan.parallelize(method=meshplan.DataParallel(), cluster=local())
    def step_b(state, batch):
        return m.train_step(state, batch)

    la = step_a(jax.tree.map(np.array, state), batch)[1]["loss"]
    lb = step_b(jax.tree.map(np.array, state), batch)[1]["loss"]
    assert float(la) == pytest.approx(float(lb), rel=1e-6)
    first = step_b.plan
    # a new abstract signature plans again
    m2 = build_model("mlp", {"optimizer": "sgd", "batch": "32"})
    s2, b2 = m2.init(0)
    step_b(s2, b2)
    assert step_b.plan is not first and step_b.plan.graph_fingerprint != first.graph_fingerprint
    lowered = step_b.lower(s2, b2)
    assert isinstance(lowered, jax.stages.Lowered)
    kinds = {c.kind for c in parse_collectives(lowered.compile().as_text())}
    assert "all-reduce" in kinds   # data parallel: the gradients are summed


def test_data_parallel_refuses_indivisible_batch():
    m = build_model("mlp", {"batch": "12"})
    with pytest.raises(InfeasiblePlanError, match="divisible by 8"):
        meshplan.plan(m.train_step, *m.abstract_args, cluster=local(), method=meshplan.DataParallel())
    # (a key of 2 words among 16 rows: the leaves disagree; the batch divides)
    step, p, x = _residual_step()
    with pytest.raises(meshplan.MeshplanError, match=r"argument 1\['rng'\] has 2 rows"):
        meshplan.plan(lambda p, b: step(p, b["x"]), p, {"x": x, "rng": jax.random.PRNGKey(0)},
                      cluster=local(), method=meshplan.DataParallel())
    # (the parameters named as the batch by the default batch_argnums, every
    # leaf's dimension 0 divisible by 8: their rows were split as a batch's)
    params = {"w": jnp.ones((16, 32)), "b": jnp.zeros(32)}
    with pytest.raises(meshplan.MeshplanError, match=r"has 32 rows.*name the arguments that "
                       r"hold the batch in batch_argnums"):
        meshplan.plan(lambda x, p: jnp.tanh(x @ p["w"] + p["b"]), jnp.ones((64, 16)), params,
                      cluster=local(), method=meshplan.DataParallel())


@pytest.mark.extended
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hidden=st.sampled_from([8, 12, 24, 64]), layers=st.integers(1, 3),
       batch=st.sampled_from([4, 6, 8, 12, 16, 20]),
       mesh=st.sampled_from([(8,), (2, 4), (4, 2)]))
def test_random_mlps_plan_run_and_match(hidden, layers, batch, mesh):
    step, par, ref, losses = run_both("mlp", meshplan.ShardParallel(mesh_shape=mesh), steps=2,
                                      optimizer="sgd", hidden=hidden, layers=layers, batch=batch,
                                      in_dim=hidden + 4, out_dim=6)
    assert_losses(losses)
    assert_elementwise(par, ref)


def _small_step(state, batch, scale=1.0):
    loss, g = jax.value_and_grad(lambda w: jnp.mean((jnp.tanh(batch @ w) * scale) ** 2))(state)
    return state - 0.1 * g, {"loss": loss}


SMALL = (jnp.ones((8, 4)) * 0.1, jnp.linspace(-1, 1, 16 * 8).reshape(16, 8))


def test_the_step_takes_keyword_arguments_as_jax_jit_does():
    step = meshplan.parallelize(_small_step, cluster=local())
    by_name = step(SMALL[0], batch=SMALL[1], scale=0.5)
    by_place = step(*SMALL, 0.5)
    assert float(by_name[1]["loss"]) == float(by_place[1]["loss"])
    # and so do its other entry points (they took positions only)
    assert step.plan_for(SMALL[0], batch=SMALL[1], scale=0.5) is step.plan
    lowered = step.lower(SMALL[0], batch=SMALL[1], scale=0.5)
    assert lowered.as_text() == step.lower(*SMALL, 0.5).as_text()
    mesh, in_s, _ = step.shardings(SMALL[0], batch=SMALL[1], scale=0.5)
    assert len(in_s) == 3
    # a misspelt name is named, as jax.jit names it (not the argument it
    # then lacks: sweep X), and a missing one too, both TypeErrors
    with pytest.raises(TypeError, match="unexpected keyword argument 'btch'"):
        step(SMALL[0], btch=SMALL[1])
    with pytest.raises(TypeError, match="missing a required argument: 'batch'"):
        step(SMALL[0], scale=0.5)
    with pytest.raises(meshplan.MeshplanError, match="unexpected keyword argument"):
        step(SMALL[0], btch=SMALL[1])


def test_a_cluster_may_be_given_as_a_path_or_a_dict(tmp_path):
    path = tmp_path / "local.json"
    path.write_text(local().to_json())
    for cluster in (str(path), path, json.loads(local().to_json())):
        p = meshplan.plan(_small_step, *SMALL, cluster=cluster)
        assert p.cluster == local()


@pytest.mark.parametrize("kwargs,match", [
    (dict(method=meshplan.Auto), r"meshplan.Auto\(\), not the class"),
    (dict(cluster=8), "cluster= takes"),
    (dict(donate_argnums=(5,)), r"donate_argnums=\(5,\) names an argument"),
    (dict(donate_argnums="state"), "give an int, a sequence of ints"),
    (dict(donate_argnums=-1), "counted from 0"),
    # (refused before planning, where the plan was made and then refused: sweep X)
    (dict(cluster=str(pathlib.Path(__file__).resolve().parents[1] / "examples" / "clusters"
                      / "dgx-a100-x8.json")),
     "has 64 devices, but only 8 are available here to run on; to plan for it without running"),
    (dict(batch_argnums=-1), r"batch_argnums=-1: give the batch arguments' positions counted "
                             r"from 0"),
])
def test_bad_arguments_are_one_clear_error(kwargs, match):
    with pytest.raises(meshplan.MeshplanError, match=match):
        meshplan.parallelize(_small_step, **kwargs)(*SMALL)


@pytest.mark.parametrize("option, match", [
    ("static_argnums", r"functools.partial\(step"), ("static_argnames", "functools.partial"),
    ("donate_argnames", r"donate_argnums=\(0,\)"), ("in_shardings", "plan="),
    ("no_such_option", "it takes cluster=, method="),
])
def test_jax_jit_options_are_refused_with_what_to_do(option, match):
    # (a bare "unexpected keyword argument" before: sweep X)
    with pytest.raises(TypeError, match=match):
        meshplan.parallelize(_small_step, **{option: 1})
    with pytest.raises(TypeError, match=match):
        meshplan.parallelize(**{option: 1})      # (as a decorator with arguments)
    with pytest.raises(meshplan.MeshplanError):  # (meshplan's kind of error too)
        meshplan.parallelize(_small_step, **{option: 1})


@pytest.mark.parametrize("make,match", [
    (lambda: meshplan.ShardParallel(mesh_shape=8), "give a tuple of positive ints"),
    (lambda: meshplan.ShardParallel(mesh_shape=(2, 4), axis_names=("a", "a")), "distinct"),
    (lambda: meshplan.ShardParallel(mesh_shape=(2, 4), axis_names=("a",)), "names 1 mesh axes"),
    (lambda: meshplan.PipeshardParallel(stages="three"), "use 'auto'"),
    (lambda: meshplan.ShardParallel(backend="gurobi"), "use 'highs' or 'cbc'"),
    (lambda: meshplan.Auto(time_limit=0), "more than 0"),
    (lambda: meshplan.ShardParallel(mesh_shape=(3, 2)).request(8), r"whose product is 8"),
])
def test_bad_method_values_are_refused_where_they_are_written(make, match):
    # (a repeated axis name was planned, then crashed XLA's partitioner)
    with pytest.raises(meshplan.MeshplanError, match=match):
        make()


@pytest.mark.parametrize("transform", [jax.jit, jax.vmap, lambda f: functools.partial(
    jax.eval_shape, f)], ids=["jit", "vmap", "eval_shape"])
def test_a_parallelized_step_under_a_jax_transformation_says_what_to_do(transform):
    step = meshplan.parallelize(_small_step, cluster=local())
    args = SMALL if transform is not jax.vmap else tuple(x[None] for x in SMALL)
    with pytest.raises(meshplan.MeshplanError, match="cannot be traced by jax.jit"):
        transform(step)(*args)


def test_a_model_too_big_for_a_tiny_device_says_how_big_in_readable_units():
    # ("needs at least 0.00 GiB ... the budget is 0.00 GiB" before)
    cluster = json.loads(local().to_json())
    cluster["device"]["memory_bytes"] = 100
    with pytest.raises(InfeasiblePlanError, match=r"at least 6\.50 KiB per device .* budget is 90 B"):
        meshplan.plan(_small_step, jnp.ones((64, 64)), jnp.ones((16, 64)), cluster=cluster)


def _residual_step(extra=lambda h: h):
    def step(p, x):
        def loss(p):
            h = extra(jnp.tanh(x @ p["w0"]))
            return jnp.mean((h @ p["w1"]) ** 2)
        value, g = jax.value_and_grad(loss)(p)
        return jax.tree.map(lambda a, b: a - 0.1 * b, p, g), value
    p = {"w0": jnp.ones((64, 256)) / 64, "w1": jnp.ones((256, 64)) / 256}
    return step, p, jnp.ones((64, 64))


@pytest.mark.parametrize("use", ["constraint", "shard_map"])
def test_the_steps_own_mesh_over_the_same_devices_in_another_order_runs(use):
    """jit runs a program on one device order: the plan's mesh (devices by
    id) beside the step's own over the same devices reversed failed inside
    the runtime with jax's "incompatible devices"; the plan's mesh now takes
    the step's order."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    mesh = Mesh(np.array(jax.devices()[::-1]).reshape(4, 2), ("data", "model"))
    if use == "constraint":
        def inner(h):
            return jax.lax.with_sharding_constraint(h, NamedSharding(mesh, P("data", None)))
    else:
        inner = jax.shard_map(lambda h: h * 2.0, mesh=mesh, in_specs=P("data"),
                              out_specs=P("data"))
    step, p, x = _residual_step(inner)
    for method in (meshplan.ShardParallel(), meshplan.Manual(dp=4, tp=2)):
        got, ref = meshplan.parallelize(step, method=method)(p, x), jax.jit(step)(p, x)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


def test_steps_jax_runs_only_otherwise_are_refused_in_one_line():
    from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P
    # inside set_mesh of a mesh with Explicit axes (jax.make_mesh's default)
    step, p, x = _residual_step()
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    with jax.set_mesh(mesh), pytest.raises(meshplan.MeshplanError, match="Explicit axes"):
        meshplan.parallelize(step)(p, x)
    # a constraint on a mesh of 4 of the 8 devices
    four = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("a", "b"))
    step, p, x = _residual_step(
        lambda h: jax.lax.with_sharding_constraint(h, NamedSharding(four, P("a", None))))
    with pytest.raises(meshplan.errors.RuntimeStageError, match="on 4 devices of a mesh of its own"):
        meshplan.parallelize(step)(p, x)
    # an ordered print: jax runs ordered effects on one device only
    step, p, x = _residual_step(lambda h: (jax.debug.print("{}", h.sum(), ordered=True), h)[1])
    with pytest.raises(meshplan.MeshplanError, match="ordered=True"):
        meshplan.parallelize(step)(p, x)


def test_a_leaf_that_is_no_array_is_named_by_its_path():
    # (an equinox module's activation function left in the state)
    def step(state, b):
        return state, jnp.mean(state["act"](b @ state["w"]))
    state = {"w": jnp.ones((4, 2)), "act": jax.nn.relu}
    with pytest.raises(meshplan.errors.TraceError,
                       match=r"argument 0\['act'\] is a custom_jvp, not an array.*eqx.partition"):
        meshplan.parallelize(step)(state, jnp.ones((8, 4)))


def test_a_step_that_needs_its_arguments_explicit_shardings_says_meshplan_drops_them():
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    mesh = jax.make_mesh((8,), ("d",), axis_types=(AxisType.Explicit,))
    # (the matmul's gradient contracts the rows split on "d": jax.jit asks
    # for an out_sharding unless the arguments' types carry theirs)
    step, p, x = _residual_step(
        lambda h: jax.sharding.reshard(h, NamedSharding(mesh, P("d", None))))
    typed = jax.device_put((p, x), (NamedSharding(mesh, P()), NamedSharding(mesh, P("d"))))
    jax.jit(step)(*typed)
    with pytest.raises(Exception) as e:
        meshplan.parallelize(step, method=meshplan.ShardParallel())(*typed)
    assert "argument 0['w0'] has a sharding on a mesh with Explicit axes" in \
        "".join(getattr(e.value, "__notes__", ()))


def test_a_constraint_of_the_steps_own_is_no_replicated_work():
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
    step, p, x = _residual_step(
        lambda h: jax.lax.with_sharding_constraint(h, NamedSharding(mesh, P("data", None))))
    got = meshplan.parallelize(step, method=meshplan.ShardParallel())
    (_, loss), (_, ref) = got(p, x), jax.jit(step)(p, x)
    assert float(loss) == pytest.approx(float(ref), rel=1e-5)
    assert not any("sharding_constraint" in n for n in got.plan.notes)


def test_a_steps_own_shard_map_runs_as_written_and_is_refused_by_pipelines():
    import warnings
    from jax.sharding import Mesh, PartitionSpec as P
    mesh = Mesh(np.array(jax.devices()), ("data",))

    def step(p, x):
        def loss(p):
            def local(p, x):
                return jax.lax.pmean(jnp.mean(jnp.tanh(x @ p["w0"]) @ p["w1"]) ** 2, "data")
            return jax.shard_map(local, mesh=mesh, in_specs=(P(), P("data")), out_specs=P())(p, x)
        value, g = jax.value_and_grad(loss)(p)
        return jax.tree.map(lambda a, b: a - 0.1 * b, p, g), value
    _, p, x = _residual_step()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = meshplan.parallelize(step, method=meshplan.ShardParallel())
        (_, loss), (_, ref) = got(p, x), jax.jit(step)(p, x)
    assert float(loss) == pytest.approx(float(ref), rel=1e-5)
    said = [str(w.message) for w in caught if "meshplan" in str(w.message)]
    assert any("shard_map runs as written" in w for w in said)
    assert not any("replicated" in w for w in said), said
    with pytest.raises(meshplan.MeshplanError, match="jax.shard_map on a mesh of its own"):
        meshplan.plan(step, p, x, method=meshplan.Manual(dp=2, tp=2, pp=2, num_micro_batches=2))


@pytest.mark.parametrize("batch_argnums", [(), (1,)])
def test_auto_plans_one_program_for_a_step_without_one_batch(batch_argnums):
    # (a graph's nodes beside its edges: no batch to cut into micro-batches;
    # Auto was refused where ShardParallel ran)
    def step(w, g):
        def loss(w):
            h = g["nodes"] @ w
            agg = jax.ops.segment_sum(h[g["senders"]], g["receivers"], num_segments=h.shape[0])
            return jnp.mean((agg.sum(1) - g["y"]) ** 2)
        value, grad = jax.value_and_grad(loss)(w)
        return w - 0.01 * grad, value
    g = {"nodes": jnp.linspace(-1, 1, 32 * 8).reshape(32, 8), "senders": jnp.arange(64) % 32,
         "receivers": (jnp.arange(64) * 7) % 32, "y": jnp.ones(32)}
    w = jnp.full((8, 16), 0.1)
    par = meshplan.parallelize(step, method=meshplan.Auto(), batch_argnums=batch_argnums)
    (got, lg), (want, lw) = par(w, g), jax.jit(step)(w, g)
    assert len(par.plan.stages) == 1 and par.plan.num_micro_batches == 1
    assert any("no one batch to split" in n for n in par.plan.notes)
    np.testing.assert_allclose(float(lg), float(lw), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-7)


def test_a_python_flag_passed_as_an_argument_is_explained():
    # (jax.jit's static_argnums idiom: meshplan traces every argument)
    step, p, x = _residual_step()

    def flagged(p, x, double):
        new, value = step(p, x)
        return new, (value * 2 if double else value)
    for fn in (flagged, jax.jit(flagged, static_argnums=2)):
        with pytest.raises((ValueError, TypeError)) as e:
            meshplan.parallelize(fn)(p, x, True)
        assert any("functools.partial" in n for n in getattr(e.value, "__notes__", ())), e.value
    par = meshplan.parallelize(functools.partial(flagged, double=True))
    np.testing.assert_allclose(float(par(p, x)[1]), 2 * float(jax.jit(step)(p, x)[1]), rtol=1e-5)


@pytest.mark.parametrize("method", [meshplan.ShardParallel(mesh_shape=(8,)), meshplan.Auto()])
def test_batch_argnums_naming_the_parameters_is_warned_of_where_it_plans(method):
    # (sweep X: the plan listed the parameters as the batch and said nothing;
    # the methods that split a batch refuse it.  Auto plans one program and
    # said so only in a note: sweep A of stop 94)
    import warnings
    f32 = jnp.float32
    params = {"w1": jax.ShapeDtypeStruct((16, 32), f32), "b1": jax.ShapeDtypeStruct((32,), f32)}
    batch = {"x": jax.ShapeDtypeStruct((8, 16), f32)}

    def step(p, b):
        g = jax.grad(lambda p: jnp.sum(jnp.tanh(b["x"] @ p["w1"] + p["b1"])))(p)
        return jax.tree.map(lambda a, c: a - 0.1 * c, p, g)
    for argnums, warned in ((0, True), (1, False)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            meshplan.plan(step, params, batch, cluster=local(), batch_argnums=argnums,
                          method=method)
        said = [str(w.message) for w in caught if "disagree on the batch size" in str(w.message)]
        assert bool(said) == warned, said
        if warned:
            assert "argument 0['b1'] has 32 rows, argument 0['w1'] has 16" in said[0]


def test_plan_arguments_name_each_leaf_by_position():
    # (bare-array arguments: the params and batch sections both key their one
    # argument "", and the record kept only the batch's: sweep V2)
    def step(w, x):
        l, g = jax.value_and_grad(lambda w: jnp.mean((x @ w) ** 2))(w)
        return w - 0.1 * g, l
    w, x = jnp.ones((8, 4)), jnp.ones((16, 8))
    p = meshplan.plan(step, w, x, cluster=local(), method=meshplan.ShardParallel())
    assert dict(p.arguments) == {"argument 0": "float32[8,4]", "argument 1": "float32[16,8]"}
    assert meshplan.Plan.from_json(p.to_json()).arguments == p.arguments
    with pytest.raises(StalePlanError, match=r"argument 0 is float32\[8,2\] where the plan "
                                             r"has float32\[8,4\]"):
        meshplan.parallelize(step, plan=p)(jnp.ones((8, 2)), x)
