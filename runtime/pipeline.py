"""Run a multi-stage (pipeline) plan: stages on submeshes, GPipe, 1F1B and
interleaved 1F1B (virtual stages sharing their device group's devices).

How a plan becomes programs
---------------------------
The planner traces the step at the *micro-batch* shapes
(:func:`meshplan.trace.trace_for_run`; the executable is given the
:class:`~meshplan.traced.TracedStep`) and the step is cut into per-stage
forward (``F``), backward (``B``; under ZB-H1 cut in two, ``B`` and ``W``)
and update (``A``) work by :mod:`meshplan.runtime.pipeline_split` (see there
for the phases).  The modules of this runtime, by role: :mod:`~meshplan.runtime.pipeline_split`
(the split, pure data), :mod:`~meshplan.runtime.pipeline_programs` (the
jitted per-stage programs and the layouts of their values),
:mod:`~meshplan.runtime.pipeline_driver` (the schedule loop of one call and
what ran), :mod:`~meshplan.runtime.pipeline_transport` (moving values
between stages, across processes too); this module binds them together.

Per stage there is one forward and one backward program (each a ``jax.jit`` of
an evaluator that replays its equations, with the stage's planned sharding
constraints) and the apply work of the stage, cut into "levels" where the
update needs values of another stage (a global gradient norm).  The driver
dispatches the programs asynchronously in the schedule's order (GPipe: all
forwards, then all backwards; 1F1B: warm-up forwards, then one forward / one
backward; interleaved: per device group, Megatron-LM's order over its model
chunks, :func:`meshplan.schedule.group_order`; ZB-H1: 1F1B's order with the
weight gradients' ``W`` programs delayed), keeps a micro-batch's
activations only until its backward ran, accumulates gradients per stage
(the gradient is the mean over micro-batches, i.e. the loss is taken to be a
mean over the batch), applies each stage's update once and returns the
outputs as the undecorated step does.  An interleaved plan's virtual stages
are stages of their own (programs, meshes, running sums) that share their
device group's devices (``Stage.device_group``).

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
cached second call of a program given an array of another submesh).

Donation (``donate_argnums`` as in ``jax.jit``): the running sums of the
gradients are always taken over by the program that adds to them (and by
the mean); a leaf of a donated argument, and a value one update program
makes for another of its stage, is taken over by the last update program
reading it (every micro-batch program runs before the first update, so a
tied weight is too), where an output of its shape can reuse its buffer
(:func:`~meshplan.runtime.pipeline_programs.donations`; fixed per program,
so the bookkeeping is static).  The caller's arrays of
donated arguments are deleted once the step is dispatched, except those
the step returns as they are and those no output of their shape and dtype
could reuse (kept and warned about, as jax.jit does); a deleted array passed
in is refused before anything runs (jax 0.10.2 crashes on a call with an
already-donated array).  Across processes only our own values (running sums, what one
update program makes for the next) are donated.

Across processes (``jax.distributed``; see
:mod:`meshplan.runtime.pipeline_transport`): every process runs this driver
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

How the micro-batches combine (with more than one): each value crossing
into the update or the outputs is a sum over the batch's examples of some
degree (:mod:`meshplan.trace.scaling`): a mean (the loss, the gradients of
a mean loss) is averaged over the micro-batches, a sum (a summed loss's
gradients, a token count) summed; a nonlinear function of such sums alone
(``exp`` of the mean loss, a mean over the tokens that are not padding) is
computed once a step from the combined sums; and the update runs with the
whole batch's literals (a division by the batch size divides by the whole
batch's).  What no combination gives exactly is averaged and named in one
warning: per-example values computed from a sum over the micro-batch
(batch normalisation's statistics, a loss divided by the micro-batch's
token count), a maximum over the batch, a backward that clips its
cotangent.  A batch-dependent integer output that is no sum over the
batch cannot be averaged and is refused; so is an update that reads the
batch itself.  Outputs whose dimension 0 is the batch (per-example
predictions) are concatenated.
"""
from __future__ import annotations

import re
from typing import Any, Callable, Sequence

import jax

