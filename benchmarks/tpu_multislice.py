"""Where meshplan's own plans put each mesh axis on TPU pods: a small gpt and
MaxText's 16B decoder (benchmarks/_maxtext_decoder.py, as in maxtext_tpu.py)
planned with ShardParallel on a fixed mesh over multi-slice jobs and one large slice,
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
# (model, cluster file, mesh shape): the slices first, as MaxText lays
# dcn_data_parallelism; the MaxText rows take MaxText's 16B configuration
# (per-chip batch 6, full recomputation) on a 2-slice v5e job, and on a
# v5p-1024 slice an FSDP x tensor mesh
CASES = (
    ("gpt", "tpu-v5e-256-x2", (2, 16, 16)),
    ("gpt", "tpu-v5e-256-x4", (4, 16, 16)),
    ("gpt", "tpu-v5p-1024", (8, 8, 8)),
    ("maxtext-16b", "tpu-v5e-256-x2", (2, 256)),
    ("maxtext-16b", "tpu-v5p-1024", (32, 16)),     # (v5p-1024: 512 chips)
)


def _step(model: str, cluster):
    """(step, its abstract arguments) of ``model`` for ``cluster``."""
    if model == "gpt":
        from meshplan.models import build_model
        m = build_model("gpt", GPT)
        return m.train_step, m.abstract_args
    from _maxtext_decoder import abstract_step
    from maxtext_tpu import model_dims
    step, state, tokens = abstract_step(batch=6 * cluster.num_devices, remat_policy="full",
                                        **model_dims(16))
    return step, (state, tokens)


def _is_weight(path: str) -> bool:
    """A model weight's leaf (gpt: under ['params']; the MaxText step's state:
    under ['params'] too, its AdamW moments under ['opt_state'])."""
    return path.startswith("['params']")


def _axes(spec) -> set[str]:
    return {a for d in spec for a in ((d,) if isinstance(d, str) else (d or ()))}


def run_case(model: str, name: str, shape: tuple[int, ...], time_limit: float = 60.0
             ) -> tuple[list[str], bool, str]:
    import meshplan
    from meshplan.cost_model.mesh import mesh_model

    cluster = meshplan.load_cluster(ROOT / "examples" / "clusters" / "tpu" / f"{name}.json")
    step, args = _step(model, cluster)
    start = time.perf_counter()
    plan = meshplan.plan(step, *args, cluster=cluster,
                         method=meshplan.ShardParallel(mesh_shape=shape, time_limit=time_limit))
    took = time.perf_counter() - start
    (stage,) = plan.stages
    mm = mesh_model(cluster, stage.logical_mesh, submesh=tuple(stage.submesh))
    weights = [s for k, s in stage.params if _is_weight(k)]
    state = [s for k, s in stage.params if not _is_weight(k)]
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
        rows.append(f"| {model} | {name} | {stage.logical_mesh.axis_size(axis)} | {axis} | "
                    f"{'DCN' if link.crosses_hosts else 'ICI'} | {rings} | "
                    f"{', '.join(batch) or '-'} | {w}/{len(weights)} | {o}/{len(state)} |")
    p = plan.predicted
    rows.append(f"| {model} | {name} | | (plan) | | predicted {p.iteration_s * 1e3:.3g} ms/iteration, "
                f"{p.tflops_per_device:.3g} TFLOP/s per chip | | planned in {took:.0f} s"
                f"{' (ILP stopped at its time limit)' if plan.ilp_time_limit_hit else ''} | |")
    note = f"- {model} on {name}: " + ("; ".join(notes) or "one slice, every axis on ICI")
    if notes and model != "gpt":
        note += "\n" + _off_dcn(step, args, cluster, stage.logical_mesh, time_limit)
    return rows, ok, note


def _off_dcn(step, args, cluster, mesh, time_limit: float) -> str:
    """The whole-graph ILP's objective as planned, and with parameters and
    state kept off the slice axis (axis 0): what keeping the cross-slice
    axis to data parallelism would cost under meshplan's own model."""
    from meshplan.graph import OPT_STATE, PARAM, STATE
    from meshplan.ilp.intra_op import solve_intra_op
    from meshplan.trace import trace

    def off_axis_0(inp, spec, _) -> bool:
        return inp.role not in (PARAM, OPT_STATE, STATE) or 0 not in [a for d in spec for a in d]
    graph = trace(step, *args, warn=False)
    free, kept = (solve_intra_op(graph, cluster, mesh, input_filter=f, time_limit=time_limit)
                  for f in (None, off_axis_0))
    return (f"  - the whole-graph ILP's objective as planned {free.objective_s:.4g} s (compute "
            f"{free.compute_s:.4g} s, communication {free.comm_s:.4g} s); with parameters and "
            f"state kept off the slice axis {kept.objective_s:.4g} s (compute {kept.compute_s:.4g} s, "
            f"communication {kept.comm_s:.4g} s): "
            f"{(kept.objective_s - free.objective_s) / free.objective_s:+.1%}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the table (markdown) here")
    parser.add_argument("--time-limit", type=float, default=60.0,
                        help="the ILP's time limit, seconds (ShardParallel's default: 60)")
    parser.add_argument("--only", help="the cases whose 'model on cluster' contains this")
    args = parser.parse_args(argv)
    lines = [
        "# Mesh axes on TPU pods: ICI or DCN",
        "",
        "Command: `python benchmarks/tpu_multislice.py"
        + (f" --time-limit {args.time_limit:g}" if args.time_limit != 60.0 else "")
        + f" --out benchmarks/results/tpu_multislice.md`. Models: builtin gpt {GPT}; "
        "MaxText's 16B decoder "
        "(benchmarks/_maxtext_decoder.py: 32 layers x 4096, mlp 28672, seq 2048, per-chip "
        "batch 6, full recomputation, AdamW; maxtext_tpu.py's configuration); method "
        "ShardParallel on the mesh "
        "shape given (axes x, y, z), the ILP choosing every layout. Clusters: "
        "examples/clusters/tpu/ (Google Cloud's figures, cited there). Predictions only; "
        "the planning time is wall time on a shared, noisy machine.",
        "",
        "| model | cluster | size | axis | link | rings (per chip per direction) | batch split on it "
        "(dim 0) | weights split on it | optimizer/other state split on it |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    all_ok, notes = True, []
    for model, name, shape in CASES:
        if args.only and args.only not in f"{model} on {name}":
            continue
        rows, ok, note = run_case(model, name, shape, args.time_limit)
        lines += rows
        notes.append(note)
        all_ok &= ok
        print(f"{model} on {name}: {'ok' if ok else 'FAILED'}", file=sys.stderr, flush=True)
    lines += ["", ("No weight is split over an axis that crosses slices, and the batch only "
                   "along dimension 0: tensor-parallel and FSDP traffic stays on ICI."
                   if all_ok else "An axis over slices splits weights: see the table."),
              "", *notes, "",
              "The gpt is small for these pods (its plans are communication-bound): its rows "
              "show where traffic goes, not throughput; maxtext_tpu.md compares the 16B "
              "configuration's throughput with MaxText's.", ""]
    text = "\n".join(lines)
    if args.out:
        Path(args.out).write_text(text, encoding="utf-8")
    print(text)
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
