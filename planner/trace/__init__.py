"""meshplan.trace: the front end, a train step -> Graph IR.

:mod:`.tracer` makes the Graph (and the :class:`~meshplan.traced.TracedStep`
the runtime takes) from ``jax.make_jaxpr``; :mod:`.walk` flattens nested
jaxprs into one equation stream; :mod:`.unstack` unrolls a ``lax.scan`` over
stacked layers into a step with one input per layer.
"""
from .tracer import graph_from_jaxpr, issue_warnings, trace, trace_both, trace_for_run

__all__ = ("trace", "trace_both", "trace_for_run", "graph_from_jaxpr", "issue_warnings")
