"""From a Graph and a logical mesh to an IlpProblem.

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

import dataclasses
from dataclasses import dataclass, field
from typing import Callable

import math

import numpy as np

from ..cost_model.collectives import all_reduce, fixed_s
from ..cost_model.compute import compute_time, kernel_fixed_time
from ..cost_model.fusion import (fused_bytes, fusion_bytes, kernels, materialised,
                                 materialised_results, moved_bytes)
from ..cost_model.memory import Liveness, live_bytes, liveness, peak_steps
from ..cost_model.mesh import MeshModel
from ..cost_model.sharding import ISpec, num_shards, price_moves, replicated, reshard_moves
from ..graph import (BATCH, CONST, IDENTITY_MARKERS, LITERAL, OPT_STATE, PARAM, STATE, Graph,
                     GraphInput, Tensor)
from ..layout_moves import spec_from_names
from .accumulation import (deferrable, gradient_only, held_copies, rows_axes, step_split,
                           summed_axes, update_nodes)
from .caches import IlpCaches, ReshardMemo
from .problem import Edge, IlpProblem, MemoryRow
from .rules import OpSpace
from .strategies import (MATMULS, Strategy, all_strategies, collectives_of, keep_strategies,
                         merged_comm_s, node_dtype, node_space, sum_all_reduces, unmerged_s)


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
    # per strategy: HLO collective kind -> bytes of the comm_bytes above
    comm_kinds: list[dict[str, float]] = field(default_factory=list)
    members: list[int] = field(default_factory=list)   # follower node ids
    # per member, per strategy: its own compute among ``compute`` (a group can
    # hold forward and backward operators: recomputation replays only some)
    member_compute: list[list[float]] = field(default_factory=list)
    # per strategy: the (tensor id, layout) reads made by an operator that
    # runs every micro-batch; the other reads are the update's, once a step
    steady_reads: list[set[tuple[int, ISpec]]] = field(default_factory=list)
    # per strategy: the part of comm / comm_bytes that reduces a parameter
    # gradient (made by an operator of ``grad_nodes``): with gradient
    # accumulation it runs once a step; the group's other collectives (e.g.
    # the input gradient of a matmul whose bias gradient follows it) do not
    grad_comm: list[float] = field(default_factory=list)
    grad_comm_bytes: list[float] = field(default_factory=list)
    # per strategy: the fixed costs its gradient reductions leave out, paid
    # once by the merged collective (priced_as_whole_step shares them out)
    grad_fixed: list[float] = field(default_factory=list)
    # per strategy: the mesh axes over which those reductions wait for the
    # step's last micro-batch (a running sum kept whole along them)
    waits: list[frozenset[int]] = field(default_factory=list)
    # per strategy: [compute, comm, comm bytes] of the above that the
    # optimizer update's operators (root or followers) and reads add: once
    # per ``grad_accum`` micro-batches, whichever group they joined (Adam's
    # element-wise update follows its weight gradient's matmul)
    update: list[list[float]] = field(default_factory=list)

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
    # groups whose own communication is paid once per ``grad_accum`` micro-batches
    accumulated: frozenset[int] = frozenset()
    grad_accum: int = 1
    # groups of the optimizer update: everything they cost is paid once per
    # ``grad_accum`` micro-batches
    per_iteration: frozenset[int] = frozenset()
    # whatever ``grad_accum``: the groups that make parameter gradients (their
    # own collectives are the gradient reductions) and the groups of the
    # update (what reads a gradient); cost_model.overlap needs both
    grad_groups: frozenset[int] = frozenset()
    update_groups: frozenset[int] = frozenset()
    # the operators whose results only feed parameter gradients (their
    # reductions can wait for the last micro-batch): see gradient_only
    grad_nodes: frozenset[int] = frozenset()
    # their results and what they pass a gradient through (see gradient_only)
    grad_tensors: frozenset[int] = frozenset()
    # the mesh axes whose gradient sums the runtime keeps apart until the last
    # micro-batch (those the batch is split over); None: any
    defer_axes: frozenset[int] | None = None
    # where the forward and the backward run as separate programs (a
    # pipeline stage's), the forward's nodes: a resharding that readers in
    # both need runs in each (None: one program)
    split_programs: frozenset[int] | None = None
    # the optimizer update's operators (ilp.accumulation.update_nodes): once
    # a step where ``grad_accum`` > 1, and after the gradient reductions
    update_nodes: frozenset[int] = frozenset()
    # what the memory rows of node positions hold besides the values live
    # there (the inputs on the device, the held copies), and those copies:
    # more such rows can be added (rows_over)
    memory_base: dict[int, np.ndarray] | None = None
    held: frozenset[int] = frozenset()
    live: Liveness | None = None        # (stored_liveness of the graph, computed once)


def first_node(g: Group) -> int | None:
    """The group's operator first in program order (None: a placeholder)."""
    return g.root_node if g.root_node is not None else min(g.members, default=None)


def follow_input(space, node, graph) -> int | None:
    """Position of the operand a node follows, if any.

    Elementwise nodes follow their first same-shaped operand (one that depends
    on the step's inputs when there is one); any other node
    with exactly one laid-out operand (the others scalars or indices) follows
    that operand, its layout mapped through the node's labels.
    """
    if space is None or len(node.outputs) != 1 or space.reduce_each_step:
        return None
    if space.elementwise:
        # a value made from constants alone (a causal mask) adapts to the
        # data it meets for free (each device makes its slice), never the
        # other way round: follow a data operand when there is one
        out_shape = graph.tensors[node.outputs[0]].shape
        cands = [k for k, t in enumerate(node.inputs)
                 if graph.tensors[t].shape == out_shape
                 and graph.tensors[t].kind not in (LITERAL, CONST) and space.in_labels[k]]
        data = [k for k in cands if node.inputs[k] not in graph.constant_tensors]
        # (nor one broadcast from a value of no example, a mask over
        # positions meeting the batch: it follows that value, so it can split
        # none of the rows, and the node would be held whole on them)
        rows = [k for k in data if not _broadcast_over_rows(graph, node.inputs[k])]
        return (rows or data or cands or [None])[0]
    laid_out = [k for k, labs in enumerate(space.in_labels)
                if labs and graph.tensors[node.inputs[k]].kind not in (LITERAL, CONST)]
    others = [k for k, labs in enumerate(space.in_labels) if labs and k not in laid_out]
    return laid_out[0] if len(laid_out) == 1 and not others else None


