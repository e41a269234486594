"""Strategies of one operator on a logical mesh, from its OpSpace.

A strategy assigns every mesh axis (of size > 1) to one label of the OpSpace
or to none.  From that follow the layout of every operand and result, the
share of the work each device does, and the collectives that combine partial
sums (all-reduce, or reduce-scatter onto a result dimension).
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Callable, Sequence

from ..cost_model.collectives import all_reduce, fixed_s, reduce_scatter, reduce_scatter_kind
from ..cost_model.compute import compute_time
from ..cost_model.mesh import MeshModel
from ..cost_model.sharding import ISpec, num_shards, replicated
from ..graph import Graph, Node
from .accumulation import summed_axes
from .rules import OpSpace, op_space


@dataclass(frozen=True)
class Strategy:
    name: str
    in_specs: tuple[ISpec | None, ...]   # None: operand taken as it is (scalar, literal)
    out_specs: tuple[ISpec, ...]
    compute_s: float
    comm_s: float
    comm_bytes: float
    collective: str = ""      # the HLO kind of the collective in comm_*, if any
    # (kind, seconds, bytes, mesh axes) of each collective where comm_* adds
    # up several
    parts: tuple[tuple[str, float, float, tuple[int, ...]], ...] = ()

    @property
    def cost(self) -> float:
        return self.compute_s + self.comm_s


MATMULS = ("dot_general", "conv_general_dilated")


def collectives_of(s: Strategy, axis_names) -> tuple[tuple[str, float, float, tuple[int, ...]], ...]:
    """``(kind, seconds, bytes, mesh axes)`` of each collective ``s`` runs:
    its ``parts``, or one over all the axes it sums over."""
    if s.parts:
        return tuple(p for p in s.parts if p[2])
    summed = tuple(sorted(summed_axes(s.name, axis_names)))
    return ((s.collective or "all-reduce", s.comm_s, s.comm_bytes, summed),) \
        if s.comm_bytes else ()


def sum_all_reduces(mm: MeshModel, groups: Sequence[tuple[int, ...]], nbytes: float
                    ) -> tuple[tuple[str, float, float, tuple[int, ...]], ...]:
    """The all-reduces of a result of ``nbytes`` per device summed over the
    mesh axes ``groups`` (those of each summed dimension): XLA emits one per
    dimension, each of the whole result (a weight gradient summed over batch
    on one axis and sequence on another reduces twice; on one dimension
    split over both, once: tests/test_merged_gradients.py checks both against
    the compiled HLO)."""
    return tuple(("all-reduce",) + all_reduce(mm, ax, nbytes) + (ax,)
                 for ax in (tuple(sorted(g)) for g in groups) if ax)


def unmerged_s(mm: MeshModel, kind: str, seconds: float, axes: tuple[int, ...]) -> float:
    """A gradient reduction's own time when XLA merges it with the step's
    others (:func:`meshplan.ilp.decode.merge_gradients`): less the fixed cost
    (:func:`meshplan.cost_model.collectives.fixed_s`) the merged collective
    pays once."""
    return seconds - min(seconds, fixed_s(mm, kind, axes))


def merged_comm_s(mm: MeshModel, s: Strategy) -> tuple[float, float]:
    """``s``'s communication where it reduces a gradient (:func:`unmerged_s`),
    and the fixed costs it left out (an ILP of the whole step charges each of
    its ``n`` gradients ``1 / n`` of them: :func:`meshplan.ilp.build.priced_as_whole_step`)."""
    cs = [(kind, sec, ax) for kind, sec, _, ax in collectives_of(s, mm.mesh.axes)]
    return (sum(unmerged_s(mm, kind, sec, ax) for kind, sec, ax in cs),
            sum(fixed_s(mm, kind, ax) for kind, _, ax in cs))


def node_dtype(graph: Graph, node: Node) -> str:
    """The dtype whose FLOP/s rate prices ``node``: a matmul's operands', its
    output's otherwise.  A float32 matmul at jax's default precision may use
    the device's fast float32 mode, so it is priced as ``tfloat32``: TF32
    tensor cores on A100/H100 (measured on an H200: 330-400 TFLOP/s against
    the 67 of plain float32, benchmarks/results/gpu_check.md); devices
    without a tfloat32 figure fall back to their float32 one
    (``DeviceSpec.flops_for``).  ``precision=HIGHEST`` (or the config's
    ``jax_default_matmul_precision`` of float32/highest) keeps float32."""
    ts = node.inputs if node.primitive in MATMULS else node.outputs
    dtype = next((graph.tensors[t].dtype for t in ts), "float32")
    if dtype == "float32" and node.primitive in MATMULS and not exact_float32(node):
        return "tfloat32"
    return dtype


def exact_float32(node: Node) -> bool:
    """Whether a float32 matmul asks for full float32 arithmetic."""
    own = str(node.param("precision")).lower()
    if own != "none":
        return "highest" in own
    return str(node.param("config_precision")).lower() in ("highest", "float32")


def node_space(graph: Graph, node: Node) -> OpSpace | None:
    ins = [graph.tensors[t].shape for t in node.inputs]
    outs = [graph.tensors[t].shape for t in node.outputs]
    return op_space(node.primitive, ins, outs, dict(node.params))


def replicated_strategy(graph: Graph, node: Node, mm: MeshModel,
                        bytes_accessed: float | None = None) -> Strategy:
    ins = tuple(replicated(len(graph.tensors[t].shape)) if graph.tensors[t].shape else None
                for t in node.inputs)
    outs = tuple(replicated(len(graph.tensors[t].shape)) for t in node.outputs)
    moved = node.bytes_accessed if bytes_accessed is None else bytes_accessed
    t = compute_time(mm.device, node.flops, moved, node_dtype(graph, node),
                     _out_elements(graph, node), _out_side(graph, node))
    return Strategy("R", ins, outs, t, 0.0, 0.0)


def _out_elements(graph: Graph, node: Node, shards: float = 1) -> float:
    """Elements of the first result on one device (what a matmul tiles);
    0 for other operators (no tiles, no wave quantization)."""
    if not node.outputs or node.primitive not in MATMULS:
        return 0.0
    return math.prod(graph.tensors[node.outputs[0]].shape) / shards


def _out_side(graph: Graph, node: Node) -> float:
    """The shorter of the first result's two minor sides (0 for a vector)."""
    shape = graph.tensors[node.outputs[0]].shape if node.outputs else ()
    return float(min(shape[-2:])) if len(shape) >= 2 else 0.0


