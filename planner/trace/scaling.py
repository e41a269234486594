"""How each value of a micro-batch trace scales with the batch, and which
values no combination of micro-batches gives exactly.

A pipeline runs the per-micro-batch part of a step ``M`` times and combines
what crosses into the update and the outputs.  Which combination is exact is
read off two traces of the step with the same equations: at the micro-batch
and at the whole batch (their literals differ where the step divides by a
batch size, as ``jnp.mean`` does).  Every value gets an :class:`Info`:

* ``N``: does not depend on the batch (parameters, constants);
* ``P``: per example (it carries the batch dimension; each row depends on
  its own example only);
* ``S``: a *sum over the examples*: ``reduce_sum`` over the batch, a
  weight gradient's ``x.T @ dy``, an embedding gradient's scatter-add, and
  what linear operations make of them;
* ``M``: a maximum or minimum over the examples (``Info.extremum``) of a
  per-example value that does not scale (a metric's largest loss or logit):
  the micro-batches' maxima's maximum;
* ``X``: none of these (a per-example value computed from a sum over the
  micro-batch, as batch normalisation is; a nonlinear function of a batch
  mean; a selection or sort over the batch; what is computed from a
  maximum): no combination of micro-batches gives the whole batch's value.

``degree`` d says how a value scales: at the whole batch it is ``M**d``
times the micro-batch's (``N``, ``P``), or ``M**d`` times the *mean* of the
micro-batches' values (``S``).  A mean over the batch has degree 0 and is
combined by averaging; a sum has degree 1 and is combined by summing; the
gradient of a mean loss has degree 0, of a summed loss 1.  A literal's
degree is ``log_M`` of the ratio of its two values (``jnp.mean``'s divisor:
1); ``None`` where a value is not such a power (``B - 1``).  The update
then runs on the whole batch's values with the whole batch's literals
(:attr:`Scaling.literals`, :attr:`Scaling.consts`), so it is the
undecorated step's update.

*Batch statistics* are computed once a step instead: a sum over the batch
made from the batch alone (a loss's token count ``sum(mask)``, a mean of
the inputs, the count of positions a BERT-style mask draws from the
state's key) that per-micro-batch work reads and turns into ``X`` (a loss
divided by it).  Computed at the whole batch and read by every
micro-batch, such a value does not depend on the micro-batch (``N``), and
what reads it combines exactly (the token-normalised loss becomes a sum of
the micro-batches' shares; the update and the outputs read the one value).
A count the state keeps, ``seen + x.shape[0]``, is made so too where the
micro-batches or the outputs read it.
:attr:`Scaling.statistics` names them and :attr:`Scaling.full_eqns` holds
the whole batch's form of the equations that compute them.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from fractions import Fraction
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
from jax import numpy as jnp
from jax.extend import core as jcore

from ..flops import ELEMENTWISE, SORTS, fft_axes, is_known, sorted_axis
from ..traced import IDENTITY_MARKERS, FlatJaxpr, Lit

from .calls import INLINE_CALLS, _closed_parts
from .walk import same_stream

__all__ = ["Info", "Scaling", "batch_scaling"]


@dataclass(frozen=True)
class Info:
    kind: str                      # "N", "P", "S", "M" or "X" (see the module doc)
    degree: Fraction | None = Fraction(0)
    zero: bool = False             # known to be zero (any degree)
    why: str = ""                  # X: the first cause
    extremum: str = ""             # M: "max" or "min"
    # P: a reshape gave the batch index's major part to a dimension of fixed
    # size (a step's own accumulation chunks, ``x.reshape(k, B // k, ...)``):
    # exact only where a lax.scan iterates over that dimension
    folded: bool = False
    # P: made from the rows' places in the micro-batch, not from its examples
    # (``jnp.arange(B)``, a constant's first B rows): exact only where it picks
    # each example's own row of a per-example value (``logp[arange(B), y]``)
    position: bool = False
    # P, position: places known not to be the rows' own (``(arange(B) - 1) % B``,
    # a roll written as a gather): picking rows by it moves examples
    shifted: bool = False


@dataclass(frozen=True)
class Scaling:
    """The analysis of one micro-batch trace (see the module doc)."""
    info: Mapping[int, Info]
    # (first output id of an equation, operand position) -> the whole batch's literal
    literals: Mapping[tuple[int, int], Any] = field(default_factory=dict)
    consts: Mapping[int, Any] = field(default_factory=dict)   # constant id -> whole batch's value
    # the batch statistics computed once a step (value ids), and the whole
    # batch's form of the equations they are made by (first output id ->
    # jaxpr equation)
    statistics: frozenset[int] = frozenset()
    full_eqns: Mapping[int, Any] = field(default_factory=dict)
    # those of the statistics made from the batch's size alone (``count +
    # x.shape[0]``): where only the update and the outputs read one, the
    # update makes it, with the whole batch's literals
    sized: frozenset[int] = frozenset()


# linear in a sum over the batch (and homogeneous in the scale of a per-example value)
_LINEAR = frozenset({
    "neg", "convert_element_type", "reshape", "broadcast_in_dim", "transpose", "squeeze",
    "expand_dims", "slice", "rev", "copy", "copy_p", "reduce_precision", "reduce_sum", "cumsum",
    "dynamic_slice", "gather", "pad", "concatenate", "add", "sub", "add_any", "dot_general",
    "mul", "div", "select_n", "dynamic_update_slice", "scatter-add", "scatter_add", "real",
    "imag", "conj", "complex", "conv_general_dilated", "reduce_window_sum", "split", "unstack",
    "sharding_constraint", "fft",
})
# homogeneous in a per-example value's scale but not linear
_HOMOGENEOUS = frozenset({
    "abs", "sign", "max", "min", "reduce_max", "reduce_min", "argmax", "argmin", "sqrt",
    "rsqrt", "cbrt", "integer_pow", "square", "eq", "ne", "gt", "ge", "lt", "le", "sort",
    "clamp", "cummax", "cummin", "stop_gradient", "reduce_window_max", "reduce_window_min",
    "select_and_scatter_add", "select_and_gather_add", "scatter",
})
# what keeps a value as it is (a maximum stays the maximum)
_KEEP_VALUE = frozenset({"convert_element_type", "reshape", "squeeze", "expand_dims", "copy",
                         "copy_p", "stop_gradient", "reduce_precision", "broadcast_in_dim",
                         "sharding_constraint"})
_SUMS = frozenset({"reduce_sum", "dot_general", "scatter-add", "scatter_add",
                   "conv_general_dilated"})
# (complex(x, y) = x + i y: its parts add)
_EQUAL = frozenset({"add", "sub", "add_any", "complex", "max", "min", "concatenate", "clamp", "pad",
                    "dynamic_update_slice", "scatter-add", "scatter_add", "scatter", "select_n",
                    "eq", "ne", "gt", "ge", "lt", "le"})
_TO_ZERO = frozenset({"sign", "eq", "ne", "gt", "ge", "lt", "le", "argmax", "argmin"})
# reductions over the batch that combine as the micro-batches' largest or
# smallest (a bool's any and all: the largest and smallest of its values)
_EXTREMA = {"reduce_max": "max", "reduce_min": "min", "reduce_or": "max", "reduce_and": "min"}
_INDEX_ARGS = {"gather": 1, "dynamic_slice": 1, "dynamic_update_slice": 2, "scatter-add": 1,
               "scatter_add": 1, "scatter": 1}


def batch_scaling(micro: FlatJaxpr, full: FlatJaxpr, batch_ids: Iterable[int],
                  m: int) -> Scaling | None:
    """The :class:`Scaling` of ``micro`` (the step at the micro-batch, ``m``
    micro-batches a step) against ``full`` (the same equations at the whole
    batch); ``None`` where the two streams differ."""
    if not same_stream(micro, full):
        return None
    # (a scalar among the batch arguments: every micro-batch reads it whole)
    batch = {i for i in batch_ids if getattr(micro.avals[i], "shape", ())}
    first = _analyse(micro, full, batch, m, frozenset())
    stats = _statistics(micro, full, batch, first.info)
    if not stats:
        return first
    again = _analyse(micro, full, batch, m, stats)
    return Scaling(again.info, again.literals, again.consts, stats,
                   {micro.eqns[k].outvars[0]: full.eqns[k].eqn
                    for k in _ancestors(micro, stats)},
                   frozenset(x for x in stats if first.info[x].kind == "N"))


def _analyse(micro: FlatJaxpr, full: FlatJaxpr, batch: set[int], m: int,
             stats: frozenset[int]) -> Scaling:
    """One pass over the paired streams, the values ``stats`` taken as the
    whole batch's (``N``: every micro-batch reads the one value)."""
    env: dict[int, Info] = {}
    consts: dict[int, Any] = {}
    for i in micro.invars:
        env[i] = Info("P") if i in batch else Info("N")
    for (i, c), c_full in zip(zip(micro.constvars, micro.consts), full.consts):
        env[i] = _literal(c, c_full, m)
        if env[i].degree != 0 and np.size(c) == 1:
            consts[i] = c_full
    literals: dict[tuple[int, int], Any] = {}
    # scalars made from literals and constants alone, at both sizes
    known: dict[int, tuple[Any, Any]] = {
        i: (c, c_full) for (i, c), c_full in zip(zip(micro.constvars, micro.consts), full.consts)
        if _foldable(c, c_full)}
    for fe, fe_full in zip(micro.eqns, full.eqns):
        ins = []
        for pos, (x, y) in enumerate(zip(fe.invars, fe_full.invars)):
            if isinstance(x, Lit):
                info = _literal(x.value, y.value if isinstance(y, Lit) else x.value, m)
                if info.degree != 0 and fe.outvars:
                    literals[(fe.outvars[0], pos)] = y.value
                ins.append(info)
            else:
                ins.append(env[x])
        folded = _fold(fe, fe_full, known)
        if folded is not None:
            # (computed here, at both sizes: ``where(n == 0, 1, n)`` of a
            # count is the count, as keras.ops.divide_no_nan makes it)
            known[fe.outvars[0]] = folded
            outs = [_literal(*folded, m)]
        else:
            pe = [_shape(micro.avals[o]) != _shape(full.avals.get(o)) for o in fe.outvars]
            outs = _eqn(fe.eqn, fe_full.eqn, ins, pe, m)
        env.update((o, Info("N") if o in stats else i) for o, i in zip(fe.outvars, outs))
    return Scaling(env, literals, consts)


