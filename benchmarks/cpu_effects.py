"""What the 8 fake CPU devices do that a cost model built for accelerators
does not expect: the measurements behind the measured grid's remaining
errors (benchmarks/results/measured_grid.md).

1. Memory bandwidth by array size: ``x + y`` on every device at once, with a
   fresh output each call (as ``meshplan calibrate`` times it) and with the
   output donated into ``x`` (no allocation).  Past glibc's largest mmap
   threshold (32 MiB) every fresh output is a new mapping, page-faulted in.
2. A psum inside a ``fori_loop``, alone and between matmuls, per group size:
   how much a collective costs once the device threads, sharing the host's
   cores, have drifted apart between collectives.
3. How many all-reduces XLA emits for a data-parallel gpt step, and how many
   gradients the largest one carries (XLA merges them).
4. Two pipeline stages' programs at once, each with psums over its own
   devices, against one program on all the devices: whether the host
   shares out the collectives' time as it shares compute.

    python benchmarks/cpu_effects.py

Prints the three tables (a few minutes on 2 cores).  The figures are
indicative: the devices share the host's cores with everything else on it.
"""
from __future__ import annotations

import _fake_devices  # noqa: F401  (before jax: 8 fake CPU devices)

import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

LOOP = 16


def fastest(fn, runs: int = 7) -> float:
    """Seconds of the fastest of ``runs`` runs of ``fn`` (after two warm-ups)."""
    for _ in range(2):
        jax.block_until_ready(fn())
    best = float("inf")
    for _ in range(runs):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - t)
    return best


def _mesh(shape=(1, 8)) -> Mesh:
    return Mesh(np.array(jax.devices()[:8]).reshape(shape), ("a", "b"))


def _filled(mesh: Mesh, shape: tuple[int, ...], value: float = 0.5):
    spec = P(("a", "b"))
    return jax.jit(lambda: jnp.full((8,) + shape, value, jnp.float32),
                   out_shardings=NamedSharding(mesh, spec))()


def bandwidth() -> list[str]:
    mesh, spec = _mesh(), P(("a", "b"))
    add = jax.shard_map(lambda x, y: x + y, mesh=mesh, in_specs=(spec, spec), out_specs=spec)
    fresh, donated = jax.jit(add), jax.jit(add, donate_argnums=0)
    rows = ["| MiB per device and array | fresh output GB/s per device | donated GB/s per device |",
            "|---:|---:|---:|"]
    for mib in (1, 4, 16, 64, 192):
        n = mib * 2**20 // 4
        x, y = _filled(mesh, (n,)), _filled(mesh, (n,))
        t_fresh = fastest(lambda: fresh(x, y))
        state = {"x": x}

        def step():
            state["x"] = donated(state["x"], y)
            return state["x"]
        t_don = fastest(step)
        gb = 3 * mib * 2**20 / 1e9
        rows.append(f"| {mib} | {gb / t_fresh:.2f} | {gb / t_don:.2f} |")
    return rows


def collectives() -> list[str]:
    m, k, n = 256, 192, 768            # the psum moves m x k float32: 192 KiB
    rows = ["| group | matmul alone us | psum alone us | both us | psum in between us |",
            "|---:|---:|---:|---:|---:|"]
    for shape in ((4, 2), (2, 4), (1, 8)):
        mesh, spec = _mesh(shape), P(("a", "b"))
        a, b = _filled(mesh, (m, k)), _filled(mesh, (k, n))

        def timed(matmul: bool, psum: bool) -> float:
            def body(x, w):
                def it(_, y):
                    if matmul:
                        y = y + jnp.matmul(y, w[0])[:, :k] * 1e-9
                    return jax.lax.psum(y, "b") * 0.5 if psum else y
                return jax.lax.fori_loop(0, LOOP, it, x[0])[None]
            f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, spec), out_specs=spec,
                                      check_vma=False))
            return fastest(lambda: f(a, b)) / LOOP * 1e6
        mm, ps, both = timed(True, False), timed(False, True), timed(True, True)
        rows.append(f"| {shape[1]} | {mm:.0f} | {ps:.0f} | {both:.0f} | {both - mm:.0f} |")
    return rows


