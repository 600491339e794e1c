"""The entry point: job dispatch, and one-line errors for config mistakes."""
import json
import os
import subprocess
import sys

import pytest
from ml_collections import ConfigDict

from flowrl_jax import config_lib, main


def _run_cli(*args):
    return subprocess.run([sys.executable, "-m", "flowrl_jax.main", *args], capture_output=True, text=True, timeout=300,
                          cwd=str(__import__("pathlib").Path(__file__).parents[1]))


def _error_lines(stderr):
    return [line for line in stderr.splitlines() if line.startswith("flowrl_jax: error:")]


@pytest.mark.parametrize("flag, key", [("--config.nonexistent=1", "nonexistent"), ("--config.model.heads=4", "model.heads")])
def test_unknown_config_key_is_one_line_naming_it(flag, key):
    result = _run_cli("--config", "configs/inspect_mmdit.py:tiny", flag)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    lines = _error_lines(result.stderr)
    assert len(lines) == 1 and repr(key) in lines[0], result.stderr


def test_missing_config_file_is_one_line():
    result = _run_cli("--config", "configs/no_such_config.py")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "no_such_config.py" in _error_lines(result.stderr)[0]


def test_inspect_job_runs_from_the_command_line(tmp_path):
    result = _run_cli("--config", "configs/inspect_mmdit.py:tiny", "--config.inspect.batch_size=8",
                      "--config.mesh=(('data',-1),('fsdp',2))", "--config.min_fsdp_size=1024", f"--workdir={tmp_path}")
    assert result.returncode == 0, result.stderr
    report = json.loads((tmp_path / "inspect.json").read_text())
    assert report["mesh"] == {"data": 4, "fsdp": 2} and report["output_finite"]
    assert report["output_shape"] == [8, 8, 8, 3]
    assert any(row["spec"] != "PartitionSpec()" for row in report["largest"])


def _tiny_inspect_config():
    return __import__("runpy").run_path("configs/inspect_mmdit.py")["get_config"]("tiny")


def test_unknown_job_names_the_known_ones():
    config = _tiny_inspect_config()
    config.job = "no_such_job"
    with pytest.raises(config_lib.ConfigError, match="unknown job 'no_such_job'.*inspect"):
        main.run_job(config, None)


def test_missing_job_field():
    with pytest.raises(config_lib.ConfigError, match="no field 'job'"):
        main.run_job(ConfigDict({"seed": 0}), None)


def test_missing_required_field_is_named():
    config = _tiny_inspect_config().to_dict()
    del config["inspect"]["batch_size"]
    with pytest.raises(config_lib.ConfigError, match="'inspect.batch_size'"):
        main.run_job(ConfigDict(config), None)
    config["inspect"]["batch_size"] = None
    with pytest.raises(config_lib.ConfigError, match="required.*--config.inspect.batch_size"):
        main.run_job(ConfigDict(config), None)


def test_a_pod_worker_left_alone_ends_with_one_line_at_its_deadline(tmp_path):
    """One worker of a 2-host slice started alone: no group forms; at `distributed_timeout_s` one line names the
    coordinator and the fix (JAX itself would abort with a C++ stack trace), exit code 2."""
    import os
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "TPU_WORKER_HOSTNAMES": "127.0.0.1,127.0.0.1", "TPU_WORKER_ID": "0",
           "JAX_COORDINATOR_PORT": str(port)}
    result = subprocess.run([sys.executable, "-m", "flowrl_jax.main", "--config", "configs/flow_grpo.py", f"--workdir={tmp_path}",
                             "--config.distributed_timeout_s=3"], capture_output=True, text=True, timeout=120, env=env,
                            cwd=str(__import__("pathlib").Path(__file__).parents[1]))
    assert result.returncode == 2 and "Traceback" not in result.stderr and "Check failure" not in result.stderr
    lines = _error_lines(result.stderr)
    assert len(lines) == 1 and f"127.0.0.1:{port}" in lines[0] and "within 3 s" in lines[0], result.stderr
    assert not os.listdir(tmp_path)  # it stopped before anything was written


def test_distributed_switch_that_is_no_boolean_is_one_line():
    result = _run_cli("--config", "configs/inspect_mmdit.py:tiny", "--config.distributed=maybe")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "config.distributed='maybe'" in _error_lines(result.stderr)[0]


def test_compilation_cache_setting_names_the_folder():
    """`config.compilation_cache`: "auto" is the workdir's compilation_cache (a user cache without a workdir), a
    folder is itself, "none" and "" are off."""
    from flowrl_jax import compiler

    assert compiler.cache_dir("auto", "/runs/a") == os.path.join("/runs/a", "compilation_cache")
    assert compiler.cache_dir("auto", None) == os.path.expanduser(compiler.DEFAULT_CACHE)
    assert compiler.cache_dir("gs://bucket/cache", "/runs/a") == "gs://bucket/cache"
    assert compiler.cache_dir("none", "/runs/a") is None and compiler.cache_dir("", "/runs/a") is None


@pytest.mark.parametrize("result, code", [({"stopped": "SIGTERM", "resumable": True}, 75), ({"stopped": "time_budget", "resumable": False}, None)])
def test_a_run_stopped_before_its_end_exits_75_and_an_ended_one_0(monkeypatch, result, code):
    """The supervisors' contract (tpu_scripts/supervise.sh, a JobSet's restarts): 75 = saved, rerun the same command."""
    from types import SimpleNamespace

    config = ConfigDict({"job": "train", "distributed": False, "compilation_cache": "none"})
    monkeypatch.setattr(main, "_CONFIG", SimpleNamespace(value=config))
    monkeypatch.setattr(main, "_WORKDIR", SimpleNamespace(value=None))
    monkeypatch.setattr(main, "run_job", lambda config, workdir: result)
    if code is None:
        main.main(["flowrl_jax.main"])  # returns: exit status 0
    else:
        with pytest.raises(SystemExit) as stopped:
            main.main(["flowrl_jax.main"])
        assert stopped.value.code == code