# what a value made from literals alone is folded through (:func:`_fold`):
# also the product of a shape taken as an array (keras's loss reduction
# divides by ``prod(convert_to_tensor(shape(values)))``)
_FOLDABLE = ELEMENTWISE | {"select_n", "convert_element_type", "broadcast_in_dim", "reshape",
                           "reduce_prod", "reduce_sum", "reduce_max", "reduce_min", "squeeze",
                           "slice", "concatenate"}
# the most elements such a value has (a shape as an array: one per dimension)
_SHAPE_VECTOR = 8
# ... or, where it has the batch's size (places: jnp.arange(B * T) % T), this
_PLACES = 2 ** 16


def _foldable(a: Any, b: Any) -> bool:
    """Whether a value of ``a`` at the micro-batch and ``b`` at the whole
    batch is kept folded: a scalar or a shape as an array, or an array of
    the batch's size made from places (read by :func:`_batch_constant`)."""
    if np.shape(a) == np.shape(b):
        return np.size(a) <= _SHAPE_VECTOR
    return np.size(b) <= _PLACES


def _fold(fe: Any, fe_full: Any, known: Mapping[int, tuple[Any, Any]]) -> tuple[Any, Any] | None:
    """The value of an equation's one output (:func:`_foldable`) at the
    micro-batch and at the whole batch, where its operands are literals or
    such values (what a count taken from a shape becomes, an iota and what
    is computed from it); else None."""
    name = fe.eqn.primitive.name
    if (name not in _FOLDABLE and name != "iota") or len(fe.outvars) != 1 or (
            not fe.invars and name != "iota"):
        return None
    ins: list[list[Any]] = [[], []]
    for x, y in zip(fe.invars, fe_full.invars):
        if isinstance(x, Lit) and isinstance(y, Lit):
            pair = (x.value, y.value)
        elif isinstance(x, int) and x in known:
            pair = known[x]
        else:
            return None
        if not _foldable(*pair):
            return None
        ins[0].append(pair[0])
        ins[1].append(pair[1])
    grows = _shape(fe.eqn.outvars[0].aval) != _shape(fe_full.eqn.outvars[0].aval)
    if grows and name != "iota" and all(np.shape(x) == np.shape(y) for x, y in zip(*ins)):
        # (a scalar filled out to the batch: alike in every row, and how it
        # scales is _rule's)
        return None
    try:
        a, b = (np.asarray(e.eqn.primitive.bind(*vals, **e.eqn.params))
                for e, vals in ((fe, ins[0]), (fe_full, ins[1])))
    except Exception:       # (what does not bind eagerly stays unfolded)
        return None
    # (an array of one shape at both sizes is taken not to scale: only a
    # small one is folded on)
    return (a, b) if _foldable(a, b) else None


