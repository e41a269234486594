"""Plan files: refused when from a newer/unknown format, never half-written.

* ``Plan.from_json`` (and so ``parallelize(plan=...)`` / ``meshplan run
  --plan``) refuses a plan of another format version, naming it.
* ``meshplan plan --json OUT`` writes OUT only once planning succeeded, via
  a temporary file and an atomic rename: Ctrl-C while planning (a real
  SIGINT to a subprocess), a solver failure, or an interruption during the
  write leave no OUT (or the previous OUT intact) and no temporary files.
"""
from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import meshplan
from meshplan import cli
from meshplan.models import build_model

ROOT = pathlib.Path(__file__).resolve().parents[1]
CLUSTER = str(ROOT / "examples" / "clusters" / "dgx-a100-x1.json")


@pytest.fixture(scope="module")
def plan_json() -> str:
    m = build_model("mlp", {"optimizer": "sgd"})
    return meshplan.plan(m.train_step, *m.abstract_args,
                         cluster=meshplan.load_cluster(CLUSTER),
                         method=meshplan.DataParallel()).to_json()


@pytest.mark.parametrize("version", ["meshplan.plan/2", "meshplan.plan/1.1", "other.plan/1",
                                     None, 1])
def test_plan_of_another_format_version_is_refused_naming_it(plan_json, version):
    d = json.loads(plan_json)
    if version is None:
        del d["format"]
    else:
        d["format"] = version
    with pytest.raises(meshplan.PlanFormatError) as e:
        meshplan.Plan.from_json(json.dumps(d))
    assert repr(version) in str(e.value)
    assert "meshplan.plan/1" in str(e.value)       # and what this version reads
    assert meshplan.Plan.from_json(plan_json).to_json() == plan_json


@pytest.mark.parametrize("programs", ["x", [1], [0, 0], [True, 0], [1, -1]])
def test_hand_edited_program_counts_are_refused_naming_the_field(plan_json, programs):
    d = json.loads(plan_json)
    d["programs"] = programs
    with pytest.raises(meshplan.PlanFormatError, match=r"programs .*give \[per micro-batch, per step\]"):
        meshplan.Plan.from_json(json.dumps(d))
    d["programs"] = [1, 0]
    assert meshplan.Plan.from_json(json.dumps(d)).programs == (1, 0)


def test_cli_run_refuses_a_newer_plan_file(plan_json, tmp_path, capsys):
    d = json.loads(plan_json)
    d["format"] = "meshplan.plan/7"
    path = tmp_path / "newer.json"
    path.write_text(json.dumps(d))
    rc = cli.main(["run", "--model", "mlp", "--plan", str(path)])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1
    assert "'meshplan.plan/7'" in err


