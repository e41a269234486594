"""Gradients summed from several layers' contributions are summed once a step
(meshplan.contributions): the definition, the plan's charge and the run."""
from meshplan.contributions import once_a_step, summing_adds

M = "marker"


def test_a_sum_of_contributions_from_two_layers_moves():
    ops = [("dot_general", [1, 2], [10]),      # 0: the head's contribution (layer 3)
           ("convert_element_type", [10], [11]),   # 1: widened where it is made
           ("scatter-add", [3, 4], [12]),      # 2: the lookup's contribution (layer 0)
           ("add_any", [11, 12], [13]),        # 3: the sum
           (M, [13, 20], [14, 21])]
    assert summing_adds(ops, M) == {3}
    assert once_a_step(ops, [3, 3, 0, 0, 0], M) == ({3}, {11, 12})


def test_contributions_of_one_layer_stay_per_micro_batch():
    ops = [("dot_general", [1, 2], [10]), ("dot_general", [1, 3], [11]),
           ("add_any", [10, 11], [12]), (M, [12], [13])]
    assert once_a_step(ops, [1, 1, 1, 1], M) == (frozenset(), frozenset())


def test_a_tree_of_sums_moves_whole_and_a_shared_sum_does_not():
    # three uses: ((a + b) + c), the inner sum read only by the outer one
    ops = [("mul", [1], [10]), ("mul", [2], [11]), ("mul", [3], [12]),
           ("add_any", [10, 11], [13]), ("add_any", [13, 12], [14]), (M, [14], [15])]
    assert once_a_step(ops, [0, 1, 2, 2, 2, 2], M) == ({3, 4}, {10, 11, 12})
    # a sum something else reads too (not only the gradient) stays
    shared = ops[:5] + [("neg", [14], [16]), (M, [14], [15])]
    assert once_a_step(shared, [0, 1, 2, 2, 2, 2, 2], M) == (frozenset(), frozenset())


def test_a_contribution_no_operator_makes_keeps_the_sum():
    # (an argument added in directly: no layer to sum it in)
    ops = [("mul", [1], [10]), ("add_any", [10, 5], [11]), (M, [11], [12])]
    assert once_a_step(ops, [0, 1, 1], M) == (frozenset(), frozenset())
