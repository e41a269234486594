"""One process of the multi-process test (tests/test_multihost.py).

Usage::

    python tests/multihost_worker.py PROCESS_ID NUM_PROCESSES PORT OUT_DIR CASES_JSON

Joins ``jax.distributed`` on 127.0.0.1:PORT with gloo CPU collectives, then
for every case ``{"label": ..., "model": ..., "config": {...}, "method":
"shard"|"data", "mesh_shape": [...], "steps": n}`` trains the built-in model
under ``meshplan.parallelize`` (``Cluster.local()``: all processes' devices)
with a ShardParallel plan of that mesh shape or a DataParallel plan, feeding
this process's rows of every batch.  The initial state and the full batches
come from ``OUT_DIR/FILE`` (written by the test with :func:`save_data`).  It also checks the batch assembler
on every layout a plan could give a batch.  It writes ``OUT_DIR/p{PROCESS_ID}-{case}.npz`` (losses and
final parameters, gathered) and ``OUT_DIR/p{PROCESS_ID}.json`` (a summary).
The environment must already say JAX_PLATFORMS=cpu and how many CPU devices
each process has (XLA_FLAGS=--xla_force_host_platform_device_count=N).
"""
from __future__ import annotations

from _workers import join_run, process_rows

import json
import pathlib
import sys
import time


def main(argv: list[str]) -> int:
    pid, nproc, out, cases = join_run(argv)
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import meshplan
    from meshplan.models import build_model
    from meshplan.runtime import to_host
    from meshplan.runtime.multihost import BatchAssembler

    started = time.perf_counter()
    summary: dict = {"process_index": jax.process_index(), "process_count": jax.process_count(),
                     "devices": jax.device_count(), "local_devices": jax.local_device_count(),
                     "cases": {}}

    # the batch assembler on its own: every layout a plan could give the batch
    mesh = meshplan.runtime.build_mesh(meshplan.LogicalMesh(("x", "y"), (nproc, jax.local_device_count())))
    rows = 4 * jax.device_count()
    full = np.arange(rows * 3, dtype=np.float32).reshape(rows, 3)
    local = rows // nproc
    mine = full[pid * local:(pid + 1) * local]
    layouts = {}
    for name, spec in [("x", P("x")), ("xy", P(("x", "y"))), ("yx", P(("y", "x"))),
                       ("y", P("y")), ("replicated", P()), ("cols", P(None, None))]:
        assembler = BatchAssembler(NamedSharding(mesh, spec), full.shape)
        got = assembler(mine)
        layouts[name] = {"direct": assembler.direct,
                         "equal": bool(np.array_equal(to_host(got), full)),
                         "sharding_kept": got.sharding.is_equivalent_to(NamedSharding(mesh, spec), 2)}
    summary["assembler"] = layouts
    summary["assembler_s"] = time.perf_counter() - started

    for case in cases:
        label = case["label"]
        case_started = time.perf_counter()
        model = build_model(case["model"], case["config"])
        # the data the test process made: the state of init(0) and one full
        # batch per step, the same host values in every process
        state, batches = _load_data(out / case["data"], model, case["steps"])
        if case.get("method", "shard") == "data":
            method = meshplan.DataParallel(time_limit=case.get("time_limit", 30.0))
        else:
            method = meshplan.ShardParallel(mesh_shape=tuple(case["mesh_shape"]),
                                            time_limit=case.get("time_limit", 30.0))
        step = meshplan.parallelize(model.train_step, cluster=meshplan.Cluster.local(),
                                    method=method)
        losses, seconds = [], []
        for k in range(case["steps"]):
            batch = batches[k]
            local_batch = process_rows(batch, pid, nproc)
            t0 = time.perf_counter()
            state, metrics = step(state, local_batch)
            loss = to_host(metrics["loss"])
            seconds.append(time.perf_counter() - t0)
            losses.append(float(loss))
        t0 = time.perf_counter()
        params = to_host(state["params"])
        gather_s = time.perf_counter() - t0
        flat = {jax.tree_util.keystr(p): np.asarray(v)
                for p, v in jax.tree_util.tree_flatten_with_path(params)[0]}
        np.savez(out / f"p{pid}-{label}.npz", losses=np.asarray(losses), **flat)
        # lowering takes the same process-local batch and shows the global shapes
        lowered = step.lower(state, local_batch)
        lowered_batch = {jax.tree_util.keystr(p): list(v.shape) for p, v in
                         jax.tree_util.tree_flatten_with_path(lowered.args_info[0][1])[0]}
        plan = step.plan
        executable = step._cache[next(iter(step._cache))][1]
        entry = executable._last
        summary["cases"][label] = {
            "losses": losses, "seconds": seconds,
            "mesh": str(plan.stages[0].logical_mesh),
            "batch_specs": {k: [list(d) if isinstance(d, tuple) else d for d in v]
                            for k, v in plan.batch},
            "batch_direct": {str(i): a.direct for i, a in entry.assemblers.items()},
            "fingerprint": plan.graph_fingerprint,
            "plan_sha": __import__("hashlib").sha256(plan.to_json().encode()).hexdigest(),
            "loss_is_global": bool(not metrics["loss"].is_fully_addressable),
            "local_batch": {jax.tree_util.keystr(p): list(np.shape(v)) for p, v in
                            jax.tree_util.tree_flatten_with_path(local_batch)[0]},
            "lowered_batch": lowered_batch,
            "total_s": time.perf_counter() - case_started, "gather_s": gather_s,
        }
    (out / f"p{pid}.json").write_text(json.dumps(summary, indent=1))
    jax.distributed.shutdown()
    return 0


def _load_data(path: pathlib.Path, model, steps: int):
    """(state, [batch per step]) saved by ``save_data`` (leaves in tree order)."""
    import jax
    import numpy as np
    state_def = jax.tree_util.tree_structure(model.abstract_args[0])
    batch_def = jax.tree_util.tree_structure(model.abstract_args[1])
    with np.load(path) as data:
        state = jax.tree_util.tree_unflatten(
            state_def, [data[f"state/{i}"] for i in range(state_def.num_leaves)])
        batches = [jax.tree_util.tree_unflatten(
            batch_def, [data[f"batch{k}/{i}"] for i in range(batch_def.num_leaves)])
            for k in range(steps)]
    return state, batches


def save_data(path: pathlib.Path, state, batches) -> None:
    """Save the initial state and the batches for the workers."""
    import jax
    import numpy as np
    arrays = {f"state/{i}": np.asarray(x) for i, x in enumerate(jax.tree_util.tree_leaves(state))}
    for k, batch in enumerate(batches):
        arrays.update({f"batch{k}/{i}": np.asarray(x)
                       for i, x in enumerate(jax.tree_util.tree_leaves(batch))})
    np.savez(path, **arrays)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
