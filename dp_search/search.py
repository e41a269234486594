"""The inter-operator pass's entry: :func:`plan_pipeline`.

It cuts the step into layers (:mod:`.layers`, :mod:`.problem`), costs every
distinct layer on every logical mesh of every candidate submesh with the ILP
(:mod:`.solver`; cached in the session, so identical transformer blocks are
solved once), and runs the stage DP for each number of micro-batches and
each schedule (:mod:`.stages`), keeping the fastest plan that fits
(:mod:`.assemble`).
"""
from __future__ import annotations

import math
import time
from dataclasses import replace
from typing import Callable

from ..cluster import ClusterSpec
from ..cost_model.pipeline import least_host_s
from ..errors import InfeasiblePlanError, MeshplanError, TraceError, batch_rows, warn
from ..graph import (BATCH, PARAM, Graph, Node, batch_dims_between, batch_shaped_draws,
                     stacked_scan_inputs, stage_program_counts)
from ..plan import Plan
from ..units import human_bytes
from .assemble import pipeline_plan
from .options import PipelineOptions
from .problem import LayerProblems, layer_problems
from .session import SearchStats, Session, StageCountBest
from .solver import LayerSolver
from .stages import PipelineChoice, StageCosts, StageMemoryError, best_pipeline


def micro_batch_candidates(batch: int, fixed: tuple[int, ...] | None) -> list[int]:
    """The micro-batch counts a search of ``batch`` starts from: those of
    ``fixed`` that divide it (refused where one count asked does not, or
    none of several does), else every divisor up to :data:`MAX_MICRO_BATCHES`."""
    if fixed:
        ok = [b for b in fixed if b >= 1 and batch % b == 0]
        if len(fixed) == 1 and not ok:
            raise MeshplanError(f"num_micro_batches={fixed[0]} does not divide the batch size "
                                f"{batch}")
        if not ok:
            divisors = [b for b in range(1, min(batch, MAX_MICRO_BATCHES) + 1) if batch % b == 0]
            raise MeshplanError(f"none of num_micro_batches={tuple(fixed)} divides the batch "
                                f"size {batch}; search counts that do: "
                                f"{', '.join(map(str, divisors[:8]))}")
        return ok
    # Every divisor of the batch within 1.5x of a power of two up to 64, not
    # only the powers: a hand plan splits the batch so that its data-parallel
    # degree divides each micro-batch (Megatron-LM's 24 or 48 of 1536 for 32
    # replicas), which no power of two does when the batch has odd factors.
    return [b for b in range(1, min(batch, MAX_MICRO_BATCHES) + 1) if batch % b == 0]


# the most micro-batches searched first (1.5 x 64); more only where the most won
MAX_MICRO_BATCHES = 96


def _pow2(b: int) -> bool:
    return b & (b - 1) == 0


def batch_leaves(graph: Graph) -> list[tuple[int, str]]:
    """(dimension 0, name) of every batch argument leaf that has one
    (:func:`meshplan.errors.batch_rows` takes them)."""
    return [(graph.tensors[i.tensor].shape[0], f"argument {i.argnum}{i.path}")
            for i in graph.inputs if i.role == BATCH and graph.tensors[i.tensor].shape]


def batch_size(graph: Graph) -> int:
    size = batch_rows(batch_leaves(graph))
    if size is None:
        raise MeshplanError("pipeline planning needs a batch: pass batch_argnums naming the "
                            "arguments whose dimension 0 is the batch")
    return size


def plan_pipeline(graph: Graph, cluster: ClusterSpec, method, *,
                  retrace: Callable[[int], Graph] | None = None,
                  options: PipelineOptions | None = None,
                  session: Session | None = None) -> Plan:
    """The fastest pipeline plan (possibly one stage) for ``graph`` under a
    pipeline ``method`` (``options`` default to its request's)."""
    request = method.request(cluster.num_devices)
    opts = options or request.pipeline
    if opts is None:
        raise MeshplanError(f"{method!r} is not a pipeline method")
    plan = search_pipeline(graph, cluster, opts, method_name=request.method, retrace=retrace,
                           session=session or Session.from_env())[0]
    warn_of_scans(graph, plan)
    return plan


