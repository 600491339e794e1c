"""Rewards by name, on the host or on the device, mixed freely in a weighted sum.

    reward_fn = build((("shapes_score", 1.0), ("shapes_strict", 0.5)), models)   # models: config.world.reward_models
    total, parts = reward_fn(images, prompts)        # weighted sum [B], and each named reward [B] (this process's rows)

`images` [B, H, W, 3] in [-1, 1]: numpy rows on the host, or the decoded batch as a (sharded) jax.Array straight from
the device. Host rewards read this process's rows as numpy; device rewards (`device.py`) run jitted on the array where
it lies, their prompts tokenized on the host and sharded like the images, so the images make no host round trip.
Host rewards, `(images numpy, prompt rows) -> r [B]`:
- `shapes_score`: the exact evaluator's partial-credit score (Flow-GRPO's GenEval reward), in [0, 1].
- `shapes_strict`: its 0/1 GenEval correctness.
- `learned`: the shipped learned reward (`shapes32_reward`, differentiable in the pixels).
- `jpeg_compressibility` / `jpeg_incompressibility`: DDPO's model-free rewards (`image.py`), for any world.
Device rewards (`device.py`, weights from `config.world.reward_models`): `pickscore`, `clipscore`, `aesthetic`.
New rewards register in `REWARDS` or `device.FACTORIES` (factories, so heavy ones load lazily).
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from flowrl_jax import parallel
from flowrl_jax.models import clip
from flowrl_jax.rewards import device, image, learned, shapes_eval


def _exact(field: str) -> Callable:
    def reward(images, prompts):
        return shapes_eval.evaluate(np.asarray(images), [p["spec"] for p in prompts])[field]
    return reward


def _learned() -> Callable:
    apply, params, tokenize = learned.reward_model()
    apply = jax.jit(apply)

    def reward(images, prompts):
        ids, mask = tokenize(prompts)
        return np.asarray(apply(params, jnp.asarray(images), jnp.asarray(ids), jnp.asarray(mask)))
    return reward


REWARDS: dict[str, Callable[[], Callable]] = {  # host rewards
    "shapes_score": lambda: _exact("score"),
    "shapes_strict": lambda: _exact("strict"),
    "learned": _learned,
    "jpeg_compressibility": lambda: image.jpeg_compressibility,
    "jpeg_incompressibility": lambda: image.jpeg_incompressibility,
}


def check(weighted: Sequence[tuple[str, float]], models: Any = None) -> None:
    """ValueError naming the unknown reward(s), without building any; with `models` (config.world.reward_models), a
    one-line error for a device reward whose weights are not given or not there (no weights are read)."""
    unknown = [str(n) for n, _ in weighted if str(n) not in REWARDS and str(n) not in device.FACTORIES]
    if unknown or not weighted:
        raise ValueError(f"unknown reward(s) {unknown or 'none given'}; known rewards: {sorted(REWARDS) + sorted(device.FACTORIES)}")
    for name, _ in weighted:
        if str(name) in device.FACTORIES and models is not None:
            device.check(str(name), models)


class _OnDevice:
    """A device reward run on images where they lie: jitted, its params placed once per mesh they arrive on (the CLIP
    towers' kernels FSDP-sharded, `clip.PARTITION_RULES`, the rest replicated; host images: the default device)."""

    def __init__(self, reward: device.DeviceReward):
        self.reward, self.apply, self.placed = reward, jax.jit(reward.apply), {}

    def __call__(self, images, prompts) -> np.ndarray:
        ids = np.asarray(self.reward.tokenize(prompts))
        sharding = getattr(images, "sharding", None)
        mesh = sharding.mesh if isinstance(sharding, jax.sharding.NamedSharding) else None
        if mesh not in self.placed:
            params = self.reward.params
            self.placed[mesh] = (parallel.put_global(params, parallel.tree_shardings(params, mesh, clip.PARTITION_RULES))
                                 if mesh is not None else jax.tree_util.tree_map(jnp.asarray, params))
        if mesh is not None and images.shape[0] % parallel.batch_shards(mesh) == 0:
            return parallel.local_rows(self.apply(self.placed[mesh], images, parallel.shard_batch(ids, mesh)))
        return np.asarray(self.apply(self.placed[mesh], jnp.asarray(images), ids))


_LOADED: dict[tuple, tuple[device.DeviceReward, _OnDevice]] = {}  # (name, its folders) -> the reward, loaded once


def _device_reward(name: str, models: Any) -> tuple[device.DeviceReward, _OnDevice]:
    """A device reward and its runner, loaded once per process whoever asks (the train loop's rewards, the world's
    eval, the latent world's reward model): the weights are read and placed once, not once per caller."""
    key = (name, tuple(sorted((k, str(v)) for k, v in dict(models).items())))
    if key not in _LOADED:
        reward = device.FACTORIES[name](models)
        _LOADED[key] = (reward, _OnDevice(reward))
    return _LOADED[key]


def build_device(weighted: Sequence[tuple[str, float]], models: Any) -> dict[str, device.DeviceReward]:
    """The device rewards of `weighted`, loaded (host params)."""
    return {str(n): _device_reward(str(n), models)[0] for n, _ in weighted if str(n) in device.FACTORIES}


def build(weighted: Sequence[tuple[str, float]], models: Any = None) -> Callable:
    """`((name, weight), ...)` -> `fn(images, prompts) -> (weighted sum [B] float32, {name: [B]})`, host and device
    rewards mixed (module doc); `models`: where the device rewards' weights are (config.world.reward_models)."""
    check(weighted, models)
    weighted = [(str(n), float(w)) for n, w in weighted]
    fns = {n: REWARDS[n]() for n, _ in weighted if n in REWARDS}
    fns.update({n: _device_reward(n, models)[1] for n, _ in weighted if n in device.FACTORIES})

    def reward(images, prompts):
        host = None
        parts = {}
        for n, _ in weighted:
            if n in REWARDS:
                if host is None:
                    host = parallel.local_rows(images) if isinstance(images, jax.Array) else np.asarray(images)
                parts[n] = np.asarray(fns[n](host, prompts), np.float32)
            else:
                parts[n] = np.asarray(fns[n](images, prompts), np.float32)
        return sum(w * parts[n] for n, w in weighted).astype(np.float32), parts

    return reward
