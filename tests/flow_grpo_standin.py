"""A loopback stand-in for flow_grpo's GenEval reward-server (yifan123/reward-server `app_geneval.py`), for the tests.

    python tests/flow_grpo_standin.py --port P [--log FILE] [--malicious PATH]

It speaks that server's protocol: POST / with a pickled {"images": [JPEG bytes], "meta_datas": [rows], "only_strict":
bool}, answered with a pickled {"scores", "rewards", "strict_rewards", "group_rewards", "group_strict_rewards"}, and
like it answers any exception with its traceback as text and status 500 (a row without `tag` is `KeyError: 'tag'`).
The detector is the shapes world's exact evaluator, run on each row's "spec" (the shapes prompts carry one). The
request is read with `remote.safe_loads` (a stand-in of ours has no business unpickling code either). `--log` appends
the received metadata rows as JSON lines. Other paths, for the client's failure modes: POST /malicious answers with a
pickle that, loaded by plain `pickle.loads`, would create the `--malicious` PATH (what a hostile server could send);
/huge answers 200 with scores 10,000 times longer than the batch; /status/CODE answers CODE with a traceback.
"""
import argparse
import io
import json
import os
import pickle
import traceback

import numpy as np
from aiohttp import web
from PIL import Image

from flowrl_jax.rewards import remote
from flowrl_jax.worlds.shapes import evaluator


class Hostile:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):  # plain pickle.loads would call os.open(path, O_CREAT | O_WRONLY)
        return os.open, (self.path, os.O_CREAT | os.O_WRONLY)


def make_app(log, malicious):
    def scores(data):
        images = np.stack([np.asarray(Image.open(io.BytesIO(b), formats=["JPEG"]).convert("RGB")) for b in data["images"]])
        tags = [m["tag"] for m in data["meta_datas"]]  # as flow_grpo's evaluate_image reads metadata['tag'] first
        result = evaluator.evaluate(images.astype(np.float32) / 127.5 - 1.0, [m["spec"] for m in data["meta_datas"]])
        if log:
            with open(log, "a") as f:
                f.writelines(json.dumps(m) + "\n" for m in data["meta_datas"])
        scores, strict = [float(v) for v in result["score"]], [float(v) for v in result["strict"]]
        return {"scores": scores, "rewards": [0.0] * len(scores), "strict_rewards": strict,
                "group_rewards": {t: [0.0] for t in tags}, "group_strict_rewards": {}}

    async def score(request):
        try:  # flow_grpo's handler: the traceback as the body of a 500
            return web.Response(body=pickle.dumps(scores(remote.safe_loads(await request.read()))))
        except Exception:
            return web.Response(status=500, body=traceback.format_exc().encode())

    async def hostile(request):
        data = remote.safe_loads(await request.read())
        return web.Response(body=pickle.dumps({"scores": [Hostile(malicious)] * len(data["images"])}))

    async def huge(request):
        data = remote.safe_loads(await request.read())
        return web.Response(body=pickle.dumps({"scores": [0.5] * (10_000 * len(data["images"]))}))

    async def status(request):
        await request.read()
        text = "Traceback (most recent call last):\n  File \"app.py\", line 1, in inference\n" + "    padding\n" * 200
        return web.Response(status=int(request.match_info["code"]), body=(text + "TimeoutError: the detector took too long\n").encode())

    app = web.Application(client_max_size=64 << 20)
    app.add_routes([web.post("/", score), web.post("/malicious", hostile), web.post("/huge", huge),
                    web.post("/status/{code}", status), web.get("/health", lambda _: web.json_response({"ok": True}))])
    return app


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--log", default=None)
    p.add_argument("--malicious", default=None)
    args = p.parse_args()
    web.run_app(make_app(args.log, args.malicious), host="127.0.0.1", port=args.port, print=None, access_log=None)
