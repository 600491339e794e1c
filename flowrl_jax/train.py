"""The `train` job: RL fine-tuning of the base DiT (Flow-GRPO and the methods that plug into it).

    python -m flowrl_jax.main --config configs/flow_grpo.py --workdir workdirs/flow_grpo

One iteration (DESIGN.md): sample prompts (each `G` times) -> `rollout` (jit, batch sharded on the
mesh) -> host rewards on this process's rows, gathered into a global array -> `credit` (jit):
advantages `A[b, t, k]` -> `num_inner_epochs` passes over the kept (sample, trained step) pairs in a
shuffled order, one optimizer step per minibatch (jit, `objectives/`) -> EMA. The text encoder is
frozen; the policy is the whole DiT or LoRA adapters (`train.lora_rank > 0`), the reference of the
KL is the base DiT. Everything random derives from `config.seed` and the iteration
(`jax.random.fold_in`), so a resumed run equals an uninterrupted one.

The workdir gets `checkpoints/` (orbax, keep-N, resumed automatically), `metrics.jsonl` + TensorBoard
events, `eval_<step>.png` sample grids, `eval.json` and, at the end, `report.png` (reward and eval
score against step and wall-clock). SIGTERM/SIGINT save a checkpoint before exiting; a non-finite
reward or loss stops the run naming the step and the quantity, keeping the last good checkpoint.
"""
from __future__ import annotations

import functools
import json
import os
import signal
import time
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from ml_collections import ConfigDict
from tqdm import tqdm

from flowrl_jax import assets, compiler, credit as credit_lib, evaluate, metrics, parallel, rewards as rewards_lib
from flowrl_jax.checkpoint import Checkpointer
from flowrl_jax.config_lib import ConfigError
from flowrl_jax.credit import spatial
from flowrl_jax.credit.context import Context
from flowrl_jax.data import curriculum, shapes
from flowrl_jax.models import lora
from flowrl_jax.objectives import OBJECTIVES, advantage_flow, forward, grpo, leap
from flowrl_jax.sampling import kernels, rollout as rollout_lib, schedule


# ----------------------------------------------------------------------------------------------- policy
class Policy:
    """The trainable DiT: `dit_variables(trainable, frozen)` for `dit.apply`, with LoRA or without."""

    def __init__(self, pipe, lora_rank: int):
        self.pipe, self.lora_rank = pipe, lora_rank

    def init(self, frozen_dit, rng):
        return lora.init_adapters(frozen_dit, rng, rank=self.lora_rank) if self.lora_rank else frozen_dit

    def variables(self, trainable, frozen_dit) -> dict:
        return {"params": frozen_dit, "lora": trainable} if self.lora_rank else {"params": trainable}

    def sampling_variables(self, trainable, frozen_dit) -> dict:
        """`dit.apply` variables for sampling without gradients: adapters merged once, not applied per step."""
        return {"params": self.merged(trainable, frozen_dit)}

    def merged(self, trainable, frozen_dit):
        """Plain DiT params (adapters folded in): what eval and export use."""
        return lora.merge(frozen_dit, trainable, self.pipe.dit.lora_alpha) if self.lora_rank else trainable

    def velocity_fn(self, dit_variables):
        return lambda x, sigma, cond: self.pipe.dit.apply(dit_variables, x, sigma, *cond)


def kernel_mean_fn(policy: Policy, sampler_cfg):
    """`mean_fn(variables, mb) -> (mean, std, v)`: the rollout's kernel (with CFG) at the minibatch's states."""

    def mean_fn(variables, mb):
        velocity = rollout_lib.guided(policy.velocity_fn(variables), mb["cond"], mb["null"], sampler_cfg.cfg)
        return kernels.transition(sampler_cfg.kind, velocity, mb["x"], mb["sigma"], mb["sigma_next"], mb["level"], mb["sigma_1"])

    return mean_fn


