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
