"""The pipeline step split: every equation of a train step to a stage and a
phase, and the per-stage programs ("tasks") with their wiring.

Pure data over the flattened jaxpr (no devices): :func:`split_step` makes a
:class:`StepSplit`, :func:`dispatch_order` one global order of the programs
for a schedule.  :class:`~meshplan.runtime.pipeline.PipelineExecutable` turns
the tasks into jitted programs and runs them.

How a plan becomes programs
---------------------------
The step is traced at the *micro-batch* shapes (the batch arguments' dimension
0 divided by ``plan.num_micro_batches``) by the planner
(:func:`meshplan.trace.trace_for_run`, handed over as a
:class:`~meshplan.traced.TracedStep`): the very equation stream (and integer
tensor ids) the inter-operator pass planned, so ``Plan.layer_of_node`` gives
the layer of every equation and ``Stage.layers`` the stage of every layer.
Every equation then gets a *phase*:

* ``F`` (forward): ancestors of the step's metric outputs (the loss), as the
  planner's :func:`forward_nodes` defines them (``TracedStep.forward``);
* ``B`` (backward): every other equation that must run once per micro-batch:
  the ancestors of the gradients (the inputs of the ``meshplan.grad`` marker,
  the user's or the one :mod:`meshplan.trace.micro` put on a step without)
  and everything else that reads the batch;
* ``A`` (apply): what runs once per step after the micro-batches: the
  equations downstream of the gradients (the optimizer update), those that
  read only state (a step counter), and the sums of a gradient's
  contributions from several layers (a tied embedding's; each contribution
  is summed over the micro-batches where it is made:
  :mod:`meshplan.contributions`), and a nonlinear function of sums over
  the batch alone that nothing per micro-batch reads (``exp`` of the mean
  loss: :func:`_sum_tails`), computed from the combined sums;
* values made from constants alone (masks, iotas) are recomputed by every
  program that reads them instead of being sent between stages;
* ``R`` (draw): a random draw over the batch (``TracedStep.batch_draws``, a
  dropout mask) runs once per step, before the micro-batches, at the full
  batch's shape, in a program of its stage that also computes its key from
  the arguments; each micro-batch reads its rows of it, so the numbers are
  the undecorated step's.  With several micro-batches the R task of a
  stage also makes, once per step, each narrowed copy of a parameter (a
  float32 weight cast to bfloat16) that only per-micro-batch work reads
  (:func:`_hoisted_casts`): every micro-batch reads the one copy, which
  lives through the step, instead of casting again per micro-batch and per
  recomputation.  It also computes the batch statistics
  (``Scaling.statistics``: a loss's token count) from the whole batch's
  rows, which every micro-batch, the update and the outputs read whole.

Rematerialised stages (``Stage.remat``, the ``remat`` argument of
:func:`split_step`): the stage's backward task does not read what its forward
computed.  It *replays* the forward equations its own equations need
(``Task.replay``, run inside the backward program before its own equations)
from the values the forward read, so between the two programs of a
micro-batch only the forward's inputs are kept: activations of earlier
stages (and any other value of another program the forward read); the
parameters, state and batch pieces are arguments the backward program reads
anyway.  The forward task then outputs only what other programs need (the
next stage's activations, metrics).  Values of other programs that the
backward itself reads stay inputs of the backward as before.  A *selective*
stage (``Stage.recompute``, :mod:`meshplan.recompute`) replays only the
equations of the selective region (the ``selective`` argument); the values
its replay reads from the rest of its forward are outputs of the forward,
kept like any other value the backward reads.  A stage that recomputes
nothing still replays the element-wise chains XLA would fuse into its
backward had the step been one program (the ``fused`` argument:
:func:`meshplan.cost_model.fusion.kept_after_fusion`'s complement): the
forward keeps what the cost model's activation memory counts, not every
value of the chain the backward reads.

Zero bubble (``zero_bubble``, the ZB-H1 schedule): a stage's backward task
is cut by dependence into ``B``, the equations the values other stages read
need (the gradient of the stage's inputs), and ``W`` (key ``("W", s)``), the
rest (its parameters' gradients and their running sums).  What ``W`` reads
of ``B``'s equations becomes an output of ``B``, kept until ``W`` runs like
any activation; ``W`` reads the forward's values itself.  Each of ``B``
and ``W`` then replays the element-wise chains of ``fused`` it reads, so the
forward keeps what it keeps under 1F1B (cut before the replay, the forward
kept every value of those chains: 46% more on a gpt block).  A stage whose
backward sends nothing back (the first) or replays its forward
(recomputation) keeps one backward task.
"""
from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import AbstractSet, Any, Sequence

import jax

from meshplan.contributions import once_a_step
from meshplan.errors import MeshplanError, StalePlanError
from meshplan.recompute import FULL, NONE, recompute_name
from meshplan.schedule import group_order
from meshplan.traced import GRAD_BOUNDARY, FlatEqn, FlatJaxpr, Lit, computed_into

__all__ = ("Task", "StepSplit", "split_step", "dispatch_order", "MEAN", "LAST", "CONCAT",)

# kinds of value crossing from the per-micro-batch phase to the update/outputs
MEAN, LAST, CONCAT = "mean", "last", "concat"


# ---------------------------------------------------------------------------
# The split: every equation to a (phase, stage); tasks and their wiring
# ---------------------------------------------------------------------------

