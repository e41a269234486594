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
