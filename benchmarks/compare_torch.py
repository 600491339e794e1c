"""flowrl_jax against the PyTorch/diffusers Flow-GRPO stack on the same work, in one process (issue 7).

    python benchmarks/compare_torch.py [--setups quickstart,medium] [--repeats 3] [--no-compile]
    python benchmarks/compare_torch.py --device cuda --bf16     # a GPU: ours in bf16, torch with bf16 autocast

Each setup builds both sides from the same weights: flowrl_jax's `rl/programs.py` programs (the jitted rollout,
credit and update that `python -m flowrl_jax.main` runs) and `torch_reference.TorchFlowGRPO` on diffusers'
`SD3Transformer2DModel`, eager and `torch.compile`d. Then it alternates one whole Flow-GRPO iteration per
side (A/B/C, A/B/C, ...) `--repeats` times after a warm-up; the warm-up minus the median is the compile time.
An iteration is: rollout (B images, T steps, CFG in one doubled batch, the SDE window) -> the exact
evaluator's reward on the host -> group advantages -> one optimizer step per minibatch of (sample, step)
pairs. Both sides get the same prompts, the same reward function and the same minibatch order, and both keep
every sample (the train loop drops samples without advantage; their number differs between the two sides'
rollouts, so the timed work would too); torch gets `torch.set_num_threads(os.cpu_count())` and takes the text
condition from our (frozen) text encoder.

- `quickstart`: `configs/quickstart.py` as it is: the shipped `shapes32` DiT (64 tokens, width 128, depth 6),
  LoRA rank 32, 8 prompts x 12 images, 10 steps, SDE on steps 0-1, CFG 3, 2 minibatches of 96 pairs.
- `medium`: the `medium` preset (256 tokens, width 512, depth 12, random weights), same recipe at 2 x 4
  images and 6 steps.

FLOPs are the hand count of `flowrl_jax/models/flops.py` (dense, attention, unmerged LoRA), per call:
rollout = T x forward(2B rows); an update on M pairs = `flops.lora_update_flops` (the policy's forward(2M) + its
backward, input gradients only, + the KL reference's forward(2M) without adapters: `3 dense + 4 attention + 3 lora`
of a 2M-row forward). Both sides are charged this count (the algorithm as PEFT runs it); flowrl_jax merges the adapters into the kernels at these widths
(`mmdit.merge_lora_in_forward`) and so does more arithmetic than counted. The machine's limit is a float32
`jnp.dot` of two 2048 x 2048 matrices (and torch's `@`), timed in the same run.
`--device cuda` puts the torch side on the GPU (`torch.set_default_device`; jax uses its default backend) and
`--bf16` runs both DiTs in bfloat16: ours with `dtype=bfloat16` (float32 params, norms and log-probs), torch under
`torch.autocast(bfloat16)`; the peak is then a bf16 matmul. Writes benchmarks/results/compare_torch.json (`--out`).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch
from ml_collections import ConfigDict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import torch_reference as tr  # noqa: E402
from configs import common  # noqa: E402
from flowrl_jax import parallel, rewards, worlds  # noqa: E402
from flowrl_jax.models import flops  # noqa: E402
from flowrl_jax.objectives.batch import IterationData  # noqa: E402
from flowrl_jax.rl import plan as plan_lib, programs as programs_lib  # noqa: E402
from flowrl_jax.rl.minibatch import minibatches  # noqa: E402
from flowrl_jax.rl.state import TrainState  # noqa: E402
from flowrl_jax.sampling import schedule  # noqa: E402
from flowrl_jax.sampling.windows import sampler_levels  # noqa: E402
from flowrl_jax.worlds.shapes import ShapesWorld, assets, pipeline  # noqa: E402

SETUPS = {
    "quickstart": dict(base="shapes32", fields={}),
    "medium": dict(preset="medium", fields={"train.prompts_per_iteration": 2, "train.group_size": 4, "sampler.num_steps": 6}),
}


@dataclasses.dataclass
class Pair:
    """Both sides of one setup, built from the same weights; `torch_sides` by name ("eager", "compile"). `state` is ours,
    replaced by each update's result (the update donates the one it is given)."""
    config: ConfigDict
    mesh: jax.sharding.Mesh
    pipe: object
    world: ShapesWorld
    plan: plan_lib.Plan
    programs: programs_lib.Programs
    frozen: dict
    state: TrainState
    torch_sides: dict

    @property
    def levels(self) -> np.ndarray:
        return sampler_levels(self.config.sampler)

    @property
    def batch(self) -> int:
        return self.config.train.prompts_per_iteration * self.config.train.group_size


