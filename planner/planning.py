"""Planning, one path for the API and the CLI.

``plan_function`` traces a step (unrolling a ``lax.scan`` over stacked layers,
:mod:`meshplan.trace.unstack`), then ``plan_step`` runs what the method's request
(:mod:`meshplan.request`) asks: the whole-graph ILP for one stage, or the
inter-operator search.  Both take a :class:`~meshplan.dp_search.Session`
(progress, layer-cost cache, worker count), made at the edge.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

import jax

from .cluster import ClusterSpec
from .collector import with_relaxed_gc
from .cost_model.pipeline import host_binds, least_host_s
from .dp_search.assemble import argument_table
from .dp_search.search import batch_leaves
from .dp_search.stage_dp import IDLE_SHARE
from .dp_search import (PipelineOptions, SearchStats, Session, batch_size,
                        micro_batch_candidates, search_pipeline, warn_of_scans)
from .errors import InfeasiblePlanError, MeshplanError, batch_rows, warn
from .explain import ONE_STAGE_NOTE, alternatives
from .offload import frees_memory, not_fitting, offloaded_bytes
from .ilp.replicated import REPLICATED_NOTE
from .one_stage import check_batch_divisible, plan_one_stage
from .graph import IDENTITY_MARKERS, OPT_STATE, PARAM, Graph, cast_origin, stage_program_counts
from .methods import Manual, Method
from .plan import Plan
from .ilp import EachMicroBatch, SequenceSplit
from .recompute import NONE
from .request import PlanRequest
from .trace import issue_warnings, trace_both
from .trace.tracer import trace_micro
from .traced import TracedStep, signature
from .trace.rescale import Rescaling
from .trace.unstack import Unstacked, layer_counts, unstack_scanned_layers


@dataclass(frozen=True)
class Planned:
    """A plan and how it was found (``search``: the inter-operator search's
    figures; None when only the whole-graph ILP ran)."""
    plan: Plan
    search: SearchStats | None = None


@dataclass(frozen=True)
class TracedFunction:
    """A step traced for planning: its Graph, the step and arguments that
    were traced (with a scan over stacked layers, its per-layer rewrite), and
    the same trace as the runtime takes it for a one-stage plan (``run``)."""
    graph: Graph
    step: Callable
    args: tuple[Any, ...]
    batch_argnums: tuple[int, ...]
    name: str
    run: TracedStep
    unstacked: Unstacked | None = None

    @functools.cached_property
    def retrace(self) -> Rescaling:
        """``retrace(B)``: the step's Graph with its batch split into ``B``
        micro-batches, rewritten from ``graph`` where that is proven exact,
        traced where not (:mod:`meshplan.trace.rescale`)."""
        return retracer(self.step, self.args, self.batch_argnums, self.name, graph=self.graph)


def trace_function(fn: Callable, abstract: Sequence[Any], batch_argnums: tuple[int, ...],
                   name: str, session: Session) -> TracedFunction:
    """Trace ``fn`` for planning.  When a ``lax.scan`` iterates over stacked
    parameters, the step planned (and run) is its rewrite with one input per
    layer (:mod:`meshplan.trace.unstack`).  The session keeps the trace: the
    same function at the same argument shapes is not traced again (nor, by
    the kept :attr:`TracedFunction.retrace`, at a micro-batch size it was)."""
    # (the configuration a trace reads: precision, x64, the default PRNG)
    config = tuple(str(getattr(jax.config, k, None)) for k in
                   ("jax_default_matmul_precision", "jax_enable_x64", "jax_default_prng_impl"))
    key = (fn, signature(tuple(abstract), weak_types=True), tuple(batch_argnums), name, config)
    try:
        hit = session.traces.get(key)
    except TypeError:       # (an unhashable callable: traced each time)
        return _trace_function(fn, abstract, batch_argnums, name, session)
    if hit is None:
        hit = session.traces[key] = _trace_function(fn, abstract, batch_argnums, name, session)
    else:
        issue_warnings(hit.graph)
    return hit


def _trace_function(fn: Callable, abstract: Sequence[Any], batch_argnums: tuple[int, ...],
                    name: str, session: Session) -> TracedFunction:
    with session.progress.step(f"tracing {name}"):
        graph, run = trace_both(fn, *abstract, batch_argnums=batch_argnums, name=name)
    issue_warnings(graph)       # (once: the retraces per micro-batch count stay silent)
    unstacked = unstack_scanned_layers(graph, fn, abstract)
    if unstacked is None:
        return TracedFunction(graph, fn, tuple(abstract), batch_argnums, name, run)
    step_args = unstacked.split(abstract)
    with session.progress.step(f"unrolling the lax.scan over {layer_counts(unstacked.shapes)} "
                               "stacked layers"):
        graph, run = trace_both(unstacked.fn, *step_args, batch_argnums=batch_argnums, name=name)
    return TracedFunction(graph, unstacked.fn, step_args, batch_argnums, name, run, unstacked)


def plan_function(traced: TracedFunction, cluster: ClusterSpec, method: Method,
                  session: Session, *, explain: bool = False,
                  donated: Sequence[int] | None = None) -> Planned:
    """Plan a traced step; the plan notes a scan rewrite.  ``explain``: see
    :func:`plan_step`.  ``donated``: the argument positions the step runs
    donated (None: every argument it updates); an updated argument the
    caller keeps needs a buffer for its new value beside the old one
    (``Graph.undonated``), as jax.jit allocates it."""
    graph = traced.graph
    if donated is not None:
        # (the session's trace and retracer stay shared: only this plan's Graph)
        graph = replace(graph, undonated=frozenset(
            k for k, i in enumerate(graph.inputs) if i.argnum not in donated))
    planned = plan_step(graph, cluster, method, retrace=traced.retrace, session=session,
                        explain=explain)
    u = traced.unstacked
    if u is None or u.note in planned.plan.notes:
        return planned
    return replace(planned, plan=replace(planned.plan, notes=planned.plan.notes + (u.note,)))


def kept_hint(err: InfeasiblePlanError, graph: Graph) -> InfeasiblePlanError:
    """``err`` saying how donation would help, where memory is what does
    not fit (a budget is named) and the step keeps state the caller did not
    donate (its new value then needs memory of its own)."""
    kept = sorted({graph.inputs[o.updates].argnum for o in graph.outputs
                   if o.tensor in graph.kept_updates})
    if not kept or err.budget_bytes is None:
        return err
    # (with those donated already: naming the kept alone would undo them)
    updated = sorted({graph.inputs[o.updates].argnum for o in graph.outputs
                      if o.updates is not None})
    return InfeasiblePlanError(
        f"{err} (the new value of argument(s) {kept} is held beside the old one: they are not "
        f"donated; donate_argnums={tuple(updated)!r} lets the step update them in place, as "
        "jax.jit does)", budget_bytes=err.budget_bytes, needed_bytes=err.needed_bytes)


def retracer(fn: Callable, abstract: Sequence[Any], batch_argnums: tuple[int, ...],
             name: str, graph: Graph | None = None) -> Callable[[int], Graph]:
    """``retrace(B)``: the step traced with its batch split into ``B`` micro-batches.
    With ``graph`` (the step traced at full batch), a :class:`Rescaling`:
    the Graph is rewritten from it where that is proven exact."""
    # (the very trace the pipeline runtime runs: trace_for_run; where it
    # differs from a rewrite, e.g. gradients found without markers, the
    # rewrite's probe sees it and every count is traced)
    def retrace(B: int) -> Graph:
        return trace_micro(fn, abstract, B, batch_argnums, name)
    return retrace if graph is None else Rescaling(graph, retrace)


@with_relaxed_gc
def plan_step(graph: Graph, cluster: ClusterSpec, method: Method, *,
              retrace: Callable[[int], Graph] | None = None,
              session: Session | None = None, explain: bool = False) -> Planned:
    """Plan a traced step: the method's request run by the passes.
    ``retrace(B)`` lets the pipeline search re-trace the step for B micro-batches.
    ``explain``: the plan also records the alternatives it was chosen over
    (``Plan.alternatives``, :mod:`meshplan.explain`); the plan is the same."""
    lower = getattr(method, "request", None)
    if lower is None:
        raise MeshplanError(f"unknown method {method!r}: use meshplan.Auto(), ShardParallel(), "
                            "PipeshardParallel(), DataParallel() or Manual(dp=, tp=, pp=)")
    request: PlanRequest = lower(cluster.num_devices)
    session = session or Session.from_env()
    if explain and retrace is not None:
        # (the alternatives re-trace the same micro-batch sizes)
        retrace = functools.lru_cache(maxsize=None)(retrace)
    try:
        planned = _plan_request(graph, cluster, request, retrace, session, explain)
    except InfeasiblePlanError as e:
        raise kept_hint(e, graph) from None
    planned = replace(planned, plan=replace(planned.plan, arguments=argument_table(graph)))
    if explain:
        alts = alternatives(graph, cluster, planned.plan, planned.search, request,
                            retrace=retrace, session=session)
        planned = replace(planned, plan=replace(planned.plan, alternatives=alts))
    # (once a plan, however many searches ran)
    warn_of_scans(graph, planned.plan)
    one_program = request.pipeline is None or any(
        n.startswith(NO_BATCH_NOTE) for n in planned.plan.notes)
    if one_program and (why := disagreeing_batch(graph)):
        # (a one-stage plan splits no batch by itself; the methods that do
        # refuse this, and Auto plans one program, noted, and says so here)
        warn(f"meshplan: planned as given, but {why}")
    idle = (idle_stages(planned.plan, graph) if request.pipeline and request.pipeline.num_stages
            else None)
    if idle:
        warn(f"meshplan: {idle}")
        planned = replace(planned, plan=replace(planned.plan, notes=planned.plan.notes + (idle,)))
    # (a fingerprint names the Graph's content: plans of one step ask once)
    why = session.replicated.get(graph.fingerprint)
    if why is None:
        why = replicated_work(graph) or ""
        if graph.fingerprint:
            session.replicated[graph.fingerprint] = why
    if not why:
        return planned
    warn(f"meshplan: {why}")
    p = planned.plan
    return replace(planned, plan=replace(p, notes=p.notes + (why,)))


REPLICATED_SHARE = 0.02     # replicated work worth a word: this share of FLOPs or bytes


def idle_stages(plan: Plan, graph: Graph) -> str | None:
    """A word on the stages of a plan with a fixed number of them (virtual
    stages of an interleaved schedule among them) that hold less than
    ``IDLE_SHARE`` of an even share of the step's FLOPs (a small step cut
    into more stages than it has work for), else None.  FLOPs, as the stage
    search balances them: a predicted time counts each kernel's launch, so a
    stage of a few tiny kernels would pass for a working one."""
    if len(plan.stages) < 2:
        return None
    work = _stage_flops(plan, graph) or [s.predicted.compute_s for s in plan.stages]
    even = sum(work) / len(work)
    idle = [k for k, x in enumerate(work) if x < IDLE_SHARE * even]
    if not idle:
        return None
    share = min(work[k] for k in idle) / even
    what = "stage" if plan.chunks == 1 else "virtual stage"
    asked = (f"{len(work)} stages" if plan.chunks == 1 else
             f"{len(work) // plan.chunks} stages of {plan.chunks} chunks ({len(work)} virtual "
             "stages)")
    which = (f"{what} {idle[0]} computes {share:.0%} of an even share while its devices wait"
             if len(idle) == 1 else
             f"{what}s {', '.join(str(k) for k in idle)} compute as little as {share:.0%} of an "
             "even share while their devices wait")
    return (f"{asked} were asked for, but the step's work does not cut into that "
            f"many: {which}; fewer stages (or a searched count) would put those devices to use"
            + _in_loops(graph))


def _in_loops(graph: Graph) -> str:
    """Why the work did not cut, where most of it sits in loops that index
    stacked layers' parameters (a fori_loop over ``params[i]``): a loop
    runs whole in one layer, where a lax.scan over the stack is unrolled
    into layers before planning."""
    total = graph.total_flops or 1.0
    share = sum(n.flops for n in graph.nodes if n.primitive in ("scan", "while")) / total
    # (the backward's loop reads the forward's residuals, not the stack)
    if share < 0.5 or not any(_indexes_stacked(graph, n) for n in graph.nodes):
        return ""
    return (f"; {share:.0%} of its FLOPs run inside lax loops over stacked layers, each of which "
            "runs whole in one stage: such a loop is cut into stages when written as "
            "lax.scan(body, carry, stacked_params), not as a fori_loop or scan that indexes "
            "them (params[i])")


def _indexes_stacked(graph: Graph, node) -> bool:
    """Whether loop ``node`` reads an argument leaf (no batch) as stacked
    along its trip count."""
    if node.primitive not in ("scan", "while") or node.repeat <= 1:
        return False
    stacked = {i.tensor for i in graph.inputs if i.argnum not in graph.batch_argnums
               and graph.tensors[i.tensor].shape[:1] == (node.repeat,)}
    return any(cast_origin(graph, t) in stacked for t in node.inputs)


def _stage_flops(plan: Plan, graph: Graph) -> list[float] | None:
    """Each stage's FLOPs, by the layer of every operation (None where the
    plan does not say it for this graph's operations)."""
    if len(plan.layer_of_node) != len(graph.nodes):
        return None
    stage_of = {layer: k for k, s in enumerate(plan.stages)
                for layer in range(s.layers[0], s.layers[1] + 1)}
    work = [0.0] * len(plan.stages)
    for node, layer in zip(graph.nodes, plan.layer_of_node):
        if layer in stage_of:
            work[stage_of[layer]] += node.flops
    return work if sum(work) else None


