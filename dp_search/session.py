"""A planning session: what planning keeps across passes and calls, passed
explicitly (no module-level state in the passes).

The API and the CLI make one per call (``Session.from_env``: configuration
is read there, once); a benchmark that plans one model many ways passes one
session to every call, so that each distinct layer ILP is solved once.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

from ..errors import MeshplanError
from ..ilp import IlpCaches, SolverOptions
from ..plan import Plan
from ..progress import Progress

LAYER_CACHE_MAX = 50_000      # layer costs kept before the cache starts afresh
# steps a session keeps traced, and layer analyses of their micro-batch
# Graphs (one per count: an explain grid asks each point's counts again),
# at most this many nodes among the latter (about 1.5 KB of memory a node)
RECENT_STEPS = 2
RECENT_ANALYSES = 16
ANALYSED_NODES = 200_000


class Recent(dict):
    """A dict keeping its ``limit`` most recently added entries, and with
    ``weight``, as many of them as weigh at most ``budget`` (the newest
    always)."""

    def __init__(self, limit: int, weight=None, budget: float = float("inf")) -> None:
        super().__init__()
        self.limit, self.weight, self.budget = limit, weight, budget

    def __setitem__(self, key, value) -> None:
        self.pop(key, None)
        super().__setitem__(key, value)
        w = self.weight
        while len(self) > 1 and (len(self) > self.limit
                                 or (w is not None and sum(map(w, self.values())) > self.budget)):
            del self[next(iter(self))]


def usable_cpus() -> int:
    """The CPUs this process may run on: the most processes for layer ILPs.
    (No fixed cap: each worker solves one single-threaded ILP at a time, so
    every core shortens a search; the cap of 8 there once was arbitrary.)"""
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:   # not Linux
        n = os.cpu_count() or 1
    return max(1, n)


@dataclass
class Session:
    progress: Progress = field(default_factory=Progress)
    workers: int = field(default_factory=usable_cpus)    # processes for layer ILPs
    solver: SolverOptions = SolverOptions()               # how the ILP back ends run
    # layer ILP results by problem (see dp_search.solver.LayerSolver)
    layer_cache: dict = field(default_factory=dict)
    # resharding costs and layouts, shared by the ILPs solved in this process
    # (a worker process keeps its own per job)
    ilp_caches: IlpCaches = field(default_factory=IlpCaches)
    # steps traced for planning, by function and argument signature (as
    # jax.jit caches its traces: a function changed in place is not seen),
    # and the layer analyses of their micro-batch Graphs (problem.LayerAnalysis)
    traces: Recent = field(default_factory=lambda: Recent(RECENT_STEPS))
    analyses: Recent = field(default_factory=lambda: Recent(
        RECENT_ANALYSES, lambda a: len(a.layering.layer_of_node), ANALYSED_NODES))
    # what a step runs replicated for want of sharding rules ("" for nothing
    # worth a word), by its Graph's fingerprint (planning.replicated_work)
    replicated: Recent = field(default_factory=lambda: Recent(RECENT_STEPS))

    @classmethod
    def from_env(cls, progress: Progress | None = None) -> "Session":
        """A session configured from the environment: ``MESHPLAN_WORKERS``
        (processes for layer ILPs; default and most: the usable CPUs) and
        the solver's ``MESHPLAN_*`` variables (:meth:`SolverOptions.from_env`)."""
        env = os.environ.get("MESHPLAN_WORKERS")
        workers = usable_cpus()
        if env:
            try:
                asked = int(env)
            except ValueError:
                asked = 0
            if asked < 1:
                raise MeshplanError(f"MESHPLAN_WORKERS={env!r}: use a positive integer (1: the "
                                    "layer ILPs in this process)")
            # (more processes than cores would only take turns on them)
            workers = min(asked, workers)
        try:
            solver = SolverOptions.from_env()
        except ValueError as e:
            raise MeshplanError(str(e)) from None
        return cls(progress=progress or Progress(), workers=workers, solver=solver)

    def __repr__(self) -> str:
        return (f"Session(workers={self.workers}, {len(self.layer_cache)} layer costs cached, "
                f"{self.solver}, {self.progress!r})")


@dataclass(frozen=True)
class StageCountBest:
    """[explain] The fastest plan the search found with exactly ``num_stages``
    stages over the micro-batch counts it searched (``plan`` None: none fits,
    ``why`` says why)."""
    num_stages: int
    plan: Plan | None = None
    why: str = ""


@dataclass(frozen=True)
class SearchStats:
    """Figures of one inter-operator search (benchmarks report them)."""
    micro_batch_counts: int = 0    # micro-batch counts searched
    distinct_layer_ilps: int = 0   # distinct layer problems the search needed
    solved: int = 0                # layer ILPs solved by this search
    cache_hits: int = 0            # layer costs found in the session's cache
    trace_s: float = 0.0           # wall time getting the step's Graph per micro-batch count
    rewritten: int = 0             # ... counts whose Graph was rewritten from the first trace
    retraced: int = 0              # ... counts whose Graph was traced again
    rewrite_s: float = 0.0         # the part of trace_s spent rewriting
    ilp_s: float = 0.0             # wall time in layer ILPs (in-process or waiting on workers)
    ilp_work_s: float = 0.0        # seconds the layer ILPs took, wherever they ran
    dp_s: float = 0.0              # wall time in the stage DP, its ILPs excluded
    workers: int = 1
    # [explain] the best plan per number of stages (asked for with by_stage_count)
    stage_counts: tuple[StageCountBest, ...] = ()
    searches: int = 1              # inter-operator searches these figures sum
    bounded: int = 0               # counts whose relaxed search beat no plan: not searched in full
    relaxed_fit: int = 0           # counts whose relaxed plan fit as it was: not searched in full
    # counts that fit nothing for memory although, memory aside, they plan
    # faster than the plan found (memory binds the search: meshplan.planning)
    squeezed: tuple[int, ...] = ()

    def plus(self, other: SearchStats) -> SearchStats:
        """These figures and ``other``'s (a second search of the same step,
        meshplan.planning) summed; the rest stays this search's."""
        summed = ("micro_batch_counts", "distinct_layer_ilps", "solved", "cache_hits",
                  "trace_s", "rewritten", "retraced", "rewrite_s", "ilp_s", "ilp_work_s",
                  "dp_s", "searches", "bounded", "relaxed_fit")
        return dataclasses.replace(self, **{f: getattr(self, f) + getattr(other, f)
                                            for f in summed},
                                   squeezed=tuple(sorted({*self.squeezed, *other.squeezed})))
