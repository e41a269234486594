"""The command line is quiet: stdout carries the plan only, and each warning
reaches stderr once, as one line, however often the passes re-trace the step."""
from __future__ import annotations

from meshplan.cli import main

USERMOD = '''
import jax, jax.numpy as jnp, optax, meshplan

def make():
    opt = optax.sgd(1e-2)
    def loss(p, b):
        h = jnp.tanh(b["x"] @ p["w1"])
        a = p["w1"][:8, :8]
        # cholesky and triangular_solve have no rule: a warning each
        h = h + jnp.sum(jnp.linalg.cholesky(a @ a.T + jnp.eye(8)))
        return jnp.mean((h @ p["w2"] - b["y"]) ** 2)
    def step(state, batch):
        p, o = state
        l, g = meshplan.value_and_grad(loss)(p, batch)   # micro-batches: re-traced per count
        u, o = opt.update(g, o, p)
        return (optax.apply_updates(p, u), o), {"loss": l}
    p = {"w1": jnp.ones((32, 64)) * 0.01, "w2": jnp.ones((64, 8)) * 0.01}
    return step, ((p, opt.init(p)), {"x": jnp.ones((32, 32)), "y": jnp.ones((32, 8))})
'''


def test_each_warning_once_on_one_line_and_stdout_only_the_plan(tmp_path, monkeypatch, capsys):
    (tmp_path / "quiet_usermod.py").write_text(USERMOD)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["plan", "-q", "--fn", "quiet_usermod:make", "--cluster", "local"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("Plan for make on ")
    assert "HiGHS" not in out and "warning" not in out
    lines = err.strip().splitlines()
    assert sorted(lines) == [
        "meshplan: warning: unknown primitive 'cholesky': costed as one FLOP per output "
        "element and planned replicated",
        "meshplan: warning: unknown primitive 'triangular_solve': costed as one FLOP per "
        "output element and planned replicated"]


def test_a_warning_names_the_users_line_not_meshplans(monkeypatch):
    """Warnings pointed at meshplan's own lines (planning.py, api.py), as deep
    inside it as each was raised; they now name the caller's line."""
    import inspect
    import warnings

    import jax
    import jax.numpy as jnp

    import meshplan
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

    def step(w, x):
        a = w[:8, :8]
        h = jnp.tanh(x @ w) + jnp.sum(jnp.linalg.cholesky(a @ a.T + jnp.eye(8)))
        return w - 0.1 * jax.grad(lambda w: jnp.mean(jnp.tanh(x @ w)))(w), jnp.mean(h)
    par = meshplan.parallelize(step, method=meshplan.ShardParallel(), batch_argnums=(1,))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = inspect.currentframe().f_lineno + 1
        par(jnp.ones((16, 16)) * 0.1, jnp.ones((32, 16)))
    ours = [w for w in caught if "cholesky" in str(w.message)]
    assert ours and all((w.filename, w.lineno) == (__file__, line) for w in ours), \
        [(w.filename, w.lineno) for w in ours]
