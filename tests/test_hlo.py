"""Counting collectives in optimized HLO: real CPU programs and hand-written text."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from meshplan.runtime import collective_bytes, parse_collectives
from meshplan.runtime.hlo import dtype_bits, kernel_summary, parse_shape, shape_bytes, summary

F32 = jnp.float32


@pytest.fixture(scope="module")
def mesh() -> Mesh:
    return Mesh(np.array(jax.devices()[:8]), ("x",), axis_types=(AxisType.Auto,))


def _sds(shape, dtype=F32):
    return jax.ShapeDtypeStruct(shape, dtype)


def _compiled_text(fn, *args, in_shardings=None, out_shardings=None) -> str:
    kw = {}
    if in_shardings is not None:
        kw["in_shardings"] = in_shardings
    if out_shardings is not None:
        kw["out_shardings"] = out_shardings
    return jax.jit(fn, **kw).lower(*args).compile().as_text()


def _shard_map(fn, mesh, in_specs, out_specs):
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs)


# ---------------------------------------------------------------------------
# real programs on 8 CPU devices
# ---------------------------------------------------------------------------

def test_all_reduce_of_split_contraction(mesh):
    s = lambda spec: NamedSharding(mesh, spec)  # noqa: E731
    text = _compiled_text(lambda a, b: a @ b, _sds((16, 64)), _sds((64, 32)),
                          in_shardings=(s(P(None, "x")), s(P("x", None))), out_shardings=s(P()))
    colls = parse_collectives(text)
    assert [c.kind for c in colls] == ["all-reduce"]
    assert colls[0].result_bytes == 16 * 32 * 4
    assert colls[0].shapes == ("f32[16,32]",)
    assert colls[0].replica_groups_text  # printed in some form (mesh[...] or {{...}})
    assert collective_bytes(text) == 2048


def test_all_gather_to_replicated(mesh):
    s = lambda spec: NamedSharding(mesh, spec)  # noqa: E731
    text = _compiled_text(lambda a, b: a @ b, _sds((16, 64)), _sds((64, 32)),
                          in_shardings=(s(P("x", None)), s(P())), out_shardings=s(P()))
    assert summary(text) == {"all-gather": (1, 16 * 32 * 4)}


def test_reduce_scatter_from_psum_scatter(mesh):
    fn = _shard_map(lambda x: jax.lax.psum_scatter(x, "x", scatter_dimension=0, tiled=True),
                    mesh, P(None), P("x"))
    text = _compiled_text(fn, _sds((64, 16)))
    colls = parse_collectives(text)
    assert [c.kind for c in colls] == ["reduce-scatter"]
    assert colls[0].result_bytes == 8 * 16 * 4          # one device's slice of the sum
    assert "0,1,2,3,4,5,6,7" in colls[0].replica_groups_text


def test_all_to_all_is_a_long_tuple(mesh):
    fn = _shard_map(lambda x: jax.lax.all_to_all(x, "x", 0, 1, tiled=True),
                    mesh, P("x"), P("x"))
    text = _compiled_text(fn, _sds((64, 64)))
    assert "/*index=5*/" in text                         # XLA CPU prints it as an 8-tuple
    colls = parse_collectives(text)
    assert [c.kind for c in colls] == ["all-to-all"]
    assert len(colls[0].shapes) == 8
    assert "/*" not in colls[0].line
    assert colls[0].result_bytes == 8 * 64 * 4          # the device's [8, 64] block


def test_collective_permute(mesh):
    perm = [(i, (i + 1) % 8) for i in range(8)]
    fn = _shard_map(lambda x: jax.lax.ppermute(x, "x", perm), mesh, P("x"), P("x"))
    colls = parse_collectives(_compiled_text(fn, _sds((64, 64))))
    assert [(c.kind, c.result_bytes) for c in colls] == [("collective-permute", 8 * 64 * 4)]
    assert "{0,1}" in colls[0].replica_groups_text  # the source_target_pairs


def test_tuple_all_reduce_mixed_dtypes(mesh):
    def body(a, b):
        return jax.lax.psum((a, b), "x")
    fn = _shard_map(body, mesh, (P("x"), P("x")), (P(), P()))
    # (XLA CPU reduces bf16 in f32, so the second operand is an integer one.)
    text = _compiled_text(fn, _sds((64, 64)), _sds((16,), jnp.int16))
    colls = parse_collectives(text)
    assert {c.kind for c in colls} == {"all-reduce"}
    # The CPU pipeline may or may not combine the two; the bytes are the same.
    assert collective_bytes(text) == 8 * 64 * 4 + 2 * 2
    if len(colls) == 1:
        assert sorted(colls[0].shapes) == ["f32[8,64]", "s16[2]"]


def test_no_collectives_without_sharding():
    assert parse_collectives(_compiled_text(lambda a: a * 2, _sds((4, 4)))) == []
    assert summary("") == {}


# ---------------------------------------------------------------------------
# hand-written text
# ---------------------------------------------------------------------------

ASYNC_GPU = """\
HloModule jit_step, entry_computation_layout={(f32[8,16]{1,0})->f32[64,16]{1,0}}

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %add = f32[] add(f32[] %x, f32[] %y)
}

