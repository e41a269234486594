"""Fuzzing planner + runtime with random small models on random 8-device meshes.

A hypothesis strategy draws a model from a small grammar -- dense, 1-D
convolution, multi-head self-attention, layer norm, reshape/transpose,
residual blocks, ``lax.scan`` over identical stacked blocks, activations,
slices + concatenation, max / argmax + gather, ``jax.checkpoint`` blocks,
an optional token embedding (integer inputs, a gather) --
with odd sizes (3, 5, 6, ...), and a logical mesh of the 8 fake CPU devices
((8,), (2, 4), (4, 2), (2, 2, 2), (1, 8)), and link/compute figures (the
local ones, or free links and slow compute so that the ILP splits tensors
even at these sizes).  Each model's SGD train step is
planned with ``ShardParallel(mesh_shape=...)`` and run through
``meshplan.parallelize``; the new state and the loss must match the
undecorated step (``jax.jit``) to float32 rounding.

How many examples: a bounded, derandomized number in CI (default 6; each
plans and compiles a program, a few seconds).  More, with fresh randomness::

    MESHPLAN_FUZZ_MODELS=200 pytest tests/test_fuzz_models.py

(``MESHPLAN_FUZZ_MODELS`` > the default also turns derandomization off; a
failing example is printed as the grammar's layer list and the mesh.)
"""
from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import meshplan

CI_MODELS = 6
MODELS = int(os.environ.get("MESHPLAN_FUZZ_MODELS", CI_MODELS))
FUZZ = settings(max_examples=MODELS, deadline=None, derandomize=MODELS <= CI_MODELS,
                suppress_health_check=list(HealthCheck), database=None,
                print_blob=True)
MESHES = [(8,), (2, 4), (4, 2), (2, 2, 2), (1, 8)]
SIZES = [1, 2, 3, 4, 5, 6, 8, 12, 16]
LR = 0.05


# ---------------------------------------------------------------------------
# the grammar: a model is a list of layer descriptions (plain tuples, so a
# failing example prints readably); init/apply interpret them
# ---------------------------------------------------------------------------

@st.composite
def layer(draw, depth: int = 0):
    kinds = ["dense", "conv", "attention", "layer_norm", "act", "transpose_dense",
             "reshape_dense", "residual", "shift_concat", "max_mix", "remat"]
    if depth == 0:
        kinds.append("scan")
    kind = draw(st.sampled_from(kinds))
    if kind == "dense":
        return ("dense", draw(st.sampled_from(SIZES)))
    if kind == "conv":
        return ("conv", draw(st.sampled_from(SIZES)), draw(st.sampled_from([1, 2, 3])))
    if kind == "attention":
        return ("attention", draw(st.sampled_from([1, 2, 3])))
    if kind == "act":
        return ("act", draw(st.sampled_from(["gelu", "relu", "tanh"])))
    if kind == "transpose_dense":
        return ("transpose_dense", draw(st.sampled_from(SIZES)))
    if kind == "reshape_dense":
        return ("reshape_dense",)
    if kind == "residual":
        return ("residual", tuple(draw(st.lists(layer(depth + 1), min_size=1, max_size=2))))
    if kind == "scan":
        return ("scan", draw(st.integers(1, 3)))
    if kind == "remat":
        return ("remat", tuple(draw(st.lists(layer(depth + 1), min_size=1, max_size=2))))
    return (kind,)


@st.composite
def model_and_mesh(draw):
    batch = draw(st.sampled_from([1, 2, 3, 4, 6, 8, 16]))
    seq = draw(st.sampled_from([1, 2, 3, 4, 5, 8]))
    features = draw(st.sampled_from(SIZES))
    layers = tuple(draw(st.lists(layer(), min_size=1, max_size=4)))
    out = draw(st.sampled_from([1, 3, 4, 8]))
    mesh = draw(st.sampled_from(MESHES))
    vocab = draw(st.sampled_from([0, 0, 5, 16]))     # > 0: integer tokens through an embedding
    # "split": links free and compute slow, so the ILP splits what it can
    # (on the local figures models this small mostly stay replicated)
    cluster = draw(st.sampled_from(["split", "split", "local"]))
    return {"batch": batch, "seq": seq, "features": features, "layers": layers, "out": out,
            "mesh": mesh, "vocab": vocab, "cluster": cluster}


def cluster_for(name: str) -> meshplan.ClusterSpec:
    base = meshplan.Cluster.local()
    if name == "local":
        return base
    free = meshplan.LinkSpec(1e15, 0.0)
    return dataclasses.replace(base, intra_host=free, inter_host=free,
                               device=dataclasses.replace(base.device, peak_flops={"float32": 1e6},
                                                          memory_bandwidth_bytes_per_s=1e15))


