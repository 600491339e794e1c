"""Config building blocks shared by `configs/*.py`, and the checks `main.py` runs on a config.

Configs are `ml_collections.ConfigDict`s returned by `get_config(arg)` and locked, so an override
of a key that does not exist fails at parse time; `main.py` turns that into a one-line error.
"""
from __future__ import annotations

import ast
import runpy

from ml_collections import ConfigDict

from flowrl_jax import credit, objectives, worlds
from flowrl_jax.data import curriculum
from flowrl_jax.models.presets import PRESETS
from flowrl_jax.parallel import DEFAULT_RULES
from flowrl_jax.rewards import remote
from flowrl_jax.sampling import windows


class ConfigError(ValueError):
    """A config that cannot run; the message names the key and the fix."""


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


def base_config(job: str) -> ConfigDict:
    """Fields every job has: job, seed, mesh, sharding rules."""
    cfg = ConfigDict()
    cfg.job = job
    cfg.seed = 0
    cfg.mesh = (("data", -1), ("fsdp", 1))  # -1 fills the remaining devices
    cfg.partition_rules = DEFAULT_RULES
    cfg.min_fsdp_size = 2**14  # arrays smaller than this stay replicated
    cfg.distributed = "auto"  # jax.distributed.initialize() on a multi-host TPU slice or cluster (parallel.distributed_plan); True / False
    cfg.compilation_cache = "auto"  # JAX's persistent cache: <workdir>/compilation_cache; a folder; "none" (compiler.cache_dir)
    cfg.distributed_timeout_s = 300  # processes that have not formed their group by then: a one-line error
    return cfg


def require(config: ConfigDict, fields) -> None:
    """Raise ConfigError naming the first dotted field that is absent or empty."""
    for field in fields:
        node = config
        for part in field.split("."):
            if not isinstance(node, ConfigDict) or part not in node:
                raise ConfigError(f"config has no field {field!r}, which this job requires; add it to the config file")
            node = node[part]
        if node is None or node == "":
            raise ConfigError(f"config field {field!r} is required: set it in the config or pass --config.{field}=...")


def parse_overrides(items) -> dict:
    """`["train.lr=1e-3", "sampler.sde_window=(0, 9)"]` -> `{"train.lr": 0.001, ...}` (values as Python literals): the
    benchmarks' `--set`."""
    return {key: ast.literal_eval(value) for key, value in (item.split("=", 1) for item in items)}


def load_config(path: str, variant: str = "", **fields) -> ConfigDict:
    """`get_config(variant)` of a config file with dotted `fields` overridden (`{"train.lr": 1e-3}`): what tests and
    benchmarks build a run from, as `main` does from flags."""
    config = runpy.run_path(path)["get_config"](variant)
    for key, value in fields.items():
        node = config
        *parents, leaf = key.split(".")
        for part in parents:
            node = node[part]
        node[leaf] = value
    return config


def train_config() -> ConfigDict:
    """The `train` job's fields with Flow-GRPO's defaults (SPEC.md §1-§4) on the embedded world; the
    method configs (`configs/flow_grpo.py`, `quickstart.py`, ...) start here and override. Plug-ins
    (the world, credit schemes, objectives, the curriculum) each get one option sub-dict filled from
    their module's `DEFAULTS`: `--config.objective.grpo.clip_range=0.2`, `--config.credit.spatial.tau=1`."""
    cfg = base_config("train")
    cfg.world = worlds.config_fields("shapes")  # base: a shipped asset name or a pretrain workdir; prompt files ("" = shipped)
    cfg.sampler = dict(kind="sde", num_steps=10, shift=1.0, noise_level=0.7, sde_window=(), cfg=3.0,
                       same_noise_per_group=False, logprob_form="gaussian",  # sde_window () = every step
                       window=dict(windows.DEFAULTS))  # how the SDE window moves per iteration: fixed, random (Fast), sliding (MixGRPO)
    cfg.train = dict(iterations=200, prompts_per_iteration=8, group_size=12, num_inner_epochs=1, minibatches=4,
                     lr=3e-4, lr_schedule="constant", weight_decay=1e-4, grad_clip=1.0, ema_decay=0.9, ema_every=1, lora_rank=0, lora_init="kaiming",
                     rewards=(("shapes_score", 1.0),), rewards_without_models=(),  # the rewards used instead, with a warning, when
                     # a device reward of `rewards` has no weights given (world.reward_models): the presets' runnable demo; () = an error
                     time_budget_s=0.0,  # stop after this much training wall time, not counting the first (compiling) iteration; 0 = none
                     rollout_chunk=0, microbatch=0,  # memory knobs (0 = off): rows sampled at a time, pairs per forward/backward (steps.py)
                     score_while_sampling=False,  # True: each rollout chunk (train.rollout_chunk rows) is scored on a thread while the next samples
                     remote_rewards=dict(remote.DEFAULTS))  # remote:NAME@URL rewards: rows per request, seconds (rewards/remote.py)
    cfg.advantage = dict(global_std=True, clip=5.0,
                         null_control=False)  # True: advantages shuffled within each group (steps.make_credit_fn), learning vs drift
    cfg.credit = credit.config_fields()  # names: the chain (credit/__init__.py); one sub-dict of options per scheme
    cfg.curriculum = dict(curriculum.DEFAULTS)  # AdaGRPO's prompt curriculum, SPEC §5 (enabled=False)
    cfg.objective = objectives.config_fields()  # name: grpo | advantage_flow | nft | leapalign; one sub-dict per objective, SPEC §4, §6
    cfg.eval = dict(every=50, at_start=True, per_category=0, samples_per_prompt=1, batch_size=210, num_steps=20, cfg=3.0, shift=1.0,
                    learned_reward=False, noise_seed=1)  # learned_reward: also score the eval images with the shipped learned
    # reward; noise_seed: the eval's initial noise, the same for every run and seed (so evals of runs pair up)
    cfg.checkpoint = dict(every=25, keep=3)
    # image_change: every this many iterations (0: never), how far the iteration's update moved the final latents of
    # the first `image_change_samples` rows at the same noise, split into trained and untrained steps (steps.make_image_change_fn)
    cfg.diagnostics = dict(image_change_every=4, image_change_samples=16)
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


