"""Megatron-LM Table 1 (Narayanan et al., SC'21) on DGX A100 clusters.

For each row: the published (tp, pp, dp, micro-batches) and TFLOP/s per GPU,
meshplan's prediction for that very configuration (Manual), and meshplan's own
choice (PipeshardParallel search) with its prediction.

    python benchmarks/megatron.py [--rows 18.4b,39.1b,145.6b] [--micro-batches searched|published]

Writes benchmarks/results/megatron.md and .csv.  Planning only: nothing runs
on a GPU; the figures are the cost model's.
"""
from __future__ import annotations

import argparse
import csv
import pathlib
import sys
import time

import meshplan
from meshplan.errors import InfeasiblePlanError
from meshplan.api import plan_graph, retracer
from meshplan.models import PRESET_INFO, build_model
from meshplan.trace import trace

ROOT = pathlib.Path(__file__).resolve().parents[1]


def stage_shape(plan) -> tuple[str, str, int]:
    """(tp, dp, pp) of a plan: tp = the size of the last (fastest) mesh axis of
    each stage, dp = the rest of the stage's devices; written once when all
    stages agree, else per stage separated by '/'."""
    tps, dps = [], []
    for s in plan.stages:
        shape = s.logical_mesh.shape
        tp = shape[-1] if len(shape) > 1 else 1
        tps.append(tp)
        dps.append(s.logical_mesh.size // tp)
    one = lambda xs: str(xs[0]) if len(set(xs)) == 1 else "/".join(map(str, xs))  # noqa: E731
    return one(tps), one(dps), len(plan.stages)


def run_row(name: str, searched: bool) -> dict:
    info = PRESET_INFO[f"megatron-{name}"]
    m = build_model(f"megatron-{name}")
    batch = m.config["batch"]
    gpus, tp, pp, dp = info["gpus"], info["tp"], info["pp"], info["dp"]
    cluster = meshplan.load_cluster(ROOT / "examples" / "clusters" / f"dgx-a100-x{gpus // 8}.json")
    mb_pub = batch // dp          # micro-batch size 1 per data-parallel replica
    t0 = time.perf_counter()
    graph = trace(m.train_step, *m.abstract_args, batch_argnums=m.batch_argnums, name=name)
    rt = retracer(m.train_step, m.abstract_args, m.batch_argnums, name)
    published = plan_graph(graph, cluster, meshplan.Manual(dp=dp, tp=tp, pp=pp,
                                                           num_micro_batches=mb_pub,
                                                           schedule="1f1b"), retrace=rt)
    t1 = time.perf_counter()
    mbs = None if searched else mb_pub
    own = plan_graph(graph, cluster, meshplan.PipeshardParallel(num_micro_batches=mbs,
                                                                schedule="1f1b"), retrace=rt)
    t2 = time.perf_counter()
    otp, odp, opp = stage_shape(own)
    return {
        "model": f"megatron-{name}", "gpus": gpus,
        "published (tp,pp,dp,mb)": f"({tp},{pp},{dp},{mb_pub})",
        "published TFLOP/s": info["tflops_per_gpu"],
        "meshplan on published config TFLOP/s": round(published.predicted.tflops_per_device, 1),
        "relative error": round(published.predicted.tflops_per_device / info["tflops_per_gpu"] - 1, 3),
        "meshplan choice (tp,pp,dp,mb)": f"({otp},{opp},{odp},{own.num_micro_batches})",
        "meshplan choice TFLOP/s": round(own.predicted.tflops_per_device, 1),
        # (tp: the last axis of a stage's 2-D mesh; a 1-D mesh has none)
        "tp inside a host": all((s.logical_mesh.shape[-1] if len(s.logical_mesh.shape) > 1 else 1)
                                <= cluster.devices_per_host for s in own.stages),
        "remat": any(s.remat for s in own.stages),
        "plan seconds": round(t2 - t0, 1),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="18.4b,39.1b,145.6b")
    ap.add_argument("--micro-batches", choices=["searched", "published"], default="published")
    args = ap.parse_args(argv)
    rows = []
    for name in args.rows.split(","):
        print(f"planning megatron-{name} ...", file=sys.stderr, flush=True)
        try:
            rows.append(run_row(name, args.micro_batches == "searched"))
        except InfeasiblePlanError as e:
            # the row stays in the table: a configuration the cost model
            # believes does not fit is a finding, not a crash
            info = PRESET_INFO[f"megatron-{name}"]
            rows.append({"model": f"megatron-{name}", "gpus": info["gpus"],
                         "published (tp,pp,dp,mb)": f"({info['tp']},{info['pp']},{info['dp']},-)",
                         "published TFLOP/s": info["tflops_per_gpu"],
                         "meshplan on published config TFLOP/s": f"does not fit: {e}"})
        print(rows[-1], file=sys.stderr, flush=True)
    out = ROOT / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    keys = list(max(rows, key=len))
    with open(out / "megatron.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys, restval="")
        w.writeheader()
        w.writerows(rows)
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(str(r.get(k, "")) for k in keys) + " |" for r in rows]
    table = "\n".join(lines)
    (out / "megatron.md").write_text(
        "# Megatron-LM Table 1 on DGX A100 (predicted by meshplan's cost model)\n\n"
        f"Command: `python benchmarks/megatron.py --rows {args.rows} --micro-batches "
        f"{args.micro_batches}`\n\n" + table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
