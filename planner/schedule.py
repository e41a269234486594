"""Pipeline schedule order, one definition for the planner's drawing
(:mod:`meshplan.tools.timeline`) and the runtime's driver
(:mod:`meshplan.runtime.pipeline_driver`).  Pure data, no jax."""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Block", "schedule_order"]


@dataclass(frozen=True)
class Block:
    """One program of a pipeline on the time axis: ``kind`` ``"F"`` or ``"B"``
    per micro-batch, or ``"A"`` (the update, micro-batch -1) as executed."""
    stage: int
    micro_batch: int
    kind: str
    start: float
    end: float


def schedule_order(schedule: str, stage: int, stages: int, m: int) -> list[tuple[str, int]]:
    """The (kind, micro-batch) order one stage runs: GPipe all forwards then
    all backwards; 1F1B ``stages - stage - 1`` warm-up forwards, then one
    forward / one backward."""
    if schedule == "gpipe" or stages == 1:
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    warm = min(stages - stage - 1, m)
    out = [("F", i) for i in range(warm)]
    f, b = warm, 0
    while b < m:
        if f < m:
            out.append(("F", f))
            f += 1
        out.append(("B", b))
        b += 1
    return out