@dataclasses.dataclass
class Task:
    """One program: the equations of one stage in one phase (``level`` orders
    the apply programs of a step)."""
    kind: str       # "F", "B", "W" (zb-h1), "A" or "R" (once, ahead: draws, casts, statistics)
    stage: int
    level: int = 0
    eqns: list[int] = dataclasses.field(default_factory=list)     # own equations (flat order)
    inputs: tuple[int, ...] = ()     # ids read from outside the program
    outputs: tuple[int, ...] = ()    # ids other programs / the step outputs need
    accumulate: tuple[int, ...] = () # ids summed over micro-batches (C phase)
    # [remat] forward equations of the stage recomputed in this (backward)
    # program before its own equations (flat order; their values are not outputs)
    replay: list[int] = dataclasses.field(default_factory=list)

    @property
    def key(self) -> tuple:
        return (self.kind, self.stage) if self.kind != "A" else ("A", self.stage, self.level)

    def name(self) -> str:
        what = {"F": "forward", "B": "backward", "W": "weight gradients", "A": "update",
                "R": "draws, casts and statistics"}[self.kind]
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
    # draw equation -> (batch dimension, full-batch shape): the R tasks' draws
    draws: dict[int, tuple[int, tuple[int, ...]]] = dataclasses.field(default_factory=dict)
    # equation -> its jaxpr equation at the full batch (what R tasks run)
    full_eqns: dict[int, Any] = dataclasses.field(default_factory=dict)
    # the narrowing casts of state R tasks make once a step (_hoisted_casts)
    hoisted: frozenset[int] = frozenset()
    # how the micro-batches' values combine (see :func:`_combination`): a
    # MEAN crossing's degree d (its sum over the micro-batches divided by
    # m ** (1 - d): 0 a mean, 1 a sum); crossings no combination gives
    # exactly, with why; and the whole batch's literals and constants the
    # update runs with (equation -> its operands; constant id -> value)
    degree: dict[int, Any] = dataclasses.field(default_factory=dict)
    inexact: dict[int, str] = dataclasses.field(default_factory=dict)
    full_literals: dict[int, tuple] = dataclasses.field(default_factory=dict)
    full_consts: dict[int, Any] = dataclasses.field(default_factory=dict)
    # id -> degree of every value per example or summed over the batch
    # (:mod:`meshplan.trace.scaling`; the partial sums' rescaled cotangents)
    value_degree: dict[int, Any] = dataclasses.field(default_factory=dict)
    # MEAN crossings combined as the micro-batches' "max" or "min" instead
    extremum: dict[int, str] = dataclasses.field(default_factory=dict)
    # the batch statistics R tasks make once a step from the whole batch
    # (ids): every micro-batch, the update and the outputs read the one value
    statistics: frozenset[int] = frozenset()


