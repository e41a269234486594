"""meshplan.ilp: the intra-operator pass.

``solve_intra_op(graph, cluster, mesh)`` chooses a layout for every tensor and
a strategy for every operator of ``graph`` on one logical mesh, minimising
compute + communication + resharding time under the per-device memory budget;
``best_intra_op`` tries every mesh shape worth trying and keeps the fastest.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from ..cluster import ClusterSpec
from ..cost_model.fusion import materialised
from ..cost_model.memory import liveness
from ..cost_model.mesh import MeshModel, default_axis_names, mesh_model, mesh_shapes
from ..cost_model.sharding import ISpec, num_shards, spec_names
from .. import progress
from ..errors import InfeasiblePlanError
from ..graph import BATCH, OPT_STATE, PARAM, STATE, Graph, GraphInput
from ..plan import LogicalMesh, Spec
from .build import Built, InputFilter, PlannedCollective, build_problem, explain, read_layouts
from .core import IlpProblem, Solution, brute_force, solve

__all__ = ["IntraOpResult", "InputLayouts", "solve_intra_op", "best_intra_op", "candidate_meshes",
           "memory_floor",
           "IlpProblem", "Solution", "brute_force", "solve", "build_problem", "explain",
           "PlannedCollective"]


@dataclass(frozen=True)
class InputLayouts:
    """An input filter for hand-made methods (a picklable ``InputFilter``).

    The batch is split along dimension 0 over mesh axis 0 (``data``) only.
    ``params`` says how parameters, optimizer and other state may be laid out:
    ``"replicated"`` (data parallel), ``"sharded"`` (ZeRO-3 style: split over
    axis 0 wherever a dimension divides) or ``"model"`` (Megatron: split over
    the other axes only, never over ``data``)."""
    params: str = "replicated"

    def __call__(self, inp: GraphInput, spec: ISpec) -> bool:
        axes = [a for d in spec for a in d]
        if inp.role == BATCH:
            # (an input with no split of dimension 0 on offer falls back to
            # replicated: a data axis of size 1, a batch it does not divide)
            return bool(spec) and spec[0] == (0,) and all(not d for d in spec[1:])
        if inp.role not in (PARAM, OPT_STATE, STATE):    # activations from another stage
            return True
        if self.params == "replicated":
            return not axes
        if self.params == "sharded":
            return 0 in axes
        if self.params == "model":
            return 0 not in axes
        raise ValueError(f"InputLayouts(params={self.params!r})")


@dataclass(frozen=True)
class IntraOpResult:
    mesh: LogicalMesh
    objective_s: float
    compute_s: float
    comm_s: float
    comm_bytes: float
    peak_memory_bytes: int
    input_specs: tuple[Spec, ...]            # one per Graph.inputs
    output_specs: tuple[Spec | None, ...]    # one per Graph.outputs
    constraints: tuple[tuple[int, Spec], ...]
    strategies: tuple[tuple[int, str], ...]
    solution: Solution
    num_groups: int
    comm_by_kind: tuple[tuple[str, float], ...] = ()      # HLO collective kind -> bytes
    collectives: tuple[PlannedCollective, ...] = ()       # every collective of the plan
    # (tensor id of the reader's first result, operand position, layout): the
    # operands the plan reshards before an operator reads them
    read_constraints: tuple[tuple[int, int, Spec], ...] = ()

    def describe(self) -> str:
        s = self.solution
        return (f"mesh {self.mesh}: {self.objective_s * 1e3:.3f} ms (compute {self.compute_s * 1e3:.3f}, "
                f"comm {self.comm_s * 1e3:.3f}), peak {self.peak_memory_bytes / 2**20:.1f} MiB, "
                f"{self.num_groups} groups, {s.num_variables} variables, {s.num_constraints} "
                f"constraints, {s.solve_s:.2f} s ({s.backend}, {s.status})")


def candidate_meshes(num_devices: int, max_rank: int | None = None, *,
                     cluster: ClusterSpec | None = None,
                     submesh: tuple[int, int] | None = None) -> list[LogicalMesh]:
    """Logical meshes worth trying for ``num_devices``.

    Every ordered factorisation into at most ``max_rank`` axes (default: 2 below
    16 devices, 3 from 16 on).  Given the cluster, a permutation of a shape
    whose axes have identical link figures is dropped: it plans the same.
    """
    if max_rank is None:
        max_rank = 2 if num_devices < 16 else 3
    out, seen = [], set()
    for shape in mesh_shapes(num_devices, max_rank):
        mesh = LogicalMesh(default_axis_names(len(shape)), shape)
        if cluster is not None:
            links = mesh_model(cluster, mesh, submesh=submesh).links
            key = tuple(sorted(zip(shape, [(l.bandwidth, l.latency) for l in links])))
            if key in seen:
                continue
            seen.add(key)
        out.append(mesh)
    return out


def memory_floor(graph: Graph, num_devices: int) -> float:
    """A lower bound of the peak bytes per device of any plan of ``graph`` on
    ``num_devices`` devices, as the ILP's memory rows count them: the inputs
    and the intermediates live at the busiest point, all split evenly."""
    profile = liveness(graph).profile
    peak = float(profile.max()) if len(profile) else 0.0
    return (sum(graph.tensors[i.tensor].nbytes for i in graph.inputs) + peak) / num_devices


def _too_big(graph: Graph, n: int, budget: float) -> InfeasiblePlanError | None:
    need = memory_floor(graph, n)
    if need <= budget:
        return None
    return InfeasiblePlanError(
        f"the model does not fit: it needs at least {need / 2**30:.2f} GiB per device on {n} "
        f"device(s) however it is split, but the budget is {budget / 2**30:.2f} GiB; use more "
        "devices, pipeline stages, remat, smaller micro-batches or a cluster with more memory "
        "per device", budget_bytes=int(budget), needed_bytes=int(need))


def solve_intra_op(graph: Graph, cluster: ClusterSpec, mesh: LogicalMesh, *,
                   submesh: tuple[int, int] | None = None, backend: str = "highs",
                   time_limit: float | None = 60.0, memory_budget: float | None = None,
                   input_filter: InputFilter | None = None,
                   accumulate: frozenset[int] = frozenset(), grad_accum: int = 1
                   ) -> IntraOpResult:
    mm = mesh_model(cluster, mesh, submesh=submesh)
    err = _too_big(graph, mesh.size, mm.memory_budget if memory_budget is None else memory_budget)
    if err is not None:
        raise err       # (before building an ILP no layout could satisfy)
    built = build_problem(graph, mm, memory_budget=memory_budget, input_filter=input_filter,
                          accumulate=accumulate, grad_accum=grad_accum)
    sol = solve(built.problem, backend=backend, time_limit=time_limit)
    return decode(graph, mm, built, sol)


def decode(graph: Graph, mm: MeshModel, built: Built, sol: Solution) -> IntraOpResult:
    groups, choice = built.groups, sol.choice
    names = mm.mesh.axes
    tensor_spec: dict[int, ISpec] = {}
    for g, c in zip(groups, choice):
        tensor_spec.update(g.specs[c])
    compute = sum(g.compute[c] for g, c in zip(groups, choice))

    input_specs = tuple(spec_names(tensor_spec[i.tensor], names) for i in graph.inputs)
    # The new value of an updated input leaves the step in that input's layout
    # (the alias edge paid for the resharding): its buffer is the donated one.
    output_specs = tuple(
        input_specs[o.updates] if o.updates is not None and graph.tensors[o.tensor].shape
        else spec_names(tensor_spec[o.tensor], names) if o.tensor in tensor_spec else None
        for o in graph.outputs)
    # Every laid-out intermediate is pinned to its planned layout: the ILP's
    # costs (followers included) assume these layouts, and a tensor left open
    # is laid out by XLA's propagation, which may pick another one and add
    # collectives the plan never paid for.
    strategies = [(graph.nodes[g.root_node].id, g.strategies[c].name)
                  for g, c in zip(groups, choice) if g.root_node is not None]
    inputs = {i.tensor for i in graph.inputs}
    constraints = [(t, spec_names(spec, names)) for t, spec in sorted(tensor_spec.items())
                   if t not in inputs and graph.tensors[t].shape]
    # Where a reader takes an operand in another layout than the value has,
    # the plan reshards: (first result of the reader, operand position, layout).
    read_constraints = tuple(
        (graph.nodes[nid].outputs[0], p, spec_names(req, names))
        for nid, p, req in read_layouts(graph, mm, built, choice) if graph.nodes[nid].outputs)
    peak = peak_memory(graph, mm, tensor_spec)
    planned = tuple(explain(graph, mm, built, choice))
    # What XLA emits for these layouts: one collective per distinct resharding
    # step (the objective charges every reader of a tensor separately, an
    # upper bound of this).
    comm = sum(pc.seconds for pc in planned)
    comm_bytes = sum(pc.nbytes for pc in planned)
    by_kind: dict[str, float] = {}
    for pc in planned:
        by_kind[pc.kind] = by_kind.get(pc.kind, 0.0) + pc.nbytes
    return IntraOpResult(mm.mesh, sol.objective, compute, comm, comm_bytes, peak, input_specs,
                         output_specs, tuple(constraints), tuple(strategies), sol, len(groups),
                         tuple(sorted(by_kind.items())), planned, read_constraints)


def peak_memory(graph: Graph, mm: MeshModel, tensor_spec: dict[int, ISpec]) -> int:
    """Resident inputs plus the peak of live intermediates, per device.
    Values computed from constants alone (a causal mask broadcast to the
    scores' shape) and values passed only between fused element-wise
    operators are not counted: XLA keeps them out of memory."""
    shape = mm.shape
    const = graph.constant_tensors
    kept = materialised(graph)

    def local(t: int) -> float:
        spec = tensor_spec.get(t)
        nb = graph.tensors[t].nbytes
        return nb / num_shards(spec, shape) if spec is not None else nb

    resident = sum(local(i.tensor) for i in graph.inputs)
    live = liveness(graph)
    n = len(graph.nodes)
    delta = np.zeros(n + 1)
    for t, (a, b) in live.intervals.items():
        if t in const or t not in kept:
            continue
        v = local(t)
        delta[a] += v
        delta[b + 1] -= v
    act = float(np.max(np.cumsum(delta)[:n])) if n else 0.0
    return int(resident + act)


def best_intra_op(graph: Graph, cluster: ClusterSpec, *, meshes: list[LogicalMesh] | None = None,
                  submesh: tuple[int, int] | None = None, backend: str = "highs",
                  time_limit: float | None = 60.0, memory_budget: float | None = None,
                  input_filter: InputFilter | None = None,
                  reporter: progress.Progress | None = None
                  ) -> tuple[IntraOpResult, list[IntraOpResult | InfeasiblePlanError]]:
    """The fastest plan over ``meshes`` (default: every mesh shape of the device
    count); ``reporter`` shows each mesh's ILP as a progress step."""
    reporter = reporter or progress.Progress(progress.QUIET)
    n = (submesh[0] * submesh[1]) if submesh else cluster.num_devices
    meshes = meshes or candidate_meshes(n, cluster=cluster, submesh=submesh)
    budget = (mesh_model(cluster, meshes[0], submesh=submesh).memory_budget
              if memory_budget is None else memory_budget)
    err = _too_big(graph, n, budget)
    if err is not None:
        raise err       # on every mesh: nothing to try
    results: list[IntraOpResult | InfeasiblePlanError] = []
    for mesh in meshes:
        try:
            with reporter.step(f"ILP on mesh {mesh}"):
                results.append(solve_intra_op(graph, cluster, mesh, submesh=submesh,
                                              backend=backend, time_limit=time_limit,
                                              memory_budget=memory_budget,
                                              input_filter=input_filter))
        except InfeasiblePlanError as e:
            results.append(e)
    ok = [r for r in results if isinstance(r, IntraOpResult)]
    if not ok:
        errs = [r for r in results if isinstance(r, InfeasiblePlanError)]
        need = min((e.needed_bytes or 0) for e in errs)
        raise InfeasiblePlanError(
            f"the model does not fit on {n} device(s) with any mesh shape: it needs at least "
            f"{need / 2**30:.2f} GiB per device, the budget is "
            f"{(errs[0].budget_bytes or 0) / 2**30:.2f} GiB; use more devices, pipeline stages "
            "(method=Auto()/PipeshardParallel) or a cluster with more memory per device",
            budget_bytes=errs[0].budget_bytes, needed_bytes=need)
    best = min(ok, key=lambda r: (round(r.objective_s, 12), len(r.mesh.shape)))
    return best, results
