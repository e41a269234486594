"""Offloading optimizer state to host memory (one-stage plans).

The optimizer state (inputs whose role is ``opt_state``) lives in host
memory between steps; each step reads it to the device before the update and
writes the new state back after it (``meshplan.runtime.shard`` gives those
leaves ``memory_kind="pinned_host"`` shardings).  The planner counts that:

* memory: the state's bytes per device leave the device's working set of
  the forward and backward: the ILP's memory rows leave those inputs out
  (``host_inputs``), and that peak is the ILP's less the state's bytes per
  device in the layout chosen.  The update reads the state back on the
  device: one more row (``mem_update``) bounds every input plus a gradient
  per parameter (laid out as the parameter: an estimate) by the same budget,
  and the plan's peak is the larger of the two points.  (XLA may bring the
  leaves in one at a time; nothing makes it, so the planner does not count on it);
* time: each leaf crosses the cluster's host link twice per step (read
  before the update, written after), on the critical path: the update needs
  the state it reads, and the next step needs the state written back.

A cluster whose host link says ``separate_memory: false`` (XLA's CPU
devices) keeps its "host" memory in the same RAM: the copies are priced,
nothing is freed.  A cluster without a host link cannot plan offloading.
"""
from __future__ import annotations

from dataclasses import replace

from .cluster import ClusterSpec
from .layout_moves import num_shards, spec_from_names
from .errors import InfeasiblePlanError, MeshplanError
from .graph import BATCH, OPT_STATE, PARAM, Graph
from .plan import MemoryBreakdown, Plan, PlanPredicted
from .units import human_bytes, human_time


def check_offload(graph: Graph, cluster: ClusterSpec) -> None:
    """Refuse to plan offloading on a cluster that does not describe its host
    link, or for a step without optimizer state."""
    if cluster.host_link is None:
        raise MeshplanError(
            f"cluster {cluster.name!r} gives no host link ($.links.host_device: bandwidth and "
            "latency between each device and host memory), so offloading to host memory "
            "cannot be priced; add one to the cluster file or plan with offload='none'")
    if not any(i.role == OPT_STATE for i in graph.inputs):
        raise MeshplanError(f"offload='optimizer': {graph.name or 'the step'} has no optimizer "
                            "state among its arguments (leaves whose path names opt_state, mu, "
                            "nu, moments); plan with offload='none'")


def frees_memory(cluster: ClusterSpec) -> bool:
    """Whether moving state to host memory frees device memory on ``cluster``."""
    return cluster.host_link is not None and cluster.host_link.separate_memory


def offloaded_bytes(graph: Graph) -> float:
    """The optimizer state's bytes (unsplit): what offloading moves out."""
    return float(sum(graph.tensors[i.tensor].nbytes for i in graph.inputs
                     if i.role == OPT_STATE))


def host_inputs(graph: Graph, cluster: ClusterSpec) -> frozenset[int]:
    """The inputs (indices into ``graph.inputs``) the ILP leaves out of the
    device's memory when the optimizer state is offloaded: none where host
    memory is device memory."""
    if not frees_memory(cluster):
        return frozenset()
    return frozenset(k for k, i in enumerate(graph.inputs) if i.role == OPT_STATE)


