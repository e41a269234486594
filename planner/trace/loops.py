"""The body of a ``scan`` or ``while`` loop, or the branches of a ``cond``,
written down for the ILP's loop rule.

A loop over time steps (an RNN, an RG-LRU recurrence, a ``fori_loop``) may
run split along any dimension its body does not mix: the batch of its carry,
say.  Which dimensions those are follows from the sharding rules of the
body's own operators, which live in the ILP layer (:mod:`meshplan.ilp.rules`);
the tracer cannot call them, so it records the body as plain data in the
loop's node params (``("loop", description)``) and the rule reads it there.

A description is ``(shapes, eqns, ties, itemsizes)``:

* ``shapes``: the shape of every body value, by id (the loop body and, for a
  ``while``, its predicate, with nested calls inlined; literals get ids too),
  and ``itemsizes`` the bytes of one of its elements (half a byte for the
  4-bit types XLA packs two to a byte);
* ``eqns``: ``(primitive, operand ids, result ids, params)`` per body equation,
  params as the Graph keeps them (a nested cond or loop with its own
  ``components`` or ``loop``);
* ``ties``: ``(slot, body id, offset)``: dimension ``d`` of body value ``id``
  is dimension ``d + offset`` of the loop's operand ``slot`` (results come
  after the operands: ``slot = len(operands) + k``).  A scan's per-step
  inputs and outputs have offset 1: their dimension 0 is the iteration.
  A carry is tied to its operand both where the body reads it and where it
  writes it, so the two share one layout across iterations.
"""
from __future__ import annotations

from typing import Any, Callable

from ..graph import dtype_bits
from .cond import cond_params
from .walk import flatten

Description = tuple[tuple[tuple[int, ...], ...], tuple[Any, ...], tuple[tuple[int, int, int], ...],
                    tuple[float, ...]]


