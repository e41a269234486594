"""Data-parallel gradient sums reduced once per step, as the plan charges them.

A backward program compiled as one SPMD program reduces every parameter
gradient over the data-parallel axes before it returns it (the gradient's
layout is replicated over them), so a pipeline of ``m`` micro-batches would
all-reduce each gradient ``m`` times.  The cost model charges one reduction per
step.  So, where it can, the runtime runs each backward program inside
``jax.shard_map`` with the data-parallel axes manual (the others stay with
XLA's partitioner): every device replays the backward on its own rows and
adds its *partial* gradient to a running sum with an explicit leading
data dimension (``(D, *shape)``, one row per data shard: on each device the
bytes of one gradient, as the memory model counts).  The means program sums
the ``D`` rows and divides by ``m * D`` once per step: the one reduction.

Replaying on ``1/D`` of the rows needs the step's equations at that size:
the step is traced again at ``m * D`` micro-batches (same equations and
value ids, smaller batch dimension).  That trace's mean over the batch
divides by the smaller count, so its gradients and the cotangents the
backwards pass each other are ``D`` times those of the full micro-batch;
the means' ``1 / (m * D)`` undoes it (the runtime already takes the loss to
be a mean over the batch), and a backward multiplies the cotangents it
receives from another backward by ``D`` and divides those it sends by ``D``,
so that a stage whose backward reduces its gradients itself (as before) can
sit beside one that keeps partial sums.  A stage does that where its
backward's equations differ between the two traces (jax traces some
operations otherwise at a batch of one), or an output is not cut along the
batch (a whole value sent to another backward); running sums made by a
forward program are reduced there, as before.  An input the plan lays out
whole over the data axes is cut where it enters (a local slice), and a
running sum the plan cuts over them is kept whole per data shard like the
others and cut once a step by the means program: the communication the plan
charges, with more memory than it counts for that sum.
:func:`partial_sums` gives None when no stage qualifies, or for one
micro-batch, no common data axes, or a batch that does not divide.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping, Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from meshplan.errors import MeshplanError
from meshplan.plan import Plan
from meshplan.traced import FlatJaxpr, TracedStep

from .pipeline_split import StepSplit, Task
from .shard import make_evaluator

__all__ = ("PartialSums", "partial_sums", "partial_program", "acc_sharding", "strip_axes")


@dataclasses.dataclass(frozen=True)
class PartialSums:
    axes: tuple[str, ...]       # the data-parallel mesh axes (manual inside the backwards)
    size: int                   # D, the product of their sizes (the same on every stage)
    flat: FlatJaxpr             # the step at 1/D of the micro-batch
    stages: frozenset[int]      # the stages whose backward keeps partial gradients
    ids: frozenset[int]         # their running sums
    batch_dim: Mapping[int, int]    # value id -> its batch dimension (values cut by D)

    def spec_at(self, x: int, ndim: int) -> PartitionSpec:
        """``x``'s spec over the manual axes: cut along its batch dimension,
        else whole on every data shard."""
        d = self.batch_dim.get(x)
        if d is None:
            return PartitionSpec()
        return PartitionSpec(*([None] * d + [self._entry()] + [None] * (ndim - d - 1)))

    def _entry(self) -> Any:
        return self.axes[0] if len(self.axes) == 1 else self.axes


def _data_axes(plan: Plan) -> tuple[str, ...] | None:
    """The axes every batch argument is cut over along dimension 0 (one
    answer for all of them), if any."""
    found = set()
    for _, spec in plan.batch:
        first = spec[0] if spec else None
        if first is None:
            found.add(())
        else:
            found.add(tuple(first) if isinstance(first, (list, tuple)) else (first,))
    if len(found) != 1:
        return None
    axes = found.pop()
    return axes or None


def partial_sums(retrace: Callable[[int], TracedStep] | None, traced: TracedStep, plan: Plan,
                 meshes: Sequence[Mesh], split: StepSplit,
                 closure: Callable[..., list[int]],
                 layout: Callable[[int, int], NamedSharding | None]) -> PartialSums | None:
    """How the backwards keep partial gradients (see the module doc), or None.
    ``retrace(pieces)``: the step traced with its batch cut in ``pieces`` (the
    planner's ``trace_for_run``; without it, no partial sums);
    ``closure(task, split, flat)``: the equations a task's program replays;
    ``layout(x, s)``: value ``x``'s planned layout on stage ``s``, if any."""
    m = int(plan.num_micro_batches)
    if retrace is None:
        return None
    axes = _data_axes(plan)
    if m < 2 or axes is None:
        return None
    sizes = set()
    for mesh in meshes:
        shape = dict(mesh.shape)
        if not all(a in shape for a in axes):
            return None
        sizes.add(math.prod(shape[a] for a in axes))
    if len(sizes) != 1 or sizes == {1}:
        return None
    d = sizes.pop()
    try:
        small = retrace(m * d)
    except MeshplanError:
        return None
    big, flat = traced.flat, small.flat
    if big.invars != flat.invars or len(big.eqns) != len(flat.eqns):
        return None
    stages, ids, batch_dim = set(), set(), {}
    for key, t in split.tasks.items():
        if key[0] != "B" or not t.accumulate:
            continue
        dims = _task_dims(t, big, flat, d, closure(
            dataclasses.replace(t, eqns=sorted(t.replay + t.eqns)), split, big), split.producer)
        if dims is not None and _data_parallel(t, dims, axes, lambda x: layout(x, key[1])):
            stages.add(key[1])
            ids.update(t.accumulate)
            batch_dim.update(dims)
    if not stages:
        return None
    return PartialSums(tuple(axes), d, flat, frozenset(stages), frozenset(ids), batch_dim)


def _task_dims(t: Task, big: FlatJaxpr, flat: FlatJaxpr, d: int, eqn_ids: Sequence[int],
               producer: Mapping[int, tuple]) -> dict[int, int] | None:
    """The batch dimension of every input and output of backward ``t`` cut
    by ``d``, or None where its equations differ between the traces, an
    output is not cut along the batch (a gradient sent to another stage, a
    value reduced over the batch), an input from another backward is not
    either, or a value is cut otherwise."""
    for k in eqn_ids:
        x, y = big.eqns[k], flat.eqns[k]
        if (x.eqn.primitive != y.eqn.primitive or x.outvars != y.outvars
                or [v for v in x.invars if isinstance(v, int)]
                != [v for v in y.invars if isinstance(v, int)]):
            return None
    acc = set(t.accumulate)
    dims = {}
    for x in list(t.inputs) + list(t.outputs):
        dim = _cut(big.avals.get(x), flat.avals.get(x), d)
        sent = x in t.outputs or producer.get(x, ("",))[0] == "B"
        if dim is False or (x in t.outputs and x in acc) or (sent and dim is None):
            # (what backwards pass each other must be per-row cotangents: a
            # whole gradient, e.g. of a tied weight, would be added per shard)
            return None
        if dim is not None:
            dims[x] = dim
    return dims


def _data_parallel(t: Task, dims: Mapping[int, int], axes: Sequence[str],
                   layout: Callable[[int], NamedSharding | None]) -> bool:
    """Does the plan run backward ``t`` data-parallel over ``axes``: every
    value cut along the batch planned cut over them there (an input planned
    whole is cut where it enters: a local slice)?  (A running sum planned
    cut over them is kept whole per data shard, like the others, and cut
    once a step where the means program reduces it.)"""
    for x, d in dims.items():
        sh = layout(x)
        entry = tuple(sh.spec)[d] if sh is not None and d < len(sh.spec) else None
        got = (entry,) if isinstance(entry, str) else tuple(entry or ())
        whole = sh is not None and not any(
            a in (e if isinstance(e, (list, tuple)) else (e,)) for e in sh.spec for a in axes)
        if got[:len(axes)] != tuple(axes) and not (x in t.inputs and whole):
            return False
    return True


def _cut(big: Any, small: Any, d: int) -> int | None | bool:
    """The one dimension along which ``small`` is ``big`` cut by ``d``; None
    if they have one shape; False otherwise."""
    bs, ss = getattr(big, "shape", None), getattr(small, "shape", None)
    if bs is None or ss is None:
        return None if bs == ss else False
    if len(bs) != len(ss):
        return False
    diff = [i for i, (p, q) in enumerate(zip(bs, ss)) if p != q]
    if not diff:
        return None
    if len(diff) == 1 and bs[diff[0]] == d * ss[diff[0]]:
        return diff[0]
    return False


def _inexact(x: Any) -> bool:
    return jax.numpy.issubdtype(getattr(x, "dtype", None) or jax.numpy.int32, jax.numpy.inexact)


def strip_axes(spec: Sequence[Any], axes: Sequence[str]) -> PartitionSpec:
    """``spec`` without the mesh axes ``axes`` (manual where it applies)."""
    out = []
    for e in spec:
        if e is None:
            out.append(None)
        elif isinstance(e, (list, tuple)):
            kept = tuple(a for a in e if a not in axes)
            out.append(None if not kept else kept[0] if len(kept) == 1 else kept)
        else:
            out.append(None if e in axes else e)
    return PartitionSpec(*out)


def acc_sharding(ps: PartialSums, planned: NamedSharding) -> NamedSharding:
    """Where a running sum of partial gradients lives: its leading dimension
    over the data axes, the rest as planned for the gradient (without them)."""
    return NamedSharding(planned.mesh, PartitionSpec(ps._entry(), *strip_axes(planned.spec,
                                                                              ps.axes)))


def partial_program(task: Task, split: StepSplit, layouts: Any, ps: PartialSums,
                    closure: Callable[..., list[int]], sub_of: Callable[..., FlatJaxpr]
                    ) -> Callable[..., Any]:
    """The backward ``task`` as a function of (inputs, running sums) that
    keeps each device's partial gradients (see the module doc)."""
    s = task.stage
    mesh = layouts.meshes[s]
    eqn_ids = closure(dataclasses.replace(task, eqns=sorted(task.replay + task.eqns)), split,
                      ps.flat)
    outs = list(task.outputs) + [x for x in task.accumulate if x not in task.outputs]
    sub = sub_of(ps.flat, eqn_ids, task.inputs, outs)
    # inside, the data axes are manual: the plan's layouts without them
    cons = {t: strip_axes(sh.spec, ps.axes) for t, sh in layouts.constraints[s].items()}
    reads = {t: [(p, strip_axes(sh.spec, ps.axes)) for p, sh in rs]
             for t, rs in layouts.reads[s].items()}
    evaluate = make_evaluator(sub, cons, reads)
    n_in, n_out = len(task.inputs), len(task.outputs)
    acc_pos = [outs.index(x) for x in task.accumulate]
    big = layouts.flat.avals
    lead = PartitionSpec(ps._entry())
    in_specs = tuple([ps.spec_at(x, len(getattr(big[x], "shape", ()))) for x in task.inputs]
                     + [lead] * len(task.accumulate))
    out_specs = ([ps.spec_at(x, len(big[x].shape)) for x in task.outputs],
                 [lead] * len(task.accumulate))

    d = ps.size
    # cotangents from other backwards arrive at the full micro-batch's scale
    # and leave at it: this trace's are d times as large (see the module doc)
    scaled = [split.producer.get(x, ("",))[0] == "B" for x in task.inputs]

    def local(*xs: Any) -> tuple[list[Any], list[Any]]:
        ins = [x * d if sc and _inexact(x) else x for x, sc in zip(xs[:n_in], scaled)]
        vals = evaluate(*ins)
        new = [a + vals[p][None] for a, p in zip(xs[n_in:], acc_pos)]
        return [v / d if _inexact(v) else v for v in vals[:n_out]], new

    return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                         axis_names=set(ps.axes), check_vma=False)
