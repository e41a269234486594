"""Built-in models for planning and tests: ``mlp``, ``gpt``, ``moe``, ``wresnet``.

``build_model(name, overrides)`` returns a :class:`BuiltModel` with a
``train_step(state, batch) -> (state, {"loss": ...})``, an ``init(seed)`` for
small sizes and ``abstract_args`` (``jax.ShapeDtypeStruct`` pytrees computed
with ``jax.eval_shape``, so presets of hundreds of billions of parameters cost
nothing to build).  Presets follow Alpa's benchmark suites (Zheng et al. 2022)
and Table 1 of Megatron-LM (Narayanan et al. 2021).
"""
from __future__ import annotations

from types import ModuleType
from typing import Any, Mapping

import jax

from ..errors import ModelConfigError
from . import gpt, mlp, moe, wresnet
from .common import BuiltModel, resolve_config

__all__ = ["BuiltModel", "build_model", "model_names", "MODEL_DEFAULTS", "PRESETS",
           "PRESET_INFO"]

_MODULES: dict[str, ModuleType] = {"mlp": mlp, "gpt": gpt, "moe": moe, "wresnet": wresnet}

MODEL_DEFAULTS: dict[str, dict[str, Any]] = {
    name: dict(module.DEFAULTS) for name, module in _MODULES.items()}

PRESETS: dict[str, tuple[str, dict[str, Any]]] = {}
# Published context of each preset: source, GPU count, parallel degrees, and
# for Megatron-LM the achieved TFLOP/s per A100 reported in Table 1.
PRESET_INFO: dict[str, dict[str, Any]] = {}

_MIXED = {"dtype": "float32", "compute_dtype": "bfloat16"}
# Alpa's suites ran on V100s, which have float16 tensor cores and no bfloat16:
# float32 parameters, float16 compute, as in Alpa's mixed-precision benchmarks.
_MIXED_FP16 = {"dtype": "float32", "compute_dtype": "float16"}

# Alpa GPT suite (seq 1024, vocab 51200, batch 1024); GPUs of the weak-scaling run.
for _size, _h, _l, _heads, _gpus in [
        ("350m", 1024, 24, 16, 1), ("760m", 1536, 24, 16, 2), ("1.3b", 2048, 24, 32, 4),
        ("2.6b", 2560, 32, 32, 8), ("6.7b", 4096, 32, 32, 16), ("15b", 5120, 48, 40, 32),
        ("39b", 8192, 48, 64, 64)]:
    PRESETS[f"gpt-{_size}"] = ("gpt", {"batch": 1024, "seq_len": 1024, "vocab": 51200,
                                       "hidden": _h, "layers": _l, "heads": _heads, **_MIXED_FP16})
    PRESET_INFO[f"gpt-{_size}"] = {"source": "Alpa GPT suite", "gpus": _gpus}

