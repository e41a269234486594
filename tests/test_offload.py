"""Optimizer state offloaded to host memory (meshplan.offload): the host link
of a cluster file, the plan's choice and its costs, and the one-stage runtime
keeping the state in pinned host memory between steps."""
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import meshplan
from meshplan.errors import ClusterSpecError, InfeasiblePlanError, MeshplanError
from meshplan.models import build_model

DGX = "examples/clusters/dgx-a100-x1.json"
GPT = {"layers": 2, "hidden": 32, "heads": 2, "seq_len": 16, "vocab": 64, "batch": 8}
ACTIVATION_HEAVY = {"layers": 2, "hidden": 16, "heads": 2, "seq_len": 64, "vocab": 32, "batch": 8}
STATE_HEAVY = {"layers": 2, "hidden": 64, "heads": 2, "seq_len": 4, "vocab": 64, "batch": 8}
OPT = optax.adam(1e-2)


def _cluster_data(**device):
    data = json.loads(open(DGX).read())
    data["device"].update(device)
    return data


def _plan(method, cluster=DGX, config=GPT):
    m = build_model("gpt", config)
    c = cluster if isinstance(cluster, meshplan.ClusterSpec) else meshplan.load_cluster(cluster)
    return meshplan.plan(m.train_step, *m.abstract_args, cluster=c, method=method)


# -- the cluster's host link ----------------------------------------------------------

def test_example_files_carry_a_cited_host_link_and_old_files_load_without_one():
    c = meshplan.load_cluster(DGX)
    assert c.host_link == meshplan.HostLink(31.5e9, 10e-6, 0.8)
    assert any("PCIe 4.0 x16" in s for s in c.sources)
    assert "host link   31.5 GB/s" in c.describe()
    old = _cluster_data()
    del old["links"]["host_device"]
    spec = meshplan.ClusterSpec.from_dict(old)
    assert spec.host_link is None and "host_device" not in spec.to_dict()["links"]
    assert meshplan.ClusterSpec.from_dict(c.to_dict()) == c


@pytest.mark.parametrize("bad, path", [
    ({"bandwidth_bytes_per_s": -1, "latency_s": 1e-5}, "$.links.host_device.bandwidth_bytes_per_s"),
    ({"bandwidth_bytes_per_s": 1e9}, "$.links.host_device.latency_s"),
    ({"bandwidth_bytes_per_s": 1e9, "latency_s": 0, "separate_memory": "no"},
     "$.links.host_device.separate_memory"),
    ({"bandwidth_bytes_per_s": 1e9, "latency_s": 0, "efficency": 0.5},
     "$.links.host_device.efficency"),
])
def test_a_bad_host_link_is_refused_naming_its_json_path(bad, path):
    data = _cluster_data()
    data["links"]["host_device"] = bad
    with pytest.raises(ClusterSpecError) as e:
        meshplan.ClusterSpec.from_dict(data)
    assert e.value.path == path and "\n" not in str(e.value)


def test_local_devices_host_link_cpu_shares_host_memory_gpus_have_pcie():
    from meshplan import datasheets
    link = meshplan.Cluster.local().host_link
    assert link is not None and not link.separate_memory
    assert datasheets.known_device("gpu", "NVIDIA H200").host_link == (63.0e9, 1e-5)
    assert datasheets.known_device("gpu", "Tesla V100-SXM2-16GB").host_link == (15.75e9, 1e-5)


# -- planning ---------------------------------------------------------------------------

def test_offloaded_plan_frees_the_optimizer_bytes_and_pays_the_host_link():
    # (activations peak above the update: the optimizer's bytes come off the peak)
    base = _plan(meshplan.Manual(dp=8), config=ACTIVATION_HEAVY)
    off = _plan(meshplan.Manual(dp=8, offload="optimizer"), config=ACTIVATION_HEAVY)
    b, o = base.stages[0], off.stages[0]
    assert (b.offload, o.offload) == ("none", "optimizer")
    opt = b.predicted.memory.optimizer
    assert opt > 0
    # the device's peak drops by the optimizer's bytes, which move to the host
    assert o.predicted.memory_bytes == b.predicted.memory_bytes - opt
    assert off.predicted.peak_memory_bytes == o.predicted.memory_bytes
    assert (o.predicted.memory.optimizer, o.predicted.memory.offloaded) == (0, opt)
    assert o.predicted.memory.total == o.predicted.memory_bytes
    # each step reads the state to the device and writes it back over PCIe
    link = meshplan.load_cluster(DGX).host_link
    leaves = len(o.host_params)
    floor = 2 * (leaves * link.latency_s + opt / link.achieved_bandwidth)
    assert o.predicted.host_transfer_s == pytest.approx(floor, rel=1e-6)
    assert off.predicted.iteration_s == pytest.approx(
        base.predicted.iteration_s + o.predicted.host_transfer_s, rel=1e-9)
    # the optimizer's leaves, not the parameters, and the outputs replacing them
    assert o.host_params and all("opt_state" in k for k in o.host_params)
    assert len(o.host_outputs) == leaves and all("opt_state" in k for k in o.host_outputs)
    assert set(o.host_outputs) <= dict(o.outputs).keys()


