"""Test set-up: 8 fake CPU devices, configured before jax initialises."""
import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_enable_x64", False)

# One compilation cache for the run, shared by the xdist workers (they inherit
# the controller's environment): tests that build the same model compile the
# same programs, and XLA:CPU compiles dominate the suite's time.
if os.environ.get("MESHPLAN_TEST_COMPILE_CACHE", "1") != "0":
    import atexit
    import shutil
    import tempfile

    if "MESHPLAN_TEST_CACHE_DIR" not in os.environ:
        os.environ["MESHPLAN_TEST_CACHE_DIR"] = tempfile.mkdtemp(prefix="meshplan-jax-cache-")
        atexit.register(shutil.rmtree, os.environ["MESHPLAN_TEST_CACHE_DIR"], True)
    jax.config.update("jax_compilation_cache_dir", os.environ["MESHPLAN_TEST_CACHE_DIR"])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
