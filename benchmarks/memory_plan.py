"""The memory plan of Flow-GRPO on SD3.5-Medium (`configs/sd35m_*.py`): per-device memory of the train job's
compiled rollout, decode, update and eval (`SD3World.eval_sampler`: one eval batch, sampled and decoded) on a simulated mesh of each target, from abstract params (no weights), a hand
estimate beside it, and the largest number of prompts per iteration (groups of 24) that fits.

    python benchmarks/memory_plan.py [--targets v5p-8,v6e-8,gpu,v5p-64,v6e-64] [--out benchmarks/results/memory_plan.json]
    python benchmarks/memory_plan.py --traffic      # the frozen DiT replicated or FSDP'd: memory and all-gathers, by hand

Each target's plan is `common.MEMORY_PLANS[target]` (mesh, rows sampled/decoded at a time, pairs per
forward/backward, remat) applied to `common.sd35m_train_config()`: bf16 compute with float32 params and
log-probs, LoRA rank 32, the DiT and the three text encoders FSDP-sharded over every device. The functions are the
train job's own (`rl/programs.py` `make_rollout`, `make_update_fn`, `SD3World.decode_rows`), jitted with the job's shardings,
lowered on `jax.ShapeDtypeStruct`s and compiled by XLA:CPU for the target's device count (up to 64 simulated CPU devices;
a GPU target is one). A phase's peak per device = what stays alive (the frozen weights and the whole train state,
per-device shards) + the stored rollout (from the rollout to the end of the update) + the phase's XLA temp buffers
and new outputs (`memory_analysis`); `all_gathered` sums the all-gathers' results (FSDP weights brought to each
device; how many are alive at once is the schedule's). XLA:TPU and XLA:GPU schedule buffers
differently (and use flash-style attention kernels only where told): the figures are the CPU compiler's, the hand
estimate says where they come from. Everything that grows with the batch (the stored trajectories, conditions,
images) is linear in it, the temp buffers are not (one chunk's, one microbatch's): the largest batch that fits in 90% of the
device's memory follows from the stored bytes per prompt (`--check` compiles it to confirm).
"""
from __future__ import annotations

import os

if __name__ == "__main__":  # the simulated meshes: 8 CPU devices, set before jax starts (not when imported by another script)
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=64").strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import time  # noqa: E402
from types import SimpleNamespace  # noqa: E402
from typing import Callable, NamedTuple  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from configs import common  # noqa: E402
from flowrl_jax import compiler, credit as credit_lib, objectives, parallel, worlds  # noqa: E402
from flowrl_jax.models import clip, clip_text, clip_vision  # noqa: E402
from flowrl_jax.objectives.batch import IterationData  # noqa: E402
from flowrl_jax.rewards import device  # noqa: E402
from flowrl_jax.rl.minibatch import minibatch_pairs  # noqa: E402
from flowrl_jax.rl.policy import Policy  # noqa: E402
from flowrl_jax.rl.programs import make_rollout, make_update_fn, schedule_of  # noqa: E402
from flowrl_jax.rl.state import initial_state, make_optimizer  # noqa: E402
from flowrl_jax.sampling.windows import sampler_levels  # noqa: E402
from flowrl_jax.config_lib import load_config  # noqa: E402
from flowrl_jax.worlds.sd3 import FluxWorld, SD3World  # noqa: E402
from flowrl_jax.worlds.sd3.flux_pipeline import FLUX1_DEV, build_flux_pipeline  # noqa: E402
from flowrl_jax.worlds.sd3.pipeline import SD35_MEDIUM, build_pipeline  # noqa: E402
from reward_throughput import TOWERS  # noqa: E402  (benchmarks/: the reward towers' real shapes)

HEADROOM = 0.9  # of the device's memory: the runtime, fragmentation and the host transfers need the rest
GB = 1e9
DTYPE_BYTES = {"f32": 4, "bf16": 2, "s32": 4, "u32": 4, "pred": 1, "f16": 2}


def _abstract(tree, shardings):
    return jax.tree_util.tree_map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings)


def _bytes(tree) -> int:
    return sum(int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize for a in jax.tree_util.tree_leaves(tree))


def _device_bytes(tree) -> int:
    """Bytes one device holds of a tree of sharded `ShapeDtypeStruct`s."""
    return sum(int(np.prod(a.sharding.shard_shape(a.shape))) * jnp.dtype(a.dtype).itemsize for a in jax.tree_util.tree_leaves(tree))