def random_base(preset: str, seed: int = 0, scale: float = 0.05):
    """(pipe, {"dit", "text"}) of a random model: the init plus `scale` noise on every DiT weight (the
    init zeroes the adaLN and output layers, which would make the velocity 0)."""
    cfg = ConfigDict({"model": common.model_config(preset), "text": dict(max_len=10, width=128, depth=1, heads=4)})
    pipe = pipeline.build_pipeline(cfg)
    params = pipeline.init_params(pipe, jax.random.PRNGKey(seed))
    leaves, treedef = jax.tree_util.tree_flatten(params["dit"])
    keys = jax.random.split(jax.random.PRNGKey(seed + 1), len(leaves))
    params["dit"] = treedef.unflatten([p + scale * jax.random.normal(k, p.shape) for p, k in zip(leaves, keys)])
    return pipe, params


def build_pair(config, pipe, base: dict, compile_modes=("eager",), lora_b_scale: float = 0.0, seed: int = 0,
               autocast: bool = False) -> Pair:
    """Our programs for `config` on `base`, and a `TorchFlowGRPO` per compile mode with the same DiT weights and
    LoRA adapters (`lora_b_scale > 0` draws the adapters' `b`, zero at init, so the policy differs from the reference)."""
    plan = plan_lib.make_plan(config)
    world = ShapesWorld(config.world, config.eval, worlds.run_facts(config, plan.mesh), loaded=(pipe, base))
    plan = dataclasses.replace(plan, world=world)
    programs, frozen, state = programs_lib.build(plan, *world.load())
    if lora_b_scale:
        flat = jax.tree_util.tree_leaves_with_path(state.params)
        keys = iter(jax.random.split(jax.random.PRNGKey(seed + 7), len(flat)))
        params = jax.tree_util.tree_map_with_path(
            lambda path, x: x + lora_b_scale * jax.random.normal(next(keys), x.shape) if path[-1].key == "b" else x, state.params)
        params = jax.device_put(params, programs.state_shardings.params)
        ema = jax.tree_util.tree_map(lambda x: x.copy(), params)  # its own buffers: the update donates both
        state = state.replace(params=params, ema=ema)
    adapters = jax.device_get(state.params)
    t, o = config.train, config.objective.grpo
    sides = {mode: tr.TorchFlowGRPO(tr.diffusers_model(pipe.dit, jax.device_get(base["dit"])), adapters, pipe.dit.lora_alpha,
                                    config.sampler.cfg, o.clip_range, o.beta, t.lr, t.weight_decay, t.grad_clip, t.ema_decay,
                                    compile=mode == "compile", kl_form=o.kl_form, detach_uncond=o.detach_uncond, ema_every=t.ema_every,
                                    autocast=autocast)
             for mode in compile_modes}
    return Pair(config, plan.mesh, pipe, world, plan, programs, frozen, state, sides)


def iteration_prompts(pair: Pair, it: int) -> list[dict]:
    t = pair.config.train
    chosen = pair.world.sample_prompts(t.prompts_per_iteration, np.random.default_rng([pair.config.seed, it]))
    return [pair.world.train_prompts[i] for i in chosen for _ in range(t.group_size)]


