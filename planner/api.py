"""The public API: ``meshplan.plan`` and ``meshplan.parallelize``.

This module sits on top of every pass: it plans through
:mod:`meshplan.planning` and hands the plan to the runtime.
"""
from __future__ import annotations

import functools
import inspect
import os
from typing import Any, Callable, Sequence

import jax

from .cluster import ClusterSpec, load_cluster
from .dp_search import Session
from .errors import (CallError, MeshplanError, RuntimeStageError, StalePlanError,
                     TraceError, argument_leaf, warn)
from .graph import Graph, batch_shaped_draws
from .methods import Method, ShardParallel, normalize_argnums
from .dp_search.assemble import argument_table
from .plan import Plan, argument_differences
from .recompute import NONE
from .shardings import UNROLLED_SCAN, check_arguments, check_updates_in_place
from .planning import TracedFunction, plan_function, plan_step, trace_function
from .planning import retracer  # noqa: F401 (re-exported)
from .trace import trace_for_run
from .trace.tracer import abstract_leaf
from .traced import TracedStep, signature
from .trace.unstack import Unstacked


# --------------------------------------------------------------------------
# planning (the passes run in meshplan.planning)
# --------------------------------------------------------------------------

def plan(fn: Callable, *args: Any, cluster: ClusterSpec | None = None,
         method: Method | None = None, batch_argnums: int | Sequence[int] = (1,),
         donate_argnums: Any = "auto", session: Session | None = None,
         explain: bool = False) -> Plan:
    """Plan ``fn(*args)`` for ``cluster`` (default: the local devices).
    ``args`` may be concrete arrays or ``jax.ShapeDtypeStruct`` pytrees.
    ``session``: a :class:`meshplan.dp_search.Session` to plan in (its
    progress reporter and layer-cost cache; default a new one).
    ``explain``: also plan the alternatives (data parallel, ZeRO-3,
    intra-operator only, other numbers of stages, a Megatron-style grid) and
    keep them in the plan: ``plan.explain()`` prints them.
    ``donate_argnums``: as the step will run (:func:`parallelize`); the
    predicted memory holds an updated argument's new value beside the old
    one where it is not donated.  Default ``"auto"``: the arguments the step
    updates are donated, as a train loop does."""
    cluster, method = _cluster(cluster), _method(method)
    session = session or Session.from_env()
    traced = _trace(fn, args, _argnums(batch_argnums), session)
    return plan_function(traced, cluster or ClusterSpec.local(), method or ShardParallel(),
                         session, explain=explain,
                         donated=donated_argnums(donate_argnums, traced.graph, len(args))).plan


def plan_graph(graph: Graph, cluster: ClusterSpec, method: Method, *,
               retrace: Callable[[int], Graph] | None = None,
               session: Session | None = None) -> Plan:
    """Plan an already traced graph (:func:`meshplan.planning.plan_step`'s plan)."""
    return plan_step(graph, cluster, method, retrace=retrace, session=session).plan


def trace_step(fn: Callable, abstract: Sequence[Any], batch_argnums: tuple[int, ...], name: str
               ) -> tuple[Graph, Callable, tuple[Any, ...], Unstacked | None]:
    """``(graph, step, step_args, unstacked)`` of :func:`meshplan.planning.trace_function`."""
    t = trace_function(fn, abstract, tuple(batch_argnums), name, Session.from_env())
    return t.graph, t.step, t.args, t.unstacked


# --------------------------------------------------------------------------
# parallelize
# --------------------------------------------------------------------------

def donated_argnums(d: Any, graph: Graph, nargs: int) -> tuple[int, ...]:
    """The argument positions ``donate_argnums`` ``d`` names (as jax.jit
    takes it; ``"auto"``: every argument the step updates but the batch)."""
    if d == "auto":
        updated = {graph.inputs[o.updates].argnum for o in graph.outputs if o.updates is not None}
        return tuple(sorted(a for a in updated if a not in graph.batch_argnums))
    if d is None:
        return ()
    donated = (d,) if isinstance(d, int) and not isinstance(d, bool) else \
        tuple(d) if isinstance(d, (tuple, list)) else None
    if donated is None or not all(isinstance(a, int) and not isinstance(a, bool)
                                  for a in donated):
        raise MeshplanError(f"donate_argnums={d!r}: give an int, a sequence of ints or "
                            "\"auto\", as jax.jit takes")
    if any(a < 0 for a in donated):
        # (jax.jit takes them and donates nothing)
        raise MeshplanError(f"donate_argnums={d!r}: give the donated arguments' positions "
                            "counted from 0 (negative positions are not taken)")
    if any(a >= nargs for a in donated):
        raise MeshplanError(f"donate_argnums={d!r} names an argument the step is not given: "
                            f"it was called with {nargs} positional argument(s)")
    return donated


