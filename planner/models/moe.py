"""A GShard-style mixture-of-experts transformer (Lepikhin et al. 2020).

The GPT blocks of ``gpt.py`` where every other layer (odd ``i``) replaces its
MLP by ``num_experts`` experts with top-2 gating.  Tokens are cut into groups of
``expert_group_size`` (0: one group per sequence); each expert takes at most
``capacity = ceil(capacity_factor * 2 * group_size / num_experts)`` tokens per
group.  Dispatch and combine are einsums with one-hot tensors of shape
``[groups, group_size, experts, capacity]``, so the expert dimension is an
explicit tensor dimension (what expert parallelism shards)::

    params["h{i}"]["moe"] = {"gate": {"w": [h, E]},
                             "w1": [E, h, r·h], "b1": [E, r·h],
                             "w2": [E, r·h, h], "b2": [E, h]}

with ``r = mlp_ratio`` (4 like the dense MLP; the Alpa presets use 8, which is
what their names count).  The loss adds ``aux_loss_weight`` times GShard's
load-balancing loss of every MoE layer.
"""
from __future__ import annotations

import math
from typing import Any, Mapping

import jax
import jax.numpy as jnp

from ..errors import ModelConfigError
from .common import (F32, FLOAT_DTYPES, Batch, InitFn, Params, State, TrainStep,
                     adam_train_step, layer_norm, layer_norm_init, normal, to_dtype)
from .gpt import (INIT_STD, attention, check_heads, embed, init_attention, init_embeddings,
                  init_mlp, lm_batch, lm_loss, mlp)

DEFAULTS: dict[str, Any] = {
    "batch": 8,
    "seq_len": 32,
    "hidden": 64,
    "layers": 2,
    "heads": 4,
    "vocab": 256,
    "num_experts": 4,
    "capacity_factor": 1.0,
    "expert_group_size": 0,
    "mlp_ratio": 4,
    "aux_loss_weight": 0.01,
    "dtype": "float32",
    "compute_dtype": "float32",
    "learning_rate": 1e-3,
    "optimizer": "adam",
}
CHOICES: dict[str, tuple[str, ...]] = {"dtype": FLOAT_DTYPES, "compute_dtype": FLOAT_DTYPES}
NON_NEGATIVE: tuple[str, ...] = ("expert_group_size",)


def finalize(config: dict[str, Any]) -> dict[str, Any]:
    check_heads("moe", config)
    if config["num_experts"] < 2:
        raise ModelConfigError("model 'moe': top-2 gating needs num_experts >= 2")
    if config["expert_group_size"] == 0:
        config["expert_group_size"] = config["seq_len"]
    tokens = config["batch"] * config["seq_len"]
    if tokens % config["expert_group_size"] != 0:
        raise ModelConfigError(
            f"model 'moe': expert_group_size ({config['expert_group_size']}) must divide "
            f"batch*seq_len ({tokens})")
    return config


def expert_capacity(config: Mapping[str, Any]) -> int:
    """Tokens per expert per group: capacity_factor * 2 * group_size / num_experts."""
    raw = config["capacity_factor"] * 2 * config["expert_group_size"] / config["num_experts"]
    return max(1, math.ceil(raw))


def is_moe_layer(i: int) -> bool:
    return i % 2 == 1


# ---------------------------------------------------------------- the MoE layer

def init_moe(key: jax.Array, hidden: int, ffn: int, experts: int, layers: int,
             dtype: jnp.dtype) -> Params:
    k_gate, k_w1, k_w2 = jax.random.split(key, 3)
    resid_std = INIT_STD / math.sqrt(2 * layers)
    return {"gate": {"w": normal(k_gate, (hidden, experts), INIT_STD, dtype)},
            "w1": normal(k_w1, (experts, hidden, ffn), INIT_STD, dtype),
            "b1": jnp.zeros((experts, ffn), dtype),
            "w2": normal(k_w2, (experts, ffn, hidden), resid_std, dtype),
            "b2": jnp.zeros((experts, hidden), dtype)}


