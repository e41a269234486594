"""The best pipeline for one micro-batch count: stage costs from the layer
costs, Alpa's stage-submesh DP (:mod:`.stage_dp`) per schedule, the fastest
schedule kept.

A stage's latency is the sum of its layers' ILP latencies on the stage's
logical mesh, plus resharding the values its layers hand each other where
a hand-made method's plans disagree on a layout (:mod:`.joints`), plus sending the
activations and their gradients to the next stage
(:func:`meshplan.cost_model.pipeline.stage_send_s`).
"""
from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass, replace
from typing import Callable, NamedTuple, Sequence

from ..cluster import ClusterSpec
from ..cost_model.mesh import MeshModel, mesh_model
from ..cost_model.overlap import Backward, StageWork, hidden_s
from ..cost_model.pipeline import (accumulation_s, host_binds, in_flight, pipeline_host_s,
                                   shared_compute_iteration_s, stage_send_s, step_buffers)
from ..errors import InfeasiblePlanError
from ..graph import GRAD_BOUNDARY, INFERRED_GRADIENTS
from ..ilp import Pins
from ..plan import MemoryBreakdown
from ..recompute import FULL, NONE, SELECTIVE, recompute_name
from ..schedule import peak_kept, schedule_order
from ..units import human_bytes
from .interleave import CHUNKS, interleave, why_not_interleaved
from .joints import Flow, flow_cost, joint_cost, layer_flows
from .zero_bubble import ZB_H1, kept_parts, w_shares, zero_bubble
from .options import PipelineOptions
from .problem import LayerProblems
from .solver import TIGHTEN, LayerCost, LayerSolver
from .stage_dp import DPResult, StageChoice, Submesh, stage_dp


@dataclass(frozen=True)
class GroupCost:
    """What a group of consecutive layers adds to a stage on one mesh."""
    time_s: float            # forward + backward + update, no recomputation
    resident_bytes: float    # parameters, optimizer and other state
    saved_bytes: float       # kept per micro-batch in flight (what the backward reads)
    transient_bytes: float   # the largest layer's temporaries beyond what it saves
    remat_time_s: float      # time_s plus what full recomputation replays (LayerCost)
    boundary_bytes: float    # the layers' inputs: what recomputation keeps
    activation_bytes: float  # the largest layer's live intermediates
    grad_bytes: float = 0.0  # parameter gradients, accumulated over micro-batches
    optimizer_bytes: float = 0.0   # the optimizer state among resident_bytes
    # selective recomputation (meshplan.recompute): time with the attention
    # region run twice, what is kept then, and the largest working set
    selective_time_s: float = 0.0
    selective_saved_bytes: float = 0.0
    selective_transient_bytes: float = 0.0
    # what cost_model.overlap needs: the compute among time_s (remat_time_s,
    # selective_time_s), and one micro-batch's backward with its gradient
    # reductions (with recomputation, what is recomputed runs first)
    compute_s: float = 0.0
    remat_compute_s: float = 0.0
    selective_compute_s: float = 0.0
    backward: Backward = Backward()
    remat_backward: Backward = Backward()
    selective_backward: Backward = Backward()
    # the parameters' narrowed copies made once a step (LayerCost.cast_s,
    # copy_bytes): one run of their casts, and their bytes among resident_bytes
    cast_s: float = 0.0
    copy_bytes: float = 0.0
    kept_new_bytes: float = 0.0    # LayerCost.kept_new_bytes, summed
    reduced_grad_bytes: float = 0.0    # LayerCost.reduced_grad_bytes, summed

    @staticmethod
    def of_layers(parts: Sequence[LayerCost]) -> "GroupCost":
        bw = rbw = sbw = Backward()
        for p in reversed(parts):      # the backward runs from the last layer down
            bw = bw.then(p.backward)
            rbw = rbw.then(Backward(p.replay_compute_s)).then(p.backward)
            sbw = sbw.then(Backward(p.selective_s)).then(p.backward)
        return GroupCost(sum(p.time_s for p in parts), sum(p.resident_bytes for p in parts),
                         sum(p.saved_bytes for p in parts), max(p.transient_bytes for p in parts),
                         sum(p.time_s + p.replay_compute_s + p.replay_comm_s for p in parts),
                         sum(p.boundary_bytes for p in parts),
                         max(p.activation_bytes for p in parts), sum(p.grad_bytes for p in parts),
                         sum(p.optimizer_bytes for p in parts),
                         sum(p.time_s + p.selective_s for p in parts),
                         sum(p.selective_kept_bytes for p in parts),
                         max(p.selective_transient_bytes for p in parts),
                         compute_s=sum(p.compute_s for p in parts),
                         remat_compute_s=sum(p.compute_s + p.replay_compute_s for p in parts),
                         selective_compute_s=sum(p.compute_s + p.selective_s for p in parts),
                         backward=bw, remat_backward=rbw, selective_backward=sbw,
                         cast_s=sum(p.cast_s for p in parts),
                         copy_bytes=sum(p.copy_bytes for p in parts),
                         kept_new_bytes=sum(p.kept_new_bytes for p in parts),
                         reduced_grad_bytes=sum(p.grad_bytes if p.reduced_grad_bytes is None
                                                else p.reduced_grad_bytes for p in parts))

    @staticmethod
    def of_groups(rows: Sequence["GroupCost"]) -> "GroupCost":
        # (one pass over the rows, as sum() and max() would take them: the
        # stage DP joins groups hundreds of thousands of times)
        bw = rbw = sbw = Backward()
        for r in reversed(rows):
            bw, rbw = bw.then(r.backward), rbw.then(r.remat_backward)
            sbw = sbw.then(r.selective_backward)
        first = rows[0]
        time_s = resident = saved = remat = boundary = grads = optimizer = 0
        selective = selective_saved = compute = remat_compute = selective_compute = 0
        cast = copy = kept_new = reduced = 0
        transient, activation = first.transient_bytes, first.activation_bytes
        selective_transient = first.selective_transient_bytes
        for r in rows:
            time_s += r.time_s
            resident += r.resident_bytes
            saved += r.saved_bytes
            remat += r.remat_time_s
            boundary += r.boundary_bytes
            grads += r.grad_bytes
            optimizer += r.optimizer_bytes
            selective += r.selective_time_s
            selective_saved += r.selective_saved_bytes
            compute += r.compute_s
            remat_compute += r.remat_compute_s
            selective_compute += r.selective_compute_s
            cast += r.cast_s
            copy += r.copy_bytes
            kept_new += r.kept_new_bytes
            reduced += r.reduced_grad_bytes
            transient = max(transient, r.transient_bytes)
            activation = max(activation, r.activation_bytes)
            selective_transient = max(selective_transient, r.selective_transient_bytes)
        return GroupCost(time_s, resident, saved, transient, remat, boundary, activation, grads,
                         optimizer, selective, selective_saved, selective_transient,
                         compute_s=compute, remat_compute_s=remat_compute,
                         selective_compute_s=selective_compute,
                         backward=bw, remat_backward=rbw, selective_backward=sbw,
                         cast_s=cast, copy_bytes=copy, kept_new_bytes=kept_new,
                         reduced_grad_bytes=reduced)

    def work(self, recompute: str, send_s: float, num_micro_batches: int) -> StageWork:
        """The stage's work per micro-batch for cost_model.overlap."""
        time_s, compute, backward = {
            FULL: (self.remat_time_s, self.remat_compute_s, self.remat_backward),
            SELECTIVE: (self.selective_time_s, self.selective_compute_s, self.selective_backward),
        }.get(recompute, (self.time_s, self.compute_s, self.backward))
        return StageWork(compute, time_s - compute, send_s, backward, num_micro_batches)

    def way(self, recompute: str) -> tuple[float, float, float]:
        """(time, kept per micro-batch in flight, working set) of one choice."""
        if recompute == FULL:
            return self.remat_time_s, self.boundary_bytes, self.activation_bytes
        if recompute == SELECTIVE:
            return self.selective_time_s, self.selective_saved_bytes, self.selective_transient_bytes
        return self.time_s, self.saved_bytes, self.transient_bytes

    def memory(self, keep: int, remat: bool | str, one_program: bool = False) -> MemoryBreakdown:
        """The stage's memory per device with ``keep`` micro-batches in flight:
        resident state, plus what each micro-batch in flight keeps (its
        saved values; with full remat its inputs; with selective remat its
        saved values but the attention region's), plus one layer's working
        set (its temporaries, or with remat its whole forward again), plus
        the parameter gradients (:meth:`held_grads`).
        ``remat``: a bool (True: full) or a :data:`meshplan.recompute.RECOMPUTE` name."""
        _, kept, working = self.way(recompute_name(remat))
        held = self.held_grads(one_program)
        total = self.resident_bytes + held + self.passes_bytes(keep * kept + working, one_program)
        return MemoryBreakdown.of(total, params=self.resident_bytes - self.optimizer_bytes,
                                  optimizer=self.optimizer_bytes,
                                  grads=held or min(self.grad_bytes, working),
                                  activations=keep * kept)

    def reducing_each(self) -> "GroupCost":
        """These layers in a stage that reduces its gradients every
        micro-batch: their running sums in the gradients' planned layouts."""
        return GroupCost(**{**vars(self), "grad_bytes": self.reduced_grad_bytes})

    def passes_bytes(self, passes: float, one_program: bool) -> float:
        """What the step holds beyond its state and gradients: ``passes``,
        the micro-batches' kept values and working set, then the update's
        new values of arguments the caller keeps (a program of its own, after
        them; in one program its outputs, beside them all along)."""
        if one_program:
            return passes + self.kept_new_bytes
        return max(passes, self.kept_new_bytes)

    def as_full(self) -> "GroupCost":
        """These layers recomputing fully, as the figures of no recomputation
        (what :meth:`way` and :meth:`work` read for ``none``): a stage whose
        first groups recompute and the rest not is the ``none`` way of
        ``of_groups`` over these and the rest."""
        # (a splat of the fields: half what dataclasses.replace takes, and
        # the mixed recomputation choices make one per group of every stage)
        return GroupCost(**{**vars(self), "time_s": self.remat_time_s,
                            "saved_bytes": self.boundary_bytes,
                            "transient_bytes": self.activation_bytes,
                            "compute_s": self.remat_compute_s, "backward": self.remat_backward})

    def casting_each(self, num_micro_batches: int) -> "GroupCost":
        """These layers keeping no narrowed copy of their parameters, where
        the copy cost one cast a step (``time_s`` holds its share per
        micro-batch) and its bytes all step: every micro-batch's forward
        casts them, and its backward reads what that cast made (kept per
        micro-batch in flight) or, recomputing, casts them again."""
        once = self.cast_s / num_micro_batches
        more, again = self.cast_s - once, 2 * self.cast_s - once
        return GroupCost(**{**vars(self), "time_s": self.time_s + more,
                            "remat_time_s": self.remat_time_s + again,
                            "selective_time_s": self.selective_time_s + again,
                            "compute_s": self.compute_s + more,
                            "remat_compute_s": self.remat_compute_s + again,
                            "selective_compute_s": self.selective_compute_s + again,
                            "saved_bytes": self.saved_bytes + self.copy_bytes,
                            "resident_bytes": self.resident_bytes - self.copy_bytes,
                            "cast_s": 0.0, "copy_bytes": 0.0})

    def held_grads(self, one_program: bool) -> float:
        """The gradient bytes held beside the working set.  A pipeline's
        stage holds them all step: the running sums over the micro-batches,
        or with one micro-batch what its backward program hands the update
        program.  In one program (one stage, one micro-batch) XLA may update
        a parameter as soon as its gradient is made: counted only inside
        one layer's working set."""
        return 0.0 if one_program else self.grad_bytes


