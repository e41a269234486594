"""The per-stage programs of a pipeline plan and where their values live.

:class:`StageLayouts` holds, per stage, the plan's shardings bound to the
stage's mesh: the planned constraints on values, the operand constraints of
the ILP (``Stage.read_constraints``), the layout of every argument leaf, of
the running sums, and of values arriving from other stages.
:func:`build_programs` turns every task of a
:class:`~meshplan.runtime.pipeline_split.StepSplit` into one ``jax.jit`` of
an evaluator that replays its equations (plus the constant equations it
reads) with the stage's constraints; :class:`RunningSums` makes the jitted
zeros and means of the gradients summed over micro-batches.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from meshplan.errors import StalePlanError
from meshplan.plan import Plan
from meshplan.traced import GRAD_BOUNDARY, FlatJaxpr, Lit, TracedStep, same_stream

from .reads import read_layouts
from .pipeline_partial import PartialSums, acc_sharding, partial_program
from .pipeline_split import StepSplit, Task
from .shard import check_spec, make_evaluator, to_partition_spec

__all__ = ("Program", "StageLayouts", "RunningSums", "build_programs", "donations",
           "returned_leaves", "fixed_outputs", "closure_eqns",)


@dataclasses.dataclass
class Program:
    """One task as a jitted program: ``fn(*inputs, *running_sums)`` returns
    (outputs, new running sums)."""
    task: Task
    fn: Callable[..., Any]                       # jitted
    constraints: Mapping[int, NamedSharding]
    donate: tuple[int, ...] = ()                 # positions of the arguments it takes over


# ---------------------------------------------------------------------------
# Layouts
# ---------------------------------------------------------------------------

class StageLayouts:
    """The plan's shardings on the stages' meshes (see the module doc).
    Shardings are made on first use and kept (one compiled program per task)."""

    def __init__(self, plan: Plan, meshes: Sequence[Mesh], traced: TracedStep,
                 split: StepSplit) -> None:
        self.plan = plan
        self.meshes = list(meshes)
        self.flat = flat = traced.flat
        prefixes = plan.key_prefixes(traced.num_args)
        self.leaf_key = {i: prefixes.get(a, "") + path
                         for (a, path), i in zip(traced.arg_paths, flat.invars)}
        self.is_batch = {i for i, b in zip(flat.invars, traced.batch_leaves) if b}
        self._batch_table = dict(plan.batch)
        self.constraints: list[dict[int, NamedSharding]] = []
        self.reads: list[dict[int, list[tuple[int, NamedSharding]]]] = []
        for s in range(len(plan.stages)):
            cons, reads = self._planned(s)
            self.constraints.append(cons)
            self.reads.append(reads)
        self._args: dict[tuple[int, int], NamedSharding] = {}
        self._sends: dict[tuple[int, int], NamedSharding] = {}
        self._cross: dict[tuple[int, int], NamedSharding] = {}
        # outputs that update an input keep that input's layout on their stage
        for x, i in traced.updated_input().items():
            key = split.producer.get(x)
            if key is not None and key[0] == "A" and hasattr(flat.avals.get(x), "shape"):
                s = key[1]
                self.constraints[s].setdefault(x, self._arg_sharding(i, s))

    def _planned(self, s: int) -> tuple[dict[int, NamedSharding],
                                        dict[int, list[tuple[int, NamedSharding]]]]:
        """Stage ``s``'s planned value constraints and operand constraints."""
        st, mesh, flat = self.plan.stages[s], self.meshes[s], self.flat
        cons: dict[int, NamedSharding] = {}
        for tid, spec in st.constraints:
            aval = flat.avals.get(tid)
            if aval is None or not hasattr(aval, "shape"):
                continue
            check_spec(spec, aval.shape, st.logical_mesh, f"stage {s} constraint on tensor t{tid}")
            cons[tid] = NamedSharding(mesh, to_partition_spec(spec))
        reads = {tid: [(pos, NamedSharding(mesh, to_partition_spec(spec))) for pos, spec in steps]
                 for tid, steps in read_layouts(st, flat).items()}
        return cons, reads

    def arg(self, i: int, s: int) -> NamedSharding:
        """Where argument leaf ``i`` lives on stage ``s``."""
        sh = self._args.get((i, s))
        if sh is None:
            sh = self._args[(i, s)] = self._arg_sharding(i, s)
        return sh

    def _arg_sharding(self, i: int, s: int) -> NamedSharding:
        key = self.leaf_key[i]
        aval = self.flat.avals[i]
        st = self.plan.stages[s]
        spec = None
        if i in self.is_batch:
            c = self.constraints[s].get(i)
            if c is not None:
                return c
            spec = self._batch_table.get(key)
        else:
            spec = dict(st.params).get(key)
        if spec is not None:
            try:
                check_spec(spec, aval.shape, st.logical_mesh, f"stage {s} argument {key}")
            except StalePlanError:
                if i not in self.is_batch:
                    raise
                spec = None     # a batch spec of another stage's mesh: replicate here
        ps = to_partition_spec(spec) if spec is not None else PartitionSpec()
        return NamedSharding(self.meshes[s], ps)

    def planned(self, x: int, s: int) -> NamedSharding | None:
        """The plan's layout of value or argument leaf ``x`` on stage ``s``, if any."""
        if x in self.leaf_key:
            return self.arg(x, s)
        return self.constraints[s].get(x)

    def acc(self, x: int, s: int) -> NamedSharding:
        """Where the running sum of ``x`` lives on stage ``s``: its planned
        layout, else replicated."""
        sh = self.constraints[s].get(x)
        return sh if sh is not None else NamedSharding(self.meshes[s], PartitionSpec())

    def send(self, v: Any, x: int, s: int) -> NamedSharding:
        """Where value ``x`` (the array ``v`` of another stage) lands on stage
        ``s``: its planned layout there, else ``v``'s spec when it fits the
        stage's mesh, else replicated."""
        sh = self._sends.get((x, s))
        if sh is None:
            sh = self.constraints[s].get(x)
            if sh is None:
                cur = getattr(v, "sharding", None)
                spec = cur.spec if isinstance(cur, NamedSharding) else PartitionSpec()
                st = self.plan.stages[s]
                try:
                    check_spec(tuple(_norm(d) for d in spec) + (None,) * (v.ndim - len(spec)),
                               v.shape, st.logical_mesh, "transfer")
                    sh = NamedSharding(self.meshes[s], spec)
                except StalePlanError:
                    sh = NamedSharding(self.meshes[s], PartitionSpec())
            self._sends[(x, s)] = sh
        return sh

    def cross(self, x: int, r: int, s: int, ndim: int) -> NamedSharding:
        """[multi-host] where a value from another process lands on stage
        ``s``: its planned layout there, else its planned layout on ``r`` when
        stage ``s`` has those axes, else replicated.  (The same in every
        process: the receiver cannot see the sender's array.)"""
        sh = self._cross.get((x, s))
        if sh is None:
            sh = self.constraints[s].get(x)
            if sh is None:
                theirs = self.constraints[r].get(x)
                sh = NamedSharding(self.meshes[s], PartitionSpec())
                if theirs is not None:
                    spec = tuple(_norm(d) for d in theirs.spec) + (None,) * (ndim - len(theirs.spec))
                    try:
                        check_spec(spec, self.flat.avals[x].shape, self.plan.stages[s].logical_mesh,
                                   "transfer")
                        sh = NamedSharding(self.meshes[s], PartitionSpec(*spec))
                    except StalePlanError:
                        pass
            self._cross[(x, s)] = sh
        return sh