def _spec(labels: Sequence[int], per_label: dict[int, tuple[int, ...]]) -> ISpec:
    return tuple(per_label.get(l, ()) for l in labels)


def _name(assign: Sequence[tuple[int, int | None]], space: OpSpace, axis_names,
          rs_dim: int | None, rs_axes: tuple[int, ...] = ()) -> str:
    parts = []
    out0 = space.out_labels[0] if space.out_labels else ()
    for a, lab in assign:
        if lab is None:
            continue
        if lab in out0:
            parts.append(f"{axis_names[a]}:o{out0.index(lab)}")
        elif lab in space.reduce:
            rs = rs_dim is not None and (not rs_axes or a in rs_axes)
            parts.append(f"{axis_names[a]}:sum" + (f">rs{rs_dim}" if rs else ""))
        else:
            for k, ls in enumerate(space.in_labels):
                if ls is not None and lab in ls:
                    parts.append(f"{axis_names[a]}:i{k}.{ls.index(lab)}")
                    break
    return " ".join(parts) or "R"


def enumerate_strategies(graph: Graph, node: Node, space: OpSpace, mm: MeshModel,
                         bytes_accessed: float | None = None) -> list[Strategy]:
    shape = mm.shape
    axes = [a for a, n in enumerate(shape) if n > 1]
    labels = sorted(l for l in space.sizes if l not in space.blocked and space.sizes[l] > 1)
    out_shapes = [graph.tensors[t].shape for t in node.outputs]
    dtype = node_dtype(graph, node)
    out_bytes = [graph.tensors[t].nbytes for t in node.outputs]
    moved = node.bytes_accessed if bytes_accessed is None else bytes_accessed
    seen: dict[tuple, Strategy] = {}
    for choice in itertools.product([None] + labels, repeat=len(axes)):
        per_label: dict[int, tuple[int, ...]] = {}
        for a, lab in zip(axes, choice):
            if lab is not None:
                per_label[lab] = per_label.get(lab, ()) + (a,)
        if any(space.sizes[l] % math.prod(shape[a] for a in ax) for l, ax in per_label.items()):
            continue
        in_specs = tuple(None if ls is None else _spec(ls, per_label) for ls in space.in_labels)
        out_specs = tuple(_spec(ls, per_label) for ls in space.out_labels)
        shards = math.prod(shape[a] for ax in per_label.values() for a in ax)
        groups = [ax for l, ax in sorted(per_label.items()) if l in space.reduce]
        red_axes = tuple(sorted(a for ax in groups for a in ax))
        local_out = [b / num_shards(s, shape) for b, s in zip(out_bytes, out_specs)]
        # (a loop's body divides each operator's work by its own cut)
        work = sum(share / math.prod(shape[a] for l in labs for a in per_label.get(l, ()))
                   for labs, share in space.work) if space.work else 1 / shards
        t_comp = compute_time(mm.device, node.flops * work, moved * work, dtype,
                              _out_elements(graph, node, num_shards(out_specs[0], shape))
                              if out_specs else 0.0, _out_side(graph, node))
        assign = list(zip(axes, choice))
        variants: list[Variant] = []
        if red_axes:
            ars = [c for b in local_out for c in sum_all_reduces(mm, groups, b)]
            variants.append((out_specs, sum(c[1] for c in ars), sum(c[2] for c in ars), None,
                             "all-reduce", (), tuple(ars) if len(groups) > 1 else ()))
            if space.reduce_scatter and len(out_specs) == 1:
                variants += _scatter_variants(mm, space, red_axes, out_specs[0], out_shapes[0],
                                              local_out[0])
        else:
            variants.append((out_specs, 0.0, 0.0, None, "", (), ()))
        each = [all_reduce(mm, per_label[l], b) for l, b in space.reduce_each_step
                if l in per_label]
        if each:        # (inside a loop: on top of any variant's own collective)
            t_e, b_e = sum(c[0] for c in each), sum(c[1] for c in each)
            e_axes = tuple(sorted({a for l, _ in space.reduce_each_step for a in per_label.get(l, ())}))
            variants = [(o, t + t_e, b + b_e, rs, kind or "all-reduce", ax,
                         parts + (("all-reduce", t_e, b_e, e_axes),) if parts else ())
                        for o, t, b, rs, kind, ax, parts in variants]
        for o_specs, t_c, b_c, rs, kind, rs_axes, parts in variants:
            key = (in_specs, o_specs)
            strat = Strategy(_name(assign, space, mm.mesh.axes, rs, rs_axes), in_specs, o_specs,
                             t_comp, t_c, b_c, kind, parts)
            if key not in seen or strat.cost < seen[key].cost:
                seen[key] = strat
    return list(seen.values())


