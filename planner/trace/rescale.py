"""The Graph of a step at micro-batch size, rewritten from its full-batch trace.

The pipeline search needs the step's Graph with the batch split into ``B``
micro-batches.  Tracing it again costs seconds for a large model; this module
derives it from the Graph already traced by rewriting shapes instead.

Which dimensions scale is inferred, never guessed from sizes: every
dimension of every tensor is a variable, and each operator states which of
its dimensions are the same (an element-wise op: all of them; a matmul: its
batch and contracting dimensions; a reshape: the batch keeps its place in the
row-major order).  Dimension 0 of the batch arguments scales; dimensions of
parameters, constants and literals do not; dimensions an op makes from
nothing (``iota``, ``broadcast_in_dim``, a random draw's ``random_bits``) take
whatever they are unified with.
Anything that does not fit (an operator without a rule here touching a
scaled dimension, a batch dimension sliced, padded or folded in a way the
rule cannot follow, a made dimension linked to nothing, a dimension that
would shrink to 1, where jax's own tracing special-cases shapes) means "not
provably exact": :func:`rescale_batch` returns None and the caller traces.

A reshape may split the batch index ``b = q * g + r`` so that one dimension
holds ``q`` (``batch / g`` values) and the remainder ``r`` goes with the
dimensions minor to it (MoE expert groups spanning ``g`` sequences); the
merge back is a reshape too.  Such a dimension is rewritten only at
micro-batch sizes that ``g`` divides into more than one ``q`` (other counts
are traced).

:class:`Rescaling` is what the search calls: it traces the first count asked
for (the probe), which settles the dimensions linked to nothing (a broadcast
of zeros no operator reads) and which the rewrite must reproduce exactly, so
a step whose operators depend on the batch size (Python branching on a
shape) is caught there and traced at every count.

FLOPs and bytes of the rewritten nodes come from the tracer's own functions
(:mod:`meshplan.flops`, :class:`~meshplan.graph.Tensor`), so a rewritten
Graph equals the traced one field by field (tests/test_rescale.py checks it).
"""
from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Callable, Iterable

from .. import flops as flop_rules
from ..graph import BATCH, IDENTITY_MARKERS, INTERMEDIATE, Graph, Node, Tensor
from .tracer import _with_fingerprint

__all__ = ["Rescaling", "BatchDims", "batch_dims", "rescale_batch", "graph_difference"]

# dimension labels: FIXED (never scales), or a scaled label ``(outer, inner, g)``:
# the dimension is ``outer * (batch // g) * inner`` elements, the batch index
# divided by ``g`` major to ``inner`` (the remainder is minor to it, in
# ``inner`` or later dimensions; ``(None, None, g)``: only the size is known,
# UNKNOWN_SPLIT where two layouts met)
FIXED = "fixed"
UNKNOWN_SPLIT = (None, None, 1)
# one output per operand, of the operand's shape
_IDENTITIES = IDENTITY_MARKERS | {"optimization_barrier"}
_UNARY_SAME = frozenset({"stop_gradient", "copy", "copy_p", "cumsum", "cumprod", "cummax",
                         "cummin", "cumlogsumexp", "rev", "reduce_precision"})
_REDUCE = frozenset({"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and",
                     "reduce_or", "reduce_xor", "argmax", "argmin"})


class _Ambiguous(Exception):
    """The rewrite cannot be proven exact: trace instead."""


class _Unfit(_Ambiguous):
    """The probe's micro-batches are too few for the batch's ``groups``:
    nothing to check the rewrite against (a probe at another count may)."""

    def __init__(self, micro: int, groups: tuple[int, ...]) -> None:
        super().__init__(f"the probe's micro-batches of {micro} do not split into two or more "
                         f"groups of {list(groups)}")
        self.groups = groups