def _argnums(batch_argnums: Any) -> tuple[int, ...]:
    try:
        return normalize_argnums(batch_argnums)
    except TypeError as e:
        raise MeshplanError(f"{e}; e.g. batch_argnums=1 or (1,)") from None


def _cluster(cluster: Any) -> ClusterSpec | None:
    """``cluster=``: a ClusterSpec, the path of a cluster JSON, or its dict."""
    if cluster is None or isinstance(cluster, ClusterSpec):
        return cluster
    if isinstance(cluster, (str, os.PathLike)):
        return load_cluster(cluster)
    if isinstance(cluster, dict):
        return ClusterSpec.from_dict(cluster)
    raise MeshplanError(f"cluster= takes a meshplan.Cluster, the path of a cluster JSON file or "
                        f"its dict, not {type(cluster).__name__}")


def _method(method: Any) -> Method | None:
    if method is None or isinstance(method, Method):
        return method
    if isinstance(method, type) and issubclass(method, Method):
        raise MeshplanError(f"method= takes a method object: meshplan.{method.__name__}(), not "
                            f"the class meshplan.{method.__name__}")
    raise MeshplanError(f"method= takes a meshplan method (ShardParallel(), Auto(), Manual(...) "
                        f"...), not {type(method).__name__}")


def _check_given_plan(plan: Any, cluster: Any, method: Any, batch_argnums: Any) -> None:
    """``plan=`` runs a plan as it is: refuse what is not one, and the
    planning arguments it would ignore."""
    if not isinstance(plan, Plan):
        raise MeshplanError(f"plan= takes a meshplan.Plan, not {type(plan).__name__}: read a "
                            "saved plan with meshplan.Plan.from_json(text) or Plan.from_dict(d)")
    given = [k for k, v in (("cluster=", cluster), ("method=", method)) if v is not None]
    if given:
        raise MeshplanError(f"plan= runs the plan as it is, on its own cluster and method: drop "
                            f"{' and '.join(given)}")
    # (batch_argnums left at its default takes the plan's)
    if batch_argnums != (1,) and _argnums(batch_argnums) != tuple(plan.batch_argnums):
        raise MeshplanError(f"batch_argnums={batch_argnums!r}, but the plan was made with "
                            f"batch_argnums={tuple(plan.batch_argnums)}: drop it, or re-plan")


def _no_explicit_context_mesh() -> None:
    """Refuse a call inside ``with jax.set_mesh(mesh)`` of a mesh with
    Explicit axes (jax.make_mesh's default): the step's values then carry
    that mesh's shardings in their types, which the plan's own layouts
    cannot meet (a mesh of Auto axes only is fine)."""
    from jax.sharding import AxisType
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty and AxisType.Explicit in tuple(mesh.axis_types):
        raise MeshplanError(
            "this call is inside `with jax.set_mesh(...)` of a mesh with Explicit axes, whose "
            "shardings the step's values would carry in their types, and meshplan lays them out "
            "on its own mesh; call the parallelized step outside it (a one-stage plan also runs "
            "inside a mesh of axis_types=(AxisType.Auto, ...); a pipeline runs outside any)")


def _one_device_effects(run: TracedStep) -> None:
    """Refuse, before planning, a step with an ordered effect that jax runs
    on one device only (``jax.debug.print(..., ordered=True)``): every plan
    of several devices would fail to compile."""
    try:    # (jax's own sets of ordered effects and those it shards)
        from jax._src import effects as jax_effects
    except ImportError:
        return
    for fe in run.flat.eqns:
        bad = jax_effects.shardable_ordered_effects.filter_not_in(
            jax_effects.ordered_effects.filter_in(fe.eqn.effects))
        if bad:
            raise MeshplanError(
                f"the step's {fe.eqn.primitive.name} is ordered (ordered=True), an effect jax "
                "runs on one device only, and the plan spans several; drop ordered=True (or use "
                "jax.experimental.io_callback(..., ordered=True), which jax runs on several)")


