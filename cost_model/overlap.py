"""Which communication runs under compute, stated once.

Whether a platform overlaps at all is the cluster's ``achieved.overlap_communication``
(XLA's CPU back end runs every collective on the critical path; GPU
back ends run collectives on streams of their own).  Where it does:

* **Tensor-parallel collectives and resharding** sit on the critical path:
  the matmul they feed waits for them.  Never hidden.
* **Data-parallel gradient reductions** start as soon as a gradient is made
  and run under the backward compute that follows it, as XLA's async
  collectives and Megatron-LM's bucketed reduction do.  Only the compute
  after a reduction is ready can hide it, so the last one (the first
  layers' gradients) is always exposed.  Reductions are serial on the
  network, and they run once per iteration, under the last micro-batch's
  backward only (the others accumulate locally).
* **Pipeline sends** of one micro-batch run while the stage computes the
  next: of ``B`` micro-batches all sends but the last are hidden, up to the
  stage's own work per micro-batch.

Only compute hides communication: critical-path collectives share the links
and are not counted as cover.  Everything here is per micro-batch, the unit
of a stage's latency in the stage search.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class StageWork:
    """One stage's work per micro-batch, as the stage search costs it.

    ``grad_steps``: the backward in execution order, as ``(compute_s,
    reduce_s)`` pairs: ``compute_s`` of backward compute runs, then a
    gradient reduction of ``reduce_s`` (amortised per micro-batch, as the
    stage's ``comm_s`` counts it) is ready to start.  A trailing pair with
    ``reduce_s == 0`` is the compute after the last gradient."""
    compute_s: float                 # all compute, recomputation included
    comm_s: float                    # all collectives, gradient reductions included
    send_s: float = 0.0              # sending activations on and their gradients back
    grad_steps: tuple[tuple[float, float], ...] = ()
    num_micro_batches: int = 1

    @property
    def grad_comm_s(self) -> float:
        return sum(r for _, r in self.grad_steps)


def exposed_reduction_s(steps: Sequence[tuple[float, float]]) -> float:
    """Seconds the reductions of ``steps`` (``(compute_s, reduce_s)`` in
    execution order, see :class:`StageWork`) run past the end of the
    compute, the reductions serial on the network: the largest suffix of
    reductions less the compute after its first one is ready."""
    exposed, reduce_after, compute_after = 0.0, 0.0, 0.0
    for compute, reduce in reversed(steps):
        reduce_after += reduce
        if reduce > 0:
            exposed = max(exposed, reduce_after - compute_after)
        compute_after += compute
    return exposed


def hidden_s(work: StageWork, overlaps: bool) -> float:
    """Seconds per micro-batch of ``work``'s communication that run under its
    compute: 0 where the platform does not overlap (``overlaps`` False).
    The stage's latency is ``compute + comm + send (+ fixed costs) - hidden``,
    never less than its compute and never less than its communication."""
    if not overlaps:
        return 0.0
    B = max(1, work.num_micro_batches)
    # reductions run once per iteration, under the last micro-batch's backward
    per_iteration = [(c, r * B) for c, r in work.grad_steps]
    grad_comm = min(work.grad_comm_s, work.comm_s)
    grads = min(max(0.0, grad_comm - exposed_reduction_s(per_iteration) / B), work.compute_s)
    # a send hides under the next micro-batch's compute (what the reductions
    # left of it): all sends but the last
    sends = min(work.compute_s - grads, work.send_s) * (1 - 1 / B)
    return grads + sends
