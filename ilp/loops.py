"""Which dimensions of a ``scan`` or ``while`` loop may be split.

The tracer records a loop's body (:mod:`meshplan.trace.loops`).  Every
dimension of every body value, and of every operand and result of the loop,
is a variable; each body operator's own sharding rule (its OpSpace) says
which of its dimensions are split together, and the ties say which body
dimensions are which loop dimensions.  A union-find over them gives classes
of dimensions that must be split alike.  A class may not be split at all
(it is *blocked*) when any member is: a dimension an operator keeps whole,
an operand an operator takes whole, an operator with no
rule, the iteration dimension of a scan's per-step values, or two
dimensions of one value (one mesh axis cannot split both).

What is left are the dimensions the loop does not mix: the batch of an
RNN's carry, the channels of an element-wise recurrence.  Splitting them,
each device runs the whole loop on its own slice, with no communication,
except where the body sums over one (a contraction: an RNN's weight
gradient over the batch); that class is *partial*, and its partial sums
are all-reduced in every step (XLA does so: a loop's carry holds whole
values).
"""
from __future__ import annotations

import math
from typing import Any, Callable, Sequence

from ..flops import flops_of

Shape = tuple[int, ...]
SpaceOf = Callable[[str, Sequence[Shape], Sequence[Shape], dict], Any]


class _Classes:
    """Union-find over hashable dimension keys, with a blocked flag per root."""

    def __init__(self) -> None:
        self.parent: dict[Any, Any] = {}
        self.blocked: set[Any] = set()

    def find(self, x: Any) -> Any:
        self.parent.setdefault(x, x)
        while self.parent[x] != x:
            self.parent[x] = self.parent[self.parent[x]]
            x = self.parent[x]
        return x

    def join(self, a: Any, b: Any) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[ra] = rb
            if ra in self.blocked:
                self.blocked.add(rb)

    def block(self, x: Any) -> None:
        self.blocked.add(self.find(x))

    def is_blocked(self, x: Any) -> bool:
        return self.find(x) in self.blocked


def loop_classes(desc: Any, ins: Sequence[Shape], outs: Sequence[Shape], space_of: SpaceOf
                 ) -> tuple[list[tuple[int, ...] | None], dict[int, float],
                            dict[frozenset[int], float]]:
    """Per operand and result of the loop (results after operands), a class
    id per dimension, -1 where the dimension may not be split, None for a
    scalar; per partial class, the bytes one step all-reduces when it is
    split; and the body's FLOPs by the classes their operators' dimensions
    fall in (a split divides an operator's work only where it cuts one of
    them: the rest runs whole on every device, as the square matmul of a
    Newton-Schulz iteration on an all-reduced value does).
    ``space_of`` is :func:`meshplan.ilp.rules.op_space`."""
    shapes, eqns, ties, itemsizes = desc
    c = _Classes()
    sums: list[tuple[Any, float]] = []      # (a dimension summed over, bytes of the sum)
    work: list[tuple[float, list[Any]]] = []   # (an operator's FLOPs, its dimensions' keys)
    for e, (prim, e_ins, e_outs, params) in enumerate(eqns):
        in_shapes = [shapes[i] for i in e_ins]
        out_shapes = [shapes[o] for o in e_outs]
        space = space_of(prim, in_shapes, out_shapes, dict(params))
        flops = _flops(prim, in_shapes, out_shapes, dict(params))
        if space is not None and space.work:    # (a nested loop: its own operators' cuts)
            work += [(flops * share, [("l", e, lab) for lab in labs])
                     for labs, share in space.work]
        else:
            work.append((flops, [] if space is None else [("l", e, lab) for lab in space.sizes]))
        if space is None:
            for v in e_ins + e_outs:
                for d in range(len(shapes[v])):
                    c.block(("v", v, d))
            continue
        for v, labels in zip(tuple(e_ins) + tuple(e_outs),
                             tuple(space.in_labels) + tuple(space.out_labels)):
            if labels is None or len(labels) != len(shapes[v]):
                for d in range(len(shapes[v])):
                    c.block(("v", v, d))
                continue
            for d, lab in enumerate(labels):
                c.join(("v", v, d), ("l", e, lab))
                if lab in space.blocked:
                    c.block(("l", e, lab))
        out_bytes = sum(math.prod(shapes[o]) * itemsizes[o] for o in e_outs)
        sums += [(("l", e, lab), float(out_bytes)) for lab in space.reduce]
        # a nested cond's sums to a scalar, a nested loop's partial sums of
        # all its steps: all-reduced again in each step of this loop
        sums += [(("l", e, lab), b) for lab, b in space.reduce_each_step]
    slots = list(ins) + list(outs)
    for slot, v, offset in ties:
        for d in range(offset):
            c.block(("s", slot, d))
        for d in range(len(shapes[v])):
            c.join(("s", slot, d + offset), ("v", v, d))
    # one mesh axis splits one dimension of a value: a class met twice in one
    # value (a square matrix multiplied by itself) stays whole
    values = [(("v", k), shape) for k, shape in enumerate(shapes)]
    values += [(("s", k), shape) for k, shape in enumerate(slots)]
    for (kind, k), shape in values:
        roots = [c.find((kind, k, d)) for d in range(len(shape))]
        c.blocked.update(r for r in roots if roots.count(r) > 1)
    ids: dict[Any, int] = {}
    sizes: dict[Any, int] = {}
    for s, shape in enumerate(slots):       # (a class must have one size throughout)
        for d, size in enumerate(shape):
            r = c.find(("s", s, d))
            if sizes.setdefault(r, size) != size:
                c.blocked.add(r)
    partial: dict[Any, float] = {}
    for key, nbytes in sums:
        r = c.find(key)
        partial[r] = partial.get(r, 0.0) + nbytes
    out: list[tuple[int, ...] | None] = []
    for s, shape in enumerate(slots):
        if not shape:
            out.append(None)
            continue
        out.append(tuple(-1 if c.is_blocked(("s", s, d))
                         else ids.setdefault(c.find(("s", s, d)), len(ids))
                         for d in range(len(shape))))
    by_classes: dict[frozenset[int], float] = {}
    for flops, keys in work:
        cut = frozenset(ids[r] for r in map(c.find, keys) if r in ids and r not in c.blocked)
        by_classes[cut] = by_classes.get(cut, 0.0) + flops
    return (out, {ids[r]: b for r, b in partial.items() if r in ids and r not in c.blocked},
            by_classes)


def loop_steps(params: dict) -> int:
    """The steps a scan (``length``) or a while loop (``trip_count``) runs."""
    return int(params.get("length", params.get("trip_count", 1)))


def _flops(prim: str, ins: Sequence[Shape], outs: Sequence[Shape], params: dict) -> float:
    """FLOPs of one body operator; a nested loop's (or cond's) its own
    body's, per step times its steps."""
    inner = params.get("loop")
    if inner is None:
        return flops_of(prim, ins, outs, params)
    shapes, eqns, _, _ = inner
    steps = loop_steps(params) or 1
    return steps * sum(_flops(p, [shapes[i] for i in e_ins], [shapes[o] for o in e_outs],
                              dict(q)) for p, e_ins, e_outs, q in eqns)
