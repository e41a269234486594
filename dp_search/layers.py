"""Cut a train step's Graph into layers.

1. *Forward* nodes are the ancestors of the step's non-state outputs (the
   loss and other metrics); everything else is backward or update work.
2. The forward nodes, in order, are cut into ``L`` contiguous layers: at the
   user's ``mark_pipeline_boundary`` marks when there are any, otherwise by a
   dynamic program that balances FLOPs and cuts where few bytes cross
   (Alpa's operator clustering, restricted to cheap cut points).
3. Every other node joins the largest layer among its *forward* operands,
   activations before parameters (a backward op reads the activations of its
   own layer, and perhaps values shared by all layers, like a mask made in
   the first; a tied embedding read by the first and the last layer must not
   pull the last layer's backward into the first).  A forward value counts
   as its own layer (its maker's, or a parameter's first reader's), except
   that one the forward of several layers reads (a tied embedding, the
   activation entering a layer) counts as the highest of those layers at
   most the layer of the backward values the op reads: the head's
   ``dlogits @ wte`` joins the head, whose backward made ``dlogits``
   (:func:`_read_layer`).  One that reads no
   forward value inherits the smallest layer among its non-scalar operands
   (the gradient arriving from the layer above is of a higher layer; a
   global gradient norm places nothing).  An update
   reads its parameter, which belongs to the layer of its first forward
   reader, and its gradient, made there.  So a layer's forward, backward
   and updates land together.  Last, a backward op that a higher layer's
   backward reads is raised to that layer, as the pipeline runtime does
   (:func:`_keep_pipeline_order`): each layer costs what its stage runs.
4. Values made from constants alone (a causal mask, a zero cotangent) belong
   to no layer of their own: each layer that reads one computes it, no other
   layer pays for it, and it never crosses a cut (:func:`layer_members`).

Repeated blocks (identical transformer layers written as a Python loop) are
found in the forward op sequence (:func:`find_blocks`); without marks, the
layers are then exactly those blocks plus what comes before and after them,
so identical layers hash equal and the ILP solves each kind once.
:func:`group_layers` merges consecutive layers into fewer, balanced groups
for the stage DP.
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from ..contributions import graph_ops, summing_adds
from ..graph import (BATCH, GRAD_BOUNDARY, INPUT, INTERMEDIATE, PIPELINE_BOUNDARY, Graph,
                     GraphInput, GraphOutput, IDENTITY_MARKERS, forward_nodes, per_micro_batch_nodes,
                     strip_markers)

# Role of a tensor that enters a layer from another layer.
BOUNDARY = "boundary"


@dataclass(frozen=True)
class Layering:
    num_layers: int
    layer_of_node: tuple[int, ...]        # per node of the graph
    forward: tuple[bool, ...]             # per node
    flops: tuple[float, ...]              # per layer, all phases
    cut_bytes: tuple[int, ...]            # bytes of forward values crossing each cut (L-1)
    marked: bool                          # cuts came from user marks
    # the cuts are the user's marks or the repeated blocks, whatever number
    # of layers was asked for by default
    fixed_cuts: bool = False


def _cut_profile(graph: Graph, fwd_ids: list[int]) -> np.ndarray:
    """bytes[k] = forward values made by fwd_ids[:k+1] and read by fwd_ids[k+1:]."""
    last: dict[int, int] = {}
    for k, nid in enumerate(fwd_ids):
        for t in graph.nodes[nid].inputs:
            last[t] = k
    delta = np.zeros(len(fwd_ids) + 1)
    for k, nid in enumerate(fwd_ids):
        for t in graph.nodes[nid].outputs:
            end = last.get(t, k)
            if end > k:
                delta[k] += graph.tensors[t].nbytes
                delta[end] -= graph.tensors[t].nbytes
    # graph inputs (parameters) are resident, not crossing traffic
    return np.cumsum(delta)[:len(fwd_ids)]


def cluster_forward(flops: np.ndarray, cut_bytes: np.ndarray, num_layers: int,
                    candidates: list[int], imbalance: float = 0.5) -> list[int]:
    """Cut positions (after index k) splitting ``flops`` into ``num_layers``
    segments, minimising the bytes crossing the cuts while every segment stays
    within ``(1 + imbalance)`` of the average FLOPs (relaxed if impossible)."""
    n = len(flops)
    if num_layers <= 1 or n <= 1:
        return []
    prefix = np.concatenate([[0.0], np.cumsum(flops)])
    cands = sorted(set(c for c in candidates if 0 <= c < n - 1))
    pts = [-1] + cands + [n - 1]
    for slack in (0.1, 0.25, imbalance, 1.0, 3.0):
        cap = (1 + slack) * prefix[-1] / num_layers
        low = prefix[-1] / num_layers / (1 + slack) / 2
        INF = float("inf")
        # best[j][m]: min cut bytes with m segments ending at pts[j]
        best = [[INF] * (num_layers + 1) for _ in pts]
        back = [[-1] * (num_layers + 1) for _ in pts]
        best[0][0] = 0.0
        for j in range(1, len(pts)):
            for i in range(j):
                seg = prefix[pts[j] + 1] - prefix[pts[i] + 1]
                if seg > cap or seg < low:
                    continue
                cost = 0.0 if j == len(pts) - 1 else float(cut_bytes[pts[j]])
                for m in range(1, num_layers + 1):
                    v = best[i][m - 1] + cost
                    if v < best[j][m]:
                        best[j][m] = v
                        back[j][m] = i
        if best[-1][num_layers] < INF:
            return _cuts(back, pts, num_layers)
    return _least_uneven(prefix, cut_bytes, num_layers, pts)


def _cuts(back: list[list[int]], pts: list[int], m: int) -> list[int]:
    """The cut positions of ``m`` segments ending at the last point, read
    back from a segmenting DP's ``back[j][m]`` (the point before ``j``)."""
    cuts, j = [], len(pts) - 1
    while j > 0:
        i = back[j][m]
        if i > 0:
            cuts.append(pts[i])
        j, m = i, m - 1
    return sorted(cuts)


