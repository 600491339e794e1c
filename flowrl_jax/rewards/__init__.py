"""Rewards by name, on the host or on the device, mixed freely in a weighted sum.

    reward_fn = build((("shapes_score", 1.0), ("shapes_strict", 0.5)), models)   # models: config.world.reward_models
    total, parts = reward_fn(images, prompts)        # weighted sum [B], and each named reward [B] (this process's rows)

`images` [B, H, W, 3] in [-1, 1]: numpy rows on the host, or the decoded batch as a (sharded) jax.Array straight from
the device. Host rewards read this process's rows as numpy; device rewards (`device.py`) run jitted on the array where
it lies, their prompts tokenized on the host and sharded like the images, so the images make no host round trip.
Host rewards, `(images numpy, prompt rows) -> r [B]`:
- `shapes_score`, `shapes_strict`, `learned`: the shapes world's (`worlds/shapes/scoring.py`, imported when named).
- `jpeg_compressibility` / `jpeg_incompressibility`: DDPO's model-free rewards (`image.py`), for any world.
- `ocr`: flow_grpo's OCR reward, the edit distance of what an OCR engine reads to the prompt's quoted text (`ocr.py`;
  RapidOCR's PP-OCRv4, `pip install -r requirements-ocr.txt`; `ocr_paddleocr`: PaddleOCR 2.x, as flow_grpo runs it);
  its prompts are checked for quoted text before the run (`check_prompts`).
Device rewards (`device.py`, weights from `config.world.reward_models`): `pickscore`, `clipscore`, `aesthetic`.
Remote rewards (`remote.py`, host side; `train.remote_rewards` sets their batch size and deadlines): `remote:NAME@URL`,
any reward served by `python -m flowrl_jax.rewards.serve`; `flow_grpo:geneval@URL` / `flow_grpo:deqa@URL`, flow_grpo's
reward-server. New rewards register in `REWARDS` or `device.FACTORIES` (factories, so heavy ones load lazily); device
rewards are loaded and placed once per process whoever asks (`device.loaded`).
"""
from __future__ import annotations

import importlib
import threading
from typing import Any, Callable, Sequence

import jax
import numpy as np

from flowrl_jax import parallel
from flowrl_jax.rewards import device, image, ocr, remote


def _provided_by(module: str, factory: str) -> Callable[[], Callable]:
    """A reward factory that imports `module` only when the reward is built: a world's own rewards load when named, and
    this registry imports no world (the static import graph keeps its arrows down)."""
    def build() -> Callable:
        return getattr(importlib.import_module(module), factory)()
    return build


def _ocr(engine: str) -> Callable:
    recognize = ocr.get_engine(engine)  # built now: a missing package is an ImportError at setup, not mid-run
    lock = threading.Lock()  # the engines' predictors are not thread-safe; the loop may score chunks on several threads

    def reward(images, prompts):
        with lock:
            return ocr.reward(images, prompts, recognize)
    return reward


REWARDS: dict[str, Callable[[], Callable]] = {  # host rewards
    "shapes_score": _provided_by("flowrl_jax.worlds.shapes.scoring", "shapes_score"),
    "shapes_strict": _provided_by("flowrl_jax.worlds.shapes.scoring", "shapes_strict"),
    "learned": _provided_by("flowrl_jax.worlds.shapes.scoring", "learned_reward"),
    "jpeg_compressibility": lambda: image.jpeg_compressibility,
    "jpeg_incompressibility": lambda: image.jpeg_incompressibility,
    "ocr": lambda: _ocr("rapidocr"),
    "ocr_paddleocr": lambda: _ocr("paddleocr"),
}
PROMPT_CHECKS: dict[str, Callable] = {"ocr": ocr.check_prompts, "ocr_paddleocr": ocr.check_prompts}  # checked before the run


def check(weighted: Sequence[tuple[str, float]], models: Any = None) -> None:
    """ValueError naming the unknown reward(s), without building any; with `models` (config.world.reward_models), a
    one-line error for a device reward whose weights are not given or not there (no weights are read)."""
    unknown = [str(n) for n, _ in weighted if str(n) not in REWARDS and str(n) not in device.FACTORIES and not remote.is_remote(n)]
    if unknown or not weighted:
        raise ValueError(f"unknown reward(s) {unknown or 'none given'}; known rewards: {sorted(REWARDS) + sorted(device.FACTORIES)}, "
                         "or remote:NAME@http://HOST:PORT for a reward server's")
    for name, _ in weighted:
        if remote.is_remote(name):
            remote.parse(str(name))
        elif str(name) in device.FACTORIES and models is not None:
            device.check(str(name), models)


