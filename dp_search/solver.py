"""Layer ILPs for the stage DP: every distinct layer problem is solved once
per session (cached by a structural hash and the mesh's link figures), in
worker processes when there are enough of them to pay for the workers."""
from __future__ import annotations

import dataclasses
import itertools
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from ..cluster import ClusterSpec
from ..cost_model.compute import compute_time
from ..cost_model.memory import program_temp_bytes
from ..cost_model.fusion import fused_bytes, moved_bytes
from ..cost_model.mesh import mesh_model
from ..cost_model.overlap import Backward
from ..layout_moves import num_shards, spec_from_names
from ..errors import InfeasiblePlanError
from ..graph import OPT_STATE, PARAM, STATE, Graph, ancestor_nodes, descendant_tensors
from ..ilp import (Built, IlpCaches, InputLayouts, IntraOpResult, Pins, build_intra_op,
                   solve_intra_op)
from ..ilp.accumulation import held_copies, update_nodes
from ..ilp.build import stored_liveness, with_resident_cap
from ..ilp.replicated import Unsplit, unsplit_flops
from ..ilp.strategies import node_dtype
from ..plan import LogicalMesh
from .layers import BOUNDARY, canonical_tensors
from .options import PipelineOptions
from .session import LAYER_CACHE_MAX, SearchStats, Session, usable_cpus


@dataclass(frozen=True)
class LayerCost:
    time_s: float
    compute_s: float
    comm_s: float
    comm_bytes: float
    resident_bytes: float      # parameters (and hoisted narrowed copies), optimizer, other state
    activation_bytes: float    # peak of live intermediates (incl. incoming boundary) per micro-batch
    boundary_bytes: float      # incoming activations per micro-batch (what remat keeps)
    saved_bytes: float         # forward values the backward reads: kept per micro-batch in flight
    # what full recomputation runs again, at the layouts chosen: the forward
    # operators making what the backward reads (compute among compute_s)
    replay_compute_s: float
    result: IntraOpResult
    # how many devices hold each byte of the activations the layer sends on
    # (bytes-weighted; 1 when they are split over the whole mesh)
    send_replication: float = 1.0
    # the solved layer's tensor ids in canonical order: a structurally equal
    # layer reuses this result with its own ids in the same positions
    tensors: tuple[int, ...] = ()
    grad_bytes: float = 0.0    # its parameters' gradients on one device (what is accumulated)
    optimizer_bytes: float = 0.0   # the optimizer state among resident_bytes
    # one micro-batch's backward and the gradient reductions it starts
    # (cost_model.overlap), the forward left out
    backward: Backward = Backward()
    # selective recomputation (meshplan.recompute): the seconds its forward
    # region takes again, and what the backward then reads from the forward
    selective_s: float = 0.0
    selective_saved_bytes: float | None = None    # None: as saved_bytes
    # the casts of its parameters to a narrower type made once a step ahead
    # of the micro-batches (meshplan.graph.hoisted_casts): one run's
    # seconds, and the copies' bytes among resident_bytes
    cast_s: float = 0.0
    copy_bytes: float = 0.0
    replay_comm_s: float = 0.0     # and their collectives among comm_s
    # the gradient reductions waiting for the step's last micro-batch: their
    # seconds and bytes per micro-batch (a 1/grad_accum share, among comm_s
    # and comm_bytes); and, per set of mesh axes, whether the layer lets its
    # stage's backward run on each data shard's rows over them, as the
    # runtime needs to keep partial sums (:func:`rows_cut_over`; else the
    # stage reduces every micro-batch)
    deferred_s: float = 0.0
    deferred_bytes: float = 0.0
    rows_cut: tuple[tuple[tuple[int, ...], bool, bool], ...] = ()
    # the largest arena of intermediates of its forward, backward and update
    # programs (cost_model.memory.program_temp_bytes); None: not known
    program_temp: float | None = None
    # the FLOPs it runs unsplit over each mesh axis (ilp.replicated)
    unsplit: Unsplit = Unsplit()
    # the bytes of the collectives full recomputation runs again (replay_comm_s)
    replay_comm_bytes: float = 0.0
    # the new values of the arguments the caller keeps (Graph.undonated),
    # held beside the old ones from the update to the step's end
    kept_new_bytes: float = 0.0
    # its gradients' running sums where its stage reduces them every
    # micro-batch (in the gradients' planned layouts, as the runtime keeps
    # them; grad_bytes holds them whole over the axes their reduction waits
    # on); None: grad_bytes
    reduced_grad_bytes: float | None = None

    @property
    def transient_bytes(self) -> float:
        """What one micro-batch's passes need beyond the saved activations:
        the backward program holds what it makes on top of every kept value
        (its arguments), however early it is done with them."""
        if self.program_temp is not None:
            return self.program_temp
        return max(self.activation_bytes - self.saved_bytes, 0.0)

    @property
    def selective_kept_bytes(self) -> float:
        sel = self.selective_saved_bytes
        return self.saved_bytes if sel is None else sel

    @property
    def selective_transient_bytes(self) -> float:
        """With selective recomputation: the layer's working set beyond what
        it keeps (the recomputed region is live again during its backward),
        no less than what its programs need without recomputation."""
        return max(self.activation_bytes - self.selective_kept_bytes, self.program_temp or 0.0)


