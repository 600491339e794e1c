"""The reward server: any registered reward behind HTTP, for rewards that should not live in the training process.

    python -m flowrl_jax.rewards.serve --reward ocr,shapes_score --port 18090
    python -m flowrl_jax.rewards.serve --reward pickscore --model pickscore=/data/PickScore_v1 --model pickscore_processor=/data/CLIP-H

Serves the host rewards (`rewards.REWARDS`: OCR, the shapes evaluator, JPEG, ...) and the device rewards
(`device.FACTORIES`, on this server's own accelerator; `--model KEY=PATH` as `world.reward_models.KEY`), loaded
before the port opens. aiohttp; binds 127.0.0.1 unless `--host` says otherwise (then it warns; `--token` or
FLOWRL_REWARD_TOKEN turns away requests without `Authorization: Bearer TOKEN`, compared in constant time). Protocol:
`protocol.py` (msgpack, versioned, never pickle). `GET /health` -> `{"version", "rewards", "max_batch", "max_pixels",
"max_body_bytes", "pending"}`. `POST /v1/score` -> scores, or:
  401 without the token; 411 without a Content-Length; 413 past a cap (body, batch, side, pixels, objects), before the
  body is read when its length says so; 503 when `--max_pending` requests are already admitted (uploading, waiting or
  being scored: admission comes before the body is read; the client backs off and retries); 408 when the body does not
  arrive within `--body_timeout_s`; 4xx naming what is wrong with the request; 504 past `--timeout_s`; 500 when a
  reward raised. The server stays up.
Batches are decoded and scored one at a time on one worker thread, in arrival order (the event loop only reads bodies
and answers, so `/health` stays quick); each reward name is scored once; a batch whose client has gone is not scored,
and one past `--timeout_s` stops at its next reward. `--timeout_s` counts from a batch's start, not its wait in the
queue. At most `--max_connections` stay open (`Doorman`): past the cap the idle ones close first (never one in an
admitted request), and up to 4 times the cap + 128 may be open for 0.1 s while new ones show whether they are idle. Memory: `protocol.worst_case_bytes` (docs/rewards.md, "Bounds"), printed at
start. `--delay_s` adds that much to each batch (a slow model's stand-in, for benchmarks and tests); `--log FILE`
appends one JSON line per request that reached the worker.
"""
from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import hmac
import ipaddress
import json
import math
import os
import signal
import sys
import threading
import time
from typing import Callable

import numpy as np
from aiohttp import web

from flowrl_jax.rewards import protocol

DEFAULT_PORT = 18090


def load_scorers(names: list[str], models: dict) -> dict[str, Callable]:
    """{name: fn(images float [B, H, W, 3] in [-1, 1], prompts) -> float32 [B]} for registered host or device rewards."""
    from flowrl_jax import rewards  # the heavy imports (jax) only when serving

    remote = [n for n in names if rewards.remote.is_remote(n)]
    if remote:
        raise ValueError(f"{remote}: a server serves its own rewards, not another server's")
    rewards.check([(n, 1.0) for n in names], models)
    built = {n: rewards.build(((n, 1.0),), models) for n in names}
    return {n: (lambda images, prompts, fn=fn, n=n: fn(images, prompts)[1][n]) for n, fn in built.items()}


TOKEN_ENV = "FLOWRL_REWARD_TOKEN"  # the shared token, for the server (or --token) and the client alike
GONE = "the client closed the connection before its batch ran"
LINGER_S = 0.0  # after refusing a request whose body is still coming, close at once (aiohttp reads and drops it for
# 10 s by default): the refusal is written first; a client still sending may see a reset instead, which ours retries
# as it retries a 503. Measured: 40 held 64 MB uploads, /health max 392 ms lingering 1 s, 227 ms closing at once.


class Service:
    """The server's state: the worker thread, what is admitted, and the connections in admitted requests."""

    def __init__(self, max_pending: int):
        self.worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="reward")
        self.max_pending, self.admitted, self.running, self.busy = max_pending, 0, 0, set()


