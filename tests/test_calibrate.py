"""`meshplan calibrate`: the figure arithmetic on synthetic times, and a quick
real calibration of the 8 fake CPU devices that loads and plans."""
import json
import os
import re
import subprocess
import sys

import jax
import pytest

import meshplan
from meshplan.tools import calibrate as C
from meshplan.cli import main


def test_matmul_and_bandwidth_arithmetic():
    assert C.matmul_flops(1000, 2.0) == pytest.approx(1e9)
    assert C.add_bandwidth(1 << 20, 1e-3) == pytest.approx(3 * (1 << 20) / 1e-3)


def test_fit_line_least_squares():
    a, b = C.fit_line([(0, 1.0), (1, 3.0), (2, 5.0)])
    assert (a, b) == (pytest.approx(1.0), pytest.approx(2.0))
    with pytest.raises(ValueError):
        C.fit_line([(1, 1.0)])
    with pytest.raises(ValueError):
        C.fit_line([(1, 1.0), (1, 2.0)])


@pytest.mark.parametrize("n", [2, 4, 8])
def test_all_reduce_link_recovers_alpha_beta(n):
    alpha, bw = 7e-6, 40e9
    ring = lambda s: 2 * (n - 1) * alpha + 2 * (n - 1) / n * s / bw
    link = C.all_reduce_link([(s, ring(s)) for s in (1e3, 1e5, 1e7)], n)
    assert link.latency_s == pytest.approx(alpha)
    assert link.bandwidth_bytes_per_s == pytest.approx(bw)


def test_all_reduce_link_noise_is_clamped():
    # negative intercept -> zero latency; flat times -> bandwidth from the largest point
    link = C.all_reduce_link([(1e3, 1e-9), (1e4, 1e-5)], 2)
    assert link.latency_s == 0.0 and link.bandwidth_bytes_per_s > 0
    flat = C.all_reduce_link([(1e3, 1e-3), (1e6, 1e-3)], 4)
    assert flat.latency_s == 0.0
    assert flat.bandwidth_bytes_per_s == pytest.approx(2 * 3 / 4 / (1e-3 / 1e6))


def test_fixed_costs_recover_dispatch_and_launch():
    dispatch, launch = 40e-6, 3e-6
    pts = [(k, dispatch + k * launch) for k in (1, 16, 64)]
    assert C.fixed_costs(pts) == (pytest.approx(dispatch), pytest.approx(launch))
    # noise below zero is clamped
    assert C.fixed_costs([(1, 1e-3), (64, 0.5e-3)])[1] == 0.0


def test_dispatch_split_into_fixed_and_per_device():
    # XLA:CPU, 8 fake devices: 18 us on one device, 118 us on all eight
    fixed, per_device = C.split_dispatch(118e-6, 18e-6, 8)
    assert per_device == pytest.approx(100e-6 / 7)
    assert fixed + 8 * per_device == pytest.approx(118e-6)
    assert fixed + per_device == pytest.approx(18e-6)
    # noise: one device slower than all of them -> no per-device part
    assert C.split_dispatch(50e-6, 60e-6, 8) == (50e-6, 0.0)
    # one device far faster than a line through zero allows: the fixed part stays >= 0
    assert C.split_dispatch(80e-6, 0.0, 8) == (pytest.approx(0.0), pytest.approx(10e-6))
    assert C.split_dispatch(80e-6, 5e-6, 1) == (80e-6, 0.0)


def test_shares_compute_threshold():
    assert C.shares_compute(alone_s=1.0, together_s=4.0)        # 8 devices on 2 cores
    assert not C.shares_compute(alone_s=1.0, together_s=1.05)   # own compute each


def test_median_time_and_grow_with_injected_timer():
    times = iter([5.0, 1.0, 3.0, 2.0])
    assert C.median_time(lambda: None, lambda fn: next(times), repeats=3, warmup=1) == 2.0
    made = []

    def make(size):
        made.append(size)
        return lambda: size

    # a timer that says how long a size "takes": 1 ms per unit of size
    size, t = C.grow(make, [1, 2, 4, 8, 16], lambda fn: fn() * 1e-3,
                     C.Options(repeats=3, target_s=4e-3))
    assert (size, t) == (4, pytest.approx(4e-3)) and made == [1, 2, 4]
    with pytest.raises(meshplan.MeshplanError):
        C.median_time(lambda: None, lambda fn: 0.0, repeats=2, warmup=0)


def test_calibrate_with_constant_timer_is_deterministic():
    opts = C.Options.quick()
    cal = C.calibrate(name="fake", options=opts, timer=lambda fn: 1e-3)
    spec = cal.cluster
    n = opts.matmul_max_n        # a constant 1 ms never reaches the target: largest size
    assert dict(spec.device.peak_flops)["float32"] == pytest.approx(2 * n ** 3 / 1e-3)
    # the integer rate: the largest draw's counted operations in 1 ms (under
    # twice the 1 ms dispatch, the whole time is the kernel's)
    assert dict(spec.device.peak_flops)["int32"] == pytest.approx(C.bits_ops(opts.bits_max) / 1e-3)
    assert C.bits_ops(1000) == 1000 * 120
    assert spec.name == "fake" and spec.num_devices == len(jax.devices())
    assert meshplan.parse_cluster(json.loads(spec.to_json())) == spec
    # constant times: no slope, so no kernel cost; the intercept is the dispatch
    a = spec.device.achieved
    assert a.kernel_launch_s == 0.0 and a.program_dispatch_s == pytest.approx(1e-3)
    assert not a.shared_host_compute


