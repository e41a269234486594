"""The search controls on Auto and PipeshardParallel (and the CLI's flags):
maximum stages, memory fraction, micro-batch counts, schedules, tensor
parallelism inside hosts only."""
from __future__ import annotations

import math
import pathlib
import warnings

import pytest

import meshplan
from meshplan.cli import _method, build_parser
from meshplan.cluster import load_cluster
from meshplan.dp_search import Session
from meshplan.errors import InfeasiblePlanError, MeshplanError
from meshplan.ilp import candidate_meshes, within_host
from meshplan.models import build_model

ROOT = pathlib.Path(__file__).resolve().parents[1]
TWO_HOSTS = load_cluster(str(ROOT / "examples/clusters/dgx-a100-x2.json"))


@pytest.fixture(scope="module")
def gpt():
    # (one session: the searches share their layers' ILPs; a shared cache
    # changes no result, tests/test_ilp_structure.py)
    m = build_model("gpt", {})
    return m.train_step, tuple(m.abstract_args), Session.from_env()


def _plan(model, method):
    step, args, *session = model
    return meshplan.plan(step, *args, cluster=TWO_HOSTS, method=method,
                         session=session[0] if session else None)


def test_within_host_keeps_only_the_first_axis_across_hosts():
    meshes = candidate_meshes(16, cluster=TWO_HOSTS, submesh=(2, 8))
    kept = within_host(meshes, 2, 8)
    assert kept and len(kept) < len(meshes)
    for m in meshes:
        inside = len(m.shape) > 1 and 8 % math.prod(m.shape[1:]) == 0
        assert (m in kept) == inside, m
    assert within_host(meshes, 1, 16) == meshes          # one host: nothing crosses


@pytest.mark.extended      # (about 20 s)
def test_tp_within_host_plans_no_axis_but_data_across_hosts():
    m = build_model("mlp", {})
    mlp = (m.train_step, tuple(m.abstract_args))
    free = _plan(mlp, meshplan.Auto(num_micro_batches=1))
    # (unconstrained, this MLP runs as one stage on a 16-device axis across both hosts)
    assert any(s.submesh[0] > 1 and len(s.logical_mesh.shape) == 1 for s in free.stages)
    p = _plan(mlp, meshplan.Auto(num_micro_batches=1, tp_within_host=True))
    for s in p.stages:
        hosts, dph = s.submesh
        if hosts > 1:
            assert len(s.logical_mesh.shape) > 1
            assert dph % math.prod(s.logical_mesh.shape[1:]) == 0


@pytest.mark.extended
def test_micro_batch_counts_schedules_and_max_stages_bound_the_search(gpt):
    p = _plan(gpt, meshplan.Auto(tp_within_host=True, num_micro_batches=(2,),
                                 schedule=("gpipe",)))
    assert p.num_micro_batches == 2 and p.schedule == "gpipe" and len(p.stages) > 1
    one = _plan(gpt, meshplan.PipeshardParallel(num_micro_batches=2, max_stages=1,
                                                tp_within_host=True))
    assert len(one.stages) == 1


def test_memory_fraction_is_the_budget(gpt):
    with pytest.raises(InfeasiblePlanError):
        _plan(gpt, meshplan.ShardParallel(memory_fraction=1e-9))
    with pytest.raises(InfeasiblePlanError):
        _plan(gpt, meshplan.PipeshardParallel(memory_fraction=1e-9))


@pytest.mark.parametrize("kwargs, needle", [
    (dict(num_micro_batches=0), "num_micro_batches=0"),
    (dict(num_micro_batches=[2, "x"]), "num_micro_batches"),
    (dict(schedule="zigzag"), "schedule='zigzag'"),
    (dict(schedule=("gpipe", "auto")), "schedule="),
    (dict(max_stages=0), "max_stages=0"),
    (dict(memory_fraction=0.0), "memory_fraction=0.0"),
    (dict(memory_fraction=1.2), "(0, 1]"),
    (dict(tp_within_host="yes"), "tp_within_host"),
])
@pytest.mark.parametrize("cls", [meshplan.Auto, meshplan.PipeshardParallel])
def test_bad_controls_are_one_clear_error(cls, kwargs, needle):
    with pytest.raises(MeshplanError, match=None) as e:
        cls(**kwargs)
    assert needle in str(e.value) and cls.__name__ in str(e.value)


