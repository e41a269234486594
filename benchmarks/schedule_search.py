"""What the default schedule search gains: ``Auto()`` (GPipe, 1F1B,
interleaved 1F1B and ZB-H1 searched) against ``Auto(schedule=("1f1b",
"gpipe"))`` (the search before interleaved and ZB-H1 joined it), both with
stages, submeshes, meshes and micro-batches searched.

For each case (a built-in model at a global batch on a cluster file) this
prints each plan's stages (``plan_quality.describe``), predicted iteration
time and largest stage memory, and the searched plan's gain, as a Markdown
table.  The figures are predictions (no GPU is used).  One session per
case, so the layer ILPs are solved once for both searches.

    python benchmarks/schedule_search.py [--cases gpt-350m:64:aws-p3.16xlarge-x4,...]
"""
from __future__ import annotations

import time

import meshplan
from meshplan.units import human_bytes

from _cases import Case, main
from plan_quality import describe

# model:batch:cluster
CASES = ("gpt-350m:64:aws-p3.16xlarge-x4,gpt-1.3b:128:aws-p3.16xlarge-x4,"
         "gpt-350m:256:dgx-a100-x1")
BEFORE = ("1f1b", "gpipe")


def run_case(spec: str) -> dict:
    name, batch, cluster_name = spec.split(":")
    case = Case.of(name, batch, cluster_name)
    row = {"case": f"{name} batch {batch}, {cluster_name}"}
    t0 = time.perf_counter()
    times = {}
    for col, method in (("1f1b, gpipe", meshplan.Auto(schedule=BEFORE)),
                        ("searched (all four)", meshplan.Auto())):
        plan = case.plan(method)
        times[col] = plan.predicted.iteration_s
        row[col] = (f"{plan.predicted.iteration_s * 1e3:.1f} ms, "
                    f"{human_bytes(plan.predicted.peak_memory_bytes)}: {describe(plan)}")
    before, after = times.values()
    row["gain"] = f"{(before - after) / before:.1%}"
    row["plan s"] = f"{time.perf_counter() - t0:.0f}"
    return row


if __name__ == "__main__":
    raise SystemExit(main(__doc__, CASES, run_case))
