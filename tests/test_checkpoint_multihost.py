"""save_state / restore_state in a 2-process run (tests/checkpoint_worker.py):
state sharded across both processes is saved by both (each its own shards)
and restored under other plans, bit-exact."""
from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "checkpoint_worker.py"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.multiprocess
@pytest.mark.extended
def test_two_processes_save_and_restore_under_other_plans(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
               XLA_FLAGS="--xla_force_host_platform_device_count=4")
    port = _free_port()
    logs = [open(tmp_path / f"worker{p}.log", "w+") for p in range(2)]
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(p), "2", str(port),
                               str(tmp_path)], cwd=ROOT, env=env, stdout=logs[p],
                              stderr=subprocess.STDOUT) for p in range(2)]
    deadline = time.monotonic() + 180
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    texts = []
    for log in logs:
        log.seek(0)
        texts.append("".join(l for l in log if not l.startswith("[Gloo]")))
        log.close()
    for pid, p in enumerate(procs):
        assert p.returncode == 0, f"worker {pid} exited with {p.returncode}:\n{texts[pid][-3000:]}"
    for pid in range(2):
        r = json.loads((tmp_path / f"p{pid}.json").read_text())
        assert r["spans_processes"]
        for label in ("8-way", "4x2"):
            assert r[label] == {"equal": True, "placed": True}, (pid, label, r)
