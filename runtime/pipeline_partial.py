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
the means' ``1 / (m * D)`` undoes it, and a backward multiplies the
cotangents it receives from another backward (or from a forward that made
them, where a metric reads a gradient) by ``D`` and divides those it sends
by ``D``.  (That is a mean loss; in general a value of degree ``k``
(:mod:`meshplan.trace.scaling`: a summed loss's cotangents have ``k = 0``,
its gradients are sums) is ``D ** -k`` times as large, and the means divide
a sum of degree ``e`` by ``(m * D) ** (1 - e)``.)  So a stage whose
backward reduces its gradients itself (as before) can sit beside one that
keeps partial sums.  The two traces are matched
equation by equation (:func:`align`): at a batch of one jax adds a
broadcast here and drops a sum over the batch there, and a reshape may
drop the batch dimension of size one (such a value is reshaped where it
enters or leaves the backward).  A stage reduces its gradients itself where
its backward's values cannot be matched, or an output is not cut along the
batch (a whole value sent to another backward); running sums made by a
forward program are reduced there, as before.  An input the plan lays out
whole over the data axes is cut where it enters (a local slice), and a
running sum the plan cuts over them is kept whole per data shard like the
others and cut once a step by the means program: the communication and the
memory the plan charges (dp_search.solver counts such sums whole).
The data axes are those the batch arguments are cut over; a searched plan
may leave them whole (its first layer cuts the rows of what it makes), and
then each run of mesh axes is checked against the stages' layouts.  Each
stage has its own ``D`` (a searched plan may give its stages meshes of
different shapes): the step is traced once per distinct ``D``, and as the
backwards hand each other cotangents of the whole micro-batch's scale, a
stage of one ``D`` sits beside a stage of another.
:func:`partial_sums` gives, per stage that qualifies, its
:class:`PartialSums`; None when none does, for a plan that reduces its
gradients every micro-batch, or for one micro-batch, no common data axes, or
a batch that does not divide.
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
    size: int                   # D, the product of their sizes on these stages' meshes
    flat: FlatJaxpr             # the step at 1/D of the micro-batch
    stages: frozenset[int]      # the stages (of this D) whose backward keeps partial gradients
    ids: frozenset[int]         # their running sums
    batch_dim: Mapping[int, int]    # value id -> its batch dimension (values cut by D)
    # stage -> its backward's equations in ``flat``; value id of the step ->
    # its id in ``flat`` (the identity where the two traces agree)
    eqns: Mapping[int, tuple[int, ...]]
    value: Mapping[int, int]

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
    """The axes the batch arguments cut along dimension 0 are cut over (one
    answer for all of them), if any.  (One left whole, targets read by the
    loss alone, say, is cut where it enters: :func:`_data_parallel`.)"""
    found = set()
    for _, spec in plan.batch:
        first = spec[0] if spec else None
        if first is not None:
            found.add(tuple(first) if isinstance(first, (list, tuple)) else (first,))
    return found.pop() if len(found) == 1 else None


def partial_sums(retrace: Callable[[int], TracedStep] | None, traced: TracedStep, plan: Plan,
                 meshes: Sequence[Mesh], split: StepSplit,
                 closure: Callable[..., list[int]],
                 layout: Callable[[int, int], NamedSharding | None]
                 ) -> dict[int, PartialSums] | None:
    """How the backwards keep partial gradients (see the module doc): per
    stage that does, its :class:`PartialSums`; or None.
    ``retrace(pieces)``: the step traced with its batch cut in ``pieces`` (the
    planner's ``trace_for_run``; without it, no partial sums);
    ``closure(task, split, flat)``: the equations a task's program replays;
    ``layout(x, s)``: value ``x``'s planned layout on stage ``s``, if any."""
    m = int(plan.num_micro_batches)
    if retrace is None or plan.reduce_grads_each_micro_batch or m < 2:
        return None
    for axes in _candidate_axes(plan, meshes):
        found = _partial_sums(retrace, traced, plan, meshes, split, closure, layout, axes)
        if found is not None:
            return found
    return None