def _norm(d: Any) -> Any:
    return tuple(d) if isinstance(d, (list, tuple)) else d


# ---------------------------------------------------------------------------
# Programs
# ---------------------------------------------------------------------------

def build_programs(split: StepSplit, flat: FlatJaxpr, layouts: StageLayouts,
                   donate: Mapping[tuple, tuple[int, ...]] | None = None,
                   partial: Mapping[int, PartialSums] | None = None) -> dict[tuple, Program]:
    """One jitted program per task of ``split``; ``donate``: per task key, the
    positions of its inputs it takes over (see :func:`donations`);
    ``partial``: the backwards keep partial gradients (see
    :mod:`~meshplan.runtime.pipeline_partial`)."""
    donate = donate or {}
    return {key: _program(task, split, flat, layouts, donate.get(key, ()), partial)
            for key, task in split.tasks.items()}


def donations(split: StepSplit, flat: FlatJaxpr, donated: frozenset[int],
              m: int) -> dict[tuple, tuple[int, ...]]:
    """Per task key, the input positions its program donates: every running
    sum (ours alone), and, in the last update program reading it, each leaf
    of ``donated`` (the caller's state) and each value an earlier update of
    the same stage made, where an output of the same shape and dtype can
    take its buffer.  Every micro-batch program runs before the first
    update, so only updates can read a value after its last update reader:
    a tied weight, read by several stages, is taken over by the last update
    reading it.  What the step returns as it is stays (jax 0.10.2 crashes on
    an already-donated array)."""
    leaf_ids = set(flat.invars)
    returned = returned_leaves(split, flat)
    handed = {x for x in flat.outvars if isinstance(x, int)}
    updates = sorted((k for k in split.tasks if k[0] == "A"), key=lambda k: (k[2], k[1]))
    made = {x: k for k in updates for x in split.tasks[k].outputs}
    last: dict[int, tuple[tuple, int]] = {}     # value -> (its last update reader, position)
    for key in updates:
        for pos, x in enumerate(split.tasks[key].inputs):
            src = x if x in leaf_ids or x in split.producer else split.alias.get(x, x)
            last[src] = (key, pos)
    out: dict[tuple, list[int]] = {}
    leaf_pos = set()
    for src, (key, pos) in last.items():
        if src in donated and src not in returned:
            out.setdefault(key, []).append(pos)
            leaf_pos.add((key, pos))
        elif src in made and made[src][1] == key[1] and src not in handed:
            out.setdefault(key, []).append(pos)
    for key, t in split.tasks.items():
        if key[0] != "A" and m > 1 and t.accumulate:
            out.setdefault(key, []).extend(range(len(t.inputs), len(t.inputs) + len(t.accumulate)))
    result = {}
    for key, positions in out.items():
        t = split.tasks[key]
        free = [_aval_key(flat.avals.get(x)) for x in list(t.outputs) + list(t.accumulate)]
        keep = []
        # (the caller's leaves first: their buffers are reused as under jax.jit)
        for pos in sorted(positions, key=lambda p: (p < len(t.inputs) and (key, p) not in leaf_pos, p)):
            if pos >= len(t.inputs):             # a running sum: its new value takes it
                keep.append(pos)
                continue
            want = _aval_key(flat.avals.get(t.inputs[pos]))
            if want is not None and want in free and list(t.inputs).count(t.inputs[pos]) == 1:
                free.remove(want)
                keep.append(pos)
        if keep:
            result[key] = tuple(sorted(keep))
    return result


