"""ZB-H1 pipelines, priced after the stage DP (as :mod:`.interleave` prices
interleaved ones).

The DP's stages are kept (it priced them with 1F1B's in-flight counts); ZB-H1
keeps ``min(B, p)`` micro-batches on every stage (:func:`meshplan.schedule.
max_in_flight`), so each stage is priced again with that many and the plan
is dropped where one no longer fits.  Each stage's latency is cut into its
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

from ..cost_model.pipeline import zb_h1_iteration_s
from ..graph import GRAD_BOUNDARY, Graph
from .layers import Layering
from .problem import LayerProblems
from .stage_dp import DPResult, StageChoice

__all__ = ("ZB_H1", "backward_parts", "zero_bubble")

ZB_H1 = "zb-h1"


def backward_parts(g: Graph, layering: Layering) -> tuple[list[float], list[float], list[float]]:
    """Per layer the FLOPs of its forward, of its input gradient (the
    backward operations some lower layer's backward reads, directly or
    through other such operations of the layer) and of the rest of its
    backward (the parameters' gradients).  Operations after the gradients
    (the update) count with the rest."""
    L, layer, fwd = layering.num_layers, layering.layer_of_node, layering.forward
    end = min((n.id for n in g.nodes if n.primitive == GRAD_BOUNDARY), default=len(g.nodes))
    users = g.consumers
    f, b, w = [0.0] * L, [0.0] * L, [0.0] * L
    down = [False] * len(g.nodes)       # feeds the gradient of a lower layer's inputs
    for n in reversed(g.nodes):
        l = layer[n.id]
        if not 0 <= l < L:
            continue
        if fwd[n.id]:
            f[l] += n.flops
            continue
        if n.id < end:
            down[n.id] = any(not fwd[c] and c < end
                             and (layer[c] < l or (layer[c] == l and down[c]))
                             for t in n.outputs for c in users.get(t, ()))
        (b if down[n.id] else w)[l] += n.flops
    return f, b, w


def zero_bubble(res: DPResult, lay: LayerProblems, costs: Any
                ) -> tuple[DPResult, dict[tuple[int, int, int, int], Any]] | None:
    """The ZB-H1 pipeline of the DP's stages ``res`` (in layer-group
    indices): a :class:`DPResult` in layer indices with the ZB-H1 iteration
    time, and the stages' options keyed as the DP's; None where a stage
    does not fit with ZB-H1's micro-batches in flight
    (``costs.not_zero_bubble`` says which)."""
    p, B = len(res.stages), lay.B
    keep = min(B, p)
    f_l, b_l, w_l = backward_parts(lay.g, lay.layering)
    stages, options = [], {}
    fs, bs, ws = [], [], []
    for k, st in enumerate(res.stages):
        o = costs.best(st.first, st.last, st.submesh, p - k, ZB_H1, keep=keep)
        i, j = lay.groups[st.first][0], lay.groups[st.last][1]
        if o is None:
            costs.not_zero_bubble = (f"stage {k} (layers {i}..{j}) does not fit with the {keep} "
                                     "micro-batches in flight that ZB-H1 keeps on every stage")
            return None
        fwd, inp, rest = sum(f_l[i:j + 1]), sum(b_l[i:j + 1]), sum(w_l[i:j + 1])
        whole = k == 0 or o.remat       # (the runtime keeps these backwards one program)
        if whole:
            inp, rest = inp + rest, 0.0
        lat = o.latency_s + (0.0 if whole else lay.dispatch_s)
        total = fwd + inp + rest
        share = (fwd / total, inp / total, rest / total) if total > 0 else (0.5, 0.5, 0.0)
        fs.append(lat * share[0])
        bs.append(lat * share[1])
        ws.append(lat * share[2])
        stages.append(StageChoice(i, j, st.submesh, lat))
        options[i, j, st.submesh, p - k] = o
    total_s = zb_h1_iteration_s(fs, bs, ws, B)
    return DPResult(total_s, tuple(stages), max(s.latency for s in stages)), options