def _candidate_axes(plan: Plan, meshes: Sequence[Mesh]) -> list[tuple[str, ...]]:
    """The data axes to try: those the batch arguments are cut over; where
    the plan leaves them whole (a searched plan may: the first layer cuts
    the rows of what it makes), every run of consecutive axes every stage's
    mesh has, the longest first (each is checked against the layouts)."""
    axes = _data_axes(plan)
    if axes is not None:
        return [axes]
    if any(spec and spec[0] is not None for _, spec in plan.batch):
        return []           # (cut, but not alike)
    names = [tuple(mesh.axis_names) for mesh in meshes]
    runs = {n[i:j] for n in names for i in range(len(n)) for j in range(i + 1, len(n) + 1)}
    return sorted((r for r in runs if all(a in n for n in names for a in r)),
                  key=lambda r: (-len(r), r))


def _partial_sums(retrace: Callable[[int], TracedStep], traced: TracedStep, plan: Plan,
                  meshes: Sequence[Mesh], split: StepSplit, closure: Callable[..., list[int]],
                  layout: Callable[[int, int], NamedSharding | None], axes: tuple[str, ...]
                  ) -> dict[int, PartialSums] | None:
    """Per stage whose mesh has ``axes``, over more than one device, and
    whose backwards run data-parallel over them: its PartialSums."""
    if not all(a in dict(mesh.shape) for mesh in meshes for a in axes):
        return None
    m = int(plan.num_micro_batches)
    by_size: dict[int, set[int]] = {}
    for s, mesh in enumerate(meshes):
        d = math.prod(dict(mesh.shape)[a] for a in axes)
        # (where the plan records the axes its sums wait over, only those:
        # over others it priced each micro-batch's reduction, and the
        # running sums cut as reduced)
        waits = plan.stages[s].deferred_axes
        if d > 1 and (waits is None or set(axes) <= set(waits)):
            by_size.setdefault(d, set()).add(s)
    found: dict[int, PartialSums] = {}
    for d, stages in sorted(by_size.items()):
        got = _of_size(retrace, traced, split, closure, layout, axes, m, d, stages)
        if got is not None:
            found.update((s, got) for s in got.stages)
    return found or None


def _of_size(retrace: Callable[[int], TracedStep], traced: TracedStep, split: StepSplit,
             closure: Callable[..., list[int]],
             layout: Callable[[int, int], NamedSharding | None], axes: tuple[str, ...],
             m: int, d: int, of: set[int]) -> PartialSums | None:
    """The PartialSums of the stages ``of`` whose data axes make ``d`` shards."""
    try:
        small = retrace(m * d)
    except MeshplanError:
        return None
    big, flat = traced.flat, small.flat
    aligned = align(big, flat)
    if aligned is None:
        return None
    eqn, value = aligned
    made_by = {o: j for j, fe in enumerate(flat.eqns) for o in fe.outvars}
    # (rows' places, jnp.arange(B) in logp[arange(B), y]: a forward's are the
    # micro-batch's, and a data shard cut from them would index rows it lacks)
    info = traced.scaling.info if traced.scaling is not None else {}
    stages, ids, batch_dim, eqns = set(), set(), {}, {}
    for key, t in split.tasks.items():
        if key[0] != "B" or not t.accumulate or key[1] not in of:
            continue
        if any(getattr(info.get(x), "position", False) for x in t.inputs):
            continue
        mine = _small_eqns(t, closure(dataclasses.replace(t, eqns=sorted(t.replay + t.eqns)),
                                      split, big), flat, eqn, value, made_by)
        dims = None if mine is None else _task_dims(t, big, flat, d, value, split.producer)
        if dims is not None and _data_parallel(t, dims, axes, lambda x: layout(x, key[1])):
            stages.add(key[1])
            ids.update(t.accumulate)
            batch_dim.update(dims)
            eqns[key[1]] = mine
    if not stages:
        return None
    return PartialSums(tuple(axes), d, flat, frozenset(stages), frozenset(ids), batch_dim,
                       eqns, value)


