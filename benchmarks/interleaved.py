"""Interleaved 1F1B against 1F1B and GPipe in the planner's cost model, and
what the searched schedule picks.

For each case (a built-in model, a cluster file, a stage count p and a
micro-batch count m) this plans ``PipeshardParallel(stages=p,
num_micro_batches=m, schedule=S)`` for S in gpipe, 1f1b, interleaved, and
with ``schedule=("gpipe", "1f1b", "interleaved")`` (searched: the fastest of
the three that fits; ``"auto"`` leaves interleaved out where the stage count
is fixed, as here),
and prints their predicted iteration times as a Markdown table.  The figures
are predictions (no GPU is used); the interleaved plan's are priced from its
virtual stages (``meshplan.dp_search.interleave``).  Planning shares one
session, so the layer ILPs are solved once per case.

    python benchmarks/interleaved.py [--cases gpt-350m:256:dgx-a100-x1:4:4,...]
"""
from __future__ import annotations


import meshplan
from meshplan.errors import InfeasiblePlanError

from _cases import Case, main

# model:batch:cluster:stages:micro-batches
CASES = "gpt-350m:256:dgx-a100-x1:4:4,gpt-350m:256:dgx-a100-x1:4:8,gpt-350m:256:dgx-a100-x1:2:2"
SCHEDULES = ("gpipe", "1f1b", "interleaved", ("gpipe", "1f1b", "interleaved"))


def run_case(spec: str) -> dict:
    name, batch, cluster_name, p, mb = spec.split(":")
    case = Case.of(name, batch, cluster_name)
    row = {"case": f"{name} batch {batch}, {cluster_name}, p={p}, m={mb}"}
    for sched in SCHEDULES:
        try:
            plan = case.plan(meshplan.PipeshardParallel(
                stages=int(p), num_micro_batches=int(mb), schedule=sched))
            text = f"{plan.predicted.iteration_s * 1e3:.0f} ms"
            if not isinstance(sched, str):
                text = f"{plan.schedule} ({text})"
        except InfeasiblePlanError:
            text = "does not fit"
        row[sched if isinstance(sched, str) else "searched"] = text
    return row


if __name__ == "__main__":
    raise SystemExit(main(__doc__, CASES, run_case))