def _statistics(micro: FlatJaxpr, full: FlatJaxpr, batch: set[int],
                info: Mapping[int, Info]) -> frozenset[int]:
    """The batch statistics worth computing once a step: values made from
    the batch, constants, literals and keys alone that are no longer per
    example (a sum, mean or maximum over the batch: the same shape in both
    traces) and that an operation reads which the first pass found no
    combination for; and a count made from the state and the batch's
    size, read so or given as an output."""
    # (and the arguments that are no floating-point parameters: the PRNG key a
    # draw over the batch is made with, a step counter)
    state = {i for i in micro.invars if i not in batch and not jnp.issubdtype(
        getattr(micro.avals[i], "dtype", np.float32), jnp.inexact)}
    data = set(batch) | set(micro.constvars) | state
    for fe in micro.eqns:
        if fe.eqn.primitive.name not in IDENTITY_MARKERS and not getattr(fe.eqn, "effects", None) \
                and all(isinstance(x, Lit) or x in data for x in fe.invars):
            data.update(fe.outvars)
            if any(isinstance(x, int) and x in state for x in fe.invars):
                state.update(fe.outvars)

    def whole(x: Any) -> bool:
        # (a sum, extremum or mixture over the batch, or a state's count
        # made with the batch's size, ``seen + x.shape[0]``: each differs
        # between the micro-batch and the whole batch, where it has the
        # same shape; what literals alone make, each program folds itself)
        if not isinstance(x, int) or x not in data:
            return False
        i = info[x]
        return ((i.kind in "SMX" or (i.kind == "N" and i.degree != 0 and x in state))
                and _shape(micro.avals[x]) == _shape(full.avals.get(x)))
    stats = {x for x in micro.outvars if whole(x) and info[x].kind == "N"}
    for fe in micro.eqns:
        if any(info[o].kind == "X" for o in fe.outvars):
            stats.update(x for x in fe.invars if whole(x))
    # (made once at the whole batch, every result of the operation is the
    # whole batch's: not one that also makes a value of the batch's size,
    # as a split of the batch's rows does)
    made = {o: fe for fe in micro.eqns for o in fe.outvars}
    return frozenset(x for x in stats if x not in made or all(
        _shape(micro.avals[o]) == _shape(full.avals.get(o)) for o in made[x].outvars))


def _ancestors(micro: FlatJaxpr, values: frozenset[int]) -> list[int]:
    """The equations ``values`` are computed by (flat order)."""
    producer = {o: k for k, fe in enumerate(micro.eqns) for o in fe.outvars}
    need, seen = list(values), set()
    while need:
        k = producer.get(need.pop())
        if k is None or k in seen:
            continue
        seen.add(k)
        need.extend(x for x in micro.eqns[k].invars if isinstance(x, int))
    return sorted(seen)


def _shape(aval: Any) -> Any:
    return getattr(aval, "shape", None)


def _scalar(a: np.ndarray) -> float | complex:
    v = a.item()
    return v if isinstance(v, complex) else float(v)


def _literal(v: Any, v_full: Any, m: int) -> Info:
    """A literal or captured constant, of value ``v`` at the micro-batch and
    ``v_full`` at the whole batch."""
    if np.shape(v) != np.shape(v_full):
        return _batch_constant(v, v_full)
    if np.size(v) >= 4096:      # (a captured array: not copied to look at)
        return Info("N")
    try:
        a, b = np.asarray(v), np.asarray(v_full)
    except TypeError:       # (typed PRNG keys)
        return Info("N")
    try:        # (bfloat16 and float8 scalars too; a complex one as it is: an FFT's 0j)
        x, y = (_scalar(a), _scalar(b)) if a.size == 1 == b.size else (None, None)
        zero = 0 < a.size < 4096 and not np.any(a != 0)
    except (TypeError, ValueError):
        return Info("N")
    if x is None:       # (an array: its values taken not to scale)
        return Info("N", Fraction(0), zero=bool(zero))
    if x == y or (np.isnan(x) and np.isnan(y)):
        return Info("N", Fraction(0), zero=x == 0)
    for d in (1, -1, 2, -2, 3, -3):     # (float32 literals: 1/24 and 1/72)
        if x and abs(y - x * float(m) ** d) <= 1e-6 * abs(y):
            return Info("N", Fraction(d))
    return Info("N", None)


# the most elements of a captured constant of the batch's shape compared
# row for row (a larger one is taken to differ between micro-batches)
_COMPARED = 2 ** 24


def _batch_constant(v: Any, v_full: Any) -> Info:
    """A constant with the batch's size, made at each trace's size (a padding
    mask built with numpy, a table's first rows): each micro-batch reads the
    micro-batch trace's, which is exact where every micro-batch's rows of
    the whole batch's are that one."""
    a, b = np.shape(v), np.shape(v_full)
    axes = sorted(_grown(a, b))
    if len(a) == len(b) and len(axes) == 1 and a[axes[0]] and b[axes[0]] % a[axes[0]] == 0 \
            and np.size(v_full) <= _COMPARED:
        d, n = axes[0], a[axes[0]]
        try:
            small, whole = np.asarray(v), np.asarray(v_full)
        except TypeError:       # (typed PRNG keys)
            return Info("P")
        if all(np.array_equal(np.take(whole, range(k, k + n), axis=d), small, equal_nan=True)
               for k in range(0, b[d], n)):
            return Info("P")
        if np.issubdtype(small.dtype, np.integer):      # (indices: each row's own place?)
            own = np.arange(n).reshape([n if k == d else 1 for k in range(len(a))])
            return Info("P", position=True, shifted=not np.array_equal(
                small, np.broadcast_to(own, a)))
    return Info("P", position=True)


