"""What the config files share (big_vision's `configs/common.py`): model presets, the train presets the method
configs start from, and the memory plans of the real-size runs.

    from configs import common
    config = common.embedded_train_config()          # a method on the embedded world, sized for a 2-core CPU
    config = common.sd35m_train_config(plan="v6e-8") # Flow-GRPO on SD3.5-Medium, with a hardware's memory plan
    config = common.flux1_dev_train_config(plan="gpu") # Flow-GRPO on FLUX.1-dev, with a hardware's memory plan
"""
from __future__ import annotations

from ml_collections import ConfigDict

from flowrl_jax.config_lib import ConfigError, base_config  # noqa: F401 (base_config: the configs' import)
from flowrl_jax.models.presets import PRESETS
from flowrl_jax.rl.schema import train_config
from flowrl_jax import worlds
from flowrl_jax.sampling import schedule


def model_config(preset: str) -> ConfigDict:
    """`config.model`: an MMDiT preset's hyper-parameters plus precision, remat and weights."""
    if preset not in PRESETS:
        raise ConfigError(f"unknown model preset {preset!r}; choose one of {sorted(PRESETS)}")
    cfg = ConfigDict(dict(PRESETS[preset]))
    cfg.dtype = "float32"  # compute dtype ("bfloat16" on TPU)
    cfg.param_dtype = "float32"
    cfg.remat = False
    cfg.scan_blocks = "auto"  # runs of equal blocks as one lax.scan: "auto" (remat, or width >= 1024), "always", "never"
    cfg.attention = "xla"  # "xla"; "cudnn" (GPU flash attention), "splash" (TPU Pallas): flowrl_jax/models/attention.py
    cfg.lora_alpha = 64.0
    cfg.timestep_scale = 1000.0
    cfg.weights = ""  # a diffusers SD3Transformer2DModel folder; "" = random init
    return cfg


def embedded_train_config(ode_rollouts: bool = False) -> ConfigDict:
    """`train_config()` sized for the embedded world on a 2-core CPU (what the quickstart and every method's
    config start from, so that `benchmarks/compare_methods.py` compares like with like): LoRA rank 32 at
    lr 3e-4, an SDE window on the first two of the 10 steps, shared initial noise per group, 8 prompts x
    12 images per iteration, evals on the full test set with one sample per prompt (and the learned
    reward of the eval images). `ode_rollouts` (the forward-process objectives and LeapAlign): the ODE
    sampler on every step, independent initial noise per image (else a group's images are the same)."""
    cfg = train_config()
    cfg.sampler.update(sde_window=(0, 2), same_noise_per_group=True)
    if ode_rollouts:
        cfg.sampler.update(kind="ode", sde_window=(), same_noise_per_group=False)
    cfg.train.update(iterations=36, prompts_per_iteration=8, group_size=12, minibatches=2, lr=3e-4, lora_rank=32)
    cfg.eval.update(every=0, per_category=0, samples_per_prompt=1, batch_size=210, learned_reward=True)
    cfg.checkpoint.update(every=8)
    return cfg


def sd35m_train_config(rewards=(), beta: float = 0.04, plan: str = "v5p-8",
                       rewards_without_models=(("jpeg_compressibility", 1.0),)) -> ConfigDict:
    """Flow-GRPO on SD3.5-Medium in the latent world, from flow_grpo's `config/grpo.py` SD3.5-M settings:
    512 px, groups of 24, 48 prompts per iteration (1,152 images) in 2 optimizer steps, 10 rollout steps
    (SDE noise level 0.7; steps 0-8 trained, upstream's timestep_fraction 0.99) and 40 eval steps, CFG 4.5,
    shift 3, LoRA rank 32 / alpha 64 at lr 3e-4, clip 1e-4, KL beta per task, bf16 compute with float32
    params. The pipeline folder and the prompt datasets come from the command line (`config.world`). `plan`: the
    memory plan of the hardware (`MEMORY_PLANS`: v5p-8, v6e-8, gpu, v5p-64, v6e-64), chosen in the config file's argument."""
    cfg = train_config()
    cfg.world = worlds.config_fields("sd3")
    cfg.world.update(resolution=512, t5_max_length=128, dtype="bfloat16")  # flow_grpo: max_sequence_length 128
    cfg.sampler.update(kind="sde", num_steps=10, shift=3.0, noise_level=0.7, sde_window=(0, 9), cfg=4.5, same_noise_per_group=False)
    cfg.train.update(iterations=1000, prompts_per_iteration=48, group_size=24, minibatches=2, lr=3e-4, lora_rank=32,
                     weight_decay=1e-4, grad_clip=1.0, rewards=tuple(rewards), rewards_without_models=tuple(rewards_without_models))
    cfg.objective.grpo.update(clip_range=1e-4, beta=beta)
    cfg.eval.update(every=50, at_start=True, samples_per_prompt=1, batch_size=16, num_steps=40, cfg=4.5, shift=3.0,
                    learned_reward=False, noise_seed=1)
    # a checkpoint after every iteration: a preemption loses at most the iteration in flight. The LoRA state's asynchronous
    # save blocks the loop for its copy to host memory only (benchmarks/checkpoint_cost.py; docs/scale_out.md "Goodput")
    cfg.checkpoint.update(every=1, keep=3)
    cfg.diagnostics.image_change_every = 0  # its three extra unsharded CFG rollouts cost ~9% of a v5p-64 iteration
    return apply_memory_plan(cfg, plan)  # the mesh, the sharding of the frozen DiT, chunk sizes, remat


