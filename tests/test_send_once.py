"""Send once, gather on the receiver (meshplan.runtime.pipeline_transport's
SendOnce): a value replicated on the receiving stage crosses once, is
all-gathered on the receiver's devices, and equals a plain put bit for bit;
a pipeline run through it equals the old path's bit for bit."""
import jax
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

import meshplan
from meshplan.models import build_model
from meshplan.runtime import pipeline_transport as pt
from meshplan.runtime.pipeline_transport import SendOnce, moved_bytes, send_once_hop


def _mesh(ids, shape=(2, 2), names=("data", "model")):
    devs = np.array([jax.devices()[i] for i in ids]).reshape(shape)
    return Mesh(devs, names, axis_types=(AxisType.Auto,) * len(names))


SENDER, RECEIVER = (0, 1, 2, 3), (4, 5, 6, 7)


def _two_hosts(monkeypatch):
    """The 8 fake devices are one process: let the stages count as two hosts."""
    monkeypatch.setattr(pt, "one_host", lambda devices: False)


class Recorder:
    """The transport's put (``pipeline_transport.cross``), counting the bytes
    each put lands on devices outside the stage that held the value (what
    crosses between the stages)."""

    def __init__(self, monkeypatch):
        self.crossed, self.values = [], []     # bytes landed, the values' own bytes
        real = pt.cross

        def put(x, sharding, *a, **k):
            src = getattr(x, "sharding", None)
            if isinstance(x, jax.Array) and isinstance(sharding, NamedSharding) \
                    and src is not None and not (src.device_set & sharding.device_set):
                self.crossed.append(moved_bytes(src, sharding, x.shape, x.dtype.itemsize))
                self.values.append(x.nbytes)
            return real(x, sharding, *a, **k)

        monkeypatch.setattr(pt, "cross", put)


def test_a_value_replicated_twice_on_the_receiver_crosses_once(monkeypatch):
    x = np.arange(8 * 6, dtype=np.float32).reshape(8, 6)
    v = jax.device_put(x, NamedSharding(_mesh(SENDER), P("data", None)))
    target = NamedSharding(_mesh(RECEIVER), P("data", None))     # 2x over "model"
    hop = send_once_hop(target, x.shape)
    assert hop.spec == P(("data", "model"), None)
    # a plain put lands every byte on both replicas; the hop each byte once,
    # and the gather moves the other half of each shard inside the receiver
    assert moved_bytes(v.sharding, target, x.shape, 4) == 2 * x.nbytes
    assert moved_bytes(v.sharding, hop, x.shape, 4) == x.nbytes
    assert moved_bytes(hop, target, x.shape, 4) == x.nbytes

    _two_hosts(monkeypatch)
    rec = Recorder(monkeypatch)
    got = SendOnce().put(v, target)
    assert rec.crossed == [x.nbytes]                   # one put across, the value once
    assert got.sharding == target
    plain = pt.cross(v, target)
    assert rec.crossed[-1] == 2 * x.nbytes             # (the old path, for contrast)
    for a, b in zip(got.addressable_shards, plain.addressable_shards):
        assert a.device == b.device and a.index == b.index
        np.testing.assert_array_equal(np.asarray(a.data), np.asarray(b.data))


def test_on_one_host_a_value_is_put_as_it_is(monkeypatch):
    # all links are the host's own: the hop and gather would move the same bytes
    x = np.arange(8 * 6, dtype=np.float32).reshape(8, 6)
    v = jax.device_put(x, NamedSharding(_mesh(SENDER), P("data", None)))
    target = NamedSharding(_mesh(RECEIVER), P("data", None))
    rec = Recorder(monkeypatch)
    got = SendOnce().put(v, target)
    assert rec.crossed == [2 * x.nbytes] and got.sharding == target


def test_sender_of_another_mesh_shape_and_a_split_target(monkeypatch):
    _two_hosts(monkeypatch)
    x = np.arange(4 * 8 * 2, dtype=np.float32).reshape(4, 8, 2)
    v = jax.device_put(x, NamedSharding(_mesh((0, 1), (2,), ("x",)), P(None, "x")))
    # split over "model", replicated over "data": the hop splits dimension 0
    target = NamedSharding(_mesh(RECEIVER), P(None, "model"))
    assert send_once_hop(target, x.shape).spec == P("data", "model", None)
    got = SendOnce().put(v, target)
    assert got.sharding == target
    np.testing.assert_array_equal(np.asarray(got), x)