def _gathered_bytes(hlo: str) -> int:
    """The summed result sizes of the compiled program's all-gathers (FSDP weights, batch rows): what the
    compiler brings to every device; how much of it is alive at once is its schedule's business."""
    total = 0
    for m in re.finditer(r"= \(?(\w+)\[([\d,]*)\][^=]*? all-gather(?:-start)?\(", hlo):
        dtype, dims = m.group(1), m.group(2)
        if dtype in DTYPE_BYTES:
            total += DTYPE_BYTES[dtype] * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
    return total


def _analysis(compiled) -> dict:
    m = compiled.memory_analysis()
    return {"arguments": m.argument_size_in_bytes, "outputs": m.output_size_in_bytes - m.alias_size_in_bytes,
            "temp": m.temp_size_in_bytes, "all_gathered": _gathered_bytes(compiled.as_text())}


METHODS = ("grpo", "leapalign")  # Flow-GRPO (the presets), or LeapAlign on PickScore(decode(x)) (the gradient methods)


def _sd35m_config(target: str, method: str):
    config = common.sd35m_train_config(plan=target)
    config.unlock()
    if method == "leapalign":  # its ODE rollout, PickScore through the VAE decoder as the differentiable reward
        config.objective.name = "leapalign"
        config.sampler.update(kind="ode", sde_window=(), same_noise_per_group=False)
        config.train.rewards = (("pickscore", 1.0),)
    return config


def _flux1_dev_config(target: str, method: str):
    preset = "configs/flux1_dev_leapalign.py" if method == "leapalign" else "configs/flux1_dev_pickscore.py"
    config = load_config(preset, target)
    config.unlock()
    return config


class Model(NamedTuple):
    """A model family's presets, plans and abstract pipeline."""
    title: str
    plans: dict          # target -> memory plan (`configs/common.py`)
    config: Callable     # (target, method) -> the preset's train config on that plan, unlocked
    build: Callable      # (components, dtype=, param_dtype=, remat=, ...) -> (pipeline, init): `build_pipeline`'s form
    components: dict
    world: type


MODELS = {
    "sd35m": Model("SD3.5-M", common.MEMORY_PLANS, _sd35m_config, build_pipeline, SD35_MEDIUM, SD3World),
    "flux1_dev": Model("FLUX.1-dev", common.FLUX_MEMORY_PLANS, _flux1_dev_config, build_flux_pipeline, FLUX1_DEV, FluxWorld),
}


def target_config(target: str, prompts: int, method: str = "grpo", model: str = "sd35m"):
    config = MODELS[model].config(target, method)
    config.train.prompts_per_iteration = prompts
    return config, MODELS[model].plans[target]


