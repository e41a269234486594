"""Trace a JAX function into the Graph IR.

``trace(fn, *args)`` runs ``jax.make_jaxpr`` (arguments may be concrete arrays
or ``jax.ShapeDtypeStruct`` pytrees: nothing is allocated), flattens nested
calls, counts FLOPs per node from the rule table in :mod:`meshplan.flops`,
labels each input leaf with a role (parameter, optimizer state, batch, other
state) and links each output leaf to the input it updates.
"""
from __future__ import annotations

import dataclasses
import hashlib
import inspect
import itertools
import json
import math
import re
from typing import Any, Callable, Iterable, Iterator, Sequence

import jax
import numpy as np

from .. import flops as flop_rules
from ..collector import with_relaxed_gc
from ..errors import MeshplanError, TraceError, batch_rows, warn
from ..graph import (BATCH, CONST, INPUT, INTERMEDIATE, LITERAL, OPT_STATE, PARAM, STATE,
                    Graph, GraphInput, GraphOutput, Node, Tensor, packed_bytes, forward_nodes)
from .cond import cond_params
from .loops import loop_description, while_trip_count
from .micro import jaxpr_of, mark_full_batch, micro_step
from .walk import COMPOSITES, FlatJaxpr, Lit, computed_from, flatten, sub_jaxprs
from ..traced import TracedStep, jit_dtype

_OPT_WORDS = re.compile(r"((?<![a-z])opt|\bmu\b|\bnu\b|moment|(?<![a-z])adam)", re.I)
_STATE_WORDS = re.compile(r"(batch_stats|(?<![a-z])stats|running_|(?<![a-z])rng|\bstep\b)", re.I)


def infer_role(argname: str, path: str, dtype: str, is_batch: bool) -> str:
    """Role of one input leaf, from its argument name, pytree path and dtype.

    Optimizer state is recognised by its path (optax states: ``mu``, ``nu``,
    ``count``; any key containing ``opt``); batch-norm statistics and counters
    are plain state; remaining floating-point leaves are parameters.
    """
    if is_batch:
        return BATCH
    words = f"{argname} {path}".replace("'", " ").replace("[", " ").replace("]", " ").replace(".", " ")
    if _OPT_WORDS.search(words):
        return OPT_STATE
    is_float = dtype == "bfloat16" or (not dtype.startswith("key<")
                                        and np.issubdtype(np.dtype(dtype), np.floating))
    if not is_float:
        return STATE
    if _STATE_WORDS.search(words):
        return STATE
    return PARAM


_DTYPE_NAMES: dict[Any, str] = {}


def _dtype_name(aval: Any) -> str:
    dt = aval.dtype
    name = _DTYPE_NAMES.get(dt)
    if name is None:
        if jax.dtypes.issubdtype(dt, jax.dtypes.prng_key):
            name = str(dt)            # "key<fry>": a typed PRNG key (graph.dtype_bits sizes it)
        else:
            name = str(np.dtype(dt)) if dt != "bfloat16" else "bfloat16"
        _DTYPE_NAMES[dt] = name
    return name


def _shape(aval: Any) -> tuple[int, ...]:
    return tuple(int(d) for d in getattr(aval, "shape", ()))


