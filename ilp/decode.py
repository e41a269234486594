"""From a solved ILP back to a plan: layouts, constraints, collectives, memory.

:func:`explain` lists the collectives a choice implies, :func:`read_layouts`
the operands it reshards, :func:`decode` turns a :class:`Solution` into an
:class:`IntraOpResult`.
"""
from __future__ import annotations

import dataclasses
import math
from collections import Counter
from dataclasses import dataclass

import numpy as np

from ..cost_model.memory import live_bytes
from ..cost_model.collectives import COMBINE_BYTES, fixed_s
from ..cost_model.mesh import MeshModel
from ..cost_model.sharding import ISpec, num_shards, reshard_steps, spec_names
from ..graph import PARAM, Graph, forward_nodes
from ..plan import LogicalMesh, Spec
from .accumulation import deferrable, rows_axes, summed_axes
from .build import Built, first_node, follow_input, map_through, stored_liveness
from .strategies import collectives_of, node_space, sum_all_reduces, unmerged_s
from .problem import Solution


@dataclass(frozen=True)
class PlannedCollective:
    """One collective the chosen plan implies (for reports and verification)."""
    kind: str          # HLO opcode family: all-reduce, all-gather, all-to-all, ...
    seconds: float
    nbytes: float      # result bytes on one device
    tensor: int        # the tensor it acts on (the result, for a reduction)
    where: str         # which operator or read causes it
    key: tuple = ()    # reshardings: (tensor, source layout, layout after the step)
    group: int = -1    # the ILP group that pays for it
    internal: bool = True   # paid inside the group (not on an edge between groups)
    # with gradient accumulation: runs once per step (a gradient reduction,
    # the update's work), its seconds and bytes here per micro-batch
    per_step: bool = False
    # reduces a parameter gradient (an operator of Built.grad_nodes)
    gradient: bool = False
    # a gradient's reduction: the mesh axes it runs over (merge_gradients)
    axes: tuple[int, ...] = ()


