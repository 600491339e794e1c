"""Which pairs each optimizer step trains on (host side): the iteration's kept samples x the objective's slots, shuffled
and cut into minibatches of one compiled size.

    size = minibatch_pairs(config.train, len(slots))
    for rows, slots_m, weight in minibatches(keep, slots, size, np.random.default_rng([seed, it, epoch])): ...
"""
from __future__ import annotations

import numpy as np


def minibatch_pairs(t_cfg, num_slots: int) -> int:
    """Pairs per optimizer step: the iteration's samples x slots over `train.minibatches`, rounded up to a whole
    number of `train.microbatch`es (the padding pairs have weight 0)."""
    pairs = -(-t_cfg.prompts_per_iteration * t_cfg.group_size * num_slots // t_cfg.minibatches)
    micro = t_cfg.get("microbatch", 0)
    return -(-pairs // micro) * micro if micro else pairs


def minibatches(keep: np.ndarray, slots: np.ndarray, size: int, rng: np.random.Generator):
    """(rows, slots, weight) chunks of `size` over the kept samples x training slots, the samples in a
    shuffled order and each sample's pairs together (as Flow-GRPO accumulates all of a sample's steps into
    one optimizer step), so that in the first epoch a chunk's samples are unseen by the updates before it
    (but where a sample straddles two chunks); the last chunk is padded with weight-0 pairs so every update
    has one compiled shape."""
    rows, steps = np.meshgrid(rng.permutation(np.flatnonzero(keep)), slots, indexing="ij")
    pairs = np.stack([rows.ravel(), steps.ravel()], 1)
    for start in range(0, len(pairs), size):
        chunk = pairs[start : start + size]
        weight = np.ones(size, np.float32)
        if len(chunk) < size:
            weight[len(chunk):] = 0.0
            chunk = np.concatenate([chunk, np.repeat(chunk[:1], size - len(chunk), 0)])
        yield chunk[:, 0].astype(np.int32), chunk[:, 1].astype(np.int32), weight