class Way(NamedTuple):
    """One recomputation choice of a stage, as :meth:`StageCosts._priced` prices it."""
    recompute: str          # none, selective or full
    layers: int             # full: only the stage's first this many layers (0: all)
    cost: GroupCost         # whose ``as_way`` figures these are
    as_way: str
    latency_s: float
    kept: float             # per micro-batch in flight
    working: float
    keep_casts: bool = True  # False: no narrowed parameter copies (GroupCost.casting_each)


@dataclass(frozen=True)
class StageOption:
    """The chosen way to run one stage (layers i..j, submesh m, s stages from it to the end)."""
    latency_s: float
    remat: bool
    memory_bytes: float
    mesh: int               # index into the submesh's logical meshes
    send_s: float           # per micro-batch, to the next stage and back
    memory: MemoryBreakdown | None = None    # memory_bytes by what it holds
    recompute: str = ""     # none, selective or full ("": as remat says)
    tighten: float = 1      # its layers' ILPs had 1 / tighten of the budget (TIGHTEN)
    recompute_layers: int = 0   # full: only the stage's first this many layers (0: all)
    keep_casts: bool = True     # False: its parameters cast per micro-batch, no copies kept
    # per micro-batch, the collectives among latency_s less the gradient
    # reductions made once a step (cost_model.pipeline.shared_compute_iteration_s)
    collectives_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.recompute:
            object.__setattr__(self, "recompute", recompute_name(self.remat))


@dataclass(frozen=True)
class UnfitStage:
    """A stage that fits no way: the least memory it needs, and what that holds."""
    memory: MemoryBreakdown
    in_flight: int           # micro-batches whose activations it keeps
    remat: bool
    layers: tuple[int, int]
    devices: int
    stages_after: int        # stages from it to the last (it included)


@dataclass(frozen=True)
class PipelineChoice:
    """The fastest pipeline for one micro-batch count."""
    total_s: float
    schedule: str
    dp: DPResult                                        # stages in layer indices
    options: dict[tuple[int, int, int, int], StageOption]
    chunks: int = 1     # virtual stages per device group (interleaved: .interleave)
    host_s: float = 0.0  # the host's time for the step's programs (cost_model.pipeline)

    def chosen(self) -> list[StageOption]:
        """The option of each stage of ``dp``, first to last (``options``
        holds every one the DP priced)."""
        n = len(self.dp.stages)
        return [self.options[st.first, st.last, st.submesh, n - k]
                for k, st in enumerate(self.dp.stages)]


# Alone, the fastest plan of a layer may keep its weights replicated (or
# their 16-bit copies gathered), which a stage of many layers cannot afford
# or affords only by recomputing.  As Alpa solves its layer ILPs at several
# memory budgets, a stage also tries its layers' plans with their state
# capped (solver.TIGHTEN): the fastest way that fits wins.  It tries
# MAX_CAPS caps, steps of the ladder, and while nothing fits MAX_CAPS more a
# halving apart, as far as three halvings reached (each cap solves the
# stage's distinct layers again).
MAX_CAPS = 3