def split_step(flat: FlatJaxpr, forward: Sequence[bool], layer_of_node: Sequence[int],
               stage_layers: Sequence[tuple[int, int]], batch_ids: Sequence[int],
               num_micro_batches: int, concat_outputs: Sequence[int] = (),
               remat: Sequence[bool | str] = (), selective: frozenset[int] = frozenset(),
               fused: frozenset[int] = frozenset(),
               draws: Sequence[tuple[int, int, tuple[int, ...]]] = (),
               draw_eqns: Sequence[tuple[int, Any]] = (),
               zero_bubble: bool = False, remat_layers: Sequence[int] = (),
               keep_casts: Sequence[bool] = (), scaling: Any = None,
               output_paths: Sequence[str] = ()) -> StepSplit:
    """Assign every equation of ``flat`` to a stage and phase and build the
    tasks (see the module doc).  ``concat_outputs``: output ids whose
    dimension 0 is the batch.  ``remat``: per stage, whether its backward
    recomputes its forward (a bool, or none/selective/full; see the module
    doc); default none.  ``fused``: the equations a stage recomputing nothing
    replays (see the module doc).  ``selective``: the equations a selective stage may
    replay.  ``draws``: the random draws over the batch
    (``TracedStep.batch_draws``) and ``draw_eqns`` their per-example
    ancestors at the full batch (``TracedStep.draw_eqns``).  ``zero_bubble``:
    cut the backwards into B and W (see the module doc).  ``remat_layers``:
    per stage recomputing fully, how many of its first layers do (0: all; the
    later ones recompute as a stage recomputing nothing).  ``keep_casts``:
    per stage, whether its parameters' narrowed copies are made once a step
    (:func:`_hoisted_casts`; default yes).  ``scaling``: how the values
    scale with the batch (``TracedStep.scaling``), which says how the
    micro-batches combine (:func:`_combination`); None: averaged.
    ``output_paths``: each output leaf's path, to name it in a refusal."""
    eqn_stage = _eqn_stages(len(flat.eqns), layer_of_node, stage_layers)
    flow = _flow(flat, frozenset(batch_ids),
                 {o for k, _, _ in draws for o in flat.eqns[k].outvars},
                 scaling.statistics if scaling is not None and num_micro_batches > 1
                 else frozenset())
    # (what some output is computed from: not a scalar made and left unread)
    feeding = computed_into(flat.eqns, (x for x in flat.outvars if isinstance(x, int)))
    if not flow.markers and not any(
            not forward[k] and not flow.is_const[k] and not flow.bdep.isdisjoint(fe.outvars)
            and not feeding.isdisjoint(fe.outvars) for k, fe in enumerate(flat.eqns)):
        # an evaluation step: its work on the batch is all forward (a scalar
        # it makes and leaves unread too)
        forward = [True] * len(flat.eqns)
    elif not flow.markers and num_micro_batches > 1:
        raise MeshplanError(
            "running more than one micro-batch needs to know where the gradients end: compute "
            "them with meshplan.value_and_grad / meshplan.grad instead of jax's (or plan with "
            "num_micro_batches=1)")
    # a gradient summed from several layers' contributions: summed once a step
    once, _ = once_a_step([(fe.eqn.primitive.name, [x for x in fe.invars if isinstance(x, int)],
                            fe.outvars) for fe in flat.eqns], layer_of_node, GRAD_BOUNDARY)
    tail = _sum_tails(flat.eqns, flow, scaling) if scaling is not None and num_micro_batches > 1 \
        else frozenset()
    phase = _phases(flat.eqns, flow, forward, once, tail)
    drawn = {k: (d, tuple(full)) for k, d, full in draws
             if num_micro_batches > 1 and phase[k] in ("F", "B")}
    hoisted = frozenset(
        k for k in (_hoisted_casts(flat, flow, phase) if num_micro_batches > 1 else ())
        if eqn_stage[k] >= len(keep_casts) or keep_casts[eqn_stage[k]])
    stats = _statistics(flat, phase, scaling) if num_micro_batches > 1 else frozenset()
    for k in (*drawn, *hoisted, *stats):
        phase[k] = "R"
    moved = _keep_pipeline(flat.eqns, phase, eqn_stage, flow.producer_eqn)
    tasks, producer = _tasks(flat.eqns, phase, eqn_stage, flow.producer_eqn, flow.alias,
                             {x for x in flat.outvars if isinstance(x, int)})
    _ahead_inputs(tasks, flat, flow, stats)
    needed_by = _wire_inputs(tasks, flat.eqns, flow.const_ids)
    for o, i in flow.alias.items():      # (a gradient an update program sums)
        if producer.get(i, ("",))[0] == "A":
            needed_by[i].update(needed_by.get(o, ()))
    # (integer values combined exactly: sums over the batch, maxima)
    sums = {x for x, i in scaling.info.items() if (i.kind == "S" and i.degree == 1)
            or i.kind == "M"} if scaling is not None else set()
    # (what depends on no example is every micro-batch's same value: what is
    # computed from the statistics alone, a loop's counter beside the
    # batch's values in its carry)
    whole = {x for x, i in scaling.info.items() if i.kind == "N"} if scaling is not None \
        else set()
    crossing = _crossings(flat, tasks, producer, flow, set(concat_outputs), num_micro_batches,
                          sums, whole, output_paths)
    prefix = [frozenset(k for k, l in enumerate(layer_of_node) if l < lo + n) if n else None
              for (lo, _), n in zip(stage_layers, remat_layers)]
    # (ZB-H1: the element-wise chains are replayed once B and W are cut, by
    # each of them, so that the forward keeps what it keeps under 1F1B)
    _replay_forwards(tasks, flat.eqns, remat, needed_by, selective,
                     frozenset() if zero_bubble else fused, prefix)
    ahead = set(drawn) | hoisted | stats
    deps = _outputs_and_deps(tasks, flat, producer, needed_by, crossing, flow.alias, ahead, stats)
    _check_pipeline(tasks, flat.eqns, producer, deps)
    if zero_bubble:
        _split_weight_gradients(tasks, flat.eqns, producer, needed_by, flow.const_ids)
        if fused:
            _replay_forwards(tasks, flat.eqns, (), needed_by, fused=fused, kinds=("B", "W"))
            _outputs_and_deps(tasks, flat, producer, needed_by, crossing, flow.alias, ahead, stats)
        deps = {key: {producer[x] for x in t.inputs if _c_phase(producer.get(x))}
                for key, t in tasks.items() if _c_phase(key)}
    const_eqn = {o: k for k, fe in enumerate(flat.eqns) if flow.is_const[k] for o in fe.outvars}
    full_eqns = dict(draw_eqns) if drawn else {}
    if stats:       # (the statistics' R tasks compute them from the whole batch,
        # the constants they read included: a variance's divisor)
        full_eqns.update((k, scaling.full_eqns[fe.outvars[0]]) for k, fe in enumerate(flat.eqns)
                         if fe.outvars and fe.outvars[0] in scaling.full_eqns)
    split = StepSplit(len(stage_layers), eqn_stage, phase, tasks, producer, const_eqn, crossing,
                      flow.alias, flow.batch_ids, deps, moved, drawn, full_eqns, hoisted,
                      statistics=frozenset(o for k in stats for o in flat.eqns[k].outvars))
    if scaling is not None and num_micro_batches > 1:
        _combination(split, flat, scaling)
    return split


