"""The plan JSON of a fixed set of models and methods, written to one file,
so that two commits can be compared byte for byte (a restructuring must not
change a plan):

    git checkout A && python benchmarks/plan_json.py /tmp/a.json
    git checkout B && python benchmarks/plan_json.py /tmp/b.json
    python benchmarks/plan_json.py --compare /tmp/a.json /tmp/b.json

The cases are the determinism test's four and four more (data parallel,
Auto on two hosts, a searched pipeline, a one-stage Megatron-style plan).
"""
from __future__ import annotations

import argparse
import json
import sys

CLUSTER = "examples/clusters/dgx-a100-x1.json"
GPT = {"layers": 2, "hidden": 32, "heads": 2, "seq_len": 16, "vocab": 64, "batch": 8}
# label -> (model, config, method expression, cluster file)
CASES = {
    "gpt-shard": ("gpt", GPT, "meshplan.ShardParallel()", CLUSTER),
    "gpt-manual-pp2": ("gpt", GPT, "meshplan.Manual(dp=2, tp=2, pp=2, num_micro_batches=2)",
                       CLUSTER),
    "mlp-auto": ("mlp", {"layers": 4}, "meshplan.Auto()", CLUSTER),
    "moe-shard": ("moe", {"layers": 1, "hidden": 32, "heads": 2, "seq_len": 16, "vocab": 64,
                          "batch": 8, "num_experts": 4, "expert_group_size": 16},
                  "meshplan.ShardParallel()", CLUSTER),
    "gpt-data": ("gpt", GPT, "meshplan.DataParallel()", CLUSTER),
    "gpt-auto-x2": ("gpt", dict(GPT, layers=4), "meshplan.Auto()",
                    "examples/clusters/dgx-a100-x2.json"),
    "gpt-pipeshard": ("gpt", dict(GPT, layers=4), "meshplan.PipeshardParallel(num_micro_batches=2)",
                      CLUSTER),
    "gpt-manual-tp": ("gpt", GPT, "meshplan.Manual(dp=4, tp=2)", CLUSTER),
}


def plans(cluster_file: str | None = None) -> dict[str, str]:
    """The cases' plans, each on its own cluster file or all on ``cluster_file``."""
    import meshplan
    from meshplan.models import build_model
    out = {}
    for label, (name, config, method, cluster) in CASES.items():
        m = build_model(name, config)
        out[label] = meshplan.plan(m.train_step, *m.abstract_args,
                                   cluster=meshplan.load_cluster(cluster_file or cluster),
                                   method=eval(method, {"meshplan": meshplan})).to_json()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", nargs="?", help="file to write the plans to")
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two such files")
    ap.add_argument("--cluster", help="plan every case on this cluster file instead (to see "
                    "what a change to a cluster's figures does to the plans)")
    args = ap.parse_args(argv)
    if args.compare:
        a, b = (json.load(open(f)) for f in args.compare)
        differ = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
        print(f"differ: {differ}" if differ else f"identical: all {len(a)} plans")
        return 1 if differ else 0
    if not args.out:
        ap.error("give a file to write, or --compare A B")
    with open(args.out, "w") as f:
        json.dump(plans(args.cluster), f, indent=0, sort_keys=True)
    print(f"{len(CASES)} plans written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