def _eqn(eqn: Any, eqn_full: Any, ins: Sequence[Info], pe: Sequence[bool], m: int,
         one: bool = False) -> list[Info]:
    """The outputs' Infos; ``one``: inside a loop over the examples, whose
    ``P`` values are one example's (:func:`_scan`)."""
    name = eqn.primitive.name
    if name in INLINE_CALLS and INLINE_CALLS[name] in eqn.params:
        key = INLINE_CALLS[name]
        return _jaxpr(eqn.params[key], eqn_full.params[key], ins, m, one)
    if name in IDENTITY_MARKERS or name == "optimization_barrier":
        return list(ins)
    if name == "scan":
        return _scan(eqn, eqn_full, ins, m, one)
    if name == "cond":
        return _cond(eqn, eqn_full, ins, m, one)
    if name == "while":
        return _while(eqn, eqn_full, ins, m, one)
    if name == "dot_general" and ins[0].kind == ins[1].kind == "P" and _across(eqn, eqn_full):
        return [Info("X", why="a product of two examples of the batch (in-batch negatives, a "
                              "similarity between examples): each micro-batch sees only its own")]
    if any(i.folded for i in ins):
        if name == "reshape" and _unfolds(eqn, eqn_full):
            return [replace(ins[0], folded=False)]
        if name in _KEEP_VALUE and len(ins) == 1:
            return [ins[0] for _ in eqn.outvars]
        unfolded = [replace(i, folded=False) for i in ins]
        if name in ELEMENTWISE and all(i.folded for i in ins if i.kind != "N"):
            # (each element as before: per chunk, with values of no example)
            return [_refolded(_rule(name, eqn.params, unfolded, p)) for p in pe]
        if name in _WHOLE and len(ins) == 1 and sorted(eqn.params["axes"]) == list(
                range(len(_shape(eqn.invars[0].aval) or ()))):
            # (over every chunk: over all the examples, however they are grouped)
            return [_rule(name, eqn.params, unfolded, p) for p in pe]
        return [Info("X", why=_FOLDED) for _ in eqn.outvars]
    # (an operand that is X already keeps its first cause: _rule)
    batch_rows = any(i.kind == "P" for i in ins) and not any(i.kind == "X" for i in ins)
    if batch_rows and _picks_rows(eqn, eqn_full, ins):
        return [Info("X", why=f"{name} of examples of the batch by index (x[idx], "
                              "x.at[i].set(...)): a micro-batch holds other examples at those "
                              "places") for _ in eqn.outvars]
    if batch_rows and _moves(eqn, eqn_full):
        if name == "reshape":
            return [replace(i, folded=True) for i in
                    (_rule(name, eqn.params, ins, p) for p in pe)]
        return [Info("X", why=f"{name} along the batch axis (a sort, a running sum, a reversal "
                              "or a cut of the batch pairs or orders examples): each micro-batch "
                              "sees only its own") for _ in eqn.outvars]
    if any(pe) and not is_known(name) and any(i.kind == "P" for i in ins):
        # (a callback, a kernel, a shard_map: what it does with the rows it
        # is given is not seen here, and it may mix them)
        return [Info("X", why=f"{name}, which meshplan cannot see into, given the batch's "
                              "examples: it may combine them, and each micro-batch would give "
                              "it only its own") for _ in eqn.outvars]
    if name == "convert_element_type" and any(i.kind == "S" for i in ins) and \
            jnp.issubdtype(eqn.invars[0].aval.dtype, jnp.inexact) and \
            not jnp.issubdtype(eqn.params["new_dtype"], jnp.inexact):
        # (rounding: computed once a step from the combined sum, as jnp.round is)
        return [Info("X", why="a sum or mean over the batch cast to integers")]
    if _index_arithmetic(ins) and not _draws(name):
        # (places, and literals that may hold the batch's size: jnp's
        # ``where(i < 0, i + B, i)`` of an index; how it scales does not
        # matter, where it ends up matters)
        shifted = any(i.shifted for i in ins)
        return [Info("P", Fraction(0), position=True, shifted=shifted) if p
                else Info("X", why=_POSITIONS) for p in pe]
    return [_placed(eqn, eqn_full, ins, _rule(name, eqn.params, ins, p), p) for p in pe]


def _index_arithmetic(ins: Sequence[Info]) -> bool:
    """Whether an equation reads places and nothing else of the batch."""
    batch = [i for i in ins if i.kind != "N"]
    return bool(batch) and all(i.kind == "P" and i.position for i in batch)


_POSITIONS = ("a value made from the rows' places in the batch (jnp.arange of the batch size, "
              "a constant's first rows, as many as the batch has): each micro-batch reads the "
              "first rows again")
# what picks rows of its first operand by indices (its own rows, where they
# are the examples' places)
_INDEXING = frozenset({"gather", "scatter", "scatter-add", "scatter_add", "scatter-mul",
                       "scatter_mul", "scatter-min", "scatter-max", "dynamic_slice",
                       "dynamic_update_slice"})


def _placed(eqn: Any, eqn_full: Any, ins: Sequence[Info], out: Info, per_example: bool) -> Info:
    """``out`` with :attr:`Info.position` where it is made from the rows'
    places; a sum or an extremum over the batch of such a value is ``X``.
    A random draw from places (a key per row) is not: the runtime draws the
    whole batch's numbers once a step (``TracedStep.batch_draws``)."""
    name = eqn.primitive.name
    placed = [i for i in ins if i.kind == "P" and i.position]
    if out.kind in "SM" and placed:
        return Info("X", why=_POSITIONS)
    if out.kind != "P" or _draws(name):
        return out
    if any(i.kind == "P" for i in ins):
        position = bool(placed) and not (name in _INDEXING and ins[0].kind == "P"
                                         and not ins[0].position)
    else:
        position = per_example and _from_places(eqn, eqn_full)
    if not position:
        return out
    return replace(out, position=True, shifted=any(i.shifted for i in placed))


def _draws(name: str) -> bool:
    """A random key or draw operation: a draw from places (a key per row) is
    a draw over the batch, made once a step by the runtime, not places."""
    return name.startswith("random_") or name == "threefry2x32"


def _grown(a: tuple[int, ...], b: tuple[int, ...]) -> set[int]:
    """The axes of a value whose size differs between its micro-batch shape
    ``a`` and its whole-batch shape ``b``: the batch's."""
    return {d for d, (x, y) in enumerate(zip(a, b)) if x != y}


