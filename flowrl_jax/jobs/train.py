"""The `train` job: RL fine-tuning of a world's base DiT (Flow-GRPO and the methods that plug into it).

    python -m flowrl_jax.main --config configs/flow_grpo.py --workdir workdirs/flow_grpo

The loop in phases (docs/design.md), each a function below:
    validate(config) -> make_plan(config) -> setup(plan, workdir) -> per iteration:
    sample_prompts -> rollout -> score -> assign_credit -> update -> after_iteration (EMA'd old policy,
    logging, eval, checkpoint, stop conditions).
It knows no world, credit scheme or objective by name: the plan (`rl/plan.py`) checks the config and builds the
world (`worlds/`: prompts, conditioning, decoding, rewards, the eval), the credit chain (`credit/`: it declares what
it needs from the objective) and the objective (`objectives/`: it builds its own training pairs) once;
`rl/programs.py` jit-compiles the iteration's programs; the loop alone holds the `TrainState`. The policy is the
whole DiT or LoRA adapters (`train.lora_rank > 0`); the KL reference is the base DiT.
Everything random derives from `config.seed`, a named stream and the iteration (`flowrl_jax/keys.py`), so a resumed
run equals an uninterrupted one.

The workdir gets `checkpoints/` (orbax, keep-N, resumed automatically), `metrics.jsonl` + TensorBoard
events, the world's eval images (`eval_<step>.png`), `eval.json`, credit schemes' debug images and, at
the end, `report.png` (reward and eval score against step and wall-clock). SIGTERM/SIGINT (or JAX's preemption
notice) end the iteration in flight, skip its eval, save and exit 75 (`main`: rerun the same command); saves are
asynchronous (orbax), every `checkpoint.every` iterations and/or `checkpoint.every_s` seconds. A non-finite reward or
loss stops the run naming the step and the quantity, keeping the last good checkpoint.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import signal
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from flowrl_jax import config_lib, keys, metrics, parallel, paths, rewards
from flowrl_jax.checkpoint import CheckpointError, Checkpointer
from flowrl_jax.config_lib import ConfigError
from flowrl_jax.data import curriculum
from flowrl_jax.rewards import remote
from flowrl_jax.rl import plan as plan_lib, programs as programs_lib
from flowrl_jax.rl.minibatch import minibatches
from flowrl_jax.rl.plan import Plan
from flowrl_jax.rl.programs import Programs
from flowrl_jax.rl.state import TrainState


def itstime(step: int, every: int, total: int, last: bool = False) -> bool:
    """big_vision's periodic-action test: after `step` iterations, every `every` (0: never), and at the end."""
    return bool(every and step % every == 0) or step == total or last


class StopSignal:
    """SIGINT, and SIGTERM where JAX's preemption service does not watch it, set `requested`: the loop finishes the
    iteration, skips its eval, saves and exits, every process together (`after_iteration`); a second signal while the first
    is pending ends the process at once, as if unhandled. In a multi-process run JAX's preemption service owns SIGTERM
    (`jax.distributed.initialize` installs its notifier, the way a TPU maintenance event or GKE announces a preemption):
    `parallel.preemption_noticed` reads it, and a Python handler here would silence it."""

    def __init__(self, jax_owns_sigterm: bool = False):
        self.signals = (signal.SIGINT,) if jax_owns_sigterm else (signal.SIGTERM, signal.SIGINT)
        self.requested = None
        self.previous = {}

    def __enter__(self):
        for sig in self.signals:
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


def _write_json(path: str, value) -> None:
    with paths.open_file(path, "w") as f:
        json.dump(value, f, indent=2)


def _finite_or_stop(values: dict, step: int, ckpt: Checkpointer) -> None:
    for name, v in values.items():
        if not np.all(np.isfinite(v)):
            raise FloatingPointError(f"the {name} is not finite at step {step}; stopped, the last good checkpoint "
                                     f"(step {ckpt.latest_step()}) in {ckpt.directory} is kept")


# --------------------------------------------------------------------------------------------- validate
def validate(config) -> None:
    """Every check a train config must pass before anything is built (`rl/plan.py` `validate`; pure)."""
    plan_lib.validate(config)