def explain(graph: Graph, mm: MeshModel, built: Built, choice, *,
            dedupe: bool = True, merge: bool = True) -> list[PlannedCollective]:
    """Every collective the choice ``choice`` (one strategy per group) implies,
    in the order of the groups: the partial-sum reductions of operators, the
    reshardings inside a group and those on the reads between groups.

    With ``dedupe`` a resharding step that several readers of one tensor share
    (same tensor, same source layout, same collective, same result layout) is
    listed once: XLA emits one collective for them (common-subexpression
    elimination), while the ILP's objective charges every reader.  With
    ``merge`` the gradient reductions are merged (:func:`merge_gradients`):
    the ILP leaves out their fixed cost, a constant of the plan.

    With gradient accumulation (``built.grad_accum`` micro-batches a step)
    what runs once a step is charged ``1 / grad_accum`` of its size, as the
    ILP charges it: the gradient reductions, the update's own work and what
    it reads, the new values' reshardings into their inputs' layouts.  Any
    other read, e.g. of a parameter gathered for the forward, is paid every
    micro-batch."""
    groups = built.groups
    shape = mm.shape
    spec_of: dict[int, ISpec] = {}
    for g, c in zip(groups, choice):
        spec_of.update(g.specs[c])
    out: list[PlannedCollective] = []
    accum = built.grad_accum > 1
    f = 1.0 / built.grad_accum if accum else 1.0

    def own_once(gid: int, nid: int, axes: frozenset[int], in_specs) -> bool:
        """Is the communication of group ``gid``'s operator ``nid`` (summing
        over mesh ``axes``, reading its operands as ``in_specs``) paid once a
        step?  The update's all of it; in a group making a gradient, the
        reductions of the gradient's own operators over the axes the runtime
        defers."""
        return accum and (nid in built.update_nodes or
                          (gid in built.accumulated and nid in built.grad_nodes
                           and deferrable(axes, built.defer_axes,
                                          rows_axes(graph, graph.nodes[nid].inputs, in_specs))))

    def add(pc: PlannedCollective, once: bool) -> None:
        out.append(dataclasses.replace(pc, seconds=pc.seconds * f, nbytes=pc.nbytes * f,
                                       per_step=True) if once else pc)

    def steps_of(t: int, src: ISpec, dst: ISpec, where: str, gid: int, internal: bool,
                 once: bool, gradient: bool = False) -> None:
        tt = graph.tensors[t]
        for kind, sec, b, after in reshard_steps(mm, tt.shape, tt.nbytes, src, dst):
            add(PlannedCollective(kind, sec, b, t, where, (t, src, kind, after), gid, internal,
                                  gradient=gradient), once)

    gt = built.group_of_tensor
    for g, c in zip(groups, choice):
        if g.root_node is not None:
            node = graph.nodes[g.root_node]
            s = g.strategies[c]
            grad = node.id in built.grad_nodes
            axes = summed_axes(s.name, mm.mesh.axes)
            for kind, sec, nbytes, ax in collectives_of(s, mm.mesh.axes):
                add(PlannedCollective(kind, unmerged_s(mm, kind, sec, ax) if grad else sec,
                                      nbytes, node.outputs[0],
                                      f"n{node.id} {node.primitive} [{s.name}]",
                                      (), g.gid, True, gradient=grad, axes=ax if grad else ()),
                    own_once(g.gid, node.id, axes, s.in_specs))
        for nid in g.members:
            node = graph.nodes[nid]
            space = node_space(graph, node)
            k = follow_input(space, node, graph)
            main = node.inputs[k]
            out_t = node.outputs[0]
            mp = map_through(space, k, spec_of[main], shape, graph.tensors[out_t].shape)
            where = f"n{nid} {node.primitive} (follower)"
            grad = nid in built.grad_nodes
            axes = frozenset(mp.reduce_axes)
            once = own_once(g.gid, nid, axes, mp.in_specs(k, len(node.inputs)))
            steps_of(main, spec_of[main], mp.main_req, where, g.gid, True, once, grad)
            for kind, sec, b, ax in sum_all_reduces(mm, mp.reduce_groups, graph.tensors[
                    out_t].nbytes / num_shards(mp.out, shape)):
                add(PlannedCollective(kind, unmerged_s(mm, kind, sec, ax) if grad else sec, b,
                                      out_t, where, (), g.gid, True, gradient=grad,
                                      axes=ax if grad else ()), once)
        seen: set[tuple[int, ISpec]] = set()
        for t, req in g.reads[c]:
            if (t, req) in seen or not graph.tensors[t].shape or t not in gt:
                continue
            seen.add((t, req))
            what = (f"read by n{g.root_node} {graph.nodes[g.root_node].primitive}"
                    if g.root_node is not None else f"read by {g.name}")
            internal = gt[t] == g.gid
            # (once a step where only the update, or a gradient's operators
            # on its way to it, read it: as the ILP charges it)
            once = accum and (t, req) not in g.steady_reads[c]
            steps_of(t, spec_of[t], req, what, g.gid, internal, once)
    for o in graph.outputs:
        if o.updates is None or o.tensor not in gt:
            continue
        in_t = graph.inputs[o.updates].tensor
        if not graph.tensors[in_t].shape:
            continue
        p = gt[in_t]
        once = len(out)
        # the new value arrives once per iteration
        steps_of(o.tensor, spec_of[o.tensor], spec_of[in_t], f"update of input {o.updates}",
                 p, gt[o.tensor] == p, accum)
        if gt[o.tensor] in built.per_iteration:
            out[once:] = [dataclasses.replace(pc, group=gt[o.tensor]) for pc in out[once:]]
    if dedupe:
        # (a resharding that both a micro-batch's programs and the update
        # do runs in each: they are separate programs; so are a pipeline
        # stage's forward and backward.  A jax.checkpoint's replay reads its
        # operands through the runtime's fence, so what it reshards is
        # resharded again, apart from the forward's)
        fwd = built.split_programs
        replayed = _replayed(graph)

        def program(pc: PlannedCollective) -> tuple:
            if pc.group < 0:
                return (pc.per_step,)
            node = first_node(groups[pc.group])
            return (pc.per_step, fwd is not None and node in fwd, node in replayed)
        seen_keys: set[tuple] = set()
        kept = []
        for pc in out:
            if pc.key:
                if (pc.key,) + program(pc) in seen_keys:
                    continue
                seen_keys.add((pc.key,) + program(pc))
            kept.append(pc)
        out = kept
    return merge_gradients(mm, out, f) if merge else out