@pytest.mark.parametrize("kwargs", [dict(dp=True, tp=4, pp=2), dict(dp=2, tp=2, pp=2,
                                                                   num_micro_batches=False)])
def test_manual_takes_integers_not_bools(kwargs):
    with pytest.raises(MeshplanError, match="must be a positive integer"):
        meshplan.Manual(**kwargs)


def _mlp_step(batch, width=16):
    import jax
    import jax.numpy as jnp

    def step(p, b):
        loss, g = jax.value_and_grad(
            lambda p: jnp.mean((jnp.tanh(b["x"] @ p["w0"]) @ p["w1"] - b["y"]) ** 2))(p)
        return jax.tree.map(lambda a, c: a - 0.1 * c, p, g), {"loss": loss}
    p = {"w0": jnp.ones((16, width)) / 16, "w1": jnp.ones((width, 16)) / width}
    return step, p, {"x": jnp.ones((batch, 16)), "y": jnp.zeros((batch, 16))}


@pytest.mark.parametrize("batch, dp, tp, pp, mb, micro", [
    (16, 8, 1, 1, 4, 4),        # a micro-batch of 4 over 8 replicas
    (12, 2, 2, 2, 4, 3),
    (16, 2, 2, 2, 16, 1),
])
def test_manual_micro_batches_the_data_axis_cannot_split_are_refused(batch, dp, tp, pp, mb, micro):
    # (each replica would run the whole micro-batch: work replicated, unasked)
    step, p, b = _mlp_step(batch)
    with pytest.raises(InfeasiblePlanError) as e:
        meshplan.plan(step, p, b, cluster=meshplan.Cluster.local(),
                      method=meshplan.Manual(dp=dp, tp=tp, pp=pp, num_micro_batches=mb))
    assert f"batch dimension of argument 1['x'] has size {batch}, whose micro-batches of " \
        f"{micro} do not split over the {dp} data-parallel devices" in str(e.value)
    assert f"divisible by {dp * mb}" in str(e.value)


def test_a_fixed_stage_count_the_work_does_not_fill_is_noted_and_warned():
    # one matmul and a head: four stages leave two with next to nothing
    import jax
    import jax.numpy as jnp

    def step(p, b):
        loss, g = jax.value_and_grad(lambda p: jnp.mean(jnp.tanh(b["x"] @ p["w0"]) @ p["out"]))(p)
        return jax.tree.map(lambda a, c: a - 0.1 * c, p, g), {"loss": loss}
    p = {"w0": jnp.ones((256, 256)) / 256, "out": jnp.ones((256, 1)) / 256}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = meshplan.plan(step, p, {"x": jnp.ones((64, 256))},
                             cluster=meshplan.Cluster.local(),
                             method=meshplan.PipeshardParallel(stages=4))
    note = [n for n in plan.notes if "4 stages were asked for" in n]
    assert len(plan.stages) == 4 and len(note) == 1
    t = [s.predicted.compute_s for s in plan.stages]
    idle = [k for k, x in enumerate(t) if x < 0.25 * sum(t) / 4]
    assert idle and ", ".join(map(str, idle)) in note[0]
    assert any(note[0] in str(w.message) for w in caught)


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved"])
def test_stages_of_a_few_tiny_kernels_are_idle_by_their_flops(schedule):
    """One linear layer cut into 4 (virtual) stages: two hold only the
    loss's subtract and mean.  Their predicted compute is mostly kernel
    launches, a quarter of an even share or more, so no note came; and
    interleaved plans were not checked at all."""
    import jax
    import jax.numpy as jnp

    def step(p, b):
        loss, g = jax.value_and_grad(
            lambda p: jnp.mean((b["x"] @ p["w"] + p["b"] - b["y"]) ** 2))(p)
        return jax.tree.map(lambda a, c: a - 0.1 * c, p, g), loss
    p = {"w": jnp.ones((16, 8)) / 16, "b": jnp.zeros(8)}
    method = (meshplan.PipeshardParallel(stages=2, num_micro_batches=4, schedule="interleaved")
              if schedule == "interleaved" else
              meshplan.PipeshardParallel(stages=4, num_micro_batches=4, schedule=schedule))
    with pytest.warns(UserWarning, match="were asked for, but the step's work does not cut"):
        plan = meshplan.plan(step, p, {"x": jnp.ones((16, 16)), "y": jnp.zeros((16, 8))},
                             cluster=meshplan.Cluster.local(), method=method)
    assert len(plan.stages) == 4
    asked = "2 stages of 2 chunks (4 virtual stages)" if schedule == "interleaved" else "4 stages"
    assert any(n.startswith(f"{asked} were asked for") for n in plan.notes), plan.notes


