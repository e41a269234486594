"""The Graph IR: a train step as a flat list of operators over tensors.

The tracer (:mod:`meshplan.trace`) builds a :class:`Graph` from a jaxpr by
inlining nested calls (``jit``, ``custom_jvp_call``, ``custom_vjp_call``,
``remat2``) and keeping control flow (``scan``, ``while``, ``cond``) as
composite nodes whose cost covers every iteration.  Everything here is frozen
data: passes read a Graph, never modify it.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections import Counter
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import numpy as np

# Roles of a graph input.
PARAM = "param"          # trainable parameter
OPT_STATE = "opt_state"  # optimizer state (Adam moments, step count)
BATCH = "batch"          # the data of one step: split along dim 0
STATE = "state"          # other carried state (batch-norm statistics, counters)

# Kinds of tensor.
INPUT = "input"
INTERMEDIATE = "intermediate"
LITERAL = "literal"
CONST = "const"


@functools.lru_cache(maxsize=None)
def dtype_bits(dtype: str) -> int:
    """Bits per element of a dtype name ("float32", "bfloat16", "int4", ...)."""
    if dtype in ("bfloat16",):
        return 16
    if dtype.startswith("float8"):
        return 8
    if dtype.startswith("float4") or dtype in ("int4", "uint4"):
        return 4        # (XLA packs two to a byte)
    if dtype in ("int2", "uint2"):
        return 2
    if dtype == "key<fry>" or dtype.startswith("key"):
        return 64
    try:
        return 8 * int(np.dtype(dtype).itemsize)
    except TypeError:
        return 32


def packed_bytes(elements: int, dtype: str) -> int:
    """Bytes of ``elements`` values of ``dtype`` as XLA stores them."""
    return (elements * dtype_bits(dtype) + 7) // 8


@dataclass(frozen=True)
class Tensor:
    id: int
    shape: tuple[int, ...]
    dtype: str
    kind: str = INTERMEDIATE

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return packed_bytes(self.size, self.dtype)

    def __str__(self) -> str:
        return f"t{self.id}:{self.dtype}[{','.join(map(str, self.shape))}]"


@dataclass(frozen=True)
class Node:
    """One operator.  ``params`` are the primitive's parameters reduced to
    plain, hashable Python values (tuples, ints, strings)."""
    id: int
    primitive: str
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    params: tuple[tuple[str, Any], ...] = ()
    flops: float = 0.0
    bytes_accessed: int = 0
    remat: bool = False          # traced under jax.checkpoint / remat
    repeat: int = 1              # iterations folded into a composite (scan length)
    scope: str = ""              # jax name stack, for readable reports
    # For composite nodes: the node's own body cost per iteration was
    # multiplied by ``repeat`` into ``flops``/``bytes_accessed``.

    def renumbered(self, new_id: int, inputs: tuple[int, ...] | None = None) -> "Node":
        """This node with another id (a subgraph numbers its nodes afresh),
        and other ``inputs`` if given.  (``dataclasses.replace`` costs ten
        times more, and passes over a 96-block step copy tens of thousands.)"""
        n = object.__new__(Node)
        n.__dict__.update(self.__dict__)
        n.__dict__["id"] = new_id
        if inputs is not None:
            n.__dict__["inputs"] = inputs
        return n

    def param(self, name: str, default: Any = None) -> Any:
        for k, v in self.params:
            if k == name:
                return v
        return default

    def __str__(self) -> str:
        ins = ",".join(f"t{i}" for i in self.inputs)
        outs = ",".join(f"t{i}" for i in self.outputs)
        extra = f" x{self.repeat}" if self.repeat != 1 else ""
        remat = " remat" if self.remat else ""
        return f"n{self.id} {outs} = {self.primitive}({ins}){extra}{remat}  flops={self.flops:.3g}"


def arithmetic_flops(node: Node) -> float:
    """The FLOPs of ``node`` a TFLOP/s figure counts: a random draw's
    ``flops`` are its generator's integer operations (what prices it), not
    arithmetic on the model's values."""
    return 0.0 if node.primitive == "random_bits" else node.flops


