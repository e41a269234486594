"""benchmarks/gpu_profile.py reads a profiler trace and an HLO module the way
the committed H100 figures were read (no GPU needed)."""
import importlib.util
import pathlib
import statistics

import pytest

BENCH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def gp():
    spec = importlib.util.spec_from_file_location("gpu_profile", BENCH / "gpu_profile.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _trace():
    """Two steps of three kernels on one GPU stream, a derived line that repeats
    them, and host events, as jax.profiler writes them."""
    meta = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "pid": 7, "name": "process_name", "args": {"name": "/host:CPU"}},
            {"ph": "M", "pid": 1, "tid": 14, "name": "thread_name",
             "args": {"name": "Stream #14(Compute)"}},
            {"ph": "M", "pid": 1, "tid": 99, "name": "thread_name", "args": {"name": "XLA Ops"}}]
    kernels = [("nvjet_sm90_tst_128x128", "custom-call.3", 40.0),
               ("loop_add_fusion", "loop_add_fusion", 6.0),
               ("input_reduce_fusion_2", "input_reduce_fusion.2", 4.0)]
    events, ts = [], 0.0
    for _ in range(2):
        for name, op, dur in kernels:
            events.append({"ph": "X", "pid": 1, "tid": 14, "ts": ts, "dur": dur, "name": name,
                           "args": {"hlo_op": op}})
            events.append({"ph": "X", "pid": 1, "tid": 99, "ts": ts, "dur": dur, "name": op})
            ts += dur
        ts += 500.0                       # the host between steps
    events.append({"ph": "X", "pid": 7, "tid": 3, "ts": 0.0, "dur": 9.0, "name": "PjitFunction"})
    return {"traceEvents": meta + events}


HLO = """HloModule jit_train_step
ENTRY %main (p0: bf16[64,32], p1: bf16[32,128]) -> bf16[64,128] {
  %custom-call.3 = (bf16[64,128]{1,0}, s8[1024]{0}) custom-call(%p0, %p1), custom_call_target="__cublas$lt$matmul"
  loop_add_fusion = bf16[64,128]{1,0} fusion(%custom-call.3), kind=kLoop
  ROOT %input_reduce_fusion.2 = f32[64]{0} fusion(loop_add_fusion), kind=kInput
}
"""


def test_kernels_of_a_trace_are_its_stream_lines(gp):
    processes, threads, events = gp.device_events(_trace())
    assert processes == {"1": "/device:GPU:0", "7": "/host:CPU"}
    assert all(e["pid"] == "1" for e in events) and len(events) == 12
    profile = {"threads": threads, "events": events, "profile_steps": 2, "hlo": HLO}
    assert [e["name"] for e in gp.kernels_of(profile)][:3] == [
        "nvjet_sm90_tst_128x128", "loop_add_fusion", "input_reduce_fusion_2"]
    assert gp.result_shapes(HLO)["custom-call.3"] == (64, 128)
    assert gp.result_shapes(HLO)["input_reduce_fusion.2"] == (64,)
    m = gp.measured_side(profile)
    assert m["kernels"] == 3
    assert m["classes"]["matmul"] == pytest.approx([1, 0.040])
    assert m["classes"]["fusion"] == pytest.approx([2, 0.010])
    assert m["busy_ms"] == pytest.approx(0.050)
    assert m["span_ms"] == pytest.approx(0.050)        # the 500 us between steps not in it
    assert m["matmuls"] == {64 * 128: pytest.approx([1, 0.040])}
    # the rest by result size: the element-wise fusion and the reduction apart
    assert m["others"] == {64 * 128: pytest.approx([1, 0.006]),
                           64: pytest.approx([1, 0.004])}


def test_kernel_classes(gp):
    assert gp.kernel_class("gemm_fusion_dot_725") == "matmul"
    assert gp.kernel_class("sm90_xmma_gemm_bf16bf16") == "matmul"
    assert gp.kernel_class("fusion_2078") == "fusion"
    assert gp.kernel_class("triton_softmax") == "fusion"
    assert gp.kernel_class("wrapped_transpose") == "transpose/convert"
    assert gp.kernel_class("Memset ") == "memset/memcpy"


def test_hopper_matmul_rate_is_what_the_committed_h100_profile_gives(gp):
    """datasheets.HOPPER_MATMUL_TFLOPS: the median rate of the h2048 step's
    plain GEMMs in the committed profile."""
    import gzip
    import json
    from meshplan import datasheets
    path = BENCH / "results" / "gpu_profile" / "nocb_profile_gpt-h2048-l8-b8.json.gz"
    with gzip.open(path, "rt") as fp:
        prof = json.load(fp)
    assert prof["device"].startswith("NVIDIA H100")
    rates = gp.plain_gemm_rates(gp.measured_side(prof), gp.model_side(prof))
    assert len(rates) == 6
    assert statistics.median(rates) == pytest.approx(datasheets.HOPPER_MATMUL_TFLOPS, rel=1e-3)