def warn_of_scans(graph: Graph, plan: Plan) -> None:
    """One warning for a plan of layers stacked in a scan that the search
    could not cut."""
    warning = _scanned_layers(graph)
    if warning and warning in plan.notes:
        warn(f"meshplan: {warning}")


def search_pipeline(graph: Graph, cluster: ClusterSpec, opts: PipelineOptions, *,
                    method_name: str, session: Session,
                    retrace: Callable[[int], Graph] | None = None,
                    by_stage_count: bool = False,
                    layered_memo: dict | None = None,
                    floor_s: float = math.inf) -> tuple[Plan, SearchStats]:
    """The fastest pipeline plan (possibly one stage) for ``graph``, and the
    search's figures.  ``retrace(B)`` returns the step traced with the batch
    split into ``B`` micro-batches; without it only ``B = 1`` is considered.
    ``by_stage_count`` (explain; a searched number of stages only): the
    figures also hold the best plan with 1, 2, 4, ... stages
    (``SearchStats.stage_counts``); the plan chosen is the same.
    ``layered_memo``: a dict shared by searches of one ``graph``, ``retrace``
    and ``cluster`` that differ only in ``opts.input_filter`` or
    ``opts.num_micro_batches`` (which the layers do not depend on): each
    micro-batch count is traced and cut into layers once for all of them.
    ``floor_s``: the predicted step of a plan already in hand (the one
    program the whole-graph ILP lays out); a count whose every plan the
    host's dispatch alone keeps from beating it is passed over unsearched
    (:func:`~meshplan.cost_model.pipeline.least_host_s`)."""
    batch = batch_size(graph)
    mbs = micro_batch_candidates(batch, opts.num_micro_batches)
    if retrace is None:
        mbs = [b for b in mbs if b == 1] or [mbs[0]]
    # The most micro-batches first: fewer, larger micro-batches need more
    # memory, so once a count fits nothing after one that did, fewer are not
    # tried (prune_micro_batches).
    todo = sorted(mbs, reverse=True)
    searched: list[int] = []
    untraceable: set[int] = set()
    search = LayerSolver(cluster, opts, session)
    best: tuple[float, Plan] | None = None
    errors: dict[int, str] = {}          # micro-batch count -> why it has no plan
    unfit: dict[int, StageMemoryError] = {}   # ... when a stage was over the memory budget
    squeezed: dict[int, float] = {}     # relaxed iteration times of the counts in unfit
    ahead: dict[int, LayerProblems | TraceError] = {}
    counts = _StageCounts() if by_stage_count and opts.num_stages is None and not opts.fixed \
        else None
    # A count is searched in full only where its relaxed search (every stage
    # fitting its fastest way) beats the best plan so far and its relaxed
    # plan does not fit as it is (explain keeps every count: its
    # per-stage-count table reads them all)
    bounding = opts.prune_micro_batches and counts is None and len(mbs) > 1
    bounded: list[int] = []
    floored: list[int] = []         # counts the host's dispatch keeps above floor_s
    relaxed_fit: list[int] = []     # counts whose relaxed plan fits: not searched again
    # (a meshplan.trace.rescale.Rescaling logs which counts it rewrote)
    rescaling = getattr(retrace, "__wrapped__", retrace)
    logged = len(getattr(rescaling, "log", ()))
    regraphed = [0]

    # the fewest stages a plan may have, and the host's floor under a count's
    # plans of so many (cost_model.pipeline.least_host_s)
    least = opts.fixed[2] if opts.fixed else opts.num_stages or 1
    programs = stage_program_counts(graph)

    def floor(B: int, stages: int) -> float:
        return least_host_s(B, cluster.device.achieved.pipeline_program_s, stages,
                            cluster.num_hosts, programs)

    memo = {} if layered_memo is None else layered_memo
    # (the layers depend on neither the input filter nor the counts asked)
    memo_opts = replace(opts, input_filter=None, num_micro_batches=None)

    def layered(B: int) -> LayerProblems | TraceError:
        if (B, memo_opts) not in memo:
            memo[B, memo_opts] = _layered(B)
        return memo[B, memo_opts]

    def _layered(B: int) -> LayerProblems | TraceError:
        t0 = time.perf_counter()
        try:
            if B > 1:
                regraphed[0] += 1
            g = graph if B == 1 else retrace(B).kept_like(graph)  # type: ignore[misc]
        except TraceError as e:
            # (kept for later: without its traceback, whose frames would hold
            # this search's graphs in a reference cycle until a full collection)
            return e.with_traceback(None)
        finally:
            search.trace_s += time.perf_counter() - t0
        why = batch_shaped_draws(graph, g) if B > 1 else None
        if why:     # (never plan what the runtime would refuse)
            return TraceError(why)
        return layer_problems(g, B, cluster, opts, batch_dims_between(graph, g, B),
                              session.analyses)

    try:
        while todo:
            B = todo.pop(0)
            searched.append(B)
            if counts is None and floor(B, least) >= floor_s:
                floored.append(B)
                continue
            bound = math.inf
            try:
                with session.progress.step(f"pipeline search with {B} micro-batch(es) "
                                           f"(layer ILPs and stage DP)"):
                    lay = ahead.pop(B) if B in ahead else layered(B)
                    if isinstance(lay, TraceError):
                        raise lay
                    if counts is None and least == 1 and floor(B, 2) >= floor_s:
                        lay = _one_stage(lay, cluster)   # (more lose to the floor)
                    pending = search.submit(lay.requests())
                    if pending is not None and todo and todo[0] not in ahead:
                        # trace the next count while the workers solve this one's ILPs
                        ahead[todo[0]] = layered(todo[0])
                    search.collect(pending)
                    p = None
                    # (a count with no relaxed plan has none at all: searched,
                    # its error names why and prunes as any count that fits
                    # nothing)
                    bound, fitting = _relaxed(lay, cluster, opts, search) \
                        if bounding else (math.inf, None)
                    if best is not None and best[0] <= bound < math.inf:
                        # even with memory to spare no plan of this count
                        # beats the best: its capped ILPs are not solved
                        bounded.append(B)
                    elif fitting is not None:
                        # its relaxed plan fits as it is: no plan of the
                        # count is faster, nor needs its capped ILPs
                        p = pipeline_plan(graph, fitting[1].lay, *fitting, cluster, method_name)
                        relaxed_fit.append(B)
                    else:
                        p = _plan_for(graph, lay, cluster, opts, search, method_name)
                    if counts is not None:
                        counts.add(graph, lay, cluster, opts, search, method_name)
                if p is not None and (best is None or p.predicted.iteration_s < best[0]):
                    best = (p.predicted.iteration_s, p)
            except InfeasiblePlanError as e:
                errors[B] = str(e)
                if isinstance(e, StageMemoryError) and e.stage is not None:
                    unfit[B] = e.with_traceback(None)     # (as in _layered)
                    squeezed[B] = bound if bounding else _relaxed(lay, cluster, opts, search)[0]
                # (only a power of two prunes, as before the other divisors
                # were searched: 48 of 1536 may fit nothing where 32, whose
                # micro-batches more replicas divide, does)
                more = [b for b in searched if b > B and b not in untraceable and _pow2(b)]
                if opts.prune_micro_batches and _pow2(B) and (best is not None or not more):
                    todo.clear()     # fewer micro-batches fit no better
            except TraceError as e:
                if B == 1:
                    raise
                # the step cannot run at this micro-batch size (e.g. MoE token
                # groups larger than a micro-batch): fewer, larger ones may
                errors[B] = f"the step does not trace with {B} micro-batches: {e}"
                untraceable.add(B)
                continue
            top = max(b for b in searched if _pow2(b)) if any(map(_pow2, searched)) \
                else max(searched)
            if (best is None and not todo and opts.num_micro_batches is None
                    and retrace is not None and top not in untraceable and batch % (2 * top) == 0):
                # nothing fits yet: smaller micro-batches, down to one example
                # (and the other divisors up to it, the most first)
                todo += [b for b in range(2 * top, max(searched), -1) if batch % b == 0]
            elif (best is not None and not todo and opts.num_micro_batches is None
                    and retrace is not None and best[1].num_micro_batches == max(searched)):
                # the most micro-batches searched won: the bubble may still
                # shrink, so the divisors up to twice as many (a hand plan of
                # gpt-39b on 64 GPUs uses 128 of 1024, where the cap stops at 64)
                todo += [b for b in range(min(batch, 2 * max(searched)), max(searched), -1)
                         if batch % b == 0]
    except BaseException:        # Ctrl-C included: no worker may outlive the search
        search.close(abort=True)
        raise
    search.close()
    if best is None:
        raise _no_plan(errors, untraceable, cluster, opts, unfit)
    plan = best[1]
    # (the warning is the planner's, once a plan: meshplan.planning.plan_step)
    plan = replace(plan, notes=plan.notes + tuple(n for n in scan_notes(graph) if n))
    # (no wall-clock time in the plan: the same inputs give byte-identical JSON)
    # (what this search needed, not what an earlier one left in the cache:
    # the plan must not depend on the process's history)
    if search.time_limit_hit():
        plan = replace(plan, ilp_time_limit_hit=True)
    note = (f"inter-operator search: {len(searched)} micro-batch count(s), {len(search.used)} distinct "
            f"layer ILPs")
    if bounded:
        note += (f"; {len(bounded)} count(s) passed over, as even with memory to spare they "
                 f"plan no faster ({', '.join(map(str, sorted(bounded)))})")
    if floored:
        note += (f"; {len(floored)} count(s) passed over, as the host's dispatch of their "
                 f"programs alone takes longer than one program's step "
                 f"({', '.join(map(str, sorted(floored)))})")
    if relaxed_fit:
        note += (f"; {len(relaxed_fit)} count(s) planned by the relaxed search alone, its plan "
                 f"fitting as it was ({', '.join(map(str, sorted(relaxed_fit)))})")
    session.progress.note(f"{search.solves} layer ILPs solved, {search.hits} layer costs "
                          "from the cache")
    stats = search.stats(len(searched))
    rewritten, _, rewrite_s = (rescaling.counts(logged) if hasattr(rescaling, "counts")
                               else (0, 0, 0.0))
    stats = replace(stats, rewritten=rewritten, retraced=regraphed[0] - rewritten,
                    rewrite_s=rewrite_s, bounded=len(bounded) + len(floored),
                    relaxed_fit=len(relaxed_fit),
                    squeezed=tuple(sorted(b for b, t in squeezed.items() if t < best[0])))
    if counts is not None:
        stats = replace(stats, stage_counts=counts.bests())
    return replace(plan, notes=plan.notes + (note,)), stats


