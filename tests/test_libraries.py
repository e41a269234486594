"""Tiny transformers from the libraries people train with, dropout on, each
step written as that library's users write it: planned with Auto(),
ShardParallel() and as a 2-stage pipeline, run 3 SGD steps on the 8 fake CPU
devices, and compared with jax.jit of the same step (issue 17).

- flax linen: nn.scan over nn.remat blocks (maxtext style), rngs={'dropout': key};
- flax nnx: nnx.Rngs, nnx.split/merge around a pure step, nnx.value_and_grad;
- equinox: eqx.nn.Dropout(key=...), eqx.filter_value_and_grad, eqx.partition;
- penzai: the llamalike transformer in a scanned LayerStack, with
  StochasticDropout inserted on every residual branch, jax.value_and_grad.

None is skipped when its library is missing: the libraries are pinned in
pyproject.toml's `test` extra.  The slowest cases run with `-m slow`; every
library keeps at least one plan in the default run.
"""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import meshplan

BATCH, SEQ, HIDDEN, HEADS, LAYERS, VOCAB = 8, 8, 32, 2, 2, 32
RATE = 0.1
TX = optax.sgd(0.1)
STEPS = 3
# A leaf whose true gradient is exactly zero (an attention key bias: softmax
# ignores a shift shared by all keys) holds only rounding noise, ~1e-9, that
# any other summation order draws anew.  Such leaves are judged against this
# scale instead of their own size; every trained leaf here is ~100 times above it.
FLOOR = 1e-4


def _tokens():
    t = jax.random.randint(jax.random.key(100), (BATCH, SEQ + 1), 0, VOCAB)
    return {"inputs": t[:, :-1], "targets": t[:, 1:]}


def _xent(logits, targets):
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def flax_linen():
    import flax.linen as nn

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            h = nn.LayerNorm()(x)
            mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
            h = nn.MultiHeadDotProductAttention(num_heads=HEADS, dropout_rate=RATE,
                                                deterministic=False)(h, h, mask=mask)
            x = x + nn.Dropout(RATE, deterministic=False)(h)
            h = nn.Dense(HIDDEN)(nn.gelu(nn.Dense(2 * HIDDEN)(nn.LayerNorm()(x))))
            return x + nn.Dropout(RATE, deterministic=False)(h), None

    class LM(nn.Module):
        @nn.compact
        def __call__(self, tokens):
            embed = nn.Embed(VOCAB, HIDDEN)
            blocks = nn.scan(nn.remat(Block, prevent_cse=False), variable_axes={"params": 0},
                             split_rngs={"params": True, "dropout": True}, length=LAYERS)
            x, _ = blocks()(embed(tokens), None)
            return embed.attend(nn.LayerNorm()(x))

    model = LM()
    params = model.init(jax.random.key(0), jnp.zeros((BATCH, SEQ), jnp.int32))["params"]

    def step(state, batch):
        key, dropout = jax.random.split(state["key"])

        def loss_fn(p):
            logits = model.apply({"params": p}, batch["inputs"], rngs={"dropout": dropout})
            return _xent(logits, batch["targets"])
        loss, grads = jax.value_and_grad(loss_fn)(state["params"])
        updates, opt = TX.update(grads, state["opt"], state["params"])
        return ({"params": optax.apply_updates(state["params"], updates), "opt": opt,
                 "key": key}, {"loss": loss})
    return step, {"params": params, "opt": TX.init(params), "key": jax.random.key(1)}


