"""The memory plan's knobs (rl/programs.py): the rollout sampled in row chunks (`train.rollout_chunk`) and the update's
gradient accumulated over microbatches (`train.microbatch`), on the 8-device mesh, against the same computation
without them."""
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.scipy.stats import norm
from jax.sharding import PartitionSpec as P

from configs import common
from flowrl_jax import parallel
from flowrl_jax.objectives.batch import IterationData
from flowrl_jax.rl import plan as plan_lib, programs as programs_lib
from flowrl_jax.rl.minibatch import minibatches
from flowrl_jax.rl.programs import make_update_fn
from tests.conftest import load_config

EPS = float(np.finfo(np.float32).eps)
TINY = {"sampler.num_steps": 3, "train.prompts_per_iteration": 2, "train.group_size": 8, "train.minibatches": 1,
        "objective.grpo.clip_range": 0.2, "sampler.sde_window": (), "train.lora_rank": 0, "mesh": (("data", 4), ("fsdp", 2)),
        "min_fsdp_size": 64}


def _run(base, **fields):
    """(plan, programs, frozen, the step-0 state) of the TINY config on `base`."""
    plan = plan_lib.make_plan(load_config("configs/flow_grpo.py", **{"world.base": base, **TINY, **fields}))
    return (plan, *programs_lib.build(plan, *plan.world.load()))


def _batch(plan):
    t, world = plan.config.train, plan.world
    prompts = [world.train_prompts[i] for i in range(t.prompts_per_iteration) for _ in range(t.group_size)]
    return prompts, parallel.shard_batch(world.tokenize(prompts), plan.mesh)


