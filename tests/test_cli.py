"""The command line: success paths and one-line errors with exit status 2."""
import json
import subprocess
import sys

import pytest

from meshplan.cli import main


def run(*argv):
    proc = subprocess.run([sys.executable, "-m", "meshplan.cli", *argv], capture_output=True,
                          text=True)
    return proc.returncode, proc.stdout, proc.stderr


def test_inspect_gpt_writes_json(tmp_path, capsys):
    out = tmp_path / "g.json"
    assert main(["inspect", "--model", "gpt", "--model-arg", "hidden=128",
                 "--model-arg", "layers=3", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    for key in ("total_flops", "num_params", "param_bytes", "num_ops", "fingerprint", "model_config"):
        assert key in data
    cfg = data["model_config"]
    assert cfg["hidden"] == 128 and cfg["layers"] == 3
    for key in ("batch", "seq_len", "hidden", "layers", "heads", "vocab"):
        assert key in cfg
    assert "dot_general" in capsys.readouterr().out


def test_inspect_fn(tmp_path, monkeypatch, capsys):
    (tmp_path / "usermod.py").write_text(
        "import jax, jax.numpy as jnp\n"
        "def make():\n"
        "    def step(w, x):\n"
        "        return jnp.tanh(x @ w).sum()\n"
        "    return step, (jax.ShapeDtypeStruct((4, 4), jnp.float32), jax.ShapeDtypeStruct((2, 4), jnp.float32))\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["inspect", "--fn", "usermod:make"]) == 0
    assert "tanh" in capsys.readouterr().out


@pytest.mark.parametrize("argv, needle", [
    (["inspect", "--model", "nosuchmodel"], "nosuchmodel"),
    (["inspect", "--model", "gpt", "--model-arg", "hidden"], "KEY=VALUE"),
    (["inspect", "--model", "gpt", "--model-arg", "colour=blue"], "colour"),
    (["inspect", "--model", "gpt", "--model-arg", "hidden=big"], "hidden"),
    (["inspect", "--fn", "no_such_module_xyz:f"], "no_such_module_xyz"),
    (["inspect", "--fn", "nocolon"], "MODULE:FUNCTION"),
    (["cluster", "validate", "/nonexistent/cluster.json"], "/nonexistent/cluster.json"),
    (["cluster", "show", "/nonexistent/cluster.json"], "/nonexistent/cluster.json"),
    (["inspect"], "--model"),
    (["frobnicate"], "frobnicate"),
])
def test_bad_input_is_one_line_exit_2(argv, needle):
    code, out, err = run(*argv)
    assert code == 2, (code, out, err)
    lines = [l for l in err.strip().splitlines() if l.strip()]
    assert len(lines) == 1, err
    assert needle in lines[0]
    assert "Traceback" not in err


def test_cluster_validate_bad_file_names_json_path(tmp_path):
    bad = tmp_path / "c.json"
    src = json.loads(open("examples/clusters/dgx-a100-x1.json").read())
    src["device"]["memory_bytes"] = -1
    bad.write_text(json.dumps(src))
    code, _, err = run("cluster", "validate", str(bad))
    assert code == 2 and "$.device.memory_bytes" in err


def test_cluster_show_and_validate_ok():
    code, out, _ = run("cluster", "validate", "examples/clusters/dgx-a100-x2.json")
    assert code == 0 and "ok" in out
    code, out, _ = run("cluster", "show", "examples/clusters/aws-p3.16xlarge-x1.json")
    assert code == 0 and "V100" in out
