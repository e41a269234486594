#!/usr/bin/env bash
# The main job: plan a built-in GPT for 8 virtual CPU devices, run the plan for
# three steps and check it against the unparallelized step
# (installs what it needs into ./.venv first).  Extra arguments go to
# `meshplan run`, e.g. `bash scripts/main.sh --method data`.
source "$(dirname "$0")/_env.sh"
export XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=8"
export JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}"
meshplan run --model gpt "$@"
