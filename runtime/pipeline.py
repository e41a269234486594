"""Run a multi-stage (pipeline) plan: stages on submeshes, GPipe and 1F1B.

How a plan becomes programs
---------------------------
The step is traced at the *micro-batch* shapes and cut into per-stage forward
(``F``), backward (``B``) and update (``A``) work by
:mod:`meshplan.runtime.pipeline_split` (see there for the phases).

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

Rematerialised stages (``Stage.remat``): the planner costs such a stage as
keeping only its forward's inputs per micro-batch in flight.  Its backward
program replays the forward equations it needs (``Task.replay``, see
:mod:`meshplan.runtime.pipeline_split`) before its own equations, from the
values the forward read; the forward program still sends its outputs to the
next stage but hands nothing to its own backward.  Between the two programs
of a micro-batch the driver keeps just the copies of the activations the
forward received from other programs, on the stage (not sent again);
parameters, state and batch pieces are arguments both programs read.  The
other stages run as without remat; the numbers are those of the undecorated
step (the replay recomputes the same equations).

Values cross stages only through an explicit ``jax.device_put`` onto a
``NamedSharding`` of the receiving stage's mesh (jax 0.10.2 crashed on the
cached second call of a program given an array of another submesh).  Nothing
is donated (jax 0.10.2 crashes on a call with an already-donated array).

Across processes (``jax.distributed``; see
:mod:`meshplan.runtime.pipeline_multihost`): every process runs this driver
in the same order and dispatches the programs of its own stages only (each
stage on the devices of one process); a value moves to a stage of another
process through a two-process collective both issue at the same point of the
loop.  As in :mod:`meshplan.runtime.multihost`, batch arguments are
process-local rows (gathered into the global batch on host at the start of
every step, one collective per batch leaf) and other arguments are the same
host value in every process or the state the step returned.  Every output is
a ``jax.Array`` on the mesh of the stage that made it: its data in that
stage's process, a handle without local data in the others; read it with
:func:`meshplan.runtime.to_host` in every process.

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
from meshplan.plan import Plan, arg_prefixes
from meshplan.graph import forward_nodes
from meshplan.timeline import Block, schedule_order

from .shard import (FastPathMiss, _signature, build_mesh, check_spec, make_evaluator,
                    stage_devices, to_partition_spec)
from .multihost import global_view, is_global_array, is_local_batch_leaf, is_multiprocess, to_host
from .pipeline_multihost import StageTransport
from .pipeline_split import (CONCAT, LAST, MEAN, StepSplit, Task, dispatch_order,  # noqa: F401
                             split_step)

__all__ = ["PipelineExecutable", "StepSplit", "split_step", "dispatch_order", "schedule_order",
           "SCHEDULES"]

SCHEDULES = ("gpipe", "1f1b")


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
        # [multi-host] every process runs this driver; each dispatches the
        # programs of its own stages and moves values to the others'
        self._xp = StageTransport(self.meshes) if is_multiprocess() else None
        self._local = list(self._xp.local) if self._xp is not None else [True] * self.p
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
        self._out_avals = [(tuple(l.shape), l.dtype) for l in jax.tree_util.tree_leaves(full_out)]
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
                           [s.layers for s in plan.stages], batch_ids, m, concat,
                           remat=[bool(s.remat) for s in plan.stages])
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
        # the stages that read every argument leaf (the update reads a
        # gradient marker's output as its input where nothing computes it)
        leaf_ids = set(flat.invars)
        readers: dict[int, set[int]] = defaultdict(set)
        for key, t in split.tasks.items():
            for x in t.inputs:
                src = x if x in leaf_ids or x in split.producer else split.alias.get(x, x)
                if src in leaf_ids:
                    readers[src].add(key[1])
        self._leaf_readers = {i: tuple(sorted(v)) for i, v in readers.items()}
        # [remat] per stage, the values of other programs its forward received
        # that its backward reads again: the received copies are kept on the
        # stage from the forward to the backward of a micro-batch
        self._keep: list[frozenset[int]] = []
        for s in range(self.p):
            f, b = split.tasks.get(("F", s)), split.tasks.get(("B", s))
            keep: frozenset[int] = frozenset()
            if f is not None and b is not None and b.replay:
                keep = frozenset(x for x in f.inputs if x in set(b.inputs) and x not in leaf_ids)
            self._keep.append(keep)

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
        eqn_ids = self._closure_eqns(dataclasses.replace(task, eqns=sorted(task.replay + task.eqns)))
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
        if _signature(self._view(tuple(args))) != self._sig:
            raise StalePlanError("the arguments do not match the shapes this pipeline was built "
                                 "for; call the parallelized step (it re-plans per signature)")
        return self._run(tuple(args))

    def call_fast(self, args: tuple[Any, ...]) -> Any:
        leaves, treedef = jax.tree_util.tree_flatten(tuple(args))
        if treedef != self._treedef or len(leaves) != self._nleaves:
            raise FastPathMiss("another argument structure")
        if _signature(self._view(tuple(args))) != self._sig:
            raise FastPathMiss("another signature")
        return self._run(tuple(args), leaves)

    def _view(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        """[multi-host] the arguments with process-local batches at their
        global shapes (what the pipeline was built for)."""
        return args if self._xp is None else global_view(args, self.plan.batch_argnums)

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
        xp, local = self._xp, self._local
        t_step = time.perf_counter()
        moves0 = xp.moves if xp is not None else 0
        if leaves is None:
            leaves = jax.tree_util.tree_leaves(args)
        given = dict(zip(flat.invars, leaves))
        placed: dict[tuple[int, int], Any] = {}        # (arg id, stage) -> array there
        mb_cache: dict[tuple[int, int], list[Any]] = {}
        # [multi-host] the global batch and arguments of remote stages, moved
        # up front and in the same order in every process
        leaf_of = given if xp is None else self._mp_arguments(given, placed)

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
                if not local[s]:
                    continue
                ids, zeros = self._zeros_fn(s)
                if ids:
                    accs[s] = dict(zip(ids, zeros()))
        # [multi-host] values moved across processes: sent once per receiving
        # stage, kept there for its other programs
        sent: set[tuple] = set()
        got: dict[tuple, list[Any]] = {}

        # [remat] (micro-batch, id, stage) -> the copy a remat stage's forward
        # received, kept there for its backward
        kept: dict[tuple[int, int, int], Any] = {}

        def take(x: int, mb: int, n: int = 1) -> Any:
            v = vals[mb][x]
            rem = remaining[mb]
            rem[x] -= n
            if rem[x] == 0:
                del vals[mb][x], rem[x]
            return v

        def fetch(x: int, s: int, mb: int, key: tuple) -> Any:
            if x in leaf_of:
                return arg_on(x, s, mb) if local[s] else None
            # [remat] what a remat stage's forward received from another
            # program, its backward reads again: taken for both at the forward
            again = x in self._keep[s]
            n = 2 if again else 1
            if xp is None or (local[split.producer[x][1]] and local[s]):
                if again and key[0] == "B":
                    return kept.pop((mb, x, s))
                v = self._send(take(x, mb, n), x, s)
                if again:
                    kept[(mb, x, s)] = v
                return v
            r = split.producer[x][1]
            if local[r]:
                if again and key[0] == "B":
                    return None          # taken and moved for both at the forward
                v = take(x, mb, n)
                if (mb, x, s) not in sent:
                    sent.add((mb, x, s))
                    self._move(v, x, r, s, False)
                return None
            if local[s]:
                hit = got.get((mb, x, s))
                if hit is None:
                    uses = sum(1 for k in self._c_consumers[x] if k[1] == s)
                    hit = got[(mb, x, s)] = [self._move(None, x, r, s, False), uses]
                hit[1] -= 1
                if hit[1] == 0:
                    del got[(mb, x, s)]
                return hit[0]
            return None

        for kind, s, i in self._order:
            key = (kind, s)
            prog = self.programs[key]
            task = prog.task
            ins = [fetch(x, s, i, key) for x in task.inputs]
            if not local[s]:       # [multi-host] another process runs it
                continue
            acc_in = [accs[s][x] for x in task.accumulate] if m > 1 else []
            t0 = time.perf_counter()
            plain, new = self._call(prog, ins, acc_in, f" on micro-batch {i}")
            t1 = time.perf_counter()
            if self.probe is not None:
                received_ids = [x for x in task.inputs if x not in leaf_of]
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
                                    "outputs": list(plain), "received": received,
                                    "received_ids": received_ids})
                del received
            del plain, new
        leftover = [x for d in vals for x in d]
        if leftover or got or kept:   # cannot happen: every value is counted to its consumers
            raise RuntimeStageError(f"internal: {len(leftover) + len(got) + len(kept)} "
                                    "activation(s) left after the step")
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

        def produced(x: int) -> bool:
            # [multi-host] what other processes made is not in `done` here
            return x in done if xp is None else x in split.producer

        for key in self._a_order:
            prog = self.programs[key]
            s = key[1]
            ins = []
            for x in prog.task.inputs:
                src = x if x in leaf_of or produced(x) else split.alias.get(x, x)
                if src in leaf_of:
                    ins.append(arg_on(src, s, 0) if local[s] else None)
                    continue
                r = split.producer[src][1] if xp is not None else s
                if xp is None or (local[r] and local[s]):
                    ins.append(self._send(done[src], src, s))
                elif local[r]:
                    if (-1, src, s) not in sent:
                        sent.add((-1, src, s))
                        self._move(done[src], src, r, s, True)
                elif local[s]:
                    hit = got.get((-1, src, s))
                    if hit is None:
                        hit = got[(-1, src, s)] = [self._move(None, src, r, s, True)]
                    ins.append(hit[0])
            if not local[s]:
                continue
            t0 = time.perf_counter()
            plain, _ = self._call(prog, ins, [], "")
            t1 = time.perf_counter()
            del ins
            done.update(zip(prog.task.outputs, plain))
            events.append((s, -1, "A", t0, t1))
            if watch:
                watchers[s].put(step_id, len(events) - 1, plain)
        got.clear()
        outs = []
        for k, x in enumerate(flat.outvars):
            if isinstance(x, Lit):
                outs.append(x.value)
            elif x in self._const_out:
                outs.append(self._const_out[x])
            elif x in leaf_of:
                outs.append(given[x])
            else:
                src = x if produced(x) else split.alias.get(x, x)
                if src in leaf_of:
                    outs.append(given[src])
                elif xp is None:
                    outs.append(done[src])
                else:
                    outs.append(self._mp_output(done.get(src), src, k))
        self.last_stats = {"max_in_flight": max_in_flight, "dispatch_s": time.perf_counter() - t_step,
                           "tasks": len(events)}
        if xp is not None:
            self.last_stats["cross_process_moves"] = xp.moves - moves0
        self._timeline = None
        self._events = (t_step, events, step_id)
        if watch:
            self._timeline_jobs = [w.mark() for w in watchers]
        return jax.tree_util.tree_unflatten(self._out_treedef, outs)

    # ---- multi-host ---------------------------------------------------------
    def _mp_arguments(self, given: dict[int, Any], placed: dict[tuple[int, int], Any]
                      ) -> dict[int, Any]:
        """[multi-host] The arguments as this process's stages read them, made
        with collectives every process issues in the same order: the global
        batch gathered to host, arrays spread over processes gathered to
        host, stage outputs of the last step moved to the stages of other
        processes that read them (into ``placed``)."""
        xp = self._xp
        assert xp is not None
        leaf_of = dict(given)
        spread: list[int] = []
        for i in self.flat.invars:
            x = given[i]
            if i in self._is_batch:
                leaf_of[i] = _global_batch(x)
            elif isinstance(x, jax.Array) and xp.stage_of(x) is None and not x.is_fully_addressable:
                procs = sorted({d.process_index for d in x.sharding.device_set})
                if jax.process_index() not in procs and len(procs) < jax.process_count():
                    raise RuntimeStageError(
                        f"argument {self._leaf_key[i]} lives on the devices of process(es) "
                        f"{procs} only and on no stage of this pipeline: pass the same host value "
                        "(NumPy) in every process, a global array, or the state the step returned")
                spread.append(i)
        if spread:
            for i, v in zip(spread, to_host([given[i] for i in spread])):
                leaf_of[i] = v
        for i in self.flat.invars:
            x = given[i]
            r = None if i in self._is_batch or i in spread else xp.stage_of(x)
            if r is None:
                continue        # a host value: each process places its copy
            for s in self._leaf_readers.get(i, ()):
                target = self._sharding_for(i, s)
                if xp.same_process(r, s):
                    if xp.local[s]:
                        placed[(i, s)] = _place(x, target)
                elif xp.local[r] or xp.local[s]:
                    y = xp.move(x if xp.local[r] else None, r, s, target, x.shape, x.dtype)
                    if y is not None:
                        placed[(i, s)] = y
        return leaf_of

    def _move(self, v: Any, x: int, r: int, s: int, after: bool) -> Any:
        """[multi-host] value ``x`` of stage ``r`` to stage ``s`` of another
        process (``v`` on the sender, None on the receiver); ``after``: in the
        update phase (concatenated outputs have the full batch there)."""
        aval = self.flat.avals[x]
        shape = tuple(aval.shape)
        if after and self.split.crossing.get(x) == CONCAT:
            shape = (shape[0] * self.m,) + shape[1:]
        return self._xp.move(v, r, s, self._cross_sharding(x, r, s, len(shape)), shape, aval.dtype)

    def _cross_sharding(self, x: int, r: int, s: int, ndim: int) -> NamedSharding:
        """[multi-host] where a value from another process lands on stage
        ``s``: its planned layout there, else its planned layout on ``r`` when
        stage ``s`` has those axes, else replicated.  (The same in every
        process: the receiver cannot see the sender's array.)"""
        key = ("cross", x, s)
        sh = self._in_sharding.get(key)
        if sh is None:
            sh = self._stage_constraints[s].get(x)
            if sh is None:
                theirs = self._stage_constraints[r].get(x)
                sh = NamedSharding(self.meshes[s], PartitionSpec())
                if theirs is not None:
                    spec = tuple(_norm(d) for d in theirs.spec) + (None,) * (ndim - len(theirs.spec))
                    try:
                        check_spec(spec, self.flat.avals[x].shape, self.plan.stages[s].logical_mesh,
                                   "transfer")
                        sh = NamedSharding(self.meshes[s], PartitionSpec(*spec))
                    except StalePlanError:
                        pass
            self._in_sharding[key] = sh
        return sh

    def _mp_output(self, v: Any, x: int, k: int) -> Any:
        """[multi-host] output leaf ``k`` (value ``x``): on its stage's mesh in
        the process of that stage, a handle without local data elsewhere."""
        xp = self._xp
        r = self.split.producer[x][1]
        if xp.local[r]:
            return xp.on_stage(v, r) if isinstance(v, jax.Array) else v
        shape, dtype = self._out_avals[k]
        planned = self._stage_constraints[r].get(x)
        spec = planned.spec if planned is not None and len(planned.spec) == len(shape) else None
        return xp.remote(r, shape, dtype, spec)

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


def _global_batch(x: Any) -> Any:
    """[multi-host] a batch leaf's global value on host, in every process
    (a collective): process-local rows stacked in process order."""
    if is_local_batch_leaf(x):
        from jax.experimental import multihost_utils
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    if is_global_array(x):
        return to_host(x)
    return x


@jax.jit
def _concat(parts: list[Any]) -> Any:
    return jax.numpy.concatenate(parts, axis=0)


def _split_rows(x: jax.Array, m: int) -> list[jax.Array]:
    return list(_split_jit(x, m))


@functools.partial(jax.jit, static_argnums=1)
def _split_jit(x: jax.Array, m: int) -> tuple[jax.Array, ...]:
    return tuple(jax.numpy.split(x, m, axis=0))
