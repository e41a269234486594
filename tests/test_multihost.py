"""The same decorated step in two processes under ``jax.distributed``.

Two worker processes (tests/multihost_worker.py) with 4 CPU devices each join
on 127.0.0.1 with gloo collectives; each trains the built-in models under
``meshplan.parallelize`` (``Cluster.local()``: a mesh over all 8 devices of
both processes), feeding its own half of every batch.  The losses and the
final parameters they gather must match a plain ``jax.jit`` of the step on the
full batch, computed here.
"""
from __future__ import annotations

import json
import pathlib
import sys

import jax
import numpy as np
import pytest

from meshplan.models import build_model

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _workers import finish, launch, reference_run  # noqa: E402
from multihost_worker import save_data  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "multihost_worker.py"
NPROC, LOCAL_DEVICES, STEPS = 2, 4, 3
TIMEOUT_S = 100          # the whole run of both workers (a normal run: 20-50 s)
GRACE_S = 10             # for a worker whose peer failed

GPT = {"optimizer": "sgd", "layers": 1, "hidden": 32, "heads": 2, "seq_len": 16,
       "vocab": 64, "batch": 8}
MLP = {"optimizer": "sgd"}
CASES = [
    {"label": "mlp-shard-8", "model": "mlp", "config": MLP, "mesh_shape": [8]},
    {"label": "mlp-data", "model": "mlp", "config": MLP, "method": "data"},
    {"label": "gpt-shard-2x4", "model": "gpt", "config": GPT, "mesh_shape": [2, 4]},
]


@pytest.mark.multiprocess
@pytest.mark.extended      # (about a minute: two jax processes)
def test_two_processes_match_a_single_process_reference(tmp_path: pathlib.Path) -> None:
    data, cases, references = {}, [], {}
    for case in CASES:
        key = (case["model"], json.dumps(case["config"], sort_keys=True))
        if key not in data:
            data[key] = f"data{len(data) + 1}.npz"
            state, batches, losses, params = reference_run(case["model"], case["config"], STEPS)
            save_data(tmp_path / data[key], state, batches)
            references[key] = (losses, params)
        cases.append({**case, "steps": STEPS, "data": data[key]})
    procs, logs = launch(WORKER, tmp_path, cases, NPROC, LOCAL_DEVICES)
    summaries = finish(tmp_path, procs, logs, TIMEOUT_S, GRACE_S)

    for pid, s in enumerate(summaries):
        assert (s["process_index"], s["process_count"]) == (pid, NPROC)
        assert (s["devices"], s["local_devices"]) == (NPROC * LOCAL_DEVICES, LOCAL_DEVICES)
        # the batch assembler: every layout rebuilds the global batch from the halves
        for name, r in s["assembler"].items():
            assert r["equal"] and r["sharding_kept"], (pid, name, r)
        assert s["assembler"]["x"]["direct"] and s["assembler"]["xy"]["direct"]
        assert not s["assembler"]["replicated"]["direct"]

    for case in CASES:
        label = case["label"]
        ref_losses, ref_params = references[(case["model"], json.dumps(case["config"], sort_keys=True))]
        runs = [s["cases"][label] for s in summaries]
        # one plan for all processes, made for the global batch
        assert runs[0]["plan_sha"] == runs[1]["plan_sha"], label
        assert runs[0]["loss_is_global"]
        # each process fed half the rows; the step was planned and lowered for all of them
        for key, shape in runs[0]["local_batch"].items():
            assert runs[0]["lowered_batch"][key] == [shape[0] * NPROC] + shape[1:], (label, key)
        for pid in range(NPROC):
            got = np.load(tmp_path / f"p{pid}-{label}.npz")
            np.testing.assert_allclose(got["losses"], ref_losses, rtol=1e-5,
                                       err_msg=f"{label}: losses of process {pid}")
            assert set(ref_params) <= set(got.files)
            for key, ref in ref_params.items():
                scale = float(np.max(np.abs(ref))) or 1.0
                np.testing.assert_allclose(got[key], ref, rtol=1e-5, atol=1e-5 * scale,
                                           err_msg=f"{label}: parameter {key} of process {pid}")
    # the data-parallel plan splits the batch by process: assembled without communication
    assert all(summaries[0]["cases"]["mlp-data"]["batch_direct"].values())


