"""Flatten a closed jaxpr into one stream of equations.

Calls that only group equations (``jit``, ``custom_jvp_call``,
``custom_vjp_call``, ``remat2`` ...) are inlined; control flow (``scan``,
``while``, ``cond``) stays one composite equation.  Each value gets a global
integer id, so the tracer can build the Graph IR from the stream and the
runtime can evaluate the very same stream, tensor for tensor.
"""
from __future__ import annotations

from typing import Any, Iterator

from jax import lax
from jax.extend import core as jcore

from ..traced import IDENTITY_MARKERS, FlatEqn, FlatJaxpr, Lit, same_stream  # noqa: F401  (the stream's data types)
from .calls import INLINE_CALLS, REMAT_CALLS, _closed_parts
from .cond import split_cond

COMPOSITES = frozenset({"scan", "while", "cond"})
# a collective over positional axes (what ``vmap(..., axis_name=...)`` leaves
# of ``lax.psum``/``pmean``/``pmax``/``pmin`` over the mapped axis, as in
# equinox's BatchNorm) is a reduction over those axes: the stream holds the
# reduction, which every pass has rules for and the runtime binds as such
_POSITIONAL_COLLECTIVES = {"psum": (lax.reduce_sum_p, {"out_sharding": None}),
                           "pmax": (lax.reduce_max_p, {}), "pmin": (lax.reduce_min_p, {})}


class _Flattener:
    def __init__(self) -> None:
        self.next_id = 0
        self.avals: dict[int, Any] = {}
        self.eqns: list[FlatEqn] = []
        self.constvars: list[int] = []
        self.consts: list[Any] = []
        self.fences = 0

    def fresh(self, aval: Any) -> int:
        i = self.next_id
        self.next_id += 1
        self.avals[i] = aval
        return i

    def read(self, env: dict[Any, int], v: Any) -> int | Lit:
        if isinstance(v, jcore.Literal):
            return Lit(v.val, v.aval)
        return env[v]

    def walk(self, jaxpr: Any, env: dict[Any, int], remat: bool, fence: int = -1) -> None:
        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            ins = tuple(self.read(env, v) for v in eqn.invars)
            if name in INLINE_CALLS and INLINE_CALLS[name] in eqn.params:
                inner, consts = _closed_parts(eqn.params[INLINE_CALLS[name]])
                inner_env: dict[Any, int] = {}
                for cv, c in zip(inner.constvars, consts):
                    inner_env[cv] = self.add_const(cv.aval, c)
                for iv, x in zip(inner.invars, ins):
                    inner_env[iv] = x if isinstance(x, int) else self.materialize(x)
                inner_fence = fence
                if fence < 0 and name in REMAT_CALLS and eqn.params.get("differentiated"):
                    inner_fence, self.fences = self.fences, self.fences + 1
                self.walk(inner, inner_env, remat or name in REMAT_CALLS, inner_fence)
                for ov, iv in zip(eqn.outvars, inner.outvars):
                    r = self.read(inner_env, iv)
                    env[ov] = r if isinstance(r, int) else self.materialize(r)
                continue
            if _positional(eqn):
                self.reduce(eqn, ins, env, remat, fence)
                continue
            if name == "cond":      # (one cond per independent component)
                for part in split_cond(eqn):
                    self.add(part, tuple(self.read(env, v) for v in part.invars), env, remat,
                             fence)
                continue
            self.add(eqn, ins, env, remat, fence)

    def add(self, eqn: Any, ins: tuple[int | Lit, ...], env: dict[Any, int], remat: bool,
            fence: int) -> None:
        outs = tuple(self.fresh(v.aval) for v in eqn.outvars)
        for ov, i in zip(eqn.outvars, outs):
            env[ov] = i
        self.eqns.append(FlatEqn(eqn, ins, outs, remat, str(eqn.source_info.name_stack), fence))

    def reduce(self, eqn: Any, ins: tuple[int | Lit, ...], env: dict[Any, int], remat: bool,
               fence: int) -> None:
        """A positional collective as one reduction per operand (over no
        axes: the operand itself, as the transpose of a sum leaves it)."""
        prim, extra = _POSITIONAL_COLLECTIVES[eqn.primitive.name]
        axes = tuple(eqn.params["axes"])
        for iv, ov, x in zip(eqn.invars, eqn.outvars, ins):
            if not axes:
                env[ov] = x if isinstance(x, int) else self.materialize(x)
                continue
            one = jcore.new_jaxpr_eqn([iv], [ov], prim, {"axes": axes, **extra}, eqn.effects,
                                      eqn.source_info)
            env[ov] = self.fresh(ov.aval)
            self.eqns.append(FlatEqn(one, (x,), (env[ov],), remat,
                                     str(eqn.source_info.name_stack), fence))

    def add_const(self, aval: Any, value: Any) -> int:
        i = self.fresh(aval)
        self.constvars.append(i)
        self.consts.append(value)
        return i

    def materialize(self, lit: Lit) -> int:
        """A literal passed where a variable is expected becomes a constant."""
        return self.add_const(lit.aval, lit.value)


