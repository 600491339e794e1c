"""The types between the RL loop and a world (the package's doc has the protocol in use).

Worlds import these from here, not from the package, whose `__init__` imports the worlds.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple, Protocol

import jax
import numpy as np

from flowrl_jax import rewards


class RunFacts(NamedTuple):
    """What a world may know of the run beyond its own settings."""
    seed: int                   # the run's seed (the prompt reader's order)
    rewards: tuple              # ((name, weight), ...) the run trains on: the eval scores them, the reward model sums them
    remote_rewards: Any         # the remote rewards' settings (`train.remote_rewards`, rewards/remote.py)
    decode_chunk: int           # rows decoded at a time (`train.rollout_chunk`; 0 = all at once)
    mesh: jax.sharding.Mesh     # the run's mesh: the batch's sharding and where the frozen weights are placed
    place: Callable[[Any], Any]  # host params -> global arrays by the run's partition rules (`parallel.put_global`)


class RewardModel(NamedTuple):
    """A reward differentiable in the DiT's output space."""
    apply: Callable     # (params, x [B, H, W, C], ids, mask) -> [B]
    params: Any
    tokenize: Callable  # prompt rows -> (ids, mask) numpy


class Evaluation(NamedTuple):
    entry: dict     # what the run's history keeps: {"table": {row: {metric: value}}, ...}
    scalars: dict   # {"eval/...": value} for the metrics writer
    text: str       # what the loop prints


class World(Protocol):
    train_prompts: Any         # indexable prompt rows
    test_prompts: list[dict]
    eval_name: str   # the eval table's title ("GenEval-style table")
    eval_rows: str   # what its rows are ("category")
    eval_curves: dict  # {metrics key: label}: the eval's curves in the train job's report.png

    def load(self) -> tuple[Any, dict]: ...
    def tokenize(self, prompts: list[dict]) -> tuple[np.ndarray, np.ndarray]: ...
    def encode(self, frozen: dict, ids, mask) -> Any: ...
    def null_condition(self, frozen: dict, batch: int) -> Any: ...
    def latent_shape(self, batch: int) -> tuple[int, ...]: ...
    def decode(self, frozen: dict, x) -> Any: ...
    def sample_prompts(self, n: int, rng: np.random.Generator) -> np.ndarray: ...
    def reward_fn(self, weighted, remote_settings: Any = None) -> rewards.Weighted: ...
    def reward_model(self) -> RewardModel: ...
    def evaluate(self, dit_params, frozen: dict, step: int, workdir: str) -> Evaluation: ...