def test_an_idle_stage_of_a_loop_that_indexes_stacked_layers_says_to_scan_them():
    """A fori_loop applying stacked layers by index runs whole in one layer;
    the idle-stage word says how to write it so it cuts (a lax.scan over the
    stack is unrolled into layers), where before it only said 'fewer stages'."""
    import jax
    import jax.numpy as jnp

    def step(p, b):
        def loss(p):
            h = jax.lax.fori_loop(0, 4, lambda i, h: jnp.tanh(h @ p["w"][i]), b["x"])
            return jnp.mean((h @ p["out"] - b["y"]) ** 2)
        l, g = jax.value_and_grad(loss)(p)
        return jax.tree.map(lambda a, c: a - 0.1 * c, p, g), l
    p = {"w": jnp.ones((4, 16, 16)) / 16, "out": jnp.ones((16, 4)) / 16}
    b = {"x": jnp.ones((16, 16)), "y": jnp.zeros((16, 4))}
    with pytest.warns(UserWarning, match=r"run inside lax loops.*lax\.scan\(body, carry, "):
        meshplan.plan(step, p, b, cluster=meshplan.Cluster.local(),
                      method=meshplan.PipeshardParallel(stages=2, num_micro_batches=2))

    def scanned(p, b):      # (the same layers as a scan over the stack: cut, no word)
        def loss(p):
            h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), b["x"], p["w"])
            return jnp.mean((h @ p["out"] - b["y"]) ** 2)
        l, g = jax.value_and_grad(loss)(p)
        return jax.tree.map(lambda a, c: a - 0.1 * c, p, g), l
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plan = meshplan.plan(scanned, p, b, cluster=meshplan.Cluster.local(),
                             method=meshplan.PipeshardParallel(stages=2, num_micro_batches=2))
    assert not any("lax loops" in n for n in plan.notes)

    def recurrent(p, b):    # (a loop over steps of one weight: no stacked layers to name)
        def loss(p):
            h = jax.lax.fori_loop(0, 4, lambda i, h: jnp.tanh(h @ p["w"][0]), b["x"])
            return jnp.mean((h @ p["out"] - b["y"]) ** 2)
        l, g = jax.value_and_grad(loss)(p)
        return jax.tree.map(lambda a, c: a - 0.1 * c, p, g), l
    one = {"w": p["w"][:1], "out": p["out"]}
    with pytest.warns(UserWarning, match="were asked for") as seen:
        meshplan.plan(recurrent, one, b, cluster=meshplan.Cluster.local(),
                      method=meshplan.PipeshardParallel(stages=2, num_micro_batches=2))
    assert not any("lax loops" in str(w.message) for w in seen)


