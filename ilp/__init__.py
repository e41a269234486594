"""meshplan.ilp: the intra-operator pass.

``solve_intra_op(graph, cluster, mesh)`` chooses a layout for every tensor and
a strategy for every operator of ``graph`` on one logical mesh, minimising
compute + communication + resharding time under the per-device memory budget;
``best_intra_op`` tries every mesh shape worth trying and keeps the fastest.

Modules, in the order data flows through them:

* :mod:`.rules`, :mod:`.strategies`: per-primitive sharding rules and the
  strategies of one operator;
* :mod:`.build`: Graph + mesh -> :class:`IlpProblem` (memoised through
  :class:`IlpCaches`);
* :mod:`.problem`: the problem as numbers; :mod:`.presolve`: exact
  reductions; :mod:`.dp`: dynamic programming; :mod:`.solvers`: ``solve``
  with the MIP back ends, run as :class:`SolverOptions` say;
* :mod:`.decode`: a solution -> :class:`IntraOpResult`, with the
  collectives and reshardings the choice implies;
* :mod:`.intra_op`: the entry points;
* :mod:`.replicated`: the work a plan leaves unsplit over a mesh axis (its note).
"""
from __future__ import annotations

from .build import Built, InputFilter, Pins, build_problem
from .caches import IlpCaches
from .decode import (IntraOpResult, PlannedCollective, decode, explain, peak_memory, peak_parts,
                     read_layouts)
from .intra_op import (EachMicroBatch, InputLayouts, SequenceSplit, best_intra_op, build_intra_op,
                       candidate_meshes, memory_floor, within_host, solve_intra_op, solve_mesh)
from .options import SolverOptions
from .problem import Edge, IlpProblem, MemoryRow, Solution, brute_force
from .solvers import solve

__all__ = ("IntraOpResult", "EachMicroBatch", "InputLayouts", "SequenceSplit", "solve_intra_op",
           "solve_mesh", "build_intra_op", "best_intra_op", "candidate_meshes",
           "within_host", "memory_floor", "decode", "peak_memory", "peak_parts", "SolverOptions",
           "IlpCaches", "IlpProblem", "Edge", "MemoryRow", "Solution", "brute_force", "solve",
           "build_problem", "explain", "read_layouts", "Built", "InputFilter", "Pins",
           "PlannedCollective")