def _sequence(model: str, config) -> dict:
    """The DiT's attention sequence and sizes at the config's resolution: tokens per row, width, heads, blocks."""
    dit, w = MODELS[model].components["dit"], config.world
    tokens = (w.resolution // 16) ** 2  # 8x VAE, then patch 2 (SD3) or packing 2 x 2 (FLUX)
    if model == "flux1_dev":  # T5's tokens only (CLIP gives the pooled vector); every block sees the whole sequence
        return {"seq": tokens + w.t5_max_length, "width": dit["num_attention_heads"] * dit["attention_head_dim"],
                "heads": dit["num_attention_heads"], "layers": dit["num_layers"] + dit["num_single_layers"]}
    return {"seq": tokens + w.clip_max_length + w.t5_max_length, "width": dit["num_attention_heads"] * dit["attention_head_dim"],
            "heads": dit["num_attention_heads"], "layers": dit["num_layers"]}


def pickscore_model(pipe, dtype, param_dtype) -> tuple:
    """The latent world's reward model for LeapAlign and spatial credit at real size: PickScore (ViT-H/14, its text
    tower) on the VAE's decode, `(apply(params, latents, ids, mask), init() -> params)`; both towers under remat."""
    towers = TOWERS["ViT-H/14 (PickScore)"]
    model = clip.CLIP(clip_text.CLIPTextEncoder(**towers["text"], dtype=dtype, param_dtype=param_dtype),
                      clip_vision.CLIPVisionEncoder(**towers["vision"], dtype=dtype, param_dtype=param_dtype, remat=True),
                      clip.ImageSettings(), None, 77)
    score = device.similarity(model, 26.0)

    def apply(p, latents, ids, mask):
        return score(p["rewards"]["pickscore"], pipe.decode(p["vae"], latents), ids)

    def init() -> dict:
        key = jax.random.PRNGKey(0)
        return {"text": model.text.init(key, jnp.zeros((1, 77), jnp.int32))["params"],
                "vision": model.vision.init(key, *model.vision.dummy_inputs())["params"], "logit_scale": jnp.zeros((), jnp.float32)}

    return apply, init


def build_job(config, devices, model: str = "sd35m") -> SimpleNamespace:
    """The train job's jitted rollout, decode and update for `config` on a mesh of `devices`, with the abstract
    (sharded `ShapeDtypeStruct`) arguments to lower them on; `init_frozen` / `init_state` make real ones. An objective
    that differentiates the reward (LeapAlign) gets PickScore on the VAE's decode (`pickscore_model`)."""
    mesh = parallel.make_mesh(config.mesh, devices=devices)
    w, t, s = config.world, config.train, config.sampler
    family = MODELS[model]
    pipe, init_frozen = family.build(family.components, dtype=jnp.dtype(w.dtype), param_dtype=jnp.dtype(w.param_dtype),
                                     remat=w.remat, attention=w.attention, scan_blocks=w.scan_blocks,
                                     clip_max_length=w.clip_max_length, t5_max_length=w.t5_max_length)
    frozen = jax.eval_shape(init_frozen, jax.random.PRNGKey(0))
    world = family.world.around(config.world, config.eval, worlds.run_facts(config, mesh), pipe)
    policy = Policy(pipe.dit, t.lora_rank, t.lora_init)
    objective = objectives.get(config.objective.name)
    reward_apply = None
    if objective.uses_reward_model:
        reward_apply, init_reward = pickscore_model(pipe, jnp.dtype(w.dtype), jnp.dtype(w.param_dtype))
        frozen = {**frozen, "reward": {"vae": frozen["vae"], "rewards": {"pickscore": jax.eval_shape(init_reward)}}}
        init_pipeline = init_frozen

        def init_frozen(rng):  # noqa: F811 (the pipeline's weights and the reward model's)
            f = init_pipeline(rng)
            return {**f, "reward": {"vae": f["vae"], "rewards": {"pickscore": init_reward()}}}
    options = objectives.resolve_options(config, pipe.dit.token_patch)
    credit = credit_lib.build(config.credit.names, config.credit, config.advantage.global_std, config.advantage.clip,
                               config.advantage.std_eps, config.advantage.std_ddof)
    optimizer = make_optimizer(t)
    rules, min_size = config.partition_rules, config.min_fsdp_size
    frozen_sh = parallel.tree_shardings(frozen, mesh, rules, min_size)
    init_state = lambda f, r: initial_state(policy, optimizer, credit, objective, config, 0, f["dit"], r)  # noqa: E731
    state = jax.eval_shape(init_state, frozen, jax.random.PRNGKey(0))
    state_sh = parallel.tree_shardings(state, mesh, rules, min_size)
    data_sh, rep = parallel.batch_sharding(mesh), NamedSharding(mesh, P())
    batch = t.prompts_per_iteration * t.group_size
    ids = jax.ShapeDtypeStruct((batch, sum(pipe.lengths)), jnp.int32, sharding=data_sh)
    mask = jax.ShapeDtypeStruct(ids.shape, jnp.bool_, sharding=data_sh)
    key = jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=rep)
    frozen_abs, state_abs = _abstract(frozen, frozen_sh), _abstract(state, state_sh)
    levels = sampler_levels(s)
    rollout_fn = jax.jit(make_rollout(policy, world, config, data_sh).whole,
                         in_shardings=(state_sh.params, frozen_sh, data_sh, data_sh, rep, rep))
    ro, cond, null = jax.eval_shape(rollout_fn, state_abs.params, frozen_abs, ids, mask, key, levels)
    final = jax.ShapeDtypeStruct((batch,) + ro.next_states.shape[2:], ro.next_states.dtype, sharding=data_sh)
    slots = objective.slots(options, levels)
    pairs = minibatch_pairs(t, len(slots))
    batch_leaf = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=data_sh if a.ndim and a.shape[0] == batch else rep)  # noqa: E731
    tokens = None, None
    if objective.uses_reward_model:  # PickScore's token ids (the objective's host-side extras)
        tokens = (jax.ShapeDtypeStruct((batch, 77), jnp.int32, sharding=data_sh), jax.ShapeDtypeStruct((batch, 77), jnp.bool_, sharding=data_sh))
    data = IterationData(jax.tree_util.tree_map(batch_leaf, ro), jax.tree_util.tree_map(batch_leaf, schedule_of(s, levels)),
                         jax.ShapeDtypeStruct((batch, s.num_steps, 1), jnp.float32, sharding=data_sh),
                         jax.tree_util.tree_map(batch_leaf, cond), jax.tree_util.tree_map(batch_leaf, null), key, *tokens)
    index = lambda dtype: jax.ShapeDtypeStruct((pairs,), dtype, sharding=rep)  # noqa: E731
    update_fn = jax.jit(make_update_fn(policy, objective, options, optimizer, config, reward_apply, data_sh),
                        out_shardings=(state_sh, None), donate_argnums=0)
    rows = config.eval.batch_size  # the eval: the EMA policy merged into a DiT shaped (and sharded) as the frozen one
    eval_params = {"dit": frozen_abs["dit"], "text": frozen_abs["text"], "vae": frozen_abs["vae"]}
    eval_args = (eval_params, jax.ShapeDtypeStruct((rows, ids.shape[1]), jnp.int32, sharding=data_sh),
                 jax.ShapeDtypeStruct(world.latent_shape(rows), jnp.float32, sharding=data_sh))
    return SimpleNamespace(
        config=config, mesh=mesh, model=pipe.dit, batch=batch, pairs=pairs, slots=slots, rollout=rollout_fn, decode=jax.jit(world.decode_rows),
        update=update_fn, eval=world.eval_sampler(), eval_args=eval_args, frozen=frozen_abs, state=state_abs, data=data,
        rollout_args=(state_abs.params, frozen_abs, ids, mask, key, levels), decode_args=(frozen_abs["vae"], final),
        update_args=(state_abs, frozen_abs, data, index(jnp.int32), index(jnp.int32), index(jnp.float32)),
        init_frozen=jax.jit(init_frozen, out_shardings=frozen_sh), init_state=jax.jit(init_state, out_shardings=state_sh),
        sizes={"frozen": _bytes(frozen), "trainable": _bytes(state.params), "state": _bytes(state)})


