"""The Cloud TPU scripts (tpu_scripts/*.sh) end to end on a simulated pod: every worker a folder and a set of
processes on this machine, `gcloud` the stand-in tpu_scripts/standin/gcloud. It checks the scripts' logic and the
train job's multi-host start, stop and resume; it is not Cloud TPU (no TPU, no Google service is involved).

    python benchmarks/simulated_pod.py [--workers 2] [--keep] [--no-pin]

In a temporary root (the stand-in's GCLOUD_STANDIN_ROOT), with the stand-in first on PATH:
  create  create.sh ACCEL=v5p-<8 x workers> (v5p-16: 2 workers of 4 chips; each worker here 4 CPU devices)
  bucket  a prompt dataset (`python -m flowrl_jax.data.datasets`) put into the stand-in bucket gs://sim-bucket/prompts
  stage   stage.sh gs://sim-bucket/prompts: every worker copies it to ~/data/prompts
  setup   setup.sh JAX_PACKAGE='jax>=0.8,<0.13': uv, a Python 3.11 venv per worker, real installs from PyPI (slow the
          first time; uv's cache is kept in ~/.cache/flowrl_simulated_pod across runs). By default the packages are
          pinned (UV_CONSTRAINT) to this machine's venv (`pip freeze`), the versions the tests ran with; --no-pin
          resolves afresh.
  train   train.sh with a tiny flow_grpo config (4 iterations, a checkpoint every iteration, mesh data x fsdp=2, a
          closing eval of 24 prompts);
          the workdir is one local folder shared by the workers (the stand-in for a gs:// bucket)
  step1   wait until step 1's checkpoint exists
  stop    stop.sh: SIGTERM to each worker's job; both must exit 0, each saying it saved the same step
  resume  train.sh again (the same command); both logs must say "resumed from step <saved>", both exit 0, and the
          run end at its last iteration (checkpoint 4)
Every wait is bounded; on a failure the tails of the workers' logs are printed; leftover jobs are killed at the end
(the PIDs in the pidfiles). Prints a table of phases (seconds, pass/fail) and writes
benchmarks/results/simulated_pod.json. The temporary root is removed unless --keep or a phase failed.
"""
from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STANDIN = os.path.join(REPO, "tpu_scripts", "standin")
RESULT = os.path.join(REPO, "benchmarks", "results", "simulated_pod.json")
CACHE = os.path.join(os.path.expanduser("~"), ".cache", "flowrl_simulated_pod")
TPU, ZONE, BUCKET = "simpod", "us-east5-a", "gs://sim-bucket/prompts"
ITERATIONS = 4
EXTRA = ("--config.sampler.num_steps=3 --config.train.iterations=4 --config.train.prompts_per_iteration=2 "
         "--config.train.group_size=4 --config.train.minibatches=2 --config.eval.at_start=False --config.eval.every=0 "
         "--config.checkpoint.every=1 --config.train.lora_rank=0 --config.sampler.sde_window=() "
         "--config.diagnostics.image_change_every=0 --config.min_fsdp_size=64 "
         # the run's closing eval, small (the 420 test prompts x ODE 20 steps take minutes on 2 cores)
         "--config.eval.per_category=4 --config.eval.batch_size=24 --config.eval.num_steps=4")
# Passed as arguments after the script's own (the README's quoted form), and relative to the jobs' folder
# ~/flowrl_jax: ../data/prompts is each worker's own staged copy (the simulated workers' homes differ).
ARGS = ["--config.mesh=(('data',-1),('fsdp',2))", "--config.world.train_prompts=../data/prompts"]


class PhaseFailed(Exception):
    pass