# ------------------------------------------------------------------------------------------------ setup
@dataclasses.dataclass
class Job:
    """What the phases share: the plan, the programs, the frozen weights and the run's outputs (not the state)."""
    plan: Plan
    workdir: str
    programs: Programs
    frozen: dict     # the world's base weights (and the reward model's), placed on the mesh
    reward_fn: rewards.Weighted
    ckpt: Checkpointer
    writer: metrics.MetricWriter
    history: dict
    local: slice     # this process's rows of the global batch
    start_step: int  # the iteration this process started (or resumed) at
    reader: Any = None  # the world's per-process prompt reader (its position is checkpointed), or None
    pool: Any = None    # the threads scoring rollout chunks while the next samples (train.score_while_sampling), or None
    saved_at: float = dataclasses.field(default_factory=time.time)  # wall time of the last save (checkpoint.every_s)

    @property
    def config(self):
        return self.plan.config

    @property
    def world(self):
        return self.plan.world

    @property
    def mesh(self):
        return self.plan.mesh


def setup(plan: Plan, workdir: str) -> tuple[Job, TrainState]:
    """Base model, programs and the TrainState: restored from the newest checkpoint that restores."""
    config, world = plan.config, plan.world
    t_cfg = config.train
    batch = t_cfg.prompts_per_iteration * t_cfg.group_size
    try:
        dit, base = world.load()
        reward_fn = world.reward_fn(plan.rewards, t_cfg.get("remote_rewards"))
    except (ValueError, FileNotFoundError, ImportError) as e:  # ImportError: a reward's optional package (OCR)
        raise ConfigError(str(e).splitlines()[0]) from None
    programs, frozen, state = programs_lib.build(plan, dit, base)
    paths.makedirs(workdir)
    if metrics.is_writer():  # what the export's model card cites: the command and the config of the run
        record = {"command": config_lib.command_line(), "config": json.loads(config.to_json_best_effort())}
        metrics.best_effort("run.json", lambda: _write_json(os.path.join(workdir, "run.json"), record))
    ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), config.checkpoint.keep)
    try:
        restored, meta, skipped = ckpt.restore_latest(state)
    except CheckpointError as e:
        ckpt.close()
        raise ConfigError(str(e)) from None
    except ValueError as e:  # orbax: the saved state's structure is not this config's
        ckpt.close()
        raise ConfigError(f"the checkpoint in {ckpt.directory} holds another train state than this config builds "
                          f"({str(e).strip().splitlines()[0]}); resume with the config that wrote it, or use a new --workdir") from None
    for step, reason in skipped:
        print(f"checkpoint step {step} in {ckpt.directory} is damaged ({reason}); resuming from an older step")
    history = {"evals": [], "wall_s": 0.0, "first_iteration_s": None}  # the first iteration includes compiling
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
    job = Job(plan, workdir, programs, frozen, reward_fn, ckpt, metrics.MetricWriter(workdir), history,
              parallel.process_batch_slice(batch), int(state.step), reader, pool)
    return job, state


# ----------------------------------------------------------------------------------------------- phases
@dataclasses.dataclass(frozen=True)
class Batch:
    """An iteration's prompts: this process's rows, and the global arrays on the mesh."""
    drawn: np.ndarray | None   # the global draw's prompt indices (the curriculum's statistics); None with a prompt reader
    prompts_local: list        # this process's prompt rows, each prompt `G` times
    group_ids: np.ndarray      # [B] every process's rows' prompt group
    ids: jax.Array             # [B, L] tokens, batch-sharded
    mask: jax.Array
    levels: np.ndarray         # [T] the iteration's noise level per step (its SDE window, sampler.window)


@dataclasses.dataclass(frozen=True)
class Sampled:
    """An iteration's rollout: per row, its schedule, and the host rewards already scored while it sampled."""
    rollout: Any               # sampling.rollout.Rollout
    schedule: Any              # sampling.rollout.Schedule
    cond: Any
    null: Any
    early: tuple = ()          # ((this process's rows of a chunk, a future of their host rewards), ...)


def sample_prompts(job: Job, state: TrainState, it: int) -> Batch:
    """The iteration's prompts, each `G` times, tokenized and sharded: this process's rows of the world's
    per-process reader when it has one, else of the global draw (uniform, or the curriculum's)."""
    t_cfg, cur = job.config.train, job.config.curriculum
    drawn = None
    if job.reader is not None:
        local = [row for row in next(job.reader) for _ in range(t_cfg.group_size)]
    else:
        host_rng = keys.host(job.config.seed, "prompts", it)
        if cur.enabled:
            drawn = curriculum.draw(jax.tree_util.tree_map(parallel.to_host, state.curriculum), t_cfg.prompts_per_iteration, host_rng, cur)
        else:
            drawn = job.world.sample_prompts(t_cfg.prompts_per_iteration, host_rng)
        local = [job.world.train_prompts[i] for i in drawn for _ in range(t_cfg.group_size)][job.local]
    group_ids = np.repeat(np.arange(t_cfg.prompts_per_iteration, dtype=np.int32), t_cfg.group_size)
    ids, mask = parallel.shard_batch(job.world.tokenize(local), job.mesh)
    return Batch(drawn, local, group_ids, ids, mask, job.plan.levels_at(it))