@pytest.mark.parametrize("shape,spec", [((3, 5), P()), ((4,), P("data")), ((), P())])
def test_nothing_to_split_is_a_plain_put(shape, spec, monkeypatch):
    # odd sizes no replicated axis divides, no replication, a scalar
    x = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)
    mesh = _mesh(RECEIVER, (4,), ("data",))
    target = NamedSharding(mesh, spec)
    assert send_once_hop(target, shape) is target
    v = jax.device_put(x, NamedSharding(_mesh(SENDER, (4,), ("data",)), P()))
    rec = Recorder(monkeypatch)
    got = SendOnce().put(v, target)
    assert len(rec.crossed) == 1 and got.sharding == target
    np.testing.assert_array_equal(np.asarray(got), x)


MODELS = {"mlp": {"optimizer": "sgd", "layers": "4"},
          "gpt": {"optimizer": "sgd", "layers": "2", "hidden": "32", "seq_len": "16",
                  "vocab": "64", "batch": "16"}}


@pytest.mark.parametrize("name", ["mlp", pytest.param("gpt", marks=pytest.mark.slow)])
def test_pipeline_equals_the_per_replica_path_bit_for_bit(name, monkeypatch):
    m = build_model(name, MODELS[name])
    state, batch = jax.device_get(m.init(0))
    plan = meshplan.plan(m.train_step, state, batch,
                         method=meshplan.Manual(dp=2, tp=2, pp=2, num_micro_batches=2))
    assert len(plan.stages) == 2

    def run():
        _two_hosts(monkeypatch)
        rec = Recorder(monkeypatch)
        step = meshplan.parallelize(m.train_step, plan=plan)
        out = jax.device_get(step(state, batch))
        monkeypatch.undo()
        return out, sum(rec.crossed), sum(rec.values)

    new, new_bytes, distinct = run()
    monkeypatch.setattr(pt.SendOnce, "_route", lambda self, v, target: None)
    old, old_bytes, _ = run()
    for a, b in zip(jax.tree_util.tree_leaves(new), jax.tree_util.tree_leaves(old)):
        np.testing.assert_array_equal(a, b)
    ref_state, ref_metrics = jax.device_get(jax.jit(m.train_step)(state, batch))
    np.testing.assert_allclose(new[1]["loss"], ref_metrics["loss"], rtol=1e-5)
    # activations on, their gradients back: fewer bytes cross between the stages
    print(name, "bytes across stages, send-once", new_bytes, "per replica", old_bytes)
    assert 0 < new_bytes < old_bytes
    assert new_bytes == distinct        # every byte of every value crossed once


def test_a_put_of_whole_shards_copies_them_as_device_put_would():
    """Within a host, where shard k of the sender is what device k of the
    receiver wants, the transport copies the shards itself (jax.device_put's
    last step, without its dispatch); elsewhere it calls jax.device_put."""
    x = np.arange(8 * 6, dtype=np.float32).reshape(8, 6)
    # (the second crosses in the sender's layout and is gathered on the
    # receiver; the third comes from a mesh of another shape)
    for have, want, copied in ((P("data", None), P("data", None), True),
                               (P("data", None), P(None, "model"), True),
                               (P("data"), P(None, "model"), False)):
        sender = _mesh(SENDER, *(((4,), ("data",)) if len(have) == 1 else ()))
        v = jax.device_put(x, NamedSharding(sender, have))
        target = NamedSharding(_mesh(RECEIVER), want)
        send = SendOnce()
        got = send.put(v, target)
        (route,) = send._routes.values()
        assert (route[3] is not None) == copied, (have, want)
        ref = jax.device_put(v, target)
        assert got.sharding == target and got.committed
        for a, b in zip(got.addressable_shards, ref.addressable_shards):
            assert a.device == b.device and a.index == b.index
            np.testing.assert_array_equal(np.asarray(a.data), np.asarray(b.data))
