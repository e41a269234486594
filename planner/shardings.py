"""A plan bound to jax: ``Mesh``, ``PartitionSpec`` and ``NamedSharding``.

The pure construction the runtime and :meth:`meshplan.Plan.shardings` share:
the mesh of a stage on real devices, the plan's spec of every argument leaf
(keyed by its argument's section prefix and ``keystr`` path, see
:mod:`meshplan.plan`), and the checks that a spec fits a tensor.  It reads
plans by their fields only (no import of :mod:`meshplan.plan`, which calls
into this module).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Mapping, NamedTuple, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from . import tpu
from .errors import (ClusterSpecError, MeshplanError, PlanFormatError, RuntimeStageError,
                     StalePlanError)
from .specs import Spec, spec_axes, spec_str

if TYPE_CHECKING:      # (annotations only: plan.py imports this module)
    from .graph import Graph
    from .plan import LogicalMesh, Plan, Stage

__all__ = ("build_mesh", "stage_devices", "to_partition_spec", "check_spec", "arg_specs",
           "StageShardings", "plan_shardings", "check_arguments", "check_updates_in_place")


# ---------------------------------------------------------------------------
# Meshes and specs
# ---------------------------------------------------------------------------

def build_mesh(logical_mesh: LogicalMesh,
               devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ``jax.sharding.Mesh`` of ``logical_mesh``'s shape and axis names.

    ``devices`` (default: the first ``logical_mesh.size`` of ``jax.devices()``
    sorted by id) fill the mesh in row-major order.  All axes are
    ``AxisType.Auto`` so that jit propagates shardings between the planned
    ones.
    """
    if devices is None:
        devices = sorted_devices()[:logical_mesh.size]
    devices = list(devices)
    if len(devices) < logical_mesh.size:
        raise RuntimeStageError(
            f"the plan's mesh {logical_mesh} needs {logical_mesh.size} devices, but only "
            f"{len(devices)} are available ({_platforms(devices)}); re-plan for this machine "
            "(cluster=meshplan.Cluster.local()) or run where enough devices exist")
    if len(devices) > logical_mesh.size:
        raise RuntimeStageError(
            f"the plan's mesh {logical_mesh} has {logical_mesh.size} devices, but "
            f"{len(devices)} were given to build it; pass exactly {logical_mesh.size}")
    grid = np.empty(len(devices), dtype=object)
    grid[:] = devices
    return Mesh(grid.reshape(logical_mesh.shape), logical_mesh.axes,
                axis_types=(AxisType.Auto,) * len(logical_mesh.axes))


def stage_devices(stage: Stage, devices: Sequence[jax.Device] | None = None) -> list[jax.Device]:
    """The devices of ``stage``: its plan device ids taken as positions in
    ``devices`` (default ``jax.devices()`` in plan id order, :func:`sorted_devices`)."""
    pool = sorted_devices() if devices is None else list(devices)
    missing = [d for d in stage.devices if not 0 <= d < len(pool)]
    if missing:
        raise RuntimeStageError(
            f"the plan places its stage on device ids {_short(stage.devices)}, but only "
            f"{len(pool)} devices are available ({_platforms(pool)}); re-plan for this machine "
            "(cluster=meshplan.Cluster.local()) or run where enough devices exist")
    return [pool[d] for d in stage.devices]


def to_partition_spec(spec: Spec) -> PartitionSpec:
    """The ``PartitionSpec`` of a plan spec (tuples of axis names stay tuples)."""
    return PartitionSpec(*spec)


