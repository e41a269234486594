"""Traced GPT FLOPs and sizes against Megatron-LM's analytic formulas."""

import jax
import pytest

from meshplan.models import build_model
from meshplan.trace import trace


def analytic_flops(B, s, l, h, V):
    """Forward + backward matmul FLOPs, no recomputation (Narayanan et al. 2021)."""
    return 72 * B * s * l * h * h * (1 + s / (6 * h) + V / (12 * l * h))


@pytest.mark.parametrize("cfg", [
    dict(batch=4, seq_len=128, hidden=256, layers=2, heads=4, vocab=1024),
    dict(batch=2, seq_len=256, hidden=512, layers=4, heads=8, vocab=4096),
    dict(batch=8, seq_len=64, hidden=384, layers=3, heads=6, vocab=2048),
])
def test_gpt_matmul_flops_match_megatron_formula(cfg):
    m = build_model("gpt", {k: str(v) for k, v in cfg.items()})
    g = trace(m.train_step, *m.abstract_args, batch_argnums=m.batch_argnums)
    want = analytic_flops(cfg["batch"], cfg["seq_len"], cfg["layers"], cfg["hidden"], cfg["vocab"])
    assert g.matmul_flops == pytest.approx(want, rel=0.05)
    h, l, V, s = cfg["hidden"], cfg["layers"], cfg["vocab"], cfg["seq_len"]
    want_params = 12 * l * h * h * (1 + 13 / (12 * h) + (V + s) / (12 * l * h))
    assert g.num_params == pytest.approx(want_params, rel=0.02)


def test_gpt_39b_traces_abstractly():
    # (other tests in this process may keep arrays alive: count only new ones)
    before = len(jax.live_arrays())
    before_bytes = sum(a.nbytes for a in jax.live_arrays())
    m = build_model("gpt-39b")
    g = trace(m.train_step, *m.abstract_args, batch_argnums=m.batch_argnums)
    assert len(jax.live_arrays()) <= before + 2   # nothing of model size was allocated
    assert sum(a.nbytes for a in jax.live_arrays()) - before_bytes < 2**20
    assert g.num_params == pytest.approx(39.1e9, rel=0.01)
    cfg = m.config
    want = analytic_flops(cfg["batch"], cfg["seq_len"], cfg["layers"], cfg["hidden"], cfg["vocab"])
    assert g.matmul_flops == pytest.approx(want, rel=0.05)
