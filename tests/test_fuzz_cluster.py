"""Fuzzing the cluster JSON reader with random mutations of the shipped files.

Every input either loads (and then round-trips through its own JSON) or is
refused with :class:`meshplan.ClusterSpecError` -- never any other exception.
Mutations are structural (a key deleted, renamed or added; a value replaced
by random JSON: huge integers, NaN/Infinity, strings, deep nesting, ...) or
textual (bytes flipped, inserted, deleted, the file truncated, invalid UTF-8).

How many examples: a bounded, derandomized number in CI (default 400 per
test).  More, with fresh randomness::

    MESHPLAN_FUZZ_EXAMPLES=5000 pytest tests/test_fuzz_cluster.py

(``MESHPLAN_FUZZ_EXAMPLES`` > the default also turns derandomization off.)
"""
from __future__ import annotations

import json
import math
import os
import pathlib
import tempfile

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import meshplan
from meshplan.cluster import ClusterSpec, load_cluster, parse_cluster

ROOT = pathlib.Path(__file__).resolve().parents[1]
FILES = sorted((ROOT / "examples" / "clusters").glob("*.json"))
CI_EXAMPLES = 400
EXAMPLES = int(os.environ.get("MESHPLAN_FUZZ_EXAMPLES", CI_EXAMPLES))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=EXAMPLES <= CI_EXAMPLES,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
                database=None)

TEXTS = {p.name: p.read_text() for p in FILES}
DATA = {name: json.loads(text) for name, text in TEXTS.items()}

# random JSON values, with the awkward ones weighted in
scalars = st.one_of(
    st.none(), st.booleans(),
    st.integers(), st.integers(min_value=-3, max_value=3),
    st.sampled_from([0, -1, 1, 2**31, 2**63, 10**400, -(10**400)]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -0.0, 1e-320, 1e308, 0.5, 8.0]),
    st.text(max_size=12), st.sampled_from(["", " ", "float32", "bf16", "NaN", "\x00", "8"]),
)
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4),
                            st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12)
awkward = st.sampled_from([0, -1, 2**53 + 1, 10**400, -(10**400), math.nan, math.inf,
                           -math.inf, 1e-320, True, None, "", "1e9", [], {}, [1]])
KEYS = ["format", "name", "num_hosts", "devices_per_host", "num_devices", "device", "links",
        "kind", "memory_bytes", "memory_bandwidth_bytes_per_s", "peak_flops", "intra_host",
        "inter_host", "bandwidth_bytes_per_s", "latency_s", "float32", "bfloat16", "tf32",
        "description", "sources", "torus", "x"]


def _paths(node, prefix=()):
    yield prefix
    if len(prefix) >= 6:
        return
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, prefix + (i,))


def _get(node, path):
    for k in path:
        node = node[k]
    return node


@st.composite
def structural(draw):
    name = draw(st.sampled_from(sorted(DATA)))
    doc = json.loads(json.dumps(DATA[name]))
    for _ in range(draw(st.integers(1, 4))):
        paths = list(_paths(doc))
        path = draw(st.sampled_from(paths))
        op = draw(st.sampled_from(["replace", "delete", "add", "rename", "deep", "scale"]))
        if not path:
            if op == "replace":
                doc = draw(json_values)
            continue
        parent, key = _get(doc, path[:-1]), path[-1]
        if op == "replace":
            parent[key] = draw(awkward | json_values)
        elif op == "delete":
            del parent[key]
        elif op == "add" and isinstance(parent, dict):
            parent[draw(st.sampled_from(KEYS) | st.text(max_size=6))] = draw(json_values)
        elif op == "rename" and isinstance(parent, dict):
            parent[draw(st.sampled_from(KEYS))] = parent.pop(key)
        elif op == "deep":
            value = 1
            for _ in range(draw(st.sampled_from([50, 5000]))):
                value = [value]
            parent[key] = value
        elif op == "scale" and isinstance(parent[key], (int, float)) \
                and not isinstance(parent[key], bool):
            factor = draw(st.sampled_from([-1, 0, 0.5, 1.5, 1e300, 2**64]))
            try:
                parent[key] = parent[key] * factor
            except OverflowError:
                parent[key] = math.inf
    return doc


