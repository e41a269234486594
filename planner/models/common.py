"""Shared pieces of the built-in models: the BuiltModel record, config parsing,
a few plain-JAX layers and the Adam train step.

Conventions used by every model:

* ``state = {"params": ..., "opt_state": ..., **extra}`` where ``extra`` holds
  non-trainable state (``"batch_stats"`` for the Wide-ResNet).
* Parameters are stored in ``config["dtype"]``; activations and matmuls run in
  ``config["compute_dtype"]`` (mixed precision); normalisation statistics,
  softmaxes and the loss are computed in float32.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import optax

from ..errors import ModelConfigError
from ..markers import value_and_grad  # jax.value_and_grad + end-of-backward marker

Params = dict[str, Any]
PyTree = Any
Batch = dict[str, jax.Array]
State = dict[str, PyTree]
Metrics = dict[str, jax.Array]
TrainStep = Callable[[State, Batch], tuple[State, Metrics]]
InitFn = Callable[[int], tuple[State, Batch]]
# loss_fn(params, extra_state, batch) -> (scalar float32 loss, new extra_state)
LossFn = Callable[[Params, dict[str, PyTree], Batch], tuple[jax.Array, dict[str, PyTree]]]

F32 = jnp.float32

# Accepted spellings of floating dtypes; values are canonical names.
DTYPE_ALIASES: dict[str, str] = {
    "float32": "float32", "fp32": "float32", "f32": "float32",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "fp16": "float16", "f16": "float16", "half": "float16",
}
FLOAT_DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class BuiltModel:
    """A built-in model, ready to plan (``abstract_args``) or to run (``init``)."""

    name: str
    preset: str | None
    config: Mapping[str, object]
    train_step: TrainStep
    init: InitFn
    abstract_args: tuple
    batch_argnums: tuple[int, ...] = (1,)

    def param_count(self) -> int:
        """Number of trainable parameters, read from ``abstract_args`` (no allocation)."""
        params = self.abstract_args[0]["params"]
        return sum(math.prod(leaf.shape) for leaf in jax.tree_util.tree_leaves(params))

    def __repr__(self) -> str:
        label = self.preset or self.name
        sizes = ", ".join(f"{k}={v}" for k, v in self.config.items())
        return f"BuiltModel({label}: {sizes})"


# ---------------------------------------------------------------- config parsing

_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")


def _fail(model: str, key: str, raw: object, expected: str) -> ModelConfigError:
    return ModelConfigError(
        f"model '{model}': bad value {raw!r} for '{key}'; expected {expected}")


def parse_value(model: str, key: str, raw: object, default: object,
                choices: tuple[str, ...] | None = None) -> object:
    """Convert ``raw`` (often a CLI string) to the type of ``default``."""
    if isinstance(default, bool):
        if isinstance(raw, bool):
            return raw
        if isinstance(raw, int) and raw in (0, 1):
            return bool(raw)
        if isinstance(raw, str) and raw.strip().lower() in _TRUE + _FALSE:
            return raw.strip().lower() in _TRUE
        raise _fail(model, key, raw, "true or false")
    if isinstance(default, int):
        if isinstance(raw, bool):
            raise _fail(model, key, raw, "an integer")
        if isinstance(raw, int):
            return raw
        if isinstance(raw, float) and raw.is_integer():
            return int(raw)
        if isinstance(raw, str):
            try:
                return int(raw.strip())
            except ValueError:
                pass
        raise _fail(model, key, raw, "an integer")
    if isinstance(default, float):
        if isinstance(raw, bool):
            raise _fail(model, key, raw, "a number")
        value: float | None = None
        if isinstance(raw, (int, float)):
            value = float(raw)
        elif isinstance(raw, str):
            try:
                value = float(raw.strip())
            except ValueError:
                value = None
        if value is None or not math.isfinite(value):
            raise _fail(model, key, raw, "a finite number")
        return value
    if isinstance(default, str):
        if not isinstance(raw, str):
            raise _fail(model, key, raw, "a string")
        value_s = raw.strip().lower()
        if choices is FLOAT_DTYPES:
            value_s = DTYPE_ALIASES.get(value_s, value_s)
        if choices is not None and value_s not in choices:
            raise _fail(model, key, raw, "one of " + ", ".join(choices))
        return value_s
    raise TypeError(f"unsupported default type for {model}.{key}: {type(default)}")


def resolve_config(model: str, defaults: Mapping[str, object],
                   layers: list[Mapping[str, object]],
                   choices: Mapping[str, tuple[str, ...]],
                   non_negative: tuple[str, ...] = ()) -> dict[str, object]:
    """Apply override dicts in order onto ``defaults`` with type conversion.

    Integers must be >= 1, floats > 0 (either >= 0 for keys in ``non_negative``).
    Keys may be spelled with '-' instead of '_'.
    """
    config = dict(defaults)
    for overrides in layers:
        for raw_key, raw in overrides.items():
            key = str(raw_key).strip().replace("-", "_")
            if key not in defaults:
                raise ModelConfigError(
                    f"model '{model}': unknown key '{raw_key}'; valid keys: "
                    + ", ".join(defaults))
            config[key] = parse_value(model, key, raw, defaults[key], choices.get(key))
    for key, value in config.items():
        if isinstance(value, bool):
            continue
        if isinstance(value, int):
            low = 0 if key in non_negative else 1
            if value < low:
                raise _fail(model, key, value, f"an integer >= {low}")
        elif isinstance(value, float) and key in non_negative and value < 0:
            raise _fail(model, key, value, "a number >= 0")
        elif isinstance(value, float) and key not in non_negative and value <= 0:
            raise _fail(model, key, value, "a number > 0")
    return config


def to_dtype(name: object) -> jnp.dtype:
    return jnp.dtype(DTYPE_ALIASES[str(name)])


# ---------------------------------------------------------------- layers

def normal(key: jax.Array, shape: tuple[int, ...], std: float, dtype: jnp.dtype) -> jax.Array:
    return (std * jax.random.normal(key, shape, F32)).astype(dtype)


def dense_init(key: jax.Array, d_in: int, d_out: int, dtype: jnp.dtype,
               std: float | None = None, bias: bool = True) -> Params:
    """``{"w": [d_in, d_out], "b": [d_out]}``; default std is 1/sqrt(d_in)."""
    std = 1.0 / math.sqrt(d_in) if std is None else std
    p: Params = {"w": normal(key, (d_in, d_out), std, dtype)}
    if bias:
        p["b"] = jnp.zeros((d_out,), dtype)
    return p


def dense(p: Params, x: jax.Array, cdt: jnp.dtype) -> jax.Array:
    """``x @ w + b`` in the compute dtype."""
    y = jnp.dot(x.astype(cdt), p["w"].astype(cdt))
    if "b" in p:
        y = y + p["b"].astype(cdt)
    return y


def layer_norm_init(dim: int, dtype: jnp.dtype) -> Params:
    return {"scale": jnp.ones((dim,), dtype), "bias": jnp.zeros((dim,), dtype)}


def layer_norm(p: Params, x: jax.Array, eps: float = 1e-5) -> jax.Array:
    """LayerNorm over the last axis; statistics in float32, result in x's dtype."""
    x32 = x.astype(F32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + eps)
    y = y * p["scale"].astype(F32) + p["bias"].astype(F32)
    return y.astype(x.dtype)


