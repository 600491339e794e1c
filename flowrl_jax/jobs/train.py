"""The `train` job: RL fine-tuning of a world's base DiT (Flow-GRPO and the methods that plug into it).

    python -m flowrl_jax.main --config configs/flow_grpo.py --workdir workdirs/flow_grpo

The loop in phases (DESIGN.md), each a function below:
    validate(config) -> setup(config, workdir) -> per iteration:
    sample_prompts -> rollout -> score -> assign_credit -> update -> after_iteration (EMA'd old policy,
    logging, eval, checkpoint, stop conditions).
It knows no world, credit scheme or objective by name: the world (`worlds/`) gives prompts, conditioning,
decoding, rewards and the eval; the credit chain (`credit/`) declares what it needs from the objective;
the objective (`objectives/`) builds its own training pairs (`steps.py` jit-compiles the pieces). The
policy is the whole DiT or LoRA adapters (`train.lora_rank > 0`); the KL reference is the base DiT.
Everything random derives from `config.seed` and the iteration (`jax.random.fold_in`), so a resumed
run equals an uninterrupted one.

The workdir gets `checkpoints/` (orbax, keep-N, resumed automatically), `metrics.jsonl` + TensorBoard
events, the world's eval images (`eval_<step>.png`), `eval.json`, credit schemes' debug images and, at
the end, `report.png` (reward and eval score against step and wall-clock). SIGTERM/SIGINT save a
checkpoint before exiting; a non-finite reward or loss stops the run naming the step and the quantity,
keeping the last good checkpoint.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import signal
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from flowrl_jax import credit as credit_lib, metrics, objectives, parallel, paths, rewards, worlds
from flowrl_jax.checkpoint import CheckpointError, Checkpointer
from flowrl_jax.config_lib import ConfigError
from flowrl_jax.data import curriculum
from flowrl_jax.models import attention, lora, mmdit
from flowrl_jax.rewards import remote
from flowrl_jax.sampling import windows
from flowrl_jax.rl.programs import Steps, TrainState, learning_rate, minibatches, sampler_levels


def itstime(step: int, every: int, total: int, last: bool = False) -> bool:
    """big_vision's periodic-action test: after `step` iterations, every `every` (0: never), and at the end."""
    return bool(every and step % every == 0) or step == total or last


class StopSignal:
    """SIGTERM/SIGINT set `requested` (the loop saves and exits at the end of the iteration, every process together:
    `after_iteration`); a second signal while the first is pending ends the process at once, as if unhandled."""

    def __init__(self):
        self.requested = None
        self.previous = {}

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            self.previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.requested is not None:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        self.requested = signal.Signals(signum).name

    def __exit__(self, *exc):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def _finite_or_stop(values: dict, step: int, ckpt: Checkpointer) -> None:
    for name, v in values.items():
        if not np.all(np.isfinite(v)):
            raise FloatingPointError(f"the {name} is not finite at step {step}; stopped, the last good checkpoint "
                                     f"(step {ckpt.latest_step()}) in {ckpt.directory} is kept")


# --------------------------------------------------------------------------------------------- validate
def use_fallback_rewards(config) -> None:
    """`train.rewards_without_models` in place of `train.rewards` when a device reward there has no weights given
    (`world.reward_models`), with a warning: a preset then runs its model-free demo instead of failing."""
    models, fallback = config.world.get("reward_models"), tuple(config.train.get("rewards_without_models", ()))
    missing = [(str(n), rewards.device.FOLDER_OF[str(n)]) for n, _ in config.train.rewards
               if str(n) in rewards.device.FACTORIES and not (models or {}).get(rewards.device.FOLDER_OF[str(n)])]
    if missing and fallback:
        flags = ", ".join(f"--config.world.reward_models.{key}" for _, key in missing)
        print(f"flowrl_jax: warning: train.rewards {[n for n, _ in missing]} need their weights ({flags}), not given: training "
              f"on {[str(n) for n, _ in fallback]} instead (train.rewards_without_models)", file=sys.stderr)
        config.train.rewards = fallback


