"""meshplan.dp_search: the inter-operator pass.

``plan_pipeline`` cuts the step into layers (:mod:`.layers`), costs every
distinct layer on every logical mesh of every candidate submesh with the ILP
(cached by a structural hash, so identical transformer blocks are solved
once), and runs Alpa's stage-submesh DP (:mod:`.stage_dp`) for each number of
micro-batches and each schedule, keeping the fastest plan that fits.

A stage's latency is the sum of its layers' ILP latencies on the stage's
logical mesh (resharding between layers of one stage is not modelled: the
layers of a stage share a mesh and identical blocks agree on their boundary
layout), plus sending the activations and their gradients to the next stage:
every device of the stage sends what it holds of them over its share of the
host's links (inter-host bandwidth / devices per host; within one host its
own link), all devices in parallel.
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

from ..cluster import ClusterSpec
from ..cost_model.mesh import mesh_model
from ..cost_model.sharding import num_shards, spec_from_names
from .. import progress
from ..errors import InfeasiblePlanError, MeshplanError, TraceError
from ..graph import BATCH, OPT_STATE, PARAM, STATE, Graph
from ..ilp import InputLayouts, IntraOpResult, candidate_meshes, solve_intra_op
from ..plan import (LogicalMesh, Plan, PlanPredicted, Predicted, Stage, arg_prefixes)
from .layers import (BOUNDARY, GRAD_BOUNDARY, Layering, assign_layers, canonical_tensors,
                     crossing_values, group_layers, layer_subgraph,
                     saved_for_backward)
from .stage_dp import DPResult, StageChoice, Submesh, brute_force, stage_dp, submesh_shapes

__all__ = ["plan_pipeline", "PipelineOptions", "assign_layers", "stage_dp", "brute_force",
           "submesh_shapes", "Submesh"]

SCHEDULES = ("gpipe", "1f1b", "interleaved")
# What a searched schedule ("auto") may be: the runtime executes GPipe and
# 1F1B; interleaved 1F1B is planned only when asked for by name.
AUTO_SCHEDULES = ("1f1b", "gpipe")


@dataclass(frozen=True)
class PipelineOptions:
    num_micro_batches: tuple[int, ...] | None = None   # None: searched
    schedules: tuple[str, ...] = ("1f1b", "gpipe", "interleaved")
    num_layers: int | None = None                       # None: from marks, else chosen
    num_stages: int | None = None                       # None: searched
    fixed: tuple[int, int, int] | None = None           # Manual (dp, tp, pp)
    time_limit: float = 60.0
    backend: str = "highs"
    memory_fraction: float = 0.9
    remat: bool | None = None          # None: chosen per stage; True: every stage; False: none
    # stop at the first micro-batch count (searched from the most) that fits
    # nothing after one that fitted: fewer, larger micro-batches need more memory
    prune_micro_batches: bool = True
    # baselines and hand-made plans
    input_filter: Any = None                  # an ilp.InputLayouts for every layer ILP
    data_parallel_stages: bool = False        # every stage one "data" axis (inter-op only)
    equal_layers: bool = False                # num_stages stages of equally many layer groups


@dataclass(frozen=True)
class LayerCost:
    time_s: float
    compute_s: float
    comm_s: float
    comm_bytes: float
    resident_bytes: float      # parameters, optimizer state, other state on one device
    activation_bytes: float    # peak of live intermediates (incl. incoming boundary) per micro-batch
    boundary_bytes: float      # incoming activations per micro-batch (what remat keeps)
    saved_bytes: float         # forward values the backward reads: kept per micro-batch in flight
    forward_fraction: float    # share of the layer's time spent in its forward pass
    result: IntraOpResult
    # how many devices hold each byte of the activations the layer sends on
    # (bytes-weighted; 1 when they are split over the whole mesh)
    send_replication: float = 1.0
    # the solved layer's tensor ids in canonical order: a structurally equal
    # layer reuses this result with its own ids in the same positions
    tensors: tuple[int, ...] = ()

    @property
    def transient_bytes(self) -> float:
        """What one micro-batch's passes need beyond the saved activations."""
        return max(self.activation_bytes - self.saved_bytes, 0.0)


def _solve_job(job: tuple) -> tuple[IntraOpResult | None, float]:
    """One layer ILP (run in a worker process when solving in parallel): its
    result (None: it does not fit) and the seconds it took."""
    sub, cluster, mesh, submesh, backend, time_limit, budget, grads, grad_accum, filt = job
    t0 = time.perf_counter()
    try:
        r = solve_intra_op(sub, cluster, mesh, submesh=submesh, backend=backend,
                           time_limit=time_limit, memory_budget=budget,
                           accumulate=grads, grad_accum=grad_accum, input_filter=filt)
    except InfeasiblePlanError:
        r = None
    return r, time.perf_counter() - t0


