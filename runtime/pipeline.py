"""Run a multi-stage (pipeline) plan: stages on submeshes, GPipe and 1F1B.

How a plan becomes programs
---------------------------
The step is traced at the *micro-batch* shapes (the batch arguments' dimension
0 divided by ``plan.num_micro_batches``) with ``jax.make_jaxpr`` and flattened
with :func:`meshplan.jaxpr_walk.flatten`: the very equation stream (and integer
tensor ids) the inter-operator pass planned, so ``Plan.layer_of_node`` gives
the layer of every equation and ``Stage.layers`` the stage of every layer.
Every equation then gets a *phase*:

* ``F`` (forward): ancestors of the step's metric outputs (the loss), as the
  planner's :func:`forward_nodes` defines them;
* ``B`` (backward): every other equation that must run once per micro-batch:
  the ancestors of the gradients (the inputs of the ``meshplan.grad`` marker)
  and everything else that reads the batch;
* ``A`` (apply): what runs once per step after the micro-batches: the
  equations downstream of the gradients (the optimizer update) and those that
  read only state (a step counter);
* values made from constants alone (masks, iotas) are recomputed by every
  program that reads them instead of being sent between stages.

Per stage there is one forward and one backward program (each a ``jax.jit`` of
an evaluator that replays its equations, with the stage's planned sharding
constraints) and the apply work of the stage, cut into "levels" where the
update needs values of another stage (a global gradient norm).  The driver
dispatches the programs asynchronously in the schedule's order (GPipe: all
forwards, then all backwards; 1F1B: warm-up forwards, then one forward / one
backward), keeps a micro-batch's activations only until its backward ran,
accumulates gradients per stage (the gradient is the mean over micro-batches,
i.e. the loss is taken to be a mean over the batch), applies each stage's
update once and returns the outputs as the undecorated step does.

Values cross stages only through an explicit ``jax.device_put`` onto a
``NamedSharding`` of the receiving stage's mesh (jax 0.10.2 crashed on the
cached second call of a program given an array of another submesh).  Nothing
is donated (jax 0.10.2 crashes on a call with an already-donated array).

What is not the same as the undecorated step (with more than one
micro-batch): metric outputs and other batch-dependent values that the update
or the outputs read (batch-norm running statistics) are *averaged* over the
micro-batches, which is exact for means over the batch and not for sums or
variances; batch normalisation normalises with micro-batch statistics.  A
batch-dependent integer output cannot be averaged and is refused; so is an
update that reads the batch itself.  Outputs whose dimension 0 is the batch
(per-example predictions) are concatenated.
"""
from __future__ import annotations

import dataclasses
import functools
import queue
import threading
import time
import warnings
from collections import defaultdict
from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from meshplan.errors import MeshplanError, RuntimeStageError, StalePlanError
from meshplan.jaxpr_walk import FlatJaxpr, Lit, flatten
from meshplan.markers import GRAD_BOUNDARY
from meshplan.plan import Plan, arg_prefixes
from meshplan.graph import forward_nodes
from meshplan.timeline import Block, schedule_order

from .shard import (FastPathMiss, _signature, build_mesh, check_spec, make_evaluator,
                    stage_devices, to_partition_spec)

__all__ = ["PipelineExecutable", "StepSplit", "split_step", "schedule_order", "SCHEDULES"]

SCHEDULES = ("gpipe", "1f1b")

# kinds of value crossing from the per-micro-batch phase to the update/outputs
MEAN, LAST, CONCAT = "mean", "last", "concat"


# ---------------------------------------------------------------------------
# The split: every equation to a (phase, stage); tasks and their wiring
# ---------------------------------------------------------------------------

@dataclasses.dataclass
class Task:
    """One program: the equations of one stage in one phase (``level`` orders
    the apply programs of a step)."""
    kind: str                     # "F", "B" or "A"
    stage: int
    level: int = 0
    eqns: list[int] = dataclasses.field(default_factory=list)     # own equations (flat order)
    inputs: tuple[int, ...] = ()     # ids read from outside the program
    outputs: tuple[int, ...] = ()    # ids other programs / the step outputs need
    accumulate: tuple[int, ...] = () # ids summed over micro-batches (C phase)

    @property
    def key(self) -> tuple:
        return (self.kind, self.stage) if self.kind != "A" else ("A", self.stage, self.level)

    def name(self) -> str:
        what = {"F": "forward", "B": "backward", "A": "update"}[self.kind]
        lvl = f" (part {self.level})" if self.kind == "A" and self.level else ""
        return f"stage {self.stage} {what}{lvl}"


@dataclasses.dataclass
class StepSplit:
    """The step cut into per-stage programs (pure data; see :func:`split_step`)."""
    num_stages: int
    eqn_stage: list[int]
    eqn_phase: list[str]              # "F", "B", "A", "K" (constant), "M" (gradient marker)
    tasks: dict[tuple, Task]
    producer: dict[int, tuple]        # id -> task key that makes it (C and A phases)
    const_eqn: dict[int, int]         # id -> constant equation making it
    crossing: dict[int, str]          # C-phase id read after the micro-batches -> MEAN/LAST/CONCAT
    alias: dict[int, int]             # gradient-marker output id -> its input id
    batch_ids: frozenset[int]
    deps: dict[tuple, set[tuple]]     # C task key -> C task keys it reads from (same micro-batch)
    moved: int = 0                    # ops moved off their layer's stage to keep a pipeline