def _trace(fn: Callable, args: Sequence[Any], batch_argnums: tuple[int, ...],
           session: Session) -> TracedFunction:
    """:func:`trace_function` of ``fn`` at ``args``' shapes.  Where the step
    itself fails, and an argument's layout was part of its type (a mesh of
    Explicit axes) that the step may rely on, the failure says so: meshplan
    traces every argument without its layout, which it chooses itself."""
    try:
        return trace_function(fn, _abstract(args), batch_argnums,
                              getattr(fn, "__name__", "fn"), session)
    except Exception as e:
        typed = _explicit_leaf(args)
        if typed is not None and getattr(e, "meshplan_step", None) is not None:
            e.add_note(f"({typed} has a sharding on a mesh with Explicit axes, part "
                       "of its type under jax.jit; meshplan traces the step without the "
                       "arguments' shardings, which it chooses itself, so a step that relies on "
                       "them fails here)")
        raise


def _explicit_leaf(args: Sequence[Any]) -> str | None:
    """The first argument leaf whose sharding is on a mesh with Explicit axes."""
    from jax.sharding import AxisType, NamedSharding
    for path, x in jax.tree_util.tree_leaves_with_path(tuple(args)):
        sh = getattr(x, "sharding", None)
        if isinstance(sh, NamedSharding) and AxisType.Explicit in tuple(sh.mesh.axis_types):
            return argument_leaf(path)
    return None


def _abstract(args: Sequence[Any]) -> tuple[Any, ...]:
    def one(path: Any, x: Any) -> Any:
        if isinstance(x, jax.ShapeDtypeStruct):
            return x
        try:
            return abstract_leaf(x)
        except TypeError:
            # (a function or a module's static field among the arrays, as
            # jax.jit refuses it too)
            raise TraceError(
                f"{argument_leaf(path)} is a {type(x).__name__}, not an array: the step's arguments "
                "are pytrees of arrays and scalars; keep it out of them (a closure, or "
                "eqx.partition / nnx.split of the module)") from None
    return tuple(jax.tree_util.tree_map_with_path(one, tuple(args)))


def _signature(args: Sequence[Any]) -> Any:
    # (weak types too: jax traces a weakly typed leaf to other equations, so a
    # restored strong int32 beside a plan made for eval_shape's weak one
    # needs its own plan, as jax.jit compiles it apart)
    return signature(tuple(args), weak_types=True)