def solve_job(job: tuple, caches: IlpCaches | None = None
              ) -> tuple[IntraOpResult | None, float, Built | None]:
    """One layer ILP (run in a worker process when solving in parallel): its
    result (None: it does not fit), the seconds it took and, for a problem
    without a cap that has a plan, the ILP as built (a capped solve of the
    same layer reuses it: ``base`` in the job).  ``caches``: the session's,
    when solved in its process."""
    (sub, cluster, mesh, submesh, backend, time_limit, budget, grads, grad_accum, filt,
     options, resident_cap, base, forward, pins, seed) = job
    t0 = time.perf_counter()
    keep = base is None and resident_cap is None
    # (the layer's plan holds its updates in place; the new values kept
    # beside the old are its stage's to count: LayerCost.kept_new_bytes)
    sub = sub.in_place()
    try:
        if base is None:
            # (a layer runs in a stage's forward and backward programs)
            base = dataclasses.replace(build_intra_op(
                sub, cluster, mesh, submesh=submesh, memory_budget=budget, accumulate=grads,
                grad_accum=grad_accum, input_filter=filt, caches=caches, pins=pins),
                split_programs=forward)
        r = solve_intra_op(sub, cluster, mesh, submesh=submesh, backend=backend,
                           time_limit=time_limit, memory_budget=budget,
                           accumulate=grads, grad_accum=grad_accum, input_filter=filt,
                           options=options, caches=caches, resident_budget=resident_cap,
                           built=base, pins=pins, seed=seed)
    except InfeasiblePlanError:
        r = None
    return r, time.perf_counter() - t0, base if keep and r is not None else None


def solve_jobs(jobs: list[tuple]) -> list[tuple]:
    """:func:`solve_job` on each of ``jobs`` in turn (in a worker process):
    they share one :class:`IlpCaches`, so jobs on one mesh shape find each
    resharding's moves once."""
    caches = IlpCaches()
    return [solve_job(job, caches) for job in jobs]