def test_auto_asked_to_offload_plans_one_offloaded_stage():
    p = _plan(meshplan.Auto(offload="optimizer"), _one_device())
    assert len(p.stages) == 1 and p.stages[0].offload == "optimizer"
    assert p.method == "auto" and p.stages[0].predicted.host_transfer_s > 0


def test_plan_json_records_the_choice_under_new_keys_only():
    base = _plan(meshplan.Manual(dp=8))
    d = json.loads(base.to_json())["stages"][0]
    assert "offload" not in d and "host_memory" not in d
    assert "offloaded" not in d["predicted"]["memory"]
    assert "host_transfer_s" not in d["predicted"]
    off = _plan(meshplan.Manual(dp=8, offload="optimizer"))
    d = json.loads(off.to_json())["stages"][0]
    assert d["offload"] == "optimizer" and d["host_memory"]["params"]
    assert d["predicted"]["memory"]["offloaded"] > 0
    assert meshplan.Plan.from_json(off.to_json()) == off
    assert "offloaded to host" in str(off)


def _one_device(memory_bytes=None):
    data = _cluster_data(**({} if memory_bytes is None else {"memory_bytes": int(memory_bytes)}))
    data.update(devices_per_host=1, num_devices=1)
    return meshplan.ClusterSpec.from_dict(data)


def test_auto_offloads_only_where_memory_binds():
    # one device: one layout, so the memory is fixed and the test exact;
    # activations outweigh the parameters (long sequences, narrow layers)
    base = _plan(meshplan.Manual(), _one_device(), ACTIVATION_HEAVY)
    peak, opt = base.predicted.peak_memory_bytes, base.stages[0].predicted.memory.optimizer
    # a budget (90% of the device) between the peak with and without the state
    small = _one_device((peak - opt / 2) / 0.9)
    with pytest.raises(InfeasiblePlanError):
        _plan(meshplan.Manual(offload="none"), small, ACTIVATION_HEAVY)
    auto = _plan(meshplan.Manual(offload="auto"), small, ACTIVATION_HEAVY)
    assert auto.stages[0].offload == "optimizer"
    assert auto.predicted.peak_memory_bytes == peak - opt
    # where it fits, auto keeps the state on the device
    assert _plan(meshplan.Manual(offload="auto"), _one_device(),
                 ACTIVATION_HEAVY).stages[0].offload == "none"
    # too small even with the state on the host: the error says so
    with pytest.raises(InfeasiblePlanError, match="does not make it fit either"):
        _plan(meshplan.Manual(offload="auto"), _one_device((peak - opt) / 0.9 - 1024),
              ACTIVATION_HEAVY)


def test_a_refusal_that_is_not_about_memory_does_not_mention_offloading():
    # (a batch of 8 over 16 devices was refused "... offloading the optimizer
    # state ... does not make it fit either")
    m = build_model("gpt")
    cluster = pathlib.Path(__file__).resolve().parents[1] / "examples/clusters/dgx-a100-x2.json"
    with pytest.raises(InfeasiblePlanError) as e:
        meshplan.plan(m.train_step, *m.abstract_args, method=meshplan.DataParallel(),
                      cluster=meshplan.load_cluster(str(cluster)))
    assert "does not split over 16 devices" in str(e.value) and "offload" not in str(e.value)


def test_the_update_needs_the_state_back_on_the_device():
    # parameters and Adam's state outweigh the activations (short sequences):
    # offloaded, the update (every input and a gradient per parameter) binds
    base = _plan(meshplan.Manual(), _one_device(), STATE_HEAVY)
    mem = base.stages[0].predicted.memory
    off = _plan(meshplan.Manual(offload="optimizer"), _one_device(), STATE_HEAVY)
    m = off.stages[0].predicted.memory
    # (the gpt has no other state: its parameters' bytes are the gradients')
    assert (m.params, m.grads, m.optimizer, m.temporaries, m.offloaded) == (
        mem.params, mem.params, mem.optimizer, 0, mem.optimizer)
    assert off.predicted.peak_memory_bytes == m.total > base.predicted.peak_memory_bytes - mem.optimizer
    # so a budget below the state alone is not rescued by offloading it
    small = _one_device((mem.params + 0.75 * mem.optimizer) / 0.9)
    with pytest.raises(InfeasiblePlanError):
        _plan(meshplan.Manual(offload="auto"), small, STATE_HEAVY)


