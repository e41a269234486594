"""One process of tests/test_multihost_failure.py.

Usage::

    python tests/failure_worker.py PROCESS_ID NUM_PROCESSES PORT HEARTBEAT_S MODE OUT_DIR

Joins the run with :func:`meshplan.runtime.initialize` (gloo, a watchdog with
HEARTBEAT_S), then trains a small MLP under ``meshplan.parallelize`` step
after step, printing ``TRAINING`` once two steps are done.  MODE ``train``
trains until killed (or until ``OUT_DIR/kill-PROCESS_ID`` appears: then
it SIGKILLs itself between two steps); ``raise-after-3`` makes process 1 raise an exception
after its third step (a crash in Python rather than a kill).
"""
from __future__ import annotations

from _workers import process_rows

import os
import signal
import sys
import time


def main(argv: list[str]) -> int:
    pid, nproc, port = int(argv[1]), int(argv[2]), int(argv[3])
    heartbeat, mode, out = float(argv[4]), argv[5], argv[6]
    import meshplan
    from meshplan.runtime import initialize, to_host
    initialize(f"127.0.0.1:{port}", nproc, pid, heartbeat_timeout_s=heartbeat,
               initialization_timeout_s=60)
    from meshplan.models import build_model

    model = build_model("mlp", {"optimizer": "sgd", "layers": 1, "hidden": 16})
    state, batch = model.init(0)
    local = process_rows(batch, pid, nproc)
    step = meshplan.parallelize(model.train_step, cluster=meshplan.Cluster.local(),
                                method=meshplan.DataParallel())
    for k in range(100000):
        state, metrics = step(state, local)
        to_host(metrics["loss"])
        if k == 1:
            print("TRAINING", flush=True)
        if mode == "raise-after-3" and pid == 1 and k == 3:
            raise ValueError("injected failure in process 1")
        if os.path.exists(os.path.join(out, f"kill-{pid}")):
            # killed between two steps (a SIGKILL in the middle of a gloo
            # message can make gloo abort the peer itself, see the test)
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(0.05)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