@dataclass(frozen=True)
class GraphInput:
    tensor: int
    argnum: int
    path: str        # jax.tree_util.keystr of the leaf inside its argument
    role: str
    # a layer subgraph's boundary value: its dimension that carries the
    # micro-batch's rows (see batch_dims_between), None if none or unknown
    batch_dim: int | None = None


@dataclass(frozen=True)
class GraphOutput:
    tensor: int
    path: str                   # keystr of the leaf inside the function's output
    updates: int | None = None  # index into Graph.inputs of the input this output replaces


@dataclass(frozen=True)
class Graph:
    name: str
    tensors: tuple[Tensor, ...]
    nodes: tuple[Node, ...]
    inputs: tuple[GraphInput, ...]
    outputs: tuple[GraphOutput, ...]
    batch_argnums: tuple[int, ...] = ()
    fingerprint: str = ""
    warnings: tuple[str, ...] = ()
    # (value, its dimension holding the micro-batch's rows): a layer
    # subgraph's values at several micro-batches, where known
    # (batch_dims_between); empty: not known
    batch_dims: tuple[tuple[int, int], ...] = ()
    # indices into ``inputs`` of the arguments the caller keeps (not
    # donated, as jax.jit's ``donate_argnums`` says): an input's new value
    # then needs a buffer of its own (cost_model.memory.liveness)
    undonated: frozenset[int] = frozenset()

    # ---- derived views (computed once, cached on the instance) ----------
    @functools.cached_property
    def producer(self) -> dict[int, int]:
        """tensor id -> id of the node that produces it."""
        return {t: n.id for n in self.nodes for t in n.outputs}

    @functools.cached_property
    def consumers(self) -> dict[int, tuple[int, ...]]:
        """tensor id -> ids of the nodes that read it (in order, no repeats)."""
        acc: dict[int, list[int]] = {}
        for n in self.nodes:
            for t in dict.fromkeys(n.inputs):
                acc.setdefault(t, []).append(n.id)
        return {t: tuple(v) for t, v in acc.items()}

    @functools.cached_property
    def output_tensors(self) -> frozenset[int]:
        """The values the step returns."""
        return frozenset(o.tensor for o in self.outputs)

    @functools.cached_property
    def kept_updates(self) -> dict[int, int]:
        """The new value of each argument the caller keeps (``undonated``)
        -> that argument's tensor: a buffer of its own, in the argument's
        layout (the step returns it so), from where it is made to the end."""
        return {o.tensor: self.inputs[o.updates].tensor for o in self.outputs
                if o.updates is not None and o.updates in self.undonated}

    def in_place(self) -> "Graph":
        """This Graph with every update taking over its argument's buffer (a
        layer's own plan: its stage counts the kept new values)."""
        return dataclasses.replace(self, undonated=frozenset()) if self.undonated else self

    def kept_like(self, step: "Graph") -> "Graph":
        """This Graph (``step`` traced again: another micro-batch count)
        with the arguments ``step``'s caller keeps, matched by leaf."""
        if not step.undonated:
            return self
        kept = {(step.inputs[k].argnum, step.inputs[k].path) for k in step.undonated}
        return dataclasses.replace(self, undonated=frozenset(
            k for k, i in enumerate(self.inputs) if (i.argnum, i.path) in kept))

    @functools.cached_property
    def output_of_tensor(self) -> dict[int, GraphOutput]:
        """tensor id -> the output returning it (the last, if several do)."""
        return {o.tensor: o for o in self.outputs}

    @functools.cached_property
    def resident_tensors(self) -> frozenset[int]:
        """Parameters, optimizer state and other state, constants and
        literals: values in memory for the whole step, never an activation."""
        return frozenset(i.tensor for i in self.inputs if i.role in (PARAM, OPT_STATE, STATE)) \
            | self.constant_tensors | self.folded_tensors

    @functools.cached_property
    def constant_tensors(self) -> frozenset[int]:
        """Intermediates that depend on no input of the step: values computed
        from literals and constants alone (causal masks, iotas, filled arrays)."""
        return frozenset(t for nid in self.constant_nodes for t in self.nodes[nid].outputs)

    @functools.cached_property
    def folded_tensors(self) -> frozenset[int]:
        """Constants and literals of the step (tensors of kind CONST or LITERAL)."""
        return frozenset(t.id for t in self.tensors if t is not None and t.kind in (CONST, LITERAL))

    @functools.cached_property
    def constant_nodes(self) -> frozenset[int]:
        """The nodes that make :attr:`constant_tensors` (their operands are
        literals, constants or other constant values)."""
        nodes: set[int] = set()
        made: set[int] = set()
        for n in self.nodes:
            if all(self.tensors[t].kind not in (INPUT, INTERMEDIATE) or t in made
                   for t in n.inputs):
                nodes.add(n.id)
                made.update(n.outputs)
        return frozenset(nodes)

    @functools.cached_property
    def batch_rows(self) -> frozenset[int]:
        """The rows of the batch arguments' leaves (one size where the step
        is given one batch)."""
        return frozenset(self.tensors[i.tensor].shape[i.batch_dim or 0] for i in self.inputs
                         if i.role == BATCH and self.tensors[i.tensor].shape)

    @functools.cached_property
    def batch_tensors(self) -> frozenset[int]:
        """The values computed from the batch: its arguments' leaves (a layer
        subgraph's boundary values that carry rows) and what is made from them."""
        made = {i.tensor for i in self.inputs if i.role == BATCH or i.batch_dim is not None}
        for n in self.nodes:
            if any(t in made for t in n.inputs):
                made.update(n.outputs)
        return frozenset(made)

    @functools.cached_property
    def rows_dim(self) -> dict[int, int] | None:
        """value -> its dimension holding the micro-batch's rows; None where
        not known (:attr:`batch_dims` empty)."""
        return dict(self.batch_dims) if self.batch_dims else None

    @functools.cached_property
    def input_of_tensor(self) -> dict[int, GraphInput]:
        return {i.tensor: i for i in self.inputs}

    def tensor(self, tid: int) -> Tensor:
        return self.tensors[tid]

    # ---- summary figures -------------------------------------------------
    @property
    def total_flops(self) -> float:
        """The step's arithmetic (model FLOPs): a random draw's integer
        operations (what its node's ``flops`` prices) are not counted."""
        return float(sum(arithmetic_flops(n) for n in self.nodes))

    def flops_by_primitive(self) -> dict[str, float]:
        acc: Counter = Counter()
        for n in self.nodes:
            acc[n.primitive] += n.flops
        return dict(acc)

    @property
    def matmul_flops(self) -> float:
        by = self.flops_by_primitive()
        return float(by.get("dot_general", 0.0) + by.get("conv_general_dilated", 0.0))

    def role_bytes(self, role: str) -> int:
        return sum(self.tensors[i.tensor].nbytes for i in self.inputs if i.role == role)

    def role_count(self, role: str) -> int:
        return sum(self.tensors[i.tensor].size for i in self.inputs if i.role == role)

    @property
    def num_params(self) -> int:
        return self.role_count(PARAM)

    @property
    def param_bytes(self) -> int:
        return self.role_bytes(PARAM)

    @property
    def activation_bytes(self) -> int:
        """Bytes of all intermediate tensors (an upper bound on activations:
        no liveness applied here; the cost model computes real peaks)."""
        return sum(t.nbytes for t in self.tensors if t.kind == INTERMEDIATE)

    def primitive_counts(self) -> dict[str, int]:
        return dict(Counter(n.primitive for n in self.nodes).most_common())

    def summary(self, top: int = 10) -> dict[str, Any]:
        """The figures ``meshplan inspect`` prints, as plain JSON data."""
        biggest = sorted(self.nodes, key=lambda n: -n.flops)[:top]
        return {
            "name": self.name,
            "fingerprint": self.fingerprint,
            "num_ops": len(self.nodes),
            "num_tensors": len(self.tensors),
            "total_flops": self.total_flops,
            "matmul_flops": self.matmul_flops,
            "num_params": self.num_params,
            "param_bytes": self.param_bytes,
            "opt_state_bytes": self.role_bytes(OPT_STATE),
            "batch_bytes": self.role_bytes(BATCH),
            "state_bytes": self.role_bytes(STATE),
            "activation_bytes": self.activation_bytes,
            "ops_by_primitive": self.primitive_counts(),
            "flops_by_primitive": {k: v for k, v in sorted(
                self.flops_by_primitive().items(), key=lambda kv: -kv[1]) if v},
            "biggest_ops": [
                {"node": n.id, "primitive": n.primitive, "flops": n.flops,
                 "output_shapes": [list(self.tensors[t].shape) for t in n.outputs],
                 "scope": n.scope}
                for n in biggest],
            "warnings": list(self.warnings),
        }

    def __str__(self) -> str:
        s = self.summary(top=5)
        lines = [f"Graph {self.name}  fingerprint {self.fingerprint[:16]}",
                 f"  {s['num_ops']} ops, {s['num_tensors']} tensors, "
                 f"{s['total_flops']:.4g} FLOPs/step, {s['num_params']:,} params "
                 f"({s['param_bytes'] / 2**20:.1f} MiB)"]
        return "\n".join(lines)

    # ---- serialisation ---------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": "meshplan.graph/1",
            "name": self.name,
            "fingerprint": self.fingerprint,
            "batch_argnums": list(self.batch_argnums),
            "tensors": [[t.id, list(t.shape), t.dtype, t.kind] for t in self.tensors],
            "nodes": [{"id": n.id, "primitive": n.primitive, "inputs": list(n.inputs),
                       "outputs": list(n.outputs), "params": _jsonable(n.params),
                       "flops": n.flops, "bytes_accessed": n.bytes_accessed,
                       "remat": n.remat, "repeat": n.repeat, "scope": n.scope}
                      for n in self.nodes],
            "inputs": [dataclasses.asdict(i) for i in self.inputs],
            "outputs": [dataclasses.asdict(o) for o in self.outputs],
            "warnings": list(self.warnings),
            **({"batch_dims": [list(p) for p in self.batch_dims]} if self.batch_dims else {}),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Graph":
        return cls(
            name=d["name"],
            tensors=tuple(Tensor(i, tuple(s), dt, k) for i, s, dt, k in d["tensors"]),
            nodes=tuple(Node(id=n["id"], primitive=n["primitive"], inputs=tuple(n["inputs"]),
                             outputs=tuple(n["outputs"]), params=_unjsonable(n["params"]),
                             flops=n["flops"], bytes_accessed=n["bytes_accessed"],
                             remat=n["remat"], repeat=n["repeat"], scope=n["scope"])
                        for n in d["nodes"]),
            inputs=tuple(GraphInput(**i) for i in d["inputs"]),
            outputs=tuple(GraphOutput(**o) for o in d["outputs"]),
            batch_argnums=tuple(d["batch_argnums"]),
            fingerprint=d["fingerprint"],
            warnings=tuple(d.get("warnings", ())),
            batch_dims=tuple((int(t), int(k)) for t, k in d.get("batch_dims", ())),
        )

    @classmethod
    def from_json(cls, text: str) -> "Graph":
        return cls.from_dict(json.loads(text))


