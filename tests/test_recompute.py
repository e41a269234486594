"""Selective recomputation (meshplan.recompute): the region it recomputes, what
it keeps against Korthikanti et al. 2022, the stage DP's choice among none /
selective / full, the plan JSON, and the pipeline runtime replaying the region
only (float32, SGD: numerics as in test_pipeline_runtime)."""
import dataclasses
import functools
import json
import pathlib

import jax
import numpy as np
import pytest

import meshplan
from _steps import assert_states_close, jit_losses, run_plan
from meshplan.cost_model.fusion import backward_reads, kept_after_fusion
from meshplan.dp_search.problem import layer_problems
from meshplan.graph import forward_nodes
from meshplan.models import build_model
from meshplan.recompute import recomputed_tensors, selective_nodes
from meshplan.request import PipelineOptions
from meshplan.runtime.pipeline import PipelineExecutable
from meshplan.trace import trace

ROOT = pathlib.Path(__file__).resolve().parents[1]
DGX = str(ROOT / "examples" / "clusters" / "dgx-a100-x1.json")
GPT = {"optimizer": "sgd", "layers": "2", "hidden": "32", "seq_len": "16", "vocab": "64",
       "batch": "16"}


def _gpt_graph(**cfg):
    m = build_model("gpt", {k: str(v) for k, v in cfg.items()})
    return trace(m.train_step, *m.abstract_args, batch_argnums=m.batch_argnums)


def test_selective_region_is_the_attention_scores_not_the_mlp():
    layers = 3
    g = _gpt_graph(batch=2, seq_len=32, hidden=64, heads=4, layers=layers, vocab=128)
    fwd = forward_nodes(g)
    region = selective_nodes(g, fwd)
    prims = [g.nodes[n].primitive for n in region]
    dots = [g.nodes[n] for n in region if g.nodes[n].primitive == "dot_general"]
    # QK^T and PV of every layer, each with batch dimensions (b, heads)
    assert len(dots) == 2 * layers
    assert all(d.param("dimension_numbers")[1][0] for d in dots)
    # softmax is in, the MLP's GELU (tanh) and every weight matmul are out
    assert prims.count("exp") == layers and prims.count("reduce_max") == layers
    assert "tanh" not in prims
    assert all(fwd[n] for n in region)
    # what the backward recomputes: score-shaped values; the context P V
    # (read by the output projection) is kept
    again = recomputed_tensors(g, fwd, region)
    score_shape = (2, 4, 32, 32)
    assert any(g.tensors[t].shape == score_shape for t in again)
    pv = [d for d in dots if g.tensors[d.outputs[0]].shape != score_shape]
    assert len(pv) == layers and not any(d.outputs[0] in again for d in pv)


def test_without_attention_only_parameter_copies_are_recomputed():
    # an MLP has no attention dot: the region is what derives from parameters
    # alone (bias broadcasts), never a value of the batch
    m = build_model("mlp", {"layers": "2"})
    g = trace(m.train_step, *m.abstract_args, batch_argnums=m.batch_argnums)
    region = selective_nodes(g, forward_nodes(g))
    batch = {i.tensor for i in g.inputs if i.role == "batch"}
    assert not any(g.nodes[n].primitive == "dot_general" for n in region)
    assert not any(t in batch for n in region for t in g.nodes[n].inputs)


def test_bfloat16_copies_of_float32_weights_are_recomputed_not_kept():
    g = _gpt_graph(batch=2, seq_len=32, hidden=64, heads=4, layers=2, vocab=128,
                   dtype="float32", compute_dtype="bfloat16")
    fwd = forward_nodes(g)
    region = selective_nodes(g, fwd)
    again = recomputed_tensors(g, fwd, region)
    params = {i.tensor for i in g.inputs if i.role == "param"}
    casts = [n for n in g.nodes if fwd[n.id] and n.primitive == "convert_element_type"
             and n.inputs[0] in params and len(g.tensors[n.inputs[0]].shape) == 2]
    assert casts and all(n.id in region and n.outputs[0] in again for n in casts)


def _kept_per_layer(s, b=2, h=256, a=8):
    """(none, selective) bytes one transformer layer keeps per micro-batch, unsplit."""
    g = _gpt_graph(batch=b, seq_len=s, hidden=h, heads=a, layers=2, vocab=512,
                   dtype="bfloat16", compute_dtype="bfloat16")
    lay = layer_problems(g, 1, meshplan.Cluster.local(), PipelineOptions(num_layers=4))
    sub = lay.subs[1]                   # the first transformer block

    def nbytes(ts):
        return sum(sub.tensors[t].nbytes for t in ts)
    return nbytes(lay.saved[1]), nbytes(lay.selective[1][1])