def _replayed(graph: Graph) -> frozenset[int]:
    """The operators a user's ``jax.checkpoint`` runs again in the backward:
    traced under remat, outside the forward."""
    if not any(n.remat for n in graph.nodes):
        return frozenset()
    fwd = forward_nodes(graph)
    return frozenset(n.id for n in graph.nodes if n.remat and not fwd[n.id])


def merge_gradients(mm: MeshModel, planned: list[PlannedCollective], f: float = 1.0
                    ) -> list[PlannedCollective]:
    """XLA merges a step's gradient reductions over the same devices (they do
    not depend on each other) into collectives of up to ``COMBINE_BYTES``:
    each merged collective pays the fixed cost
    (:func:`meshplan.cost_model.collectives.fixed_s`) that the gradients'
    own entries leave out, charged on the last gradient it merges.  ``f``:
    the share of a once-a-step collective that one micro-batch pays."""
    merged: dict[tuple, tuple[int, float]] = {}     # (kind, axes, once): last, bytes
    for i, pc in enumerate(planned):
        if pc.gradient and pc.axes:
            k = (pc.kind, pc.axes, pc.per_step)
            merged[k] = (i, merged.get(k, (0, 0.0))[1] + pc.nbytes / (f if pc.per_step else 1))
    out = list(planned)
    for (kind, axes, once), (last, nbytes) in merged.items():
        fixed = math.ceil(nbytes / COMBINE_BYTES) * fixed_s(mm, kind, axes)
        out[last] = dataclasses.replace(out[last], seconds=out[last].seconds
                                        + fixed * (f if once else 1.0))
    return out


def read_layouts(graph: Graph, mm: MeshModel, built: Built, choice, *,
                 all_reads: bool = False) -> list[tuple[int, int, ISpec]]:
    """``(node id, operand position, layout)`` for every operand that the chosen
    strategies read in a layout other than the one its producer leaves: where
    the plan reshards (with ``all_reads``, every laid-out operand).  A runtime
    that constrains each operand as its reader takes it makes XLA do exactly
    these reshardings; with one constraint per value only, XLA's partitioner
    picks its own algorithm for such a reader."""
    shape = mm.shape
    spec_of: dict[int, ISpec] = {}
    for g, c in zip(built.groups, choice):
        spec_of.update(g.specs[c])
    out = []

    def add(nid: int, p: int, t: int, req: ISpec) -> None:
        if t in spec_of and graph.tensors[t].shape and (all_reads or spec_of[t] != req):
            out.append((nid, p, req))

    for g, c in zip(built.groups, choice):
        if g.root_node is not None:
            node = graph.nodes[g.root_node]
            s = g.strategies[c]
            for p, (t, req) in enumerate(zip(node.inputs, s.in_specs)):
                if req is not None:
                    add(node.id, p, t, req)
        for nid in g.members:
            node = graph.nodes[nid]
            space = node_space(graph, node)
            k = follow_input(space, node, graph)
            main = node.inputs[k]
            mp = map_through(space, k, spec_of[main], shape, graph.tensors[node.outputs[0]].shape)
            add(nid, k, main, mp.main_req)
            for p, req in mp.reads:
                add(nid, p, node.inputs[p], req)
    return out


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
    # the backward's gradient reductions in program order, for
    # cost_model.overlap: (compute_s, reduce_s) pairs, see grad_steps()
    grad_steps: tuple[tuple[float, float], ...] = ()
    # the mesh axes over which gradient sums wait for the step's last
    # micro-batch (ilp.build Group.waits of the chosen strategies)
    waiting_axes: frozenset[int] = frozenset()
    # (node id, compute_s, comm_s) at the chosen strategies: each follower's
    # compute under its own node, the rest of its group's (the resharding of
    # its reads included) under the group's first operator (-1: a
    # placeholder's, e.g. element-wise updates of an input): what replaying
    # part of the graph costs (recomputation)
    node_seconds: tuple[tuple[int, float, float], ...] = ()
    # (node id, bytes): the bytes of its group's collectives under the
    # group's first operator, as node_seconds puts their seconds
    node_bytes: tuple[tuple[int, float], ...] = ()

    def seconds_of(self, nodes: frozenset[int]) -> tuple[float, float]:
        """(compute, comm) of the groups whose first operator is among ``nodes``."""
        mine = [(c, m) for n, c, m in self.node_seconds if n in nodes]
        return sum(c for c, _ in mine), sum(m for _, m in mine)

    def bytes_of(self, nodes: frozenset[int]) -> float:
        """What the collectives of :meth:`seconds_of`'s groups send per device."""
        return sum(b for n, b in self.node_bytes if n in nodes)

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
    paid: dict[int, float] = {}     # group -> seconds of its collectives
    sent: dict[int, float] = {}     # group -> their bytes
    for pc in planned:
        by_kind[pc.kind] = by_kind.get(pc.kind, 0.0) + pc.nbytes
        paid[pc.group] = paid.get(pc.group, 0.0) + pc.seconds
        sent[pc.group] = sent.get(pc.group, 0.0) + pc.nbytes
    return IntraOpResult(mm.mesh, sol.objective, compute, comm, comm_bytes, peak, input_specs,
                         output_specs, tuple(constraints), tuple(strategies), sol, len(groups),
                         tuple(sorted(by_kind.items())), planned, read_constraints,
                         grad_steps(built, choice, planned),
                         frozenset().union(*(g.waits[c] for g, c in zip(groups, choice)
                                             if g.waits and built.grad_accum > 1)),
                         node_seconds(built, choice, paid),
                         tuple((node_seconds_key(built.groups[gid]), b)
                               for gid, b in sorted(sent.items())))


