"""meshplan.tools.verify: predicted vs compiled communication and memory."""
import pytest

from meshplan.tools.verify import VerifyRow, csv_text, markdown_table, verify


@pytest.mark.parametrize("model, mesh, overrides", [
    ("gpt", (2, 4), {"layers": 1}),
    ("mlp", (8,), {"batch": 256, "hidden": 512}),
    # blocks in a lax.scan, planned and compiled unrolled (meshplan.trace.unstack)
    ("gpt", (2, 4), {"layers": 2, "scan_layers": True}),
])
def test_plan_run_as_planned_communicates_as_predicted(model, mesh, overrides):
    # the runtime pins every reshard the plan makes where it happens, so XLA
    # emits the collectives the cost model predicts
    r = verify(model, mesh, overrides=overrides)
    assert isinstance(r, VerifyRow)
    assert r.actual_comm_bytes > 0
    assert abs(r.comm_rel_error) <= 0.05, (r.predicted_by_kind, r.actual_by_kind)
    assert dict(r.predicted_by_kind)["all-reduce"] > 0
    parts = dict(r.memory_parts)
    assert r.actual_memory_bytes == (parts["argument"] + parts["output"] - parts["alias"]
                                     + parts["temp"])
    assert 0.5 < r.predicted_memory_bytes / r.actual_memory_bytes < 2.0


def test_reports():
    r = verify("gpt", (2, 4), overrides={"layers": 1})
    table = markdown_table([r])
    assert "| gpt | 2x4 |" in table and "AR:" in table
    text = csv_text([r])
    assert text.splitlines()[0].startswith("model,mesh,predicted_comm_bytes")
    assert len(text.splitlines()) == 2


def test_pipeline_lowers_to_one_program_per_stage_and_phase():
    import jax
    import meshplan
    from meshplan.models import build_model
    from meshplan.runtime.pipeline_lower import PipelineLowered

    model = build_model("mlp", {})
    step = meshplan.parallelize(model.train_step,
                                method=meshplan.Manual(dp=2, tp=2, pp=2, num_micro_batches=2))
    lowered = step.lower(*model.abstract_args)
    assert isinstance(lowered, PipelineLowered)
    # (M: the means of a stage's running sums, run once per call)
    assert {k[:2] for k, _ in lowered.items()} == {(k, s) for k in "FBAM" for s in (0, 1)}
    assert all(isinstance(lo, jax.stages.Lowered) for _, lo in lowered.items())
    compiled = lowered.compile()
    assert all(isinstance(c, jax.stages.Compiled) for _, c in compiled.items())
    assert compiled.runs(("F", 0)) == 2 and compiled.runs(("A", 0, 0)) == 1
    assert compiled.runs(("M", 0)) == 1
    assert "stage 1 B" in lowered.as_text()
    # (jax.jit's idiom asks the set for one program's figures: it says where they are)
    for whole, name in ((compiled, "memory_analysis"), (lowered, "compiler_ir")):
        with pytest.raises(AttributeError, match=rf"one jax.stages.\w+ per stage program.*"
                                                 rf"\[key\].{name}"):
            getattr(whole, name)
    for name in ("no_such", "in_tree"):      # (in_tree: the step's, which no program takes)
        with pytest.raises(AttributeError, match=f"no attribute '{name}'"):
            getattr(compiled, name)


def test_pipeline_rows_compare_each_stage():
    from meshplan.tools.verify import pipeline_table, verify_pipeline

    rows = verify_pipeline("mlp", 2, 1, 4, 2, "gpipe")
    assert [r.stage for r in rows] == [0, 1, 2, 3]
    for r in rows:
        parts = dict(r.memory_parts)
        # (the update's unaliased outputs, after the passes: a metric here)
        assert r.actual_memory_bytes == parts["state"] + parts["running_sums"] + max(
            parts["activations"] + parts["programs"], parts["updated"])
        assert parts["updated"] < 0.01 * parts["state"]
        assert 0.5 < r.predicted_memory_bytes / r.actual_memory_bytes < 2.0
    # every stage runs data parallel (a middle stage once computed its
    # activations whole on both data shards, taking them whole from its
    # neighbours) and reduces its gradients once per step (in the means
    # program), as the plan charges: not once per micro-batch
    for r in rows:
        assert r.predicted_comm_bytes > 0
        assert abs(r.comm_rel_error) <= 0.01, (r.stage, r.predicted_comm_bytes, r.actual_by_kind)
    assert "| mlp | 4x(2x1) mb2 gpipe | 3 |" in pipeline_table(rows)


