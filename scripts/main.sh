#!/usr/bin/env bash
# The main job: trace a built-in GPT and summarise its graph
# (installs what it needs into ./.venv first).
source "$(dirname "$0")/_env.sh"
export XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=8"
meshplan inspect --model gpt "$@"
