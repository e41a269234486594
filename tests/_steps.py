"""Shared by tests that run a parallel step beside the plain one."""
from __future__ import annotations

from typing import Any, Callable

import jax
import numpy as np


def losses_match(step: Callable, state: Any, batch: Any, fn: Callable, steps: int = 2,
                 rtol: float = 1e-5) -> tuple[Any, Any]:
    """Run ``step`` and ``jax.jit(fn)`` ``steps`` times from ``state``, the
    losses equal within ``rtol`` at every step; their final states (got, want)."""
    ref = jax.jit(fn)
    got, want = state, state
    for _ in range(steps):
        got, metrics = step(got, batch)
        want, ref_metrics = ref(want, batch)
        np.testing.assert_allclose(float(metrics["loss"]), float(ref_metrics["loss"]), rtol=rtol)
    return got, want


def jit_losses(fn: Callable, state: Any, batch: Any, steps: int) -> tuple[list[float], Any]:
    """``jax.jit(fn)`` run ``steps`` times from ``state``: its losses and final state."""
    ref = jax.jit(fn)
    losses = []
    for _ in range(steps):
        state, metrics = ref(state, batch)
        losses.append(float(metrics["loss"]))
    return losses, jax.device_get(state)


def assert_states_close(want: Any, got: Any, rtol: float = 1e-5) -> None:
    """Every leaf of ``got`` within ``rtol`` of ``want``'s largest magnitude."""
    for a, b in zip(jax.tree_util.tree_leaves(want), jax.tree_util.tree_leaves(got)):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert float(np.max(np.abs(a - b))) / max(float(np.max(np.abs(a))), 1e-3) < rtol


def run_plan(fn: Callable, plan: Any, state: Any, batch: Any, steps: int
             ) -> tuple[Any, Any, list[float]]:
    """``fn`` parallelized by ``plan``, run ``steps`` times from ``state``:
    the decorated step, the final state and the losses."""
    import meshplan
    step = meshplan.parallelize(fn, plan=plan)
    losses = []
    for _ in range(steps):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return step, jax.device_get(state), losses


def tanh_mlp_loss(ws: Any, batch: Any) -> Any:
    """The mean squared error of the tanh layers ``ws`` (a list of weights)
    on ``batch["x"]`` against ``batch["y"]``."""
    h = batch["x"]
    for w in ws:
        h = jax.numpy.tanh(h @ w)
    return jax.numpy.mean((h - batch["y"]) ** 2)