def jax_rollout(pair: Pair, prompts: list[dict], it: int):
    ids, mask = parallel.shard_batch(pair.pipe.tokenize([p["prompt"] for p in prompts]), pair.mesh)
    return pair.programs.rollout(pair.state.params, pair.frozen, ids, mask, jax.random.PRNGKey(it), pair.levels)


def jax_updates(pair: Pair, ro, cond, null, reward: np.ndarray, it: int):
    """Group advantages and one update per minibatch (the train loop's order, every sample kept)
    -> (adv [B, T, 1], [stats per update])."""
    t = pair.config.train
    gids = np.repeat(np.arange(t.prompts_per_iteration, dtype=np.int32), t.group_size)
    sched = programs_lib.schedule_of(pair.config.sampler, pair.levels)
    adv, _, _ = pair.programs.credit(ro, sched, parallel.shard_batch(reward.astype(np.float32), pair.mesh),
                                     parallel.shard_batch(gids, pair.mesh), t.prompts_per_iteration, pair.state.credit, {},
                                     jax.random.PRNGKey(0))
    stats, data = [], IterationData(ro, sched, adv, cond, null, jax.random.PRNGKey(1))
    for rows, slots, weight in minibatch_order(pair, it):
        pair.state, s = pair.programs.update(pair.state, pair.frozen, data, rows, slots, weight)
        stats.append(s)
    return adv, stats


def minibatch_order(pair: Pair, it: int):
    keep = np.ones(pair.batch, bool)
    return minibatches(keep, pair.plan.slots_at(pair.levels), pair.plan.minibatch_size, np.random.default_rng([pair.config.seed, it, 0]))


def torch_condition(cond, null):
    return [tr.to_torch(jax.device_get(c)) for c in cond], [tr.to_torch(jax.device_get(u)) for u in null]


def torch_schedule(config):
    s = config.sampler
    return tr.to_torch(schedule.sigmas(s.num_steps, s.shift)), tr.to_torch(sampler_levels(s))


def torch_updates(pair: Pair, side, ro: dict, cond, null, reward: np.ndarray, it: int):
    """The same as `jax_updates` on the torch side (same advantages formula and minibatch order)."""
    adv = tr.group_advantages(tr.to_torch(reward), pair.config.train.group_size,
                              pair.config.advantage.global_std, pair.config.advantage.clip,
                              pair.config.advantage.std_eps, pair.config.advantage.std_ddof)
    stats = [side.update(ro, adv, cond, null, tr.to_torch(rows, np.int64), tr.to_torch(slots, np.int64), tr.to_torch(weight))
             for rows, slots, weight in minibatch_order(pair, it)]
    return adv, stats


# ---------------------------------------------------------------------------------------------- timing
def time_jax_iteration(pair: Pair, reward_fn, it: int) -> dict:
    prompts = iteration_prompts(pair, it)
    t0 = time.perf_counter()
    ro, cond, null = jax.block_until_ready(jax_rollout(pair, prompts, it))
    t1 = time.perf_counter()
    reward, _ = reward_fn(parallel.local_rows(ro.final), prompts)
    _, stats = jax_updates(pair, ro, cond, null, reward, it)
    jax.block_until_ready(pair.state)
    t2 = time.perf_counter()
    return {"rollout_s": t1 - t0, "update_s": t2 - t1, "iteration_s": t2 - t0, "updates": len(stats)}