def _ignore_sigint() -> None:
    """In an ILP worker: Ctrl-C is the parent's to handle (it ends the workers)."""
    import signal
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _workers() -> int:
    """Processes for layer ILPs: ``MESHPLAN_WORKERS``, else the usable CPUs (at most 8)."""
    env = os.environ.get("MESHPLAN_WORKERS")
    if env:
        try:
            return max(1, int(env))
        except ValueError:
            raise MeshplanError(f"MESHPLAN_WORKERS={env!r}: use a positive integer") from None
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:   # not Linux
        n = os.cpu_count() or 1
    return max(1, min(n, 8))


# Figures of the last plan_pipeline call in this process (benchmarks read them).
LAST_SEARCH: dict[str, float] = {}

# Layer ILP results, shared by the searches of one process (a benchmark that
# plans one model many ways solves each distinct layer once).
_LAYER_CACHE: dict[tuple, "LayerCost | None"] = {}
_LAYER_CACHE_MAX = 50_000


@dataclass
class _Search:
    cluster: ClusterSpec
    options: PipelineOptions
    cache: dict = field(default_factory=lambda: _LAYER_CACHE)
    solves: int = 0             # ILPs solved by this search
    hits: int = 0               # layer costs found in the (process-wide) cache
    used: set = field(default_factory=set)   # distinct layer problems this search needed
    trace_s: float = 0.0        # wall time re-tracing the step per micro-batch count
    ilp_s: float = 0.0          # wall time in layer ILPs (in-process or waiting on workers)
    ilp_work_s: float = 0.0     # seconds the layer ILPs took, wherever they ran
    dp_s: float = 0.0           # wall time in the stage DP, its ILPs excluded
    workers: int = 1
    _pool: Any = None

    def _key(self, sub: Graph, mesh: LogicalMesh, submesh: tuple[int, int],
             grad_accum: int) -> tuple:
        mm = mesh_model(self.cluster, mesh, submesh=submesh)
        if len(self.cache) > _LAYER_CACHE_MAX:
            self.cache.clear()
        o = self.options
        return (sub.fingerprint, mesh.shape, tuple((l.bandwidth, l.latency) for l in mm.links),
                grad_accum, o.input_filter, repr(self.cluster.device), o.backend, o.time_limit,
                o.memory_fraction)

    def _job(self, sub: Graph, mesh: LogicalMesh, submesh: tuple[int, int],
             grads: frozenset[int], grad_accum: int) -> tuple:
        """The arguments of :func:`_solve_job` (only what a worker needs)."""
        o = self.options
        used = frozenset(t for n in sub.nodes for t in n.inputs) & grads
        return (sub, self.cluster, mesh, submesh, o.backend, o.time_limit,
                self.cluster.device.memory_bytes * o.memory_fraction, used, grad_accum,
                o.input_filter)

    def submit(self, requests: list[tuple]) -> tuple | None:
        """Start solving the distinct layer ILPs of ``requests`` (arguments of
        :meth:`layer_cost`) in worker processes, when there are enough of
        them to pay for the workers; :meth:`collect` waits for them.  (Those
        not sent are solved one by one when :meth:`layer_cost` asks.)"""
        todo: dict[tuple, tuple] = {}
        for sub, mesh, submesh, fwd_flops, grads, grad_accum, saved, crossing in requests:
            key = self._key(sub, mesh, submesh, grad_accum)
            if key not in self.cache and key not in todo:
                todo[key] = (self._job(sub, mesh, submesh, grads, grad_accum), sub, mesh,
                             fwd_flops, saved, crossing)
        if self.workers <= 1 or len(todo) < 4 * self.workers:
            return None
        import multiprocessing
        import warnings
        with warnings.catch_warnings():
            # The workers run the ILP only (numpy, HiGHS), never JAX, so
            # JAX's warning about forking a multithreaded process does not
            # apply; fork (unlike spawn) needs no `if __name__ == "__main__"`
            # guard in the user's script.
            warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called")
            if self._pool is None:
                self._pool = multiprocessing.get_context("fork").Pool(
                    self.workers, initializer=_ignore_sigint)
        keys = list(todo)
        return keys, todo, self._pool.map_async(_solve_job, [todo[k][0] for k in keys],
                                                chunksize=1)

    def collect(self, batch: tuple | None) -> None:
        """Wait for a :meth:`submit` and keep its layer costs."""
        if batch is None:
            return
        keys, todo, pending = batch
        t0 = time.perf_counter()
        results = pending.get()
        for key, (r, took) in zip(keys, results):
            _, sub, mesh, fwd_flops, saved, crossing = todo[key]
            self.solves += 1
            self.ilp_work_s += took
            self.cache[key] = (None if r is None else
                               _layer_cost(sub, r, mesh, fwd_flops, saved, crossing))
        self.ilp_s += time.perf_counter() - t0

    def close(self, abort: bool = False) -> None:
        """Stop the worker processes; ``abort`` (an interrupt, an error)
        kills them instead of letting them finish."""
        if self._pool is not None:
            if abort:
                self._pool.terminate()
            else:
                self._pool.close()
            self._pool.join()
            self._pool = None

    def layer_cost(self, sub: Graph, mesh: LogicalMesh, submesh: tuple[int, int],
                   fwd_flops: float, grads: frozenset[int] = frozenset(),
                   grad_accum: int = 1, saved: frozenset[int] = frozenset(),
                   crossing: frozenset[int] = frozenset()
                   ) -> LayerCost | None:
        progress.check()         # (called for every layer cost: a Ctrl-C checkpoint)
        key = self._key(sub, mesh, submesh, grad_accum)
        self.used.add(key)
        if key in self.cache:
            self.hits += 1
            return self.cache[key]
        self.solves += 1
        t0 = time.perf_counter()
        r, took = _solve_job(self._job(sub, mesh, submesh, grads, grad_accum))
        self.ilp_work_s += took
        self.cache[key] = (None if r is None else
                           _layer_cost(sub, r, mesh, fwd_flops, saved, crossing))
        self.ilp_s += time.perf_counter() - t0
        return self.cache[key]


