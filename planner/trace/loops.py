"""The body of a ``scan`` or ``while`` loop, written down for the ILP's loop rule.

A loop over time steps (an RNN, an RG-LRU recurrence, a ``fori_loop``) may
run split along any dimension its body does not mix: the batch of its carry,
say.  Which dimensions those are follows from the sharding rules of the
body's own operators, which live in the ILP layer (:mod:`meshplan.ilp.rules`);
the tracer cannot call them, so it records the body as plain data in the
loop's node params (``("loop", description)``) and the rule reads it there.

A description is ``(shapes, eqns, ties, itemsizes)``:

* ``shapes``: the shape of every body value, by id (the loop body and, for a
  ``while``, its predicate, with nested calls inlined; literals get ids too),
  and ``itemsizes`` the bytes of one of its elements;
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

from .cond import cond_components
from .walk import flatten

Description = tuple[tuple[tuple[int, ...], ...], tuple[Any, ...], tuple[tuple[int, int, int], ...],
                    tuple[int, ...]]


class _Body:
    """Body values and equations gathered from one or more flattened jaxprs."""

    def __init__(self, params_of: Callable[[Any], tuple]) -> None:
        self.params_of = params_of
        self.shapes: list[tuple[int, ...]] = []
        self.eqns: list[tuple[Any, ...]] = []
        self.itemsizes: list[int] = []

    def _new(self, aval: Any) -> int:
        self.shapes.append(tuple(int(d) for d in getattr(aval, "shape", ())))
        self.itemsizes.append(int(getattr(getattr(aval, "dtype", None), "itemsize", 4) or 4))
        return len(self.shapes) - 1

    def _params(self, eqn: Any) -> tuple:
        """An equation's params as the Graph keeps them, with what the
        tracer adds for the rules of nested control flow."""
        params = self.params_of(eqn)
        if eqn.primitive.name == "cond":
            comps = cond_components(eqn)
            if comps is not None:
                params = params + (("components", comps),)
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
    """The description of the ``scan`` or ``while`` equation ``eqn``; None for
    any other equation."""
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
    else:
        return None
    return tuple(body.shapes), tuple(body.eqns), tuple(ties), tuple(body.itemsizes)

