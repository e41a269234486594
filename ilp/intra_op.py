"""The intra-operator pass: :func:`solve_intra_op` on one logical mesh,
:func:`best_intra_op` over the mesh shapes worth trying.

``solve_intra_op(graph, cluster, mesh)`` chooses a layout for every tensor and
a strategy for every operator of ``graph`` on one logical mesh, minimising
compute + communication + resharding time under the per-device memory budget.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Sequence

from .. import progress
from ..cluster import ClusterSpec
from ..cost_model.mesh import default_axis_names, mesh_model, mesh_shapes
from ..cost_model.sharding import ISpec
from ..cost_model.torus import torus_orders
from ..errors import InfeasiblePlanError
from ..graph import BATCH, OPT_STATE, PARAM, STATE, Graph, GraphInput, Tensor
from ..plan import LogicalMesh
from ..units import human_bytes
from .build import (Built, InputFilter, Pins, build_problem, priced_as_whole_step, rows_over,
                    stored_liveness, with_resident_cap)
from .caches import IlpCaches
from .decode import IntraOpResult, decode
from .options import SolverOptions
from .problem import IlpProblem
from .solvers import solve


@dataclass(frozen=True)
class InputLayouts:
    """An input filter for hand-made methods (a picklable ``InputFilter``).

    The batch is split along dimension 0 over mesh axis 0 (``data``) only.
    ``params`` says how parameters, optimizer and other state may be laid out:
    ``"replicated"`` (data parallel), ``"sharded"`` (ZeRO-3 style: split over
    axis 0 wherever a dimension divides) or ``"model"`` (Megatron: split over
    the other axes only, never over ``data``).  ``sequence``: Megatron-LM's
    sequence parallelism (Korthikanti et al. 2022, section 4.2.2): the
    activations a layer gets from another layer ([batch, sequence, ...]
    values, and their gradients) arrive split along the sequence over the
    other axes, so the LayerNorm and residual regions run on sequence shards
    (the layer's ILP still chooses where to gather).  Only floating-point
    values are activations in that sense: token ids or positions handed from
    one layer to the next ([batch, sequence, 1] indices of the embedding's
    gather) stay free, or the embedding's gradient would be summed over the
    whole table on every micro-batch."""
    params: str = "replicated"
    sequence: bool = False
    batch_axes: tuple[int, ...] = (0,)      # (where __call__ puts the batch)

    def __call__(self, inp: GraphInput, spec: ISpec, tensor: Tensor | None = None) -> bool:
        axes = [a for d in spec for a in d]
        if inp.role == BATCH:
            # (an input with no split of dimension 0 on offer falls back to
            # replicated: a data axis of size 1, a batch it does not divide)
            return bool(spec) and spec[0] == (0,) and all(not d for d in spec[1:])
        if inp.role not in (PARAM, OPT_STATE, STATE):    # activations from another stage
            # (none on offer, as for an odd sequence length: replicated)
            return not self.sequence or _sequence_cut(spec, tensor, rows_over=(0,))
        if self.params == "replicated":
            return not axes
        if self.params == "sharded":
            return 0 in axes
        if self.params == "model":
            # (Megatron's tensor parallelism splits every weight matrix over
            # the model axes; vectors (biases, LayerNorm) may stay whole)
            return 0 not in axes and (bool(axes) or len(spec) < 2)
        raise ValueError(f"InputLayouts(params={self.params!r})")


def _sequence_cut(spec: ISpec, tensor: Tensor | None, rows_over: tuple[int, ...] | None) -> bool:
    """Is an activation from another layer laid out as sequence parallelism
    hands it over: a [batch, sequence, ...] floating-point value split along
    the sequence, its other dimensions whole but the batch's, whose rows are
    cut over ``rows_over`` at most (None: any axes)?  Any other value passes."""
    if (tensor is not None and not _sequence_shaped(tensor)) or len(spec) < 3:
        return True
    rows_ok = rows_over is None or all(a in rows_over for a in spec[0])
    return rows_ok and bool(spec[1]) and not set(spec[1]) & set(rows_over or ()) \
        and all(not d for d in spec[2:])


def _sequence_shaped(tensor: Tensor) -> bool:
    """Could ``tensor`` be a [batch, sequence, ...] activation: floating
    point, of rank 3 or more?"""
    return len(tensor.shape) >= 3 and str(tensor.dtype).startswith(("float", "bfloat"))


@dataclass(frozen=True)
class SequenceSplit:
    """An input filter that hands every activation between layers over split
    along the sequence (:func:`_sequence_cut`), each layer's ILP choosing
    where to gather it, and leaves every other layout free: sequence
    parallelism (Korthikanti et al. 2022, 4.2.2) found by a search, which
    keeps what recomputation holds per micro-batch in flight split over the
    axes that split the sequence.  As with :class:`EachMicroBatch`, no
    gradient sum waits for the last micro-batch: a weight gradient made from
    sequence shards would otherwise wait whole (a layer's gradients at full
    size, for gpt-39b 3 GiB a layer), over an axis that does not cut the
    rows, which the runtime could not keep either.  The searched methods'
    last pass where memory binds (meshplan.planning)."""
    batch_axes: tuple[int, ...] = ()

    def __call__(self, inp: GraphInput, spec: ISpec, tensor: Tensor | None = None) -> bool:
        if inp.role in (BATCH, PARAM, OPT_STATE, STATE):
            return True
        return _sequence_cut(spec, tensor, rows_over=None)

    @staticmethod
    def applies(graph: Graph) -> bool:
        """Has ``graph`` a value this filter could split?  (Else a search
        with it searches the same as one without.)"""
        return any(t is not None and _sequence_shaped(t) for t in graph.tensors)


@dataclass(frozen=True)
class EachMicroBatch:
    """An input filter that leaves every layout free but lets no gradient
    sum wait for the step's last micro-batch (``batch_axes`` empty, see
    :func:`meshplan.ilp.accumulation.deferrable`): each micro-batch's
    gradients are reduced as they are made, ZeRO-2's way, so the running
    sums keep their parameters' layout: less memory than sums kept whole
    per data shard, for more communication.  The searched methods' pass
    where memory binds (``Plan.reduce_grads_each_micro_batch``)."""
    batch_axes: tuple[int, ...] = ()

    def __call__(self, inp: GraphInput, spec: ISpec, tensor: Tensor | None = None) -> bool:
        return True


def candidate_meshes(num_devices: int, max_rank: int | None = None, *,
                     cluster: ClusterSpec | None = None,
                     submesh: tuple[int, int] | None = None) -> list[LogicalMesh]:
    """Logical meshes worth trying for ``num_devices``.

    Every ordered factorisation into at most ``max_rank`` axes (default: 2 below
    16 devices, 3 from 16 on); on a TPU cluster, each laid over the torus
    dimensions in every order worth trying (``LogicalMesh.torus``).  Given
    the cluster, a mesh whose axes have the sizes and link figures of one
    already offered, in the same order, is dropped: it plans the same.  A
    permutation (4x2 of 2x4) is kept even where all links are alike: a
    dimension split over several axes is split major axis first, so the
    two reach different layouts (on 2x4 a 4-way split cannot be refined to
    8 ways in place; on 4x2 it can).
    """
    if max_rank is None:
        max_rank = 2 if num_devices < 16 else 3
    orders = torus_orders(cluster, submesh) if cluster is not None else [()]
    out, seen = [], set()
    for shape in mesh_shapes(num_devices, max_rank):
        for order in orders:
            mesh = LogicalMesh(default_axis_names(len(shape)), shape, order)
            if cluster is not None:
                links = mesh_model(cluster, mesh, submesh=submesh).links
                key = tuple(zip(shape, [(l.bandwidth, l.latency, l.local, l.phases)
                                        for l in links]))
                if key in seen:
                    continue
                seen.add(key)
            out.append(mesh)
    return out


def within_host(meshes: list[LogicalMesh], hosts: int, devices_per_host: int
                ) -> list[LogicalMesh]:
    """Of ``meshes`` laid row-major over ``hosts`` whole hosts, those whose
    every axis but the first lies inside a host: only the first (data) axis
    crosses hosts, so tensor parallelism stays on the fast links.  One host
    keeps them all; hosts of one device keep the one-axis mesh."""
    if hosts <= 1:
        return meshes
    inside = [m for m in meshes
              if len(m.shape) > 1 and devices_per_host % math.prod(m.shape[1:]) == 0]
    return inside or [m for m in meshes if len(m.shape) == 1]


def memory_floor(graph: Graph, num_devices: int,
                 host_inputs: frozenset[int] = frozenset()) -> float:
    """A lower bound of the peak bytes per device of any plan of ``graph`` on
    ``num_devices`` devices, as the ILP's memory rows and the decoded peak
    count them: the inputs (but ``host_inputs``, kept in host memory) and the
    stored intermediates live at the busiest point, all split evenly; with
    ``host_inputs``, also the update's point (:func:`meshplan.ilp.build.update_point`)."""
    profile = stored_liveness(graph).profile
    peak = float(profile.max()) if len(profile) else 0.0
    floor = (sum(graph.tensors[i.tensor].nbytes for k, i in enumerate(graph.inputs)
                 if k not in host_inputs) + peak) / num_devices
    if host_inputs:     # the update: every input on the device, a gradient per parameter
        floor = max(floor, sum(graph.tensors[i.tensor].nbytes * (2 if i.role == PARAM else 1)
                               for i in graph.inputs) / num_devices)
    return floor


