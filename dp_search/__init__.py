"""meshplan.dp_search: the inter-operator pass (entry :func:`plan_pipeline`,
in :mod:`.search`)."""
from .layers import assign_layers
from .options import AUTO_SCHEDULES, SCHEDULES, PipelineOptions
from .search import (batch_size, micro_batch_candidates, plan_pipeline, search_pipeline,
                     warn_of_scans)
from .session import SearchStats, Session
from .solver import LayerCost
from .stage_dp import Submesh, brute_force, stage_dp, submesh_shapes

__all__ = ("plan_pipeline", "search_pipeline", "PipelineOptions", "Session", "SearchStats",
           "LayerCost", "batch_size", "micro_batch_candidates", "assign_layers", "stage_dp",
           "brute_force", "submesh_shapes", "Submesh", "SCHEDULES", "AUTO_SCHEDULES",
           "warn_of_scans")