def align(big: FlatJaxpr, small: FlatJaxpr) -> tuple[dict[int, int], dict[int, int]] | None:
    """Equations and values of ``big`` (the step's trace) matched with those
    of ``small`` (its trace at a smaller batch): (equation index -> index,
    value id -> id), or None where they cannot be matched.  jax traces a few
    operations otherwise where a batch dimension has size one (a broadcast
    more, a sum over the batch less), so the two are matched as sequences of
    primitives (:func:`_match`), values through the matched equations'
    results and operands; a match of another dtype gives None (shapes are
    the callers' to check)."""
    if big.invars != small.invars:
        return None
    if len(big.eqns) == len(small.eqns) and all(
            x.eqn.primitive == y.eqn.primitive and x.outvars == y.outvars
            for x, y in zip(big.eqns, small.eqns)):
        ids = {x for fe in big.eqns for x in fe.outvars} | set(big.invars) | set(big.constvars)
        return {k: k for k in range(len(big.eqns))}, {x: x for x in ids}

    def sig(fe: Any, avals: Mapping[int, Any]) -> tuple:
        return (fe.eqn.primitive.name,
                tuple(len(getattr(avals.get(v), "shape", ())) if isinstance(v, int) else None
                      for v in fe.invars),
                tuple(len(getattr(avals.get(v), "shape", ())) for v in fe.outvars))

    eqn = _match([sig(e, big.avals) for e in big.eqns],
                 [sig(e, small.avals) for e in small.eqns])
    value = {x: x for x in big.invars}
    for k, j in eqn.items():
        value.update(zip(big.eqns[k].outvars, small.eqns[j].outvars))
    # a value whose maker has no match (a sum over the batch the smaller
    # trace does without) is named by what its matched readers read; a value
    # matched already and read through an added broadcast keeps its match
    for k, j in eqn.items():
        for a, b in zip(big.eqns[k].invars, small.eqns[j].invars):
            if isinstance(a, int) and isinstance(b, int):
                value.setdefault(a, b)
    if any(getattr(big.avals.get(a), "dtype", None) != getattr(small.avals.get(b), "dtype", None)
           for a, b in value.items()):
        return None
    return eqn, value


# the equations jax adds or leaves out where a batch dimension has size one
_SHAPING = frozenset({"reshape", "broadcast_in_dim", "reduce_sum", "squeeze", "expand_dims"})
# (at most this many more equations skipped on one side than the lengths differ by)
_SLACK = 16


def _match(big: Sequence[tuple], small: Sequence[tuple]) -> dict[int, int]:
    """The cheapest alignment of two sequences of equation signatures
    ``(primitive, operand ranks, result ranks)``: a pair of one primitive
    costs 0 with the same ranks, 1 otherwise; an equation left unmatched
    costs 2 if it only shapes (``_SHAPING``), else 4.  The traces differ in a
    few equations, so the search keeps to a band around the diagonal (and,
    unlike a longest-common-run match, never pairs one layer's equations
    with the next identical layer's).  big index -> small index."""
    # (the same equations at both ends, the forward mostly, pair one to one)
    head = 0
    while head < min(len(big), len(small)) and big[head] == small[head]:
        head += 1
    tail = 0
    while tail < min(len(big), len(small)) - head and big[-1 - tail] == small[-1 - tail]:
        tail += 1
    out = {k: k for k in range(head)}
    out.update((len(big) - 1 - k, len(small) - 1 - k) for k in range(tail))
    big, small = big[head:len(big) - tail], small[head:len(small) - tail]
    n, m = len(big), len(small)
    lo, hi = min(0, n - m) - _SLACK, max(0, n - m) + _SLACK      # bounds of i - j
    inf = float("inf")
    cost: dict[tuple[int, int], float] = {(0, 0): 0.0}
    move: dict[tuple[int, int], int] = {}

    def skip(x: tuple) -> float:
        return 2.0 if x[0] in _SHAPING else 4.0

    for i in range(n + 1):
        for j in range(max(0, i - hi), min(m, i - lo) + 1):
            if i == j == 0:
                continue
            best, how = inf, -1
            if i and j and big[i - 1][0] == small[j - 1][0]:
                best = cost.get((i - 1, j - 1), inf) + (big[i - 1] != small[j - 1])
                how = 0
            if i and cost.get((i - 1, j), inf) + skip(big[i - 1]) < best:
                best, how = cost[i - 1, j] + skip(big[i - 1]), 1
            if j and cost.get((i, j - 1), inf) + skip(small[j - 1]) < best:
                best, how = cost[i, j - 1] + skip(small[j - 1]), 2
            if best < inf:
                cost[i, j], move[i, j] = best, how
    i, j = n, m
    while i or j:
        how = move[i, j]
        if how == 0:
            out[head + i - 1] = head + j - 1
        i, j = i - (how != 2), j - (how != 1)
    return out