def batches(keys: list[tuple], mesh_of: dict, workers: int) -> list[list[tuple]]:
    """``keys`` in batches for :func:`solve_jobs`: those on one mesh shape
    together, at most a quarter of one worker's share in a batch (so the
    workers still take turns evenly)."""
    most = max(1, -(-len(keys) // (4 * workers)))
    by_shape: dict[tuple, list[tuple]] = {}
    for k in keys:
        by_shape.setdefault(mesh_of[k].shape, []).append(k)
    return [same[i:i + most] for same in by_shape.values() for i in range(0, len(same), most)]


# The shares of the budget (1 / each) a layer's parameters and optimizer
# state may take when its stage caps them (meshplan.dp_search.stages): steps
# of 2 ** (1/4), so that a stage of many layers finds the layouts that just
# fit it (halving, the gap between two caps could be the whole difference
# between a stage that keeps its weights' copies and one that recomputes).
TIGHTEN = tuple(2 ** (i / 4) for i in range(41))
# seconds an interrupted search waits for its worker pool to stop (LayerSolver.close)
ABORT_WAIT_S = 5.0


def _cap_key(tighten: float, pins: Pins | None = None) -> tuple:
    """What a layer's cache key adds for its cap (nothing uncapped) and its
    pinned boundary layouts (nothing without)."""
    return ((tighten,) if tighten != 1 else ()) + ((pins,) if pins else ())


def _ignore_sigint() -> None:
    """In an ILP worker: Ctrl-C is the parent's to handle (it ends the workers)."""
    import signal
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@dataclass
class LayerSolver:
    """The layer ILPs of one search, cached in its session."""
    cluster: ClusterSpec
    options: PipelineOptions
    session: Session
    solves: int = 0             # ILPs solved by this search
    hits: int = 0               # layer costs found in the session's cache
    used: set = field(default_factory=set)   # distinct layer problems this search needed
    trace_s: float = 0.0        # wall time re-tracing the step per micro-batch count
    ilp_s: float = 0.0          # wall time in layer ILPs (in-process or waiting on workers)
    ilp_work_s: float = 0.0     # seconds the layer ILPs took, wherever they ran
    dp_s: float = 0.0           # wall time in the stage DP, its ILPs excluded
    _pool: Any = None
    # (the CPUs this process may use, asked once: the stage DP reads
    # :attr:`workers` hundreds of thousands of times)
    _cpus: int = field(default_factory=usable_cpus)
    # uncapped layer key -> (the layer's graph, its ILP as built): the capped solves of that layer
    # add their cap row to it instead of building it again (this search's
    # current micro-batch count only: the keys hold it)
    _built: dict = field(default_factory=dict)

    @property
    def cache(self) -> dict:
        return self.session.layer_cache

    @property
    def workers(self) -> int:
        # (never more processes than cores, whatever the session says)
        return min(self.session.workers, self._cpus)

    def _key(self, sub: Graph, mesh: LogicalMesh, submesh: tuple[int, int],
             grad_accum: int, tighten: float = 1, pins: Pins | None = None) -> tuple:
        mm = mesh_model(self.cluster, mesh, submesh=submesh)
        if len(self.cache) > LAYER_CACHE_MAX:
            self.cache.clear()
        o = self.options
        links = tuple((l.bandwidth, l.latency, l.local, l.phases) for l in mm.links)
        return (sub.fingerprint, mesh.shape, links, mm.intra, mm.inter,
                grad_accum, o.input_filter, repr(self.cluster.device), o.backend, o.time_limit,
                o.memory_fraction) + _cap_key(tighten, pins)

    def _job(self, sub: Graph, mesh: LogicalMesh, submesh: tuple[int, int],
             grads: frozenset[int], grad_accum: int, tighten: float = 1,
             forward_values: frozenset[int] = frozenset(), pins: Pins | None = None) -> tuple:
        """The arguments of :func:`solve_job` (only what a worker needs);
        ``tighten`` > 1: its parameters and optimizer state may use at most
        1 / tighten of the budget; ``forward_values``: the layer's forward
        values that its backward or other layers read (what marks its
        forward nodes, :func:`forward_of`)."""
        o = self.options
        uncapped = self._key(sub, mesh, submesh, grad_accum, pins=pins)
        # (a structurally equal layer's build has other tensor ids: not this one's)
        hit = self._built.get(uncapped)
        base = hit[1] if tighten > 1 and hit is not None and hit[0] is sub else None
        # (a gradient, or a contribution to one the layer sends on)
        used = frozenset(t for n in sub.nodes for t in n.inputs + n.outputs) & grads
        # (a capped MIP starts from the layer's uncapped plan made to fit: never
        # a looser cap's, which would make the answer depend on what this
        # session happened to solve before)
        loose = self.cache.get(uncapped) if tighten > 1 else None
        seed = loose.result.solution.choice if loose is not None else None
        filt = o.input_filter
        if isinstance(filt, str):       # "model", or "model+sequence" (sequence parallel)
            mode, _, seq = filt.partition("+")
            filt = InputLayouts(mode, sequence=seq == "sequence")
        return (sub, self.cluster, mesh, submesh, o.backend, o.time_limit,
                self.cluster.device.memory_bytes * o.memory_fraction, used, grad_accum, filt,
                self.session.solver,
                self.cluster.device.memory_bytes * o.memory_fraction / tighten
                if tighten > 1 else None, base, forward_of(sub, forward_values, used), pins, seed)

    def _looser_unfit(self, sub: Graph, mesh: LogicalMesh, submesh: tuple[int, int],
                      grad_accum: int, tighten: float, pins: Pins | None = None) -> bool:
        """Has the layer no plan under a looser cap (or none)?  Then it has
        none under ``tighten`` either: a tighter cap only removes plans."""
        base = self._key(sub, mesh, submesh, grad_accum)
        return any(self.cache.get(base + _cap_key(t, pins), 0) is None
                   for t in TIGHTEN if t < tighten)

    def _looser_fits(self, sub: Graph, mesh: LogicalMesh, submesh: tuple[int, int],
                     grad_accum: int, tighten: float, pins: Pins | None = None
                     ) -> LayerCost | None:
        """A looser cap's plan of the layer (or its uncapped one), solved to
        optimality (a capped one: within ``SolverOptions.capped_gap``), that
        already meets 1 / ``tighten`` of the budget: it is the optimum under
        that cap too, or as near (a tighter cap only removes plans, and not
        this one), so the capped ILP need not be solved.  The
        tightest such cap's plan wins, so that one search asks the same."""
        base = self._key(sub, mesh, submesh, grad_accum)
        hit = self._built.get(base + _cap_key(1, pins))
        if hit is None:
            return None
        built = hit[1]
        capped = with_resident_cap(built, self.cluster.device.memory_bytes
                                   * self.options.memory_fraction / tighten).problem
        for t in sorted((t for t in TIGHTEN if t < tighten), reverse=True):
            c = self.cache.get(base + _cap_key(t, pins))
            if c is not None and c.result.solution.status in ("optimal", "trivial") \
                    and capped.feasible(list(c.result.solution.choice)):
                return c
        return None

    def submit(self, requests: list[tuple]) -> tuple | None:
        """Start solving the distinct layer ILPs of ``requests`` (arguments of
        :meth:`layer_cost`) in worker processes, when there are enough of
        them to pay for the workers; :meth:`collect` waits for them.  (Those
        not sent are solved one by one when :meth:`layer_cost` asks.)"""
        todo: dict[tuple, tuple] = {}
        counts = {r[4] for r in requests}
        # (a new micro-batch count: the problems built for the last are not asked again)
        self._built = {k: v for k, v in self._built.items() if k[5] in counts}
        for sub, mesh, submesh, grads, grad_accum, saved, crossing, entering, selective \
                in requests:
            key = self._key(sub, mesh, submesh, grad_accum)
            if key not in self.cache and key not in todo:
                todo[key] = (self._job(sub, mesh, submesh, grads, grad_accum,
                                       forward_values=saved | crossing), sub, mesh,
                             saved, crossing, entering, selective)
        if self.workers <= 1 or len(todo) < 4 * self.workers:
            return None
        return self._send(todo)

    def _send(self, todo: dict[tuple, tuple]) -> tuple:
        """Start the jobs of ``todo`` in the workers, in batches by mesh shape."""
        parts = batches(list(todo), {k: v[2] for k, v in todo.items()}, self.workers)
        pending = self._workers().map_async(
            solve_jobs, [[todo[k][0] for k in part] for part in parts], chunksize=1)
        return list(todo), todo, (parts, pending)

    def prefetch(self, requests: list[tuple], tighten: float,
                 pins: Sequence[Pins | None] | None = None) -> None:
        """Solve the distinct uncached layer ILPs of ``requests`` (arguments
        of :meth:`layer_cost`) under 1 / ``tighten`` of the budget, each with
        its ``pins`` (default none), side by side in the worker processes,
        when there are two or more (the stage DP asks for a capped mesh's
        layers, and for the layers solved again to agree with their stage,
        one by one, each a MIP of seconds).  The same problems give the same
        results wherever they are solved."""
        todo: dict[tuple, tuple] = {}
        for (sub, mesh, submesh, grads, grad_accum, saved, crossing, entering, selective), pin \
                in zip(requests, pins or [None] * len(requests)):
            key = self._key(sub, mesh, submesh, grad_accum, tighten, pin)
            if key in self.cache or key in todo \
                    or self._looser_unfit(sub, mesh, submesh, grad_accum, tighten, pin):
                continue
            same = self._looser_fits(sub, mesh, submesh, grad_accum, tighten, pin) \
                if tighten > 1 else None
            if same is not None:
                self.cache[key] = same
            else:
                todo[key] = (self._job(sub, mesh, submesh, grads, grad_accum, tighten,
                                       saved | crossing, pin), sub, mesh,
                             saved, crossing, entering, selective)
        if self.workers <= 1 or len(todo) < 2:
            return
        self.collect(self._send(todo))

    def _workers(self) -> Any:
        """The pool of ILP worker processes (started on first use)."""
        import multiprocessing
        import warnings
        with warnings.catch_warnings():
            # The workers run the ILP only (numpy, HiGHS), never JAX, so
            # JAX's warning about forking a multithreaded process does not
            # apply; fork (unlike spawn) needs no `if __name__ == "__main__"`
            # guard in the user's script.
            warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called")
            if self._pool is None:
                # a Ctrl-C landing while os.fork runs its at-fork hooks (logging's
                # lock) is printed as "Exception ignored" and lost: hold it until
                # the workers exist; it is delivered when unblocked
                import signal
                held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
                try:
                    self._pool = multiprocessing.get_context("fork").Pool(
                        self.workers, initializer=_ignore_sigint)
                finally:
                    signal.pthread_sigmask(signal.SIG_SETMASK, held)
        return self._pool

    def collect(self, batch: tuple | None) -> None:
        """Wait for a :meth:`submit` and keep its layer costs."""
        if batch is None:
            return
        keys, todo, (parts, pending) = batch
        t0 = time.perf_counter()
        got = {k: res for part, out in zip(parts, pending.get()) for k, res in zip(part, out)}
        for key in keys:        # (in the order asked, as one by one)
            r, took, built = got[key]
            job, sub, mesh, saved, crossing, entering, selective = todo[key]
            self.solves += 1
            self.ilp_work_s += took
            if built is not None:
                self._built[key] = (sub, built)
            self.cache[key] = (None if r is None else
                               layer_cost_from_result(sub, r, mesh, saved, crossing,
                                                      entering, selective, self.cluster,
                                                      *_accumulating(job)))
        self.ilp_s += time.perf_counter() - t0

    def close(self, abort: bool = False) -> None:
        """Stop the worker processes; ``abort`` (an interrupt, an error)
        kills them instead of letting them finish."""
        if self._pool is None:
            return
        pool, self._pool = self._pool, None
        if not abort:
            pool.close()
            pool.join()
            return
        # (CPython's Pool.terminate kills the workers, then may wait forever for
        # its task thread, blocked sending a task to them: wait a while, then
        # leave that daemon thread behind; the workers are gone either way)
        import threading
        stop = threading.Thread(target=pool.terminate, daemon=True)
        stop.start()
        stop.join(ABORT_WAIT_S)
        if not stop.is_alive():
            pool.join()

    def layer_cost(self, sub: Graph, mesh: LogicalMesh, submesh: tuple[int, int],
                   grads: frozenset[int] = frozenset(),
                   grad_accum: int = 1, saved: frozenset[int] = frozenset(),
                   crossing: frozenset[int] = frozenset(),
                   entering: frozenset[int] | None = None,
                   selective: tuple[frozenset[int], frozenset[int]] | None = None, *,
                   tighten: float = 1, pins: Pins | None = None) -> LayerCost | None:
        """The layer's cost; ``tighten`` > 1 solves its ILP with its
        parameters and optimizer state under 1 / tighten of the budget (a
        stage of many layers shares the budget: the fastest plan of a layer
        alone may keep its weights replicated); ``pins``: boundary layouts
        the layers of its stage fix (StageCosts.member)."""
        self.session.progress.check()   # (called for every layer cost: a Ctrl-C checkpoint)
        key = self._key(sub, mesh, submesh, grad_accum, tighten, pins)
        self.used.add(key)
        if key in self.cache:
            self.hits += 1
            return self.cache[key]
        if tighten > 1 and self._looser_unfit(sub, mesh, submesh, grad_accum, tighten, pins):
            self.hits += 1       # (known from the looser problem's answer)
            self.cache[key] = None
            return None
        if tighten > 1:
            same = self._looser_fits(sub, mesh, submesh, grad_accum, tighten, pins)
            if same is not None:
                self.hits += 1
                self.cache[key] = same
                return same
        self.solves += 1
        t0 = time.perf_counter()
        job = self._job(sub, mesh, submesh, grads, grad_accum, tighten, saved | crossing, pins)
        r, took, built = solve_job(job, self.session.ilp_caches)
        if built is not None:
            self._built[key] = (sub, built)
        self.ilp_work_s += took
        self.cache[key] = (None if r is None else
                           layer_cost_from_result(sub, r, mesh, saved, crossing,
                                                  entering, selective, self.cluster,
                                                  *_accumulating(job)))
        self.ilp_s += time.perf_counter() - t0
        return self.cache[key]

    def time_limit_hit(self) -> bool:
        """Did a layer ILP this search needed stop at its time limit?"""
        return any(c is not None and c.result.solution.status == "time_limit"
                   for c in (self.cache.get(k) for k in self.used))

    def stats(self, micro_batch_counts: int) -> SearchStats:
        return SearchStats(micro_batch_counts=micro_batch_counts,
                           distinct_layer_ilps=len(self.used), solved=self.solves,
                           cache_hits=self.hits, trace_s=self.trace_s, ilp_s=self.ilp_s,
                           ilp_work_s=self.ilp_work_s, dp_s=self.dp_s, workers=self.workers)


def forward_of(sub: Graph, forward_values: frozenset[int],
               grads: frozenset[int] = frozenset()) -> frozenset[int]:
    """The forward nodes of a layer's graph: those ``forward_values`` (what
    its backward or other layers read of its forward) and its loss-like
    outputs (the step's outputs updating no input) depend on, but for those
    computed from the gradients ``grads`` (a norm of the new weights:
    update work, as :func:`meshplan.graph.forward_nodes` has it)."""
    late = descendant_tensors(sub, (n.id for n in sub.nodes if not grads.isdisjoint(n.inputs)))
    return frozenset(ancestor_nodes(sub, set(forward_values) | {
        o.tensor for o in sub.outputs
        if o.updates is None and o.path != f"t{o.tensor}" and o.tensor not in late}))


def _accumulating(job: tuple) -> tuple[frozenset[int], int]:
    """(the gradients the layer makes, micro-batches) of a
    :meth:`LayerSolver._job`."""
    return job[7], job[8]


def layer_cost_from_result(sub: Graph, r: IntraOpResult, mesh: LogicalMesh,
                saved: frozenset[int], crossing: frozenset[int],
                entering: frozenset[int] | None = None,
                selective: tuple[frozenset[int], frozenset[int]] | None = None,
                cluster: ClusterSpec | None = None, accumulate: frozenset[int] = frozenset(),
                grad_accum: int = 1) -> LayerCost:
    """The layer's cost from its ILP.  ``entering``: the forward values of
    other layers it reads, what recomputation keeps per micro-batch (None:
    every boundary input).  ``selective``: the values selective recomputation
    makes again (their makers' time is priced on ``cluster``'s device) and
    what it keeps per micro-batch instead of ``saved``.  ``accumulate``: the
    parameter gradients the layer makes, summed over ``grad_accum``
    micro-batches, their sums over ``r.waiting_axes`` reduced once a step
    (ilp.accumulation.deferrable)."""
    specs = dict(r.constraints)
    resident = boundary = grads = optimizer = 0.0
    # With several micro-batches a gradient's running sum waits unreduced
    # over the axes its makers' deferred sums cover: whole along them
    waiting = r.waiting_axes if grad_accum > 1 and accumulate else frozenset()
    deferred = [pc for pc in r.collectives if pc.per_step and pc.gradient] if waiting else []

    def local(t: int, spec, skip: frozenset[int] = frozenset()) -> float:
        cut = tuple(tuple(a for a in d if a not in skip)
                    for d in spec_from_names(spec, mesh.axes))
        return sub.tensors[t].nbytes / num_shards(cut, mesh.shape)

    for inp, spec in zip(sub.inputs, r.input_specs):
        specs[inp.tensor] = spec
        if inp.role in (PARAM, OPT_STATE, STATE):
            resident += local(inp.tensor, spec)
        if inp.role == PARAM:
            grads += local(inp.tensor, spec, waiting)
        elif inp.role == OPT_STATE:
            optimizer += local(inp.tensor, spec)
        elif inp.role == BOUNDARY and (entering is None or inp.tensor in entering):
            boundary += local(inp.tensor, spec)
    # the parameters' narrowed copies, made once a step and kept for it
    copied = held_copies(sub, accumulate) if grad_accum > 1 else frozenset()
    copies = sum(local(t, specs[t]) if t in specs else sub.tensors[t].nbytes for t in copied)
    cast_s = _nodes_s(sub, [n for n in sub.nodes if n.outputs and n.outputs[0] in copied],
                      specs, mesh, cluster)
    resident += copies
    # the new values of the arguments the caller keeps, in their layouts: the
    # update program makes them beside the old ones (Graph.undonated)
    updated = set(sub.kept_updates.values())
    kept_new = sum(local(inp.tensor, spec) for inp, spec in zip(sub.inputs, r.input_specs)
                   if inp.tensor in updated)
    # (a backward reads the copy, not a micro-batch's own cast)
    saved = frozenset(saved) - copied
    kept = sum(local(t, specs[t]) if t in specs else sub.tensors[t].nbytes for t in saved)
    # all devices together hold each byte of what the layer sends on this often
    sent = sum(sub.tensors[t].nbytes for t in crossing)
    held = sum(mesh.size * (local(t, specs[t]) if t in specs else sub.tensors[t].nbytes)
               for t in crossing)
    steps = list(r.grad_steps)
    fwd_nodes = forward_of(sub, frozenset(saved) | crossing, accumulate)
    if ancestor_nodes(sub, [o.tensor for o in sub.outputs]) <= fwd_nodes:
        grads = 0.0     # (no backward: an evaluation step's layer makes no gradients)
    if steps:   # the forward runs before the backward: it hides no reduction
        forward, _ = r.seconds_of(fwd_nodes)
        steps[0] = (max(steps[0][0] - forward, 0.0), steps[0][1])
    # Full recomputation runs again what makes the values the backward
    # reads, from the layer's kept inputs; a forward value read only by the
    # next layer (the block's last projection) is kept as a boundary, and
    # XLA drops the replayed operators nothing reads
    replayed = frozenset(ancestor_nodes(sub, set(saved)))
    replay = r.seconds_of(replayed)
    again, sel_saved = selective if selective else (frozenset(), saved)
    # (nor does its selective replay cast the weights again)
    again, sel_saved = frozenset(again) - copied, frozenset(sel_saved) - copied
    sel_kept = sum(local(t, specs[t]) if t in specs else sub.tensors[t].nbytes for t in sel_saved)
    # the arena of intermediates its forward, backward and update programs need
    # (updates in place: the kept new values are kept_new, counted by the stage)
    plain = sub.in_place()
    temps = program_temp_bytes(
        plain, stored_liveness(plain).intervals, [n.id in fwd_nodes for n in sub.nodes],
        saved | crossing | copied, accumulate, update_nodes(sub, frozenset(accumulate))[0],
        grad_accum > 1,
        lambda t: local(t, specs[t]) if t in specs else sub.tensors[t].nbytes)
    return LayerCost(r.compute_s + r.comm_s, r.compute_s, r.comm_s, r.comm_bytes, resident,
                     max(r.peak_memory_bytes - resident, 0.0), boundary, kept,
                     replay[0], r, max(held / sent, 1.0) if sent else 1.0,
                     canonical_tensors(sub), grads, optimizer, Backward.of_steps(steps),
                     _region_s(sub, again, specs, mesh, cluster) if again else 0.0,
                     sel_kept if again else None, cast_s, copies, replay[1],
                     sum(pc.seconds for pc in deferred), sum(pc.nbytes for pc in deferred),
                     rows_cut_over(sub, r, mesh, saved, crossing) if grad_accum > 1 else (),
                     temps, unsplit_flops(sub, mesh, r.strategies),
                     replay_comm_bytes=r.bytes_of(replayed), kept_new_bytes=kept_new,
                     reduced_grad_bytes=sum(local(t, specs[t]) if t in specs
                                            else sub.tensors[t].nbytes for t in accumulate)
                     if waiting and grads else None)


def rows_cut_over(sub: Graph, r: IntraOpResult, mesh: LogicalMesh, saved: frozenset[int],
                  crossing: frozenset[int]) -> tuple[tuple[tuple[int, ...], bool, bool], ...]:
    """Whether plan ``r`` of layer ``sub`` lets a backward that holds it be
    replayed on each data shard's rows, per set of mesh axes (indices) that
    could be the data axes: ``(axes, reads, sent)``.  ``reads``: what the
    backward reads from outside -- the layer's inputs, the forward values it
    keeps -- is cut along its rows over ``axes``, those axes first, or whole
    over them (cut where it enters); ``sent``: so are the cotangents the
    layer hands back to an earlier layer (what matters for a stage's first
    layer only: within a stage they stay in its program).  As
    runtime.pipeline_partial checks a stage's backward program.  Empty
    where the rows are not known."""
    dims = sub.rows_dim
    if not dims:
        return ()
    specs = dict(r.constraints)
    specs.update((inp.tensor, spec) for inp, spec in zip(sub.inputs, r.input_specs))
    read = {inp.tensor for inp in sub.inputs} | set(saved)
    back = {o.tensor for o in sub.outputs if o.updates is None} - set(crossing)
    cuts = [(spec_from_names(specs[t], mesh.axes), d, t in read, t in back)
            for t, d in dims.items() if t in specs and (t in read or t in back)]
    real = [a for a, n in enumerate(mesh.shape) if n > 1]
    out = []
    for k in range(1, len(real) + 1):
        for axes in itertools.combinations(real, k):
            want, reads_ok, sent_ok = set(axes), True, True
            for cut, d, is_read, is_back in cuts:
                if set(cut[d][:k] if d < len(cut) else ()) == want:
                    continue
                sent_ok = sent_ok and not is_back
                if is_read and any(a in e for e in cut for a in axes):
                    reads_ok = False
            out.append((axes, reads_ok, sent_ok))
    return tuple(out)


def _region_s(sub: Graph, again: frozenset[int], specs: dict, mesh: LogicalMesh,
              cluster: ClusterSpec | None) -> float:
    """Seconds to run again the nodes making only values of ``again`` (the
    selective region), each at its planned split: arithmetic or fused
    memory traffic, whichever is slower (softmax is memory-bound)."""
    region = [n for n in sub.nodes if n.outputs and all(t in again for t in n.outputs)]
    return _nodes_s(sub, region, specs, mesh, cluster)


def _nodes_s(sub: Graph, nodes: list, specs: dict, mesh: LogicalMesh,
             cluster: ClusterSpec | None) -> float:
    """Seconds to run ``nodes`` once, each at its planned split."""
    if not nodes or cluster is None:
        return 0.0
    traffic = fused_bytes(sub, shared_written=cluster.device.achieved.fusion_writes_shared)
    total = 0.0
    for n in nodes:
        t = n.outputs[0]
        shards = num_shards(spec_from_names(specs[t], mesh.axes), mesh.shape) if t in specs else 1
        moved = moved_bytes(sub, n, traffic)
        total += compute_time(cluster.device, n.flops / shards, moved / shards,
                              node_dtype(sub, n))
    return total