def make_app(scorers: dict[str, Callable], limits: protocol.Limits = protocol.Limits(), timeout_s: float = 120.0,
             max_pending: int = 8, delay_s: float = 0.0, log_path: str | None = None, body_timeout_s: float = 60.0,
             token: str | None = None) -> web.Application:
    service = Service(max_pending)

    def answer(status: int, message: str) -> web.Response:
        return web.Response(status=status, body=protocol.encode_error(message), content_type=protocol.CONTENT_TYPE)

    def run_batch(box: list, gone: Callable[[], bool], stop: threading.Event, started: Callable):
        """On the worker: decode and score one body -> {name: [B]}, a ProtocolError to answer, or GONE."""
        started()
        body = box.pop()  # the only reference: freed once unpacked
        if gone():
            return GONE
        try:
            request = protocol.decode_request(body, limits)
        except protocol.ProtocolError as e:
            return e
        del body
        names = request.rewards if request.rewards is not None else sorted(scorers)
        unknown = [n for n in names if n not in scorers]
        if unknown or not names:
            return protocol.ProtocolError(f"unknown reward(s) {unknown[:8] or 'none asked'}; this server serves {sorted(scorers)}", 422)
        if delay_s:
            stop.wait(delay_s)
        images = request.pixels.astype(np.float32)  # in place: 12 bytes per pixel, not three temporaries
        images /= 127.5
        images -= 1.0
        request.pixels, out = None, {}
        for n in names:
            if stop.is_set() or gone():  # past --timeout_s (answered 504), or nobody left to answer
                return GONE
            scores = np.asarray(scorers[n](images, request.prompts), np.float32).reshape(-1)
            if scores.shape[0] != images.shape[0]:
                raise RuntimeError(f"reward {n} gave {scores.shape[0]} scores for {images.shape[0]} images")
            out[n] = scores
        return out

    def log(entry: dict) -> None:
        if log_path:
            with open(log_path, "a") as f:
                f.write(json.dumps(entry) + "\n")

    async def health(_):
        return web.json_response({"version": protocol.VERSION, "rewards": sorted(scorers), "max_batch": limits.max_batch,
                                  "max_pixels": limits.max_pixels, "max_body_bytes": limits.max_body_bytes,
                                  "pending": service.admitted, "token": token is not None})

    async def score(request: web.Request) -> web.Response:
        if token and not hmac.compare_digest(request.headers.get("Authorization", "").encode(), f"Bearer {token}".encode()):
            return answer(401, f"this server takes requests with its token only: set {TOKEN_ENV} to the server's --token")
        if request.content_type != protocol.CONTENT_TYPE:
            return answer(415, f"Content-Type must be {protocol.CONTENT_TYPE}, got {request.content_type!r}")
        length = request.content_length
        if length is None:
            return answer(411, "send a Content-Length: the server admits a body by its size before reading it")
        if length > limits.max_body_bytes:
            return answer(413, f"the body is {length} bytes, over the cap of {limits.max_body_bytes} (--max_body_mb); send smaller batches")
        if service.admitted >= max_pending:
            return answer(503, f"busy: {service.admitted} requests admitted ({service.running} being scored, the rest uploading or "
                               f"waiting; --max_pending {max_pending}); retry later")
        service.admitted += 1
        service.busy.add(request.protocol)
        job = None

        def release(_=None):
            service.admitted -= 1
            service.busy.discard(request.protocol)

        try:
            try:
                body = await asyncio.wait_for(read_body(request, length), body_timeout_s)
            except asyncio.TimeoutError:
                return answer(408, f"the body did not arrive within --body_timeout_s {body_timeout_s:g}")
            except protocol.ProtocolError as e:
                return answer(e.status, str(e))
            except ConnectionError:  # the client left mid-body: nobody to answer
                return answer(499, GONE)
            loop, began, stop = asyncio.get_running_loop(), asyncio.Event(), threading.Event()

            def on_start():
                service.running += 1
                began.set()

            def started():  # on the worker
                loop.call_soon_threadsafe(on_start)

            def gone() -> bool:
                return request.transport is None or request.transport.is_closing()

            job = loop.run_in_executor(service.worker, run_batch, [body], gone, stop, started)
            del body
            job.add_done_callback(lambda _: (release(), setattr(service, "running", service.running - began.is_set())))
            await asyncio.wait([asyncio.ensure_future(began.wait()), job], return_when=asyncio.FIRST_COMPLETED)
            start = time.time()
            try:
                result = await asyncio.wait_for(asyncio.shield(job), timeout_s)
            except asyncio.TimeoutError:
                stop.set()
                return answer(504, f"the batch took longer than --timeout_s {timeout_s:g}")
            except Exception as e:
                return answer(500, f"reward failed on this batch: {type(e).__name__}: {e}")
            if isinstance(result, protocol.ProtocolError):
                return answer(result.status, str(result))
            if result is GONE:
                log({"time": start, "skipped": GONE, "rows": 0})
                return answer(499, GONE)
            log({"time": start, "s": time.time() - start, "rows": len(next(iter(result.values()))), "rewards": list(result)})
            return web.Response(body=protocol.encode_response(result), content_type=protocol.CONTENT_TYPE)
        finally:
            if job is None:
                release()

    app = web.Application(client_max_size=limits.max_body_bytes)
    app["service"] = service
    app.add_routes([web.get(protocol.HEALTH_PATH, health), web.post(protocol.SCORE_PATH, score)])
    app.on_cleanup.append(lambda _: asyncio.get_running_loop().run_in_executor(None, service.worker.shutdown))
    return app