class PolicyFns(NamedTuple):
    """What an objective may call (`objectives/__init__.py`)."""
    mean: Callable      # (variables, mb) -> (mean, std, v): the rollout's kernel at mb["x"] (kernel_mean_fn, the rollout's CFG)
    velocity: Callable  # (variables, x [M, H, W, C], sigma [M], mb) -> v with mb's condition, at CFG `velocity_cfg`
    reward: Callable    # (images [M, H, W, C], mb) -> [M]: the learned reward (params and tokens in mb)


def policy_fns(policy: Policy, sampler_cfg, reward_apply: Callable | None = None, velocity_cfg: float | None = None) -> PolicyFns:
    """`velocity_cfg`: the CFG scale of `velocity` (None: the sampler's; 1: the conditional velocity alone)."""
    cfg = sampler_cfg.cfg if velocity_cfg is None else velocity_cfg

    def velocity(variables, x, sigma, mb):
        return rollout_lib.guided(policy.velocity_fn(variables), mb["cond"], mb["null"], cfg)(x, sigma)

    def reward(images, mb):
        return reward_apply(mb["reward_params"], images, mb["reward_ids"], mb["reward_mask"])

    return PolicyFns(kernel_mean_fn(policy, sampler_cfg), velocity, reward)


# -------------------------------------------------------------------------------------------- the steps
def sampler_levels(sampler_cfg):
    """[T] noise level per step from `config.sampler` (its SDE window; `()` = every step)."""
    window = tuple(sampler_cfg.sde_window) if sampler_cfg.sde_window else None
    levels = rollout_lib.noise_levels(sampler_cfg.num_steps, sampler_cfg.noise_level, window)
    return levels * 0.0 if sampler_cfg.kind == "ode" else levels


def training_slots(config) -> np.ndarray:
    """The per-sample slots an objective trains on: the SDE window's steps (reverse process), the
    forward-process time slots (`objective.timesteps`), or one leap per sample (LeapAlign)."""
    process = OBJECTIVES[config.objective.name].process
    if process == "forward":
        return np.arange(config.objective.timesteps)
    if process == "leap":
        return np.zeros(1, np.int64)
    return np.flatnonzero(np.asarray(sampler_levels(config.sampler)))


def make_rollout_fn(policy: Policy, config):
    """jit-able `(trainable, frozen, ids, mask, rng) -> (Rollout, cond, null)`."""
    s, t = config.sampler, config.train
    sigmas = schedule.sigmas(s.num_steps, s.shift)
    levels = sampler_levels(s)

    def rollout_fn(trainable, frozen, ids, mask, rng):
        cond = policy.pipe.encode(frozen["text"], ids, mask)
        null = policy.pipe.null_condition(frozen["text"], ids.shape[0])
        velocity = rollout_lib.guided(policy.velocity_fn(policy.sampling_variables(trainable, frozen["dit"])), cond, null, s.cfg)
        k_noise, k_steps = jax.random.split(rng)
        x_T = rollout_lib.initial_noise(k_noise, policy.pipe.image_shape(ids.shape[0]), t.group_size, s.same_noise_per_group)
        ro = rollout_lib.rollout(velocity, x_T, sigmas, levels, k_steps, s.kind, policy.pipe.dit.patch_size, s.logprob_form)
        return ro, cond, null

    return rollout_fn


