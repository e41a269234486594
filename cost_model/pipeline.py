"""Pipeline cost formulas: what a stage pays to send its activations on, how
many micro-batches a schedule keeps in flight, and the iteration time of the
interleaved schedule from its virtual stages.  Pure arithmetic on figures the stage DP already has."""
from __future__ import annotations

from typing import Sequence


def stage_send_s(cut_bytes: float, replication: float, devices: int, p2p_bw: float) -> float:
    """Seconds a stage spends per micro-batch sending ``cut_bytes`` of
    activations on and receiving their gradients: every one of its
    ``devices`` sends what it holds of them over its share of the links
    (``p2p_bw`` bytes/s; a value replicated over r devices goes r times,
    ``replication``), all devices in parallel."""
    return 2 * cut_bytes * replication / (devices * p2p_bw)


def accumulation_s(grad_bytes: float, num_micro_batches: int, memory_bw: float,
                   passes: int = 3) -> float:
    """Seconds per micro-batch a stage spends adding its parameter gradients
    (``grad_bytes`` on one device) into their running sums, for every
    micro-batch after the first.  ``passes`` over the gradient bytes: 3 where
    the add is a kernel of its own (read the sum and the gradient, write the
    sum: XLA's CPU back end), 1 where it fuses into the weight-gradient matmul
    as its accumulator (a GEMM with beta = 1 reads the old sum; on GPUs)."""
    if num_micro_batches <= 1:
        return 0.0
    return passes * grad_bytes * (num_micro_batches - 1) / num_micro_batches / memory_bw


def in_flight(schedule: str, num_micro_batches: int, stages_after: int) -> int:
    """Micro-batches whose activations a stage keeps at once: GPipe all of
    them; 1F1B (and interleaved) at most the stages from this one to the last.
    (ZB-H1 keeps the pipeline's stage count on every stage: the stage DP
    does not know it, :mod:`meshplan.dp_search.zero_bubble` prices it after.)"""
    if schedule == "gpipe":
        return num_micro_batches
    return min(num_micro_batches, stages_after)


def interleaved_iteration_s(chunk_latencies: Sequence[float], groups: Sequence[int],
                            num_micro_batches: int) -> float:
    """Iteration time of interleaved 1F1B from its virtual stages' own
    figures: ``chunk_latencies[k]`` is virtual stage k's forward + backward
    (its sends included) per micro-batch, run on device group ``groups[k]``.
    A group spends ``W_g`` (its chunks' sum) per micro-batch; the slowest
    group paces the steady state and the fill and drain cost the other
    groups' work divided by the chunks per group ``v``: Narayanan et al.,
    SC'21 (Megatron-LM), section 2.2.2, bubble ``(p - 1) / v`` of a stage's
    time against 1F1B's ``p - 1``.  With ``v = 1`` this is 1F1B's
    ``m t_max + (sum t - t_max)``."""
    work: dict[int, float] = {}
    for t, g in zip(chunk_latencies, groups):
        work[g] = work.get(g, 0.0) + t
    if not work:
        return 0.0
    v = len(chunk_latencies) / len(work)
    w_max = max(work.values())
    return num_micro_batches * w_max + (sum(work.values()) - w_max) / v


def zb_h1_iteration_s(forward: Sequence[float], backward: Sequence[float],
                      weight: Sequence[float], num_micro_batches: int) -> float:
    """Iteration time of ZB-H1 (:func:`meshplan.schedule.schedule_order`)
    from per stage its forward ``F``, input-gradient ``B`` and weight-gradient
    ``W`` seconds per micro-batch (sends included where they are paid).
    Qi et al. (arXiv:2401.10241, section 2.1) give the bubble of equal stages
    as ``(p - 1)(F + B - W)`` against 1F1B's ``(p - 1)(F + B + W)``: a third of
    it where the three are equal.  (The issue's ``F + B - 2W`` would make
    that bubble zero, which is ZB-H2's.)  Per stage other than the slowest:
    its ``F`` plus the part of its ``B`` that its ``W`` cannot hide; the
    slowest stage paces the ``m`` micro-batches.  With fewer micro-batches
    than stages the W's fill nothing: the B chain of the last micro-batch
    ends the step, ``sum (F + B) + (m - 1) max (F + B) + W`` of the first
    stage.  Exact for equal stages where ``W <= B`` or ``m >= p`` (checked
    against an event simulation of the order in tests/test_zero_bubble.py)."""
    p, m = len(forward), num_micro_batches
    if p == 0:
        return 0.0
    per = [f + b + w for f, b, w in zip(forward, backward, weight)]
    k = max(range(p), key=per.__getitem__)
    paced = m * per[k] + sum(forward[s] + backward[s] - min(weight[s], backward[s])
                             for s in range(p) if s != k)
    chain = [f + b for f, b in zip(forward, backward)]
    drained = sum(chain) + (m - 1) * max(chain) + weight[0]
    return max(paced, drained)


def shared_compute_iteration_s(latencies: Sequence[float], devices: Sequence[int],
                               num_micro_batches: int, total_devices: int,
                               dispatch_s: float) -> float:
    """Iteration time when the devices share one host's compute (XLA's fake
    CPU devices): a stage idle in the bubble lends its share to the busy
    ones, so the host works through every stage's micro-batches with all of
    its compute, ``sum_k B t_k d_k / D``.  ``latencies`` are per micro-batch
    at one device's share of the host with every device busy.  Dispatching
    ``dispatch_s`` per program (two per stage and micro-batch) is serial on
    the host thread and adds up."""
    work = sum(t * d for t, d in zip(latencies, devices)) / total_devices
    return num_micro_batches * (work + 2 * len(latencies) * dispatch_s)
