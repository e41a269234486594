"""How long ``Auto()`` takes to plan small steps on ``Cluster.local()``.

A user's first call of ``meshplan.parallelize(step)`` on 8 CPU devices plans
before it runs; for a small model that wait is most of the first call.  Each
row plans one built-in model in a fresh process (no cache warmed by another
row) with ``Auto()`` and with ``ShardParallel()`` (one program, the plan
``Auto()`` is compared with) and prints the seconds of ``meshplan.plan`` and
the plan: predicted step, stages x mesh, micro-batches, and the layer ILPs
the searches needed (from the plan's note).

    python benchmarks/local_planning.py [--rows gpt,mlp] [--out FILE.md]
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import subprocess
import sys
import time

ROWS = {
    "gpt": ("gpt", {}),
    "gpt-4x128": ("gpt", {"layers": 4, "hidden": 128, "heads": 4, "seq_len": 64, "vocab": 256,
                          "batch": 16, "optimizer": "adam"}),
    "moe": ("moe", {}),
    "mlp": ("mlp", {}),
    "wresnet": ("wresnet", {}),
}
METHODS = ("Auto", "ShardParallel")


def one(name: str, method: str) -> dict:
    """Plan row ``name`` with ``method`` in this process (the child's part)."""
    import _fake_devices  # noqa: F401  (before jax: 8 fake CPU devices)
    import meshplan
    from meshplan.models import build_model
    model, overrides = ROWS[name]
    m = build_model(model, overrides)
    t0 = time.perf_counter()
    p = meshplan.plan(m.train_step, *m.abstract_args, cluster=meshplan.Cluster.local(),
                      method=getattr(meshplan, method)())
    seconds = time.perf_counter() - t0
    found = [re.search(r"needed (\d+) layer ILPs", n) for n in p.notes]
    ilps = next((int(f[1]) for f in found if f), None)
    if ilps is None:
        found = [re.search(r"(\d+) distinct layer ILPs", n) for n in p.notes]
        ilps = next((int(f[1]) for f in found if f), 0)
    shape = "x".join(map(str, p.stages[0].logical_mesh.shape))
    return {"model": name, "method": method, "seconds": round(seconds, 2),
            "predicted_ms": round(p.predicted.iteration_s * 1e3, 4),
            "plan": f"{len(p.stages)}x[{shape}]", "micro_batches": p.num_micro_batches,
            "layer_ilps": ilps}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--out", help="write the table to this Markdown file")
    ap.add_argument("--one", nargs=2, metavar=("ROW", "METHOD"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(one(*args.one)))
        return 0
    rows = []
    for name in args.rows.split(","):
        for method in METHODS:
            out = subprocess.run([sys.executable, __file__, "--one", name, method],
                                 capture_output=True, text=True, env=dict(os.environ))
            if out.returncode:
                print(out.stderr[-2000:], file=sys.stderr)
                return out.returncode
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(rows[-1], flush=True)
    keys = list(rows[0])
    table = "\n".join(["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
                      + ["| " + " | ".join(str(r[k]) for k in keys) + " |" for r in rows])
    print(table)
    if args.out:
        pathlib.Path(args.out).write_text(
            "# Planning small steps on Cluster.local() (8 fake CPU devices)\n\n"
            f"Command: `python benchmarks/local_planning.py --rows {args.rows}`; seconds of "
            "`meshplan.plan` in a fresh process per row.\n\n" + table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
