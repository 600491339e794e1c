"""Multi-host for real, on localhost: 2 processes x 4 CPU devices run the train job (`python -m flowrl_jax.main`, the
TPU runtime's worker environment `TPU_WORKER_HOSTNAMES` / `TPU_WORKER_ID` / `JAX_COORDINATOR_PORT` as a pod slice
gives it, gloo collectives) and agree with 1 process x 8 devices. SIGTERM goes to one process only, in the middle of an
iteration: both save the same step and exit; the same command resumes, and the run ends bit-equal to an uninterrupted
one, evals included. The SIGTERM goes to JAX's preemption service (`jax.distributed` installs its notifier; the train
job leaves SIGTERM to it in a multi-process run), whose sync point stops both processes after the same iteration.
Bounded: every process is killed after TIMEOUT_S."""
import json
import os
import signal
import socket
import subprocess
import sys
import threading

import jax
import numpy as np

from tests.conftest import load_config
from tests.test_train import TINY, _state

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT_S = 420  # two processes compiling on 2 cores: ~60 s measured
FIELDS = {**TINY, "train.iterations": 2, "mesh": (("data", 4), ("fsdp", 2)), "min_fsdp_size": 64, "sampler.num_steps": 2,
          "eval.num_steps": 1, "eval.at_start": True, "checkpoint.every": 0,  # saved at a stop or at the end only
          "train.rewards": (("learned", 1.0),)}  # a continuous reward: every advantage non-zero


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(base: str, workdir: str, sigterm_after: str | None = None, cache: str | None = None, **overrides) -> list[str]:
    """Run the train job as 2 processes x 4 devices; -> their outputs (fails with them if either fails: an exit status
    other than 0, or 75 after a SIGTERM). With `sigterm_after`, process 1 alone gets SIGTERM once process 0 has printed
    that text. `cache`: a persistent compilation cache folder the launches share (JAX_COMPILATION_CACHE_DIR, which the
    job keeps: `compiler.use_persistent_cache`), so a later launch loads what an earlier one compiled, as a restarted
    pod does from its workdir's cache."""
    fields = {**FIELDS, "world.base": base, **overrides}
    flags = [f"--config.{k}={v!r}" if not isinstance(v, str) else f"--config.{k}={v}" for k, v in fields.items()]
    port = _free_port()
    procs, outputs, readers, seen = [], [[], []], [], threading.Event()
    for i in range(2):
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
               "TPU_WORKER_HOSTNAMES": "127.0.0.1,127.0.0.1", "TPU_WORKER_ID": str(i), "JAX_COORDINATOR_PORT": str(port),
               "JAX_DISABLE_MOST_OPTIMIZATIONS": "1", "PYTHONUNBUFFERED": "1",  # as the in-process tests (conftest)
               **({"JAX_COMPILATION_CACHE_DIR": cache, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"} if cache else {})}
        procs.append(subprocess.Popen([sys.executable, "-m", "flowrl_jax.main", "--config", "configs/flow_grpo.py",
                                       "--workdir", workdir, *flags], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))

    def read(i):
        for line in procs[i].stdout:
            outputs[i].append(line)
            if i == 0 and sigterm_after and sigterm_after in line:
                seen.set()

    readers = [threading.Thread(target=read, args=(i,), daemon=True) for i in range(2)]
    for r in readers:
        r.start()
    try:
        if sigterm_after:
            assert seen.wait(TIMEOUT_S), "".join(outputs[0])[-3000:]
            procs[1].send_signal(signal.SIGTERM)
        for p in procs:
            p.wait(timeout=TIMEOUT_S)
    finally:
        for p in procs:
            p.kill()
    for r in readers:
        r.join(timeout=10)
    texts = ["".join(o) for o in outputs]
    for p, out in zip(procs, texts):
        expected = 75 if sigterm_after else 0  # 75: stopped and saved, rerun the same command (main.EXIT_RERUN_LATER)
        assert p.returncode == expected, f"process exited with {p.returncode}, not {expected}:\n{out[-3000:]}"
    return texts


def _rows(workdir: str) -> list[dict]:
    return [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl")) if '"reward"' in line]


def test_two_processes_agree_with_one_stop_together_on_one_sigterm_and_resume_bit_equal(smoke_base, tmp_path):
    from flowrl_jax import main

    two, one, straight = str(tmp_path / "two"), str(tmp_path / "one"), str(tmp_path / "straight")
    cache = str(tmp_path / "xla_cache")  # shared by the three launches: only the first compiles
    outputs = _launch(smoke_base, two, sigterm_after="eval at step 0", cache=cache)  # process 1 alone, during the first iteration
    for out in outputs:  # process 1's notice, propagated to process 0 by the service
        assert "a preemption notice (SIGTERM to a process of the run): saved a checkpoint at step 1" in out
    assert sorted(os.listdir(os.path.join(two, "checkpoints"))) == ["1"]  # the same step, once, then both exited
    main.run_job(load_config("configs/flow_grpo.py", **{**FIELDS, "world.base": smoke_base, "train.iterations": 1,
                                                        "eval.at_start": False}), one)  # 1 process x 8 devices

    rows = [_rows(two)[0], _rows(one)[0]]
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

    outputs = _launch(smoke_base, two, cache=cache)  # the same command: resumes from step 1 and runs to the end
    assert all("resumed from step 1" in out for out in outputs)
    _launch(smoke_base, straight, cache=cache)  # the same run, never interrupted
    assert [r["step"] for r in _rows(two)] == [1, 2] and [r["step"] for r in _rows(straight)] == [1, 2]
    ends = [_state(two), _state(straight)]
    assert int(ends[0]["step"]) == int(ends[1]["step"]) == 2
    for x, y in zip(jax.tree_util.tree_leaves(ends[0]), jax.tree_util.tree_leaves(ends[1])):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))  # same prompts, noise and reductions: bit-equal
    evals = [json.load(open(os.path.join(d, "eval.json")))["evals"] for d in (two, straight)]
    assert [e["step"] for e in evals[0]] == [e["step"] for e in evals[1]] == [0, 2]  # the eval ran on 2 processes
    assert [e["table"] for e in evals[0]] == [e["table"] for e in evals[1]]
    assert sorted(os.listdir(two)) == sorted(os.listdir(straight))  # process 0 wrote the run's files, nothing else did
