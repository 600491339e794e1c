"""The Cloud TPU scripts (tpu_scripts/*.sh) end to end on a simulated pod: every worker a folder and a set of
processes on this machine, `gcloud` the stand-in tpu_scripts/standin/gcloud. It checks the scripts' logic and the
train job's multi-host start, stop and resume; it is not Cloud TPU (no TPU, no Google service is involved).

    python benchmarks/simulated_pod.py [--scenario stop|preempt|both] [--workers 2] [--keep] [--no-pin]

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
  stop    stop.sh: SIGTERM to each worker's job; both must exit 75 (stopped by a signal, resumable), each saying it
          saved the same step (the JSON records the status)
  resume  train.sh again (the same command); both logs must say "resumed from step <saved>", both exit 0, and the
          run end at its last iteration (checkpoint 4)
The preemption drill (--scenario preempt; `both`, the default, runs the stop scenario and then the drill on the same
slice):
  reference  launch.sh: the same tiny run, uninterrupted, in the foreground (workdir root/reference)
  train      train.sh (workdir root/drill), then supervise.sh in the background (POLL 2 s)
  stepK      wait until step K's checkpoint exists (K = 2 of 4)
  preempt    the stand-in's `tpu-vm simulate-preemption --notice=1`: state PREEMPTED, SIGTERM to every process of
             the workers, SIGKILL after 1 s (shorter than an iteration: the iteration in flight is lost), disks wiped
  recovered  the supervisor sees PREEMPTED and runs recover.sh (delete, create, stage, setup from uv's cache, train);
             the run must complete (the supervisor exits 0), resume from the last step saved before the preemption
             (only the in-flight iteration redone), and end bit-equal to the reference: every leaf of the final
             checkpoint's state (np.array_equal) and eval.json's last table
  The recovery's wall time by phase: notice, detect (preemption -> recover.sh starts), delete, create, stage,
  setup, train (train.sh), resume (train.sh -> the first new checkpoint: loading, compiling, one iteration), and the
  total from the preemption to that checkpoint; in the table and in the JSON's "preemption_drill" section.
Every wait is bounded; on a failure the tails of the workers' logs are printed; leftover jobs are killed at the end
(the PIDs in the pidfiles). Prints a table of phases (seconds, pass/fail) and writes
benchmarks/results/simulated_pod.json (a scenario run alone keeps the other's keys from the file). The temporary root
is removed unless --keep or a phase failed.
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
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STANDIN = os.path.join(REPO, "tpu_scripts", "standin")
RESULT = os.path.join(REPO, "benchmarks", "results", "simulated_pod.json")
CACHE = os.path.join(os.path.expanduser("~"), ".cache", "flowrl_simulated_pod")
TPU, ZONE, BUCKET = "simpod", "us-east5-a", "gs://sim-bucket/prompts"
ITERATIONS = 4
DRILL_STEP, DRILL_NOTICE_S, DRILL_POLL_S = 2, 1, 2  # preempt once step 2 is saved, 1 s notice, the supervisor's poll
EXTRA = ("--config.sampler.num_steps=3 --config.train.iterations=4 --config.train.prompts_per_iteration=2 "
         "--config.train.group_size=4 --config.train.minibatches=2 --config.eval.at_start=False --config.eval.every=0 "
         "--config.checkpoint.every=1 --config.train.lora_rank=0 --config.sampler.sde_window=() "
         "--config.diagnostics.image_change_every=0 --config.min_fsdp_size=64 "
         # the run's closing eval, small (the 420 test prompts x ODE 20 steps take minutes on 2 cores)
         "--config.eval.per_category=4 --config.eval.batch_size=24 --config.eval.num_steps=4")
# Passed as arguments after the script's own (the README's quoted form), and relative to the jobs' folder
# ~/flowrl_jax: ../data/prompts is each worker's own staged copy (the simulated workers' homes differ).
ARGS = ["--config.mesh=(('data',-1),('fsdp',2))", "--config.world.train_prompts=../data/prompts"]
JAX_PACKAGE = "jax>=0.8,<0.13"
CREATE_FLAGS = "--spot"  # passed through create.sh (the stand-in records it); recover.sh makes the slice again with it
# Every leaf of two checkpoints' states, compared in a fresh process (one CPU device reads the 2-process checkpoint).
COMPARE = r"""
import json, sys
import jax, numpy as np
from flowrl_jax.checkpoint import Checkpointer
step = int(sys.argv[3])
trees = []
for d in sys.argv[1:3]:
    with Checkpointer(d) as c:
        trees.append(jax.tree_util.tree_flatten_with_path(c.restore(step, None)[0]))