def _jsonable(v: Any) -> Any:
    if isinstance(v, tuple):
        return [_jsonable(x) for x in v]
    return v


def _unjsonable(v: Any) -> Any:
    if isinstance(v, list):
        return tuple(_unjsonable(x) for x in v)
    return v


def topological(nodes: Iterable[Node]) -> bool:
    """True when every node reads only tensors produced earlier (or inputs)."""
    seen: set[int] = set()
    produced_later = {t for n in nodes for t in n.outputs}
    for n in nodes:
        for t in n.inputs:
            if t in produced_later and t not in seen:
                return False
        seen.update(n.outputs)
    return True


# The marker primitives of :mod:`meshplan.markers` (the one definition of
# their names): a cut between pipeline layers, and the end of the gradients.
PIPELINE_BOUNDARY = "meshplan_pipeline_boundary"
GRAD_BOUNDARY = "meshplan_grad_boundary"
GRAD_MARKER = GRAD_BOUNDARY
# the scope of the gradient marker meshplan adds where the step has none
# (trace.micro.infer_gradients)
INFERRED_GRADIENTS = "meshplan_inferred_gradients"
IDENTITY_MARKERS = frozenset({PIPELINE_BOUNDARY, GRAD_BOUNDARY})


def ancestor_nodes(graph: Graph, values: Iterable[int],
                   skip: frozenset[int] | set[int] = frozenset(),
                   among: Iterable[int] | None = None) -> set[int]:
    """The nodes ``values`` are computed from (their makers, and theirs, ...),
    not looking through the nodes ``skip``; ``among``: only these node ids
    (one layer's, say; None: the whole graph)."""
    need, out = set(values), set()
    nodes = graph.nodes if among is None else [graph.nodes[i] for i in sorted(among)]
    for n in reversed(nodes):
        if n.id not in skip and not need.isdisjoint(n.outputs):
            out.add(n.id)
            need.update(n.inputs)
    return out


