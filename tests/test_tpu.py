"""TPU clusters: the slice format, the torus cost model, the shipped files,
``Cluster.local()`` from TPU device objects and a 2-slice plan."""
import importlib.util
import json
import pathlib

import pytest

import meshplan
from meshplan.cluster import ClusterSpec, load_cluster, parse_cluster
from meshplan.cost_model import collectives as C
from meshplan.cost_model.mesh import mesh_model
from meshplan.cost_model.torus import axis_phases, device_order, torus_orders
from meshplan.errors import ClusterSpecError
from meshplan.ilp.intra_op import candidate_meshes
from meshplan.plan import LogicalMesh, Plan

ROOT = pathlib.Path(__file__).resolve().parents[1]
TPU = ROOT / "examples" / "clusters" / "tpu"
TPU_FILES = sorted(TPU.glob("*.json"))


def tpu_dict(**slice_changes) -> dict:
    d = {
        "format": "meshplan.cluster/1", "name": "test-tpu", "sources": ["made up for a test"],
        "num_slices": 2,
        "slice": {
            "chip": {"kind": "TPU test", "memory_bytes": 16 * 2**30,
                     "memory_bandwidth_bytes_per_s": 8e11, "peak_flops": {"bfloat16": 2e14}},
            "topology": [4, 4], "wraparound": [True, False], "hosts": 2,
            "ici": {"bandwidth_bytes_per_s": 5e10, "latency_s": 1e-6},
        },
        "dcn": {"bandwidth_bytes_per_s": 2.5e10, "latency_s": 2e-5},
    }
    d["slice"].update(slice_changes)
    return d


# -- the format -----------------------------------------------------------------

def test_a_tpu_file_is_slices_of_chips_and_round_trips():
    spec = parse_cluster(tpu_dict())
    assert (spec.num_hosts, spec.devices_per_host, spec.num_devices) == (2, 16, 32)
    assert spec.tpu.topology == (4, 4) and spec.tpu.wraparound == (True, False)
    # the slice's DCN is every host's network together
    assert spec.inter_host.bandwidth_bytes_per_s == 2 * 2.5e10
    assert spec.intra_host.bandwidth_bytes_per_s == 5e10
    assert parse_cluster(spec.to_dict()) == spec
    assert ClusterSpec.from_json(spec.to_json()) == spec
    assert spec.to_dict()["slice"]["topology"] == [4, 4]


def test_a_topology_may_be_written_as_google_writes_it():
    assert parse_cluster(tpu_dict(topology="4x4")).tpu.topology == (4, 4)


def test_wraparound_defaults_to_rings_of_more_than_two_chips():
    d = tpu_dict(topology=[2, 4, 8])
    del d["slice"]["wraparound"]
    assert parse_cluster(d).tpu.wraparound == (False, True, True)


@pytest.mark.parametrize("mutate, path", [
    (lambda d: d["slice"].update(topology="4 by 4"), "$.slice.topology"),
    (lambda d: d["slice"].update(topology=[4, 0]), "$.slice.topology[1]"),
    (lambda d: d["slice"].update(topology=[]), "$.slice.topology"),
    (lambda d: d["slice"].update(wraparound=[True]), "$.slice.wraparound"),
    (lambda d: d["slice"].update(wraparound=[True, "yes"]), "$.slice.wraparound[1]"),
    (lambda d: d["slice"].update(hosts=3), "$.slice.hosts"),
    (lambda d: d["slice"]["ici"].update(bandwidth_bytes_per_s=-1), "$.slice.ici.bandwidth_bytes_per_s"),
    (lambda d: d["slice"]["chip"]["peak_flops"].update(bf16=1e14), "$.slice.chip.peak_flops.bf16"),
    (lambda d: d["slice"].pop("ici"), "$.slice.ici"),
    (lambda d: d.pop("dcn"), "$.dcn"),
    (lambda d: d["dcn"].update(latency_s=-1), "$.dcn.latency_s"),
    (lambda d: d.update(num_slices=0), "$.num_slices"),
    (lambda d: d.update(num_devices=31), "$.num_devices"),
    (lambda d: d.update(links={}), "$.links"),
    (lambda d: d["slice"].update(torus=[4, 4]), "$.slice.torus"),
    # (a GPU file's key in a TPU file: named itself, not the TPU keys)
    (lambda d: d.update(num_hosts=16), "$.num_hosts"),
])
def test_bad_tpu_values_name_their_json_path(mutate, path):
    d = tpu_dict()
    mutate(d)
    with pytest.raises(ClusterSpecError) as e:
        parse_cluster(d)
    assert e.value.path == path, str(e.value)
    assert "\n" not in str(e.value)


