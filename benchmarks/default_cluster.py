"""What ``Auto()`` picks on the uncalibrated local CPU cluster, and how fast it runs.

A user's first call, ``meshplan.parallelize(step)`` on a laptop, plans on
``Cluster.local()``: nominal CPU figures.  For small built-in models on 8
fake CPU devices this plans ``Auto()`` twice, on the local cluster as it is
and with its launch costs per program and per kernel and its host time per
pipeline program set to zero (how the CPU default stood before stop 52),
plans ``ShardParallel()`` (one program on every device), runs each plan and
prints the predicted and measured step times: the median of ``--repeats``
timings of ``--steps`` steps each, each ended by ``block_until_ready``.

    python benchmarks/default_cluster.py [--repeats 7] [--steps 5] [--cluster FILE]

``--cluster FILE`` adds a row per model: ``Auto()`` planned on that cluster
file (e.g. one ``meshplan calibrate`` wrote on this host), run on the same
devices; where the file has no ``pipeline_program_s`` (calibrated before
calibrate timed a pipeline), one more with the local default's host figures
(per program and per buffer).
"""
from __future__ import annotations

import _fake_devices  # noqa: F401  (before jax: 8 fake CPU devices)

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402

import meshplan  # noqa: E402
from meshplan.cluster import load_cluster  # noqa: E402
from meshplan.models import build_model  # noqa: E402

MODELS = {
    "mlp-2x32": ("mlp", {"layers": 2, "hidden": 32, "in_dim": 32, "out_dim": 10, "batch": 16,
                         "optimizer": "sgd"}),
    "mlp-4x256": ("mlp", {"layers": 4, "hidden": 256, "batch": 64, "optimizer": "adam"}),
    "gpt-2x64": ("gpt", {"layers": 2, "hidden": 64, "heads": 4, "seq_len": 32, "vocab": 128,
                         "batch": 8, "optimizer": "adam"}),
    "gpt-4x128": ("gpt", {"layers": 4, "hidden": 128, "heads": 4, "seq_len": 64, "vocab": 256,
                          "batch": 16, "optimizer": "adam"}),
}


def without_launch_costs(cluster: meshplan.ClusterSpec) -> meshplan.ClusterSpec:
    a = dataclasses.replace(cluster.device.achieved, kernel_launch_s=0.0,
                            program_dispatch_s=0.0, pipeline_program_s=0.0,
                            pipeline_buffer_s=0.0)
    return dataclasses.replace(cluster, device=dataclasses.replace(cluster.device, achieved=a))


def measure(step, state, batch, repeats: int, steps: int) -> float:
    for _ in range(2):          # compile, then warm up
        state, _ = step(state, batch)
    jax.block_until_ready(state)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(steps):
            state, _ = step(state, batch)
        jax.block_until_ready(state)
        times.append((time.perf_counter() - t0) / steps)
    return statistics.median(times)


def describe(plan) -> str:
    meshes = ",".join("x".join(map(str, st.logical_mesh.shape)) for st in plan.stages)
    return f"{len(plan.stages)}x[{meshes}] mb{plan.num_micro_batches}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--cluster", metavar="FILE", help="also plan Auto() on this cluster file")
    args = ap.parse_args()
    local = meshplan.Cluster.local()
    clusters = {"Auto, local": local, "Auto, no launch costs": without_launch_costs(local)}
    if args.cluster:
        given = load_cluster(args.cluster)
        clusters[f"Auto, {args.cluster}"] = given
        a = local.device.achieved
        if not given.device.achieved.pipeline_program_s and a.pipeline_program_s:
            # (a file calibrated before calibrate timed a pipeline: with the local default's)
            clusters[f"Auto, {args.cluster} + the local host figures"] = \
                dataclasses.replace(given, device=dataclasses.replace(
                    given.device, achieved=dataclasses.replace(
                        given.device.achieved, pipeline_program_s=a.pipeline_program_s,
                        pipeline_buffer_s=a.pipeline_buffer_s)))
    print("| model | plan | chosen | predicted ms | measured ms |")
    print("|---|---|---|---:|---:|")
    for name, (kind, config) in MODELS.items():
        m = build_model(kind, config)
        state, batch = jax.device_get(m.init(0))
        runs = [(label, meshplan.Auto(), c) for label, c in clusters.items()]
        runs.append(("ShardParallel, local", meshplan.ShardParallel(), local))
        for label, method, cluster in runs:
            plan = meshplan.plan(m.train_step, state, batch, method=method, cluster=cluster)
            step = meshplan.parallelize(m.train_step, plan=plan)
            t = measure(step, jax.tree_util.tree_map(lambda x: x.copy(), state), batch,
                        args.repeats, args.steps)
            print(f"| {name} | {label} | {describe(plan)} | "
                  f"{plan.predicted.iteration_s * 1e3:.3f} | {t * 1e3:.2f} |", flush=True)


if __name__ == "__main__":
    main()