# Megatron-LM Table 1 (seq 2048, vocab 51200): hidden, layers, heads, batch,
# GPUs, tensor-, pipeline-parallel degree, achieved TFLOP/s per GPU.  Dropout
# 0.1 on the attention probabilities and the residual branches: Megatron-LM's
# default --attention-dropout / --hidden-dropout, whose masks Korthikanti et
# al. (2022, section 4.1) count among a layer's activations; drawn with
# Philox, as PyTorch draws them (JAX's threefry does four times the work).
for _size, _h, _l, _heads, _batch, _gpus, _tp, _pp, _tflops in [
        ("1.7b", 2304, 24, 24, 512, 32, 1, 1, 137),
        ("3.6b", 3072, 30, 32, 512, 64, 2, 1, 138),
        ("7.5b", 4096, 36, 32, 512, 128, 4, 1, 142),
        ("18.4b", 6144, 40, 48, 1024, 256, 8, 1, 135),
        ("39.1b", 8192, 48, 64, 1536, 512, 8, 2, 138),
        ("76.1b", 10240, 60, 80, 1792, 1024, 8, 4, 140),
        ("145.6b", 12288, 80, 96, 2304, 1536, 8, 8, 148),
        ("310.1b", 16384, 96, 128, 2160, 1920, 8, 16, 155),
        ("529.6b", 20480, 105, 128, 2520, 2520, 8, 35, 163),
        ("1t", 25600, 128, 160, 3072, 3072, 8, 64, 163)]:
    PRESETS[f"megatron-{_size}"] = ("gpt", {"batch": _batch, "seq_len": 2048, "vocab": 51200,
                                            "hidden": _h, "layers": _l, "heads": _heads,
                                            "dropout": 0.1, "rng_impl": "rbg", **_MIXED})
    PRESET_INFO[f"megatron-{_size}"] = {
        "source": "Megatron-LM (Narayanan et al. 2021) Table 1", "gpus": _gpus,
        "tp": _tp, "pp": _pp, "dp": _gpus // (_tp * _pp), "tflops_per_gpu": _tflops}

# Alpa MoE suite (seq 1024, vocab 32000, 16 heads, expert group 2048, FFN 8h,
# batch 1024); the names count parameters with that FFN width.
for _size, _h, _l, _experts, _gpus in [
        ("380m", 768, 8, 8, 1), ("690m", 768, 8, 16, 2), ("1.3b", 768, 16, 16, 4),
        ("2.4b", 1024, 16, 16, 8), ("7.1b", 1280, 16, 32, None), ("10b", 1536, 16, 32, 16),
        ("27b", 2048, 16, 48, 32), ("70b", 2048, 32, 64, 64),
        ("140b", 2048, 32, 128, None)]:
    PRESETS[f"moe-{_size}"] = ("moe", {"batch": 1024, "seq_len": 1024, "vocab": 32000,
                                       "hidden": _h, "layers": _l, "heads": 16,
                                       "num_experts": _experts, "expert_group_size": 2048,
                                       "mlp_ratio": 8, **_MIXED_FP16})
    PRESET_INFO[f"moe-{_size}"] = {"source": "Alpa MoE suite", "gpus": _gpus}

# Alpa Wide-ResNet suite (image 224, bottleneck blocks, 1024 classes, batch
# 1536, float32): depth, base width, width factor.
for _size, _depth, _base, _width, _gpus in [
        ("250m", 50, 160, 2, 1), ("500m", 50, 224, 2, 2), ("1b", 50, 320, 2, 4),
        ("2b", 50, 448, 2, 8), ("4b", 50, 640, 2, 16), ("6.8b", 50, 320, 16, 32),
        ("13b", 101, 320, 16, 64)]:
    PRESETS[f"wresnet-{_size}"] = ("wresnet", {
        "batch": 1536, "image_size": 224, "channels": 3, "num_classes": 1024,
        "layers": _depth, "block": "bottleneck", "num_stages": 4, "base_width": _base,
        "width_factor": _width, "dtype": "float32", "compute_dtype": "float32"})
    PRESET_INFO[f"wresnet-{_size}"] = {"source": "Alpa Wide-ResNet suite", "gpus": _gpus}


def model_names() -> list[str]:
    """Base models, then presets."""
    return list(_MODULES) + list(PRESETS)


def build_model(name: str,
                overrides: Mapping[str, str | int | float | bool] | None = None) -> BuiltModel:
    """Build a base model or preset; ``overrides`` (e.g. CLI strings) replace sizes.

    Raises :class:`ModelConfigError` for an unknown model, unknown key or bad value.
    """
    key = str(name).strip().lower()
    if key in _MODULES:
        base, preset, preset_overrides = key, None, {}
    elif key in PRESETS:
        base, preset_overrides = PRESETS[key]
        preset = key
    else:
        raise ModelConfigError(
            f"unknown model '{name}'; valid names: " + ", ".join(model_names()))
    module = _MODULES[base]
    config = resolve_config(base, module.DEFAULTS, [preset_overrides, dict(overrides or {})],
                            module.CHOICES, module.NON_NEGATIVE)
    config = module.finalize(config)
    train_step, init = module.make(config)
    abstract_args = jax.eval_shape(init, 0)
    return BuiltModel(name=base, preset=preset, config=config, train_step=train_step,
                      init=init, abstract_args=tuple(abstract_args))