def validate(config):
    """Every check a train config must pass before anything heavy is built; -> the world. ConfigError names the key."""
    s = config.sampler
    use_fallback_rewards(config)
    try:
        objective = objectives.get(config.objective.name)
        options = objectives.resolve_options(config, patch_size=None)
        objective.check(options, s)
        credit = credit_lib.build(config.credit.names, config.credit, config.advantage.global_std, config.advantage.clip)
        rewards.check(config.train.rewards, config.world.get("reward_models"))  # the device rewards' folders, before compiling
        remote.settings(config.train.get("remote_rewards"))
        sampler_levels(s, windows.window_at(s, 0, config.seed))  # the window's schedule and its options
        if windows.tail(s) != windows.tail({}) and (config.objective.name == "leapalign" or "turning_point" in config.credit.names):
            raise ValueError("sampler.window.tail_solver / tail_ratio: LeapAlign and TurningPoint credit read every step's state "
                             "on the base grid (Rollout.sigmas) and its Euler completions; keep the default tail (euler, 1.0)")
        world = worlds.build(config)
        for prompts in (world.train_prompts, getattr(world, "test_prompts", None) or []):  # the latent world's eval scores
            rewards.check_prompts(config.train.rewards, prompts)  # test prompts with train.rewards; e.g. OCR's quoted text
    except (ValueError, FileNotFoundError) as e:
        raise ConfigError(str(e).splitlines()[0]) from None
    rows = config.train.prompts_per_iteration * config.train.group_size
    if config.train.get("score_while_sampling") and not 0 < config.train.rollout_chunk < rows:
        raise ConfigError(f"train.score_while_sampling=True scores each rollout chunk while the next samples: set "
                          f"train.rollout_chunk to the rows per chunk, fewer than the {rows} of an iteration (e.g. {rows // 4})")
    if config.world.get("scan_blocks", "auto") not in mmdit.SCAN_CHOICES:
        raise ConfigError(f"world.scan_blocks={config.world.scan_blocks!r}: choose one of {', '.join(mmdit.SCAN_CHOICES)}")
    if config.world.get("attention", "xla") not in attention.IMPLEMENTATIONS:
        raise ConfigError(f"world.attention={config.world.attention!r}: choose one of {', '.join(attention.IMPLEMENTATIONS)}")
    if config.train.lora_init not in lora.INITS:
        raise ConfigError(f"train.lora_init={config.train.lora_init!r}: choose one of {', '.join(lora.INITS)}")
    if s.kind == "ode" and s.same_noise_per_group:
        raise ConfigError("sampler.kind=ode with sampler.same_noise_per_group=True makes every image of a group the same "
                          "(no advantage to learn from): set --config.sampler.same_noise_per_group=False")
    for need in sorted(credit.needs - objective.offers(options)):
        schemes = [n for n in credit.names if need in credit_lib.SCHEMES[n].needs]
        raise ConfigError(f"credit {', '.join(schemes)} needs per-{need} ratios, which objective {config.objective.name!r} "
                          f"does not offer with its options (config.objective.{config.objective.name}); per-sample "
                          "objectives take credit ('uniform',) or ('uniform', 'adaptive')")
    return world


# ------------------------------------------------------------------------------------------------ setup
@dataclasses.dataclass
class Job:
    """What the phases share: the config, the world, the jitted steps and the run's outputs."""
    config: Any
    workdir: str
    world: Any
    mesh: Any
    steps: Steps
    credit: Any
    reward_fn: Any
    ckpt: Checkpointer
    writer: metrics.MetricWriter
    history: dict
    local: slice     # this process's rows of the global batch
    start_step: int  # the iteration this process started (or resumed) at
    reader: Any = None  # the world's per-process prompt reader (its position is checkpointed), or None
    pool: Any = None    # the threads scoring rollout chunks while the next samples (train.score_while_sampling), or None


