"""A Wide-ResNet (Zagoruyko & Komodakis 2016) in the form Alpa benchmarks.

NHWC activations, HWIO kernels, ``jax.lax.conv_general_dilated``, BatchNorm in
training mode (batch statistics; running averages kept in
``state["batch_stats"]`` and updated by every step), global average pooling and
a dense classifier with softmax cross-entropy.

Stage ``i`` has ``f = base_width * 2**i`` filters and starts with a stride-2
block (except stage 0).  Blocks:

* ``basic``: 3x3 conv to ``f·W`` channels, 3x3 conv, both with BN; output ``f·W``.
* ``bottleneck`` (Alpa's ``wide_resnet``): 1x1 conv to ``f``, 3x3 conv to
  ``f·W``, 1x1 conv to ``4f``; output ``4f``.

A 1x1 projection (with BN) joins the residual when the shape changes.
``layers`` is the total depth: 18/34 (basic) and 50/101/152/200 (bottleneck)
with 4 stages use the standard ResNet stage sizes; any other depth must be
``2 + convs_per_block * num_stages * blocks_per_stage``.  Images of 64 pixels
or more get the ImageNet stem (7x7/2 conv, 3x3/2 max-pool), smaller ones a
3x3/1 conv.

Parameters: ``params["stem"] = {"conv": {"w"}, "bn": {"scale", "bias"}}``,
``params["stage{i}"]["block{j}"] = {"conv1": {"w"}, "bn1": ..., ...,
"proj": {"w"}, "proj_bn": ...}``, ``params["head"] = {"w", "b"}``;
``batch_stats`` mirrors every ``bn`` entry with ``{"mean", "var"}``.
"""
from __future__ import annotations

import math
from typing import Any, Mapping

import jax
import jax.numpy as jnp

from ..errors import ModelConfigError
from .common import (F32, FLOAT_DTYPES, Batch, InitFn, Params, State, TrainStep,
                     adam_train_step, dense, dense_init, normal, softmax_cross_entropy,
                     to_dtype)

DEFAULTS: dict[str, Any] = {
    "batch": 8,
    "image_size": 16,
    "channels": 3,
    "num_classes": 10,
    "layers": 8,
    "block": "basic",
    "num_stages": 3,
    "base_width": 16,
    "width_factor": 2,
    "dtype": "float32",
    "compute_dtype": "float32",
    "learning_rate": 1e-3,
    "optimizer": "adam",
}
CHOICES: dict[str, tuple[str, ...]] = {
    "block": ("basic", "bottleneck"),
    "dtype": FLOAT_DTYPES,
    "compute_dtype": FLOAT_DTYPES,
}
NON_NEGATIVE: tuple[str, ...] = ()

STANDARD_STAGES: dict[tuple[str, int], tuple[int, ...]] = {
    ("basic", 18): (2, 2, 2, 2),
    ("basic", 34): (3, 4, 6, 3),
    ("bottleneck", 50): (3, 4, 6, 3),
    ("bottleneck", 101): (3, 4, 23, 3),
    ("bottleneck", 152): (3, 8, 36, 3),
    ("bottleneck", 200): (3, 24, 36, 3),
}
_CONVS_PER_BLOCK = {"basic": 2, "bottleneck": 3}
BN_MOMENTUM = 0.9
BN_EPS = 1e-5


def stage_sizes(config: Mapping[str, Any]) -> tuple[int, ...]:
    """Blocks per stage, decoded from the total depth ``layers``."""
    block, depth, stages = config["block"], config["layers"], config["num_stages"]
    if stages == 4 and (block, depth) in STANDARD_STAGES:
        return STANDARD_STAGES[(block, depth)]
    per_block = _CONVS_PER_BLOCK[block]
    blocks, rest = divmod(depth - 2, per_block * stages)
    if depth < 2 or rest != 0 or blocks < 1:
        step = per_block * stages
        raise ModelConfigError(
            f"model 'wresnet': layers={depth} does not fit {stages} stages of {block} "
            f"blocks; use 2 + {step}*k (e.g. {2 + step}, {2 + 2 * step}), or 18/34 (basic) "
            f"or 50/101/152/200 (bottleneck) with num_stages=4")
    return (blocks,) * stages


