"""Layers in a ``lax.scan`` against layers in a Python loop, planned by ``auto``.

The built-in GPT has both forms (``scan_layers=true``: every block parameter
stacked with a leading ``[layers]`` axis and applied with ``jax.lax.scan``).
meshplan unrolls the scan into one input per layer (``meshplan.trace.unstack``), so
the two forms should get the same plan and the same predicted speed.  For each
row of Alpa's GPT suite given, both forms are planned with ``meshplan.plan``
(``Auto``) in this process; the table gives the planning time, the plan and
the predicted TFLOP/s per GPU of each.

    python benchmarks/scan_layers.py [--rows gpt-1.3b,gpt-39b]

Writes benchmarks/results/scan_layers.md and .csv.
"""
from __future__ import annotations

import argparse
import csv
import os
import pathlib
import platform
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import meshplan
from meshplan import progress
from meshplan.dp_search import Session
from meshplan.models import PRESET_INFO, build_model
from plan_quality import cluster_for, describe   # (benchmarks/ is on sys.path)

ROOT = pathlib.Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results"
ROWS = ["gpt-1.3b", "gpt-6.7b", "gpt-39b"]
KEYS = ["model", "gpus", "loop_s", "loop_plan", "loop_tflops", "scan_s", "scan_plan",
        "scan_tflops", "same_plan", "tflops_ratio"]


def _plan(name: str, gpus: int, scan: bool, session: Session) -> tuple[float, meshplan.Plan]:
    m = build_model(name, {"scan_layers": scan})
    t = time.perf_counter()
    p = meshplan.plan(m.train_step, *m.abstract_args, cluster=cluster_for(gpus),
                      method=meshplan.Auto(), batch_argnums=m.batch_argnums, session=session)
    return time.perf_counter() - t, p


def row(name: str, session: Session) -> dict:
    gpus = PRESET_INFO[name]["gpus"]
    loop_s, loop = _plan(name, gpus, False, session)
    scan_s, scan = _plan(name, gpus, True, session)
    lt, st = loop.predicted.tflops_per_device, scan.predicted.tflops_per_device
    return {"model": name, "gpus": gpus, "loop_s": round(loop_s, 1), "loop_plan": describe(loop),
            "loop_tflops": round(lt, 2), "scan_s": round(scan_s, 1), "scan_plan": describe(scan),
            "scan_tflops": round(st, 2), "same_plan": "yes" if describe(loop) == describe(scan)
            else "no", "tflops_ratio": round(st / lt, 4)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default=",".join(ROWS))
    args = ap.parse_args()
    # one session for the run: layer costs are shared, as they were by the
    # process-wide cache before sessions existed
    session = Session.from_env(progress.Progress(progress.QUIET))
    rows = []
    for name in args.rows.split(","):
        r = row(name, session)
        print(" | ".join(str(r[k]) for k in KEYS), flush=True)
        rows.append(r)
    OUT.mkdir(parents=True, exist_ok=True)
    with open(OUT / "scan_layers.csv", "w", newline="") as f:
        w = csv.DictWriter(f, KEYS)
        w.writeheader()
        w.writerows(rows)
    lines = ["# GPT with its layers in lax.scan vs in a Python loop (`--method auto`)", "",
             f"`python benchmarks/scan_layers.py --rows {args.rows}` on {platform.node()} "
             f"({os.cpu_count()} CPUs), AWS p3.16xlarge cluster files. Planning times are "
             "in-process seconds (tracing included); TFLOP/s per GPU are meshplan's prediction.",
             "", "| " + " | ".join(KEYS) + " |", "|" + "---|" * len(KEYS)]
    lines += ["| " + " | ".join(str(r[k]) for k in KEYS) + " |" for r in rows]
    (OUT / "scan_layers.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {OUT / 'scan_layers.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
