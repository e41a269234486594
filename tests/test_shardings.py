"""Plan.shardings and ``meshplan plan --emit python``: the plan taken out of
meshplan into a plain ``jax.jit`` gives parallelize's numbers."""
import dataclasses
import runpy

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import meshplan
from meshplan.cli import main
from meshplan.errors import StalePlanError
from meshplan.models import build_model
from meshplan.tools.snippet import python_snippet

GPT = {"layers": "2", "hidden": "32", "heads": "2", "seq_len": "16", "vocab": "64", "batch": "8"}


@pytest.fixture(scope="module")
def gpt():
    return build_model("gpt", GPT)


@pytest.fixture(scope="module")
def plan(gpt):
    # data and tensor parallel both: the specs name two mesh axes
    return meshplan.plan(gpt.train_step, *gpt.abstract_args, cluster=meshplan.Cluster.local(),
                         method=meshplan.Manual(dp=4, tp=2))


@pytest.fixture(scope="module")
def reference(gpt, plan):
    """Two steps of parallelize under ``plan``: [(new state, metrics), ...]."""
    state, batch = gpt.init(0)
    step = meshplan.parallelize(gpt.train_step, plan=plan)
    out, s = [], jax.tree.map(np.array, state)
    for _ in range(2):
        s, metrics = step(s, batch)
        out.append(jax.device_get((s, metrics)))
    return out


def run_two_steps(jitted, state, batch):
    out, s = [], state
    for _ in range(2):
        s, metrics = jitted(s, batch)
        out.append(jax.device_get((s, metrics)))
    return out


def assert_same(got, want, rtol=1e-6):
    """Every leaf within ``rtol`` of its tensor's scale, a tensor near zero
    judged against the largest magnitude of the tree (DESIGN.md: Adam turns
    rounding noise of vanishing gradients into update-sized differences)."""
    for (g_state, g_metrics), (w_state, w_metrics) in zip(got, want):
        loss, ref = float(g_metrics["loss"]), float(w_metrics["loss"])
        assert abs(loss - ref) <= rtol * abs(ref), (loss, ref)
        assert jax.tree.structure(g_state) == jax.tree.structure(w_state)
        leaves = [np.asarray(b, np.float64) for b in jax.tree.leaves(w_state)]
        floor = max(np.abs(b).max(initial=0.0) for b in leaves)
        for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(g_state)[0], leaves):
            err = np.abs(np.asarray(a, np.float64) - b).max(initial=0.0)
            scale = max(np.abs(b).max(initial=0.0), floor)
            assert err <= rtol * scale, (jax.tree_util.keystr(path), err, scale)


def test_plain_jit_with_the_plans_shardings_matches_parallelize(gpt, plan, reference):
    state, batch = gpt.init(0)
    mesh, in_s, out_s = plan.shardings(state, batch, step=gpt.train_step)
    jitted = jax.jit(gpt.train_step, in_shardings=in_s, out_shardings=out_s)
    assert_same(run_two_steps(jitted, state, batch), reference)
    # the new state comes back where the next step wants it
    new_state, _ = jitted(state, batch)
    for got, want in zip(jax.tree.leaves(new_state), jax.tree.leaves(in_s[0])):
        assert got.sharding.is_equivalent_to(want, got.ndim)


def test_shardings_have_the_arguments_structure_and_the_plans_specs(gpt, plan):
    args = gpt.abstract_args
    mesh, in_s, out_s = plan.shardings(*args, step=gpt.train_step)
    st = plan.stages[0]
    assert dict(mesh.shape) == dict(zip(st.logical_mesh.axes, st.logical_mesh.shape))
    assert [d.id for d in mesh.devices.flat] == list(st.devices)
    assert len(in_s) == len(args)
    tables = (dict(st.params), dict(plan.batch))
    split = 0
    for arg, shardings, table in zip(args, in_s, tables):
        assert jax.tree.structure(shardings) == jax.tree.structure(arg)
        for (path, _), sh in zip(jax.tree_util.tree_flatten_with_path(arg)[0],
                                 jax.tree.leaves(shardings)):
            assert isinstance(sh, NamedSharding) and sh.mesh == mesh
            assert sh.spec == P(*table[jax.tree_util.keystr(path)])
            split += bool(sh.spec and any(sh.spec))
    assert split       # (the plan splits something: the check is not vacuous)
    # outputs: shaped like the step's output, the planned spec or None (jit chooses)
    outs = dict(st.outputs)
    out_tree = jax.eval_shape(gpt.train_step, *args)
    flat_out = jax.tree_util.tree_flatten_with_path(out_tree)[0]
    flat_sh = jax.tree.leaves(out_s, is_leaf=lambda x: x is None)
    assert len(flat_sh) == len(flat_out) and any(s is not None for s in flat_sh)
    for (path, _), sh in zip(flat_out, flat_sh):
        spec = outs.get(jax.tree_util.keystr(path))
        assert (sh is None) if spec is None else (sh.spec == P(*spec))
    # without the step the outputs are left to jit
    assert plan.shardings(*args)[2] is None


