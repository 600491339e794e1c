"""A loopback stand-in for flow_grpo's GenEval reward-server (yifan123/reward-server `app_geneval.py`), for the tests.

    python tests/flow_grpo_standin.py --port P [--log FILE] [--malicious PATH]

It speaks that server's protocol: POST / with a pickled {"images": [JPEG bytes], "meta_datas": [rows], "only_strict":
bool}, answered with a pickled {"scores", "rewards", "strict_rewards", "group_rewards", "group_strict_rewards"}. The
detector is the shapes world's exact evaluator, run on each row's "spec" (the shapes prompts carry one). The request is
read with `remote.safe_loads` (a stand-in of ours has no business unpickling code either). `--log` appends the
received metadata rows as JSON lines; `--malicious PATH` answers instead with a pickle that, loaded by plain
`pickle.loads`, would create PATH (what a hostile server could send).
"""
import argparse
import io
import json
import os
import pickle

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
    async def score(request):
        data = remote.safe_loads(await request.read())
        if malicious:
            return web.Response(body=pickle.dumps({"scores": [Hostile(malicious)] * len(data["images"])}))
        images = np.stack([np.asarray(Image.open(io.BytesIO(b), formats=["JPEG"]).convert("RGB")) for b in data["images"]])
        result = evaluator.evaluate(images.astype(np.float32) / 127.5 - 1.0, [m["spec"] for m in data["meta_datas"]])
        if log:
            with open(log, "a") as f:
                f.writelines(json.dumps(m) + "\n" for m in data["meta_datas"])
        scores, strict = [float(v) for v in result["score"]], [float(v) for v in result["strict"]]
        return web.Response(body=pickle.dumps({"scores": scores, "rewards": [0.0] * len(scores), "strict_rewards": strict,
                                               "group_rewards": {}, "group_strict_rewards": {}}))

    app = web.Application(client_max_size=64 << 20)
    app.add_routes([web.post("/", score), web.get("/health", lambda _: web.json_response({"ok": True}))])
    return app


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--log", default=None)
    p.add_argument("--malicious", default=None)
    args = p.parse_args()
    web.run_app(make_app(args.log, args.malicious), host="127.0.0.1", port=args.port, print=None, access_log=None)
