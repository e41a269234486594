"""Where meshplan's own plans put each mesh axis on TPU pods: a gpt planned
with ShardParallel on a fixed mesh over multi-slice jobs and one large slice,
listing for each axis the links it runs on (ICI torus rings or DCN) and what
the plan splits over it.  Plan-only: the figures are predictions, not runs.

    python benchmarks/tpu_multislice.py [--out benchmarks/results/tpu_multislice.md]

The claim checked (issue 21): an axis over slices carries only data
parallelism, the batch split along dimension 0 and, where the optimizer
state is sharded over it, the two halves of the gradients' all-reduce; no
weight is split over it, so tensor-parallel and FSDP traffic stays on ICI.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GPT = {"layers": "2", "hidden": "1024", "heads": "8", "seq_len": "512", "vocab": "1024",
       "batch": "1024", "dtype": "bfloat16", "compute_dtype": "bfloat16"}
# (cluster file, mesh shape): the slices first, as MaxText lays dcn_data_parallelism
CASES = (
    ("tpu-v5e-256-x2", (2, 16, 16)),
    ("tpu-v5e-256-x4", (4, 16, 16)),
    ("tpu-v5p-1024", (8, 8, 8)),
)


def _axes(spec) -> set[str]:
    return {a for d in spec for a in ((d,) if isinstance(d, str) else (d or ()))}


def run_case(name: str, shape: tuple[int, ...]) -> tuple[list[str], bool, str]:
    import meshplan
    from meshplan.cost_model.mesh import mesh_model
    from meshplan.models import build_model

    cluster = meshplan.load_cluster(ROOT / "examples" / "clusters" / "tpu" / f"{name}.json")
    model = build_model("gpt", GPT)
    start = time.perf_counter()
    plan = meshplan.plan(model.train_step, *model.abstract_args, cluster=cluster,
                         method=meshplan.ShardParallel(mesh_shape=shape))
    took = time.perf_counter() - start
    (stage,) = plan.stages
    mm = mesh_model(cluster, stage.logical_mesh, submesh=tuple(stage.submesh))
    weights = [s for k, s in stage.params if k.startswith("['params']")]
    state = [s for k, s in stage.params if not k.startswith("['params']")]
    rows, ok, notes = [], True, []
    for axis, link in zip(stage.logical_mesh.axes, mm.links):
        rings = " + ".join(f"{n}-ring {bw / 1e9:.4g} GB/s" for n, bw, _ in link.phases)
        batch = [k for k, s in plan.batch if axis in _axes(s[:1])]
        w = sum(axis in _axes(s) for s in weights)
        o = sum(axis in _axes(s) for s in state)
        if link.crosses_hosts and (w or any(axis in _axes(s[1:]) for _, s in plan.batch)):
            ok = False
        if link.crosses_hosts:
            notes.append(f"axis {axis} (DCN): " + (
                "the batch is split over it, so it carries the gradients' all-reduce"
                if batch else "the batch is not split over it: every slice runs the same "
                "step, and DCN carries only the all-gather of the weights updated from the "
                "optimizer state sharded over it") + f"; {w} weights split over it")
        rows.append(f"| {name} | {stage.logical_mesh.axis_size(axis)} | {axis} | "
                    f"{'DCN' if link.crosses_hosts else 'ICI'} | {rings} | "
                    f"{', '.join(batch) or '-'} | {w}/{len(weights)} | {o}/{len(state)} |")
    p = plan.predicted
    rows.append(f"| {name} | | (plan) | | predicted {p.iteration_s * 1e3:.3g} ms/iteration, "
                f"{p.tflops_per_device:.3g} TFLOP/s per chip | | planned in {took:.0f} s | |")
    return rows, ok, f"- {name}: " + ("; ".join(notes) or "one slice, every axis on ICI")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the table (markdown) here")
    args = parser.parse_args(argv)
    lines = [
        "# Mesh axes on TPU pods: ICI or DCN",
        "",
        f"Command: `python benchmarks/tpu_multislice.py --out benchmarks/results/"
        f"tpu_multislice.md`. Model: builtin gpt {GPT}; method ShardParallel on the mesh "
        "shape given (axes x, y, z), the ILP choosing every layout. Clusters: "
        "examples/clusters/tpu/ (Google Cloud's figures, cited there). Predictions only; "
        "the planning time is wall time on a shared, noisy machine.",
        "",
        "| cluster | size | axis | link | rings (per chip per direction) | batch split on it "
        "(dim 0) | weights split on it | optimizer/other state split on it |",
        "|---|---|---|---|---|---|---|---|",
    ]
    all_ok, notes = True, []
    for name, shape in CASES:
        rows, ok, note = run_case(name, shape)
        lines += rows
        notes.append(note)
        all_ok &= ok
        print(f"{name}: {'ok' if ok else 'FAILED'}", file=sys.stderr)
    lines += ["", ("No weight is split over an axis that crosses slices, and the batch only "
                   "along dimension 0: tensor-parallel and FSDP traffic stays on ICI."
                   if all_ok else "An axis over slices splits weights: see the table."),
              "", *notes, "",
              "The model is small for these pods (the plans are communication-bound), so "
              "these show where traffic goes, not throughput.", ""]
    text = "\n".join(lines)
    if args.out:
        Path(args.out).write_text(text, encoding="utf-8")
    print(text)
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
