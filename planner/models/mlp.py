"""A multi-layer perceptron: ``layers`` hidden dense layers and a dense head.

Parameters: ``params["dense{i}"] = {"w": [d_in, hidden], "b": [hidden]}`` for
i < layers, then ``params["head"] = {"w": [hidden, out_dim], "b": [out_dim]}``.
Batch: ``{"x": [batch, in_dim], "y": [batch, out_dim] float}`` for the MSE loss
or ``"y": int32[batch]`` class labels for ``loss="xent"``.
"""
from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp

from ..errors import ModelConfigError
from .common import (F32, FLOAT_DTYPES, Batch, InitFn, Params, State, TrainStep,
                     adam_train_step, dense, dense_init, softmax_cross_entropy, to_dtype)

DEFAULTS: dict[str, Any] = {
    "batch": 16,
    "in_dim": 32,
    "hidden": 64,
    "layers": 3,
    "out_dim": 16,
    "activation": "gelu",
    "loss": "mse",
    "dtype": "float32",
    "compute_dtype": "float32",
    "learning_rate": 1e-3,
    "optimizer": "adam",
}
CHOICES: dict[str, tuple[str, ...]] = {
    "activation": ("gelu", "relu"),
    "loss": ("mse", "xent"),
    "dtype": FLOAT_DTYPES,
    "compute_dtype": FLOAT_DTYPES,
}
NON_NEGATIVE: tuple[str, ...] = ()

_ACTIVATIONS = {"gelu": jax.nn.gelu, "relu": jax.nn.relu}


def finalize(config: dict[str, Any]) -> dict[str, Any]:
    if config["loss"] == "xent" and config["out_dim"] < 2:
        raise ModelConfigError("model 'mlp': loss=xent needs out_dim >= 2 classes")
    return config


def make(config: Mapping[str, Any]) -> tuple[TrainStep, InitFn]:
    batch_size: int = config["batch"]
    in_dim: int = config["in_dim"]
    hidden: int = config["hidden"]
    layers: int = config["layers"]
    out_dim: int = config["out_dim"]
    act = _ACTIVATIONS[config["activation"]]
    xent: bool = config["loss"] == "xent"
    dtype = to_dtype(config["dtype"])
    cdt = to_dtype(config["compute_dtype"])

    def forward(params: Params, x: jax.Array) -> jax.Array:
        h = x.astype(cdt)
        for i in range(layers):
            h = act(dense(params[f"dense{i}"], h, cdt))
        return dense(params["head"], h, cdt).astype(F32)

    def loss_fn(params: Params, extra: dict[str, Any], batch: Batch
                ) -> tuple[jax.Array, dict[str, Any]]:
        out = forward(params, batch["x"])
        if xent:
            loss = softmax_cross_entropy(out, batch["y"])
        else:
            loss = jnp.mean(jnp.square(out - batch["y"].astype(F32)))
        return loss, extra

    tx, train_step = adam_train_step(loss_fn, config["learning_rate"], config["optimizer"])

    def init(seed: int) -> tuple[State, Batch]:
        key = jax.random.PRNGKey(seed)
        k_params, k_x, k_y = jax.random.split(key, 3)
        keys = jax.random.split(k_params, layers + 1)
        params: Params = {}
        d_in = in_dim
        for i in range(layers):
            params[f"dense{i}"] = dense_init(keys[i], d_in, hidden, dtype)
            d_in = hidden
        params["head"] = dense_init(keys[layers], d_in, out_dim, dtype)
        x = jax.random.normal(k_x, (batch_size, in_dim), F32).astype(dtype)
        if xent:
            y = jax.random.randint(k_y, (batch_size,), 0, out_dim, jnp.int32)
        else:
            y = jax.random.normal(k_y, (batch_size, out_dim), F32).astype(dtype)
        state: State = {"params": params, "opt_state": tx.init(params)}
        return state, {"x": x, "y": y}

    return train_step, init
