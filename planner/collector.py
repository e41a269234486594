"""Python's cyclic garbage collector, run less often while meshplan traces
and plans.

Tracing a step and searching its plans allocate millions of small objects
(JAX's tracers and jaxpr equations, Graph nodes, layer and stage costs).
With Python's default thresholds (a young collection every 700 allocations,
a full one every 100 young ones, and again each time the heap grew by a
quarter) the collector scans the whole heap, JAX's caches and the user's
arrays included, dozens of times during one plan: a third to a half of the
time of a plan bound by tracing (gpt-350m, a manual GPT-3 175B configuration,
``benchmarks/results/planning_time.md``); one bound by its layer ILPs gains
little.

:func:`relaxed_gc` raises the thresholds for the duration of a trace or a
plan and puts the caller's back afterwards.  Nothing stops being collected:
values without reference cycles are freed by reference counting as always,
and those in cycles (a caught exception's traceback holding the frames of
a search, with their graphs) at the rarer collections, or at the first one
after planning.  Peak memory did not grow in the planning benchmark
(gpt-1.3b: 539 MB, against 546 MB with the default thresholds).
"""
from __future__ import annotations

import functools
import gc
from contextlib import contextmanager
from typing import Any, Callable, Iterator, TypeVar

__all__ = ["RELAXED_THRESHOLDS", "relaxed_gc", "with_relaxed_gc"]

# (allocations before a young collection, young collections before a middle
# one, middle ones before a full one); Python's defaults are (700, 10, 10)
RELAXED_THRESHOLDS = (50_000, 20, 100)

F = TypeVar("F", bound=Callable[..., Any])


@contextmanager
def relaxed_gc() -> Iterator[None]:
    """Collect less often inside the block (never more often than the
    caller's thresholds already say); the caller's thresholds are restored
    on the way out, exceptions included.  Nests."""
    old = gc.get_threshold()
    gc.set_threshold(*(max(o, r) for o, r in zip(old, RELAXED_THRESHOLDS)))
    try:
        yield
    finally:
        gc.set_threshold(*old)


def with_relaxed_gc(fn: F) -> F:
    """``fn`` run inside :func:`relaxed_gc`."""
    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with relaxed_gc():
            return fn(*args, **kwargs)
    return wrapped  # type: ignore[return-value]
