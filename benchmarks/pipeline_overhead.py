"""Dispatch overhead of the pipeline driver, per micro-batch and per stage.

For the built-in ``mlp`` (SGD, 8 layers so that 4 stages have work) on 8 fake
CPU devices this plans ``Manual(dp=1, tp=8/p, pp=p, num_micro_batches=m,
schedule=1f1b)`` for p in {2, 4} and m in {1, 2, 4, 8}, runs the step, and
reads what one call costs the Python driver:

* ``dispatch``: wall time of the call itself (it returns before the devices
  finish: every program and transfer is dispatched asynchronously);
* ``in jit``: the part of it spent inside the jitted programs' dispatch;
* ``driver``: the rest -- placing arguments, cutting the batch into
  micro-batches, ``device_put`` between stages, bookkeeping;
* per program: ``dispatch`` and ``driver`` divided by the number of
  programs run (2 * p * m forward/backward + the update programs); the
  driver's target is 0.2 ms per program (issue 19);
* ``driver CPU``: the calling thread's CPU time (``time.thread_time``) in
  the call outside the programs' dispatch: the driver's own work, without
  the time the fake devices' threads take the 2 cores from it;
* ``step``: wall time of a call ended by ``block_until_ready`` (the
  devices' work included; fake CPU devices share the host's cores).

The overhead per micro-batch and per stage are the slopes of a least-squares
fit ``dispatch = a + b * m + c * p * m`` over the grid.  The timeline
watcher threads are switched off (``record_timeline=False``) and on in a
second pass, to show what observing the schedule costs.

    python benchmarks/pipeline_overhead.py [--calls 20] [--repeats 5]
                                           [--out benchmarks/results/pipeline_overhead.md]

With ``--grid`` it times the pipelines of ``benchmarks/measured_grid.py``'s
gpt instead (``Manual(dp, tp, pp, m)`` on that grid's calibrated cluster,
timeline off) and prints their table: what the driver costs the grid's rows,
as wall time of the call (which includes waits inside jit's dispatch) and as
the calling thread's CPU time (the host work itself, jit's dispatch included).
"""
from __future__ import annotations

import os

import _fake_devices  # noqa: E402,F401  (before jax: 8 fake CPU devices)

import argparse  # noqa: E402
import datetime  # noqa: E402
import pathlib  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

import meshplan  # noqa: E402
from meshplan.models import build_model  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]


