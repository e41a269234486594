"""Layers inside a ``lax.scan`` over stacked parameters, made pipelineable.

A model that stores its L blocks once, every parameter leaf with a leading
``[L]`` axis, and applies them with ``jax.lax.scan`` is one equation to the
planner: the pipeline search cannot cut inside it and the ILP has no sharding
rule for it.  :func:`unstack_scanned_layers` rewrites such a step into an
equivalent one the passes understand:

* every stacked leaf (and every other non-batch leaf of the same shape, such as
  its optimizer moments) is given to the rewritten step as a tuple of L
  pieces, one per layer (:meth:`Unstacked.split`);
* the step's jaxpr is evaluated with the scans over stacked values unrolled:
  iteration i reads piece i, its per-iteration outputs stay pieces, and
  elementwise equations over stacked values (the optimizer update) run piece
  by piece; anything else that reads a stacked value gets the stack back
  (``jnp.stack`` of the pieces), so the rewrite never changes a number;
* values made from constants alone by cheap equations (a causal mask and its
  broadcast), which jax hoists out of a scan body, are made again in every
  unrolled layer, as a Python loop over the blocks would (:class:`_Const`),
  instead of one large value read by every layer and stage;
* outputs of a split shape come back as pieces, which
  :meth:`Unstacked.restore` stacks into the user's structure again.

The planner, the plan and the runtime all see the rewritten step, so a plan's
parameter paths end in the layer index (``['params']['h']['attn']['w'][3]``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core as jcore

from ..errors import MeshplanError, deleted_argument
from ..flops import ELEMENTWISE   # (over stacked operands they run piece by piece)
from ..graph import GRAD_BOUNDARY, PIPELINE_BOUNDARY, Graph, stacked_scan_inputs
from ..shardings import UNROLLED_MARK
from .calls import INLINE_CALLS, REMAT_CALLS, _closed_parts

__all__ = ["Unstacked", "unstack_scanned_layers"]

# identity markers over any number of operands: applied to the pieces
MARKERS = frozenset({GRAD_BOUNDARY, PIPELINE_BOUNDARY})


class _Stack:
    """A value whose leading axis of size ``n`` is held as n pieces.

    ``pieces`` are real per-layer values; a *lazy* stack (a broadcast along
    the leading axis) makes a piece on demand and its whole value by the
    original equation, so it never adds work where it is not split."""

    def __init__(self, n: int, pieces: list[Any] | None = None,
                 make_piece: Callable[[int], Any] | None = None,
                 make_whole: Callable[[], Any] | None = None) -> None:
        self.n = n
        self.lazy = pieces is None
        self._pieces = pieces
        self._make_piece = make_piece
        self._make_whole = make_whole
        self._whole: Any = None

    def piece(self, i: int) -> Any:
        return self._pieces[i] if self._pieces is not None else self._make_piece(i)

    def pieces(self) -> list[Any]:
        return [self.piece(i) for i in range(self.n)]

    def whole(self) -> Any:
        if self._whole is None:
            self._whole = (self._make_whole() if self._make_whole is not None
                           else jnp.stack(self._pieces))
        return self._whole


class _Const:
    """A value computed from constants alone by cheap equations (a causal
    mask and its broadcast).  jax hoists such loop invariants out of a scan
    body; the unrolled layers each make their own again (:meth:`fresh`), as
    layers written in a Python loop do, instead of all reading one value.

    ``eqn`` is None for a constant of the jaxpr (``value``)."""

    def __init__(self, eqn: Any = None, invals: Sequence[Any] = (), k: int = 0,
                 value: Any = None) -> None:
        self.eqn, self.invals, self.k = eqn, invals, k
        self._value = value

    def value(self) -> Any:
        if self._value is None:
            self._value = self.fresh({})
        return self._value

    def fresh(self, memo: dict[int, list[Any]]) -> Any:
        """The value made again; ``memo`` shares equations within one layer."""
        if self.eqn is None:
            return self._value
        key = id(self.eqn)
        if key not in memo:
            memo[key] = _bind(self.eqn, [x.fresh(memo) if isinstance(x, _Const) else x
                                         for x in self.invals])
        return memo[key][self.k]


# equations cheap enough to repeat per layer when they read only constants
CHEAP = ELEMENTWISE | {"iota", "broadcast_in_dim", "reshape", "transpose", "squeeze",
                       "expand_dims", "slice"}


def _whole(v: Any) -> Any:
    if isinstance(v, _Stack):
        return v.whole()
    return v.value() if isinstance(v, _Const) else v


def _fresh(v: Any, memo: dict[int, list[Any]]) -> Any:
    """A value for one more layer: constants-only values made again."""
    return v.fresh(memo) if isinstance(v, _Const) else _whole(v)


def _bind(eqn: Any, invals: Sequence[Any]) -> list[Any]:
    params = eqn.primitive.get_bind_params(eqn.params)
    out = eqn.primitive.bind(*[_whole(v) for v in invals], **params)
    return list(out) if eqn.primitive.multiple_results else [out]


def _piece_of(v: Any, i: int) -> Any:
    """Piece ``i`` of an operand of an elementwise equation over n pieces."""
    if isinstance(v, _Stack):
        return v.piece(i)
    v = _whole(v)
    if not jnp.shape(v):
        return v                      # a scalar broadcasts to every piece
    return lax.index_in_dim(v, i, keepdims=False)


def _elementwise(eqn: Any, invals: Sequence[Any]) -> list[Any] | None:
    stacks = [v for v in invals if isinstance(v, _Stack)]
    if not any(not s.lazy for s in stacks):
        return None                    # nothing really split: bind as it is
    n = stacks[0].n
    out_shape = eqn.outvars[0].aval.shape
    if any(s.n != n for s in stacks) or not out_shape or out_shape[0] != n or any(
            not isinstance(v, _Stack) and jnp.shape(_whole(v)) not in ((), out_shape)
            for v in invals):
        return None
    params = eqn.primitive.get_bind_params(eqn.params)
    pieces = [eqn.primitive.bind(*[_piece_of(v, i) for v in invals], **params)
              for i in range(n)]
    return [_Stack(n, pieces)]


def _broadcast(eqn: Any, invals: Sequence[Any], shapes: frozenset[tuple[int, ...]]
               ) -> list[Any] | None:
    """A broadcast to a stacked leaf's shape (the learning rate times a
    stacked update): a lazy stack, so the pieces need not be sliced out of
    it.  (Not any leading axis of a layer count: a value of the batch whose
    rows are as many would be made where it is first read, at one batch
    size but not at another.  Nor a constant's: a ``zeros_like`` of an
    activation whose rows happen to be as many as the layers is a constant
    each layer makes again, as at any other batch size.)"""
    shape, dims = eqn.params["shape"], tuple(eqn.params["broadcast_dimensions"])
    if tuple(shape) not in shapes or 0 in dims or isinstance(invals[0], (_Stack, _Const)) \
            or isinstance(eqn.invars[0], jcore.Literal):
        return None
    x = _whole(invals[0])
    return [_Stack(shape[0],
                   make_piece=lambda i: lax.broadcast_in_dim(x, shape[1:], tuple(d - 1 for d in dims)),
                   make_whole=lambda: _bind(eqn, invals)[0])]


def _marker(eqn: Any, invals: Sequence[Any]) -> list[Any]:
    flat: list[Any] = []
    for v in invals:
        flat.extend(v.pieces() if isinstance(v, _Stack) else [_whole(v)])
    out = list(eqn.primitive.bind(*flat, **eqn.params))
    res, k = [], 0
    for v in invals:
        if isinstance(v, _Stack):
            res.append(_Stack(v.n, out[k:k + v.n]))
            k += v.n
        else:
            res.append(out[k])
            k += 1
    return res


def _scan(eqn: Any, invals: Sequence[Any], shapes: frozenset[tuple[int, ...]]
          ) -> list[Any] | None:
    p = eqn.params
    n, nc, ncarry = p["length"], p["num_consts"], p["num_carry"]
    xs = invals[nc + ncarry:]
    if not any(isinstance(x, _Stack) and not x.lazy and x.n == n for x in xs):
        return None
    body, body_consts = _closed_parts(p["jaxpr"])
    carry = [_whole(v) for v in invals[nc:nc + ncarry]]
    ys: list[list[Any]] = [[None] * n for _ in body.outvars[ncarry:]]
    for i in (reversed(range(n)) if p["reverse"] else range(n)):
        memo: dict[int, list[Any]] = {}
        consts = [_fresh(v, memo) for v in invals[:nc]]
        x_i = [x.piece(i) if isinstance(x, _Stack)
               else lax.index_in_dim(_whole(x), i, keepdims=False) for x in xs]
        out = _eval(body, body_consts, consts + carry + x_i, shapes)
        carry = [_whole(v) for v in out[:ncarry]]
        for k, y in enumerate(out[ncarry:]):
            ys[k][i] = y
    return carry + [_Stack(n, [_whole(y) for y in col]) for col in ys]


def _cheap(eqn: Any) -> bool:
    """Whether ``eqn`` is cheap to repeat per layer (a call: all it holds)."""
    name = eqn.primitive.name
    if name in INLINE_CALLS and name not in REMAT_CALLS and INLINE_CALLS[name] in eqn.params:
        return all(_cheap(e) for e in _closed_parts(eqn.params[INLINE_CALLS[name]])[0].eqns)
    return name in CHEAP


def _eval(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any],
          shapes: frozenset[tuple[int, ...]]) -> list[Any]:
    """Evaluate ``jaxpr`` (tracing it again) with stacked values kept apart."""
    env: dict[Any, Any] = {}

    def read(v: Any) -> Any:
        return v.val if isinstance(v, jcore.Literal) else env[v]

    for v, x in zip(jaxpr.constvars, consts):
        env[v] = x if isinstance(x, _Const) else _Const(value=x)
    for v, x in zip(jaxpr.invars, args):
        env[v] = x
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        name = eqn.primitive.name
        out = None
        if any(isinstance(v, _Stack) for v in invals):
            if name in ELEMENTWISE:
                out = _elementwise(eqn, invals)
            elif name in MARKERS:
                out = _marker(eqn, invals)
            elif name == "scan":
                out = _scan(eqn, invals, shapes)
            elif name in INLINE_CALLS and name not in REMAT_CALLS \
                    and INLINE_CALLS[name] in eqn.params:
                inner, inner_consts = _closed_parts(eqn.params[INLINE_CALLS[name]])
                out = _eval(inner, inner_consts, invals, shapes)
        elif name == "broadcast_in_dim":
            out = _broadcast(eqn, invals, shapes)
        if out is None and _cheap(eqn) and all(
                isinstance(x, _Const) or isinstance(v, jcore.Literal)
                for v, x in zip(eqn.invars, invals)):
            out = [_Const(eqn, invals, k) for k in range(len(eqn.outvars))]
        if out is None:
            out = _bind(eqn, invals)
        for v, x in zip(eqn.outvars, out):
            env[v] = x
    # stacks stay apart; constants-only values are resolved
    return [x if isinstance(x := read(v), _Stack) else _whole(x) for v in jaxpr.outvars]


# ---------------------------------------------------------------------------
# Which leaves are stacked layers, and the rewritten step
# ---------------------------------------------------------------------------

def layer_counts(shapes: frozenset[tuple[int, ...]]) -> str:
    """The scan lengths of :func:`scanned_leaf_shapes`, e.g. ``"48"``."""
    return "/".join(map(str, sorted({shape[0] for shape in shapes})))


def scanned_leaf_shapes(graph: Graph) -> frozenset[tuple[int, ...]]:
    """Shapes of the non-batch inputs that a ``scan`` iterates over (its
    ``xs``, :func:`~meshplan.graph.stacked_scan_inputs`)."""
    return frozenset(tuple(graph.tensors[t].shape) for n in graph.nodes
                     for t in stacked_scan_inputs(graph, n))


@dataclass
class Unstacked:
    """The step rewritten to take stacked leaves as per-layer pieces."""
    fn: Callable                       # the rewritten step (takes split arguments)
    shapes: frozenset[tuple[int, ...]]
    batch_argnums: tuple[int, ...]
    num_layers: tuple[int, ...]        # the scan lengths
    _out: Any = field(default=None, repr=False)   # (treedef, split mask) of fn's outputs

    @property
    def note(self) -> str:
        return (f"the lax.scan over {layer_counts(self.shapes)} {UNROLLED_MARK}: each layer's "
                "parameters and optimizer state are planned as their own inputs (paths "
                "ending in the layer index); the step's arguments and results keep "
                "their stacked form (step.split_layers keeps them per layer)")

    def _splits(self, a: int, x: Any) -> bool:
        return a not in self.batch_argnums and tuple(getattr(x, "shape", ())) in self.shapes

    def delete_split(self, args: Sequence[Any], argnums: Sequence[int]) -> None:
        """Delete the arrays of arguments ``argnums`` that :meth:`split` cut
        into pieces (donated: the step ran on, and consumed, the pieces)."""
        for a in argnums:
            for x in jax.tree.leaves(args[a]) if a < len(args) else ():
                if isinstance(x, jax.Array) and self._splits(a, x) and not x.is_deleted():
                    x.delete()

    def split(self, args: Sequence[Any]) -> tuple[Any, ...]:
        """The user's arguments as the rewritten step takes them."""
        def one(a: int, path: Any, x: Any) -> Any:
            if not self._splits(a, x):
                return x
            if isinstance(x, jax.ShapeDtypeStruct):
                return tuple(jax.ShapeDtypeStruct(x.shape[1:], x.dtype) for _ in range(x.shape[0]))
            if not isinstance(x, jax.Array):    # host data stays on the host
                return tuple(x[i] for i in range(x.shape[0]))
            if x.is_deleted():
                raise deleted_argument(f"argument {a}{jax.tree_util.keystr(path)}")
            return _unstack_array(x)
        return tuple(jax.tree_util.tree_map_with_path(lambda p, x, a=a: one(a, p, x), arg)
                     for a, arg in enumerate(args))

    def _is_pieces(self, x: Any) -> bool:
        return (type(x) is tuple and len(x) > 0 and all(hasattr(p, "shape") for p in x)
                and (len(x),) + tuple(x[0].shape) in self.shapes
                and all(tuple(p.shape) == tuple(x[0].shape) for p in x))

    def stack(self, tree: Any) -> Any:
        """Every tuple of per-layer pieces in ``tree`` as one stacked array."""
        return jax.tree.map(lambda x: _stack_arrays(x) if self._is_pieces(x) else x, tree,
                            is_leaf=self._is_pieces)

    def restore(self, out: Any) -> Any:
        """The rewritten step's results in the user's structure."""
        treedef, mask = self._out
        leaves = jax.tree_util.tree_leaves(out)
        res, k = [], 0
        for m in mask:
            if m:
                res.append(_stack_arrays(leaves[k:k + m]))
                k += m
            else:
                res.append(leaves[k])
                k += 1
        return jax.tree_util.tree_unflatten(treedef, res)


