"""What a 1% gap buys on the hardest capped layer ILPs of a search.

Plans a built-in model with ``Auto()`` on its Alpa-suite cluster (every ILP in
this process, capped ones exact: ``capped_gap=0``), keeps the ``--keep``
slowest MIPs handed to HiGHS, then solves each again exact and at each
``--gaps`` value, printing seconds and objectives (the objective's excess
over the exact optimum is what the gap costs the layer).

    python benchmarks/capped_gap.py [--model gpt-1.3b] [--keep 12] [--gaps 0.01,0.02]

Figures depend on the machine and its load; the exact and gapped solves of
one MIP run one after the other.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import meshplan
from meshplan.dp_search import Session
from meshplan.ilp import solvers
from meshplan.ilp.options import SolverOptions
from meshplan.models import PRESET_INFO, build_model
from meshplan.planning import plan_step, retracer
from meshplan.trace import trace
from plan_quality import cluster_for   # (benchmarks/ is on sys.path)


def hardest_mips(name: str, keep: int) -> list[tuple[float, object, object]]:
    """The ``keep`` slowest MIPs of planning ``name`` (seconds, MIP, warm start)."""
    grabbed: list = []
    run = solvers._run_highs

    def timed(mip, warm, time_limit, threads, options, gap=0.0):
        t0 = time.perf_counter()
        out = run(mip, warm, time_limit, threads, options, gap)
        grabbed.append((time.perf_counter() - t0, mip, warm))
        grabbed.sort(key=lambda g: -g[0])
        del grabbed[keep:]
        return out

    solvers._run_highs = timed
    try:
        session = Session.from_env()
        session = dataclasses.replace(session, workers=1,
                                      solver=dataclasses.replace(session.solver, capped_gap=0.0))
        m = build_model(name, {})
        graph = trace(m.train_step, *m.abstract_args, batch_argnums=m.batch_argnums, name=name)
        rt = retracer(m.train_step, m.abstract_args, m.batch_argnums, name, graph=graph)
        plan_step(graph, cluster_for(PRESET_INFO[name]["gpus"]), meshplan.Auto(), retrace=rt,
                  session=session)
    finally:
        solvers._run_highs = run
    return grabbed


def objective(mip, values) -> float:
    cost, _ = mip.columns()
    return float(sum(c * v for c, v in zip(cost, values))) + mip.offset


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gpt-1.3b")
    ap.add_argument("--keep", type=int, default=12)
    ap.add_argument("--gaps", default="0.01,0.02")
    args = ap.parse_args(argv)
    gaps = [float(g) for g in args.gaps.split(",")]
    mips = hardest_mips(args.model, args.keep)
    print(f"{len(mips)} slowest MIPs of planning {args.model} (Auto(), exact capped ILPs)")
    print("exact s  objective  | " + " | ".join(f"gap {g:g}: s, excess" for g in gaps))
    totals = [0.0] * (len(gaps) + 1)
    for _, mip, warm in mips:
        row = []
        t0 = time.perf_counter()
        values, _ = solvers._run_highs(mip, warm, None, 1, SolverOptions(), 0.0)
        exact_s, best = time.perf_counter() - t0, objective(mip, values)
        totals[0] += exact_s
        for i, g in enumerate(gaps):
            t0 = time.perf_counter()
            values, _ = solvers._run_highs(mip, warm, None, 1, SolverOptions(), g)
            took = time.perf_counter() - t0
            totals[i + 1] += took
            row.append(f"{took:6.2f}, {objective(mip, values) / best - 1:+.2%}")
        print(f"{exact_s:7.2f}  {best:9.4g}  | " + " | ".join(row))
    print(f"total: exact {totals[0]:.1f} s; " + "; ".join(
        f"gap {g:g} {t:.1f} s" for g, t in zip(gaps, totals[1:])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