def time_torch_iteration(pair: Pair, side, reward_fn, it: int) -> dict:
    prompts = iteration_prompts(pair, it)
    s, t = pair.config.sampler, pair.config.train
    ids, mask = parallel.shard_batch(pair.pipe.tokenize([p["prompt"] for p in prompts]), pair.mesh)
    cond, null = torch_condition(pair.pipe.encode(pair.frozen["text"], ids, mask),
                                 pair.pipe.null_condition(pair.frozen["text"], pair.batch))
    sigmas, levels = torch_schedule(pair.config)
    shape = (pair.batch, pair.pipe.dit.in_channels, pair.pipe.dit.sample_size, pair.pipe.dit.sample_size)
    gen = torch.Generator(torch.get_default_device()).manual_seed(it)
    t0 = time.perf_counter()
    x_T = torch.randn((pair.batch // t.group_size,) + shape[1:], generator=gen).repeat_interleave(t.group_size, 0)
    ro = side.rollout(x_T, torch.randn((s.num_steps,) + shape, generator=gen), cond, null, sigmas, levels)
    t1 = time.perf_counter()
    images = ro["next_states"][:, -1].movedim(1, -1).cpu().numpy()
    reward, _ = reward_fn(images, prompts)
    _, stats = torch_updates(pair, side, ro, cond, null, reward, it)
    synchronize()
    t2 = time.perf_counter()
    return {"rollout_s": t1 - t0, "update_s": t2 - t1, "iteration_s": t2 - t0, "updates": len(stats)}


def synchronize() -> None:
    """Wait for torch's queued GPU work (a no-op on the CPU)."""
    if torch.get_default_device().type == "cuda":
        torch.cuda.synchronize()


def matmul_peak(n: int = 2048, repeats: int = 10, bf16: bool = False) -> dict:
    dtype = jnp.bfloat16 if bf16 else jnp.float32
    a, b = (jax.random.normal(jax.random.PRNGKey(i), (n, n), dtype) for i in (0, 1))
    dot = jax.jit(jnp.dot)
    ta, tb = (torch.randn(n, n, dtype=torch.bfloat16 if bf16 else torch.float32) for _ in range(2))
    out = {}
    for name, fn in (("jax", lambda: dot(a, b).block_until_ready()), ("torch", lambda: (ta @ tb, synchronize()))):
        fn()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        out[f"{name}_gflop_s"] = 2 * n**3 / statistics.median(times) / 1e9
    return out


def hand_flops(pair: Pair) -> dict:
    """(rollout, one update) FLOPs (module doc)."""
    dit, s = pair.pipe.dit, pair.config.sampler
    params, adapters = pair.frozen["dit"], pair.state.params if pair.config.train.lora_rank else None
    text_len = pair.pipe.text.max_len
    size = dit.sample_size
    roll = flops.forward_flops(dit, params, 2 * pair.batch, size, size, text_len, adapters)
    kl = pair.config.objective.grpo.beta > 0
    return {"rollout": s.num_steps * roll,
            "update": flops.lora_update_flops(dit, params, pair.plan.minibatch_size, size, size, text_len, adapters, kl)}


def setup_pair(name: str, compile_modes=("eager",), bf16: bool = False, overrides: dict | None = None) -> tuple[Pair, object]:
    """(the `Pair` of setup `name` with config `overrides` ({"world.scan_blocks": "always"}), its reward function)."""
    spec = SETUPS[name]
    config = common.embedded_train_config()
    config.update_from_flattened_dict({**spec["fields"], **(overrides or {})})
    pipe, base = assets.load_pipeline(spec["base"])[:2] if "base" in spec else random_base(spec["preset"])
    if bf16:
        pipe = dataclasses.replace(pipe, dit=pipe.dit.clone(dtype=jnp.bfloat16))
    return build_pair(config, pipe, base, compile_modes, autocast=bf16), rewards.build(config.train.rewards)


def run_setup(name: str, repeats: int, compile_torch: bool, bf16: bool = False) -> dict:
    modes = ("eager", "compile") if compile_torch else ("eager",)
    pair, reward_fn = setup_pair(name, modes, bf16)
    config = pair.config
    runs = {"flowrl_jax": lambda it: time_jax_iteration(pair, reward_fn, it),
            **{f"torch_{m}": (lambda it, side=pair.torch_sides[m]: time_torch_iteration(pair, side, reward_fn, it)) for m in modes}}
    times = {k: [] for k in runs}
    for r in range(repeats + 1):  # round 0 is the warm-up (compiles)
        for k, fn in runs.items():
            times[k].append(fn(r))
            print(f"  {name} round {r} {k}: {times[k][-1]['iteration_s']:.2f} s", flush=True)
    fl = hand_flops(pair)
    result = {"setup": name, "batch": pair.batch, "num_steps": config.sampler.num_steps, "trained_steps": len(pair.plan.slots_at(pair.levels)),
              "minibatch_pairs": pair.plan.minibatch_size, "updates": times["flowrl_jax"][0]["updates"],
              "params": int(sum(x.size for x in jax.tree_util.tree_leaves(pair.frozen["dit"]))), "flops": fl, "sides": {}}
    for k, rows in times.items():
        med = {f: statistics.median(row[f] for row in rows[1:]) for f in ("rollout_s", "update_s", "iteration_s")}
        per_update = med["update_s"] / rows[1]["updates"]
        result["sides"][k] = {**med, "compile_s": rows[0]["iteration_s"] - med["iteration_s"],
                              "rollout_images_per_s": pair.batch / med["rollout_s"],
                              "update_pairs_per_s": pair.plan.minibatch_size / per_update,
                              "rollout_gflop_s": fl["rollout"] / med["rollout_s"] / 1e9,
                              "update_gflop_s": fl["update"] / per_update / 1e9, "all": rows}
    return result


def table(results: list[dict], peak: dict) -> str:
    lines = [f"matmul peak (2048^2 dot in the run's dtype): jax {peak['jax_gflop_s']:.0f} GFLOP/s, torch {peak['torch_gflop_s']:.0f} GFLOP/s",
             f"{'setup':10s} {'side':14s} {'rollout img/s':>13s} {'update pairs/s':>14s} {'iteration s':>11s} {'compile s':>9s} "
             f"{'rollout GF/s':>12s} {'update GF/s':>11s} {'upd % peak':>10s} {'speedup (iter)':>14s}"]
    for res in results:
        jx = res["sides"]["flowrl_jax"]
        for k, s in res["sides"].items():
            speed = "" if k == "flowrl_jax" else f"{s['iteration_s'] / jx['iteration_s']:.2f}x"
            lines.append(f"{res['setup']:10s} {k:14s} {s['rollout_images_per_s']:13.2f} {s['update_pairs_per_s']:14.2f} "
                         f"{s['iteration_s']:11.2f} {s['compile_s']:9.1f} {s['rollout_gflop_s']:12.1f} {s['update_gflop_s']:11.1f} "
                         f"{100 * s['update_gflop_s'] / peak['jax_gflop_s' if k == 'flowrl_jax' else 'torch_gflop_s']:9.0f}% {speed:>14s}")
    lines.append("speedup (iter) = torch iteration time / flowrl_jax iteration time (> 1: flowrl_jax is faster)")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setups", default="quickstart,medium")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile side")
    parser.add_argument("--device", default="cpu", help="torch's device: cpu or cuda")
    parser.add_argument("--bf16", action="store_true", help="both DiTs in bfloat16 (ours: dtype; torch: autocast)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "compare_torch.json"))
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count())
    torch.set_default_device(args.device)
    peak = matmul_peak(bf16=args.bf16)
    results = [run_setup(name, args.repeats, not args.no_compile, args.bf16) for name in args.setups.split(",")]
    print(table(results, peak))
    from machine import describe  # benchmarks/machine.py (this script's folder)
    env = describe(jax=jax.__version__, torch=torch.__version__, backend=jax.default_backend(), devices=jax.device_count(),
                   xla_flags=os.environ.get("XLA_FLAGS", ""),
               torch_device=args.device, bf16=args.bf16)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"env": env, "matmul_peak": peak, "results": results}, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