def _from_places(eqn: Any, eqn_full: Any) -> bool:
    """Whether an equation that reads nothing of the batch makes an axis of
    the batch's size out of places: an iota along it, or rows cut from a
    value of fixed size (a slice, a gather of a table by an iota)."""
    name = eqn.primitive.name
    out, out_full = _shape(eqn.outvars[0].aval), _shape(eqn_full.outvars[0].aval)
    if name == "iota":
        d = eqn.params["dimension"]
        return out is not None and out_full is not None and out[d] != out_full[d]
    if name in ("slice", "dynamic_slice", "gather") and eqn.invars:
        return _shape(eqn.invars[0].aval) == _shape(eqn_full.invars[0].aval)
    return False


def _refolded(i: Info) -> Info:
    """``i`` of a value per chunk of the batch (one of no example, or one no
    combination gives anyway, stays as it is)."""
    return i if i.kind in "NX" else replace(i, folded=True)


# reductions whose value over every element does not depend on how the
# examples are grouped into chunks
_WHOLE = frozenset({"reduce_sum", "reduce_max", "reduce_min"})
_FOLDED = ("reshape along the batch axis (a dimension of fixed size holds the batch index's "
           "major part: two views of each example, chunks read other than by a lax.scan over "
           "them): each micro-batch pairs its own examples")
_NESTED_DRAW = ("a random draw over the batch inside a loop or branch (each micro-batch would "
                "draw other numbers; draw the batch's numbers outside it, as vmap does)")
_ALONG = {"cumsum": "axis", "cumprod": "axis", "cummax": "axis", "cummin": "axis",
          "cumlogsumexp": "axis"}


def _moves(eqn: Any, eqn_full: Any) -> bool:
    """Whether an operation moves examples along a batch axis (one whose
    size differs between the traces): sorts or accumulates along it,
    reverses, cuts, pads or splits it, or reshapes it so that a dimension of
    fixed size takes the batch index's major part (``x.reshape(2, B // 2)``,
    two views of each example).  Each micro-batch would pair or order its
    own examples only."""
    name, p = eqn.primitive.name, eqn.params
    shapes = [(_shape(v.aval), _shape(w.aval)) for v, w in zip(eqn.invars, eqn_full.invars)]
    if not shapes or shapes[0][0] is None or shapes[0][1] is None:
        return False
    (a, b) = shapes[0]
    axes = _grown(a, b)
    if not axes:
        return False
    if name in SORTS:
        return sorted_axis(p, len(a)) in axes
    if name in _ALONG:
        d = p.get(_ALONG[name], len(a) - 1)
        return (d if d is not None and d >= 0 else len(a) - 1) in axes
    if name == "rev":
        return bool(axes & set(p["dimensions"]))
    if name == "fft":
        return bool(axes & set(fft_axes(p, len(a))))
    if name == "tile":      # (repeats of the batch: each micro-batch repeats its own)
        return any(p["reps"][d] != 1 for d in axes)
    if name == "slice":     # (at either size: x[:8] keeps all of a micro-batch of 8)
        def cut(q: Mapping[str, Any], n: tuple[int, ...]) -> bool:
            strides = q["strides"] or (1,) * len(n)
            return any((q["start_indices"][d], q["limit_indices"][d], strides[d]) != (0, n[d], 1)
                       for d in axes)
        return cut(p, a) or cut(eqn_full.params, b)
    if name == "split":
        return p["axis"] in axes and len(p["sizes"]) > 1
    if name == "dynamic_slice":
        return any(p["slice_sizes"][d] != a[d] for d in axes)
    if name == "dynamic_update_slice":
        return any((shapes[1][0] or a)[d] != a[d] for d in axes)
    if name == "pad":
        return any(tuple(p["padding_config"][d]) != (0, 0, 0) for d in axes)
    if name == "concatenate":    # (a row of fixed size joined to the batch axis)
        d = p["dimension"]
        return d in axes and any(x is not None and x[d] == y[d] for x, y in shapes)
    if name == "reshape":
        out = (_shape(eqn.outvars[0].aval), _shape(eqn_full.outvars[0].aval))
        return _major(a, b) < _major(*out)
    return False


def _picks_rows(eqn: Any, eqn_full: Any, ins: Sequence[Info]) -> bool:
    """Whether a gather or scatter indexes the batch axis of its operand by
    anything but the rows' own places (``x[jnp.array([1, 5])]``,
    ``l.at[0].set(0)``, ``x[perm]``): it picks or edits some examples, which a
    micro-batch holds other ones of.  (``logp[arange(B), y]`` picks each
    row's own.)"""
    name = eqn.primitive.name
    if name == "gather":
        indexed = eqn.params["dimension_numbers"].start_index_map
    elif name.startswith("scatter"):
        indexed = eqn.params["dimension_numbers"].scatter_dims_to_operand_dims
    else:
        return False
    a, b = _shape(eqn.invars[0].aval), _shape(eqn_full.invars[0].aval)
    if a is None or b is None:
        return False
    return bool(_grown(a, b) & set(indexed)) and not (ins[1].kind == "P" and ins[1].position
                                                    and not ins[1].shifted)


def _unfolds(eqn: Any, eqn_full: Any) -> bool:
    """Whether a reshape of a folded value puts the batch index's parts back
    together (``x.reshape(2, B // 2, n).reshape(B, n)``): fewer elements
    major to the batch axis, and as many up to its end as before."""
    (a, b), (c, d) = ((_shape(v.aval), _shape(w.aval)) for v, w in
                      ((eqn.invars[0], eqn_full.invars[0]), (eqn.outvars[0], eqn_full.outvars[0])))
    ka = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), None)
    kc = next((k for k, (x, y) in enumerate(zip(c, d)) if x != y), None)
    if ka is None or kc is None:
        return False
    return _major(c, d) < _major(a, b) and np.prod(a[:ka + 1], dtype=np.int64) == np.prod(
        c[:kc + 1], dtype=np.int64)


