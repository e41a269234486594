"""From a Graph and a logical mesh to an IlpProblem, and back to shardings.

Groups are the ILP's decision units:

* every graph input is a *placeholder* group whose strategies are the layouts
  of that tensor (parameters and optimizer state may thus be laid out unlike
  the activations that use them: ZeRO-style sharding is one of the choices);
* every operator with a sharding rule that is not elementwise is a group of
  its own, with the strategies of :mod:`meshplan.ilp.strategies`;
* an elementwise operator whose result has the shape of one operand *follows*
  that operand: it joins the operand's group and takes its layout (Alpa's
  follower merging), which keeps the ILP small.

Edges carry resharding costs between the layout a group gives a tensor and the
layout a reader needs; the new value of an updated input (a parameter after
the optimizer step) is tied to that input's layout by an edge to its
placeholder (the alias constraint).  Memory rows bound resident inputs plus
live intermediates at the peaks of the liveness profile.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import math

import numpy as np

from ..cost_model.collectives import all_reduce
from ..cost_model.compute import compute_time
from ..cost_model.memory import liveness, peak_steps
from ..cost_model.mesh import MeshModel
from ..cost_model.sharding import ISpec, enumerate_specs, num_shards, replicated, reshard_cost
from ..graph import CONST, LITERAL, Graph, GraphInput
from .core import Edge, IlpProblem, MemoryRow
from .strategies import Strategy, node_dtype, node_space, node_strategies


TIE_BREAK_S_PER_BYTE = 1e-18


@dataclass
class Group:
    gid: int
    name: str
    root_node: int | None            # None for a placeholder
    input_index: int | None          # index into Graph.inputs for a placeholder
    strategies: list[Strategy]
    # per strategy: tensor id -> layout, for every tensor the group produces
    specs: list[dict[int, ISpec]] = field(default_factory=list)
    # per strategy: (tensor id, required layout) for every operand read
    reads: list[list[tuple[int, ISpec]]] = field(default_factory=list)
    cost: list[float] = field(default_factory=list)
    compute: list[float] = field(default_factory=list)
    comm: list[float] = field(default_factory=list)
    comm_bytes: list[float] = field(default_factory=list)
    members: list[int] = field(default_factory=list)   # follower node ids

    @property
    def size(self) -> int:
        return len(self.strategies)


@dataclass
class Built:
    problem: IlpProblem
    groups: list[Group]
    group_of_tensor: dict[int, int]
    edge_costs: list[tuple[int, int, np.ndarray, np.ndarray]]   # (u, v, seconds, bytes)
    resident_rows: dict[int, np.ndarray]


def _follow_input(space, node, graph) -> int | None:
    """Position of the operand a node follows, if any.

    Elementwise nodes follow their first same-shaped operand; any other node
    with exactly one laid-out operand (the others scalars or indices) follows
    that operand, its layout mapped through the node's labels.
    """
    if space is None or len(node.outputs) != 1:
        return None
    if space.elementwise:
        out_shape = graph.tensors[node.outputs[0]].shape
        for k, t in enumerate(node.inputs):
            tt = graph.tensors[t]
            if tt.shape == out_shape and tt.kind not in (LITERAL, CONST) and space.in_labels[k]:
                return k
        return None
    laid_out = [k for k, labs in enumerate(space.in_labels)
                if labs and graph.tensors[node.inputs[k]].kind not in (LITERAL, CONST)]
    others = [k for k, labs in enumerate(space.in_labels) if labs and k not in laid_out]
    return laid_out[0] if len(laid_out) == 1 and not others else None


@dataclass(frozen=True)
class _Mapped:
    """A follower's layout under one layout of the operand it follows."""
    main_req: ISpec                      # the operand as the node needs it
    out: ISpec
    reads: tuple[tuple[int, ISpec], ...]  # other operands: (position, layout)
    reduce_axes: tuple[int, ...]
    shards: int


def _map_through(space, k: int, spec: ISpec, mesh_shape, out_shape) -> _Mapped:
    """Carry the layout ``spec`` of operand ``k`` through the node's labels.
    Axes on labels the node cannot split are gathered first."""
    per_label: dict[int, tuple[int, ...]] = {}
    for lab, axes in zip(space.in_labels[k], spec):
        if axes and lab not in space.blocked:
            per_label[lab] = axes
    for lab in list(per_label):
        if space.sizes[lab] % math.prod(mesh_shape[a] for a in per_label[lab]):
            del per_label[lab]
    main_req = tuple(per_label.get(l, ()) for l in space.in_labels[k])
    out = tuple(per_label.get(l, ()) for l in space.out_labels[0])
    reads = tuple((p, tuple(per_label.get(l, ()) for l in labs))
                  for p, labs in enumerate(space.in_labels) if labs is not None and p != k)
    red = tuple(sorted(a for l, ax in per_label.items() if l in space.reduce for a in ax))
    shards = math.prod(mesh_shape[a] for ax in per_label.values() for a in ax)
    return _Mapped(main_req, out, reads, red, shards)