def _compute_by_node(g, c: int, built: Built) -> list[tuple[int, float, bool]]:
    """``(node, compute_s, is the update's)`` making up ``g.compute[c]``: each
    follower's own, the rest under the group's first operator (-1: none),
    the update's share of that rest apart (it runs once a step)."""
    first = node_seconds_key(g)
    once = 1.0 / built.grad_accum if built.grad_accum > 1 else 1.0
    own = [(nid, mc[c] * once, True) if nid in built.update_nodes else (nid, mc[c], False)
           for nid, mc in zip(g.members, g.member_compute)]
    root_update = g.update[c][0] - sum(s for _, s, upd in own if upd)
    rest = g.compute[c] - sum(s for _, s, _ in own) - root_update
    return [(first, rest, False), (first, root_update, True), *own]


def node_seconds_key(g) -> int:
    """The node :func:`node_seconds` puts a group's collectives under."""
    first = first_node(g)
    return -1 if first is None else first


def node_seconds(built: Built, choice, paid: dict[int, float]
                 ) -> tuple[tuple[int, float, float], ...]:
    """``IntraOpResult.node_seconds``: each follower's own compute under its
    node, the rest of its group's compute and all of its collectives under
    the group's first operator."""
    out = []
    for g, c in zip(built.groups, choice):
        parts = _compute_by_node(g, c, built)
        out.append((parts[0][0], parts[0][1] + parts[1][1], paid.get(g.gid, 0.0)))
        out.extend((nid, s, 0.0) for nid, s, _ in parts[2:])
    return tuple(out)


def grad_steps(built: Built, choice, planned) -> tuple[tuple[float, float], ...]:
    """The gradient reductions of ``choice`` in program order (each operator
    at its own place, as :func:`node_seconds` prices it) as
    :class:`meshplan.cost_model.overlap.StageWork` takes them:
    ``(compute_s, reduce_s)``, the compute since the previous reduction
    (the first one's includes the forward), then a reduction (once per
    iteration: not divided over the micro-batches); a last pair holds the
    compute after the last gradient.  Reductions run merged
    (:func:`merge_gradients`) and a merged collective waits for its last
    gradient: the groups making gradients are taken in program order into
    reductions of at least ``COMBINE_BYTES`` each (the last, what is left).
    The update's compute is left out: it waits for the reductions.  Empty
    when nothing reduces a gradient."""
    reduce: dict[int, tuple[float, float]] = {}     # group: seconds, bytes
    for pc in planned:
        if pc.gradient and pc.group in built.grad_groups and pc.internal:
            once = built.grad_accum if pc.per_step else 1
            sec, b = reduce.get(pc.group, (0.0, 0.0))
            reduce[pc.group] = (sec + pc.seconds * once, b + pc.nbytes * once)
    if not any(sec for sec, _ in reduce.values()):
        return ()
    # (program position, compute, group reducing there or -1): each follower
    # at its own node (a backward operator can join a forward operator's
    # group), the rest of a group at its first, its reductions right after
    # the operator making its gradient; the update waits for them all
    events: list[tuple[float, float, int]] = []
    for g in built.groups:
        first = first_node(g)
        if g.gid in built.update_groups or first is None:
            continue
        events.extend((nid, s, -1) for nid, s, upd in _compute_by_node(g, choice[g.gid], built)
                      if not upd)
        if g.gid in reduce:
            makers = [n for n in [g.root_node, *g.members] if n in built.grad_nodes]
            events.append((max(makers, default=first) + 0.5, 0.0, g.gid))
    steps, compute, held, merged, nbytes = [], 0.0, 0.0, 0.0, 0.0
    for _, work, gid in sorted(events):
        compute += work
        sec, b = reduce.get(gid, (0.0, 0.0))
        if sec > 0:
            held, merged, nbytes, compute = held + compute, merged + sec, nbytes + b, 0.0
            if nbytes >= COMBINE_BYTES:
                steps.append((held, merged))
                held = merged = nbytes = 0.0
    if merged > 0:
        steps.append((held, merged))
    if compute > 0:
        steps.append((compute, 0.0))
    return tuple(steps)