def _one_stage(lay: LayerProblems, cluster: ClusterSpec) -> LayerProblems:
    """``lay`` searched for plans of one stage, on every device, alone."""
    whole = [m for m, s in enumerate(lay.submeshes) if s.size == cluster.num_devices]
    return replace(lay, submeshes=[lay.submeshes[m] for m in whole],
                   meshes_of=[lay.meshes_of[m] for m in whole], max_stages=1, many_stages=())


class _StageCounts:
    """[explain] The best plan per number of stages over the micro-batch
    counts searched: the stage DP re-run with the number of stages fixed, on
    the layer costs the search already has (no new layer ILP)."""

    def __init__(self) -> None:
        self.best: dict[int, Plan] = {}
        self.why: dict[int, str] = {}

    def add(self, graph: Graph, lay: LayerProblems, cluster: ClusterSpec,
            opts: PipelineOptions, solver: LayerSolver, method: str) -> None:
        k = 1
        while k <= min(len(lay.groups), cluster.num_devices):
            try:
                choice, costs = best_pipeline(replace(lay, min_stages=k, max_stages=k), cluster,
                                              opts, solver)
            except InfeasiblePlanError as e:
                # (the most micro-batches, searched first, need the least memory)
                self.why.setdefault(k, str(e))
            else:
                old = self.best.get(k)
                if old is None or choice.total_s < old.predicted.iteration_s:
                    self.best[k] = pipeline_plan(graph, costs.lay, choice, costs, cluster,
                                                 method)
            k *= 2

    def bests(self) -> tuple[StageCountBest, ...]:
        return tuple(StageCountBest(k, self.best.get(k), "" if k in self.best else self.why[k])
                     for k in sorted(self.best.keys() | self.why.keys()))