def compile_phases(target: str, prompts: int, float32: bool = False, method: str = "grpo", model: str = "sd35m") -> dict:
    """Per-device bytes of each phase of one iteration at `prompts` x group rows on `target`'s simulated mesh
    (`float32`: weights and compute in float32, for the activations' bound, `native_bf16`)."""
    config, plan = target_config(target, prompts, method, model)
    if float32:
        config.world.update(dtype="float32", param_dtype="float32")
    job = build_job(config, jax.devices()[: plan["devices"]], model)
    names = ("rollout", "decode", "update", "eval")
    compiled = {n: getattr(job, n).lower(*getattr(job, n + "_args")).compile() for n in names}
    frozen_abs, state_abs, data, batch, pairs = job.frozen, job.state, job.data, job.batch, job.pairs
    live = _device_bytes(frozen_abs) + _device_bytes(state_abs)  # alive the whole run
    stored = _device_bytes(data)  # the iteration's rollout, alive from the rollout to the update's end
    phases = {name: _analysis(compiled[name]) for name in names}
    phases["rollout"]["peak"] = live + phases["rollout"]["temp"] + phases["rollout"]["outputs"]  # its outputs are `stored`
    for name in ("decode", "update"):
        phases[name]["peak"] = live + stored + phases[name]["temp"] + phases[name]["outputs"]
    # the eval runs between iterations (no stored rollout) on the merged DiT, a second DiT beside the frozen one
    phases["eval"]["peak"] = live + _device_bytes(frozen_abs["dit"]) + phases["eval"]["temp"] + phases["eval"]["outputs"]
    return {"prompts": prompts, "batch": batch, "minibatch_pairs": pairs, "phases": phases, "live": live, "stored": stored,
            "peak": max(p["peak"] for p in phases.values()),
            "params": job.sizes,
            "per_row": {"rollout": _bytes(data) / batch}}


