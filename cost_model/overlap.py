"""Which communication runs under compute, stated once.

Whether a platform overlaps at all is the cluster's ``achieved.overlap_communication``
(XLA's CPU back end runs every collective on the critical path; GPU
back ends run collectives on streams of their own).  Where it does:

* **Tensor-parallel collectives and resharding** sit on the critical path:
  the matmul they feed waits for them.  Never hidden.
* **Data-parallel gradient reductions** of a step of one micro-batch start
  as soon as a gradient is made and run under the backward compute that
  follows it, as XLA's async collectives and Megatron-LM's bucketed
  reduction do.  Only the compute after a reduction is ready can hide it,
  so the last one (the first layers' gradients) is always exposed.
  Reductions are serial on the network.  With several micro-batches the
  runtime adds each device's partial gradients over the micro-batches and
  reduces the sums once, in the step's means program after the last
  backward (:mod:`meshplan.runtime.pipeline_partial`): no compute of the
  stage is left to hide them (Megatron-LM too reduces after the pipeline's
  flush).
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
class Backward:
    """A stretch of backward compute and the gradient reductions it starts,
    summed up so that stretches chain in O(1) (a stage of many layers is
    costed many times by the stage search).

    ``exposed_s``: how long its reductions, serial on the network, run past
    the end of its compute when it runs alone (never less than the last
    reduction: nothing computes after it)."""
    compute_s: float = 0.0
    reduce_s: float = 0.0      # per iteration
    exposed_s: float = 0.0

    @staticmethod
    def of_steps(steps: Sequence[tuple[float, float]]) -> "Backward":
        """``steps``: ``(compute_s, reduce_s)`` in the order they run:
        ``compute_s`` of backward compute, then a gradient reduction of
        ``reduce_s`` is ready (0: none).  The exposed time is the largest
        suffix of reductions less the compute after its first one is ready."""
        out = Backward()
        for compute, reduce in steps:
            out = out.then(Backward(compute, reduce, reduce))
        return out

    def then(self, later: "Backward") -> "Backward":
        """This stretch followed by ``later``: ``later``'s compute hides this
        one's reductions, which queue before ``later``'s on the network."""
        return Backward(self.compute_s + later.compute_s, self.reduce_s + later.reduce_s,
                        max(later.exposed_s, self.exposed_s + later.reduce_s - later.compute_s))


@dataclass(frozen=True)
class StageWork:
    """One stage's work per micro-batch, as the stage search costs it.
    ``backward``: one micro-batch's backward with the gradient reductions
    it starts (their full time, once per iteration); ``comm_s`` counts them
    amortised over the ``num_micro_batches``."""
    compute_s: float                 # all compute, recomputation included
    comm_s: float                    # all collectives, gradient reductions included
    send_s: float = 0.0              # sending activations on and their gradients back
    backward: Backward = Backward()
    num_micro_batches: int = 1

    @property
    def per_micro_batch_comm_s(self) -> float:
        """The collectives every micro-batch runs: ``comm_s`` less the share
        of the gradient reductions made once a step."""
        return max(0.0, self.comm_s - self.backward.reduce_s / max(1, self.num_micro_batches))


def hidden_s(work: StageWork, overlaps: bool) -> float:
    """Seconds per micro-batch of ``work``'s communication that run under its
    compute: 0 where the platform does not overlap (``overlaps`` False).
    The stage's latency is ``compute + comm + send (+ fixed costs) - hidden``,
    never less than its compute and never less than its communication."""
    if not overlaps:
        return 0.0
    B = max(1, work.num_micro_batches)
    bw = work.backward
    # one micro-batch: the reductions run under the backward after them;
    # several: once a step, after the last backward (see the module doc)
    grads = 0.0 if B > 1 else min(max(0.0, min(bw.reduce_s, work.comm_s) - bw.exposed_s),
                                  work.compute_s)
    # a send hides under the next micro-batch's compute (what the reductions
    # left of it): all sends but the last
    sends = min(work.compute_s - grads, work.send_s) * (1 - 1 / B)
    return grads + sends