def descendant_tensors(graph: Graph, nodes: Iterable[int]) -> set[int]:
    """The values computed from the outputs of ``nodes`` (theirs included)."""
    start = set(nodes)
    out: set[int] = set()
    for n in graph.nodes:
        if n.id in start or not out.isdisjoint(n.inputs):
            out.update(n.outputs)
    return out


def cast_origin(graph: Graph, t: int) -> int:
    """The value ``t`` is, before element-wise casts and copies."""
    producer = graph.producer
    while t in producer:
        n = graph.nodes[producer[t]]
        if n.primitive not in ("convert_element_type", "copy") or len(n.inputs) != 1:
            break
        t = n.inputs[0]
    return t


def stacked_scan_inputs(graph: Graph, node: Node) -> list[int]:
    """The step's non-batch inputs that the scan ``node`` iterates over (its
    ``xs``, directly or through an elementwise cast) and whose leading
    dimension is the scan's length: layers stacked along it.  Empty for a
    scan that reads the step's parameters only as constants, the same in
    every iteration (a recurrence, a loop over micro-batches)."""
    if node.primitive != "scan" or node.repeat <= 1:
        return []
    p = dict(node.params)
    if "num_consts" not in p:
        return []
    inputs = {i.tensor for i in graph.inputs if i.argnum not in graph.batch_argnums}
    out = []
    for t in (cast_origin(graph, t) for t in node.inputs[p["num_consts"] + p["num_carry"]:]):
        shape = graph.tensors[t].shape
        if t in inputs and shape and shape[0] == node.repeat:
            out.append(t)
    return out