def _broadcast_over_rows(graph, t: int) -> bool:
    """Whether tensor ``t`` is a broadcast of a smaller value made without
    the batch (while the step has one)."""
    k, batch = graph.producer.get(t), graph.batch_tensors
    if k is None or not batch or t in batch or graph.nodes[k].primitive != "broadcast_in_dim":
        return False
    return graph.tensors[graph.nodes[k].inputs[0]].size < graph.tensors[t].size


@dataclass(frozen=True)
class Mapped:
    """A follower's layout under one layout of the operand it follows."""
    main_req: ISpec                      # the operand as the node needs it
    out: ISpec
    reads: tuple[tuple[int, ISpec], ...]  # other operands: (position, layout)
    # the mesh axes of each summed dimension (ilp.strategies.sum_all_reduces)
    reduce_groups: tuple[tuple[int, ...], ...]
    shards: int

    @property
    def reduce_axes(self) -> tuple[int, ...]:
        return tuple(sorted(a for g in self.reduce_groups for a in g))

    def in_specs(self, k: int, n: int) -> list[ISpec | None]:
        """The layouts of the node's ``n`` operands (``k``: the one followed;
        None: an operand taken as it is)."""
        out: list[ISpec | None] = [None] * n
        out[k] = self.main_req
        for p, req in self.reads:
            out[p] = req
        return out


def map_through(space, k: int, spec: ISpec, mesh_shape, out_shape) -> Mapped:
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
    groups = tuple(ax for l, ax in sorted(per_label.items()) if l in space.reduce)
    shards = math.prod(mesh_shape[a] for ax in per_label.values() for a in ax)
    return Mapped(main_req, out, reads, groups, shards)


# (input, a layout on offer, the input's tensor) -> is the layout allowed
InputFilter = Callable[[GraphInput, ISpec, Tensor], bool]


@dataclass(frozen=True)
class Pins:
    """Layouts a layer's boundary values must meet, those of the layers it
    shares a stage with (dp_search.stages.StageCosts.member): ``inputs``
    (position in Graph.inputs, layout) are read as their maker leaves them;
    ``outputs`` (position in Graph.outputs, layout) are wanted so by their
    reader, and each layout of their maker pays the resharding to it.
    Layouts as mesh-axis names (IntraOpResult's specs)."""
    inputs: tuple[tuple[int, tuple], ...] = ()
    outputs: tuple[tuple[int, tuple], ...] = ()

    def __bool__(self) -> bool:
        return bool(self.inputs or self.outputs)


def _restrict(g: Group, ok: list[int]) -> None:
    """Keep only the strategies ``ok`` of group ``g`` (every per-strategy
    list: all the list fields but the members')."""
    for f in dataclasses.fields(g):
        vals = getattr(g, f.name)
        if isinstance(vals, list) and f.name not in ("members", "member_compute"):
            setattr(g, f.name, [vals[j] for j in ok])
    g.member_compute = [[per[j] for j in ok] for per in g.member_compute]


def _add_kinds(d: dict[str, float], steps) -> None:
    """Add the bytes of reshard ``steps`` to ``d`` by collective kind."""
    for kind, _, b, *_ in steps:
        if b:
            d[kind] = d.get(kind, 0.0) + b


@dataclass
class _Resharding:
    """Resharding costs of the tensors of one graph on one mesh model, memoised."""
    graph: Graph
    mm: MeshModel
    memo: ReshardMemo
    moves: dict           # (source, destination) -> reshard_moves(...) on this mesh shape
    # this build's: tensor id -> (shape, bytes), the memo keys' part for it
    _tkey: dict[int, tuple] = field(default_factory=dict)
    # this build's: (writer group, tensor id, layout read) -> column (a
    # group's layouts no longer change once the reads are costed)
    _cols: dict[tuple[int, int, ISpec], tuple[np.ndarray, np.ndarray]] = \
        field(default_factory=dict)

    def _key(self, t: int) -> tuple:
        k = self._tkey.get(t)
        if k is None:
            tt = self.graph.tensors[t]
            k = self._tkey[t] = (tt.shape, tt.nbytes)
        return k

    def steps(self, t: int, src: ISpec, dst: ISpec) -> tuple:
        """(kind, seconds, bytes, layout after) steps of a resharding of tensor ``t``."""
        if src == dst:
            return ()
        key = self._key(t) + (src, dst)     # shared by the tensors of every layer
        hit = self.memo.steps.get(key)
        if hit is None:
            # (what moves depends on the layouts alone: found once for every size)
            moves = self.moves.get((src, dst))
            if moves is None:
                moves = self.moves[src, dst] = reshard_moves(self.mm.shape, src, dst)
            hit = self.memo.steps[key] = price_moves(self.mm, key[1], moves,
                                                     self.memo.collectives)
        return hit

    def cost(self, t: int, src: ISpec, dst: ISpec) -> tuple[float, float]:
        """Seconds and bytes of resharding ``t`` from ``src`` to ``dst``."""
        steps = self.steps(t, src, dst)
        if not steps:
            return 0.0, 0.0
        return sum(x[1] for x in steps), sum(x[2] for x in steps)

    def column(self, h: Group, t: int, req: ISpec) -> tuple[np.ndarray, np.ndarray]:
        """Seconds and bytes of resharding ``t`` from each strategy of ``h`` to ``req``."""
        local = (h.gid, t, req)
        hit = self._cols.get(local)
        if hit is not None:
            return hit
        srcs = tuple(sp[t] for sp in h.specs)
        key = self._key(t) + (srcs, req)
        hit = self.memo.columns.get(key)
        if hit is None:
            # (many strategies share a layout of t: each distinct one costed once)
            per = {src: self.cost(t, src, req) for src in dict.fromkeys(srcs)}
            hit = self.memo.columns[key] = (np.array([per[s][0] for s in srcs], dtype=float),
                                            np.array([per[s][1] for s in srcs], dtype=float))
        self._cols[local] = hit
        return hit