def test_gpu_files_are_not_read_as_tpu_files():
    gpu = load_cluster(ROOT / "examples" / "clusters" / "dgx-a100-x2.json")
    assert gpu.tpu is None and "num_slices" not in gpu.to_dict()


# -- the shipped files ------------------------------------------------------------

@pytest.mark.parametrize("path", TPU_FILES, ids=lambda p: p.stem)
def test_every_shipped_tpu_cluster_validates(path):
    spec = load_cluster(path)
    assert spec.name == path.stem and spec.tpu is not None
    assert parse_cluster(spec.to_dict()) == spec
    slices = int(path.stem.rsplit("-x", 1)[1]) if "-x" in path.stem else 1
    assert spec.num_hosts == slices
    assert spec.num_devices == json.loads(path.read_text())["num_devices"]
    assert spec.sources and all("cloud.google.com/tpu/docs/" in s or "estimate" in s
                                or "glennklockwood" in s for s in spec.sources)
    assert "estimate" in spec.description


def test_shipped_files_cover_the_generations_and_multislice_jobs():
    names = {p.stem for p in TPU_FILES}
    for gen in ("v4", "v5e", "v5p", "v6e"):
        assert len([n for n in names if n.startswith(f"tpu-{gen}-")]) >= 3, gen
    assert {"tpu-v5e-256-x2", "tpu-v5e-256-x4", "tpu-v6e-256-x2", "tpu-v6e-256-x4",
            "tpu-v5p-1024"} <= names
    v5p = load_cluster(TPU / "tpu-v5p-1024.json")
    assert v5p.num_devices == 512 and v5p.tpu.topology == (8, 8, 8)
    assert v5p.device.flops_for("bfloat16") == 459e12
    assert v5p.intra_host.bandwidth_bytes_per_s == 100e9      # 1200 GB/s / 2 / 6 links
    v5e = load_cluster(TPU / "tpu-v5e-256-x2.json")
    assert v5e.tpu.hosts == 32 and v5e.tpu.dcn.bandwidth_bytes_per_s == 25e9