def test_calibrate_quick_writes_a_cluster_that_plans(tmp_path, capsys):
    out = tmp_path / "local.json"
    assert main(["calibrate", "--out", str(out), "--quick", "--name", "here"]) == 0
    assert "cluster written to" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["format"] == "meshplan.cluster/1"
    spec = meshplan.load_cluster(out)
    assert spec.name == "here"
    assert (spec.num_hosts, spec.devices_per_host) == (1, 8)
    flops = dict(spec.device.peak_flops)
    assert "float32" in flops
    for dtype, f in flops.items():
        assert 1e6 < f < 1e16, (dtype, f)           # 1 MFLOP/s .. 10 PFLOP/s
    assert 1e6 < spec.device.memory_bandwidth_bytes_per_s < 1e14
    assert spec.device.memory_bytes > 2**20
    intra = spec.intra_host
    assert 1e5 < intra.bandwidth_bytes_per_s < 1e13
    assert 0 <= intra.latency_s < 0.1
    a = spec.device.achieved
    assert 0 <= a.kernel_launch_s < 0.01 and 0 < a.dispatch_s(8) < 0.1
    assert a.program_dispatch_s >= 0 and a.dispatch_per_device_s >= 0
    d = spec.description
    assert re.search(r"\d{4}-\d\d-\d\d", d) and jax.__version__ in d
    assert "int32" in flops
    for word in ("matmul", "x + y", "psum", "memory_bytes", "cpu", "inter_host", "random.bits",
                 "kernel_launch_s", "shared_host_compute"):
        assert word in d, word
    # a plan can be made with it
    assert main(["plan", "--model", "mlp", "--cluster", str(out), "--method", "shard"]) == 0
    assert "Plan for" in capsys.readouterr().out


@pytest.mark.parametrize("where", ["/nonexistent/dir/c.json", "."])
def test_calibrate_bad_out_is_one_line_exit_2(where):
    proc = subprocess.run([sys.executable, "-m", "meshplan.cli", "calibrate", "--out", where],
                          capture_output=True, text=True)
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "--out" in lines[0] or where in lines[0]


def test_kernel_seconds_take_out_the_dispatch_of_long_calls_only():
    assert C.kernel_seconds(1.5e-3, 0.1e-3) == pytest.approx(1.4e-3)
    # a call under twice the dispatch is mostly fixed cost: kept whole
    assert C.kernel_seconds(0.15e-3, 0.1e-3) == pytest.approx(0.15e-3)


def test_a_calibration_that_cannot_trust_its_figures_says_so():
    assert C.unsteady(1e-3, 1.2e-3) is None and C.unsteady(1.2e-3, 1e-3) is None
    w = C.unsteady(1e-3, 2.2e-3)
    assert "1 ms at the start and 2.2 ms at the end" in w and "quiet machine" in w
    assert C.unsteady(2.2e-3, 1e-3) is not None      # (faster at the end: also changed)
    assert C.busy(0.5, 2) is None and C.busy(0.0, 0) is None
    assert "load average 3.00 on 2 CPUs" in C.busy(3.0, 2)


def test_the_matmul_is_timed_again_and_the_faster_kept(monkeypatch):
    # a host that slows down halfway: every later timing of a matmul takes 3x
    calls = []

    def timer(fn):
        calls.append(1)
        return 1e-3 * (3 if len(calls) > 84 else 1)

    monkeypatch.setattr(C, "_host_load", lambda: (0.0, 2))
    cal = C.calibrate(name="fake", options=C.Options.quick(), timer=timer)
    assert len(calls) > 84
    assert any("at the start and" in w for w in cal.warnings), cal.warnings
    assert "Warning: the same float32 matmul" in cal.cluster.description
    n = C.Options.quick().matmul_max_n
    assert dict(cal.cluster.device.peak_flops)["float32"] == pytest.approx(2 * n ** 3 / 1e-3)
    steady = C.calibrate(name="fake", options=C.Options.quick(), timer=lambda fn: 1e-3)
    assert not [w for w in steady.warnings if "at the start" in w]


def test_one_device_measures_the_pipeline_host_time_with_one_stage(tmp_path):
    # a lent GPU is one device: the pipeline's host time is measured on a
    # one-stage plan with micro-batches (the driver runs it as any pipeline)
    out = tmp_path / "one.json"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run([sys.executable, "-m", "meshplan.cli", "calibrate", "--quick", "--out",
                           str(out)], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    spec = meshplan.load_cluster(str(out))
    assert spec.num_devices == 1
    assert spec.device.achieved.pipeline_program_s > 0
    assert "1-stage pipeline over the 1 device(s), 4 micro-batches" in spec.description
    assert "its 9 stage programs" in spec.description


def test_busy_program_is_the_line_through_the_time_added_beside_busy_devices():
    quiet = [(2, 60e-6), (4, 100e-6)]
    a, b = C.busy_program(quiet, [(2, 1.40e-3), (4, 1.60e-3)])
    # added 1.34 and 1.50 ms: 1.18 ms a program + 80 us a device
    assert (a, b) == (pytest.approx(1.18e-3), pytest.approx(80e-6))
    # one count: all of it per program
    assert C.busy_program(quiet[:1], [(2, 1.4e-3)]) == (pytest.approx(1.34e-3), 0.0)
    # noise: less added on more devices -> the mean per program; nothing added -> 0
    assert C.busy_program(quiet, [(2, 1.6e-3), (4, 1.5e-3)]) == (pytest.approx(1.47e-3), 0.0)
    assert C.busy_program(quiet, [(2, 50e-6), (4, 90e-6)]) == (0.0, 0.0)
    # a line below zero at one device: through zero
    a, b = C.busy_program(quiet, [(2, 0.16e-3), (4, 1.1e-3)])
    assert a == 0.0 and b == pytest.approx((0.1e-3 + 1.0e-3) / 6)
