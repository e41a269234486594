"""The stage-submesh dynamic program of Alpa (Zheng et al., OSDI'22, sec. 5.2).

Layers ``0..L-1`` are cut into contiguous stages; stage ``k`` runs on a
submesh; the submeshes together use every device.  With ``B`` micro-batches
the pipeline latency is ``sum_k t_k + (B - 1) * max_k t_k``.  For a fixed
``t_max`` the DP minimises ``sum_k t_k`` over stages with ``t_k <= t_max``;
enumerating ``t_max`` over the distinct stage latencies finds the optimum.

With ``balance`` (per layer its FLOPs; given when the user fixed the
number of stages) totals within ``BALANCE_TOLERANCE`` of each other tie, and
the tie goes to the smaller largest stage FLOPs: with one micro-batch the
latency is the plain sum of the stages' whatever the cut, small differences
(a send, a program launch) decided alone, and a fixed count of stages left
one stage almost without work.  (2% is well inside the cost model's error.)
And a stage with less than ``IDLE_SHARE`` of an even share of the FLOPs is
not taken where the layers allow every stage more: a user who fixed the
number of stages asked for that many stages doing work, and on a small
model the resharding a stage's layers pay between each other can make a
stage of the embedding alone the cheaper cut (dp_search.joints).

The core is pure: ``cost(first, last, submesh_index, stages_left)`` gives a
stage's latency per micro-batch, or ``None`` when it does not fit (memory may
depend on ``stages_left``: under 1F1B a stage keeps that many micro-batches of
activations in flight).  :func:`brute_force` enumerates every assignment for
tests.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Sequence

StageCost = Callable[[int, int, int, int], "float | None"]
BALANCE_TOLERANCE = 0.02
IDLE_SHARE = 0.25


@dataclass(frozen=True)
class Submesh:
    hosts: int
    devices_per_host: int

    @property
    def size(self) -> int:
        return self.hosts * self.devices_per_host


@dataclass(frozen=True)
class StageChoice:
    first: int
    last: int
    submesh: int        # index into the submesh list
    latency: float


@dataclass(frozen=True)
class DPResult:
    total_s: float
    stages: tuple[StageChoice, ...]
    t_max: float


def submesh_shapes(num_hosts: int, devices_per_host: int) -> list[Submesh]:
    """(1, 1), (1, 2), (1, 4) ... (1, devices_per_host), then 2 .. num_hosts whole hosts."""
    out = []
    d = 1
    while d <= devices_per_host:
        if devices_per_host % d == 0:
            out.append(Submesh(1, d))
        d *= 2
    if out[-1].devices_per_host != devices_per_host:
        out.append(Submesh(1, devices_per_host))
    out += [Submesh(h, devices_per_host) for h in range(2, num_hosts + 1)]
    return out


def pipeline_latency(latencies: Sequence[float], num_micro_batches: int) -> float:
    return sum(latencies) + (num_micro_batches - 1) * max(latencies)


def stage_dp(num_layers: int, submeshes: Sequence[Submesh], total_devices: int,
             num_micro_batches: int, cost: StageCost, *,
             max_stages: int | None = None, min_stages: int = 1,
             balance: Sequence[float] | None = None) -> DPResult | None:
    """The optimal stages (between ``min_stages`` and ``max_stages`` of them),
    or ``None`` when no assignment fits."""
    if balance is not None:
        prefix = list(itertools.accumulate(balance, initial=0.0))
        floor = IDLE_SHARE * prefix[-1] / (max_stages or num_layers)

        def working(i: int, j: int, m: int, s: int) -> float | None:
            return cost(i, j, m, s) if prefix[j + 1] - prefix[i] >= floor else None
        res = _stage_dp(num_layers, submeshes, total_devices, num_micro_batches, working,
                        max_stages, min_stages, balance)
        if res is not None:
            return res
    return _stage_dp(num_layers, submeshes, total_devices, num_micro_batches, cost,
                     max_stages, min_stages, balance)


def _stage_dp(num_layers: int, submeshes: Sequence[Submesh], total_devices: int,
              num_micro_batches: int, cost: StageCost, max_stages: int | None,
              min_stages: int, balance: Sequence[float] | None) -> DPResult | None:
    L, B = num_layers, num_micro_batches
    max_stages = min(max_stages or L, L)
    if min_stages > max_stages:
        return None
    sizes = [s.size for s in submeshes]

    @lru_cache(maxsize=None)
    def c(i: int, j: int, m: int, s: int) -> float | None:
        return cost(i, j, m, s)

    # only stages some assignment has: ``s - 1`` later stages need a layer
    # each, and the first stage starts a plan of min..max stages (the DP
    # reaches no other, and one group per stage then costs L, not L^3, stages)
    # (nor a submesh the other stages cannot complete to every device: the
    # whole model on half of them, all of them for a stage after the first)
    def fits(i: int, m: int, s: int) -> bool:
        return _reachable(i, s, min_stages, max_stages) \
            and _devices_reachable(i, s, sizes[m], sizes, total_devices, min_stages, max_stages)
    latencies = sorted({v for i in range(L) for j in range(i, L) for m in range(len(sizes))
                        for s in range(1, min(max_stages, L - j) + 1)
                        if fits(i, m, s) and (v := c(i, j, m, s)) is not None})
    if not latencies:
        return None
    best: DPResult | None = None
    rows: dict = {}     # (first layer, stages left) -> its stages that fit, for every t_max
    for t_max in (latencies if B > 1 else latencies[-1:]):
        if best is not None and (B - 1) * t_max >= best.total_s:
            break
        res = _dp_for(t_max, L, sizes, total_devices, max_stages, c, min_stages, balance, rows,
                      fits)
        if res is None:
            continue
        total, stages = res
        total += (B - 1) * max(st.latency for st in stages)
        if best is None or total < best.total_s - 1e-15:
            best = DPResult(total, stages, t_max)
    return best


def _reachable(first: int, s: int, min_stages: int, max_stages: int) -> bool:
    """Can a stage starting at layer ``first``, with ``s`` stages from it to
    the last, be part of a plan of ``min_stages`` to ``max_stages`` stages?
    (``e`` stages before it, one layer each at least.)"""
    if first == 0:
        return min_stages <= s <= max_stages
    return max(1, min_stages - s) <= min(first, max_stages - s)


def _devices_reachable(first: int, s: int, size: int, sizes: Sequence[int], D: int,
                       min_stages: int, max_stages: int) -> bool:
    """Can a stage of ``size`` devices starting at layer ``first``, with
    ``s`` stages from it to the last, be part of a plan on all ``D`` devices?
    (The stages before it, none for the first layer, and the ``s - 1``
    after it take one submesh of ``sizes`` each.)"""
    lo, hi = min(sizes), max(sizes)
    before = (0, 0) if first == 0 else (max(1, min_stages - s), min(first, max_stages - s))
    rest = D - size
    return (before[0] + s - 1) * lo <= rest <= (before[1] + s - 1) * hi


def _dp_for(t_max: float, L: int, sizes: list[int], D: int, max_stages: int,
            c: Callable, min_stages: int = 1, balance: Sequence[float] | None = None,
            rows: dict | None = None, fits: Callable[[int, int, int], bool] | None = None
            ) -> tuple[float, tuple[StageChoice, ...]] | None:
    INF = math.inf
    min_size = min(sizes)
    rows = {} if rows is None else rows

    def stages_from(k: int, s: int) -> list[tuple[int, int, int, float]]:
        """(last layer, submesh, its size, latency) of each stage from layer
        ``k`` with ``s`` stages left that fits, in the DP's order.  (Every
        one was priced before the first t_max: no new cost is asked.)"""
        r = rows.get((k, s))
        if r is None:
            r = rows[k, s] = [(j, m, size, t) for j in range(k, L - s + 1)
                              for m, size in enumerate(sizes)
                              if (fits is None or fits(k, m, s)) and (t := c(k, j, m, s)) is not None]
        return r
    if balance is None:
        def better(a: tuple, b: tuple) -> bool:
            return a[0] < b[0]
    else:
        prefix = list(itertools.accumulate(balance, initial=0.0))

        def heaviest(stages: tuple[StageChoice, ...]) -> float:
            return max(prefix[st.last + 1] - prefix[st.first] for st in stages)

        def better(a: tuple, b: tuple) -> bool:
            """A smaller total, or (within the tolerance) lighter heaviest stage."""
            if a[0] == INF or b[0] == INF:
                return a[0] < b[0]
            if abs(a[0] - b[0]) > BALANCE_TOLERANCE * max(a[0], b[0]):
                return a[0] < b[0]
            ha, hb = heaviest(a[1]), heaviest(b[1])
            return ha < hb or (ha == hb and a[0] < b[0])

    @lru_cache(maxsize=None)
    def F(s: int, k: int, d: int) -> tuple[float, tuple[StageChoice, ...]]:
        if k == L:
            return (0.0, ()) if s == 0 and d == 0 else (INF, ())
        if s == 0 or d < s * min_size or L - k < s:
            return INF, ()
        best: tuple[float, tuple[StageChoice, ...]] = (INF, ())
        for j, m, size, t in stages_from(k, s):
            if size > d or t > t_max:
                continue
            rest, stages = F(s - 1, j + 1, d - size)
            if balance is None:     # (better() on totals alone: no tuple made for a loser)
                if t + rest < best[0]:
                    best = (t + rest, (StageChoice(k, j, m, t),) + stages)
                continue
            cand = (t + rest, (StageChoice(k, j, m, t),) + stages)
            if better(cand, best):
                best = cand
        return best

    best: tuple[float, tuple[StageChoice, ...]] = (INF, ())
    for s in range(min_stages, max_stages + 1):
        r = F(s, 0, D)
        if better(r, best):
            best = r
    # (F reaches itself through its closure, a reference cycle: unbound, its
    # memo and the stage costs it reaches are freed now, not at the next
    # full collection, meshplan.collector)
    F = None  # type: ignore[assignment]
    if best[0] == INF:
        return None
    return best


def brute_force(num_layers: int, submeshes: Sequence[Submesh], total_devices: int,
                num_micro_batches: int, cost: StageCost, *,
                stages: int | None = None) -> float | None:
    """Every cut of the layers (into ``stages`` stages, if given), every
    submesh per stage (tests only)."""
    L = num_layers
    best = None
    for n_cuts in (range(L) if stages is None else [stages - 1]):
        for cuts in itertools.combinations(range(1, L), n_cuts):
            bounds = list(zip((0,) + cuts, cuts + (L,)))
            S = len(bounds)
            for subs in itertools.product(range(len(submeshes)), repeat=S):
                if sum(submeshes[m].size for m in subs) != total_devices:
                    continue
                lat = []
                for k, ((a, b), m) in enumerate(zip(bounds, subs)):
                    t = cost(a, b - 1, m, S - k)
                    if t is None:
                        break
                    lat.append(t)
                else:
                    v = pipeline_latency(lat, num_micro_batches)
                    if best is None or v < best:
                        best = v
    return best
