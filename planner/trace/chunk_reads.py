"""A loop written over chunks of the batch by index: which of a ``lax.scan``
body's slices read chunk ``k`` of a batch value at step ``k``.

A step's own accumulation loop is written two ways: a scan over
``x.reshape(n, B // n, ...)``, or a ``fori_loop`` (a scan of ``n`` steps
with a counter) whose body cuts ``lax.dynamic_slice_in_dim(x, i * c, c)``
out of the whole batch.  The two compute the same thing; the second is
recognised here so that :mod:`meshplan.trace.scaling` can hold it to the
first's rules.  A slice counts only where the places it reads at each step
are computed from counters alone, and those places, evaluated step by step at
the micro-batch and at the whole batch, visit the ``n`` chunks once each, in
the same order.
"""
from __future__ import annotations

from typing import Any

from jax.extend import core as jcore

from .calls import _closed_parts

__all__ = ["chunk_reads"]

MAX_STEPS = 4096    # (the places are evaluated step by step)


def chunk_reads(eqn: Any, eqn_full: Any) -> dict[Any, int]:
    """The ``dynamic_slice`` results of a scan's body (``eqn``, traced at the
    micro-batch; ``eqn_full`` at the whole batch) that read chunk ``k`` of a
    const operand of the batch at step ``k``, each with that operand's index
    among the scan's operands."""
    p, p_full = eqn.params, eqn_full.params
    nc, n = p["num_consts"], p["length"]
    body, body_full = _closed_parts(p["jaxpr"])[0], _closed_parts(p_full["jaxpr"])[0]
    if n != p_full["length"] or not 1 < n <= MAX_STEPS or \
            len(body.eqns) != len(body_full.eqns):
        return {}
    consts = {v: k for k, v in enumerate(body.invars[:nc])}
    found: dict[Any, int] = {}
    for e, f in zip(body.eqns, body_full.eqns):
        k = consts.get(e.invars[0]) if e.primitive.name == "dynamic_slice" else None
        if k is None or f.primitive is not e.primitive:
            continue
        a, b = eqn.invars[k].aval.shape, eqn_full.invars[k].aval.shape
        axes = [d for d, (x, y) in enumerate(zip(a, b)) if x != y]
        if len(axes) != 1:
            continue
        (d,) = axes
        size, size_full = e.params["slice_sizes"][d], f.params["slice_sizes"][d]
        # (every other axis cut at a fixed place: a counter there would give
        # chunk k other features in each micro-batch)
        if size * n != a[d] or size_full * n != b[d] or any(
                not isinstance(v, jcore.Literal) for j, v in enumerate(e.invars[1:]) if j != d):
            continue
        steps = _places(eqn, e.invars[1 + d])
        steps_full = _places(eqn_full, f.invars[1 + d])
        if steps is None or steps_full is None:
            continue
        chunks = [s // size for s in steps]
        if sorted(chunks) == list(range(n)) and [s % size for s in steps] == [0] * n and \
                steps_full == [c * size_full for c in chunks]:
            found[e.outvars[0]] = k
    return found


def _places(eqn: Any, var: Any) -> list[int] | None:
    """The value of body value ``var`` at each step of scan ``eqn``, where it
    is computed from carries alone whose initial values are literals (a
    fori_loop's counter), else None."""
    from jax._src.interpreters import partial_eval as pe
    p = eqn.params
    nc, nk, n = p["num_consts"], p["num_carry"], p["length"]
    jaxpr, consts = _closed_parts(p["jaxpr"])
    if isinstance(var, jcore.Literal) or jaxpr.constvars or consts:
        return None
    known = {c for c in range(nk) if isinstance(eqn.invars[nc + c], jcore.Literal)}
    keep: list[int] = []
    while True:     # (the carries the place is computed from, and theirs)
        outs = [var, *(jaxpr.outvars[c] for c in keep)]
        dced, used = pe.dce_jaxpr(jaxpr.replace(outvars=outs), [True] * len(outs))
        need = [i - nc for i, u in enumerate(used) if u]
        if any(c not in known for c in need):
            return None
        if set(need) <= set(keep):
            break
        keep = sorted(set(keep) | set(need))
    run = jcore.jaxpr_as_fun(jcore.ClosedJaxpr(dced, ()))
    values = {c: eqn.invars[nc + c].val for c in keep}
    places = []
    for _ in range(n):
        got = run(*(values[c] for c in need))
        places.append(int(got[0]))
        values.update(zip(keep, got[1:]))
    return places