def test_counts_to_search_that_do_not_divide_the_batch_are_skipped():
    # (one count of several that did not divide the batch refused the search)
    import jax
    import jax.numpy as jnp

    def step(p, b):
        loss, g = jax.value_and_grad(lambda p: jnp.mean(jnp.tanh(b @ p["w0"]) @ p["w1"]))(p)
        return jax.tree.map(lambda a, c: a - 0.1 * c, p, g), loss
    p = {"w0": jnp.ones((16, 32)) / 16, "w1": jnp.ones((32, 4)) / 32}
    batch = jnp.ones((10, 16))
    plan = meshplan.plan(step, p, batch, cluster=meshplan.Cluster.local(),
                         method=meshplan.PipeshardParallel(stages=2, num_micro_batches=(4, 5)))
    assert plan.num_micro_batches == 5
    with pytest.raises(MeshplanError, match=r"none of num_micro_batches=\(3, 4\) divides the "
                                            r"batch size 10; search counts that do: 1, 2, 5, 10"):
        meshplan.plan(step, p, batch, cluster=meshplan.Cluster.local(),
                      method=meshplan.PipeshardParallel(stages=2, num_micro_batches=(3, 4)))
    with pytest.raises(MeshplanError, match="num_micro_batches=4 does not divide the batch size"):
        meshplan.plan(step, p, batch, cluster=meshplan.Cluster.local(),
                      method=meshplan.PipeshardParallel(stages=2, num_micro_batches=4))


def test_exact_stages_above_max_stages_is_refused():
    with pytest.raises(MeshplanError, match="max_stages"):
        meshplan.PipeshardParallel(stages=4, max_stages=2).request(8)


def _args(*argv):
    return build_parser().parse_args(["plan", "--model", "gpt", "--cluster", "local", *argv])


def test_cli_flags_reach_the_methods():
    m = _method(_args("--max-stages", "3", "--memory-fraction", "0.5", "--tp-within-host",
                      "--micro-batches", "4,8", "--schedule", "gpipe,1f1b"))
    assert m == meshplan.Auto(max_stages=3, memory_fraction=0.5, tp_within_host=True,
                              num_micro_batches=(4, 8), schedule=("gpipe", "1f1b"))
    m = _method(_args("--method", "pipeshard", "--pp", "2", "--micro-batches", "4"))
    assert m == meshplan.PipeshardParallel(stages=2, num_micro_batches=4)
    m = _method(_args("--method", "manual", "--dp", "4", "--tp", "2", "--memory-fraction", "0.8"))
    assert m.memory_fraction == 0.8 and (m.dp, m.tp) == (4, 2)


@pytest.mark.parametrize("argv, needle", [
    (("--method", "data", "--max-stages", "2"), "--max-stages applies to --method auto or pipeshard"),
    (("--method", "shard", "--tp-within-host"), "--tp-within-host applies"),
    (("--method", "manual", "--dp", "4", "--pp", "2", "--max-stages", "2"),
     "give its shape with --dp, --tp and --pp"),
    (("--method", "manual", "--micro-batches", "2,4"), "one --micro-batches count"),
    (("--micro-batches", "0"), "--micro-batches expects"),
    (("--schedule", "gpipe,zigzag"), "--schedule expects"),
])
def test_cli_flag_misuse_is_one_line(argv, needle):
    with pytest.raises(MeshplanError, match=None) as e:
        _method(_args(*argv))
    assert needle in str(e.value)


def test_manual_remat_names_follow_design():
    assert meshplan.Manual(dp=8, remat="full").remat is True
    assert meshplan.Manual(dp=8, remat="none").remat is False
    assert meshplan.Manual(dp=8, remat="selective").remat == "selective"
    with pytest.raises(MeshplanError, match="remat='sometimes'"):
        meshplan.Manual(dp=8, remat="sometimes")
    for flag, value in (("full", True), ("always", True), ("none", False), ("never", False),
                        ("auto", None), ("selective", "selective")):
        m = _method(_args("--method", "manual", "--dp", "8", "--remat", flag))
        assert m.remat is value or m.remat == value == "selective", flag


def test_shard_remat_flag_defaults_to_none_and_takes_the_same_names():
    assert _method(_args("--method", "shard")).remat is False
    for flag, value in (("full", True), ("always", True), ("none", False), ("never", False),
                        ("auto", "auto"), ("selective", "selective")):
        m = _method(_args("--method", "shard", "--remat", flag))
        assert m.remat is value or m.remat == value, flag
    assert meshplan.ShardParallel().request(8).pipeline is None      # (today's one-stage ILP)
    p = meshplan.ShardParallel(mesh_shape=(2, 4), remat="auto").request(8).pipeline
    assert p.num_stages == 1 and p.num_micro_batches == (1,) and p.mesh_shape == (2, 4)
    assert p.remat is None


