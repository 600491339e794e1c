"""Every random stream of a run from one function: the seed, a named stream and the stream's indices.

    key = keys.device(seed, "rollout", it)                # a JAX PRNG key (jit-able: an index may be traced)
    rng = keys.host(seed, "minibatches", it, epoch)       # a numpy Generator, the same on every process

The key of `(seed, stream, i_1 .. i_n)` is `PRNGKey(seed)` folded with the stream's number and n, then with each
index in turn; the host generator is seeded with the same tuple. Two different tuples therefore take two different
fold paths from two different roots (or the same root and a different first fold), and share a key only by a
threefry collision. The old scheme derived streams by offsetting the seed (`PRNGKey(seed + 2)`) or by tuples of
different lengths (`[seed, it]`, `[seed, it, 3]`), so seed s's update key at step u was seed s + 2's rollout key at
iteration u, and an iteration's minibatch order at epoch 3 was its window draw (issue 45; `tests/test_keys.py`).
"""
from __future__ import annotations

import jax
import numpy as np

STREAMS = {  # name: number (never renumber: a run's draws follow them)
    "init": 1,          # the train state's initialisation (LoRA adapters)
    "rollout": 2,       # an iteration's initial noise and SDE step noise (rl/programs.py)
    "iteration": 3,     # an iteration's own draws inside the update (the forward objectives' times, LeapAlign's steps)
    "update": 4,        # an optimizer step's key (index: the step), split per microbatch (second index)
    "null_control": 5,  # the null control's shuffle of the advantages
    "window": 6,        # the SDE window's random start (Flow-GRPO-Fast)
    "prompts": 7,       # the prompts an iteration draws (worlds without a prompt reader, the curriculum)
    "minibatches": 8,   # which pairs each optimizer step trains on (index: iteration, inner epoch)
    "diagnostics": 9,   # the image-change diagnostic's rollouts
}
MAX_INDICES = 8


def _number(stream: str, indices: tuple) -> int:
    if stream not in STREAMS:
        raise ValueError(f"unknown random stream {stream!r}; known: {sorted(STREAMS)}")
    if len(indices) > MAX_INDICES:
        raise ValueError(f"stream {stream!r}: at most {MAX_INDICES} indices, got {len(indices)}")
    return STREAMS[stream] * (MAX_INDICES + 1) + len(indices)  # the index count too: (u,) and (u, 0) differ


def device(seed: int, stream: str, *indices) -> jax.Array:
    """The JAX key of `(seed, stream, indices)` (module doc); indices are ints >= 0 or traced int32 scalars."""
    key = jax.random.fold_in(jax.random.PRNGKey(seed), _number(stream, indices))
    for i in indices:
        key = jax.random.fold_in(key, i)
    return key


def host(seed: int, stream: str, *indices: int) -> np.random.Generator:
    """The numpy generator of `(seed, stream, indices)`: `SeedSequence` of the whole tuple (module doc)."""
    if not all(0 <= int(v) < 2**32 for v in (seed, *indices)):  # one 32-bit word each, so no two tuples share words
        raise ValueError(f"seed and indices must be in [0, 2^32): seed {seed}, indices {indices}")
    return np.random.default_rng([int(seed), _number(stream, indices), *(int(i) for i in indices)])
