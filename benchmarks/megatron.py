"""Megatron-LM Table 1 (Narayanan et al., SC'21) on DGX A100 clusters.

For each row: the published (tp, pp, dp, micro-batches) and TFLOP/s per GPU,
meshplan's prediction for that very configuration (Manual, every stage
recomputing its activations as Megatron-LM's runs did), and meshplan's own
choice (PipeshardParallel search, recomputation chosen per stage) with its
predicted iteration time.

Megatron-LM counts FLOPs with its formula for full recomputation,
96 B s l h^2 (1 + s/6h + V/16lh) per iteration; the predicted TFLOP/s of the
published configuration uses that formula with meshplan's predicted
iteration time, so the two are comparable.

    python benchmarks/megatron.py [--rows 18.4b,39.1b,145.6b] [--micro-batches searched|published]

Writes benchmarks/results/megatron.md and .csv (`--name`: another file name).  Planning
only: nothing runs on a GPU; the figures are the cost model's.
"""
from __future__ import annotations

import argparse
import csv
import pathlib
import sys
import time

import meshplan
from meshplan.errors import InfeasiblePlanError
from meshplan.api import plan_graph, retracer
from meshplan.dp_search import Session
from meshplan.models import PRESET_INFO, build_model
from meshplan.trace import trace

ROOT = pathlib.Path(__file__).resolve().parents[1]


def stage_shape(plan) -> tuple[str, str, int]:
    """(tp, dp, pp) of a plan: tp = the size of the last (fastest) mesh axis of
    each stage, dp = the rest of the stage's devices; written once when all
    stages agree, else per stage separated by '/'."""
    tps, dps = [], []
    for s in plan.stages:
        shape = s.logical_mesh.shape
        tp = shape[-1] if len(shape) > 1 else 1
        tps.append(tp)
        dps.append(s.logical_mesh.size // tp)
    one = lambda xs: str(xs[0]) if len(set(xs)) == 1 else "/".join(map(str, xs))  # noqa: E731
    return one(tps), one(dps), len(plan.stages)


def megatron_flops(config: dict) -> float:
    """FLOPs of one iteration as Megatron-LM counts them (full recomputation)."""
    B, s, l, h, V = (config[k] for k in ("batch", "seq_len", "layers", "hidden", "vocab"))
    return 96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))