@st.composite
def textual(draw):
    name = draw(st.sampled_from(sorted(TEXTS)))
    data = bytearray(TEXTS[name].encode())
    for _ in range(draw(st.integers(1, 6))):
        op = draw(st.sampled_from(["flip", "insert", "delete", "truncate", "splice"]))
        i = draw(st.integers(0, max(len(data) - 1, 0)))
        if op == "flip" and data:
            data[i] = draw(st.integers(0, 255))
        elif op == "insert":
            data[i:i] = draw(st.sampled_from([b"[" * 3000, b"{", b"}", b",", b'"', b"\\u0000",
                                              b"NaN", b"-Infinity", b"1e999", b"\xff\xfe",
                                              b"9" * 5000, b'"x": 1,']) | st.binary(max_size=8))
        elif op == "delete":
            del data[i:i + draw(st.integers(1, 40))]
        elif op == "truncate":
            del data[i:]
        elif op == "splice":
            # a value from one key pasted at another place
            j = draw(st.integers(0, max(len(data) - 1, 0)))
            data[j:j] = data[i:i + draw(st.integers(1, 30))]
    return bytes(data)


def _accepts_or_refuses(load) -> ClusterSpec | None:
    try:
        spec = load()
    except meshplan.ClusterSpecError:
        return None
    assert isinstance(spec, ClusterSpec)
    # what loads describes itself and reads back the same
    again = ClusterSpec.from_json(spec.to_json())
    assert again == spec
    assert spec.num_devices == spec.num_hosts * spec.devices_per_host >= 1
    spec.describe()
    str(spec)
    return spec


def test_shipped_files_load_and_round_trip():
    for path in FILES:
        spec = _accepts_or_refuses(lambda: load_cluster(path))
        assert spec is not None, path


@FUZZ
@given(doc=structural())
def test_structural_mutations_load_or_raise_cluster_spec_error(doc):
    _accepts_or_refuses(lambda: parse_cluster(doc))
    # and the same document as JSON text (NaN/Infinity written as JSON allows)
    try:
        text = json.dumps(doc)
    except (ValueError, RecursionError):
        return
    _accepts_or_refuses(lambda: ClusterSpec.from_json(text))


@FUZZ
@given(data=textual())
def test_textual_mutations_load_or_raise_cluster_spec_error(data):
    with tempfile.NamedTemporaryFile("wb", suffix=".json", delete=False) as f:
        f.write(data)
    try:
        _accepts_or_refuses(lambda: load_cluster(f.name))
    finally:
        os.unlink(f.name)


@pytest.mark.parametrize("text, where", [
    ('{"num_hosts": ' + "[" * 100000 + "]" * 100000 + "}", "$"),
    (json.dumps({**{k: v for k, v in DATA["dgx-a100-x1.json"].items() if k != "num_devices"},
                 "num_hosts": 10**400}), "$.num_hosts"),
    ('{"num_hosts": ' + "9" * 5000 + "}", "$"),
    (json.dumps({**DATA["dgx-a100-x1.json"],
                 "device": {**DATA["dgx-a100-x1.json"]["device"],
                            "memory_bandwidth_bytes_per_s": 10**400}}),
     "$.device.memory_bandwidth_bytes_per_s"),
    (json.dumps({**DATA["dgx-a100-x1.json"],
                 "links": {"intra_host": {"bandwidth_bytes_per_s": 1e9, "latency_s": 10**400},
                           "inter_host": {"bandwidth_bytes_per_s": 1e9, "latency_s": 0}}}),
     "$.links.intra_host.latency_s"),
])
def test_found_by_the_fuzzer(text, where):
    """Inputs that once escaped as RecursionError / OverflowError."""
    with pytest.raises(meshplan.ClusterSpecError) as e:
        ClusterSpec.from_json(text)
    assert e.value.path == where
