"""The PyTorch Flow-GRPO reference (benchmarks/torch_reference.py, diffusers' SD3Transformer2DModel) computes
what flowrl_jax computes: with the same weights, LoRA adapters and noise, the rollouts' states and per-step
log-probs, the advantages, and the loss of every update of an iteration (the second one after an AdamW step
on each side) agree. An independent code path for our kernels, loss and optimizer, and the premise of
benchmarks/compare_torch.py."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")

import flax  # noqa: E402
import jax  # noqa: E402

from benchmarks import compare_torch as ct, torch_reference as tr  # noqa: E402
from configs import common  # noqa: E402

FIELDS = {"sampler": dict(num_steps=4, sde_window=(0, 2)), "train": dict(prompts_per_iteration=2, group_size=4, minibatches=2, lora_rank=4),
          "objective.grpo": dict(clip_range=0.2, beta=0.04)}


@pytest.fixture(scope="module")
def pair():
    config = common.embedded_train_config()
    for section, fields in FIELDS.items():
        node = config
        for part in section.split("."):
            node = node[part]
        node.update(fields)
    pipe, base = ct.random_base("tiny")
    return ct.build_pair(config, pipe, base, lora_b_scale=0.05)


def test_torch_reference_matches_flowrl_jax(pair):
    prompts = ct.iteration_prompts(pair, 0)
    ro, cond, null = ct.jax_rollout(pair, prompts, 0)
    side = pair.torch_sides["eager"]
    t_cond, t_null = ct.torch_condition(cond, null)
    sigmas, levels = ct.torch_schedule(pair.config)
    states, next_states, means = (np.asarray(jax.device_get(a)) for a in (ro.states, ro.next_states, ro.means))
    std = np.asarray(ro.stds)[..., None, None, None]
    noise = np.where(std > 0, (next_states - means) / np.where(std > 0, std, 1.0), 0.0)  # the rollout's own draws
    t_ro = side.rollout(tr.nchw(states[:, 0]), tr.nchw(noise).transpose(0, 1), t_cond, t_null, sigmas, levels)

    np.testing.assert_allclose(t_ro["next_states"].movedim(2, -1).numpy(), next_states, atol=2e-5)
    logp = np.asarray(ro.logp).mean(-1)  # [B, T]: per-token means averaged = the whole-image mean
    assert np.all(logp[:, 2:] == 0) and np.all(np.abs(logp[:, :2]) > 0.1)
    np.testing.assert_allclose(t_ro["logp"].numpy(), logp, rtol=1e-5, atol=1e-5)

    reward = np.random.default_rng(0).uniform(size=pair.batch).astype(np.float32)
    adv, stats = ct.jax_updates(pair, ro, cond, null, reward, 0)
    t_adv, t_stats = ct.torch_updates(pair, side, t_ro, t_cond, t_null, reward, 0)
    np.testing.assert_allclose(t_adv.numpy(), np.asarray(adv)[:, 0, 0], rtol=1e-5, atol=1e-6)
    assert len(stats) == len(t_stats) == 2
    for s, t in zip(stats, t_stats):
        assert float(s["kl"]) > 1e-6  # the adapters move the policy off the reference
        for key in ("loss", "policy_loss", "kl"):
            np.testing.assert_allclose(float(t[key]), float(s[key]), rtol=2e-5, atol=1e-8, err_msg=key)
        np.testing.assert_allclose(float(t["grad_norm"]), float(s["grad_norm"]), rtol=2e-5)
    # the second minibatch comes after one AdamW step: the ratio is no longer 1 on either side
    assert float(stats[1]["approx_kl"]) > 0
    # and after both steps the adapters agree. AdamW's step lr m^ / (sqrt(v^) + eps) is ~lr = 3e-4 per element whatever the
    # gradient's size, so an element whose gradient is a cancellation within float32 rounding of 0 takes a step whose size
    # is set by that rounding, on each side its own: such elements may differ by up to the two steps' 2 x 2 lr (seen: 3 of
    # 1,024 elements, up to 2.8e-5). Every other element follows the gradients that agree above: their steps agree to the
    # gradients' 2e-5 relative, 2 x 2e-5 lr = 1.2e-8, plus float32 ulps of values ~0.2 (1.5e-8): 1e-7 each. A porting
    # error (lr, sign, clipping, weight decay, EMA) moves most elements by ~lr: so 99% of elements within 1e-7 (measured
    # 4e-8 at most), and every element within 4 lr.
    ours = flax.traverse_util.flatten_dict(jax.device_get(pair.state.params), sep="/")
    theirs = side.adapters()
    assert sorted(ours) == sorted(theirs)
    diffs = np.concatenate([np.abs(theirs[path] - value).ravel() for path, value in ours.items()])
    lr = float(pair.config.train.lr)
    assert np.mean(diffs <= 1e-7) >= 0.99, np.sort(diffs)[-20:]  # 1e-7: gradient agreement + ulps (derived above)
    assert diffs.max() <= 4 * lr, diffs.max()  # two AdamW steps per side, each <= lr per element
