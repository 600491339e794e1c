"""The train job's config fields and their defaults: Flow-GRPO on the embedded world (docs/math.md §1-§4).

    config = train_config()         # what configs/common.py's presets and the method configs start from

Plug-ins (the world, credit schemes, objectives, the curriculum, the SDE window's schedule, remote rewards) each
get one option sub-dict filled from their module's `DEFAULTS`: `--config.objective.grpo.clip_range=0.2`,
`--config.credit.spatial.tau=1`.
"""
from __future__ import annotations

from ml_collections import ConfigDict

from flowrl_jax import credit, objectives, worlds
from flowrl_jax.config_lib import base_config
from flowrl_jax.data import curriculum
from flowrl_jax.rewards import remote
from flowrl_jax.rl import trained
from flowrl_jax.sampling import windows


def train_config() -> ConfigDict:
    """The `train` job's fields with Flow-GRPO's defaults (docs/math.md §1-§4) on the embedded world; the
    method configs (`configs/flow_grpo.py`, `quickstart.py`, ...) start here and override. Plug-ins
    (the world, credit schemes, objectives, the curriculum) each get one option sub-dict filled from
    their module's `DEFAULTS`: `--config.objective.grpo.clip_range=0.2`, `--config.credit.spatial.tau=1`."""
    cfg = base_config("train")
    cfg.world = worlds.config_fields("shapes")  # base: a shipped asset name or a pretrain workdir; prompt files ("" = shipped)
    cfg.sampler = dict(kind="sde", num_steps=10, shift=1.0, grid="sd3", noise_level=0.7, sde_window=(), cfg=3.0,
                       same_noise_per_group=False, logprob_form="gaussian",  # sde_window () = every step
                       window=dict(windows.DEFAULTS))  # how the SDE window moves per iteration: fixed, random (Fast), sliding (MixGRPO)
    cfg.train = dict(iterations=200, prompts_per_iteration=8, group_size=12, num_inner_epochs=1, minibatches=4,
                     lr=3e-4, lr_schedule="constant", weight_decay=1e-4, grad_clip=1.0, ema_decay=0.9, ema_every=1, lora_rank=0, lora_init="kaiming",
                     rewards=(("shapes_score", 1.0),), rewards_without_models=(),  # the rewards used instead, with a warning, when
                     # a device reward of `rewards` has no weights given (world.reward_models) or `rewards` is (): a preset's model-free
                     # demo, used only with allow_rewards_without_models=True (else an error naming the missing weights' flag)
                     allow_rewards_without_models=False,
                     time_budget_s=0.0,  # stop after this much training wall time, not counting the first (compiling) iteration; 0 = none
                     rollout_chunk=0, microbatch=0,  # memory knobs (0 = off): rows sampled at a time, pairs per forward/backward (rl/programs.py)
                     score_while_sampling=False,  # True: each rollout chunk (train.rollout_chunk rows) is scored on a thread while the next samples
                     remote_rewards=dict(remote.DEFAULTS))  # remote:NAME@URL rewards: rows per request, seconds (rewards/remote.py)
    cfg.advantage = dict(global_std=True, clip=5.0, std_eps=1e-4, std_ddof=0,  # (r - group mean) / (std + eps): credit/group.py
                         null_control=False)  # True: advantages shuffled within each group (rl/programs.py make_credit_fn), learning vs drift
    cfg.credit = credit.config_fields()  # names: the chain (credit/__init__.py); one sub-dict of options per scheme
    cfg.curriculum = dict(curriculum.DEFAULTS)  # AdaGRPO's prompt curriculum, docs/math.md §5 (enabled=False)
    cfg.objective = objectives.config_fields()  # name: grpo | advantage_flow | nft | leapalign; one sub-dict per objective, docs/math.md §4, §6
    cfg.eval = dict(every=50, at_start=True, per_category=0, samples_per_prompt=1, batch_size=210, num_steps=20, cfg=3.0, shift=1.0,
                    learned_reward=False, noise_seed=1)  # learned_reward: also score the eval images with the shipped learned
    # reward; noise_seed: the eval's initial noise, the same for every run and seed (so evals of runs pair up)
    # every: iterations between saves; every_s: seconds of wall time between saves (0: off), agreed by every process at the
    # end of an iteration, beside `every`. Saves are asynchronous (orbax): the loop waits only for the copy to host memory.
    cfg.checkpoint = dict(every=25, every_s=0.0, keep=3)
    # image_change: every this many iterations (0: never), how far the iteration's update moved the final latents of
    # the first `image_change_samples` rows at the same noise, split into trained and untrained steps (rl/programs.py make_image_change_fn)
    cfg.diagnostics = dict(image_change_every=4, image_change_samples=16)
    # After training (docs/after_training.md): the same config with --config.job=sample | evaluate | export and the run's
    # --workdir. policy: which weights (rl/trained.py); sample: prompts -> PNGs (jobs/sample.py); evaluate: a prompt set's
    # table (jobs/evaluate.py); export: diffusers LoRA / PEFT adapter / merged transformer folders (jobs/export.py).
    cfg.policy = dict(trained.DEFAULTS)
    cfg.sample = dict(prompt="", prompts="", samples_per_prompt=4, batch_size=8, seed=0, kind="ode", noise_level=0.7,
                      num_steps=0, cfg=-1.0, shift=0.0,  # 0 / -1 / 0: the run's eval settings (config.eval)
                      out="")  # "" = <workdir>/samples/<weights>
    cfg.evaluate = dict(prompts="",  # "" = the run's test prompts (world.test_prompts)
                        out="")  # "" = <workdir>/evaluate/<weights>
    cfg.export = dict(formats="auto",  # comma-separated: lora, peft, merged; auto = lora,peft for a LoRA, merged for a whole DiT
                      dtype="bfloat16", max_shard_gb=5.0, out="")  # the merged folder's dtype and shard size; "" = <workdir>/export/<weights>
    return cfg