def test_shipped_files_are_what_their_generator_writes():
    spec = importlib.util.spec_from_file_location("_tpu_generate", TPU / "generate.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert set(gen.build_all()) == {p.name for p in TPU_FILES}
    assert gen.main(["--check"]) == 0


def test_cluster_show_draws_the_torus_in_words(capsys):
    from meshplan.cli import main
    assert main(["cluster", "show", str(TPU / "tpu-v5p-128-x2.json")]) == 0
    text = capsys.readouterr().out
    assert "2 TPU slice(s) of 4x4x4" in text and "x: a ring of 4 (wraparound" in text
    assert "DCN" in text and "6.25 GB/s per chip" in text
    small = load_cluster(TPU / "tpu-v5e-16.json").describe()
    assert "x: a line of 4 (no wraparound)" in small and "one slice" in small


# -- the torus cost model -------------------------------------------------------

def test_a_wraparound_ring_has_twice_a_lines_bandwidth():
    ring = parse_cluster(tpu_dict(topology=[8], wraparound=[True]))
    line = parse_cluster(tpu_dict(topology=[8], wraparound=[False]))
    mesh = LogicalMesh(("x",), (8,))
    t_ring = C.all_reduce(mesh_model(ring, mesh, submesh=(1, 8)), (0,), 1e9)[0]
    t_line = C.all_reduce(mesh_model(line, mesh, submesh=(1, 8)), (0,), 1e9)[0]
    assert t_line == pytest.approx(2 * t_ring, rel=1e-3)
    # the ring formula: 2 (n-1)/n S / (2 B) + 2 (n-1) alpha
    assert t_ring == pytest.approx(2 * 7 / 8 * 1e9 / 1e11 + 14e-6)


def test_an_axis_over_two_dimensions_runs_one_ring_phase_per_dimension():
    spec = parse_cluster(tpu_dict(topology=[4, 4], wraparound=[True, True]))
    mm = mesh_model(spec, LogicalMesh(("x",), (16,)), submesh=(1, 16))
    assert mm.links[0].phases == ((4, 1e11, 1e-6), (4, 1e11, 1e-6))
    # reduce-scatter over the first ring, then over the second on a quarter of the data
    first = 3e-6 + 3 / 4 * 1e9 / 1e11
    second = 3e-6 + 3 / 4 * 0.25e9 / 1e11
    assert C.all_reduce(mm, (0,), 1e9)[0] == pytest.approx(2 * (first + second))
    # two axes, one per dimension, cost the same together as the one axis
    mm2 = mesh_model(spec, LogicalMesh(("a", "b"), (4, 4)), submesh=(1, 16))
    assert C.all_reduce(mm2, (0, 1), 1e9)[0] == pytest.approx(C.all_reduce(mm, (0,), 1e9)[0])


def test_an_axis_over_slices_uses_dcn_and_the_rest_stays_on_ici():
    spec = load_cluster(TPU / "tpu-v5e-256-x2.json")
    mm = mesh_model(spec, LogicalMesh(("data", "fsdp", "tensor"), (2, 16, 16)),
                    submesh=(2, 256))
    data, fsdp, tensor = mm.links
    assert data.crosses_hosts and not fsdp.crosses_hosts and not tensor.crosses_hosts
    per_chip = 25e9 * 32 / 256
    assert data.phases == ((2, per_chip, 2e-5),)
    assert tensor.phases == ((16, 1e11, 1e-6),)
    # the same gradient costs far more over DCN than over ICI
    assert C.all_reduce(mm, (0,), 1e8)[0] > 10 * C.all_reduce(mm, (2,), 1e8)[0]


def test_a_split_dimension_shares_its_links():
    spec = parse_cluster(tpu_dict(topology=[16], wraparound=[True]))
    phases = axis_phases(spec, LogicalMesh(("a", "b"), (4, 4)), (1, 16))
    # b: 4 neighbouring chips of the ring (a line); a: chips 4 apart sharing the ring 4 ways
    assert phases[1] == (((4, 5e10, 1e-6),), 1)
    assert phases[0] == (((4, 2 * 5e10 / 4, 4e-6),), 1)


def test_candidate_meshes_offer_each_torus_order_once():
    spec = parse_cluster(tpu_dict(topology=[4, 8], wraparound=[True, True]))
    assert torus_orders(spec, (1, 32)) == [(), (1, 0)]
    square = parse_cluster(tpu_dict(topology=[4, 4], wraparound=[True, True]))
    assert torus_orders(square, (1, 16)) == [()]       # the two orders plan the same
    meshes = candidate_meshes(32, 2, cluster=spec, submesh=(1, 32))
    assert any(m.torus == (1, 0) for m in meshes) and any(m.torus == () for m in meshes)
    gpu = load_cluster(ROOT / "examples" / "clusters" / "dgx-a100-x2.json")
    assert all(m.torus == () for m in candidate_meshes(16, cluster=gpu))


def test_a_torus_order_reorders_the_stage_devices_and_survives_json():
    spec = parse_cluster(tpu_dict(topology=[2, 4], wraparound=[False, True]))
    mesh = LogicalMesh(("a", "b"), (2, 4), (1, 0))
    # chip id = x + 2 y; with y fastest the devices run 0, 2, 4, 6, then 1, 3, 5, 7
    assert device_order(spec, tuple(range(8)), mesh) == (0, 2, 4, 6, 1, 3, 5, 7)
    assert device_order(spec, tuple(range(8)), LogicalMesh(("a", "b"), (2, 4))) == tuple(range(8))
    assert LogicalMesh.from_dict(mesh.to_dict()) == mesh
    assert "torus" not in LogicalMesh(("a",), (8,)).to_dict()


# -- Cluster.local() on a TPU ------------------------------------------------------

class FakeTpu:
    platform = "tpu"

    def __init__(self, id, coords, slice_index=0, kind="TPU v5 lite"):
        self.id, self.coords, self.slice_index, self.device_kind = id, coords, slice_index, kind


def fake_devices(topology=(4, 2), slices=2):
    out, i = [], 0
    for s in range(slices):
        for y in range(topology[1]):
            for x in range(topology[0]):
                out.append(FakeTpu(i, (x, y, 0), s))
                i += 1
    return out


def test_local_reads_the_torus_and_slices_from_device_coords():
    spec = ClusterSpec.from_tpu_devices(fake_devices(), process_count=2)
    assert spec.tpu.topology == (4, 2) and spec.num_hosts == 2 and spec.devices_per_host == 8
    assert spec.tpu.wraparound == (True, False)
    assert spec.device.flops_for("bfloat16") == 197e12       # the v5e datasheet entry
    assert parse_cluster(spec.to_dict()) == spec


def test_plan_ids_bind_to_tpu_devices_in_torus_order():
    from meshplan.shardings import tpu_order
    devs = fake_devices(topology=(4, 2), slices=2)
    shuffled = sorted(devs, key=lambda d: (-d.slice_index, d.coords[0], d.coords[1]))
    for i, d in enumerate(shuffled):
        d.id = i            # jax's ids need not follow the torus
    ordered = tpu_order(sorted(shuffled, key=lambda d: d.id))
    assert [(d.slice_index, d.coords) for d in ordered] == \
        [(s, (x, y, 0)) for s in range(2) for y in range(2) for x in range(4)]
    cpu = [type("Cpu", (), {"platform": "cpu", "id": i})() for i in range(3)]
    assert tpu_order(cpu) == cpu


def test_local_on_a_tpu_goes_through_jax_devices(monkeypatch):
    import jax
    devs = fake_devices(slices=1)
    monkeypatch.setattr(jax, "devices", lambda *a: devs)
    monkeypatch.setattr(jax, "process_count", lambda *a: 1)
    monkeypatch.setattr(jax, "local_device_count", lambda *a: 8)
    spec = ClusterSpec.local()
    assert spec.tpu is not None and spec.num_devices == 8


def test_devices_without_coordinates_are_refused_in_one_line():
    devs = fake_devices(slices=1)
    devs[3].coords = None
    with pytest.raises(ClusterSpecError, match="cluster file"):
        ClusterSpec.from_tpu_devices(devs)


# -- a 2-slice plan --------------------------------------------------------------

def test_a_two_slice_plan_puts_only_data_parallelism_across_slices():
    from meshplan.models import build_model
    m = build_model("gpt", {"layers": "2", "hidden": "256", "heads": "4", "seq_len": "256",
                            "vocab": "1024", "batch": "512"})
    cluster = load_cluster(TPU / "tpu-v5e-4-x2.json")
    plan = meshplan.plan(m.train_step, *m.abstract_args, cluster=cluster,
                         method=meshplan.ShardParallel())
    assert Plan.from_json(plan.to_json()).to_json() == plan.to_json()
    (stage,) = plan.stages
    mm = mesh_model(cluster, stage.logical_mesh, submesh=tuple(stage.submesh))
    across = {a for a, l in zip(stage.logical_mesh.axes, mm.links) if l.crosses_hosts}
    assert across, "the plan should use both slices"

    def axes_of(spec):
        return {a for d in spec for a in ((d,) if isinstance(d, str) else (d or ()))}

    # the batch is split over the cross-slice axes on dimension 0 only ...
    batch = dict(plan.batch)
    assert all(across & axes_of(spec[:1]) and not across & axes_of(spec[1:])
               for spec in batch.values())
    # ... and no weight is split over them (no tensor parallelism across
    # slices): what crosses the slices is the gradients' all-reduce, or its
    # two halves where the optimizer state is sharded (weight-update sharding)
    weights = [(k, spec) for k, spec in stage.params if k.startswith("['params']")]
    assert weights and not any(across & axes_of(spec) for _, spec in weights)


def _mlp_step():
    """A float32-weight, bfloat16-compute MLP step with AdamW: ``wi`` is read
    once (its forward), ``wo`` twice (forward and the input's gradient)."""
    import jax
    import jax.numpy as jnp
    import optax
    f32, bf = jnp.float32, jnp.bfloat16
    params = {"wi": jax.ShapeDtypeStruct((4096, 28672), f32),
              "wo": jax.ShapeDtypeStruct((28672, 4096), f32)}
    tx = optax.adamw(1e-4)

    def loss(p, x):
        h = jax.nn.silu(x @ p["wi"].astype(bf))
        return jnp.mean(jnp.square((h @ p["wo"].astype(bf)).astype(f32)))

    def step(state, x):
        g = jax.grad(loss)(state["params"], x)
        u, opt = tx.update(g, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], u), "opt": opt}
    state = {"params": params, "opt": jax.eval_shape(tx.init, params)}
    return step, state, jax.ShapeDtypeStruct((3072, 2048, 4096), bf)