from meshplan.errors import MeshplanError, RuntimeStageError, StalePlanError, warn
from meshplan.graph import BATCH, Graph
from meshplan.plan import Plan
from meshplan.recompute import SELECTIVE, selective_nodes
from meshplan.schedule import Block, schedule_order
from meshplan.traced import IDENTITY_MARKERS, FlatJaxpr, TracedStep

from .multihost import global_view, is_multiprocess
from .pipeline_driver import StepRun, Watcher, timeline_blocks, wire
from .pipeline_partial import partial_sums
from .pipeline_programs import (Program, RunningSums, StageLayouts, build_programs, closure_eqns,
                                constant_gradients, fixed_outputs, donations,
                                returned_leaves)
from .pipeline_lower import PipelineLowered, lower_pipeline
from .pipeline_split import StepSplit, dispatch_order, split_step
from .pipeline_transport import StageTransport, Transfers
from .shard import (FastPathMiss, _signature, build_mesh, stage_devices, user_mesh_use,
                    user_meshes)

__all__ = ("PipelineExecutable", "StepSplit", "split_step", "dispatch_order", "schedule_order",
           "SCHEDULES",)

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")


def _no_context_mesh() -> None:
    """Refuse to build or run inside ``with jax.set_mesh(...)``: jit refuses a
    stage's submesh beside the context mesh, inside its shard_map too, and
    programs built there keep it (``jax.set_mesh(None)`` around the run did
    not clear it)."""
    if not jax.sharding.get_abstract_mesh().empty:
        raise RuntimeStageError(
            "a pipeline plan runs each stage on a submesh of its own, and this call is inside "
            "`with jax.set_mesh(...)`; call the parallelized step outside it (a "
            "step that needs that mesh, as a with_sharding_constraint to a bare PartitionSpec "
            "does, runs as one stage only: drop the constraint, or plan one stage)")


def _no_user_mesh(flat: FlatJaxpr) -> None:
    """Refuse a step that constrains a value to a sharding on a mesh of its
    own (``with_sharding_constraint(x, NamedSharding(mesh, ...))``): a stage
    program runs on its submesh, which jit refuses beside that mesh."""
    for sharding, mesh in user_meshes(flat):
        raise RuntimeStageError(
            f"the step runs {user_mesh_use(sharding)} on a mesh of {mesh.size} devices of its "
            "own, and a pipeline plan runs each stage on a submesh; drop it (the plan lays out "
            "every value) or plan one stage")


def _quick_key(leaf: Any) -> Any:
    """What jit's dispatch would tell apart about ``leaf``, cheaply: its
    type, shape, dtype and weak type (a cache key in front of the full
    signature, not a substitute)."""
    # (typed PRNG key arrays are jax.Arrays without a weak type)
    return (type(leaf), getattr(leaf, "shape", None), getattr(leaf, "dtype", None),
            getattr(leaf, "weak_type", None))


def _selective(traced: TracedStep, plan: Plan) -> frozenset[int]:
    """The equations a selective stage replays (the step's graph numbers its
    nodes as the flat equations), or none when no stage is selective."""
    if not any(s.recompute == SELECTIVE for s in plan.stages) or traced.graph is None:
        return frozenset()
    return selective_nodes(traced.graph, traced.forward)


def _usable_donations(traced: TracedStep, donate_argnums: tuple[int, ...]) -> frozenset[int]:
    """The leaves of donated arguments the call gives up: as under jax.jit,
    each leaf the step reads takes the first output of its shape and dtype
    no earlier leaf took (its buffer can hold that output); the others stay
    alive, with jax.jit's warning, naming them.  A leaf the step never reads
    stays alive without a word (jax.jit prunes it before donating)."""
    flat = traced.flat
    read = {x for fe in flat.eqns for x in fe.invars if isinstance(x, int)}
    read |= {x for x in flat.outvars if isinstance(x, int)}
    free: dict[tuple, int] = {}
    for shape, dtype in traced.step_out_avals:
        key = (tuple(shape), str(dtype))
        free[key] = free.get(key, 0) + 1
    usable, unused = [], []
    for (a, path), i, batch in zip(traced.arg_paths, traced.flat.invars, traced.batch_leaves):
        if a not in donate_argnums or i not in read:
            continue
        aval = traced.flat.avals[i]
        shape = tuple(getattr(aval, "shape", ()))
        if batch and traced.micro_batches:     # (traced at the micro-batch's rows)
            shape = (shape[0] * traced.micro_batches,) + shape[1:]
        key = (shape, str(aval.dtype))
        if free.get(key):
            free[key] -= 1
            usable.append(i)
        else:
            unused.append(f"argument {a}{path} ({aval.dtype}{list(shape)})")
    if unused:
        warn(f"meshplan: donated {', '.join(unused)} not used: no output of its shape and "
             "dtype is left for it; kept alive, as jax.jit keeps it")
    return frozenset(usable)