def setup(config, workdir: str, world) -> tuple[Job, TrainState]:
    """Mesh, base model, jitted steps and the TrainState: restored from the newest checkpoint that restores."""
    t_cfg = config.train
    mesh = parallel.make_mesh(config.mesh)
    batch = t_cfg.prompts_per_iteration * t_cfg.group_size
    if batch % jax.device_count():
        raise ConfigError(f"train.prompts_per_iteration x train.group_size = {batch} must be divisible by the {jax.device_count()} devices")
    shards = parallel.batch_shards(mesh)
    if 0 < t_cfg.rollout_chunk < batch and (batch % t_cfg.rollout_chunk or t_cfg.rollout_chunk % shards):
        raise ConfigError(f"train.rollout_chunk={t_cfg.rollout_chunk} must divide the {batch} rows of an iteration and be a "
                          f"multiple of the {shards} batch shards of the mesh")
    if t_cfg.microbatch and t_cfg.microbatch % shards:
        raise ConfigError(f"train.microbatch={t_cfg.microbatch} must be a multiple of the {shards} batch shards of the mesh")
    try:
        learning_rate(t_cfg)  # a misspelled train.lr_schedule fails here, before the base model loads
        dit, base = world.load()
        credit = credit_lib.build(config.credit.names, config.credit, config.advantage.global_std, config.advantage.clip)
        reward_fn = world.reward_fn(t_cfg.rewards, t_cfg.get("remote_rewards"))
    except (ValueError, FileNotFoundError, ImportError) as e:  # ImportError: a reward's optional package (OCR)
        raise ConfigError(str(e).splitlines()[0]) from None
    steps = Steps(config, mesh, world, dit, base, credit, len(world.train_prompts))
    paths.makedirs(workdir)
    ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), config.checkpoint.keep)
    try:
        restored, meta, skipped = ckpt.restore_latest(steps.state)
    except CheckpointError as e:
        ckpt.close()
        raise ConfigError(str(e)) from None
    except ValueError as e:  # orbax: the saved state's structure is not this config's
        ckpt.close()
        raise ConfigError(f"the checkpoint in {ckpt.directory} holds another train state than this config builds "
                          f"({str(e).strip().splitlines()[0]}); resume with the config that wrote it, or use a new --workdir") from None
    for step, reason in skipped:
        print(f"checkpoint step {step} in {ckpt.directory} is damaged ({reason}); resuming from an older step")
    state, history = steps.state, {"evals": [], "wall_s": 0.0, "first_iteration_s": None}  # the first iteration includes compiling
    if restored is not None:
        state, history = restored, {**history, **meta.get("history", {})}
        print(f"resumed from step {int(state.step)} in {ckpt.directory}")
    reader = None
    if hasattr(world, "prompt_reader") and not config.curriculum.enabled:  # the curriculum draws prompt indices itself
        reader = world.prompt_reader(t_cfg.prompts_per_iteration)
        if restored is not None and "prompt_reader" in meta:  # saved by process 0; every process is at the same position
            reader.set_state({**meta["prompt_reader"], "process_index": jax.process_index()})
    pool = None
    if t_cfg.get("score_while_sampling") and reward_fn.on_host:
        pool = concurrent.futures.ThreadPoolExecutor(min(4, batch // t_cfg.rollout_chunk), thread_name_prefix="score")
    job = Job(config, workdir, world, mesh, steps, credit, reward_fn, ckpt, metrics.MetricWriter(workdir), history,
              parallel.process_batch_slice(batch), int(state.step), reader, pool)
    return job, state


# ----------------------------------------------------------------------------------------------- phases
def sample_prompts(job: Job, state: TrainState, it: int) -> dict:
    """The iteration's prompts, each `G` times, tokenized and sharded: this process's rows of the world's
    per-process reader when it has one, else of the global draw (uniform, or the curriculum's)."""
    t_cfg, cur = job.config.train, job.config.curriculum
    drawn = None
    if job.reader is not None:
        local = [row for row in next(job.reader) for _ in range(t_cfg.group_size)]
    else:
        host_rng = np.random.default_rng([job.config.seed, it])
        if cur.enabled:
            drawn = curriculum.draw(jax.tree_util.tree_map(parallel.to_host, state.curriculum), t_cfg.prompts_per_iteration, host_rng, cur)
        else:
            drawn = job.world.sample_prompts(t_cfg.prompts_per_iteration, host_rng)
        local = [job.world.train_prompts[i] for i in drawn for _ in range(t_cfg.group_size)][job.local]
    group_ids = np.repeat(np.arange(t_cfg.prompts_per_iteration, dtype=np.int32), t_cfg.group_size)
    ids, mask = parallel.shard_batch(job.world.tokenize(local), job.mesh)
    return {"drawn": drawn, "prompts_local": local, "group_ids": group_ids, "ids": ids, "mask": mask,
            "levels": job.steps.levels_at(it)}  # the iteration's SDE window (sampler.window)


def rollout(job: Job, state: TrainState, batch: dict, it: int):
    """-> (Rollout, cond, null): the old policy's rollout where the objective keeps one, else the policy's. With
    `train.score_while_sampling` the rollout runs chunk by chunk and each chunk's host and remote rewards are
    scored on `job.pool` while the next chunk samples (`batch["early"]`: [(this process's rows, future)])."""
    params = state.old if job.steps.objective.old_policy is not None else state.params
    rng = jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(job.config.seed), it), 0)
    if job.pool is None:
        return job.steps.rollout(params, job.steps.frozen, batch["ids"], batch["mask"], rng, batch["levels"])
    b, chunk = len(batch["group_ids"]), job.config.train.rollout_chunk
    order = parallel.to_row_chunks(np.arange(b), b // chunk, parallel.batch_shards(job.mesh))  # chunk i's global rows
    batch["early"] = []

    def on_chunk(i, out):
        mine = order[i][(order[i] >= job.local.start) & (order[i] < job.local.stop)] - job.local.start  # this process's, in order
        images = job.world.decode(job.steps.frozen, out[0].final)  # dispatched here: the device's work keeps one order
        prompts = [batch["prompts_local"][r] for r in mine]
        batch["early"].append((mine, job.pool.submit(lambda: job.reward_fn.host_parts(parallel.local_rows(images), prompts))))

    return job.steps.rollout_in_chunks(params, job.steps.frozen, batch["ids"], batch["mask"], rng, on_chunk, batch["levels"])


def host_rewards(job: Job, images, batch: dict) -> dict:
    """This process's rows' host and remote rewards {name: [b]}: from the chunks scored early, if any, else scored now
    on `images` (the decoded batch)."""
    if batch.get("early"):
        parts = {}
        for rows, future in batch["early"]:
            for name, values in future.result().items():
                parts.setdefault(name, np.zeros(len(batch["prompts_local"]), np.float32))[rows] = values
        return parts
    return job.reward_fn.host_parts(parallel.local_rows(images), batch["prompts_local"]) if job.reward_fn.on_host else {}


def score(job: Job, ro, batch: dict, it: int) -> dict:
    """Rewards of this process's decoded samples (host and remote rewards on the host, device rewards on the device after
    them), gathered into global arrays with the group ids (`reward` and `parts`: every process's rows on the host, for
    the logs). Failures are agreed before any device work (`rewards.agree_on_failure`: no process enters a collective another
    left). A non-finite reward anywhere stops the run on every process at once: the test reads the gathered rewards."""
    scored_early = bool(batch.get("early"))
    images = None if scored_early and not job.reward_fn.on_device else job.world.decode(job.steps.frozen, ro.final)  # on device
    failure = None
    try:
        parts = host_rewards(job, images, batch)
    except Exception as e:  # agreed below, then raised on every process
        failure = e
    rewards.agree_on_failure(failure)
    parts.update(job.reward_fn.device_parts(images, batch["prompts_local"]) if job.reward_fn.on_device else {})
    reward, parts = job.reward_fn.total(parts), {n: parts[n] for n, _ in job.reward_fn.weighted}
    on_mesh = parallel.global_from_local(reward, job.mesh)
    every = {n: parallel.to_host(parallel.global_from_local(v, job.mesh)) for n, v in parts.items()}  # all processes' rows, for logs
    gathered = parallel.to_host(on_mesh)
    _finite_or_stop({"reward": gathered}, it + 1, job.ckpt)
    return {"reward": gathered, "parts": every, "rewards": on_mesh,
            "group_ids": parallel.global_from_local(batch["group_ids"][job.local], job.mesh)}


def assign_credit(job: Job, state: TrainState, ro, cond, null, batch: dict, scored: dict, it: int):
    """-> (state, adv [B, T, K], keep [B] numpy): the credit chain, the curriculum's update, debug images."""
    t_cfg, steps = job.config.train, job.steps
    ctx = steps.context(state, ro, cond, null, batch["prompts_local"], job.reward_fn)
    extras = job.credit.prepare(ctx)
    key = jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(job.config.seed), it), 2)  # the null control's shuffle
    adv, credit_state, keep = steps.credit(ro, scored["rewards"], scored["group_ids"], t_cfg.prompts_per_iteration, state.credit,
                                           extras, key)
    state = state.replace(credit=credit_state)
    if job.config.curriculum.enabled:
        by_group = parallel.to_host(scored["rewards"]).reshape(t_cfg.prompts_per_iteration, t_cfg.group_size)
        updated = curriculum.update(jax.tree_util.tree_map(parallel.to_host, state.curriculum), batch["drawn"], by_group, job.config.curriculum)
        state = state.replace(curriculum=parallel.put_global(updated, steps.shardings.curriculum))
    if it == job.start_step or it + 1 == t_cfg.iterations:
        for stem, grid in job.credit.debug_images(ctx, extras).items():
            if jax.process_index() == 0:
                metrics.save_grid(path=os.path.join(job.workdir, f"{stem}_{it + 1:06d}.png"), **grid)
    return state, adv, parallel.to_host(keep)