def _small_eqns(t: Task, eqn_ids: Sequence[int], small: FlatJaxpr, eqn: Mapping[int, int],
                value: Mapping[int, int], producer: Mapping[int, int]
                ) -> tuple[int, ...] | None:
    """Backward ``t``'s equations (``eqn_ids`` of the step's trace) in the
    smaller trace: the matched ones and the unmatched ones they read (the
    broadcasts jax adds at a batch of one); None where a boundary value has
    no match, or the equations read a value neither they nor ``t``'s inputs
    make.  ``producer``: value id -> the equation of ``small`` making it."""
    bounds = list(t.inputs) + list(t.outputs) + list(t.accumulate)
    if any(x not in value for x in bounds):
        return None
    matched = set(eqn.values())
    own = {eqn[k] for k in eqn_ids if k in eqn}
    stack = [x for j in own for x in small.eqns[j].invars if isinstance(x, int)]
    stack += [value[x] for x in bounds]
    inputs = {value[x] for x in t.inputs}
    while stack:
        j = producer.get(stack.pop())
        if j is not None and j not in matched and j not in own:
            own.add(j)
            stack.extend(x for x in small.eqns[j].invars if isinstance(x, int))
    made = inputs | set(small.invars) | set(small.constvars) | {
        o for j in own for o in small.eqns[j].outvars}
    if any(x not in made for j in own for x in small.eqns[j].invars if isinstance(x, int)) or \
            any(value[x] not in made for x in list(t.outputs) + list(t.accumulate)):
        return None
    return tuple(sorted(own))


