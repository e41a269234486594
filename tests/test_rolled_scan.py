"""A one-stage plan of a step that recomputes inside a ``lax.scan`` over
stacked layers runs with the scan rolled (meshplan.runtime.rolled): the
numbers of ``jax.jit``, the plan's layouts stacked, ``jax.jit``'s memory."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import meshplan
from meshplan.api import _Unstacking
from meshplan.runtime.rolled import RolledScan, _restack

L, B, H = 4, 32, 64


def _step(checkpoint: bool):
    def block(x, w):
        return jnp.tanh(jnp.tanh(x @ w[0]) @ w[1]) + x

    body = jax.checkpoint(block, prevent_cse=False) if checkpoint else block

    def loss(ws, x):
        y, _ = jax.lax.scan(lambda c, w: (body(c, w), None), x, ws)
        return (y ** 2).mean()

    def step(ws, x):
        value, g = jax.value_and_grad(loss)(ws, x)
        return ws - 0.1 * g, value
    return step


def _args():
    ws = jax.random.normal(jax.random.key(0), (L, 2, H, H)) * 0.1
    return ws, jax.random.normal(jax.random.key(1), (B, H))


def test_a_scanned_checkpoint_runs_rolled_with_the_numbers_of_jax_jit():
    ws, x = _args()
    step = meshplan.parallelize(_step(True), method=meshplan.Manual(dp=2, tp=4),
                                donate_argnums=())
    new_ws, loss = step(ws, x)
    ex = step._entry((ws, x))[1]
    assert isinstance(ex, RolledScan)
    # it moves what the plan predicts, or less (each loop-body collective once per trip)
    assert 0 < ex.comm_bytes((ws, x)) <= 1.1 * step.plan.predicted.comm_bytes_per_device
    ref_ws, ref_loss = jax.jit(_step(True))(ws, x)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(new_ws), np.asarray(ref_ws), rtol=1e-5, atol=1e-6)
    # the stacked parameters carry the plan's per-layer layout, unsplit along
    # the layers, and come back as they went in
    mesh, ins, outs = step.shardings(ws, x)
    assert ins[0].spec[0] is None and ins[0].spec == outs[0].spec
    assert new_ws.sharding.spec == ins[0].spec
    # called again (the fast path) and lowered, it is the same program
    again, _ = step(new_ws, x)
    np.testing.assert_allclose(np.asarray(again),
                               np.asarray(jax.jit(_step(True))(ref_ws, x)[0]), rtol=1e-5,
                               atol=1e-6)
    assert "while" in step.lower(ws, x).as_text()


def test_a_scan_without_checkpoint_stays_unrolled():
    # (unrolled, XLA frees each layer's values sooner than the loop does:
    # benchmarks/results/checkpoint_memory.md)
    ws, x = _args()
    step = meshplan.parallelize(_step(False), method=meshplan.ShardParallel(), donate_argnums=())
    new_ws, _ = step(ws, x)
    assert isinstance(step._entry((ws, x))[1], _Unstacking)
    np.testing.assert_allclose(np.asarray(new_ws), np.asarray(jax.jit(_step(False))(ws, x)[0]),
                               rtol=1e-5, atol=1e-6)


def test_a_plan_that_recomputes_on_its_own_stays_unrolled():
    # (the runtime's recomputation is the plan's, layer by layer; the step's
    # own checkpoints leave it nothing to replay, which it once refused)
    ws, x = _args()
    step = meshplan.parallelize(_step(True), method=meshplan.ShardParallel(remat=True),
                                donate_argnums=())
    new_ws, _ = step(ws, x)
    assert step.plan.stages[0].recompute != "none"
    assert isinstance(step._entry((ws, x))[1], _Unstacking)
    np.testing.assert_allclose(np.asarray(new_ws), np.asarray(jax.jit(_step(True))(ws, x)[0]),
                               rtol=1e-5, atol=1e-6)


def test_a_rolled_scan_that_moves_more_than_the_plan_runs_unrolled(monkeypatch):
    # XLA lays out the loop body itself: the rolled program is kept only
    # where its collectives, each once per trip, move no more than the plan
    # predicts (a flax decoder under Manual(dp=1, tp=8) moved 5x).  Here the
    # allowance is cut to nothing, so the rolled program moves too much
    import meshplan.api
    monkeypatch.setattr(meshplan.api, "ROLLED_COMM_SLACK", 0.0)
    ws, x = _args()
    step = meshplan.parallelize(_step(True), method=meshplan.Manual(dp=2, tp=4),
                                donate_argnums=())
    with pytest.warns(UserWarning, match=r"runs unrolled: rolled, .* KiB a step per device "
                                         r"against the plan's .* KiB"):
        new_ws, _ = step(ws, x)
    assert isinstance(step._entry((ws, x))[1], _Unstacking)
    np.testing.assert_allclose(np.asarray(new_ws), np.asarray(jax.jit(_step(True))(ws, x)[0]),
                               rtol=1e-5, atol=1e-6)


def test_what_a_checkpoint_replays_reshards_again_behind_its_fence():
    # a flax decoder with nn.remat blocks under Manual(dp=1, tp=8): the ILP
    # gathers each weight whole for its matmul; the backward's replay reads
    # it through the checkpoint's fence and gathers it again.  The plan's
    # communication is the compiled program's (it counted one gather: 26.3
    # against 38.9 MB)
    from benchmarks.checkpoint_memory import _flax
    from meshplan.runtime import collective_bytes
    step, args = _flax(True, scanned=False)
    ps = meshplan.parallelize(step, method=meshplan.Manual(dp=1, tp=8), donate_argnums=())
    text = ps.lower(*args).compile().as_text()
    predicted = ps.plan.predicted.comm_bytes_per_device
    assert abs(predicted - collective_bytes(text)) <= 0.001 * predicted
    assert "all-gather" in text


def test_layers_planned_apart_are_not_rolled():
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("x", "y"))
    a, b = NamedSharding(mesh, P("x", None)), NamedSharding(mesh, P(None, "y"))
    # one leaf split into two layers, then an unsplit leaf
    assert _restack([a, a, b], [2, 0]) == [NamedSharding(mesh, P(None, "x", None)), b]
    assert _restack([a, b, b], [2, 0]) is None
    assert _restack([None, None, b], [2, 0]) is None


@pytest.mark.extended
def test_a_scanned_checkpoint_keeps_the_saving_jax_jit_keeps():
    # issue 17: temp memory within 20% of jax.jit's; unrolled, these took
    # 1.40x and 2.52x (one device, XLA's memory-aware CPU scheduler)
    from _workers import checkpoint_temps
    temp = checkpoint_temps("mlp, jax.checkpoint in lax.scan",
                            "flax decoder, nn.scan(nn.remat(Block))")
    for name, (jit, ours) in temp.items():
        assert ours <= 1.2 * jit, (name, temp)
