"""What the inter-operator search may choose (defined with the planning
request, :mod:`meshplan.request`)."""
from __future__ import annotations

from ..methods import AUTO_SCHEDULES
from ..request import PipelineOptions

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")
CHUNKS = 2      # model chunks per device group in interleaved plans (v; .interleave)

__all__ = ("PipelineOptions", "SCHEDULES", "AUTO_SCHEDULES", "CHUNKS",)