def _too_big(graph: Graph, n: int, budget: float,
             host_inputs: frozenset[int] = frozenset()) -> InfeasiblePlanError | None:
    need = memory_floor(graph, n, host_inputs)
    if need <= budget:
        return None
    return InfeasiblePlanError(
        f"the model does not fit: it needs at least {human_bytes(need)} per device on {n} "
        f"device(s) however it is split, but the budget is {human_bytes(budget)}; use more "
        "devices, pipeline stages, remat, smaller micro-batches or a cluster with more memory "
        "per device", budget_bytes=int(budget), needed_bytes=int(need))


def solve_intra_op(graph: Graph, cluster: ClusterSpec, mesh: LogicalMesh, *,
                   submesh: tuple[int, int] | None = None, backend: str = "highs",
                   time_limit: float | None = 60.0, memory_budget: float | None = None,
                   input_filter: InputFilter | None = None,
                   accumulate: frozenset[int] = frozenset(), grad_accum: int = 1,
                   options: SolverOptions = SolverOptions(),
                   caches: IlpCaches | None = None,
                   resident_budget: float | None = None,
                   host_inputs: frozenset[int] = frozenset(),
                   built: Built | None = None, pins: Pins | None = None,
                   seed: Sequence[int] | None = None) -> IntraOpResult:
    """The best plan of ``graph`` on ``mesh``.  ``options`` says how the
    solvers run (parse it once: :meth:`SolverOptions.from_env`); ``caches``
    may be shared by many calls (None: a fresh one for this call);
    ``resident_budget`` bounds the inputs' bytes per device (the MIP then
    stops within ``options.capped_gap`` of its optimum) and
    ``host_inputs`` are kept out of the device's memory
    (:func:`meshplan.ilp.build.build_problem`).  The result's peak still
    counts every input.  ``built``: the problem :func:`build_intra_op` made
    with these arguments (no ``host_inputs``), reused with
    ``resident_budget`` added.  ``pins``: boundary layouts fixed by
    neighbouring layers (:class:`meshplan.ilp.build.Pins`).  ``seed``: a
    plan of the problem without ``resident_budget`` (the MIP starts from it,
    :func:`meshplan.ilp.solvers.solve`)."""
    mm = mesh_model(cluster, mesh, submesh=submesh)
    if built is None:
        built = build_intra_op(graph, cluster, mesh, submesh=submesh,
                               memory_budget=memory_budget, input_filter=input_filter,
                               accumulate=accumulate, grad_accum=grad_accum, caches=caches,
                               resident_budget=resident_budget, host_inputs=host_inputs,
                               pins=pins)
    elif host_inputs:
        raise ValueError("solve_intra_op: a prebuilt problem has no host inputs")
    elif resident_budget is not None:
        built = with_resident_cap(built, resident_budget)
    # (a capped layer's MIP proves its last percent slowly, and the caps
    # themselves are steps of 19%: SolverOptions.capped_gap)
    gap = options.capped_gap if resident_budget is not None else 0.0
    sol = solve(built.problem, backend=backend, time_limit=time_limit, options=options,
                gap=gap, seed=seed)
    # Rows bound a few positions only; where the chosen layouts peak at
    # another one, bound it too and solve again (each round adds twice as
    # many rows as the last at most, and there are finitely many positions).
    k = 4
    while extra := rows_over(graph, mm.shape, built, sol.choice, k):
        p = built.problem
        built = dataclasses.replace(built, problem=IlpProblem(p.names, p.costs, p.edges,
                                                              p.memory + extra))
        sol = solve(built.problem, backend=backend, time_limit=time_limit, options=options,
                    gap=gap, seed=sol.choice)
        k *= 2
    return decode(graph, mm, built, sol)


