"""An optimizer update inside a ``lax.cond`` against the same update outside
one, planned and run on the 8 fake CPU devices.

``optax.apply_if_finite`` runs its inner update in a cond; with
``clip_by_global_norm`` inside, a branch sums every gradient to a scalar.
Such a cond is laid out with its operands, each scalar sum all-reduced where
its array is split (:mod:`meshplan.trace.cond`); before, no rule applied and
the cond, with the whole update, ran replicated on every device.  The table
gives, per step: the predicted iteration time, the measured one (median and
fastest of ``--repeats`` timings of ``--calls`` calls each, the two steps
interleaved, each call ended by ``block_until_ready``), ``jax.jit`` of the
step on one device, and the layout of the large weight's first moment.

    python benchmarks/cond_update.py [--size 2048] [--calls 5] [--repeats 7]

Run it on an earlier commit to see the replicated cond (the public API
alone is used).
"""
from __future__ import annotations

import argparse
import importlib
import statistics
import time
import warnings

importlib.import_module("_fake_devices")    # before jax: 8 fake CPU devices
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import meshplan  # noqa: E402


def _step(tx):
    def step(state, batch):
        p, o = state
        loss, g = jax.value_and_grad(
            lambda p: jnp.mean((jnp.tanh(batch["x"] @ p["w1"]) @ p["w2"] - batch["y"]) ** 2))(p)
        u, o = tx.update(g, o, p)
        return (optax.apply_updates(p, u), o), loss
    return step


def _time(fn, state, batch, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        state = fn(state, batch)[0]
    jax.block_until_ready(state)
    return (time.perf_counter() - t0) / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=int, default=2048)
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=7)
    a = ap.parse_args()
    n = a.size
    p = {"w1": jnp.linspace(-1, 1, 16 * n).reshape(16, n) * 0.1,
         "w2": jnp.linspace(1, -1, n * n).reshape(n, n) * 0.01}
    batch = {"x": jnp.linspace(-1, 1, 32 * 16).reshape(32, 16), "y": jnp.ones((32, n))}
    clipped = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2))
    txs = {"chain(clip, adam)": clipped, "apply_if_finite(chain(clip, adam))":
           optax.apply_if_finite(clipped, 3)}
    rows = []
    for name, tx in txs.items():
        state = (p, tx.init(p))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step = meshplan.parallelize(_step(tx), method=meshplan.ShardParallel(mesh_shape=(8,)),
                                        donate_argnums=())
            state = step(state, batch)[0]
        replicated = [str(w.message) for w in caught if "run replicated" in str(w.message)]
        mu = next(v for k, v in step.plan.stages[0].params if k.endswith(".mu['w2']"))
        jitted = jax.jit(_step(tx))
        jax.block_until_ready(jitted((p, tx.init(p)), batch))
        rows.append([name, step, state, jitted, (p, tx.init(p)), mu, replicated, [], []])
    for _ in range(a.repeats):
        for row in rows:
            row[7].append(_time(row[1], row[2], batch, a.calls))
            row[8].append(_time(row[3], row[4], batch, a.calls))
    print(f"w1 16x{n}, w2 {n}x{n} (float32), batch 32, ShardParallel(mesh_shape=(8,)) on "
          f"8 fake CPU devices; {a.repeats} x {a.calls} calls\n")
    print("| step | predicted ms | measured median ms | fastest ms | jax.jit median ms | "
          "mu['w2'] layout | replicated warning |")
    print("|---|---|---|---|---|---|---|")
    for name, step, _, _, _, mu, replicated, ts, js in rows:
        print(f"| {name} | {step.plan.predicted.iteration_s * 1e3:.2f} | "
              f"{statistics.median(ts) * 1e3:.1f} | {min(ts) * 1e3:.1f} | "
              f"{statistics.median(js) * 1e3:.1f} | {mu} | {'yes' if replicated else 'no'} |")


if __name__ == "__main__":
    main()