def softmax_cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Mean negative log-likelihood of integer ``labels``; float32."""
    logp = jax.nn.log_softmax(logits.astype(F32), axis=-1)
    nll = -jnp.take_along_axis(logp, labels[..., None].astype(jnp.int32), axis=-1)
    return jnp.mean(nll)


# ---------------------------------------------------------------- training

OPTIMIZERS = {"adam": optax.adam, "sgd": optax.sgd}


def adam_train_step(loss_fn: LossFn, learning_rate: float, optimizer: str = "adam"
                    ) -> tuple[optax.GradientTransformation, TrainStep]:
    """The train step shared by all models: value_and_grad, then an optax
    optimizer (Adam by default; plain SGD is there for exact numerics checks:
    Adam's normalisation amplifies rounding differences of tiny gradients)."""
    if optimizer not in OPTIMIZERS:
        from ..errors import ModelConfigError
        raise ModelConfigError(f"optimizer={optimizer!r}: use one of {sorted(OPTIMIZERS)}")
    tx = OPTIMIZERS[optimizer](learning_rate)

    def train_step(state: State, batch: Batch) -> tuple[State, Metrics]:
        params = state["params"]
        extra = {k: v for k, v in state.items() if k not in ("params", "opt_state")}
        (loss, new_extra), grads = value_and_grad(loss_fn, has_aux=True)(
            params, extra, batch)
        updates, opt_state = tx.update(grads, state["opt_state"], params)
        new_params = optax.apply_updates(params, updates)
        new_state: State = {"params": new_params, "opt_state": opt_state, **new_extra}
        return new_state, {"loss": loss.astype(F32)}

    return tx, train_step