def agree_on_failure(failure: Exception | None) -> None:
    """Every process raises, or none: a reward server's failure anywhere is a `RewardServerError` on every process (the train
    loop saves and stops, every process at the same step), any other reward error stops every process without saving."""
    served = isinstance(failure, remote.RewardServerError)
    agreed = parallel.agree({"server": served, "other": failure is not None and not served})
    if agreed["other"]:
        raise failure if failure is not None and not served else RuntimeError("a reward raised on another process (see its log)")
    if agreed["server"]:
        raise failure or remote.RewardServerError("of another process", "failed there (see that process's log)")


def check_prompts(weighted: Sequence[tuple[str, float]], rows) -> None:
    """ValueError when a reward of `weighted` (local or served: `remote:ocr@...`) cannot score these prompt rows."""
    for name, _ in weighted:
        if remote.is_remote(name):
            remote.check_rows(str(name), rows)  # flow_grpo's GenEval server: its metadata fields
        served = remote.parse(str(name)).reward if remote.is_remote(name) and remote.parse(str(name)).kind == "remote" else str(name)
        if served in PROMPT_CHECKS:
            PROMPT_CHECKS[served](rows)


class Weighted:
    """A weighted sum of rewards: `fn(images, prompts) -> (total [B] float32, {name: [B]})` (this process's rows). Its
    halves for a loop that scores the host's part early (`train.score_while_sampling`): `host_parts` (host and remote
    rewards on local numpy rows, any thread), `device_parts` (device rewards on the device batch, the main thread:
    multi-process programs launch in one order on every process), `total(parts)`."""

    def __init__(self, weighted: list[tuple[str, float]], fns: dict[str, Callable]):
        self.weighted, self.fns = weighted, fns
        self.on_host = [n for n, _ in weighted if n not in device.FACTORIES]
        self.on_device = [n for n, _ in weighted if n in device.FACTORIES]

    def host_parts(self, host_images: np.ndarray, prompts: list) -> dict[str, np.ndarray]:
        """numpy [b, H, W, 3] in [-1, 1] and b prompt rows -> {host or remote reward: [b]}."""
        return {n: np.asarray(self.fns[n](host_images, prompts), np.float32) for n in self.on_host}

    def device_parts(self, images, prompts: list) -> dict[str, np.ndarray]:
        """The (sharded) device batch [B, H, W, 3] and this process's prompt rows -> {device reward: this process's [b]}."""
        return {n: np.asarray(self.fns[n](images, prompts), np.float32) for n in self.on_device}

    def total(self, parts: dict[str, np.ndarray]) -> np.ndarray:
        """{name: [b]} -> the weighted sum [b] float32."""
        return sum(w * parts[n] for n, w in self.weighted).astype(np.float32)

    def __call__(self, images, prompts) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        parts = {}
        if self.on_host:
            parts.update(self.host_parts(parallel.local_rows(images) if isinstance(images, jax.Array) else np.asarray(images), prompts))
        parts.update(self.device_parts(images, prompts))
        return self.total(parts), {n: parts[n] for n, _ in self.weighted}


def build(weighted: Sequence[tuple[str, float]], models: Any = None, remote_settings: Any = None) -> Weighted:
    """`((name, weight), ...)` -> `Weighted`: `fn(images, prompts) -> (weighted sum [B] float32, {name: [B]})`, host,
    device and remote rewards mixed (module doc); `models`: where the device rewards' weights are
    (config.world.reward_models); `remote_settings`: the remote rewards' (config.train.remote_rewards, `remote.DEFAULTS`)."""
    check(weighted, models)
    weighted = [(str(n), float(w)) for n, w in weighted]
    fns = {n: REWARDS[n]() for n, _ in weighted if n in REWARDS}
    fns.update({n: remote.build(n, remote_settings) for n, _ in weighted if remote.is_remote(n)})
    fns.update({n: device.loaded(n, models)[1] for n, _ in weighted if n in device.FACTORIES})
    return Weighted(weighted, fns)