def test_kept_bytes_follow_korthikanti_terms():
    """Korthikanti et al. 2022, Table 2 (16-bit, t = 1): a layer keeps
    s b h (34 + 5 a s / h) bytes without recomputation, s b h 34 with selective.
    What meshplan counts as kept (cost_model.fusion.kept_after_fusion: the
    traced backward's reads once XLA has fused the element-wise chains) has
    the same terms.  Selective: 32 s b h, the paper's 34 without its two
    dropout masks (this model has no dropout): LayerNorm inputs 4, their
    outputs 4, Q K V 6, the context 2, GELU input and output 16.  The region
    frees 4 bytes per attention score: the probabilities (2, as the paper's
    softmax output) and the scores' matmul result (2), from which the fused
    backward makes the softmax's exp again (the paper's 3 more are dropout)."""
    b, h, a = 2, 256, 8
    rows = {}
    for s in (64, 128, 256):
        none, sel = _kept_per_layer(s, b, h, a)
        rows[s] = (none, sel, a * s * s * b, s * b * h)
    sel_per_sbh = [r[1] / r[3] for r in rows.values()]
    assert max(sel_per_sbh) / min(sel_per_sbh) < 1.01
    assert 32 <= sel_per_sbh[0] <= 32.1
    # bytes per attention score, from the growth with s (the scores'
    # per-row statistics, a s b floats, add the 0.02 over 4)
    (n1, s1, q1, _), (n2, s2, q2, _) = rows[128], rows[256]
    freed_per_score = ((n2 - s2) - (n1 - s1)) / (q2 - q1)
    assert abs(freed_per_score - 4) < 0.05
    for s, (none, sel, scores, sbh) in rows.items():
        assert none <= 34 * sbh + 5 * scores


@functools.lru_cache(maxsize=None)
def _manual(remat, mb=4):
    m = build_model("gpt", GPT)
    return meshplan.plan(m.train_step, *m.abstract_args, cluster=meshplan.load_cluster(DGX),
                         method=meshplan.Manual(dp=2, tp=2, pp=2, num_micro_batches=mb,
                                                remat=remat))


def test_manual_selective_costs_between_none_and_full():
    plans = {r: _manual(r) for r in ("none", "selective", "full")}
    assert [s.recompute for s in plans["selective"].stages] == ["selective"] * 2
    assert all(s.remat for s in plans["selective"].stages)     # old readers: it recomputes
    assert [s.recompute for s in plans["full"].stages] == ["full"] * 2
    assert [s.recompute for s in plans["none"].stages] == ["none"] * 2
    for k in range(2):
        mem = {r: p.stages[k].predicted.memory.activations for r, p in plans.items()}
        assert mem["none"] > mem["selective"] > mem["full"], mem
    t = {r: p.predicted.iteration_s for r, p in plans.items()}
    assert t["none"] < t["selective"] < t["full"], t
    # the recomputed region costs a few percent, a full forward far more
    assert t["selective"] - t["none"] < 0.5 * (t["full"] - t["none"])
    assert "remat (selective)" in str(plans["selective"])


def test_auto_remat_takes_selective_where_none_does_not_fit():
    none, sel = _manual("none"), _manual("selective")
    dev = meshplan.load_cluster(DGX).device.memory_bytes
    need_none = max(s.predicted.memory_bytes for s in none.stages)
    need_sel = max(s.predicted.memory_bytes for s in sel.stages)
    # a budget that fits every stage selectively but not every stage without remat
    frac = (need_none + need_sel) / 2 / dev
    m = build_model("gpt", GPT)
    p = meshplan.plan(m.train_step, *m.abstract_args, cluster=meshplan.load_cluster(DGX),
                      method=meshplan.Manual(dp=2, tp=2, pp=2, num_micro_batches=4,
                                             memory_fraction=frac))
    kinds = [s.recompute for s in p.stages]
    assert "selective" in kinds and "full" not in kinds, kinds


def test_plan_json_records_the_choice_and_old_files_load():
    p = _manual("selective")
    d = json.loads(p.to_json())
    assert [s["recompute"] for s in d["stages"]] == ["selective"] * 2
    assert [s["remat"] for s in d["stages"]] == [True, True]
    assert meshplan.Plan.from_json(p.to_json()) == p
    # a file written before the key existed: remat alone says none or full
    for remat, want in ((True, "full"), (False, "none")):
        old = json.loads(p.to_json())
        for s in old["stages"]:
            del s["recompute"]
            s["remat"] = remat
        back = meshplan.Plan.from_json(json.dumps(old))
        assert [s.recompute for s in back.stages] == [want] * 2
    bad = json.loads(p.to_json())
    bad["stages"][0]["recompute"] = "sometimes"
    with pytest.raises(meshplan.MeshplanError, match="recompute 'sometimes'"):
        meshplan.Plan.from_json(json.dumps(bad))


