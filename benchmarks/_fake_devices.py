"""Run a benchmark on fake CPU devices: import this before jax.

Asks XLA's host platform for 8 devices (unless XLA_FLAGS already sets a
count) and defaults JAX_PLATFORMS to cpu, as the tests' conftest does."""
import os

COUNT_FLAG = "--xla_force_host_platform_device_count"

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if COUNT_FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" {COUNT_FLAG}=8").strip()
