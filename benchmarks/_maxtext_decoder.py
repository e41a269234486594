"""A decoder with MaxText's default shape (base.yml, decoder_block "llama2"),
written here for the MaxText comparison (benchmarks/maxtext_tpu.py): RMSNorm
without biases, q/k/v/o projections of ``heads`` x 128, a gated SiLU MLP
(``wi_0``, ``wi_1``: emb x mlp, ``wo``: mlp x emb), untied output logits,
float32 weights and AdamW state with bfloat16 compute (MaxText's
``weight_dtype`` float32, ``dtype`` bfloat16).  Attention runs in blocks of queries over the
keys up to each block's end, as a fused (flash/splash) kernel schedules it,
so that one block's scores live at a time and fully masked blocks are
skipped; unlike such a kernel, each block's scores still pass through HBM
(XLA attention), which the planner prices.  Not modelled: rotary position
embeddings (element-wise on q and k).

Only abstract values are built (``jax.ShapeDtypeStruct``): plans, not runs.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from jax.ad_checkpoint import checkpoint_name

HEAD_DIM = 128
QUERY_BLOCK = 512       # queries per attention block
CDT = jnp.bfloat16


def _rms(x, scale):
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6)
    return (y * scale).astype(CDT)


def _attend(q, k, v, start, block):
    """Causal attention of queries ``start .. start + block`` over the keys
    up to the block's end: blockwise, as fused attention kernels run it (no
    scores for fully masked key blocks; one block's scores live at a time)."""
    end = start + block
    qb, kb, vb = q[:, start:end], k[:, :end], v[:, :end]
    scores = jnp.einsum("bqhd,bkhd->bhqk", qb, kb).astype(jnp.float32) / HEAD_DIM ** 0.5
    causal = jnp.arange(start, end)[:, None] >= jnp.arange(end)[None, :]
    probs = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", probs.astype(CDT), vb)


def _layer(p, x, heads):
    b, s, e = x.shape
    h = _rms(x, p["pre_norm"])
    q, k, v = (checkpoint_name(jnp.einsum("bse,ehd->bshd", h, p[n].astype(CDT)), f"{n}_proj")
               for n in ("q", "k", "v"))
    ctx = jnp.concatenate([_attend(q, k, v, i, min(QUERY_BLOCK, s)) for i in
                           range(0, s, min(QUERY_BLOCK, s))], axis=1)
    x = x + checkpoint_name(jnp.einsum("bshd,hde->bse", ctx, p["o"].astype(CDT)), "out_proj")
    h = _rms(x, p["post_norm"])
    wi_0 = checkpoint_name(h @ p["wi_0"].astype(CDT), "mlpwi_0")
    wi_1 = checkpoint_name(h @ p["wi_1"].astype(CDT), "mlpwi_1")
    return x + checkpoint_name((jax.nn.silu(wi_0) * wi_1) @ p["wo"].astype(CDT), "mlpwo")


# MaxText's remat_policy as jax.checkpoint policies (its decoder's names)
MINIMAL = ("q_proj", "k_proj", "v_proj", "out_proj", "mlpwi_0", "mlpwi_1", "mlpwo")


def remat_layer(policy: str):
    """The layer under MaxText's ``remat_policy``: "minimal" keeps the
    projections' outputs, "full" keeps nothing, "none" keeps everything."""
    if policy == "none":
        return _layer
    keep = jax.checkpoint_policies.save_only_these_names(*MINIMAL) if policy == "minimal" \
        else jax.checkpoint_policies.nothing_saveable
    return jax.checkpoint(_layer, policy=keep, static_argnums=(2,))


def abstract_step(emb: int, heads: int, mlp: int, layers: int, vocab: int, seq: int,
                  batch: int, remat_policy: str = "none"):
    """``(train_step, abstract state, abstract batch)`` of the decoder, each
    layer under MaxText's ``remat_policy``."""
    layer_fn = remat_layer(remat_policy)
    f32 = jnp.float32

    def sds(*shape, dtype=f32):
        return jax.ShapeDtypeStruct(shape, dtype)

    layer = {"pre_norm": sds(emb), "post_norm": sds(emb), "q": sds(emb, heads, HEAD_DIM),
             "k": sds(emb, heads, HEAD_DIM), "v": sds(emb, heads, HEAD_DIM),
             "o": sds(heads, HEAD_DIM, emb), "wi_0": sds(emb, mlp), "wi_1": sds(emb, mlp),
             "wo": sds(mlp, emb)}
    params = {"embed": sds(vocab, emb), "final_norm": sds(emb), "logits": sds(emb, vocab),
              **{f"layer{i}": layer for i in range(layers)}}
    tx = optax.adamw(1e-4)

    def loss_fn(p, batch):
        x = p["embed"].astype(CDT)[batch["inputs"]]
        for i in range(layers):
            x = layer_fn(p[f"layer{i}"], x, heads)
        logits = (_rms(x, p["final_norm"]) @ p["logits"].astype(CDT)).astype(f32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

    def train_step(state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(state["params"], batch)
        updates, opt = tx.update(grads, state["opt_state"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt_state": opt}, loss

    opt_state = jax.eval_shape(tx.init, params)
    tokens = {"inputs": sds(batch, seq, dtype=jnp.int32),
              "targets": sds(batch, seq, dtype=jnp.int32)}
    return train_step, {"params": params, "opt_state": opt_state}, tokens