# ---------------------------------------------------------------------------
# single process: the pieces multi-process runs are built from, and the fast
# path every call after the first takes
# ---------------------------------------------------------------------------

def test_global_view_multiplies_dim0_of_process_local_batch_leaves() -> None:
    from meshplan.runtime import global_view
    state = {"w": np.zeros((4, 3), np.float32)}
    batch = {"x": np.zeros((8, 5), np.float32), "step": np.int32(3),
             "spec": jax.ShapeDtypeStruct((16, 2), np.float32)}
    s, b = global_view((state, batch), batch_argnums=(1,), num_processes=2)
    assert s is state                                   # not a batch argument
    assert b["x"].shape == (16, 5) and b["x"].dtype == np.float32
    assert b["step"] is batch["step"]                   # a scalar is the same everywhere
    assert b["spec"] is batch["spec"]                   # abstract leaves are global already
    assert global_view((state, batch), (1,)) == (state, batch)   # one process: unchanged


def test_one_process_plan_agreement_and_to_host() -> None:
    from meshplan.runtime import agree_on_plan, to_host
    sentinel = object()
    assert agree_on_plan(sentinel) is sentinel          # type: ignore[arg-type]
    assert agree_on_plan(lambda: sentinel) is sentinel  # type: ignore[arg-type]
    tree = {"a": jax.numpy.arange(4.0), "b": 2.0}
    host = to_host(tree)
    assert isinstance(host["a"], np.ndarray) and host["a"].tolist() == [0, 1, 2, 3]


def test_fast_path_runs_placed_arguments_and_falls_back_otherwise() -> None:
    import meshplan
    from meshplan.runtime import ShardExecutable

    model = build_model("mlp", {"optimizer": "sgd"})
    state, batch = model.init(0)
    ref_step = jax.jit(model.train_step)
    step = meshplan.parallelize(model.train_step, cluster=meshplan.Cluster.local(),
                                method=meshplan.DataParallel(), donate_argnums=(0,))
    full_calls = []
    original = ShardExecutable._place_all

    def counting(self, entry, args):
        full_calls.append(1)
        return original(self, entry, args)

    ShardExecutable._place_all = counting
    try:
        ref, ref_state = [], state
        s = jax.tree.map(np.asarray, state)
        for k in range(3):
            s, m = step(s, batch)
            ref_state, r = ref_step(ref_state, batch)
            ref.append(float(r["loss"]))
            assert float(m["loss"]) == pytest.approx(ref[-1], rel=1e-5)
        assert len(full_calls) == 1             # calls 2 and 3 went straight to the program

        # another batch size: its own plan and program, then back to the first
        other_model = build_model("mlp", {"optimizer": "sgd", "batch": 32})
        _, big = other_model.init(1)
        s, _ = step(s, big)
        plan_big = step.plan
        s, _ = step(s, batch)
        assert step.plan is not plan_big and len(step._cache) == 2

        # state committed with other shardings: jit refuses it, the full path places it
        from jax.sharding import NamedSharding, PartitionSpec
        ex = step._cache[next(iter(step._cache))][1]
        split = NamedSharding(ex.mesh, PartitionSpec(ex.mesh.axis_names[0]))
        moved = jax.tree.map(lambda x: jax.device_put(x, split)
                             if x.ndim and x.shape[0] % split.mesh.size == 0 else x, s)
        assert any(not x.sharding.is_fully_replicated for x in jax.tree.leaves(moved))
        before = len(full_calls)
        out, m = step(moved, batch)
        assert len(full_calls) == before + 1 and np.isfinite(float(m["loss"]))

        # a donated (deleted) state is the caller's error, not a silent re-run
        s, _ = step(out, batch)
        with pytest.raises(meshplan.RuntimeStageError, match="donated"):
            step(out, batch)
    finally:
        ShardExecutable._place_all = original