def _init_layer(spec: tuple, key: Any, d: int, s: int) -> tuple[dict, int, int]:
    """(params, features after, seq after) of one layer on (B, s, d) inputs."""
    kind = spec[0]
    k1, k2, k3 = jax.random.split(key, 3)
    normal = lambda k, shape, fan: jax.random.normal(k, shape) / math.sqrt(fan)  # noqa: E731
    if kind == "dense":
        return {"w": normal(k1, (d, spec[1]), d), "b": jnp.full((spec[1],), 0.1)}, spec[1], s
    if kind == "conv":
        f, width = spec[1], spec[2]
        return {"k": normal(k1, (f, d, width), d * width), "b": jnp.zeros((f,))}, f, s
    if kind == "attention":
        heads = spec[1] if d % spec[1] == 0 else 1
        return {"qkv": normal(k1, (d, 3 * d), d), "o": normal(k2, (d, d), d),
                "heads": None if heads else None}, d, s
    if kind == "layer_norm":
        return {"scale": jnp.ones((d,)) + 0.1 * jax.random.normal(k1, (d,)),
                "bias": 0.1 * jax.random.normal(k2, (d,))}, d, s
    if kind == "act":
        return {}, d, s
    if kind == "transpose_dense":       # mixes along the sequence: (B, s, d) -> (B, s', d)
        return {"w": normal(k1, (s, spec[1]), s)}, d, spec[1]
    if kind == "reshape_dense":         # flattens (s, d), mixes, reshapes back
        return {"w": normal(k1, (s * d, s * d), s * d)}, d, s
    if kind == "residual":
        params, dd, ss = [], d, s
        for i, sub in enumerate(spec[1]):
            p, dd, ss = _init_layer(sub, jax.random.fold_in(k1, i), dd, ss)
            params.append(p)
        proj = {"w": normal(k2, (dd, d), dd)}
        back = {"w": normal(k3, (ss, s), ss)} if ss != s else {}
        return {"body": params, "proj": proj, "back": back}, d, s
    if kind == "scan":
        n = spec[1]
        return {"w": normal(k1, (n, d, d), d), "b": jnp.zeros((n, d))}, d, s
    if kind == "shift_concat":          # slices and a concatenation along the sequence
        return {"w": normal(k1, (2 * d, d), 2 * d)}, d, s
    if kind == "max_mix":               # a max-reduction broadcast back, a gather by argmax
        return {"g": jnp.ones((d,))}, d, s
    if kind == "remat":
        params, dd, ss = [], d, s
        for i, sub in enumerate(spec[1]):
            p, dd, ss = _init_layer(sub, jax.random.fold_in(k1, i), dd, ss)
            params.append(p)
        return {"body": params}, dd, ss
    raise AssertionError(kind)