def _least_uneven(prefix: np.ndarray, cut_bytes: np.ndarray, num_layers: int,
                  pts: list[int]) -> list[int]:
    """Where no cut keeps the segments near an even share (a few large
    operations, more layers asked than they make): the cuts whose largest
    segment has the fewest FLOPs, then the fewest bytes crossing; so each
    large operation gets a layer of its own before any layer gets two."""
    INF = (float("inf"), float("inf"))
    best = [[INF] * (num_layers + 1) for _ in pts]
    back = [[-1] * (num_layers + 1) for _ in pts]
    best[0][0] = (0.0, 0.0)
    for j in range(1, len(pts)):
        cost = 0.0 if j == len(pts) - 1 else float(cut_bytes[pts[j]])
        for i in range(j):
            seg = float(prefix[pts[j] + 1] - prefix[pts[i] + 1])
            for m in range(1, min(num_layers, j) + 1):
                top, nbytes = best[i][m - 1]
                v = (max(top, seg), nbytes + cost)
                if v < best[j][m]:
                    best[j][m] = v
                    back[j][m] = i
    return _cuts(back, pts, max((k for k in range(1, num_layers + 1) if best[-1][k] < INF),
                                default=1))


def _structure_params(n) -> tuple:
    """``n``'s params as far as they decide its strategies and costs: a
    scan's leading ones (its body is in the graph), and a ``slice``'s
    strides without its position: the blocks of ``keys[i]`` (one key per
    layer, split from one) differ there only, and a slice's rule and cost
    depend on its shapes alone (ilp.rules.slice_like_rule)."""
    if n.primitive == "scan":
        return n.params[:3]
    if n.primitive == "slice":
        return tuple((k, v) for k, v in n.params if k not in ("start_indices", "limit_indices"))
    return n.params


def _signatures(graph: Graph, fwd_ids: list[int]) -> np.ndarray:
    """One integer per forward node: equal when primitive, parameters
    (:func:`_structure_params`) and operand / result shapes are equal."""
    codes: dict[str, int] = {}
    out = []
    for nid in fwd_ids:
        n = graph.nodes[nid]
        key = repr((n.primitive, _structure_params(n),
                    [(graph.tensors[t].shape, graph.tensors[t].dtype) for t in n.inputs],
                    [(graph.tensors[t].shape, graph.tensors[t].dtype) for t in n.outputs]))
        out.append(codes.setdefault(key, len(codes)))
    return np.array(out, dtype=np.int64)


