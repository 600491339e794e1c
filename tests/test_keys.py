"""Every random stream of a run comes from `keys.device` / `keys.host` (issue 45): over a range of seeds, streams,
iterations, optimizer steps, microbatches and inner epochs, no two (seed, stream, indices) share a key or a generator.
The old derivations are checked to collide where the issue says they did, so the test can tell the schemes apart."""
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flowrl_jax import keys

SEEDS, ITERATIONS, STEPS, MICROBATCHES, EPOCHS = range(6), range(12), range(24), range(4), range(4)


def _device_keys() -> dict:
    """{(seed, stream, indices...): key data as bytes} for every stream the train job uses, as it uses them."""
    out = {}
    for seed in SEEDS:
        out[(seed, "init")] = keys.device(seed, "init")
        for stream in ("rollout", "iteration", "null_control", "diagnostics"):
            batch = jax.vmap(lambda i: keys.device(seed, stream, i))(jnp.arange(len(ITERATIONS)))  # traced index, as under jit
            out.update({(seed, stream, i): k for i, k in zip(ITERATIONS, batch)})
        steps = jax.vmap(lambda u: keys.device(seed, "update", u))(jnp.arange(len(STEPS)))
        for u, k in zip(STEPS, steps):
            out[(seed, "update", u)] = k
            for j in MICROBATCHES:  # the update's microbatch keys: fold_in(step key, j) (rl/programs.py)
                out[(seed, "update", u, "micro", j)] = jax.random.fold_in(k, j)
    return {name: np.asarray(jax.random.key_data(k) if jnp.issubdtype(k.dtype, jax.dtypes.prng_key) else k).tobytes()
            for name, k in out.items()}


def test_no_two_device_streams_share_a_key():
    found = _device_keys()
    assert len(found) == len(SEEDS) * (1 + 4 * len(ITERATIONS) + len(STEPS) * (1 + len(MICROBATCHES)))
    assert len(set(found.values())) == len(found)  # distinct tuples, distinct keys


def test_no_two_host_streams_share_a_generator():
    draws = {}
    for seed in SEEDS:
        for it in ITERATIONS:
            draws[(seed, "prompts", it)] = keys.host(seed, "prompts", it)
            draws[(seed, "window", it)] = keys.host(seed, "window", it)
            for epoch in EPOCHS:
                draws[(seed, "minibatches", it, epoch)] = keys.host(seed, "minibatches", it, epoch)
    first = {name: tuple(rng.integers(0, 2**63, size=2)) for name, rng in draws.items()}
    assert len(set(first.values())) == len(first)
    # the same tuple, the same draws (every process, every resume)
    assert tuple(keys.host(3, "window", 5).integers(0, 2**63, size=2)) == first[(3, "window", 5)]


def test_the_old_derivations_collided_where_the_new_ones_do_not():
    """Before issue 45: the update key `fold_in(PRNGKey(seed + 2), u)` and its microbatch 0 `fold_in(., 0)` were seed
    s + 2's iteration-u keys `fold_in(fold_in(PRNGKey(s + 2), u), 0)` (the rollout); host draws `[seed, it, 3]` were
    both the random window and inner epoch 3's minibatch order."""
    s, u = 0, 5
    old_micro0 = jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(s + 2), u), 0)
    old_rollout_of_s_plus_2 = jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(s + 2), u), 0)
    assert np.array_equal(old_micro0, old_rollout_of_s_plus_2)
    new_micro0 = jax.random.fold_in(keys.device(s, "update", u), 0)
    assert not np.array_equal(new_micro0, keys.device(s + 2, "rollout", u))
    assert np.random.default_rng([s, u, 3]).integers(2**62) == np.random.default_rng([s, u, 3]).integers(2**62)
    assert keys.host(s, "window", u).integers(2**62) != keys.host(s, "minibatches", u, 3).integers(2**62)


def test_a_traced_index_gives_the_eager_key_and_bad_input_is_named():
    eager = keys.device(7, "update", 11)
    np.testing.assert_array_equal(jax.jit(lambda u: keys.device(7, "update", u))(jnp.int32(11)), eager)
    with pytest.raises(ValueError, match="unknown random stream 'rollouts'"):
        keys.device(0, "rollouts", 1)
    with pytest.raises(ValueError, match=r"\[0, 2\^32\)"):
        keys.host(-1, "prompts", 0)


def test_the_stream_numbers_are_distinct():
    numbers = [keys._number(s, (0,) * n) for s, n in itertools.product(keys.STREAMS, range(keys.MAX_INDICES + 1))]
    assert len(set(numbers)) == len(numbers)
