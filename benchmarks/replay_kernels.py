"""What full recomputation adds to a step: the cost model's replay against
the kernels XLA compiles for it and the step time measured.

The measured grid's gpt (``benchmarks/measured_grid.py``'s ``MODEL_SIZES``)
as one stage, ``Manual(dp, tp, pp=1, remat=False / True)``, on the 8 fake
CPU devices, planned on that grid's calibrated cluster file.  Per
configuration and way:

- predicted: the plan's iteration time, and what the layers' replay adds
  (``dp_search.solver.layer_cost_from_result``: the forward operators making
  what the backward reads), split into matmuls and the rest;
- compiled: the kernels of the step's compiled program by kind
  (:func:`meshplan.runtime.hlo.kernel_summary`: matmul, reduction, loop
  fusions; how many, the bytes of their results on one device);
- measured: the fastest of ``--repeats`` means of ``--steps`` steps, each
  ended by ``block_until_ready``, after a warm-up.

    python benchmarks/replay_kernels.py [--configs 8x1,4x2] [--repeats 5] [--steps 3]

Prints a Markdown table; nothing is written.  The fake devices share the
host's cores: the measured column is indicative.
"""
from __future__ import annotations

import _fake_devices  # noqa: F401  (before jax: 8 fake CPU devices)

import argparse  # noqa: E402
import pathlib  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402

import meshplan  # noqa: E402
from meshplan.api import trace_step  # noqa: E402
from meshplan.dp_search import Session  # noqa: E402
from meshplan.dp_search.problem import layer_problems  # noqa: E402
from meshplan.dp_search.solver import LayerSolver  # noqa: E402
from meshplan.graph import ancestor_nodes  # noqa: E402
from meshplan.runtime.hlo import kernel_summary  # noqa: E402

from measured_grid import build  # noqa: E402  (benchmarks/ is on sys.path)

ROOT = pathlib.Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "benchmarks" / "results" / "measured_grid_cluster.json"
MATMULS = frozenset({"dot_general", "conv_general_dilated"})
KINDS = ("matmul", "reduction", "loop")


def replay_split(model, cluster, method) -> tuple[float, float]:
    """(matmul s, other s) that the layers' full recomputation runs again,
    summed over the step's layers, as the stage DP prices it."""
    g = trace_step(model.train_step, model.abstract_args, tuple(model.batch_argnums), "gpt")[0]
    opts = method.request(cluster.num_devices).pipeline
    lay = layer_problems(g, 1, cluster, opts)
    solver = LayerSolver(cluster, opts, Session(workers=1))
    dots = other = 0.0
    for layer in range(len(lay.subs)):
        req = lay.request(layer, 0, 0)
        sub, saved = req[0], req[5]
        cost = solver.layer_cost(*req)
        replayed = frozenset(ancestor_nodes(sub, set(saved)))
        for node, seconds, _ in cost.result.node_seconds:
            if node in replayed:
                if sub.nodes[node].primitive in MATMULS:
                    dots += seconds
                else:
                    other += seconds
    return dots, other


def measure(step, state, batch, repeats: int, steps: int) -> float:
    """Seconds per step: the fastest mean of ``steps`` over ``repeats``."""
    for _ in range(2):
        state, _ = step(state, batch)
    jax.block_until_ready(state)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(steps):
            state, out = step(state, batch)
        jax.block_until_ready((state, out))
        best = min(best, (time.perf_counter() - t0) / steps)
    return best


def row(model, cluster, dp: int, tp: int, remat: bool, repeats: int, steps: int) -> dict:
    method = meshplan.Manual(dp=dp, tp=tp, pp=1, num_micro_batches=1, remat=remat)
    step = meshplan.parallelize(model.train_step, method=method, cluster=cluster,
                                batch_argnums=model.batch_argnums, donate_argnums=(0,))
    state, batch = model.init(0)
    plan = step.plan_for(state, batch)
    kernels = kernel_summary(step.lower(state, batch).compile().as_text())
    dots, other = replay_split(model, cluster, method) if remat else (0.0, 0.0)
    return {"predicted": plan.predicted.iteration_s, "replay_dots": dots, "replay_other": other,
            "kernels": kernels, "measured": measure(step, state, batch, repeats, steps)}


def table(rows: list[tuple[str, dict, dict]]) -> str:
    head = ("| configuration | way | predicted ms | replay: matmuls ms | replay: other ms | "
            + " | ".join(f"{k} kernels (MB)" for k in KINDS) + " | measured ms |")
    lines = [head, "|---|---|" + "---:|" * (4 + len(KINDS))]

    def cells(r: dict) -> list[str]:
        out = [f"{r['predicted'] * 1e3:.1f}", f"{r['replay_dots'] * 1e3:.1f}",
               f"{r['replay_other'] * 1e3:.1f}"]
        out += [f"{r['kernels'].get(k, (0, 0))[0]} ({r['kernels'].get(k, (0, 0))[1] / 1e6:.1f})"
                for k in KINDS]
        return out + [f"{r['measured'] * 1e3:.1f}"]

    for name, off, on in rows:
        lines.append(f"| {name} | none | " + " | ".join(cells(off)) + " |")
        lines.append(f"| {name} | full | " + " | ".join(cells(on)) + " |")
        delta = [f"{(on['predicted'] - off['predicted']) * 1e3:+.1f}", "", ""]
        for k in KINDS:
            (n0, b0), (n1, b1) = off["kernels"].get(k, (0, 0)), on["kernels"].get(k, (0, 0))
            delta.append(f"{n1 - n0:+d} ({(b1 - b0) / 1e6:+.1f})")
        delta.append(f"{(on['measured'] - off['measured']) * 1e3:+.1f}")
        lines.append(f"| {name} | full - none | " + " | ".join(delta) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="8x1,4x2",
                    help="comma-separated dp x tp meshes of 8 devices (default 8x1,4x2)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--cluster", default=str(CLUSTER), help="cluster JSON to plan with")
    args = ap.parse_args(argv)
    meshes = []
    for text in args.configs.split(","):
        try:
            dp, tp = (int(x) for x in text.lower().split("x"))
        except ValueError:
            ap.error(f"--configs: {text!r} is not DPxTP (e.g. 4x2)")
        if dp * tp != 8:
            ap.error(f"--configs: {text} uses {dp * tp} devices; dp x tp must be 8")
        meshes.append((dp, tp))
    cluster = meshplan.load_cluster(args.cluster)
    model = build("gpt")
    rows = []
    for dp, tp in meshes:
        off, on = (row(model, cluster, dp, tp, remat, args.repeats, args.steps)
                   for remat in (False, True))
        rows.append((f"dp={dp} tp={tp}", off, on))
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
