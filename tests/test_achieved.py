"""The cost model at achieved rates: cluster JSON, compute, kernels,
hierarchical collectives, pipelines on hosts whose devices share compute, and
the two FLOP counts.  Synthetic figures chosen so each formula is checked by
hand."""
import dataclasses
import json
import math

import jax.numpy as jnp
import pytest

import meshplan
from meshplan.cluster import Achieved, ClusterSpec, DeviceSpec, LinkSpec
from meshplan.cost_model.collectives import all_gather, all_reduce, reduce_scatter
from meshplan.cost_model.compute import (SPLIT_K_MIN_DEPTH, compute_time, kernel_fixed_time,
                                         launch_time, wave_utilisation)
from meshplan.cost_model.fusion import kernels
from meshplan.cost_model.mesh import mesh_model
from meshplan.cost_model.pipeline import host_bound_s, shared_compute_iteration_s, stage_programs
from meshplan.errors import ClusterSpecError
from meshplan.plan import LogicalMesh
from meshplan.trace import trace

A100 = meshplan.load_cluster("examples/clusters/dgx-a100-x2.json")


def _device(**achieved):
    return DeviceSpec(kind="gpu", memory_bytes=2**34, memory_bandwidth_bytes_per_s=1e12,
                      peak_flops={"float32": 100e12}, achieved=Achieved(**achieved))


def _cluster(hosts=2, dph=8, intra=LinkSpec(100e9, 0.0), inter=LinkSpec(80e9, 0.0), **achieved):
    return ClusterSpec("c", hosts, dph, _device(**achieved), intra, inter)


def test_achieved_round_trips_and_is_optional():
    spec = A100
    again = meshplan.parse_cluster(json.loads(spec.to_json()))
    assert again == spec and again.device.achieved.matmul_efficiency == pytest.approx(0.859)
    assert spec.intra_host.efficiency == pytest.approx(0.7)
    # a file without the optional keys is the ideal device, written as before
    plain = dataclasses.replace(spec, device=dataclasses.replace(spec.device, achieved=Achieved()),
                                intra_host=LinkSpec(300e9, 1e-6), inter_host=LinkSpec(200e9, 5e-6))
    d = plain.to_dict()
    assert "achieved" not in d["device"] and "efficiency" not in d["links"]["intra_host"]
    assert meshplan.parse_cluster(d) == plain
    assert "ideal" in plain.describe() and "86%" in spec.describe()


@pytest.mark.parametrize("where, value, message", [
    ("achieved.matmul_efficiency", 1.5, "at most 1"),
    ("achieved.memory_efficiency", 0, "positive"),
    ("achieved.kernel_launch_s", -1e-6, "non-negative"),
    ("achieved.matmul_kernel_min_s", -1e-6, "non-negative"),
    ("achieved.memory_kernel_min_s", "3us", "a string"),
    ("achieved.compute_units", 1.5, "integer"),
    ("achieved.shared_host_compute", "yes", "true or false"),
    ("achieved.fusion_writes_shared", 1, "true or false"),
    ("achieved.tile_size", 4, "unknown key"),
])
def test_bad_achieved_is_one_clear_error(where, value, message):
    d = A100.to_dict()
    key = where.split(".")[1]
    d["device"]["achieved"][key] = value
    with pytest.raises(ClusterSpecError) as info:
        meshplan.parse_cluster(d)
    assert info.value.path == f"$.device.{where}" and message in str(info.value)


def test_bad_link_efficiency_names_its_path():
    d = A100.to_dict()
    d["links"]["inter_host"]["efficiency"] = 2
    with pytest.raises(ClusterSpecError) as info:
        meshplan.parse_cluster(d)
    assert info.value.path == "$.links.inter_host.efficiency"


def test_compute_at_achieved_rates_with_wave_quantization():
    dev = _device(matmul_efficiency=0.5, memory_efficiency=0.8, compute_units=4,
                  tile_elements=100)
    # 4 tiles fill one wave: half the peak
    assert compute_time(dev, 1e12, 0.0, "float32", out_elements=400) == pytest.approx(
        1e12 / 50e12)
    # 5 tiles need two waves of 4: 5/8 of the units' time is used
    assert wave_utilisation(dev, 500) == pytest.approx(5 / 8)
    # fewer tiles than units: one wave with idle units (measured so on an H200)
    assert wave_utilisation(dev, 200) == pytest.approx(2 / 4)
    # ... unless it is a matrix-vector product (fewer rows than one MMA's)
    assert wave_utilisation(dev, 200, out_side=8) == 1.0
    assert wave_utilisation(dev, 200, out_side=64) == pytest.approx(2 / 4)
    # a matmul summing 256 products per output (2 x 500 x 256 FLOPs) is too
    # shallow to split: its two waves stay 5/8 full
    assert compute_time(dev, 256e3, 0.0, "float32", out_elements=500) == pytest.approx(
        256e3 / (50e12 * 5 / 8))
    # split-K: a reduction of two SPLIT_K_MIN_DEPTH slices may run on twice the
    # units -- 2 tiles x 2 fill the 4 units; 5 tiles x 2 = 10 fill 10 of 12
    deep = 2 * SPLIT_K_MIN_DEPTH
    assert wave_utilisation(dev, 200, depth=deep) == 1.0
    assert wave_utilisation(dev, 500, depth=deep) == pytest.approx(10 / 12)
    assert wave_utilisation(dev, 500, depth=deep - 1) == pytest.approx(5 / 8)
    # the split that fills best is taken: 5 tiles over 4 units, 4 ways: 20 = 5 waves
    assert wave_utilisation(dev, 500, depth=4 * SPLIT_K_MIN_DEPTH) == 1.0
    # compute_time reads the depth off the FLOPs: 2 x 500 x 1e9 is deep, all units busy
    assert compute_time(dev, 1e12, 0.0, "float32", out_elements=500) == pytest.approx(
        1e12 / 50e12)
    # memory-bound at 80% of the bandwidth
    assert compute_time(dev, 0.0, 8e9, "float32") == pytest.approx(8e9 / 0.8e12)
    assert launch_time(_device(kernel_launch_s=5e-6), 3) == pytest.approx(15e-6)
    # the ideal device is the plain roofline at peak
    ideal = _device()
    assert compute_time(ideal, 1e12, 1e9, "float32", out_elements=1) == pytest.approx(
        max(1e12 / 100e12, 1e9 / 1e12))