def peak_memory(graph: Graph, mm: MeshModel, tensor_spec: dict[int, ISpec]) -> int:
    """Resident inputs plus the peak of live intermediates, per device.
    Values computed from constants alone (a causal mask broadcast to the
    scores' shape) and values passed only between fused element-wise
    operators are not counted: XLA keeps them out of memory."""
    total, _, act, _ = _peak(graph, mm.shape, tensor_spec)
    return int(total + act)


def peak_parts(graph: Graph, shape: tuple[int, ...], tensor_spec: dict[int, ISpec]
               ) -> tuple[int, dict[str, float]]:
    """:func:`peak_memory` and what it holds per device: the inputs by role,
    and the intermediates live at the peak made by the forward pass
    (``"forward"``), those of the backward and update shaped like a parameter
    (``"grads"``: a parameter's gradient) and the others (``"other"``)."""
    total, resident, act, live = _peak(graph, shape, tensor_spec)
    local = _local(graph, shape, tensor_spec)
    fwd, made_by = forward_nodes(graph), graph.producer
    # each parameter's shape and dtype once per parameter (so one gradient each)
    unclaimed = Counter((graph.tensors[i.tensor].shape, graph.tensors[i.tensor].dtype)
                        for i in graph.inputs if i.role == PARAM)
    parts = {f"input:{role}": b for role, b in resident.items()}
    parts.update(forward=0.0, grads=0.0, other=0.0)
    # (a kept argument's new value: shaped like it, no gradient)
    kept = {o.tensor for o in graph.outputs if o.updates in graph.undonated}
    for t in live:
        key = (graph.tensors[t].shape, graph.tensors[t].dtype)
        if fwd[made_by[t]]:
            parts["forward"] += local(t)
        elif unclaimed[key] > 0 and t not in kept:
            unclaimed[key] -= 1
            parts["grads"] += local(t)
        else:
            parts["other"] += local(t)
    return int(total + act), parts


def _local(graph: Graph, shape: tuple[int, ...], tensor_spec: dict[int, ISpec]):
    kept = graph.kept_updates

    def local(t: int) -> float:
        # (a kept argument's new value is returned in the argument's layout)
        spec = tensor_spec.get(kept.get(t, t))
        nb = graph.tensors[t].nbytes
        return nb / num_shards(spec, shape) if spec is not None else nb
    return local


def _peak(graph: Graph, shape: tuple[int, ...], tensor_spec: dict[int, ISpec]
          ) -> tuple[float, dict[str, float], float, list[int]]:
    """Resident input bytes per device (summed in input order) and by role,
    the peak of live intermediates, and the intermediates live at that peak."""
    local = _local(graph, shape, tensor_spec)
    total = sum(local(i.tensor) for i in graph.inputs)
    resident: dict[str, float] = {}
    for i in graph.inputs:
        resident[i.role] = resident.get(i.role, 0.0) + local(i.tensor)
    intervals = stored_liveness(graph).intervals
    n = len(graph.nodes)
    if not n:
        return total, resident, 0.0, []
    profile = live_bytes(intervals, n, local)
    step = int(np.argmax(profile))
    live = [t for t, (a, b) in intervals.items() if a <= step <= b]
    return total, resident, float(profile[step]), live
