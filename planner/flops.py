"""FLOP counts per primitive: a rule table, like jax's own rule registries.

A rule takes the input shapes, output shapes and the (raw) params of one
equation and returns its floating-point operations.  Primitives in
:data:`PER_ELEMENT` cost one FLOP per output element, those in
:data:`DATA_MOVEMENT` cost none; a primitive found in no table gets the
elementwise estimate and the tracer records a warning.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Sequence

from .graph import IDENTITY_MARKERS

Shape = tuple[int, ...]
FlopRule = Callable[[Sequence[Shape], Sequence[Shape], dict[str, Any]], float]

# The one definition of the element-wise primitives: one output, of the
# operands' shape, element by element (the ILP gives them one layout rule,
# the scan unrolling runs them layer piece by layer piece).
ELEMENTWISE = frozenset("""
abs acos acosh add add_any and asin asinh atan atan2 atanh cbrt ceil clamp
complex conj convert_element_type copy copy_p cos cosh digamma div eq erf erf_inv
erfc exp exp2 expm1 floor ge gt igamma igammac imag integer_pow is_finite le lgamma
log log1p logistic lt max min mul ne neg nextafter not or polygamma pow real
reduce_precision regularized_incomplete_beta rem round rsqrt select_n sign sin
sinh sqrt square sub tan tanh xor shift_left shift_right_logical
shift_right_arithmetic population_count clz stop_gradient
bessel_i0e bessel_i1e zeta one_minus_square
""".split())
# Random bits and keys: one operation per element, but random_bits costs its
# generator's integer work (below); the ILP splits random_bits where the
# draw is partitionable and replicates the key operations.
RANDOM = frozenset("""
random_bits random_seed random_wrap random_unwrap random_fold_in random_split threefry2x32
random_clone
""".split())
# An identity over any number of operands that XLA may not move code across.
BARRIERS = frozenset({"optimization_barrier"})
# What costs one FLOP per output element and fuses into its neighbours.
PER_ELEMENT = ELEMENTWISE | RANDOM | BARRIERS

REDUCTIONS = frozenset("""
reduce_sum reduce_max reduce_min reduce_prod reduce_and reduce_or reduce_xor
argmax argmin cumsum cumprod cummax cummin cumlogsumexp reduce_precision_sum
""".split())

DATA_MOVEMENT = frozenset("""
reshape transpose broadcast_in_dim squeeze expand_dims slice dynamic_slice
dynamic_update_slice concatenate pad gather rev iota select_and_gather_add
copy device_put sharding_constraint stack unstack split convert_layout
mesh_cast reshard pvary psum_invariant axis_index empty empty2 full_like name platform_index
tile
""".split()) | IDENTITY_MARKERS

# Host callbacks with no outputs (jax.debug.callback, jax.debug.print): the
# values they read cross to the host; no device work.
HOST_CALLBACKS = frozenset({"debug_callback", "debug_print"})

# Gather/scatter variants move data and may add.
SCATTERS = frozenset("scatter scatter-add scatter_add scatter_mul scatter_min scatter_max".split())

SORTS = frozenset("sort top_k approx_top_k".split())


def sorted_axis(params: Mapping[str, Any], rank: int) -> int:
    """The dimension a sort or top-k orders (each names it its own way; the
    last by default), counted from 0."""
    d = next((params[k] for k in ("dimension", "axis", "reduction_dimension")
              if params.get(k) is not None), -1)
    return d % rank if rank else 0


def _size(shape: Shape) -> int:
    return math.prod(shape)


def dot_general_flops(ins: Sequence[Shape], outs: Sequence[Shape], params: dict) -> float:
    (lhs_contract, _rhs_contract), _batch = params["dimension_numbers"]
    contract = math.prod(ins[0][d] for d in lhs_contract)
    return 2.0 * _size(outs[0]) * contract


def conv_flops(ins: Sequence[Shape], outs: Sequence[Shape], params: dict) -> float:
    rhs = ins[1]
    dn = params.get("dimension_numbers")
    out_feature_dim = dn.rhs_spec[0] if dn is not None else 0
    per_output = _size(rhs) / max(rhs[out_feature_dim], 1)
    return 2.0 * _size(outs[0]) * per_output


# Integer operations a key's generator spends, counted from the algorithms
# (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11).
# Threefry-2x32, JAX's default, makes two 32-bit words a call: 20 rounds of
# add, rotate (two shifts and an or) and xor, 5 key injections of 2 adds, and
# the counter words, about 120 operations.  Drawn partitionably (JAX's default,
# each element's counter its index) every element takes a whole call, its two
# words xored; otherwise each call gives two words of the draw.  Philox-4x32-10
# (XLA's RngBitGenerator, under JAX's "rbg" keys) makes four words with 10
# rounds of two 32x32 -> 64-bit products (high and low halves), xors and the
# key bump, about 120 operations too: 30 a word.  They run on the integer
# units, the device's int32 rate (meshplan.cluster.DeviceSpec.flops_for).
THREEFRY_CALL_OPS = 120.0
PHILOX_OPS_PER_WORD = 30.0


def random_bits_flops(ins, outs, params) -> float:
    """The generator's integer operations for one draw."""
    n = _size(outs[0])
    words = n * max(int(params.get("bit_width", 32)), 32) / 32
    if params.get("generator", "threefry2x32") != "threefry2x32":
        return words * PHILOX_OPS_PER_WORD
    calls = n if params.get("partitionable", True) else math.ceil(words / 2)
    return calls * THREEFRY_CALL_OPS