def test_kernel_floors_round_trip_and_old_files_stay_as_they_were():
    h100 = meshplan.load_cluster("examples/clusters/dgx-h100-x1.json")
    a = h100.device.achieved
    assert a.matmul_kernel_min_s == pytest.approx(9.9e-6)
    assert a.memory_kernel_min_s == pytest.approx(3.1e-6)
    assert meshplan.parse_cluster(json.loads(h100.to_json())) == h100
    assert "at least 9.9 us (matmul)" in h100.describe()
    # without floors (an older file, or an unmeasured GPU) the keys are not written
    assert "matmul_kernel_min_s" not in A100.to_dict()["device"]["achieved"]
    assert A100.device.achieved.matmul_kernel_min_s == 0.0


def test_a_kernel_costs_its_floor_or_launch_plus_roofline_whichever_is_longer():
    dev = _device(kernel_launch_s=2e-6, matmul_kernel_min_s=10e-6, memory_kernel_min_s=3e-6)
    # a small matmul: the floor (launch included) and nothing else
    assert 1e-6 + kernel_fixed_time(dev, 1e-6, True) == pytest.approx(10e-6)
    # a large one: launch + roofline; not floor + roofline
    assert 20e-6 + kernel_fixed_time(dev, 20e-6, True) == pytest.approx(22e-6)
    # between them, the floor still wins until launch + roofline passes it
    assert 7e-6 + kernel_fixed_time(dev, 7e-6, True) == pytest.approx(10e-6)
    assert 0.5e-6 + kernel_fixed_time(dev, 0.5e-6, False) == pytest.approx(3e-6)
    # no floors: the launch alone, as before
    assert kernel_fixed_time(_device(kernel_launch_s=2e-6), 1e-6, True) == pytest.approx(2e-6)


def test_hopper_floors_are_what_the_committed_h200_timings_give():
    import importlib.util
    import pathlib
    bench = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"
    spec = importlib.util.spec_from_file_location("kernel_latency", bench / "kernel_latency.py")
    kl = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kl)
    kind, rows = kl.load(kl.DEFAULT_FILES)
    assert kind == "NVIDIA H200"
    derived = kl.floors(rows)
    from meshplan import datasheets
    # the datasheet keeps two significant figures of the medians
    assert derived["matmul"][0] == pytest.approx(datasheets.HOPPER_MATMUL_KERNEL_MIN_S, rel=0.01)
    assert derived["stream"][0] == pytest.approx(datasheets.HOPPER_MEMORY_KERNEL_MIN_S, rel=0.02)
    assert len(derived["matmul"][1]) == 8 and len(derived["stream"][1]) == 4


def _compute_s(fn, args, **achieved) -> float:
    from meshplan.ilp.build import build_problem
    g = trace(fn, *args, batch_argnums=())
    c = ClusterSpec("one", 1, 1, _device(**achieved), LinkSpec(100e9, 0.0), LinkSpec(80e9, 0.0))
    built = build_problem(g, mesh_model(c, LogicalMesh(("x",), (1,))))
    return sum(grp.compute[0] for grp in built.groups)