def check_spec(spec: Spec, shape: Sequence[int], mesh: LogicalMesh, what: str) -> None:
    """Refuse a spec that cannot split a tensor of ``shape`` over ``mesh``.

    Raises :class:`StalePlanError` when the rank differs, an axis is unknown
    or used twice, or a dimension does not divide by the product of the mesh
    axes that split it.
    """
    shape = tuple(int(s) for s in shape)
    if len(spec) != len(shape):
        raise StalePlanError(
            f"{what}: the plan gives {spec_str(spec)} ({len(spec)} dimension(s)) for a tensor of "
            f"shape {shape} ({len(shape)} dimension(s)); the plan was made for other arguments, "
            "or edited: give one entry per dimension, or re-plan with these arguments")
    axes = spec_axes(spec)
    unknown = [a for a in axes if a not in mesh.axes]
    if unknown:
        raise StalePlanError(f"{what}: the plan's spec {spec_str(spec)} names mesh axis "
                             f"{unknown[0]!r}, which the mesh ({mesh}) does not have; re-plan")
    if len(set(axes)) != len(axes):
        raise StalePlanError(f"{what}: the plan's spec {spec_str(spec)} uses a mesh axis twice; re-plan")
    for dim, (size, d) in enumerate(zip(shape, spec)):
        names = (d,) if isinstance(d, str) else (d or ())
        ways = int(np.prod([mesh.axis_size(a) for a in names], dtype=np.int64))
        if size % ways:
            raise StalePlanError(
                f"{what}: dimension {dim} has size {size}, which the plan splits {ways} ways over "
                f"mesh axis {'x'.join(names)} ({mesh}); {size} is not divisible by {ways}. Use a "
                f"size that is a multiple of {ways}, or re-plan for these shapes")


def _section_keys(plan: Plan, nargs: int, stage: int = 0
                  ) -> dict[int, tuple[Mapping[str, Spec], str]]:
    """argnum -> (the spec table its leaves are keyed in, the key prefix).

    Non-batch arguments live in ``stages[stage].params``, batch arguments in
    ``plan.batch``; each section numbers its own arguments
    (:meth:`meshplan.plan.Plan.key_prefixes`).
    """
    prefixes = plan.key_prefixes(nargs)
    params = dict(plan.stages[stage].params)
    batch_table = dict(plan.batch)
    return {a: (batch_table if a in plan.batch_argnums else params, prefixes[a])
            for a in range(nargs)}


def arg_specs(plan: Plan, args: Sequence[Any]) -> tuple[Any, ...]:
    """PartitionSpecs for ``args``: a tuple of pytrees shaped like ``args``.

    A leaf's key is its argument's prefix followed by ``keystr`` of its path
    inside the argument.  Leaves the plan does not name are replicated
    (``P()``); a spec that does not fit the leaf raises :class:`StalePlanError`.
    """
    if not plan.stages:
        raise StalePlanError("the plan has no stages; re-plan")
    mesh = plan.stages[0].logical_mesh
    sections = _section_keys(plan, len(args))
    out = []
    for argnum, arg in enumerate(args):
        table, prefix = sections[argnum]

        def one(path: Any, leaf: Any, table: Mapping[str, Spec] = table, prefix: str = prefix,
                argnum: int = argnum) -> PartitionSpec:
            key = prefix + jax.tree_util.keystr(path)
            spec = table.get(key)
            if spec is None:
                return PartitionSpec()
            check_spec(spec, shape_of(leaf), mesh, f"argument {argnum} leaf {key or '<root>'}")
            return to_partition_spec(spec)

        out.append(jax.tree_util.tree_map_with_path(one, arg))
    return tuple(out)


# ---------------------------------------------------------------------------
# Plan.shardings
# ---------------------------------------------------------------------------

class StageShardings(NamedTuple):
    """``(mesh, in_shardings, out_shardings)`` of a plan (or of one pipeline
    stage), ready for ``jax.jit(step, in_shardings=..., out_shardings=...)``."""
    mesh: Mesh
    in_shardings: tuple[Any, ...]
    out_shardings: Any


def plan_shardings(plan: Plan, args: Sequence[Any], step: Callable[..., Any] | None = None,
                   devices: Sequence[jax.Device] | None = None
                   ) -> StageShardings | tuple[StageShardings, ...]:
    """:meth:`meshplan.Plan.shardings` (see there)."""
    if not plan.stages:
        raise StalePlanError("the plan has no stages; re-plan")
    args = tuple(args)
    check_arguments(plan, args)
    out_tree = jax.eval_shape(step, *args) if step is not None else None
    if len(plan.stages) == 1:
        st = plan.stages[0]
        mesh = build_mesh(st.logical_mesh, stage_devices(st, devices))
        in_shardings = jax.tree.map(lambda spec: NamedSharding(mesh, spec), arg_specs(plan, args),
                                    is_leaf=lambda x: isinstance(x, PartitionSpec))
        return StageShardings(mesh, in_shardings, _out_shardings(st, mesh, out_tree))
    return tuple(_pipeline_stage(plan, k, args, out_tree, devices)
                 for k in range(len(plan.stages)))