def update(job: Job, state: TrainState, data: dict, keep: np.ndarray, slots: np.ndarray, it: int) -> tuple[TrainState, dict, int]:
    """`num_inner_epochs` shuffled passes over the kept samples x the objective's `slots`, one optimizer step
    per minibatch; then the old policy follows. -> (state, mean stats, number of updates). The objective's
    per-minibatch `alignment` becomes `alignment_heldout` (first epoch, after its first minibatch: samples
    no update has seen) and `alignment_trained` (later epochs)."""
    t_cfg, steps, seed = job.config.train, job.steps, job.config.seed
    step_stats, aligned = [], {"alignment_heldout": [], "alignment_trained": []}
    for epoch in range(t_cfg.num_inner_epochs):
        chunks = minibatches(keep, slots, steps.minibatch_size, np.random.default_rng([seed, it, epoch]))
        for i, (rows, pair_slots, weight) in enumerate(chunks):
            state, stats = steps.update(state, steps.frozen, data, rows, pair_slots, weight)
            step_stats.append(stats)
            if "alignment" in stats and (epoch or i):  # the first minibatch is on-policy: no change to correlate yet
                aligned["alignment_trained" if epoch else "alignment_heldout"].append(stats["alignment"])
    state = state.replace(step=state.step + 1)
    if steps.objective.old_policy is not None:
        state = steps.update_old_policy(state)
    stats = {k: np.mean([np.asarray(s[k]) for s in step_stats], 0) for k in step_stats[0] if k != "alignment"} if step_stats else {}
    stats.update({k: np.mean(np.asarray(v)) for k, v in aligned.items() if v})
    _finite_or_stop({k: v for k, v in stats.items() if k in ("loss", "kl", "grad_norm")}, it + 1, job.ckpt)
    return state, stats, len(step_stats)