@dataclass
class _Builder:
    """The state :func:`build_problem` fills in, one part after the other."""
    graph: Graph
    mm: MeshModel
    caches: IlpCaches
    rs: _Resharding
    groups: list[Group] = field(default_factory=list)
    group_of_tensor: dict[int, int] = field(default_factory=dict)
    # (reader group, writer group) -> (seconds, bytes) per strategy pair
    edge_acc: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    launches: dict[int, int] = field(default_factory=dict)   # node id -> kernels it launches
    # fusible node id -> (bytes its whole fusion moves, bytes charged to the node)
    fusion_share: dict[int, tuple[float, float]] = field(default_factory=dict)
    # the optimizer update's operators (reading a parameter gradient, directly
    # or not): with gradient accumulation they run once per ``grad_accum``
    # micro-batches, so what they read between groups costs ``once`` of it
    update_nodes: frozenset[int] = frozenset()
    update_values: set[int] = field(default_factory=set)     # what they make
    once: float = 1.0
    grad_nodes: frozenset[int] = frozenset()
    # their results and what they pass a gradient through (see gradient_only)
    grad_tensors: frozenset[int] = frozenset()
    # the mesh axes whose gradient sums the runtime keeps apart until the last
    # micro-batch (those the batch is split over); None: any
    defer_axes: frozenset[int] | None = None
    # an operator's signature (what its OpSpace depends on) -> the OpSpace
    _spaces: dict[tuple, OpSpace | None] = field(default_factory=dict)
    # (signature, followed operand, its layout) -> map_through(...) on this mesh
    _mapped: dict[tuple, Mapped] = field(default_factory=dict)

    def _signature(self, node) -> tuple:
        tensors = self.graph.tensors
        return (node.primitive, tuple(tensors[t].shape for t in node.inputs),
                tuple(tensors[t].shape for t in node.outputs), node.params)

    def _space(self, node):
        """:func:`node_space`, once per signature (a layer repeats its operators)."""
        sig = self._signature(node)
        if sig not in self._spaces:
            self._spaces[sig] = node_space(self.graph, node)
        return self._spaces[sig]

    # ---- placeholders for inputs -----------------------------------------
    def add_input_groups(self, input_filter: InputFilter | None, pins: Pins | None = None) -> None:
        graph, shape = self.graph, self.mm.shape
        pinned = {k: spec_from_names(s, self.mm.mesh.axes) for k, s in (pins.inputs if pins else ())}
        for k, inp in enumerate(graph.inputs):
            t = graph.tensors[inp.tensor]
            specs = self.caches.specs(t.shape, shape) or (replicated(len(t.shape)),)
            if k in pinned:
                specs = (pinned[k],)
            elif input_filter is not None:
                specs = tuple(s for s in specs if input_filter(inp, s, t)) or \
                    (replicated(len(t.shape)),)
                specs = _rows_cut(specs, inp, getattr(input_filter, "batch_axes", ()))
            strategies = [Strategy("in", (), (s,), 0.0, 0.0, 0.0) for s in specs]
            g = Group(len(self.groups), f"in{k}", None, k, strategies)
            g.specs = [{inp.tensor: s} for s in specs]
            g.reads = [[] for _ in specs]
            g.steady_reads = [set() for _ in specs]
            g.cost = [0.0] * len(specs)
            g.compute = [0.0] * len(specs)
            g.comm = [0.0] * len(specs)
            g.comm_bytes = [0.0] * len(specs)
            g.grad_comm = [0.0] * len(specs)
            g.grad_comm_bytes = [0.0] * len(specs)
            g.grad_fixed = [0.0] * len(specs)
            g.waits = [frozenset() for _ in specs]
            g.update = [[0.0, 0.0, 0.0] for _ in specs]
            g.comm_kinds = [{} for _ in specs]
            self.groups.append(g)
            self.group_of_tensor[inp.tensor] = g.gid

    # ---- operators: new groups or followers ---------------------------------
    def add_operator_groups(self) -> None:
        graph = self.graph
        shared = self.mm.device.achieved.fusion_writes_shared
        leaving = materialised_results(graph, shared)     # (what these need)
        traffic = fused_bytes(graph, leaving, shared)
        self.launches = kernels(graph, leaving)
        whole = fusion_bytes(graph, traffic, leaving, shared)
        self.fusion_share = {i: (whole[i], traffic[i]) for i in self.launches if i in whole}
        strat_cache: dict[tuple, list[Strategy]] = {}
        for node in graph.nodes:
            if node.primitive in IDENTITY_MARKERS and len(node.inputs) == len(node.outputs):
                node = self._pass_through(node)
                if node is None:
                    continue
            space = self._space(node)
            moved = moved_bytes(graph, node, traffic)
            if space is not None and space.independent:
                node, left = self._components(node, space, moved)
                if node is None:
                    continue
                space, moved = None, moved * left
            k = follow_input(space, node, graph)
            main = node.inputs[k] if k is not None else None
            gt = self.group_of_tensor
            if main is not None and main in gt and self.groups[gt[main]].size > 1:
                self._add_follower(self.groups[gt[main]], node, space, k, moved)
            else:
                self._add_operator(node, moved, strat_cache)

    def _pass_through(self, node):
        """A marker changes no value: each result joins its operand's group,
        layout and all.  The node of the results left (those whose operand
        has no group yet), or None."""
        loose = []
        for t_in, t_out in zip(node.inputs, node.outputs):
            h = self.group_of_tensor.get(t_in)
            if h is None:
                loose.append(t_out)
                continue
            for spec in self.groups[h].specs:
                spec[t_out] = spec[t_in]
            self.group_of_tensor[t_out] = h
        if not loose:
            return None
        return dataclasses.replace(node, inputs=(), outputs=tuple(loose))

    def _components(self, node, space, moved: float):
        """A per-element cond: each result takes the layout of an operand of
        its component that has a group (joining that group, with its share
        of the work); the component's other operands are read in that layout.
        A component a branch reduces to a scalar (``space.reduce_each_step``)
        adds its share of one all-reduce of the cond's scalars where split
        (XLA combines them).  The node of the results left (no laid-out
        operand) or None, and their share of the work."""
        graph, mm, gt = self.graph, self.mm, self.group_of_tensor
        sizes = [math.prod(graph.tensors[t].shape) for t in node.outputs]
        total = sum(sizes) or 1
        dtype = node_dtype(graph, node)
        summed = {l for l, _ in space.reduce_each_step}
        reduced = {labs for labs in space.out_labels if labs and summed & set(labs)}
        charged: set = set()
        operands: dict[tuple[int, ...], list[int]] = {}
        for p, labs in enumerate(space.in_labels):
            if labs:
                operands.setdefault(labs, []).append(p)
        loose, left = [], 0.0
        for t_out, labs, n in zip(node.outputs, space.out_labels, sizes):
            ops = [p for p in operands.get(labs, []) if node.inputs[p] in gt] if labs else []
            if not ops:
                loose.append(t_out)
                left += n / total
                continue
            lead = max(ops, key=lambda p: self.groups[gt[node.inputs[p]]].size > 1)
            g = self.groups[gt[node.inputs[lead]]]
            share = labs in reduced and labs not in charged
            charged.add(labs)
            for i in range(g.size):
                spec = g.specs[i][node.inputs[lead]]
                g.specs[i][t_out] = spec
                shards = num_shards(spec, mm.shape)
                t = compute_time(mm.device, node.flops * n / total / shards,
                                 moved * n / total / shards, dtype)
                g.cost[i] += t
                g.compute[i] += t
                axes = tuple(sorted({a for dim in spec for a in dim})) if share else ()
                if axes:
                    sec, b = (x / len(reduced) for x in all_reduce(mm, axes, 4.0 * len(reduced)))
                    g.cost[i] += sec
                    g.comm[i] += sec
                    g.comm_bytes[i] += b
                    _add_kinds(g.comm_kinds[i], (("all-reduce", sec, b),))
                if node.id in self.update_nodes:
                    g.update[i][0] += t
                read = [(node.inputs[p], spec) for p in ops if p != lead]
                g.reads[i].extend(read)
                if node.id not in self.update_nodes:
                    g.steady_reads[i].update(read)
            gt[t_out] = g.gid
        if not loose:
            return None, 0.0
        return dataclasses.replace(node, inputs=(), outputs=tuple(loose),
                                   flops=node.flops * left), left

    def _add_follower(self, g: Group, node, space, k: int, nbytes: float) -> None:
        """``node`` joins ``g``, laid out as its operand ``k`` is (XLA fuses
        chains of elementwise ops: ``nbytes`` is what the fusion moves)."""
        graph, mm, shape = self.graph, self.mm, self.mm.shape
        main = node.inputs[k]
        out_t = node.outputs[0]
        out_shape = graph.tensors[out_t].shape
        dtype = node_dtype(graph, node)
        out_bytes = graph.tensors[out_t].nbytes
        sig = self._signature(node) + (k,)
        # (what a strategy adds depends on its layout of the operand alone:
        # worked out once per distinct layout, many strategies share one)
        layouts = [sp[main] for sp in g.specs]
        per_spec: dict[ISpec, tuple] = {}
        axes: dict[ISpec, frozenset[int]] = {}     # (the axes the follower sums over)
        rows: dict[ISpec, frozenset[int] | None] = {}  # (... and those cutting its rows)
        for ms in dict.fromkeys(layouts):
            mp = self._mapped.get(sig + (ms,))
            if mp is None:
                mp = self._mapped[sig + (ms,)] = map_through(space, k, ms, shape, out_shape)
            axes[ms] = frozenset(mp.reduce_axes)
            rows[ms] = rows_axes(graph, node.inputs, mp.in_specs(k, len(node.inputs)))
            t = compute_time(mm.device, node.flops / mp.shards, nbytes / mp.shards, dtype)
            t += self._fixed(node, t)
            steps = self.rs.steps(main, ms, mp.main_req)
            fixed = 0.0
            for kind, sec, b, ax in sum_all_reduces(mm, mp.reduce_groups,
                                                    out_bytes / num_shards(mp.out, shape)):
                if node.id in self.grad_nodes:      # (merged with the others)
                    sec = unmerged_s(mm, kind, sec, ax)
                    fixed += fixed_s(mm, kind, ax)
                steps = steps + ((kind, sec, b),)
            reads = [(node.inputs[p], req) for p, req in mp.reads
                     if graph.tensors[node.inputs[p]].shape]
            per_spec[ms] = (mp.out, t, steps, sum(x[1] for x in steps),
                            sum(x[2] for x in steps), reads, fixed)
        got = [per_spec[ms] for ms in layouts]
        for sp, row in zip(g.specs, got):
            sp[out_t] = row[0]
        g.cost[:] = [c + (row[1] + row[3]) for c, row in zip(g.cost, got)]
        g.compute[:] = [c + row[1] for c, row in zip(g.compute, got)]
        g.comm[:] = [c + row[3] for c, row in zip(g.comm, got)]
        g.comm_bytes[:] = [c + row[4] for c, row in zip(g.comm_bytes, got)]
        if node.id in self.update_nodes:
            for u, row in zip(g.update, got):
                u[0], u[1], u[2] = u[0] + row[1], u[1] + row[3], u[2] + row[4]
        if node.id in self.grad_nodes:
            for i, ms in enumerate(layouts):
                g.grad_fixed[i] += got[i][6]
                if deferrable(axes[ms], self.defer_axes, rows[ms]):
                    g.grad_comm[i] += got[i][3]
                    g.grad_comm_bytes[i] += got[i][4]
                    g.waits[i] |= axes[ms]
        steady = node.id not in self.update_nodes
        for i, row in enumerate(got):
            if row[2]:
                _add_kinds(g.comm_kinds[i], row[2])
            if row[5]:
                g.reads[i].extend(row[5])
                if steady:
                    g.steady_reads[i].update(self._steady(node, row[5]))
        g.members.append(node.id)
        g.member_compute.append([row[1] for row in got])
        self.group_of_tensor[out_t] = g.gid

    def _offered(self, t: int) -> frozenset[ISpec] | None:
        """The layouts the group making ``t`` can leave it in (None: not made
        by a group yet, a literal or constant, read as it comes)."""
        h = self.group_of_tensor.get(t)
        if h is None:
            return None
        return frozenset(sp[t] for sp in self.groups[h].specs if t in sp)

    def _add_operator(self, node, moved: float, strat_cache: dict[tuple, list[Strategy]]) -> None:
        """A group of its own for ``node``, one strategy per way to split it."""
        graph = self.graph
        key = (node.primitive, tuple(graph.tensors[t].shape for t in node.inputs),
               tuple(graph.tensors[t].shape for t in node.outputs), node.params,
               node.flops, moved)
        every = strat_cache.get(key)
        if every is None:
            every = strat_cache[key] = all_strategies(graph, node, self.mm, bytes_accessed=moved)
        # (what the operands' makers offer matters only where there is a cut)
        strategies = keep_strategies(every, lambda: [self._offered(t) for t in node.inputs])
        g = Group(len(self.groups), f"n{node.id}_{node.primitive}", node.id, None, list(strategies))
        steady = node.id not in self.update_nodes
        for s in strategies:
            fixed = self._fixed(node, s.compute_s)
            # (a gradient's reduction is merged with the others)
            comm, fixed_comm = (merged_comm_s(self.mm, s) if node.id in self.grad_nodes
                                else (s.comm_s, 0.0))
            g.specs.append(dict(zip(node.outputs, s.out_specs)))
            g.reads.append([(t, sp) for t, sp in zip(node.inputs, s.in_specs) if sp is not None])
            g.steady_reads.append(self._steady(node, g.reads[-1]) if steady else set())
            g.cost.append(s.compute_s + comm + fixed)
            g.compute.append(s.compute_s + fixed)
            g.comm.append(comm)
            g.comm_bytes.append(s.comm_bytes)
            summed = summed_axes(s.name, self.mm.mesh.axes)
            grad = node.id in self.grad_nodes and deferrable(
                summed, self.defer_axes, rows_axes(graph, node.inputs, s.in_specs))
            g.grad_comm.append(comm if grad else 0.0)
            g.grad_fixed.append(fixed_comm)
            g.waits.append(summed if grad else frozenset())
            g.grad_comm_bytes.append(s.comm_bytes if grad else 0.0)
            g.update.append([s.compute_s + fixed, comm, s.comm_bytes] if not steady
                            else [0.0, 0.0, 0.0])
            kinds: dict[str, float] = {}
            for kind, _, nbytes, _ in collectives_of(s, self.mm.mesh.axes):
                if nbytes:
                    kinds[kind] = kinds.get(kind, 0.0) + nbytes
            g.comm_kinds.append(kinds)
        self.groups.append(g)
        for t in node.outputs:
            self.group_of_tensor[t] = g.gid

    def _steady(self, node, reads) -> set[tuple[int, ISpec]]:
        """Of ``node``'s ``reads``, those paid every micro-batch: not a
        gradient operator's reads of a gradient's value (summed over the
        micro-batches first, resharded once a step)."""
        if node.id not in self.grad_nodes:
            return set(reads)
        return {r for r in reads if r[0] not in self.grad_tensors}

    def _fixed(self, node, roofline_s: float) -> float:
        """Launch and floor of the kernels ``node`` launches (0 for none),
        given the roofline of its own share of the work.  A fusion is one
        kernel: its floor is weighed against the whole fusion's roofline,
        the node's scaled by the bytes of the fusion over the node's own."""
        n = self.launches.get(node.id, 0)
        if not n:
            return 0.0
        whole, own = self.fusion_share.get(node.id, (0.0, 0.0))
        if own > 0:
            roofline_s *= whole / own
        return n * kernel_fixed_time(self.mm.device, roofline_s, node.primitive in MATMULS)

    def add_output_wants(self, pins: Pins | None) -> None:
        """Each layout of the maker of an output its reader wants in another
        layout pays the resharding to it (in the objective only: what the
        plan reports is the layer's own work, the stage charges a resharding
        left between two layers: dp_search.joints)."""
        for k, spec in (pins.outputs if pins else ()):
            t = self.graph.outputs[k].tensor
            g = self.groups[self.group_of_tensor[t]] if t in self.group_of_tensor else None
            if g is None or not self.graph.tensors[t].shape:
                continue
            want = spec_from_names(spec, self.mm.mesh.axes)
            for j in range(g.size):
                if t in g.specs[j]:
                    g.cost[j] += self.rs.cost(t, g.specs[j][t], want)[0]

    # ---- inputs a hand-made method pins to one layout ----------------------------
    def keep_pinned_reads(self) -> None:
        """(DataParallel's replicated weights and batch-split data, say): the
        operators read them as they are laid out, never through a collective,
        or the method would quietly become another one.  Activations from
        another layer are not the method's to pin: sequence parallelism
        hands them over split along the sequence, and the layer gathers them
        where its matmuls need them whole (Korthikanti et al. 2022, 4.2.2)."""
        graph, groups = self.graph, self.groups
        pinned = {graph.inputs[g.input_index].tensor: g.specs[0][graph.inputs[g.input_index].tensor]
                  for g in groups if g.input_index is not None and g.size == 1
                  and graph.inputs[g.input_index].role in _METHOD_ROLES}
        # an activation's rows stay cut over the method's data axes where it
        # is read: a pipeline's backward runs on each data shard's own rows
        # (runtime.pipeline_partial), it never gathers them
        data = tuple(sorted(self.defer_axes or ()))
        rows = {i.tensor: i.batch_dim for i in graph.inputs
                if data and i.role not in _METHOD_ROLES and i.batch_dim is not None}
        if not pinned and not rows:
            return
        for g in groups:
            if g.input_index is not None:
                continue
            ok = [j for j in range(g.size)
                  if not any((t in pinned and self.rs.steps(t, pinned[t], req))
                             or (t in rows and not _cuts_rows(req, rows[t], data))
                             for t, req in g.reads[j])]
            if ok and len(ok) < g.size:
                _restrict(g, ok)

    # ---- reads -> edges (or costs inside a group) ------------------------------
    def _add_read(self, h: Group, g: Group, t: int, j: int, req: ISpec,
                  weight: float = 1.0) -> None:
        """Strategy ``j`` of ``g`` reads ``t`` (made by ``h``) laid out as ``req``,
        ``weight`` times per micro-batch when between groups (a read inside a
        group is paid as the group's own work)."""
        if h.gid == g.gid:
            steps = self.rs.steps(t, g.specs[j][t], req)
            if steps:
                c, b = sum(x[1] for x in steps), sum(x[2] for x in steps)
                g.cost[j] += c
                g.comm[j] += c
                g.comm_bytes[j] += b
                if (t, req) not in g.steady_reads[j]:
                    # (the update's, or a gradient's on its way to it)
                    g.update[j][1] += c
                    g.update[j][2] += b
                _add_kinds(g.comm_kinds[j], steps)
            return
        if (h.gid, g.gid) not in self.edge_acc:
            self.edge_acc[h.gid, g.gid] = (np.zeros((h.size, g.size)), np.zeros((h.size, g.size)))
        sec, byt = self.edge_acc[h.gid, g.gid]
        c, b = self.rs.column(h, t, req)
        sec[:, j] += c * weight
        byt[:, j] += b * weight

    def add_read_edges(self) -> None:
        graph, groups, gt = self.graph, self.groups, self.group_of_tensor
        for g in groups:
            for j in range(g.size):
                seen: set[tuple[int, ISpec]] = set()
                for t, req in g.reads[j]:
                    if (t, req) in seen or not graph.tensors[t].shape or t not in gt:
                        continue
                    seen.add((t, req))
                    w = 1.0 if (t, req) in g.steady_reads[j] else self.once
                    self._add_read(groups[gt[t]], g, t, j, req, w)

    def add_alias_edges(self) -> None:
        """The new value of an updated input must end in that input's layout."""
        graph, groups, gt = self.graph, self.groups, self.group_of_tensor
        for o in graph.outputs:
            if o.updates is None or o.tensor not in gt:
                continue
            p = groups[gt[graph.inputs[o.updates].tensor]]
            in_t = graph.inputs[o.updates].tensor
            if not graph.tensors[in_t].shape:
                continue
            h = groups[gt[o.tensor]]
            for j in range(p.size):     # (the new value arrives once a step)
                self._add_read(h, p, o.tensor, j, p.specs[j][in_t], self.once)

    # ---- gradient accumulation ---------------------------------------------------
    def scale_for_accumulation(self, accumulate: frozenset[int], grad_accum: int
                               ) -> tuple[frozenset[int], frozenset[int]]:
        """The reductions that make parameter gradients run once per
        iteration, not once per micro-batch; so does the update (its
        operators and reads: ``Group.update``, wherever they joined).  (The
        reshardings between groups were weighted as they were added: those
        the update reads, and the new values into their inputs' layouts, once
        per iteration; every other read, e.g. of a parameter that the forward
        gathers, once per micro-batch.)  ``(accumulated, per_iteration)``:
        the groups making gradients, and those holding what the update
        makes."""
        groups = self.groups
        accumulated, updates = self.gradient_groups(accumulate)
        if grad_accum <= 1:
            return accumulated, frozenset()
        f = 1.0 / grad_accum
        for gid in accumulated:
            g = groups[gid]
            for i in range(g.size):
                saved = g.grad_comm[i] * (1 - f)
                g.cost[i] -= saved
                g.comm[i] -= saved
                g.comm_bytes[i] -= g.grad_comm_bytes[i] * (1 - f)
        for g in groups:
            for i, u in enumerate(g.update):
                compute, comm, nbytes = (x * (1 - f) for x in u)
                g.cost[i] -= compute + comm
                g.compute[i] -= compute
                g.comm[i] -= comm
                g.comm_bytes[i] -= nbytes
                u[:] = [x * f for x in u]
        return accumulated, updates

    def gradient_groups(self, accumulate: frozenset[int]) -> tuple[frozenset[int], frozenset[int]]:
        """The groups making the parameter gradients ``accumulate``, and those
        of the update (holding what it makes: ``update_values``)."""
        gt = self.group_of_tensor
        made = frozenset(gt[t] for t in accumulate if t in gt)
        return made, frozenset(gt[t] for t in self.update_values if t in gt) - made

    # ---- memory rows ------------------------------------------------------------
    def resident_bytes(self, held: frozenset[int] = frozenset()) -> dict[int, np.ndarray]:
        """Per input group: the bytes per device of each of its layouts; and
        per group making a value of ``held`` (a parameter's copy held all
        step), that value's."""
        graph, shape = self.graph, self.mm.shape
        resident: dict[int, np.ndarray] = {}
        for g in self.groups:
            if g.input_index is not None:
                t = graph.inputs[g.input_index].tensor
                nb = graph.tensors[t].nbytes
                resident[g.gid] = np.array([nb / num_shards(s[t], shape) for s in g.specs])
        for t in held:
            if t in self.group_of_tensor:
                g = self.groups[self.group_of_tensor[t]]
                v = np.array([graph.tensors[t].nbytes / num_shards(s[t], shape) for s in g.specs])
                resident[g.gid] = resident[g.gid] + v if g.gid in resident else v
        return resident

    def memory_rows(self, resident: dict[int, np.ndarray], budget: float,
                    memory_points: int, held: frozenset[int], live: Liveness) -> list[MemoryRow]:
        """Resident inputs plus live intermediates at the peaks of the liveness
        profile ``live`` (those of ``held`` are among the resident already)."""
        rows = [step_row(self.graph, self.mm.shape, self.groups, self.group_of_tensor, live,
                         step, resident, held, budget)
                for step in peak_steps(live, memory_points)]
        if not rows:
            rows.append(MemoryRow(dict(resident), budget, name="mem_resident"))
        return rows


