"""The reward service on loopback: the server under load, and scoring overlapped with sampling in the train loop.

    python benchmarks/reward_service.py [--clients 8] [--requests 25] [--iterations 5] [--out benchmarks/results/reward_service.json]

1. Load: `--clients` threads each send `--requests` batches (16 images of 32 x 32, the JPEG reward) to one
   `python -m flowrl_jax.rewards.serve` process; p50 / p99 latency of a request (the client's retries included) and
   requests per second over the whole run.
2. Overlap: `configs/flow_grpo_cpu.py` (8 prompts x 12 images, 2-core laptop shapes) trains on
   `remote:shapes_score@...` served by a server that sleeps `--delay_s` per batch (1 s, and 0.25 s where scoring
   costs about what sampling does here), a slow model's stand-in.
   The rollout is cut into 4 chunks of 24 rows (`train.rollout_chunk`) and requests carry 24 rows, so both runs send
   the same 4 requests per iteration: scored after the rollout (sequential), or each chunk while the next samples
   (`train.score_while_sampling`). Iteration time = rollout + reward + update, the mean over iterations 2.. (the first
   compiles). The rollout's own time hides in the reward's (JAX dispatches it asynchronously: the scoring waits for
it), so the table gives the two together. Run with nothing else on the machine.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np
import requests

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from flowrl_jax import main  # noqa: E402
from flowrl_jax.config_lib import load_config  # noqa: E402
from flowrl_jax.rewards import remote  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(rewards: str, *extra: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "flowrl_jax.rewards.serve", "--reward", rewards, "--port", str(port), *extra],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if requests.get(url + "/health", timeout=1).ok:
                return proc, url
        except requests.ConnectionError:
            time.sleep(0.2)
    proc.kill()
    raise TimeoutError("the reward server did not start within 2 minutes")


def load(clients: int, per_client: int) -> dict:
    proc, url = start_server("jpeg_compressibility", "--max_pending", str(2 * clients))
    try:
        reward = remote.build(f"remote:jpeg_compressibility@{url}", {"deadline_s": 120})
        batch = np.random.default_rng(0).uniform(-1, 1, (16, 32, 32, 3)).astype(np.float32)

        def client(_):
            latencies = []
            for _ in range(per_client):
                t = time.perf_counter()
                reward(batch, ["p"] * 16)
                latencies.append(time.perf_counter() - t)
            return latencies

        start = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(clients) as pool:
            latencies = np.concatenate(list(pool.map(client, range(clients))))
        wall = time.perf_counter() - start
    finally:
        proc.kill()
    return {"clients": clients, "requests": int(latencies.size), "images_per_request": 16, "p50_ms": 1e3 * float(np.percentile(latencies, 50)),
            "p99_ms": 1e3 * float(np.percentile(latencies, 99)), "requests_per_s": latencies.size / wall}


def overlap(iterations: int, delay_s: float) -> dict:
    proc, url = start_server("shapes_score", "--delay_s", str(delay_s))
    out = {}
    try:
        for name, overlapped in (("sequential", False), ("overlapped", True)):
            workdir = tempfile.mkdtemp(prefix=f"reward_service_{name}_")
            config = load_config(os.path.join(ROOT, "configs/flow_grpo_cpu.py"), **{
                "train.iterations": iterations, "train.rollout_chunk": 24, "train.score_while_sampling": overlapped,
                "train.rewards": ((f"remote:shapes_score@{url}", 1.0),), "train.remote_rewards.batch_size": 24,
                "eval.at_start": False, "eval.every": 0, "checkpoint.every": 1000, "diagnostics.image_change_every": 0})
            config.eval.update(per_category=1)  # the final eval: as small as it goes
            main.run_job(config, workdir)
            rows = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl")) if '"rollout_s"' in line][1:]
            out[name] = {k: float(np.mean([r[k] for r in rows])) for k in ("rollout_s", "reward_s", "update_s")}
            out[name]["iteration_s"] = sum(out[name][k] for k in ("rollout_s", "reward_s", "update_s"))
            out[name]["iterations_timed"] = len(rows)
    finally:
        proc.kill()
    out["speedup"] = out["sequential"]["iteration_s"] / out["overlapped"]["iteration_s"]
    out["delay_s_per_batch"], out["batches_per_iteration"] = delay_s, 4
    return out


def table(runs: list[dict]) -> str:
    lines = ["| server s per batch (4 per iteration) | scoring | rollout + reward s | update s | iteration s | speedup |",
             "|---|---|---|---|---|---|"]
    for ov in runs:
        for name in ("sequential", "overlapped"):
            r, speedup = ov[name], f"{ov['speedup']:.2f}x" if name == "overlapped" else "1"
            lines.append(f"| {ov['delay_s_per_batch']:g} | {name} | {r['rollout_s'] + r['reward_s']:.2f} | {r['update_s']:.2f} | "
                         f"{r['iteration_s']:.2f} | {speedup} |")
    return "\n".join(lines)


def main_() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--requests", type=int, default=25)
    p.add_argument("--iterations", type=int, default=5)
    p.add_argument("--delay_s", default="1,0.25", help="the server's seconds per batch, comma-separated: one pair of runs each")
    p.add_argument("--out", default="benchmarks/results/reward_service.json")
    args = p.parse_args()
    result = {"load": load(args.clients, args.requests),
              "overlap": [overlap(args.iterations, float(d)) for d in args.delay_s.split(",")]}
    ld = result["load"]
    print(f"\nload: {ld['clients']} clients x {ld['requests'] // ld['clients']} requests of 16 images: "
          f"p50 {ld['p50_ms']:.1f} ms, p99 {ld['p99_ms']:.1f} ms, {ld['requests_per_s']:.1f} requests/s")
    print("\n" + table(result["overlap"]))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main_()