def _no_plan(errors: dict[int, str], untraceable: set[int], cluster: ClusterSpec,
             opts: PipelineOptions, unfit: dict[int, StageMemoryError] | None = None
             ) -> InfeasiblePlanError:
    """Why no micro-batch count has a plan: why the most micro-batches that
    traced (the least memory) fit nothing, then why the fewest micro-batches
    that did not trace failed."""
    unfit = unfit or {}
    traced = [b for b in errors if b not in untraceable]
    why = [errors[max(traced)]] if traced else []
    why += [errors[min(untraceable)]] if untraceable else []
    if not traced and untraceable:
        return InfeasiblePlanError(f"no number of micro-batches can be planned ({'; '.join(why)})")
    budget = int(cluster.device.memory_bytes * opts.memory_fraction)
    # the stage closest to fitting, over every micro-batch count tried
    closest = min(unfit.values(), key=lambda e: e.stage.memory.total, default=None)
    need = None if closest is None else closest.stage.memory.total
    if opts.fixed is not None:         # one configuration was tried, not a search
        dp, tp, pp = opts.fixed
        mb = ", ".join(str(b) for b in sorted(errors))
        remat = {None: "where needed", True: "in every stage", False: "nowhere",
                 "selective": "selective in every stage"}[opts.remat]
        last = unfit.get(max(traced)) if traced else None
        cause = last.detail if last is not None else f"({'; '.join(why)})"
        return InfeasiblePlanError(
            f"Manual(dp={dp}, tp={tp}, pp={pp}) with {mb} micro-batch(es) and recomputation "
            f"{remat} does not fit the devices' memory: {cause}; {_what_to_change(opts, last)}",
            budget_bytes=budget, needed_bytes=need)
    over = ("" if closest is None else
            f"; the closest stage is {human_bytes(need - budget)} over the "
            f"{human_bytes(budget)} budget")
    return InfeasiblePlanError(
        "no pipeline plan fits the devices' memory with any number of stages, micro-batches "
        f"or remat ({'; '.join(why) or 'no candidates'}){over}; use more devices or a "
        "cluster with more memory per device", budget_bytes=budget, needed_bytes=need)