def disagreeing_batch(graph: Graph) -> str | None:
    """Why the batch arguments' leaves hold no one batch (dimension 0 of
    several sizes: most often ``batch_argnums`` naming the parameters), or
    None."""
    try:
        batch_rows(batch_leaves(graph))
    except MeshplanError as e:
        return str(e)
    return None


def replicated_work(graph: Graph) -> str | None:
    """What the plan must run replicated because no sharding rule covers it
    (control flow, primitives without a rule), when it is more than a few
    percent of the step's FLOPs or of the bytes its operations make; None if not."""
    from .ilp.strategies import node_space
    total_flops = graph.total_flops or 1.0
    total_bytes = sum(graph.tensors[t].nbytes for n in graph.nodes for t in n.outputs) or 1.0
    by: dict[str, list[float]] = {}
    # (an operator's space depends on its primitive, shapes and params alone:
    # a model's repeated blocks ask the same few hundred)
    ruled: dict[tuple, bool] = {}
    for n in graph.nodes:
        if n.primitive in IDENTITY_MARKERS or n.primitive in ("sharding_constraint", "shard_map") \
                or not any(graph.tensors[t].shape for t in n.outputs):
            # (markers change nothing; the step's own constraints and shard_maps
            # keep their layouts, as written; scalars have nothing to split)
            continue
        key = (n.primitive, tuple(graph.tensors[t].shape for t in n.inputs),
               tuple(graph.tensors[t].shape for t in n.outputs), n.params)
        if key not in ruled:
            ruled[key] = node_space(graph, n) is not None
        if not ruled[key]:
            f, b = by.setdefault(n.primitive, [0.0, 0.0])
            by[n.primitive] = [f + n.flops, b + sum(graph.tensors[t].nbytes for t in n.outputs)]
    flops = sum(f for f, _ in by.values()) / total_flops
    nbytes = sum(b for _, b in by.values()) / total_bytes
    if max(flops, nbytes) < REPLICATED_SHARE:
        return None
    def weight(fb: list[float]) -> float:
        return max(fb[0] / total_flops, fb[1] / total_bytes)
    top = sorted(by.items(), key=lambda kv: -weight(kv[1]))
    # (each with both shares, as either may be why it is named; those that
    # weigh nothing, e.g. a top_k on a few logits, are left out)
    named = [kv for kv in top[:4] if weight(kv[1]) >= 0.005] or top[:1]
    parts = ", ".join(f"{k} ({f / total_flops:.0%} of FLOPs, {b / total_bytes:.0%} of bytes: "
                      f"{b / 2**20:.1f} MiB)" for k, (f, b) in named)
    return (f"{flops:.0%} of the step's FLOPs and {nbytes:.0%} of the bytes its operations make "
            f"run replicated on every device, in operations with no sharding rule: {parts}")


