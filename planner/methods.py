"""Parallelization methods: what the user asks the planner to do.

Plain frozen data; each lowers itself once into a :class:`PlanRequest`
(``method.request(num_devices)``), which ``meshplan.planning.plan_step`` runs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .errors import MeshplanError
from .request import OFFLOAD_MODES, PipelineOptions, PlanRequest

def normalize_argnums(argnums: Any) -> tuple[int, ...]:
    """``batch_argnums`` as jax takes argnums: an int or a sequence of ints."""
    if isinstance(argnums, bool):
        raise TypeError("batch_argnums must be an int or a sequence of ints, not a bool")
    out = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    if not all(isinstance(a, int) and not isinstance(a, bool) for a in out):
        raise TypeError(f"batch_argnums must be an int or a sequence of ints, got {argnums!r}")
    if any(a < 0 for a in out):
        raise TypeError(f"batch_argnums={argnums!r}: give the batch arguments' positions counted "
                        "from 0 (negative positions are not taken)")
    return out


# What a searched schedule ("auto") may be: every schedule the runtime runs.
# The first of equally fast ones wins, so 1F1B where nothing else gains.
# Interleaved 1F1B answers a fixed stage count N with N device groups of
# virtual stages, so it is searched by default only where the count is.
AUTO_SCHEDULES = ("1f1b", "gpipe", "interleaved", "zb-h1")

SCHEDULES = ("auto", "gpipe", "1f1b", "interleaved", "zb-h1")

# Manual's remat names (DESIGN.md) and what each means (selective:
# meshplan.recompute); "auto" is None
REMAT_NAMES = {"none": False, "full": True, "selective": "selective"}


def _check_mesh(m: Any) -> None:
    """``mesh_shape``: positive ints; ``axis_names``: as many distinct names."""
    shape, names = m.mesh_shape, m.axis_names
    if shape is not None and (not isinstance(shape, (tuple, list)) or not all(
            isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in shape)):
        raise MeshplanError(f"{type(m).__name__}(mesh_shape={shape!r}): give a tuple of positive "
                            "ints, e.g. (2, 4)")
    if names is None:
        return
    if not isinstance(names, (tuple, list)) or not all(isinstance(a, str) for a in names) \
            or len(set(names)) != len(names):
        raise MeshplanError(f"{type(m).__name__}(axis_names={names!r}): give a tuple of distinct "
                            "names, e.g. ('data', 'model')")
    if shape is None or len(shape) != len(names):
        raise MeshplanError(f"{type(m).__name__}(axis_names={names!r}) names "
                            f"{len(names)} mesh axes; give mesh_shape with as many")


@dataclass(frozen=True)
class ShardParallel:
    """One stage; the ILP chooses every sharding.  ``mesh_shape`` fixes the
    logical mesh (e.g. ``(2, 4)``); ``None`` tries every shape.
    ``memory_fraction``: of each device's memory the plan may use.
    ``remat``: ``"none"``/``False`` (the default) the step keeps every
    activation; ``"full"``/``True`` or ``"selective"`` it recomputes them
    (as :class:`Manual`'s); ``"auto"`` the fastest of the three that fits.
    A recomputing plan is priced layer by layer (the stage search with one
    stage and one micro-batch) and runs as one program.
    ``offload``: ``"optimizer"`` keeps the optimizer state in host memory
    between steps, ``"auto"`` only where the plan does not fit without it,
    ``"none"`` never (:mod:`meshplan.offload`); a recomputing plan does not
    offload."""
    mesh_shape: tuple[int, ...] | None = None
    axis_names: tuple[str, ...] | None = None
    time_limit: float = 60.0
    backend: str = "highs"
    memory_fraction: float = 0.9
    remat: bool | str = False
    offload: str = "auto"
    name = "shard"

    def __post_init__(self) -> None:
        _check_fraction(self)
        _check_mesh(self)
        r = self.remat
        _check_remat(self, (True, False, "selective", "auto"),
                     "'none', 'selective', 'full', 'auto', True or False")
        _check_offload(self)
        if self.remat is not False and self.offload == "optimizer":
            raise MeshplanError(f"ShardParallel(remat={r!r}, offload='optimizer'): a recomputing "
                                "plan does not offload yet; use one of them")

    def request(self, num_devices: int) -> PlanRequest:
        meshes = None
        if self.mesh_shape is not None:
            shape = tuple(int(s) for s in self.mesh_shape)
            if math.prod(shape) != num_devices:
                raise MeshplanError(f"ShardParallel(mesh_shape={shape}) has {math.prod(shape)} "
                                    f"devices but the cluster has {num_devices}: give a mesh shape "
                                    f"(CLI --mesh) whose product is {num_devices}, or none to "
                                    "search every shape")
            meshes = shape
        if self.remat is not False:
            return PlanRequest("shard", pipeline=PipelineOptions(
                num_micro_batches=(1,), schedules=("1f1b",), num_stages=1,
                mesh_shape=meshes, axis_names=self.axis_names,
                remat=None if self.remat == "auto" else self.remat,
                time_limit=self.time_limit, backend=self.backend,
                memory_fraction=float(self.memory_fraction)),
                # ("auto": recomputing nothing, the whole-graph ILP's plan is
                # one of the three, and more exact than a sum of layer costs)
                one_stage_by_whole_graph=self.remat == "auto",
                time_limit=self.time_limit, backend=self.backend,
                memory_fraction=float(self.memory_fraction))
        return PlanRequest("shard", mesh_shape=meshes, axis_names=self.axis_names,
                           time_limit=self.time_limit, backend=self.backend,
                           memory_fraction=float(self.memory_fraction), offload=self.offload)


@dataclass(frozen=True)
class DataParallel:
    """Replicated parameters and optimizer state, batch split over all devices.
    ``offload`` as for :class:`ShardParallel`."""
    time_limit: float = 60.0
    backend: str = "highs"
    memory_fraction: float = 0.9
    offload: str = "auto"
    name = "data"

    def __post_init__(self) -> None:
        _check_fraction(self)
        _check_offload(self)

    def request(self, num_devices: int) -> PlanRequest:
        return PlanRequest("data", mesh_shape=(num_devices,), axis_names=("data",),
                           input_layouts="replicated", batch_split=num_devices,
                           batch_split_by="DataParallel", time_limit=self.time_limit,
                           backend=self.backend, memory_fraction=float(self.memory_fraction),
                           offload=self.offload)


@dataclass(frozen=True)
class Manual:
    """A hand-given Megatron-style plan: ``dp`` x ``tp`` devices per stage
    (batch split over ``data``, parameters over ``model``), ``pp`` stages.
    ``remat``: ``None`` each stage recomputes its activations only if it must
    to fit (selectively, or fully where that is not enough);
    ``"full"``/``True`` every stage recomputes its forward (as Megatron-LM's
    older runs do); ``"selective"`` every stage recomputes its attention-score
    region only (Korthikanti et al. 2022); ``"none"``/``False`` none does.
    ``offload``: ``"optimizer"`` keeps the optimizer state in host memory
    between steps (one stage, one micro-batch, no recomputation: the
    one-program path), ``"auto"`` only where the plan does not fit without
    it, ``"none"`` (the default) never.
    ``sequence_parallel``: the activations between layers split along the
    sequence over ``model`` (Megatron-LM's sequence parallelism;
    :class:`~meshplan.ilp.InputLayouts`), for pipelined plans."""
    dp: int = 1
    tp: int = 1
    pp: int = 1
    num_micro_batches: int = 1
    schedule: str = "1f1b"
    time_limit: float = 60.0
    backend: str = "highs"
    remat: bool | str | None = None
    memory_fraction: float = 0.9
    offload: str = "none"
    sequence_parallel: bool = False
    name = "manual"

    def __post_init__(self) -> None:
        for k in ("dp", "tp", "pp", "num_micro_batches"):
            v = getattr(self, k)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise MeshplanError(f"Manual({k}={v!r}): must be a positive integer")
        if self.schedule not in SCHEDULES[1:]:
            raise MeshplanError(f"Manual(schedule={self.schedule!r}): use one of {SCHEDULES[1:]}")
        if self.schedule == "interleaved":
            _check_interleaved(self, self.pp, self.num_micro_batches, "pp")
        _check_remat(self, (None, True, False, "selective"),
                     "None, 'none', 'selective', 'full', True or False")
        _check_fraction(self)
        _check_offload(self)

    def request(self, num_devices: int) -> PlanRequest:
        used = self.dp * self.tp * self.pp
        if used != num_devices:
            raise MeshplanError(f"Manual(dp={self.dp}, tp={self.tp}, pp={self.pp}) uses "
                                f"{used} devices but the cluster has {num_devices}: give dp, tp "
                                f"and pp (CLI --dp, --tp, --pp) whose product is {num_devices}")
        staged = self.pp > 1 or self.num_micro_batches > 1 or self.remat in (True, "selective")
        if self.sequence_parallel and not staged:
            raise MeshplanError("Manual(sequence_parallel=True) plans layers apart: it needs "
                                "pp > 1, num_micro_batches > 1 or remat")
        # (one stage with one micro-batch and recomputation: the stage DP
        # prices it, and the one program recomputes: meshplan.runtime.remat)
        if staged:
            if self.offload == "optimizer":
                raise MeshplanError(
                    f"Manual(offload='optimizer') is planned for one stage without "
                    f"recomputation; this asks for pp={self.pp}, num_micro_batches="
                    f"{self.num_micro_batches}, remat={self.remat!r}: use pp=1, "
                    "num_micro_batches=1 and remat=None/'none', or offload='none'")
            return PlanRequest("manual", pipeline=PipelineOptions(
                num_micro_batches=(self.num_micro_batches,), schedules=(self.schedule,),
                num_stages=self.pp, fixed=(self.dp, self.tp, self.pp),
                time_limit=self.time_limit, backend=self.backend, remat=self.remat,
                input_filter="model+sequence" if self.sequence_parallel else "model",
                memory_fraction=float(self.memory_fraction)),
                batch_split=self.dp,
                batch_split_by=f"Manual(dp={self.dp}, num_micro_batches={self.num_micro_batches})",
                time_limit=self.time_limit, backend=self.backend,
                memory_fraction=float(self.memory_fraction))
        return PlanRequest("manual", mesh_shape=(self.dp, self.tp),
                           axis_names=("data", "model"),
                           input_layouts="model", batch_split=self.dp,
                           batch_split_by="Manual(dp=...)", time_limit=self.time_limit,
                           backend=self.backend, memory_fraction=float(self.memory_fraction),
                           offload=self.offload)


def _check_solver(method: Any) -> None:
    """``backend``: an ILP back end meshplan has; ``time_limit``: seconds > 0."""
    b, t = method.backend, method.time_limit
    if not isinstance(b, str) or b.lower() not in ("highs", "cbc"):
        raise MeshplanError(f"{type(method).__name__}(backend={b!r}): use 'highs' or 'cbc'")
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0:
        raise MeshplanError(f"{type(method).__name__}(time_limit={t!r}): give the ILP's limit "
                            "in seconds, more than 0")


def _check_fraction(method: Any) -> None:
    _check_solver(method)
    f = method.memory_fraction
    if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f <= 1:
        raise MeshplanError(f"{type(method).__name__}(memory_fraction={f!r}): use a fraction "
                            "of each device's memory in (0, 1], e.g. 0.9")


def _check_remat(method: Any, allowed: tuple[Any, ...], hint: str) -> None:
    """Normalise ``method.remat`` (a recomputation name: True, False or
    "selective") and refuse what is not in ``allowed``."""
    r = method.remat
    if isinstance(r, str) and r in REMAT_NAMES:
        object.__setattr__(method, "remat", REMAT_NAMES[r])
    if method.remat not in allowed:
        raise MeshplanError(f"{type(method).__name__}(remat={r!r}): use {hint}")


def _check_interleaved(method: Any, stages: int, mb: Any, what: str) -> None:
    """Interleaved 1F1B (Megatron-LM's order, meshplan.schedule) needs two or
    more stages and a multiple of them as micro-batches."""
    name = type(method).__name__
    if stages < 2:
        raise MeshplanError(f"{name}({what}={stages}, schedule='interleaved'): interleaved 1F1B "
                            f"needs {what} >= 2")
    counts = (mb,) if isinstance(mb, int) else tuple(mb or ())
    if counts and all(b % stages for b in counts):
        raise MeshplanError(f"{name}({what}={stages}, num_micro_batches={mb!r}, "
                            "schedule='interleaved'): interleaved 1F1B runs a multiple of the "
                            f"{stages} stages as micro-batches; use e.g. {stages * 2}")


def _check_offload(method: Any) -> None:
    if method.offload not in OFFLOAD_MODES:
        raise MeshplanError(f"{type(method).__name__}(offload={method.offload!r}): use one of "
                            f"{', '.join(repr(m) for m in OFFLOAD_MODES)}")


def _controls(method: Any) -> None:
    """Check and normalise the search controls of ``method`` (a frozen data
    class: normalised values are set in place, as ``__post_init__`` may)."""
    name = type(method).__name__
    st = getattr(method, "stages", "auto")
    if st != "auto" and not (isinstance(st, int) and not isinstance(st, bool) and st >= 1):
        raise MeshplanError(f"{name}(stages={st!r}): use 'auto' (searched) or a positive integer")
    mb = method.num_micro_batches
    if mb is not None:
        counts = (mb,) if isinstance(mb, int) and not isinstance(mb, bool) else tuple(mb) \
            if isinstance(mb, (tuple, list)) else ()
        if not counts or not all(isinstance(b, int) and not isinstance(b, bool) and b >= 1
                                 for b in counts):
            raise MeshplanError(f"{name}(num_micro_batches={mb!r}): use None (searched), a "
                                "positive integer, or a sequence of them (the counts to search)")
        object.__setattr__(method, "num_micro_batches", mb if isinstance(mb, int) else counts)
    sched = method.schedule
    names = (sched,) if isinstance(sched, str) else tuple(sched) \
        if isinstance(sched, (tuple, list)) else ()
    if not names or (names != ("auto",) and not all(n in SCHEDULES[1:] for n in names)):
        raise MeshplanError(f"{name}(schedule={sched!r}): use 'auto', one of {SCHEDULES[1:]}, "
                            "or a sequence of them (the schedules to search)")
    object.__setattr__(method, "schedule", "auto" if names == ("auto",) else
                       sched if isinstance(sched, str) else names)
    ms = method.max_stages
    if ms is not None and (not isinstance(ms, int) or isinstance(ms, bool) or ms < 1):
        raise MeshplanError(f"{name}(max_stages={ms!r}): use None (any) or a positive integer")
    _check_fraction(method)
    if not isinstance(method.tp_within_host, bool):
        raise MeshplanError(f"{name}(tp_within_host={method.tp_within_host!r}): use True or False")


def _pipeline_options(method: Any, **more: Any) -> PipelineOptions:
    """The search controls of ``method`` as the inter-operator search takes them."""
    mb = method.num_micro_batches
    sched = method.schedule
    searched = AUTO_SCHEDULES if more.get("num_stages") is None else \
        tuple(s for s in AUTO_SCHEDULES if s != "interleaved")
    return PipelineOptions(
        num_micro_batches=None if mb is None else (mb,) if isinstance(mb, int) else mb,
        schedules=searched if sched == "auto" else (sched,) if isinstance(sched, str)
        else sched,
        max_stages=method.max_stages, memory_fraction=float(method.memory_fraction),
        tp_within_host=method.tp_within_host, time_limit=method.time_limit,
        backend=method.backend, **more)


@dataclass(frozen=True)
class PipeshardParallel:
    """Pipeline stages on submeshes, each sharded by the ILP.  ``None``/"auto"
    means searched; ``stages=N`` is exact (N stages, or a clear error).

    Search controls (also on :class:`Auto`): ``num_micro_batches`` an int or
    a sequence of counts to search; ``schedule`` a name or a sequence of
    names; ``max_stages`` at most that many stages; ``memory_fraction`` of each
    device's memory the plan may use; ``tp_within_host`` keeps every mesh
    axis but the first (data) inside a host."""
    num_micro_batches: int | tuple[int, ...] | None = None
    schedule: str | tuple[str, ...] = "auto"
    stages: int | str = "auto"
    time_limit: float = 60.0
    backend: str = "highs"
    max_stages: int | None = None
    memory_fraction: float = 0.9
    tp_within_host: bool = False
    name = "pipeshard"

    def __post_init__(self) -> None:
        _controls(self)

    def request(self, num_devices: int) -> PlanRequest:
        stages = None if self.stages == "auto" else int(self.stages)
        if self.schedule == "interleaved" and stages is not None:
            _check_interleaved(self, stages, self.num_micro_batches, "stages")
        if stages is not None and not 1 <= stages <= num_devices:
            raise MeshplanError(f"PipeshardParallel(stages={stages}): a stage needs at least one "
                                f"device and the cluster has {num_devices}; use 1 to "
                                f"{num_devices} stages or stages='auto'")
        if stages is not None and self.max_stages is not None and stages > self.max_stages:
            raise MeshplanError(f"PipeshardParallel(stages={stages}, max_stages="
                                f"{self.max_stages}): ask for at most max_stages stages")
        return PlanRequest("pipeshard", pipeline=_pipeline_options(self, num_stages=stages),
                           time_limit=self.time_limit, backend=self.backend,
                           memory_fraction=float(self.memory_fraction),
                           tp_within_host=self.tp_within_host)


@dataclass(frozen=True)
class Auto:
    """Search everything: stages, submeshes, logical meshes, shardings,
    micro-batches and schedule, within the search controls (see
    :class:`PipeshardParallel`).  ``offload``: ``"auto"`` plans one stage
    with the optimizer state in host memory where no plan fits without it;
    ``"optimizer"`` plans that one-stage plan only; ``"none"`` never
    (:mod:`meshplan.offload`)."""
    time_limit: float = 60.0
    backend: str = "highs"
    num_micro_batches: int | tuple[int, ...] | None = None
    schedule: str | tuple[str, ...] = "auto"
    max_stages: int | None = None
    memory_fraction: float = 0.9
    tp_within_host: bool = False
    offload: str = "auto"
    name = "auto"

    def __post_init__(self) -> None:
        _controls(self)
        _check_offload(self)

    def request(self, num_devices: int) -> PlanRequest:
        return PlanRequest("auto", pipeline=_pipeline_options(self),
                           one_stage_by_whole_graph=True, time_limit=self.time_limit,
                           backend=self.backend, memory_fraction=float(self.memory_fraction),
                           tp_within_host=self.tp_within_host, offload=self.offload)


Method = ShardParallel | DataParallel | Manual | PipeshardParallel | Auto