def _combination(split: StepSplit, flat: FlatJaxpr, scaling: Any) -> None:
    """How each value crossing into the update and the outputs combines
    over the micro-batches (:mod:`meshplan.trace.scaling`): a sum over the
    examples of degree d is the micro-batches' sum divided by m ** (1 - d)
    (a mean averaged, a sum summed); a maximum over the examples computed
    by a forward is the micro-batches' maximum; per-example outputs are concatenated
    where they do not scale with the batch.  The rest is named in
    ``split.inexact``.  The update then runs with the whole batch's
    literals (a division by the batch size there divides by the whole
    batch's), so it is the undecorated step's update on the whole batch's
    values."""
    for x, how in split.crossing.items():
        info = scaling.info.get(x)
        if info is None:
            continue
        if how == LAST:     # (every micro-batch's same value, unless made from its size)
            if info.kind == "N" and info.degree != 0:
                split.inexact[x] = ("a value computed from the batch's size (x.shape[0]), "
                                    "which each micro-batch takes to be its own")
            continue
        if info.kind == "X":
            split.inexact[x] = info.why
        elif info.folded and how != CONCAT:
            split.inexact[x] = ("a value per chunk of the batch (x.reshape(k, B // k, ...)): "
                                "each micro-batch's chunk k holds other examples than the "
                                "whole batch's")
        elif how == MEAN and info.kind == "S" and info.degree is not None:
            split.degree[x] = info.degree
        elif how == MEAN and info.kind == "M" and split.producer[x][0] == "F":
            split.extremum[x] = info.extremum
        elif how == CONCAT and info.position:
            split.inexact[x] = ("an output made from the rows' places in the batch (jnp.arange "
                                "of the batch size): each micro-batch's rows start again at 0")
        elif not (how == CONCAT and info.kind in "PN" and info.degree == 0
                  and not info.folded) \
                and not (how == MEAN and info.kind == "N"):
            split.inexact[x] = "a value that scales with the micro-batch size"
    for k, fe in enumerate(flat.eqns):
        if fe.outvars and any((fe.outvars[0], pos) in scaling.literals
                              for pos in range(len(fe.invars))):
            split.full_literals[k] = tuple(
                Lit(scaling.literals[(fe.outvars[0], pos)], x.aval)
                if (fe.outvars[0], pos) in scaling.literals else x
                for pos, x in enumerate(fe.invars))
    split.full_consts.update(scaling.consts)
    split.value_degree.update((x, i.degree) for x, i in scaling.info.items()
                              if i.kind in "PS" and i.degree is not None)


def _statistics(flat: FlatJaxpr, phase: Sequence[str], scaling: Any) -> frozenset[int]:
    """The equations making the batch statistics that run once a step at the
    whole batch (``Scaling.statistics``: a loss's token count); the analysis
    chose them among the per-micro-batch work that only such work reads."""
    if scaling is None or not scaling.statistics:
        return frozenset()
    made = [k for k, fe in enumerate(flat.eqns) if any(o in scaling.statistics for o in fe.outvars)
            and not (phase[k] == "A" and all(o in scaling.sized for o in fe.outvars))]
    late = [k for k in made if phase[k] not in ("F", "B")]
    if late:    # (the combination assumed every micro-batch reads the whole batch's value)
        raise MeshplanError(
            f"with micro-batches, operation {late[0]} ({flat.eqns[late[0]].eqn.primitive.name}) "
            "computes a value from the whole batch that both the micro-batches and the update "
            "or the outputs read (as the next key taken from a key split into the batch size "
            "plus one), which the pipeline cannot give both; plan with num_micro_batches=1, or "
            "split the next key off before splitting the batch's keys")
    return frozenset(made)


def _eqn_stages(n: int, layer_of_node: Sequence[int],
                stage_layers: Sequence[tuple[int, int]]) -> list[int]:
    """The stage of every equation, from the plan's layering."""
    if len(layer_of_node) != n:
        raise StalePlanError(
            f"the plan's layering covers {len(layer_of_node)} operations but the step traced at "
            f"micro-batch size has {n}; the plan was made for another function or other shapes: "
            "re-plan with these arguments")
    stage_of_layer: dict[int, int] = {}
    for s, (first, last) in enumerate(stage_layers):
        for l in range(first, last + 1):
            stage_of_layer[l] = s
    missing = sorted({l for l in layer_of_node if l not in stage_of_layer})
    if missing:
        raise StalePlanError(f"the plan's stages do not cover layer {missing[0]}; re-plan")
    return [stage_of_layer[l] for l in layer_of_node]


@dataclasses.dataclass
class _Flow:
    """What every value depends on (see :func:`_flow`)."""
    producer_eqn: dict[int, int]     # id -> the equation making it
    const_ids: set[int]              # made from constants and literals alone
    is_const: list[bool]             # per equation
    bdep: set[int]                   # depends on the batch
    after: set[int]                  # downstream of the gradients
    markers: list[int]               # the gradient-marker equations
    alias: dict[int, int]            # gradient-marker output id -> its input id
    batch_ids: frozenset[int]


def _flow(flat: FlatJaxpr, batch_ids: frozenset[int],
          drawn: set[int] = frozenset(), statistics: frozenset[int] = frozenset()) -> _Flow:
    """What every value depends on; ``drawn``: the draws over the batch,
    which differ per micro-batch like the batch (each reads its rows).
    ``statistics``: the batch statistics.  One made from constants alone (the
    count of a mask built with jnp.ones of the batch's shape), like a draw
    from a constant key (dropout keyed by jax.random.key(0) in the step), is
    no constant each program remakes at its micro-batch's size: as the
    others, it is made once a step at the whole batch's and read by the
    micro-batches."""
    eqns = flat.eqns
    producer_eqn: dict[int, int] = {}
    for k, fe in enumerate(eqns):
        for o in fe.outvars:
            producer_eqn[o] = k
    # constant equations: read only constants and literals (transitively)
    const_ids = set(flat.constvars)
    is_const = [False] * len(eqns)
    made_once: set[int] = set()
    for k, fe in enumerate(eqns):
        if all(isinstance(x, Lit) or x in const_ids for x in fe.invars):
            if any(o in statistics or o in drawn for o in fe.outvars):
                made_once.update(fe.outvars)
                continue
            is_const[k] = True
            const_ids.update(fe.outvars)
    # batch dependence and "after the gradients"
    bdep = set(batch_ids) | set(drawn) | made_once
    after: set[int] = set()
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
    return _Flow(producer_eqn, const_ids, is_const, bdep, after, markers, alias, batch_ids)