def run_eval(job: Job, state: TrainState, step: int) -> dict:
    """The world's eval of the EMA policy; logged, kept in the history and printed."""
    dit_params = job.steps.policy.merged(state.ema, job.steps.frozen["dit"])
    out = job.world.evaluate(dit_params, job.steps.frozen, step, job.workdir)
    entry = {"step": step, "wall_s": job.history["wall_s"], **out["entry"]}
    job.writer.scalars(step, {**out["scalars"], "wall_s": job.history["wall_s"]})
    job.history["evals"].append(entry)
    if metrics.is_writer():
        tqdm.write(out["text"])
    return entry


def log_iteration(job: Job, done: int, scored: dict, stats: dict, keep: np.ndarray, slots: np.ndarray, num_updates: int,
                  times: list) -> dict:
    """One metrics.jsonl / TensorBoard row: rewards, the objective's stats (per-step ones per slot), timings."""
    t0, t1, t2, t3 = times
    scalars = {"reward": float(scored["reward"].mean()), "reward_std": float(scored["reward"].std()), "kept_fraction": float(keep.mean()),
               **{f"reward/{n}": float(v.mean()) for n, v in scored["parts"].items()},
               **{k: float(v) for k, v in stats.items() if np.ndim(v) == 0},
               "rollout_s": t1 - t0, "reward_s": t2 - t1, "update_s": t3 - t2, "updates": num_updates, "wall_s": job.history["wall_s"]}
    for key in (k for k in stats if k.endswith("_per_step")):
        for t in slots:
            scalars[f"{key[:-9]}/step_{t}"] = float(stats[key][t])
    job.writer.scalars(done, scalars)
    return scalars