def _sanitize(v: Any) -> Any:
    """Reduce a primitive param to plain, hashable, JSON-able, deterministic data."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, np.bool_):
        return bool(v)
    if isinstance(v, np.integer):
        return int(v)
    if isinstance(v, np.floating):
        return float(v)
    if isinstance(v, (tuple, list)):
        return tuple(_sanitize(x) for x in v)
    if isinstance(v, np.dtype) or (isinstance(v, type) and issubclass(v, np.generic)):
        return str(np.dtype(v))
    if hasattr(v, "dtype") and hasattr(v, "name") and not hasattr(v, "shape"):
        return str(v.name)
    if hasattr(v, "lhs_spec") and hasattr(v, "rhs_spec"):  # ConvDimensionNumbers
        return (tuple(v.lhs_spec), tuple(v.rhs_spec), tuple(v.out_spec))
    if isinstance(v, np.ndarray):
        return tuple(v.tolist()) if v.size <= 16 else f"array{v.shape}"
    if hasattr(v, "jaxpr") or hasattr(v, "eqns") or callable(v):
        return None  # bodies are fingerprinted separately; functions are not data
    text = repr(v)
    return type(v).__name__ if " at 0x" in text else text


def _node_params(eqn: Any) -> tuple[tuple[str, Any], ...]:
    out = []
    for k in sorted(eqn.params):
        v = eqn.params[k]
        s = _sanitize(v)
        if s is None and v is not None:
            continue
        out.append((k, s))
    return tuple(out)


def _body_cost(body: Any, warnings: set[str]) -> tuple[float, int]:
    """FLOPs and bytes of one execution of a nested jaxpr."""
    flat = flatten(body)
    total_f, total_b = 0.0, 0
    for fe in flat.eqns:
        f, b = _eqn_cost(fe, lambda i: flat.avals[i] if isinstance(i, int) else i.aval, warnings)
        total_f += f
        total_b += b
    return total_f, total_b


def _eqn_cost(fe: Any, aval_of: Callable[[Any], Any], warnings: set[str],
              sized: Callable[[Any], tuple[tuple[int, ...], int]] | None = None
              ) -> tuple[float, int]:
    """FLOPs and bytes of one flat equation.  ``sized(var)``: its (shape,
    bytes), if the caller has them (default: from ``aval_of``)."""
    eqn = fe.eqn
    name = eqn.primitive.name
    size = sized or (lambda x: _sized(aval_of(x)))
    ins = [size(i) for i in fe.invars]
    outs = [size(o) for o in fe.outvars]
    nbytes = sum(b for _, b in ins) + sum(b for _, b in outs)
    if name in COMPOSITES:
        f, b, _ = _composite_cost(eqn, warnings)
        return f, b + nbytes
    if name == "shard_map":     # (the user's own parallel code: it runs as written)
        warnings.add("the step's jax.shard_map runs as written, on its own mesh and specs; "
                     "a one-stage plan lays out the rest of the step around it, pricing it as "
                     "one FLOP per output element (a pipeline cannot run it)")
    elif not flop_rules.is_known(name):
        warnings.add(f"unknown primitive '{name}': costed as one FLOP per output element "
                     "and planned replicated")
    params = dict(eqn.params, **random_generator([aval_of(i) for i in fe.invars])) \
        if name == "random_bits" else eqn.params
    f = flop_rules.flops_of(name, [s for s, _ in ins], [s for s, _ in outs], params)
    return f, nbytes


def random_generator(in_avals: Sequence[Any]) -> dict[str, Any]:
    """A random_bits' key implementation and whether a split draw equals the
    whole one (what its bits cost, planner.flops.random_bits_flops; the ILP
    may split a partitionable draw), from its operands."""
    impl = getattr(getattr(in_avals[0], "dtype", None), "_impl", None) if in_avals else None
    generator = str(getattr(impl, "name", "threefry2x32"))
    # (XLA splits an RngBitGenerator's counter-based Philox draw exactly: on
    # 8 CPU devices a split "rbg" draw equals the whole one, in a ninth the time)
    return {"partitionable": generator != "threefry2x32"
            or bool(jax.config.jax_threefry_partitionable), "generator": generator}


def _composite_cost(eqn: Any, warnings: set[str]) -> tuple[float, int, int]:
    """(flops, bytes, repeat) of a scan / while / cond over all its iterations."""
    name = eqn.primitive.name
    if name == "scan":
        f, b = _body_cost(eqn.params["jaxpr"], warnings)
        n = int(eqn.params["length"])
        return f * n, b * n, n
    if name == "while":
        f1, b1 = _body_cost(eqn.params["body_jaxpr"], warnings)
        f2, b2 = _body_cost(eqn.params["cond_jaxpr"], warnings)
        n = while_trip_count(eqn)
        if n is None:
            warnings.add("while loop: trip count unknown at trace time, costed as one iteration")
            return f1 + f2, b1 + b2, 1
        return f1 * n + f2 * (n + 1), b1 * n + b2 * (n + 1), n
    if name == "cond":
        costs = [_body_cost(br, warnings) for br in eqn.params["branches"]]
        return max(c[0] for c in costs), max(c[1] for c in costs), 1
    raise AssertionError(name)


def _cond_fused_bytes(fe: Any, params: dict[str, Any], aval_of: Callable[[Any], Any]) -> int:
    """The bytes an element-wise cond moves as XLA runs it: each branch
    fused into loops that read the operands once (twice where the branch
    also reduces them to a scalar) and write the results; its equations'
    own bytes count every intermediate."""
    comps, reduced = params["components"], set(params.get("reduced", ()))
    ins = fe.invars[1:]
    read = sum(_nbytes(aval_of(x)) * (2 if comps[j] in reduced else 1) for j, x in enumerate(ins))
    return read + sum(_nbytes(aval_of(o)) for o in fe.outvars)


def _nbytes(aval: Any, shape: tuple[int, ...] | None = None) -> int:
    try:
        return packed_bytes(math.prod(_shape(aval) if shape is None else shape),
                            _dtype_name(aval))
    except Exception:
        return 0


def _sized(aval: Any) -> tuple[tuple[int, ...], int]:
    shape = _shape(aval)
    return shape, _nbytes(aval, shape)


def _argnames(fn: Callable, nargs: int) -> list[str]:
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        params = []
    names = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return (names + [f"arg{i}" for i in range(len(names), nargs)])[:nargs]


def _body_digest(eqn: Any) -> str:
    h = hashlib.sha256()
    for k, j in sub_jaxprs(eqn):
        h.update(k.encode())
        h.update(str(j).encode())
    return h.hexdigest()[:16]


def trace(fn: Callable, *args: Any, batch_argnums: Sequence[int] = (1,),
          name: str | None = None, warn: bool = True) -> Graph:
    """Trace ``fn(*args)`` into a :class:`Graph` without running it.  With
    ``warn``, what the trace could not cost exactly (``Graph.warnings``) is
    also issued as Python warnings; a caller that traces the same step again
    (per micro-batch count) passes False and reports them once itself."""
    graph = _traced(fn, args, batch_argnums, name)[3]
    if warn:
        issue_warnings(graph)
    return graph


def issue_warnings(graph: Graph) -> None:
    """``graph.warnings`` as Python warnings, each once."""
    for w in graph.warnings:
        warn(f"meshplan: {w}")


def trace_both(fn: Callable, *args: Any, batch_argnums: Sequence[int] = (1,),
               name: str | None = None) -> tuple[Graph, TracedStep]:
    """``fn(*args)`` traced once: its :class:`Graph` for the planner and the
    :class:`~meshplan.traced.TracedStep` a one-stage runtime runs (its graph
    is that Graph).  Issues no warnings (:func:`issue_warnings`)."""
    closed, out_shape, flat, graph = _traced(fn, args, batch_argnums, name)
    bn = graph.batch_argnums
    flat, graph = _mark_whole_batch(fn, args, bn, closed, out_shape, flat, graph)
    return graph, _traced_step(closed, out_shape, flat, tuple(args), bn, graph=graph)


def _mark_whole_batch(fn: Callable, args: Sequence[Any], batch_argnums: tuple[int, ...],
                      closed: Any, out_shape: Any, flat: FlatJaxpr,
                      graph: Graph) -> tuple[FlatJaxpr, Graph]:
    """A step without gradient markers traced at its whole batch, with the
    marker its micro-batches get (:func:`~meshplan.trace.micro.mark_full_batch`,
    probed at twice the batch): the planner's Graph and the runtime's trace
    of one micro-batch agree."""
    probe = tuple(jax.tree_util.tree_map(lambda x: _grow(abstract_leaf(x), 2), a)
                  if i in batch_argnums else a for i, a in enumerate(args))
    return mark_full_batch(
        fn, args, probe, flat, graph,
        lambda f: graph_from_jaxpr(closed, args, out_shape, batch_argnums=batch_argnums,
                                   name=graph.name, argnames=_argnames(fn, len(args)), flat=f))


@with_relaxed_gc
def _traced(fn: Callable, args: Sequence[Any], batch_argnums: Sequence[int],
            name: str | None) -> tuple[Any, Any, FlatJaxpr, Graph]:
    """``(closed jaxpr, output shapes, flat stream, Graph)`` of ``fn(*args)``."""
    batch_argnums = tuple(int(b) for b in batch_argnums)
    for b in batch_argnums:
        if not 0 <= b < len(args):
            raise TraceError(f"batch_argnums={batch_argnums} names argument {b}, but the function "
                             f"was given {len(args)} argument(s); pass batch_argnums=() if there is no batch")
    closed, out_shape = jaxpr_of(fn, args)
    flat = flatten(closed)
    graph = graph_from_jaxpr(closed, args, out_shape, batch_argnums=batch_argnums,
                             name=name or getattr(fn, "__name__", "fn"),
                             argnames=_argnames(fn, len(args)), flat=flat)
    return closed, out_shape, flat, graph


def graph_from_jaxpr(closed: Any, args: Sequence[Any], out_shape: Any, *,
                     batch_argnums: tuple[int, ...], name: str,
                     argnames: Sequence[str], flat: FlatJaxpr | None = None) -> Graph:
    """The Graph of ``closed`` (``flat``: its :func:`flatten`, if already made)."""
    if flat is None:
        flat = flatten(closed)
    warnings: set[str] = set()
    tensors: dict[int, Tensor] = {}
    const_set = set(flat.constvars)
    in_set = set(flat.invars)
    for i, aval in flat.avals.items():
        kind = INPUT if i in in_set else CONST if i in const_set else INTERMEDIATE
        tensors[i] = Tensor(i, _shape(aval), _dtype_name(aval), kind)
    next_id = len(tensors)

    def tid(x: int | Lit) -> int:
        nonlocal next_id
        if isinstance(x, int):
            return x
        t = Tensor(next_id, _shape(x.aval), _dtype_name(x.aval), LITERAL)
        tensors[next_id] = t
        next_id += 1
        return t.id

    # (each value's shape and bytes once: a value is read by several equations)
    known = {i: (t.shape, _nbytes(flat.avals[i], t.shape)) for i, t in tensors.items()}

    def sized(x: int | Lit) -> tuple[tuple[int, ...], int]:
        return known[x] if isinstance(x, int) else _sized(x.aval)

    def aval_of(i: int | Lit) -> Any:
        return flat.avals[i] if isinstance(i, int) else i.aval

    nodes: list[Node] = []
    for fe in flat.eqns:
        eqn = fe.eqn
        prim = eqn.primitive.name
        in_ids = tuple(tid(x) for x in fe.invars)
        f, b = _eqn_cost(fe, aval_of, warnings, sized)
        params = _node_params(eqn)
        repeat = 1
        if prim in COMPOSITES:
            repeat = _composite_cost(eqn, set())[2]
            params = params + (("body", _body_digest(eqn)),)
            loop = loop_description(eqn, _node_params)
            if loop is not None:    # (what the ILP's loop rule reads)
                params = params + (("loop", loop),)
            if prim == "while":     # (its steps, as a scan's ``length``: 1 if unknown)
                params = params + (("trip_count", repeat),)
        if prim == "cond":      # (branches that work element by element)
            comps = cond_params(eqn)
            params = params + comps
            if comps:
                b = min(b, _cond_fused_bytes(fe, dict(comps), aval_of))
        if prim in ("dot_general", "conv_general_dilated") \
                and jax.config.jax_default_matmul_precision is not None:
            # the precision a matmul without its own runs at (ilp.strategies.node_dtype)
            params = params + (("config_precision",
                                str(jax.config.jax_default_matmul_precision)),)
        if prim == "random_bits":
            params = params + tuple(random_generator([aval_of(i) for i in fe.invars]).items())
        nodes.append(Node(id=len(nodes), primitive=prim, inputs=in_ids, outputs=fe.outvars,
                          params=params, flops=f, bytes_accessed=b, remat=fe.remat,
                          repeat=repeat, scope=fe.scope))
    out_ids = tuple(tid(x) for x in flat.outvars)

    # ---- inputs: one per leaf of args, with role and path ----------------
    leaves_with_path = jax.tree_util.tree_flatten_with_path(tuple(args))[0]
    if len(leaves_with_path) != len(flat.invars):
        raise TraceError(f"internal: {len(leaves_with_path)} argument leaves but "
                         f"{len(flat.invars)} jaxpr inputs")
    inputs = []
    for (path, _leaf), t in zip(leaves_with_path, flat.invars):
        argnum = int(path[0].idx)
        sub = jax.tree_util.keystr(tuple(path[1:]))
        role = infer_role(argnames[argnum], sub, tensors[t].dtype, argnum in batch_argnums)
        inputs.append(GraphInput(tensor=t, argnum=argnum, path=sub, role=role))

    outputs = _link_outputs(out_shape, out_ids, args, inputs, batch_argnums, nodes)
    tensor_tuple = tuple(tensors[i] for i in range(next_id))
    g = Graph(name=name, tensors=tensor_tuple, nodes=tuple(nodes), inputs=tuple(inputs),
              outputs=outputs, batch_argnums=batch_argnums, warnings=tuple(sorted(warnings)))
    return _with_fingerprint(_update_only_state(g))


def _update_only_state(g: Graph) -> Graph:
    """``g`` with the parameters by name that the forward does not read
    (optimizer moments under positional paths, as keras's
    ``optimizer.variables`` are; an EMA of the weights) taken as optimizer
    state: no gradient, read by the update alone.  Only where the forward
    reads some parameter (a step with no loss has no forward to go by)."""
    fwd = forward_nodes(g)
    read = {t for n, f in zip(g.nodes, fwd) if f for t in n.inputs}
    params = [i for i in g.inputs if i.role == PARAM]
    if not any(i.tensor in read for i in params) or all(i.tensor in read for i in params):
        return g
    return dataclasses.replace(g, inputs=tuple(
        dataclasses.replace(i, role=OPT_STATE) if i.role == PARAM and i.tensor not in read else i
        for i in g.inputs))


def _link_outputs(out_shape: Any, out_ids: Sequence[int], args: Sequence[Any],
                  inputs: Sequence[GraphInput], batch_argnums: tuple[int, ...],
                  nodes: Sequence[Node]) -> tuple[GraphOutput, ...]:
    """Pair each output leaf with the input it replaces.

    An element of a tuple output whose pytree structure, shapes and dtypes
    (as jax.jit takes them: a float64 NumPy array is a float32 one unless
    x64 is on) equal those of a non-batch argument, and some leaf of which
    is computed from that argument's, is that argument's new value (the
    ``new_state`` of ``(new_state, metrics)``; not the loss beside a
    learning rate passed as a scalar, which it is not computed from).  An
    element matching no whole argument may be the new value of a part of
    one, by the same test on the leaves' paths below it (``new_params`` and
    ``new_opt`` of ``(new_params, new_opt, loss)`` for a state
    ``{"params": ..., "opt": ...}``); larger elements are paired first, and
    a single scalar never so (a loss is no step count's new value).
    """
    out_leaves = jax.tree_util.tree_flatten_with_path(out_shape)[0]
    paths = [jax.tree_util.keystr(p) for p, _ in out_leaves]
    updates: list[int | None] = [None] * len(out_leaves)
    parts = out_shape if isinstance(out_shape, (tuple, list)) else (out_shape,)
    input_index = {(i.argnum, i.path): k for k, i in enumerate(inputs)}
    producer = {t: k for k, n in enumerate(nodes) for t in n.outputs}
    starts = list(itertools.accumulate((len(jax.tree_util.tree_leaves(p)) for p in parts),
                                       initial=0))
    used: set[int] = set()          # input indices already paired

    def pair(i: int, found: Iterable[tuple[int, list[str]]]) -> bool:
        offset, n = starts[i], starts[i + 1] - starts[i]
        found = list(itertools.islice(found, MAX_ALIKE + 1))
        if len(found) > MAX_ALIKE:
            return False    # (a part of many alike: none told apart, and each is a search)
        fits = []
        for a, leaf_paths in found:
            ids = [input_index[(a, p)] for p in leaf_paths]
            if not used.intersection(ids) and (not n or any(
                    _made_from(nodes, producer, inputs[k].tensor, out_ids[offset + j])
                    for j, k in enumerate(ids))):
                fits.append(ids)
        if not fits:
            return False
        # (of several alike, a new parameter is made from its momentum too:
        # the nearest is the value it replaces, w - lr * m from w)
        ids = min(fits, key=lambda ids: [
            _distance(nodes, producer, inputs[k].tensor, out_ids[offset + j])
            for j, k in enumerate(ids[:4])]) if len(fits) > 1 else fits[0]
        used.update(ids)
        updates[offset:offset + n] = ids
        return True

    whole = [i for i, part in enumerate(parts) if pair(i, _whole_args(part, args, batch_argnums))]

    def size(i: int) -> int:    # (one scalar counts as none)
        leaves = jax.tree_util.tree_leaves(parts[i])
        return 0 if len(leaves) == 1 and not np.shape(leaves[0]) else len(leaves)
    for i in sorted((i for i in range(len(parts)) if i not in whole and size(i)), key=size,
                    reverse=True):
        pair(i, _arg_parts(parts[i], args, batch_argnums))
    return tuple(GraphOutput(tensor=t, path=p, updates=u)
                 for t, p, u in zip(out_ids, paths, updates))


MAX_ALIKE = 16      # arguments, or parts of them, an output may be told among


def _whole_args(part: Any, args: Sequence[Any], batch_argnums: tuple[int, ...]
                ) -> Iterator[tuple[int, list[str]]]:
    """The non-batch arguments of ``part``'s structure, shapes and dtypes:
    (argnum, their leaves' paths)."""
    sig = _jit_signature(part)
    for a, arg in enumerate(args):
        if a not in batch_argnums and _jit_signature(arg) == sig:
            yield a, [jax.tree_util.keystr(p)
                      for p, _ in jax.tree_util.tree_flatten_with_path(arg)[0]]


def _arg_parts(part: Any, args: Sequence[Any], batch_argnums: tuple[int, ...]
               ) -> Iterator[tuple[int, list[str]]]:
    """The parts of non-batch arguments whose leaves lie at ``part``'s own
    paths below them, of its shapes and dtypes: (argnum, their paths)."""
    want = [(jax.tree_util.keystr(p), _leaf_signature(x))
            for p, x in jax.tree_util.tree_flatten_with_path(part)[0]]
    for a, arg in enumerate(args):
        if a in batch_argnums:
            continue
        below: dict[tuple, list] = {}       # prefix -> the leaves under it, in order
        for p, x in jax.tree_util.tree_flatten_with_path(arg)[0]:
            for d in range(1, len(p) + 1):
                below.setdefault(p[:d], []).append((p, x))
        for pre, leaves in below.items():
            if len(leaves) == len(want) and [
                    (jax.tree_util.keystr(p[len(pre):]), _leaf_signature(x))
                    for p, x in leaves] == want:
                yield a, [jax.tree_util.keystr(p) for p, _ in leaves]


def _leaf_signature(x: Any) -> tuple[Any, ...]:
    return tuple(np.shape(x)), str(jit_dtype(x))


def _jit_signature(tree: Any) -> Any:
    """Structure, shapes and dtypes as jax.jit takes the leaves."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return treedef, tuple(_leaf_signature(x) for x in leaves)


def _distance(nodes: Sequence[Node], producer: dict[int, int], src: int, dst: int) -> float:
    """The fewest operations from tensor ``src`` to tensor ``dst`` (inf if
    ``dst`` is not computed from it)."""
    seen, level, d = {dst}, [dst], 0
    while level:
        if src in level:
            return d
        nxt = []
        for t in level:
            k = producer.get(t)
            if k is not None:
                nxt.extend(x for x in nodes[k].inputs if isinstance(x, int) and x not in seen)
                seen.update(nxt)
        level, d = nxt, d + 1
    return math.inf


def _made_from(nodes: Sequence[Node], producer: dict[int, int], src: int, dst: int) -> bool:
    """Whether tensor ``dst`` is tensor ``src`` or computed from it."""
    seen, todo = set(), [dst]
    while todo:
        t = todo.pop()
        if t == src:
            return True
        if t in seen:
            continue
        seen.add(t)
        k = producer.get(t)
        if k is not None:
            todo.extend(x for x in nodes[k].inputs if isinstance(x, int))
    return False


def _with_fingerprint(g: Graph) -> Graph:
    # (json writes tuples as lists: the params go in as they are)
    data = {
        "tensors": [[t.shape, t.dtype, t.kind] for t in g.tensors],
        "nodes": [[n.primitive, n.inputs, n.outputs, n.params, n.remat] for n in g.nodes],
        "inputs": [[i.tensor, i.argnum, i.path, i.role] for i in g.inputs],
        "outputs": [[o.tensor, o.path, o.updates] for o in g.outputs],
        "batch_argnums": list(g.batch_argnums),
    }
    text = json.dumps(data, sort_keys=True, separators=(",", ":"), default=str)
    import dataclasses
    return dataclasses.replace(g, fingerprint=hashlib.sha256(text.encode()).hexdigest())


# --------------------------------------------------------------------------
# the step as the runtime runs it
# --------------------------------------------------------------------------

@with_relaxed_gc
def trace_for_run(fn: Callable, args: Sequence[Any], batch_argnums: Sequence[int],
                  micro_batches: int | None = None, *, scaling: bool = True) -> TracedStep:
    """``fn(*args)`` traced for the runtime (:class:`~meshplan.traced.TracedStep`).

    Without ``micro_batches`` (one-stage plans) the arguments are traced as
    given (arrays or ``jax.ShapeDtypeStruct``) and nothing more is made (no
    Graph: the one-stage runtime needs none, and a step whose values include
    typed PRNG keys has none).  With it (pipeline plans) the batch arguments
    must agree on their dimension 0, which must divide into
    ``micro_batches``; the step is traced at the micro-batch shapes, and its
    Graph, forward equations and the outputs of the whole batch are recorded,
    and (``scaling``) how its values scale with the batch
    (:mod:`meshplan.trace.scaling`: how the micro-batches combine)."""
    batch_argnums = tuple(int(b) for b in batch_argnums)
    args = tuple(args)
    if micro_batches is None:
        closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
        return _traced_step(closed, out_shape, flatten(closed), args, batch_argnums)
    m = int(micro_batches)
    args = jax.tree_util.tree_map(abstract_leaf, args)
    mb = _micro_batch_size(args, batch_argnums, m)
    micro = tuple(jax.tree_util.tree_map(lambda x: _shrink(x, m), a) if i in batch_argnums
                  else a for i, a in enumerate(args))
    closed, out_shape, flat, graph, draws, scaling = _micro(
        fn, args, micro, batch_argnums, getattr(fn, "__name__", "fn"), m, scaling=scaling and m > 1)
    step_out = jax.eval_shape(fn, *args)
    return _traced_step(closed, out_shape, flat, args, batch_argnums, graph=graph,
                        forward=tuple(forward_nodes(graph)), step_out=step_out,
                        micro_batches=m, micro_batch_size=mb,
                        concat=_concat_outputs(out_shape, step_out, flat, m,
                                               _batch_ids(flat, args, batch_argnums)),
                        draws=draws[0], draw_eqns=draws[1], scaling=scaling)


def trace_micro(fn: Callable, args: Sequence[Any], B: int, batch_argnums: Sequence[int],
                name: str | None = None) -> Graph:
    """The Graph of ``fn`` with the batch of ``args`` cut into ``B``
    micro-batches, as the pipeline runtime runs it (the planner's
    ``retrace(B)``): the same trace as :func:`trace_for_run`, gradient
    marker and random draws over the batch included
    (:mod:`meshplan.trace.micro`)."""
    batch_argnums = tuple(int(b) for b in batch_argnums)
    args = tuple(jax.tree_util.tree_map(abstract_leaf, tuple(args)))
    micro = tuple(jax.tree_util.tree_map(lambda x: _shrink(x, B), a) if i in batch_argnums
                  else a for i, a in enumerate(args))
    return _micro(fn, args, micro, batch_argnums, name or getattr(fn, "__name__", "fn"), B)[3]


@with_relaxed_gc
def _micro(fn: Callable, args: tuple[Any, ...], micro: tuple[Any, ...],
           batch_argnums: tuple[int, ...], name: str, m: int,
           scaling: bool = False) -> tuple[Any, ...]:
    def build(closed: Any, a: Sequence[Any], out_shape: Any, flat: FlatJaxpr) -> Graph:
        return graph_from_jaxpr(closed, a, out_shape, batch_argnums=batch_argnums, name=name,
                                argnames=_argnames(fn, len(a)), flat=flat)
    out = micro_step(fn, args, micro, build, infer=m > 1, scaling=m if scaling else 0,
                     suspects=lambda: _unlisted_batch_args(fn, args, batch_argnums))
    if m > 1:
        return out
    closed, out_shape, flat, graph, draws, scaled = out
    flat, graph = _mark_whole_batch(fn, micro, batch_argnums, closed, out_shape, flat, graph)
    return closed, out_shape, flat, graph, draws, scaled


def _traced_step(closed: Any, out_shape: Any, flat: FlatJaxpr, args: tuple[Any, ...],
                 batch_argnums: tuple[int, ...], *, graph: Graph | None = None,
                 forward: tuple[bool, ...] = (), step_out: Any = None,
                 micro_batches: int | None = None, micro_batch_size: int = 0,
                 concat: tuple[int, ...] = (), draws: tuple[Any, ...] = (),
                 draw_eqns: tuple[Any, ...] = (), scaling: Any = None) -> TracedStep:
    leaves_p, arg_tree = jax.tree_util.tree_flatten_with_path(args)
    arg_paths = tuple((int(path[0].idx), jax.tree_util.keystr(tuple(path[1:])))
                      for path, _ in leaves_p)
    step_out = out_shape if step_out is None else step_out
    return TracedStep(closed=closed, flat=flat, graph=graph, arg_tree=arg_tree,
                      arg_paths=arg_paths, batch_argnums=batch_argnums,
                      out_tree=jax.tree_util.tree_structure(out_shape), out_shape=out_shape,
                      step_out_avals=tuple((tuple(l.shape), l.dtype)
                                           for l in jax.tree_util.tree_leaves(step_out)),
                      forward=forward, micro_batches=micro_batches,
                      micro_batch_size=micro_batch_size, concat_outputs=concat,
                      batch_draws=draws, draw_eqns=draw_eqns, scaling=scaling)


def abstract_leaf(x: Any) -> Any:
    """``x`` as a ``jax.ShapeDtypeStruct``, weakly typed where jax.jit would
    trace it so (a Python scalar, a weakly typed array): the dtype promotion,
    and so the step's equations, depend on it."""
    # (not getattr's default: np.asarray of a typed PRNG key raises)
    if not hasattr(x, "dtype"):
        x = jax.numpy.asarray(x)
    return jax.ShapeDtypeStruct(np.shape(x), x.dtype, weak_type=_weak(x))


def _weak(x: Any) -> bool:
    return bool(getattr(x, "weak_type", False))


def _shrink(x: Any, m: int) -> Any:
    if not getattr(x, "shape", ()):
        return x
    return jax.ShapeDtypeStruct((x.shape[0] // m,) + tuple(x.shape[1:]), x.dtype,
                                weak_type=_weak(x))


def _grow(x: Any, k: int) -> Any:
    if not getattr(x, "shape", ()):
        return x
    return jax.ShapeDtypeStruct((x.shape[0] * k,) + tuple(x.shape[1:]), x.dtype,
                                weak_type=_weak(x))


def _unlisted_batch_args(fn: Callable, args: tuple[Any, ...],
                         batch_argnums: tuple[int, ...]) -> str:
    """The arguments outside ``batch_argnums`` with a leaf whose dimension 0
    is the batch's size (per-example labels or weights passed on their own,
    the commonest cause of a step that does not trace at micro-batch size),
    as the end of that error's hint; "" if none."""
    rows = {int(l.shape[0]) for a in batch_argnums if a < len(args)
            for l in jax.tree_util.tree_leaves(args[a]) if getattr(l, "shape", ())}
    if len(rows) != 1:
        return ""
    names = _argnames(fn, len(args))
    found = [i for i, a in enumerate(args) if i not in batch_argnums
             and any(tuple(getattr(l, "shape", ()))[:1] == tuple(rows)
                     for l in jax.tree_util.tree_leaves(a))]
    if not found:
        return ""
    which = ", ".join(f"{i} ({names[i]})" for i in found)
    return (f" Argument(s) {which} have dimension 0 of the batch's size {rows.pop()} but are "
            f"not in batch_argnums={batch_argnums}: if they are per-example, pass "
            f"batch_argnums={tuple(sorted({*batch_argnums, *found}))}.")


def _micro_batch_size(args: tuple[Any, ...], batch_argnums: tuple[int, ...], m: int) -> int:
    """Rows of one micro-batch (0 without batch arguments); a batch that does
    not split into ``m`` micro-batches is refused."""
    full = batch_rows([(int(l.shape[0]), f"argument {a}{jax.tree_util.keystr(path)}")
                       for a in batch_argnums if a < len(args)
                       for path, l in jax.tree_util.tree_flatten_with_path(args[a])[0]
                       if l.shape])
    if full is None:
        return 0
    if full % m:
        raise MeshplanError(f"the batch size {full} does not split into {m} micro-batches; "
                            f"use a batch size divisible by {m}")
    return full // m


def _concat_outputs(micro_out: Any, step_out: Any, flat: FlatJaxpr, m: int,
                    batch_ids: set[int]) -> tuple[int, ...]:
    """Output ids whose dimension 0 is the batch; another output whose shape
    depends on the batch is refused."""
    concat = []
    bdep = computed_from(flat, batch_ids)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(step_out)[0]]
    for k, (a, b, x) in enumerate(zip(jax.tree_util.tree_leaves(micro_out),
                                      jax.tree_util.tree_leaves(step_out), flat.outvars)):
        if tuple(a.shape) != tuple(b.shape):
            if not (a.shape and b.shape and a.shape[0] * m == b.shape[0]
                    and a.shape[1:] == b.shape[1:]):
                raise MeshplanError(f"output {paths[k] or k} has shape {tuple(b.shape)} for the "
                                    f"batch but {tuple(a.shape)} for a micro-batch; only outputs "
                                    "whose dimension 0 is the batch can be put together from "
                                    "micro-batches: return it with the batch first (or plan "
                                    "with num_micro_batches=1)")
            if not isinstance(x, int) or x not in bdep:
                # (its micro-batch pieces would not make it up: an arange over
                # the batch is not two aranges over half of it)
                raise MeshplanError(
                    f"output {paths[k] or k} has the batch's shape {tuple(b.shape)} but does not depend "
                    "on the batch's values, so it cannot be put together from micro-batches; "
                    "compute it outside the step (or plan with num_micro_batches=1)")
            concat.append(x)
    return tuple(concat)


def _batch_ids(flat: FlatJaxpr, args: tuple[Any, ...], batch_argnums: tuple[int, ...]
               ) -> set[int]:
    """The flat input ids of the batch arguments' leaves."""
    leaves = jax.tree_util.tree_flatten_with_path(args)[0]
    return {i for i, (path, _) in zip(flat.invars, leaves) if int(path[0].idx) in batch_argnums}