def test_cli_remat_selective(tmp_path, capsys):
    from meshplan.cli import main
    out = tmp_path / "p.json"
    args = ["plan", "--model", "gpt", "--cluster", DGX, "--method", "manual", "--dp", "2",
            "--tp", "2", "--pp", "2", "--micro-batches", "2", "--remat", "selective",
            "--json", str(out)]
    for k, v in GPT.items():
        args += ["--model-arg", f"{k}={v}"]
    assert main(args) == 0
    d = json.loads(out.read_text())
    assert [s["recompute"] for s in d["stages"]] == ["selective"] * 2
    assert "remat (selective)" in capsys.readouterr().out


# ---------------------------------------------------------------------------
# the runtime: a selective backward replays the region only
# ---------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _model():
    m = build_model("gpt", GPT)
    state, batch = jax.device_get(m.init(0))
    return m, state, batch


def _local_plan(kinds):
    m, state, batch = _model()
    p = meshplan.plan(m.train_step, state, batch,
                      method=meshplan.Manual(dp=2, tp=2, pp=2, num_micro_batches=4))
    return dataclasses.replace(p, stages=tuple(
        dataclasses.replace(s, remat=k != "none", recompute=k) for s, k in zip(p.stages, kinds)))


def _run(plan, steps=3):
    m, state, batch = _model()
    step, state, losses = run_plan(m.train_step, plan, state, batch, steps)
    return step._fast[1], state, losses


def test_selective_and_full_stages_equal_undecorated_step():
    ex, state, losses = _run(_local_plan(("selective", "full")))
    assert isinstance(ex, PipelineExecutable)
    m, state0, batch = _model()
    ref_losses, ref_state = jit_losses(m.train_step, state0, batch, 3)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_states_close(ref_state, state)
    eqns = ex.flat.eqns
    f0, b0 = ex.programs[("F", 0)].task, ex.programs[("B", 0)].task
    f1, b1 = ex.programs[("F", 1)].task, ex.programs[("B", 1)].task
    # selective: the softmax replayed, no weight matmul; full: the whole forward's
    replayed0 = [eqns[k].eqn.primitive.name for k in b0.replay]
    assert "exp" in replayed0 and "tanh" not in replayed0
    assert replayed0.count("dot_general") == 1          # Q K^T (P V's result is kept)
    assert set(b0.replay) < set(f0.eqns)
    replayed1 = [eqns[k].eqn.primitive.name for k in b1.replay]
    assert "tanh" in replayed1 and replayed1.count("dot_general") > 2


def _kept_between(ex, s):
    """Bytes a stage's backward reads from its own forward program (or from
    what that forward received), per micro-batch: what it keeps in between."""
    f, b = ex.programs[("F", s)].task, ex.programs[("B", s)].task
    made = {o for k in f.eqns for o in ex.flat.eqns[k].outvars}
    kept = [x for x in b.inputs if x in made or (x in f.inputs and x not in ex.flat.invars)]
    return sum(np.prod(ex.flat.avals[x].shape) * ex.flat.avals[x].dtype.itemsize for x in kept)


@pytest.mark.slow   # (42 s; selective and full numerics stay in the default suite)
def test_kept_between_forward_and_backward_follows_none_selective_full():
    kept = {}
    for k in ("none", "selective", "full"):
        ex, _, _ = _run(_local_plan((k, k)), steps=1)
        kept[k] = [_kept_between(ex, s) for s in range(2)]
    for s in range(2):
        assert kept["none"][s] > kept["selective"][s] > kept["full"][s], kept


def test_with_dropout_a_block_keeps_korthikanti_bytes():
    """With Megatron-LM's dropout (the model's ``dropout``), what one more
    block keeps for its backward without recomputation is Korthikanti et
    al.'s whole count, s b h (34 + 5 a s / h) bytes: the two 1-byte masks on
    the residual branches make 34, and per attention score the scores'
    matmul result (2), the mask (1) and the dropped probabilities the PV
    product reads (2) make 5.  (0.3 s b h more: the softmax's float32 row
    statistics.)"""
    def kept(layers, s, b=2, h=256, a=8):
        g = _gpt_graph(batch=b, seq_len=s, hidden=h, heads=a, layers=layers, vocab=512,
                       dtype="bfloat16", compute_dtype="bfloat16", dropout=0.1)
        fwd = forward_nodes(g)
        return sum(g.tensors[t].nbytes for t in kept_after_fusion(g, fwd, backward_reads(g, fwd)))
    for s in (64, 256):
        block = kept(3, s) - kept(2, s)
        sbh, scores = s * 2 * 256, 8 * s * s * 2
        assert 34 <= (block - 5 * scores) / sbh <= 34.5