def test_parallelize_wrapper_gives_the_same_shardings(gpt, plan):
    state, batch = gpt.init(0)
    step = meshplan.parallelize(gpt.train_step, plan=plan)
    mesh, in_s, out_s = step.shardings(state, batch)
    assert step.plan is plan
    want = plan.shardings(state, batch, step=gpt.train_step)
    assert mesh == want.mesh
    assert jax.tree.leaves(in_s) == jax.tree.leaves(want.in_shardings)
    assert (jax.tree.leaves(out_s, is_leaf=lambda x: x is None)
            == jax.tree.leaves(want.out_shardings, is_leaf=lambda x: x is None))


def test_emitted_snippet_runs_without_meshplan_and_matches(gpt, plan, reference, tmp_path):
    text = python_snippet(plan, len(gpt.abstract_args))
    imports = [line for line in text.splitlines() if line.startswith(("import ", "from "))]
    assert imports and not any("meshplan" in line for line in imports)
    path = tmp_path / "shard_plan.py"
    path.write_text(text)
    module = runpy.run_path(str(path), run_name="shard_plan")    # (not __main__)
    state, batch = gpt.init(0)
    jitted = module["jit_step"](gpt.train_step, state, batch)
    assert_same(run_two_steps(jitted, state, batch), reference)
    # the snippet's shardings are the plan's
    mesh = module["make_mesh"]()
    in_s = tuple(module["shardings_like"](a, s, mesh)
                 for a, s in zip((state, batch), module["IN_SPECS"]))
    assert jax.tree.leaves(in_s) == jax.tree.leaves(plan.shardings(state, batch).in_shardings)
    with pytest.raises(ValueError, match="2 argument"):
        module["jit_step"](gpt.train_step, state)
    # the state one level deeper: refused, where every layout was dropped
    # and the step ran replicated without a word (sweep X)
    with pytest.raises(ValueError, match="argument leaves these arguments lack"):
        module["jit_step"](lambda s, b: gpt.train_step(s["inner"], b), {"inner": state}, batch)
    # ... and a step returning another structure is told so
    with pytest.raises(ValueError, match="output leaves the step does not return"):
        module["jit_step"](lambda s, b: gpt.train_step(s, b)[0], state, batch)


def test_cli_emit_python(tmp_path, capsys):
    argv = ["-q", "plan", "--model", "mlp", "--model-arg", "layers=2", "--cluster", "local",
            "--method", "manual", "--dp", "8", "--emit", "python"]
    assert main(argv + ["--json", str(tmp_path / "plan.json")]) == 0
    out, err = capsys.readouterr()
    # stdout is the snippet alone: it compiles, and the plan printout is not in it
    compile(out, "snippet", "exec")
    assert "jax.jit(train_step" in out and "Plan for" not in out
    assert "plan written to" in err
    assert main(argv + ["--emit-out", str(tmp_path / "s.py")]) == 0
    out, _ = capsys.readouterr()
    assert out.startswith("Plan for") and "python snippet written to" in out
    m = build_model("mlp", {"layers": "2"})
    state, batch = m.init(0)
    module = runpy.run_path(str(tmp_path / "s.py"), run_name="s")
    _, metrics = module["jit_step"](m.train_step, state, batch)(state, batch)
    _, want = jax.jit(m.train_step)(state, batch)
    assert abs(float(metrics["loss"]) - float(want["loss"])) <= 1e-6 * abs(float(want["loss"]))


@pytest.mark.parametrize("argv, needle", [
    (["--emit-out", "x.py"], "add --emit python"),
    (["--emit", "python", "--method", "manual", "--dp", "4", "--pp", "2", "--micro-batches", "2"],
     "one-stage plans"),
])
def test_cli_emit_refusals_are_one_line(argv, needle, capsys):
    assert main(["-q", "plan", "--model", "mlp", "--model-arg", "layers=2",
                 "--cluster", "local"] + argv) == 2
    out, err = capsys.readouterr()
    assert needle in err and len(err.strip().splitlines()) == 1 and out == ""