class _Body:
    """Body values and equations gathered from one or more flattened jaxprs."""

    def __init__(self, params_of: Callable[[Any], tuple]) -> None:
        self.params_of = params_of
        self.shapes: list[tuple[int, ...]] = []
        self.eqns: list[tuple[Any, ...]] = []
        self.itemsizes: list[int] = []

    def _new(self, aval: Any) -> int:
        self.shapes.append(tuple(int(d) for d in getattr(aval, "shape", ())))
        dtype = getattr(aval, "dtype", None)
        bits = dtype_bits(str(dtype)) if dtype is not None else 32
        self.itemsizes.append(bits // 8 if bits % 8 == 0 else bits / 8)
        return len(self.shapes) - 1

    def _params(self, eqn: Any) -> tuple:
        """An equation's params as the Graph keeps them, with what the
        tracer adds for the rules of nested control flow."""
        params = self.params_of(eqn)
        if eqn.primitive.name == "cond":
            params = params + cond_params(eqn)
        inner = loop_description(eqn, self.params_of)
        if inner is not None:
            params = params + (("loop", inner),)
        return params

    def add(self, jaxpr: Any) -> tuple[list[int], list[int]]:
        """Adds one (closed) jaxpr; returns the ids of its inputs and outputs."""
        flat = flatten(jaxpr)
        ids = {i: self._new(a) for i, a in sorted(flat.avals.items())}

        def ref(x: Any) -> int:
            return ids[x] if isinstance(x, int) else self._new(x.aval)
        for fe in flat.eqns:
            self.eqns.append((fe.eqn.primitive.name, tuple(ref(x) for x in fe.invars),
                              tuple(ids[o] for o in fe.outvars), self._params(fe.eqn)))
        return [ids[i] for i in flat.invars], [ref(x) for x in flat.outvars]


def loop_description(eqn: Any, params_of: Callable[[Any], tuple]) -> Description | None:
    """The description of the ``scan``, ``while`` or ``cond`` equation
    ``eqn`` (a cond: its branches, as one step of a loop); None for any
    other equation."""
    name = eqn.primitive.name
    body = _Body(params_of)
    n_in = len(eqn.invars)
    ties: list[tuple[int, int, int]] = []
    if name == "scan":
        nc, nk = int(eqn.params["num_consts"]), int(eqn.params["num_carry"])
        ins, outs = body.add(eqn.params["jaxpr"])
        for j, v in enumerate(ins):
            ties.append((j, v, 0 if j < nc + nk else 1))
        for k, v in enumerate(outs):
            if k < nk:
                ties += [(nc + k, v, 0), (n_in + k, v, 0)]
            else:
                ties.append((n_in + k, v, 1))
    elif name == "while":
        cn, bn = int(eqn.params["cond_nconsts"]), int(eqn.params["body_nconsts"])
        c_ins, _ = body.add(eqn.params["cond_jaxpr"])
        b_ins, b_outs = body.add(eqn.params["body_jaxpr"])
        ties += [(j, v, 0) for j, v in enumerate(c_ins[:cn])]
        ties += [(cn + bn + j, v, 0) for j, v in enumerate(c_ins[cn:])]
        ties += [(cn + j, v, 0) for j, v in enumerate(b_ins)]
        for k, v in enumerate(b_outs):
            ties += [(cn + bn + k, v, 0), (n_in + k, v, 0)]
    elif name == "cond":
        # (a loop of one step through whichever branch runs: every branch is
        # a body of the cond's operands, after the branch index, and results)
        for branch in eqn.params["branches"]:
            b_ins, b_outs = body.add(branch)
            ties += [(1 + j, v, 0) for j, v in enumerate(b_ins)]
            ties += [(n_in + k, v, 0) for k, v in enumerate(b_outs)]
    else:
        return None
    return tuple(body.shapes), tuple(body.eqns), tuple(ties), tuple(body.itemsizes)



def while_trip_count(eqn: Any) -> int | None:
    """How many times the ``while`` equation ``eqn`` runs its body, where the
    jaxpr says so: a counter carry that starts at a literal, changes by a
    literal step in the body, and is compared in the predicate with a
    literal (or a carry passed through unchanged from a literal start), the
    loop ``lax.while_loop(lambda s: s[0] < 10, ...)`` or a ``fori_loop``
    with traced-looking bounds compiles to.  None: not known at trace time."""
    p = eqn.params
    cn, bn = int(p["cond_nconsts"]), int(p["body_nconsts"])
    cond, body = p["cond_jaxpr"].jaxpr, p["body_jaxpr"].jaxpr
    inits = eqn.invars[cn + bn:]
    carries_c, carries_b = cond.invars[cn:], body.invars[bn:]
    if len(cond.eqns) != 1 or cond.eqns[0].outvars[0] is not cond.outvars[0]:
        return None
    test = cond.eqns[0]
    if test.primitive.name not in _FLIP:
        return None

    def start(v: Any) -> int | None:
        """The literal start of carry ``v`` of the predicate, if it has one."""
        if v not in carries_c:
            return None
        init = inits[carries_c.index(v)]
        return int(init.val) if _int_literal(init) else None

    def bound(v: Any) -> int | None:
        if _int_literal(v):
            return int(v.val)
        if v in carries_c:   # a carry the body passes through unchanged
            k = carries_c.index(v)
            if body.outvars[k] is carries_b[k]:
                return start(v)
        return None

    a, b = test.invars
    op = test.primitive.name
    if start(a) is None or bound(b) is None:
        a, b, op = b, a, _FLIP[op]
    i0, n = start(a), bound(b)
    step = None if i0 is None else _step(body, carries_b[carries_c.index(a)],
                                         body.outvars[carries_c.index(a)])
    if n is None or not step:
        return None
    if op in ("lt", "le") and step > 0:
        span = n - i0 + (1 if op == "le" else 0)
        return max(0, -(-span // step))
    if op in ("gt", "ge") and step < 0:
        span = i0 - n + (1 if op == "ge" else 0)
        return max(0, -(-span // -step))
    if op == "ne" and (n - i0) % step == 0 and (n - i0) // step >= 0:
        return (n - i0) // step
    return None


# a comparison, and the same one with its operands swapped
_FLIP = {"lt": "gt", "gt": "lt", "le": "ge", "ge": "le", "ne": "ne"}


def _int_literal(v: Any) -> bool:
    val = getattr(v, "val", None)
    return val is not None and not hasattr(v, "count") and getattr(
        getattr(v, "aval", None), "shape", None) == () and str(v.aval.dtype).startswith(("int", "uint"))


def _step(body: Any, var_in: Any, var_out: Any) -> int | None:
    """The literal step by which the body's one equation moves a counter."""
    for e in body.eqns:
        if var_out not in e.outvars:
            continue
        if e.primitive.name not in ("add", "sub"):
            return None
        x, y = e.invars
        if x is var_in and _int_literal(y):
            return int(y.val) if e.primitive.name == "add" else -int(y.val)
        if y is var_in and _int_literal(x) and e.primitive.name == "add":
            return int(x.val)
        return None
    return None