def returned_leaves(split: StepSplit, flat: FlatJaxpr) -> frozenset[int]:
    """The argument leaves the step returns as they are."""
    leaf_ids = set(flat.invars)
    out = set()
    for x in flat.outvars:
        if isinstance(x, int):
            src = x if x in leaf_ids or x in split.producer else split.alias.get(x, x)
            if src in leaf_ids:
                out.add(src)
    return frozenset(out)


def _aval_key(aval: Any) -> tuple | None:
    shape = getattr(aval, "shape", None)
    return None if shape is None else (tuple(shape), str(aval.dtype))


def closure_eqns(task: Task, split: StepSplit, flat: FlatJaxpr) -> list[int]:
    """The task's equations plus the constant equations it reads, in flat order."""
    eqns = flat.eqns
    own = set(task.eqns)
    stack = [x for k in task.eqns for x in eqns[k].invars if isinstance(x, int)]
    while stack:
        x = stack.pop()
        k = split.const_eqn.get(x)
        if k is not None and k not in own:
            own.add(k)
            stack.extend(y for y in eqns[k].invars if isinstance(y, int))
    return sorted(own)


def _sub(flat: FlatJaxpr, eqn_ids: list[int], inputs: Sequence[int],
         outputs: Sequence[int]) -> FlatJaxpr:
    read = {x for k in eqn_ids for x in flat.eqns[k].invars if isinstance(x, int)}
    read |= set(outputs)
    # captured constants go in as host values: a constant committed to a
    # device of another stage must not be handed to this stage's program
    cv = [(i, np.asarray(c) if isinstance(c, jax.Array) else c)
          for i, c in zip(flat.constvars, flat.consts) if i in read]
    return FlatJaxpr(tuple(inputs), tuple(i for i, _ in cv), tuple(c for _, c in cv),
                     tuple(flat.eqns[k] for k in eqn_ids), tuple(outputs), flat.avals)


