"""The cost model against what XLA really emits: reshardings, CPU collectives."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

import meshplan
from meshplan.cost_model import mesh_model, spec_from_names
from meshplan.cost_model.collectives import all_reduce, reduce_scatter, reduce_scatter_kind
from meshplan.cost_model.sharding import reshard_cost, reshard_steps
from meshplan.plan import LogicalMesh
from meshplan.runtime import hlo

A100 = meshplan.load_cluster("examples/clusters/dgx-a100-x1.json")


def _mm(shape, cluster=A100):
    names = ("x", "y", "z")[:len(shape)]
    return mesh_model(cluster, LogicalMesh(names, tuple(shape)))


def _steps(mm, shape, src, dst):
    names = mm.mesh.axes
    nbytes = int(np.prod(shape)) * 4
    return [(k, b) for k, _, b, _ in reshard_steps(mm, shape, nbytes, spec_from_names(src, names),
                                                    spec_from_names(dst, names))]


# (mesh, f32 shape, source spec, target spec, collectives XLA emits: (kind, result bytes))
# measured with jax 0.10.2 on 8 fake CPU devices for x -> constraint(src) ->
# constraint(dst), the way the runtime reshards (jit in/out shardings alone can
# give XLA more freedom and sometimes fewer bytes)
MEASURED = [
    ((8,), (16, 8), ("x", None), (None, "x"), [("all-to-all", 64)]),
    ((2, 4), (8, 16, 32), ("y", None, "x"), (None, None, "y"),
     [("all-gather", 4096), ("all-to-all", 4096)]),
    ((2, 4), (16, 8), (None, "x"), (None, "y"), [("collective-permute", 128)]),
    ((2, 4), (16, 8), ("y", "x"), (None, None), [("all-gather", 128), ("all-gather", 512)]),
    ((2, 4), (16, 8), (("x", "y"), None), ("y", None),
     [("collective-permute", 64), ("all-gather", 128)]),
    ((2, 4), (16, 8), (None, ("x", "y")), ("x", None), [("all-gather", 512)]),
    ((2, 4), (8, 16, 32), ("x", None, None), (None, None, ("x", "y")),
     [("all-to-all", 2048), ("collective-permute", 2048)]),
    # a gather goes first, the new axis is sliced from its result
    ((2, 4), (16, 8), (None, "y"), ("x", None), [("all-gather", 512)]),
    # moves with a new axis past them: all-to-all first, then the slice
    ((2, 4), (8, 16, 32), (None, "y", None), ("y", None, "x"), [("all-to-all", 4096)]),
    # ... and a new axis before them: sliced first
    ((2, 4), (8, 16, 32), ("x", None, None), (None, "y", "x"), [("all-to-all", 2048)]),
    ((2, 4), (16, 8), ("y", None), (("x", "y"), None), [("collective-permute", 64)]),
    ((2, 4), (16, 8), (None, "x"), ("x", None), [("all-to-all", 256)]),
    ((2, 4), (16, 8), ("x", None), ("x", "y"), []),
    ((2, 2, 2), (8, 4, 32, 32), (None, None, ("y", "z"), None), ("x", "z", "y", None),
     [("all-to-all", 16384)]),
    ((2, 2, 2), (8, 4, 32, 32), (None, None, ("y", "z"), None), ("x", None, "z", "y"),
     [("all-to-all", 16384), ("collective-permute", 16384)]),
]


@pytest.mark.parametrize("mesh, shape, src, dst, want", MEASURED)
def test_reshard_steps_match_measured_xla(mesh, shape, src, dst, want):
    assert sorted(_steps(_mm(mesh), shape, src, dst)) == sorted(want)


def test_reshard_cost_is_the_sum_of_its_steps_and_zero_for_slicing():
    mm = _mm((2, 4))
    names = mm.mesh.axes
    src, dst = spec_from_names(("y", None, "x"), names), spec_from_names((None, None, "y"), names)
    steps = reshard_steps(mm, (8, 16, 32), 16384, src, dst)
    sec, byt = reshard_cost(mm, (8, 16, 32), 16384, src, dst)
    assert byt == sum(s[2] for s in steps) and sec == pytest.approx(sum(s[1] for s in steps))
    rep = spec_from_names((None, None), names)
    assert reshard_cost(mm, (16, 8), 512, rep, spec_from_names(("x", "y"), names)) == (0.0, 0.0)


def test_live_reshardings_on_fake_devices():
    """A few reshardings compiled now: the model's bytes equal the HLO's."""
    devs = np.array(jax.devices()[:8]).reshape(2, 4)
    mesh = Mesh(devs, ("x", "y"), axis_types=(AxisType.Auto,) * 2)
    mm = mesh_model(meshplan.Cluster.local(), LogicalMesh(("x", "y"), (2, 4)))
    for shape, src, dst in [((8, 16, 32), ("y", None, "x"), (None, None, "y")),
                            ((16, 8), (None, "x"), (None, "y")),
                            ((16, 8), (("x", "y"), None), ("y", None)),
                            ((16, 8), (None, "y"), ("x", None))]:
        s_in, s_out = NamedSharding(mesh, P(*src)), NamedSharding(mesh, P(*dst))

        def f(a, s_in=s_in, s_out=s_out):
            b = jax.lax.with_sharding_constraint(a * 2, s_in)
            return jax.lax.with_sharding_constraint(b, s_out) * 3

        f = jax.jit(f, in_shardings=s_in, out_shardings=s_out)
        text = f.lower(jax.ShapeDtypeStruct(shape, jnp.float32)).compile().as_text()
        assert hlo.collective_bytes(text) == sum(b for _, b in _steps(mm, shape, src, dst))


def test_cpu_reduce_scatter_is_an_all_reduce():
    cpu = _mm((8,), meshplan.Cluster.local())
    gpu = _mm((8,))
    assert not cpu.native_reduce_scatter and gpu.native_reduce_scatter
    assert reduce_scatter_kind(cpu) == "all-reduce" and reduce_scatter_kind(gpu) == "reduce-scatter"
    assert reduce_scatter(cpu, (0,), 4096) == all_reduce(cpu, (0,), 4096)
    assert reduce_scatter(gpu, (0,), 4096)[1] == 512


def _hosts(num_hosts, per_host):
    import json
    d = json.loads(open("examples/clusters/aws-p3.16xlarge-x4.json").read())
    d.update(name=f"{num_hosts}x{per_host}", num_hosts=num_hosts, devices_per_host=per_host,
             num_devices=num_hosts * per_host)
    return meshplan.ClusterSpec.from_dict(d)


def test_an_axis_whose_groups_straddle_hosts_pays_the_network():
    # 12 devices of hosts of 8 (8 + 4) were priced as one host (12 // 8 = 1
    # host), 100x cheaper than the 24 devices of three hosts; a pair of
    # devices split between hosts of 3 as inside a host
    three = _hosts(3, 8)
    S = 256 * 2**20
    straddle = mesh_model(three, LogicalMesh(("x", "y"), (2, 12)), submesh=(3, 8))
    whole = mesh_model(three, LogicalMesh(("x", "y"), (1, 24)), submesh=(3, 8))
    inside = mesh_model(three, LogicalMesh(("x", "y"), (3, 8)), submesh=(3, 8))
    assert straddle.links[1].crosses_hosts and not inside.links[1].crosses_hosts
    assert all_reduce(straddle, (1,), S)[0] >= all_reduce(whole, (1,), S)[0] \
        > 10 * all_reduce(inside, (1,), S)[0]
    pairs = mesh_model(_hosts(2, 3), LogicalMesh(("x", "y"), (3, 2)), submesh=(2, 3))
    assert pairs.links[1].crosses_hosts and pairs.links[1].local == 1
    # hosts the axes tile evenly are priced as before
    for shape in ((2, 8), (4, 4), (8, 2), (16, 1), (2, 2, 4), (4, 2, 2), (2, 4, 2)):
        mm = mesh_model(_hosts(2, 8), LogicalMesh(("x", "y", "z")[:len(shape)], shape),
                        submesh=(2, 8))
        for i, size in enumerate(shape):
            stride = int(np.prod(shape[i + 1:]))
            crosses = stride * size > 8
            assert mm.links[i].crosses_hosts == crosses
            assert mm.links[i].local == (max(1, min(size, 8 // stride)) if stride < 8 else 1) \
                if crosses else mm.links[i].local == size