def step_row(graph: Graph, shape: tuple[int, ...], groups: list[Group],
             group_of_tensor: dict[int, int], live: Liveness, step: int,
             resident: dict[int, np.ndarray], held: frozenset[int], budget: float) -> MemoryRow:
    """The memory row of node position ``step``: ``resident`` plus each value
    live there (but ``held``, among the resident already) in its group's layouts."""
    coefs = {gid: v.copy() for gid, v in resident.items()}
    kept = graph.kept_updates
    for t in live.live_at(step):
        if t not in group_of_tensor or t in held:
            continue
        at = kept.get(t, t)     # (a kept argument's new value: in its layout)
        g = groups[group_of_tensor[at]]
        nb = graph.tensors[t].nbytes
        v = np.array([nb / num_shards(s[at], shape) for s in g.specs])
        coefs[g.gid] = coefs[g.gid] + v if g.gid in coefs else v
    return MemoryRow(coefs, budget, name=f"mem_node{step}")


def rows_over(graph: Graph, shape: tuple[int, ...], built: Built, choice, k: int = 4
              ) -> list[MemoryRow]:
    """Rows for up to ``k`` node positions where ``choice`` holds more than
    the budget though no row bounds them.  The rows bound the peaks of the
    unsharded profile; under the chosen layouts another position can peak
    (a value the solver left whole beside values it split), and the decoded
    plan's peak would pass the budget unnoticed."""
    rows = [r for r in built.problem.memory if r.name.startswith("mem_node")]
    if not rows or built.memory_base is None:
        return []
    budget, bounded = rows[0].budget, {int(r.name[len("mem_node"):]) for r in rows}
    groups, gt = built.groups, built.group_of_tensor
    live = built.live or stored_liveness(graph)

    kept = graph.kept_updates

    def local(t: int) -> float:
        if t not in gt or t in built.held:
            return 0.0
        at = kept.get(t, t)
        g = groups[gt[at]]
        return graph.tensors[t].nbytes / num_shards(g.specs[choice[g.gid]][at], shape)
    base = sum(float(v[choice[gid]]) for gid, v in built.memory_base.items())
    total = base + live_bytes(live.intervals, len(graph.nodes), local)
    over = Liveness(live.intervals, np.where(total > budget * (1 + 1e-9) + 1e-6, total, 0.0))
    steps = [s for s in peak_steps(over, k) if over.profile[s] > 0 and s not in bounded]
    return [step_row(graph, shape, groups, gt, live, s, built.memory_base, built.held, budget)
            for s in steps]