def _what_to_change(opts: PipelineOptions, err: StageMemoryError | None) -> str:
    """What may make a Manual configuration fit, the likeliest first, from
    what its stage closest to fitting holds (``err``; None: unknown)."""
    hints = []
    if opts.remat is False:
        hints.append("recomputation is off (--remat none / remat='none'): allow it")
    elif opts.remat == "selective":
        hints.append("recomputation is selective (--remat selective): allow full recomputation")
    if err is None:
        hints.append("use more micro-batches, more tensor or pipeline parallelism, or devices "
                     "with more memory")
        return "; ".join(hints)
    m, over = err.stage.memory, err.stage.memory.total - (err.budget_bytes or 0)
    state = m.params + m.grads + m.optimizer
    if m.activations + m.temporaries >= over:
        hints.append("use more micro-batches (smaller ones keep less in flight)")
    hints.append(f"split the parameters, gradients and optimizer state ({human_bytes(state)}) "
                 "further: more tensor or pipeline parallelism (--tp/--pp), or ZeRO-style "
                 "sharding (--method shard / auto)")
    hints.append("or use devices with more memory")
    return "; ".join(hints)


def _relaxed(lay: LayerProblems, cluster: ClusterSpec, opts: PipelineOptions,
             solver: LayerSolver) -> tuple[float, tuple[PipelineChoice, StageCosts] | None]:
    """The iteration time of ``lay``'s count if memory bound no stage (its
    layers' uncapped plans, no recomputation needed), and that pipeline with
    the costs it was priced with where every stage of it fits all the same
    (else None).  A cap or recomputation only slows a layer down, so no plan
    of the count should be faster; what a stage hides under compute and the
    gradients it sums are not monotone in its layers' plans, so that is
    checked (``tests/test_count_bound.py`` per count on random cases;
    ``benchmarks/planning_time.py --check-pruning`` against the exhaustive
    search), not proven."""
    try:
        choice, costs = best_pipeline(lay, cluster, opts, solver, relaxed=True)
    except InfeasiblePlanError:
        return math.inf, None
    # (interleaved chunks are checked together, not stage by stage: not taken)
    fits = choice.chunks == 1 and all(o.memory_bytes <= costs.lay.budget for o in choice.chosen())
    return choice.total_s, ((choice, costs) if fits else None)


