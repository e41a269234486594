"""Per-call overhead of a meshplan step versus a hand-written ``jax.jit``.

For each built-in model (``mlp`` and a small ``gpt``, Adam) on 8 fake CPU
devices this plans the step with ``ShardParallel`` and times three callables
that run the same plan:

* ``jit (by hand)``: ``jax.jit(train_step)`` with the plan's input shardings
  (``NamedSharding`` on the same mesh, from the plan's specs), its output
  shardings and ``donate_argnums=(0,)`` -- what a user would write by hand;
* ``meshplan``: the ``meshplan.parallelize`` step, called as users call it;
* ``meshplan program``: the jitted program inside the meshplan step, called
  directly: the same XLA program without meshplan's Python, which separates
  dispatch overhead from differences of the compiled programs (the planned
  constraints on intermediate tensors are in meshplan's program only).

Each callable threads its own train state (donated every call) and gets the
same batch, either already placed as planned ("device batch", a data loader
that prefetches to the devices) or as NumPy arrays ("host batch", copied to
the devices on every call).  A measurement is N calls after warm-up, ended by
``block_until_ready``; the table shows the median over R repeats, the
callables interleaved within each repeat.

    python benchmarks/overhead.py [--calls 50] [--repeats 9] [--models mlp,gpt]
                                  [--out benchmarks/results/overhead.md]
"""
from __future__ import annotations

import os

import _fake_devices  # noqa: E402,F401  (before jax: 8 fake CPU devices)

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import datetime  # noqa: E402
import itertools  # noqa: E402
import pathlib  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from typing import Any, Callable  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

import meshplan  # noqa: E402
from meshplan.models import build_model  # noqa: E402
from meshplan.runtime import arg_specs, build_mesh  # noqa: E402
from meshplan.runtime.hlo import summary  # noqa: E402
from meshplan.runtime.shard import stage_devices, to_partition_spec  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
MODELS: dict[str, dict[str, Any]] = {
    "mlp": {},                                                        # batch 16, 3 x 64 hidden
    "gpt": {"batch": 8, "seq_len": 32, "hidden": 64, "layers": 2, "heads": 4, "vocab": 256},
}


def hand_written_jit(model: Any, plan: meshplan.Plan, state: Any, batch: Any) -> tuple[Any, Any]:
    """``jax.jit`` of the step with the plan's shardings written out by hand."""
    stage = plan.stages[0]
    mesh = build_mesh(stage.logical_mesh, stage_devices(stage))
    specs = arg_specs(plan, (state, batch))
    in_shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                                is_leaf=lambda x: isinstance(x, PartitionSpec))
    outputs = dict(stage.outputs)
    out_shape = jax.eval_shape(model.train_step, state, batch)

    def out_one(path: Any, _: Any) -> NamedSharding | None:
        spec = outputs.get(jax.tree_util.keystr(path))
        return None if spec is None else NamedSharding(mesh, to_partition_spec(spec))

    out_shardings = jax.tree_util.tree_map_with_path(out_one, out_shape)
    jitted = jax.jit(model.train_step, in_shardings=in_shardings, out_shardings=out_shardings,
                     donate_argnums=(0,))
    return jitted, in_shardings


def time_calls(fn: Callable[..., Any], state: Any, batch: Any, calls: int) -> tuple[float, Any]:
    """Seconds per call of ``calls`` chained calls, and the final state."""
    start = time.perf_counter()
    for _ in range(calls):
        state, metrics = fn(state, batch)
    jax.block_until_ready((state, metrics))
    return (time.perf_counter() - start) / calls, state