def after_iteration(job: Job, state: TrainState, done: int, stop: StopSignal) -> str | None:
    """Eval, checkpoint and the stop conditions after `done` iterations; -> why the run stops, or None. The stop
    conditions of every process are agreed in one collective (`parallel.agree`): a signal to any one process, or any
    process past the time budget, stops them all after the same iteration, each saving the same step."""
    t_cfg, history = job.config.train, job.history
    agreed = parallel.agree({"signal": stop.requested is not None, "out_of_time": bool(t_cfg.time_budget_s) and
                             history["wall_s"] - history["first_iteration_s"] >= t_cfg.time_budget_s})
    out_of_time = agreed["out_of_time"]
    signalled = (stop.requested or "a stop signal to another process") if agreed["signal"] else None
    if itstime(done, job.config.eval.every, t_cfg.iterations, last=out_of_time):
        run_eval(job, state, done)
    if itstime(done, job.config.checkpoint.every, t_cfg.iterations, last=out_of_time or bool(signalled)):
        meta = {"step": done, "history": history}
        if job.reader is not None:
            meta["prompt_reader"] = job.reader.get_state()
        job.ckpt.save(done, state, meta)
    if signalled:
        tqdm.write(f"{signalled}: saved a checkpoint at step {done} in {job.ckpt.directory}; rerun the same command to resume")
        return signalled
    if out_of_time:
        tqdm.write(f"train.time_budget_s={t_cfg.time_budget_s} reached after {done} iterations ({history['wall_s']:.0f} s)")
        return "time_budget"
    return None


def iteration(job: Job, state: TrainState, it: int) -> tuple[TrainState, dict]:
    """One RL iteration, phase by phase; -> (state, the logged scalars)."""
    t0 = time.time()
    batch = sample_prompts(job, state, it)
    ro, cond, null = rollout(job, state, batch, it)
    t1 = time.time()
    scored = score(job, ro, batch, it)
    state, adv, keep = assign_credit(job, state, ro, cond, null, batch, scored, it)
    key = jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(job.config.seed), it), 1)  # the iteration's own randomness
    data = {"rollout": ro, "adv": adv, "cond": cond, "null": null, "key": key, **job.steps.objective_extras(batch["prompts_local"])}
    t2 = time.time()
    diag = job.config.diagnostics
    before = jax.tree_util.tree_map(jnp.copy, state.params) if itstime(it + 1, diag.image_change_every, job.config.train.iterations) else None
    slots = job.steps.slots_at(batch["levels"])
    state, stats, num_updates = update(job, state, data, keep, slots, it)
    t3 = time.time()
    job.history["wall_s"] += t3 - t0
    if before is not None:  # the same-noise change of the final latents, trained vs untrained steps (not in wall_s)
        change = job.steps.image_change(before, state.params, job.steps.frozen, batch["ids"], batch["mask"], jax.random.fold_in(key, 7),
                                         batch["levels"])
        stats.update({f"image_change/{k}": np.asarray(v) for k, v in change.items()})
    if job.history["first_iteration_s"] is None:
        job.history["first_iteration_s"] = t3 - t0
    return state, log_iteration(job, it + 1, scored, stats, keep, slots, num_updates, [t0, t1, t2, t3])


# -------------------------------------------------------------------------------------------------- run
def run(config, workdir: str | None) -> dict:
    if not workdir:
        raise ConfigError("the train job needs --workdir (checkpoints, metrics and samples go there)")
    with StopSignal() as stop:  # from the start: a signal during loading or compiling stops after the first iteration
        parallel.maybe_initialize_distributed(config.distributed, config.get("distributed_timeout_s", parallel.DISTRIBUTED_TIMEOUT_S))
        world = validate(config)
        job, state = setup(config, workdir, world)
        return loop(job, state, stop)