def flax_nnx():
    from flax import nnx

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.ln1 = nnx.LayerNorm(HIDDEN, rngs=rngs)
            self.attn = nnx.MultiHeadAttention(num_heads=HEADS, in_features=HIDDEN,
                                               dropout_rate=RATE, decode=False,
                                               deterministic=False, rngs=rngs)
            self.ln2 = nnx.LayerNorm(HIDDEN, rngs=rngs)
            self.up = nnx.Linear(HIDDEN, 2 * HIDDEN, rngs=rngs)
            self.down = nnx.Linear(2 * HIDDEN, HIDDEN, rngs=rngs)
            self.drop = nnx.Dropout(RATE, deterministic=False, rngs=rngs)

        def __call__(self, x):
            mask = nnx.make_causal_mask(jnp.ones(x.shape[:2]))
            x = x + self.drop(self.attn(self.ln1(x), mask=mask))
            return x + self.drop(self.down(nnx.gelu(self.up(self.ln2(x)))))

    class LM(nnx.Module):
        def __init__(self, rngs):
            self.embed = nnx.Embed(VOCAB, HIDDEN, rngs=rngs)
            self.blocks = nnx.List([Block(rngs) for _ in range(LAYERS)])
            self.ln = nnx.LayerNorm(HIDDEN, rngs=rngs)

        def __call__(self, tokens):
            x = self.embed(tokens)
            for block in self.blocks:
                x = block(x)
            return self.embed.attend(self.ln(x))

    graphdef, params, rest = nnx.split(LM(nnx.Rngs(params=0, dropout=1)), nnx.Param, ...)

    def step(state, batch):
        model = nnx.merge(graphdef, state["params"], state["rest"])
        loss, grads = nnx.value_and_grad(
            lambda m: _xent(m(batch["inputs"]), batch["targets"]))(model)
        _, params, rest = nnx.split(model, nnx.Param, ...)   # rest: the advanced rng counts
        updates, opt = TX.update(grads, state["opt"], params)
        return ({"params": optax.apply_updates(params, updates), "opt": opt, "rest": rest},
                {"loss": loss})
    return step, {"params": params, "opt": TX.init(params), "rest": rest}


def equinox():
    import equinox as eqx

    class Block(eqx.Module):
        ln1: eqx.nn.LayerNorm
        attn: eqx.nn.MultiheadAttention
        ln2: eqx.nn.LayerNorm
        up: eqx.nn.Linear
        down: eqx.nn.Linear
        drop: eqx.nn.Dropout

        def __init__(self, key):
            k1, k2, k3 = jax.random.split(key, 3)
            self.ln1, self.ln2 = eqx.nn.LayerNorm(HIDDEN), eqx.nn.LayerNorm(HIDDEN)
            self.attn = eqx.nn.MultiheadAttention(HEADS, HIDDEN, dropout_p=RATE, key=k1)
            self.up = eqx.nn.Linear(HIDDEN, 2 * HIDDEN, key=k2)
            self.down = eqx.nn.Linear(2 * HIDDEN, HIDDEN, key=k3)
            self.drop = eqx.nn.Dropout(RATE)

        def __call__(self, x, key):          # one example: x is (seq, hidden)
            k1, k2, k3 = jax.random.split(key, 3)
            h = jax.vmap(self.ln1)(x)
            mask = jnp.tril(jnp.ones((x.shape[0], x.shape[0]), bool))
            x = x + self.drop(self.attn(h, h, h, mask=mask, key=k1), key=k2)
            h = jax.vmap(self.down)(jax.nn.gelu(jax.vmap(self.up)(jax.vmap(self.ln2)(x))))
            return x + self.drop(h, key=k3)

    class LM(eqx.Module):
        embed: eqx.nn.Embedding
        blocks: list
        ln: eqx.nn.LayerNorm

        def __init__(self, key):
            keys = jax.random.split(key, LAYERS + 1)
            self.embed = eqx.nn.Embedding(VOCAB, HIDDEN, key=keys[0])
            self.blocks = [Block(k) for k in keys[1:]]
            self.ln = eqx.nn.LayerNorm(HIDDEN)

        def __call__(self, tokens, key):
            x = jax.vmap(self.embed)(tokens)
            for block, k in zip(self.blocks, jax.random.split(key, LAYERS)):
                x = block(x, k)
            return jax.vmap(self.ln)(x) @ self.embed.weight.T

    params, static = eqx.partition(LM(jax.random.key(0)), eqx.is_array)

    def step(state, batch):
        key, dropout = jax.random.split(state["key"])

        @eqx.filter_value_and_grad
        def loss_fn(p):
            model = eqx.combine(p, static)
            logits = jax.vmap(model)(batch["inputs"], jax.random.split(dropout, BATCH))
            return _xent(logits, batch["targets"])
        loss, grads = loss_fn(state["params"])
        updates, opt = TX.update(grads, state["opt"], state["params"])
        return ({"params": eqx.apply_updates(state["params"], updates), "opt": opt,
                 "key": key}, {"loss": loss})
    return step, {"params": params, "opt": TX.init(params), "key": jax.random.key(1)}