def _layer_cost(sub: Graph, r: IntraOpResult, mesh: LogicalMesh, fwd_flops: float,
                saved: frozenset[int], crossing: frozenset[int]) -> LayerCost:
    specs = dict(r.constraints)
    resident = boundary = 0.0

    def local(t: int, spec) -> float:
        return sub.tensors[t].nbytes / num_shards(spec_from_names(spec, mesh.axes), mesh.shape)

    for inp, spec in zip(sub.inputs, r.input_specs):
        specs[inp.tensor] = spec
        if inp.role in (PARAM, OPT_STATE, STATE):
            resident += local(inp.tensor, spec)
        elif inp.role == BOUNDARY:
            boundary += local(inp.tensor, spec)
    kept = sum(local(t, specs[t]) if t in specs else sub.tensors[t].nbytes for t in saved)
    total_flops = sum(n.flops for n in sub.nodes) or 1.0
    # all devices together hold each byte of what the layer sends on this often
    sent = sum(sub.tensors[t].nbytes for t in crossing)
    held = sum(mesh.size * (local(t, specs[t]) if t in specs else sub.tensors[t].nbytes)
               for t in crossing)
    return LayerCost(r.compute_s + r.comm_s, r.compute_s, r.comm_s, r.comm_bytes, resident,
                     max(r.peak_memory_bytes - resident, 0.0), boundary, kept,
                     min(fwd_flops / total_flops, 1.0), r, max(held / sent, 1.0) if sent else 1.0,
                     canonical_tensors(sub))


def _micro_batch_candidates(batch: int, fixed: tuple[int, ...] | None) -> list[int]:
    if fixed:
        bad = [b for b in fixed if b < 1 or batch % b]
        if bad:
            raise MeshplanError(f"num_micro_batches={bad[0]} does not divide the batch size {batch}")
        return list(fixed)
    out = [b for b in (1, 2, 4, 8, 16, 32, 64) if batch % b == 0 and b <= batch]
    return out or [1]


def _batch_size(graph: Graph) -> int:
    sizes = {graph.tensors[i.tensor].shape[0] for i in graph.inputs
             if i.role == BATCH and graph.tensors[i.tensor].shape}
    if not sizes:
        raise MeshplanError("pipeline planning needs a batch: pass batch_argnums naming the "
                            "arguments whose dimension 0 is the batch")
    if len(sizes) > 1:
        raise MeshplanError(f"batch arguments disagree on the batch size: {sorted(sizes)}")
    return sizes.pop()