class Parallelized:
    """A train step run under a plan.  Call it like the original function."""

    def __init__(self, fn: Callable, *, cluster: ClusterSpec | None, method: Method | None,
                 batch_argnums: Sequence[int], donate_argnums: Any, plan: Plan | None,
                 session: Session | None = None):
        if plan is not None:
            _check_given_plan(plan, cluster, method, batch_argnums)
        self.fn = fn
        self.session = session
        self.cluster = _cluster(cluster)
        self.method = _method(method) or ShardParallel()
        self.batch_argnums = _argnums(batch_argnums) if plan is None else tuple(plan.batch_argnums)
        self.donate_argnums = donate_argnums
        self._given_plan = plan
        self._cache: dict[Any, tuple[Plan, Any]] = {}
        self._last: Plan | None = plan
        self._fast: tuple[Plan, Any] | None = None   # [fast path] (plan, executable) of the last call
        # (a name and a doc, as jax.jit gives; not the callable's own attributes,
        # which would overwrite these: an eqx.filter_jit keeps its own `fn`)
        functools.update_wrapper(self, fn, updated=())
        if not hasattr(self, "__name__"):   # (a partial, a callable object: named as jax.jit does)
            self.__name__ = getattr(getattr(fn, "func", None), "__name__", "<unnamed function>")

    @property
    def plan(self) -> Plan | None:
        """The plan of the most recent call (or the plan given); None before
        the first call (:meth:`plan_for` plans without running)."""
        return self._last

    def plan_for(self, *args: Any, **kwargs: Any) -> Plan:
        """The plan for ``args`` (arrays or ShapeDtypeStructs), made (with
        its executable) as a call would make it, without running the step."""
        return self._entry(self._positional(args, kwargs))[0]

    def shardings(self, *args: Any, **kwargs: Any) -> Any:
        """:meth:`meshplan.Plan.shardings` of the plan for ``args`` (planned
        on first use), with the output shardings of this step:
        ``mesh, in_s, out_s = step.shardings(state, batch)``."""
        args = self._positional(args, kwargs)
        p, executable = self._entry(args)
        rolled = getattr(executable, "stacked_shardings", None)
        if rolled is not None:      # (the scan runs rolled: the plan's layouts stacked)
            return rolled
        if isinstance(executable, _Unstacking):
            raise MeshplanError(UNROLLED_SCAN)
        return p.shardings(*args, step=getattr(executable, "fn", self.fn))

    def split_layers(self, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        """[lax.scan over stacked layers] ``args`` in the per-layer form the
        step runs on (see :mod:`meshplan.trace.unstack`); the step called with them
        returns its results in that form, with no split or stack per call:
        ``state, metrics = step(*step.split_layers(state, batch))`` ... then
        ``step.stack_layers(state)``.  Other steps get ``args`` back."""
        args = self._positional(args, kwargs)
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
        _no_explicit_context_mesh()
        args = global_view(args, self.batch_argnums)
        sig = _signature(args)
        hit = self._cache.get(sig)
        if hit is not None:
            self._last = hit[0]
            return hit
        _runs_here(self._given_plan.cluster if self._given_plan is not None
                   else self.cluster or ClusterSpec.local())
        session = self.session or Session.from_env()
        traced = _trace(self.fn, args, self.batch_argnums, session)
        graph, abstract, unstacked = traced.graph, traced.args, traced.unstacked
        cluster = self._given_plan.cluster if self._given_plan is not None else self.cluster
        if (cluster or ClusterSpec.local()).num_devices > 1:
            _one_device_effects(traced.run)
        if self._given_plan is not None:
            p = self._given_plan
            if p.graph_fingerprint != graph.fingerprint:
                raise StalePlanError(_stale(p, graph))
            # (a scan's stacked layers: the plan names the per-layer arguments)
            check_arguments(p, abstract)
            check_updates_in_place(p, graph, len(abstract))
        else:
            # (the memory it predicts holds what jax.jit holds: an updated
            # argument the caller keeps has its new value beside it)
            p = plan_function(traced, self.cluster or ClusterSpec.local(), self.method, session,
                              donated=self._donate(graph, len(args))).plan
        # [multi-host] every process runs process 0's plan (one process: p itself)
        p = agree_on_plan(p)
        executable = self._executable(p, traced)
        if unstacked is not None:
            # arguments already in per-layer form (split_layers) run as they are
            self._cache[_signature(abstract)] = (p, executable)
            donated = self._donate(graph, len(args))
            executable = (_rolled(self.fn, p, traced, _abstract(args), donated)
                          or _Unstacking(executable, unstacked, jax.tree.structure(tuple(args)),
                                         donated))
        self._cache[sig] = (p, executable)
        self._last = p
        return p, executable

    def _executable(self, p: Plan, traced: TracedFunction) -> Any:
        """The runtime's executable of ``p`` for the step as traced for planning."""
        from meshplan.runtime import ShardExecutable
        step, abstract, graph = traced.step, traced.args, traced.graph
        batch_argnums = tuple(p.batch_argnums)
        if len(p.stages) > 1 or (p.num_micro_batches > 1 and p.layer_of_node):
            # [pipeline] stages on submeshes, micro-batches, GPipe / 1F1B (one
            # stage with several micro-batches: gradient accumulation, as
            # planned; Plan.from_dict refuses such a plan without its layers)
            from meshplan.runtime.pipeline import PipelineExecutable
            run = trace_for_run(step, abstract, batch_argnums, p.num_micro_batches)
            why = batch_shaped_draws(graph, run.graph) if p.num_micro_batches > 1 else None
            if why:
                raise MeshplanError(f"this pipeline plan runs {p.num_micro_batches} "
                                    f"micro-batches, but {why}")
            # (the retrace of the partial sums: the same equations, at smaller
            # micro-batches; how values scale is the first trace's)
            return PipelineExecutable(step, p, abstract, traced=run,
                                      retrace=functools.partial(trace_for_run, step, abstract,
                                                                batch_argnums, scaling=False),
                                      fused=fused_replay(run, p.schedule,
                                                         _layer_of_node(p, run)),
                                      layer_of_node=_layer_of_node(p, run),
                                      donate_argnums=self._donate(graph, len(abstract)),
                                      whole=traced.run)
        # (one stage: the planner's own trace, which the plan's tensor ids name)
        return ShardExecutable(step, p, abstract, traced=traced.run,
                               retrace=functools.partial(trace_for_run, step,
                                                         batch_argnums=batch_argnums),
                               donate_argnums=self._donate(graph, len(abstract)),
                               replay=_replay(p, graph))

    def _donate(self, graph: Graph, nargs: int) -> tuple[int, ...]:
        return donated_argnums(self.donate_argnums, graph, nargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        args = self._positional(args, kwargs)
        try:
            return self._call(args)
        except _TRACED_ERRORS:
            if not any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves(args)):
                raise
            raise MeshplanError(
                "a parallelized step runs its own compiled programs on arrays: it cannot be "
                "traced by jax.jit, jax.vmap, jax.eval_shape or jax.grad; call "
                "it outside them, or apply the transformation to the plain step and "
                "parallelize that") from None

    def _positional(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        """Keyword arguments bound to the step's positions (as jax.jit
        accepts them); a keyword-only argument has no position to plan."""
        if not kwargs:
            return tuple(args)
        name = getattr(self.fn, "__name__", "the step")
        try:
            sig = inspect.signature(self.fn)
        except (TypeError, ValueError) as e:
            raise MeshplanError(f"{name}: {e}") from None
        unknown = [k for k in kwargs if k not in sig.parameters]
        if unknown and not any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()):
            # (as Python and jax.jit say it, before any argument it then lacks)
            raise CallError(f"{name}() got an unexpected keyword argument {unknown[0]!r}")
        try:
            bound = sig.bind(*args, **kwargs)
        except TypeError as e:
            raise CallError(f"{name}(): {e}") from None
        if bound.kwargs:
            raise MeshplanError(
                f"{name} takes {sorted(bound.kwargs)} by "
                "keyword only; meshplan plans positional arguments: give the step them by "
                "position (functools.partial for fixed ones)")
        return tuple(bound.args)

    def _call(self, args: tuple[Any, ...]) -> Any:
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
        ``meshplan.tools.timeline.Block`` per stage program (see
        ``PipelineExecutable.last_timeline``); ``[]`` for one-stage plans."""
        ex = self._fast[1] if self._fast is not None else None
        return list(getattr(ex, "last_timeline", None) or [])

    def lower(self, *args: Any, **kwargs: Any) -> Any:
        """The ``jax.stages.Lowered`` of the step exactly as it runs; for a
        pipeline plan a ``meshplan.runtime.pipeline_lower.PipelineLowered``
        holding every stage program's (``.compile()``: their ``Compiled``)."""
        args = self._positional(args, kwargs)
        _, executable = self._entry(args)
        return executable.lower(*args)

    def __repr__(self) -> str:
        return f"meshplan.parallelize({getattr(self.fn, '__name__', self.fn)}, method={self.method})"


# what jax raises where a tracer reaches the runtime's checks of concrete arrays
_TRACED_ERRORS = (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError,
                  jax.errors.TracerBoolConversionError, jax.errors.TracerIntegerConversionError)

# a rolled scan may communicate this much more than the plan predicts (and 64 KiB)
ROLLED_COMM_SLACK = 1.1


def _runs_here(cluster: ClusterSpec) -> None:
    """Refuse, before planning, a cluster of more devices than this machine
    runs on: its plan could not run here."""
    have = jax.device_count()
    if cluster.num_devices > have:
        raise RuntimeStageError(
            f"the cluster {cluster.name} has {cluster.num_devices} devices, but only {have} are "
            f"available here to run on; to plan for it without running, use "
            f"meshplan.plan(step, *args, cluster=...) or `meshplan plan --cluster FILE`; to run "
            f"here, pass cluster=meshplan.Cluster.local()")


def _stale(p: Plan, graph: Graph) -> str:
    """Why a saved plan does not fit this call: the function and the
    argument leaves that differ where the plan records them."""
    diff = argument_differences(p.arguments, argument_table(graph)) if p.arguments else []
    if diff:
        what = "other arguments: " + "; ".join(diff)
    elif p.arguments:
        # (the same arguments: the operations differ; a name may differ only
        # by how it was called, the CLI's model against its train_step)
        named = (f"; the plan names function {p.function!r}, this is {graph.name!r}"
                 if p.function and p.function != graph.name else "")
        what = ("the same arguments but other operations (the step's code or the model's "
                f"options differ{named})")
    else:
        what = "another function or other argument shapes or dtypes"
    return (f"the saved plan was made for {what} (a saved plan holds for the shapes it was "
            f"made for: a batch of another size, as an epoch's last, needs a plan of its own; "
            f"a Python scalar is weakly typed where a jnp.int32 or jnp.float32 is not, as "
            f"jax.jit tells them apart; plan fingerprint {p.graph_fingerprint[:12]}, this call "
            f"{graph.fingerprint[:12]}); re-plan for this step: meshplan.plan(...), or "
            f"`meshplan plan ... --json FILE` with the same model options")


def _rolled(fn: Callable, p: Plan, traced: TracedFunction, abstract: Sequence[Any],
            donate_argnums: tuple[int, ...]) -> Any:
    """[lax.scan over stacked layers] The user's step with its scan rolled
    (:mod:`meshplan.runtime.rolled`), for a one-stage plan of a step that
    recomputes (a ``jax.checkpoint`` keeps its saving only in the loop) whose
    layers were each planned alike, and where the plan adds no recomputation
    of its own; else None.  (One process: several take their rows of the
    batch through the runtime's own assembly.)"""
    from meshplan.runtime.rolled import RolledScan, rolled_shardings
    from meshplan.units import human_bytes
    one_program = len(p.stages) == 1 and p.num_micro_batches == 1
    if (not one_program or jax.process_count() > 1 or p.stages[0].recompute != NONE
            or not any(n.remat for n in traced.graph.nodes)):
        return None
    shardings = rolled_shardings(p, traced.unstacked, abstract)
    if shardings is None:
        return None
    rolled = RolledScan(fn, shardings, abstract, donate_argnums)
    # (XLA lays out the loop body itself: kept where it moves what the plan does)
    moved, planned = rolled.comm_bytes(abstract), p.predicted.comm_bytes_per_device
    if moved > ROLLED_COMM_SLACK * planned + 2 ** 16:
        warn(f"meshplan: the lax.scan over stacked layers runs unrolled: rolled, the "
             f"layouts XLA chose inside it move {human_bytes(moved)} a step per device "
             f"against the plan's {human_bytes(planned)} (a jax.checkpoint inside it "
             "keeps less of its saving unrolled)")
        return None
    return rolled


class _Unstacking:
    """An executable of the rewritten step (:mod:`meshplan.trace.unstack`) called
    with the user's stacked arguments: split on the way in, stacked on the way out."""

    def __init__(self, inner: Any, unstacked: Unstacked, in_tree: Any,
                 donated: tuple[int, ...] = ()) -> None:
        self.inner = inner
        self.unstacked = unstacked
        self.in_tree = in_tree      # the stacked arguments' structure
        self.donated = donated

    def __call__(self, *args: Any) -> Any:
        out = self.unstacked.restore(self.inner(*self.unstacked.split(args)))
        self._consume(args)
        return out

    def call_fast(self, args: tuple[Any, ...]) -> Any:
        from meshplan.runtime import FastPathMiss
        if jax.tree.structure(tuple(args)) != self.in_tree:
            raise FastPathMiss("not the stacked arguments")   # e.g. already per layer
        out = self.unstacked.restore(self.inner.call_fast(self.unstacked.split(args)))
        self._consume(args)
        return out

    def _consume(self, args: Sequence[Any]) -> None:
        # the donated stacked arrays go as jax.jit's donated arguments go
        # (the program consumed their pieces)
        self.unstacked.delete_split(args, self.donated)

    def lower(self, *args: Any) -> Any:
        return self.inner.lower(*self.unstacked.split(args))

    def __getattr__(self, name: str) -> Any:   # last_timeline, ...
        return getattr(self.inner, name)


def _replay(p: Plan, graph: Graph) -> Any:
    """[one stage] What the program recomputes (None: nothing), layer by layer:
    the plan's layers, or (a plan from the whole-graph ILP) the planner's."""
    from meshplan.runtime.remat import plan_replay
    if p.stages[0].recompute == NONE:
        return None
    layers = p.layer_of_node
    if len(layers) != len(graph.nodes):
        from meshplan.dp_search.layers import assign_layers
        layers = assign_layers(graph).layer_of_node
    st = p.stages[0]
    return plan_replay(graph, st.recompute, layers,
                       st.layers[0] + st.recompute_layers if st.recompute_layers else None)


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
                method: Method | None = None, batch_argnums: int | Sequence[int] = (1,),
                donate_argnums: Any = (), plan: Plan | None = None,
                session: Session | None = None, **jit_options: Any) -> Any:
    """Run ``fn`` in parallel: ``meshplan.parallelize(step, cluster=..., method=...)``
    or as a decorator, with or without arguments.  ``donate_argnums`` as in
    ``jax.jit``: only the arguments named are donated (``"auto"``: every
    argument the step returns a new value of, the batch never).
    ``session``: see :func:`plan`.  ``jax.jit``'s other options are refused,
    each with what to do instead."""
    if jit_options:
        raise CallError(_jit_option(sorted(jit_options)[0]))

    def wrap(f: Callable) -> Parallelized:
        return Parallelized(f, cluster=cluster, method=method, batch_argnums=batch_argnums,
                            donate_argnums=donate_argnums, plan=plan, session=session)
    if fn is None:
        return wrap
    return wrap(fn)