def _at_full_batch(flat: FlatJaxpr, eqn_ids: Sequence[int],
                   full_eqns: Mapping[int, Any]) -> FlatJaxpr:
    """``flat`` with the equations ``eqn_ids`` of an R task that have a
    full-batch form run in that form (its draws over the batch and their
    per-example keys, its batch statistics and what they are computed from):
    made once per step, cut into micro-batches by the driver (draws) or read
    whole by each (statistics)."""
    eqns = list(flat.eqns)
    for k in eqn_ids:
        if k in full_eqns:
            eqns[k] = dataclasses.replace(eqns[k], eqn=full_eqns[k])
    return dataclasses.replace(flat, eqns=tuple(eqns))


def _full_batch_literals(flat: FlatJaxpr, eqn_ids: Sequence[int], split: StepSplit) -> FlatJaxpr:
    """``flat`` with the equations ``eqn_ids`` of an update task reading the
    whole batch's literals and constants (``split.full_literals``): it runs
    on the whole batch's values (see :func:`~.pipeline_split.split_step`)."""
    eqns = list(flat.eqns)
    for k in eqn_ids:
        if k in split.full_literals:
            eqns[k] = dataclasses.replace(eqns[k], invars=split.full_literals[k])
    consts = tuple(split.full_consts.get(i, c) for i, c in zip(flat.constvars, flat.consts))
    return dataclasses.replace(flat, eqns=tuple(eqns), consts=consts)


def _program(task: Task, split: StepSplit, flat: FlatJaxpr, layouts: StageLayouts,
             donate: tuple[int, ...] = (),
             partial: Mapping[int, PartialSums] | None = None) -> Program:
    s = task.stage
    ps = partial.get(s) if partial is not None else None
    if ps is not None and task.kind == "B":
        local = partial_program(task, split, layouts, ps, _sub)
        acc_sh = [acc_sharding(ps, layouts.acc(x, s)) for x in task.accumulate]

        def backward(*xs: Any) -> tuple[list[Any], list[Any]]:
            plain, new = local(*xs)
            return list(plain), [jax.lax.with_sharding_constraint(v, sh)
                                 for v, sh in zip(new, acc_sh)]
        backward.__name__ = backward.__qualname__ = f"stage{s}_B"
        return Program(task, jax.jit(backward, donate_argnums=donate), layouts.constraints[s],
                       donate)
    eqn_ids = closure_eqns(dataclasses.replace(task, eqns=sorted(task.replay + task.eqns)),
                            split, flat)
    if task.kind == "R":
        flat = _at_full_batch(flat, eqn_ids, split.full_eqns)
        flat = _full_batch_literals(flat, [k for k in eqn_ids if k in split.full_eqns], split)
    elif task.kind == "A" and (split.full_literals or split.full_consts):
        flat = _full_batch_literals(flat, eqn_ids, split)
    outs = list(task.outputs) + [x for x in task.accumulate if x not in task.outputs]
    sub = _sub(flat, eqn_ids, task.inputs, outs)
    cons = layouts.constraints[s]
    reads = layouts.reads[s]
    evaluate = make_evaluator(sub, cons, reads) if reads else make_evaluator(sub, cons)
    n_out = len(task.outputs)
    acc_pos = [outs.index(x) for x in task.accumulate]
    acc_sh = [layouts.acc(x, s) for x in task.accumulate]
    n_in = len(task.inputs)

    def program(*xs: Any) -> tuple[list[Any], list[Any]]:
        vals = evaluate(*xs[:n_in])
        accs = xs[n_in:]
        plain = [_weak_as_traced(v, flat.avals.get(x)) for v, x in zip(vals[:n_out], task.outputs)]
        new = [vals[p] for p in acc_pos]
        if accs:
            new = [_combine(split.extremum.get(x, ""), a, v)
                   for x, a, v in zip(task.accumulate, accs, new)]
        # the running sums keep one layout: one compiled program per task
        return plain, [jax.lax.with_sharding_constraint(v, sh) for v, sh in zip(new, acc_sh)]

    program.__name__ = f"stage{s}_{task.kind}{task.level if task.kind == 'A' else ''}"
    program.__qualname__ = program.__name__
    return Program(task, jax.jit(program, donate_argnums=donate), cons, donate)


