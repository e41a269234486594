"""Pipeline cost formulas: what a stage pays to send its activations on, how
many micro-batches a schedule keeps in flight, and the iteration time of the
interleaved schedule from its virtual stages and of ZB-H1 from its stages'
forward, input- and weight-gradient parts.  Pure arithmetic on figures the
stage DP already has."""
from __future__ import annotations

from typing import Sequence

from ..schedule import schedule_order
from .cross_mesh import cross_mesh_cost


def stage_send_s(cut_bytes: float, replication: float, devices: int, p2p_bw: float,
                 p2p_lat: float = 0.0, fast_bw: float | None = None,
                 fast_lat: float = 0.0) -> float:
    """Seconds a stage of ``devices`` spends per micro-batch sending
    ``cut_bytes`` of activations on and receiving their gradients back, each
    a cross-mesh transfer (:func:`.cross_mesh.cross_mesh_cost`): every
    distinct byte once over the slow link (``p2p_bw``, ``p2p_lat``: one
    device's share of the links between the stages), then an all-gather over
    the ``replication`` devices holding each byte, on the fast links
    (``fast_bw``, ``fast_lat``; default the slow ones).  The stage DP knows
    only the sender's layout: the receiver is taken to hold the value as the
    sender does, on as many devices (exact for the gradient coming back)."""
    one = cross_mesh_cost(cut_bytes, devices, devices, replication, p2p_bw, p2p_lat,
                          p2p_bw if fast_bw is None else fast_bw, fast_lat)
    return 2 * one.seconds


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
    """Iteration time of ZB-H1 from per stage its forward ``F``, input-gradient
    ``B`` and weight-gradient ``W`` seconds per micro-batch (sends included
    where they are paid): when the last program ends if every stage runs
    its :func:`meshplan.schedule.schedule_order` back to back, each program
    starting once its stage is free and its inputs are done (a forward after
    the stage before's, a ``B`` after the stage after's).  For equal stages
    with ``W <= B`` and ``m >= p`` this is ``m (F + B + W) + (p - 1)(F + B -
    W)``: Qi et al. (arXiv:2401.10241, section 2.1) give that bubble against
    1F1B's ``(p - 1)(F + B + W)``, a third of it where the three are equal
    (the issue's ``F + B - 2W`` would make it zero, which is ZB-H2's).  Walked
    rather than a closed form: with unequal stages, and a first stage whose
    backward stays one program (``W`` 0), which stage's ``W`` hides which
    wait depends on the figures (a closed form was off by up to 25%)."""
    p, m = len(forward), num_micro_batches
    orders = [schedule_order("zb-h1", s, p, m) for s in range(p)]
    took = {"F": forward, "B": backward, "W": weight}
    end: dict[tuple[str, int, int], float] = {}
    free, pos = [0.0] * p, [0] * p
    left = sum(map(len, orders))
    while left:
        for s in range(p):
            while pos[s] < len(orders[s]):
                kind, i = orders[s][pos[s]]
                dep = ("F", s - 1, i) if kind == "F" and s else \
                    ("B", s + 1, i) if kind == "B" and s + 1 < p else None
                if dep is not None and dep not in end:
                    break
                start = max(free[s], end[dep]) if dep is not None else free[s]
                free[s] = end[(kind, s, i)] = start + took[kind][s]
                pos[s] += 1
                left -= 1
    return max(free, default=0.0)


def shared_compute_iteration_s(latencies: Sequence[float], devices: Sequence[int],
                               num_micro_batches: int, total_devices: int,
                               dispatch_s: Sequence[float],
                               collectives_s: Sequence[float] | None = None,
                               passes: int = 2) -> float:
    """Iteration time when the devices share one host's compute (XLA's fake
    CPU devices): a stage idle in the bubble lends its share to the busy
    ones, so the host works through every stage's micro-batches with all of
    its compute, ``sum_k B t_k d_k / D``.  ``latencies`` are per micro-batch
    at one device's share of the host with every device busy.  Dispatching
    a stage's programs (``dispatch_s`` each, ``passes`` per stage and
    micro-batch: :data:`TRAIN_PROGRAMS`) is serial on the host thread and
    adds up.

    ``collectives_s`` (per stage and micro-batch, among its latency) are not
    shared out: a stage's compute runs faster while other stages idle and
    lend it their cores, its collectives do not (a rendezvous of the stage's
    device threads lasts as long however many cores are free), so they add
    up in full, as dispatch does.  That takes no two stages' collectives to
    run at the same time; where they do, they overlap (two stages' psums at
    once add 0.5-1.7x what one program's add, ``benchmarks/cpu_effects.py``
    part 4) and this overcounts.  On the measured grid's pipelines, driven
    one program at a time, it ranks the configurations as measured better
    than sharing them out (``benchmarks/results/measured_grid.md``, stop 67).
    With one stage on every device both readings agree."""
    coll = list(collectives_s) if collectives_s is not None else [0.0] * len(latencies)
    work = sum((t - c) * d for t, c, d in zip(latencies, coll, devices)) / total_devices
    return num_micro_batches * (work + sum(coll) + passes * sum(dispatch_s))


# the programs a stage of a train step runs: a forward and a backward per
# micro-batch, its update once a step.  A step whose every pass over the
# batch is forward work (an evaluation step) runs (1, 0), or (1, 1) where it
# changes state (graph.stage_program_counts)
TRAIN_PROGRAMS = (2, 1)


