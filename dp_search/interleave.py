"""Interleaved 1F1B pipelines, priced from their virtual stages: a step
right after the stage DP.

The DP chooses ``p`` stages (their submeshes); these become the device
groups.  The layer groups are cut again, into ``p * CHUNKS`` consecutive
virtual stages, virtual stage ``k`` on the submesh of group ``k % p``
(Megatron-LM's layout: group ``s`` holds chunks ``s`` and ``s + p``).  Each
virtual stage is priced by the layer ILPs on its submesh
(:meth:`StageCosts.best`) with the micro-batches the interleaved order keeps
in flight on it (:func:`meshplan.schedule.max_in_flight`), and the cut
minimises the slowest virtual stage.  A group holds both its chunks, so
their memory together must fit the budget.  The iteration time is
:func:`meshplan.cost_model.pipeline.interleaved_iteration_s` of the virtual
stages' latencies (each with its own sends: the traffic doubles because
there are twice the cuts)."""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Sequence

from ..cost_model.pipeline import interleaved_iteration_s
from ..schedule import max_in_flight
from .options import CHUNKS
from .problem import LayerProblems
from .stage_dp import DPResult, StageChoice

__all__ = ("CHUNKS", "interleave", "why_not_interleaved", "group_memory")

INF = float("inf")
GROUP_UNFIT = "no cut of the layers into"


def why_not_interleaved(groups: int, layer_groups: int, num_micro_batches: int) -> str | None:
    """Why ``groups`` device groups cannot run interleaved over
    ``layer_groups`` groups of layers with this many micro-batches (None: they can)."""
    if groups < 2:
        return "interleaved 1F1B needs two or more pipeline stages"
    if num_micro_batches % groups:
        return (f"interleaved 1F1B runs a multiple of the {groups} stages as micro-batches, "
                f"not {num_micro_batches}")
    if layer_groups < groups * CHUNKS:
        return (f"interleaved 1F1B cuts {groups} stages into {groups * CHUNKS} chunks but the "
                f"model has {layer_groups} layer group(s)")
    return None


def interleave(res: DPResult, lay: LayerProblems, costs: Any
               ) -> tuple[DPResult, dict[tuple[int, int, int, int], Any]] | None:
    """The virtual stages on the device groups of ``res`` (its stages in
    layer-group indices): a :class:`DPResult` of the ``p * CHUNKS`` virtual
    stages in layer indices, its total the interleaved iteration time, and
    their options keyed as the DP's ``(first, last, submesh, stages after)``;
    None where no cut fits (``costs.not_interleaved`` says why).  The groups
    are the DP's submeshes or, as in Megatron-LM, ``p`` equal submeshes on
    the same devices (the DP sized its stages for one chunk each): the
    faster that fits."""
    p, G, B = len(res.stages), len(lay.groups), lay.B
    if why_not_interleaved(p, G, B) is not None:
        return None
    own = tuple(st.submesh for st in res.stages)
    devices = sum(lay.submeshes[m].size for m in own)
    tries = [own] + [(m,) * p for m, sub in enumerate(lay.submeshes)
                     if sub.size * p == devices and (m,) * p != own]
    found, why = None, None
    halved = None
    for subs in tries:
        got = _cut(subs, lay, costs)
        if isinstance(got, str) and got.startswith(GROUP_UNFIT):
            # each chunk chose alone, within the whole budget: with half of
            # it each (recomputing where it must) the group fits for sure
            if halved is None:
                halved = type(costs)(replace(lay, budget=lay.budget / CHUNKS), costs.opts,
                                     costs.solver)
            got = _cut(subs, lay, halved)
        if isinstance(got, str):
            why = why or got
        elif found is None or got[0].total_s < found[0].total_s:
            found = got
    if found is None:
        costs.not_interleaved = why
    return found


def _cut(subs: Sequence[int], lay: LayerProblems, costs: Any
         ) -> tuple[DPResult, dict[tuple[int, int, int, int], Any]] | str:
    """The layer groups cut into virtual stages on device groups of
    submeshes ``subs``, minimising the slowest virtual stage; or why none fits."""
    p, G, B = len(subs), len(lay.groups), lay.B
    n = p * CHUNKS
    keep = max_in_flight("interleaved", p, B, CHUNKS)

    def option(k: int, gi: int, gj: int) -> Any:
        return costs.best(gi, gj, subs[k % p], n - k, "interleaved", keep=keep[k])

    # best[k][j]: the least slowest-chunk latency of chunks 0..k over layer
    # groups 0..j (chunk k ending with group j), and where chunk k begins
    best = [[INF] * G for _ in range(n)]
    start = [[-1] * G for _ in range(n)]
    for k in range(n):
        for j in range(k, G - (n - k - 1)):
            for i in range(k, j + 1):
                before = 0.0 if k == 0 else best[k - 1][i - 1]
                if (k == 0 and i != 0) or before == INF:
                    continue
                o = option(k, i, j)
                if o is None:
                    continue
                t = max(before, o.latency_s)
                if t < best[k][j]:
                    best[k][j], start[k][j] = t, i
    if best[n - 1][G - 1] == INF:
        return f"no chunk of a cut into {n} fits the memory budget"
    cuts: list[tuple[int, int]] = []
    j = G - 1
    for k in range(n - 1, -1, -1):
        i = start[k][j]
        cuts.append((i, j))
        j = i - 1
    cuts.reverse()
    chosen = [option(k, i, j) for k, (i, j) in enumerate(cuts)]
    if not _fits(chosen, p, lay.budget):
        return (f"{GROUP_UNFIT} {n} chunks fits: a device group holds {CHUNKS} of them, with "
                "the micro-batches the interleaved order keeps in flight")
    stages = tuple(StageChoice(lay.groups[i][0], lay.groups[j][1], subs[k % p], o.latency_s)
                   for k, ((i, j), o) in enumerate(zip(cuts, chosen)))
    lats = [o.latency_s for o in chosen]
    total = interleaved_iteration_s(lats, [k % p for k in range(n)], B)
    options = {(st.first, st.last, st.submesh, n - k): o
               for k, (st, o) in enumerate(zip(stages, chosen))}
    return DPResult(total, stages, max(lats)), options


def _working(o: Any) -> float:
    """A chunk's working set: its memory less its state and activations."""
    m = o.memory
    if m is None:
        return 0.0
    return max(o.memory_bytes - m.params - m.optimizer - m.activations, 0.0)


def group_memory(chosen: Sequence[Any], p: int) -> list[float]:
    """Per device group, the memory of its virtual stages together: their
    state and kept activations, and the larger of their working sets (one
    program runs at a time on a group)."""
    out = []
    for g in range(p):
        mine = chosen[g::p]
        out.append(sum(o.memory_bytes - _working(o) for o in mine) + max(map(_working, mine)))
    return out


def _fits(chosen: Sequence[Any], p: int, budget: float) -> bool:
    """A device group holds all its chunks within the budget."""
    return all(m <= budget for m in group_memory(chosen, p))
