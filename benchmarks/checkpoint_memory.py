"""A user's own ``jax.checkpoint`` through meshplan (issue 17, item 5):
XLA's temporaries (``compiled.memory_analysis().temp_size_in_bytes``) of the
same train step under ``jax.jit`` and under ``meshplan.parallelize(...,
ShardParallel())`` on one CPU device:

    python benchmarks/checkpoint_memory.py [--json CASE ...]

meshplan unrolls scans over stacked layers and inlines checkpoint calls; each
differentiated call's operands then pass through one optimization barrier,
as jax lowers the call itself.  Rows: a 4-layer MLP (512 x 1024, two
1024 x 1024 matmuls per layer) with no checkpoint, with ``jax.checkpoint``
per layer in a Python loop, and with it inside ``lax.scan``; a 4-layer flax
linen decoder (``nn.scan(nn.remat(Block))``, batch 8, sequence 128, width
256) with and without ``nn.remat``, and with ``nn.remat`` blocks in a Python loop.  XLA's CPU back end runs with its
memory-aware scheduler (``meshplan.tools.remat_memory.SCHEDULER_FLAG``), set
here before jax starts.
"""
from __future__ import annotations

import os

from meshplan.tools.remat_memory import SCHEDULER_FLAG

if __name__ == "__main__":     # (run as a script: one device, before jax starts;
    # the tests import the steps into their own 8-device process)
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count=1 {SCHEDULER_FLAG}"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import meshplan  # noqa: E402

MIB = 2 ** 20


def _mlp(mode: str):
    L, B, H = 4, 512, 1024

    def block(x, w):
        return jnp.tanh(jnp.tanh(x @ w[0]) @ w[1]) + x

    def loss(ws, x):
        if mode == "scan":
            y, _ = jax.lax.scan(lambda c, w: (jax.checkpoint(block, prevent_cse=False)(c, w),
                                              None), x, ws)
        else:
            y = x
            for i in range(L):
                y = jax.checkpoint(block)(y, ws[i]) if mode == "loop" else block(y, ws[i])
        return (y ** 2).mean()

    def step(ws, x):
        return ws - 0.1 * jax.grad(loss)(ws, x)
    return step, (jnp.ones((L, 2, H, H)) * 0.01, jnp.ones((B, H)))


def _flax(remat: bool, scanned: bool = True):
    import flax.linen as nn
    B, S, H, L, V = 8, 128, 256, 4, 256

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            attend = nn.MultiHeadDotProductAttention(num_heads=4, deterministic=True)
            x = x + attend(nn.LayerNorm()(x))
            return x + nn.Dense(H)(nn.gelu(nn.Dense(4 * H)(nn.LayerNorm()(x)))), None

    class LM(nn.Module):
        @nn.compact
        def __call__(self, t):
            e = nn.Embed(V, H)
            if not scanned:
                x = e(t)
                for _ in range(L):
                    x, _ = nn.remat(Block)()(x, None)
                return e.attend(x)
            block = nn.remat(Block, prevent_cse=False) if remat else Block
            x, _ = nn.scan(block, variable_axes={"params": 0}, split_rngs={"params": True},
                           length=L)()(e(t), None)
            return e.attend(x)

    model, tokens = LM(), jnp.zeros((B, S), jnp.int32)
    params = model.init(jax.random.key(0), tokens)["params"]

    def step(p, t):
        def loss(p):
            logits = model.apply({"params": p}, t)
            return optax.softmax_cross_entropy_with_integer_labels(logits, t).mean()
        return jax.tree.map(lambda a, g: a - 0.1 * g, p, jax.grad(loss)(p))
    return step, (params, tokens)


CASES = {
    "mlp, no checkpoint": lambda: _mlp("plain"),
    "mlp, jax.checkpoint per layer (Python loop)": lambda: _mlp("loop"),
    "mlp, jax.checkpoint in lax.scan": lambda: _mlp("scan"),
    "flax decoder, nn.scan(Block)": lambda: _flax(False),
    "flax decoder, nn.scan(nn.remat(Block))": lambda: _flax(True),
    "flax decoder, nn.remat(Block) per layer (Python loop)": lambda: _flax(True, scanned=False),
}


def _temp(compiled) -> float:
    return compiled.memory_analysis().temp_size_in_bytes / MIB


def temps(name: str) -> tuple[float, float]:
    """(jax.jit's, meshplan's) temp MiB of one of :data:`CASES`."""
    step, args = CASES[name]()
    return (_temp(jax.jit(step).lower(*args).compile()),
            _temp(meshplan.parallelize(step, method=meshplan.ShardParallel())
                  .lower(*args).compile()))


def main(argv: list[str] | None = None) -> None:
    import json
    import sys
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--json"]:      # (the tests: {case: [jit, meshplan]} for the cases named)
        print(json.dumps({name: temps(name) for name in argv[1:]}))
        return
    print("| step | jax.jit temp (MiB) | meshplan temp (MiB) | meshplan / jit |")
    print("|---|---:|---:|---:|")
    for name in CASES:
        ref, ours = temps(name)
        print(f"| {name} | {ref:.1f} | {ours:.1f} | {ours / ref:.2f} |", flush=True)


if __name__ == "__main__":
    main()