def test_each_kernel_pays_its_floor_once_and_a_fusion_is_weighed_whole():
    import jax
    import jax.numpy as jnp

    def f(x, w):
        h = jnp.tanh(x * 2.0 + 1.0)          # one fused kernel
        return (h @ w).sum()                  # a matmul, and a reduction kernel
    small = [jax.ShapeDtypeStruct((8, 16), jnp.float32), jax.ShapeDtypeStruct((16, 4), jnp.float32)]
    launch = dict(kernel_launch_s=2e-6)
    floors = dict(launch, matmul_kernel_min_s=10e-6, memory_kernel_min_s=3e-6)
    k = kernels(trace(f, *small, batch_argnums=()))
    assert len(k) == 3
    # tiny work: each kernel is lifted from launch + roofline to its floor
    extra = _compute_s(f, small, **floors) - _compute_s(f, small, **launch)
    assert extra == pytest.approx((10e-6 - 2e-6) + 2 * (3e-6 - 2e-6), rel=1e-3)

    # x * 2 + 1, then a sum: one fusion whose read of the 8 MB input is
    # charged to the multiply and whose root (the sum) moves 4 bytes.  The
    # fusion moves 8 MB in 8 us, past its 3 us floor: launch only
    def g(x):
        return (x * 2.0 + 1.0).sum()
    big = [jax.ShapeDtypeStruct((2**21,), jnp.float32)]
    assert _compute_s(g, big, **floors) == pytest.approx(_compute_s(g, big, **launch))


def test_kernels_one_per_fusion_and_per_matmul():
    import jax.numpy as jnp

    def f(x, w):
        h = jnp.tanh(x * 2.0 + 1.0)          # one fusion (its root feeds the matmul)
        y = h @ w                             # a kernel
        return (jnp.exp(y) - 1.0).reshape(-1).sum()   # exp-sub fused into the reduce's input
    g = trace(f, jnp.ones((8, 16)), jnp.ones((16, 4)))
    k = kernels(g)
    prims = sorted(g.nodes[i].primitive for i in k)
    assert prims.count("dot_general") == 1 and "reduce_sum" in prims
    assert "reshape" not in prims
    # the elementwise chains: only their roots (tanh feeding the dot, sub feeding the
    # reduction) launch a kernel
    assert sum(p in ("tanh", "add", "mul") for p in prims) == 1
    assert sum(p in ("exp", "sub") for p in prims) == 1


def test_a_value_two_operators_read_is_written_and_read_back_where_fusion_writes_shared():
    import jax.numpy as jnp
    from meshplan.cost_model.fusion import fused_bytes, materialised_results

    def f(x):
        h = jnp.tanh(x)                       # read by two operators
        return (h * 2.0).sum() + (h + 1.0).max()
    g = trace(f, jnp.ones((256, 256)), batch_argnums=())
    h = next(t for n in g.nodes if n.primitive == "tanh" for t in n.outputs)
    size = g.tensors[h].nbytes
    assert h not in materialised_results(g) and h in materialised_results(g, True)
    # one kernel on a GPU (the reductions end inside it, as their cones say);
    # on XLA:CPU tanh's own kernel writes h
    assert len(kernels(g)) == 1 and len(kernels(g, shared_written=True)) == 2
    # a GPU's XLA: h made in registers; XLA:CPU: h written, then read by the
    # fusion of the operators reading it, once (the reductions' own reads,
    # kernel-ending, are in both)
    gpu, cpu = fused_bytes(g), fused_bytes(g, shared_written=True)
    tanh = next(n.id for n in g.nodes if n.primitive == "tanh")
    assert cpu[tanh] - gpu[tanh] == size
    assert sum(cpu.values()) - sum(gpu.values()) == 2 * size
    # the flag round-trips and is written only when set
    on = dataclasses.replace(A100, device=dataclasses.replace(
        A100.device, achieved=dataclasses.replace(A100.device.achieved,
                                                  fusion_writes_shared=True)))
    assert "fusion_writes_shared" not in A100.to_dict()["device"]["achieved"]
    assert meshplan.parse_cluster(json.loads(on.to_json())) == on
    assert "shared fused values written to memory" in on.describe()


def test_fusion_writes_shared_counts_what_xla_cpu_writes():
    # the compiled step on XLA's CPU back end, against the model: the bytes
    # its loop and reduction kernels write, and its kernels (matmuls included)
    import jax
    from meshplan.cost_model.fusion import materialised_results
    from meshplan.models import build_model
    from meshplan.runtime.hlo import kernel_summary
    m = build_model("gpt", {"hidden": 64, "layers": 2, "seq_len": 32, "batch": 2, "heads": 2,
                            "optimizer": "sgd"})
    state, batch = m.init(0)
    compiled = kernel_summary(jax.jit(m.train_step).lower(state, batch).compile().as_text())
    written = compiled["loop"][1] + compiled["reduction"][1]
    g = trace(m.train_step, *m.abstract_args, batch_argnums=m.batch_argnums)

    def model(shared):
        return (sum(g.tensors[t].nbytes for t in materialised_results(g, shared)),
                len(kernels(g, shared_written=shared)))
    (gpu_bytes, gpu_kernels), (cpu_bytes, cpu_kernels) = model(False), model(True)
    assert 0.85 < cpu_bytes / written < 1.15, (cpu_bytes, written)
    assert gpu_bytes / written < 0.7
    total = sum(n for n, _ in compiled.values())
    assert abs(cpu_kernels - total) < 0.1 * total < abs(gpu_kernels - total), \
        (cpu_kernels, gpu_kernels, total)


