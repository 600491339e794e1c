"""The reward server: any registered reward behind HTTP, for rewards that should not live in the training process.

    python -m flowrl_jax.rewards.serve --reward ocr,shapes_score --port 18090
    python -m flowrl_jax.rewards.serve --reward pickscore --model pickscore=/data/PickScore_v1 --model pickscore_processor=/data/CLIP-H

Serves the host rewards (`rewards.REWARDS`: OCR, the shapes evaluator, JPEG, ...) and the device rewards
(`device.FACTORIES`, on this server's own accelerator; `--model KEY=PATH` as `world.reward_models.KEY`), loaded
before the port opens. aiohttp; binds 127.0.0.1 unless `--host` says otherwise. Protocol: `protocol.py` (msgpack,
versioned, never pickle). `GET /health` -> `{"version", "rewards", "max_batch", "max_body_bytes", "pending"}`.
`POST /v1/score` -> scores, or a 4xx naming what is wrong with the request (the server stays up), 503 when
`--max_pending` requests already wait (the client backs off and retries), 504 past `--timeout_s`, 500 when a reward
raised. Batches are scored one at a time on one worker thread, in arrival order; `--timeout_s` counts from a batch's
start, not its wait in the queue (the queue is `--max_pending` long), and a batch past it still holds the worker until
it ends (it counts as pending until then). `--delay_s` adds that much to each
batch (a slow model's stand-in, for benchmarks and tests); `--log FILE` appends one JSON line per scored request.
"""
from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import sys
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


def make_app(scorers: dict[str, Callable], limits: protocol.Limits = protocol.Limits(), timeout_s: float = 120.0,
             max_pending: int = 8, delay_s: float = 0.0, log_path: str | None = None) -> web.Application:
    executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="reward")
    state = {"pending": 0}

    def answer(status: int, message: str) -> web.Response:
        return web.Response(status=status, body=protocol.encode_error(message), content_type=protocol.CONTENT_TYPE)

    def compute(request: protocol.Request, names: list[str], started: Callable) -> dict[str, np.ndarray]:
        started()
        if delay_s:
            time.sleep(delay_s)
        images = request.pixels.astype(np.float32) / 127.5 - 1.0
        out = {}
        for n in names:
            scores = np.asarray(scorers[n](images, request.prompts), np.float32).reshape(-1)
            if scores.shape[0] != images.shape[0]:
                raise RuntimeError(f"reward {n} gave {scores.shape[0]} scores for {images.shape[0]} images")
            out[n] = scores
        return out

    async def health(_):
        return web.json_response({"version": protocol.VERSION, "rewards": sorted(scorers), "max_batch": limits.max_batch,
                                  "max_body_bytes": limits.max_body_bytes, "pending": state["pending"]})

    async def score(request: web.Request) -> web.Response:
        if request.content_type != protocol.CONTENT_TYPE:
            return answer(415, f"Content-Type must be {protocol.CONTENT_TYPE}, got {request.content_type!r}")
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return answer(413, f"the body is over the cap of {limits.max_body_bytes} bytes; send smaller batches")
        try:
            req = protocol.decode_request(body, limits)
        except protocol.ProtocolError as e:
            return answer(e.status, str(e))
        names = req.rewards if req.rewards is not None else sorted(scorers)
        unknown = [n for n in names if n not in scorers]
        if unknown or not names:
            return answer(422, f"unknown reward(s) {unknown or 'none asked'}; this server serves {sorted(scorers)}")
        if state["pending"] >= max_pending:
            return answer(503, f"busy: {state['pending']} batches waiting (--max_pending {max_pending}); retry later")
        state["pending"] += 1
        loop, began = asyncio.get_running_loop(), asyncio.Event()
        job = loop.run_in_executor(executor, compute, req, names, lambda: loop.call_soon_threadsafe(began.set))
        job.add_done_callback(lambda _: state.__setitem__("pending", state["pending"] - 1))  # when the worker is free again
        await asyncio.wait([asyncio.ensure_future(began.wait()), job], return_when=asyncio.FIRST_COMPLETED)
        start = time.time()
        try:
            scores = await asyncio.wait_for(asyncio.shield(job), timeout_s)
        except asyncio.TimeoutError:
            return answer(504, f"the batch took longer than --timeout_s {timeout_s}")
        except Exception as e:
            return answer(500, f"reward failed on this batch: {type(e).__name__}: {e}")
        if log_path:
            with open(log_path, "a") as f:
                f.write(json.dumps({"time": start, "s": time.time() - start, "rows": int(req.pixels.shape[0]), "rewards": names}) + "\n")
        return web.Response(body=protocol.encode_response(scores), content_type=protocol.CONTENT_TYPE)

    app = web.Application(client_max_size=limits.max_body_bytes)
    app.add_routes([web.get(protocol.HEALTH_PATH, health), web.post(protocol.SCORE_PATH, score)])
    app.on_cleanup.append(lambda _: asyncio.get_running_loop().run_in_executor(None, executor.shutdown))
    return app


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m flowrl_jax.rewards.serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--reward", required=True, help="reward name(s), comma-separated (rewards.REWARDS, device.FACTORIES)")
    p.add_argument("--host", default="127.0.0.1", help="the address to bind (default loopback only)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT)
    p.add_argument("--model", action="append", default=[], metavar="KEY=PATH", help="a device reward's weights (world.reward_models.KEY)")
    p.add_argument("--max_batch", type=int, default=protocol.Limits.max_batch)
    p.add_argument("--max_body_mb", type=float, default=protocol.Limits.max_body_bytes / 2 ** 20)
    p.add_argument("--timeout_s", type=float, default=120.0, help="the longest one batch may take")
    p.add_argument("--max_pending", type=int, default=8, help="batches waiting at once before answering 503")
    p.add_argument("--delay_s", type=float, default=0.0, help="added to every batch: a slow model's stand-in (benchmarks, tests)")
    p.add_argument("--log", default=None, help="append one JSON line per scored request to this file")
    return p.parse_args(argv)


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
    limits = protocol.Limits(max_batch=args.max_batch, max_body_bytes=int(args.max_body_mb * 2 ** 20))
    app = make_app(scorers, limits, args.timeout_s, args.max_pending, args.delay_s, args.log)
    print(f"serving {sorted(scorers)} on http://{args.host}:{args.port} (protocol {protocol.VERSION})", flush=True)
    web.run_app(app, host=args.host, port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
