"""meshplan.tools: what sits beside planning: measuring the local devices
(:mod:`.calibrate`), checking predictions against XLA's compiled programs
(:mod:`.verify`), drawing a pipeline schedule (:mod:`.timeline`) and writing a
plan as a standalone jax snippet (:mod:`.snippet`)."""