def _plan_for(full: Graph, lay: LayerProblems, cluster: ClusterSpec, opts: PipelineOptions,
              solver: LayerSolver, method: str) -> Plan:
    """The best plan with ``lay``'s micro-batch count (InfeasiblePlanError: none fits)."""
    choice, costs = best_pipeline(lay, cluster, opts, solver)
    return pipeline_plan(full, costs.lay, choice, costs, cluster, method)


def _scanned_layers(graph: Graph) -> str | None:
    """What to tell a user whose layers run inside one ``lax.scan`` over
    stacked parameters (:func:`scan_notes`' warning)."""
    return scan_notes(graph)[0]


def scan_notes(graph: Graph) -> tuple[str | None, str | None]:
    """``(warning, note)``: what a pipeline plan of ``graph`` says of the
    scans that read its parameters, where they hold most of its FLOPs.  The
    search cannot cut inside a scan.  A scan over stacked parameters gets the
    warning (``meshplan.plan`` and ``parallelize`` unroll one that iterates
    over stacked arguments first, :mod:`meshplan.trace.unstack`; this remains
    for other scans and graphs traced as they are); loops that read the same
    parameters in every iteration (a recurrence over time, a loop over
    micro-batches written in the step) get a note: nothing to change."""
    params = {i.tensor for i in graph.inputs if i.role == PARAM}
    stacked: list[Node] = []
    reused: list[Node] = []
    # (the forward scan and its transpose in the backward pass both read them)
    for n in graph.nodes:
        if n.primitive != "scan" or n.repeat <= 1:
            continue
        if stacked_scan_inputs(graph, n):
            stacked.append(n)
        elif params & set(n.inputs):
            reused.append(n)
    total = graph.total_flops or 1.0
    warning = note = None
    share = sum(n.flops for n in stacked) / total
    if share >= 0.5:
        warning = (f"{share:.0%} of the step's FLOPs run inside lax.scan over {stacked[0].repeat} "
                   "stacked layers, which the pipeline search treats as one layer each (stages "
                   "cannot split a scan); meshplan.plan unrolls a scan only when it iterates over "
                   "stacked arguments of the step: stack the layers' parameters as arguments, or "
                   "loop over the blocks in Python")
    share = sum(n.flops for n in reused) / total
    if share >= 0.5:
        lengths = "/".join(map(str, sorted({n.repeat for n in reused})))
        note = (f"{share:.0%} of the step's FLOPs run inside lax.scan loops of {lengths} "
                "iterations that read the same parameters in every iteration (a recurrence, or a "
                "loop over micro-batches written in the step): the pipeline search keeps each "
                "loop whole in one stage (a loop over micro-batches can be left to meshplan: "
                "num_micro_batches)")
    return warning, note