def _plan_request(graph: Graph, cluster: ClusterSpec, request: PlanRequest,
                  retrace: Callable[[int], Graph] | None, session: Session,
                  explain: bool = False) -> Planned:
    """The passes the request asks for (``explain``: the search also keeps its
    best plan per number of stages)."""
    if request.pipeline is None:
        return Planned(plan_one_stage(graph, cluster, request, session))
    opts = request.pipeline
    stages = opts.fixed[2] if opts.fixed else opts.num_stages or 1
    if stages > 1 and any(n.primitive == "shard_map" for n in graph.nodes):
        raise MeshplanError(
            f"the step runs a jax.shard_map on a mesh of its own, which the {stages} stages of a "
            "pipeline, each on a submesh, cannot run; plan one stage (ShardParallel(), Auto(), "
            "Manual(pp=1)), or drop the shard_map")
    if request.batch_split > 1:     # (Manual's data-parallel degree, each micro-batch split so)
        check_batch_divisible(graph, request.batch_split, request.batch_split_by,
                              request.pipeline.num_micro_batches[0])
    if request.offload == "optimizer":
        # (offloading is planned for one stage: the whole-graph ILP's path)
        return Planned(plan_one_stage(graph, cluster, replace(request, pipeline=None), session))
    if request.one_stage_by_whole_graph:
        try:
            batch_size(graph)
        except MeshplanError as e:
            # no one batch to cut into micro-batches (a graph's nodes beside
            # its edges): one program, as ShardParallel plans it
            p = plan_one_stage(graph, cluster, replace(request, pipeline=None), session)
            return Planned(replace(p, notes=p.notes + (
                f"{NO_BATCH_NOTE} ({' '.join(str(e).split())})",)))
    # Where a host hands a pipeline's programs over one by one (CPU devices,
    # a calibrated cluster), the one program's plan comes first: its step is
    # a floor that the host's dispatch alone keeps most counts above, and
    # those are not searched (a tiny step planned in seconds, not a minute)
    whole: Plan | None = None
    floor = math.inf
    if request.one_stage_by_whole_graph and _host_may_bind(graph, cluster):
        try:
            whole = plan_one_stage(graph, cluster, replace(request, pipeline=None), session)
            floor = whole.predicted.iteration_s
        except InfeasiblePlanError:
            pass
    try:
        p, stats = _searched(graph, cluster, request, retrace, session, explain, floor)
    except InfeasiblePlanError as e:
        if whole is not None:       # (it fits: the counts the floor left fit nothing)
            return Planned(replace(whole, notes=whole.notes + (ONE_STAGE_NOTE,)))
        # no plan fits: one stage with the optimizer state in host memory may
        if request.offload != "auto" or not frees_memory(cluster) or not offloaded_bytes(graph):
            raise
        try:
            return Planned(plan_one_stage(graph, cluster,
                                          replace(request, pipeline=None, offload="optimizer"),
                                          session))
        except InfeasiblePlanError:
            raise not_fitting(e, cluster) from None
    host_bound = host_binds(p.predicted.iteration_s, p.predicted.host_s)
    if request.one_stage_by_whole_graph and (len(p.stages) == 1 or p.num_micro_batches == 1
                                             or host_bound):
        # one stage: the whole-graph ILP is more exact than the sum of layer
        # costs; it is kept where it is no slower (so that Auto never predicts
        # a plan slower than one it found, or than a Manual one of the search).
        # Stages of one micro-batch run one after the other, and a pipeline
        # the host's time per program bounds may lose to one program: the
        # whole-graph plan on every device (ShardParallel's) is compared
        # with them too.  (Not with every pipeline: with that, Auto on
        # gpt-350m (batch 64, 32 V100s) ran whole-graph ILPs to their time
        # limits and past 15 minutes, against 50 s.  A pipeline slower than
        # one program meets it here through the one-program hand plans
        # that _searched prices: tests/test_auto_contains_manual.py)
        try:
            s = whole or plan_one_stage(graph, cluster, replace(request, pipeline=None), session)
        except InfeasiblePlanError:
            return Planned(p, stats)
        if s.predicted.iteration_s <= p.predicted.iteration_s:
            # (the whole-graph ILP lays out every value itself: not as a hand
            # plan, and on a mesh of its own)
            searched = tuple(n for n in p.notes if n != HAND_MADE_NOTE
                             and not n.startswith(REPLICATED_NOTE))
            return Planned(replace(s, notes=s.notes + searched + (ONE_STAGE_NOTE,),
                                   ilp_time_limit_hit=s.ilp_time_limit_hit
                                   or p.ilp_time_limit_hit), stats)
    return Planned(p, stats)