def plan_pipeline(graph: Graph, cluster: ClusterSpec, method, *,
                  retrace: Callable[[int], Graph] | None = None,
                  options: PipelineOptions | None = None) -> Plan:
    """The fastest pipeline plan (possibly one stage) for ``graph``.

    ``retrace(B)`` returns the step traced with the batch split into ``B``
    micro-batches; without it only ``B = 1`` is considered.
    """
    opts = options or _options_from_method(method)
    batch = _batch_size(graph)
    mbs = _micro_batch_candidates(batch, opts.num_micro_batches)
    if retrace is None:
        mbs = [b for b in mbs if b == 1] or [mbs[0]]
    # The most micro-batches first: fewer, larger micro-batches need more
    # memory, so once a count fits nothing after one that did, fewer are not
    # tried (prune_micro_batches).
    todo = sorted(mbs, reverse=True)
    searched: list[int] = []
    untraceable: set[int] = set()
    search = _Search(cluster, opts, workers=_workers())
    best: tuple[float, Plan] | None = None
    errors: dict[int, str] = {}          # micro-batch count -> why it has no plan
    ahead: dict[int, _Layered | TraceError] = {}

    def layered(B: int) -> _Layered | TraceError:
        t0 = time.perf_counter()
        try:
            g = graph if B == 1 else retrace(B)  # type: ignore[misc]
        except TraceError as e:
            return e
        finally:
            search.trace_s += time.perf_counter() - t0
        return _layered(g, B, cluster, opts)

    try:
        while todo:
            B = todo.pop(0)
            searched.append(B)
            try:
                with progress.step(f"pipeline search with {B} micro-batch(es) "
                                   f"(layer ILPs and stage DP)"):
                    lay = ahead.pop(B) if B in ahead else layered(B)
                    if isinstance(lay, TraceError):
                        raise lay
                    pending = search.submit(lay.requests())
                    if pending is not None and todo and todo[0] not in ahead:
                        # trace the next count while the workers solve this one's ILPs
                        ahead[todo[0]] = layered(todo[0])
                    search.collect(pending)
                    p = _plan_for_micro_batches(graph, lay, cluster, opts, search, method)
                if best is None or p.predicted.iteration_s < best[0]:
                    best = (p.predicted.iteration_s, p)
            except InfeasiblePlanError as e:
                errors[B] = str(e)
                more = [b for b in searched if b > B and b not in untraceable]
                if opts.prune_micro_batches and (best is not None or not more):
                    todo.clear()     # fewer micro-batches fit no better
            except TraceError as e:
                if B == 1:
                    raise
                # the step cannot run at this micro-batch size (e.g. MoE token
                # groups larger than a micro-batch): fewer, larger ones may
                errors[B] = f"the step does not trace with {B} micro-batches: {e}"
                untraceable.add(B)
                continue
            top = max(searched)
            if (best is None and not todo and opts.num_micro_batches is None
                    and retrace is not None and top not in untraceable and batch % (2 * top) == 0):
                # nothing fits yet: smaller micro-batches, down to one example
                todo.append(2 * top)
    except BaseException:        # Ctrl-C included: no worker may outlive the search
        search.close(abort=True)
        raise
    search.close()
    if best is None:
        # why the most micro-batches that traced (the least memory) fit nothing,
        # then why the fewest micro-batches that did not trace failed
        traced = [b for b in errors if b not in untraceable]
        why = [errors[max(traced)]] if traced else []
        why += [errors[min(untraceable)]] if untraceable else []
        raise InfeasiblePlanError(
            "no pipeline plan fits the devices' memory with any number of stages, micro-batches "
            f"or remat ({'; '.join(why) or 'no candidates'}); use more devices or a "
            "cluster with more memory per device",
            budget_bytes=int(cluster.device.memory_bytes * opts.memory_fraction))
    plan = best[1]
    scan_note = _scanned_layers(graph)
    if scan_note:
        import warnings
        warnings.warn(f"meshplan: {scan_note}", stacklevel=3)
        plan = replace(plan, notes=plan.notes + (scan_note,))
    # (no wall-clock time in the plan: the same inputs give byte-identical JSON)
    # (what this search needed, not what an earlier one left in the cache:
    # the plan must not depend on the process's history)
    note = (f"inter-operator search: {len(searched)} micro-batch count(s), {len(search.used)} distinct "
            f"layer ILPs")
    progress.note(f"{search.solves} layer ILPs solved, {search.hits} layer costs from the cache")
    LAST_SEARCH.clear()
    LAST_SEARCH.update(micro_batch_counts=len(searched), distinct_layer_ilps=len(search.used),
                       solved=search.solves, cache_hits=search.hits, trace_s=search.trace_s,
                       ilp_s=search.ilp_s, ilp_work_s=search.ilp_work_s, dp_s=search.dp_s,
                       workers=search.workers)
    return replace(plan, notes=plan.notes + (note,))


