"""One micro-batch count's layer problems, ready for the stage DP: the step
traced at micro-batch size cut into layers, each layer's subgraph, what its
backward keeps and what it sends on, and the submeshes and logical meshes a
stage may take."""
from __future__ import annotations

import functools
import operator
from dataclasses import dataclass, replace
from typing import Mapping, MutableMapping

from ..cluster import ClusterSpec
from ..contributions import graph_ops, once_a_step
from ..cost_model import default_axis_names
from ..cost_model.fusion import kept_after_fusion
from ..cost_model.mesh import is_cpu
from ..cost_model.pipeline import TRAIN_PROGRAMS, layer_buffers
from ..cost_model.torus import torus_orders
from ..errors import MeshplanError
from ..graph import (OPT_STATE, PARAM, STATE, Graph, ancestor_nodes, arithmetic_flops,
                     forward_nodes, stage_program_counts)
from ..ilp import candidate_meshes, within_host
from ..plan import LogicalMesh
from ..recompute import recomputed_tensors, replay_reads, selective_nodes
from .layers import (GRAD_BOUNDARY, Layering, assign_layers, crossing_values, entering_values,
                     group_layers, layer_subgraph, saved_for_backward, unmarked_view)
from .options import CHUNKS, PipelineOptions
from .stage_dp import Submesh, submesh_shapes


@dataclass
class LayerProblems:
    """One micro-batch count's layers and layer problems, ready for the DP."""
    B: int
    g: Graph                        # the step traced at micro-batch size
    layering: Layering
    groups: list[tuple[int, int]]   # consecutive layers the stage DP cuts between
    subs: list[Graph]               # one subgraph per layer
    replay_flops: list[float]       # per layer: the FLOPs full recomputation runs again
    grads: frozenset[int]           # parameter gradients (what meshplan.grad marks)
    saved: list[frozenset[int]]     # per layer: what its backward reads
    crossing: list[frozenset[int]]  # per layer: forward values it sends to later layers
    entering: list[frozenset[int]]  # per layer: forward values of other layers it reads
    # per layer: the values selective recomputation makes again in the
    # backward (:mod:`meshplan.recompute`) and what it keeps then (the saved
    # values but those, plus what their replay reads); the FLOPs replayed
    selective: list[tuple[frozenset[int], frozenset[int]]]
    selective_flops: list[float]
    submeshes: list[Submesh]
    meshes_of: list[list[LogicalMesh]]
    max_stages: int | None
    min_stages: int                 # PipeshardParallel(stages=N): exactly N
    budget: float
    p2p_bw: float                   # one device's share of the links between stages (bytes/s)
    p2p_lat: float                  # their latency (s)
    # the links inside a host: where a receiver all-gathers what crossed once
    fast_bw: float
    fast_lat: float
    dispatch_s: float               # launching one compiled program (ClusterSpec achieved)
    dispatch_per_device_s: float    # and per device it runs on
    memory_bw: float                # a device's achieved memory bandwidth (bytes/s)
    accumulate_passes: int          # passes over the gradients per accumulation (cost_model)
    # parameters, optimizer and other state of each layer, unsharded: a stage
    # whose state cannot fit even when split over all its devices is skipped
    # before any ILP is solved
    state_bytes: list[float]
    optimizer_bytes: list[float]      # the optimizer-state part of state_bytes
    # the programs a stage runs: per micro-batch, per step (graph.stage_program_counts)
    programs: tuple[int, int] = TRAIN_PROGRAMS
    # the user fixed the number of stages (stages=N, Manual's pp): near ties of
    # the stage DP go to the more balanced stages (stage_dp's balance)
    exact_stages: bool = False
    # stage counts the groups cannot give equal shares: more stages than
    # groups (a hand plan's 35 of 105 layers), or a count that does not
    # divide them (12 of 16): per count S, S stages on equal submeshes, and
    # their logical meshes (:meth:`many_stage_views`)
    many_stages: tuple[tuple[int, Submesh, tuple[LogicalMesh, ...]], ...] = ()

    def dispatch(self, m: int) -> float:
        """Launching one compiled program on submesh ``m``."""
        return self.dispatch_s + self.submeshes[m].size * self.dispatch_per_device_s

    def buffers(self, first: int, last: int, schedule: str) -> tuple[int, int]:
        """The arrays a stage of layers ``first..last`` takes and makes in its
        programs: (per micro-batch, per step)
        (:func:`meshplan.cost_model.pipeline.layer_buffers`)."""
        per_mb = per_step = 0
        for l in range(first, last + 1):
            roles = [i.role for i in self.subs[l].inputs]
            mb, step = layer_buffers(roles.count(PARAM),
                                     sum(r in (PARAM, OPT_STATE, STATE) for r in roles),
                                     len(self.saved[l]), len(self.crossing[l]),
                                     len(self.entering[l]), schedule)
            per_mb, per_step = per_mb + mb, per_step + step
        return per_mb, per_step

    def request(self, l: int, m: int, k: int) -> tuple:
        """The arguments of :meth:`_Search.layer_cost` for layer ``l`` on mesh ``k`` of submesh ``m``."""
        s = self.submeshes[m]
        return (self.subs[l], self.meshes_of[m][k], (s.hosts, s.devices_per_host),
                self.grads, self.B, self.saved[l], self.crossing[l],
                self.entering[l], self.selective[l])

    def requests(self) -> list[tuple]:
        """Every layer on every mesh its state fits: the stage DP asks for all of them."""
        out = [self.request(l, m, k) for l in range(len(self.subs))
               for m, s in enumerate(self.submeshes) if self.state_bytes[l] / s.size <= self.budget
               for k in range(len(self.meshes_of[m]))]
        for view in self.many_stage_views():
            if view.submeshes[0] not in self.submeshes:
                out += view.requests()
        return out

    def many_stage_views(self) -> list["LayerProblems"]:
        """Per count of :attr:`many_stages` within ``min_stages..max_stages``:
        these problems on that many stages of one submesh, over as many
        groups (above the search's groups: one stage each, the one
        assignment there is) or as many groups a stage (below them: what a
        hand plan of that ``pp`` gets, :func:`layer_problems`)."""
        out = []
        G = len(self.groups)
        for S, sub, meshes in self.many_stages:
            if not self.min_stages <= S <= (self.max_stages or S):
                continue
            out.append(replace(self, groups=group_layers(self.layering.flops,
                                                         equal_groups(S, G)),
                               submeshes=[sub], meshes_of=[list(meshes)],
                               min_stages=S, max_stages=S, many_stages=()))
        return out


