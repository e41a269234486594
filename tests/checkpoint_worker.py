"""One process of the multi-process checkpoint test (tests/test_checkpoint_multihost.py).

Usage::

    python tests/checkpoint_worker.py PROCESS_ID NUM_PROCESSES PORT OUT_DIR

Trains one step of a small MLP under a 2 x 4 ShardParallel plan over both
processes' devices, saves the (global, sharded across processes) state with
``meshplan.save_state`` into ``OUT_DIR/ck`` -- every process writes its own
shards -- restores it under an 8-way plan and under a 4 x 2 plan, and
writes ``OUT_DIR/p{PROCESS_ID}.json``: whether the restored values equal the
saved ones bit for bit and where they landed.
"""
from __future__ import annotations

from _workers import process_rows

import json
import pathlib
import sys


def main(argv: list[str]) -> int:
    pid, nproc, port, out = int(argv[1]), int(argv[2]), int(argv[3]), pathlib.Path(argv[4])
    from meshplan.runtime import initialize, to_host
    initialize(f"127.0.0.1:{port}", nproc, pid, heartbeat_timeout_s=10,
               initialization_timeout_s=60)
    import jax
    import numpy as np

    import meshplan
    from meshplan.models import build_model

    model = build_model("mlp", {"optimizer": "sgd", "layers": 2, "hidden": 32})
    state, batch = model.init(0)
    local = process_rows(batch, pid, nproc)
    step = meshplan.parallelize(model.train_step, cluster=meshplan.Cluster.local(),
                                method=meshplan.ShardParallel(mesh_shape=(2, 4)))
    state, _ = step(state, local)
    saved = to_host(state)
    path = out / "ck"
    meshplan.save_state(path, state)
    report = {"spans_processes": any(not x.is_fully_addressable for x in jax.tree.leaves(state))}
    abstract = model.abstract_args[0]
    for label, method in (("8-way", meshplan.ShardParallel(mesh_shape=(8,))),
                          ("4x2", meshplan.ShardParallel(mesh_shape=(4, 2)))):
        plan = meshplan.plan(model.train_step, *model.abstract_args,
                             cluster=meshplan.Cluster.local(), method=method)
        restored = meshplan.restore_state(path, like=abstract, plan=plan)
        got = to_host(restored)
        equal = all(np.array_equal(a, b) for a, b in
                    zip(jax.tree.leaves(got), jax.tree.leaves(saved)))
        specs = {jax.tree_util.keystr(p): str(x.sharding.spec) for p, x in
                 jax.tree_util.tree_flatten_with_path(restored)[0]}
        want = {k: str(jax.sharding.PartitionSpec(*v)) for k, v in plan.stages[0].params}
        report[label] = {"equal": equal, "placed": all(specs[k] == want.get(k, specs[k])
                                                       for k in specs)}
    (out / f"p{pid}.json").write_text(json.dumps(report))
    jax.distributed.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
