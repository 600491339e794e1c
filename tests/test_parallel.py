"""Sharding on 8 simulated CPU devices: the (4, 2) data x fsdp mesh reproduces the 1-device model."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import random_inputs
from jax.sharding import PartitionSpec as P

from flowrl_jax import parallel

EPS = float(np.finfo(np.float32).eps)  # 1.19e-7
# Sharded and one-device programs compute the same float32 math and differ only in summation order (a batch of 1 vs 8 per
# device, FSDP partial sums added across devices, XLA:CPU's per-shape blocking, which differs between CPUs). Worst case a
# K-term reduction reorders to within K eps sum|terms|; with every op's error passed on at unit gain (normalized layers),
# a program's output is within (reduced terms + elementwise ops) eps of its scale, counted from the tiny model's jaxprs:
FORWARD_TERMS = 2800  # forward: 43 matmuls (sum K 1,782) + 29 sums (730) + 261 elementwise ops
GRAD_TERMS = 16000  # value_and_grad at batch 8: matmuls 6,744 + sums 8,345 (bias and weight grads sum 8 x 16 rows) + 650


def test_eight_simulated_devices():
    assert jax.device_count() == 8, "tests/conftest.py must set XLA_FLAGS before jax is imported"


def test_make_mesh_fills_minus_one():
    mesh = parallel.make_mesh([("data", -1), ("fsdp", 2)])
    assert dict(mesh.shape) == {"data": 4, "fsdp": 2}
    with pytest.raises(ValueError, match="slots"):
        parallel.make_mesh([("data", 3), ("fsdp", 2)])
    with pytest.raises(ValueError, match="at most one"):
        parallel.make_mesh([("data", -1), ("fsdp", -1)])


def test_spec_rules():
    mesh = parallel.make_mesh([("data", 4), ("fsdp", 2)])
    assert parallel.spec_for("a/kernel", (64, 256), mesh, min_fsdp_size=1024) == P(None, "fsdp")
    assert parallel.spec_for("a/kernel", (63, 256), mesh, min_fsdp_size=1024) == P(None, "fsdp")
    assert parallel.spec_for("a/kernel", (256, 63), mesh, min_fsdp_size=1024) == P("fsdp", None)
    assert parallel.spec_for("a/kernel", (8, 8), mesh, min_fsdp_size=1024) == P()  # small: replicated
    assert parallel.spec_for("a/bias", (4096,), mesh, min_fsdp_size=1024) == P()
    rules = ((r"to_q/kernel$", ("fsdp", None)),) + parallel.DEFAULT_RULES
    assert parallel.spec_for("attn/to_q/kernel", (64, 64), mesh, rules) == P("fsdp", None)
    with pytest.raises(ValueError, match="no partition rule"):
        parallel.spec_for("a/bias", (4,), mesh, rules=((r"kernel$", "fsdp"),))


@pytest.fixture(scope="module")
def sharded(tiny_model, tiny_params):
    mesh = parallel.make_mesh([("data", 4), ("fsdp", 2)])
    init = lambda rng: jax.tree_util.tree_map(lambda x: x, tiny_params)  # noqa: E731 - the test's params
    params, shardings = parallel.init_sharded(init, jax.random.PRNGKey(0), mesh, min_fsdp_size=1024)
    return mesh, params, shardings


def test_big_kernels_are_sharded(sharded):
    mesh, params, _ = sharded
    ff = params["transformer_blocks_0"]["ff"]["fc1"]["kernel"]  # [32, 128]
    assert ff.sharding.spec == P(None, "fsdp")
    assert ff.addressable_shards[0].data.shape == (32, 64)
    assert params["transformer_blocks_0"]["ff"]["fc1"]["bias"].sharding.spec == P()
    assert params["proj_out"]["kernel"].sharding.spec == P()  # 32 x 12: below min_fsdp_size


def test_sharded_init_runs_init_fn_under_out_shardings(tiny_model):
    mesh = parallel.make_mesh([("data", 4), ("fsdp", 2)])
    dummy = tiny_model.dummy_inputs()
    params, _ = parallel.init_sharded(lambda r: tiny_model.init(r, *dummy)["params"], jax.random.PRNGKey(0), mesh, min_fsdp_size=1024)
    reference = jax.jit(tiny_model.init)(jax.random.PRNGKey(0), *dummy)["params"]
    square = params["transformer_blocks_0"]["attn"]["to_q"]["kernel"]  # [32, 32]: ties go to the first dim
    assert square.sharding.spec == P("fsdp", None)
    kernel = params["transformer_blocks_0"]["ff"]["fc2"]["kernel"]  # [128, 32]
    assert kernel.sharding.spec == P("fsdp", None)
    np.testing.assert_array_equal(kernel, reference["transformer_blocks_0"]["ff"]["fc2"]["kernel"])


def test_sharded_forward_and_grad_equal_single_device(tiny_model, tiny_params, sharded):
    mesh, params, shardings = sharded
    inputs = random_inputs(tiny_model, batch=8, text_len=5)
    data = parallel.batch_sharding(mesh)
    assert data.spec == P(("data", "fsdp"))

    def loss(p, *a):
        return jnp.mean(tiny_model.apply({"params": p}, *a) ** 2)

    step = jax.jit(jax.value_and_grad(loss), in_shardings=(shardings, data, data, data, data), out_shardings=(None, shardings))
    forward = jax.jit(lambda p, *a: tiny_model.apply({"params": p}, *a), in_shardings=(shardings, data, data, data, data), out_shardings=data)
    sharded_inputs = parallel.shard_batch(inputs, mesh)
    v = forward(params, *sharded_inputs)
    assert v.sharding.spec == P(("data", "fsdp")) and len(v.addressable_shards) == 8

    one = jax.devices()[0]
    local = jax.device_put((tiny_params, inputs), one)
    v_ref = jax.jit(lambda p, *a: tiny_model.apply({"params": p}, *a))(*(local[0],), *local[1])
    # 2,800 eps = 3.3e-4 of max|v| (12); measured 2.9e-7. Sharding bugs are O(1): rows out of order or half of a kernel lost
    # move outputs by >= 0.3 of their scale (measured on the rollout in tests/test_rollout.py), ~1,000x the bound.
    np.testing.assert_allclose(np.asarray(v), np.asarray(v_ref), rtol=0, atol=FORWARD_TERMS * EPS * float(jnp.abs(v_ref).max()))

    l_sh, g_sh = step(params, *sharded_inputs)
    l_ref, g_ref = jax.jit(jax.value_and_grad(loss))(local[0], *local[1])
    # mean(v^2): twice v's relative error plus a 1,536-term positive sum reordered across devices: (2 x 2,800 + 1,536) eps
    # = 8.5e-4 relative; measured 7e-8
    np.testing.assert_allclose(l_sh, l_ref, rtol=(2 * FORWARD_TERMS + 1536) * EPS)
    assert g_sh["transformer_blocks_0"]["ff"]["fc1"]["kernel"].sharding.spec == P(None, "fsdp")
    for a, b in zip(jax.tree_util.tree_leaves(g_sh), jax.tree_util.tree_leaves(g_ref)):
        # 16,000 eps = 1.9e-3 of each gradient's max|.| (exactly 0 where a leaf's gradient is structurally 0); measured
        # <= 1.2e-6. A lost or doubled all-reduce changes a gradient by O(1) (x 2 for a doubled one): >= 500x the bound.
        a, b = np.asarray(a), np.asarray(b)
        np.testing.assert_allclose(a, b, rtol=0, atol=GRAD_TERMS * EPS * float(np.abs(b).max()))


# ------------------------------------------------------------------------------------------- multi-host start
CLUSTER_VARS = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "TPU_WORKER_HOSTNAMES", "TPU_PROCESS_ADDRESSES",
                "TPU_WORKER_ID", "JAX_COORDINATOR_PORT", "SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE", "GCE_METADATA_IP")


def _fake_pci(root, devices):
    """A /sys/bus/pci/devices stand-in: (vendor, device) per PCI function."""
    for i, (vendor, device) in enumerate(devices):
        d = root / f"0000:00:{i:02x}.0"
        d.mkdir(parents=True)
        (d / "vendor").write_text(vendor + "\n")
        (d / "device").write_text(device + "\n")
    return str(root)


def test_tpu_vm_is_a_tpu_chip_on_the_pci_bus(tmp_path):
    assert parallel.on_tpu_vm(_fake_pci(tmp_path / "v5p", [("0x1ae0", "0x0042"), ("0x1ae0", "0x0062")]))  # gVNIC + a v5p chip
    assert not parallel.on_tpu_vm(_fake_pci(tmp_path / "gce", [("0x1ae0", "0x0042"), ("0x10de", "0x2330")]))  # gVNIC + an H100
    assert not parallel.on_tpu_vm(str(tmp_path / "none"))


def test_distributed_plan_multi_host_slices_only(monkeypatch):
    for var in CLUSTER_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(parallel, "on_tpu_vm", lambda: False)
    assert parallel.distributed_plan("auto") is None  # a laptop
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "10.0.0.5")
    assert parallel.distributed_plan("auto") is None  # one host: a v5p-8 or v6e-8 needs no group
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "10.0.0.5,10.0.0.6,10.0.0.7,10.0.0.8")
    monkeypatch.setenv("TPU_WORKER_ID", "2")
    # off a TPU VM (the simulated pod): the values JAX's GKE detection derives from this environment, its port 8482
    assert parallel.distributed_plan("auto") == {"coordinator_address": "10.0.0.5:8482", "num_processes": 4, "process_id": 2}
    monkeypatch.setenv("JAX_COORDINATOR_PORT", "9999")
    assert parallel.distributed_plan(True)["coordinator_address"] == "10.0.0.5:9999"
    monkeypatch.setattr(parallel, "on_tpu_vm", lambda: True)
    assert parallel.distributed_plan("auto") == {}  # on the TPU VM itself: JAX's own detection, no arguments
    assert parallel.distributed_plan("False") is None  # the switch off, as a command line spells it
    monkeypatch.delenv("TPU_WORKER_HOSTNAMES")
    monkeypatch.delenv("TPU_WORKER_ID")
    # no worker list at all (a single host, or a metadata read that would have missed): a TPU VM always initializes,
    # so no process of a pod runs alone, and JAX's preemption service watches SIGTERM
    assert parallel.tpu_workers() == [] and parallel.distributed_plan("auto") == {}
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "127.0.0.1:1234")
    monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
    monkeypatch.setenv("JAX_PROCESS_ID", "1")
    assert parallel.distributed_plan("auto") == {"num_processes": 2, "process_id": 1}  # by hand, any platform


def test_distributed_switch_parses_command_line_booleans():
    assert [parallel.parse_switch(v) for v in ("auto", "True", "true", "1", "yes", "False", "0", "no", True, False)] == \
        ["auto", True, True, True, True, False, False, False, True, False]
    with pytest.raises(ValueError, match="choose auto, True or False"):
        parallel.parse_switch("maybe")
