"""The step as the runtime runs it: traced once on the planner side and
handed to the runtime, which never traces.

:class:`TracedStep` is frozen data: the closed jaxpr of the step, its
flattened form (:class:`FlatJaxpr`, the very equation stream and integer
tensor ids the planner saw, so a plan's tensor ids name values here), the
:class:`~meshplan.graph.Graph` of that stream (which output updates which
input: ``graph.outputs[k].updates``), the argument and output structure, and,
for pipeline plans, the micro-batch split.  It is made by
:func:`meshplan.trace.trace_for_run`.

The flat stream's data types live here (and are re-exported by
:mod:`meshplan.trace.walk`, which makes them), as do the names of the marker
primitives (:data:`GRAD_BOUNDARY`, :data:`PIPELINE_BOUNDARY`, defined once in
:mod:`meshplan.graph`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import jax
import numpy as np

from .graph import GRAD_BOUNDARY, IDENTITY_MARKERS, PIPELINE_BOUNDARY, Graph

__all__ = ["Lit", "FlatEqn", "FlatJaxpr", "TracedStep", "GRAD_BOUNDARY", "PIPELINE_BOUNDARY",
           "IDENTITY_MARKERS", "jit_dtype", "signature", "same_stream"]


def signature(tree: Any, *, weak_types: bool = False) -> Any:
    """What a trace of ``tree`` depends on: its structure and each leaf's shape
    and dtype.  ``weak_types``: also whether a leaf is weakly typed (a Python
    scalar), which ``jax.jit`` compiles apart (the runtime's program key)."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    if not weak_types:
        return treedef, tuple((tuple(getattr(l, "shape", ())), str(getattr(l, "dtype", type(l))))
                              for l in leaves)
    return treedef, tuple(_jit_key(x) for x in leaves)


def _jit_key(leaf: Any) -> tuple[Any, ...]:
    if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
        return (tuple(leaf.shape), str(leaf.dtype), bool(getattr(leaf, "weak_type", False)))
    # (a Python bool is no weak type to jax.jit; its int, float and complex are)
    weak = isinstance(leaf, (int, float, complex)) and not isinstance(leaf, bool)
    return (np.shape(leaf), str(jit_dtype(leaf)), weak)


def jit_dtype(leaf: Any) -> Any:
    """The dtype ``jax.jit`` takes ``leaf`` in: a Python float or a float64
    NumPy array is float32 unless x64 is on (a PRNG key's stays its own)."""
    dtype = getattr(leaf, "dtype", None) or np.asarray(leaf).dtype
    return jax.dtypes.canonicalize_dtype(dtype, allow_extended_dtype=True)


@dataclass(frozen=True)
class Lit:
    """A literal operand (a Python/numpy scalar baked into the jaxpr)."""
    value: Any
    aval: Any


@dataclass(frozen=True)
class FlatEqn:
    eqn: Any                        # the original jax JaxprEqn
    invars: tuple[int | Lit, ...]   # global ids, or literals
    outvars: tuple[int, ...]
    remat: bool
    scope: str
    # the differentiated ``jax.checkpoint`` call (in the backward) this
    # equation was inlined from, numbered in the stream; -1: none.  The
    # runtime fences each such call's operands as jax lowers the call, so
    # XLA cannot merge its recomputation with the forward's values.
    fence: int = -1


@dataclass(frozen=True)
class FlatJaxpr:
    invars: tuple[int, ...]
    constvars: tuple[int, ...]
    consts: tuple[Any, ...]
    eqns: tuple[FlatEqn, ...]
    outvars: tuple[int | Lit, ...]
    avals: dict[int, Any]           # global id -> abstract value


def computed_into(eqns: Sequence[FlatEqn], ids: Iterable[int]) -> set[int]:
    """``ids`` and every value of ``eqns`` they are computed from."""
    out = set(ids)
    for fe in reversed(eqns):
        if any(o in out for o in fe.outvars):
            out.update(x for x in fe.invars if isinstance(x, int))
    return out


def same_stream(a: FlatJaxpr, b: FlatJaxpr) -> bool:
    """Whether two traces of one step (at two batch sizes) are the same
    equations: their ids then match."""
    return len(a.eqns) == len(b.eqns) and len(a.avals) == len(b.avals) and all(
        x.eqn.primitive is y.eqn.primitive for x, y in zip(a.eqns, b.eqns))


@dataclass(frozen=True, eq=False)
class TracedStep:
    """A train step traced for the runtime (see the module doc).

    With ``micro_batches`` (pipeline plans) the step is traced at the
    micro-batch shapes: the batch arguments' dimension 0 divided by
    ``micro_batches``; ``step_out_avals`` are then the output leaves of the
    whole batch and ``concat_outputs`` the output ids whose dimension 0 is
    the batch (concatenated over micro-batches), and ``graph`` and
    ``forward`` are made (the one-stage runtime needs neither)."""
    closed: Any                                  # jax ClosedJaxpr, as jax.make_jaxpr made it
    flat: FlatJaxpr
    graph: Graph | None                          # of ``flat`` (tensor ids are flat ids); pipelines only
    arg_tree: Any                                # treedef of the argument tuple
    arg_paths: tuple[tuple[int, str], ...]       # per flat input: (argnum, keystr inside it)
    batch_argnums: tuple[int, ...]
    out_tree: Any                                # treedef of the outputs
    out_shape: Any                               # outputs as traced: pytree of ShapeDtypeStruct
    step_out_avals: tuple[tuple[tuple[int, ...], Any], ...]   # (shape, dtype) per output leaf
    forward: tuple[bool, ...]                    # per equation: in the forward pass; pipelines only
    micro_batches: int | None = None             # None: traced at the arguments' own shapes
    micro_batch_size: int = 0                    # rows of one micro-batch (0: no batch)
    concat_outputs: tuple[int, ...] = ()
    # random draws over the batch: (flat equation, batch dimension, full-batch
    # shape); drawn once per step, each micro-batch reads its rows
    batch_draws: tuple[tuple[int, int, tuple[int, ...]], ...] = ()
    # (equation, its jaxpr equation at the full batch) for what such a draw
    # is computed from that is per-example (e.g. a split into per-example keys)
    draw_eqns: tuple[tuple[int, Any], ...] = ()
    # how each value scales with the batch (:mod:`meshplan.trace.scaling`):
    # how micro-batches combine; None where not analysed (one micro-batch)
    scaling: Any = None

    @property
    def num_args(self) -> int:
        return len(self.arg_tree.children())

    @property
    def batch_leaves(self) -> tuple[bool, ...]:
        """Per flat input: is it a leaf of a batch argument with rows (a
        scalar among them is every micro-batch's whole, as jax.vmap's
        in_axes=None)?"""
        return tuple(a in self.batch_argnums and bool(getattr(self.flat.avals[i], "shape", ()))
                     for (a, _), i in zip(self.arg_paths, self.flat.invars))

    def updated_input(self) -> dict[int, int]:
        """Output id -> id of the input it is the new value of."""
        g = self.graph
        if g is None:
            raise ValueError("a TracedStep made without micro_batches has no Graph")
        return {o.tensor: g.inputs[o.updates].tensor for o in g.outputs if o.updates is not None}

    def __repr__(self) -> str:
        mb = f", {self.micro_batches} micro-batches" if self.micro_batches else ""
        return (f"TracedStep({len(self.flat.eqns)} equations, "
                f"{len(self.flat.invars)} inputs, {len(self.flat.outvars)} outputs{mb})")