def loop(job: Job, state: TrainState, stop: StopSignal) -> dict:
    """The iterations from `job.start_step`, an eval first on a fresh run; -> `finish`'s result."""
    config = job.config
    t_cfg, start = config.train, job.start_step
    if start == 0 and config.eval.at_start and not job.history["evals"]:
        run_eval(job, state, 0)
    bar = tqdm(range(start, t_cfg.iterations), initial=start, total=t_cfg.iterations, desc=config.objective.name, dynamic_ncols=True,
               disable=not metrics.is_writer())  # logs from process 0
    stopped = None
    try:
        for it in bar:
            reader_before = job.reader.get_state() if job.reader is not None else None
            try:
                state, scalars = iteration(job, state, it)
                shown = {k: f"{scalars[k]:.3g}" for k in ("learned_reward", "clipfrac", "kl") if k in scalars}  # the objective's own
                bar.set_postfix(reward=f"{scalars['reward']:.3f}", **shown)
                stopped = after_iteration(job, state, it + 1, stop)
            except remote.RewardServerError as e:  # every process is here together (score agreed on it)
                save_and_stop(job, state, reader_before if int(state.step) == it else None, e)
            if stopped:
                break
    finally:
        if job.pool is not None:
            job.pool.shutdown(wait=False, cancel_futures=True)
        job.ckpt.close()
        job.writer.close()
    return finish(job, state, stopped)


def save_and_stop(job: Job, state: TrainState, reader_state: dict | None, error: remote.RewardServerError) -> None:
    """A reward server failed: save `state` (the iteration it failed in starts again on resume, from the same prompts
    and noise, so nothing is lost or counted twice), then raise the error with one line naming the server and the step."""
    step = int(state.step)
    if job.ckpt.latest_step() != step:
        meta = {"step": step, "history": job.history}
        if job.reader is not None:
            meta["prompt_reader"] = reader_state if reader_state is not None else job.reader.get_state()
        job.ckpt.save(step, state, meta)
    then = "rerun the same command once the server is back" if error.retryable else "fix the server or the request, then rerun the same command"
    raise remote.RewardServerError(error.url, f"{error.reason}; saved a checkpoint at step {step} in {job.ckpt.directory}; {then}",
                                   error.retryable) from None


def finish(job: Job, state: TrainState, stopped: str | None) -> dict:
    """eval.json, report.png and the before/after table; -> the job's result."""
    history = job.history
    result = {"step": int(state.step), "evals": history["evals"], "stopped": stopped,
              "wall_s": history["wall_s"], "first_iteration_s": history["first_iteration_s"]}
    if history["evals"] and metrics.is_writer():
        with paths.open_file(os.path.join(job.workdir, "eval.json"), "w") as f:
            json.dump({"base": job.config.world.get("base"), "evals": history["evals"]}, f, indent=2)
        metrics.plot_report(job.workdir, os.path.join(job.workdir, "report.png"))
    if len(history["evals"]) >= 2 and history["evals"][0]["step"] == 0 and metrics.is_writer():
        print(before_after(history["evals"][0], history["evals"][-1], job.world.eval_name, job.world.eval_rows))
    return result


def before_after(before: dict, after: dict, title: str = "Eval table", rows: str = "row") -> str:
    """The eval table before and after training, side by side (every metric of the table's rows but `n`)."""
    names = [m for m in next(iter(before["table"].values())) if m != "n"]
    lines = [f"{title}, step {before['step']} -> {after['step']} ({after['wall_s']:.0f} s of training):",
             f"{rows:14s} " + "   ".join(f"{m:>7s} {'->':>3s} {m:>7s}" for m in names)]
    for row, b in before["table"].items():
        a = after["table"][row]
        lines.append(f"{row:14s} " + "   ".join(f"{b[m]:7.3f} {'':>3s} {a[m]:7.3f}" for m in names))
    return "\n".join(lines)
