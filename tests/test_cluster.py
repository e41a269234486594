"""ClusterSpec: the cluster JSON format, the shipped examples, local()."""
from __future__ import annotations

import ast
import copy
import dataclasses
import importlib.util
import json
import math
import pathlib

import jax
import numpy as np
import pytest

from meshplan.cluster import (CLUSTER_FORMAT, ClusterSpec, DeviceSpec, LinkSpec, load_cluster,
                              parse_cluster)
from meshplan.errors import ClusterSpecError, MeshplanError

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples" / "clusters"

EXPECTED_NAMES = (
    [f"aws-p3.16xlarge-x{n}" for n in (1, 2, 4, 8)]
    + [f"dgx-a100-x{n}" for n in (1, 2, 4, 8, 16, 32, 64, 128, 192, 256, 384)]
    + [f"dgx-h100-x{n}" for n in (1, 8, 64)]
)
EXAMPLE_FILES = sorted(EXAMPLES.glob("*.json"))


def valid() -> dict:
    return {
        "format": CLUSTER_FORMAT,
        "name": "test-cluster",
        "description": "two hosts of four devices",
        "sources": ["made up for a test"],
        "num_hosts": 2,
        "devices_per_host": 4,
        "num_devices": 8,
        "device": {
            "kind": "TestGPU",
            "memory_bytes": 16 * 2**30,
            "memory_bandwidth_bytes_per_s": 1e12,
            "peak_flops": {"bfloat16": 1e14, "float32": 1e13},
        },
        "links": {
            "intra_host": {"bandwidth_bytes_per_s": 1e11, "latency_s": 5e-6},
            "inter_host": {"bandwidth_bytes_per_s": 2.5e10, "latency_s": 1e-5},
        },
    }


# -- the shipped examples -------------------------------------------------------

def test_every_expected_example_exists():
    names = {p.stem for p in EXAMPLE_FILES}
    missing = [n for n in EXPECTED_NAMES if n not in names]
    assert not missing, f"missing example clusters: {missing}"


@pytest.mark.parametrize("path", EXAMPLE_FILES, ids=lambda p: p.stem)
def test_example_loads_and_round_trips(path):
    spec = load_cluster(path)
    assert spec.name == path.stem
    assert ClusterSpec.from_dict(spec.to_dict()) == spec
    assert ClusterSpec.from_json(spec.to_json()) == spec
    data = json.loads(path.read_text())
    assert data["num_devices"] == spec.num_hosts * spec.devices_per_host == spec.num_devices
    assert spec.num_hosts == int(path.stem.rsplit("-x", 1)[1])
    assert spec.devices_per_host == 8
    d = spec.device
    assert d.memory_bytes > 0 and d.memory_bandwidth_bytes_per_s > 0
    assert d.peak_flops and all(v > 0 and math.isfinite(v) for _, v in d.peak_flops)
    for link in (spec.intra_host, spec.inter_host):
        assert link.bandwidth_bytes_per_s > 0 and link.latency_s > 0
    # Documented: a description saying latencies are estimates, and cited sources.
    assert "estimate" in spec.description
    assert len(spec.sources) >= 2
    # A 16-bit matmul is never slower than float32 on these GPUs.
    assert d.flops_for("float16") >= d.flops_for("float32")


def test_example_figures_match_the_datasheets():
    p3 = load_cluster(EXAMPLES / "aws-p3.16xlarge-x8.json")
    assert p3.num_devices == 64
    assert p3.device.flops_for("float16") == 125e12
    assert p3.device.flops_for("float32") == 15.7e12
    assert p3.intra_host.bandwidth_bytes_per_s == 150e9
    assert p3.inter_host.bandwidth_bytes_per_s == 3.125e9
    a100 = load_cluster(EXAMPLES / "dgx-a100-x384.json")
    assert a100.num_devices == 3072
    assert a100.device.flops_for("bfloat16") == 312e12
    assert a100.device.memory_bytes == 80 * 2**30
    assert a100.intra_host.bandwidth_bytes_per_s == 300e9
    assert a100.inter_host.bandwidth_bytes_per_s == 200e9
    h100 = load_cluster(EXAMPLES / "dgx-h100-x64.json")
    assert h100.device.flops_for("bfloat16") == pytest.approx(989e12, rel=1e-3)
    assert h100.intra_host.bandwidth_bytes_per_s == 450e9
    assert h100.inter_host.bandwidth_bytes_per_s == 400e9


