"""meshplan.runtime: run plans on real devices with ``jax.sharding``.

* :class:`ShardExecutable` runs a one-stage (intra-operator) plan;
  :func:`build_mesh` and :func:`arg_specs` bind a plan's logical mesh and
  argument specs to devices.
* :func:`parse_collectives` / :func:`collective_bytes` read the collectives of
  a compiled program's per-device HLO.
"""
from .hlo import Collective, collective_bytes, parse_collectives, summary
from .shard import ShardExecutable, arg_specs, build_mesh

__all__ = ["ShardExecutable", "build_mesh", "arg_specs", "Collective", "collective_bytes",
           "parse_collectives", "summary"]