@dataclass(frozen=True)
class LayerAnalysis:
    """What the layer problems read of the step alone (no cluster): its
    layers, their subgraphs, what each backward keeps and each layer sends
    on.  Plans of one step on other meshes reuse it (``Session.analyses``)."""
    layering: Layering
    subs: tuple[Graph, ...]
    replay_flops: tuple[float, ...]
    grads: frozenset[int]
    saved: tuple[frozenset[int], ...]
    crossing: tuple[frozenset[int], ...]
    entering: tuple[frozenset[int], ...]
    selective: tuple[tuple[frozenset[int], frozenset[int]], ...]
    selective_flops: tuple[float, ...]
    state_bytes: tuple[float, ...]
    optimizer_bytes: tuple[float, ...]
    wanted: int             # the layers asked for by default
    need: int               # ... and at least
    finer: bool             # too few repeated blocks for ``need``: cut finer

    def serves(self, wanted: int, need: int) -> bool:
        """Is this the analysis :func:`analyse_layers` makes with ``wanted``
        and ``need`` (which decide only clustered layers, or too few blocks)?"""
        if (wanted, need) == (self.wanted, self.need):
            return True
        return (self.layering.fixed_cuts and not self.finer
                and self.layering.num_layers >= need)


def layer_problems(g: Graph, B: int, cluster: ClusterSpec, opts: PipelineOptions,
                   batch_dim: Mapping[int, int] | None = None,
                   analyses: MutableMapping | None = None) -> LayerProblems:
    """``g``: the step at ``B`` micro-batches; ``batch_dim``: its values'
    dimensions holding a micro-batch's rows (graph.batch_dims_between).
    ``analyses``: the session's :class:`LayerAnalysis` by step and layering
    (read and filled; None: made afresh)."""
    # at least as many layers as a fixed number of stages needs
    need = max(opts.fixed[2] if opts.fixed else 1, opts.num_stages or 1)
    if opts.schedules == ("interleaved",):
        # every stage cut into chunks (.interleave); searched beside other
        # schedules, interleaved takes the layers there are
        need *= CHUNKS
    wanted = max(default_layers(g, cluster), need)
    key = None
    if analyses is not None and g.fingerprint:      # (a fingerprint names the content)
        key = (g.fingerprint, opts.num_layers, frozenset(batch_dim.items()) if batch_dim else None,
               g.undonated)
    a = analyses.get(key) if key is not None else None
    if a is None or not a.serves(wanted, need):
        a = analyse_layers(g, wanted, need, opts.num_layers, batch_dim)
        if key is not None:
            analyses[key] = a
    layering = a.layering
    L = layering.num_layers
    if L < need and not any(forward_nodes(g)):
        raise MeshplanError(
            f"{need} pipeline stages cut the step's forward pass, and every output of this step "
            "updates an argument, so nothing marks where its forward ends (the loss, or a "
            "metric of the batch, returned on its own); return one (an evaluation step's "
            "running sum: return the batch's value and add it up outside the step), or plan "
            "one stage")
    if L < need:
        # (no cut of the step makes that many layers: few operations)
        chunks = f" of {CHUNKS} chunks each" if opts.schedules == ("interleaved",) else ""
        stages = need // CHUNKS if chunks else need
        raise MeshplanError(
            f"the step's forward cuts into at most {L} layer(s), too few for {stages} pipeline "
            f"stages{chunks}: ask for {L // CHUNKS if chunks else L} stages or fewer, or let the "
            "search choose the count")
    # the stage DP cuts between groups of consecutive layers (repeated blocks
    # make many small layers; each kind is costed once, and a stage's cost is
    # the sum of its layers' costs)
    n_groups = max(wanted, min(L, 16)) if opts.num_layers is None else L
    if opts.num_layers is None and need > 1 and n_groups < L:
        # a fixed number of stages over merged layers (need <= n_groups)
        n_groups = equal_groups(need, n_groups)
    if opts.equal_layers:
        if not opts.num_stages or L < opts.num_stages:
            raise MeshplanError("equal_layers needs a number of stages of at most the layers")
        S = opts.num_stages
        n_groups = S * (min(n_groups, L) // S)
    many: tuple = ()
    if opts.fixed is not None:
        dp, tp, pp = opts.fixed
        submeshes = [fixed_submesh(cluster, dp * tp)]
        max_stages = pp
    elif opts.mesh_shape is not None:       # one stage on every device
        submeshes = [fixed_submesh(cluster, cluster.num_devices)]
        max_stages = 1
    else:
        # whole hosts: powers of two, and the divisors of the host count (so
        # that equal stages can cover every host)
        submeshes = [s for s in submesh_shapes(cluster.num_hosts, cluster.devices_per_host)
                     if s.hosts & (s.hosts - 1) == 0 or cluster.num_hosts % s.hosts == 0]
        max_stages = opts.num_stages or opts.max_stages
        if opts.num_stages is None and not opts.equal_layers and opts.num_layers is None:
            many = tuple((S, sub, tuple(stage_meshes(cluster, sub, None, opts.data_parallel_stages,
                                                     opts.tp_within_host)))
                         for S, sub in _many_stages(cluster, L, n_groups, max_stages))
    if opts.num_stages and opts.fixed is None:
        _check_coverable(opts.num_stages, [s.size for s in submeshes],
                         {S for S, _, _ in many}, cluster)
    return LayerProblems(
        B=B, g=g, layering=layering, groups=group_layers(layering.flops, n_groups),
        subs=list(a.subs), replay_flops=list(a.replay_flops), grads=a.grads, saved=list(a.saved),
        crossing=list(a.crossing), entering=list(a.entering), selective=list(a.selective),
        selective_flops=list(a.selective_flops),
        submeshes=submeshes,
        meshes_of=[given_meshes(cluster, s, opts.mesh_shape, opts.axis_names)
                   if opts.mesh_shape is not None else
                   stage_meshes(cluster, s, opts.fixed, opts.data_parallel_stages,
                                opts.tp_within_host) for s in submeshes],
        max_stages=max_stages, min_stages=(opts.num_stages or 1) if opts.fixed is None else 1,
        budget=cluster.device.memory_bytes * opts.memory_fraction,
        p2p_bw=(cluster.inter_host.achieved_bandwidth / cluster.devices_per_host
                if cluster.num_hosts > 1 else cluster.intra_host.achieved_bandwidth),
        # inside one host the send stays priced by bandwidth alone, as before:
        # the link is the gather's own, so sending once saves nothing there,
        # and its microseconds of latency would only tip the cut of tiny models
        p2p_lat=cluster.inter_host.latency_s if cluster.num_hosts > 1 else 0.0,
        fast_bw=cluster.intra_host.achieved_bandwidth,
        fast_lat=cluster.intra_host.latency_s if cluster.num_hosts > 1 else 0.0,
        dispatch_s=cluster.device.achieved.program_dispatch_s,
        dispatch_per_device_s=cluster.device.achieved.dispatch_per_device_s,
        memory_bw=(cluster.device.memory_bandwidth_bytes_per_s
                   * cluster.device.achieved.memory_efficiency),
        accumulate_passes=3 if is_cpu(cluster.device) else 1,
        state_bytes=list(a.state_bytes), optimizer_bytes=list(a.optimizer_bytes),
        programs=stage_program_counts(g),
        exact_stages=opts.num_stages is not None or opts.fixed is not None,
        many_stages=many)


def analyse_layers(g: Graph, wanted: int, need: int, num_layers: int | None,
                   batch_dim: Mapping[int, int] | None) -> LayerAnalysis:
    """``g`` cut into layers (``wanted`` by default, at least ``need``, or
    the ``num_layers`` asked for) and what each layer's problem reads."""
    layering = assign_layers(g, num_layers, default_layers=wanted)
    finer = layering.num_layers < need and num_layers is None
    if finer:
        # fewer repeated blocks than the stages asked for: finer layers
        layering = assign_layers(g, need)
    L = layering.num_layers
    view = unmarked_view(g, layering)
    subs = [layer_subgraph(g, layering, l, l, view, batch_dim) for l in range(L)]
    region = selective_nodes(view.graph, view.forward)
    again = recomputed_tensors(view.graph, view.forward, region)
    # what each backward reads, then what it keeps once XLA has fused it
    read = saved_for_backward(g, layering, view)
    saved = [kept_after_fusion(view.graph, view.forward, r, members)
             for members, r in zip(view.members, read)]
    # what full recomputation runs again: the makers of what each backward
    # reads (the solver's LayerCost prices the same operators)
    replay_flops = [sum(arithmetic_flops(view.graph.nodes[nid])
                        for nid in ancestor_nodes(view.graph, kept, among=members))
                    for members, kept in zip(view.members, saved)]
    selective = []
    for members, r, kept in zip(view.members, read, saved):
        mine = frozenset(t for nid in members for t in view.graph.nodes[nid].outputs if t in again)
        if not mine:
            selective.append((mine, kept))
            continue
        reads = replay_reads(view.graph, view.forward, mine, members)
        selective.append((mine, kept_after_fusion(view.graph, view.forward,
                                                  (r - mine) | reads, members)))
    selective_flops = [sum(view.graph.nodes[nid].flops for nid in members
                           if all(t in again for t in view.graph.nodes[nid].outputs))
                       for members in view.members]
    return LayerAnalysis(
        layering=layering, subs=tuple(subs), replay_flops=tuple(replay_flops),
        grads=_gradients(g, layering), saved=tuple(saved),
        crossing=tuple(crossing_values(g, layering, subs, view)),
        entering=tuple(entering_values(g, layering, subs, view)),
        selective=tuple(selective), selective_flops=tuple(selective_flops),
        state_bytes=tuple(sum(t.nbytes for t in (sub.tensors[i.tensor] for i in sub.inputs
                                                 if i.role in (PARAM, OPT_STATE, STATE)))
                          for sub in subs),
        optimizer_bytes=tuple(sum(sub.tensors[i.tensor].nbytes for i in sub.inputs
                                  if i.role == OPT_STATE) for sub in subs),
        wanted=wanted, need=need, finer=finer)

def equal_groups(stages: int, groups: int) -> int:
    """How many layer groups ``stages`` equal stages are cut from, given
    ``groups`` at most: one each where there are more stages than groups,
    else as many each (12 stages over 16 groups of a 96-block model gave
    four stages 12 blocks and the rest 6; over 12 groups, 8 each)."""
    return stages if stages > groups else stages * (groups // stages)


def _many_stages(cluster: ClusterSpec, L: int, n_groups: int, max_stages: int | None
                 ) -> list[tuple[int, Submesh]]:
    """The stage counts (up to the ``L`` layers) that split the devices into
    equal stages of whole hosts or of pieces that tile a host, as a hand
    plan's ``pp`` does, each with its stages' submesh: those above
    ``n_groups``, and those below it that do not divide it (the DP over
    ``n_groups`` groups cannot give them equal shares)."""
    D, dph = cluster.num_devices, cluster.devices_per_host
    out = []
    for S in range(2, min(L, D, max_stages or L) + 1):
        if S <= n_groups and (n_groups % S == 0 or n_groups >= L):
            continue        # (the search's own DP has equal shares for these)
        n = D // S
        if D % S == 0 and (dph % n == 0 or n % dph == 0):
            out.append((S, Submesh(1, n) if n <= dph else Submesh(n // dph, dph)))
    return out


def default_layers(g: Graph, cluster: ClusterSpec) -> int:
    return max(2, min(16, cluster.num_devices, len(g.nodes) // 50 or 2))


def _check_coverable(stages: int, sizes: list[int], equal: set[int], cluster: ClusterSpec
                     ) -> None:
    """Refuse a number of ``stages`` that no stages of these ``sizes`` (or
    the ``equal`` stage counts of equal submeshes) cover the devices with."""
    sizes = sorted(set(sizes))
    counts = _covering_counts(sizes, cluster.num_devices, 2 * stages + 2) | equal
    if stages not in counts:
        near = sorted(counts, key=lambda c: (abs(c - stages), c))[:2]
        raise MeshplanError(
            f"no {stages} pipeline stages cover the {cluster.num_devices} devices: a stage is "
            f"{', '.join(map(str, sizes))} devices (a divisor of a host's "
            f"{cluster.devices_per_host}, or whole hosts); ask for "
            f"{' or '.join(map(str, sorted(near)))} stages")


def _covering_counts(sizes: list[int], total: int, most: int) -> set[int]:
    """The numbers of stages, up to ``most``, of these ``sizes`` (each any
    number of times) whose devices add up to ``total``."""
    counts, reach = set(), 1            # (bit d: d devices covered by c stages)
    for c in range(1, most + 1):
        reach = functools.reduce(operator.or_, (reach << s for s in sizes), 0) \
            & ((1 << (total + 1)) - 1)
        if reach >> total & 1:
            counts.add(c)
    return counts


def fixed_submesh(cluster: ClusterSpec, n: int) -> Submesh:
    dph = cluster.devices_per_host
    if n <= dph and dph % n == 0:
        return Submesh(1, n)
    if n % dph:
        # (stages of the same size fill the hosts one after another: one of
        # them would straddle two hosts)
        raise MeshplanError(f"a stage of {n} devices neither divides a host of {dph} devices "
                            f"nor is whole hosts: give stages (dp x tp) of a divisor or a "
                            f"multiple of {dph} devices")
    return Submesh(n // dph, dph)


def given_meshes(cluster: ClusterSpec, sub: Submesh, shape: tuple[int, ...],
                 names: tuple[str, ...] | None) -> list[LogicalMesh]:
    """The logical mesh ``shape`` a request fixes, laid over a TPU torus in
    every order worth trying (one mesh elsewhere)."""
    names = tuple(names) if names else default_axis_names(len(shape))
    return [LogicalMesh(names, tuple(shape), order)
            for order in torus_orders(cluster, (sub.hosts, sub.devices_per_host))]


def stage_meshes(cluster: ClusterSpec, sub: Submesh, fixed, data_only: bool = False,
                 tp_within_host: bool = False) -> list[LogicalMesh]:
    n = sub.size
    if data_only:
        return [LogicalMesh(("data",), (n,))]
    if fixed is not None:
        dp, tp, _ = fixed
        return [LogicalMesh(("data", "model"), (dp, tp))]
    meshes = candidate_meshes(n, 2, cluster=cluster, submesh=(sub.hosts, sub.devices_per_host))
    if sub.hosts > 1:   # keep the fast axis inside a host (one axis may cross hosts)
        meshes = [m for m in meshes if len(m.shape) == 1 or m.shape[-1] <= sub.devices_per_host]
    if tp_within_host:
        meshes = within_host(meshes, sub.hosts, sub.devices_per_host)
    return meshes


def _gradients(g: Graph, layering: Layering) -> frozenset[int]:
    """What the layer ILPs may sum over the micro-batches and reduce once a
    step: the parameter gradients, and the contributions of several layers
    to one gradient, which the runtime sums once a step
    (:mod:`meshplan.contributions`)."""
    marked = frozenset(t for n in g.nodes if n.primitive == GRAD_BOUNDARY for t in n.inputs)
    _, contributions = once_a_step(graph_ops(g), layering.layer_of_node, GRAD_BOUNDARY,
                                  g.consumers)
    return marked | contributions