def _weak_as_traced(v: Any, aval: Any) -> Any:
    """``v`` weakly typed where the step's trace has it so (a parameter made
    by ``jnp.array(2.0)``: its update, from running sums of a dtype's zeros,
    came back strongly typed, and the next call was refused as another
    signature)."""
    if getattr(aval, "weak_type", False) and not getattr(v, "weak_type", True):
        from jax._src.lax.lax import _convert_element_type     # (no public way)
        return _convert_element_type(v, aval.dtype, weak_type=True)
    return v


def _combine(extremum: str, a: Any, v: Any) -> Any:
    """A running sum taking in a micro-batch's value (a maximum: the larger)."""
    if not extremum:
        return a + v
    return (jax.numpy.maximum if extremum == "max" else jax.numpy.minimum)(a, v)


def _start(shape: tuple[int, ...], dtype: Any, extremum: str) -> Any:
    """A running sum's start: zero, or for a maximum (minimum) the dtype's
    smallest (largest) value."""
    if not extremum:
        return jax.numpy.zeros(shape, dtype)
    if jax.numpy.dtype(dtype) == jax.numpy.bool_:
        return jax.numpy.full(shape, extremum == "min", dtype)
    info = jax.numpy.finfo(dtype) if jax.numpy.issubdtype(dtype, jax.numpy.inexact) \
        else jax.numpy.iinfo(dtype)
    return jax.numpy.full(shape, info.min if extremum == "max" else info.max, dtype)


def fixed_outputs(split: StepSplit, flat: FlatJaxpr, whole: FlatJaxpr | None = None
                  ) -> tuple[tuple[int, ...], Callable[[], Any]]:
    """The positions among the step's outputs of those made from literals
    and constants alone, and a jitted function making them: arrays of the
    dtypes and weak types ``jax.jit`` returns, made anew each call (a caller
    may donate them back, as a state's ``first_step=False``).  ``whole``:
    the step traced at the whole batch, the same equations; its literals and
    constants are the outputs' (``x.shape[0]``, ``jnp.sum(jnp.ones(B))``:
    the micro-batch's trace holds the micro-batch's size)."""
    src = whole if whole is not None and same_stream(flat, whole) else flat
    makers: dict[int, Callable[[], Any]] = {}
    for k, (x, y) in enumerate(zip(flat.outvars, src.outvars)):
        if isinstance(x, Lit):
            makers[k] = lambda v=(y.value if isinstance(y, Lit) else x.value): v
        elif x in split.const_eqn:
            makers[k] = _constant(split, src, x)
    keys = tuple(makers)
    return keys, jax.jit(lambda: [makers[k]() for k in keys])


def constant_gradients(split: StepSplit, flat: FlatJaxpr
                       ) -> tuple[tuple[int, ...], Callable[[], Any]]:
    """The marked gradients made from constants alone (the zeros of a
    parameter the loss never reads, under meshplan.value_and_grad), which no
    stage program makes: their ids (the marker's operand, or its output
    where the operand is a literal) and a jitted function making them for
    the update."""
    makers: dict[int, Callable[[], Any]] = {}
    for fe in flat.eqns:
        if fe.eqn.primitive.name == GRAD_BOUNDARY:
            for i, o in zip(fe.invars, fe.outvars):
                if isinstance(i, Lit):
                    makers[o] = lambda v=i.value, a=flat.avals[o]: jax.numpy.asarray(v, a.dtype)
                elif i in split.const_eqn:
                    makers[i] = _constant(split, flat, i)
    ids = tuple(sorted(makers))
    return ids, jax.jit(lambda: [makers[k]() for k in ids])


def _constant(split: StepSplit, flat: FlatJaxpr, x: int) -> Callable[[], Any]:
    """A function computing the constant value ``x`` (traceable)."""
    t = Task("K", 0, 0, [split.const_eqn[x]])
    f = make_evaluator(_sub(flat, closure_eqns(t, split, flat), (), (x,)), {})
    return lambda: f()[0]