def run_row(name: str, searched: bool, published_only: bool = False) -> dict:
    info = PRESET_INFO[f"megatron-{name}"]
    m = build_model(f"megatron-{name}")
    batch = m.config["batch"]
    gpus, tp, pp, dp = info["gpus"], info["tp"], info["pp"], info["dp"]
    cluster = meshplan.load_cluster(ROOT / "examples" / "clusters" / f"dgx-a100-x{gpus // 8}.json")
    mb_pub = batch // dp          # micro-batch size 1 per data-parallel replica
    session = Session.from_env()      # the two plans share their layer costs
    t0 = time.perf_counter()
    graph = trace(m.train_step, *m.abstract_args, batch_argnums=m.batch_argnums, name=name)
    rt = retracer(m.train_step, m.abstract_args, m.batch_argnums, name, graph=graph)
    published = plan_graph(graph, cluster, meshplan.Manual(dp=dp, tp=tp, pp=pp,
                                                           num_micro_batches=mb_pub,
                                                           schedule="1f1b", remat=True),
                           retrace=rt, session=session)
    t1 = time.perf_counter()
    t_pub = published.predicted.iteration_s
    row = {
        "model": f"megatron-{name}", "gpus": gpus,
        "published (tp,pp,dp,mb)": f"({tp},{pp},{dp},{mb_pub})",
        "published TFLOP/s": info["tflops_per_gpu"],
        "meshplan on published config TFLOP/s": round(megatron_flops(m.config) / gpus / t_pub
                                                      / 1e12, 1),
        "relative error": round(megatron_flops(m.config) / gpus / t_pub / 1e12
                                / info["tflops_per_gpu"] - 1, 3),
        "published config iteration s": round(t_pub, 2),
    }
    if published_only:
        return {**row, "plan seconds": round(t1 - t0, 1)}
    mbs = None if searched else mb_pub
    own = plan_graph(graph, cluster, meshplan.PipeshardParallel(num_micro_batches=mbs,
                                                                schedule="1f1b"), retrace=rt,
                     session=session)
    t2 = time.perf_counter()
    otp, odp, opp = stage_shape(own)
    t_own = own.predicted.iteration_s
    return {
        **row,
        "meshplan choice (tp,pp,dp,mb)": f"({otp},{opp},{odp},{own.num_micro_batches})",
        "meshplan choice iteration s": round(t_own, 2),
        "choice speedup": round(t_pub / t_own, 2),
        # (tp: the last axis of a stage's 2-D mesh; a 1-D mesh has none)
        "tp inside a host": all((s.logical_mesh.shape[-1] if len(s.logical_mesh.shape) > 1 else 1)
                                <= cluster.devices_per_host for s in own.stages),
        "choice remat": any(s.remat for s in own.stages),
        "plan seconds": round(t2 - t0, 1),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1.7b,3.6b,7.5b,18.4b,39.1b,76.1b,145.6b,310.1b,529.6b,1t")
    ap.add_argument("--micro-batches", choices=["searched", "published"], default="published")
    ap.add_argument("--published-only", action="store_true",
                    help="plan the published configurations only (no meshplan choice columns)")
    ap.add_argument("--name", default="megatron",
                    help="file name (no suffix) of the tables under benchmarks/results")
    args = ap.parse_args(argv)
    rows = []
    for name in args.rows.split(","):
        print(f"planning megatron-{name} ...", file=sys.stderr, flush=True)
        try:
            rows.append(run_row(name, args.micro_batches == "searched", args.published_only))
        except InfeasiblePlanError as e:
            # the row stays in the table: a configuration the cost model
            # believes does not fit is a finding, not a crash
            info = PRESET_INFO[f"megatron-{name}"]
            rows.append({"model": f"megatron-{name}", "gpus": info["gpus"],
                         "published (tp,pp,dp,mb)": f"({info['tp']},{info['pp']},{info['dp']},-)",
                         "published TFLOP/s": info["tflops_per_gpu"],
                         "meshplan on published config TFLOP/s": f"does not fit: {e}"})
        print(rows[-1], file=sys.stderr, flush=True)
    out = ROOT / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    keys = list(max(rows, key=len))
    with open(out / f"{args.name}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys, restval="")
        w.writeheader()
        w.writerows(rows)
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(str(r.get(k, "")) for k in keys) + " |" for r in rows]
    table = "\n".join(lines)
    (out / f"{args.name}.md").write_text(
        "# Megatron-LM Table 1 on DGX A100 (predicted by meshplan's cost model)\n\n"
        f"Command: `python benchmarks/megatron.py --rows {args.rows} --micro-batches "
        f"{args.micro_batches}{' --published-only' if args.published_only else ''}"
        f"{'' if args.name == 'megatron' else ' --name ' + args.name}`\n\n"
        "Planning only: nothing ran on a GPU.  *published config*: `Manual(dp, tp, pp, mb, "
        "1f1b, remat=True)`, every stage recomputing its activations as Megatron-LM's runs "
        "did, with Megatron-LM's dropout (0.1 on the attention probabilities and the residual "
        "branches, drawn with Philox as PyTorch draws it: JAX's \"rbg\" keys); its TFLOP/s "
        "per GPU use Megatron-LM's FLOP count for full recomputation, "
        "96 B s l h^2 (1 + s/6h + V/16lh), over meshplan's predicted iteration time, the same "
        "definition as the published figure.  *meshplan choice*: `PipeshardParallel` with the "
        "published micro-batch count, stages, meshes and recomputation searched; `choice "
        "speedup`: the published configuration's predicted iteration time over the choice's.  "
        "`(tp,pp,dp,mb)` of a choice: tp = the last axis of a stage's 2-D mesh (1 for a 1-D "
        "mesh), dp = the rest of its devices, per stage when they differ.\n\n"
        + table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
