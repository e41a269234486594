"""The built-in models: they train, their abstract args match, presets stay abstract."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshplan.errors import ModelConfigError
from meshplan.models import (MODEL_DEFAULTS, PRESET_INFO, PRESETS, BuiltModel, build_model,
                             model_names)
from meshplan.models.moe import top2_routing

BASE_MODELS = ["mlp", "gpt", "moe", "wresnet"]


def _structure(tree):
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return treedef, [(tuple(x.shape), jnp.dtype(x.dtype)) for x in leaves]


def _gpt_formula(l: int, h: int, v: int, s: int) -> float:
    return 12 * l * h * h * (1 + 13 / (12 * h) + (v + s) / (12 * l * h))


# (wresnet's five steps take about 50 s: after the default run)
@pytest.fixture(scope="module", params=[pytest.param(m, marks=pytest.mark.extended)
                                        if m == "wresnet" else m for m in BASE_MODELS])
def trained(request):
    """Each base model with defaults, run for 5 jitted steps on a fixed batch."""
    model = build_model(request.param)
    state, batch = model.init(0)
    step = jax.jit(model.train_step)
    states, losses = [state], []
    for _ in range(5):
        state, metrics = step(state, batch)
        states.append(state)
        losses.append(metrics["loss"])
    return model, states, batch, losses


def test_train_step_runs_with_finite_loss(trained):
    model, _, _, losses = trained
    for loss in losses:
        assert loss.shape == () and loss.dtype == jnp.float32
        assert np.isfinite(float(loss))


def test_loss_decreases_on_a_fixed_batch(trained):
    model, _, _, losses = trained
    values = [float(x) for x in losses]
    assert values[-1] < values[0], (model.name, values)


def test_abstract_args_match_init(trained):
    model, states, batch, _ = trained
    expected = jax.eval_shape(model.init, 0)
    assert _structure(model.abstract_args) == _structure(expected)
    assert _structure(model.abstract_args) == _structure((states[0], batch))
    assert all(isinstance(x, jax.ShapeDtypeStruct)
               for x in jax.tree_util.tree_leaves(model.abstract_args))
    assert model.batch_argnums == (1,)


def test_new_state_keeps_structure_shapes_and_dtypes(trained):
    model, states, _, _ = trained
    for new in states[1:]:
        assert _structure(new) == _structure(states[0])
    assert set(states[0]) >= {"params", "opt_state"}
    assert ("batch_stats" in states[0]) == (model.name == "wresnet")


def test_built_model_record():
    model = build_model("gpt")
    assert isinstance(model, BuiltModel)
    assert model.name == "gpt" and model.preset is None
    assert dict(model.config) == MODEL_DEFAULTS["gpt"]
    assert model.param_count() == sum(
        math.prod(x.shape) for x in jax.tree_util.tree_leaves(model.abstract_args[0]["params"]))
    params = model.abstract_args[0]["params"]
    h = model.config["hidden"]
    assert params["wte"].shape == (model.config["vocab"], h)
    assert params["wpe"].shape == (model.config["seq_len"], h)
    assert params["h0"]["ln1"]["scale"].shape == (h,)
    assert params["h0"]["attn"]["qkv"]["w"].shape == (h, 3 * h)
    assert params["h0"]["attn"]["proj"]["w"].shape == (h, h)
    assert params["h0"]["mlp"]["fc"]["w"].shape == (h, 4 * h)
    assert params["ln_f"]["bias"].shape == (h,)
    batch = model.abstract_args[1]
    assert batch["input_ids"].dtype == jnp.int32 and batch["labels"].dtype == jnp.int32


@pytest.mark.parametrize("overrides", [
    {}, {"hidden": 128, "layers": 3, "heads": 8}, {"hidden": 96, "vocab": 1000, "seq_len": 17},
    {"hidden": 256, "layers": 1, "scan_layers": True}])
def test_gpt_param_count_formula(overrides):
    model = build_model("gpt", overrides)
    c = model.config
    expected = _gpt_formula(c["layers"], c["hidden"], c["vocab"], c["seq_len"])
    assert model.param_count() == pytest.approx(expected, rel=0.02)


@pytest.mark.parametrize("preset", ["gpt-1.3b", "megatron-18.4b"])
def test_gpt_preset_param_count_from_abstract_args(preset):
    model = build_model(preset)
    c = model.config
    assert model.preset == preset and model.name == "gpt"
    # Alpa's suite ran float16 on V100s; Megatron-LM bfloat16 on A100s
    want = "float16" if preset.startswith("gpt-") else "bfloat16"
    assert c["compute_dtype"] == want and c["dtype"] == "float32"
    expected = _gpt_formula(c["layers"], c["hidden"], c["vocab"], c["seq_len"])
    assert model.param_count() == pytest.approx(expected, rel=0.02)


@pytest.mark.parametrize("preset,billions", [
    ("gpt-350m", 0.35), ("gpt-39b", 39), ("megatron-1.7b", 1.7), ("megatron-1t", 1000),
    ("moe-380m", 0.38), ("moe-2.4b", 2.4), ("wresnet-1b", 1.0), ("wresnet-6.8b", 6.8)])
def test_presets_match_their_names(preset, billions):
    assert build_model(preset).param_count() / 1e9 == pytest.approx(billions, rel=0.06)


def test_big_preset_builds_abstractly_without_allocation():
    live_before = len(jax.live_arrays())
    model = build_model("gpt-39b")
    assert len(jax.live_arrays()) == live_before
    leaves = jax.tree_util.tree_leaves(model.abstract_args)
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
    assert model.config["hidden"] == 8192 and model.config["layers"] == 48
    assert model.abstract_args[1]["input_ids"].shape == (1024, 1024)
    assert model.param_count() > 38e9


def test_override_strings_are_converted():
    model = build_model("gpt", {"hidden": "128", "layers": "3"})
    assert model.config["hidden"] == 128 and model.config["layers"] == 3
    assert model.abstract_args[0]["params"]["h2"]["attn"]["qkv"]["w"].shape == (128, 384)
    model = build_model("gpt", {"scan_layers": "true", "compute_dtype": "bf16",
                                "learning_rate": "3e-4"})
    assert model.config["scan_layers"] is True
    assert model.config["compute_dtype"] == "bfloat16"
    assert model.config["learning_rate"] == pytest.approx(3e-4)
    assert build_model("gpt-1.3b", {"batch": "8"}).config["batch"] == 8


@pytest.mark.parametrize("name,overrides,fragment", [
    ("gpt", {"hiden": "128"}, "valid keys"),
    ("gpt", {"hidden": "big"}, "hidden"),
    ("gpt", {"hidden": "0"}, "hidden"),
    ("gpt", {"scan_layers": "maybe"}, "scan_layers"),
    ("gpt", {"compute_dtype": "float8"}, "compute_dtype"),
    ("gpt", {"hidden": "100", "heads": "3"}, "divisible"),
    ("gpt", {"dropout": "1"}, "dropout"),
    ("gpt", {"dropout": "-0.1"}, "dropout"),
    ("gpt", {"rng_impl": "philox"}, "rng_impl"),
    ("moe", {"num_experts": "1"}, "num_experts"),
    ("wresnet", {"layers": "7"}, "layers"),
    ("mlp", {"loss": "hinge"}, "loss"),
    ("transformer", None, "valid names"),
])
def test_bad_config_raises_model_config_error(name, overrides, fragment):
    with pytest.raises(ModelConfigError) as info:
        build_model(name, overrides)
    message = str(info.value)
    assert fragment in message and "\n" not in message
    assert isinstance(info.value, ValueError)


def test_model_names_and_presets():
    names = model_names()
    assert names[:4] == BASE_MODELS
    for preset in ["gpt-350m", "gpt-39b", "megatron-1.7b", "megatron-1t", "moe-1.3b",
                   "wresnet-250m"]:
        assert preset in names and preset in PRESETS
    assert set(PRESET_INFO) == set(PRESETS)
    assert PRESET_INFO["megatron-39.1b"]["gpus"] == 512
    for base, overrides in PRESETS.values():
        assert base in MODEL_DEFAULTS and set(overrides) <= set(MODEL_DEFAULTS[base])


@pytest.mark.extended      # (about 25 s)
def test_scan_layers_matches_unrolled_layers():
    unrolled = build_model("gpt")
    scanned = build_model("gpt", {"scan_layers": True})
    state, batch = unrolled.init(0)
    blocks = [state["params"][f"h{i}"] for i in range(unrolled.config["layers"])]
    stacked = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *blocks)
    params = {k: v for k, v in state["params"].items() if not k.startswith("h")}
    params["h"] = stacked
    scanned_state, _ = scanned.init(0)
    assert _structure(params) == _structure(scanned_state["params"])
    # Adam's initial state is all zeros (count, mu, nu), so it can be rebuilt in place.
    scanned_state = {"params": params, "opt_state": jax.tree_util.tree_map(
        jnp.zeros_like, scanned_state["opt_state"])}
    new_unrolled, m_unrolled = jax.jit(unrolled.train_step)(state, batch)
    new_scanned, m_scanned = jax.jit(scanned.train_step)(scanned_state, batch)
    np.testing.assert_allclose(float(m_scanned["loss"]), float(m_unrolled["loss"]), rtol=1e-5)
    assert _structure(new_scanned) == _structure(scanned_state)
    restacked = jax.tree_util.tree_map(
        lambda *xs: jnp.stack(xs),
        *[new_unrolled["params"][f"h{i}"] for i in range(unrolled.config["layers"])])
    for a, b in zip(jax.tree_util.tree_leaves(restacked),
                    jax.tree_util.tree_leaves(new_scanned["params"]["h"])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
    jaxpr = jax.make_jaxpr(scanned.train_step)(*scanned.abstract_args)
    assert any(eqn.primitive.name == "scan" for eqn in jaxpr.jaxpr.eqns)


@pytest.mark.parametrize("scan,impl", [(False, "threefry2x32"),
                                       pytest.param(True, "rbg", marks=pytest.mark.extended)])
def test_gpt_dropout_draws_from_the_state_key(scan, impl):
    m = build_model("gpt", {"dropout": "0.3", "scan_layers": scan, "rng_impl": impl})
    plain = build_model("gpt", {"scan_layers": scan})
    state, batch = m.init(0)
    s1, m1 = jax.jit(m.train_step)(state, batch)
    # the key advances every step, so the masks differ step to step
    assert not np.array_equal(np.asarray(s1["rng"]), np.asarray(state["rng"]))
    p_state, _ = plain.init(0)
    _, pm = jax.jit(plain.train_step)(p_state, batch)
    assert float(m1["loss"]) != float(pm["loss"])
    assert "rng" not in p_state
    jaxpr = jax.make_jaxpr(m.train_step)(*m.abstract_args)
    assert "random_bits" in str(jaxpr)
    assert state["rng"].shape == ((4,) if impl == "rbg" else (2,))
    if impl == "rbg":       # the Megatron-LM presets draw as PyTorch does
        assert build_model("megatron-1.7b").config["rng_impl"] == "rbg"


def test_mixed_precision_keeps_param_dtype():
    for name in ["gpt", "moe"]:
        model = build_model(name, {"compute_dtype": "bfloat16", "layers": "2"})
        state, batch = model.init(1)
        new_state, metrics = jax.jit(model.train_step)(state, batch)
        assert metrics["loss"].dtype == jnp.float32 and np.isfinite(float(metrics["loss"]))
        assert _structure(new_state) == _structure(state)
        dtypes = {x.dtype for x in jax.tree_util.tree_leaves(new_state["params"])}
        assert dtypes == {jnp.dtype(jnp.float32)}


def test_moe_has_explicit_expert_dimension():
    model = build_model("moe", {"num_experts": "8"})
    params = model.abstract_args[0]["params"]
    h = model.config["hidden"]
    assert "mlp" in params["h0"] and "moe" in params["h1"]
    assert params["h1"]["moe"]["w1"].shape == (8, h, 4 * h)
    assert params["h1"]["moe"]["w2"].shape == (8, 4 * h, h)
    assert params["h1"]["moe"]["gate"]["w"].shape == (h, 8)
    assert model.config["expert_group_size"] == model.config["seq_len"]


def test_top2_routing_respects_capacity():
    logits = jax.random.normal(jax.random.PRNGKey(3), (2, 16, 4))
    capacity = 5
    combine, dispatch, aux = top2_routing(logits, capacity)
    assert combine.shape == dispatch.shape == (2, 16, 4, capacity)
    d = np.asarray(dispatch)
    assert set(np.unique(d)) <= {0.0, 1.0}
    assert (d.sum(axis=(2, 3)) <= 2).all()          # a token goes to at most 2 experts
    assert (d.sum(axis=1) <= 1).all()               # a slot holds at most one token
    assert (d.sum(axis=(1, 3)) <= capacity).all()   # an expert takes at most `capacity`
    c = np.asarray(combine)
    assert (c >= 0).all() and (c.sum(axis=(2, 3)) <= 1 + 1e-6).all()
    assert ((c > 0) == (d > 0)).all()
    assert np.isfinite(float(aux)) and float(aux) > 0


def test_wresnet_updates_batch_stats():
    model = build_model("wresnet")
    state, batch = model.init(0)
    new_state, _ = jax.jit(model.train_step)(state, batch)
    before = state["batch_stats"]["stem"]["bn"]["mean"]
    after = new_state["batch_stats"]["stem"]["bn"]["mean"]
    assert not np.allclose(np.asarray(before), np.asarray(after))
    assert _structure(new_state["batch_stats"]) == _structure(state["batch_stats"])


def test_wresnet_bottleneck_imagenet_config_builds():
    model = build_model("wresnet", {"image_size": 64, "layers": 50, "block": "bottleneck",
                                    "num_stages": 4, "base_width": 8})
    params = model.abstract_args[0]["params"]
    assert [len(params[f"stage{i}"]) for i in range(4)] == [3, 4, 6, 3]
    assert params["stem"]["conv"]["w"].shape == (7, 7, 3, 8)
    assert params["head"]["w"].shape == (4 * 8 * 8, model.config["num_classes"])