def split_step(flat: FlatJaxpr, forward: Sequence[bool], layer_of_node: Sequence[int],
               stage_layers: Sequence[tuple[int, int]], batch_ids: Sequence[int],
               num_micro_batches: int, concat_outputs: Sequence[int] = ()) -> StepSplit:
    """Assign every equation of ``flat`` to a stage and phase and build the
    tasks (see the module doc).  ``concat_outputs``: output ids whose
    dimension 0 is the batch."""
    eqns = flat.eqns
    n = len(eqns)
    if len(layer_of_node) != n:
        raise StalePlanError(
            f"the plan's layering covers {len(layer_of_node)} operations but the step traced at "
            f"micro-batch size has {n}; the plan was made for another function or other shapes: "
            "re-plan with these arguments")
    p = len(stage_layers)
    stage_of_layer: dict[int, int] = {}
    for s, (first, last) in enumerate(stage_layers):
        for l in range(first, last + 1):
            stage_of_layer[l] = s
    missing = sorted({l for l in layer_of_node if l not in stage_of_layer})
    if missing:
        raise StalePlanError(f"the plan's stages do not cover layer {missing[0]}; re-plan")
    eqn_stage = [stage_of_layer[l] for l in layer_of_node]
    batch_ids = frozenset(batch_ids)
    invars = set(flat.invars)
    constvars = set(flat.constvars)

    producer_eqn: dict[int, int] = {}
    for k, fe in enumerate(eqns):
        for o in fe.outvars:
            producer_eqn[o] = k
    # constant equations: read only constants and literals (transitively)
    const_ids = set(constvars)
    is_const = [False] * n
    for k, fe in enumerate(eqns):
        if all(isinstance(x, Lit) or x in const_ids for x in fe.invars):
            is_const[k] = True
            const_ids.update(fe.outvars)
    # batch dependence and "after the gradients"
    bdep = set(batch_ids)
    after = set()
    markers = [k for k, fe in enumerate(eqns) if fe.eqn.primitive.name == GRAD_BOUNDARY]
    alias: dict[int, int] = {}
    for k in markers:
        for i, o in zip(eqns[k].invars, eqns[k].outvars):
            if isinstance(i, int):
                alias[o] = i
    for k, fe in enumerate(eqns):
        ins = [x for x in fe.invars if isinstance(x, int)]
        if k in markers:
            after.update(fe.outvars)
            continue
        if any(x in bdep for x in ins):
            bdep.update(fe.outvars)
        if any(x in after for x in ins):
            after.update(fe.outvars)
    if not markers and num_micro_batches > 1:
        raise MeshplanError(
            "running more than one micro-batch needs to know where the gradients end: compute "
            "them with meshplan.value_and_grad / meshplan.grad instead of jax's (or plan with "
            "num_micro_batches=1)")
    # C phase: ancestors of the gradients and of everything batch-dependent
    # that does not come after the gradients
    need: set[int] = set()
    for k in markers:
        need.update(x for x in eqns[k].invars if isinstance(x, int))
    for k, fe in enumerate(eqns):
        if not is_const[k] and k not in markers and any(o in bdep for o in fe.outvars) \
                and not any(o in after for o in fe.outvars):
            need.update(fe.outvars)
    in_c = [False] * n
    for k in range(n - 1, -1, -1):
        fe = eqns[k]
        if k in markers or is_const[k]:
            continue
        if any(o in need for o in fe.outvars):
            if any(o in after for o in fe.outvars):
                raise MeshplanError(
                    f"operation {k} ({fe.eqn.primitive.name}) is needed to compute the gradients "
                    "but reads a gradient itself; the step cannot be split into micro-batches")
            in_c[k] = True
            need.update(x for x in fe.invars if isinstance(x, int))
    phase = []
    for k in range(n):
        if k in markers:
            phase.append("M")
        elif is_const[k]:
            phase.append("K")
        elif in_c[k]:
            phase.append("F" if forward[k] else "B")
        else:
            phase.append("A")

    # ---- keep the per-micro-batch work a pipeline: a forward op runs no
    # earlier than the forward ops it reads, a backward op no later than the
    # backward ops it reads (the planner's layering guarantees it for the
    # usual steps; an odd op is moved, deterministically)
    moved = 0
    for k, fe in enumerate(eqns):
        if phase[k] == "F":
            src = [eqn_stage[producer_eqn[x]] for x in fe.invars
                   if isinstance(x, int) and x in producer_eqn and phase[producer_eqn[x]] == "F"]
            if src and max(src) > eqn_stage[k]:
                eqn_stage[k] = max(src)
                moved += 1
    consumers: dict[int, list[int]] = defaultdict(list)
    for k, fe in enumerate(eqns):
        if phase[k] == "B":
            for x in fe.invars:
                if isinstance(x, int) and x in producer_eqn:
                    consumers[producer_eqn[x]].append(k)
    for k in range(n - 1, -1, -1):
        if phase[k] == "B":
            users = [eqn_stage[c] for c in consumers.get(k, ())]
            if users and max(users) > eqn_stage[k]:
                eqn_stage[k] = max(users)
                moved += 1

    # ---- apply levels: a stage's update work is cut where it needs a value
    # computed by another stage's update work
    level_of_id: dict[int, int] = {}
    tasks: dict[tuple, Task] = {}
    eqn_task: list[tuple | None] = [None] * n
    for k, fe in enumerate(eqns):
        ph, s = phase[k], eqn_stage[k]
        if ph in ("K", "M"):
            continue
        if ph == "A":
            lvl = 0
            for x in fe.invars:
                if isinstance(x, int) and x in level_of_id:
                    pk = producer_eqn[x]
                    lvl = max(lvl, level_of_id[x] + (eqn_stage[pk] != s))
            for o in fe.outvars:
                level_of_id[o] = lvl
            key = ("A", s, lvl)
        else:
            key = (ph, s)
        if key not in tasks:
            tasks[key] = Task(ph, s, key[2] if ph == "A" else 0)
        tasks[key].eqns.append(k)
        eqn_task[k] = key
    producer: dict[int, tuple] = {}
    for k, key in enumerate(eqn_task):
        if key is not None:
            for o in eqns[k].outvars:
                producer[o] = key
    const_eqn = {o: k for k, fe in enumerate(eqns) if is_const[k] for o in fe.outvars}

    # ---- wiring: inputs, outputs, what crosses into the update phase
    out_ids = [x for x in flat.outvars if isinstance(x, int)]
    needed_by: dict[int, set[tuple]] = defaultdict(set)
    for key, t in tasks.items():
        own = {o for k in t.eqns for o in eqns[k].outvars}
        ins: list[int] = []
        seen: set[int] = set()
        for k in t.eqns:
            for x in eqns[k].invars:
                if not isinstance(x, int) or x in own or x in seen or x in const_ids:
                    continue
                seen.add(x)
                ins.append(x)
        t.inputs = tuple(ins)
        for x in ins:
            needed_by[x].add(key)
    crossing: dict[int, str] = {}
    concat = set(concat_outputs)

    def c_phase(key: tuple | None) -> bool:
        return key is not None and key[0] in ("F", "B")

    def cross(x: int, why: str) -> None:
        if x in crossing or not c_phase(producer.get(x)):
            return
        if x in concat and x in bdep:
            crossing[x] = CONCAT
        elif x in bdep:
            aval = flat.avals[x]
            if num_micro_batches > 1 and not jax.numpy.issubdtype(aval.dtype, jax.numpy.inexact):
                raise MeshplanError(
                    f"{why} is a batch-dependent {aval.dtype} value, which cannot be averaged over "
                    "micro-batches; return floating-point means (or plan with num_micro_batches=1)")
            crossing[x] = MEAN
        else:
            crossing[x] = LAST

    for key, t in tasks.items():
        if key[0] != "A":
            continue
        for x in t.inputs:
            if x in batch_ids and num_micro_batches > 1:
                raise MeshplanError(
                    f"the update ({t.name()}) reads the batch itself; with micro-batches the "
                    "update may only read gradients, state and batch means")
            src = alias.get(x, x)
            cross(src, f"a value the update ({t.name()}) reads")
    for x in out_ids:
        cross(alias.get(x, x), "an output of the step")
    # marker outputs whose input comes straight from the C phase
    for o, i in alias.items():
        cross(i, "a gradient")
    deps: dict[tuple, set[tuple]] = {}
    for key, t in tasks.items():
        if key[0] == "A":
            outs = [o for k in t.eqns for o in eqns[k].outvars
                    if any(c != key for c in needed_by.get(o, ())) or o in out_ids]
        else:
            outs = [o for k in t.eqns for o in eqns[k].outvars
                    if any(c != key and c[0] != "A" for c in needed_by.get(o, ()))
                    or crossing.get(o) in (LAST, CONCAT)]
        t.outputs = tuple(dict.fromkeys(outs))
        t.accumulate = tuple(o for k in t.eqns for o in eqns[k].outvars if crossing.get(o) == MEAN)
        if key[0] in ("F", "B"):
            deps[key] = {producer[x] for x in t.inputs if c_phase(producer.get(x))}
    # ---- the C phase must fit a pipeline: forward reads earlier stages'
    # forwards; backward reads forwards and later stages' backwards
    for key, ds in deps.items():
        for d in ds:
            ok = (d[0] == "F" and d[1] < key[1]) if key[0] == "F" else \
                (d[0] == "F" or (d[0] == "B" and d[1] > key[1]))
            if not ok:
                x = next(x for x in tasks[key].inputs if producer.get(x) == d)
                k = next(k for k in tasks[key].eqns if x in eqns[k].invars)
                raise MeshplanError(
                    f"the plan's layering does not fit a pipeline: {tasks[key].name()} "
                    f"(operation {k}, {eqns[k].eqn.primitive.name}) reads a value of "
                    f"{tasks[d].name()}; re-plan with other layer cuts (mark_pipeline_boundary)")
    return StepSplit(p, eqn_stage, phase, tasks, producer, const_eqn, crossing, alias,
                     batch_ids, deps, moved)