def _sum_tails(eqns: Sequence[FlatEqn], flow: _Flow, scaling: Any) -> frozenset[int]:
    """Equations that compute a nonlinear function of sums over the batch
    (``exp`` of a mean loss) from such sums alone, and what reads them alone:
    run once a step on the micro-batches' combined sums (their results
    exact) unless the per-micro-batch work needs them (:func:`_phases`)."""
    info = scaling.info
    made: set[int] = set()     # values of sums alone (S), computed by such equations
    tail: set[int] = set()
    for k, fe in enumerate(eqns):
        ins = [x for x in fe.invars if isinstance(x, int)]
        if flow.is_const[k] or not fe.outvars or not any(x in flow.bdep for x in ins):
            continue
        if all(x in made or (x in info and info[x].kind in "NS") for x in ins) and \
                all(o in info and info[o].kind != "P" for o in fe.outvars):
            made.update(fe.outvars)
            if any(info[o].kind == "X" for o in fe.outvars) or any(
                    x in made and info[x].kind == "X" for x in ins):
                tail.add(k)
    return frozenset(tail)


def _phases(eqns: Sequence[FlatEqn], flow: _Flow, forward: Sequence[bool],
            once: frozenset[int], tail: frozenset[int] = frozenset()) -> list[str]:
    """The phase of every equation (see the module doc): the C phase holds
    the ancestors of the gradients and of everything batch-dependent that
    does not come after the gradients.  ``once``: sums of gradient
    contributions (:func:`meshplan.contributions.once_a_step`), run in the
    update; their operands are the C phase's results instead.  ``tail``
    (:func:`_sum_tails`): run in the update unless the C phase needs them."""
    n = len(eqns)
    markers, after = flow.markers, flow.after
    need: set[int] = set()
    for k in markers:
        need.update(x for x in eqns[k].invars if isinstance(x, int))
    for k, fe in enumerate(eqns):
        if not flow.is_const[k] and k not in markers and k not in tail \
                and any(o in flow.bdep for o in fe.outvars) \
                and not any(o in after for o in fe.outvars):
            need.update(fe.outvars)
    # an operation with effects only (jax.debug.callback, print) that reads
    # a micro-batch's values runs with each micro-batch, as in a scan
    effect = {k for k, fe in enumerate(eqns)
              if not fe.outvars and any(isinstance(x, int) and x in flow.bdep for x in fe.invars)
              and not any(isinstance(x, int) and x in after for x in fe.invars)}
    aside = _effects_of_forward(eqns, effect, forward, flow.producer_eqn)
    in_c = [False] * n
    for k in range(n - 1, -1, -1):
        fe = eqns[k]
        if k in markers or flow.is_const[k]:
            continue
        if k in once:
            need.update(x for x in fe.invars if isinstance(x, int))
            continue
        if k in effect or any(o in need for o in fe.outvars):
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
        elif flow.is_const[k]:
            phase.append("K")
        elif in_c[k] and k not in once:
            phase.append("F" if forward[k] or k in aside else "B")
        else:
            phase.append("A")
    return phase


def _effects_of_forward(eqns: Sequence[FlatEqn], effect: set[int], forward: Sequence[bool],
                        producer_eqn: dict[int, int]) -> set[int]:
    """The effects (:func:`_phases`) that read forward values alone, and
    the equations only they read (``jnp.mean(h)`` printed): they run with
    the forward, though the loss is computed from none of them."""
    readers: dict[int, list[int]] = defaultdict(list)
    for k, fe in enumerate(eqns):
        for x in fe.invars:
            if isinstance(x, int):
                readers[x].append(k)
    feeding = set(effect)       # (read by the effects alone)
    for k in range(len(eqns) - 1, -1, -1):
        outs = eqns[k].outvars
        if k not in feeding and outs and all(
                readers[o] and all(r in feeding for r in readers[o]) for o in outs):
            feeding.add(k)
    aside: set[int] = set()
    for k, fe in enumerate(eqns):
        if k in feeding and all(forward[producer_eqn[x]] or producer_eqn[x] in aside
                                for x in fe.invars if isinstance(x, int) and x in producer_eqn):
            aside.add(k)
    return aside


def _keep_pipeline(eqns: Sequence[FlatEqn], phase: list[str], eqn_stage: list[int],
                   producer_eqn: dict[int, int]) -> int:
    """Keep the per-micro-batch work a pipeline: a forward op runs no earlier
    than the forward ops it reads, a backward op no later than the backward
    ops it reads (the planner's layering guarantees it for the usual steps;
    an odd op is moved, deterministically).  Returns how many were moved."""
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
    for k in range(len(eqns) - 1, -1, -1):
        if phase[k] == "B":
            users = [eqn_stage[c] for c in consumers.get(k, ())]
            if users and max(users) > eqn_stage[k]:
                eqn_stage[k] = max(users)
                moved += 1
    return moved