def _leftovers(directory: pathlib.Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


@pytest.mark.parametrize("failure, rc, words", [
    (KeyboardInterrupt(), 130, "interrupted"),
    (meshplan.SolverError("ILP back end 'highs' found no solution within its time limit"),
     2, "no solution within its time limit"),
    (meshplan.InfeasiblePlanError("no plan fits"), 2, "no plan fits"),
])
def test_cli_plan_that_fails_writes_no_file(tmp_path, monkeypatch, capsys, failure, rc, words):
    import meshplan.planning

    def fail(*a, **k):
        raise failure

    monkeypatch.setattr(meshplan.planning, "plan_step", fail)
    out = tmp_path / "plan.json"
    got = cli.main(["plan", "--model", "mlp", "--cluster", CLUSTER, "--method", "shard",
                    "--json", str(out)])
    assert got == rc
    assert words in capsys.readouterr().err
    assert _leftovers(tmp_path) == []


def test_interrupted_write_keeps_the_previous_file(tmp_path, monkeypatch):
    out = tmp_path / "plan.json"
    out.write_text("previous plan")

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli.os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        cli._write_text(str(out), "new plan " * 1000)
    monkeypatch.undo()
    assert out.read_text() == "previous plan"
    assert _leftovers(tmp_path) == ["plan.json"]
    cli._write_text(str(out), "new plan")
    assert out.read_text() == "new plan" and _leftovers(tmp_path) == ["plan.json"]


def test_ctrl_c_while_planning_leaves_no_plan_file(tmp_path):
    """A real SIGINT to ``meshplan plan`` in the middle of the pipeline search."""
    out = tmp_path / "plan.json"
    # (PYTHONFAULTHANDLER: a SIGABRT makes it print every thread's stack)
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1")
    env.pop("XLA_FLAGS", None)
    cmd = [sys.executable, "-m", "meshplan.cli", "--verbose", "plan", "--model", "gpt",
           "--model-arg", "layers=4", "--model-arg", "hidden=64", "--model-arg", "heads=4",
           "--model-arg", "seq_len=32", "--model-arg", "vocab=128", "--model-arg", "batch=16",
           "--cluster", str(ROOT / "examples" / "clusters" / "dgx-a100-x2.json"),
           "--method", "auto", "--json", str(out)]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        # --verbose reports each finished step on stderr: interrupt once tracing
        # is done, i.e. inside the pipeline search (several seconds at least),
        # however slowly this machine got there
        seen = []
        for line in proc.stderr:
            seen.append(line)
            if "tracing" in line:
                break
        assert proc.poll() is None, "".join(seen)
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        try:
            stdout, rest = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            # (seen once in CI, 2026-12-05, not reproduced since: say where it hangs)
            proc.send_signal(signal.SIGABRT)
            _, rest = proc.communicate(timeout=30)
            pytest.fail("meshplan plan did not stop within 60 s of Ctrl-C; its threads:\n"
                        + "".join(seen) + rest[-6000:])
        stderr = "".join(seen) + rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, stderr[-2000:]
    assert "interrupted" in stderr
    assert "Traceback" not in stderr and "Exception ignored" not in stderr, stderr[-2000:]
    assert not out.exists() and _leftovers(tmp_path) == []
    # no ILP worker process of the search outlives it
    if os.path.isdir("/proc"):
        time.sleep(0.5)
        alive = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if str(out).encode() in f.read():
                        alive.append(int(pid))
            except OSError:
                pass
        assert alive == [], alive


def _mlp_step():
    import jax
    import jax.numpy as jnp

    def loss(p, x, y):
        return jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"] - y) ** 2)

    def step(p, batch):
        value, g = jax.value_and_grad(loss)(p, *batch)
        return jax.tree.map(lambda a, b: a - 0.1 * b, p, g), value

    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
    p = {"w1": jax.random.normal(k1, (256, 1024)) / 16, "w2": jax.random.normal(k2, (1024, 256)) / 32}
    batch = (jax.random.normal(k3, (512, 256)), jnp.zeros((512, 256)))
    return step, p, batch


def test_a_spec_edited_on_one_side_of_an_update_is_refused_and_on_both_runs():
    import jax
    import numpy as np
    step, p, batch = _mlp_step()
    plan = meshplan.plan(step, p, batch, cluster=meshplan.Cluster.local(),
                         method=meshplan.ShardParallel())
    d = json.loads(plan.to_json())
    st = d["stages"][0]
    assert st["params"]["['w1']"] == st["outputs"]["[0]['w1']"]   # (as planned)
    st["params"]["['w1']"] = [None, None]
    one_side = meshplan.parallelize(step, plan=meshplan.Plan.from_dict(d), donate_argnums=(0,))
    with pytest.raises(meshplan.PlanFormatError) as e:
        one_side(p, batch)
    assert "['w1']" in str(e.value) and "[0]['w1']" in str(e.value)
    assert "same spec" in str(e.value)
    # both sides edited: the parameter lives in the edited layout, step after step
    st["outputs"]["[0]['w1']"] = [None, None]
    both = meshplan.parallelize(step, plan=meshplan.Plan.from_dict(d), donate_argnums=(0,))
    want, got = p, jax.tree.map(jax.numpy.copy, p)
    for _ in range(2):
        want, lw = jax.jit(step)(want, batch)
        got, lg = both(got, batch)
        assert tuple(got["w1"].sharding.spec) in ((), (None, None))
    np.testing.assert_allclose(float(lg), float(lw), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(got["w1"]), np.asarray(want["w1"]), rtol=1e-4, atol=1e-6)


def _stage0(d):
    return d["stages"][0]


@pytest.mark.parametrize("edit, words", [
    (lambda d: d.update(stages=[]), "no stages"),
    (lambda d: d.update(num_micro_batches=0), "num_micro_batches is 0"),
    (lambda d: _stage0(d)["params"].update({"['w1']": [1, None]}), "['w1']: a spec's entry"),
    (lambda d: _stage0(d)["params"].update({"['w1']": None}), "['w1']: a spec is a list"),
    (lambda d: _stage0(d).update(devices=[0, 0] + _stage0(d)["devices"][2:]),
     "lists device 0 twice"),
    (lambda d: _stage0(d).update(devices=_stage0(d)["devices"][:4]), "has 4 devices for"),
    # (a one-program plan's tensor ids name the whole batch's graph: it ran
    # one program, ignoring the count, before)
    (lambda d: d.update(num_micro_batches=2), "re-plan with num_micro_batches=2"),
    # (hand edits that reached the runtime as numpy's or Python's own errors)
    (lambda d: _stage0(d)["logical_mesh"].update(shape=[-2, -4]), "a size of 1 or more"),
    (lambda d: _stage0(d)["logical_mesh"].update(axes=["x", "x"]), "repeat a name"),
    (lambda d: d.pop("stages"), "the key 'stages' is missing"),
    (lambda d: _stage0(d).pop("devices"), "in stages[0]: the key 'devices' is missing"),
    (lambda d: _stage0(d).update(params=None), "in stages[0]: a value has the wrong type"),
    # (hand edits that ran as something else, or as written: sweep C of stop 94)
    (lambda d: d.update(num_micro_batches=2.5), "must be an integer, got 2.5"),
    (lambda d: d.update(num_micro_batches="1"), "must be an integer, got '1'"),
    (lambda d: d.update(num_micro_batches=True), "must be an integer, got True"),
    (lambda d: _stage0(d).update(remat="yes"), "remat must be true or false"),
    (lambda d: d.update(schedule="foo"), "schedule 'foo' is none of"),
    (lambda d: _stage0(d).update(layers=[1, 0]), "stage 0 has layers 1..0"),
    (lambda d: d["stages"].append(json.loads(json.dumps(_stage0(d)))),
     "layer 0 is in stages 0 and 1"),
    (lambda d: _stage0(d).update(submesh=[3, 5]), "submesh 3x5 for its 8 devices"),
])
def test_a_plan_file_no_runtime_can_follow_is_one_clear_error(edit, words):
    step, p, batch = _mlp_step()
    d = json.loads(meshplan.plan(step, p, batch, cluster=meshplan.Cluster.local(),
                                 method=meshplan.ShardParallel()).to_json())
    edit(d)
    with pytest.raises(meshplan.PlanFormatError, match="malformed plan JSON") as e:
        meshplan.Plan.from_dict(d)
    assert words in str(e.value)


def test_a_plan_key_the_arguments_lack_is_refused_naming_it():
    step, p, batch = _mlp_step()
    d = json.loads(meshplan.plan(step, p, batch, cluster=meshplan.Cluster.local(),
                                 method=meshplan.ShardParallel()).to_json())
    params = _stage0(d)["params"]
    params["['W1']"] = params.pop("['w1']")     # (a typo: the leaf is 'w1')
    step_run = meshplan.parallelize(step, plan=meshplan.Plan.from_dict(d))
    with pytest.raises(meshplan.StalePlanError, match=r"\['W1'\]"):
        step_run(p, batch)


def test_parallelize_with_a_plan_refuses_what_it_would_ignore(plan_json):
    m = build_model("mlp", {"optimizer": "sgd"})
    plan = meshplan.Plan.from_json(plan_json)
    for bad, words in [(dict(plan=plan_json), "takes a meshplan.Plan, not str"),
                       (dict(plan=json.loads(plan_json)), "Plan.from_json(text)"),
                       (dict(plan=plan, method=meshplan.Auto()), "drop method="),
                       (dict(plan=plan, cluster=meshplan.Cluster.local()), "drop cluster="),
                       (dict(plan=plan, batch_argnums=(0,)), "batch_argnums=(1,)")]:
        with pytest.raises(meshplan.MeshplanError, match=None) as e:
            meshplan.parallelize(m.train_step, **bad)
        assert words in str(e.value), (bad.keys(), str(e.value))
    assert meshplan.parallelize(m.train_step, plan=plan, batch_argnums=1).plan is plan


def test_api_misuse_of_files_is_one_clear_error(plan_json, tmp_path):
    with pytest.raises(meshplan.PlanFormatError, match="takes the plan's JSON text, not NoneType"):
        meshplan.Plan.from_json(None)
    cluster = meshplan.load_cluster(CLUSTER)
    with pytest.raises(meshplan.ClusterSpecError, match="ClusterSpec.from_dict"):
        meshplan.load_cluster(cluster.to_dict())
    with pytest.raises(meshplan.ClusterSpecError, match=r"Cluster\.local\(\)"):
        meshplan.load_cluster("local")
    (tmp_path / "file").write_text("")
    with pytest.raises(meshplan.CheckpointError, match="cannot create the checkpoint directory"):
        meshplan.save_state(tmp_path / "file" / "ckpt", {"w": np.ones(3)})


@pytest.mark.parametrize("where", ["finalizer", "__del__", "plain"])
def test_ctrl_c_inside_a_finalizer_is_kept_for_the_next_checkpoint(where):
    # (CI, 2026-12-07: a SIGINT landed in a weakref finalizer the collector
    # ran; the KeyboardInterrupt raised there was printed as "Exception
    # ignored" and lost)
    import weakref
    from meshplan.progress import Progress
    progress, raised = Progress(), []

    def press() -> None:
        try:
            signal.getsignal(signal.SIGINT)(signal.SIGINT, sys._getframe())
        except KeyboardInterrupt:
            raised.append(True)

    class Held:
        def __del__(self):
            press()
    with progress.interruptible():
        if where == "finalizer":
            obj = type("Plain", (), {})()
            weakref.finalize(obj, press)
            del obj
        elif where == "__del__":
            Held()
        else:
            press()
        assert raised == ([True] if where == "plain" else [])
        with pytest.raises(KeyboardInterrupt):
            progress.check()