def test_a_weight_gradient_reduce_scatters_on_ici_and_all_reduces_its_shard_over_dcn():
    """FSDP over a slice's chips x data parallelism over slices: the weight
    gradient's partial sums are reduce-scattered over ICI, then the 1/256
    shard is all-reduced over DCN, landing in the weight's own layout (sharded
    over ICI only).  Without this pair the only scatter was over both axes
    (slice-major), which leaves the gradient split across slices."""
    from meshplan.ilp.strategies import node_strategies
    from meshplan.trace import trace
    step, state, x = _mlp_step()
    graph = trace(step, state, x, warn=False)
    cluster = load_cluster(TPU / "tpu-v5e-256-x2.json")
    mm = mesh_model(cluster, LogicalMesh(("x", "y"), (2, 256)))
    # the gradient of wo: h (batch, seq, mlp) x dy (batch, seq, emb) -> (mlp, emb)
    (node,) = [n for n in graph.nodes if n.primitive == "dot_general"
               and graph.tensors[n.outputs[0]].shape == (28672, 4096)]
    nbytes = graph.tensors[node.outputs[0]].nbytes
    dp = [s for s in node_strategies(graph, node, mm)
          if s.in_specs[0][0] == (0, 1) and s.out_specs == (((1,), ()),)]
    assert dp, "no strategy reduces over both axes into the ICI-only layout"
    best = min(dp, key=lambda s: s.comm_s)
    rs, ar = C.reduce_scatter(mm, (1,), nbytes), C.all_reduce(mm, (0,), nbytes / 256)
    assert [p[0] for p in best.parts] == ["reduce-scatter", "all-reduce"]
    assert best.comm_s == pytest.approx(rs[0] + ar[0])
    assert best.comm_bytes == pytest.approx(nbytes / 256 * 2)
    # over DCN: a 2-ring all-reduce of the shard at the chip's share of its
    # host's NICs (2 x 100 Gbit/s over 8 chips), 20 us a step
    per_chip = 25e9 / 8
    assert ar[0] == pytest.approx(2 * (2e-5 + nbytes / 256 / 2 / per_chip)
                                  + cluster.device.achieved.kernel_launch_s)


