"""A GPT-2/3 style decoder-only transformer in plain JAX.

Layout (pre-LayerNorm, tied output embedding)::

    params["wte"]  [vocab, hidden]         token embedding (also the output layer)
    params["wpe"]  [seq_len, hidden]       learned position embedding
    params["h{i}"] = {"ln1": {scale, bias},
                      "attn": {"qkv": {w [h, 3h], b}, "proj": {w [h, h], b}},
                      "ln2": {scale, bias},
                      "mlp": {"fc": {w [h, 4h], b}, "proj": {w [4h, h], b}}}
    params["ln_f"] {scale, bias}

With ``dropout`` > 0 the step drops activations as Megatron-LM does (its
default rate is 0.1 for both kinds): the attention probabilities, and the
embeddings' sum and each block's two residual branches before they are
added.  Its key is ``state["rng"]``, the raw data of a key of ``rng_impl``
(JAX's default threefry, ``uint32[2]``, or ``rbg``: Philox, as PyTorch and so
Megatron-LM draw, ``uint32[4]``), split every step.

With ``scan_layers=True`` the blocks are stored once as ``params["h"]`` with a
leading ``[layers]`` dimension on every leaf and applied with ``jax.lax.scan``.
Parameter count: 12·l·h² + 13·l·h + (V + s)·h + 2h.

The attention, MLP, embedding and LM-head helpers are shared with ``moe.py``.
"""
from __future__ import annotations

import math
from typing import Any, Mapping

import jax
import jax.numpy as jnp

from ..errors import ModelConfigError
from .common import (F32, FLOAT_DTYPES, Batch, InitFn, Params, State, TrainStep,
                     adam_train_step, dense, dense_init, layer_norm, layer_norm_init,
                     normal, softmax_cross_entropy, to_dtype)

DEFAULTS: dict[str, Any] = {
    "batch": 8,
    "seq_len": 32,
    "hidden": 64,
    "layers": 2,
    "heads": 4,
    "vocab": 256,
    "dtype": "float32",
    "compute_dtype": "float32",
    "scan_layers": False,
    "learning_rate": 1e-3,
    "optimizer": "adam",
    "dropout": 0.0,
    "rng_impl": "threefry2x32",
}
CHOICES: dict[str, tuple[str, ...]] = {"dtype": FLOAT_DTYPES, "compute_dtype": FLOAT_DTYPES,
                                       "rng_impl": ("threefry2x32", "rbg")}
NON_NEGATIVE: tuple[str, ...] = ("dropout",)

INIT_STD = 0.02


def check_heads(model: str, config: Mapping[str, Any]) -> None:
    if config["hidden"] % config["heads"] != 0:
        raise ModelConfigError(
            f"model '{model}': hidden ({config['hidden']}) must be divisible by "
            f"heads ({config['heads']})")


def finalize(config: dict[str, Any]) -> dict[str, Any]:
    check_heads("gpt", config)
    if not config["dropout"] < 1:
        raise ModelConfigError(f"model 'gpt': dropout ({config['dropout']}) must be below 1")
    return config


def dropout(x: jax.Array, rate: float, key: jax.Array | None) -> jax.Array:
    """``x`` with each element zeroed at probability ``rate`` and the rest
    scaled by 1 / (1 - rate); ``x`` itself without a key or at rate 0."""
    if key is None or rate == 0:
        return x
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0).astype(x.dtype)


# ---------------------------------------------------------------- building blocks

def init_attention(key: jax.Array, hidden: int, layers: int, dtype: jnp.dtype) -> Params:
    k_qkv, k_proj = jax.random.split(key)
    resid_std = INIT_STD / math.sqrt(2 * layers)  # GPT-2's scaled residual init
    return {"qkv": dense_init(k_qkv, hidden, 3 * hidden, dtype, std=INIT_STD),
            "proj": dense_init(k_proj, hidden, hidden, dtype, std=resid_std)}


def attention(p: Params, x: jax.Array, heads: int, cdt: jnp.dtype, rate: float = 0.0,
              key: jax.Array | None = None) -> jax.Array:
    """Causal multi-head self-attention with a fused qkv projection; with
    ``key``, dropout at ``rate`` on the attention probabilities.

    The fused projection's columns are grouped by head (head-major, then q/k/v,
    then the head dimension, as Megatron-LM lays them out), so splitting its
    output features over devices splits whole heads."""
    b, s, h = x.shape
    head_dim = h // heads
    qkv = dense(p["qkv"], x, cdt).reshape(b, s, heads, 3, head_dim)
    q, k, v = qkv[:, :, :, 0], qkv[:, :, :, 1], qkv[:, :, :, 2]
    scores = jnp.einsum("bqnd,bknd->bnqk", q, k).astype(F32) / math.sqrt(head_dim)
    causal = jnp.tril(jnp.ones((s, s), dtype=bool))
    scores = jnp.where(causal, scores, jnp.finfo(F32).min)
    probs = dropout(jax.nn.softmax(scores, axis=-1).astype(cdt), rate, key)
    ctx = jnp.einsum("bnqk,bknd->bqnd", probs, v).reshape(b, s, h)
    return dense(p["proj"], ctx, cdt)


def init_mlp(key: jax.Array, hidden: int, ffn: int, layers: int, dtype: jnp.dtype) -> Params:
    k_fc, k_proj = jax.random.split(key)
    resid_std = INIT_STD / math.sqrt(2 * layers)
    return {"fc": dense_init(k_fc, hidden, ffn, dtype, std=INIT_STD),
            "proj": dense_init(k_proj, ffn, hidden, dtype, std=resid_std)}


