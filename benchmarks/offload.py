"""Offloading Adam's state to host memory: a GPT that does not fit a
one-stage data-parallel plan on V100s of 16 GB, and fits once its optimizer
state lives in host memory (PCIe 3.0 x16, the cluster file's host link).

For each offload setting this plans the step with ``Manual(dp=8)`` (every
device holds the whole model, as plain data parallelism does) and prints the
predicted iteration time, peak memory per device and the time the state
takes over PCIe per step; then ``ShardParallel()``, whose ILP may instead
split the state over the devices (ZeRO-style), for comparison.  Predictions only: nothing runs (a CPU run keeps "host"
memory in the same RAM, see tests/test_offload.py).

    python benchmarks/offload.py [--cluster examples/clusters/aws-p3.16xlarge-x1.json]
                                 [--layers 24 --hidden 1536 --heads 16 --seq-len 1024 --batch 16]
"""
from __future__ import annotations

import argparse
import sys

import _fake_devices  # noqa: F401  (before jax: 8 fake CPU devices)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cluster", default="examples/clusters/aws-p3.16xlarge-x1.json")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--hidden", type=int, default=1536)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=51200)
    ap.add_argument("--batch", type=int, default=16)
    args = ap.parse_args(argv)

    import meshplan
    from meshplan.models import build_model
    from meshplan.units import human_bytes, human_time

    # the Alpa suite's gpt-760m shape by default, float32 parameters and fp16 compute
    config = {"layers": args.layers, "hidden": args.hidden, "heads": args.heads,
              "seq_len": args.seq_len, "vocab": args.vocab, "batch": args.batch,
              "dtype": "float32", "compute_dtype": "float16"}
    m = build_model("gpt", config)
    cluster = meshplan.load_cluster(args.cluster)
    budget = cluster.device.memory_bytes * 0.9
    print(f"gpt {config} on {cluster.name}: {m.param_count() / 1e9:.2f} B parameters, "
          f"budget {human_bytes(budget)} per device (90% of {human_bytes(cluster.device.memory_bytes)})")
    print(f"{'offload':<10} {'iteration':>10} {'peak/device':>12} {'host moves':>11}  memory")
    n = cluster.num_devices
    methods = [(o, meshplan.Manual(dp=n, offload=o)) for o in ("none", "optimizer", "auto")]
    # for comparison: the ILP free to shard the state over the devices (ZeRO-style)
    methods.append(("shard", meshplan.ShardParallel()))
    for label, method in methods:
        try:
            p = meshplan.plan(m.train_step, *m.abstract_args, cluster=cluster, method=method)
        except meshplan.InfeasiblePlanError as e:
            print(f"{label:<10} does not fit: {str(e)[:110]}")
            continue
        s = p.stages[0]
        moves = s.predicted.host_transfer_s or 0.0
        print(f"{label:<10} {human_time(p.predicted.iteration_s):>10} "
              f"{human_bytes(p.predicted.peak_memory_bytes):>12} {human_time(moves):>11}  "
              f"{s.predicted.memory} [{s.offload}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