def stage_programs(num_stages: int, num_micro_batches: int, per_micro_batch: int = 2,
                   per_step: int = 1) -> int:
    """The stage programs a pipelined step runs: per stage (an interleaved
    plan's virtual stage) and micro-batch a forward and a backward
    (``per_micro_batch`` 3 where ZB-H1 splits out the weight gradient, 1 for
    a forward alone), and each stage's update once (``per_step``).  (The
    zero running sums and their means, one program each per stage, are not
    counted: a per-program figure measured on a real pipeline,
    ``Achieved.pipeline_program_s``, carries them.)"""
    return num_stages * (num_micro_batches * per_micro_batch + per_step)


def pipeline_host_s(num_stages: int, num_micro_batches: int, schedule: str,
                    per_program_s: float, per_buffer_s: float = 0.0, buffers: int = 0,
                    programs: tuple[int, int] = TRAIN_PROGRAMS) -> float:
    """:func:`host_bound_s` of the programs of ``num_stages`` stages (an
    interleaved plan's virtual stages) over ``num_micro_batches`` under
    ``schedule`` that one process hands over, plus ``per_buffer_s`` for each
    of the ``buffers`` they take and make (:func:`step_buffers`).  Each
    host's process drives the stages on its devices
    (``dp_search.stages._host_s``).  (A plan of one stage and one
    micro-batch is a single program that jit dispatches whole: its callers
    do not ask.)  ``programs``: a stage's per micro-batch and per step
    (:data:`TRAIN_PROGRAMS`)."""
    return host_bound_s(schedule_programs(num_stages, num_micro_batches, schedule, programs),
                        per_program_s) + buffers * per_buffer_s


def schedule_programs(num_stages: int, num_micro_batches: int, schedule: str,
                      programs: tuple[int, int] = TRAIN_PROGRAMS) -> int:
    """:func:`stage_programs` under ``schedule`` (ZB-H1: a W program too,
    where there is a backward to split)."""
    per_mb, per_step = programs
    return stage_programs(num_stages, num_micro_batches,
                          per_mb + (schedule == "zb-h1" and per_mb > 1), per_step)


def layer_buffers(params: int, state: int, kept: int, sent: int, received: int,
                  schedule: str) -> tuple[int, int]:
    """The arrays one layer adds to its stage's programs: (per micro-batch,
    per step).  A forward takes the ``params`` and what it ``received`` and
    makes the ``kept`` values and what it ``sent``; a backward takes the
    params, the kept values, the cotangents of what was sent and the running
    gradient sums, and makes the sums and the cotangents of what was
    received (ZB-H1's weight-gradient program takes the kept values and the
    sums again and makes the sums).  The update takes the ``state`` and the
    gradients and makes the state.  (Recomputation keeps fewer values: not
    counted.)"""
    per_mb = 4 * params + 2 * kept + 2 * sent + 2 * received
    if schedule == "zb-h1":
        per_mb += 2 * params + kept
    return per_mb, 2 * state + params


def step_buffers(stages: Sequence[tuple[int, int, int]], num_micro_batches: int) -> int:
    """The array buffers a step's stage programs take and make, one per
    device an array lives on: ``stages`` holds each stage's (devices,
    buffers per micro-batch, buffers per step) (:func:`layer_buffers`
    summed over its layers)."""
    return sum(d * (num_micro_batches * mb + step) for d, mb, step in stages)


def host_binds(iteration_s: float, host_s: float) -> bool:
    """Is ``iteration_s`` (a plan's predicted step) set by the host's time
    ``host_s`` (:func:`pipeline_host_s`) rather than by its devices' work?"""
    return host_s > 0 and iteration_s <= host_s * (1 + 1e-9)


def least_host_s(num_micro_batches: int, per_program_s: float, num_stages: int = 1,
                 hosts: int = 1, programs: tuple[int, int] = TRAIN_PROGRAMS) -> float:
    """A floor under the predicted step of every plan of ``num_micro_batches``
    and at least ``num_stages`` stages that the hosts hand over program by
    program: the busiest of ``hosts`` runs the forwards, backwards and
    update of at least its share of the stages (:func:`host_bound_s`; the
    buffers' time is on top).  0 for one stage of one micro-batch, a single
    program jit dispatches whole.  ``programs``: as :func:`pipeline_host_s`'s."""
    if num_micro_batches <= 1 and num_stages <= 1:
        return 0.0
    return host_bound_s(stage_programs(-(-num_stages // hosts), num_micro_batches, *programs),
                        per_program_s)


def host_bound_s(programs: int, per_program_s: float) -> float:
    """The least time of a step whose ``programs`` stage programs one host
    thread dispatches, each costing the host ``per_program_s`` (the
    pipeline driver's own work and jit's dispatch): the devices cannot
    finish before the last program is handed to them.  Where the devices'
    work is longer, as on every GPU run in the benchmarks, it does not bind;
    a pipeline of tiny stages is priced by it (8 fake CPU devices, a 2-layer
    MLP in three stages: measured 2.6 ms where the devices' work alone was
    priced at 0.43, ``benchmarks/results/default_cluster.md``)."""
    return programs * per_program_s