ENTRY %main (param.0: f32[8,16], p: f32[1024], p2: f32[8,64]) -> f32[64,16] {
  %param.0 = f32[8,16]{1,0} parameter(0)
  %p = f32[1024]{0} parameter(1)
  %p2 = f32[8,64]{1,0} parameter(2)
  %all-gather-start = (f32[8,16]{1,0}, f32[64,16]{1,0}) all-gather-start(f32[8,16]{1,0} %param.0), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, use_global_device_ids=true
  %all-gather-done = f32[64,16]{1,0} all-gather-done((f32[8,16]{1,0}, f32[64,16]{1,0}) %all-gather-start)
  %all-reduce-start = f32[1024]{0} all-reduce-start(f32[1024]{0} %p), channel_id=2, replica_groups=[2,4]<=[8], to_apply=%add
  %all-reduce-done = f32[1024]{0} all-reduce-done(f32[1024]{0} %all-reduce-start)
  %collective-permute-start = (f32[8,64]{1,0}, f32[8,64]{1,0}, u32[], u32[]) collective-permute-start(f32[8,64]{1,0} %p2), channel_id=3, source_target_pairs={{0,1},{1,0}}
  %collective-permute-done = f32[8,64]{1,0} collective-permute-done((f32[8,64]{1,0}, f32[8,64]{1,0}, u32[], u32[]) %collective-permute-start)
  ROOT %r = f32[64,16]{1,0} copy(%all-gather-done)
}
"""

EXPECTED_ASYNC = {"all-gather": (1, 64 * 16 * 4), "all-reduce": (1, 1024 * 4),
                  "collective-permute": (1, 8 * 64 * 4)}


def test_async_pairs_count_once_at_the_start():
    colls = parse_collectives(ASYNC_GPU)
    assert all(c.is_async for c in colls)
    assert [c.name for c in colls] == ["all-gather-start", "all-reduce-start",
                                       "collective-permute-start"]
    assert summary(ASYNC_GPU) == EXPECTED_ASYNC
    assert [c.replica_groups_text for c in colls] == [
        "{{0,1,2,3,4,5,6,7}}", "[2,4]<=[8]", "{{0,1},{1,0}}"]


def test_async_starts_without_their_done_lines():
    text = "\n".join(l for l in ASYNC_GPU.splitlines() if "-done" not in l)
    assert summary(text) == EXPECTED_ASYNC


def test_combined_and_wrapped_async_starts():
    text = """
  %ag = ((f32[4]{0}, bf16[2,3]{1,0}), (f32[32]{0}, bf16[16,3]{1,0})) all-gather-start(%a, %b), replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
  %rs = ((f32[64]{0}), f32[8]{0}, s32[]) reduce-scatter-start(%c), replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, to_apply=%add
  %rs-done = f32[8]{0} reduce-scatter-done(%rs)
  %a2a = ((s8[16]{0}), s8[16]{0}) all-to-all-start(%d), replica_groups={{0,1}}
  %ar = (f32[3]{0}, f32[5]{0}) all-reduce-start(%e, %f), replica_groups={}, to_apply=%add
