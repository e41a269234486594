"""What the pipeline-schedule benchmarks share: a built-in model traced once
for a cluster file, and a Markdown table of one row per case."""
from __future__ import annotations

import argparse
import pathlib
import sys
from typing import Callable, NamedTuple

import meshplan
from meshplan.api import plan_graph, retracer
from meshplan.dp_search import Session
from meshplan.models import build_model
from meshplan.trace import trace

ROOT = pathlib.Path(__file__).resolve().parents[1]


class Case(NamedTuple):
    """A model traced once at ``batch`` and a cluster; :meth:`plan` plans it
    with one session, so that its layer ILPs are solved once for every method."""
    graph: object
    cluster: meshplan.ClusterSpec
    retrace: Callable
    session: Session

    @classmethod
    def of(cls, name: str, batch: str | int, cluster_name: str) -> "Case":
        m = build_model(name, {"batch": batch})
        cluster = meshplan.load_cluster(ROOT / "examples" / "clusters" / f"{cluster_name}.json")
        graph = trace(m.train_step, *m.abstract_args, batch_argnums=m.batch_argnums, name=name)
        rt = retracer(m.train_step, m.abstract_args, m.batch_argnums, name, graph=graph)
        return cls(graph, cluster, rt, Session.from_env())

    def plan(self, method) -> meshplan.Plan:
        return plan_graph(self.graph, self.cluster, method, retrace=self.retrace,
                          session=self.session)


def print_table(cases: str, run_case: Callable[[str], dict]) -> None:
    """Run ``run_case`` on each of the comma-separated ``cases`` (progress on
    stderr) and print their rows as a Markdown table."""
    rows = []
    for spec in cases.split(","):
        print(f"planning {spec} ...", file=sys.stderr, flush=True)
        rows.append(run_case(spec))
    cols = list(rows[0])
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(str(r[c]) for c in cols) + " |")


def main(doc: str, cases: str, run_case: Callable[[str], dict], argv=None) -> int:
    """A schedule benchmark's command line: ``--cases`` (default ``cases``)
    planned by ``run_case`` and printed by :func:`print_table`."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--cases", default=cases)
    print_table(ap.parse_args(argv).cases, run_case)
    return 0