class StageCosts:
    """Stage costs of one micro-batch count, from layer costs asked of ``solver`` once each."""

    def __init__(self, lay: LayerProblems, opts: PipelineOptions, solver: LayerSolver,
                 relaxed: bool = False) -> None:
        self.lay, self.opts, self.solver = lay, opts, solver
        # relaxed: every stage whose state split evenly fits takes its
        # fastest way on its layers' uncapped plans (no memory check, no
        # caps) -- a bound on the count's best (best_pipeline)
        self.relaxed = relaxed
        self._layer: dict[tuple[int, int, int, int], LayerCost | None] = {}
        self._per_shard: dict[int, bool] = {}      # data shards -> _traces_per_shard
        self._undeferred: dict[tuple, tuple[float, float]] = {}     # (undeferred's)
        self._groups: dict[tuple[int, int, int], list[GroupCost | None]] = {}
        # (gi, gj, m, k, tighten) -> _priced's answer; -> _levels' largest layer state
        self._prices: dict[tuple[int, int, int, int, int], tuple | None] = {}
        self._largest: dict[tuple[int, int, int, int, int], float | None] = {}
        # the least memory of a stage that fits no way (what the error reports)
        self.least_unfit: float | None = None
        self.least_unfit_stage: UnfitStage | None = None
        # why the DP's stages could not run interleaved (the error when only it was asked)
        self.not_interleaved: str | None = None
        self.not_zero_bubble: str | None = None     # (the same for ZB-H1)
        # (.zero_bubble.kept_parts, and each layer's kept bytes after fusion)
        self._zb_kept: tuple[tuple[list[float], list[float]], list[float]] | None = None
        # Where two layers of a stage disagree on the layout of a value one
        # hands the other, the stage program reshards it every micro-batch
        # (the runtime constrains each layer to its plan): charged under any
        # method.  A hand-made method fixes those layouts (rows over the data
        # axis, sequence parallelism's cuts); under a searched one each
        # layer's ILP picks them alone, so a layer is solved again to agree
        # with the later layers of its stage (:meth:`member`), as a joint
        # solve of the stage would.
        self.flows = layer_flows(lay.subs)
        self._pinning = solver.options.input_filter is None
        self._flows_of: dict[int, list[Flow]] = {}
        for f in self.flows:
            for l in (f.maker, f.reader):
                self._flows_of.setdefault(l, []).append(f)
        self._members: dict[tuple[int, int, int, int, float], LayerCost | None] = {}
        # (j, m, k, tighten) -> the first layer whose pinned plans _prefetch_members asked
        self._prefetched: dict[tuple[int, int, int, float], int] = {}
        self._flow_cost: dict[tuple, tuple[float, float]] = {}
        self._mesh_models: dict[tuple[int, int], MeshModel] = {}
        self.state_prefix, self.optimizer_prefix = [0.0], [0.0]
        for b, o in zip(lay.state_bytes, lay.optimizer_bytes):
            self.state_prefix.append(self.state_prefix[-1] + b)
            self.optimizer_prefix.append(self.optimizer_prefix[-1] + o)

    def layer(self, l: int, m: int, k: int, tighten: float = 1) -> LayerCost | None:
        if (l, m, k, tighten) not in self._layer:
            self._layer[l, m, k, tighten] = self.solver.layer_cost(*self.lay.request(l, m, k),
                                                                   tighten=tighten)
        return self._layer[l, m, k, tighten]

    def member(self, l: int, j: int, m: int, k: int, tighten: float = 1) -> LayerCost | None:
        """Layer ``l``'s plan as a layer of a stage ending with layer ``j`` on
        mesh ``k`` of submesh ``m``.  Under a searched method, where it
        disagrees with the later layers of the stage on the layout of a value
        they hand each other, its ILP is solved again with those layouts
        pinned to theirs (what it reads as they leave it, what it makes
        charged the resharding to how they read it): from right to left, so
        the last layer keeps its own plan and the ends of a model
        (embeddings) adapt to its blocks, which agree with each other.  The
        plan so solved is taken where it and the resharding still left are
        faster than its own plan and the resharding that needs."""
        own = self.layer(l, m, k, tighten)
        if l >= j or own is None or not self._pinning or l not in self._flows_of:
            return own
        key = (l, j, m, k, tighten)
        if key not in self._members:
            partners, pins = self._pins(l, j, m, k, tighten, own)
            pinned = None
            if pins:
                pinned = self.solver.layer_cost(*self.lay.request(l, m, k), tighten=tighten,
                                                pins=pins)

            def with_joints(c: LayerCost) -> float:
                return c.time_s + sum(self._flow_s(f, c, them, l, m, k) for f, them in partners)
            self._members[key] = (pinned if pinned is not None
                                  and with_joints(pinned) < with_joints(own) else own)
        return self._members[key]

    def _pins(self, l: int, j: int, m: int, k: int, tighten: float, own: LayerCost
              ) -> tuple[list[tuple[Flow, LayerCost]], Pins]:
        """For :meth:`member`: the flows between layer ``l`` and the later
        layers of its stage (to ``j``) with their plans, and the boundary
        layouts of ``l`` where its own plan ``own`` disagrees with theirs."""
        ins: dict[int, tuple] = {}
        outs: dict[int, tuple] = {}
        partners = []
        for f in self._flows_of[l]:
            other = f.reader if f.maker == l else f.maker
            them = self.member(other, j, m, k, tighten) if l < other <= j else None
            if them is None:
                continue
            partners.append((f, them))
            if f.maker == l:
                want, have = them.result.input_specs[f.in_pos], own.result.output_specs[f.out_pos]
                if want is not None and want != have:
                    outs[f.out_pos] = want
            else:
                made, read = them.result.output_specs[f.out_pos], own.result.input_specs[f.in_pos]
                if made is not None and made != read:
                    ins[f.in_pos] = made
        return partners, Pins(tuple(sorted(ins.items())), tuple(sorted(outs.items())))

    def _prefetch_members(self, gi: int, gj: int, m: int, meshes: list[int],
                          tighten: float) -> None:
        """Solve the layers of groups ``gi..gj`` solved again to agree with
        their stage (:meth:`member`) on ``meshes`` of submesh ``m`` side by
        side, from the stage's end: a layer's pins need the plans of the
        layers after it, so each step solves one layer of every mesh's stage
        (:meth:`LayerSolver.prefetch`; one such problem alone is solved
        when :meth:`member` asks, as before)."""
        lay = self.lay
        if not self._pinning or self.solver.workers <= 1 or len(meshes) < 2:
            return
        i, j = lay.groups[gi][0], lay.groups[gj][1]
        # (a stage ending at j down to a later layer was done before: only the rest)
        done = {k: self._prefetched.get((j, m, k, tighten), j) for k in meshes}
        ks = [k for k in meshes if done[k] > i
              and all(r is not None for r in self.groups(m, k, tighten)[gi:gj + 1])]
        if len(ks) < 2:
            return
        for k in ks:
            self._prefetched[j, m, k, tighten] = i
        for l in range(max(done[k] for k in ks) - 1, i - 1, -1):
            if l not in self._flows_of:
                continue
            asks = []
            for k in ks:
                if l >= done[k]:
                    continue
                own = self.layer(l, m, k, tighten)
                if own is not None and (l, j, m, k, tighten) not in self._members:
                    pins = self._pins(l, j, m, k, tighten, own)[1]
                    if pins:
                        asks.append((lay.request(l, m, k), pins))
            if len(asks) > 1:
                self.solver.prefetch([r for r, _ in asks], tighten, [p for _, p in asks])

    def _flow_s(self, f: Flow, c: LayerCost, them: LayerCost, l: int, m: int, k: int) -> float:
        """Seconds per micro-batch of resharding flow ``f`` between layer
        ``l``'s plan ``c`` and the other end's plan ``them``."""
        maker, reader = (c, them) if f.maker == l else (them, c)
        return self._flow(f, maker, reader, m, k)[0]

    def _flow(self, f: Flow, maker: LayerCost, reader: LayerCost, m: int, k: int
              ) -> tuple[float, float]:
        """:func:`.joints.flow_cost`, memoised by what it reads of the two plans."""
        key = (f, m, k, maker.result.output_specs[f.out_pos], reader.result.input_specs[f.in_pos])
        if key not in self._flow_cost:
            self._flow_cost[key] = flow_cost(f, self.lay.g, maker, reader, self._mesh_model(m, k))
        return self._flow_cost[key]

    def joint(self, i: int, j: int, m: int, k: int, tighten: float = 1) -> tuple[float, float]:
        """Seconds and bytes per micro-batch of resharding what layers
        ``i..j`` hand each other as one stage on mesh ``k`` of submesh ``m``
        (:mod:`.joints`)."""
        def cost(f: Flow) -> tuple[float, float]:
            maker, reader = (self.member(l, j, m, k, tighten) for l in (f.maker, f.reader))
            if maker is None or reader is None:
                return 0.0, 0.0
            return self._flow(f, maker, reader, m, k)
        return joint_cost(self.flows, i, j, cost)

    def undeferred(self, i: int, j: int, m: int, k: int, tighten: float = 1,
                   every: bool = False) -> tuple[float, float]:
        """Seconds and bytes per micro-batch that layers ``i..j`` as one stage
        on mesh ``k`` of submesh ``m`` add where the stage's backward cannot
        run on each data shard's rows over the axes its gradient sums wait on
        (``LayerCost.rows_cut`` of every layer, the cotangents it hands back
        of the first), or anywhere (``every``: ZB-H1, whose weight-gradient
        programs the runtime does not replay per shard): the runtime then
        reduces the stage's gradients every micro-batch
        (runtime.pipeline_partial), so each waiting reduction, priced at a
        1/B share, is paid whole each time."""
        if self.lay.B == 1:
            return 0.0, 0.0
        key = (i, j, m, k, tighten, every)
        if key not in self._undeferred:
            self._undeferred[key] = self._undeferred_of(i, j, m, k, tighten, every)
        return self._undeferred[key]

    def deferred_axes(self, i: int, j: int, m: int, k: int, tighten: float = 1,
                      every: bool = False) -> tuple[int, ...]:
        """The mesh axes over which the gradient sums of layers ``i..j`` as
        one stage wait for the step's last micro-batch (``Stage.deferred_axes``):
        its layers' waiting axes where the runtime can keep partial sums over
        them (:meth:`undeferred` adds nothing), else none (each micro-batch's
        gradients are reduced)."""
        if self.lay.B == 1:
            return ()
        _, waiting, axes = self._waiting(i, j, m, k, tighten)
        return axes if waiting and self.undeferred(i, j, m, k, tighten, every) == (0.0, 0.0) \
            else ()

    def _waiting(self, i: int, j: int, m: int, k: int, tighten: float
                 ) -> tuple[list[LayerCost | None], list[LayerCost], tuple[int, ...]]:
        """(the members' costs, those whose gradient sums wait, the axes they wait over)."""
        parts = [self.member(l, j, m, k, tighten) for l in range(i, j + 1)]
        if any(p is None for p in parts):
            return parts, [], ()
        waiting = [p for p in parts if p.deferred_s or p.deferred_bytes]
        return parts, waiting, tuple(sorted(set().union(*(p.result.waiting_axes
                                                          for p in waiting))))

    def _undeferred_of(self, i: int, j: int, m: int, k: int, tighten: float,
                       every: bool) -> tuple[float, float]:
        parts, waiting, axes = self._waiting(i, j, m, k, tighten)
        if not waiting:
            return 0.0, 0.0

        def runs_per_shard(p: LayerCost, first: bool) -> bool:
            reads, sent = next(((r, s) for a, r, s in p.rows_cut if a == axes), (True, True))
            return reads and (sent or not first)
        shards = math.prod(self.lay.meshes_of[m][k].shape[a] for a in axes)
        if not every and self._traces_per_shard(shards) and all(
                runs_per_shard(p, n == 0) for n, p in enumerate(parts)):
            return 0.0, 0.0
        more = self.lay.B - 1
        return (more * sum(p.deferred_s for p in waiting),
                more * sum(p.deferred_bytes for p in waiting))

    def _traces_per_shard(self, shards: int) -> bool:
        """Whether the runtime can trace the step at a data shard's rows of a
        micro-batch (runtime.pipeline_partial): where the shards divide the
        rows (a micro-batch of one sequence cannot be cut over the devices
        that cut its tokens), and not at one example where meshplan found
        the step's gradients itself (trace.micro.ONE_EXAMPLE: JAX leaves out
        the broadcasts it tells them by)."""
        if shards not in self._per_shard:
            g = self.lay.g
            rows = min(g.batch_rows, default=0)
            inferred = any(n.primitive == GRAD_BOUNDARY and n.scope == INFERRED_GRADIENTS
                           for n in g.nodes)
            self._per_shard[shards] = rows >= shards and rows % shards == 0 \
                and not (inferred and rows // shards < 2)
        return self._per_shard[shards]

    def _stage_rows(self, gi: int, gj: int, m: int, k: int, tighten: float
                    ) -> list[GroupCost | None]:
        """The costs of groups ``gi..gj`` as one stage: :meth:`groups`' rows,
        those with a layer planned again to agree with its stage
        (:meth:`member`) summed anew."""
        lay = self.lay
        rows = self.groups(m, k, tighten)[gi:gj + 1]
        if not self._pinning or any(r is None for r in rows):
            return rows
        j = lay.groups[gj][1]
        out = []
        for (a, b), row in zip(lay.groups[gi:gj + 1], rows):
            parts = [self.member(l, j, m, k, tighten) for l in range(a, b + 1)]
            same = all(p is self.layer(l, m, k, tighten) for l, p in zip(range(a, b + 1), parts))
            out.append(row if same else GroupCost.of_layers(parts))
        return out

    def _mesh_model(self, m: int, k: int) -> MeshModel:
        if (m, k) not in self._mesh_models:
            sub = self.lay.submeshes[m]
            self._mesh_models[m, k] = mesh_model(self.solver.cluster, self.lay.meshes_of[m][k],
                                                 submesh=(sub.hosts, sub.devices_per_host))
        return self._mesh_models[m, k]

    def send_s(self, j: int, m: int, k: int, tighten: float = 1) -> float:
        """Seconds a stage ending with layer ``j`` (on mesh ``k`` of submesh ``m``)
        spends per micro-batch sending its activations on."""
        lay = self.lay
        if j == lay.layering.num_layers - 1:
            return 0.0
        sub = lay.submeshes[m]
        r = self.layer(j, m, k, tighten).send_replication
        # a replica group wider than a host gathers over the slow links too
        fast = (lay.fast_bw, lay.fast_lat) if r <= sub.devices_per_host else \
            (lay.p2p_bw, lay.p2p_lat)
        return stage_send_s(lay.layering.cut_bytes[j], r, sub.size, lay.p2p_bw, lay.p2p_lat,
                            *fast)

    def groups(self, m: int, k: int, tighten: float = 1) -> list[GroupCost | None]:
        """Per group of layers on mesh ``k`` of submesh ``m``: its cost, or None
        where a layer has no plan (or its state alone cannot fit); ``tighten``
        as for :meth:`LayerSolver.layer_cost`."""
        if (m, k, tighten) not in self._groups:
            lay, rows = self.lay, []
            if tighten > 1:     # (the loosest plans were solved side by side already)
                self._prefetch(m, [k], tighten)
            for a, b in lay.groups:
                if any(lay.state_bytes[l] / lay.submeshes[m].size > lay.budget
                       for l in range(a, b + 1)):
                    rows.append(None)
                    continue
                parts = [self.layer(l, m, k, tighten) for l in range(a, b + 1)]
                rows.append(None if any(p is None for p in parts) else GroupCost.of_layers(parts))
            self._groups[m, k, tighten] = rows
        return self._groups[m, k, tighten]

    def _prefetch(self, m: int, meshes: list[int], tighten: float) -> None:
        """Solve the layers' ILPs on ``meshes`` of submesh ``m`` under cap
        ``tighten`` side by side (:meth:`LayerSolver.prefetch`)."""
        lay = self.lay
        self.solver.prefetch(
            [lay.request(l, m, k) for k in meshes for a, b in lay.groups
             if not any(lay.state_bytes[l] / lay.submeshes[m].size > lay.budget
                        for l in range(a, b + 1))
             for l in range(a, b + 1)], tighten)

    def _placeable(self, gi: int, gj: int, s: int) -> bool:
        """Can groups ``gi..gj`` be a stage with ``s`` stages from it to the
        last in a plan of a fixed number of stages?  (The DP also asks about
        stages no such plan has: they are not what the error reports.)"""
        if self.opts.fixed is None:
            return True
        pp, last = self.opts.fixed[2], len(self.lay.groups) - 1
        return ((gi == 0) == (s == pp) and (gj == last) == (s == 1)
                and gi >= pp - s and last - gj >= s - 1)

    def _stage_count(self) -> int | None:
        """The plan's number of stages where the request fixes it."""
        if self.opts.fixed is not None:
            return self.opts.fixed[2]
        lay = self.lay
        return lay.max_stages if lay.max_stages and lay.max_stages == lay.min_stages else None

    def zb_extra(self, first: int, last: int, s: int, p: int) -> float:
        """[zb-h1] what a stage of layers ``first..last`` with ``s`` stages
        from it to the last (of ``p``) keeps at most, in whole micro-batches of
        its kept activations, beyond 1F1B's count: its order walked with what
        each micro-batch keeps until its B and then until its W."""
        lay = self.lay
        if p == s:      # (the first stage sends no gradient back: 1F1B's one backward)
            return 0.0
        if self._zb_kept is None:
            self._zb_kept = (kept_parts(lay.g, lay.layering),
                             [sum(lay.g.tensors[t].nbytes for t in ts) for ts in lay.saved])
        fw, bw = w_shares(*self._zb_kept, first, last)
        kinds = [k for k, _ in schedule_order(ZB_H1, p - s, p, lay.B)]
        return max(0.0, peak_kept(kinds, 1.0, bw, fw + bw) - min(lay.B, s))

    def best(self, gi: int, gj: int, m: int, s: int, schedule: str,
             keep: int | None = None, extra: float = 0.0) -> StageOption | None:
        """The fastest fitting way to run groups ``gi..gj`` as a stage on submesh
        ``m`` with ``s`` stages from it to the last, or None.  ``keep``: the
        micro-batches it keeps in flight where the schedule's order says
        (an interleaved plan's virtual stage, :mod:`.interleave`; its layers
        need not follow ``equal_layers``), else from ``schedule`` and ``s``;
        ``extra``: more kept activations, in micro-batches, where the stage
        does not recompute (:meth:`zb_extra`)."""
        lay, opts = self.lay, self.opts
        i, j = lay.groups[gi][0], lay.groups[gj][1]
        extra = float(extra)
        # (a virtual stage's or ZB-H1's backward programs: all or nothing)
        partial_ok = keep is None and schedule != ZB_H1
        if keep is None and opts.equal_layers \
                and gj - gi + 1 != len(lay.groups) // opts.num_stages:
            return None
        if keep is None:
            keep = in_flight(schedule, lay.B, s)
            if schedule == ZB_H1 and self._stage_count() is not None:
                # ZB-H1 keeps p micro-batches, the later ones past their B
                # (.zero_bubble): where the count is fixed, the DP sees it too
                extra = self.zb_extra(i, j, s, self._stage_count())
        n = lay.submeshes[m].size
        whole = lay.B == 1 and i == 0 and j == lay.layering.num_layers - 1   # one program
        state = (self.state_prefix[j + 1] - self.state_prefix[i]) / n
        if state > lay.budget:
            # its state alone, split evenly over the devices, cannot fit
            opt = (self.optimizer_prefix[j + 1] - self.optimizer_prefix[i]) / n
            self._unfit(state, MemoryBreakdown.of(state, params=state - opt, optimizer=opt,
                                                  grads=0, activations=0),
                        keep, False, (i, j), n, gi, gj, s)
            return None
        best, least = None, None
        least_way = None
        # the layers' fastest plans first, then with their state capped where
        # the activations leave room for the stage's state split evenly:
        # capped plans are slower per layer but may keep what the fastest
        # recompute, and hold smaller gradient sums (Korthikanti's 175B:
        # 12.72 s, against 14.29 s with caps only where nothing else fits
        # and 12.91 s with caps only where the fastest recompute or cast again)
        room = [None]       # the budget less the least activations of the loosest plans
        grads_floor = 0.0 if whole else \
            state - (self.optimizer_prefix[j + 1] - self.optimizer_prefix[i]) / n
        for tighten, k in self._levels(gi, gj, m, room, lambda: best is not None):
            priced = self._priced(gi, gj, m, k, tighten)
            if priced is None:
                continue
            send, c, ways = priced
            # (ZB-H1's gradients are reduced every micro-batch wherever they
            # could wait: what _priced charged only where the rows forbid it)
            every = self.undeferred(i, j, m, k, tighten, every=schedule == ZB_H1)
            lost = (every[0] - self.undeferred(i, j, m, k, tighten)[0]) \
                if schedule == ZB_H1 else 0.0
            # (a stage reducing every micro-batch keeps its sums as the
            # gradients are laid out, not whole over the data axes)
            each = every[1] > 0
            held = (c.reducing_each() if each else c).held_grads(whole)
            for w in ways:
                if w.layers and (whole or not partial_ok):
                    continue
                if each:
                    w = w._replace(cost=w.cost.reducing_each())
                # (a recomputing stage's backward stays one program: 1F1B's count)
                n_kept = keep + extra if extra and w.recompute == NONE else keep
                mem = (w.cost.resident_bytes + held
                       + w.cost.passes_bytes(n_kept * w.kept + w.working, whole))
                # (capped plans hold smaller gradient sums too: at least the
                # parameters split evenly, where they follow their layout)
                left = lay.budget - min(held, grads_floor) - n_kept * w.kept - w.working
                if tighten == 1 and (room[0] is None or left > room[0]):
                    room[0] = left
                if (mem <= lay.budget or self.relaxed) \
                        and (best is None or w.latency_s + lost < best.latency_s):
                    best = StageOption(w.latency_s + lost, w.recompute != NONE, mem, k, send,
                                       w.cost.memory(n_kept, w.as_way, whole), w.recompute,
                                       tighten, w.layers, w.keep_casts,
                                       w.cost.work(w.as_way, send, lay.B).per_micro_batch_comm_s)
                if least is None or mem < least:
                    least, least_way = mem, (w.cost, w.as_way, n_kept)
        if best is None and least is not None:
            c, way, n_kept = least_way
            self._unfit(least, c.memory(n_kept, way, whole), keep, way != NONE, (i, j), n, gi, gj, s)
        return best

    def _priced(self, gi: int, gj: int, m: int, k: int, tighten: float
                ) -> tuple[float, GroupCost, list[Way]] | None:
        """Groups ``gi..gj`` as one stage on mesh ``k`` of submesh ``m``: its
        send time, its cost and its recomputation choices; None where a
        group has no plan.
        (None of it depends on the stages after it or the schedule, which
        the DP varies: priced once.)"""
        key = (gi, gj, m, k, tighten)
        if key in self._prices:
            return self._prices[key]
        lay = self.lay
        rows = self._stage_rows(gi, gj, m, k, tighten)
        if any(r is None for r in rows):
            self._prices[key] = None
            return None
        send = self.send_s(lay.groups[gj][1], m, k, tighten)
        c = GroupCost.of_groups(rows)
        i, j = lay.groups[gi][0], lay.groups[gj][1]
        joint_s = self.joint(i, j, m, k, tighten)[0]
        # a stage launches a forward and a backward program per micro-batch
        fixed = send + joint_s + self.undeferred(i, j, m, k, tighten)[0] + \
            lay.programs[0] * lay.dispatch(m) + accumulation_s(
            c.grad_bytes, lay.B, lay.memory_bw, lay.accumulate_passes)
        # each micro-batch in flight keeps what its backward reads; the one
        # being processed also needs its layer's temporaries.  With remat
        # a stage keeps only its inputs and recomputes a layer's forward
        # just before its backward.
        # (the whole model as one stage with one micro-batch runs as one
        # program, which recomputes as the stage DP prices it too:
        # meshplan.runtime.remat)
        ways = []
        for way in _ways(self.opts.remat):
            t, kept, working = c.way(way)
            # (less what runs under compute: cost_model.overlap)
            ways.append(Way(way, 0, c, way, t + fixed - self._hidden(c, way, send), kept, working))
        if self.opts.remat is None:
            # Mist's choice: the first g of the stage's groups recompute, the rest not
            # (each split joins the first g rows recomputing and the rest as they are)
            size = len(rows)
            firsts, rests = [None] * size, [None] * size
            for g in range(1, size):
                full = rows[g - 1].as_full()
                firsts[g] = full if g == 1 else GroupCost.of_groups([firsts[g - 1], full])
                h = size - g
                rests[h] = (rows[h] if h == size - 1
                            else GroupCost.of_groups([rows[h], rests[h + 1]]))
            for g in range(1, size):
                mixed = GroupCost.of_groups([firsts[g], rests[g]])
                t, kept, working = mixed.way(NONE)
                n = lay.groups[gi + g - 1][1] - lay.groups[gi][0] + 1
                ways.append(Way(FULL, n, mixed, NONE,
                                t + fixed - self._hidden(mixed, NONE, send), kept, working))
        if c.copy_bytes and lay.B > 1:
            # each recomputing way again without the copies: slower, less
            # memory (where it binds); one recomputing nothing would keep a
            # copy per micro-batch in flight instead
            for w in [w for w in ways if w.recompute != NONE]:
                each = w.cost.casting_each(lay.B)
                t, kept, working = each.way(w.as_way)
                ways.append(w._replace(cost=each, keep_casts=False, latency_s=(
                    t + fixed - self._hidden(each, w.as_way, send))))
        self._prices[key] = (send, c, ways)
        return self._prices[key]

    def _levels(self, gi: int, gj: int, m: int, room: list, fits: Callable[[], bool]):
        """(tighten, mesh) pairs to try for groups ``gi..gj`` on submesh ``m``,
        loosest first.  Caps are tried only when the stage's state split over
        its devices fits in ``room[0]`` (what the loosest plans' activations
        leave), from the first cap under that room: ``MAX_CAPS`` of them,
        then while ``fits()`` says no way fits yet ``MAX_CAPS`` more, each a
        halving (4 steps) below the last (one that leaves a mesh with no
        plan has the steps it jumped bisected); a cap no layer's state reaches is
        skipped (it would plan the same), and once a mesh has a layer with no
        plan under a cap (or none at all) tighter caps on it are not tried."""
        lay, alive = self.lay, list(range(len(self.lay.meshes_of[m])))
        i, j = lay.groups[gi][0], lay.groups[gj][1]
        state = (self.state_prefix[j + 1] - self.state_prefix[i]) / lay.submeshes[m].size
        prev: dict[int, float] = {}     # mesh -> its layers' largest state at the last level
        good: dict[int, int] = {}       # mesh -> the ladder step of its last level with plans
        tried, last = 0, 0              # caps solved; the ladder step of the last
        top = math.inf                  # the largest of prev over the live meshes
        for step, tighten in enumerate(TIGHTEN):
            cap = lay.budget / tighten
            if tighten > 1 and self.relaxed:
                return      # (a cap only removes plans)
            if tighten > 1 and cap >= top:
                continue    # (no mesh's layers reach this cap: nothing to ask, nothing changes)
            if tighten > 1:
                if room[0] is None or state > room[0]:
                    return          # even split evenly, the state leaves no room
                if cap > room[0]:
                    continue
                if tried >= MAX_CAPS:
                    if tried == 2 * MAX_CAPS or fits():
                        return
                    if step < last + 4:
                        continue
            asked = [k for k in alive if tighten == 1 or prev.get(k, 0.0) > cap]
            if tighten > 1 and len(asked) > 1:
                # (every mesh's layers at this cap side by side, not one mesh at a time)
                self._prefetch(m, [k for k in asked if (m, k, tighten) not in self._groups],
                               tighten)
            self._prefetch_members(gi, gj, m, asked, tighten)
            for k in asked:
                yield tighten, k
                largest = self._largest_state(gi, gj, m, k, tighten)
                if largest is None:
                    if tried >= MAX_CAPS and k in good and not fits():
                        # a halving that overshot: the fine steps it jumped, bisected
                        yield from self._bisect(gi, gj, m, k, good[k], step, prev[k])
                    alive.remove(k)
                else:
                    prev[k], good[k] = largest, step
            if asked and tighten > 1:
                tried, last = tried + 1, step
            if not alive:
                return
            top = max(prev[k] for k in alive)

    def _bisect(self, gi: int, gj: int, m: int, k: int, lo: int, hi: int, largest: float):
        """(tighten, mesh ``k``) pairs between ladder steps ``lo`` (its layers
        have plans; ``largest``: their largest state there) and ``hi`` (some
        layer has none), bisected: the tightest cap with plans is found in
        about log2(hi - lo) solves.  A cap above ``largest`` plans as ``lo``
        does and is passed over."""
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if largest <= self.lay.budget / TIGHTEN[mid]:
                lo = mid
                continue
            yield TIGHTEN[mid], k
            got = self._largest_state(gi, gj, m, k, TIGHTEN[mid])
            if got is None:
                hi = mid
            else:
                lo, largest = mid, got

    def _largest_state(self, gi: int, gj: int, m: int, k: int, tighten: float) -> float | None:
        """The largest resident state of a layer of groups ``gi..gj`` on mesh
        ``k`` of submesh ``m`` (None: some layer has no plan there)."""
        key = (gi, gj, m, k, tighten)
        if key not in self._largest:
            lay = self.lay
            rows = self.groups(m, k, tighten)[gi:gj + 1]
            j = lay.groups[gj][1]
            layers = [self.member(l, j, m, k, tighten) for a, b in lay.groups[gi:gj + 1]
                      for l in range(a, b + 1)] if all(r is not None for r in rows) else []
            self._largest[key] = (None if not layers or any(c is None for c in layers)
                                  else max(c.resident_bytes for c in layers))
        return self._largest[key]

    def _hidden(self, c: GroupCost, recompute: str, send: float) -> float:
        return hidden_s(c.work(recompute, send, self.lay.B),
                        self.solver.cluster.device.achieved.overlap_communication)

    def _unfit(self, need: float, memory: MemoryBreakdown, keep: int, remat: bool,
               layers: tuple[int, int], devices: int, gi: int, gj: int, s: int) -> None:
        """Record a stage that fits no way, if it is the closest to fitting yet."""
        if not self._placeable(gi, gj, s):
            return
        if self.least_unfit is None or need < self.least_unfit:
            self.least_unfit = need
            self.least_unfit_stage = UnfitStage(memory, keep, remat, layers, devices, s)


def _ways(remat: bool | str | None) -> tuple[str, ...]:
    """The recomputation choices a stage may take: ``remat`` None tries all
    three (the fastest that fits wins)."""
    if remat is None:
        return (NONE, SELECTIVE, FULL)
    return (recompute_name(remat),)


def best_pipeline(lay: LayerProblems, cluster: ClusterSpec, opts: PipelineOptions,
                  solver: LayerSolver, relaxed: bool = False
                  ) -> tuple[PipelineChoice, StageCosts]:
    """The fastest schedule's pipeline for ``lay``'s micro-batch count, and
    the stage costs it was priced with (``costs.lay``: the problems it cuts,
    ``lay`` or one of its :meth:`~LayerProblems.many_stage_views`).
    ``relaxed``: as if every device had memory to spare (each stage its
    fastest way on its layers' uncapped plans): what
    :func:`meshplan.dp_search.search.search_pipeline` bounds a count with."""
    costs = StageCosts(lay, opts, solver, relaxed)
    found = []
    priced_all = []
    for view in [lay] + lay.many_stage_views():
        priced = costs if view is lay else StageCosts(view, opts, solver, relaxed)
        priced_all.append(priced)
        dps: dict[str, tuple] = {}      # the stage DPs run on this view, by _dp_kind
        for schedule in opts.schedules:
            c = _pipeline_for(schedule, view, cluster, opts, solver, priced, dps)
            if c is not None:
                found.append((c.total_s, len(found), c, priced))
    if not found and opts.schedules == ("interleaved",):
        why = next((c.not_interleaved for c in priced_all if c.not_interleaved), None)
        if why is not None:
            raise InfeasiblePlanError(f"no interleaved pipeline with {lay.B} micro-batch(es): {why}")
    if not found and opts.schedules == (ZB_H1,):
        why = next((c.not_zero_bubble for c in priced_all if c.not_zero_bubble), None)
        if why is not None:
            raise InfeasiblePlanError(f"no ZB-H1 pipeline with {lay.B} micro-batch(es): {why}")
    if not found:
        exactly = f" of exactly {lay.min_stages} stages" if lay.min_stages > 1 else ""
        need, unfit = costs.least_unfit, costs.least_unfit_stage
        detail = (unfit_text(unfit, lay.budget, opts, cluster.device.memory_bytes)
                  if unfit is not None else
                  # (no stage got as far as a memory figure: a layer's ILP found
                  # no sharding within the budget, on every mesh tried)
                  f"some layer of every candidate stage has no sharding within the budget of "
                  f"{human_bytes(lay.budget)} per device ({opts.memory_fraction:g} x "
                  f"{human_bytes(cluster.device.memory_bytes)}) even on its own")
        raise StageMemoryError(f"no stage assignment{exactly} fits with {lay.B} "
                               f"micro-batch(es){': ' + detail if detail else ''}", detail, unfit,
                               budget_bytes=int(lay.budget),
                               needed_bytes=None if need is None else int(need))
    _fewer_stages(found, lay, cluster, opts, solver)
    return _first_fastest(found)


def _first_fastest(found: list[tuple]) -> tuple[PipelineChoice, StageCosts]:
    """The first of equals (the groups' DP, then the order schedules are
    named in): a schedule later in the list must be faster by more than
    rounding."""
    fastest = min(t for t, _, _, _ in found)
    _, _, choice, priced = next(f for f in found if f[0] <= fastest * (1 + 1e-9))
    return choice, priced


def _fewer_stages(found: list[tuple], lay: LayerProblems, cluster: ClusterSpec,
                  opts: PipelineOptions, solver: LayerSolver) -> None:
    """Where the host's time for its programs bounds the fastest pipeline
    of ``found`` (:func:`~meshplan.cost_model.pipeline.pipeline_host_s`),
    the stage DP, which does not see the bound, may have passed over a
    split into fewer stages (fewer programs) that is faster: the DP again
    with fewer stages allowed, until the fastest is not so bound; the
    pipelines found are added to ``found``."""
    a = cluster.device.achieved
    cap = None
    while (a.pipeline_program_s or a.pipeline_buffer_s) and opts.fixed is None:
        choice, priced = _first_fastest(found)
        n = len(choice.dp.stages)
        if not host_binds(choice.total_s, choice.host_s):
            return
        cap = min(cap or n, n // choice.chunks) - 1
        if cap < max(1, priced.lay.min_stages):
            return
        view, dps = replace(priced.lay, max_stages=cap), {}
        for schedule in opts.schedules:
            c = _pipeline_for(schedule, view, cluster, opts, solver, priced, dps)
            if c is not None:
                found.append((c.total_s, len(found), c, priced))


def _dp_kind(schedule: str, costs: "StageCosts") -> str:
    """The stage DP ``schedule`` prices its stages with.  Interleaved 1F1B
    and ZB-H1 start from 1F1B's cut (:mod:`.interleave`, :mod:`.zero_bubble`
    rework it after) and keep what it keeps, unless the stage count is fixed,
    where ZB-H1's DP sees its extra kept micro-batches."""
    if schedule == "interleaved" or (schedule == ZB_H1 and costs._stage_count() is None):
        return "1f1b"
    return schedule


def _pipeline_for(schedule: str, lay: LayerProblems, cluster: ClusterSpec,
                  opts: PipelineOptions, solver: LayerSolver, costs: StageCosts,
                  dps: dict[str, tuple]) -> PipelineChoice | None:
    """``schedule``'s pipeline on ``lay``, or None; ``dps``: the stage DPs
    already run on ``lay`` by :func:`_dp_kind` (filled in), so that the
    schedules sharing 1F1B's cut run its DP once."""
    kind = _dp_kind(schedule, costs)
    if kind not in dps:
        dps[kind] = _stage_dp(kind, lay, cluster, solver, costs)
    res, shared = dps[kind]
    chosen = dict(shared)      # (interleave and zero_bubble give their own)
    if res is None:
        return None
    if opts.fixed is not None and len(res.stages) != opts.fixed[2]:
        return None
    chunks = 1
    if schedule == "interleaved":
        # the DP's stages become device groups of virtual stages
        costs.not_interleaved = why_not_interleaved(len(res.stages), len(lay.groups), lay.B)
        got = interleave(res, lay, costs)
        if got is None:
            return None
        (res, chosen), chunks = got, CHUNKS
    elif schedule == ZB_H1 and (len(res.stages) > 1 or lay.B > 1):
        got = zero_bubble(res, lay, costs)
        if got is None:
            return None
        res, chosen = got
    else:
        res = replace(res, stages=tuple(replace(st, first=lay.groups[st.first][0],  # groups -> layers
                                                last=lay.groups[st.last][1]) for st in res.stages))
    n_st = len(res.stages)
    total = res.total_s
    if cluster.device.achieved.shared_host_compute:
        # (a stage program on several devices waits for cores while the
        # other stages hold them: Achieved.busy_program_s)
        busy = [cluster.device.achieved.busy_s(lay.submeshes[st.submesh].size) if n_st > 1
                else 0.0 for st in res.stages]
        total = shared_compute_iteration_s(
            [st.latency - lay.programs[0] * lay.dispatch(st.submesh) for st in res.stages],
            [lay.submeshes[st.submesh].size for st in res.stages], lay.B,
            cluster.num_devices,
            [lay.dispatch(st.submesh) + b for st, b in zip(res.stages, busy)],
            [chosen[st.first, st.last, st.submesh, n_st - k].collectives_s
             for k, st in enumerate(res.stages)], lay.programs[0])
        if schedule == ZB_H1:
            # a W program's launch is serial on the host too (.zero_bubble
            # put it in the stage's latency, which the formula shares out)
            w = [lay.dispatch(st.submesh)
                 if st.latency != chosen[st.first, st.last, st.submesh, n_st - k].latency_s
                 else 0.0 for k, st in enumerate(res.stages)]
            total += sum(lay.B * x * (1 - lay.submeshes[st.submesh].size / cluster.num_devices)
                         for x, st in zip(w, res.stages))
    if n_st == 1 and lay.B == 1:
        # one program, once per iteration
        total -= lay.dispatch(res.stages[0].submesh)
    else:
        # and each stage's update program, once per iteration
        total += lay.programs[1] * sum(lay.dispatch(st.submesh) for st in res.stages)
        # the driver hands every stage program over from one host thread
        # (an interleaved plan's stages here are its virtual stages).  The DP
        # does not see it: where it binds, best_pipeline runs the DP again
        # with fewer stages allowed (_fewer_stages)
        host = _host_s(lay, res, schedule, chunks, cluster)
        return PipelineChoice(max(total, host), schedule, res, dict(chosen), chunks, host)
    return PipelineChoice(total, schedule, res, dict(chosen), chunks)


def place_stages(submeshes: Sequence[Submesh], stages: Sequence[StageChoice],
                 cluster: ClusterSpec) -> list[tuple[int, ...]]:
    """Device ids per stage: whole hosts first, then pieces of hosts, first fit."""
    dph = cluster.devices_per_host
    free = {h: list(range(h * dph, (h + 1) * dph)) for h in range(cluster.num_hosts)}
    out: list[tuple[int, ...] | None] = [None] * len(stages)
    order = sorted(range(len(stages)), key=lambda k: -submeshes[stages[k].submesh].size)
    for k in order:
        sub = submeshes[stages[k].submesh]
        if sub.hosts > 1 or sub.devices_per_host == dph:
            hosts = [h for h in free if len(free[h]) == dph][:sub.hosts]
            ids = [d for h in hosts for d in free.pop(h)]
        else:
            h = next(h for h in free if len(free[h]) >= sub.devices_per_host)
            ids, free[h] = free[h][:sub.devices_per_host], free[h][sub.devices_per_host:]
            if not free[h]:
                free.pop(h)
        out[k] = tuple(ids)
    return [o for o in out if o is not None]


def _host_s(lay: LayerProblems, res: DPResult, schedule: str, chunks: int,
            cluster: ClusterSpec) -> float:
    """The host's time for a pipelined step's stage programs
    (:func:`~meshplan.cost_model.pipeline.pipeline_host_s`): each host's
    process hands over the programs of the stages on its devices (their
    arrays on its devices), and the busiest sets the bound (one host: all of
    them).  An interleaved plan's virtual stage ``k`` is on group ``k % p``."""
    a = cluster.device.achieved
    if not (a.pipeline_program_s or a.pipeline_buffer_s):
        return 0.0
    p = len(res.stages) // chunks
    placed = place_stages(lay.submeshes, res.stages[:p], cluster)
    # host -> per stage on it: (its devices there, buffers a micro-batch, a step)
    stages: dict[int, list[tuple[int, int, int]]] = {}
    for k, st in enumerate(res.stages):
        mb, step = lay.buffers(st.first, st.last, schedule) if a.pipeline_buffer_s else (0, 0)
        for h, local in Counter(d // cluster.devices_per_host for d in placed[k % p]).items():
            stages.setdefault(h, []).append((local, mb, step))
    return max(pipeline_host_s(len(on), lay.B, schedule, a.pipeline_program_s,
                               a.pipeline_buffer_s, step_buffers(on, lay.B), lay.programs)
               for on in stages.values())


def _stage_dp(schedule: str, lay: LayerProblems, cluster: ClusterSpec, solver: LayerSolver,
              costs: StageCosts
              ) -> tuple[DPResult | None, dict[tuple[int, int, int, int], StageOption]]:
    """Alpa's stage-submesh DP over ``lay``'s groups priced for ``schedule``:
    its result (None: no assignment fits) and the stage options it priced."""
    chosen: dict[tuple[int, int, int, int], StageOption] = {}

    def stage_cost(gi: int, gj: int, m: int, s: int) -> float | None:
        best = costs.best(gi, gj, m, s, schedule)
        if best is None:
            return None
        chosen[lay.groups[gi][0], lay.groups[gj][1], m, s] = best
        return best.latency_s

    t0, ilp0 = time.perf_counter(), solver.ilp_s
    res = stage_dp(len(lay.groups), lay.submeshes, cluster.num_devices, lay.B, stage_cost,
                   max_stages=lay.max_stages, min_stages=lay.min_stages,
                   balance=[sum(lay.layering.flops[g[0]:g[1] + 1]) for g in lay.groups]
                   if lay.exact_stages else None)
    solver.dp_s += time.perf_counter() - t0 - (solver.ilp_s - ilp0)
    return res, chosen


class StageMemoryError(InfeasiblePlanError):
    """No stage assignment fits; ``stage``: the stage closest to fitting
    (None: no stage had a plan at all), ``detail``: it in words."""

    def __init__(self, message: str, detail: str, stage: UnfitStage | None, **kw) -> None:
        super().__init__(message, **kw)
        self.detail, self.stage = detail, stage


def unfit_text(u: UnfitStage, budget: float, opts: PipelineOptions, device_bytes: float) -> str:
    """``u`` in words: what it needs per device, part by part, against the budget."""
    m = u.memory
    which = (f"stage {opts.fixed[2] - u.stages_after} (layers {u.layers[0]}..{u.layers[1]})"
             if opts.fixed is not None else
             f"a stage of layers {u.layers[0]}..{u.layers[1]} on {u.devices} device(s)")
    remat = ", recomputing" if u.remat else ""
    return (f"{which} needs at least {human_bytes(m.total)} per device (parameters "
            f"{human_bytes(m.params)}, gradients {human_bytes(m.grads)}, optimizer state "
            f"{human_bytes(m.optimizer)}, activations {human_bytes(m.activations)} for "
            f"{u.in_flight} micro-batch(es) in flight{remat}, temporaries "
            f"{human_bytes(m.temporaries)}) against a budget of {human_bytes(budget)} "
            f"({opts.memory_fraction:g} x {human_bytes(device_bytes)}): "
            f"{human_bytes(m.total - budget)} over")
