"""The public API: ``meshplan.plan`` and ``meshplan.parallelize``.

This module sits on top of every pass: it traces, asks the ILP (and the
inter-operator pass) for a plan, turns the answer into a :class:`Plan`, and
hands the plan to the runtime.
"""
from __future__ import annotations

import functools
import math
from dataclasses import replace
from typing import Any, Callable, Sequence

import jax

from .cluster import ClusterSpec
from .errors import InfeasiblePlanError, MeshplanError, StalePlanError
from .graph import BATCH, Graph, strip_markers
from .methods import Auto, DataParallel, Manual, Method, PipeshardParallel, ShardParallel
from . import progress
from .plan import (LogicalMesh, Plan, PlanPredicted, Predicted, Stage, arg_prefixes)
from .trace import trace, trace_for_run
from .traced import TracedStep
from .unstack import Unstacked, layer_counts, unstack_scanned_layers


# --------------------------------------------------------------------------
# planning
# --------------------------------------------------------------------------

def plan(fn: Callable, *args: Any, cluster: ClusterSpec | None = None,
         method: Method | None = None, batch_argnums: Sequence[int] = (1,)) -> Plan:
    """Plan ``fn(*args)`` for ``cluster`` (default: the local devices).
    ``args`` may be concrete arrays or ``jax.ShapeDtypeStruct`` pytrees."""
    cluster = cluster or ClusterSpec.local()
    name = getattr(fn, "__name__", "fn")
    graph, step, abstract, unstacked = trace_step(fn, _abstract(args), tuple(batch_argnums), name)
    p = plan_graph(graph, cluster, method or ShardParallel(),
                   retrace=retracer(step, abstract, tuple(batch_argnums), name))
    return with_note(p, unstacked)


def trace_step(fn: Callable, abstract: Sequence[Any], batch_argnums: tuple[int, ...], name: str
               ) -> tuple[Graph, Callable, tuple[Any, ...], Unstacked | None]:
    """Trace ``fn`` for planning: ``(graph, step, step_args, unstacked)``.

    When a ``lax.scan`` iterates over stacked parameters, the step planned
    (and run) is its rewrite with one input per layer (:mod:`meshplan.unstack`):
    ``step``/``step_args`` are then the rewritten step and its arguments."""
    with progress.step(f"tracing {name}"):
        graph = trace(fn, *abstract, batch_argnums=batch_argnums, name=name)
    unstacked = unstack_scanned_layers(graph, fn, abstract)
    if unstacked is None:
        return graph, fn, tuple(abstract), None
    step_args = unstacked.split(abstract)
    with progress.step(f"unrolling the lax.scan over {layer_counts(unstacked.shapes)} "
                       "stacked layers"):
        graph = trace(unstacked.fn, *step_args, batch_argnums=batch_argnums, name=name)
    return graph, unstacked.fn, step_args, unstacked


def with_note(p: Plan, unstacked: Unstacked | None) -> Plan:
    """``p`` noting the scan rewrite, if any."""
    if unstacked is None or unstacked.note in p.notes:
        return p
    return replace(p, notes=p.notes + (unstacked.note,))