def hand_estimate(target: str, prompts: int, sizes: dict, method: str = "grpo", model: str = "sd35m") -> dict:
    """Per-device bytes by hand: sharded weights and state, the stored batch, and the largest activation set held at
    once (one rollout chunk's attention scores and MLP, or one microbatch's remat'd forward + one block's backward)."""
    config, plan = target_config(target, prompts, method, model)
    d = plan["devices"]
    t = config.train
    batch = prompts * t.group_size
    dims = _sequence(model, config)
    seq, width, heads, layers = dims["seq"], dims["width"], dims["heads"], dims["layers"]
    cfg_rows = 2 if config.sampler.cfg != 1.0 else 1  # CFG doubles the forward's rows
    weights = (sizes["params"]["frozen"] + sizes["params"]["state"]) / d
    stored = batch * sizes["per_row"]["rollout"] / d  # trajectories (4 x [T, h, w, 16] f32), logp, cond and null
    rows = cfg_rows * (t.rollout_chunk or batch) / d
    attention = rows * heads * seq * seq * 4  # float32 scores of one block, one chunk
    mlp = rows * seq * 4 * width * 2 * 2  # bf16 hidden, twice (pre and post activation)
    rollout_act = attention + mlp
    micro = cfg_rows * (t.microbatch or batch) / d  # the policy's CFG pair (the uncond branch under stop_gradient, forward only)
    saved = micro * layers * seq * width * 2 * 2 if config.world.remat else micro * layers * (attention + mlp) / rows
    update_act = saved + micro * (heads * seq * seq * 4 * 2 + seq * 4 * width * 2 * 4)  # + one block's fwd+bwd
    return {"weights_and_state": weights, "stored_batch": stored, "rollout_activations": rollout_act,
            "update_activations": update_act, "peak": weights + stored + max(rollout_act, update_act)}


def native_bf16(low: dict, f32: dict) -> dict:
    """The plan's phases with XLA:CPU's bf16 temp replaced by the float32 compile's: XLA:CPU computes bf16 dots in
    float32 and keeps float32 copies of the bf16 weights as temp (26.7 GB of the gpu plan's 37.1 GB rollout temp),
    which TPUs and GPUs, computing in bf16, do not make; float32 activations bound the bf16 ones (twice their size)."""
    phases = {n: {**p, "temp": f32["phases"][n]["temp"], "peak": p["peak"] - p["temp"] + f32["phases"][n]["temp"]}
              for n, p in low["phases"].items()}
    return {**low, "phases": phases, "peak": max(p["peak"] for p in phases.values())}


