"""Pipeline schedule order, one definition for the planner's drawing
(:mod:`meshplan.tools.timeline`), its costing of interleaved plans
(:mod:`meshplan.dp_search.stages`) and the runtime's driver
(:mod:`meshplan.runtime.pipeline_driver`).  Pure data, no jax.

Interleaved 1F1B (Narayanan et al., "Efficient Large-Scale Language Model
Training on GPU Clusters Using Megatron-LM", SC'21, section 2.2.2): ``p``
device groups each hold ``v`` model chunks; virtual stage ``k`` (chunk ``k //
p`` of group ``k % p``) runs on group ``k % p``, so group ``s`` holds stages
``s, s + p, ...``.  Each group runs forwards in rounds of ``p`` micro-batches
per chunk, warms up with ``2 (p - s - 1) + (v - 1) p`` forwards, then
alternates one forward and one backward; the micro-batch count must be a
multiple of ``p``.  Its bubble is ``(p - 1) / v`` of a stage's time per
micro-batch, against ``p - 1`` for 1F1B.

ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR'24,
arXiv:2401.10241, section 2.1): a stage's backward is two programs, ``B``
(the gradient of the stage's inputs, what the stage before waits for) and
``W`` (the gradients of its parameters).  The order is 1F1B's with ``B`` for
the backward; a ``W`` runs once the stage holds ``p`` micro-batches (its
activations live until its ``W``), so stage ``s`` delays ``s`` of them, and
in the drain every ``B`` is followed by the oldest pending ``W``, the rest
at the end.  Every stage then keeps at most ``p`` micro-batches, 1F1B's
largest (its first stage's), and the B chain back through the stages no
longer waits for the ``W``s."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from .errors import MeshplanError

__all__ = ["Block", "schedule_order", "group_order", "max_in_flight", "peak_kept",
           "ScheduleError"]


class ScheduleError(MeshplanError, ValueError):
    """A schedule that cannot run this many micro-batches or stages."""


@dataclass(frozen=True)
class Block:
    """One program of a pipeline on the time axis: ``kind`` ``"F"`` or ``"B"``
    per micro-batch, or ``"A"`` (the update, micro-batch -1) as executed."""
    stage: int
    micro_batch: int
    kind: str       # "F", "B", "W" (zb-h1's weight gradients) or "A"
    start: float
    end: float


def schedule_order(schedule: str, stage: int, stages: int, m: int) -> list[tuple[str, int]]:
    """The (kind, micro-batch) order one stage runs: GPipe all forwards then
    all backwards; 1F1B ``stages - stage - 1`` warm-up forwards, then one
    forward / one backward; ZB-H1 1F1B's order with ``("W", i)`` (see the
    module doc)."""
    if schedule == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    split = schedule == "zb-h1"
    warm = min(stages - stage - 1, m)
    out = [("F", i) for i in range(warm)]
    f, b, w = warm, 0, 0
    while b < m:
        if f < m:
            out.append(("F", f))
            f += 1
        out.append(("B", b))
        b += 1
        # ZB-H1: a full stage frees the oldest micro-batch before its next
        # forward; in the drain a W fills the wait for the next B
        if split and (f - w >= stages or f == m):
            out.append(("W", w))
            w += 1
    return out + [("W", i) for i in range(w, m)] if split else out


def group_order(schedule: str, group: int, groups: int, m: int,
                chunks: int = 1) -> list[tuple[str, int, int]]:
    """The (kind, virtual stage, micro-batch) order the devices of ``group``
    (of ``groups``) run, with ``chunks`` model chunks per group (virtual
    stage ``k`` on group ``k % groups``).  ``chunks`` 1 is
    :func:`schedule_order`; more needs ``schedule`` ``"interleaved"``."""
    if chunks == 1:
        return [(k, group, i) for k, i in schedule_order(schedule, group, groups, m)]
    if schedule != "interleaved":
        raise ScheduleError(f"{chunks} model chunks per device group need the interleaved "
                            f"schedule, not {schedule!r}")
    p, v = groups, chunks
    if m % p:
        raise ScheduleError(f"interleaved 1F1B runs a multiple of the {p} device groups as "
                            f"micro-batches, not {m}")
    total = m * v

    def at(k: int, backward: bool) -> tuple[int, int]:
        chunk = (k // p) % v
        if backward:
            chunk = v - 1 - chunk
        return chunk * p + group, (k // (p * v)) * p + k % p

    warm = min(2 * (p - group - 1) + (v - 1) * p, total)
    out = [("F", *at(k, False)) for k in range(warm)]
    for k in range(total - warm):
        out.append(("F", *at(warm + k, False)))
        out.append(("B", *at(k, True)))
    out += [("B", *at(k, True)) for k in range(total - warm, total)]
    return out


def max_in_flight(schedule: str, groups: int, m: int, chunks: int = 1) -> tuple[int, ...]:
    """Per virtual stage, the most micro-batches whose forward ran and whose
    backward did not yet (what it keeps activations for), in the order
    :func:`group_order` gives.  (ZB-H1: until its ``W``, which reads them.)"""
    done = "W" if schedule == "zb-h1" else "B"
    most = [0] * (groups * chunks)
    for g in range(groups):
        now = [0] * (groups * chunks)
        for kind, k, _ in group_order(schedule, g, groups, m, chunks):
            if kind not in ("F", done):
                continue
            now[k] += 1 if kind == "F" else -1
            most[k] = max(most[k], now[k])
    return tuple(most)


def peak_kept(kinds: Iterable[str], forward: float, backward: float, after_b: float) -> float:
    """The most a stage keeps at once between its programs, walking its
    ``kinds`` in order ("F", "B", "W" per micro-batch, as its devices run
    them): each forward keeps ``forward`` for its backward; a ``B`` adds
    ``backward`` (what it makes for its ``W``) and, where a ``W`` follows,
    then frees all but ``after_b`` (what ``W`` reads: its forward's values
    and ``B``'s), which the ``W`` frees.  With no ``W`` the ``B`` frees all.
    (The runtime frees a micro-batch's values after their last reader.)"""
    kinds = list(kinds)
    has_w = "W" in kinds
    live = peak = 0.0
    for kind in kinds:
        if kind == "F":
            live += forward
        elif kind == "B":
            live += backward
            peak = max(peak, live)
            live -= forward + backward - (after_b if has_w else 0.0)
        elif kind == "W":
            live -= after_b
        peak = max(peak, live)
    return peak