def rollout_policy(job: Job, state: TrainState):
    """The params that draw the rollouts: the old policy where the objective keeps one, else the policy's own."""
    return state.old if job.plan.objective.old_policy is not None else state.params


def rollout(job: Job, state: TrainState, batch: Batch, it: int) -> Sampled:
    """The rollout policy's rollout (`rollout_policy`). With `train.score_while_sampling` the rollout runs chunk by chunk
    and each chunk's host and remote rewards are scored on `job.pool` while the next chunk samples (`Sampled.early`)."""
    params = rollout_policy(job, state)
    rng = keys.device(job.config.seed, "rollout", it)
    sched = programs_lib.schedule_of(job.config.sampler, batch.levels)
    run = job.programs.rollout
    if job.pool is None:
        ro, cond, null = run(params, job.frozen, batch.ids, batch.mask, rng, batch.levels)
        return Sampled(ro, sched, cond, null)
    order = parallel.to_row_chunks(np.arange(len(batch.group_ids)), run.chunks, parallel.batch_shards(job.mesh))  # chunks' global rows
    early = []

    def on_chunk(i, out):
        mine = order[i][(order[i] >= job.local.start) & (order[i] < job.local.stop)] - job.local.start  # this process's, in order
        images = job.world.decode(job.frozen, out[0].final)  # dispatched here: the device's work keeps one order
        prompts = [batch.prompts_local[r] for r in mine]
        early.append((mine, job.pool.submit(lambda: job.reward_fn.host_parts(parallel.local_rows(images), prompts))))

    ro, cond, null = run(params, job.frozen, batch.ids, batch.mask, rng, batch.levels, on_chunk)
    return Sampled(ro, sched, cond, null, tuple(early))


def host_rewards(job: Job, images, batch: Batch, sampled: Sampled) -> dict:
    """This process's rows' host and remote rewards {name: [b]}: from the chunks scored early, if any, else scored now
    on `images` (the decoded batch)."""
    if sampled.early:
        parts = {}
        for rows, future in sampled.early:
            for name, values in future.result().items():
                parts.setdefault(name, np.zeros(len(batch.prompts_local), np.float32))[rows] = values
        return parts
    return job.reward_fn.host_parts(parallel.local_rows(images), batch.prompts_local) if job.reward_fn.on_host else {}


def score(job: Job, sampled: Sampled, batch: Batch, it: int) -> dict:
    """Rewards of this process's decoded samples (host and remote rewards on the host, device rewards on the device after
    them), gathered into global arrays with the group ids (`reward` and `parts`: every process's rows on the host, for
    the logs). Failures are agreed before any device work (`rewards.agree_on_failure`: no process enters a collective another
    left). A non-finite reward anywhere stops the run on every process at once: the test reads the gathered rewards."""
    decode = not sampled.early or job.reward_fn.on_device
    images = job.world.decode(job.frozen, sampled.rollout.final) if decode else None  # on device
    failure = None
    try:
        parts = host_rewards(job, images, batch, sampled)
    except Exception as e:  # agreed below, then raised on every process
        failure = e
    rewards.agree_on_failure(failure)
    parts.update(job.reward_fn.device_parts(images, batch.prompts_local) if job.reward_fn.on_device else {})
    reward, parts = job.reward_fn.total(parts), {n: parts[n] for n, _ in job.reward_fn.weighted}
    on_mesh = parallel.global_from_local(reward, job.mesh)
    every = {n: parallel.to_host(parallel.global_from_local(v, job.mesh)) for n, v in parts.items()}  # all processes' rows, for logs
    gathered = parallel.to_host(on_mesh)
    _finite_or_stop({"reward": gathered}, it + 1, job.ckpt)
    return {"reward": gathered, "parts": every, "rewards": on_mesh,
            "group_ids": parallel.global_from_local(batch.group_ids[job.local], job.mesh)}