def _small_gpt_graph(layers: str = "1"):
    from meshplan.graph import GRAD_BOUNDARY, strip_markers
    from meshplan.models import build_model
    from meshplan.trace import trace
    m = build_model("gpt", {"layers": layers, "hidden": "256", "heads": "4", "seq_len": "128",
                            "vocab": "1024", "batch": "1024", "dtype": "bfloat16",
                            "compute_dtype": "bfloat16"})
    graph = trace(m.train_step, *m.abstract_args, batch_argnums=m.batch_argnums, warn=False)
    grads = frozenset(t for n in graph.nodes if n.primitive == GRAD_BOUNDARY for t in n.inputs)
    return strip_markers(graph), grads


def test_the_strategy_cut_keeps_a_gradient_summed_over_a_batch_split_three_ways():
    """On a 4x16x16 multi-slice mesh a weight gradient has hundreds of
    strategies.  The one that reads both activations as the forward left
    them (batch split over all three axes) pays its reduce-scatter itself,
    so the cheapest 64 by own cost leave it out; the cut keeps it when its
    operands' makers offer that layout."""
    from meshplan.ilp.strategies import MAX_STRATEGIES, enumerate_strategies, node_space, \
        node_strategies
    graph, _ = _small_gpt_graph()
    mm = mesh_model(load_cluster(TPU / "tpu-v5e-256-x4.json"),
                    LogicalMesh(("x", "y", "z"), (4, 16, 16)))
    # the first MLP weight's gradient: (batch, seq, 256) x (batch, seq, 1024) -> (256, 1024)
    node = next(n for n in graph.nodes if n.primitive == "dot_general"
                and graph.tensors[n.outputs[0]].shape == (256, 1024)
                and graph.tensors[n.inputs[0]].shape[0] == 1024)
    split = ((0, 1, 2), (), ())
    aligned = [s for s in enumerate_strategies(graph, node, node_space(graph, node), mm)
               if s.in_specs == (split, split)]
    assert aligned and len(enumerate_strategies(graph, node, node_space(graph, node), mm)) \
        > 2 * MAX_STRATEGIES
    blind = node_strategies(graph, node, mm)
    assert len(blind) == MAX_STRATEGIES
    assert not any(s.in_specs == (split, split) for s in blind)
    offered = (frozenset({split}), frozenset({split}))
    kept = node_strategies(graph, node, mm, offered=offered)
    assert kept[:MAX_STRATEGIES] == blind        # (the cheapest first, as before)
    assert {s.name for s in kept if s.in_specs == (split, split)} == {s.name for s in aligned}
    # every strategy kept beyond the cheapest reads its operands as offered
    assert all(s.in_specs == (split, split) for s in kept[MAX_STRATEGIES:])


