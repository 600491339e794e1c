"""Hostile clients of the reward server (`flowrl_jax.rewards.serve`), one per finding of issue 43, and the server's
memory while each runs: the benchmark (run as a script: the table in docs/rewards.md) and `tests/test_reward_service.py`
(the bound, at small caps) share them.

    python benchmarks/reward_attacks.py [--server_nice -15] [--out benchmarks/results/reward_attacks.json]   # default caps

    caps = Caps(max_batch=8, max_pixels=8 * 128 * 128, max_body_bytes=1 << 20, max_pending=2, max_connections=16)
    proc = subprocess.Popen(caps.command("jpeg_compressibility", port))   # the server under attack
    result = attack(ATTACKS["held_uploads"], url, caps, proc.pid)          # statuses, peak memory, /health meanwhile

Each attack returns the HTTP statuses it got (0: the server closed the connection without an answer). `attack` resets
the server's peak-RSS counter (/proc/PID/clear_refs), runs it while another process polls `/health` on fresh
connections (`HealthPoller`), and reads the peak (VmHWM): the memory it cost is the peak minus the idle RSS measured before any attack.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import io
import json
import math
import os
import socket
import subprocess
import sys
import threading
import time
from typing import Callable

import msgpack
import numpy as np
import requests
from PIL import Image

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from flowrl_jax.rewards import protocol, remote  # noqa: E402

REWARD = "jpeg_compressibility"


@dataclasses.dataclass(frozen=True)
class Caps:
    """The server's flags under attack."""
    max_batch: int = 8
    max_pixels: int = 8 * 128 * 128
    max_body_bytes: int = 1 << 20
    max_pending: int = 2
    max_connections: int = 16
    body_timeout_s: float = 0.5
    delay_s: float = 0.2  # each batch holds the worker this long: a batch can be queued behind another
    token: str | None = None  # sent by every attack: what is measured is past the door

    @property
    def limits(self) -> protocol.Limits:
        return protocol.Limits(max_batch=self.max_batch, max_pixels=self.max_pixels, max_body_bytes=self.max_body_bytes)

    def bound(self) -> int:
        return protocol.worst_case_bytes(self.limits, self.max_pending, self.max_connections)

    def command(self, port: int, log: str | None = None) -> list[str]:
        return [sys.executable, "-m", "flowrl_jax.rewards.serve", "--reward", REWARD, "--port", str(port),
                "--max_batch", str(self.max_batch), "--max_pixels", str(self.max_pixels),
                "--max_body_mb", str(self.max_body_bytes / 2 ** 20), "--max_pending", str(self.max_pending),
                "--max_connections", str(self.max_connections), "--body_timeout_s", str(self.body_timeout_s),
                "--delay_s", str(self.delay_s)] + (["--log", log] if log else []) + (["--token", self.token] if self.token else [])

    @property
    def headers(self) -> dict:
        return {"Content-Type": protocol.CONTENT_TYPE, **({"Authorization": f"Bearer {self.token}"} if self.token else {})}


# ---------------------------------------------------------------------------------------------- raw HTTP
def _connect(url: str, timeout_s: float) -> socket.socket:
    host, port = url.split("//", 1)[1].rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=timeout_s)


def _head(length: int, caps: Caps) -> bytes:
    headers = "".join(f"{k}: {v}\r\n" for k, v in caps.headers.items())
    return f"POST {protocol.SCORE_PATH} HTTP/1.1\r\nHost: x\r\n{headers}Content-Length: {length}\r\n\r\n".encode()


def _status(sock: socket.socket) -> int:
    """The answer's HTTP status; 0 when the server closed the connection first."""
    try:
        line = sock.recv(64)
    except OSError:  # reset by the server, or no answer within the socket's timeout
        return 0
    return int(line.split()[1]) if line.startswith(b"HTTP/1.1 ") else 0


def _send(sock: socket.socket, data: bytes) -> None:
    try:
        sock.sendall(data)
    except OSError:  # the server answered and closed before taking it all (a 503, a 413)
        pass


def _post(url: str, body: bytes, caps: Caps, timeout_s: float = 30.0) -> int:
    return requests.post(url + protocol.SCORE_PATH, data=body, headers=caps.headers, timeout=timeout_s).status_code


