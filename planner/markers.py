"""Markers a user may put into a train step: pipeline boundaries and the end
of gradient computation.

Both are identity primitives: they change no value and compile to nothing,
but they survive tracing, so the inter-operator pass can read them from the
Graph.  ``meshplan.grad`` / ``meshplan.value_and_grad`` are drop-in for the
jax functions and mark their gradients; ``mark_pipeline_boundary(x)`` marks a
cut between layers (and, through its transpose, the matching cut of the
backward pass).
"""
from __future__ import annotations

from typing import Any, Callable

import jax
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from .graph import GRAD_BOUNDARY, PIPELINE_BOUNDARY


def _identity_primitive(name: str) -> Primitive:
    p = Primitive(name)
    p.multiple_results = True
    p.def_impl(lambda *xs: xs)
    p.def_abstract_eval(lambda *avals: avals)
    mlir.register_lowering(p, lambda ctx, *xs: xs)

    def jvp(primals, tangents):
        tangents = [ad.instantiate_zeros(t) for t in tangents]
        return p.bind(*primals), p.bind(*tangents)

    ad.primitive_jvps[p] = jvp
    ad.primitive_transposes[p] = lambda cts, *args: p.bind(
        *[ad.instantiate_zeros(c) for c in cts])
    batching.primitive_batchers[p] = lambda args, dims: (p.bind(*args), dims)
    return p


_pipeline_p = _identity_primitive(PIPELINE_BOUNDARY)
_grad_p = _identity_primitive(GRAD_BOUNDARY)


def _mark(p: Primitive, tree: Any) -> Any:
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    if not leaves:
        return tree
    return jax.tree_util.tree_unflatten(treedef, p.bind(*leaves))


def mark_pipeline_boundary(x: Any = None) -> Any:
    """Mark a cut between pipeline layers; returns ``x`` unchanged (any pytree).

    Call it on the activations that flow from one layer to the next, e.g.
    ``h = meshplan.mark_pipeline_boundary(h)`` between transformer blocks.
    """
    if x is None:
        raise TypeError("mark_pipeline_boundary(x) needs the activations that cross the cut")
    return _mark(_pipeline_p, x)


def grad(fun: Callable, argnums: int | tuple[int, ...] = 0, has_aux: bool = False,
         **kwargs: Any) -> Callable:
    """``jax.grad`` whose gradients carry the end-of-backward marker."""
    g = jax.grad(fun, argnums=argnums, has_aux=has_aux, **kwargs)

    def wrapped(*args: Any, **kw: Any) -> Any:
        out = g(*args, **kw)
        if has_aux:
            grads, aux = out
            return _mark(_grad_p, grads), aux
        return _mark(_grad_p, out)
    return wrapped


def value_and_grad(fun: Callable, argnums: int | tuple[int, ...] = 0, has_aux: bool = False,
                   **kwargs: Any) -> Callable:
    """``jax.value_and_grad`` whose gradients carry the end-of-backward marker."""
    vg = jax.value_and_grad(fun, argnums=argnums, has_aux=has_aux, **kwargs)

    def wrapped(*args: Any, **kw: Any) -> Any:
        value, grads = vg(*args, **kw)
        return value, _mark(_grad_p, grads)
    return wrapped


def grad_marker_eqn(avals: Any) -> Any:
    """A jaxpr equation of the end-of-backward marker over values of
    ``avals``: what :mod:`meshplan.trace.micro` inserts where it finds the
    gradients of an unmarked step."""
    specs = [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=getattr(a, "weak_type", False))
             for a in avals]
    return jax.make_jaxpr(lambda *xs: _grad_p.bind(*xs))(*specs).jaxpr.eqns[0]
