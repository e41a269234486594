"""meshplan.runtime: run plans on real devices with ``jax.sharding``.

* :class:`ShardExecutable` runs a one-stage (intra-operator) plan;
  :func:`build_mesh` and :func:`arg_specs` bind a plan's logical mesh and
  argument specs to devices.
* :func:`parse_collectives` / :func:`collective_bytes` read the collectives of
  a compiled program's per-device HLO.
* :mod:`~meshplan.runtime.multihost`: runs whose mesh spans several JAX
  processes -- process-local batches (:func:`global_view`), one plan for all
  processes (:func:`agree_on_plan`), outputs read back with :func:`to_host`;
  pipeline plans with one stage per process:
  :mod:`~meshplan.runtime.pipeline_transport`.
"""
from .hlo import Collective, collective_bytes, parse_collectives, summary
from .multihost import agree_on_plan, global_view, is_multiprocess, to_host
from .shard import FastPathMiss, ShardExecutable, arg_specs, build_mesh
from .watchdog import PEER_LOST_EXIT_CODE, PeerWatchdog, initialize

__all__ = ("ShardExecutable", "FastPathMiss", "build_mesh", "arg_specs", "Collective",
           "collective_bytes", "parse_collectives", "summary", "to_host", "global_view",
           "agree_on_plan", "is_multiprocess", "initialize", "PeerWatchdog",
           "PEER_LOST_EXIT_CODE",)
