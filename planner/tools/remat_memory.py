"""Predicted activation bytes against XLA's memory analysis, per recomputation
choice of a one-program plan (``Manual(dp, tp, remat=...)``, executed by
:mod:`meshplan.runtime.remat`).

XLA's CPU backend schedules for concurrency by default and then keeps a
forward value alive until whatever runs next is ready, recomputed copy or
not: ``memory_analysis()`` shows the saving only with its memory-aware
scheduler (:data:`SCHEDULER_FLAG` in ``XLA_FLAGS`` before jax starts), as it
does for ``jax.checkpoint`` itself.  GPU backends schedule for memory
already.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

SCHEDULER_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler=false"
KINDS = ("none", "selective", "full")


@dataclass(frozen=True)
class RematRow:
    model: str
    config: str
    recompute: str
    planned_by: str                   # "stage DP" or "whole-graph ILP"
    predicted_activation_bytes: int   # the plan's kept activations per device
    predicted_memory_bytes: int       # the plan's peak per device
    predicted_iteration_s: float
    temp_bytes: int                   # memory_analysis(): the program's temporaries
    compiled_bytes: int               # argument + output - alias + temp


def memory_aware_scheduler() -> bool:
    """Whether this process's XLA CPU scheduler is the memory-aware one."""
    return SCHEDULER_FLAG in os.environ.get("XLA_FLAGS", "")


def verify_remat(model_name: str, dp: int, tp: int, kinds: Sequence[str] = KINDS, *,
                 overrides: Mapping[str, Any] | None = None) -> list[RematRow]:
    """Plan ``model_name`` with ``Manual(dp, tp, remat=k)`` on the local
    devices for each of ``kinds``, compile the step as ``parallelize`` runs
    it and read its memory analysis."""
    from ..api import parallelize
    from ..methods import Manual
    from ..models import build_model
    from .verify import _local_cluster, compiled_memory
    import meshplan

    cluster = _local_cluster(dp * tp)
    model = build_model(model_name, {k: str(v) for k, v in (overrides or {}).items()})
    args = model.abstract_args
    rows = []
    for kind in kinds:
        plan = meshplan.plan(model.train_step, *args, cluster=cluster,
                             method=Manual(dp=dp, tp=tp, remat=kind))
        step = parallelize(model.train_step, plan=plan, donate_argnums=(0,))
        total, parts = compiled_memory(step.lower(*args).compile())
        st = plan.stages[0]
        rows.append(RematRow(
            model=model_name, config=f"{dp}x{tp}", recompute=st.recompute,
            planned_by="whole-graph ILP" if st.recompute == "none" else "stage DP",
            predicted_activation_bytes=int(st.predicted.memory.activations),
            predicted_memory_bytes=int(st.predicted.memory_bytes),
            predicted_iteration_s=float(plan.predicted.iteration_s),
            temp_bytes=parts["temp"], compiled_bytes=total))
    return rows


def remat_table(rows: Sequence[RematRow]) -> str:
    head = ("| model | mesh | recompute | planned by | pred activations | pred memory | "
            "pred iteration | compiled temp | compiled total |")
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        lines.append(
            f"| {r.model} | {r.config} | {r.recompute} | {r.planned_by} | "
            f"{r.predicted_activation_bytes:,} | {r.predicted_memory_bytes:,} | "
            f"{r.predicted_iteration_s * 1e3:.3f} ms | {r.temp_bytes:,} | {r.compiled_bytes:,} |")
    return "\n".join(lines)