def with_offload(plan: Plan, graph: Graph, cluster: ClusterSpec, prefixes: dict[int, str]
                 ) -> Plan:
    """The one-stage ``plan`` (its ILP solved with :func:`host_inputs` left out)
    with its optimizer state in host memory: the leaves named, the moves
    priced, the state's bytes taken out of the device's peak.  ``prefixes``:
    the key prefix of each argument (as the plan's ``params`` keys go)."""
    check_offload(graph, cluster)
    link = cluster.host_link
    (stage,) = plan.stages
    mesh = stage.logical_mesh
    specs = dict(stage.params)
    host_inputs = [k for k, i in enumerate(graph.inputs) if i.role == OPT_STATE]
    keys, local, moves = [], 0.0, 0.0
    for k in host_inputs:
        inp = graph.inputs[k]
        key = prefixes.get(inp.argnum, "") + inp.path
        keys.append(key)
        spec = specs.get(key, ())
        nbytes = graph.tensors[inp.tensor].nbytes / num_shards(
            spec_from_names(spec, mesh.axes), mesh.shape)
        local += nbytes
        moves += 2 * link.transfer_s(nbytes)        # read before the update, written after
    outputs = dict(stage.outputs)
    host_outputs = []
    for o in graph.outputs:
        if o.updates in host_inputs:
            host_outputs.append(o.path)
            # the new state goes back where the old one came from
            outputs.setdefault(o.path, specs.get(keys[host_inputs.index(o.updates)], ()))
    pr = stage.predicted
    memory = pr.memory
    peak = pr.memory_bytes
    if frees_memory(cluster):
        peak = int(pr.memory_bytes - local)
        if memory is not None:
            memory = replace(memory, optimizer=0, offloaded=int(local),
                             temporaries=memory.temporaries + memory.optimizer - int(local))
        update = _update_point(graph, plan, prefixes)
        if update.total > peak:     # (the ILP's mem_update row kept it in the budget)
            peak, memory = update.total, replace(update, offloaded=int(local))
    stage = replace(stage, offload="optimizer", host_params=tuple(keys),
                    host_outputs=tuple(host_outputs), outputs=tuple(sorted(outputs.items())),
                    predicted=replace(pr, memory_bytes=peak, memory=memory,
                                      host_transfer_s=moves))
    it = plan.predicted.iteration_s + moves
    scale = plan.predicted.iteration_s / it if it > 0 else 0.0
    predicted = PlanPredicted(iteration_s=it,
                              tflops_per_device=plan.predicted.tflops_per_device * scale,
                              peak_memory_bytes=peak,
                              comm_bytes_per_device=plan.predicted.comm_bytes_per_device,
                              hardware_tflops_per_device=(
                                  plan.predicted.hardware_tflops_per_device * scale))
    note = (f"optimizer state offloaded to host memory: {human_bytes(local)} per device, "
            f"{human_time(moves)} per step over the host link"
            + ("" if frees_memory(cluster) else
               " (host memory is device memory on this cluster: nothing is freed)"))
    return replace(plan, stages=(stage,), predicted=predicted, notes=plan.notes + (note,))


def _update_point(graph: Graph, plan: Plan, prefixes: dict[int, str]) -> MemoryBreakdown:
    """The device's memory while the update runs: the offloaded state back on
    the device beside every other input and a gradient per parameter (laid
    out as its parameter), as the ILP's ``mem_update`` row counts it."""
    mesh = plan.stages[0].logical_mesh
    params, batch = dict(plan.stages[0].params), dict(plan.batch)
    parts = {"params": 0.0, "grads": 0.0, "optimizer": 0.0, "activations": 0.0}
    for inp in graph.inputs:
        # (batch arguments are keyed in a section of their own)
        table = batch if inp.argnum in plan.batch_argnums else params
        spec = table.get(prefixes.get(inp.argnum, "") + inp.path, ())
        nbytes = graph.tensors[inp.tensor].nbytes / num_shards(
            spec_from_names(spec, mesh.axes), mesh.shape)
        part = {OPT_STATE: "optimizer", BATCH: "activations"}.get(inp.role, "params")
        parts[part] += nbytes
        if inp.role == PARAM:
            parts["grads"] += nbytes
    return MemoryBreakdown.of(sum(int(v) for v in parts.values()), **parts)


def not_fitting(err: InfeasiblePlanError, cluster: ClusterSpec) -> InfeasiblePlanError:
    """``err`` (the plan without offloading) saying offloading did not help
    either; as it is where it is no shortage of memory (a batch that does not
    split over the devices)."""
    if err.budget_bytes is None:
        return err
    return InfeasiblePlanError(f"{err} (offloading the optimizer state to host memory over "
                               f"{cluster.name}'s host link does not make it fit either)",
                               budget_bytes=err.budget_bytes, needed_bytes=err.needed_bytes)