class Rescaling:
    """``retrace(B) -> Graph`` for the pipeline search: the step's Graph with
    its batch split into ``B`` micro-batches, rewritten from ``graph`` where
    that is proven exact and traced by ``trace(B)`` where not.

    The first count asked for is traced (the probe): dimensions the step
    makes from nothing and links to nothing (a broadcast no op reads) are
    settled by it, and the rewrite at the probe's count must equal the probe
    field by field, or every count is traced.  The probe's Graph and the
    last one made are kept and given again for their counts.  ``log`` holds
    one ``(B, "rewritten" | "traced" | "kept", seconds)`` per call."""

    def __init__(self, graph: Graph, trace: Callable[[int], Graph]) -> None:
        self.graph, self.trace = graph, trace
        self.probe: tuple[int, Graph] | None = None
        self.last: tuple[int, Graph] | None = None   # the last count made, and its Graph
        self.dims: BatchDims | None = None          # after the probe, once a second count comes
        self.log: list[tuple[int, str, float]] = []
        # (what a probe must fit: the groups a reshape splits the batch into)
        self.split = BatchDims(0)

    def __call__(self, B: int) -> Graph:
        t0 = time.perf_counter()
        for kept in (self.probe, self.last):
            if kept is not None and kept[0] == B:
                # (a count asked again, as by plans of one step one after
                # another in a session: the probe, or the last Graph made)
                self.log.append((B, "kept", time.perf_counter() - t0))
                return kept[1]
        batch = _batch_size(self.graph)
        if self.dims is None and self.probe is not None:
            # (analysed only when a second count comes: one count, as a
            # Manual plan asks, is the probe alone)
            self.dims = batch_dims(self.graph, probe=self.probe)
            if self.dims.why and not self.dims.fits(batch // self.probe[0]):
                # the probe's micro-batches are too few for the batch's
                # groups: a later count that fits them probes again
                self.split, self.dims, self.probe = self.dims, None, None
        g = rescale_batch(self.graph, B, self.dims) if self.dims is not None else None
        how = "rewritten"
        if g is None:
            how = "traced"
            g = self.trace(B)
            if self.probe is None and batch and self.split.fits(batch // B):
                # (a probe with micro-batches of one would settle nothing:
                # jax leaves out broadcasts to shapes of ones)
                self.probe = (B, g)
        self.log.append((B, how, time.perf_counter() - t0))
        self.last = (B, g)
        return g

    def counts(self, since: int = 0) -> tuple[int, int, float]:
        """(rewritten, traced, seconds rewriting) over ``log[since:]``."""
        entries = self.log[since:]
        return (sum(h == "rewritten" for _, h, _ in entries),
                sum(h == "traced" for _, h, _ in entries),
                sum((s for _, h, s in entries if h == "rewritten"), 0.0))

    def __repr__(self) -> str:
        r, t, _ = self.counts()
        dims = self.dims or self.split      # (the last probe's, where one was too fine)
        why = f", not rewritable: {dims.why}" if dims.why else ""
        return f"Rescaling({self.graph.name}: {r} rewritten, {t} traced{why})"


@dataclasses.dataclass(frozen=True)
class BatchDims:
    """Which dimensions of a Graph scale with its batch: per tensor, per
    dimension, None (fixed) or ``(outer, inner, g)`` (see the labels above);
    or ``why`` the Graph cannot be rewritten.  ``groups``: the factors ``g``
    above 1 that a reshape splits the batch by (known even with ``why``
    where the analysis got that far)."""
    batch: int
    scaled: tuple[tuple[tuple[int, int, int] | None, ...], ...] = ()
    why: str = ""
    groups: tuple[int, ...] = ()

    def fits(self, micro: int) -> bool:
        """Whether micro-batches of ``micro`` examples may be rewritten: more
        than one, and two or more of every group."""
        return micro > 1 and all(micro % g == 0 and micro // g > 1 for g in self.groups)

    def __repr__(self) -> str:
        n = sum(d is not None for dims in self.scaled for d in dims)
        split = f", the batch split by {list(self.groups)}" if self.groups else ""
        return (f"BatchDims(batch={self.batch}, {n} scaled dimensions{split})" if not self.why
                else f"BatchDims(batch={self.batch}, not rewritable: {self.why})")


def batch_dims(graph: Graph, probe: tuple[int, Graph] | None = None) -> BatchDims:
    """Which dimensions of ``graph`` scale with the batch (computed once per
    Graph, used for every micro-batch count).  ``probe``: ``(B, the step
    traced with B micro-batches)``, which settles dimensions linked to
    nothing and must equal the rewrite at ``B``."""
    batch = _batch_size(graph)
    if not batch:
        return BatchDims(0, why="no single batch size")
    try:
        scaled = _Solver(graph, batch).solve(probe)
        dims = BatchDims(batch, scaled, groups=_groups(d for dims in scaled for d in dims))
        if probe is not None:
            B, traced = probe
            if not dims.fits(batch // B):
                raise _Unfit(batch // B, dims.groups)
            why = graph_difference(_rewrite(graph, dims, batch // B), traced)
            if why:
                raise _Ambiguous(f"the rewrite at {B} micro-batches differs from the trace: {why}")
        return dims
    except _Unfit as e:
        return BatchDims(batch, why=str(e), groups=e.groups)
    except _Ambiguous as e:
        return BatchDims(batch, why=str(e))


def _groups(labels: Iterable[Any]) -> tuple[int, ...]:
    """The factors above 1 that ``labels`` split the batch by."""
    return tuple(sorted({d[2] for d in labels if isinstance(d, tuple) and d[2] > 1}))


def _batch_size(graph: Graph) -> int:
    """Dimension 0 of the batch inputs (0 if none or they disagree)."""
    sizes = {graph.tensors[i.tensor].shape[0] for i in graph.inputs
             if i.role == BATCH and graph.tensors[i.tensor].shape}
    return sizes.pop() if len(sizes) == 1 else 0


def rescale_batch(graph: Graph, B: int, dims: BatchDims | None = None) -> Graph | None:
    """``graph`` with its batch split into ``B`` micro-batches, as a trace at
    that size would make it; None where that cannot be proven (trace then).
    ``dims``: :func:`batch_dims` of ``graph``, if already made."""
    dims = dims or batch_dims(graph)
    if dims.why or B < 1 or dims.batch % B:
        return None
    if B == 1:
        return graph
    try:
        return _rewrite(graph, dims, dims.batch // B)
    except _Ambiguous:
        return None


def graph_difference(a: Graph, b: Graph) -> str | None:
    """The first difference between two Graphs in what the planner reads
    (tensors, operators with their parameters, FLOPs and bytes, inputs with
    their roles, outputs, markers, warnings, fingerprint); None if none."""
    for f in ("name", "batch_argnums", "warnings", "inputs", "outputs"):
        if getattr(a, f) != getattr(b, f):
            return f"{f}: {getattr(a, f)} vs {getattr(b, f)}"
    if len(a.tensors) != len(b.tensors) or len(a.nodes) != len(b.nodes):
        return (f"{len(a.tensors)} tensors and {len(a.nodes)} operators vs "
                f"{len(b.tensors)} and {len(b.nodes)}")
    for x, y in zip(a.tensors, b.tensors):
        if x != y:
            return f"tensor {x} ({x.kind}) vs {y} ({y.kind})"
    for x, y in zip(a.nodes, b.nodes):
        for f in ("id", "primitive", "inputs", "outputs", "flops", "bytes_accessed", "remat",
                  "repeat", "scope"):
            if getattr(x, f) != getattr(y, f):
                return f"operator {x.id} ({x.primitive}) {f}: {getattr(x, f)} vs {getattr(y, f)}"
        if repr(x.params) != repr(y.params):     # (repr: a NaN fill value equals itself)
            return f"operator {x.id} ({x.primitive}) params: {x.params} vs {y.params}"
    if a.fingerprint != b.fingerprint:
        return "fingerprint"
    return None


# ---------------------------------------------------------------------------
# inference: union-find over (tensor, dimension)
# ---------------------------------------------------------------------------

class _Solver:
    def __init__(self, graph: Graph, batch: int) -> None:
        self.g, self.batch = graph, batch
        self.base: list[int] = []
        total = 0
        for t in graph.tensors:
            self.base.append(total)
            total += len(t.shape)
        self.parent = list(range(total))
        self.size = [d for t in graph.tensors for d in t.shape]
        self.label: list[Any] = [None] * total     # per root: None (free), FIXED or (o, i)
        self.reshapes: list[Node] = []

    # ---- union-find --------------------------------------------------------
    def var(self, t: int, d: int) -> int:
        return self.base[t] + d

    def find(self, v: int) -> int:
        while self.parent[v] != v:
            self.parent[v] = self.parent[self.parent[v]]
            v = self.parent[v]
        return v

    def set(self, v: int, label: Any) -> bool:
        """Give ``v``'s class ``label``; True if that changed anything."""
        r = self.find(v)
        merged = _merge(self.label[r], label, self.size[r])
        changed = merged != self.label[r]
        self.label[r] = merged
        return changed

    def union(self, a: int, b: int) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra == rb:
            return
        if self.size[ra] != self.size[rb]:
            raise _Ambiguous(f"dimensions of {self.size[ra]} and {self.size[rb]} elements meet")
        self.parent[rb] = ra
        self.label[ra] = _merge(self.label[ra], self.label[rb], self.size[ra])

    def same(self, t1: int, d1: int, t2: int, d2: int) -> None:
        self.union(self.var(t1, d1), self.var(t2, d2))

    def fixed(self, t: int, *ds: int) -> None:
        for d in ds or range(len(self.g.tensors[t].shape)):
            self.set(self.var(t, d), FIXED)

    def rank(self, t: int) -> int:
        return len(self.g.tensors[t].shape)

    # ---- the constraints ---------------------------------------------------
    def solve(self, probe: tuple[int, Graph] | None
              ) -> tuple[tuple[tuple[int, int, int] | None, ...], ...]:
        g = self.g
        for t in g.tensors:
            if t.kind != INTERMEDIATE:
                self.fixed(t.id)
        for i in g.inputs:
            if i.role == BATCH and g.tensors[i.tensor].shape:
                self.label[self.find(self.var(i.tensor, 0))] = (1, 1, 1)
        for n in g.nodes:
            self.node(n)
        self.settle()
        if probe is not None:
            # (a probe too fine for a split of the batch may trace to other
            # operators: say so before comparing)
            groups = _groups(self.label[r] for r in range(len(self.label)) if self.parent[r] == r)
            if not BatchDims(self.batch, groups=groups).fits(self.batch // probe[0]):
                raise _Unfit(self.batch // probe[0], groups)
            self.from_probe(*probe)
            self.settle()
        out = []
        for t in g.tensors:
            dims = []
            for d, size in enumerate(t.shape):
                lab = self.label[self.find(self.var(t.id, d))]
                if lab is None and size > 1:
                    made = g.nodes[g.producer[t.id]].primitive if t.id in g.producer else "?"
                    raise _Ambiguous(f"a dimension of {size} elements made by {made} (t{t.id}) "
                                     "is tied to no input's dimension")
                dims.append(lab if isinstance(lab, tuple) else None)
            out.append(tuple(dims))
        return tuple(out)

    def settle(self) -> None:
        changed = True
        while changed:      # reshapes pass the batch on in both directions
            changed = False
            for n in self.reshapes:
                changed |= self.reshape(n)

    def from_probe(self, B: int, traced: Graph) -> None:
        """Settle the dimensions still free by ``traced`` (the step at ``B``
        micro-batches): one that kept its size is fixed; one divided by ``B``
        scales if nothing reads it (by the size alone: at micro-batch sizes
        that make it a whole number); anything else, or other operators, is
        not rewritable."""
        g = self.g
        if len(traced.tensors) != len(g.tensors) or len(traced.nodes) != len(g.nodes) or any(
                (x.primitive, x.inputs, x.outputs) != (y.primitive, y.inputs, y.outputs)
                for x, y in zip(g.nodes, traced.nodes)):
            raise _Ambiguous(f"the step traces to other operators with {B} micro-batches")
        seen: dict[int, set[int]] = {}
        read: set[int] = set()       # classes some operator or output reads
        outputs = {o.tensor for o in g.outputs}
        for t, u in zip(g.tensors, traced.tensors):
            if len(t.shape) != len(u.shape):
                raise _Ambiguous(f"t{t.id} has another rank with {B} micro-batches")
            for d, size in enumerate(u.shape):
                r = self.find(self.var(t.id, d))
                if self.label[r] is None:
                    seen.setdefault(r, set()).add(size)
                    if t.id in g.consumers or t.id in outputs:
                        read.add(r)
        for r, probe_sizes in seen.items():
            size = self.size[r]
            if probe_sizes == {size}:
                self.label[r] = FIXED
            elif size % B == 0 and probe_sizes == {size // B} and r not in read:
                # (a value nothing reads: a broadcast of zeros jax made and
                # dropped; size * micro / batch elements, so micro-batches
                # must be a multiple of what that fraction's denominator is)
                self.label[r] = (None, None, self.batch // math.gcd(self.batch, size))
            else:
                raise _Ambiguous(f"a dimension of {size} elements made by the step is "
                                 f"{sorted(probe_sizes)} with {B} micro-batches and tied to no "
                                 "input's dimension")

    def node(self, n: Node) -> None:
        p, ins, outs = n.primitive, n.inputs, n.outputs
        shape = lambda t: self.g.tensors[t].shape  # noqa: E731
        if p in _IDENTITIES:
            for a, b in zip(ins, outs):
                self.all_same(a, b)
        elif p in flop_rules.ELEMENTWISE or p in _UNARY_SAME:
            for a in ins:
                if shape(a):
                    self.all_same(a, outs[0], ones=True)
        elif p == "broadcast_in_dim" and len(ins) == 1:
            bd = n.param("broadcast_dimensions")
            for k, d in enumerate(bd):
                if shape(ins[0])[k] == shape(outs[0])[d]:
                    self.same(ins[0], k, outs[0], d)
                else:
                    self.fixed(ins[0], k)
        elif p == "reshape" and n.param("dimensions") is None and len(ins) == 1:
            self.reshapes.append(n)
        elif p == "squeeze":
            gone = {d % self.rank(ins[0]) for d in n.param("dimensions")}
            kept = [d for d in range(self.rank(ins[0])) if d not in gone]
            for k, d in enumerate(kept):
                self.same(ins[0], d, outs[0], k)
            self.fixed(ins[0], *gone)
        elif p == "transpose":
            for k, d in enumerate(n.param("permutation")):
                self.same(ins[0], d, outs[0], k)
        elif p in _REDUCE:
            axes = set(n.param("axes"))
            kept = [d for d in range(self.rank(ins[0])) if d not in axes]
            for k, d in enumerate(kept):
                self.same(ins[0], d, outs[0], k)
        elif p == "dot_general":
            self.dot(n)
        elif p == "conv_general_dilated":
            self.conv(n)
        elif p == "gather":
            self.gather(n)
        elif p in ("scatter-add", "scatter_add", "scatter"):
            self.scatter(n)
        elif p == "iota":
            pass                # (its dimensions are whatever they meet)
        elif p == "bitcast_convert_type":
            # (a random draw's bits made floats: the same shape at the same
            # width, else a trailing dimension of the widths' ratio comes or goes)
            a, b = ins[0], outs[0]
            for d in range(min(self.rank(a), self.rank(b))):
                self.same(a, d, b, d)
            for t in (a, b):
                if self.rank(t) > min(self.rank(a), self.rank(b)):
                    self.fixed(t, self.rank(t) - 1)
        elif p == "random_bits":
            # a draw's dimensions are whatever they meet (a dropout mask: the
            # activations'); its key's, leading the result's, never scale
            self.fixed(ins[0])
            if self.rank(ins[0]):
                self.fixed(outs[0], *range(self.rank(ins[0])))
        elif p == "slice":
            for d, (lo, hi) in enumerate(zip(n.param("start_indices"), n.param("limit_indices"))):
                strides = n.param("strides")
                if lo == 0 and hi == shape(ins[0])[d] and (strides is None or strides[d] == 1):
                    self.same(ins[0], d, outs[0], d)
                else:
                    self.fixed(ins[0], d)
                    self.fixed(outs[0], d)
        elif p == "pad":
            for d, cfg in enumerate(n.param("padding_config")):
                if tuple(cfg) == (0, 0, 0):
                    self.same(ins[0], d, outs[0], d)
                else:
                    self.fixed(ins[0], d)
                    self.fixed(outs[0], d)
        elif p == "concatenate":
            axis = n.param("dimension")
            for a in ins:
                for d in range(self.rank(a)):
                    if d == axis:
                        self.fixed(a, d)
                    else:
                        self.same(a, d, outs[0], d)
            self.fixed(outs[0], axis)
        elif p in flop_rules.WINDOWED:
            self.window(n)
        elif p == "sort":
            for t in ins[1:] + outs:
                self.all_same(ins[0], t)
        else:
            # no rule here: nothing it touches may scale (control flow,
            # key splits, primitives met nowhere yet)
            for t in ins + outs:
                self.fixed(t)

    def window(self, n: Node) -> None:
        """Pooling and its transposes: operands (init values are scalars) and
        results share the dimensions the window leaves alone; the rest keep
        their size."""
        rank = self.rank(n.outputs[0])
        free = set(flop_rules.window_free_dims(dict(n.params), rank))
        arrays = [t for t in n.inputs + n.outputs if self.rank(t) == rank]
        for d in range(rank):
            for t in arrays:
                if d in free:
                    self.same(arrays[0], d, t, d)
                else:
                    self.fixed(t, d)
        for t in n.inputs:
            if self.rank(t) != rank:
                self.fixed(t)

    def all_same(self, a: int, b: int, ones: bool = False) -> None:
        """``a`` and ``b`` have the same dimensions (``ones``: except where
        ``a`` has 1, which element-wise ops broadcast)."""
        sa, sb = self.g.tensors[a].shape, self.g.tensors[b].shape
        if len(sa) != len(sb):
            raise _Ambiguous(f"element-wise operands of shapes {sa} and {sb}")
        for d, (x, y) in enumerate(zip(sa, sb)):
            if x == y:
                self.same(a, d, b, d)
            elif ones and x == 1:
                self.fixed(a, d)
            else:
                raise _Ambiguous(f"element-wise operands of shapes {sa} and {sb}")

    def dot(self, n: Node) -> None:
        (lc, rc), (lb, rb) = n.param("dimension_numbers")
        lhs, rhs, out = n.inputs[0], n.inputs[1], n.outputs[0]
        for a, b in zip(lc, rc):
            self.same(lhs, a, rhs, b)
        k = 0
        for a, b in zip(lb, rb):
            self.same(lhs, a, out, k)
            self.same(rhs, b, out, k)
            k += 1
        for t, skip in ((lhs, set(lc) | set(lb)), (rhs, set(rc) | set(rb))):
            for d in range(self.rank(t)):
                if d not in skip:
                    self.same(t, d, out, k)
                    k += 1

    def conv(self, n: Node) -> None:
        lhs_spec, rhs_spec, out_spec = n.param("dimension_numbers")
        lhs, rhs, out = n.inputs[0], n.inputs[1], n.outputs[0]
        plain_batch = n.param("batch_group_count") == 1
        if plain_batch:
            self.same(lhs, lhs_spec[0], out, out_spec[0])
            self.same(rhs, rhs_spec[0], out, out_spec[1])
        else:
            self.fixed(lhs, lhs_spec[0])
            self.fixed(out, out_spec[0], out_spec[1])
            self.fixed(rhs, rhs_spec[0])
        if n.param("feature_group_count") == 1:
            self.same(lhs, lhs_spec[1], rhs, rhs_spec[1])
        else:
            self.fixed(lhs, lhs_spec[1])
            self.fixed(rhs, rhs_spec[1])
        self.fixed(lhs, *lhs_spec[2:])
        self.fixed(rhs, *rhs_spec[2:])
        self.fixed(out, *out_spec[2:])

    def gather(self, n: Node) -> None:
        offset, collapsed, _start_map, op_batch, idx_batch = n.param("dimension_numbers")
        operand, indices, out = n.inputs[0], n.inputs[1], n.outputs[0]
        sizes = n.param("slice_sizes")
        op_shape = self.g.tensors[operand].shape
        window = [d for d in range(len(op_shape)) if d not in collapsed and d not in op_batch]
        for k, d in zip(offset, window):
            if sizes[d] == op_shape[d]:
                self.same(operand, d, out, k)
            else:
                self.fixed(operand, d)
                self.fixed(out, k)
        self.fixed(operand, *collapsed)
        for a, b in zip(op_batch, idx_batch):
            self.same(operand, a, indices, b)
        rest = [d for d in range(self.rank(out)) if d not in offset]
        for k, d in enumerate(rest):
            self.same(indices, k, out, d)
        self.fixed(indices, self.rank(indices) - 1)

    def scatter(self, n: Node) -> None:
        window, inserted, _to_operand, op_batch, idx_batch = n.param("dimension_numbers")
        operand, indices, updates, out = n.inputs[0], n.inputs[1], n.inputs[2], n.outputs[0]
        self.all_same(operand, out)
        op_shape, up_shape = self.g.tensors[operand].shape, self.g.tensors[updates].shape
        op_window = [d for d in range(len(op_shape)) if d not in inserted and d not in op_batch]
        for k, d in zip(window, op_window):
            if up_shape[k] == op_shape[d]:
                self.same(updates, k, operand, d)
            else:
                self.fixed(updates, k)
                self.fixed(operand, d)
        self.fixed(operand, *inserted)
        for a, b in zip(op_batch, idx_batch):
            self.same(operand, a, indices, b)
        rest = [d for d in range(len(up_shape)) if d not in window]
        for k, d in enumerate(rest):
            self.same(indices, k, updates, d)
        self.fixed(indices, self.rank(indices) - 1)

    def reshape(self, n: Node) -> bool:
        """Pass a scaled dimension through a reshape (either way); True if
        any label changed.  The batch index keeps its place in the row-major
        order: with ``outer`` elements major to it and ``minor`` minor on one
        side, the other side's dimension that holds it is the one whose
        major dimensions fit in ``outer`` (see :func:`_holder`); nothing
        else scales on either side."""
        a, b = n.inputs[0], n.outputs[0]
        sa, sb = self.scaled_dims(a), self.scaled_dims(b)
        if len(sa) > 1 or len(sb) > 1:
            raise _Ambiguous("a reshape of two batch dimensions")
        if not sa and not sb:
            return False
        src, dst, k = (a, b, sa[0]) if sa else (b, a, sb[0])
        shape_src, shape_dst = self.g.tensors[src].shape, self.g.tensors[dst].shape
        o, i, g = self.label[self.find(self.var(src, k))]
        if o is None:
            raise _Ambiguous("a reshape of a batch dimension of unknown layout")
        outer = math.prod(shape_src[:k]) * o
        minor = i * math.prod(shape_src[k + 1:])
        held = _holder(shape_dst, outer, minor, self.batch, g)
        if held is None:
            raise _Ambiguous(f"a reshape {shape_src} -> {shape_dst} splits the batch")
        j, label = held
        changed = self.set(self.var(dst, j), label)
        for t, keep in ((src, k), (dst, j)):
            for d in range(self.rank(t)):
                if d != keep:
                    changed |= self.set(self.var(t, d), FIXED)
        return changed

    def scaled_dims(self, t: int) -> list[int]:
        return [d for d in range(self.rank(t))
                if isinstance(self.label[self.find(self.var(t, d))], tuple)]


def _merge(x: Any, y: Any, size: int) -> Any:
    if x is None or x == y:
        return y if x is None else x
    if y is None:
        return x
    if x == FIXED or y == FIXED:
        raise _Ambiguous(f"a dimension of {size} elements both scales with the batch and does not")
    if x[2] != 1 or y[2] != 1:
        # (UNKNOWN_SPLIT would drop the micro-batch sizes its groups need)
        raise _Ambiguous(f"a dimension of {size} elements holds a split batch in two layouts")
    return UNKNOWN_SPLIT        # (two layouts of the same size)


def _holder(shape: tuple[int, ...], outer: int, minor: int, batch: int, g: int
            ) -> tuple[int, tuple[int, int, int]] | None:
    """The dimension of ``shape`` that holds the batch index of the row-major
    layout ``[outer][batch // g][minor]``, and its label; None if none does.

    It is the one whose major dimensions fit in ``outer``; it holds the
    batch index divided by the least further factor ``g2`` that lets the
    dimensions minor to it fit in ``g2 * minor`` (1 where they fit in
    ``minor``), which must divide the batch and leave at least two values.
    At most one dimension can: it has at least ``2 * outer / before``
    elements, so the next ``before`` no longer divides ``outer``."""
    for j, size in enumerate(shape):
        before, after = math.prod(shape[:j]), math.prod(shape[j + 1:])
        if outer % before:
            break
        g2 = after // math.gcd(after, minor)
        if (batch // g) % g2 or batch // (g * g2) < 2:
            continue
        o, i, split = outer // before, g2 * minor // after, g * g2
        # (a remainder merged back: the batch index whole again, as the
        # dimension it was split from)
        common = math.gcd(split, i)
        i, split = i // common, split // common
        if size == o * (batch // split) * i:
            return j, (o, i, split)
    return None


# ---------------------------------------------------------------------------
# the rewrite
# ---------------------------------------------------------------------------

class _ConvNumbers:
    """The sanitized conv dimension numbers, as the FLOP rule reads them."""
    def __init__(self, specs: tuple) -> None:
        self.lhs_spec, self.rhs_spec, self.out_spec = specs


def _rewrite(graph: Graph, dims: BatchDims, micro: int) -> Graph:
    tensors = list(graph.tensors)
    changed: set[int] = set()
    for t, scaled in zip(graph.tensors, dims.scaled):
        if not any(s is not None for s in scaled):
            continue
        shape = []
        for d, s in zip(t.shape, scaled):
            if s is None:
                shape.append(d)
            else:
                o, i, g = s
                if micro % g or (g > 1 and micro // g < 2):
                    raise _Ambiguous(f"micro-batches of {micro} do not split into two or more "
                                     f"groups of {g}")
                # (a layout unknown: only the size, a multiple of batch / g)
                shape.append(d * micro // dims.batch if o is None else o * (micro // g) * i)
        if any(x <= 1 for x, s in zip(shape, scaled) if s is not None):
            # (jax's tracing special-cases dimensions of 1: broadcasts and
            # reshapes that become identities are left out)
            raise _Ambiguous("a batch dimension of 1")
        tensors[t.id] = Tensor(t.id, tuple(shape), t.dtype, t.kind)
        changed.add(t.id)
    nodes = []
    for n in graph.nodes:
        if changed.isdisjoint(n.inputs) and changed.isdisjoint(n.outputs):
            nodes.append(n)
            continue
        nodes.append(_node(n, tensors, graph.tensors))
    return _with_fingerprint(dataclasses.replace(graph, tensors=tuple(tensors),
                                                 nodes=tuple(nodes), fingerprint=""))


def _node(n: Node, tensors: list[Tensor], old: tuple[Tensor, ...]) -> Node:
    ins = [tensors[t].shape for t in n.inputs]
    outs = [tensors[t].shape for t in n.outputs]
    params = dict(n.params)
    p = n.primitive
    if p in ("broadcast_in_dim", "iota"):
        params["shape"] = outs[0]
    elif p == "random_bits":
        params["shape"] = outs[0][len(ins[0]):]
    elif p == "reshape":
        params["new_sizes"] = outs[0]
        if ins[0] == outs[0]:
            raise _Ambiguous("a reshape that becomes an identity")
    elif p == "slice":
        was = old[n.inputs[0]].shape     # (only whole-dimension slices scale)
        params["limit_indices"] = tuple(new if new != before else hi for new, before, hi in
                                        zip(ins[0], was, params["limit_indices"]))
    elif p == "gather":
        offset, collapsed, _m, op_batch, _ib = params["dimension_numbers"]
        window = [d for d in range(len(ins[0])) if d not in collapsed and d not in op_batch]
        sizes = list(params["slice_sizes"])
        for k, d in zip(offset, window):
            sizes[d] = outs[0][k]
        params["slice_sizes"] = tuple(sizes)
    if p == "broadcast_in_dim" and ins[0] == outs[0]:
        raise _Ambiguous("a broadcast that becomes an identity")
    new_params = tuple((k, params[k]) for k, _ in n.params)
    flop_params = dict(new_params)
    if p == "conv_general_dilated":
        flop_params["dimension_numbers"] = _ConvNumbers(flop_params["dimension_numbers"])
    flops = flop_rules.flops_of(p, ins, outs, flop_params)
    nbytes = sum(tensors[t].nbytes for t in n.inputs + n.outputs)
    return Node(n.id, p, n.inputs, n.outputs, new_params, flops, nbytes, n.remat, n.repeat,
                n.scope)
