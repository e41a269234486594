"""What a plan was chosen over (``explain=True``, ``meshplan plan --explain``).

:func:`alternatives` plans the step the other ways a user would ask about,
on the same traced graph and in the same session (layer costs and micro-batch
traces are shared), and says why each lost:

* data parallel and ZeRO-3 (parameters and optimizer state sharded over the
  one ``data`` axis): the whole batch at once; when that does not fit, what
  it would take if memory were no limit, and the same with gradient
  accumulation over micro-batches (one stage, micro-batches searched);
* intra-operator only (ShardParallel: one stage, the whole-graph ILP);
* the best pipeline with 1, 2, 4, ... stages (recorded by the method's own
  search when it searched the number of stages, else by an Auto search);
* the best Megatron-style grid plan: tensor parallel inside a host, the
  rest split between pipeline stages and data parallel, micro-batches and
  schedule searched.

Everything is deterministic (no wall-clock cut-off): the same inputs give the
same alternatives.
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Callable

from .alternatives import Alternative, comm_share, describe_plan
from .cluster import ClusterSpec
from .dp_search import AUTO_SCHEDULES, PipelineOptions, SearchStats, Session, search_pipeline
from .errors import InfeasiblePlanError, MeshplanError
from .graph import Graph
from .methods import Manual
from .one_stage import plan_one_stage
from .plan import Plan
from .request import PlanRequest

UNLIMITED = 2.0 ** 62        # a memory budget no plan reaches ("if memory were no limit")
ONE_STAGE_NOTE = "one stage is fastest: planned by the whole-graph ILP"


def alternatives(graph: Graph, cluster: ClusterSpec, plan: Plan, stats: SearchStats | None,
                 request: PlanRequest, *, retrace: Callable[[int], Graph] | None,
                 session: Session) -> tuple[Alternative, ...]:
    """The alternatives ``plan`` (planned for ``request``, with the search's
    ``stats``) was chosen over, each compared with it."""
    ctx = _Context(graph, cluster, plan, request, retrace, session)
    rows: list[Alternative] = []
    for method, mode, what in (("data", "replicated", "data parallel"),
                               ("zero3", "sharded", "ZeRO-3")):
        with session.progress.step(f"explain: {what}"):
            rows += ctx.one_axis(method, mode, what)
    with session.progress.step("explain: intra-operator only (one stage, whole-graph ILP)"):
        rows.append(ctx.intra())
    with session.progress.step("explain: the best pipeline per number of stages"):
        rows += ctx.stage_counts(stats)
    with session.progress.step("explain: Megatron-style grid plans"):
        rows.append(ctx.grid())
    return tuple(rows)


class _Context:
    """The step, the cluster and the chosen plan the alternatives are planned
    for and compared with."""

    def __init__(self, graph: Graph, cluster: ClusterSpec, plan: Plan, request: PlanRequest,
                 retrace: Callable[[int], Graph] | None, session: Session) -> None:
        self.graph, self.cluster, self.plan = graph, cluster, plan
        self.request, self.retrace, self.session = request, retrace, session
        self.n = cluster.num_devices

    # ---- the alternatives ------------------------------------------------------
    def one_axis(self, method: str, mode: str, what: str) -> list[Alternative]:
        """One stage on a 1-D ``data`` mesh, parameters replicated or sharded:
        the whole batch at once, else also with gradient accumulation."""
        whole = f"{what}, whole batch at once"
        try:
            return [self.row(method, whole, self.one_stage(method, mode, None))]
        except InfeasiblePlanError as e:
            rows = [self.unfit(method, whole, e,
                               relaxed=lambda: self.one_stage(method, mode, UNLIMITED))]
            memory = bool(e.budget_bytes)
        if self.retrace is None or not memory:
            return rows     # (only memory is helped by smaller micro-batches)
        opts = PipelineOptions(num_stages=1, schedules=("1f1b",), data_parallel_stages=True,
                               input_filter=_layouts(mode), time_limit=self.request.time_limit,
                               backend=self.request.backend)
        try:
            p, _ = search_pipeline(self.graph, self.cluster, opts, method_name=method,
                                   session=self.session, retrace=self.retrace)
        except MeshplanError as e:
            return rows + [self.unfit(method, f"{what}, gradient accumulation", e)]
        return rows + [self.row(method, f"{what}, gradient accumulation over "
                                        f"{p.num_micro_batches} micro-batch(es)", p)]

    def intra(self) -> Alternative:
        """ShardParallel: one stage, the whole batch, every logical mesh."""
        what = "intra-operator only (ShardParallel), one stage, whole batch"
        if ONE_STAGE_NOTE in self.plan.notes:
            return self.row("intra", what, self.plan, same="the chosen plan is this one")
        try:
            p = plan_one_stage(self.graph, self.cluster, PlanRequest(
                "shard", time_limit=self.request.time_limit, backend=self.request.backend),
                self.session)
        except InfeasiblePlanError as e:
            return self.unfit("intra", what, e)
        return self.row("intra", what, p)

    def stage_counts(self, stats: SearchStats | None) -> list[Alternative]:
        """The best pipeline per number of stages: the chosen plan's own search
        when it searched the number of stages, else an Auto search."""
        own = stats is not None and bool(stats.stage_counts)
        if not own:
            opts = PipelineOptions(schedules=AUTO_SCHEDULES, time_limit=self.request.time_limit,
                                   backend=self.request.backend)
            try:
                _, stats = search_pipeline(self.graph, self.cluster, opts, method_name="auto",
                                           session=self.session, retrace=self.retrace,
                                           by_stage_count=True)
            except MeshplanError as e:      # (also: no batch to split into micro-batches)
                return [self.unfit("pipeline", "the best pipeline (any number of stages)", e)]
        rows = []
        for best in stats.stage_counts:       # type: ignore[union-attr]
            k = best.num_stages
            if own and k == len(self.plan.stages):
                continue        # (the chosen plan is the best with its number of stages)
            label = f"{k} stage{'s' if k > 1 else ''}"
            if best.plan is None:
                rows.append(self.unfit(f"pipeline-{k}", f"pipeline of {label}",
                                       InfeasiblePlanError(best.why)))
            else:
                rows.append(self.row(f"pipeline-{k}", describe_plan(best.plan), best.plan))
        return rows

    def grid(self) -> Alternative:
        """The fastest Megatron-style hand plan over :func:`grid_points`."""
        best: Plan | None = None
        err: MeshplanError | None = None
        points = grid_points(self.n, self.cluster.devices_per_host)
        for dp, tp, pp in points:
            opts = PipelineOptions(num_stages=pp, fixed=(dp, tp, pp), input_filter="model",
                                   schedules=("1f1b", "gpipe") if pp > 1 else ("1f1b",),
                                   time_limit=self.request.time_limit,
                                   backend=self.request.backend)
            found = []
            try:
                found.append(search_pipeline(self.graph, self.cluster, opts, method_name="manual",
                                             session=self.session, retrace=self.retrace)[0])
                if pp == 1:     # (Manual(dp, tp)'s own plan: one program, the whole graph)
                    found.append(plan_one_stage(self.graph, self.cluster,
                                                Manual(dp=dp, tp=tp).request(self.n),
                                                self.session))
            except MeshplanError as e:        # (also: fewer layers than stages, no batch)
                err = e
            for p in found:
                if best is None or p.predicted.iteration_s < best.predicted.iteration_s:
                    best = replace(p, notes=(f"dp={dp} tp={tp} pp={pp}",))
        tried = ", ".join(f"{dp}x{tp}x{pp}" for dp, tp, pp in points)
        what = f"best Megatron-style grid (dp x tp x pp of {tried})"
        if best is None:
            return self.unfit("grid", what, err or InfeasiblePlanError("no grid plan"))
        desc = (f"Manual({best.notes[0]}), {best.num_micro_batches} micro-batch(es)"
                + (f", {best.schedule}" if len(best.stages) > 1 else "")
                + (", remat" if any(s.remat for s in best.stages) else ""))
        return self.row("grid", desc, best, hand=True)

    # ---- rows ----------------------------------------------------------------------
    def one_stage(self, method: str, mode: str, budget: float | None) -> Plan:
        """One stage on a 1-D ``data`` mesh with parameters laid out as ``mode``
        says (``ilp.InputLayouts``), the batch split over it; ``budget``: the
        memory limit (None: the devices')."""
        return plan_one_stage(self.graph, self.cluster, PlanRequest(
            method, mesh_shape=(self.n,), axis_names=("data",), input_layouts=mode,
            batch_split=self.n, batch_split_by=method, time_limit=self.request.time_limit,
            backend=self.request.backend), self.session, memory_budget=budget)

    def row(self, method: str, description: str, p: Plan, *, same: str = "",
            hand: bool = False) -> Alternative:
        t, chosen = p.predicted.iteration_s, self.plan.predicted.iteration_s
        if same:
            why = same
        elif math.isclose(t, chosen, rel_tol=1e-9):
            why = "as fast as the chosen plan"
        elif t < chosen:
            why = f"{'a hand plan' if hand else 'this plan'} is faster by {1 - t / chosen:.1%}"
        else:
            why = f"{t / chosen - 1:.1%} slower" + _reason(p, self.plan)
        return Alternative(method, description, t, p.predicted.peak_memory_bytes, True, why)

    def unfit(self, method: str, description: str, e: MeshplanError,
              relaxed: Callable[[], Plan] | None = None) -> Alternative:
        """A plan that does not fit: with ``relaxed`` (and a memory error), what
        it would take and need with no memory limit; else the error's gist."""
        gist = str(e).split("; ")[0]
        if not isinstance(e, InfeasiblePlanError):
            gist = f"not available: {gist}"
        budget = getattr(e, "budget_bytes", None)
        if relaxed is not None and budget:
            try:
                p = relaxed()
            except MeshplanError:
                pass
            else:
                need = p.predicted.peak_memory_bytes
                return Alternative(method, description, p.predicted.iteration_s, need, False,
                                   f"needs {_gib(need)} per device > budget "
                                   f"{_gib(budget)}")
        return Alternative(method, description, None, getattr(e, "needed_bytes", None), False,
                           gist)


def grid_points(num_devices: int, devices_per_host: int) -> list[tuple[int, int, int]]:
    """(dp, tp, pp) of the Megatron-style plans tried: tensor parallel over a
    whole host (Megatron-LM's rule: tensor parallel inside a host), the hosts
    split between pipeline stages and data parallel (powers of two)."""
    tp = min(devices_per_host, num_devices)
    rest = num_devices // tp
    out, pp = [], 1
    while pp <= rest:
        if rest % pp == 0:
            out.append((rest // pp, tp, pp))
        pp *= 2
    return out


def _layouts(mode: str):
    from .ilp import InputLayouts
    return InputLayouts(mode)


def _reason(p: Plan, chosen: Plan) -> str:
    """Why ``p`` is slower than ``chosen``, in a few words (or nothing)."""
    a, c = comm_share(p), comm_share(chosen)
    if a > c + 0.05:
        return f": more communication ({a:.0%} of its stage time, chosen {c:.0%})"
    if len(p.stages) > len(chosen.stages):
        return ": pipeline bubble and sends between stages"
    if any(s.remat for s in p.stages) and not any(s.remat for s in chosen.stages):
        return ": recomputes activations"
    if p.num_micro_batches > chosen.num_micro_batches:
        return ": more, smaller micro-batches"
    return ""


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**28 else f"{n / 2**20:.1f} MiB"