def make_update_fn(policy: Policy, optimizer, config, reward_apply: Callable | None = None):
    """jit-able `(state, frozen, ro, adv, cond, null, rows, slots, weight, extras) -> (state, stats)`: one
    optimizer step of the configured objective on the pairs `(rows[m], slots[m])` (`training_slots`).
    The forward-process noise and LeapAlign's steps come from `config.seed` and the update counter."""
    o, s = config.objective, config.sampler
    objective = OBJECTIVES[o.name]
    options = ConfigDict({**o.to_dict(), "patch_size": policy.pipe.dit.patch_size, "logprob_form": s.logprob_form,
                          "num_steps": s.num_steps, "kernel": s.kind})
    fns = policy_fns(policy, s, reward_apply, o.train_cfg if o.train_cfg > 0 else None)
    times = forward.training_times(o.timesteps, s.shift)
    ema_decay = config.train.ema_decay

    def update(state, frozen, ro, adv, cond, null, rows, slots, weight, extras):
        key = jax.random.fold_in(jax.random.PRNGKey(config.seed + 2), state["updates"])
        if objective.process == "reverse":
            mb, fn = grpo.gather_pairs(ro, adv, cond, null, rows, slots, weight), fns.mean
        elif objective.process == "forward":
            mb, fn = forward.forward_pairs(ro, adv, cond, null, rows, slots, weight, key, times), fns
        else:
            mb, fn = {**leap.leap_pairs(ro, cond, null, rows, weight, key, extras), "reward_params": frozen["reward"]}, fns
        if objective.old_policy is not None:
            mb["old_variables"] = policy.variables(state["old"], frozen["dit"])
        ref = {"params": frozen["dit"]}

        def loss(trainable):
            return objective.loss(policy.variables(trainable, frozen["dit"]), ref, mb, fn, options)

        (value, aux), grads = jax.value_and_grad(loss, has_aux=True)(state["params"])
        updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        n = state["updates"] + 1
        decay = jnp.minimum(ema_decay, (1.0 + n) / (10.0 + n))
        ema = jax.tree_util.tree_map(lambda e, p: decay * e + (1 - decay) * p, state["ema"], params)
        stats = {"loss": value, **aux, "grad_norm": optax.tree.norm(grads), "update_norm": optax.tree.norm(updates),
                 "param_norm": optax.tree.norm(params)}
        return {**state, "params": params, "opt_state": opt_state, "ema": ema, "updates": n}, stats

    return update


def update_old_policy(state, decay: Callable):
    """The old policy after an iteration: `old <- d old + (1 - d) params`, `d = decay(step)` (objectives/__init__.py)."""
    d = decay(state["step"].astype(jnp.float32))
    return {**state, "old": jax.tree_util.tree_map(lambda o, p: d * o + (1 - d) * p, state["old"], state["params"])}


def make_completion_fn(policy: Policy, config):
    """jit-able `(trainable, frozen, cond, null, states [B, m, H, W, C], steps) -> [B, m, H, W, C]`: the
    ODE sampler (CFG) from each state, the state before step `steps[j]`, to sigma = 0; all `B m`
    completions in one scan over the steps (a row waits, unchanged, until its own step). `steps` is static."""
    s = config.sampler
    sigmas = schedule.sigmas(s.num_steps, s.shift)

    def complete(trainable, frozen, cond, null, states, steps):
        b, m = states.shape[:2]
        x = states.reshape((b * m,) + states.shape[2:])
        start = jnp.tile(jnp.asarray(steps, jnp.int32), b)
        repeat = lambda tree: jax.tree_util.tree_map(lambda a: jnp.repeat(a, m, axis=0), tree)  # noqa: E731
        velocity = rollout_lib.guided(policy.velocity_fn(policy.sampling_variables(trainable, frozen["dit"])), repeat(cond), repeat(null), s.cfg)

        def step(x, i):
            mean, _, _ = kernels.transition("ode", velocity, x, sigmas[i], sigmas[i + 1], 0.0, sigmas[1])
            return jnp.where(kernels.column(i >= start, x), mean, x), None

        x, _ = jax.lax.scan(step, x, jnp.arange(min(steps), s.num_steps))
        return x.reshape(states.shape)

    return complete


def make_credit_fn(credit, reverse: bool = True):
    """`(ro, rewards, group_ids, num_groups, credit_state, extras) -> (A, credit_state, keep [B])`; the
    reverse-process objectives drop samples with no advantage on a trained step (SPEC §2), the others
    keep all (their advantage-free samples still carry the regularizing term)."""
    def credit_fn(ro, rewards, group_ids, num_groups, credit_state, extras):
        inputs = {"rollout": ro, "rewards": rewards, "group_ids": group_ids, "num_groups": num_groups, **extras}
        adv, credit_state = credit.apply(inputs, credit_state)
        keep = credit_lib.kept_samples(adv, ro.trained) if reverse else jnp.ones(rewards.shape, bool)
        return adv, credit_state, keep

    return credit_fn


