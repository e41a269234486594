"""Run a one-stage (intra-operator) plan with ``jax.sharding``.

The plan says how every argument leaf, every output leaf and some
intermediate tensors are split over a logical mesh.  This module binds the
logical mesh to real devices and builds one jitted program:

* the planner traces the function (:func:`meshplan.trace.trace_for_run`)
  and hands over the :class:`~meshplan.traced.TracedStep`: the flattened
  jaxpr is the very stream of equations the planner saw, so the integer
  tensor ids in ``Stage.constraints`` name the same values here;
* an evaluator replays that stream equation by equation (as
  ``jax.core.eval_jaxpr`` does) and wraps every constrained value in
  ``jax.lax.with_sharding_constraint``;
* the evaluator is jitted with the planned ``in_shardings`` /
  ``out_shardings`` and donation, once per abstract signature of the
  arguments.

Everything a user can get wrong (a plan for other shapes, a batch that does
not divide over the mesh, too few devices) is refused with a
:class:`~meshplan.MeshplanError` before XLA sees it.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Container, Iterable, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from meshplan.errors import RuntimeStageError, StalePlanError, argument_leaf, deleted_argument
from meshplan.plan import Plan
from meshplan.recompute import NONE
# (meshes and specs: shared with Plan.shardings, re-exported for the runtime's modules)
from meshplan.shardings import (arg_specs, build_mesh, check_spec, shape_of as _shape_of,
                                stage_devices, to_partition_spec)
from meshplan.traced import FlatJaxpr, Lit, TracedStep, signature

from .reads import read_layouts
from .remat import Replay
from .multihost import (BatchAssembler, is_local_batch_leaf, check_mesh_spans_processes,
                        global_view, is_multiprocess, place_global)

__all__ = ("build_mesh", "arg_specs", "to_partition_spec", "ShardExecutable", "FastPathMiss",)


# ---------------------------------------------------------------------------
# The evaluator: replay the flat equation stream with sharding constraints
# ---------------------------------------------------------------------------

def make_evaluator(flat: FlatJaxpr, constraints: Mapping[int, NamedSharding],
                   reads: Mapping[int, Sequence[tuple[int, NamedSharding]]] | None = None,
                   replay: Replay | None = None,
                   to_device: Mapping[int, NamedSharding] | None = None
                   ) -> Callable[..., list[Any]]:
    """A function of the flat input leaves that computes the flat outputs.

    It binds every equation of ``flat`` in order, like ``jax.core.eval_jaxpr``,
    and passes each value whose global id is in ``constraints`` through
    ``with_sharding_constraint``.  ``reads`` maps the first result id of an
    equation to (operand position, sharding) pairs: those operands are
    constrained as that equation reads them.  Without them XLA's partitioner
    picks its own way from an operand's layout to what a dot or convolution
    needs, which need not be the (costed) way the plan chose.  ``replay``:
    the forward values the backward reads recomputed (:mod:`.remat`).
    ``to_device``: input ids kept in host memory between steps (offloaded
    state), each moved to the device's memory where the stream first reads
    it, so that it occupies the device only from there on.
    """
    reads = reads or {}
    fences = checkpoint_fences(flat)

    def evaluate(*invals: Any) -> list[Any]:
        env: dict[int, Any] = {}
        pending = dict(to_device or {})

        def write(i: int, value: Any) -> None:
            sharding = constraints.get(i)
            if sharding is not None:
                value = jax.lax.with_sharding_constraint(value, sharding)
            env[i] = value

        def read(x: int | Lit) -> Any:
            if isinstance(x, Lit):
                return x.value
            if x in pending:     # (its constraint applies on the device, once there)
                write(x, jax.device_put(env[x], pending.pop(x)))
            return env[x]

        for i, c in zip(flat.constvars, flat.consts):
            write(i, c)
        for i, v in zip(flat.invars, invals, strict=True):
            if i in pending:
                env[i] = v
            else:
                write(i, v)
        def bind(fe: Any, args: list[Any]) -> Sequence[Any]:
            eqn = fe.eqn
            subfuns, bind_params = _bind_params(eqn)
            ctx = getattr(getattr(eqn, "ctx", None), "manager", None) or contextlib.nullcontext()
            for pos, sharding in (reads.get(fe.outvars[0], ()) if fe.outvars else ()):
                if pos < len(args) and getattr(args[pos], "ndim", 0):
                    args[pos] = jax.lax.with_sharding_constraint(args[pos], sharding)
            with ctx:
                outs = eqn.primitive.bind(*subfuns, *args, **bind_params)
            return outs if eqn.primitive.multiple_results else (outs,)

        again: dict[int, Any] = {}      # [replay] recomputed copies

        def recompute(g: int, anchor: list[Any]) -> list[Any]:
            """Bind group ``g`` again from its kept operands, barriered with
            ``anchor`` (backward values: the copy waits for them); returns
            ``anchor`` as it left the barrier."""
            eqns = [flat.eqns[k] for k in replay.groups[g]]
            made = {o for fe in eqns for o in fe.outvars}
            for fe in eqns:     # another group's values first (a shared weight copy)
                for x in fe.invars:
                    if isinstance(x, int) and x not in made and x in replay.group_of \
                            and x not in again:
                        recompute(replay.group_of[x], [])
            kept = sorted({x for fe in eqns for x in fe.invars if isinstance(x, int)
                           and x not in made and x not in again})
            fenced = jax.lax.optimization_barrier((tuple(env[x] for x in kept), tuple(anchor)))
            local = dict(zip(kept, fenced[0]))
            local.update({x: again[x] for fe in eqns for x in fe.invars
                          if isinstance(x, int) and x in again})
            for fe in eqns:
                args = [x.value if isinstance(x, Lit) else local[x] for x in fe.invars]
                for i, v in zip(fe.outvars, bind(fe, args), strict=True):
                    sharding = constraints.get(i)
                    local[i] = v if sharding is None else jax.lax.with_sharding_constraint(
                        v, sharding)
            again.update({o: local[o] for fe in eqns for o in fe.outvars
                          if replay.group_of.get(o) == g})
            return list(fenced[1])

        fenced: dict[int, dict[int, Any]] = {}   # checkpoint call -> its operands, fenced

        for k, fe in enumerate(flat.eqns):
            if k in fences:
                ops = fences[k]
                values = [again.get(x, read(x)) if replay is not None and not replay.forward[k]
                          else read(x) for x in ops]
                fenced[fe.fence] = dict(zip(ops, jax.lax.optimization_barrier(tuple(values))))
            mine = fenced.get(fe.fence, {})
            args = [mine[x] if isinstance(x, int) and x in mine else read(x) for x in fe.invars]
            for t in (replay.reads(k, fe.invars) if replay is not None else ()):
                if t not in again:
                    pos = [p for p, x in enumerate(fe.invars) if isinstance(x, int)
                           and x not in replay.group_of and getattr(args[p], "ndim", None)
                           is not None]
                    out = recompute(replay.group_of[t], [args[p] for p in pos])
                    for p, v in zip(pos, out):
                        args[p] = v
            if replay is not None:
                args = [again.get(x, a) if isinstance(x, int) and not replay.forward[k] else a
                        for x, a in zip(fe.invars, args)]
            for i, v in zip(fe.outvars, bind(fe, args), strict=True):
                write(i, v)
        return [read(x) for x in flat.outvars]

    return evaluate


def checkpoint_fences(flat: FlatJaxpr) -> dict[int, tuple[int, ...]]:
    """First equation of each inlined differentiated ``jax.checkpoint`` call
    (``FlatEqn.fence``) -> the operands its equations read from outside it.

    jax lowers such a call with its operands behind one
    ``optimization_barrier`` (``prevent_cse``); a ``lax.scan`` boundary does
    the same for ``prevent_cse=False``.  Inlined and unrolled, neither is
    left, and XLA may merge the recomputation with the forward's identical
    values or run it early, keeping values alive: the saving gone.  Fencing the operands (the
    backward's cotangents among them) puts it back."""
    born = {o: k for k, fe in enumerate(flat.eqns) for o in fe.outvars}
    first: dict[int, int] = {}
    ops: dict[int, dict[int, None]] = {}
    for k, fe in enumerate(flat.eqns):
        if fe.fence < 0:
            continue
        start = first.setdefault(fe.fence, k)
        # (what the call reads from before it starts: a stream rewrite may
        # have moved one of its equations past a value made later)
        ops.setdefault(fe.fence, {}).update(
            (x, None) for x in fe.invars if isinstance(x, int) and born.get(x, -1) < start)
    return {k: tuple(ops[f]) for f, k in first.items() if ops[f]}


def _bind_params(eqn: Any) -> tuple[Sequence[Any], dict[str, Any]]:
    """(sub-functions, params) to bind ``eqn`` with.  jax 0.10 returns the
    params alone from ``get_bind_params``; older versions a pair."""
    got = eqn.primitive.get_bind_params(eqn.params)
    if isinstance(got, tuple) and len(got) == 2 and isinstance(got[1], dict):
        return got
    return (), got


# ---------------------------------------------------------------------------
# The executable
# ---------------------------------------------------------------------------

class FastPathMiss(Exception):
    """Raised by :meth:`ShardExecutable.call_fast` when the arguments do not fit
    the program of the last call (another signature, arrays placed elsewhere);
    nothing has run and nothing was donated: take the full path."""


class _SignatureChanged(Exception):
    """Raised while jit re-traces a program for arguments it was not built for."""


@dataclasses.dataclass(frozen=True)
class _Compiled:
    """Everything built for one abstract signature of the arguments."""
    jitted: Any                       # the jax.jit of the evaluator
    in_shardings: tuple[Any, ...]     # per argument: pytree of NamedSharding
    out_shardings: Any                # pytree like fn's output: NamedSharding or None
    flat_in_shardings: tuple[NamedSharding, ...]
    treedef: Any                      # of the (global) argument tuple
    batch_leaves: tuple[int, ...]     # flat indices of the leaves of batch arguments
    flat_avals: tuple[Any, ...]       # (global) abstract value of every flat leaf
    # (argnum, key path) of one leaf per donated argument: checked before each
    # fast call (jax 0.10.2 crashes the process on a jit call with a donated array)
    donated_probes: tuple[tuple[int, tuple[Any, ...]], ...] = ()
    # flat indices of the leaves of donated arguments: none may be passed
    # twice (jax 0.10.2 crashes the process donating a buffer twice)
    donated_leaves: frozenset[int] = frozenset()
    # (argnum, key path, shape) of the first leaf of each batch argument: a
    # batch of another size misses the fast path without a jit re-trace
    shape_probes: tuple[tuple[int, tuple[Any, ...], tuple[int, ...]], ...] = ()
    # multi-process: flat leaf index -> assembler of its process-local rows
    assemblers: dict[int, BatchAssembler] = dataclasses.field(default_factory=dict)

    def assembler(self, i: int) -> BatchAssembler:
        a = self.assemblers.get(i)
        if a is None:
            a = self.assemblers[i] = BatchAssembler(self.flat_in_shardings[i],
                                                    self.flat_avals[i].shape)
        return a


def user_meshes(flat: FlatJaxpr) -> Iterable[tuple[Any, Mesh]]:
    """``(sharding, its mesh)`` of every value the step constrains to a mesh
    of its own (``with_sharding_constraint(x, NamedSharding(mesh, ...))``),
    and ``(the shard_map, its mesh)`` of every ``jax.shard_map`` on one."""
    for fe in flat.eqns:
        name = fe.eqn.primitive.name
        if name == "sharding_constraint":
            sharding = fe.eqn.params.get("sharding")
            mesh = getattr(sharding, "mesh", None)
        elif name == "shard_map":
            sharding, mesh = "a jax.shard_map", fe.eqn.params.get("mesh")
        else:
            continue
        if isinstance(mesh, Mesh) and not mesh.empty:
            yield sharding, mesh


def user_mesh_use(sharding: Any) -> str:
    """What :func:`user_meshes` found, in words."""
    return (sharding if isinstance(sharding, str) else
            f"a constraint of a value to {sharding} (with_sharding_constraint)")


def _in_users_order(devices: list[jax.Device], flat: FlatJaxpr) -> list[jax.Device]:
    """``devices`` in the order of the step's own mesh over the same devices,
    where it constrains values to one or runs a shard_map on one: jit runs a
    program on one device order, and the plan's layouts hold in any."""
    ours = {d.id for d in devices}
    orders = {tuple(d.id for d in m.devices.flat) for _, m in user_meshes(flat)}
    same = [o for o in orders if set(o) == ours]
    if len(same) != 1:      # (none; or several orders, which jit refuses itself)
        return devices
    by_id = {d.id: d for d in devices}
    return [by_id[i] for i in same[0]]


def _check_user_meshes(flat: FlatJaxpr, mesh: Mesh) -> None:
    """Refuse a step that constrains a value to a mesh of its own on other
    devices than the plan's (``NamedSharding(mesh4, ...)``): jit cannot run
    the two together."""
    ours = {d.id for d in mesh.devices.flat}
    for sharding, theirs in user_meshes(flat):
        if {d.id for d in theirs.devices.flat} != ours:
            raise RuntimeStageError(
                f"the step runs {user_mesh_use(sharding)} on {theirs.size} devices of a mesh of its own, and the "
                f"plan runs on {len(ours)} devices, not those; use a mesh of the plan's devices, "
                "or drop it (the plan lays out every value)")


class ShardExecutable:
    """``fn`` run under a one-stage plan; called like ``fn``.

    ``args`` are example arguments (arrays or ``jax.ShapeDtypeStruct``) that
    fix the shardings reported by ``in_shardings`` / ``out_shardings``, and
    ``traced`` the step traced for them (:func:`meshplan.trace.trace_for_run`);
    other argument shapes compile their own program on first use, traced by
    ``retrace(args)`` (without it they are refused).  ``donate_argnums``
    defaults to ``(0,)`` (the train state) unless argument 0 is a batch
    argument.  ``devices`` is the pool the plan's device ids index (default
    ``jax.devices()`` sorted by id).

    ``out_shardings`` holds ``None`` for output leaves the plan leaves open:
    jit chooses their sharding.

    Calls after the first go straight to the jitted program of the previous
    call (jit's own C++ dispatch checks shapes, dtypes and shardings); only
    when that program does not fit -- other shapes, arrays placed elsewhere --
    are the arguments matched to a signature and placed as planned.

    In a multi-process run (``jax.process_count() > 1``) the mesh must span
    every process; batch arguments are process-local and every other argument
    is the same host value in each process or a global array (see
    :mod:`meshplan.runtime.multihost`).  ``jax.ShapeDtypeStruct`` batch leaves
    (for ``args`` and :meth:`lower`) describe the *global* batch.

    ``replay``: what the program recomputes (the stage's ``recompute``, made
    by :func:`meshplan.runtime.remat.plan_replay` on the step's graph); a
    plan that recomputes is refused without it.
    """

    def __init__(self, fn: Callable[..., Any], plan: Plan, args: Sequence[Any], *,
                 traced: TracedStep,
                 retrace: Callable[[tuple[Any, ...]], TracedStep] | None = None,
                 donate_argnums: Sequence[int] | None = None,
                 devices: Sequence[jax.Device] | None = None,
                 replay: Replay | None = None) -> None:
        if len(plan.stages) != 1:
            raise RuntimeStageError(
                f"ShardExecutable runs one-stage plans; this plan has {len(plan.stages)} stages "
                "(use the pipeline runtime for it)")
        self.fn = fn
        self.plan = plan
        self.stage = plan.stages[0]
        if self.stage.recompute != NONE and replay is None:
            raise RuntimeStageError(f"this plan recomputes ({self.stage.recompute}): give "
                                    "ShardExecutable the replay (meshplan.runtime.remat)")
        self.replay = replay
        if donate_argnums is None:
            donate_argnums = (0,) if args and 0 not in plan.batch_argnums else ()
        self.donate_argnums = tuple(int(a) for a in donate_argnums)
        self.mesh = build_mesh(self.stage.logical_mesh,
                               _in_users_order(stage_devices(self.stage, devices), traced.flat))
        self.multiprocess = is_multiprocess()
        if self.multiprocess:
            check_mesh_spans_processes(self.mesh)
        self._cache: dict[Any, _Compiled] = {}
        self._last: _Compiled | None = None
        self._retrace = retrace
        first = self._entry(tuple(args), traced)
        self.in_shardings = first.in_shardings
        self.out_shardings = first.out_shardings

    # ---- public -----------------------------------------------------------
    def __call__(self, *args: Any) -> Any:
        if self._last is not None:
            try:
                return self.call_fast(args)
            except FastPathMiss:
                pass
        entry = self._entry(args)
        # (the caller's arrays: placing two aliases makes two arrays that may
        # still share one device's buffer)
        _check_aliases(entry, jax.tree_util.tree_leaves(args), args)
        placed = self._place_all(entry, args)
        out = entry.jitted(*placed)
        self._last = entry
        return out

    def call_fast(self, args: tuple[Any, ...]) -> Any:
        """Run ``args`` with the program of the last call, as a hand-written
        ``jax.jit`` would; raises :class:`FastPathMiss` (before anything runs)
        when they do not fit it."""
        entry = self._last
        if entry is None:
            raise FastPathMiss("no call yet")
        if not self.multiprocess:      # (there the batch assembly checks every shape)
            for argnum, path, shape in entry.shape_probes:
                leaf = _follow(args, argnum, path)
                if getattr(leaf, "shape", None) != shape:
                    raise FastPathMiss("another batch shape")
        for argnum, path in entry.donated_probes:
            leaf = _follow(args, argnum, path)
            if isinstance(leaf, jax.Array) and leaf.is_deleted():
                raise deleted_argument(
                    f"argument {argnum} of {getattr(self.fn, '__name__', 'the step')}")
        leaves, treedef = jax.tree_util.tree_flatten(args)
        if treedef != entry.treedef:
            raise FastPathMiss("another argument structure")
        _check_aliases(entry, leaves, args)
        try:
            if self.multiprocess:
                args = self._assemble_batches(entry, leaves, treedef)
            else:
                # a host batch (or scalar) placed first: passed as it is, jit would
                # key its cache on the unplaced type and compile the step again
                args = self._place_batches(entry, leaves, treedef)
            return entry.jitted(*args)
        except _SignatureChanged as e:
            raise FastPathMiss(str(e)) from None
        except (ValueError, TypeError, RuntimeError) as e:
            # a leaf an earlier call took over (jit deletes the donated leaves
            # it could alias, not only the one probed above) is the caller's
            # error; else, e.g. an argument committed to another sharding:
            # jit refuses it before running, and the full path places it
            where = _deleted_leaf(args)
            if where is not None:
                raise deleted_argument(where) from None
            if isinstance(e, RuntimeError):
                raise
            raise FastPathMiss(str(e)) from e

    def lower(self, *args: Any) -> jax.stages.Lowered:
        """The ``jax.stages.Lowered`` of the step exactly as ``__call__`` runs it
        (``args`` may be ``jax.ShapeDtypeStruct`` pytrees)."""
        entry = self._entry(args)
        view = self._global_view(args)
        return entry.jitted.lower(*_abstract_args(view, entry.in_shardings))

    def __repr__(self) -> str:
        name = getattr(self.fn, "__name__", "fn")
        return f"ShardExecutable({name}, mesh {self.stage.logical_mesh}, {len(self._cache)} signature(s))"

    # ---- placing ----------------------------------------------------------
    def _global_view(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        if not self.multiprocess:
            return tuple(args)
        return global_view(args, self.plan.batch_argnums)

    def _place_all(self, entry: _Compiled, args: tuple[Any, ...]) -> tuple[Any, ...]:
        where = _deleted_leaf(args)
        if where is not None:
            raise deleted_argument(where)
        leaves, treedef = jax.tree_util.tree_flatten(args)
        if not self.multiprocess:
            placed = [place(x, s) for x, s in zip(leaves, entry.flat_in_shardings)]
        else:
            batch = set(entry.batch_leaves)
            placed = []
            for i, (x, s) in enumerate(zip(leaves, entry.flat_in_shardings)):
                if i in batch and is_local_batch_leaf(x):
                    placed.append(entry.assembler(i)(x))
                else:
                    placed.append(place_global(x, s, entry.flat_avals[i].dtype))
        return tuple(jax.tree_util.tree_unflatten(treedef, placed))

    def _place_batches(self, entry: _Compiled, leaves: list[Any], treedef: Any
                       ) -> tuple[Any, ...]:
        """Fast path: the batch leaves on their planned shardings, and every
        leaf not yet on a device of its own choosing (a Python scalar, a numpy
        array, an uncommitted array: jit keys its cache on that type too)."""
        for i in entry.batch_leaves:
            leaves[i] = place(leaves[i], entry.flat_in_shardings[i])
        for i, x in enumerate(leaves):
            if not isinstance(x, jax.Array) or not x.committed:
                leaves[i] = place(x, entry.flat_in_shardings[i])
        return tuple(jax.tree_util.tree_unflatten(treedef, leaves))

    def _assemble_batches(self, entry: _Compiled, leaves: list[Any], treedef: Any
                          ) -> tuple[Any, ...]:
        """Multi-process fast path: the process-local batch leaves become
        global arrays; the state must already be placed."""
        for i in entry.batch_leaves:
            x = leaves[i]
            if is_local_batch_leaf(x):
                a = entry.assembler(i)
                if tuple(np.shape(x)) != a.local_shape:
                    raise FastPathMiss("another batch shape")
                leaves[i] = a(x)
        return tuple(jax.tree_util.tree_unflatten(treedef, leaves))

    # ---- building ---------------------------------------------------------
    def _entry(self, args: tuple[Any, ...], traced: TracedStep | None = None) -> _Compiled:
        view = self._global_view(tuple(args))
        key = _signature(view)
        entry = self._cache.get(key)
        if entry is None:
            entry = self._build(view, traced)
            self._cache[key] = entry
        return entry

    def _trace(self, args: tuple[Any, ...]) -> TracedStep:
        if self._retrace is None:
            raise StalePlanError("the arguments do not match the shapes this executable was built "
                                 "for; call the parallelized step (it re-plans per signature)")
        return self._retrace(args)

    def _build(self, args: tuple[Any, ...], traced: TracedStep | None) -> _Compiled:
        logical = self.stage.logical_mesh
        named = lambda spec: NamedSharding(self.mesh, spec)  # noqa: E731
        specs = arg_specs(self.plan, args)
        in_shardings = jax.tree_util.tree_map(named, specs,
                                              is_leaf=lambda x: isinstance(x, PartitionSpec))
        host = _host_memory(self.mesh) if self.stage.host_params else None
        if host is not None:
            in_shardings = _on_host(in_shardings, self.plan, self.stage.host_params, host)
        flat_in = tuple(jax.tree_util.tree_leaves(
            in_shardings, is_leaf=lambda x: isinstance(x, NamedSharding)))
        # offloaded leaves come to the device's own memory where the step reads them
        device_kind = self.mesh.devices.flat[0].default_memory().kind
        to_device = {i: s.with_memory_kind(device_kind)
                     for i, s in enumerate(flat_in) if host is not None and s.memory_kind == host}
        leaves, in_treedef = jax.tree_util.tree_flatten(args)
        batch_leaves: list[int] = []
        offset = 0
        for argnum, arg in enumerate(args):
            count = len(jax.tree_util.tree_leaves(arg))
            if argnum in self.plan.batch_argnums:
                batch_leaves.extend(range(offset, offset + count))
            offset += count

        traced = traced if traced is not None else self._trace(args)
        out_shape, flat = traced.out_shape, traced.flat
        _check_user_meshes(flat, self.mesh)
        in_avals = tuple(flat.avals[i] for i in flat.invars)
        constraints: dict[int, NamedSharding] = {}
        for tid, spec in self.stage.constraints:
            aval = flat.avals.get(tid)
            if aval is None or not hasattr(aval, "shape"):
                continue  # a literal of the Graph, not a value of the stream
            check_spec(spec, aval.shape, logical, f"constraint on tensor t{tid}")
            constraints[tid] = named(to_partition_spec(spec))

        reads = {tid: [(pos, named(to_partition_spec(spec))) for pos, spec in steps]
                 for tid, steps in read_layouts(self.stage, flat).items()}

        out_table = dict(self.stage.outputs)
        host_out = frozenset(self.stage.host_outputs) if host is not None else frozenset()

        def out_one(path: Any, leaf: Any) -> NamedSharding | None:
            key = jax.tree_util.keystr(path)
            spec = out_table.get(key)
            if spec is None:
                return None
            check_spec(spec, _shape_of(leaf), logical, f"output leaf {key or '<root>'}")
            sharding = named(to_partition_spec(spec))
            # (the new offloaded state goes back to host memory as the step ends)
            return sharding.with_memory_kind(host) if key in host_out else sharding

        out_shardings = jax.tree_util.tree_map_with_path(out_one, out_shape)
        out_treedef = jax.tree_util.tree_structure(out_shape)
        if self.multiprocess:
            # constants captured on one local device cannot join a program
            # that spans processes: give them to XLA as host values
            flat = dataclasses.replace(flat, consts=tuple(
                np.asarray(c) if isinstance(c, jax.Array) else c for c in flat.consts))
        if self.replay is not None and len(self.replay.forward) != len(flat.eqns):
            raise StalePlanError("the step traced for these arguments has other equations than "
                                 "the one its recomputation was planned on; re-plan")
        evaluate = make_evaluator(flat, constraints, reads, self.replay,
                                  {flat.invars[i]: s for i, s in to_device.items()})
        expected = tuple((tuple(a.shape), a.dtype) for a in in_avals)

        def step(*step_args: Any) -> Any:
            flat_args, treedef = jax.tree_util.tree_flatten(step_args)
            # jit re-traces when called with other shapes (the fast path
            # tries the last program first): refuse to replay this stream
            if treedef != in_treedef or len(flat_args) != len(expected) or any(
                    tuple(x.shape) != shape or x.dtype != dtype
                    for x, (shape, dtype) in zip(flat_args, expected)):
                raise _SignatureChanged("the arguments do not match this program")
            outs = evaluate(*flat_args)
            return jax.tree_util.tree_unflatten(out_treedef, outs)

        step.__name__ = getattr(self.fn, "__name__", "step")
        step.__qualname__ = step.__name__
        donated = tuple(a for a in self.donate_argnums if a < len(args))
        jitted = jax.jit(step, in_shardings=in_shardings, out_shardings=out_shardings,
                         donate_argnums=donated)
        probes, shapes = [], []
        for a in range(len(args)):
            with_path = jax.tree_util.tree_flatten_with_path(args[a])[0]
            if not with_path:
                continue
            path, leaf = with_path[0]
            if a in donated:
                probes.append((a, tuple(path)))
            if a in self.plan.batch_argnums and hasattr(leaf, "shape"):
                shapes.append((a, tuple(path), tuple(leaf.shape)))
        sizes = [len(jax.tree_util.tree_leaves(a)) for a in args]
        starts = np.cumsum([0] + sizes)
        donated_leaves = frozenset(i for a in donated for i in range(starts[a], starts[a + 1]))
        return _Compiled(jitted, in_shardings, out_shardings, flat_in, in_treedef,
                         tuple(batch_leaves), in_avals, tuple(probes), donated_leaves,
                         tuple(shapes))


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------

def _signature(args: tuple[Any, ...]) -> Any:
    return signature(args, weak_types=True)


def _check_aliases(entry: _Compiled, leaves: list[Any], args: tuple[Any, ...]) -> None:
    """Refuse, before anything runs, one array passed as a donated leaf and
    as another leaf (optax's ``LookaheadParams.init_synced`` makes two);
    ``leaves``: those of ``args``."""
    if not entry.donated_leaves or len({id(x) for x in leaves}) == len(leaves):
        return
    paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(args)[0]]
    check_donated_aliases(enumerate(leaves), entry.donated_leaves,
                          lambda k: f"argument {paths[k][0].idx}"
                                    f"{jax.tree_util.keystr(paths[k][1:])}")


def check_donated_aliases(leaves: Iterable[tuple[Any, Any]], donated: Container[Any],
                          name: Callable[[Any], str]) -> None:
    """Refuse one array passed as a donated leaf and as another leaf (it
    would be taken over twice): ``leaves`` are (key, value) pairs, ``donated``
    the donated keys, ``name(key)`` a leaf's name for the message."""
    seen: dict[int, Any] = {}
    for key, value in leaves:
        if not isinstance(value, jax.Array):
            continue
        first = seen.setdefault(id(value), key)
        if first != key and (key in donated or first in donated):
            raise RuntimeStageError(f"{name(first)} and {name(key)} are the same array, and a "
                                    "donated argument holds it; pass distinct arrays or do not "
                                    "donate")


def _follow(args: tuple[Any, ...], argnum: int, path: tuple[Any, ...]) -> Any:
    """The leaf at ``path`` inside ``args[argnum]``, or None (a path that does
    not lead anywhere: the arguments have another structure)."""
    try:
        node = args[argnum]
        for key in path:
            if isinstance(key, jax.tree_util.DictKey):
                node = node[key.key]
            elif isinstance(key, jax.tree_util.SequenceKey):
                node = node[key.idx]
            elif isinstance(key, jax.tree_util.GetAttrKey):
                node = getattr(node, key.name)
            else:                      # a custom node: flatten what is left
                node = jax.tree_util.tree_leaves(node)[0]
                break
    except (KeyError, IndexError, AttributeError, TypeError):
        return None
    return node


HOST_MEMORY = "pinned_host"


def _host_memory(mesh: Any) -> str:
    """The memory kind offloaded leaves live in, refused where the backend has none."""
    kinds = {m.kind for m in mesh.devices.flat[0].addressable_memories()}
    if HOST_MEMORY not in kinds:
        raise RuntimeStageError(
            f"this plan keeps state in host memory ({HOST_MEMORY!r}), which "
            f"{mesh.devices.flat[0].platform} devices do not offer (their memories: "
            f"{', '.join(sorted(kinds))}); re-plan with offload='none'")
    return HOST_MEMORY


def _on_host(in_shardings: tuple[Any, ...], plan: Plan, keys: Sequence[str], host: str
             ) -> tuple[Any, ...]:
    """``in_shardings`` with the leaves ``keys`` names (params keys) in ``host`` memory."""
    wanted = frozenset(keys)
    prefixes = plan.key_prefixes(len(in_shardings))
    out = []
    for argnum, tree in enumerate(in_shardings):
        if argnum in plan.batch_argnums:
            out.append(tree)
            continue

        def one(path: Any, s: NamedSharding, prefix: str = prefixes.get(argnum, "")) -> Any:
            key = prefix + jax.tree_util.keystr(path)
            return s.with_memory_kind(host) if key in wanted else s
        out.append(jax.tree_util.tree_map_with_path(
            one, tree, is_leaf=lambda x: isinstance(x, NamedSharding)))
    return tuple(out)


def _deleted_leaf(args: tuple[Any, ...]) -> str | None:
    """``argument N[path]`` of the first deleted array among ``args``."""
    for path, x in jax.tree_util.tree_leaves_with_path(tuple(args)):
        if isinstance(x, jax.Array) and x.is_deleted():
            return argument_leaf(path)
    return None


def place(x: Any, sharding: NamedSharding) -> Any:
    """``x`` on ``sharding``; arrays already placed that way are passed through."""
    if isinstance(x, jax.Array) and not x.is_deleted():
        current = getattr(x, "sharding", None)
        # only a NamedSharding on the same mesh passes through: an equivalent
        # SingleDeviceSharding (a one-device plan) gives jit another input
        # type than the step's own outputs, and the second call compiles again
        if current is not None and (current == sharding
                                    or (isinstance(current, NamedSharding)
                                        and current.mesh == sharding.mesh
                                        and current.is_equivalent_to(sharding, x.ndim))):
            return x
    return jax.device_put(x, sharding)


def _abstract_args(args: tuple[Any, ...], in_shardings: tuple[Any, ...]) -> tuple[Any, ...]:
    """``args`` with every array replaced by a ShapeDtypeStruct carrying its
    planned sharding (so lowering never trips over where an array lives)."""
    def one(x: Any, s: NamedSharding) -> Any:
        if isinstance(x, (jax.Array, jax.ShapeDtypeStruct, np.ndarray)):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s,
                                        weak_type=bool(getattr(x, "weak_type", False)))
        return x
    return tuple(jax.tree_util.tree_map(one, a, s) for a, s in zip(args, in_shardings))