def test_collective_inside_a_host_is_a_ring_at_achieved_bandwidth():
    c = _cluster(intra=LinkSpec(100e9, 1e-6, efficiency=0.5), kernel_launch_s=2e-6)
    mm = mesh_model(c, LogicalMesh(("x",), (8,)), submesh=(1, 8))
    t, b = all_reduce(mm, (0,), 8e9)
    assert b == 8e9
    assert t == pytest.approx(2e-6 + 14 * 1e-6 + 2 * 7 / 8 * 8e9 / 50e9)


def test_collective_across_hosts_is_hierarchical():
    # 16 devices on 2 hosts in one axis: reduce-scatter over 8 in the host,
    # all-reduce of S/8 across the 2 hosts on a device's share (80/8 GB/s), all-gather
    c = _cluster()
    mm = mesh_model(c, LogicalMesh(("x",), (16,)))
    S = 16e9
    intra = 7 / 8 * S / 100e9
    inter = 2 * 1 / 2 * (S / 8) / (80e9 / 8)
    assert all_reduce(mm, (0,), S)[0] == pytest.approx(2 * intra + inter)
    assert all_gather(mm, (0,), S)[0] == pytest.approx(intra + 1 / 2 * (S / 8) / 10e9)
    t, out = reduce_scatter(mm, (0,), S)
    assert out == S / 16 and t == pytest.approx(intra + 1 / 2 * (S / 8) / 10e9)
    # an axis with one device per host (data parallel across hosts): the
    # network only, each of the 8 devices of a host with its share
    mm2 = mesh_model(c, LogicalMesh(("x", "y"), (2, 8)))
    assert all_reduce(mm2, (0,), S)[0] == pytest.approx(2 * 1 / 2 * S / 10e9)
    assert all_reduce(mm2, (1,), S)[0] == pytest.approx(2 * intra)


def test_shared_compute_pipeline_has_no_bubble():
    # two stages of 4 devices on an 8-device host, 4 micro-batches: the host
    # works through 4 x (1 + 3) s of stage time at half the devices each
    t = shared_compute_iteration_s([1.0, 3.0], [4, 4], 4, 8, dispatch_s=[0.0, 0.0])
    assert t == pytest.approx(4 * (1.0 * 4 + 3.0 * 4) / 8)
    # dispatch is serial: two programs per stage and micro-batch
    assert shared_compute_iteration_s([1.0, 3.0], [4, 4], 4, 8, [0.01, 0.02]) == pytest.approx(
        t + 4 * 2 * (0.01 + 0.02))


def test_shared_compute_pipeline_charges_its_collectives_in_full():
    # the same stages with 0.5 s and 1 s of collectives among their 1 s and
    # 3 s: their compute is shared out, the collectives' waits are not
    t = shared_compute_iteration_s([1.0, 3.0], [4, 4], 4, 8, [0.0, 0.0], [0.5, 1.0])
    assert t == pytest.approx(4 * ((0.5 * 4 + 2.0 * 4) / 8 + 0.5 + 1.0))
    assert t > shared_compute_iteration_s([1.0, 3.0], [4, 4], 4, 8, [0.0, 0.0])
    # one stage on every device: nothing to share, both readings agree
    assert shared_compute_iteration_s([2.0], [8], 3, 8, [0.01], [0.5]) == pytest.approx(
        shared_compute_iteration_s([2.0], [8], 3, 8, [0.01]))


def test_a_shared_host_pipeline_adds_its_tensor_parallel_collectives_in_full(monkeypatch):
    # the stage search hands the shared-host formula each stage's collectives
    # of a micro-batch: the tensor-parallel ones, not the gradient sums
    # reduced once a step
    from meshplan.dp_search import stages
    seen = []

    def record(latencies, devices, B, D, dispatch, collectives=None, passes=2):
        seen.append((list(latencies), list(collectives)))
        return shared_compute_iteration_s(latencies, devices, B, D, dispatch, collectives, passes)
    monkeypatch.setattr(stages, "shared_compute_iteration_s", record)
    m, cluster = _gpt(), ClusterSpec.local()
    summed = {}
    for tp, method in ((4, meshplan.Manual(dp=1, tp=4, pp=2, num_micro_batches=2)),
                       (1, meshplan.Manual(dp=4, tp=1, pp=2, num_micro_batches=2))):
        seen.clear()
        meshplan.plan(m.train_step, *m.abstract_args, cluster=cluster, method=method)
        (latencies, collectives), = seen
        assert all(0 <= c < t for c, t in zip(collectives, latencies))
        summed[tp] = sum(collectives)
        if tp > 1:      # every stage's matmuls are split: all-reduces each micro-batch
            assert all(c > 0.1 * t for c, t in zip(collectives, latencies))
    # data parallel: the gradient sums wait for the step's end; what is left
    # is the loss's mean over the data shards
    assert summed[1] < 0.25 * summed[4]


def test_local_cpu_cluster_shares_compute():
    assert ClusterSpec.local().device.achieved.shared_host_compute


def _gpt():
    from meshplan.models import build_model
    return build_model("gpt", {"layers": "2", "hidden": "32", "heads": "2", "seq_len": "16",
                               "vocab": "64", "batch": "8"})


