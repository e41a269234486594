"""Checkpoints across plans: ``meshplan.save_state`` / ``meshplan.restore_state``.

State trained under one plan is saved and restored under another (other mesh
shape, other device count, a pipeline plan whose stages own different
parameters on different devices); every array lands directly on its new
sharding, bit-exact.  A save that is interrupted (an injected failure, or the
saving process killed with SIGKILL) never leaves a checkpoint that loads.
"""
from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import jax
import numpy as np
import pytest

import meshplan
from meshplan import checkpoint as ckpt
from meshplan.models import build_model

ROOT = pathlib.Path(__file__).resolve().parents[1]
GPT = {"optimizer": "sgd", "layers": 2, "hidden": 32, "heads": 2, "seq_len": 16,
       "vocab": 64, "batch": 8}


def _local():
    return meshplan.Cluster.local()


def _flat(tree):
    return {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _assert_bit_exact(got, want):
    g, w = _flat(got), _flat(want)
    assert set(g) == set(w)
    for k in w:
        a, b = np.asarray(g[k]), np.asarray(w[k])
        assert a.dtype == b.dtype and a.shape == b.shape, k
        assert np.array_equal(a, b), f"{k} differs after restore"


def _assert_close(got, want, rtol=1e-5):
    g, w = _flat(got), _flat(want)
    for k in w:
        ref = np.asarray(w[k], np.float64)
        scale = float(np.max(np.abs(ref))) or 1.0
        np.testing.assert_allclose(np.asarray(g[k], np.float64), ref, rtol=rtol,
                                   atol=rtol * scale, err_msg=k)


def _expected_placement(plan, like):
    """key -> (device ids, spec) every state leaf must have under ``plan``:
    the first stage naming the leaf owns it; others are replicated on stage 0."""
    devices = sorted(jax.devices(), key=lambda d: d.id)
    out = {}
    for key in _flat(like):
        owner = next((s for s in plan.stages if s.param_spec(key) is not None), None)
        stage = owner or plan.stages[0]
        spec = owner.param_spec(key) if owner else ()
        out[key] = ({devices[i].id for i in stage.devices}, spec)
    return out


def _check_placement(restored, plan, like):
    want = _expected_placement(plan, like)
    for key, leaf in _flat(restored).items():
        ids, spec = want[key]
        assert {d.id for d in leaf.sharding.device_set} == ids, key
        got = tuple(leaf.sharding.spec) + (None,) * (leaf.ndim - len(leaf.sharding.spec))
        full = tuple(spec) + (None,) * (leaf.ndim - len(spec))
        assert got == full, (key, got, full)
    return want


@pytest.fixture(scope="module")
def gpt():
    model = build_model("gpt", GPT)
    state, batch0 = model.init(0)
    batches = [model.init(k + 1)[1] for k in range(4)]
    ref = jax.jit(model.train_step)
    ref_states, s = [], state
    for b in batches:
        s, _ = ref(s, b)
        ref_states.append(s)
    return model, state, batches, ref_states


@pytest.fixture(scope="module")
def trained(gpt, tmp_path_factory):
    """2 steps under a 2 x 4 ShardParallel plan, then saved."""
    model, state, batches, _ = gpt
    step = meshplan.parallelize(model.train_step, cluster=_local(),
                                method=meshplan.ShardParallel(mesh_shape=(2, 4)))
    s = jax.tree.map(np.array, state)
    for b in batches[:2]:
        s, _ = step(s, b)
    assert step.plan.stages[0].logical_mesh.shape == (2, 4)
    path = tmp_path_factory.mktemp("ckpt") / "step2"
    meshplan.save_state(path, s)
    return path, s


def test_acceptance_2x4_then_4_devices_matches_4_plain_steps(gpt, trained):
    model, state, batches, ref_states = gpt
    path, saved = trained
    # 2 x 4 -> a 2 x 2 mesh over 4 devices: another mesh shape and device count
    cluster4 = _local().with_devices(1, 4)
    plan4 = meshplan.plan(model.train_step, *model.abstract_args, cluster=cluster4,
                          method=meshplan.ShardParallel(mesh_shape=(2, 2)))
    assert plan4.stages[0].devices == (0, 1, 2, 3)
    restored = meshplan.restore_state(path, like=model.abstract_args[0], plan=plan4)
    _assert_bit_exact(restored, saved)
    _check_placement(restored, plan4, model.abstract_args[0])

    step = meshplan.parallelize(model.train_step, plan=plan4)
    s = restored
    for b in batches[2:]:
        s, metrics = step(s, b)
    # the restored arrays were already where the plan wants them
    ex = step._cache[next(iter(step._cache))][1]
    for leaf, want in zip(jax.tree.leaves(restored),
                          jax.tree.leaves(ex.in_shardings[0])):
        assert leaf.sharding.is_equivalent_to(want, leaf.ndim)
    _assert_close(s, ref_states[3])
    ref_loss = float(jax.jit(model.train_step)(ref_states[2], batches[3])[1]["loss"])
    assert float(metrics["loss"]) == pytest.approx(ref_loss, rel=1e-5)


def test_restore_under_a_two_stage_pipeline_plan(gpt, trained):
    model, state, batches, ref_states = gpt
    path, saved = trained
    pplan = meshplan.plan(model.train_step, *model.abstract_args, cluster=_local(),
                          method=meshplan.Manual(dp=2, tp=2, pp=2, num_micro_batches=2))
    assert len(pplan.stages) == 2
    assert set(pplan.stages[0].devices).isdisjoint(pplan.stages[1].devices)
    # each stage owns different parameters
    own0 = {k for k, _ in pplan.stages[0].params}
    own1 = {k for k, _ in pplan.stages[1].params}
    assert own0 - own1 and own1 - own0
    # the plan may come as a Plan or as JSON read back
    pplan = meshplan.Plan.from_json(pplan.to_json())
    restored = meshplan.restore_state(path, like=state, plan=pplan)
    _assert_bit_exact(restored, saved)
    want = _check_placement(restored, pplan, state)
    assert len({frozenset(ids) for ids, _ in want.values()}) == 2   # both submeshes used

    # the values are the trained state: 2 more plain steps reach step 4
    s = jax.device_put(restored, jax.devices()[0])
    step = jax.jit(model.train_step)
    for b in batches[2:]:
        s, _ = step(s, b)
    _assert_close(s, ref_states[3])


# (a restore under a pipeline plan: test_restore_under_a_two_stage_pipeline_plan)
@pytest.mark.extended
def test_restore_then_train_under_the_pipeline_runtime(gpt, trained):
    model, state, batches, ref_states = gpt
    path, _ = trained
    pplan = meshplan.plan(model.train_step, *model.abstract_args, cluster=_local(),
                          method=meshplan.Manual(dp=2, tp=2, pp=2, num_micro_batches=2))
    restored = meshplan.restore_state(path, like=state, plan=pplan)
    step = meshplan.parallelize(model.train_step, plan=pplan)
    s = restored
    for b in batches[2:]:
        s, _ = step(s, b)
    _assert_close(s, ref_states[3])


def test_restore_into_a_parallelized_step_and_without_a_plan(gpt, trained):
    model, state, batches, _ = gpt
    path, saved = trained
    step = meshplan.parallelize(model.train_step, cluster=_local(),
                                method=meshplan.DataParallel())
    with pytest.raises(meshplan.CheckpointError, match="plan_for"):
        meshplan.restore_state(path, like=state, plan=step)
    step.plan_for(state, batches[0])
    restored = meshplan.restore_state(path, like=state, plan=step)
    _assert_bit_exact(restored, saved)
    assert all(len(x.sharding.device_set) == 8 for x in jax.tree.leaves(restored))
    # no plan: the shardings of `like` (here host arrays: the default device)
    plain = meshplan.restore_state(path, like=jax.tree.map(np.asarray, state))
    _assert_bit_exact(plain, saved)


def test_mismatched_state_is_refused_naming_the_leaf(gpt, trained, tmp_path):
    model, state, _, _ = gpt
    path, _ = trained
    other = build_model("gpt", {**GPT, "hidden": 48}).abstract_args[0]
    with pytest.raises(meshplan.CheckpointError, match=r"\['params'\]\['h0'\].*saved as float32"):
        meshplan.restore_state(path, like=other)
    fewer = {"params": {k: v for k, v in state["params"].items() if k != "wpe"}}
    with pytest.raises(meshplan.CheckpointError, match=r"wpe"):
        meshplan.restore_state(path, like=fewer)
    with pytest.raises(meshplan.CheckpointError, match="already exists"):
        meshplan.save_state(path, state)
    with pytest.raises(meshplan.CheckpointError, match="no checkpoint"):
        meshplan.restore_state(tmp_path / "nothing", like=state)
    # overwrite=True replaces checkpoints, never other directories
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(meshplan.CheckpointError, match="not a meshplan checkpoint"):
        meshplan.save_state(tmp_path / "mine", _small_state(0), overwrite=True)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


def test_typed_prng_keys_round_trip_with_their_implementation(tmp_path):
    # (a new-style key in a train state, as flax nnx.Rngs and dropout steps keep one)
    state = {"w": np.ones((8, 4), np.float32), "key": jax.random.key(3, impl="rbg"),
             "keys": jax.random.split(jax.random.key(5), 4)}
    meshplan.save_state(tmp_path / "ck", state)
    like = jax.eval_shape(lambda: state)
    got = meshplan.restore_state(tmp_path / "ck", like=like)
    for k in ("key", "keys"):
        assert got[k].dtype == state[k].dtype, k
        assert np.array_equal(jax.random.key_data(got[k]), jax.random.key_data(state[k])), k
    assert np.array_equal(jax.random.bits(got["key"]), jax.random.bits(state["key"]))
    other = {**like, "key": jax.eval_shape(lambda: jax.random.key(0))}     # threefry
    with pytest.raises(meshplan.CheckpointError, match=r"\['key'\] was saved as key<rbg>"):
        meshplan.restore_state(tmp_path / "ck", like=other)


def test_python_scalars_are_stored_as_jax_takes_them(tmp_path):
    """A step counter and a learning rate held as Python numbers (a flax
    TrainState saved before its first step) were stored as int64 and float64,
    so a restore shaped by jax.eval_shape (int32, float32) was refused."""
    init = lambda: {"w": np.ones((4, 4), np.float32), "step": 0, "lr": 0.1, "done": False}
    meshplan.save_state(tmp_path / "ck", init())
    for like in (jax.eval_shape(init), init()):
        got = meshplan.restore_state(tmp_path / "ck", like=like)
        assert {k: str(v.dtype) for k, v in got.items()} == {
            "w": "float32", "step": "int32", "lr": "float32", "done": "bool"}
        assert (int(got["step"]), float(got["lr"])) == (0, np.float32(0.1))
    # (as earlier versions stored them: 64-bit scalars, still restored)
    meshplan.save_state(tmp_path / "old", {**init(), "step": np.int64(7), "lr": np.float64(0.5)})
    got = meshplan.restore_state(tmp_path / "old", like=jax.eval_shape(init))
    assert (str(got["step"].dtype), int(got["step"]), float(got["lr"])) == ("int32", 7, 0.5)
    with pytest.raises(meshplan.CheckpointError, match=r"\['w'\] was saved as float32"):
        meshplan.restore_state(tmp_path / "old", like={**init(), "w": np.ones((4, 4), np.int32)})


def test_a_strong_leaf_where_the_plan_had_a_weak_one_is_planned_again(tmp_path):
    """``plan_for(jax.eval_shape(init), ...)`` plans a Python 0 as a weakly
    typed int32; the restored counter is a strong int32, which jax traces to
    other equations.  The step reused the weak plan and failed with a stale
    constraint on an internal tensor; it now plans the strong one apart."""
    def step(s, x):
        loss, g = jax.value_and_grad(lambda w: jax.numpy.mean((x @ w) ** 2))(s["w"])
        return {"w": s["w"] - 0.1 * g, "step": s["step"] + 1}, loss
    init = lambda: {"w": np.full((8, 8), 0.1, np.float32), "step": 0}
    x = np.linspace(-1, 1, 64, dtype=np.float32).reshape(8, 8)
    meshplan.save_state(tmp_path / "ck", jax.jit(step)(init(), x)[0])
    par = meshplan.parallelize(step, method=meshplan.ShardParallel(), batch_argnums=(1,))
    like = jax.eval_shape(init)
    state = meshplan.restore_state(tmp_path / "ck", like=like, plan=par.plan_for(like, x))
    assert not state["step"].weak_type
    got, loss = par(state, x)
    want, ref = jax.jit(step)(jax.jit(step)(init(), x)[0], x)
    assert int(got["step"]) == 2 and np.allclose(loss, ref, rtol=1e-6)
    assert np.allclose(got["w"], want["w"], rtol=1e-6)


# ---------------------------------------------------------------------------
# interrupted saves
# ---------------------------------------------------------------------------

def _small_state(seed: int):
    rng = np.random.default_rng(seed)
    return {"w": rng.standard_normal((64, 32)).astype(np.float32),
            "b": rng.standard_normal((32,)).astype(np.float32),
            "n": np.int32(seed)}


def test_injected_failure_mid_save_leaves_nothing_that_loads(tmp_path, monkeypatch):
    path = tmp_path / "ck"
    first = _small_state(1)

    def boom(*a, **k):
        raise OSError("disk full (injected)")

    # fails after orbax has written every array, before the commit
    monkeypatch.setattr(ckpt, "_write_marker", boom)
    with pytest.raises(OSError, match="injected"):
        meshplan.save_state(path, first)
    assert not path.exists()
    with pytest.raises(meshplan.CheckpointError, match="interrupted save"):
        meshplan.restore_state(path, like=first)
    monkeypatch.undo()

    # the next save clears the partial directory and commits
    meshplan.save_state(path, first)
    assert not pathlib.Path(str(path) + ckpt._PARTIAL).exists()
    _assert_bit_exact(meshplan.restore_state(path, like=first), first)

    # a failed overwrite keeps the previous complete checkpoint
    second = _small_state(2)
    monkeypatch.setattr(ckpt, "_write_marker", boom)
    with pytest.raises(OSError):
        meshplan.save_state(path, second, overwrite=True)
    monkeypatch.undo()
    _assert_bit_exact(meshplan.restore_state(path, like=first), first)
    meshplan.save_state(path, second, overwrite=True)
    _assert_bit_exact(meshplan.restore_state(path, like=second), second)
    assert not pathlib.Path(str(path) + ckpt._OLD).exists()

    # a directory without the marker (e.g. copied half-way) is refused
    (path / ckpt.MARKER).unlink()
    with pytest.raises(meshplan.CheckpointError, match="not a complete"):
        meshplan.restore_state(path, like=second)


_KILLED_SAVER = textwrap.dedent("""
    import os, sys, time
    import numpy as np
    import meshplan
    from meshplan import checkpoint as ckpt
    path, mode = sys.argv[1], sys.argv[2]
    rng = np.random.default_rng(0)
    state = {f"w{i}": rng.standard_normal((256, 1024)).astype(np.float32) for i in range(24)}
    if mode == "before-commit":
        def hang(*a, **k):
            print("WRITTEN", flush=True)
            time.sleep(600)
        ckpt._write_marker = hang
    print("SAVING", flush=True)
    meshplan.save_state(path, state, overwrite=True)
    print("DONE", flush=True)
""")


def _spawn_saver(path: pathlib.Path, mode: str) -> subprocess.Popen:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
               XLA_FLAGS="--xla_force_host_platform_device_count=2")
    return subprocess.Popen([sys.executable, "-c", _KILLED_SAVER, str(path), mode], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_for(proc: subprocess.Popen, word: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    lines = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if line.strip() == word:
            return
    proc.kill()
    raise AssertionError(f"saver never printed {word}:\n{''.join(lines)[-3000:]}")


def test_save_killed_by_sigkill_never_loads_as_complete(tmp_path):
    """The saving process is killed (1) after every array is written but
    before the commit, (2) at an arbitrary moment while orbax writes.  Either
    way ``path`` holds nothing that loads, or (2 only, if the kill came late)
    the complete state."""
    like = {f"w{i}": jax.ShapeDtypeStruct((256, 1024), np.float32) for i in range(24)}
    path = tmp_path / "ck"
    proc = _spawn_saver(path, "before-commit")
    try:
        _wait_for(proc, "WRITTEN")
        assert pathlib.Path(str(path) + ckpt._PARTIAL, "state").exists()
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        proc.kill()
    assert not path.exists()
    with pytest.raises(meshplan.CheckpointError, match="interrupted save"):
        meshplan.restore_state(path, like=like)

    proc = _spawn_saver(path, "anywhere")
    try:
        _wait_for(proc, "SAVING")
        time.sleep(0.3)                    # somewhere inside orbax's write
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        proc.kill()
    if path.exists():                      # the save got through before the kill
        rng = np.random.default_rng(0)
        want = {f"w{i}": rng.standard_normal((256, 1024)).astype(np.float32) for i in range(24)}
        _assert_bit_exact(meshplan.restore_state(path, like=like), want)
    else:
        with pytest.raises(meshplan.CheckpointError):
            meshplan.restore_state(path, like=like)