def _pipeline_stage(plan: Plan, k: int, args: tuple[Any, ...], out_tree: Any,
                    devices: Sequence[jax.Device] | None) -> StageShardings:
    """Stage ``k``'s triple: its parameters and state on its mesh, the leaves
    other stages hold ``None``, batch leaves laid out as one micro-batch."""
    st = plan.stages[k]
    mesh = build_mesh(st.logical_mesh, stage_devices(st, devices))
    sections = _section_keys(plan, len(args), k)
    B = plan.num_micro_batches
    out = []
    for argnum, arg in enumerate(args):
        table, prefix = sections[argnum]
        is_batch = argnum in plan.batch_argnums

        def one(path: Any, leaf: Any, table: Mapping[str, Spec] = table, prefix: str = prefix,
                is_batch: bool = is_batch) -> NamedSharding | None:
            key = prefix + jax.tree_util.keystr(path)
            spec = table.get(key)
            if not is_batch:
                if spec is None:
                    return None           # another stage's leaf
                check_spec(spec, shape_of(leaf), st.logical_mesh, f"stage {k} argument {key}")
                return NamedSharding(mesh, to_partition_spec(spec))
            shape = shape_of(leaf)
            micro = (shape[0] // B,) + shape[1:] if shape else shape
            try:    # (as the runtime: a spec that does not fit this mesh replicates)
                if spec is not None:
                    check_spec(spec, micro, st.logical_mesh, f"stage {k} batch {key}")
            except StalePlanError:
                spec = None
            return NamedSharding(mesh, to_partition_spec(spec or ()))

        out.append(jax.tree_util.tree_map_with_path(one, arg))
    # the plan records no output layouts of pipeline stages: jit chooses them
    outs = None if out_tree is None else jax.tree.map(lambda _: None, out_tree)
    return StageShardings(mesh, tuple(out), outs)


def _out_shardings(st: Stage, mesh: Mesh, out_tree: Any) -> Any:
    """A pytree like ``out_tree`` of the stage's planned output shardings;
    ``None`` where the plan leaves a leaf open (jit chooses), and ``None``
    without an output tree."""
    if out_tree is None:
        return None
    table = dict(st.outputs)

    def one(path: Any, leaf: Any) -> NamedSharding | None:
        key = jax.tree_util.keystr(path)
        spec = table.get(key)
        if spec is None:
            return None
        check_spec(spec, shape_of(leaf), st.logical_mesh, f"output leaf {key or '<root>'}")
        return NamedSharding(mesh, to_partition_spec(spec))
    return jax.tree_util.tree_map_with_path(one, out_tree)


# (Unstacked.note says this of a plan whose step scans over stacked layers)
UNROLLED_MARK = "stacked layers was unrolled"
UNROLLED_SCAN = (
    "this step's lax.scan over stacked layers was unrolled for planning, so the plan lays out "
    "per-layer arguments that the step as written never sees; run it with "
    "meshplan.parallelize, or write the step without the scan for a plain jax.jit")


def check_arguments(plan: Plan, args: Sequence[Any]) -> None:
    """Refuse arguments the plan was not made for: too few, or leaves the
    plan names that are missing (another structure, another model)."""
    argnums = [a for a, _ in plan.arg_prefixes]
    want = max(argnums) + 1 if argnums else 1
    if len(args) < want:
        raise StalePlanError(
            f"the plan was made for a step of {want} argument(s), got {len(args)}; pass all "
            "the step's arguments (arrays or jax.ShapeDtypeStruct) in the order the step "
            "takes them")
    prefixes = plan.key_prefixes(len(args))
    present = {prefixes.get(a, "") + jax.tree_util.keystr(path)
               for a, arg in enumerate(args)
               for path, _ in jax.tree_util.tree_flatten_with_path(arg)[0]}
    named = dict(plan.batch)
    for st in plan.stages:
        named.update(st.params)
    missing = sorted(k for k in named if k not in present)
    if missing and any(UNROLLED_MARK in n for n in plan.notes):
        raise MeshplanError(UNROLLED_SCAN)
    if missing:
        raise StalePlanError(
            f"the plan names {len(missing)} argument leaf/leaves these arguments lack (e.g. "
            f"{missing[0]}); pass the arguments the plan was made for, with the same pytree "
            "structure, or re-plan for these arguments (a key edited by hand must name an "
            "argument leaf as jax.tree_util.keystr writes its path)")


def check_updates_in_place(plan: Plan, graph: Graph, nargs: int) -> None:
    """Refuse a plan (a hand-edited file) that lays out an updated argument
    leaf and its new value differently: meshplan's plans keep the new value
    in its argument's layout, where the donated buffer takes it, and a spec
    edited on one side only would apply to that side alone."""
    prefixes = plan.key_prefixes(nargs)
    for k, st in enumerate(plan.stages):
        params, outputs = dict(st.params), dict(st.outputs)
        for o in graph.outputs:
            if o.updates is None:
                continue
            leaf = graph.inputs[o.updates]
            key = prefixes.get(leaf.argnum, "") + leaf.path
            a, b = params.get(key), outputs.get(o.path)
            if a is None or b is None:
                continue
            shape = graph.tensors[leaf.tensor].shape
            check_spec(a, shape, st.logical_mesh, f"argument leaf {key}")
            check_spec(b, shape, st.logical_mesh, f"output leaf {o.path or '<root>'}")
            if _canonical(a) == _canonical(b):
                continue
            where = f" of stage {k}" if len(plan.stages) > 1 else ""
            raise PlanFormatError(
                f"the plan{where} lays out argument leaf {key} as {spec_str(a)} but its new "
                f"value, output leaf {o.path or '<root>'}, as {spec_str(b)}; an updated value "
                "keeps its argument's layout (the donated buffer): give both entries the same "
                "spec, or re-plan")


def _canonical(spec: Spec) -> tuple[tuple[str, ...], ...]:
    """``spec`` compared as jax compares PartitionSpecs: ``'x'`` is ``('x',)``
    and trailing unsplit dimensions are dropped."""
    dims = [(d,) if isinstance(d, str) else tuple(d or ()) for d in spec]
    while dims and not dims[-1]:
        dims.pop()
    return tuple(dims)


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------

def sorted_devices() -> list[jax.Device]:
    """jax's devices in plan id order: by id; on a TPU by slice, then torus
    position (meshplan's chip numbering, :mod:`meshplan.tpu`), so that a
    plan's axes land on the rings the planner costed them on."""
    return tpu_order(sorted(jax.devices(), key=lambda d: d.id))


def tpu_order(devices: list[Any]) -> list[Any]:
    """TPU ``devices`` (with ``coords``) by slice and chip number; any other
    devices, or TPU devices whose coordinates fill no torus, as given."""
    if not devices or getattr(devices[0], "platform", "") != "tpu":
        return devices
    try:
        _, topology, order = tpu.topology_of(devices)
    except ClusterSpecError:
        return devices
    chips = int(np.prod(topology))
    rank = {id(d): s * chips + c for d, (s, c) in zip(devices, order)}
    return sorted(devices, key=lambda d: rank[id(d)])


def _platforms(devices: Sequence[jax.Device]) -> str:
    kinds = sorted({getattr(d, "platform", "?") for d in devices}) or ["none"]
    return "/".join(kinds)


def _short(ids: Sequence[int]) -> str:
    ids = list(ids)
    return str(ids) if len(ids) <= 8 else f"[{ids[0]}, {ids[1]}, ..., {ids[-1]}]"


def shape_of(leaf: Any) -> tuple[int, ...]:
    shape = getattr(leaf, "shape", None)
    return tuple(shape) if shape is not None else np.shape(leaf)