@pytest.mark.extended   # (its numbers: tests/test_pipeline_runtime.py, the tied embedding)
def test_a_tied_embedding_gradient_is_reduced_once_a_step_at_the_last_stage():
    # gpt's output projection is its token embedding: the last stage sums its
    # contribution to that gradient over the micro-batches (planned cut over
    # the data axis, kept whole per data shard) and reduces it once a step,
    # as the plan charges (meshplan.contributions, runtime.pipeline_partial)
    from meshplan.tools.verify import verify_pipeline

    rows = verify_pipeline("gpt", 2, 1, 4, 2, "gpipe")
    last = rows[-1]
    assert last.predicted_comm_bytes > 0
    assert abs(last.comm_rel_error) <= 0.01, (last.predicted_comm_bytes, last.actual_by_kind)
    # and each stage keeps between its forward and backward what the plan's
    # activation memory counts: the backward makes again the element-wise
    # chains XLA would fuse into it in one program (api.fused_replay); its
    # state and running gradient sums (whole per data shard, though the
    # plan cuts some gradients over the data axis) are what the plan counts
    for r in rows:
        measured, planned = dict(r.memory_parts), dict(r.predicted_memory_parts)
        for got, want in ((measured["activations"], planned["activations"]),
                          (measured["running_sums"], planned["grads"]),
                          (measured["state"], planned["params"] + planned["optimizer"])):
            assert abs(got - want) <= 0.01 * want + 1024, (r.stage, measured, planned)


def test_a_weight_gathered_for_the_forward_is_gathered_again_by_the_backward_program():
    # a pipeline stage's forward and backward are separate programs: a
    # parameter both read in a gathered layout (the head's weight under
    # tensor parallelism) is gathered in each, as the plan now charges
    # (ilp.decode.explain, Built.split_programs); charged once, the last
    # stage's prediction was 25% under the compiled programs' bytes
    from meshplan.tools.verify import verify_pipeline

    rows = verify_pipeline("gpt", 2, 2, 2, 4, "1f1b")
    for r in rows:
        assert abs(r.comm_rel_error) <= 0.1, (r.stage, r.predicted_comm_bytes, r.actual_by_kind)


@pytest.mark.parametrize("model", [pytest.param("gpt", marks=pytest.mark.extended), "mlp"])
def test_searched_pipeline_stages_communicate_as_predicted(model):
    # PipeshardParallel(stages=2, num_micro_batches=4) on 8 devices: each
    # layer's ILP picks its layouts, a layer is solved again to agree with
    # the later layers of its stage where they disagree, and what still
    # disagrees is charged (dp_search.stages.StageCosts.member, .joints); a
    # gradient's sum waits for the last micro-batch only over axes cutting
    # its rows, and each stage keeps partial sums over its own data shards
    # (gpt's stages get meshes of different shapes); a stage whose backward
    # cannot run on each data shard's rows (mlp's head computed whole on
    # every device, handing back whole cotangents) reduces its gradients
    # every micro-batch, as its plan now charges (StageCosts.undeferred)
    from meshplan.tools.verify import verify_pipeline

    rows = verify_pipeline(model, 1, 4, 2, 4, "1f1b", searched=True)
    assert len(rows) == 2 and any(r.actual_comm_bytes for r in rows)
    for r in rows:
        assert abs(r.comm_rel_error) <= 0.1, (r.stage, r.predicted_comm_bytes, r.actual_by_kind)


