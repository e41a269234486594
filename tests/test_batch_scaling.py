"""How micro-batches combine (meshplan.trace.scaling): a step's values are
sums over the batch's examples of some degree (a mean: 0, a sum: 1), and
the pipeline combines each crossing into the update by its degree; sums
over the batch made from the batch alone (a loss's token count) are
computed once a step from the whole batch; what no combination gives
exactly (batch statistics of activations, a maximum over the batch,
in-batch negatives) is named in a warning.
Each step is a 2-stage pipeline of 2 micro-batches against jax.jit."""
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import meshplan
from meshplan.trace import trace_for_run
from meshplan.traced import GRAD_BOUNDARY

PIPE = meshplan.Manual(dp=2, tp=2, pp=2, num_micro_batches=2)
TOKENS = jax.random.randint(jax.random.key(1), (16, 8), 0, 32)
# padding: most of the first micro-batch, the last two tokens of every row
PAD = (jnp.arange(16) < 6)[:, None] | (jnp.arange(8)[None, :] >= 6)
BATCH = {"tok": TOKENS, "tgt": jnp.where(PAD, -1, jnp.roll(TOKENS, -1, 1))}


def _params():
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    return {"emb": jax.random.normal(k1, (32, 16)) * 0.3,
            "w1": jax.random.normal(k2, (16, 64)) * 0.2,
            "w2": jax.random.normal(k3, (64, 16)) * 0.2}


def _token_losses(p, batch):
    h = p["emb"][batch["tok"]]
    h = h + jnp.tanh(h @ p["w1"]) @ p["w2"]
    logits = h @ p["emb"].T
    tgt = jnp.maximum(batch["tgt"], 0)
    return jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, tgt[..., None], -1)[..., 0]


def _step(loss_fn, metrics=lambda p, batch, loss: {}, update=lambda p, g, batch: g):
    def step(p, batch):
        loss, g = jax.value_and_grad(loss_fn)(p, batch)
        g = update(p, g, batch)
        return jax.tree.map(lambda a, b: a - 0.05 * b, p, g), {"loss": loss,
                                                               **metrics(p, batch, loss)}
    return step


def _run(step_fn):
    """The largest difference from jax.jit over two steps, relative to each
    leaf's size (dtypes equal), and the warnings the pipeline gave."""
    step = meshplan.parallelize(step_fn, method=PIPE)
    ref = par = _params()
    gap = 0.0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            ref, rm = jax.jit(step_fn)(ref, BATCH)
            par, pm = step(par, BATCH)
            for a, b in zip(jax.tree.leaves((par, pm)), jax.tree.leaves((ref, rm))):
                assert a.dtype == b.dtype
                a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
                gap = max(gap, float(np.max(np.abs(a - b))) / max(float(np.max(np.abs(b))), 1e-6))
    assert len(step.plan.stages) == 2 and step.plan.num_micro_batches == 2
    return gap, [str(w.message) for w in caught if "micro-batches" in str(w.message)]


def test_a_summed_loss_and_summed_metrics_pipeline_exactly():
    # the gradients of a summed loss are sums over the examples: summed over
    # the micro-batches, not averaged (which halved them)
    mask = lambda b: (b["tgt"] >= 0).astype(jnp.float32)
    gap, warned = _run(_step(
        lambda p, b: jnp.sum(_token_losses(p, b) * mask(b)) * 0.01,
        lambda p, b, loss: {"tokens": jnp.sum(mask(b)), "loss_sum": loss * 100.0,
                            "mean_loss": jnp.mean(_token_losses(p, b)),
                            "int_tokens": jnp.sum(b["tgt"] >= 0)}))   # (an integer sum: summed)
    assert gap < 1e-5 and not warned


def test_a_summed_gradient_divided_by_the_batch_size_in_the_update():
    # the update divides by the whole batch's size, not the micro-batch's
    gap, warned = _run(_step(
        lambda p, b: jnp.sum(_token_losses(p, b)),
        update=lambda p, g, b: jax.tree.map(lambda x: x / (b["tok"].shape[0] * 8), g)))
    assert gap < 1e-5 and not warned


def test_a_mean_loss_pipelines_exactly_without_a_warning():
    gap, warned = _run(_step(lambda p, b: jnp.mean(_token_losses(p, b))))
    assert gap < 1e-5 and not warned


def test_rotary_pairs_stacked_and_unstacked_pipeline_without_a_warning():
    # jnp.stack of rotated halves: its cotangent goes through unstack, a
    # linear operation (it was named as scaling differently)
    def rope(x):
        x1, x2 = x[..., ::2], x[..., 1::2]
        return jnp.stack([x1 * 0.8 - x2 * 0.6, x1 * 0.6 + x2 * 0.8], -1).reshape(x.shape)
    gap, warned = _run(_step(
        lambda p, b: jnp.mean((rope(p["emb"][b["tok"]] @ p["w1"]) @ p["w2"] - 1.0) ** 2)))
    assert gap < 1e-5 and not warned


def test_per_example_gradients_clipped_then_averaged_pipeline_exactly():
    # DP-SGD: each example's gradient (vmap) clipped, then the batch mean
    def step(p, batch):
        one = lambda p, tok, tgt: jnp.mean(_token_losses(p, {"tok": tok, "tgt": tgt}))
        g = jax.vmap(jax.grad(one), (None, 0, 0))(p, batch["tok"][:, None], batch["tgt"][:, None])
        norm = jnp.sqrt(sum(jnp.sum(v.reshape(v.shape[0], -1) ** 2, 1) for v in jax.tree.leaves(g)))
        scale = jnp.minimum(1.0, 0.5 / (norm + 1e-6))
        g = jax.tree.map(lambda v: jnp.mean(v * scale.reshape((-1,) + (1,) * (v.ndim - 1)), 0), g)
        return jax.tree.map(lambda a, b: a - 0.05 * b, p, g), {"scale": jnp.mean(scale)}
    gap, warned = _run(step)
    assert gap < 1e-5 and not warned