def _major(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """The elements major to the first axis whose size differs between a
    value's two shapes (row-major order)."""
    k = next((d for d, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
    return int(np.prod(a[:k], dtype=np.int64))


def _across(eqn: Any, eqn_full: Any) -> bool:
    """Whether a dot_general pairs examples with other examples: both
    operands keep a batch axis (one whose size differs between the traces)
    that is neither contracted nor a batch dimension of the product."""
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]

    def free(k: int, taken: tuple) -> bool:
        a, b = eqn.invars[k].aval.shape, eqn_full.invars[k].aval.shape
        return any(x != y and d not in taken for d, (x, y) in enumerate(zip(a, b)))
    return free(0, (*lc, *lb)) and free(1, (*rc, *rb))


def _jaxpr(j: Any, j_full: Any, ins: Sequence[Info], m: int, one: bool = False) -> list[Info]:
    """The outputs of a nested jaxpr (paired with its whole-batch twin)."""
    jaxpr, consts = _closed_parts(j)
    jaxpr_full, consts_full = _closed_parts(j_full)
    env: dict[Any, Info] = {}
    for v, c, c_full in zip(jaxpr.constvars, consts, consts_full):
        env[v] = _literal(c, c_full, m)
    env.update(zip(jaxpr.invars, ins))

    def read(v: Any, v_full: Any) -> Info:
        if isinstance(v, jcore.Literal):
            return _literal(v.val, getattr(v_full, "val", v.val), m)
        return env.get(v, Info("N"))
    if len(jaxpr.eqns) != len(jaxpr_full.eqns) or any(
            a.primitive is not b.primitive for a, b in zip(jaxpr.eqns, jaxpr_full.eqns)):
        return [Info("X", why="a nested computation traced differently at another batch size")
                for _ in jaxpr.outvars]
    for e, e_full in zip(jaxpr.eqns, jaxpr_full.eqns):
        infos = [read(v, w) for v, w in zip(e.invars, e_full.invars)]
        # (one example's values: what is computed from them is that example's)
        each = one and any(i.kind == "P" for i in infos)
        pe = [each or _shape(v.aval) != _shape(w.aval) for v, w in zip(e.outvars, e_full.outvars)]
        if e.primitive.name == "random_bits" and (any(pe) or any(i.kind == "P" for i in infos)):
            # (the pipeline draws the batch's numbers once a step where the
            # step draws them, not inside a loop or branch: each micro-batch
            # would draw its own)
            env.update((v, Info("X", why=_NESTED_DRAW)) for v in e.outvars)
            continue
        env.update(zip(e.outvars, _eqn(e, e_full, infos, pe, m, one)))
    return [read(v, w) for v, w in zip(jaxpr.outvars, jaxpr_full.outvars)]


def _scan(eqn: Any, eqn_full: Any, ins: Sequence[Info], m: int, one: bool = False
          ) -> list[Info]:
    nc, nk = eqn.params["num_consts"], eqn.params["num_carry"]
    xs = list(zip(eqn.invars[nc + nk:], eqn_full.invars[nc + nk:], ins[nc + nk:]))
    lead = [(_shape(v.aval) or ())[:1] != (_shape(w.aval) or ())[:1] for v, w, _ in xs]
    if eqn.params["length"] != eqn_full.params["length"] and not any(lead):
        # (a loop run batch-size-dependent times over no batch axis: a
        # fori_loop to B // 8 runs fewer times per micro-batch)
        return [Info("X", why="a loop whose number of steps depends on the batch size")
                for _ in eqn.outvars]
    if any(i.folded for i in ins[:nc + nk]):
        return [Info("X", why=_FOLDED) for _ in eqn.outvars]
    # a loop over the examples (lax.map, a scan over the batch axis): each
    # step reads one example; its ys are per example, and a carry that sums
    # what the steps compute is a sum over the examples
    over = (eqn.params["length"] != eqn_full.params["length"] and not one
            and all(i.kind == "P" and d for (_, _, i), d in zip(xs, lead) if i.kind != "N")
            and not any(i.kind in "PSMX" for i in ins[:nc + nk]))
    # (iterating over a folded dimension: each step reads a chunk of examples)
    chunks = any(i.folded for i in ins[nc + nk:])
    xs_in = list(ins[nc + nk:])
    ins = [*ins[:nc + nk], *(replace(i, folded=False) for i in xs_in)]
    settled = _settled(eqn.params["jaxpr"], eqn_full.params["jaxpr"], ins[:nc],
                       ins[nc:nc + nk], ins[nc + nk:], m, one or over)
    if settled is None:
        return [Info("X", why=_UNSETTLED) for _ in eqn.outvars]
    outs = settled[0]
    if chunks:      # (what each chunk's step stacks is per chunk: of other rows per micro-batch)
        outs = [*outs[:nk], *(_refolded(o) for o in outs[nk:])]
        weighed = _weighs_chunks(eqn.params["jaxpr"], nc, nk, xs_in, settled[1])
        weighed |= _chunks_not_summed(eqn.params["jaxpr"], nc, nk, outs[:nk])
        outs = [Info("X", why=_CHUNK_PLACES) if k in weighed and i.kind not in "NX" else i
                for k, i in enumerate(outs)]
    if not over:
        return outs
    body = eqn.params["jaxpr"]
    sums = [_carried(i, a, same) for i, a, same in
            zip(outs[:nk], _accumulates(body, nc, nk), _passed_on(body, nc, nk))]
    bad = next((i for i in sums if i.kind == "X"), None)
    # (what a step computes from such a carry is no one example's)
    return [*sums, *outs[nk:]] if bad is None else [bad for _ in outs]


_UNSETTLED = "a loop carry that does not settle"
_CHUNK_PLACES = ("a lax.scan over the step's own chunks of the batch that treats them by their "
                 "places (a counter or per-chunk values met with the chunk's rows, or a carry "
                 "other than a running sum of the chunks'): each micro-batch cuts its own rows "
                 "into those chunks")


def _weighs_chunks(closed: Any, nc: int, nk: int, xs: Sequence[Info], carry: Sequence[Info]
                   ) -> set[int]:
    """The results of a scan over chunks of the batch (carries, then what it
    stacks) computed from a chunk's rows and from what tells the steps apart
    other than their rows (a counter in the carry, a per-step input of no
    example): chunk k holds other rows in each micro-batch than in the whole
    batch, so weighing it by k weighs other examples."""
    jaxpr, _ = _closed_parts(closed)
    same = _passed_on(closed, nc, nk)
    steps = {nc + c for c in range(nk) if carry[c].kind == "N" and not same[c]}
    steps |= {nc + nk + j for j, i in enumerate(xs) if i.kind == "N"}
    rows = {nc + nk + j for j, i in enumerate(xs) if i.folded}
    if not steps or not rows:
        return set()
    got = _depends(jaxpr, [frozenset((k,)) for k in range(len(jaxpr.invars))])
    return {k for k, d in enumerate(got) if d & steps and d & rows}


def _chunks_not_summed(closed: Any, nc: int, nk: int, carry: Sequence[Info]) -> set[int]:
    """The carries of a scan over chunks of the batch that hold a value of the
    batch other than a running sum of the chunks' (the last chunk's, a decaying
    average): of other rows in each micro-batch.  Not where a call (a
    jax.checkpoint around the body) reads the carry: the sum is not seen
    there."""
    jaxpr, _ = _closed_parts(closed)
    adds, same = _accumulates(closed, nc, nk), _passed_on(closed, nc, nk)
    called = {v for e in jaxpr.eqns if e.primitive.name in INLINE_CALLS for v in e.invars
              if not isinstance(v, jcore.Literal)}
    return {c for c in range(nk) if carry[c].kind in "PSM" and not same[c] and not adds[c]
            and jaxpr.invars[nc + c] not in called}


def _depends(jaxpr: Any, ins: Sequence[frozenset[int]]) -> list[frozenset[int]]:
    """Per output of ``jaxpr``, the union of ``ins`` it is computed from;
    through the calls that only group equations (a jax.checkpoint, a nested
    jit), operand by operand, and any other equation's results from all its
    operands."""
    env: dict[Any, frozenset[int]] = dict(zip(jaxpr.invars, ins))

    def of(v: Any) -> frozenset[int]:
        return frozenset() if isinstance(v, jcore.Literal) else env.get(v, frozenset())
    for e in jaxpr.eqns:
        name = e.primitive.name
        inner = e.params.get(INLINE_CALLS[name]) if name in INLINE_CALLS else None
        body = _closed_parts(inner)[0] if inner is not None else None
        if body is not None and len(body.invars) == len(e.invars):
            outs = _depends(body, [of(v) for v in e.invars])
        else:
            outs = [frozenset().union(*map(of, e.invars))] * len(e.outvars)
        env.update(zip(e.outvars, outs))
    return [of(v) for v in jaxpr.outvars]


def _settled(body: Any, body_full: Any, consts: Sequence[Info], carry: Sequence[Info],
             xs: Sequence[Info], m: int, one: bool
             ) -> tuple[list[Info], list[Info]] | None:
    """(a loop body's outputs, its carries' infos) at a fixed point of the
    carries (the body's first outputs), or None where they do not settle."""
    carry = list(carry)
    for _ in range(4):
        outs = _jaxpr(body, body_full, [*consts, *carry, *xs], m, one)
        joined = [_join(a, b) for a, b in zip(carry, outs[:len(carry)])]
        if joined == carry:
            return outs, carry
        carry = joined
    return None


def _while(eqn: Any, eqn_full: Any, ins: Sequence[Info], m: int, one: bool = False
           ) -> list[Info]:
    """A while loop: its carries as its body makes them (a fixed point, as
    a scan's), where the number of steps is the same for every micro-batch
    (its condition reads no value of the batch, nor the batch's size)."""
    p, p_full = eqn.params, eqn_full.params
    cn, bn = p["cond_nconsts"], p["body_nconsts"]
    settled = _settled(p["body_jaxpr"], p_full["body_jaxpr"], ins[cn:cn + bn], ins[cn + bn:],
                       (), m, one)
    if settled is None:
        return [Info("X", why=_UNSETTLED) for _ in eqn.outvars]
    outs, carry = settled
    (pred,) = _jaxpr(p["cond_jaxpr"], p_full["cond_jaxpr"], [*ins[:cn], *carry], m, one)
    if pred.kind != "N" or pred.degree != 0:
        return [Info("X", why="a while loop whose number of steps depends on the batch")
                for _ in eqn.outvars]
    return outs


def _passed_on(closed: Any, nc: int, nk: int) -> list[bool]:
    """Per carry of a scan body: whether each step returns it unchanged."""
    jaxpr, _ = _closed_parts(closed)
    return [jaxpr.outvars[c] is jaxpr.invars[nc + c] for c in range(nk)]


def _carried(info: Info, adds: bool, same: bool) -> Info:
    """A carry after a loop over the examples: as it is where each step
    passes it on unchanged; a sum over the examples where each step only
    adds to it (:func:`_accumulates`; a count of the examples too); else
    one example's value passed on to the next (a key split per example)."""
    if same or info.kind == "X":
        return info
    if adds and info.degree is not None:
        return Info("S", info.degree + 1)
    return Info("X", why="a loop over the examples of the batch that carries a value from one "
                         "example to the next (other than a sum of theirs)")


def _accumulates(closed: Any, nc: int, nk: int) -> list[bool]:
    """Per carry of a scan body: whether it only accumulates, its new value
    its old one plus a value not computed from it, and nothing else in the
    body reading either (a running sum read by the step would pass one
    example's value on to the next)."""
    jaxpr, _ = _closed_parts(closed)
    made = {v: e for e in jaxpr.eqns for v in e.outvars}
    readers: dict[Any, list[Any]] = {}
    for e in jaxpr.eqns:
        for v in e.invars:
            if not isinstance(v, jcore.Literal):
                readers.setdefault(v, []).append(e)
    returned = [v for v in jaxpr.outvars if not isinstance(v, jcore.Literal)]

    def step(v: Any, old: Any) -> Any:
        """The value v is passed on to: its one reader, a cast of it or an
        addition of a value not computed from ``old`` (None: other readers)."""
        rs = readers.get(v, [])
        if len(rs) != 1 or v in returned:
            return None
        e = rs[0]
        if e.primitive.name in ("convert_element_type", "copy") and len(e.invars) == 1:
            return e.outvars[0]
        if e.primitive.name in ("add", "add_any") and sum(u is v for u in e.invars) == 1 \
                and not any(u is not v and _reads(made, u, old) for u in e.invars):
            return e.outvars[0]
        return None
    result = []
    for c in range(nk):
        old, new = jaxpr.invars[nc + c], jaxpr.outvars[c]
        v, hops = old, 0
        while v is not None and v is not new:
            v, hops = step(v, old), hops + 1
        result.append(v is new and hops > 0 and not readers.get(new)
                      and returned.count(new) == 1)
    return result


def _reads(made: Mapping[Any, Any], v: Any, old: Any) -> bool:
    """Whether ``v`` is computed from ``old`` inside one jaxpr."""
    need, seen = [v], set()
    while need:
        x = need.pop()
        if x is old:
            return True
        if isinstance(x, jcore.Literal) or id(x) in seen or x not in made:
            continue
        seen.add(id(x))
        need.extend(made[x].invars)
    return False


def _cond(eqn: Any, eqn_full: Any, ins: Sequence[Info], m: int, one: bool = False) -> list[Info]:
    if ins[0].kind != "N":
        return [Info("X", why="a lax.cond branch chosen by the batch") for _ in eqn.outvars]
    xs = [i for i in ins if i.kind == "X"]
    if xs:      # (what a branch makes of it: taken to be as inexact)
        return [xs[0] for _ in eqn.outvars]
    branches = [_jaxpr(b, b_full, ins[1:], m, one)
                for b, b_full in zip(eqn.params["branches"], eqn_full.params["branches"])]
    outs = branches[0]
    for other in branches[1:]:
        outs = [_join(a, b) for a, b in zip(outs, other)]
    return outs


def _join(a: Info, b: Info) -> Info:
    if a == b or b.zero:
        return a
    if a.zero:
        return b
    if a.folded or b.folded:
        return Info("X", why=_FOLDED)
    if "X" in (a.kind, b.kind):
        return a if a.kind == "X" else b
    kind = a.kind if b.kind == "N" else b.kind if a.kind == "N" else a.kind
    if a.kind != "N" and b.kind != "N" and a.kind != b.kind:
        return Info("X", why="values of different kinds meeting in a loop or branch")
    if a.degree != b.degree:
        return Info("X", why="values that scale differently with the batch meeting in a loop "
                             "or branch")
    return Info(kind, a.degree)


def _rule(name: str, params: Mapping[str, Any], ins: Sequence[Info], per_example: bool) -> Info:
    """What one output of an equation is (see the module doc)."""
    xs = [i for i in ins if i.kind == "X"]
    if xs:
        return xs[0]
    ms = [i for i in ins if i.kind == "M"]
    if ms:      # (a maximum passes through what keeps its value: a cast, a reshape)
        if name in _KEEP_VALUE and not per_example and len(ms) == 1 and all(
                i.kind == "N" for i in ins if i is not ms[0]):
            return ms[0]
        return Info("X", why=f"{name} of a maximum or minimum over the batch")
    dep = [i for i in ins if i.kind in "PS"]
    degree = _degree(name, params, ins)
    if not dep:
        zero = name in ("broadcast_in_dim", "convert_element_type", "reshape", "mul") and any(
            i.zero for i in ins[:1 if name != "mul" else 2])
        # (one with the batch dimension is per example: a draw over the batch
        # from the state's key, a constant filled out to the batch)
        return Info("P" if per_example else "N", degree, zero=zero)
    sums = any(i.kind == "S" for i in ins)
    if per_example:
        if sums:
            return Info("X", why="a per-example value computed from a sum over the micro-batch "
                                 "(batch statistics, a loss divided by the batch's token count, "
                                 "a gradient read again by the backward)")
        if degree is None:
            return Info("X", why=f"{name} of values that scale differently with the batch (a "
                                 "clipped cotangent, a constant added to a batch mean's "
                                 "gradient)")
        return Info("P", degree)
    if any(i.kind == "P" for i in ins):      # a reduction over the batch
        if name in ("scatter-add", "scatter_add") and ins[2].kind == "P" and ins[0].kind != "P":
            # the operand plus the examples' rows summed: a sum of one more
            # degree than the rows, where the operand scales as that sum (a
            # table's own rows, degree 0, plus the rows of a mean's gradient)
            d = ins[2].degree
            if d is None or not (ins[0].zero or ins[0].degree == d + 1):
                return Info("X", why=f"{name} of values that scale differently with the batch")
            return Info("S", d + 1)
        if name in _EXTREMA and not sums and degree == 0:
            return Info("M", degree, extremum=_EXTREMA[name])
        if name not in _SUMS or sums:
            return Info("X", why=f"{name} over the examples of the batch (some examples picked, "
                                 "a maximum, a sort): only sums over them combine exactly "
                                 "across micro-batches")
        if degree is None:
            return Info("X", why=f"{name} of values that scale differently with the batch")
        return Info("S", degree + 1)
    # sums over the batch (and values not of the batch): only linear maps keep them sums
    bdep_operands = sum(i.kind == "S" for i in ins if not i.zero)
    linear = name in _LINEAR and not (
        name in ("mul", "dot_general", "conv_general_dilated") and bdep_operands > 1) and not (
        name == "div" and ins[1].kind == "S") and not (name == "select_n" and ins[0].kind == "S")
    if not linear or degree is None:
        return Info("X", why=f"{name} of a sum or mean over the batch (a nonlinear function of "
                             "a batch mean, a ratio of two sums over the batch)")
    return Info("S", degree)


def _degree(name: str, params: Mapping[str, Any], ins: Sequence[Info]) -> Fraction | None:
    """The output's degree by the operation's arithmetic; None where its
    operands scale inconsistently."""
    ds = [i.degree for i in ins]
    if name in _TO_ZERO:
        return Fraction(0) if name in ("sign", "argmax", "argmin") or _same(ins) is not None \
            else None
    if name in ("mul", "dot_general", "conv_general_dilated"):
        return None if None in ds[:2] else ds[0] + ds[1]
    if name == "div":
        return None if None in ds[:2] else ds[0] - ds[1]
    if name in ("sqrt", "rsqrt", "cbrt", "integer_pow", "square"):
        if ds[0] is None:
            return None
        return ds[0] * {"sqrt": Fraction(1, 2), "rsqrt": Fraction(-1, 2), "cbrt": Fraction(1, 3),
                        "square": 2}.get(name, Fraction(params.get("y", 1)))
    skip = _INDEX_ARGS.get(name)
    operands = [i for k, i in enumerate(ins) if k != skip and not (name == "select_n" and k == 0)]
    if name in ("dynamic_slice", "dynamic_update_slice"):    # (one index operand a dimension)
        operands = list(ins[:skip])
    if name in _EQUAL:
        return _same(operands)
    if name in _LINEAR or name in _HOMOGENEOUS:
        return operands[0].degree if operands else Fraction(0)
    # any other operation: only on values that do not scale
    return Fraction(0) if all(d == 0 or i.zero for d, i in zip(ds, ins)) else None


def _same(ins: Sequence[Info]) -> Fraction | None:
    degrees = {i.degree for i in ins if not i.zero}
    if len(degrees) > 1:
        return None
    return degrees.pop() if degrees else Fraction(0)