def bench_model(name: str, calls: int, repeats: int, warmup: int) -> list[dict[str, Any]]:
    model = build_model(name, MODELS[name])
    state0, batch0 = model.init(0)
    host_state = jax.tree.map(np.asarray, state0)
    step = meshplan.parallelize(model.train_step, cluster=meshplan.Cluster.local(),
                                method=meshplan.ShardParallel(), donate_argnums=(0,))
    state_mp, _ = step(host_state, batch0)              # plan + compile
    plan = step.plan
    executable = next(iter(step._cache.values()))[1]
    program = executable._last.jitted                   # meshplan's jitted program
    hand, in_shardings = hand_written_jit(model, plan, state0, batch0)

    hand_text = hand.lower(jax.device_put(host_state, in_shardings[0]),
                           jax.device_put(batch0, in_shardings[1])).compile().as_text()
    mp_text = step.lower(host_state, batch0).compile().as_text()
    rows = []
    for batch_kind in ("device", "host"):
        if batch_kind == "device":
            batch = jax.device_put(batch0, in_shardings[1])
        else:
            batch = jax.tree.map(np.asarray, batch0)
        states = {"hand": jax.device_put(host_state, in_shardings[0]),
                  "meshplan": state_mp,
                  "program": None}
        fns = {"hand": hand, "meshplan": step, "program": program}
        # the program shares placed state with the meshplan step: give it its own copy
        states["program"] = jax.tree.map(lambda x: x.copy(), state_mp)
        if batch_kind == "host":
            # jit's own path takes NumPy batches; the raw program needs them placed
            fns["program"] = lambda s, b: program(s, jax.device_put(b, in_shardings[1]))
        for key, fn in fns.items():
            for _ in range(warmup):
                states[key], _m = fn(states[key], batch)
            jax.block_until_ready(states[key])
        samples: dict[str, list[float]] = {k: [] for k in fns}
        # every order in turn: no callable always first or always after another
        orders = list(itertools.permutations(fns))
        for r in range(repeats):
            for key in orders[r % len(orders)]:
                seconds, states[key] = time_calls(fns[key], states[key], batch, calls)
                samples[key].append(seconds)
        state_mp = states["meshplan"]
        med = {k: statistics.median(v) for k, v in samples.items()}
        # paired: the ratio within each repeat, then the median (drift cancels)
        vs_hand = [m / h for m, h in zip(samples["meshplan"], samples["hand"])]
        vs_program = [m / p for m, p in zip(samples["meshplan"], samples["program"])]
        python_us, full_us = python_overhead(step, executable, states["meshplan"], batch)
        rows.append({
            "model": name, "batch": batch_kind, "mesh": str(plan.stages[0].logical_mesh),
            "leaves": len(jax.tree.leaves((state0, batch0))),
            "hand_us": med["hand"] * 1e6, "meshplan_us": med["meshplan"] * 1e6,
            "program_us": med["program"] * 1e6,
            "overhead": statistics.median(vs_hand) - 1.0,
            "overhead_iqr": _iqr(vs_hand),
            "overhead_best": min(samples["meshplan"]) / min(samples["hand"]) - 1.0,
            "dispatch": statistics.median(vs_program) - 1.0,
            "python_us": python_us, "full_path_us": full_us,
            "same_collectives": summary(hand_text) == summary(mp_text),
            "collectives_hand": summary(hand_text), "collectives_meshplan": summary(mp_text),
        })
    return rows


def _iqr(values: list[float]) -> tuple[float, float]:
    q = statistics.quantiles(values, n=4)
    return q[0] - 1.0, q[2] - 1.0


def python_overhead(step: Any, executable: Any, state: Any, batch: Any,
                    calls: int = 2000) -> tuple[float, float]:
    """Microseconds of Python that meshplan adds per call, without XLA.

    The executable's program is swapped for a stub that returns at once;
    the first figure is ``step(state, batch)`` (the path every call after
    the first takes) minus calling the stub directly, the second the full
    path taken when the arguments must be matched to a signature and placed
    (``Parallelized._entry`` + ``ShardExecutable._entry`` + placement).
    """
    entry = executable._last

    def stub(*args: Any) -> Any:
        return args

    def per_call(fn: Callable[[], Any]) -> float:
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            best = min(best, (time.perf_counter() - start) / calls)
        return best

    executable._last = dataclasses.replace(entry, jitted=stub)
    try:
        args = (state, batch)
        base = per_call(lambda: stub(*args))
        fast = per_call(lambda: step(*args)) - base

        def full() -> Any:
            _, ex = step._entry(args)
            e = ex._entry(args)
            return stub(*ex._place_all(e, args))
        slow = per_call(full) - base
    finally:
        executable._last = entry
    return fast * 1e6, slow * 1e6


