"""meshplan.tools: what sits beside planning: measuring the local devices
(:mod:`.calibrate`), checking predictions against XLA's compiled programs
(:mod:`.verify`) and drawing a pipeline schedule (:mod:`.timeline`)."""
