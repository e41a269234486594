"""Predicted step time of time-step recurrences with and without the loop
rule (issue 17, item 3), planned for an 8-GPU host (no GPU needed):

    python benchmarks/time_step_loops.py

Each step is an RG-LRU-like recurrence (gates outside the scan, an
element-wise scan over time) or a plain RNN (h @ W inside the scan), batch
4096, 64 time steps, hidden 512, float32, one SGD update.  "replicated" is
the planner with no rule for ``scan`` (as before the rule: the loop runs
whole on every device); "loop rule" is the planner as it is.
"""
from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp

CLUSTER = "examples/clusters/dgx-a100-x1.json"
B, T, H = 4096, 64, 512


def _rglru(p, x):
    a = jax.nn.sigmoid(x @ p["wa"])
    b = x @ p["wb"]

    def step(h, ab):
        h = ab[0] * h + (1 - ab[0]) * ab[1]
        return h, h
    _, hs = jax.lax.scan(step, jnp.zeros((x.shape[0], H)), (a.transpose(1, 0, 2),
                                                           b.transpose(1, 0, 2)))
    return jnp.mean(hs ** 2)


def _rnn(p, x):
    def step(h, x_t):
        h = jnp.tanh(h @ p["wa"] + x_t @ p["wb"])
        return h, h
    _, hs = jax.lax.scan(step, jnp.zeros((x.shape[0], H)), x.transpose(1, 0, 2))
    return jnp.mean(hs ** 2)


def _step(loss):
    def step(p, x):
        v, g = jax.value_and_grad(loss)(p, x)
        return jax.tree.map(lambda a, b: a - 0.1 * b, p, g), v
    return step


def _plan(step, method, loop_rule: bool):
    import meshplan
    import meshplan.ilp.rules as rules
    saved = rules.RULES
    if not loop_rule:
        rules.RULES = {k: v for k, v in saved.items() if k not in ("scan", "while")}
    try:
        S = jax.ShapeDtypeStruct
        p = {"wa": S((H, H), jnp.float32), "wb": S((H, H), jnp.float32)}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return meshplan.plan(step, p, S((B, T, H), jnp.float32),
                                 cluster=meshplan.load_cluster(CLUSTER), method=method)
    finally:
        rules.RULES = saved


def main() -> None:
    import meshplan
    print(f"{'step':8} {'method':14} {'planner':12} {'iteration ms':>12} {'comm MiB/dev':>12}")
    for name, loss in (("rglru", _rglru), ("rnn", _rnn)):
        for label, method in (("ShardParallel", meshplan.ShardParallel()),
                              ("DataParallel", meshplan.DataParallel())):
            for rule in (False, True):
                pr = _plan(_step(loss), method, rule)
                print(f"{name:8} {label:14} {'loop rule' if rule else 'replicated':12} "
                      f"{pr.predicted.iteration_s * 1e3:12.3f} "
                      f"{pr.predicted.comm_bytes_per_device / 2**20:12.1f}")


if __name__ == "__main__":
    main()
