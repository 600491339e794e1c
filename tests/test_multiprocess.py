"""Multi-host for real, on localhost: 2 processes x 4 CPU devices run the train job (`python -m flowrl_jax.main`,
`JAX_COORDINATOR_ADDRESS` / `JAX_NUM_PROCESSES` / `JAX_PROCESS_ID`, gloo collectives) and agree with 1 process x 8
devices; the 2-process run then resumes from its checkpoint. Bounded: every process is killed after TIMEOUT_S."""
import json
import os
import socket
import subprocess
import sys

import jax
import numpy as np

from tests.conftest import load_config
from tests.test_train import TINY, _state

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT_S = 420  # two processes compiling on 2 cores: ~60 s measured
FIELDS = {**TINY, "train.iterations": 1, "mesh": (("data", 4), ("fsdp", 2)), "min_fsdp_size": 64, "sampler.num_steps": 2,
          "eval.num_steps": 1, "train.rewards": (("learned", 1.0),)}  # a continuous reward: every advantage non-zero


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(base: str, workdir: str, **overrides) -> list[str]:
    """Run the train job as 2 processes x 4 devices; -> their outputs (fails with them if either fails)."""
    fields = {**FIELDS, "world.base": base, **overrides}
    flags = [f"--config.{k}={v!r}" if not isinstance(v, str) else f"--config.{k}={v}" for k, v in fields.items()]
    port = _free_port()
    procs = []
    for i in range(2):
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
               "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": str(i),
               "JAX_DISABLE_MOST_OPTIMIZATIONS": "1"}  # as the in-process tests (conftest)
        procs.append(subprocess.Popen([sys.executable, "-m", "flowrl_jax.main", "--config", "configs/flow_grpo.py",
                                       "--workdir", workdir, *flags], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=TIMEOUT_S)[0])
    finally:
        for p in procs:
            p.kill()
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, f"process exited with {p.returncode}:\n{out[-3000:]}"
    return outputs


def _first_row(workdir: str) -> dict:
    return [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl")) if '"reward"' in line][0]


def test_two_processes_agree_with_one_and_resume(smoke_base, tmp_path):
    from flowrl_jax import main

    two, one = str(tmp_path / "two"), str(tmp_path / "one")
    _launch(smoke_base, two)
    main.run_job(load_config("configs/flow_grpo.py", **{**FIELDS, "world.base": smoke_base}), one)  # 1 process x 8 devices

    rows = [_first_row(two), _first_row(one)]
    assert rows[0]["reward_std"] > 1e-3  # a real signal to agree on
    # Tolerances as tests/test_train.py's 8-vs-1-device run (derived there): the same global batch and noise, sums over
    # up to ~16k terms reduced in another order across devices and processes; a wrong row or an unreduced gradient is O(1).
    for key in ("reward", "reward_std", "loss", "policy_loss", "kl", "clipfrac", "grad_norm"):
        # rtol 2e-3 >= K eps = 16e3 x 1.2e-7 for sums of <= ~16k terms in another order; atol 1e-6 for values near 0
        np.testing.assert_allclose(rows[0][key], rows[1][key], rtol=2e-3, atol=1e-6, err_msg=key)  # derived on the line above
    a, b = _state(two), _state(one)
    diffs = np.concatenate([np.abs(np.asarray(x) - np.asarray(y)).ravel()
                            for x, y in zip(jax.tree_util.tree_leaves(a["params"]), jax.tree_util.tree_leaves(b["params"]))])
    assert diffs.max() <= 2 * TINY["train.lr"] and np.mean(diffs > 1e-5) < 0.005  # Adam's ~lr sign steps (test_train)
    assert sorted(os.listdir(two)) == sorted(os.listdir(one))  # process 0 wrote the run's files, nothing else did

    outputs = _launch(smoke_base, two, **{"train.iterations": 2})  # the same run, continued
    assert all("resumed from step 1" in out for out in outputs)
    assert [r["step"] for r in map(json.loads, open(os.path.join(two, "metrics.jsonl"))) if "reward" in r] == [1, 2]
    assert int(_state(two)["step"]) == 2