def test_examples_are_what_generate_py_writes():
    spec = importlib.util.spec_from_file_location("_cluster_generate", EXAMPLES / "generate.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert set(gen.build_all()) == {p.name for p in EXAMPLE_FILES}
    assert gen.main(["--check"]) == 0


# -- the catalogue of bad clusters ------------------------------------------------

def _set(path: str, value):
    """A mutation that sets a dotted path ('device.peak_flops.float32') to value."""
    def apply(d):
        *parents, last = path.split(".")
        for p in parents:
            d = d[p]
        d[last] = value
    return apply


def _delete(path: str):
    def apply(d):
        *parents, last = path.split(".")
        for p in parents:
            d = d[p]
        del d[last]
    return apply


BAD = [
    # (id, mutation, JSON path expected in the message, another expected fragment)
    ("unknown-top-key", _set("nmae", "x"), "$.nmae", "unknown key"),
    ("unknown-device-key", _set("device.memory_gb", 16), "$.device.memory_gb", "memory_bytes"),
    ("unknown-link-key", _set("links.inter_host.bandwith", 1e9),
     "$.links.inter_host.bandwith", "did you mean 'bandwidth_bytes_per_s'"),
    ("unknown-link-level", _set("links.torus", {}), "$.links.torus", "unknown key"),
    ("missing-num-hosts", _delete("num_hosts"), "$.num_hosts", "missing"),
    ("missing-memory", _delete("device.memory_bytes"), "$.device.memory_bytes", "missing"),
    ("missing-latency", _delete("links.intra_host.latency_s"),
     "$.links.intra_host.latency_s", "missing"),
    ("missing-inter-host", _delete("links.inter_host"), "$.links.inter_host", "missing"),
    ("missing-format", _delete("format"), "$.format", CLUSTER_FORMAT),
    ("string-for-number", _set("device.peak_flops.bfloat16", "312e12"),
     "$.device.peak_flops.bfloat16", "a string"),
    ("string-for-count", _set("num_hosts", "2"), "$.num_hosts", "positive integer"),
    ("bool-for-int", _set("num_hosts", True), "$.num_hosts", "boolean"),
    ("bool-for-number", _set("links.intra_host.latency_s", False),
     "$.links.intra_host.latency_s", "boolean"),
    ("float-for-count", _set("devices_per_host", 4.0), "$.devices_per_host", "integer"),
    ("float-for-memory", _set("device.memory_bytes", 1.6e10), "$.device.memory_bytes",
     "integer"),
    ("zero-hosts", _set("num_hosts", 0), "$.num_hosts", "got 0"),
    ("negative-devices", _set("devices_per_host", -4), "$.devices_per_host", "got -4"),
    ("zero-bandwidth", _set("links.inter_host.bandwidth_bytes_per_s", 0),
     "$.links.inter_host.bandwidth_bytes_per_s", "positive"),
    ("negative-flops", _set("device.peak_flops.float32", -3), "$.device.peak_flops.float32",
     "must be a positive number, got -3"),
    ("negative-latency", _set("links.intra_host.latency_s", -1e-6),
     "$.links.intra_host.latency_s", "non-negative"),
    ("zero-memory", _set("device.memory_bytes", 0), "$.device.memory_bytes", "positive"),
    ("nan-bandwidth", _set("device.memory_bandwidth_bytes_per_s", float("nan")),
     "$.device.memory_bandwidth_bytes_per_s", "NaN"),
    ("inf-flops", _set("device.peak_flops.bfloat16", float("inf")),
     "$.device.peak_flops.bfloat16", "Infinity"),
    ("inconsistent-num-devices", _set("num_devices", 16), "$.num_devices", "2 x 4 = 8"),
    ("wrong-format", _set("format", "meshplan.cluster/2"), "$.format", CLUSTER_FORMAT),
    ("plan-format", _set("format", "meshplan.plan/1"), "$.format", CLUSTER_FORMAT),
    ("empty-peak-flops", _set("device.peak_flops", {}), "$.device.peak_flops", "empty"),
    ("peak-flops-not-object", _set("device.peak_flops", [1e13]), "$.device.peak_flops",
     "a list"),
    ("dtype-alias", _set("device.peak_flops.bf16", 1e14), "$.device.peak_flops.bf16",
     "'bfloat16'"),
    ("unknown-dtype", _set("device.peak_flops.float128", 1e12),
     "$.device.peak_flops.float128", "unknown dtype"),
    ("device-not-object", _set("device", "A100"), "$.device", "JSON object"),
    ("null-kind", _set("device.kind", None), "$.device.kind", "null"),
    ("empty-name", _set("name", ""), "$.name", "non-empty"),
    ("sources-not-list", _set("sources", "a paper"), "$.sources", "list of strings"),
    ("source-not-string", _set("sources", ["a paper", 3]), "$.sources[1]", "string"),
    ("description-not-string", _set("description", 1), "$.description", "string"),
]


@pytest.mark.parametrize("mutate,path,fragment", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_cluster_dict_is_refused(mutate, path, fragment):
    data = valid()
    mutate(data)
    with pytest.raises(ClusterSpecError) as info:
        parse_cluster(data)
    err = info.value
    assert isinstance(err, ValueError) and isinstance(err, MeshplanError)
    assert err.path == path
    assert path in str(err)
    assert fragment in str(err)


def test_top_level_must_be_an_object():
    with pytest.raises(ClusterSpecError, match=r"\$: must be a JSON object"):
        parse_cluster([valid()])


def test_valid_dict_parses_and_ints_become_floats():
    data = valid()
    data["links"]["intra_host"]["bandwidth_bytes_per_s"] = 100_000_000_000  # an int
    del data["num_devices"], data["description"], data["sources"]           # optional
    spec = parse_cluster(data)
    assert spec.intra_host.bandwidth_bytes_per_s == 1e11
    assert isinstance(spec.intra_host.bandwidth_bytes_per_s, float)
    assert spec.num_devices == 8 and spec.sources == () and spec.description == ""
    assert parse_cluster(spec.to_dict()) == spec


def test_zero_latency_is_allowed():
    data = valid()
    data["links"]["intra_host"]["latency_s"] = 0
    assert parse_cluster(data).intra_host.latency_s == 0.0


def _write(tmp_path, text: str) -> pathlib.Path:
    path = tmp_path / "cluster.json"
    path.write_text(text)
    return path


def test_invalid_json_syntax_names_line_and_column(tmp_path):
    text = json.dumps(valid(), indent=2).replace('"num_hosts": 2,', '"num_hosts": 2,,')
    path = _write(tmp_path, text)
    with pytest.raises(ClusterSpecError) as info:
        load_cluster(path)
    assert info.value.path == "$"
    line = next(i for i, s in enumerate(text.splitlines(), 1) if ",," in s)
    assert f"line {line}" in str(info.value) and "column" in str(info.value)
    assert str(path) in str(info.value)


def test_missing_file(tmp_path):
    with pytest.raises(ClusterSpecError) as info:
        load_cluster(tmp_path / "nope.json")
    assert info.value.path == "$" and "does not exist" in str(info.value)
    assert isinstance(info.value, ValueError)


def test_duplicate_key_in_file(tmp_path):
    text = json.dumps(valid()).replace('"num_hosts": 2,', '"num_hosts": 2, "num_hosts": 3,')
    with pytest.raises(ClusterSpecError, match="appears twice"):
        load_cluster(_write(tmp_path, text))


def test_nan_literal_in_file(tmp_path):
    text = json.dumps(valid()).replace('"latency_s": 1e-05', '"latency_s": NaN')
    with pytest.raises(ClusterSpecError) as info:
        load_cluster(_write(tmp_path, text))
    assert info.value.path == "$.links.inter_host.latency_s"


def test_file_errors_name_the_file(tmp_path):
    data = valid()
    data["num_hosts"] = -1
    path = _write(tmp_path, json.dumps(data))
    with pytest.raises(ClusterSpecError) as info:
        load_cluster(path)
    assert "$.num_hosts" in str(info.value) and str(path) in str(info.value)


# -- DeviceSpec.flops_for ---------------------------------------------------------

def _device(**tflops) -> DeviceSpec:
    return DeviceSpec(kind="x", memory_bytes=2**30, memory_bandwidth_bytes_per_s=1e11,
                      peak_flops={k: v * 1e12 for k, v in tflops.items()})


def test_flops_for_exact_and_dtype_objects():
    d = _device(bfloat16=300, float32=20, int8=600)
    assert d.flops_for("bfloat16") == 300e12
    assert d.flops_for(jax.numpy.bfloat16) == 300e12
    assert d.flops_for(np.dtype("float32")) == 20e12
    assert d.flops_for(np.int8) == 600e12
    assert d.flops_for("bf16") == 300e12


def test_flops_for_fallbacks():
    only_bf16 = _device(bfloat16=300, float32=20)
    assert only_bf16.flops_for("float16") == 300e12
    assert _device(float16=125, float32=15).flops_for("bfloat16") == 125e12
    assert only_bf16.flops_for("float64") == 10e12              # half of float32
    assert only_bf16.flops_for("tfloat32") == 20e12             # float32 figure
    assert only_bf16.flops_for("int8") == 20e12                 # integers -> float32
    assert only_bf16.flops_for("int32") == 20e12
    assert only_bf16.flops_for("bool") == 20e12
    assert only_bf16.flops_for("no-such-dtype") == 20e12
    assert only_bf16.flops_for("float8_e4m3fn") == 300e12       # float8 -> 16-bit
    assert _device(float8_e4m3fn=2000, float32=60).flops_for("float8_e5m2") == 2000e12
    assert _device(float64=7, float32=15).flops_for("float64") == 7e12
    # float32 absent: the smallest figure given stands in (conservative).
    assert _device(bfloat16=275, int8=550).flops_for("float32") == 275e12


def test_device_spec_normalises_peak_flops():
    d = _device(float32=1, bfloat16=2)
    assert d.peak_flops == (("bfloat16", 2e12), ("float32", 1e12))
    assert d == _device(bfloat16=2, float32=1)
    hash(d)


# -- derived specs, printing, immutability -------------------------------------------

def test_with_devices():
    spec = load_cluster(EXAMPLES / "dgx-a100-x4.json")
    sub = spec.with_devices(2, 4)
    assert (sub.num_hosts, sub.devices_per_host, sub.num_devices) == (2, 4, 8)
    assert sub.device == spec.device and sub.inter_host == spec.inter_host
    assert parse_cluster(sub.to_dict()) == sub
    assert spec.with_devices(4, 8) is spec
    with pytest.raises(ClusterSpecError, match=r"\$\.num_hosts"):
        spec.with_devices(5, 8)
    with pytest.raises(ClusterSpecError, match=r"\$\.devices_per_host"):
        spec.with_devices(1, 0)


def test_describe_is_readable():
    spec = load_cluster(EXAMPLES / "dgx-a100-x2.json")
    text = spec.describe()
    assert str(spec) == text
    for fragment in ("dgx-a100-x2", "2 host(s) x 8 device(s) = 16 devices", "A100-SXM4-80GB",
                     "80.0 GiB", "bfloat16 312", "float32 19.5", "300 GB/s", "5 us",
                     "200 GB/s", "5 us", "sources", "Megatron-LM"):
        assert fragment in text, fragment
    assert len(text.splitlines()) >= 6


def test_specs_are_frozen():
    spec = parse_cluster(valid())
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.num_hosts = 3
    assert isinstance(spec.sources, tuple) and isinstance(spec.device.peak_flops, tuple)
    assert {spec: 1}[parse_cluster(valid())] == 1
    assert spec.shape == (2, 4)
    assert spec.inter_host_bandwidth_per_device == pytest.approx(2.5e10 / 4)
    assert spec.intra_host == LinkSpec(1e11, 5e-6)


# -- ClusterSpec.local --------------------------------------------------------------

def test_local_matches_jax_devices():
    spec = ClusterSpec.local()
    devices = jax.devices()
    assert spec.num_devices == len(devices)
    assert spec.num_hosts == jax.process_count()
    assert spec.devices_per_host == jax.local_device_count()
    assert spec.device.kind == devices[0].device_kind
    assert spec.device.memory_bytes > 0
    assert spec.device.flops_for("float32") > 0
    assert parse_cluster(spec.to_dict()) == spec
    assert spec.name in spec.describe()


class _FakeDevice:
    def __init__(self, kind, platform="gpu", stats=None):
        self.device_kind, self.platform, self._stats = kind, platform, stats

    def memory_stats(self):
        return self._stats


@pytest.mark.parametrize("kind,dtype,flops,intra_bw,memory", [
    ("NVIDIA H100 80GB HBM3", "bfloat16", 989.4e12, 450e9, 80 * 2**30),
    ("NVIDIA H100 PCIe", "bfloat16", 756e12, 64e9, 80 * 2**30),
    ("NVIDIA H200", "float8_e4m3fn", 1978.9e12, 450e9, 141 * 10**9),
    ("NVIDIA A100-SXM4-40GB", "tfloat32", 156e12, 300e9, 40 * 2**30),
    ("NVIDIA A100-SXM4-80GB", "bfloat16", 312e12, 300e9, 80 * 2**30),
    ("Tesla V100-SXM2-32GB", "float16", 125e12, 150e9, 32 * 2**30),
    ("Tesla V100-PCIE-16GB", "float32", 14e12, 16e9, 16 * 2**30),
    ("Tesla T4", "float16", 65e12, 16e9, 16 * 2**30),
    ("NVIDIA L4", "bfloat16", 121e12, 32e9, 24 * 2**30),
])
def test_local_uses_the_datasheet_table_for_gpus(monkeypatch, kind, dtype, flops, intra_bw,
                                                  memory):
    devs = [_FakeDevice(kind) for _ in range(4)]
    monkeypatch.setattr(jax, "devices", lambda *a: devs)
    monkeypatch.setattr(jax, "local_devices", lambda *a, **k: devs)
    monkeypatch.setattr(jax, "process_count", lambda *a: 1)
    monkeypatch.setattr(jax, "local_device_count", lambda *a: 4)
    spec = ClusterSpec.local()
    assert spec.name == "local-gpu-1x4" and spec.device.kind == kind
    assert spec.device.flops_for(dtype) == pytest.approx(flops)
    assert spec.intra_host.bandwidth_bytes_per_s == intra_bw
    assert spec.device.memory_bytes == memory          # no memory_stats: nominal figure
    devs[0]._stats = {"bytes_limit": 60 * 2**30}
    assert ClusterSpec.local().device.memory_bytes == 60 * 2**30


def test_local_unknown_gpu_warns_and_still_builds(monkeypatch):
    devs = [_FakeDevice("NVIDIA Imaginary X9", stats={"bytes_limit": 2**34})] * 2
    monkeypatch.setattr(jax, "devices", lambda *a: devs)
    monkeypatch.setattr(jax, "local_devices", lambda *a, **k: devs)
    monkeypatch.setattr(jax, "process_count", lambda *a: 1)
    monkeypatch.setattr(jax, "local_device_count", lambda *a: 2)
    with pytest.warns(UserWarning, match="Imaginary X9"):
        spec = ClusterSpec.local()
    assert spec.device.memory_bytes == 2**34 and spec.device.flops_for("float32") > 0
    assert parse_cluster(spec.to_dict()) == spec


# -- layering -----------------------------------------------------------------------

@pytest.mark.parametrize("module", ["cluster", "tpu"])
def test_cluster_module_imports_only_errors_and_jax_lazily(module):
    # (tpu.py holds the TPU slices of a cluster file; it too needs only errors)
    tree = ast.parse((ROOT / "planner" / f"{module}.py").read_text())
    for node in tree.body:  # module level
        if isinstance(node, ast.ImportFrom) and node.level:
            assert node.module == "errors" or (module, node.module, node.names[0].name) == \
                ("cluster", None, "tpu"), ast.dump(node)
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module] if isinstance(node, ast.ImportFrom) else [])
        assert not any(n and (n.startswith("jax") or n.startswith("meshplan")) for n in names)
    relative = [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level]
    assert all(n.module == "errors" or n.names[0].name == "tpu" for n in relative)


def test_parsing_does_not_mutate_its_input():
    data = valid()
    before = copy.deepcopy(data)
    parse_cluster(data)
    assert data == before  # parsing never mutates its input
