"""Per-primitive sharding rules: a table from primitive name to an OpSpace.

An :class:`OpSpace` describes an operator the way an einsum does: every
dimension of every operand and result carries a *label*; dimensions with the
same label are split together.  Labels that appear in operands but not in the
results are reductions: splitting them leaves partial results that an
all-reduce (or reduce-scatter) must combine.  Blocked labels may not be split
(a concatenation axis, a sort axis, a sliced dimension).  Operands with no
labels (scalars, index operands) are always replicated.

Strategy enumeration (:mod:`meshplan.ilp.strategies`) is then one generic
mechanism for every primitive: assign each mesh axis to a label or to none.
A primitive with no rule is planned replicated, with a warning.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Callable, Mapping, Sequence

from ..flops import (BARRIERS, ELEMENTWISE, RANDOM, WINDOWED, sorted_axis,
                     window_free_dims)
from .loops import loop_classes, loop_steps

Shape = tuple[int, ...]


@dataclass(frozen=True)
class OpSpace:
    in_labels: tuple[tuple[int, ...] | None, ...]
    out_labels: tuple[tuple[int, ...], ...]
    sizes: dict[int, int]
    blocked: frozenset[int] = frozenset()
    reduce: frozenset[int] = frozenset()
    elementwise: bool = False            # results follow the first same-shaped operand
    reduce_scatter: bool = False         # partial sums may be reduce-scattered instead
    # the results fall into independent components (a per-element cond): a
    # result and the operands with its labels share a layout, and each
    # component may be laid out apart (the ILP builder does so)
    independent: bool = False
    # (label, bytes): splitting the label leaves partial sums inside a loop's
    # body, which an all-reduce of that many bytes (all steps) combines
    reduce_each_step: tuple[tuple[int, float], ...] = ()
    # a loop's body: (labels, share of its FLOPs) per set of labels its
    # operators' dimensions carry; a split divides each share by its cut of
    # those labels alone (empty: the whole work divides by every split)
    work: tuple[tuple[frozenset[int], float], ...] = ()


class _Labels:
    def __init__(self) -> None:
        self.sizes: dict[int, int] = {}
        self.blocked: set[int] = set()

    def new(self, size: int, blocked: bool = False) -> int:
        lab = len(self.sizes)
        self.sizes[lab] = size
        if blocked or size == 1:
            self.blocked.add(lab)
        return lab

    def fresh(self, shape: Shape, blocked_dims: Sequence[int] = ()) -> tuple[int, ...]:
        return tuple(self.new(s, d in blocked_dims) for d, s in enumerate(shape))

    def space(self, ins, outs, *, reduce=(), elementwise=False, reduce_scatter=False,
              independent=False, reduce_each_step=(), work=()) -> OpSpace:
        # only labels some operand or result carries: a split of any other
        # would divide the work without changing a layout
        used = {l for ls in tuple(ins) + tuple(outs) if ls is not None for l in ls}
        return OpSpace(tuple(ins), tuple(outs),
                       {l: n for l, n in self.sizes.items() if l in used},
                       frozenset(self.blocked & used), frozenset(reduce), elementwise,
                       reduce_scatter, independent, tuple(reduce_each_step), tuple(work))


Rule = Callable[[Sequence[Shape], Sequence[Shape], dict[str, Any]], OpSpace | None]


def _same_or_blocked(L: _Labels, out: tuple[int, ...], out_shape: Shape, shape: Shape):
    """Labels of an operand aligned with the result dim by dim (broadcast size-1 dims
    get their own blocked labels; scalars get none)."""
    if len(shape) == 0:
        return None
    if len(shape) != len(out_shape):
        return L.fresh(shape, blocked_dims=range(len(shape)))
    return tuple(o if s == os_ else L.new(s, True) for o, s, os_ in zip(out, shape, out_shape))


def elementwise_rule(ins: Sequence[Shape], outs: Sequence[Shape], params) -> OpSpace:
    L = _Labels()
    out = L.fresh(outs[0])
    in_labels = [_same_or_blocked(L, out, outs[0], s) for s in ins]
    out_labels = [out] + [out if o == outs[0] else L.fresh(o, range(len(o))) for o in outs[1:]]
    return L.space(in_labels, out_labels, elementwise=True)


def dot_general_rule(ins, outs, params) -> OpSpace:
    (lc, rc), (lb, rb) = params["dimension_numbers"]
    lhs, rhs = ins
    L = _Labels()
    lhs_l: list[int | None] = [None] * len(lhs)
    rhs_l: list[int | None] = [None] * len(rhs)
    batch = []
    for a, b in zip(lb, rb):
        lab = L.new(lhs[a])
        lhs_l[a] = rhs_l[b] = lab
        batch.append(lab)
    contract = []
    for a, b in zip(lc, rc):
        lab = L.new(lhs[a])
        lhs_l[a] = rhs_l[b] = lab
        contract.append(lab)
    lfree = [d for d in range(len(lhs)) if lhs_l[d] is None]
    rfree = [d for d in range(len(rhs)) if rhs_l[d] is None]
    for d in lfree:
        lhs_l[d] = L.new(lhs[d])
    for d in rfree:
        rhs_l[d] = L.new(rhs[d])
    out = tuple(batch) + tuple(lhs_l[d] for d in lfree) + tuple(rhs_l[d] for d in rfree)
    return L.space([tuple(lhs_l), tuple(rhs_l)], [out], reduce=contract, reduce_scatter=True)


def conv_rule(ins, outs, params) -> OpSpace | None:
    """Batch, input and output features split as a matmul's (the input
    features contracted).  A grouped convolution pairs each group of
    features with its own filters: there the grouped dimensions stay whole,
    and what remains splits: the batch of a depthwise convolution
    (``feature_group_count``), the contracted examples of its weight
    gradient (``batch_group_count``, whose lhs batch holds the groups)."""
    fg, bg = params.get("feature_group_count", 1), params.get("batch_group_count", 1)
    dn = params["dimension_numbers"]
    if hasattr(dn, "lhs_spec"):
        lhs_spec, rhs_spec, out_spec = dn.lhs_spec, dn.rhs_spec, dn.out_spec
    else:  # the Graph keeps them as plain tuples
        lhs_spec, rhs_spec, out_spec = dn
    lhs, rhs = ins
    out = outs[0]
    L = _Labels()
    n = L.new(lhs[lhs_spec[0]], bg != 1)
    cin = L.new(lhs[lhs_spec[1]], fg != 1)
    cout = L.new(rhs[rhs_spec[0]], fg != 1 or bg != 1)
    lhs_l = [0] * len(lhs)
    rhs_l = [0] * len(rhs)
    out_l = [0] * len(out)
    lhs_l[lhs_spec[0]], lhs_l[lhs_spec[1]] = n, cin
    rhs_l[rhs_spec[0]] = cout
    rhs_l[rhs_spec[1]] = cin if fg == 1 else L.new(rhs[rhs_spec[1]], True)
    out_l[out_spec[0]] = n if bg == 1 else L.new(out[out_spec[0]], True)
    out_l[out_spec[1]] = cout
    for k in range(2, len(lhs_spec)):  # spatial dims: halos are not modelled, keep whole
        lhs_l[lhs_spec[k]] = L.new(lhs[lhs_spec[k]], True)
        rhs_l[rhs_spec[k]] = L.new(rhs[rhs_spec[k]], True)
        out_l[out_spec[k]] = L.new(out[out_spec[k]], True)
    return L.space([tuple(lhs_l), tuple(rhs_l)], [tuple(out_l)], reduce=[cin] if fg == 1 else [],
                   reduce_scatter=True)


def reduction_rule(ins, outs, params) -> OpSpace:
    axes = tuple(params.get("axes", ()))
    L = _Labels()
    inl = L.fresh(ins[0])
    out = tuple(inl[d] for d in range(len(ins[0])) if d not in axes)
    extra = [inl if s == ins[0] else _same_or_blocked(L, inl, ins[0], s) for s in ins[1:]]
    return L.space([inl] + extra, [out] * len(outs), reduce=[inl[d] for d in axes])


def arg_reduction_rule(ins, outs, params) -> OpSpace:
    axis = params["axes"][0] if "axes" in params else params.get("axis", 0)
    L = _Labels()
    inl = L.fresh(ins[0], blocked_dims=[axis])
    out = tuple(inl[d] for d in range(len(ins[0])) if d != axis)
    return L.space([inl], [out])


def along_axis_rule(param: str) -> Rule:
    """Ops that mix values along one axis (cumsum, sort): that axis stays whole."""
    def rule(ins, outs, params) -> OpSpace:
        axis = params.get(param, -1)
        if isinstance(axis, (tuple, list)):
            axis = axis[0]
        axis = axis % max(len(ins[0]), 1)
        L = _Labels()
        lab = L.fresh(ins[0], blocked_dims=[axis])
        return L.space([lab if s == ins[0] else None for s in ins],
                       [lab if o == ins[0] else L.fresh(o, range(len(o))) for o in outs])
    return rule


def reduce_window_rule(ins, outs, params) -> OpSpace:
    """reduce_window (pooling), select_and_gather_add, and select_and_scatter_add
    (max pooling's transpose: pooled source, operand and operand-shaped
    result): the operands (init values are scalars) and results share the
    dimensions the window leaves alone."""
    rank = len(outs[0])
    free = window_free_dims(params, rank)
    L = _Labels()
    shared = {d: L.new(outs[0][d]) for d in free}
    def labels(shape):
        return tuple(shared[d] if d in shared else L.new(shape[d], True) for d in range(rank))
    return L.space([labels(s) if len(s) == rank else None for s in ins],
                   [labels(o) for o in outs])


def top_k_rule(ins, outs, params) -> OpSpace:
    """approx_max_k along its axis: every other dimension may be split."""
    rank = len(ins[0])
    axis = sorted_axis(params, rank)
    L = _Labels()
    inl = L.fresh(ins[0], blocked_dims=[axis])
    outl = [tuple(inl[d] if d != axis else L.new(o[d], True) for d in range(rank)) for o in outs]
    return L.space([inl], outl)


def transpose_rule(ins, outs, params) -> OpSpace:
    perm = params["permutation"]
    L = _Labels()
    inl = L.fresh(ins[0])
    return L.space([inl], [tuple(inl[p] for p in perm)])


def broadcast_rule(ins, outs, params) -> OpSpace:
    bd = params["broadcast_dimensions"]
    L = _Labels()
    out = L.fresh(outs[0])
    operand = tuple(out[bd[i]] if ins[0][i] == outs[0][bd[i]] else L.new(ins[0][i], True)
                    for i in range(len(ins[0])))
    rest = [None] * (len(ins) - 1)  # dynamic shape operands
    return L.space([operand if ins[0] else None] + rest, [out])


def reshape_rule(ins, outs, params) -> OpSpace:
    """Dimensions are matched in groups of equal products.  Splitting the
    major-most dimension of a group into ``n`` pieces takes the same contiguous
    ``1/n`` of the group on both sides, so those two share a label (of size
    gcd of the two, which every split must divide); the rest stay whole."""
    src, dst = ins[0], outs[0]
    L = _Labels()
    inl = [L.new(1, True) if s == 1 else -1 for s in src]
    outl = [L.new(1, True) if s == 1 else -1 for s in dst]
    si = [d for d, s in enumerate(src) if s != 1]
    di = [d for d, s in enumerate(dst) if s != 1]
    i = j = 0
    while i < len(si) and j < len(di):
        gi, gj = [si[i]], [di[j]]
        pi, pj = src[si[i]], dst[di[j]]
        while pi != pj:
            if pi < pj:
                i += 1
                gi.append(si[i])
                pi *= src[si[i]]
            else:
                j += 1
                gj.append(di[j])
                pj *= dst[di[j]]
        head = L.new(math.gcd(src[gi[0]], dst[gj[0]]))
        inl[gi[0]], outl[gj[0]] = head, head
        for k in gi[1:]:
            inl[k] = L.new(src[k], True)
        for k in gj[1:]:
            outl[k] = L.new(dst[k], True)
        i, j = i + 1, j + 1
    return L.space([tuple(inl)] + [None] * (len(ins) - 1), [tuple(outl)])


def slice_like_rule(ins, outs, params) -> OpSpace:
    """slice / pad / dynamic_slice: dimensions whose size is unchanged may be split."""
    L = _Labels()
    src, dst = ins[0], outs[0]
    unchanged = [d for d in range(len(src)) if src[d] == dst[d]]
    if params.get("padding_config") is not None:
        unchanged = [d for d in unchanged if tuple(params["padding_config"][d]) == (0, 0, 0)]
    if params.get("strides") not in (None, ()) and any(s != 1 for s in params["strides"] or ()):
        unchanged = [d for d in unchanged if params["strides"][d] == 1]
    inl = L.fresh(src, blocked_dims=[d for d in range(len(src)) if d not in unchanged])
    outl = tuple(inl[d] if d in unchanged else L.new(dst[d], True) for d in range(len(dst)))
    return L.space([inl] + [None] * (len(ins) - 1), [outl])


def dynamic_update_slice_rule(ins, outs, params) -> OpSpace:
    L = _Labels()
    op, upd = ins[0], ins[1]
    same = [d for d in range(len(op)) if op[d] == upd[d]]
    opl = L.fresh(op, blocked_dims=[d for d in range(len(op)) if d not in same])
    updl = tuple(opl[d] if d in same else L.new(upd[d], True) for d in range(len(upd)))
    return L.space([opl, updl] + [None] * (len(ins) - 2), [opl])


def concatenate_rule(ins, outs, params) -> OpSpace:
    dim = params["dimension"]
    L = _Labels()
    out = L.fresh(outs[0], blocked_dims=[dim])
    in_labels = [tuple(out[d] if d != dim else L.new(s[d], True) for d in range(len(s))) for s in ins]
    return L.space(in_labels, [out])


def split_rule(ins, outs, params) -> OpSpace:
    """jnp.split: pieces along ``axis``; every other dimension may stay split
    (rotary embeddings split q and k in halves in every layer)."""
    axis = params["axis"] % len(ins[0])
    L = _Labels()
    inl = L.fresh(ins[0], blocked_dims=[axis])
    outl = [tuple(inl[d] if d != axis else L.new(o[d], True) for d in range(len(o)))
            for o in outs]
    return L.space([inl], outl)


def stack_rule(ins, outs, params) -> OpSpace:
    """jnp.stack (jax's ``stack`` primitive): the operands' dimensions may be
    split alike; the new ``axis`` stays whole (each operand is one slice of it)."""
    axis = params["axis"] % len(outs[0])
    L = _Labels()
    inl = L.fresh(ins[0])
    out = inl[:axis] + (L.new(outs[0][axis], True),) + inl[axis:]
    return L.space([inl if s == ins[0] else None for s in ins], [out])


def unstack_rule(ins, outs, params) -> OpSpace:
    """jnp.unstack: the pieces along ``axis`` stay whole; every other dimension
    may be split, each piece split like its operand."""
    axis = params["axis"] % len(ins[0])
    L = _Labels()
    inl = L.fresh(ins[0], blocked_dims=[axis])
    out = inl[:axis] + inl[axis + 1:]
    return L.space([inl], [out] * len(outs))


def squeeze_rule(ins, outs, params) -> OpSpace:
    dims = set(d % len(ins[0]) for d in params["dimensions"])
    L = _Labels()
    inl = L.fresh(ins[0], blocked_dims=dims)
    return L.space([inl], [tuple(inl[d] for d in range(len(ins[0])) if d not in dims)])


def rev_rule(ins, outs, params) -> OpSpace:
    """rev: the reversed dimensions stay whole, the others may be split."""
    dims = set(d % max(len(ins[0]), 1) for d in params.get("dimensions", ()))
    L = _Labels()
    inl = L.fresh(ins[0], blocked_dims=dims)
    return L.space([inl], [inl])


def cond_rule(ins, outs, params) -> OpSpace | None:
    """A cond whose branches work element by element (the tracer records its
    ``components``, :mod:`meshplan.trace.cond`): the operands and results of
    one component share labels, so any common layout of them is consistent
    in every branch; the branch index is replicated.  The components a
    branch reduces to a scalar (``reduced``) are named by
    ``reduce_each_step``: where one is split, the ILP builder charges its
    share of the one all-reduce XLA combines the cond's scalars into, and a
    loop around the cond an all-reduce per step.  Other branches are read as
    a loop body run once (:func:`loop_rule`)."""
    comps = params.get("components")
    if comps is None or len(comps) != len(ins) - 1 + len(outs):
        # (branches that mix some dimensions, as a matmul does: split the
        # others, as a loop of one step is split)
        return loop_rule(ins, outs, params)
    L = _Labels()
    labels: dict[int, tuple[int, ...]] = {}

    def of(c: int, shape: Shape) -> tuple[int, ...] | None:
        if not shape:
            return None
        if c < 0:
            return L.fresh(shape)
        if c not in labels:
            labels[c] = L.fresh(shape)
        return labels[c]
    n = len(ins) - 1
    in_l = [None] + [of(c, s) for c, s in zip(comps[:n], ins[1:])]
    out_l = [of(c, o) or () for c, o in zip(comps[n:], outs)]
    each = [(l, 4.0) for c in params.get("reduced", ()) for l in labels.get(c, ())]
    return L.space(in_l, out_l, independent=True, reduce_each_step=each)


def loop_rule(ins, outs, params) -> OpSpace | None:
    """A scan or while loop (the tracer records its body as ``loop``,
    :mod:`meshplan.ilp.loops`): the dimensions its body does not mix (the
    batch of a time-step recurrence's carry) may be split, alike in every
    operand and result of their class; the rest stay whole.  A class the
    body contracts over (an RNN's weight gradient summed over the batch)
    costs an all-reduce of the partial sums in every step.  None when
    nothing may be split: the loop runs replicated (and is warned about)."""
    desc = params.get("loop")
    if desc is None:
        return None
    classes, partial, by_classes = loop_classes(desc, ins, outs, op_space)
    steps = loop_steps(params)
    L = _Labels()
    label: dict[int, int] = {}

    def labels(cls: tuple[int, ...] | None, shape: Shape) -> tuple[int, ...] | None:
        if cls is None:
            return None
        for k, n in zip(cls, shape):
            if k >= 0 and k not in label:
                label[k] = L.new(n)
        return tuple(L.new(n, True) if k < 0 else label[k] for k, n in zip(cls, shape))
    in_l = [labels(k, s) for k, s in zip(classes, ins)]
    out_l = [labels(k, o) or () for k, o in zip(classes[len(ins):], outs)]
    if all(l in L.blocked for l in L.sizes):
        return None
    each = [(label[k], b * steps) for k, b in sorted(partial.items()) if k in label]
    total = sum(by_classes.values())
    work = sorted((frozenset(label[k] for k in ks if k in label), f / total)
                  for ks, f in by_classes.items() if f) if total else ()
    return L.space(in_l, out_l, reduce_each_step=each, work=work)


def iota_rule(ins, outs, params) -> OpSpace:
    L = _Labels()
    return L.space([None] * len(ins), [L.fresh(outs[0])])


def random_bits_rule(ins, outs, params) -> OpSpace | None:
    """Bits drawn from a key read whole, split any way, when a split draw equals
    the whole one (jax_threefry_partitionable, recorded when traced)."""
    return iota_rule(ins, outs, params) if params.get("partitionable") else None


def select_n_rule(ins, outs, params) -> OpSpace:
    return elementwise_rule(ins, outs, params)


def gather_rule(ins, outs, params) -> OpSpace | None:
    """Gathered (indexed) operand dimensions stay whole; full-size window
    dimensions and the index batch dimensions may be split."""
    operand, indices = ins[0], ins[1]
    out = outs[0]
    offset_dims, collapsed, start_map, op_batch, idx_batch = params["dimension_numbers"]
    slice_sizes = params["slice_sizes"]
    L = _Labels()
    ivd = len(indices) - 1
    op_l: list[int | None] = [None] * len(operand)
    idx_l: list[int | None] = [None] * len(indices)
    idx_l[ivd] = L.new(indices[ivd], True)
    for od, idd in zip(op_batch, idx_batch):
        op_l[od] = idx_l[idd] = L.new(operand[od])
    for d in range(len(indices)):
        if idx_l[d] is None:
            idx_l[d] = L.new(indices[d])
    trivial = []
    for d in range(len(operand)):
        if op_l[d] is None:
            whole = d not in start_map and d not in collapsed and slice_sizes[d] == operand[d]
            if not whole and d in start_map and slice_sizes[d] == 1:
                # an indexed dimension sliced one element at a time may be split:
                # each device gathers what falls in its range (zeros elsewhere)
                # and an all-reduce adds the pieces (XLA's trivial-slice gather)
                op_l[d] = L.new(operand[d])
                trivial.append(op_l[d])
            else:
                op_l[d] = L.new(operand[d], not whole)
    out_l: list[int | None] = [None] * len(out)
    window = [d for d in range(len(operand)) if d not in collapsed and d not in op_batch]
    for od, d in zip(offset_dims, window):
        out_l[od] = (op_l[d] if out[od] == operand[d] and op_l[d] not in trivial
                     else L.new(out[od], True))
    batch_out = [d for d in range(len(out)) if d not in offset_dims]
    for od, idd in zip(batch_out, [d for d in range(len(indices)) if d != ivd]):
        out_l[od] = idx_l[idd] if out[od] == indices[idd] else L.new(out[od], True)
    if any(l is None for l in out_l):
        return None
    return L.space([tuple(op_l), tuple(idx_l)] + [None] * (len(ins) - 2), [tuple(out_l)],
                   reduce=trivial)


def scatter_rule(reduce_updates: bool) -> Rule:
    """Scatter: window dimensions follow the operand; the update (scatter)
    dimensions follow the indices.  For scatter-add, splitting the update
    dimensions leaves partial sums (a reduction label)."""
    def rule(ins, outs, params) -> OpSpace | None:
        if len(ins) != 3:
            return None
        operand, indices, updates = ins
        uwd, inserted, sd_to_od, op_batch, idx_batch = params["dimension_numbers"]
        L = _Labels()
        ivd = len(indices) - 1
        op_l: list[int | None] = [None] * len(operand)
        idx_l: list[int | None] = [None] * len(indices)
        idx_l[ivd] = L.new(indices[ivd], True)
        for od, idd in zip(op_batch, idx_batch):
            op_l[od] = idx_l[idd] = L.new(operand[od])
        scatter_labels = []
        for d in range(len(indices)):
            if idx_l[d] is None:
                idx_l[d] = L.new(indices[d], not reduce_updates)
                scatter_labels.append(idx_l[d])
        trivial = []
        for d in range(len(operand)):
            if op_l[d] is None:
                if d in sd_to_od and d in inserted:
                    # scattered one element at a time: each device applies the
                    # updates that fall in its range (XLA's trivial-slice scatter)
                    op_l[d] = L.new(operand[d])
                    trivial.append(op_l[d])
                else:
                    op_l[d] = L.new(operand[d], d in sd_to_od or d in inserted)
        upd_l: list[int | None] = [None] * len(updates)
        window = [d for d in range(len(operand)) if d not in inserted and d not in op_batch]
        for ud, d in zip(uwd, window):
            upd_l[ud] = (op_l[d] if updates[ud] == operand[d] and op_l[d] not in trivial
                         else L.new(updates[ud], True))
        scatter_dims = [d for d in range(len(updates)) if d not in uwd]
        for ud, idd in zip(scatter_dims, [d for d in range(len(indices)) if d != ivd]):
            upd_l[ud] = idx_l[idd] if updates[ud] == indices[idd] else L.new(updates[ud], True)
        if any(l is None for l in upd_l):
            return None
        return L.space([tuple(op_l), tuple(idx_l), tuple(upd_l)], [tuple(op_l)],
                       reduce=scatter_labels if reduce_updates else ())
    return rule


# Random keys are planned replicated (identical on all devices).  The bits
# drawn from them may be split any way: with jax_threefry_partitionable (on
# by default) a sharded draw equals the unsharded one, element by element.
REPLICATED = RANDOM - {"random_bits"}


def _rules() -> Mapping[str, Rule]:
    table: dict[str, Rule] = {
        **{p: elementwise_rule for p in ELEMENTWISE | BARRIERS},
        "select_n": select_n_rule,
        "dot_general": dot_general_rule,
        "conv_general_dilated": conv_rule,
        "reduce_sum": reduction_rule,
        "reduce_max": reduction_rule,
        "reduce_min": reduction_rule,
        "reduce_prod": reduction_rule,
        "reduce_and": reduction_rule,
        "reduce_or": reduction_rule,
        "argmax": arg_reduction_rule,
        "argmin": arg_reduction_rule,
        "cumsum": along_axis_rule("axis"),
        "cumprod": along_axis_rule("axis"),
        "cummax": along_axis_rule("axis"),
        "cummin": along_axis_rule("axis"),
        "cumlogsumexp": along_axis_rule("axis"),
        "sort": along_axis_rule("dimension"),
        # (no rule for fft or top_k: XLA's SPMD partitioner gathers their
        # operand whole on every device, whatever its layout, so a split
        # would be priced as free and run replicated; checked on jax 0.10.2's
        # compiled programs: tests/test_rules_coverage.py)
        "approx_top_k": top_k_rule,
        **{p: reduce_window_rule for p in WINDOWED},
        "transpose": transpose_rule,
        "broadcast_in_dim": broadcast_rule,
        "reshape": reshape_rule,
        "slice": slice_like_rule,
        "pad": slice_like_rule,
        "dynamic_slice": slice_like_rule,
        "tile": slice_like_rule,      # (the dimensions repeated once may be split)
        "dynamic_update_slice": dynamic_update_slice_rule,
        "concatenate": concatenate_rule,
        "split": split_rule,
        "stack": stack_rule,
        "unstack": unstack_rule,
        "cond": cond_rule,
        "scan": loop_rule,
        "while": loop_rule,
        "name": elementwise_rule,     # checkpoint_name: an identity that names its operand
        "squeeze": squeeze_rule,
        "iota": iota_rule,
        "random_bits": random_bits_rule,
        "bitcast_convert_type": elementwise_rule,
        "rev": rev_rule,
        "gather": gather_rule,
        "scatter-add": scatter_rule(True),
        "scatter_add": scatter_rule(True),
        "scatter": scatter_rule(False),
    }
    return MappingProxyType({p: rule for p, rule in table.items() if p not in REPLICATED})


# primitive name -> rule (read-only)
RULES = _rules()


def op_space(primitive: str, ins: Sequence[Shape], outs: Sequence[Shape],
             params: dict[str, Any]) -> OpSpace | None:
    """The OpSpace of one operator, or None when it must run replicated."""
    rule = RULES.get(primitive)
    if rule is None or not outs:
        return None
    try:
        return rule(ins, outs, params)
    except (KeyError, IndexError, TypeError, ValueError, ZeroDivisionError):
        return None