# (result layouts, comm seconds, comm bytes, reduce-scattered dimension, HLO
# kind, the axes reduce-scattered when only some are, collectives when several)
Variant = tuple[tuple[ISpec, ...], float, float, "int | None", str, tuple[int, ...],
                tuple[tuple[str, float, float, tuple[int, ...]], ...]]


def _scatter_variants(mm: MeshModel, space: OpSpace, red_axes: tuple[int, ...], out: ISpec,
                      out_shape: tuple[int, ...], nbytes: float) -> list[Variant]:
    """The partial sums over ``red_axes`` reduce-scattered onto a free result
    dimension: over all of them, or (with a native reduce-scatter) over some
    of them followed by an all-reduce of the shard over the rest, leaving the
    result replicated over those.  The second is how a data-parallel gradient
    is reduced where the weight is sharded over another axis (FSDP x DP: a
    reduce-scatter on the fast links, an all-reduce of 1/n of the bytes on the
    slow ones, e.g. DCN between TPU slices); XLA's AllReduceSplitter
    (xla/service/all_reduce_splitter.h) rewrites an all-reduce followed by a
    dynamic slice into this pair."""
    shape = mm.shape
    subsets = [red_axes]
    if mm.native_reduce_scatter and len(red_axes) > 1:
        subsets += [c for r in range(1, len(red_axes))
                    for c in itertools.combinations(red_axes, r)]
    out_v: list[Variant] = []
    for d, (dim_axes, size) in enumerate(zip(out, out_shape)):
        if dim_axes or space.out_labels[0][d] in space.blocked:
            continue
        for part in subsets:
            n_part = math.prod(shape[a] for a in part)
            if size % n_part:
                continue
            spec = tuple(part if k == d else x for k, x in enumerate(out))
            t_rs, b_rs = reduce_scatter(mm, part, nbytes)
            if part == red_axes:
                out_v.append(((spec,), t_rs, b_rs, d, reduce_scatter_kind(mm), (), ()))
                continue
            rest = tuple(a for a in red_axes if a not in part)
            t_ar, b_ar = all_reduce(mm, rest, nbytes / n_part)
            out_v.append(((spec,), t_rs + t_ar, b_rs + b_ar, d, reduce_scatter_kind(mm), part,
                          ((reduce_scatter_kind(mm), t_rs, b_rs, part),
                           ("all-reduce", t_ar, b_ar, rest))))
    return out_v


