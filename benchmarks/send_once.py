"""Send once, gather on the receiver: the predicted iteration time of
pipelines whose stages sit on different hosts, priced per replica (every
receiver device fetching its own copy over the network, the old model) and
send-once (each distinct piece over the network once, then an all-gather on
the receiver's NVLink: :mod:`meshplan.cost_model.cross_mesh`).

Both columns come from the same planner; the per-replica column swaps the
stage DP's send price back to ``2 * cut * replication / (devices * p2p_bw)``.
Each cell: the predicted iteration time, the send time per micro-batch of the
first stage (its activations on and their gradients back, as the stage DP
priced the cut the plan took) and the stages (devices and logical mesh).
The figures are predictions (no GPU is used); sends but the last micro-batch's
hide under compute (:mod:`meshplan.cost_model.overlap`), so the iteration time
moves by far less than the send time.

    python benchmarks/send_once.py [--cases gpt-1.3b:64:dgx-a100-x2:4:2:2:8,...]

``--driver``: instead, what the runtime's send-once costs the Python driver
on 8 fake CPU devices: the built-in mlp under Manual(dp=2, tp=2, pp=2), the
median wall time of one call's dispatch (it returns before the devices
finish) and of a call ended by ``block_until_ready``, sending once
(a slice on the sender, a put, an all-gather on the receiver: three
dispatches) and per replica (one put), interleaved call by call.

    python benchmarks/send_once.py --driver [--calls 30]
"""
from __future__ import annotations

import argparse
import importlib
import statistics
import time

importlib.import_module("_fake_devices")    # before jax: 8 fake CPU devices for --driver
import jax  # noqa: E402

import meshplan  # noqa: E402
from meshplan.dp_search import stages as stage_costs  # noqa: E402
from meshplan.models import build_model  # noqa: E402

from _cases import Case, print_table  # noqa: E402

# model:batch:cluster:dp:tp:pp:micro-batches (pp 0: PipeshardParallel searches
# stages on whole hosts, tp within a host)
CASES = ("gpt-1.3b:64:dgx-a100-x2:4:2:2:8,gpt-1.3b:64:dgx-a100-x2:2:4:2:8,"
         "gpt-350m:64:dgx-a100-x2:0:0:0:8")


def per_replica_send_s(cut_bytes, replication, devices, p2p_bw, *_):
    """The old price: a replicated value crosses once per receiver replica."""
    return 2 * cut_bytes * replication / (devices * p2p_bw)


def run_case(spec: str) -> dict:
    name, batch, cluster_name, dp, tp, pp, mb = spec.split(":")
    case = Case.of(name, batch, cluster_name)
    if int(pp):
        method = meshplan.Manual(dp=int(dp), tp=int(tp), pp=int(pp), num_micro_batches=int(mb))
        label = f"Manual(dp={dp}, tp={tp}, pp={pp})"
    else:
        method = meshplan.PipeshardParallel(num_micro_batches=int(mb), tp_within_host=True)
        label = "PipeshardParallel(tp_within_host)"
    row = {"case": f"{name} batch {batch}, {cluster_name}, {label}, m={mb}"}
    t0 = time.perf_counter()
    real, real_send = stage_costs.stage_send_s, stage_costs.StageCosts.send_s
    for col, price in (("per replica", per_replica_send_s), ("send once", real)):
        priced: dict[int, float] = {}     # last layer of a stage -> its send time

        def spy(self, j, *a, **k):
            priced[j] = t = real_send(self, j, *a, **k)
            return t

        stage_costs.stage_send_s, stage_costs.StageCosts.send_s = price, spy
        try:
            plan = case.plan(method)
        finally:
            stage_costs.stage_send_s, stage_costs.StageCosts.send_s = real, real_send
        shape = " + ".join(f"{len(s.devices)}{tuple(s.logical_mesh.shape)}" for s in plan.stages)
        send = priced.get(plan.stages[0].layers[1], 0.0) if len(plan.stages) > 1 else 0.0
        row[col] = (f"{plan.predicted.iteration_s * 1e3:.1f} ms, send {send * 1e3:.2f} ms "
                    f"[{shape}]")
    row["plan s"] = f"{time.perf_counter() - t0:.0f}"
    return row


def driver(calls: int) -> None:
    from meshplan.runtime import pipeline_transport as pt
    from meshplan.runtime.pipeline_transport import SendOnce
    # the 8 fake devices are one host, where the runtime puts values as they
    # are; count them as two hosts to time what send-once costs the driver
    pt.one_host = lambda devices: False
    m = build_model("mlp", {"optimizer": "sgd", "layers": "4"})
    state, batch = jax.device_get(m.init(0))
    plan = meshplan.plan(m.train_step, state, batch, method=meshplan.Manual(
        dp=2, tp=2, pp=2, num_micro_batches=4, schedule="1f1b"))
    route = SendOnce._route
    steps, states = {}, {}
    for col in ("per replica", "send once"):
        SendOnce._route = route if col == "send once" else (lambda self, v, target: None)
        steps[col] = meshplan.parallelize(m.train_step, plan=plan)
        states[col] = state
        for _ in range(3):      # compile, and warm every route
            states[col] = steps[col](states[col], batch)[0]
    SendOnce._route = route
    times = {c: ([], []) for c in steps}
    for _ in range(calls):
        for col, step in steps.items():
            jax.block_until_ready(states[col])
            t0 = time.perf_counter()
            states[col] = step(states[col], batch)[0]
            t1 = time.perf_counter()
            jax.block_until_ready(states[col])
            times[col][0].append(t1 - t0)
            times[col][1].append(time.perf_counter() - t0)
    print("| sends | dispatch (ms) | step (ms) |")
    print("|---|---:|---:|")
    for col, (d, w) in times.items():
        print(f"| {col} | {statistics.median(d) * 1e3:.3f} | {statistics.median(w) * 1e3:.3f} |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=CASES)
    ap.add_argument("--driver", action="store_true")
    ap.add_argument("--calls", type=int, default=30)
    args = ap.parse_args(argv)
    if args.driver:
        driver(args.calls)
        return 0
    print_table(args.cases, run_case)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