def _tasks(eqns: Sequence[FlatEqn], phase: list[str], eqn_stage: list[int],
           producer_eqn: dict[int, int], alias: dict[int, int], returned: AbstractSet[int]
           ) -> tuple[dict[tuple, Task], dict[int, tuple]]:
    """(tasks, id -> key of the task making it).  Apply levels: a stage's
    update work is cut where it needs a value computed by another stage's
    update work, or a gradient an update program sums (the update reads the
    marker's output, which the driver finds under the marker's input).  An
    update equation whose values only a later level of its stage reads runs
    there (a tied weight's moments decayed early would cross as new tables)."""
    level_of_id: dict[int, int] = {}
    level: dict[int, int] = {}
    for k, fe in enumerate(eqns):
        ph, s = phase[k], eqn_stage[k]
        if ph == "M":
            for o in fe.outvars:
                i = alias.get(o)
                if i in level_of_id:
                    level_of_id[o] = level_of_id[i] + 1
        elif ph == "A":
            lvl = 0
            for x in fe.invars:
                if isinstance(x, int) and x in level_of_id:
                    pk = producer_eqn[x]
                    lvl = max(lvl, level_of_id[x] + (eqn_stage[pk] != s))
            for o in fe.outvars:
                level_of_id[o] = lvl
            level[k] = lvl
    readers: dict[int, list[int]] = defaultdict(list)
    for k, fe in enumerate(eqns):
        for x in fe.invars:
            if isinstance(x, int):
                readers[x].append(k)
    for k in sorted(level, reverse=True):
        outs = eqns[k].outvars
        if not outs or any(o in returned for o in outs):
            continue
        users = [c for o in outs for c in readers[o]]
        if users and all(c in level for c in users):
            level[k] = max(level[k], min(level[c] - (eqn_stage[c] != eqn_stage[k])
                                         for c in users))
    tasks: dict[tuple, Task] = {}
    producer: dict[int, tuple] = {}
    for k, fe in enumerate(eqns):
        ph, s = phase[k], eqn_stage[k]
        if ph in ("M", "K"):
            continue
        key = ("A", s, level[k]) if ph == "A" else (ph, s)
        if key not in tasks:
            tasks[key] = Task(ph, s, key[2] if ph == "A" else 0)
        tasks[key].eqns.append(k)
        for o in fe.outvars:
            producer[o] = key
    return tasks, producer


def _hoisted_casts(flat: FlatJaxpr, flow: _Flow, phase: Sequence[str]) -> frozenset[int]:
    """[several micro-batches] The casts of state (a float32 parameter) to a
    narrower float type that only per-micro-batch work reads: each runs once
    a step in its stage's R task, ahead of the micro-batches, and every
    micro-batch reads the copy, where the forward would cast again for each
    micro-batch and each recomputation.  The planner's rule is
    :func:`meshplan.graph.hoisted_casts`."""
    readers: dict[int, list[int]] = defaultdict(list)
    for k, fe in enumerate(flat.eqns):
        for x in fe.invars:
            if isinstance(x, int):
                readers[x].append(k)
    outs = {x for x in flat.outvars if isinstance(x, int)}
    inexact = jax.numpy.inexact
    found = []
    for k, fe in enumerate(flat.eqns):
        if phase[k] not in ("F", "B") or fe.eqn.primitive.name != "convert_element_type":
            continue
        x, o = fe.invars[0], fe.outvars[0]
        if not isinstance(x, int) or x in flow.bdep or x in flow.after or x in flow.const_ids \
                or o in outs:
            continue
        src, dst = flat.avals[x].dtype, flat.avals[o].dtype
        if jax.numpy.issubdtype(src, inexact) and jax.numpy.issubdtype(dst, inexact) \
                and dst.itemsize < src.itemsize \
                and all(phase[r] in ("F", "B") for r in readers[o]):
            found.append(k)
    return frozenset(found)


def _ahead_inputs(tasks: dict[tuple, Task], flat: FlatJaxpr, flow: _Flow,
                  stats: frozenset[int] = frozenset()) -> None:
    """An R task also computes what its draws, casts and statistics read
    (the draws' keys, a parameter's reshape, a padding mask) from the
    arguments: those equations run again there, once per step (they stay in
    the programs that made them too, where something else reads them).
    ``stats``: the batch statistics' equations, which read the whole batch."""
    for key, t in tasks.items():
        if key[0] != "R":
            continue
        own = set(t.eqns)
        stack = [(x, k in stats) for k in t.eqns for x in flat.eqns[k].invars
                 if isinstance(x, int)]
        while stack:
            x, of_batch = stack.pop()
            k = flow.producer_eqn.get(x)
            if k is None or k in own or x in flow.const_ids:
                continue
            if (x in flow.bdep and not of_batch) or x in flow.after:
                raise MeshplanError(
                    f"a random draw over the batch ({t.name()}) takes its key from the batch or "
                    "the gradients, so it cannot be drawn once per step; pass the key as a "
                    "separate argument or use one micro-batch (num_micro_batches=1)")
            own.add(k)
            stack.extend((y, of_batch) for y in flat.eqns[k].invars if isinstance(y, int))
        t.eqns = sorted(own)


def _wire_inputs(tasks: dict[tuple, Task], eqns: Sequence[FlatEqn],
                 const_ids: set[int]) -> dict[int, set[tuple]]:
    """Set every task's inputs; returns id -> keys of the tasks reading it."""
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
    return needed_by


