"""Which values of a ``lax.cond`` go together element by element.

``optax.MultiSteps`` wraps its update in a ``cond`` whose branches map each
state leaf to a same-shaped leaf, element by element (accumulate, or apply
Adam and reset).  Such a cond may run split any way, as long as the operands
and results that meet in one element-wise computation share one layout: a
*component*.  Different components are independent, so each may follow its
own parameter's layout.

:func:`cond_components` walks every branch (inlining nested calls) and
returns, per operand after the branch index and per result, a component id,
or -1 for a value that needs no layout (a scalar, or a result made from
scalars and constants only); None when some branch does more than element-wise
work on arrays (a matmul, a reshape, a reduction that keeps some axes ...):
then no rule applies.  A branch may reduce a whole array to a scalar
(``optax.clip_by_global_norm``'s norm, ``optax.apply_if_finite``'s check):
its component is *reduced*, and the rule charges an all-reduce of a scalar
where the component is split.
"""
from __future__ import annotations

from typing import Any

from jax.extend import core as jcore

from ..flops import ELEMENTWISE
from .calls import INLINE_CALLS, _closed_parts


class _Union:
    """Union-find over hashable keys."""

    def __init__(self) -> None:
        self.parent: dict[Any, Any] = {}

    def find(self, x: Any) -> Any:
        self.parent.setdefault(x, x)
        while self.parent[x] != x:
            self.parent[x] = self.parent[self.parent[x]]
            x = self.parent[x]
        return x

    def join(self, a: Any, b: Any) -> None:
        self.parent[self.find(a)] = self.find(b)


class _NotPerElement(Exception):
    pass


def _rank(v: Any) -> int:
    return len(getattr(v.aval, "shape", ()))


# reductions of a whole array to a scalar: each device reduces its part and
# one all-reduce of a scalar combines them (a global norm, an isfinite check)
_TO_SCALAR = frozenset({"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and",
                        "reduce_or", "argmax", "argmin"})


def _walk(jaxpr: Any, key: dict[Any, Any], u: _Union, scope: str,
          reduced: list[Any]) -> None:
    """Join, in ``u``, the keys of the array values that meet element-wise in
    ``jaxpr``; ``key`` maps its variables to keys (filled in as it goes).
    ``reduced`` gets the keys of the arrays reduced to a scalar."""
    for n, eqn in enumerate(jaxpr.eqns):
        name = eqn.primitive.name
        arrays_in = [v for v in eqn.invars
                     if not isinstance(v, jcore.Literal) and _rank(v) and v in key]
        if name in INLINE_CALLS and INLINE_CALLS[name] in eqn.params:
            inner, _ = _closed_parts(eqn.params[INLINE_CALLS[name]])
            for iv, v in zip(inner.invars, eqn.invars):
                if not isinstance(v, jcore.Literal) and v in key:
                    key[iv] = key[v]
            _walk(inner, key, u, f"{scope}/{n}", reduced)
            for ov, iv in zip(eqn.outvars, inner.outvars):
                key[ov] = key.get(iv, ("free", scope, n, id(ov))) \
                    if not isinstance(iv, jcore.Literal) else ("free", scope, n, id(ov))
            continue
        for k, ov in enumerate(eqn.outvars):
            key[ov] = (scope, n, k)
        if name == "cond":      # (a cond in a branch: apply_if_finite around MultiSteps)
            for b, branch in enumerate(eqn.params["branches"]):
                inner, _ = _closed_parts(branch)
                for iv, v in zip(inner.invars, eqn.invars[1:]):
                    if not isinstance(v, jcore.Literal) and v in key:
                        key[iv] = key[v]
                _walk(inner, key, u, f"{scope}/{n}/b{b}", reduced)
                for ov, iv in zip(eqn.outvars, inner.outvars):
                    if _rank(ov) and not isinstance(iv, jcore.Literal) and iv in key:
                        u.join(key[iv], key[ov])
            continue
        if all(_rank(v) == 0 for v in list(eqn.invars) + list(eqn.outvars)):
            continue        # scalar work: replicated, whatever the arrays' layouts
        if name in _TO_SCALAR and len(arrays_in) == 1 and not any(map(_rank, eqn.outvars)):
            reduced.append(key[arrays_in[0]])
            continue
        if name == "broadcast_in_dim" and _rank(eqn.invars[0]) == 0:
            continue        # a scalar filled out: made in any layout for free
        if name in ELEMENTWISE and len(eqn.outvars) == 1:
            shape = tuple(eqn.outvars[0].aval.shape)
            if any(tuple(v.aval.shape) != shape for v in arrays_in):
                raise _NotPerElement(name)
            for v in arrays_in:
                u.join(key[v], key[eqn.outvars[0]])
            continue
        raise _NotPerElement(name)