def mlp(p: Params, x: jax.Array, cdt: jnp.dtype) -> jax.Array:
    return dense(p["proj"], jax.nn.gelu(dense(p["fc"], x, cdt)), cdt)


def init_block(key: jax.Array, hidden: int, layers: int, dtype: jnp.dtype) -> Params:
    k_attn, k_mlp = jax.random.split(key)
    return {"ln1": layer_norm_init(hidden, dtype),
            "attn": init_attention(k_attn, hidden, layers, dtype),
            "ln2": layer_norm_init(hidden, dtype),
            "mlp": init_mlp(k_mlp, hidden, 4 * hidden, layers, dtype)}


def block(p: Params, x: jax.Array, heads: int, cdt: jnp.dtype, rate: float = 0.0,
          key: jax.Array | None = None) -> jax.Array:
    """One pre-LayerNorm block; with ``key``, dropout at ``rate`` on the
    attention probabilities and on both residual branches."""
    k = jax.random.split(key, 3) if key is not None else (None,) * 3
    x = x + dropout(attention(p["attn"], layer_norm(p["ln1"], x), heads, cdt, rate, k[0]),
                    rate, k[1])
    return x + dropout(mlp(p["mlp"], layer_norm(p["ln2"], x), cdt), rate, k[2])


def init_embeddings(key: jax.Array, vocab: int, seq_len: int, hidden: int,
                    dtype: jnp.dtype) -> Params:
    k_wte, k_wpe = jax.random.split(key)
    return {"wte": normal(k_wte, (vocab, hidden), INIT_STD, dtype),
            "wpe": normal(k_wpe, (seq_len, hidden), INIT_STD / 2, dtype)}


def embed(params: Params, input_ids: jax.Array, cdt: jnp.dtype) -> jax.Array:
    tokens = jnp.take(params["wte"], input_ids, axis=0).astype(cdt)
    return tokens + params["wpe"].astype(cdt)[None]


def lm_loss(params: Params, x: jax.Array, labels: jax.Array, cdt: jnp.dtype) -> jax.Array:
    """Final LayerNorm, tied output projection ``x @ wte.T``, next-token xent."""
    x = layer_norm(params["ln_f"], x)
    logits = jnp.einsum("bsh,vh->bsv", x, params["wte"].astype(cdt))
    return softmax_cross_entropy(logits, labels)


def lm_batch(key: jax.Array, batch: int, seq_len: int, vocab: int) -> Batch:
    """Random tokens; the labels are the inputs shifted left by one."""
    input_ids = jax.random.randint(key, (batch, seq_len), 0, vocab, jnp.int32)
    return {"input_ids": input_ids, "labels": jnp.roll(input_ids, -1, axis=1)}


# ---------------------------------------------------------------- the model

def make(config: Mapping[str, Any]) -> tuple[TrainStep, InitFn]:
    batch_size: int = config["batch"]
    seq_len: int = config["seq_len"]
    hidden: int = config["hidden"]
    layers: int = config["layers"]
    heads: int = config["heads"]
    vocab: int = config["vocab"]
    scan_layers: bool = config["scan_layers"]
    dtype = to_dtype(config["dtype"])
    cdt = to_dtype(config["compute_dtype"])
    rate: float = config["dropout"]
    impl: str = config["rng_impl"]

    def loss_fn(params: Params, extra: dict[str, Any], batch: Batch
                ) -> tuple[jax.Array, dict[str, Any]]:
        keys: Any = [None] * (layers + 1)
        if rate > 0:
            rng, drawn = jax.random.split(jax.random.wrap_key_data(extra["rng"], impl=impl))
            extra = {**extra, "rng": jax.random.key_data(rng)}
            keys = jax.random.split(drawn, layers + 1)
        x = dropout(embed(params, batch["input_ids"], cdt), rate, keys[layers])
        if scan_layers:
            def body(carry: jax.Array, xs: Any) -> tuple[jax.Array, None]:
                p, key = xs
                return block(p, carry, heads, cdt, rate, key), None
            x, _ = jax.lax.scan(body, x, (params["h"], keys[:layers] if rate > 0 else None))
        else:
            for i in range(layers):
                x = block(params[f"h{i}"], x, heads, cdt, rate, keys[i])
        return lm_loss(params, x, batch["labels"], cdt), extra

    tx, train_step = adam_train_step(loss_fn, config["learning_rate"], config["optimizer"])

    def init(seed: int) -> tuple[State, Batch]:
        k_emb, k_blocks, k_data = jax.random.split(jax.random.PRNGKey(seed), 3)
        params: Params = init_embeddings(k_emb, vocab, seq_len, hidden, dtype)
        block_keys = jax.random.split(k_blocks, layers)
        if scan_layers:
            params["h"] = jax.vmap(lambda k: init_block(k, hidden, layers, dtype))(block_keys)
        else:
            for i in range(layers):
                params[f"h{i}"] = init_block(block_keys[i], hidden, layers, dtype)
        params["ln_f"] = layer_norm_init(hidden, dtype)
        state: State = {"params": params, "opt_state": tx.init(params)}
        if rate > 0:
            state["rng"] = jax.random.key_data(jax.random.key(seed + 1, impl=impl))
        return state, lm_batch(k_data, batch_size, seq_len, vocab)

    return train_step, init