def _positional(eqn: Any) -> bool:
    return (eqn.primitive.name in _POSITIONAL_COLLECTIVES
            and eqn.params.get("axis_index_groups") is None
            and all(isinstance(a, int) for a in eqn.params.get("axes", ("?",))))


def flatten(closed: Any) -> FlatJaxpr:
    """Flatten ``closed`` (a ClosedJaxpr from ``jax.make_jaxpr``)."""
    jaxpr, consts = _closed_parts(closed)
    f = _Flattener()
    env: dict[Any, int] = {}
    for cv, c in zip(jaxpr.constvars, consts):
        env[cv] = f.add_const(cv.aval, c)
    invars = tuple(f.fresh(v.aval) for v in jaxpr.invars)
    for v, i in zip(jaxpr.invars, invars):
        env[v] = i
    f.walk(jaxpr, env, remat=False)
    outs = tuple(f.read(env, v) for v in jaxpr.outvars)
    return FlatJaxpr(invars, tuple(f.constvars), tuple(f.consts), _live(f.eqns, outs), outs,
                     f.avals)


def _live(eqns: list[FlatEqn], outs: tuple[int | Lit, ...]) -> tuple[FlatEqn, ...]:
    """``eqns`` less those no output is computed from and that have no
    effect: XLA drops them from the program, so the plan must not price them
    (an unrolled scan's transpose makes the gradient of its carry's initial
    value, a batch input's, which nothing reads).  Markers stay, and so do
    scalars nobody reads with what they are computed from."""
    need = {x for x in outs if isinstance(x, int)}
    read = {x for fe in eqns for x in fe.invars if isinstance(x, int)} | need
    keep = [False] * len(eqns)
    for k in range(len(eqns) - 1, -1, -1):
        fe = eqns[k]
        # (a scalar nobody reads is a loss or metric the step computed and
        # dropped, which ends the forward of a step returning its state alone)
        dropped = fe.outvars and not any(o in read for o in fe.outvars) and all(
            getattr(v.aval, "shape", None) == () for v in fe.eqn.outvars)
        if fe.eqn.effects or fe.eqn.primitive.name in IDENTITY_MARKERS or dropped \
                or any(o in need for o in fe.outvars):
            keep[k] = True
            need.update(x for x in fe.invars if isinstance(x, int))
    return tuple(fe for fe, k in zip(eqns, keep) if k)


def computed_from(flat: FlatJaxpr, ids: Any) -> set[int]:
    """``ids`` and the ids of ``flat`` computed from any of them (the values
    that depend on the batch, given its inputs)."""
    dep = set(ids)
    for fe in flat.eqns:
        if any(isinstance(x, int) and x in dep for x in fe.invars):
            dep.update(fe.outvars)
    return dep


def sub_jaxprs(eqn: Any) -> Iterator[tuple[str, Any]]:
    """(param name, jaxpr) for every jaxpr held in the params of a composite."""
    for k, v in eqn.params.items():
        if hasattr(v, "eqns") or hasattr(v, "jaxpr"):
            yield k, v
        elif isinstance(v, tuple):
            for j, b in enumerate(v):
                if hasattr(b, "eqns") or (hasattr(b, "jaxpr") and hasattr(b, "consts")):
                    yield f"{k}[{j}]", b