def minibatches(keep: np.ndarray, trained_steps: np.ndarray, size: int, rng: np.random.Generator):
    """Shuffled (rows, steps, weight) chunks of `size` over the kept samples x trained steps; the last
    chunk is padded with weight-0 pairs so every update has one compiled shape."""
    rows, steps = np.meshgrid(np.flatnonzero(keep), trained_steps, indexing="ij")
    pairs = np.stack([rows.ravel(), steps.ravel()], 1)[rng.permutation(rows.size)]
    for start in range(0, len(pairs), size):
        chunk = pairs[start : start + size]
        weight = np.ones(size, np.float32)
        if len(chunk) < size:
            weight[len(chunk):] = 0.0
            chunk = np.concatenate([chunk, np.repeat(chunk[:1], size - len(chunk), 0)])
        yield chunk[:, 0].astype(np.int32), chunk[:, 1].astype(np.int32), weight


# ---------------------------------------------------------------------------------------------- inputs
def load_base(name: str):
    """(pipe, {"dit", "text"}) of the base model; a missing or corrupt checkpoint is a ConfigError."""
    try:
        pipe, params, info = assets.load_pipeline(name, use_ema=True)
    except (FileNotFoundError, assets.AssetError, ValueError, OSError, KeyError) as e:
        raise ConfigError(f"cannot load the base model {name!r} (config.base): {str(e).splitlines()[0]}") from None
    return pipe, params, info


def load_prompt_set(path: str, split: str) -> list[dict]:
    try:
        return shapes.load_prompt_file(path) if path else shapes.load_prompts(split)
    except (ValueError, FileNotFoundError) as e:
        raise ConfigError(str(e)) from None


def sample_prompts(prompts: list[dict], n: int, rng: np.random.Generator) -> list[dict]:
    """`n` prompts, the category drawn uniformly first (the train set is unbalanced across categories)."""
    by_category = {}
    for p in prompts:
        by_category.setdefault(p["category"], []).append(p)
    names = sorted(by_category)
    return [by_category[c][rng.integers(len(by_category[c]))] for c in (names[i] for i in rng.integers(len(names), size=n))]


class StopSignal:
    """SIGTERM/SIGINT set `requested` (the loop saves and exits at the end of the iteration)."""

    def __init__(self):
        self.requested = None
        self.previous = {}

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            self.previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        self.requested = signal.Signals(signum).name

    def __exit__(self, *exc):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def _finite_or_stop(values: dict, step: int, what: str, ckpt: Checkpointer) -> None:
    for name, v in values.items():
        if not np.all(np.isfinite(v)):
            raise FloatingPointError(f"{what} {name} is not finite at step {step}; stopped, the last good checkpoint "
                                     f"(step {ckpt.latest_step()}) in {ckpt.directory} is kept")


