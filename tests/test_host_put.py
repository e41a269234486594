"""HostPut: host arrays put as jax.device_put puts them, its layouts worked
out once per (shape, dtype, sharding)."""
import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from meshplan.runtime.host_put import HostPut


def _mesh():
    return Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("a", "b"))


SPECS = [P(), P("a"), P("b", None), P(None, "a"), P(("a", "b")), P("b", "a")]


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_host_arrays_land_as_device_put_lays_them_out(spec):
    mesh = _mesh()
    sh = NamedSharding(mesh, spec)
    put = HostPut()
    rng = np.random.default_rng(0)
    for _ in range(2):      # (the second call reads the layout worked out by the first)
        xs = [rng.standard_normal((8, 16)).astype(np.float32),
              rng.integers(0, 9, (8, 16)).astype(np.int32)]
        got = put(xs, [sh, sh])
        ref = jax.device_put(xs, [sh, sh])
        for g, r, x in zip(got, ref, xs):
            assert g.sharding == r.sharding and g.dtype == r.dtype and g.shape == r.shape
            assert not g.weak_type
            for a, b in zip(sorted(g.addressable_shards, key=lambda t: t.device.id),
                            sorted(r.addressable_shards, key=lambda t: t.device.id)):
                assert a.device == b.device and a.index == b.index
                np.testing.assert_array_equal(np.asarray(a.data), np.asarray(b.data))
            np.testing.assert_array_equal(np.asarray(g), x)
    assert len(put._how) == 2


def test_what_needs_a_cast_or_is_no_array_goes_through_device_put():
    """A float64 array (jax without x64 makes it float32), a NumPy scalar
    and a jax array are left to jax.device_put, with its results."""
    sh = NamedSharding(_mesh(), P("a"))
    put = HostPut()
    xs = [np.arange(8, dtype=np.float64), np.float32(2.0), jax.numpy.arange(8)]
    shs = [sh, NamedSharding(_mesh(), P()), sh]
    got = put(xs, shs)
    ref = jax.device_put(xs, shs)
    for g, r in zip(got, ref):
        assert g.dtype == r.dtype and g.sharding == r.sharding and g.weak_type == r.weak_type
        np.testing.assert_array_equal(np.asarray(g), np.asarray(r))