def _host_may_bind(graph: Graph, cluster: ClusterSpec) -> bool:
    """Whether the host's dispatch could keep a pipeline of the most
    micro-batches (one example each) above the step at peak speed on every
    device, a floor under any plan: else no count is passed over by it, and
    the one program (a long whole-graph ILP for a large step) is not planned
    ahead for nothing."""
    per_program = cluster.device.achieved.pipeline_program_s
    if per_program <= 0:
        return False
    peak = max(dict(cluster.device.peak_flops).values(), default=0.0)
    ideal = graph.total_flops / (cluster.num_devices * peak) if peak > 0 else 0.0
    return ideal < least_host_s(batch_size(graph), per_program,
                                programs=stage_program_counts(graph))


NO_BATCH_NOTE = ("planned as one program, without pipeline stages or micro-batches: the "
                 "step's batch arguments hold no one batch to split")


# why the search's later passes ran: memory, or the method's own recomputation
BINDS, ASKED = "memory binds", "the method recomputes"

EACH_MICRO_BATCH_NOTE = (
    f"the data-parallel gradient sums are reduced every micro-batch, not once a step: {BINDS}, "
    "and running sums in the parameters' layout fit a faster plan than sums kept whole per "
    "data shard")


SEQUENCE_NOTE = (
    "the activations between layers are handed over split along the sequence (sequence "
    f"parallelism, found by the search): {BINDS}, and what recomputation keeps per "
    "micro-batch in flight fits a faster plan split")