def largest_prompts(low: dict, memory_gb: float, chunk: int, group: int) -> int:
    """The most prompts per iteration that fit in HEADROOM x `memory_gb` per device, the batch a whole number of
    rollout chunks. Of a phase's peak only what holds rows grows with them (the stored rollout; the decode's images),
    linearly; the temp buffers are one chunk's or microbatch's (measured: the same at 48 and 96 prompts)."""
    n = None
    for name, phase in low["phases"].items():
        if name == "eval":  # between iterations, no rows of the train batch: it does not grow with the prompts
            continue
        grows = low["stored"] + (phase["outputs"] if name == "decode" else 0)
        fixed = phase["peak"] - grows
        fits = int((HEADROOM * memory_gb * GB - fixed) // (grows / low["prompts"]))
        n = fits if n is None else min(n, fits)
    while n > 0 and (n * group) % (chunk or 1):
        n -= 1
    return max(n, 0)


def frozen_dit_traffic(target: str, prompts: int, model: str = "sd35m") -> dict:
    """The frozen base DiT replicated or FSDP'd on `target`'s plan, by hand: bytes per device either way, and the
    bytes each device all-gathers per iteration when it is FSDP'd. Every DiT call gathers the weights it lacks,
    (f - 1) / f of them on an fsdp axis of f: the rollout calls it once per step and chunk (CFG's two branches in one
    call), the update three times per microbatch (the policy's forward, its backward (remat recomputes the forward
    there, and dx needs the weights), the KL reference's forward). An upper bound: XLA may keep gathered weights
    alive across calls (the CPU compile's `all_gathered` counts each gather once, not per loop trip)."""
    config, plan = target_config(target, prompts, model=model)
    mesh = dict(config.mesh)
    fsdp = mesh["fsdp"] if mesh["fsdp"] != -1 else plan["devices"] // mesh.get("data", 1)
    pipe, init = MODELS[model].build(MODELS[model].components, param_dtype=jnp.dtype(config.world.param_dtype))
    dit_bytes = _bytes(jax.eval_shape(init, jax.random.PRNGKey(0))["dit"])
    t, s = config.train, config.sampler
    batch = prompts * t.group_size
    slots = int(np.sum(np.asarray(sampler_levels(s)) > 0))
    pairs = minibatch_pairs(t, slots)
    calls = {"rollout": (batch // (t.rollout_chunk or batch)) * s.num_steps,
             "update": 3 * t.minibatches * (pairs // (t.microbatch or pairs))}
    gathered = sum(calls.values()) * dit_bytes * (fsdp - 1) / fsdp
    return {"fsdp": fsdp, "dit_bytes": dit_bytes, "dtype": config.world.param_dtype, "per_device": {"replicate": dit_bytes,
            "fsdp": dit_bytes / fsdp}, "calls": calls, "gathered_per_iteration": {"replicate": 0.0, "fsdp": gathered},
            "memory_share": {"replicate": dit_bytes / (plan["memory_gb"] * GB), "fsdp": dit_bytes / fsdp / (plan["memory_gb"] * GB)},
            "chosen": plan.get("frozen_dit", "fsdp")}


def print_traffic(prompts: int, model: str = "sd35m") -> dict:
    out = {target: frozen_dit_traffic(target, prompts, model) for target in MODELS[model].plans}
    print(f"the frozen {MODELS[model].title} DiT per device, replicated or FSDP'd, at {prompts} prompts x 24 (hand count, GB):")
    print(f"{'target':8s} {'fsdp':>4s} {'dtype':>8s} {'replicated':>10s} {'FSDP':>6s} {'DiT calls':>9s} {'gathered/iter':>13s}  chosen")
    for target, r in out.items():
        print(f"{target:8s} {r['fsdp']:4d} {r['dtype']:>8s} {r['per_device']['replicate'] / GB:10.2f} {r['per_device']['fsdp'] / GB:6.2f} "
              f"{sum(r['calls'].values()):9d} {r['gathered_per_iteration']['fsdp'] / GB:13.0f}  {r['chosen']}")
    return out


def attention_memory(resolution: int = 1024, text_tokens: int = 77 + 256, chunk_rows: int = 16) -> dict:
    """The attention buffers of one SD3.5-M joint block at `resolution` px, per implementation (`models/attention.py`),
    bf16 compute, by hand, per row (one image) and per rollout chunk of `chunk_rows` (8 prompts' rows x 2 for CFG):
    S = (resolution / 16)^2 image + `text_tokens` text tokens, 24 heads of 64. `forward`: what one call holds at
    once (its inputs aside); `residual`: what autodiff keeps per block for the backward (every block's at once without
    remat). Cross-checks at one row, in seconds, no SD3.5: xla's forward against XLA:CPU's temp bytes for one compiled
    call, xla's and splash's residuals against jax's own (`eval_shape` of `jax.vjp`; cudnn cannot trace off a GPU).
    Prints the table; returns what `--attention` writes to attention_memory.json."""
    from flowrl_jax.models import attention
    from flowrl_jax.models.presets import PRESETS

    dit = PRESETS["sd35_medium"]
    heads, d = dit["num_attention_heads"], dit["attention_head_dim"]
    s = (resolution // 16) ** 2 + text_tokens  # latent resolution / 8, patch 2
    bf16, f32 = 2, 4
    blk = attention.splash_block(s)
    sp = -(-s // blk) * blk
    hss, hsd, hpd = heads * s * s, heads * s * d, heads * sp * d
    per_row = {
        # xla_attention: q/k/v copied heads-major, the logits and their exp (float32, [H, S, S] each; the exp's bf16
        # copy, the PV operand, fuses into the dot), the float32 PV output; the backward keeps the exp in float32 and
        # in bf16, q/k/v heads-major and the float32 output
        "xla": {"forward": {"scores_f32": hss * f32, "weights_f32": hss * f32, "qkv_heads_major_bf16": 3 * hsd * bf16,
                            "out_f32": hsd * f32},
                "residual": {"weights_f32": hss * f32, "weights_bf16": hss * bf16, "qkv_heads_major_bf16": 3 * hsd * bf16,
                             "out_f32": hsd * f32}},
        # cuDNN flash attention on [B, S, H, d] as is: the output and (training) the float32 softmax stats [H, S]; its
        # S x S tiles stay on chip; the backward's float32 dQ accumulator [H, S, d] is a cuDNN workspace (approx.)
        "cudnn": {"forward": {"out_bf16": hsd * bf16, "softmax_stats_f32": heads * s * f32},
                  "residual": {"out_bf16": hsd * bf16, "softmax_stats_f32": heads * s * f32},
                  "backward_workspace": {"dq_accumulator_f32": hsd * f32}},
        # splash: q/k/v transposed to [H, Sp, d] and padded to Sp (block `blk`), the padded output, the logsumexp
        # written 128 lanes wide [H, Sp, 128] float32 (then sliced to [H, Sp]), the q segment ids [Sp, 128] int32;
        # per kernel instance (a head, a q block) VMEM scratch m, l [blk, 128] and o [blk, d] float32 (not HBM)
        "splash": {"forward": {"qkv_padded_bf16": 3 * hpd * bf16, "out_padded_bf16": hpd * bf16,
                               "logsumexp_lanes_f32": heads * sp * 128 * f32, "segment_ids_i32": sp * 128 * 4,
                               "vmem_scratch_per_core": (2 * blk * 128 + blk * d) * f32},
                   "residual": {"qkv_padded_bf16": 3 * hpd * bf16, "out_padded_bf16": hpd * bf16,
                                "logsumexp_f32": heads * sp * f32}},
    }
    out = {"resolution": resolution, "S": s, "heads": heads, "head_dim": d, "splash_block": blk, "splash_S_padded": sp,
           "chunk_rows": chunk_rows, "implementations": {}}
    for name, parts in per_row.items():
        row = {phase: sum(v for k, v in items.items() if not k.endswith("_per_core")) for phase, items in parts.items()}
        out["implementations"][name] = {"parts_per_row": parts, "per_row": row,
                                        "per_chunk": {phase: chunk_rows * v for phase, v in row.items()}}
    spec = jax.ShapeDtypeStruct((1, s, heads, d), jnp.bfloat16)
    lowered = jax.jit(attention.xla_attention).lower(spec, spec, spec)
    # XLA:CPU hands the whole attention to one YNNPACK fusion whose scratch memory_analysis does not count (temp
    # 0.04 GB: the heads-major copies alone); with those fusions off it materializes the buffers as XLA:TPU/GPU do.
    stats = lowered.compile(compiler_options=compiler.backward_options()).memory_analysis()  # the YNNPACK-off options
    out["cross_check_1_row"] = {"xla_forward_xla_cpu_temp": stats.temp_size_in_bytes}
    for name in ("xla", "splash"):
        fn = getattr(attention, f"{name}_attention")
        res = jax.eval_shape(lambda q, k, v: jax.vjp(fn, q, k, v)[1], spec, spec, spec)
        out["cross_check_1_row"][f"{name}_residual_jax"] = int(sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(res)))
    r, c = out, out["cross_check_1_row"]
    print(f"SD3.5-M attention buffers per joint block at {r['resolution']} px: S = {r['S']}, {r['heads']} heads x "
          f"{r['head_dim']}, bf16 compute (splash: block {r['splash_block']}, S padded to {r['splash_S_padded']}); GB, by hand")
    print(f"{'impl':7s} {'forward/row':>11s} {'fwd/chunk':>10s} {'residual/row':>12s} {'res/chunk':>10s}   "
          f"(chunk = {r['chunk_rows']} rows)")
    for name, m in r["implementations"].items():
        print(f"{name:7s} {m['per_row']['forward'] / GB:11.3f} {m['per_chunk']['forward'] / GB:10.2f} "
              f"{m['per_row']['residual'] / GB:12.3f} {m['per_chunk']['residual'] / GB:10.2f}")
    print(f"cross-checks at 1 row: xla forward, XLA:CPU temp {c['xla_forward_xla_cpu_temp'] / GB:.3f}; residuals by jax.vjp: "
          f"xla {c['xla_residual_jax'] / GB:.3f}, splash {c['splash_residual_jax'] / GB:.3f}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="sd35m", choices=list(MODELS), help="the model family: its presets and plans "
                        "(sd35m: configs/sd35m_*.py, common.MEMORY_PLANS; flux1_dev: configs/flux1_dev_*.py, FLUX_MEMORY_PLANS)")
    parser.add_argument("--targets", default="", help="comma-separated; default every plan of the model")
    parser.add_argument("--check", action="store_true", help="also compile at the largest batch found (another compile per target)")
    parser.add_argument("--out", default="", help="default benchmarks/results/memory_plan.json (sd35m), "
                        "memory_plan_<model>.json (others)")
    parser.add_argument("--traffic", action="store_true", help="only the frozen DiT's replicate-or-FSDP table (no compiling)")
    parser.add_argument("--attention", action="store_true", help="only the attention buffers per block at 1024 px, per "
                        "implementation (by hand, xla cross-checked by one compile; seconds)")
    parser.add_argument("--method", default="grpo", choices=METHODS, help="leapalign: the gradient methods' plan (PickScore on "
                        "the VAE decode, rows '<target>+leapalign'; FLUX: configs/flux1_dev_leapalign.py)")
    args = parser.parse_args()
    family = MODELS[args.model]
    out = args.out or ("benchmarks/results/memory_plan.json" if args.model == "sd35m" else f"benchmarks/results/memory_plan_{args.model}.json")
    if args.attention:
        result = attention_memory()
        with open(os.path.join(os.path.dirname(out) or ".", "attention_memory.json"), "w") as f:
            json.dump(result, f, indent=2)
        return
    targets = args.targets.split(",") if args.targets else list(family.plans)
    base = family.config(targets[0], args.method).train
    if args.traffic:
        traffic = print_traffic(base.prompts_per_iteration, args.model)
        name = "frozen_dit_traffic.json" if args.model == "sd35m" else f"frozen_dit_traffic_{args.model}.json"
        with open(os.path.join(os.path.dirname(out) or ".", name), "w") as f:
            json.dump(traffic, f, indent=2)
        return
    results = {}
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    if os.path.isfile(out):  # targets measured before are kept (each takes minutes of compiling on 2 cores)
        with open(out) as f:
            results = json.load(f)
    group = base.group_size
    for target in targets:
        plan = family.plans[target]
        t0 = time.time()
        kw = dict(method=args.method, model=args.model)
        low = compile_phases(target, base.prompts_per_iteration, **kw)
        native = native_bf16(low, compile_phases(target, base.prompts_per_iteration, float32=True, **kw))
        memories = (plan["memory_gb"],) + tuple(plan.get("also_gb", ()))
        largest = {str(gb): largest_prompts(native, gb, plan["rollout_chunk"], group) for gb in memories}
        largest_cpu = {str(gb): largest_prompts(low, gb, plan["rollout_chunk"], group) for gb in memories}
        check = compile_phases(target, largest[str(plan["memory_gb"])], **kw) if args.check and largest[str(plan["memory_gb"])] else None
        results[target if args.method == "grpo" else f"{target}+{args.method}"] = {
            "plan": plan, "method": args.method, "model": args.model, "low": low, "native_bf16": native,
            "bytes_per_prompt": low["stored"] / low["prompts"], "hand": hand_estimate(target, base.prompts_per_iteration, low, **kw),
            "largest_prompts": largest, "largest_prompts_xla_cpu": largest_cpu, "at_largest": check, "compile_s": time.time() - t0}
        with open(out, "w") as f:
            json.dump(results, f, indent=2)
    print(f"per-device GB, {family.title} at {base.prompts_per_iteration} prompts x {group}: XLA:CPU's compiled peak, "
          "the bf16 bound (float32 temp in place of XLA:CPU's bf16 temp), the hand estimate; largest prompts by the bound")
    print(f"{'target':8s} {'dev':>3s} {'weights+state':>13s} {'stored':>7s} {'rollout':>8s} {'decode':>7s} {'update':>7s} {'eval':>6s} "
          f"{'XLA:CPU':>8s} {'bound':>6s} {'hand':>5s} {'memory':>7s} {'GB/prompt':>9s}  largest prompts x {group}")
    for target, r in results.items():
        low, ph = r["low"], r["native_bf16"]["phases"]
        fits = ", ".join(f"{n} ({gb} GB)" for gb, n in r["largest_prompts"].items())
        print(f"{target:8s} {r['plan']['devices']:3d} {low['live'] / GB:13.1f} {low['stored'] / GB:7.2f} {ph['rollout']['peak'] / GB:8.1f} "
              f"{ph['decode']['peak'] / GB:7.1f} {ph['update']['peak'] / GB:7.1f} {ph.get('eval', {}).get('peak', float('nan')) / GB:6.1f} {low['peak'] / GB:8.1f} {r['native_bf16']['peak'] / GB:6.1f} "
              f"{r['hand']['peak'] / GB:5.1f} {r['plan']['memory_gb']:7d} {r['bytes_per_prompt'] / GB:9.3f}  {fits}")
    with open(out, "w") as f:
        json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
