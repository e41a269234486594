"""Build time of one layer-sized ILP (ilp.build.build_problem alone, no solve).

A one-block GPT step with gpt-2.6b's block (hidden 2560, 32 heads, seq 1024;
a micro-batch of 8, bfloat16 compute) built on a few logical meshes with
fresh memo tables each time, as an ILP worker builds its first job.  Prints
the process CPU seconds of each build (min and median over ``--repeat``) and
a digest of the built problem, so that two commits can be compared: the
digests must match, the times may not.

    python benchmarks/ilp_build_time.py [--repeat 3]
"""
from __future__ import annotations

import argparse
import hashlib
import os
import pathlib
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIG = {"layers": 1, "hidden": 2560, "heads": 32, "seq_len": 1024, "vocab": 51200,
          "batch": 8, "dtype": "float32", "compute_dtype": "bfloat16"}
# (cluster file, mesh shape)
MESHES = [("dgx-a100-x1.json", (2, 4)), ("dgx-a100-x1.json", (2, 2, 2)),
          ("aws-p3.16xlarge-x2.json", (2, 2, 4))]


def digest(built) -> str:
    """The problem's numbers: costs, edges, memory rows."""
    h = hashlib.sha256()
    p = built.problem
    for c in p.costs:
        h.update(c.tobytes())
    for e in p.edges:
        h.update(repr((e.u, e.v)).encode() + e.cost.tobytes())
    for r in p.memory:
        h.update(repr((r.name, r.budget, sorted(r.coefs))).encode())
        for g in sorted(r.coefs):
            h.update(r.coefs[g].tobytes())
    return h.hexdigest()[:16]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    import meshplan
    from meshplan.cost_model.mesh import mesh_model
    from meshplan.graph import GRAD_BOUNDARY
    from meshplan.ilp import IlpCaches, build_problem
    from meshplan.models import build_model
    from meshplan.plan import LogicalMesh
    from meshplan.trace import trace

    m = build_model("gpt", CONFIG)
    g = trace(m.train_step, *m.abstract_args, batch_argnums=m.batch_argnums)
    grads = frozenset(t for n in g.nodes if n.primitive == GRAD_BOUNDARY for t in n.inputs)
    for cluster_file, shape in MESHES:
        cluster = meshplan.load_cluster(ROOT / "examples" / "clusters" / cluster_file)
        mm = mesh_model(cluster, LogicalMesh(("x", "y", "z")[:len(shape)], shape))
        took = []
        for _ in range(args.repeat):
            t0 = time.process_time()
            built = build_problem(g, mm, accumulate=grads, grad_accum=4, caches=IlpCaches())
            took.append(time.process_time() - t0)
        strategies = sum(len(c) for c in built.problem.costs)
        print(f"{cluster_file} mesh {shape}: {len(g.nodes)} operators, {strategies} strategies, "
              f"build CPU s min {min(took):.2f} median {statistics.median(took):.2f} "
              f"(x{args.repeat}), problem {digest(built)}", flush=True)


if __name__ == "__main__":
    main()