def assign_credit(job: Job, state: TrainState, sampled: Sampled, batch: Batch, scored: dict, it: int):
    """-> (state, adv [B, T, K], keep [B] numpy): the credit chain, the curriculum's update, debug images."""
    t_cfg, credit = job.config.train, job.plan.credit
    ctx = programs_lib.credit_context(job.programs, job.world, job.mesh, job.frozen, rollout_policy(job, state), sampled.rollout,
                                      sampled.schedule, sampled.cond, sampled.null, batch.prompts_local, job.reward_fn)
    extras = credit.prepare(ctx)
    key = keys.device(job.config.seed, "null_control", it)
    adv, credit_state, keep = job.programs.credit(sampled.rollout, sampled.schedule, scored["rewards"], scored["group_ids"],
                                                  t_cfg.prompts_per_iteration, state.credit, extras, key)
    state = state.replace(credit=credit_state)
    if job.config.curriculum.enabled:
        by_group = parallel.to_host(scored["rewards"]).reshape(t_cfg.prompts_per_iteration, t_cfg.group_size)
        updated = curriculum.update(jax.tree_util.tree_map(parallel.to_host, state.curriculum), batch.drawn, by_group, job.config.curriculum)
        state = state.replace(curriculum=parallel.put_global(updated, job.programs.state_shardings.curriculum))
    if it == job.start_step or it + 1 == t_cfg.iterations:
        for stem, grid in credit.debug_images(ctx, extras).items():
            if jax.process_index() == 0:
                metrics.save_grid(path=os.path.join(job.workdir, f"{stem}_{it + 1:06d}.png"), **grid)
    return state, adv, parallel.to_host(keep)


def update(job: Job, state: TrainState, data, keep: np.ndarray, slots: np.ndarray, it: int) -> tuple[TrainState, dict, int]:
    """`num_inner_epochs` shuffled passes over the kept samples x the objective's `slots`, one optimizer step
    per minibatch; then the old policy follows. -> (state, mean stats, number of updates). The objective's
    per-minibatch `alignment` becomes `alignment_heldout` (first epoch, after its first minibatch: samples
    no update has seen) and `alignment_trained` (later epochs)."""
    t_cfg, programs, seed = job.config.train, job.programs, job.config.seed
    step_stats, aligned = [], {"alignment_heldout": [], "alignment_trained": []}
    for epoch in range(t_cfg.num_inner_epochs):
        chunks = minibatches(keep, slots, job.plan.minibatch_size, keys.host(seed, "minibatches", it, epoch))
        for i, (rows, pair_slots, weight) in enumerate(chunks):
            state, stats = programs.update(state, job.frozen, data, rows, pair_slots, weight)
            step_stats.append(stats)
            if "alignment" in stats and (epoch or i):  # the first minibatch is on-policy: no change to correlate yet
                aligned["alignment_trained" if epoch else "alignment_heldout"].append(stats["alignment"])
    state = state.replace(step=state.step + 1)
    if programs.update_old_policy is not None:
        state = programs.update_old_policy(state)
    stats = {k: np.mean([np.asarray(s[k]) for s in step_stats], 0) for k in step_stats[0] if k != "alignment"} if step_stats else {}
    stats.update({k: np.mean(np.asarray(v)) for k, v in aligned.items() if v})
    _finite_or_stop({k: v for k, v in stats.items() if k in ("loss", "kl", "grad_norm")}, it + 1, job.ckpt)
    return state, stats, len(step_stats)


