"""The command line: success paths and one-line errors with exit status 2."""
import io
import json
import subprocess
import sys

import pytest

import meshplan
from meshplan import progress
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
    text = capsys.readouterr().out
    assert "dot_general" in text and "lax.scan" not in text


def test_inspect_says_a_scan_over_stacked_layers_is_unrolled(capsys):
    assert main(["inspect", "--model", "gpt", "--model-arg", "scan_layers=true",
                 "--model-arg", "layers=3"]) == 0
    assert "a lax.scan iterates over 3 stacked layers; planning unrolls it" in capsys.readouterr().out


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


def test_fn_takes_the_path_of_a_file(tmp_path, monkeypatch, capsys):
    # (what users type first: `--fn step.py:make` named a module 'step.py')
    sub = tmp_path / "models"
    sub.mkdir()
    (sub / "helper_mod_for_fn.py").write_text("import jax.numpy as jnp\nact = jnp.tanh\n")
    (sub / "stepfile.py").write_text(
        "import jax, jax.numpy as jnp\n"
        "from helper_mod_for_fn import act\n"
        "def make():\n"
        "    def step(w, x):\n"
        "        return act(x @ w).sum()\n"
        "    return step, (jax.ShapeDtypeStruct((4, 4), jnp.float32), jax.ShapeDtypeStruct((2, 4), jnp.float32))\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    assert main(["inspect", "--fn", "models/stepfile.py:make"]) == 0
    assert "tanh" in capsys.readouterr().out
    assert main(["inspect", "--fn", "models/nofile.py:make"]) == 2
    assert "no file models/nofile.py" in capsys.readouterr().err


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
    (["inspect", "--model", "mlp", "--top", "-1"], "--top"),
    (["inspect", "--fn", "no_such_module_xyz:f", "--model-arg", "hidden=3"], "--model-arg"),
    (["inspect", "--model", "mlp", "--json", "/nonexistent/x.json"], "/nonexistent"),
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
    code, out, _ = run("cluster", "validate", "local")      # (as plan --cluster local)
    assert code == 0 and "local: ok (local-" in out


# ---------------------------------------------------------------------------
# every error path of `meshplan plan` / `run` / `calibrate`, in process

USERMOD = '''
import jax, jax.numpy as jnp

def make():
    def step(w, x):
        return jnp.tanh(x @ w).sum()
    return step, (jax.ShapeDtypeStruct((4, 4), jnp.float32),
                  jax.ShapeDtypeStruct((8, 4), jnp.float32))

def boom():
    raise RuntimeError("kaboom")

def wrong():
    return 42

def needs_arg(x):
    return x

notcallable = 3

def untraceable():
    def step(w, x):
        return undefined_name + w
    return step, (jax.ShapeDtypeStruct((4, 4), jnp.float32),
                  jax.ShapeDtypeStruct((8, 4), jnp.float32))
'''

DGX = "examples/clusters/dgx-a100-x1.json"


@pytest.fixture
def usermod(tmp_path, monkeypatch):
    (tmp_path / "cli_usermod.py").write_text(USERMOD)
    (tmp_path / "cli_brokenmod.py").write_text("raise SyntaxError('broken on purpose')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("cli_usermod", "cli_brokenmod"):
        sys.modules.pop(name, None)
    return tmp_path


def run_here(argv, capsys):
    """main(argv) in this process: (exit status, stdout, stderr)."""
    try:
        code = main(argv)
    except SystemExit as e:          # argparse usage errors
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def _files(tmp_path):
    src = json.loads(open(DGX).read())
    (tmp_path / "syntax.json").write_text('{"format": "meshplan.cluster/1", ')
    bad = dict(src, links={"intra_host": {"bandwidth_bytes_per_s": -1, "latency_s": 0}})
    (tmp_path / "invalid.json").write_text(json.dumps(bad))
    tiny = json.loads(json.dumps(src))
    tiny["device"]["memory_bytes"] = 1000
    (tmp_path / "tiny.json").write_text(json.dumps(tiny))
    (tmp_path / "notjson.plan").write_text("not json")
    (tmp_path / "noformat.plan").write_text('{"format": "meshplan.plan/1"}')
    (tmp_path / "oldformat.plan").write_text('{"format": "meshplan.plan/0"}')
    (tmp_path / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff")
    (tmp_path / "real.plan").write_text('{"format": "meshplan.plan/1", "stages": []}')


@pytest.mark.parametrize("argv, needle", [
    (["plan", "--model", "nosuchmodel", "--cluster", DGX], "nosuchmodel"),
    (["plan", "--model", "gpt", "--model-arg", "hidden=big", "--cluster", DGX], "hidden"),
    (["plan", "--model", "gpt", "--model-arg", "hidden", "--cluster", DGX], "KEY=VALUE"),
    (["plan", "--model", "mlp", "--cluster", "{tmp}/missing.json"], "missing.json"),
    (["plan", "--model", "mlp", "--cluster", "{tmp}/syntax.json"], "not valid JSON"),
    (["plan", "--model", "mlp", "--cluster", "{tmp}/invalid.json"], "$.links"),
    (["plan", "--model", "mlp", "--cluster", DGX, "--method", "shard", "--mesh", "2xq"], "2xq"),
    (["plan", "--model", "mlp", "--cluster", DGX, "--method", "shard", "--mesh", "3x3"], "9 devices"),
    (["plan", "--model", "mlp", "--cluster", DGX, "--mesh", "2x4"], "--method shard"),
    (["plan", "--model", "mlp", "--cluster", DGX, "--remat", "always"], "--method manual"),
    (["plan", "--model", "mlp", "--cluster", DGX, "--method", "manual", "--remat", "often"],
     "--remat"),
    (["plan", "--model", "mlp", "--cluster", "{tmp}/tiny.json", "--method", "shard"], "does not fit"),
    (["plan", "--model", "mlp", "--cluster", "{tmp}/tiny.json", "--method", "data"], "does not fit"),
    (["plan", "--model", "mlp", "--cluster", DGX, "--method", "manual", "--dp", "3"], "3 devices"),
    (["plan", "--model", "mlp", "--cluster", DGX, "--method", "manual", "--dp", "0"], "--dp"),
    (["plan", "--model", "mlp", "--cluster", DGX, "--method", "manual", "--dp", "2", "--pp", "2"],
     "4 devices"),
    (["plan", "--model", "mlp", "--cluster", DGX, "--time-limit", "-1"], "--time-limit"),
    (["plan", "--model", "mlp", "--cluster", DGX, "--method", "pipeshard",
      "--micro-batches", "7"], "micro_batches=7"),
    (["plan", "--model", "mlp", "--cluster", DGX, "--method", "warp"], "warp"),
    (["plan", "--model", "mlp", "--cluster", DGX, "--method", "manual", "--pp", "2",
      "--micro-batches", "-1,2"], "--micro-batches=VALUE"),
    (["plan", "--model", "mlp", "--cluster", DGX, "--method", "manual", "--pp", "2",
      "--micro-batches=-1,2"], "positive integer"),
    (["plan", "--model", "mlp"], "--cluster"),
    (["plan", "--model", "mlp", "--fn", "cli_usermod:make", "--cluster", DGX], "--fn"),
    (["plan", "--fn", "nocolon", "--cluster", DGX], "MODULE:FUNCTION"),
    (["plan", "--fn", "no_such_module_xyz:f", "--cluster", DGX], "no_such_module_xyz"),
    (["plan", "--fn", "cli_brokenmod:f", "--cluster", DGX], "broken on purpose"),
    (["plan", "--fn", "cli_usermod:nosuch", "--cluster", DGX], "nosuch"),
    (["plan", "--fn", "cli_usermod:notcallable", "--cluster", DGX], "notcallable"),
    (["plan", "--fn", "cli_usermod:boom", "--cluster", DGX], "kaboom"),
    (["plan", "--fn", "cli_usermod:needs_arg", "--cluster", DGX], "no arguments"),
    (["plan", "--fn", "cli_usermod:wrong", "--cluster", DGX], "train_step, example_args"),
    (["plan", "--fn", "cli_usermod:untraceable", "--cluster", DGX], "undefined_name"),
    (["plan", "--model", "mlp", "--cluster", DGX, "--method", "shard",
      "--json", "{tmp}/no/such/dir/p.json"], "p.json"),
    (["plan", "--model", "mlp", "--cluster", DGX, "--method", "manual", "--dp", "4", "--pp", "2",
      "--timeline", "{tmp}/no/such/dir/t.png"], "t.png"),
    (["plan", "--model", "mlp", "--cluster", DGX, "--method", "manual", "--dp", "4", "--pp", "2",
      "--timeline", "{tmp}/t.xyz"], "name an image file"),
    (["run", "--model", "mlp", "--plan", "{tmp}/missing.plan"], "missing.plan"),
    (["run", "--model", "mlp", "--plan", "{tmp}/notjson.plan"], "not valid JSON"),
    (["run", "--model", "mlp", "--plan", "{tmp}/noformat.plan"], "malformed plan"),
    (["run", "--model", "mlp", "--plan", "{tmp}/oldformat.plan"], "meshplan.plan/0"),
    (["run", "--model", "mlp", "--plan", "{tmp}/missing.plan", "--method", "shard", "--mesh",
      "2x4"], "drop --method, --mesh"),
    (["run", "--fn", "cli_usermod:make"], "--model"),
    (["run", "--model", "mlp", "--steps", "0"], "--steps"),
    (["run", "--model", "mlp", "--tolerance", "-1"], "--tolerance"),
    (["calibrate", "--out", "{tmp}/no/such/dir/c.json"], "c.json"),
    (["calibrate", "--out", "{tmp}"], "directory"),
    (["calibrate"], "--out"),
    (["inspect", "--model", "mlp", "--json", "-"], "not written to stdout"),
    (["plan", "--model", "mlp", "--cluster", "local", "--timeline", "-"], "timeline.png"),
    (["plan", "--model", "mlp", "--cluster", "local", "--emit", "python", "--emit-out", "-"],
     "shard_plan.py"),
    (["plan", "--model", "mlp", "--cluster", "local", "--json", "-", "--emit", "python"],
     "both write to stdout"),
    (["--quiet", "--verbose", "inspect", "--model", "mlp"], "--verbose"),
    # (sweep C of stop 94: written nowhere, a traceback, and files of the other kind)
    (["plan", "--model", "mlp", "--cluster", "local", "--json="], "--json needs a file name"),
    (["run", "--model", "mlp", "--plan", "{tmp}/image.png"], "not a text file"),
    (["run", "--model", "mlp", "--plan", DGX], "this is a cluster file, not a plan"),
    (["cluster", "validate", "{tmp}/real.plan"], "this is a plan file, not a cluster"),
])
def test_every_error_is_one_line_exit_2(argv, needle, usermod, tmp_path, capsys):
    _files(tmp_path)
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    code, out, err = run_here(argv, capsys)
    lines = [l for l in err.splitlines() if l.strip()]
    assert code == 2, (code, out, err)
    assert len(lines) == 1, err
    assert lines[0].startswith("meshplan: error:") and needle in lines[0], lines[0]


def test_run_refuses_a_stale_plan(tmp_path, capsys):
    saved = tmp_path / "mlp.plan.json"
    assert main(["plan", "--model", "mlp", "--cluster", "local", "--method", "shard",
                 "--json", str(saved)]) == 0
    capsys.readouterr()
    code, _, err = run_here(["run", "--model", "gpt", "--model-arg", "hidden=64",
                             "--model-arg", "layers=2", "--plan", str(saved)], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1
    # (what differs, by the leaves the plan records: sweep X)
    assert "of the plan's" in err and "leaves are missing" in err and "not in the plan" in err


def test_plan_json_to_stdout(capsys):
    # --json -: the plan JSON alone on stdout, the plan's text on stderr
    code, out, err = run_here(["plan", "--model", "mlp", "--cluster", "local", "--method",
                               "data", "--json", "-"], capsys)
    assert code == 0, err
    plan = meshplan.Plan.from_json(out)
    assert plan.method == "data" and "Plan for mlp" in err


def test_plan_fn_prints_specs_and_devices_and_writes_json(usermod, tmp_path, capsys):
    out = tmp_path / "p.json"
    code, text, err = run_here(["plan", "--fn", "cli_usermod:make", "--cluster", DGX,
                                "--method", "shard", "--json", str(out)], capsys)
    assert code == 0, err
    assert err == ""                       # no progress when stderr is not a terminal
    assert "devices 0-7" in text
    spec_lines = [l for l in text.splitlines() if "P(" in l]
    assert len(spec_lines) >= 2            # the weight and the batch, each with its spec
    plan = meshplan.Plan.from_json(out.read_text())
    assert plan.function == "make" and plan.stages[0].devices == tuple(range(8))


@pytest.mark.parametrize("flags, where", [(["--verbose"], "before"), (["-v"], "after"),
                                          (["--quiet"], "before")])
def test_quiet_and_verbose(flags, where, usermod, capsys):
    base = ["plan", "--fn", "cli_usermod:make", "--cluster", DGX, "--method", "shard"]
    argv = flags + base if where == "before" else base + flags
    code, text, err = run_here(argv, capsys)
    assert code == 0 and "Plan for" in text
    if "--quiet" in flags:
        assert err == ""
    else:
        assert "meshplan: tracing make:" in err and "meshplan: ILP on mesh" in err


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_progress_on_a_terminal(monkeypatch):
    tty = _Tty()
    reporter = progress.Progress(progress.NORMAL, stream=tty)
    with reporter.step("fast"):
        pass
    assert "fast ..." in tty.getvalue() and "fast:" not in tty.getvalue()
    monkeypatch.setattr(progress, "SLOW_S", 0.0)     # every step counts as slow
    with reporter.step("outer"):
        with reporter.step("inner"):
            pass
    text = tty.getvalue()
    assert "outer > inner ..." in text and "inner: " in text and "outer: " in text
    plain = io.StringIO()                             # not a terminal: nothing
    with progress.Progress(progress.NORMAL, stream=plain).step("hidden"):
        pass
    assert plain.getvalue() == ""
    before = tty.getvalue()
    with progress.Progress(progress.QUIET, stream=tty).step("quiet"):
        pass
    assert tty.getvalue() == before


def test_a_reader_that_goes_away_stops_it_quietly():
    # (`meshplan inspect ... | head -1`: the handler stood after `except
    # Exception`, which caught the BrokenPipeError first: sweep C of stop 94)
    proc = subprocess.Popen([sys.executable, "-m", "meshplan.cli", "inspect", "--model", "mlp",
                             "--top", "200"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 1
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