(a, ta), (b, tb) = trees
differ = [jax.tree_util.keystr(p) for (p, x), (_, y) in zip(a, b) if not np.array_equal(np.asarray(x), np.asarray(y))]
print(json.dumps({"leaves": len(a), "same_structure": ta == tb, "differ": differ[:10], "n_differ": len(differ)}))
"""


class PhaseFailed(Exception):
    pass


class Pod:
    def __init__(self, root: str, workers: int, pin: bool, verbose: bool):
        self.root, self.workers, self.verbose = root, workers, verbose
        self.workdir = os.path.join(root, "workdir")
        self.homes = [os.path.join(root, "tpus", TPU, f"worker-{i}") for i in range(workers)]
        self.phases: list[dict] = []
        self.section = self.phases  # where phase() records: the stop scenario's list, or the drill's
        self.facts: dict = {}
        self.drill: dict = {"phases": []}
        self.supervisor: subprocess.Popen | None = None
        os.makedirs(os.path.join(CACHE, "uv"), exist_ok=True)
        self.env = {**os.environ, "GCLOUD_STANDIN_ROOT": root, "PATH": STANDIN + os.pathsep + os.environ["PATH"],
                    "TPU_NAME": TPU, "ZONE": ZONE, "ACCEL": f"v5p-{8 * workers}", "CREATE_FLAGS": CREATE_FLAGS,
                    "UV_CACHE_DIR": os.path.join(CACHE, "uv"), "PIP_CACHE_DIR": os.path.join(CACHE, "pip"),
                    "GCLOUD_STANDIN_PASS_ENV": "UV_CACHE_DIR PIP_CACHE_DIR UV_CONSTRAINT SSL_CERT_FILE"}
        # uv trusts its own root certificates; where this machine's TLS goes through a local authority (pip's
        # `cert` setting), the workers' uv is given the system bundle, as a VM behind such a proxy would be.
        cert = os.environ.get("SSL_CERT_FILE") or os.environ.get("PIP_CERT") or "/etc/ssl/certs/ca-certificates.crt"
        if os.path.isfile(cert):
            self.env["SSL_CERT_FILE"] = cert
        for k in ("VIRTUAL_ENV", "GCLOUD_STANDIN_WORKERS", "GCLOUD_STANDIN_CHIPS", "RUNTIME", "EXTRA", "QUEUED",
                  "STOP_WAIT", "FORCE", "RECOVER_STEPS", "STAGE_DIR"):
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
        self.section.append({"phase": name, "seconds": round(time.time() - t0, 1), "ok": ok, "note": note.splitlines()[0] if note else ""})
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

    def steps_saved(self, workdir: str | None = None) -> list[int]:
        return sorted(int(os.path.basename(p)) for p in glob.glob(os.path.join(workdir or self.workdir, "checkpoints", "*"))
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
    def tpu(self) -> dict:
        with open(os.path.join(self.root, "tpus", TPU, "tpu.json")) as f:
            return json.load(f)

    def create(self):
        self.script("create", "create.sh", 60)
        tpu = self.tpu()
        if tpu["workers"] != self.workers or tpu["runtime"] != "v2-alpha-tpuv5" or tpu["flags"] != CREATE_FLAGS.split():
            raise PhaseFailed(f"the stand-in recorded {tpu}")
        return (f"{tpu['accelerator']}, {tpu['runtime']}, {tpu['workers']} workers x {tpu['chips_per_worker']} devices, "
                f"{' '.join(tpu['flags'])}")

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
        out = self.script("setup", "setup.sh", 2400, env={"JAX_PACKAGE": JAX_PACKAGE})
        found = re.findall(r"^\[worker (\d+)\] python (\S+) jax (\S+) (\w+) (\d+) local devices", out, re.M)
        if sorted(int(w) for w, *_ in found) != list(range(self.workers)):
            raise PhaseFailed(f"not every worker printed its jax check: {found}")
        _, python, jax_version, backend, devices = found[0]
        return f"python {python}, jax {jax_version}, {backend}, {devices} local devices per worker"

    def job_env(self, workdir: str) -> dict:
        return {"CONFIG": "configs/flow_grpo.py", "WORKDIR": workdir, "EXTRA": EXTRA}

    def train(self, name: str, workdir: str | None = None):
        self.logs_before = [len(self.home_file(i, "flowrl_train.log") or "") for i in range(self.workers)]
        self.script(name, "train.sh", 120, ARGS, env=self.job_env(workdir or self.workdir))
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
        # 75: stopped by a signal after saving (resumable; flowrl_jax/main.py), recorded (stop_exit)
        if len(set(exits)) != 1 or exits[0] != "75":
            raise PhaseFailed(f"exit statuses {exits} (want 75 on every worker)")
        self.facts["stop_exit"] = int(exits[0])
        saved = [re.findall(r"saved a checkpoint at step (\d+)", log) for log in self.this_run_logs()]
        if any(len(s) != 1 for s in saved) or len({s[0] for s in saved}) != 1:
            raise PhaseFailed(f"the workers' 'saved a checkpoint at step' lines: {saved}")
        step = int(saved[0][0])
        if step not in self.steps_saved():
            raise PhaseFailed(f"step {step} is not among the checkpoints {self.steps_saved()}")
        self.facts["saved_step"] = step
        return f"every worker exited {exits[0]}, saved step {step}"

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

    # ------------------------------------------------------------------------------------------------ the drill
    def reference(self, timeout: float):
        """The same tiny run, uninterrupted (launch.sh, foreground): what the preempted run must end equal to."""
        self.ref_dir, self.drill_dir = os.path.join(self.root, "reference"), os.path.join(self.root, "drill")
        self.script("reference", "launch.sh", timeout, ARGS, env=self.job_env(self.ref_dir))
        last = max(self.steps_saved(self.ref_dir), default=None)
        if last != ITERATIONS:
            raise PhaseFailed(f"the reference's newest checkpoint is {last}, not {ITERATIONS}")
        return f"uninterrupted run to checkpoint {last} (launch.sh)"

    def supervise(self):
        """supervise.sh in the background, on the running job (its output to root/supervise.log)."""
        env = {**self.env, **self.job_env(self.drill_dir), "STAGE_SOURCES": BUCKET, "JAX_PACKAGE": JAX_PACKAGE,
               "POLL": str(DRILL_POLL_S), "MAX_RECOVERIES": "3", "UNHEALTHY_POLLS": "10", "RETRY_PAUSE": "5"}
        self.supervise_log = os.path.join(self.root, "supervise.log")
        with open(self.supervise_log, "w") as log:
            self.supervisor = subprocess.Popen(["bash", os.path.join("tpu_scripts", "supervise.sh"), *ARGS], cwd=REPO,
                                               env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                               start_new_session=True)
        self.seen: dict = {}  # what -> when it was first seen (the watcher thread)
        threading.Thread(target=self.watch, daemon=True).start()
        return f"supervise.sh pid {self.supervisor.pid}, POLL {DRILL_POLL_S} s"

    def watch(self) -> None:
        """While the supervisor runs, note when recover.sh starts, when its train step is done, and when each
        checkpoint step first exists (every 50 ms, so the recovery's phases are timed from outside the scripts)."""
        while self.supervisor.poll() is None:
            text = self.supervisor_log()
            if "recover_start" not in self.seen and "recover.sh: delete (try 1" in text:
                self.seen["recover_start"] = time.time()
            if "train_started" not in self.seen and re.search(r"^recover\.sh: train [\d.]+ s$", text, re.MULTILINE):
                self.seen["train_started"] = time.time()
            for step in self.steps_saved(self.drill_dir):
                self.seen.setdefault(("step", step), time.time())
            time.sleep(0.05)

    def supervisor_log(self) -> str:
        with open(self.supervise_log, errors="replace") as f:
            return f.read()

    def step_k(self, timeout: float):
        def ready():
            if self.supervisor.poll() is not None:
                raise PhaseFailed(f"supervise.sh exited {self.supervisor.returncode} before step {DRILL_STEP}:\n"
                                  + self.supervisor_log()[-2000:])
            return DRILL_STEP in self.steps_saved(self.drill_dir)
        self.wait(f"step {DRILL_STEP}'s checkpoint", ready, timeout, poll=0.05)
        return f"checkpoints {self.steps_saved(self.drill_dir)}"

    def preempt(self):
        self.t_preempt = time.time()
        out = self.sh("preempt", ["gcloud", "compute", "tpus", "tpu-vm", "simulate-preemption", TPU, f"--zone={ZONE}",
                                  f"--notice={DRILL_NOTICE_S}"], 120)
        down = re.search(r"the VMs were down after ([\d.]+) s", out)
        if not down:
            raise PhaseFailed(f"simulate-preemption did not say when the VMs were down: {out}")
        self.drill["recovery_s"] = {"notice": float(down.group(1))}
        self.t_preempted = self.t_preempt + float(down.group(1))  # from then on the slice is PREEMPTED
        saved = self.steps_saved(self.drill_dir)
        self.drill["saved_before_preemption"] = max(saved)
        return f"{out.strip().splitlines()[-1]}; checkpoints {saved}"

    def recovered(self, timeout: float):
        """Wait for the supervisor to end the run; note when recover.sh starts and when the first new step is saved."""
        deadline, before = time.time() + timeout, self.drill["saved_before_preemption"]
        while self.supervisor.poll() is None:
            if time.time() > deadline:
                raise PhaseFailed(f"supervise.sh did not finish the run within {timeout:g} s:\n" + self.supervisor_log()[-2000:])
            time.sleep(0.5)
        time.sleep(0.2)  # the watcher's last look
        seen = dict(self.seen)
        if ("step", before + 1) in seen:
            seen["first_new_step"] = seen[("step", before + 1)]
        text, code = self.supervisor_log(), self.supervisor.returncode
        self.drill["supervisor_exit"] = code
        self.drill["supervisor_decisions"] = [line.split("] ", 1)[1] for line in text.splitlines()
                                              if line.startswith("[supervise.sh") and ("relaunch" in line or "recover" in line
                                                                                      or ": done" in line)]
        if code != 0:
            raise PhaseFailed(f"supervise.sh exited {code}:\n" + text[-2000:])
        # The disks were wiped: setup made each worker's venv afresh (from uv's cache), not updated the old one.
        made = len(re.findall(r"^\[worker \d+\] Creating virtual environment at: \.venv", text, re.MULTILINE))
        if made != self.workers:
            raise PhaseFailed(f"setup made {made} new venvs during the recovery, not {self.workers} (disks not wiped?)")
        rec = self.drill["recovery_s"]
        if "recover_start" in seen:
            rec["detect"] = round(seen["recover_start"] - self.t_preempted, 1)
        for step, secs in re.findall(r"^recover\.sh: (delete|create|stage|setup|train) ([\d.]+) s$", text, re.MULTILINE):
            rec[step] = float(secs)
        if "train_started" in seen and "first_new_step" in seen:
            rec["resume_to_first_new_step"] = round(seen["first_new_step"] - seen["train_started"], 1)
            rec["total_to_first_new_step"] = round(seen["first_new_step"] - self.t_preempt, 1)
        missing = [k for k in ("detect", "delete", "create", "stage", "setup", "train", "resume_to_first_new_step") if k not in rec]
        if missing:
            raise PhaseFailed(f"the recovery's phases {missing} were not seen in supervise.log / the workdir")
        logs = [self.home_file(i, "flowrl_train.log") or "" for i in range(self.workers)]  # the disks were wiped: this run's
        resumed = [re.findall(r"resumed from step (\d+) ", log) for log in logs]
        if any(len(r) != 1 for r in resumed) or len({r[0] for r in resumed}) != 1:
            raise PhaseFailed(f"the workers' 'resumed from step' lines: {resumed}")
        step = int(resumed[0][0])
        self.drill["resumed_from"] = step
        if step < before:
            raise PhaseFailed(f"resumed from step {step}, but step {before} was saved before the preemption")
        last = max(self.steps_saved(self.drill_dir), default=None)
        if last != ITERATIONS:
            raise PhaseFailed(f"the newest checkpoint is step {last}, not the last iteration {ITERATIONS}")
        self.drill["iterations_redone"] = 1 if step == before else 0  # the one in flight when the slice went
        return (f"supervise.sh exit 0 after {len([d for d in self.drill['supervisor_decisions'] if 'recover ' in d])} "
                f"recovery (new venvs on {made} wiped workers); resumed from step {step} (saved before: {before}), "
                f"checkpoint {last}")

    def compare(self):
        p = subprocess.run([sys.executable, "-c", COMPARE, os.path.join(self.ref_dir, "checkpoints"),
                            os.path.join(self.drill_dir, "checkpoints"), str(ITERATIONS)], cwd=REPO,
                           env={**os.environ, "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True, timeout=600, check=False)
        if p.returncode != 0:
            raise PhaseFailed(f"the checkpoint comparison failed:\n{p.stderr[-2000:]}")
        result = json.loads(p.stdout.strip().splitlines()[-1])
        self.drill["state_leaves"], self.drill["state_bit_equal"] = result["leaves"], result["n_differ"] == 0 and result["same_structure"]
        tables = []
        for d in (self.ref_dir, self.drill_dir):
            with open(os.path.join(d, "eval.json")) as f:
                last = json.load(f)["evals"][-1]
            tables.append((last["step"], last["table"]))
        self.drill["eval_table_equal"] = tables[0] == tables[1]
        if not self.drill["state_bit_equal"]:
            raise PhaseFailed(f"the final states differ from the reference's: {result}")
        if not self.drill["eval_table_equal"]:
            raise PhaseFailed(f"eval.json's last table differs: reference {tables[0]}, drill {tables[1]}")
        return (f"step {ITERATIONS}: {result['leaves']} state leaves bit-equal to the reference's, eval table "
                f"(step {tables[0][0]}, {len(tables[0][1])} rows) equal")

    # ------------------------------------------------------------------------------------------------ cleanup
    def print_logs(self) -> None:
        for i in range(self.workers):
            log = self.home_file(i, "flowrl_train.log")
            if log:
                print(f"=== worker {i}: the end of ~/flowrl_train.log ({self.homes[i]})")
                print("\n".join(log.splitlines()[-40:]))

    def kill_leftovers(self) -> list[int]:
        alive = []
        if self.supervisor is not None and self.supervisor.poll() is None:  # its session: it and what it runs
            os.killpg(self.supervisor.pid, signal.SIGTERM)
            try:
                self.supervisor.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.supervisor.pid, signal.SIGKILL)
            alive.append(self.supervisor.pid)
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
    parser.add_argument("--scenario", choices=("stop", "preempt", "both"), default="both",
                        help="stop: stop.sh and resume; preempt: the preemption drill under supervise.sh; both (default)")
    parser.add_argument("--workers", type=int, default=2, help="simulated hosts (the slice is v5p-<8 x workers>)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary root (worker folders, logs)")
    parser.add_argument("--no-pin", dest="pin", action="store_false", help="resolve packages afresh, not this venv's versions")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds for each wait on the train job")
    parser.add_argument("--verbose", action="store_true", help="print the scripts' output as well")
    args = parser.parse_args()

    root = tempfile.mkdtemp(prefix="simulated_pod_")
    pod = Pod(root, args.workers, args.pin, args.verbose)
    print(f"simulated pod: {args.workers} workers, root {root} (a stand-in for Cloud TPU, not Cloud TPU)")
    stop, drill = args.scenario in ("stop", "both"), args.scenario in ("preempt", "both")
    t0, ok = time.time(), False
    try:
        if not stop:
            pod.section = pod.drill["phases"]
        pod.phase("create", pod.create)
        pod.phase("bucket", pod.bucket)
        pod.phase("stage", pod.stage)
        pod.phase("setup", pod.setup)
        if stop:
            pod.phase("train", lambda: pod.train("train"))
            pod.phase("step1", lambda: pod.step1(args.timeout))
            pod.phase("stop", lambda: pod.stop(args.timeout))
            pod.phase("resume", lambda: pod.train("resume"))
            pod.phase("resume_end", lambda: pod.resume_end(args.timeout))
        stop_ok = stop
        if drill:
            pod.section = pod.drill["phases"]
            t_drill = time.time()
            pod.phase("reference", lambda: pod.reference(args.timeout))
            pod.phase("drill_train", lambda: pod.train("drill_train", pod.drill_dir))
            pod.phase("supervise", pod.supervise)
            pod.phase(f"step{DRILL_STEP}", lambda: pod.step_k(args.timeout))
            pod.phase("preempt", pod.preempt)
            pod.phase("recovered", lambda: pod.recovered(args.timeout + 2400))
            pod.phase("compare", pod.compare)
            pod.drill.update(ok=True, total_s=round(time.time() - t_drill, 1))
        ok = True
    except PhaseFailed:
        pod.print_logs()
        if drill and pod.section is pod.drill["phases"]:
            pod.drill["ok"] = False
            if pod.supervisor is not None:
                print("=== supervise.log (end)\n" + pod.supervisor_log()[-3000:])
    except KeyboardInterrupt:
        pod.section.append({"phase": "interrupted", "seconds": 0, "ok": False, "note": "KeyboardInterrupt"})
    finally:
        killed = pod.kill_leftovers()
        if killed:
            print(f"killed leftovers: pids {killed}")

    print(f"\n{'phase':12s} {'seconds':>8s}  result  note")
    for p in pod.phases + (pod.drill["phases"] if drill else []):
        print(f"{p['phase']:12s} {p['seconds']:8.1f}  {'pass' if p['ok'] else 'FAIL':6s}  {p['note']}")
    print(f"{'total':12s} {time.time() - t0:8.1f}  {'pass' if ok else 'FAIL'}")
    if drill and pod.drill.get("recovery_s"):
        print("\nthe recovery after the preemption (seconds):")
        for k, v in pod.drill["recovery_s"].items():
            print(f"  {k:26s} {v:8.1f}")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    try:
        with open(RESULT) as f:
            result = json.load(f)  # a scenario run alone keeps the other's keys
    except (OSError, ValueError):
        result = {}
    if stop:
        for key in ("saved_step", "final_step", "stop_exit"):
            result.pop(key, None)
        result.update({"ok": ok if not drill else stop_ok and all(p["ok"] for p in pod.phases),
                       "what": "tpu_scripts on a simulated pod (tpu_scripts/standin/gcloud), not Cloud TPU",
                       "workers": args.workers, "accelerator": pod.env["ACCEL"], "pinned_to_local_venv": args.pin,
                       "commit": commit, "date": date, "total_s": round(sum(p["seconds"] for p in pod.phases), 1), **pod.facts,
                       "phases": pod.phases})
    if drill:
        pod.drill.setdefault("ok", False)
        result["preemption_drill"] = {"what": f"preempted after step {DRILL_STEP}'s checkpoint (notice "
                                              f"{DRILL_NOTICE_S} s), recovered by supervise.sh + recover.sh",
                                      "commit": commit, "date": date, "workers": args.workers,
                                      "iterations": ITERATIONS, **pod.drill}
    os.makedirs(os.path.dirname(RESULT), exist_ok=True)
    with open(RESULT, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {os.path.relpath(RESULT, REPO)}")
    if args.keep or not ok:
        print(f"kept {root}")
    else:
        shutil.rmtree(root, ignore_errors=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