# The memory plan of `sd35m_train_config()` per target (`benchmarks/memory_plan.py` measures each; README "Memory plan"):
# devices and memory per device (vendor figures, GB), the mesh (data x fsdp; default FSDP over every device), the knobs:
# rows sampled and decoded at a time (`train.rollout_chunk`, global), pairs per forward/backward (`train.microbatch`,
# global; both multiples of the mesh's batch shards, the chunk a divisor of flow_grpo's 48 x 24 rows), remat per MMDiT
# block, the frozen weights' dtype, and `frozen_dit`: the frozen base DiT (LoRA trains adapters only) "fsdp" (sharded,
# all-gathered at every DiT call) or "replicate" (a whole copy per device, no all-gather): chosen per plan from the
# memory and traffic table of `benchmarks/memory_plan.py --traffic` (README "Memory plan").
MEMORY_PLANS = {
    "v5p-8": dict(devices=4, memory_gb=95, rollout_chunk=32, microbatch=16, remat=True, frozen_dit="replicate"),
    # frozen weights in bf16, the frozen DiT replicated: FSDP'd it is 36.2 TB all-gathered per chip per iteration in float32,
    # 18.1 TB in bf16 (`memory_plan.py --traffic`), against a 75 s iteration on paper; replicated in bf16 the peak is 22.6 GB
    # of the 32 (the eval's; the largest batch 200 prompts, 4x the preset's 48; benchmarks/results/memory_plan.json)
    "v6e-8": dict(devices=8, memory_gb=32, rollout_chunk=16, microbatch=8, remat=True, param_dtype="bfloat16", frozen_dit="replicate"),
    # one H100 (an H200: 141 GB); frozen weights in bf16 (as flow_grpo loads them for LoRA): float32 they and their
    # bf16 copies leave no room for the 48-prompt batch (benchmarks/results/memory_plan.json, WORKSPACE_NOTES.md)
    "gpu": dict(devices=1, memory_gb=80, also_gb=(141,), rollout_chunk=8, microbatch=4, remat=True, param_dtype="bfloat16"),
    # 95 GB chips replicate it: +10.6 GB per chip on v5p-8 (peak 37.6 GB, largest batch 508 prompts instead of 568) for
    # none of the all-gathers (`memory_plan.py --traffic`: up to 15.5 TB per chip per iteration on v5p-8, 2.5 TB on v5p-64)
    # pods: 8 hosts x 4 chips; 36 rows per chip: 9 rows per chunk (4 chunks), 3 pairs per microbatch (54 per minibatch)
    "v5p-64": dict(devices=32, memory_gb=95, mesh=(("data", 8), ("fsdp", 4)), rollout_chunk=288, microbatch=96, remat=True,
                   frozen_dit="replicate"),
    # 16 hosts x 4 chips; 18 rows per chip: 2 rows per chunk (9 chunks), 1 pair per microbatch (81 per minibatch); the
    # frozen DiT stays FSDP'd: replicated, the rollout needs 37.3 GB, past the chip (benchmarks/results/memory_plan.json)
    # A save every 5 iterations: its blocking part is 4.5% of this plan's 9.4 s iteration on paper, over the 2% that
    # every iteration is worth (benchmarks/checkpoint_cost.py, goodput_on_paper.py); a preemption loses <= 5 (~47 s)
    "v6e-64": dict(devices=64, memory_gb=32, mesh=(("data", 8), ("fsdp", 8)), rollout_chunk=128, microbatch=64, remat=True,
                   param_dtype="bfloat16", frozen_dit="fsdp", checkpoint_every=5),
}
SD35M_RULES = ((r"(kernel|embedding)$", "fsdp"), (r".*", "replicate"))  # the DiT, CLIPs and T5-XXL sharded
FROZEN_DIT_RULES = {"fsdp": (), "replicate": ((r"^dit/", "replicate"),)}  # "dit/..." is the frozen tree's DiT only


