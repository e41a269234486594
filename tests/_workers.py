"""Shared by the multi-process tests and their workers (run as scripts from
tests/): the workers' batch slice, and the launching and waiting the tests do."""
from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys
import time
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]


def join_run(argv: list[str]) -> tuple[int, int, pathlib.Path, list[dict]]:
    """A worker's start: argv is (script, pid, nproc, port, out dir, cases as
    JSON) as :func:`launch` passes them; join the ``jax.distributed`` run on
    127.0.0.1 with gloo collectives.  Returns (pid, nproc, out, cases)."""
    pid, nproc, port = int(argv[1]), int(argv[2]), int(argv[3])
    import jax      # only now: jax.distributed must start before any backend
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=nproc, process_id=pid,
                               initialization_timeout=60)
    return pid, nproc, pathlib.Path(argv[4]), json.loads(argv[5])


def process_rows(batch, pid: int, nproc: int):
    """This process's contiguous share of the global batch's rows, as a
    multi-controller JAX program feeds its local part."""
    import jax      # the workers import jax only after joining the run
    n = jax.tree.leaves(batch)[0].shape[0] // nproc
    return jax.tree.map(lambda x: x[pid * n:(pid + 1) * n], batch)


def launch(worker: pathlib.Path, out: pathlib.Path, cases: list[dict], nproc: int,
           local_devices: int) -> tuple[list, list]:
    """Start ``nproc`` workers of a ``jax.distributed`` run on 127.0.0.1, each
    with ``local_devices`` CPU devices; their output goes to out/worker{pid}.log."""
    env = dict(os.environ)
    env.update(JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={local_devices}",
               PYTHONUNBUFFERED="1")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs, logs = [], []
    for pid in range(nproc):
        log = open(out / f"worker{pid}.log", "w+")
        logs.append(log)
        procs.append(subprocess.Popen(
            [sys.executable, str(worker), str(pid), str(nproc), str(port), str(out),
             json.dumps(cases)], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
    return procs, logs


def finish(out: pathlib.Path, procs: list, logs: list, timeout_s: float,
           grace_s: float = 10) -> list[dict]:
    """Wait (bounded) for the workers and return their out/p{pid}.json
    summaries; kill stragglers; fail the test with their output.  A worker
    that fails leaves its peer waiting in a collective: the peer gets
    ``grace_s``, then is killed."""
    import pytest
    deadline = time.monotonic() + timeout_s
    status: dict[int, Any] = {}
    try:
        while len(status) < len(procs):
            for pid, p in enumerate(procs):
                if pid not in status and p.poll() is not None:
                    status[pid] = p.returncode
                    if p.returncode != 0:
                        deadline = min(deadline, time.monotonic() + grace_s)
            if time.monotonic() > deadline:
                for pid in range(len(procs)):
                    status.setdefault(pid, "a timeout (killed)")
                break
            time.sleep(0.1)
    finally:
        for p in procs:        # never leave a worker behind (one may wait on a dead peer)
            if p.poll() is None:
                p.kill()
                p.wait()
    report = []
    for pid, rc in sorted(status.items()):
        if rc != 0:
            logs[pid].seek(0)
            text = "".join(line for line in logs[pid] if not line.startswith("[Gloo]"))
            report.append(f"--- worker {pid} exited with {rc}; its output:\n{text[-6000:]}")
    for log in logs:
        log.close()
    if report:
        pytest.fail("multi-process workers failed\n" + "\n".join(report))
    return [json.loads((out / f"p{pid}.json").read_text()) for pid in range(len(procs))]


def reference_run(model_name: str, config: dict, steps: int):
    """A built-in model's initial state (seed 0), one full batch per step
    (seeds 1..), and a plain ``jax.jit`` run of the step on them: (state,
    batches, losses, {parameter path: final value})."""
    import jax
    import numpy as np

    from meshplan.models import build_model
    model = build_model(model_name, config)
    init = jax.jit(model.init)
    state0, _ = init(0)
    batches = [init(k + 1)[1] for k in range(steps)]
    step = jax.jit(model.train_step)
    state, losses = state0, []
    for batch in batches:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    params = {jax.tree_util.keystr(p): np.asarray(v)
              for p, v in jax.tree_util.tree_flatten_with_path(state["params"])[0]}
    return state0, batches, losses, params


def checkpoint_temps(*cases: str) -> dict[str, list[float]]:
    """``benchmarks/checkpoint_memory.py``'s (jax.jit, meshplan) temp MiB of
    ``cases``, in a process of its own: one device and XLA's memory-aware
    CPU scheduler, which the benchmark sets before jax starts."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = subprocess.run([sys.executable, "benchmarks/checkpoint_memory.py", "--json", *cases],
                         cwd=ROOT, env=env, check=True, capture_output=True, text=True,
                         timeout=900).stdout
    return json.loads(out.strip().splitlines()[-1])
