"""Plans from the passes' answers: a one-stage plan from the whole-graph ILP,
a pipeline plan from the stage DP's choice.  Parameters and batch pieces are
keyed by their argument's section prefix and ``keystr`` path (DESIGN.md)."""
from __future__ import annotations

from typing import Any

from ..cluster import ClusterSpec
from ..cost_model.mesh import default_submesh
from ..cost_model.torus import device_order
from ..layout_moves import spec_from_names
from ..cost_model.overlap import Backward, StageWork, hidden_s
from ..graph import BATCH, OPT_STATE, PARAM, STATE, Graph, forward_nodes
from ..ilp import peak_parts
from ..ilp.replicated import Unsplit, replicated_note
from ..plan import MemoryBreakdown, Plan, PlanPredicted, Predicted, Stage, section_prefixes
from ..recompute import SELECTIVE
from .interleave import group_memory
from .layers import BOUNDARY, canonical_tensors
from .problem import LayerProblems
from .stages import PipelineChoice, StageCosts, place_stages
from .zero_bubble import ZB_H1


def graph_prefixes(graph: Graph) -> tuple[tuple[int, str], ...]:
    """The key prefix of each argument of ``graph`` (:func:`meshplan.plan.section_prefixes`)."""
    return section_prefixes({i.argnum for i in graph.inputs} | set(graph.batch_argnums),
                            graph.batch_argnums)


def argument_table(graph: Graph) -> tuple[tuple[str, str], ...]:
    """``Plan.arguments`` of a plan of ``graph``: each argument leaf, by its
    position and path, and its dtype and shape, e.g.
    ``("argument 1['x']", "float32[16,4]")``."""
    out = []
    for i in graph.inputs:
        t = graph.tensors[i.tensor]
        out.append((f"argument {i.argnum}{i.path}",
                    f"{t.dtype}[{','.join(str(d) for d in t.shape)}]"))
    return tuple(out)


def plan_from_intra_op(graph: Graph, cluster: ClusterSpec, result: Any, method: str,
                       notes: tuple[str, ...] = ()) -> Plan:
    """A one-stage Plan from the ILP's answer."""
    prefixes = dict(graph_prefixes(graph))
    params, batch = [], []
    for inp, spec in zip(graph.inputs, result.input_specs):
        key = prefixes.get(inp.argnum, "") + inp.path
        (batch if inp.argnum in graph.batch_argnums else params).append((key, spec))
    outputs = tuple((o.path, s) for o, s in zip(graph.outputs, result.output_specs) if s is not None)
    n = result.mesh.size
    stage = Stage(layers=(0, 0), devices=device_order(cluster, tuple(range(n)), result.mesh),
                  submesh=default_submesh(cluster, n),
                  logical_mesh=result.mesh, remat=False, params=tuple(params),
                  predicted=Predicted(result.compute_s, result.comm_s, int(result.peak_memory_bytes),
                                      one_stage_memory(graph, result)),
                  outputs=outputs, constraints=result.constraints, strategies=result.strategies,
                  read_constraints=tuple(getattr(result, "read_constraints", ())))
    it = one_stage_seconds(graph, cluster, result)
    tflops = graph.total_flops / n / it / 1e12 if it > 0 else 0.0
    predicted = PlanPredicted(iteration_s=it, tflops_per_device=tflops,
                              peak_memory_bytes=int(result.peak_memory_bytes),
                              comm_bytes_per_device=int(round(result.comm_bytes)),
                              hardware_tflops_per_device=tflops)
    return Plan(graph_fingerprint=graph.fingerprint, cluster=cluster, method=method,
                stages=(stage,), num_micro_batches=1, schedule="none", batch=tuple(batch),
                predicted=predicted, function=graph.name, batch_argnums=graph.batch_argnums,
                arg_prefixes=graph_prefixes(graph), notes=notes)


def one_stage_seconds(graph: Graph, cluster: ClusterSpec, result: Any) -> float:
    """The predicted iteration of a one-stage plan from the ILP's answer:
    one program per iteration, less what runs under compute."""
    return (result.compute_s + result.comm_s + cluster.device.achieved.dispatch_s(result.mesh.size)
            - hidden_s(one_stage_work(graph, result), cluster.device.achieved.overlap_communication))