def sd35m_train_config(rewards=(("jpeg_compressibility", 1.0),), beta: float = 0.04, plan: str = "v5p-8",
                       rewards_without_models=()) -> ConfigDict:
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
    cfg.checkpoint.update(every=20, keep=3)
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
    # 32 GB chips keep the frozen DiT FSDP'd: replicated (bf16) the v6e-8 peak is 25.5 GB instead of 17.4, the largest
    # batch 110 prompts instead of 268; the v6e-64 rollout 37.3 GB, past the chip (benchmarks/results/memory_plan.json)
    "v6e-8": dict(devices=8, memory_gb=32, rollout_chunk=16, microbatch=8, remat=True),
    # one H100 (an H200: 141 GB); frozen weights in bf16 (as flow_grpo loads them for LoRA): float32 they and their
    # bf16 copies leave no room for the 48-prompt batch (benchmarks/results/memory_plan.json, WORKSPACE_NOTES.md)
    "gpu": dict(devices=1, memory_gb=80, also_gb=(141,), rollout_chunk=8, microbatch=4, remat=True, param_dtype="bfloat16"),
    # 95 GB chips replicate it: +10.6 GB per chip on v5p-8 (peak 37.6 GB, largest batch 508 prompts instead of 568) for
    # none of the all-gathers (`memory_plan.py --traffic`: up to 15.5 TB per chip per iteration on v5p-8, 2.5 TB on v5p-64)
    # pods: 8 hosts x 4 chips; 36 rows per chip: 9 rows per chunk (4 chunks), 3 pairs per microbatch (54 per minibatch)
    "v5p-64": dict(devices=32, memory_gb=95, mesh=(("data", 8), ("fsdp", 4)), rollout_chunk=288, microbatch=96, remat=True,
                   frozen_dit="replicate"),
    # 16 hosts x 4 chips; 18 rows per chip: 2 rows per chunk (9 chunks), 1 pair per microbatch (81 per minibatch)
    "v6e-64": dict(devices=64, memory_gb=32, mesh=(("data", 8), ("fsdp", 8)), rollout_chunk=128, microbatch=64, remat=True,
                   param_dtype="bfloat16", frozen_dit="fsdp"),
}
SD35M_RULES = ((r"(kernel|embedding)$", "fsdp"), (r".*", "replicate"))  # the DiT, CLIPs and T5-XXL sharded
FROZEN_DIT_RULES = {"fsdp": (), "replicate": ((r"^dit/", "replicate"),)}  # "dit/..." is the frozen tree's DiT only


def apply_memory_plan(config: ConfigDict, target: str) -> ConfigDict:
    """Set `config`'s memory knobs to `MEMORY_PLANS[target]` (mesh, partition rules, chunk sizes, remat, dtype)."""
    if target not in MEMORY_PLANS:
        raise ConfigError(f"unknown memory plan {target!r}: choose one of {', '.join(MEMORY_PLANS)} (configs/sd35m_*.py:<plan>)")
    plan = MEMORY_PLANS[target]
    config.mesh = plan.get("mesh", (("data", 1), ("fsdp", -1)))
    config.partition_rules = FROZEN_DIT_RULES[plan.get("frozen_dit", "fsdp")] + SD35M_RULES
    config.train.update(rollout_chunk=plan["rollout_chunk"], microbatch=plan["microbatch"])
    config.world.remat = plan["remat"]
    config.world.param_dtype = plan.get("param_dtype", "float32")  # the frozen weights' (LoRA adapters stay float32)
    return config
