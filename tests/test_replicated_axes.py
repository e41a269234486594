"""A one-stage plan says so when it runs most of the step's FLOPs
identically on every device of a mesh axis (no silent replication of work):
the ILP may find that splitting a tiny step costs more in collectives than
it saves, and the user should hear that the devices along that axis repeat
each other's work."""
import re

import jax
import jax.numpy as jnp

import meshplan
from meshplan.ilp.replicated import REPLICATED_AXIS_SHARE


def _step(rows: int):
    def loss(w, x):
        return jnp.mean(jnp.tanh(x @ w[0]) @ w[1])

    def step(w, x):
        return w - 0.1 * jax.grad(loss)(w, x)
    w = jax.ShapeDtypeStruct((2, 256, 256), jnp.float32)
    return step, w, jax.ShapeDtypeStruct((rows, 256), jnp.float32)


def _notes(rows: int, method) -> list[str]:
    step, w, x = _step(rows)
    plan = meshplan.plan(step, w, x, method=method, batch_argnums=(1,))
    return [n for n in plan.notes if n.startswith("replicated work")]


def test_a_step_too_small_to_split_says_which_axis_repeats_it():
    # one row: nothing to split along the batch, and a 256x256 matmul is
    # cheaper whole than any collective that splitting it would need
    (note,) = _notes(1, meshplan.ShardParallel(mesh_shape=(8,)))
    assert "mesh axis x" in note and "8 devices" in note and "fewer devices" in note
    share = float(note.split("% of the operators")[0].split()[-1]) / 100
    assert REPLICATED_AXIS_SHARE <= share <= 1.0


def test_a_data_parallel_plan_has_no_such_note():
    assert _notes(512, meshplan.ShardParallel(mesh_shape=(8,))) == []


def test_auto_notes_only_the_axes_of_the_mesh_it_chose():
    # Auto compares the searched plans (hand plans on data x model meshes
    # among them) with the whole-graph plan; the note of a plan it passed
    # over named a mesh axis ("model") the chosen plan (mesh x=8) lacks
    import optax
    tx = optax.adam(1e-2)
    dims = [32, 64, 64, 64, 32]
    p = {f"l{i}": {"w": jax.ShapeDtypeStruct((dims[i], dims[i + 1]), jnp.float32),
                   "b": jax.ShapeDtypeStruct((dims[i + 1],), jnp.float32)} for i in range(4)}

    def loss(p, b):
        h = b["x"]
        for i in range(4):
            h = h @ p[f"l{i}"]["w"] + p[f"l{i}"]["b"]
            h = jnp.tanh(h) if i < 3 else h
        return jnp.mean((h - b["y"]) ** 2)

    def step(s, b):
        value, g = jax.value_and_grad(loss)(s["params"], b)
        u, o = tx.update(g, s["opt"], s["params"])
        return {"params": optax.apply_updates(s["params"], u), "opt": o}, {
            "loss": value, "gnorm": optax.tree.norm(g)}
    state = {"params": p, "opt": jax.eval_shape(tx.init, p)}
    batch = {k: jax.ShapeDtypeStruct((16, 32), jnp.float32) for k in ("x", "y")}
    plan = meshplan.plan(step, state, batch, method=meshplan.Auto(), batch_argnums=(1,),
                         cluster=meshplan.Cluster.local())
    axes = {a for s in plan.stages for a in s.logical_mesh.axes}
    for note in (n for n in plan.notes if n.startswith("replicated work")):
        assert set(re.findall(r"mesh axis (\w+)", note)) <= axes, (note, axes)


def test_a_mesh_axis_that_divides_no_dimension_is_named_as_the_cause():
    # every size is 7, 16 or 64, none divisible by 3: no layout could split
    # the work over 3 devices, and the note said none was predicted faster
    def step(w, x):
        return w - 0.1 * jax.grad(lambda w: jnp.mean(jnp.tanh(x @ w[0]) @ w[1].T))(w)
    w = jax.ShapeDtypeStruct((2, 16, 64), jnp.float32)
    x = jax.ShapeDtypeStruct((7, 16), jnp.float32)
    # (the same step with 6 rows can split them: the first wording)
    for rows, cause in ((7, "none of their dimensions divides by 3"),
                        (6, "no layout that splits them was predicted faster")):
        plan = meshplan.plan(step, w, jax.ShapeDtypeStruct((rows, 16), jnp.float32),
                             method=meshplan.ShardParallel(mesh_shape=(3,)), batch_argnums=(1,),
                             cluster=meshplan.Cluster.local().with_devices(1, 3))
        (note,) = [n for n in plan.notes if n.startswith("replicated work")]
        assert "3 devices" in note and cause in note, note


def _mlp_step():
    import optax
    tx = optax.adam(1e-2)
    p = {"w1": jax.ShapeDtypeStruct((32, 64), jnp.float32),
         "w2": jax.ShapeDtypeStruct((64, 64), jnp.float32),
         "w3": jax.ShapeDtypeStruct((64, 8), jnp.float32)}

    def loss(p, b):
        h = jnp.tanh(jnp.tanh(b["x"] @ p["w1"]) @ p["w2"])
        return jnp.mean((h @ p["w3"] - b["y"]) ** 2)

    def step(s, b):
        value, g = jax.value_and_grad(loss)(s["params"], b)
        u, o = tx.update(g, s["opt"], s["params"])
        return {"params": optax.apply_updates(s["params"], u), "opt": o}, {"loss": value}
    return step, {"params": p, "opt": jax.eval_shape(tx.init, p)}


def test_plans_of_the_stage_search_say_so_too():
    # Auto's one-stage plan from the stage search (batch 12 on 8 devices: all
    # replicated) carried no note, nor did a pipeline's stages
    step, state = _mlp_step()
    batch = {"x": jax.ShapeDtypeStruct((12, 32), jnp.float32),
             "y": jax.ShapeDtypeStruct((12, 8), jnp.float32)}
    plan = meshplan.plan(step, state, batch, method=meshplan.Auto(), batch_argnums=(1,),
                         cluster=meshplan.Cluster.local())
    (note,) = [n for n in plan.notes if n.startswith("replicated work")]
    mesh = plan.stages[0].logical_mesh
    said = re.findall(r"(\d+) devices of mesh axis (\w+)", note)
    assert said and all(dict(zip(mesh.axes, mesh.shape))[a] == int(n) for n, a in said), note
    # a pipeline of two stages on 3 devices each: nothing divides by 3
    batch = {"x": jax.ShapeDtypeStruct((8, 32), jnp.float32),
             "y": jax.ShapeDtypeStruct((8, 8), jnp.float32)}
    plan = meshplan.plan(step, state, batch, method=meshplan.Manual(tp=3, pp=2),
                         batch_argnums=(1,), cluster=meshplan.Cluster.local().with_devices(1, 6))
    (note,) = [n for n in plan.notes if n.startswith("replicated work")]
    assert "stage 0: " in note and "stage 1: " in note, note
    assert "none of their dimensions divides by 3" in note, note