def one_stage_work(graph: Graph, result: Any) -> StageWork:
    """The whole-graph ILP's answer as cost_model.overlap takes it: its
    gradient reductions, the forward (by its share of the FLOPs) left out of
    the compute that can hide them."""
    steps = list(result.grad_steps)
    if steps:
        fwd = forward_nodes(graph)
        share = sum(n.flops for n in graph.nodes if fwd[n.id]) / (graph.total_flops or 1.0)
        steps[0] = (max(steps[0][0] - result.compute_s * min(share, 1.0), 0.0), steps[0][1])
    return StageWork(result.compute_s, result.comm_s, backward=Backward.of_steps(steps))


def one_stage_memory(graph: Graph, result: Any) -> MemoryBreakdown:
    """What the whole-graph ILP's peak memory holds per device: the inputs
    by role in their chosen layouts, and the intermediates live at the peak
    (:func:`meshplan.ilp.peak_parts`); the rest counts as temporaries."""
    axes = result.mesh.axes
    names = {i.tensor: s for i, s in zip(graph.inputs, result.input_specs)} | dict(result.constraints)
    _, parts = peak_parts(graph, result.mesh.shape,
                          {t: spec_from_names(s, axes) for t, s in names.items()})
    inp = {k.removeprefix("input:"): v for k, v in parts.items() if k.startswith("input:")}
    return MemoryBreakdown.of(result.peak_memory_bytes,
                              params=inp.get(PARAM, 0.0) + inp.get(STATE, 0.0),
                              optimizer=inp.get(OPT_STATE, 0.0), grads=parts["grads"],
                              activations=inp.get(BATCH, 0.0) + parts["forward"])


