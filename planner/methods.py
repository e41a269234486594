"""Parallelization methods: what the user asks the planner to do.

Plain frozen data; the API turns them into planning calls.
"""
from __future__ import annotations

from dataclasses import dataclass

from .errors import MeshplanError

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


@dataclass(frozen=True)
class DataParallel:
    """Replicated parameters and optimizer state, batch split over all devices."""
    time_limit: float = 60.0
    backend: str = "highs"
    name = "data"


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


@dataclass(frozen=True)
class PipeshardParallel:
    """Pipeline stages on submeshes, each sharded by the ILP.  ``None``/"auto"
    means searched."""
    num_micro_batches: int | None = None
    schedule: str = "auto"
    stages: int | str = "auto"
    time_limit: float = 60.0
    backend: str = "highs"
    name = "pipeshard"

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise MeshplanError(f"PipeshardParallel(schedule={self.schedule!r}): use one of {SCHEDULES}")


@dataclass(frozen=True)
class Auto:
    """Search everything: stages, submeshes, logical meshes, shardings,
    micro-batches and schedule."""
    time_limit: float = 60.0
    backend: str = "highs"
    name = "auto"


Method = ShardParallel | DataParallel | Manual | PipeshardParallel | Auto
