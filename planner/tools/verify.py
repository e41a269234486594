"""Check the planner's predictions against what XLA really compiles.

``verify(model, mesh_shape)`` plans a built-in model with
``ShardParallel(mesh_shape)`` on the local devices, lowers and compiles the
step exactly as the runtime runs it, and compares

* communication: the plan's ``comm_bytes_per_device`` against the sum of the
  collectives' result bytes in the compiled per-device HLO (the convention of
  DESIGN.md, counted by :func:`meshplan.runtime.hlo.collective_bytes`), with a
  per-kind breakdown on both sides (a collective in a rolled loop's body
  counted once per trip: ``collective_bytes_per_call``);
* memory: the plan's peak bytes per device against
  ``compiled.memory_analysis()``, read as

      argument + output - alias + temp

  ``argument`` are the (sharded) inputs, resident for the whole step;
  ``output`` are the results, of which ``alias`` bytes reuse donated input
  buffers (the updated parameters and optimizer state) and so cost nothing
  extra; ``temp`` is XLA's buffer assignment for every intermediate, which
  already packs buffers by liveness, so it is XLA's own peak of live
  intermediates (an upper bound: the allocation is one arena sized for the
  worst point, plus fragmentation).  The planner predicts the same sum:
  resident inputs plus the peak of live intermediates, where the updated
  inputs take over the donated buffers.

Everything is per device.  A relative error is ``(predicted - actual) /
actual`` (0 when both are 0).

Pipeline plans (:func:`verify_pipeline`, one row per stage): the stage's
programs lowered and compiled as the driver runs them (``step.lower(...)``,
:mod:`meshplan.runtime.pipeline_lower`); communication is the collectives'
bytes of each program times the times one call runs it (forward and
backward once per micro-batch; the means of the running sums, where partial
gradient sums are reduced, and the update once) against the stage's
predicted ``comm_bytes``; memory is what the stage keeps alive (state,
running sums, activations of the micro-batches in flight) plus the largest
arena of intermediates of its programs, against the stage's predicted
``memory_bytes``.  Transfers between stages are ``device_put`` s, not
collectives: neither side counts them.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

__all__ = ["VerifyRow", "verify", "compiled_memory", "markdown_table", "csv_text",
           "predicted_breakdown", "PipelineVerifyRow", "verify_pipeline", "pipeline_table"]


class _Errors:
    """Relative errors of a row's predicted against its compiled figures."""
    predicted_comm_bytes: int
    actual_comm_bytes: int
    predicted_memory_bytes: int
    actual_memory_bytes: int

    @property
    def comm_rel_error(self) -> float:
        return _rel(self.predicted_comm_bytes, self.actual_comm_bytes)

    @property
    def memory_rel_error(self) -> float:
        return _rel(self.predicted_memory_bytes, self.actual_memory_bytes)

    @property
    def comm_ok(self) -> bool:
        return abs(self.comm_rel_error) <= 0.10


@dataclass(frozen=True)
class VerifyRow(_Errors):
    model: str
    mesh_shape: tuple[int, ...]
    predicted_comm_bytes: int
    actual_comm_bytes: int
    predicted_by_kind: tuple[tuple[str, int], ...]      # kind -> bytes (the plan's view)
    actual_by_kind: tuple[tuple[str, int, int], ...]    # kind -> (count, bytes) in the HLO
    predicted_memory_bytes: int
    actual_memory_bytes: int
    memory_parts: tuple[tuple[str, int], ...]           # argument/output/alias/temp bytes
    plan_s: float
    compile_s: float
    overrides: tuple[tuple[str, str], ...] = ()


def _rel(pred: float, actual: float) -> float:
    if actual == 0:
        return 0.0 if pred == 0 else math.inf
    return (pred - actual) / actual


def compiled_memory(compiled: Any) -> tuple[int, dict[str, int]]:
    """Peak bytes per device of a compiled program: argument + output - alias + temp."""
    ma = compiled.memory_analysis()
    if isinstance(ma, (list, tuple)):       # some versions give one per device
        ma = ma[0]
    parts = {k: int(getattr(ma, f"{k}_size_in_bytes", 0) or 0)
             for k in ("argument", "output", "alias", "temp")}
    total = parts["argument"] + parts["output"] - parts["alias"] + parts["temp"]
    return total, parts


def predicted_breakdown(result: Any) -> dict[str, int]:
    """The ILP answer's communication bytes per collective kind."""
    by = getattr(result, "comm_by_kind", None)
    return {k: int(round(v)) for k, v in (by or ())}


def _local_cluster(num_devices: int):
    import jax
    from ..cluster import ClusterSpec
    if len(jax.devices()) < num_devices:
        raise RuntimeError(
            f"verify needs {num_devices} devices, jax sees {len(jax.devices())}: set "
            "XLA_FLAGS=--xla_force_host_platform_device_count=8 before importing jax")
    return ClusterSpec.local()