def pipeline_plan(full: Graph, lay: LayerProblems, choice: PipelineChoice, costs: StageCosts,
                  cluster: ClusterSpec, method: str) -> Plan:
    """The Plan of the stage DP's ``choice`` (``full``: the step at full batch)."""
    g, layering, subs, submeshes, meshes_of = lay.g, lay.layering, lay.subs, lay.submeshes, \
        lay.meshes_of
    res, schedule, B, total = choice.dp, choice.schedule, lay.B, choice.total_s
    pre = dict(graph_prefixes(full))
    n_stages = len(res.stages)
    # interleaved: virtual stage k on the devices of group k % p
    p = n_stages // choice.chunks
    placements = place_stages(submeshes, res.stages[:p], cluster)
    placements = [placements[k % p] for k in range(n_stages)]
    stages, batch_specs = [], {}
    unsplit: list[Unsplit] = []     # per stage (ilp.replicated)
    recomputed = 0.0     # FLOPs run again by recomputing stages
    peak_mem = 0
    comm_bytes = 0.0
    for k, (st, devices, opt) in enumerate(zip(res.stages, placements, choice.chosen())):
        remat, mem, mesh_k = opt.remat, opt.memory_bytes, opt.mesh
        upto = st.first + opt.recompute_layers if opt.recompute_layers else st.last + 1
        if opt.recompute == SELECTIVE:
            recomputed += B * sum(lay.selective_flops[st.first:st.last + 1])
        elif remat:
            recomputed += B * sum(lay.replay_flops[st.first:upto])
        mesh = meshes_of[st.submesh][mesh_k]
        params: dict[str, tuple] = {}
        # the layers' planned layouts, keyed by tensor ids of the step traced
        # at micro-batch size (what the pipeline runtime replays): the
        # intermediates, and the activations / batch pieces entering a layer
        constraints: dict[int, tuple] = {}
        reads: dict[tuple[int, int], tuple] = {}
        compute = comm = cbytes = 0.0
        unsplit.append(Unsplit())
        for l in range(st.first, st.last + 1):
            lc = costs.member(l, st.last, st.submesh, mesh_k, opt.tighten)
            compute += lc.compute_s
            unsplit[-1] += lc.unsplit
            if not opt.keep_casts:      # (GroupCost.casting_each)
                again = not opt.recompute_layers or l < st.first + opt.recompute_layers
                compute += (1 + again) * lc.cast_s - lc.cast_s / B
            comm += lc.comm_s
            cbytes += lc.comm_bytes
            # (what the stage's programs run: a recomputed forward too)
            if opt.recompute == SELECTIVE:
                compute += lc.selective_s
            elif remat and l < upto:
                compute += lc.replay_compute_s
                comm += lc.replay_comm_s
                cbytes += lc.replay_comm_bytes
            # (the result may come from a structurally equal layer: its ids)
            ids = dict(zip(lc.tensors, canonical_tensors(subs[l])))
            for t, spec in lc.result.constraints:
                constraints.setdefault(ids.get(t, t), spec)
            for t, pos, spec in lc.result.read_constraints:
                reads.setdefault((ids.get(t, t), pos), spec)
            for inp, spec in zip(subs[l].inputs, lc.result.input_specs):
                if inp.role in (BOUNDARY, BATCH) and g.tensors[inp.tensor].shape:
                    made = constraints.setdefault(inp.tensor, spec)
                    if made != spec:
                        # made in an earlier layer of this stage in another
                        # layout: this layer's readers take it as priced
                        _read_as(subs[l], inp.tensor, spec, reads)
                if inp.role == BOUNDARY:
                    continue
                key = pre.get(inp.argnum, "") + inp.path
                if inp.role == BATCH:
                    batch_specs.setdefault(key, spec)
                else:
                    params.setdefault(key, spec)
        joint_s, joint_bytes = costs.joint(st.first, st.last, st.submesh, mesh_k, opt.tighten)
        lost_s, lost_bytes = costs.undeferred(st.first, st.last, st.submesh, mesh_k, opt.tighten,
                                              every=schedule == ZB_H1)
        comm, cbytes = comm + joint_s + lost_s, cbytes + joint_bytes + lost_bytes
        deferred = costs.deferred_axes(st.first, st.last, st.submesh, mesh_k, opt.tighten,
                                       every=schedule == ZB_H1)
        sub = submeshes[st.submesh]
        # (the new value of an updated argument leaf keeps its layout, as the
        # whole-graph ILP's plans record it: a plain jit of the plan needs it)
        outputs = {}
        for o in full.outputs:
            if o.updates is not None:
                leaf = full.inputs[o.updates]
                spec = params.get(pre.get(leaf.argnum, "") + leaf.path)
                if spec is not None:
                    outputs[o.path] = spec
        stages.append(Stage(layers=(st.first, st.last),
                            devices=device_order(cluster, devices, mesh),
                            submesh=(sub.hosts, sub.devices_per_host), logical_mesh=mesh,
                            remat=remat, recompute=opt.recompute,
                            recompute_layers=opt.recompute_layers, keep_casts=opt.keep_casts,
                            params=tuple(sorted(params.items())),
                            outputs=tuple(sorted(outputs.items())),
                            predicted=Predicted(compute, comm, int(mem), opt.memory, opt.latency_s,
                                                int(round(cbytes * B))),
                            constraints=tuple(sorted(constraints.items())),
                            read_constraints=tuple((t, q, sp) for (t, q), sp in sorted(reads.items())),
                            device_group=k % p if choice.chunks > 1 else -1,
                            deferred_axes=tuple(mesh.axes[a] for a in deferred) if B > 1
                            else None))
        peak_mem = max(peak_mem, int(mem))
        comm_bytes = max(comm_bytes, cbytes * B)
    if choice.chunks > 1:       # a device group holds all its chunks
        peak_mem = int(max(group_memory(choice.chosen(), p)))
    per_s = 1 / (cluster.num_devices * total * 1e12) if total > 0 else 0.0
    tflops = full.total_flops * per_s
    return Plan(graph_fingerprint=full.fingerprint, cluster=cluster, method=method,
                stages=tuple(stages), num_micro_batches=B,
                schedule=schedule if n_stages > 1 or B > 1 else "none",
                batch=tuple(sorted(batch_specs.items())),
                predicted=PlanPredicted(total, tflops, peak_mem, int(comm_bytes),
                                        (full.total_flops + recomputed) * per_s,
                                        choice.host_s),
                function=full.name, batch_argnums=full.batch_argnums,
                arg_prefixes=tuple(sorted(pre.items())),
                notes=(f"{layering.num_layers} layers "
                       f"({'user marks' if layering.marked else 'clustered'})",)
                + tuple(n for n in (replicated_note(unsplit),) if n),
                layer_of_node=layering.layer_of_node if n_stages > 1 or B > 1 else (),
                programs=lay.programs)


def _read_as(layer: Graph, tensor: int, spec: tuple, reads: dict[tuple[int, int], tuple]) -> None:
    """Every reader of ``tensor`` in ``layer`` takes it in ``spec``: the layer
    boundary's resharding, which the stage DP priced from the producing
    layer's layout (without it XLA's propagation picks its own way)."""
    for n in layer.nodes:
        if n.outputs:
            for pos, t in enumerate(n.inputs):
                if t == tensor:
                    reads.setdefault((n.outputs[0], pos), spec)