async def read_body(request: web.Request, length: int) -> bytearray:
    """The body, `length` bytes (its Content-Length) into one buffer allocated once (no copy on the way)."""
    body, filled = bytearray(length), 0
    while filled < length:
        chunk = await request.content.readany()
        if not chunk:
            raise protocol.ProtocolError(f"the body ended after {filled} of its {length} bytes")
        body[filled:filled + len(chunk)] = chunk
        filled += len(chunk)
    return body


GRACE_S = 0.1  # a new connection's time to send its first bytes before it may count as idle
BACKLOG = 2048  # connections the kernel queues before accept (capped by net.core.somaxconn): past it a client's SYN is
                # dropped and retried 1 s later (a /health poll took 1,041 ms in a 1,100-connection flood at 128)


class Door(asyncio.Protocol):
    """One connection: aiohttp's handler for it, and when it last sent bytes (the `Doorman` closes idle ones first)."""

    def __init__(self, doorman: "Doorman"):
        self.doorman, self.handler, self.last_data, self.opened = doorman, doorman.factory(), -math.inf, math.inf

    def connection_made(self, transport):
        self.opened = self.doorman.loop.time()
        self.handler.connection_made(transport)
        self.doorman.arrived(self)

    def data_received(self, data):
        self.last_data = self.doorman.loop.time()
        self.handler.data_received(data)

    def eof_received(self):
        return self.handler.eof_received()

    def connection_lost(self, exc):
        self.doorman.open.pop(self, None)
        self.handler.connection_lost(exc)

    def pause_writing(self):
        self.handler.pause_writing()

    def resume_writing(self):
        self.handler.resume_writing()

    def close(self):
        self.doorman.open.pop(self, None)
        self.handler.force_close()


class Doorman:
    """The protocol factory that caps connections: at most `cap` stay open, up to `ceiling` (4 `cap` + 128) for GRACE_S
    while new ones show whether they are idle; past the ceiling a new connection closes at once. Every GRACE_S while
    over the cap, the idle ones older than GRACE_S close: those that never sent a byte (oldest first), then the least
    recently active; never one in an admitted request (`busy`). A /health client can be turned away only while a flood
    holds the ceiling, for GRACE_S."""

    def __init__(self, factory: web.Server, cap: int, busy: set):
        self.factory, self.cap, self.busy, self.open, self.sweep = factory, cap, busy, {}, None
        self.ceiling = protocol.connection_ceiling(cap)
        self.loop = asyncio.get_running_loop()

    def __call__(self) -> Door:
        return Door(self)

    def arrived(self, door: Door) -> None:
        self.open[door] = None
        if len(self.open) > self.ceiling:
            door.close()
        elif len(self.open) > self.cap and self.sweep is None:
            self.sweep = self.loop.call_later(GRACE_S, self.make_room)

    def make_room(self) -> None:
        self.sweep, now = None, self.loop.time()
        settled = [d for d in self.open if d.handler not in self.busy and now - d.opened >= GRACE_S]  # connect order
        settled.sort(key=lambda d: d.last_data)  # stable: the silent (-inf) first, oldest first
        for door in settled[:max(0, len(self.open) - self.cap)]:
            door.close()
        if len(self.open) > self.cap:
            self.sweep = self.loop.call_later(GRACE_S, self.make_room)


def run(app: web.Application, host: str, port: int, max_connections: int, banner: str) -> None:
    """Serve `app` until SIGINT or SIGTERM, its connections capped by a `Doorman`."""
    async def serve():
        runner = web.AppRunner(app, access_log=None, lingering_time=LINGER_S)
        await runner.setup()
        doorman = Doorman(runner.server, max_connections, app["service"].busy)
        server = await asyncio.get_running_loop().create_server(doorman, host, port, backlog=BACKLOG)
        print(banner, flush=True)
        stopped = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            asyncio.get_running_loop().add_signal_handler(sig, stopped.set)
        await stopped.wait()
        server.close()
        await runner.cleanup()

    asyncio.run(serve())


