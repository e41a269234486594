"""Shared by the multi-process test workers (run as scripts from tests/)."""


def process_rows(batch, pid: int, nproc: int):
    """This process's contiguous share of the global batch's rows, as a
    multi-controller JAX program feeds its local part."""
    import jax      # the workers import jax only after joining the run
    n = jax.tree.leaves(batch)[0].shape[0] // nproc
    return jax.tree.map(lambda x: x[pid * n:(pid + 1) * n], batch)