@jax.jit
def _unstack_array(x: Any) -> tuple[Any, ...]:
    return tuple(x[i] for i in range(x.shape[0]))


@jax.jit
def _stack_jit(*pieces: Any) -> Any:
    return jnp.stack(pieces)


def _stack_arrays(pieces: Sequence[Any]) -> Any:
    if not all(getattr(p, "is_fully_addressable", True) for p in pieces):
        raise MeshplanError("a stacked result's layers live on devices of several processes; "
                            "read them with meshplan.runtime.to_host or loop over the layers "
                            "in Python instead of lax.scan")
    target = getattr(pieces[0], "sharding", None)
    moved = [p if target is None or p.sharding == target else jax.device_put(p, target)
             for p in pieces]
    return _stack_jit(*moved)


def unstack_scanned_layers(graph: Graph, fn: Callable, abstract: Sequence[Any]
                           ) -> Unstacked | None:
    """The rewrite of ``fn`` (traced into ``graph`` at ``abstract``), or None
    when no scan iterates over stacked non-batch inputs."""
    shapes = scanned_leaf_shapes(graph)
    if not shapes:
        return None
    batch = tuple(graph.batch_argnums)
    with_path, in_tree = jax.tree_util.tree_flatten_with_path(tuple(abstract))
    leaves = [x for _, x in with_path]
    mask = [int(p[0].idx) not in batch and tuple(getattr(x, "shape", ())) in shapes
            for p, x in with_path]
    lengths = frozenset(s[0] for s in shapes)
    u = Unstacked(fn=None, shapes=shapes, batch_argnums=batch,  # type: ignore[arg-type]
                  num_layers=tuple(sorted(lengths)))

    def step(*args2: Any) -> Any:
        flat2 = jax.tree_util.tree_leaves(args2)
        vals, whole, k = [], [], 0
        for m in mask:
            if m:
                pieces = flat2[k:k + int(leaves[len(vals)].shape[0])]
                k += len(pieces)
                vals.append(_Stack(len(pieces), list(pieces)))
                whole.append(jax.ShapeDtypeStruct((len(pieces),) + tuple(jnp.shape(pieces[0])),
                                                  pieces[0].dtype))
            else:
                vals.append(flat2[k])
                whole.append(jax.ShapeDtypeStruct(jnp.shape(flat2[k]), flat2[k].dtype))
                k += 1
        closed, out_shape = jax.make_jaxpr(
            lambda *a: fn(*a), return_shape=True)(*jax.tree_util.tree_unflatten(in_tree, whole))
        outs = _eval(closed.jaxpr, closed.consts, vals, shapes)
        out_leaves, out_tree = jax.tree_util.tree_flatten(out_shape)
        res, out_mask = [], []
        for o, v in zip(out_leaves, outs):
            if tuple(o.shape) in shapes:
                pieces = v.pieces() if isinstance(v, _Stack) else [
                    lax.index_in_dim(v, i, keepdims=False) for i in range(o.shape[0])]
                res.append(tuple(pieces))
                out_mask.append(len(pieces))
            else:
                res.append(_whole(v))
                out_mask.append(0)
        u._out = (out_tree, out_mask)
        return jax.tree_util.tree_unflatten(out_tree, res)

    step.__name__ = getattr(fn, "__name__", "fn")
    step.__wrapped__ = fn  # type: ignore[attr-defined]
    u.fn = step
    return u