def _searched(graph: Graph, cluster: ClusterSpec, request: PlanRequest,
              retrace: Callable[[int], Graph] | None, session: Session,
              explain: bool, floor_s: float = math.inf) -> tuple[Plan, SearchStats]:
    """The inter-operator search.  For a searched method where memory binds
    (no plan fits, a stage recomputes, or a count that fits nothing would
    plan faster with memory to spare), the search again with every
    gradient reduced each micro-batch (:class:`meshplan.ilp.EachMicroBatch`),
    and where it still binds, so and with the activations between layers
    split along the sequence (:class:`meshplan.ilp.SequenceSplit`): the fastest
    plan (the earlier pass's on a tie).  A hand-made method's layouts stay
    as they are.  ``floor_s``: the step of a plan in hand (search_pipeline)."""
    opts = request.pipeline
    layered: dict = {}      # (the passes cut each micro-batch count into the same layers)

    def run(o) -> tuple[Plan, SearchStats]:
        return search_pipeline(graph, cluster, o, method_name=request.method, retrace=retrace,
                               session=session, by_stage_count=explain, layered_memo=layered,
                               floor_s=floor_s)

    if opts.input_filter is not None or opts.fixed is not None:
        return run(opts)

    def why(note: str) -> str:
        # (ShardParallel(remat="full") recomputes with memory to spare)
        return note if opts.remat is None else note.replace(BINDS, ASKED)

    def eager(p: Plan) -> Plan:
        if p.num_micro_batches == 1:    # (a step's one reduction either way)
            return p
        return replace(p, notes=p.notes + (why(EACH_MICRO_BATCH_NOTE),),
                       reduce_grads_each_micro_batch=True)

    def split(p: Plan) -> Plan:
        p = eager(p)
        return replace(p, notes=p.notes + (why(SEQUENCE_NOTE),))

    passes = ((None, lambda p: p), (EachMicroBatch(), eager), (SequenceSplit(), split))
    if not SequenceSplit.applies(graph):
        passes = passes[:2]     # (no [batch, sequence, ...] values: a third searches the same)
    best: Plan | None = None
    summed: SearchStats | None = None
    # (an ILP of any plan compared stopped at its time limit: with more
    # time the choice might differ, so the plan says so whichever wins)
    hit = False
    counts: tuple = ()          # (the winning pass's plans per stage count)
    error: InfeasiblePlanError | None = None
    binds = True            # (no plan yet: nothing fit)
    scope = opts            # the later passes' micro-batch counts
    for i, (f, mark) in enumerate(passes):
        if not binds:
            break
        try:
            p, stats = run(replace(scope, input_filter=f))
        except InfeasiblePlanError as e:
            error = error or e
            continue
        hit |= p.ilp_time_limit_hit
        # (the figures sum every search run, whichever pass's plan wins)
        summed = stats if summed is None else summed.plus(stats)
        if best is None or p.predicted.iteration_s < best.predicted.iteration_s:
            best, counts = mark(p), stats.stage_counts
            if scope is not opts:   # (its search note counts only the counts searched again)
                best = replace(best, notes=best.notes + (
                    f"searched again with {', '.join(map(str, scope.num_micro_batches))} "
                    "micro-batch(es) alone: the first pass's layouts fit none of them, "
                    "although with memory to spare they plan faster than its plan",))
        # memory binds where a stage recomputes (every count is searched
        # again), or where it kept the search from counts that would plan
        # faster (those counts are: moe-10b on 16 V100s, whose 64
        # micro-batches fit nothing but fit faster than the 256 that won
        # with each micro-batch's gradients reduced)
        recomputes = any(s.recompute != NONE for s in best.stages)
        binds = recomputes or bool(stats.squeezed)
        if i == 0 and binds and not recomputes:
            scope = replace(opts, num_micro_batches=stats.squeezed)
    if best is None:
        assert error is not None
        raise error
    assert summed is not None
    # (the hand plans of one stage too, where the stage count is searched:
    # a pipeline of layers each planned on its own can lose to one stage
    # with Megatron's layouts)
    batch = batch_size(graph)
    stage_counts = sorted({len(best.stages)} | ({1} if opts.num_stages is None else set()))
    for o in (o for pp in stage_counts
              for o in hand_made_options(opts, cluster, batch, pp, best.num_micro_batches,
                                         best.schedule)
              if _holds_state(graph, cluster, request, o.fixed[1] * o.fixed[2])):
        try:
            p, stats = run(o)
        except MeshplanError:
            continue        # (does not fit, or cannot be cut so: not a candidate)
        summed = summed.plus(stats)
        best, hit = _taken(best, hit, p)
    if request.one_stage_by_whole_graph:
        for p in _one_program_hand_plans(graph, cluster, request, session, batch):
            best, hit = _taken(best, hit, p)
    if hit:
        best = replace(best, ilp_time_limit_hit=True)
    if summed.searches > 1:
        # (the plan's own search note counts only the search that made it)
        best = replace(best, notes=best.notes + (compared_note(summed),))
    return best, replace(summed, stage_counts=counts)