def dispatch_order(split: StepSplit, schedule: str, m: int) -> list[tuple[str, int, int]]:
    """One global order of (kind, stage, micro-batch) that follows every
    stage's schedule order and every data dependence."""
    p = split.num_stages
    orders = [[(k, i) for k, i in schedule_order(schedule, s, p, m) if (k, s) in split.tasks]
              for s in range(p)]
    pos = [0] * p
    done: set[tuple[str, int, int]] = set()
    out: list[tuple[str, int, int]] = []
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for s in range(p):
            while pos[s] < len(orders[s]):
                kind, i = orders[s][pos[s]]
                if any((d[0], d[1], i) not in done for d in split.deps[(kind, s)]):
                    break
                out.append((kind, s, i))
                done.add((kind, s, i))
                pos[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise MeshplanError(f"the {schedule} schedule deadlocks on this step's stage "
                                "dependencies; re-plan with another schedule")
    return out


# ---------------------------------------------------------------------------
# The executable
# ---------------------------------------------------------------------------

@dataclasses.dataclass
class _Program:
    task: Task
    fn: Callable[..., Any]                       # jitted
    constraints: Mapping[int, NamedSharding]


class PipelineExecutable:
    """``fn`` run under a multi-stage plan; called like ``fn``.

    ``args`` are example arguments (arrays or ``jax.ShapeDtypeStruct``) of
    the full batch; the executable runs that signature only (another one
    raises :class:`~meshplan.runtime.FastPathMiss` from :meth:`call_fast`, and
    :class:`~meshplan.StalePlanError` when called).  ``layer_of_node`` (default
    ``plan.layer_of_node``) is the layer of every operation of the step traced
    at micro-batch size.  ``timeline``: record what ran (see
    :attr:`last_timeline`).
    """

    def __init__(self, fn: Callable[..., Any], plan: Plan, args: Sequence[Any], *,
                 layer_of_node: Sequence[int] | None = None,
                 devices: Sequence[jax.Device] | None = None,
                 timeline: bool = True) -> None:
        if len(plan.stages) < 2:
            raise RuntimeStageError("PipelineExecutable runs plans of two or more stages; "
                                    "use ShardExecutable for one stage")
        if plan.schedule not in SCHEDULES:
            raise RuntimeStageError(
                f"the plan's schedule {plan.schedule!r} cannot be executed by this version "
                f"(it runs {' and '.join(SCHEDULES)}); re-plan with "
                "PipeshardParallel(schedule='1f1b') or schedule='gpipe'")
        layer_of_node = plan.layer_of_node if layer_of_node is None else tuple(layer_of_node)
        if not layer_of_node:
            raise StalePlanError("the pipeline plan does not record its layering "
                                 "(layer_of_node); re-plan with this version of meshplan")
        if jax.process_count() > 1:
            raise RuntimeStageError("pipeline plans run in one process only in this version")
        self.fn = fn
        self.plan = plan
        self.m = int(plan.num_micro_batches)
        self.schedule = plan.schedule
        self.p = len(plan.stages)
        self.record_timeline = timeline
        self.meshes = [build_mesh(s.logical_mesh, stage_devices(s, devices)) for s in plan.stages]
        seen: set[int] = set()
        for k, s in enumerate(plan.stages):
            overlap = seen & set(s.devices)
            if overlap:
                raise StalePlanError(f"stage {k} shares devices {sorted(overlap)} with an earlier "
                                     "stage; re-plan")
            seen |= set(s.devices)
        self._build(tuple(args), layer_of_node)
        self.last_stats: dict[str, Any] = {}
        self._timeline_jobs: list[Any] | None = None
        self._timeline: list[Block] | None = None
        self._watchers: list[_Watcher] | None = None
        self.probe: Callable[[str, Any], None] | None = None   # test hook: (event, info)

    # ---- building ---------------------------------------------------------
    def _build(self, args: tuple[Any, ...], layer_of_node: Sequence[int]) -> None:
        plan, m = self.plan, self.m
        self._sig = _signature(args)
        leaves_p, self._treedef = jax.tree_util.tree_flatten_with_path(args)[0], \
            jax.tree_util.tree_structure(args)
        self._nleaves = len(leaves_p)
        batch_leaf = [int(path[0].idx) in plan.batch_argnums for path, _ in leaves_p]
        sizes = {int(l.shape[0]) for (path, l), b in zip(leaves_p, batch_leaf) if b and l.shape}
        if len(sizes) > 1:
            raise MeshplanError(f"batch arguments disagree on the batch size: {sorted(sizes)}")
        if sizes:
            full = sizes.pop()
            if full % m:
                raise MeshplanError(f"the batch size {full} does not split into {m} micro-batches; "
                                    f"use a batch size divisible by {m}")
            self._mb = full // m
        else:
            self._mb = 0

        def shrink(x: Any) -> Any:
            return jax.ShapeDtypeStruct((x.shape[0] // m,) + tuple(x.shape[1:]), x.dtype) \
                if getattr(x, "shape", ()) else x

        def abstract(x: Any) -> Any:
            return jax.ShapeDtypeStruct(np.shape(x), getattr(x, "dtype", np.asarray(x).dtype))

        abs_args = jax.tree_util.tree_map(abstract, args)
        micro = tuple(jax.tree_util.tree_map(shrink, a) if i in plan.batch_argnums else a
                      for i, a in enumerate(abs_args))
        closed, out_shape = jax.make_jaxpr(self.fn, return_shape=True)(*micro)
        full_out = jax.eval_shape(self.fn, *abs_args)
        flat = flatten(closed)
        self.flat = flat
        from meshplan.trace import graph_from_jaxpr
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            graph = graph_from_jaxpr(closed, micro, out_shape, batch_argnums=tuple(plan.batch_argnums),
                                     name=getattr(self.fn, "__name__", "fn"),
                                     argnames=[f"arg{i}" for i in range(len(micro))])
        self._out_treedef = jax.tree_util.tree_structure(out_shape)
        micro_leaves = jax.tree_util.tree_leaves(out_shape)
        full_leaves = jax.tree_util.tree_leaves(full_out)
        concat = []
        for k, (a, b, x) in enumerate(zip(micro_leaves, full_leaves, flat.outvars)):
            if tuple(a.shape) != tuple(b.shape):
                if not (a.shape and b.shape and a.shape[0] * m == b.shape[0]
                        and a.shape[1:] == b.shape[1:]):
                    raise MeshplanError(f"output leaf {k} has shape {tuple(b.shape)} for the batch "
                                        f"but {tuple(a.shape)} for a micro-batch; only outputs whose "
                                        "dimension 0 is the batch can be split into micro-batches")
                if isinstance(x, int):
                    concat.append(x)
        batch_ids = [i for i, b in zip(flat.invars, batch_leaf) if b]
        split = split_step(flat, forward_nodes(graph), layer_of_node,
                           [s.layers for s in plan.stages], batch_ids, m, concat)
        self.split = split
        if m > 1:
            state_bdep = [o for o in graph.outputs if o.updates is not None and isinstance(o.tensor, int)
                          and split.crossing.get(o.tensor) == MEAN]
            if state_bdep:
                warnings.warn(
                    f"meshplan: {len(state_bdep)} state output(s) depend on the batch (e.g. "
                    f"{state_bdep[0].path}, batch-norm statistics): with {m} micro-batches they are "
                    "averaged over micro-batches and normalisation uses micro-batch statistics, "
                    "which differs from the undecorated step", stacklevel=3)

        # ---- shardings of the arguments, per stage
        nonbatch = [a for a in range(len(args)) if a not in plan.batch_argnums]
        batch = [a for a in range(len(args)) if a in plan.batch_argnums]
        prefixes = dict(arg_prefixes(nonbatch)) | dict(arg_prefixes(batch)) | dict(plan.arg_prefixes)
        batch_table = dict(plan.batch)
        self._leaf_key: dict[int, str] = {}
        self._leaf_index = {i: k for k, i in enumerate(flat.invars)}
        self._is_batch = {i for i, b in zip(flat.invars, batch_leaf) if b}
        for (path, _), i in zip(leaves_p, flat.invars):
            self._leaf_key[i] = prefixes.get(int(path[0].idx), "") + jax.tree_util.keystr(tuple(path[1:]))
        self._stage_constraints: list[dict[int, NamedSharding]] = []
        self._stage_reads: list[dict[int, list[tuple[int, NamedSharding]]]] = []
        for s, st in enumerate(plan.stages):
            mesh, logical = self.meshes[s], st.logical_mesh
            cons: dict[int, NamedSharding] = {}
            for tid, spec in st.constraints:
                aval = flat.avals.get(tid)
                if aval is None or not hasattr(aval, "shape"):
                    continue
                check_spec(spec, aval.shape, logical, f"stage {s} constraint on tensor t{tid}")
                cons[tid] = NamedSharding(mesh, to_partition_spec(spec))
            reads: dict[int, list[tuple[int, NamedSharding]]] = {}
            for tid, pos, spec in getattr(st, "read_constraints", ()):
                if tid in flat.avals:
                    reads.setdefault(tid, []).append((pos, NamedSharding(mesh, to_partition_spec(spec))))
            self._stage_constraints.append(cons)
            self._stage_reads.append(reads)
        self._in_sharding: dict[tuple[int, int], NamedSharding] = {}

        def arg_sharding(i: int, s: int) -> NamedSharding:
            key = self._leaf_key[i]
            aval = flat.avals[i]
            st = self.plan.stages[s]
            spec = None
            if i in self._is_batch:
                c = self._stage_constraints[s].get(i)
                if c is not None:
                    return c
                spec = batch_table.get(key)
            else:
                spec = dict(st.params).get(key)
            if spec is not None:
                try:
                    check_spec(spec, aval.shape, st.logical_mesh, f"stage {s} argument {key}")
                except StalePlanError:
                    if i not in self._is_batch:
                        raise
                    spec = None     # a batch spec of another stage's mesh: replicate here
            ps = to_partition_spec(spec) if spec is not None else PartitionSpec()
            return NamedSharding(self.meshes[s], ps)

        self._arg_sharding = arg_sharding
        # outputs that update an input keep that input's layout on their stage
        upd_of_out = {o.tensor: graph.inputs[o.updates].tensor for o in graph.outputs
                      if o.updates is not None}
        for x, i in upd_of_out.items():
            key = split.producer.get(x)
            if key is not None and key[0] == "A" and hasattr(flat.avals.get(x), "shape"):
                s = key[1]
                self._stage_constraints[s].setdefault(x, arg_sharding(i, s))

        # ---- programs
        self.programs: dict[tuple, _Program] = {}
        for key, task in split.tasks.items():
            self.programs[key] = self._program(task)
        # values of the outputs made from constants alone
        self._const_out: dict[int, Any] = {}
        for x in flat.outvars:
            if isinstance(x, int) and x in split.const_eqn:
                self._const_out[x] = self._const_value(x)
        self._order = dispatch_order(split, self.schedule, m)
        self._a_order = sorted((k for k in split.tasks if k[0] == "A"), key=lambda k: (k[2], k[1]))
        # consumers per C id within one micro-batch: (task key)
        self._c_consumers: dict[int, list[tuple]] = defaultdict(list)
        for key, t in split.tasks.items():
            if key[0] in ("F", "B"):
                for x in t.inputs:
                    self._c_consumers[x].append(key)

    def _closure_eqns(self, task: Task) -> list[int]:
        """The task's equations plus the constant equations it reads, in flat order."""
        eqns = self.flat.eqns
        own = set(task.eqns)
        stack = [x for k in task.eqns for x in eqns[k].invars if isinstance(x, int)]
        while stack:
            x = stack.pop()
            k = self.split.const_eqn.get(x)
            if k is not None and k not in own:
                own.add(k)
                stack.extend(y for y in eqns[k].invars if isinstance(y, int))
        return sorted(own)

    def _sub(self, eqn_ids: list[int], inputs: Sequence[int], outputs: Sequence[int]) -> FlatJaxpr:
        flat = self.flat
        read = {x for k in eqn_ids for x in flat.eqns[k].invars if isinstance(x, int)}
        read |= set(outputs)
        # captured constants go in as host values: a constant committed to a
        # device of another stage must not be handed to this stage's program
        cv = [(i, np.asarray(c) if isinstance(c, jax.Array) else c)
              for i, c in zip(flat.constvars, flat.consts) if i in read]
        return FlatJaxpr(tuple(inputs), tuple(i for i, _ in cv), tuple(c for _, c in cv),
                         tuple(flat.eqns[k] for k in eqn_ids), tuple(outputs), flat.avals)

    def _program(self, task: Task) -> _Program:
        s = task.stage
        eqn_ids = self._closure_eqns(task)
        outs = list(task.outputs) + [x for x in task.accumulate if x not in task.outputs]
        sub = self._sub(eqn_ids, task.inputs, outs)
        cons = self._stage_constraints[s]
        reads = self._stage_reads[s]
        evaluate = make_evaluator(sub, cons, reads) if reads else make_evaluator(sub, cons)
        n_out = len(task.outputs)
        acc_pos = [outs.index(x) for x in task.accumulate]
        acc_sh = [self._acc_sharding(x, s) for x in task.accumulate]
        n_in = len(task.inputs)

        def program(*xs: Any) -> tuple[list[Any], list[Any]]:
            vals = evaluate(*xs[:n_in])
            accs = xs[n_in:]
            plain = list(vals[:n_out])
            new = [vals[p] for p in acc_pos]
            if accs:
                new = [a + v for a, v in zip(accs, new)]
            # the running sums keep one layout: one compiled program per task
            return plain, [jax.lax.with_sharding_constraint(v, sh) for v, sh in zip(new, acc_sh)]

        program.__name__ = f"stage{s}_{task.kind}{task.level if task.kind == 'A' else ''}"
        program.__qualname__ = program.__name__
        return _Program(task, jax.jit(program), cons)

    def _acc_sharding(self, x: int, s: int) -> NamedSharding:
        """Where the running sum of ``x`` lives on stage ``s``: its planned
        layout, else replicated."""
        sh = self._stage_constraints[s].get(x)
        return sh if sh is not None else NamedSharding(self.meshes[s], PartitionSpec())

    def _zeros_fn(self, s: int) -> tuple[list[int], Callable[[], list[Any]]]:
        """(ids, a jitted function making zero running sums) of stage ``s``."""
        cache = self.__dict__.setdefault("_zeros", {})
        hit = cache.get(s)
        if hit is None:
            ids = [x for key, t in self.split.tasks.items() if key[0] != "A" and key[1] == s
                   for x in t.accumulate]
            avals = [self.flat.avals[x] for x in ids]
            shardings = [self._acc_sharding(x, s) for x in ids]

            def zeros() -> list[Any]:
                return [jax.numpy.zeros(a.shape, a.dtype) for a in avals]
            hit = cache[s] = (ids, jax.jit(zeros, out_shardings=shardings))
        return hit

    def _const_value(self, x: int) -> Any:
        k = self.split.const_eqn[x]
        t = Task("K", 0, 0, [k])
        sub = self._sub(self._closure_eqns(t), (), (x,))
        return make_evaluator(sub, {})()[0]

    # ---- running ----------------------------------------------------------
    def __call__(self, *args: Any) -> Any:
        if _signature(tuple(args)) != self._sig:
            raise StalePlanError("the arguments do not match the shapes this pipeline was built "
                                 "for; call the parallelized step (it re-plans per signature)")
        return self._run(tuple(args))

    def call_fast(self, args: tuple[Any, ...]) -> Any:
        leaves, treedef = jax.tree_util.tree_flatten(tuple(args))
        if treedef != self._treedef or len(leaves) != self._nleaves:
            raise FastPathMiss("another argument structure")
        if _signature(tuple(args)) != self._sig:
            raise FastPathMiss("another signature")
        return self._run(tuple(args), leaves)

    def lower(self, *args: Any) -> Any:
        raise MeshplanError("lower() returns the one program of a one-stage plan; a pipeline plan "
                            "runs one program per stage and phase (see .programs)")

    def _call(self, prog: _Program, ins: list[Any], accs: list[Any], what: str) -> Any:
        try:
            return prog.fn(*ins, *accs)
        except Exception as e:
            raise RuntimeStageError(
                f"pipeline {prog.task.name()} failed{what}: {type(e).__name__}: {e}") from e

    def _run(self, args: tuple[Any, ...], leaves: list[Any] | None = None) -> Any:
        split, m, flat = self.split, self.m, self.flat
        t_step = time.perf_counter()
        if leaves is None:
            leaves = jax.tree_util.tree_leaves(args)
        leaf_of = dict(zip(flat.invars, leaves))
        placed: dict[tuple[int, int], Any] = {}        # (arg id, stage) -> array there
        mb_cache: dict[tuple[int, int], list[Any]] = {}

        def arg_on(i: int, s: int, mb: int) -> Any:
            if i in self._is_batch:
                pieces = mb_cache.get((i, s))
                if pieces is None:
                    pieces = mb_cache[(i, s)] = self._split_batch(leaf_of[i], i, s)
                return pieces[mb]
            v = placed.get((i, s))
            if v is None:
                v = placed[(i, s)] = _place(leaf_of[i], self._sharding_for(i, s))
            return v

        # per micro-batch values: id -> array on its producer's stage; remote copies
        vals: list[dict[int, Any]] = [dict() for _ in range(m)]
        remaining: list[dict[int, int]] = [dict() for _ in range(m)]
        accs: list[dict[int, Any]] = [dict() for _ in range(self.p)]
        last: dict[int, Any] = {}
        concat: dict[int, list[Any]] = defaultdict(list)
        events: list[tuple] = []
        in_flight = [0] * self.p
        max_in_flight = [0] * self.p
        watch = self.record_timeline
        self._steps = getattr(self, "_steps", 0) + 1
        step_id = self._steps
        if watch:
            watchers = self._get_watchers()
        if m > 1:      # running sums start at zero: every program has one signature
            for s in range(self.p):
                ids, zeros = self._zeros_fn(s)
                if ids:
                    accs[s] = dict(zip(ids, zeros()))

        def fetch(x: int, s: int, mb: int, key: tuple) -> Any:
            if x in leaf_of:
                return arg_on(x, s, mb)
            v = vals[mb][x]
            rem = remaining[mb]
            rem[x] -= 1
            if rem[x] == 0:
                del vals[mb][x], rem[x]
            return self._send(v, x, s)

        for kind, s, i in self._order:
            key = (kind, s)
            prog = self.programs[key]
            task = prog.task
            ins = [fetch(x, s, i, key) for x in task.inputs]
            acc_in = [accs[s][x] for x in task.accumulate] if m > 1 else []
            t0 = time.perf_counter()
            plain, new = self._call(prog, ins, acc_in, f" on micro-batch {i}")
            t1 = time.perf_counter()
            if self.probe is not None:
                received = [v for x, v in zip(task.inputs, ins) if x not in leaf_of]
            del ins, acc_in
            for x, v in zip(task.accumulate, new):
                accs[s][x] = v
            for x, v in zip(task.outputs, plain):
                c = split.crossing.get(x)
                if c == LAST:
                    last[x] = v
                elif c == CONCAT:
                    concat[x].append(v)
                uses = len(self._c_consumers.get(x, ()))
                if uses:
                    vals[i][x] = v
                    remaining[i][x] = uses
            if kind == "F":
                in_flight[s] += 1
                max_in_flight[s] = max(max_in_flight[s], in_flight[s])
            elif ("F", s) in split.tasks:
                in_flight[s] -= 1
            events.append((s, i, kind, t0, t1))
            if watch:
                watchers[s].put(step_id, len(events) - 1, plain + new)
            if self.probe is not None:
                # (tests) what this program made and the activations it received
                self.probe("task", {"kind": kind, "stage": s, "micro_batch": i,
                                    "outputs": list(plain), "received": received})
                del received
            del plain, new
        leftover = [x for d in vals for x in d]
        if leftover:   # cannot happen: every value is counted to its consumers
            raise RuntimeStageError(f"internal: {len(leftover)} activation(s) left after the step")
        # ---- after the micro-batches: means, then the update, level by level
        done: dict[int, Any] = {}            # id -> array (on its producer's stage)
        done.update(last)
        for s in range(self.p):
            if not accs[s]:
                continue
            ids = list(accs[s])
            arrs = [accs[s][x] for x in ids]
            if m > 1:
                arrs = self._mean_fn(s, len(arrs))(*arrs)
            done.update(zip(ids, arrs))
        for x, parts in concat.items():
            done[x] = parts[0] if len(parts) == 1 else _concat(parts)
        for key in self._a_order:
            prog = self.programs[key]
            s = key[1]
            ins = []
            for x in prog.task.inputs:
                if x in leaf_of:
                    ins.append(arg_on(x, s, 0))
                else:
                    src = split.alias.get(x, x) if x not in done else x
                    if src in leaf_of:
                        ins.append(arg_on(src, s, 0))
                    else:
                        ins.append(self._send(done[src], src, s))
            t0 = time.perf_counter()
            plain, _ = self._call(prog, ins, [], "")
            t1 = time.perf_counter()
            del ins
            done.update(zip(prog.task.outputs, plain))
            events.append((s, -1, "A", t0, t1))
            if watch:
                watchers[s].put(step_id, len(events) - 1, plain)
        outs = []
        for x in flat.outvars:
            if isinstance(x, Lit):
                outs.append(x.value)
            elif x in self._const_out:
                outs.append(self._const_out[x])
            elif x in leaf_of:
                outs.append(leaf_of[x])
            else:
                src = x if x in done else split.alias.get(x, x)
                outs.append(leaf_of[src] if src in leaf_of else done[src])
        self.last_stats = {"max_in_flight": max_in_flight, "dispatch_s": time.perf_counter() - t_step,
                           "tasks": len(events)}
        self._timeline = None
        self._events = (t_step, events, step_id)
        if watch:
            self._timeline_jobs = [w.mark() for w in watchers]
        return jax.tree_util.tree_unflatten(self._out_treedef, outs)

    # ---- helpers ----------------------------------------------------------
    def _sharding_for(self, i: int, s: int) -> NamedSharding:
        sh = self._in_sharding.get((i, s))
        if sh is None:
            sh = self._in_sharding[(i, s)] = self._arg_sharding(i, s)
        return sh

    def _split_batch(self, x: Any, i: int, s: int) -> list[Any]:
        sh = self._sharding_for(i, s)
        mb, m = self._mb, self.m
        if m == 1:
            return [_place(x, sh)]
        if not isinstance(x, jax.Array):
            x = np.asarray(x)
            return [jax.device_put(x[k * mb:(k + 1) * mb], sh) for k in range(m)]
        return [jax.device_put(piece, sh) for piece in _split_rows(x, m)]

    def _send(self, v: Any, x: int, s: int) -> Any:
        """``v`` onto stage ``s``: unchanged if it already lives there, else one
        explicit ``device_put`` onto the receiving stage's sharding."""
        mesh = self.meshes[s]
        cur = getattr(v, "sharding", None)
        if isinstance(cur, NamedSharding) and cur.mesh == mesh:
            return v
        key = (x, s)
        sh = self._in_sharding.get(key)
        if sh is None:
            sh = self._stage_constraints[s].get(x)
            if sh is None:
                spec = cur.spec if isinstance(cur, NamedSharding) else PartitionSpec()
                st = self.plan.stages[s]
                try:
                    check_spec(tuple(_norm(d) for d in spec) + (None,) * (v.ndim - len(spec)),
                               v.shape, st.logical_mesh, "transfer")
                    sh = NamedSharding(mesh, spec)
                except StalePlanError:
                    sh = NamedSharding(mesh, PartitionSpec())
            self._in_sharding[key] = sh
        return jax.device_put(v, sh)

    def _mean_fn(self, s: int, n: int) -> Callable[..., Any]:
        cache = self.__dict__.setdefault("_means", {})
        f = cache.get((s, n))
        if f is None:
            m = self.m

            def mean(*xs: Any) -> list[Any]:
                return [(x / m).astype(x.dtype) for x in xs]
            f = cache[(s, n)] = jax.jit(mean)
        return f

    def _get_watchers(self) -> list["_Watcher"]:
        if self._watchers is None:
            self._watchers = [_Watcher() for _ in range(self.p)]
        return self._watchers

    @property
    def last_timeline(self) -> list[Block]:
        """What the last call ran: one :class:`meshplan.timeline.Block` per
        program (stage, micro-batch, ``"F"``/``"B"``, or ``"A"`` with
        micro-batch -1 for the update), times in seconds from the start of the
        call.  ``end`` is when the program's outputs were ready (observed by
        a watcher thread per stage); ``start`` is the later of its dispatch,
        the end of the stage's previous program and the end of the programs
        it reads from."""
        if self._timeline is not None:
            return self._timeline
        if not getattr(self, "_events", None):
            return []
        t_step, events, step_id = self._events
        ends: dict[int, float] = {}
        if self._timeline_jobs is not None:
            for w, upto in zip(self._watchers or [], self._timeline_jobs):
                ends.update(w.wait(step_id, upto))
        blocks: list[Block] = []
        stage_free = [0.0] * self.p
        end_of: dict[tuple, float] = {}
        for k, (s, i, kind, t0, t1) in enumerate(events):
            end = ends.get(k, t1) - t_step
            start = max(t0 - t_step, stage_free[s])
            if kind in ("F", "B"):
                for d in self.split.deps[(kind, s)]:
                    start = max(start, end_of.get((d[0], d[1], i), 0.0))
            end = max(end, start)
            stage_free[s] = end
            end_of[(kind, s, i)] = end
            blocks.append(Block(s, i, kind, start, end))
        self._timeline = blocks
        return blocks

    def __repr__(self) -> str:
        name = getattr(self.fn, "__name__", "fn")
        return (f"PipelineExecutable({name}, {self.p} stages, {self.m} micro-batches, "
                f"{self.schedule}, {len(self.programs)} programs)")


class _Watcher:
    """A thread that waits for programs' outputs in dispatch order and notes
    when each was ready (one per stage: a stage runs its programs in order)."""

    def __init__(self) -> None:
        self._q: queue.Queue = queue.Queue()
        self._done: dict[int, dict[int, float]] = {}
        self._cv = threading.Condition()
        self._put = 0
        self._seen = 0
        t = threading.Thread(target=self._loop, daemon=True, name="meshplan-pipeline-watch")
        t.start()

    def put(self, step: int, event: int, arrays: list[Any]) -> None:
        self._put += 1
        self._q.put((step, event, arrays))

    def mark(self) -> int:
        return self._put

    def _loop(self) -> None:
        while True:
            step, event, arrays = self._q.get()
            try:
                jax.block_until_ready(arrays)
            except Exception:       # the error is the caller's to see, not the watcher's
                pass
            t = time.perf_counter()
            del arrays
            with self._cv:
                d = self._done.setdefault(step, {})
                d[event] = t
                for old in [k for k in self._done if k < step - 1]:
                    del self._done[old]
                self._seen += 1
                self._cv.notify_all()

    def wait(self, step: int, upto: int) -> dict[int, float]:
        with self._cv:
            self._cv.wait_for(lambda: self._seen >= upto, timeout=120)
            return dict(self._done.get(step, {}))


def _norm(d: Any) -> Any:
    return tuple(d) if isinstance(d, (list, tuple)) else d


def _place(x: Any, sharding: NamedSharding) -> Any:
    if isinstance(x, jax.Array) and not x.is_deleted():
        cur = getattr(x, "sharding", None)
        if cur is not None and (cur == sharding or cur.is_equivalent_to(sharding, x.ndim)):
            return x
    return jax.device_put(x, sharding)


@jax.jit
def _concat(parts: list[Any]) -> Any:
    return jax.numpy.concatenate(parts, axis=0)


def _split_rows(x: jax.Array, m: int) -> list[jax.Array]:
    return list(_split_jit(x, m))


@functools.partial(jax.jit, static_argnums=1)
def _split_jit(x: jax.Array, m: int) -> tuple[jax.Array, ...]:
    return tuple(jax.numpy.split(x, m, axis=0))
