"""What a pipeline stage's programs need beside their arguments and outputs
(cost_model.memory.program_temp_bytes): against a count by hand over the
liveness, and against the temp arena XLA compiles for the stage programs."""
import jax
import jax.numpy as jnp

import meshplan
from meshplan.cost_model.fusion import backward_reads, kept_after_fusion
from meshplan.cost_model.memory import program_temp_bytes
from meshplan.graph import forward_nodes
from meshplan.ilp.accumulation import update_nodes
from meshplan.ilp.build import stored_liveness
from meshplan.trace import trace


def _tanh_step():
    w = jax.ShapeDtypeStruct((64, 512), jnp.float32)
    x = jax.ShapeDtypeStruct((32, 64), jnp.float32)

    def loss(w, x):
        return jnp.sum(jnp.tanh(x @ w) @ w.T)

    def step(w, x):
        return meshplan.value_and_grad(loss)(w, x)
    return trace(step, w, x, batch_argnums=(1,))


def _peak_by_hand(g, intervals, pick) -> float:
    """The most bytes of the stored values ``pick`` accepts live at one node."""
    return max(sum(g.tensors[t].nbytes for t, (a, b) in intervals.items() if a <= i <= b and pick(t))
               for i in range(len(g.nodes)))


def test_the_backward_holds_what_it_makes_on_top_of_every_kept_value():
    g = _tanh_step()
    fwd = forward_nodes(g)
    kept = kept_after_fusion(g, fwd, backward_reads(g, fwd))
    intervals = stored_liveness(g).intervals
    made = g.producer
    got = program_temp_bytes(g, intervals, fwd, kept, (), (), True,
                             lambda t: g.tensors[t].nbytes)
    backward = _peak_by_hand(g, intervals, lambda t: not fwd[made[t]] and t not in kept)
    forward = _peak_by_hand(g, intervals, lambda t: fwd[made[t]] and t not in kept)
    assert got == max(backward, forward) > 0
    # the peak of everything live less what is kept (the stage DP's figure
    # before): the backward is done with tanh's output early, but its program
    # holds it as an argument to the end, so that saving is not there
    everything = _peak_by_hand(g, intervals, lambda t: True)
    assert everything - sum(g.tensors[t].nbytes for t in kept) < got


def test_a_gradient_summed_as_it_is_made_counts_only_then_and_an_output_not_at_all():
    g = _tanh_step()
    fwd = forward_nodes(g)
    kept = kept_after_fusion(g, fwd, backward_reads(g, fwd))
    intervals = stored_liveness(g).intervals
    (grad,) = [o.tensor for o in g.outputs if g.tensors[o.tensor].shape == (64, 512)]
    # (the marker's operand: the gradient the backward makes)
    made = g.nodes[g.producer[grad]].inputs[0]
    size = g.tensors[made].nbytes
    update = update_nodes(g, frozenset({made}))[0]

    def temps(summed: bool) -> float:
        return program_temp_bytes(g, intervals, fwd, kept, {made}, update, summed,
                                  lambda t: g.tensors[t].nbytes)
    # as an output it is not a temp; summed, it is one at the node making it
    a, _ = intervals[made]

    def by_hand(summed: bool) -> float:
        def at(i: int) -> float:
            live = sum(g.tensors[t].nbytes for t, (s, e) in intervals.items()
                       if s <= i <= e and t != made and t not in kept and not fwd[g.producer[t]])
            return live + (size if summed and i == a else 0)
        forward = _peak_by_hand(g, intervals, lambda t: fwd[g.producer[t]] and t not in kept)
        return max(forward, max(at(i) for i in range(len(g.nodes))))
    assert temps(False) == by_hand(False)
    assert temps(True) == by_hand(True)


def test_a_middle_stage_plans_the_memory_its_compiled_programs_take():
    # gpt, 4 stages of (2 x 1), GPipe over 2 micro-batches: stages 1 and 2
    # hold one transformer block each.  Their state, running sums and kept
    # activations are counted exactly (tests/test_verify.py); the rest is
    # the largest temp arena of their programs, the backward's here
    from meshplan.tools.verify import verify_pipeline

    rows = verify_pipeline("gpt", 2, 1, 4, 2, "gpipe")
    for r in rows[1:3]:
        planned, measured = dict(r.predicted_memory_parts), dict(r.memory_parts)
        # (the figure of before counted 0.31 of it, the total 11.9% short)
        assert planned["temporaries"] >= 0.5 * measured["programs"], (planned, measured)
        assert abs(r.memory_rel_error) <= 0.10, (r.stage, planned, measured)