def forward_nodes(graph: Graph) -> list[bool]:
    """Per node: is it in the forward pass?  The ancestors of the outputs that
    update no input (loss, metrics), not looking through the end-of-backward
    marker (:func:`meshplan.value_and_grad`), so the backward is excluded."""
    markers = {n.id for n in graph.nodes if n.primitive == GRAD_MARKER}
    # a metric computed from a gradient (a gradient norm, a norm or average
    # of the new parameters) is update work: taken as forward it would pull
    # the update arithmetic of every layer it reads into the forward
    after = descendant_tensors(graph, markers) if markers else set()
    metrics = {o.tensor for o in graph.outputs if o.updates is None}
    targets = metrics - after
    late = metrics & after
    if late:
        # ... whose forward part (the loss in loss * |new weights|) is forward:
        # the values of the batch made before the gradients that it reads
        batch = graph.batch_tensors
        targets |= {t for nid in ancestor_nodes(graph, late, markers)
                    for t in graph.nodes[nid].inputs if t in batch and t not in after}
    if markers:
        # the loss a step computed and dropped (read by nothing, or only
        # after the gradients: a running mean of the loss in the state) ends
        # the forward, as a returned one does, whatever else the step returns
        # (a count of the batch's tokens, whose ancestors hold no layer)
        first = min(markers)
        made = [t for n in graph.nodes[:first] for t in n.outputs]
        unread = {t for t in made if not graph.consumers.get(t)}
        if targets:
            # (a scalar, as jax.grad's loss is: not a value the backward made
            # and left unread, as a loop's cotangent of the batch; nor the new
            # value of an input the step returns, BatchNorm's running
            # statistics: update work, as outputs that update are)
            targets |= {t for t in unread - {o.tensor for o in graph.outputs}
                        if math.prod(graph.tensors[t].shape) == 1}
        else:
            early = {t for n in graph.nodes[:first] for t in n.inputs}
            targets = unread or {t for t in made if t not in early and t in graph.batch_tensors}
    fwd = ancestor_nodes(graph, targets, markers)
    return [n.id in fwd for n in graph.nodes]


