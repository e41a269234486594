"""One stage, planned by the whole-graph ILP: what a request without a
pipeline asks (:func:`meshplan.planning.plan_step`), and what ``--explain``
plans its one-stage alternatives with (:mod:`meshplan.explain`)."""
from __future__ import annotations

from dataclasses import replace

from .cluster import ClusterSpec
from .cost_model import default_axis_names
from .cost_model.mesh import default_submesh
from .dp_search import Session
from .dp_search.assemble import one_stage_seconds, plan_from_intra_op
from .errors import InfeasiblePlanError, batch_rows
from .graph import BATCH, GRAD_BOUNDARY, Graph, strip_markers
from .ilp import (InputLayouts, IntraOpResult, best_intra_op, candidate_meshes, solve_mesh,
                  within_host)
from .ilp.replicated import replicated_note, unsplit_flops
from .offload import (check_offload, frees_memory, host_inputs, not_fitting, offloaded_bytes,
                      with_offload)
from .plan import LogicalMesh, Plan
from .request import PlanRequest


def plan_one_stage(graph: Graph, cluster: ClusterSpec, request: PlanRequest, session: Session,
                   memory_budget: float | None = None) -> Plan:
    """The one-stage plan ``request`` asks for (its ``pipeline`` is ignored).
    ``memory_budget``: bytes per device (default: the request's memory
    fraction of the devices').  ``request.offload``: "optimizer" keeps the
    optimizer state in host memory; "auto" does so only where the plan does
    not fit without it and the cluster's host memory is separate
    (:mod:`meshplan.offload`)."""
    if request.offload == "optimizer":
        return _plan(graph, cluster, request, session, memory_budget, offload=True)
    try:
        return _plan(graph, cluster, request, session, memory_budget, offload=False)
    except InfeasiblePlanError as e:
        if request.offload != "auto" or not frees_memory(cluster) or not offloaded_bytes(graph):
            raise
        try:
            return _plan(graph, cluster, request, session, memory_budget, offload=True)
        except InfeasiblePlanError:
            raise not_fitting(e, cluster) from None


def _plan(graph: Graph, cluster: ClusterSpec, request: PlanRequest, session: Session,
          memory_budget: float | None, offload: bool) -> Plan:
    if offload:
        check_offload(graph, cluster)
    # the parameter gradients (meshplan.value_and_grad marks them): their
    # reductions may run under the backward (cost_model.overlap)
    grads = frozenset(t for n in graph.nodes if n.primitive == GRAD_BOUNDARY for t in n.inputs)
    graph = strip_markers(graph)
    if request.batch_split > 1:
        check_batch_divisible(graph, request.batch_split, request.batch_split_by)
    shape = request.mesh_shape
    mesh = None if shape is None else LogicalMesh(
        tuple(request.axis_names or default_axis_names(len(shape))), tuple(shape))
    budget = (int(cluster.device.memory_bytes * request.memory_fraction)
              if memory_budget is None else memory_budget)
    host = host_inputs(graph, cluster) if offload else frozenset()
    if request.input_layouts is not None:
        # hand-made layouts (data parallel, Megatron): one mesh, one ILP
        results = solve_mesh(graph, cluster, mesh,
                             input_filter=InputLayouts(request.input_layouts),
                             backend=request.backend, time_limit=request.time_limit,
                             memory_budget=budget, options=session.solver,
                             caches=session.ilp_caches, accumulate=grads, host_inputs=host,
                             whole_step=True)
    else:
        meshes = None if mesh is None else [mesh]
        if meshes is None and request.tp_within_host:
            hosts, dph = default_submesh(cluster, cluster.num_devices)
            meshes = within_host(candidate_meshes(cluster.num_devices, cluster=cluster,
                                                  submesh=(hosts, dph)), hosts, dph)
        results = best_intra_op(graph, cluster, meshes=meshes, backend=request.backend,
                                time_limit=request.time_limit, memory_budget=budget,
                                reporter=session.progress, options=session.solver,
                                caches=session.ilp_caches, accumulate=grads,
                                host_inputs=host, whole_step=True)[1]
    r = _fastest(graph, cluster, results)
    plan = plan_from_intra_op(graph, cluster, r, request.method)
    same = replicated_axes(graph, r)
    if same:
        plan = replace(plan, notes=plan.notes + (same,))
    if r.solution.status == "time_limit":
        plan = replace(plan, ilp_time_limit_hit=True)
    if offload:
        plan = with_offload(plan, graph, cluster, dict(plan.arg_prefixes))
    return plan


def _fastest(graph: Graph, cluster: ClusterSpec, results: list) -> IntraOpResult:
    """Of the ILP results (meshes, pricings), the one whose plan is
    predicted fastest.  The ILP's objective leaves out what the plan's time
    counts after it (gradient reductions run under the backward, a merged
    reduction's fixed cost), so two results can rank the other way by it."""
    ok = [r for r in results if isinstance(r, IntraOpResult)]
    return min(ok, key=lambda r: (round(one_stage_seconds(graph, cluster, r), 12),
                                  len(r.mesh.shape)))


def replicated_axes(graph: Graph, r: IntraOpResult) -> str | None:
    """A note where the plan runs most of the step's FLOPs identically on
    every device of a mesh axis (:mod:`meshplan.ilp.replicated`), else None."""
    return replicated_note([unsplit_flops(graph, r.mesh, r.strategies)])


def check_batch_divisible(graph: Graph, n: int, what: str, micro_batches: int = 1) -> None:
    """Refuse a batch whose dimension 0 does not split ``n`` ways (``what``
    asks for it): with ``micro_batches``, each of them ``n`` ways (one that
    does not divide the batch is the search's to refuse).  Where leaves
    disagree on the batch size, that is what is refused (a key among the
    rows, or batch_argnums naming the parameters), not the size: splitting
    the rows is what was asked for."""
    batch_rows([(graph.tensors[i.tensor].shape[0], f"argument {i.argnum}{i.path}")
                for i in graph.inputs if i.role == BATCH and graph.tensors[i.tensor].shape])
    for inp in graph.inputs:
        if inp.role == BATCH:
            shape = graph.tensors[inp.tensor].shape
            if not shape or shape[0] % micro_batches or not (shape[0] // micro_batches) % n:
                continue
            of = f"argument {inp.argnum}{inp.path}"
            if micro_batches == 1:
                raise InfeasiblePlanError(
                    f"{what}: the batch dimension of {of} has size {shape[0]}, which does not "
                    f"split over {n} devices; use a batch size divisible by {n} or ShardParallel()")
            raise InfeasiblePlanError(
                f"{what}: the batch dimension of {of} has size {shape[0]}, whose micro-batches "
                f"of {shape[0] // micro_batches} do not split over the {n} data-parallel devices "
                f"(each would run the whole micro-batch); use a batch size divisible by "
                f"{n * micro_batches}, or fewer micro-batches")
