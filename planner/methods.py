"""Parallelization methods: what the user asks the planner to do.

Plain frozen data; each lowers itself once into a :class:`PlanRequest`
(``method.request(num_devices)``), which ``meshplan.planning.plan_step`` runs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .errors import MeshplanError
from .request import PipelineOptions, PlanRequest

def normalize_argnums(argnums: Any) -> tuple[int, ...]:
    """``batch_argnums`` as jax takes argnums: an int or a sequence of ints."""
    if isinstance(argnums, bool):
        raise TypeError("batch_argnums must be an int or a sequence of ints, not a bool")
    if isinstance(argnums, int):
        return (argnums,)
    out = tuple(argnums)
    if not all(isinstance(a, int) and not isinstance(a, bool) for a in out):
        raise TypeError(f"batch_argnums must be an int or a sequence of ints, got {argnums!r}")
    return out


# What a searched schedule ("auto") may be: the runtime executes GPipe and
# 1F1B; interleaved 1F1B is planned only when asked for by name.
AUTO_SCHEDULES = ("1f1b", "gpipe")

SCHEDULES = ("auto", "gpipe", "1f1b", "interleaved")


@dataclass(frozen=True)
class ShardParallel:
    """One stage; the ILP chooses every sharding.  ``mesh_shape`` fixes the
    logical mesh (e.g. ``(2, 4)``); ``None`` tries every shape."""
    mesh_shape: tuple[int, ...] | None = None
    axis_names: tuple[str, ...] | None = None
    time_limit: float = 60.0
    backend: str = "highs"
    name = "shard"

    def request(self, num_devices: int) -> PlanRequest:
        meshes = None
        if self.mesh_shape is not None:
            shape = tuple(int(s) for s in self.mesh_shape)
            if math.prod(shape) != num_devices:
                raise MeshplanError(f"ShardParallel(mesh_shape={shape}) has {math.prod(shape)} "
                                    f"devices but the cluster has {num_devices}")
            meshes = shape
        return PlanRequest("shard", mesh_shape=meshes, axis_names=self.axis_names,
                           time_limit=self.time_limit, backend=self.backend)


@dataclass(frozen=True)
class DataParallel:
    """Replicated parameters and optimizer state, batch split over all devices."""
    time_limit: float = 60.0
    backend: str = "highs"
    name = "data"

    def request(self, num_devices: int) -> PlanRequest:
        return PlanRequest("data", mesh_shape=(num_devices,), axis_names=("data",),
                           input_layouts="replicated", batch_split=num_devices,
                           batch_split_by="DataParallel", time_limit=self.time_limit,
                           backend=self.backend)


@dataclass(frozen=True)
class Manual:
    """A hand-given Megatron-style plan: ``dp`` x ``tp`` devices per stage
    (batch split over ``data``, parameters over ``model``), ``pp`` stages.
    ``remat``: ``None`` each stage recomputes its activations only if it must
    to fit; ``True`` every stage does (as Megatron-LM's runs do); ``False``
    none does."""
    dp: int = 1
    tp: int = 1
    pp: int = 1
    num_micro_batches: int = 1
    schedule: str = "1f1b"
    time_limit: float = 60.0
    backend: str = "highs"
    remat: bool | None = None
    name = "manual"

    def __post_init__(self) -> None:
        for k in ("dp", "tp", "pp", "num_micro_batches"):
            v = getattr(self, k)
            if not isinstance(v, int) or v < 1:
                raise MeshplanError(f"Manual({k}={v!r}): must be a positive integer")
        if self.schedule not in SCHEDULES[1:]:
            raise MeshplanError(f"Manual(schedule={self.schedule!r}): use one of {SCHEDULES[1:]}")
        if self.remat not in (None, True, False):
            raise MeshplanError(f"Manual(remat={self.remat!r}): use None, True or False")

    def request(self, num_devices: int) -> PlanRequest:
        used = self.dp * self.tp * self.pp
        if used != num_devices:
            raise MeshplanError(f"Manual(dp={self.dp}, tp={self.tp}, pp={self.pp}) uses "
                                f"{used} devices but the cluster has {num_devices}")
        # (one stage with one micro-batch runs as one program, which never
        # recomputes: remat=True changes nothing there)
        if self.pp > 1 or self.num_micro_batches > 1:
            return PlanRequest("manual", pipeline=PipelineOptions(
                num_micro_batches=(self.num_micro_batches,), schedules=(self.schedule,),
                num_stages=self.pp, fixed=(self.dp, self.tp, self.pp),
                time_limit=self.time_limit, backend=self.backend, remat=self.remat,
                input_filter="model"), time_limit=self.time_limit, backend=self.backend)
        return PlanRequest("manual", mesh_shape=(self.dp, self.tp),
                           axis_names=("data", "model"),
                           input_layouts="model", batch_split=self.dp,
                           batch_split_by="Manual(dp=...)", time_limit=self.time_limit,
                           backend=self.backend)


@dataclass(frozen=True)
class PipeshardParallel:
    """Pipeline stages on submeshes, each sharded by the ILP.  ``None``/"auto"
    means searched; ``stages=N`` is exact (N stages, or a clear error)."""
    num_micro_batches: int | None = None
    schedule: str = "auto"
    stages: int | str = "auto"
    time_limit: float = 60.0
    backend: str = "highs"
    name = "pipeshard"

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise MeshplanError(f"PipeshardParallel(schedule={self.schedule!r}): use one of {SCHEDULES}")

    def request(self, num_devices: int) -> PlanRequest:
        mb = None if self.num_micro_batches is None else (int(self.num_micro_batches),)
        sched = AUTO_SCHEDULES if self.schedule == "auto" else (self.schedule,)
        stages = None if self.stages == "auto" else int(self.stages)
        if stages is not None and not 1 <= stages <= num_devices:
            raise MeshplanError(f"PipeshardParallel(stages={stages}): a stage needs at least one "
                                f"device and the cluster has {num_devices}; use 1 to "
                                f"{num_devices} stages or stages='auto'")
        return PlanRequest("pipeshard", pipeline=PipelineOptions(
            num_micro_batches=mb, schedules=sched, num_stages=stages,
            time_limit=self.time_limit, backend=self.backend),
            time_limit=self.time_limit, backend=self.backend)


@dataclass(frozen=True)
class Auto:
    """Search everything: stages, submeshes, logical meshes, shardings,
    micro-batches and schedule."""
    time_limit: float = 60.0
    backend: str = "highs"
    name = "auto"

    def request(self, num_devices: int) -> PlanRequest:
        return PlanRequest("auto", pipeline=PipelineOptions(
            schedules=AUTO_SCHEDULES, time_limit=self.time_limit, backend=self.backend),
            one_stage_by_whole_graph=True, time_limit=self.time_limit, backend=self.backend)


Method = ShardParallel | DataParallel | Manual | PipeshardParallel | Auto
