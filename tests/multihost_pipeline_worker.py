"""One process of the multi-process pipeline test (tests/test_multihost_pipeline.py).

Usage::

    python tests/multihost_pipeline_worker.py PROCESS_ID NUM_PROCESSES PORT OUT_DIR CASES_JSON

Joins ``jax.distributed`` on 127.0.0.1:PORT with gloo CPU collectives, checks
the cross-process stage transport on its own, then for every case
``{"label", "model", "config", "manual": {dp, tp, pp, num_micro_batches,
schedule}, "steps", "data"}`` trains the built-in model under
``meshplan.parallelize`` with that Manual pipeline plan over all processes'
devices (``Cluster.local()``), feeding this process's rows of every batch.
An optional ``"remat": [bool per stage]`` sets ``Stage.remat`` in that plan;
``"split_layers": true`` runs a model with its blocks in a ``lax.scan`` on
its state split per layer (``Parallelized.split_layers``).
Writes ``OUT_DIR/p{PROCESS_ID}-{case}.npz`` (losses, final parameters read
with ``to_host``) and ``OUT_DIR/p{PROCESS_ID}.json`` (a summary).  The
environment must say JAX_PLATFORMS=cpu and
XLA_FLAGS=--xla_force_host_platform_device_count=N.
"""
from __future__ import annotations

from _workers import join_run, process_rows

import dataclasses
import json
import sys
import time


def main(argv: list[str]) -> int:
    pid, nproc, out, cases = join_run(argv)
    import jax
    import numpy as np

    import meshplan
    from meshplan.models import build_model
    from meshplan.runtime import to_host
    from multihost_worker import _load_data

    summary: dict = {"process_index": jax.process_index(), "process_count": jax.process_count(),
                     "transport": _check_transport(nproc), "cases": {}}

    for case in cases:
        label = case["label"]
        started = time.perf_counter()
        model = build_model(case["model"], case["config"])
        state, batches = _load_data(out / case["data"], model, case["steps"])
        step = meshplan.parallelize(model.train_step, cluster=meshplan.Cluster.local(),
                                    method=meshplan.Manual(**case["manual"]))
        if case.get("remat"):
            # the same plan with rematerialised stages (Stage.remat)
            plan = step.plan_for(state, process_rows(batches[0], pid, nproc))
            plan = dataclasses.replace(plan, stages=tuple(
                dataclasses.replace(s, remat=bool(r)) for s, r in zip(plan.stages, case["remat"])))
            step = meshplan.parallelize(model.train_step, plan=plan)
        if case.get("split_layers"):
            # [lax.scan over stacked layers] keep the state per layer: a
            # stacked result would gather layers living on other processes
            state = step.split_layers(state, process_rows(batches[0], pid, nproc))[0]
        losses, seconds = [], []
        for k in range(case["steps"]):
            t0 = time.perf_counter()
            state, metrics = step(state, process_rows(batches[k], pid, nproc))
            losses.append(float(to_host(metrics["loss"])))
            seconds.append(time.perf_counter() - t0)
        params = to_host(state["params"])
        if case.get("split_layers"):
            params = jax.tree.map(lambda x: np.stack(x) if type(x) is tuple else x, params,
                                  is_leaf=lambda x: type(x) is tuple)
        flat = {jax.tree_util.keystr(p): np.asarray(v)
                for p, v in jax.tree_util.tree_flatten_with_path(params)[0]}
        np.savez(out / f"p{pid}-{label}.npz", losses=np.asarray(losses), **flat)
        plan = step.plan
        executable = step._cache[next(iter(step._cache))][1]
        stage_procs = [sorted({d.process_index for d in mesh.devices.flat})
                       for mesh in executable.meshes]
        leaves = jax.tree_util.tree_leaves(state["params"])
        summary["cases"][label] = {
            "losses": losses, "seconds": seconds, "total_s": time.perf_counter() - started,
            "stages": len(plan.stages), "stage_devices": [list(s.devices) for s in plan.stages],
            "stage_processes": stage_procs,
            "local_stages": [k for k, loc in enumerate(executable.transfers.local) if loc],
            "plan_sha": __import__("hashlib").sha256(plan.to_json().encode()).hexdigest(),
            # each parameter's data lives on its stage's process only
            "params_here": sum(1 for x in leaves if x.is_fully_addressable),
            "params_elsewhere": sum(1 for x in leaves if not x.addressable_shards),
            "params": len(leaves),
            "cross_process_moves": executable.last_stats.get("cross_process_moves", 0),
            "tasks_run": executable.last_stats["tasks"],
            # per stage: whether its backward replays its forward
            "replays": [bool(executable.split.tasks[("B", k)].replay) if ("B", k) in
                        executable.split.tasks else False for k in range(len(plan.stages))],
        }
    (out / f"p{pid}.json").write_text(json.dumps(summary, indent=1))
    jax.distributed.shutdown()
    return 0


def _check_transport(nproc: int) -> dict:
    """StageTransport on its own: stage 0 on process 0, stage 1 on process 1;
    meshes of one shape (each device sends its shard) and of two shapes (one
    device sends the whole value); to_host of a value of one process."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from meshplan.plan import LogicalMesh
    from meshplan.runtime import build_mesh, to_host
    from meshplan.runtime.pipeline_transport import StageTransport

    devices = sorted(jax.devices(), key=lambda d: d.id)
    n = jax.local_device_count()
    a = build_mesh(LogicalMesh(("data", "model"), (2, n // 2)), devices[:n])
    b = build_mesh(LogicalMesh(("data", "model"), (2, n // 2)), devices[n:2 * n])
    c = build_mesh(LogicalMesh(("data",), (n,)), devices[n:2 * n])
    value = np.arange(8 * 6, dtype=np.float32).reshape(8, 6)
    result = {}
    # (same-shape-replicated: sent once, split over "model", gathered on the receiver)
    for name, meshes, spec in [("same-shape", (a, b), P("data", "model")),
                               ("same-shape-replicated", (a, b), P("data", None)),
                               ("other-shape", (a, c), P("data", None))]:
        xp = StageTransport(meshes)
        target = NamedSharding(meshes[1], spec)
        x = jax.device_put(value, NamedSharding(a, P("model"))) if xp.local[0] else None
        y = xp.move(x, 0, 1, target, value.shape, value.dtype)
        if xp.local[1]:
            result[name] = {"equal": bool(np.array_equal(np.asarray(y), value)),
                            "sharding_kept": y.sharding.is_equivalent_to(target, 2)}
        # a value of stage 1 read in every process
        z = xp.on_stage(y, 1) if xp.local[1] else xp.remote(1, value.shape, value.dtype)
        result[name + "-to_host"] = bool(np.array_equal(to_host(z), value))
    return result


if __name__ == "__main__":
    try:
        code = main(sys.argv)
    except BaseException:
        # exit at once: a normal exit would wait for the peer at the
        # distributed shutdown barrier
        import os
        import traceback
        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)
    sys.exit(code)