def cond_params(eqn: Any) -> tuple[tuple[str, Any], ...]:
    """What the tracer adds to a cond's params for its rule: its
    ``components`` (:func:`cond_components`) and the components some branch
    reduces to a scalar (``reduced``); nothing when no rule applies."""
    found = cond_components(eqn)
    if found is None:
        return ()
    comps, reduced = found
    return (("components", comps),) + ((("reduced", reduced),) if reduced else ())


def cond_components(eqn: Any) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """Per operand (after the branch index) and per result of the cond
    ``eqn``, its component id (-1: needs no layout), and the components a
    branch reduces to a scalar; None when a branch is not element-wise."""
    operands, results = eqn.invars[1:], eqn.outvars
    u = _Union()
    reduced: list[Any] = []
    try:
        for b, branch in enumerate(eqn.params["branches"]):
            inner, _ = _closed_parts(branch)
            key: dict[Any, Any] = {iv: ("in", j) for j, iv in enumerate(inner.invars)}
            _walk(inner, key, u, f"b{b}", reduced)
            for k, ov in enumerate(inner.outvars):
                if _rank(results[k]) and not isinstance(ov, jcore.Literal) and ov in key:
                    u.join(key[ov], ("out", k))
    except _NotPerElement:
        return None
    roots: dict[Any, int] = {}

    def comp(k: Any, v: Any) -> int:
        if not _rank(v):
            return -1
        return roots.setdefault(u.find(k), len(roots))

    ins = [comp(("in", j), v) for j, v in enumerate(operands)]
    outs = [comp(("out", k), v) for k, v in enumerate(results)]
    # a component with no operand is made from scalars and constants: free
    has_in = {c for c in ins if c >= 0}
    comps = tuple(ins) + tuple(c if c in has_in else -1 for c in outs)
    return comps, tuple(sorted({roots[u.find(k)] for k in reduced
                                if roots.get(u.find(k), -1) in has_in}))


def split_cond(eqn: Any) -> list[Any]:
    """A cond whose branches work element by element, as one cond per
    component (each reading the branch index, the scalars and its own
    operands; the first also makes the scalar results), so that each
    parameter's update is its own operation: a pipeline stage runs the
    update of its own parameters (optax.MultiSteps' cond over every leaf
    put the whole optimizer state on one stage).  ``[eqn]`` where it does not
    split: not element-wise, a component some branch reduces to a scalar (a
    norm that may scale the others), effects, or branch constants."""
    found = cond_components(eqn)
    if found is None or found[1] or eqn.effects:
        return [eqn]
    branches = [_closed_parts(b) for b in eqn.params["branches"]]
    if any(consts for _, consts in branches):
        return [eqn]
    comps, n_in = found[0], len(eqn.invars) - 1
    outs = comps[n_in:]
    parts = sorted({c for c in comps if c >= 0})
    if len(parts) < 2:
        return [eqn]
    # (jax's dead-code elimination of the branches: not in jax.extend)
    from jax._src.interpreters import partial_eval as pe
    from jax import lax
    split = []
    for k, c in enumerate(parts):
        used = [o == c or (o < 0 and k == 0) for o in outs]
        if not any(used):
            continue
        needed = [False] * n_in
        for jaxpr, _ in branches:
            _, ins = pe.dce_jaxpr(jaxpr, used)
            needed = [a or b for a, b in zip(needed, ins)]
        new = [jcore.ClosedJaxpr(pe.dce_jaxpr(jaxpr, used, needed)[0], ())
               for jaxpr, _ in branches]
        split.append(jcore.new_jaxpr_eqn(
            [eqn.invars[0]] + [v for v, keep in zip(eqn.invars[1:], needed) if keep],
            [v for v, keep in zip(eqn.outvars, used) if keep], lax.cond_p,
            {**eqn.params, "branches": tuple(new)}, eqn.effects, eqn.source_info))
    return split