@pytest.mark.extended
def test_shard_remat_auto_is_no_slower_than_recomputing_nothing():
    # (it priced only the layer by layer plans: 2.51 ms on gpt against the
    # whole-graph ILP's 2.10 ms without recomputation, which fits)
    m = build_model("gpt")
    got = {r: meshplan.plan(m.train_step, *m.abstract_args, cluster=meshplan.Cluster.local(),
                            method=meshplan.ShardParallel(remat=r)) for r in ("none", "auto")}
    assert got["auto"].predicted.iteration_s <= got["none"].predicted.iteration_s


def test_ilp_workers_use_every_core_and_never_more(monkeypatch):
    from meshplan.dp_search.session import Session, usable_cpus
    from meshplan.dp_search.solver import LayerSolver
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(96)), raising=False)
    assert usable_cpus() == 96                      # (no fixed cap)
    monkeypatch.setenv("MESHPLAN_WORKERS", "500")
    assert Session.from_env().workers == 96
    monkeypatch.setenv("MESHPLAN_WORKERS", "3")
    assert Session.from_env().workers == 3
    for bad in ("0", "-3", "abc"):      # (0 and -3 were taken as 1, silently)
        monkeypatch.setenv("MESHPLAN_WORKERS", bad)
        with pytest.raises(MeshplanError, match="use a positive integer"):
            Session.from_env()
    monkeypatch.setenv("MESHPLAN_WORKERS", "3")
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1}, raising=False)
    solver = LayerSolver(meshplan.Cluster.local(), None, Session(workers=64))
    assert solver.workers == 2


def test_an_evaluation_running_sum_pipelines_with_micro_batches():
    # (every output updates an argument: refused first as cutting "into at
    # most 1 layer", then as "nothing marks where its forward ends"; the
    # batch's loss, read only by the sum, now ends the forward)
    import jax
    import jax.numpy as jnp

    def eval_acc(p, acc, b):
        h = b["x"]
        for w in p:
            h = jnp.tanh(h @ w)
        return acc + jnp.mean((h - b["y"]) ** 2)
    p = [jnp.ones((16, 16)) / 16] * 4
    b = {"x": jnp.linspace(-1, 1, 256).reshape(16, 16), "y": jnp.zeros((16, 16))}
    step = meshplan.parallelize(eval_acc, batch_argnums=(2,), donate_argnums=(),
                                method=meshplan.PipeshardParallel(stages=2, num_micro_batches=2))
    got = step(p, jnp.float32(1), b)
    assert float(got) == pytest.approx(float(jax.jit(eval_acc)(p, jnp.float32(1), b)), rel=1e-6)
    assert len(step.plan.stages) == 2
    # each stage's forward per micro-batch, and the sum once
    assert sorted(x.kind for x in step.last_timeline) == ["A"] + ["F"] * 4


def _two_hosts_of_three():
    import dataclasses
    return dataclasses.replace(TWO_HOSTS, name="2x3", num_hosts=2, devices_per_host=3)


@pytest.mark.parametrize("method, needle", [
    # (a bare StopIteration: the third stage of 2 devices found no host room)
    (meshplan.Manual(tp=2, pp=3, num_micro_batches=2),
     "a stage of 2 devices neither divides a host of 3 devices nor is whole hosts"),
    # (refused as not fitting 72 GiB a device, for a 100 KB model)
    (meshplan.PipeshardParallel(stages=3, num_micro_batches=2),
     "no 3 pipeline stages cover the 6 devices: a stage is 1, 3, 6 devices .* ask for 2 or "
     "4 stages"),
])
def test_stages_that_cannot_tile_the_hosts_are_refused_saying_so(method, needle):
    import jax.numpy as jnp
    from _steps import tanh_mlp_loss

    def step(ws, batch):
        return tanh_mlp_loss(ws, batch)
    ws = [jnp.ones((64, 64)) * 0.01 for _ in range(6)]
    batch = {"x": jnp.ones((12, 64)), "y": jnp.ones((12, 64))}
    with pytest.raises(MeshplanError, match=needle):
        meshplan.plan(step, ws, batch, cluster=_two_hosts_of_three(), method=method)