def apply_memory_plan(config: ConfigDict, target: str, plans: dict = MEMORY_PLANS) -> ConfigDict:
    """Set `config`'s memory knobs to `plans[target]` (mesh, partition rules, chunk sizes, remat, dtype) and its
    checkpoint cadence where the plan has one (`plans`: `MEMORY_PLANS`, SD3.5-M's, or `FLUX_MEMORY_PLANS`)."""
    if target not in plans:
        raise ConfigError(f"unknown memory plan {target!r}: choose one of {', '.join(plans)} (configs/<preset>.py:<plan>)")
    plan = plans[target]
    config.mesh = plan.get("mesh", (("data", 1), ("fsdp", -1)))
    config.partition_rules = FROZEN_DIT_RULES[plan.get("frozen_dit", "fsdp")] + SD35M_RULES
    config.train.update(rollout_chunk=plan["rollout_chunk"], microbatch=plan["microbatch"])
    config.eval.batch_size = -(-config.eval.batch_size // plan["devices"]) * plan["devices"]  # whole rows on every device (the
    # eval is split over the batch axes, which span every device in these meshes): 16 -> 32 on v5p-64, 64 on v6e-64
    config.world.remat = plan["remat"]
    config.world.param_dtype = plan.get("param_dtype", "float32")  # the frozen weights' (LoRA adapters stay float32)
    config.checkpoint.every = plan.get("checkpoint_every", config.checkpoint.every)
    return config


def flux1_dev_train_config(rewards=(), beta: float = 0.0, noise_level: float = 0.9, plan: str = "v5p-8",
                           rewards_without_models=(("jpeg_compressibility", 1.0),)) -> ConfigDict:
    """Flow-GRPO on FLUX.1-dev in the latent world, from flow_grpo's `config/grpo.py:pickscore_flux` and
    `scripts/train_flux.py`: 512 px, groups of 24, 48 prompts per iteration (1,152 images) in 2 optimizer steps, 6 rollout
    steps (SDE noise level 0.9 on every step, steps 0-4 trained: timestep_fraction 0.99) and 28 eval steps, the distilled
    guidance 3.5 and no CFG, FluxPipeline's dynamic shift (e^mu at 1,024 tokens: `schedule.flux_shift(512)` = 1.878), T5
    at 128 tokens, LoRA rank 64 / alpha 128 (gaussian init) on flow_grpo's FLUX targets at lr 3e-4, clip 1e-4, KL beta
    per task (0 for PickScore), bf16 compute. `plan`: the memory plan of the hardware (`FLUX_MEMORY_PLANS`)."""
    cfg = train_config()
    cfg.world = worlds.config_fields("flux")
    cfg.world.update(resolution=512, t5_max_length=128, dtype="bfloat16", guidance=3.5, lora_alpha=128.0)
    shift = schedule.flux_shift(512)
    cfg.sampler.update(kind="sde", num_steps=6, grid="flux", shift=shift, noise_level=noise_level, sde_window=(0, 5), cfg=1.0,
                       same_noise_per_group=False)
    cfg.train.update(iterations=1000, prompts_per_iteration=48, group_size=24, minibatches=2, lr=3e-4, lora_rank=64,
                     lora_init="gaussian", weight_decay=1e-4, grad_clip=1.0, rewards=tuple(rewards),
                     rewards_without_models=tuple(rewards_without_models))
    cfg.objective.grpo.update(clip_range=1e-4, beta=beta)
    cfg.eval.update(every=30, at_start=True, samples_per_prompt=1, batch_size=16, num_steps=28, cfg=1.0, shift=shift,
                    learned_reward=False, noise_seed=1)  # flow_grpo evaluates every 30 epochs, ODE at the train guidance
    cfg.checkpoint.update(every=1, keep=3)
    cfg.diagnostics.image_change_every = 0
    return apply_memory_plan(cfg, plan, FLUX_MEMORY_PLANS)


# The memory plan of `flux1_dev_train_config()` per target (`benchmarks/memory_plan.py --model flux1_dev` measures each;
# docs/real_models.md "FLUX.1"): FLUX.1-dev's transformer is 11.9B parameters, 23.8 GB in bf16, T5-XXL 9.5 GB. The
# frozen weights are bf16 everywhere (as flow_grpo loads them); the DiT is FSDP'd where a replica does not leave room.
FLUX_MEMORY_PLANS = {
    # the frozen DiT FSDP'd on every plan: replicated, each DiT call's stacked copy of the scanned blocks' weights
    # (`models/scan.py`) is a second whole DiT per chip, and the v5p-8 eval's bound reached 105.5 GB of the 95
    "v5p-8": dict(devices=4, memory_gb=95, rollout_chunk=32, microbatch=8, remat=True, param_dtype="bfloat16", frozen_dit="fsdp"),
    # one H200 (141 GB): on an 80-GB H100 the bf16 bound of the rollout and the eval is past the chip at any batch (the
    # frozen DiT, T5 and the stacked copy of the scanned blocks' weights each DiT call makes: `models/scan.py`)
    "gpu": dict(devices=1, memory_gb=141, also_gb=(80,), rollout_chunk=8, microbatch=2, remat=True, param_dtype="bfloat16"),
    "v5p-64": dict(devices=32, memory_gb=95, mesh=(("data", 8), ("fsdp", 4)), rollout_chunk=288, microbatch=64, remat=True,
                   param_dtype="bfloat16", frozen_dit="fsdp"),
    "v6e-64": dict(devices=64, memory_gb=32, mesh=(("data", 8), ("fsdp", 8)), rollout_chunk=128, microbatch=64, remat=True,
                   param_dtype="bfloat16", frozen_dit="fsdp", checkpoint_every=5),
}