def find_blocks(sig: np.ndarray, cut: np.ndarray, *, min_coverage: float = 0.5
                ) -> list[int] | None:
    """Cut positions (after index k) around the longest stretch of identical
    consecutive blocks in the signature sequence, or ``None`` when no stretch
    of at least two blocks covers ``min_coverage`` of the sequence.

    For each period ``p`` the longest run of ``sig[i] == sig[i + p]`` is found;
    a run of length ``R`` means ``(R + p) // p`` repeated blocks.  The period
    covering most ops wins (ties: the shortest).  Within the slack the run
    leaves, the blocks start where the fewest bytes cross."""
    n = len(sig)
    best = None    # (coverage, -p, start, run)
    for p in range(1, n // 2 + 1):
        eq = np.concatenate([[False], sig[:-p] == sig[p:], [False]])
        edges = np.flatnonzero(np.diff(eq.astype(np.int8)))
        if not len(edges):
            continue
        starts, ends = edges[0::2], edges[1::2]
        k = int(np.argmax(ends - starts))
        run = int(ends[k] - starts[k])
        if run < p:
            continue
        blocks = (run + p) // p
        cand = (blocks * p, -p, int(starts[k]), run)
        if best is None or cand[:2] > best[:2]:
            best = cand
    if best is None or best[0] < min_coverage * n:
        return None
    covered, neg_p, start, run = best
    p = -neg_p
    blocks = covered // p
    slack = run + p - covered
    # cut before block 0 at position start + o - 1; cuts inside the sequence only
    def bytes_at(o: int) -> float:
        return sum(float(cut[start + o + k * p - 1]) for k in range(blocks + 1)
                   if 0 <= start + o + k * p - 1 < n - 1)
    o = min(range(slack + 1), key=lambda o: (bytes_at(o), o))
    return [start + o + k * p - 1 for k in range(blocks + 1) if 0 <= start + o + k * p - 1 < n - 1]


def group_layers(flops: Sequence[float], num_groups: int) -> list[tuple[int, int]]:
    """Consecutive layers merged into ``num_groups`` groups (first, last),
    minimising the largest group's FLOPs."""
    L = len(flops)
    G = max(1, min(num_groups, L))
    if G == L:
        return [(l, l) for l in range(L)]
    prefix = np.concatenate([[0.0], np.cumsum(flops)])
    INF = float("inf")
    # best[g][j]: smallest max-group FLOPs covering layers [0, j) with g groups
    best = np.full((G + 1, L + 1), INF)
    back = np.zeros((G + 1, L + 1), dtype=np.int64)
    best[0][0] = 0.0
    for g in range(1, G + 1):
        for j in range(g, L - (G - g) + 1):
            for i in range(g - 1, j):
                v = max(best[g - 1][i], prefix[j] - prefix[i])
                if v < best[g][j]:
                    best[g][j], back[g][j] = v, i
    out, j = [], L
    for g in range(G, 0, -1):
        i = int(back[g][j])
        out.append((i, j - 1))
        j = i
    return out[::-1]


def assign_layers(graph: Graph, num_layers: int | None = None, *,
                  max_candidates: int = 12, default_layers: int = 1) -> Layering:
    """Layers for every node of ``graph`` (see the module doc).  Without
    ``num_layers`` the layers are the user's marks, else the repeated blocks,
    else ``default_layers`` clustered ones."""
    fwd = forward_nodes(graph)
    fwd_ids = [n.id for n in graph.nodes if fwd[n.id]]
    marks = [k for k, nid in enumerate(fwd_ids) if graph.nodes[nid].primitive == PIPELINE_BOUNDARY]
    flops = np.array([graph.nodes[nid].flops for nid in fwd_ids])
    cut = _cut_profile(graph, fwd_ids) if fwd_ids else np.zeros(0)
    blocks = None if marks or len(fwd_ids) < 4 else find_blocks(_signatures(graph, fwd_ids), cut)
    fixed_cuts = True
    if marks and num_layers is None:
        cuts, marked = marks, True
    elif blocks is not None and num_layers in (None, len(blocks) + 1):
        cuts, marked = blocks, False
    else:
        fixed_cuts = False
        L = num_layers or default_layers
        if marks:
            cands = marks
        elif blocks is not None and L <= len(blocks) + 1:
            cands = blocks
        else:
            # cheap cut points: the lowest-traffic positions in each stretch
            k = max(1, max_candidates * L)
            order = np.argsort(cut, kind="stable")
            cands = sorted(int(i) for i in order[:k])
            step = max(1, len(fwd_ids) // (4 * L))
            cands += list(range(step - 1, len(fwd_ids) - 1, step))
        cuts, marked = cluster_forward(flops, cut, L, cands), bool(marks)
    L = len(cuts) + 1
    layer = [-1] * len(graph.nodes)
    # sums of several uses' contributions to a gradient (meshplan.contributions)
    sums = summing_adds(graph_ops(graph), GRAD_BOUNDARY, graph.consumers)
    cur, ci = 0, 0
    for k, nid in enumerate(fwd_ids):
        layer[nid] = cur
        if ci < len(cuts) and k == cuts[ci]:
            cur += 1
            ci += 1
    # parameters: the layer of their first forward reader
    tensor_layer: dict[int, int] = {}
    graph_inputs = {i.tensor for i in graph.inputs}
    # forward value -> the layer making it (none for an input) and those reading it
    read_in: dict[int, set[int]] = {}
    for nid in fwd_ids:
        for t in graph.nodes[nid].inputs:
            tensor_layer.setdefault(t, layer[nid])
            read_in.setdefault(t, set()).add(layer[nid])
        for t in graph.nodes[nid].outputs:
            tensor_layer[t] = layer[nid]
            read_in.setdefault(t, set()).add(layer[nid])
    forward_values = set(tensor_layer)
    pending = []
    loose: set[int] = set()     # placed by their operands' layers: they read no forward value
    for n in graph.nodes:
        if layer[n.id] >= 0:
            continue
        # the activations a backward op reads place it; a parameter places it
        # only when it reads no activation.  A value the forward of several
        # layers reads (a tied embedding, the activation entering a layer)
        # places it in the layer of the backward values it reads, when that
        # is one of them: the head's ``dlogits @ wte`` runs with the head's
        # backward, not the embedding's (:func:`_read_layer`)
        below = min((tensor_layer[t] for t in n.inputs
                     if t in tensor_layer and t not in forward_values
                     and math.prod(graph.tensors[t].shape) > 1), default=None)
        fl = [_read_layer(read_in[t], below) for t in n.inputs
              if t in forward_values and t not in graph_inputs]
        fl = fl or [_read_layer(read_in[t], below) for t in n.inputs if t in forward_values]
        # (scalars such as a global gradient norm are read by every layer's
        # update and place nothing)
        bl = [tensor_layer[t] for t in n.inputs if t in tensor_layer]
        bl = [tensor_layer[t] for t in n.inputs
              if t in tensor_layer and math.prod(graph.tensors[t].shape) > 1] or bl
        if fl:
            layer[n.id] = max(fl)
        elif bl:
            layer[n.id] = min(bl)
            loose.add(n.id)
        else:   # reads only state the forward pass never touches (optimizer moments)
            pending.append(n)
            continue
        for t in n.outputs:
            tensor_layer[t] = layer[n.id]
        if n.primitive in IDENTITY_MARKERS:   # each marked value keeps its own layer
            for i, o in zip(n.inputs, n.outputs):
                tensor_layer[o] = tensor_layer.get(i, layer[n.id])
        if n.primitive == GRAD_BOUNDARY:
            _place_gradients(graph, n, layer, tensor_layer, loose, sums)
    # ... such nodes run where their first consumer runs
    for n in reversed(pending):
        users = [layer[c] for t in n.outputs for c in graph.consumers.get(t, ()) if layer[c] >= 0]
        layer[n.id] = min(users) if users else L - 1
    # A widening cast of a gradient that only a lower layer reads (the
    # gradient of a layer's output converted back to its input's dtype) runs
    # in that layer: the narrower value crosses, and the layer above stays
    # identical to the other blocks.
    # (Not a contribution to a gradient summed from several layers: that sum
    # runs once a step, so the wide value crosses once a step, and the
    # contribution is summed over the micro-batches at full width where it
    # is made: meshplan.contributions.)
    end = min((n.id for n in graph.nodes if n.primitive == GRAD_BOUNDARY), default=len(layer))
    for nid in sorted((x for x in loose if x < end), reverse=True):
        n = graph.nodes[nid]
        if (n.primitive != "convert_element_type" or len(n.inputs) != 1 or len(n.outputs) != 1
                or graph.tensors[n.outputs[0]].nbytes <= graph.tensors[n.inputs[0]].nbytes
                or all(c in sums for c in graph.consumers.get(n.outputs[0], ()))):
            continue
        users = {layer[c] for t in n.outputs for c in graph.consumers.get(t, ())
                 if graph.nodes[c].primitive not in IDENTITY_MARKERS}
        if len(users) == 1 and (u := users.pop()) < layer[nid]:
            layer[nid] = u
    _keep_pipeline_order(graph, layer, fwd)
    flops_per_layer = [0.0] * L
    for l, members in enumerate(layer_members(graph, layer, L)):
        flops_per_layer[l] = sum(graph.nodes[nid].flops for nid in members)
    cut_bytes = tuple(int(cut[c]) for c in cuts)
    return Layering(L, tuple(layer), tuple(fwd), tuple(flops_per_layer), cut_bytes, marked,
                    fixed_cuts)


def _read_layer(layers: set[int], below: int | None) -> int:
    """The layer a forward value places a backward op reading it in:
    ``layers`` are the layer making the value and those whose forward reads
    it; ``below``, the lowest layer making a backward value the op reads
    (None: it reads none).  The value's own layer (the lowest), unless
    several layers read it and the op reads backward values: then the
    highest of them at most ``below``.  The backward op of the layer that
    read it runs there, with the backward values it reads, instead of them
    being sent down to the first layer (a ``[batch, seq, vocab]`` gradient to
    a tied embedding's layer).  A parameter's gradient and its update read
    the gradient made where the parameter is, and stay there."""
    first = min(layers)
    if below is None or len(layers) == 1:
        return first
    return max((l for l in layers if l <= below), default=first)


def _per_micro_batch_backward(graph: Graph, fwd: Sequence[bool]) -> list[int]:
    """The backward nodes a pipeline runs once per micro-batch, in graph order:
    :func:`meshplan.graph.per_micro_batch_nodes` of the gradients (the
    gradient marker's operands) and the batch, less the forward nodes and
    the values made from constants alone (the runtime's ``B`` phase)."""
    grads = frozenset(t for n in graph.nodes if n.primitive == GRAD_BOUNDARY for t in n.inputs)
    each = per_micro_batch_nodes(graph, grads,
                                 (i.tensor for i in graph.inputs if i.role == BATCH))
    const = graph.constant_nodes
    return [n.id for n in graph.nodes if n.id in each and n.id not in const and not fwd[n.id]]


def _keep_pipeline_order(graph: Graph, layer: list[int], fwd: Sequence[bool]) -> None:
    """Raise each per-micro-batch backward node to the highest layer among its
    backward readers, as the pipeline runtime does
    (``runtime/pipeline_split._keep_pipeline``): a layer's backward runs after
    the backward of the layers above it, so what a higher layer's backward
    reads is computed there.  (The operand rule already places the usual
    such ops there, like the weight gradient ``h.T @ dy`` of a layer's first
    matmul ``h @ w``, which reads the activation entering the layer; this
    catches the rest.)  The layers then cost what each stage runs, and the
    runtime moves nothing."""
    bwd = _per_micro_batch_backward(graph, fwd)
    is_bwd = set(bwd)
    for nid in reversed(bwd):
        users = [layer[c] for t in graph.nodes[nid].outputs
                 for c in graph.consumers.get(t, ()) if c in is_bwd]
        if users and max(users) > layer[nid]:
            layer[nid] = max(users)


def gradient_parameters(graph: Graph, marker) -> list[int | None]:
    """The parameter (graph input tensor) of each gradient a ``meshplan.grad``
    marker carries, or ``None`` where it cannot be told.

    First by the data flow: when each marked gradient is read, directly or
    not, by the update of exactly one parameter of its shape and dtype, and
    no two gradients name the same one, that parameter is its own (this
    holds whatever order the gradients come in: the gradients found in an
    unmarked step come in the backward's order, :mod:`meshplan.trace.micro`).
    Otherwise by position: a marker's operands are the leaves of the
    gradient pytree, which has the structure of the differentiated argument;
    that argument's leaves are a run of consecutive parameter inputs of the
    step.  The one run of parameters whose shapes and dtypes match the
    gradients leaf by leaf names them; no run, or several, names none."""
    by_flow = _parameters_by_flow(graph, marker)
    if by_flow is None:
        # (a global norm, clipping's, makes every update read every
        # gradient, through a scalar: follow the tensors alone)
        by_flow = _parameters_by_flow(graph, marker, through_scalars=False)
    if by_flow is not None:
        return by_flow
    params = [i for i in graph.inputs if i.role == "param"]
    sig = [(graph.tensors[t].shape, graph.tensors[t].dtype) for t in marker.inputs]
    k = len(sig)
    runs = [s for s in range(len(params) - k + 1)
            if all((graph.tensors[params[s + j].tensor].shape,
                    graph.tensors[params[s + j].tensor].dtype) == sig[j] for j in range(k))]
    if len(runs) != 1:
        return [None] * k
    return [params[runs[0] + j].tensor for j in range(k)]


_SEVERAL = -1     # (a value several parameters' updates read)


def _parameters_by_flow(graph: Graph, marker, through_scalars: bool = True
                        ) -> list[int] | None:
    """The parameter whose update reads each marked gradient (see
    :func:`gradient_parameters`), or None when that does not name one
    distinct parameter of the gradient's shape and dtype for every one (a
    global gradient norm makes every update read every gradient, unless
    not ``through_scalars``: what only a scalar is computed from is read by
    no update)."""
    updated: dict[int, int] = {}
    for o in graph.outputs:
        if o.updates is not None and graph.inputs[o.updates].role == "param":
            updated[o.tensor] = graph.inputs[o.updates].tensor
    # one backward sweep: per value, the one parameter whose new value is
    # computed from it, or _SEVERAL
    reaches: dict[int, int] = dict(updated)
    for n in reversed(graph.nodes):
        got = {reaches[t] for t in n.outputs if t in reaches}
        if not got or not through_scalars and all(
                math.prod(graph.tensors[t].shape) <= 1 for t in n.outputs):
            continue
        p = got.pop() if len(got) == 1 else _SEVERAL
        for t in n.inputs:
            q = reaches.get(t, p)
            reaches[t] = p if q == p else _SEVERAL
    out = []
    for g, o in zip(marker.inputs, marker.outputs):
        p = reaches.get(o, _SEVERAL)
        if p == _SEVERAL or (graph.tensors[p].shape, graph.tensors[p].dtype) != (
                graph.tensors[g].shape, graph.tensors[g].dtype):
            return None
        out.append(p)
    return out if len(set(out)) == len(out) else None


def _place_gradients(graph: Graph, marker, layer: list[int], tensor_layer: dict[int, int],
                     loose: set[int], sums: frozenset[int] = frozenset()) -> None:
    """Put each marked gradient, and the work that only makes it, on its
    parameter's layer.  A bias gradient sums the gradient arriving from the
    layer above and reads no activation, so the operand rule would place it
    (and the Adam moments updated from it) one layer too high.  A sum of
    several uses' contributions (``sums``) moves, but each contribution
    stays with its use: meshplan.contributions sums them once a step."""
    for g, o, p in zip(marker.inputs, marker.outputs, gradient_parameters(graph, marker)):
        if p is None or p not in tensor_layer:
            continue
        lp = tensor_layer[p]
        tensor_layer[o] = lp
        moved = {marker.id}
        stack = [graph.producer.get(g)]
        while stack:
            q = stack.pop()
            if q is None or q not in loose or q in moved:
                continue
            if any(c not in moved for t in graph.nodes[q].outputs
                   for c in graph.consumers.get(t, ())):
                continue        # shared with other work: stays where it is
            moved.add(q)
            layer[q] = lp
            for t in graph.nodes[q].outputs:
                tensor_layer[t] = lp
            makers = (graph.producer.get(t) for t in graph.nodes[q].inputs)
            stack.extend(m for m in makers if q not in sums or m in sums)


def layer_subgraph(graph: Graph, layering: Layering, first: int, last: int,
                   view: UnmarkedView | None = None,
                   batch_dim: Mapping[int, int] | None = None) -> Graph:
    """The nodes of layers ``first..last`` as a Graph of their own: values from
    other layers enter as inputs (role ``boundary``), values other layers or the
    step's outputs need leave as outputs.  ``view``: :func:`unmarked_view`
    of ``graph`` (made here if not given).  ``batch_dim``: value -> its
    dimension holding the micro-batch's rows (graph.batch_dims_between),
    kept on the boundary inputs."""
    # identity markers (the gradient marker gathers every layer's gradients)
    # are read through: a layer's update reads its own layer's gradient
    v = view or unmarked_view(graph, layering)
    graph, const = v.graph, v.const
    # (values computed from constants alone are in every layer that reads
    # them, and in no other: see :func:`layer_members`)
    keep_ids = {nid for l in range(first, last + 1) for nid in v.members[l]}
    keep = [graph.nodes[nid] for nid in sorted(keep_ids)]
    produced = {t for n in keep for t in n.outputs}
    orig_inputs = graph.input_of_tensor
    inputs: list[GraphInput] = []
    seen: set[int] = set()
    for n in keep:
        for t in n.inputs:
            if t in produced or t in seen or graph.tensors[t].kind not in (INPUT, INTERMEDIATE):
                continue
            seen.add(t)
            if t in orig_inputs:
                inputs.append(orig_inputs[t])
            else:
                inputs.append(GraphInput(t, -1, f"t{t}", BOUNDARY,
                                         (batch_dim or {}).get(t)))
    index = {i.tensor: k for k, i in enumerate(inputs)}
    outputs: list[GraphOutput] = []
    consumers = graph.consumers
    graph_out = graph.output_of_tensor
    for n in keep:
        for t in n.outputs:
            if t in graph_out:
                o = graph_out[t]
                upd = None
                if o.updates is not None:
                    upd = index.get(graph.inputs[o.updates].tensor)
                outputs.append(GraphOutput(t, o.path, upd))
            elif n.id not in const and not keep_ids.issuperset(consumers.get(t, ())):
                # (a constant-only value is recomputed by the layers reading
                # it: it never leaves the layer)
                outputs.append(GraphOutput(t, f"t{t}", None))
    nodes = tuple(n.renumbered(k) for k, n in enumerate(keep))
    # only the layer's own tensors (ids keep their numbering): a layer sent
    # to an ILP worker process pickles what it uses, not the whole step
    tensors: list = [None] * len(graph.tensors)
    used: set[int] = set()
    for n in keep:
        used.update(n.inputs)
        used.update(n.outputs)
    for t in used:
        tensors[t] = graph.tensors[t]
    # (the layer's own values only: the step's whole map, once per layer,
    # cost seconds for a 96-block model)
    dims = batch_dim or {}
    rows = tuple(sorted((t, dims[t]) for t in used if t in dims))
    # (the step's arguments the caller keeps, by this layer's numbering: the
    # stage holds their new values beside the old, LayerCost.kept_new_bytes)
    kept = {graph.inputs[k].tensor for k in graph.undonated}
    sub = dataclasses.replace(graph, name=f"{graph.name}[{first}:{last}]", nodes=nodes,
                              tensors=tuple(tensors), inputs=tuple(inputs),
                              outputs=tuple(outputs), warnings=(), batch_dims=rows,
                              undonated=frozenset(k for k, i in enumerate(inputs)
                                                  if i.tensor in kept))
    return dataclasses.replace(sub, fingerprint=structural_hash(sub))


def saved_for_backward(graph: Graph, layering: Layering, view: UnmarkedView | None = None
                       ) -> list[frozenset[int]]:
    """Per layer: the forward values (and batch pieces) its backward ops read,
    i.e. what one micro-batch keeps alive between its forward and backward
    pass.  Tensor ids are those of :func:`layer_subgraph` (markers read
    through)."""
    v = view or unmarked_view(graph, layering)
    view, layer_of, fwd = v.graph, v.layer_of, v.forward
    batch = {i.tensor for i in view.inputs if i.role == BATCH}
    const = view.constant_tensors      # recomputed (fused) where read, never kept
    out: list[set[int]] = [set() for _ in range(layering.num_layers)]
    for n in view.nodes:
        if fwd[n.id]:
            continue
        for t in n.inputs:
            p = view.producer.get(t)
            if ((p is not None and fwd[p]) or t in batch) and t not in const:
                out[layer_of[n.id]].add(t)
    return [frozenset(s) for s in out]


def crossing_values(graph: Graph, layering: Layering, subs: Sequence[Graph],
                    view: UnmarkedView | None = None) -> list[frozenset[int]]:
    """Per layer: the forward values it makes that a later layer reads (what a
    stage ending with it sends to the next stage).  ``subs``: the
    :func:`layer_subgraph` of each layer."""
    v = view or unmarked_view(graph, layering)
    view, layer_of, fwd = v.graph, v.layer_of, v.forward

    def read_later(t: int, l: int) -> bool:
        return any(layer_of[c] > l for c in view.consumers.get(t, ()))
    return [frozenset(o.tensor for o in sub.outputs
                      if o.updates is None and (p := view.producer.get(o.tensor)) is not None
                      and fwd[p] and read_later(o.tensor, l))
            for l, sub in enumerate(subs)]


def entering_values(graph: Graph, layering: Layering, subs: Sequence[Graph],
                    view: UnmarkedView | None = None) -> list[frozenset[int]]:
    """Per layer: the forward values of other layers it reads (what a
    recomputing stage keeps per micro-batch in flight).  Gradients arriving
    from the layers above are not among them: they come at backward time and
    are used at once."""
    v = view or unmarked_view(graph, layering)
    return [frozenset(i.tensor for i in sub.inputs
                      if i.role == BOUNDARY and (p := v.graph.producer.get(i.tensor)) is not None
                      and v.forward[p])
            for sub in subs]


def layer_members(graph: Graph, layer_of: Sequence[int], num_layers: int) -> list[list[int]]:
    """The nodes each layer computes, in graph order: the nodes of its own
    (``layer_of``), except the values made from constants alone (masks,
    iotas, broadcast literals: :attr:`Graph.constant_nodes`), which are in
    every layer that reads them, directly or through other such values, and
    in no other.

    XLA fuses such a value into each reader, or folds it, and drops one
    nobody reads, wherever the layering happens to put it: a layer pays for
    its own copy, never for another layer's, and none crosses between
    layers.  (Nodes that read nothing of the forward pass and have no reader,
    like the zero cotangent ``jnp.where``'s ``jit`` returns for the backward
    it then never reads, land on the last layer: counted there, the head
    layer would pay for one such value per transformer block.)  A constant
    value the step returns stays with the layer it was put on."""
    const = graph.constant_nodes
    returned = {o.tensor for o in graph.outputs}
    readers: dict[int, set[int]] = {}
    for nid in sorted(const, reverse=True):      # readers come later in the graph
        r = readers[nid] = set()
        for t in graph.nodes[nid].outputs:
            if t in returned:
                r.add(layer_of[nid])
            for c in graph.consumers.get(t, ()):
                if c in const:
                    r |= readers[c]
                else:
                    r.add(layer_of[c])
    members: list[list[int]] = [[] for _ in range(num_layers)]
    for n in graph.nodes:
        for l in (sorted(readers[n.id]) if n.id in const else (layer_of[n.id],)):
            members[l].append(n.id)
    return members


@dataclass(frozen=True)
class UnmarkedView:
    """A step's graph without identity markers, as the layer functions read
    it: the graph, the layer of each remaining node, its constant nodes, the
    nodes each layer's subgraph holds (:func:`layer_members`) and whether
    each node is a forward op.  Made once per layering (:func:`unmarked_view`)
    and passed to the functions below."""
    graph: Graph
    layer_of: list[int]
    const: frozenset[int]
    members: list[list[int]]
    forward: list[bool]


def unmarked_view(graph: Graph, layering: Layering) -> UnmarkedView:
    layer_of = [layering.layer_of_node[n.id] for n in graph.nodes
                if n.primitive not in IDENTITY_MARKERS]
    view = strip_markers(graph)
    fwd = [layering.forward[n.id] for n in graph.nodes if n.primitive not in IDENTITY_MARKERS]
    return UnmarkedView(view, layer_of, view.constant_nodes,
                        layer_members(view, layer_of, layering.num_layers), fwd)


def canonical_tensors(graph: Graph) -> tuple[int, ...]:
    """The graph's tensor ids in the order :func:`structural_hash` numbers
    them: two graphs with equal hashes correspond tensor by tensor."""
    seen: dict[int, None] = {}
    for i in graph.inputs:
        seen.setdefault(i.tensor)
    for n in graph.nodes:
        for t in n.inputs + n.outputs:
            seen.setdefault(t)
    for o in graph.outputs:
        seen.setdefault(o.tensor)
    return tuple(seen)


def structural_hash(graph: Graph) -> str:
    """A hash of a graph's structure and shapes that ignores tensor numbering,
    so identical layers (transformer blocks) hash equal."""
    r = {t: k for k, t in enumerate(canonical_tensors(graph))}
    ts = graph.tensors
    ins = [(r[i.tensor], ts[i.tensor].shape, ts[i.tensor].dtype,
            i.role if i.role != BOUNDARY else "b", i.batch_dim) for i in graph.inputs]
    num = r.__getitem__
    nodes = [(n.primitive, tuple(map(num, n.inputs)), tuple(map(num, n.outputs)),
              tuple([(ts[t].shape, ts[t].dtype) for t in n.outputs]),
              _structure_params(n))
             for n in graph.nodes]
    outs = [(r[o.tensor], o.updates is not None) for o in graph.outputs]
    rows = sorted((r[t], d) for t, d in graph.batch_dims if t in r)
    # (the kept arguments only where there are: every other hash stays as it was)
    kept = (sorted(graph.undonated),) if graph.undonated else ()
    # (params are plain, deterministic Python data: their repr is canonical)
    return hashlib.sha256(repr((ins, nodes, outs, rows) + kept).encode()).hexdigest()