def stage_program_counts(graph: Graph) -> tuple[int, int]:
    """The programs each pipeline stage of ``graph`` runs: (per micro-batch,
    per step).  A train step's forward and backward, then its update
    (``cost_model.pipeline.TRAIN_PROGRAMS``); a step whose every pass over
    the batch is forward work (an evaluation step) runs its forward alone,
    and an update program only where it changes state
    (``runtime/pipeline_split``'s phases)."""
    fwd = forward_nodes(graph)
    # (not a scalar made and left unread, which the tracer keeps for a
    # dropped loss)
    live = ancestor_nodes(graph, [o.tensor for o in graph.outputs])
    rest = [n for n in graph.nodes if not fwd[n.id] and n.id in live]
    # work on the batch after the forward and before the gradients' marks
    after = descendant_tensors(graph, (n.id for n in graph.nodes if n.primitive == GRAD_MARKER))
    batch = graph.batch_tensors - after
    if any(not batch.isdisjoint(n.outputs) for n in rest):
        return 2, 1
    return 1, int(bool(rest))


def per_micro_batch_nodes(graph: Graph, grads: frozenset[int], varying: Iterable[int]
                          ) -> set[int]:
    """The nodes a pipeline runs once per micro-batch, as the runtime splits a
    step (``runtime/pipeline_split._phases``): what the gradients ``grads``
    need, and what a value made from the inputs ``varying`` (the batch, or
    a layer's activations) but not from a gradient needs; a node reading a
    gradient, or a value made from one, runs once a step, as do the casts
    of :func:`hoisted_casts`."""
    return micro_batch_split(graph, grads, varying)[0]


def micro_batch_split(graph: Graph, grads: frozenset[int], varying: Iterable[int]
                      ) -> tuple[set[int], frozenset[int]]:
    """(:func:`per_micro_batch_nodes`, the :func:`hoisted_casts` run once a
    step ahead of the micro-batches)."""
    after, batch = set(grads), set(varying)
    reads_grad: set[int] = set()
    for n in graph.nodes:
        if not after.isdisjoint(n.inputs):
            after.update(n.outputs)
            reads_grad.add(n.id)
        elif not batch.isdisjoint(n.inputs):
            batch.update(n.outputs)
    targets = set(grads) | (batch - after)
    each = ancestor_nodes(graph, targets, reads_grad)
    ahead = hoisted_casts(graph, each, batch | after)
    return (ancestor_nodes(graph, targets, reads_grad | ahead) if ahead else each), ahead


def _narrowing_float_cast(graph: Graph, n: "Node") -> bool:
    if n.primitive != "convert_element_type" or len(n.inputs) != 1 or len(n.outputs) != 1:
        return False
    src, dst = graph.tensors[n.inputs[0]].dtype, graph.tensors[n.outputs[0]].dtype
    return ("float" in src and "float" in dst) and dtype_bits(dst) < dtype_bits(src)


def hoisted_casts(graph: Graph, each: set[int], varying: set[int]) -> frozenset[int]:
    """Of the per-micro-batch nodes ``each``, the casts of state (a float32
    parameter) to a narrower float type (its bfloat16 copy) that only
    per-micro-batch nodes read: with several micro-batches the runtime makes
    each such copy once a step, ahead of the micro-batches, and keeps it for
    the step (``runtime/pipeline_split._hoisted_casts``), instead of casting
    per micro-batch and again in every recomputation (Megatron-LM keeps its
    half-precision weights the same way).  ``varying``: the values made from
    the batch, an activation or a gradient."""
    outs = {o.tensor for o in graph.outputs}
    const = graph.constant_nodes
    return frozenset(
        n.id for n in graph.nodes
        if n.id in each and n.id not in const and _narrowing_float_cast(graph, n)
        and n.inputs[0] not in varying and n.outputs[0] not in outs
        and all(r in each for r in graph.consumers.get(n.outputs[0], ())))