InputFilter = Callable[[GraphInput, ISpec], bool]


def build_problem(graph: Graph, mm: MeshModel, *, memory_points: int = 4,
                  memory_budget: float | None = None,
                  input_filter: InputFilter | None = None,
                  accumulate: frozenset[int] = frozenset(), grad_accum: int = 1) -> Built:
    """The ILP of ``graph`` on ``mm``.  ``input_filter(input, spec)`` may restrict
    the layouts an input can take (hand-made methods such as data parallel).
    ``accumulate`` names the parameter-gradient tensors: with ``grad_accum``
    micro-batches their reduction is paid once per iteration, so per
    micro-batch it costs ``1 / grad_accum``."""
    shape = mm.shape
    groups: list[Group] = []
    group_of_tensor: dict[int, int] = {}
    strat_cache: dict[tuple, list[Strategy]] = {}

    reshard_cache: dict[tuple, tuple[float, float]] = {}

    def reshard(t: int, src: ISpec, dst: ISpec) -> tuple[float, float]:
        if src == dst:
            return 0.0, 0.0
        key = (t, src, dst)
        if key not in reshard_cache:
            tt = graph.tensors[t]
            reshard_cache[key] = reshard_cost(mm, tt.shape, tt.nbytes, src, dst)
        return reshard_cache[key]

    # ---- placeholders for inputs -----------------------------------------
    for k, inp in enumerate(graph.inputs):
        t = graph.tensors[inp.tensor]
        specs = enumerate_specs(t.shape, shape) or (replicated(len(t.shape)),)
        if input_filter is not None:
            specs = tuple(s for s in specs if input_filter(inp, s)) or (replicated(len(t.shape)),)
        strategies = [Strategy("in", (), (s,), 0.0, 0.0, 0.0) for s in specs]
        g = Group(len(groups), f"in{k}", None, k, strategies)
        g.specs = [{inp.tensor: s} for s in specs]
        g.reads = [[] for _ in specs]
        g.cost = [0.0] * len(specs)
        g.compute = [0.0] * len(specs)
        g.comm = [0.0] * len(specs)
        g.comm_bytes = [0.0] * len(specs)
        groups.append(g)
        group_of_tensor[inp.tensor] = g.gid

    # ---- operators: new groups or followers ---------------------------------
    for node in graph.nodes:
        space = node_space(graph, node)
        k = _follow_input(space, node, graph)
        main = node.inputs[k] if k is not None else None
        if main is not None and main in group_of_tensor and groups[group_of_tensor[main]].size > 1:
            g = groups[group_of_tensor[main]]
            out_t = node.outputs[0]
            out_shape = graph.tensors[out_t].shape
            dtype = node_dtype(graph, node)
            # XLA fuses chains of elementwise ops: count the result's bytes only
            nbytes = graph.tensors[out_t].nbytes if space.elementwise else node.bytes_accessed
            out_bytes = graph.tensors[out_t].nbytes
            mapped_cache: dict[ISpec, _Mapped] = {}
            for i in range(g.size):
                ms = g.specs[i][main]
                mp = mapped_cache.get(ms)
                if mp is None:
                    mp = mapped_cache[ms] = _map_through(space, k, ms, shape, out_shape)
                g.specs[i][out_t] = mp.out
                t = compute_time(mm.device, node.flops / mp.shards, nbytes / mp.shards, dtype)
                c_time, c_bytes = reshard(main, ms, mp.main_req)
                if mp.reduce_axes:
                    r_time, r_bytes = all_reduce(mm, mp.reduce_axes,
                                                 out_bytes / num_shards(mp.out, shape))
                    c_time, c_bytes = c_time + r_time, c_bytes + r_bytes
                g.cost[i] += t + c_time
                g.compute[i] += t
                g.comm[i] += c_time
                g.comm_bytes[i] += c_bytes
                for p, rs in mp.reads:
                    if graph.tensors[node.inputs[p]].shape:
                        g.reads[i].append((node.inputs[p], rs))
            g.members.append(node.id)
            group_of_tensor[out_t] = g.gid
            continue
        key = (node.primitive, tuple(graph.tensors[t].shape for t in node.inputs),
               tuple(graph.tensors[t].shape for t in node.outputs), node.params,
               node.flops, node.bytes_accessed)
        strategies = strat_cache.get(key)
        if strategies is None:
            strategies = node_strategies(graph, node, mm)
            strat_cache[key] = strategies
        g = Group(len(groups), f"n{node.id}_{node.primitive}", node.id, None, list(strategies))
        for s in strategies:
            g.specs.append(dict(zip(node.outputs, s.out_specs)))
            g.reads.append([(t, sp) for t, sp in zip(node.inputs, s.in_specs) if sp is not None])
            g.cost.append(s.cost)
            g.compute.append(s.compute_s)
            g.comm.append(s.comm_s)
            g.comm_bytes.append(s.comm_bytes)
        groups.append(g)
        for t in node.outputs:
            group_of_tensor[t] = g.gid

    # ---- reads -> edges (or costs inside a group) ------------------------------
    edge_acc: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}

    def add_read(h: Group, g: Group, t: int, j: int, req: ISpec) -> None:
        if h.gid == g.gid:
            c, b = reshard(t, g.specs[j][t], req)
            g.cost[j] += c
            g.comm[j] += c
            g.comm_bytes[j] += b
            return
        if (h.gid, g.gid) not in edge_acc:
            edge_acc[h.gid, g.gid] = (np.zeros((h.size, g.size)), np.zeros((h.size, g.size)))
        sec, byt = edge_acc[h.gid, g.gid]
        for i in range(h.size):
            c, b = reshard(t, h.specs[i][t], req)
            sec[i, j] += c
            byt[i, j] += b

    for g in groups:
        for j in range(g.size):
            seen: set[tuple[int, ISpec]] = set()
            for t, req in g.reads[j]:
                if (t, req) in seen or not graph.tensors[t].shape or t not in group_of_tensor:
                    continue
                seen.add((t, req))
                add_read(groups[group_of_tensor[t]], g, t, j, req)

    # alias: the new value of an updated input must end in that input's layout
    for o in graph.outputs:
        if o.updates is None or o.tensor not in group_of_tensor:
            continue
        p = groups[group_of_tensor[graph.inputs[o.updates].tensor]]
        in_t = graph.inputs[o.updates].tensor
        if not graph.tensors[in_t].shape:
            continue
        h = groups[group_of_tensor[o.tensor]]
        for j in range(p.size):
            add_read(h, p, o.tensor, j, p.specs[j][in_t])

    edges, edge_costs = [], []
    for (u, v), (sec, byt) in edge_acc.items():
        edges.append(Edge(u, v, sec, name=f"edge_{groups[u].name}_{groups[v].name}"))
        edge_costs.append((u, v, sec, byt))

    # ---- memory rows ------------------------------------------------------------
    budget = mm.memory_budget if memory_budget is None else memory_budget
    resident: dict[int, np.ndarray] = {}
    for g in groups:
        if g.input_index is not None:
            t = graph.inputs[g.input_index].tensor
            nb = graph.tensors[t].nbytes
            resident[g.gid] = np.array([nb / num_shards(s[t], shape) for s in g.specs])
    rows = []
    live = liveness(graph)
    for step in peak_steps(live, memory_points):
        coefs = {gid: v.copy() for gid, v in resident.items()}
        for t in live.live_at(step):
            if t not in group_of_tensor:
                continue
            g = groups[group_of_tensor[t]]
            nb = graph.tensors[t].nbytes
            v = np.array([nb / num_shards(s[t], shape) for s in g.specs])
            coefs[g.gid] = coefs[g.gid] + v if g.gid in coefs else v
        rows.append(MemoryRow(coefs, budget, name=f"mem_node{step}"))
    if not rows:
        rows.append(MemoryRow(dict(resident), budget, name="mem_resident"))

    # Gradient accumulation: the groups that make parameter gradients
    # communicate once per iteration, not once per micro-batch.
    if grad_accum > 1:
        for gid in {group_of_tensor[t] for t in accumulate if t in group_of_tensor}:
            g = groups[gid]
            for i in range(g.size):
                saved = g.comm[i] * (1 - 1 / grad_accum)
                g.cost[i] -= saved
                g.comm[i] -= saved
                g.comm_bytes[i] /= grad_accum

    # Ties in time go to the layout with less resident memory (1 GiB ~ 1 ns).
    costs = [np.array(g.cost) + (TIE_BREAK_S_PER_BYTE * resident[g.gid] if g.gid in resident else 0.0)
             for g in groups]
    problem = IlpProblem([g.name for g in groups], costs, edges, rows)
    return Built(problem, groups, group_of_tensor, edge_costs, resident)