# the inputs whose layouts a hand-made method decides
_METHOD_ROLES = frozenset({PARAM, OPT_STATE, STATE, BATCH})


def update_point(graph: Graph, groups: list[Group], resident: dict[int, np.ndarray]
                 ) -> dict[int, np.ndarray]:
    """Coefficients of the memory when the update runs with offloaded state:
    every input on the device (the state read back for the update), and a
    gradient per parameter, taken as laid out like its parameter."""
    return {gid: v * (2 if graph.inputs[groups[gid].input_index].role == PARAM else 1)
            for gid, v in resident.items()}


def stored_liveness(graph: Graph) -> Liveness:
    """The liveness of the intermediates that occupy memory, as the decoded
    plan's peak counts them: neither values made from constants alone nor
    values passed only between fused operators.  (The memory rows, the
    decoded peak and :func:`meshplan.ilp.memory_floor` must count alike, or
    the floor refuses what the ILP would plan.)"""
    const, kept = graph.constant_tensors, materialised(graph)
    intervals = {t: iv for t, iv in liveness(graph).intervals.items()
                 if t not in const and t in kept}
    return Liveness(intervals, live_bytes(intervals, len(graph.nodes),
                                          lambda t: graph.tensors[t].nbytes))


def _rows_cut(specs: tuple[ISpec, ...], inp: GraphInput, axes: tuple[int, ...]
              ) -> tuple[ISpec, ...]:
    """Of ``specs``, those cutting the micro-batch's rows of a value from
    another layer (``inp.batch_dim``) over the data ``axes`` first, where
    one is on offer: the runtime cuts such a value planned whole where it
    enters (runtime.pipeline_partial), so its gradients are partial sums
    over those axes, charged, not work repeated on every data shard."""
    d = inp.batch_dim
    if d is None or not axes:
        return specs
    cut = tuple(s for s in specs if _cuts_rows(s, d, tuple(axes)))
    return cut or specs


