"""Resharding between the layers of one stage.

Each layer's ILP picks the layouts of the values it takes from other layers
freely.  Where two layers of one stage disagree (an embedding that leaves its
output cut over the model axis, a block that reads it whole), the stage
program reshards the value between them, once per micro-batch: a forward
value as it is made, a cotangent as the backward hands it down.  Identical
blocks agree with each other, so what this charges is mostly at the ends of
the model (the pipeline runtime constrains each layer's reads to its plan:
dp_search.assemble).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from ..cost_model.mesh import MeshModel
from ..cost_model.sharding import reshard_cost
from ..graph import Graph
from ..layout_moves import spec_from_names
from .layers import BOUNDARY
from .solver import LayerCost


@dataclass(frozen=True)
class Flow:
    """A value layer ``maker`` hands layer ``reader``: the maker's output at
    ``out_pos``, the reader's input at ``in_pos``."""
    maker: int
    reader: int
    tensor: int
    out_pos: int
    in_pos: int

    @property
    def span(self) -> tuple[int, int]:
        return min(self.maker, self.reader), max(self.maker, self.reader)


def layer_flows(subs: Sequence[Graph]) -> tuple[Flow, ...]:
    """Every value one layer subgraph of ``subs`` (dp_search.layers) makes and
    another reads."""
    made = {o.tensor: (l, k) for l, sub in enumerate(subs) for k, o in enumerate(sub.outputs)}
    flows = []
    for r, sub in enumerate(subs):
        for q, inp in enumerate(sub.inputs):
            hit = made.get(inp.tensor) if inp.role == BOUNDARY else None
            if hit is not None and hit[0] != r:
                flows.append(Flow(hit[0], r, inp.tensor, hit[1], q))
    return tuple(flows)


def flow_cost(flow: Flow, g: Graph, maker: LayerCost, reader: LayerCost, mm: MeshModel
              ) -> tuple[float, float]:
    """Seconds and bytes per device of resharding ``flow`` on ``mm``'s mesh
    from the layout its maker's plan leaves it in to the one its reader's
    plan reads (zero where they agree, or a plan leaves it free)."""
    src = maker.result.output_specs[flow.out_pos]
    dst = reader.result.input_specs[flow.in_pos]
    t = g.tensors[flow.tensor]
    if src is None or dst is None or src == dst or not t.shape:
        return 0.0, 0.0
    axes = mm.mesh.axes
    return reshard_cost(mm, t.shape, t.nbytes, spec_from_names(src, axes),
                        spec_from_names(dst, axes))


def joint_cost(flows: Sequence[Flow], first: int, last: int,
               cost: Callable[[Flow], tuple[float, float]]) -> tuple[float, float]:
    """Seconds and bytes per micro-batch of the flows between layers
    ``first..last`` (both ends inside), each priced by ``cost``."""
    s = b = 0.0
    for f in flows:
        lo, hi = f.span
        if first <= lo and hi <= last:
            ds, db = cost(f)
            s, b = s + ds, b + db
    return s, b