def test_model_and_hardware_flops():
    m = _gpt()
    cluster = meshplan.load_cluster("examples/clusters/dgx-a100-x1.json")
    one = meshplan.plan(m.train_step, *m.abstract_args, cluster=cluster,
                        method=meshplan.ShardParallel())
    p = one.predicted
    assert p.tflops_per_device > 0
    assert p.hardware_tflops_per_device == pytest.approx(p.tflops_per_device)
    pipe = meshplan.plan(m.train_step, *m.abstract_args, cluster=cluster,
                         method=meshplan.Manual(dp=2, tp=2, pp=2, num_micro_batches=2,
                                                remat=True))
    q = pipe.predicted
    assert all(s.remat for s in pipe.stages)
    # recomputation runs the forward again: about a third more FLOPs than the model's
    assert 1.1 < q.hardware_tflops_per_device / q.tflops_per_device < 1.5
    assert "with recomputation" in str(pipe)


def test_program_dispatch_is_charged_per_stage_and_micro_batch():
    m = _gpt()
    base = meshplan.load_cluster("examples/clusters/dgx-a100-x1.json")
    slow = dataclasses.replace(base, device=dataclasses.replace(
        base.device, achieved=dataclasses.replace(base.device.achieved,
                                                  program_dispatch_s=1.0)))
    manual = meshplan.Manual(dp=2, tp=2, pp=2, num_micro_batches=2)
    t0 = meshplan.plan(m.train_step, *m.abstract_args, cluster=base, method=manual).predicted.iteration_s
    t1 = meshplan.plan(m.train_step, *m.abstract_args, cluster=slow, method=manual).predicted.iteration_s
    # 1F1B over 2 stages and 2 micro-batches: 3 stage slots on the critical
    # path, 2 programs each, plus each stage's update program
    extra = t1 - t0
    assert extra == pytest.approx(3 * 2 * (1.0 - 50e-6) + 2 * (1.0 - 50e-6), rel=1e-3)
    assert math.isfinite(t1)
    # a second per device a program runs on: each stage's programs run on 4
    per_device = dataclasses.replace(base, device=dataclasses.replace(
        base.device, achieved=dataclasses.replace(base.device.achieved,
                                                  dispatch_per_device_s=1.0)))
    t2 = meshplan.plan(m.train_step, *m.abstract_args, cluster=per_device,
                       method=manual).predicted.iteration_s
    assert t2 - t0 == pytest.approx((3 * 2 + 2) * 4 * 1.0, rel=1e-3)
    # one program on all 8 devices
    whole = meshplan.Manual(dp=8)
    t3, t4 = (meshplan.plan(m.train_step, *m.abstract_args, cluster=c,
                            method=whole).predicted.iteration_s for c in (base, per_device))
    assert t4 - t3 == pytest.approx(8.0, rel=1e-3)
    back = meshplan.ClusterSpec.from_json(per_device.to_json())
    assert back.device.achieved.dispatch_s(4) == pytest.approx(50e-6 + 4.0)


def test_gradients_accumulate_per_micro_batch_at_memory_bandwidth():
    from meshplan.cost_model.pipeline import accumulation_s
    # one micro-batch: nothing to add; B of them: B-1 adds, each reading the sum
    # and the gradient and writing the sum
    assert accumulation_s(1e9, 1, 1e9) == 0.0
    assert accumulation_s(1e9, 4, 1e9) == pytest.approx(3 * 3 / 4)
    # fused into the weight-gradient GEMM as its accumulator: one read of the sum
    assert accumulation_s(1e9, 4, 1e9, passes=1) == pytest.approx(3 / 4)


def test_one_stage_plans_are_charged_for_the_recomputation_they_run():
    # the whole model as one program recomputes when asked
    # (meshplan.runtime.remat): Manual(remat=True) with one stage pays for it
    m = _gpt()
    cluster = meshplan.load_cluster("examples/clusters/dgx-a100-x1.json")
    plain = meshplan.plan(m.train_step, *m.abstract_args, cluster=cluster,
                          method=meshplan.Manual(dp=8, tp=1, pp=1, remat=False))
    asked = meshplan.plan(m.train_step, *m.abstract_args, cluster=cluster,
                          method=meshplan.Manual(dp=8, tp=1, pp=1, remat=True))
    assert not plain.stages[0].remat
    assert len(asked.stages) == 1 and asked.stages[0].recompute == "full"
    assert asked.predicted.iteration_s > plain.predicted.iteration_s
    q = asked.predicted
    assert 1.1 < q.hardware_tflops_per_device / q.tflops_per_device < 1.5


def test_float32_matmuls_at_default_precision_are_priced_at_the_tfloat32_rate():
    import jax
    import jax.numpy as jnp
    from meshplan.ilp.strategies import node_dtype

    def dots(a, b):
        return a @ b, jnp.matmul(a, b, precision="highest")

    x = jax.ShapeDtypeStruct((64, 64), jnp.float32)

    def priced_as(config: str | None) -> list[str]:
        with jax.default_matmul_precision(config):
            g = trace(dots, x, x)
        return [node_dtype(g, n) for n in g.nodes if n.primitive == "dot_general"]

    assert priced_as(None) == ["tfloat32", "float32"]
    assert priced_as("float32") == ["float32", "float32"]
    assert priced_as("tensorfloat32") == ["tfloat32", "float32"]
    a100 = A100.device
    assert a100.flops_for("tfloat32") == pytest.approx(156e12)
    # a device without a tfloat32 figure prices it as float32
    assert _device().flops_for("tfloat32") == _device().flops_for("float32")