def _cuts_rows(spec: ISpec, dim: int, axes: tuple[int, ...]) -> bool:
    """Does ``spec`` cut dimension ``dim`` over ``axes`` first?"""
    return dim < len(spec) and spec[dim][:len(axes)] == axes


def build_problem(graph: Graph, mm: MeshModel, *, memory_points: int = 4,
                  memory_budget: float | None = None,
                  input_filter: InputFilter | None = None,
                  accumulate: frozenset[int] = frozenset(), grad_accum: int = 1,
                  caches: IlpCaches | None = None,
                  resident_budget: float | None = None,
                  host_inputs: frozenset[int] = frozenset(),
                  pins: Pins | None = None) -> Built:
    """The ILP of ``graph`` on ``mm``.  ``input_filter(input, spec, tensor)`` may restrict
    the layouts an input can take (hand-made methods such as data parallel);
    ``pins`` fixes boundary layouts to those of neighbouring layers.
    ``accumulate`` names the parameter-gradient tensors: with ``grad_accum``
    micro-batches their reduction is paid once per iteration, so per
    micro-batch it costs ``1 / grad_accum``.  ``caches`` may carry memo
    tables from earlier problems (None: a fresh one).  ``resident_budget``
    also bounds the inputs' bytes per device alone (parameters and optimizer
    state: a layer that must share a stage's memory with many others).
    ``host_inputs`` (indices into ``graph.inputs``): inputs kept in host
    memory between steps (meshplan.offload), left out of the memory rows.
    Each gradient's reduction is charged without the fixed cost of the
    collective XLA merges it into (a layer's merge with its stage's other
    layers', which it cannot see): :func:`priced_as_whole_step` shares it
    out where ``graph`` is the whole step."""
    caches = IlpCaches() if caches is None else caches
    b = _Builder(graph, mm, caches, _Resharding(graph, mm, caches.reshard(mm),
                                                caches.moves(mm.shape)))
    split = step_split(graph, accumulate) if accumulate else None
    b.update_nodes, b.update_values = update_nodes(graph, accumulate, split)
    b.grad_nodes, b.grad_tensors = gradient_only(graph, accumulate, b.update_nodes)
    # (a hand-made method splits the batch over axis 0 only: the runtime's
    # partial gradient sums cover that axis, not the tensor-parallel ones)
    batch_axes = getattr(input_filter, "batch_axes", None)
    b.defer_axes = None if batch_axes is None else frozenset(batch_axes)
    if grad_accum > 1:
        b.once = 1.0 / grad_accum
    b.add_input_groups(input_filter, pins)
    b.add_operator_groups()
    b.add_output_wants(pins)
    if input_filter is not None:
        b.keep_pinned_reads()
    b.add_read_edges()
    b.add_alias_edges()
    accumulated, per_iteration = b.scale_for_accumulation(accumulate, grad_accum)
    groups = b.groups
    edges, edge_costs = [], []
    for (u, v), (sec, byt) in b.edge_acc.items():
        edges.append(Edge(u, v, sec, name=f"edge_{groups[u].name}_{groups[v].name}"))
        edge_costs.append((u, v, sec, byt))
    # (with several micro-batches the parameters' copies are held all step)
    held = held_copies(graph, accumulate, split) if grad_accum > 1 else frozenset()
    resident = b.resident_bytes(held)
    budget = mm.memory_budget if memory_budget is None else memory_budget
    on_device = {gid: v for gid, v in resident.items()
                 if groups[gid].input_index not in host_inputs}
    live = stored_liveness(graph)
    rows = b.memory_rows(on_device, budget, memory_points, held, live)
    if resident_budget is not None:
        rows.append(_cap_row(on_device, resident_budget))
    if host_inputs:
        rows.append(MemoryRow(update_point(graph, groups, resident), budget, name="mem_update"))
    # Ties in time go to the layout with less resident memory (1 GiB ~ 1 ns).
    costs = [np.array(g.cost) + (TIE_BREAK_S_PER_BYTE * resident[g.gid] if g.gid in resident else 0.0)
             for g in groups]
    problem = IlpProblem([g.name for g in groups], costs, edges, rows)
    grad_groups, update_groups = b.gradient_groups(accumulate)
    return Built(problem, groups, b.group_of_tensor, edge_costs, resident,
                 accumulated if grad_accum > 1 else frozenset(), grad_accum, per_iteration,
                 grad_groups, update_groups, b.grad_nodes, b.grad_tensors, b.defer_axes,
                 update_nodes=b.update_nodes, memory_base=on_device, held=held, live=live)