def run_eval(job: Job, state: TrainState, step: int) -> dict:
    """The world's eval of the EMA policy; logged, kept in the history and printed."""
    dit_params = job.programs.policy.merged(state.ema, job.frozen["dit"])
    out = job.world.evaluate(dit_params, job.frozen, step, job.workdir)
    entry = {"step": step, "wall_s": job.history["wall_s"], **out.entry}
    job.writer.scalars(step, {**out.scalars, "wall_s": job.history["wall_s"]})
    job.history["evals"].append(entry)
    if metrics.is_writer():
        tqdm.write(out.text)
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
    """Eval, checkpoint and the stop conditions after `done` iterations; -> why the run stops, or None. The conditions of
    every process are agreed in one collective (`parallel.agree`): a signal to any one process or JAX's preemption notice
    (`parallel.preemption_noticed`), any process past the time budget or past `checkpoint.every_s` since its last save
    stop or save them all after the same iteration, each saving the same step. A signal skips the eval (the notice gives
    seconds, an eval takes minutes; the resumed run evaluates that step first: `loop`)."""
    t_cfg, history, c_cfg = job.config.train, job.history, job.config.checkpoint
    preempted = parallel.preemption_noticed(done - job.start_step)  # every process's count of iterations run, the same
    agreed = parallel.agree({"signal": stop.requested is not None, "out_of_time": bool(t_cfg.time_budget_s) and
                             history["wall_s"] - history["first_iteration_s"] >= t_cfg.time_budget_s,
                             "save_due": bool(c_cfg.get("every_s")) and time.time() - job.saved_at >= c_cfg.every_s})
    out_of_time = agreed["out_of_time"]
    signalled = (stop.requested or "a stop signal to another process") if agreed["signal"] else None
    signalled = signalled or ("a preemption notice (SIGTERM to a process of the run)" if preempted else None)
    if not signalled and itstime(done, job.config.eval.every, t_cfg.iterations, last=out_of_time):
        run_eval(job, state, done)
    if agreed["save_due"] or itstime(done, c_cfg.every, t_cfg.iterations, last=out_of_time or bool(signalled)):
        meta = {"step": done, "history": history}
        if job.reader is not None:
            meta["prompt_reader"] = job.reader.get_state()
        job.ckpt.save(done, state, meta)  # asynchronous: the loop goes on once the state is copied to host memory
        job.saved_at = time.time()
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
    sampled = rollout(job, state, batch, it)
    t1 = time.time()
    scored = score(job, sampled, batch, it)
    state, adv, keep = assign_credit(job, state, sampled, batch, scored, it)
    key = keys.device(job.config.seed, "iteration", it)
    data = programs_lib.iteration_data(job.programs, sampled.rollout, sampled.schedule, adv, sampled.cond, sampled.null, key,
                                       batch.prompts_local)
    t2 = time.time()
    diag = job.config.diagnostics
    before = jax.tree_util.tree_map(jnp.copy, state.params) if itstime(it + 1, diag.image_change_every, job.config.train.iterations) else None
    slots = job.plan.slots_at(batch.levels)
    state, stats, num_updates = update(job, state, data, keep, slots, it)
    t3 = time.time()
    job.history["wall_s"] += t3 - t0
    if before is not None:  # the same-noise change of the final latents, trained vs untrained steps (not in wall_s)
        change = job.programs.image_change(before, state.params, job.frozen, batch.ids, batch.mask, keys.device(job.config.seed, "diagnostics", it),
                                           batch.levels)
        stats.update({f"image_change/{k}": np.asarray(v) for k, v in change.items()})
    if job.history["first_iteration_s"] is None:
        job.history["first_iteration_s"] = t3 - t0
    return state, log_iteration(job, it + 1, scored, stats, keep, slots, num_updates, [t0, t1, t2, t3])


# -------------------------------------------------------------------------------------------------- run
def run(config, workdir: str | None) -> dict:
    if not workdir:
        raise ConfigError("the train job needs --workdir (checkpoints, metrics and samples go there)")
    parallel.maybe_initialize_distributed(config.distributed, config.get("distributed_timeout_s", parallel.DISTRIBUTED_TIMEOUT_S))
    with StopSignal(parallel.preemption_service_running()) as stop:  # a signal while loading or compiling stops after the
        job, state = setup(plan_lib.make_plan(config), workdir)  # first iteration
        return loop(job, state, stop)


def loop(job: Job, state: TrainState, stop: StopSignal) -> dict:
    """The iterations from `job.start_step`, an eval first on a fresh run and on a resumed one whose eval a stop skipped;
    -> `finish`'s result."""
    config = job.config
    t_cfg, start = config.train, job.start_step
    due = config.eval.at_start if start == 0 else itstime(start, config.eval.every, t_cfg.iterations)
    if due and all(e["step"] != start for e in job.history["evals"]):
        run_eval(job, state, start)
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
              "resumable": stopped is not None and stopped != "time_budget",  # main exits 75: rerun the same command
              "wall_s": history["wall_s"], "first_iteration_s": history["first_iteration_s"]}
    if history["evals"] and metrics.is_writer():
        with paths.open_file(os.path.join(job.workdir, "eval.json"), "w") as f:
            json.dump({"base": job.config.world.get("base"), "evals": history["evals"]}, f, indent=2)
        metrics.plot_report(job.workdir, os.path.join(job.workdir, "report.png"), job.world.eval_curves)
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