def finalize(config: dict[str, Any]) -> dict[str, Any]:
    stage_sizes(config)
    if config["num_classes"] < 2:
        raise ModelConfigError("model 'wresnet': num_classes must be >= 2")
    return config


# ---------------------------------------------------------------- layers

def conv_init(key: jax.Array, size: int, c_in: int, c_out: int, dtype: jnp.dtype) -> Params:
    std = math.sqrt(2.0 / (size * size * c_in))  # He initialisation
    return {"w": normal(key, (size, size, c_in, c_out), std, dtype)}


def conv(p: Params, x: jax.Array, stride: int, cdt: jnp.dtype) -> jax.Array:
    return jax.lax.conv_general_dilated(
        x.astype(cdt), p["w"].astype(cdt), window_strides=(stride, stride), padding="SAME",
        dimension_numbers=("NHWC", "HWIO", "NHWC"))


def bn_init(c: int, dtype: jnp.dtype) -> tuple[Params, Params]:
    params = {"scale": jnp.ones((c,), dtype), "bias": jnp.zeros((c,), dtype)}
    stats = {"mean": jnp.zeros((c,), F32), "var": jnp.ones((c,), F32)}
    return params, stats


def batch_norm(p: Params, stats: Params, x: jax.Array) -> tuple[jax.Array, Params]:
    """Training-mode BatchNorm over N, H, W; returns (y, updated running stats)."""
    x32 = x.astype(F32)
    mean = jnp.mean(x32, axis=(0, 1, 2))
    var = jnp.mean(jnp.square(x32 - mean), axis=(0, 1, 2))
    y = (x32 - mean) * jax.lax.rsqrt(var + BN_EPS)
    y = y * p["scale"].astype(F32) + p["bias"].astype(F32)
    new_stats = {
        "mean": BN_MOMENTUM * stats["mean"] + (1 - BN_MOMENTUM) * jax.lax.stop_gradient(mean),
        "var": BN_MOMENTUM * stats["var"] + (1 - BN_MOMENTUM) * jax.lax.stop_gradient(var),
    }
    return y.astype(x.dtype), new_stats


def _block_convs(kind: str, c_in: int, filters: int, width: int
                 ) -> list[tuple[str, int, int, int]]:
    """(name, kernel size, in channels, out channels) of a block's main path."""
    if kind == "basic":
        wide = filters * width
        return [("1", 3, c_in, wide), ("2", 3, wide, wide)]
    return [("1", 1, c_in, filters), ("2", 3, filters, filters * width),
            ("3", 1, filters * width, 4 * filters)]


def init_block(key: jax.Array, kind: str, c_in: int, filters: int, width: int, stride: int,
               dtype: jnp.dtype) -> tuple[Params, Params, int]:
    convs = _block_convs(kind, c_in, filters, width)
    keys = jax.random.split(key, len(convs) + 1)
    params: Params = {}
    stats: Params = {}
    for k, (name, size, ci, co) in zip(keys, convs):
        params[f"conv{name}"] = conv_init(k, size, ci, co, dtype)
        params[f"bn{name}"], stats[f"bn{name}"] = bn_init(co, dtype)
    c_out = convs[-1][3]
    if stride != 1 or c_in != c_out:
        params["proj"] = conv_init(keys[-1], 1, c_in, c_out, dtype)
        params["proj_bn"], stats["proj_bn"] = bn_init(c_out, dtype)
    return params, stats, c_out


def apply_block(p: Params, stats: Params, x: jax.Array, kind: str, stride: int,
                cdt: jnp.dtype) -> tuple[jax.Array, Params]:
    names = ("1", "2") if kind == "basic" else ("1", "2", "3")
    strided = "1" if kind == "basic" else "2"  # the (first) 3x3 conv carries the stride
    new_stats: Params = {}
    y = x
    for name in names:
        y = conv(p[f"conv{name}"], y, stride if name == strided else 1, cdt)
        y, new_stats[f"bn{name}"] = batch_norm(p[f"bn{name}"], stats[f"bn{name}"], y)
        if name != names[-1]:
            y = jax.nn.relu(y)
    residual = x
    if "proj" in p:
        residual = conv(p["proj"], x, stride, cdt)
        residual, new_stats["proj_bn"] = batch_norm(p["proj_bn"], stats["proj_bn"], residual)
    return jax.nn.relu(y + residual.astype(y.dtype)), new_stats