def _c_phase(key: tuple | None) -> bool:
    return key is not None and key[0] in ("F", "B", "W")


def _crossings(flat: FlatJaxpr, tasks: dict[tuple, Task], producer: dict[int, tuple],
               flow: _Flow, concat: set[int], num_micro_batches: int,
               sums: set[int] = frozenset(), whole: set[int] = frozenset(),
               output_paths: Sequence[str] = ()) -> dict[int, str]:
    """What crosses from the per-micro-batch phase into the update and the
    outputs, and how it is combined over micro-batches.  ``sums``: sums over
    the examples (an integer one is summed, exactly); ``whole``: values the
    same in every micro-batch (the last one's taken)."""
    crossing: dict[int, str] = {}

    def cross(x: int, why: str) -> None:
        if x in crossing or not _c_phase(producer.get(x)):
            return
        if x in concat and x in flow.bdep:
            crossing[x] = CONCAT
        elif x in flow.bdep and x not in whole:
            aval = flat.avals[x]
            if num_micro_batches > 1 and x not in sums and \
                    not jax.numpy.issubdtype(aval.dtype, jax.numpy.inexact):
                raise MeshplanError(
                    f"{why} is a batch-dependent {aval.dtype} value, which cannot be averaged over "
                    "micro-batches; return floating-point means or sums over the batch (or plan "
                    "with num_micro_batches=1)")
            crossing[x] = MEAN
        else:
            crossing[x] = LAST

    for key, t in tasks.items():
        if key[0] != "A":
            continue
        for x in t.inputs:
            if x in flow.batch_ids and num_micro_batches > 1:
                raise MeshplanError(
                    f"the update ({t.name()}) reads the batch itself (as an optimizer that "
                    "evaluates the loss again, a line search, does); with micro-batches the "
                    "update may only read gradients, state and batch means: plan with "
                    "num_micro_batches=1")
            cross(flow.alias.get(x, x), f"a value the update ({t.name()}) reads")
    for k, x in enumerate(flat.outvars):
        if isinstance(x, int):
            cross(flow.alias.get(x, x), f"the output {output_paths[k]}"
                  if len(output_paths) == len(flat.outvars) and output_paths[k]
                  else f"output leaf {k} of the step (jax.tree.leaves order)")
    # marker outputs whose input comes straight from the C phase
    for o, i in flow.alias.items():
        cross(i, "a gradient")
    return crossing


def _replay_forwards(tasks: dict[tuple, Task], eqns: Sequence[FlatEqn], remat: Sequence[bool | str],
                     needed_by: dict[int, set[tuple]], selective: frozenset[int] = frozenset(),
                     fused: frozenset[int] = frozenset(),
                     prefix: Sequence[frozenset[int] | None] = (),
                     kinds: Sequence[str] = ("B",)) -> None:
    """[remat] a backward replays its stage's forward (full), or the selective
    region's part of it, or (no recomputation) the element-wise chains of
    ``fused``, from the values that forward read or made.  ``prefix[s]``:
    where stage ``s`` recomputes fully, the equations of the layers that do
    (None: all); the others' are replayed as with no recomputation.
    ``kinds``: the backward tasks that replay (ZB-H1: its B and its W, each
    what it reads; one that replays already is left as it is)."""
    maker = {o: key for key, t in tasks.items() for k in t.eqns for o in eqns[k].outvars} \
        if "W" in kinds else {}
    for kind, s in sorted({key[:2] for key in tasks if key[0] in kinds}):
        r = recompute_name(remat[s] if s < len(remat) else NONE)
        f, b = tasks.get(("F", s)), tasks.get((kind, s))
        if f is None or b is None or b.replay or (r == NONE and not fused):
            continue
        part = prefix[s] if s < len(prefix) and r == FULL else None
        again_ok = fused if r == NONE or part is not None else selective
        made = {o for k in f.eqns for o in eqns[k].outvars}
        want = {x for x in b.inputs if x in made}
        if not want:
            continue
        # (a W replays from what its forward made alone: the values the
        # forward received from other programs reach F and B only, the
        # remat copies the driver keeps, Wiring.keep)
        foreign = set() if kind == "B" else {
            x for x in f.inputs if isinstance(x, int) and maker.get(x, f.key) != f.key}
        replay: set[int] = set()
        for k in reversed(f.eqns):
            if ((r == FULL and (part is None or k in part)) or k in again_ok) \
                    and any(o in want for o in eqns[k].outvars) \
                    and not any(x in foreign for x in eqns[k].invars if isinstance(x, int)):
                replay.add(k)
                want.update(x for x in eqns[k].invars if isinstance(x, int))
        if not replay:
            continue
        b.replay = sorted(replay)
        again = {o for k in replay for o in eqns[k].outvars}
        ins = [x for x in b.inputs if x not in again]
        # what the replay reads: the forward's inputs, and (selective) values
        # the rest of the forward made
        for k in b.replay:
            for x in eqns[k].invars:
                if isinstance(x, int) and x not in again and x not in ins \
                        and (x in made or x in f.inputs):
                    ins.append(x)
        for x in b.inputs:
            needed_by[x].discard(b.key)
        b.inputs = tuple(ins)
        for x in ins:
            needed_by[x].add(b.key)