def verify(model_name: str, mesh_shape: Sequence[int], *,
           overrides: Mapping[str, Any] | None = None, cluster: Any = None,
           time_limit: float = 60.0, backend: str = "highs") -> VerifyRow:
    """Plan ``model_name`` on ``mesh_shape`` (local devices), compile it and
    compare predicted with compiled communication and memory per device.

    The step is compiled as ``parallelize`` runs it: every planned layout and
    every operand the plan reshards pinned by ``with_sharding_constraint``."""
    from ..api import parallelize, trace_step
    from ..dp_search.assemble import plan_from_intra_op
    from ..models import build_model
    from ..plan import LogicalMesh
    from ..cost_model import default_axis_names
    from ..ilp import solve_intra_op
    from ..runtime import hlo

    mesh_shape = tuple(int(s) for s in mesh_shape)
    n = math.prod(mesh_shape)
    cluster = cluster or _local_cluster(n)
    model = build_model(model_name, dict(overrides or {}))
    args = model.abstract_args

    t0 = time.perf_counter()
    # (a step with its blocks in a lax.scan is planned and run unrolled)
    graph = trace_step(model.train_step, args, (1,), model_name)[0]
    mesh = LogicalMesh(default_axis_names(len(mesh_shape)), mesh_shape)
    result = solve_intra_op(graph, cluster, mesh, backend=backend, time_limit=time_limit)
    plan = plan_from_intra_op(graph, cluster, result, "shard")
    plan_s = time.perf_counter() - t0

    step = parallelize(model.train_step, plan=plan, donate_argnums="auto")  # (the state in place)
    t0 = time.perf_counter()
    compiled = step.lower(*args).compile()
    compile_s = time.perf_counter() - t0
    text = compiled.as_text()
    # (a collective in a rolled loop's body once per trip, as the plan counts it)
    actual = hlo.collective_bytes_per_call(text)
    by_kind = hlo.summary(text, per_call=True)
    mem, parts = compiled_memory(compiled)
    return VerifyRow(
        model=model_name, mesh_shape=mesh_shape,
        predicted_comm_bytes=int(plan.predicted.comm_bytes_per_device),
        actual_comm_bytes=int(actual),
        predicted_by_kind=tuple(sorted(predicted_breakdown(result).items())),
        actual_by_kind=tuple(sorted((k, c, b) for k, (c, b) in by_kind.items())),
        predicted_memory_bytes=int(plan.predicted.peak_memory_bytes),
        actual_memory_bytes=int(mem), memory_parts=tuple(parts.items()),
        plan_s=plan_s, compile_s=compile_s,
        overrides=tuple(sorted((str(k), str(v)) for k, v in (overrides or {}).items())))


_SHORT = {"all-reduce": "AR", "all-gather": "AG", "reduce-scatter": "RS", "all-to-all": "A2A",
          "collective-permute": "CP"}


def _kinds(items) -> str:
    return " ".join(f"{_SHORT.get(k, k)}:{_kb(b)}" for k, *_, b in items) or "-"


def _kb(b: float) -> str:
    return f"{b / 1024:.1f}K"


def markdown_table(rows: Sequence[VerifyRow]) -> str:
    head = ("| model | mesh | pred comm | HLO comm | err | pred by kind | HLO by kind | "
            "pred mem | XLA mem | mem err |")
    sep = "|" + "---|" * 10
    lines = [head, sep]
    for r in rows:
        lines.append(
            f"| {r.model} | {'x'.join(map(str, r.mesh_shape))} | {r.predicted_comm_bytes:,} | "
            f"{r.actual_comm_bytes:,} | {r.comm_rel_error:+.1%} | {_kinds(r.predicted_by_kind)} | "
            f"{_kinds(r.actual_by_kind)} | {r.predicted_memory_bytes:,} | "
            f"{r.actual_memory_bytes:,} | {r.memory_rel_error:+.1%} |")
    return "\n".join(lines)


