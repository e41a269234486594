"""The step at micro-batch size, as both the planner and the runtime see it.

A pipeline runs the step once per micro-batch and the update once per step.
Two things of the micro-batch trace must be found for that, and one function
(:func:`micro_step`) finds them for the planner (``retrace(B)``) and for the
runtime (:func:`~meshplan.trace.trace_for_run`), so that neither plans nor
runs what the other would refuse:

* **Where the gradients end** (when the step has no ``meshplan.grad``
  marker, e.g. plain ``jax.value_and_grad``, ``nnx.value_and_grad``,
  ``eqx.filter_value_and_grad``).  The rule, over the flat jaxpr traced at
  the micro-batch and at the full batch (same equations, same ids):

  - a value is *per-example* when its shape differs between the two traces
    (it carries the batch dimension);
  - the *gradients* are the floating-point values made by an equation that
    reads a per-example value, that are not themselves per-example, from
    which no per-example value is computed and from which the new state (an
    output that updates an input) is: where the backward reduces over the
    batch for good (a weight's ``x.T @ dy``, a bias's sum, an embedding's
    scatter-add).  The loss and metrics are no gradients (the state is not
    computed from them), nor is a batch mean that the forward goes on with
    (it feeds per-example values).  Each is then taken past the
    layout-only operations that are its only reader (the transpose after a
    weight gradient's ``dot_general``, a bias gradient's reshape), so that
    it has its parameter's shape, as ``meshplan.value_and_grad`` returns
    it.  What reads them (the optimizer, and linear glue such as the sum of
    a tied weight's two gradients) runs once per step on their mean, which
    is exact because a gradient of a mean loss is the mean of the
    micro-batch gradients.

  A ``meshplan.grad`` marker is put on them (one, after the last of them)
  and the step is then split, laid out in layers and costed exactly as a
  marked one (issue 17: the layers map each gradient to its parameter by
  the data flow, since these come in the backward's order).  The trace of
  the whole batch (one micro-batch: the whole-graph ILP and the overlap of
  its gradient reductions) gets the same marker, found against a trace at
  twice the batch (:func:`mark_full_batch`).  Markers the user
  wrote take precedence: nothing is inferred then.  Where a state output
  is computed from the backward (outside the forward, the ancestors of the
  outputs that update no input) but not from these gradients, the first
  values computed from a sum over the batch that the backward reads again
  count as gradients too (batch normalisation's scale gradient under
  ``nnx.value_and_grad``: ``sum(dy * (x - mean))``, which the input's
  gradient reads, times ``rsqrt(var)``); a step still not covered is
  refused with the fix (mark the gradients).

* **Random draws over the batch** (dropout masks): a ``random_bits`` whose
  shape carries the batch dimension would draw each micro-batch its own
  mask.  :func:`~meshplan.graph.draw_batch_dims` names, per such draw, the
  dimension and the full-batch shape, and :func:`draw_equations` the
  full-batch form of the draw and of its per-example keys (a split into one
  key per example); the runtime draws once per step that way and hands each
  micro-batch its rows, as the plain step draws them.  A draw keyed by the
  batch is refused.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import numpy as np

from ..errors import TraceError, mark_step_failure, warn
from ..graph import GRAD_BOUNDARY, INFERRED_GRADIENTS, Graph, draw_batch_dims, forward_nodes
from ..markers import grad_marker_eqn
from ..traced import FlatEqn, FlatJaxpr, computed_into
from .scaling import batch_scaling
from .walk import computed_from, flatten, same_stream

__all__ = ("micro_step", "mark_full_batch", "infer_gradients", "draw_equations", "BatchDraw")

# (flat equation index, batch dimension, full-batch shape) of a draw over the batch
BatchDraw = tuple[int, int, tuple[int, ...]]


def jaxpr_of(fn: Callable, args: Sequence[Any], where: str = "",
             suspects: Callable[[], str] | None = None) -> tuple[Any, Any]:
    """``jax.make_jaxpr(fn, return_shape=True)(*args)``.  A failure at the
    arguments as given is the function's own: it is raised as it is, as
    ``jax.jit`` raises it, with a note saying meshplan was tracing it.  A
    failure at another size (``where``) becomes one TraceError that says so
    and keeps the cause (the search tries other sizes); ``suspects()``, the
    likeliest cause at micro-batch size (asked on failure only), ends the hint."""
    try:
        return jax.make_jaxpr(fn, return_shape=True)(*args)
    except Exception as e:
        if not where:
            mark_step_failure(e, getattr(fn, "__name__", str(fn)))
            raise
        hint = (" (a micro-batch is the first rows, along dimension 0, of every leaf of the "
                "batch arguments: is dimension 0 the batch in each of them, and does the step "
                f"take the batch size from x.shape[0] rather than from a constant?"
                f"{suspects() if suspects else ''})"
                if where == " at micro-batch size" else "")
        raise TraceError(f"could not trace {getattr(fn, '__name__', fn)!r}{where}: "
                         f"{type(e).__name__}: {' '.join(str(e).split())}{hint}") from e


def micro_step(fn: Callable, full_args: Sequence[Any], micro_args: Sequence[Any],
               build_graph: Callable[[Any, Sequence[Any], Any, FlatJaxpr], Graph], *,
               infer: bool = True, scaling: int = 0,
               suspects: Callable[[], str] | None = None) -> tuple[Any, ...]:
    """``fn`` traced at ``micro_args`` (the batch cut into micro-batches):
    (closed jaxpr, output shapes, flat stream with the gradient marker, its
    Graph, (the draws over the batch, :func:`draw_equations`), its
    :class:`~meshplan.trace.scaling.Scaling` or None).  ``build_graph(closed, args,
    out_shape, flat)`` makes the Graph of a flat stream.  ``infer`` False
    (one micro-batch): the trace as it is.  ``scaling``: the number of
    micro-batches, to analyse how the values scale with the batch (the
    runtime's combination of micro-batches); 0: not analysed.  ``suspects``:
    see :func:`jaxpr_of`."""
    closed, out_shape = jaxpr_of(fn, micro_args, " at micro-batch size", suspects)
    flat = flatten(closed)
    graph = build_graph(closed, micro_args, out_shape, flat)
    marked = any(fe.eqn.primitive.name == GRAD_BOUNDARY for fe in flat.eqns)
    draws = any(fe.eqn.primitive.name == "random_bits" for fe in flat.eqns)
    if not infer or (marked and not draws and not scaling):
        return closed, out_shape, flat, graph, ((), ()), None
    full = flatten(jax.make_jaxpr(fn)(*full_args))
    batch = {i.tensor for i in graph.inputs if i.role == "batch"}
    scaled = _scaling(flat, full, batch, scaling) if scaling else None
    if marked and not draws:
        return closed, out_shape, flat, graph, ((), ()), scaled
    if marked and not same_stream(flat, full):
        # (a micro-batch of one example: JAX elides broadcasts over it)
        return closed, out_shape, flat, graph, _draws_in_order(flat, full, batch), scaled
    try:
        per_example = _per_example(flat, full)
    except TraceError:
        if _one_example(graph):
            raise TraceError(ONE_EXAMPLE) from None
        raise
    if not marked:
        metrics = _metrics(graph)
        flat = infer_gradients(flat, per_example, forward_nodes(graph), batch, metrics)
        if not any(fe.eqn.primitive.name == GRAD_BOUNDARY for fe in flat.eqns):
            # (the runtime's split would refuse it: never plan it)
            after = _metric_after_update(flat, graph, batch)
            if after is not None:
                raise TraceError(
                    f"running more than one micro-batch needs the update to come after every "
                    f"pass over the batch, and the output {after} runs the batch through the "
                    "new state (a loss after the update, an EMA model's loss); compute it before "
                    "the update, or plan with num_micro_batches=1")
            if _state_reads_batch(flat, graph, batch):
                raise TraceError(
                    "running more than one micro-batch needs to know where the gradients end, "
                    "and no reduction over the batch that the new state is computed from was "
                    "found in this step; compute the gradients with meshplan.value_and_grad / "
                    "meshplan.grad, or, for a metric added into the state (an evaluation "
                    "step's running sum), return it and add it up outside the step (or plan "
                    "with num_micro_batches=1)")
            # an evaluation step (or one returning its gradients): its every
            # pass over the batch is forward work, run per micro-batch, and
            # its outputs are the micro-batches' combined
        graph = build_graph(closed, micro_args, out_shape, flat)
    draws = _draws(flat, per_example, full, batch)
    return (closed, out_shape, flat, graph, (draws, draw_equations(flat, draws, per_example, full)),
            scaled)


def _metrics(graph: Graph) -> set[int]:
    """The outputs that update no argument: metrics, less a new state's
    value returned again among them (a metrics dict holding the new state)."""
    state = {o.tensor for o in graph.outputs if o.updates is not None}
    return {o.tensor for o in graph.outputs if o.updates is None} - state


def _state_reads_batch(flat: FlatJaxpr, graph: Graph, batch: set[int]) -> bool:
    """Whether an output that updates an argument is computed from the batch."""
    bdep = computed_from(flat, batch)
    return any(o.updates is not None and o.tensor in bdep for o in graph.outputs)


def _metric_after_update(flat: FlatJaxpr, graph: Graph, batch: set[int]) -> str | None:
    """The path of an output that is no new state but is computed from the
    batch and from a new state's value, else None."""
    state = {o.tensor for o in graph.outputs if o.updates is not None} - set(flat.invars)
    for o in graph.outputs:
        if o.updates is None and isinstance(o.tensor, int):
            up = computed_into(flat.eqns, {o.tensor})
            if up & batch and (up - {o.tensor}) & state:
                return o.path or "a metric"
    return None


def _scaling(flat: FlatJaxpr, full: FlatJaxpr, batch: set[int], m: int) -> Any:
    """:func:`~meshplan.trace.scaling.batch_scaling`, or None (micro-batches
    averaged, as before the analysis) with a warning where it fails."""
    try:
        found = batch_scaling(flat, full, batch, m)
        if found is None and not any(getattr(flat.avals[i], "shape", (0,))[:1] == (1,)
                                     for i in batch):
            # (jax traces a micro-batch of one otherwise, eliding broadcasts
            # over it: known, and averaged as before)
            warn(f"meshplan: could not tell how this step's values scale with the "
                 f"batch: jax traces other operations at a micro-batch than at the "
                 f"whole batch ({_first_difference(flat, full)}; an operation left out "
                 "at one size, as x[:8] of 8 rows); the pipeline averages every value "
                 "over the micro-batches, which is exact only for means")
        return found
    except Exception as e:      # (an operation the analysis did not foresee)
        warn(f"meshplan: could not tell how this step's values scale with the batch "
             f"({type(e).__name__}: {e}); the pipeline averages every value over the "
             "micro-batches, which is exact only for means")
        return None


def _first_difference(micro: FlatJaxpr, full: FlatJaxpr) -> str:
    """Where two traces' streams of equations part, in words."""
    k = next((k for k, (x, y) in enumerate(zip(micro.eqns, full.eqns))
              if x.eqn.primitive is not y.eqn.primitive), min(len(micro.eqns), len(full.eqns)))

    def at(f: FlatJaxpr) -> str:
        return f.eqns[k].eqn.primitive.name if k < len(f.eqns) else "the end"
    return f"operation {k}: {at(full)} at the whole batch, {at(micro)} at a micro-batch"


def mark_full_batch(fn: Callable, args: Sequence[Any], probe_args: Sequence[Any],
                    flat: FlatJaxpr, graph: Graph,
                    rebuild: Callable[[FlatJaxpr], Graph]) -> tuple[FlatJaxpr, Graph]:
    """The whole-batch trace ``flat`` (its Graph ``graph``) of a step with no
    gradient marker, with the marker :func:`infer_gradients` puts on its
    gradients: found by comparing with the trace at ``probe_args`` (the batch
    at another size), so that one micro-batch (the whole-graph ILP, the
    overlap of the gradient reductions, the layers) sees the gradients
    several micro-batches see.  ``rebuild(flat)``: the Graph of a stream.
    Unchanged when the step is marked, has no batch, or no gradients are
    found (then it plans as traced, as before)."""
    batch = {i.tensor for i in graph.inputs if i.role == "batch"}
    if not batch or any(fe.eqn.primitive.name == GRAD_BOUNDARY for fe in flat.eqns):
        return flat, graph
    try:
        other = flatten(jax.make_jaxpr(fn)(*probe_args))
        per_example = _per_example(flat, other)
        metrics = _metrics(graph)
        marked = infer_gradients(flat, per_example, forward_nodes(graph), batch, metrics)
    except Exception:   # (a step that traces only at its own batch size: as traced)
        return flat, graph
    if marked is flat:
        return flat, graph
    return marked, rebuild(marked)


OTHER_STREAM = ("the step traces to other operations at micro-batch size than at full batch "
                "size, so meshplan cannot tell its gradients or its random draws over the batch "
                "apart; mark the gradients with meshplan.value_and_grad and keep random draws "
                "out of the batch, or use one micro-batch")


ONE_EXAMPLE = ("micro-batches of one example trace to other operations than the whole batch "
               "(JAX leaves out broadcasts over a dimension of one), so meshplan cannot tell "
               "the step's gradients apart; use micro-batches of two or more examples, or mark "
               "the gradients with meshplan.value_and_grad")


def _one_example(graph: Graph) -> bool:
    """Whether the micro-batch holds one example (its batch leaves' rows)."""
    return graph.batch_rows == {1}


def _per_example(micro: FlatJaxpr, full: FlatJaxpr) -> set[int]:
    """Ids whose shape differs between the micro-batch and full-batch traces."""
    if not same_stream(micro, full):
        raise TraceError(OTHER_STREAM)
    return {i for i, a in micro.avals.items()
            if i in full.avals and getattr(a, "shape", None) != getattr(full.avals[i], "shape", None)}


def _draws_in_order(flat: FlatJaxpr, full: FlatJaxpr, batch: set[int]
                    ) -> tuple[tuple[BatchDraw, ...], tuple[tuple[int, Any], ...]]:
    """(draws, draw equations) as :func:`_draws` and :func:`draw_equations`
    give them, for a marked step whose micro-batch trace is not the full
    trace's stream: the k-th random_bits of one is the k-th of the other,
    when the two compute its key alike (the same equations at the same
    shapes: no key per example); else refused."""
    mine = [k for k, fe in enumerate(flat.eqns) if fe.eqn.primitive.name == "random_bits"]
    theirs = [k for k, fe in enumerate(full.eqns) if fe.eqn.primitive.name == "random_bits"]
    whole = [tuple(full.avals[full.eqns[k].outvars[0]].shape) for k in theirs]
    dims = draw_batch_dims(whole, [tuple(flat.avals[flat.eqns[k].outvars[0]].shape)
                                   for k in mine])
    if isinstance(dims, str):
        raise TraceError(dims)
    if _key_chains(flat, mine) != _key_chains(full, theirs):
        raise TraceError(OTHER_STREAM)
    over = [(a, b, d, w) for a, b, d, w in zip(mine, theirs, dims, whole) if d is not None]
    _refuse_batch_keys(flat, [flat.eqns[a] for a, _, _, _ in over], batch)
    return (tuple((a, d, w) for a, _, d, w in over),
            tuple((a, full.eqns[b].eqn) for a, b, _, _ in over))


def _key_chains(flat: FlatJaxpr, draws: Sequence[int]) -> list[list[tuple[str, tuple]]]:
    """Per draw (equation index): (primitive, result shapes) of the equations
    it is computed from, in stream order -- one backward walk for all draws
    (a bit per draw on each value still needed)."""
    need: dict[int, int] = {}
    for bit, k in enumerate(draws):
        for x in flat.eqns[k].invars:
            if isinstance(x, int):
                need[x] = need.get(x, 0) | 1 << bit
    chains: list[list[tuple[str, tuple]]] = [[] for _ in draws]
    for fe in reversed(flat.eqns[:max(draws, default=0)]):
        mask = 0
        for o in fe.outvars:
            mask |= need.get(o, 0)
        if not mask:
            continue
        sig = (fe.eqn.primitive.name,
               tuple(tuple(getattr(flat.avals[o], "shape", ())) for o in fe.outvars))
        for bit in range(len(draws)):
            if mask >> bit & 1:
                chains[bit].append(sig)
        for x in fe.invars:
            if isinstance(x, int):
                need[x] = need.get(x, 0) | mask
    return [c[::-1] for c in chains]


def _refuse_batch_keys(flat: FlatJaxpr, draws: Sequence[FlatEqn], batch: set[int]) -> None:
    """A draw whose key is computed from the batch cannot be drawn once per step."""
    bdep = computed_from(flat, batch)
    if any(isinstance(x, int) and x in bdep for fe in draws for x in fe.invars):
        raise TraceError("a random draw over the batch takes its key from the batch, so it cannot "
                         "be drawn once per step; pass the key outside the batch arguments or use "
                         "one micro-batch (num_micro_batches=1)")


def infer_gradients(flat: FlatJaxpr, per_example: set[int], forward: Sequence[bool],
                    batch: set[int], metrics: set[int]) -> FlatJaxpr:
    """``flat`` with a gradient marker on the gradients found by the rule of
    the module doc (``forward``: per equation, for the check of the state
    outputs; ``batch``: the batch input ids; ``metrics``: output ids that
    update no input).  Unchanged when no gradient is found."""
    eqns = flat.eqns
    bdep = computed_from(flat, batch)
    # values some per-example value is computed from, and those the state is
    feeds = computed_into(eqns, per_example)
    state = computed_into(eqns, {x for x in flat.outvars
                                 if isinstance(x, int) and x not in metrics})
    def gradient(o: int) -> bool:
        aval = flat.avals[o]
        return (o in bdep and o in state and o not in per_example and o not in feeds
                and jax.numpy.issubdtype(getattr(aval, "dtype", np.int32), jax.numpy.inexact))
    grads = [o for fe in eqns if any(isinstance(x, int) and x in per_example for x in fe.invars)
             for o in fe.outvars if gradient(o)]
    # (nor a scalar of the forward: the loss, where the update reads it too,
    # a learning rate scaled by it or optax's reduce_on_plateau)
    made_by = {o: k for k, fe in enumerate(eqns) for o in fe.outvars}
    grads = [o for o in grads if flat.avals[o].shape != () or not forward[made_by[o]]]
    grads = _not_feeding(eqns, grads)
    try:
        _check_outputs(flat, grads, per_example, forward, bdep, metrics)
    except TraceError:
        # a gradient made from a sum over the batch that the backward reads
        # again (batch normalisation's scale: sum(dy * (x - mean)) times
        # rsqrt(var), the sum feeding the input's gradient too)
        again = {x for x in feeds if x in bdep and x not in per_example}
        more = _gradients_of_sums(eqns, grads, again, gradient)
        if not more:
            raise
        grads += more
        _check_outputs(flat, grads, per_example, forward, bdep, metrics)
    if not grads:
        return flat
    return _insert_marker(flat, _through_glue(flat, grads))


def _not_feeding(eqns: Sequence[FlatEqn], grads: list[int]) -> list[int]:
    """``grads`` less those another of them is computed from (a residual a
    lax.cond's forward hands its backward is no gradient: the marker would
    have to come both before and after the backward cond)."""
    made = set(grads)
    up = computed_into(eqns, {x for fe in eqns if not made.isdisjoint(fe.outvars)
                           for x in fe.invars if isinstance(x, int)})
    return [g for g in grads if g not in up]


def _gradients_of_sums(eqns: Sequence[FlatEqn], grads: list[int], sums: set[int],
                       gradient: Callable[[int], bool]) -> list[int]:
    """The first values (``gradient`` ones) computed from the sums over the
    batch in ``sums`` that are neither computed from ``grads`` nor read to
    compute them, nor from each other."""
    up = computed_into(eqns, set(grads))
    down = set(grads)
    more: list[int] = []
    for fe in eqns:
        ins = [x for x in fe.invars if isinstance(x, int)]
        if any(x in down for x in ins):
            down.update(fe.outvars)
        elif any(x in sums for x in ins):
            for o in fe.outvars:
                if gradient(o) and o not in up:
                    more.append(o)
                    down.add(o)
    return more


# layout-only operations jax's backward ends a gradient with (a weight
# gradient ``dot_general`` comes out transposed, a bias gradient goes through
# a (1, n) reshape and a sum over its axis of one): what
# meshplan.value_and_grad would return, and mark, is the value after them.
# A sum or broadcast counts only when it keeps the element count.
_GLUE = frozenset({"transpose", "reshape", "convert_element_type", "squeeze", "expand_dims",
                   "copy", "copy_p", "reduce_sum", "broadcast_in_dim"})


def _through_glue(flat: FlatJaxpr, grads: list[int]) -> list[int]:
    """Each gradient moved past the layout-only operations that are its only
    reader, so that the marker carries the gradients in their parameters'
    shapes, as a marked step's does (the same layering, accumulation and
    gradient reductions: :func:`meshplan.dp_search.layers.gradient_parameters`)."""
    readers: dict[int, list[FlatEqn]] = {}
    for fe in flat.eqns:
        for x in set(x for x in fe.invars if isinstance(x, int)):
            readers.setdefault(x, []).append(fe)
    outs = {x for x in flat.outvars if isinstance(x, int)}
    moved = []
    for g in grads:
        while g not in outs and len(readers.get(g, ())) == 1:
            fe = readers[g][0]
            if (fe.eqn.primitive.name not in _GLUE or len(fe.outvars) != 1
                    or [x for x in fe.invars if isinstance(x, int)] != [g]
                    or _size(flat.avals[fe.outvars[0]]) != _size(flat.avals[g])):
                break
            g = fe.outvars[0]
        moved.append(g)
    return moved


def _check_outputs(flat: FlatJaxpr, grads: list[int], per_example: set[int],
                   forward: Sequence[bool], bdep: set[int], metrics: set[int]) -> None:
    """Refuse a step whose state is computed from its backward other than
    through the gradients found (the update would run per micro-batch)."""
    after, backward = set(grads), set()
    for k, fe in enumerate(flat.eqns):
        ins = [x for x in fe.invars if isinstance(x, int)]
        if any(x in after for x in ins):
            after.update(fe.outvars)
        elif not forward[k] and (any(x in backward for x in ins) or any(
                o in per_example and o in bdep for o in fe.outvars)):
            backward.update(o for o in fe.outvars if o not in after)
    for x in flat.outvars:
        if isinstance(x, int) and x not in metrics and x in backward and x not in after:
            raise TraceError(
                "meshplan cannot find where this step's gradients end (a state output is computed "
                "from the backward pass, or from the batch again inside the update as a line "
                "search does, but not from a reduction over the batch); compute the gradients "
                "with meshplan.value_and_grad / meshplan.grad, or plan with num_micro_batches=1")


def _insert_marker(flat: FlatJaxpr, grads: list[int]) -> FlatJaxpr:
    """One gradient marker on ``grads``, right after the last of them is
    made; what reads them moves after it and reads the marker's outputs."""
    eqns = list(flat.eqns)
    made_at = {o: k for k, fe in enumerate(eqns) for o in fe.outvars}
    pos = max(made_at[g] for g in grads) + 1
    after = set(grads)
    moved: list[int] = []
    for k, fe in enumerate(eqns):
        if any(isinstance(x, int) and x in after for x in fe.invars):
            after.update(fe.outvars)
            if k < pos:
                moved.append(k)
    avals = dict(flat.avals)
    nxt = max(avals) + 1
    outs = tuple(range(nxt, nxt + len(grads)))
    for g, o in zip(grads, outs):
        avals[o] = flat.avals[g]
    rename = dict(zip(grads, outs))

    def rewire(fe: FlatEqn) -> FlatEqn:
        ins = tuple(rename.get(x, x) if isinstance(x, int) else x for x in fe.invars)
        return fe if ins == fe.invars else dataclasses.replace(fe, invars=ins)

    marker = FlatEqn(grad_marker_eqn([flat.avals[g] for g in grads]), tuple(grads), outs,
                     False, INFERRED_GRADIENTS)
    moved_set = set(moved)
    order = ([eqns[k] for k in range(pos) if k not in moved_set] + [marker]
             + [rewire(eqns[k]) for k in moved] + [rewire(fe) for fe in eqns[pos:]])
    out = tuple(rename.get(x, x) if isinstance(x, int) else x for x in flat.outvars)
    return FlatJaxpr(flat.invars, flat.constvars, flat.consts, tuple(order), out, avals)


def _size(aval: Any) -> int:
    return int(np.prod(getattr(aval, "shape", ()), dtype=np.int64))


def _draws(flat: FlatJaxpr, per_example: set[int], full: FlatJaxpr,
           batch: set[int]) -> tuple[BatchDraw, ...]:
    """The draws over the batch of ``flat`` (see :func:`draw_batch_dims`);
    a draw whose key is computed from the batch is refused (it cannot be
    drawn once per step)."""
    made = {o: k for k, fe in enumerate(flat.eqns) for o in fe.outvars}
    found = [(k, fe) for k, fe in enumerate(flat.eqns) if fe.eqn.primitive.name == "random_bits"
             and fe.outvars and fe.outvars[0] in per_example
             and not _keyed_by_rows(flat, fe.invars[0], batch, per_example, made)]
    _refuse_batch_keys(flat, [fe for _, fe in found], batch)
    micro = [tuple(flat.avals[fe.outvars[0]].shape) for _, fe in found]
    whole = [tuple(full.avals[fe.outvars[0]].shape) for _, fe in found]
    dims = draw_batch_dims(whole, micro)
    if isinstance(dims, str):
        raise TraceError(dims)
    return tuple((k, d, w) for (k, _), d, w in zip(found, dims, whole))


# equations that keep a key per row the row's own (its leading dimension the
# batch's, untouched): the key may be split, folded with a value no example
# owns, or have its per-row parts cut out
_ROW_KEYS = frozenset({"random_wrap", "random_unwrap", "random_split", "random_fold_in", "slice",
                       "squeeze"})


def _keyed_by_rows(flat: FlatJaxpr, key: Any, batch: set[int], per_example: set[int],
                   made: dict[int, int]) -> bool:
    """Whether ``key`` is a key per example that the batch itself holds
    (``jax.vmap(model)(x, batch["keys"])``): a draw from it draws each row
    with its own key, at any micro-batch size, so it needs no drawing once a
    step; a key of the batch's rows mixed in another way is not."""
    while isinstance(key, int) and key in per_example:
        if key in batch:
            return True
        k = made.get(key)
        if k is None:
            return False
        fe = flat.eqns[k]
        name, params = fe.eqn.primitive.name, fe.eqn.params
        if (name not in _ROW_KEYS
                or any(isinstance(x, int) and x in per_example for x in fe.invars[1:])
                or name == "slice" and (params["start_indices"][0] != 0 or params["strides"]
                                        and params["strides"][0] != 1
                                        or params["limit_indices"][0]
                                        != flat.avals[fe.invars[0]].shape[0])
                or name == "squeeze" and 0 in params["dimensions"]):
            return False
        key = fe.invars[0]
    return False


def draw_equations(flat: FlatJaxpr, draws: Sequence[BatchDraw], per_example: set[int],
                   full: FlatJaxpr) -> tuple[tuple[int, Any], ...]:
    """(equation index, its full-batch jaxpr equation) for every equation a
    draw over the batch is computed from (itself included) whose results are
    per-example: e.g. ``jax.random.split(key, batch_size)`` before a vmapped
    draw.  The runtime draws once per step with these."""
    made = {o: k for k, fe in enumerate(flat.eqns) for o in fe.outvars}
    full_made = {o: fe.eqn for fe in full.eqns for o in fe.outvars}
    out: dict[int, Any] = {}
    seen: set[int] = set()
    stack = [k for k, _, _ in draws]
    while stack:
        k = stack.pop()
        if k in seen:
            continue
        seen.add(k)
        fe = flat.eqns[k]
        if any(o in per_example for o in fe.outvars):
            out[k] = full_made[fe.outvars[0]]
        stack.extend(made[x] for x in fe.invars if isinstance(x, int) and x in made)
    return tuple(sorted(out.items(), key=lambda kv: kv[0]))