def _request(pixels: np.ndarray, names=None) -> bytes:
    return protocol.encode_request(pixels, ["p"] * len(pixels), names)


def _largest_batch(caps: Caps) -> np.ndarray:
    """max_batch square images of as many pixels as the caps allow (the body must fit too)."""
    side = math.isqrt(min(caps.max_pixels, (caps.max_body_bytes - (64 << 10)) // 3) // caps.max_batch)
    return np.random.default_rng(0).integers(0, 256, (caps.max_batch, side, side, 3), np.uint8)


# ------------------------------------------------------------------------------------------------ attacks
def held_uploads(url: str, caps: Caps) -> list[int]:
    """5 P uploads of a body at the size cap, all but its last byte sent, then held: P are admitted and time out (408),
    the others are turned away before their bodies are read (503)."""
    body = _head(caps.max_body_bytes, caps) + bytes(caps.max_body_bytes - 1)

    def one(_):
        sock = _connect(url, caps.body_timeout_s + 10)
        with sock:
            _send(sock, body)
            return _status(sock)
    return _parallel(one, 5 * caps.max_pending)


def png_pixel_bomb(url: str, caps: Caps) -> list[int]:
    """max_batch PNGs of 2048 x 2048 black pixels (a few kB each), over the pixel cap in total: 413 before decoding."""
    png = io.BytesIO()
    Image.new("RGB", (2048, 2048)).save(png, format="PNG", optimize=True)
    body = msgpack.packb({"version": 1, "images": {"png": [png.getvalue()] * caps.max_batch}, "prompts": ["p"] * caps.max_batch})
    return [_post(url, body, caps)]


def object_nest(url: str, caps: Caps) -> list[int]:
    """A body at the size cap that is all empty msgpack maps, 256 to an array (each container under the length caps):
    413 at the object cap, while counting, before anything is unpacked."""
    arrays = (caps.max_body_bytes - 1024) // 259
    body = msgpack.packb({"version": 1, "images": {"dtype": "uint8", "shape": [1, 1, 1, 3], "data": bytes(3)},
                          "prompts": [[{}] * 256] * arrays})
    return [_post(url, body, caps)]


def legal_batch(url: str, caps: Caps) -> list[int]:
    """The largest raw batch the caps admit, P of them at once: scored (200), or 503 past P."""
    body = _request(_largest_batch(caps))
    return _parallel(lambda _: _post(url, body, caps), caps.max_pending)


def repeated_names(url: str, caps: Caps) -> list[int]:
    """One small batch asking for the reward 4096 times (or as often as the object cap admits): scored once (200)."""
    return [_post(url, _request(np.zeros((1, 8, 8, 3), np.uint8), [REWARD] * min(4096, caps.limits.max_objects - 64)), caps)]


def slow_body(url: str, caps: Caps) -> list[int]:
    """A body sent 10 bytes a second: 408 at --body_timeout_s."""
    sock = _connect(url, caps.body_timeout_s + 10)
    with sock:
        _send(sock, _head(1000, caps))
        end = time.monotonic() + caps.body_timeout_s + 5
        sock.setblocking(False)
        while time.monotonic() < end:
            try:
                if sock.recv(64, socket.MSG_PEEK):
                    break
            except BlockingIOError:
                pass
            except OSError:
                break
            _send(sock, b"x")
            time.sleep(0.1)
        sock.setblocking(True)
        return [_status(sock)]


def idle_connections(url: str, caps: Caps) -> list[int]:
    """max(4 C, 1100) connections opened and left silent (1100: past the usual 1024 file descriptors): the server keeps
    at most C open, closing the oldest idle ones (status 0 for each closed, 1 for each still open after 0.5 s)."""
    count = max(4 * caps.max_connections, 1100)
    socks = []
    for _ in range(count):
        try:
            socks.append(_connect(url, 2.0))
        except OSError:
            break
    time.sleep(0.5)  # the server's sweeps (every 0.1 s) close the idle past the cap
    open_ = []
    for s in socks:
        s.setblocking(False)
        try:
            open_.append(0 if s.recv(1) == b"" else 1)
        except BlockingIOError:
            open_.append(1)  # nothing to read: still open
        except OSError:
            open_.append(0)
        s.close()
    return open_


def gone_client(url: str, caps: Caps) -> list[int]:
    """A batch queued behind another, its client gone before it runs: not scored (the log says skipped); the first
    answers 200."""
    body = _request(np.zeros((1, 8, 8, 3), np.uint8))
    statuses = []
    first = threading.Thread(target=lambda: statuses.append(_post(url, body, caps)))
    first.start()
    time.sleep(caps.delay_s / 4)  # the first holds the worker for --delay_s
    sock = _connect(url, 5)
    _send(sock, _head(len(body), caps) + body)
    time.sleep(caps.delay_s / 4)  # read and queued, not yet run
    sock.close()
    first.join()
    return statuses


ATTACKS: dict[str, Callable] = {
    "held_uploads": held_uploads, "png_pixel_bomb": png_pixel_bomb, "object_nest": object_nest, "legal_batch": legal_batch,
    "repeated_names": repeated_names, "slow_body": slow_body, "idle_connections": idle_connections, "gone_client": gone_client,
}


def _parallel(fn: Callable, n: int) -> list:
    out = [None] * n

    def run(i):
        out[i] = fn(i)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


# ------------------------------------------------------------------------------------------- measuring
def rss(pid: int, field: str = "VmRSS") -> int:
    """Bytes of a /proc/PID/status field (VmRSS now, VmHWM the peak since the last reset)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) << 10
    raise KeyError(field)


def reset_peak(pid: int) -> None:
    with open(f"/proc/{pid}/clear_refs", "w") as f:  # "5": reset the peak RSS to the current RSS (Linux >= 4.0)
        f.write("5")


def warm_up(url: str, caps: Caps) -> None:
    """One request of each kind a server answers, so what loads lazily (modules, the worker thread) is in the idle RSS."""
    pixels = np.zeros((2, 8, 8, 3), np.uint8)
    png = io.BytesIO()
    Image.fromarray(pixels[0]).save(png, format="PNG")
    for body in (_request(pixels), msgpack.packb({"version": 1, "images": {"png": [png.getvalue()] * 2}, "prompts": ["p", "p"]}),
                 b"\x93garbled"):
        _post(url, body, caps)
    requests.get(url + protocol.HEALTH_PATH, timeout=5)


POLL = """
import json, sys, threading, time, requests
url, on, lock, out = sys.argv[1], threading.Event(), threading.Lock(), []
def poll():
    while True:
        on.wait()
        with lock:
            t = time.perf_counter()
            try:
                ok = requests.get(url, timeout=5).status_code == 200
            except requests.RequestException:
                ok = False
            out.append(1e3 * (time.perf_counter() - t) if ok else -1.0)
        time.sleep(0.02)
threading.Thread(target=poll, daemon=True).start()
for line in sys.stdin:
    if line.strip() == "start":
        with lock:
            out.clear()
        on.set()
    else:
        on.clear()
        with lock:
            print(json.dumps(out), flush=True)
"""


class HealthPoller:
    """GET /health on a fresh connection every 20 ms from its own process (so the attackers' threads do not delay the
    measurement): `start()`, then `stop()` -> the latencies in ms (inf for a poll that failed)."""

    def __init__(self, url: str):
        self.proc = subprocess.Popen([sys.executable, "-c", POLL, url + protocol.HEALTH_PATH], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)

    def start(self) -> None:
        self.proc.stdin.write("start\n")
        self.proc.stdin.flush()

    def stop(self) -> list[float]:
        self.proc.stdin.write("stop\n")
        self.proc.stdin.flush()
        return [math.inf if v < 0 else v for v in json.loads(self.proc.stdout.readline())]

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


def attack(fn: Callable, url: str, caps: Caps, pid: int, poller: HealthPoller, honest: Callable | None = None) -> dict:
    """Run one attack while `poller` polls /health (and two threads call `honest()` in a loop, when given) -> {statuses,
    seconds, peak_bytes (VmHWM during it), health_ms (each poll; inf when it failed), honest_ms}."""
    reset_peak(pid)
    done, honest_ms = threading.Event(), []

    def client():
        while not done.is_set():
            t = time.perf_counter()
            honest()
            honest_ms.append(1e3 * (time.perf_counter() - t))

    threads = [threading.Thread(target=client) for _ in range(2)] if honest else []
    poller.start()
    for t in threads:
        t.start()
    start = time.perf_counter()
    try:
        statuses = fn(url, caps)
    finally:
        seconds = time.perf_counter() - start
        time.sleep(0.1)  # a poll or two after the attack's last answer
        health_ms = poller.stop()
        done.set()
        for t in threads:
            t.join()
    return {"statuses": dict(sorted(collections.Counter(statuses).items())), "seconds": seconds, "peak_bytes": rss(pid, "VmHWM"),
            "health_ms": health_ms, "honest_ms": honest_ms}


# ------------------------------------------------------------------------------------------ the benchmark
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--body_timeout_s", type=float, default=5.0, help="shorter than the server's 60 s: the run stays short")
    p.add_argument("--server_nice", type=int, default=-15, help="the server's priority: above the attacker's, which shares this "
                   "machine's cores (a remote attacker would not); negative values need root")
    p.add_argument("--out", default="benchmarks/results/reward_attacks.json")
    args = p.parse_args()
    limits = protocol.Limits()
    caps = Caps(max_batch=limits.max_batch, max_pixels=limits.max_pixels, max_body_bytes=limits.max_body_bytes, max_pending=8,
                max_connections=64, body_timeout_s=args.body_timeout_s, delay_s=0.2)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(["nice", "-n", str(args.server_nice)] + caps.command(port), cwd=ROOT, stdout=subprocess.DEVNULL)  # exec: same pid
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                if requests.get(url + protocol.HEALTH_PATH, timeout=1).ok:
                    break
            except requests.ConnectionError:
                time.sleep(0.2)
        warm_up(url, caps)
        idle = rss(proc.pid)
        reward = remote.build(f"remote:{REWARD}@{url}", {"deadline_s": 600})
        batch = np.random.default_rng(1).uniform(-1, 1, (4, 32, 32, 3)).astype(np.float32)
        honest = lambda: reward(batch, ["p"] * 4)  # noqa: E731
        rows, poller = {}, HealthPoller(url)
        for name, fn in ATTACKS.items():
            r = attack(fn, url, caps, proc.pid, poller, honest)
            health, served = np.asarray(r["health_ms"]), np.asarray(r["honest_ms"] or [math.nan])
            failed, health = int(np.isinf(health).sum()), health[np.isfinite(health)]
            rows[name] = {"doc": fn.__doc__.split("\n\n")[0].replace("\n", " ").replace("    ", " "), "statuses": r["statuses"],
                          "seconds": r["seconds"], "peak_mib": (r["peak_bytes"] - idle) / 2 ** 20,
                          "health_max_ms": float(health.max()), "health_p99_ms": float(np.percentile(health, 99)),
                          "health_polls": int(health.size) + failed, "health_failed": failed, "honest_p50_ms": float(np.percentile(served, 50)),
                          "honest_p99_ms": float(np.percentile(served, 99)), "honest_requests": len(r["honest_ms"])}
            print(f"{name:18s} {r['statuses']} peak +{rows[name]['peak_mib']:.0f} MiB, /health max {rows[name]['health_max_ms']:.1f} ms, "
                  f"({failed} failed), honest p50/p99 {rows[name]['honest_p50_ms']:.0f}/{rows[name]['honest_p99_ms']:.0f} ms", flush=True)
        poller.close()
    finally:
        proc.kill()
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from machine import describe
    result = {"caps": dataclasses.asdict(caps) | {"token": None}, "idle_mib": idle / 2 ** 20, "bound_mib": caps.bound() / 2 ** 20,
              "reward": REWARD, "attacks": rows, "env": describe(),
              "server_nice": args.server_nice if os.geteuid() == 0 or args.server_nice >= 0 else "refused (not root)"}
    print(f"bound {result['bound_mib']:.0f} MiB past idle ({result['idle_mib']:.0f} MiB) plus the reward's own")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