# ---------------------------------------------------------------- the model

def make(config: Mapping[str, Any]) -> tuple[TrainStep, InitFn]:
    batch_size: int = config["batch"]
    image: int = config["image_size"]
    channels: int = config["channels"]
    classes: int = config["num_classes"]
    kind: str = config["block"]
    base: int = config["base_width"]
    width: int = config["width_factor"]
    sizes = stage_sizes(config)
    imagenet_stem = image >= 64
    dtype = to_dtype(config["dtype"])
    cdt = to_dtype(config["compute_dtype"])

    def strides(stage: int, j: int) -> int:
        return 2 if stage > 0 and j == 0 else 1

    def forward(params: Params, stats: Params, images: jax.Array
                ) -> tuple[jax.Array, Params]:
        new_stats: Params = {"stem": {}}
        x = conv(params["stem"]["conv"], images, 2 if imagenet_stem else 1, cdt)
        x, new_stats["stem"]["bn"] = batch_norm(params["stem"]["bn"], stats["stem"]["bn"], x)
        x = jax.nn.relu(x)
        if imagenet_stem:
            x = jax.lax.reduce_window(x, -jnp.inf, jax.lax.max,
                                      (1, 3, 3, 1), (1, 2, 2, 1), "SAME")
        for i, n_blocks in enumerate(sizes):
            stage_p, stage_s = params[f"stage{i}"], stats[f"stage{i}"]
            new_stats[f"stage{i}"] = {}
            for j in range(n_blocks):
                x, new_stats[f"stage{i}"][f"block{j}"] = apply_block(
                    stage_p[f"block{j}"], stage_s[f"block{j}"], x, kind, strides(i, j), cdt)
        pooled = jnp.mean(x.astype(F32), axis=(1, 2))
        return dense(params["head"], pooled, cdt).astype(F32), new_stats

    def loss_fn(params: Params, extra: dict[str, Any], batch: Batch
                ) -> tuple[jax.Array, dict[str, Any]]:
        logits, new_stats = forward(params, extra["batch_stats"], batch["images"])
        return softmax_cross_entropy(logits, batch["labels"]), {"batch_stats": new_stats}

    tx, train_step = adam_train_step(loss_fn, config["learning_rate"], config["optimizer"])

    def init(seed: int) -> tuple[State, Batch]:
        k_stem, k_stages, k_head, k_x, k_y = jax.random.split(jax.random.PRNGKey(seed), 5)
        stem_size = 7 if imagenet_stem else 3
        params: Params = {"stem": {"conv": conv_init(k_stem, stem_size, channels, base, dtype)}}
        stats: Params = {"stem": {}}
        params["stem"]["bn"], stats["stem"]["bn"] = bn_init(base, dtype)
        c_in = base
        stage_keys = jax.random.split(k_stages, len(sizes))
        for i, n_blocks in enumerate(sizes):
            block_keys = jax.random.split(stage_keys[i], n_blocks)
            params[f"stage{i}"], stats[f"stage{i}"] = {}, {}
            for j in range(n_blocks):
                p, s, c_in = init_block(block_keys[j], kind, c_in, base * 2 ** i, width,
                                        strides(i, j), dtype)
                params[f"stage{i}"][f"block{j}"] = p
                stats[f"stage{i}"][f"block{j}"] = s
        params["head"] = dense_init(k_head, c_in, classes, dtype)
        images = jax.random.normal(k_x, (batch_size, image, image, channels), F32).astype(dtype)
        labels = jax.random.randint(k_y, (batch_size,), 0, classes, jnp.int32)
        state: State = {"params": params, "batch_stats": stats, "opt_state": tx.init(params)}
        return state, {"images": images, "labels": labels}

    return train_step, init