def _scanned_layers(graph: Graph) -> str | None:
    """What to tell a user whose layers run inside one ``lax.scan`` that
    reads parameters: the search cannot cut inside a scan.  (``meshplan.plan``
    and ``parallelize`` unroll a scan that iterates over stacked arguments
    first, :mod:`meshplan.unstack`; this remains for other scans and graphs
    traced as they are.)"""
    total = graph.total_flops or 1.0
    params = {i.tensor for i in graph.inputs if i.role == PARAM}
    # (the forward scan and its transpose in the backward pass both read them)
    scans = [n for n in graph.nodes
             if n.primitive == "scan" and n.repeat > 1 and params & set(n.inputs)]
    share = sum(n.flops for n in scans) / total
    if share < 0.5:
        return None
    return (f"{share:.0%} of the step's FLOPs run inside lax.scan over {scans[0].repeat} stacked "
            "layers, which the pipeline search treats as one layer each (stages cannot split a "
            "scan); meshplan.plan unrolls a scan only when it iterates over stacked arguments "
            "of the step: stack the layers' parameters as arguments, or loop over the blocks "
            "in Python")


def _options_from_method(method) -> PipelineOptions:
    from ..methods import Auto, Manual, PipeshardParallel
    if isinstance(method, Manual):
        return PipelineOptions(num_micro_batches=(method.num_micro_batches,),
                               schedules=(method.schedule,), num_stages=method.pp,
                               fixed=(method.dp, method.tp, method.pp),
                               time_limit=method.time_limit, backend=method.backend,
                               remat=method.remat, input_filter=InputLayouts("model"))
    if isinstance(method, PipeshardParallel):
        mb = None if method.num_micro_batches is None else (int(method.num_micro_batches),)
        sched = AUTO_SCHEDULES if method.schedule == "auto" else (method.schedule,)
        stages = None if method.stages == "auto" else int(method.stages)
        return PipelineOptions(num_micro_batches=mb, schedules=sched, num_stages=stages,
                               time_limit=method.time_limit, backend=method.backend)
    if isinstance(method, Auto):
        return PipelineOptions(schedules=AUTO_SCHEDULES, time_limit=method.time_limit,
                               backend=method.backend)
    raise MeshplanError(f"{method!r} is not a pipeline method")


def _stage_meshes(cluster: ClusterSpec, sub: Submesh, fixed, data_only: bool = False
                  ) -> list[LogicalMesh]:
    n = sub.size
    if data_only:
        return [LogicalMesh(("data",), (n,))]
    if fixed is not None:
        dp, tp, _ = fixed
        return [LogicalMesh(("data", "model"), (dp, tp))]
    meshes = candidate_meshes(n, 2, cluster=cluster, submesh=(sub.hosts, sub.devices_per_host))
    if sub.hosts > 1:   # keep the fast axis inside a host (one axis may cross hosts)
        meshes = [m for m in meshes if len(m.shape) == 1 or m.shape[-1] <= sub.devices_per_host]
    return meshes


@dataclass
class _Layered:
    """One micro-batch count's layers and layer problems, ready for the DP."""
    B: int
    g: Graph                        # the step traced at micro-batch size
    layering: Layering
    groups: list[tuple[int, int]]   # consecutive layers the stage DP cuts between
    subs: list[Graph]               # one subgraph per layer
    fwd_flops: list[float]
    grads: frozenset[int]           # parameter gradients (what meshplan.grad marks)
    saved: list[frozenset[int]]     # per layer: what its backward reads
    crossing: list[frozenset[int]]  # per layer: forward values it sends to later layers
    submeshes: list[Submesh]
    meshes_of: list[list[LogicalMesh]]
    max_stages: int | None
    budget: float
    p2p_bw: float                   # one device's share of the links between stages (bytes/s)
    # parameters, optimizer and other state of each layer, unsharded: a stage
    # whose state cannot fit even when split over all its devices is skipped
    # before any ILP is solved
    state_bytes: list[float]

    def request(self, l: int, m: int, k: int) -> tuple:
        """The arguments of :meth:`_Search.layer_cost` for layer ``l`` on mesh ``k`` of submesh ``m``."""
        s = self.submeshes[m]
        return (self.subs[l], self.meshes_of[m][k], (s.hosts, s.devices_per_host),
                self.fwd_flops[l], self.grads, self.B, self.saved[l], self.crossing[l])

    def requests(self) -> list[tuple]:
        """Every layer on every mesh its state fits: the stage DP asks for all of them."""
        return [self.request(l, m, k) for l in range(len(self.subs))
                for m, s in enumerate(self.submeshes) if self.state_bytes[l] / s.size <= self.budget
                for k in range(len(self.meshes_of[m]))]