def _with_achieved(cluster, **fields):
    """``cluster`` with these ``Achieved`` fields replaced."""
    return dataclasses.replace(cluster, device=dataclasses.replace(
        cluster.device, achieved=dataclasses.replace(cluster.device.achieved, **fields)))


def test_a_pipelined_step_takes_at_least_its_programs_host_time():
    assert stage_programs(2, 4) == 2 * (4 * 2 + 1)
    assert stage_programs(3, 1, per_micro_batch=3) == 3 * (3 + 1)
    assert host_bound_s(18, 250e-6) == pytest.approx(4.5e-3)
    m = _gpt()
    base = meshplan.load_cluster("examples/clusters/dgx-a100-x1.json")

    def host(per_program_s):
        return _with_achieved(base, pipeline_program_s=per_program_s)
    manual = meshplan.Manual(dp=2, tp=2, pp=2, num_micro_batches=4, schedule="1f1b")
    t0, t1 = (meshplan.plan(m.train_step, *m.abstract_args, cluster=c,
                            method=manual).predicted.iteration_s for c in (base, host(1.0)))
    # 2 stages x (4 micro-batches x forward and backward + the update): 18 s
    assert t0 < 1.0 and t1 == pytest.approx(18.0)
    # where the devices' work is longer, the host's time does not bind
    assert meshplan.plan(m.train_step, *m.abstract_args, cluster=host(t0 / 100),
                         method=manual).predicted.iteration_s == pytest.approx(t0)
    # one program on every device is not driven stage by stage
    whole = meshplan.Manual(dp=8)
    assert meshplan.plan(m.train_step, *m.abstract_args, cluster=host(1.0),
                         method=whole).predicted.iteration_s < 1.0
    # two hosts, a stage on each: each host's process hands over its own 9
    two = meshplan.load_cluster("examples/clusters/dgx-a100-x2.json")
    p2 = meshplan.plan(m.train_step, *m.abstract_args,
                       cluster=_with_achieved(two, pipeline_program_s=1.0),
                       method=meshplan.Manual(dp=2, tp=4, pp=2, num_micro_batches=4))
    assert sorted({d // 8 for d in p2.stages[0].devices} | {d // 8 for d in p2.stages[1].devices}) \
        == [0, 1] and p2.predicted.host_s == pytest.approx(9.0)
    back = meshplan.ClusterSpec.from_json(host(3e-4).to_json())
    assert back.device.achieved.pipeline_program_s == pytest.approx(3e-4)
    assert "pipeline_program_s" not in base.to_json()      # (written only when known)


def test_a_tiny_model_stays_one_program_where_the_host_time_is_known():
    # the 2-layer MLP of benchmarks/default_cluster.py on the cluster calibrate
    # measured for the measured grid: one program measured 4x faster than
    # three stages (default_cluster.md).  With the host's time per pipeline
    # program known, Auto() plans one program.  Without it Auto() planned
    # three stages, predicted at 427 us against the one program's 687 us:
    # that one program's ILP split the weight gradients for less than the
    # fixed cost of their merged all-reduce.  Priced (ilp.intra_op.underpriced),
    # the one program is predicted at 340 us and wins without it too.
    from meshplan.models import build_model
    m = build_model("mlp", {"layers": 2, "hidden": 32, "in_dim": 32, "out_dim": 10,
                            "batch": 16, "optimizer": "sgd"})
    state, batch = m.abstract_args
    base = meshplan.load_cluster("benchmarks/results/measured_grid_cluster_2026-12-04.json")
    assert base.device.achieved.pipeline_program_s == 0
    known = _with_achieved(base, pipeline_program_s=250e-6)
    plans = [meshplan.plan(m.train_step, state, batch, cluster=c, method=meshplan.Auto())
             for c in (base, known)]
    assert [len(p.stages) for p in plans] == [1, 1]
    three = meshplan.plan(m.train_step, state, batch, cluster=known,
                          method=meshplan.PipeshardParallel(stages=3))
    assert three.predicted.host_s > 0
    assert plans[1].predicted.iteration_s < three.predicted.iteration_s


def test_the_timeline_says_when_the_hosts_time_bounds_the_step():
    from meshplan.tools.timeline import breakdown, simulate
    m = _gpt()
    base = meshplan.load_cluster("examples/clusters/dgx-a100-x1.json")
    slow_host = _with_achieved(base, pipeline_program_s=1.0)
    manual = meshplan.Manual(dp=2, tp=2, pp=2, num_micro_batches=4, schedule="1f1b")
    p = meshplan.plan(m.train_step, *m.abstract_args, cluster=slow_host, method=manual)
    text = breakdown(p, simulate(p))
    assert "18 stage programs" in text and "differs" not in text, text
    q = meshplan.plan(m.train_step, *m.abstract_args, cluster=base, method=manual)
    assert "stage programs" not in breakdown(q, simulate(q))


def test_a_pipeline_the_hosts_time_bounds_is_compared_with_one_program():
    # two micro-batches asked: the searched pipeline runs 2 x (2 x 2 + 1) or
    # more stage programs at a second each; Auto() keeps the one program
    from meshplan.models import build_model
    m = build_model("mlp", {"layers": 2, "hidden": 32, "in_dim": 32, "out_dim": 10,
                            "batch": 16, "optimizer": "sgd"})
    base = meshplan.load_cluster("benchmarks/results/measured_grid_cluster_2026-12-04.json")
    slow_host = _with_achieved(base, pipeline_program_s=1.0)
    p = meshplan.plan(m.train_step, *m.abstract_args, cluster=slow_host,
                      method=meshplan.Auto(num_micro_batches=2))
    assert len(p.stages) == 1 and p.num_micro_batches == 1 and p.predicted.iteration_s < 1.0


@pytest.mark.parametrize("per_program_s", [0.0, 1.0])
def test_fewer_stages_are_searched_where_the_hosts_time_bounds_the_pipeline(per_program_s):
    # four micro-batches, stages searched: at a second a program, one stage
    # (4 x 2 + 1 programs) beats any split the DP prefers without the bound
    from meshplan.models import build_model
    m = build_model("mlp", {"layers": 2, "hidden": 32, "in_dim": 32, "out_dim": 10,
                            "batch": 16, "optimizer": "sgd"})
    base = meshplan.load_cluster("benchmarks/results/measured_grid_cluster_2026-12-04.json")
    host = _with_achieved(base, pipeline_program_s=per_program_s)
    p = meshplan.plan(m.train_step, *m.abstract_args, cluster=host,
                      method=meshplan.PipeshardParallel(num_micro_batches=4))
    if per_program_s == 0:
        assert len(p.stages) > 1        # (what the DP prefers: the case is not vacuous)
    else:
        assert len(p.stages) == 1 and p.predicted.iteration_s == pytest.approx(9.0)


def test_buffer_counts_by_hand():
    from meshplan.cost_model.pipeline import layer_buffers, pipeline_host_s, step_buffers
    # 3 parameters (5 state arrays with their optimizer moments), 4 kept values,
    # 1 sent on, 2 received: forward 3 + 2 in, 4 + 1 out; backward 3 + 4 + 1 + 3
    # in, 3 + 2 out; the update 5 + 3 in, 5 out
    assert layer_buffers(3, 5, 4, 1, 2, "1f1b") == (5 + 5 + 11 + 5, 13)
    # ZB-H1's weight-gradient program: the kept values and the sums in, the sums out
    assert layer_buffers(3, 5, 4, 1, 2, "zb-h1") == (26 + 4 + 6, 13)
    # two stages on 2 and 4 devices, 3 micro-batches
    assert step_buffers([(2, 10, 7), (4, 1, 1)], 3) == 2 * 37 + 4 * 4
    assert pipeline_host_s(2, 3, "1f1b", 1e-3, 1e-6, 90) == pytest.approx(14e-3 + 90e-6)


def _eval_step(ws, batch):
    h = batch["x"]
    for w in ws:
        h = jnp.tanh(h @ w)
    return {"loss": jnp.mean((h - batch["y"]) ** 2)}


def _counting_eval_step(state, batch):
    return {**state, "seen": state["seen"] + 1}, _eval_step(state["ws"], batch)


def test_an_evaluation_pipeline_runs_a_forward_program_per_micro_batch_and_no_update():
    from meshplan.cost_model.pipeline import schedule_programs
    from meshplan.graph import stage_program_counts
    assert schedule_programs(2, 3, "1f1b") == 2 * (3 * 2 + 1)
    assert schedule_programs(2, 3, "zb-h1") == 2 * (3 * 3 + 1)
    assert schedule_programs(2, 3, "zb-h1", (1, 0)) == schedule_programs(2, 3, "1f1b", (1, 0)) \
        == 2 * 3
    ws = [jnp.ones((16, 16)) * 0.1 for _ in range(4)]
    batch = {"x": jnp.ones((16, 16)), "y": jnp.zeros((16, 16))}
    counts = {fn: stage_program_counts(trace(fn, state, batch, batch_argnums=(1,), warn=False))
              for fn, state in ((_eval_step, ws), (_counting_eval_step, {"ws": ws, "seen": 0}))}
    assert counts == {_eval_step: (1, 0), _counting_eval_step: (1, 1)}
    m = _gpt()
    assert stage_program_counts(trace(m.train_step, *m.abstract_args,
                                      batch_argnums=m.batch_argnums)) == (2, 1)
    # the host hands over 4 stages x 4 micro-batches forward programs (the
    # planner charged a backward and an update each too: 36)
    cluster = meshplan.Cluster.local()
    per = cluster.device.achieved.pipeline_program_s
    plan = meshplan.plan(_eval_step, ws, batch, cluster=cluster,
                         method=meshplan.Manual(dp=2, tp=1, pp=4, num_micro_batches=4))
    assert 16 * per <= plan.predicted.host_s < 17 * per
    # the plan records them, and its timeline draws forwards alone (it drew a
    # backward per micro-batch and stage, and counted an update program)
    from meshplan.tools.timeline import breakdown, simulate
    assert plan.programs == (1, 0) == meshplan.Plan.from_json(plan.to_json()).programs
    blocks = simulate(plan)
    assert {b.kind for b in blocks} == {"F"} and len(blocks) == 16
    assert "update" not in breakdown(plan, blocks)
    assert plan.to_dict()["programs"] == [1, 0]


@pytest.mark.extended
def test_the_host_time_counts_the_buffers_the_programs_take_and_make():
    # the plan counts its stage programs' arrays from the graph; the programs
    # that run take and make about as many (an H200 run: gpt-small 2081
    # counted, 1973 ran; gpt-350m 6745 and 6903, benchmarks/results/gpu_driver.md)
    from meshplan.models import build_model
    from meshplan.tools.calibrate import _buffers_run
    m = build_model("gpt", {"layers": 2, "hidden": 32, "heads": 2, "seq_len": 16,
                            "vocab": 64, "batch": 8})
    base = meshplan.load_cluster("examples/clusters/dgx-a100-x1.json")

    def host(per_buffer_s):
        return _with_achieved(base, pipeline_buffer_s=per_buffer_s)
    manual = meshplan.Manual(dp=2, tp=2, pp=2, num_micro_batches=4, schedule="1f1b")
    p = meshplan.plan(m.train_step, *m.abstract_args, cluster=host(1.0), method=manual)
    counted = p.predicted.host_s            # (1 s a buffer, 0 a program)
    assert p.predicted.iteration_s == pytest.approx(counted)
    from meshplan.tools.timeline import breakdown, simulate
    assert "their array buffers at" in breakdown(p, simulate(p))
    state, batch = m.init(0)
    ran = _buffers_run(meshplan.parallelize(m.train_step, plan=p), p, state, batch)
    assert 0.85 <= counted / ran <= 1.15, (counted, ran)
    q = meshplan.plan(m.train_step, *m.abstract_args, cluster=base, method=manual)
    assert q.predicted.host_s == 0 and "host_s" not in q.to_json()
    assert meshplan.Plan.from_json(p.to_json()).predicted.host_s == pytest.approx(counted)
    back = meshplan.ClusterSpec.from_json(host(2e-6).to_json())
    assert back.device.achieved.pipeline_buffer_s == pytest.approx(2e-6)
    assert "pipeline_buffer_s" not in base.to_json()


def _shared_cpu(**busy) -> meshplan.ClusterSpec:
    return meshplan.parse_cluster({
        "format": "meshplan.cluster/1", "name": "fake-cpu", "num_hosts": 1,
        "devices_per_host": 4, "num_devices": 4,
        "device": {"kind": "cpu", "memory_bytes": 2**30, "memory_bandwidth_bytes_per_s": 1e9,
                   "peak_flops": {"float32": 2e10},
                   "achieved": {"program_dispatch_s": 2e-5, "shared_host_compute": True,
                                **busy}},
        "links": {"intra_host": {"bandwidth_bytes_per_s": 1e9, "latency_s": 1e-5},
                  "inter_host": {"bandwidth_bytes_per_s": 1e8, "latency_s": 5e-5}}})


def test_a_pipeline_stage_on_several_devices_pays_for_starting_beside_busy_ones():
    """On devices that share a host's cores, a program on several devices
    waits for cores the other stages hold (Achieved.busy_program_s): charged
    per stage program of a pipeline, only on stages of several devices."""
    from meshplan.models import build_model
    m = build_model("mlp", {"layers": 2, "hidden": 32, "in_dim": 16, "out_dim": 8, "batch": 16,
                            "optimizer": "sgd"})
    busy = {"busy_program_s": 1e-3, "busy_program_per_device_s": 1e-4}
    assert _shared_cpu(**busy).device.achieved.busy_s(2) == pytest.approx(1.2e-3)
    assert _shared_cpu(**busy).device.achieved.busy_s(1) == 0.0
    assert meshplan.parse_cluster(json.loads(_shared_cpu(**busy).to_json())) == _shared_cpu(**busy)

    def t(method, **fields):
        return meshplan.plan(m.train_step, *m.abstract_args, cluster=_shared_cpu(**fields),
                             method=method).predicted.iteration_s
    two = meshplan.Manual(dp=2, pp=2, num_micro_batches=4)
    # 2 stages of 2 devices, 4 micro-batches, a forward and a backward program each
    assert t(two, **busy) - t(two) == pytest.approx(4 * 2 * 2 * 1.2e-3, rel=1e-6)
    ones = meshplan.Manual(dp=1, pp=4, num_micro_batches=4)      # stages of one device
    one_stage = meshplan.Manual(dp=4, num_micro_batches=4)         # nothing beside it
    for method in (ones, one_stage):
        assert t(method, **busy) == pytest.approx(t(method), rel=1e-12)