def _device_groups(plan: Plan) -> tuple[int, ...]:
    """Every stage's device group, checked: stages share devices only as an
    interleaved plan's virtual stages do (stage k on group k mod p, the
    stages of a group on the same devices)."""
    groups = plan.device_groups
    p = len(set(groups))
    if plan.schedule == "interleaved" or p != len(groups):
        if plan.schedule != "interleaved" or groups != tuple(k % p for k in range(len(groups))) \
                or len(groups) % p or len(groups) == p:
            raise StalePlanError(
                f"the plan's device groups {list(groups)} are not an interleaved layout (virtual "
                f"stage k on group k mod p, two or more chunks per group) under schedule "
                f"{plan.schedule!r}; re-plan")
        if plan.num_micro_batches % p:
            raise StalePlanError(f"interleaved 1F1B runs a multiple of the {p} device groups as "
                                 f"micro-batches, not {plan.num_micro_batches}; re-plan")
    owner: dict[int, int] = {}
    for k, (s, g) in enumerate(zip(plan.stages, groups)):
        for d in s.devices:
            if owner.setdefault(d, g) != g:
                raise StalePlanError(f"stage {k} shares device {d} with a stage of another device "
                                     "group; re-plan")
        if set(s.devices) != set(plan.stages[groups.index(g)].devices):
            raise StalePlanError(f"stage {k} is not on the devices of its device group {g}; re-plan")
    return groups