def top2_routing(logits: jax.Array, capacity: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """GShard top-2 gating for ``logits [G, S, E]`` (float32).

    Returns ``(combine [G,S,E,C] float32, dispatch [G,S,E,C] 0/1 float32,
    aux_loss scalar)``.  Tokens past an expert's capacity are dropped.
    """
    experts = logits.shape[-1]
    gates = jax.nn.softmax(logits, axis=-1)

    index1 = jnp.argmax(gates, axis=-1)
    mask1 = jax.nn.one_hot(index1, experts, dtype=F32)
    # Load balancing: fraction of tokens whose first choice is e times the mean
    # gate of e, summed over experts (E * mean over e; 1.0 when uniform).
    density = jnp.mean(mask1, axis=1)
    density_proxy = jnp.mean(gates, axis=1)
    aux_loss = jnp.mean(density * density_proxy) * experts * experts

    index2 = jnp.argmax(gates * (1.0 - mask1), axis=-1)
    mask2 = jax.nn.one_hot(index2, experts, dtype=F32)

    gate1 = jnp.sum(gates * mask1, axis=-1)
    gate2 = jnp.sum(gates * mask2, axis=-1)
    denom = gate1 + gate2
    denom = jnp.where(denom > 0, denom, 1.0)
    gate1, gate2 = gate1 / denom, gate2 / denom

    # Position of each token in its expert's buffer; second choices queue
    # behind all first choices of the group.
    position1 = jnp.cumsum(mask1, axis=1) - 1.0
    mask1 = mask1 * (position1 < capacity)
    position2 = jnp.cumsum(mask2, axis=1) - 1.0 + jnp.sum(mask1, axis=1, keepdims=True)
    mask2 = mask2 * (position2 < capacity)

    slot1 = jax.nn.one_hot(jnp.sum(position1 * mask1, axis=-1).astype(jnp.int32), capacity,
                           dtype=F32)
    slot2 = jax.nn.one_hot(jnp.sum(position2 * mask2, axis=-1).astype(jnp.int32), capacity,
                           dtype=F32)
    dispatch1 = mask1[..., None] * slot1[:, :, None, :]
    dispatch2 = mask2[..., None] * slot2[:, :, None, :]
    combine = gate1[..., None, None] * dispatch1 + gate2[..., None, None] * dispatch2
    return combine, dispatch1 + dispatch2, aux_loss


def moe_mlp(p: Params, x: jax.Array, group_size: int, capacity: int,
            cdt: jnp.dtype) -> tuple[jax.Array, jax.Array]:
    """Mixture-of-experts MLP for ``x [B, S, h]``; returns (y, aux_loss)."""
    b, s, h = x.shape
    tokens = x.reshape(b * s // group_size, group_size, h)
    logits = jnp.einsum("gsm,me->gse", tokens.astype(F32), p["gate"]["w"].astype(F32))
    combine, dispatch, aux_loss = top2_routing(logits, capacity)
    expert_in = jnp.einsum("gsec,gsm->egcm", dispatch.astype(cdt), tokens.astype(cdt))
    hid = jnp.einsum("egcm,emf->egcf", expert_in, p["w1"].astype(cdt))
    hid = jax.nn.gelu(hid + p["b1"].astype(cdt)[:, None, None, :])
    out = jnp.einsum("egcf,efm->egcm", hid, p["w2"].astype(cdt))
    out = out + p["b2"].astype(cdt)[:, None, None, :]
    y = jnp.einsum("gsec,egcm->gsm", combine.astype(cdt), out)
    return y.reshape(b, s, h), aux_loss


# ---------------------------------------------------------------- the model

def make(config: Mapping[str, Any]) -> tuple[TrainStep, InitFn]:
    batch_size: int = config["batch"]
    seq_len: int = config["seq_len"]
    hidden: int = config["hidden"]
    layers: int = config["layers"]
    heads: int = config["heads"]
    vocab: int = config["vocab"]
    experts: int = config["num_experts"]
    group_size: int = config["expert_group_size"]
    ffn: int = config["mlp_ratio"] * hidden
    aux_weight: float = config["aux_loss_weight"]
    capacity = expert_capacity(config)
    dtype = to_dtype(config["dtype"])
    cdt = to_dtype(config["compute_dtype"])

    def loss_fn(params: Params, extra: dict[str, Any], batch: Batch
                ) -> tuple[jax.Array, dict[str, Any]]:
        x = embed(params, batch["input_ids"], cdt)
        aux_total = jnp.zeros((), F32)
        for i in range(layers):
            p = params[f"h{i}"]
            x = x + attention(p["attn"], layer_norm(p["ln1"], x), heads, cdt)
            if is_moe_layer(i):
                y, aux = moe_mlp(p["moe"], layer_norm(p["ln2"], x), group_size, capacity, cdt)
                aux_total = aux_total + aux
            else:
                y = mlp(p["mlp"], layer_norm(p["ln2"], x), cdt)
            x = x + y
        loss = lm_loss(params, x, batch["labels"], cdt) + aux_weight * aux_total
        return loss, extra

    tx, train_step = adam_train_step(loss_fn, config["learning_rate"], config["optimizer"])

    def init(seed: int) -> tuple[State, Batch]:
        k_emb, k_blocks, k_data = jax.random.split(jax.random.PRNGKey(seed), 3)
        params: Params = init_embeddings(k_emb, vocab, seq_len, hidden, dtype)
        block_keys = jax.random.split(k_blocks, layers)
        for i in range(layers):
            k_attn, k_mlp = jax.random.split(block_keys[i])
            layer: Params = {"ln1": layer_norm_init(hidden, dtype),
                             "attn": init_attention(k_attn, hidden, layers, dtype),
                             "ln2": layer_norm_init(hidden, dtype)}
            if is_moe_layer(i):
                layer["moe"] = init_moe(k_mlp, hidden, ffn, experts, layers, dtype)
            else:
                layer["mlp"] = init_mlp(k_mlp, hidden, ffn, layers, dtype)
            params[f"h{i}"] = layer
        params["ln_f"] = layer_norm_init(hidden, dtype)
        state: State = {"params": params, "opt_state": tx.init(params)}
        return state, lm_batch(k_data, batch_size, seq_len, vocab)

    return train_step, init