def _apply_layer(spec: tuple, p: dict, x: jax.Array) -> jax.Array:
    kind = spec[0]
    if kind == "dense":
        return x @ p["w"] + p["b"]
    if kind == "conv":
        # (B, s, d) -> NCH layout for a 1-D convolution over the sequence
        y = jax.lax.conv_general_dilated(x.transpose(0, 2, 1), p["k"], (1,), "SAME",
                                         dimension_numbers=("NCH", "OIH", "NCH"))
        return y.transpose(0, 2, 1) + p["b"]
    if kind == "attention":
        b, s, d = x.shape
        heads = spec[1] if d % spec[1] == 0 else 1
        q, k, v = jnp.split(x @ p["qkv"], 3, axis=-1)
        split = lambda t: t.reshape(b, s, heads, d // heads).transpose(0, 2, 1, 3)  # noqa: E731
        q, k, v = split(q), split(k), split(v)
        w = jax.nn.softmax(q @ k.transpose(0, 1, 3, 2) / math.sqrt(d // heads), axis=-1)
        y = (w @ v).transpose(0, 2, 1, 3).reshape(b, s, d)
        return y @ p["o"]
    if kind == "layer_norm":
        mean = x.mean(-1, keepdims=True)
        var = ((x - mean) ** 2).mean(-1, keepdims=True)
        return (x - mean) * jax.lax.rsqrt(var + 1e-5) * p["scale"] + p["bias"]
    if kind == "act":
        return {"gelu": jax.nn.gelu, "relu": jax.nn.relu, "tanh": jnp.tanh}[spec[1]](x)
    if kind == "transpose_dense":
        return jnp.einsum("bsd,st->btd", x, p["w"])
    if kind == "reshape_dense":
        b, s, d = x.shape
        return jnp.tanh(x.reshape(b, s * d) @ p["w"]).reshape(b, s, d)
    if kind == "residual":
        y = x
        for sub, sp in zip(spec[1], p["body"]):
            y = _apply_layer(sub, sp, y)
        y = y @ p["proj"]["w"]
        if p["back"]:
            y = jnp.einsum("bsd,st->btd", y, p["back"]["w"])
        return x + y
    if kind == "scan":
        def block(h, wb):
            w, bias = wb
            return h + jnp.tanh(h @ w + bias), None
        return jax.lax.scan(block, x, (p["w"], p["b"]))[0]
    if kind == "shift_concat":
        prev = jnp.concatenate([jnp.zeros_like(x[:, :1]), x[:, :-1]], axis=1)
        return jnp.concatenate([x, prev], axis=-1) @ p["w"]
    if kind == "max_mix":
        m = jnp.max(x, axis=1, keepdims=True)
        idx = jnp.argmax(x, axis=-1)                               # (B, s) int
        picked = jnp.take_along_axis(x, idx[..., None], axis=-1)   # (B, s, 1)
        return x - m + picked * p["g"]
    if kind == "remat":
        def body(x, params):
            for sub, sp in zip(spec[1], params):
                x = _apply_layer(sub, sp, x)
            return x
        return jax.checkpoint(body)(x, p["body"])
    raise AssertionError(kind)


def build(desc: dict) -> tuple[Any, dict, dict]:
    """(train_step, state, batch) of a drawn model."""
    key = jax.random.PRNGKey(len(repr(desc)))
    d, s = desc["features"], desc["seq"]
    params = {}
    for i, spec in enumerate(desc["layers"]):
        p, d, s = _init_layer(spec, jax.random.fold_in(key, i), d, s)
        params[f"l{i}"] = _strip(p)
    params["head"] = {"w": jax.random.normal(jax.random.fold_in(key, 99), (d, desc["out"]))
                      / math.sqrt(d)}
    kx, ky = jax.random.split(jax.random.fold_in(key, 7))
    vocab = desc.get("vocab", 0)
    if vocab:
        params["embed"] = jax.random.normal(jax.random.fold_in(key, 98),
                                            (vocab, desc["features"]))
        x = jax.random.randint(kx, (desc["batch"], desc["seq"]), 0, vocab, jnp.int32)
    else:
        x = jax.random.normal(kx, (desc["batch"], desc["seq"], desc["features"]))
    batch = {"x": x, "y": jax.random.normal(ky, (desc["batch"], s, desc["out"]))}
    layers = desc["layers"]

    def loss_fn(params, batch):
        h = params["embed"][batch["x"]] if vocab else batch["x"]
        for i, spec in enumerate(layers):
            h = _apply_layer(spec, params[f"l{i}"], h)
        return jnp.mean((h @ params["head"]["w"] - batch["y"]) ** 2)

    def train_step(state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(state["params"], batch)
        new = jax.tree.map(lambda p, g: p - LR * g, state["params"], grads)
        return {"params": new, "step": state["step"] + 1}, {"loss": loss}

    return train_step, {"params": params, "step": jnp.zeros((), jnp.int32)}, batch


def _strip(p: Any) -> Any:
    """Drop the None placeholders (not arrays) from a parameter tree."""
    if isinstance(p, dict):
        return {k: _strip(v) for k, v in p.items() if v is not None}
    if isinstance(p, list):
        return [_strip(v) for v in p]
    return p


def _close(got: Any, want: Any, what: str) -> None:
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want)):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        scale = max(float(np.max(np.abs(b))) if b.size else 0.0, 1.0)
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5 * scale,
                                   err_msg=f"{what} {jax.tree_util.keystr(path)}")


def check(desc: dict, steps: int = 2) -> meshplan.Plan:
    train_step, state, batch = build(desc)
    step = meshplan.parallelize(train_step, cluster=cluster_for(desc.get("cluster", "local")),
                                method=meshplan.ShardParallel(mesh_shape=desc["mesh"],
                                                              time_limit=30.0))
    ref = jax.jit(train_step)
    s_ref, s_par = state, jax.tree.map(np.asarray, state)
    for k in range(steps):
        s_ref, m_ref = ref(s_ref, batch)
        s_par, m_par = step(s_par, batch)
        _close(m_par, m_ref, f"step {k + 1} metrics")
        _close(s_par, s_ref, f"step {k + 1} state")
    assert step.plan.stages[0].logical_mesh.shape == tuple(desc["mesh"])
    return step.plan


@pytest.mark.extended
@FUZZ
@given(desc=model_and_mesh())
def test_random_models_plan_and_match_the_undecorated_step(desc):
    check(desc)