MAX_STRATEGIES = 64


def node_strategies(graph: Graph, node: Node, mm: MeshModel,
                    max_strategies: int = MAX_STRATEGIES,
                    bytes_accessed: float | None = None,
                    offered: Sequence[frozenset[ISpec] | None] | None = None
                    ) -> list[Strategy]:
    """The strategies of ``node`` the ILP gets (:func:`keep_strategies` of
    :func:`all_strategies`)."""
    return keep_strategies(all_strategies(graph, node, mm, bytes_accessed), offered,
                           max_strategies)


def all_strategies(graph: Graph, node: Node, mm: MeshModel,
                   bytes_accessed: float | None = None) -> list[Strategy]:
    """Every strategy of ``node``; a single replicated one when it has no rule."""
    space = node_space(graph, node)
    if space is None or space.independent:
        # (independent components are laid out one by one by the ILP builder;
        # one strategy over all of them would be a product of their layouts)
        return [replicated_strategy(graph, node, mm, bytes_accessed)]
    return (enumerate_strategies(graph, node, space, mm, bytes_accessed)
            or [replicated_strategy(graph, node, mm, bytes_accessed)])


def keep_strategies(strategies: list[Strategy],
                    offered: Sequence[frozenset[ISpec] | None] | None
                    | Callable[[], Sequence[frozenset[ISpec] | None]] = None,
                    max_strategies: int = MAX_STRATEGIES) -> list[Strategy]:
    """``strategies`` as the ILP gets them.  On meshes of three or more axes
    an operator can have hundreds; then only the ``max_strategies`` cheapest
    by their own compute and communication time are kept (ties broken by
    name, so the cut is deterministic), and with them up to twice
    ``max_strategies`` more that read every operand in a layout its maker
    can leave it in (``offered``, per operand, None: any; or a function
    giving them, asked only where there is a cut): see :func:`_cut`.  The
    ILP is exact over the strategies it is given."""
    if len(strategies) <= max_strategies:
        return strategies
    return _cut(strategies, max_strategies, offered() if callable(offered) else offered)


def _cut(strategies: list[Strategy], keep: int,
         offered: Sequence[frozenset[ISpec] | None] | None) -> list[Strategy]:
    """The ``keep`` cheapest strategies by their own cost, then up to twice
    ``keep`` of the others, cheapest first, that need no resharding of any
    operand.  Own cost alone drops those that pay their collective
    themselves in favour of ones whose operands must first be resharded at
    their makers' expense: a weight gradient summed over a batch split over
    all three axes of a TPU mesh pays a reduce-scatter, while a layout that
    splits its result over one axis costs nothing of its own but needs the
    activations gathered.  (On a 4x16x16 multi-slice mesh the own-cost cut
    made every slice run the same examples; with ``keep`` operand-aligned
    strategies the layer ILP of a one-layer gpt was 21% above its optimum
    over every strategy, with twice ``keep`` on it: tests/test_tpu.py.)"""
    ranked = sorted(strategies, key=lambda s: (s.cost, s.name))
    if offered is None:
        return ranked[:keep]

    def free(s: Strategy) -> bool:
        return all(want is None or can is None or want in can
                   for want, can in zip(s.in_specs, offered))
    return ranked[:keep] + [s for s in ranked[keep:] if free(s)][:2 * keep]
