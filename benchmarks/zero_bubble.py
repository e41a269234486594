"""ZB-H1 against 1F1B and GPipe in the planner's cost model, and what the
search picks when it may choose zb-h1.

For each case (a built-in model, a cluster file, a stage count p and a
micro-batch count m) this plans ``PipeshardParallel(stages=p,
num_micro_batches=m, schedule=S)`` for S in gpipe, 1f1b, zb-h1 and with
``schedule=("gpipe", "1f1b", "zb-h1")`` (searched: the fastest that fits,
as ``"auto"`` searches these three where the stage count is fixed), and prints the predicted iteration
times and the largest stage memory as a Markdown table.  The figures are
predictions (no GPU is used): ZB-H1 is priced by
:mod:`meshplan.dp_search.zero_bubble` (every stage keeps p micro-batches,
the time walks the schedule's order with each stage's F, B and W cut by
FLOPs).  Planning shares one session, so the layer ILPs are solved once per case.

    python benchmarks/zero_bubble.py [--cases gpt-350m:256:dgx-a100-x1:4:8,...]
"""
from __future__ import annotations

import time

import meshplan
from meshplan.errors import InfeasiblePlanError
from meshplan.units import human_bytes

from _cases import Case, main

# model:batch:cluster:stages:micro-batches
CASES = "gpt-350m:256:dgx-a100-x1:4:4,gpt-350m:256:dgx-a100-x1:4:8,gpt-350m:256:dgx-a100-x1:2:8"
SCHEDULES = ("gpipe", "1f1b", "zb-h1", ("gpipe", "1f1b", "zb-h1"))


def run_case(spec: str) -> dict:
    name, batch, cluster_name, p, mb = spec.split(":")
    case = Case.of(name, batch, cluster_name)
    row = {"case": f"{name} batch {batch}, {cluster_name}, p={p}, m={mb}"}
    t0 = time.perf_counter()
    for sched in SCHEDULES:
        try:
            plan = case.plan(meshplan.PipeshardParallel(
                stages=int(p), num_micro_batches=int(mb), schedule=sched))
            text = (f"{plan.predicted.iteration_s * 1e3:.1f} ms, "
                    f"{human_bytes(plan.predicted.peak_memory_bytes)}")
            if not isinstance(sched, str):
                text = f"{plan.schedule} ({text})"
        except InfeasiblePlanError:
            text = "does not fit"
        row[sched if isinstance(sched, str) else "searched"] = text
    row["plan s"] = f"{time.perf_counter() - t0:.0f}"
    return row


if __name__ == "__main__":
    raise SystemExit(main(__doc__, CASES, run_case))