def test_row_chunks_take_rows_from_every_shard_and_come_back_in_place():
    x = np.arange(48).reshape(24, 2)
    chunks = parallel.to_row_chunks(jnp.asarray(x), num_chunks=3, shards=4)  # 4 shards of 6 rows, 2 rows each per chunk
    expected = np.stack([x[[s * 6 + i * 2 + j for s in range(4) for j in range(2)]] for i in range(3)])
    np.testing.assert_array_equal(chunks, expected)
    out = parallel.map_row_chunks(lambda i, c: (c * 10, jnp.full(c.shape[:1], i)), jnp.asarray(x), num_chunks=3, shards=4)
    np.testing.assert_array_equal(out[0], x * 10)  # every row back in its place
    np.testing.assert_array_equal(out[1], (np.arange(24) % 6) // 2)  # row r of shard s was in chunk (r mod 6) // 2
    with pytest.raises(ValueError, match="cannot be cut into 5 chunks over 4 batch shards"):
        parallel.to_row_chunks(jnp.asarray(x), num_chunks=5, shards=4)


def test_a_map_over_row_chunks_of_a_sharded_batch_moves_no_data():
    mesh = parallel.make_mesh((("data", 4), ("fsdp", 2)))
    shards, sharding = parallel.batch_shards(mesh), parallel.batch_sharding(mesh)
    f = lambda x: parallel.map_row_chunks(lambda i, c: jnp.tanh(c) * 2.0, x, 4, shards, sharding)  # noqa: E731
    hlo = jax.jit(f, in_shardings=sharding, out_shardings=sharding).lower(jnp.zeros((64, 16))).compile().as_text()
    for collective in ("all-to-all", "all-gather", "collective-permute", "all-reduce"):
        assert collective not in hlo, collective


def test_chunked_rollout_equals_the_whole_batch_rollout(smoke_base):
    """ODE rollouts have no step noise: chunked and whole-batch rollouts are the same computation on the same rows,
    in other batch sizes. The SDE rollout's chunks draw their own step noise; each row's log-prob is still its
    Gaussian density, and its condition is its own prompt's."""
    ode = {"sampler.kind": "ode", "sampler.same_noise_per_group": False, "objective.name": "advantage_flow"}  # an ODE objective
    plan, whole, frozen, state = _run(smoke_base, **ode)
    _, chunked, frozen_c, state_c = _run(smoke_base, **ode, **{"train.rollout_chunk": 8})
    _, (ids, mask) = _batch(plan)
    rng, levels = jax.random.PRNGKey(3), plan.levels_at(0)
    a = whole.rollout(state.params, frozen, ids, mask, rng, levels)
    b = chunked.rollout(state_c.params, frozen_c, ids, mask, rng, levels)
    c = chunked.rollout(state_c.params, frozen_c, ids, mask, rng, levels, on_chunk=lambda i, out: None)  # chunk by chunk
    # 3 Euler steps of a 6-block DiT in float32 at batch 16 vs 8: the matmuls' rows are the same dot products, blocked
    # differently at most: ~1e3 accumulated roundings of EPS per step relative to the state's scale (the bound of
    # test_rollout's sharded test, 8 x 2800 EPS). A row taken from another chunk or prompt moves a state by O(1).
    # The host-driven chunks (one call per chunk, what train.score_while_sampling runs) are the same chunk function compiled
    # on its own rather than inside the loop over chunks: the same bound.
    for x, y, z in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), jax.tree_util.tree_leaves(c)):
        bound = 8 * 2800 * EPS * max(np.abs(np.asarray(y)).max(), 1.0)  # blocking, above
        np.testing.assert_allclose(x, y, rtol=0, atol=bound)  # whole batch vs chunks: matmul blocking, derived above
        np.testing.assert_allclose(z, y, rtol=0, atol=bound)  # host-driven vs in-program chunks: the same bound

    plan, sde, frozen, state = _run(smoke_base, **{"train.rollout_chunk": 8})
    _, (ids, mask) = _batch(plan)
    ro, cond, _ = sde.rollout(state.params, frozen, ids, mask, rng, plan.levels_at(0))
    p = sde.policy.dit.patch_size
    std = np.asarray(ro.stds)[:, :, None, None, None]
    density = norm.logpdf(np.asarray(ro.next_states), np.asarray(ro.means), std)  # [B, T, H, W, C]
    b_, t_, h, w, c = density.shape
    per_token = density.reshape(b_, t_, h // p, p, w // p, p, c).sum((3, 5, 6)).reshape(b_, t_, -1) / (p * p * c)
    # per-token mean log-density: float32 Gaussian terms of size ~|log std| ~ 10, summed over p^2 C = 48 elements
    np.testing.assert_allclose(ro.logp, per_token, rtol=0, atol=48 * 10 * EPS * 10)  # 48 terms of ~10, x10 margin
    expected = plan.world.encode(frozen, ids, mask)
    np.testing.assert_allclose(cond[0], expected[0], rtol=0, atol=1e-5)  # the same encoder on the same rows (batch 8 vs 16)
    assert not np.allclose(np.asarray(ro.final[:8]), np.asarray(ro.final[8:16]))


def test_microbatched_update_has_the_whole_minibatch_gradient(smoke_base):
    """One SGD step (lr 1) moves the params by minus the gradient: with 4 microbatches it must equal the gradient of
    the whole minibatch (grpo's loss is a weighted mean over pairs), and so must the loss and the mean stats."""
    plan, programs, frozen, state = _run(smoke_base)
    config = plan.config
    prompts, (ids, mask) = _batch(plan)
    levels = plan.levels_at(0)
    ro, cond, null = programs.rollout(state.params, frozen, ids, mask, jax.random.PRNGKey(0), levels)
    sched = programs_lib.schedule_of(config.sampler, levels)
    rewards = parallel.shard_batch(np.linspace(0, 1, len(prompts), dtype=np.float32)[::-1].copy(), plan.mesh)
    gids = parallel.shard_batch(np.repeat(np.arange(2, dtype=np.int32), 8), plan.mesh)
    adv, _, keep = programs.credit(ro, sched, rewards, gids, 2, state.credit, {}, jax.random.PRNGKey(1))
    data = IterationData(ro, sched, adv, cond, null, jax.random.PRNGKey(2))
    rows, slots, weight = next(minibatches(np.asarray(keep), plan.slots_at(levels), plan.minibatch_size, np.random.default_rng(0)))
    weight = weight.copy()
    weight[-5:] = 0.0  # padding pairs, unevenly spread over the microbatches
    assert len(rows) == 48

    outs = []
    for microbatch in (0, 12):
        cfg = config.copy_and_resolve_references()
        cfg.train.microbatch = microbatch
        sgd = optax.sgd(1.0)
        update = jax.jit(make_update_fn(programs.policy, plan.objective, plan.loss_options(programs.policy.dit.patch_size), sgd, cfg,
                                        None, parallel.batch_sharding(plan.mesh)))
        start = state.replace(opt_state=sgd.init(state.params))
        new, stats = update(start, frozen, data, rows, slots, weight)
        grads = jax.tree_util.tree_map(lambda p, q: np.asarray(p) - np.asarray(q), start.params, new.params)
        outs.append((np.concatenate([g.ravel() for g in jax.tree_util.tree_leaves(grads)]), stats))
    (g0, s0), (g1, s1) = outs
    scale = np.abs(g0).max()
    assert scale > 0
    # Float32 sums over the pairs' ~48 x 16 token terms, reassociated into 4 partial sums and the DiT's matmuls at batch
    # 12 vs 48: |delta| <= K EPS sum|terms| with K ~ 800, i.e. ~1e-4 of sum|terms|, itself within ~10x max|g| here;
    # so 1e-3 max|g| (measured 2.3e-6). A microbatch lost, counted twice or given the wrong share moves the gradient by ~1/4 of it.
    np.testing.assert_allclose(g1, g0, rtol=0, atol=1e-3 * scale)  # K eps sum|terms|, derived above
    for key in ("loss", "policy_loss", "kl", "clipfrac", "approx_kl"):
        np.testing.assert_allclose(s1[key], s0[key], rtol=1e-4, atol=1e-7, err_msg=key)  # the same weighted means, reassociated


PLANS = [("sd35m", t) for t in common.MEMORY_PLANS] + [("flux1_dev", t) for t in common.FLUX_MEMORY_PLANS]


@pytest.mark.parametrize("model,target", PLANS, ids=[f"{m}:{t}" for m, t in PLANS])
def test_every_memory_plan_divides_its_batch_shards(model, target):
    """What the train job's setup would refuse on the pod itself: each plan's mesh fills its devices, the chunk and the
    microbatch are whole numbers of batch shards, the chunk divides flow_grpo's 48 x 24 rows; the frozen DiT's rule
    matches the frozen tree's DiT alone (paths 'dit/...'), not a trainable DiT's state or the text encoders."""
    if model == "sd35m":
        config, plan = common.sd35m_train_config(plan=target), common.MEMORY_PLANS[target]
    else:
        config, plan = common.flux1_dev_train_config(plan=target), common.FLUX_MEMORY_PLANS[target]
    t = config.train
    # the device count is the plan's, not this machine's: the mesh is checked by arithmetic
    sizes = dict(config.mesh)
    filled = [s for s in sizes.values() if s != -1]
    shards = plan["devices"] if -1 in sizes.values() else int(np.prod(filled))
    assert plan["devices"] % int(np.prod(filled)) == 0 and shards == plan["devices"]
    rows = t.prompts_per_iteration * t.group_size
    assert t.rollout_chunk % shards == 0 and rows % t.rollout_chunk == 0, (t.rollout_chunk, shards, rows)
    assert t.microbatch % shards == 0, (t.microbatch, shards)
    assert config.eval.batch_size % shards == 0 and config.eval.batch_size >= 16, (config.eval.batch_size, shards)  # sharded eval
    replicated = plan.get("frozen_dit", "fsdp") == "replicate"
    for path, frozen_dit in (("dit/transformer_blocks_0/attn/to_q/kernel", True), ("params/transformer_blocks_0/attn/to_q/kernel", False),
                             ("text/t5/block_0/layer_0/SelfAttention/q/kernel", False)):
        spec = parallel.spec_for(path, (1536, 1536), SimpleNamespace(shape={"fsdp": 4}), config.partition_rules, config.min_fsdp_size)
        assert (spec == P()) == (replicated and frozen_dit), (path, spec)
