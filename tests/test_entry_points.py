"""Entry points give one clear line (or work) on the inputs users get wrong."""
import sys

import jax
import jax.numpy as jnp
import pytest

import meshplan
from meshplan.cli import main

DGX = "examples/clusters/dgx-a100-x1.json"

MOD = '''
import jax, jax.numpy as jnp
def step(s, b):
    return s - 0.1 * jnp.mean(b) * s, jnp.mean(b)
S = jax.ShapeDtypeStruct((8, 8), jnp.float32)
B = jax.ShapeDtypeStruct((16, 8), jnp.float32)
def args_not_a_tuple():
    return (step, S)                 # example_args should be (S, B)
def bad_argnums():
    return (step, (S, B), "one")
def int_argnums():
    return (step, (S, B), 1)
'''


@pytest.fixture
def entrymod(tmp_path, monkeypatch):
    (tmp_path / "entry_mod.py").write_text(MOD)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("entry_mod", None)


def _run(argv, capsys):
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("argv, needle", [
    (["plan", "--fn", "entry_mod:args_not_a_tuple", "--cluster", DGX], "example_args a tuple"),
    (["plan", "--fn", "entry_mod:bad_argnums", "--cluster", DGX], "batch_argnums must be"),
    (["plan", "--model", "mlp", "--cluster", DGX, "--method", "auto", "--dp", "2"], "--dp"),
    (["plan", "--model", "mlp", "--cluster", DGX, "--method", "shard", "--micro-batches", "2"],
     "--micro-batches"),
    (["plan", "--model", "mlp", "--cluster", DGX, "--method", "data", "--schedule", "gpipe"],
     "--schedule"),
    (["plan", "--model", "mlp", "--cluster", DGX, "--method", "pipeshard", "--tp", "2"], "--tp"),
    (["run", "--fn", "entry_mod:int_argnums"], "--model"),
])
def test_one_clear_line(argv, needle, entrymod, capsys):
    code, out, err = _run(argv, capsys)
    lines = [l for l in err.splitlines() if l.strip()]
    assert code == 2 and len(lines) == 1, err
    assert lines[0].startswith("meshplan: error:") and needle in lines[0], lines[0]


def test_fn_with_an_int_batch_argnums_plans(entrymod, capsys):
    code, out, err = _run(["plan", "--fn", "entry_mod:int_argnums", "--cluster", DGX,
                           "--method", "data", "-q"], capsys)
    assert code == 0, err
    assert "Plan for" in out


def test_batch_argnums_as_an_int_like_jax():
    def step(s, b):
        return s - 0.1 * jnp.mean(b) * s, jnp.mean(b)
    s, b = jnp.ones((8, 8)), jnp.ones((16, 8))
    cluster = meshplan.load_cluster(DGX)
    as_int = meshplan.plan(step, s, b, cluster=cluster, method=meshplan.DataParallel(),
                           batch_argnums=1)
    as_tuple = meshplan.plan(step, s, b, cluster=cluster, method=meshplan.DataParallel(),
                             batch_argnums=(1,))
    assert as_int.to_json() == as_tuple.to_json()
    with pytest.raises(meshplan.MeshplanError, match="batch_argnums"):
        meshplan.plan(step, s, b, cluster=cluster, batch_argnums="1")
    out = meshplan.parallelize(step, batch_argnums=1, method=meshplan.DataParallel())(s, b)
    ref = jax.jit(step)(s, b)
    assert jnp.allclose(out[0], ref[0]) and jnp.allclose(out[1], ref[1])


def test_nothing_but_the_plan_on_stdout():
    # HiGHS prints a banner on file descriptor 1 when a process makes its
    # first solver: a fresh process, so that this is that first one (a GPT's
    # ILP is solved by HiGHS; the mlp's by dynamic programming alone)
    import subprocess
    out = subprocess.run([sys.executable, "-m", "meshplan.cli", "plan", "--model", "gpt",
                          "--cluster", DGX, "--method", "shard"],
                         capture_output=True, text=True, check=True,
                         env={**__import__("os").environ, "JAX_PLATFORMS": "cpu"})
    assert out.stdout.startswith("Plan for gpt"), out.stdout[:200]
    assert "HiGHS" not in out.stdout


def test_a_refused_manual_plan_names_the_configuration_not_a_search(tmp_path, capsys):
    import json
    tiny = json.loads(open(DGX).read())
    tiny["device"]["memory_bytes"] = 50_000
    (tmp_path / "tiny.json").write_text(json.dumps(tiny))
    code, out, err = _run(["plan", "--model", "mlp", "--cluster", str(tmp_path / "tiny.json"),
                           "--method", "manual", "--dp", "2", "--tp", "2", "--pp", "2",
                           "--micro-batches", "2", "--remat", "never"], capsys)
    lines = [l for l in err.splitlines() if l.strip()]
    assert code == 2 and len(lines) == 1, err
    assert "Manual(dp=2, tp=2, pp=2) with 2 micro-batch(es)" in lines[0]
    assert "recomputation is off" in lines[0]
    assert "any number of stages" not in lines[0]
    # ... and by how much it is over (the budget: 0.9 x 50,000 bytes)
    import re
    need = re.search(r"stage \d \(layers \d+\.\.\d+\) needs at least ([\d.]+) KiB per device "
                     r"\(parameters .* against a budget of 43\.9 KiB \(0\.9 x 48\.8 KiB\): "
                     r"([\d.]+) (KiB|B) over", lines[0])
    assert need and float(need.group(1)) > 43.95 and float(need.group(2)) > 0, lines[0]