def retracer(fn: Callable, abstract: Sequence[Any], batch_argnums: tuple[int, ...],
             name: str) -> Callable[[int], Graph]:
    """``retrace(B)``: the step traced with its batch split into ``B`` micro-batches."""
    def shrink(x: Any, B: int) -> Any:
        if not getattr(x, "shape", ()):
            return x
        return jax.ShapeDtypeStruct((x.shape[0] // B,) + tuple(x.shape[1:]), x.dtype)

    def retrace(B: int) -> Graph:
        args = list(abstract)
        for a in batch_argnums:
            args[a] = jax.tree.map(lambda x: shrink(x, B), args[a])
        return trace(fn, *args, batch_argnums=batch_argnums, name=name)
    return retrace


def plan_graph(graph: Graph, cluster: ClusterSpec, method: Method, *,
               retrace: Callable[[int], Graph] | None = None) -> Plan:
    """Plan an already traced graph (the CLI's entry point).  ``retrace(B)``
    lets the pipeline search re-trace the step for B micro-batches."""
    if isinstance(method, Manual):
        used = method.dp * method.tp * method.pp
        if used != cluster.num_devices:
            raise MeshplanError(f"Manual(dp={method.dp}, tp={method.tp}, pp={method.pp}) uses "
                                f"{used} devices but the cluster has {cluster.num_devices}")
    if isinstance(method, (Auto, PipeshardParallel)) or (
            isinstance(method, Manual) and (method.pp > 1 or method.num_micro_batches > 1
                                            or method.remat)):
        return _plan_pipeline(graph, cluster, method, retrace)
    graph = strip_markers(graph)
    if isinstance(method, ShardParallel):
        return _plan_shard(graph, cluster, method)
    if isinstance(method, DataParallel):
        return _plan_data(graph, cluster, method)
    if isinstance(method, Manual):
        return _plan_manual(graph, cluster, method)
    raise MeshplanError(f"unknown method {method!r}: use meshplan.Auto(), ShardParallel(), "
                        "PipeshardParallel(), DataParallel() or Manual(dp=, tp=, pp=)")


def _plan_shard(graph: Graph, cluster: ClusterSpec, method: ShardParallel) -> Plan:
    from meshplan.ilp import best_intra_op, candidate_meshes
    meshes = None
    if method.mesh_shape is not None:
        shape = tuple(int(s) for s in method.mesh_shape)
        if math.prod(shape) != cluster.num_devices:
            raise MeshplanError(f"ShardParallel(mesh_shape={shape}) has {math.prod(shape)} devices "
                                f"but the cluster has {cluster.num_devices}")
        names = method.axis_names or _default_names(len(shape))
        meshes = [LogicalMesh(tuple(names), shape)]
    best, _ = best_intra_op(graph, cluster, meshes=meshes, backend=method.backend,
                            time_limit=method.time_limit)
    return plan_from_intra_op(graph, cluster, best, "shard")


def _plan_data(graph: Graph, cluster: ClusterSpec, method: DataParallel) -> Plan:
    from meshplan.ilp import InputLayouts, solve_intra_op
    n = cluster.num_devices
    _check_batch_divisible(graph, n, "DataParallel")
    mesh = LogicalMesh(("data",), (n,))
    r = solve_intra_op(graph, cluster, mesh, input_filter=InputLayouts("replicated"),
                       backend=method.backend, time_limit=method.time_limit)
    return plan_from_intra_op(graph, cluster, r, "data")


def _plan_manual(graph: Graph, cluster: ClusterSpec, method: Manual) -> Plan:
    from meshplan.ilp import InputLayouts, solve_intra_op
    _check_batch_divisible(graph, method.dp, "Manual(dp=...)")
    mesh = LogicalMesh(("data", "model"), (method.dp, method.tp))
    r = solve_intra_op(graph, cluster, mesh, input_filter=InputLayouts("model"),
                       backend=method.backend, time_limit=method.time_limit)
    return plan_from_intra_op(graph, cluster, r, "manual")


def _plan_pipeline(graph: Graph, cluster: ClusterSpec, method: Method,
                   retrace: Callable[[int], Graph] | None) -> Plan:
    from meshplan.dp_search import plan_pipeline
    p = plan_pipeline(graph, cluster, method, retrace=retrace)
    if isinstance(method, Auto) and len(p.stages) == 1:
        # one stage: the whole-graph ILP is more exact than the sum of layer costs
        try:
            s = _plan_shard(strip_markers(graph), cluster,
                            ShardParallel(time_limit=method.time_limit, backend=method.backend))
        except InfeasiblePlanError:
            return p
        if s.predicted.iteration_s <= p.predicted.iteration_s * 1.05:
            return replace(s, method="auto", notes=s.notes + p.notes + (
                "one stage is fastest: planned by the whole-graph ILP",))
    return p


def _check_batch_divisible(graph: Graph, n: int, what: str) -> None:
    for inp in graph.inputs:
        if inp.role == BATCH:
            shape = graph.tensors[inp.tensor].shape
            if shape and shape[0] % n:
                raise InfeasiblePlanError(
                    f"{what}: the batch dimension of {inp.path or 'the batch'} has size {shape[0]}, "
                    f"which does not split over {n} devices; use a batch size divisible by {n} "
                    "or ShardParallel()")


def _default_names(rank: int) -> tuple[str, ...]:
    from meshplan.cost_model import default_axis_names
    return default_axis_names(rank)


def section_prefixes(graph: Graph) -> tuple[tuple[int, str], ...]:
    nonbatch = sorted({i.argnum for i in graph.inputs if i.argnum not in graph.batch_argnums})
    return arg_prefixes(nonbatch) + arg_prefixes(sorted(set(graph.batch_argnums)))


def plan_from_intra_op(graph: Graph, cluster: ClusterSpec, result: Any, method: str,
                       notes: tuple[str, ...] = ()) -> Plan:
    """A one-stage Plan from the ILP's answer."""
    from meshplan.cost_model.mesh import default_submesh
    prefixes = dict(section_prefixes(graph))
    params, batch = [], []
    for inp, spec in zip(graph.inputs, result.input_specs):
        key = prefixes.get(inp.argnum, "") + inp.path
        (batch if inp.argnum in graph.batch_argnums else params).append((key, spec))
    outputs = tuple((o.path, s) for o, s in zip(graph.outputs, result.output_specs) if s is not None)
    n = result.mesh.size
    stage = Stage(layers=(0, 0), devices=tuple(range(n)), submesh=default_submesh(cluster, n),
                  logical_mesh=result.mesh, remat=False, params=tuple(params),
                  predicted=Predicted(result.compute_s, result.comm_s, int(result.peak_memory_bytes)),
                  outputs=outputs, constraints=result.constraints, strategies=result.strategies,
                  read_constraints=tuple(getattr(result, "read_constraints", ())))
    it = result.compute_s + result.comm_s
    tflops = graph.total_flops / n / it / 1e12 if it > 0 else 0.0
    predicted = PlanPredicted(iteration_s=it, tflops_per_device=tflops,
                              peak_memory_bytes=int(result.peak_memory_bytes),
                              comm_bytes_per_device=int(round(result.comm_bytes)))
    return Plan(graph_fingerprint=graph.fingerprint, cluster=cluster, method=method,
                stages=(stage,), num_micro_batches=1, schedule="none", batch=tuple(batch),
                predicted=predicted, function=graph.name, batch_argnums=graph.batch_argnums,
                arg_prefixes=section_prefixes(graph), notes=notes)


# --------------------------------------------------------------------------
# parallelize
# --------------------------------------------------------------------------

def _abstract(args: Sequence[Any]) -> tuple[Any, ...]:
    def one(x: Any) -> Any:
        if isinstance(x, jax.ShapeDtypeStruct):
            return x
        x = jax.numpy.asarray(x) if not hasattr(x, "shape") else x
        return jax.ShapeDtypeStruct(x.shape, x.dtype)
    return tuple(jax.tree.map(one, tuple(args)))


def _signature(args: Sequence[Any]) -> Any:
    leaves, treedef = jax.tree_util.tree_flatten(tuple(args))
    return treedef, tuple((tuple(getattr(l, "shape", ())), str(getattr(l, "dtype", type(l))))
                          for l in leaves)


class Parallelized:
    """A train step run under a plan.  Call it like the original function."""

    def __init__(self, fn: Callable, *, cluster: ClusterSpec | None, method: Method | None,
                 batch_argnums: Sequence[int], donate_argnums: Any, plan: Plan | None):
        self.fn = fn
        self.cluster = cluster
        self.method = method or ShardParallel()
        self.batch_argnums = tuple(batch_argnums) if plan is None else tuple(plan.batch_argnums)
        self.donate_argnums = donate_argnums
        self._given_plan = plan
        self._cache: dict[Any, tuple[Plan, Any]] = {}
        self._last: Plan | None = plan
        self._fast: tuple[Plan, Any] | None = None   # [fast path] (plan, executable) of the last call
        functools.update_wrapper(self, fn)

    @property
    def plan(self) -> Plan | None:
        """The plan of the most recent call (or the plan given)."""
        return self._last

    def plan_for(self, *args: Any) -> Plan:
        return self._entry(args)[0]

    def split_layers(self, *args: Any) -> tuple[Any, ...]:
        """[lax.scan over stacked layers] ``args`` in the per-layer form the
        step runs on (see :mod:`meshplan.unstack`); the step called with them
        returns its results in that form, with no split or stack per call:
        ``state, metrics = step(*step.split_layers(state, batch))`` ... then
        ``step.stack_layers(state)``.  Other steps get ``args`` back."""
        _, executable = self._entry(args)
        if isinstance(executable, _Unstacking):
            return executable.unstacked.split(args)
        return tuple(args)

    def stack_layers(self, tree: Any) -> Any:
        """Undo :meth:`split_layers` on arguments or results (any pytree holding
        them): every tuple of per-layer pieces becomes one stacked array."""
        units = [ex.unstacked for _, ex in self._cache.values() if isinstance(ex, _Unstacking)]
        return units[-1].stack(tree) if units else tree

    def _entry(self, args: Sequence[Any]) -> tuple[Plan, Any]:
        # [multi-host] in a multi-process run the batch arguments hold this
        # process's rows: plan and compile for the global batch (dim 0 times
        # jax.process_count()); with one process the args come back unchanged.
        from meshplan.runtime.multihost import agree_on_plan, global_view
        args = global_view(args, self.batch_argnums)
        sig = _signature(args)
        hit = self._cache.get(sig)
        if hit is not None:
            self._last = hit[0]
            return hit
        name = getattr(self.fn, "__name__", "fn")
        graph, step, abstract, unstacked = trace_step(self.fn, _abstract(args),
                                                      self.batch_argnums, name)
        if self._given_plan is not None:
            p = self._given_plan
            if p.graph_fingerprint != graph.fingerprint:
                raise StalePlanError(
                    f"the saved plan was made for another function or other argument shapes "
                    f"(plan fingerprint {p.graph_fingerprint[:12]}, this call "
                    f"{graph.fingerprint[:12]}); re-plan with meshplan.plan(...) for this step")
        else:
            p = with_note(plan_graph(graph, self.cluster or ClusterSpec.local(), self.method,
                                     retrace=retracer(step, abstract, self.batch_argnums, name)),
                          unstacked)
        # [multi-host] every process runs process 0's plan (one process: p itself)
        p = agree_on_plan(p)
        executable = self._executable(p, graph, step, abstract)
        if unstacked is not None:
            # arguments already in per-layer form (split_layers) run as they are
            self._cache[_signature(abstract)] = (p, executable)
            executable = _Unstacking(executable, unstacked, jax.tree.structure(tuple(args)))
        self._cache[sig] = (p, executable)
        self._last = p
        return p, executable

    def _executable(self, p: Plan, graph: Graph, step: Callable, abstract: tuple[Any, ...]) -> Any:
        """The runtime's executable of ``p``, given ``step`` traced as it runs."""
        from meshplan.runtime import ShardExecutable
        batch_argnums = tuple(p.batch_argnums)
        if len(p.stages) > 1:
            # [pipeline] stages on submeshes, micro-batches, GPipe / 1F1B
            from meshplan.runtime.pipeline import PipelineExecutable
            traced = trace_for_run(step, abstract, batch_argnums, p.num_micro_batches)
            return PipelineExecutable(step, p, abstract, traced=traced,
                                      layer_of_node=_layer_of_node(p, traced))
        return ShardExecutable(step, p, abstract, traced=trace_for_run(step, abstract, batch_argnums),
                               retrace=functools.partial(trace_for_run, step,
                                                         batch_argnums=batch_argnums),
                               donate_argnums=self._donate(graph))

    def _donate(self, graph: Graph) -> tuple[int, ...]:
        if self.donate_argnums == "auto":
            updated = {graph.inputs[o.updates].argnum for o in graph.outputs if o.updates is not None}
            return tuple(sorted(a for a in updated if a not in graph.batch_argnums))
        if self.donate_argnums is None:
            return ()
        if isinstance(self.donate_argnums, int):
            return (self.donate_argnums,)
        return tuple(self.donate_argnums)

    def __call__(self, *args: Any) -> Any:
        # [fast path] straight to the program of the last call; jit's own
        # dispatch checks the arguments, FastPathMiss says they do not fit
        fast = self._fast
        if fast is not None:
            from meshplan.runtime import FastPathMiss
            try:
                out = fast[1].call_fast(args)
            except FastPathMiss:
                pass
            else:
                self._last = fast[0]
                return out
        hit = self._entry(args)
        out = hit[1](*args)
        self._fast = hit
        return out

    @property
    def last_timeline(self) -> list[Any]:
        """[pipeline] What the last call of a pipeline plan ran: one
        ``meshplan.timeline.Block`` per stage program (see
        ``PipelineExecutable.last_timeline``); ``[]`` for one-stage plans."""
        ex = self._fast[1] if self._fast is not None else None
        return list(getattr(ex, "last_timeline", None) or [])

    def lower(self, *args: Any) -> jax.stages.Lowered:
        """The ``jax.stages.Lowered`` of the step exactly as it runs."""
        _, executable = self._entry(args)
        return executable.lower(*args)

    def __repr__(self) -> str:
        return f"meshplan.parallelize({getattr(self.fn, '__name__', self.fn)}, method={self.method})"


class _Unstacking:
    """An executable of the rewritten step (:mod:`meshplan.unstack`) called
    with the user's stacked arguments: split on the way in, stacked on the way out."""

    def __init__(self, inner: Any, unstacked: Unstacked, in_tree: Any) -> None:
        self.inner = inner
        self.unstacked = unstacked
        self.in_tree = in_tree      # the stacked arguments' structure

    def __call__(self, *args: Any) -> Any:
        return self.unstacked.restore(self.inner(*self.unstacked.split(args)))

    def call_fast(self, args: tuple[Any, ...]) -> Any:
        from meshplan.runtime import FastPathMiss
        if jax.tree.structure(tuple(args)) != self.in_tree:
            raise FastPathMiss("not the stacked arguments")   # e.g. already per layer
        return self.unstacked.restore(self.inner.call_fast(self.unstacked.split(args)))

    def lower(self, *args: Any) -> Any:
        return self.inner.lower(*self.unstacked.split(args))

    def __getattr__(self, name: str) -> Any:   # last_timeline, ...
        return getattr(self.inner, name)


def _layer_of_node(p: Plan, traced: TracedStep) -> tuple[int, ...]:
    """[pipeline] The layer of every operation of the step at micro-batch size:
    recorded in the plan, or (a plan file from before the record) the
    planner's layering recomputed with the plan's number of layers on the
    graph of the step as it runs (``traced``, at micro-batch size)."""
    if p.layer_of_node:
        return p.layer_of_node
    from meshplan.dp_search.layers import assign_layers
    g = traced.graph
    L = p.stages[-1].layers[1] + 1
    lay = assign_layers(g, L)
    if lay.num_layers != L:
        raise StalePlanError(f"the pipeline plan does not record its layering and its {L} layers "
                             "cannot be recomputed; re-plan with this version of meshplan")
    return lay.layer_of_node


def parallelize(fn: Callable | None = None, *, cluster: ClusterSpec | None = None,
                method: Method | None = None, batch_argnums: Sequence[int] = (1,),
                donate_argnums: Any = "auto", plan: Plan | None = None) -> Any:
    """Run ``fn`` in parallel: ``meshplan.parallelize(step, cluster=..., method=...)``
    or as a decorator, with or without arguments."""
    def wrap(f: Callable) -> Parallelized:
        return Parallelized(f, cluster=cluster, method=method, batch_argnums=batch_argnums,
                            donate_argnums=donate_argnums, plan=plan)
    if fn is None:
        return wrap
    return wrap(fn)