def table(rows: list[dict[str, Any]]) -> str:
    head = ("| model | batch | mesh | leaves | jit by hand (µs/call) | meshplan (µs/call) "
            "| meshplan program (µs/call) | meshplan vs hand (IQR) | best vs best "
            "| meshplan vs its program | meshplan Python (µs/call) | full path Python (µs/call) "
            "| same collectives |")
    lines = [head, "|" + "---|" * 13]
    for r in rows:
        lo, hi = r["overhead_iqr"]
        lines.append(
            f"| {r['model']} | {r['batch']} | {r['mesh']} | {r['leaves']} | {r['hand_us']:.0f} "
            f"| {r['meshplan_us']:.0f} | {r['program_us']:.0f} "
            f"| {r['overhead']:+.1%} ({lo:+.1%} .. {hi:+.1%}) | {r['overhead_best']:+.1%} "
            f"| {r['dispatch']:+.1%} "
            f"| {r['python_us']:.1f} | {r['full_path_us']:.0f} "
            f"| {'yes' if r['same_collectives'] else 'no'} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=20, help="calls per measurement")
    parser.add_argument("--repeats", type=int, default=30,
                        help="measurements per callable (a multiple of 6 visits every order equally)")
    parser.add_argument("--warmup", type=int, default=5, help="calls before measuring")
    parser.add_argument("--models", default="mlp,gpt")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "overhead.md"),
                        help="markdown report ('' to skip)")
    a = parser.parse_args()
    rows = []
    for name in a.models.split(","):
        rows.extend(bench_model(name.strip(), a.calls, a.repeats, a.warmup))
    text = table(rows)
    print(text)
    for r in rows:
        if not r["same_collectives"] and r["batch"] == "device":
            print(f"{r['model']}: collectives differ: hand {r['collectives_hand']}, "
                  f"meshplan {r['collectives_meshplan']}")
    if a.out:
        load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
        env = (f"jax {jax.__version__}, {jax.device_count()} {jax.devices()[0].platform} devices "
               f"(fake: --xla_force_host_platform_device_count), {os.cpu_count()} CPU cores "
               f"(load average {load} at the end), Python {platform.python_version()}, "
               f"{platform.machine()}")
        report = [
            "# meshplan per-call overhead vs. a hand-written jax.jit",
            "",
            f"Generated by `python benchmarks/overhead.py --calls {a.calls} --repeats {a.repeats} "
            f"--warmup {a.warmup}` on {datetime.date.today().isoformat()}: {env}.",
            "",
            "Both paths run the plan `ShardParallel()` chose for the model (mesh and specs in the "
            "plan); the hand-written jit gets the plan's in/out `NamedSharding`s and donation. "
            "Times are medians over the repeats of the mean time per call of "
            f"{a.calls} chained calls (state donated and fed back, `block_until_ready` at the "
            "end); the three callables take turns within each repeat, in every order in turn. *meshplan vs hand* is the "
            "median of the per-repeat ratios (IQR in brackets): the overhead a user sees, "
            "program differences included; *best vs best* compares the fastest repeats (noise "
            "only adds time). *meshplan vs its program* compares with the same "
            "compiled program called directly. *meshplan Python* is the Python time meshplan "
            "adds to a call, measured with the program replaced by a stub (no XLA, no noise "
            "from the machine); *full path Python* is what a call costs when its arguments "
            "must be matched to a signature and placed (the first call of a signature, or "
            "arguments that do not fit the last program) -- what every call cost before the "
            "fast path.",
            "",
            text,
            "",
            "Reading: meshplan's own Python costs at most "
            f"{max(r['python_us'] for r in rows):.1f} µs per call, "
            f"{max(r['python_us'] / r['hand_us'] for r in rows):.2%} of the hand-written call at "
            "most: within the 5% target by construction. The wall-clock ratios scatter "
            "around zero by as much as the machine's noise (IQR); where the compiled programs "
            "differ (the planned constraints on intermediate tensors), the difference is the "
            "plan's, not the dispatch's. Before the fast path every call took the full path: "
            f"up to {max(r['full_path_us'] / r['hand_us'] for r in rows):.0%} of the "
            "hand-written call.",
            "",
        ]
        noted = set()
        for r in rows:
            if not r["same_collectives"] and r["model"] not in noted:
                noted.add(r["model"])
                report.append(f"- {r['model']}: the compiled programs differ in their collectives "
                              f"(hand {r['collectives_hand']}, meshplan "
                              f"{r['collectives_meshplan']}): the plan's constraints on "
                              "intermediate tensors change the program, not the dispatch.")
        pathlib.Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(a.out).write_text("\n".join(report) + "\n")
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
