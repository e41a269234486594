"""meshplan.cost_model: pure functions of shapes, dtypes and a logical mesh.

Compute time by roofline, collective time by the alpha-beta ring model per
mesh axis, resharding cost between any two shardings, and memory by liveness.
Which communication runs under compute is stated once, in :mod:`.overlap`.
"""
from .collectives import all_gather, all_reduce, all_to_all, reduce_scatter
from .compute import compute_time
from .mesh import AxisLink, MeshModel, default_axis_names, mesh_model, mesh_shapes
from ..layout_moves import ISpec, num_shards, spec_from_names
from .sharding import divides, enumerate_specs, local_shape, replicated, reshard_cost, spec_names

__all__ = ("all_gather", "all_reduce", "all_to_all", "reduce_scatter", "compute_time",
           "AxisLink", "MeshModel", "default_axis_names", "mesh_model", "mesh_shapes",
           "ISpec", "divides", "enumerate_specs", "local_shape", "num_shards", "replicated",
           "reshard_cost", "spec_from_names", "spec_names")