# ---------------------------------------------------------------------------
# Running sums over micro-batches
# ---------------------------------------------------------------------------

class RunningSums:
    """Jitted functions making the zero running sums of a stage and the
    means of its sums (made on first use, one per stage and count)."""

    def __init__(self, split: StepSplit, flat: FlatJaxpr, layouts: StageLayouts, m: int,
                 partial: Mapping[int, PartialSums] | None = None) -> None:
        self.split, self.flat, self.layouts, self.m = split, flat, layouts, m
        self.partial = partial or {}       # stage -> its PartialSums
        self._zeros: dict[int, tuple[list[int], Callable[[], list[Any]]]] = {}
        self._means: dict[tuple[int, int], Callable[..., Any]] = {}

    def zeros(self, s: int) -> tuple[list[int], Callable[[], list[Any]]]:
        """(ids, a jitted function making zero running sums) of stage ``s``."""
        hit = self._zeros.get(s)
        if hit is None:
            ids = [x for key, t in self.split.tasks.items() if key[0] != "A" and key[1] == s
                   for x in t.accumulate]
            structs = [self.struct(x, s) for x in ids]

            ext = [self.split.extremum.get(x, "") for x in ids]

            def zeros() -> list[Any]:
                return [_start(a.shape, a.dtype, e) for a, e in zip(structs, ext)]
            shardings = [a.sharding for a in structs]
            hit = self._zeros[s] = (ids, jax.jit(zeros, out_shardings=shardings))
        return hit

    def struct(self, x: int, s: int) -> jax.ShapeDtypeStruct:
        """The running sum of ``x`` on stage ``s``: the gradient's shape on its
        layout, or with partial sums ``(D, *shape)`` with one row per data shard."""
        aval, sh = self.flat.avals[x], self.layouts.acc(x, s)
        ps = self.partial.get(s)
        if ps is None or x not in ps.ids:
            return jax.ShapeDtypeStruct(tuple(aval.shape), aval.dtype, sharding=sh)
        return jax.ShapeDtypeStruct((ps.size, *aval.shape), aval.dtype,
                                    sharding=acc_sharding(ps, sh))

    def mean(self, s: int, n: int) -> Callable[..., Any]:
        """A jitted function dividing the ``n`` sums of stage ``s`` (in the
        order of :meth:`zeros`) by the number of micro-batches; with partial
        sums it first adds the data shards' rows (the one gradient reduction
        of the step) and leaves each mean on its planned layout."""
        f = self._means.get((s, n))
        if f is None:
            m, ps = self.m, self.partial.get(s)
            ids = self.zeros(s)[0]
            # (a sum over the examples of degree e: divided by m ** (1 - e); with
            # partial sums, the data shards' rows added first, by (m * D) ** (1 - e))
            rows = [ps is not None and x in ps.ids for x in ids]
            div = [1.0 if x in self.split.extremum else
                   float(m * (ps.size if r else 1)) ** (1 - self.split.degree.get(x, 0))
                   for x, r in zip(ids, rows)]

            # (a weakly typed value stays so: a parameter made by jnp.asarray(1.0)
            # whose update runs per micro-batch, its mean the step's output)
            avals = [self.flat.avals.get(x) for x in ids]

            def total(x: Any, r: bool, d: float, aval: Any) -> Any:
                x = x.sum(0) if r else x
                return _weak_as_traced(x if d == 1 else (x / d).astype(x.dtype), aval)
            if not any(rows):
                def mean(*xs: Any) -> list[Any]:
                    return [total(x, False, d, a) for x, d, a in zip(xs, div, avals)]
                # (the sums are ours and read by nothing after: taken over)
                mean.__name__ = mean.__qualname__ = f"stage{s}_mean"
                f = jax.jit(mean, donate_argnums=tuple(range(n)))
            else:
                shardings = [self.layouts.acc(x, s) for x in ids]

                def mean(*xs: Any) -> list[Any]:
                    return [jax.lax.with_sharding_constraint(total(x, r, d, a), sh)
                            for x, r, d, sh, a in zip(xs, rows, div, shardings, avals)]
                mean.__name__ = mean.__qualname__ = f"stage{s}_mean"
                f = jax.jit(mean)
            self._means[(s, n)] = f
        return f