class Pod:
    def __init__(self, root: str, workers: int, pin: bool, verbose: bool):
        self.root, self.workers, self.verbose = root, workers, verbose
        self.workdir = os.path.join(root, "workdir")
        self.homes = [os.path.join(root, "tpus", TPU, f"worker-{i}") for i in range(workers)]
        self.phases: list[dict] = []
        self.facts: dict = {}
        os.makedirs(os.path.join(CACHE, "uv"), exist_ok=True)
        self.env = {**os.environ, "GCLOUD_STANDIN_ROOT": root, "PATH": STANDIN + os.pathsep + os.environ["PATH"],
                    "TPU_NAME": TPU, "ZONE": ZONE, "ACCEL": f"v5p-{8 * workers}",
                    "UV_CACHE_DIR": os.path.join(CACHE, "uv"), "PIP_CACHE_DIR": os.path.join(CACHE, "pip"),
                    "GCLOUD_STANDIN_PASS_ENV": "UV_CACHE_DIR PIP_CACHE_DIR UV_CONSTRAINT SSL_CERT_FILE"}
        # uv trusts its own root certificates; where this machine's TLS goes through a local authority (pip's
        # `cert` setting), the workers' uv is given the system bundle, as a VM behind such a proxy would be.
        cert = os.environ.get("SSL_CERT_FILE") or os.environ.get("PIP_CERT") or "/etc/ssl/certs/ca-certificates.crt"
        if os.path.isfile(cert):
            self.env["SSL_CERT_FILE"] = cert
        for k in ("VIRTUAL_ENV", "GCLOUD_STANDIN_WORKERS", "GCLOUD_STANDIN_CHIPS", "RUNTIME", "EXTRA"):
            self.env.pop(k, None)
        if pin:
            self.env["UV_CONSTRAINT"] = self.constraints()

    def constraints(self) -> str:
        """This venv's versions as uv constraints (local versions and editable installs left out)."""
        frozen = subprocess.run([sys.executable, "-m", "pip", "freeze"], capture_output=True, text=True, check=True,
                                timeout=120).stdout.splitlines()
        lines = [l for l in frozen if "==" in l and "+" not in l and not l.startswith(("-e", "flowrl"))]
        path = os.path.join(self.root, "constraints.txt")
        with open(path, "w") as f:
            f.write("\n".join(lines) + "\n")
        return path

    # ------------------------------------------------------------------------------------------------ running
    def sh(self, name: str, args: list[str], timeout: float, env: dict | None = None) -> str:
        """Run a command (a script), its output to root/<name>.log; a non-zero exit or a timeout fails the phase.
        The stand-in ends its workers' sessions a little before `timeout` (GCLOUD_STANDIN_SSH_TIMEOUT)."""
        env = {**self.env, "GCLOUD_STANDIN_SSH_TIMEOUT": str(max(5, timeout - 10)), **(env or {})}
        log = os.path.join(self.root, f"{name}.log")
        try:
            p = subprocess.run(args, cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, timeout=timeout)
            out, code = p.stdout, p.returncode
        except subprocess.TimeoutExpired as e:
            out, code = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or ""), None
        with open(log, "a") as f:
            f.write(out)
        if self.verbose:
            print(out, end="")
        if code != 0:
            tail = "\n".join(out.splitlines()[-25:])
            raise PhaseFailed(f"{' '.join(args[:2])} {'timed out after %g s' % timeout if code is None else 'exited %d' % code}"
                              f"\n{tail}")
        return out

    def phase(self, name: str, fn) -> None:
        print(f"--- {name}", flush=True)
        t0 = time.time()
        try:
            note = fn() or ""
            ok = True
        except PhaseFailed as e:
            note, ok = str(e), False
        self.phases.append({"phase": name, "seconds": round(time.time() - t0, 1), "ok": ok, "note": note.splitlines()[0] if note else ""})
        print(f"    {'ok' if ok else 'FAILED'} in {time.time() - t0:.1f} s{': ' + note if note else ''}", flush=True)
        if not ok:
            raise PhaseFailed(note)

    def script(self, name: str, script: str, timeout: float, args: list[str] = (), env: dict | None = None) -> str:
        return self.sh(name, ["bash", os.path.join("tpu_scripts", script), *args], timeout, env)

    def home_file(self, worker: int, name: str) -> str | None:
        path = os.path.join(self.homes[worker], name)
        if not os.path.isfile(path):
            return None
        with open(path, errors="replace") as f:
            return f.read()

    def wait(self, what: str, done, timeout: float, poll: float = 0.2):
        deadline = time.time() + timeout
        while time.time() < deadline:
            result = done()
            if result:
                return result
            time.sleep(poll)
        raise PhaseFailed(f"{what}: not within {timeout:g} s")

    def steps_saved(self) -> list[int]:
        return sorted(int(os.path.basename(p)) for p in glob.glob(os.path.join(self.workdir, "checkpoints", "*"))
                      if os.path.basename(p).isdigit() and os.path.isdir(p))

    def exits(self) -> list[str | None]:
        return [(self.home_file(i, "flowrl_train.exit") or "").strip() or None for i in range(self.workers)]

    def pids(self) -> list[int]:
        out = []
        for i in range(self.workers):
            text = (self.home_file(i, "flowrl_train.pid") or "").strip()
            if text.isdigit():
                out.append(int(text))
        return out

    # ------------------------------------------------------------------------------------------------ phases
    def create(self):
        self.script("create", "create.sh", 60)
        with open(os.path.join(self.root, "tpus", TPU, "tpu.json")) as f:
            tpu = json.load(f)
        if tpu["workers"] != self.workers or tpu["runtime"] != "v2-alpha-tpuv5":
            raise PhaseFailed(f"the stand-in recorded {tpu}")
        return f"{tpu['accelerator']}, {tpu['runtime']}, {tpu['workers']} workers x {tpu['chips_per_worker']} devices"

    def bucket(self):
        local = os.path.join(self.root, "upload", "prompts")
        self.sh("bucket", [sys.executable, "-m", "flowrl_jax.data.datasets", "flowrl_jax/data/prompts/train.jsonl",
                           local, "--split", "train"], 300)
        self.sh("bucket", ["gcloud", "storage", "rsync", "--recursive", local, BUCKET], 60)
        return f"{BUCKET}: {', '.join(sorted(os.listdir(local)))}"

    def stage(self):
        self.script("stage", "stage.sh", 120, [BUCKET])
        for i in range(self.workers):
            if not os.path.isfile(os.path.join(self.homes[i], "data", "prompts", "train.array_record")):
                raise PhaseFailed(f"worker {i} has no ~/data/prompts/train.array_record")
        return f"~/data/prompts on {self.workers} workers"

    def setup(self):
        out = self.script("setup", "setup.sh", 2400, env={"JAX_PACKAGE": "jax>=0.8,<0.13"})
        found = re.findall(r"^\[worker (\d+)\] python (\S+) jax (\S+) (\w+) (\d+) local devices", out, re.M)
        if sorted(int(w) for w, *_ in found) != list(range(self.workers)):
            raise PhaseFailed(f"not every worker printed its jax check: {found}")
        _, python, jax_version, backend, devices = found[0]
        return f"python {python}, jax {jax_version}, {backend}, {devices} local devices per worker"

    def train(self, name: str):
        self.logs_before = [len(self.home_file(i, "flowrl_train.log") or "") for i in range(self.workers)]
        self.script(name, "train.sh", 120, ARGS, env={"CONFIG": "configs/flow_grpo.py", "WORKDIR": self.workdir,
                                                      "EXTRA": EXTRA})
        return f"pids {self.pids()}"

    def this_run_logs(self) -> list[str]:
        return [(self.home_file(i, "flowrl_train.log") or "")[self.logs_before[i]:] for i in range(self.workers)]

    def step1(self, timeout: float):
        def ready():
            ended = [e for e in self.exits() if e is not None]
            if ended:
                raise PhaseFailed(f"a job ended before step 1's checkpoint (exit statuses {self.exits()})")
            return 1 in self.steps_saved()
        self.wait("step 1's checkpoint", ready, timeout)
        return f"checkpoints {self.steps_saved()}"

    def stop(self, timeout: float):
        self.script("stop", "stop.sh", timeout + 30, env={"STOP_WAIT": str(int(timeout))})
        self.wait("the exit statuses", lambda: all(e is not None for e in self.exits()), 10)
        exits = self.exits()
        if exits != ["0"] * self.workers:
            raise PhaseFailed(f"exit statuses {exits} (want 0 on every worker)")
        saved = [re.findall(r"saved a checkpoint at step (\d+)", log) for log in self.this_run_logs()]
        if any(len(s) != 1 for s in saved) or len({s[0] for s in saved}) != 1:
            raise PhaseFailed(f"the workers' 'saved a checkpoint at step' lines: {saved}")
        step = int(saved[0][0])
        if step not in self.steps_saved():
            raise PhaseFailed(f"step {step} is not among the checkpoints {self.steps_saved()}")
        self.facts["saved_step"] = step
        return f"every worker exited 0, saved step {step}"

    def resume_end(self, timeout: float):
        self.wait("the resumed run's end", lambda: all(e is not None for e in self.exits()), timeout, poll=1)
        exits, logs, step = self.exits(), self.this_run_logs(), self.facts["saved_step"]
        if exits != ["0"] * self.workers:
            raise PhaseFailed(f"exit statuses {exits} (want 0 on every worker)")
        for i, log in enumerate(logs):
            if f"resumed from step {step} " not in log:
                raise PhaseFailed(f"worker {i}'s log does not say 'resumed from step {step}'")
            if "saved a checkpoint at step" in log:
                raise PhaseFailed(f"worker {i}'s resumed run was stopped early")
        last = max(self.steps_saved(), default=None)
        if last != ITERATIONS:
            raise PhaseFailed(f"the newest checkpoint is step {last}, not the last iteration {ITERATIONS}")
        self.facts["final_step"] = last
        return f"both resumed from step {step}, exited 0, checkpoint {last} = the last iteration"

    # ------------------------------------------------------------------------------------------------ cleanup
    def print_logs(self) -> None:
        for i in range(self.workers):
            log = self.home_file(i, "flowrl_train.log")
            if log:
                print(f"=== worker {i}: the end of ~/flowrl_train.log ({self.homes[i]})")
                print("\n".join(log.splitlines()[-40:]))

    def kill_leftovers(self) -> list[int]:
        alive = []
        for pid in self.pids():
            try:
                os.kill(pid, signal.SIGTERM)
                alive.append(pid)
            except ProcessLookupError:
                pass
        deadline = time.time() + 15
        for pid in alive:
            while time.time() < deadline and os.path.exists(f"/proc/{pid}") and "Z" not in _state(pid):
                time.sleep(0.2)
            if os.path.exists(f"/proc/{pid}") and "Z" not in _state(pid):
                os.kill(pid, signal.SIGKILL)
        return alive


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return "Z"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=2, help="simulated hosts (the slice is v5p-<8 x workers>)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary root (worker folders, logs)")
    parser.add_argument("--no-pin", dest="pin", action="store_false", help="resolve packages afresh, not this venv's versions")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds for each wait on the train job")
    parser.add_argument("--verbose", action="store_true", help="print the scripts' output as well")
    args = parser.parse_args()

    root = tempfile.mkdtemp(prefix="simulated_pod_")
    pod = Pod(root, args.workers, args.pin, args.verbose)
    print(f"simulated pod: {args.workers} workers, root {root} (a stand-in for Cloud TPU, not Cloud TPU)")
    t0, ok = time.time(), False
    try:
        pod.phase("create", pod.create)
        pod.phase("bucket", pod.bucket)
        pod.phase("stage", pod.stage)
        pod.phase("setup", pod.setup)
        pod.phase("train", lambda: pod.train("train"))
        pod.phase("step1", lambda: pod.step1(args.timeout))
        pod.phase("stop", lambda: pod.stop(args.timeout))
        pod.phase("resume", lambda: pod.train("resume"))
        pod.phase("resume_end", lambda: pod.resume_end(args.timeout))
        ok = True
    except PhaseFailed:
        pod.print_logs()
    except KeyboardInterrupt:
        pod.phases.append({"phase": "interrupted", "seconds": 0, "ok": False, "note": "KeyboardInterrupt"})
    finally:
        killed = pod.kill_leftovers()
        if killed:
            print(f"killed leftover train jobs: pids {killed}")

    print(f"\n{'phase':12s} {'seconds':>8s}  result  note")
    for p in pod.phases:
        print(f"{p['phase']:12s} {p['seconds']:8.1f}  {'pass' if p['ok'] else 'FAIL':6s}  {p['note']}")
    print(f"{'total':12s} {time.time() - t0:8.1f}  {'pass' if ok else 'FAIL'}")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    os.makedirs(os.path.dirname(RESULT), exist_ok=True)
    with open(RESULT, "w") as f:
        json.dump({"ok": ok, "what": "tpu_scripts on a simulated pod (tpu_scripts/standin/gcloud), not Cloud TPU",
                   "workers": args.workers, "accelerator": pod.env["ACCEL"], "pinned_to_local_venv": args.pin,
                   "commit": commit, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   "total_s": round(time.time() - t0, 1), **pod.facts, "phases": pod.phases}, f, indent=1)
    print(f"wrote {os.path.relpath(RESULT, REPO)}")
    if args.keep or not ok:
        print(f"kept {root}")
    else:
        shutil.rmtree(root, ignore_errors=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