def strip_markers(graph: Graph, markers: frozenset[str] = IDENTITY_MARKERS) -> Graph:
    """The same computation without identity marker nodes: readers of a
    marker's result read the marked value instead; nodes are renumbered, tensor
    ids are kept (so shardings found for the stripped graph apply to the
    original)."""
    if not any(n.primitive in markers for n in graph.nodes):
        return graph
    alias: dict[int, int] = {}
    for n in graph.nodes:
        if n.primitive in markers:
            for i, o in zip(n.inputs, n.outputs):
                alias[o] = alias.get(i, i)

    nodes = []
    for n in graph.nodes:
        if n.primitive in markers:
            continue
        inputs = n.inputs
        if not alias.keys().isdisjoint(inputs):
            inputs = tuple([alias.get(t, t) for t in inputs])
        # (nodes before the first marker stay as they are: no copy)
        nodes.append(n if n.id == len(nodes) and inputs is n.inputs
                     else n.renumbered(len(nodes), inputs))
    outputs = tuple(dataclasses.replace(o, tensor=alias.get(o.tensor, o.tensor))
                    for o in graph.outputs)
    return dataclasses.replace(graph, nodes=tuple(nodes), outputs=outputs)


def random_draw_shapes(graph: Graph) -> tuple[tuple[int, ...], ...]:
    """The shapes of the random bits the step draws (``random_bits`` nodes, in
    order)."""
    return tuple(graph.tensors[n.outputs[0]].shape for n in graph.nodes
                 if n.primitive == "random_bits" and n.outputs)


def batch_shaped_draws(full: Graph, micro: Graph) -> str | None:
    """Why a pipeline of ``micro`` (the step at micro-batch size) cannot give
    each micro-batch its rows of the random bits the plain step ``full``
    draws; None if it can (:func:`draw_batch_dims`)."""
    dims = draw_batch_dims(random_draw_shapes(full), random_draw_shapes(micro))
    return dims if isinstance(dims, str) else None


def batch_dims_between(full: Graph, micro: Graph, B: int) -> dict[int, int]:
    """Per value of ``micro`` (the step traced at ``B`` micro-batches) that is
    ``full``'s value (the step at the full batch) cut along one dimension
    into ``B``: that dimension.  Empty where the two are not the same
    operators on the same values (then nothing is known)."""
    if B < 2 or len(full.tensors) != len(micro.tensors) or len(full.nodes) != len(micro.nodes) \
            or any(a.primitive != b.primitive or a.outputs != b.outputs
                   for a, b in zip(full.nodes, micro.nodes)):
        return {}
    out = {}
    for t, (a, b) in enumerate(zip(full.tensors, micro.tensors)):
        if a is None or b is None or len(a.shape) != len(b.shape):
            continue
        diff = [d for d, (p, q) in enumerate(zip(a.shape, b.shape)) if p != q]
        if len(diff) == 1 and a.shape[diff[0]] == B * b.shape[diff[0]]:
            out[t] = diff[0]
    return out


def draw_batch_dims(full: Sequence[tuple[int, ...]], micro: Sequence[tuple[int, ...]]
                    ) -> list[int | None] | str:
    """Per random draw (shapes at the full batch and at the micro-batch, in
    order): the dimension that carries the batch (None: the draw is the same
    at both), or why a pipeline cannot give each micro-batch its rows of the
    full draw."""
    if len(full) != len(micro):
        return (f"the step makes {len(full)} random draws at full batch size but {len(micro)} "
                "per micro-batch; use one micro-batch (num_micro_batches=1)")
    dims: list[int | None] = []
    for a, b in zip(full, micro):
        differ = [d for d in range(len(a)) if len(a) == len(b) and a[d] != b[d]]
        if len(a) != len(b) or len(differ) > 1 or (differ and a[differ[0]] % b[differ[0]]):
            return (f"the step draws random bits of shape {a} at full batch size but {b} per "
                    "micro-batch, which is not a slice of rows of the full draw; draw over one "
                    "batch dimension or use one micro-batch (num_micro_batches=1)")
        dims.append(differ[0] if differ else None)
    return dims