@pytest.mark.extended
def test_the_cut_ilp_finds_the_optimum_over_every_strategy_on_a_three_axis_mesh():
    """The layer ILP over the cut strategies against the same ILP over all of
    them (no cut) on a 4x16x16 two-level mesh: the same objective."""
    from meshplan.ilp.intra_op import solve_intra_op
    from meshplan.ilp import strategies
    graph, grads = _small_gpt_graph()
    cluster = load_cluster(TPU / "tpu-v5e-256-x4.json")
    mesh = LogicalMesh(("x", "y", "z"), (4, 16, 16))
    cut = solve_intra_op(graph, cluster, mesh, accumulate=grads, time_limit=120)
    every = pytest.MonkeyPatch()
    every.setattr(strategies, "_cut", lambda ranked, keep, offered: ranked)
    try:
        full = solve_intra_op(graph, cluster, mesh, accumulate=grads, time_limit=300)
    finally:
        every.undo()
    assert cut.solution.status == full.solution.status == "optimal"
    assert cut.objective_s == pytest.approx(full.objective_s, rel=1e-6)


def test_a_weight_read_twice_stays_off_the_slice_axis():
    """Sharding a weight over the slices too costs a DCN phase (1/512 of it)
    in every gather and in the gradient's reduce-scatter; keeping it to ICI
    costs one all-reduce of its 1/256 gradient shard over DCN (two such
    phases).  A weight gathered twice (forward and backward) is cheaper kept
    off the slice axis; the planner must see that option."""
    from meshplan.graph import OPT_STATE, PARAM
    from meshplan.ilp.intra_op import solve_intra_op
    from meshplan.trace import trace
    step, state, x = _mlp_step()
    graph = trace(step, state, x, warn=False)
    cluster = load_cluster(TPU / "tpu-v5e-256-x2.json")
    r = solve_intra_op(graph, cluster, LogicalMesh(("x", "y"), (2, 256)), time_limit=60)
    wo = [s for i, s in zip(graph.inputs, r.input_specs) if i.role in (PARAM, OPT_STATE)
          and graph.tensors[i.tensor].shape == (28672, 4096)]
    assert len(wo) == 3 and all(s == ("y", None) for s in wo), wo


@pytest.mark.extended
def test_pipeline_stages_may_be_whole_slices():
    from meshplan.models import build_model
    m = build_model("gpt", {"layers": "4", "hidden": "64", "heads": "2", "seq_len": "32",
                            "vocab": "128", "batch": "16"})
    cluster = load_cluster(TPU / "tpu-v5e-4-x2.json")
    plan = meshplan.plan(m.train_step, *m.abstract_args, cluster=cluster,
                         method=meshplan.PipeshardParallel(stages=2, num_micro_batches=2))
    assert [s.submesh for s in plan.stages] == [(1, 4), (1, 4)]
    assert sorted(s.devices for s in plan.stages) == [(0, 1, 2, 3), (4, 5, 6, 7)]


# -- fuzzing the TPU format ---------------------------------------------------------

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_PATHS = [("num_slices",), ("slice",), ("dcn",), ("num_devices",), ("slice", "chip"),
          ("slice", "topology"), ("slice", "wraparound"), ("slice", "hosts"), ("slice", "ici"),
          ("slice", "topology", 0), ("slice", "wraparound", 1), ("slice", "ici", "latency_s"),
          ("dcn", "bandwidth_bytes_per_s"), ("slice", "chip", "peak_flops")]
_VALUES = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True),
                    st.text(max_size=8), st.lists(st.integers(-2, 20), max_size=5),
                    st.sampled_from([{}, [], "4x4x8", "x", 10**400, -1, 0, [0, 4]]))


@settings(max_examples=200, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(_PATHS), _VALUES), min_size=1, max_size=3))
def test_any_bad_tpu_value_is_a_cluster_spec_error(changes):
    d = tpu_dict()
    for path, value in changes:
        node = d
        try:
            for key in path[:-1]:
                node = node[key]
            node[path[-1]] = value
        except (KeyError, IndexError, TypeError):
            continue
    try:
        spec = parse_cluster(d)
    except ClusterSpecError as e:
        assert "\n" not in str(e) and e.path.startswith("$")
    else:
        assert parse_cluster(spec.to_dict()) == spec
