"""Shared test setup: 8 simulated CPU devices (must be set before jax is imported) and tiny models."""
import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import shutil  # noqa: E402

import tempfile  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

# The train/pretrain tests rebuild their jitted functions per run; a persistent compilation cache lets identical programs
# skip XLA compilation the second time. One per test run, shared by pytest-xdist's workers (PYTEST_XDIST_TESTRUNUID is the
# run's id in every worker), so a program one worker compiled the other loads (test_train / test_train_methods /
# test_memory_knobs: 580 -> 506 s of worker time). No size cap: a cap turns on JAX's file lock, with which the whole
# suite ran past 25 minutes. Unlocked, an entry read while the other worker writes it fails zlib's checksum (JAX
# compresses with zlib when zstandard is absent, as here): JAX warns and compiles, so a result never depends on it.
_RUN = os.environ.get("PYTEST_XDIST_TESTRUNUID")
_CACHE = os.path.join(tempfile.gettempdir(), f"flowrl_jax_xla_cache_{_RUN}") if _RUN else tempfile.mkdtemp(prefix="flowrl_jax_xla_cache_")
os.makedirs(_CACHE, exist_ok=True)
jax.config.update("jax_compilation_cache_dir", _CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
# Tests run tiny shapes, where XLA's compile time dominates its run time: most optimization passes off cut the suite's
# wall time by about a third (tests/test_sd3.py 88 s -> 56 s). Benchmarks and real runs keep them on.
jax.config.update("jax_disable_most_optimizations", True)
import pytest  # noqa: E402

from flowrl_jax.models import build_mmdit  # noqa: E402
from configs.common import model_config  # noqa: E402
from flowrl_jax.config_lib import load_config  # noqa: E402,F401 (load_config: the tests' import)


@pytest.fixture(scope="session")
def smoke_base(tmp_path_factory):
    """A 6-step smoke pretrain workdir: the base model of the train, method and asset tests. Built once per test run
    (~60 s): pytest-xdist's workers share it through a lock in the run's common temp folder; read-only once written."""
    from filelock import FileLock

    from flowrl_jax import main

    basetemp = tmp_path_factory.getbasetemp()
    root = basetemp.parent if os.environ.get("PYTEST_XDIST_WORKER") else basetemp  # xdist: pytest-N/popen-gwK
    workdir = root / "smoke_base"
    with FileLock(str(root / "smoke_base.lock")):
        if not (workdir / "COMPLETE").exists():
            shutil.rmtree(workdir, ignore_errors=True)  # a worker that died half-way
            main.run_job(load_config("configs/pretrain_shapes.py", "smoke", **{"pretrain.eval_every": 0}), str(workdir))
            (workdir / "COMPLETE").touch()
    return str(workdir)


@pytest.fixture(scope="session")
def tiny_model():
    return build_mmdit(model_config("tiny"))


@pytest.fixture(scope="session")
def tiny_params(tiny_model):
    """Tiny-model params with every leaf random (the default init zeroes the adaLN and output layers,
    which would hide most of the network from a test)."""
    shapes = jax.eval_shape(lambda: tiny_model.init(jax.random.PRNGKey(0), *tiny_model.dummy_inputs())["params"])
    leaves, treedef = jax.tree_util.tree_flatten(shapes)
    keys = jax.random.split(jax.random.PRNGKey(1), len(leaves))
    return jax.tree_util.tree_unflatten(treedef, [0.2 * jax.random.normal(k, s.shape) for k, s in zip(keys, leaves)])


def random_inputs(model, batch=2, text_len=5, height=None, width=None, seed=0):
    """(x [B, H, W, C], t [B] in (0, 1), text_tokens [B, L, J], pooled [B, P])."""
    x, _, txt, pooled = model.dummy_inputs(batch, text_len, height, width)
    k = jax.random.split(jax.random.PRNGKey(seed), 4)
    return (jax.random.normal(k[0], x.shape), jax.random.uniform(k[1], (batch,), minval=0.05, maxval=0.95),
            jax.random.normal(k[2], txt.shape), jax.random.normal(k[3], pooled.shape))


def gaussian_velocity(m, s):
    """Exact v(x, t) = E[eps - x0 | x_t = x] for x0 ~ N(m, s^2) per element, eps ~ N(0, 1),
    x_t = (1 - t) x0 + t eps; `(x [B, ...], t [B]) -> v`."""
    def v(x, t):
        t = jnp.reshape(t, t.shape + (1,) * (x.ndim - jnp.ndim(t)))
        var = (1 - t) ** 2 * s**2 + t**2
        r = x - (1 - t) * m
        return t / var * r - (m + (1 - t) * s**2 / var * r)
    return v


def gaussian_marginal(m, s, t):
    """(mean, std) of x_t for x0 ~ N(m, s^2)."""
    return (1 - t) * m, ((1 - t) ** 2 * s**2 + t**2) ** 0.5