"""
    got = {c.name: (c.kind, c.result_bytes) for c in parse_collectives(text)}
    assert got == {"ag": ("all-gather", 32 * 4 + 16 * 3 * 2),
                   "rs": ("reduce-scatter", 8 * 4),
                   "a2a": ("all-to-all", 16),
                   "ar": ("all-reduce", 8 * 4)}


def test_long_tuple_with_index_comments():
    line = ("  ROOT %all-reduce.1 = (f32[8,16]{1,0}, f32[16]{0}, bf16[4]{0}, f16[2]{0}, pred[3]{0}, "
            "/*index=5*/s32[]{:T(128)}, u8[7]{0}, f64[2]{0}, s64[1]{0}, u32[2]{0}, "
            "/*index=10*/f8e4m3fn[8]{0}, f8e5m2[8]{0}) all-reduce(%a, %b, %c, %d, %e, /*index=5*/%f, "
            "%g, %h, %i, %j, /*index=10*/%k, %l), channel_id=7, "
            "replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}, use_global_device_ids=true, to_apply=%add")
    (c,) = parse_collectives(line)
    assert c.kind == "all-reduce" and len(c.shapes) == 12
    assert c.result_bytes == (8 * 16 * 4 + 16 * 4 + 4 * 2 + 2 * 2 + 3 + 4 + 7 + 2 * 8 + 8 + 2 * 4
                              + 8 + 8)
    assert c.replica_groups_text == "mesh['axis_0'=2,'axis_1'=4] {'axis_1'}"
    assert collective_bytes(line) == c.result_bytes


def test_shapes_and_dtypes():
    assert shape_bytes("f32[8,16]{1,0}") == 512
    assert shape_bytes("(f32[8,16]{1,0}, f32[16]{0})") == 576
    assert shape_bytes("((f32[2]{0}), (bf16[2]{0}, s8[3]))") == 8 + 4 + 3
    assert shape_bytes("f32[]") == 4
    assert shape_bytes("f32[<=10,4]{1,0}") == 160       # a dynamic dimension counts its bound
    assert shape_bytes("s4[3]{0:E(4)}") == 2            # packed sub-byte types round up
    for dtype, bits in {"f32": 32, "bf16": 16, "f16": 16, "f64": 64, "s32": 32, "u32": 32,
                        "s8": 8, "u8": 8, "pred": 8, "s64": 64, "u64": 64, "f8e4m3fn": 8,
                        "f8e5m2": 8, "f8e4m3b11fnuz": 8, "f8e5m2fnuz": 8, "c64": 64}.items():
        assert dtype_bits(dtype) == bits, dtype
    with pytest.raises(ValueError):
        parse_shape("q7[3]")


def test_other_instructions_are_ignored():
    text = """
  %all-reduce-like = f32[4]{0} add(%a, %b), metadata={op_name="all-reduce"}
  %fusion = f32[4]{0} fusion(%all-reduce.3), kind=kLoop, calls=%fused
  %gte = f32[4]{0} get-tuple-element(%all-to-all), index=0
"""
    assert parse_collectives(text) == []


def test_a_collective_in_a_loop_body_runs_once_per_trip(mesh):
    # a lax.scan of 5 steps, each summing over the mesh: one all-reduce in
    # the while body, counted once by collective_bytes (DESIGN.md) and 5
    # times a call by collective_bytes_per_call; nested loops multiply
    from meshplan.runtime.hlo import collective_bytes_per_call, summary

    def body(c, _):
        return c + jax.lax.psum(c, "x") * 0.5, None

    def inner(x):
        return jax.lax.scan(body, x, None, length=5)[0]

    def outer(x):
        return jax.lax.scan(lambda c, _: (inner(c), None), x, None, length=3)[0]

    for fn, trips in ((inner, 5), (outer, 15)):
        text = _compiled_text(_shard_map(fn, mesh, P("x"), P("x")), _sds((8, 16)))
        (c,) = parse_collectives(text)
        assert c.kind == "all-reduce" and c.runs == trips
        assert collective_bytes(text) == 16 * 4
        assert collective_bytes_per_call(text) == trips * 16 * 4
        # (tools/verify's per-kind breakdown counts as collective_bytes_per_call)
        assert summary(text) == {"all-reduce": (1, 16 * 4)}
        assert summary(text, per_call=True) == {"all-reduce": (trips, trips * 16 * 4)}


# ---------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------

KERNELS = """\
HloModule jit_step

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %add = f32[] add(f32[] %x, f32[] %y)
}