# jax.jit's options parallelize does not take, and what a user does instead
_STATIC = "bind the static arguments first: parallelize(functools.partial(step, arg=value))"
_LAYOUTS = "the plan chooses the layouts; pass plan= to fix them, or method=Manual(...)"
_JIT_INSTEAD = {
    "static_argnums": _STATIC, "static_argnames": _STATIC,
    "donate_argnames": "name the donated arguments by position: donate_argnums=(0,)",
    "in_shardings": _LAYOUTS, "out_shardings": _LAYOUTS,
}


def _jit_option(name: str) -> str:
    instead = _JIT_INSTEAD.get(name)
    if instead is None:
        return (f"parallelize() got an unexpected keyword argument {name!r}; it takes cluster=, "
                "method=, batch_argnums=, donate_argnums=, plan= and session=")
    return f"parallelize() does not take jax.jit's {name}: {instead}"


def fused_replay(traced: TracedStep, schedule: str,
                 layer_of_node: Sequence[int] = ()) -> frozenset[int]:
    """[pipeline] The forward equations a stage recomputing nothing replays
    in its backward: the element-wise ones whose results XLA would make again
    inside the backward's fusions were the step one program (what
    :func:`meshplan.cost_model.fusion.kept_after_fusion` does not keep).
    With the plan's layering, layer by layer as the planner's activation
    memory counts it (``dp_search/problem``: a chain is not followed into
    another layer, whose value entering it is kept); else over the whole
    step.  (ZB-H1: its B and W programs each replay what they read of them.)"""
    from meshplan.cost_model.fusion import RECOMPUTABLE, backward_reads, kept_after_fusion
    g = traced.graph
    if g is None:
        return frozenset()
    fwd = traced.forward
    if len(layer_of_node) == len(g.nodes):
        from meshplan.dp_search.layers import Layering, saved_for_backward, unmarked_view
        layering = Layering(max(layer_of_node) + 1, tuple(layer_of_node), tuple(fwd), (), (),
                            False)
        view = unmarked_view(g, layering)
        kept = frozenset().union(*(
            kept_after_fusion(view.graph, view.forward, r, members)
            for members, r in zip(view.members, saved_for_backward(g, layering, view))))
    else:
        kept = kept_after_fusion(g, fwd, backward_reads(g, fwd))
    return frozenset(n.id for n in g.nodes if fwd[n.id] and n.primitive in RECOMPUTABLE
                     and not any(o in kept for o in n.outputs))