def build_intra_op(graph: Graph, cluster: ClusterSpec, mesh: LogicalMesh, *,
                   submesh: tuple[int, int] | None = None, memory_budget: float | None = None,
                   input_filter: InputFilter | None = None,
                   accumulate: frozenset[int] = frozenset(), grad_accum: int = 1,
                   caches: IlpCaches | None = None, resident_budget: float | None = None,
                   host_inputs: frozenset[int] = frozenset(), pins: Pins | None = None
                   ) -> Built:
    """The ILP :func:`solve_intra_op` solves with these arguments
    (InfeasiblePlanError where no layout could fit, before building it)."""
    mm = mesh_model(cluster, mesh, submesh=submesh)
    err = _too_big(graph, mesh.size, mm.memory_budget if memory_budget is None else memory_budget,
                   host_inputs)
    if err is not None:
        raise err       # (before building an ILP no layout could satisfy)
    return build_problem(graph, mm, memory_budget=memory_budget, input_filter=input_filter,
                         accumulate=accumulate, grad_accum=grad_accum, caches=caches,
                         resident_budget=resident_budget, host_inputs=host_inputs,
                         pins=pins)


def solve_mesh(graph: Graph, cluster: ClusterSpec, mesh: LogicalMesh, *,
               submesh: tuple[int, int] | None = None, backend: str = "highs",
               time_limit: float | None = 60.0, memory_budget: float | None = None,
               input_filter: InputFilter | None = None,
               accumulate: frozenset[int] = frozenset(),
               options: SolverOptions = SolverOptions(), caches: IlpCaches | None = None,
               host_inputs: frozenset[int] = frozenset(), whole_step: bool = False
               ) -> list[IntraOpResult]:
    """[:func:`solve_intra_op`'s result on ``mesh``]; with ``whole_step``
    (``graph`` is the whole step, ``accumulate`` its parameter gradients)
    and where that plan costs ``UNPRICED_SHARE`` more than its ILP priced
    it, also the plan of the same problem priced as the whole step
    (:func:`meshplan.ilp.build.priced_as_whole_step`): the merged gradient
    reduction's fixed cost, which the first ILP cannot see, may make another
    plan faster (a latency-bound step split for less than that cost: 233 us
    where replicating it is 89 us).  The caller ranks them by the time of the
    plans (:func:`meshplan.dp_search.assemble.one_stage_seconds`)."""
    built = build_intra_op(graph, cluster, mesh, submesh=submesh, memory_budget=memory_budget,
                           input_filter=input_filter, accumulate=accumulate, caches=caches,
                           host_inputs=host_inputs)
    kw = dict(submesh=submesh, backend=backend, time_limit=time_limit, options=options,
              caches=caches)
    r = solve_intra_op(graph, cluster, mesh, built=built, **kw)
    if not (whole_step and accumulate and underpriced(r)):
        return [r]
    return [r, solve_intra_op(graph, cluster, mesh,
                              built=priced_as_whole_step(built, len(accumulate)), **kw)]