def pipeline_collectives(loop: int = 64, rounds: int = 9) -> list[str]:
    """Two pipeline stages of 4 devices each, one program apiece dispatched
    together, each a loop of matmuls with (or without) a psum over its own
    devices, against the same loop as one program on all 8 devices (a psum
    over each half).  Each configuration: the fastest of ``rounds`` rounds
    taken in turn.  Where the host shared out the psums' time as it shares
    compute, two stages at once would add per iteration what one program
    adds (each stage's psum is lent half the host); where the waits are
    not shared, twice that."""
    m, k, n = 256, 192, 768
    devices = jax.devices()[:8]

    def program(devs, psum: bool):
        mesh = Mesh(np.array(devs).reshape(len(devs) // 4, 4), ("a", "b"))
        spec = P(("a", "b"))

        def body(x, w):
            def it(_, y):
                y = y + jnp.matmul(y, w[0])[:, :k] * 1e-9
                return jax.lax.psum(y, "b") * 0.25 if psum else y
            return jax.lax.fori_loop(0, loop, it, x[0])[None]
        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, spec), out_specs=spec,
                                  check_vma=False))
        a, b = _filled(mesh, (m, k)), _filled(mesh, (k, n))
        return lambda: f(a, b)

    configs = {(kind, psum): ([program(devices, psum)] if kind == "one" else
                              [program(devices[:4], psum), program(devices[4:], psum)])
               for kind in ("one", "two") for psum in (False, True)}
    best = {c: float("inf") for c in configs}
    for fns in configs.values():
        jax.block_until_ready([f() for f in fns])
    for _ in range(rounds):
        for c, fns in configs.items():
            t = time.perf_counter()
            jax.block_until_ready([f() for f in fns])
            best[c] = min(best[c], time.perf_counter() - t)
    per = {c: v / loop * 1e6 for c, v in best.items()}
    one = per["one", True] - per["one", False]
    two = per["two", True] - per["two", False]
    return ["| programs | matmuls us | with psum us | psum adds us |", "|---|---:|---:|---:|",
            f"| one on 8 devices | {per['one', False]:.0f} | {per['one', True]:.0f} | {one:.0f} |",
            f"| two stages of 4 at once | {per['two', False]:.0f} | {per['two', True]:.0f} "
            f"| {two:.0f} |",
            f"\ntwo stages' psums add {two / one:.2f}x what one program's add "
            "(1: shared out as compute is; 2: in full)" if one > 0 else ""]


def merged() -> list[str]:
    import meshplan
    from meshplan.models import build_model
    from meshplan.runtime import parse_collectives
    model = build_model("gpt", {"hidden": 192, "layers": 4, "seq_len": 64, "batch": 16,
                                "heads": 4})
    state, batch = model.init(0)
    step = meshplan.parallelize(model.train_step, method=meshplan.DataParallel(),
                                batch_argnums=model.batch_argnums)
    reduces = [c for c in parse_collectives(step.lower(state, batch).compile())
               if c.kind == "all-reduce"]
    grads = len(jax.tree.leaves(state["params"]))
    return [f"gradients: {grads}; all-reduces in the compiled step: {len(reduces)}, "
            f"carrying {', '.join(str(len(c.shapes)) for c in reduces)} arrays"]


def main() -> int:
    print("1. memory bandwidth, x + y on all 8 devices at once\n")
    print("\n".join(bandwidth()))
    print(f"\n2. psum over a mesh axis in a fori_loop of {LOOP}, per iteration\n")
    print("\n".join(collectives()))
    print("\n3. a data-parallel gpt step (hidden 192, 4 layers) compiled\n")
    print("\n".join(merged()))
    print("\n4. two pipeline stages' collectives on the shared cores, per iteration\n")
    print("\n".join(pipeline_collectives()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
