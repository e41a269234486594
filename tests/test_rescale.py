"""The Graph rewritten per micro-batch count (meshplan.trace.rescale) equals a
real trace at that count, field by field, for every built-in model and for
the fuzzer's models; what cannot be proven exact is traced instead."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import meshplan
from meshplan.dp_search import Session
from meshplan.errors import TraceError
from meshplan.models import build_model
from meshplan.planning import retracer, trace_function
from meshplan.trace.rescale import Rescaling, batch_dims, graph_difference, rescale_batch

from test_fuzz_models import build, model_and_mesh

SMALL = {
    "mlp": {},
    "gpt": {},
    "gpt-scan": {"scan_layers": True, "layers": 3},
    "gpt-bf16": {"compute_dtype": "bfloat16"},
    # (dropout: a draw's bits made floats, with JAX's two generators)
    "gpt-dropout": {"dropout": 0.1, "rng_impl": "rbg"},
    "gpt-threefry": {"dropout": 0.1, "rng_impl": "threefry2x32"},
    "moe": {},
    "moe-groups": {"expert_group_size": 16, "batch": 16},
    # (expert groups of two sequences, as the Alpa presets' 2048 tokens of
    # 1024: a reshape splits the batch in two)
    "moe-pairs": {"expert_group_size": 64, "batch": 32},
    "wresnet": {},
    # (the ImageNet stem's max pooling and its transpose)
    "wresnet-pool": {"image_size": 64, "layers": 4, "num_stages": 1, "base_width": 4},
}
# the factor a reshape splits the batch by (1 where none does)
SPLIT = {"moe-pairs": 2}


def _traced(step, args, batch_argnums=(1,), name="step"):
    t = trace_function(step, args, batch_argnums, name, Session())
    return t, retracer(t.step, t.args, t.batch_argnums, name)


def _check_all_counts(t, real, counts) -> Rescaling:
    """Every count through a Rescaling equals a real trace at that count."""
    r = Rescaling(t.graph, real)
    for B in counts:
        try:
            want = real(B)
        except TraceError:   # (a step that cannot run B micro-batches: nor may its rewrite)
            with pytest.raises(TraceError):
                r(B)
            continue
        got = r(B)
        why = graph_difference(got, want)
        assert why is None, f"{B} micro-batches ({r.log[-1][1]}): {why}"
    return r


@pytest.mark.parametrize("label", sorted(SMALL))
def test_rewritten_graph_equals_a_trace_for_built_in_models(label):
    m = build_model(label.split("-")[0], SMALL[label])
    t, real = _traced(m.train_step, m.abstract_args, m.batch_argnums, label)
    batch = t.graph.tensors[next(i.tensor for i in t.graph.inputs if i.role == "batch")].shape[0]
    counts = [b for b in (2, 4, 8, 16) if batch % b == 0]
    r = _check_all_counts(t, real, counts)
    rewritten, traced, _ = r.counts()
    assert traced >= 1 and rewritten + traced == len(counts)
    # the first count is the probe; after it, every count whose micro-batch
    # keeps more than one example (two or more groups of them where the
    # batch is split) is rewritten
    g = SPLIT.get(label, 1)
    assert r.dims.groups == ((g,) if g > 1 else ()), r.dims
    assert rewritten == sum(1 for b in counts[1:] if (batch // b) % g == 0
                            and batch // b // g > 1), r.dims
    if g > 1:
        assert rewritten >= 1
    # the probe's count and the last one made are given again as they were
    n = len(r.log)
    assert r(counts[0]) is r.probe[1] and r(counts[-1]) is r.last[1]
    assert [how for _, how, _ in r.log[n:]] == ["kept", "kept"]
    assert r.counts() == (rewritten, traced, r.counts()[2])


def test_the_moe_presets_are_rewritten():
    # expert groups of 2048 tokens, two sequences of 1024: at 2 micro-batches
    # the probe, then rewritten
    m = build_model("moe-380m")
    t, real = _traced(m.train_step, m.abstract_args, m.batch_argnums, "moe-380m")
    r = _check_all_counts(t, real, (2, 4, 8))
    assert r.counts()[:2] == (2, 1) and r.dims.groups == (2,), r


FUZZ = settings(max_examples=8, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))


@pytest.mark.extended   # (the built-in models: test_rewritten_graph_equals_a_trace_for_built_in_models)
@FUZZ
@given(desc=model_and_mesh(), batch=st.sampled_from([4, 8, 12]))
def test_rewritten_graph_equals_a_trace_for_fuzzed_models(desc, batch):
    step, state, data = build(dict(desc, batch=batch))
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), x.dtype), (state, data))
    t, real = _traced(step, abstract)
    _check_all_counts(t, real, [b for b in (2, 3, 4, 6, 12) if batch % b == 0])


def _small_batch_step(body, x=(16, 8)):
    def step(w, x):
        loss, g = meshplan.value_and_grad(lambda w: body(w, x))(w)
        return w - 0.1 * g, {"loss": loss}
    return step, (jax.ShapeDtypeStruct((x[-1], x[-1]), jnp.float32),
                  jax.ShapeDtypeStruct(x, jnp.float32))


def _all_traced(body, counts=(2, 4, 8), x=(16, 8)) -> str:
    step, args = _small_batch_step(body, x)
    t, real = _traced(step, args)
    r = _check_all_counts(t, real, counts)
    assert r.counts()[0] == 0, r
    return r.dims.why if r.dims is not None else ""


def test_a_reshape_that_splits_the_batch_is_traced():
    # 16 x 6 -> 3 x 32: no dimension holds two or more batch indices
    why = _all_traced(lambda w, x: jnp.sum((x @ w) ** 2) + jnp.sum(x.reshape(3, -1) ** 2),
                      x=(16, 6))
    assert "splits the batch" in why
    # 16 x 8 -> 4 x 4 x 8: read as 4 groups of 4 examples, but the step
    # keeps 4 chunks whatever the batch; the probe tells them apart
    why = _all_traced(lambda w, x: jnp.sum((x.reshape(4, -1, 8) @ w) ** 2))
    assert "differs from the trace" in why


def _pairs(w, x):
    """Two examples to a row and back, as MoE expert groups of two sequences."""
    b, s, h = x.shape
    y = jnp.tanh(x.reshape(b // 2, 2 * s, h) @ w)
    return jnp.sum((y.reshape(b, s, h) * x) ** 2)


def test_a_reshape_that_groups_examples_in_pairs_is_rewritten():
    step, args = _small_batch_step(_pairs, x=(12, 4, 8))
    t, real = _traced(step, args)
    # 6 examples a micro-batch (the probe), 4 (rewritten), 3 (odd: the trace
    # fails, as must the count), 2 (one pair: traced)
    r = _check_all_counts(t, real, (2, 3, 4, 6))
    assert [(B, how) for B, how, _ in r.log] == [(2, "traced"), (3, "rewritten"), (6, "traced")]
    assert r.dims.groups == (2,), r.dims
    assert rescale_batch(t.graph, 4, r.dims) is None      # (3 examples: no whole pairs)


def test_a_probe_too_fine_for_the_pairs_is_taken_again():
    # the search's order, the most micro-batches first: the probe of one
    # pair cannot check the rewrite, the next count that fits probes again
    step, args = _small_batch_step(_pairs, x=(16, 4, 8))
    t, real = _traced(step, args)
    r = _check_all_counts(t, real, (8, 4, 2))
    assert [(B, how) for B, how, _ in r.log] == [(8, "traced"), (4, "traced"),
                                                 (2, "rewritten")], r


def test_python_branching_on_the_batch_size_is_caught_by_the_probe():
    def body(w, x):
        y = x @ w
        if x.shape[0] > 8:          # other operators at the full batch
            y = jnp.tanh(y)
        return jnp.sum(y ** 2)
    assert "other operators" in _all_traced(body)


def test_a_made_dimension_of_the_batch_size_linked_to_nothing_is_traced():
    # the arange has the batch's length but meets no batch dimension
    why = _all_traced(lambda w, x: jnp.sum((x @ w) ** 2) + jnp.sum(jnp.arange(x.shape[0]) * 1.0))
    assert "tied to no input" in why


def test_an_iota_that_meets_the_batch_is_rewritten():
    step, args = _small_batch_step(
        lambda w, x: jnp.sum((x @ w) ** 2 * jnp.arange(x.shape[0])[:, None]))
    t, real = _traced(step, args)
    r = _check_all_counts(t, real, (2, 4))
    assert r.counts()[:2] == (1, 1)


def test_micro_batches_of_one_example_are_traced():
    # (jax leaves out broadcasts that become identities at size 1)
    m = build_model("mlp", {"batch": 4})
    t, real = _traced(m.train_step, m.abstract_args, m.batch_argnums)
    dims = batch_dims(t.graph)
    assert not dims.why
    assert rescale_batch(t.graph, 2, dims) is not None
    assert rescale_batch(t.graph, 4, dims) is None
    assert rescale_batch(t.graph, 3, dims) is None        # (4 does not split into 3)


@pytest.mark.slow   # (29 s; the rewrite-equals-trace tests stay in the default suite)
def test_the_pipeline_search_reports_rewritten_counts():
    from meshplan.planning import plan_function
    m = build_model("gpt", {"layers": 2, "hidden": 16, "heads": 2, "seq_len": 8, "vocab": 32,
                            "batch": 16})
    cluster = meshplan.load_cluster("examples/clusters/dgx-a100-x1.json")
    session = Session()
    t = trace_function(m.train_step, m.abstract_args, m.batch_argnums, "gpt", session)
    planned = plan_function(t, cluster, meshplan.PipeshardParallel(), session)
    s = planned.search
    assert s.micro_batch_counts >= 3
    # (16 micro-batches of one example are traced, then 8 as the probe)
    assert s.retraced <= 2 and s.rewritten >= 1, s
    assert s.rewritten + s.retraced <= s.micro_batch_counts
    assert 0.0 < s.rewrite_s <= s.trace_s
    # the same plan as tracing every count
    fresh = dataclasses.replace(t)
    fresh.__dict__["retrace"] = retracer(t.step, t.args, t.batch_argnums, "gpt")
    again = plan_function(fresh, cluster, meshplan.PipeshardParallel(), Session())
    assert again.search.rewritten == 0
    assert again.plan.to_json() == planned.plan.to_json()