def _cap_row(on_device: dict[int, np.ndarray], cap: float) -> MemoryRow:
    return MemoryRow(dict(on_device), cap, name="mem_resident_cap")


def with_resident_cap(built: Built, cap: float) -> Built:
    """What :func:`build_problem` makes with ``resident_budget=cap`` from what
    it made with the same arguments but no ``resident_budget`` and no
    ``host_inputs`` (``built``): the cap is one row more, the rest does not
    depend on it, so a layer solved under several caps is built once."""
    p = built.problem
    if any(r.name == "mem_update" for r in p.memory):
        raise ValueError("with_resident_cap: the problem was built with host inputs")
    problem = IlpProblem(p.names, p.costs, p.edges, p.memory + [_cap_row(built.resident_rows, cap)])
    return dataclasses.replace(built, problem=problem)


def priced_as_whole_step(built: Built, gradients: int) -> Built:
    """``built`` (a problem of the whole step, one micro-batch) with each of
    its ``gradients`` parameter gradients' reductions charged ``1 /
    gradients`` of the fixed cost (launch, ring latency) that XLA's merged
    collective pays once (:func:`meshplan.ilp.decode.merge_gradients`; exact
    where every gradient is reduced over the same axes).  Without it, a plan
    of a latency-bound step gets those reductions for free and may split a
    tiny step for less than the merged collective costs.  Only the
    objective changes: the decode prices the merged collective itself."""
    if built.grad_accum > 1:
        raise ValueError("priced_as_whole_step: the problem accumulates micro-batches")
    share = 1.0 / max(gradients, 1)
    p = built.problem
    costs = [c + share * np.asarray(g.grad_fixed) if any(g.grad_fixed) else c
             for c, g in zip(p.costs, built.groups)]
    return dataclasses.replace(built, problem=IlpProblem(p.names, costs, p.edges, p.memory))