class Steps:
    """The jit-compiled pieces of one iteration on `mesh`, and the initial TrainState:
    `rollout(params, frozen, ids, mask, rng)`, `credit(ro, rewards, group_ids, num_groups, credit_state)`,
    `update(state, frozen, ro, adv, cond, null, rows, slots, weight, extras)`. `frozen = {"dit", "text"}` are the
    base weights (the KL reference and the frozen text encoder) and, for LeapAlign, `"reward"` (the learned
    reward's params), all sharded by the partition rules. `objective_extras(prompts)` are the
    objective's host-side inputs per iteration (LeapAlign: the learned reward's tokens), batch-sharded."""

    def __init__(self, config, mesh, pipe, base: dict, credit, num_prompts: int = 0):
        t_cfg, s_cfg = config.train, config.sampler
        self.mesh = mesh
        self.policy = policy = Policy(pipe, t_cfg.lora_rank)
        optimizer = optax.chain(optax.clip_by_global_norm(t_cfg.grad_clip),
                                optax.adamw(t_cfg.lr, b1=0.9, b2=0.999, weight_decay=t_cfg.weight_decay))
        rules, min_size = config.partition_rules, config.min_fsdp_size
        self.objective = objective = OBJECTIVES[config.objective.name]
        reward_apply, self._reward_tokenize = None, None
        if objective.process == "leap":
            reward_apply, reward_params, self._reward_tokenize = rewards_lib.learned_model()
            base = {**base, "reward": reward_params}
        frozen_shardings = parallel.tree_shardings(base, mesh, rules, min_size)
        self.frozen = jax.device_put(base, frozen_shardings)

        def init_state(r):
            params = policy.init(self.frozen["dit"], r)
            state = {"step": jnp.zeros((), jnp.int32), "updates": jnp.zeros((), jnp.int32), "params": params, "ema": params,
                     "opt_state": optimizer.init(params), "credit": credit.init()}
            if objective.old_policy is not None:
                state["old"] = params
            if config.curriculum.enabled:
                state["curriculum"] = jax.tree_util.tree_map(jnp.asarray, curriculum.init(num_prompts))
            return state

        rng = jax.random.fold_in(jax.random.PRNGKey(config.seed), 1)
        self.shardings = parallel.tree_shardings(jax.eval_shape(init_state, rng), mesh, rules, min_size)
        self.state = jax.jit(init_state, out_shardings=self.shardings)(rng)
        data, replicated = parallel.batch_sharding(mesh), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        self.rollout = jax.jit(make_rollout_fn(policy, config),
                               in_shardings=(self.shardings["params"], frozen_shardings, data, data, replicated))
        self.credit = jax.jit(make_credit_fn(credit, objective.process == "reverse"), static_argnums=3)
        self.complete = jax.jit(make_completion_fn(policy, config), static_argnums=5)
        self._reward_gradient = None
        self.update = jax.jit(make_update_fn(policy, optimizer, config, reward_apply), out_shardings=(self.shardings, None),
                              donate_argnums=0, compiler_options=compiler.backward_options())
        self.update_old_policy = jax.jit(functools.partial(update_old_policy, decay=objective.old_policy),
                                         out_shardings=self.shardings, donate_argnums=0)
        self.slots = training_slots(config)
        batch = t_cfg.prompts_per_iteration * t_cfg.group_size
        self.minibatch_size = -(-batch * len(self.slots) // t_cfg.minibatches)

    def objective_extras(self, prompts_local: list[dict]) -> dict:
        if self._reward_tokenize is None:
            return {}
        ids, mask = self._reward_tokenize(prompts_local)
        return dict(zip(("reward_ids", "reward_mask"), parallel.shard_batch((ids, mask), self.mesh)))

    def context(self, state, ro, cond, null, prompts_local, reward_fn) -> Context:
        """The credit schemes' host-side tools for this iteration (`credit.context`)."""
        def complete(states, steps):
            return self.complete(state["params"], self.frozen, cond, null, states, tuple(int(t) for t in steps))

        def reward_gradient(images, prompts):
            if self._reward_gradient is None:  # loaded on first use: only spatial credit needs it
                self._reward_gradient = rewards_lib.learned_gradient(self.mesh)
            return self._reward_gradient(images, prompts)

        return Context(ro, prompts_local, reward_fn, self.mesh, complete, reward_gradient)


# ------------------------------------------------------------------------------------------------- run
def run(config, workdir: str | None) -> dict:
    if not workdir:
        raise ConfigError("the train job needs --workdir (checkpoints, metrics and samples go there)")
    t_cfg, s_cfg, e_cfg = config.train, config.sampler, config.eval
    if config.objective.name not in OBJECTIVES:
        raise ConfigError(f"unknown objective {config.objective.name!r} (config.objective.name); known: {sorted(OBJECTIVES)}")
    objective = OBJECTIVES[config.objective.name]
    if s_cfg.kind not in objective.kinds:
        raise ConfigError(f"sampler.kind={s_cfg.kind!r} cannot be trained on by objective {config.objective.name!r}; "
                          f"choose one of {', '.join(objective.kinds)}")
    if config.objective.af_regularizer not in advantage_flow.REGULARIZERS:
        raise ConfigError(f"unknown objective.af_regularizer {config.objective.af_regularizer!r}; "
                          f"choose one of {', '.join(advantage_flow.REGULARIZERS)}")
    if s_cfg.kind == "ode" and s_cfg.same_noise_per_group:
        raise ConfigError("sampler.kind=ode with sampler.same_noise_per_group=True makes every image of a group the same "
                          "(no advantage to learn from): set --config.sampler.same_noise_per_group=False")
    if objective.process != "reverse" and (set(config.credit) & {"stepwise", "turning_point", "spatial"} or config.objective.ratio != "sample"):
        raise ConfigError(f"objective {config.objective.name!r} has no per-step or per-token ratio: use credit "
                          "('uniform',) or ('uniform', 'adaptive') and objective.ratio=sample")
    try:
        reward_fn = rewards_lib.build(t_cfg.rewards)
        credit = credit_lib.build(config.credit, config.credit_options, config.advantage.global_std, config.advantage.clip)
        sampler_levels(s_cfg)
    except (ValueError, FileNotFoundError) as e:
        raise ConfigError(str(e).splitlines()[0]) from None
    if "spatial" in credit.names and config.objective.ratio != "token":
        raise ConfigError("credit 'spatial' weights tokens, which a per-sample ratio averages away: "
                          "set --config.objective.ratio=token")
    train_prompts = load_prompt_set(config.prompts.train, "train")
    test_prompts = load_prompt_set(config.prompts.test, "test")
    if e_cfg.per_category:
        test_prompts = [p for c in shapes.CATEGORIES for p in [q for q in test_prompts if q["category"] == c][: e_cfg.per_category]]

    parallel.maybe_initialize_distributed(config.distributed)
    mesh = parallel.make_mesh(config.mesh)
    batch = t_cfg.prompts_per_iteration * t_cfg.group_size
    if batch % jax.device_count():
        raise ConfigError(f"train.prompts_per_iteration x train.group_size = {batch} must be divisible by the {jax.device_count()} devices")
    pipe, base, base_info = load_base(config.base)
    jitted = Steps(config, mesh, pipe, base, credit, len(train_prompts))
    state, frozen, policy = jitted.state, jitted.frozen, jitted.policy
    rng = jax.random.PRNGKey(config.seed)
    ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), config.checkpoint.keep)
    os.makedirs(workdir, exist_ok=True)
    try:
        restored, meta = ckpt.restore_latest(state)
    except Exception as e:  # noqa: BLE001 - orbax raises many types on a damaged checkpoint
        ckpt.close()
        raise ConfigError(f"cannot restore the latest checkpoint in {ckpt.directory}: {str(e).splitlines()[0]} "
                          "(move the damaged step folder away to resume from the one before)") from None
    history = {"evals": [], "wall_s": 0.0, "first_iteration_s": None}  # the first iteration includes compiling
    if restored is not None:
        state, history = restored, {**history, **meta.get("history", {})}
        print(f"resumed from step {int(state['step'])} in {ckpt.directory}")

    rollout_fn, credit_fn, update_fn = jitted.rollout, jitted.credit, jitted.update
    slots, minibatch_size = jitted.slots, jitted.minibatch_size
    sampler = evaluate.make_sampler(pipe, e_cfg.num_steps, e_cfg.cfg, e_cfg.shift)
    local = parallel.process_batch_slice(batch)
    writer = metrics.MetricWriter(workdir)
    learned_reward = rewards_lib.build((("learned", 1.0),)) if e_cfg.learned_reward else None

    def run_eval(step: int) -> dict:
        params = {"dit": policy.merged(state["ema"], frozen["dit"]), "text": frozen["text"]}
        result = evaluate.geneval(pipe, params, test_prompts, jax.random.PRNGKey(config.seed + 1), e_cfg.samples_per_prompt,
                                  e_cfg.batch_size, sampler=sampler, progress=True)
        evaluate.category_grid(result, os.path.join(workdir, f"eval_{step:06d}.png"))
        table = result["table"]
        entry = {"step": step, "wall_s": history["wall_s"], "table": table}
        if learned_reward is not None:  # the shipped learned reward on the same eval images (what LeapAlign optimizes)
            entry["learned_reward"] = float(learned_reward(result["images"], result["rows"])[0].mean())
        writer.scalars(step, {**{f"eval/{k}/{m}": v[m] for k, v in table.items() for m in ("strict", "score")}, "wall_s": history["wall_s"],
                              **({"eval/learned_reward": entry["learned_reward"]} if "learned_reward" in entry else {})})
        history["evals"].append(entry)
        tqdm.write(f"eval at step {step} (EMA weights, {len(test_prompts)} test prompts x {e_cfg.samples_per_prompt}, "
                   f"ODE {e_cfg.num_steps} steps, cfg {e_cfg.cfg}):\n" + evaluate.format_table(table))
        return table

    start = int(state["step"])
    if start == 0 and e_cfg.at_start and not history["evals"]:
        run_eval(0)
    bar = tqdm(range(start, t_cfg.iterations), initial=start, total=t_cfg.iterations, desc=config.objective.name, dynamic_ncols=True)
    stopped = None
    try:
        with StopSignal() as stop:
            for it in bar:
                t0 = time.time()
                it_rng = jax.random.fold_in(rng, it)
                host_rng = np.random.default_rng([config.seed, it])
                if config.curriculum.enabled:
                    drawn = curriculum.draw(jax.device_get(state["curriculum"]), t_cfg.prompts_per_iteration, host_rng, config.curriculum)
                    chosen = [train_prompts[i] for i in drawn]
                else:
                    chosen = sample_prompts(train_prompts, t_cfg.prompts_per_iteration, host_rng)
                prompts = [p for p in chosen for _ in range(t_cfg.group_size)]
                group_ids = np.repeat(np.arange(t_cfg.prompts_per_iteration, dtype=np.int32), t_cfg.group_size)
                ids, mask = pipe.tokenize([p["prompt"] for p in prompts])
                ids, mask = parallel.shard_batch((ids[local], mask[local]), mesh)
                rollout_params = state["old"] if objective.old_policy is not None else state["params"]
                ro, cond, null = rollout_fn(rollout_params, frozen, ids, mask, jax.random.fold_in(it_rng, 0))
                t1 = time.time()

                images = parallel.local_rows(ro.final)  # this process's samples -> host rewards
                reward, parts = reward_fn(images, prompts[local])
                _finite_or_stop({"reward": reward}, it + 1, "the", ckpt)
                rewards = parallel.global_from_local(reward, mesh)
                gids = parallel.global_from_local(group_ids[local], mesh)
                extras = credit.prepare(jitted.context(state, ro, cond, null, prompts[local], reward_fn))
                adv, credit_state, keep = credit_fn(ro, rewards, gids, t_cfg.prompts_per_iteration, state["credit"], extras)
                state = {**state, "credit": credit_state}
                if config.curriculum.enabled:
                    by_group = parallel.to_host(rewards).reshape(t_cfg.prompts_per_iteration, t_cfg.group_size)
                    updated = curriculum.update(jax.device_get(state["curriculum"]), drawn, by_group, config.curriculum)
                    state = {**state, "curriculum": jax.device_put(updated, jitted.shardings["curriculum"])}
                if "spatial" in credit.names and (it == start or it + 1 == t_cfg.iterations):
                    w = spatial.weights({"rollout": ro, **extras}, config.credit_options.get("spatial", None))
                    spatial.save_credit_maps(parallel.local_rows(ro.final), parallel.local_rows(w), pipe.dit.patch_size,
                                             os.path.join(workdir, f"credit_maps_{it + 1:06d}.png"),
                                             [p["prompt"] for p in prompts[local]])
                keep = np.asarray(keep)
                objective_extras = jitted.objective_extras(prompts[local])
                t2 = time.time()

                step_stats = []
                for epoch in range(t_cfg.num_inner_epochs):
                    for rows, steps, weight in minibatches(keep, slots, minibatch_size, np.random.default_rng([config.seed, it, epoch])):
                        state, stats = update_fn(state, frozen, ro, adv, cond, null, rows, steps, weight, objective_extras)
                        step_stats.append(stats)
                state = {**state, "step": state["step"] + 1}
                if objective.old_policy is not None:
                    state = jitted.update_old_policy(state)
                stats = {k: np.mean([np.asarray(s[k]) for s in step_stats], 0) for k in step_stats[0]} if step_stats else {}
                _finite_or_stop({k: v for k, v in stats.items() if k in ("loss", "kl", "grad_norm")}, it + 1, "the", ckpt)
                t3 = time.time()
                history["wall_s"] += t3 - t0
                if history["first_iteration_s"] is None:
                    history["first_iteration_s"] = t3 - t0

                done = it + 1
                scalars = {"reward": float(reward.mean()), "reward_std": float(reward.std()), "kept_fraction": float(keep.mean()),
                           **{f"reward/{n}": float(v.mean()) for n, v in parts.items()},
                           **{k: float(v) for k, v in stats.items() if np.ndim(v) == 0},
                           "rollout_s": t1 - t0, "reward_s": t2 - t1, "update_s": t3 - t2, "updates": len(step_stats),
                           "wall_s": history["wall_s"]}
                for key in (k for k in stats if k.endswith("_per_step")):
                    for t in slots:
                        scalars[f"{key[:-9]}/step_{t}"] = float(stats[key][t])
                writer.scalars(done, scalars)
                bar.set_postfix(reward=f"{scalars['reward']:.3f}", clipfrac=f"{scalars.get('clipfrac', 0):.3f}",
                                kl=f"{scalars.get('kl', 0):.2e}")
                out_of_time = bool(t_cfg.time_budget_s) and history["wall_s"] - history["first_iteration_s"] >= t_cfg.time_budget_s
                last = done == t_cfg.iterations or out_of_time
                if (e_cfg.every and done % e_cfg.every == 0) or last:
                    run_eval(done)
                if done % config.checkpoint.every == 0 or last or stop.requested:
                    ckpt.save(done, state, {"step": done, "history": history})
                if stop.requested:
                    stopped = stop.requested
                    tqdm.write(f"{stopped}: saved a checkpoint at step {done} in {ckpt.directory}; rerun the same command to resume")
                    break
                if out_of_time:
                    stopped = "time_budget"
                    tqdm.write(f"train.time_budget_s={t_cfg.time_budget_s} reached after {done} iterations ({history['wall_s']:.0f} s)")
                    break
    finally:
        ckpt.close()
        writer.close()
    result = {"step": int(state["step"]), "evals": history["evals"], "stopped": stopped,
              "wall_s": history["wall_s"], "first_iteration_s": history["first_iteration_s"]}
    if history["evals"]:
        with open(os.path.join(workdir, "eval.json"), "w") as f:
            json.dump({"base": base_info.get("name"), "evals": history["evals"]}, f, indent=2)
        metrics.plot_report(workdir, os.path.join(workdir, "report.png"))
    if len(history["evals"]) >= 2 and history["evals"][0]["step"] == 0:
        print(before_after(history["evals"][0], history["evals"][-1]))
    return result


def before_after(before: dict, after: dict) -> str:
    """The GenEval-style table before and after training, side by side."""
    lines = [f"GenEval-style table, step {before['step']} -> {after['step']} ({after['wall_s']:.0f} s of training):",
             f"{'category':14s} {'strict':>7s} {'->':>3s} {'strict':>7s}   {'score':>6s} {'->':>3s} {'score':>6s}"]
    for name, b in before["table"].items():
        a = after["table"][name]
        lines.append(f"{name:14s} {b['strict']:7.3f} {'':>3s} {a['strict']:7.3f}   {b['score']:6.3f} {'':>3s} {a['score']:6.3f}")
    return "\n".join(lines)
