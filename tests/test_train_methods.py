"""Every credit scheme and objective through the shared train loop at tiny size, and the configs they refuse."""
import json
import os

import jax
import numpy as np
import pytest

from flowrl_jax import rewards
from flowrl_jax.config_lib import ConfigError
from tests.test_train import TINY, _run, _state


def _brightness_reward(monkeypatch):
    """A reward with spread even for an untrained base (mean pixel value), so advantages are non-zero."""
    monkeypatch.setitem(rewards.REWARDS, "shapes_score", lambda: (lambda images, prompts: np.asarray(images).mean(axis=(1, 2, 3))))


def test_stepwise_adaptive_curriculum_and_lambda_control_run_together(smoke_base, tmp_path, monkeypatch):
    _brightness_reward(monkeypatch)
    out = _run(smoke_base, tmp_path, **{"train.iterations": 2, "credit.names": ("stepwise", "adaptive"), "curriculum.enabled": True,
                                  "objective.grpo.lambda_control": True, "sampler.sde_window": (0, 2)})
    assert out["step"] == 2
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl") if '"reward"' in line]
    assert {"path_variance/step_0", "path_variance_pred/step_1", "path_variance_budget", "over_budget_fraction"} <= set(rows[-1])
    assert rows[-1]["updates"] > 0 and rows[-1]["path_variance/step_0"] > 0
    state = _state(str(tmp_path))
    assert int(state["credit"]["adaptive"]["count"]) == 2
    assert int(np.asarray(state["curriculum"]["count"]).sum()) == 2 * TINY["train.prompts_per_iteration"]


def test_turning_points_compose_with_spatial_credit_and_draw_credit_maps(smoke_base, tmp_path, monkeypatch):
    _brightness_reward(monkeypatch)
    out = _run(smoke_base, tmp_path, **{"train.iterations": 2, "credit.names": ("turning_point", "spatial"), "objective.grpo.ratio": "token"})
    assert out["step"] == 2
    assert os.path.isfile(tmp_path / "credit_maps_000001.png") and os.path.isfile(tmp_path / "credit_maps_000002.png")
    with pytest.raises(ConfigError, match="credit spatial needs per-token ratios.*config.objective.grpo"):
        _run(smoke_base, tmp_path / "bad", **{"credit.names": ("uniform", "spatial")})


@pytest.mark.parametrize("name", ["advantage_flow", "nft", "leapalign"])
def test_forward_process_and_leap_objectives_train_through_the_shared_loop(smoke_base, tmp_path, monkeypatch, name):
    _brightness_reward(monkeypatch)
    anchored = {"objective.leapalign.beta_kl": 1.0, "objective.leapalign.detach_uncond": True}  # the quickstart's two options
    options = anchored if name == "leapalign" else {f"objective.{name}.timesteps": 2}
    out = _run(smoke_base, tmp_path, **{"train.iterations": 2, "objective.name": name, "sampler.kind": "ode", **options})
    assert out["step"] == 2
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl") if '"reward"' in line]
    assert rows[-1]["updates"] == TINY["train.minibatches"] and rows[-1]["kept_fraction"] == 1.0
    assert {"advantage_flow": "flow_matching", "nft": "optimality_mean", "leapalign": "learned_reward"}[name] in rows[-1]
    if name == "leapalign":  # the anchor to the frozen base: 0 at the first update, > 0 once the policy has moved
        assert rows[-1]["kl"] > 0
    state, first = _state(str(tmp_path)), _state(str(tmp_path), 1)
    moved = [np.abs(np.asarray(a) - np.asarray(b)).max() for a, b in zip(jax.tree_util.tree_leaves(state["params"]),
                                                                       jax.tree_util.tree_leaves(first["params"]))]
    assert max(moved) > 0
    if name == "nft":  # the old policy follows with d = min(0.001 step, 0.5): after step 1 (d = 0.001) it is ~ the policy
        old_gap = max(np.abs(np.asarray(a) - np.asarray(b)).max() for a, b in zip(jax.tree_util.tree_leaves(state["old"]),
                                                                                jax.tree_util.tree_leaves(state["params"])))
        assert 0 < old_gap <= 0.01 * max(moved) + 1e-9


def test_objectives_reject_samplers_and_credit_they_cannot_use(smoke_base, tmp_path):
    for fields, match in [({"objective.name": "grpo", "sampler.kind": "ode"}, "cannot be trained on"),
                          ({"objective.name": "nft", "sampler.kind": "sde", "objective.nft.timesteps": 2}, "choose one of ode"),
                          ({"objective.grpo.lambda_control": True, "sampler.kind": "lc"}, "choose one of sde, cps"),
                          ({"objective.name": "nft", "sampler.kind": "ode", "sampler.same_noise_per_group": True,
                            "objective.nft.timesteps": 2}, "same_noise_per_group"),
                          ({"objective.name": "nft", "sampler.kind": "ode"}, "objective.nft.timesteps=9 of the sampler's 3"),
                          ({"objective.name": "advantage_flow", "sampler.kind": "ode", "credit.names": ("stepwise",)}, "needs per-step")]:
        with pytest.raises(ConfigError, match=match):
            _run(smoke_base, tmp_path / "bad", **fields)


def test_a_sliding_window_and_grpo_guard_train_through_the_shared_loop(smoke_base, tmp_path, monkeypatch):
    # MixGRPO-Flash's sliding window (moved 1 step every iteration, DPM-Solver++(2M) on a coarser tail) with GRPO-Guard's
    # RatioNorm: each iteration trains, and logs, the steps of its own window, and the same-noise image change reads it.
    _brightness_reward(monkeypatch)
    out = _run(smoke_base, tmp_path, **{"train.iterations": 2, "sampler.sde_window": (0, 2), "sampler.window.schedule": "sliding",
                                        "sampler.window.shift_every": 1, "objective.grpo.ratio_norm": True,
                                        "sampler.window.end": "whole",  # 3 steps: upstream's cut at T - 2 would leave [0], then none
                                        "sampler.window.tail_solver": "dpm2m", "sampler.window.tail_ratio": 0.5,
                                        "diagnostics.image_change_every": 1})
    assert out["step"] == 2
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl") if '"reward"' in line]
    logged = [sorted(int(k.split("_")[-1]) for k in r if k.startswith("clipfrac/step_")) for r in rows]
    assert logged == [[0, 1], [1, 2]]  # TINY's 3 steps: windows (0, 2) then (1, 2)
    assert all(r["updates"] == TINY["train.minibatches"] and r["image_change/trained_steps"] > 0 for r in rows)