def test_pipeline_plan_gives_one_triple_per_stage():
    m = build_model("mlp", {"layers": "4"})
    p = meshplan.plan(m.train_step, *m.abstract_args, cluster=meshplan.Cluster.local(),
                      method=meshplan.Manual(dp=2, tp=2, pp=2, num_micro_batches=2))
    assert len(p.stages) == 2
    state, batch = m.abstract_args
    triples = p.shardings(state, batch, step=m.train_step)
    assert len(triples) == 2
    held = set()
    for st, (mesh, (s_state, s_batch), out_s) in zip(p.stages, triples):
        assert [d.id for d in mesh.devices.flat] == list(st.devices)
        table = dict(st.params)
        for (path, _), sh in zip(jax.tree_util.tree_flatten_with_path(state)[0],
                                 jax.tree.leaves(s_state, is_leaf=lambda x: x is None)):
            key = jax.tree_util.keystr(path)
            if key in table:
                assert sh.mesh == mesh and sh.spec == P(*table[key])
                held.add(key)
            else:
                assert sh is None           # another stage's leaf
        assert jax.tree.structure(s_batch) == jax.tree.structure(batch)
        assert all(sh.mesh == mesh for sh in jax.tree.leaves(s_batch))
        assert all(s is None for s in jax.tree.leaves(out_s, is_leaf=lambda x: x is None))
    assert held == {jax.tree_util.keystr(path)
                    for path, _ in jax.tree_util.tree_flatten_with_path(state)[0]}


def test_arguments_the_plan_was_not_made_for_are_refused(gpt, plan):
    state, batch = gpt.abstract_args
    with pytest.raises(StalePlanError, match="step of 2 argument"):
        plan.shardings(state)
    pruned = dict(state, params={k: v for k, v in state["params"].items()
                                 if k != sorted(state["params"])[0]})
    with pytest.raises(StalePlanError, match="arguments lack"):
        plan.shardings(pruned, batch)
    odd = jax.tree.map(lambda x: jax.ShapeDtypeStruct((6,) + x.shape[1:], x.dtype), batch)
    with pytest.raises(StalePlanError, match="not divisible"):
        plan.shardings(state, odd)
    # a plan for devices this machine lacks names them
    elsewhere = dataclasses.replace(plan, stages=(dataclasses.replace(
        plan.stages[0], devices=tuple(range(8, 16))),))
    with pytest.raises(meshplan.MeshplanError, match="only 8 devices are available"):
        elsewhere.shardings(state, batch)


@pytest.mark.parametrize("method", [meshplan.ShardParallel(remat="full"),
                                    meshplan.Manual(dp=4, tp=2, remat="full")])
def test_a_recomputing_one_stage_plans_shardings_run_step_after_step(gpt, method):
    # (priced by the stage DP, whose plans recorded no output layouts: jit
    # chose its own, and the second step refused the state it returned)
    plan = meshplan.plan(gpt.train_step, *gpt.abstract_args, cluster=meshplan.Cluster.local(),
                         method=method)
    state, batch = gpt.init(0)
    mesh, in_s, out_s = plan.shardings(state, batch, step=gpt.train_step)
    assert all(s is not None for s in jax.tree.leaves(out_s[0]))
    jitted = jax.jit(gpt.train_step, in_shardings=in_s, out_shardings=out_s)
    s = jax.device_put(state, in_s[0])
    for _ in range(2):
        s, _ = jitted(s, batch)
    for got, want in zip(jax.tree.leaves(s), jax.tree.leaves(in_s[0])):
        assert got.sharding.is_equivalent_to(want, got.ndim)


@pytest.mark.extended
def test_cli_emit_of_a_scanned_step_is_refused_and_explain_goes_to_stderr(capsys):
    # (the plan keys per-layer arguments the stacked step never sees: every
    # spec of the snippet would have matched nothing, unsaid)
    small = ["--model-arg", "layers=2", "--model-arg", "hidden=32", "--model-arg", "heads=2",
             "--model-arg", "seq_len=16", "--model-arg", "vocab=64"]
    assert main(["-q", "plan", "--model", "gpt", *small, "--model-arg", "scan_layers=true",
                 "--cluster", "local", "--emit", "python"]) == 2
    out, err = capsys.readouterr()
    assert "lax.scan over stacked layers" in err and out == ""
    assert main(["-q", "plan", "--model", "mlp", "--model-arg", "layers=2", "--cluster", "local",
                 "--emit", "python", "--explain"]) == 0
    out, err = capsys.readouterr()
    assert "jax.jit" in out and "faster" in err