def measure(m, state, batch, pp: int, mb: int, calls: int, repeats: int, timeline: bool,
            dp: int = 1, cluster=None):
    plan = meshplan.plan(m.train_step, state, batch, cluster=cluster, method=meshplan.Manual(
        dp=dp, tp=8 // pp // dp, pp=pp, num_micro_batches=mb, schedule="1f1b"))
    step = meshplan.parallelize(m.train_step, plan=plan)
    state, _ = step(state, batch)
    ex = step._fast[1]
    ex.record_timeline = timeline
    for _ in range(3):
        state, _ = step(state, batch)
    jax.block_until_ready(state)
    # the calling thread's CPU time inside the programs' dispatch
    jit_cpu = [0.0]
    call = ex._call

    def timed_call(*a):
        c0 = time.thread_time()
        try:
            return call(*a)
        finally:
            jit_cpu[0] += time.thread_time() - c0

    ex._call = timed_call
    dispatch, in_jit, stepped, cpu, host = [], [], [], [], []
    for _ in range(repeats):
        d, j, c, h = [], [], [], []
        for _ in range(calls):
            jax.block_until_ready(state)
            jit_cpu[0] = 0.0
            t0, c0 = time.perf_counter(), time.thread_time()
            state, _ = step(state, batch)
            d.append(time.perf_counter() - t0)
            h.append(time.thread_time() - c0)
            c.append(h[-1] - jit_cpu[0])
            _, events, _ = ex._events
            j.append(sum(e[4] - e[3] for e in events))
        t0 = time.perf_counter()
        for _ in range(calls):
            state, _ = step(state, batch)
        jax.block_until_ready(state)
        stepped.append((time.perf_counter() - t0) / calls)
        dispatch.append(statistics.median(d))
        in_jit.append(statistics.median(j))
        cpu.append(statistics.median(c))
        host.append(statistics.median(h))
    if timeline:
        blocks = step.last_timeline
        assert blocks
    return {"dp": dp, "pp": pp, "mb": mb, "tasks": ex.last_stats["tasks"],
            "dispatch": statistics.median(dispatch), "in_jit": statistics.median(in_jit),
            "step": statistics.median(stepped), "driver_cpu": statistics.median(cpu),
            "host_cpu": statistics.median(host)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/pipeline_overhead.md"))
    ap.add_argument("--grid", action="store_true",
                    help="time the measured grid's gpt pipelines instead (printed, nothing written)")
    args = ap.parse_args()
    if args.grid:
        return grid(args.calls, args.repeats)
    m = build_model("mlp", {"optimizer": "sgd", "layers": "8"})
    state, batch = jax.device_get(m.init(0))
    rows = {True: [], False: []}
    for timeline in (False, True):
        for pp in (2, 4):
            for mb in (1, 2, 4, 8):
                r = measure(m, state, batch, pp, mb, args.calls, args.repeats, timeline)
                rows[timeline].append(r)
                print(f"timeline={timeline!s:5} pp={pp} mb={mb} tasks={r['tasks']:3d} "
                      f"dispatch={r['dispatch'] * 1e3:7.3f} ms in_jit={r['in_jit'] * 1e3:7.3f} ms "
                      f"step={r['step'] * 1e3:7.3f} ms driver cpu={r['driver_cpu'] * 1e3:7.3f} ms",
                      flush=True)
    lines = [
        "# Pipeline driver dispatch overhead",
        "",
        f"Generated by `python benchmarks/pipeline_overhead.py --calls {args.calls} --repeats "
        f"{args.repeats}` on {datetime.date.today()}, "
        f"{platform.machine()} host, jax {jax.__version__}, 8 fake CPU devices "
        f"({os.cpu_count()} host cores, shared with other work while measured: read the "
        "numbers as an order of magnitude).",
        "",
        "Model: built-in `mlp`, 8 hidden layers of 64, batch 16, SGD; plan "
        "`Manual(dp=1, tp=8/p, pp=p, num_micro_batches=m, schedule='1f1b')`. "
        "Medians over repeats of the median call.  `dispatch` is the wall time of one call "
        "(it returns before the devices finish); `in jit` is the part spent dispatching the "
        "jitted stage programs; `driver` = dispatch - in jit (placing arguments, micro-batch "
        "slicing, cross-stage `device_put`, bookkeeping); `step` is a call ended by "
        "`block_until_ready`.  Per program: `dispatch` and `driver` divided by the programs "
        "run (target: driver 0.2 ms per program).  Where the sender holds not every piece of "
        "the receiver's layout, a value crosses in the sender's layout and a jitted gather on "
        "the receiver lays it out (counted in `driver`); a put would copy it through host "
        "memory, waiting for it.  Where `dispatch` comes close to `step`, the fake devices "
        "ran the programs on the cores the driver runs on while it dispatched: `driver` then "
        "includes that contention, not Python alone.  `driver CPU`: the calling thread's CPU "
        "time in the call outside the programs' dispatch (`time.thread_time`), the driver's "
        "own work without the time the fake devices' threads take the cores from it: what "
        "the driver costs a host whose devices do not share its cores.",
        "",
    ]
    for timeline in (False, True):
        rs = rows[timeline]
        lines += [f"## Timeline recording {'on (default)' if timeline else 'off'}", "",
                  "| stages p | micro-batches m | programs | dispatch (ms) | in jit (ms) | "
                  "driver (ms) | dispatch per program (µs) | driver per program (µs) | "
                  "driver CPU per program (µs) | step (ms) |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in rs:
            drv = r["dispatch"] - r["in_jit"]
            lines.append(f"| {r['pp']} | {r['mb']} | {r['tasks']} | {r['dispatch'] * 1e3:.3f} | "
                         f"{r['in_jit'] * 1e3:.3f} | {drv * 1e3:.3f} | "
                         f"{r['dispatch'] / r['tasks'] * 1e6:.0f} | {drv / r['tasks'] * 1e6:.0f} | "
                         f"{r['driver_cpu'] / r['tasks'] * 1e6:.0f} | {r['step'] * 1e3:.3f} |")
        A = np.array([[1.0, r["mb"], r["pp"] * r["mb"]] for r in rs])
        y = np.array([r["dispatch"] for r in rs])
        a, b, c = np.linalg.lstsq(A, y, rcond=None)[0]
        lines += ["", f"Fit `dispatch = a + b*m + c*p*m`: a = {a * 1e3:.3f} ms per call, "
                  f"b = {b * 1e3:.3f} ms per micro-batch, c = {c * 1e3:.3f} ms per stage and "
                  f"micro-batch (one forward + one backward program and their transfers).", ""]
        print(lines[-2])
    pathlib.Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


# the pipelines of benchmarks/measured_grid.py's gpt: (dp, pp, micro-batches)
GRID_ROWS = ((2, 4, 4), (2, 4, 8), (1, 4, 4), (1, 4, 8), (1, 8, 8), (4, 2, 2), (4, 2, 4))


def grid(calls: int, repeats: int) -> None:
    """What a call of the measured grid's gpt pipelines costs the driver,
    planned on that grid's calibrated cluster."""
    from measured_grid import MODEL_SIZES    # (benchmarks/ is on sys.path)
    m = build_model("gpt", MODEL_SIZES["gpt"])
    state, batch = jax.device_get(m.init(0))
    cluster = meshplan.load_cluster(ROOT / "benchmarks/results/measured_grid_cluster.json")
    print("| dp | tp | pp | micro-batches | programs | dispatch ms | in jit ms | step ms | "
          "dispatch per program us | calling thread's CPU per program us |\n"
          "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for dp, pp, mb in GRID_ROWS:
        r = measure(m, state, batch, pp, mb, calls, repeats, False, dp=dp, cluster=cluster)
        print(f"| {dp} | {8 // pp // dp} | {pp} | {mb} | {r['tasks']} | {r['dispatch'] * 1e3:.1f} | "
              f"{r['in_jit'] * 1e3:.1f} | {r['step'] * 1e3:.1f} | "
              f"{r['dispatch'] / r['tasks'] * 1e6:.0f} | {r['host_cpu'] / r['tasks'] * 1e6:.0f} |",
              flush=True)


if __name__ == "__main__":
    main()