def _taken(best: Plan, hit: bool, hand: Plan) -> tuple[Plan, bool]:
    """The faster of ``best`` and the hand plan ``hand`` (noted as one), and
    whether an ILP of either stopped at its time limit."""
    if hand.predicted.iteration_s < best.predicted.iteration_s:
        best = replace(hand, notes=hand.notes + (HAND_MADE_NOTE,))
    return best, hit or hand.ilp_time_limit_hit


def compared_note(summed: SearchStats) -> str:
    """What every inter-operator search behind a plan needed, summed: the
    passes and the hand plans it was chosen among.  (Layer ILPs counted
    per search, as each search's own note counts them: deterministic, unlike
    the solves, which depend on what the session's cache held.)"""
    return (f"chosen among {summed.searches} inter-operator searches (the search's passes and "
            f"the hand plans), which needed {summed.distinct_layer_ilps} layer ILPs between them "
            f"(a layer ILP two searches share counts in both)")


def _one_program_hand_plans(graph: Graph, cluster: ClusterSpec, request: PlanRequest,
                            session: Session, batch: int) -> list[Plan]:
    """``Manual(dp, tp, 1, 1)``'s plans that fit, for each (dp, tp) of the
    devices that :func:`hand_made_options` allows: one program, its layouts
    chosen by the whole-graph ILP under Megatron's input layouts.  The
    search prices a stage as the sum of its layers, each planned on its own,
    which can overcharge one stage of one micro-batch (a 3-layer gpt on 2
    devices: 45.2 us by its layers, 35.1 us as one program)."""
    opts = request.pipeline
    if opts.num_stages not in (None, 1) or 1 not in (opts.num_micro_batches or (1,)):
        return []
    plans = []
    for o in hand_made_options(replace(opts, num_micro_batches=(1,)), cluster, batch, 1, 1,
                               "none"):
        dp, tp, _ = o.fixed
        if not _holds_state(graph, cluster, request, tp):
            continue
        # (Manual's own request, recorded under this method's name)
        one = replace(Manual(dp, tp, 1, 1, time_limit=request.time_limit,
                             backend=request.backend,
                             memory_fraction=request.memory_fraction).request(dp * tp),
                      method=request.method)
        try:
            plans.append(plan_one_stage(graph, cluster, one, session))
        except MeshplanError:
            continue        # (does not fit: not a candidate)
    return plans


