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
   pull the last layer's backward into the first); one that reads no
   forward value inherits the smallest layer among its operands (the
   gradient arriving from the layer above is of a higher layer).  An update
   reads its parameter, which belongs to the layer of its first forward
   reader.  So a layer's forward, backward and updates land together.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass

import numpy as np

from ..graph import (BATCH, INPUT, INTERMEDIATE, STATE, Graph, GraphInput, GraphOutput,
                     IDENTITY_MARKERS, forward_nodes, strip_markers)

PIPELINE_BOUNDARY = "meshplan_pipeline_boundary"
GRAD_BOUNDARY = "meshplan_grad_boundary"
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


def _cut_profile(graph: Graph, fwd_ids: list[int]) -> np.ndarray:
    """bytes[k] = forward values made by fwd_ids[:k+1] and read by fwd_ids[k+1:]."""
    pos = {nid: k for k, nid in enumerate(fwd_ids)}
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
    for slack in (0.1, 0.25, imbalance, 1.0, 3.0, float("inf")):
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
            cuts, j, m = [], len(pts) - 1, num_layers
            while j > 0:
                i = back[j][m]
                if i > 0:
                    cuts.append(pts[i])
                j, m = i, m - 1
            return sorted(cuts)
    return []


def assign_layers(graph: Graph, num_layers: int | None = None, *,
                  max_candidates: int = 12) -> Layering:
    """Layers for every node of ``graph`` (see the module doc)."""
    fwd = forward_nodes(graph)
    fwd_ids = [n.id for n in graph.nodes if fwd[n.id]]
    marks = [k for k, nid in enumerate(fwd_ids) if graph.nodes[nid].primitive == PIPELINE_BOUNDARY]
    flops = np.array([graph.nodes[nid].flops for nid in fwd_ids])
    cut = _cut_profile(graph, fwd_ids) if fwd_ids else np.zeros(0)
    if marks and num_layers is None:
        cuts, marked = marks, True
    else:
        L = num_layers or 1
        if marks:
            cands = marks
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
    cur, ci = 0, 0
    for k, nid in enumerate(fwd_ids):
        layer[nid] = cur
        if ci < len(cuts) and k == cuts[ci]:
            cur += 1
            ci += 1
    # parameters: the layer of their first forward reader
    tensor_layer: dict[int, int] = {}
    for nid in fwd_ids:
        for t in graph.nodes[nid].inputs:
            tensor_layer.setdefault(t, layer[nid])
        for t in graph.nodes[nid].outputs:
            tensor_layer[t] = layer[nid]
    forward_values = set(tensor_layer)
    graph_inputs = {i.tensor for i in graph.inputs}
    pending = []
    for n in graph.nodes:
        if layer[n.id] >= 0:
            continue
        # the activations a backward op reads place it; a parameter places it
        # only when it reads no activation (a tied embedding read by the first
        # and the last layer must not pull the last layer's backward matmul
        # into the first layer)
        fl = [tensor_layer[t] for t in n.inputs if t in forward_values and t not in graph_inputs]
        fl = fl or [tensor_layer[t] for t in n.inputs if t in forward_values]
        bl = [tensor_layer[t] for t in n.inputs if t in tensor_layer]
        if fl:
            layer[n.id] = max(fl)
        elif bl:
            layer[n.id] = min(bl)
        else:   # reads only state the forward pass never touches (optimizer moments)
            pending.append(n)
            continue
        for t in n.outputs:
            tensor_layer[t] = layer[n.id]
    # ... such nodes run where their first consumer runs
    for n in reversed(pending):
        users = [layer[c] for t in n.outputs for c in graph.consumers.get(t, ()) if layer[c] >= 0]
        layer[n.id] = min(users) if users else L - 1
    flops_per_layer = [0.0] * L
    for n in graph.nodes:
        flops_per_layer[layer[n.id]] += n.flops
    cut_bytes = tuple(int(cut[c]) for c in cuts)
    return Layering(L, tuple(layer), tuple(fwd), tuple(flops_per_layer), cut_bytes, marked)


def layer_subgraph(graph: Graph, layering: Layering, first: int, last: int) -> Graph:
    """The nodes of layers ``first..last`` as a Graph of their own: values from
    other layers enter as inputs (role ``boundary``), values other layers or the
    step's outputs need leave as outputs."""
    const = constant_nodes(graph)
    keep_ids = {n.id for n in graph.nodes if first <= layering.layer_of_node[n.id] <= last}
    # values computed from constants alone (masks, iotas) are recomputed in
    # every layer that reads them instead of crossing layer boundaries
    stack = [t for nid in keep_ids for t in graph.nodes[nid].inputs]
    while stack:
        t = stack.pop()
        p = graph.producer.get(t)
        if p is not None and p in const and p not in keep_ids:
            keep_ids.add(p)
            stack.extend(graph.nodes[p].inputs)
    keep = [n for n in graph.nodes if n.id in keep_ids]
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
                inputs.append(GraphInput(t, -1, f"t{t}", BOUNDARY))
    index = {i.tensor: k for k, i in enumerate(inputs)}
    outputs: list[GraphOutput] = []
    used_outside = {t for n in graph.nodes if n.id not in keep_ids for t in n.inputs}
    graph_out = {o.tensor: o for o in graph.outputs}
    for n in keep:
        for t in n.outputs:
            if t in graph_out:
                o = graph_out[t]
                upd = None
                if o.updates is not None:
                    upd = index.get(graph.inputs[o.updates].tensor)
                outputs.append(GraphOutput(t, o.path, upd))
            elif t in used_outside:
                outputs.append(GraphOutput(t, f"t{t}", None))
    nodes = tuple(dataclasses.replace(n, id=k) for k, n in enumerate(keep))
    sub = dataclasses.replace(graph, name=f"{graph.name}[{first}:{last}]", nodes=nodes,
                              inputs=tuple(inputs), outputs=tuple(outputs), warnings=())
    sub = strip_markers(sub)
    return dataclasses.replace(sub, fingerprint=structural_hash(sub))


def constant_nodes(graph: Graph) -> set[int]:
    """Nodes whose value depends on no input of the step (only literals/constants)."""
    out: set[int] = set()
    produced_by_const: set[int] = set()
    for n in graph.nodes:
        if all(graph.tensors[t].kind not in (INPUT, INTERMEDIATE) or t in produced_by_const
               for t in n.inputs):
            out.add(n.id)
            produced_by_const.update(n.outputs)
    return out


def structural_hash(graph: Graph) -> str:
    """A hash of a graph's structure and shapes that ignores tensor numbering,
    so identical layers (transformer blocks) hash equal."""
    rename: dict[int, int] = {}

    def r(t: int) -> int:
        if t not in rename:
            rename[t] = len(rename)
        return rename[t]

    ins = [[r(i.tensor), list(graph.tensors[i.tensor].shape), graph.tensors[i.tensor].dtype,
            i.role if i.role != BOUNDARY else "b"] for i in graph.inputs]
    nodes = [[n.primitive, [r(t) for t in n.inputs], [r(t) for t in n.outputs],
              [list(graph.tensors[t].shape) for t in n.outputs],
              [graph.tensors[t].dtype for t in n.outputs],
              json.loads(json.dumps(n.params, default=str)) if n.primitive != "scan" else n.params[:3]]
             for n in graph.nodes]
    outs = [[r(o.tensor), o.updates is not None] for o in graph.outputs]
    text = json.dumps([ins, nodes, outs], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()
