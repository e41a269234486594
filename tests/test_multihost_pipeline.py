"""A pipeline plan across two processes under ``jax.distributed``.

Two worker processes (tests/multihost_pipeline_worker.py) with 4 CPU devices
each join on 127.0.0.1 with gloo collectives and train the built-in models
under a Manual plan of two stages, one stage per process, each feeding its
own half of every batch.  The losses and the final parameters (read with
``meshplan.runtime.to_host`` in both processes) must match a plain
``jax.jit`` of the step on the full batch, computed here.
"""
from __future__ import annotations

import pathlib
import sys
from typing import Any

import numpy as np
import pytest


sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _workers import finish, launch, reference_run  # noqa: E402
from multihost_worker import save_data  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "multihost_pipeline_worker.py"
NPROC, LOCAL_DEVICES, STEPS = 2, 4, 3
TIMEOUT_S = 300          # the whole run of both workers
GRACE_S = 10             # for a worker whose peer failed
RTOL = 1e-5
FLOOR = 1e-3             # parameters near zero are judged against this scale

MLP = {"optimizer": "sgd", "layers": 4}
# GPT ties its embedding: stage 0 and the last stage both read it, so the
# updated table crosses processes at the start of every step
GPT = {"optimizer": "sgd", "layers": 2, "hidden": 32, "heads": 2, "seq_len": 16, "vocab": 64,
       "batch": 8}
CASES = [
    {"label": "mlp-gpipe", "model": "mlp", "config": MLP,
     "manual": {"dp": 2, "tp": 2, "pp": 2, "num_micro_batches": 2, "schedule": "gpipe"}},
    {"label": "gpt-1f1b", "model": "gpt", "config": GPT,
     "manual": {"dp": 2, "tp": 2, "pp": 2, "num_micro_batches": 2, "schedule": "1f1b"}},
    # rematerialised stages: stage 1 keeps the activations it received from
    # process 0 until its backward replays its forward from them
    {"label": "mlp-1f1b-remat", "model": "mlp", "config": MLP,
     "manual": {"dp": 2, "tp": 2, "pp": 2, "num_micro_batches": 2, "schedule": "1f1b"},
     "remat": [True, True],
     # priced with the 50 us inter-host latency of each send (send-once
     # cross-mesh cost), Manual's cut falls after layer 0 on this cluster: a
     # stage of the first layer alone has nothing of its forward to replay
     "replays": [False, True]},
    # ZB-H1: each stage's backward cut into B and W, the W programs run
    # where 1F1B idles, in the same global order in both processes
    {"label": "gpt-zb-h1", "model": "gpt", "config": GPT,
     "manual": {"dp": 2, "tp": 2, "pp": 2, "num_micro_batches": 4, "schedule": "zb-h1"}},
    # interleaved 1F1B: 4 virtual stages on the 2 processes' device groups,
    # chunk k on process k mod 2, so values cross processes 3 times each way
    {"label": "mlp-interleaved", "model": "mlp", "config": MLP,
     "manual": {"dp": 2, "tp": 2, "pp": 2, "num_micro_batches": 2, "schedule": "interleaved"},
     "stages": 4},
    # blocks in a lax.scan over stacked parameters, unrolled by the planner:
    # each process holds the layers of its stage, the state kept per layer
    {"label": "gpt-scan-1f1b", "model": "gpt",
     "config": {**GPT, "layers": 4, "scan_layers": True}, "split_layers": True,
     "manual": {"dp": 2, "tp": 2, "pp": 2, "num_micro_batches": 2, "schedule": "1f1b"}},
]


@pytest.mark.multiprocess
@pytest.mark.slow   # (66 s; the one-stage two-process test stays in the default suite)
def test_two_stage_pipeline_on_two_processes_matches_one_process_reference(
        tmp_path: pathlib.Path) -> None:
    cases = [{**c, "steps": STEPS, "data": f"data-{c['label']}.npz"} for c in CASES]
    references = {}
    for c in cases:
        state, batches, losses, params = reference_run(c["model"], c["config"], STEPS)
        save_data(tmp_path / c["data"], state, batches)
        references[c["label"]] = (losses, params)
    procs, logs = launch(WORKER, tmp_path, cases, NPROC, LOCAL_DEVICES)
    summaries = finish(tmp_path, procs, logs, TIMEOUT_S, GRACE_S)

    for pid, s in enumerate(summaries):
        assert (s["process_index"], s["process_count"]) == (pid, NPROC)
        for name, ok in s["transport"].items():
            assert ok if isinstance(ok, bool) else all(ok.values()), (pid, name, ok)
    # the receiving process checked the moved values; both read them back
    assert set(summaries[1]["transport"]) >= {"same-shape", "same-shape-replicated",
                                              "other-shape"}

    for case in CASES:
        label = case["label"]
        runs = [s["cases"][label] for s in summaries]
        assert runs[0]["plan_sha"] == runs[1]["plan_sha"], label
        n = runs[0]["stages"]
        assert n == case.get("stages", 2), (label, n)
        assert runs[0]["replays"] == case.get("replays", case.get("remat", [False] * n)), \
            (label, runs[0])
        # one stage (interleaved: every other virtual stage) per process: the
        # plan's device ids follow the processes
        assert runs[0]["stage_processes"] == [[k % NPROC] for k in range(n)], runs[0]
        for pid, run in enumerate(runs):
            assert run["local_stages"] == list(range(pid, n, NPROC)), (label, pid)
            assert run["cross_process_moves"] > 0, (label, pid)
            # each parameter's data lives on the process of its stage only
            assert run["params_here"] + run["params_elsewhere"] == run["params"], (label, pid)
            assert 0 < run["params_here"] < run["params"], (label, pid, run)
        assert runs[0]["params_here"] + runs[1]["params_here"] == runs[0]["params"], label

        ref_losses, ref_params = references[label]
        for pid in range(NPROC):
            got = np.load(tmp_path / f"p{pid}-{label}.npz")
            np.testing.assert_allclose(got["losses"], ref_losses, rtol=RTOL,
                                       err_msg=f"{label}: losses of process {pid}")
            assert set(ref_params) <= set(got.files)
            for key, ref in ref_params.items():
                scale = max(float(np.max(np.abs(ref))), FLOOR)
                np.testing.assert_allclose(got[key], ref, rtol=RTOL, atol=RTOL * scale,
                                           err_msg=f"{label}: parameter {key} of process {pid}")


def test_a_stage_over_several_processes_is_refused_with_a_clear_message() -> None:
    from types import SimpleNamespace

    import meshplan
    from meshplan.runtime.pipeline_transport import stage_processes

    def mesh(*processes: int) -> Any:
        grid = np.empty(len(processes), dtype=object)
        grid[:] = [SimpleNamespace(process_index=p) for p in processes]
        return SimpleNamespace(devices=grid)

    assert stage_processes([mesh(0, 0), mesh(1, 1)]) == [0, 1]
    with pytest.raises(meshplan.MeshplanError, match=r"stage 1 runs on devices of processes "
                                                     r"\[0, 1\].*at most one host"):
        stage_processes([mesh(0, 0), mesh(0, 1)])