def penzai():
    from penzai import pz
    from penzai.models.transformer.variants import llamalike_common as llamalike

    config = llamalike.LlamalikeTransformerConfig(
        num_kv_heads=HEADS, query_head_multiplier=1, embedding_dim=HIDDEN,
        projection_dim=HIDDEN // HEADS, mlp_hidden_dim=2 * HIDDEN, num_decoder_blocks=LAYERS,
        vocab_size=VOCAB, mlp_variant="swiglu", tie_embedder_and_logits=True,
        use_layer_stack=True)
    model = llamalike.build_llamalike_transformer(config, init_base_rng=jax.random.key(0))
    # llamalike has no dropout: rewrite the tree as penzai users do
    model = model.select().at_instances_of(pz.nn.Residual).apply(
        lambda r: pz.nn.Residual(pz.nn.Sequential([r.delta, pz.nn.StochasticDropout(RATE)])))
    unbound, params = pz.unbind_params(model)
    params = pz.freeze_params(params)

    def step(state, batch):
        key, dropout = jax.random.split(state["key"])

        def loss_fn(p):
            lm = pz.bind_variables(unbound, p)
            tokens = pz.nx.wrap(batch["inputs"]).tag("batch", "seq")
            logits = lm(tokens, random_stream=pz.RandomStream.from_base_key(dropout))
            return _xent(logits.unwrap("batch", "seq", "vocabulary"), batch["targets"])
        loss, grads = jax.value_and_grad(loss_fn)(state["params"])
        updates, opt = TX.update(grads, state["opt"], state["params"])
        return ({"params": optax.apply_updates(state["params"], updates), "opt": opt,
                 "key": key}, {"loss": loss})
    return step, {"params": params, "opt": TX.init(params), "key": jax.random.key(1)}


LIBRARIES = {"flax_linen": flax_linen, "flax_nnx": flax_nnx, "equinox": equinox,
             "penzai": penzai}
METHODS = {"auto": meshplan.Auto, "shard": meshplan.ShardParallel,
           "pipeline": lambda: meshplan.PipeshardParallel(stages=2),
           # tiny models plan replicated on CPU: this one forces dropout
           # draws and weights to be split inside each stage
           "manual": lambda: meshplan.Manual(dp=2, tp=2, pp=2, num_micro_batches=1)}
# (library, method) pairs in the default run; the rest are marked slow
# (pipelines of scanned layers: tests/test_unstack.py in the default run too)
DEFAULT = {("flax_linen", "shard"), ("flax_nnx", "manual"), ("equinox", "shard"),
           ("penzai", "shard")}


# pairs run after the default run instead (-m extended: .ci/run)
EXTENDED = {("flax_linen", "shard"), ("equinox", "auto"), ("penzai", "shard")}


def _cases():
    for lib in LIBRARIES:
        for method in METHODS:
            marks = () if (lib, method) in DEFAULT - EXTENDED else \
                (pytest.mark.extended,) if (lib, method) in EXTENDED else (pytest.mark.slow,)
            yield pytest.param(lib, method, marks=marks, id=f"{lib}-{method}")


@pytest.fixture(scope="module")
def references():
    return {}                   # library -> (step, first state, jit's losses, jit's last state)


def _reference(references, lib):
    if lib not in references:
        step_fn, state = LIBRARIES[lib]()
        jitted, ref, losses = jax.jit(step_fn), state, []
        for _ in range(STEPS):
            ref, metrics = jitted(ref, _tokens())
            losses.append(float(metrics["loss"]))
        references[lib] = (step_fn, state, losses, ref)
    return references[lib]


def _plain(leaf):
    if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        return np.asarray(jax.random.key_data(leaf))
    return np.asarray(leaf)


@pytest.mark.parametrize("lib,method", list(_cases()))
def test_library_step_with_dropout_matches_jit(references, lib, method):
    step_fn, state, losses, ref = _reference(references, lib)
    step = meshplan.parallelize(step_fn, method=METHODS[method]())
    for ref_loss in losses:
        state, metrics = step(state, _tokens())
        assert abs(float(metrics["loss"]) - ref_loss) <= 1e-5 * abs(ref_loss)
    if method in ("pipeline", "manual"):
        assert len(step.plan.stages) == 2
    assert jax.tree.structure(state) == jax.tree.structure(ref)
    paths = jax.tree_util.tree_flatten_with_path(ref)[0]
    for (path, b), a in zip(paths, jax.tree.leaves(state)):
        a, b = _plain(a), _plain(b)
        if b.dtype.kind != "f":                     # rng keys and counts: exact
            assert (a == b).all(), jax.tree_util.keystr(path)
            continue
        a, b = a.astype(np.float64), b.astype(np.float64)
        name = jax.tree_util.keystr(path)
        if np.linalg.norm(b) < FLOOR:                # only the key biases are noise
            assert "['key']['bias']" in name, name
        assert np.linalg.norm(a - b) <= 1e-4 * max(np.linalg.norm(b), FLOOR), name