# the decoded plan over the ILP's objective by more than this share: solve
# again priced as the whole step (solve_mesh)
UNPRICED_SHARE = 0.02


def underpriced(r: IntraOpResult) -> bool:
    """Whether the decoded plan costs ``UNPRICED_SHARE`` more than the ILP
    priced it (the merged gradient reduction's fixed cost, mostly)."""
    return r.compute_s + r.comm_s > (1 + UNPRICED_SHARE) * r.objective_s


def best_intra_op(graph: Graph, cluster: ClusterSpec, *, meshes: list[LogicalMesh] | None = None,
                  submesh: tuple[int, int] | None = None, backend: str = "highs",
                  time_limit: float | None = 60.0, memory_budget: float | None = None,
                  input_filter: InputFilter | None = None,
                  reporter: progress.Progress | None = None,
                  options: SolverOptions = SolverOptions(), caches: IlpCaches | None = None,
                  accumulate: frozenset[int] = frozenset(),
                  host_inputs: frozenset[int] = frozenset(), whole_step: bool = False
                  ) -> tuple[IntraOpResult, list[IntraOpResult | InfeasiblePlanError]]:
    """The fastest plan over ``meshes`` (default: every mesh shape of the device
    count); ``reporter`` shows each mesh's ILP as a progress step.  ``options``,
    ``caches``, ``accumulate`` (the parameter gradients), ``host_inputs`` and
    ``whole_step`` as for :func:`solve_mesh` (its results are all listed)."""
    reporter = reporter or progress.Progress(progress.QUIET)
    n = (submesh[0] * submesh[1]) if submesh else cluster.num_devices
    meshes = meshes or candidate_meshes(n, cluster=cluster, submesh=submesh)
    budget = (mesh_model(cluster, meshes[0], submesh=submesh).memory_budget
              if memory_budget is None else memory_budget)
    err = _too_big(graph, n, budget, host_inputs)
    if err is not None:
        raise err       # on every mesh: nothing to try
    results: list[IntraOpResult | InfeasiblePlanError] = []
    for mesh in meshes:
        try:
            with reporter.step(f"ILP on mesh {mesh}"):
                results += solve_mesh(graph, cluster, mesh, submesh=submesh,
                                      backend=backend, time_limit=time_limit,
                                      memory_budget=memory_budget, input_filter=input_filter,
                                      options=options, caches=caches, accumulate=accumulate,
                                      host_inputs=host_inputs, whole_step=whole_step)
        except InfeasiblePlanError as e:
            results.append(e)
    ok = [r for r in results if isinstance(r, IntraOpResult)]
    if not ok:
        errs = [r for r in results if isinstance(r, InfeasiblePlanError)]
        need = min((e.needed_bytes or 0) for e in errs)
        raise InfeasiblePlanError(
            f"the model does not fit on {n} device(s) with any mesh shape: it needs at least "
            f"{human_bytes(need)} per device, the budget is "
            f"{human_bytes(errs[0].budget_bytes or 0)}; use more devices, pipeline stages "
            "(method=Auto()/PipeshardParallel) or a cluster with more memory per device",
            budget_bytes=errs[0].budget_bytes, needed_bytes=need)
    best = min(ok, key=lambda r: (round(r.objective_s, 12), len(r.mesh.shape)))
    return best, results