def _layered(g: Graph, B: int, cluster: ClusterSpec, opts: PipelineOptions) -> _Layered:
    # at least as many layers as a fixed number of stages needs
    need = max(opts.fixed[2] if opts.fixed else 1, opts.num_stages or 1)
    wanted = max(_default_layers(g, cluster), need)
    layering = assign_layers(g, opts.num_layers, default_layers=wanted)
    if layering.num_layers < need and opts.num_layers is None:
        # fewer repeated blocks than the stages asked for: finer layers
        layering = assign_layers(g, need)
    L = layering.num_layers
    # the stage DP cuts between groups of consecutive layers (repeated blocks
    # make many small layers; each kind is costed once, and a stage's cost is
    # the sum of its layers' costs)
    n_groups = max(wanted, min(L, 16)) if opts.num_layers is None else L
    if opts.equal_layers:
        if not opts.num_stages or L < opts.num_stages:
            raise MeshplanError("equal_layers needs a number of stages of at most the layers")
        S = opts.num_stages
        n_groups = S * (min(n_groups, L) // S)
    subs = [layer_subgraph(g, layering, l, l) for l in range(L)]
    fwd_flops = [0.0] * L
    for n in g.nodes:
        if layering.forward[n.id]:
            fwd_flops[layering.layer_of_node[n.id]] += n.flops
    if opts.fixed is not None:
        dp, tp, pp = opts.fixed
        submeshes = [_fixed_submesh(cluster, dp * tp)]
        max_stages = pp
    else:
        # whole hosts: powers of two, and the divisors of the host count (so
        # that equal stages can cover every host)
        submeshes = [s for s in submesh_shapes(cluster.num_hosts, cluster.devices_per_host)
                     if s.hosts & (s.hosts - 1) == 0 or cluster.num_hosts % s.hosts == 0]
        max_stages = opts.num_stages
    return _Layered(
        B=B, g=g, layering=layering, groups=group_layers(layering.flops, n_groups), subs=subs,
        fwd_flops=fwd_flops,
        grads=frozenset(t for n in g.nodes if n.primitive == GRAD_BOUNDARY for t in n.inputs),
        saved=saved_for_backward(g, layering), crossing=crossing_values(g, layering, subs),
        submeshes=submeshes,
        meshes_of=[_stage_meshes(cluster, s, opts.fixed, opts.data_parallel_stages)
                   for s in submeshes],
        max_stages=max_stages, budget=cluster.device.memory_bytes * opts.memory_fraction,
        p2p_bw=(cluster.inter_host.bandwidth_bytes_per_s / cluster.devices_per_host
                if cluster.num_hosts > 1 else cluster.intra_host.bandwidth_bytes_per_s),
        state_bytes=[sum(t.nbytes for t in (sub.tensors[i.tensor] for i in sub.inputs
                                            if i.role in (PARAM, OPT_STATE, STATE)))
                     for sub in subs])


def _plan_for_micro_batches(full: Graph, lay: _Layered, cluster: ClusterSpec,
                            opts: PipelineOptions, search: _Search, method) -> Plan:
    B, g, layering, groups, subs = lay.B, lay.g, lay.layering, lay.groups, lay.subs
    L = layering.num_layers
    submeshes, meshes_of, budget, p2p_bw = lay.submeshes, lay.meshes_of, lay.budget, lay.p2p_bw
    state_bytes = lay.state_bytes
    state_prefix = [0.0]
    for b in state_bytes:
        state_prefix.append(state_prefix[-1] + b)
    costs: dict[tuple[int, int, int], LayerCost | None] = {}

    def layer(l: int, m: int, k: int) -> LayerCost | None:
        key = (l, m, k)
        if key not in costs:
            costs[key] = search.layer_cost(*lay.request(l, m, k))
        return costs[key]

    # per (submesh, mesh): what each group of layers adds to a stage, or None
    # where a layer of the group has no plan (or its state alone cannot fit)
    group_sums: dict[tuple[int, int], list[tuple | None]] = {}

    def sends(j: int, m: int, k: int) -> float:
        """Seconds a stage ending with layer ``j`` (on mesh ``k`` of submesh
        ``m``) spends per micro-batch sending its activations on and
        receiving their gradients: every device sends what it holds of them
        over its share of the links (a value replicated over r devices goes
        r times), the stage's devices in parallel."""
        if j == L - 1:
            return 0.0
        rep = layer(j, m, k).send_replication
        return 2 * layering.cut_bytes[j] * rep / (submeshes[m].size * p2p_bw)

    def sums_of(m: int, k: int) -> list[tuple | None]:
        if (m, k) not in group_sums:
            rows: list[tuple | None] = []
            for a, b in groups:
                if any(state_bytes[l] / submeshes[m].size > budget for l in range(a, b + 1)):
                    rows.append(None)
                    continue
                parts = [layer(l, m, k) for l in range(a, b + 1)]
                if any(p is None for p in parts):
                    rows.append(None)
                    continue
                rows.append((sum(p.time_s for p in parts),
                             sum(p.resident_bytes for p in parts),
                             sum(p.saved_bytes for p in parts),
                             max(p.transient_bytes for p in parts),
                             sum(p.time_s * (1 + p.forward_fraction) for p in parts),
                             sum(p.boundary_bytes for p in parts),
                             max(p.activation_bytes for p in parts)))
            group_sums[m, k] = rows
        return group_sums[m, k]

    best_plans = []
    for schedule in opts.schedules:
        choice: dict[tuple, tuple] = {}

        def stage_cost(gi: int, gj: int, m: int, s: int, schedule=schedule, choice=choice):
            i, j = groups[gi][0], groups[gj][1]
            if opts.equal_layers and gj - gi + 1 != len(groups) // opts.num_stages:
                return None
            in_flight = B if schedule == "gpipe" else min(B, s)
            if (state_prefix[j + 1] - state_prefix[i]) / submeshes[m].size > budget:
                return None
            best = None
            for k in range(len(meshes_of[m])):
                rows = sums_of(m, k)[gi:gj + 1]
                if any(r is None for r in rows):
                    continue
                send = sends(j, m, k)
                t, resident, act, temp, t_r, keep, peak = (
                    sum(r[0] for r in rows), sum(r[1] for r in rows), sum(r[2] for r in rows),
                    max(r[3] for r in rows), sum(r[4] for r in rows), sum(r[5] for r in rows),
                    max(r[6] for r in rows))
                # each micro-batch in flight keeps what its backward reads;
                # the one being processed also needs its layer's temporaries
                options = []
                if opts.remat is not True:
                    options.append((t + send, False, resident + in_flight * act + temp))
                if opts.remat is not False:
                    # keep only the stage's inputs; recompute a layer's forward
                    # just before its backward
                    options.append((t_r + send, True, resident + in_flight * keep + peak))
                for lat, remat, mem in options:
                    if mem <= budget and (best is None or lat < best[0]):
                        best = (lat, remat, mem, k, send)
            if best is None:
                return None
            choice[i, j, m, s] = best
            return best[0]

        t0, ilp0 = time.perf_counter(), search.ilp_s
        res = stage_dp(len(groups), submeshes, cluster.num_devices, B, stage_cost,
                       max_stages=lay.max_stages)
        search.dp_s += time.perf_counter() - t0 - (search.ilp_s - ilp0)
        if res is not None:   # group indices -> layer indices
            res = replace(res, stages=tuple(replace(st, first=groups[st.first][0],
                                                    last=groups[st.last][1]) for st in res.stages))
        if res is None or (opts.fixed is not None and len(res.stages) != opts.fixed[2]):
            continue
        total = res.total_s
        n_st = len(res.stages)
        if schedule == "interleaved":
            if n_st < 2 or any(st.last - st.first < 1 for st in res.stages):
                continue
            # two model chunks per device: bubble halves, stage-to-stage traffic doubles
            t_max = max(st.latency for st in res.stages)
            n_st = len(res.stages)
            sends = sum(choice[st.first, st.last, st.submesh, n_st - k][4]
                        for k, st in enumerate(res.stages[:-1]))
            total = B * t_max + (sum(st.latency for st in res.stages) - t_max) / 2 + sends
        best_plans.append((total, schedule, res, dict(choice)))
    if not best_plans:
        raise InfeasiblePlanError(f"no stage assignment fits with {B} micro-batch(es)")
    total, schedule, res, choice = min(best_plans, key=lambda x: x[0])
    return _make_plan(full, g, layering, subs, submeshes, meshes_of, res, choice, schedule,
                      B, total, cluster, method, layer)


def _default_layers(g: Graph, cluster: ClusterSpec) -> int:
    return max(2, min(16, cluster.num_devices, len(g.nodes) // 50 or 2))


def _fixed_submesh(cluster: ClusterSpec, n: int) -> Submesh:
    dph = cluster.devices_per_host
    if n <= dph:
        return Submesh(1, n)
    if n % dph:
        raise MeshplanError(f"a stage of {n} devices is not whole hosts of {dph}")
    return Submesh(n // dph, dph)


def _place(submeshes: Sequence[Submesh], stages: Sequence[StageChoice], cluster: ClusterSpec
           ) -> list[tuple[int, ...]]:
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


def _make_plan(full: Graph, g: Graph, layering: Layering, subs, submeshes, meshes_of,
               res: DPResult, choice, schedule: str, B: int, total: float,
               cluster: ClusterSpec, method, layer) -> Plan:
    nonbatch = sorted({i.argnum for i in full.inputs if i.argnum not in full.batch_argnums})
    pre = dict(arg_prefixes(nonbatch) + arg_prefixes(sorted(set(full.batch_argnums))))
    placements = _place(submeshes, res.stages, cluster)
    stages, batch_specs = [], {}
    n_stages = len(res.stages)
    peak_mem = 0
    comm_bytes = 0.0
    for k, (st, devices) in enumerate(zip(res.stages, placements)):
        lat, remat, mem, mesh_k, _ = choice[st.first, st.last, st.submesh, n_stages - k]
        mesh = meshes_of[st.submesh][mesh_k]
        params: dict[str, tuple] = {}
        # the layers' planned layouts, keyed by tensor ids of the step traced
        # at micro-batch size (what the pipeline runtime replays): the
        # intermediates, and the activations / batch pieces entering a layer
        constraints: dict[int, tuple] = {}
        reads: dict[tuple[int, int], tuple] = {}
        compute = comm = cbytes = 0.0
        for l in range(st.first, st.last + 1):
            lc = layer(l, st.submesh, mesh_k)
            compute += lc.compute_s
            comm += lc.comm_s
            cbytes += lc.comm_bytes
            # (the result may come from a structurally equal layer: its ids)
            ids = dict(zip(lc.tensors, canonical_tensors(subs[l])))
            for t, spec in lc.result.constraints:
                constraints.setdefault(ids.get(t, t), spec)
            for t, pos, spec in lc.result.read_constraints:
                reads.setdefault((ids.get(t, t), pos), spec)
            for inp, spec in zip(subs[l].inputs, lc.result.input_specs):
                if inp.role in (BOUNDARY, BATCH) and g.tensors[inp.tensor].shape:
                    constraints.setdefault(inp.tensor, spec)
                if inp.role == BOUNDARY:
                    continue
                key = pre.get(inp.argnum, "") + inp.path
                if inp.role == BATCH:
                    batch_specs.setdefault(key, spec)
                else:
                    params.setdefault(key, spec)
        sub = submeshes[st.submesh]
        stages.append(Stage(layers=(st.first, st.last), devices=devices,
                            submesh=(sub.hosts, sub.devices_per_host), logical_mesh=mesh,
                            remat=remat, params=tuple(sorted(params.items())),
                            predicted=Predicted(compute, comm, int(mem)),
                            constraints=tuple(sorted(constraints.items())),
                            read_constraints=tuple((t, p, sp) for (t, p), sp in sorted(reads.items()))))
        peak_mem = max(peak_mem, int(mem))
        comm_bytes = max(comm_bytes, cbytes * B)
    tflops = full.total_flops / cluster.num_devices / total / 1e12 if total > 0 else 0.0
    name = getattr(method, "name", "auto")
    return Plan(graph_fingerprint=full.fingerprint, cluster=cluster, method=name,
                stages=tuple(stages), num_micro_batches=B,
                schedule=schedule if n_stages > 1 else "none",
                batch=tuple(sorted(batch_specs.items())),
                predicted=PlanPredicted(total, tflops, peak_mem, int(comm_bytes)),
                function=full.name, batch_argnums=full.batch_argnums,
                arg_prefixes=tuple(sorted(pre.items())),
                notes=(f"{layering.num_layers} layers "
                       f"({'user marks' if layering.marked else 'clustered'})",),
                layer_of_node=layering.layer_of_node if n_stages > 1 else ())