@pytest.mark.parametrize("count", ["size", "shape-array"])
def test_a_guarded_division_by_the_batchs_count_pipelines_exactly(count):
    # keras.ops.divide_no_nan, keras' default loss reduction: the count from
    # the shape guarded by where(n == 0, 1, n) is still the count; keras 3
    # takes it as prod(convert_to_tensor(shape(values))), a constant array
    # of the shape (falsely warned of before)
    def loss(p, b):
        t = _token_losses(p, b)
        n = jnp.asarray(t.size, jnp.float32) if count == "size" else \
            jnp.prod(jnp.array(t.shape)).astype(jnp.float32)
        return jnp.where(n == 0, 0, jnp.sum(t) / jnp.where(n == 0, 1, n))
    gap, warned = _run(_step(loss))
    assert gap < 1e-5 and not warned


def test_a_slice_at_a_computed_start_pipelines_exactly():
    # dynamic_slice along the features, its start taken from a parameter:
    # the backward's dynamic_update_slice has one index operand a dimension
    def loss(p, b):
        h = p["emb"][b["tok"]]
        start = jnp.argmax(p["w1"][0]) % 8
        h = jax.lax.dynamic_slice_in_dim(h, start, 8, axis=2)
        return jnp.mean(jnp.tanh(h @ p["w1"][:8]) @ p["w2"])
    gap, warned = _run(_step(loss))
    assert gap < 1e-5 and not warned