def _holds_state(graph: Graph, cluster: ClusterSpec, request: PlanRequest, ways: int) -> bool:
    """Whether the parameters and optimizer state split ``ways`` ways fit a
    device's budget.  A hand plan splits them over its model axis and its
    stages alone, never over data, so one that fails this fits nothing and
    is passed over without its ILPs (Megatron-LM's 39.1B, 469 GB of
    parameters and Adam state, on 512 A100s: one stage of tp 4 would hold
    117 GB a device against a budget of 77 GB)."""
    state = graph.role_bytes(PARAM) + graph.role_bytes(OPT_STATE)
    return state / ways <= cluster.device.memory_bytes * request.memory_fraction


HAND_MADE_NOTE = (
    "each stage takes Megatron-style layouts (weights split over the model axis only, each "
    "micro-batch's rows over data), faster here than the layouts the search chose per layer")


def hand_made_options(opts: PipelineOptions, cluster: ClusterSpec, batch: int, pp: int,
                      mb: int, schedule: str) -> list[PipelineOptions]:
    """The hand plans (``Manual``'s options) beside a searched plan of ``pp``
    stages, ``mb`` micro-batches of a ``batch`` and ``schedule``: each
    (dp, tp) of a stage's devices, over the micro-batch counts the search
    starts from and ``mb`` (or the counts ``opts`` fixes), and the schedules
    it searched but interleaved.  The search plans each layer on its own and
    pins disagreeing neighbours afterwards; a hand plan's layers agree by
    construction (each micro-batch's rows stay over ``data``), which can be
    cheaper end to end, and its layouts can fit where the search's fit
    nothing (moe-10b on 16 V100s: 64 micro-batches fit only with them), so
    these are priced too: the search never returns a plan slower than the
    hand plans of its own stage count, or (where the stage count is
    searched) of one stage.  None for a method that fixes the
    layouts or meshes (baselines), stages of unequal size, or a schedule
    hand plans cut otherwise (interleaved)."""
    D, dph = cluster.num_devices, cluster.devices_per_host
    if opts.data_parallel_stages or opts.mesh_shape is not None or D % pp \
            or schedule == "interleaved":
        return []
    counts = opts.num_micro_batches or tuple(sorted({*micro_batch_candidates(batch, None), mb}))
    schedules = tuple(s for s in opts.schedules if s != "interleaved") if pp > 1 else ("1f1b",)
    n = D // pp
    out = []
    for tp in (t for t in range(1, n + 1) if n % t == 0):
        dp = n // tp
        fits = tuple(b for b in counts if not batch % b and (batch // b) % dp == 0)
        if not fits or (tp > dph and (dp > 1 or opts.tp_within_host)):
            continue        # (rows dp does not split; tensor parallel across hosts)
        out.append(replace(opts, num_micro_batches=fits, num_stages=pp, fixed=(dp, tp, pp),
                           schedules=schedules, input_filter="model"))
    return out