def elementwise_flops(ins, outs, params) -> float:
    return float(sum(_size(s) for s in outs))


def reduction_flops(ins, outs, params) -> float:
    return float(sum(_size(s) for s in ins))


def no_flops(ins, outs, params) -> float:
    return 0.0


def sort_flops(ins, outs, params) -> float:
    n = _size(ins[0]) if ins else 0
    k = ins[0][sorted_axis(params, len(ins[0]))] if ins and ins[0] else 1
    return float(n * max(math.log2(max(k, 2)), 1.0))


def fft_axes(params: Mapping[str, Any], rank: int) -> range:
    """The trailing dimensions an ``fft`` transforms (one per fft length)."""
    return range(rank - len(params["fft_lengths"]), rank)


def fft_flops(ins, outs, params) -> float:
    """5 n log2 n per complex transform of n points (Cooley-Tukey's count);
    a real one (RFFT, IRFFT) half that."""
    n = math.prod(params["fft_lengths"])
    transforms = math.prod(ins[0][:len(ins[0]) - len(params["fft_lengths"])])
    kind = params.get("fft_type", "")
    real = "RFFT" in str(getattr(kind, "name", kind))
    return float(5 * n * math.log2(max(n, 2)) * transforms * (0.5 if real else 1.0))


# window ops: pooling and max pooling's transposes
WINDOWED = frozenset({"reduce_window_sum", "reduce_window_max", "reduce_window_min",
                      "reduce_window", "select_and_scatter_add", "select_and_gather_add"})


def window_free_dims(params: Mapping[str, Any], rank: int) -> list[int]:
    """Dimensions a window op leaves alone: window 1, stride 1, no padding or
    dilation; split there, each device pools its own slice."""
    ones = (1,) * rank
    win = tuple(params["window_dimensions"])
    stride = tuple(params.get("window_strides") or ones)
    pad = tuple(tuple(p) for p in (params.get("padding") or ((0, 0),) * rank))
    base = tuple(params.get("base_dilation") or ones)
    return [d for d in range(rank)
            if win[d] == 1 and stride[d] == 1 and pad[d] == (0, 0) and base[d] == 1]


FLOP_RULES: dict[str, FlopRule] = {
    "dot_general": dot_general_flops,
    "conv_general_dilated": conv_flops,
    **{p: elementwise_flops for p in PER_ELEMENT},
    "random_bits": random_bits_flops,
    **{p: reduction_flops for p in REDUCTIONS},
    **{p: no_flops for p in DATA_MOVEMENT | HOST_CALLBACKS},
    **{p: elementwise_flops for p in SCATTERS},
    **{p: sort_flops for p in SORTS},
    "reduce_window_sum": reduction_flops,
    "reduce_window_max": reduction_flops,
    "reduce_window": reduction_flops,
    "select_and_scatter_add": reduction_flops,
    "logsumexp": reduction_flops,
    "fft": fft_flops,
    # a reinterpretation of bits (random draws become floats this way); it
    # may change the shape when the widths differ, so it is not ELEMENTWISE
    "bitcast_convert_type": no_flops,
}


def is_known(primitive: str) -> bool:
    return primitive in FLOP_RULES


def flops_of(primitive: str, ins: Sequence[Shape], outs: Sequence[Shape],
             params: dict) -> float:
    """FLOPs of one equation; unknown primitives cost one FLOP per output element."""
    rule = FLOP_RULES.get(primitive, elementwise_flops)
    return float(rule(ins, outs, params))