%fused_dot (a: f32[8,16], b: f32[16,4]) -> f32[8,4] {
  %a = f32[8,16]{1,0} parameter(0)
  %b = f32[16,4]{1,0} parameter(1)
  %d = f32[8,4]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %t = f32[8,4]{1,0} tanh(%d)
}

%fused_sum (a: f32[8,4]) -> f32[8] {
  %a = f32[8,4]{1,0} parameter(0)
  %z = f32[] constant(0)
  ROOT %r = f32[8]{0} reduce(%a, %z), dimensions={1}, to_apply=%add
}

%fused_loop (a: f32[8,4]) -> f32[8,4] {
  %a = f32[8,4]{1,0} parameter(0)
  ROOT %m = f32[8,4]{1,0} multiply(%a, %a)
}

%body (p: (s32[], f32[8,4])) -> (s32[], f32[8,4]) {
  %p = (s32[], f32[8,4]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %v = f32[8,4]{1,0} get-tuple-element(%p), index=1
  %f = f32[8,4]{1,0} fusion(%v), kind=kLoop, calls=%fused_loop
  ROOT %out = (s32[], f32[8,4]{1,0}) tuple(%i, %f)
}

%cond (p: (s32[], f32[8,4])) -> pred[] {
  %p = (s32[], f32[8,4]{1,0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (a: f32[8,16], b: f32[16,4], i: s32[]) -> f32[8] {
  %a = f32[8,16]{1,0} parameter(0)
  %b = f32[16,4]{1,0} parameter(1)
  %i = s32[] parameter(2)
  %dot.1 = f32[8,4]{1,0} fusion(%a, %b), kind=kOutput, calls=%fused_dot
  %ar = f32[8,4]{1,0} all-reduce(%dot.1), channel_id=1, replica_groups={{0,1}}, to_apply=%add
  %loop = f32[8,4]{1,0} fusion(%ar), kind=kLoop, calls=%fused_loop
  %init = (s32[], f32[8,4]{1,0}) tuple(%i, %loop)
  %w = (s32[], f32[8,4]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %v = f32[8,4]{1,0} get-tuple-element(%w), index=1
  %c = f32[8,4]{1,0} copy(%v)
  ROOT %s = f32[8]{0} fusion(%c), kind=kInput, calls=%fused_sum
}
"""


def test_kernel_summary_of_hand_written_text():
    # kernels by what their fused computation holds; the while body's fusion
    # once per trip; the reduce's adder, tuples, parameters and the fused
    # computations' own instructions are no kernels
    assert kernel_summary(KERNELS) == {
        "matmul": (1, 8 * 4 * 4),
        "reduction": (1, 8 * 4),
        "loop": (1 + 3 + 1, 5 * 8 * 4 * 4),        # the fusion, 3 trips of the body's, the copy
        "collective": (1, 8 * 4 * 4)}
    assert kernel_summary("") == {}
    gemm = ('  %g = (f32[8,4]{1,0}, s8[64]{0}) custom-call(%a, %b), '
            'custom_call_target="__cublas$gemm"')
    assert kernel_summary(gemm) == {"matmul": (1, 8 * 4 * 4 + 64)}
    # a plain call's body runs its kernels (its to_apply is no reducer)
    called = KERNELS.replace("  %c = f32[8,4]{1,0} copy(%v)",
                             "  %c = f32[8,4]{1,0} call(%v), to_apply=%body_of_call")
    called = called.replace("ENTRY", """%body_of_call (a: f32[8,4]) -> f32[8,4] {
  %a = f32[8,4]{1,0} parameter(0)
  ROOT %n = f32[8,4]{1,0} negate(%a)
}

ENTRY""")
    assert kernel_summary(called) == kernel_summary(KERNELS)     # negate in place of the copy


def test_kernel_summary_of_a_compiled_program():
    def step(x, w):
        h = jnp.tanh(x @ w)
        return (h * h).sum(axis=1)
    got = kernel_summary(_compiled_text(step, _sds((32, 64)), _sds((64, 16))))
    assert got["matmul"][0] >= 1 and got["reduction"][0] >= 1
    assert "collective" not in got
    assert got["reduction"][1] == 32 * 4          # the sum's result is the program's