def test_a_tile_along_the_features_is_sharded_and_pipelines_exactly():
    # jnp.tile is a primitive of its own: known (no unknown-primitive
    # warning, no work planned replicated) and exact with micro-batches
    def loss(p, b):
        h = jnp.tile(p["emb"][b["tok"]], (1, 1, 2))
        return jnp.mean(jnp.tanh(h[..., :16] @ p["w1"]) @ p["w2"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gap, warned = _run(_step(loss))
    assert gap < 1e-5 and not [w for w in caught if "meshplan" in str(w.message)]


def test_maxima_and_minima_over_the_batch_are_the_micro_batches_extremes():
    mask = lambda b: (b["tgt"] >= 0).astype(jnp.float32)
    gap, warned = _run(_step(
        lambda p, b: jnp.mean(_token_losses(p, b)),
        lambda p, b, loss: {"worst": jnp.max(_token_losses(p, b)),
                            "best": jnp.min(_token_losses(p, b), axis=0),
                            "longest": jnp.max(jnp.sum(b["tgt"] >= 0, 1)),      # (an integer)
                            "max_logit": jnp.max(p["emb"][b["tok"]] @ p["emb"].T).astype(
                                jnp.bfloat16),
                            "tokens": jnp.sum(mask(b)),
                            # (a bool's any and all: its largest and smallest)
                            "any_hard": jnp.any(_token_losses(p, b) > 4.0),
                            "all_easy": jnp.all(_token_losses(p, b) < 10.0, axis=0)}))
    assert gap < 1e-5 and not warned


def test_nonlinear_metrics_of_batch_sums_are_computed_once_a_step():
    # exp of the mean loss, and a mean over the tokens that are not padding:
    # functions of sums over the batch, computed on the micro-batches' sums
    mask = lambda b: (b["tgt"] >= 0).astype(jnp.float32)
    gap, warned = _run(_step(
        lambda p, b: jnp.mean(_token_losses(p, b)),
        lambda p, b, loss: {"perplexity": jnp.exp(loss),
                            "token_loss": jnp.sum(_token_losses(p, b) * mask(b))
                            / jnp.maximum(jnp.sum(mask(b)), 1.0),
                            # (a cast to integers rounds: refused before)
                            "decis": (loss * 10).astype(jnp.int32)}))
    assert gap < 1e-5 and not warned


def _token_mean_step(p, batch):
    # a loss divided by the batch's token count, the count also returned
    # (has_aux): each micro-batch divided by its own count differed
    def loss_fn(p):
        mask = (batch["tgt"] >= 0).astype(jnp.float32)
        n = jnp.sum(mask)
        return jnp.sum(_token_losses(p, batch) * mask) / n, n
    (loss, n), g = jax.value_and_grad(loss_fn, has_aux=True)(p)
    return jax.tree.map(lambda a, b: a - 0.05 * b, p, g), {
        "loss": loss, "tokens": n, "int_tokens": n.astype(jnp.int32)}


def _standardised_step(p, batch):
    # inputs standardised by the batch's mean and standard deviation (the
    # variance's divisor, the batch size, a constant the statistics read)
    # and scaled by the batch's largest magnitude
    def loss_fn(p):
        x = batch["x"]
        x = (x - x.mean(0)) / (x.std(0) + 1e-3) / jnp.max(jnp.abs(x))
        return jnp.mean((p["emb"][batch["tok"]].mean(1) @ p["w1"])[:, :4] * x)
    loss, g = jax.value_and_grad(loss_fn)(p)
    return jax.tree.map(lambda a, b: a - 0.05 * b, p, g), {"loss": loss}


def _count_in_update_step(p, batch):
    # the summed gradients divided by the token count in the update
    mask = (batch["tgt"] >= 0).astype(jnp.float32)
    loss, g = jax.value_and_grad(lambda p: jnp.sum(_token_losses(p, batch) * mask))(p)
    n = jnp.sum(mask)
    return jax.tree.map(lambda a, b: a - 0.05 * b / n, p, g), {"loss": loss / n}


@pytest.mark.parametrize("step_fn", [_token_mean_step, _standardised_step, _count_in_update_step])
def test_batch_statistics_are_computed_once_a_step_from_the_whole_batch(step_fn, monkeypatch):
    # sums over the batch made from the batch alone, which per-micro-batch
    # work reads: computed once a step (an R task) and read by every
    # micro-batch, the update and the outputs
    monkeypatch.setitem(BATCH, "x", jax.random.normal(jax.random.key(5), (16, 4)))
    gap, warned = _run(step_fn)
    assert gap < 1e-5 and not warned
    traced = trace_for_run(step_fn, (_params(), BATCH), (1,), 2)
    stats = traced.scaling.statistics
    assert stats and all(8 not in traced.flat.avals[x].shape for x in stats)


def test_a_loss_divided_by_the_count_of_drawn_positions_pipelines_exactly():
    # BERT-style: positions drawn from the state's key (a draw over the
    # batch: each micro-batch reads its rows), the loss divided by how many
    # were drawn in the whole batch, and that count returned (it was taken
    # from one micro-batch, the gradients divided by each micro-batch's own)
    def step_fn(state, batch):
        key, sub = jax.random.split(state["key"])
        pick = jax.random.bernoulli(sub, 0.3, batch["tok"].shape).astype(jnp.float32)
        loss, g = jax.value_and_grad(
            lambda p: jnp.sum(_token_losses(p, batch) * pick) / jnp.sum(pick))(state["p"])
        p = jax.tree.map(lambda a, b: a - 0.05 * b, state["p"], g)
        return {"p": p, "key": key}, {"loss": loss, "picked": jnp.sum(pick)}
    step = meshplan.parallelize(step_fn, method=PIPE)
    ref = par = {"p": _params(), "key": jax.random.key(42)}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            ref, rm = jax.jit(step_fn)(ref, BATCH)
            par, pm = step(par, BATCH)
            assert float(pm["picked"]) == float(rm["picked"])
            assert float(pm["loss"]) == pytest.approx(float(rm["loss"]), rel=1e-5)
    assert not [w for w in caught if "meshplan" in str(w.message)]
    for a, b in zip(jax.tree.leaves(par["p"]), jax.tree.leaves(ref["p"])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
    assert step.plan.num_micro_batches == 2


def test_a_pipeline_reading_batch_statistics_lowers_at_the_whole_batch():
    # the statistics' program reads the whole batch: lowered with its shape
    # (its broadcasts are the whole batch's)
    batch = {**BATCH, "x": jax.random.normal(jax.random.key(5), (16, 4))}
    text = meshplan.parallelize(_standardised_step, method=PIPE).lower(_params(), batch).as_text()
    program = text.split("// stage 0 R\n")[1].split("\n// ")[0]
    assert "tensor<16x4xf32>" in program and "tensor<8x4xf32>" not in program


@pytest.mark.parametrize("case", ["batch-norm", "sort", "max-of", "in-batch", "two-views",
                                  "two-views-reshaped", "hardest", "hardest-approx",
                                  "running", "loop-count",
                                  "carried", "draw-per-example", "draw-per-chunk", "tiled",
                                  "callback", "first-rows", "weighted-by-place",
                                  "table-by-place", "while-until", "edited-row",
                                  "picked-rows", "rolled", "rolled-by-gather"])
def test_what_micro_batches_cannot_give_exactly_is_warned_of(case):
    if case == "batch-norm":
        # each example normalised with its micro-batch's statistics
        def loss(p, b):
            t = _token_losses(p, b)
            return jnp.mean((t - jnp.mean(t)) ** 2 / (jnp.var(t) + 1e-3))
        step, named, why = _step(loss), "outputs [0]['emb']", "per-example value computed from a sum"
    elif case == "sort":
        # the median loss of the batch is no function of the micro-batches'
        step = _step(lambda p, b: jnp.mean(_token_losses(p, b)),
                     lambda p, b, loss: {"median": jnp.median(_token_losses(p, b))})
        named, why = "median", "over the batch"
    elif case == "max-of":
        # a function of the largest loss: not the micro-batches' largest
        step = _step(lambda p, b: jnp.mean(_token_losses(p, b)),
                     lambda p, b, loss: {"spread": jnp.max(_token_losses(p, b)) - loss})
        named, why = "spread", "of a maximum or minimum over the batch"
    elif case == "in-batch":
        # a contrastive loss: every example against the others of its batch
        def loss(p, b):
            u = p["emb"][b["tok"]].mean(1) @ p["w1"]
            logits = u @ (p["emb"][b["tgt"] % 32].mean(1) @ p["w1"]).T
            return jnp.mean(jax.nn.logsumexp(logits, -1) - jnp.diagonal(logits))
        step, named, why = _step(loss), "outputs [0]['emb']", "a product of two examples"
    elif case == "two-views":
        # the batch holds two views of each example, concatenated: a
        # micro-batch pairs other examples (silently, before the rule)
        def loss(p, b):
            z = p["emb"][b["tok"]].mean(1) @ p["w1"]
            z1, z2 = jnp.split(z, 2)
            return jnp.mean((z1 - z2) ** 2) + jnp.mean(_token_losses(p, b))
        step, named, why = _step(loss), "outputs [0]['emb']", "split along the batch axis"
    elif case == "two-views-reshaped":
        # the same pairing by a reshape: a dimension of 2 takes the batch
        # index's major part
        def loss(p, b):
            z = p["emb"][b["tok"]].mean(1) @ p["w1"]
            z = z.reshape(2, z.shape[0] // 2, -1)
            return jnp.mean((z[0] - z[1]) ** 2) + jnp.mean(_token_losses(p, b))
        step, named, why = _step(loss), "outputs [0]['emb']", "reshape along the batch axis"
    elif case == "loop-count":
        # a loop run a number of times taken from the batch size: fewer
        # times per micro-batch (silently, before the rule)
        def loss(p, b):
            h = p["emb"][b["tok"]]
            h = jax.lax.fori_loop(0, b["tok"].shape[0] // 8, lambda i, h: jnp.tanh(h @ p["w1"])
                                  @ p["w2"], h)
            return jnp.mean(h ** 2)
        step, named, why = _step(loss), "outputs [0]['emb']", "number of steps depends on the batch"
    elif case == "carried":
        # a recurrence over the examples: each reads the one before it
        def loss(p, b):
            xs = p["emb"][b["tok"]].mean(1)
            hs = jax.lax.scan(lambda h, x: (jnp.tanh(h @ p["w1"] @ p["w2"] + x),) * 2,
                              jnp.zeros(16), xs)[1]
            return jnp.mean(hs ** 2)
        step, named, why = _step(loss), "outputs [0]['emb']", "from one example to the next"
    elif case == "draw-per-example":
        # dropout drawn inside a lax.map over the examples, a key each
        def loss(p, b):
            def one(ex):
                t = _token_losses(p, {k: v[None] for k, v in ex.items() if k != "key"})
                return jnp.mean(jnp.where(jax.random.bernoulli(ex["key"], 0.7, t.shape), t, 0.0))
            keys = jax.random.split(jax.random.key(3), b["tok"].shape[0])
            return jnp.mean(jax.lax.map(one, {**b, "key": keys}))
        step, named, why = _step(loss), "outputs [0]['emb']", "random draw over the batch inside a loop"
    elif case == "draw-per-chunk":
        # the step's own accumulation over chunks, dropout drawn in each
        def loss(p, b):
            chunks = jax.tree.map(lambda x: x.reshape((2, x.shape[0] // 2) + x.shape[1:]), b)

            def body(total, ck):
                chunk, k = ck
                t = _token_losses(p, chunk)
                return total + jnp.sum(jnp.where(jax.random.bernoulli(k, 0.7, t.shape), t, 0)), None
            keys = jax.random.split(jax.random.key(3), 2)
            return jax.lax.scan(body, jnp.zeros(()), (chunks, keys))[0] / b["tok"].size
        step, named, why = _step(loss), "outputs [0]['emb']", "random draw over the batch inside a loop"
    elif case == "tiled":
        # the batch repeated (jnp.tile along it): each micro-batch repeats its own
        def loss(p, b):
            z = p["emb"][b["tok"]].mean(1) @ p["w1"]
            zz = jnp.tile(z, (2, 1))
            return jnp.mean((zz[: z.shape[0] + 1] - zz[1: z.shape[0] + 2]) ** 2)
        step, named, why = _step(loss), "outputs [0]['emb']", "tile along the batch axis"
    elif case == "callback":
        # a host function of the examples' losses that normalises them over
        # the batch: meshplan cannot see into it, and it mixes examples
        def norm(v):
            w = np.exp(-np.asarray(v))
            return (w / w.sum() * len(w)).astype(np.float32)

        def loss(p, b):
            t = _token_losses(p, b).mean(1)
            w = jax.pure_callback(norm, jax.ShapeDtypeStruct(t.shape, t.dtype),
                                  jax.lax.stop_gradient(t))
            return jnp.mean(w * t)
        step, named, why = _step(loss), "outputs [0]['emb']", "pure_callback, which meshplan"
    elif case == "hardest":
        # the hardest quarter of the batch: a micro-batch's own quarter
        def loss(p, b):
            t = _token_losses(p, b).mean(1)
            return jnp.mean(jax.lax.top_k(t, t.shape[0] // 4)[0])
        step, named, why = _step(loss), "outputs [0]['emb']", "top_k along the batch axis"
    elif case == "hardest-approx":
        # the same by jax.lax.approx_max_k (along a token's row it is exact:
        # tests/test_rules_coverage.py)
        def loss(p, b):
            t = _token_losses(p, b).mean(1)
            return jnp.mean(jax.lax.approx_max_k(t, t.shape[0] // 4)[0])
        step, named, why = _step(loss), "outputs [0]['emb']", "approx_top_k along the batch axis"
    elif case == "running":
        # a running sum over the examples
        step = _step(lambda p, b: jnp.mean(_token_losses(p, b)),
                     lambda p, b, loss: {"last": jnp.cumsum(_token_losses(p, b).mean(1))[-3:]})
        named, why = "last", "cumsum along the batch axis"
    elif case in ("first-rows", "weighted-by-place", "table-by-place"):
        # a value made from the rows' places, not their examples: row i of a
        # numpy table (each micro-batch read rows 0..7 again, silently before),
        # weights by place, a jax table gathered by place
        rows = {"first-rows": lambda n: np.linspace(0.5, 1.5, 64, dtype=np.float32)[:n],
                "weighted-by-place": lambda n: jnp.arange(n) / 16.0,
                "table-by-place": lambda n: jnp.linspace(0.5, 1.5, 64)[jnp.arange(n) % 64]}[case]

        def loss(p, b):
            t = _token_losses(p, b).mean(1)
            return jnp.mean(t * rows(t.shape[0]))
        step, named, why = _step(loss), "outputs [0]['emb']", "the rows' places in the batch"
    elif case == "while-until":
        step = _step(lambda p, b: jnp.mean(_token_losses(p, b)),
                     lambda p, b, loss: {"refined": jnp.mean(_refined(p, b, "until") ** 2)})
        named, why = "refined", "while loop whose number of steps depends on the batch"
    elif case in ("edited-row", "picked-rows"):
        # the first example's loss dropped, some examples picked by index:
        # each micro-batch drops or picks its own (silently, before)
        pick = {"edited-row": lambda t: t.at[0].set(0.0),
                "picked-rows": lambda t: t[jnp.array([1, 5, 9, 12])]}[case]
        step = _step(lambda p, b: jnp.mean(pick(_token_losses(p, b).mean(1))))
        named, why = "outputs [0]['emb']", "of examples of the batch by index"
    elif case == "rolled":
        # each example against its neighbour in the batch (its backward's
        # split of a padded constant was made once a step at the whole
        # batch's size, and the pipeline failed)
        def loss(p, b):
            t = _token_losses(p, b).mean(1)
            return jnp.mean(t * jnp.roll(t, 1, axis=0))
        step, named, why = _step(loss), "outputs [0]['emb']", "along the batch axis"
    elif case == "rolled-by-gather":
        # the same neighbours picked by places that are not the rows' own
        def loss(p, b):
            t = _token_losses(p, b).mean(1)
            return jnp.mean(t * t[(jnp.arange(t.shape[0]) - 1) % t.shape[0]])
        step, named, why = _step(loss), "outputs [0]['emb']", "of examples of the batch by index"
    gap, warned = _run(step)
    assert gap > 1e-5       # (what the warning is about; rounding is ~1e-7)
    assert len(warned) == 1 and named in warned[0] and why in warned[0], warned
    assert "num_micro_batches=1" in warned[0]


def _refined(p, b, stop):
    """A forward refined by a while loop: a fixed number of times, or as
    many as a sum over the batch says (then fewer for a micro-batch)."""
    h = p["emb"][b["tok"]].mean(1)

    def body(c):
        i, h = c
        return i + 1, jnp.tanh(h @ p["w1"]) @ p["w2"] * 0.9
    cond = (lambda c: c[0] < 3) if stop == "fixed" else \
        (lambda c: c[0] < jnp.sum(b["tok"][:, 0]) // 40)
    return jax.lax.while_loop(cond, body, (0, h))[1]


def test_a_while_loop_of_a_fixed_count_pipelines_exactly():
    # (warned of as something meshplan cannot see into, before)
    gap, warned = _run(_step(lambda p, b: jnp.mean(_token_losses(p, b)),
                             lambda p, b, loss: {"refined": jnp.mean(_refined(p, b, "fixed") ** 2)}))
    assert gap < 1e-5 and not warned


def test_an_operation_jax_leaves_out_at_the_micro_batch_size_is_warned_of():
    # x[:8] of a micro-batch of 8 rows is no operation at all in its trace:
    # the two traces differ, and the combination falls back to averaging
    # (with jax.value_and_grad the gradients are not found: refused)
    def step(p, b):
        loss, g = meshplan.value_and_grad(lambda p: jnp.mean(_token_losses(p, b).mean(1)[:8]))(p)
        return jax.tree.map(lambda a, d: a - 0.05 * d, p, g), {"loss": loss}
    gap, warned = _run(step)
    assert gap > 1e-5 and len(warned) == 1 and "slice at the whole batch" in warned[0], warned


def test_values_made_from_the_batchs_size_alone_are_the_whole_batchs():
    # outputs and a mask's count made from constants of the batch's shape:
    # the micro-batch's size (outputs 8 not 16; the count refused, naming a
    # key, before); a mask of places alike in every micro-batch (falsely
    # warned of before); keys per example folded from their places and a
    # draw, from constant keys
    def step(p, b):
        def loss(p):
            t = _token_losses(p, b)
            mask = jnp.ones(t.shape).at[:, 6:].set(0.0) * \
                ((jnp.arange(t.size) % t.shape[1]) > 0).reshape(t.shape)
            keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.key(5), i))(
                jnp.arange(t.shape[0]))
            keep = jax.vmap(lambda k: jax.random.bernoulli(k, 0.8, t.shape[1:]))(keys)
            # (a draw from a constant key: each micro-batch drew the first
            # rows' numbers again, silently)
            keep = keep & jax.random.bernoulli(jax.random.key(6), 0.9, t.shape)
            return jnp.sum(jnp.where(keep, t, 0.0) * mask) / jnp.sum(mask)
        loss, g = jax.value_and_grad(loss)(p)
        return jax.tree.map(lambda a, d: a - 0.05 * d, p, g), {
            "loss": loss, "rows": b["tok"].shape[0], "tokens": jnp.sum(jnp.ones(b["tok"].shape))}
    gap, warned = _run(step)
    assert gap < 1e-5 and not warned


def test_places_that_pick_each_examples_own_row_pipeline_exactly():
    # logp[arange(B), y] picks each example's own row; a numpy mask made at
    # the batch's size is alike for every micro-batch's rows
    def loss(p, b):
        h = p["emb"][b["tok"]].mean(1) @ p["w1"] @ p["w2"] @ p["emb"].T
        logp = jax.nn.log_softmax(h)
        n = b["tok"].shape[0]
        picked = logp[jnp.arange(n), jnp.maximum(b["tgt"][:, 0], 0)]
        return -jnp.mean(picked * np.ones(n, np.float32))
    gap, warned = _run(_step(loss))
    assert gap < 1e-5 and not warned


def test_a_running_statistic_in_the_state_is_named_among_the_outputs_that_differ():
    # batch normalisation's running variance (flax's batch_stats): the
    # micro-batch's own statistic, mixed into the state after the gradients;
    # the warning names that state entry, and the exact rest stays exact
    def step_fn(state, b):
        def loss(p):
            h = p["emb"][b["tok"]].mean(1) @ p["w1"]
            return jnp.mean(_token_losses(p, b)), jnp.var(h, 0)
        (l, var), g = jax.value_and_grad(loss, has_aux=True)(state["p"])
        return {"p": jax.tree.map(lambda a, c: a - 0.05 * c, state["p"], g),
                "var": 0.9 * state["var"] + 0.1 * var}, {"loss": l}
    state = {"p": _params(), "var": jnp.ones(64)}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        par, pm = meshplan.parallelize(step_fn, method=PIPE)(state, BATCH)
    ref, rm = jax.jit(step_fn)(state, BATCH)
    warned = [str(w.message) for w in caught if "micro-batches" in str(w.message)]
    assert len(warned) == 1 and "outputs [0]['var'] of this step differ" in warned[0]
    assert float(jnp.max(jnp.abs(par["var"] - ref["var"]))) > 1e-4
    assert float(pm["loss"]) == pytest.approx(float(rm["loss"]), rel=1e-5)
    for a, b in zip(jax.tree.leaves(par["p"]), jax.tree.leaves(ref["p"])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.float32])
def test_a_counter_of_the_examples_seen_pipelines_exactly_or_is_named(dtype):
    # state + x.shape[0], read by the forward: an integer counter is made once
    # a step with the whole batch's size; a float one (which could be a
    # parameter) is still each micro-batch's own, and named
    def step_fn(state, b):
        seen = state["seen"] + b["tok"].shape[0]
        scale = 1.0 + seen.astype(jnp.float32) / 100.0
        loss, g = jax.value_and_grad(lambda p: jnp.mean(_token_losses(p, b)) * scale)(state["p"])
        return {"p": jax.tree.map(lambda a, c: a - 0.05 * c, state["p"], g),
                "seen": seen}, {"loss": loss, "seen": seen}
    state = {"p": _params(), "seen": jnp.zeros((), dtype)}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step = meshplan.parallelize(step_fn, method=PIPE)
        par, ref = state, state
        for _ in range(2):
            (par, pm), (ref, rm) = step(par, BATCH), jax.jit(step_fn)(ref, BATCH)
    warned = [str(w.message) for w in caught if "micro-batches" in str(w.message)]
    if dtype == jnp.float32:
        assert float(par["seen"]) != float(ref["seen"])
        assert len(warned) == 1 and "outputs [0]['p'], [0]['seen']," in warned[0]
        return
    assert not warned
    assert int(par["seen"]) == int(ref["seen"]) == 32 and int(pm["seen"]) == 32
    assert float(pm["loss"]) == pytest.approx(float(rm["loss"]), rel=1e-5)
    for a, b in zip(jax.tree.leaves(par["p"]), jax.tree.leaves(ref["p"])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


def test_a_steps_own_accumulation_over_chunks_of_its_batch_pipelines_exactly():
    # the batch reshaped into chunks a lax.scan runs one after another: the
    # chunks' dimension holds the batch index's major part, which only the
    # scan's iteration reads (a reshape so folded is otherwise warned of)
    def loss(p, b):
        chunks = jax.tree.map(lambda x: x.reshape((2, x.shape[0] // 2) + x.shape[1:]), b)

        def body(total, chunk):
            return total + jnp.sum(_token_losses(p, chunk)), None
        return jax.lax.scan(body, jnp.zeros(()), chunks)[0] / b["tok"].size
    gap, warned = _run(_step(loss))
    assert not warned and gap < 1e-5


def test_an_fft_over_each_examples_own_axes_pipelines_exactly():
    # (an unknown primitive was warned of as one that may mix examples)
    def loss(p, b):
        h = p["emb"][b["tok"]]
        h = h + jnp.real(jnp.fft.fft(jnp.tanh(h @ p["w1"]) @ p["w2"], axis=1)) / 8
        return jnp.mean((h - 0.1) ** 2)
    gap, warned = _run(_step(loss))
    assert not warned and gap < 1e-5


def test_an_fft_along_the_batch_is_warned_of():
    def loss(p, b):
        h = (p["emb"][b["tok"]] @ p["w1"]).mean((1, 2))
        return jnp.mean(jnp.abs(jnp.fft.fft(h)) ** 2)
    with pytest.warns(UserWarning, match="fft along the batch axis"):
        meshplan.parallelize(_step(loss), method=PIPE)(_params(), BATCH)


def test_an_fft_along_the_features_is_exact_with_micro_batches():
    # (the complex zero an rfft pads with was not known to be zero: a false
    # warning that the gradients differ)
    def step(p, b):
        def loss(p):
            h = jnp.tanh(b["x"] @ p["w1"])
            h = jnp.fft.irfft(jnp.fft.rfft(h, axis=-1) * 0.5, n=32, axis=-1)
            return jnp.mean((h @ p["w2"] - b["y"]) ** 2)
        value, g = jax.value_and_grad(loss)(p)
        return jax.tree.map(lambda a, d: a - 0.1 * d, p, g), value
    p = {"w1": jnp.linspace(-1, 1, 32 * 32).reshape(32, 32) / 6,
         "w2": jnp.linspace(1, -1, 32 * 32).reshape(32, 32) / 6}
    batch = {"x": jnp.linspace(-1, 1, 16 * 32).reshape(16, 32), "y": jnp.ones((16, 32))}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")     # (the fft runs gathered: warned of as replicated)
        got = meshplan.parallelize(step, method=PIPE)(p, batch)
    assert not [c for c in caught if "differ from the undecorated" in str(c.message)]
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(jax.jit(step)(p, batch))):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("combine,exact,checkpointed", [
    (lambda acc, g, i, w: acc + g, True, False),
    (lambda acc, g, i, w: acc + g, True, True),     # (the counter meets the rows in one call)
    (lambda acc, g, i, w: acc + g * (i + 1).astype(g.dtype), False, False),   # by a counter
    (lambda acc, g, i, w: acc + g * w, False, False),                 # by per-chunk values
    (lambda acc, g, i, w: 0.5 * acc + g, False, False),               # a decaying average
    (lambda acc, g, i, w: g, False, False),                           # the last chunk's
], ids=["sum", "sum-checkpointed", "counter", "scanned", "decay", "last"])
def test_chunks_of_the_step_weighed_by_their_places_are_warned_of(combine, exact, checkpointed):
    # (each micro-batch cuts its own rows into the chunks: chunk k holds other
    # examples than the whole batch's chunk k; these ran 2.4 to 8.2 off
    # jax.jit without a word)
    def loss(p, x, y):
        return jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"] - y) ** 2)

    def step(p, batch):
        x, y = batch
        chunks = (x.reshape(4, -1, 8), y.reshape(4, -1, 1), jnp.array([1.0, 0.5, 1.0, 0.5]))

        def body(c, chunk):
            g, i = c
            gi = jax.grad(loss)(p, *chunk[:2])
            return (jax.tree.map(lambda a, b: combine(a, b, i, chunk[2]), g, gi), i + 1), None
        body = jax.checkpoint(body) if checkpointed else body
        (g, _), _ = jax.lax.scan(body, (jax.tree.map(jnp.zeros_like, p), 0), chunks)
        return jax.tree.map(lambda a, b: a - 0.5 * b, p, g), loss(p, x, y)
    said = _chunk_step_warnings(step, exact)
    assert exact or "by their places" in said[0], said


def test_a_fori_loop_over_chunks_sized_from_the_shape_is_warned_of_not_dropped():
    # (a fori_loop that slices chunk i of the batch at step i combines exactly
    # in principle, but the runtime replays each micro-batch at its rows per
    # device, where a chunk size computed from the shape, B // 8, is 0: a
    # version that took such loops as exact dropped the update without a word
    # (every slice empty); the loop is warned of and computed exactly)
    def loss(p, x, y):
        return jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"] - y) ** 2)

    def step(p, batch):
        x, y = batch
        c = x.shape[0] // 8

        def body(i, g):
            xs, ys = (jax.lax.dynamic_slice_in_dim(v, i * 2 * c, 2 * c) for v in (x, y))
            return jax.tree.map(jnp.add, g, jax.grad(loss)(p, xs, ys))
        g = jax.lax.fori_loop(0, 4, body, jax.tree.map(jnp.zeros_like, p))
        return jax.tree.map(lambda a, b: a - 0.5 * b, p, g), loss(p, x, y)
    said = _chunk_step_warnings(step, exact=False, equal=True)
    assert "dynamic_slice along the batch axis" in said[0], said


def _chunk_step_warnings(step, exact, equal=None):
    """What a 2-micro-batch plan of a step over chunks of an MLP's batch warns
    of the step's results; warned of unless ``exact``, and equal to jax.jit's
    where ``equal`` (default: ``exact``)."""
    p = {"w1": jnp.linspace(-1, 1, 8 * 16).reshape(8, 16), "w2": jnp.linspace(1, -1, 16).reshape(16, 1)}
    batch = (jnp.linspace(-2, 2, 32 * 8).reshape(32, 8), jnp.linspace(1, -1, 32).reshape(32, 1))
    f = meshplan.parallelize(step, method=meshplan.Manual(dp=4, tp=2, num_micro_batches=2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = f(p, batch)
    said = [str(c.message) for c in caught if "differ from the undecorated" in str(c.message)]
    assert bool(said) != exact, said
    if exact if equal is None else equal:
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(jax.jit(step)(p, batch))):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    return said


def _chunk_losses(p, b):
    """Each chunk's mean loss, stacked by the step's own lax.scan."""
    chunks = jax.tree.map(lambda x: x.reshape((2, x.shape[0] // 2) + x.shape[1:]), b)
    return jax.lax.scan(lambda c, chunk: (c, jnp.mean(_token_losses(p, chunk))), 0.0, chunks)[1]


@pytest.mark.parametrize("metric,exact", [
    (lambda per_chunk: per_chunk, False),           # chunk k: other rows in each micro-batch
    (lambda per_chunk: jnp.mean(per_chunk), True),
    (lambda per_chunk: jnp.sum(per_chunk / 2), True),
    (lambda per_chunk: jnp.max(per_chunk * 2.0), False),    # a chunk's mean is no example's
])
def test_what_a_steps_own_chunks_stack_is_exact_only_over_every_chunk(metric, exact):
    """A lax.scan over the step's own chunks stacks a value per chunk; each
    micro-batch's chunk k holds other rows than the whole batch's chunk k,
    so that value was averaged silently.  Over every chunk, it is over every
    example, however they are grouped."""
    step = _step(lambda p, b: jnp.mean(_token_losses(p, b)),
                 lambda p, b, loss: {"chunks": metric(_chunk_losses(p, b))})
    if exact:
        gap, warned = _run(step)
        assert not warned and gap < 1e-5
    else:
        with pytest.warns(UserWarning, match=r"\['chunks'\].*(chunk k holds other examples|"
                                             "reshape along the batch axis)"):
            meshplan.parallelize(step, method=PIPE)(_params(), BATCH)


@pytest.mark.parametrize("loop", ["map", "summed"])
def test_a_loop_over_the_examples_pipelines_exactly(loop):
    # lax.map of a per-example loss (its results are per example), or a
    # scan that sums the examples' losses into its carry (a sum over them)
    def loss(p, b):
        one = lambda ex: jnp.mean(_token_losses(p, {k: v[None] for k, v in ex.items()}))
        if loop == "map":
            return jnp.mean(jax.lax.map(one, b))
        return jax.lax.scan(lambda c, ex: (c + one(ex), None), 0.0, b)[0] / b["tok"].shape[0]
    gap, warned = _run(_step(loss))
    assert not warned and gap < 1e-5


def test_a_batch_folded_and_put_back_together_pipelines_exactly():
    # (a reshape back to the batch's own order undoes the fold)
    def loss(p, b):
        h = p["emb"][b["tok"]]
        h = h.reshape((2, h.shape[0] // 2) + h.shape[1:]).reshape(h.shape)
        return jnp.mean(jnp.tanh(h @ p["w1"]) @ p["w2"])
    gap, warned = _run(_step(loss))
    assert not warned and gap < 1e-5


def test_each_value_gets_its_kind_and_degree():
    def step(p, batch):
        def loss(p):
            t = _token_losses(p, batch)
            mu = jnp.mean(t)
            return jnp.mean((t - mu) ** 2) + jnp.sum(t)     # per-example values read a batch mean
        l, g = jax.value_and_grad(loss)(p)
        return jax.tree.map(lambda a, b: a - 0.05 * b, p, g), {
            "loss": l, "sum": jnp.sum(_token_losses(p, batch)),
            "mean": jnp.mean(_token_losses(p, batch)), "tokens": _token_losses(p, batch)}
    traced = trace_for_run(step, (_params(), BATCH), (1,), 2)
    info = traced.scaling.info
    outs = dict(zip(["emb", "w1", "w2", "loss", "mean", "sum", "tokens"],
                    [x for x in traced.flat.outvars]))
    assert info[outs["sum"]].kind == "S" and info[outs["sum"]].degree == 1
    assert info[outs["mean"]].kind == "S" and info[outs["mean"]].degree == 0
    assert info[outs["tokens"]].kind == "P" and info[outs["tokens"]].degree == 0
    assert info[outs["loss"]].kind == "X" and "per-example" in info[outs["loss"]].why
    marker = next(fe for fe in traced.flat.eqns if fe.eqn.primitive.name == GRAD_BOUNDARY)
    assert {info[x].kind for x in marker.invars} == {"X"}


def test_an_integer_output_no_combination_gives_is_refused():
    # (which example of the batch has the largest loss: an index into the batch)
    step = meshplan.parallelize(_step(lambda p, b: jnp.mean(_token_losses(p, b)),
                                      lambda p, b, loss: {
                                          "top": jnp.argmax(_token_losses(p, b).sum(1))}),
                                method=PIPE)
    # (named by its path: it was "output leaf 4", its place among the leaves)
    with pytest.raises(meshplan.MeshplanError, match=r"the output \[1\]\['top'\] is a batch-"
                                                     "dependent int32 value, which cannot be "
                                                     "averaged"):
        step(_params(), BATCH)


def test_an_analysis_that_fails_warns_and_averages(monkeypatch):
    import importlib
    micro = importlib.import_module("meshplan.trace.micro")

    def fails(*args):
        raise KeyError("an operation not foreseen")
    monkeypatch.setattr(micro, "batch_scaling", fails)
    gap, warned = _run(_step(lambda p, b: jnp.mean(_token_losses(p, b))))
    assert len(warned) == 1 and "could not tell how this step's values scale" in warned[0]
    assert gap < 1e-5       # (a mean loss: averaging is exact)


def test_an_inexact_step_is_the_average_of_its_micro_batches_under_data_parallelism():
    # batch normalisation: warned of, and then what the warning says (the
    # micro-batches' steps averaged), not statistics of each data shard's
    # rows (the once-a-step reduction replays a backward on a shard's rows)
    def step_fn(p, b):
        def loss(p):
            h = b["x"] @ p["w1"] + p["b1"]
            h = (h - h.mean(0)) / jnp.sqrt(h.var(0) + 1e-5)
            return jnp.mean((jax.nn.relu(h) @ p["w2"] - b["y"]) ** 2)
        loss, g = jax.value_and_grad(loss)(p)
        return jax.tree.map(lambda a, c: a - 0.1 * c, p, g), {"loss": loss}
    k = jax.random.split(jax.random.key(0), 4)
    p = {"w1": jax.random.normal(k[0], (8, 16)) * 0.3, "b1": jnp.zeros(16),
         "w2": jax.random.normal(k[1], (16, 4)) * 0.3}
    b = {"x": jax.random.normal(k[2], (16, 8)), "y": jax.random.normal(k[3], (16, 4))}
    halves = [jax.jit(step_fn)(p, jax.tree.map(lambda a: a[i * 8:(i + 1) * 8], b))
              for i in range(2)]
    average = jax.tree.map(lambda x, y: (x + y) / 2, *halves)
    step = meshplan.parallelize(step_fn, method=meshplan.Manual(dp=2, tp=4, pp=1,
                                                                 num_micro_batches=2))
    with pytest.warns(UserWarning, match="averages it over them"):
        par = step(p, b)
    _, rm = jax.jit(step_fn)(p, b)
    assert abs(float(par[1]["loss"]) - float(rm["loss"])) > 1e-4
    for x, y in zip(jax.tree.leaves(par), jax.tree.leaves(average)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-4, atol=1e-6)


def test_an_output_with_the_batch_on_another_axis_is_named_by_its_path():
    # (it was "output leaf 1", with no remedy)
    def step_fn(p, b):
        value, g = meshplan.value_and_grad(lambda p: jnp.mean(_token_losses(p, b)))(p)
        losses = _token_losses(p, b).sum(1)
        return (jax.tree.map(lambda a, c: a - 0.1 * c, p, g),
                {"loss": value, "spread": jnp.stack([losses, -losses])})
    with pytest.raises(meshplan.MeshplanError,
                       match=r"output \[1\]\['spread'\] has shape .* with the batch first"):
        meshplan.parallelize(step_fn, method=PIPE)(_params(), BATCH)
