"""A planning request: what a method (:mod:`meshplan.methods`) asks the passes
to do, lowered once (``method.request(num_devices)``) and read by
``meshplan.planning.plan_step``, the one function the API and the CLI plan
through.  Plain frozen data, like the methods."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# what a method may say about offloading optimizer state to host memory
# (meshplan.offload): never, always (one-stage plans), or where memory binds
OFFLOAD_MODES = ("none", "optimizer", "auto")


@dataclass(frozen=True)
class PipelineOptions:
    """What the inter-operator search (``meshplan.dp_search``) may choose."""
    num_micro_batches: tuple[int, ...] | None = None   # None: searched
    schedules: tuple[str, ...] = ("1f1b", "gpipe", "interleaved")
    num_layers: int | None = None                       # None: from marks, else chosen
    num_stages: int | None = None                       # None: searched
    max_stages: int | None = None                       # searched up to this many (None: any)
    fixed: tuple[int, int, int] | None = None           # Manual (dp, tp, pp)
    # ShardParallel(mesh_shape=..., remat=...): one stage on this logical mesh
    mesh_shape: tuple[int, ...] | None = None
    axis_names: tuple[str, ...] | None = None
    time_limit: float = 60.0
    backend: str = "highs"
    memory_fraction: float = 0.9
    # None: chosen per stage; True: every stage fully; "selective": every
    # stage selectively (meshplan.recompute); False: none
    remat: bool | str | None = None
    # stop at the first micro-batch count (searched from the most) that fits
    # nothing after one that fitted: fewer, larger micro-batches need more memory
    prune_micro_batches: bool = True
    # baselines and hand-made plans: the layouts every layer ILP may give the
    # inputs (an ilp.InputLayouts, or its ``params`` mode as a string)
    input_filter: Any = None
    data_parallel_stages: bool = False        # every stage one "data" axis (inter-op only)
    equal_layers: bool = False                # num_stages stages of equally many layer groups
    # a stage spanning hosts gets only (data, model) meshes whose model axis
    # lies inside a host (tensor parallelism never crosses the slow link)
    tp_within_host: bool = False


@dataclass(frozen=True)
class PlanRequest:
    """A method lowered to passes.  ``pipeline`` set: the inter-operator
    search with those options; else one stage, planned by the whole-graph
    ILP on the logical mesh ``mesh_shape`` (None: every candidate mesh;
    ``axis_names`` None: the default names)."""
    method: str                                   # the name the plan records
    pipeline: PipelineOptions | None = None
    mesh_shape: tuple[int, ...] | None = None
    axis_names: tuple[str, ...] | None = None
    input_layouts: str | None = None              # ilp.InputLayouts(params=...) for one stage
    batch_split: int = 1                          # dim 0 of the batch must split this many ways
    batch_split_by: str = ""                      # ... because of this (for the error)
    # Auto: when the search ends with one stage, re-plan it with the
    # whole-graph ILP (more exact than the sum of layer costs)
    one_stage_by_whole_graph: bool = False
    time_limit: float = 60.0
    backend: str = "highs"
    memory_fraction: float = 0.9                  # of each device's memory the plan may use
    tp_within_host: bool = False                  # as PipelineOptions.tp_within_host
    # one of OFFLOAD_MODES; "auto": only where the plan does not fit without it
    offload: str = "none"