def _task_dims(t: Task, big: FlatJaxpr, flat: FlatJaxpr, d: int, value: Mapping[int, int],
               producer: Mapping[int, tuple]) -> dict[int, int] | None:
    """The batch dimension of every input and output of backward ``t`` cut
    by ``d`` (``value``: its ids in ``flat``), or None where an output is not
    cut along the batch (a gradient sent to another stage, a value reduced
    over the batch), an input from another backward is not either, or a
    value is cut otherwise."""
    acc = set(t.accumulate)
    dims = {}
    for x in list(t.inputs) + list(t.outputs):
        dim = _cut(big.avals.get(x), flat.avals.get(value[x]), d)
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
    whole is cut where it enters: a local slice), and at least one so cut?
    (A running sum planned cut over them is kept whole per data shard, like
    the others, and cut once a step where the means program reduces it.  A
    backward planned on whole rows makes whole gradients: cut here, its sums
    would add the reduction the plan does without.)"""
    cut = False
    for x, d in dims.items():
        sh = layout(x)
        entry = tuple(sh.spec)[d] if sh is not None and d < len(sh.spec) else None
        got = (entry,) if isinstance(entry, str) else tuple(entry or ())
        whole = sh is not None and not any(
            a in (e if isinstance(e, (list, tuple)) else (e,)) for e in sh.spec for a in axes)
        if got[:len(axes)] == tuple(axes):
            cut = True
        elif not (x in t.inputs and whole):
            return False
    return cut


def _cut(big: Any, small: Any, d: int) -> int | None | bool:
    """The one dimension along which ``small`` is ``big`` cut by ``d``; None
    if they have one shape; False otherwise.  ``small`` may also lack
    dimensions of size one the cut leaves (jax drops a batch dimension of
    size one in some reshapes): the program reshapes those values."""
    bs, ss = getattr(big, "shape", None), getattr(small, "shape", None)
    if bs is None or ss is None:
        return None if bs == ss else False
    if len(bs) != len(ss):
        dims = [i for i, n in enumerate(bs) if n % d == 0 and [
            k for k in bs[:i] + (n // d,) + bs[i + 1:] if k != 1] == [k for k in ss if k != 1]]
        return dims[0] if len(dims) == 1 else False
    diff = [i for i, (p, q) in enumerate(zip(bs, ss)) if p != q]
    if not diff:
        return None
    if len(diff) == 1 and bs[diff[0]] == d * ss[diff[0]]:
        return diff[0]
    return False


def _rank(aval: Any) -> int:
    return len(getattr(aval, "shape", ()))


def _per_shard(shape: Sequence[int], dim: int | None, d: int) -> tuple[int, ...]:
    """``shape`` with its batch dimension ``dim`` cut by ``d`` (one shard's)."""
    shape = tuple(shape)
    return shape if dim is None else shape[:dim] + (shape[dim] // d,) + shape[dim + 1:]


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
                    sub_of: Callable[..., FlatJaxpr]) -> Callable[..., Any]:
    """The backward ``task`` as a function of (inputs, running sums) that
    keeps each device's partial gradients (see the module doc)."""
    s = task.stage
    mesh = layouts.meshes[s]
    v = ps.value
    outs = list(task.outputs) + [x for x in task.accumulate if x not in task.outputs]
    sub = sub_of(ps.flat, list(ps.eqns[s]), [v[x] for x in task.inputs], [v[x] for x in outs])
    # inside, the data axes are manual: the plan's layouts without them (its
    # values and readers named by their ids in the smaller trace; a value the
    # smaller trace holds at another rank keeps no constraint)
    small, big = ps.flat.avals, layouts.flat.avals
    by_small = {ps.flat.eqns[k].outvars[0]: ps.flat.eqns[k] for k in ps.eqns[s]
                if ps.flat.eqns[k].outvars}
    by_big = {e.outvars[0]: e for e in layouts.flat.eqns if e.outvars}

    def operand_rank(by: Mapping[int, Any], avals: Mapping[int, Any], first: int, p: int) -> int:
        fe = by.get(first)
        x = fe.invars[p] if fe is not None and p < len(fe.invars) else None
        return _rank(avals.get(x)) if isinstance(x, int) else -1

    cons = {v[t]: strip_axes(sh.spec, ps.axes) for t, sh in layouts.constraints[s].items()
            if t in v and _rank(small.get(v[t])) == _rank(big.get(t))}
    reads = {v[t]: [(p, strip_axes(sh.spec, ps.axes)) for p, sh in rs
                    if operand_rank(by_small, small, v[t], p) == operand_rank(by_big, big, t, p)]
             for t, rs in layouts.reads[s].items() if t in v}
    evaluate = make_evaluator(sub, cons, reads)
    n_in, n_out = len(task.inputs), len(task.outputs)
    acc_pos = [outs.index(x) for x in task.accumulate]
    lead = PartitionSpec(ps._entry())
    in_specs = tuple([ps.spec_at(x, len(getattr(big[x], "shape", ()))) for x in task.inputs]
                     + [lead] * len(task.accumulate))
    out_specs = ([ps.spec_at(x, len(big[x].shape)) for x in task.outputs],
                 [lead] * len(task.accumulate))

    d = ps.size
    # cotangents from other backwards arrive at the full micro-batch's scale
    # and leave at it: this trace's are d ** -k times as large for a value of
    # degree k (meshplan.trace.scaling; a mean loss's cotangents: k = -1, d
    # times; a summed loss's: k = 0; see the module doc)
    # (so do the forward's values of known degree: a cotangent the forward
    # made because a metric reads a gradient; an activation, degree 0, is as
    # it is; a backward's of unknown degree is a mean loss's cotangent)
    k = split.value_degree
    unknown = {"B": -1, "F": 0}
    scaled = [float(d) ** -k.get(x, unknown[by]) if by in unknown else 1.0
              for x, by in ((x, split.producer.get(x, ("",))[0]) for x in task.inputs)]
    unscaled = [float(d) ** -k.get(x, -1) for x in task.outputs]

    # (values whose smaller trace dropped a dimension of size one: reshaped
    # on the way in and out, see _cut)
    in_shape = [tuple(small[v[x]].shape) if hasattr(small[v[x]], "shape") else None
                for x in task.inputs]
    out_shape = [_per_shard(big[x].shape, ps.batch_dim.get(x), d) for x in task.outputs]

    def local(*xs: Any) -> tuple[list[Any], list[Any]]:
        ins = [x * sc if sc != 1 and _inexact(x) else x for x, sc in zip(xs[:n_in], scaled)]
        ins = [x if n is None or x.shape == n else x.reshape(n) for x, n in zip(ins, in_shape)]
        vals = evaluate(*ins)
        new = [a + vals[p][None] for a, p in zip(xs[n_in:], acc_pos)]
        outs = [v / u if u != 1 and _inexact(v) else v for v, u in zip(vals[:n_out], unscaled)]
        return [o if o.shape == n else o.reshape(n) for o, n in zip(outs, out_shape)], new

    return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                         axis_names=set(ps.axes), check_vma=False)