def csv_text(rows: Sequence[VerifyRow]) -> str:
    cols = ["model", "mesh", "predicted_comm_bytes", "actual_comm_bytes", "comm_rel_error",
            "predicted_by_kind", "actual_by_kind", "predicted_memory_bytes",
            "actual_memory_bytes", "memory_rel_error", "argument_bytes", "output_bytes",
            "alias_bytes", "temp_bytes", "plan_s", "compile_s"]
    out = [",".join(cols)]
    for r in rows:
        parts = dict(r.memory_parts)
        out.append(",".join(str(x) for x in [
            r.model, "x".join(map(str, r.mesh_shape)), r.predicted_comm_bytes,
            r.actual_comm_bytes, f"{r.comm_rel_error:.4f}",
            " ".join(f"{k}={b}" for k, b in r.predicted_by_kind),
            " ".join(f"{k}={c}/{b}" for k, c, b in r.actual_by_kind),
            r.predicted_memory_bytes, r.actual_memory_bytes, f"{r.memory_rel_error:.4f}",
            parts.get("argument", 0), parts.get("output", 0), parts.get("alias", 0),
            parts.get("temp", 0), f"{r.plan_s:.2f}", f"{r.compile_s:.2f}"]))
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------------------
# pipeline plans: one row per stage
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class PipelineVerifyRow(_Errors):
    model: str
    config: str                                         # e.g. "2x(2x2) mb4 1f1b"
    stage: int
    predicted_comm_bytes: int
    actual_comm_bytes: int
    actual_by_kind: tuple[tuple[str, int, int], ...]    # kind -> (count, bytes), times run
    predicted_memory_bytes: int
    actual_memory_bytes: int
    memory_parts: tuple[tuple[str, int], ...]           # state/running_sums/activations/programs
    # the plan's parts (params/grads/optimizer/activations/temporaries)
    predicted_memory_parts: tuple[tuple[str, int], ...] = ()


def verify_pipeline(model_name: str, dp: int, tp: int, pp: int, micro_batches: int,
                    schedule: str = "1f1b", *, overrides: Mapping[str, Any] | None = None,
                    searched: bool = False) -> list[PipelineVerifyRow]:
    """Plan ``model_name`` with ``Manual(dp, tp, pp)`` on the local devices
    (``searched``: ``PipeshardParallel(stages=pp)`` on ``dp * tp * pp`` of
    them, its meshes and layouts searched), lower and compile every stage
    program as the pipeline runs it and compare each stage's communication
    and memory with the plan's."""
    from ..api import parallelize
    from ..methods import Manual, PipeshardParallel
    from ..models import build_model
    from ..runtime import hlo
    from ..runtime.pipeline_lower import stage_memory

    _local_cluster(dp * tp * pp)
    model = build_model(model_name, dict(overrides or {}))
    args = model.abstract_args
    method = (PipeshardParallel(stages=pp, num_micro_batches=micro_batches, schedule=schedule)
              if searched else
              Manual(dp=dp, tp=tp, pp=pp, num_micro_batches=micro_batches, schedule=schedule))
    step = parallelize(model.train_step, method=method, donate_argnums=(0,))
    compiled = step.lower(*args).compile()
    plan = step.plan
    ex = step._entry(args)[1]
    meshes = ", ".join("x".join(map(str, st.logical_mesh.shape)) for st in plan.stages)
    config = (f"searched ({meshes}) mb{micro_batches} {schedule}" if searched
              else f"{pp}x({dp}x{tp}) mb{micro_batches} {schedule}")
    rows = []
    for mem, st in zip(stage_memory(ex, compiled), plan.stages):
        kinds: dict[str, list[int]] = {}
        actual = 0
        for key, co in compiled.stage(mem.stage).items():
            runs = compiled.runs(key)
            text = co.as_text()
            actual += runs * hlo.collective_bytes_per_call(text)
            for k, (c, b) in hlo.summary(text, per_call=True).items():
                got = kinds.setdefault(k, [0, 0])
                got[0] += runs * c
                got[1] += runs * b
        rows.append(PipelineVerifyRow(
            model=model_name, config=config, stage=mem.stage,
            predicted_comm_bytes=int(st.predicted.comm_bytes or 0), actual_comm_bytes=int(actual),
            actual_by_kind=tuple(sorted((k, c, b) for k, (c, b) in kinds.items())),
            predicted_memory_bytes=int(st.predicted.memory_bytes),
            actual_memory_bytes=int(mem.total),
            memory_parts=tuple((k, v) for k, v in mem.to_dict().items()
                               if k not in ("stage", "total")),
            predicted_memory_parts=st.predicted.memory.parts() if st.predicted.memory else ()))
    return rows


def pipeline_table(rows: Sequence[PipelineVerifyRow]) -> str:
    head = ("| model | stages x (mesh), micro-batches, schedule | stage | pred comm | HLO comm | "
            "err | HLO by kind | pred mem | measured mem | mem err | pred temporaries | "
            "largest program temp |")
    lines = [head, "|" + "---|" * 12]
    for r in rows:
        temps = dict(r.predicted_memory_parts).get("temporaries", 0)
        lines.append(
            f"| {r.model} | {r.config} | {r.stage} | {r.predicted_comm_bytes:,} | "
            f"{r.actual_comm_bytes:,} | {r.comm_rel_error:+.1%} | {_kinds(r.actual_by_kind)} | "
            f"{r.predicted_memory_bytes:,} | {r.actual_memory_bytes:,} | "
            f"{r.memory_rel_error:+.1%} | {temps:,} | {dict(r.memory_parts).get('programs', 0):,} |")
    return "\n".join(lines)
