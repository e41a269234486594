"""Full recomputation: the cost model's replay, XLA's kernels, the measured step.

What full recomputation adds to a step, three ways: the cost model's replay,
the kernels XLA compiles for it, and the step time measured.

The measured grid's gpt (``benchmarks/measured_grid.py``'s ``MODEL_SIZES``)
as one stage, ``Manual(dp, tp, pp=1, remat=False / True)``, on the 8 fake
CPU devices, planned on that grid's calibrated cluster file.  Per
configuration and way:

- predicted: the plan's iteration time, and what the layers' replay adds
  (``dp_search.solver.layer_cost_from_result``: the forward operators making
  what the backward reads), split into matmuls, other compute and
  collectives;
- compiled: the kernels of the step's compiled program by kind
  (:func:`meshplan.runtime.hlo.kernel_summary`: matmul, reduction, loop
  fusions; how many, the bytes of their results on one device);
- measured: the fastest of ``--repeats`` means of ``--steps`` steps, each
  ended by ``block_until_ready``, after a warm-up; the two ways take turns
  repeat by repeat.

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


def replay_split(model, cluster, method) -> tuple[float, float, float]:
    """(matmul s, other compute s, collective s) that the layers' full
    recomputation runs again, summed over the step's layers, as the stage DP
    prices it."""
    g = trace_step(model.train_step, model.abstract_args, tuple(model.batch_argnums), "gpt")[0]
    opts = method.request(cluster.num_devices).pipeline
    lay = layer_problems(g, 1, cluster, opts)
    solver = LayerSolver(cluster, opts, Session(workers=1))
    dots = other = comm = 0.0
    for layer in range(len(lay.subs)):
        req = lay.request(layer, 0, 0)
        sub, saved = req[0], req[5]
        cost = solver.layer_cost(*req)
        # (the solver's replayed operators; its replay figures split by kind)
        replayed = frozenset(ancestor_nodes(sub, set(saved)))
        mine = sum(seconds for node, seconds, _ in cost.result.node_seconds
                   if node in replayed and sub.nodes[node].primitive in MATMULS)
        dots += mine
        other += cost.replay_compute_s - mine
        comm += cost.replay_comm_s
    return dots, other, comm


def measure(steps_of: list, repeats: int, steps: int) -> list[float]:
    """Seconds per step of each ``(step, state, batch)``: the fastest mean of
    ``steps`` steps over ``repeats``, the ways taking turns repeat by repeat
    (a change in the shared machine's load touches each alike)."""
    live = []
    for step, state, batch in steps_of:
        for _ in range(2):
            state, _ = step(state, batch)
        jax.block_until_ready(state)
        live.append([step, state, batch])
    best = [float("inf")] * len(live)
    for _ in range(repeats):
        for k, (step, state, batch) in enumerate(live):
            t0 = time.perf_counter()
            for _ in range(steps):
                state, out = step(state, batch)
            jax.block_until_ready((state, out))
            best[k] = min(best[k], (time.perf_counter() - t0) / steps)
            live[k][1] = state
    return best


def pair(model, cluster, dp: int, tp: int, repeats: int, steps: int) -> tuple[dict, dict]:
    """The configuration without recomputation and with full recomputation."""
    rows, runs = [], []
    for remat in (False, True):
        method = meshplan.Manual(dp=dp, tp=tp, pp=1, num_micro_batches=1, remat=remat)
        step = meshplan.parallelize(model.train_step, method=method, cluster=cluster,
                                    batch_argnums=model.batch_argnums, donate_argnums=(0,))
        state, batch = model.init(0)
        plan = step.plan_for(state, batch)
        kernels = kernel_summary(step.lower(state, batch).compile().as_text())
        dots, other, comm = replay_split(model, cluster, method) if remat else (0.0, 0.0, 0.0)
        rows.append({"predicted": plan.predicted.iteration_s, "replay_dots": dots,
                     "replay_other": other, "replay_comm": comm, "kernels": kernels})
        runs.append((step, state, batch))
    for r, seconds in zip(rows, measure(runs, repeats, steps)):
        r["measured"] = seconds
    return rows[0], rows[1]


def table(rows: list[tuple[str, dict, dict]]) -> str:
    head = ("| configuration | way | predicted ms | replay: matmuls ms | replay: other ms | "
            "replay: collectives ms | "
            + " | ".join(f"{k} kernels (MB)" for k in KINDS) + " | measured ms |")
    lines = [head, "|---|---|" + "---:|" * (5 + len(KINDS))]

    def cells(r: dict) -> list[str]:
        out = [f"{r['predicted'] * 1e3:.1f}", f"{r['replay_dots'] * 1e3:.1f}",
               f"{r['replay_other'] * 1e3:.1f}", f"{r['replay_comm'] * 1e3:.1f}"]
        out += [f"{r['kernels'].get(k, (0, 0))[0]} ({r['kernels'].get(k, (0, 0))[1] / 1e6:.1f})"
                for k in KINDS]
        return out + [f"{r['measured'] * 1e3:.1f}"]

    for name, off, on in rows:
        lines.append(f"| {name} | none | " + " | ".join(cells(off)) + " |")
        lines.append(f"| {name} | full | " + " | ".join(cells(on)) + " |")
        delta = [f"{(on['predicted'] - off['predicted']) * 1e3:+.1f}", "", "", ""]
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
        off, on = pair(model, cluster, dp, tp, args.repeats, args.steps)
        rows.append((f"dp={dp} tp={tp}", off, on))
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