def _outputs_and_deps(tasks: dict[tuple, Task], flat: FlatJaxpr, producer: dict[int, tuple],
                      needed_by: dict[int, set[tuple]], crossing: dict[int, str],
                      alias: dict[int, int], ahead: set[int] | frozenset[int] = frozenset(),
                      stats: frozenset[int] = frozenset()) -> dict[tuple, set[tuple]]:
    """Set every task's outputs and running sums; returns, per C task, the C
    tasks it reads from (within one micro-batch).  ``ahead``: the equations
    R tasks run for the others (draws, hoisted casts, batch statistics);
    ``stats``: the statistics', which the update and the outputs may read."""
    eqns = flat.eqns
    out_ids = [x for x in flat.outvars if isinstance(x, int)]
    out_ids += [alias[x] for x in out_ids if x in alias]
    deps: dict[tuple, set[tuple]] = {}
    for key, t in tasks.items():
        if key[0] == "R":       # what it runs for the others alone (what they read is theirs)
            t.outputs = tuple(o for k in t.eqns if k in ahead
                              and producer.get(eqns[k].outvars[0]) == key
                              for o in eqns[k].outvars)
            bad = [o for k in t.eqns if k in ahead and k not in stats
                   for o in eqns[k].outvars if o in t.outputs and (
                       o in out_ids or any(c[0] not in ("F", "B", "W")
                                                for c in needed_by.get(o, ())))]
            if bad:
                raise MeshplanError(
                    f"random bits drawn over the batch (tensor t{bad[0]}) are read outside the "
                    "per-micro-batch work (by the update, or as an output of the step); return "
                    "values computed from them instead, or use one micro-batch")
            continue
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
            deps[key] = {producer[x] for x in t.inputs if _c_phase(producer.get(x))}
    return deps


def _check_pipeline(tasks: dict[tuple, Task], eqns: Sequence[FlatEqn], producer: dict[int, tuple],
                    deps: dict[tuple, set[tuple]]) -> None:
    """The C phase must fit a pipeline: forward reads earlier stages'
    forwards; backward reads forwards and later stages' backwards."""
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


def _split_weight_gradients(tasks: dict[tuple, Task], eqns: Sequence[FlatEqn],
                            producer: dict[int, tuple], needed_by: dict[int, set[tuple]],
                            const_ids: set[int]) -> None:
    """[zero bubble] every stage's backward cut into B and W (module doc)."""
    for key in [k for k in tasks if k[0] == "B"]:
        t = tasks[key]
        sent = {o for o in t.outputs
                if any(c != key and c[0] in ("F", "B") for c in needed_by.get(o, ()))}
        if not sent or t.replay:
            continue
        # B: the equations what other stages read depends on
        need, mine = set(sent), set()
        for k in reversed(t.eqns):
            if any(o in need for o in eqns[k].outvars):
                mine.add(k)
                need.update(x for x in eqns[k].invars if isinstance(x, int))
        rest = [k for k in t.eqns if k not in mine]
        if not rest:
            continue
        b_eqns = [k for k in t.eqns if k in mine]
        made_b = {o for k in b_eqns for o in eqns[k].outvars}
        made_w = {o for k in rest for o in eqns[k].outvars}
        w_in: list[int] = []
        for k in rest:
            for x in eqns[k].invars:
                if isinstance(x, int) and x not in made_w and x not in const_ids \
                        and x not in w_in:
                    w_in.append(x)
        b_read = {x for k in b_eqns for x in eqns[k].invars if isinstance(x, int)}
        w = Task("W", key[1], 0, rest, tuple(w_in),
                 tuple(o for o in t.outputs if o in made_w),
                 tuple(o for o in t.accumulate if o in made_w))
        kept = [x for x in w_in if x in made_b]
        t.eqns = b_eqns
        t.outputs = tuple(dict.fromkeys([o for o in t.outputs if o in made_b] + kept))
        t.accumulate = tuple(o for o in t.accumulate if o in made_b)
        for x in t.inputs:
            if x not in b_read:
                needed_by[x].discard(key)
        t.inputs = tuple(x for x in t.inputs if x in b_read)
        for o in made_w:
            producer[o] = w.key
        for x in w_in:
            needed_by[x].add(w.key)
        tasks[w.key] = w


def dispatch_order(split: StepSplit, schedule: str, m: int,
                   groups: Sequence[int] | None = None) -> list[tuple[str, int, int]]:
    """One global order of (kind, stage, micro-batch) that follows every
    device group's schedule order and every data dependence.  ``groups``:
    the device group of every stage (default: its own); an interleaved plan
    puts virtual stage ``k`` on group ``k % p`` (:func:`meshplan.schedule.group_order`)."""
    n = split.num_stages
    groups = tuple(range(n)) if groups is None else tuple(groups)
    p = len(set(groups))
    chunks = n // p
    orders = [[(k, s, i) for k, s, i in group_order(schedule, g, p, m, chunks)
               if (k, s) in split.tasks] for g in range(p)]
    pos = [0] * p
    done: set[tuple[str, int, int]] = set()
    out: list[tuple[str, int, int]] = []
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for g in range(p):
            while pos[g] < len(orders[g]):
                kind, s, i = orders[g][pos[g]]
                if any((d[0], d[1], i) not in done for d in split.deps[(kind, s)]):
                    break
                out.append((kind, s, i))
                done.add((kind, s, i))
                pos[g] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise MeshplanError(f"the {schedule} schedule deadlocks on this step's stage "
                                "dependencies; re-plan with another schedule")
    return out