def is_loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


MEMORY_HELP = """Memory: at most (P + 1) B + 15 M + 12 min(S^2, M) + 128 O + (4 C + 128) x 512 KiB above the idle server, plus what the
rewards allocate on one batch: P --max_pending requests each hold a body of at most B --max_body_mb; the one being scored
also its unpacked copy (B), its pixels as uint8 (3 M) and float32 (12 M bytes, M = --max_pixels), the PNG being decoded
(12 bytes per pixel, S = 2048 per side), its msgpack objects (O = 64 + 256 x --max_batch, 128 bytes each); 4 C + 128
connections open at most (for 0.1 s), C = --max_connections. The bound for the flags given is printed at start (docs/rewards.md, "Bounds")."""


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m flowrl_jax.rewards.serve", description=__doc__.split("\n\n")[0], epilog=MEMORY_HELP)
    p.add_argument("--reward", required=True, help="reward name(s), comma-separated (rewards.REWARDS, device.FACTORIES)")
    p.add_argument("--host", default="127.0.0.1", help="the address to bind (default loopback only; any other warns)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT)
    p.add_argument("--model", action="append", default=[], metavar="KEY=PATH", help="a device reward's weights (world.reward_models.KEY)")
    p.add_argument("--max_batch", type=int, default=protocol.Limits.max_batch, help="images per request")
    p.add_argument("--max_pixels", type=int, default=protocol.Limits.max_pixels, help="rows x height x width per request")
    p.add_argument("--max_body_mb", type=float, default=protocol.Limits.max_body_bytes / 2 ** 20)
    p.add_argument("--timeout_s", type=float, default=120.0, help="the longest one batch may take")
    p.add_argument("--body_timeout_s", type=float, default=60.0, help="the longest a body may take to arrive")
    p.add_argument("--max_pending", type=int, default=8, help="requests admitted at once (uploading, waiting or scored); 503 past it")
    p.add_argument("--max_connections", type=int, default=64, help="connections open at once")
    p.add_argument("--token", default=os.environ.get(TOKEN_ENV) or None,
                   help=f"a shared token the requests must carry (default: ${TOKEN_ENV}); clients send ${TOKEN_ENV}")
    p.add_argument("--delay_s", type=float, default=0.0, help="added to every batch: a slow model's stand-in (benchmarks, tests)")
    p.add_argument("--log", default=None, help="append one JSON line per request that reached the worker to this file")
    args = p.parse_args(argv)
    small = [f"--{k} {getattr(args, k)}" for k in ("max_batch", "max_pixels", "max_body_mb", "timeout_s", "body_timeout_s",
                                                     "max_pending", "max_connections") if getattr(args, k) <= 0]
    if small:
        p.error(f"{', '.join(small)}: must be positive")
    if args.max_connections <= args.max_pending:
        p.error(f"--max_connections {args.max_connections} must exceed --max_pending {args.max_pending} (room for /health and 503s)")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    models = {}
    for item in args.model:
        key, sep, path = item.partition("=")
        if not sep:
            sys.exit(f"serve: error: --model {item!r} must be KEY=PATH, e.g. --model pickscore=/data/PickScore_v1")
        models[key] = path
    names = [n.strip() for n in args.reward.split(",") if n.strip()]
    try:
        scorers = load_scorers(names, models)
    except (ValueError, FileNotFoundError, ImportError) as e:
        sys.exit(f"serve: error: {str(e).splitlines()[0]}")
    limits = protocol.Limits(max_batch=args.max_batch, max_pixels=args.max_pixels, max_body_bytes=int(args.max_body_mb * 2 ** 20))
    if not is_loopback(args.host):
        print(f"serve: warning: binding {args.host}, not loopback: anyone who can reach this port can use it "
              f"{'with the token' if args.token else 'freely (no --token)'}; requests travel unencrypted", file=sys.stderr, flush=True)
    app = make_app(scorers, limits, args.timeout_s, args.max_pending, args.delay_s, args.log, args.body_timeout_s, args.token)
    bound = protocol.worst_case_bytes(limits, args.max_pending, args.max_connections)
    run(app, args.host, args.port, args.max_connections,
        f"serving {sorted(scorers)} on http://{args.host}:{args.port} (protocol {protocol.VERSION}); memory past idle at most "
        f"{bound / 2 ** 20:.0f} MiB plus the rewards' own (--help)")


if __name__ == "__main__":
    main()