def test_a_stage_planned_on_whole_rows_keeps_no_partial_sums():
    # Manual(dp=1, tp=2): the batch is whole, so the runtime tries the mesh's
    # axes as data axes.  Stage 0's backward is planned on whole rows (its
    # gradients whole, nothing to reduce); cut into rows anyway, its partial
    # sums added an all-reduce of every gradient a step (+67% over the plan)
    from meshplan.tools.verify import verify_pipeline
    rows = verify_pipeline("mlp", 1, 2, 4, 2, "1f1b", overrides={"layers": "4"})
    for r in rows:
        assert abs(r.comm_rel_error) <= 0.02, (r.stage, r.predicted_comm_bytes,
                                               r.actual_by_kind)


@pytest.mark.extended
def test_zb_h1_stages_pay_the_reduction_of_every_micro_batch():
    # the runtime keeps no partial gradient sums under ZB-H1 (its W programs
    # are not replayed per data shard), so each stage all-reduces its
    # gradients every micro-batch; the plan charged one reduction a step
    # (-32% and -29% against the compiled programs)
    from meshplan.tools.verify import verify_pipeline
    rows = verify_pipeline("mlp", 2, 2, 2, 4, "zb-h1")
    for r in rows:
        assert abs(r.comm_rel_error) <= 0.02, (r.stage, r.predicted_comm_bytes,
                                               r.actual_by_kind)


@pytest.mark.extended
def test_zb_h1_stages_keep_what_the_plan_counts():
    # ZB-H1's B and W each replay the element-wise chains they read, so a
    # forward keeps what it keeps under 1F1B (cut before the replay, every
    # value of those chains: +46% a micro-batch on these stages), and the
    # planner walks the stage's order with what each micro-batch keeps until
    # its B and then until its W (it charged 1F1B's count plus a share:
    # -37% and -40% against the runtime's peak here).  The last stage's W
    # computes the tied head's contribution to the embedding's gradient (its
    # sum runs once a step): the planner took it for input-gradient work, and
    # charged 43% of that stage's activations
    from meshplan.tools.verify import verify_pipeline
    rows = verify_pipeline("gpt", 2, 1, 4, 4, "zb-h1")
    for r in rows[1:]:
        got = dict(r.predicted_memory_parts)["activations"]
        want = dict(r.memory_parts)["activations"]
        assert abs(got - want) <= 0.05 * want, (r.stage, got, want)


def test_a_stage_keeps_partial_sums_only_over_the_axes_its_plan_defers():
    # gpt Manual(1,2,4): the head stage cuts its tokens over the model axis,
    # and its layer ILP priced the tied weight's gradient reduced each
    # micro-batch (no sums wait: Stage.deferred_axes is empty).  The runtime
    # kept partial sums over the model axis regardless (one reduction a
    # step: -19% communication against the plan, running sums twice the
    # plan's); now it does what the plan priced
    from meshplan.tools.verify import verify_pipeline
    rows = verify_pipeline("gpt", 1, 2, 4, 4, "1f1b")
    for r in rows:
        assert abs(r.comm_rel_error) <= 0.01, (r.stage, r.predicted_comm_bytes, r.actual_by_kind)
        got = dict(r.predicted_memory_parts)["grads"]
        want = dict(r.memory_parts)["running_sums"]
        assert abs(got - want) <= 0.01 * want + 16, (r.stage, got, want)


@pytest.mark.extended
def test_micro_batches_of_one_row_reduce_every_micro_batch_as_planned():
    # PipeshardParallel(stages=4) on gpt with micro-batches of one sequence:
    # the layer ILPs let gradient sums wait over axes that cut the tokens
    # (rows and sequence folded), but no data shard has rows of its own, so
    # the runtime keeps no partial sums and reduces every micro-batch
    # (-73% and -59% communication against the compiled programs before),
    # holding the sums in the gradients' planned layouts (whole, twice, before)
    from meshplan.tools.verify import verify_pipeline
    rows = verify_pipeline("gpt", 1, 2, 4, 8, "1f1b", searched=True)
    for r in rows:
        assert abs(r.comm_rel_error) <= 0.02, (r.stage, r.predicted_comm_bytes, r.actual_by_kind)
        got = dict(r.predicted_memory_parts)["grads"]
        want = dict(r.memory_parts)["running_sums"]
        assert abs(got - want) <= 0.02 * want, (r.stage, got, want)