def test_bad_offload_requests_give_one_clear_line():
    with pytest.raises(MeshplanError, match="offload='bogus'"):
        meshplan.Manual(offload="bogus")
    with pytest.raises(MeshplanError, match="use pp=1"):
        meshplan.Manual(pp=2, dp=4, offload="optimizer").request(8)
    no_link = _cluster_data()
    del no_link["links"]["host_device"]
    with pytest.raises(MeshplanError, match=r"links\.host_device") as e:
        _plan(meshplan.Manual(dp=8, offload="optimizer"), meshplan.ClusterSpec.from_dict(no_link))
    assert "\n" not in str(e.value)

    def sgd_step(w, batch):     # no optimizer state to offload
        g = jax.grad(lambda w: jnp.mean((batch["x"] @ w) ** 2))(w)
        return w - 0.1 * g, None
    with pytest.raises(MeshplanError, match="no optimizer state"):
        meshplan.plan(sgd_step, jnp.ones((16, 8)), {"x": jnp.ones((16, 16))},
                      cluster=meshplan.load_cluster(DGX),
                      method=meshplan.Manual(dp=8, offload="optimizer"))


# -- the runtime ------------------------------------------------------------------------

def _loss(p, x, y):
    h = jnp.tanh(x @ p["w1"])
    return jnp.mean((h @ p["w2"] - y) ** 2)


def _step(state, batch):
    loss, g = meshplan.value_and_grad(_loss)(state["params"], batch["x"], batch["y"])
    u, o = OPT.update(g, state["opt_state"], state["params"])
    return {"params": optax.apply_updates(state["params"], u), "opt_state": o}, {"loss": loss}


def _state():
    k1, k2 = jax.random.split(jax.random.key(0))
    p = {"w1": jax.random.normal(k1, (16, 32)) * 0.3, "w2": jax.random.normal(k2, (32, 8)) * 0.3}
    return {"params": p, "opt_state": OPT.init(p)}


BATCH = {"x": jnp.linspace(-1, 1, 16 * 16).reshape(16, 16), "y": jnp.ones((16, 8))}


def test_offloaded_step_runs_from_pinned_host_memory_and_matches_the_plain_step():
    method = meshplan.Manual(dp=2, tp=4, offload="optimizer")
    step = meshplan.parallelize(_step, method=method, donate_argnums=(0,))
    jitted = jax.jit(_step)
    ref = par = _state()
    for k in range(3):
        ref, rm = jitted(ref, BATCH)
        prev, (par, pm) = par, step(par, BATCH)
        assert float(pm["loss"]) == pytest.approx(float(rm["loss"]), rel=1e-5)
        if k:       # donated as jax.jit donates: host-memory leaves too
            assert all(leaf.is_deleted() for leaf in jax.tree.leaves(prev))
    assert step.plan.stages[0].offload == "optimizer"
    kinds = {leaf.sharding.memory_kind for leaf in jax.tree.leaves(par["opt_state"])}
    assert kinds == {"pinned_host"}
    assert {leaf.sharding.memory_kind for leaf in jax.tree.leaves(par["params"])} != {"pinned_host"}
    # Adam: within the README's tolerance (leaves near zero against a floor scale)
    for a, b in zip(jax.tree.leaves(par), jax.tree.leaves(ref)):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.linalg.norm(a - b) <= 1e-4 * max(np.linalg.norm(b), 1.0)


def test_offloaded_step_lowers_with_host_memory_arguments():
    step = meshplan.parallelize(_step, method=meshplan.Manual(dp=8, offload="optimizer"))
    state = _state()
    text = step.lower(state, BATCH).as_text()
    # the optimizer's arguments and results carry the host memory space
    assert "pinned_host" in text
    step.lower(state, BATCH).compile()


# -- the command line ---------------------------------------------------------------------

def test_cli_offload_flag_forces_it_and_is_refused_where_it_does_not_apply(tmp_path, capsys):
    from meshplan.cli import main
    model = ["--model", "gpt"] + [f"--model-arg={k}={v}" for k, v in GPT.items()]
    out = tmp_path / "p.json"
    assert main(["plan", *model, "--cluster", DGX, "--method", "manual", "--dp", "8",
                 "--offload", "optimizer", "--json", str(out)]) == 0
    assert "optimizer state offloaded to host" in capsys.readouterr().out
    assert meshplan.Plan.from_json(out.read_text()).stages[0].offload == "optimizer"
    assert main(["plan", *model, "--cluster", DGX, "--method", "pipeshard",
                 "--offload", "optimizer"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--offload applies to" in err
