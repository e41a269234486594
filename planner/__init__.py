"""meshplan: automatic intra- and inter-operator parallelization for JAX."""
from __future__ import annotations

from .cluster import (Achieved, ClusterSpec, DeviceSpec, HostLink, LinkSpec, load_cluster,
                      parse_cluster)
from .errors import (CheckpointError, ClusterSpecError, InfeasiblePlanError, MeshplanError,
                     ModelConfigError,
                     PlanFormatError, RuntimeStageError, SolverError, StalePlanError,
                     TraceError, UnsupportedPrimitiveError)
from .graph import Graph, GraphInput, GraphOutput, Node, Tensor
from .trace import trace
from .methods import Auto, DataParallel, Manual, PipeshardParallel, ShardParallel
from .plan import LogicalMesh, Plan, PlanPredicted, Predicted, Stage
from .api import Parallelized, parallelize, plan
from .markers import grad, mark_pipeline_boundary, value_and_grad
from .checkpoint import restore_state, save_state

Cluster = ClusterSpec

__version__ = "0.1.0"

__all__ = [
    "Cluster", "ClusterSpec", "DeviceSpec", "HostLink", "LinkSpec", "Achieved", "load_cluster", "parse_cluster",
    "Graph", "GraphInput", "GraphOutput", "Node", "Tensor", "trace",
    "Auto", "DataParallel", "Manual", "PipeshardParallel", "ShardParallel",
    "LogicalMesh", "Plan", "PlanPredicted", "Predicted", "Stage",
    "Parallelized", "parallelize", "plan", "grad", "value_and_grad", "mark_pipeline_boundary",
    "MeshplanError", "ClusterSpecError", "TraceError", "UnsupportedPrimitiveError",
    "InfeasiblePlanError", "SolverError", "PlanFormatError", "StalePlanError",
    "ModelConfigError", "RuntimeStageError", "CheckpointError", "save_state", "restore_state",
]
