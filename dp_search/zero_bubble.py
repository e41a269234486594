"""ZB-H1 pipelines, priced after the stage DP (as :mod:`.interleave` prices
interleaved ones).

The DP's stages are kept (it priced them with 1F1B's in-flight counts, or
where the request fixes the stage count with ZB-H1's); ZB-H1 keeps ``min(B,
p)`` micro-batches on every stage (:func:`meshplan.schedule.max_in_flight`),
whole until their ``B``, then only what their ``W`` still reads
(:func:`kept_parts`: the driver frees the rest after their ``B``); the most
a stage holds at once is walked through its order
(:func:`meshplan.schedule.peak_kept`), so each stage is priced again and
the plan is dropped where one no longer fits.  Each stage's latency is cut into its
forward ``F``, input-gradient ``B`` and weight-gradient ``W`` by the FLOPs
of those parts of its layers (:func:`backward_parts`: by dependence, as the
runtime cuts the programs, :mod:`meshplan.runtime.pipeline_split`), and the
iteration time is :func:`meshplan.cost_model.pipeline.zb_h1_iteration_s`.
The first stage sends no gradient back: the runtime keeps its backward one
program, so its ``W`` is 0 and its ``B`` the whole backward; so does a stage
that recomputes its forward.  Every other stage launches one program more
per micro-batch (its ``W``)."""
from __future__ import annotations

from typing import Any

from ..contributions import graph_ops, once_a_step
from ..cost_model.pipeline import zb_h1_iteration_s
from ..graph import GRAD_BOUNDARY, Graph
from .layers import Layering
from .problem import LayerProblems
from .stage_dp import DPResult, StageChoice

__all__ = ("ZB_H1", "backward_parts", "kept_parts", "w_shares", "zero_bubble")

ZB_H1 = "zb-h1"


def _input_gradient_nodes(g: Graph, layering: Layering) -> tuple[list[bool], int]:
    """Per node: does a lower layer's backward read it (directly or through
    other such backward operations of its layer)?  And where the backward
    ends (the first gradient marker)."""
    L, layer, fwd = layering.num_layers, layering.layer_of_node, layering.forward
    end = min((n.id for n in g.nodes if n.primitive == GRAD_BOUNDARY), default=len(g.nodes))
    users = g.consumers
    # (the sum of a tied weight's contributions runs once a step, in the
    # update: a contribution is a weight gradient, W's, as the runtime cuts it)
    once, _ = once_a_step(graph_ops(g), layer, GRAD_BOUNDARY, users)
    down = [False] * len(g.nodes)
    for n in reversed(g.nodes[:end]):
        l = layer[n.id]
        if fwd[n.id] or not 0 <= l < L:
            continue
        down[n.id] = any(not fwd[c] and c < end and c not in once
                         and (layer[c] < l or (layer[c] == l and down[c]))
                         for t in n.outputs for c in users.get(t, ()))
    return down, end


def backward_parts(g: Graph, layering: Layering) -> tuple[list[float], list[float], list[float]]:
    """Per layer the FLOPs of its forward, of its input gradient (the
    backward operations some lower layer's backward reads, directly or
    through other such operations of the layer) and of the rest of its
    backward (the parameters' gradients).  Operations after the gradients
    (the update) count with the rest."""
    L, layer, fwd = layering.num_layers, layering.layer_of_node, layering.forward
    down, _ = _input_gradient_nodes(g, layering)
    f, b, w = [0.0] * L, [0.0] * L, [0.0] * L
    for n in g.nodes:
        l = layer[n.id]
        if 0 <= l < L:
            (f if fwd[n.id] else b if down[n.id] else w)[l] += n.flops
    return f, b, w


def kept_parts(g: Graph, layering: Layering) -> tuple[list[float], list[float]]:
    """Per layer the bytes one micro-batch keeps past its B for its W: the
    forward values W reads, and B's results W reads.  (The runtime frees the
    rest of what the forward kept after B: :func:`meshplan.schedule.peak_kept`.)"""
    L, layer, fwd = layering.num_layers, layering.layer_of_node, layering.forward
    down, end = _input_gradient_nodes(g, layering)
    made = g.producer
    from_f: list[set[int]] = [set() for _ in range(L)]
    from_b: list[set[int]] = [set() for _ in range(L)]
    for n in g.nodes[:end]:
        l = layer[n.id]
        if fwd[n.id] or down[n.id] or not 0 <= l < L:
            continue
        for t in n.inputs:
            k = made.get(t)
            if k is None:
                continue        # parameters and batch pieces: not per micro-batch
            if fwd[k]:
                from_f[l].add(t)
            elif down[k]:
                from_b[l].add(t)
    return ([sum(g.tensors[t].nbytes for t in ts) for ts in from_f],
            [sum(g.tensors[t].nbytes for t in ts) for ts in from_b])


def w_shares(parts: tuple[list[float], list[float]], kept: list[float], first: int,
             last: int) -> tuple[float, float]:
    """Of what layers ``first..last`` keep per micro-batch for their backward
    (``kept``, after fusion), the shares W still reads past B: the forward's
    values (at most all of them) and B's results."""
    full = sum(kept[first:last + 1])
    if full <= 0:
        return 0.0, 0.0
    return (min(1.0, sum(parts[0][first:last + 1]) / full),
            sum(parts[1][first:last + 1]) / full)


def zero_bubble(res: DPResult, lay: LayerProblems, costs: Any
                ) -> tuple[DPResult, dict[tuple[int, int, int, int], Any]] | None:
    """The ZB-H1 pipeline of the DP's stages ``res`` (in layer-group
    indices): a :class:`DPResult` in layer indices with the ZB-H1 iteration
    time, and the stages' options keyed as the DP's; None where a stage
    does not fit with ZB-H1's micro-batches in flight
    (``costs.not_zero_bubble`` says which)."""
    p, B = len(res.stages), lay.B
    f_l, b_l, w_l = backward_parts(lay.g, lay.layering)
    stages, options = [], {}
    fs, bs, ws = [], [], []
    for k, st in enumerate(res.stages):
        i, j = lay.groups[st.first][0], lay.groups[st.last][1]
        o = costs.best(st.first, st.last, st.submesh, p - k, ZB_H1, keep=min(B, p - k),
                       extra=costs.zb_extra(i, j, p - k, p))
        if o is None:
            costs.not_zero_bubble = (f"stage {k} (layers {i}..{j}) does not fit with the "
                                     f"{min(B, p)} micro-batches in flight that ZB-H1 keeps on "
                                     "every stage")
            return None
        fwd, inp, rest = sum(f_l[i:j + 1]), sum(b_l[i:j + 1]), sum(w_l[i:j + 1])
        # (the runtime keeps these backwards one program; a forward alone has none)
        whole = k == 0 or o.remat or lay.programs[0] == 1
        if whole:
            inp, rest = inp + rest, 0.0
        lat = o.latency_s + (0.0 if whole else lay.dispatch(st.submesh))
        total = fwd + inp + rest
        share = (fwd / total, inp / total, rest / total) if total > 0 else (0.5, 0.5, 0.0)
        fs.append(lat * share[0])
        bs.append(lat * share[1])
        ws.append(lat * share[2])
        stages.append(StageChoice(i, j, st.submesh, lat))
        options[i, j, st.submesh, p - k] = o
    total_s = zb_h1_iteration_s(fs, bs, ws, B)
    return DPResult(total_s, tuple(stages), max(s.latency for s in stages)), options
