"""From a solved ILP back to a plan: layouts, constraints, collectives, memory."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..cost_model.fusion import materialised
from ..cost_model.memory import liveness, live_bytes
from ..cost_model.mesh import MeshModel
from ..cost_model.sharding import ISpec, num_shards, spec_names
from ..graph import Graph
from ..plan import LogicalMesh, Spec
from .build import Built, PlannedCollective, explain, read_layouts
from .problem import Solution


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
    intervals = {t: iv for t, iv in liveness(graph).intervals.items()
                 if t not in const and t in kept}
    n = len(graph.nodes)
    act = float(np.max(live_bytes(intervals, n, local))) if n else 0.0
    return int(resident + act)
