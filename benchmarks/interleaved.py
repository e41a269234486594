"""Interleaved 1F1B against 1F1B and GPipe in the planner's cost model, and
what the searched schedule picks.

For each case (a built-in model, a cluster file, a stage count p and a
micro-batch count m) this plans ``PipeshardParallel(stages=p,
num_micro_batches=m, schedule=S)`` for S in gpipe, 1f1b, interleaved, and
with ``schedule=("gpipe", "1f1b", "interleaved")`` (searched: the fastest of
the three that fits; ``"auto"`` searches GPipe and 1F1B only),
and prints their predicted iteration times as a Markdown table.  The figures
are predictions (no GPU is used); the interleaved plan's are priced from its
virtual stages (``meshplan.dp_search.interleave``).  Planning shares one
session, so the layer ILPs are solved once per case.

    python benchmarks/interleaved.py [--cases gpt-350m:256:dgx-a100-x1:4:4,...]
"""
from __future__ import annotations

import argparse
import pathlib
import sys
import time

import meshplan
from meshplan.api import plan_graph, retracer
from meshplan.dp_search import Session
from meshplan.errors import InfeasiblePlanError
from meshplan.models import build_model
from meshplan.trace import trace

ROOT = pathlib.Path(__file__).resolve().parents[1]
# model:batch:cluster:stages:micro-batches
CASES = "gpt-350m:256:dgx-a100-x1:4:4,gpt-350m:256:dgx-a100-x1:4:8,gpt-350m:256:dgx-a100-x1:2:2"
SCHEDULES = ("gpipe", "1f1b", "interleaved", ("gpipe", "1f1b", "interleaved"))


def run_case(spec: str) -> dict:
    name, batch, cluster_name, p, mb = spec.split(":")
    m = build_model(name, {"batch": batch})
    cluster = meshplan.load_cluster(ROOT / "examples" / "clusters" / f"{cluster_name}.json")
    graph = trace(m.train_step, *m.abstract_args, batch_argnums=m.batch_argnums, name=name)
    rt = retracer(m.train_step, m.abstract_args, m.batch_argnums, name)
    session = Session.from_env()
    row = {"case": f"{name} batch {batch}, {cluster_name}, p={p}, m={mb}"}
    t0 = time.perf_counter()
    for sched in SCHEDULES:
        try:
            plan = plan_graph(graph, cluster, meshplan.PipeshardParallel(
                stages=int(p), num_micro_batches=int(mb), schedule=sched), retrace=rt,
                session=session)
            text = f"{plan.predicted.iteration_s * 1e3:.0f} ms"
            if not isinstance(sched, str):
                text = f"{plan.schedule} ({text})"
        except InfeasiblePlanError:
            text = "does not fit"
        row[sched if isinstance(sched, str) else "searched"] = text
    row["plan s"] = f"{time.perf_counter() - t0:.0f}"
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=CASES)
    args = ap.parse_args(argv)
    rows = []
    for spec in args.cases.split(","):
        print(f"planning {spec} ...", file=sys.stderr, flush=True)
        rows.append(run_case(spec))
    cols = list(rows[0])
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(str(r[c]) for c in cols) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