class PipelineExecutable:
    """``fn`` run under a multi-stage plan; called like ``fn``.

    ``args`` are example arguments (arrays or ``jax.ShapeDtypeStruct``) of
    the full batch and ``traced`` the step traced for them at the plan's
    micro-batch size (:func:`meshplan.trace.trace_for_run` with
    ``micro_batches=plan.num_micro_batches``); the executable runs that
    signature only (another one raises
    :class:`~meshplan.runtime.FastPathMiss` from :meth:`call_fast`, and
    :class:`~meshplan.StalePlanError` when called).  ``layer_of_node``
    (default ``plan.layer_of_node``) is the layer of every operation of the
    traced step.  ``timeline``: record what ran (see :attr:`last_timeline`).
    ``retrace(pieces)``: the step traced with its batch cut in ``pieces``
    (``trace_for_run`` bound to ``fn`` and ``args``); with it, data-parallel
    stages keep partial gradient sums reduced once per step
    (:mod:`.pipeline_partial`), without it they reduce every micro-batch.
    ``fused``: the forward equations a stage recomputing nothing replays in
    its backward (the element-wise chains XLA would fuse there in one
    program; see :func:`~meshplan.runtime.pipeline_split.split_step`); with
    none, the backward reads every forward value it uses.  ``whole``: the
    step traced at the whole batch (the outputs made from constants alone
    are made at its size).
    """

    def __init__(self, fn: Any, plan: Plan, args: Sequence[Any], *, traced: TracedStep,
                 layer_of_node: Sequence[int] | None = None,
                 devices: Sequence[jax.Device] | None = None,
                 timeline: bool = True, donate_argnums: Sequence[int] = (),
                 retrace: Callable[[int], TracedStep] | None = None,
                 fused: frozenset[int] = frozenset(),
                 whole: TracedStep | None = None) -> None:
        _no_context_mesh()
        if len(plan.stages) < 2 and plan.num_micro_batches < 2:
            raise RuntimeStageError("PipelineExecutable runs plans of two or more stages or "
                                    "micro-batches; use ShardExecutable for one program")
        if plan.schedule not in SCHEDULES:
            raise RuntimeStageError(
                f"the plan's schedule {plan.schedule!r} cannot be executed by this version "
                f"(it runs {', '.join(SCHEDULES)}); re-plan with "
                "PipeshardParallel(schedule='1f1b') or schedule='gpipe'")
        layer_of_node = plan.layer_of_node if layer_of_node is None else tuple(layer_of_node)
        if not layer_of_node:
            raise StalePlanError("the pipeline plan does not record its layering "
                                 "(layer_of_node); re-plan with this version of meshplan")
        if traced.micro_batches != plan.num_micro_batches:
            raise MeshplanError(f"the step was traced for {traced.micro_batches} micro-batches but "
                                f"the plan runs {plan.num_micro_batches}")
        _no_user_mesh(traced.flat)
        self.fn = fn
        self.plan = plan
        self.traced = traced
        self.flat = traced.flat
        self.m = int(plan.num_micro_batches)
        self.schedule = plan.schedule
        self.p = len(plan.stages)
        self.record_timeline = timeline
        self.donate_argnums = tuple(int(a) for a in donate_argnums)
        self.arg_path = dict(zip(traced.flat.invars, traced.arg_paths))
        # the leaves of donated arguments the caller gives up; those of no
        # batch may lend their buffers to the update (a batch leaf is cut
        # into micro-batches, read by many programs)
        self.released = _usable_donations(traced, self.donate_argnums)
        self.donated = frozenset(i for i, b in zip(traced.flat.invars, traced.batch_leaves)
                                 if i in self.released and not b)
        self.groups = _device_groups(plan)
        self.meshes = [build_mesh(s.logical_mesh, stage_devices(s, devices)) for s in plan.stages]
        # [multi-host] every process runs this driver; each dispatches the
        # programs of its own stages and moves values to the others'
        xp = StageTransport(self.meshes) if is_multiprocess() else None
        self._sig = _signature(tuple(args))
        self._treedef = jax.tree_util.tree_structure(tuple(args))
        self._nleaves = len(traced.flat.invars)
        self._quick: tuple | None = None
        self._build(layer_of_node, xp, retrace, fused, whole)
        self.last_stats: dict[str, Any] = {}
        self._steps = 0
        self._events: tuple | None = None
        self._timeline_jobs: list[Any] | None = None
        self._timeline: list[Block] | None = None
        self._watchers: list[Watcher] | None = None

    # ---- building ---------------------------------------------------------
    def _build(self, layer_of_node: Sequence[int], xp: StageTransport | None,
               retrace: Callable[[int], TracedStep] | None, fused: frozenset[int],
               whole: TracedStep | None = None) -> None:
        traced, plan, m, flat = self.traced, self.plan, self.m, self.flat
        batch_ids = [i for i, b in zip(flat.invars, traced.batch_leaves) if b]
        self.split = split = split_step(flat, traced.forward, layer_of_node,
                                        [s.layers for s in plan.stages], batch_ids, m,
                                        traced.concat_outputs,
                                        remat=[s.recompute for s in plan.stages],
                                        remat_layers=[s.recompute_layers for s in plan.stages],
                                        keep_casts=[s.keep_casts for s in plan.stages],
                                        selective=_selective(traced, plan),
                                        fused=fused,
                                        draws=traced.batch_draws,
                                        draw_eqns=traced.draw_eqns,
                                        zero_bubble=self.schedule == "zb-h1",
                                        scaling=traced.scaling,
                                        output_paths=[o.path for o in traced.graph.outputs])
        if split.inexact:
            self._warn_inexact(split)
        # (a per-example cotangent of degree -1 is a mean loss's: 1 / rows)
        if m > 1 and any(split.eqn_phase[k] == "B" and any(
                str(getattr(flat.avals.get(o), "dtype", "")) == "float16"
                and (split.value_degree.get(o) or 0) < 0 for o in fe.outvars)
                for k, fe in enumerate(flat.eqns)):
            warn(f"meshplan: the backward runs in float16 with {m} micro-batches: each one's "
                 f"cotangents are those of its own mean loss, {m} times the whole batch's, so a "
                 "loss scale that fits the whole batch may overflow here where it does not under "
                 f"jax.jit; leave {m}x room in the loss scale, or plan with num_micro_batches=1")
        self.layouts = StageLayouts(plan, self.meshes, traced, split)
        self.wiring = wire(split, flat, self.schedule, m, self.layouts.is_batch, self.groups)
        # [multi-host] the caller's state stays whole: only our own values are donated
        if xp is not None:
            self.donated = self.released = frozenset()
        self.donations = donations(split, flat, self.donated, m)
        # data-parallel gradients reduced once per step (see pipeline_partial;
        # it rewrites whole backwards, not zb-h1's W programs, and replays
        # each on a data shard's rows: not where a statistic of the
        # micro-batch is inexact already, which would become the shard's)
        if self.schedule == "zb-h1" or split.inexact or any(
                not fe.outvars and split.eqn_phase[k] == "B" for k, fe in enumerate(flat.eqns)):
            retrace = None      # (nor where a backward holds a host callback: shard_map's
            #                     manual axes take it no mesh to run under)
        self.partial = partial_sums(retrace, traced, plan, self.meshes, split,
                                    closure_eqns, self.layouts.planned)
        self.programs: dict[tuple, Program] = build_programs(split, flat, self.layouts,
                                                             self.donations, self.partial)
        self.fixed = fixed_outputs(split, flat, whole.flat if whole is not None else None)
        self.constant_grads = constant_gradients(split, flat)
        self.constant_ids = frozenset(self.constant_grads[0])
        self.returned = returned_leaves(split, flat)
        self.sums = RunningSums(split, flat, self.layouts, m, self.partial)
        self.transfers = Transfers(self.meshes, self.layouts, split, traced, m, xp,
                                   self.wiring.leaf_readers)

    def _warn_inexact(self, split: StepSplit) -> None:
        """Name what no combination of the micro-batches gives exactly (see
        :func:`~.pipeline_split.split_step`): it is averaged over them; and
        the step's outputs that differ for it (grouped by their first two
        keys: a BatchNorm's new statistics may cross with the gradients)."""
        outputs = [(o.tensor, o.path) for o in self.traced.graph.outputs
                   if isinstance(o.tensor, int)]
        names = dict(outputs)
        # (the gradient marker found by meshplan.trace.micro's rule carries
        # every sum over the batch the state is made from: the gradients,
        # and a BatchNorm's statistics returned by has_aux)
        grads = set(split.alias.values())
        what = {x: names.get(x) or ("the sums over the batch the update reads (gradients, batch "
                                    "statistics)" if x in grads else "a value the update reads")
                for x in split.inexact}
        first = min(split.inexact, key=lambda x: (x not in grads, what[x]))
        listed = sorted(set(what.values()))
        differ = _output_groups(self.flat, split.inexact, outputs)
        subject = (f"outputs {', '.join(differ)} of this step differ" if differ else
                   "this step differs")
        warn(
            f"meshplan: with {self.m} micro-batches, {subject} from the undecorated step's: "
            f"what they are computed from ({', '.join(listed[:4])}"
            f"{' ...' if len(listed) > 4 else ''}) cannot be combined exactly from the "
            f"micro-batches ({split.inexact[first]}), and the pipeline averages it over them.  "
            f"Plan with num_micro_batches=1 for the exact step{_tables(self.traced.graph)}")

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
        # (the leaves' avals as the last call that matched saw them: the
        # full signature, dtype names and all, only when they differ)
        quick = tuple(map(_quick_key, leaves))
        if quick != self._quick:
            if _signature(self._view(tuple(args))) != self._sig:
                raise FastPathMiss("another signature")
            self._quick = quick
        return self._run(tuple(args), leaves)

    def _view(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        """[multi-host] the arguments with process-local batches at their
        global shapes (what the pipeline was built for)."""
        return args if self.transfers.xp is None else global_view(args, self.plan.batch_argnums)

    def lower(self, *args: Any) -> PipelineLowered:
        """Every stage program as a ``jax.stages.Lowered``, lowered as the
        driver calls it (``args`` may be ``jax.ShapeDtypeStruct`` pytrees);
        ``.compile()`` gives the ``Compiled`` ones (see
        :mod:`meshplan.runtime.pipeline_lower`)."""
        if _signature(self._view(tuple(args))) != self._sig:
            raise StalePlanError("the arguments do not match the shapes this pipeline was built "
                                 "for; lower the parallelized step (it re-plans per signature)")
        return lower_pipeline(self, tuple(args))

    def _call(self, prog: Program, ins: list[Any], accs: list[Any], mb: int) -> Any:
        """Run one program (``mb``: its micro-batch, -1 for the update)."""
        try:
            return prog.fn(*ins, *accs)
        except Exception as e:
            what = f" on micro-batch {mb}" if mb >= 0 else ""
            raise RuntimeStageError(
                f"pipeline {prog.task.name()} failed{what}: {type(e).__name__}: {e}") from e

    def _run(self, args: tuple[Any, ...], leaves: list[Any] | None = None) -> Any:
        if leaves is None:
            leaves = jax.tree_util.tree_leaves(args)
        _no_context_mesh()
        run = StepRun(self, leaves)
        outs = run.run()
        self.last_stats = run.stats()
        self._timeline = None
        self._events = (run.t_step, run.events, run.step_id)
        if run.watchers is not None:
            self._timeline_jobs = [w.mark() for w in run.watchers]
        return jax.tree_util.tree_unflatten(self.traced.out_tree, outs)

    # ---- what ran -----------------------------------------------------------
    def _get_watchers(self) -> list[Watcher]:
        if self._watchers is None:
            self._watchers = [Watcher() for _ in range(self.p)]
        return self._watchers

    @property
    def last_timeline(self) -> list[Block]:
        """What the last call ran: one :class:`meshplan.schedule.Block` per
        program (stage, micro-batch, ``"F"``/``"B"``, or ``"A"`` with
        micro-batch -1 for the update), times in seconds from the start of the
        call.  ``end`` is when the program's outputs were ready (observed by
        a watcher thread per stage); ``start`` is the later of its dispatch,
        the end of the stage's previous program and the end of the programs
        it reads from."""
        if self._timeline is not None:
            return self._timeline
        if not self._events:
            return []
        t_step, events, step_id = self._events
        ends: dict[int, float] = {}
        if self._timeline_jobs is not None:
            for w, upto in zip(self._watchers or [], self._timeline_jobs):
                ends.update(w.wait(step_id, upto))
        self._timeline = timeline_blocks(events, t_step, ends, self.split, self.p,
                                         self.groups)
        return self._timeline

    def __repr__(self) -> str:
        name = getattr(self.fn, "__name__", "fn")
        return (f"PipelineExecutable({name}, {self.p} stages, {self.m} micro-batches, "
                f"{self.schedule}, {len(self.programs)} programs)")


def _tables(graph: Graph) -> str:
    """A word on batch leaves the step indexes by values of the batch (a
    table of classes among the batch's leaves, as long as the batch: each
    micro-batch would hold part of it), else ''."""
    batch = {i.tensor: i for i in graph.inputs if i.role == BATCH}
    named = sorted({f"argument {batch[n.inputs[0]].argnum}{batch[n.inputs[0]].path}"
                    for n in graph.nodes if n.primitive in ("gather", "dynamic_slice")
                    and n.inputs and n.inputs[0] in batch
                    and any(t in graph.batch_tensors for t in n.inputs[1:])})
    if not named:
        return ""
    return (f" ({', '.join(named)} {'is' if len(named) == 1 else 'are'} indexed by values of "
            "the batch: a table that is no batch, as long as the batch by chance, goes in "
            "another argument than batch_argnums')")


def _output_groups(flat: FlatJaxpr, sources: Any, outputs: Sequence[tuple[int, str]]) -> list[str]:
    """The outputs computed from ``sources`` (ids of ``flat``), each named by
    the first two keys of its path (``[0]['batch_stats']``, ``[0].params``),
    in output order."""
    reached = set(sources)
    for fe in flat.eqns:
        if fe.eqn.primitive.name in IDENTITY_MARKERS:     # (each operand is its own output)
            reached.update(o for x, o in zip(fe.invars, fe.outvars)
                           if isinstance(x, int) and x in reached)
        elif any(isinstance(x, int) and x in reached for x in fe.invars):
            reached.update(fe.outvars)
    groups: list[str] = []
    for tensor, path in outputs:
        # (a key is an index or an attribute: a flax TrainState's .params)
        group = "".join(re.findall(r"\[[^\]]*\]|\.\w+", path)[:2]) or path or "the output"
        if tensor in reached and group not in groups:
            groups.append(group)
    return groups
